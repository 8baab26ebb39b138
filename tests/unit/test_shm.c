/* Unit tests of daemon/shm: limits, spans, detach while in use, idle expiry, the ring
 * cache, and ids that do not repeat. */
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
#include <unistd.h>

#include <cmocka.h>

#include "shm.h"

#define MiB (1u << 20)

static int name_exists(const char *name)
{
	int fd = shm_open(name, O_RDONLY, 0);

	if (fd < 0)
		return 0;
	close(fd);
	return 1;
}

static void test_limits_and_spans(void **state)
{
	struct shm_table *t;
	uint64_t id, id2, count, bytes;
	char name[64];
	void *p;

	(void)state;
	assert_int_equal(shm_table_new(4 * MiB, 6 * MiB, 600, 0600, &t), 0);
	assert_int_equal(shm_create(t, 5 * MiB, &id, name, sizeof(name)), -E2BIG);
	assert_int_equal(shm_create(t, 0, &id, name, sizeof(name)), -E2BIG);
	assert_int_equal(shm_create(t, 4 * MiB, &id, name, sizeof(name)), 0);
	assert_true(name_exists(name));
	assert_int_equal(shm_create(t, 4 * MiB, &id2, name, sizeof(name)), -ENOSPC);
	shm_usage(t, &count, &bytes);
	assert_int_equal(count, 1);
	assert_int_equal(bytes, 4 * MiB);
	/* spans are checked against the segment */
	assert_int_equal(shm_acquire(t, id, 4 * MiB - 10, 11, &p), -ERANGE);
	assert_int_equal(shm_acquire(t, id, UINT64_MAX, 1, &p), -ERANGE);
	assert_int_equal(shm_acquire(t, id + 1, 0, 1, &p), -ENOENT);
	assert_int_equal(shm_acquire(t, id, 4 * MiB - 10, 10, &p), 0);
	/* the first use unlinks the name: the client has it mapped */
	assert_false(name_exists(name));
	/* detached while in use: unmapped only when released */
	assert_int_equal(shm_detach(t, id), 0);
	memset(p, 0x5a, 10);
	assert_int_equal(shm_acquire(t, id, 0, 1, &p), -ENOENT);
	shm_release(t, id);
	shm_usage(t, &count, &bytes);
	assert_int_equal(count, 0);
	assert_int_equal(bytes, 0);
	assert_int_equal(shm_detach(t, id), -ENOENT);
	shm_table_free(&t);
	assert_null(t);
}

static void test_expiry(void **state)
{
	struct shm_table *t;
	uint64_t id, count, bytes;
	char name[64];
	void *p;

	(void)state;
	assert_int_equal(shm_table_new(4 * MiB, 8 * MiB, 1, 0600, &t), 0);
	assert_int_equal(shm_create(t, MiB, &id, name, sizeof(name)), 0);
	assert_int_equal(shm_acquire(t, id, 0, 1, &p), 0);
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
	uint64_t id, id2, actual;
	char name[64], name2[64];
	void *p, *p2;

	(void)state;
	assert_int_equal(shm_table_new(8 * MiB, 16 * MiB, 600, 0600, &t), 0);
	assert_int_equal(shm_create_ring(t, 2 * MiB, &id, name, sizeof(name), &actual), 0);
	assert_int_equal(actual, 2 * MiB);
	assert_int_equal(shm_hold(t, id, &p), 0);
	memset(p, 7, 2 * MiB);
	/* a ring keeps its name while in use (the client maps it by name) */
	assert_true(name_exists(name));
	shm_release(t, id);
	assert_int_equal(shm_detach(t, id), 0);
	/* cached, not listed, and reused as it is for a ring of the same size (or half) */
	assert_int_equal(shm_create_ring(t, 1 * MiB + 1, &id2, name2, sizeof(name2), &actual), 0);
	assert_string_equal(name, name2);
	assert_int_equal(actual, 2 * MiB);
	assert_true(id2 != id);
	assert_int_equal(shm_hold(t, id2, &p2), 0);
	assert_ptr_equal(p, p2);
	shm_release(t, id2);
	shm_detach(t, id2);
	/* a plain segment squeezes cached rings out when memory runs short */
	{
		uint64_t a, b;
		char n1[64], n2[64];

		assert_int_equal(shm_create(t, 8 * MiB, &a, n1, sizeof(n1)), 0);
		assert_int_equal(shm_create(t, 8 * MiB, &b, n2, sizeof(n2)), 0);
		assert_false(name_exists(name));
	}
	shm_table_free(&t);
}

static void test_ids_do_not_repeat(void **state)
{
	struct shm_table *t;
	uint64_t ids[32];
	char name[64];

	(void)state;
	assert_int_equal(shm_table_new(MiB, 64 * MiB, 600, 0600, &t), 0);
	for (int i = 0; i < 32; i++) {
		assert_int_equal(shm_create(t, MiB, &ids[i], name, sizeof(name)), 0);
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
		cmocka_unit_test(test_expiry),
		cmocka_unit_test(test_ring_cache),
		cmocka_unit_test(test_ids_do_not_repeat),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
