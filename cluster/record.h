/*
 * record — a cluster member's record in etcd: the JSON object a daemon puts under
 * PREFIX/NODE_ID while it is a member, {"id", "endpoint", "curve_public_key",
 * "capacity", "version"}. Built and parsed here, and nowhere else. The parser
 * trusts nothing that etcd holds: anyone who can write to the prefix can write
 * anything there, so a record that is not exactly as documented is refused with
 * the reason, never half read.
 */
#ifndef KVBLEND_CLUSTER_RECORD_H
#define KVBLEND_CLUSTER_RECORD_H

#include <stddef.h>
#include <stdint.h>

#define RECORD_ENDPOINT_MAX 256 /* with its NUL, as config.h's CONFIG_ENDPOINT_MAX */
#define RECORD_KEY_LEN 40	/* a Z85 CURVE public key */

struct member_record {
	char endpoint[RECORD_ENDPOINT_MAX]; /* tcp://HOST:PORT */
	char key[RECORD_KEY_LEN + 1];	    /* the member's CURVE public key, "" for none */
	uint64_t capacity;		    /* bytes, > 0 */
	char version[64];		    /* kvblendd's version, "" when absent; informative */
};

/*
 * Is s (n bytes) an endpoint a member may have: "tcp://" and more, shorter than
 * RECORD_ENDPOINT_MAX, printable ASCII without ',' or space (member lists are comma
 * separated)?
 */
int record_endpoint_ok(const char *s, size_t n);

/*
 * Parse a member record of len bytes (need not be NUL-terminated). Required:
 * "endpoint" a string that record_endpoint_ok() accepts, "capacity" an integer
 * above 0. Optional: "curve_public_key" a string, empty or 40 Z85 characters;
 * "id" and "version" strings. Unknown fields are ignored (newer daemons may add
 * some); a known field of another type, JSON null included, is an error.
 * Returns 0 and fills *out; -EINVAL with the reason in err (errlen bytes, may be
 * 0) and *out untouched. Allocates nothing that outlives the call.
 */
int record_parse(const char *json, size_t len, struct member_record *out, char *err,
		 size_t errlen);

/*
 * The record of id as JSON text into buf (size bytes). Returns its length, or
 * -ENOSPC when it does not fit, -ENOMEM.
 */
int record_format(const char *id, const struct member_record *r, char *buf, size_t size);

#endif
