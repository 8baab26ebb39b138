/*
 * ops/impl — what the request handlers share (private to daemon/ops/): the request
 * being served, reply buffers held on the client's account, the one translation
 * of store errors into replies, model names and namespaces, model checks. The
 * handlers themselves live by concern in daemon/ops/: chunk.c (PUT, GET, LOOKUP,
 * DELETE, LIST, PIN, UNPIN), fuse.c (fuse sessions), peer.c (FETCH, REPLICATE
 * between members), admin.c (HELLO, models, STATS, shared memory); ops.c holds the
 * table of operations, decodes, refuses what must be refused and dispatches; reply.c
 * the helpers below; send.c sends what a handler returned (ops_send).
 */
#ifndef KVBLEND_DAEMON_OPS_IMPL_H
#define KVBLEND_DAEMON_OPS_IMPL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "daemon/ops/ops.h"

struct req {
	struct server *srv;
	const char *principal; /* who asks: owner of what it creates */
	const char *ns;	       /* its namespace: "" the default, else a tenant */
	struct client_acct *acct; /* its byte account (NULL in tests of ops alone) */
	struct kvbp_request h;
	unsigned flags; /* the operation's (ops.h enum ops_flag) */
	zmq_msg_t *payload;
	size_t n_payload;
	struct reply_out *out;
	int fd; /* the connection's descriptor (held.h), -1 unknown */
	bool lane; /* on the lane thread (lane.h), not a worker */
	const void *conn_id; /* the ZeroMQ connection's routing id */
	size_t conn_id_len;
	uint64_t reserved; /* this request's own bytes held on acct (reply_hold) */
};

/*
 * A reply payload buffer shared by several frames, freed when ZeroMQ drops the last;
 * its bytes are held on the client's account until then (an unread reply counts).
 * Or, with view set, no buffer: the frames point into the store's map through the
 * view, which ends when ZeroMQ drops the last (zero-copy GET).
 */
struct shared_buf {
	atomic_int refs;
	size_t len;
	struct clients *clients;
	struct client_acct *acct;
	struct store_view *view;
	struct held_reply held; /* with a view: registered in srv->held until sent */
	struct held_replies *registry;
	_Alignas(64) uint8_t data[];
};

/* ZeroMQ's free function for frames over a shared_buf: drops one reference. */
void shared_buf_unref(void *data, void *hint);

/* Set the reply's error code and message; returns -1 (for `return fail(...)`). */
__attribute__((format(printf, 3, 4))) int fail(struct req *q, uint32_t code, const char *fmt,
					       ...);

/*
 * A reply buffer of len bytes (data_len of them for data), held on the client's
 * account with the request's own bytes (a client that holds nothing else is admitted
 * whatever the size); NULL with a reply naming the limit (or memory) that refused it.
 */
struct shared_buf *reply_hold(struct req *q, size_t len, size_t data_len);
struct shared_buf *reply_buf(struct req *q, size_t len);

/* `full`, saying which ran out: the file system under the store or its LMDB map. */
int fail_full(struct req *q, const char *what);
/* Translate a store errno into a reply; the one place store errors meet the wire. */
int fail_store(struct req *q, int rc, const char *what);

/*
 * The stored name of the client's model name (its namespace in front); refuses a
 * '#' except where a cluster member names another namespace. 0, or -1 with a reply.
 */
int stored_name(struct req *q, const char *name, char out[STORE_NAME_MAX + 1]);
/* The client's name of a stored model of its namespace; NULL for another namespace's. */
const char *client_name(const struct req *q, const char *stored);
/* The request's model (in the client's namespace) into *m; 0, or -1 with a reply. */
int need_model(struct req *q, struct store_model *m);
/*
 * Model name (as stored), not registered here, from the members of this daemon's
 * cluster, registered here (issue 20). 0 with *m; -ENOENT when no member has it;
 * -EINVAL when q was failed (a bad description); or the store's error.
 */
int model_from_members(struct req *q, const char *name, struct store_model *m);
/* The request carries a hash / no payload frames; 0, or -1 with a reply. */
int need_hash(struct req *q);
int no_payload(struct req *q);

/* A wire model description as the store keeps it (every field). */
void model_to_store(const struct kvbp_model *m, struct store_model *s);
/* Check a model description and fill in the defaults, so equal models compare equal. */
int model_check(struct req *q, struct kvbp_model *m);

/* One chunk of a reply from its stored info. */
void chunk_out(struct kvbp_chunk *c, const uint8_t *hash, bool found,
	       const struct store_chunk_info *ci);
int one_chunk_reply(struct req *q, const uint8_t *hash, const struct store_chunk_info *ci);
/* May this request ask the cluster (a daemon with members, a request not from one)? */
bool cluster_wanted(const struct req *q);
/* A chunk's bytes per tensor and in all for tokens x layers of m; 0, or -1 with a reply. */
int chunk_bytes(struct req *q, const struct store_model *m, uint32_t tokens, uint32_t layers,
		uint64_t *tensor_bytes, uint64_t *total);
/* The chunk of the request failed its checksum: remove it and answer `corrupt`. */
void remove_corrupt(struct req *q, const struct store_model *m);
/* Log, remove and count chunk (m, hash) that failed its checksum; its hash in hex into h. */
void drop_corrupt(struct server *srv, const struct store_model *m,
		  const uint8_t hash[KVBP_HASH_LEN], char h[2 * KVBP_HASH_LEN + 1]);
/* Every layer of view v, split over the helper threads (send.c): 0, or -EBADMSG. */
int view_verify_all(struct server *srv, const struct store_view *v);

/* The handlers, one per operation. */
void op_hello(struct req *q);
void op_model_register(struct req *q);
void op_model_list(struct req *q);
void op_stats(struct req *q);
void op_shm_attach(struct req *q);
void op_shm_detach(struct req *q);
void op_put(struct req *q);
/* A PUT refused before it ran whose payload waits on its bulk connection: close that
 * connection, so that the client's writes fail at once. */
void put_void_bulk(struct req *q);
struct bulk_conn;
/*
 * A PUT's or REPLICATE's (what) bulk connection when it names a ticket: 0 and *bc
 * (NULL without a ticket), or -1 with q failed (no bulk connections here, or none of
 * this client's on this ZeroMQ connection). *bc goes to bulk_recv or bulk_cut.
 */
int take_bulk_payload(struct req *q, const char *what, struct bulk_conn **bc);
void op_get(struct req *q);
void op_lookup(struct req *q);
void op_delete(struct req *q);
void op_list(struct req *q);
void op_pin(struct req *q);
void op_unpin(struct req *q);
void op_fetch(struct req *q);
void op_replicate(struct req *q);
void op_fuse_open(struct req *q);
void op_fuse_layer(struct req *q);
void op_fuse_close(struct req *q);

#endif
