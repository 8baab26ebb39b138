/*
 * aegis — AEGIS-128L and AEGIS-128X2; see aegis.h. Written from the algorithms'
 * specification (draft-irtf-cfrg-aegis-aead, sections "AEGIS-128L" and "AEGIS-128X"):
 * eight state words, each update one AES round per word; 32 bytes of message per update
 * and lane. The body is aegis_impl.h, included once per vector width; the state lives
 * in local variables (eight vector registers) through each whole call.
 */
#include "proto/aegis.h"

#include <errno.h>
#include <string.h>

#if defined(__x86_64__)
#include <immintrin.h>

/* The specification's constants C0 and C1 (C0 is the Fibonacci sequence mod 256). */
static const uint8_t c0_bytes[16] = { 0x00, 0x01, 0x01, 0x02, 0x03, 0x05, 0x08, 0x0d,
				      0x15, 0x22, 0x37, 0x59, 0x90, 0xe9, 0x79, 0x62 };
static const uint8_t c1_bytes[16] = { 0xdb, 0x3d, 0x18, 0x55, 0x6d, 0xc2, 0x2f, 0xf1,
				      0x20, 0x11, 0x31, 0x42, 0x73, 0xb5, 0x28, 0xdd };

/* AEGIS-128L: one 128-bit lane (its context is zero). */
#define VEC __m128i
#define BLOCK 32
#define TARGET __attribute__((target("aes,sse2")))
#define NAME(x) x##_128l
#define V_LOAD(p) _mm_loadu_si128((const __m128i *)(const void *)(p))
#define V_STORE(p, v) _mm_storeu_si128((__m128i *)(void *)(p), (v))
#define V_XOR _mm_xor_si128
#define V_AND _mm_and_si128
#define V_AESENC _mm_aesenc_si128
#define V_BCAST(p) V_LOAD(p)
#define V_CTX _mm_setzero_si128()
#define V_FOLD(v) (v)
#include "proto/aegis_impl.h"
#undef VEC
#undef BLOCK
#undef TARGET
#undef NAME
#undef V_LOAD
#undef V_STORE
#undef V_XOR
#undef V_AND
#undef V_AESENC
#undef V_BCAST
#undef V_CTX
#undef V_FOLD

/* AEGIS-128X2: two lanes of 256-bit registers; lane i's context is Byte(i) || Byte(1). */
#define VEC __m256i
#define BLOCK 64
#define TARGET __attribute__((target("aes,vaes,avx2")))
#define NAME(x) x##_128x2
#define V_LOAD(p) _mm256_loadu_si256((const __m256i *)(const void *)(p))
#define V_STORE(p, v) _mm256_storeu_si256((__m256i *)(void *)(p), (v))
#define V_XOR _mm256_xor_si256
#define V_AND _mm256_and_si256
#define V_AESENC _mm256_aesenc_epi128
#define V_BCAST(p) _mm256_broadcastsi128_si256(_mm_loadu_si128((const __m128i *)(const void *)(p)))
#define V_CTX _mm256_set_epi64x(0, 0x0101, 0, 0x0100)
#define V_FOLD(v) _mm_xor_si128(_mm256_castsi256_si128(v), _mm256_extracti128_si256((v), 1))
#include "proto/aegis_impl.h"

bool kvb_aegis_available(enum kvb_aegis_variant v)
{
	if (v == KVB_AEGIS_128L)
		return __builtin_cpu_supports("aes") && __builtin_cpu_supports("sse2");
	if (v == KVB_AEGIS_128X2)
		return __builtin_cpu_supports("aes") && __builtin_cpu_supports("vaes") &&
		       __builtin_cpu_supports("avx2");
	return false;
}

int kvb_aegis_seal(enum kvb_aegis_variant v, const uint8_t key[KVB_AEGIS_KEY_LEN],
		   const uint8_t nonce[KVB_AEGIS_NONCE_LEN], const uint8_t *ad, size_t ad_len,
		   const struct iovec *iov, size_t n, uint8_t *out, uint8_t tag[KVB_AEGIS_TAG_LEN])
{
	if (!kvb_aegis_available(v))
		return -ENOTSUP;
	if (v == KVB_AEGIS_128X2)
		seal_128x2(key, nonce, ad, ad_len, iov, n, out, tag);
	else
		seal_128l(key, nonce, ad, ad_len, iov, n, out, tag);
	return 0;
}

int kvb_aegis_open(enum kvb_aegis_variant v, const uint8_t key[KVB_AEGIS_KEY_LEN],
		   const uint8_t nonce[KVB_AEGIS_NONCE_LEN], const uint8_t *ad, size_t ad_len,
		   uint8_t *buf, size_t len, const uint8_t tag[KVB_AEGIS_TAG_LEN])
{
	if (!kvb_aegis_available(v))
		return -ENOTSUP;
	if (v == KVB_AEGIS_128X2)
		return open_128x2(key, nonce, ad, ad_len, buf, len, tag);
	return open_128l(key, nonce, ad, ad_len, buf, len, tag);
}

#else /* no AES instructions this file knows: AES-256-GCM only (bulk.c) */

bool kvb_aegis_available(enum kvb_aegis_variant v)
{
	(void)v;
	return false;
}

int kvb_aegis_seal(enum kvb_aegis_variant v, const uint8_t key[KVB_AEGIS_KEY_LEN],
		   const uint8_t nonce[KVB_AEGIS_NONCE_LEN], const uint8_t *ad, size_t ad_len,
		   const struct iovec *iov, size_t n, uint8_t *out, uint8_t tag[KVB_AEGIS_TAG_LEN])
{
	(void)v, (void)key, (void)nonce, (void)ad, (void)ad_len, (void)iov, (void)n, (void)out;
	(void)tag;
	return -ENOTSUP;
}

int kvb_aegis_open(enum kvb_aegis_variant v, const uint8_t key[KVB_AEGIS_KEY_LEN],
		   const uint8_t nonce[KVB_AEGIS_NONCE_LEN], const uint8_t *ad, size_t ad_len,
		   uint8_t *buf, size_t len, const uint8_t tag[KVB_AEGIS_TAG_LEN])
{
	(void)v, (void)key, (void)nonce, (void)ad, (void)ad_len, (void)buf, (void)len, (void)tag;
	return -ENOTSUP;
}

#endif
