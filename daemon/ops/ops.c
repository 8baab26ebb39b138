/* ops — the table of operations and the dispatch of one request; see ops.h and impl.h. */
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

/*
 * Every operation: its handler and what sets it apart (ops.h OPF_*), as Redis's command
 * table carries each command's flags; nothing outside this table asks which
 * operation a request is.
 */
static const struct op_entry {
	void (*fn)(struct req *q);
	unsigned flags;
} ops_table[KVBP_OP_COUNT] = {
	[KVBP_OP_HELLO] = { op_hello, 0 },
	[KVBP_OP_MODEL_REGISTER] = { op_model_register, 0 },
	[KVBP_OP_MODEL_LIST] = { op_model_list, 0 },
	[KVBP_OP_PUT] = { op_put, OPF_BULK_IN },
	[KVBP_OP_GET] = { op_get, OPF_BULK_OUT },
	[KVBP_OP_LOOKUP] = { op_lookup, OPF_MEMBER_NAMESPACES },
	[KVBP_OP_DELETE] = { op_delete, 0 },
	[KVBP_OP_STATS] = { op_stats, 0 },
	[KVBP_OP_LIST] = { op_list, 0 },
	[KVBP_OP_SHM_ATTACH] = { op_shm_attach, 0 },
	[KVBP_OP_SHM_DETACH] = { op_shm_detach, 0 },
	[KVBP_OP_FUSE_OPEN] = { op_fuse_open, 0 },
	[KVBP_OP_FUSE_LAYER] = { op_fuse_layer, 0 },
	[KVBP_OP_FUSE_CLOSE] = { op_fuse_close, 0 },
	/* a FETCH's parts are each layer's stored bytes, of sizes the member cannot know */
	[KVBP_OP_FETCH] = { op_fetch, OPF_BULK_OUT | OPF_BULK_PARTS | OPF_MEMBER_NAMESPACES },
	[KVBP_OP_REPLICATE] = { op_replicate, OPF_BULK_IN | OPF_MEMBER_NAMESPACES },
	[KVBP_OP_PIN] = { op_pin, 0 },
	[KVBP_OP_UNPIN] = { op_unpin, 0 },
};

void ops_handle(struct server *srv, const struct ops_origin *from, zmq_msg_t *frames, size_t n,
		size_t extra_frames, struct reply_out *out)
{
	struct req q = { .srv = srv, .principal = from->principal, .ns = from->ns ? from->ns : "",
			 .acct = from->acct, .out = out, .fd = from->fd, .lane = from->lane,
			 .conn_id = from->conn_id, .conn_id_len = from->conn_id_len,
			 .reserved = from->reserved };
	uint64_t total = 0;
	char err[KVBP_MESSAGE_MAX];
	bool ran = false;
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
	q.flags = out->flags = out->op < KVBP_OP_COUNT ? ops_table[out->op].flags : 0;
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
	if (q.h.version < KVBP_VERSION || q.h.version > KVBP_VERSION_MAX) {
		fail(&q, KVBP_BAD_VERSION, "protocol version %" PRIu32 " not supported; this server "
		     "speaks versions %d to %d", q.h.version, KVBP_VERSION, KVBP_VERSION_MAX);
		goto done;
	}
	if (q.h.op >= KVBP_OP_COUNT || !ops_table[q.h.op].fn) {
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
	/* a payload that may go out on the bulk connection of the ticket (send.c) */
	if ((q.flags & OPF_BULK_OUT) && q.h.has_bulk_ticket) {
		out->has_bulk = true;
		memcpy(out->bulk_ticket, q.h.bulk_ticket, sizeof(out->bulk_ticket));
	}
	ran = true;
	ops_table[q.h.op].fn(&q);
done:
	/* a request refused unrun whose payload waits on its bulk connection */
	if (!rc && !ran && (q.flags & OPF_BULK_IN) && q.h.has_bulk_ticket)
		put_void_bulk(&q);
	if (out->defer) { /* counted when the lane runs it */
		kvbp_request_clear(&q.h);
		return;
	}
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
