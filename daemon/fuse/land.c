/* fuse/land — landing a session's layers in the node's own buffers; see fuse_impl.h. */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <linux/futex.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "store/checksum.h"
#include "common/ckd.h"
#include "daemon/fuse/fuse_impl.h"
#include "daemon/log.h"

/*
 * Rows go to the node's buffers with non-temporal stores once a layer is at least
 * this large: ordinary stores first read every line they fill (read for ownership),
 * a third more memory traffic, while a layer this size leaves the caches before the
 * engine reads it anyway. So for paged and for contiguous layouts alike (contiguous
 * rows were written with ordinary stores, decoded in place, until 2026-12-05).
 * Measured: docs/benchmarks.md, "Paged landing" and "Contiguous landing streamed".
 */
#define LAND_STREAM_MIN (1u << 20)

/* Publish that layers 0 .. v-1 are in place (or, with KVBP_LAND_FAILED, that landing stopped). */
void land_publish(struct fuse_session *s, uint32_t v)
{
	atomic_store_explicit(s->progress, v, memory_order_release);
	/* A shared futex: the node may sleep on the word (its mapping of the same memfd). */
	syscall(SYS_futex, (uint32_t *)s->progress, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/*
 * The last byte + 1 a layout side may write, from its base offset off: layer_max
 * and page_max are the largest layer and page offsets; a side's rows are token
 * (tstride), head (hstride) and element (dstride) strided. False on overflow.
 */
static bool land_extent(const struct fuse_session *s, const struct kvbp_layout *y, uint64_t off,
			uint64_t layer_max, uint64_t page_max, uint64_t tstride, uint64_t hstride,
			uint64_t dstride, uint64_t *end)
{
	uint64_t tokens = y->page_tokens ? (s->n < y->page_tokens ? s->n : y->page_tokens) : s->n;
	uint64_t tok_max, head_max, row_end, e;

	/* every step checked: a head stride near 2^64 must not wrap the extent to a few
	 * bytes (issue 30: a write before the segment) */
	return !ckd_mul_add(&tok_max, tokens - 1, tstride, page_max) &&
	       !ckd_mul(&head_max, (uint64_t)s->land_hn - 1, hstride) &&
	       !ckd_mul_add(&row_end, (uint64_t)s->m.desc.head_dim - 1, dstride, s->m.elem_size) &&
	       !ckd_add(&row_end, row_end, head_max) &&
	       !ckd_add3(&e, off, layer_max, tok_max) && !ckd_add(end, e, row_end);
}

/*
 * Check the node's layout y for session s (its tokens, heads, layers) against the
 * segment it names, and hold that segment for the session. Every byte the daemon
 * may write lies inside it: the extent is computed with overflow checks. A layout
 * with k_dim_stride > 0 places K by its own strides (e.g. transposed per page).
 */
uint32_t land_setup(struct fuse_table *t, struct fuse_session *s,
		    const struct kvbp_layout *y, const char *owner, char *err, size_t errlen)
{
	uint64_t pm = 0, layer_max, end = 0, dev_end = 0, e, span[2] = { 0, 0 };
	bool k_own = y->k_dim_stride != 0;
	uint32_t code;
	void *base;

	/* The node's heads: all, or a tensor-parallel rank's range of the stored ones. */
	if (!y->head_count && y->head_begin)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "landing layout: head_begin %" PRIu32
			    " without head_count", y->head_begin);
	/* ckd-ok: two 32-bit numbers summed in 64 bits */
	if ((uint64_t)y->head_begin + y->head_count > s->m.desc.num_kv_heads)
		return fail(err, errlen, KVBP_BAD_SHAPE, "landing layout: heads [%" PRIu32 ", %"
			    PRIu64 ") of a model with %" PRIu32 " KV heads", y->head_begin,
			    /* ckd-ok: as above */ (uint64_t)y->head_begin + y->head_count,
			    s->m.desc.num_kv_heads);
	s->land_h0 = y->head_begin;
	s->land_hn = y->head_count ? y->head_count : s->m.desc.num_kv_heads;
	if (s->land_hn < s->m.desc.num_kv_heads && s->n_checks &&
	    s->metric == KVBP_METRIC_ATTENTION)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "landing layout: a head range blends "
			    "by the value or key metric only (the ranks sum their heads' deviations), "
			    "not by attention");
	if (ckd_mul(&layer_max, (uint64_t)s->m.desc.num_layers - 1, y->layer_stride))
		return fail(err, errlen, KVBP_BAD_SHAPE, "landing layout: strides overflow");
	if (y->page_tokens) {
		/* ckd-ok: two 32-bit numbers summed in 64 bits */
		uint64_t need = ((uint64_t)s->n + y->page_tokens - 1) / y->page_tokens;

		if (y->n_pages < need)
			return fail(err, errlen, KVBP_BAD_SHAPE, "landing layout: the block table has "
				    "%zu pages; %" PRIu32 " tokens in pages of %" PRIu32 " need %" PRIu64,
				    y->n_pages, s->n, y->page_tokens, need);
		for (uint64_t i = 0; i < need; i++)
			if (y->pages[i] > pm)
				pm = y->pages[i];
		if (ckd_mul(&pm, pm, y->page_stride))
			return fail(err, errlen, KVBP_BAD_SHAPE, "landing layout: page offsets "
				    "overflow");
	} else if (y->n_pages) {
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "landing layout: a block table needs "
			    "page_tokens");
	}
	for (int i = 0; i < 2; i++) {
		bool own = i == 0 && k_own;

		if (!land_extent(s, y, i ? y->v_offset : y->k_offset, layer_max, pm,
				 own ? y->k_token_stride : y->token_stride,
				 own ? y->k_head_stride : y->head_stride,
				 own ? y->k_dim_stride : s->m.elem_size, &e))
			return fail(err, errlen, KVBP_BAD_SHAPE, "landing layout: %c offsets overflow",
				    i ? 'V' : 'K');
		end = e > end ? e : end;
		/* one layer's span from its start (it holds within the whole, checked above) */
		land_extent(s, y, 0, 0, pm, own ? y->k_token_stride : y->token_stride,
			    own ? y->k_head_stride : y->head_stride,
			    own ? y->k_dim_stride : s->m.elem_size, &span[i]);
	}
	if (y->progress % 4 || y->progress > UINT64_MAX - 4)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "landing layout: the progress word at "
			    "%" PRIu64 " is not 4-byte aligned", y->progress);
	if (y->has_device) {
		/* K and V in the node's device allocation: the segment holds the word only. */
		dev_end = end;
		end = 0;
	}
	if (y->progress + 4 > end) /* ckd-ok: progress <= UINT64_MAX - 4, checked above */
		end = y->progress + 4; /* ckd-ok: as above */
	if (shm_acquire(t->shm, y->shm_id, owner, 0, end, &base))
		return fail(err, errlen, KVBP_BAD_SHM, "landing layout: shared-memory segment %"
			    PRIu64 " unknown, expired, not this client's, or smaller than the %"
			    PRIu64 " bytes the layout spans", y->shm_id, end);
	s->land = true;
	s->land_shm = y->shm_id;
	s->land_mem = base;
	s->lay = *y;
	if (!k_own) {
		s->lay.k_token_stride = y->token_stride;
		s->lay.k_head_stride = y->head_stride;
	}
	s->lay.pages = NULL;
	s->lay.n_pages = 0;
	if (y->page_tokens && !y->has_device) { /* a device landing keeps its own (device.c) */
		/* ckd-ok: two 32-bit numbers summed in 64 bits */
		size_t np = ((size_t)s->n + y->page_tokens - 1) / y->page_tokens;

		s->lay.pages = malloc(np * sizeof(uint32_t));
		if (!s->lay.pages)
			return fail(err, errlen, KVBP_LIMIT, "out of memory");
		memcpy(s->lay.pages, y->pages, np * sizeof(uint32_t));
		s->lay.n_pages = np;
	}
	/* ckd-ok: progress + 4 <= end, inside the segment shm_acquire checked */
	s->progress = (_Atomic uint32_t *)((uint8_t *)base + y->progress);
	s->land_begin = s->n_checks ? s->checks[0] + 1 : 0;
	s->land_next = s->land_begin;
	if (y->has_device) {
		code = dland_setup(t, s, y, owner, dev_end, span[0], span[1], err, errlen);
		if (code)
			return code;
		/* The host lands each layer into the pinned staging, as rows of all tokens
		 * (K, then V); dland_layer() takes them to the node's cache from there. */
		/* land_mem stays the segment's base until dland_alloc() gives the staging */
		s->lay = (struct kvbp_layout){ .shm_id = y->shm_id,
					       .v_offset = (uint64_t)s->n * s->row_bytes,
					       .token_stride = s->row_bytes,
					       .head_stride = (uint64_t)s->m.desc.head_dim *
							      s->m.elem_size,
					       .progress = y->progress,
					       .k_token_stride = s->row_bytes,
					       .k_head_stride = (uint64_t)s->m.desc.head_dim *
								s->m.elem_size };
		s->direct = true;
		s->stream = false;
		return KVBP_OK;
	}
	/* Contiguous rows too go through the blocks of land_scattered(): K re-rotated
	 * straight into place, V copied, both streamed (see LAND_STREAM_MIN). */
	s->direct = false;
	/* ckd-ok: n < 2^32 tokens of row_bytes, both checked when the session opened */
	s->stream = 2 * (uint64_t)s->n * s->row_bytes >= LAND_STREAM_MIN;
	return KVBP_OK;
}

/* The check-layer slots, in one allocation of bytes. */
int land_alloc(struct fuse_session *s, uint64_t bytes)
{
	size_t slot = 2 * (size_t)s->n * s->row_bytes;

	s->cslot = calloc(s->n_checks ? s->n_checks : 1, sizeof(*s->cslot));
	/* Not zeroed whole (megabytes, at every open): loads write every chunk row, and
	 * the fresh rows, which the deviation reads and drops, are zeroed here. */
	s->land_buf = bytes ? malloc(bytes) : NULL;
	if (!s->cslot || (bytes && !s->land_buf))
		return -ENOMEM;
	for (size_t i = 0; i < s->n_checks; i++) {
		struct slot *sl = &s->cslot[i];

		sl->layer = -1;
		sl->k = s->land_buf + i * slot;
		sl->v = sl->k + slot / 2;
		for (size_t j = 0; j < s->n_fresh; j++) {
			/* ckd-ok: a fresh row of the session's n, inside the slot */
			memset(sl->k + (size_t)s->fresh[j] * s->row_bytes, 0, s->row_bytes);
			memset(sl->v + (size_t)s->fresh[j] * s->row_bytes, 0, s->row_bytes);
		}
	}
	/* The first check layer is never landed (the node computes it): the value and key
	 * metrics read one plane of it, so the other is not loaded (nor re-rotated). */
	if (s->n_checks && s->metric == KVBP_METRIC_VALUE)
		s->cslot[0].skip = SKIP_K;
	else if (s->n_checks && s->metric == KVBP_METRIC_KEY)
		s->cslot[0].skip = SKIP_V;
	return 0;
}

/*
 * Offset in the node's segment of row t of layer l, from base (k_offset or
 * v_offset), tokens tstride apart in a page (k_token_stride or token_stride).
 */
static inline uint64_t land_off(const struct fuse_session *s, uint64_t base, uint64_t tstride,
				uint32_t l, uint32_t t)
{
	const struct kvbp_layout *y = &s->lay;

	/* ckd-ok: l, t and the pages below their maxima, whose extent land_setup checked */
	base += (uint64_t)l * y->layer_stride;
	if (y->page_tokens)
		/* ckd-ok: as above */
		return base + (uint64_t)y->pages[t / y->page_tokens] * y->page_stride +
		       (uint64_t)(t % y->page_tokens) * tstride;
	return base + (uint64_t)t * tstride;
}

/* Tokens a K tile of land_k_strided() spans: its source rows stay in L1 while each
 * element column of the tile is written, a cache line at a time for vLLM's layout. */
#define K_TILE 16

/*
 * K rows [a, b) of layer l, from src ([b - a][heads][head_dim], rows row_bytes apart),
 * by the layout's own K strides (e.g. transposed per page): in tiles of up to K_TILE
 * tokens of one page, element column by column.
 */
static void land_k_strided(const struct fuse_session *s, uint32_t l, uint32_t a, uint32_t b,
			   const uint8_t *src)
{
	size_t hs = s->lay.k_head_stride, ds = s->lay.k_dim_stride, ts = s->lay.k_token_stride;
	size_t es = s->m.elem_size, rb = s->row_bytes;
	uint32_t hd = s->m.desc.head_dim, pt = s->lay.page_tokens;

	for (uint32_t t = a, run; t < b; t += run, src += (size_t)run * rb) {
		uint8_t *dst = s->land_mem + land_off(s, s->lay.k_offset, ts, l, t);

		run = b - t < K_TILE ? b - t : K_TILE;
		if (pt && run > pt - t % pt)
			run = pt - t % pt; /* the tile ends with the page */
		for (uint32_t h = 0; h < s->land_hn; h++)
			for (uint32_t d = 0; d < hd; d++) {
				uint8_t *o = dst + h * hs + d * ds;
				const uint8_t *in = src + ((size_t)(s->land_h0 + h) * hd + d) * es;

				if (es == 4)
					for (uint32_t j = 0; j < run; j++)
						memcpy(o + j * ts, in + j * rb, 4);
				else
					for (uint32_t j = 0; j < run; j++)
						memcpy(o + j * ts, in + j * rb, 2);
			}
	}
}

/* n bytes into the node's buffers: streamed where the session streams (see LAND_STREAM_MIN). */
static inline void land_copy(const struct fuse_session *s, uint8_t *dst, const uint8_t *src,
			     size_t n)
{
	if (s->stream)
		blend_stream_copy(dst, src, n);
	else
		memcpy(dst, src, n);
}

/*
 * Write n rows (src: [n][heads][head_dim]) from token t on into layer l of V, or of
 * K (kv 0) by its own strides where the layout gives K some.
 */
static void land_put_rows(const struct fuse_session *s, int kv, uint32_t l, uint32_t t,
			  uint32_t n, const uint8_t *src)
{
	size_t hb = (size_t)s->m.desc.head_dim * s->m.elem_size;
	uint64_t base = kv ? s->lay.v_offset : s->lay.k_offset;
	uint64_t ts = kv ? s->lay.token_stride : s->lay.k_token_stride;

	if (!kv && s->lay.k_dim_stride) {
		land_k_strided(s, l, t, t + n, src);
		return;
	}
	if (!s->lay.page_tokens && s->land_hn == s->m.desc.num_kv_heads &&
	    s->lay.head_stride == hb && ts == s->row_bytes) {
		/* contiguous whole rows: one run */
		land_copy(s, s->land_mem + land_off(s, base, ts, l, t), src,
			  (size_t)n * s->row_bytes); /* ckd-ok: rows of the chunk's block */
		return;
	}
	for (uint32_t i = 0; i < n; i++, src += s->row_bytes) {
		uint8_t *dst = s->land_mem + land_off(s, base, ts, l, t + i);
		const uint8_t *from = src + s->land_h0 * hb; /* the node's first head */

		if (s->lay.head_stride == hb) {
			land_copy(s, dst, from, s->land_hn * hb);
			continue;
		}
		for (uint32_t h = 0; h < s->land_hn; h++)
			land_copy(s, dst + h * s->lay.head_stride, from + h * hb, hb);
	}
}

/* Copy rows [a, b) of slot sl (K and V) into layer l of the node's buffers. */
static void land_rows(const struct fuse_session *s, const struct slot *sl, uint32_t l, uint32_t a,
		      uint32_t b)
{
	size_t off = (size_t)a * s->row_bytes;

	if (s->dl) {
		/* The device landing's staging holds whole rows, as the direct path writes
		 * them: dland_layer() takes a head range's heads out of each row itself. */
		/* ckd-ok: rows [a, b) of the session's n, inside the staging (dland_setup) */
		memcpy(s->land_mem + off, sl->k + off, (size_t)(b - a) * s->row_bytes);
		/* ckd-ok: as above; V at n rows after K */
		memcpy(s->land_mem + s->lay.v_offset + off, sl->v + off,
		       (size_t)(b - a) * s->row_bytes);
		return;
	}
	land_put_rows(s, 0, l, a, b - a, sl->k + off);
	land_put_rows(s, 1, l, a, b - a, sl->v + off);
}

/* One tensor (K or V) of a chunk's layer on its way from the store to the node's buffers. */
struct land_scatter {
	const struct fuse_session *s;
	struct rotate_ctx *rx; /* K: re-rotate each block first; V: NULL */
	int kv;		       /* 0 K, 1 V */
	uint32_t layer;
	uint32_t row0;	       /* the chunk's first row in the session */
	uint8_t *tmp;	       /* K: a block of re-rotated rows */
};

/*
 * K rows [r, r + n) of the chunk (src: row r), re-rotated straight into the node's
 * buffers by the backend's rotate_to, a page's run at a time.
 */
static void land_rotate_to(struct land_scatter *a, const uint8_t *src, uint32_t r, uint32_t n)
{
	const struct fuse_session *s = a->s;
	const struct blend_backend *be = a->rx->be;
	struct blend_out o = { s->lay.k_token_stride, s->lay.k_head_stride, s->stream };
	uint32_t pt = s->lay.page_tokens;

	for (uint32_t run; n && !a->rx->err; r += run, n -= run, src += (size_t)run * s->row_bytes) {
		uint32_t t = a->row0 + r;
		int rc;

		run = pt && n > pt - t % pt ? pt - t % pt : n; /* a run ends with its page */
		rc = be->rotate_to(be, &s->shape, a->rx->rot, src,
				   s->land_mem + land_off(s, s->lay.k_offset, s->lay.k_token_stride,
							  a->layer, t),
				   &o, r, run);
		if (rc)
			a->rx->err = rc;
	}
}

/* codec_apply's transform: a verified block of stored rows, written where the node keeps them. */
static void land_scatter(void *arg, const void *src, void *dst, size_t off, size_t len)
{
	struct land_scatter *a = arg;
	size_t rb = a->s->row_bytes;

	(void)dst;
	if (a->rx && !a->tmp) {
		land_rotate_to(a, src, (uint32_t)(off / rb), (uint32_t)(len / rb));
		return;
	}
	if (a->rx) {
		rotate_rows(a->rx, src, a->tmp, off, len);
		if (a->rx->err)
			return;
		src = a->tmp;
	}
	land_put_rows(a->s, a->kv, a->layer, a->row0 + (uint32_t)(off / rb), (uint32_t)(len / rb),
		      src);
}

/*
 * Land chunk c of layer l into the node's host buffers (contiguous, paged, or
 * heads apart): one pass, each block verified, its K re-rotated straight into
 * place (the backend's rotate_to), or where the backend cannot (a device) or K
 * has its own element strides, re-rotated into a cache-sized scratch and
 * scattered while it is in cache.
 */
static int land_scattered(struct fuse_table *t, struct fuse_session *s, struct chunk_ref *c,
			  uint32_t l)
{
	struct rotate_ctx rx = { t->be, s, c, rope_table_of_layer(&s->m.desc, c->rot, l), 0 };
	struct land_scatter ks = { s, &rx, 0, l, c->off, NULL };
	struct land_scatter vs = { s, NULL, 1, l, c->off, NULL };
	struct codec_xform kx = { land_scatter, &ks, s->row_bytes };
	struct codec_xform vx = { land_scatter, &vs, s->row_bytes };
	int rc;

	/* rotate_to writes every head: a head range goes through the scratch block */
	if (!t->be->rotate_to || s->lay.k_dim_stride || s->land_hn < s->m.desc.num_kv_heads) {
		ks.tmp = malloc(checksum_apply_block(s->row_bytes));
		if (!ks.tmp)
			return -ENOMEM;
	}
	rc = store_chunk_apply_layer(t->store, &s->m, c->hash, l,
				     (uint64_t)c->tokens * s->row_bytes, &kx, &vx);
	free(ks.tmp);
	return rc ? rc : rx.err;
}

struct land_job {
	struct fuse_table *t;
	struct fuse_session *s;
	const struct slot *from; /* the layer is loaded here already (a check layer), or NULL */
	uint32_t layer;
	bool raw; /* keys as stored: the device re-rotates them (a device landing) */
};

/* Land chunk i of a layer: from the check slot it is in, or verified straight from the store. */
static int land_chunk(void *arg, size_t i)
{
	struct land_job *j = arg;
	struct fuse_session *s = j->s;
	struct chunk_ref *c = &s->chunks[i];
	int rc = 0;

	if (j->from) {
		land_rows(s, j->from, j->layer, c->off, c->off + c->tokens);
	} else if (s->direct) {
		struct rotate_ctx rx = { j->t->be, s, c,
					 rope_table_of_layer(&s->m.desc, c->rot, j->layer), 0 };
		struct codec_xform x = { rotate_rows, &rx, s->row_bytes };

		/* A device landing's host staging: one pass, verify, re-rotate (here, or on
		 * the device after the copy up), write the chunk's rows whole. */
		rc = store_chunk_get_layer(j->t->store, &s->m, c->hash, j->layer,
					   s->land_mem + land_off(s, s->lay.k_offset,
								  s->lay.token_stride, j->layer,
								  c->off),
					   s->land_mem + land_off(s, s->lay.v_offset,
								  s->lay.token_stride, j->layer,
								  c->off),
					   (uint64_t)c->tokens * s->row_bytes, j->raw ? NULL : &x);
		if (rc == -EBADMSG)
			atomic_store(&c->corrupt, true);
		return rc ? rc : rx.err;
	} else {
		rc = land_scattered(j->t, s, c, j->layer);
	}
	if (rc == -EBADMSG)
		atomic_store(&c->corrupt, true);
	if (s->stream)
		blend_stream_fence(); /* before the layer is published (land_step) */
	return rc;
}

/* Make check slot i READY, loading it here unless another thread is; session lock held. */
int ensure_cslot(struct fuse_table *t, struct fuse_session *s, size_t i)
{
	struct slot *sl = &s->cslot[i];

	for (;;) {
		if (sl->state == SLOT_READY)
			return 0;
		if (sl->state == SLOT_FAILED)
			return sl->err;
		if (sl->state == SLOT_LOADING) {
			pthread_cond_wait(&s->cond, &s->lock);
			continue;
		}
		load_slot_locked(t, s, sl, s->checks[i]);
	}
}

/*
 * Landing stopped at layer l for store errno rc: tell the node (session lock held)
 * how many layers are in place, once nothing more is on its way into a device cache.
 */
static void land_failed(struct fuse_table *t, struct fuse_session *s, uint32_t l, int rc)
{
	uint32_t in_place = s->dl ? dland_quiesce(t, s, s->land_next) : s->land_next;
	char why[160];

	s->land_code = store_code(rc);
	log_warn("fuse session %016" PRIx64 ": layer %" PRIu32 " cannot be landed: %s", s->id, l,
		 load_error(t, rc, why, sizeof(why)));
	land_publish(s, KVBP_LAND_FAILED | s->land_code << 24 | in_place);
}

/*
 * Land the session's next layer (or first load the first check layer, which the
 * node asks about before any layer lands). Called by the prefetch thread holding
 * a reference; returns whether there is more to do, so that sessions take turns.
 */
bool land_step(struct fuse_table *t, struct fuse_session *s)
{
	struct land_job j = { t, s, NULL, 0, false };
	struct timespec t0;
	uint32_t done = 0;
	bool more;
	int rc = 0;

	pthread_mutex_lock(&s->lock);
	if (s->closed || s->land_stop || s->land_code || s->landing ||
	    s->land_next >= s->m.desc.num_layers) {
		pthread_mutex_unlock(&s->lock);
		return false;
	}
	if (s->n_checks && s->cslot[0].state == SLOT_EMPTY) {
		rc = ensure_cslot(t, s, 0);
		if (rc)
			land_failed(t, s, s->checks[0], rc);
		pthread_mutex_unlock(&s->lock);
		return !rc;
	}
	s->landing = true;
	j.layer = s->land_next;
	for (size_t i = 1; i < s->n_checks && !rc; i++)
		if (s->checks[i] == j.layer) {
			/* A later check layer: loaded once, for its deviation and to land. */
			rc = ensure_cslot(t, s, i);
			j.from = &s->cslot[i];
		}
	if (s->dl) {
		s->land_mem = dland_stage(s, j.layer); /* the host buffer this layer goes to */
		j.raw = !j.from; /* a check layer's slot is rotated already */
	}
	pthread_mutex_unlock(&s->lock);
	clock_gettime(CLOCK_MONOTONIC, &t0);
	if (!rc)
		rc = pool_run(t->pool, s->n_chunks, land_chunk, &j);
	if (!rc && s->dl)
		rc = dland_layer(t, s, j.layer, j.raw, &done);
	pthread_mutex_lock(&s->lock);
	s->ns_land += ns_since(&t0);
	s->landing = false;
	if (rc) {
		land_failed(t, s, j.layer, rc);
	} else if (!s->land_stop) {
		s->land_next++;
		s->layers_served++;
		/* ckd-ok: n_cached < 2^32 rows of at most row_bytes */
		s->bytes_out += 2 * (uint64_t)s->n_cached * s->row_bytes / s->m.desc.num_kv_heads *
				s->land_hn;
		land_publish(s, s->dl ? done : s->land_next);
	}
	pthread_cond_broadcast(&s->cond);
	more = !rc && !s->land_stop && s->land_next < s->m.desc.num_layers;
	pthread_mutex_unlock(&s->lock);
	return more;
}
