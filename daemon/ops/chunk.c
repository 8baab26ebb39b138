/* ops/chunk — PUT, GET, LOOKUP, DELETE, LIST, PIN and UNPIN; see impl.h. */
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

#include "daemon/bulk.h"
#include "daemon/clients.h"
#include "cluster/cluster.h"
#include "daemon/fdguard.h"
#include "daemon/log.h"
#include "daemon/metrics.h"
#include "daemon/pool.h"
#include "blend/rope.h"

/* A reply from the store's pages unread this long while the map is full is cut (held.h). */
#define HELD_GRACE_MS 100

/*
 * A PUT: its payload in frames, in the client's shared memory, or (*bc, taken by
 * op_put) as records on its bulk connection, read here once the request's sizes are
 * checked; *bc is set to NULL once given back.
 */
static void put_run(struct req *q, struct bulk_conn **bc)
{
	struct store_model m;
	struct store_chunk_info ci;
	const void **tensors = NULL;
	struct shared_buf *in = NULL;
	uint8_t *snapshot = NULL;
	uint64_t tb, total;
	void *shm = NULL;
	int rc;

	if (need_model(q, &m) || need_hash(q))
		return;
	if (q->h.dtype && q->h.dtype != m.desc.dtype) {
		fail(q, KVBP_DTYPE_MISMATCH, "payload dtype %s does not match model '%s' dtype %s",
		     kvbp_dtype_name(q->h.dtype), q->h.model_name, kvbp_dtype_name(m.desc.dtype));
		return;
	}
	if (chunk_bytes(q, &m, q->h.num_tokens, m.desc.num_layers, &tb, &total))
		return;
	if (q->h.payload_frames != q->n_payload) {
		fail(q, KVBP_BAD_FRAMES, "header declares %" PRIu32 " payload frames; the message "
		     "has %zu", q->h.payload_frames, q->n_payload);
		return;
	}
	tensors = calloc(2 * (size_t)m.desc.num_layers, sizeof(*tensors));
	if (!tensors) {
		fail(q, KVBP_LIMIT, "out of memory");
		return;
	}
	if (*bc) {
		char why[256];

		if (q->n_payload || q->h.has_shm) {
			fail(q, KVBP_BAD_FRAMES, "put with a bulk payload takes no payload frames "
			     "and no shared memory; got %zu frames%s", q->n_payload,
			     q->h.has_shm ? " and a segment" : "");
			goto out;
		}
		/* held on the client's account with the request, as its frames would be */
		in = reply_buf(q, total);
		if (!in)
			goto out;
		rc = bulk_recv(q->srv->bulk, *bc, q->h.request_id, in->data, total, why,
			       sizeof(why));
		*bc = NULL;
		if (rc) {
			fail(q, KVBP_BAD_FRAMES, "put of %" PRIu64 " bytes on the bulk connection: "
			     "%s; nothing stored", total, why);
			goto out;
		}
		for (size_t i = 0; i < 2 * (size_t)m.desc.num_layers; i++)
			tensors[i] = in->data + i * tb;
	} else if (q->h.has_shm) {
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
		for (size_t i = 0; i < 2 * (size_t)m.desc.num_layers; i++)
			tensors[i] = snapshot + i * tb;
	} else {
		if (q->n_payload != 2 * (size_t)m.desc.num_layers) {
			fail(q, KVBP_BAD_FRAMES, "put for a %" PRIu32 "-layer model needs %" PRIu32
			     " payload frames (K and V per layer); got %zu", m.desc.num_layers,
			     2 * m.desc.num_layers, q->n_payload);
			goto out;
		}
		for (size_t i = 0; i < q->n_payload; i++) {
			size_t sz = zmq_msg_size(&q->payload[i]);

			if (sz != tb) {
				fail(q, KVBP_BAD_SHAPE, "payload frame %zu is %zu bytes; expected %"
				     PRIu64 " (%" PRIu32 " tokens x %" PRIu32 " heads x %" PRIu32
				     " dims x %" PRIu32 " bytes)", i + 1, sz, tb, q->h.num_tokens,
				     m.desc.num_kv_heads, m.desc.head_dim, m.elem_size);
				goto out;
			}
			tensors[i] = zmq_msg_data(&q->payload[i]);
		}
	}
	rc = store_chunk_put(q->srv->store, &m, q->h.hash, q->h.num_tokens, q->h.base_pos,
			     tensors, &ci);
	/* A full map while replies from the store's pages wait unread: their snapshots
	 * keep freed pages from reuse, so their connections go first (not only after
	 * reply_timeout_ms; never when that is 0), then the write again. */
	if (rc == -ENOSPC && q->srv->cfg->reply_timeout_ms &&
	    held_expire_for_room(&q->srv->held, HELD_GRACE_MS, 500))
		rc = store_chunk_put(q->srv->store, &m, q->h.hash, q->h.num_tokens,
				     q->h.base_pos, tensors, &ci);
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
	if (in)
		shared_buf_unref(NULL, in);
	free(snapshot);
	free(tensors);
}

void put_void_bulk(struct req *q)
{
	struct bulk_conn *bc;

	if (q->srv->bulk && !bulk_take(q->srv->bulk, q->h.bulk_ticket, q->principal, q->conn_id,
				       q->conn_id_len, &bc))
		bulk_cut(q->srv->bulk, bc);
}

int take_bulk_payload(struct req *q, const char *what, struct bulk_conn **bc)
{
	*bc = NULL;
	if (!q->h.has_bulk_ticket)
		return 0;
	if (!q->srv->bulk)
		return fail(q, KVBP_BAD_FRAMES, "%s with a bulk ticket, but this daemon has no "
			    "bulk connections (tcp_bulk off): send the payload in frames", what);
	if (bulk_take(q->srv->bulk, q->h.bulk_ticket, q->principal, q->conn_id, q->conn_id_len,
		      bc))
		return fail(q, KVBP_BAD_FRAMES, "%s with a bulk ticket this client has no open "
			    "bulk connection for on this connection (closed, expired or never "
			    "opened): open another, or send the payload in frames", what);
	return 0;
}

void op_put(struct req *q)
{
	struct bulk_conn *bc;

	if (take_bulk_payload(q, "put", &bc))
		return;
	put_run(q, &bc);
	if (bc) /* refused before its payload was read */
		bulk_cut(q->srv->bulk, bc);
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
	const struct rope_table *rot; /* NULL, or rope_tables_for_desc's pair */
	struct blend_shape shape;
	uint32_t tokens;
	/* GET of a head range: each part decodes its layers whole (every head, tb bytes a
	 * tensor) into tmp, then copies each token's heads [h0, h0 + shape.heads) to dst,
	 * otb bytes a tensor, where the keys are re-rotated; without one tmp is NULL and
	 * otb is tb */
	uint8_t *tmp;
	uint32_t h0;
	uint64_t otb;
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

	uint8_t *dst = g->dst + (uint64_t)(a - g->lb) * 2 * g->otb;
	uint8_t *in = g->tmp ? g->tmp + (uint64_t)(a - g->lb) * 2 * g->tb : dst;
	int rc;

	if (a == b)
		return 0;
	rc = store_chunk_get(g->store, g->m, g->hash, a, b, in, (uint64_t)(b - a) * 2 * g->tb, NULL);
	if (!rc && g->tmp) {
		/* bytes of one head of one token; the sizes were checked by op_get */
		size_t hb = (size_t)(g->tb / g->tokens / g->m->desc.num_kv_heads);
		size_t row = hb * g->shape.heads;

		for (uint32_t j = 0; j < 2 * (b - a); j++) {
			const uint8_t *s = in + (uint64_t)j * g->tb + (size_t)g->h0 * hb;
			uint8_t *o = dst + (uint64_t)j * g->otb;

			for (uint32_t t = 0; t < g->tokens; t++, o += row,
			     s += hb * g->m->desc.num_kv_heads)
				memcpy(o, s, row);
		}
	}
	for (uint32_t l = a; !rc && g->rot && l < b; l++, dst += 2 * g->otb)
		rc = g->be->rotate(g->be, &g->shape, rope_table_of_layer(&g->m->desc, g->rot, l),
				   dst, dst, 0, g->tokens);
	if (!rc && g->progress) {
		struct get_split *w = (struct get_split *)g;

		pthread_mutex_lock(&w->lock);
		w->done[i] = 1;
		while (w->prefix < w->parts && w->done[w->prefix])
			w->prefix++;
		/* parts are layer ranges in order: the prefix's end in bytes */
		atomic_store_explicit(w->progress,
				      (uint64_t)((uint64_t)(le_of(w, w->prefix) - w->lb)) * 2 * w->otb,
				      memory_order_release);
		pthread_mutex_unlock(&w->lock);
	}
	return rc;
}

/* Below this a GET is not worth splitting: thread hand-offs cost more than they save. */
#define SPLIT_MIN_BYTES (4u << 20)

/*
 * Decode layers [lb, le) of the request's chunk into dst (total bytes), re-rotated by
 * the pair of tables rot (rope_tables_for_desc) when not NULL. With a head range
 * (heads > 0: stored heads [h0, h0 + heads)) dst holds only those, otb bytes a tensor,
 * and tmp (2 * (le - lb) * tb bytes) takes the whole layers first; else tmp is NULL and
 * otb is tb.
 */
static int chunk_get_parallel(struct req *q, const struct store_model *m, uint32_t lb, uint32_t le,
			      void *dst, uint64_t tb, uint64_t total, const struct rope_table *rot,
			      uint32_t tokens, _Atomic uint64_t *progress, uint8_t *tmp,
			      uint32_t h0, uint32_t heads, uint64_t otb)
{
	struct get_split g = { q->srv->store, m, q->h.hash, lb, le, 1, dst, tb, q->srv->blend, rot,
			       { heads ? heads : m->desc.num_kv_heads, m->desc.head_dim, 0,
				 ROPE_NEOX, (enum blend_dtype)m->desc.dtype },
			       tokens, tmp, h0, tmp ? otb : tb };
	unsigned threads = pool_threads(q->srv->pool) + 1;
	struct rope_config rc_cfg;
	int rc;

	rope_config_from_desc(&m->desc, false, &rc_cfg);
	g.shape.rotary_dim = rc_cfg.rotary_dim;
	g.shape.style = rc_cfg.style;

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
	size_t n = 2 * (size_t)(le - lb);
	/* on a bulk connection, verified as sent (send.c) */
	bool lazy = q->out->has_bulk && q->srv->bulk;
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
	/* For a bulk connection, each layer is verified as it is sent (send.c: the check
	 * reads it into the cache the send reads it from), not all first. */
	if (!lazy && view_verify_all(q->srv, v)) {
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
	hold->registry = &q->srv->held;
	held_add(hold->registry, &hold->held, q->fd, q->principal);
	q->out->held = &hold->held;
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
			if (lazy) {
				q->out->verify_view = v;
				q->out->verify_model = *m;
				memcpy(q->out->verify_hash, q->h.hash, KVBP_HASH_LEN);
			}
		}
	}
	shared_buf_unref(NULL, hold);
	return 0;
}

void op_get(struct req *q)
{
	struct store_model m;
	struct store_chunk_info ci;
	struct shared_buf *buf = NULL;
	struct rope_table rot[2] = { { 0 } };
	uint32_t lb = q->h.layer_begin, le = q->h.layer_end;
	uint32_t h0 = q->h.head_begin, hn = q->h.head_count;
	uint64_t tb, total, otb, ototal;
	uint8_t *tmp = NULL;
	void *dst = NULL;
	int rc;

	if (need_model(q, &m) || need_hash(q) || no_payload(q))
		return;
	if (!hn && h0) {
		fail(q, KVBP_BAD_ARGUMENT, "head_begin %" PRIu32 " without head_count", h0);
		return;
	}
	/* ckd-ok: two 32-bit numbers summed in 64 bits */
	if ((uint64_t)h0 + hn > m.desc.num_kv_heads) {
		fail(q, KVBP_BAD_ARGUMENT, "heads %" PRIu32 "..%" PRIu64 " beyond the model's %"
		     PRIu32 " KV heads", h0, (uint64_t)h0 + hn - 1 /* ckd-ok: as above */,
		     m.desc.num_kv_heads);
		return;
	}
	if (hn == m.desc.num_kv_heads)
		hn = 0; /* every head: the plain GET */
	if (le == 0)
		le = m.desc.num_layers;
	if (lb >= le || le > m.desc.num_layers) {
		fail(q, KVBP_BAD_ARGUMENT, "layer range %" PRIu32 ":%" PRIu32 " invalid for a %"
		     PRIu32 "-layer model", lb, le, m.desc.num_layers);
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
	/* a head range: hn of the heads, whose bytes divide tb exactly (tokens x heads x
	 * head_dim x element) */
	otb = hn ? tb / m.desc.num_kv_heads * hn : tb; /* ckd-ok: at most tb */
	ototal = hn ? total / m.desc.num_kv_heads * hn : total; /* ckd-ok: at most total */
	if (!hn && !q->h.rerotate && !q->h.has_shm && total >= VIEW_MIN_BYTES &&
	    get_from_view(q, &m, lb, le, tb, total) == 0)
		return;
	if (q->h.rerotate) {
		/* A chunk alone at target_pos: dynamic NTK sees target_pos + T positions. */
		/* ckd-ok: two 32-bit numbers summed in 64 bits */
		if ((uint64_t)q->h.target_pos + ci.num_tokens > UINT32_MAX) {
			fail(q, KVBP_BAD_ARGUMENT, "target position %" PRIu32 " + %" PRIu32 " tokens "
			     "overflows", q->h.target_pos, ci.num_tokens);
			return;
		}
		rc = rope_tables_for_desc(&m.desc, ci.num_tokens, ci.base_pos,
					  (uint64_t)ci.base_pos + ci.num_tokens, q->h.target_pos,
					  (uint64_t)q->h.target_pos + ci.num_tokens, /* ckd-ok: above */
					  rot);
		if (rc) {
			fail(q, KVBP_INTERNAL, "rotation table: %s", strerror(-rc));
			return;
		}
	}
	if (q->h.has_shm) {
		if (q->h.shm_length < ototal) {
			fail(q, KVBP_BAD_SHM, "shared-memory span of %" PRIu64 " bytes is too small; "
			     "the chunk needs %" PRIu64, q->h.shm_length, ototal);
			one_chunk_reply(q, q->h.hash, &ci); /* so that the client learns the size */
			goto out;
		}
		if (q->h.head_count && q->h.shm_length != ototal) {
			/* the client cannot tell a head range's size from the chunk's info */
			fail(q, KVBP_BAD_SHM, "shared-memory span of %" PRIu64 " bytes does not "
			     "match the %" PRIu64 " bytes of heads %" PRIu32 "..%" PRIu64, q->h.shm_length,
			     ototal, h0, (uint64_t)h0 + q->h.head_count - 1 /* ckd-ok: checked above */);
			goto out;
		}
		rc = shm_acquire(q->srv->shm, q->h.shm_id, q->principal, q->h.shm_offset, ototal,
				 &dst);
		if (rc) {
			fail(q, KVBP_BAD_SHM, "shared-memory segment %" PRIu64 ": %s", q->h.shm_id,
			     rc == -ENOENT ? "unknown, expired or not this client's"
					   : "span outside the segment");
			goto out;
		}
	} else {
		buf = reply_buf(q, ototal);
		if (!buf)
			goto out;
		dst = buf->data;
	}
	if (hn && !(tmp = malloc(total))) {
		fail(q, KVBP_LIMIT, "out of memory");
		if (q->h.has_shm)
			shm_release(q->srv->shm, q->h.shm_id);
		goto out;
	}
	{
		_Atomic uint64_t *progress = NULL;
		void *pw = NULL;

		/* A progress word inside the client's segment, 8-byte aligned, apart from the data. */
		if (q->h.has_shm && q->h.progress && (q->h.progress - 1) % 8 == 0 &&
		    shm_acquire(q->srv->shm, q->h.shm_id, q->principal, q->h.progress - 1, 8, &pw) == 0)
			progress = pw;
		rc = chunk_get_parallel(q, &m, lb, le, dst, tb, ototal, q->h.rerotate ? rot : NULL,
					ci.num_tokens, progress, tmp, h0, hn, otb);
		if (pw)
			shm_release(q->srv->shm, q->h.shm_id);
	}
	free(tmp);
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
				zmq_msg_init_data(&q->out->payload[i], buf->data + i * otb, otb,
						  shared_buf_unref, buf);
			}
			q->out->n_payload = n;
			q->out->rep.payload_frames = (uint32_t)n;
		}
	}
out:
	if (buf)
		shared_buf_unref(NULL, buf);
	rope_table_free(&rot[0]);
	rope_table_free(&rot[1]);
}

void op_lookup(struct req *q)
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

void op_delete(struct req *q)
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

void op_list(struct req *q)
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

#define PIN_TTL_MAX (30u * 86400)

void op_pin(struct req *q)
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

void op_unpin(struct req *q)
{
	struct store_model m;

	if (need_model(q, &m) || need_hash(q) || no_payload(q))
		return;
	if (evictor_unpin(q->srv->evict, m.id, q->h.hash))
		fail(q, KVBP_NOT_FOUND, "chunk is not pinned");
}
