/* lane — a thread for costly requests, off the workers; see lane.h. */
#include "daemon/lane.h"

#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdlib.h>

#include "daemon/log.h"

struct job {
	zmq_msg_t frames[LANE_FRAMES];
	size_t n;
	struct job *next;
};

struct lane {
	void *zctx;
	const char *endpoint;
	lane_run_fn *run;
	void *ctx;
	unsigned max_waiting;
	pthread_t thread;
	bool started;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	struct job *head, *tail; /* lock */
	unsigned waiting;	 /* lock */
	unsigned long done;	 /* lock */
	bool stop;		 /* lock */
};

static void job_free(struct job *j)
{
	for (size_t i = 0; i < j->n; i++)
		zmq_msg_close(&j->frames[i]);
	free(j);
}

static void *lane_main(void *arg)
{
	struct lane *l = arg;
	void *sock = zmq_socket(l->zctx, ZMQ_PUSH);
	int linger = 0;

	if (!sock || zmq_setsockopt(sock, ZMQ_LINGER, &linger, sizeof(linger)) ||
	    zmq_connect(sock, l->endpoint)) {
		log_err("the lane for costly requests failed to start: %s", zmq_strerror(errno));
		if (sock)
			zmq_close(sock);
		sock = NULL;
	}
	pthread_mutex_lock(&l->lock);
	for (;;) {
		struct job *j;

		while (!l->stop && !l->head)
			pthread_cond_wait(&l->cond, &l->lock);
		if (l->stop)
			break;
		j = l->head;
		l->head = j->next;
		if (!l->head)
			l->tail = NULL;
		l->waiting--;
		pthread_mutex_unlock(&l->lock);
		if (sock) {
			l->run(l->ctx, sock, j->frames, j->n);
			j->n = 0; /* sent or closed by run */
		}
		job_free(j);
		pthread_mutex_lock(&l->lock);
		l->done++;
	}
	pthread_mutex_unlock(&l->lock);
	if (sock)
		zmq_close(sock);
	return NULL;
}

int lane_start(struct lane **out, void *zctx, const char *endpoint, lane_run_fn *run, void *ctx,
	       unsigned max_waiting)
{
	struct lane *l = calloc(1, sizeof(*l));
	sigset_t all, old;
	int rc;

	if (!l)
		return -ENOMEM;
	*l = (struct lane){ .zctx = zctx, .endpoint = endpoint, .run = run, .ctx = ctx,
			    .max_waiting = max_waiting };
	pthread_mutex_init(&l->lock, NULL);
	pthread_cond_init(&l->cond, NULL);
	/* no signals: the main loop handles them */
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	rc = -pthread_create(&l->thread, NULL, lane_main, l);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc) {
		lane_stop(&l);
		return rc;
	}
	l->started = true;
	*out = l;
	return 0;
}

int lane_submit(struct lane *l, zmq_msg_t *frames, size_t n)
{
	struct job *j;
	int rc = 0;

	if (n > LANE_FRAMES)
		return -E2BIG;
	j = calloc(1, sizeof(*j));
	if (!j)
		return -ENOMEM;
	pthread_mutex_lock(&l->lock);
	if (l->stop || l->waiting >= l->max_waiting) {
		rc = -EBUSY;
	} else {
		for (size_t i = 0; i < n; i++) {
			zmq_msg_init(&j->frames[i]);
			zmq_msg_move(&j->frames[i], &frames[i]);
		}
		j->n = n;
		if (l->tail)
			l->tail->next = j;
		else
			l->head = j;
		l->tail = j;
		l->waiting++;
		pthread_cond_signal(&l->cond);
	}
	pthread_mutex_unlock(&l->lock);
	if (rc)
		free(j);
	return rc;
}

void lane_counts(struct lane *l, unsigned *waiting, unsigned long *done)
{
	pthread_mutex_lock(&l->lock);
	*waiting = l->waiting;
	*done = l->done;
	pthread_mutex_unlock(&l->lock);
}

void lane_stop(struct lane **lp)
{
	struct lane *l = lp ? *lp : NULL;

	if (!l)
		return;
	pthread_mutex_lock(&l->lock);
	l->stop = true;
	pthread_cond_signal(&l->cond);
	pthread_mutex_unlock(&l->lock);
	if (l->started)
		pthread_join(l->thread, NULL);
	while (l->head) {
		struct job *j = l->head;

		l->head = j->next;
		job_free(j);
	}
	pthread_cond_destroy(&l->cond);
	pthread_mutex_destroy(&l->lock);
	free(l);
	*lp = NULL;
}
