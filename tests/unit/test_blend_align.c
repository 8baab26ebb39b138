/*
 * Unit tests of the blend backends on memory of no particular alignment: payload
 * frames and shared-memory offsets guarantee none, so rotate, deviation and merge
 * must give, at any byte offset, the same bits as on aligned buffers. Every CPU
 * instruction set this machine has, every dtype, both RoPE styles, full and
 * partial rotary, head_dims with and without SIMD tails. Under UBSan
 * (-fsanitize=alignment) a typed 16- or 32-bit access at an odd address aborts.
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "blend/backend.h"
#include "blend/cuda/cuda.h"
#include "blend/rope.h"

#define ROWS 5

struct align_case {
	uint32_t heads, head_dim, rotary_dim;
	enum rope_style style;
};

static const struct align_case cases[] = {
	{ 8, 128, 128, ROPE_NEOX }, /* the shape of the issue: 8 heads x 128 */
	{ 8, 128, 128, ROPE_GPTJ },
	{ 2, 40, 32, ROPE_NEOX },   /* f16 fast path (half % 8 == 0), partial rotary */
	{ 3, 10, 6, ROPE_NEOX },    /* scalar tails everywhere */
	{ 3, 14, 10, ROPE_GPTJ },
};

static const enum blend_dtype dtypes[] = { BLEND_F16, BLEND_BF16, BLEND_F32 };
static const char *const isas[] = { "baseline", "avx2", "avx512" };
/* 2 is aligned for 16-bit types but not for f32 nor for any vector width. */
static const size_t offsets[] = { 1, 2, 3 };

static uint64_t rng = 0x9e3779b97f4a7c15ull;

static uint64_t next_rand(void)
{
	rng ^= rng << 13, rng ^= rng >> 7, rng ^= rng << 17;
	return rng;
}

/* Finite values of magnitude 2^-2..2^1 with random mantissas and signs. */
static void fill(enum blend_dtype dt, uint8_t *p, size_t elems)
{
	for (size_t i = 0; i < elems; i++) {
		uint64_t x = next_rand();

		if (dt == BLEND_F16) {
			uint16_t h = (uint16_t)((x >> 63) << 15 | (13 + (x >> 20 & 3)) << 10 |
						(x & 0x3ff));

			memcpy(p + 2 * i, &h, 2);
		} else if (dt == BLEND_BF16) {
			uint16_t h = (uint16_t)((x >> 63) << 15 | (125 + (x >> 20 & 3)) << 7 |
						(x & 0x7f));

			memcpy(p + 2 * i, &h, 2);
		} else {
			uint32_t f = (uint32_t)((x >> 63) << 31 | (125 + (x >> 20 & 3)) << 23 |
						(x & 0x7fffff));

			memcpy(p + 4 * i, &f, 4);
		}
	}
}

/* A buffer of n bytes whose data starts `off` bytes past a 64-byte boundary. */
static uint8_t *at_offset(size_t n, size_t off, void **base)
{
	assert_int_equal(posix_memalign(base, 64, n + off + 64), 0);
	memset(*base, 0xa5, n + off + 64);
	return (uint8_t *)*base + off;
}

static void check_one(const struct blend_backend *be, const struct align_case *c,
		      enum blend_dtype dt, size_t off)
{
	struct blend_shape s = { c->heads, c->head_dim, c->rotary_dim, c->style, dt };
	struct rope_config rc = { .head_dim = c->head_dim, .rotary_dim = c->rotary_dim,
				  .style = c->style, .theta = 10000.0 };
	struct rope_table t;
	size_t row = (size_t)c->heads * c->head_dim * blend_dtype_size(dt), bytes = ROWS * row;
	/* off for inputs, another misalignment for outputs: both must work independently. */
	size_t off2 = (off * 5 + 1) % 4;
	void *b_src, *b_dst, *b_usrc, *b_udst, *b_fr, *b_ufr, *b_out, *b_uout;
	uint8_t *src = at_offset(bytes, 0, &b_src), *dst = at_offset(bytes, 0, &b_dst);
	uint8_t *usrc = at_offset(bytes, off, &b_usrc), *udst = at_offset(bytes, off2, &b_udst);
	uint8_t *fr = at_offset(bytes, 0, &b_fr), *ufr = at_offset(bytes, off, &b_ufr);
	uint8_t *out = at_offset(bytes, 0, &b_out), *uout = at_offset(bytes, off2, &b_uout);
	int32_t idx[ROWS] = { 4, 0, 3, 1, 2 }, sel[2] = { 1, 3 };
	float dev[ROWS], udev[ROWS];

	/* Per-token rows: pre-RoPE keys rotate from zero to new_pos + t. */
	assert_int_equal(rope_table_build(&rc, true, ROWS, 0, ROWS, 7, 64, &t), 0);
	assert_int_equal(t.rows, ROWS);
	fill(dt, src, ROWS * c->heads * c->head_dim);
	fill(dt, fr, ROWS * c->heads * c->head_dim);
	memcpy(usrc, src, bytes);
	memcpy(ufr, fr, bytes);

	assert_int_equal(be->rotate(be, &s, &t, src, dst, 0, ROWS), 0);
	assert_int_equal(be->rotate(be, &s, &t, usrc, udst, 0, ROWS), 0);
	assert_memory_equal(dst, udst, bytes);
	/* In place, the way a GET re-rotates into the client's buffer. */
	assert_int_equal(be->rotate(be, &s, &t, usrc, usrc, 0, ROWS), 0);
	assert_memory_equal(dst, usrc, bytes);
	/* From a row other than 0 (table row row0 + r). */
	memcpy(usrc, src, bytes);
	assert_int_equal(be->rotate(be, &s, &t, src + 2 * row, dst + 2 * row, 2, ROWS - 2), 0);
	assert_int_equal(be->rotate(be, &s, &t, usrc + 2 * row, udst + 2 * row, 2, ROWS - 2), 0);
	assert_memory_equal(dst, udst, bytes);

	memcpy(usrc, src, bytes);
	assert_int_equal(be->deviation(be, &s, fr, src, idx, ROWS, dev), 0);
	assert_int_equal(be->deviation(be, &s, ufr, usrc, idx, ROWS, udev), 0);
	assert_memory_equal(dev, udev, sizeof(dev));
	for (int i = 0; i < ROWS; i++)
		assert_true(dev[i] > 0);

	assert_int_equal(be->merge(be, &s, src, fr, sel, 2, out, 0, ROWS), 0);
	assert_int_equal(be->merge(be, &s, usrc, ufr, sel, 2, uout, 0, ROWS), 0);
	assert_memory_equal(out, uout, bytes);
	assert_memory_equal(out + 1 * row, fr, row);
	assert_memory_equal(out + 3 * row, fr + row, row);
	assert_memory_equal(out + 4 * row, src + 4 * row, row);

	rope_table_free(&t);
	free(b_src), free(b_dst), free(b_usrc), free(b_udst);
	free(b_fr), free(b_ufr), free(b_out), free(b_uout);
}

/* The CUDA backend on device 0, or NULL (saying why) where there is none. */
static struct blend_cuda *gpu;

static const struct blend_backend *gpu_backend(void)
{
	char why[256];

	if (!gpu && blend_cuda_open(0, &gpu, why, sizeof(why))) {
		print_message("# cuda: %s\n", why);
		return NULL;
	}
	return blend_cuda_backend(gpu);
}

static void test_unaligned_equals_aligned(void **state)
{
	unsigned ran = 0;

	(void)state;
	for (size_t i = 0; i < sizeof(isas) / sizeof(isas[0]) + 1; i++) {
		const struct blend_backend *be = i < sizeof(isas) / sizeof(isas[0])
							 ? blend_cpu_backend_isa(isas[i])
							 : gpu_backend();

		if (!be) {
			if (i < sizeof(isas) / sizeof(isas[0]))
				print_message("# %s: not on this CPU\n", isas[i]);
			continue;
		}
		for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++)
			for (size_t d = 0; d < sizeof(dtypes) / sizeof(dtypes[0]); d++)
				for (size_t o = 0; o < sizeof(offsets) / sizeof(offsets[0]); o++) {
					check_one(be, &cases[c], dtypes[d], offsets[o]);
					ran++;
				}
	}
	assert_true(ran > 0);
}

/*
 * rotate_to (landing's K into a node's paged cache) gives rotate's bits with each head
 * where the strides say, streamed or not, at aligned and odd addresses, and touches
 * no byte between the heads it writes. Laid out as vLLM's CPU cache is: a head's
 * slots of a page one after another, heads a page of K and V apart.
 */
static void test_rotate_to_places_heads(void **state)
{
	unsigned ran = 0;

	(void)state;
	for (size_t i = 0; i < sizeof(isas) / sizeof(isas[0]); i++) {
		const struct blend_backend *be = blend_cpu_backend_isa(isas[i]);

		if (!be)
			continue;
		assert_non_null(be->rotate_to);
		for (size_t c = 0; c < sizeof(cases) / sizeof(cases[0]); c++)
			for (size_t d = 0; d < sizeof(dtypes) / sizeof(dtypes[0]); d++)
				for (int mode = 0; mode < 4; mode++) {
					const struct align_case *k = &cases[c];
					enum blend_dtype dt = dtypes[d];
					struct blend_shape s = { k->heads, k->head_dim, k->rotary_dim,
								 k->style, dt };
					struct rope_config rc = { .head_dim = k->head_dim,
								  .rotary_dim = k->rotary_dim,
								  .style = k->style, .theta = 1e4 };
					size_t hb = k->head_dim * blend_dtype_size(dt);
					size_t row = k->heads * hb, bytes = ROWS * row;
					/* 64-byte-aligned strides, or odd ones (never streamed) */
					size_t ts = mode & 1 ? hb + 3 : (hb + 63) / 64 * 64;
					size_t hs = 2 * ROWS * ts + (mode & 1 ? 5 : 0);
					size_t span = k->heads * hs, off = mode & 1 ? 3 : 0;
					struct blend_out o = { ts, hs, mode >> 1 };
					struct rope_table t;
					void *b1, *b2, *b3;
					uint8_t *src = at_offset(bytes, 0, &b1);
					uint8_t *want = at_offset(bytes, 0, &b2);
					uint8_t *dst = at_offset(span, off, &b3);

					assert_int_equal(rope_table_build(&rc, true, ROWS, 0, ROWS, 9,
									  64, &t), 0);
					fill(dt, src, bytes / blend_dtype_size(dt));
					assert_int_equal(be->rotate(be, &s, &t, src, want, 0, ROWS), 0);
					/* rows 1.. from table row 1, as landing's runs start mid-chunk */
					assert_int_equal(be->rotate_to(be, &s, &t, src, dst, &o, 0, 1), 0);
					assert_int_equal(be->rotate_to(be, &s, &t, src + row, dst + ts,
								       &o, 1, ROWS - 1), 0);
					blend_stream_fence();
					for (uint32_t h = 0; h < k->heads; h++)
						for (uint32_t r = 0; r < ROWS; r++) {
							uint8_t *p = dst + h * hs + r * ts;

							assert_memory_equal(p, want + r * row + h * hb, hb);
							for (size_t b = hb; b < ts; b++)
								assert_int_equal(p[b], 0xa5);
						}
					rope_table_free(&t);
					free(b1), free(b2), free(b3);
					ran++;
				}
	}
	assert_true(ran > 0);
}

/* blend_stream_copy copies every byte at every alignment and length, streamed or not. */
static void test_stream_copy(void **state)
{
	static const size_t lens[] = { 0, 1, 63, 64, 128, 192, 256, 4096 + 64 };
	void *b1, *b2;
	uint8_t *src = at_offset(8192, 0, &b1);

	(void)state;
	fill(BLEND_F16, src, 4096);
	for (size_t l = 0; l < sizeof(lens) / sizeof(lens[0]); l++)
		for (size_t off = 0; off < 3; off++) {
			uint8_t *dst = at_offset(lens[l] + 64, off * 31, &b2);

			blend_stream_copy(dst, src + off, lens[l]);
			blend_stream_fence();
			assert_memory_equal(dst, src + off, lens[l]);
			assert_int_equal(dst[lens[l]], 0xa5);
			free(b2);
		}
	free(b1);
}

/*
 * NaNs (quiet, signalling, with payloads), infinities, the largest finite and values
 * halfway between two of the dtype: in the first head's rotated pairs (x1 at d, x2
 * at d + 64) and in every dtype, so the SIMD rounding back agrees with half.h's.
 */
static void specials(enum blend_dtype dt, uint8_t *p)
{
	static const uint16_t h16[] = { 0x7e01, 0x7c01, 0xfc00, 0x7bff, 0xfe55, 0x3c00 };
	static const uint16_t b16[] = { 0x7fc1, 0x7f81, 0xff80, 0x7f7f, 0xffaa, 0x3f80 };
	static const uint32_t f32[] = { 0x7fc00001, 0x7f800001, 0xff800000, 0x7f7fffff,
					0x3f808000, 0x3f818000 };

	for (int i = 0; i < 6; i++) {
		size_t at = i < 3 ? (size_t)i : 64 + (size_t)i; /* pairs (0..2) and (67..69) */

		if (dt == BLEND_F32)
			memcpy(p + 4 * at, &f32[i], 4);
		else
			memcpy(p + 2 * at, dt == BLEND_BF16 ? &b16[i] : &h16[i], 2);
	}
	/* both halves of pair 3 NaN */
	memcpy(p + (dt == BLEND_F32 ? 4 : 2) * 3, dt == BLEND_F32 ? (const void *)&f32[0]
			 : dt == BLEND_BF16 ? (const void *)&b16[0] : (const void *)&h16[0],
	       dt == BLEND_F32 ? 4 : 2);
	memcpy(p + (dt == BLEND_F32 ? 4 : 2) * 67, dt == BLEND_F32 ? (const void *)&f32[1]
			 : dt == BLEND_BF16 ? (const void *)&b16[1] : (const void *)&h16[1],
	       dt == BLEND_F32 ? 4 : 2);
}

/* The widest backend the daemon picks must agree with the baseline bit for bit at an
 * odd offset too (the reference the NumPy tests check). */
static void test_isas_agree_unaligned(void **state)
{
	const struct blend_backend *base = blend_cpu_backend_isa("baseline");
	const struct blend_backend *be = blend_cpu_backend();
	struct blend_shape s = { 8, 128, 128, ROPE_NEOX, BLEND_BF16 };
	struct rope_config rc = { .head_dim = 128, .rotary_dim = 128, .style = ROPE_NEOX,
				  .theta = 1e6 };
	size_t cap = ROWS * 8 * 128 * 4, bytes;
	void *b1, *b2, *b3;
	uint8_t *src = at_offset(cap, 1, &b1), *d1 = at_offset(cap, 3, &b2);
	uint8_t *d2 = at_offset(cap, 1, &b3);
	struct rope_table t;

	(void)state;
	assert_non_null(base);
	assert_int_equal(rope_table_build(&rc, false, ROWS, 0, ROWS, 100, 200, &t), 0);
	for (size_t d = 0; d < sizeof(dtypes) / sizeof(dtypes[0]); d++) {
		s.dtype = dtypes[d];
		bytes = ROWS * 8 * 128 * blend_dtype_size(s.dtype);
		fill(s.dtype, src, bytes / blend_dtype_size(s.dtype));
		specials(s.dtype, src);
		assert_int_equal(base->rotate(base, &s, &t, src, d1, 0, ROWS), 0);
		assert_int_equal(be->rotate(be, &s, &t, src, d2, 0, ROWS), 0);
		assert_memory_equal(d1, d2, bytes);
		if (gpu_backend()) {
			const struct blend_backend *g = gpu_backend();

			assert_int_equal(g->rotate(g, &s, &t, src, d2, 0, ROWS), 0);
			assert_memory_equal(d1, d2, bytes);
		}
	}
	rope_table_free(&t);
	free(b1), free(b2), free(b3);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_unaligned_equals_aligned),
		cmocka_unit_test(test_isas_agree_unaligned),
		cmocka_unit_test(test_rotate_to_places_heads),
		cmocka_unit_test(test_stream_copy),
	};

	int rc = cmocka_run_group_tests(tests, NULL, NULL);

	blend_cuda_close(&gpu);
	return rc;
}
