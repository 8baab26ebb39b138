/* server_threads — kvblendd's worker threads, the prefetch thread and the lane's
 * runner: a request decoded, run and answered; see server_impl.h. */
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
#include <openssl/crypto.h>
#include <zmq.h>

#include "daemon/bulk.h"
#include "daemon/work.h"
#include "proto/bulk.h"
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

/* Layers whose payload a bulk diversion lists on the stack (more: malloc). */
#define KVBP_LAYERS_IOV 128
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

/*
 * Send the reply: the first n_env frames of env (tag and routing id, and the
 * delimiter when the request had one), then an empty delimiter when add_delim, then
 * the header and any payload.
 */
static void send_reply(struct server *srv, void *sock, zmq_msg_t *env, size_t n_env,
		       bool add_delim, struct reply_out *out)
{
	uint8_t *hdr = NULL;
	size_t len = 0;
	uint64_t bytes = 0;
	bool payload = out->rep.code == KVBP_OK && out->n_payload;

	if (!payload)
		out->rep.payload_frames = 0;
	for (size_t i = 0; i < n_env; i++)
		if (zmq_msg_send(&env[i], sock, ZMQ_SNDMORE) < 0)
			zmq_msg_close(&env[i]);
	if (add_delim)
		zmq_send(sock, "", 0, ZMQ_SNDMORE);
	if (kvbp_reply_encode(&out->rep, &hdr, &len)) {
		/* Out of memory: still answer, with an empty frame, rather than leave a hang. */
		zmq_send(sock, "", 0, 0);
		return;
	}
	zmq_send(sock, hdr, len, payload ? ZMQ_SNDMORE : 0);
	bytes += len;
	if (out->rep.has_bulk_key) { /* the key lives on only in the bulk connection */
		OPENSSL_cleanse(hdr, len);
		OPENSSL_cleanse(out->rep.bulk_key, sizeof(out->rep.bulk_key));
	}
	free(hdr);
	for (size_t i = 0; payload && i < out->n_payload; i++) {
		bytes += zmq_msg_size(&out->payload[i]);
		zmq_msg_send(&out->payload[i], sock, i + 1 < out->n_payload ? ZMQ_SNDMORE : 0);
	}
	atomic_fetch_add(&srv->stats.bytes_out, bytes);
}

/* Before frame i of an unverified view goes out: its layer's checksums (frames K, V). */
static int verify_frame(void *arg, size_t i)
{
	return i % 2 ? 0 : ops_verify_layer(arg, (uint32_t)(i / 2));
}

/*
 * A GET that asked for its payload on a bulk connection: the reply first, without the
 * frames (it travels through ZeroMQ's threads while the payload streams), then the
 * frames on the bulk connection (from the store's pages, sealed for a CURVE client),
 * each layer verified just before it is sent, when the view was left unverified (a
 * layer that fails voids the payload with an abort record, and the chunk is removed).
 * A ticket this daemon does not know (expired, another client's) leaves the frames to
 * ZeroMQ, verified first (false: the caller sends the reply as usual). A connection
 * that fails mid-way is closed, and the client sees the stream end mid-payload; it
 * opens another.
 */
static bool bulk_divert(struct server *srv, void *sock, zmq_msg_t *env, size_t n_env,
			const char *principal, struct reply_out *out)
{
	struct bulk_check check = { verify_frame, out };
	struct iovec iov[2 * KVBP_LAYERS_IOV];
	struct iovec *v = out->n_payload <= KVBP_LAYERS_IOV * 2 ? iov
					: malloc(out->n_payload * sizeof(*v));
	struct bulk_conn *bc;
	zmq_msg_t *payload = out->payload;
	size_t n_payload = out->n_payload;
	uint64_t sent = 0, total = 0;
	int rc;

	/* a FETCH's parts are each layer's stored bytes, of sizes the member cannot know */
	if (v && out->op == KVBP_OP_FETCH)
		out->rep.bulk_parts = malloc(n_payload * sizeof(uint64_t));
	if (!v || (out->op == KVBP_OP_FETCH && !out->rep.bulk_parts) ||
	    bulk_take(srv->bulk, out->bulk_ticket, principal, zmq_msg_data(&env[1]),
			    zmq_msg_size(&env[1]), &bc)) {
		/* frames after all, every layer verified first */
		if (v != iov)
			free(v);
		if (out->verify_view && ops_verify_all(srv, out)) {
			/* the reply: corrupt, no frames (closed first: they hold the view) */
			for (size_t i = 0; i < n_payload; i++)
				zmq_msg_close(&payload[i]);
			out->n_payload = 0;
			ops_remove_corrupt(srv, out);
		}
		return false;
	}
	for (size_t i = 0; i < n_payload; i++) {
		v[i].iov_base = zmq_msg_data(&payload[i]);
		v[i].iov_len = zmq_msg_size(&payload[i]);
		total += v[i].iov_len;
		if (out->rep.bulk_parts)
			out->rep.bulk_parts[i] = v[i].iov_len;
	}
	out->rep.n_bulk_parts = out->rep.bulk_parts ? n_payload : 0;
	/* The bulk connection's writer has its own deadline: the ZeroMQ connection is not
	 * the one to cut while it writes (held.h). */
	if (out->held)
		held_remove(&srv->held, out->held);
	out->n_payload = 0;
	out->rep.payload_frames = 0;
	out->rep.bulk_bytes = total;
	send_reply(srv, sock, env, n_env, false, out);
	rc = bulk_send(srv->bulk, bc, out->rep.request_id, v, n_payload,
		       out->verify_view ? &check : NULL, &sent);
	if (v != iov)
		free(v);
	for (size_t i = 0; i < n_payload; i++)
		zmq_msg_close(&payload[i]);
	if (rc == -EBADMSG)
		ops_remove_corrupt(srv, out); /* once the frames let go of the view */
	if (!rc)
		atomic_fetch_add(&srv->stats.bytes_out, sent);
	return true;
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

/* Queue a fuse session for loading ahead; a session already queued is not queued twice. */
static void prefetch_enqueue(struct server *srv, uint64_t id)
{
	pthread_mutex_lock(&srv->pf_lock);
	for (unsigned i = 0; i < srv->pf_len; i++)
		if (srv->pf_queue[(srv->pf_head + i) % srv->pf_cap] == id)
			goto out;
	/* Room for every session at once: a landing session is never dropped. */
	if (srv->pf_len < srv->pf_cap) {
		srv->pf_queue[(srv->pf_head + srv->pf_len) % srv->pf_cap] = id;
		srv->pf_len++;
		pthread_cond_signal(&srv->pf_cond);
	}
out:
	pthread_mutex_unlock(&srv->pf_lock);
}

void *server_prefetch_main(void *arg)
{
	struct server *srv = arg;

	struct timespec last = { 0 }, now;

	pthread_mutex_lock(&srv->pf_lock);
	while (!srv->pf_stop) {
		uint64_t id;

		/*
		 * Idle sessions expire here, not on the main thread: freeing a session waits
		 * for its device work and gives device memory back, which stalls the device
		 * and would stall every socket with it.
		 */
		clock_gettime(CLOCK_MONOTONIC, &now);
		if (now.tv_sec != last.tv_sec) {
			pthread_mutex_unlock(&srv->pf_lock);
			fuse_expire(srv->fuse);
			pthread_mutex_lock(&srv->pf_lock);
			last = now;
			continue;
		}
		if (!srv->pf_len) {
			struct timespec until;

			clock_gettime(CLOCK_REALTIME, &until);
			until.tv_sec += 1;
			pthread_cond_timedwait(&srv->pf_cond, &srv->pf_lock, &until);
			continue;
		}
		id = srv->pf_queue[srv->pf_head];
		srv->pf_head = (srv->pf_head + 1) % srv->pf_cap;
		srv->pf_len--;
		pthread_mutex_unlock(&srv->pf_lock);
		/* A landing session with layers left goes to the back: sessions take turns. */
		if (fuse_prefetch(srv->fuse, id))
			prefetch_enqueue(srv, id);
		pthread_mutex_lock(&srv->pf_lock);
	}
	pthread_mutex_unlock(&srv->pf_lock);
	return NULL;
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
	send_reply(srv, sock, frames, ENVELOPE_LEN, false, &out);
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
			send_reply(srv, sock, frames, env, true, &out);
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
			if (!out.has_bulk || !srv->bulk || out.rep.code != KVBP_OK ||
			    !out.n_payload ||
			    !bulk_divert(srv, sock, frames, env, tag.principal, &out))
				send_reply(srv, sock, frames, env, false, &out);
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
		/* Work the node waits on next: load a fuse session's coming layers now. */
		if (out.prefetch_session)
			prefetch_enqueue(srv, out.prefetch_session);
		reply_out_clear(&out);
	}
out:
	if (sock)
		zmq_close(sock);
	free(frames);
	atomic_fetch_sub(&srv->running_workers, 1);
	return NULL;
}
