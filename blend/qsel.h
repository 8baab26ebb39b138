/*
 * qsel — question-aware selection (issue 24): the score of a cached token at a
 * check layer is sum over KV heads h of A[j,h] * sqrt(dK'[j,h] + dV'[j,h]), where A
 * is how much the question attends to token j through head h (the node's preview
 * pass) and dK', dV' are the token's squared K and V deviation in head h, each
 * divided by that head's mean over the candidates. A library: no I/O, no globals.
 *
 * Every step has a fixed operation order so that a NumPy reference reproduces the
 * scores bit for bit (eval/cacheblend.py, attention_score): build without
 * floating-point contraction (-ffp-contract=off).
 */
#ifndef KVBLEND_BLEND_QSEL_H
#define KVBLEND_BLEND_QSEL_H

#include <stddef.h>
#include <stdint.h>

#include "blend/backend.h"

/*
 * Squared deviation per head: out[i * heads + h] = sum over d = 0 .. head_dim-1,
 * in that order, of (fresh - stored)^2, each element converted to fp32, every
 * operation rounded to fp32. Fresh row i is at fresh + i * stride; its stored row is
 * row idx[i] of stored ([tokens, heads, head_dim] in s->dtype).
 */
void qsel_head_deviation(const struct blend_shape *s, const uint8_t *fresh, size_t stride,
			 const uint8_t *stored, const int32_t *idx, size_t n, float *out);

/*
 * The scores of n candidates from their per-head K and V deviations dk, dv and
 * their attention rows a (each [n, heads], row i of candidate i): per head the mean
 * m of the finite deviations over the candidates (summed in double in candidate
 * order, divided by their count in double, rounded to fp32; 0 if none), each
 * deviation divided by m in fp32 (left as it is when m is 0); then
 * score[i] = ((0 + a[i,0] * sqrt(dk'+dv')) + a[i,1] * sqrt(...)) + ..., in fp32.
 * A non-finite deviation gives a non-finite score (NaN sorts as largest). Returns 0
 * or -ENOMEM.
 */
int qsel_score(const float *dk, const float *dv, const float *a, size_t n, uint32_t heads,
	       float *score);

/*
 * The first of count attention values that is not a finite number >= 0, or -1 when
 * all are (A must be; the daemon refuses others).
 */
long qsel_first_bad(const float *a, size_t count);

#endif
