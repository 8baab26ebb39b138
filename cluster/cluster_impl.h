/*
 * cluster_impl — what the cluster's modules share, private to cluster/: struct
 * cluster and its members, the view (who is in placement), peer calls, and the
 * threads each module runs. The daemon sees only cluster.h.
 *
 * cluster.c: lifecycle, stats, the operator's view, who is a member.
 * view.c: the shared view, placement queries over it, liveness, the shared helpers.
 * members.c: the static member list, the etcd registration and watch.
 * transfer.c: calls to a peer, the push queue and its thread, fetch and lookup.
 * bulk.c: a member's end of bulk connections to its peers (FETCH payloads).
 * rebalance.c: rebalance and repair passes, heartbeats.
 * check.c: the replication check: the copies of the chunks held here among their
 * owners, and the same asked of every other member (run by rebalance.c's thread).
 *
 * Beside them, three modules with a header of their own that know nothing of
 * struct cluster: place.c (place.h, weighted rendezvous placement, used by view.c),
 * etcd.c (etcd.h, etcd v3 over its JSON gateway) and record.c (record.h, a member's
 * record in etcd), both used by members.c.
 */
#ifndef KVBLEND_CLUSTER_CLUSTER_IMPL_H
#define KVBLEND_CLUSTER_CLUSTER_IMPL_H

#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <time.h>
#include <zmq.h>

#include "proto/wire.h"
#include "store/store.h"
#include "cluster/cluster.h"
#include "cluster/etcd.h"
#include "cluster/place.h"

#define POOL 4		      /* idle sockets kept per peer */
#define SUSPECT_MS 2000	      /* a peer that missed a deadline is skipped this long */
#define QUEUE_MAX (1u << 16)  /* pushes held in memory; the rest wait in the store */
#define MEMBERS_MAX 1024
#define PEER_INFLIGHT_MAX 32  /* calls to one peer at once; more are refused (-EBUSY) */
#define HEARTBEAT_MS 1000     /* a live member not heard from this long is pinged */
#define LOOKUP_BATCH 1024     /* hashes per LOOKUP of a rebalance */
#define VIEW_TIMES 64	      /* view changes whose time is kept (change_wall_ms) */

struct peer {
	char id[STORE_OWED_PEER_MAX + 1];
	/* endpoint and key change only under lock (a member re-registering elsewhere) */
	char endpoint[CLUSTER_ENDPOINT_MAX];
	char key[41]; /* the peer's CURVE server key, "" for none */
	double weight;
	bool live; /* listed statically, or registered in etcd (view lock) */
	bool in_view; /* in placement: live, or gone less than cluster_grace (view lock) */
	pthread_mutex_t lock;
	struct psock *idle[POOL];
	unsigned n_idle;
	atomic_int_fast64_t suspect_until; /* ms, monotonic */
	/* ms, monotonic: its FETCH payload stalled (answered, then no byte for
	 * cluster_hedge_ms); skipped until then. An answer to a call (a heartbeat) does not
	 * clear it, since calls do not cross the bulk connection; a payload received does. */
	atomic_int_fast64_t stall_until;
	atomic_int_fast64_t last_reply;	   /* ms, realtime; 0 never */
	atomic_int in_flight;
	atomic_uint_fast64_t held_chunks, held_bytes; /* its store, at its last heartbeat */
	/* etcd: since when it is gone (ms, monotonic; 0 live), and whether it is forgotten
	 * (gone cluster_forget_after, owed nothing: not shown; known again if it returns) */
	atomic_int_fast64_t gone_since;
	atomic_bool forgotten;
};

struct push {
	uint32_t peer;
	uint32_t model_id;
	uint8_t hash[KVBP_HASH_LEN];
	bool rebalance; /* to a member that joined or returned: rate limited */
};

/* Who is in placement: this daemon and the live peers. */
struct view {
	struct place_member *members; /* [0] this daemon */
	uint32_t *peer_of;	      /* members[j] is peers[peer_of[j] - 1]; 0 this daemon */
	size_t n;
};

struct cluster {
	struct store *store;
	void (*log)(int level, const char *msg);
	void (*describe)(const struct store_model *m, struct kvbp_model *out);
	void *zctx;
	char self[STORE_OWED_PEER_MAX + 1];
	char secret[41], public_key[41];
	double self_weight;
	unsigned replicas;
	int timeout_ms;
	int64_t hedge_ms; /* cluster_hedge_ms: 0 never hedge */
	bool bulk;	  /* cluster_bulk: FETCH payloads on bulk connections (bulk.c) */
	uint64_t max_message; /* a fetched chunk's raw bytes at most this (bulk.c) */
	int64_t forget_after_ms; /* cluster_forget_after */
	int64_t grace_ms;	 /* cluster_grace: a member gone stays placed this long */
	int64_t drain_ms;	 /* cluster_drain_timeout: 0 no drain */
	atomic_uint_fast64_t next_id;
	/* members: peers only grow (an index stays valid); the view is rebuilt on change */
	pthread_rwlock_t view_lock;
	struct peer *peers[MEMBERS_MAX];
	size_t n_peers;
	struct view view;
	atomic_uint_fast64_t view_gen, membership_changes;
	/* when view generation g began (unix ms), at [g % VIEW_TIMES]; the view lock */
	int64_t change_wall_ms[VIEW_TIMES];
	/* pushes */
	pthread_t pusher;
	bool pusher_started;
	pthread_mutex_t qlock;
	pthread_cond_t qcond;
	bool stop;
	struct push *q;
	size_t q_head, q_len;
	size_t q_rebalance; /* of q_len, the rebalance pushes (held by the rate) */
	bool rescan; /* owed pushes in the store that the queue could not hold */
	uint64_t rebalance_rate;
	int64_t rebalance_next_ns; /* the rate limit: no rebalance push before this */
	atomic_uint_fast64_t pushes_done, push_failures, remote_hits, remote_misses,
		fetch_failures, fetched_bytes, fetch_ns, fetch_wire_ns, in_flight, rebalance_pushes,
		rebalance_skipped, peer_busy, hedged, bulk_fetches, bulk_pushes, fetch_stalls;
	/* rebalance after a membership change (its own thread) */
	pthread_t rebalancer;
	bool rebalancer_started;
	pthread_mutex_t rlock;
	pthread_cond_t rcond;
	uint64_t rebalanced_gen;
	int64_t repair_ms; /* cluster_repair_interval; 0 never */
	uint64_t rebalanced_wall_s; /* when that view was taken (unix s) */
	struct view rebalanced; /* the view the last rebalance left the chunks in */
	bool have_rebalanced;
	/* heartbeats */
	pthread_t heart;
	bool heart_started;
	/* etcd */
	char etcd_urls[CLUSTER_ENDPOINT_MAX * 2];
	/* TLS and authentication towards etcd (etcd_opts points into these) */
	char etcd_ca[PATH_MAX], etcd_cert[PATH_MAX], etcd_key[PATH_MAX];
	char etcd_user[256], etcd_password[256];
	struct etcd_opts etcd_opts;
	char prefix[256];
	char advertise[CLUSTER_ENDPOINT_MAX];
	uint64_t capacity;
	int lease_ttl;
	pthread_t registrar, watcher;
	bool registrar_started, watcher_started;
	atomic_bool etcd_stop, watch_abort, etcd_ok, etcd_synced;
	atomic_uint_fast64_t etcd_errors, etcd_last_ok; /* realtime ms */
	/* the last replication check (check.c) */
	pthread_mutex_t check_lock;
	atomic_bool check_wanted; /* the rebalance thread runs a local check next */
	struct cluster_check last_check;
};

/* A peer's reply: its decoded header, and the payload frames after it, or its payload
 * from the bulk connection (rep.bulk_bytes in bulk, in the parts rep.bulk_parts). */
struct call_out {
	struct kvbp_reply rep;
	zmq_msg_t *frames;
	size_t n_frames;
	uint8_t *bulk;
};

/* A socket to a peer (pooled per peer), with its bulk connection (bulk.c) when the
 * peer offered one: fd >= 0, sealed with aead when the ticket came over CURVE. */
struct psock {
	void *s;
	int fd;
	struct kvbb_aead *aead;
	uint8_t ticket[KVBP_BULK_TICKET_LEN];
	uint64_t rcounter; /* the next record's counter, peer to this member */
	uint64_t scounter; /* the next record's counter, this member to the peer (from 1) */
	bool put;	   /* the peer takes REPLICATE payloads on it (HELLO's bulk_put) */
	bool spoilt;	   /* its bulk connection fell out of step: closed after this call */
};

/* A socket to endpoint (CURVE towards key when both ends have keys), with a bulk
 * connection when cluster_bulk and the peer offer one; NULL when the socket cannot be
 * made or the peer does not answer its HELLO by cluster_timeout_ms. */
struct psock *psock_new(struct cluster *c, const char *endpoint, const char *key);
void psock_free(struct psock *ps);
/*
 * Send the payload of REPLICATE request_id (the concatenation of blobs[0..n), lens
 * bytes each) as records on ps's bulk connection (sealed when it is), by the deadline.
 * 0; or -ETIMEDOUT, -EIO, -ENOMEM: ps's connection is then out of step, and ps must be
 * closed.
 */
int psock_send_payload(struct psock *ps, uint64_t request_id, const void *const *blobs,
		       const size_t *lens, size_t n, int64_t deadline);
/*
 * Receive the payload of FETCH reply o (rep.bulk_bytes > 0) on ps's bulk connection
 * into o->bulk, by the deadline (ms, monotonic), after checking the parts it names
 * against m and its size against c->max_message (fetch_size_check), before o->bulk is
 * allocated. With stall_ms > 0, a payload that makes no progress (no byte) for
 * stall_ms, from the call to the first byte or between bytes, is given up: -ETIME.
 * 0; or -EMSGSIZE (above max_message: nothing allocated), -EPROTO, -EBADMSG (altered
 * on the wire), -ETIME (stalled), -ETIMEDOUT, -EIO, -ENOMEM, with why: ps's connection
 * is then out of step, and ps must be closed.
 */
int psock_fetch_payload(struct cluster *c, struct psock *ps, const struct store_model *m,
			struct call_out *o, int64_t deadline, int64_t stall_ms, char *why,
			size_t why_len);
/*
 * Is a FETCH reply's chunk within bounds: num_tokens of m take at most c->max_message
 * raw bytes (K and V of every layer, as a REPLICATE's must), and its stored bytes are
 * no more than such a chunk may take stored (kvbb_stored_max), nor 0? 0; or -EMSGSIZE
 * (above max_message) or -EPROTO, with why naming the sizes.
 */
int fetch_size_check(const struct cluster *c, const struct store_model *m,
		     uint32_t num_tokens, uint64_t stored, char *why, size_t why_len);

/* A log line through the daemon's callback (cluster_opts.log), as printf formats it. */
void cluster_logf(const struct cluster *c, int level, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));
#define cl_err(c, ...) cluster_logf(c, CLUSTER_LOG_ERR, __VA_ARGS__)
#define cl_warn(c, ...) cluster_logf(c, CLUSTER_LOG_WARN, __VA_ARGS__)
#define cl_info(c, ...) cluster_logf(c, CLUSTER_LOG_INFO, __VA_ARGS__)

static inline int64_t now_ms(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static inline int64_t now_ns(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static inline int64_t wall_ms(void)
{
	struct timespec t;

	clock_gettime(CLOCK_REALTIME, &t);
	return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* Is p skipped for now: it missed a deadline, or its FETCH payload stalled? */
static inline bool suspect(struct peer *p)
{
	int64_t now = now_ms();

	return atomic_load(&p->suspect_until) > now || atomic_load(&p->stall_until) > now;
}

/*
 * How long the pusher sleeps when every queued push must wait: when one waits
 * only for the rebalance rate (rate_wait), until the rate's next_ns allows the
 * next push (at least 1 ns, at most 100 ms), whatever others wait for; else
 * 100 ms (peers suspect or gone are heard of again by then; an empty queue is
 * signalled).
 */
static inline int64_t push_wait_ns(bool rate_wait, int64_t next_ns, int64_t now)
{
	const int64_t poll = 100 * 1000000;
	int64_t left = next_ns - now;

	if (!rate_wait)
		return poll;
	return left < 1 ? 1 : left < poll ? left : poll;
}

/* Sleep on cond (its mutex held) for ms, or until signalled. */
void wait_ms(pthread_cond_t *cond, pthread_mutex_t *mu, int64_t ms);
void wait_ns(pthread_cond_t *cond, pthread_mutex_t *mu, int64_t ns);

/* ---- the view (view.c) ---- */

void view_free(struct view *v);
/* A copy of a view into out (the view lock held). 0 or -ENOMEM. */
int view_copy(const struct view *in, struct view *out);
/*
 * Rebuild c's view from the live peers (the view lock held for writing); the view
 * generation moves on only when the members or their weights changed. 0 or -ENOMEM.
 */
int view_rebuild(struct cluster *c);
/* Members of view v in placement order for hash, as 0 (this daemon) or 1 + peer index. */
size_t view_ranked(const struct view *v, const uint8_t *hash, size_t r, size_t *idx);
/* The same for the current view. */
size_t ranked(struct cluster *c, const uint8_t *hash, size_t r, size_t *idx);
/* Peer i (NULL past the end), whether it is live, how many peers: each under the view lock. */
struct peer *peer_at(struct cluster *c, size_t i);
bool peer_live(struct cluster *c, struct peer *p);
size_t n_peers(struct cluster *c);
/* Is p gone from etcd cluster_grace or longer (the view lock held)? */
bool past_grace(const struct cluster *c, const struct peer *p);
/* Wake the rebalance and heartbeat threads (a membership change). */
void rebalance_kick(struct cluster *c);

/* ---- members (members.c) ---- */

/* Is s (n bytes) a member id: 1..STORE_OWED_PEER_MAX letters, digits or ._-? */
bool id_ok(const char *s, size_t n);
/* Close p's idle sockets (its endpoint or key changed, or the end); p->lock held. */
void peer_drop_idle(struct peer *p);
/* The peers of a cluster_peers list, live from the start. 0, or -EINVAL with err. */
int members_parse_list(struct cluster *c, const char *list, char *err, size_t errlen);
/* The etcd settings of o checked and kept in c (etcd mode). 0, or -EINVAL with err. */
int members_etcd_setup(struct cluster *c, const struct cluster_opts *o, char *err,
		       size_t errlen);
/* The threads that keep this daemon's etcd record alive, and apply the others'. */
void *registrar_main(void *arg);
void *watcher_main(void *arg);

/* ---- transfers (transfer.c) ---- */

void call_out_free(struct call_out *o);
/*
 * Send req (and its payload frames: on the socket's bulk connection when cluster_bulk
 * and the peer takes them there, in frames once more if it refuses them there) to
 * peer p and wait for the reply until the deadline. Returns 0 with out filled
 * (out->rep.code may be an error), or
 * -ETIMEDOUT / -EIO / -ENOMEM, the peer then marked suspect; -EBUSY (not marked)
 * when PEER_INFLIGHT_MAX calls to p are under way.
 */
int peer_call(struct cluster *c, struct peer *p, struct kvbp_request *req,
	      const void *const *frames, const size_t *lens, size_t n_frames,
	      struct call_out *out);
/* Record (store first: a crash from here on still pushes it) and queue a push. */
void owe(struct cluster *c, size_t peer, uint32_t model_id, const uint8_t *hash,
	 bool rebalance);
/* Push one chunk to one peer now: 0 done (or nothing to do), -EAGAIN retry later. */
int push_one(struct cluster *c, const struct push *e, uint64_t *bytes);
/* Pushes queued for live members that are not suspect, plus those under way. */
size_t pushes_pending(struct cluster *c);
/* The push thread: what the store still owes first, then the queue. */
void *pusher_main(void *arg);

/* ---- rebalance and heartbeats (rebalance.c) ---- */

void *rebalancer_main(void *arg);
void *heart_main(void *arg);

#endif
