/* hkvd — top-k selection by KV deviation; see hkvd.h. */
#include "blend/hkvd.h"

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "blend/elem.h"

size_t hkvd_count(double ratio, size_t n_cached)
{
	double k;

	if (!(ratio > 0) || n_cached == 0)
		return 0;
	k = floor(ratio * (double)n_cached);
	if (k < 1)
		return 1;
	return k >= (double)n_cached ? n_cached : (size_t)k;
}

/* One 64-bit key orders candidates exactly as required (elem.h). */
static uint64_t key_of(float dev, int32_t idx)
{
	return elem_hkvd_key(dev, idx);
}

static void swap(uint64_t *a, uint64_t *b)
{
	uint64_t t = *a;

	*a = *b;
	*b = t;
}

/* Move the k largest keys to a[0..k) (in no order): quickselect, median of three. */
static void select_top(uint64_t *a, size_t n, size_t k)
{
	size_t lo = 0, hi = n; /* the answer's boundary lies in [lo, hi) */

	while (hi - lo > 1) {
		size_t mid = lo + (hi - lo) / 2, i, store;
		uint64_t pivot;

		if (a[lo] < a[mid])
			swap(&a[lo], &a[mid]);
		if (a[lo] < a[hi - 1])
			swap(&a[lo], &a[hi - 1]);
		if (a[mid] < a[hi - 1])
			swap(&a[mid], &a[hi - 1]);
		/* now a[lo] >= a[mid] >= a[hi-1]: the median is at mid */
		pivot = a[mid];
		swap(&a[mid], &a[hi - 1]);
		for (i = store = lo; i < hi - 1; i++)
			if (a[i] > pivot)
				swap(&a[i], &a[store++]);
		swap(&a[store], &a[hi - 1]);
		/* a[lo..store) > pivot = a[store] > a[store+1..hi) (keys are distinct) */
		if (store + 1 == k || store == k)
			return;
		if (store + 1 < k)
			lo = store + 1;
		else
			hi = store;
	}
}

static int cmp_i32(const void *a, const void *b)
{
	int32_t x = *(const int32_t *)a, y = *(const int32_t *)b;

	return (x > y) - (x < y);
}

long hkvd_select(const int32_t *cand, const float *dev, size_t n_cand, size_t k,
		 const int32_t *always, size_t n_always, int32_t *out)
{
	uint64_t *keys;
	size_t n = 0;

	if (k > n_cand)
		k = n_cand;
	if (k) {
		keys = malloc(n_cand * sizeof(*keys));
		if (!keys)
			return -ENOMEM;
		for (size_t i = 0; i < n_cand; i++)
			keys[i] = key_of(dev[i], cand[i]);
		if (k < n_cand)
			select_top(keys, n_cand, k);
		for (size_t i = 0; i < k; i++)
			out[n++] = elem_hkvd_index(keys[i]);
		free(keys);
	}
	memcpy(out + n, always, n_always * sizeof(*always));
	n += n_always;
	qsort(out, n, sizeof(*out), cmp_i32);
	return (long)n;
}
