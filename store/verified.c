/* verified — layer values verified since their pages were read; see verified.h. */
#include "store/verified.h"

#include <pthread.h>
#include <stdlib.h>
#include <sys/mman.h>
#include <time.h>
#include <unistd.h>

#define WAYS 4
#define SHARDS 16

struct entry {
	uint64_t fp;	  /* 0: empty */
	uint32_t epoch;
	uint32_t born;	  /* seconds on the monotonic clock */
};

struct shard {
	pthread_mutex_t lock;
};

struct st_verified {
	struct entry *e;	/* buckets * WAYS */
	size_t buckets;
	unsigned ttl_s;
	uint32_t epoch;		/* under every shard's lock to change; read under one */
	struct shard shard[SHARDS];
};

static uint32_t now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC_COARSE, &ts);
	return (uint32_t)ts.tv_sec;
}

struct st_verified *st_verified_new(size_t entries, unsigned ttl_s)
{
	struct st_verified *t = calloc(1, sizeof(*t));

	if (!t)
		return NULL;
	t->buckets = entries / WAYS ? entries / WAYS : 1;
	t->e = calloc(t->buckets * WAYS, sizeof(*t->e));
	if (!t->e) {
		free(t);
		return NULL;
	}
	t->ttl_s = ttl_s;
	t->epoch = 1;
	for (int i = 0; i < SHARDS; i++)
		pthread_mutex_init(&t->shard[i].lock, NULL);
	return t;
}

void st_verified_free(struct st_verified *t)
{
	if (!t)
		return;
	for (int i = 0; i < SHARDS; i++)
		pthread_mutex_destroy(&t->shard[i].lock);
	free(t->e);
	free(t);
}

bool st_resident(const void *p, size_t len)
{
	static long page;
	unsigned char vec[1024];
	uintptr_t a, end;

	if (!page)
		page = sysconf(_SC_PAGESIZE);
	a = (uintptr_t)p & ~(uintptr_t)(page - 1);
	end = (uintptr_t)p + len;
	while (a < end) {
		size_t n = (end - a + (size_t)page - 1) / (size_t)page;

		if (n > sizeof(vec))
			n = sizeof(vec);
		if (mincore((void *)a, n * (size_t)page, vec))
			return false;
		for (size_t i = 0; i < n; i++)
			if (!(vec[i] & 1))
				return false;
		a += n * (size_t)page;
	}
	return true;
}

static struct entry *bucket(struct st_verified *t, uint64_t fp, pthread_mutex_t **lock)
{
	size_t b = (size_t)(fp % t->buckets);

	*lock = &t->shard[b % SHARDS].lock;
	return &t->e[b * WAYS];
}

static bool live(const struct st_verified *t, const struct entry *e, uint32_t now)
{
	return e->fp && e->epoch == t->epoch && now - e->born < t->ttl_s;
}

bool st_verified_has(struct st_verified *t, uint64_t fp)
{
	pthread_mutex_t *lock;
	struct entry *b = bucket(t, fp | 1, &lock);
	uint32_t now = now_s();
	bool found = false;

	fp |= 1; /* never 0, the empty mark */
	pthread_mutex_lock(lock);
	for (int i = 0; i < WAYS && !found; i++)
		found = b[i].fp == fp && live(t, &b[i], now);
	pthread_mutex_unlock(lock);
	return found;
}

void st_verified_add(struct st_verified *t, uint64_t fp)
{
	pthread_mutex_t *lock;
	struct entry *b = bucket(t, fp | 1, &lock), *victim;
	uint32_t now = now_s();

	fp |= 1;
	pthread_mutex_lock(lock);
	victim = &b[0];
	for (int i = 0; i < WAYS; i++) {
		if (b[i].fp == fp || !live(t, &b[i], now)) {
			victim = &b[i];
			break;
		}
		if (b[i].born < victim->born)
			victim = &b[i];
	}
	*victim = (struct entry){ fp, t->epoch, now };
	pthread_mutex_unlock(lock);
}

void st_verified_drop(struct st_verified *t, uint64_t fp)
{
	pthread_mutex_t *lock;
	struct entry *b = bucket(t, fp | 1, &lock);

	fp |= 1;
	pthread_mutex_lock(lock);
	for (int i = 0; i < WAYS; i++)
		if (b[i].fp == fp)
			b[i].fp = 0;
	pthread_mutex_unlock(lock);
}

void st_verified_clear(struct st_verified *t)
{
	for (int i = 0; i < SHARDS; i++)
		pthread_mutex_lock(&t->shard[i].lock);
	t->epoch++;
	for (int i = SHARDS - 1; i >= 0; i--)
		pthread_mutex_unlock(&t->shard[i].lock);
}
