/* cluster — chunks shared across daemons: the lifecycle (start, stop), stats, who is a
 * member; see cluster.h and docs/cluster.md. The shared view is view.c's. */
#include "cluster/cluster.h"

#include <errno.h>
#include <inttypes.h>
#include <netdb.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>
#include <zmq.h>

#include "cluster/cluster_impl.h"

/* ---- lifecycle ---- */

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

int cluster_new(const struct cluster_opts *o, struct cluster **out, char *err, size_t errlen)
{
	struct cluster *c;
	const char *s = o->peers ? o->peers : "";
	const char *node_id = o->node_id ? o->node_id : "";
	bool etcd = o->etcd && o->etcd[0];
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
	c->store = o->store;
	c->log = o->log;
	c->describe = o->describe;
	c->replicas = o->replicas;
	c->timeout_ms = o->timeout_ms;
	c->hedge_ms = o->hedge_ms > 0 ? o->hedge_ms : 0;
	c->bulk = o->bulk;
	c->max_message = o->max_message ? o->max_message : 1ull << 30;
	c->forget_after_ms = (int64_t)(o->forget_after_s ? o->forget_after_s : 600) * 1000;
	c->grace_ms = (int64_t)o->grace_s * 1000;
	c->drain_ms = (int64_t)o->drain_timeout_s * 1000;
	c->rebalance_rate = o->rebalance_rate;
	c->repair_ms = (int64_t)o->repair_interval_s * 1000;
	c->self_weight = 1.0;
	pthread_rwlock_init(&c->view_lock, NULL);
	pthread_mutex_init(&c->qlock, NULL);
	pthread_cond_init(&c->qcond, NULL);
	pthread_mutex_init(&c->rlock, NULL);
	pthread_mutex_init(&c->check_lock, NULL);
	pthread_cond_init(&c->rcond, NULL);
	if (node_id[0]) {
		size_t n = strlen(node_id);

		if (!id_ok(node_id, n)) {
			snprintf(err, errlen, "node_id '%.64s' must be 1..%d letters, digits or ._-",
				 node_id, STORE_OWED_PEER_MAX);
			rc = -EINVAL;
			goto fail;
		}
		memcpy(c->self, node_id, n + 1);
	} else if (gethostname(c->self, sizeof(c->self) - 1)) {
		snprintf(c->self, sizeof(c->self), "kvblendd");
	}
	if (!id_ok(c->self, strlen(c->self))) {
		snprintf(err, errlen, "the host name '%s' is no node_id (letters, digits, ._-): set "
			 "node_id", c->self);
		rc = -EINVAL;
		goto fail;
	}
	rc = members_parse_list(c, s, err, errlen);
	if (rc < 0)
		goto fail;
	if (!etcd && !c->n_peers) {
		snprintf(err, errlen, "cluster_peers lists no member but this one ('%s')", c->self);
		rc = -EINVAL;
		goto fail;
	}
	if (etcd) {
		rc = members_etcd_setup(c, o, err, errlen);
		if (rc)
			goto fail;
	}
	c->q = calloc(QUEUE_MAX, sizeof(*c->q));
	c->zctx = zmq_ctx_new();
	if (!c->q || !c->zctx || view_rebuild(c)) {
		rc = -ENOMEM;
		goto fail;
	}
	/*
	 * Towards peers with a key this daemon authenticates with its own. Without one,
	 * on a static list it makes up a pair (a peer listed with a key is reached over
	 * CURVE all the same); with etcd it has none: its record publishes no key, since
	 * its own endpoint does not speak CURVE, and it reaches members without a key
	 * over plain TCP.
	 */
	if (o->curve_secret && o->curve_secret[0]) {
		snprintf(c->secret, sizeof(c->secret), "%s", o->curve_secret);
		snprintf(c->public_key, sizeof(c->public_key), "%s",
			 o->curve_public ? o->curve_public : "");
	} else if (etcd || zmq_curve_keypair(c->public_key, c->secret)) {
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
		cl_info(c, "cluster: node '%s' at %s, members from etcd %s under %s, %u replicas, "
			"timeout %d ms, lease %d s", c->self, c->advertise, c->etcd_urls, c->prefix,
			c->replicas, c->timeout_ms, c->lease_ttl);
	else
		cl_info(c, "cluster: node '%s', %zu other members, %u replicas, timeout %d ms",
			c->self, c->n_peers, c->replicas, c->timeout_ms);
	*out = c;
	return 0;
fail:
	cluster_free(&c);
	return rc;
}

/* ---- operator view and placement queries ---- */

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
	out->fetch_wire_ms = (double)atomic_load(&c->fetch_wire_ns) / 1e6;
	out->rebalance_pushes = atomic_load(&c->rebalance_pushes);
	out->rebalance_skipped = atomic_load(&c->rebalance_skipped);
	out->membership_changes = atomic_load(&c->membership_changes);
	out->peer_busy = atomic_load(&c->peer_busy);
	out->hedged = atomic_load(&c->hedged);
	out->fetch_stalls = atomic_load(&c->fetch_stalls);
	out->bulk_fetches = atomic_load(&c->bulk_fetches);
	out->bulk_pushes = atomic_load(&c->bulk_pushes);
	out->etcd = c->etcd_urls[0] != 0;
	out->etcd_ok = atomic_load(&c->etcd_ok);
	out->etcd_errors = atomic_load(&c->etcd_errors);
	out->etcd_last_ok_ms = atomic_load(&c->etcd_last_ok);
}

/*
 * Is p forgotten: out of placement (gone from etcd, its grace over),
 * gone cluster_forget_after or longer, owed nothing
 * (owed: what is queued for it, nonzero when unsure)? Logged once when it is.
 */
static bool forget(struct cluster *c, struct peer *p, uint64_t owed)
{
	int64_t since = atomic_load(&p->gone_since);
	bool placed;

	pthread_rwlock_rdlock(&c->view_lock);
	placed = p->live || p->in_view; /* (a member in its grace is still placed) */
	pthread_rwlock_unlock(&c->view_lock);
	if (placed)
		return false;
	if (atomic_load(&p->forgotten))
		return true;
	if (!since || owed || now_ms() - since < c->forget_after_ms)
		return false;
	if (!atomic_exchange(&p->forgotten, true))
		cl_info(c, "cluster: member '%s' forgotten (gone %" PRId64 " s, owed nothing)",
			p->id, (now_ms() - since) / 1000);
	return true;
}

void cluster_members(struct cluster *c, void (*fn)(void *ctx, const struct cluster_member *m),
		     void *ctx)
{
	size_t np = n_peers(c);
	uint64_t *owed = calloc(np ? np : 1, sizeof(uint64_t));

	struct cluster_member me = { .state = CLUSTER_ALIVE, .last_reply_ms = (uint64_t)wall_ms() };
	struct store_totals t;
	bool rescan = true;

	snprintf(me.id, sizeof(me.id), "%s", c->self);
	snprintf(me.endpoint, sizeof(me.endpoint), "%s", c->advertise);
	if (!store_totals(c->store, &t)) {
		me.held_chunks = t.chunks;
		me.held_bytes = t.stored_bytes;
	}
	fn(ctx, &me); /* this daemon first */
	if (owed) {
		pthread_mutex_lock(&c->qlock);
		for (size_t i = 0; i < c->q_len; i++) {
			uint32_t p = c->q[(c->q_head + i) % QUEUE_MAX].peer;

			if (p < np)
				owed[p]++;
		}
		rescan = c->rescan || atomic_load(&c->in_flight);
		pthread_mutex_unlock(&c->qlock);
	}
	for (size_t i = 0; i < np; i++) {
		struct peer *p = peer_at(c, i);
		struct cluster_member m = { 0 };

		if (!p || forget(c, p, owed && !rescan ? owed[i] : 1))
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

struct store *cluster_store(struct cluster *c)
{
	return c->store;
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
	char host[CLUSTER_ENDPOINT_MAX];
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
	char (*names)[CLUSTER_ENDPOINT_MAX] = NULL;
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
	pthread_mutex_destroy(&c->check_lock);
	pthread_cond_destroy(&c->qcond);
	pthread_mutex_destroy(&c->qlock);
	pthread_rwlock_destroy(&c->view_lock);
	free(c->q);
	explicit_bzero(c->etcd_password, sizeof(c->etcd_password));
	free(c);
	*cp = NULL;
}
