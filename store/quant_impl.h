/*
 * quant_impl.h — the encode and decode kernels of quant.c, compiled once per
 * instruction set (quant.c: baseline; quant_avx2.c: AVX2 + F16C) with
 * -ffp-contract=off. The scalar code is the reference and runs every tail; the
 * vector paths do the same f32 operations on each element (IEEE division and
 * multiplication, rounding to nearest even, no fused multiply-add), so both
 * builds give the same bits. Not a public header.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if defined(__AVX2__) && defined(__F16C__)
#include <immintrin.h>
#define QUANT_SIMD 1
#else
#define QUANT_SIMD 0
#endif

#include "common/half.h"
#include "store/quant.h"

#define QCAT_(a, b) a##b
#define QCAT(a, b) QCAT_(a, b)
#define QFN(name) QCAT(name##_, QUANT_SUFFIX)

/*
 * Elements the encoder stages as f32 at a time (on the stack, three arrays): at
 * least QUANT_GROUP_MAX, so that a group of channels always fits.
 */
#define QENC_BLOCK QUANT_GROUP_MAX

#define QINLINE static inline __attribute__((always_inline))

void QFN(quant_dec_rows)(struct quant_dec *d, uint32_t a, uint32_t b, void *dst);
int QFN(quant_encode)(const struct quant_info *qi, const void *src, void *dst);

static inline float QFN(ld_f32)(const uint8_t *p)
{
	float f;

	memcpy(&f, p, 4);
	return f;
}

static inline uint16_t QFN(ld_u16)(const uint8_t *p)
{
	return (uint16_t)(p[0] | p[1] << 8);
}

static inline void QFN(st_f32)(uint8_t *p, float f)
{
	memcpy(p, &f, 4);
}

static inline void QFN(st_u16)(uint8_t *p, uint16_t v)
{
	p[0] = (uint8_t)v;
	p[1] = (uint8_t)(v >> 8);
}

/* ---- decode ---- */

/* v rounded to the output dtype, as element k of o (any alignment). */
static inline void QFN(put1)(uint32_t dtype, float v, uint8_t *o, size_t k)
{
	uint16_t h;

	if (dtype == 3) {
		memcpy(o + 4 * k, &v, 4);
		return;
	}
	h = dtype == 2 ? f32_to_bf16(v) : f32_to_f16(v);
	memcpy(o + 2 * k, &h, 2);
}

/*
 * Elements [k, channels) of row t, one at a time: the reference every vector
 * kernel matches, and their tail. Per-channel scales come from d->s_all and
 * d->z_all (int4: filled for t's row group).
 */
static void QFN(row_scalar)(const struct quant_dec *d, uint32_t t, const uint8_t *codes, size_t k,
			    uint8_t *o)
{
	const struct quant_info *qi = d->qi;
	const uint8_t *sc = d->payload + qi->scales_off;
	size_t C = qi->channels, G = qi->group, gcur = SIZE_MAX;
	float s = 0, z = 0;

	if (qi->axis == QUANT_PER_TOKEN && qi->codec != QUANT_INT4)
		s = QFN(ld_f32)(sc + 4 * (size_t)t);
	for (; k < C; k++) {
		float v;

		if (qi->axis == QUANT_PER_CHANNEL) {
			s = d->s_all[k];
			z = qi->codec == QUANT_INT4 ? d->z_all[k] : 0;
		} else if (qi->codec == QUANT_INT4 && k / G != gcur) {
			size_t g = (size_t)t * d->ng + k / G;

			gcur = k / G;
			s = f16_to_f32(QFN(ld_u16)(sc + 2 * g));
			z = f16_to_f32(QFN(ld_u16)(sc + 2 * (d->groups + g)));
		}
		if (qi->codec == QUANT_INT8)
			v = (float)(int8_t)codes[k] * s;
		else if (qi->codec == QUANT_FP8)
			v = d->fp8_lut[codes[k]] * s;
		else
			v = (float)(codes[k / 2] >> (4 * (k & 1)) & 15) * s + z;
		QFN(put1)(qi->dtype, v, o, k);
	}
}

/* int4 keys: the f32 scales and zero points of row t's group of rows, unless there already. */
static void QFN(load_key_groups)(struct quant_dec *d, uint32_t t)
{
	const struct quant_info *qi = d->qi;
	size_t C = qi->channels, c = 0;
	const uint8_t *sg, *zg;

	if (t / qi->group == d->tg)
		return;
	d->tg = t / qi->group;
	sg = d->payload + qi->scales_off + 2 * (d->tg * C);
	zg = d->payload + qi->scales_off + 2 * (d->groups + d->tg * C);
#if QUANT_SIMD
	for (; c + 8 <= C; c += 8) {
		_mm256_storeu_ps(d->s_all + c, _mm256_cvtph_ps(_mm_loadu_si128((const void *)(sg + 2 * c))));
		_mm256_storeu_ps(d->z_all + c, _mm256_cvtph_ps(_mm_loadu_si128((const void *)(zg + 2 * c))));
	}
#endif
	for (; c < C; c++) {
		d->s_all[c] = f16_to_f32(QFN(ld_u16)(sg + 2 * c));
		d->z_all[c] = f16_to_f32(QFN(ld_u16)(zg + 2 * c));
	}
}

#if QUANT_SIMD
/* f32_to_bf16() of 8 floats: nearest even, NaN quieted with its sign and top payload. */
static inline __m128i QFN(bf16x8)(__m256 v)
{
	__m256i x = _mm256_castps_si256(v);
	__m256i hi = _mm256_srli_epi32(x, 16);
	__m256i r = _mm256_srli_epi32(
		_mm256_add_epi32(x, _mm256_add_epi32(_mm256_set1_epi32(0x7fff),
						     _mm256_and_si256(hi, _mm256_set1_epi32(1)))),
		16);
	__m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(x, _mm256_set1_epi32(0x7fffffff)),
					 _mm256_set1_epi32(0x7f800000));

	r = _mm256_blendv_epi8(r, _mm256_or_si256(hi, _mm256_set1_epi32(0x40)), nan);
	return _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
}

/* 8 decoded values to the output dtype, as elements [k, k + 8) of o. */
QINLINE void QFN(emit8)(uint32_t dtype, __m256 v, uint8_t *o, size_t k)
{
	if (dtype == 1)
		_mm_storeu_si128((void *)(o + 2 * k), _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
	else if (dtype == 2)
		_mm_storeu_si128((void *)(o + 2 * k), QFN(bf16x8)(v));
	else
		_mm256_storeu_ps((float *)(void *)(o + 4 * k), v);
}

/*
 * Whether any of n e4m3 codes is NaN (0x7f, 0xff): the fast fp8 kernel has no
 * lane for them, so a block that holds one (never written by quant_encode) is
 * decoded by the scalar reference instead.
 */
static int QFN(fp8_any_nan)(const uint8_t *p, size_t n)
{
	__m256i a0 = _mm256_setzero_si256(), a1 = a0, top = _mm256_set1_epi8((char)0x80);
	size_t i = 0;

	/*
	 * code | 0x80 is 0xff for the NaN codes only: keep the largest. Four vectors
	 * an iteration on two accumulators: this runs on every block, so its loop
	 * overhead shows next to the decode.
	 */
	for (; i + 128 <= n; i += 128) {
		/* the top bit goes in before the max: max(a, b) | 0x80 would miss a 0x7f */
		__m256i v0 = _mm256_max_epu8(
			_mm256_or_si256(_mm256_loadu_si256((const void *)(p + i)), top),
			_mm256_or_si256(_mm256_loadu_si256((const void *)(p + i + 32)), top));
		__m256i v1 = _mm256_max_epu8(
			_mm256_or_si256(_mm256_loadu_si256((const void *)(p + i + 64)), top),
			_mm256_or_si256(_mm256_loadu_si256((const void *)(p + i + 96)), top));

		a0 = _mm256_max_epu8(a0, v0);
		a1 = _mm256_max_epu8(a1, v1);
	}
	for (; i + 32 <= n; i += 32)
		a0 = _mm256_max_epu8(a0,
				     _mm256_or_si256(_mm256_loadu_si256((const void *)(p + i)), top));
	if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_max_epu8(a0, a1),
						   _mm256_set1_epi8((char)0xff))))
		return 1;
	for (; i < n; i++)
		if ((p[i] & 0x7f) == 0x7f)
			return 1;
	return 0;
}

/* Outputs k .. k + 15 of a row: v0, v1 times the per-channel scales per (from k), or
 * times the one scale sv when per is NULL; one rounding each, then the dtype's. */
QINLINE void QFN(scale_emit16)(__m256 v0, __m256 v1, const float *per, __m256 sv,
			       uint32_t dtype, uint8_t *o, size_t k)
{
	if (per) {
		v0 = _mm256_mul_ps(v0, _mm256_loadu_ps(per + k));
		v1 = _mm256_mul_ps(v1, _mm256_loadu_ps(per + k + 8));
	} else {
		v0 = _mm256_mul_ps(v0, sv);
		v1 = _mm256_mul_ps(v1, sv);
	}
	QFN(emit8)(dtype, v0, o, k);
	QFN(emit8)(dtype, v1, o, k + 8);
}

/*
 * fp8: (value / 256) x (scale x 256), 16 codes at a time. A code c read as the
 * f16 bits (c & 0x80) << 8 | (c & 0x7f) << 7 is its value / 256 exactly,
 * subnormals included: sign-extending c to 16 bits and shifting by 7 puts the
 * sign in bits 14 and 15, and the mask drops bit 14. Both factors are exact
 * (s256 is s x 256, checked at init not to overflow), so the one rounding is
 * that of value x scale, as in the reference.
 */
QINLINE size_t QFN(fp8_row)(const uint8_t *codes, size_t C, const float *s256, float s1,
			    uint32_t dtype, uint8_t *o)
{
	__m256i mask = _mm256_set1_epi16((short)0xbf80);
	__m256 sv = _mm256_set1_ps(s1);
	size_t k = 0;

	for (; k + 16 <= C; k += 16) {
		__m256i x = _mm256_cvtepi8_epi16(_mm_loadu_si128((const void *)(codes + k)));
		__m256i h = _mm256_and_si256(_mm256_slli_epi16(x, 7), mask);
		__m256 v0 = _mm256_cvtph_ps(_mm256_castsi256_si128(h));
		__m256 v1 = _mm256_cvtph_ps(_mm256_extracti128_si256(h, 1));

		QFN(scale_emit16)(v0, v1, s256, sv, dtype, o, k);
	}
	return k;
}

/* int8: code x scale, 16 codes at a time. */
QINLINE size_t QFN(int8_row)(const uint8_t *codes, size_t C, const float *s_c, float s1,
			     uint32_t dtype, uint8_t *o)
{
	__m256 sv = _mm256_set1_ps(s1);
	size_t k = 0;

	for (; k + 16 <= C; k += 16) {
		__m256 v0 = _mm256_cvtepi32_ps(
			_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)(codes + k))));
		__m256 v1 = _mm256_cvtepi32_ps(
			_mm256_cvtepi8_epi32(_mm_loadl_epi64((const void *)(codes + k + 8))));

		QFN(scale_emit16)(v0, v1, s_c, sv, dtype, o, k);
	}
	return k;
}

/* The 16 int4 codes of 8 bytes (low nibble first) as f32. */
QINLINE void QFN(int4_codes16)(const uint8_t *cb, __m256 *v0, __m256 *v1)
{
	__m128i b = _mm_loadl_epi64((const void *)cb), m = _mm_set1_epi8(15);
	__m128i q = _mm_unpacklo_epi8(_mm_and_si128(b, m), _mm_and_si128(_mm_srli_epi16(b, 4), m));

	*v0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
	*v1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));
}

/* int4, a scale and zero point per channel: code x scale + zero, elements [k, end). */
QINLINE size_t QFN(int4_row_c)(const uint8_t *codes, size_t k, size_t end, const float *s_c,
			       const float *z_c, uint32_t dtype, uint8_t *o)
{
	for (; k + 16 <= end; k += 16) {
		__m256 v0, v1;

		QFN(int4_codes16)(codes + k / 2, &v0, &v1);
		v0 = _mm256_add_ps(_mm256_mul_ps(v0, _mm256_loadu_ps(s_c + k)),
				   _mm256_loadu_ps(z_c + k));
		v1 = _mm256_add_ps(_mm256_mul_ps(v1, _mm256_loadu_ps(s_c + k + 8)),
				   _mm256_loadu_ps(z_c + k + 8));
		QFN(emit8)(dtype, v0, o, k);
		QFN(emit8)(dtype, v1, o, k + 8);
	}
	return k;
}

/* int4, one scale and zero point for elements [k, end) (k even). */
QINLINE size_t QFN(int4_row_1)(const uint8_t *codes, size_t k, size_t end, float s, float z,
			       uint32_t dtype, uint8_t *o)
{
	__m256 sv = _mm256_set1_ps(s), zv = _mm256_set1_ps(z);

	for (; k + 16 <= end; k += 16) {
		__m256 v0, v1;

		QFN(int4_codes16)(codes + k / 2, &v0, &v1);
		QFN(emit8)(dtype, _mm256_add_ps(_mm256_mul_ps(v0, sv), zv), o, k);
		QFN(emit8)(dtype, _mm256_add_ps(_mm256_mul_ps(v1, sv), zv), o, k + 8);
	}
	return k;
}

/*
 * Row t with the vector kernels, as far as they go; returns the first element
 * left to the scalar reference (the row's tail). dtype is a constant where this
 * is inlined, so each output dtype gets its own loop.
 */
QINLINE size_t QFN(row_vec)(struct quant_dec *d, uint32_t t, const uint8_t *codes, uint32_t dtype,
			    uint8_t *o)
{
	const struct quant_info *qi = d->qi;
	const uint8_t *sc = d->payload + qi->scales_off;
	size_t C = qi->channels, G = qi->group;

	if (qi->codec == QUANT_INT8)
		return qi->axis == QUANT_PER_CHANNEL
			       ? QFN(int8_row)(codes, C, d->s_all, 0, dtype, o)
			       : QFN(int8_row)(codes, C, NULL, QFN(ld_f32)(sc + 4 * (size_t)t), dtype,
					       o);
	if (qi->codec == QUANT_FP8) {
		float s1 = 0;

		if (qi->axis == QUANT_PER_CHANNEL) {
			if (!d->s256)
				return 0;
		} else {
			s1 = QFN(ld_f32)(sc + 4 * (size_t)t);
			if (!(fabsf(s1) < 0x1p120f))
				return 0; /* x 256 would not be exact: the reference decodes it */
			s1 *= 256.0f;
		}
		return QFN(fp8_row)(codes, C, qi->axis == QUANT_PER_CHANNEL ? d->s256 : NULL, s1,
				    dtype, o);
	}
	if (qi->axis == QUANT_PER_CHANNEL)
		return QFN(int4_row_c)(codes, 0, C, d->s_all, d->z_all, dtype, o);
	if (G % 16 == 0) {
		/* int4 values: a group at a time, its scale and zero broadcast */
		size_t k = 0;

		for (size_t g = (size_t)t * d->ng; k < C; g++) {
			size_t end = k + G < C ? k + G : C;
			float s = _cvtsh_ss(QFN(ld_u16)(sc + 2 * g));
			float z = _cvtsh_ss(QFN(ld_u16)(sc + 2 * (d->groups + g)));

			k = QFN(int4_row_1)(codes, k, end, s, z, dtype, o);
			if (k < end)
				break; /* the row's last, partial group: its tail is scalar */
		}
		return k;
	}
	/* int4 values, other groups: scales and zero points spelled out per channel */
	for (size_t k = 0, g = (size_t)t * d->ng; k < C; g++) {
		float s = _cvtsh_ss(QFN(ld_u16)(sc + 2 * g));
		float z = _cvtsh_ss(QFN(ld_u16)(sc + 2 * (d->groups + g)));

		for (size_t end = k + G < C ? k + G : C; k < end; k++) {
			d->s_all[k] = s;
			d->z_all[k] = z;
		}
	}
	return QFN(int4_row_c)(codes, 0, C, d->s_all, d->z_all, dtype, o);
}

static void QFN(rows_vec)(struct quant_dec *d, uint32_t a, uint32_t b, uint32_t dtype, uint8_t *o)
{
	const struct quant_info *qi = d->qi;
	size_t out_row = (size_t)qi->channels * (dtype == 3 ? 4 : 2);

	for (uint32_t t = a; t < b; t++, o += out_row) {
		const uint8_t *codes = d->payload + qi->data_off + (size_t)t * qi->row_bytes;
		size_t k;

		if (qi->codec == QUANT_INT4 && qi->axis == QUANT_PER_CHANNEL)
			QFN(load_key_groups)(d, t);
		switch (dtype) {
		case 1:
			k = QFN(row_vec)(d, t, codes, 1, o);
			break;
		case 2:
			k = QFN(row_vec)(d, t, codes, 2, o);
			break;
		default:
			k = QFN(row_vec)(d, t, codes, 3, o);
			break;
		}
		if (k < qi->channels)
			QFN(row_scalar)(d, t, codes, k, o);
	}
}
#endif

void QFN(quant_dec_rows)(struct quant_dec *d, uint32_t a, uint32_t b, void *dst)
{
	const struct quant_info *qi = d->qi;
	size_t out_row = (size_t)qi->channels * (qi->dtype == 3 ? 4 : 2);
	uint8_t *o = dst;

#if QUANT_SIMD
	if (qi->codec != QUANT_FP8 ||
	    !QFN(fp8_any_nan)(d->payload + qi->data_off + (size_t)a * qi->row_bytes,
			      (size_t)(b - a) * qi->row_bytes)) {
		QFN(rows_vec)(d, a, b, qi->dtype, o);
		return;
	}
#endif
	for (uint32_t t = a; t < b; t++, o += out_row) {
		if (qi->codec == QUANT_INT4 && qi->axis == QUANT_PER_CHANNEL)
			QFN(load_key_groups)(d, t);
		QFN(row_scalar)(d, t, d->payload + qi->data_off + (size_t)t * qi->row_bytes, 0, o);
	}
}

/* ---- encode ---- */

/* n elements of dtype at p as f32. */
static void QFN(load_f32)(uint32_t dtype, const uint8_t *p, float *out, size_t n)
{
	size_t i = 0;

	if (dtype == 3) {
		memcpy(out, p, 4 * n);
		return;
	}
#if QUANT_SIMD
	for (; dtype == 1 && i + 8 <= n; i += 8) {
		__m128i h = _mm_loadu_si128((const void *)(p + 2 * i));

		_mm256_storeu_ps(out + i, _mm256_cvtph_ps(h));
	}
	/* bf16 is the top half of an f32 */
	for (; dtype == 2 && i + 8 <= n; i += 8) {
		__m256i w = _mm256_cvtepu16_epi32(_mm_loadu_si128((const void *)(p + 2 * i)));

		_mm256_storeu_ps(out + i, _mm256_castsi256_ps(_mm256_slli_epi32(w, 16)));
	}
#endif
	for (; i < n; i++) {
		uint16_t h = QFN(ld_u16)(p + 2 * i);

		out[i] = dtype == 2 ? bf16_to_f32(h) : f16_to_f32(h);
	}
}

/* Whether all n elements of dtype at p are finite (integer tests of the exponent). */
static int QFN(all_finite)(uint32_t dtype, const uint8_t *p, size_t n)
{
	size_t i = 0;

	if (dtype == 3) {
#if QUANT_SIMD
		__m256i e = _mm256_set1_epi32(0x7f800000), bad = _mm256_setzero_si256();

		for (; i + 8 <= n; i += 8)
			bad = _mm256_or_si256(bad, _mm256_cmpeq_epi32(_mm256_and_si256(
				_mm256_loadu_si256((const void *)(p + 4 * i)), e), e));
		if (!_mm256_testz_si256(bad, bad))
			return 0;
#endif
		for (; i < n; i++)
			if (!isfinite(QFN(ld_f32)(p + 4 * i)))
				return 0;
		return 1;
	}
	{
		uint16_t em = dtype == 2 ? 0x7f80 : 0x7c00;
#if QUANT_SIMD
		__m256i e = _mm256_set1_epi16((short)em), bad = _mm256_setzero_si256();

		for (; i + 16 <= n; i += 16)
			bad = _mm256_or_si256(bad, _mm256_cmpeq_epi16(_mm256_and_si256(
				_mm256_loadu_si256((const void *)(p + 2 * i)), e), e));
		if (!_mm256_testz_si256(bad, bad))
			return 0;
#endif
		for (; i < n; i++)
			if ((QFN(ld_u16)(p + 2 * i) & em) == em)
				return 0;
	}
	return 1;
}

/* Scale of an int8 or fp8 run with absolute maximum amax, never 0 unless amax is. */
static float QFN(sym_scale)(float amax, float top)
{
	float s = amax / top;

	return amax > 0 && s == 0 ? 0x1p-149f : s;
}

/* The f16 next to h towards -infinity (h finite). */
static uint16_t QFN(f16_down)(uint16_t h)
{
	if (h == 0)
		return 0x8001;
	return h & 0x8000 ? (uint16_t)(h + 1) : (uint16_t)(h - 1);
}

/*
 * An int4 group's zero point (min rounded down to f16) and scale ((max - zero) /
 * 15 rounded up to f16); -ERANGE when f16 cannot hold them.
 */
static int QFN(int4_params)(float mn, float mx, uint16_t *sh_out, uint16_t *zh_out)
{
	float need;
	uint16_t zh, sh;

	if (fabsf(mn) > 65504.0f || fabsf(mx) > 65504.0f)
		return -ERANGE;
	zh = f32_to_f16(mn);
	if (f16_to_f32(zh) > mn)
		zh = QFN(f16_down)(zh);
	need = (mx - f16_to_f32(zh)) / 15.0f;
	sh = f32_to_f16(need);
	while (f16_to_f32(sh) < need && sh < 0x7c00)
		sh++;
	if (sh >= 0x7c00)
		return -ERANGE;
	*sh_out = sh;
	*zh_out = zh;
	return 0;
}

/*
 * int4_params() of n groups (min mn[i], max mx[i]): their f16 scales and zero
 * points stored at s_out and z_out (payload bytes), and returned as f32 in sf and
 * zf (which may be mn and mx). -ERANGE when any group's is out of f16's range.
 * The vector path rounds in one step where int4_params() steps from nearest:
 * the zero point is the min rounded toward -infinity, the scale the need rounded
 * toward +infinity (the same f16 for every f32, checked exhaustively).
 */
static int QFN(int4_params_n)(const float *mn, const float *mx, size_t n, uint8_t *s_out,
			      uint8_t *z_out, float *sf, float *zf)
{
	size_t i = 0;

#if QUANT_SIMD
	__m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
	__m256 lim = _mm256_set1_ps(65504.0f);

	for (; i + 8 <= n; i += 8) {
		__m256 lo = _mm256_loadu_ps(mn + i), hi = _mm256_loadu_ps(mx + i), z;
		__m256 big = _mm256_or_ps(_mm256_cmp_ps(_mm256_and_ps(lo, abs), lim, _CMP_GT_OQ),
					  _mm256_cmp_ps(_mm256_and_ps(hi, abs), lim, _CMP_GT_OQ));
		__m128i zh, sh;

		if (_mm256_movemask_ps(big))
			return -ERANGE;
		zh = _mm256_cvtps_ph(lo, _MM_FROUND_TO_NEG_INF);
		z = _mm256_cvtph_ps(zh);
		/* max >= min >= zero: the need is +0 or more, and an f16 at 0x7c00 is Inf */
		sh = _mm256_cvtps_ph(_mm256_div_ps(_mm256_sub_ps(hi, z), _mm256_set1_ps(15.0f)),
				     _MM_FROUND_TO_POS_INF);
		if (_mm_movemask_epi8(_mm_cmpgt_epi16(sh, _mm_set1_epi16(0x7bff))))
			return -ERANGE;
		_mm_storeu_si128((void *)(s_out + 2 * i), sh);
		_mm_storeu_si128((void *)(z_out + 2 * i), zh);
		_mm256_storeu_ps(sf + i, _mm256_cvtph_ps(sh));
		_mm256_storeu_ps(zf + i, z);
	}
#endif
	for (; i < n; i++) {
		uint16_t sh, zh;

		if (QFN(int4_params)(mn[i], mx[i], &sh, &zh))
			return -ERANGE;
		QFN(st_u16)(s_out + 2 * i, sh);
		QFN(st_u16)(z_out + 2 * i, zh);
		sf[i] = f16_to_f32(sh);
		zf[i] = f16_to_f32(zh);
	}
	return 0;
}

#if QUANT_SIMD
/* quant_fp8_encode() of 8 floats, each code in the low byte of its lane. */
static inline __m256i QFN(fp8_encode8)(__m256 y)
{
	__m256i u = _mm256_castps_si256(y);
	__m256i a = _mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff));
	__m256i sign = _mm256_and_si256(_mm256_srli_epi32(u, 24), _mm256_set1_epi32(0x80));
	/*
	 * Normals: round the mantissa to 3 bits, nearest even (a carry moves into the
	 * exponent, as m == 8 does in the reference), rebias the exponent from 127 to
	 * 7 and saturate at 448 (0x7e).
	 */
	__m256i r = _mm256_add_epi32(a, _mm256_add_epi32(_mm256_set1_epi32(0x7ffff),
							 _mm256_and_si256(_mm256_srli_epi32(a, 20),
									  _mm256_set1_epi32(1))));
	__m256i c = _mm256_min_epi32(_mm256_sub_epi32(_mm256_srli_epi32(r, 20),
						      _mm256_set1_epi32(120 << 3)),
				     _mm256_set1_epi32(0x7e));
	/* below 2^-6, multiples of 2^-9: the conversion rounds to nearest even, as rintf */
	__m256i sub = _mm256_cvtps_epi32(
		_mm256_mul_ps(_mm256_castsi256_ps(a), _mm256_set1_ps(0x1p9f)));

	c = _mm256_blendv_epi8(c, sub, _mm256_cmpgt_epi32(_mm256_set1_epi32(0x3c800000), a));
	c = _mm256_or_si256(c, sign);
	return _mm256_blendv_epi8(c, _mm256_set1_epi32(0x7f),
				  _mm256_cmpgt_epi32(a, _mm256_set1_epi32(0x7f800000)));
}

/* int8 or fp8 codes of x / s for 8 lanes (0 where s is 0), as int32. */
QINLINE __m256i QFN(sym_codes8)(enum quant_codec codec, __m256 x, __m256 s)
{
	__m256 y = _mm256_div_ps(x, s);
	__m256 pos = _mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_GT_OQ);

	if (codec == QUANT_FP8)
		return _mm256_and_si256(QFN(fp8_encode8)(y), _mm256_castps_si256(pos));
	y = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
	y = _mm256_min_ps(_mm256_max_ps(y, _mm256_set1_ps(-127.0f)), _mm256_set1_ps(127.0f));
	return _mm256_cvtps_epi32(_mm256_and_ps(y, pos));
}

/* int4 codes of (x - z) / s for 8 lanes (0 where s is 0), as int32. */
static inline __m256i QFN(int4_codes8)(__m256 x, __m256 s, __m256 z)
{
	__m256 y = _mm256_div_ps(_mm256_sub_ps(x, z), s);
	__m256 pos = _mm256_cmp_ps(s, _mm256_setzero_ps(), _CMP_GT_OQ);

	y = _mm256_round_ps(y, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
	y = _mm256_min_ps(_mm256_max_ps(y, _mm256_setzero_ps()), _mm256_set1_ps(15.0f));
	return _mm256_cvtps_epi32(_mm256_and_ps(y, pos));
}

/* 16 int32 lanes of small values as 16 bytes. */
static inline __m128i QFN(pack16)(__m256i q0, __m256i q1, int is_signed)
{
	__m128i w0 = _mm_packs_epi32(_mm256_castsi256_si128(q0), _mm256_extracti128_si256(q0, 1));
	__m128i w1 = _mm_packs_epi32(_mm256_castsi256_si128(q1), _mm256_extracti128_si256(q1, 1));

	return is_signed ? _mm_packs_epi16(w0, w1) : _mm_packus_epi16(w0, w1);
}
#endif

/* Per-lane max of |x| into the f32 array at amax (payload bytes: any alignment). */
static void QFN(amax_acc)(uint8_t *amax, const float *x, size_t n)
{
	size_t i = 0;

#if QUANT_SIMD
	__m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));

	/* max(a, m) is a > m ? a : m, as below */
	for (; i + 8 <= n; i += 8) {
		float *m = (float *)(void *)(amax + 4 * i);

		_mm256_storeu_ps(m, _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs),
						  _mm256_loadu_ps(m)));
	}
#endif
	for (; i < n; i++) {
		float a = fabsf(x[i]), m = QFN(ld_f32)(amax + 4 * i);

		QFN(st_f32)(amax + 4 * i, a > m ? a : m);
	}
}

/* max(amax, |x|) over n values: a max of non-negative values, in any order. */
static float QFN(amax_of)(const float *x, size_t n, float amax)
{
	size_t i = 0;

#if QUANT_SIMD
	if (n >= 8) {
		__m256 abs = _mm256_castsi256_ps(_mm256_set1_epi32(0x7fffffff));
		__m256 m = _mm256_set1_ps(amax);
		__m128 h;

		for (; i + 8 <= n; i += 8)
			m = _mm256_max_ps(_mm256_and_ps(_mm256_loadu_ps(x + i), abs), m);
		h = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
		h = _mm_max_ps(h, _mm_movehl_ps(h, h));
		h = _mm_max_ss(h, _mm_shuffle_ps(h, h, 1));
		amax = _mm_cvtss_f32(h);
	}
#endif
	for (; i < n; i++) {
		float a = fabsf(x[i]);

		amax = a > amax ? a : amax;
	}
	return amax;
}

/*
 * int8 or fp8 codes of n values x into q: scale s_c[i] (f32 payload bytes), or
 * s1 for all when s_c is NULL.
 */
static void QFN(sym_codes)(enum quant_codec codec, const float *x, size_t n, const uint8_t *s_c,
			   float s1, uint8_t *q)
{
	size_t i = 0;

#if QUANT_SIMD
	for (; i + 16 <= n; i += 16) {
		__m256 s0 = s_c ? _mm256_loadu_ps((const float *)(const void *)(s_c + 4 * i))
				: _mm256_set1_ps(s1);
		__m256 s8 = s_c ? _mm256_loadu_ps((const float *)(const void *)(s_c + 4 * i + 32))
				: _mm256_set1_ps(s1);
		__m256i q0 = QFN(sym_codes8)(codec, _mm256_loadu_ps(x + i), s0);
		__m256i q1 = QFN(sym_codes8)(codec, _mm256_loadu_ps(x + i + 8), s8);

		_mm_storeu_si128((void *)(q + i), QFN(pack16)(q0, q1, codec == QUANT_INT8));
	}
#endif
	for (; i < n; i++) {
		float s = s_c ? QFN(ld_f32)(s_c + 4 * i) : s1;

		if (codec == QUANT_INT8) {
			float v = s > 0 ? rintf(x[i] / s) : 0;

			v = v > 127 ? 127 : v < -127 ? -127 : v;
			q[i] = (uint8_t)(int8_t)v;
		} else {
			q[i] = s > 0 ? quant_fp8_encode(x[i] / s) : 0;
		}
	}
}

/*
 * int4 codes of n values x, elements [c, c + n) of a row whose code bytes start
 * at row (zeroed): scale and zero s_c[i], z_c[i], or s1, z1 for all when NULL.
 */
static void QFN(int4_codes)(const float *x, size_t n, const float *s_c, float s1, const float *z_c,
			    float z1, uint8_t *row, size_t c)
{
	size_t i = 0;

#if QUANT_SIMD
	if (c % 2 == 0) {
		__m256 s0 = _mm256_set1_ps(s1), z0 = _mm256_set1_ps(z1), s8 = s0, z8 = z0;

		for (; i + 16 <= n; i += 16) {
			__m256i q0, q1;
			__m128i pairs;

			if (s_c) {
				s0 = _mm256_loadu_ps(s_c + i);
				s8 = _mm256_loadu_ps(s_c + i + 8);
			}
			if (z_c) {
				z0 = _mm256_loadu_ps(z_c + i);
				z8 = _mm256_loadu_ps(z_c + i + 8);
			}
			q0 = QFN(int4_codes8)(_mm256_loadu_ps(x + i), s0, z0);
			q1 = QFN(int4_codes8)(_mm256_loadu_ps(x + i + 8), s8, z8);
			/* byte j: code 2j | code 2j+1 << 4 */
			pairs = _mm_maddubs_epi16(QFN(pack16)(q0, q1, 0), _mm_set1_epi16(0x1001));
			_mm_storel_epi64((void *)(row + (c + i) / 2), _mm_packus_epi16(pairs, pairs));
		}
	}
#endif
	for (; i < n; i++) {
		float s = s_c ? s_c[i] : s1, z = z_c ? z_c[i] : z1;
		float v = s > 0 ? rintf((x[i] - z) / s) : 0;

		v = v > 15 ? 15 : v < 0 ? 0 : v;
		row[(c + i) / 2] |= (uint8_t)((unsigned)v << (4 * ((c + i) & 1)));
	}
}

/* Per-lane min and max of x into mn and mx, in the order the rows come (see int4_keys). */
static void QFN(minmax_acc)(float *mn, float *mx, const float *x, size_t n)
{
	size_t i = 0;

#if QUANT_SIMD
	/* min(v, m) is v < m ? v : m and max(v, m) is v > m ? v : m, as below */
	for (; i + 8 <= n; i += 8) {
		__m256 v = _mm256_loadu_ps(x + i);

		_mm256_storeu_ps(mn + i, _mm256_min_ps(v, _mm256_loadu_ps(mn + i)));
		_mm256_storeu_ps(mx + i, _mm256_max_ps(v, _mm256_loadu_ps(mx + i)));
	}
#endif
	for (; i < n; i++) {
		mn[i] = x[i] < mn[i] ? x[i] : mn[i];
		mx[i] = x[i] > mx[i] ? x[i] : mx[i];
	}
}

/*
 * Min and max of n values in order, the first of equal values kept: only the
 * sign of a zero depends on the order, so the lanes are reduced in any order and
 * the scan is redone in order when a result is zero.
 */
static void QFN(minmax_of)(const float *x, size_t n, float *mn_out, float *mx_out)
{
	float mn = INFINITY, mx = -INFINITY;
	size_t i = 0;

#if QUANT_SIMD
	if (n >= 8) {
		__m256 lo = _mm256_set1_ps(INFINITY), hi = _mm256_set1_ps(-INFINITY);
		__m128 l, h;

		for (; i + 8 <= n; i += 8) {
			__m256 v = _mm256_loadu_ps(x + i);

			lo = _mm256_min_ps(v, lo);
			hi = _mm256_max_ps(v, hi);
		}
		l = _mm_min_ps(_mm256_castps256_ps128(lo), _mm256_extractf128_ps(lo, 1));
		l = _mm_min_ps(l, _mm_movehl_ps(l, l));
		mn = _mm_cvtss_f32(_mm_min_ss(l, _mm_shuffle_ps(l, l, 1)));
		h = _mm_max_ps(_mm256_castps256_ps128(hi), _mm256_extractf128_ps(hi, 1));
		h = _mm_max_ps(h, _mm_movehl_ps(h, h));
		mx = _mm_cvtss_f32(_mm_max_ss(h, _mm_shuffle_ps(h, h, 1)));
	}
#endif
	for (; i < n; i++) {
		mn = x[i] < mn ? x[i] : mn;
		mx = x[i] > mx ? x[i] : mx;
	}
	if (QUANT_SIMD && n >= 8 && (mn == 0 || mx == 0)) {
		mn = INFINITY;
		mx = -INFINITY;
		for (i = 0; i < n; i++) {
			mn = x[i] < mn ? x[i] : mn;
			mx = x[i] > mx ? x[i] : mx;
		}
	}
	*mn_out = mn;
	*mx_out = mx;
}

/* int8 / fp8: scales (all first: keys need every row for theirs), then the codes row by row. */
static void QFN(enc_sym)(const struct quant_info *qi, const uint8_t *in, uint8_t *sc,
			 uint8_t *codes)
{
	size_t R = qi->rows, C = qi->channels, esz = qi->dtype == 3 ? 4 : 2;
	float top = qi->codec == QUANT_INT8 ? 127.0f : 448.0f, xb[QENC_BLOCK];

	if (qi->axis == QUANT_PER_CHANNEL) {
		/* the absolute maxima gather in the scales' place, row by row */
		memset(sc, 0, 4 * C);
		for (size_t t = 0; t < R; t++)
			for (size_t c0 = 0; c0 < C; c0 += QENC_BLOCK) {
				size_t n = C - c0 < QENC_BLOCK ? C - c0 : QENC_BLOCK;

				QFN(load_f32)(qi->dtype, in + (t * C + c0) * esz, xb, n);
				QFN(amax_acc)(sc + 4 * c0, xb, n);
			}
		for (size_t c = 0; c < C; c++)
			QFN(st_f32)(sc + 4 * c, QFN(sym_scale)(QFN(ld_f32)(sc + 4 * c), top));
	}
	for (size_t t = 0; t < R; t++) {
		const uint8_t *row = in + t * C * esz;
		float s1 = 0;

		if (qi->axis == QUANT_PER_TOKEN) {
			float amax = 0;

			for (size_t c0 = 0; c0 < C; c0 += QENC_BLOCK) {
				size_t n = C - c0 < QENC_BLOCK ? C - c0 : QENC_BLOCK;

				QFN(load_f32)(qi->dtype, row + c0 * esz, xb, n);
				amax = QFN(amax_of)(xb, n, amax);
			}
			s1 = QFN(sym_scale)(amax, top);
			QFN(st_f32)(sc + 4 * t, s1);
		}
		for (size_t c0 = 0; c0 < C; c0 += QENC_BLOCK) {
			size_t n = C - c0 < QENC_BLOCK ? C - c0 : QENC_BLOCK;

			/* a row that fits one block is staged already */
			if (qi->axis == QUANT_PER_CHANNEL || C > QENC_BLOCK)
				QFN(load_f32)(qi->dtype, row + c0 * esz, xb, n);
			QFN(sym_codes)(qi->codec, xb, n,
				       qi->axis == QUANT_PER_CHANNEL ? sc + 4 * c0 : NULL, s1,
				       codes + t * C + c0);
		}
	}
}

/*
 * int4 keys: a group of G rows at a time, in blocks of channels: min and max per
 * channel over the group's rows in order, the groups' scales and zero points,
 * then the group's codes.
 */
static int QFN(int4_keys)(const struct quant_info *qi, const uint8_t *in, uint8_t *sc,
			  uint8_t *codes, size_t groups)
{
	size_t R = qi->rows, C = qi->channels, G = qi->group, esz = qi->dtype == 3 ? 4 : 2;
	float xb[QENC_BLOCK], mn[QENC_BLOCK], mx[QENC_BLOCK];

	for (size_t t0 = 0; t0 < R; t0 += G) {
		size_t t1 = t0 + G < R ? t0 + G : R;

		for (size_t c0 = 0; c0 < C; c0 += QENC_BLOCK) {
			size_t n = C - c0 < QENC_BLOCK ? C - c0 : QENC_BLOCK, g;

			for (size_t i = 0; i < n; i++) {
				mn[i] = INFINITY;
				mx[i] = -INFINITY;
			}
			for (size_t t = t0; t < t1; t++) {
				QFN(load_f32)(qi->dtype, in + (t * C + c0) * esz, xb, n);
				QFN(minmax_acc)(mn, mx, xb, n);
			}
			/* mn and mx become the f32 scales and zero points */
			g = t0 / G * C + c0;
			if (QFN(int4_params_n)(mn, mx, n, sc + 2 * g, sc + 2 * (groups + g), mn, mx))
				return -ERANGE;
			for (size_t t = t0; t < t1; t++) {
				QFN(load_f32)(qi->dtype, in + (t * C + c0) * esz, xb, n);
				QFN(int4_codes)(xb, n, mn, 0, mx, 0, codes + t * qi->row_bytes, c0);
			}
		}
	}
	return 0;
}

/*
 * int4 values: a row at a time, in blocks of whole groups of channels: the
 * groups' min and max, their scales and zero points, then their codes.
 */
static int QFN(int4_values)(const struct quant_info *qi, const uint8_t *in, uint8_t *sc,
			    uint8_t *codes, size_t groups)
{
	size_t R = qi->rows, C = qi->channels, G = qi->group, esz = qi->dtype == 3 ? 4 : 2;
	size_t ng = (C + G - 1) / G, span = QENC_BLOCK / G * G;
	float xb[QENC_BLOCK], s[QENC_BLOCK], z[QENC_BLOCK];

	for (size_t t = 0; t < R; t++)
		for (size_t c0 = 0; c0 < C; c0 += span) {
			size_t n = C - c0 < span ? C - c0 : span, k = (n + G - 1) / G;
			size_t g = t * ng + c0 / G;

			QFN(load_f32)(qi->dtype, in + (t * C + c0) * esz, xb, n);
			for (size_t j = 0; j < k; j++)
				QFN(minmax_of)(xb + j * G, n - j * G < G ? n - j * G : G, &s[j], &z[j]);
			/* s and z: the groups' min and max, then their scales and zero points */
			if (QFN(int4_params_n)(s, z, k, sc + 2 * g, sc + 2 * (groups + g), s, z))
				return -ERANGE;
			for (size_t j = 0; j < k; j++)
				QFN(int4_codes)(xb + j * G, n - j * G < G ? n - j * G : G, NULL, s[j],
						NULL, z[j], codes + t * qi->row_bytes, c0 + j * G);
		}
	return 0;
}

int QFN(quant_encode)(const struct quant_info *qi, const void *src, void *dst)
{
	const uint8_t *in = src;
	uint8_t *p = dst, *sc = p + qi->scales_off, *codes = p + qi->data_off;
	size_t R = qi->rows, C = qi->channels, G = qi->group;

	/* Every value finite, first: a tensor that is not is stored losslessly. */
	if (!QFN(all_finite)(qi->dtype, in, R * C))
		return -ERANGE;
	memset(p, 0, QUANT_HEADER_SIZE);
	for (int i = 0; i < 4; i++) {
		p[i] = (uint8_t)(qi->rows >> (8 * i));
		p[4 + i] = (uint8_t)(qi->channels >> (8 * i));
	}
	p[8] = (uint8_t)qi->axis;
	p[9] = (uint8_t)qi->dtype;
	p[10] = (uint8_t)qi->group;
	p[11] = (uint8_t)(qi->group >> 8);
	p[12] = (uint8_t)qi->codec;
	if (qi->codec == QUANT_INT8 || qi->codec == QUANT_FP8) {
		QFN(enc_sym)(qi, in, sc, codes);
		return 0;
	}
	/* int4: groups of G tokens along a channel (keys) or G channels along a token (values) */
	memset(codes, 0, qi->row_bytes * R);
	if (qi->axis == QUANT_PER_CHANNEL)
		return QFN(int4_keys)(qi, in, sc, codes, (R + G - 1) / G * C);
	return QFN(int4_values)(qi, in, sc, codes, R * ((C + G - 1) / G));
}
