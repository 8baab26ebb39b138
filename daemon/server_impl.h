/*
 * server_impl — what the three parts of the server share (private to them): the
 * composition (server.c: sockets bound, backends and services started, the stop), the
 * threads (server_threads.c: workers, the lane's runner) and the
 * socket loop (server_loop.c: the main thread moving requests to the workers and
 * replies back). See server.h for the whole.
 */
#ifndef KVBLEND_DAEMON_SERVER_IMPL_H
#define KVBLEND_DAEMON_SERVER_IMPL_H

#include <stddef.h>
#include <stdint.h>

#include <zmq.h>

#include "daemon/ops/ops.h"
#include "daemon/state.h"
#include "daemon/tenants.h"

#define WORKER_ENDPOINT "inproc://kvblend-workers"
#define LANE_ENDPOINT "inproc://kvblend-lane"
#define LANE_WAITING 4 /* costly requests queued for the lane; beyond: busy */
#define POLL_MS 200
/* Requests queued for the workers at most (work.h); past it the main thread stops
 * reading its sockets until a worker takes one. */
#define WORK_QUEUE 4096
/*
 * A request as the workers receive it: [tag] [routing id] [empty delimiter] [header]
 * [payload ...]. The tag is added by the main thread (struct req_tag); the routing id
 * by the ROUTER. The delimiter is required: REQ sockets add it, DEALER clients send it
 * themselves. Without it a payload frame could pass for the delimiter, so a message
 * whose third frame is not empty is refused as a whole.
 */
#define ENVELOPE_LEN 3

/* What the main thread tells a worker about a request, and gets back with the reply. */
struct req_tag {
	uint8_t frontend; /* index into srv->frontends */
	uint32_t extra;	  /* frames dropped by the main thread (too many for a request) */
	uint64_t reserved; /* bytes of its frames held for the client until the reply passes */
	struct client_acct *acct; /* the client's record, referenced until the reply passes */
	enum ops_refuse refuse; /* answer with an error without running it */
	char principal[96]; /* who sent it (principal_of) */
	char ns[TENANT_NAME_MAX + 1]; /* its namespace (tenants.h); "" the default */
	int fd; /* its connection's descriptor (ZeroMQ's, for held.h), -1 unknown */
};

/* Receive one whole message, keeping at most cap frames; counts the rest in *extra.
 * The parts of a multipart message arrive together, so no call here blocks. */
int server_recv_frames(void *sock, zmq_msg_t *frames, size_t cap, size_t *n, size_t *extra);

/* ---- server_threads.c ---- */

/* A worker thread (arg: the server): requests from the backend, replies to it. */
void *server_worker_main(void *arg);
/* The lane's runner (lane.h): a deferred request run as a worker would, its reply on sock. */
void server_lane_run(void *ctx, void *sock, zmq_msg_t *frames, size_t n);

/* ---- server_loop.c ---- */

/* A request from frontend i to the workers: 0, or -errno (nothing was waiting). */
int server_forward_in(struct server *srv, unsigned i);
/* A reply from `from` (the backend, or the lane's socket) to its client: 0, or -errno. */
int server_forward_reply(struct server *srv, void *from);
/* A worker's reply to its client: server_forward_reply from the backend. */
int server_forward_out(struct server *srv);
/* The frontends' poll items[0..n): read only while the workers' queue has room. */
void server_gate_frontends(struct server *srv, zmq_pollitem_t *items, int n);
/* A connection event on a frontend's monitor socket mon: the live count follows it. */
void server_count_connection(struct server *srv, void *mon);

#endif
