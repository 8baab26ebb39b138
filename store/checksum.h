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

/* "avx2" or "sse2": which implementation runs here. */
const char *checksum_impl(void);

#endif
