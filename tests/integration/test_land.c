/*
 * Landing fuse sessions through the real kvblendd and libkvblend: the daemon
 * writes fused layers into the node's own buffers (a region), in contiguous,
 * padded and paged layouts and with K transposed per page (vLLM's CPU cache), and the result must be byte for byte what the
 * classic session (kvb_fuse_layer) returns for the same request; check layers
 * take only the metric's plane (packed, strided in place, or in frames) and
 * name the dropped rows; reuse-only sessions; errors; nothing lands after close.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/data_file.h"
#include "tests/fixture.h"
#include "tests/integration/harness.h"

#define L 6
#define H 2
#define D 8
#define ROW (H * D * 2)
#define N 46 /* 10 + 5 fresh + 17 + 14 */

static const struct kvb_model model = TEST_MODEL_F16("lm", L, H, D);

struct fixture {
	struct daemon d;
	kvb_client *c;
	uint8_t hash[3][KVB_HASH_LEN];
	const char *name; /* the model the sessions use: "lm", or "lm8" (int8), "lmz" (bitshuffle+LZ4) */
	uint16_t *fresh; /* [L][2][N][H][D]: what the node computes for every token */
	bool stale;	 /* before each check: let the daemon expire the client's segment */
};

static const uint32_t chunk_tokens[3] = { 10, 17, 14 };

static int setup(void **state)
{
	struct fixture *f = calloc(1, sizeof(*f));
	const char *args[] = { "--fuse-idle", "30", NULL };

	daemon_start(&f->d, args);
	f->c = daemon_client(&f->d, 0);
	struct kvb_model m8 = model, mz = model;

	snprintf(m8.name, sizeof(m8.name), "lm8");
	m8.store_codec = KVB_STORE_INT8;
	snprintf(mz.name, sizeof(mz.name), "lmz");
	f->name = "lm";
	assert_int_equal(kvb_model_register(f->c, &model, NULL), 0);
	assert_int_equal(kvb_model_register(f->c, &m8, NULL), 0);
	assert_int_equal(kvb_model_register(f->c, &mz, NULL), 0);
	for (uint32_t i = 0; i < 3; i++) {
		uint32_t ids[2] = { 91, i };
		size_t n = (size_t)L * 2 * chunk_tokens[i] * H * D;
		uint16_t *kv = malloc(n * 2);

		put_test_chunk(f->c, &model, ids, 2, chunk_tokens[i], 3 * i, i + 1, f->hash[i]);
		put_test_chunk(f->c, &m8, ids, 2, chunk_tokens[i], 3 * i, i + 1, f->hash[i]);
		/* the same values, low mantissa bits cleared: bitshuffle+LZ4 saves enough to be
		 * stored compressed */
		fill_f16(kv, n, i + 1);
		for (size_t e = 0; e < n; e++)
			kv[e] &= 0xff80;
		assert_int_equal(kvb_put(f->c, "lmz", f->hash[i], KVB_F16, chunk_tokens[i], 3 * i, kv,
					 n * 2, NULL), 0);
		free(kv);
	}
	f->fresh = malloc((size_t)L * 2 * N * ROW);
	fill_f16(f->fresh, (size_t)L * 2 * N * H * D, 4242);
	*state = f;
	return 0;
}

static int teardown(void **state)
{
	struct fixture *f = *state;

	daemon_end(&f->d, &f->c);
	free(f->fresh);
	free(f);
	return 0;
}

/* chunk 0 at 0, 5 fresh at 10, chunk 1 at 15, chunk 2 at 32: 46 tokens */
static size_t segments(struct fixture *f, struct kvb_segment *s)
{
	return fresh_after_first_chunk(s, f->hash, chunk_tokens, 3, 5);
}

static const uint8_t *fresh_row(struct fixture *f, uint32_t l, int kv, uint32_t t)
{
	return (const uint8_t *)f->fresh + (((size_t)l * 2 + (size_t)kv) * N + t) * ROW;
}

/*
 * The classic session's answer: ref[l] = fused K and V of all tokens ([L][2][N] rows);
 * layers the node computes whole hold its fresh rows. sel_hist[i] the selection
 * after check i.
 */
static void classic(struct fixture *f, const struct kvb_fuse_params *p, uint8_t *ref)
{
	struct kvb_segment segs[4];
	size_t ns = segments(f, segs);
	uint8_t *k = malloc((size_t)N * ROW), *v = malloc((size_t)N * ROW);
	kvb_fuse *fu;

	assert_int_equal(kvb_fuse_open(f->c, f->name, segs, ns, p, &fu, NULL, NULL), 0);
	for (uint32_t l = 0; l < L; l++) {
		const int32_t *rows;
		size_t nr;
		int fused = 0;

		if (l < kvb_fuse_next_layer(fu)) {
			/* before the first check layer: the node's own */
			memcpy(ref + (size_t)l * 2 * N * ROW, fresh_row(f, l, 0, 0), 2 * (size_t)N * ROW);
			continue;
		}
		nr = kvb_fuse_rows(fu, &rows);
		for (size_t i = 0; i < nr; i++) {
			memcpy(k + i * ROW, fresh_row(f, l, 0, (uint32_t)rows[i]), ROW);
			memcpy(v + i * ROW, fresh_row(f, l, 1, (uint32_t)rows[i]), ROW);
		}
		assert_int_equal(kvb_fuse_layer(f->c, fu, l, k, v, ref + (size_t)l * 2 * N * ROW,
						ref + ((size_t)l * 2 + 1) * N * ROW, &fused), 0);
		if (!fused)
			memcpy(ref + (size_t)l * 2 * N * ROW, fresh_row(f, l, 0, 0), 2 * (size_t)N * ROW);
	}
	assert_int_equal(kvb_fuse_close(f->c, &fu, NULL, NULL), 0);
	free(k);
	free(v);
}

/* Element d of head h of token t of layer l: K by ks when not NULL (kvb_kv_strides). */
static uint8_t *elem_at(const struct kvb_kv_layout *y, const struct kvb_kv_strides *ks, int kv,
			uint32_t l, uint32_t t, uint32_t h, uint32_t d)
{
	bool own = ks && !kv;
	size_t ts = own ? ks->token_stride : y->token_stride;
	uint8_t *p = (uint8_t *)(kv ? y->v : y->k) + (size_t)l * y->layer_stride +
		     h * (own ? ks->head_stride : y->head_stride) + d * (own ? ks->dim_stride : 2);

	if (y->page_tokens)
		return p + (size_t)y->pages[t / y->page_tokens] * y->page_stride +
		       (size_t)(t % y->page_tokens) * ts;
	return p + (size_t)t * ts;
}

static void put_row(const struct kvb_kv_layout *y, const struct kvb_kv_strides *ks, int kv,
		    uint32_t l, uint32_t t, const uint8_t *src)
{
	for (uint32_t h = 0; h < H; h++)
		for (uint32_t d = 0; d < D; d++)
			memcpy(elem_at(y, ks, kv, l, t, h, d), src + (h * D + d) * 2, 2);
}

static void get_row(const struct kvb_kv_layout *y, const struct kvb_kv_strides *ks, int kv,
		    uint32_t l, uint32_t t, uint8_t *dst)
{
	for (uint32_t h = 0; h < H; h++)
		for (uint32_t d = 0; d < D; d++)
			memcpy(dst + (h * D + d) * 2, elem_at(y, ks, kv, l, t, h, d), 2);
}

enum check_input { PACKED, STRIDED_REGION, STRIDED_HEAP };

/*
 * Drive a landing session the way an engine does, into layout y; then compare every
 * layer of y with ref. qkv: a [N][3 rows] buffer the strided check rows come from.
 * ks: K's own strides (kvb_fuse_open_into_strided), or NULL.
 */
static void landed_k(struct fixture *f, const struct kvb_fuse_params *p,
		     const struct kvb_kv_layout *y, const struct kvb_kv_strides *ks,
		     enum check_input in, uint8_t *qkv, const uint8_t *ref)
{
	struct kvb_segment segs[4];
	size_t ns = segments(f, segs);
	uint32_t first = p && p->n_checks ? p->check_layers[0] : 0, reuse = !(p && p->n_checks);
	int plane = p && p->metric == KVB_METRIC_KEY ? 0 : 1;
	size_t ci = 0;
	uint8_t row[ROW];
	kvb_fuse *fu;

	if (ks)
		assert_int_equal(kvb_fuse_open_into_strided(f->c, f->name, segs, ns, p, y, ks, &fu,
							    NULL, NULL), 0);
	else
		assert_int_equal(kvb_fuse_open_into(f->c, f->name, segs, ns, p, y, &fu, NULL, NULL),
				 0);
	for (uint32_t l = 0; l < L; l++) {
		const int32_t *rows, *dropped;
		size_t nr = kvb_fuse_rows(fu, &rows), nd, prev_n = nr;
		int32_t prev[N];
		bool check = !reuse && ci < p->n_checks && p->check_layers[ci] == l;

		memcpy(prev, rows, nr * sizeof(int32_t));
		if (!reuse && l <= first) {
			/* the node's own layers: every token */
			for (uint32_t t = 0; t < N; t++) {
				put_row(y, ks, 0, l, t, fresh_row(f, l, 0, t));
				put_row(y, ks, 1, l, t, fresh_row(f, l, 1, t));
			}
			assert_int_equal(kvb_fuse_wait(f->c, fu, l, 0), 0);
		} else {
			assert_int_equal(kvb_fuse_wait(f->c, fu, l, 10000), 0);
			for (size_t i = 0; i < nr; i++) {
				put_row(y, ks, 0, l, (uint32_t)rows[i], fresh_row(f, l, 0, (uint32_t)rows[i]));
				put_row(y, ks, 1, l, (uint32_t)rows[i], fresh_row(f, l, 1, (uint32_t)rows[i]));
			}
		}
		if (!check)
			continue;
		if (f->stale) {
			/* attached, then idle past --shm-idle: the daemon forgets it */
			assert_non_null(kvb_shared_buffer(f->c, 64));
			sleep(3);
		}
		/* The metric's plane (V) of the rows the session asks for. */
		if (in == PACKED) {
			uint8_t *pk = malloc(nr * ROW + 1);

			for (size_t i = 0; i < nr; i++)
				memcpy(pk + i * ROW, fresh_row(f, l, plane, (uint32_t)rows[i]), ROW);
			assert_int_equal(kvb_fuse_check(f->c, fu, l, pk, 0, &dropped, &nd), 0);
			free(pk);
		} else {
			/* rows of a fused QKV output: [q | k | v] per token, V at 2 * ROW */
			for (size_t i = 0; i < nr; i++) {
				memset(qkv + i * 3 * ROW, 0xa5, 2 * ROW);
				memcpy(qkv + i * 3 * ROW + 2 * ROW,
				       fresh_row(f, l, plane, (uint32_t)rows[i]), ROW);
			}
			assert_int_equal(kvb_fuse_check(f->c, fu, l, qkv + 2 * ROW, 3 * ROW, &dropped,
							&nd), 0);
		}
		ci++;
		/* dropped = the rows sent, less the new selection */
		nr = kvb_fuse_rows(fu, &rows);
		{
			size_t k = 0;

			for (size_t i = 0, j = 0; i < prev_n; i++) {
				while (j < nr && rows[j] < prev[i])
					j++;
				if (j == nr || rows[j] != prev[i]) {
					assert_true(k < nd);
					assert_int_equal(dropped[k], prev[i]);
					k++;
				}
			}
			assert_int_equal(k, nd);
		}
	}
	/* wrong calls on a landing session leave it usable */
	assert_int_equal(kvb_fuse_layer(f->c, fu, 0, row, row, NULL, NULL, NULL), -EINVAL);
	assert_int_equal(kvb_fuse_close(f->c, &fu, NULL, NULL), 0);
	for (uint32_t l = 0; l < L; l++)
		for (int kv = 0; kv < 2; kv++)
			for (uint32_t t = 0; t < N; t++) {
				get_row(y, ks, kv, l, t, row);
				if (memcmp(row, ref + (((size_t)l * 2 + (size_t)kv) * N + t) * ROW, ROW))
					fail_msg("layer %u %c token %u differs from the classic session",
						 l, kv ? 'V' : 'K', t);
			}
}

static void landed(struct fixture *f, const struct kvb_fuse_params *p,
		   const struct kvb_kv_layout *y, enum check_input in, uint8_t *qkv,
		   const uint8_t *ref)
{
	landed_k(f, p, y, NULL, in, qkv, ref);
}

static const uint32_t checks2[2] = { 1, 3 };
static const double ratios2[2] = { 0.5, 0.25 };

static void test_contiguous_matches_classic(void **state)
{
	struct fixture *f = *state;
	struct kvb_fuse_params p = { checks2, ratios2, 2, KVB_METRIC_VALUE };
	size_t layer = (size_t)N * ROW;
	uint8_t *ref = malloc((size_t)L * 2 * N * ROW);
	uint8_t *reg = kvb_region_alloc(f->c, 2 * L * layer + 3 * (size_t)N * ROW);
	struct kvb_kv_layout y = { reg, reg + L * layer, layer, ROW, D * 2, 0, 0, NULL, 0 };

	assert_non_null(reg);
	classic(f, &p, ref);
	/* direct landing; check rows packed, in place in the region, from the heap */
	landed(f, &p, &y, PACKED, NULL, ref);
	memset(reg, 0, 2 * L * layer);
	landed(f, &p, &y, STRIDED_REGION, reg + 2 * L * layer, ref);
	{
		uint8_t *heap = malloc(3 * (size_t)N * ROW);

		memset(reg, 0, 2 * L * layer);
		landed(f, &p, &y, STRIDED_HEAP, heap, ref);
		free(heap);
	}
	/* the key metric too */
	p.metric = KVB_METRIC_KEY;
	classic(f, &p, ref);
	memset(reg, 0, 2 * L * layer);
	landed(f, &p, &y, PACKED, NULL, ref);
	free(ref);
	assert_int_equal(kvb_region_free(f->c, reg), 0);
}

/*
 * Check rows from the heap cross in the client's segment; when the daemon no longer
 * knows it (expired here, as after a restart), the check goes again in a frame and
 * the session lands as it would have.
 */
static void test_check_after_segment_expired(void **state)
{
	struct fixture *f = *state;
	const char *args[] = { "--fuse-idle", "30", "--shm-idle", "1", NULL };
	struct kvb_fuse_params p = { checks2, ratios2, 2, KVB_METRIC_VALUE };
	size_t layer = (size_t)N * ROW;
	uint8_t *ref = malloc((size_t)L * 2 * N * ROW), *reg;
	struct kvb_kv_layout y;
	double bad0, bad1;

	kvb_close(&f->c);
	daemon_restart(&f->d, args);
	f->c = daemon_client(&f->d, 0);
	reg = kvb_region_alloc(f->c, 2 * L * layer);
	assert_non_null(reg);
	y = (struct kvb_kv_layout){ reg, reg + L * layer, layer, ROW, D * 2, 0, 0, NULL, 0 };
	classic(f, &p, ref);
	bad0 = daemon_stat(f->c, "errors_bad_shm");
	f->stale = true;
	landed(f, &p, &y, PACKED, NULL, ref);
	f->stale = false;
	/* each of the two checks was staged in the expired segment (rows from the heap: no
	 * other way to a bad_shm), refused, and sent again */
	bad1 = daemon_stat(f->c, "errors_bad_shm");
	assert_true(bad1 - bad0 >= 2);
	/* and the next one stages in a new segment */
	memset(reg, 0, 2 * L * layer);
	landed(f, &p, &y, PACKED, NULL, ref);
	assert_true(daemon_stat(f->c, "errors_bad_shm") == bad1);
	free(ref);
	assert_int_equal(kvb_region_free(f->c, reg), 0);
}

/*
 * Corrupt chunks under a landing session (verify = once, the default): a flipped byte
 * in a layer the session lands stops landing at that layer (kvb_fuse_wait: corrupt),
 * and the chunk is removed once the session is closed, as a GET removes one; a flipped
 * byte in a plane the session never reads (the first check layer's K, by the value
 * metric) is not served, and the next read of it (a GET) says corrupt and removes it.
 */
static void test_corrupt_chunks(void **state)
{
	struct fixture *f = *state;
	static const uint32_t ck[1] = { 1 };
	static const double rt[1] = { 0.5 };
	struct kvb_fuse_params p = { ck, rt, 1, KVB_METRIC_VALUE };
	size_t layer = (size_t)N * ROW, n1 = (size_t)L * 2 * 17 * H * D;
	size_t n2 = (size_t)L * 2 * 14 * H * D;
	uint16_t *kv1 = malloc(n1 * 2), *kv2 = malloc(n2 * 2);
	const char *args[] = { "--fuse-idle", "30", "--scrub-mb-per-s", "0", NULL };
	uint8_t *reg, *pk = malloc((size_t)N * ROW);
	struct kvb_kv_layout y = { NULL, NULL, layer, ROW, D * 2, 0, 0, NULL, 0 };
	struct kvb_segment segs[4];
	size_t ns = segments(f, segs), nr;
	const int32_t *rows;
	kvb_fuse *fu;
	int i;

	/* the scrub off: the reads below, not the scrub, are to find the flipped bytes */
	kvb_close(&f->c);
	daemon_restart(&f->d, args);
	f->c = daemon_client(&f->d, 0);
	reg = kvb_region_alloc(f->c, 2 * L * layer);
	y.k = reg;
	y.v = reg + L * layer;
	assert_non_null(reg);
	fill_f16(kv1, n1, 2); /* chunk 1 (17 tokens) and chunk 2 (14) as setup stored them */
	fill_f16(kv2, n2, 3);
	/* chunk 1: layer 3's V; chunk 2: layer 1's K; every copy of each: a small value sits
	 * in a leaf page, whose older copies LMDB's later transactions left in free pages */
	flip_in_data_file(f->d.data_dir, (const uint8_t *)(kv1 + (3 * 2 + 1) * 17 * H * D) + 64,
			  true);
	flip_in_data_file(f->d.data_dir, (const uint8_t *)(kv2 + (1 * 2 + 0) * 14 * H * D) + 64,
			  true);
	assert_int_equal(kvb_fuse_open_into(f->c, "lm", segs, ns, &p, &y, &fu, NULL, NULL), 0);
	/* the node's own layers 0 and 1, then the check (landing runs ahead meanwhile, and
	 * may have stopped at layer 3 already: every wait would say so from then on) */
	nr = kvb_fuse_rows(fu, &rows);
	for (size_t j = 0; j < nr; j++)
		memcpy(pk + j * ROW, fresh_row(f, 1, 1, (uint32_t)rows[j]), ROW);
	assert_int_equal(kvb_fuse_check(f->c, fu, 1, pk, 0, NULL, NULL), 0);
	assert_int_equal(kvb_fuse_wait(f->c, fu, 3, 10000), KVB_E_CORRUPT);
	assert_non_null(strstr(kvb_last_error(f->c), "stopped landing at layer 3"));
	assert_int_equal(kvb_fuse_close(f->c, &fu, NULL, NULL), 0);
	for (i = 0; i < 500 && daemon_stat(f->c, "corrupt_removed") < 1; i++)
		usleep(10000);
	assert_int_equal((uint64_t)daemon_stat(f->c, "corrupt_removed"), 1);
	assert_int_equal(kvb_get(f->c, "lm", f->hash[1], 0, L, kv1, n1 * 2, NULL),
			 KVB_E_NOT_FOUND);
	/* chunk 2 served nothing corrupt; its next whole read finds it */
	assert_int_equal(kvb_get(f->c, "lm", f->hash[2], 0, L, kv2, n2 * 2, NULL),
			 KVB_E_CORRUPT);
	assert_int_equal((uint64_t)daemon_stat(f->c, "corrupt_removed"), 2);
	assert_int_equal(kvb_get(f->c, "lm", f->hash[2], 0, L, kv2, n2 * 2, NULL),
			 KVB_E_NOT_FOUND);
	/* chunk 0 is sound and lands */
	assert_int_equal(kvb_get(f->c, "lm", f->hash[0], 0, L, kv2, (size_t)L * 2 * 10 * ROW,
				 NULL), 0);
	free(kv1);
	free(kv2);
	free(pk);
	assert_int_equal(kvb_region_free(f->c, reg), 0);
}

static void test_paged_and_padded_match_classic(void **state)
{
	struct fixture *f = *state;
	struct kvb_fuse_params p = { checks2, ratios2, 2, KVB_METRIC_VALUE };
	uint8_t *ref = malloc((size_t)L * 2 * N * ROW);
	/* paged: blocks of 4 tokens, K and V interleaved in a block, blocks shuffled */
	enum { PT = 4, NB = 16 };
	uint32_t pages[NB];
	size_t block = 2 * PT * ROW, layer = NB * block;
	uint8_t *reg = kvb_region_alloc(f->c, L * layer);
	struct kvb_kv_layout y = { reg, reg + PT * ROW, layer, ROW, D * 2, PT, block, pages, NB };

	assert_non_null(reg);
	for (uint32_t i = 0; i < NB; i++)
		pages[i] = (i * 7 + 3) % NB;
	classic(f, &p, ref);
	landed(f, &p, &y, PACKED, NULL, ref);
	assert_int_equal(kvb_region_free(f->c, reg), 0);
	/* padded heads: [L][N][H][D + 4], K then V */
	{
		size_t hs = (D + 4) * 2, ts = H * hs, ls = (size_t)N * ts;
		uint8_t *r2 = kvb_region_alloc(f->c, 2 * L * ls);
		struct kvb_kv_layout y2 = { r2, r2 + L * ls, ls, ts, hs, 0, 0, NULL, 0 };

		assert_non_null(r2);
		landed(f, &p, &y2, PACKED, NULL, ref);
		assert_int_equal(kvb_region_free(f->c, r2), 0);
	}
	free(ref);
}

/*
 * vLLM's CPU cache: per block and head, K transposed [D][PT], then V rows [PT][D];
 * blocks shuffled. K lands by its own strides, with check layers and reuse only.
 */
static void test_transposed_k_matches_classic(void **state)
{
	struct fixture *f = *state;
	struct kvb_fuse_params p = { checks2, ratios2, 2, KVB_METRIC_VALUE };
	struct kvb_fuse_params none = { NULL, NULL, 0, KVB_METRIC_VALUE };
	uint8_t *ref = malloc((size_t)L * 2 * N * ROW);
	enum { PT = 16, NB = 5 };
	uint32_t pages[NB] = { 3, 0, 4, 1, 2 };
	size_t hs = 2 * PT * D * 2, block = H * hs, layer = NB * block;
	uint8_t *reg = kvb_region_alloc(f->c, L * layer);
	struct kvb_kv_layout y = { reg, reg + PT * D * 2, layer, D * 2, hs, PT, block, pages, NB };
	struct kvb_kv_strides ks = { 2, hs, PT * 2 };
	kvb_fuse *fu;
	struct kvb_segment segs[4];
	size_t ns = segments(f, segs);

	assert_non_null(reg);
	classic(f, &p, ref);
	landed_k(f, &p, &y, &ks, PACKED, NULL, ref);
	memset(reg, 0, L * layer);
	classic(f, &none, ref);
	landed_k(f, &none, &y, &ks, PACKED, NULL, ref);
	/* the K side is checked against the region by its own strides */
	ks.dim_stride = layer;
	assert_int_equal(kvb_fuse_open_into_strided(f->c, "lm", segs, ns, NULL, &y, &ks, &fu, NULL,
						    NULL), KVB_E_BAD_SHM);
	assert_non_null(strstr(kvb_last_error(f->c), "spans"));
	ks.dim_stride = SIZE_MAX / 4;
	assert_int_equal(kvb_fuse_open_into_strided(f->c, "lm", segs, ns, NULL, &y, &ks, &fu, NULL,
						    NULL), KVB_E_BAD_SHAPE);
	ks.dim_stride = 0;
	assert_int_equal(kvb_fuse_open_into_strided(f->c, "lm", segs, ns, NULL, &y, &ks, &fu, NULL,
						    NULL), -EINVAL);
	assert_non_null(strstr(kvb_last_error(f->c), "dim_stride"));
	/* NULL strides: kvb_fuse_open_into() */
	assert_int_equal(kvb_fuse_open_into_strided(f->c, "lm", segs, ns, NULL, &y, NULL, &fu, NULL,
						    NULL), 0);
	assert_int_equal(kvb_fuse_close(f->c, &fu, NULL, NULL), 0);
	free(ref);
	assert_int_equal(kvb_region_free(f->c, reg), 0);
}

/*
 * Quantized and compressed stores land in a paged layout (decoded whole, then
 * scattered) byte for byte as the classic session serves them; the compressed
 * model's chunks really are stored compressed.
 */
static void test_paged_other_codecs(void **state)
{
	struct fixture *f = *state;
	struct kvb_fuse_params p = { checks2, ratios2, 2, KVB_METRIC_KEY };
	uint8_t *ref = malloc((size_t)L * 2 * N * ROW);
	enum { PT = 8, NB = 6 };
	uint32_t pages[NB] = { 5, 0, 3, 1, 4, 2 };
	/* [layers][blocks][heads][2][PT][D]: per block and head K rows, then V rows */
	size_t hs = 2 * PT * D * 2, block = H * hs, layer = NB * block;
	uint8_t *reg = kvb_region_alloc(f->c, L * layer);
	struct kvb_kv_layout y = { reg, reg + PT * D * 2, layer, D * 2, hs, PT, block, pages, NB };
	const char *names[2] = { "lm8", "lmz" };
	struct kvb_chunk_info ci[2];

	assert_non_null(reg);
	memcpy(ci[0].hash, f->hash[1], KVB_HASH_LEN);
	memcpy(ci[1].hash, f->hash[1], KVB_HASH_LEN);
	assert_int_equal(kvb_lookup(f->c, "lmz", &f->hash[1], 1, &ci[0]), 0);
	assert_int_equal(kvb_lookup(f->c, "lm8", &f->hash[1], 1, &ci[1]), 0);
	assert_true(ci[0].found && ci[1].found);
	assert_true(ci[0].stored_bytes < ci[0].raw_bytes * 9 / 10);
	/* int8 codes plus scales: under 3/4 of f16 */
	assert_true(ci[1].stored_bytes < ci[1].raw_bytes * 3 / 4);
	for (int i = 0; i < 2; i++) {
		f->name = names[i];
		classic(f, &p, ref);
		memset(reg, 0, L * layer);
		landed(f, &p, &y, PACKED, NULL, ref);
	}
	{ /* and with K transposed per page, as vLLM's CPU cache keeps it */
		struct kvb_kv_strides ks = { 2, hs, PT * 2 };

		for (int i = 0; i < 2; i++) {
			f->name = names[i];
			classic(f, &p, ref);
			memset(reg, 0, L * layer);
			landed_k(f, &p, &y, &ks, PACKED, NULL, ref);
		}
	}
	f->name = "lm";
	free(ref);
	assert_int_equal(kvb_region_free(f->c, reg), 0);
}

static void test_reuse_only(void **state)
{
	struct fixture *f = *state;
	size_t layer = (size_t)N * ROW;
	uint8_t *ref = malloc((size_t)L * 2 * N * ROW);
	uint8_t *reg = kvb_region_alloc(f->c, 2 * L * layer);
	struct kvb_kv_layout y = { reg, reg + L * layer, layer, ROW, D * 2, 0, 0, NULL, 0 };
	struct kvb_fuse_params none = { NULL, NULL, 0, KVB_METRIC_VALUE };
	struct kvb_segment segs[4];
	size_t ns = segments(f, segs);
	const int32_t *rows;
	kvb_fuse *fu;

	assert_non_null(reg);
	/* classic reuse-only: from layer 0, the fresh tokens' rows only */
	assert_int_equal(kvb_fuse_open(f->c, "lm", segs, ns, NULL, &fu, NULL, NULL), 0);
	assert_int_equal(kvb_fuse_next_layer(fu), 0);
	assert_int_equal(kvb_fuse_rows(fu, &rows), 5);
	for (int i = 0; i < 5; i++)
		assert_int_equal(rows[i], 10 + i);
	assert_int_equal(kvb_fuse_close(f->c, &fu, NULL, NULL), 0);
	classic(f, &none, ref);
	landed(f, &none, &y, PACKED, NULL, ref);
	/* a reuse-only landing session takes no layer requests */
	assert_int_equal(kvb_fuse_open_into(f->c, "lm", segs, ns, NULL, &y, &fu, NULL, NULL), 0);
	assert_int_equal(kvb_fuse_check(f->c, fu, 0, reg, 0, NULL, NULL), KVB_E_BAD_ARGUMENT);
	assert_non_null(strstr(kvb_last_error(f->c), "reuse-only"));
	assert_int_equal(kvb_fuse_close(f->c, &fu, NULL, NULL), 0);
	free(ref);
	assert_int_equal(kvb_region_free(f->c, reg), 0);
}

static void test_errors(void **state)
{
	struct fixture *f = *state;
	struct kvb_fuse_params p = { checks2, ratios2, 2, KVB_METRIC_VALUE };
	size_t layer = (size_t)N * ROW;
	uint8_t *reg = kvb_region_alloc(f->c, 2 * L * layer);
	struct kvb_kv_layout y = { reg, reg + L * layer, layer, ROW, D * 2, 0, 0, NULL, 0 };
	struct kvb_segment segs[4];
	size_t ns = segments(f, segs);
	uint8_t *heap = malloc(2 * L * layer);
	kvb_fuse *fu;
	uint32_t pages[2] = { 0, 1 };

	assert_non_null(reg);
	/* the layout must lie in a region, and fit in it */
	y.k = heap;
	assert_int_equal(kvb_fuse_open_into(f->c, "lm", segs, ns, &p, &y, &fu, NULL, NULL),
			 -EINVAL);
	y.k = reg;
	y.layer_stride = 2 * layer;
	assert_int_equal(kvb_fuse_open_into(f->c, "lm", segs, ns, &p, &y, &fu, NULL, NULL),
			 KVB_E_BAD_SHM);
	assert_non_null(strstr(kvb_last_error(f->c), "spans"));
	y.layer_stride = SIZE_MAX / 2;
	assert_int_equal(kvb_fuse_open_into(f->c, "lm", segs, ns, &p, &y, &fu, NULL, NULL),
			 KVB_E_BAD_SHAPE);
	y.layer_stride = layer;
	/* a block table too short for the tokens */
	y.page_tokens = 4;
	y.pages = pages;
	y.n_pages = 2;
	assert_int_equal(kvb_fuse_open_into(f->c, "lm", segs, ns, &p, &y, &fu, NULL, NULL),
			 KVB_E_BAD_SHAPE);
	assert_non_null(strstr(kvb_last_error(f->c), "block table"));
	y.page_tokens = 0;
	y.pages = NULL;
	y.n_pages = 0;
	/* a good session: requests for other than the next check layer are refused */
	assert_int_equal(kvb_fuse_open_into(f->c, "lm", segs, ns, &p, &y, &fu, NULL, NULL), 0);
	assert_int_equal(kvb_fuse_check(f->c, fu, 2, heap, 0, NULL, NULL), KVB_E_BAD_ARGUMENT);
	assert_non_null(strstr(kvb_last_error(f->c), "next check layer 1"));
	/* stride below the row */
	assert_int_equal(kvb_fuse_check(f->c, fu, 1, heap, ROW - 2, NULL, NULL), -EINVAL);
	/* still usable */
	assert_int_equal(kvb_fuse_check(f->c, fu, 1, heap, 0, NULL, NULL), 0);
	assert_int_equal(kvb_fuse_wait(f->c, fu, L - 1, 10000), 0);
	assert_int_equal(kvb_fuse_close(f->c, &fu, NULL, NULL), 0);
	free(heap);
	assert_int_equal(kvb_region_free(f->c, reg), 0);
	assert_int_equal(kvb_region_free(f->c, reg), -EINVAL);
}

/*
 * Head strides that wrap the layout's extent (issue 30, defect 1): with 2 KV heads, a
 * head stride of 2^64-1-j puts head 1 at j+1 bytes before the segment. The daemon must
 * refuse the layout bad_shape (for V's strides and for K's own), write nothing, and
 * serve on. A second client's region, allocated after the first (the kernel maps it
 * just below, past the daemon's guard page), is the neighbour a wrapped write would
 * hit: it must keep its bytes, and the daemon must live (a write into the guard page
 * kills it).
 */
static void test_head_strides_that_wrap(void **state)
{
	struct fixture *f = *state;
	struct kvb_segment segs[4];
	size_t ns = segments(f, segs), layer = (size_t)N * ROW, size = 2 * L * layer;
	kvb_client *other = daemon_client(&f->d, 0);
	uint8_t *reg = kvb_region_alloc(f->c, size), *next = kvb_region_alloc(other, size);

	assert_non_null(reg);
	assert_non_null(next);
	memset(next, 0x11, size);
	for (int side = 0; side < 2; side++)
		for (size_t j = 0; j < 4; j++) {
			struct kvb_kv_layout y = { reg, reg + L * layer, layer, ROW, D * 2, 0, 0,
						   NULL, 0 };
			struct kvb_kv_strides ks = { ROW, D * 2, 2 };
			struct timespec nap = { 0, 50 * 1000000 };
			kvb_fuse *fu = NULL;
			int rc;

			memset(reg, 0x5a, size);
			if (side)
				ks.head_stride = SIZE_MAX - j;
			else
				y.head_stride = SIZE_MAX - j;
			/* reuse only: the daemon lands every layer at once */
			rc = kvb_fuse_open_into_strided(f->c, "lm", segs, ns, NULL, &y,
							side ? &ks : NULL, &fu, NULL, NULL);
			if (rc == 0) {
				nanosleep(&nap, NULL);
				kvb_fuse_close(f->c, &fu, NULL, NULL);
				fail_msg("%s head stride 2^64-%zu accepted (the extent wrapped)",
					 side ? "K's own" : "V's", j + 1);
			}
			assert_int_equal(rc, KVB_E_BAD_SHAPE);
			assert_non_null(strstr(kvb_last_error(f->c), "overflow"));
			nanosleep(&nap, NULL);
			for (size_t i = 0; i < size; i++) {
				if (reg[i] != 0x5a)
					fail_msg("byte %zu of the refused layout's region written", i);
				if (next[i] != 0x11)
					fail_msg("byte %zu of the neighbouring region written", i);
			}
			assert_int_equal(kvb_ping(f->c, NULL, 0), 0);
		}
	assert_int_equal(kvb_region_free(other, next), 0);
	assert_int_equal(kvb_region_free(f->c, reg), 0);
	kvb_close(&other);
}

/* After close returns nothing more lands: the node may reuse its buffers at once. */
static void test_nothing_lands_after_close(void **state)
{
	struct fixture *f = *state;
	struct kvb_segment segs[4];
	size_t ns = segments(f, segs), layer = (size_t)N * ROW;
	uint8_t *reg = kvb_region_alloc(f->c, 2 * L * layer);
	struct kvb_kv_layout y = { reg, reg + L * layer, layer, ROW, D * 2, 0, 0, NULL, 0 };

	assert_non_null(reg);
	for (int round = 0; round < 200; round++) {
		kvb_fuse *fu;
		struct timespec ts = { 0, 2000000 };

		assert_int_equal(kvb_fuse_open_into(f->c, "lm", segs, ns, NULL, &y, &fu, NULL, NULL),
				 0);
		assert_int_equal(kvb_fuse_close(f->c, &fu, NULL, NULL), 0);
		memset(reg, 0x5a, 2 * L * layer);
		if (round % 50 == 0) {
			nanosleep(&ts, NULL);
			for (size_t i = 0; i < 2 * L * layer; i++)
				if (reg[i] != 0x5a)
					fail_msg("round %d: byte %zu written after close", round, i);
		}
	}
	assert_int_equal(kvb_region_free(f->c, reg), 0);
}

/*
 * A layer of megabytes (8 heads x 128, f16: the rotate's fast path) lands paged as
 * vLLM's CPU cache is, with non-temporal stores (LAND_STREAM_MIN), through both of
 * landing's paths (a later check layer's slot, and rotated straight from the store):
 * every chunk token the node did not recompute is what the contiguous layout (one
 * memcpy-sized write per chunk, never streamed) got, and no byte between heads or
 * past the chunk moved.
 */
enum { WL = 4, WH = 8, WD = 128, WROW = WH * WD * 2, WFRESH = 7, WCHUNK = 600,
       WN = WFRESH + WCHUNK, WPT = 128, WNB = (WN + WPT - 1) / WPT };

static size_t land_wide(kvb_client *c, const struct kvb_segment *segs,
			const struct kvb_kv_layout *y, const uint8_t *vfresh, int32_t *sel)
{
	/* layer 2 is a later check layer: it lands from its slot, layer 3 from the store */
	uint32_t checks[2] = { 1, 2 };
	double ratios[2] = { 0.3, 0.15 };
	struct kvb_fuse_params p = { checks, ratios, 2, KVB_METRIC_VALUE };
	const int32_t *rows;
	size_t nr = 0;
	kvb_fuse *fu;

	assert_int_equal(kvb_fuse_open_into(c, "lmw", segs, 2, &p, y, &fu, NULL, NULL), 0);
	for (uint32_t l = 0; l < WL; l++) {
		nr = kvb_fuse_rows(fu, &rows);
		assert_int_equal(kvb_fuse_wait(c, fu, l, l <= checks[0] ? 0 : 10000), 0);
		if (l == checks[0] || l == checks[1]) {
			uint8_t *pk = malloc(nr * WROW);

			for (size_t i = 0; i < nr; i++)
				memcpy(pk + i * WROW, vfresh + (size_t)rows[i] * WROW, WROW);
			assert_int_equal(kvb_fuse_check(c, fu, l, pk, 0, NULL, NULL), 0);
			free(pk);
			nr = kvb_fuse_rows(fu, &rows);
		}
	}
	memcpy(sel, rows, nr * sizeof(int32_t));
	assert_int_equal(kvb_fuse_close(c, &fu, NULL, NULL), 0);
	return nr;
}

static void test_wide_paged_streams(void **state)
{
	struct fixture *f = *state;
	struct kvb_model m = { .name = "lmw", .num_layers = WL, .num_kv_heads = WH,
			       .head_dim = WD, .dtype = KVB_F16, .rope_theta = 1e6 };
	size_t hb = WD * 2, hs = 2 * WPT * hb, ps = WH * hs, pls = WNB * ps;
	size_t cls = (size_t)WN * WROW, kv_bytes = (size_t)WL * 2 * WCHUNK * WROW;
	uint16_t *kv = malloc(kv_bytes);
	uint8_t *vfresh = malloc((size_t)WN * WROW);
	uint8_t *cont = kvb_region_alloc(f->c, 2 * WL * cls);
	uint8_t *paged = kvb_region_alloc(f->c, WL * pls);
	uint32_t pages[WNB];
	struct kvb_kv_layout yc = { cont, cont + WL * cls, cls, WROW, hb, 0, 0, NULL, 0 };
	struct kvb_kv_layout yp = { paged, paged + WPT * hb, pls, hb, hs, WPT, ps, pages, WNB };
	struct kvb_segment segs[2];
	int32_t sel_c[WN], sel_p[WN];
	size_t n_c, n_p;
	uint32_t ids[2] = { 93, 1 };

	assert_non_null(cont);
	assert_non_null(paged);
	assert_int_equal(kvb_model_register(f->c, &m, NULL), 0);
	fill_f16(kv, kv_bytes / 2, 77);
	fill_f16((uint16_t *)vfresh, (size_t)WN * WROW / 2, 78);
	memset(segs, 0, sizeof(segs));
	kvb_chunk_hash(ids, 2, segs[1].hash);
	/* stored at 40, lands at WFRESH: every K row is re-rotated */
	assert_int_equal(kvb_put(f->c, "lmw", segs[1].hash, KVB_F16, WCHUNK, 40, kv, kv_bytes,
				 NULL), 0);
	segs[0].fresh = 1;
	segs[0].count = WFRESH;
	segs[1].pos = WFRESH;
	for (uint32_t i = 0; i < WNB; i++)
		pages[i] = (i * 3 + 1) % WNB;
	memset(cont, 0x5a, 2 * WL * cls);
	memset(paged, 0x5a, WL * pls);
	n_c = land_wide(f->c, segs, &yc, vfresh, sel_c);
	n_p = land_wide(f->c, segs, &yp, vfresh, sel_p);
	assert_int_equal(n_c, n_p);
	assert_memory_equal(sel_c, sel_p, n_c * sizeof(int32_t));
	for (uint32_t l = 2; l < WL; l++)
		for (int v = 0; v < 2; v++)
			for (uint32_t t = 0, j = 0; t < WNB * WPT; t++) {
				bool chunk = t >= WFRESH && t < WN, node = j < n_c &&
								   (uint32_t)sel_c[j] == t;
				uint8_t *pt = paged + l * pls + pages[t / WPT] * ps + v * WPT * hb +
					      (t % WPT) * hb;

				j += node;
				for (uint32_t h = 0; h < WH; h++) {
					const uint8_t *want = cont + (size_t)v * WL * cls +
							      l * cls + (size_t)t * WROW + h * hb;

					if (chunk && !node && memcmp(pt + h * hs, want, hb))
						fail_msg("layer %u %c token %u head %u differs", l,
							 v ? 'V' : 'K', t, h);
					if (!chunk)
						for (size_t b = 0; b < hb; b++)
							if (pt[h * hs + b] != 0x5a)
								fail_msg("layer %u token %u: written "
									 "outside the chunk", l, t);
				}
			}
	free(kv);
	free(vfresh);
	assert_int_equal(kvb_region_free(f->c, cont), 0);
	assert_int_equal(kvb_region_free(f->c, paged), 0);
}

/*
 * A tensor-parallel rank's share: a head range lands the stored heads [h0, h0 + 1) as
 * the node's only head, equal to those heads of a full landing, contiguous and paged
 * with K transposed; the fresh tokens' rows untouched. Refused: a range past the
 * model's heads, a range with check layers (reuse-only), head_begin without a count.
 */
static void test_head_range(void **state)
{
	struct fixture *f = *state;
	size_t layer = (size_t)N * ROW, hb = D * 2, lb = (size_t)N * hb;
	enum { PT = 4, NB = 12 };
	size_t kpart = (size_t)D * PT * 2, ps = 2 * kpart, ls = NB * ps;
	uint8_t *full = kvb_region_alloc(f->c, 2 * L * layer);
	uint8_t *one = kvb_region_alloc(f->c, 2 * L * lb + L * ls);
	uint8_t *paged = one + 2 * L * lb;
	struct kvb_kv_layout ya = { full, full + L * layer, layer, ROW, hb, 0, 0, NULL, 0 };
	struct kvb_kv_layout yb = { one, one + L * lb, lb, hb, hb, 0, 0, NULL, 0 };
	uint32_t pages[NB];
	struct kvb_kv_layout yp = { paged, paged + kpart, ls, hb, hb, PT, ps, pages, NB };
	struct kvb_kv_strides kt = { 2, kpart, PT * 2 };
	struct kvb_fuse_params p = { (uint32_t[]){ 1 }, (double[]){ 0.5 }, 1, KVB_METRIC_VALUE };
	struct kvb_segment segs[4];
	size_t ns = segments(f, segs);
	kvb_fuse *fu;

	assert_non_null(full);
	assert_non_null(one);
	for (uint32_t i = 0; i < NB; i++)
		pages[i] = (i * 5 + 7) % NB;
	assert_int_equal(kvb_fuse_open_into(f->c, "lm", segs, ns, NULL, &ya, &fu, NULL, NULL), 0);
	for (uint32_t l = 0; l < L; l++)
		assert_int_equal(kvb_fuse_wait(f->c, fu, l, 10000), 0);
	assert_int_equal(kvb_fuse_close(f->c, &fu, NULL, NULL), 0);
	for (uint32_t h0 = 0; h0 < H; h0++) {
		struct kvb_land_opts o = { sizeof(o), NULL, NULL, h0, 1 };
		struct kvb_land_opts ot = { sizeof(ot), &kt, NULL, h0, 1 };

		memset(one, 0x5a, 2 * L * lb + L * ls);
		assert_int_equal(kvb_fuse_open_into_opts(f->c, "lm", segs, ns, NULL, &yb, &o, &fu,
							 NULL, NULL),
				 0);
		for (uint32_t l = 0; l < L; l++)
			assert_int_equal(kvb_fuse_wait(f->c, fu, l, 10000), 0);
		assert_int_equal(kvb_fuse_close(f->c, &fu, NULL, NULL), 0);
		assert_int_equal(kvb_fuse_open_into_opts(f->c, "lm", segs, ns, NULL, &yp, &ot, &fu,
							 NULL, NULL),
				 0);
		for (uint32_t l = 0; l < L; l++)
			assert_int_equal(kvb_fuse_wait(f->c, fu, l, 10000), 0);
		assert_int_equal(kvb_fuse_close(f->c, &fu, NULL, NULL), 0);
		for (uint32_t l = 0; l < L; l++)
			for (int kv = 0; kv < 2; kv++)
				for (uint32_t t = 0; t < N; t++) {
					bool fresh = t >= 10 && t < 15;
					const uint8_t *want = full + (size_t)kv * L * layer +
							      l * layer + (size_t)t * ROW + h0 * hb;
					const uint8_t *got = one + (size_t)kv * L * lb + l * lb +
							     (size_t)t * hb;
					uint8_t *pg = paged + l * ls + pages[t / PT] * ps;

					for (uint32_t d = 0; d < D; d++) {
						/* K: [D][PT] per block; V: [PT][D] after it */
						const uint8_t *pe = kv ? pg + kpart + (t % PT) * hb + d * 2
								       : pg + d * PT * 2 + (t % PT) * 2;

						if (fresh) {
							if (got[d * 2] != 0x5a || pe[0] != 0x5a)
								fail_msg("fresh token %u written", t);
						} else if (memcmp(got + d * 2, want + d * 2, 2) ||
							   memcmp(pe, want + d * 2, 2)) {
							fail_msg("head %u layer %u %c token %u dim %u "
								 "differs", h0, l, kv ? 'V' : 'K', t, d);
						}
					}
				}
	}
	{
		struct kvb_land_opts past = { sizeof(past), NULL, NULL, 1, 2 };
		struct kvb_land_opts mine = { sizeof(mine), NULL, NULL, 1, 1 };
		struct kvb_land_opts nocount = { sizeof(nocount), NULL, NULL, 1, 0 };

		assert_int_equal(kvb_fuse_open_into_opts(f->c, "lm", segs, ns, NULL, &yb, &past, &fu,
							 NULL, NULL),
				 KVB_E_BAD_SHAPE);
		assert_non_null(strstr(kvb_last_error(f->c), "heads [1, 3)"));
		struct kvb_fuse_params pa = { checks2, ratios2, 2, KVB_METRIC_ATTENTION };

		/* a head range blends by the value or key metric (the ranks sum deviations;
		 * test_land_device's ranks_blend_as_one), not by attention */
		assert_int_equal(kvb_fuse_open_into_opts(f->c, "lm", segs, ns, &pa, &yb, &mine, &fu,
							 NULL, NULL),
				 KVB_E_BAD_ARGUMENT);
		assert_non_null(strstr(kvb_last_error(f->c), "value or key metric"));
		/* by the value metric it opens; a plain check is then refused (the two-step one
		 * is ranks_blend_as_one's) */
		assert_int_equal(kvb_fuse_open_into_opts(f->c, "lm", segs, ns, &p, &yb, &mine, &fu,
							 NULL, NULL),
				 0);
		assert_int_equal(kvb_fuse_close(f->c, &fu, NULL, NULL), 0);
		assert_int_equal(kvb_fuse_open_into_opts(f->c, "lm", segs, ns, NULL, &yb, &nocount,
							 &fu, NULL, NULL),
				 -EINVAL);
	}
	assert_int_equal(kvb_region_free(f->c, full), 0);
	assert_int_equal(kvb_region_free(f->c, one), 0);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		fixture_test(test_contiguous_matches_classic),
		fixture_test(test_check_after_segment_expired),
		fixture_test(test_corrupt_chunks),
		fixture_test(test_paged_and_padded_match_classic),
		fixture_test(test_transposed_k_matches_classic),
		fixture_test(test_paged_other_codecs),
		fixture_test(test_reuse_only),
		fixture_test(test_errors),
		fixture_test(test_head_strides_that_wrap),
		fixture_test(test_nothing_lands_after_close),
		fixture_test(test_wide_paged_streams),
		fixture_test(test_head_range),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
