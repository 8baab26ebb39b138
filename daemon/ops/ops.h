/*
 * ops — what kvblendd does with one request: decode and check the header,
 * check every size before use, run it against the store and build the reply.
 * Every failure becomes a reply with a code and a message naming the problem.
 */
#ifndef KVBLEND_DAEMON_OPS_H
#define KVBLEND_DAEMON_OPS_H

#include <stdbool.h>
#include <stddef.h>
#include <zmq.h>

#include "daemon/state.h"

/* What sets an operation apart (ops.c's table; a reply carries its request's). */
enum ops_flag {
	OPF_BULK_OUT = 1 << 0,		/* its payload may go out on a bulk connection */
	OPF_BULK_PARTS = 1 << 1,	/* ... with each part's size in the reply (FETCH) */
	OPF_BULK_IN = 1 << 2,		/* its payload may come on a bulk connection */
	OPF_MEMBER_NAMESPACES = 1 << 3, /* a member may name any namespace's model */
};

struct reply_out {
	struct kvbp_reply rep;
	unsigned flags; /* the operation's (enum ops_flag) */
	zmq_msg_t *payload; /* initialised frames to send after the header; owned */
	size_t n_payload;
	uint64_t op; /* for stats */
	uint64_t kick_session; /* after the reply is sent: the fuse loader's work (fuse_kick) */
	/* a reply from the store's pages: its entry in srv->held (held.h), alive with the
	 * payload frames; NULL for others */
	struct held_reply *held;
	bool has_bulk; /* a GET that asked for its payload on a bulk connection (bulk.h) */
	/* too costly for a worker (the cluster-wide check): run it on the lane (lane.h),
	 * which calls ops_handle again with from->lane set; nothing to send now */
	bool defer;
	uint8_t bulk_ticket[KVBP_BULK_TICKET_LEN];
	/* such a GET from the store's pages, not verified yet: its view (alive with the
	 * payload frames, layer i in frames 2i and 2i+1), checked a layer at a time as the
	 * bulk connection sends it, or all at once before the frames go to ZeroMQ instead
	 * (send.c); the chunk's model and hash, to remove it if a layer fails */
	const struct store_view *verify_view;
	struct store_model verify_model;
	uint8_t verify_hash[KVBP_HASH_LEN];
};

/* The scrub, or a fuse session's read, found chunk (model_id, hash) corrupt: log, remove
 * and count it as a read would. */
void ops_chunk_corrupt(void *srv, uint32_t model_id, const uint8_t *hash);

/* Why a request is answered with an error without being run. */
enum ops_refuse {
	OPS_RUN = 0,
	OPS_REFUSE_STOPPING,	 /* busy: the daemon is shutting down */
	OPS_REFUSE_CLIENT_BYTES, /* limit: the client holds client_inflight_bytes */
	OPS_REFUSE_TOTAL_BYTES,	 /* limit: all clients hold max_inflight_bytes */
	OPS_REFUSE_MEMORY,	 /* limit: out of memory */
};

/* Who sent a request, as the main thread tells the worker. */
struct ops_origin {
	const char *principal;	  /* server.c principal_of: owner of what it creates */
	const char *ns;		  /* its namespace (tenants.h): "" the default */
	struct client_acct *acct; /* its byte account: reply payloads are held on it */
	enum ops_refuse refuse;
	int fd; /* the connection's descriptor, for held.h; -1 unknown */
	bool lane; /* run on the lane (lane.h): costly requests are run, not deferred */
	const void *conn_id; /* the ZeroMQ connection's routing id (bulk tickets bind to it) */
	size_t conn_id_len;
	uint64_t reserved; /* the request's own bytes held on acct */
};

/*
 * Handle frames[0..n): frames[0] is the header, the rest payloads.
 * extra_frames counts frames beyond n that were received and dropped.
 * A request from->refuse says to refuse is answered with the request's id and
 * that error, not run. Fills *out; the caller sends it and calls reply_out_clear().
 */
void ops_handle(struct server *srv, const struct ops_origin *from, zmq_msg_t *frames, size_t n,
		size_t extra_frames, struct reply_out *out);

/* Where a reply goes: a worker's or the lane's socket, and the request's envelope. */
struct ops_dest {
	void *sock;
	zmq_msg_t *env;	 /* the envelope frames to send first (moved out) */
	size_t n_env;
	bool add_delim;	 /* the request had no delimiter: send one after env */
	const char *principal; /* who asked: a bulk ticket must be theirs */
};

/*
 * The one way out for a reply (ops/send.c), for a worker and the lane alike: out's
 * header and payload to `to`, the payload on the client's bulk connection when the
 * request asked for one and it is there (handed to a sender thread: this call never
 * waits on a client's socket), else in frames (an unverified view verified first; a
 * chunk that fails is removed and the reply becomes `corrupt`). Takes out's payload;
 * the caller still calls reply_out_clear().
 */
void ops_send(struct server *srv, const struct ops_dest *to, struct reply_out *out);

/* Close unsent payload frames and free the reply's arrays. */
void reply_out_clear(struct reply_out *out);

/* A stored model as the wire describes it (every field; the stored name). */
void model_from_store(const struct store_model *s, struct kvbp_model *m);

#endif
