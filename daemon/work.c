/* work — requests from the main thread to idle workers; see work.h. */
#include "daemon/work.h"

#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

struct item {
	struct item *next;
	size_t n;
	zmq_msg_t frames[]; /* the tag, then the request's frames */
};

struct work {
	pthread_mutex_t lock;
	pthread_cond_t more;
	struct item *head, *tail;
	size_t len, cap;
};

int work_new(size_t cap, struct work **out)
{
	struct work *w = calloc(1, sizeof(*w));
	pthread_condattr_t ca;

	if (!w)
		return -ENOMEM;
	w->cap = cap;
	pthread_mutex_init(&w->lock, NULL);
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&w->more, &ca);
	pthread_condattr_destroy(&ca);
	*out = w;
	return 0;
}

void work_free(struct work **wp)
{
	struct work *w = wp ? *wp : NULL;

	if (!w)
		return;
	while (w->head) {
		struct item *it = w->head;

		w->head = it->next;
		for (size_t i = 0; i < it->n; i++)
			zmq_msg_close(&it->frames[i]);
		free(it);
	}
	pthread_cond_destroy(&w->more);
	pthread_mutex_destroy(&w->lock);
	free(w);
	*wp = NULL;
}

bool work_full(struct work *w)
{
	bool full;

	pthread_mutex_lock(&w->lock);
	full = w->len >= w->cap;
	pthread_mutex_unlock(&w->lock);
	return full;
}

size_t work_len(struct work *w)
{
	size_t n;

	pthread_mutex_lock(&w->lock);
	n = w->len;
	pthread_mutex_unlock(&w->lock);
	return n;
}

int work_push(struct work *w, const void *tag, size_t tag_len, zmq_msg_t *frames, size_t n)
{
	struct item *it;

	if (work_full(w))
		return -ENOSPC;
	it = malloc(sizeof(*it) + (n + 1) * sizeof(zmq_msg_t));
	if (!it)
		return -ENOMEM;
	if (zmq_msg_init_size(&it->frames[0], tag_len)) {
		free(it);
		return -ENOMEM;
	}
	memcpy(zmq_msg_data(&it->frames[0]), tag, tag_len);
	for (size_t i = 0; i < n; i++) {
		zmq_msg_init(&it->frames[i + 1]);
		zmq_msg_move(&it->frames[i + 1], &frames[i]);
	}
	it->n = n + 1;
	it->next = NULL;
	pthread_mutex_lock(&w->lock);
	if (w->tail)
		w->tail->next = it;
	else
		w->head = it;
	w->tail = it;
	w->len++;
	pthread_cond_signal(&w->more);
	pthread_mutex_unlock(&w->lock);
	return 0;
}

size_t work_pop(struct work *w, zmq_msg_t *frames, size_t cap, int timeout_ms)
{
	struct timespec until;
	struct item *it;
	size_t n;

	clock_gettime(CLOCK_MONOTONIC, &until);
	until.tv_sec += timeout_ms / 1000;
	until.tv_nsec += (long)(timeout_ms % 1000) * 1000000;
	if (until.tv_nsec >= 1000000000) {
		until.tv_sec++;
		until.tv_nsec -= 1000000000;
	}
	pthread_mutex_lock(&w->lock);
	while (!w->head)
		if (pthread_cond_timedwait(&w->more, &w->lock, &until) == ETIMEDOUT)
			break;
	it = w->head;
	if (it) {
		w->head = it->next;
		if (!w->head)
			w->tail = NULL;
		w->len--;
	}
	pthread_mutex_unlock(&w->lock);
	if (!it)
		return 0;
	n = it->n < cap ? it->n : cap;
	for (size_t i = 0; i < it->n; i++) {
		if (i < n) {
			zmq_msg_init(&frames[i]);
			zmq_msg_move(&frames[i], &it->frames[i]);
		}
		zmq_msg_close(&it->frames[i]);
	}
	free(it);
	return n;
}
