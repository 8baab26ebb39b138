/*
 * Landing into device memory (kvb_fuse_open_into_device) through the real kvblendd:
 * the node's KV cache is a device allocation (nodemem.h: on the emulated device a
 * sealed memfd, on CUDA device memory of this process exported by its IPC handle),
 * laid out as vLLM's GPU backends lay it out (each token's K then V per head,
 * paged; LBNHC and LBHNC), and every byte of it must equal what the host landing
 * (kvb_fuse_open_into) writes into a region with the same layout. Two sessions land
 * into one allocation at once (mapped once). Refused with the reason, the daemon
 * serving on: a daemon without a device, another GPU, a handle that maps nothing,
 * a layout beyond the allocation, K by its own strides. Landing handles are no bearer
 * capabilities (issue 55, defect 3): another process naming this one's descriptor
 * handle, or memory by a /proc path (the daemon's own descriptors included), lands
 * nothing anywhere; the daemon's own segments are never taken as device memory.
 *
 * The device is KVBLEND_TEST_DEVICE's (cuda through gpu_run.sh), else emulated.
 */
#include <errno.h>
#include <inttypes.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cmocka.h>

#include "blend/nodemem.h"
#include "proto/fdsock.h"
#include "proto/wire.h"
#include "tests/integration/harness.h"
#include "tests/integration/rawreq.h"

#define L 4
#define H 2
#define D 8
#define HB (D * 2)	  /* a head's bytes (f16) */
#define PT 4		  /* tokens a block */
#define BLOCKS 24
#define N 46 /* chunk 0 (10), 5 fresh, chunk 1 (17), chunk 2 (14) */
#define LAYER_BYTES ((size_t)BLOCKS * PT * H * 2 * HB)
#define CACHE_BYTES ((size_t)L * LAYER_BYTES)

static const char *which = "emulated";
static const uint32_t chunk_tokens[3] = { 10, 17, 14 };

struct fixture {
	struct daemon d;
	kvb_client *c;
	uint8_t hash[3][KVB_HASH_LEN];
	struct nodemem mem;
	uint8_t *region; /* the host landing's cache, then the progress words */
	uint32_t pages[BLOCKS];
};

static int setup(void **state)
{
	struct fixture *f = calloc(1, sizeof(*f));
	const char *args[] = { "--device", which, "--fuse-idle", "30", NULL };
	struct kvb_model m = TEST_MODEL_F16("lm", L, H, D);
	char err[256] = "";
	int rc;

	rc = nodemem_open(&f->mem, which, CACHE_BYTES, err, sizeof(err));
	if (rc == 77) {
		printf("skip: %s\n", err);
		exit(77);
	}
	assert_int_equal(rc, 0);
	daemon_start(&f->d, args);
	f->c = daemon_client(&f->d, 0);
	if (!f->mem.dv) /* emulated: the memfd handed over, its handle the daemon's word */
		assert_int_equal(kvb_device_handle_from_fd(f->c, f->mem.fd, f->mem.handle), 0);
	assert_int_equal(kvb_model_register(f->c, &m, NULL), 0);
	for (uint32_t i = 0; i < 3; i++) {
		uint32_t ids[2] = { 77, i };

		put_test_chunk(f->c, &m, ids, 2, chunk_tokens[i], 5 * i, i + 11, f->hash[i]);
	}
	f->region = kvb_region_alloc(f->c, CACHE_BYTES + 4096);
	assert_non_null(f->region);
	/* a block table out of order, as a paged cache's is */
	for (uint32_t i = 0; i < BLOCKS; i++)
		f->pages[i] = (i * 7 + 3) % BLOCKS;
	*state = f;
	return 0;
}

static int teardown(void **state)
{
	struct fixture *f = *state;

	kvb_region_free(f->c, f->region);
	daemon_end(&f->d, &f->c);
	nodemem_close(&f->mem);
	free(f);
	return 0;
}

/* chunk 0 at 0, 5 fresh at 10, chunk 1 at 15, chunk 2 at 32 */
static size_t segments(struct fixture *f, struct kvb_segment *s)
{
	return fresh_after_first_chunk(s, f->hash, chunk_tokens, 3, 5);
}

/*
 * The same chunks in another order: chunk 2 at 0, 5 fresh at 14, chunk 1 at 19, chunk
 * 0 at 36. Every position's rows differ from segments()'s, so that rows another test
 * left in a cached staging buffer cannot pass for this session's.
 */
static size_t segments_alt(struct fixture *f, struct kvb_segment *s)
{
	memset(s, 0, 4 * sizeof(*s));
	memcpy(s[0].hash, f->hash[2], KVB_HASH_LEN);
	s[1].fresh = 1;
	s[1].count = 5;
	s[1].pos = 14;
	memcpy(s[2].hash, f->hash[1], KVB_HASH_LEN);
	s[2].pos = 19;
	memcpy(s[3].hash, f->hash[0], KVB_HASH_LEN);
	s[3].pos = 36;
	return 4;
}

/* vLLM's GPU layout over base: LBNHC (hnd false) or LBHNC, each token's K then V. */
static struct kvb_kv_layout gpu_layout(struct fixture *f, uint8_t *base, bool hnd)
{
	struct kvb_kv_layout y = { .k = base, .v = base + HB, .layer_stride = LAYER_BYTES,
				   .page_tokens = PT, .page_stride = (size_t)PT * H * 2 * HB,
				   .pages = f->pages, .n_pages = BLOCKS };

	y.token_stride = hnd ? 2 * HB : (size_t)H * 2 * HB;
	y.head_stride = hnd ? (size_t)PT * 2 * HB : 2 * HB;
	return y;
}

static void wait_all(struct fixture *f, kvb_fuse *s)
{
	for (uint32_t l = 0; l < L; l++)
		assert_int_equal(kvb_fuse_wait(f->c, s, l, 10000), 0);
}

static struct kvb_device_mem device_mem(struct fixture *f)
{
	struct kvb_device_mem dm = { .base = f->mem.base, .bytes = f->mem.bytes,
				     .progress = f->region + CACHE_BYTES };

	memcpy(dm.ipc_handle, f->mem.handle, sizeof(dm.ipc_handle));
	memcpy(dm.pci, f->mem.pci, sizeof(dm.pci));
	return dm;
}

/* A reuse-only landing into device memory equals the host landing, byte for byte. */
static void land_equals_host(struct fixture *f, bool hnd)
{
	struct kvb_segment segs[4];
	size_t ns = segments(f, segs);
	struct kvb_kv_layout hy = gpu_layout(f, f->region, hnd);
	struct kvb_kv_layout dy = gpu_layout(f, f->mem.base, hnd);
	struct kvb_device_mem dm = device_mem(f);
	uint8_t *got = malloc(CACHE_BYTES);
	kvb_fuse *s = NULL;
	size_t diff = 0;

	memset(f->region, 0xa5, CACHE_BYTES);
	assert_int_equal(nodemem_fill(&f->mem, 0xa5), 0);
	assert_int_equal(kvb_fuse_open_into(f->c, "lm", segs, ns, NULL, &hy, &s, NULL, NULL), 0);
	wait_all(f, s);
	assert_int_equal(kvb_fuse_close(f->c, &s, NULL, NULL), 0);
	assert_int_equal(kvb_fuse_open_into_device(f->c, "lm", segs, ns, NULL, &dy, &dm, &s, NULL,
						   NULL),
			 0);
	wait_all(f, s);
	assert_int_equal(kvb_fuse_close(f->c, &s, NULL, NULL), 0);
	assert_int_equal(nodemem_read(&f->mem, 0, got, CACHE_BYTES), 0);
	for (size_t i = 0; i < CACHE_BYTES; i++)
		diff += got[i] != f->region[i];
	assert_int_equal(diff, 0);
	/* and the landing wrote something: the stored rows are not the fill */
	diff = 0;
	for (size_t i = 0; i < CACHE_BYTES; i++)
		diff += got[i] != 0xa5;
	assert_true(diff > (size_t)L * 2 * 41 * H * HB / 2);
	free(got);
}

static void lbnhc_equals_host(void **state)
{
	land_equals_host(*state, false);
}

static void lbhnc_equals_host(void **state)
{
	land_equals_host(*state, true);
}

/* Two sessions into one allocation at once (different blocks), then both right. */
static void two_sessions_one_allocation(void **state)
{
	struct fixture *f = *state;
	struct kvb_segment segs[4];
	size_t ns = segments(f, segs);
	struct kvb_kv_layout y1 = gpu_layout(f, f->mem.base, false), y2 = y1;
	struct kvb_device_mem dm = device_mem(f);
	uint32_t pages2[BLOCKS];
	kvb_fuse *a = NULL, *b = NULL;
	uint8_t *got = malloc(CACHE_BYTES);
	size_t diff = 0;

	/* session b's blocks are a's shifted by 12: both fit in 24 blocks of 4 (46 tokens) */
	for (uint32_t i = 0; i < BLOCKS; i++)
		pages2[i] = (f->pages[i] + 12) % BLOCKS;
	y1.n_pages = 12;
	y2.pages = pages2;
	y2.n_pages = 12;
	assert_int_equal(nodemem_fill(&f->mem, 0), 0);
	assert_int_equal(kvb_fuse_open_into_device(f->c, "lm", segs, ns, NULL, &y1, &dm, &a, NULL,
						   NULL),
			 0);
	dm.progress = f->region + CACHE_BYTES + 64;
	assert_int_equal(kvb_fuse_open_into_device(f->c, "lm", segs, ns, NULL, &y2, &dm, &b, NULL,
						   NULL),
			 0);
	wait_all(f, a);
	wait_all(f, b);
	assert_int_equal(kvb_fuse_close(f->c, &a, NULL, NULL), 0);
	assert_int_equal(kvb_fuse_close(f->c, &b, NULL, NULL), 0);
	assert_int_equal(nodemem_read(&f->mem, 0, got, CACHE_BYTES), 0);
	/* each token's rows where its own block table puts them: block p of a's table holds
	 * what block (p + 12) % 24 of b's holds */
	for (uint32_t l = 0; l < L; l++)
		for (uint32_t i = 0; i < 12; i++) {
			size_t pa = l * LAYER_BYTES + (size_t)f->pages[i] * y1.page_stride;
			size_t pb = l * LAYER_BYTES + (size_t)pages2[i] * y1.page_stride;

			diff += memcmp(got + pa, got + pb, y1.page_stride) != 0;
		}
	assert_int_equal(diff, 0);
	free(got);
}

/* A tensor-parallel rank's share: stored head h0 alone into a one-head device cache. */
static void head_range_into_device(void **state)
{
	struct fixture *f = *state;
	struct kvb_segment segs[4];
	size_t ns = segments(f, segs);
	struct kvb_kv_layout hy = gpu_layout(f, f->region, false);
	struct kvb_device_mem dm = device_mem(f);
	size_t ps1 = (size_t)PT * 2 * HB; /* a block of one head */
	struct kvb_kv_layout dy = { .k = f->mem.base, .v = f->mem.base + HB,
				    .layer_stride = BLOCKS * ps1, .token_stride = 2 * HB,
				    .head_stride = 2 * HB, .page_tokens = PT, .page_stride = ps1,
				    .pages = f->pages, .n_pages = BLOCKS };
	uint8_t *got = malloc(CACHE_BYTES);
	kvb_fuse *s = NULL;

	memset(f->region, 0xa5, CACHE_BYTES);
	assert_int_equal(kvb_fuse_open_into(f->c, "lm", segs, ns, NULL, &hy, &s, NULL, NULL), 0);
	wait_all(f, s);
	assert_int_equal(kvb_fuse_close(f->c, &s, NULL, NULL), 0);
	for (uint32_t h0 = 0; h0 < H; h0++) {
		struct kvb_land_opts o = { sizeof(o), NULL, &dm, h0, 1 };

		assert_int_equal(nodemem_fill(&f->mem, 0xa5), 0);
		assert_int_equal(kvb_fuse_open_into_opts(f->c, "lm", segs, ns, NULL, &dy, &o, &s,
							 NULL, NULL),
				 0);
		wait_all(f, s);
		assert_int_equal(kvb_fuse_close(f->c, &s, NULL, NULL), 0);
		assert_int_equal(nodemem_read(&f->mem, 0, got, CACHE_BYTES), 0);
		for (uint32_t l = 0; l < L; l++)
			for (uint32_t t = 0; t < N; t++) {
				size_t page = f->pages[t / PT], slot = t % PT;
				const uint8_t *want = f->region + l * LAYER_BYTES +
						      page * hy.page_stride + slot * hy.token_stride +
						      h0 * hy.head_stride;
				const uint8_t *one = got + l * dy.layer_stride + page * ps1 +
						     slot * dy.token_stride;

				if (memcmp(one, want, 2 * HB)) /* K then V of the head */
					fail_msg("head %u layer %u token %u differs", h0, l, t);
			}
	}
	free(got);
}

/*
 * One blend session (check layers 1 and 3) driven the same way into a host layout
 * and into device memory: the node sends the same check rows and writes nothing
 * itself, so both caches must end equal byte for byte. Layer 2 and the layers after
 * the last check land as stored and are re-rotated on the device; layer 3 lands from
 * the check's slot, which the host re-rotated.
 */
static void blend_one(struct fixture *f, const struct kvb_kv_layout *y,
		      const struct kvb_device_mem *dm, size_t *selected)
{
	static const uint32_t checks[2] = { 1, 3 };
	static const double ratios[2] = { 0.5, 0.25 };
	struct kvb_fuse_params p = { checks, ratios, 2, KVB_METRIC_VALUE };
	struct kvb_segment segs[4];
	size_t ns = segments(f, segs), ci = 0;
	uint16_t *pk = malloc((size_t)N * H * D * 2);
	kvb_fuse *s = NULL;

	if (dm)
		assert_int_equal(kvb_fuse_open_into_device(f->c, "lm", segs, ns, &p, y, dm, &s,
							   NULL, NULL),
				 0);
	else
		assert_int_equal(kvb_fuse_open_into(f->c, "lm", segs, ns, &p, y, &s, NULL, NULL),
				 0);
	for (uint32_t l = 0; l < L; l++) {
		const int32_t *rows;
		size_t nr = kvb_fuse_rows(s, &rows);

		if (l > checks[0])
			assert_int_equal(kvb_fuse_wait(f->c, s, l, 10000), 0);
		if (ci < 2 && checks[ci] == l) {
			/* the V rows of the rows asked for: a pattern of the layer and token */
			for (size_t i = 0; i < nr; i++)
				fill_f16(pk + i * H * D, (size_t)H * D, 1000 * l + (uint32_t)rows[i]);
			assert_int_equal(kvb_fuse_check(f->c, s, l, pk, 0, NULL, NULL), 0);
			ci++;
		}
	}
	{
		const int32_t *rows;

		*selected = kvb_fuse_rows(s, &rows);
	}
	assert_int_equal(kvb_fuse_close(f->c, &s, NULL, NULL), 0);
	free(pk);
}

static void blend_into_device_equals_host(void **state)
{
	struct fixture *f = *state;
	struct kvb_kv_layout hy = gpu_layout(f, f->region, false);
	struct kvb_kv_layout dy = gpu_layout(f, f->mem.base, false);
	struct kvb_device_mem dm = device_mem(f);
	uint8_t *got = malloc(CACHE_BYTES);
	size_t diff = 0, host_sel, dev_sel;

	memset(f->region, 0xa5, CACHE_BYTES);
	assert_int_equal(nodemem_fill(&f->mem, 0xa5), 0);
	blend_one(f, &hy, NULL, &host_sel);
	blend_one(f, &dy, &dm, &dev_sel);
	assert_int_equal(host_sel, dev_sel);
	assert_true(host_sel > 0 && host_sel < N); /* a blend: some rows recomputed, not all */
	assert_int_equal(nodemem_read(&f->mem, 0, got, CACHE_BYTES), 0);
	for (size_t i = 0; i < CACHE_BYTES; i++)
		diff += got[i] != f->region[i];
	assert_int_equal(diff, 0);
	/* the layers after the first check were landed: not the fill */
	diff = 0;
	for (size_t i = 2 * LAYER_BYTES; i < CACHE_BYTES; i++)
		diff += got[i] != 0xa5;
	assert_true(diff > (size_t)2 * 2 * 20 * H * HB / 2);
	free(got);
}

/*
 * Tensor-parallel ranks blend as one: two sessions landing heads [0, 1) and [1, 2) in
 * host memory each send their head's V rows for the deviation, sum the two answers and
 * select by the sum; both get the selection of one session of every head sent the same
 * rows (kvb_fuse_check), and each lands its head of what that session lands. A plain
 * check on a head range is refused, naming the two-step call.
 */
static void ranks_blend(struct fixture *f, bool device)
{
	static const uint32_t checks[2] = { 1, 3 };
	static const double ratios[2] = { 0.5, 0.25 };
	struct kvb_fuse_params p = { checks, ratios, 2, KVB_METRIC_VALUE };
	struct kvb_segment segs[4];
	size_t ns = segments_alt(f, segs), ps1 = (size_t)PT * 2 * HB, rank_bytes = L * BLOCKS * ps1;
	struct kvb_kv_layout hy = gpu_layout(f, f->region, false), ry[H];
	/* the ranks' caches: one region (host), or halves of the node's device allocation,
	 * each a head's paged cache (the full session's cache is the fixture's region) */
	uint8_t *rr = device ? malloc(H * rank_bytes) : kvb_region_alloc(f->c, H * rank_bytes + 4096);
	uint8_t *rbase = device ? f->mem.base : rr;
	struct kvb_device_mem dm[H];
	uint16_t *pk = malloc((size_t)N * H * D * 2), *pr[H];
	float *dev[H], *sum = malloc(N * sizeof(float));
	kvb_fuse *full = NULL, *rank[H];
	const int32_t *dropped;
	size_t nd, ci = 0;

	assert_non_null(rr);
	memset(f->region, 0xa5, CACHE_BYTES);
	memset(rr, 0xa5, H * rank_bytes);
	if (device)
		assert_int_equal(nodemem_fill(&f->mem, 0xa5), 0);
	assert_int_equal(kvb_fuse_open_into(f->c, "lm", segs, ns, &p, &hy, &full, NULL, NULL), 0);
	for (uint32_t h = 0; h < H; h++) {
		struct kvb_land_opts o = { sizeof(o), NULL, NULL, h, 1 };

		dm[h] = device_mem(f);
		dm[h].progress = f->region + CACHE_BYTES + 64 * (h + 1);
		if (device)
			o.device = &dm[h];
		ry[h] = (struct kvb_kv_layout){ .k = rbase + h * rank_bytes,
						.v = rbase + h * rank_bytes + HB,
						.layer_stride = BLOCKS * ps1, .token_stride = 2 * HB,
						.head_stride = 2 * HB, .page_tokens = PT,
						.page_stride = ps1, .pages = f->pages, .n_pages = BLOCKS };
		pr[h] = malloc((size_t)N * D * 2);
		dev[h] = malloc(N * sizeof(float));
		assert_int_equal(kvb_fuse_open_into_opts(f->c, "lm", segs, ns, &p, &ry[h], &o,
							 &rank[h], NULL, NULL),
				 0);
	}
	for (uint32_t l = 0; l < L; l++) {
		const int32_t *rows, *rrows;
		size_t nr = kvb_fuse_rows(full, &rows);

		if (l > checks[0]) {
			assert_int_equal(kvb_fuse_wait(f->c, full, l, 10000), 0);
			for (uint32_t h = 0; h < H; h++)
				assert_int_equal(kvb_fuse_wait(f->c, rank[h], l, 10000), 0);
		}
		if (ci == 2 || checks[ci] != l)
			continue;
		for (size_t i = 0; i < nr; i++) {
			fill_f16(pk + i * H * D, (size_t)H * D, 1000 * l + (uint32_t)rows[i]);
			for (uint32_t h = 0; h < H; h++)
				memcpy(pr[h] + i * D, pk + i * H * D + h * D, D * 2);
		}
		/* one rank alone may not select: its deviation covers its head only */
		assert_int_equal(kvb_fuse_check(f->c, rank[0], l, pr[0], 0, NULL, NULL),
				 KVB_E_BAD_ARGUMENT);
		assert_non_null(strstr(kvb_last_error(f->c), "check_mode"));
		for (uint32_t h = 0; h < H; h++) {
			assert_int_equal(kvb_fuse_rows(rank[h], &rrows), nr);
			assert_int_equal(kvb_fuse_check_deviation(f->c, rank[h], l, pr[h], 0, dev[h]),
					 0);
			assert_int_equal(kvb_fuse_rows(rank[h], NULL), nr); /* nothing selected */
		}
		for (size_t i = 0; i < nr; i++) {
			sum[i] = dev[0][i] + dev[1][i];
			assert_true(dev[0][i] > 0 && dev[1][i] > 0);
		}
		assert_int_equal(kvb_fuse_check(f->c, full, l, pk, 0, NULL, NULL), 0);
		for (uint32_t h = 0; h < H; h++) {
			assert_int_equal(kvb_fuse_check_select(f->c, rank[h], l, sum, &dropped, &nd), 0);
			nr = kvb_fuse_rows(full, &rows);
			assert_int_equal(kvb_fuse_rows(rank[h], &rrows), nr);
			assert_memory_equal(rrows, rows, nr * sizeof(int32_t));
		}
		assert_true(nr > 0 && nr < N);
		ci++;
	}
	assert_int_equal(ci, 2);
	assert_int_equal(kvb_fuse_close(f->c, &full, NULL, NULL), 0);
	for (uint32_t h = 0; h < H; h++)
		assert_int_equal(kvb_fuse_close(f->c, &rank[h], NULL, NULL), 0);
	if (device) /* what the device holds, read back into rr (where ry[] point, offsets) */
		assert_int_equal(nodemem_read(&f->mem, 0, rr, H * rank_bytes), 0);
	for (uint32_t h = 0; h < H; h++) {
		const uint8_t *rk = rr + h * rank_bytes;

		for (uint32_t l = 0; l < L; l++)
			for (uint32_t t = 0; t < N; t++) {
				size_t page = f->pages[t / PT], slot = t % PT;
				const uint8_t *want = f->region + l * LAYER_BYTES +
						      page * hy.page_stride + slot * hy.token_stride +
						      h * hy.head_stride;
				const uint8_t *one = rk + l * ry[h].layer_stride + page * ps1 +
						     slot * ry[h].token_stride;

				if (memcmp(one, want, 2 * HB))
					fail_msg("rank %u layer %u token %u differs (%s)", h, l, t,
						 device ? "device" : "host");
			}
		free(pr[h]);
		free(dev[h]);
	}
	if (device)
		free(rr);
	else
		kvb_region_free(f->c, rr);
	free(pk);
	free(sum);
}

static void ranks_blend_as_one(void **state)
{
	ranks_blend(*state, false);
}

/* The same, each rank landing into device memory: a later check layer's slot goes up
 * as whole rows, of which the device takes the rank's head (rank 1 once got head 0's). */
static void ranks_blend_as_one_device(void **state)
{
	ranks_blend(*state, true);
}

/* Refusals: each names its cause, and the daemon serves on. */
static void refusals(void **state)
{
	struct fixture *f = *state;
	struct kvb_segment segs[4];
	size_t ns = segments(f, segs);
	struct kvb_kv_layout y = gpu_layout(f, f->mem.base, false);
	struct kvb_device_mem dm = device_mem(f);
	struct kvb_kv_strides ks = { 2, 2 * HB, 2 };
	kvb_fuse *s = NULL;
	int rc;

	/* another GPU */
	snprintf(dm.pci, sizeof(dm.pci), "0000:ff:1f.7");
	rc = kvb_fuse_open_into_device(f->c, "lm", segs, ns, NULL, &y, &dm, &s, NULL, NULL);
	assert_int_equal(rc, KVB_E_BAD_ARGUMENT);
	assert_non_null(strstr(kvb_last_error(f->c), "not on this daemon's"));
	dm = device_mem(f);
	/* a handle that maps nothing */
	if (!strcmp(which, "emulated")) {
		memcpy(dm.ipc_handle, "kvbfd:0123456789abcdef", 23);
		rc = kvb_fuse_open_into_device(f->c, "lm", segs, ns, NULL, &y, &dm, &s, NULL,
					       NULL);
		assert_int_equal(rc, KVB_E_BAD_ARGUMENT);
		assert_non_null(strstr(kvb_last_error(f->c), "not one this client handed in"));
	} else {
		memset(dm.ipc_handle, 0x5a, sizeof(dm.ipc_handle));
		rc = kvb_fuse_open_into_device(f->c, "lm", segs, ns, NULL, &y, &dm, &s, NULL,
					       NULL);
		assert_int_equal(rc, KVB_E_BAD_ARGUMENT);
		assert_non_null(strstr(kvb_last_error(f->c), "cannot be mapped"));
	}
	dm = device_mem(f);
	/* the emulated device maps no file but a node's sealed memfd that it handed over:
	 * never a path a client names, nor a file that could shrink under the mapping (a
	 * plain shared file here, handed over) */
	if (!strcmp(which, "emulated")) {
		char shm[] = "/dev/shm/kvb-test-unsealed-XXXXXX";
		int fd = mkstemp(shm);

		assert_true(fd >= 0);
		assert_int_equal(ftruncate(fd, (off_t)CACHE_BYTES), 0);
		unlink(shm);
		for (int i = 0; i < 3; i++) {
			dm = device_mem(f);
			memset(dm.ipc_handle, 0, sizeof(dm.ipc_handle));
			if (i == 2)
				assert_int_equal(kvb_device_handle_from_fd(f->c, fd, dm.ipc_handle),
						 0);
			else if (i)
				snprintf((char *)dm.ipc_handle, sizeof(dm.ipc_handle),
					 "emu:/proc/%d/fd/%d", (int)getpid(), fd);
			else
				memcpy(dm.ipc_handle, "emu:/etc/passwd", 16);
			rc = kvb_fuse_open_into_device(f->c, "lm", segs, ns, NULL, &y, &dm, &s,
						       NULL, NULL);
			assert_int_equal(rc, KVB_E_BAD_ARGUMENT);
			assert_non_null(strstr(kvb_last_error(f->c),
					       i == 2 ? "not memory this device can map"
						      : "naming memory by a path"));
		}
		close(fd);
	}
	dm = device_mem(f);
	/* a layout beyond the allocation: the client's size says yes, the daemon's no */
	dm.bytes = 4 * CACHE_BYTES;
	y.layer_stride = 2 * LAYER_BYTES;
	rc = kvb_fuse_open_into_device(f->c, "lm", segs, ns, NULL, &y, &dm, &s, NULL, NULL);
	assert_int_equal(rc, KVB_E_BAD_SHAPE);
	assert_non_null(strstr(kvb_last_error(f->c), "device allocation"));
	/* strides the land kernel cannot take: refused at the open, not at a layer */
	dm = device_mem(f);
	y.token_stride += 2;
	rc = kvb_fuse_open_into_device(f->c, "lm", segs, ns, NULL, &y, &dm, &s, NULL, NULL);
	assert_int_equal(rc, KVB_E_BAD_ARGUMENT);
	assert_non_null(strstr(kvb_last_error(f->c), "multiples of 4"));
	y = gpu_layout(f, f->mem.base, false);
	/* the library's own checks: K outside the allocation, no progress region */
	dm = device_mem(f);
	y = gpu_layout(f, f->mem.base + CACHE_BYTES, false);
	assert_int_equal(kvb_fuse_open_into_device(f->c, "lm", segs, ns, NULL, &y, &dm, &s, NULL,
						   NULL),
			 -EINVAL);
	y = gpu_layout(f, f->mem.base, false);
	dm.progress = &ks;
	assert_int_equal(kvb_fuse_open_into_device(f->c, "lm", segs, ns, NULL, &y, &dm, &s, NULL,
						   NULL),
			 -EINVAL);
	/* serving on: a good session lands */
	dm = device_mem(f);
	assert_int_equal(kvb_fuse_open_into_device(f->c, "lm", segs, ns, NULL, &y, &dm, &s, NULL,
						   NULL),
			 0);
	wait_all(f, s);
	assert_int_equal(kvb_fuse_close(f->c, &s, NULL, NULL), 0);
}

/*
 * Landing handles are no bearer capabilities (issue 55, defect 3). Another process (a
 * child: another principal) that learns this one's descriptor handle, or names memory
 * by a /proc path (this process's memfd, or any of the daemon's own descriptors 3..63),
 * is refused every time, and this process's allocation is untouched by it; this
 * process lands by its handle as before. A descriptor of the daemon's own segment
 * (a client holds those) is refused when handed in.
 */
static void handles_are_the_clients_own(void **state)
{
	struct fixture *f = *state;
	struct kvb_segment segs[4];
	size_t ns = segments(f, segs);
	struct kvb_kv_layout y = gpu_layout(f, f->mem.base, false);
	struct kvb_device_mem dm = device_mem(f);
	kvb_fuse *s = NULL;
	pid_t child;
	int status;

	if (strcmp(which, "emulated")) {
		print_message("skip: descriptor handles are the emulated device's here\n");
		return;
	}
	memset(f->mem.base, 0x11, f->mem.bytes);
	child = fork();
	assert_true(child >= 0);
	if (child == 0) {
		kvb_client *c = daemon_client(&f->d, 0);
		uint8_t *region = kvb_region_alloc(c, 4096);
		int refused = 0, tries = 0;

		dm.progress = region;
		/* the parent's handle, as it is */
		tries++;
		refused += kvb_fuse_open_into_device(c, "lm", segs, ns, NULL, &y, &dm, &s, NULL,
						     NULL) == KVB_E_BAD_ARGUMENT &&
			   strstr(kvb_last_error(c), "not one this client handed in");
		/* the parent's memfd and the daemon's descriptors, by path */
		for (int n = 3; n < 64; n++) {
			snprintf((char *)dm.ipc_handle, sizeof(dm.ipc_handle), "emu:/proc/%d/fd/%d",
				 n == 3 ? (int)getppid() : (int)f->d.pid, n == 3 ? f->mem.fd : n);
			tries++;
			refused += kvb_fuse_open_into_device(c, "lm", segs, ns, NULL, &y, &dm, &s,
							     NULL, NULL) == KVB_E_BAD_ARGUMENT &&
				   strstr(kvb_last_error(c), "naming memory by a path");
		}
		kvb_region_free(c, region);
		kvb_close(&c);
		_exit(refused == tries ? 0 : 1);
	}
	assert_int_equal(waitpid(child, &status, 0), child);
	assert_true(WIFEXITED(status));
	assert_int_equal(WEXITSTATUS(status), 0);
	for (size_t i = 0; i < f->mem.bytes; i++)
		if (f->mem.base[i] != 0x11)
			fail_msg("byte %zu of the node's memory changed (0x%02x) by another "
				 "process's opens", i, f->mem.base[i]);
	/* the owner itself: lands by its handle */
	assert_int_equal(kvb_fuse_open_into_device(f->c, "lm", segs, ns, NULL, &y, &dm, &s, NULL,
						   NULL),
			 0);
	wait_all(f, s);
	assert_int_equal(kvb_fuse_close(f->c, &s, NULL, NULL), 0);
	{
		size_t changed = 0;

		for (size_t i = 0; i < f->mem.bytes; i++)
			changed += f->mem.base[i] != 0x11;
		assert_true(changed > 0);
	}
	/* the daemon's own segment, handed back in as device memory: refused */
	{
		struct kvbp_request q = { .op = KVBP_OP_SHM_ATTACH, .shm_size = 1u << 20 };
		struct kvbp_reply rep = { 0 };
		struct raw r;
		uint8_t h[64];
		int fd;

		raw_open(&r, f->d.endpoint, 10000);
		assert_int_equal(raw_call(&r, &q, NULL, NULL, 0, &rep), KVBP_OK);
		fd = kvbp_segment_fd(rep.shm_name, rep.shm_id);
		assert_true(fd >= 0);
		assert_int_equal(kvb_device_handle_from_fd(f->c, fd, h), KVB_E_BAD_ARGUMENT);
		assert_non_null(strstr(kvb_last_error(f->c), "kvblendd's own segments"));
		close(fd);
		kvbp_reply_clear(&rep);
		raw_close(&r);
	}
}

/*
 * Memory in segments (kvb_device_handle_from_fds: a GPU cache reserved as one range and
 * backed by one allocation a layer, as vLLM 0.34's growable cache is): one memfd a
 * layer, each at its offset of one extent with a page unmapped between them. The
 * landing equals the host landing layer by layer, byte for byte; a layout whose layer
 * reaches into the gap is refused at the open, and one naming places out of order or
 * overlapping is refused when handed in; the daemon serves on.
 */
static void segments_land_layer_by_layer(void **state)
{
	enum { SEG = 8192, STRIDE = SEG + 4096 };
	struct fixture *f = *state;
	struct kvb_segment segs[4];
	size_t ns = segments(f, segs);
	struct kvb_kv_layout hy = gpu_layout(f, f->region, false);
	struct kvb_kv_layout dy;
	struct kvb_device_mem dm = device_mem(f);
	uint8_t *map[L];
	int fds[L];
	uint64_t offs[L], sizes[L];
	char err[128];
	kvb_fuse *s = NULL;

	if (strcmp(which, "emulated")) {
		print_message("skip: segments by descriptor are the emulated device's here\n");
		return;
	}
	assert_true(LAYER_BYTES <= SEG);
	for (int l = 0; l < L; l++) {
		struct nodemem m;

		assert_int_equal(nodemem_open(&m, "emulated", SEG, err, sizeof(err)), 0);
		fds[l] = m.fd; /* (kept: closed at the end) */
		map[l] = m.base;
		memset(map[l], 0xa5, SEG);
		offs[l] = (uint64_t)l * STRIDE;
		sizes[l] = SEG;
	}
	assert_int_equal(kvb_device_handle_from_fds(f->c, fds, offs, sizes, L, dm.ipc_handle), 0);
	dm.base = map[0]; /* (what the node's own reservation starts at: its word only) */
	dm.bytes = (size_t)(L - 1) * STRIDE + SEG;
	dy = gpu_layout(f, (uint8_t *)dm.base, false);
	dy.layer_stride = STRIDE;
	memset(f->region, 0xa5, CACHE_BYTES);
	assert_int_equal(kvb_fuse_open_into(f->c, "lm", segs, ns, NULL, &hy, &s, NULL, NULL), 0);
	wait_all(f, s);
	assert_int_equal(kvb_fuse_close(f->c, &s, NULL, NULL), 0);
	assert_int_equal(kvb_fuse_open_into_device(f->c, "lm", segs, ns, NULL, &dy, &dm, &s, NULL,
						   NULL),
			 0);
	wait_all(f, s);
	assert_int_equal(kvb_fuse_close(f->c, &s, NULL, NULL), 0);
	for (int l = 0; l < L; l++) {
		assert_memory_equal(map[l], f->region + (size_t)l * LAYER_BYTES, LAYER_BYTES);
		for (size_t i = LAYER_BYTES; i < SEG; i++)
			assert_int_equal(map[l][i], 0xa5); /* nothing past the layer */
	}
	/* a layer that reaches into the gap after its segment: refused at the open */
	dy.layer_stride = STRIDE - 2048;
	assert_int_equal(kvb_fuse_open_into_device(f->c, "lm", segs, ns, NULL, &dy, &dm, &s, NULL,
						   NULL),
			 KVB_E_BAD_SHAPE);
	assert_non_null(strstr(kvb_last_error(f->c), "reaches past the segment"));
	/* places out of order, overlapping: refused when handed in */
	offs[1] = 0;
	assert_int_equal(kvb_device_handle_from_fds(f->c, fds, offs, sizes, L, dm.ipc_handle),
			 KVB_E_BAD_ARGUMENT);
	assert_non_null(strstr(kvb_last_error(f->c), "out of order"));
	assert_int_equal(kvb_ping(f->c, NULL, 0), 0);
	for (int l = 0; l < L; l++) {
		munmap(map[l], SEG);
		close(fds[l]);
	}
}

/* One client maps at most 4 allocations at once; a fifth is refused, then fine again. */
static void four_allocations_a_client(void **state)
{
	struct fixture *f = *state;
	struct kvb_segment segs[4];
	size_t ns = segments(f, segs);
	struct nodemem m[5];
	kvb_fuse *s[5] = { 0 };
	char err[256];

	for (int i = 0; i < 5; i++) {
		struct kvb_kv_layout y;
		struct kvb_device_mem dm;

		assert_int_equal(nodemem_open(&m[i], which, CACHE_BYTES, err, sizeof(err)), 0);
		if (!m[i].dv)
			assert_int_equal(kvb_device_handle_from_fd(f->c, m[i].fd, m[i].handle), 0);
		y = gpu_layout(f, m[i].base, false);
		dm = (struct kvb_device_mem){ .base = m[i].base, .bytes = m[i].bytes,
					      .progress = f->region + CACHE_BYTES };
		memcpy(dm.ipc_handle, m[i].handle, sizeof(dm.ipc_handle));
		memcpy(dm.pci, m[i].pci, sizeof(dm.pci));
		if (i < 4) {
			assert_int_equal(kvb_fuse_open_into_device(f->c, "lm", segs, ns, NULL, &y,
								   &dm, &s[i], NULL, NULL),
					 0);
			continue;
		}
		assert_int_equal(kvb_fuse_open_into_device(f->c, "lm", segs, ns, NULL, &y, &dm,
							   &s[i], NULL, NULL),
				 KVB_E_LIMIT);
		assert_non_null(strstr(kvb_last_error(f->c), "map 4 device allocations"));
		/* one closed: its allocation unmapped, room for this one */
		wait_all(f, s[0]);
		assert_int_equal(kvb_fuse_close(f->c, &s[0], NULL, NULL), 0);
		assert_int_equal(kvb_fuse_open_into_device(f->c, "lm", segs, ns, NULL, &y, &dm,
							   &s[i], NULL, NULL),
				 0);
	}
	for (int i = 0; i < 5; i++) {
		if (s[i]) {
			wait_all(f, s[i]);
			assert_int_equal(kvb_fuse_close(f->c, &s[i], NULL, NULL), 0);
		}
		nodemem_close(&m[i]);
	}
}

/* A daemon whose fuse runs on the CPU refuses, saying what it needs. */
static void no_device_daemon(void **state)
{
	struct fixture *f = *state;
	struct daemon d2;
	const char *args[] = { "--device", "cpu", NULL };
	struct kvb_model m = TEST_MODEL_F16("lm", L, H, D);
	struct kvb_segment seg = { .pos = 0 };
	struct kvb_kv_layout y = gpu_layout(f, f->mem.base, false);
	struct kvb_device_mem dm = device_mem(f);
	size_t n = (size_t)L * 2 * 10 * H * D;
	uint16_t *kv = malloc(n * 2);
	kvb_client *c;
	kvb_fuse *s = NULL;
	void *reg;

	c = daemon_start_client(&d2, args, &m, 0);
	fill_f16(kv, n, 5);
	memcpy(seg.hash, f->hash[0], KVB_HASH_LEN);
	assert_int_equal(kvb_put(c, "lm", seg.hash, KVB_F16, 10, 0, kv, n * 2, NULL), 0);
	reg = kvb_region_alloc(c, 4096);
	assert_non_null(reg);
	dm.progress = reg;
	assert_int_equal(kvb_fuse_open_into_device(c, "lm", &seg, 1, NULL, &y, &dm, &s, NULL, NULL),
			 KVB_E_BAD_ARGUMENT);
	assert_non_null(strstr(kvb_last_error(c), "CUDA device"));
	assert_int_equal(kvb_ping(c, NULL, 0), 0);
	kvb_region_free(c, reg);
	daemon_end(&d2, &c);
	free(kv);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(lbnhc_equals_host),
		cmocka_unit_test(lbhnc_equals_host),
		cmocka_unit_test(two_sessions_one_allocation),
		cmocka_unit_test(head_range_into_device),
		cmocka_unit_test(blend_into_device_equals_host),
		cmocka_unit_test(ranks_blend_as_one),
		cmocka_unit_test(ranks_blend_as_one_device),
		cmocka_unit_test(refusals),
		cmocka_unit_test(handles_are_the_clients_own),
		cmocka_unit_test(segments_land_layer_by_layer),
		cmocka_unit_test(four_allocations_a_client),
		cmocka_unit_test(no_device_daemon),
	};

	if (getenv("KVBLEND_TEST_DEVICE"))
		which = getenv("KVBLEND_TEST_DEVICE");
	return cmocka_run_group_tests(tests, setup, teardown);
}
