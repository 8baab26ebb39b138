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

struct reply_out {
	struct kvbp_reply rep;
	zmq_msg_t *payload; /* initialised frames to send after the header; owned */
	size_t n_payload;
	uint64_t op; /* for stats */
	uint64_t prefetch_session; /* after the reply is sent: load ahead for this fuse session */
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
	 * bulk connection sends it (ops_verify_layer), or all at once before the frames
	 * go to ZeroMQ instead (ops_verify_all); the chunk's model and hash, to remove it
	 * if a layer fails (ops_remove_corrupt) */
	const struct store_view *verify_view;
	struct store_model verify_model;
	uint8_t verify_hash[KVBP_HASH_LEN];
};

/* Layer i of out's unverified view: 0, or -EBADMSG (it failed its checksum). */
int ops_verify_layer(const struct reply_out *out, uint32_t i);
/* Every layer of it, on the helper threads: 0, or -EBADMSG. */
int ops_verify_all(struct server *srv, const struct reply_out *out);
/* Its chunk failed: logged, removed and counted; out becomes the `corrupt` error. */
void ops_remove_corrupt(struct server *srv, struct reply_out *out);

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

/* Close unsent payload frames and free the reply's arrays. */
void reply_out_clear(struct reply_out *out);

/* A stored model as the wire describes it (every field; the stored name). */
void model_from_store(const struct store_model *s, struct kvbp_model *m);

#endif
