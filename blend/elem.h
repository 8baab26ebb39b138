/*
 * elem — the per-element math of the fuse, shared by every backend: loading and
 * storing one element of a dtype, rotating one pair, the deviation's lane sums
 * and their fixed reduction tree, and HKVD's ordering key. The CPU kernels
 * (kernels_impl.h, hkvd.c) and the CUDA kernels (cuda/kernels.cu) call these
 * same functions, so the CPU tests exercise the code the GPU runs, and both
 * backends agree bit for bit where the operation order is the same. Compile
 * without floating-point contraction (-ffp-contract=off, nvcc --fmad=false).
 * Not a public header.
 */
#ifndef KVBLEND_BLEND_ELEM_H
#define KVBLEND_BLEND_ELEM_H

#include <stddef.h>
#include <stdint.h>

#include "blend/backend.h"
#include "common/half.h"

/*
 * Element i of a tensor of dtype dt. On the host p may be any byte address; on the
 * device it must be aligned to the element size (device buffers are), so that a
 * load is one access rather than a byte-wise copy.
 */
KVB_HD float elem_load(int dt, const uint8_t *p, size_t i)
{
#ifdef __CUDA_ARCH__
	if (dt == BLEND_F32)
		return ((const float *)p)[i];
	return dt == BLEND_BF16 ? bf16_to_f32(((const uint16_t *)p)[i])
			       : f16_to_f32(((const uint16_t *)p)[i]);
#endif
	if (dt == BLEND_F32) {
		float f;

		memcpy(&f, p + 4 * i, 4);
		return f;
	}
	{
		uint16_t h;

		memcpy(&h, p + 2 * i, 2);
		return dt == BLEND_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
	}
}

/* Store f as element i, rounded to nearest even (alignment as for elem_load). */
KVB_HD void elem_store(int dt, uint8_t *p, size_t i, float f)
{
#ifdef __CUDA_ARCH__
	if (dt == BLEND_F32)
		((float *)p)[i] = f;
	else
		((uint16_t *)p)[i] = dt == BLEND_BF16 ? f32_to_bf16(f) : f32_to_f16(f);
	return;
#endif
	if (dt == BLEND_F32) {
		memcpy(p + 4 * i, &f, 4);
	} else {
		uint16_t h = dt == BLEND_BF16 ? f32_to_bf16(f) : f32_to_f16(f);

		memcpy(p + 2 * i, &h, 2);
	}
}

/*
 * Rotate the pair (x1, x2) by the angle whose cosine and sine are c and s, then
 * scale: y1 = (x1 c - x2 s) sc, y2 = (x2 c + x1 s) sc, in this order, each
 * product rounded (no FMA). Every backend's rotation is this.
 */
KVB_HD void elem_rotate_pair(float x1, float x2, float c, float s, float sc, float *y1,
			     float *y2)
{
	float p = x1 * c, q = x2 * s;
	float u = x2 * c, v = x1 * s;

	*y1 = (p - q) * sc;
	*y2 = (u + v) * sc;
}

/*
 * The deviation of a row is accumulated in 8 lanes: element j of a head (j from
 * 0 in every head) adds its squared difference to lane j % 8, in order of head
 * then j; the lanes then reduce in a fixed tree. Any SIMD width or thread split
 * that keeps each lane's order gives the same float.
 */
KVB_HD float elem_lanes_reduce(const float acc[8])
{
	return ((acc[0] + acc[4]) + (acc[2] + acc[6])) + ((acc[1] + acc[5]) + (acc[3] + acc[7]));
}

/*
 * HKVD's ordering key: larger key = selected first. The deviation's bits (a
 * non-negative float orders like its bit pattern; NaN above +Inf, a negative
 * value, which squares cannot give, lowest) above the complemented token index,
 * so that at equal deviation the lower index wins. Keys are distinct.
 */
KVB_HD uint64_t elem_hkvd_key(float dev, int32_t idx)
{
	uint32_t b = f32_bits(dev);

	if ((b & 0x7fffffffu) > 0x7f800000u) /* NaN, either sign */
		b = 0x7fffffffu;
	else if (b & 0x80000000u)
		b = 0;
	return (uint64_t)b << 32 | (0xffffffffu - (uint32_t)idx);
}

/* The token index a key was made from. */
KVB_HD int32_t elem_hkvd_index(uint64_t key)
{
	return (int32_t)(0xffffffffu - (uint32_t)key);
}

#endif
