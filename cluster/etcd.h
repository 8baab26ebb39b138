/*
 * etcd — the few etcd v3 calls cluster membership needs, over etcd's JSON
 * gateway (POST /v3/...), with libcurl (its TLS: OpenSSL) and json-c.
 *
 * Keys and values are byte strings (base64 on the wire); lease ids and
 * revisions are int64 (decimal strings on the wire). endpoints is a comma
 * list of http://HOST:PORT or https://HOST:PORT; a call that cannot reach one
 * tries the next. https:// verifies etcd's certificate (against ca_file, else
 * the system's CAs) and its host name, and shows a client certificate when
 * given one. With a user, every call carries the token /v3/auth/authenticate
 * gave; a token etcd no longer takes (expired, etcd restarted) is replaced by
 * authenticating again, and the call retried once.
 *
 * One struct etcd is used by one thread at a time (it holds one curl handle);
 * a daemon opens one per thread that talks to etcd. Errors are negative errno:
 * -ECONNREFUSED (no endpoint answered), -ETIMEDOUT, -EPROTO (TLS failed: the
 * server's certificate not trusted, ours refused; or an answer that is not the
 * gateway's JSON), -EACCES (authentication failed, or no permission on a key),
 * -ENOENT (a lease that is gone), -ECANCELED (stopped).
 */
#ifndef KVBLEND_CLUSTER_ETCD_H
#define KVBLEND_CLUSTER_ETCD_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct etcd;

/* Once per process, before any thread uses etcd (curl_global_init). */
int etcd_global_init(void);

/* How to reach etcd; the strings are copied by etcd_new. */
struct etcd_opts {
	int timeout_ms;		/* bounds each unary call */
	const char *ca_file;	/* PEM CAs etcd's certificate must chain to; NULL/"": system's */
	const char *cert_file;	/* PEM client certificate; NULL/"": none (then no key_file) */
	const char *key_file;	/* its PEM private key */
	const char *user;	/* etcd user; NULL/"": no authentication */
	const char *password;	/* its password (with a user) */
};

/*
 * endpoints: "http[s]://HOST:PORT[,...]". Returns 0, or -EINVAL with err
 * naming the bad endpoint or option: a TLS file with an http:// endpoint, a
 * certificate without its key (or a key alone), a file that cannot be read, a
 * user without a password.
 */
int etcd_new(const char *endpoints, const struct etcd_opts *o, struct etcd **out, char *err,
	     size_t errlen);
void etcd_free(struct etcd **e);

/* The endpoint of the last call, and its error text when it failed. */
const char *etcd_endpoint(const struct etcd *e);
const char *etcd_error(const struct etcd *e);

/*
 * One read of prefix (a count), authenticating first with a user: whether
 * etcd can be reached, trusted and used with these settings. Returns 0 or a
 * call's errors (etcd_error says which endpoint and why).
 */
int etcd_probe(struct etcd *e, const char *prefix);

int etcd_lease_grant(struct etcd *e, int64_t ttl_s, int64_t *id);
/* Renew lease id; *ttl_s is what is left. -ENOENT when the lease is gone. */
int etcd_lease_keepalive(struct etcd *e, int64_t id, int64_t *ttl_s);
int etcd_lease_revoke(struct etcd *e, int64_t id);

/* Put key = val (vlen bytes), attached to lease (0 for none). */
int etcd_put(struct etcd *e, const char *key, const void *val, size_t vlen, int64_t lease);

/*
 * Every key under prefix: fn(ctx, key, val, vlen) for each (val NUL-terminated
 * too); *revision the store's revision of that read. Returns 0, fn's non-zero
 * return, or a negative errno.
 */
int etcd_range_prefix(struct etcd *e, const char *prefix,
		      int (*fn)(void *ctx, const char *key, const char *val, size_t vlen),
		      void *ctx, int64_t *revision);

/*
 * Watch prefix from revision start on: fn(ctx, put, key, val, vlen, rev) for
 * every event (put false: the key was deleted, val NULL). Blocks until the
 * stream ends or breaks (a negative errno), fn returns non-zero, or *stop is
 * set (-ECANCELED, noticed within about a second). -ESTALE: start was
 * compacted away; read the prefix again.
 */
int etcd_watch_prefix(struct etcd *e, const char *prefix, int64_t start,
		      int (*fn)(void *ctx, bool put, const char *key, const char *val, size_t vlen,
				int64_t rev),
		      void *ctx, const atomic_bool *stop);

/* base64 (RFC 4648, with padding). out has room for 4 * ((n + 2) / 3) + 1. */
void etcd_b64_encode(const void *in, size_t n, char *out);
/* Returns the decoded length, or -1 for bad input; out has room for 3 * (strlen / 4) + 1. */
long etcd_b64_decode(const char *in, uint8_t *out);

#endif
