/* Unit tests of daemon/shm: limits, spans, owners and kinds, the per-owner share, detach
 * while in use, idle expiry, the ring cache (per owner), rings pinned once for their life,
 * sealed segments, the descriptor server, and ids that do not repeat. */
#include <errno.h>
#include <fcntl.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <cmocka.h>

#include "daemon/shm.h"

#define MiB (1u << 20)
#define A "ipc:1000:1000:11"
#define B "ipc:1001:1001:12"

static void test_limits_and_spans(void **state)
{
	struct shm_table *t;
	uint64_t id, id2, count, bytes;
	void *p;

	(void)state;
	assert_int_equal(shm_table_new(4 * MiB, 6 * MiB, 600, 16, &t), 0);
	assert_int_equal(shm_create(t, 5 * MiB, A, &id), -E2BIG);
	assert_int_equal(shm_create(t, 0, A, &id), -E2BIG);
	assert_int_equal(shm_create(t, 4 * MiB, A, &id), 0);
	assert_true(id != 0);
	assert_int_equal(shm_create(t, 4 * MiB, A, &id2), -ENOSPC);
	shm_usage(t, &count, &bytes);
	assert_int_equal(count, 1);
	assert_int_equal(bytes, 4 * MiB);
	assert_int_equal(shm_acquire(t, id, A, 4 * MiB - 10, 11, &p), -ERANGE);
	assert_int_equal(shm_acquire(t, id, A, UINT64_MAX, 1, &p), -ERANGE);
	assert_int_equal(shm_acquire(t, id + 1, A, 0, 1, &p), -ENOENT);
	assert_int_equal(shm_acquire(t, id, A, 4 * MiB - 10, 10, &p), 0);
	memset(p, 1, 10);
	/* detached while a request uses it: unmapped when released */
	assert_int_equal(shm_detach(t, id, A), 0);
	assert_int_equal(shm_acquire(t, id, A, 0, 1, &p), -ENOENT);
	shm_release(t, id);
	shm_usage(t, &count, &bytes);
	assert_int_equal(count, 0);
	assert_int_equal(bytes, 0);
	assert_int_equal(shm_detach(t, id, A), -ENOENT);
	shm_table_free(&t);
}

/* Requests reach only their owner's client segments, never a ring. */
static void test_owners_and_kinds(void **state)
{
	struct shm_table *t;
	uint64_t a, ring, actual;
	void *p;

	(void)state;
	assert_int_equal(shm_table_new(4 * MiB, 64 * MiB, 600, 16, &t), 0);
	assert_int_equal(shm_create(t, MiB, A, &a), 0);
	assert_int_equal(shm_acquire(t, a, B, 0, 1, &p), -ENOENT);
	assert_int_equal(shm_detach(t, a, B), -ENOENT);
	assert_int_equal(shm_acquire(t, a, A, 0, 1, &p), 0);
	shm_release(t, a);
	assert_int_equal(shm_create_ring(t, MiB, A, &ring, &actual), 0);
	/* not even its owner's requests reach a ring, and only the daemon detaches it */
	assert_int_equal(shm_acquire(t, ring, A, 0, 1, &p), -ENOENT);
	assert_int_equal(shm_detach(t, ring, A), -ENOENT);
	assert_int_equal(shm_detach(t, ring, NULL), 0);
	shm_table_free(&t);
}

/* One owner may hold per_owner client segments; rings and other owners do not count. */
static void test_owner_share(void **state)
{
	struct shm_table *t;
	uint64_t ids[4], other, ring, actual;

	(void)state;
	assert_int_equal(shm_table_new(MiB, 64 * MiB, 600, 3, &t), 0);
	for (int i = 0; i < 3; i++)
		assert_int_equal(shm_create(t, MiB, A, &ids[i]), 0);
	assert_int_equal(shm_create(t, MiB, A, &ids[3]), -EDQUOT);
	assert_int_equal(shm_create(t, MiB, B, &other), 0);
	assert_int_equal(shm_create_ring(t, MiB, A, &ring, &actual), 0);
	assert_int_equal(shm_detach(t, ids[0], A), 0);
	assert_int_equal(shm_create(t, MiB, A, &ids[3]), 0);
	shm_table_free(&t);
}

static void test_expiry(void **state)
{
	struct shm_table *t;
	uint64_t id, count, bytes;
	void *p;

	(void)state;
	assert_int_equal(shm_table_new(4 * MiB, 8 * MiB, 1, 16, &t), 0);
	assert_int_equal(shm_create(t, MiB, A, &id), 0);
	assert_int_equal(shm_acquire(t, id, A, 0, 1, &p), 0);
	sleep(2);
	assert_int_equal(shm_expire(t), 0); /* in use: kept */
	shm_release(t, id);
	sleep(2);
	assert_int_equal(shm_expire(t), 1);
	shm_usage(t, &count, &bytes);
	assert_int_equal(count, 0);
	assert_int_equal(bytes, 0);
	shm_table_free(&t);
}

static void test_ring_cache(void **state)
{
	struct shm_table *t;
	uint64_t id, id2, id3, actual;
	void *p, *p2, *p3;

	(void)state;
	assert_int_equal(shm_table_new(8 * MiB, 16 * MiB, 600, 16, &t), 0);
	assert_int_equal(shm_create_ring(t, 2 * MiB, A, &id, &actual), 0);
	assert_int_equal(actual, 2 * MiB);
	assert_int_equal(shm_hold(t, id, &p), 0);
	memset(p, 7, 2 * MiB);
	shm_release(t, id);
	assert_int_equal(shm_detach(t, id, NULL), 0);
	/* another owner never gets it: a new segment, zeroed */
	assert_int_equal(shm_create_ring(t, 2 * MiB, B, &id3, &actual), 0);
	assert_int_equal(shm_hold(t, id3, &p3), 0);
	assert_true(p3 != p);
	assert_int_equal(((uint8_t *)p3)[12345], 0);
	shm_release(t, id3);
	shm_detach(t, id3, NULL);
	/* the same owner's next ring of the same size (or half) reuses it as it is */
	assert_int_equal(shm_create_ring(t, 1 * MiB + 1, A, &id2, &actual), 0);
	assert_int_equal(actual, 2 * MiB);
	assert_true(id2 != id);
	assert_int_equal(shm_hold(t, id2, &p2), 0);
	assert_ptr_equal(p, p2);
	shm_release(t, id2);
	shm_detach(t, id2, NULL);
	/* a plain segment squeezes cached rings out when memory runs short */
	{
		uint64_t a, b, count, bytes;

		assert_int_equal(shm_create(t, 8 * MiB, A, &a), 0);
		assert_int_equal(shm_create(t, 8 * MiB, A, &b), 0);
		shm_usage(t, &count, &bytes);
		assert_int_equal(bytes, 16 * MiB);
	}
	shm_table_free(&t);
}

/* A pinner that counts, remembers what it pinned, and reads the memory it unpins. */
struct pin_log {
	unsigned pins, unpins;
	void *base;
	size_t bytes;
	int fail; /* the next pin fails with this */
};

static int log_pin(void *ctx, void *base, size_t bytes)
{
	struct pin_log *l = ctx;

	if (l->fail) {
		int rc = l->fail;

		l->fail = 0;
		return rc;
	}
	l->pins++;
	l->base = base;
	l->bytes = bytes;
	return 0;
}

static void log_unpin(void *ctx, void *base)
{
	struct pin_log *l = ctx;

	/* Still mapped when unpinned (the pinned bytes are 7): this read faults otherwise. */
	assert_int_equal(((volatile uint8_t *)base)[0], 7);
	assert_ptr_equal(base, l->base);
	l->unpins++;
}

/*
 * A ring is pinned once for its life: a second pin, and its owner's next session
 * reusing it from the cache, pin nothing new. Released for good (expired, evicted),
 * it is unpinned only by shm_reap(), never on the thread that expires it, and
 * while still mapped; removing the pinner unpins what is left. A failed pin leaves
 * the ring unpinned, and a later pin tries again.
 */
static void test_pinned_once(void **state)
{
	struct pin_log l = { 0 };
	struct shm_pinner pinner = { log_pin, log_unpin, &l };
	struct shm_table *t;
	uint64_t id, id2, actual, count, bytes, pinned, pins, unpins, big;
	bool fresh = false;
	void *p, *p2;

	(void)state;
	assert_int_equal(shm_table_new(8 * MiB, 16 * MiB, 1, 16, &t), 0);
	assert_int_equal(shm_create_ring(t, 2 * MiB, A, &id, &actual), 0);
	assert_int_equal(shm_hold(t, id, &p), 0);
	assert_int_equal(shm_pin(t, id, &fresh), -ENODEV); /* no pinner yet */
	shm_set_pinner(t, &pinner);
	l.fail = -ENOMEM;
	assert_int_equal(shm_pin(t, id, &fresh), -ENOMEM);
	assert_int_equal(l.pins, 0);
	assert_int_equal(shm_pin(t, id, &fresh), 0);
	assert_true(fresh);
	assert_ptr_equal(l.base, p);
	assert_int_equal(l.bytes, 2 * MiB);
	memset(p, 7, 2 * MiB);
	assert_int_equal(shm_pin(t, id, &fresh), 0);
	assert_false(fresh);
	assert_int_equal(shm_pin(t, id + 1, &fresh), -ENOENT);
	shm_release(t, id);
	assert_int_equal(shm_detach(t, id, NULL), 0);
	/* cached, still pinned; its owner's next ring is the same memory, pinned already */
	shm_pin_counts(t, &pinned, &pins, &unpins);
	assert_int_equal(pinned, 1);
	assert_int_equal(l.unpins, 0);
	assert_int_equal(shm_create_ring(t, 2 * MiB, A, &id2, &actual), 0);
	assert_int_equal(shm_hold(t, id2, &p2), 0);
	assert_ptr_equal(p2, p);
	assert_int_equal(shm_pin(t, id2, &fresh), 0);
	assert_false(fresh);
	assert_int_equal(l.pins, 1);
	shm_release(t, id2);
	shm_detach(t, id2, NULL);
	/* idle: released by the expiry, unpinned only by the reap */
	sleep(2);
	assert_int_equal(shm_expire(t), 1);
	assert_int_equal(l.unpins, 0);
	shm_usage(t, &count, &bytes);
	assert_int_equal(bytes, 0);
	assert_int_equal(shm_reap(t), 1);
	assert_int_equal(l.unpins, 1);
	assert_int_equal(shm_reap(t), 0);
	shm_pin_counts(t, &pinned, &pins, &unpins);
	assert_int_equal(pinned, 0);
	assert_int_equal(pins, 1);
	assert_int_equal(unpins, 1);
	/* evicted from the cache for a plain segment's room: the same */
	assert_int_equal(shm_create_ring(t, 8 * MiB, A, &id, &actual), 0);
	assert_int_equal(shm_hold(t, id, &p), 0);
	assert_int_equal(shm_pin(t, id, &fresh), 0);
	assert_true(fresh);
	memset(p, 7, 1);
	shm_release(t, id);
	shm_detach(t, id, NULL);
	assert_int_equal(shm_create(t, 8 * MiB, A, &big), 0);
	assert_int_equal(shm_create(t, 8 * MiB, A, &big), 0); /* the ring's room */
	assert_int_equal(l.unpins, 1);
	assert_int_equal(shm_reap(t), 1);
	assert_int_equal(l.unpins, 2);
	/* what is pinned when the pinner goes is unpinned then */
	assert_int_equal(shm_detach(t, big, NULL), 0);
	assert_int_equal(shm_create_ring(t, 4 * MiB, B, &id, &actual), 0);
	assert_int_equal(shm_hold(t, id, &p), 0);
	assert_int_equal(shm_pin(t, id, &fresh), 0);
	memset(p, 7, 1);
	shm_release(t, id);
	shm_detach(t, id, NULL);
	shm_set_pinner(t, NULL);
	assert_int_equal(l.pins, 3);
	assert_int_equal(l.unpins, 3);
	shm_pin_counts(t, &pinned, &pins, &unpins);
	assert_int_equal(pinned, 0);
	shm_table_free(&t);
}

/* Fetch segment id's descriptor from the server at path, as the client library does. */
static int fetch_fd(const char *path, uint64_t id, uint8_t *status)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	union {
		char buf[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} u;
	uint8_t req[8];
	struct iovec iov = { status, 1 };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			     .msg_controllen = sizeof(u.buf) };
	struct cmsghdr *cm;
	int s = socket(AF_UNIX, SOCK_STREAM, 0), fd = -1;

	memset(&u, 0, sizeof(u));
	strcpy(a.sun_path, path);
	for (int i = 0; i < 8; i++)
		req[i] = (uint8_t)(id >> (8 * i));
	assert_int_equal(connect(s, (struct sockaddr *)&a, sizeof(a)), 0);
	assert_int_equal(send(s, req, 8, 0), 8);
	assert_int_equal(recvmsg(s, &mh, 0), 1);
	cm = CMSG_FIRSTHDR(&mh);
	if (cm && cm->cmsg_type == SCM_RIGHTS)
		memcpy(&fd, CMSG_DATA(cm), sizeof(int));
	close(s);
	return fd;
}

/*
 * The descriptor goes only to the segment's owner (this process: its credentials
 * make the owner string), and the segment cannot be resized through it: a client
 * cannot truncate memory the daemon writes.
 */
static void test_descriptor_server(void **state)
{
	char dir[] = "/tmp/kvb-shm-XXXXXX", path[128], me[SHM_OWNER_MAX];
	struct shm_table *t;
	uint64_t mine, theirs;
	uint8_t status = 9;
	void *p, *q;
	int fd;

	(void)state;
	assert_non_null(mkdtemp(dir));
	snprintf(path, sizeof(path), "%s/s.shm", dir);
	snprintf(me, sizeof(me), "ipc:%u:%u:%d", (unsigned)getuid(), (unsigned)getgid(),
		 (int)getpid());
	assert_int_equal(shm_table_new(4 * MiB, 64 * MiB, 600, 16, &t), 0);
	assert_string_equal(shm_path(t), "");
	assert_int_equal(shm_serve(t, path, 0660), 0);
	assert_string_equal(shm_path(t), path);
	assert_int_equal(shm_create(t, MiB, me, &mine), 0);
	assert_int_equal(shm_create(t, MiB, B, &theirs), 0);
	/* another owner's segment, and an unknown id: status 1, no descriptor */
	assert_int_equal(fetch_fd(path, theirs, &status), -1);
	assert_int_equal(status, 1);
	assert_int_equal(fetch_fd(path, 424242, &status), -1);
	assert_int_equal(status, 1);
	fd = fetch_fd(path, mine, &status);
	assert_int_equal(status, 0);
	assert_true(fd >= 0);
	/* sealed: neither shrinking nor growing */
	assert_int_equal(ftruncate(fd, 4096), -1);
	assert_int_equal(errno, EPERM);
	assert_int_equal(ftruncate(fd, 2 * MiB), -1);
	/* and it is the daemon's memory */
	p = mmap(NULL, MiB, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	assert_true(p != MAP_FAILED);
	memset(p, 0x5a, MiB);
	assert_int_equal(shm_acquire(t, mine, me, MiB - 1, 1, &q), 0);
	assert_int_equal(*(uint8_t *)q, 0x5a);
	shm_release(t, mine);
	munmap(p, MiB);
	close(fd);
	shm_table_free(&t);
	assert_int_equal(access(path, F_OK), -1);
	rmdir(dir);
}

static void test_ids_do_not_repeat(void **state)
{
	struct shm_table *t;
	uint64_t ids[32];

	(void)state;
	assert_int_equal(shm_table_new(MiB, 64 * MiB, 600, 64, &t), 0);
	for (int i = 0; i < 32; i++) {
		assert_int_equal(shm_create(t, MiB, A, &ids[i]), 0);
		for (int j = 0; j < i; j++)
			assert_true(ids[i] != ids[j]);
		/* random, not a counter: a stale id from another daemon names nothing */
		assert_true(ids[i] > 1000);
	}
	shm_table_free(&t);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_limits_and_spans),
		cmocka_unit_test(test_owners_and_kinds),
		cmocka_unit_test(test_owner_share),
		cmocka_unit_test(test_expiry),
		cmocka_unit_test(test_ring_cache),
		cmocka_unit_test(test_pinned_once),
		cmocka_unit_test(test_descriptor_server),
		cmocka_unit_test(test_ids_do_not_repeat),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
