/*
 * curve — CURVE (CurveZMQ) for kvblendd's TCP endpoints: the server's key pair
 * from a file, and the ZAP handler that every handshake passes: it admits only
 * the client public keys listed in an authorized-keys file (one Z85 key a line,
 * # comments), when there is one, and refuses connections beyond max_clients
 * on every endpoint. Without that file any client that knows the server's
 * public key may connect.
 */
#ifndef KVBLEND_DAEMON_CURVE_H
#define KVBLEND_DAEMON_CURVE_H

#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>

struct curve_auth;

/*
 * Read a Z85 secret key (40 characters; whitespace around it ignored) from path
 * into secret (41 bytes, NUL-terminated) and derive its public key into public
 * (41 bytes). Returns 0, or a negative errno with the reason in err.
 */
int curve_load_secret(const char *path, char *secret, char *public_key, char *err,
		      size_t errlen);

/* Connections counted by the daemon (socket monitor), and the limit on them. */
struct auth_limits {
	atomic_uint_fast64_t *connections; /* live connections on every endpoint */
	uint64_t max_clients;		   /* beyond it handshakes are refused */
	atomic_uint_fast64_t *refused;	   /* counts those refused for it */
	atomic_uint_fast64_t *key_refused; /* counts CURVE keys not in authorized_path */
};

/*
 * Start the ZAP handler on zctx: it decides every handshake on sockets with a
 * ZAP domain, plain or CURVE. It refuses a handshake while more than
 * lim->max_clients connections are counted, and, when authorized_path is set
 * (non-empty), a CURVE key not in that file. Must run before any socket with a
 * ZAP domain binds. Returns 0 or a negative errno (err says why).
 */
int curve_auth_start(void *zctx, const char *authorized_path, const struct auth_limits *lim,
		     struct curve_auth **out, char *err, size_t errlen);
/* Stop it (before the context terminates). Accepts NULL. */
void curve_auth_stop(struct curve_auth **a);

#endif
