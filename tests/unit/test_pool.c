/* Unit tests of daemon/pool: every index runs once, errors surface, concurrent callers. */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>

#include <cmocka.h>

#include "daemon/pool.h"

struct counts {
	atomic_int hits[1000];
	size_t fail_at;
};

static int count(void *arg, size_t i)
{
	struct counts *c = arg;

	atomic_fetch_add(&c->hits[i], 1);
	return i == c->fail_at ? -EIO : 0;
}

static void test_each_index_once(void **state)
{
	struct pool *p;
	struct counts *c = calloc(1, sizeof(*c));

	(void)state;
	for (unsigned threads = 0; threads < 4; threads++) {
		assert_int_equal(pool_new(threads, &p), 0);
		assert_int_equal(pool_threads(p), threads);
		for (size_t n = 0; n < 1000; n += 333) {
			for (size_t i = 0; i < 1000; i++)
				atomic_store(&c->hits[i], 0);
			c->fail_at = SIZE_MAX;
			assert_int_equal(pool_run(p, n, count, c), 0);
			for (size_t i = 0; i < 1000; i++)
				assert_int_equal(atomic_load(&c->hits[i]), i < n ? 1 : 0);
		}
		c->fail_at = 7;
		assert_int_equal(pool_run(p, 100, count, c), -EIO);
		pool_free(&p);
		assert_null(p);
	}
	pool_free(&p);
	free(c);
}

struct caller {
	struct pool *p;
	int ok;
};

static void *call_many(void *arg)
{
	struct caller *k = arg;
	struct counts *c = calloc(1, sizeof(*c));

	c->fail_at = SIZE_MAX;
	k->ok = 1;
	for (int r = 0; r < 200; r++) {
		if (pool_run(k->p, 50, count, c))
			k->ok = 0;
	}
	for (size_t i = 0; i < 50; i++)
		if (atomic_load(&c->hits[i]) != 200)
			k->ok = 0;
	free(c);
	return NULL;
}

static void test_concurrent_callers(void **state)
{
	struct pool *p;
	pthread_t t[4];
	struct caller k[4];

	(void)state;
	assert_int_equal(pool_new(2, &p), 0);
	for (int i = 0; i < 4; i++) {
		k[i].p = p;
		pthread_create(&t[i], NULL, call_many, &k[i]);
	}
	for (int i = 0; i < 4; i++) {
		pthread_join(t[i], NULL);
		assert_true(k[i].ok);
	}
	pool_free(&p);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_each_index_once),
		cmocka_unit_test(test_concurrent_callers),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
