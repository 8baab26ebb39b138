/* shm — client shared-memory segments; see shm.h. */
#include "daemon/shm.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

#include "proto/wire.h"

#define SHM_SLOTS 256
#define CACHE_MAX 8
/* A descriptor request is 8 bytes: a client that sends less within this is dropped. */
#define SERVE_TIMEOUT_MS 1000
/* What clients hand in (shm_deposit_take), all together and of one owner. */
#define DEPOSITS_MAX 64
#define DEPOSITS_PER_OWNER 16

/*
 * Memory a client handed in over the socket: one to SHM_DEPOSIT_SEGMENTS_MAX
 * descriptors, each placed at its offset of the memory's extent, kept while the
 * client's process lives.
 */
struct deposit {
	uint64_t token; /* 0: slot free */
	unsigned n;
	struct shm_fd_seg *segs; /* [n], their fds the table's */
	int pidfd; /* the depositing process: readable once it has exited */
	char owner[SHM_OWNER_MAX];
};

static void deposit_free(struct deposit *d);

struct segment {
	uint64_t id; /* 0: slot free */
	int fd;	     /* the sealed memfd, passed to the owner */
	void *base;
	uint64_t size;
	unsigned users;
	bool ring;     /* a fuse ring: the daemon's, kept for the owner's next session */
	bool detached; /* released: unmapped once users drop to 0 */
	bool cached;   /* a released ring, idle in the reuse cache */
	bool pinned;   /* pinned in place by the pinner (shm_pin) */
	bool pinning;  /* a shm_pin() is pinning it now */
	bool retired;  /* released while pinned: shm_reap() unpins and unmaps it */
	char owner[SHM_OWNER_MAX];
	time_t last_used;
};

struct shm_table {
	pthread_mutex_t lock;
	struct segment seg[SHM_SLOTS];
	uint64_t max_one, max_total, total, idle_s, counter;
	unsigned per_owner;
	bool closing;
	struct shm_pinner pinner;
	bool has_pinner;
	uint64_t pins, unpins;
	struct deposit dep[DEPOSITS_MAX];
	/* descriptor server */
	int listen_fd;
	char path[sizeof(((struct sockaddr_un *)0)->sun_path)];
	pthread_t thread;
	bool serving;
	atomic_bool stop;
};

static time_t now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec;
}

/*
 * The span a segment of size bytes takes in the daemon's address space: its pages with
 * a PROT_NONE guard page below and above, so that a write outside a layout (a bug, or a
 * check that missed a wrap) faults instead of landing in the neighbouring client's
 * segment (tests/integration/test_land.c, test_hostile.c).
 */
static size_t guarded_span(uint64_t size)
{
	size_t page = (size_t)sysconf(_SC_PAGESIZE);

	return ((size_t)size + page - 1) / page * page + 2 * page;
}

static void unmap_guarded(void *base, uint64_t size)
{
	size_t page = (size_t)sysconf(_SC_PAGESIZE);

	munmap((uint8_t *)base - page, guarded_span(size));
}

int shm_table_new(uint64_t max_one, uint64_t max_total, uint64_t idle_s, unsigned per_owner,
		  struct shm_table **out)
{
	struct shm_table *t = calloc(1, sizeof(*t));

	if (!t)
		return -ENOMEM;
	pthread_mutex_init(&t->lock, NULL);
	t->max_one = max_one;
	t->max_total = max_total;
	t->idle_s = idle_s;
	t->per_owner = per_owner;
	t->listen_fd = -1;
	*out = t;
	return 0;
}

/* Called with the lock held, once no request uses the segment. */
static void seg_destroy(struct shm_table *t, struct segment *s)
{
	unsigned cached = 0;

	for (int i = 0; i < SHM_SLOTS; i++)
		cached += t->seg[i].id && t->seg[i].cached;
	/* A released ring goes to the cache: its pages are already faulted in, and a new
	 * segment of that size would cost a page fault and a zeroed page per 4 KiB. */
	if (s->ring && !s->cached && cached < CACHE_MAX && !t->closing) {
		s->cached = true;
		s->detached = true;
		s->last_used = now_s();
		return;
	}
	if (s->pinned && t->has_pinner && !t->closing) {
		/* Unpinning stalls the device, and this may be the thread that serves
		 * sockets: shm_reap() unpins and unmaps it. The slot stays taken till then. */
		s->retired = true;
		s->id = UINT64_MAX;
		s->detached = true;
		s->cached = false;
		s->ring = false;
		t->total -= s->size;
		return;
	}
	if (s->pinned && t->has_pinner) {
		t->pinner.unpin(t->pinner.ctx, s->base);
		t->unpins++;
	}
	unmap_guarded(s->base, s->size);
	close(s->fd);
	t->total -= s->size;
	memset(s, 0, sizeof(*s));
}

void shm_table_free(struct shm_table **tp)
{
	struct shm_table *t = tp ? *tp : NULL;

	if (!t)
		return;
	if (t->serving) {
		atomic_store(&t->stop, true);
		pthread_join(t->thread, NULL);
	}
	if (t->listen_fd >= 0) {
		close(t->listen_fd);
		unlink(t->path);
	}
	shm_reap(t);
	t->closing = true;
	for (int i = 0; i < SHM_SLOTS; i++)
		if (t->seg[i].id && t->seg[i].id != UINT64_MAX)
			seg_destroy(t, &t->seg[i]);
	for (int i = 0; i < DEPOSITS_MAX; i++)
		deposit_free(&t->dep[i]);
	pthread_mutex_destroy(&t->lock);
	free(t);
	*tp = NULL;
}

/* A live segment (not released, not being created) by id. */
static struct segment *find(struct shm_table *t, uint64_t id)
{
	for (int i = 0; i < SHM_SLOTS; i++)
		if (id && id != UINT64_MAX && t->seg[i].id == id && !t->seg[i].detached)
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
			t->seg[i].ring = false;
			seg_destroy(t, &t->seg[i]);
		}
}

static struct segment *free_slot(struct shm_table *t)
{
	for (int i = 0; i < SHM_SLOTS; i++)
		if (!t->seg[i].id)
			return &t->seg[i];
	/* every slot in use: a cached ring gives its slot up (a pinned one only once
	 * shm_reap() unmapped it) */
	for (int i = 0; i < SHM_SLOTS; i++)
		if (t->seg[i].cached) {
			t->seg[i].ring = false;
			seg_destroy(t, &t->seg[i]);
			if (!t->seg[i].id)
				return &t->seg[i];
		}
	return NULL;
}

/* A sealed memfd of size bytes, mapped between guard pages. */
static int make_memfd(uint64_t size, int *fd_out, void **base_out)
{
	int fd = memfd_create("kvblend", MFD_CLOEXEC | MFD_ALLOW_SEALING), rc = 0;
	size_t page = (size_t)sysconf(_SC_PAGESIZE);
	void *span, *base;

	if (fd < 0)
		return -errno;
	if (ftruncate(fd, (off_t)size) ||
	    fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL)) {
		rc = -errno;
		close(fd);
		return rc;
	}
	span = mmap(NULL, guarded_span(size), PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS |
		    MAP_NORESERVE, -1, 0);
	if (span == MAP_FAILED) {
		rc = -errno;
		close(fd);
		return rc;
	}
	base = mmap((uint8_t *)span + page, size, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED,
		    fd, 0);
	if (base == MAP_FAILED) {
		rc = -errno;
		munmap(span, guarded_span(size));
		close(fd);
		return rc;
	}
	*fd_out = fd;
	*base_out = base;
	return 0;
}

static int create(struct shm_table *t, uint64_t size, bool ring, const char *owner, uint64_t *id,
		  uint64_t *actual)
{
	struct segment *s = NULL;
	unsigned held = 0;
	uint64_t new_id = 0;
	void *base = NULL;
	int fd = -1, rc = 0;

	if (size == 0 || size > t->max_one)
		return -E2BIG;
	pthread_mutex_lock(&t->lock);
	if (ring) {
		/* A cached ring of this owner and size, or up to twice it, is used as it is. */
		for (int i = 0; i < SHM_SLOTS; i++) {
			struct segment *c = &t->seg[i];

			if (!c->id || !c->cached || c->size < size || c->size > 2 * size ||
			    strcmp(c->owner, owner))
				continue;
			c->cached = false;
			c->detached = false;
			c->users = 0;
			c->id = new_segment_id(t);
			c->last_used = now_s();
			*id = c->id;
			*actual = c->size;
			pthread_mutex_unlock(&t->lock);
			return 0;
		}
	} else {
		for (int i = 0; i < SHM_SLOTS; i++)
			held += t->seg[i].id && !t->seg[i].ring && !t->seg[i].detached &&
				!strcmp(t->seg[i].owner, owner);
		if (held >= t->per_owner)
			rc = -EDQUOT;
	}
	if (!rc) {
		cache_make_room(t, size);
		if (t->max_total == 0 || t->total + size > t->max_total)
			rc = -ENOSPC;
	}
	if (!rc && !(s = free_slot(t)))
		rc = -EMFILE;
	if (!rc) {
		t->total += size; /* reserve while we create outside the lock */
		s->id = UINT64_MAX; /* slot taken, not yet findable */
		s->detached = true;
		new_id = new_segment_id(t);
	}
	pthread_mutex_unlock(&t->lock);
	if (rc)
		return rc;
	rc = make_memfd(size, &fd, &base);
	pthread_mutex_lock(&t->lock);
	if (rc) {
		t->total -= size;
		memset(s, 0, sizeof(*s));
	} else {
		s->fd = fd;
		s->base = base;
		s->size = size;
		s->users = 0;
		s->detached = false;
		s->last_used = now_s();
		s->ring = ring;
		s->cached = false;
		snprintf(s->owner, sizeof(s->owner), "%s", owner);
		s->id = new_id;
		*id = new_id;
		*actual = size;
	}
	pthread_mutex_unlock(&t->lock);
	return rc;
}

int shm_create(struct shm_table *t, uint64_t size, const char *owner, uint64_t *id)
{
	uint64_t actual;

	return create(t, size, false, owner, id, &actual);
}

int shm_create_ring(struct shm_table *t, uint64_t size, const char *owner, uint64_t *id,
		    uint64_t *actual)
{
	return create(t, size, true, owner, id, actual);
}

int shm_acquire(struct shm_table *t, uint64_t id, const char *owner, uint64_t offset,
		uint64_t length, void **addr)
{
	struct segment *s;
	int rc = 0;

	pthread_mutex_lock(&t->lock);
	s = find(t, id);
	if (!s || s->ring || strcmp(s->owner, owner))
		rc = -ENOENT;
	else if (offset > s->size || length > s->size - offset)
		rc = -ERANGE;
	if (!rc) {
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

		if (s->id != id || s->cached)
			continue;
		s->users--;
		s->last_used = now_s();
		if (!s->users && s->detached)
			seg_destroy(t, s);
		break;
	}
	pthread_mutex_unlock(&t->lock);
}

int shm_detach(struct shm_table *t, uint64_t id, const char *owner)
{
	struct segment *s;

	pthread_mutex_lock(&t->lock);
	s = find(t, id);
	if (s && owner && (s->ring || strcmp(s->owner, owner)))
		s = NULL;
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

		if (!s->id || s->id == UINT64_MAX || s->users ||
		    (uint64_t)(now - s->last_used) < t->idle_s || (s->detached && !s->cached))
			continue;
		s->ring = false; /* idle too long: really free it */
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

/* ---- descriptor server ---- */

/* A duplicate of segment id's descriptor when peer is its owner, else -ENOENT. */
static int owner_fd(struct shm_table *t, uint64_t id, const char *peer)
{
	struct segment *s;
	int fd = -ENOENT;

	pthread_mutex_lock(&t->lock);
	s = find(t, id);
	if (s && !strcmp(s->owner, peer)) {
		fd = fcntl(s->fd, F_DUPFD_CLOEXEC, 0);
		if (fd < 0)
			fd = -errno;
		s->last_used = now_s();
	}
	pthread_mutex_unlock(&t->lock);
	return fd;
}

/* With t->lock held: free slot d (its descriptors closed). */
static void deposit_free(struct deposit *d)
{
	for (unsigned k = 0; k < d->n; k++)
		close(d->segs[k].fd);
	free(d->segs);
	if (d->token)
		close(d->pidfd);
	memset(d, 0, sizeof(*d));
}

/* With t->lock held: forget the deposits of processes that have exited. */
static void deposits_reap(struct shm_table *t)
{
	for (int i = 0; i < DEPOSITS_MAX; i++) {
		struct deposit *d = &t->dep[i];
		struct pollfd p = { d->pidfd, POLLIN, 0 };

		if (d->token && poll(&p, 1, 0) > 0)
			deposit_free(d);
	}
}

/* Whether a and b (n each) are the same files at the same places. */
static bool same_segments(const struct shm_fd_seg *a, const struct shm_fd_seg *b, unsigned n)
{
	for (unsigned k = 0; k < n; k++) {
		struct stat x, y;

		if (a[k].offset != b[k].offset || a[k].size != b[k].size || fstat(a[k].fd, &x) ||
		    fstat(b[k].fd, &y) || x.st_dev != y.st_dev || x.st_ino != y.st_ino)
			return false;
	}
	return true;
}

/* With t->lock held: whether fd is one of the daemon's own segments. */
static bool own_segment(struct shm_table *t, int fd)
{
	struct stat st;

	if (fstat(fd, &st))
		return true; /* (what cannot be told apart is refused) */
	for (int i = 0; i < SHM_SLOTS; i++) {
		struct stat ss;
		struct segment *g = &t->seg[i];

		if (g->id && g->id != UINT64_MAX && g->fd >= 0 && !fstat(g->fd, &ss) &&
		    ss.st_dev == st.st_dev && ss.st_ino == st.st_ino)
			return true;
	}
	return false;
}

/*
 * Keep segs[0..n) (their descriptors), handed in by peer (process pid), under a new
 * token (*token); what peer handed in already (the same files at the same places)
 * keeps its token. SHM_DEPOSIT_* status: OK (the descriptors are the table's now:
 * *taken), or why not (the caller closes them).
 */
static uint8_t deposit_keep(struct shm_table *t, struct shm_fd_seg *segs, unsigned n,
			    const char *peer, pid_t pid, uint64_t *token, bool *taken)
{
	struct deposit *slot = NULL;
	unsigned mine = 0;
	uint8_t status = SHM_DEPOSIT_OK;
	int pidfd;

	*taken = false;
	pthread_mutex_lock(&t->lock);
	deposits_reap(t);
	/* never memory of the daemon's own: a client holds its segments' and rings'
	 * descriptors, and landing there would write into what the daemon runs on */
	for (unsigned k = 0; k < n; k++)
		if (own_segment(t, segs[k].fd)) {
			status = SHM_DEPOSIT_OWN;
			goto out;
		}
	for (int i = 0; i < DEPOSITS_MAX; i++) {
		struct deposit *d = &t->dep[i];

		if (!d->token) {
			if (!slot)
				slot = d;
			continue;
		}
		if (strcmp(d->owner, peer))
			continue;
		if (d->n == n && same_segments(d->segs, segs, n)) {
			*token = d->token; /* the ones kept already serve */
			goto out;
		}
		mine++;
	}
	if (mine >= DEPOSITS_PER_OWNER) {
		status = SHM_DEPOSIT_TOO_MANY;
		goto out;
	}
	if (!slot) {
		status = SHM_DEPOSIT_FULL;
		goto out;
	}
	slot->segs = malloc(n * sizeof(*segs));
	pidfd = slot->segs ? (int)syscall(SYS_pidfd_open, pid, 0) : -1;
	if (pidfd < 0) {
		free(slot->segs);
		slot->segs = NULL;
		status = SHM_DEPOSIT_REFUSED;
		goto out;
	}
	do {
		if (getrandom(&slot->token, sizeof(slot->token), 0) != sizeof(slot->token))
			slot->token = 0;
	} while (!slot->token);
	memcpy(slot->segs, segs, n * sizeof(*segs));
	slot->n = n;
	slot->pidfd = pidfd;
	snprintf(slot->owner, sizeof(slot->owner), "%s", peer);
	*token = slot->token;
	*taken = true;
out:
	pthread_mutex_unlock(&t->lock);
	return status;
}

int shm_deposit_take(struct shm_table *t, uint64_t token, const char *owner,
		     struct shm_fd_seg **out, unsigned *n)
{
	struct shm_fd_seg *segs = NULL;
	int rc = -ENOENT;

	if (!token)
		return -ENOENT;
	pthread_mutex_lock(&t->lock);
	deposits_reap(t);
	for (int i = 0; i < DEPOSITS_MAX && rc == -ENOENT; i++) {
		struct deposit *d = &t->dep[i];
		unsigned k = 0;

		if (d->token != token || strcmp(d->owner, owner))
			continue;
		segs = malloc(d->n * sizeof(*segs));
		rc = segs ? 0 : -ENOMEM;
		while (!rc && k < d->n) {
			segs[k] = d->segs[k];
			segs[k].fd = fcntl(d->segs[k].fd, F_DUPFD_CLOEXEC, 0);
			if (segs[k].fd < 0)
				rc = -errno;
			else
				k++;
		}
		if (rc) {
			while (k > 0)
				close(segs[--k].fd);
			free(segs);
		} else {
			*out = segs;
			*n = d->n;
		}
	}
	pthread_mutex_unlock(&t->lock);
	return rc;
}

/*
 * The segment table of a deposit request (KVBP_DEPOSIT_REQUEST, then n and n x
 * (offset, size), little-endian) checked against the descriptors that came, into
 * segs: each at a page-aligned offset, in order, none overlapping, sizes that
 * add up within SHM_DEPOSIT_EXTENT_MAX (a size of 0: the whole file, for one alone).
 */
static bool deposit_table_ok(const uint8_t *tab, unsigned n, const int *fds, unsigned n_fds,
			     struct shm_fd_seg *segs)
{
	uint64_t end = 0;

	if (!n || n > SHM_DEPOSIT_SEGMENTS_MAX || n != n_fds)
		return false;
	for (unsigned k = 0; k < n; k++) {
		uint64_t off = 0, size = 0;

		for (int i = 7; i >= 0; i--) {
			off = off << 8 | tab[16 * k + (unsigned)i];
			size = size << 8 | tab[16 * k + 8 + (unsigned)i];
		}
		if (off % 4096 || off < end || size > SHM_DEPOSIT_EXTENT_MAX ||
		    off > SHM_DEPOSIT_EXTENT_MAX - size || (!size && n > 1))
			return false;
		end = off + size;
		segs[k] = (struct shm_fd_seg){ fds[k], off, size };
	}
	return true;
}

/* Send status (and, when fd >= 0, the descriptor; else, with has_token, the token). */
static void serve_answer(int c, uint8_t status, int fd, const uint64_t *token)
{
	union {
		char buf[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} u;
	uint8_t out[9] = { status };
	struct iovec iov = { out, 1 };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1 };

	if (token) {
		for (int i = 0; i < 8; i++)
			out[1 + i] = (uint8_t)(*token >> (8 * i));
		iov.iov_len = 9;
	}
	if (fd >= 0) {
		struct cmsghdr *cm;

		memset(&u, 0, sizeof(u));
		mh.msg_control = u.buf;
		mh.msg_controllen = sizeof(u.buf);
		cm = CMSG_FIRSTHDR(&mh);
		cm->cmsg_level = SOL_SOCKET;
		cm->cmsg_type = SCM_RIGHTS;
		cm->cmsg_len = CMSG_LEN(sizeof(int));
		memcpy(CMSG_DATA(cm), &fd, sizeof(int));
	}
	sendmsg(c, &mh, MSG_NOSIGNAL);
}

/*
 * Read want bytes into buf from c, the descriptors that come with them into fds (at
 * most cap; *n_fds counts them, the rest are closed): 0, or -1 (closed, timed out).
 */
static int serve_read(int c, uint8_t *buf, size_t want, int *fds, unsigned cap, unsigned *n_fds)
{
	size_t got = 0;

	while (got < want) {
		union {
			char buf[CMSG_SPACE(SHM_DEPOSIT_SEGMENTS_MAX * sizeof(int))];
			struct cmsghdr align;
		} u;
		struct iovec iov = { buf + got, want - got };
		struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
				     .msg_controllen = sizeof(u.buf) };
		ssize_t r = recvmsg(c, &mh, MSG_CMSG_CLOEXEC);

		for (struct cmsghdr *cm = r >= 0 ? CMSG_FIRSTHDR(&mh) : NULL; cm;
		     cm = CMSG_NXTHDR(&mh, cm)) {
			if (cm->cmsg_level != SOL_SOCKET || cm->cmsg_type != SCM_RIGHTS)
				continue;
			for (size_t k = 0; k < (cm->cmsg_len - CMSG_LEN(0)) / sizeof(int); k++) {
				int x;

				memcpy(&x, CMSG_DATA(cm) + k * sizeof(int), sizeof(int));
				if (*n_fds < cap)
					fds[(*n_fds)++] = x;
				else
					close(x);
			}
		}
		if (r <= 0)
			return -1;
		got += (size_t)r;
	}
	return 0;
}

/*
 * Answer one connection: a segment's descriptor (status byte, the descriptor attached
 * when ok), or memory handed in (status byte and its token). Never blocks for long.
 * Descriptors a request brings that are not kept are closed.
 */
static void serve_one(struct shm_table *t, int c)
{
	struct timeval tv = { SERVE_TIMEOUT_MS / 1000, (SERVE_TIMEOUT_MS % 1000) * 1000 };
	struct ucred cred;
	socklen_t cl = sizeof(cred);
	uint8_t req[8], *tab = NULL;
	char peer[SHM_OWNER_MAX];
	uint64_t id = 0, token = 0;
	int fds[SHM_DEPOSIT_SEGMENTS_MAX], fd;
	unsigned n_fds = 0;
	bool taken = false;

	setsockopt(c, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	setsockopt(c, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
	if (getsockopt(c, SOL_SOCKET, SO_PEERCRED, &cred, &cl))
		return;
	if (serve_read(c, req, sizeof(req), fds, SHM_DEPOSIT_SEGMENTS_MAX, &n_fds))
		goto out;
	for (int i = 7; i >= 0; i--)
		id = id << 8 | req[i];
	/* the same principal as server.c builds from ZeroMQ's Peer-Address */
	snprintf(peer, sizeof(peer), "ipc:%u:%u:%d", (unsigned)cred.uid, (unsigned)cred.gid,
		 (int)cred.pid);
	if (id == KVBP_DEPOSIT_REQUEST) {
		struct shm_fd_seg segs[SHM_DEPOSIT_SEGMENTS_MAX];
		uint8_t nb[4], status;
		unsigned n = 0;

		if (serve_read(c, nb, sizeof(nb), fds, SHM_DEPOSIT_SEGMENTS_MAX, &n_fds))
			goto out;
		n = (unsigned)nb[0] | (unsigned)nb[1] << 8 | (unsigned)nb[2] << 16 |
		    (unsigned)nb[3] << 24;
		if (n && n <= SHM_DEPOSIT_SEGMENTS_MAX && (tab = malloc(16 * (size_t)n)) &&
		    serve_read(c, tab, 16 * (size_t)n, fds, SHM_DEPOSIT_SEGMENTS_MAX, &n_fds))
			goto out;
		if (!n_fds)
			status = SHM_DEPOSIT_NO_FD;
		else if (!tab || !deposit_table_ok(tab, n, fds, n_fds, segs))
			status = SHM_DEPOSIT_MALFORMED;
		else
			status = deposit_keep(t, segs, n, peer, cred.pid, &token, &taken);
		serve_answer(c, status, -1, status == SHM_DEPOSIT_OK ? &token : NULL);
		goto out;
	}
	fd = owner_fd(t, id, peer);
	serve_answer(c, fd < 0 ? 1 : 0, fd, NULL);
	if (fd >= 0)
		close(fd);
out:
	free(tab);
	for (unsigned k = 0; !taken && k < n_fds; k++)
		close(fds[k]);
}

static void *serve_main(void *arg)
{
	struct shm_table *t = arg;

	while (!atomic_load(&t->stop)) {
		struct pollfd p = { t->listen_fd, POLLIN, 0 };
		int c;

		if (poll(&p, 1, 200) <= 0)
			continue;
		c = accept4(t->listen_fd, NULL, NULL, SOCK_CLOEXEC);
		if (c < 0) {
			if (errno == EMFILE || errno == ENFILE)
				usleep(10000); /* out of descriptors: let the backlog wait */
			continue;
		}
		serve_one(t, c);
		close(c);
	}
	return NULL;
}

int shm_serve(struct shm_table *t, const char *path, unsigned mode)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	sigset_t all, old;
	int fd, rc;

	if (strlen(path) >= sizeof(a.sun_path))
		return -ENAMETOOLONG;
	strcpy(a.sun_path, path);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0)
		return -errno;
	unlink(path);
	if (bind(fd, (struct sockaddr *)&a, sizeof(a)) || chmod(path, mode & 0777) ||
	    listen(fd, 128)) {
		rc = -errno;
		close(fd);
		unlink(path);
		return rc;
	}
	t->listen_fd = fd;
	snprintf(t->path, sizeof(t->path), "%s", path);
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	rc = pthread_create(&t->thread, NULL, serve_main, t);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc)
		return -rc;
	t->serving = true;
	return 0;
}

const char *shm_path(const struct shm_table *t)
{
	return t->serving ? t->path : "";
}

/* ---- pinning ---- */

void shm_set_pinner(struct shm_table *t, const struct shm_pinner *p)
{
	if (p) {
		pthread_mutex_lock(&t->lock);
		t->pinner = *p;
		t->has_pinner = true;
		pthread_mutex_unlock(&t->lock);
		return;
	}
	shm_reap(t);
	/* Under the lock: this runs at shutdown, when no one waits on the table. */
	pthread_mutex_lock(&t->lock);
	for (int i = 0; t->has_pinner && i < SHM_SLOTS; i++) {
		struct segment *s = &t->seg[i];

		if (!s->pinned || s->id == UINT64_MAX) /* a retired one: shm_reap() above */
			continue;
		t->pinner.unpin(t->pinner.ctx, s->base);
		t->unpins++;
		s->pinned = false;
	}
	t->has_pinner = false;
	pthread_mutex_unlock(&t->lock);
}

int shm_pin(struct shm_table *t, uint64_t id, bool *fresh)
{
	struct shm_pinner p;
	struct segment *s;
	void *base = NULL;
	uint64_t size = 0;
	int rc = 0;

	pthread_mutex_lock(&t->lock);
	s = find(t, id);
	if (!s)
		rc = -ENOENT;
	else if (!t->has_pinner)
		rc = -ENODEV;
	else if (s->pinning)
		rc = -EBUSY;
	else if (s->pinned)
		*fresh = false;
	else {
		s->pinning = true;
		base = s->base;
		size = s->size;
		p = t->pinner;
	}
	pthread_mutex_unlock(&t->lock);
	if (rc || !base)
		return rc;
	/* Outside the lock (pinning gigabytes takes a while): the caller holds the segment,
	 * so it stays mapped. */
	rc = p.pin(p.ctx, base, size);
	pthread_mutex_lock(&t->lock);
	s->pinning = false;
	if (!rc) {
		s->pinned = true;
		t->pins++;
		*fresh = true;
	}
	pthread_mutex_unlock(&t->lock);
	return rc;
}

unsigned shm_reap(struct shm_table *t)
{
	unsigned n = 0;

	for (;;) {
		struct segment *s = NULL;
		struct shm_pinner p = { 0 };
		bool unpin = false;

		pthread_mutex_lock(&t->lock);
		for (int i = 0; i < SHM_SLOTS && !s; i++)
			if (t->seg[i].retired)
				s = &t->seg[i];
		if (s) {
			s->retired = false; /* the slot stays taken (id UINT64_MAX) till it is cleared */
			unpin = t->has_pinner;
			p = t->pinner;
		}
		pthread_mutex_unlock(&t->lock);
		if (!s)
			return n;
		if (unpin)
			p.unpin(p.ctx, s->base);
		unmap_guarded(s->base, s->size);
		close(s->fd);
		pthread_mutex_lock(&t->lock);
		t->unpins += unpin;
		memset(s, 0, sizeof(*s));
		pthread_mutex_unlock(&t->lock);
		n++;
	}
}

void shm_pin_counts(struct shm_table *t, uint64_t *pinned, uint64_t *pins, uint64_t *unpins)
{
	uint64_t n = 0;

	pthread_mutex_lock(&t->lock);
	for (int i = 0; i < SHM_SLOTS; i++)
		n += t->seg[i].pinned && !t->seg[i].retired && t->seg[i].id != UINT64_MAX;
	*pinned = n;
	*pins = t->pins;
	*unpins = t->unpins;
	pthread_mutex_unlock(&t->lock);
}
