/*
 * curve — CURVE (CurveZMQ) for kvblendd's TCP endpoints: the server's key pair
 * from a file, and a ZAP handler that admits only the client public keys
 * listed in an authorized-keys file (one Z85 key a line, # comments).
 * Without that file any client that knows the server's public key may connect.
 */
#ifndef KVBLEND_DAEMON_CURVE_H
#define KVBLEND_DAEMON_CURVE_H

#include <stddef.h>

struct curve_auth;

/*
 * Read a Z85 secret key (40 characters; whitespace around it ignored) from path
 * into secret (41 bytes, NUL-terminated) and derive its public key into public
 * (41 bytes). Returns 0, or a negative errno with the reason in err.
 */
int curve_load_secret(const char *path, char *secret, char *public_key, char *err,
		      size_t errlen);

/*
 * Start the ZAP handler on zctx for the keys in authorized_path. Must run
 * before any CURVE socket binds. Returns 0 or a negative errno (err says why).
 */
int curve_auth_start(void *zctx, const char *authorized_path, struct curve_auth **out,
		     char *err, size_t errlen);
/* Stop it (before the context terminates). Accepts NULL. */
void curve_auth_stop(struct curve_auth **a);

#endif
