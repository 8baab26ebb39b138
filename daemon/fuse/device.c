/* fuse/device — the device path: a session's ring in device memory; see fuse_impl.h. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/arena.h"
#include "daemon/fuse/fuse_impl.h"
#include "blend/hkvd.h"
#include "daemon/log.h"

/* Why a load or a kernel failed: the device's own message for DEV_FAILED, else the errno's. */
const char *compute_error(const struct fuse_table *t, int rc, char *buf, size_t len)
{
	char dev[128];

	if (rc != DEV_FAILED || !t->dev)
		return strerror(-rc);
	t->dev->last_error(t->dev, dev, sizeof(dev));
	snprintf(buf, len, "the %s device failed (%s)", t->dev->name, dev);
	return buf;
}

const char *load_error(const struct fuse_table *t, int rc, char *buf, size_t len)
{
	if (rc == -EBADMSG)
		return "a chunk failed its checksum";
	if (rc == -ENOTSUP)
		return "a chunk is quantized other than one row per token, which a fuse session "
		       "cannot read (GET can; the chunk is sound and kept)";
	return compute_error(t, rc, buf, len);
}

bool dev_usable(struct fuse_table *t)
{
	bool first;
	char why[128];

	if (!t->dev)
		return false;
	if (!t->dev->broken(t->dev))
		return true;
	pthread_mutex_lock(&t->lock);
	first = !t->dev_down;
	t->dev_down = true;
	pthread_mutex_unlock(&t->lock);
	if (first) {
		t->dev->last_error(t->dev, why, sizeof(why));
		log_err("the %s device failed for good (%s): new fuse sessions run on the CPU "
			"until kvblendd restarts", t->dev->name, why);
		block_flush(t); /* nothing will take these blocks again */
	}
	return false;
}

/* The shared-memory table's pinner (shm.h): the device's host_register, counted. */
static int ring_pin(void *ctx, void *base, size_t bytes)
{
	struct fuse_table *t = ctx;
	int rc = t->dev->host_register(t->dev, base, bytes);

	if (!rc)
		atomic_fetch_add(&t->n_registrations, 1);
	return rc;
}

static void ring_unpin(void *ctx, void *base)
{
	struct fuse_table *t = ctx;

	t->dev->host_unregister(t->dev, base);
	atomic_fetch_add(&t->n_unregistrations, 1);
}

void dev_pinner_set(struct fuse_table *t, bool on)
{
	struct shm_pinner p = { ring_pin, ring_unpin, t };

	if (t->dev && t->shm)
		shm_set_pinner(t->shm, on ? &p : NULL);
}

/*
 * The array arr (n elements used of *cap, elem bytes each) with room for one more:
 * arr itself, or arr grown by doubling (from 8), *cap updated; NULL when out of
 * memory (arr unchanged, still the caller's). The lists of reaped and cached blocks
 * and of pooled streams grow through here, under the table lock.
 */
static void *room_for_one(void *arr, size_t n, size_t *cap, size_t elem)
{
	size_t want = *cap ? 2 * *cap : 8;
	void *p;

	if (n < *cap)
		return arr;
	p = realloc(arr, want * elem);
	if (p)
		*cap = want;
	return p;
}

/* The reserve's arena p was carved from (host: pinned), or NULL. */
static struct arena *arena_of(const struct fuse_table *t, bool host, const void *p)
{
	struct arena *a = t->arena[host];

	return p && a && arena_owns(a, p) ? a : NULL;
}

void dev_reserve_open(struct fuse_table *t)
{
	const struct blend_device *d = t->dev;
	size_t bytes = (size_t)t->lim.dev_reserve;
	int rc = 0;

	if (!d || !bytes)
		return;
	for (int host = 0; host < 2 && !rc; host++) {
		rc = host ? d->host_alloc(d, bytes, &t->reserve[1]) :
			    d->alloc(d, bytes, &t->reserve[0]);
		if (!rc)
			rc = arena_new(t->reserve[host], bytes, DEV_ALIGN, &t->arena[host]);
	}
	if (rc) {
		log_warn("fuse_device_reserve %zu: cannot reserve that much %s memory (%s): "
			 "sessions' blocks are allocated as they open", bytes,
			 t->reserve[0] ? "pinned host" : "device", strerror(-rc));
		dev_reserve_close(t);
		return;
	}
	log_info("fuse: %zu bytes of device memory and as many of pinned host memory reserved "
		 "for sessions' blocks", bytes);
}

void dev_reserve_close(struct fuse_table *t)
{
	for (int host = 0; host < 2; host++)
		arena_free(&t->arena[host]);
	if (t->reserve[0])
		t->dev->free(t->dev, t->reserve[0], (size_t)t->lim.dev_reserve);
	if (t->reserve[1])
		t->dev->host_free(t->dev, t->reserve[1]);
	t->reserve[0] = t->reserve[1] = NULL;
}

/* Give a block back to the device, or to the reserve it came from (NULL: nothing). */
static void block_free(struct fuse_table *t, bool host, void *p, size_t bytes)
{
	struct arena *a = arena_of(t, host, p);

	if (a) { /* bookkeeping only: no device call */
		pthread_mutex_lock(&t->lock);
		arena_give(a, p);
		pthread_mutex_unlock(&t->lock);
	} else if (p && host)
		t->dev->host_free(t->dev, p);
	else if (p)
		t->dev->free(t->dev, p, bytes);
}

/*
 * A block given up on a session's path (open, close): freed by the next block_reap(),
 * off that path. Freed here only when the list cannot grow.
 */
void block_free_later(struct fuse_table *t, bool host, void *p, size_t bytes)
{
	struct dblock *r;

	if (!p)
		return;
	if (arena_of(t, host, p)) { /* back to the reserve: nothing stalls */
		block_free(t, host, p, bytes);
		return;
	}
	pthread_mutex_lock(&t->lock);
	r = room_for_one(t->reap, t->n_reap, &t->cap_reap, sizeof(*r));
	if (r) {
		t->reap = r;
		t->reap[t->n_reap++] = (struct dblock){ p, bytes, host };
		p = NULL;
	}
	pthread_mutex_unlock(&t->lock);
	if (p)
		block_free(t, host, p, bytes);
}

/* Free the blocks of list[0..n) and the list. */
static void blocks_free(struct fuse_table *t, struct dblock *list, size_t n)
{
	for (size_t i = 0; i < n; i++)
		block_free(t, list[i].host, list[i].p, list[i].bytes);
	free(list);
}

void block_reap(struct fuse_table *t)
{
	struct dblock *r;
	size_t n;

	if (!t->dev)
		return;
	pthread_mutex_lock(&t->lock);
	r = t->reap;
	n = t->n_reap;
	t->reap = NULL;
	t->n_reap = t->cap_reap = 0;
	pthread_mutex_unlock(&t->lock);
	blocks_free(t, r, n);
}

/* Drop every cached block, and free those waiting for block_reap(). */
void block_flush(struct fuse_table *t)
{
	struct dblock *c;
	size_t n;

	pthread_mutex_lock(&t->lock);
	c = t->cache;
	n = t->n_cache;
	t->cache = NULL;
	t->n_cache = t->cap_cache = 0;
	t->cached = t->cached_dev = 0;
	t->n_want = 0; /* short of memory: no spares either */
	pthread_mutex_unlock(&t->lock);
	blocks_free(t, c, n);
	block_reap(t);
}

/* Free one set of streams and events (what a failed take left too). */
static void streams_free(const struct blend_device *dv, struct dev_streams *ds)
{
	for (uint32_t i = 0; ds->ev && i < ds->n_ev; i++)
		if (ds->ev[i])
			dv->event_free(dv, ds->ev[i]);
	if (ds->comp)
		dv->stream_free(dv, ds->comp);
	if (ds->copy)
		dv->stream_free(dv, ds->copy);
	free(ds->ev);
	memset(ds, 0, sizeof(*ds));
}

/*
 * A session's streams and n_ring events: a pooled set (of a closed session), else a
 * new one with room for the longest ring (fuse_ring + 1), so that any session can
 * take it next. On failure d holds what was made, for dev_sess_free().
 */
static int streams_take(struct fuse_table *t, uint32_t n_ring, struct dev_sess *d)
{
	const struct blend_device *dv = t->dev;
	struct dev_streams ds = { 0 };
	bool pooled = false;
	int rc = 0;

	pthread_mutex_lock(&t->lock);
	for (size_t i = 0; i < t->n_spool && !pooled; i++)
		if (t->spool[i].n_ev >= n_ring) {
			ds = t->spool[i];
			t->spool[i] = t->spool[--t->n_spool];
			pooled = true;
		}
	pthread_mutex_unlock(&t->lock);
	if (!pooled) {
		ds.n_ev = t->lim.ring + 1 > n_ring ? (uint32_t)t->lim.ring + 1 : n_ring;
		ds.ev = calloc(ds.n_ev, sizeof(*ds.ev));
		if (!ds.ev)
			return -ENOMEM;
		rc = dv->stream_new(dv, &ds.copy);
		if (!rc)
			rc = dv->stream_new(dv, &ds.comp);
		for (uint32_t i = 0; !rc && i < ds.n_ev; i++)
			rc = dv->event_new(dv, &ds.ev[i]);
	}
	d->copy = ds.copy;
	d->comp = ds.comp;
	d->loaded = ds.ev;
	d->n_loaded = ds.n_ev;
	return rc;
}

/* Keep a session's streams and events for the next session (idle: synced), up to one
 * set per session the table holds; else, or after a device failure, free them. */
static void streams_give(struct fuse_table *t, struct dev_sess *d, bool failed)
{
	struct dev_streams ds = { d->copy, d->comp, d->loaded, d->n_loaded };

	d->copy = d->comp = NULL;
	d->loaded = NULL;
	d->n_loaded = 0;
	if (!ds.copy && !ds.comp && !ds.ev)
		return;
	pthread_mutex_lock(&t->lock);
	if (!failed && ds.copy && ds.comp && ds.ev && t->n_spool < t->lim.max_sessions) {
		struct dev_streams *sp = room_for_one(t->spool, t->n_spool, &t->cap_spool,
						      sizeof(*sp));

		if (sp) {
			t->spool = sp;
			t->spool[t->n_spool++] = ds;
			ds.ev = NULL;
			ds.copy = ds.comp = NULL;
		}
	}
	pthread_mutex_unlock(&t->lock);
	streams_free(t->dev, &ds);
}

void dev_streams_flush(struct fuse_table *t)
{
	for (size_t i = 0; i < t->n_spool; i++)
		streams_free(t->dev, &t->spool[i]);
	free(t->spool);
	t->spool = NULL;
	t->n_spool = t->cap_spool = 0;
}

/*
 * An exported block of a session that expired: its node never said it unmapped it,
 * and a block freed under a mapping is undefined behaviour (and its memory could
 * serve a later session under the node's eyes). Kept, charged to the device
 * budget, until exit.
 */
static void block_orphan(struct fuse_table *t, struct fuse_session *s, void *p, size_t bytes)
{
	struct dblock *o;

	if (!p)
		return;
	log_warn("fuse session %016" PRIx64 " expired with its device ring exported: the ring "
		 "(%zu bytes) stays allocated until kvblendd exits, since its node may still map "
		 "it; nodes must close their sessions", s->id, bytes);
	pthread_mutex_lock(&t->lock);
	o = realloc(t->orphans, (t->n_orphans + 1) * sizeof(*o));
	if (o) { /* else never freed: still not under a mapping */
		t->orphans = o;
		o[t->n_orphans++] = (struct dblock){ p, bytes, false };
	}
	t->dev_bytes += bytes;
	pthread_mutex_unlock(&t->lock);
}

void block_orphans_free(struct fuse_table *t)
{
	for (size_t i = 0; i < t->n_orphans; i++)
		block_free(t, false, t->orphans[i].p, t->orphans[i].bytes);
	free(t->orphans);
	t->orphans = NULL;
	t->n_orphans = 0;
}


/* Note that a session's open had to allocate bytes (host: pinned), for block_spares(). */
static void want_spare(struct fuse_table *t, bool host, size_t bytes)
{
	size_t n = sizeof(t->want) / sizeof(t->want[0]);

	pthread_mutex_lock(&t->lock);
	for (size_t i = 0; i < t->n_want; i++)
		if (t->want[i].host == host && t->want[i].bytes == bytes)
			goto out;
	if (t->n_want == n) /* the oldest goes */
		t->n_want--;
	memmove(&t->want[1], &t->want[0], t->n_want * sizeof(t->want[0]));
	t->want[0] = (struct dblock){ NULL, bytes, host };
	t->n_want++;
out:
	pthread_mutex_unlock(&t->lock);
}

void block_spares(struct fuse_table *t)
{
	struct dblock want[sizeof(t->want) / sizeof(t->want[0])];
	size_t n;

	if (!t->dev || t->dev->broken(t->dev))
		return;
	pthread_mutex_lock(&t->lock);
	n = t->n_want;
	memcpy(want, t->want, n * sizeof(want[0]));
	t->n_want = 0;
	pthread_mutex_unlock(&t->lock);
	for (size_t i = 0; i < n; i++) {
		bool host = want[i].host, fits;
		size_t bytes = want[i].bytes;
		void *p = NULL;

		pthread_mutex_lock(&t->lock);
		fits = host ? t->bytes + (t->cached - t->cached_dev) + bytes <= t->lim.max_bytes
			    : t->dev_bytes + t->cached_dev + bytes <= t->dev_budget;
		pthread_mutex_unlock(&t->lock);
		if (!fits || (host ? t->dev->host_alloc(t->dev, bytes, &p) :
				     t->dev->alloc(t->dev, bytes, &p)))
			continue; /* no room: the next session allocates, as before */
		atomic_fetch_add(&t->n_spares, 1);
		block_give(t, host, p, bytes);
	}
}

/*
 * A block of at least bytes (device, or pinned host memory): a cached one of up to
 * 1.25 times that, else one carved from the reserve (unless reserve is false), else a
 * new one (after dropping the cache if the device is full), counted in *allocs and the
 * table's allocations. *got: its real size, which the session is charged.
 */
int block_take(struct fuse_table *t, bool host, size_t bytes, void **out, size_t *got,
	       uint32_t *allocs, bool reserve)
{
	const struct blend_device *d = t->dev;
	struct dblock *best = NULL;
	int rc;

	/* The smallest that fits: a larger one may be what the session's next block needs
	 * (its ring and its staging can be of similar sizes). */
	pthread_mutex_lock(&t->lock);
	for (size_t i = 0; i < t->n_cache; i++) {
		struct dblock *b = &t->cache[i];

		if (b->host == host && b->bytes >= bytes && b->bytes - bytes <= bytes / 4 &&
		    (!best || b->bytes < best->bytes))
			best = b;
	}
	if (best) {
		*out = best->p;
		*got = best->bytes;
		t->cached -= best->bytes;
		if (!host)
			t->cached_dev -= best->bytes;
		*best = t->cache[--t->n_cache];
		pthread_mutex_unlock(&t->lock);
		return 0;
	}
	if (reserve && t->arena[host] && arena_take(t->arena[host], bytes, out, got) == 0) {
		pthread_mutex_unlock(&t->lock);
		return 0;
	}
	pthread_mutex_unlock(&t->lock);
	for (int pass = 0; pass < 2; pass++) {
		rc = host ? d->host_alloc(d, bytes, out) : d->alloc(d, bytes, out);
		if (rc != -ENOMEM || pass)
			break;
		block_flush(t);
	}
	if (!rc) {
		*got = bytes;
		(*allocs)++;
		atomic_fetch_add(&t->n_allocs, 1);
		want_spare(t, host, bytes);
	}
	return rc;
}

/* Whether the cache holds more than its budgets allow (under the table lock). */
static bool over_budget(const struct fuse_table *t)
{
	return t->bytes + (t->cached - t->cached_dev) > t->lim.max_bytes ||
	       t->dev_bytes + t->cached_dev > t->dev_budget;
}

/*
 * Drop cached blocks until sessions and cache together fit: host blocks in
 * fuse_max_bytes, device blocks in the device budget.
 */
void block_trim(struct fuse_table *t)
{
	struct dblock *drop = NULL;
	size_t n = 0;

	pthread_mutex_lock(&t->lock);
	if (t->n_cache && over_budget(t))
		drop = malloc(t->n_cache * sizeof(*drop));
	while (drop && t->n_cache && over_budget(t)) {
		drop[n] = t->cache[--t->n_cache];
		t->cached -= drop[n].bytes;
		if (!drop[n].host)
			t->cached_dev -= drop[n].bytes;
		n++;
	}
	pthread_mutex_unlock(&t->lock);
	for (size_t i = 0; i < n; i++) /* a session is opening: not here */
		block_free_later(t, drop[i].host, drop[i].p, drop[i].bytes);
	free(drop);
}

/*
 * Keep a block for the next session while sessions and cache together stay within
 * their budget: fuse_max_bytes for host blocks, the device's for device blocks
 * (block_trim() keeps it so as sessions open).
 */
void block_give(struct fuse_table *t, bool host, void *p, size_t bytes)
{
	bool fits;

	if (!p)
		return;
	if (arena_of(t, host, p)) { /* the reserve is the pool: back there, no cache needed */
		block_free(t, host, p, bytes);
		return;
	}
	pthread_mutex_lock(&t->lock);
	fits = host ? t->bytes + (t->cached - t->cached_dev) + bytes <= t->lim.max_bytes
		    : t->dev_bytes + t->cached_dev + bytes <= t->dev_budget;
	if (fits) {
		struct dblock *c = room_for_one(t->cache, t->n_cache, &t->cap_cache, sizeof(*c));

		if (c) {
			t->cache = c;
			t->cache[t->n_cache++] = (struct dblock){ p, bytes, host };
			t->cached += bytes;
			if (!host)
				t->cached_dev += bytes;
			pthread_mutex_unlock(&t->lock);
			return;
		}
	}
	pthread_mutex_unlock(&t->lock);
	block_free_later(t, host, p, bytes);
}

/* Bytes of the chunks' spans and rotation tables, which end a session's device block. */
size_t dev_setup_bytes(const struct fuse_session *s)
{
	size_t off = dev_align(rot_kinds(s) * (s->n_chunks + 1) * sizeof(struct blend_dev_span));

	for (size_t k = 0; k < rot_kinds(s); k++)
		for (size_t i = 0; i < s->n_chunks; i++) {
			const struct rope_table *r = &s->chunks[i].rot[k];

			off += 2 * dev_align((size_t)r->rows * r->half * sizeof(float));
		}
	return off;
}

/* Carve (or, with base NULL, only measure) a session's device block; returns its size. */
size_t dev_layout(const struct fuse_session *s, struct dev_sess *d, uint8_t *base)
{
	size_t off = 0, n = s->n, rb = s->row_bytes;

#define CARVE(field, type, bytes)                                                 \
	do {                                                                      \
		if (base)                                                         \
			d->field = (type)(base + off);                            \
		off += dev_align(bytes);                                          \
	} while (0)
	CARVE(ring, uint8_t *, (size_t)s->n_ring * 2 * n * rb);
	CARVE(fk, uint8_t *, n * rb);
	CARVE(fv, uint8_t *, n * rb);
	CARVE(idx, int32_t *, (n + 1) * sizeof(int32_t));
	CARVE(cand, int32_t *, (n + 1) * sizeof(int32_t));
	CARVE(always, int32_t *, (n + 1) * sizeof(int32_t));
	CARVE(sel, int32_t *, (n + 1) * sizeof(int32_t));
	CARVE(out, int32_t *, (n + 1) * sizeof(int32_t));
	CARVE(dev, float *, (n + 1) * sizeof(float));
	CARVE(cdev, float *, (n + 1) * sizeof(float));
	CARVE(scratch, uint8_t *, d->scratch_bytes);
	CARVE(spans, struct blend_dev_span *,
	      rot_kinds(s) * (s->n_chunks + 1) * sizeof(struct blend_dev_span));
#undef CARVE
	for (size_t k = 0; k < rot_kinds(s); k++)
		for (size_t i = 0; i < s->n_chunks; i++) {
			const struct rope_table *r = &s->chunks[i].rot[k];
			size_t tb = (size_t)r->rows * r->half * sizeof(float);
			struct blend_dev_table *dt = &d->tabs[k * (s->n_chunks + 1) + i];

			if (base) {
				dt->cos = (const float *)(base + off);
				dt->sin = (const float *)(base + off + dev_align(tb));
				dt->rows = r->rows;
				dt->scale = r->scale;
			}
			off += 2 * dev_align(tb);
		}
	return off;
}

void dev_drop(struct fuse_session *s)
{
	if (!s->dv)
		return;
	free(s->dv->tabs);
	free(s->dv);
	s->dv = NULL;
}

void dev_sess_free(struct fuse_table *t, struct fuse_session *s)
{
	struct dev_sess *d = s->dv;
	bool failed = false;

	if (!d)
		return;
	/* Nothing may still be running on what goes back to the cache; after a device
	 * failure nothing goes back (the blocks are freed). */
	if (d->comp)
		failed |= t->dev->stream_sync(t->dev, d->comp) != 0;
	if (d->copy)
		failed |= t->dev->stream_sync(t->dev, d->copy) != 0;
	streams_give(t, d, failed);
	/* A shared ring stays pinned: the segment is, for its life (shm_pin). */
	/* A block the node mapped stays readable there: it must not serve another session,
	 * nor be freed while the node of an expired session may map it still. */
	if (d->exported && s->expired)
		block_orphan(t, s, d->blk, d->blk_bytes);
	else if (d->exported || failed) /* the node unmapped it before its close */
		block_free_later(t, false, d->blk, d->blk_bytes);
	else
		block_give(t, false, d->blk, d->blk_bytes);
	if (failed) {
		block_free_later(t, true, d->hring, d->hring_bytes);
		block_free_later(t, true, d->hstage, d->hstage_bytes);
	} else {
		block_give(t, true, d->hring, d->hring_bytes);
		block_give(t, true, d->hstage, d->hstage_bytes);
	}
	free(d->tabs);
	free(d);
	s->dv = NULL;
}

/* Carve (or, with base NULL, only measure) the pinned staging; returns its size. */
static size_t stage_layout(const struct fuse_session *s, struct dev_sess *d, uint8_t *base)
{
	size_t off = 0, n = s->n, rb = s->row_bytes;

#define CARVE(field, type, bytes)                                                 \
	do {                                                                      \
		if (base)                                                         \
			d->field = (type)(base + off);                            \
		off += dev_align(bytes);                                          \
	} while (0)
	CARVE(hk, uint8_t *, n * rb);
	CARVE(hv, uint8_t *, n * rb);
	CARVE(hidx, int32_t *, (n + 1) * sizeof(int32_t));
	CARVE(hcand, int32_t *, (n + 1) * sizeof(int32_t));
	CARVE(hsel, int32_t *, (n + 1) * sizeof(int32_t));
	CARVE(hdev, float *, (n + 1) * sizeof(float));
	CARVE(halways, int32_t *, (s->n_fresh + 1) * sizeof(int32_t));
	CARVE(hspans, uint8_t *, dev_setup_bytes(s));
#undef CARVE
	return off;
}

/*
 * The fresh tokens, the chunks as spans of a layer and their rotation tables, staged
 * in pinned memory (copies from pageable memory block the thread and run at a
 * fraction of PCIe speed) and uploaded in two copies on the compute stream: the
 * spans and the tables end the device block, in the layout dev_layout() gives them,
 * and the staging mirrors it. The caller syncs the stream before the staging is
 * used again.
 */
static int dev_setup_upload(const struct blend_device *dv, const struct fuse_session *s,
			    struct dev_sess *d)
{
	uint32_t n = 0, rows = 0;
	int rc;

	if (s->n_fresh)
		memcpy(d->halways, s->fresh, s->n_fresh * sizeof(int32_t));
	for (size_t k = 0; k < rot_kinds(s); k++) {
		struct blend_dev_span *sp = (struct blend_dev_span *)d->hspans + k * (s->n_chunks + 1);

		n = rows = 0;
		for (size_t i = 0; i < s->n_chunks; i++) {
			const struct rope_table *r = &s->chunks[i].rot[k];
			const struct blend_dev_table *dt = &d->tabs[k * (s->n_chunks + 1) + i];
			size_t tb = (size_t)r->rows * r->half * sizeof(float);
			uint8_t *h = d->hspans + ((const uint8_t *)dt->cos - (uint8_t *)d->spans);

			memcpy(h, r->cos, tb);
			memcpy(h + ((const uint8_t *)dt->sin - (const uint8_t *)dt->cos), r->sin, tb);
			if (!s->chunks[i].tokens)
				continue;
			sp[n] = (struct blend_dev_span){ *dt, s->chunks[i].off, s->chunks[i].tokens,
							 rows };
			rows += s->chunks[i].tokens;
			n++;
		}
	}
	d->n_spans = n;
	d->span_rows = rows;
	rc = dv->upload(dv, d->comp, d->always, d->halways, s->n_fresh * sizeof(int32_t));
	if (!rc)
		rc = dv->upload(dv, d->comp, d->spans, d->hspans, dev_setup_bytes(s));
	return rc;
}

/*
 * The device half of a session's open: the host ring (pinned from the cache, or the
 * shared segment at s->ring_mem pinned in place), streams, events, the device
 * block (zeroed first when the node is to map it: a cached block holds another
 * session's rows), and the rotation tables and fresh tokens uploaded.
 */
int dev_sess_setup(struct fuse_table *t, struct fuse_session *s, size_t ring_bytes,
		   bool zero)
{
	const struct blend_device *dv = t->dev;
	struct dev_sess *d = s->dv;
	int rc = 0;

	if (!s->ring_mem) {
		rc = block_take(t, true, ring_bytes, (void **)&d->hring, &d->hring_bytes,
				&d->allocs, true);
		if (rc)
			return dev_rc(rc);
		s->ring_mem = d->hring;
		/* Fresh tokens' rows are never read from a chunk: zero them, and only them
		 * (every load writes every chunk row of its slot; a block from the cache
		 * holds another session's rows). */
		for (uint32_t i = 0; i < s->n_ring; i++) {
			uint8_t *k = d->hring + (size_t)i * 2 * s->n * s->row_bytes;

			for (uint32_t f = 0; f < s->n_fresh; f++) {
				memset(k + (size_t)s->fresh[f] * s->row_bytes, 0, s->row_bytes);
				memset(k + ((size_t)s->n + s->fresh[f]) * s->row_bytes, 0,
				       s->row_bytes);
			}
		}
		d->zeroed = (uint64_t)s->n_ring * 2 * s->n_fresh * s->row_bytes;
	} else if (s->shm_id) {
		/* Pinned in place once for the segment's life: a ring its owner's last session
		 * left in the cache is pinned already. Unpinned, the copies still work, only
		 * slower: not a reason to refuse. */
		d->registered = shm_pin(t->shm, s->shm_id, &d->reg_fresh) == 0;
		d->reg_bytes = ring_bytes;
	}
	rc = block_take(t, true, stage_layout(s, d, NULL), (void **)&d->hstage, &d->hstage_bytes,
			&d->allocs, true);
	if (rc)
		return dev_rc(rc);
	stage_layout(s, d, d->hstage);
	rc = streams_take(t, s->n_ring, d);
	if (!rc)
		rc = block_take(t, false, d->blk_bytes, (void **)&d->blk, &d->blk_bytes, &d->allocs,
				!zero); /* a node maps an exported block's whole allocation */
	if (rc)
		return dev_rc(rc);
	dev_layout(s, d, d->blk);
	if (zero)
		rc = dv->zero(dv, d->comp, d->blk, d->blk_bytes);
	if (!rc)
		rc = dev_setup_upload(dv, s, d);
	if (!rc)
		rc = dv->stream_sync(dv, d->comp); /* the staging is read by the copies till then */
	return dev_rc(rc);
}

struct raw_job {
	struct fuse_table *t;
	struct fuse_session *s;
	struct slot *slot;
	uint32_t layer;
};

/* Chunk i's rows of a layer into the host slot, verified, as stored (no rotation). */
static int load_chunk_raw(void *arg, size_t i)
{
	struct raw_job *j = arg;
	struct fuse_session *s = j->s;
	struct chunk_ref *c = &s->chunks[i];
	int rc = store_chunk_get_layer(j->t->store, &s->m, c->hash, j->layer,
				       j->slot->k + (size_t)c->off * s->row_bytes,
				       j->slot->v + (size_t)c->off * s->row_bytes,
				       (uint64_t)c->tokens * s->row_bytes, NULL);

	if (rc == -EBADMSG)
		atomic_store(&c->corrupt, true);
	return rc;
}

/* Load layer into ring slot sl on the device: read here, copied and re-rotated there. */
int dev_load(struct fuse_table *t, struct fuse_session *s, struct slot *sl, uint32_t layer)
{
	const struct blend_device *dv = t->dev;
	struct dev_sess *d = s->dv;
	size_t i = (size_t)(sl - s->ring);
	uint8_t *dk = d->ring + i * d->slot_bytes;
	struct raw_job j = { t, s, sl, layer };
	int rc;

	/* The slot's last copy to the device must be done before its host rows change. */
	rc = dv->event_sync(dv, d->loaded[i]);
	if (rc)
		return dev_rc(rc);
	rc = pool_run(t->pool, s->n_chunks, load_chunk_raw, &j);
	if (rc)
		return rc; /* the store's errno */
	rc = dv->upload(dv, d->copy, dk, sl->k, d->slot_bytes);
	/* Every chunk's keys in one launch (a launch per chunk costs more than the work of
	 * a short chunk). */
	if (!rc)
		rc = dv->rotate_spans(dv, d->copy, &s->shape,
				      d->spans + rot_kind(s, layer) * (s->n_chunks + 1), d->n_spans,
				      d->span_rows, dk);
	if (!rc)
		rc = dv->event_record(dv, d->loaded[i], d->copy);
	return dev_rc(rc);
}


/*
 * HKVD on the device at the session's next check layer, with the node's rows
 * already in d->fk, d->fv and the stored layer in dk: as check_select() does on the
 * host, its host arrays in the pinned staging. *sel is malloc'd.
 */
static int dev_select(struct fuse_table *t, struct fuse_session *s, const uint8_t *dk,
		      int32_t **sel_out, size_t *n_out)
{
	const struct blend_device *dv = t->dev;
	struct dev_sess *d = s->dv;
	size_t rows = s->next_check == 0 ? s->n : s->n_sel, n_cand, n_sel = 0;
	const uint8_t *plane = s->metric ? dk : dk + (size_t)s->n * s->row_bytes;
	int32_t *idx = d->hidx, *cand = d->hcand;
	float *dev = d->hdev;
	int32_t *sel = malloc((s->n + 1) * sizeof(int32_t));
	int rc = -ENOMEM;

	if (!sel)
		return rc;
	for (size_t i = 0; i < rows; i++)
		idx[i] = s->next_check == 0 ? (int32_t)i : s->sel[i];
	rc = dv->upload(dv, d->comp, d->idx, idx, rows * sizeof(int32_t));
	if (!rc)
		rc = dv->deviation(dv, d->comp, &s->shape, s->metric ? d->fk : d->fv, plane, d->idx,
				   rows, d->dev);
	if (!rc)
		rc = dv->download(dv, d->comp, dev, d->dev, rows * sizeof(float));
	if (!rc)
		rc = dv->stream_sync(dv, d->comp);
	if (rc)
		goto out;
	n_cand = candidates(s, idx, rows, dev, cand);
	rc = dv->upload(dv, d->comp, d->cand, cand, n_cand * sizeof(int32_t));
	if (!rc)
		rc = dv->upload(dv, d->comp, d->cdev, dev, n_cand * sizeof(float));
	if (!rc)
		rc = dv->select(dv, d->comp, d->cand, d->cdev, n_cand,
				hkvd_count(s->ratios[s->next_check], s->n_cached), d->always,
				s->n_fresh, d->out, d->scratch, d->scratch_bytes, &n_sel);
	if (!rc)
		rc = dv->download(dv, d->comp, d->hsel, d->out, n_sel * sizeof(int32_t));
	/* The staged arrays above are read by queued copies until this returns. */
	if (!rc)
		rc = dv->stream_sync(dv, d->comp);
	if (!rc)
		memcpy(sel, d->hsel, n_sel * sizeof(int32_t));
out:
	if (rc) {
		free(sel);
		return rc;
	}
	*sel_out = sel;
	*n_out = n_sel;
	return 0;
}

/* Whether [p, p + n) lies in the session's shared ring pinned in place. */
static bool in_registered(const struct fuse_session *s, const void *p, size_t n)
{
	uintptr_t b = (uintptr_t)s->ring_mem, x = (uintptr_t)p;

	return s->dv->registered && x >= b && x - b <= s->dv->reg_bytes &&
	       n <= s->dv->reg_bytes - (x - b);
}

/*
 * The node's layer on the device (fuse_layer_run's work for a device session):
 * rows_in fresh rows up, the selection at a check layer (*sel, malloc'd), the
 * fresh rows of the selection so far merged, and the fused layer down into k_out,
 * v_out (or the host slot, for a shared ring) unless out is false. Rows that come
 * from pageable memory (a request's frames) go up through the pinned staging, and
 * the fused layer comes down into the pinned host slot before it is copied into
 * pageable k_out, v_out.
 */
int dev_layer(struct fuse_table *t, struct fuse_session *s, struct slot *sl,
	      uint64_t rows_in, const void *k_in, const void *v_in, bool is_check,
	      bool out, void *k_out, void *v_out, int32_t **sel, size_t *n_sel)
{
	const struct blend_device *dv = t->dev;
	struct dev_sess *d = s->dv;
	size_t i = (size_t)(sl - s->ring), rb = s->row_bytes, n = s->n, in = rows_in * rb;
	uint8_t *dk = d->ring + i * d->slot_bytes, *dvv = dk + n * rb;
	bool merge = !is_check || s->next_check > 0;
	/* A heap ring's host slot is pinned (the cache's block): the layer comes down there. */
	bool via_slot = out && k_out && d->hring;
	int rc;

	if (!in_registered(s, k_in, in)) {
		memcpy(d->hk, k_in, in);
		k_in = d->hk;
	}
	if (!in_registered(s, v_in, in)) {
		memcpy(d->hv, v_in, in);
		v_in = d->hv;
	}
	rc = dv->event_wait(dv, d->comp, d->loaded[i]);
	if (!rc)
		rc = dv->upload(dv, d->comp, d->fk, k_in, in);
	if (!rc)
		rc = dv->upload(dv, d->comp, d->fv, v_in, in);
	if (!rc && is_check)
		rc = dev_select(t, s, dk, sel, n_sel);
	/* The rows sent are those of the selection before this layer's narrows it. */
	if (!rc && merge) {
		memcpy(d->hsel, s->sel, s->n_sel * sizeof(int32_t));
		rc = dv->upload(dv, d->comp, d->sel, d->hsel, s->n_sel * sizeof(int32_t));
	}
	if (!rc && merge)
		rc = dv->scatter(dv, d->comp, &s->shape, dk, d->fk, d->sel, s->n_sel);
	if (!rc && merge)
		rc = dv->scatter(dv, d->comp, &s->shape, dvv, d->fv, d->sel, s->n_sel);
	if (!rc && out && k_out && !via_slot) {
		rc = dv->download(dv, d->comp, k_out, dk, n * rb);
		if (!rc)
			rc = dv->download(dv, d->comp, v_out, dvv, n * rb);
	} else if (!rc && out) {
		rc = dv->download(dv, d->comp, sl->k, dk, d->slot_bytes);
	}
	if (!rc)
		rc = dv->stream_sync(dv, d->comp);
	else
		dv->stream_sync(dv, d->comp); /* what was queued must not outlive the request */
	if (!rc && via_slot) {
		memcpy(k_out, sl->k, n * rb);
		memcpy(v_out, sl->v, n * rb);
	}
	if (rc && is_check && *sel) {
		free(*sel);
		*sel = NULL;
	}
	return dev_rc(rc);
}
