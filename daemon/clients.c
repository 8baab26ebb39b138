/* clients — per-client byte accounting; see clients.h. */
#include "daemon/clients.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#define BUCKETS 256

struct client_acct {
	struct client_acct *next;
	unsigned refs; /* under the table lock */
	uint64_t held; /* under the table lock */
	char principal[];
};

struct clients {
	pthread_mutex_t lock;
	uint64_t total_max, per_client, held, n;
	struct client_acct *bucket[BUCKETS];
};

static unsigned hash_of(const char *s)
{
	uint32_t h = 2166136261u;

	for (; *s; s++)
		h = (h ^ (uint8_t)*s) * 16777619u;
	return h % BUCKETS;
}

int clients_new(uint64_t total, uint64_t per_client, struct clients **out)
{
	struct clients *t = calloc(1, sizeof(*t));

	if (!t)
		return -ENOMEM;
	pthread_mutex_init(&t->lock, NULL);
	t->total_max = total;
	t->per_client = per_client;
	*out = t;
	return 0;
}

void clients_free(struct clients **tp)
{
	struct clients *t = tp ? *tp : NULL;

	if (!t)
		return;
	for (unsigned i = 0; i < BUCKETS; i++)
		while (t->bucket[i]) {
			struct client_acct *a = t->bucket[i];

			t->bucket[i] = a->next;
			free(a);
		}
	pthread_mutex_destroy(&t->lock);
	free(t);
	*tp = NULL;
}

struct client_acct *clients_get(struct clients *t, const char *principal)
{
	unsigned h = hash_of(principal);
	struct client_acct *a;

	pthread_mutex_lock(&t->lock);
	for (a = t->bucket[h]; a; a = a->next)
		if (!strcmp(a->principal, principal))
			break;
	if (!a) {
		size_t len = strlen(principal) + 1;

		a = calloc(1, sizeof(*a) + len);
		if (a) {
			memcpy(a->principal, principal, len);
			a->next = t->bucket[h];
			t->bucket[h] = a;
			t->n++;
		}
	}
	if (a)
		a->refs++;
	pthread_mutex_unlock(&t->lock);
	return a;
}

void clients_ref(struct clients *t, struct client_acct *a)
{
	pthread_mutex_lock(&t->lock);
	a->refs++;
	pthread_mutex_unlock(&t->lock);
}

void clients_put(struct clients *t, struct client_acct *a)
{
	if (!a)
		return;
	pthread_mutex_lock(&t->lock);
	if (--a->refs == 0) {
		struct client_acct **p = &t->bucket[hash_of(a->principal)];

		while (*p != a)
			p = &(*p)->next;
		*p = a->next;
		t->n--;
		free(a);
	}
	pthread_mutex_unlock(&t->lock);
}

int clients_reserve(struct clients *t, struct client_acct *a, uint64_t bytes)
{
	return clients_reserve_more(t, a, bytes, 0);
}

int clients_reserve_more(struct clients *t, struct client_acct *a, uint64_t bytes,
			 uint64_t own)
{
	int rc = 0;

	pthread_mutex_lock(&t->lock);
	if (t->held > own &&
	    bytes > t->total_max - (t->held < t->total_max ? t->held : t->total_max))
		rc = -ENOBUFS;
	else if (a->held > own && bytes > t->per_client - (a->held < t->per_client
								   ? a->held
								   : t->per_client))
		rc = -EDQUOT;
	if (!rc) {
		a->held += bytes;
		t->held += bytes;
	}
	pthread_mutex_unlock(&t->lock);
	return rc;
}

void clients_release(struct clients *t, struct client_acct *a, uint64_t bytes)
{
	pthread_mutex_lock(&t->lock);
	a->held -= bytes < a->held ? bytes : a->held;
	t->held -= bytes < t->held ? bytes : t->held;
	pthread_mutex_unlock(&t->lock);
}

uint64_t clients_held(const struct client_acct *a)
{
	return __atomic_load_n(&a->held, __ATOMIC_RELAXED);
}

void clients_usage(struct clients *t, uint64_t *bytes, uint64_t *n_clients)
{
	pthread_mutex_lock(&t->lock);
	*bytes = t->held;
	*n_clients = t->n;
	pthread_mutex_unlock(&t->lock);
}
