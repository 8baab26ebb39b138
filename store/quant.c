/* quant — quantized KV tensors; see quant.h. */
#define QUANT_SUFFIX base
#include "store/quant_impl.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdbool.h>

#include "common/ckd.h"

void quant_dec_rows_avx2(struct quant_dec *d, uint32_t a, uint32_t b, void *dst);
int quant_encode_avx2(const struct quant_info *qi, const void *src, void *dst);

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
	if (ckd_mul(&data, t.row_bytes, (size_t)rows))
		return -EINVAL;
	t.data_off = QUANT_HEADER_SIZE + scales;
	if (ckd_add(&t.size, t.data_off, data))
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

/* ---- encode and decode: the kernels are quant_impl.h's ---- */

int quant_encode(const struct quant_info *qi, const void *src, void *dst)
{
	if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c"))
		return quant_encode_avx2(qi, src, dst);
	return quant_encode_base(qi, src, dst);
}

int quant_dec_init(struct quant_dec *d, const struct quant_info *qi, const void *payload)
{
	size_t C = qi->channels, G = qi->group;

	pthread_once(&fp8_once, fp8_init);
	memset(d, 0, sizeof(*d));
	d->qi = qi;
	d->payload = payload;
	d->fp8_lut = fp8_lut;
	d->tg = SIZE_MAX;
	d->avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("f16c");
	if (qi->codec == QUANT_INT4) {
		d->ng = (C + G - 1) / G;
		d->groups = qi->axis == QUANT_PER_CHANNEL ? ((size_t)qi->rows + G - 1) / G * C
							  : (size_t)qi->rows * d->ng;
	} else if (qi->axis != QUANT_PER_CHANNEL) {
		return 0; /* one scale a row, read as the rows come */
	}
	/*
	 * Per-channel scales as f32, once per tensor (int4 keys: per row group, on the
	 * way; int4 values: room for a row's); fp8 keys also keep them x 256.
	 */
	d->s_all = malloc((qi->codec == QUANT_FP8 ? 3 : 2) * C * sizeof(float));
	if (!d->s_all)
		return -ENOMEM;
	d->z_all = d->s_all + C;
	if (qi->codec == QUANT_INT4)
		return 0;
	memcpy(d->s_all, (const uint8_t *)payload + qi->scales_off, 4 * C);
	if (qi->codec == QUANT_FP8) {
		/* the AVX2 kernel multiplies value / 256 by scale x 256: exact below 2^120 */
		d->s256 = d->z_all + C;
		for (size_t c = 0; c < C; c++) {
			if (!(fabsf(d->s_all[c]) < 0x1p120f)) {
				d->s256 = NULL;
				break;
			}
			d->s256[c] = d->s_all[c] * 256.0f;
		}
	}
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
	d->s_all = d->z_all = d->s256 = NULL;
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
