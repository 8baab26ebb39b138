/*
 * Capacity and eviction through the real kvblendd: a load with a hot set past
 * the capacity keeps the store under the high watermark, the hot set and the
 * pinned chunks survive; a full LMDB map makes room and the PUT succeeds; with
 * everything pinned, a PUT gets "cache full" and the daemon keeps serving.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/integration/harness.h"

static void fill(uint8_t *p, size_t n, uint64_t seed)
{
	uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;

	/* random bytes: they do not compress, so stored sizes are what they seem */
	for (size_t i = 0; i < n; i++) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		p[i] = (uint8_t)(x >> 40);
	}
}

static void hash_of(uint32_t i, uint8_t h[KVB_HASH_LEN])
{
	uint32_t ids[2] = { 0xe71c7, i };

	kvb_chunk_hash(ids, 2, h);
}

static int found(kvb_client *c, const char *model, uint32_t i)
{
	uint8_t h[KVB_HASH_LEN];
	struct kvb_chunk_info ci;

	hash_of(i, h);
	assert_int_equal(kvb_lookup(c, model, (const uint8_t(*)[KVB_HASH_LEN])h, 1, &ci), 0);
	return ci.found;
}

static void test_hot_set_survives(void **state)
{
	const char *args[] = { "--capacity", "4M", "--evict-high", "90", "--evict-low", "70",
			       "--no-sync", NULL };
	const struct kvb_model m = { .name = "ev", .num_layers = 2, .num_kv_heads = 2,
				     .head_dim = 64, .dtype = KVB_F16, .rope_theta = 1e4 };
	const uint64_t cap = 4u << 20;
	size_t n = 2 * 2 * 32 * 2 * 64 * 2; /* 32 tokens: 32 KiB */
	uint8_t *kv = malloc(n), h[KVB_HASH_LEN];
	struct daemon d;
	kvb_client *c;
	int misses = 0;

	(void)state;
	c = daemon_start_client(&d, args, &m, 0);
	for (uint32_t i = 0; i < 300; i++) {
		fill(kv, n, i);
		hash_of(i, h);
		assert_int_equal(kvb_put(c, "ev", h, KVB_F16, 32, 0, kv, n, NULL), 0);
		if (i == 5 || i == 6)
			assert_int_equal(kvb_pin(c, "ev", h, 600), 0);
		/* the hot set (chunks 0..4) is read all along */
		for (uint32_t j = 0; i % 10 == 9 && j < 5; j++) {
			uint8_t hh[KVB_HASH_LEN];

			hash_of(j, hh);
			assert_int_equal(kvb_get(c, "ev", hh, 0, 0, kv, n, NULL), 0);
		}
	}
	/* the evictor runs at least once a second */
	for (int t = 0; t < 50 && daemon_stat(c, "stored_bytes") > cap * 0.9; t++)
		usleep(100000);
	assert_true(daemon_stat(c, "stored_bytes") <= cap * 0.9);
	assert_true(daemon_stat(c, "evictions") > 0);
	assert_int_equal(daemon_stat(c, "pinned_chunks"), 2);
	for (uint32_t j = 0; j < 7; j++)
		if (!found(c, "ev", j))
			fail_msg("hot or pinned chunk %u was evicted", j);
	/* the cold early chunks went first */
	for (uint32_t j = 7; j < 50; j++)
		misses += !found(c, "ev", j);
	assert_int_equal(misses, 43);
	/* unpinned, a chunk is a candidate again; unpinning twice is an error */
	hash_of(5, h);
	assert_int_equal(kvb_unpin(c, "ev", h), 0);
	assert_int_equal(kvb_unpin(c, "ev", h), KVB_E_NOT_FOUND);
	assert_int_equal(kvb_pin(c, "ev", h, 0), KVB_E_BAD_ARGUMENT);
	daemon_end(&d, &c);
	free(kv);
}

static void test_map_full(void **state)
{
	const char *args[] = { "--map-size", "16M", "--no-sync", NULL };
	const struct kvb_model m = { .name = "big", .num_layers = 4, .num_kv_heads = 4,
				     .head_dim = 128, .dtype = KVB_F16, .rope_theta = 1e4 };
	size_t n = 4 * 2 * 64 * 4 * 128 * 2; /* 64 tokens: 512 KiB */
	uint8_t *kv = malloc(n), h[KVB_HASH_LEN];
	struct daemon d;
	kvb_client *c;
	struct kvb_chunk_info *list;
	size_t n_list;
	int rc = 0;

	(void)state;
	/* the harness passes --map-size 1G first; the later flag wins */
	c = daemon_start_client(&d, args, &m, 0);
	/* 80 chunks of 512 KiB into a 16 MiB map: room is made as it fills */
	for (uint32_t i = 0; i < 80; i++) {
		fill(kv, n, 1000 + i);
		hash_of(1000 + i, h);
		rc = kvb_put(c, "big", h, KVB_F16, 64, 0, kv, n, NULL);
		if (rc)
			fail_msg("put %u: %s", i, kvb_last_error(c));
	}
	assert_true(daemon_stat(c, "evictions") > 0);
	/* Pin everything that is left: now nothing can be evicted. */
	assert_int_equal(kvb_list(c, "big", &list, &n_list), 0);
	for (size_t i = 0; i < n_list; i++)
		assert_int_equal(kvb_pin(c, "big", list[i].hash, 600), 0);
	free(list);
	/* ...and every chunk put from now on is pinned as soon as it is stored. */
	for (uint32_t i = 0; i < 40 && rc == 0; i++) {
		fill(kv, n, 5000 + i);
		hash_of(5000 + i, h);
		rc = kvb_put(c, "big", h, KVB_F16, 64, 0, kv, n, NULL);
		if (rc == 0)
			assert_int_equal(kvb_pin(c, "big", h, 600), 0);
	}
	assert_int_equal(rc, KVB_E_FULL);
	assert_non_null(strstr(kvb_last_error(c), "cache full"));
	{
		char v[32];

		assert_int_equal(kvb_ping(c, v, sizeof(v)), 0);
	}
	daemon_end(&d, &c);
	free(kv);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_hot_set_survives),
		cmocka_unit_test(test_map_full),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
