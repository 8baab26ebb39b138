/*
 * kernels_impl.h — the CPU kernels of the blend backend, compiled once per
 * instruction set (cpu_baseline.c, cpu_avx2.c, cpu_avx512.c include it with
 * different target flags and KERNEL_SUFFIX). All builds use
 * -ffp-contract=off and the same operation order, so they agree bit for bit.
 * Not a public header.
 */
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "blend/backend.h"
#include "blend/elem.h"

#define KCAT_(a, b) a##b
#define KCAT(a, b) KCAT_(a, b)
#define KFN(name) KCAT(name##_, KERNEL_SUFFIX)

/* Largest head_dim the kernels take on the stack. */
#define KMAX_DIM 4096

int KFN(blend_rotate)(const struct blend_backend *be, const struct blend_shape *s,
		      const struct rope_table *t, const void *src, void *dst, uint32_t row0,
		      uint32_t n);
int KFN(blend_rotate_to)(const struct blend_backend *be, const struct blend_shape *s,
			 const struct rope_table *t, const void *src, void *dst,
			 const struct blend_out *out, uint32_t row0, uint32_t n);
int KFN(blend_deviation)(const struct blend_backend *be, const struct blend_shape *s,
			 const void *fresh, const void *stored, const int32_t *idx, size_t n,
			 float *out);

/*
 * Tensors come from payload frames and shared-memory offsets, which promise no
 * alignment: every access to them goes through memcpy (one unaligned move once
 * compiled) or an unaligned SIMD load/store, never through a uint16_t or float
 * lvalue, so an odd address is neither undefined behaviour nor a slower path.
 */
static inline uint16_t KFN(get16)(const uint8_t *p)
{
	uint16_t v;

	memcpy(&v, p, 2);
	return v;
}

static inline void KFN(put16)(uint8_t *p, uint16_t v)
{
	memcpy(p, &v, 2);
}

static void KFN(load)(enum blend_dtype dt, const void *src, float *restrict out, size_t n)
{
	const uint8_t *b = src;
	size_t i = 0;

	if (dt == BLEND_F32) {
		memcpy(out, src, n * 4);
		return;
	}
	if (dt == BLEND_BF16) {
		for (; i < n; i++)
			out[i] = f32_from_bits((uint32_t)KFN(get16)(b + 2 * i) << 16);
		return;
	}
#if defined(__F16C__)
	for (; i + 8 <= n; i += 8)
		_mm256_storeu_ps(out + i,
				 _mm256_cvtph_ps(_mm_loadu_si128((const void *)(b + 2 * i))));
#endif
	for (; i < n; i++)
		out[i] = f16_to_f32(KFN(get16)(b + 2 * i));
}

static void KFN(store)(enum blend_dtype dt, const float *restrict in, void *dst, size_t n)
{
	uint8_t *b = dst;
	size_t i = 0;

	if (dt == BLEND_F32) {
		memcpy(dst, in, n * 4);
		return;
	}
	if (dt == BLEND_BF16) {
		for (; i < n; i++)
			KFN(put16)(b + 2 * i, f32_to_bf16(in[i]));
		return;
	}
#if defined(__F16C__)
	for (; i + 8 <= n; i += 8)
		_mm_storeu_si128((void *)(b + 2 * i), _mm256_cvtps_ph(_mm256_loadu_ps(in + i),
								      _MM_FROUND_TO_NEAREST_INT));
#endif
	for (; i < n; i++)
		KFN(put16)(b + 2 * i, f32_to_f16(in[i]));
}

#if defined(__F16C__) && defined(__AVX2__)
/* Eight elements of dtype dt from p (any address), as fp32. */
static inline __m256 KFN(load8)(enum blend_dtype dt, const uint8_t *p)
{
	if (dt == BLEND_F32)
		return _mm256_loadu_ps((const float *)(const void *)p);
	if (dt == BLEND_BF16)
		return _mm256_castsi256_ps(_mm256_slli_epi32(
			_mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)p)), 16));
	return _mm256_cvtph_ps(_mm_loadu_si128((const void *)p));
}

/* Eight bf16 of v, rounded as f32_to_bf16 (half.h) does, NaN included. */
static inline __m128i KFN(to_bf16x8)(__m256 v)
{
	__m256i x = _mm256_castps_si256(v);
	__m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)),
					 _mm256_set1_epi32(0x7f800000));
	__m256i odd = _mm256_and_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(1));
	__m256i r = _mm256_srli_epi32(
		_mm256_add_epi32(x, _mm256_add_epi32(_mm256_set1_epi32(0x7fff), odd)), 16);
	__m256i q = _mm256_or_si256(_mm256_srli_epi32(x, 16), _mm256_set1_epi32(0x40));

	r = _mm256_blendv_epi8(r, q, nan);
	/* 32 to 16 bits (every value fits), lanes back in order */
	r = _mm256_permute4x64_epi64(_mm256_packus_epi32(r, r), 0x08);
	return _mm256_castsi256_si128(r);
}

/* Eight elements of v to p in dtype dt: non-temporal when nt (p then aligned to the
 * store: 16 bytes, or 32 for f32). */
static inline void KFN(store8)(enum blend_dtype dt, uint8_t *p, __m256 v, int nt)
{
	__m128i h;

	if (dt == BLEND_F32) {
		if (nt)
			_mm256_stream_ps((float *)(void *)p, v);
		else
			_mm256_storeu_ps((float *)(void *)p, v);
		return;
	}
	h = dt == BLEND_BF16 ? KFN(to_bf16x8)(v) : _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT);
	if (nt)
		_mm_stream_si128((__m128i *)(void *)p, h);
	else
		_mm_storeu_si128((void *)p, h);
}

/*
 * Neox pairs, half a multiple of 8, any dtype: convert, rotate and convert back in
 * registers, 8 pairs at a time. The same operations in the same order as the
 * general path (elem_rotate_pair, no FMA; the same rounding back), so the results
 * are identical. Output rows rs and heads hs bytes apart; nt: non-temporal stores
 * (the caller checked that every store is aligned).
 */
static inline __attribute__((always_inline)) void
KFN(rotate_neox8)(enum blend_dtype dt, int nt, const struct blend_shape *s,
		  const struct rope_table *t, const uint8_t *src, uint8_t *dst, size_t rs,
		  size_t hs, uint32_t row0, uint32_t n)
{
	size_t es = blend_dtype_size(dt), hd = s->head_dim, half = s->rotary_dim / 2;
	const __m256 sc = _mm256_set1_ps(t->scale);

	for (uint32_t r = 0; r < n; r++) {
		size_t trow = t->rows == 1 ? 0 : (size_t)(row0 + r);
		const float *c = t->cos + trow * half, *sn = t->sin + trow * half;

		for (uint32_t h = 0; h < s->heads; h++) {
			/* Byte pointers: the rows may sit at any address (see get16). */
			const uint8_t *x = src + ((size_t)r * s->heads + h) * hd * es;
			uint8_t *y = dst + r * rs + h * hs;

			for (size_t j = 0; j < half; j += 8) {
				__m256 x1 = KFN(load8)(dt, x + es * j);
				__m256 x2 = KFN(load8)(dt, x + es * (half + j));
				__m256 cj = _mm256_loadu_ps(c + j), sj = _mm256_loadu_ps(sn + j);
				__m256 y1 = _mm256_mul_ps(_mm256_sub_ps(_mm256_mul_ps(x1, cj),
									_mm256_mul_ps(x2, sj)), sc);
				__m256 y2 = _mm256_mul_ps(_mm256_add_ps(_mm256_mul_ps(x2, cj),
									_mm256_mul_ps(x1, sj)), sc);

				KFN(store8)(dt, y + es * j, y1, nt);
				KFN(store8)(dt, y + es * (half + j), y2, nt);
			}
			if (y != x)
				memcpy(y + 2 * half * es, x + 2 * half * es, (hd - 2 * half) * es);
		}
	}
}
#endif

int KFN(blend_rotate_to)(const struct blend_backend *be, const struct blend_shape *s,
			 const struct rope_table *t, const void *src, void *dst,
			 const struct blend_out *out, uint32_t row0, uint32_t n)
{
	size_t es = blend_dtype_size(s->dtype), hd = s->head_dim, half = s->rotary_dim / 2;
	size_t rs = out->row_stride, hs = out->head_stride;
	float x[KMAX_DIM], y[KMAX_DIM], a[KMAX_DIM / 2], b[KMAX_DIM / 2];
	const float sc = t->scale;

	(void)be;
#if defined(__F16C__) && defined(__AVX2__)
	if (s->style == ROPE_NEOX && half % 8 == 0 && es) {
		/* streamed only where every store is aligned (half % 8 == 0: the rotated
		 * part of a head is whole stores of 8 elements from the head's start) */
		int nt = out->stream && ((uintptr_t)dst | rs | hs) % (8 * es) == 0;

		/* one loop per dtype and store kind: no branch left in the inner loop */
#define ROTATE8(dt_, nt_) KFN(rotate_neox8)(dt_, nt_, s, t, src, dst, rs, hs, row0, n)
		if (s->dtype == BLEND_F16)
			nt ? ROTATE8(BLEND_F16, 1) : ROTATE8(BLEND_F16, 0);
		else if (s->dtype == BLEND_BF16)
			nt ? ROTATE8(BLEND_BF16, 1) : ROTATE8(BLEND_BF16, 0);
		else
			nt ? ROTATE8(BLEND_F32, 1) : ROTATE8(BLEND_F32, 0);
#undef ROTATE8
		return 0;
	}
#endif
	for (uint32_t r = 0; r < n; r++) {
		size_t trow = t->rows == 1 ? 0 : (size_t)(row0 + r);
		const float *restrict c = t->cos + trow * half, *restrict sn = t->sin + trow * half;

		for (uint32_t h = 0; h < s->heads; h++) {
			size_t off = ((size_t)r * s->heads + h) * hd * es;

			KFN(load)(s->dtype, (const uint8_t *)src + off, x, hd);
			if (s->style == ROPE_NEOX) {
				const float *restrict x1 = x, *restrict x2 = x + half;
				float *restrict y1 = y, *restrict y2 = y + half;

				for (size_t j = 0; j < half; j++)
					elem_rotate_pair(x1[j], x2[j], c[j], sn[j], sc, &y1[j], &y2[j]);
			} else {
				/* Deinterleave, rotate, interleave: keeps the arithmetic identical. */
				for (size_t j = 0; j < half; j++) {
					a[j] = x[2 * j];
					b[j] = x[2 * j + 1];
				}
				for (size_t j = 0; j < half; j++)
					elem_rotate_pair(a[j], b[j], c[j], sn[j], sc, &y[2 * j],
							 &y[2 * j + 1]);
			}
			for (size_t j = 2 * half; j < hd; j++)
				y[j] = x[j];
			KFN(store)(s->dtype, y, (uint8_t *)dst + r * rs + h * hs, hd);
		}
	}
	return 0;
}

int KFN(blend_rotate)(const struct blend_backend *be, const struct blend_shape *s,
		      const struct rope_table *t, const void *src, void *dst, uint32_t row0,
		      uint32_t n)
{
	size_t hb = (size_t)s->head_dim * blend_dtype_size(s->dtype);
	struct blend_out o = { s->heads * hb, hb, 0 };

	return KFN(blend_rotate_to)(be, s, t, src, dst, &o, row0, n);
}

int KFN(blend_deviation)(const struct blend_backend *be, const struct blend_shape *s,
			 const void *fresh, const void *stored, const int32_t *idx, size_t n,
			 float *out)
{
	size_t es = blend_dtype_size(s->dtype), row = (size_t)s->heads * s->head_dim;
	float x[KMAX_DIM], y[KMAX_DIM];

	(void)be;
	for (size_t i = 0; i < n; i++) {
		const uint8_t *f = (const uint8_t *)fresh + i * row * es;
		const uint8_t *o = (const uint8_t *)stored + (idx ? (size_t)idx[i] : i) * row * es;
		/* Eight partial sums, then a fixed tree: the same order at every SIMD width. */
		float acc[8] = { 0 };

		for (size_t h = 0; h < s->heads; h++) {
			size_t d = s->head_dim, j;

			KFN(load)(s->dtype, f + h * d * es, x, d);
			KFN(load)(s->dtype, o + h * d * es, y, d);
			for (j = 0; j + 8 <= d; j += 8)
				for (int k = 0; k < 8; k++) {
					float e = x[j + k] - y[j + k];

					acc[k] += e * e;
				}
			for (; j < d; j++) {
				float e = x[j] - y[j];

				acc[j % 8] += e * e;
			}
		}
		out[i] = elem_lanes_reduce(acc);
	}
	return 0;
}
