/*
 * bulk — the byte format of bulk connections (docs/protocol.md#bulk-connections), shared
 * by the daemon and libkvblend: the hello a client opens one with, the header of each
 * record of a GET's payload, and the seal over both when the connection's ticket was
 * handed out over CURVE: AEGIS-128X2 or AEGIS-128L (aegis.h) where both ends have the AES
 * instructions for it and the daemon allows it, else AES-256-GCM. Nothing here does I/O.
 *
 * Records go both ways: a GET's payload from the daemon, a PUT's payload from the
 * client (same header; the client never sends an abort record).
 *
 * Nonces: 64-bit record counter of the connection (little-endian) then a 32-bit
 * direction (0 client to daemon: the hello, counter 0, then PUT records, counters 1,
 * 2, ... in the order sent; 1 daemon to client: records, counters 0, 1, 2, ... in the
 * order sent); AEGIS's 16-byte nonce ends in four zero bytes. A key belongs to one connection and is never reused, so no nonce repeats under
 * a key. The associated data of a record is its header: request id, offset, length,
 * total and the last flag are bound to the bytes.
 */
#ifndef KVBLEND_PROTO_BULK_H
#define KVBLEND_PROTO_BULK_H

#include <stdbool.h>
#include <stddef.h>
#include <errno.h>
#include <stdint.h>
#include <sys/uio.h>

#include "proto/wire.h"

#define KVBB_MAGIC_HELLO 0x4242564bu  /* "KVBB" */
#define KVBB_MAGIC_RECORD 0x5242564bu /* "KVBR" */
#define KVBB_VERSION 1
#define KVBB_HELLO_LEN 40 /* magic, version, ticket, tag (zero when not sealed) */
#define KVBB_HDR_LEN 40
#define KVBB_TAG_LEN 16
/* Largest record a client accepts; the daemon sends at most this (sealed: KVBB_SEAL_BYTES). */
#define KVBB_RECORD_MAX (4u << 20)
/* Sealed records are this big: encrypted into a buffer that stays in the L2 cache, and
 * opened while still there (512 KiB: half of a recent core's L2; 256 KiB records ran no
 * faster on bench_cluster, 1 MiB ones no faster either). */
#define KVBB_SEAL_BYTES (512u << 10)
#define KVBB_LAST 1u /* record flag: the payload's last record */
/* Record flag, with KVBB_LAST and no bytes: the payload is void from this offset on (the
 * daemon's copy of the chunk failed its checksum as it was sent; it removed it). */
#define KVBB_ABORT 2u
#define KVBB_DIR_HELLO 0u
#define KVBB_DIR_RECORDS 1u
#define KVBB_DIR_PUT 0u /* a PUT's records, client to daemon: counters from 1 */

struct kvbb_hdr {
	uint32_t flags;
	uint64_t request_id;
	uint64_t total;	 /* the payload's bytes, all records */
	uint64_t offset; /* of this record's bytes in the payload */
	uint32_t len;	 /* of this record's bytes (the tag follows them when sealed) */
};

void kvbb_hdr_put(uint8_t out[KVBB_HDR_LEN], const struct kvbb_hdr *h);
/* 0, or -EPROTO (not a record header: magic, reserved bytes, flags, len above the max,
 * an abort record with bytes). */
int kvbb_hdr_get(const uint8_t in[KVBB_HDR_LEN], struct kvbb_hdr *h);

/* One connection's seal: AES-256-GCM (OpenSSL's EVP) or AEGIS (aegis.h). */
struct kvbb_aead;

/* The ciphers this process can seal and open besides AES-256-GCM, a bit each
 * (1 << KVBP_AEAD_*): what its CPU has the instructions for. */
uint32_t kvbb_aeads(void);
/* The fastest cipher of those in the mask (AES-256-GCM, always there, when none). */
uint32_t kvbb_aead_pick(uint32_t mask);
/*
 * The seal of cipher (KVBP_AEAD_*) under key (AEGIS takes its first 16 bytes): 0 and
 * *out, or -ENOMEM, or -ENOTSUP (no AES-256-GCM in this libcrypto; an AEGIS variant not
 * in kvbb_aeads(); an unknown cipher).
 */
int kvbb_aead_new(struct kvbb_aead **out, const uint8_t key[KVBP_BULK_KEY_LEN], uint32_t cipher);
/* A cipher's name, for messages: "AES-256-GCM", "AEGIS-128L", "AEGIS-128X2". */
const char *kvbb_cipher_name(uint32_t cipher);
const char *kvbb_aead_name(const struct kvbb_aead *a);
/* Accepts NULL; sets *a to NULL; wipes the key. */
void kvbb_aead_free(struct kvbb_aead **a);
/*
 * Encrypt the concatenation of iov[0..n) into out (their total bytes), with ad
 * authenticated, under nonce (counter, dir); the tag into tag. 0, or -EIO.
 */
int kvbb_seal(struct kvbb_aead *a, uint64_t counter, uint32_t dir, const uint8_t *ad,
	      size_t ad_len, const struct iovec *iov, size_t n, uint8_t *out,
	      uint8_t tag[KVBB_TAG_LEN]);
/* Decrypt buf[0..len) in place and check tag: 0, or -EBADMSG (altered: buf is zeroed). */
int kvbb_open(struct kvbb_aead *a, uint64_t counter, uint32_t dir, const uint8_t *ad,
	      size_t ad_len, uint8_t *buf, size_t len, const uint8_t tag[KVBB_TAG_LEN]);

/* Advance iov[0..*n) past done bytes (they went out, or came in): the pieces used up
 * are dropped (*iov, *n move on), the next one is shortened. */
void kvbb_iov_advance(struct iovec **iov, int *n, size_t done);

/*
 * The most bytes a chunk's stored layers may take as a payload between members (FETCH
 * and REPLICATE on a bulk connection), for raw_total bytes of K and V over num_layers
 * layers: twice the raw bytes and 4 KiB a layer (a codec's worst case and its headers
 * fit well within), at most 16 GiB. 0 and *out, or -EOVERFLOW.
 */
static inline int kvbb_stored_max(uint64_t raw_total, uint32_t num_layers, uint64_t *out)
{
	uint64_t twice, slack, sum;

	if (__builtin_mul_overflow(raw_total, 2, &twice) ||
	    __builtin_mul_overflow((uint64_t)num_layers, 4096, &slack) ||
	    __builtin_add_overflow(twice, slack, &sum))
		return -EOVERFLOW;
	*out = sum < (16ull << 30) ? sum : (16ull << 30);
	return 0;
}

/* The host of a tcp://HOST:PORT endpoint (an IPv6 address without its brackets), where
 * its bulk connection is opened, into host (len bytes): 0, or -EINVAL (not one). */
int kvbb_endpoint_host(const char *endpoint, char *host, size_t len);

/* The hello: magic, version, ticket, and with a the tag over those (counter 0, dir 0). */
int kvbb_hello_put(uint8_t out[KVBB_HELLO_LEN], const uint8_t ticket[KVBP_BULK_TICKET_LEN],
		   struct kvbb_aead *a);
/* Its ticket, or -EPROTO (magic or version wrong). */
int kvbb_hello_ticket(const uint8_t in[KVBB_HELLO_LEN], uint8_t ticket[KVBP_BULK_TICKET_LEN]);
/* Its tag checked under a: 0, or -EBADMSG. */
int kvbb_hello_check(const uint8_t in[KVBB_HELLO_LEN], struct kvbb_aead *a);

#endif
