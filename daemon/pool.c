/* pool — helper threads for splitting bulk work; see pool.h. */
#include "daemon/pool.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdlib.h>

struct job {
	int (*fn)(void *arg, size_t i);
	void *arg;
	size_t n;
	atomic_size_t next; /* next index to hand out */
	size_t done;	    /* under the pool lock */
	unsigned active;    /* helpers inside drain(), under the pool lock */
	int rc;		    /* under the pool lock */
	struct job *link;
};

struct pool {
	pthread_mutex_t lock;
	pthread_cond_t work; /* a job was queued, or stop */
	pthread_cond_t idle; /* a job finished an index */
	struct job *head;
	bool stop;
	unsigned n;
	pthread_t *threads;
};

/* Take indices of j until none are left; count what was finished. */
static void drain(struct pool *p, struct job *j)
{
	size_t i;

	while ((i = atomic_fetch_add(&j->next, 1)) < j->n) {
		int rc = j->fn(j->arg, i);

		pthread_mutex_lock(&p->lock);
		if (rc && !j->rc)
			j->rc = rc;
		if (++j->done == j->n)
			pthread_cond_broadcast(&p->idle);
		pthread_mutex_unlock(&p->lock);
	}
}

static void unlink_job(struct pool *p, struct job *j)
{
	for (struct job **pp = &p->head; *pp; pp = &(*pp)->link)
		if (*pp == j) {
			*pp = j->link;
			break;
		}
}

static void *helper(void *arg)
{
	struct pool *p = arg;

	pthread_mutex_lock(&p->lock);
	while (!p->stop) {
		struct job *j = p->head;

		if (!j) {
			pthread_cond_wait(&p->work, &p->lock);
			continue;
		}
		if (atomic_load(&j->next) >= j->n) {
			/* All handed out: stop offering it; its owner waits for the rest. */
			unlink_job(p, j);
			continue;
		}
		/* The owner's stack holds j: it waits until no helper is inside. */
		j->active++;
		pthread_mutex_unlock(&p->lock);
		drain(p, j);
		pthread_mutex_lock(&p->lock);
		if (--j->active == 0)
			pthread_cond_broadcast(&p->idle);
	}
	pthread_mutex_unlock(&p->lock);
	return NULL;
}

int pool_new(unsigned n, struct pool **out)
{
	struct pool *p = calloc(1, sizeof(*p));
	sigset_t all, old;
	int rc = 0;

	if (!p)
		return -ENOMEM;
	pthread_mutex_init(&p->lock, NULL);
	pthread_cond_init(&p->work, NULL);
	pthread_cond_init(&p->idle, NULL);
	p->threads = calloc(n ? n : 1, sizeof(*p->threads));
	if (!p->threads) {
		pool_free(&p);
		return -ENOMEM;
	}
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	for (; p->n < n; p->n++) {
		rc = pthread_create(&p->threads[p->n], NULL, helper, p);
		if (rc)
			break;
	}
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc) {
		pool_free(&p);
		return -rc;
	}
	*out = p;
	return 0;
}

void pool_free(struct pool **pp)
{
	struct pool *p = pp ? *pp : NULL;

	if (!p)
		return;
	pthread_mutex_lock(&p->lock);
	p->stop = true;
	pthread_cond_broadcast(&p->work);
	pthread_mutex_unlock(&p->lock);
	for (unsigned i = 0; i < p->n; i++)
		pthread_join(p->threads[i], NULL);
	pthread_cond_destroy(&p->work);
	pthread_cond_destroy(&p->idle);
	pthread_mutex_destroy(&p->lock);
	free(p->threads);
	free(p);
	*pp = NULL;
}

int pool_run(struct pool *p, size_t n, int (*fn)(void *arg, size_t i), void *arg)
{
	struct job j = { .fn = fn, .arg = arg, .n = n };
	int rc;

	if (n == 0)
		return 0;
	atomic_init(&j.next, 0);
	if (n > 1 && p->n) {
		pthread_mutex_lock(&p->lock);
		j.link = p->head;
		p->head = &j;
		pthread_cond_broadcast(&p->work);
		pthread_mutex_unlock(&p->lock);
	}
	drain(p, &j);
	pthread_mutex_lock(&p->lock);
	unlink_job(p, &j);
	while (j.done < j.n || j.active)
		pthread_cond_wait(&p->idle, &p->lock);
	rc = j.rc;
	pthread_mutex_unlock(&p->lock);
	return rc;
}

unsigned pool_threads(const struct pool *p)
{
	return p ? p->n : 0;
}
