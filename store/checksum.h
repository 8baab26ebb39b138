/*
 * checksum — XXH3-64 of tensor bytes, with the widest SIMD the CPU has (AVX2 or
 * the SSE2 baseline, chosen once at run time; both give the same value), and a
 * fused form that hashes while it copies so the data crosses memory once.
 */
#ifndef KVBLEND_STORE_CHECKSUM_H
#define KVBLEND_STORE_CHECKSUM_H

#include <stddef.h>
#include <stdint.h>

uint64_t checksum(const void *buf, size_t len);

/* Copy n bytes from src to dst (not overlapping) and return the checksum of src. */
uint64_t checksum_copy(void *dst, const void *src, size_t n);

/*
 * Hash n bytes of src while handing them, a block at a time, to fn(ctx, src,
 * off, len) (which typically writes a transformed copy); returns the checksum
 * of src. Blocks are multiples of `unit` bytes (the last may be shorter), at
 * least one unit each.
 */
uint64_t checksum_apply(const void *src, size_t n, size_t unit,
			void (*fn)(void *ctx, const void *src, size_t off, size_t len), void *ctx);

/*
 * checksum_apply() with plen bytes at prefix hashed first: the checksum of prefix
 * followed by src (equal to checksum() of both when they are contiguous).
 */
uint64_t checksum_apply_prefixed(const void *prefix, size_t plen, const void *src, size_t n,
				 size_t unit,
				 void (*fn)(void *ctx, const void *src, size_t off, size_t len),
				 void *ctx);

/*
 * The largest block checksum_apply() hands fn at once for this unit: the unit
 * itself when it is at least the cache block (16 KiB), else as many units as fit
 * in one. A transform that stages a block in scratch memory needs this much.
 */
size_t checksum_apply_block(size_t unit);

/* "avx2" or "sse2": which implementation runs here. */
const char *checksum_impl(void);

#endif
