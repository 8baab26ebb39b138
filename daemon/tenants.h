/*
 * tenants — which namespace a client's chunks live in. A namespace is bound to
 * the client's identity as the transport gives it: its Unix user or primary
 * group on IPC, its CURVE public key on TCP. The daemon reads the bindings from
 * a file (tenants_file), one tenant a line:
 *
 *     NAME MATCH [MATCH ...] [capacity=SIZE]      MATCH: uid=N | gid=N | key=Z85KEY
 *
 * ('#' starts a comment). A client matching no line, and every client when there
 * is no file, is in the default namespace, so a single-tenant node changes
 * nothing. The first matching line wins. Models, and so chunks, pins and fuse
 * sessions, are per namespace: a tenant neither sees, overwrites, deletes nor
 * unpins another's. A tenant with a capacity owns that many bytes of the cache:
 * while it stays within them, no other namespace's PUTs evict its chunks, and
 * above them its own least recently used chunks go (evict.h).
 */
#ifndef KVBLEND_DAEMON_TENANTS_H
#define KVBLEND_DAEMON_TENANTS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* Longest tenant name (letters, digits, '.', '_', '-'), NUL not included. */
#define TENANT_NAME_MAX 16

struct tenants;

/*
 * Read the bindings from path (NULL or "": none). Returns 0, or a negative errno
 * with err naming the file, the line and the problem.
 */
int tenants_load(const char *path, struct tenants **out, char *err, size_t errlen);
/* Accepts NULL. */
void tenants_free(struct tenants **t);

/* The namespace of a client principal (server.c principal_of): a tenant name, or "". */
const char *tenants_of(const struct tenants *t, const char *principal);

/* The capacity= of tenant ns in bytes; 0 when it has none (and for the default ""). */
uint64_t tenants_capacity(const struct tenants *t, const char *ns);

/* Has any tenant a capacity? */
bool tenants_quota_any(const struct tenants *t);

/* How many tenants are bound. */
size_t tenants_count(const struct tenants *t);

#endif
