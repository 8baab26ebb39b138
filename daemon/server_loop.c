/* server_loop — the main thread of kvblendd: requests from the frontends to the workers,
 * replies back, connections counted, the periodic work; see server_impl.h. */
#include "daemon/server.h"
#include "daemon/work.h"

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

/* A connection came or went (a monitor event); main thread. */
void server_count_connection(struct server *srv, void *mon)
{
	zmq_msg_t ev, addr;
	uint16_t event = 0;

	zmq_msg_init(&ev);
	zmq_msg_init(&addr);
	if (zmq_msg_recv(&ev, mon, ZMQ_DONTWAIT) < 0)
		goto out;
	if (zmq_msg_more(&ev))
		zmq_msg_recv(&addr, mon, ZMQ_DONTWAIT);
	if (zmq_msg_size(&ev) >= 2)
		memcpy(&event, zmq_msg_data(&ev), 2);
	if (event == ZMQ_EVENT_ACCEPTED)
		atomic_fetch_add(&srv->connections, 1);
	else if (event == ZMQ_EVENT_DISCONNECTED && atomic_load(&srv->connections))
		atomic_fetch_sub(&srv->connections, 1);
out:
	zmq_msg_close(&ev);
	zmq_msg_close(&addr);
}

/* Move one multipart message from one socket to another without copying its frames. */
static int forward(void *from, void *to)
{
	int more = 1;

	while (more) {
		zmq_msg_t m;

		zmq_msg_init(&m);
		if (zmq_msg_recv(&m, from, ZMQ_DONTWAIT) < 0) {
			zmq_msg_close(&m);
			return -errno;
		}
		more = zmq_msg_more(&m);
		if (zmq_msg_send(&m, to, more ? ZMQ_SNDMORE : 0) < 0)
			zmq_msg_close(&m);
	}
	return 0;
}

/*
 * Who sent a message, as the transport tells it: on IPC the peer's Unix
 * credentials ("ipc:UID:GID:PID"), on TCP the CURVE key that the ZAP handler
 * admitted or else the peer's address. Shared-memory segments and fuse sessions
 * belong to it, and per-client limits are counted by it.
 */
static void principal_of(zmq_msg_t *m, unsigned frontend, char *out, size_t len)
{
	const char *user = zmq_msg_gets(m, "User-Id");
	const char *peer = zmq_msg_gets(m, "Peer-Address");

	if (user && *user)
		snprintf(out, len, "key:%s", user);
	else if (peer && !strncmp(peer, "localhost:", 10) && frontend == 0)
		snprintf(out, len, "ipc:%s", peer + 10);
	else
		snprintf(out, len, "%s:%s", frontend ? "curve" : "tcp", peer ? peer : "?");
}

/* The request's bytes are no longer held: its reply is on its way. */
static void tag_done(struct server *srv, const struct req_tag *t)
{
	if (!t->acct)
		return;
	clients_release(srv->clients, t->acct, t->reserved);
	clients_put(srv->clients, t->acct);
}

/*
 * A request from frontend i to the workers, with a tag in front (struct req_tag).
 * While stopping, requests still go to the workers, which answer them `busy` with
 * the request's id (the client matches replies by id) without running them; so do
 * requests that were queued for a worker but not started when the stop began.
 * Frames are moved, not copied; frames beyond what a request can have are dropped
 * here and counted in the tag, so that the worker answers bad_frames.
 */
int server_forward_in(struct server *srv, unsigned i)
{
	struct req_tag tag = { .frontend = (uint8_t)i };
	zmq_msg_t *frames = srv->in_frames;
	uint64_t bytes = 0;
	size_t n, extra;
	int rc;

	rc = server_recv_frames(srv->frontends[i], frames, srv->in_cap, &n, &extra);
	if (rc)
		return rc;
	if (!n)
		return 0;
	/* While stopping, the workers answer new requests `busy` without running them. */
	tag.refuse = atomic_load(&srv->stopping) ? OPS_REFUSE_STOPPING : OPS_RUN;
	tag.extra = extra > UINT32_MAX ? UINT32_MAX : (uint32_t)extra;
	for (size_t k = 0; k < n; k++)
		bytes += zmq_msg_size(&frames[k]);
	/* (the routing id frame may carry no metadata when the ROUTER prefetched it) */
	principal_of(&frames[n > 1 ? 1 : 0], i, tag.principal, sizeof(tag.principal));
	/* (ZMQ_SRCFD: deprecated in libzmq, kept through 4.3; only held.h's deadline uses it) */
	tag.fd = zmq_msg_get(&frames[n - 1], ZMQ_SRCFD);
	snprintf(tag.ns, sizeof(tag.ns), "%s", tenants_of(srv->tenants, tag.principal));
	/*
	 * Hold the request's bytes for its client until the reply passes: a client over its
	 * share, or all clients over max_inflight_bytes, gets `limit` at once (the worker
	 * answers with the request's id), and its frames are freed right away.
	 */
	tag.acct = clients_get(srv->clients, tag.principal);
	if (!tag.acct) {
		tag.refuse = OPS_REFUSE_MEMORY;
	} else if (tag.refuse == OPS_RUN) {
		rc = clients_reserve(srv->clients, tag.acct, bytes);
		if (rc == 0)
			tag.reserved = bytes;
		else
			tag.refuse = rc == -EDQUOT ? OPS_REFUSE_CLIENT_BYTES : OPS_REFUSE_TOTAL_BYTES;
	}
	if (tag.refuse != OPS_RUN)
		for (size_t k = 3; k < n; k++) { /* the payload is not needed to refuse */
			zmq_msg_close(&frames[k]);
			zmq_msg_init(&frames[k]);
		}
	/* to the first idle worker (work.h) */
	rc = work_push(srv->work, &tag, sizeof(tag), frames, n);
	for (size_t k = 0; k < n; k++)
		zmq_msg_close(&frames[k]);
	if (rc) {
		tag_done(srv, &tag);
		return rc;
	}
	srv->inflight++;
	return 0;
}

/* A reply from the workers to the frontend its tag names. */
int server_forward_reply(struct server *srv, void *from)
{
	zmq_msg_t tag;
	unsigned i = 0;
	int more;

	zmq_msg_init(&tag);
	if (zmq_msg_recv(&tag, from, ZMQ_DONTWAIT) < 0) {
		zmq_msg_close(&tag);
		return -errno;
	}
	if (zmq_msg_size(&tag) == sizeof(struct req_tag)) {
		struct req_tag t;

		memcpy(&t, zmq_msg_data(&tag), sizeof(t));
		i = t.frontend & 1;
		tag_done(srv, &t);
	}
	more = zmq_msg_more(&tag);
	zmq_msg_close(&tag);
	if (srv->inflight)
		srv->inflight--;
	if (!more)
		return 0;
	if (!srv->frontends[i]) {
		/* cannot happen; drain the rest rather than misroute it */
		while (more) {
			zmq_msg_t m;

			zmq_msg_init(&m);
			if (zmq_msg_recv(&m, from, 0) < 0)
				break;
			more = zmq_msg_more(&m);
			zmq_msg_close(&m);
		}
		return 0;
	}
	return forward(from, srv->frontends[i]);
}

/* A worker's reply to its client. */
int server_forward_out(struct server *srv)
{
	return server_forward_reply(srv, srv->backend);
}

void server_gate_frontends(struct server *srv, zmq_pollitem_t *items, int n)
{
	/* the workers' queue full: requests wait in the sockets (their HWM, then TCP) */
	short events = work_full(srv->work) ? 0 : ZMQ_POLLIN;

	for (int i = 0; i < n; i++)
		items[i].events = events;
}

int server_run(struct server *srv, volatile int *stop, void (*tick)(struct server *))
{
	zmq_pollitem_t items[6] = { { srv->backend, 0, ZMQ_POLLIN, 0 },
				    { srv->frontends[0], 0, ZMQ_POLLIN, 0 },
				    { srv->frontends[1], 0, ZMQ_POLLIN, 0 },
				    { srv->monitors[0], 0, ZMQ_POLLIN, 0 },
				    { srv->monitors[1], 0, ZMQ_POLLIN, 0 } };
	int n_items = srv->frontends[1] ? 3 : 2, lane = 2 * n_items - 1;
	struct timespec last = { 0 }, now;

	if (!srv->frontends[1]) /* no CURVE frontend: its monitor neither */
		items[2] = items[3];
	items[lane] = (zmq_pollitem_t){ srv->lane_out, 0, ZMQ_POLLIN, 0 }; /* last */
	while (!*stop) {
		int rc;

		server_gate_frontends(srv, items + 1, n_items - 1);
		rc = zmq_poll(items, lane + 1, POLL_MS);

		if (rc < 0 && errno != EINTR)
			log_warn("poll: %s", zmq_strerror(errno));
		/* connections first, so that the count the ZAP handler reads is current */
		for (int i = n_items; rc > 0 && i < 2 * n_items - 1; i++)
			if (items[i].revents & ZMQ_POLLIN)
				server_count_connection(srv, items[i].socket);
		if (rc > 0 && (items[0].revents & ZMQ_POLLIN))
			server_forward_out(srv);
		if (rc > 0 && (items[lane].revents & ZMQ_POLLIN))
			server_forward_reply(srv, srv->lane_out);
		for (int i = 1; rc > 0 && i < n_items; i++)
			if (items[i].revents & ZMQ_POLLIN)
				server_forward_in(srv, (unsigned)i - 1);
		clock_gettime(CLOCK_MONOTONIC, &now);
		if (tick)
			tick(srv); /* cheap: the watchdog ping is rate-limited inside */
		if (now.tv_sec != last.tv_sec) {
			unsigned n = shm_expire(srv->shm);

			if (n)
				log_info("released %u idle shared-memory segments", n);
			held_expire(&srv->held, (int64_t)srv->cfg->reply_timeout_ms);
			last = now;
		}
	}
	return 0;
}
