/*
 * loader — the fuse engine's background thread (fuse.h fuse_loader_start): it loads
 * ahead into rings and lands into nodes' buffers for the sessions the workers kick
 * after their replies, a layer a turn, landing sessions taking turns; and once a
 * second it frees idle sessions (fuse_expire), off the threads that serve sockets.
 */
#include <pthread.h>
#include <signal.h>
#include <stdlib.h>
#include <time.h>

#include "daemon/fuse/fuse_impl.h"

struct fuse_loader {
	struct fuse_table *t;
	pthread_t thread;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	uint64_t *queue; /* sessions to work for, cap slots from head */
	unsigned head, len, cap;
	bool stop;
};

/* Queue id unless queued already. Room for every session at once: none is dropped. */
static void loader_queue(struct fuse_loader *l, uint64_t id)
{
	pthread_mutex_lock(&l->lock);
	for (unsigned i = 0; i < l->len; i++)
		if (l->queue[(l->head + i) % l->cap] == id)
			goto out;
	if (l->len < l->cap) {
		l->queue[(l->head + l->len) % l->cap] = id;
		l->len++;
		pthread_cond_signal(&l->cond);
	}
out:
	pthread_mutex_unlock(&l->lock);
}

static void *loader_main(void *arg)
{
	struct fuse_loader *l = arg;
	struct timespec last = { 0 }, now;

	pthread_mutex_lock(&l->lock);
	while (!l->stop) {
		uint64_t id;

		/*
		 * Idle sessions expire here, not on the main thread: freeing a session waits
		 * for its device work and gives device memory back, which stalls the device
		 * and would stall every socket with it.
		 */
		clock_gettime(CLOCK_MONOTONIC, &now);
		if (now.tv_sec != last.tv_sec) {
			pthread_mutex_unlock(&l->lock);
			fuse_expire(l->t);
			pthread_mutex_lock(&l->lock);
			last = now;
			continue;
		}
		if (!l->len) {
			struct timespec until;

			clock_gettime(CLOCK_REALTIME, &until);
			until.tv_sec += 1;
			pthread_cond_timedwait(&l->cond, &l->lock, &until);
			continue;
		}
		id = l->queue[l->head];
		l->head = (l->head + 1) % l->cap;
		l->len--;
		pthread_mutex_unlock(&l->lock);
		/* A landing session with layers left goes to the back: sessions take turns. */
		if (fuse_prefetch(l->t, id))
			loader_queue(l, id);
		pthread_mutex_lock(&l->lock);
	}
	pthread_mutex_unlock(&l->lock);
	return NULL;
}

int fuse_loader_start(struct fuse_table *t)
{
	struct fuse_loader *l;
	sigset_t all, old;
	int rc;

	if (t->loader)
		return -EALREADY;
	l = calloc(1, sizeof(*l));
	if (!l)
		return -ENOMEM;
	l->t = t;
	l->cap = (unsigned)t->lim.max_sessions + 1;
	l->queue = calloc(l->cap, sizeof(*l->queue));
	if (!l->queue) {
		free(l);
		return -ENOMEM;
	}
	pthread_mutex_init(&l->lock, NULL);
	pthread_cond_init(&l->cond, NULL);
	/* the loader takes no signals: the main loop handles them */
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	rc = -pthread_create(&l->thread, NULL, loader_main, l);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc) {
		pthread_cond_destroy(&l->cond);
		pthread_mutex_destroy(&l->lock);
		free(l->queue);
		free(l);
		return rc;
	}
	t->loader = l;
	return 0;
}

void fuse_kick(struct fuse_table *t, uint64_t id)
{
	if (t && t->loader && id)
		loader_queue(t->loader, id);
}

void fuse_loader_stop(struct fuse_table *t)
{
	struct fuse_loader *l = t ? t->loader : NULL;

	if (!l)
		return;
	pthread_mutex_lock(&l->lock);
	l->stop = true;
	pthread_cond_signal(&l->cond);
	pthread_mutex_unlock(&l->lock);
	pthread_join(l->thread, NULL);
	pthread_cond_destroy(&l->cond);
	pthread_mutex_destroy(&l->lock);
	free(l->queue);
	free(l);
	t->loader = NULL;
}
