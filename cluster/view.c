/*
 * cluster/view — the members as every thread of the cluster sees them: the shared view
 * (rebuilt when membership changes, copied by readers), placement over it, the peers'
 * liveness and grace, and the helpers all the cluster's modules use (its log, timed
 * waits, the rebalance kick). Below the lifecycle (cluster.c) and the membership
 * sources (members.c), which both use it. See cluster_impl.h.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "cluster/cluster.h"
#include "cluster/cluster_impl.h"

void cluster_logf(const struct cluster *c, int level, const char *fmt, ...)
{
	char line[1024];
	va_list ap;

	if (!c->log)
		return;
	va_start(ap, fmt);
	vsnprintf(line, sizeof(line), fmt, ap);
	va_end(ap);
	c->log(level, line);
}

void wait_ms(pthread_cond_t *cond, pthread_mutex_t *mu, int64_t ms)
{
	wait_ns(cond, mu, ms * 1000000);
}

void wait_ns(pthread_cond_t *cond, pthread_mutex_t *mu, int64_t ns)
{
	struct timespec ts;

	clock_gettime(CLOCK_REALTIME, &ts);
	ts.tv_sec += ns / 1000000000;
	ts.tv_nsec += ns % 1000000000;
	ts.tv_sec += ts.tv_nsec / 1000000000;
	ts.tv_nsec %= 1000000000;
	pthread_cond_timedwait(cond, mu, &ts);
}

/* ---- the view ---- */

void view_free(struct view *v)
{
	free(v->members);
	free(v->peer_of);
	memset(v, 0, sizeof(*v));
}

/* A copy of c's view into out (the view lock held). */
int view_copy(const struct view *in, struct view *out)
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
int view_rebuild(struct cluster *c)
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
		c->peers[i]->in_view = c->peers[i]->live || !past_grace(c, c->peers[i]);
	for (size_t i = 0; i < c->n_peers; i++)
		if (c->peers[i]->in_view) {
			v.members[n] = (struct place_member){ place_seed(c->peers[i]->id),
							      c->peers[i]->weight };
			v.peer_of[n++] = (uint32_t)(i + 1);
		}
	v.n = n;
	/* the same members with the same weights: placement did not change, nothing to do */
	if (v.n == c->view.n && c->view.members &&
	    !memcmp(v.members, c->view.members, n * sizeof(*v.members)) &&
	    !memcmp(v.peer_of, c->view.peer_of, n * sizeof(*v.peer_of))) {
		view_free(&v);
		return 0;
	}
	view_free(&c->view);
	c->view = v;
	c->change_wall_ms[(atomic_fetch_add(&c->view_gen, 1) + 1) % VIEW_TIMES] = wall_ms();
	return 0;
}

bool past_grace(const struct cluster *c, const struct peer *p)
{
	int64_t since = atomic_load(&p->gone_since);

	return !p->live && (!since || now_ms() - since >= c->grace_ms);
}

/* Members of view v in placement order for hash, as 0 (this daemon) or 1 + peer index. */
size_t view_ranked(const struct view *v, const uint8_t *hash, size_t r, size_t *idx)
{
	size_t n = place_owners(v->members, v->n, hash, r, idx);

	for (size_t j = 0; j < n; j++)
		idx[j] = v->peer_of[idx[j]];
	return n;
}

/* The same for the current view. */
size_t ranked(struct cluster *c, const uint8_t *hash, size_t r, size_t *idx)
{
	size_t n;

	pthread_rwlock_rdlock(&c->view_lock);
	n = view_ranked(&c->view, hash, r, idx);
	pthread_rwlock_unlock(&c->view_lock);
	return n;
}

struct peer *peer_at(struct cluster *c, size_t i)
{
	struct peer *p;

	pthread_rwlock_rdlock(&c->view_lock);
	p = i < c->n_peers ? c->peers[i] : NULL;
	pthread_rwlock_unlock(&c->view_lock);
	return p;
}

bool peer_live(struct cluster *c, struct peer *p)
{
	bool live;

	pthread_rwlock_rdlock(&c->view_lock);
	live = p->live;
	pthread_rwlock_unlock(&c->view_lock);
	return live;
}

size_t n_peers(struct cluster *c)
{
	size_t n;

	pthread_rwlock_rdlock(&c->view_lock);
	n = c->n_peers;
	pthread_rwlock_unlock(&c->view_lock);
	return n;
}

void rebalance_kick(struct cluster *c)
{
	/* the heartbeat thread sleeps on the same condition: wake both, not one of them */
	pthread_mutex_lock(&c->rlock);
	pthread_cond_broadcast(&c->rcond);
	pthread_mutex_unlock(&c->rlock);
}
