/*
 * hkvd — selection of the high-KV-deviation tokens of CacheBlend: the cached
 * tokens whose stored KV differs most from a fresh recomputation, which the
 * serving node recomputes from then on. A library: no I/O, no globals.
 */
#ifndef KVBLEND_BLEND_HKVD_H
#define KVBLEND_BLEND_HKVD_H

#include <stddef.h>
#include <stdint.h>

/*
 * How many cached tokens a ratio selects: floor(ratio x n_cached) computed in
 * double, at least 1 when ratio > 0 and n_cached > 0, at most n_cached.
 */
size_t hkvd_count(double ratio, size_t n_cached);

/*
 * Pick the k candidates with the largest deviation (ties to the lower token
 * index; NaN counts as largest), add every token of `always` (the fresh ones),
 * and write the union sorted ascending to out (room for min(k, n_cand) +
 * n_always). cand holds token indices, dev their deviations; both arrays of
 * n_cand. cand and always must not share tokens. Returns the count written, or
 * a negative errno (-ENOMEM).
 */
long hkvd_select(const int32_t *cand, const float *dev, size_t n_cand, size_t k,
		 const int32_t *always, size_t n_always, int32_t *out);

#endif
