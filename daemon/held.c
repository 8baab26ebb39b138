/* held — replies sent from the store's pages, and their deadline; see held.h. */
#include "daemon/held.h"

#include <inttypes.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <time.h>

#include "daemon/log.h"

static int64_t mono_ms(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

void held_init(struct held_replies *h)
{
	pthread_mutex_init(&h->lock, NULL);
	h->head.prev = h->head.next = &h->head;
	atomic_init(&h->count, 0);
	atomic_init(&h->cut, 0);
}

void held_destroy(struct held_replies *h)
{
	pthread_mutex_destroy(&h->lock);
}

/* The inode of socket fd, 0 when it is none (closed, or not a socket). */
static ino_t socket_ino(int fd)
{
	struct stat st;

	if (fd < 0 || fstat(fd, &st) || !S_ISSOCK(st.st_mode))
		return 0;
	return st.st_ino;
}

void held_add(struct held_replies *h, struct held_reply *r, int fd, const char *who)
{
	r->fd = fd;
	r->ino = socket_ino(fd);
	r->since_ms = mono_ms();
	r->cut = false;
	snprintf(r->who, sizeof(r->who), "%s", who ? who : "?");
	pthread_mutex_lock(&h->lock);
	r->prev = h->head.prev;
	r->next = &h->head;
	h->head.prev->next = r;
	h->head.prev = r;
	pthread_mutex_unlock(&h->lock);
	atomic_fetch_add(&h->count, 1);
}

void held_remove(struct held_replies *h, struct held_reply *r)
{
	if (!r->next)
		return;
	pthread_mutex_lock(&h->lock);
	r->prev->next = r->next;
	r->next->prev = r->prev;
	pthread_mutex_unlock(&h->lock);
	r->prev = r->next = NULL;
	atomic_fetch_sub(&h->count, 1);
}

static unsigned expire(struct held_replies *h, int64_t timeout_ms, bool for_room)
{
	int64_t now = mono_ms();
	unsigned n = 0;

	if (timeout_ms <= 0 || !atomic_load(&h->count))
		return 0;
	pthread_mutex_lock(&h->lock);
	/* oldest first: stop at the first reply within its deadline */
	for (struct held_reply *r = h->head.next; r != &h->head && now - r->since_ms > timeout_ms;
	     r = r->next) {
		if (r->cut || !r->ino)
			continue;
		r->cut = true;
		/* a connection that ended meanwhile may have left its number to another */
		if (socket_ino(r->fd) != r->ino)
			continue;
		shutdown(r->fd, SHUT_RDWR);
		for (struct held_reply *o = r->next; o != &h->head; o = o->next)
			if (o->ino == r->ino) /* its other replies go with it */
				o->cut = true;
		n++;
		atomic_fetch_add(&h->cut, 1);
		if (for_room)
			log_warn("client %s left a reply from the store's pages unread for %"
				 PRId64 " ms while the store's map is full: its connection is "
				 "closed, since the reply's snapshot keeps freed pages from reuse",
				 r->who, now - r->since_ms);
		else
			log_warn("client %s left a reply from the store's pages unread for %"
				 PRId64 " ms (reply_timeout_ms %" PRId64 "): its connection is "
				 "closed, since the reply holds a snapshot that keeps freed pages "
				 "of the store from reuse", r->who, now - r->since_ms, timeout_ms);
	}
	pthread_mutex_unlock(&h->lock);
	return n;
}

unsigned held_expire(struct held_replies *h, int64_t timeout_ms)
{
	return expire(h, timeout_ms, false);
}

unsigned held_expire_for_room(struct held_replies *h, int64_t timeout_ms, int64_t wait_ms)
{
	unsigned n = expire(h, timeout_ms, true);

	/* ZeroMQ drops what it queued for a shut connection on its own thread: give it a
	 * moment to end the snapshots */
	for (int64_t t0 = mono_ms(); n && atomic_load(&h->count) && mono_ms() - t0 < wait_ms;) {
		struct timespec nap = { 0, 5 * 1000000 };

		nanosleep(&nap, NULL);
	}
	return n;
}
