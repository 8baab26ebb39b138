/* Unit tests of daemon/arena: ranges inside the region, aligned, never overlapping
 * (checked against a map of the region's bytes over random takes and gives), the
 * room a give frees taken again first-fit, and the errors. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "daemon/arena.h"

static void test_errors_and_first_fit(void **state)
{
	static uint8_t region[4096];
	struct arena *a;
	void *p[4], *q;
	size_t got, used, bytes;

	(void)state;
	assert_int_equal(arena_new(region, 4096, 3, &a), -EINVAL);
	assert_int_equal(arena_new(region, 0, 256, &a), -EINVAL);
	assert_int_equal(arena_new(region, 4096, 256, &a), 0);
	assert_int_equal(arena_take(a, 0, &q, &got), -EINVAL);
	assert_int_equal(arena_take(a, 4097, &q, &got), -ENOMEM);
	for (int i = 0; i < 4; i++) {
		assert_int_equal(arena_take(a, 1000, &p[i], &got), 0);
		assert_int_equal(got, 1024);
		assert_ptr_equal(p[i], region + 1024 * i);
	}
	q = NULL;
	assert_int_equal(arena_take(a, 1, &q, &got), -ENOMEM); /* full */
	assert_null(q);
	assert_int_equal(arena_give(a, region + 1), -EINVAL); /* not a range's start */
	assert_int_equal(arena_give(a, region + 4096), -EINVAL); /* not in the region */
	assert_int_equal(arena_give(a, p[1]), 0);
	assert_int_equal(arena_give(a, p[1]), -EINVAL); /* given already */
	assert_int_equal(arena_take(a, 2000, &q, &got), -ENOMEM); /* one gap of 1024 */
	assert_int_equal(arena_give(a, p[2]), 0);
	assert_int_equal(arena_take(a, 2000, &q, &got), 0); /* the two gaps, joined */
	assert_ptr_equal(q, p[1]);
	assert_int_equal(got, 2048);
	arena_usage(a, &used, &bytes);
	assert_int_equal(used, 4096);
	assert_int_equal(bytes, 4096);
	assert_true(arena_owns(a, region + 4095));
	assert_false(arena_owns(a, region + 4096));
	arena_free(&a);
	assert_null(a);
	arena_free(&a);
}

/* Random takes and gives: every range in the region, aligned, disjoint from the others. */
static void test_random_disjoint(void **state)
{
	enum { BYTES = 1 << 16, ALIGN = 64, SLOTS = 64 };
	static uint8_t region[BYTES], owner[BYTES];
	struct arena *a;
	void *p[SLOTS] = { 0 };
	size_t len[SLOTS] = { 0 }, used, bytes, sum = 0;
	unsigned seed = 7;

	(void)state;
	assert_int_equal(arena_new(region, BYTES, ALIGN, &a), 0);
	memset(owner, 0, sizeof(owner));
	for (int step = 0; step < 20000; step++) {
		int s = rand_r(&seed) % SLOTS;

		if (p[s]) {
			memset(owner + ((uint8_t *)p[s] - region), 0, len[s]);
			assert_int_equal(arena_give(a, p[s]), 0);
			sum -= len[s];
			p[s] = NULL;
			continue;
		}
		{
			size_t want = 1 + (size_t)rand_r(&seed) % 4000, got = 0;
			void *q = NULL;
			int rc = arena_take(a, want, &q, &got);

			if (rc) {
				assert_int_equal(rc, -ENOMEM);
				continue;
			}
			assert_true(got >= want && got % ALIGN == 0 && got - want < ALIGN);
			assert_true((size_t)((uint8_t *)q - region) % ALIGN == 0);
			assert_true((uint8_t *)q + got <= region + BYTES);
			for (size_t i = 0; i < got; i++)
				assert_int_equal(owner[(uint8_t *)q - region + i], 0);
			memset(owner + ((uint8_t *)q - region), s + 1, got);
			p[s] = q;
			len[s] = got;
			sum += got;
		}
		arena_usage(a, &used, &bytes);
		assert_int_equal(used, sum);
	}
	arena_free(&a);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_errors_and_first_fit),
		cmocka_unit_test(test_random_disjoint),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
