/* codec — bitshuffle+LZ4 or raw tensor encoding with checksums; see codec.h. */
#include "store/codec.h"

#include <blosc.h>
#include <errno.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/ckd.h"
#include "store/checksum.h"
#include "store/quant.h"

#define CODEC_MAGIC 0x5442564bu /* "KVBT" little-endian */
/* Tensors this large are judged on a sample before a full attempt. */
#define SAMPLE_THRESHOLD (256u << 10)
#define SAMPLE_SIZE (64u << 10)
/* LZ4 at a low level: the point is speed; higher levels buy little on KV. */
#define CLEVEL 1

static void put_u32(uint8_t *p, uint32_t v)
{
	for (int i = 0; i < 4; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static void put_u64(uint8_t *p, uint64_t v)
{
	for (int i = 0; i < 8; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static uint32_t get_u32(const uint8_t *p)
{
	uint32_t v = 0;

	for (int i = 3; i >= 0; i--)
		v = v << 8 | p[i];
	return v;
}

static uint64_t get_u64(const uint8_t *p)
{
	uint64_t v = 0;

	for (int i = 7; i >= 0; i--)
		v = v << 8 | p[i];
	return v;
}

size_t codec_bound(size_t raw_size)
{
	size_t n;

	if (ckd_add(&n, raw_size, (size_t)CODEC_HEADER_SIZE + BLOSC_MAX_OVERHEAD))
		return 0;
	return n;
}

static void write_header(uint8_t *dst, const struct codec_header *h)
{
	memset(dst, 0, CODEC_HEADER_SIZE);
	put_u32(dst, CODEC_MAGIC);
	dst[4] = h->version;
	dst[5] = h->kind;
	dst[6] = h->elem_size;
	put_u64(dst + 8, h->raw_size);
	put_u64(dst + 16, h->stored_size);
	put_u64(dst + 24, h->checksum);
}

/* Would compressing save at least min_saving? Decided on a slice of the middle. */
static int sample_worth_it(const uint8_t *src, size_t raw_size, unsigned elem_size,
			   double min_saving, uint8_t *scratch, size_t scratch_cap)
{
	size_t n = SAMPLE_SIZE, off = ((raw_size - n) / 2) & ~(size_t)(elem_size - 1);
	int c;

	if (scratch_cap < n + BLOSC_MAX_OVERHEAD)
		return 1;
	c = blosc_compress_ctx(CLEVEL, BLOSC_BITSHUFFLE, elem_size, n, src + off, scratch,
			       n + BLOSC_MAX_OVERHEAD, "lz4", 0, 1);
	/* Demand half the margin on the sample: samples vary, full attempts are cheap. */
	return c > 0 && (double)c <= (double)n * (1.0 - min_saving / 2);
}

int codec_plan(const void *src, size_t raw_size, unsigned elem_size, double min_saving,
	       void *scratch, size_t scratch_cap, struct codec_plan *p)
{
	struct codec_plan t = { .kind = CODEC_RAW, .elem_size = (uint8_t)elem_size,
				.raw_size = raw_size, .encoded_len = CODEC_HEADER_SIZE + raw_size };
	int try_compress;

	if (elem_size != 1 && elem_size != 2 && elem_size != 4)
		return -EINVAL;
	try_compress = min_saving < 1.0 && raw_size >= 64 && raw_size <= BLOSC_MAX_BUFFERSIZE &&
		       raw_size % elem_size == 0;
	if (try_compress && scratch_cap < raw_size + BLOSC_MAX_OVERHEAD)
		return -ENOBUFS;
	if (try_compress && raw_size >= SAMPLE_THRESHOLD)
		try_compress = sample_worth_it(src, raw_size, elem_size, min_saving, scratch,
					       scratch_cap);
	if (try_compress) {
		int c = blosc_compress_ctx(CLEVEL, BLOSC_BITSHUFFLE, elem_size, raw_size, src,
					   scratch, raw_size + BLOSC_MAX_OVERHEAD, "lz4", 0, 1);

		if (c > 0 && (double)c <= (double)raw_size * (1.0 - min_saving)) {
			t.kind = CODEC_BSLZ4;
			t.compressed = scratch;
			t.encoded_len = CODEC_HEADER_SIZE + (size_t)c;
			t.checksum = checksum(src, raw_size);
		}
	}
	*p = t;
	return 0;
}

int codec_plan_quant(const void *src, size_t raw_size, uint32_t dtype, uint32_t channels,
		     int axis, int quant_codec, uint32_t group, double min_saving, void *scratch,
		     size_t scratch_cap, struct codec_plan *p)
{
	size_t esz = dtype == 3 ? 4 : 2, row = (size_t)channels * esz;
	struct quant_info qi;

	if (!channels || raw_size % row || raw_size / row > UINT32_MAX)
		return -EINVAL;
	if (quant_layout((enum quant_codec)quant_codec, (uint32_t)(raw_size / row), channels,
			 (enum quant_axis)axis, dtype, group, &qi))
		return -EINVAL;
	if (qi.size < raw_size && qi.size <= scratch_cap && quant_encode(&qi, src, scratch) == 0) {
		*p = (struct codec_plan){ .kind = CODEC_QUANT, .elem_size = (uint8_t)esz,
					  .raw_size = raw_size,
					  .encoded_len = CODEC_HEADER_SIZE + qi.size,
					  .compressed = scratch,
					  .checksum = checksum(scratch, qi.size) };
		return 0;
	}
	/* Not finite, out of range, or no smaller: stored losslessly. */
	return codec_plan(src, raw_size, (unsigned)esz, min_saving, scratch, scratch_cap, p);
}

void codec_write(const struct codec_plan *p, const void *src, void *dst)
{
	struct codec_header h = { .version = CODEC_FORMAT_VERSION, .kind = p->kind,
				  .elem_size = p->elem_size, .raw_size = p->raw_size,
				  .stored_size = p->encoded_len - CODEC_HEADER_SIZE,
				  .checksum = p->checksum };
	uint8_t *out = dst;

	if (p->kind == CODEC_RAW)
		h.checksum = checksum_copy(out + CODEC_HEADER_SIZE, src, p->raw_size);
	else if (p->compressed != out + CODEC_HEADER_SIZE)
		memmove(out + CODEC_HEADER_SIZE, p->compressed, h.stored_size);
	write_header(out, &h);
}

int codec_encode(const void *src, size_t raw_size, unsigned elem_size, double min_saving,
		 void *dst, size_t dst_cap, size_t *out_len)
{
	struct codec_plan p;
	size_t bound = codec_bound(raw_size);
	int rc;

	if (!bound || dst_cap < bound)
		return -ENOBUFS;
	/* Compress straight into place after the header. */
	rc = codec_plan(src, raw_size, elem_size, min_saving, (uint8_t *)dst + CODEC_HEADER_SIZE,
			dst_cap - CODEC_HEADER_SIZE, &p);
	if (rc)
		return rc;
	codec_write(&p, src, dst);
	*out_len = p.encoded_len;
	return 0;
}

int codec_peek(const void *src, size_t src_len, struct codec_header *h)
{
	const uint8_t *p = src;
	struct codec_header t;

	if (src_len < CODEC_HEADER_SIZE || get_u32(p) != CODEC_MAGIC)
		return -EBADMSG;
	t.version = p[4];
	t.kind = p[5];
	t.elem_size = p[6];
	t.raw_size = get_u64(p + 8);
	t.stored_size = get_u64(p + 16);
	t.checksum = get_u64(p + 24);
	if (t.version != CODEC_FORMAT_VERSION || t.kind > CODEC_QUANT ||
	    t.stored_size > src_len - CODEC_HEADER_SIZE)
		return -EBADMSG;
	if (t.kind == CODEC_RAW && t.stored_size != t.raw_size)
		return -EBADMSG;
	*h = t;
	return 0;
}

struct quant_apply {
	const struct quant_info *qi;
	struct quant_dec dec;
	uint8_t *dst;
	size_t out_row;
	const struct codec_xform *x; /* or NULL */
};

/* A block of codes, just hashed: decode its rows into place, then transform them. */
static void quant_block(void *ctx, const void *src, size_t off, size_t len)
{
	struct quant_apply *a = ctx;
	uint32_t r0 = (uint32_t)(off / a->qi->row_bytes), r1 = (uint32_t)((off + len) / a->qi->row_bytes);
	uint8_t *d = a->dst + (size_t)r0 * a->out_row;

	(void)src;
	quant_dec_rows(&a->dec, r0, r1, d);
	if (a->x)
		a->x->fn(a->x->ctx, d, d, (size_t)r0 * a->out_row, (size_t)(r1 - r0) * a->out_row);
}

/*
 * Decode a quantized payload into dst in one pass: hash its header and scales,
 * then a block of rows' codes at a time, decoding (and transforming) each block
 * while it is in cache. dst holds garbage unless the checksum matched.
 */
static int quant_decode_checked(const uint8_t *payload, const struct codec_header *h, void *dst,
				size_t dst_len, const struct codec_xform *x, unsigned flags)
{
	struct quant_info qi;
	struct quant_apply a = { &qi, { 0 }, dst, 0, x };
	uint64_t sum;

	if (quant_peek(payload, h->stored_size, &qi))
		return -EBADMSG;
	a.out_row = (size_t)qi.channels * (qi.dtype == 3 ? 4 : 2);
	if ((uint64_t)qi.rows * a.out_row != dst_len || a.out_row / qi.channels != h->elem_size)
		return -EBADMSG;
	if (x && x->unit != a.out_row) {
		/* Sound bytes in rows the transform cannot take are not corruption: say which. */
		if (!(flags & CODEC_TRUSTED) && checksum(payload, h->stored_size) != h->checksum)
			return -EBADMSG;
		return -ENOTSUP;
	}
	if (!qi.rows)
		return checksum(payload, h->stored_size) == h->checksum ? 0 : -EBADMSG;
	if (quant_dec_init(&a.dec, &qi, payload))
		return -ENOMEM;
	if (flags & CODEC_TRUSTED) {
		size_t block = checksum_apply_block(qi.row_bytes);

		for (size_t off = 0; off < (size_t)qi.rows * qi.row_bytes; off += block) {
			size_t left = (size_t)qi.rows * qi.row_bytes - off;

			quant_block(&a, NULL, off, left < block ? left : block);
		}
		quant_dec_free(&a.dec);
		return 0;
	}
	sum = checksum_apply_prefixed(payload, qi.data_off, payload + qi.data_off,
				      (size_t)qi.rows * qi.row_bytes, qi.row_bytes, quant_block, &a);
	quant_dec_free(&a.dec);
	return sum == h->checksum ? 0 : -EBADMSG;
}

int codec_decode(const void *src, size_t src_len, void *dst, size_t dst_len, size_t *consumed)
{
	return codec_decode_flags(src, src_len, dst, dst_len, consumed, 0);
}

int codec_decode_flags(const void *src, size_t src_len, void *dst, size_t dst_len,
		       size_t *consumed, unsigned flags)
{
	bool check = !(flags & CODEC_TRUSTED);
	const uint8_t *payload = (const uint8_t *)src + CODEC_HEADER_SIZE;
	struct codec_header h;
	int rc = codec_peek(src, src_len, &h);

	if (rc)
		return rc;
	if (h.raw_size != dst_len)
		return -EINVAL;
	if (h.kind == CODEC_RAW) {
		/* Hash the source as it is copied: one pass; equal hashes make dst correct. */
		if (!check)
			memcpy(dst, payload, dst_len);
		else if (checksum_copy(dst, payload, dst_len) != h.checksum)
			return -EBADMSG;
	} else if (h.kind == CODEC_QUANT) {
		rc = quant_decode_checked(payload, &h, dst, dst_len, NULL, flags);
		if (rc)
			return rc;
	} else {
		size_t nbytes = 0;
		int d;

		if (blosc_cbuffer_validate(payload, h.stored_size, &nbytes) < 0 ||
		    nbytes != h.raw_size)
			return -EBADMSG;
		d = blosc_decompress_ctx(payload, dst, dst_len, 1);
		if (d < 0 || (size_t)d != dst_len || (check && checksum(dst, dst_len) != h.checksum))
			return -EBADMSG;
	}
	if (consumed)
		*consumed = CODEC_HEADER_SIZE + h.stored_size;
	return 0;
}

int codec_verify(const void *src, size_t src_len, size_t raw_size, uint32_t dtype,
		 uint32_t channels, void *scratch, size_t *consumed)
{
	const uint8_t *payload = (const uint8_t *)src + CODEC_HEADER_SIZE;
	struct codec_header h;
	struct quant_info qi;

	if (codec_peek(src, src_len, &h) || h.raw_size != raw_size ||
	    h.elem_size != (dtype == 3 ? 4 : 2))
		return -EBADMSG;
	if (h.kind == CODEC_BSLZ4) {
		if (codec_decode(src, src_len, scratch, raw_size, consumed))
			return -EBADMSG;
		return 0;
	}
	if (h.kind == CODEC_QUANT && (quant_peek(payload, h.stored_size, &qi) || qi.dtype != dtype ||
				      (uint64_t)qi.rows * qi.channels * (qi.dtype == 3 ? 4 : 2) !=
					      raw_size))
		return -EBADMSG;
	if (checksum(payload, h.stored_size) != h.checksum)
		return -EBADMSG;
	/* Sound, and of the right size: in rows a transforming read takes (one a token)? */
	if (h.kind == CODEC_QUANT && qi.channels != channels)
		return -ENOTSUP;
	*consumed = CODEC_HEADER_SIZE + h.stored_size;
	return 0;
}

int codec_quant_shape(const void *src, size_t src_len, uint32_t *rows, uint32_t *channels)
{
	struct codec_header h;
	struct quant_info qi;

	if (codec_peek(src, src_len, &h) || h.kind != CODEC_QUANT ||
	    quant_peek((const uint8_t *)src + CODEC_HEADER_SIZE, h.stored_size, &qi))
		return -EBADMSG;
	*rows = qi.rows;
	*channels = qi.channels;
	return 0;
}

#define CODEC_CHECK_MAX (1ull << 30)

int codec_check(const void *src, size_t src_len, void **scratch, size_t *scratch_cap,
		size_t *consumed)
{
	const uint8_t *payload = (const uint8_t *)src + CODEC_HEADER_SIZE;
	struct codec_header h;

	if (codec_peek(src, src_len, &h))
		return -EBADMSG;
	if (h.kind == CODEC_BSLZ4) {
		if (h.raw_size > CODEC_CHECK_MAX)
			return -EBADMSG; /* no stored tensor is that large: a damaged header */
		if (h.raw_size > *scratch_cap) {
			void *p = realloc(*scratch, h.raw_size);

			if (!p)
				return -ENOMEM;
			*scratch = p;
			*scratch_cap = h.raw_size;
		}
		if (codec_decode(src, src_len, *scratch, h.raw_size, consumed))
			return -EBADMSG;
		return 0;
	}
	if (checksum(payload, h.stored_size) != h.checksum)
		return -EBADMSG;
	*consumed = CODEC_HEADER_SIZE + h.stored_size;
	return 0;
}

struct xform_apply {
	const struct codec_xform *x;
	uint8_t *dst;
};

static void xform_block(void *ctx, const void *src, size_t off, size_t len)
{
	struct xform_apply *a = ctx;

	a->x->fn(a->x->ctx, src, a->dst + off, off, len);
}

/* Hand n bytes of src to fn a block at a time, as checksum_apply() would, without hashing. */
static void apply_unchecked(const void *src, size_t n, size_t unit,
			    void (*fn)(void *ctx, const void *src, size_t off, size_t len),
			    void *ctx)
{
	size_t block = checksum_apply_block(unit);

	for (size_t off = 0; off < n; off += block)
		fn(ctx, (const uint8_t *)src + off, off, n - off < block ? n - off : block);
}

int codec_decode_xform(const void *src, size_t src_len, void *dst, size_t dst_len,
		       size_t *consumed, const struct codec_xform *x, unsigned flags)
{
	const uint8_t *payload = (const uint8_t *)src + CODEC_HEADER_SIZE;
	struct xform_apply a = { x, dst };
	struct codec_header h;
	int rc = codec_peek(src, src_len, &h);

	if (rc)
		return rc;
	if (h.raw_size != dst_len)
		return -EINVAL;
	if (h.kind == CODEC_RAW) {
		if (flags & CODEC_TRUSTED)
			apply_unchecked(payload, dst_len, x->unit, xform_block, &a);
		else if (checksum_apply(payload, dst_len, x->unit, xform_block, &a) != h.checksum)
			return -EBADMSG;
	} else if (h.kind == CODEC_QUANT) {
		rc = quant_decode_checked(payload, &h, dst, dst_len, x, flags);
		if (rc)
			return rc;
	} else {
		rc = codec_decode_flags(src, src_len, dst, dst_len, NULL, flags);
		if (rc)
			return rc;
		for (size_t off = 0; off < dst_len; off += 16 * x->unit) {
			size_t n = dst_len - off < 16 * x->unit ? dst_len - off : 16 * x->unit;

			x->fn(x->ctx, a.dst + off, a.dst + off, off, n);
		}
	}
	if (consumed)
		*consumed = CODEC_HEADER_SIZE + h.stored_size;
	return 0;
}

static void apply_block(void *ctx, const void *src, size_t off, size_t len)
{
	const struct codec_xform *x = ctx;

	x->fn(x->ctx, src, NULL, off, len);
}

int codec_apply(const void *src, size_t src_len, size_t raw_size, size_t *consumed,
		const struct codec_xform *x, unsigned flags)
{
	const uint8_t *payload = (const uint8_t *)src + CODEC_HEADER_SIZE;
	struct codec_header h;
	size_t block = checksum_apply_block(x->unit);
	uint8_t *buf;
	int rc = codec_peek(src, src_len, &h);

	if (rc)
		return rc;
	if (h.raw_size != raw_size)
		return -EINVAL;
	if (h.kind == CODEC_RAW) {
		if (flags & CODEC_TRUSTED)
			apply_unchecked(payload, raw_size, x->unit, apply_block, (void *)x);
		else if (checksum_apply(payload, raw_size, x->unit, apply_block, (void *)x) !=
			 h.checksum)
			return -EBADMSG;
		if (consumed)
			*consumed = CODEC_HEADER_SIZE + h.stored_size;
		return 0;
	}
	buf = malloc(raw_size ? raw_size : 1);
	if (!buf)
		return -ENOMEM;
	rc = codec_decode_flags(src, src_len, buf, raw_size, consumed, flags);
	for (size_t off = 0; !rc && off < raw_size; off += block)
		x->fn(x->ctx, buf + off, NULL, off, raw_size - off < block ? raw_size - off : block);
	free(buf);
	return rc;
}
