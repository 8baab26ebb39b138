/* evict — capacity and LRU eviction; see evict.h. */
#include "daemon/evict.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/log.h"
#include "daemon/tenants.h"

#define KEY_LEN (4 + STORE_HASH_LEN)
#define CACHE_PASS_S 5	  /* cache passes after chunks arrive: at most this often, */
#define CACHE_SHARE 20	  /* and apart by this many times the last pass's length */
#define CACHE_IDLE_S 60	  /* and without arrivals (ownership changes with membership) */
#define CACHE_BATCH 256	  /* cache copies asked about at once */

struct entry {
	uint8_t key[KEY_LEN];
	uint64_t seq; /* access order: larger is more recent */
	struct entry *next;
};

struct pin {
	uint8_t key[KEY_LEN];
	time_t until;
};

struct evictor {
	struct store *store;
	struct fuse_table *fuse;
	const struct tenants *tenants; /* their capacities; NULL: none */
	uint64_t capacity, high, low;
	unsigned high_pct, low_pct;
	struct timespec last_quota_pass;
	pthread_mutex_t lock; /* the access map, pins, stats, stop */
	pthread_cond_t cond;
	pthread_mutex_t pass_lock; /* one eviction pass at a time */
	pthread_t thread;
	bool started, stop, kicked;
	struct entry **buckets;
	size_t n_buckets, count;
	uint64_t seq;
	struct pin *pins;
	size_t n_pins, cap_pins;
	struct evict_stats stats;
	bool (*owns)(void *ctx, const uint8_t *hash); /* NULL: every chunk is owned */
	void *owns_ctx;
	evict_hold_fn hold; /* NULL: cache copies have no budget of their own */
	uint64_t cache_budget;
	bool cache_pending; /* chunks arrived since the last cache pass */
	int64_t cache_next; /* monotonic s: the next cache pass at the latest */
	int64_t cache_last;
	int64_t cache_gap; /* s between cache passes: CACHE_PASS_S, more for a long walk */
};

struct cand {
	uint8_t key[KEY_LEN];
	uint64_t seq, created, stored;
	size_t ns; /* index into the pass's namespaces */
	bool gone; /* evicted earlier in this pass */
	bool owned; /* false: a cache copy of another member's chunk, evicted first */
};

/* A namespace in one pass: its name, capacity and the stored bytes of its chunks. */
struct ns_use {
	char name[TENANT_NAME_MAX + 1];
	uint64_t capacity, bytes;
};

static void make_key(uint8_t *key, uint32_t model_id, const uint8_t *hash)
{
	key[0] = (uint8_t)(model_id >> 24);
	key[1] = (uint8_t)(model_id >> 16);
	key[2] = (uint8_t)(model_id >> 8);
	key[3] = (uint8_t)model_id;
	memcpy(key + 4, hash, STORE_HASH_LEN);
}

static size_t bucket_of(const struct evictor *e, const uint8_t *key)
{
	uint64_t h;

	/* Chunk hashes are uniformly distributed already. */
	memcpy(&h, key + 4, sizeof(h));
	return (size_t)((h ^ key[3] ^ (uint64_t)key[2] << 8) % e->n_buckets);
}

static struct entry *find_entry(struct evictor *e, const uint8_t *key)
{
	for (struct entry *x = e->buckets[bucket_of(e, key)]; x; x = x->next)
		if (!memcmp(x->key, key, KEY_LEN))
			return x;
	return NULL;
}

/* Double the table when it gets dense (lock held); on failure keep the old one. */
static void grow(struct evictor *e)
{
	size_t nb = e->n_buckets * 2;
	struct entry **b = calloc(nb, sizeof(*b));

	if (!b)
		return;
	for (size_t i = 0; i < e->n_buckets; i++)
		for (struct entry *x = e->buckets[i], *next; x; x = next) {
			size_t j;

			next = x->next;
			memcpy(&j, x->key + 4, sizeof(j));
			j = (size_t)((j ^ x->key[3] ^ (uint64_t)x->key[2] << 8) % nb);
			x->next = b[j];
			b[j] = x;
		}
	free(e->buckets);
	e->buckets = b;
	e->n_buckets = nb;
}

void evictor_touch(struct evictor *e, uint32_t model_id, const uint8_t *hash)
{
	uint8_t key[KEY_LEN];
	struct entry *x;

	make_key(key, model_id, hash);
	pthread_mutex_lock(&e->lock);
	x = find_entry(e, key);
	if (!x) {
		x = malloc(sizeof(*x));
		if (x) {
			size_t b = bucket_of(e, key);

			memcpy(x->key, key, KEY_LEN);
			x->next = e->buckets[b];
			e->buckets[b] = x;
			if (++e->count > 2 * e->n_buckets)
				grow(e);
		}
	}
	if (x)
		x->seq = ++e->seq;
	pthread_mutex_unlock(&e->lock);
}

static void forget(struct evictor *e, const uint8_t *key)
{
	struct entry **pp = &e->buckets[bucket_of(e, key)];

	for (; *pp; pp = &(*pp)->next)
		if (!memcmp((*pp)->key, key, KEY_LEN)) {
			struct entry *x = *pp;

			*pp = x->next;
			free(x);
			e->count--;
			return;
		}
}

void evictor_kick(struct evictor *e)
{
	pthread_mutex_lock(&e->lock);
	e->kicked = true;
	pthread_cond_signal(&e->cond);
	pthread_mutex_unlock(&e->lock);
}

/* ---- pins (lock held) ---- */

static struct pin *pin_find(struct evictor *e, const uint8_t *key)
{
	for (size_t i = 0; i < e->n_pins; i++)
		if (!memcmp(e->pins[i].key, key, KEY_LEN))
			return &e->pins[i];
	return NULL;
}

static void pins_expire(struct evictor *e)
{
	time_t now = time(NULL);

	for (size_t i = 0; i < e->n_pins;)
		if (e->pins[i].until <= now)
			e->pins[i] = e->pins[--e->n_pins];
		else
			i++;
}

int evictor_pin(struct evictor *e, uint32_t model_id, const uint8_t *hash, uint32_t ttl_s)
{
	uint8_t key[KEY_LEN];
	struct pin *p;
	int rc = 0;

	make_key(key, model_id, hash);
	pthread_mutex_lock(&e->lock);
	pins_expire(e);
	p = pin_find(e, key);
	if (!p && e->n_pins == e->cap_pins) {
		size_t cap = e->cap_pins ? 2 * e->cap_pins : 64;
		struct pin *np = realloc(e->pins, cap * sizeof(*np));

		if (np) {
			e->pins = np;
			e->cap_pins = cap;
		}
	}
	if (!p && e->n_pins < e->cap_pins) {
		p = &e->pins[e->n_pins++];
		memcpy(p->key, key, KEY_LEN);
	}
	if (p)
		p->until = time(NULL) + ttl_s;
	else
		rc = -ENOMEM;
	pthread_mutex_unlock(&e->lock);
	return rc;
}

int evictor_unpin(struct evictor *e, uint32_t model_id, const uint8_t *hash)
{
	uint8_t key[KEY_LEN];
	struct pin *p;

	make_key(key, model_id, hash);
	pthread_mutex_lock(&e->lock);
	pins_expire(e);
	p = pin_find(e, key);
	if (p)
		*p = e->pins[--e->n_pins];
	pthread_mutex_unlock(&e->lock);
	return p ? 0 : -ENOENT;
}

/* ---- the pass ---- */

struct gather {
	struct evictor *e;
	struct cand *c;
	size_t n, cap;
	int err;
};

static int gather_one(void *ctx, uint32_t model_id, const uint8_t *hash,
		      const struct store_chunk_info *info)
{
	struct gather *g = ctx;
	struct cand *c;
	struct entry *x;

	if (g->n == g->cap) {
		size_t cap = g->cap ? 2 * g->cap : 1024;
		struct cand *nc = realloc(g->c, cap * sizeof(*nc));

		if (!nc)
			return -ENOMEM;
		g->c = nc;
		g->cap = cap;
	}
	c = &g->c[g->n++];
	make_key(c->key, model_id, hash);
	pthread_mutex_lock(&g->e->lock);
	x = find_entry(g->e, c->key);
	c->seq = x ? x->seq : 0;
	pthread_mutex_unlock(&g->e->lock);
	c->created = info->created;
	c->stored = info->stored_bytes;
	c->gone = false;
	c->owned = !g->e->owns || g->e->owns(g->e->owns_ctx, hash);
	return 0;
}

static int cmp_cand(const void *a, const void *b)
{
	const struct cand *x = a, *y = b;

	if (x->owned != y->owned)
		return x->owned ? 1 : -1;
	if (x->seq != y->seq)
		return x->seq < y->seq ? -1 : 1;
	return (x->created > y->created) - (x->created < y->created);
}

/* The model id a chunk key starts with (big-endian, as the store keys chunks). */
static uint32_t key_model_id(const uint8_t *key)
{
	return (uint32_t)key[0] << 24 | (uint32_t)key[1] << 16 | (uint32_t)key[2] << 8 | key[3];
}

/* The namespace of a model: the tenant before '#' in its stored name, or "" (tenants.h). */
static void ns_of_model(const struct store_model *m, char ns[TENANT_NAME_MAX + 1])
{
	const char *sep = strchr(m->name, '#');
	size_t n = sep ? (size_t)(sep - m->name) : 0;

	if (n > TENANT_NAME_MAX)
		n = 0;
	memcpy(ns, m->name, n);
	ns[n] = 0;
}

/* Index of namespace name in *use (added when new); SIZE_MAX without memory. */
static size_t ns_index(struct evictor *e, struct ns_use **use, size_t *n, const char *name)
{
	struct ns_use *nu;

	for (size_t i = 0; i < *n; i++)
		if (!strcmp((*use)[i].name, name))
			return i;
	nu = realloc(*use, (*n + 1) * sizeof(*nu));
	if (!nu)
		return SIZE_MAX;
	*use = nu;
	memset(&nu[*n], 0, sizeof(*nu));
	snprintf(nu[*n].name, sizeof(nu[*n].name), "%s", name);
	nu[*n].capacity = tenants_capacity(e->tenants, name);
	return (*n)++;
}

/* The namespace of every candidate, and each namespace's stored bytes. */
static int assign_namespaces(struct evictor *e, struct gather *g, struct ns_use **use, size_t *n)
{
	struct store_model m = { .id = UINT32_MAX };
	size_t cur = 0;

	for (size_t i = 0; i < g->n; i++) {
		struct cand *c = &g->c[i];
		uint32_t id = key_model_id(c->key);

		if (m.id != id) {
			char ns[TENANT_NAME_MAX + 1] = "";

			if (store_model_by_id(e->store, id, &m) == 0)
				ns_of_model(&m, ns);
			else
				m.id = id; /* unreadable: the default namespace */
			cur = ns_index(e, use, n, ns);
			if (cur == SIZE_MAX)
				return -ENOMEM;
		}
		c->ns = cur;
		(*use)[cur].bytes += c->stored;
	}
	return 0;
}

/*
 * Evict candidate c unless it is gone already, pinned or in use, and count its bytes
 * against its namespace and in *freed. Returns whether it went.
 */
static bool take(struct evictor *e, struct cand *c, struct ns_use *use, struct store_model *m,
		 uint64_t *freed)
{
	struct ns_use *u = &use[c->ns];
	uint32_t id = key_model_id(c->key);
	bool pinned;

	if (c->gone)
		return false;
	pthread_mutex_lock(&e->lock);
	pinned = pin_find(e, c->key) != NULL;
	pthread_mutex_unlock(&e->lock);
	if (pinned)
		return false;
	if (m->id != id && store_model_by_id(e->store, id, m)) {
		m->id = UINT32_MAX;
		return false;
	}
	/* Refused while a fuse session pins it; gone if deleted meanwhile. */
	if (fuse_delete_chunk(e->fuse, m, c->key + 4))
		return false;
	pthread_mutex_lock(&e->lock);
	forget(e, c->key);
	pthread_mutex_unlock(&e->lock);
	c->gone = true;
	u->bytes -= c->stored < u->bytes ? c->stored : u->bytes;
	*freed += c->stored;
	return true;
}

static uint64_t pct_of(uint64_t x, unsigned pct)
{
	return x / 100 * pct + x % 100 * pct / 100;
}

/*
 * One eviction pass, least recently used first. First every tenant above its own
 * capacity (at the high watermark) loses its own chunks down to the low one; then,
 * until goal bytes are freed, chunks of any namespace that is not a tenant within
 * its capacity go, and with requester (a tenant making room for its PUT) that
 * tenant's own too. Returns the bytes freed.
 */
static uint64_t pass(struct evictor *e, uint64_t goal, const char *requester)
{
	struct gather g = { .e = e };
	struct store_model m = { .id = UINT32_MAX };
	struct ns_use *use = NULL;
	size_t n_use = 0;
	uint64_t freed = 0, n = 0;
	int rc;

	pthread_mutex_lock(&e->pass_lock);
	rc = store_chunk_scan(e->store, gather_one, &g);
	if (!rc)
		rc = assign_namespaces(e, &g, &use, &n_use);
	if (rc) {
		log_warn("eviction: cannot scan the store: %s", strerror(-rc));
		goto out;
	}
	if (g.n) /* (an empty store gathers no array: qsort must not see NULL) */
		qsort(g.c, g.n, sizeof(*g.c), cmp_cand);
	pthread_mutex_lock(&e->lock);
	pins_expire(e);
	pthread_mutex_unlock(&e->lock);
	for (size_t k = 0; k < n_use; k++) {
		struct ns_use *u = &use[k];

		if (!u->capacity || u->bytes <= pct_of(u->capacity, e->high_pct))
			continue;
		for (size_t i = 0; i < g.n && u->bytes > pct_of(u->capacity, e->low_pct); i++)
			if (g.c[i].ns == k)
				n += take(e, &g.c[i], use, &m, &freed);
	}
	for (size_t i = 0; i < g.n && freed < goal; i++) {
		struct cand *c = &g.c[i];
		struct ns_use *u = &use[c->ns];
		bool mine = requester && !strcmp(u->name, requester);

		/* a tenant within its capacity is not evicted for another namespace */
		if (u->capacity && u->bytes <= u->capacity && !mine)
			continue;
		n += take(e, c, use, &m, &freed);
	}
	pthread_mutex_lock(&e->lock);
	e->stats.evicted += n;
	e->stats.evicted_bytes += freed;
	e->stats.passes++;
	pthread_mutex_unlock(&e->lock);
	if (n)
		log_info("evicted %" PRIu64 " chunks (%" PRIu64 " bytes)", n, freed);
out:
	pthread_mutex_unlock(&e->pass_lock);
	free(use);
	free(g.c);
	return freed;
}

/* One batch of cache copies g->c[i..j) (one model): evict those its owners hold. */
static uint64_t cache_batch(struct evictor *e, struct cand *c, size_t n, uint64_t *bytes,
			    uint64_t *freed)
{
	uint8_t(*hashes)[STORE_HASH_LEN] = calloc(n, STORE_HASH_LEN);
	bool *held = calloc(n, sizeof(*held));
	struct ns_use one = { .bytes = UINT64_MAX };
	struct store_model m = { .id = UINT32_MAX };
	uint64_t taken = 0;

	if (!hashes || !held)
		goto out;
	for (size_t i = 0; i < n; i++)
		memcpy(hashes[i], c[i].key + 4, STORE_HASH_LEN);
	e->hold(e->owns_ctx, key_model_id(c[0].key), (const uint8_t(*)[STORE_HASH_LEN])hashes, n,
		held);
	pthread_mutex_lock(&e->pass_lock);
	for (size_t i = 0; i < n && *bytes > e->cache_budget; i++) {
		c[i].ns = 0;
		if (held[i] && take(e, &c[i], &one, &m, freed)) {
			*bytes -= c[i].stored < *bytes ? c[i].stored : *bytes;
			taken++;
		}
	}
	pthread_mutex_unlock(&e->pass_lock);
out:
	free(hashes);
	free(held);
	return taken;
}

/*
 * Cache copies beyond the budget go, least recently used first, each once its
 * owners hold it. Returns whether they are still beyond it.
 */
static bool cache_pass(struct evictor *e)
{
	struct gather g = { .e = e };
	uint64_t bytes = 0, freed = 0, n = 0;
	size_t n_cache = 0;
	int rc;

	pthread_mutex_lock(&e->pass_lock);
	rc = store_chunk_scan(e->store, gather_one, &g);
	pthread_mutex_unlock(&e->pass_lock);
	if (rc) {
		log_warn("eviction: cannot scan the store for cache copies: %s", strerror(-rc));
		free(g.c);
		return true;
	}
	for (size_t i = 0; i < g.n; i++)
		if (!g.c[i].owned) {
			bytes += g.c[i].stored;
			n_cache++;
		}
	if (bytes > e->cache_budget) {
		qsort(g.c, g.n, sizeof(*g.c), cmp_cand); /* cache copies first, LRU */
		for (size_t i = 0; i < n_cache && bytes > e->cache_budget;) {
			size_t j = i + 1;

			while (j < n_cache && j - i < CACHE_BATCH &&
			       key_model_id(g.c[j].key) == key_model_id(g.c[i].key))
				j++;
			n += cache_batch(e, &g.c[i], j - i, &bytes, &freed);
			i = j;
		}
	}
	pthread_mutex_lock(&e->lock);
	e->stats.evicted += n;
	e->stats.evicted_bytes += freed;
	e->stats.cache_reclaimed += n;
	e->stats.cache_bytes = bytes;
	pthread_mutex_unlock(&e->lock);
	if (n)
		log_info("cache copies: %" PRIu64 " reclaimed (%" PRIu64 " bytes), their owners "
			 "hold them; %" PRIu64 " bytes of cache copies left (budget %" PRIu64 ")",
			 n, freed, bytes, e->cache_budget);
	free(g.c);
	return bytes > e->cache_budget;
}

void evictor_set_cache(struct evictor *e, evict_hold_fn hold, uint64_t budget)
{
	pthread_mutex_lock(&e->lock);
	e->hold = hold;
	e->cache_budget = budget;
	e->cache_pending = true;
	pthread_mutex_unlock(&e->lock);
}

int64_t evictor_make_room(struct evictor *e, uint64_t bytes, const char *ns)
{
	uint64_t freed = pass(e, bytes, ns);

	return freed ? (int64_t)freed : -ENOSPC;
}

static void *evict_main(void *arg)
{
	struct evictor *e = arg;

	pthread_mutex_lock(&e->lock);
	while (!e->stop) {
		struct timespec until, now;
		struct store_totals t;
		bool kicked;

		clock_gettime(CLOCK_REALTIME, &until);
		until.tv_sec += 1;
		if (!e->kicked)
			pthread_cond_timedwait(&e->cond, &e->lock, &until);
		kicked = e->kicked;
		e->kicked = false;
		e->cache_pending |= kicked;
		if (e->stop)
			continue;
		clock_gettime(CLOCK_MONOTONIC, &now);
		if (e->hold && ((e->cache_pending && now.tv_sec >= e->cache_last + e->cache_gap) ||
				now.tv_sec >= e->cache_next)) {
			struct timespec end;
			int64_t took;
			bool over;

			e->cache_pending = false;
			pthread_mutex_unlock(&e->lock);
			over = cache_pass(e);
			clock_gettime(CLOCK_MONOTONIC, &end);
			pthread_mutex_lock(&e->lock);
			/* a walk of a large store is not repeated every few seconds */
			took = (end.tv_sec - now.tv_sec) * 1000 + (end.tv_nsec - now.tv_nsec) / 1000000;
			e->cache_gap = CACHE_SHARE * took / 1000 > CACHE_PASS_S
					       ? CACHE_SHARE * took / 1000
					       : CACHE_PASS_S;
			e->cache_last = now.tv_sec;
			e->cache_next = now.tv_sec + (over ? e->cache_gap : CACHE_IDLE_S);
		}
		pthread_mutex_unlock(&e->lock);
		/*
		 * Over the capacity: a pass down to the low watermark. Tenants' own
		 * capacities need a scan to see: after PUTs (a kick), at most once a second.
		 */
		clock_gettime(CLOCK_MONOTONIC, &now);
		if (e->capacity && store_totals(e->store, &t) == 0 && t.stored_bytes > e->high) {
			pass(e, t.stored_bytes - e->low, NULL);
			e->last_quota_pass = now;
		} else if (kicked && tenants_quota_any(e->tenants) &&
			   now.tv_sec != e->last_quota_pass.tv_sec) {
			pass(e, 0, NULL);
			e->last_quota_pass = now;
		}
		pthread_mutex_lock(&e->lock);
	}
	pthread_mutex_unlock(&e->lock);
	return NULL;
}

int evictor_new(struct store *store, struct fuse_table *fuse, const struct tenants *tenants,
		uint64_t capacity, unsigned high_pct, unsigned low_pct, struct evictor **out)
{
	struct evictor *e = calloc(1, sizeof(*e));
	int rc;

	if (!e)
		return -ENOMEM;
	e->store = store;
	e->fuse = fuse;
	e->tenants = tenants;
	e->high_pct = high_pct;
	e->low_pct = low_pct;
	e->capacity = capacity;
	e->high = pct_of(capacity, high_pct);
	e->low = pct_of(capacity, low_pct);
	e->cache_gap = CACHE_PASS_S;
	e->n_buckets = 1024;
	e->buckets = calloc(e->n_buckets, sizeof(*e->buckets));
	pthread_mutex_init(&e->lock, NULL);
	pthread_mutex_init(&e->pass_lock, NULL);
	pthread_cond_init(&e->cond, NULL);
	if (!e->buckets) {
		evictor_free(&e);
		return -ENOMEM;
	}
	rc = pthread_create(&e->thread, NULL, evict_main, e);
	if (rc) {
		evictor_free(&e);
		return -rc;
	}
	e->started = true;
	*out = e;
	return 0;
}

void evictor_free(struct evictor **ep)
{
	struct evictor *e = ep ? *ep : NULL;

	if (!e)
		return;
	if (e->started) {
		pthread_mutex_lock(&e->lock);
		e->stop = true;
		pthread_cond_signal(&e->cond);
		pthread_mutex_unlock(&e->lock);
		pthread_join(e->thread, NULL);
	}
	for (size_t i = 0; e->buckets && i < e->n_buckets; i++)
		for (struct entry *x = e->buckets[i], *next; x; x = next) {
			next = x->next;
			free(x);
		}
	free(e->buckets);
	free(e->pins);
	pthread_cond_destroy(&e->cond);
	pthread_mutex_destroy(&e->pass_lock);
	pthread_mutex_destroy(&e->lock);
	free(e);
	*ep = NULL;
}

void evictor_set_owner(struct evictor *e, bool (*owns)(void *ctx, const uint8_t *hash),
		       void *ctx)
{
	pthread_mutex_lock(&e->pass_lock);
	e->owns = owns;
	e->owns_ctx = ctx;
	pthread_mutex_unlock(&e->pass_lock);
}

void evictor_stats(struct evictor *e, struct evict_stats *out)
{
	pthread_mutex_lock(&e->lock);
	pins_expire(e);
	*out = e->stats;
	out->pins = e->n_pins;
	pthread_mutex_unlock(&e->lock);
}
