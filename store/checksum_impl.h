/*
 * checksum_impl.h — the body of checksum.c's functions, compiled once per
 * instruction set (included by checksum.c and checksum_avx2.c with different
 * target flags and name suffixes). Not a public header.
 */
#define XXH_INLINE_ALL
#include <string.h>
#include <xxhash.h>

/* Hash a block while it is still in L1, then copy it: one trip to memory, not two. */
#define FUSE_BLOCK (16u << 10)

size_t checksum_apply_block(size_t unit);

#define CAT_(a, b) a##b
#define CAT(a, b) CAT_(a, b)

uint64_t CAT(checksum_, CHECKSUM_SUFFIX)(const void *buf, size_t len);
uint64_t CAT(checksum_copy_, CHECKSUM_SUFFIX)(void *dst, const void *src, size_t n);
uint64_t CAT(checksum_apply_, CHECKSUM_SUFFIX)(const void *prefix, size_t plen, const void *src,
					       size_t n, size_t unit,
					       void (*fn)(void *, const void *, size_t, size_t),
					       void *ctx);

uint64_t CAT(checksum_, CHECKSUM_SUFFIX)(const void *buf, size_t len)
{
	return XXH3_64bits(buf, len);
}

uint64_t CAT(checksum_copy_, CHECKSUM_SUFFIX)(void *dst, const void *src, size_t n)
{
	XXH3_state_t st;
	const unsigned char *s = src;
	unsigned char *d = dst;

	if (n <= FUSE_BLOCK) {
		memcpy(dst, src, n);
		return XXH3_64bits(src, n);
	}
	XXH3_64bits_reset(&st);
	for (size_t off = 0; off < n; off += FUSE_BLOCK) {
		size_t k = n - off < FUSE_BLOCK ? n - off : FUSE_BLOCK;

		XXH3_64bits_update(&st, s + off, k);
		memcpy(d + off, s + off, k);
	}
	return XXH3_64bits_digest(&st);
}

uint64_t CAT(checksum_apply_, CHECKSUM_SUFFIX)(const void *prefix, size_t plen, const void *src,
					       size_t n, size_t unit,
					       void (*fn)(void *, const void *, size_t, size_t),
					       void *ctx)
{
	size_t block = checksum_apply_block(unit);
	const unsigned char *s = src;
	XXH3_state_t st;

	XXH3_64bits_reset(&st);
	if (plen)
		XXH3_64bits_update(&st, prefix, plen);
	for (size_t off = 0; off < n; off += block) {
		size_t k = n - off < block ? n - off : block;

		XXH3_64bits_update(&st, s + off, k);
		fn(ctx, s + off, off, k);
	}
	return XXH3_64bits_digest(&st);
}
