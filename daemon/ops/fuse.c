/* ops/fuse — FUSE_OPEN, FUSE_LAYER and FUSE_CLOSE over the fuse session engine; see impl.h. */
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

void op_fuse_open(struct req *q)
{
	struct fuse_open_result r;
	struct store_model m;
	char err[KVBP_MESSAGE_MAX];
	uint32_t code;

	if (need_model(q, &m) || no_payload(q))
		return;
	if (q->h.attention) {
		fail(q, KVBP_BAD_ARGUMENT, "A (attention) comes with a layer request of the session, "
		     "not with the open");
		return;
	}
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
	q->out->rep.land_k_strided = r.land_k_strided;
	q->out->rep.land_heads = r.land_heads;
	/* The session's model, so that the client needs no lookup of its own (without it,
	 * out of memory here, the client asks MODEL_LIST as before). */
	q->out->rep.models = calloc(1, sizeof(struct kvbp_model));
	if (q->out->rep.models) {
		model_from_store(&m, q->out->rep.models);
		snprintf(q->out->rep.models->name, sizeof(q->out->rep.models->name), "%s",
			 q->h.model_name);
		q->out->rep.n_models = 1;
	}
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
	q->out->kick_session = r.id;
	log_debug("fuse session %016" PRIx64 " opened: %" PRIu32 " tokens, model '%s'", r.id,
		  r.num_tokens, m.name);
}

/*
 * A request's A (q->h.attention: its last payload frame, float32 [chunk tokens, kv
 * heads]), checked against the session: 0 with *a (NULL when the request has none),
 * or -1 with q failed.
 */
static int attention_frame(struct req *q, const struct fuse_layer_plan *plan, const void **a)
{
	*a = NULL;
	if (!q->h.attention)
		return 0;
	if (!plan->attn) {
		fail(q, KVBP_BAD_ARGUMENT, "A (attention) is taken only by a session opened with the "
		     "attention metric");
		return -1;
	}
	if (!q->n_payload || !q->h.payload_frames) {
		fail(q, KVBP_BAD_FRAMES, "the request says it carries A but has no payload frame");
		return -1;
	}
	if (zmq_msg_size(&q->payload[q->n_payload - 1]) != plan->attn_bytes) {
		fail(q, KVBP_BAD_SHAPE, "A is %zu bytes; expected %" PRIu64 " (float32, chunk tokens x "
		     "kv heads)", zmq_msg_size(&q->payload[q->n_payload - 1]), plan->attn_bytes);
		return -1;
	}
	*a = zmq_msg_data(&q->payload[q->n_payload - 1]);
	return 0;
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
	size_t row_bytes = plan->check_row_bytes, n_rows_frames;
	uint64_t stride = q->h.row_stride ? q->h.row_stride : row_bytes, span = 0;
	const void *rows, *attn;
	void *in_shm = NULL;
	uint32_t code;
	int mode = (int)q->h.check_mode;

	if (q->h.check_mode > FUSE_CHECK_SELECT_BY) {
		fail(q, KVBP_BAD_ARGUMENT, "check_mode %" PRIu32 ": 0 selects by the rows sent, 1 "
		     "answers their deviations, 2 selects by the deviations sent", q->h.check_mode);
		return;
	}
	if (mode == FUSE_CHECK_SELECT_BY) {
		/* One frame: float32 deviations, one a current row (the ranks' sum). */
		uint64_t want = (uint64_t)plan->rows_in * sizeof(float);

		if (q->h.has_shm || q->n_payload != 1 || q->h.payload_frames != 1) {
			fail(q, KVBP_BAD_FRAMES, "check_mode 2 takes 1 payload frame (the float32 "
			     "deviations) and no shared memory; got %zu frames%s", q->n_payload,
			     q->h.has_shm ? " and shared memory" : "");
			return;
		}
		if (q->h.rows != plan->rows_in || zmq_msg_size(&q->payload[0]) != want) {
			fail(q, KVBP_BAD_SHAPE, "check layer %" PRIu32 ": %zu bytes of deviations for "
			     "%" PRIu32 " rows; expected %" PRIu64 " (float32, one a row of the %s)",
			     q->h.layer, zmq_msg_size(&q->payload[0]), q->h.rows, want,
			     plan->rows_in == plan->num_tokens ? "prompt" : "current selection");
			return;
		}
		code = fuse_check_run(q->srv->fuse, s, mode, NULL, 0, NULL,
				      zmq_msg_data(&q->payload[0]), &res, err, sizeof(err));
		goto answered;
	}
	if (attention_frame(q, plan, &attn))
		return;
	/* The frames before A: the rows (none when they are in shared memory). */
	n_rows_frames = q->n_payload - (attn != NULL);
	if (q->h.rows != plan->rows_in) {
		fail(q, KVBP_BAD_SHAPE, "check layer %" PRIu32 " takes %" PRIu32 " rows (%s); the "
		     "request declares %" PRIu32, q->h.layer, plan->rows_in,
		     plan->rows_in == plan->num_tokens ? "all tokens" : "the current selection",
		     q->h.rows);
		return;
	}
	if (q->h.has_shm) {
		if (stride < row_bytes) {
			fail(q, KVBP_BAD_SHAPE, "row_stride %" PRIu64 " is below the row size %zu",
			     stride, row_bytes);
			return;
		}
		if (plan->rows_in &&
		    ckd_mul_add(&span, (uint64_t)(plan->rows_in - 1), stride, row_bytes)) {
			fail(q, KVBP_BAD_SHAPE, "%" PRIu32 " rows %" PRIu64 " bytes apart overflow",
			     plan->rows_in, stride);
			return;
		}
		if (n_rows_frames || q->h.shm_length < span) {
			fail(q, KVBP_BAD_SHAPE, "shared-memory input is %" PRIu64 " bytes in %zu "
			     "frames; %" PRIu32 " rows %" PRIu64 " bytes apart span %" PRIu64 ", and no "
			     "frames", q->h.shm_length, n_rows_frames, plan->rows_in, stride, span);
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
		uint64_t want = (uint64_t)plan->rows_in * row_bytes;

		if (n_rows_frames != 1 || q->h.payload_frames != 1 + (attn != NULL)) {
			fail(q, KVBP_BAD_FRAMES, "a check layer of a landing session takes 1 payload "
			     "frame (the %s rows)%s; got %zu", plan->attn ? "K then V" :
			     "metric plane's", attn ? " before A" : "", n_rows_frames);
			return;
		}
		if (zmq_msg_size(&q->payload[0]) != want) {
			fail(q, KVBP_BAD_SHAPE, "the metric rows are %zu bytes; expected %" PRIu64
			     " (%" PRIu32 " rows x %zu bytes)", zmq_msg_size(&q->payload[0]), want,
			     plan->rows_in, row_bytes);
			return;
		}
		rows = zmq_msg_data(&q->payload[0]);
		stride = row_bytes;
	}
	code = fuse_check_run(q->srv->fuse, s, mode, rows, stride, attn, NULL, &res, err,
			      sizeof(err));
	if (in_shm)
		shm_release(q->srv->shm, q->h.shm_id);
answered:
	if (code) {
		fail(q, code, "%s", err);
		free(res.selection);
		free(res.dropped);
		free(res.deviation);
		return;
	}
	if (mode == FUSE_CHECK_DEVIATION) {
		q->out->rep.num_tokens = plan->num_tokens;
		q->out->rep.next_layer = res.next_layer;
		q->out->rep.rows_next = res.rows_next;
		q->out->rep.deviation = res.deviation;
		q->out->rep.n_deviation = res.n_deviation;
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

void op_fuse_layer(struct req *q)
{
	struct fuse_layer_plan plan;
	struct fuse_layer_result res = { 0 };
	struct fuse_session *s;
	struct shared_buf *buf = NULL;
	char err[KVBP_MESSAGE_MAX];
	const uint8_t *k_in, *v_in;
	const void *attn;
	uint8_t *out = NULL;
	void *in_shm = NULL;
	uint64_t in_bytes, out_bytes;
	size_t n_kv; /* payload frames before A */
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
	if (attention_frame(q, &plan, &attn))
		goto out;
	n_kv = q->n_payload - (attn != NULL);
	/* The ring is shared only if this client mapped it: else the layer goes in frames. */
	plan.shared_ring = plan.shared_ring && q->h.shared_ring;
	if (q->h.device_out && !plan.device_ring) {
		fail(q, KVBP_BAD_ARGUMENT, "device_out: this session's ring is not exported (the "
		     "daemon fuses on %s, or the open did not ask for device_out); take the layer "
		     "in host memory", q->srv->dev_ordinal >= 0 ? "a CUDA device, but the export failed" :
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
		if (n_kv || q->h.shm_length != 2 * in_bytes) {
			fail(q, KVBP_BAD_SHAPE, "shared-memory input is %" PRIu64 " bytes in %zu frames; "
			     "expected %" PRIu64 " (K then V of %" PRIu32 " rows) and no frames",
			     q->h.shm_length, n_kv, 2 * in_bytes, plan.rows_in);
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
		if (n_kv != 2 || q->h.payload_frames != 2 + (attn != NULL)) {
			fail(q, KVBP_BAD_FRAMES, "fuse_layer takes 2 payload frames (fresh K, fresh V)%s; "
			     "got %zu", attn ? " before A" : "", n_kv);
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
			      q->h.device_out, attn, &res, err, sizeof(err));
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
		q->out->kick_session = q->h.session_id;
out:
	fuse_layer_end(q->srv->fuse, s);
	if (in_shm)
		shm_release(q->srv->shm, q->h.shm_id);
	if (buf)
		shared_buf_unref(NULL, buf);
	free(res.selection);
}

void op_fuse_close(struct req *q)
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
