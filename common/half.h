/*
 * half — bit-exact scalar conversions between f32 and the 16-bit float formats
 * (IEEE binary16 "f16" and bfloat16 "bf16"), rounding to nearest even, NaN kept
 * quiet. The SIMD kernels use the same rounding, so every backend agrees; the
 * CUDA kernels call these very functions. Shared by store/ (the quantized codecs)
 * and blend/ (the fuse kernels), which never include each other's headers: this
 * folder, common/, holds what both need. Header-only; no state. Not installed.
 *
 * KVB_HD marks a function for the host and, under nvcc, the device too; blend's
 * elem.h uses it as well.
 */
#ifndef KVBLEND_COMMON_HALF_H
#define KVBLEND_COMMON_HALF_H

#include <stdint.h>
#include <string.h>

/* Compiled for the host and, by nvcc, for the device too (blend/cuda/). */
#ifndef KVB_HD
#ifdef __CUDACC__
#define KVB_HD __host__ __device__ static inline
#else
#define KVB_HD static inline
#endif
#endif

KVB_HD float f32_from_bits(uint32_t u)
{
	float f;

	memcpy(&f, &u, 4);
	return f;
}

KVB_HD uint32_t f32_bits(float f)
{
	uint32_t u;

	memcpy(&u, &f, 4);
	return u;
}

KVB_HD float f16_to_f32(uint16_t h)
{
	uint32_t sign = (uint32_t)(h & 0x8000) << 16, exp = (h >> 10) & 0x1f, man = h & 0x3ff;

	if (exp == 0x1f) /* Inf, NaN */
		return f32_from_bits(sign | 0x7f800000 | man << 13);
	if (exp == 0) {
		if (!man)
			return f32_from_bits(sign);
		/* subnormal: value man x 2^-24 */
		return sign ? -(float)man * 0x1p-24f : (float)man * 0x1p-24f;
	}
	return f32_from_bits(sign | (exp + 112) << 23 | man << 13);
}

KVB_HD uint16_t f32_to_f16(float f)
{
	uint32_t x = f32_bits(f), sign = (x >> 16) & 0x8000, ax = x & 0x7fffffff;

	if (ax >= 0x7f800000) /* Inf or NaN (quieted) */
		return (uint16_t)(sign | 0x7c00 | (ax > 0x7f800000 ? 0x200 | ((ax >> 13) & 0x3ff) : 0));
	if (ax >= 0x477ff000) /* rounds to >= 65520: overflow to Inf */
		return (uint16_t)(sign | 0x7c00);
	if (ax < 0x38800000) { /* below 2^-14: subnormal or zero */
		/* Add 0.5 (as a float) so the FPU rounds to nearest even at 2^-24 granularity. */
		float r = f32_from_bits(ax) + 0.5f;

		return (uint16_t)(sign | (f32_bits(r) - 0x3f000000));
	}
	{
		uint32_t mant_odd = (ax >> 13) & 1;

		ax += 0xc8000fff + mant_odd; /* rebias exponent (-112 << 23) and round */
		return (uint16_t)(sign | (ax >> 13));
	}
}

KVB_HD float bf16_to_f32(uint16_t h)
{
	return f32_from_bits((uint32_t)h << 16);
}

KVB_HD uint16_t f32_to_bf16(float f)
{
	uint32_t x = f32_bits(f);

	if ((x & 0x7fffffff) > 0x7f800000) /* NaN: keep sign and top payload, force quiet */
		return (uint16_t)((x >> 16) | 0x40);
	x += 0x7fff + ((x >> 16) & 1);
	return (uint16_t)(x >> 16);
}

#endif
