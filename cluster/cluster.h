/*
 * cluster — the daemons of a cluster share one chunk space (docs/cluster.md).
 *
 * Members are this daemon (node_id) and either the peers of cluster_peers, each
 * "id=tcp://host:port[=Z85 server key]", or those registered in etcd
 * (cluster_etcd: each daemon keeps its record under a lease and watches the
 * others'). A chunk's owners are the cluster_replicas best live members by
 * weighted rendezvous hashing (place.h). When the members change, the chunks
 * held here whose owners changed are pushed to their new owners, rate limited.
 *
 * Write path: a chunk a client stores here is pushed, as its stored bytes
 * (REPLICATE), to its owners other than this daemon by a background thread.
 * What is owed is recorded in the store (store_owed_put) once the chunk is
 * stored, before the PUT is answered, and cleared once the owner has it, so a
 * restart resumes the pushes. A peer that does not answer is retried after a
 * pause.
 *
 * Read path: a chunk missing here is fetched (FETCH) from its owners in
 * placement order, its bytes verified and stored here as a copy
 * (store_chunk_import); a LOOKUP miss asks the owners (LOOKUP).
 *
 * Every remote call has a deadline (cluster_timeout_ms); a peer that misses one
 * is suspect and skipped for a while, so it never holds a local request past
 * the deadline again. Thread-safe.
 *
 * A library the daemon drives: it imports nothing from daemon/. What it needs
 * from the daemon (settings, logging, the wire form of a model) comes in
 * through struct cluster_opts.
 */
#ifndef KVBLEND_CLUSTER_CLUSTER_H
#define KVBLEND_CLUSTER_CLUSTER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/wire.h"
#include "store/store.h"

#define CLUSTER_ENDPOINT_MAX 256 /* an endpoint with its NUL, as the daemon's listen */

struct cluster;

/* Levels of the cluster's log lines (cluster_opts.log). */
enum cluster_log_level { CLUSTER_LOG_ERR = 0, CLUSTER_LOG_WARN, CLUSTER_LOG_INFO };

/*
 * What the daemon hands the cluster: its settings (named as in the daemon's
 * config), where to log, and how a stored model is described on the wire. The
 * strings are read during cluster_new() only (copied where kept); store,
 * log and describe must outlive the cluster.
 */
struct cluster_opts {
	const char *node_id;   /* this member's id; "" or NULL: the host name */
	const char *peers;     /* cluster_peers: "id=tcp://host:port[=key]", comma separated */
	const char *etcd;      /* cluster_etcd: the etcd endpoints, comma separated */
	/* cluster_etcd_ca_file, _cert_file, _key_file, _user, _password_file ("" or NULL:
	 * unset); the password file is read by cluster_new */
	const char *etcd_ca_file, *etcd_cert_file, *etcd_key_file, *etcd_user;
	const char *etcd_password_file;
	const char *name;      /* cluster_name: the etcd prefix is /kvblend/NAME/members/ */
	const char *advertise; /* cluster_advertise: tcp://HOST:PORT other members reach */
	const char *listen_tcp; /* the first tcp:// listen endpoint, NULL or "" without */
	unsigned replicas;	/* cluster_replicas */
	int timeout_ms;		/* cluster_timeout_ms: every remote call's deadline */
	int hedge_ms;		/* cluster_hedge_ms: a fetch not answered this long also asks
				 * the next member; 0 never */
	bool bulk;		/* cluster_bulk: FETCH and REPLICATE payloads to and from
				 * peers over tcp:// on bulk connections where they offer one */
	uint64_t max_message;	/* max_message: a fetched chunk's raw bytes at most this, as a
				 * REPLICATE's (checked before anything is allocated for it);
				 * 0: 1 GiB */
	uint64_t rebalance_rate; /* cluster_rebalance_rate: bytes/s of rebalance pushes */
	uint64_t repair_interval_s; /* cluster_repair_interval: 0 never */
	int lease_ttl_s;	    /* cluster_lease_ttl: the etcd lease */
	uint64_t forget_after_s;    /* cluster_forget_after: a gone member owed nothing is
				     * forgotten after this (0: the default, 600) */
	uint64_t grace_s;	    /* cluster_grace: a member gone from etcd keeps its place
				     * this long (its chunks not re-replicated); 0 none */
	uint64_t drain_timeout_s;   /* cluster_drain_timeout: cluster_drain's bound; 0 none */
	uint64_t capacity;	    /* bytes this member offers (its weight in placement) */
	/* this daemon's CURVE key pair (Z85, "" or NULL without), towards peers with a key */
	const char *curve_secret, *curve_public;
	struct store *store;
	/* one line, without a newline, at a cluster_log_level; NULL: no log */
	void (*log)(int level, const char *msg);
	/* m as a request describes it (FETCH and REPLICATE carry the model) */
	void (*describe)(const struct store_model *m, struct kvbp_model *out);
};

/*
 * Parse o's cluster settings and start the push thread (which first queues
 * what the store says is still owed). *out is NULL (no cluster)
 * when o->peers and o->etcd are empty. Returns 0, -ENOMEM, or -EINVAL (or
 * another negative errno when a thread cannot start) with a message in err
 * naming the bad setting.
 */
int cluster_new(const struct cluster_opts *o, struct cluster **out, char *err, size_t errlen);
void cluster_free(struct cluster **c);

/*
 * Fetch chunk hash of model m from its owners (then the other members) and store
 * it here. Returns 0 when it is stored here now (also when it already was),
 * -ENOENT when no live member has it, or another negative errno. A member that
 * has not answered within cluster_hedge_ms is not waited for: the next is asked
 * too, the first answer wins; one whose payload makes no progress for
 * cluster_hedge_ms is given up (and skipped for a while) for the next. Bounded by
 * cluster_timeout_ms per member. A reply for a chunk above max_message is refused.
 */
int cluster_fetch(struct cluster *c, const struct store_model *m, const uint8_t *hash);

/*
 * For hashes not found here (found[i] false), ask their owners; set found[i] and
 * infos[i] for those a live member holds. Returns how many were found there.
 */
size_t cluster_lookup(struct cluster *c, const struct store_model *m,
		      const uint8_t (*hashes)[KVBP_HASH_LEN], size_t n, bool *found,
		      struct store_chunk_info *infos);

/*
 * The description of model name (as stored: "TENANT#NAME" for a tenant's) from
 * the live members, asked in turn (MODEL_LIST naming it), each within
 * cluster_timeout_ms: for a model registered on another member only. Returns 0
 * with *out (its name as stored), or -ENOENT when no live member answers with it.
 */
int cluster_model_find(struct cluster *c, const char *name, struct kvbp_model *out);

/*
 * A clean stop, before cluster_free (which then leaves etcd): every chunk this
 * daemon owns is pushed to the members that own it once this daemon is gone,
 * those that lack it (one LOOKUP per 1024 chunks), not rate limited, and the
 * pushes still queued for live members are sent; all within
 * cluster_drain_timeout, then it returns (what is left stays owed in the store).
 * Returns how many chunks it pushed, or a negative errno (-ETIMEDOUT: the
 * bound ran out first). 0 at once with cluster_drain_timeout 0 or no other member.
 */
long cluster_drain(struct cluster *c);

/* A client stored chunk hash of m here: push it to its other owners. */
void cluster_stored(struct cluster *c, const struct store_model *m, const uint8_t *hash);

struct cluster_stats {
	uint64_t members, suspect; /* in placement (this daemon included); of them suspect */
	uint64_t pushes_owed, pushes_done, push_failures;
	uint64_t remote_hits, remote_misses, fetch_failures, fetched_bytes;
	double fetch_ms; /* total time in successful fetches */
	double fetch_wire_ms; /* of it, until the bytes were here (before checks and store) */
	uint64_t rebalance_pushes, rebalance_skipped; /* to new owners; skipped: they had it */
	uint64_t membership_changes, peer_busy;	      /* peer_busy: calls refused, in-flight cap */
	uint64_t hedged; /* fetches that asked a further member after cluster_hedge_ms */
	uint64_t fetch_stalls; /* FETCH payloads given up: no progress for cluster_hedge_ms */
	uint64_t bulk_fetches; /* fetched chunks whose bytes came on a bulk connection */
	uint64_t bulk_pushes;  /* chunks pushed (REPLICATE) whose bytes went on one */
	bool etcd, etcd_ok;			      /* membership from etcd; etcd answers now */
	uint64_t etcd_errors, etcd_last_ok_ms;	      /* failed etcd calls; last success (unix ms) */
};

void cluster_stats(struct cluster *c, struct cluster_stats *out);

enum cluster_state { CLUSTER_ALIVE = 1, CLUSTER_SUSPECT = 0, CLUSTER_GONE = -1 };

struct cluster_member {
	char id[STORE_OWED_PEER_MAX + 1];
	char endpoint[CLUSTER_ENDPOINT_MAX];
	enum cluster_state state; /* gone: left etcd (kept for the pushes it is owed) */
	uint64_t owed;		  /* pushes queued for it */
	uint64_t last_reply_ms;	  /* unix ms of its last answer (heartbeats: about 1 s); 0 never */
	uint64_t held_chunks, held_bytes; /* its store at its last heartbeat (copies included) */
};

/* Each other member this daemon knows. */
void cluster_members(struct cluster *c, void (*fn)(void *ctx, const struct cluster_member *m),
		     void *ctx);

/*
 * Is principal (a client as server.c names it: "key:Z85" on CURVE, "tcp:ADDRESS" on
 * plain TCP) a live member of this cluster? A member with a CURVE key is known by
 * that key only (members connect with their own key pair); a member without one by
 * the address of its endpoint's host, which on a keyless cluster any client of
 * that host shares: a keyless cluster trusts its network. c may be NULL (false).
 */
bool cluster_is_member(struct cluster *c, const char *principal);

/*
 * For n chunks of model m held here as cache copies: held[i] true when every owner
 * of chunk i under the current membership is known to hold it (one LOOKUP per
 * owner for its share of the hashes, each within cluster_timeout_ms); false when
 * this daemon is an owner, or an owner lacks it, is suspect, gone or does not
 * answer. A cache copy may go once its owners hold the chunk.
 */
void cluster_owners_hold(struct cluster *c, const struct store_model *m,
			 const uint8_t (*hashes)[KVBP_HASH_LEN], size_t n, bool *held);

/* The store the cluster was given (cluster_opts.store). */
struct store *cluster_store(struct cluster *c);

/*
 * A replication check of the chunks held here (check.c), as `redis-cli --cluster
 * check` does for slots. Each chunk's owners under the current membership are
 * asked (one LOOKUP per owner, model and 1024 chunks, each within
 * cluster_timeout_ms) whether they hold it. A chunk with fewer than R verified
 * copies among its owners (R: cluster_replicas, or the members in placement if
 * fewer) is under-replicated; it is counted by one member only: the first of its
 * owners in placement order that holds it, or, when no owner does, each member
 * holding a copy. A copy held by a member that does not own the chunk is a copy
 * beyond R (a cache copy, cluster_cache_pct).
 */
struct cluster_check {
	uint64_t chunks;     /* held here */
	uint64_t owned;	     /* of them owned here */
	uint64_t beyond;     /* of them not owned here: copies beyond R */
	uint64_t under;	     /* under-replicated chunks counted here */
	uint64_t unverified; /* owner copies not known: the owner did not answer */
	uint64_t missing;    /* cluster_check_all: copies this member owns and lacks */
	bool complete;	     /* every chunk held here was looked at within the budget */
	uint64_t took_ms;
	uint64_t at_ms; /* unix ms it finished; 0: never run */
};

/*
 * Check the chunks held here, stopping after budget_ms (0: no bound; -1: half
 * of cluster_timeout_ms, for a member asked by another) with out->complete
 * false. The result is also kept as this member's last (the
 * stats' and metrics' gauge, cluster_check_last). 0, or a negative errno when
 * the store cannot be read.
 */
int cluster_check_local(struct cluster *c, int64_t budget_ms, struct cluster_check *out);
/* The last check's figures (at_ms 0 when none has run). */
void cluster_check_last(struct cluster *c, struct cluster_check *out);

struct cluster_check_member {
	char id[STORE_OWED_PEER_MAX + 1];
	bool answered; /* false: gone, suspect, or a LIST failed or missed cluster_timeout_ms */
	struct cluster_check check; /* chunks, owned, beyond, missing, unverified */
};

/*
 * The whole cluster's check, exact: every member in placement lists its chunks
 * of each model this daemon knows (one LIST per member and model, answered from
 * its store with no further call: nothing waits on this daemon's workers), and
 * this daemon places each chunk and counts, per member, the chunks held, those
 * it owns, those beyond R, the copies it owns but lacks (missing), and owner
 * copies not known (unverified: that owner did not answer); *under is the
 * chunks with fewer than R copies among their owners. Holds every member's list
 * at once (36 bytes a copy). Then asks every member to run its own
 * cluster_check_local in the background (the gauges). *out malloc'd (free it),
 * [0] this daemon, *n entries. 0, or a negative errno (the store, memory).
 */
int cluster_check_all(struct cluster *c, struct cluster_check_member **out, size_t *n,
		      uint64_t *under);
/* Ask this daemon's rebalance thread, and every live member's, for a local check. */
void cluster_check_request(struct cluster *c);
/* Ask this daemon's rebalance thread for a local check (a member's HELLO asked it). */
void cluster_check_wanted(struct cluster *c);

/* Is this daemon one of hash's owners under the current membership? */
bool cluster_owns(struct cluster *c, const uint8_t *hash);

#endif
