/* fuse/dland — landing into the node's device memory (its allocation mapped by handle,
 * layers copied up and written there by the device); see fuse_impl.h (dland_*). */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/ckd.h"
#include "daemon/fuse/fuse_impl.h"
#include "daemon/log.h"

/* ---- landing into the node's device memory ---- */

struct dev_land {
	struct dimport *imp;
	/* pinned: two buffers of a layer's K rows, then V rows, of all tokens (layers
	 * alternate: the host fills one while the other is copied up); then the rows and
	 * the block table for their upload */
	uint8_t *hstage;
	size_t hstage_bytes, hstage_need;
	uint8_t *dblk; /* device: one layer's K and V rows, the cached tokens, the block table */
	size_t dblk_bytes, dblk_need;
	size_t rows_off, pages_off, spans_off; /* in dblk (and after the host's two buffers) */
	int32_t *drows; /* the cached tokens (in dblk) */
	uint32_t n_rows;
	uint32_t *pages; /* the node's block table (a copy), and its place in dblk */
	size_t n_pages;
	uint32_t *dpages;
	/* the chunks as spans of a layer's K rows, and their rotation tables (in dblk, at
	 * spans_off, laid out as a device session's: dev_setup_bytes) */
	struct blend_dev_span *dspans;
	uint32_t n_spans, span_rows;
	struct blend_stream *st;
	struct blend_event *ev[2]; /* the layer of each host buffer, landed */
	int64_t pending;	   /* a layer copied up and landing, not yet published; or -1 */
	struct kvbp_layout lay; /* the node's (offsets into its allocation); pages not kept */
	uint32_t allocs;
	bool failed;
};

enum { IMPORT_FREE = 0, IMPORT_OPENING, IMPORT_OPEN, IMPORT_CLOSING };

/* A handle naming a descriptor the node handed in (shm.h): "kvbfd:" and 16 hex digits. */
#define FD_HANDLE "kvbfd:"

/* The token of a descriptor handle, or 0 when handle is not one. */
static uint64_t fd_handle_token(const uint8_t handle[KVBP_DEVICE_HANDLE_LEN])
{
	const size_t p = sizeof(FD_HANDLE) - 1;
	uint64_t token = 0;

	if (memcmp(handle, FD_HANDLE, p) || handle[p + 16])
		return 0;
	for (size_t i = p; i < p + 16; i++) {
		int c = handle[i];
		int v = c >= '0' && c <= '9' ? c - '0' : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1;

		if (v < 0)
			return 0;
		token = token << 4 | (uint64_t)v;
	}
	return token;
}

/*
 * Map y's allocation for owner into slot: the descriptors it handed in (their token in
 * the handle), or a CUDA IPC memory handle. Returns 0 with slot's base, bytes and,
 * from descriptors, its places; or a reply code with err.
 */
static uint32_t import_open(struct fuse_table *t, const struct kvbp_layout *y, const char *owner,
			    struct dimport *slot, char *err, size_t errlen)
{
	const struct blend_device *dv = t->dev;
	uint64_t token = fd_handle_token(y->device_handle);
	char why[128] = "";
	int rc;

	if (!memcmp(y->device_handle, "emu:", 4))
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "landing into device memory: a handle "
			    "naming memory by a path (emu:...) is refused, since any local "
			    "process could name it; hand the descriptor over instead "
			    "(kvb_device_handle_from_fd)");
	if (token) {
		struct shm_fd_seg *in = NULL;
		struct blend_fd_seg *segs = NULL;
		unsigned n = 0;

		rc = t->shm ? shm_deposit_take(t->shm, token, owner, &in, &n) : -ENOENT;
		if (rc)
			return fail(err, errlen, KVBP_BAD_ARGUMENT, "landing into device memory: "
				    "descriptor handle %016" PRIx64 " is not one this client handed "
				    "in (unknown, another client's, or its process has exited)",
				    token);
		segs = calloc(n, sizeof(*segs));
		slot->segs = calloc(n, sizeof(*slot->segs));
		if (!segs || !slot->segs) {
			rc = -ENOMEM;
		} else {
			for (unsigned k = 0; k < n; k++)
				segs[k] = (struct blend_fd_seg){ in[k].fd, in[k].offset, in[k].size };
			rc = dv->fd_open ? dv->fd_open(dv, segs, n, y->device_pci, y->device_bytes,
						       &slot->base, &slot->bytes, &slot->ctx)
					 : -ENOTSUP;
		}
		for (unsigned k = 0; k < n; k++) {
			close(in[k].fd);
			if (!rc) /* (a lone segment of size 0: the whole file) */
				slot->segs[k] = (struct dimport_seg){
					in[k].offset, in[k].size ? in[k].size : slot->bytes - in[k].offset
				};
		}
		free(in);
		free(segs);
		if (rc) {
			free(slot->segs);
			slot->segs = NULL;
		} else {
			slot->n_segs = n;
			slot->by_fd = true;
		}
		if (rc == -ENOTSUP)
			return fail(err, errlen, KVBP_BAD_ARGUMENT, "landing into device memory: "
				    "this daemon's %s device takes no descriptors; hand it a CUDA IPC "
				    "handle", dv->name);
		if (rc == -EPERM)
			return fail(err, errlen, KVBP_BAD_ARGUMENT, "landing into device memory: "
				    "the descriptors handed in are not memory this device can map (the "
				    "emulated device takes memfds sealed against shrinking)");
	} else {
		if (!dv->ipc_open)
			return fail(err, errlen, KVBP_BAD_ARGUMENT, "landing into device memory: "
				    "this daemon's %s device takes descriptors only; hand one in "
				    "(kvb_device_handle_from_fd)", dv->name);
		rc = dv->ipc_open(dv, y->device_handle, y->device_pci, &slot->base, &slot->bytes);
	}
	if (rc && rc != -ENODEV)
		dv->last_error(dv, why, sizeof(why));
	if (rc == -ENODEV)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "landing into device memory: the "
			    "allocation is on device %s, not on this daemon's %s device",
			    y->device_pci, dv->name);
	if (rc)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "landing into device memory: the "
			    "allocation's handle cannot be mapped (%s%s%s)", strerror(-rc),
			    *why ? ": " : "", why);
	return KVBP_OK;
}

/*
 * Map the node's allocation (or take another reference to it). Imports are the
 * owner's: keyed by (owner, handle), never shared with another client that names the
 * same handle (a handle is no proof of whose memory it is). Takes the table lock; the
 * driver's map (cudaIpcOpenMemHandle: milliseconds, more on a busy device) runs with
 * it dropped, its slot marked opening, so that other sessions' opens, closes and
 * layers do not wait on it; a session of the same owner after the same handle waits
 * for that map, or for an unmap under way (a process maps a handle once at a time).
 */
static uint32_t import_take(struct fuse_table *t, const struct kvbp_layout *y, const char *owner,
			    struct dimport **out, char *err, size_t errlen)
{
	struct dimport *slot;
	uint32_t code;

	pthread_mutex_lock(&t->lock);
	for (;;) {
		struct dimport *free_slot = NULL, *same = NULL;
		unsigned mine = 0;

		for (size_t i = 0; i < FUSE_IMPORTS_MAX; i++) {
			struct dimport *m = &t->imports[i];

			mine += m->refs && !strcmp(m->owner, owner);
			if (m->state != IMPORT_FREE && !strcmp(m->owner, owner) &&
			    !memcmp(m->handle, y->device_handle, sizeof(m->handle)))
				same = m;
			if (m->state == IMPORT_FREE && !free_slot)
				free_slot = m;
		}
		if (same && same->state != IMPORT_OPEN) {
			pthread_cond_wait(&t->imports_cond, &t->lock);
			continue;
		}
		if (same) {
			if (strcmp(same->pci, y->device_pci)) {
				pthread_mutex_unlock(&t->lock);
				return fail(err, errlen, KVBP_BAD_ARGUMENT, "landing into device "
					    "memory: the allocation is mapped from device %s, not "
					    "%s", same->pci, y->device_pci);
			}
			same->refs++;
			pthread_mutex_unlock(&t->lock);
			*out = same;
			return KVBP_OK;
		}
		if (mine >= FUSE_IMPORTS_PER_OWNER) {
			pthread_mutex_unlock(&t->lock);
			return fail(err, errlen, KVBP_LIMIT, "landing into device memory: this "
				    "client's sessions map %u device allocations already (at most "
				    "%d)", mine, FUSE_IMPORTS_PER_OWNER);
		}
		if (!free_slot) {
			pthread_mutex_unlock(&t->lock);
			return fail(err, errlen, KVBP_LIMIT, "landing into device memory: %d node "
				    "allocations are mapped already", FUSE_IMPORTS_MAX);
		}
		slot = free_slot;
		break;
	}
	memcpy(slot->handle, y->device_handle, sizeof(slot->handle));
	snprintf(slot->pci, sizeof(slot->pci), "%s", y->device_pci);
	snprintf(slot->owner, sizeof(slot->owner), "%s", owner);
	slot->refs = 1; /* counts against the owner's cap while it opens */
	slot->state = IMPORT_OPENING;
	slot->by_fd = false;
	slot->ctx = NULL;
	slot->n_segs = 0;
	slot->segs = NULL;
	pthread_mutex_unlock(&t->lock);
	code = import_open(t, y, owner, slot, err, errlen);
	pthread_mutex_lock(&t->lock);
	if (code) {
		slot->refs = 0;
		slot->base = NULL;
		slot->bytes = 0;
		slot->state = IMPORT_FREE;
	} else {
		slot->state = IMPORT_OPEN;
	}
	pthread_cond_broadcast(&t->imports_cond);
	pthread_mutex_unlock(&t->lock);
	if (code)
		return code;
	*out = slot;
	return KVBP_OK;
}

/* Drop a reference; the last unmaps it, with the table lock dropped (its slot closing). */
static void import_put(struct fuse_table *t, struct dimport *m)
{
	void *base;
	uint64_t bytes;

	pthread_mutex_lock(&t->lock);
	if (!m || !m->refs || --m->refs) {
		pthread_mutex_unlock(&t->lock);
		return;
	}
	base = m->base;
	bytes = m->bytes;
	m->state = IMPORT_CLOSING;
	pthread_mutex_unlock(&t->lock);
	if (m->by_fd)
		t->dev->fd_close(t->dev, base, bytes, m->ctx);
	else
		t->dev->ipc_close(t->dev, base, bytes);
	pthread_mutex_lock(&t->lock);
	free(m->segs);
	m->segs = NULL;
	m->n_segs = 0;
	m->ctx = NULL;
	m->by_fd = false;
	m->base = NULL;
	m->bytes = 0;
	m->state = IMPORT_FREE;
	pthread_cond_broadcast(&t->imports_cond);
	pthread_mutex_unlock(&t->lock);
}

/*
 * Whether every layer's K and V of y (each span bytes from its layer's start) lie in one
 * mapped place of import m: a layout that reached into a gap between the segments of a
 * node's reservation would fault the device (or, emulated, the daemon).
 */
static bool layers_in_segments(const struct dimport *m, const struct kvbp_layout *y,
			       uint32_t layers, uint64_t k_span, uint64_t v_span)
{
	for (uint32_t l = 0; l < layers; l++)
		for (int side = 0; side < 2; side++) {
			uint64_t lo, hi, span = side ? v_span : k_span;
			bool in = false;

			if (ckd_mul_add(&lo, l, y->layer_stride, side ? y->v_offset : y->k_offset) ||
			    ckd_add(&hi, lo, span))
				return false;
			for (uint32_t k = 0; k < m->n_segs && !in; k++)
				in = lo >= m->segs[k].offset &&
				     /* ckd-ok: both at most 2^44 (shm.c checked them) */
				     hi <= m->segs[k].offset + m->segs[k].size;
			if (!in)
				return false;
		}
	return true;
}

uint32_t dland_setup(struct fuse_table *t, struct fuse_session *s, const struct kvbp_layout *y,
		     const char *owner, uint64_t end, uint64_t k_span, uint64_t v_span,
		     char *err, size_t errlen)
{
	const struct blend_device *dv = t->dev;
	struct dev_land *d;
	size_t half, np = 0;
	uint32_t code;

	if (!dv || (!dv->ipc_open && !dv->fd_open) || !dv->land || !dev_usable(t))
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "landing into device memory needs a "
			    "kvblendd whose fuse runs on a CUDA device (--device cuda or auto "
			    "with a GPU); this one has %s", dv ? "a device that cannot" : "none");
	if (y->k_dim_stride)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "landing into device memory: K by its "
			    "own element strides is a CPU cache's layout; give K as V");
	/* The land kernel writes 4-byte words at least (16 where everything allows). */
	if ((y->k_offset | y->v_offset | y->layer_stride | y->token_stride | y->head_stride |
	     y->page_stride | ((uint64_t)s->m.desc.head_dim * s->m.elem_size)) % 4)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "landing into device memory: offsets, "
			    "strides and a head's bytes must be multiples of 4");
	if (end > y->device_bytes)
		return fail(err, errlen, KVBP_BAD_SHAPE, "landing layout: it spans %" PRIu64
			    " bytes of the node's device allocation, whose size it gives as %"
			    PRIu64, end, y->device_bytes);
	d = calloc(1, sizeof(*d));
	if (!d)
		return fail(err, errlen, KVBP_LIMIT, "out of memory");
	s->dl = d;
	d->lay = *y;
	d->lay.pages = NULL;
	d->pending = -1;
	if (y->page_tokens) {
		np = ((size_t)s->n + y->page_tokens - 1) / y->page_tokens; /* ckd-ok: 32-bit */
		d->pages = malloc(np * sizeof(uint32_t));
		if (!d->pages)
			return fail(err, errlen, KVBP_LIMIT, "out of memory");
		memcpy(d->pages, y->pages, np * sizeof(uint32_t)); /* land_setup: n_pages >= np */
		d->n_pages = np;
	}
	code = import_take(t, y, owner, &d->imp, err, errlen);
	if (code)
		return code;
	if (end > d->imp->bytes)
		return fail(err, errlen, KVBP_BAD_SHAPE, "landing layout: it spans %" PRIu64
			    " bytes of the node's device allocation, which has %" PRIu64, end,
			    d->imp->bytes);
	if (d->imp->by_fd && !layers_in_segments(d->imp, y, s->m.desc.num_layers, k_span, v_span))
		return fail(err, errlen, KVBP_BAD_SHAPE, "landing layout: a layer's K or V "
			    "reaches past the segment of the node's memory it starts in (each "
			    "layer must lie in one segment it handed in)");
	/* ckd-ok: n < 2^32 tokens of row_bytes, both checked when the session opened */
	half = (size_t)s->n * s->row_bytes;
	d->rows_off = dev_align(2 * half); /* ckd-ok: as above */
	d->pages_off = d->rows_off + dev_align(((size_t)s->n + 1) * sizeof(int32_t)); /* ckd-ok */
	d->spans_off = d->pages_off + dev_align((np + 1) * sizeof(uint32_t)); /* ckd-ok */
	d->dblk_need = d->spans_off + dev_setup_bytes(s); /* ckd-ok: tables of the open's size */
	/* the host's rows and block table follow its second buffer */
	d->hstage_need = d->rows_off + d->dblk_need; /* ckd-ok: as above */
	return KVBP_OK;
}

void dland_bytes(const struct fuse_session *s, uint64_t *host, uint64_t *dev)
{
	*host = s->dl ? s->dl->hstage_need : 0;
	*dev = s->dl ? s->dl->dblk_need : 0;
}

/*
 * The chunks as spans of a layer and their rotation tables, written into the host's
 * mirror h of dblk's tail at spans_off (device pointers into dblk, as
 * dev_setup_upload() writes a device session's): the device re-rotates a layer's keys
 * in one launch, and the host only verifies and copies them.
 */
static void dland_spans(const struct fuse_session *s, struct dev_land *d, uint8_t *h)
{
	uint8_t *dbase = d->dblk + d->spans_off;
	size_t off = dev_align(rot_kinds(s) * (s->n_chunks + 1) * sizeof(struct blend_dev_span));
	uint32_t n = 0, rows = 0;

	for (size_t k = 0; k < rot_kinds(s); k++) {
		struct blend_dev_span *sp = (struct blend_dev_span *)h + k * (s->n_chunks + 1);

		n = rows = 0;
		for (size_t i = 0; i < s->n_chunks; i++) {
			const struct rope_table *r = &s->chunks[i].rot[k];
			size_t tb = (size_t)r->rows * r->half * sizeof(float);
			struct blend_dev_table tab = { (const float *)(dbase + off),
						       (const float *)(dbase + off + dev_align(tb)),
						       r->rows, r->scale };

			memcpy(h + off, r->cos, tb);
			memcpy(h + off + dev_align(tb), r->sin, tb);
			off += 2 * dev_align(tb);
			if (!s->chunks[i].tokens)
				continue;
			sp[n++] = (struct blend_dev_span){ tab, s->chunks[i].off, s->chunks[i].tokens,
							   rows };
			rows += s->chunks[i].tokens;
		}
	}
	d->dspans = (struct blend_dev_span *)dbase;
	d->n_spans = n;
	d->span_rows = rows;
}

uint32_t dland_alloc(struct fuse_table *t, struct fuse_session *s, char *err, size_t errlen)
{
	const struct blend_device *dv = t->dev;
	struct dev_land *d = s->dl;
	uint8_t *hrows;
	uint32_t r = 0;
	int rc;

	rc = block_take(t, true, d->hstage_need, (void **)&d->hstage, &d->hstage_bytes,
			&d->allocs, true);
	if (!rc)
		rc = block_take(t, false, d->dblk_need, (void **)&d->dblk, &d->dblk_bytes,
				&d->allocs, true);
	if (!rc)
		rc = dv->stream_new(dv, &d->st);
	if (!rc)
		rc = dv->event_new(dv, &d->ev[0]);
	if (!rc)
		rc = dv->event_new(dv, &d->ev[1]);
	if (rc)
		goto failed;
	/* The cached tokens: the rows the node's cache gets (its fresh ones it writes). */
	hrows = d->hstage + d->rows_off + d->rows_off;
	for (size_t i = 0; i < s->n_chunks; i++)
		for (uint32_t k = 0; k < s->chunks[i].tokens; k++)
			((int32_t *)hrows)[r++] = (int32_t)(s->chunks[i].off + k);
	d->n_rows = r;
	d->drows = (int32_t *)(d->dblk + d->rows_off);
	if (d->n_pages) {
		memcpy(hrows + (d->pages_off - d->rows_off), d->pages,
		       d->n_pages * sizeof(uint32_t));
		d->dpages = (uint32_t *)(d->dblk + d->pages_off);
	}
	dland_spans(s, d, hrows + (d->spans_off - d->rows_off));
	/* what was asked for, not the (possibly larger) cached blocks' sizes */
	rc = dv->upload(dv, d->st, d->dblk + d->rows_off, hrows, d->dblk_need - d->rows_off);
	if (!rc)
		rc = dv->stream_sync(dv, d->st);
	if (rc)
		goto failed;
	s->land_mem = dland_stage(s, s->land_begin);
	return KVBP_OK;
failed:
	d->failed = rc != -ENOMEM;
	return fail(err, errlen, rc == -ENOMEM ? KVBP_LIMIT : KVBP_INTERNAL,
		    "landing into device memory: staging for %" PRIu32 " tokens: %s", s->n,
		    rc == -ENOMEM ? "out of device or pinned memory" : "the device failed");
}

uint8_t *dland_stage(const struct fuse_session *s, uint32_t l)
{
	/* ckd-ok: the staging holds two buffers of rows_off bytes (dland_setup) */
	return s->dl->hstage + (size_t)(l % 2) * s->dl->rows_off;
}

int dland_layer(struct fuse_table *t, struct fuse_session *s, uint32_t l, bool raw,
		uint32_t *done)
{
	const struct blend_device *dv = t->dev;
	struct dev_land *d = s->dl;
	const struct kvbp_layout *y = &d->lay;
	size_t half = (size_t)s->n * s->row_bytes;
	/* ckd-ok: l < layers, offsets inside the allocation (land_setup's extent) */
	uint8_t *base = (uint8_t *)d->imp->base + (uint64_t)l * y->layer_stride;
	/* ckd-ok: offsets inside the allocation, whose extent land_setup checked */
	struct blend_dev_land L = { base + y->k_offset, y->token_stride, y->head_stride,
				    y->page_stride, y->page_tokens, d->dpages,
				    s->land_h0, s->land_hn };
	const uint8_t *h = dland_stage(s, l);
	struct blend_shape sh = s->shape;
	size_t hb = (size_t)s->m.desc.head_dim * s->m.elem_size, up = half;
	int rc;

	/* Queued behind the previous layer's kernels on the one stream (one device buffer). */
	if (s->land_hn < s->m.desc.num_kv_heads) {
		/* A rank's head range: only its heads of each row go up, packed (a rank of t
		 * moves 1/t of the layer), and are rotated and landed as rows of those heads. */
		size_t w = (size_t)s->land_hn * hb, off = (size_t)s->land_h0 * hb;

		up = (size_t)s->n * w;
		sh.heads = s->land_hn;
		L.head0 = 0;
		rc = dv->upload2d(dv, d->st, d->dblk, w, h + off, s->row_bytes, w, s->n);
		if (!rc)
			rc = dv->upload2d(dv, d->st, d->dblk + up, w, h + half + off, s->row_bytes,
					  w, s->n);
	} else {
		rc = dv->upload(dv, d->st, d->dblk, h, 2 * half);
	}
	if (!rc && raw && d->n_spans)
		rc = dv->rotate_spans(dv, d->st, &sh, d->dspans + rot_kind(s, l) * (s->n_chunks + 1),
				      d->n_spans, d->span_rows, d->dblk);
	if (!rc)
		rc = dv->land(dv, d->st, &sh, &L, d->dblk, d->drows, d->n_rows);
	L.dst = base + y->v_offset; /* ckd-ok: as above */
	if (!rc)
		rc = dv->land(dv, d->st, &sh, &L, d->dblk + up, d->drows, d->n_rows);
	if (!rc)
		rc = dv->event_record(dv, d->ev[l % 2], d->st);
	if (rc) {
		d->failed = true;
		return dev_rc(rc);
	}
	/* The previous layer, landing while this one was read from the store, is in place
	 * now (and its host buffer free for the next layer); the last layer waits for
	 * itself. */
	*done = l;
	if (d->pending >= 0) {
		rc = dv->event_sync(dv, d->ev[d->pending % 2]);
		if (rc) {
			d->failed = true;
			return dev_rc(rc);
		}
	}
	d->pending = l;
	if (l + 1 == s->m.desc.num_layers) {
		rc = dv->event_sync(dv, d->ev[l % 2]);
		if (rc) {
			d->failed = true;
			return dev_rc(rc);
		}
		d->pending = -1;
		*done = l + 1;
	}
	return 0;
}

uint32_t dland_quiesce(struct fuse_table *t, struct fuse_session *s, uint32_t next)
{
	struct dev_land *d = s->dl;
	int64_t pending = d->pending;

	if (!d->st)
		return next;
	d->pending = -1;
	if (t->dev->stream_sync(t->dev, d->st)) {
		d->failed = true;
		/* what was queued may not have run: the layer pending is not in place */
		return pending >= 0 && (uint64_t)pending < next ? (uint32_t)pending : next;
	}
	return next;
}

void dland_free(struct fuse_table *t, struct fuse_session *s)
{
	const struct blend_device *dv = t->dev;
	struct dev_land *d = s->dl;

	if (!d)
		return;
	if (d->st && dv->stream_sync(dv, d->st))
		d->failed = true;
	for (int i = 0; i < 2; i++)
		if (d->ev[i])
			dv->event_free(dv, d->ev[i]);
	if (d->st)
		dv->stream_free(dv, d->st);
	if (d->failed) {
		block_free_later(t, true, d->hstage, d->hstage_bytes);
		block_free_later(t, false, d->dblk, d->dblk_bytes);
	} else {
		block_give(t, true, d->hstage, d->hstage_bytes);
		block_give(t, false, d->dblk, d->dblk_bytes);
	}
	import_put(t, d->imp);
	free(d->pages);
	free(d);
	s->dl = NULL;
}
