/*
 * codec — encoding of one tensor for the store.
 *
 * Lossless: a tensor is either bitshuffled and LZ4-compressed (c-blosc) or kept
 * raw when compression would save less than a configured share: fp16 KV
 * compresses by only ~1.1x, and raw tensors read back at memory speed. Lossy,
 * for models registered with a store codec: quantized (quant.h: int8, fp8,
 * int4), decoded back to the model's dtype. Every encoded tensor starts with a
 * fixed header that records the codec and an XXH3-64 checksum, verified on
 * every decode: of the raw bytes for lossless tensors, of the stored payload
 * for quantized ones.
 */
#ifndef KVBLEND_STORE_CODEC_H
#define KVBLEND_STORE_CODEC_H

#include <stddef.h>
#include <stdint.h>

#define CODEC_HEADER_SIZE 32
#define CODEC_FORMAT_VERSION 1

enum codec_kind {
	CODEC_RAW = 0,
	CODEC_BSLZ4 = 1,
	CODEC_QUANT = 2, /* a quant.h payload; raw_size is the decoded size */
};

struct codec_header {
	uint8_t version;
	uint8_t kind;	   /* enum codec_kind */
	uint8_t elem_size; /* 2 or 4 */
	uint64_t raw_size;
	uint64_t stored_size; /* payload bytes after the header */
	uint64_t checksum;    /* XXH3-64 of the raw bytes (quantized: of the payload) */
};

/* How one tensor will be stored: decided (and compressed, if so) before it is written. */
struct codec_plan {
	uint8_t kind;
	uint8_t elem_size;
	uint64_t raw_size;
	size_t encoded_len;	/* header + payload */
	const void *compressed; /* CODEC_BSLZ4, CODEC_QUANT: the payload, in the caller's scratch */
	uint64_t checksum;	/* those two only; raw tensors are hashed while written */
};

/* Largest encoding of raw_size bytes, header included. 0 if that overflows. */
size_t codec_bound(size_t raw_size);

/*
 * Encode raw_size bytes of elem_size-byte elements (1, 2 or 4) from src into
 * dst (capacity dst_cap, at least codec_bound(raw_size)). The tensor is stored
 * compressed only if that saves at least min_saving (0..1) of raw_size.
 * Returns 0 and the encoded length in *out_len, or -EINVAL (bad elem_size),
 * -ENOBUFS (dst_cap too small). Thread-safe; uses no global state.
 */
int codec_encode(const void *src, size_t raw_size, unsigned elem_size, double min_saving,
		 void *dst, size_t dst_cap, size_t *out_len);

/*
 * Decide how to store raw_size bytes at src: compressed into scratch (capacity
 * scratch_cap >= codec_bound(raw_size)) if that saves at least min_saving,
 * else raw. Large tensors are judged on a sample first, so incompressible KV
 * costs little to reject. Returns 0, -EINVAL (bad elem_size) or -ENOBUFS.
 * Thread-safe.
 */
int codec_plan(const void *src, size_t raw_size, unsigned elem_size, double min_saving,
	       void *scratch, size_t scratch_cap, struct codec_plan *p);

/*
 * A quantized plan: quantize raw_size bytes at src (rows x channels of dtype,
 * scales along axis; quant.h) into scratch. When the tensor cannot be quantized
 * (NaN, Inf, out of the codec's range) or quantizing would not make it smaller,
 * falls back to codec_plan() (lossless). Returns 0, -EINVAL or -ENOBUFS.
 */
int codec_plan_quant(const void *src, size_t raw_size, uint32_t dtype, uint32_t channels,
		     int axis, int quant_codec, uint32_t group, double min_saving, void *scratch,
		     size_t scratch_cap, struct codec_plan *p);

/*
 * Write the planned encoding (p->encoded_len bytes) of src to dst: one pass over
 * the data (raw tensors are hashed as they are copied).
 */
void codec_write(const struct codec_plan *p, const void *src, void *dst);

/*
 * Parse and check the header at src (src_len bytes available). Returns 0 and
 * fills *h, or -EBADMSG if the bytes are not a well-formed encoded tensor.
 */
int codec_peek(const void *src, size_t src_len, struct codec_header *h);

/*
 * Decode the tensor at src into dst, which must hold exactly raw_size bytes
 * (dst_len == header raw_size). Verifies the checksum. Returns 0, -EBADMSG when
 * the bytes are corrupt or the checksum fails (dst then holds garbage, never to
 * be served), or -EINVAL when dst_len differs from the recorded raw size.
 * *consumed (may be NULL) receives the encoded length read.
 */
int codec_decode(const void *src, size_t src_len, void *dst, size_t dst_len, size_t *consumed);

/*
 * Flags of the decoding calls below. CODEC_TRUSTED: the caller has verified
 * these very bytes already (store.h, "verify once per residency"): decode
 * without computing the checksum. The header is still checked.
 */
#define CODEC_TRUSTED 1u

/* codec_decode() with flags. */
int codec_decode_flags(const void *src, size_t src_len, void *dst, size_t dst_len,
		       size_t *consumed, unsigned flags);


/*
 * Check one encoded tensor at src without keeping its decoded bytes: a
 * well-formed header for raw_size decoded bytes of dtype (1 f16, 2 bf16, 3 f32),
 * and its checksum (compressed tensors are decompressed into scratch, raw_size
 * bytes, to check it); a quantized tensor must also be laid out as every decoding
 * call below reads it, one row of `channels` elements a token (a transform takes a
 * token row at a time). Returns 0 with the encoded length in *consumed, -EBADMSG,
 * or -ENOTSUP for a sound quantized tensor of the right size in other rows
 * (codec_quant_shape() says which).
 */
int codec_verify(const void *src, size_t src_len, size_t raw_size, uint32_t dtype,
		 uint32_t channels, void *scratch, size_t *consumed);

/*
 * The rows and channels a quantized tensor at src says it has: 0, or -EBADMSG when
 * it is not a well-formed quantized tensor. *rows and *channels are untouched then.
 */
int codec_quant_shape(const void *src, size_t src_len, uint32_t *rows, uint32_t *channels);

/*
 * Check one encoded tensor at src against its own header alone (the scrub: no
 * model at hand): its checksum, decompressing into *scratch (grown with
 * realloc to the raw size; *scratch_cap its size; free it when done) when it is
 * compressed. Returns 0 with the encoded length in *consumed, -EBADMSG, or
 * -ENOMEM.
 */
int codec_check(const void *src, size_t src_len, void **scratch, size_t *scratch_cap,
		size_t *consumed);

/*
 * A transform applied while decoding: fn(ctx, src, dst, off, len) writes the
 * transformed bytes [off, off + len) of the tensor from src (raw bytes) to dst
 * (the destination at off); src and dst may be equal. len is a multiple of
 * unit except at the end.
 */
struct codec_xform {
	void (*fn)(void *ctx, const void *src, void *dst, size_t off, size_t len);
	void *ctx;
	size_t unit;
};

/*
 * codec_decode() with a transform: raw tensors are hashed and transformed in
 * one pass (the checksum is of the stored bytes, so a mismatch still means
 * corruption); compressed ones are decompressed, verified, then transformed in
 * place. Same errors as codec_decode(), plus -ENOTSUP for a quantized tensor whose
 * checksum holds but whose rows are not x->unit bytes decoded (not one a token:
 * codec_verify() refuses such a tensor, so only one stored before it did meets
 * this); never -EBADMSG for that. On -EBADMSG dst holds garbage.
 */
int codec_decode_xform(const void *src, size_t src_len, void *dst, size_t dst_len,
		       size_t *consumed, const struct codec_xform *x, unsigned flags);

/*
 * Decode one tensor of raw_size bytes and hand it to x->fn(ctx, src, NULL, off,
 * len) a block at a time (dst NULL: the transform writes wherever it keeps the
 * rows, e.g. scattered into a paged cache). Raw tensors are hashed and handed
 * over in one pass, each block while it is in cache (blocks of at most
 * checksum_apply_block(x->unit) bytes); compressed and quantized ones are decoded
 * whole into a temporary buffer, verified, then handed over in blocks of that
 * size. Errors as codec_decode(), plus -ENOMEM; on -EBADMSG the transform may
 * already have written garbage, never to be served. flags: CODEC_TRUSTED or 0
 * (so for codec_decode_xform()).
 */
int codec_apply(const void *src, size_t src_len, size_t raw_size, size_t *consumed,
		const struct codec_xform *x, unsigned flags);

#endif
