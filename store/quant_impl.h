/*
 * quant_impl.h — the decode kernel of quant.c, compiled once per instruction set
 * (quant.c: baseline; quant_avx2.c: AVX2 + F16C) with -ffp-contract=off, so that
 * both give the same bits. Not a public header.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#if defined(__F16C__)
#include <immintrin.h>
#endif

#include "../blend/half.h"
#include "quant.h"

#define QCAT_(a, b) a##b
#define QCAT(a, b) QCAT_(a, b)
#define QFN(name) QCAT(name##_, QUANT_SUFFIX)

/* Channels decoded at a time (floats on the stack). */
#define QBLOCK 512

void QFN(quant_dec_rows)(struct quant_dec *d, uint32_t a, uint32_t b, void *dst);

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

/* Round n floats to the output dtype at o (any alignment). */
static void QFN(put)(uint32_t dtype, const float *in, uint8_t *o, size_t n)
{
	size_t i = 0;

	if (dtype == 3) {
		memcpy(o, in, n * 4);
		return;
	}
	if (dtype == 2) {
		for (; i < n; i++) {
			uint16_t h = f32_to_bf16(in[i]);

			memcpy(o + 2 * i, &h, 2);
		}
		return;
	}
#if defined(__F16C__)
	for (; i + 8 <= n; i += 8)
		_mm_storeu_si128((void *)(o + 2 * i),
				 _mm256_cvtps_ph(_mm256_loadu_ps(in + i), _MM_FROUND_TO_NEAREST_INT));
#endif
	for (; i < n; i++) {
		uint16_t h = f32_to_f16(in[i]);

		memcpy(o + 2 * i, &h, 2);
	}
}

#if defined(__AVX2__) && defined(__F16C__)
/*
 * e4m3 codes (8, in the low bytes of b) to their f32 values divided by 256: an
 * e4m3 code c read as the f16 bits (c & 0x80) << 8 | (c & 0x7f) << 7 is its value
 * times 2^-8 exactly, subnormals included. The two NaN codes become NaN.
 */
static inline __m256 QFN(fp8_ps_div256)(__m128i b)
{
	__m128i x = _mm_cvtepu8_epi16(b);
	__m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x80)), 8),
				 _mm_slli_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7f)), 7));
	__m128i nan = _mm_cmpeq_epi16(_mm_and_si128(x, _mm_set1_epi16(0x7f)), _mm_set1_epi16(0x7f));

	/* a quiet f16 NaN (0x7e00) where the code is NaN: f32 NaN 0x7fc00000 after conversion */
	h = _mm_blendv_epi8(h, _mm_set1_epi16(0x7e00), nan);
	return _mm256_cvtph_ps(h);
}
#endif

/*
 * One block of n codes of a row to f32 in out: int8/fp8 times s_c; int4 times s_c
 * plus z_c (codes from the row's byte c0 / 2 on, c0 even). Straight to f16 at o
 * when the output is f16 and AVX2 is there (returns 1), else into out (returns 0).
 */
static int QFN(block)(enum quant_codec codec, const uint8_t *codes, size_t c0, size_t n,
		      const float *s_c, float s1, const float *z_c, float z1,
		      const float *fp8_lut, float *out, uint32_t dtype, uint8_t *o)
{
	size_t i = 0;

#if defined(__AVX2__) && defined(__F16C__)
	if (dtype == 1) {
		if (codec == QUANT_INT4) {
			const uint8_t *cb = codes + c0 / 2;

			for (; i + 16 <= n; i += 16) {
				__m128i b = _mm_loadl_epi64((const void *)(cb + i / 2));
				__m128i lo = _mm_and_si128(b, _mm_set1_epi8(15));
				__m128i hi = _mm_and_si128(_mm_srli_epi16(b, 4), _mm_set1_epi8(15));
				__m128i q = _mm_unpacklo_epi8(lo, hi);
				__m256 f0 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(q));
				__m256 f1 = _mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(_mm_srli_si128(q, 8)));

				__m256 s0 = s_c ? _mm256_loadu_ps(s_c + i) : _mm256_set1_ps(s1);
				__m256 s8 = s_c ? _mm256_loadu_ps(s_c + i + 8) : _mm256_set1_ps(s1);
				__m256 z0 = z_c ? _mm256_loadu_ps(z_c + i) : _mm256_set1_ps(z1);
				__m256 z8 = z_c ? _mm256_loadu_ps(z_c + i + 8) : _mm256_set1_ps(z1);

				f0 = _mm256_add_ps(_mm256_mul_ps(f0, s0), z0);
				f1 = _mm256_add_ps(_mm256_mul_ps(f1, s8), z8);
				_mm_storeu_si128((void *)(o + 2 * i),
						 _mm256_cvtps_ph(f0, _MM_FROUND_TO_NEAREST_INT));
				_mm_storeu_si128((void *)(o + 2 * i + 16),
						 _mm256_cvtps_ph(f1, _MM_FROUND_TO_NEAREST_INT));
			}
		} else {
			for (; i + 8 <= n; i += 8) {
				__m128i b = _mm_loadl_epi64((const void *)(codes + c0 + i));
				__m256 sv = s_c ? _mm256_loadu_ps(s_c + i) : _mm256_set1_ps(s1);
				__m256 v;

				if (codec == QUANT_INT8) {
					v = _mm256_mul_ps(_mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(b)), sv);
				} else {
					/* (value / 256) x (scale x 256): both exact, so the one
					 * rounding is that of value x scale */
					v = _mm256_mul_ps(QFN(fp8_ps_div256)(b),
							  _mm256_mul_ps(sv, _mm256_set1_ps(256.0f)));
				}
				_mm_storeu_si128((void *)(o + 2 * i),
						 _mm256_cvtps_ph(v, _MM_FROUND_TO_NEAREST_INT));
			}
		}
		if (i == n)
			return 1;
	}
#endif
	for (size_t k = i; k < n; k++) {
		size_t c = c0 + k;

		if (codec == QUANT_INT8)
			out[k] = (float)(int8_t)codes[c] * (s_c ? s_c[k] : s1);
		else if (codec == QUANT_FP8)
			out[k] = fp8_lut[codes[c]] * (s_c ? s_c[k] : s1);
		else
			out[k] = (float)(codes[c / 2] >> (4 * (c & 1)) & 15) * (s_c ? s_c[k] : s1) +
				 (z_c ? z_c[k] : z1);
	}
	if (i) {
		/* the vector part went straight to f16: round the rest the same way */
		QFN(put)(dtype, out + i, o + 2 * i, n - i);
		return 1;
	}
	return 0;
}

void QFN(quant_dec_rows)(struct quant_dec *d, uint32_t a, uint32_t b, void *dst)
{
	const struct quant_info *qi = d->qi;
	const uint8_t *p = d->payload, *sc = p + qi->scales_off;
	size_t esz = qi->dtype == 3 ? 4 : 2, C = qi->channels, G = qi->group;
	size_t ng = qi->codec == QUANT_INT4 ? (C + G - 1) / G : 0;
	/* int4: the groups of the tensor (the zero points follow the scales) */
	size_t groups = qi->codec != QUANT_INT4 ? 0
			: qi->axis == QUANT_PER_CHANNEL ? ((size_t)qi->rows + G - 1) / G * C
							: (size_t)qi->rows * ng;
	float out[QBLOCK], s_c[QBLOCK], z_c[QBLOCK];
	uint8_t *o = dst;

	for (uint32_t t = a; t < b; t++, o += C * esz) {
		const uint8_t *codes = p + qi->data_off + (size_t)t * qi->row_bytes;

		if (qi->codec == QUANT_INT4 && qi->axis == QUANT_PER_CHANNEL && t / G != d->tg) {
			/* int4 keys: a scale and zero per channel for a run of G rows */
			const uint8_t *sg, *zg;
			size_t c = 0;

			d->tg = t / G;
			sg = sc + 2 * (d->tg * C);
			zg = sc + 2 * (groups + d->tg * C);
#if defined(__F16C__)
			for (; c + 8 <= C; c += 8) {
				_mm256_storeu_ps(d->s_all + c,
						 _mm256_cvtph_ps(_mm_loadu_si128((const void *)(sg + 2 * c))));
				_mm256_storeu_ps(d->z_all + c,
						 _mm256_cvtph_ps(_mm_loadu_si128((const void *)(zg + 2 * c))));
			}
#endif
			for (; c < C; c++) {
				d->s_all[c] = f16_to_f32(QFN(ld_u16)(sg + 2 * c));
				d->z_all[c] = f16_to_f32(QFN(ld_u16)(zg + 2 * c));
			}
		}
		for (size_t c0 = 0; c0 < C; c0 += QBLOCK) {
			size_t n = C - c0 < QBLOCK ? C - c0 : QBLOCK;
			const float *s = s_c, *z = z_c;
			float s1 = 0;

			if (qi->axis == QUANT_PER_CHANNEL) {
				s = d->s_all + c0;
				z = qi->codec == QUANT_INT4 ? d->z_all + c0 : NULL;
			} else if (qi->codec != QUANT_INT4) {
				s = NULL; /* one scale for the row */
				s1 = QFN(ld_f32)(sc + 4 * (size_t)t);
			} else if (G % 2 == 0 && G >= 16) {
				/* int4 values, even groups: a group at a time, its scale and zero
				 * uniform (blocks start on a byte) */
				for (size_t i = 0; i < n;) {
					size_t c = c0 + i, g = t * ng + c / G, end = (c / G + 1) * G - c0;
					float sv = f16_to_f32(QFN(ld_u16)(sc + 2 * g));
					float zv = f16_to_f32(QFN(ld_u16)(sc + 2 * (groups + g)));

					end = end < n ? end : n;
					if (!QFN(block)(qi->codec, codes, c, end - i, NULL, sv, NULL, zv,
							d->fp8_lut, out, qi->dtype, o + c * esz))
						QFN(put)(qi->dtype, out, o + c * esz, end - i);
					i = end;
				}
				continue;
			} else {
				/* int4 values, other groups: scales and zeros spelled out */
				for (size_t i = 0; i < n;) {
					size_t c = c0 + i, g = t * ng + c / G, end = (c / G + 1) * G - c0;
					float sv = f16_to_f32(QFN(ld_u16)(sc + 2 * g));
					float zv = f16_to_f32(QFN(ld_u16)(sc + 2 * (groups + g)));

					for (end = end < n ? end : n; i < end; i++) {
						s_c[i] = sv;
						z_c[i] = zv;
					}
				}
			}
			if (!QFN(block)(qi->codec, codes, c0, n, s, s1, z, 0, d->fp8_lut, out, qi->dtype,
					o + c0 * esz))
				QFN(put)(qi->dtype, out, o + c0 * esz, n);
		}
	}
}
