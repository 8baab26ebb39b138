/* ops/reply — the helpers every request handler shares: replies held on the client's
 * account, errors, model names and namespaces, model checks, corrupt chunks; see impl.h. */
#include "daemon/ops/impl.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/ckd.h"
#include "daemon/clients.h"
#include "cluster/cluster.h"
#include "daemon/fdguard.h"
#include "daemon/log.h"
#include "daemon/metrics.h"
#include "daemon/pool.h"
#include "blend/rope.h"

void shared_buf_unref(void *data, void *hint)
{
	struct shared_buf *b = hint;

	(void)data;
	if (atomic_fetch_sub(&b->refs, 1) != 1)
		return;
	if (b->acct) {
		clients_release(b->clients, b->acct, b->len);
		clients_put(b->clients, b->acct);
	}
	if (b->registry)
		held_remove(b->registry, &b->held);
	store_view_free(&b->view);
	free(b);
}

int fail(struct req *q, uint32_t code, const char *fmt, ...)
{
	va_list ap;

	q->out->rep.code = code;
	va_start(ap, fmt);
	vsnprintf(q->out->rep.message, sizeof(q->out->rep.message), fmt, ap);
	va_end(ap);
	return -1;
}

/*
 * A reply buffer of len bytes, held on the client's account; NULL with a reply
 * naming the limit (or memory) that refused it.
 */
struct shared_buf *reply_hold(struct req *q, size_t len, size_t data_len)
{
	struct shared_buf *b;
	int rc = 0;

	/* with the request's own bytes, as one exchange: a client that holds nothing else
	 * gets its one request and reply of any admissible size */
	if (q->acct)
		rc = clients_reserve_more(q->srv->clients, q->acct, len, q->reserved);
	if (rc == -EDQUOT) {
		fail(q, KVBP_LIMIT, "this client's requests and unread replies hold %" PRIu64
		     " bytes; a %zu-byte reply would pass client_inflight_bytes (%" PRIu64 "): "
		     "read replies first", clients_held(q->acct), len,
		     q->srv->cfg->client_inflight_bytes);
		return NULL;
	}
	if (rc) {
		fail(q, KVBP_LIMIT, "requests and unread replies of all clients hold "
		     "max_inflight_bytes (%" PRIu64 "); retry", q->srv->cfg->max_inflight_bytes);
		return NULL;
	}
	b = aligned_alloc(64, (sizeof(*b) + data_len + 63) & ~(size_t)63);
	if (!b) {
		if (q->acct)
			clients_release(q->srv->clients, q->acct, len);
		fail(q, KVBP_LIMIT, "out of memory for a %zu-byte reply", len);
		return NULL;
	}
	atomic_init(&b->refs, 1);
	b->len = len;
	b->clients = q->srv->clients;
	b->acct = q->acct;
	b->view = NULL;
	b->registry = NULL;
	memset(&b->held, 0, sizeof(b->held));
	if (b->acct)
		clients_ref(b->clients, b->acct);
	return b;
}

struct shared_buf *reply_buf(struct req *q, size_t len)
{
	return reply_hold(q, len, len);
}

static void hex(const uint8_t *h, char *out)
{
	for (int i = 0; i < KVBP_HASH_LEN; i++)
		sprintf(out + 2 * i, "%02x", h[i]);
}

/* `full`, saying which ran out: the file system under the store or its LMDB map. */
int fail_full(struct req *q, const char *what)
{
	struct store_totals t;

	if (store_totals(q->srv->store, &t) == 0 && t.disk_avail < t.map_size - t.map_used)
		return fail(q, KVBP_FULL, "%s: the file system of %s is full (%" PRIu64 " of %"
			    PRIu64 " bytes free)", what, q->srv->cfg->data_dir, t.disk_avail,
			    t.disk_size);
	return fail(q, KVBP_FULL, "%s: store full (LMDB map of %" PRIu64 " bytes)", what,
		    q->srv->cfg->map_size);
}

/* Translate a store errno into a reply; the one place store errors meet the wire. */
int fail_store(struct req *q, int rc, const char *what)
{
	switch (rc) {
	case -ENOENT:
		return fail(q, KVBP_NOT_FOUND, "%s: not found", what);
	case -ENOSPC:
		return fail_full(q, what);
	case -EBADMSG:
		return fail(q, KVBP_CORRUPT, "%s: stored data is corrupt", what);
	case -ENOTSUP:
		return fail(q, KVBP_BAD_SHAPE, "%s: a stored chunk is quantized other than one row "
			    "per token, which this read cannot take (it is sound, and kept)", what);
	case -EAGAIN:
		return fail(q, KVBP_LIMIT, "%s: too many concurrent readers; retry", what);
	case -ENOMEM:
		return fail(q, KVBP_LIMIT, "%s: out of memory", what);
	default:
		return fail(q, KVBP_INTERNAL, "%s: %s", what, strerror(-rc));
	}
}

/*
 * Namespaces (tenants.h): a tenant's model NAME is stored as "TENANT#NAME" ('#' is
 * never in a model name), the default namespace's as NAME. Chunks, pins and fuse
 * sessions hang off the model, so they are per namespace too.
 */
/*
 * Only the requests members make of each other (FETCH, REPLICATE, LOOKUP) may name
 * a stored "TENANT#NAME" as it is, and only from a member (cluster_is_member): that
 * is how a tenant's chunks travel between daemons. From anyone else a '#' would
 * reach into that tenant's namespace.
 */
static bool names_any_namespace(struct req *q)
{
	if (!(q->flags & OPF_MEMBER_NAMESPACES))
		return false;
	return cluster_is_member(q->srv->cluster, q->principal);
}

int stored_name(struct req *q, const char *name, char out[STORE_NAME_MAX + 1])
{
	size_t ns = strlen(q->ns);

	if (strchr(name, '#')) {
		if (!names_any_namespace(q))
			return fail(q, KVBP_BAD_ARGUMENT, "model name '%s' has '#', which separates "
				    "a tenant from its model names: no client may use it", name);
		snprintf(out, STORE_NAME_MAX + 1, "%s", name);
		return 0;
	}
	if (!ns) {
		snprintf(out, STORE_NAME_MAX + 1, "%s", name);
		return 0;
	}
	if (ns + 1 + strlen(name) > STORE_NAME_MAX)
		return fail(q, KVBP_BAD_ARGUMENT, "model name '%s' is too long for tenant '%s': at "
			    "most %zu characters", name, q->ns, STORE_NAME_MAX - ns - 1);
	memcpy(out, q->ns, ns);
	out[ns] = '#';
	memcpy(out + ns + 1, name, strlen(name) + 1); /* fits: checked above */
	return 0;
}

/* The client's name of a stored model of its namespace; NULL for another namespace's. */
const char *client_name(const struct req *q, const char *stored)
{
	const char *sep = strchr(stored, '#');
	size_t ns = strlen(q->ns);

	if (!ns)
		return sep ? NULL : stored;
	return sep && (size_t)(sep - stored) == ns && !strncmp(stored, q->ns, ns) ? sep + 1 : NULL;
}

/*
 * Model name (as stored) registered on another member: its description from the
 * members (cluster_model_find), registered here. 0 with *m, -ENOENT when no member
 * has it, -EINVAL when the request failed already, or the store's error.
 */
int model_from_members(struct req *q, const char *name, struct store_model *m)
{
	struct kvbp_model w;
	int rc = cluster_model_find(q->srv->cluster, name, &w);

	if (rc)
		return -ENOENT;
	snprintf(w.name, sizeof(w.name), "%s", q->h.model_name); /* checked as the client names it */
	if (model_check(q, &w))
		return -EINVAL;
	model_to_store(&w, m);
	snprintf(m->name, sizeof(m->name), "%s", name);
	rc = store_model_register(q->srv->store, m);
	if (rc == -EEXIST) /* registered here meanwhile, differently: that one stands */
		return store_model_find(q->srv->store, name, m);
	if (rc >= 0)
		log_info("model '%s' registered from another member's description", name);
	return rc < 0 ? rc : 0;
}

int need_model(struct req *q, struct store_model *m)
{
	char name[STORE_NAME_MAX + 1];
	int rc;

	if (!q->h.model_name[0])
		return fail(q, KVBP_BAD_ARGUMENT, "%s needs a model name", kvbp_op_name(q->h.op));
	if (stored_name(q, q->h.model_name, name))
		return -1;
	rc = store_model_find(q->srv->store, name, m);
	if (rc == -ENOENT && q->srv->cluster && !q->h.local_only)
		rc = model_from_members(q, name, m);
	if (rc == -ENOENT)
		return fail(q, KVBP_UNKNOWN_MODEL, "unknown model '%s'", q->h.model_name);
	if (rc == -EINVAL)
		return -1; /* (failed already) */
	if (rc)
		return fail_store(q, rc, "model lookup");
	return 0;
}

int need_hash(struct req *q)
{
	if (!q->h.has_hash)
		return fail(q, KVBP_BAD_ARGUMENT, "%s needs a 32-byte chunk hash",
			    kvbp_op_name(q->h.op));
	return 0;
}

int no_payload(struct req *q)
{
	if (q->n_payload || q->h.payload_frames)
		return fail(q, KVBP_BAD_FRAMES, "%s takes no payload frames; got %zu",
			    kvbp_op_name(q->h.op), q->n_payload);
	return 0;
}

void model_from_store(const struct store_model *s, struct kvbp_model *m)
{
	memset(m, 0, sizeof(*m));
	snprintf(m->name, sizeof(m->name), "%s", s->name);
	m->desc = s->desc;
}

void model_to_store(const struct kvbp_model *m, struct store_model *s)
{
	memset(s, 0, sizeof(*s));
	snprintf(s->name, sizeof(s->name), "%s", m->name);
	s->desc = m->desc;
}

/*
 * Check a model description and fill in the defaults, so equal models compare equal:
 * the layout against the daemon's limits, the storage here, the RoPE configuration by
 * the blend's own rules (rope_config_check), the ones every fuse is computed under.
 */
int model_check(struct req *q, struct kvbp_model *m)
{
	const struct config *c = q->srv->cfg;
	struct kvb_model_desc *d = &m->desc;
	struct rope_config rc;
	char why[160];

	for (const char *p = m->name; *p; p++)
		if (!isalnum((unsigned char)*p) && !strchr("._-:/@+", *p))
			return fail(q, KVBP_BAD_ARGUMENT, "model name '%s' has character 0x%02x; "
				    "allowed are letters, digits and ._-:/@+", m->name,
				    (unsigned char)*p);
	if (!m->name[0])
		return fail(q, KVBP_BAD_ARGUMENT, "model name is empty");
	if (d->num_layers < 1 || d->num_layers > c->max_layers)
		return fail(q, KVBP_BAD_SHAPE, "num_layers %" PRIu32 " out of range 1..%" PRIu64,
			    d->num_layers, c->max_layers);
	if (d->num_kv_heads < 1 || d->num_kv_heads > c->max_kv_heads)
		return fail(q, KVBP_BAD_SHAPE, "num_kv_heads %" PRIu32 " out of range 1..%" PRIu64,
			    d->num_kv_heads, c->max_kv_heads);
	if (d->head_dim < 2 || d->head_dim > c->max_head_dim || d->head_dim % 2)
		return fail(q, KVBP_BAD_SHAPE, "head_dim %" PRIu32 " must be even and in 2..%" PRIu64,
			    d->head_dim, c->max_head_dim);
	if (!kvbp_dtype_size(d->dtype))
		return fail(q, KVBP_BAD_ARGUMENT, "dtype %" PRIu32 " unknown; expected f16, bf16 "
			    "or f32", d->dtype);
	if (d->store_codec > 3)
		return fail(q, KVBP_BAD_ARGUMENT, "store codec %" PRIu32 " unknown; expected 0 "
			    "(the model's dtype), 1 fp8, 2 int8 or 3 int4", d->store_codec);
	if (d->store_codec == 3 && d->store_group == 0)
		d->store_group = 32; /* the default int4 group */
	if (d->store_codec != 3 && d->store_group)
		return fail(q, KVBP_BAD_ARGUMENT, "store_group %" PRIu32 " is for int4 only",
			    d->store_group);
	if (d->store_group > 1024)
		return fail(q, KVBP_BAD_ARGUMENT, "int4 group %" PRIu32 " out of range 1..1024",
			    d->store_group);
	if (d->rotary_dim == 0)
		d->rotary_dim = d->head_dim;
	if (d->scaling == ROPE_SCALING_YARN && d->beta_fast == 0 && d->beta_slow == 0) {
		d->beta_fast = 32; /* YaRN's defaults (HF transformers) */
		d->beta_slow = 1;
	}
	rope_config_from_desc(d, false, &rc);
	if (rope_config_check(&rc, why, sizeof(why)))
		return fail(q, KVBP_BAD_ARGUMENT, "%s", why);
	if (!d->full_every && d->rope_local_theta == 0)
		return 0;
	if (!isfinite(d->rope_local_theta) || d->rope_local_theta <= 0)
		return fail(q, KVBP_BAD_ARGUMENT, "rope_local_theta must be a positive number "
			    "with full_every %" PRIu32, d->full_every);
	if (d->full_every < 2 || d->full_every > d->num_layers)
		return fail(q, KVBP_BAD_ARGUMENT, "full_every %" PRIu32 " out of range 2..%" PRIu32
			    " (num_layers) with rope_local_theta %g", d->full_every,
			    d->num_layers, d->rope_local_theta);
	return 0;
}

void chunk_out(struct kvbp_chunk *c, const uint8_t *hash, bool found,
		      const struct store_chunk_info *ci)
{
	memcpy(c->hash, hash, KVBP_HASH_LEN);
	c->found = found;
	c->num_tokens = ci->num_tokens;
	c->base_pos = ci->base_pos;
	c->num_layers = ci->num_layers;
	c->raw_bytes = ci->raw_bytes;
	c->stored_bytes = ci->stored_bytes;
}

int one_chunk_reply(struct req *q, const uint8_t *hash, const struct store_chunk_info *ci)
{
	q->out->rep.chunks = calloc(1, sizeof(struct kvbp_chunk));
	if (!q->out->rep.chunks)
		return fail(q, KVBP_LIMIT, "out of memory");
	q->out->rep.n_chunks = 1;
	chunk_out(q->out->rep.chunks, hash, true, ci);
	return 0;
}

/* Bytes of K and V for `layers` layers of a chunk, or a reply naming the problem. */
/* Whether a local miss of this request may ask other members. */
bool cluster_wanted(const struct req *q)
{
	return q->srv->cluster && !q->h.local_only;
}

int chunk_bytes(struct req *q, const struct store_model *m, uint32_t tokens,
		       uint32_t layers, uint64_t *tensor_bytes, uint64_t *total)
{
	const struct config *c = q->srv->cfg;
	uint64_t tb, t;

	if (tokens == 0)
		return fail(q, KVBP_BAD_SHAPE, "num_tokens is 0");
	if (tokens > c->max_tokens)
		return fail(q, KVBP_BAD_SHAPE, "num_tokens %" PRIu32 " exceeds max_tokens %" PRIu64,
			    tokens, c->max_tokens);
	tb = store_tensor_bytes(m, tokens);
	if (!tb || ckd_mul(&t, tb, 2 * (uint64_t)layers))
		return fail(q, KVBP_BAD_SHAPE, "chunk size overflows: %" PRIu32 " tokens x %" PRIu32
			    " heads x %" PRIu32 " dims x %" PRIu32 " layers", tokens,
			    m->desc.num_kv_heads, m->desc.head_dim, layers);
	if (t > c->max_message)
		return fail(q, KVBP_TOO_LARGE, "chunk payload of %" PRIu64 " bytes exceeds "
			    "max_message %" PRIu64, t, c->max_message);
	*tensor_bytes = tb;
	*total = t;
	return 0;
}

void drop_corrupt(struct server *srv, const struct store_model *m,
			 const uint8_t hash[KVBP_HASH_LEN], char h[2 * KVBP_HASH_LEN + 1])
{
	int rc;

	hex(hash, h);
	log_err("chunk %s of model '%s' failed its checksum; removing it", h, m->name);
	rc = fuse_delete_chunk(srv->fuse, m, hash);
	if (rc == 0)
		atomic_fetch_add(&srv->stats.corrupt_removed, 1);
	else if (rc == -EBUSY)
		log_warn("chunk %s stays while an open fuse session pins it; the next read "
			 "that finds it, or the scrub, removes it", h);
}

void remove_corrupt(struct req *q, const struct store_model *m)
{
	char h[2 * KVBP_HASH_LEN + 1];

	drop_corrupt(q->srv, m, q->h.hash, h);
	fail(q, KVBP_CORRUPT, "chunk %s failed its checksum and was removed; treat it as a miss",
	     h);
}

void ops_chunk_corrupt(void *arg, uint32_t model_id, const uint8_t *hash)
{
	struct server *srv = arg;
	char h[2 * KVBP_HASH_LEN + 1];
	struct store_model m;

	if (store_model_by_id(srv->store, model_id, &m)) {
		hex(hash, h);
		log_err("chunk %s of model id %" PRIu32 " failed its checksum and its model "
			"cannot be read; left in place", h, model_id);
		return;
	}
	drop_corrupt(srv, &m, hash, h);
}

