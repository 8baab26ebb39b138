/*
 * aegis — AEGIS-128L and AEGIS-128X2 (draft-irtf-cfrg-aegis-aead, the CFRG's AES-based
 * AEADs), the fast seals of bulk connections' records. They run on AES instructions
 * (x86-64 AES-NI; AEGIS-128X2, two AEGIS-128L states side by side, on 256-bit VAES), at
 * several times AES-GCM's speed, and only where the CPU has them: kvb_aegis_available()
 * says so, and bulk.c offers a variant only then. 128-bit key, nonce and tag.
 * Nothing here allocates or does I/O.
 */
#ifndef KVBLEND_PROTO_AEGIS_H
#define KVBLEND_PROTO_AEGIS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#define KVB_AEGIS_KEY_LEN 16
#define KVB_AEGIS_NONCE_LEN 16
#define KVB_AEGIS_TAG_LEN 16

enum kvb_aegis_variant {
	KVB_AEGIS_128L,	 /* AES-NI */
	KVB_AEGIS_128X2, /* VAES and AVX2 */
};

/* Whether this build and this CPU run the variant (false: the calls below refuse it). */
bool kvb_aegis_available(enum kvb_aegis_variant v);

/*
 * Encrypt the concatenation of iov[0..n) (pieces of any length) into out (their total
 * bytes), authenticating ad too; the 16-byte tag into tag. 0, or -ENOTSUP where the
 * variant is not available. out may not overlap the pieces.
 */
int kvb_aegis_seal(enum kvb_aegis_variant v, const uint8_t key[KVB_AEGIS_KEY_LEN],
		   const uint8_t nonce[KVB_AEGIS_NONCE_LEN], const uint8_t *ad, size_t ad_len,
		   const struct iovec *iov, size_t n, uint8_t *out, uint8_t tag[KVB_AEGIS_TAG_LEN]);

/*
 * Decrypt buf[0..len) in place and check tag (in constant time). 0; -EBADMSG when the
 * tag does not match (buf is then zeroed: no unauthenticated plaintext is left); or
 * -ENOTSUP.
 */
int kvb_aegis_open(enum kvb_aegis_variant v, const uint8_t key[KVB_AEGIS_KEY_LEN],
		   const uint8_t nonce[KVB_AEGIS_NONCE_LEN], const uint8_t *ad, size_t ad_len,
		   uint8_t *buf, size_t len, const uint8_t tag[KVB_AEGIS_TAG_LEN]);

#endif
