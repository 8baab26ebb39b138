/*
 * lane — one thread for requests too costly for a worker (the cluster-wide replication
 * check: every chunk of every model, and a round to every member). A worker hands such
 * a request over with its frames and goes on serving; the lane runs them one at a time
 * (so that no client can run several at once) and sends each reply to the main thread
 * on its own inproc socket, as a worker would. The queue is bounded: beyond it a
 * request is refused at once. Thread-safe.
 */
#ifndef KVBLEND_DAEMON_LANE_H
#define KVBLEND_DAEMON_LANE_H

#include <stddef.h>

#include <zmq.h>

struct lane;

/* The frames of one request, as the worker received them. */
#define LANE_FRAMES 8

/*
 * Run one request: frames[0..n) (the caller's, moved in: the callee sends or closes
 * every one), its reply to go out on sock (a PUSH connected to the lane's endpoint).
 */
typedef void lane_run_fn(void *ctx, void *sock, zmq_msg_t *frames, size_t n);

/*
 * Start the lane's thread: a PUSH socket of zctx connected to endpoint (where the main
 * thread's PULL is bound), run for each request, at most max_waiting queued. 0 and
 * *out, or -errno.
 */
int lane_start(struct lane **out, void *zctx, const char *endpoint, lane_run_fn *run, void *ctx,
	       unsigned max_waiting);

/*
 * Queue frames[0..n) (n <= LANE_FRAMES): 0, and the frames are moved in (the caller's
 * are left empty); -EBUSY when max_waiting requests wait already, -E2BIG for too many
 * frames, -ENOMEM (the caller keeps its frames then).
 */
int lane_submit(struct lane *l, zmq_msg_t *frames, size_t n);

/* Requests waiting now, and run so far (stats). */
void lane_counts(struct lane *l, unsigned *waiting, unsigned long *done);

/*
 * Stop after the request running now; requests still waiting are dropped (their frames
 * closed: their clients get no reply, as for requests past drain_timeout). Accepts
 * NULL; sets *l to NULL.
 */
void lane_stop(struct lane **l);

#endif
