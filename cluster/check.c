/*
 * check — how many copies the chunks held here have among their owners, and
 * which copies here are beyond R (see cluster.h, struct cluster_check); and the
 * same from every other member, asked with a HELLO.
 */
#include "cluster/cluster_impl.h"

#include <errno.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define RANKS_MAX 16

struct ck_chunk {
	uint8_t hash[KVBP_HASH_LEN];
	uint32_t model_id;
	uint8_t n_owners;
	int8_t self_rank;  /* -1: not an owner */
	uint16_t holding;  /* bit j: owner of rank j holds it (this daemon's own bit at the scan) */
	uint16_t unknown;  /* bit j: owner of rank j could not be asked */
};

/* One question: does peer (the owner of rank `rank`) hold chunk `chunk`? */
struct ck_item {
	uint32_t peer, model_id, chunk;
	uint8_t rank;
};

struct ck_scan {
	struct cluster *c;
	const struct view *v;
	size_t R;
	struct ck_chunk *chunks;
	size_t n, cap;
	struct ck_item *items;
	size_t n_items, cap_items;
	int err;
};

static int grow(void **p, size_t *cap, size_t n, size_t size)
{
	void *q;
	size_t c;

	if (n < *cap)
		return 0;
	c = *cap ? 2 * *cap : 1024;
	q = realloc(*p, c * size);
	if (!q)
		return -ENOMEM;
	*p = q;
	*cap = c;
	return 0;
}

static int ck_chunk(void *ctx, uint32_t model_id, const uint8_t *hash,
		    const struct store_chunk_info *info)
{
	struct ck_scan *s = ctx;
	size_t owners[RANKS_MAX], n = view_ranked(s->v, hash, s->R, owners);
	struct ck_chunk *k;

	(void)info;
	if (grow((void **)&s->chunks, &s->cap, s->n, sizeof(*s->chunks))) {
		s->err = -ENOMEM;
		return 1;
	}
	k = &s->chunks[s->n];
	memset(k, 0, sizeof(*k));
	memcpy(k->hash, hash, KVBP_HASH_LEN);
	k->model_id = model_id;
	k->n_owners = (uint8_t)n;
	k->self_rank = -1;
	for (size_t j = 0; j < n; j++) {
		if (!owners[j]) {
			k->self_rank = (int8_t)j;
			k->holding |= (uint16_t)(1u << j);
			continue;
		}
		if (grow((void **)&s->items, &s->cap_items, s->n_items, sizeof(*s->items))) {
			s->err = -ENOMEM;
			return 1;
		}
		s->items[s->n_items++] = (struct ck_item){ (uint32_t)(owners[j] - 1), model_id,
							   (uint32_t)s->n, (uint8_t)j };
	}
	s->n++;
	return 0;
}

static int item_cmp(const void *a, const void *b)
{
	const struct ck_item *x = a, *y = b;

	if (x->peer != y->peer)
		return x->peer < y->peer ? -1 : 1;
	if (x->model_id != y->model_id)
		return x->model_id < y->model_id ? -1 : 1;
	return x->chunk < y->chunk ? -1 : x->chunk > y->chunk;
}

/* Ask the owners, one LOOKUP per peer, model and LOOKUP_BATCH; until deadline (0: none). */
static bool ck_ask(struct ck_scan *s, int64_t deadline)
{
	struct cluster *c = s->c;
	size_t i = 0;

	qsort(s->items, s->n_items, sizeof(*s->items), item_cmp);
	while (i < s->n_items) {
		size_t start = i, k = 0;
		struct ck_item *it = s->items;
		struct peer *p = peer_at(c, it[start].peer);
		struct kvbp_request q = { .op = KVBP_OP_LOOKUP, .local_only = true };
		struct store_model m;
		struct call_out o;
		bool asked = false;

		if (deadline && now_ms() >= deadline) {
			for (; i < s->n_items; i++)
				s->chunks[it[i].chunk].unknown |= (uint16_t)(1u << it[i].rank);
			return false;
		}
		while (i < s->n_items && k < LOOKUP_BATCH && it[i].peer == it[start].peer &&
		       it[i].model_id == it[start].model_id) {
			i++;
			k++;
		}
		q.hashes = calloc(k, KVBP_HASH_LEN);
		if (p && peer_live(c, p) && q.hashes &&
		    !store_model_by_id(c->store, it[start].model_id, &m)) {
			for (size_t j = 0; j < k; j++)
				memcpy(q.hashes[j], s->chunks[it[start + j].chunk].hash, KVBP_HASH_LEN);
			q.n_hashes = k;
			snprintf(q.model_name, sizeof(q.model_name), "%s", m.name);
			if (!peer_call(c, p, &q, NULL, NULL, 0, &o)) {
				asked = o.rep.code == KVBP_OK && o.rep.n_chunks == k;
				for (size_t j = 0; asked && j < k; j++)
					if (o.rep.chunks[j].found)
						s->chunks[it[start + j].chunk].holding |=
							(uint16_t)(1u << it[start + j].rank);
				call_out_free(&o);
			}
		}
		kvbp_request_clear(&q);
		for (size_t j = 0; !asked && j < k; j++)
			s->chunks[it[start + j].chunk].unknown |= (uint16_t)(1u << it[start + j].rank);
	}
	return true;
}

static void ck_count(const struct ck_scan *s, struct cluster_check *out)
{
	for (size_t i = 0; i < s->n; i++) {
		const struct ck_chunk *k = &s->chunks[i];
		int first = k->holding ? __builtin_ctz(k->holding) : -1;
		bool counted = k->self_rank >= 0 ? first == k->self_rank : first < 0;

		if (k->self_rank >= 0)
			out->owned++;
		else
			out->beyond++;
		out->unverified += (uint64_t)__builtin_popcount(k->unknown);
		if (counted && __builtin_popcount(k->holding) < k->n_owners)
			out->under++;
	}
	out->chunks = s->n;
}

int cluster_check_local(struct cluster *c, int64_t budget_ms, struct cluster_check *out)
{
	struct ck_scan s = { .c = c, .R = c->replicas < RANKS_MAX ? c->replicas : RANKS_MAX };
	struct cluster_check r = { 0 };
	struct view v = { 0 };
	int64_t t0 = now_ms();
	int rc;

	pthread_rwlock_rdlock(&c->view_lock);
	rc = view_copy(&c->view, &v);
	pthread_rwlock_unlock(&c->view_lock);
	if (rc)
		return rc;
	s.v = &v;
	rc = store_chunk_scan(c->store, ck_chunk, &s);
	if (rc >= 0 && s.err)
		rc = s.err;
	if (rc >= 0) {
		if (budget_ms < 0)
			budget_ms = c->timeout_ms / 2;
		r.complete = ck_ask(&s, budget_ms ? t0 + budget_ms : 0);
		ck_count(&s, &r);
		r.took_ms = (uint64_t)(now_ms() - t0);
		r.at_ms = (uint64_t)wall_ms();
		pthread_mutex_lock(&c->check_lock);
		c->last_check = r;
		pthread_mutex_unlock(&c->check_lock);
		*out = r;
		rc = 0;
	}
	free(s.chunks);
	free(s.items);
	view_free(&v);
	return rc;
}

void cluster_check_last(struct cluster *c, struct cluster_check *out)
{
	pthread_mutex_lock(&c->check_lock);
	*out = c->last_check;
	pthread_mutex_unlock(&c->check_lock);
}

/* ---- the whole cluster: every member's chunk list, gathered here ---- */

struct ck_copy {
	uint8_t hash[KVBP_HASH_LEN];
	uint32_t member; /* index in the view */
};

struct ck_all {
	struct ck_copy *copies;
	size_t n, cap;
};

static int copy_add(struct ck_all *a, const uint8_t *hash, uint32_t member)
{
	if (grow((void **)&a->copies, &a->cap, a->n, sizeof(*a->copies)))
		return -ENOMEM;
	memcpy(a->copies[a->n].hash, hash, KVBP_HASH_LEN);
	a->copies[a->n++].member = member;
	return 0;
}

static int copy_cmp(const void *x, const void *y)
{
	const struct ck_copy *a = x, *b = y;
	int d = memcmp(a->hash, b->hash, KVBP_HASH_LEN);

	return d ? d : (a->member > b->member) - (a->member < b->member);
}

/* Member j's chunks of model m into a (j 0: this store; else a LIST). 0, or -errno. */
static int list_member(struct cluster *c, const struct view *v, uint32_t j,
		       const struct store_model *m, struct ck_all *a)
{
	struct kvbp_request q = { .op = KVBP_OP_LIST };
	struct peer *p;
	struct call_out o;
	int rc = 0;

	if (!v->peer_of[j]) {
		struct store_chunk_entry *e = NULL;
		size_t n = 0;

		rc = store_chunk_list(c->store, m, &e, &n);
		for (size_t i = 0; !rc && i < n; i++)
			rc = copy_add(a, e[i].hash, j);
		free(e);
		return rc;
	}
	p = peer_at(c, v->peer_of[j] - 1);
	if (!p || !peer_live(c, p))
		return -EHOSTUNREACH;
	snprintf(q.model_name, sizeof(q.model_name), "%s", m->name);
	rc = peer_call(c, p, &q, NULL, NULL, 0, &o);
	if (rc)
		return rc;
	if (o.rep.code == KVBP_UNKNOWN_MODEL)
		rc = 0; /* it holds none of the model */
	else if (o.rep.code)
		rc = -EPROTO;
	for (size_t i = 0; !rc && !o.rep.code && i < o.rep.n_chunks; i++)
		rc = copy_add(a, o.rep.chunks[i].hash, j);
	call_out_free(&o);
	return rc;
}

/* One chunk's copies g[0..n) (sorted by member): owners, missing and beyond, per member. */
static void tally(const struct view *v, size_t R, const struct ck_copy *g, size_t n,
		  struct cluster_check_member *m, uint64_t *under)
{
	size_t owners[RANKS_MAX], n_own = view_ranked(v, g[0].hash, R, owners), held = 0;

	for (size_t k = 0; k < n; k++)
		m[g[k].member].check.chunks++;
	for (size_t r = 0; r < n_own; r++) {
		uint32_t j = 0;
		bool has = false;

		while (j < v->n && v->peer_of[j] != owners[r])
			j++;
		if (j == v->n)
			continue;
		for (size_t k = 0; k < n && !has; k++)
			has = g[k].member == j;
		if (has) {
			m[j].check.owned++;
			held++;
		} else if (m[j].answered) {
			m[j].check.missing++; /* copies it owns and lacks */
		} else {
			m[j].check.unverified++;
		}
	}
	if (held < n_own)
		(*under)++;
}

int cluster_check_all(struct cluster *c, struct cluster_check_member **out, size_t *n,
		      uint64_t *under)
{
	struct cluster_check_member *m = NULL;
	struct store_model *models = NULL;
	struct ck_all a = { 0 };
	struct view v = { 0 };
	size_t n_models = 0, n_members, R = c->replicas < RANKS_MAX ? c->replicas : RANKS_MAX;
	int rc;

	pthread_rwlock_rdlock(&c->view_lock);
	rc = view_copy(&c->view, &v);
	pthread_rwlock_unlock(&c->view_lock);
	if (!rc && !(m = calloc(v.n ? v.n : 1, sizeof(*m))))
		rc = -ENOMEM;
	if (!rc)
		rc = store_model_list(c->store, &models, &n_models);
	for (size_t j = 0; !rc && j < v.n; j++) {
		struct peer *p = v.peer_of[j] ? peer_at(c, v.peer_of[j] - 1) : NULL;

		snprintf(m[j].id, sizeof(m[j].id), "%s", p ? p->id : c->self);
		m[j].answered = true;
		for (size_t k = 0; m[j].answered && k < n_models; k++) {
			int lr = list_member(c, &v, (uint32_t)j, &models[k], &a);

			if (lr == -ENOMEM)
				rc = lr;
			else if (lr)
				m[j].answered = false;
		}
		m[j].check.complete = m[j].answered;
	}
	*under = 0;
	if (!rc) {
		/* one group of copies per chunk (a hash in two models counts once: it is the
		 * same tokens' KV, placed the same) */
		qsort(a.copies, a.n, sizeof(*a.copies), copy_cmp);
		for (size_t i = 0, e; i < a.n; i = e) {
			for (e = i + 1; e < a.n && !memcmp(a.copies[e].hash, a.copies[i].hash,
							  KVBP_HASH_LEN); e++)
				;
			tally(&v, R, a.copies + i, e - i, m, under);
		}
		for (size_t j = 0; j < v.n; j++) {
			m[j].check.beyond = m[j].check.chunks - m[j].check.owned;
			m[j].check.at_ms = (uint64_t)wall_ms();
		}
	}
	free(a.copies);
	free(models);
	n_members = v.n;
	view_free(&v);
	if (rc) {
		free(m);
		return rc;
	}
	*out = m;
	*n = n_members;
	cluster_check_request(c); /* the gauges follow: every member checks its own share */
	return 0;
}

void cluster_check_request(struct cluster *c)
{
	size_t np = n_peers(c);

	atomic_store(&c->check_wanted, true);
	rebalance_kick(c);
	for (size_t i = 0; i < np; i++) {
		struct peer *p = peer_at(c, i);
		struct kvbp_request q = { .op = KVBP_OP_HELLO, .cluster_check = true };
		struct call_out o;

		if (p && peer_live(c, p) && !peer_call(c, p, &q, NULL, NULL, 0, &o))
			call_out_free(&o);
	}
}

void cluster_check_wanted(struct cluster *c)
{
	atomic_store(&c->check_wanted, true);
	rebalance_kick(c);
}
