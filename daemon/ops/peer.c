/* ops/peer — FETCH and REPLICATE, the requests members make of each other; see impl.h. */
#include "daemon/ops/impl.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/ckd.h"
#include "daemon/clients.h"
#include "daemon/bulk.h"
#include "proto/bulk.h"
#include "cluster/cluster.h"
#include "daemon/fdguard.h"
#include "daemon/log.h"
#include "daemon/metrics.h"
#include "daemon/pool.h"
#include "blend/rope.h"

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

void op_fetch(struct req *q)
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

/*
 * REPLICATE (between daemons): store a chunk from its stored bytes, one frame per layer,
 * or (*bc, taken by op_replicate) the layers back to back as records on the member's
 * bulk connection, their sizes in bulk_parts; *bc is set to NULL once given back.
 */
static void replicate_run(struct req *q, struct bulk_conn **bc)
{
	struct store_model m;
	struct store_chunk_info ci;
	struct store_tensor_shape bad = { 0 };
	const void **blobs = NULL;
	size_t *lens = NULL;
	struct shared_buf *in = NULL;
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
	if (chunk_bytes(q, &m, q->h.num_tokens, m.desc.num_layers, &tb, &total))
		return;
	if (*bc ? q->n_payload || q->h.n_bulk_parts != m.desc.num_layers
		: q->n_payload != m.desc.num_layers || q->h.payload_frames != q->n_payload) {
		fail(q, KVBP_BAD_FRAMES, "replicate of a %" PRIu32 "-layer model takes %" PRIu32
		     " payload frames (a layer's stored bytes each), or on a bulk connection "
		     "no frames and %" PRIu32 " bulk_parts; got %zu frames, %zu parts",
		     m.desc.num_layers, m.desc.num_layers, m.desc.num_layers, q->n_payload,
		     q->h.n_bulk_parts);
		return;
	}
	blobs = calloc(m.desc.num_layers, sizeof(*blobs));
	lens = calloc(m.desc.num_layers, sizeof(*lens));
	if (!blobs || !lens) {
		fail(q, KVBP_LIMIT, "out of memory");
		goto out;
	}
	if (*bc) {
		uint64_t sum = 0, bound;
		char why[256];

		/* stored bytes: no more than a chunk of these tokens can take stored
		 * (kvbb_stored_max), as a FETCH's parts are checked (cluster/bulk.c) */
		for (uint32_t l = 0; l < m.desc.num_layers; l++)
			if (q->h.bulk_parts[l] > SIZE_MAX ||
			    ckd_add(&sum, sum, q->h.bulk_parts[l]))
				sum = UINT64_MAX;
		if (kvbb_stored_max(total, m.desc.num_layers, &bound) || !sum || sum > bound) {
			fail(q, KVBP_BAD_FRAMES, "replicate on the bulk connection: bulk_parts add "
			     "up to %" PRIu64 " bytes, for a chunk of %" PRIu64 " raw bytes; nothing "
			     "stored", sum, total);
			goto out;
		}
		/* held on the member's account with the request, as its frames would be */
		in = reply_buf(q, sum);
		if (!in)
			goto out;
		rc = bulk_recv(q->srv->bulk, *bc, q->h.request_id, in->data, sum, why, sizeof(why));
		*bc = NULL;
		if (rc) {
			fail(q, KVBP_BAD_FRAMES, "replicate of %" PRIu64 " bytes on the bulk "
			     "connection: %s; nothing stored", sum, why);
			goto out;
		}
		/* ckd-ok: the parts' running sum, checked above to add up to sum */
		for (uint64_t l = 0, off = 0; l < m.desc.num_layers; off += q->h.bulk_parts[l++]) {
			blobs[l] = in->data + off;
			lens[l] = (size_t)q->h.bulk_parts[l];
		}
	} else {
		for (uint32_t l = 0; l < m.desc.num_layers; l++) {
			blobs[l] = zmq_msg_data(&q->payload[l]);
			lens[l] = zmq_msg_size(&q->payload[l]);
		}
	}
	rc = store_chunk_import(q->srv->store, &m, q->h.hash, q->h.num_tokens, q->h.base_pos,
				blobs, lens, &ci, &bad);
	for (int tries = 0; rc == -ENOSPC && tries < 3; tries++) {
		if (evictor_make_room(q->srv->evict, 2 * total + (1u << 20), q->ns) < 0)
			break;
		rc = store_chunk_import(q->srv->store, &m, q->h.hash, q->h.num_tokens,
					q->h.base_pos, blobs, lens, &ci, &bad);
	}
	if (rc == -EBADMSG) {
		fail(q, KVBP_CORRUPT, "replicate: the chunk's bytes fail their checks (header, "
		     "size or checksum); nothing stored");
		goto out;
	}
	if (rc == -ENOTSUP) {
		fail(q, KVBP_BAD_SHAPE, "replicate: layer %" PRIu32 "'s %s is quantized as %" PRIu32
		     " rows x %" PRIu32 " channels; this model's tensors are read one row per token: "
		     "%" PRIu32 " rows x %" PRIu32 " channels (%" PRIu32 " kv_heads x %" PRIu32
		     " head_dim); nothing stored", bad.layer, bad.plane ? "V" : "K", bad.rows,
		     bad.channels, q->h.num_tokens, m.desc.num_kv_heads * m.desc.head_dim,
		     m.desc.num_kv_heads, m.desc.head_dim);
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
	if (in)
		shared_buf_unref(NULL, in);
	free(blobs);
	free(lens);
}

void op_replicate(struct req *q)
{
	struct bulk_conn *bc;

	if (take_bulk_payload(q, "replicate", &bc))
		return;
	replicate_run(q, &bc);
	if (bc) /* refused before its payload was read */
		bulk_cut(q->srv->bulk, bc);
}
