/* checksum — XXH3-64 with run-time SIMD choice; see checksum.h. */
#include "store/checksum.h"

#define CHECKSUM_SUFFIX sse2
#include "store/checksum_impl.h"

uint64_t checksum_avx2(const void *buf, size_t len);
uint64_t checksum_copy_avx2(void *dst, const void *src, size_t n);

static int have_avx2(void)
{
	/* Reads the CPU model libgcc filled in at start-up: cheap, and no state of ours. */
	return __builtin_cpu_supports("avx2");
}

uint64_t checksum(const void *buf, size_t len)
{
	return have_avx2() ? checksum_avx2(buf, len) : checksum_sse2(buf, len);
}

uint64_t checksum_copy(void *dst, const void *src, size_t n)
{
	return have_avx2() ? checksum_copy_avx2(dst, src, n) : checksum_copy_sse2(dst, src, n);
}

uint64_t checksum_apply_avx2(const void *prefix, size_t plen, const void *src, size_t n,
			     size_t unit, void (*fn)(void *, const void *, size_t, size_t),
			     void *ctx);

uint64_t checksum_apply_prefixed(const void *prefix, size_t plen, const void *src, size_t n,
				 size_t unit,
				 void (*fn)(void *ctx, const void *src, size_t off, size_t len),
				 void *ctx)
{
	return have_avx2() ? checksum_apply_avx2(prefix, plen, src, n, unit, fn, ctx)
			   : checksum_apply_sse2(prefix, plen, src, n, unit, fn, ctx);
}

uint64_t checksum_apply(const void *src, size_t n, size_t unit,
			void (*fn)(void *ctx, const void *src, size_t off, size_t len), void *ctx)
{
	return checksum_apply_prefixed(NULL, 0, src, n, unit, fn, ctx);
}

size_t checksum_apply_block(size_t unit)
{
	if (!unit)
		return FUSE_BLOCK;
	return unit >= FUSE_BLOCK ? unit : FUSE_BLOCK / unit * unit;
}

const char *checksum_impl(void)
{
	return have_avx2() ? "avx2" : "sse2";
}
