/* cluster — chunks shared across daemons; see cluster.h and docs/cluster.md. */
#include "cluster.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "log.h"
#include "ops.h"
#include "place.h"

#define POOL 4		      /* idle sockets kept per peer */
#define SUSPECT_MS 2000	      /* a peer that missed a deadline is skipped this long */
#define QUEUE_MAX (1u << 16)  /* pushes held in memory; the rest wait in the store */
#define MEMBERS_MAX 1024

struct peer {
	char id[STORE_OWED_PEER_MAX + 1];
	char endpoint[CONFIG_ENDPOINT_MAX];
	char key[41]; /* the peer's CURVE server key, "" for none */
	pthread_mutex_t lock;
	void *idle[POOL];
	unsigned n_idle;
	atomic_int_fast64_t suspect_until; /* ms, monotonic */
};

struct push {
	uint32_t peer;
	uint32_t model_id;
	uint8_t hash[KVBP_HASH_LEN];
};

struct cluster {
	struct store *store;
	void *zctx;
	char self[STORE_OWED_PEER_MAX + 1];
	char secret[41], public_key[41];
	struct place_member *members; /* [0] this daemon, [1 + i] peers[i] */
	struct peer *peers;
	size_t n_peers;
	unsigned replicas;
	int timeout_ms;
	atomic_uint_fast64_t next_id;
	/* pushes */
	pthread_t pusher;
	bool pusher_started;
	pthread_mutex_t qlock;
	pthread_cond_t qcond;
	bool stop;
	struct push *q;
	size_t q_head, q_len;
	bool rescan; /* owed pushes in the store that the queue could not hold */
	atomic_uint_fast64_t pushes_done, push_failures, remote_hits, remote_misses,
		fetch_failures, fetched_bytes, fetch_ns, in_flight;
};

static void *pusher_main(void *arg);

static int64_t now_ms(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

static bool suspect(struct peer *p)
{
	return atomic_load(&p->suspect_until) > now_ms();
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

/* One "id=tcp://host:port[=key]" of cluster_peers into p; 1 when it names this daemon. */
static int parse_peer(struct cluster *c, const char *s, size_t n, struct peer *p, char *err,
		      size_t errlen)
{
	const char *eq = memchr(s, '=', n), *ep, *eq2;
	size_t id_len, ep_len;

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
	if (ep_len < 7 || strncmp(ep, "tcp://", 6) || ep_len >= CONFIG_ENDPOINT_MAX) {
		snprintf(err, errlen, "cluster_peers: member '%.*s': endpoint '%.*s' must be "
			 "tcp://HOST:PORT", (int)id_len, s, (int)ep_len, ep);
		return -EINVAL;
	}
	memset(p, 0, sizeof(*p));
	memcpy(p->id, s, id_len);
	memcpy(p->endpoint, ep, ep_len);
	if (eq2) {
		size_t kl = n - id_len - 1 - ep_len - 1;

		if (kl != 40) {
			snprintf(err, errlen, "cluster_peers: member '%s': a CURVE key is 40 Z85 "
				 "characters; got %zu", p->id, kl);
			return -EINVAL;
		}
		memcpy(p->key, eq2 + 1, 40);
	}
	return !strcmp(p->id, c->self);
}

int cluster_new(const struct config *cfg, struct store *store, const char *curve_secret,
		const char *curve_public, struct cluster **out, char *err, size_t errlen)
{
	struct cluster *c;
	const char *s = cfg->cluster_peers;
	size_t cap = 0;
	int rc = 0;

	*out = NULL;
	if (!s[0])
		return 0;
	c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	c->store = store;
	c->replicas = (unsigned)cfg->cluster_replicas;
	c->timeout_ms = (int)cfg->cluster_timeout_ms;
	pthread_mutex_init(&c->qlock, NULL);
	pthread_cond_init(&c->qcond, NULL);
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
		struct peer p;

		if (!n) {
			s++;
			continue;
		}
		rc = parse_peer(c, s, n, &p, err, errlen);
		if (rc < 0)
			goto fail;
		s += n;
		if (rc == 1) { /* this daemon, listed like the others: skip */
			rc = 0;
			continue;
		}
		for (size_t i = 0; i < c->n_peers; i++)
			if (!strcmp(c->peers[i].id, p.id)) {
				snprintf(err, errlen, "cluster_peers: member '%s' listed twice", p.id);
				rc = -EINVAL;
				goto fail;
			}
		if (c->n_peers + 1 >= MEMBERS_MAX) {
			snprintf(err, errlen, "cluster_peers: more than %d members", MEMBERS_MAX);
			rc = -EINVAL;
			goto fail;
		}
		if (c->n_peers == cap) {
			struct peer *np = realloc(c->peers, (cap = cap ? 2 * cap : 8) * sizeof(*np));

			if (!np) {
				rc = -ENOMEM;
				goto fail;
			}
			c->peers = np;
		}
		c->peers[c->n_peers++] = p;
	}
	if (!c->n_peers) {
		snprintf(err, errlen, "cluster_peers lists no member but this one ('%s')", c->self);
		rc = -EINVAL;
		goto fail;
	}
	c->members = calloc(c->n_peers + 1, sizeof(*c->members));
	c->q = calloc(QUEUE_MAX, sizeof(*c->q));
	c->zctx = zmq_ctx_new();
	if (!c->members || !c->q || !c->zctx) {
		rc = -ENOMEM;
		goto fail;
	}
	c->members[0] = (struct place_member){ place_seed(c->self), 1.0 };
	for (size_t i = 0; i < c->n_peers; i++) {
		pthread_mutex_init(&c->peers[i].lock, NULL);
		c->members[1 + i] = (struct place_member){ place_seed(c->peers[i].id), 1.0 };
	}
	/* Towards peers with a key this daemon authenticates with its own, or a fresh one. */
	if (curve_secret && curve_secret[0]) {
		snprintf(c->secret, sizeof(c->secret), "%s", curve_secret);
		snprintf(c->public_key, sizeof(c->public_key), "%s", curve_public);
	} else if (zmq_curve_keypair(c->public_key, c->secret)) {
		c->secret[0] = c->public_key[0] = 0;
	}
	rc = pthread_create(&c->pusher, NULL, pusher_main, c);
	if (rc) {
		snprintf(err, errlen, "cannot start the cluster's push thread: %s", strerror(rc));
		rc = -rc;
		goto fail;
	}
	c->pusher_started = true;
	log_info("cluster: node '%s', %zu other members, %u replicas, timeout %d ms", c->self,
		 c->n_peers, c->replicas, c->timeout_ms);
	*out = c;
	return 0;
fail:
	free(c->peers);
	c->peers = NULL;
	c->n_peers = 0;
	cluster_free(&c);
	return rc;
}

/* ---- calls to a peer ---- */

static void *sock_get(struct cluster *c, struct peer *p)
{
	void *s = NULL;
	int zero = 0;

	pthread_mutex_lock(&p->lock);
	if (p->n_idle)
		s = p->idle[--p->n_idle];
	pthread_mutex_unlock(&p->lock);
	if (s)
		return s;
	s = zmq_socket(c->zctx, ZMQ_DEALER);
	if (!s)
		return NULL;
	zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
	if (p->key[0] && c->secret[0] &&
	    (zmq_setsockopt(s, ZMQ_CURVE_SERVERKEY, p->key, 40) ||
	     zmq_setsockopt(s, ZMQ_CURVE_PUBLICKEY, c->public_key, 40) ||
	     zmq_setsockopt(s, ZMQ_CURVE_SECRETKEY, c->secret, 40))) {
		zmq_close(s);
		return NULL;
	}
	if (zmq_connect(s, p->endpoint)) {
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
	void *s = sock_get(c, p);
	uint8_t *hdr = NULL;
	size_t hlen;
	int rc = 0;

	memset(out, 0, sizeof(*out));
	if (!s)
		return -EIO;
	req->version = KVBP_VERSION;
	req->request_id = atomic_fetch_add(&c->next_id, 1) + 1;
	req->local_only = true; /* the peer answers from its own store: no call back */
	req->payload_frames = (uint32_t)n_frames;
	if (kvbp_request_encode(req, &hdr, &hlen)) {
		sock_put(p, s, true);
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
		log_warn("cluster: member '%s' (%s): %s; skipped for %d ms", p->id, p->endpoint,
			 rc == -ETIMEDOUT ? "no reply within cluster_timeout_ms" : "call failed",
			 SUSPECT_MS);
	} else {
		atomic_store(&p->suspect_until, 0);
	}
	sock_put(p, s, rc == 0);
	return rc;
}

/* Members in placement order for hash (this daemon included, as index 0). */
static size_t ranked(struct cluster *c, const uint8_t *hash, size_t r, size_t *idx)
{
	return place_owners(c->members, c->n_peers + 1, hash, r, idx);
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
		p = &c->peers[idx[i] - 1];
		if (suspect(p))
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

	/* one batched LOOKUP per peer, for the missing hashes it owns */
	for (size_t pi = 0; pi < c->n_peers; pi++) {
		struct peer *p = &c->peers[pi];
		struct kvbp_request q = { .op = KVBP_OP_LOOKUP };
		size_t *which = NULL, k = 0;
		struct call_out o;

		if (suspect(p))
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
static bool enqueue(struct cluster *c, uint32_t peer, uint32_t model_id, const uint8_t *hash)
{
	struct push *e;

	if (c->q_len == QUEUE_MAX) {
		c->rescan = true; /* it stays owed in the store: read again when there is room */
		return false;
	}
	e = &c->q[(c->q_head + c->q_len++) % QUEUE_MAX];
	e->peer = peer;
	e->model_id = model_id;
	memcpy(e->hash, hash, KVBP_HASH_LEN);
	pthread_cond_signal(&c->qcond);
	return true;
}

void cluster_stored(struct cluster *c, const struct store_model *m, const uint8_t *hash)
{
	size_t idx[16], r = ranked(c, hash, c->replicas < 16 ? c->replicas : 16, idx);

	for (size_t i = 0; i < r; i++) {
		if (idx[i] == 0)
			continue;
		/* recorded first: a crash from here on still pushes it after the restart */
		if (store_owed_put(c->store, c->peers[idx[i] - 1].id, m->id, hash, true))
			log_warn("cluster: cannot record a push owed to '%s'; pushing it anyway",
				 c->peers[idx[i] - 1].id);
		pthread_mutex_lock(&c->qlock);
		enqueue(c, (uint32_t)(idx[i] - 1), m->id, hash);
		pthread_mutex_unlock(&c->qlock);
	}
}

struct export_buf {
	uint8_t *data;
	size_t len, cap;
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

/* Push one chunk to one peer: 0 done (or nothing to do), -EAGAIN retry later. */
static int push_one(struct cluster *c, const struct push *e)
{
	struct peer *p = &c->peers[e->peer];
	struct store_model m;
	struct store_chunk_info ci;
	struct export_buf b = { 0 };
	struct kvbp_request q = { .op = KVBP_OP_REPLICATE, .has_model = true, .has_hash = true };
	struct call_out o;
	int rc = store_model_by_id(c->store, e->model_id, &m);

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
	if (o.rep.code == KVBP_OK) {
		atomic_fetch_add(&c->pushes_done, 1);
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

	for (size_t i = 0; i < c->n_peers; i++)
		if (!strcmp(c->peers[i].id, peer))
			return enqueue(c, (uint32_t)i, model_id, hash) ? 0 : 1;
	return 0; /* a member no longer listed: its pushes wait until it is again */
}

static void *pusher_main(void *arg)
{
	struct cluster *c = arg;
	unsigned waiting = 0; /* entries in a row whose peer is suspect */

	pthread_mutex_lock(&c->qlock);
	store_owed_scan(c->store, load_owed, c); /* what the last run still owed */
	while (!c->stop) {
		struct push e;

		if (!c->q_len && c->rescan) {
			c->rescan = false;
			store_owed_scan(c->store, load_owed, c);
		}
		if (!c->q_len || (waiting && waiting >= c->q_len)) {
			struct timespec ts;

			clock_gettime(CLOCK_REALTIME, &ts);
			ts.tv_nsec += 100 * 1000000;
			ts.tv_sec += ts.tv_nsec / 1000000000;
			ts.tv_nsec %= 1000000000;
			pthread_cond_timedwait(&c->qcond, &c->qlock, &ts);
			waiting = 0;
			continue;
		}
		e = c->q[c->q_head];
		c->q_head = (c->q_head + 1) % QUEUE_MAX;
		c->q_len--;
		if (suspect(&c->peers[e.peer])) {
			enqueue(c, e.peer, e.model_id, e.hash);
			waiting++;
			continue;
		}
		waiting = 0;
		atomic_fetch_add(&c->in_flight, 1);
		pthread_mutex_unlock(&c->qlock);
		if (push_one(c, &e) == -EAGAIN) {
			pthread_mutex_lock(&c->qlock);
			enqueue(c, e.peer, e.model_id, e.hash);
		} else {
			pthread_mutex_lock(&c->qlock);
		}
		atomic_fetch_sub(&c->in_flight, 1);
	}
	pthread_mutex_unlock(&c->qlock);
	return NULL;
}

void cluster_stats(struct cluster *c, struct cluster_stats *out)
{
	memset(out, 0, sizeof(*out));
	out->members = c->n_peers + 1;
	for (size_t i = 0; i < c->n_peers; i++)
		out->suspect += suspect(&c->peers[i]);
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
}

void cluster_members(struct cluster *c,
		     void (*fn)(void *ctx, const char *id, bool suspect, uint64_t owed), void *ctx)
{
	uint64_t *owed = calloc(c->n_peers, sizeof(uint64_t));

	if (owed) {
		pthread_mutex_lock(&c->qlock);
		for (size_t i = 0; i < c->q_len; i++)
			owed[c->q[(c->q_head + i) % QUEUE_MAX].peer]++;
		pthread_mutex_unlock(&c->qlock);
	}
	for (size_t i = 0; i < c->n_peers; i++)
		fn(ctx, c->peers[i].id, suspect(&c->peers[i]), owed ? owed[i] : 0);
	free(owed);
}

void cluster_free(struct cluster **cp)
{
	struct cluster *c = cp ? *cp : NULL;

	if (!c)
		return;
	if (c->pusher_started) {
		pthread_mutex_lock(&c->qlock);
		c->stop = true;
		pthread_cond_broadcast(&c->qcond);
		pthread_mutex_unlock(&c->qlock);
		pthread_join(c->pusher, NULL);
	}
	for (size_t i = 0; i < c->n_peers; i++) {
		for (unsigned k = 0; k < c->peers[i].n_idle; k++)
			zmq_close(c->peers[i].idle[k]);
		pthread_mutex_destroy(&c->peers[i].lock);
	}
	if (c->zctx)
		zmq_ctx_term(c->zctx);
	pthread_cond_destroy(&c->qcond);
	pthread_mutex_destroy(&c->qlock);
	free(c->peers);
	free(c->members);
	free(c->q);
	free(c);
	*cp = NULL;
}
