/*
 * bulk — the byte format of bulk connections (docs/protocol.md#bulk-connections), shared
 * by the daemon and libkvblend: the hello a client opens one with, the header of each
 * record of a GET's payload, and the AES-256-GCM seal over both when the connection's
 * ticket was handed out over CURVE. Nothing here does I/O.
 *
 * Nonces: 64-bit record counter of the connection (little-endian) then a 32-bit
 * direction (0 client to daemon: the hello, counter 0; 1 daemon to client: records,
 * counters 0, 1, 2, ... in the order sent). A key belongs to one connection and is never
 * reused, so no nonce repeats under a key. The associated data of a record is its
 * header: request id, offset, length, total and the last flag are bound to the bytes.
 */
#ifndef KVBLEND_PROTO_BULK_H
#define KVBLEND_PROTO_BULK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "wire.h"

#define KVBB_MAGIC_HELLO 0x4242564bu  /* "KVBB" */
#define KVBB_MAGIC_RECORD 0x5242564bu /* "KVBR" */
#define KVBB_VERSION 1
#define KVBB_HELLO_LEN 40 /* magic, version, ticket, tag (zero when not sealed) */
#define KVBB_HDR_LEN 40
#define KVBB_TAG_LEN 16
/* Largest record a client accepts; the daemon sends at most this (sealed: KVBB_SEAL_BYTES). */
#define KVBB_RECORD_MAX (4u << 20)
/* Sealed records are this big: encrypted into a buffer that stays in the L2 cache. */
#define KVBB_SEAL_BYTES (256u << 10)
#define KVBB_LAST 1u /* record flag: the payload's last record */
#define KVBB_DIR_HELLO 0u
#define KVBB_DIR_RECORDS 1u

struct kvbb_hdr {
	uint32_t flags;
	uint64_t request_id;
	uint64_t total;	 /* the payload's bytes, all records */
	uint64_t offset; /* of this record's bytes in the payload */
	uint32_t len;	 /* of this record's bytes (the tag follows them when sealed) */
};

void kvbb_hdr_put(uint8_t out[KVBB_HDR_LEN], const struct kvbb_hdr *h);
/* 0, or -EPROTO (not a record header: magic, reserved bytes, len above the max). */
int kvbb_hdr_get(const uint8_t in[KVBB_HDR_LEN], struct kvbb_hdr *h);

/* AES-256-GCM under one connection's key (OpenSSL's EVP). */
struct kvbb_aead;

/* 0 and *out, or -ENOMEM / -ENOTSUP (no AES-256-GCM in this libcrypto). */
int kvbb_aead_new(struct kvbb_aead **out, const uint8_t key[KVBP_BULK_KEY_LEN]);
/* Accepts NULL; sets *a to NULL; wipes the key. */
void kvbb_aead_free(struct kvbb_aead **a);
/*
 * Encrypt the concatenation of iov[0..n) into out (their total bytes), with ad
 * authenticated, under nonce (counter, dir); the tag into tag. 0, or -EIO.
 */
int kvbb_seal(struct kvbb_aead *a, uint64_t counter, uint32_t dir, const uint8_t *ad,
	      size_t ad_len, const struct iovec *iov, size_t n, uint8_t *out,
	      uint8_t tag[KVBB_TAG_LEN]);
/* Decrypt buf[0..len) in place and check tag: 0, or -EBADMSG (altered: buf is garbage). */
int kvbb_open(struct kvbb_aead *a, uint64_t counter, uint32_t dir, const uint8_t *ad,
	      size_t ad_len, uint8_t *buf, size_t len, const uint8_t tag[KVBB_TAG_LEN]);

/* The hello: magic, version, ticket, and with a the tag over those (counter 0, dir 0). */
int kvbb_hello_put(uint8_t out[KVBB_HELLO_LEN], const uint8_t ticket[KVBP_BULK_TICKET_LEN],
		   struct kvbb_aead *a);
/* Its ticket, or -EPROTO (magic or version wrong). */
int kvbb_hello_ticket(const uint8_t in[KVBB_HELLO_LEN], uint8_t ticket[KVBP_BULK_TICKET_LEN]);
/* Its tag checked under a: 0, or -EBADMSG. */
int kvbb_hello_check(const uint8_t in[KVBB_HELLO_LEN], struct kvbb_aead *a);

#endif
