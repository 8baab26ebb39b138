/* server_threads — kvblendd's worker threads and the lane's runner: a request decoded,
 * run and answered; see server_impl.h. */
#include "daemon/server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <zmq.h>

#include "daemon/work.h"
#include "daemon/clients.h"
#include "cluster/cluster.h"
#include "daemon/curve.h"
#include "daemon/fdguard.h"
#include "daemon/lane.h"
#include "daemon/log.h"
#include "daemon/metrics.h"
#include "daemon/notify.h"
#include "daemon/ops/ops.h"
#include "daemon/pool.h"
#include "daemon/server_impl.h"

/* Receive one whole message, keeping at most cap frames; counts the rest in *extra.
 * The parts of a multipart message arrive together, so no call here blocks. */
int server_recv_frames(void *sock, zmq_msg_t *frames, size_t cap, size_t *n, size_t *extra)
{
	int more = 1;

	*n = 0;
	*extra = 0;
	while (more) {
		zmq_msg_t tmp, *m = *n < cap ? &frames[*n] : &tmp;

		zmq_msg_init(m);
		if (zmq_msg_recv(m, sock, ZMQ_DONTWAIT) < 0) {
			int e = errno;

			zmq_msg_close(m);
			for (size_t i = 0; i < *n; i++)
				zmq_msg_close(&frames[i]);
			return -e;
		}
		more = zmq_msg_more(m);
		if (m == &tmp) {
			zmq_msg_close(m);
			(*extra)++;
		} else {
			(*n)++;
		}
	}
	return 0;
}

/* Does the message have the whole envelope, delimiter included? */
static bool envelope_ok(zmq_msg_t *frames, size_t n)
{
	return n >= ENVELOPE_LEN && zmq_msg_size(&frames[ENVELOPE_LEN - 1]) == 0;
}

/* An error reply built without a request handler (refused envelope, shutting down). */
static void reply_error(struct reply_out *out, uint32_t code, const char *msg)
{
	memset(out, 0, sizeof(*out));
	out->rep.version = KVBP_VERSION;
	out->rep.code = code;
	out->op = KVBP_OP_COUNT;
	snprintf(out->rep.message, sizeof(out->rep.message), "%s", msg);
}

/*
 * A request too costly for a worker (out->defer): its frames to the lane (true), or,
 * when the lane is full, out becomes `busy` to send as usual (false).
 */
static bool defer_to_lane(struct server *srv, zmq_msg_t *frames, size_t n, struct reply_out *out)
{
	int rc = srv->lane ? lane_submit(srv->lane, frames, n) : -ENOTSUP;

	out->defer = false;
	if (!rc)
		return true;
	out->rep.code = KVBP_BUSY;
	snprintf(out->rep.message, sizeof(out->rep.message), "%d cluster checks wait already; "
		 "retry when they are done", LANE_WAITING);
	atomic_fetch_add(&srv->stats.requests[out->op], 1);
	atomic_fetch_add(&srv->stats.errors[KVBP_BUSY], 1);
	return false;
}

/* The lane runs a deferred request (lane.h): as a worker would, its reply on sock. */
void server_lane_run(void *ctx, void *sock, zmq_msg_t *frames, size_t n)
{
	struct server *srv = ctx;
	struct req_tag tag;
	struct ops_origin from;
	struct reply_out out;

	memcpy(&tag, zmq_msg_data(&frames[0]), sizeof(tag)); /* (checked by the worker) */
	tag.principal[sizeof(tag.principal) - 1] = 0;
	tag.ns[sizeof(tag.ns) - 1] = 0;
	from = (struct ops_origin){ tag.principal, tag.ns, tag.acct,
				    atomic_load(&srv->stopping) ? OPS_REFUSE_STOPPING : OPS_RUN,
				    tag.fd, true, zmq_msg_data(&frames[1]), zmq_msg_size(&frames[1]),
				    tag.reserved };
	ops_handle(srv, &from, frames + ENVELOPE_LEN, n - ENVELOPE_LEN, 0, &out);
	for (size_t i = ENVELOPE_LEN; i < n; i++)
		zmq_msg_close(&frames[i]);
	ops_send(srv, &(struct ops_dest){ sock, frames, ENVELOPE_LEN, false, tag.principal },
		 &out);
	reply_out_clear(&out);
}

void *server_worker_main(void *arg)
{
	struct server *srv = arg;
	size_t cap = srv->in_cap + 1; /* the tag, then what the main thread forwarded */
	zmq_msg_t *frames = calloc(cap, sizeof(*frames));
	void *sock = zmq_socket(srv->zctx, ZMQ_DEALER);
	int linger = 0;

	if (!frames || !sock || zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof(linger)) ||
	    zmq_connect(sock, WORKER_ENDPOINT)) {
		log_err("worker failed to start: %s", frames ? zmq_strerror(errno) : "no memory");
		goto out;
	}
	while (!atomic_load(&srv->stop_workers)) {
		struct reply_out out;
		size_t n, extra, env;
		struct timespec t0, t1;
		zmq_msg_t empty;
		struct req_tag tag;
		struct ops_origin from;

		/* the oldest request, when this worker is free (work.h); replies on sock */
		n = work_pop(srv->work, frames, cap, POLL_MS);
		extra = 0;
		if (!n)
			continue;
		if (n && zmq_msg_size(&frames[0]) == sizeof(tag)) {
			memcpy(&tag, zmq_msg_data(&frames[0]), sizeof(tag));
			tag.principal[sizeof(tag.principal) - 1] = 0;
		} else {
			memset(&tag, 0, sizeof(tag));
		}
		extra += tag.extra;
		tag.ns[sizeof(tag.ns) - 1] = 0;
		from = (struct ops_origin){ tag.principal, tag.ns, tag.acct, tag.refuse, tag.fd,
					    false, n > 1 ? zmq_msg_data(&frames[1]) : NULL,
					    n > 1 ? zmq_msg_size(&frames[1]) : 0, tag.reserved };
		/* A request queued here when the stop began is not started: busy, at once. */
		if (from.refuse == OPS_RUN && atomic_load(&srv->stopping))
			from.refuse = OPS_REFUSE_STOPPING;
		clock_gettime(CLOCK_MONOTONIC, &t0);
		if (!envelope_ok(frames, n)) {
			/* Answered after the routing id, with a delimiter of our own. */
			env = n < 2 ? n : 2;
			reply_error(&out, KVBP_BAD_FRAMES, "message has no empty delimiter frame "
				    "before its header; send [\"\"] [header] [payload ...] (see "
				    "docs/protocol.md)");
			atomic_fetch_add(&srv->stats.errors[KVBP_BAD_FRAMES], 1);
			atomic_fetch_add(&srv->stats.requests[KVBP_OP_COUNT], 1);
			for (size_t i = env; i < n; i++)
				zmq_msg_close(&frames[i]);
			ops_send(srv, &(struct ops_dest){ sock, frames, env, true, tag.principal },
				 &out);
		} else {
			env = ENVELOPE_LEN;
			if (env == n) {
				/* No header frame at all: answer as for an empty one. */
				zmq_msg_init(&empty);
				ops_handle(srv, &from, &empty, 1, extra, &out);
				zmq_msg_close(&empty);
			} else {
				ops_handle(srv, &from, frames + env, n - env, extra,
					   &out);
			}
			if (out.defer && defer_to_lane(srv, frames, n, &out)) {
				reply_out_clear(&out);
				continue; /* the lane answers it */
			}
			for (size_t i = env; i < n; i++)
				zmq_msg_close(&frames[i]);
			ops_send(srv, &(struct ops_dest){ sock, frames, env, false, tag.principal },
				 &out);
		}
		{
			uint64_t ns;

			clock_gettime(CLOCK_MONOTONIC, &t1);
			ns = (uint64_t)(t1.tv_sec - t0.tv_sec) * 1000000000u + (uint64_t)t1.tv_nsec -
			     (uint64_t)t0.tv_nsec;
			atomic_fetch_add(&srv->stats.lat_bucket[out.op][metrics_bucket(ns)], 1);
			atomic_fetch_add(&srv->stats.lat_sum_ns[out.op], ns);
			atomic_fetch_add(&srv->stats.lat_count[out.op], 1);
		}
		/* Work the node waits on next: the fuse loader takes the session's layers now. */
		fuse_kick(srv->fuse, out.kick_session);
		reply_out_clear(&out);
	}
out:
	if (sock)
		zmq_close(sock);
	free(frames);
	atomic_fetch_sub(&srv->running_workers, 1);
	return NULL;
}
