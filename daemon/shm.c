/* shm — client shared-memory segments; see shm.h. */
#include "shm.h"

#include <dirent.h>
#include <errno.h>
#include <signal.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#define SHM_SLOTS 256

struct segment {
	uint64_t id; /* 0: slot free */
	char name[64];
	void *base;
	uint64_t size;
	unsigned users;
	bool unlinked;
	bool detached;
	bool reusable; /* a fuse ring: kept, named, for the next session when released */
	bool cached;   /* idle in the reuse cache */
	time_t last_used;
};

struct shm_table {
	pthread_mutex_t lock;
	struct segment seg[SHM_SLOTS];
	uint64_t max_one, max_total, total, idle_s, counter;
	unsigned mode;
	bool closing;
};

static time_t now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec;
}

/* Segments left by a kvblendd that died without cleaning up: its pid is in the name. */
static void sweep_stale(void)
{
	DIR *d = opendir("/dev/shm");
	struct dirent *e;

	if (!d)
		return;
	while ((e = readdir(d))) {
		int pid;
		char path[300];

		if (sscanf(e->d_name, "kvblend-%d-", &pid) != 1 || pid <= 0)
			continue;
		if (kill(pid, 0) == 0 || errno != ESRCH)
			continue;
		snprintf(path, sizeof(path), "/%s", e->d_name);
		shm_unlink(path);
	}
	closedir(d);
}

int shm_table_new(uint64_t max_one, uint64_t max_total, uint64_t idle_s, unsigned mode,
		  struct shm_table **out)
{
	struct shm_table *t = calloc(1, sizeof(*t));

	sweep_stale();
	if (!t)
		return -ENOMEM;
	pthread_mutex_init(&t->lock, NULL);
	t->max_one = max_one;
	t->max_total = max_total;
	t->idle_s = idle_s;
	t->mode = mode;
	*out = t;
	return 0;
}

static void seg_unlink(struct segment *s)
{
	if (!s->unlinked) {
		shm_unlink(s->name);
		s->unlinked = true;
	}
}

#define CACHE_MAX 8

/* Called with the lock held, once no request uses the segment. */
static void seg_destroy(struct shm_table *t, struct segment *s)
{
	unsigned cached = 0;

	for (int i = 0; i < SHM_SLOTS; i++)
		cached += t->seg[i].id && t->seg[i].cached;
	/* A released ring goes to the cache: its pages are already faulted in, and a new
	 * segment of that size would cost a page fault and a zeroed page per 4 KiB. */
	if (s->reusable && !s->cached && cached < CACHE_MAX && !t->closing) {
		s->cached = true;
		s->detached = true;
		s->last_used = now_s();
		return;
	}
	seg_unlink(s);
	munmap(s->base, s->size);
	t->total -= s->size;
	memset(s, 0, sizeof(*s));
}

void shm_table_free(struct shm_table **tp)
{
	struct shm_table *t = tp ? *tp : NULL;

	if (!t)
		return;
	t->closing = true;
	for (int i = 0; i < SHM_SLOTS; i++)
		if (t->seg[i].id)
			seg_destroy(t, &t->seg[i]);
	pthread_mutex_destroy(&t->lock);
	free(t);
	*tp = NULL;
}

static struct segment *find(struct shm_table *t, uint64_t id)
{
	for (int i = 0; i < SHM_SLOTS; i++)
		if (id && t->seg[i].id == id && !t->seg[i].detached)
			return &t->seg[i];
	return NULL;
}

/*
 * A new segment id (lock held): random, so that an id from before a restart, or
 * another client's, names nothing here; a stale request then fails cleanly
 * instead of reaching someone else's memory.
 */
static uint64_t new_segment_id(struct shm_table *t)
{
	for (;;) {
		uint64_t id = 0;
		bool used = false;

		if (getrandom(&id, sizeof(id), 0) != sizeof(id))
			id = ++t->counter * 0x9e3779b97f4a7c15ull ^ (uint64_t)now_s();
		for (int i = 0; i < SHM_SLOTS && !used; i++)
			used = t->seg[i].id == id;
		if (id && id != UINT64_MAX && !used)
			return id;
	}
}

/* Drop cached rings until size more bytes fit (lock held). */
static void cache_make_room(struct shm_table *t, uint64_t size)
{
	for (int i = 0; i < SHM_SLOTS && t->total + size > t->max_total; i++)
		if (t->seg[i].id && t->seg[i].cached) {
			t->seg[i].reusable = false;
			seg_destroy(t, &t->seg[i]);
		}
}

static int create(struct shm_table *t, uint64_t size, bool reusable, uint64_t *id, char *name,
		  size_t name_len, uint64_t *actual)
{
	struct segment *s = NULL;
	uint64_t rnd = 0, new_id;
	void *base;
	char nm[64];
	int fd, rc = 0;

	if (size == 0 || size > t->max_one)
		return -E2BIG;
	pthread_mutex_lock(&t->lock);
	if (reusable) {
		/* A cached ring of this size, or up to twice it, is used as it is. */
		for (int i = 0; i < SHM_SLOTS; i++) {
			struct segment *c = &t->seg[i];

			if (!c->id || !c->cached || c->size < size || c->size > 2 * size)
				continue;
			c->cached = false;
			c->detached = false;
			c->users = 0;
			c->id = new_segment_id(t);
			c->last_used = now_s();
			*id = c->id;
			*actual = c->size;
			snprintf(name, name_len, "%s", c->name);
			pthread_mutex_unlock(&t->lock);
			return 0;
		}
	}
	cache_make_room(t, size);
	if (t->max_total == 0 || t->total + size > t->max_total)
		rc = -ENOSPC;
	for (int i = 0; i < SHM_SLOTS && !rc && !s; i++)
		if (!t->seg[i].id)
			s = &t->seg[i];
	if (!rc && !s)
		rc = -ENOSPC;
	if (!rc) {
		t->total += size; /* reserve while we create outside the lock */
		s->id = UINT64_MAX; /* slot taken, not yet findable */
		s->detached = true;
		new_id = new_segment_id(t);
	}
	pthread_mutex_unlock(&t->lock);
	if (rc)
		return rc;
	/* The name is unguessable so that another local user cannot map it first. */
	if (getrandom(&rnd, sizeof(rnd), 0) != sizeof(rnd))
		rnd = (uint64_t)now_s() * 2654435761u;
	snprintf(nm, sizeof(nm), "/kvblend-%d-%llu-%016llx", (int)getpid(),
		 (unsigned long long)new_id, (unsigned long long)rnd);
	fd = shm_open(nm, O_CREAT | O_EXCL | O_RDWR, 0600);
	if (fd < 0) {
		rc = -errno;
		goto fail;
	}
	if (fchmod(fd, t->mode & 0666) || ftruncate(fd, (off_t)size)) {
		rc = -errno;
		close(fd);
		shm_unlink(nm);
		goto fail;
	}
	base = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (base == MAP_FAILED) {
		rc = -errno;
		shm_unlink(nm);
		goto fail;
	}
	pthread_mutex_lock(&t->lock);
	snprintf(s->name, sizeof(s->name), "%s", nm);
	s->base = base;
	s->size = size;
	s->users = 0;
	s->unlinked = false;
	s->detached = false;
	s->last_used = now_s();
	s->reusable = reusable;
	s->cached = false;
	s->id = new_id;
	pthread_mutex_unlock(&t->lock);
	*id = new_id;
	*actual = size;
	snprintf(name, name_len, "%s", nm);
	return 0;
fail:
	pthread_mutex_lock(&t->lock);
	t->total -= size;
	memset(s, 0, sizeof(*s));
	pthread_mutex_unlock(&t->lock);
	return rc;
}

int shm_create(struct shm_table *t, uint64_t size, uint64_t *id, char *name, size_t name_len)
{
	uint64_t actual;

	return create(t, size, false, id, name, name_len, &actual);
}

int shm_create_ring(struct shm_table *t, uint64_t size, uint64_t *id, char *name, size_t name_len,
		    uint64_t *actual)
{
	return create(t, size, true, id, name, name_len, actual);
}

int shm_acquire(struct shm_table *t, uint64_t id, uint64_t offset, uint64_t length, void **addr)
{
	struct segment *s;
	int rc = 0;

	pthread_mutex_lock(&t->lock);
	s = find(t, id);
	if (!s)
		rc = -ENOENT;
	else if (offset > s->size || length > s->size - offset)
		rc = -ERANGE;
	if (!rc) {
		/* The client has mapped it if it uses it: the name can go. */
		seg_unlink(s);
		s->users++;
		s->last_used = now_s();
		*addr = (uint8_t *)s->base + offset;
	}
	pthread_mutex_unlock(&t->lock);
	return rc;
}

int shm_hold(struct shm_table *t, uint64_t id, void **base)
{
	struct segment *s;

	pthread_mutex_lock(&t->lock);
	s = find(t, id);
	if (s) {
		s->users++;
		*base = s->base;
	}
	pthread_mutex_unlock(&t->lock);
	return s ? 0 : -ENOENT;
}

void shm_release(struct shm_table *t, uint64_t id)
{
	pthread_mutex_lock(&t->lock);
	for (int i = 0; i < SHM_SLOTS; i++) {
		struct segment *s = &t->seg[i];

		if (s->id != id)
			continue;
		s->users--;
		s->last_used = now_s();
		if (!s->users && s->detached)
			seg_destroy(t, s);
		break;
	}
	pthread_mutex_unlock(&t->lock);
}

int shm_detach(struct shm_table *t, uint64_t id)
{
	struct segment *s;

	pthread_mutex_lock(&t->lock);
	s = find(t, id);
	if (s) {
		s->detached = true;
		if (!s->users)
			seg_destroy(t, s);
	}
	pthread_mutex_unlock(&t->lock);
	return s ? 0 : -ENOENT;
}

unsigned shm_expire(struct shm_table *t)
{
	time_t now = now_s();
	unsigned n = 0;

	pthread_mutex_lock(&t->lock);
	for (int i = 0; i < SHM_SLOTS; i++) {
		struct segment *s = &t->seg[i];

		if (!s->id || s->users || (uint64_t)(now - s->last_used) < t->idle_s ||
		    (s->detached && !s->cached))
			continue;
		s->reusable = false; /* idle too long: really free it */
		s->detached = true;
		seg_destroy(t, s);
		n++;
	}
	pthread_mutex_unlock(&t->lock);
	return n;
}

void shm_usage(struct shm_table *t, uint64_t *count, uint64_t *bytes)
{
	uint64_t n = 0;

	pthread_mutex_lock(&t->lock);
	for (int i = 0; i < SHM_SLOTS; i++)
		n += t->seg[i].id && !t->seg[i].detached && !t->seg[i].cached;
	*count = n;
	*bytes = t->total;
	pthread_mutex_unlock(&t->lock);
}
