/* cluster — chunks shared across daemons; see cluster.h and docs/cluster.md. */
#include "cluster.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <netdb.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "etcd.h"
#include "log.h"
#include "ops.h"
#include "place.h"
#include "record.h"

#define POOL 4		      /* idle sockets kept per peer */
#define SUSPECT_MS 2000	      /* a peer that missed a deadline is skipped this long */
#define QUEUE_MAX (1u << 16)  /* pushes held in memory; the rest wait in the store */
#define MEMBERS_MAX 1024
#define PEER_INFLIGHT_MAX 32  /* calls to one peer at once; more are refused (-EBUSY) */
#define HEARTBEAT_MS 1000     /* a live member not heard from this long is pinged */
#define LOOKUP_BATCH 1024     /* hashes per LOOKUP of a rebalance */

struct peer {
	char id[STORE_OWED_PEER_MAX + 1];
	/* endpoint and key change only under lock (a member re-registering elsewhere) */
	char endpoint[CONFIG_ENDPOINT_MAX];
	char key[41]; /* the peer's CURVE server key, "" for none */
	double weight;
	bool live; /* in placement: listed statically, or registered in etcd (view lock) */
	pthread_mutex_t lock;
	void *idle[POOL];
	unsigned n_idle;
	atomic_int_fast64_t suspect_until; /* ms, monotonic */
	atomic_int_fast64_t last_reply;	   /* ms, realtime; 0 never */
	atomic_int in_flight;
	atomic_uint_fast64_t held_chunks, held_bytes; /* its store, at its last heartbeat */
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
	void *zctx;
	char self[STORE_OWED_PEER_MAX + 1];
	char secret[41], public_key[41];
	double self_weight;
	unsigned replicas;
	int timeout_ms;
	atomic_uint_fast64_t next_id;
	/* members: peers only grow (an index stays valid); the view is rebuilt on change */
	pthread_rwlock_t view_lock;
	struct peer *peers[MEMBERS_MAX];
	size_t n_peers;
	struct view view;
	atomic_uint_fast64_t view_gen, membership_changes;
	/* pushes */
	pthread_t pusher;
	bool pusher_started;
	pthread_mutex_t qlock;
	pthread_cond_t qcond;
	bool stop;
	struct push *q;
	size_t q_head, q_len;
	bool rescan; /* owed pushes in the store that the queue could not hold */
	uint64_t rebalance_rate;
	int64_t rebalance_next_ns; /* the rate limit: no rebalance push before this */
	atomic_uint_fast64_t pushes_done, push_failures, remote_hits, remote_misses,
		fetch_failures, fetched_bytes, fetch_ns, in_flight, rebalance_pushes,
		rebalance_skipped, peer_busy;
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
	char etcd_urls[CONFIG_ENDPOINT_MAX * 2];
	char prefix[256];
	char advertise[CONFIG_ENDPOINT_MAX];
	uint64_t capacity;
	int lease_ttl;
	pthread_t registrar, watcher;
	bool registrar_started, watcher_started;
	atomic_bool etcd_stop, watch_abort, etcd_ok, etcd_synced;
	atomic_uint_fast64_t etcd_errors, etcd_last_ok; /* realtime ms */
};

static void *pusher_main(void *arg);
static void *rebalancer_main(void *arg);
static void *heart_main(void *arg);
static void *registrar_main(void *arg);
static void *watcher_main(void *arg);

static int64_t now_ms(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static int64_t now_ns(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (int64_t)t.tv_sec * 1000000000 + t.tv_nsec;
}

static int64_t wall_ms(void)
{
	struct timespec t;

	clock_gettime(CLOCK_REALTIME, &t);
	return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static bool suspect(struct peer *p)
{
	return atomic_load(&p->suspect_until) > now_ms();
}

/* Sleep on cond (its mutex held) for ms, or until signalled. */
static void wait_ms(pthread_cond_t *cond, pthread_mutex_t *mu, int64_t ms)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	ts.tv_sec += ms / 1000;
	ts.tv_nsec += (ms % 1000) * 1000000;
	ts.tv_sec += ts.tv_nsec / 1000000000;
	ts.tv_nsec %= 1000000000;
	pthread_cond_timedwait(cond, mu, &ts);
}

/* ---- the view ---- */

static void view_free(struct view *v)
{
	free(v->members);
	free(v->peer_of);
	memset(v, 0, sizeof(*v));
}

/* A copy of c's view into out (the view lock held). */
static int view_copy(const struct view *in, struct view *out)
{
	out->members = malloc(in->n * sizeof(*out->members));
	out->peer_of = malloc(in->n * sizeof(*out->peer_of));
	if (!out->members || !out->peer_of) {
		view_free(out);
		return -ENOMEM;
	}
	memcpy(out->members, in->members, in->n * sizeof(*out->members));
	memcpy(out->peer_of, in->peer_of, in->n * sizeof(*out->peer_of));
	out->n = in->n;
	return 0;
}

/* Rebuild the view from the live peers (the view lock held for writing). */
static int view_rebuild(struct cluster *c)
{
	struct view v = { 0 };
	size_t n = 1;

	v.members = malloc((c->n_peers + 1) * sizeof(*v.members));
	v.peer_of = malloc((c->n_peers + 1) * sizeof(*v.peer_of));
	if (!v.members || !v.peer_of) {
		view_free(&v);
		return -ENOMEM;
	}
	v.members[0] = (struct place_member){ place_seed(c->self), c->self_weight };
	v.peer_of[0] = 0;
	for (size_t i = 0; i < c->n_peers; i++)
		if (c->peers[i]->live) {
			v.members[n] = (struct place_member){ place_seed(c->peers[i]->id),
							      c->peers[i]->weight };
			v.peer_of[n++] = (uint32_t)(i + 1);
		}
	v.n = n;
	view_free(&c->view);
	c->view = v;
	atomic_fetch_add(&c->view_gen, 1);
	return 0;
}

/* Members of view v in placement order for hash, as 0 (this daemon) or 1 + peer index. */
static size_t view_ranked(const struct view *v, const uint8_t *hash, size_t r, size_t *idx)
{
	size_t n = place_owners(v->members, v->n, hash, r, idx);

	for (size_t j = 0; j < n; j++)
		idx[j] = v->peer_of[idx[j]];
	return n;
}

/* The same for the current view. */
static size_t ranked(struct cluster *c, const uint8_t *hash, size_t r, size_t *idx)
{
	size_t n;

	pthread_rwlock_rdlock(&c->view_lock);
	n = view_ranked(&c->view, hash, r, idx);
	pthread_rwlock_unlock(&c->view_lock);
	return n;
}

static struct peer *peer_at(struct cluster *c, size_t i)
{
	struct peer *p;

	pthread_rwlock_rdlock(&c->view_lock);
	p = i < c->n_peers ? c->peers[i] : NULL;
	pthread_rwlock_unlock(&c->view_lock);
	return p;
}

static bool peer_live(struct cluster *c, struct peer *p)
{
	bool live;

	pthread_rwlock_rdlock(&c->view_lock);
	live = p->live;
	pthread_rwlock_unlock(&c->view_lock);
	return live;
}

static size_t n_peers(struct cluster *c)
{
	size_t n;

	pthread_rwlock_rdlock(&c->view_lock);
	n = c->n_peers;
	pthread_rwlock_unlock(&c->view_lock);
	return n;
}

static void rebalance_kick(struct cluster *c)
{
	/* the heartbeat thread sleeps on the same condition: wake both, not one of them */
	pthread_mutex_lock(&c->rlock);
	pthread_cond_broadcast(&c->rcond);
	pthread_mutex_unlock(&c->rlock);
}

/* ---- configuration ---- */

static bool id_ok(const char *s, size_t n)
{
	if (!n || n > STORE_OWED_PEER_MAX)
		return false;
	for (size_t i = 0; i < n; i++)
		if (!isalnum((unsigned char)s[i]) && !strchr("._-", s[i]))
			return false;
	return true;
}

/* A new peer (the view lock held for writing, or before any thread runs). */
static struct peer *peer_add(struct cluster *c, const char *id, size_t id_len)
{
	struct peer *p;

	if (c->n_peers == MEMBERS_MAX - 1)
		return NULL;
	p = calloc(1, sizeof(*p));
	if (!p)
		return NULL;
	memcpy(p->id, id, id_len);
	p->weight = 1.0;
	pthread_mutex_init(&p->lock, NULL);
	c->peers[c->n_peers++] = p;
	return p;
}

static struct peer *peer_find(struct cluster *c, const char *id)
{
	for (size_t i = 0; i < c->n_peers; i++)
		if (!strcmp(c->peers[i]->id, id))
			return c->peers[i];
	return NULL;
}

/* Close p's idle sockets (its endpoint or key changed); p->lock held. */
static void peer_drop_idle(struct peer *p)
{
	while (p->n_idle)
		zmq_close(p->idle[--p->n_idle]);
}

/* One "id=tcp://host:port[=key]" of cluster_peers. */
static int parse_peer(struct cluster *c, const char *s, size_t n, char *err, size_t errlen)
{
	const char *eq = memchr(s, '=', n), *ep, *eq2;
	size_t id_len, ep_len;
	struct peer *p;

	if (!eq) {
		snprintf(err, errlen, "cluster_peers: '%.*s' is not ID=tcp://HOST:PORT[=KEY]", (int)n,
			 s);
		return -EINVAL;
	}
	id_len = (size_t)(eq - s);
	if (!id_ok(s, id_len)) {
		snprintf(err, errlen, "cluster_peers: member id '%.*s' must be 1..%d letters, digits "
			 "or ._-", (int)id_len, s, STORE_OWED_PEER_MAX);
		return -EINVAL;
	}
	ep = eq + 1;
	eq2 = memchr(ep, '=', n - id_len - 1);
	ep_len = eq2 ? (size_t)(eq2 - ep) : n - id_len - 1;
	if (!record_endpoint_ok(ep, ep_len)) {
		snprintf(err, errlen, "cluster_peers: member '%.*s': endpoint '%.*s' must be "
			 "tcp://HOST:PORT", (int)id_len, s, (int)ep_len, ep);
		return -EINVAL;
	}
	if (eq2 && n - id_len - 1 - ep_len - 1 != 40) {
		snprintf(err, errlen, "cluster_peers: member '%.*s': a CURVE key is 40 Z85 "
			 "characters; got %zu", (int)id_len, s, n - id_len - 1 - ep_len - 1);
		return -EINVAL;
	}
	if (id_len == strlen(c->self) && !memcmp(s, c->self, id_len))
		return 0; /* this daemon, listed like the others */
	for (size_t i = 0; i < c->n_peers; i++)
		if (strlen(c->peers[i]->id) == id_len && !memcmp(c->peers[i]->id, s, id_len)) {
			snprintf(err, errlen, "cluster_peers: member '%.*s' listed twice", (int)id_len,
				 s);
			return -EINVAL;
		}
	p = peer_add(c, s, id_len);
	if (!p) {
		snprintf(err, errlen, "cluster_peers: more than %d members", MEMBERS_MAX);
		return -EINVAL;
	}
	memcpy(p->endpoint, ep, ep_len);
	if (eq2)
		memcpy(p->key, eq2 + 1, 40);
	p->live = true;
	return 0;
}

/* The endpoint other members reach this daemon at (etcd mode). */
static int advertise_endpoint(struct cluster *c, const struct config *cfg, char *err,
			      size_t errlen)
{
	const char *tcp = NULL;

	if (cfg->cluster_advertise[0]) {
		if (!record_endpoint_ok(cfg->cluster_advertise, strlen(cfg->cluster_advertise))) {
			snprintf(err, errlen, "cluster_advertise: '%.200s' is not tcp://HOST:PORT",
				 cfg->cluster_advertise);
			return -EINVAL;
		}
		memcpy(c->advertise, cfg->cluster_advertise, strlen(cfg->cluster_advertise) + 1);
		return 0;
	}
	for (unsigned i = 0; i < cfg->n_listen && !tcp; i++)
		if (!strncmp(cfg->listen[i], "tcp://", 6))
			tcp = cfg->listen[i];
	if (!tcp) {
		snprintf(err, errlen, "cluster_etcd needs a tcp:// endpoint in listen (other members "
			 "reach this daemon there), or cluster_advertise");
		return -EINVAL;
	}
	{
		const char *host = tcp + 6, *colon = strrchr(host, ':');
		size_t hl = colon ? (size_t)(colon - host) : strlen(host);

		if (!colon) {
			snprintf(err, errlen, "listen '%.200s' has no port", tcp);
			return -EINVAL;
		}
		if ((hl == 1 && host[0] == '*') || (hl == 7 && !memcmp(host, "0.0.0.0", 7)) ||
		    (hl == 4 && !memcmp(host, "[::]", 4))) {
			char name[256];

			if (gethostname(name, sizeof(name) - 1)) {
				snprintf(err, errlen, "listen '%.200s' binds every address: set "
					 "cluster_advertise", tcp);
				return -EINVAL;
			}
			name[sizeof(name) - 1] = 0;
			snprintf(c->advertise, sizeof(c->advertise), "tcp://%.100s%.20s", name, colon);
		} else {
			memcpy(c->advertise, tcp, strlen(tcp) + 1); /* < CONFIG_ENDPOINT_MAX */
		}
	}
	return 0;
}

static int start_thread(pthread_t *t, bool *started, void *(*fn)(void *), void *arg,
			const char *what, char *err, size_t errlen)
{
	int rc = pthread_create(t, NULL, fn, arg);

	if (rc) {
		snprintf(err, errlen, "cannot start the cluster's %s thread: %s", what, strerror(rc));
		return -rc;
	}
	*started = true;
	return 0;
}

int cluster_new(const struct config *cfg, struct store *store, const char *curve_secret,
		const char *curve_public, struct cluster **out, char *err, size_t errlen)
{
	struct cluster *c;
	const char *s = cfg->cluster_peers;
	bool etcd = cfg->cluster_etcd[0] != 0;
	int rc = 0;

	*out = NULL;
	if (!s[0] && !etcd)
		return 0;
	if (s[0] && etcd) {
		snprintf(err, errlen, "cluster_peers and cluster_etcd: a cluster's members come from "
			 "one of them; set only one");
		return -EINVAL;
	}
	c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	c->store = store;
	c->replicas = (unsigned)cfg->cluster_replicas;
	c->timeout_ms = (int)cfg->cluster_timeout_ms;
	c->rebalance_rate = cfg->cluster_rebalance_rate;
	c->repair_ms = (int64_t)cfg->cluster_repair_interval * 1000;
	c->self_weight = 1.0;
	pthread_rwlock_init(&c->view_lock, NULL);
	pthread_mutex_init(&c->qlock, NULL);
	pthread_cond_init(&c->qcond, NULL);
	pthread_mutex_init(&c->rlock, NULL);
	pthread_cond_init(&c->rcond, NULL);
	if (cfg->node_id[0]) {
		size_t n = strlen(cfg->node_id);

		if (!id_ok(cfg->node_id, n)) {
			snprintf(err, errlen, "node_id '%.64s' must be 1..%d letters, digits or ._-",
				 cfg->node_id, STORE_OWED_PEER_MAX);
			rc = -EINVAL;
			goto fail;
		}
		memcpy(c->self, cfg->node_id, n + 1);
	} else if (gethostname(c->self, sizeof(c->self) - 1)) {
		snprintf(c->self, sizeof(c->self), "kvblendd");
	}
	if (!id_ok(c->self, strlen(c->self))) {
		snprintf(err, errlen, "the host name '%s' is no node_id (letters, digits, ._-): set "
			 "node_id", c->self);
		rc = -EINVAL;
		goto fail;
	}
	while (*s) {
		size_t n = strcspn(s, ", \t\n");

		if (!n) {
			s++;
			continue;
		}
		rc = parse_peer(c, s, n, err, errlen);
		if (rc < 0)
			goto fail;
		s += n;
	}
	if (!etcd && !c->n_peers) {
		snprintf(err, errlen, "cluster_peers lists no member but this one ('%s')", c->self);
		rc = -EINVAL;
		goto fail;
	}
	if (etcd) {
		struct etcd *probe;

		if (!id_ok(cfg->cluster_name, strlen(cfg->cluster_name))) {
			snprintf(err, errlen, "cluster_name '%.64s' must be 1..%d letters, digits or ._-",
				 cfg->cluster_name, STORE_OWED_PEER_MAX);
			rc = -EINVAL;
			goto fail;
		}
		if (strlen(cfg->cluster_etcd) >= sizeof(c->etcd_urls)) {
			snprintf(err, errlen, "cluster_etcd: longer than %zu characters",
				 sizeof(c->etcd_urls) - 1);
			rc = -EINVAL;
			goto fail;
		}
		memcpy(c->etcd_urls, cfg->cluster_etcd, strlen(cfg->cluster_etcd) + 1);
		rc = etcd_new(c->etcd_urls, c->timeout_ms, &probe, err, errlen); /* checks the list */
		if (rc)
			goto fail;
		etcd_free(&probe);
		rc = advertise_endpoint(c, cfg, err, errlen);
		if (rc)
			goto fail;
		snprintf(c->prefix, sizeof(c->prefix), "/kvblend/%.64s/members/",
			 cfg->cluster_name);
		c->lease_ttl = (int)cfg->cluster_lease_ttl;
		c->capacity = cfg->capacity ? cfg->capacity : cfg->map_size;
		/* weight: capacity in GiB, the same formula every member applies to every record */
		c->self_weight = fmax((double)c->capacity / (double)(1ull << 30), 1.0 / 1024);
	}
	c->q = calloc(QUEUE_MAX, sizeof(*c->q));
	c->zctx = zmq_ctx_new();
	if (!c->q || !c->zctx || view_rebuild(c)) {
		rc = -ENOMEM;
		goto fail;
	}
	/* Towards peers with a key this daemon authenticates with its own, or a fresh one. */
	if (curve_secret && curve_secret[0]) {
		snprintf(c->secret, sizeof(c->secret), "%s", curve_secret);
		snprintf(c->public_key, sizeof(c->public_key), "%s", curve_public);
	} else if (zmq_curve_keypair(c->public_key, c->secret)) {
		c->secret[0] = c->public_key[0] = 0;
	}
	/* A static cluster's first view is the one the chunks are in already. */
	if (!etcd) {
		c->have_rebalanced = view_copy(&c->view, &c->rebalanced) == 0;
		c->rebalanced_gen = atomic_load(&c->view_gen);
		c->rebalanced_wall_s = (uint64_t)(wall_ms() / 1000);
	}
	rc = start_thread(&c->pusher, &c->pusher_started, pusher_main, c, "push", err, errlen);
	if (!rc)
		rc = start_thread(&c->rebalancer, &c->rebalancer_started, rebalancer_main, c,
				  "rebalance", err, errlen);
	if (!rc)
		rc = start_thread(&c->heart, &c->heart_started, heart_main, c, "heartbeat", err,
				  errlen);
	if (!rc && etcd)
		rc = start_thread(&c->registrar, &c->registrar_started, registrar_main, c,
				  "etcd lease", err, errlen);
	if (!rc && etcd)
		rc = start_thread(&c->watcher, &c->watcher_started, watcher_main, c, "etcd watch",
				  err, errlen);
	if (rc)
		goto fail;
	if (etcd)
		log_info("cluster: node '%s' at %s, members from etcd %s under %s, %u replicas, "
			 "timeout %d ms, lease %d s", c->self, c->advertise, c->etcd_urls, c->prefix,
			 c->replicas, c->timeout_ms, c->lease_ttl);
	else
		log_info("cluster: node '%s', %zu other members, %u replicas, timeout %d ms",
			 c->self, c->n_peers, c->replicas, c->timeout_ms);
	*out = c;
	return 0;
fail:
	cluster_free(&c);
	return rc;
}

/* ---- calls to a peer ---- */

static void *sock_get(struct cluster *c, struct peer *p)
{
	void *s = NULL;
	int zero = 0;

	char endpoint[CONFIG_ENDPOINT_MAX], key[41];

	pthread_mutex_lock(&p->lock);
	if (p->n_idle)
		s = p->idle[--p->n_idle];
	memcpy(endpoint, p->endpoint, sizeof(endpoint));
	memcpy(key, p->key, sizeof(key));
	pthread_mutex_unlock(&p->lock);
	if (s)
		return s;
	s = zmq_socket(c->zctx, ZMQ_DEALER);
	if (!s)
		return NULL;
	zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
	if (key[0] && c->secret[0] &&
	    (zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, key, 40) ||
	     zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, c->public_key, 40) ||
	     zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, c->secret, 40))) {
		zmq_close(s);
		return NULL;
	}
	if (!endpoint[0] || zmq_connect(s, endpoint)) {
		zmq_close(s);
		return NULL;
	}
	return s;
}

static void sock_put(struct peer *p, void *s, bool good)
{
	pthread_mutex_lock(&p->lock);
	if (good && p->n_idle < POOL) {
		p->idle[p->n_idle++] = s;
		s = NULL;
	}
	pthread_mutex_unlock(&p->lock);
	if (s)
		zmq_close(s); /* a late reply can never answer a later call */
}

struct call_out {
	struct kvbp_reply rep;
	zmq_msg_t *frames;
	size_t n_frames;
};

static void call_out_free(struct call_out *o)
{
	for (size_t i = 0; i < o->n_frames; i++)
		zmq_msg_close(&o->frames[i]);
	free(o->frames);
	o->frames = NULL;
	o->n_frames = 0;
	kvbp_reply_clear(&o->rep);
}

/*
 * Send req (and its payload frames) to peer p and wait for the reply until the
 * deadline. Returns 0 with out filled (out->rep.code may be an error), or
 * -ETIMEDOUT / -EIO / -ENOMEM, the peer then marked suspect.
 */
static int peer_call(struct cluster *c, struct peer *p, struct kvbp_request *req,
		     const void *const *frames, const size_t *lens, size_t n_frames,
		     struct call_out *out)
{
	int64_t deadline = now_ms() + c->timeout_ms;
	void *s;
	uint8_t *hdr = NULL;
	size_t hlen;
	int rc = 0;

	memset(out, 0, sizeof(*out));
	if (atomic_fetch_add(&p->in_flight, 1) >= PEER_INFLIGHT_MAX) {
		atomic_fetch_sub(&p->in_flight, 1);
		atomic_fetch_add(&c->peer_busy, 1);
		return -EBUSY; /* the peer is not marked: it is busy, not gone */
	}
	s = sock_get(c, p);
	if (!s) {
		atomic_fetch_sub(&p->in_flight, 1);
		return -EIO;
	}
	req->version = KVBP_VERSION;
	req->request_id = atomic_fetch_add(&c->next_id, 1) + 1;
	req->local_only = true; /* the peer answers from its own store: no call back */
	req->payload_frames = (uint32_t)n_frames;
	if (kvbp_request_encode(req, &hdr, &hlen)) {
		sock_put(p, s, true);
		atomic_fetch_sub(&p->in_flight, 1);
		return -ENOMEM;
	}
	if (zmq_send(s, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
	    zmq_send(s, hdr, hlen, (n_frames ? ZMQ_SNDMORE : 0) | ZMQ_DONTWAIT) < 0)
		rc = -EIO;
	free(hdr);
	for (size_t i = 0; !rc && i < n_frames; i++)
		if (zmq_send(s, frames[i], lens[i], (i + 1 < n_frames ? ZMQ_SNDMORE : 0) |
							    ZMQ_DONTWAIT) < 0)
			rc = -EIO;
	while (!rc) {
		zmq_pollitem_t it = { s, 0, ZMQ_POLLIN, 0 };
		int64_t left = deadline - now_ms();
		zmq_msg_t parts[2];
		size_t np = 0, cap = 0;
		int more = 1;
		char derr[128];

		if (left <= 0) {
			rc = -ETIMEDOUT;
			break;
		}
		if (zmq_poll(&it, 1, (long)left) <= 0)
			continue; /* EINTR or timeout: the loop checks the deadline */
		for (; more && np < 2; np++) {
			zmq_msg_init(&parts[np]);
			if (zmq_msg_recv(&parts[np], s, 0) < 0) {
				zmq_msg_close(&parts[np]);
				rc = -EIO;
				break;
			}
			more = zmq_msg_more(&parts[np]);
		}
		while (!rc && more) {
			if (out->n_frames == cap) {
				zmq_msg_t *f = realloc(out->frames, (cap = cap ? 2 * cap : 16) *
								      sizeof(*f));

				if (!f) {
					rc = -ENOMEM;
					break;
				}
				out->frames = f;
			}
			zmq_msg_init(&out->frames[out->n_frames]);
			if (zmq_msg_recv(&out->frames[out->n_frames], s, 0) < 0) {
				zmq_msg_close(&out->frames[out->n_frames]);
				rc = -EIO;
				break;
			}
			more = zmq_msg_more(&out->frames[out->n_frames++]);
		}
		if (!rc && (np != 2 || zmq_msg_size(&parts[0]) != 0 ||
			    kvbp_reply_decode(zmq_msg_data(&parts[1]), zmq_msg_size(&parts[1]),
					      &out->rep, derr, sizeof(derr))))
			rc = -EIO;
		for (size_t i = 0; i < np; i++)
			zmq_msg_close(&parts[i]);
		if (!rc && out->rep.request_id == req->request_id)
			break;
		if (!rc) /* someone else's late reply: keep waiting */
			call_out_free(out);
	}
	if (rc) {
		call_out_free(out);
		atomic_store(&p->suspect_until, now_ms() + SUSPECT_MS);
		log_warn("cluster: member '%s': %s; skipped for %d ms", p->id,
			 rc == -ETIMEDOUT ? "no reply within cluster_timeout_ms" : "call failed",
			 SUSPECT_MS);
	} else {
		atomic_store(&p->suspect_until, 0);
		atomic_store(&p->last_reply, wall_ms());
	}
	sock_put(p, s, rc == 0);
	atomic_fetch_sub(&p->in_flight, 1);
	return rc;
}

/* ---- read path ---- */

int cluster_fetch(struct cluster *c, const struct store_model *m, const uint8_t *hash)
{
	/* place_owners ranks at most 64: the owners first, then the rest in order */
	size_t idx[64], n = ranked(c, hash, 64, idx);
	int rc = -ENOENT;

	/* the owners first, then everyone else (a chunk may sit where it used to belong) */
	for (size_t i = 0; i < n && rc; i++) {
		struct peer *p;
		struct kvbp_request q = { .op = KVBP_OP_FETCH, .has_model = true, .has_hash = true };
		struct call_out o;
		struct timespec t0, t1;
		const void **blobs;
		size_t *lens;
		int crc;

		if (idx[i] == 0)
			continue;
		p = peer_at(c, idx[i] - 1);
		if (!p || suspect(p))
			continue;
		model_from_store(m, &q.model);
		snprintf(q.model_name, sizeof(q.model_name), "%s", m->name);
		memcpy(q.hash, hash, KVBP_HASH_LEN);
		clock_gettime(CLOCK_MONOTONIC, &t0);
		crc = peer_call(c, p, &q, NULL, NULL, 0, &o);
		if (crc) {
			atomic_fetch_add(&c->fetch_failures, 1);
			continue;
		}
		if (o.rep.code == KVBP_NOT_FOUND) {
			call_out_free(&o);
			continue;
		}
		if (o.rep.code || o.rep.n_chunks != 1 || o.n_frames != m->num_layers) {
			log_warn("cluster: fetch from '%s': %s", p->id,
				 o.rep.code ? o.rep.message : "reply of the wrong shape");
			atomic_fetch_add(&c->fetch_failures, 1);
			call_out_free(&o);
			continue;
		}
		blobs = calloc(o.n_frames, sizeof(*blobs));
		lens = calloc(o.n_frames, sizeof(*lens));
		if (!blobs || !lens) {
			free(blobs);
			free(lens);
			call_out_free(&o);
			return -ENOMEM;
		}
		for (size_t l = 0; l < o.n_frames; l++) {
			blobs[l] = zmq_msg_data(&o.frames[l]);
			lens[l] = zmq_msg_size(&o.frames[l]);
		}
		crc = store_chunk_import(c->store, m, hash, o.rep.chunks[0].num_tokens,
					 o.rep.chunks[0].base_pos, blobs, lens, NULL);
		clock_gettime(CLOCK_MONOTONIC, &t1);
		if (crc >= 0) {
			uint64_t bytes = 0;

			for (size_t l = 0; l < o.n_frames; l++)
				bytes += lens[l];
			atomic_fetch_add(&c->remote_hits, 1);
			atomic_fetch_add(&c->fetched_bytes, bytes);
			atomic_fetch_add(&c->fetch_ns, (uint64_t)(t1.tv_sec - t0.tv_sec) * 1000000000u +
							       (uint64_t)t1.tv_nsec - (uint64_t)t0.tv_nsec);
			rc = 0;
		} else {
			log_warn("cluster: chunk from '%s' refused: %s", p->id,
				 crc == -EBADMSG ? "its bytes fail their checks" : strerror(-crc));
			atomic_fetch_add(&c->fetch_failures, 1);
			if (crc != -EBADMSG)
				rc = crc;
		}
		free(blobs);
		free(lens);
		call_out_free(&o);
	}
	if (rc == -ENOENT)
		atomic_fetch_add(&c->remote_misses, 1);
	return rc;
}

size_t cluster_lookup(struct cluster *c, const struct store_model *m,
		      const uint8_t (*hashes)[KVBP_HASH_LEN], size_t n, bool *found,
		      struct store_chunk_info *infos)
{
	size_t got = 0;

	size_t np = n_peers(c);

	/* one batched LOOKUP per peer, for the missing hashes it owns */
	for (size_t pi = 0; pi < np; pi++) {
		struct peer *p = peer_at(c, pi);
		struct kvbp_request q = { .op = KVBP_OP_LOOKUP };
		size_t *which = NULL, k = 0;
		struct call_out o;

		if (!p || suspect(p) || !peer_live(c, p))
			continue;
		for (size_t i = 0; i < n; i++) {
			size_t idx[16], r;

			if (found[i])
				continue;
			r = ranked(c, hashes[i], c->replicas < 16 ? c->replicas : 16, idx);
			for (size_t j = 0; j < r; j++)
				if (idx[j] == pi + 1) {
					if (!which) {
						which = calloc(n, sizeof(*which));
						q.hashes = calloc(n, KVBP_HASH_LEN);
						if (!which || !q.hashes)
							goto next;
					}
					memcpy(q.hashes[k], hashes[i], KVBP_HASH_LEN);
					which[k++] = i;
				}
		}
		if (!k)
			goto next;
		q.n_hashes = k;
		snprintf(q.model_name, sizeof(q.model_name), "%s", m->name);
		if (peer_call(c, p, &q, NULL, NULL, 0, &o))
			goto next;
		if (o.rep.code == KVBP_OK && o.rep.n_chunks == k)
			for (size_t j = 0; j < k; j++)
				if (o.rep.chunks[j].found && !found[which[j]]) {
					struct store_chunk_info *ci = &infos[which[j]];

					found[which[j]] = true;
					memset(ci, 0, sizeof(*ci));
					ci->num_tokens = o.rep.chunks[j].num_tokens;
					ci->base_pos = o.rep.chunks[j].base_pos;
					ci->num_layers = o.rep.chunks[j].num_layers;
					ci->raw_bytes = o.rep.chunks[j].raw_bytes;
					ci->stored_bytes = o.rep.chunks[j].stored_bytes;
					got++;
				}
		call_out_free(&o);
next:
		free(which);
		kvbp_request_clear(&q);
	}
	return got;
}

/* ---- write path ---- */

/* Queue a push (the queue lock held); false when the queue is full. */
static bool enqueue(struct cluster *c, uint32_t peer, uint32_t model_id, const uint8_t *hash,
		    bool rebalance)
{
	struct push *e;

	if (c->q_len == QUEUE_MAX) {
		c->rescan = true; /* it stays owed in the store: read again when there is room */
		return false;
	}
	e = &c->q[(c->q_head + c->q_len++) % QUEUE_MAX];
	e->peer = peer;
	e->model_id = model_id;
	e->rebalance = rebalance;
	memcpy(e->hash, hash, KVBP_HASH_LEN);
	pthread_cond_signal(&c->qcond);
	return true;
}

/* Record (store first: a crash from here on still pushes it) and queue a push. */
static void owe(struct cluster *c, size_t peer, uint32_t model_id, const uint8_t *hash,
		bool rebalance)
{
	struct peer *p = peer_at(c, peer);

	if (!p)
		return;
	if (store_owed_put(c->store, p->id, model_id, hash, true))
		log_warn("cluster: cannot record a push owed to '%s'; pushing it anyway", p->id);
	pthread_mutex_lock(&c->qlock);
	enqueue(c, (uint32_t)peer, model_id, hash, rebalance);
	pthread_mutex_unlock(&c->qlock);
}

void cluster_stored(struct cluster *c, const struct store_model *m, const uint8_t *hash)
{
	size_t idx[16], r = ranked(c, hash, c->replicas < 16 ? c->replicas : 16, idx);

	for (size_t i = 0; i < r; i++)
		if (idx[i])
			owe(c, idx[i] - 1, m->id, hash, false);
}

struct export_buf {
	const void **blobs;
	size_t *lens;
	uint32_t n;
};

static int export_layer(void *ctx, uint32_t layer, const void *bytes, size_t len)
{
	struct export_buf *b = ctx;

	if (layer >= b->n)
		return -EBADMSG;
	b->blobs[layer] = malloc(len ? len : 1);
	if (!b->blobs[layer])
		return -ENOMEM;
	memcpy((void *)b->blobs[layer], bytes, len);
	b->lens[layer] = len;
	return 0;
}

/* Push one chunk to one peer: 0 done (or nothing to do), -EAGAIN retry later. *bytes sent. */
static int push_one(struct cluster *c, const struct push *e, uint64_t *bytes)
{
	struct peer *p = peer_at(c, e->peer);
	struct store_model m;
	struct store_chunk_info ci;
	struct export_buf b = { 0 };
	struct kvbp_request q = { .op = KVBP_OP_REPLICATE, .has_model = true, .has_hash = true };
	struct call_out o;
	int rc = store_model_by_id(c->store, e->model_id, &m);

	*bytes = 0;
	if (!p)
		return 0;
	if (rc) /* the model is gone, or its record is unreadable: nothing to push */
		goto done;
	b.n = m.num_layers;
	b.blobs = calloc(b.n, sizeof(*b.blobs));
	b.lens = calloc(b.n, sizeof(*b.lens));
	if (!b.blobs || !b.lens) {
		rc = -EAGAIN;
		goto out;
	}
	rc = store_chunk_export(c->store, &m, e->hash, &ci, export_layer, &b);
	if (rc == -ENOENT || rc == -EBADMSG) /* deleted or corrupt here: not ours to send */
		goto done;
	if (rc) {
		rc = -EAGAIN;
		goto out;
	}
	model_from_store(&m, &q.model);
	snprintf(q.model_name, sizeof(q.model_name), "%s", m.name);
	memcpy(q.hash, e->hash, KVBP_HASH_LEN);
	q.num_tokens = ci.num_tokens;
	q.base_pos = ci.base_pos;
	if (peer_call(c, p, &q, (const void *const *)b.blobs, b.lens, b.n, &o)) {
		rc = -EAGAIN;
		goto out;
	}
	for (uint32_t l = 0; l < b.n; l++)
		*bytes += b.lens[l];
	if (o.rep.code == KVBP_OK) {
		atomic_fetch_add(&c->pushes_done, 1);
		if (e->rebalance)
			atomic_fetch_add(&c->rebalance_pushes, 1);
	} else if (o.rep.code == KVBP_FULL || o.rep.code == KVBP_LIMIT || o.rep.code == KVBP_BUSY ||
		   o.rep.code == KVBP_INTERNAL) {
		/* the peer may take it later */
		call_out_free(&o);
		rc = -EAGAIN;
		goto out;
	} else {
		log_warn("cluster: '%s' refused a chunk of '%s': %s", p->id, m.name, o.rep.message);
		atomic_fetch_add(&c->push_failures, 1);
	}
	call_out_free(&o);
done:
	rc = 0;
	if (store_owed_put(c->store, p->id, e->model_id, e->hash, false))
		log_warn("cluster: cannot clear a push owed to '%s'", p->id);
out:
	for (uint32_t l = 0; b.blobs && l < b.n; l++)
		free((void *)b.blobs[l]);
	free(b.blobs);
	free(b.lens);
	return rc;
}

static int load_owed(void *ctx, const char *peer, uint32_t model_id, const uint8_t *hash)
{
	struct cluster *c = ctx;
	size_t np = n_peers(c);

	for (size_t i = 0; i < np; i++) {
		struct peer *p = peer_at(c, i);

		if (p && !strcmp(p->id, peer))
			return enqueue(c, (uint32_t)i, model_id, hash, false) ? 0 : 1;
	}
	return 0; /* a member not known (yet): read again when the membership changes */
}

static void *pusher_main(void *arg)
{
	struct cluster *c = arg;
	unsigned waiting = 0; /* entries in a row that must wait: peer suspect or gone, or rate */

	pthread_mutex_lock(&c->qlock);
	store_owed_scan(c->store, load_owed, c); /* what the last run still owed */
	while (!c->stop) {
		struct push e;
		struct peer *p;
		uint64_t bytes;
		int rc;

		if (!c->q_len && c->rescan) {
			c->rescan = false;
			store_owed_scan(c->store, load_owed, c);
		}
		if (!c->q_len || (waiting && waiting >= c->q_len)) {
			wait_ms(&c->qcond, &c->qlock, 100);
			waiting = 0;
			continue;
		}
		e = c->q[c->q_head];
		c->q_head = (c->q_head + 1) % QUEUE_MAX;
		c->q_len--;
		p = peer_at(c, e.peer);
		if (p && (suspect(p) || !peer_live(c, p) ||
			  (e.rebalance && now_ns() < c->rebalance_next_ns))) {
			enqueue(c, e.peer, e.model_id, e.hash, e.rebalance);
			waiting++;
			continue;
		}
		waiting = 0;
		atomic_fetch_add(&c->in_flight, 1);
		pthread_mutex_unlock(&c->qlock);
		rc = push_one(c, &e, &bytes);
		pthread_mutex_lock(&c->qlock);
		if (e.rebalance && bytes) { /* the rate limit: this push's share of a second */
			int64_t t = now_ns();

			if (c->rebalance_next_ns < t)
				c->rebalance_next_ns = t;
			c->rebalance_next_ns += (int64_t)((double)bytes * 1e9 /
							  (double)c->rebalance_rate);
		}
		if (rc == -EAGAIN)
			enqueue(c, e.peer, e.model_id, e.hash, e.rebalance);
		atomic_fetch_sub(&c->in_flight, 1);
	}
	pthread_mutex_unlock(&c->qlock);
	return NULL;
}

/* ---- rebalance: chunks to the members that now own them ---- */

struct rb_item {
	uint32_t peer, model_id;
	uint8_t hash[KVBP_HASH_LEN];
};

struct rb_scan {
	struct cluster *c;
	const struct view *old, *cur;
	uint64_t since; /* chunks stored since (unix s) may have been placed by a later view */
	struct rb_item *items;
	size_t n, cap;
	int err;
};

static bool in_list(const size_t *l, size_t n, size_t x)
{
	for (size_t i = 0; i < n; i++)
		if (l[i] == x)
			return true;
	return false;
}

/*
 * One chunk held here: each of its owners under the current view that was no
 * owner under the old one (old NULL: every owner, a repair pass) is a candidate;
 * rb_filter then keeps only those that lack it. Every member holding the chunk
 * does this, so a new owner gets it even when the member that should have had it
 * does not (a push still queued, a copy lost); two holders pushing the same
 * chunk at once cost a second transfer, nothing else.
 */
static int rb_chunk(void *ctx, uint32_t model_id, const uint8_t *hash,
		    const struct store_chunk_info *info)
{
	struct rb_scan *r = ctx;
	size_t R = r->c->replicas < 16 ? r->c->replicas : 16;
	size_t now[16], before[16], n_now, n_before = 0;

	n_now = view_ranked(r->cur, hash, R, now);
	/* A chunk stored after the old view was taken was placed by whatever view held
	 * then (a member may have left and come back in between): all its owners count. */
	if (r->old && info->created < r->since)
		n_before = view_ranked(r->old, hash, R, before);
	for (size_t j = 0; j < n_now; j++) {
		if (!now[j] || in_list(before, n_before, now[j]))
			continue;
		if (r->n == r->cap) {
			size_t cap = r->cap ? 2 * r->cap : 1024;
			struct rb_item *it = realloc(r->items, cap * sizeof(*it));

			if (!it) {
				r->err = -ENOMEM;
				return 1;
			}
			r->items = it;
			r->cap = cap;
		}
		r->items[r->n].peer = (uint32_t)(now[j] - 1);
		r->items[r->n].model_id = model_id;
		memcpy(r->items[r->n++].hash, hash, KVBP_HASH_LEN);
	}
	return 0;
}

/* Drop the items peer already holds (one LOOKUP per model and batch); keep them on failure. */
static size_t rb_filter(struct cluster *c, struct rb_item *it, size_t n)
{
	size_t kept = 0, i = 0;

	while (i < n) {
		struct peer *p = peer_at(c, it[i].peer);
		struct store_model m;
		struct kvbp_request q = { .op = KVBP_OP_LOOKUP };
		struct call_out o;
		size_t k = 0, start = i;

		/* a batch: the same peer and model, up to LOOKUP_BATCH */
		while (i < n && k < LOOKUP_BATCH && it[i].peer == it[start].peer &&
		       it[i].model_id == it[start].model_id) {
			i++;
			k++;
		}
		q.hashes = calloc(k, KVBP_HASH_LEN);
		if (p && q.hashes && !store_model_by_id(c->store, it[start].model_id, &m)) {
			for (size_t j = 0; j < k; j++)
				memcpy(q.hashes[j], it[start + j].hash, KVBP_HASH_LEN);
			q.n_hashes = k;
			snprintf(q.model_name, sizeof(q.model_name), "%s", m.name);
			if (!peer_call(c, p, &q, NULL, NULL, 0, &o)) {
				bool ok = o.rep.code == KVBP_OK && o.rep.n_chunks == k;

				for (size_t j = 0; j < k; j++)
					if (!(ok && o.rep.chunks[j].found))
						it[kept++] = it[start + j];
					else
						atomic_fetch_add(&c->rebalance_skipped, 1);
				call_out_free(&o);
				kvbp_request_clear(&q);
				continue;
			}
		}
		kvbp_request_clear(&q);
		for (size_t j = 0; j < k; j++) /* not asked: push them all */
			it[kept++] = it[start + j];
	}
	return kept;
}

static int rb_cmp(const void *a, const void *b)
{
	const struct rb_item *x = a, *y = b;

	if (x->peer != y->peer)
		return x->peer < y->peer ? -1 : 1;
	if (x->model_id != y->model_id)
		return x->model_id < y->model_id ? -1 : 1;
	return memcmp(x->hash, y->hash, KVBP_HASH_LEN);
}

static void rebalance(struct cluster *c, const struct view *old, const struct view *cur)
{
	/* created is in whole seconds: a margin of two */
	struct rb_scan r = { c, old, cur, c->rebalanced_wall_s - 2, NULL, 0, 0, 0 };
	int rc = store_chunk_scan(c->store, rb_chunk, &r);
	size_t n;

	if (rc < 0 || r.err) {
		log_warn("cluster: rebalance: cannot read the store's chunks: %s",
			 strerror(r.err ? -r.err : -rc));
		free(r.items);
		return;
	}
	if (!r.n)
		return; /* nothing here changed owners */
	qsort(r.items, r.n, sizeof(*r.items), rb_cmp);
	n = rb_filter(c, r.items, r.n);
	for (size_t i = 0; i < n; i++)
		owe(c, r.items[i].peer, r.items[i].model_id, r.items[i].hash, true);
	if (n || old)
		log_info("cluster: %s: %zu chunk copies to push to owners that lack them (%zu "
			 "already there)", old ? "membership changed" : "repair pass", n, r.n - n);
	free(r.items);
}

static void *rebalancer_main(void *arg)
{
	struct cluster *c = arg;

	int64_t next_repair = now_ms() + c->repair_ms;

	pthread_mutex_lock(&c->rlock);
	while (!c->stop) {
		struct view cur = { 0 };
		uint64_t gen = atomic_load(&c->view_gen), wall;
		int rc;

		if (gen == c->rebalanced_gen) {
			/* A repair pass: every chunk held here to every owner that lacks it. */
			if (c->repair_ms && now_ms() >= next_repair && c->have_rebalanced &&
			    c->rebalanced.n > 1) {
				pthread_mutex_unlock(&c->rlock);
				rebalance(c, NULL, &c->rebalanced); /* only this thread changes it */
				pthread_mutex_lock(&c->rlock);
				next_repair = now_ms() + c->repair_ms;
				continue;
			}
			wait_ms(&c->rcond, &c->rlock, 500);
			continue;
		}
		pthread_mutex_unlock(&c->rlock);
		wall = (uint64_t)(wall_ms() / 1000);
		pthread_rwlock_rdlock(&c->view_lock);
		gen = atomic_load(&c->view_gen);
		rc = view_copy(&c->view, &cur);
		pthread_rwlock_unlock(&c->view_lock);
		/* owed pushes for members that just became known can be queued now */
		pthread_mutex_lock(&c->qlock);
		c->rescan = true;
		pthread_cond_signal(&c->qcond);
		pthread_mutex_unlock(&c->qlock);
		if (!rc && c->have_rebalanced)
			rebalance(c, &c->rebalanced, &cur);
		pthread_mutex_lock(&c->rlock);
		if (!rc) {
			view_free(&c->rebalanced);
			c->rebalanced = cur;
			c->have_rebalanced = true;
			c->rebalanced_gen = gen;
			c->rebalanced_wall_s = wall;
		} else {
			wait_ms(&c->rcond, &c->rlock, 1000); /* out of memory: try again later */
		}
	}
	pthread_mutex_unlock(&c->rlock);
	return NULL;
}

/* ---- heartbeats: every live member is heard from at least every HEARTBEAT_MS ---- */

static void *heart_main(void *arg)
{
	struct cluster *c = arg;

	pthread_mutex_lock(&c->rlock);
	while (!c->stop) {
		size_t np;

		wait_ms(&c->rcond, &c->rlock, HEARTBEAT_MS / 4);
		if (c->stop)
			break;
		pthread_mutex_unlock(&c->rlock);
		np = n_peers(c);
		/* (a stop does not wait for a sweep over many dead members: etcd_stop is set
		 * first of all by cluster_free) */
		for (size_t i = 0; i < np && !atomic_load(&c->etcd_stop); i++) {
			struct peer *p = peer_at(c, i);
			struct kvbp_request q = { .op = KVBP_OP_HELLO };
			struct call_out o;

			if (!p || !peer_live(c, p) ||
			    wall_ms() - atomic_load(&p->last_reply) < HEARTBEAT_MS)
				continue;
			if (peer_call(c, p, &q, NULL, NULL, 0, &o))
				continue;
			for (size_t k = 0; k < o.rep.n_stats; k++) {
				if (!strcmp(o.rep.stats[k].name, "chunks"))
					atomic_store(&p->held_chunks, (uint64_t)o.rep.stats[k].value);
				else if (!strcmp(o.rep.stats[k].name, "stored_bytes"))
					atomic_store(&p->held_bytes, (uint64_t)o.rep.stats[k].value);
			}
			call_out_free(&o);
		}
		pthread_mutex_lock(&c->rlock);
	}
	pthread_mutex_unlock(&c->rlock);
	return NULL;
}

/* ---- etcd: this daemon's registration, and the others' ---- */

/* Sleep ms in steps, returning early when the daemon stops. */
static void etcd_sleep(struct cluster *c, int64_t ms)
{
	int64_t end = now_ms() + ms;

	while (!atomic_load(&c->etcd_stop) && now_ms() < end) {
		struct timespec ts = { 0, 50 * 1000000 };

		nanosleep(&ts, NULL);
	}
}

static void etcd_state(struct cluster *c, bool ok, struct etcd *e, const char *what)
{
	if (ok) {
		atomic_store(&c->etcd_last_ok, (uint64_t)wall_ms());
		if (!atomic_exchange(&c->etcd_ok, true))
			log_info("cluster: etcd %s answers again", etcd_endpoint(e));
		return;
	}
	atomic_fetch_add(&c->etcd_errors, 1);
	if (atomic_exchange(&c->etcd_ok, false) || !atomic_load(&c->etcd_last_ok))
		log_warn("cluster: etcd unreachable (%s: %s); serving with the last membership "
			 "known, retrying", what, etcd_error(e));
}

static void *registrar_main(void *arg)
{
	struct cluster *c = arg;
	struct etcd *e = NULL;
	char err[256], key[sizeof(c->prefix) + STORE_OWED_PEER_MAX + 1];
	struct member_record self = { .capacity = c->capacity };
	char val[1024];
	int64_t lease = 0, backoff = 250;

	snprintf(self.endpoint, sizeof(self.endpoint), "%s", c->advertise);
	snprintf(self.key, sizeof(self.key), "%s", c->public_key);
	snprintf(self.version, sizeof(self.version), "%s", KVBLEND_VERSION);
	if (record_format(c->self, &self, val, sizeof(val)) < 0 ||
	    etcd_new(c->etcd_urls, c->timeout_ms, &e, err, sizeof(err))) {
		log_err("cluster: cannot start talking to etcd");
		return NULL;
	}
	snprintf(key, sizeof(key), "%s%s", c->prefix, c->self);
	while (!atomic_load(&c->etcd_stop)) {
		int64_t ttl;
		int rc;

		if (!lease) {
			rc = etcd_lease_grant(e, c->lease_ttl, &lease);
			if (!rc) {
				rc = etcd_put(e, key, val, strlen(val), lease);
				if (rc) {
					etcd_lease_revoke(e, lease);
					lease = 0;
				}
			}
			etcd_state(c, rc == 0, e, "registering");
			if (rc) {
				etcd_sleep(c, backoff);
				backoff = backoff * 2 > 4000 ? 4000 : backoff * 2;
				continue;
			}
			log_info("cluster: registered in etcd as %s (lease %d s)", key, c->lease_ttl);
			backoff = 250;
		}
		/* renew at a third of the TTL: two tries before it runs out */
		etcd_sleep(c, c->lease_ttl * 1000 / 3);
		if (atomic_load(&c->etcd_stop))
			break;
		rc = etcd_lease_keepalive(e, lease, &ttl);
		if (rc == -ENOENT) {
			log_warn("cluster: etcd lease expired (etcd unreachable longer than %d s?); "
				 "registering again", c->lease_ttl);
			lease = 0;
			etcd_state(c, true, e, "renewing");
			continue;
		}
		etcd_state(c, rc == 0, e, "renewing the lease");
	}
	if (lease) /* a clean leave: the others drop this member now, not after the TTL */
		etcd_lease_revoke(e, lease);
	etcd_free(&e);
	return NULL;
}

/* A member record from etcd applied to the membership (the view lock held for writing). */
static bool member_put(struct cluster *c, const char *key, const char *val)
{
	const char *id = key + strlen(c->prefix);
	struct member_record r;
	char err[200];
	struct peer *p;
	double w;
	bool changed = false;

	if (strncmp(key, c->prefix, strlen(c->prefix)) || !id_ok(id, strlen(id))) {
		log_warn("cluster: etcd key %.200s: not a member record; ignored", key);
		return false;
	}
	if (record_parse(val, strlen(val), &r, err, sizeof(err))) {
		log_warn("cluster: member '%s' in etcd: bad record (%s); ignored", id, err);
		return false;
	}
	if (!strcmp(id, c->self)) {
		if (strcmp(r.endpoint, c->advertise))
			log_err("cluster: etcd says member '%s' is at %s, but this daemon is '%s' at "
				"%s: two daemons with one node_id?", id, r.endpoint, c->self,
				c->advertise);
		return false;
	}
	w = fmax((double)r.capacity / (double)(1ull << 30), 1.0 / 1024);
	p = peer_find(c, id);
	if (!p) {
		p = peer_add(c, id, strlen(id));
		if (!p) {
			log_warn("cluster: more than %d members; '%s' ignored", MEMBERS_MAX, id);
			return false;
		}
	}
	pthread_mutex_lock(&p->lock);
	if (strcmp(p->endpoint, r.endpoint) || strcmp(p->key, r.key)) {
		snprintf(p->endpoint, sizeof(p->endpoint), "%s", r.endpoint);
		snprintf(p->key, sizeof(p->key), "%s", r.key);
		peer_drop_idle(p);
		atomic_store(&p->suspect_until, 0);
		changed = true;
	}
	pthread_mutex_unlock(&p->lock);
	if (!p->live || p->weight != w) {
		if (!p->live)
			log_info("cluster: member '%s' at %s joined", id, r.endpoint);
		p->live = true;
		p->weight = w;
		changed = true;
	}
	return changed;
}

static bool member_gone(struct cluster *c, const char *id)
{
	struct peer *p = peer_find(c, id);

	if (!p || !p->live)
		return false;
	p->live = false;
	log_info("cluster: member '%s' left (its etcd lease ended)", id);
	return true;
}

/* The member records of one read of the prefix, copied out of the answer. */
struct sync_ctx {
	char **keys, **vals;
	size_t n, cap;
};

static int sync_one(void *ctx, const char *key, const char *val, size_t vlen)
{
	struct sync_ctx *s = ctx;

	(void)vlen;
	if (s->n == s->cap) {
		size_t cap = s->cap ? 2 * s->cap : 16;
		char **k = realloc(s->keys, cap * sizeof(*k)), **v;

		if (!k)
			return -ENOMEM;
		s->keys = k;
		v = realloc(s->vals, cap * sizeof(*v));
		if (!v)
			return -ENOMEM;
		s->vals = v;
		s->cap = cap;
	}
	s->keys[s->n] = strdup(key);
	s->vals[s->n] = strdup(val);
	if (!s->keys[s->n] || !s->vals[s->n]) {
		free(s->keys[s->n]);
		free(s->vals[s->n]);
		return -ENOMEM;
	}
	s->n++;
	return 0;
}

static void sync_free(struct sync_ctx *s)
{
	for (size_t i = 0; i < s->n; i++) {
		free(s->keys[i]);
		free(s->vals[i]);
	}
	free(s->keys);
	free(s->vals);
}

/*
 * The membership is what the read found (the view lock held for writing): its
 * records applied, every other member gone. Returns whether anything changed.
 */
static bool sync_apply(struct cluster *c, const struct sync_ctx *s)
{
	size_t plen = strlen(c->prefix);
	bool changed = false;

	for (size_t i = 0; i < s->n; i++)
		changed |= member_put(c, s->keys[i], s->vals[i]);
	for (size_t p = 0; p < c->n_peers; p++) {
		bool listed = false;

		for (size_t i = 0; i < s->n && !listed; i++)
			listed = !strcmp(s->keys[i] + plen, c->peers[p]->id);
		if (!listed)
			changed |= member_gone(c, c->peers[p]->id);
	}
	return changed;
}

static int watch_one(void *ctx, bool put, const char *key, const char *val, size_t vlen,
		     int64_t rev)
{
	struct cluster *c = ctx;
	bool changed;

	(void)vlen;
	(void)rev;
	pthread_rwlock_wrlock(&c->view_lock);
	changed = put ? member_put(c, key, val) : member_gone(c, key + strlen(c->prefix));
	if (changed && !view_rebuild(c))
		atomic_fetch_add(&c->membership_changes, 1);
	pthread_rwlock_unlock(&c->view_lock);
	if (changed)
		rebalance_kick(c);
	return 0;
}

static void *watcher_main(void *arg)
{
	struct cluster *c = arg;
	struct etcd *e = NULL;
	char err[256];
	int64_t backoff = 250;

	if (etcd_new(c->etcd_urls, c->timeout_ms, &e, err, sizeof(err))) {
		log_err("cluster: cannot start talking to etcd");
		return NULL;
	}
	while (!atomic_load(&c->etcd_stop)) {
		struct sync_ctx s = { 0 };
		int64_t rev = 0;
		size_t others = 0;
		bool changed = false;
		int rc;

		/* The whole membership first (read without the view lock: etcd may be slow,
		 * requests must not wait on it), then every change after that revision. */
		rc = etcd_range_prefix(e, c->prefix, sync_one, &s, &rev);
		if (!rc) {
			pthread_rwlock_wrlock(&c->view_lock);
			changed = sync_apply(c, &s);
			if (changed && !view_rebuild(c))
				atomic_fetch_add(&c->membership_changes, 1);
			others = c->view.n - 1;
			pthread_rwlock_unlock(&c->view_lock);
		}
		sync_free(&s);
		etcd_state(c, rc == 0, e, "reading the members");
		if (rc) {
			etcd_sleep(c, backoff);
			backoff = backoff * 2 > 4000 ? 4000 : backoff * 2;
			continue;
		}
		if (!atomic_exchange(&c->etcd_synced, true))
			log_info("cluster: %zu other members in etcd", others);
		if (changed)
			rebalance_kick(c);
		backoff = 250;
		rc = etcd_watch_prefix(e, c->prefix, rev + 1, watch_one, c, &c->etcd_stop);
		if (rc == -ECANCELED)
			break;
		if (rc != -ESTALE)
			etcd_state(c, false, e, "watching the members");
		etcd_sleep(c, backoff);
	}
	etcd_free(&e);
	return NULL;
}

/* ---- operator view ---- */

void cluster_stats(struct cluster *c, struct cluster_stats *out)
{
	memset(out, 0, sizeof(*out));
	pthread_rwlock_rdlock(&c->view_lock);
	out->members = c->view.n;
	for (size_t j = 1; j < c->view.n; j++)
		out->suspect += suspect(c->peers[c->view.peer_of[j] - 1]);
	pthread_rwlock_unlock(&c->view_lock);
	pthread_mutex_lock(&c->qlock);
	out->pushes_owed = c->q_len + atomic_load(&c->in_flight);
	pthread_mutex_unlock(&c->qlock);
	out->pushes_done = atomic_load(&c->pushes_done);
	out->push_failures = atomic_load(&c->push_failures);
	out->remote_hits = atomic_load(&c->remote_hits);
	out->remote_misses = atomic_load(&c->remote_misses);
	out->fetch_failures = atomic_load(&c->fetch_failures);
	out->fetched_bytes = atomic_load(&c->fetched_bytes);
	out->fetch_ms = (double)atomic_load(&c->fetch_ns) / 1e6;
	out->rebalance_pushes = atomic_load(&c->rebalance_pushes);
	out->rebalance_skipped = atomic_load(&c->rebalance_skipped);
	out->membership_changes = atomic_load(&c->membership_changes);
	out->peer_busy = atomic_load(&c->peer_busy);
	out->etcd = c->etcd_urls[0] != 0;
	out->etcd_ok = atomic_load(&c->etcd_ok);
	out->etcd_errors = atomic_load(&c->etcd_errors);
	out->etcd_last_ok_ms = atomic_load(&c->etcd_last_ok);
}

void cluster_members(struct cluster *c, void (*fn)(void *ctx, const struct cluster_member *m),
		     void *ctx)
{
	size_t np = n_peers(c);
	uint64_t *owed = calloc(np ? np : 1, sizeof(uint64_t));

	if (owed) {
		pthread_mutex_lock(&c->qlock);
		for (size_t i = 0; i < c->q_len; i++) {
			uint32_t p = c->q[(c->q_head + i) % QUEUE_MAX].peer;

			if (p < np)
				owed[p]++;
		}
		pthread_mutex_unlock(&c->qlock);
	}
	for (size_t i = 0; i < np; i++) {
		struct peer *p = peer_at(c, i);
		struct cluster_member m = { 0 };

		if (!p)
			continue;
		snprintf(m.id, sizeof(m.id), "%s", p->id);
		pthread_mutex_lock(&p->lock);
		snprintf(m.endpoint, sizeof(m.endpoint), "%s", p->endpoint);
		pthread_mutex_unlock(&p->lock);
		m.state = !peer_live(c, p) ? CLUSTER_GONE : suspect(p) ? CLUSTER_SUSPECT
								      : CLUSTER_ALIVE;
		m.owed = owed ? owed[i] : 0;
		m.last_reply_ms = (uint64_t)atomic_load(&p->last_reply);
		m.held_chunks = atomic_load(&p->held_chunks);
		m.held_bytes = atomic_load(&p->held_bytes);
		fn(ctx, &m);
	}
	free(owed);
}

bool cluster_owns(struct cluster *c, const uint8_t *hash)
{
	size_t idx[16], r = ranked(c, hash, c->replicas < 16 ? c->replicas : 16, idx);

	for (size_t i = 0; i < r; i++)
		if (idx[i] == 0)
			return true;
	return false;
}

/*
 * Does the host of endpoint "tcp://HOST:PORT" have address ip? A numeric host is
 * compared as written; a name is resolved (only keyless clusters get here, and only
 * for requests that name another namespace).
 */
static bool endpoint_has_ip(const char *endpoint, const char *ip, bool resolve)
{
	char host[CONFIG_ENDPOINT_MAX];
	const char *h = endpoint + 6, *colon = strrchr(h, ':');
	struct addrinfo hints = { .ai_socktype = SOCK_STREAM }, *res = NULL;
	bool same = false;
	size_t n;

	if (strncmp(endpoint, "tcp://", 6) || !colon || colon == h)
		return false;
	n = (size_t)(colon - h);
	if (h[0] == '[' && n >= 2 && h[n - 1] == ']') { /* [v6]:port */
		h++;
		n -= 2;
	}
	if (n >= sizeof(host))
		return false;
	memcpy(host, h, n);
	host[n] = 0;
	if (!strcmp(host, ip))
		return true;
	if (!resolve || getaddrinfo(host, NULL, &hints, &res))
		return false;
	for (struct addrinfo *a = res; a && !same; a = a->ai_next) {
		char num[NI_MAXHOST];

		same = !getnameinfo(a->ai_addr, a->ai_addrlen, num, sizeof(num), NULL, 0,
				    NI_NUMERICHOST) && !strcmp(num, ip);
	}
	freeaddrinfo(res);
	return same;
}

bool cluster_is_member(struct cluster *c, const char *principal)
{
	bool key = !strncmp(principal, "key:", 4), addr = !strncmp(principal, "tcp:", 4);
	char (*names)[CONFIG_ENDPOINT_MAX] = NULL;
	size_t n_names = 0;
	bool found = false;

	if (!c || (!key && !addr) || !principal[4])
		return false;
	pthread_rwlock_rdlock(&c->view_lock);
	if (addr)
		names = malloc(c->n_peers * sizeof(*names) + 1);
	for (size_t i = 0; i < c->n_peers && !found; i++) {
		struct peer *p = c->peers[i];

		if (!p->live)
			continue;
		pthread_mutex_lock(&p->lock);
		if (p->key[0]) { /* a member with a key is known by it alone */
			found = key && !strcmp(p->key, principal + 4);
		} else if (addr) {
			found = endpoint_has_ip(p->endpoint, principal + 4, false);
			if (names)
				memcpy(names[n_names++], p->endpoint, sizeof(p->endpoint));
		}
		pthread_mutex_unlock(&p->lock);
	}
	pthread_rwlock_unlock(&c->view_lock);
	/* host names are resolved outside the locks: a resolver may take its time */
	for (size_t i = 0; i < n_names && !found; i++)
		found = endpoint_has_ip(names[i], principal + 4, true);
	free(names);
	return found;
}

void cluster_free(struct cluster **cp)
{
	struct cluster *c = cp ? *cp : NULL;

	if (!c)
		return;
	atomic_store(&c->etcd_stop, true);
	if (c->registrar_started)
		pthread_join(c->registrar, NULL);
	if (c->watcher_started)
		pthread_join(c->watcher, NULL);
	pthread_mutex_lock(&c->qlock);
	c->stop = true;
	pthread_cond_broadcast(&c->qcond);
	pthread_mutex_unlock(&c->qlock);
	pthread_mutex_lock(&c->rlock);
	pthread_cond_broadcast(&c->rcond);
	pthread_mutex_unlock(&c->rlock);
	if (c->heart_started)
		pthread_join(c->heart, NULL);
	if (c->rebalancer_started)
		pthread_join(c->rebalancer, NULL);
	if (c->pusher_started)
		pthread_join(c->pusher, NULL);
	for (size_t i = 0; i < c->n_peers; i++) {
		peer_drop_idle(c->peers[i]);
		pthread_mutex_destroy(&c->peers[i]->lock);
		free(c->peers[i]);
	}
	if (c->zctx)
		zmq_ctx_term(c->zctx);
	view_free(&c->view);
	view_free(&c->rebalanced);
	pthread_cond_destroy(&c->rcond);
	pthread_mutex_destroy(&c->rlock);
	pthread_cond_destroy(&c->qcond);
	pthread_mutex_destroy(&c->qlock);
	pthread_rwlock_destroy(&c->view_lock);
	free(c->q);
	free(c);
	*cp = NULL;
}
