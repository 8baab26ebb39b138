/*
 * rebalance — chunks to the members that own them (see cluster.h): after a
 * membership change, the chunks held here whose owners changed; in a repair pass,
 * every chunk held here to each owner that lacks it. And heartbeats.
 */
#include "cluster/cluster_impl.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct rb_item {
	uint32_t peer, model_id;
	uint8_t hash[KVBP_HASH_LEN];
};

struct rb_scan {
	struct cluster *c;
	const struct view *old, *cur;
	uint64_t since; /* chunks stored since (unix s) may have been placed by a later view */
	const bool *sender_ok; /* [0 this daemon, 1 + peer]: in the current view and live */
	size_t n_sender_ok;
	bool drain; /* cur is old without this daemon: what it owns, it sends */
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
 * rb_filter then keeps only those that lack it. One holder sends a chunk that
 * moves: the first of its old owners still in the view and live (it holds the
 * chunk: it was pushed there), so a join moves each chunk once, not once per
 * copy. Where no old owner is left (all R left at once), and for a chunk stored
 * since the old view (placed by whatever view held then), every holder offers it;
 * the LOOKUP before a push keeps that to the copies the owner lacks, and a chunk
 * the chosen sender lost after all is mended by the repair pass.
 */
static int rb_chunk(void *ctx, uint32_t model_id, const uint8_t *hash,
		    const struct store_chunk_info *info)
{
	struct rb_scan *r = ctx;
	size_t R = r->c->replicas < 16 ? r->c->replicas : 16;
	size_t now[16], before[16], n_now, n_before = 0;

	n_now = view_ranked(r->cur, hash, R, now);
	if (r->old && info->created < r->since) {
		n_before = view_ranked(r->old, hash, R, before);
		if (r->drain && !in_list(before, n_before, 0))
			return 0; /* not owned here: its owners stay */
		for (size_t j = 0; !r->drain && j < n_before; j++) {
			if (before[j] >= r->n_sender_ok || !r->sender_ok[before[j]])
				continue; /* gone: the next old owner sends */
			if (before[j] != 0)
				return 0; /* another member sends it */
			break;	  /* this daemon does */
		}
	}
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

static size_t rb_collect(struct cluster *c, struct rb_scan *r);

/*
 * Chunks held here to the owners under cur that lack them: those whose owners
 * changed since old, or (old NULL, a repair pass) all. since (unix s): when old
 * stopped being the view; a chunk stored later may have been placed by another.
 */
static void rebalance(struct cluster *c, const struct view *old, const struct view *cur,
		      uint64_t since)
{
	/* created is in whole seconds, and a PUT's owners are taken just after it: a margin */
	struct rb_scan r = { .c = c, .old = old, .cur = cur, .since = since - 1 };
	size_t n = rb_collect(c, &r);

	if (!r.items)
		return; /* nothing here changed owners, or it could not be read */
	for (size_t i = 0; i < n; i++)
		owe(c, r.items[i].peer, r.items[i].model_id, r.items[i].hash, true);
	if (n || old)
		cl_info(c, "cluster: %s: %zu chunk copies to push to owners that lack them (%zu "
			"already there)", old ? "membership changed" : "repair pass", n, r.n - n);
	free(r.items);
}

/*
 * The items of scan r (its views and since set): the chunks held here to push,
 * each to an owner that lacks it, sorted, in r->items (NULL when none or on
 * failure, logged). Returns how many are to push; r->n - that already had them.
 */
static size_t rb_collect(struct cluster *c, struct rb_scan *r)
{
	const struct view *cur = r->cur;
	size_t n, np = n_peers(c);
	bool *ok = calloc(np + 1, sizeof(*ok));
	int rc;

	if (!ok)
		return 0;
	for (size_t j = 0; j < cur->n; j++) {
		struct peer *p = cur->peer_of[j] ? peer_at(c, cur->peer_of[j] - 1) : NULL;

		if (cur->peer_of[j] <= np)
			ok[cur->peer_of[j]] = !cur->peer_of[j] || (p && peer_live(c, p));
	}
	r->sender_ok = ok;
	r->n_sender_ok = np + 1;
	rc = store_chunk_scan(c->store, rb_chunk, r);
	free(ok);
	if (rc < 0 || r->err) {
		cl_warn(c, "cluster: rebalance: cannot read the store's chunks: %s",
			strerror(r->err ? -r->err : -rc));
		free(r->items);
		r->items = NULL;
		return 0;
	}
	if (!r->n) {
		free(r->items);
		r->items = NULL;
		return 0;
	}
	qsort(r->items, r->n, sizeof(*r->items), rb_cmp);
	n = rb_filter(c, r->items, r->n);
	return n;
}

long cluster_drain(struct cluster *c)
{
	int64_t start = now_ms(), end = start + c->drain_ms;
	struct view cur = { 0 }, without = { 0 };
	struct rb_scan r = { .c = c, .old = &cur, .cur = &without, .since = UINT64_MAX,
			     .drain = true };
	size_t n;
	long sent = 0, failed = 0;
	int rc;

	if (!c || !c->drain_ms)
		return 0;
	pthread_rwlock_rdlock(&c->view_lock);
	rc = view_copy(&c->view, &cur);
	if (!rc)
		rc = view_copy(&c->view, &without);
	pthread_rwlock_unlock(&c->view_lock);
	if (rc || cur.n < 2) {
		view_free(&cur);
		view_free(&without);
		return rc;
	}
	/* the view once this daemon ([0]) is gone, and with it those gone already (in their
	 * grace): nothing can be pushed to them */
	n = 0;
	for (size_t j = 1; j < cur.n; j++) {
		struct peer *p = peer_at(c, cur.peer_of[j] - 1);

		if (p && peer_live(c, p)) {
			without.members[n] = cur.members[j];
			without.peer_of[n++] = cur.peer_of[j];
		}
	}
	without.n = n;
	if (!n) {
		view_free(&cur);
		view_free(&without);
		return 0;
	}
	cl_info(c, "cluster: draining: the chunks this member owns to those that own them "
		"without it (at most %" PRId64 " s)", c->drain_ms / 1000);
	n = rb_collect(c, &r);
	for (size_t i = 0; i < n && now_ms() < end; i++) {
		struct push e = { r.items[i].peer, r.items[i].model_id, { 0 }, false };
		struct peer *p = peer_at(c, e.peer);
		uint64_t bytes;

		memcpy(e.hash, r.items[i].hash, KVBP_HASH_LEN);
		if (!p || suspect(p) || push_one(c, &e, &bytes))
			failed++;
		else
			sent++;
	}
	/* and what the push thread still owes live members (a PUT's copies) */
	while (pushes_pending(c) && now_ms() < end) {
		struct timespec ts = { 0, 20 * 1000000 };

		nanosleep(&ts, NULL);
	}
	rc = now_ms() >= end ? -ETIMEDOUT : 0;
	if (rc)
		cl_warn(c, "cluster: drain cut short by cluster_drain_timeout (%" PRId64 " s): %zu "
			"chunk copies and %zu owed pushes not sent", c->drain_ms / 1000,
			n - (size_t)(sent + failed), pushes_pending(c));
	cl_info(c, "cluster: drained: %ld chunk copies pushed to their new owners (%zu already "
		"there, %ld failed) in %" PRId64 " ms", sent, r.n - n, failed, now_ms() - start);
	free(r.items);
	view_free(&cur);
	view_free(&without);
	return rc ? rc : sent;
}

void *rebalancer_main(void *arg)
{
	struct cluster *c = arg;

	int64_t next_repair = now_ms() + c->repair_ms;

	pthread_mutex_lock(&c->rlock);
	while (!c->stop) {
		struct view cur = { 0 };
		uint64_t gen = atomic_load(&c->view_gen), wall, since;
		int rc;

		if (gen == c->rebalanced_gen && atomic_exchange(&c->check_wanted, false)) {
			struct cluster_check ck; /* asked for (kvblend cluster check) */

			pthread_mutex_unlock(&c->rlock);
			cluster_check_local(c, 0, &ck);
			pthread_mutex_lock(&c->rlock);
			continue;
		}
		if (gen == c->rebalanced_gen) {
			/* A repair pass: every chunk held here to every owner that lacks it. */
			if (c->repair_ms && now_ms() >= next_repair && c->have_rebalanced &&
			    c->rebalanced.n > 1) {
				pthread_mutex_unlock(&c->rlock);
				rebalance(c, NULL, &c->rebalanced, 0); /* only this thread changes it */
				atomic_store(&c->check_wanted, true); /* the gauge, after repair */
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
		/* the old view held until the first change after it */
		since = gen - c->rebalanced_gen <= VIEW_TIMES
				? (uint64_t)(c->change_wall_ms[(c->rebalanced_gen + 1) % VIEW_TIMES] /
					     1000)
				: c->rebalanced_wall_s;
		pthread_rwlock_unlock(&c->view_lock);
		/* owed pushes for members that just became known can be queued now */
		pthread_mutex_lock(&c->qlock);
		c->rescan = true;
		pthread_cond_signal(&c->qcond);
		pthread_mutex_unlock(&c->qlock);
		if (!rc && c->have_rebalanced)
			rebalance(c, &c->rebalanced, &cur, since);
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

/* Members gone longer than cluster_grace leave placement: their chunks go to the others. */
static void grace_expire(struct cluster *c)
{
	bool expired = false;

	pthread_rwlock_rdlock(&c->view_lock);
	for (size_t i = 0; i < c->n_peers && !expired; i++)
		expired = c->peers[i]->in_view && past_grace(c, c->peers[i]);
	pthread_rwlock_unlock(&c->view_lock);
	if (!expired)
		return;
	pthread_rwlock_wrlock(&c->view_lock);
	for (size_t i = 0; i < c->n_peers; i++)
		if (c->peers[i]->in_view && past_grace(c, c->peers[i]))
			cl_info(c, "cluster: member '%s' gone longer than cluster_grace (%" PRId64
				" s): its chunks go to the others", c->peers[i]->id,
				c->grace_ms / 1000);
	view_rebuild(c);
	pthread_rwlock_unlock(&c->view_lock);
	rebalance_kick(c);
}

void *heart_main(void *arg)
{
	struct cluster *c = arg;

	pthread_mutex_lock(&c->rlock);
	while (!c->stop) {
		size_t np;

		wait_ms(&c->rcond, &c->rlock, HEARTBEAT_MS / 4);
		if (c->stop)
			break;
		pthread_mutex_unlock(&c->rlock);
		grace_expire(c);
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
