/* ops — request handlers of kvblendd; see ops.h. */
#include "ops.h"

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

#include "clients.h"
#include "cluster.h"
#include "cuda/cuda.h"
#include "fdguard.h"
#include "log.h"
#include "metrics.h"
#include "pool.h"
#include "rope.h"

#ifndef KVBLEND_VERSION
#define KVBLEND_VERSION "0.0.0"
#endif

struct req {
	struct server *srv;
	const char *principal; /* who asks: owner of what it creates */
	const char *ns;	       /* its namespace: "" the default, else a tenant */
	struct client_acct *acct; /* its byte account (NULL in tests of ops alone) */
	struct kvbp_request h;
	zmq_msg_t *payload;
	size_t n_payload;
	struct reply_out *out;
};

/*
 * A reply payload buffer shared by several frames, freed when ZeroMQ drops the last;
 * its bytes are held on the client's account until then (an unread reply counts).
 * Or, with view set, no buffer: the frames point into the store's map through the
 * view, which ends when ZeroMQ drops the last (zero-copy GET).
 */
struct shared_buf {
	atomic_int refs;
	size_t len;
	struct clients *clients;
	struct client_acct *acct;
	struct store_view *view;
	_Alignas(64) uint8_t data[];
};

static void shared_buf_unref(void *data, void *hint)
{
	struct shared_buf *b = hint;

	(void)data;
	if (atomic_fetch_sub(&b->refs, 1) != 1)
		return;
	if (b->acct) {
		clients_release(b->clients, b->acct, b->len);
		clients_put(b->clients, b->acct);
	}
	store_view_free(&b->view);
	free(b);
}

__attribute__((format(printf, 3, 4))) static int fail(struct req *q, uint32_t code,
						      const char *fmt, ...)
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
static struct shared_buf *reply_hold(struct req *q, size_t len, size_t data_len)
{
	struct shared_buf *b;
	int rc = 0;

	if (q->acct)
		rc = clients_reserve(q->srv->clients, q->acct, len);
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
	if (b->acct)
		clients_ref(b->clients, b->acct);
	return b;
}

static struct shared_buf *reply_buf(struct req *q, size_t len)
{
	return reply_hold(q, len, len);
}

static void hex(const uint8_t *h, char *out)
{
	for (int i = 0; i < KVBP_HASH_LEN; i++)
		sprintf(out + 2 * i, "%02x", h[i]);
}

/* `full`, saying which ran out: the file system under the store or its LMDB map. */
static int fail_full(struct req *q, const char *what)
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
static int fail_store(struct req *q, int rc, const char *what)
{
	switch (rc) {
	case -ENOENT:
		return fail(q, KVBP_NOT_FOUND, "%s: not found", what);
	case -ENOSPC:
		return fail_full(q, what);
	case -EBADMSG:
		return fail(q, KVBP_CORRUPT, "%s: stored data is corrupt", what);
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
static int stored_name(struct req *q, const char *name, char out[STORE_NAME_MAX + 1])
{
	size_t ns = strlen(q->ns);

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
static const char *client_name(const struct req *q, const char *stored)
{
	const char *sep = strchr(stored, '#');
	size_t ns = strlen(q->ns);

	if (!ns)
		return sep ? NULL : stored;
	return sep && (size_t)(sep - stored) == ns && !strncmp(stored, q->ns, ns) ? sep + 1 : NULL;
}

static int need_model(struct req *q, struct store_model *m)
{
	char name[STORE_NAME_MAX + 1];
	int rc;

	if (!q->h.model_name[0])
		return fail(q, KVBP_BAD_ARGUMENT, "%s needs a model name", kvbp_op_name(q->h.op));
	if (stored_name(q, q->h.model_name, name))
		return -1;
	rc = store_model_find(q->srv->store, name, m);
	if (rc == -ENOENT)
		return fail(q, KVBP_UNKNOWN_MODEL, "unknown model '%s'", q->h.model_name);
	if (rc)
		return fail_store(q, rc, "model lookup");
	return 0;
}

static int need_hash(struct req *q)
{
	if (!q->h.has_hash)
		return fail(q, KVBP_BAD_ARGUMENT, "%s needs a 32-byte chunk hash",
			    kvbp_op_name(q->h.op));
	return 0;
}

static int no_payload(struct req *q)
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
	m->num_layers = s->num_layers;
	m->num_kv_heads = s->num_kv_heads;
	m->head_dim = s->head_dim;
	m->dtype = s->dtype;
	m->rope_theta = s->rope_theta;
	m->rope_style = s->rope_style;
	m->rotary_dim = s->rotary_dim;
	m->scaling = s->scaling;
	m->factor = s->factor;
	m->low_freq_factor = s->low_freq_factor;
	m->high_freq_factor = s->high_freq_factor;
	m->original_max_pos = s->original_max_pos;
	m->beta_fast = s->beta_fast;
	m->beta_slow = s->beta_slow;
	m->max_pos = s->max_pos;
	m->k_pre_rope = s->k_pre_rope;
	m->store_codec = s->store_codec;
	m->store_group = s->store_group;
}

static void model_to_store(const struct kvbp_model *m, struct store_model *s)
{
	memset(s, 0, sizeof(*s));
	snprintf(s->name, sizeof(s->name), "%s", m->name);
	s->num_layers = m->num_layers;
	s->num_kv_heads = m->num_kv_heads;
	s->head_dim = m->head_dim;
	s->dtype = m->dtype;
	s->rope_theta = m->rope_theta;
	s->rope_style = m->rope_style;
	s->rotary_dim = m->rotary_dim;
	s->scaling = m->scaling;
	s->factor = m->factor;
	s->low_freq_factor = m->low_freq_factor;
	s->high_freq_factor = m->high_freq_factor;
	s->original_max_pos = m->original_max_pos;
	s->beta_fast = m->beta_fast;
	s->beta_slow = m->beta_slow;
	s->max_pos = m->max_pos;
	s->k_pre_rope = m->k_pre_rope;
	s->store_codec = m->store_codec;
	s->store_group = m->store_group;
}

static bool positive(double x)
{
	return isfinite(x) && x > 0;
}

/* Check a model description and fill in the defaults, so equal models compare equal. */
static int model_check(struct req *q, struct kvbp_model *m)
{
	const struct config *c = q->srv->cfg;

	for (const char *p = m->name; *p; p++)
		if (!isalnum((unsigned char)*p) && !strchr("._-:/@+", *p))
			return fail(q, KVBP_BAD_ARGUMENT, "model name '%s' has character 0x%02x; "
				    "allowed are letters, digits and ._-:/@+", m->name,
				    (unsigned char)*p);
	if (!m->name[0])
		return fail(q, KVBP_BAD_ARGUMENT, "model name is empty");
	if (m->num_layers < 1 || m->num_layers > c->max_layers)
		return fail(q, KVBP_BAD_SHAPE, "num_layers %" PRIu32 " out of range 1..%" PRIu64,
			    m->num_layers, c->max_layers);
	if (m->num_kv_heads < 1 || m->num_kv_heads > c->max_kv_heads)
		return fail(q, KVBP_BAD_SHAPE, "num_kv_heads %" PRIu32 " out of range 1..%" PRIu64,
			    m->num_kv_heads, c->max_kv_heads);
	if (m->head_dim < 2 || m->head_dim > c->max_head_dim || m->head_dim % 2)
		return fail(q, KVBP_BAD_SHAPE, "head_dim %" PRIu32 " must be even and in 2..%" PRIu64,
			    m->head_dim, c->max_head_dim);
	if (!kvbp_dtype_size(m->dtype))
		return fail(q, KVBP_BAD_ARGUMENT, "dtype %" PRIu32 " unknown; expected f16, bf16 "
			    "or f32", m->dtype);
	if (!positive(m->rope_theta))
		return fail(q, KVBP_BAD_ARGUMENT, "rope_theta must be a positive number");
	if (m->rope_style > 1)
		return fail(q, KVBP_BAD_ARGUMENT, "rope_style %" PRIu32 " unknown; expected neox "
			    "or gptj", m->rope_style);
	if (m->store_codec > 3)
		return fail(q, KVBP_BAD_ARGUMENT, "store codec %" PRIu32 " unknown; expected 0 "
			    "(the model's dtype), 1 fp8, 2 int8 or 3 int4", m->store_codec);
	if (m->store_codec == 3 && m->store_group == 0)
		m->store_group = 32; /* the default int4 group */
	if (m->store_codec != 3 && m->store_group)
		return fail(q, KVBP_BAD_ARGUMENT, "store_group %" PRIu32 " is for int4 only",
			    m->store_group);
	if (m->store_group > 1024)
		return fail(q, KVBP_BAD_ARGUMENT, "int4 group %" PRIu32 " out of range 1..1024",
			    m->store_group);
	if (m->rotary_dim == 0)
		m->rotary_dim = m->head_dim;
	if (m->rotary_dim > m->head_dim || m->rotary_dim % 2)
		return fail(q, KVBP_BAD_ARGUMENT, "rotary_dim %" PRIu32 " must be even and at most "
			    "head_dim %" PRIu32, m->rotary_dim, m->head_dim);
	switch (m->scaling) {
	case 0:
		break;
	case 1:
		if (!positive(m->factor))
			return fail(q, KVBP_BAD_ARGUMENT, "linear rope scaling needs factor > 0");
		break;
	case 2:
		if (!positive(m->factor) || !positive(m->low_freq_factor) ||
		    !(m->high_freq_factor > m->low_freq_factor) || !isfinite(m->high_freq_factor) ||
		    !m->original_max_pos)
			return fail(q, KVBP_BAD_ARGUMENT, "llama3 rope scaling needs factor > 0, "
				    "0 < low_freq_factor < high_freq_factor, original_max_pos > 0");
		break;
	case 3:
		if (m->beta_fast == 0 && m->beta_slow == 0) {
			m->beta_fast = 32;
			m->beta_slow = 1;
		}
		if (!positive(m->factor) || !m->original_max_pos || !positive(m->beta_slow) ||
		    !(m->beta_fast > m->beta_slow) || !isfinite(m->beta_fast))
			return fail(q, KVBP_BAD_ARGUMENT, "yarn rope scaling needs factor > 0, "
				    "original_max_pos > 0, beta_fast > beta_slow > 0");
		break;
	case 4:
		if (!positive(m->factor) || !m->max_pos)
			return fail(q, KVBP_BAD_ARGUMENT, "dynamic rope scaling needs factor > 0 and "
				    "max_pos > 0");
		break;
	default:
		return fail(q, KVBP_BAD_ARGUMENT, "rope scaling %" PRIu32 " unknown", m->scaling);
	}
	return 0;
}

static void op_hello(struct req *q)
{
	if (no_payload(q))
		return;
	snprintf(q->out->rep.server_version, sizeof(q->out->rep.server_version), "%s",
		 KVBLEND_VERSION);
	if (q->h.local_only) { /* another member's heartbeat: what this store holds */
		struct store_totals t;

		if (!store_totals(q->srv->store, &t)) {
			struct kvbp_stat *st = calloc(2, sizeof(*st));

			if (st) {
				snprintf(st[0].name, sizeof(st[0].name), "chunks");
				st[0].value = (double)t.chunks;
				snprintf(st[1].name, sizeof(st[1].name), "stored_bytes");
				st[1].value = (double)t.stored_bytes;
				q->out->rep.stats = st;
				q->out->rep.n_stats = 2;
			}
		}
	}
}

static void op_model_register(struct req *q)
{
	struct store_model sm;
	int rc;

	if (no_payload(q))
		return;
	if (!q->h.has_model) {
		fail(q, KVBP_BAD_ARGUMENT, "model_register needs a model");
		return;
	}
	if (model_check(q, &q->h.model))
		return;
	model_to_store(&q->h.model, &sm);
	if (stored_name(q, q->h.model.name, sm.name))
		return;
	rc = store_model_register(q->srv->store, &sm);
	if (rc == -EEXIST) {
		fail(q, KVBP_MODEL_CONFLICT, "model '%s' exists with a different layout or RoPE "
		     "configuration", q->h.model.name);
		return;
	}
	if (rc < 0) {
		fail_store(q, rc, "model_register");
		return;
	}
	q->out->rep.existed = rc == 1;
	q->out->rep.models = calloc(1, sizeof(struct kvbp_model));
	if (!q->out->rep.models) {
		fail(q, KVBP_LIMIT, "out of memory");
		return;
	}
	model_from_store(&sm, q->out->rep.models);
	snprintf(q->out->rep.models->name, sizeof(q->out->rep.models->name), "%s",
		 q->h.model.name);
	q->out->rep.n_models = 1;
	if (rc == 0)
		log_info("model '%s' registered: %u layers, %u kv heads, head_dim %u, %s", sm.name,
			 sm.num_layers, sm.num_kv_heads, sm.head_dim, kvbp_dtype_name(sm.dtype));
}

static void op_model_list(struct req *q)
{
	struct store_model *ms = NULL;
	size_t n = 0;
	int rc;

	if (no_payload(q))
		return;
	rc = store_model_list(q->srv->store, &ms, &n);
	if (rc) {
		fail_store(q, rc, "model_list");
		return;
	}
	if (n) {
		q->out->rep.models = calloc(n, sizeof(struct kvbp_model));
		if (!q->out->rep.models) {
			free(ms);
			fail(q, KVBP_LIMIT, "out of memory");
			return;
		}
		for (size_t i = 0; i < n; i++) {
			const char *name = client_name(q, ms[i].name);
			struct kvbp_model *m = &q->out->rep.models[q->out->rep.n_models];

			if (!name) /* another namespace's */
				continue;
			model_from_store(&ms[i], m);
			snprintf(m->name, sizeof(m->name), "%s", name);
			q->out->rep.n_models++;
		}
	}
	free(ms);
}

static void chunk_out(struct kvbp_chunk *c, const uint8_t *hash, bool found,
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

static int one_chunk_reply(struct req *q, const uint8_t *hash, const struct store_chunk_info *ci)
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
static bool cluster_wanted(const struct req *q)
{
	return q->srv->cluster && !q->h.local_only;
}

static int chunk_bytes(struct req *q, const struct store_model *m, uint32_t tokens,
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
	if (!tb || __builtin_mul_overflow(tb, 2 * (uint64_t)layers, &t))
		return fail(q, KVBP_BAD_SHAPE, "chunk size overflows: %" PRIu32 " tokens x %" PRIu32
			    " heads x %" PRIu32 " dims x %" PRIu32 " layers", tokens,
			    m->num_kv_heads, m->head_dim, layers);
	if (t > c->max_message)
		return fail(q, KVBP_TOO_LARGE, "chunk payload of %" PRIu64 " bytes exceeds "
			    "max_message %" PRIu64, t, c->max_message);
	*tensor_bytes = tb;
	*total = t;
	return 0;
}

static void remove_corrupt(struct req *q, const struct store_model *m)
{
	char h[2 * KVBP_HASH_LEN + 1];

	hex(q->h.hash, h);
	log_err("chunk %s of model '%s' failed its checksum; removing it", h, m->name);
	if (fuse_delete_chunk(q->srv->fuse, m, q->h.hash) == 0)
		atomic_fetch_add(&q->srv->stats.corrupt_removed, 1);
	fail(q, KVBP_CORRUPT, "chunk %s failed its checksum and was removed; treat it as a miss",
	     h);
}

static void op_put(struct req *q)
{
	struct store_model m;
	struct store_chunk_info ci;
	const void **tensors = NULL;
	uint8_t *snapshot = NULL;
	uint64_t tb, total;
	void *shm = NULL;
	int rc;

	if (need_model(q, &m) || need_hash(q))
		return;
	if (q->h.dtype && q->h.dtype != m.dtype) {
		fail(q, KVBP_DTYPE_MISMATCH, "payload dtype %s does not match model '%s' dtype %s",
		     kvbp_dtype_name(q->h.dtype), q->h.model_name, kvbp_dtype_name(m.dtype));
		return;
	}
	if (chunk_bytes(q, &m, q->h.num_tokens, m.num_layers, &tb, &total))
		return;
	if (q->h.payload_frames != q->n_payload) {
		fail(q, KVBP_BAD_FRAMES, "header declares %" PRIu32 " payload frames; the message "
		     "has %zu", q->h.payload_frames, q->n_payload);
		return;
	}
	tensors = calloc(2 * (size_t)m.num_layers, sizeof(*tensors));
	if (!tensors) {
		fail(q, KVBP_LIMIT, "out of memory");
		return;
	}
	if (q->h.has_shm) {
		if (q->n_payload) {
			fail(q, KVBP_BAD_FRAMES, "put with a shared-memory payload takes no payload "
			     "frames; got %zu", q->n_payload);
			goto out;
		}
		if (q->h.shm_length != total) {
			fail(q, KVBP_BAD_SHAPE, "shared-memory payload is %" PRIu64 " bytes; expected "
			     "%" PRIu64, q->h.shm_length, total);
			goto out;
		}
		rc = shm_acquire(q->srv->shm, q->h.shm_id, q->principal, q->h.shm_offset, total,
				 &shm);
		if (rc) {
			fail(q, KVBP_BAD_SHM, "shared-memory segment %" PRIu64 ": %s", q->h.shm_id,
			     rc == -ENOENT ? "unknown, expired or not this client's"
					   : "span outside the segment");
			goto out;
		}
		/*
		 * The client can write its segment while we read it: checksum and store one
		 * snapshot, so that what is acknowledged reads back whole. (A copy at memory
		 * speed; the PUT itself runs at disk speed.)
		 */
		snapshot = malloc(total ? total : 1);
		if (!snapshot) {
			fail(q, KVBP_LIMIT, "out of memory for a %" PRIu64 "-byte PUT", total);
			goto out;
		}
		memcpy(snapshot, shm, total);
		shm_release(q->srv->shm, q->h.shm_id);
		shm = NULL;
		for (size_t i = 0; i < 2 * (size_t)m.num_layers; i++)
			tensors[i] = snapshot + i * tb;
	} else {
		if (q->n_payload != 2 * (size_t)m.num_layers) {
			fail(q, KVBP_BAD_FRAMES, "put for a %" PRIu32 "-layer model needs %" PRIu32
			     " payload frames (K and V per layer); got %zu", m.num_layers,
			     2 * m.num_layers, q->n_payload);
			goto out;
		}
		for (size_t i = 0; i < q->n_payload; i++) {
			size_t sz = zmq_msg_size(&q->payload[i]);

			if (sz != tb) {
				fail(q, KVBP_BAD_SHAPE, "payload frame %zu is %zu bytes; expected %"
				     PRIu64 " (%" PRIu32 " tokens x %" PRIu32 " heads x %" PRIu32
				     " dims x %" PRIu32 " bytes)", i + 1, sz, tb, q->h.num_tokens,
				     m.num_kv_heads, m.head_dim, m.elem_size);
				goto out;
			}
			tensors[i] = zmq_msg_data(&q->payload[i]);
		}
	}
	rc = store_chunk_put(q->srv->store, &m, q->h.hash, q->h.num_tokens, q->h.base_pos,
			     tensors, &ci);
	/* A full map: evict least recently used chunks and retry, a few times. */
	for (int tries = 0; rc == -ENOSPC && tries < 3; tries++) {
		int64_t freed = evictor_make_room(q->srv->evict, 2 * total + (1u << 20), q->ns);

		if (freed < 0) {
			fail_full(q, "put: cache full and nothing can be evicted (every chunk is "
				  "pinned or in use)");
			goto out;
		}
		rc = store_chunk_put(q->srv->store, &m, q->h.hash, q->h.num_tokens, q->h.base_pos,
				     tensors, &ci);
	}
	if (rc < 0) {
		fail_store(q, rc, "put");
		goto out;
	}
	evictor_touch(q->srv->evict, m.id, q->h.hash);
	if (rc == 0)
		evictor_kick(q->srv->evict);
	if (rc == 0 && q->srv->cluster)
		cluster_stored(q->srv->cluster, &m, q->h.hash); /* to its other owners */
	q->out->rep.existed = rc == 1;
	if (rc == 1)
		snprintf(q->out->rep.message, sizeof(q->out->rep.message),
			 "chunk already stored; nothing written");
	one_chunk_reply(q, q->h.hash, &ci);
out:
	if (shm)
		shm_release(q->srv->shm, q->h.shm_id);
	free(snapshot);
	free(tensors);
}

/* A large GET is decoded by several threads, each taking a contiguous run of layers. */
struct get_split {
	struct store *store;
	const struct store_model *m;
	const uint8_t *hash;
	uint32_t lb, le, parts;
	uint8_t *dst;
	uint64_t tb;
	/* GET re-rotated: keys moved to a new position after decoding */
	const struct blend_backend *be;
	const struct rope_table *rot;
	struct blend_shape shape;
	uint32_t tokens;
	/* progress: the contiguous prefix of finished parts, published to the client */
	_Atomic uint64_t *progress;
	pthread_mutex_t lock;
	uint8_t *done;
	uint32_t prefix;
};

/* The first layer after part p (parts split [lb, le) evenly, in order). */
static uint32_t le_of(const struct get_split *g, uint32_t p)
{
	return g->lb + (uint32_t)((uint64_t)(g->le - g->lb) * p / g->parts);
}

static int get_part(void *arg, size_t i)
{
	const struct get_split *g = arg;
	uint32_t n = g->le - g->lb;
	uint32_t a = g->lb + (uint32_t)((uint64_t)n * i / g->parts);
	uint32_t b = g->lb + (uint32_t)((uint64_t)n * (i + 1) / g->parts);

	uint8_t *dst = g->dst + (uint64_t)(a - g->lb) * 2 * g->tb;
	int rc;

	if (a == b)
		return 0;
	rc = store_chunk_get(g->store, g->m, g->hash, a, b, dst, (uint64_t)(b - a) * 2 * g->tb, NULL);
	for (uint32_t l = a; !rc && g->rot && l < b; l++, dst += 2 * g->tb)
		rc = g->be->rotate(g->be, &g->shape, g->rot, dst, dst, 0, g->tokens);
	if (!rc && g->progress) {
		struct get_split *w = (struct get_split *)g;

		pthread_mutex_lock(&w->lock);
		w->done[i] = 1;
		while (w->prefix < w->parts && w->done[w->prefix])
			w->prefix++;
		/* parts are layer ranges in order: the prefix's end in bytes */
		atomic_store_explicit(w->progress,
				      (uint64_t)((uint64_t)(le_of(w, w->prefix) - w->lb)) * 2 * w->tb,
				      memory_order_release);
		pthread_mutex_unlock(&w->lock);
	}
	return rc;
}

/* Below this a GET is not worth splitting: thread hand-offs cost more than they save. */
#define SPLIT_MIN_BYTES (4u << 20)

static int chunk_get_parallel(struct req *q, const struct store_model *m, uint32_t lb, uint32_t le,
			      void *dst, uint64_t tb, uint64_t total, const struct rope_table *rot,
			      uint32_t tokens, _Atomic uint64_t *progress)
{
	struct get_split g = { q->srv->store, m, q->h.hash, lb, le, 1, dst, tb, q->srv->blend, rot,
			       { m->num_kv_heads, m->head_dim, m->rotary_dim ? m->rotary_dim : m->head_dim,
				 m->rope_style ? ROPE_GPTJ : ROPE_NEOX, (enum blend_dtype)m->dtype },
			       tokens };
	unsigned threads = pool_threads(q->srv->pool) + 1;
	int rc;

	if (total < SPLIT_MIN_BYTES)
		progress = NULL; /* small: one part, the client copies after the reply */
	if (progress) {
		/* One part a layer, handed out in order: the client copies behind the decode. */
		g.parts = le - lb;
		g.progress = progress;
		g.done = calloc(g.parts, 1);
		if (!g.done)
			return -ENOMEM;
		pthread_mutex_init(&g.lock, NULL);
	} else if (total >= SPLIT_MIN_BYTES && threads > 1) {
		g.parts = le - lb < threads ? le - lb : threads;
	}
	rc = pool_run(q->srv->pool, g.parts, get_part, &g);
	if (progress) {
		pthread_mutex_destroy(&g.lock);
		free(g.done);
	}
	return rc;
}

/* GETs of at least this many bytes go out from the store's pages (below, a copy is
 * as cheap as the view's transaction). */
#define VIEW_MIN_BYTES (256u << 10)

struct view_check {
	const struct store_view *v;
	uint32_t n, parts;
};

static int view_check_part(void *arg, size_t i)
{
	const struct view_check *c = arg;
	uint32_t a = (uint32_t)((uint64_t)c->n * i / c->parts);
	uint32_t b = (uint32_t)((uint64_t)c->n * (i + 1) / c->parts);

	for (uint32_t l = a; l < b; l++)
		if (store_view_verify(c->v, l))
			return -EBADMSG;
	return 0;
}

/*
 * Serve a GET of layers [lb, le) as frames pointing at the stored bytes: verify
 * every layer's checksums (split over the helper threads), then hand ZeroMQ
 * frames that keep the view, and its read transaction, alive until sent. No copy
 * of the payload in the daemon. Returns 1 when the chunk has no view (a layer is
 * compressed or quantized: decode it instead), else 0 with the reply (or the
 * failure) written.
 */
static int get_from_view(struct req *q, const struct store_model *m, uint32_t lb, uint32_t le,
			 uint64_t tb, uint64_t total)
{
	struct store_chunk_info ci;
	struct store_view *v = NULL;
	struct shared_buf *hold;
	struct view_check c;
	size_t n = 2 * (size_t)(le - lb);
	unsigned threads = pool_threads(q->srv->pool) + 1;
	int rc = store_chunk_view(q->srv->store, m, q->h.hash, lb, le, &ci, &v);

	if (rc == -EAGAIN)
		return 1;
	if (rc == 0 && v->tensor_bytes != tb) {
		store_view_free(&v); /* replaced by another chunk of another size since: retry */
		fail(q, KVBP_NOT_FOUND, "chunk changed while it was read; retry");
		return 0;
	}
	if (rc == -EBADMSG) {
		remove_corrupt(q, m);
		return 0;
	}
	if (rc) {
		fail_store(q, rc, "get");
		return 0;
	}
	c = (struct view_check){ v, le - lb, threads < le - lb ? threads : le - lb };
	if (pool_run(q->srv->pool, c.parts, view_check_part, &c)) {
		store_view_free(&v);
		remove_corrupt(q, m);
		return 0;
	}
	hold = reply_hold(q, total, 0);
	if (!hold) {
		store_view_free(&v);
		return 0;
	}
	hold->view = v;
	if (one_chunk_reply(q, q->h.hash, &ci) == 0) {
		q->out->payload = calloc(n, sizeof(zmq_msg_t));
		if (!q->out->payload) {
			fail(q, KVBP_LIMIT, "out of memory");
		} else {
			evictor_touch(q->srv->evict, m->id, q->h.hash);
			q->out->rep.layer_begin = lb;
			q->out->rep.layer_end = le;
			for (size_t i = 0; i < n; i++) {
				const uint8_t *p = i % 2 ? v->v[i / 2] : v->k[i / 2];

				atomic_fetch_add(&hold->refs, 1);
				/* ZeroMQ only reads the frames' data: the map stays read-only. */
				zmq_msg_init_data(&q->out->payload[i], (void *)p, tb, shared_buf_unref,
						  hold);
			}
			q->out->n_payload = n;
			q->out->rep.payload_frames = (uint32_t)n;
		}
	}
	shared_buf_unref(NULL, hold);
	return 0;
}

static void op_get(struct req *q)
{
	struct store_model m;
	struct store_chunk_info ci;
	struct shared_buf *buf = NULL;
	struct rope_table rot = { 0 };
	uint32_t lb = q->h.layer_begin, le = q->h.layer_end;
	uint64_t tb, total;
	void *dst = NULL;
	int rc;

	if (need_model(q, &m) || need_hash(q) || no_payload(q))
		return;
	if (le == 0)
		le = m.num_layers;
	if (lb >= le || le > m.num_layers) {
		fail(q, KVBP_BAD_ARGUMENT, "layer range %" PRIu32 ":%" PRIu32 " invalid for a %"
		     PRIu32 "-layer model", lb, le, m.num_layers);
		return;
	}
	rc = store_chunk_info(q->srv->store, &m, q->h.hash, &ci);
	if (rc == -ENOENT && cluster_wanted(q) &&
	    cluster_fetch(q->srv->cluster, &m, q->h.hash) == 0) {
		/* fetched from another member and stored here */
		evictor_kick(q->srv->evict);
		rc = store_chunk_info(q->srv->store, &m, q->h.hash, &ci);
	}
	if (rc == -EBADMSG) {
		remove_corrupt(q, &m); /* its record failed its checksum */
		return;
	}
	if (rc) {
		fail_store(q, rc, "get");
		return;
	}
	if (chunk_bytes(q, &m, ci.num_tokens, le - lb, &tb, &total))
		return;
	if (!q->h.rerotate && !q->h.has_shm && total >= VIEW_MIN_BYTES &&
	    get_from_view(q, &m, lb, le, tb, total) == 0)
		return;
	if (q->h.rerotate) {
		struct rope_config rc_cfg;

		/* A chunk alone at target_pos: dynamic NTK sees target_pos + T positions. */
		fuse_rope_config(&m, &rc_cfg);
		if ((uint64_t)q->h.target_pos + ci.num_tokens > UINT32_MAX) {
			fail(q, KVBP_BAD_ARGUMENT, "target position %" PRIu32 " + %" PRIu32 " tokens "
			     "overflows", q->h.target_pos, ci.num_tokens);
			return;
		}
		rc = rope_table_build(&rc_cfg, m.k_pre_rope, ci.num_tokens, ci.base_pos,
				      (uint64_t)ci.base_pos + ci.num_tokens, q->h.target_pos,
				      (uint64_t)q->h.target_pos + ci.num_tokens, &rot);
		if (rc) {
			fail(q, KVBP_INTERNAL, "rotation table: %s", strerror(-rc));
			return;
		}
	}
	if (q->h.has_shm) {
		if (q->h.shm_length < total) {
			fail(q, KVBP_BAD_SHM, "shared-memory span of %" PRIu64 " bytes is too small; "
			     "the chunk needs %" PRIu64, q->h.shm_length, total);
			one_chunk_reply(q, q->h.hash, &ci); /* so that the client learns the size */
			goto out;
		}
		rc = shm_acquire(q->srv->shm, q->h.shm_id, q->principal, q->h.shm_offset, total,
				 &dst);
		if (rc) {
			fail(q, KVBP_BAD_SHM, "shared-memory segment %" PRIu64 ": %s", q->h.shm_id,
			     rc == -ENOENT ? "unknown, expired or not this client's"
					   : "span outside the segment");
			goto out;
		}
	} else {
		buf = reply_buf(q, total);
		if (!buf)
			goto out;
		dst = buf->data;
	}
	{
		_Atomic uint64_t *progress = NULL;
		void *pw = NULL;

		/* A progress word inside the client's segment, 8-byte aligned, apart from the data. */
		if (q->h.has_shm && q->h.progress && (q->h.progress - 1) % 8 == 0 &&
		    shm_acquire(q->srv->shm, q->h.shm_id, q->principal, q->h.progress - 1, 8, &pw) == 0)
			progress = pw;
		rc = chunk_get_parallel(q, &m, lb, le, dst, tb, total, q->h.rerotate ? &rot : NULL,
					ci.num_tokens, progress);
		if (pw)
			shm_release(q->srv->shm, q->h.shm_id);
	}
	if (q->h.has_shm)
		shm_release(q->srv->shm, q->h.shm_id);
	if (rc == -EBADMSG) {
		remove_corrupt(q, &m);
	} else if (rc == -ENOBUFS) {
		fail(q, KVBP_NOT_FOUND, "chunk changed while it was read; retry");
	} else if (rc) {
		fail_store(q, rc, "get");
	} else if (one_chunk_reply(q, q->h.hash, &ci) == 0) {
		evictor_touch(q->srv->evict, m.id, q->h.hash);
		q->out->rep.layer_begin = lb;
		q->out->rep.layer_end = le;
		if (buf) {
			size_t n = 2 * (size_t)(le - lb);

			q->out->payload = calloc(n, sizeof(zmq_msg_t));
			if (!q->out->payload) {
				fail(q, KVBP_LIMIT, "out of memory");
				goto out;
			}
			for (size_t i = 0; i < n; i++) {
				atomic_fetch_add(&buf->refs, 1);
				zmq_msg_init_data(&q->out->payload[i], buf->data + i * tb, tb,
						  shared_buf_unref, buf);
			}
			q->out->n_payload = n;
			q->out->rep.payload_frames = (uint32_t)n;
		}
	}
out:
	if (buf)
		shared_buf_unref(NULL, buf);
	rope_table_free(&rot);
}

static void op_lookup(struct req *q)
{
	struct store_model m;
	struct store_chunk_info *infos;
	bool *found;
	int rc;

	if (need_model(q, &m) || no_payload(q))
		return;
	if (!q->h.n_hashes) {
		fail(q, KVBP_BAD_ARGUMENT, "lookup needs at least one hash");
		return;
	}
	infos = calloc(q->h.n_hashes, sizeof(*infos));
	found = calloc(q->h.n_hashes, sizeof(*found));
	q->out->rep.chunks = calloc(q->h.n_hashes, sizeof(struct kvbp_chunk));
	if (!infos || !found || !q->out->rep.chunks) {
		fail(q, KVBP_LIMIT, "out of memory");
		goto out;
	}
	rc = store_chunk_lookup(q->srv->store, &m, (const uint8_t(*)[KVBP_HASH_LEN])q->h.hashes,
				q->h.n_hashes, infos, found);
	if (rc) {
		fail_store(q, rc, "lookup");
		goto out;
	}
	if (cluster_wanted(q)) {
		bool all = true;

		for (size_t i = 0; i < q->h.n_hashes && all; i++)
			all = found[i];
		if (!all) /* what other members hold counts as found: a GET fetches it */
			cluster_lookup(q->srv->cluster, &m,
				       (const uint8_t(*)[KVBP_HASH_LEN])q->h.hashes, q->h.n_hashes,
				       found, infos);
	}
	for (size_t i = 0; i < q->h.n_hashes; i++) {
		chunk_out(&q->out->rep.chunks[i], q->h.hashes[i], found[i], &infos[i]);
		atomic_fetch_add(found[i] ? &q->srv->stats.lookup_hits : &q->srv->stats.lookup_misses,
				 1);
		if (found[i])
			evictor_touch(q->srv->evict, m.id, q->h.hashes[i]);
	}
	q->out->rep.n_chunks = q->h.n_hashes;
out:
	free(infos);
	free(found);
}

static void op_delete(struct req *q)
{
	struct store_model m;
	int rc;

	if (need_model(q, &m) || need_hash(q) || no_payload(q))
		return;
	rc = fuse_delete_chunk(q->srv->fuse, &m, q->h.hash);
	if (rc == -EBUSY)
		fail(q, KVBP_BUSY, "chunk is in use by an open fuse session; delete it after the "
		     "session closes");
	else if (rc)
		fail_store(q, rc, "delete");
}

static void op_list(struct req *q)
{
	struct store_model m;
	struct store_chunk_entry *e = NULL;
	size_t n = 0;
	int rc;

	if (need_model(q, &m) || no_payload(q))
		return;
	rc = store_chunk_list(q->srv->store, &m, &e, &n);
	if (rc) {
		fail_store(q, rc, "list");
		return;
	}
	if (n) {
		q->out->rep.chunks = calloc(n, sizeof(struct kvbp_chunk));
		if (!q->out->rep.chunks) {
			fail(q, KVBP_LIMIT, "out of memory");
			free(e);
			return;
		}
		for (size_t i = 0; i < n; i++)
			chunk_out(&q->out->rep.chunks[i], e[i].hash, true, &e[i].info);
		q->out->rep.n_chunks = n;
	}
	free(e);
}

struct member_stats {
	struct kvbp_stat *s;
	size_t *n, cap;
	struct kvbp_reply *rep; /* and each member in full (with its endpoint) */
	size_t cap_members;
};

static void member_stat(void *ctx, const struct cluster_member *mb)
{
	struct member_stats *m = ctx;
	struct timespec now;

	clock_gettime(CLOCK_REALTIME, &now);
	if (m->rep->n_members == m->cap_members) {
		size_t cap = m->cap_members ? 2 * m->cap_members : 8;
		struct kvbp_member *p = realloc(m->rep->members, cap * sizeof(*p));

		if (p) {
			m->rep->members = p;
			m->cap_members = cap;
		}
	}
	if (m->rep->n_members < m->cap_members) {
		struct kvbp_member *e = &m->rep->members[m->rep->n_members++];

		snprintf(e->id, sizeof(e->id), "%s", mb->id);
		snprintf(e->endpoint, sizeof(e->endpoint), "%s", mb->endpoint);
		e->state = mb->state;
		e->pushes_owed = mb->owed;
		e->last_reply_age_ms = mb->last_reply_ms ? (double)now.tv_sec * 1e3 +
								   now.tv_nsec / 1e6 -
								   (double)mb->last_reply_ms
							 : -1;
		e->chunks = mb->held_chunks;
		e->stored_bytes = mb->held_bytes;
	}
	if (*m->n + 5 > m->cap)
		return;
	/* member:ID 1 alive, 0 suspect, -1 gone; the rest per member, names cut at 63 */
	snprintf(m->s[*m->n].name, sizeof(m->s[0].name), "member:%.56s", mb->id);
	m->s[(*m->n)++].value = mb->state;
	snprintf(m->s[*m->n].name, sizeof(m->s[0].name), "owed:%.58s", mb->id);
	m->s[(*m->n)++].value = (double)mb->owed;
	snprintf(m->s[*m->n].name, sizeof(m->s[0].name), "seen_ms:%.55s", mb->id);
	m->s[(*m->n)++].value =
		mb->last_reply_ms ? (double)now.tv_sec * 1e3 + now.tv_nsec / 1e6 -
					    (double)mb->last_reply_ms
				  : -1;
	snprintf(m->s[*m->n].name, sizeof(m->s[0].name), "chunks:%.56s", mb->id);
	m->s[(*m->n)++].value = (double)mb->held_chunks;
	snprintf(m->s[*m->n].name, sizeof(m->s[0].name), "bytes:%.57s", mb->id);
	m->s[(*m->n)++].value = (double)mb->held_bytes;
}

static void op_stats(struct req *q)
{
	struct server *srv = q->srv;
	struct store_totals t;
	struct timespec now;
	uint64_t shm_n, shm_bytes;
	struct kvbp_stat *s;
	size_t n = 0, cap = 128 + 3 * KVBP_OP_COUNT + KVBP_CODE_COUNT + 5 * 1024;
	int rc;

	if (no_payload(q))
		return;
	rc = store_totals(srv->store, &t);
	if (rc) {
		fail_store(q, rc, "stats");
		return;
	}
	s = calloc(cap, sizeof(*s));
	if (!s) {
		fail(q, KVBP_LIMIT, "out of memory");
		return;
	}
	shm_usage(srv->shm, &shm_n, &shm_bytes);
	clock_gettime(CLOCK_MONOTONIC, &now);
#define STAT(nm, v)                                                        \
	do {                                                               \
		snprintf(s[n].name, sizeof(s[n].name), "%s", nm);          \
		s[n++].value = (double)(v);                                \
	} while (0)
	STAT("uptime_seconds", (double)(now.tv_sec - srv->started.tv_sec) +
				       (now.tv_nsec - srv->started.tv_nsec) / 1e9);
	STAT("workers", srv->n_workers);
	STAT("models", t.models);
	STAT("chunks", t.chunks);
	STAT("raw_bytes", t.raw_bytes);
	STAT("stored_bytes", t.stored_bytes);
	STAT("compression_ratio", t.stored_bytes ? (double)t.raw_bytes / t.stored_bytes : 1.0);
	/* What each store codec holds: kept by the store, no walk of the chunks. */
	for (int c = 0; c < STORE_CODECS; c++) {
		static const char *const names[STORE_CODECS] = { "dtype", "fp8", "int8", "int4" };
		char nm[64];

		if (!t.codec[c].chunks)
			continue;
		snprintf(nm, sizeof(nm), "store_%s_chunks", names[c]);
		STAT(nm, t.codec[c].chunks);
		snprintf(nm, sizeof(nm), "store_%s_raw_bytes", names[c]);
		STAT(nm, t.codec[c].raw_bytes);
		snprintf(nm, sizeof(nm), "store_%s_stored_bytes", names[c]);
		STAT(nm, t.codec[c].stored_bytes);
	}
	STAT("store_chunk_walks", store_chunk_walks(srv->store));
	STAT("map_size_bytes", t.map_size);
	STAT("map_used_bytes", t.map_used);
	if (srv->cluster) {
		struct cluster_stats cs;

		cluster_stats(srv->cluster, &cs);
		STAT("cluster_members", cs.members);
		STAT("cluster_suspect", cs.suspect);
		STAT("cluster_pushes_owed", cs.pushes_owed);
		STAT("cluster_pushes_done", cs.pushes_done);
		STAT("cluster_push_failures", cs.push_failures);
		STAT("cluster_remote_hits", cs.remote_hits);
		STAT("cluster_remote_misses", cs.remote_misses);
		STAT("cluster_fetch_failures", cs.fetch_failures);
		STAT("cluster_fetched_bytes", cs.fetched_bytes);
		STAT("cluster_fetch_ms", cs.fetch_ms);
		STAT("cluster_rebalance_pushes", cs.rebalance_pushes);
		STAT("cluster_rebalance_skipped", cs.rebalance_skipped);
		STAT("cluster_membership_changes", cs.membership_changes);
		STAT("cluster_peer_busy", cs.peer_busy);
		if (cs.etcd) {
			STAT("cluster_etcd_ok", cs.etcd_ok);
			STAT("cluster_etcd_errors", cs.etcd_errors);
			STAT("cluster_etcd_last_ok_ms", cs.etcd_last_ok_ms);
		}
		/* per member: member:ID, owed:ID, seen_ms:ID, chunks:ID, bytes:ID */
		{
			struct member_stats ms = { s, &n, cap, &q->out->rep, 0 };

			cluster_members(srv->cluster, member_stat, &ms);
		}
	}
	STAT("shm_segments", shm_n);
	STAT("shm_bytes", shm_bytes);
	STAT("bytes_in", atomic_load(&srv->stats.bytes_in));
	STAT("bytes_out", atomic_load(&srv->stats.bytes_out));
	STAT("lookup_hits", atomic_load(&srv->stats.lookup_hits));
	STAT("lookup_misses", atomic_load(&srv->stats.lookup_misses));
	STAT("corrupt_removed", atomic_load(&srv->stats.corrupt_removed));
	{
		uint64_t held, n_clients;

		clients_usage(srv->clients, &held, &n_clients);
		STAT("inflight_bytes", held);
		STAT("clients", n_clients);
		STAT("connections", atomic_load(&srv->connections));
		STAT("connections_refused", atomic_load(&srv->refused_clients));
		STAT("curve_keys_refused", atomic_load(&srv->refused_keys));
		STAT("connections_dropped_no_fd", fdguard_dropped());
		STAT("max_clients", srv->max_clients);
	}
	{
		struct evict_stats es;

		evictor_stats(srv->evict, &es);
		STAT("capacity_bytes", srv->cfg->capacity);
		STAT("evictions", es.evicted);
		STAT("evicted_bytes", es.evicted_bytes);
		STAT("pinned_chunks", es.pins);
	}
	{
		uint64_t fs, fb, fp;

		fuse_usage(srv->fuse, &fs, &fb, &fp);
		STAT("fuse_sessions", fs);
		STAT("fuse_ring_bytes", fb);
		STAT("fuse_pinned_chunks", fp);
	}
	for (uint32_t op = 1; op <= KVBP_OP_COUNT; op++) {
		char nm[64];

		snprintf(nm, sizeof(nm), "requests_%s",
			 op < KVBP_OP_COUNT ? kvbp_op_name(op) : "unknown");
		STAT(nm, atomic_load(&srv->stats.requests[op]));
	}
	for (uint32_t c = 1; c < KVBP_CODE_COUNT; c++) {
		char nm[64];

		snprintf(nm, sizeof(nm), "errors_%s", kvbp_code_name(c));
		STAT(nm, atomic_load(&srv->stats.errors[c]));
	}
	/* Latency by operation: mean, and the 99th percentile as its bucket's upper bound. */
	for (uint32_t op = 1; op < KVBP_OP_COUNT; op++) {
		uint64_t cnt = atomic_load(&srv->stats.lat_count[op]), cum = 0;
		char nm[64];
		unsigned b = 0;

		if (!cnt)
			continue;
		snprintf(nm, sizeof(nm), "latency_ms_mean_%s", kvbp_op_name(op));
		STAT(nm, atomic_load(&srv->stats.lat_sum_ns[op]) / 1e6 / cnt);
		for (; b < METRICS_BUCKETS; b++) {
			cum += atomic_load(&srv->stats.lat_bucket[op][b]);
			if (cum * 100 >= cnt * 99)
				break;
		}
		snprintf(nm, sizeof(nm), "latency_ms_p99_le_%s", kvbp_op_name(op));
		STAT(nm, b + 1 < METRICS_BUCKETS ? metrics_bucket_le[b] * 1e3 : -1);
	}
	{
		char nm[64];

		snprintf(nm, sizeof(nm), "backend_%s", srv->blend->name);
		STAT(nm, 1);
		if (srv->gpu) {
			size_t k = (size_t)snprintf(nm, sizeof(nm), "device_name_%s",
						    blend_cuda_name(srv->gpu));

			/* The name as a stat name: words joined by '_' ("NVIDIA_H200"). */
			for (k = k < sizeof(nm) ? k : sizeof(nm) - 1; k-- > 12;)
				if (nm[k] == ' ')
					nm[k] = '_';
			STAT(nm, 1);
			STAT("device_cuda_ordinal", blend_cuda_ordinal(srv->gpu));
		}
		if (srv->dev) {
			uint64_t held, total;

			snprintf(nm, sizeof(nm), "device_%s", srv->dev->name);
			STAT(nm, 1);
			srv->dev->memory(srv->dev, &held, &total);
			STAT("device_memory_bytes", held);
			STAT("device_memory_total_bytes", total);
		}
	}
#undef STAT
	q->out->rep.stats = s;
	q->out->rep.n_stats = n;
}

static void op_shm_attach(struct req *q)
{
	const struct config *cfg = q->srv->cfg;
	uint64_t id;
	int rc;

	if (no_payload(q))
		return;
	if (!shm_path(q->srv->shm)[0]) {
		fail(q, KVBP_BAD_ARGUMENT, "shared memory is only for clients on an ipc:// endpoint "
		     "of this daemon");
		return;
	}
	if (strncmp(q->principal, "ipc:", 4)) {
		fail(q, KVBP_BAD_ARGUMENT, "shared memory is only for clients on an ipc:// "
		     "endpoint; this one came over TCP");
		return;
	}
	rc = shm_create(q->srv->shm, q->h.shm_size, q->principal, &id);
	switch (rc) {
	case 0:
		break;
	case -E2BIG:
		fail(q, KVBP_BAD_ARGUMENT, "shared-memory size %" PRIu64 " out of range 1..%" PRIu64
		     " (shm_max)", q->h.shm_size, cfg->shm_max);
		return;
	case -ENOSPC:
		fail(q, KVBP_LIMIT, "shared memory exhausted: all segments together may hold %"
		     PRIu64 " bytes (shm_total)", cfg->shm_total);
		return;
	case -EMFILE:
		fail(q, KVBP_LIMIT, "all 256 shared-memory segments of the daemon are in use");
		return;
	case -EDQUOT:
		fail(q, KVBP_LIMIT, "this client holds %" PRIu64 " shared-memory segments already "
		     "(client_shm_segments); detach one first", cfg->client_shm_segments);
		return;
	default:
		fail(q, KVBP_INTERNAL, "cannot create shared memory: %s", strerror(-rc));
		return;
	}
	q->out->rep.shm_id = id;
	q->out->rep.shm_size = q->h.shm_size;
	snprintf(q->out->rep.shm_name, sizeof(q->out->rep.shm_name), "%s", shm_path(q->srv->shm));
}

static void op_shm_detach(struct req *q)
{
	if (no_payload(q))
		return;
	if (!q->h.has_shm) {
		fail(q, KVBP_BAD_ARGUMENT, "shm_detach needs a shared-memory reference");
		return;
	}
	if (shm_detach(q->srv->shm, q->h.shm_id, q->principal))
		fail(q, KVBP_BAD_SHM, "shared-memory segment %" PRIu64 " unknown, expired or not "
		     "this client's", q->h.shm_id);
}

/* FETCH (between daemons): a chunk's stored bytes, one frame per layer. */
struct fetch_copy {
	uint8_t *data;
	size_t used, cap;
	size_t *lens;
	uint32_t n;
};

static int fetch_layer(void *ctx, uint32_t layer, const void *bytes, size_t len)
{
	struct fetch_copy *f = ctx;

	if (layer >= f->n || len > f->cap - f->used)
		return -EBADMSG; /* more than the record says */
	memcpy(f->data + f->used, bytes, len);
	f->used += len;
	f->lens[layer] = len;
	return 0;
}

/* The model a peer names must be ours, described the same as the store compares models. */
static int peer_model(struct req *q, struct store_model *m)
{
	struct kvbp_model w;
	struct store_model want;

	if (need_model(q, m))
		return -1;
	if (!q->h.has_model)
		return 0;
	w = q->h.model;
	if (model_check(q, &w))
		return -1;
	model_to_store(&w, &want);
	if (!store_model_same(&want, m))
		return fail(q, KVBP_MODEL_CONFLICT, "model '%s' is described differently by the "
			    "members", q->h.model_name);
	return 0;
}

static void op_fetch(struct req *q)
{
	struct store_model m;
	struct store_chunk_info ci;
	struct fetch_copy f = { 0 };
	struct shared_buf *buf = NULL;
	size_t off = 0;
	int rc;

	if (peer_model(q, &m) || need_hash(q) || no_payload(q))
		return;
	rc = store_chunk_info(q->srv->store, &m, q->h.hash, &ci);
	if (!rc) {
		buf = reply_buf(q, ci.stored_bytes ? ci.stored_bytes : 1);
		if (!buf)
			return;
		f = (struct fetch_copy){ buf->data, 0, ci.stored_bytes,
					 calloc(ci.num_layers + 1, sizeof(size_t)), ci.num_layers };
		q->out->payload = calloc(ci.num_layers + 1, sizeof(zmq_msg_t));
		if (!f.lens || !q->out->payload) {
			fail(q, KVBP_LIMIT, "out of memory");
			goto out;
		}
		rc = store_chunk_export(q->srv->store, &m, q->h.hash, &ci, fetch_layer, &f);
	}
	if (rc == -EBADMSG) {
		remove_corrupt(q, &m);
		goto out;
	}
	if (rc) {
		fail_store(q, rc, "fetch");
		goto out;
	}
	for (uint32_t l = 0; l < ci.num_layers; l++, off += f.lens[l - 1]) {
		atomic_fetch_add(&buf->refs, 1);
		zmq_msg_init_data(&q->out->payload[l], buf->data + off, f.lens[l], shared_buf_unref,
				  buf);
	}
	q->out->n_payload = ci.num_layers;
	q->out->rep.payload_frames = ci.num_layers;
	one_chunk_reply(q, q->h.hash, &ci);
out:
	if (!q->out->n_payload) {
		free(q->out->payload);
		q->out->payload = NULL;
	}
	free(f.lens);
	if (buf)
		shared_buf_unref(NULL, buf);
}

/* REPLICATE (between daemons): store a chunk from its stored bytes, one frame per layer. */
static void op_replicate(struct req *q)
{
	struct store_model m;
	struct store_chunk_info ci;
	const void **blobs = NULL;
	size_t *lens = NULL;
	uint64_t tb, total;
	int rc;

	/* The model travels with its chunks: a member that joined after it was registered
	 * elsewhere learns it from the first chunk pushed to it. */
	if (q->h.has_model && q->h.model_name[0]) {
		char name[STORE_NAME_MAX + 1];
		struct kvbp_model w = q->h.model;

		if (stored_name(q, q->h.model_name, name))
			return;
		if (store_model_find(q->srv->store, name, &m) == -ENOENT) {
			if (model_check(q, &w))
				return;
			model_to_store(&w, &m);
			snprintf(m.name, sizeof(m.name), "%s", name);
			rc = store_model_register(q->srv->store, &m);
			if (rc < 0 && rc != -EEXIST) {
				fail_store(q, rc, "replicate: registering the model");
				return;
			}
			if (rc >= 0)
				log_info("model '%s' registered from another member's chunk", name);
		}
	}
	if (peer_model(q, &m) || need_hash(q))
		return;
	if (chunk_bytes(q, &m, q->h.num_tokens, m.num_layers, &tb, &total))
		return;
	if (q->n_payload != m.num_layers || q->h.payload_frames != q->n_payload) {
		fail(q, KVBP_BAD_FRAMES, "replicate of a %" PRIu32 "-layer model takes %" PRIu32
		     " payload frames (a layer's stored bytes each); got %zu", m.num_layers,
		     m.num_layers, q->n_payload);
		return;
	}
	blobs = calloc(m.num_layers, sizeof(*blobs));
	lens = calloc(m.num_layers, sizeof(*lens));
	if (!blobs || !lens) {
		fail(q, KVBP_LIMIT, "out of memory");
		goto out;
	}
	for (uint32_t l = 0; l < m.num_layers; l++) {
		blobs[l] = zmq_msg_data(&q->payload[l]);
		lens[l] = zmq_msg_size(&q->payload[l]);
	}
	rc = store_chunk_import(q->srv->store, &m, q->h.hash, q->h.num_tokens, q->h.base_pos,
				blobs, lens, &ci);
	for (int tries = 0; rc == -ENOSPC && tries < 3; tries++) {
		if (evictor_make_room(q->srv->evict, 2 * total + (1u << 20), q->ns) < 0)
			break;
		rc = store_chunk_import(q->srv->store, &m, q->h.hash, q->h.num_tokens,
					q->h.base_pos, blobs, lens, &ci);
	}
	if (rc == -EBADMSG) {
		fail(q, KVBP_CORRUPT, "replicate: the chunk's bytes fail their checks (header, "
		     "size or checksum); nothing stored");
		goto out;
	}
	if (rc < 0) {
		fail_store(q, rc, "replicate");
		goto out;
	}
	evictor_touch(q->srv->evict, m.id, q->h.hash);
	if (rc == 0)
		evictor_kick(q->srv->evict);
	q->out->rep.existed = rc == 1;
	one_chunk_reply(q, q->h.hash, &ci);
out:
	free(blobs);
	free(lens);
}

struct fetch_many {
	struct cluster *c;
	const struct store_model *m;
	uint8_t (*hashes)[KVBP_HASH_LEN];
	atomic_size_t got;
};

static int fetch_one(void *arg, size_t i)
{
	struct fetch_many *f = arg;

	if (cluster_fetch(f->c, f->m, f->hashes[i]) == 0)
		atomic_fetch_add(&f->got, 1);
	return 0;
}

static void op_fuse_open(struct req *q)
{
	struct fuse_open_result r;
	struct store_model m;
	char err[KVBP_MESSAGE_MAX];
	uint32_t code;

	if (need_model(q, &m) || no_payload(q))
		return;
	code = fuse_open(q->srv->fuse, &m, &q->h, q->principal, &r, err, sizeof(err));
	if (code == KVBP_NOT_FOUND && r.n_missing && cluster_wanted(q)) {
		/* Chunks held elsewhere: fetch them all at once, then open again. */
		struct fetch_many fm = { q->srv->cluster, &m, r.missing, 0 };

		pool_run(q->srv->pool, r.n_missing, fetch_one, &fm);
		free(r.missing);
		if (atomic_load(&fm.got))
			evictor_kick(q->srv->evict);
		code = fuse_open(q->srv->fuse, &m, &q->h, q->principal, &r, err, sizeof(err));
	}
	if (code) {
		fail(q, code, "%s", err);
		if (r.n_missing) {
			q->out->rep.chunks = calloc(r.n_missing, sizeof(struct kvbp_chunk));
			for (size_t i = 0; q->out->rep.chunks && i < r.n_missing; i++)
				memcpy(q->out->rep.chunks[i].hash, r.missing[i], KVBP_HASH_LEN);
			q->out->rep.n_chunks = q->out->rep.chunks ? r.n_missing : 0;
		}
		free(r.missing);
		return;
	}
	for (size_t i = 0; i < q->h.n_segments; i++)
		if (!q->h.segments[i].fresh)
			evictor_touch(q->srv->evict, m.id, q->h.segments[i].hash);
	q->out->rep.session_id = r.id;
	q->out->rep.num_tokens = r.num_tokens;
	q->out->rep.next_layer = r.next_layer;
	q->out->rep.rows_next = r.rows_next;
	q->out->rep.ring_slots = r.ring_slots;
	q->out->rep.slot_bytes = r.slot_bytes;
	if (r.has_ipc) {
		q->out->rep.has_ipc = true;
		memcpy(q->out->rep.ipc_handle, r.ipc_handle, sizeof(r.ipc_handle));
		q->out->rep.ipc_offset = r.ipc_offset;
		snprintf(q->out->rep.device_pci, sizeof(q->out->rep.device_pci), "%s", r.device_pci);
	}
	if (r.shm_id) {
		q->out->rep.shm_id = r.shm_id;
		q->out->rep.shm_size = r.shm_size;
		snprintf(q->out->rep.shm_name, sizeof(q->out->rep.shm_name), "%s",
			 shm_path(q->srv->shm));
	}
	if (r.rows) {
		/* Reuse only: the rows the node computes are the fresh tokens, from layer 0. */
		q->out->rep.has_selection = true;
		q->out->rep.selection = r.rows;
		q->out->rep.n_selection = r.n_rows;
	}
	q->out->prefetch_session = r.id;
	log_debug("fuse session %016" PRIx64 " opened: %" PRIu32 " tokens, model '%s'", r.id,
		  r.num_tokens, m.name);
}

/*
 * A check layer of a session that lands in the node's buffers: the rows of the
 * metric's plane come in one frame, or in the client's segment rows row_stride
 * bytes apart (read where the node has them, e.g. a slice of its QKV output).
 */
static void fuse_check_layer(struct req *q, struct fuse_session *s,
			     const struct fuse_layer_plan *plan)
{
	struct fuse_layer_result res = { 0 };
	char err[KVBP_MESSAGE_MAX];
	uint64_t stride = q->h.row_stride ? q->h.row_stride : plan->row_bytes, span = 0;
	const void *rows;
	void *in_shm = NULL;
	uint32_t code;

	if (q->h.rows != plan->rows_in) {
		fail(q, KVBP_BAD_SHAPE, "check layer %" PRIu32 " takes %" PRIu32 " rows (%s); the "
		     "request declares %" PRIu32, q->h.layer, plan->rows_in,
		     plan->rows_in == plan->num_tokens ? "all tokens" : "the current selection",
		     q->h.rows);
		return;
	}
	if (q->h.has_shm) {
		if (stride < plan->row_bytes) {
			fail(q, KVBP_BAD_SHAPE, "row_stride %" PRIu64 " is below the row size %zu",
			     stride, plan->row_bytes);
			return;
		}
		if (plan->rows_in && (__builtin_mul_overflow((uint64_t)(plan->rows_in - 1), stride,
							     &span) ||
				      __builtin_add_overflow(span, plan->row_bytes, &span))) {
			fail(q, KVBP_BAD_SHAPE, "%" PRIu32 " rows %" PRIu64 " bytes apart overflow",
			     plan->rows_in, stride);
			return;
		}
		if (q->n_payload || q->h.shm_length < span) {
			fail(q, KVBP_BAD_SHAPE, "shared-memory input is %" PRIu64 " bytes in %zu "
			     "frames; %" PRIu32 " rows %" PRIu64 " bytes apart span %" PRIu64 ", and no "
			     "frames", q->h.shm_length, q->n_payload, plan->rows_in, stride, span);
			return;
		}
		if (shm_acquire(q->srv->shm, q->h.shm_id, q->principal, q->h.shm_offset,
				span ? span : 1, &in_shm)) {
			fail(q, KVBP_BAD_SHM, "shared-memory segment %" PRIu64 ": unknown, expired or "
			     "span outside it", q->h.shm_id);
			return;
		}
		rows = in_shm;
	} else {
		uint64_t want = (uint64_t)plan->rows_in * plan->row_bytes;

		if (q->n_payload != 1 || q->h.payload_frames != 1) {
			fail(q, KVBP_BAD_FRAMES, "a check layer of a landing session takes 1 payload "
			     "frame (the %s rows); got %zu", "metric plane's", q->n_payload);
			return;
		}
		if (zmq_msg_size(&q->payload[0]) != want) {
			fail(q, KVBP_BAD_SHAPE, "the metric rows are %zu bytes; expected %" PRIu64
			     " (%" PRIu32 " rows x %zu bytes)", zmq_msg_size(&q->payload[0]), want,
			     plan->rows_in, plan->row_bytes);
			return;
		}
		rows = zmq_msg_data(&q->payload[0]);
		stride = plan->row_bytes;
	}
	code = fuse_check_run(q->srv->fuse, s, rows, stride, &res, err, sizeof(err));
	if (in_shm)
		shm_release(q->srv->shm, q->h.shm_id);
	if (code) {
		fail(q, code, "%s", err);
		free(res.selection);
		free(res.dropped);
		return;
	}
	q->out->rep.num_tokens = plan->num_tokens;
	q->out->rep.next_layer = res.next_layer;
	q->out->rep.rows_next = res.rows_next;
	q->out->rep.has_selection = true;
	q->out->rep.selection = res.selection;
	q->out->rep.n_selection = res.n_selection;
	q->out->rep.dropped = res.dropped;
	q->out->rep.n_dropped = res.n_dropped;
}

static void op_fuse_layer(struct req *q)
{
	struct fuse_layer_plan plan;
	struct fuse_layer_result res = { 0 };
	struct fuse_session *s;
	struct shared_buf *buf = NULL;
	char err[KVBP_MESSAGE_MAX];
	const uint8_t *k_in, *v_in;
	uint8_t *out = NULL;
	void *in_shm = NULL;
	uint64_t in_bytes, out_bytes;
	uint32_t code;

	code = fuse_layer_begin(q->srv->fuse, q->h.session_id, q->principal, q->h.layer, &s, &plan,
				err, sizeof(err));
	if (code) {
		fail(q, code, "%s", err);
		return;
	}
	if (plan.land) {
		fuse_check_layer(q, s, &plan);
		goto out;
	}
	/* The ring is shared only if this client mapped it: else the layer goes in frames. */
	plan.shared_ring = plan.shared_ring && q->h.shared_ring;
	if (q->h.device_out && !plan.device_ring) {
		fail(q, KVBP_BAD_ARGUMENT, "device_out: this session's ring is not exported (the "
		     "daemon fuses on %s, or the open did not ask for device_out); take the layer "
		     "in host memory", q->srv->gpu ? "a CUDA device, but the export failed" :
		     "no CUDA device");
		goto out;
	}
	in_bytes = (uint64_t)plan.rows_in * plan.row_bytes;
	out_bytes = (uint64_t)plan.num_tokens * plan.row_bytes;
	if (q->h.rows != plan.rows_in) {
		fail(q, KVBP_BAD_SHAPE, "layer %" PRIu32 " takes fresh K and V for %" PRIu32 " tokens "
		     "(%s); the request declares %" PRIu32, q->h.layer, plan.rows_in,
		     plan.rows_in == plan.num_tokens ? "all of them" : "the current selection",
		     q->h.rows);
		goto out;
	}
	if (q->h.has_shm) {
		if (q->n_payload || q->h.shm_length != 2 * in_bytes) {
			fail(q, KVBP_BAD_SHAPE, "shared-memory input is %" PRIu64 " bytes in %zu frames; "
			     "expected %" PRIu64 " (K then V of %" PRIu32 " rows) and no frames",
			     q->h.shm_length, q->n_payload, 2 * in_bytes, plan.rows_in);
			goto out;
		}
		if (shm_acquire(q->srv->shm, q->h.shm_id, q->principal, q->h.shm_offset, 2 * in_bytes,
				&in_shm)) {
			fail(q, KVBP_BAD_SHM, "shared-memory segment %" PRIu64 ": unknown, expired or "
			     "span outside it", q->h.shm_id);
			goto out;
		}
		k_in = in_shm;
		v_in = k_in + in_bytes;
	} else {
		if (q->n_payload != 2 || q->h.payload_frames != 2) {
			fail(q, KVBP_BAD_FRAMES, "fuse_layer takes 2 payload frames (fresh K, fresh V); "
			     "got %zu", q->n_payload);
			goto out;
		}
		for (int i = 0; i < 2; i++)
			if (zmq_msg_size(&q->payload[i]) != in_bytes) {
				fail(q, KVBP_BAD_SHAPE, "fresh %c is %zu bytes; expected %" PRIu64 " (%"
				     PRIu32 " rows x %zu bytes)", i ? 'V' : 'K',
				     zmq_msg_size(&q->payload[i]), in_bytes, plan.rows_in,
				     plan.row_bytes);
				goto out;
			}
		k_in = zmq_msg_data(&q->payload[0]);
		v_in = zmq_msg_data(&q->payload[1]);
	}
	/* With a shared ring the fused layer stays where it is made; else it goes in frames. */
	if (plan.fused_out && !plan.shared_ring && !q->h.device_out) {
		buf = reply_buf(q, 2 * out_bytes);
		if (!buf)
			goto out;
		out = buf->data;
	}
	code = fuse_layer_run(q->srv->fuse, s, k_in, v_in, out, out ? out + out_bytes : NULL,
			      q->h.device_out, &res, err, sizeof(err));
	if (code) {
		fail(q, code, "%s", err);
		goto out;
	}
	q->out->rep.num_tokens = plan.num_tokens;
	q->out->rep.next_layer = res.next_layer;
	q->out->rep.rows_next = res.rows_next;
	q->out->rep.has_selection = plan.selection_out;
	q->out->rep.selection = res.selection;
	q->out->rep.n_selection = res.n_selection;
	res.selection = NULL;
	q->out->rep.has_fused = plan.fused_out;
	q->out->rep.ring_slot = res.ring_slot;
	if (buf) {
		q->out->payload = calloc(2, sizeof(zmq_msg_t));
		if (!q->out->payload) {
			fail(q, KVBP_LIMIT, "out of memory");
			goto out;
		}
		for (int i = 0; i < 2; i++) {
			atomic_fetch_add(&buf->refs, 1);
			zmq_msg_init_data(&q->out->payload[i], buf->data + i * out_bytes, out_bytes,
					  shared_buf_unref, buf);
		}
		q->out->n_payload = 2;
		q->out->rep.payload_frames = 2;
	}
	if (!res.done)
		q->out->prefetch_session = q->h.session_id;
out:
	fuse_layer_end(q->srv->fuse, s);
	if (in_shm)
		shm_release(q->srv->shm, q->h.shm_id);
	if (buf)
		shared_buf_unref(NULL, buf);
	free(res.selection);
}

static void op_fuse_close(struct req *q)
{
	char err[KVBP_MESSAGE_MAX];
	uint32_t code;

	if (no_payload(q))
		return;
	code = fuse_close(q->srv->fuse, q->h.session_id, q->principal, &q->out->rep.stats,
			  &q->out->rep.n_stats, err, sizeof(err));
	if (code)
		fail(q, code, "%s", err);
}

#define PIN_TTL_MAX (30u * 86400)

static void op_pin(struct req *q)
{
	struct store_model m;
	struct store_chunk_info ci;
	int rc;

	if (need_model(q, &m) || need_hash(q) || no_payload(q))
		return;
	if (q->h.ttl == 0 || q->h.ttl > PIN_TTL_MAX) {
		fail(q, KVBP_BAD_ARGUMENT, "pin TTL %" PRIu32 " s out of range 1..%u", q->h.ttl,
		     PIN_TTL_MAX);
		return;
	}
	rc = store_chunk_info(q->srv->store, &m, q->h.hash, &ci);
	if (rc) {
		fail_store(q, rc, "pin");
		return;
	}
	if (evictor_pin(q->srv->evict, m.id, q->h.hash, q->h.ttl))
		fail(q, KVBP_LIMIT, "out of memory");
}

static void op_unpin(struct req *q)
{
	struct store_model m;

	if (need_model(q, &m) || need_hash(q) || no_payload(q))
		return;
	if (evictor_unpin(q->srv->evict, m.id, q->h.hash))
		fail(q, KVBP_NOT_FOUND, "chunk is not pinned");
}

typedef void (*op_fn)(struct req *q);

static const op_fn handlers[KVBP_OP_COUNT] = {
	[KVBP_OP_HELLO] = op_hello,	    [KVBP_OP_MODEL_REGISTER] = op_model_register,
	[KVBP_OP_MODEL_LIST] = op_model_list, [KVBP_OP_PUT] = op_put,
	[KVBP_OP_GET] = op_get,		    [KVBP_OP_LOOKUP] = op_lookup,
	[KVBP_OP_DELETE] = op_delete,	    [KVBP_OP_STATS] = op_stats,
	[KVBP_OP_LIST] = op_list,	    [KVBP_OP_SHM_ATTACH] = op_shm_attach,
	[KVBP_OP_SHM_DETACH] = op_shm_detach, [KVBP_OP_FUSE_OPEN] = op_fuse_open,
	[KVBP_OP_FUSE_LAYER] = op_fuse_layer, [KVBP_OP_FUSE_CLOSE] = op_fuse_close,
	[KVBP_OP_FETCH] = op_fetch, [KVBP_OP_REPLICATE] = op_replicate,
	[KVBP_OP_PIN] = op_pin,		    [KVBP_OP_UNPIN] = op_unpin,
};

void ops_handle(struct server *srv, const struct ops_origin *from, zmq_msg_t *frames, size_t n,
		size_t extra_frames, struct reply_out *out)
{
	struct req q = { .srv = srv, .principal = from->principal, .ns = from->ns ? from->ns : "",
			 .acct = from->acct, .out = out };
	uint64_t total = 0;
	char err[KVBP_MESSAGE_MAX];
	int rc;

	memset(out, 0, sizeof(*out));
	out->rep.version = KVBP_VERSION;
	out->op = KVBP_OP_COUNT;
	for (size_t i = 0; i < n; i++)
		total += zmq_msg_size(&frames[i]);
	atomic_fetch_add(&srv->stats.bytes_in, total);
	rc = kvbp_request_decode(zmq_msg_data(&frames[0]), zmq_msg_size(&frames[0]), &q.h, err,
				 sizeof(err));
	if (rc) {
		/* a header refused for its fields still names its request */
		kvbp_request_peek_id(zmq_msg_data(&frames[0]), zmq_msg_size(&frames[0]),
				     &out->rep.request_id);
		fail(&q, (uint32_t)rc, "%s", err);
		goto done;
	}
	out->rep.request_id = q.h.request_id;
	out->op = q.h.op < KVBP_OP_COUNT ? q.h.op : KVBP_OP_COUNT;
	switch (from->refuse) {
	case OPS_RUN:
		break;
	case OPS_REFUSE_STOPPING:
		fail(&q, KVBP_BUSY, "kvblendd is shutting down; retry when it is back");
		goto done;
	case OPS_REFUSE_CLIENT_BYTES:
		fail(&q, KVBP_LIMIT, "this client's requests and unread replies hold %" PRIu64
		     " bytes; this request would pass client_inflight_bytes (%" PRIu64 "): read "
		     "replies or wait for them", from->acct ? clients_held(from->acct) : 0,
		     srv->cfg->client_inflight_bytes);
		goto done;
	case OPS_REFUSE_TOTAL_BYTES:
		fail(&q, KVBP_LIMIT, "requests and unread replies of all clients hold "
		     "max_inflight_bytes (%" PRIu64 "); retry", srv->cfg->max_inflight_bytes);
		goto done;
	default:
		fail(&q, KVBP_LIMIT, "out of memory");
		goto done;
	}
	if (q.h.version != KVBP_VERSION) {
		fail(&q, KVBP_BAD_VERSION, "protocol version %" PRIu32 " not supported; this server "
		     "speaks version %d", q.h.version, KVBP_VERSION);
		goto done;
	}
	if (q.h.op >= KVBP_OP_COUNT || !handlers[q.h.op]) {
		fail(&q, KVBP_UNKNOWN_OP, "unknown operation %" PRIu32, q.h.op);
		goto done;
	}
	if (extra_frames) {
		fail(&q, KVBP_BAD_FRAMES, "message has %zu frames; at most %zu are accepted",
		     n + extra_frames, n);
		goto done;
	}
	if (total > srv->cfg->max_message + (1u << 20)) {
		fail(&q, KVBP_TOO_LARGE, "message of %" PRIu64 " bytes exceeds max_message %" PRIu64,
		     total, srv->cfg->max_message);
		goto done;
	}
	q.payload = frames + 1;
	q.n_payload = n - 1;
	handlers[q.h.op](&q);
done:
	atomic_fetch_add(&srv->stats.requests[out->op], 1);
	if (out->rep.code && out->rep.code < KVBP_CODE_COUNT)
		atomic_fetch_add(&srv->stats.errors[out->rep.code], 1);
	if (out->rep.code)
		log_debug("request %" PRIu64 " (%s) failed: %s: %s", q.h.request_id,
			  kvbp_op_name(q.h.op), kvbp_code_name(out->rep.code), out->rep.message);
	kvbp_request_clear(&q.h);
}

void reply_out_clear(struct reply_out *out)
{
	for (size_t i = 0; i < out->n_payload; i++)
		zmq_msg_close(&out->payload[i]);
	free(out->payload);
	out->payload = NULL;
	out->n_payload = 0;
	kvbp_reply_clear(&out->rep);
}
