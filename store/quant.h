/*
 * quant — lossy, opt-in quantized storage of one KV tensor (rows = tokens,
 * channels = kv_heads x head_dim) for models registered with a store codec:
 *
 *   int8  symmetric, one f32 scale per channel for keys (KIVI, arXiv 2402.02750:
 *         key outliers sit in fixed channels) and per token for values;
 *   fp8   e4m3 (no infinities, max 448) on the same axes, f32 scales;
 *   int4  asymmetric, f16 scale and zero point per group of `group` elements:
 *         keys in groups of tokens along each channel, values in groups of
 *         channels along each token; two codes a byte, low nibble first. The
 *         scales of all groups come first, then their zero points; group g of
 *         keys is (row / group) x channels + channel, of values row x
 *         ceil(channels / group) + channel / group.
 *
 * Keys are quantized in the frame they are stored in (post-RoPE keys at their
 * stored positions), so re-rotation applies to the dequantized values exactly as
 * to stored raw keys. Dequantization computes in f32 without fused multiply-add
 * (int8/fp8: code x scale; int4: code x scale + zero) and rounds to the model's
 * dtype to nearest even: a NumPy float32 reference gives the same bits.
 *
 * Error bounds (x the input, x' its decoded value, s the element's scale):
 *   int8: |x - x'| <= s/2 (+ one f32 rounding), s = absmax / 127;
 *   fp8:  |x - x'| <= 2^-4 |x| for |x| >= 2^-6 s (e4m3 normals), else 2^-10 s;
 *   int4: |x - x'| <= s/2 (+ f32 rounding), s = (max - zero) / 15 rounded up to
 *         f16, zero = min rounded down to f16;
 * each before the final rounding to the model's dtype. Tensors with NaN or Inf,
 * or (int4) values an f16 scale cannot hold, are refused with -ERANGE: the
 * caller stores them losslessly.
 *
 * A payload is a 16-byte header (rows, channels, axis, output dtype, group),
 * then the scales, then the codes, row-major: the codes of rows [a, b) are one
 * contiguous range (quant_rows_span), so a decoder can hash and decode a block
 * of rows at a time. Thread-safe; no global state.
 */
#ifndef KVBLEND_STORE_QUANT_H
#define KVBLEND_STORE_QUANT_H

#include <stddef.h>
#include <stdint.h>

#define QUANT_HEADER_SIZE 16
/* Largest and default int4 group. */
#define QUANT_GROUP_MAX 1024
#define QUANT_GROUP_DEFAULT 32

enum quant_codec { QUANT_NONE = 0, QUANT_FP8 = 1, QUANT_INT8 = 2, QUANT_INT4 = 3 };

/* Which way a tensor's scales run: per channel (keys) or per token (values). */
enum quant_axis { QUANT_PER_CHANNEL = 0, QUANT_PER_TOKEN = 1 };

struct quant_info {
	enum quant_codec codec;
	uint32_t rows, channels;
	enum quant_axis axis;
	uint32_t dtype; /* of the decoded tensor: 1 f16, 2 bf16, 3 f32 */
	uint32_t group; /* int4 */
	size_t scales_off, data_off, row_bytes, size;
};

/* Name ("fp8", "int8", "int4") and parse; parse returns QUANT_NONE for "" or "none", -1 if unknown. */
const char *quant_name(enum quant_codec q);
int quant_parse(const char *s);

/*
 * Describe the payload of a rows x channels tensor: its size and layout. Returns
 * 0, or -EINVAL for a bad codec, dtype, group (int4: 1..QUANT_GROUP_MAX) or a
 * size that overflows.
 */
int quant_layout(enum quant_codec q, uint32_t rows, uint32_t channels, enum quant_axis axis,
		 uint32_t dtype, uint32_t group, struct quant_info *out);

/*
 * Quantize src (rows x channels of dtype) into dst (qi->size bytes, from
 * quant_layout). Returns 0, or -ERANGE when the tensor must be stored losslessly
 * (NaN, Inf, or int4 values beyond f16 scales); dst is then undefined. Uses
 * AVX2 and F16C when the CPU has them; every path writes the same bytes.
 */
int quant_encode(const struct quant_info *qi, const void *src, void *dst);

/*
 * Parse a payload's header (len bytes) and check it against its size; 0, or
 * -EBADMSG when it is not a well-formed payload.
 */
int quant_peek(const void *payload, size_t len, struct quant_info *out);

/* Byte offset and length of the codes of rows [a, b) in the payload. */
static inline void quant_rows_span(const struct quant_info *qi, uint32_t a, uint32_t b,
				   size_t *off, size_t *len)
{
	*off = qi->data_off + (size_t)a * qi->row_bytes;
	*len = (size_t)(b - a) * qi->row_bytes;
}

/*
 * A decoder of one payload, for decoding it a block of rows at a time: it keeps
 * the per-channel scales expanded to f32 across calls. Its fields are the
 * kernels' (quant_impl.h), not the caller's.
 */
struct quant_dec {
	const struct quant_info *qi;
	const uint8_t *payload;
	const float *fp8_lut;
	/*
	 * Per-channel scales and int4 zero points (int4 keys: of row group tg; int4
	 * values: the current row's, spelled out per channel).
	 */
	float *s_all, *z_all;
	float *s256;	   /* fp8 keys: s_all x 256, or NULL when that would not be exact */
	size_t tg;
	size_t ng, groups; /* int4: groups in a row of values; groups in the tensor */
	int avx2;
};

/* 0, or -ENOMEM. */
int quant_dec_init(struct quant_dec *d, const struct quant_info *qi, const void *payload);
/*
 * Decode rows [a, b) into dst (the decoded bytes of row a on), in qi->dtype. Uses
 * AVX2 and F16C when the CPU has them; every path gives the same bits.
 */
void quant_dec_rows(struct quant_dec *d, uint32_t a, uint32_t b, void *dst);
void quant_dec_free(struct quant_dec *d);

/* quant_dec_init + quant_dec_rows + quant_dec_free; -ENOMEM or 0. */
int quant_decode_rows(const struct quant_info *qi, const void *payload, uint32_t a, uint32_t b,
		      void *dst);

/* e4m3 code of f (saturating at +-448, nearest even) and its value. */
uint8_t quant_fp8_encode(float f);
float quant_fp8_value(uint8_t code);

#endif
