/* qsel — question-aware selection scores; see qsel.h. */
#include "blend/qsel.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>

#include "blend/elem.h"

void qsel_head_deviation(const struct blend_shape *s, const uint8_t *fresh, size_t stride,
			 const uint8_t *stored, const int32_t *idx, size_t n, float *out)
{
	size_t per_row = (size_t)s->heads * s->head_dim;

	for (size_t i = 0; i < n; i++) {
		const uint8_t *f = fresh + i * stride;
		size_t base = (size_t)idx[i] * per_row;

		for (uint32_t h = 0; h < s->heads; h++) {
			float acc = 0.0f;

			for (uint32_t d = 0; d < s->head_dim; d++) {
				size_t e = (size_t)h * s->head_dim + d;
				float x = elem_load(s->dtype, f, e) -
					  elem_load(s->dtype, stored, base + e);

				acc = acc + x * x;
			}
			out[i * s->heads + h] = acc;
		}
	}
}

/* Per head, the mean of the finite values of column h of d [n, heads]. */
static void head_means(const float *d, size_t n, uint32_t heads, float *m)
{
	for (uint32_t h = 0; h < heads; h++) {
		double sum = 0;
		size_t cnt = 0;

		for (size_t i = 0; i < n; i++) {
			float x = d[i * heads + h];

			if (isfinite(x)) {
				sum = sum + (double)x;
				cnt++;
			}
		}
		m[h] = cnt ? (float)(sum / (double)cnt) : 0.0f;
	}
}

int qsel_score(const float *dk, const float *dv, const float *a, size_t n, uint32_t heads,
	       float *score)
{
	float *mk = malloc(2 * ((size_t)heads + 1) * sizeof(float)), *mv;

	if (!mk)
		return -ENOMEM;
	mv = mk + heads + 1;
	head_means(dk, n, heads, mk);
	head_means(dv, n, heads, mv);
	for (size_t i = 0; i < n; i++) {
		float acc = 0.0f;

		for (uint32_t h = 0; h < heads; h++) {
			float k = dk[i * heads + h], v = dv[i * heads + h];

			if (mk[h] > 0)
				k = k / mk[h];
			if (mv[h] > 0)
				v = v / mv[h];
			acc = acc + a[i * heads + h] * sqrtf(k + v);
		}
		score[i] = acc;
	}
	free(mk);
	return 0;
}

long qsel_first_bad(const float *a, size_t count)
{
	for (size_t i = 0; i < count; i++)
		if (!(isfinite(a[i]) && a[i] >= 0))
			return (long)i;
	return -1;
}
