/*
 * The fuse engine alone (daemon/fuse/, through fuse.h), linked from the daemon's library
 * with no socket, no ZeroMQ, no client: a real LMDB store in a temporary directory, the
 * CPU backend, a helper pool and a shared-memory table. Open, layer, check, land and
 * close, with the properties that need no RoPE reference to check:
 *   - a chunk placed where it was computed (no move) is served byte for byte as stored;
 *   - a moved chunk's V is served as stored (V carries no position), and its K is
 *     rotated: changed, but every RoPE pair keeps its length (a rotation);
 *   - the node's fresh rows are served as it sent them;
 *   - a check layer selects exactly the cached tokens whose V deviates, plus every
 *     fresh token, sorted; later layers merge the node's rows for those only;
 *   - sessions belong to their owner, expect their next layer, pin their chunks;
 *   - a landing session writes every layer into the segment, in place, and nothing
 *     where the node's own rows go; a layout whose extent would wrap is refused.
 * (The integration tests check the same against the classic path and NumPy.)
 */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "blend/backend.h"
#include "common/half.h"
#include "daemon/fuse/fuse.h"
#include "daemon/pool.h"
#include "daemon/shm.h"
#include "store/store.h"
#include "tests/fixture.h"

#define L 4
#define H 2
#define D 8
#define ROW (H * D) /* elements of one token row */
#define TA 6	    /* chunk A: 6 tokens computed at 0, placed at 0 */
#define TB 5	    /* chunk B: 5 tokens computed at 20, placed at 9 */
#define NF 3	    /* 3 fresh tokens at 6 */
#define N (TA + NF + TB)

static const char *const owner = "ipc:0:0:1";

struct fixture {
	char dir[64];
	struct store *store;
	struct store_model m;
	struct pool *pool;
	struct shm_table *shm;
	struct fuse_table *t;
	uint8_t ha[STORE_HASH_LEN], hb[STORE_HASH_LEN];
	uint16_t a[L][2][TA * ROW], b[L][2][TB * ROW]; /* as stored: [layer][K, V][T x H x D] */
};

/* Small normal f16 values of either sign, from seed. */
static void fill(uint16_t *p, size_t n, uint32_t seed)
{
	uint32_t x = seed * 2654435761u + 1;

	for (size_t i = 0; i < n; i++) {
		x ^= x << 13;
		x ^= x >> 17;
		x ^= x << 5;
		p[i] = f32_to_f16(((float)(x % 2001) - 1000.0f) / 500.0f);
	}
}

/* kv: [L][2][tokens x H x D], K then V of each layer. */
static void put_chunk(struct fixture *f, const uint8_t *hash, uint32_t tokens, uint32_t base,
		      const uint16_t *kv)
{
	const void *tensors[2 * L];
	size_t elems = (size_t)tokens * ROW;

	for (int l = 0; l < L; l++)
		for (int s = 0; s < 2; s++)
			tensors[2 * l + s] = kv + ((size_t)l * 2 + s) * elems;
	assert_int_equal(store_chunk_put(f->store, &f->m, hash, tokens, base, tensors, NULL), 0);
}

static int setup(void **state)
{
	struct fixture *f = calloc(1, sizeof(*f));
	struct store_opts so = { .map_size = 64u << 20, .max_readers = 16, .min_saving = 0.1,
				 .no_sync = true };
	struct fuse_limits lim = { .max_sessions = 8, .max_tokens = 4096, .max_bytes = 64u << 20,
				   .ring = 2, .idle_s = 60, .per_owner = 8 };

	assert_non_null(f);
	snprintf(f->dir, sizeof(f->dir), "/tmp/kvb-fuse-unit-XXXXXX");
	assert_non_null(mkdtemp(f->dir));
	so.dir = f->dir;
	assert_int_equal(store_open(&so, &f->store), 0);
	f->m = (struct store_model){ .name = "m", .desc.num_layers = L, .desc.num_kv_heads = H,
				     .desc.head_dim = D, .desc.dtype = 1,
				     .desc.rope_theta = 10000 };
	assert_true(store_model_register(f->store, &f->m) >= 0);
	fill(&f->a[0][0][0], sizeof(f->a) / 2, 1);
	fill(&f->b[0][0][0], sizeof(f->b) / 2, 2);
	memset(f->ha, 0xa1, sizeof(f->ha));
	memset(f->hb, 0xb2, sizeof(f->hb));
	put_chunk(f, f->ha, TA, 0, &f->a[0][0][0]);
	put_chunk(f, f->hb, TB, 20, &f->b[0][0][0]);
	assert_int_equal(pool_new(2, &f->pool), 0);
	assert_int_equal(shm_table_new(16u << 20, 64u << 20, 60, 16, &f->shm), 0);
	assert_int_equal(fuse_table_new(&lim, f->store, f->pool, blend_cpu_backend(), NULL, f->shm,
					&f->t), 0);
	*state = f;
	return 0;
}

static int teardown(void **state)
{
	struct fixture *f = *state;
	char cmd[128];

	fuse_loader_stop(f->t); /* (before the table: its thread works on the sessions) */
	fuse_table_free(&f->t);
	shm_table_free(&f->shm);
	pool_free(&f->pool);
	store_close(&f->store);
	snprintf(cmd, sizeof(cmd), "rm -rf %s", f->dir);
	assert_int_equal(system(cmd), 0);
	free(f);
	return 0;
}

/* A at 0, NF fresh at TA, B at TA + NF (computed at 20: moved by -11). */
static void segments(const struct fixture *f, struct kvbp_segment *s)
{
	memset(s, 0, 3 * sizeof(*s));
	memcpy(s[0].hash, f->ha, STORE_HASH_LEN);
	s[1].fresh = true;
	s[1].pos = TA;
	s[1].count = NF;
	memcpy(s[2].hash, f->hb, STORE_HASH_LEN);
	s[2].pos = TA + NF;
}

/* What the node computes for token i of layer l (K: kv 0, V: kv 1). */
static void fresh_row(uint32_t l, int kv, uint32_t i, uint16_t *row)
{
	fill(row, ROW, 1000 + l * 100 + (uint32_t)kv * 50 + i);
}

/* Row i of layer l as served (fused): A's, the node's, or B's (V as stored, K rotated). */
static void check_row(const struct fixture *f, uint32_t l, uint32_t i, const uint16_t *k,
		      const uint16_t *v, bool node_row)
{
	uint16_t want[ROW];

	if (node_row) {
		fresh_row(l, 0, i, want);
		assert_memory_equal(k, want, sizeof(want));
		fresh_row(l, 1, i, want);
		assert_memory_equal(v, want, sizeof(want));
	} else if (i < TA) { /* in place: byte for byte */
		assert_memory_equal(k, &f->a[l][0][i * ROW], ROW * 2);
		assert_memory_equal(v, &f->a[l][1][i * ROW], ROW * 2);
	} else {
		const uint16_t *sk = &f->b[l][0][(i - TA - NF) * ROW];
		bool changed = false;

		assert_memory_equal(v, &f->b[l][1][(i - TA - NF) * ROW], ROW * 2);
		/* neox pairs (j, j + D/2) of each head: rotated, their length kept */
		for (int h = 0; h < H; h++)
			for (int j = 0; j < D / 2; j++) {
				const uint16_t *a = sk + h * D, *b = k + h * D;
				float x0 = f16_to_f32(a[j]), y0 = f16_to_f32(a[j + D / 2]);
				float x1 = f16_to_f32(b[j]), y1 = f16_to_f32(b[j + D / 2]);
				float n0 = sqrtf(x0 * x0 + y0 * y0), n1 = sqrtf(x1 * x1 + y1 * y1);

				/* f16 rounding of each coordinate: a few ulps of values below 2 */
				if (fabsf(n0 - n1) > 4e-3f + 2e-3f * n0)
					fail_msg("layer %u token %u head %d pair %d: length %g became %g",
						 l, i, h, j, n0, n1);
				changed |= a[j] != b[j] || a[j + D / 2] != b[j + D / 2];
			}
		if (!changed)
			fail_msg("layer %u token %u: a chunk moved by -11 came back unrotated", l, i);
	}
}

/* Reuse only: every layer, the node sends its fresh rows, the engine serves all rows. */
static void test_reuse_only_session(void **state)
{
	struct fixture *f = *state;
	struct kvbp_segment segs[3];
	struct kvbp_request q = { .segments = segs, .n_segments = 3, .reuse_only = true };
	struct fuse_open_result r = { 0 };
	char err[256];
	uint16_t kin[NF * ROW], vin[NF * ROW], kout[N * ROW], vout[N * ROW];

	segments(f, segs);
	assert_int_equal(fuse_open(f->t, &f->m, &q, owner, &r, err, sizeof(err)), KVBP_OK);
	assert_int_equal(r.num_tokens, N);
	assert_int_equal(r.n_rows, NF);
	for (size_t i = 0; i < NF; i++)
		assert_int_equal(r.rows[i], TA + (int32_t)i);
	/* its chunks are pinned while it is open */
	assert_int_equal(fuse_delete_chunk(f->t, &f->m, f->ha), -EBUSY);
	for (uint32_t l = 0; l < L; l++) {
		struct fuse_session *s;
		struct fuse_layer_plan plan;
		struct fuse_layer_result lr = { 0 };

		/* another owner's session is unknown to it; a layer out of turn is refused */
		assert_int_equal(fuse_layer_begin(f->t, r.id, "ipc:0:0:2", l, &s, &plan, err,
						  sizeof(err)), KVBP_UNKNOWN_SESSION);
		assert_int_not_equal(fuse_layer_begin(f->t, r.id, owner, l + 1, &s, &plan, err,
						      sizeof(err)), KVBP_OK);
		assert_int_equal(fuse_layer_begin(f->t, r.id, owner, l, &s, &plan, err,
						  sizeof(err)), KVBP_OK);
		assert_int_equal(plan.rows_in, NF);
		assert_int_equal(plan.row_bytes, ROW * 2);
		assert_true(plan.fused_out);
		for (uint32_t i = 0; i < NF; i++) {
			fresh_row(l, 0, TA + i, kin + i * ROW);
			fresh_row(l, 1, TA + i, vin + i * ROW);
		}
		assert_int_equal(fuse_layer_run(f->t, s, kin, vin, kout, vout, false, NULL, &lr,
						err, sizeof(err)), KVBP_OK);
		fuse_layer_end(f->t, s);
		for (uint32_t i = 0; i < N; i++)
			check_row(f, l, i, kout + i * ROW, vout + i * ROW, i >= TA && i < TA + NF);
		assert_int_equal(lr.done, l == L - 1);
		free(lr.selection);
		free(lr.dropped);
		fuse_prefetch(f->t, r.id);
	}
	{
		struct kvbp_stat *st = NULL;
		size_t n = 0;

		assert_int_equal(fuse_close(f->t, r.id, "ipc:0:0:2", &st, &n, err, sizeof(err)),
				 KVBP_UNKNOWN_SESSION);
		assert_int_equal(fuse_close(f->t, r.id, owner, &st, &n, err, sizeof(err)), KVBP_OK);
		free(st);
	}
	free(r.rows);
	/* closed: unpinned */
	assert_int_equal(fuse_delete_chunk(f->t, &f->m, f->ha), 0);
}

/*
 * CacheBlend: check layer 1 with ratio 0.5 (value metric). The node's V equals the
 * stored V for every cached token but five, which it changes by a lot: those five and
 * the three fresh tokens are the selection, sorted. At layer 2 the node sends those
 * eight rows and gets the stored rows for the rest.
 */
static void test_check_selects_the_deviating_tokens(void **state)
{
	struct fixture *f = *state;
	static const uint32_t checks[1] = { 1 };
	static const double ratios[1] = { 0.5 };
	static const int32_t moved[5] = { 1, 3, 10, 11, 13 }; /* cached tokens the node changes */
	struct kvbp_segment segs[3];
	struct kvbp_request q = { .segments = segs, .n_segments = 3,
				  .check_layers = (uint32_t *)checks, .n_checks = 1,
				  .ratios = (double *)ratios, .n_ratios = 1,
				  .metric = KVBP_METRIC_VALUE };
	struct fuse_open_result r = { 0 };
	struct fuse_session *s;
	struct fuse_layer_plan plan;
	struct fuse_layer_result lr = { 0 };
	char err[256];
	uint16_t kin[N * ROW], vin[N * ROW], kout[N * ROW], vout[N * ROW];
	int32_t want[8];
	size_t nw = 0;

	segments(f, segs);
	assert_int_equal(fuse_open(f->t, &f->m, &q, owner, &r, err, sizeof(err)), KVBP_OK);
	assert_int_equal(r.next_layer, 1); /* layer 0 is the node's own */
	assert_int_equal(fuse_layer_begin(f->t, r.id, owner, 1, &s, &plan, err, sizeof(err)),
			 KVBP_OK);
	assert_int_equal(plan.rows_in, N);
	assert_true(plan.selection_out);
	for (uint32_t i = 0; i < N; i++) {
		bool cached = i < TA || i >= TA + NF;
		const uint16_t *sv = i < TA ? &f->a[1][1][i * ROW]
				   : cached ? &f->b[1][1][(i - TA - NF) * ROW] : NULL;

		fresh_row(1, 0, i, kin + i * ROW);
		if (sv)
			memcpy(vin + i * ROW, sv, ROW * 2);
		else
			fresh_row(1, 1, i, vin + i * ROW);
		for (int j = 0; j < 5; j++)
			if (moved[j] == (int32_t)i)
				for (int e = 0; e < ROW; e++)
					vin[i * ROW + e] = f32_to_f16(f16_to_f32(vin[i * ROW + e]) + 8);
	}
	assert_int_equal(fuse_layer_run(f->t, s, kin, vin, kout, vout, false, NULL, &lr, err,
					sizeof(err)), KVBP_OK);
	fuse_layer_end(f->t, s);
	for (int32_t i = 0; i < N; i++) {
		bool fresh = i >= TA && i < TA + NF, hit = false;

		for (int j = 0; j < 5; j++)
			hit |= moved[j] == i;
		if (fresh || hit)
			want[nw++] = i;
	}
	/* floor(0.5 x 11 cached) = 5 cached tokens, plus the 3 fresh */
	assert_int_equal(lr.n_selection, nw);
	assert_memory_equal(lr.selection, want, nw * sizeof(int32_t));
	assert_int_equal(lr.rows_next, nw);
	free(lr.selection);
	free(lr.dropped);
	fuse_prefetch(f->t, r.id);

	/* layer 2: the node's rows for the selection, stored rows for the rest */
	memset(&lr, 0, sizeof(lr));
	assert_int_equal(fuse_layer_begin(f->t, r.id, owner, 2, &s, &plan, err, sizeof(err)),
			 KVBP_OK);
	assert_int_equal(plan.rows_in, nw);
	for (size_t j = 0; j < nw; j++) {
		fresh_row(2, 0, (uint32_t)want[j], kin + j * ROW);
		fresh_row(2, 1, (uint32_t)want[j], vin + j * ROW);
	}
	assert_int_equal(fuse_layer_run(f->t, s, kin, vin, kout, vout, false, NULL, &lr, err,
					sizeof(err)), KVBP_OK);
	fuse_layer_end(f->t, s);
	for (uint32_t i = 0; i < N; i++) {
		bool sel = false;

		for (size_t j = 0; j < nw; j++)
			sel |= want[j] == (int32_t)i;
		check_row(f, 2, i, kout + i * ROW, vout + i * ROW, sel);
	}
	free(lr.selection);
	free(lr.dropped);
	{
		struct kvbp_stat *st = NULL;
		size_t n = 0;

		assert_int_equal(fuse_close(f->t, r.id, owner, &st, &n, err, sizeof(err)), KVBP_OK);
		free(st);
	}
}

/*
 * Landing, reuse only: every layer is written into the owner's segment (K rows, then
 * V rows, contiguous per layer) by the engine's loader thread (fuse_loader_start,
 * fuse_kick; fuse_loader_stop), the progress word counts the layers,
 * and the fresh tokens' rows are left as they were (the node writes them). A layout
 * whose head stride wraps its extent (issue 30) is refused, nothing written.
 */
static void test_landing_session(void **state)
{
	struct fixture *f = *state;
	struct kvbp_segment segs[3];
	size_t side = (size_t)L * N * ROW * 2, size = 2 * side + 64;
	struct kvbp_request q = { .segments = segs, .n_segments = 3, .reuse_only = true,
				  .has_land = true };
	struct fuse_open_result r = { 0 };
	uint64_t id;
	uint8_t *base;
	char err[256];
	uint32_t progress;

	segments(f, segs);
	assert_int_equal(shm_create(f->shm, size, owner, &id), 0);
	assert_int_equal(shm_hold(f->shm, id, (void **)&base), 0);
	memset(base, 0x5a, size);
	q.land = (struct kvbp_layout){ .shm_id = id, .k_offset = 0, .v_offset = side,
				       .layer_stride = (uint64_t)N * ROW * 2,
				       .token_stride = ROW * 2, .head_stride = D * 2,
				       .progress = 2 * side };

	/* the wrapped extent first: refused, nothing written */
	q.land.head_stride = UINT64_MAX - 1;
	assert_int_equal(fuse_open(f->t, &f->m, &q, owner, &r, err, sizeof(err)), KVBP_BAD_SHAPE);
	assert_non_null(strstr(err, "overflow"));
	for (size_t i = 0; i < size; i++)
		if (base[i] != 0x5a)
			fail_msg("byte %zu written by a refused layout", i);
	q.land.head_stride = D * 2;

	assert_int_equal(fuse_open(f->t, &f->m, &q, owner, &r, err, sizeof(err)), KVBP_OK);
	/* the engine's own thread lands it, kicked as a worker kicks it after its reply */
	assert_int_equal(fuse_loader_start(f->t), 0);
	assert_int_equal(fuse_loader_start(f->t), -EALREADY);
	fuse_kick(f->t, r.id);
	for (int waited = 0; waited < 10000; waited++) {
		struct timespec ms = { 0, 1000000 };

		progress = __atomic_load_n((uint32_t *)(base + 2 * side), __ATOMIC_ACQUIRE);
		if ((progress & KVBP_LAND_COUNT) == L || (progress & KVBP_LAND_FAILED))
			break;
		nanosleep(&ms, NULL);
	}
	assert_int_equal(progress & KVBP_LAND_COUNT, L);
	assert_false(progress & KVBP_LAND_FAILED);
	for (uint32_t l = 0; l < L; l++)
		for (uint32_t i = 0; i < N; i++) {
			const uint16_t *k = (const uint16_t *)(base + ((size_t)l * N + i) * ROW * 2);
			const uint16_t *v = (const uint16_t *)(base + side +
							       ((size_t)l * N + i) * ROW * 2);

			if (i >= TA && i < TA + NF) { /* the node's rows: untouched */
				for (size_t e = 0; e < ROW * 2; e++)
					if (((const uint8_t *)k)[e] != 0x5a ||
					    ((const uint8_t *)v)[e] != 0x5a)
						fail_msg("layer %u: the node's row %u written", l, i);
				continue;
			}
			check_row(f, l, i, k, v, false);
		}
	{
		struct kvbp_stat *st = NULL;
		size_t n = 0;

		assert_int_equal(fuse_close(f->t, r.id, owner, &st, &n, err, sizeof(err)), KVBP_OK);
		free(st);
	}
	free(r.rows);
	shm_release(f->shm, id);
	assert_int_equal(shm_detach(f->shm, id, owner), 0);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		fixture_test(test_reuse_only_session),
		fixture_test(test_check_selects_the_deviating_tokens),
		fixture_test(test_landing_session),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
