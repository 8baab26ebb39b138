/* quant — quantized KV tensors; see quant.h. */
#define QUANT_SUFFIX base
#include "quant_impl.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>

void quant_dec_rows_avx2(struct quant_dec *d, uint32_t a, uint32_t b, void *dst);

static const char *const names[] = { [QUANT_NONE] = "none", [QUANT_FP8] = "fp8",
				     [QUANT_INT8] = "int8", [QUANT_INT4] = "int4" };

const char *quant_name(enum quant_codec q)
{
	return (unsigned)q < sizeof(names) / sizeof(names[0]) ? names[q] : "?";
}

int quant_parse(const char *s)
{
	if (!s || !*s)
		return QUANT_NONE;
	for (int i = 0; i < (int)(sizeof(names) / sizeof(names[0])); i++)
		if (!strcmp(s, names[i]))
			return i;
	return -1;
}

/* ---- e4m3 ---- */

uint8_t quant_fp8_encode(float f)
{
	uint8_t sign = signbit(f) ? 0x80 : 0;
	float a = fabsf(f);
	int e;

	if (!(a == a))
		return 0x7f; /* NaN (never asked for: encoders refuse non-finite tensors) */
	if (a >= 448.0f)
		return sign | 0x7e; /* saturate: e4m3 has no infinity */
	if (a < 0x1p-6f) {
		/* subnormal: m x 2^-9, m in 0..8 (8 is the smallest normal, code 0x08) */
		return sign | (uint8_t)rintf(a * 0x1p9f);
	}
	frexpf(a, &e); /* a = f x 2^e, f in [0.5, 1): the e4m3 exponent is e - 1 */
	{
		float m = rintf((ldexpf(a, 1 - e) - 1.0f) * 8.0f); /* 0..8 */
		int ex = e - 1 + 7;

		if (m == 8.0f) {
			m = 0;
			ex++;
		}
		if (ex > 15 || (ex == 15 && m > 6))
			return sign | 0x7e;
		return sign | (uint8_t)(ex << 3 | (int)m);
	}
}

float quant_fp8_value(uint8_t code)
{
	int e = code >> 3 & 15, m = code & 7;
	float v;

	if (e == 15 && m == 7)
		return NAN;
	v = e ? ldexpf(1.0f + (float)m / 8.0f, e - 7) : ldexpf((float)m, -9);
	return code & 0x80 ? -v : v;
}

static float fp8_lut[256];
static pthread_once_t fp8_once = PTHREAD_ONCE_INIT;

static void fp8_init(void)
{
	for (int i = 0; i < 256; i++)
		fp8_lut[i] = quant_fp8_value((uint8_t)i);
}

/* ---- layout ---- */

static void put_u32(uint8_t *p, uint32_t v)
{
	for (int i = 0; i < 4; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32(const uint8_t *p)
{
	return (uint32_t)p[0] | (uint32_t)p[1] << 8 | (uint32_t)p[2] << 16 | (uint32_t)p[3] << 24;
}

int quant_layout(enum quant_codec q, uint32_t rows, uint32_t channels, enum quant_axis axis,
		 uint32_t dtype, uint32_t group, struct quant_info *out)
{
	struct quant_info t = { q, rows, channels, axis, dtype, 0, QUANT_HEADER_SIZE, 0, 0, 0 };
	size_t scales, data;

	if (q != QUANT_FP8 && q != QUANT_INT8 && q != QUANT_INT4)
		return -EINVAL;
	if (dtype < 1 || dtype > 3 || (axis != QUANT_PER_CHANNEL && axis != QUANT_PER_TOKEN) ||
	    !channels)
		return -EINVAL;
	if (q == QUANT_INT4) {
		size_t ng;

		if (group < 1 || group > QUANT_GROUP_MAX)
			return -EINVAL;
		t.group = group;
		ng = axis == QUANT_PER_CHANNEL ? ((size_t)rows + group - 1) / group * channels
					       : (size_t)rows * ((channels + group - 1) / group);
		scales = 4 * ng;
		t.row_bytes = ((size_t)channels + 1) / 2;
	} else {
		scales = 4 * (size_t)(axis == QUANT_PER_CHANNEL ? channels : rows);
		t.row_bytes = channels;
	}
	if (__builtin_mul_overflow(t.row_bytes, (size_t)rows, &data))
		return -EINVAL;
	t.data_off = QUANT_HEADER_SIZE + scales;
	if (__builtin_add_overflow(t.data_off, data, &t.size))
		return -EINVAL;
	*out = t;
	return 0;
}

int quant_peek(const void *payload, size_t len, struct quant_info *out)
{
	const uint8_t *p = payload;
	uint32_t rows, channels, group;

	if (len < QUANT_HEADER_SIZE)
		return -EBADMSG;
	rows = get_u32(p);
	channels = get_u32(p + 4);
	group = (uint32_t)p[10] | (uint32_t)p[11] << 8;
	if (p[12] < QUANT_FP8 || p[12] > QUANT_INT4 || p[13] || p[14] || p[15] ||
	    quant_layout((enum quant_codec)p[12], rows, channels, (enum quant_axis)p[8], p[9],
			 group, out) ||
	    out->size != len)
		return -EBADMSG;
	return 0;
}

/* ---- encode ---- */

static float load1(uint32_t dtype, const uint8_t *p, size_t i)
{
	uint16_t h;
	float f;

	if (dtype == 3) {
		memcpy(&f, p + 4 * i, 4);
		return f;
	}
	memcpy(&h, p + 2 * i, 2);
	return dtype == 2 ? bf16_to_f32(h) : f16_to_f32(h);
}

static void put_f32(uint8_t *p, float f)
{
	memcpy(p, &f, 4);
}

static void put_u16(uint8_t *p, uint16_t v)
{
	p[0] = (uint8_t)v;
	p[1] = (uint8_t)(v >> 8);
}

/* The f16 next to h towards -infinity (h finite). */
static uint16_t f16_down(uint16_t h)
{
	if (h == 0)
		return 0x8001;
	return h & 0x8000 ? (uint16_t)(h + 1) : (uint16_t)(h - 1);
}

/* Scale of an int8 or fp8 run with absolute maximum amax, never 0 unless amax is. */
static float sym_scale(float amax, float top)
{
	float s = amax / top;

	return amax > 0 && s == 0 ? 0x1p-149f : s;
}

int quant_encode(const struct quant_info *qi, const void *src, void *dst)
{
	const uint8_t *in = src;
	uint8_t *p = dst, *sc = p + qi->scales_off, *codes = p + qi->data_off;
	size_t R = qi->rows, C = qi->channels;
	float top = qi->codec == QUANT_INT8 ? 127.0f : 448.0f;

	/* Every value finite, first: a tensor that is not is stored losslessly. */
	for (size_t i = 0; i < R * C; i++)
		if (!isfinite(load1(qi->dtype, in, i)))
			return -ERANGE;
	memset(p, 0, QUANT_HEADER_SIZE);
	put_u32(p, qi->rows);
	put_u32(p + 4, qi->channels);
	p[8] = (uint8_t)qi->axis;
	p[9] = (uint8_t)qi->dtype;
	p[10] = (uint8_t)qi->group;
	p[11] = (uint8_t)(qi->group >> 8);
	p[12] = (uint8_t)qi->codec;
	if (qi->codec == QUANT_INT8 || qi->codec == QUANT_FP8) {
		size_t ns = qi->axis == QUANT_PER_CHANNEL ? C : R;

		for (size_t k = 0; k < ns; k++) {
			float amax = 0;

			for (size_t j = 0; j < (qi->axis == QUANT_PER_CHANNEL ? R : C); j++) {
				size_t i = qi->axis == QUANT_PER_CHANNEL ? j * C + k : k * C + j;
				float a = fabsf(load1(qi->dtype, in, i));

				amax = a > amax ? a : amax;
			}
			put_f32(sc + 4 * k, sym_scale(amax, top));
		}
		for (size_t t = 0; t < R; t++)
			for (size_t c = 0; c < C; c++) {
				float s, x = load1(qi->dtype, in, t * C + c);

				memcpy(&s, sc + 4 * (qi->axis == QUANT_PER_CHANNEL ? c : t), 4);
				if (qi->codec == QUANT_INT8) {
					float q = s > 0 ? rintf(x / s) : 0;

					q = q > 127 ? 127 : q < -127 ? -127 : q;
					codes[t * C + c] = (uint8_t)(int8_t)q;
				} else {
					codes[t * C + c] = s > 0 ? quant_fp8_encode(x / s) : 0;
				}
			}
		return 0;
	}
	/* int4: groups of G tokens along a channel (keys) or G channels along a token (values) */
	{
		size_t G = qi->group, ng_row = (C + G - 1) / G;
		size_t groups = qi->axis == QUANT_PER_CHANNEL ? (R + G - 1) / G * C : R * ng_row;

		memset(codes, 0, qi->row_bytes * R);
		for (size_t g = 0; g < groups; g++) {
			/* the group's elements: (t, c) for t in [t0, t1), c in [c0, c1) */
			size_t t0, t1, c0, c1;
			float mn = INFINITY, mx = -INFINITY, z, s, need;
			uint16_t zh, sh;

			if (qi->axis == QUANT_PER_CHANNEL) {
				t0 = g / C * G;
				t1 = t0 + G < R ? t0 + G : R;
				c0 = g % C;
				c1 = c0 + 1;
			} else {
				t0 = g / ng_row;
				t1 = t0 + 1;
				c0 = g % ng_row * G;
				c1 = c0 + G < C ? c0 + G : C;
			}
			for (size_t t = t0; t < t1; t++)
				for (size_t c = c0; c < c1; c++) {
					float x = load1(qi->dtype, in, t * C + c);

					mn = x < mn ? x : mn;
					mx = x > mx ? x : mx;
				}
			if (fabsf(mn) > 65504.0f || fabsf(mx) > 65504.0f)
				return -ERANGE;
			zh = f32_to_f16(mn);
			if (f16_to_f32(zh) > mn)
				zh = f16_down(zh);
			z = f16_to_f32(zh);
			need = (mx - z) / 15.0f;
			sh = f32_to_f16(need);
			while (f16_to_f32(sh) < need && sh < 0x7c00)
				sh++;
			if (sh >= 0x7c00)
				return -ERANGE;
			s = f16_to_f32(sh);
			put_u16(sc + 2 * g, sh);
			put_u16(sc + 2 * (groups + g), zh);
			for (size_t t = t0; t < t1; t++)
				for (size_t c = c0; c < c1; c++) {
					float x = load1(qi->dtype, in, t * C + c);
					float q = s > 0 ? rintf((x - z) / s) : 0;

					q = q > 15 ? 15 : q < 0 ? 0 : q;
					codes[t * qi->row_bytes + c / 2] |= (uint8_t)((unsigned)q << (4 * (c & 1)));
				}
		}
	}
	return 0;
}

/* ---- decode ---- */

int quant_dec_init(struct quant_dec *d, const struct quant_info *qi, const void *payload)
{
	size_t C = qi->channels;

	pthread_once(&fp8_once, fp8_init);
	memset(d, 0, sizeof(*d));
	d->qi = qi;
	d->payload = payload;
	d->fp8_lut = fp8_lut;
	d->tg = SIZE_MAX;
	d->avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
	if (qi->axis != QUANT_PER_CHANNEL)
		return 0;
	/* per-channel scales as f32, once per tensor (int4: per row group, on the way) */
	d->s_all = malloc(2 * C * sizeof(float));
	if (!d->s_all)
		return -ENOMEM;
	d->z_all = d->s_all + C;
	if (qi->codec != QUANT_INT4)
		memcpy(d->s_all, (const uint8_t *)payload + qi->scales_off, 4 * C);
	return 0;
}

void quant_dec_rows(struct quant_dec *d, uint32_t a, uint32_t b, void *dst)
{
	if (d->avx2)
		quant_dec_rows_avx2(d, a, b, dst);
	else
		quant_dec_rows_base(d, a, b, dst);
}

void quant_dec_free(struct quant_dec *d)
{
	free(d->s_all);
	d->s_all = d->z_all = NULL;
}

int quant_decode_rows(const struct quant_info *qi, const void *payload, uint32_t a, uint32_t b,
		      void *dst)
{
	struct quant_dec d;
	int rc = quant_dec_init(&d, qi, payload);

	if (rc)
		return rc;
	quant_dec_rows(&d, a, b, dst);
	quant_dec_free(&d);
	return 0;
}
