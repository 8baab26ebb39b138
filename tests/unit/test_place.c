/*
 * Placement (cluster/place.c): the owners are the r best scores, best first,
 * whatever the order of the member list; distinct; min(r, n) of them; weights
 * shift load in proportion; a member's join changes only owner sets it enters.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "cluster/place.h"

static void hash_of(unsigned i, uint8_t h[PLACE_HASH_LEN])
{
	for (int k = 0; k < PLACE_HASH_LEN; k++)
		h[k] = (uint8_t)((i * 2654435761u) >> (k % 4 * 8)) ^ (uint8_t)(k * 31 + i);
}

static void members(struct place_member *m, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		char id[32];

		snprintf(id, sizeof(id), "m%zu", i);
		m[i].seed = place_seed(id);
		m[i].weight = 1;
	}
}

static void test_top_r(void **state)
{
	struct place_member m[12], rev[12];
	size_t out[5], out2[5];

	(void)state;
	members(m, 12);
	for (size_t i = 0; i < 12; i++)
		rev[i] = m[11 - i];
	for (unsigned c = 0; c < 500; c++) {
		uint8_t h[PLACE_HASH_LEN];
		double s[12];

		hash_of(c, h);
		assert_int_equal(place_owners(m, 12, h, 5, out), 5);
		for (size_t i = 0; i < 12; i++)
			s[i] = place_score(&m[i], h);
		/* best first, and nobody outside beats the last */
		for (size_t i = 1; i < 5; i++)
			assert_true(s[out[i - 1]] >= s[out[i]] && out[i - 1] != out[i]);
		for (size_t i = 0; i < 12; i++) {
			int in = 0;

			for (size_t j = 0; j < 5; j++)
				in |= out[j] == i;
			assert_true(in || s[i] <= s[out[4]]);
		}
		/* the same owners from the list in another order */
		assert_int_equal(place_owners(rev, 12, h, 5, out2), 5);
		for (size_t i = 0; i < 5; i++)
			assert_true(rev[out2[i]].seed == m[out[i]].seed);
	}
	{
		uint8_t h[PLACE_HASH_LEN] = { 1 };

		assert_int_equal(place_owners(m, 3, h, 5, out), 3);
		assert_int_equal(place_owners(m, 0, h, 2, out), 0);
	}
}

static void test_weights_and_join(void **state)
{
	struct place_member m[5];
	unsigned load[5] = { 0 }, moved = 0, wrong = 0;
	size_t out[2], out2[2];

	(void)state;
	members(m, 5);
	m[0].weight = 3; /* three times the others: about three times the chunks */
	for (unsigned c = 0; c < 20000; c++) {
		uint8_t h[PLACE_HASH_LEN];

		hash_of(c, h);
		place_owners(m, 4, h, 1, out);
		load[out[0]]++;
		/* member 4 joins: a chunk moves only to it */
		place_owners(m, 5, h, 2, out2);
		place_owners(m, 4, h, 2, out);
		for (int i = 0; i < 2; i++) {
			int kept = m[out2[i]].seed == m[out[0]].seed || m[out2[i]].seed == m[out[1]].seed;

			if (!kept) {
				moved++;
				wrong += out2[i] != 4;
			}
		}
	}
	assert_int_equal(wrong, 0);
	assert_true(moved > 20000 * 2 / 10 && moved < 20000 * 2 / 5); /* about 2/7 of chunks */
	assert_true(load[0] > 2.6 * load[1] && load[0] < 3.4 * load[1]);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_top_r),
		cmocka_unit_test(test_weights_and_join),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
