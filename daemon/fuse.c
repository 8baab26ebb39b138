/* fuse — CacheBlend fuse sessions; see fuse.h. */
#include "fuse.h"

#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <limits.h>
#include <linux/futex.h>
#include <stdatomic.h>
#include <sys/random.h>
#include <sys/syscall.h>
#include <unistd.h>
#include <time.h>

#include "codec.h"
#include "device.h"
#include "hkvd.h"
#include "log.h"

enum slot_state { SLOT_EMPTY = 0, SLOT_LOADING, SLOT_READY, SLOT_FAILED, SLOT_SERVED };

struct slot {
	int64_t layer; /* -1: none */
	enum slot_state state;
	int err;    /* store errno when SLOT_FAILED */
	uint8_t *k; /* [N, heads, head_dim]: re-rotated stored keys; fresh rows zero */
	uint8_t *v; /* right after k in one allocation or shared segment */
};

struct chunk_ref {
	uint8_t hash[KVBP_HASH_LEN];
	uint32_t off; /* first row in the session's token order */
	uint32_t tokens;
	uint32_t base_pos; /* where its keys were rotated when stored */
	struct rope_table rot;
};

struct fuse_session {
	uint64_t id;
	pthread_mutex_t lock;
	pthread_cond_t cond; /* a slot finished loading, or the session became free */
	unsigned refs;	     /* under the table lock */
	bool busy;	     /* a layer request holds the session */
	bool closed;	     /* removed from the table; freed by the last ref */
	bool ready;	     /* published in the table: findable by id (under the table lock) */
	struct store_model m;
	struct blend_shape shape;
	size_t row_bytes;
	uint32_t n;	   /* tokens */
	uint32_t n_cached; /* tokens from stored chunks */
	int32_t *fresh;	   /* sorted token indices of fresh tokens */
	uint32_t n_fresh;
	struct chunk_ref *chunks;
	size_t n_chunks;
	uint32_t checks[KVBP_CHECKS_MAX];
	double ratios[KVBP_CHECKS_MAX];
	size_t n_checks;
	uint32_t metric; /* 0 value, 1 key */
	int32_t *sel;	 /* current selection, sorted; room for n */
	size_t n_sel;
	uint32_t next_layer;
	size_t next_check; /* index into checks of the next check layer */
	struct slot *ring;
	uint32_t n_ring;
	int64_t served; /* slot holding the fused layer the node reads now, or -1 */
	uint8_t *ring_mem;
	uint64_t shm_id; /* the ring is this shared segment (0: heap) */
	uint64_t bytes;	 /* ring memory */
	char owner[SHM_OWNER_MAX]; /* the client that opened it: only it may drive it */
	uint32_t first; /* the first layer the node sends: checks[0], or 0 when reuse-only */
	/*
	 * Landing (land): the daemon writes stored, re-rotated rows into the node's own
	 * buffers, layers land_begin .. num_layers-1, and publishes in *progress how many
	 * layers (from 0) are in place. Check layers are loaded into cslot[] for the
	 * deviation. The node writes its fresh rows of a layer only once it has landed.
	 */
	bool land;
	struct kvbp_layout lay; /* pages owned */
	uint64_t land_shm;	/* the node's segment, held while the session lives */
	uint8_t *land_mem;	/* its offset 0 */
	_Atomic uint32_t *progress;
	uint32_t land_begin, land_next;
	bool landing;	   /* a layer is being landed (by the prefetch thread) */
	bool land_stop;	   /* closing: land nothing more */
	uint32_t land_code; /* a layer failed to land: its kvbp code (0: none) */
	bool direct;	   /* rows of a chunk are contiguous in the node's buffers */
	struct slot *cslot; /* one per check layer: K and V of all tokens */
	struct slot stage;  /* when !direct: a layer is loaded here, then scattered */
	uint8_t *land_buf;  /* memory of cslot[] and stage */
	uint64_t ns_land;
	struct dev_sess *dv; /* the session's ring on the device (the table has one), or NULL */
	struct timespec last_used;
	struct timespec opened;
	uint64_t layers_served, ns_load, ns_compute, bytes_in, bytes_out;
};

struct pin {
	uint32_t model_id;
	uint8_t hash[KVBP_HASH_LEN];
	uint32_t count;
};

/* A block of device (or pinned host) memory a closed session left for the next one. */
struct dblock {
	void *p;
	size_t bytes;
	bool host;
};

struct fuse_table {
	struct fuse_limits lim;
	struct store *store;
	struct pool *pool;
	const struct blend_backend *be;
	const struct blend_device *dev; /* sessions keep their rings here (NULL: host only) */
	struct dblock *cache;		/* under lock */
	size_t n_cache, cap_cache;
	uint64_t cached;
	struct shm_table *shm;
	pthread_mutex_t lock; /* sessions, bytes, pins */
	struct fuse_session **sessions;
	uint64_t bytes;
	struct pin *pins;
	size_t n_pins, cap_pins;
};

__attribute__((format(printf, 4, 5))) static uint32_t fail(char *err, size_t errlen,
							   uint32_t code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(err, errlen, fmt, ap);
	va_end(ap);
	return code;
}

static uint64_t ns_since(const struct timespec *t0)
{
	struct timespec now;

	clock_gettime(CLOCK_MONOTONIC, &now);
	return (uint64_t)(now.tv_sec - t0->tv_sec) * 1000000000u + (uint64_t)now.tv_nsec -
	       (uint64_t)t0->tv_nsec;
}

/*
 * A call of the table's device failed (its -EIO, carried under a code of its own so
 * that a store's -EIO, a read error, is not taken for one).
 */
#define DEV_FAILED (-EREMOTEIO)

static int dev_rc(int rc)
{
	return rc == -EIO ? DEV_FAILED : rc;
}

/* Why a load or a kernel failed: the device's own message for DEV_FAILED, else the errno's. */
static const char *compute_error(const struct fuse_table *t, int rc, char *buf, size_t len)
{
	char dev[128];

	if (rc != DEV_FAILED || !t->dev)
		return strerror(-rc);
	t->dev->last_error(t->dev, dev, sizeof(dev));
	snprintf(buf, len, "the %s device failed (%s)", t->dev->name, dev);
	return buf;
}

void fuse_rope_config(const struct store_model *m, struct rope_config *c)
{
	memset(c, 0, sizeof(*c));
	c->head_dim = m->head_dim;
	c->rotary_dim = m->rotary_dim ? m->rotary_dim : m->head_dim;
	c->style = m->rope_style ? ROPE_GPTJ : ROPE_NEOX;
	c->theta = m->rope_theta;
	c->scaling = (enum rope_scaling)m->scaling;
	c->factor = m->factor;
	c->low_freq_factor = m->low_freq_factor;
	c->high_freq_factor = m->high_freq_factor;
	c->original_max_pos = m->original_max_pos;
	c->beta_fast = m->beta_fast;
	c->beta_slow = m->beta_slow;
	c->max_pos = m->max_pos;
}

int fuse_table_new(const struct fuse_limits *l, struct store *store, struct pool *pool,
		   const struct blend_backend *backend, const struct blend_device *device,
		   struct shm_table *shm, struct fuse_table **out)
{
	struct fuse_table *t = calloc(1, sizeof(*t));

	if (!t)
		return -ENOMEM;
	t->sessions = calloc(l->max_sessions ? l->max_sessions : 1, sizeof(*t->sessions));
	if (!t->sessions) {
		free(t);
		return -ENOMEM;
	}
	t->lim = *l;
	t->store = store;
	t->pool = pool;
	t->be = backend;
	t->dev = device;
	t->shm = shm;
	pthread_mutex_init(&t->lock, NULL);
	*out = t;
	return 0;
}

/* ---- pins (under the table lock) ---- */

static struct pin *pin_find(struct fuse_table *t, uint32_t model_id, const uint8_t *hash)
{
	for (size_t i = 0; i < t->n_pins; i++)
		if (t->pins[i].model_id == model_id && !memcmp(t->pins[i].hash, hash, KVBP_HASH_LEN))
			return &t->pins[i];
	return NULL;
}

static int pin_add(struct fuse_table *t, uint32_t model_id, const uint8_t *hash)
{
	struct pin *p = pin_find(t, model_id, hash);

	if (p) {
		p->count++;
		return 0;
	}
	if (t->n_pins == t->cap_pins) {
		size_t cap = t->cap_pins ? 2 * t->cap_pins : 64;
		struct pin *np = realloc(t->pins, cap * sizeof(*np));

		if (!np)
			return -ENOMEM;
		t->pins = np;
		t->cap_pins = cap;
	}
	p = &t->pins[t->n_pins++];
	p->model_id = model_id;
	memcpy(p->hash, hash, KVBP_HASH_LEN);
	p->count = 1;
	return 0;
}

static void pin_drop(struct fuse_table *t, uint32_t model_id, const uint8_t *hash)
{
	struct pin *p = pin_find(t, model_id, hash);

	if (p && --p->count == 0)
		*p = t->pins[--t->n_pins];
}

int fuse_delete_chunk(struct fuse_table *t, const struct store_model *m, const uint8_t *hash)
{
	int rc;

	/* Under the lock, so that no session pins the chunk between the check and the delete. */
	pthread_mutex_lock(&t->lock);
	rc = pin_find(t, m->id, hash) ? -EBUSY : store_chunk_delete(t->store, m, hash);
	pthread_mutex_unlock(&t->lock);
	return rc;
}

/* ---- the device path: a session's ring in device memory ---- */

/*
 * Per session: host slot i (pinned: a block of the table's cache, or the shared
 * segment registered in place) is where layers are read into from the store and
 * where fused layers come back to; device slot i is where they are re-rotated and
 * merged. Copies to the device and the rotation after them queue on `copy`; the
 * node's layer (its fresh rows up, deviation, top-k, scatter, the fused layer
 * down) on `comp`, after the slot's `loaded` event. So the layers ahead load while
 * the node's runs.
 */
struct dev_sess {
	struct blend_stream *copy, *comp;
	struct blend_event **loaded; /* per ring slot: uploaded and re-rotated */
	uint8_t *blk;		     /* the device block everything below is carved from */
	size_t blk_bytes;
	uint8_t *hring; /* the pinned host ring, from the cache (heap rings) */
	size_t hring_bytes;
	bool registered; /* the shared ring is pinned in place */
	bool exported;	 /* the block is mapped by the node (CUDA IPC): never reused */
	uint64_t slot_bytes;
	uint8_t *ring;	 /* n_ring slots, K then V of all tokens each */
	uint8_t *fk, *fv; /* a request's fresh rows, up to n each */
	int32_t *idx, *cand, *always, *sel, *out;
	float *dev, *cdev;
	uint8_t *scratch;
	size_t scratch_bytes;
	struct blend_dev_table *tabs; /* host array: chunk i's rotation table, on the device */
};

#define DEV_ALIGN 256

static size_t dev_align(size_t x)
{
	return (x + DEV_ALIGN - 1) / DEV_ALIGN * DEV_ALIGN;
}

/* Give a block back to the device (NULL: nothing). */
static void block_free(struct fuse_table *t, bool host, void *p, size_t bytes)
{
	if (p && host)
		t->dev->host_free(t->dev, p);
	else if (p)
		t->dev->free(t->dev, p, bytes);
}

/* Drop every cached block (to make room on the device). */
static void block_flush(struct fuse_table *t)
{
	struct dblock *c;
	size_t n;

	pthread_mutex_lock(&t->lock);
	c = t->cache;
	n = t->n_cache;
	t->cache = NULL;
	t->n_cache = t->cap_cache = 0;
	t->cached = 0;
	pthread_mutex_unlock(&t->lock);
	for (size_t i = 0; i < n; i++)
		block_free(t, c[i].host, c[i].p, c[i].bytes);
	free(c);
}

/*
 * A block of at least bytes (device, or pinned host memory): a cached one of up to
 * 1.25 times that, else a new one (after dropping the cache if the device is full).
 * *got: its real size, which the session is charged.
 */
static int block_take(struct fuse_table *t, bool host, size_t bytes, void **out, size_t *got)
{
	const struct blend_device *d = t->dev;
	int rc;

	pthread_mutex_lock(&t->lock);
	for (size_t i = 0; i < t->n_cache; i++) {
		struct dblock *b = &t->cache[i];

		if (b->host != host || b->bytes < bytes || b->bytes - bytes > bytes / 4)
			continue;
		*out = b->p;
		*got = b->bytes;
		t->cached -= b->bytes;
		*b = t->cache[--t->n_cache];
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
	if (!rc)
		*got = bytes;
	return rc;
}

/* Drop cached blocks until sessions and cache together fit in fuse_max_bytes. */
static void block_trim(struct fuse_table *t)
{
	struct dblock *drop = NULL;
	size_t n = 0;

	pthread_mutex_lock(&t->lock);
	if (t->n_cache && t->bytes + t->cached > t->lim.max_bytes)
		drop = malloc(t->n_cache * sizeof(*drop));
	while (drop && t->n_cache && t->bytes + t->cached > t->lim.max_bytes) {
		drop[n] = t->cache[--t->n_cache];
		t->cached -= drop[n++].bytes;
	}
	pthread_mutex_unlock(&t->lock);
	for (size_t i = 0; i < n; i++)
		block_free(t, drop[i].host, drop[i].p, drop[i].bytes);
	free(drop);
}

/*
 * Keep a block for the next session while sessions and cache together stay within
 * fuse_max_bytes (block_trim() keeps it so as sessions open).
 */
static void block_give(struct fuse_table *t, bool host, void *p, size_t bytes)
{
	if (!p)
		return;
	pthread_mutex_lock(&t->lock);
	if (t->bytes + t->cached + bytes <= t->lim.max_bytes) {
		if (t->n_cache == t->cap_cache) {
			size_t cap = t->cap_cache ? 2 * t->cap_cache : 8;
			struct dblock *c = realloc(t->cache, cap * sizeof(*c));

			if (c) {
				t->cache = c;
				t->cap_cache = cap;
			}
		}
		if (t->n_cache < t->cap_cache) {
			t->cache[t->n_cache++] = (struct dblock){ p, bytes, host };
			t->cached += bytes;
			pthread_mutex_unlock(&t->lock);
			return;
		}
	}
	pthread_mutex_unlock(&t->lock);
	block_free(t, host, p, bytes);
}

/* Carve (or, with base NULL, only measure) a session's device block; returns its size. */
static size_t dev_layout(const struct fuse_session *s, struct dev_sess *d, uint8_t *base)
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
#undef CARVE
	for (size_t i = 0; i < s->n_chunks; i++) {
		const struct rope_table *r = &s->chunks[i].rot;
		size_t tb = (size_t)r->rows * r->half * sizeof(float);

		if (base) {
			d->tabs[i].cos = (const float *)(base + off);
			d->tabs[i].sin = (const float *)(base + off + dev_align(tb));
			d->tabs[i].rows = r->rows;
			d->tabs[i].scale = r->scale;
		}
		off += 2 * dev_align(tb);
	}
	return off;
}

static void dev_sess_free(struct fuse_table *t, struct fuse_session *s)
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
	for (uint32_t i = 0; d->loaded && i < s->n_ring; i++)
		if (d->loaded[i])
			t->dev->event_free(t->dev, d->loaded[i]);
	if (d->comp)
		t->dev->stream_free(t->dev, d->comp);
	if (d->copy)
		t->dev->stream_free(t->dev, d->copy);
	if (d->registered)
		t->dev->host_unregister(t->dev, s->ring_mem);
	/* A block the node mapped stays readable there: it must not serve another session. */
	if (d->exported || failed)
		block_free(t, false, d->blk, d->blk_bytes);
	else
		block_give(t, false, d->blk, d->blk_bytes);
	if (failed)
		block_free(t, true, d->hring, d->hring_bytes);
	else
		block_give(t, true, d->hring, d->hring_bytes);
	free(d->loaded);
	free(d->tabs);
	free(d);
	s->dv = NULL;
}

/*
 * The device half of a session's open: the host ring (pinned from the cache, or the
 * shared segment at s->ring_mem pinned in place), streams, events, the device
 * block (zeroed first when the node is to map it: a cached block holds another
 * session's rows), and the rotation tables and fresh tokens uploaded.
 */
static int dev_sess_setup(struct fuse_table *t, struct fuse_session *s, size_t ring_bytes,
			  bool zero)
{
	const struct blend_device *dv = t->dev;
	struct dev_sess *d = s->dv;
	int rc = 0;

	if (!s->ring_mem) {
		rc = block_take(t, true, ring_bytes, (void **)&d->hring, &d->hring_bytes);
		if (rc)
			return dev_rc(rc);
		memset(d->hring, 0, ring_bytes); /* fresh tokens' rows are never read from a chunk */
		s->ring_mem = d->hring;
	} else {
		/* Unpinned, the copies still work, only slower: not a reason to refuse. */
		d->registered = dv->host_register(dv, s->ring_mem, ring_bytes) == 0;
	}
	rc = dv->stream_new(dv, &d->copy);
	if (!rc)
		rc = dv->stream_new(dv, &d->comp);
	d->loaded = calloc(s->n_ring, sizeof(*d->loaded));
	if (!rc && !d->loaded)
		rc = -ENOMEM;
	for (uint32_t i = 0; !rc && i < s->n_ring; i++)
		rc = dv->event_new(dv, &d->loaded[i]);
	if (!rc)
		rc = block_take(t, false, d->blk_bytes, (void **)&d->blk, &d->blk_bytes);
	if (rc)
		return dev_rc(rc);
	dev_layout(s, d, d->blk);
	if (zero)
		rc = dv->zero(dv, d->comp, d->blk, d->blk_bytes);
	for (size_t i = 0; !rc && i < s->n_chunks; i++) {
		const struct rope_table *r = &s->chunks[i].rot;
		size_t tb = (size_t)r->rows * r->half * sizeof(float);

		rc = dv->upload(dv, d->comp, (void *)d->tabs[i].cos, r->cos, tb);
		if (!rc)
			rc = dv->upload(dv, d->comp, (void *)d->tabs[i].sin, r->sin, tb);
	}
	if (!rc)
		rc = dv->upload(dv, d->comp, d->always, s->fresh, s->n_fresh * sizeof(int32_t));
	if (!rc)
		rc = dv->stream_sync(dv, d->comp);
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

	return store_chunk_get_layer(j->t->store, &s->m, c->hash, j->layer,
				     j->slot->k + (size_t)c->off * s->row_bytes,
				     j->slot->v + (size_t)c->off * s->row_bytes,
				     (uint64_t)c->tokens * s->row_bytes, NULL);
}

/* Load layer into ring slot sl on the device: read here, copied and re-rotated there. */
static int dev_load(struct fuse_table *t, struct fuse_session *s, struct slot *sl, uint32_t layer)
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
	for (size_t c = 0; !rc && c < s->n_chunks; c++) {
		uint8_t *rows = dk + (size_t)s->chunks[c].off * s->row_bytes;

		rc = dv->rotate(dv, d->copy, &s->shape, &d->tabs[c], rows, rows,
				s->chunks[c].tokens);
	}
	if (!rc)
		rc = dv->event_record(dv, d->loaded[i], d->copy);
	return dev_rc(rc);
}

/* Cached tokens among rows idx[0..rows) with their deviations, compacted into cand, dev. */
static size_t candidates(const struct fuse_session *s, const int32_t *idx, size_t rows,
			 float *dev, int32_t *cand)
{
	size_t n_cand = 0, fi = 0;

	for (size_t i = 0; i < rows; i++) {
		while (fi < s->n_fresh && s->fresh[fi] < idx[i])
			fi++;
		if (fi < s->n_fresh && s->fresh[fi] == idx[i])
			continue;
		dev[n_cand] = dev[i];
		cand[n_cand++] = idx[i];
	}
	return n_cand;
}

/*
 * HKVD on the device at the session's next check layer, with the node's rows
 * already in d->fk, d->fv and the stored layer in dk: as check_select() does on the
 * host. *sel is malloc'd.
 */
static int dev_select(struct fuse_table *t, struct fuse_session *s, const uint8_t *dk,
		      int32_t **sel_out, size_t *n_out)
{
	const struct blend_device *dv = t->dev;
	struct dev_sess *d = s->dv;
	size_t rows = s->next_check == 0 ? s->n : s->n_sel, n_cand, n_sel = 0;
	const uint8_t *plane = s->metric ? dk : dk + (size_t)s->n * s->row_bytes;
	int32_t *idx = malloc((rows + 1) * sizeof(int32_t));
	int32_t *cand = malloc((rows + 1) * sizeof(int32_t));
	float *dev = malloc((rows + 1) * sizeof(float));
	int32_t *sel = malloc((s->n + 1) * sizeof(int32_t));
	int rc = -ENOMEM;

	if (!idx || !cand || !dev || !sel)
		goto out;
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
		rc = dv->download(dv, d->comp, sel, d->out, n_sel * sizeof(int32_t));
	/* The host arrays above are read by queued copies until this returns. */
	if (!rc)
		rc = dv->stream_sync(dv, d->comp);
out:
	free(idx);
	free(cand);
	free(dev);
	if (rc) {
		free(sel);
		return rc;
	}
	*sel_out = sel;
	*n_out = n_sel;
	return 0;
}

/*
 * The node's layer on the device (fuse_layer_run's work for a device session):
 * rows_in fresh rows up, the selection at a check layer (*sel, malloc'd), the
 * fresh rows of the selection so far merged, and the fused layer down into k_out,
 * v_out (or the host slot, for a shared ring) unless out is false.
 */
static int dev_layer(struct fuse_table *t, struct fuse_session *s, struct slot *sl,
		     uint64_t rows_in, const void *k_in, const void *v_in, bool is_check,
		     bool out, void *k_out, void *v_out, int32_t **sel, size_t *n_sel)
{
	const struct blend_device *dv = t->dev;
	struct dev_sess *d = s->dv;
	size_t i = (size_t)(sl - s->ring), rb = s->row_bytes, n = s->n;
	uint8_t *dk = d->ring + i * d->slot_bytes, *dvv = dk + n * rb;
	bool merge = !is_check || s->next_check > 0;
	int rc;

	rc = dv->event_wait(dv, d->comp, d->loaded[i]);
	if (!rc)
		rc = dv->upload(dv, d->comp, d->fk, k_in, rows_in * rb);
	if (!rc)
		rc = dv->upload(dv, d->comp, d->fv, v_in, rows_in * rb);
	if (!rc && is_check)
		rc = dev_select(t, s, dk, sel, n_sel);
	/* The rows sent are those of the selection before this layer's narrows it. */
	if (!rc && merge)
		rc = dv->upload(dv, d->comp, d->sel, s->sel, s->n_sel * sizeof(int32_t));
	if (!rc && merge)
		rc = dv->scatter(dv, d->comp, &s->shape, dk, d->fk, d->sel, s->n_sel);
	if (!rc && merge)
		rc = dv->scatter(dv, d->comp, &s->shape, dvv, d->fv, d->sel, s->n_sel);
	if (!rc && out && k_out) {
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
	if (rc && is_check && *sel) {
		free(*sel);
		*sel = NULL;
	}
	return dev_rc(rc);
}

/* ---- sessions ---- */

static void session_free(struct fuse_table *t, struct fuse_session *s)
{
	bool heap_ring;

	if (!s)
		return;
	heap_ring = !s->dv || !s->dv->hring; /* else a pinned block, back to the cache */
	dev_sess_free(t, s); /* first: it unpins a shared ring */
	if (s->shm_id) {
		shm_release(t->shm, s->shm_id);
		shm_detach(t->shm, s->shm_id, NULL);
	} else if (heap_ring) {
		free(s->ring_mem);
	}
	if (s->land_mem)
		shm_release(t->shm, s->land_shm);
	free(s->lay.pages);
	free(s->cslot);
	free(s->land_buf);
	for (size_t i = 0; s->chunks && i < s->n_chunks; i++)
		rope_table_free(&s->chunks[i].rot);
	free(s->ring);
	free(s->chunks);
	free(s->fresh);
	free(s->sel);
	pthread_cond_destroy(&s->cond);
	pthread_mutex_destroy(&s->lock);
	free(s);
}

/* Take session s out of the table (under the table lock): unpin, release its memory budget. */
static void session_remove(struct fuse_table *t, size_t slot)
{
	struct fuse_session *s = t->sessions[slot];

	t->sessions[slot] = NULL;
	for (size_t i = 0; i < s->n_chunks; i++)
		pin_drop(t, s->m.id, s->chunks[i].hash);
	t->bytes -= s->bytes;
	s->closed = true;
}

void fuse_table_free(struct fuse_table **tp)
{
	struct fuse_table *t = tp ? *tp : NULL;

	if (!t)
		return;
	for (uint64_t i = 0; i < t->lim.max_sessions; i++)
		if (t->sessions[i]) {
			struct fuse_session *s = t->sessions[i];

			session_remove(t, i);
			session_free(t, s);
		}
	if (t->dev)
		block_flush(t);
	free(t->sessions);
	free(t->pins);
	pthread_mutex_destroy(&t->lock);
	free(t);
	*tp = NULL;
}

/* Does slot i hold session id of owner (NULL: any owner)? Under the table lock. */
static bool session_is(struct fuse_table *t, uint64_t i, uint64_t id, const char *owner)
{
	const struct fuse_session *s = t->sessions[i];

	return s && s->ready && s->id == id && (!owner || !strcmp(s->owner, owner));
}

/* Find owner's session id and take a reference (the table lock protects refs). */
static struct fuse_session *session_get(struct fuse_table *t, uint64_t id, const char *owner)
{
	struct fuse_session *s = NULL;

	pthread_mutex_lock(&t->lock);
	for (uint64_t i = 0; i < t->lim.max_sessions && !s; i++)
		if (session_is(t, i, id, owner))
			s = t->sessions[i];
	if (s)
		s->refs++;
	pthread_mutex_unlock(&t->lock);
	return s;
}

static void session_put(struct fuse_table *t, struct fuse_session *s)
{
	bool last;

	pthread_mutex_lock(&t->lock);
	last = --s->refs == 0 && s->closed;
	clock_gettime(CLOCK_MONOTONIC, &s->last_used);
	pthread_mutex_unlock(&t->lock);
	if (last)
		session_free(t, s);
}

/* ---- landing in the node's buffers ---- */

/* *out = a * b + c; false on overflow. */
static bool mul_add(uint64_t a, uint64_t b, uint64_t c, uint64_t *out)
{
	uint64_t p;

	return !__builtin_mul_overflow(a, b, &p) && !__builtin_add_overflow(p, c, out);
}

/* Publish that layers 0 .. v-1 are in place (or, with KVBP_LAND_FAILED, that landing stopped). */
static void land_publish(struct fuse_session *s, uint32_t v)
{
	atomic_store_explicit(s->progress, v, memory_order_release);
	/* A shared futex: the node may sleep on the word (its mapping of the same memfd). */
	syscall(SYS_futex, (uint32_t *)s->progress, FUTEX_WAKE, INT_MAX, NULL, NULL, 0);
}

/*
 * Check the node's layout y for session s (its tokens, heads, layers) against the
 * segment it names, and hold that segment for the session. Every byte the daemon
 * may write lies inside it: the extent is computed with overflow checks.
 */
static uint32_t land_setup(struct fuse_table *t, struct fuse_session *s,
			   const struct kvbp_layout *y, const char *owner, char *err, size_t errlen)
{
	size_t head_bytes = (size_t)s->m.head_dim * s->m.elem_size;
	uint64_t tok_max = 0, row_end, layer_max, end = 0, e;
	void *base;

	if (!mul_add(s->m.num_kv_heads - 1, y->head_stride, head_bytes, &row_end) ||
	    !mul_add(s->m.num_layers - 1, y->layer_stride, 0, &layer_max))
		return fail(err, errlen, KVBP_BAD_SHAPE, "landing layout: strides overflow");
	if (y->page_tokens) {
		uint64_t need = ((uint64_t)s->n + y->page_tokens - 1) / y->page_tokens;
		uint64_t in_page = (s->n < y->page_tokens ? s->n : y->page_tokens) - 1, pm = 0;

		if (y->n_pages < need)
			return fail(err, errlen, KVBP_BAD_SHAPE, "landing layout: the block table has "
				    "%zu pages; %" PRIu32 " tokens in pages of %" PRIu32 " need %" PRIu64,
				    y->n_pages, s->n, y->page_tokens, need);
		for (uint64_t i = 0; i < need; i++)
			if (y->pages[i] > pm)
				pm = y->pages[i];
		if (!mul_add(pm, y->page_stride, 0, &pm) ||
		    !mul_add(in_page, y->token_stride, pm, &tok_max))
			return fail(err, errlen, KVBP_BAD_SHAPE, "landing layout: page offsets "
				    "overflow");
	} else if (y->n_pages) {
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "landing layout: a block table needs "
			    "page_tokens");
	} else if (!mul_add(s->n - 1, y->token_stride, 0, &tok_max)) {
		return fail(err, errlen, KVBP_BAD_SHAPE, "landing layout: token offsets overflow");
	}
	for (int i = 0; i < 2; i++) {
		uint64_t off = i ? y->v_offset : y->k_offset;

		if (__builtin_add_overflow(off, layer_max, &e) ||
		    __builtin_add_overflow(e, tok_max, &e) || __builtin_add_overflow(e, row_end, &e))
			return fail(err, errlen, KVBP_BAD_SHAPE, "landing layout: %c offsets overflow",
				    i ? 'V' : 'K');
		end = e > end ? e : end;
	}
	if (y->progress % 4 || y->progress > UINT64_MAX - 4)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "landing layout: the progress word at "
			    "%" PRIu64 " is not 4-byte aligned", y->progress);
	if (y->progress + 4 > end)
		end = y->progress + 4;
	if (shm_acquire(t->shm, y->shm_id, owner, 0, end, &base))
		return fail(err, errlen, KVBP_BAD_SHM, "landing layout: shared-memory segment %"
			    PRIu64 " unknown, expired, not this client's, or smaller than the %"
			    PRIu64 " bytes the layout spans", y->shm_id, end);
	s->land = true;
	s->land_shm = y->shm_id;
	s->land_mem = base;
	s->lay = *y;
	s->lay.pages = NULL;
	s->lay.n_pages = 0;
	if (y->page_tokens) {
		size_t np = ((size_t)s->n + y->page_tokens - 1) / y->page_tokens;

		s->lay.pages = malloc(np * sizeof(uint32_t));
		if (!s->lay.pages)
			return fail(err, errlen, KVBP_LIMIT, "out of memory");
		memcpy(s->lay.pages, y->pages, np * sizeof(uint32_t));
		s->lay.n_pages = np;
	}
	s->progress = (_Atomic uint32_t *)((uint8_t *)base + y->progress);
	s->land_begin = s->n_checks ? s->checks[0] + 1 : 0;
	s->land_next = s->land_begin;
	s->direct = !y->page_tokens && y->token_stride == s->row_bytes &&
		    y->head_stride == head_bytes;
	return KVBP_OK;
}

/* The check-layer slots and the staging slot, in one allocation of bytes. */
static int land_alloc(struct fuse_session *s, uint64_t bytes)
{
	size_t slot = 2 * (size_t)s->n * s->row_bytes;

	s->cslot = calloc(s->n_checks + 1, sizeof(*s->cslot));
	s->land_buf = bytes ? calloc(1, bytes) : NULL;
	if (!s->cslot || (bytes && !s->land_buf))
		return -ENOMEM;
	for (size_t i = 0; i <= s->n_checks; i++) {
		struct slot *sl = i < s->n_checks ? &s->cslot[i] : &s->stage;

		if (i == s->n_checks && s->direct)
			break;
		sl->layer = -1;
		sl->k = s->land_buf + i * slot;
		sl->v = sl->k + slot / 2;
	}
	return 0;
}

uint32_t fuse_open(struct fuse_table *t, const struct store_model *m, const struct kvbp_request *q,
		   const char *owner, struct fuse_open_result *r, char *err, size_t errlen)
{
	struct fuse_session *s = NULL;
	struct rope_config rc_cfg;
	uint64_t n = 0, max_pos_end = 0, ring_bytes, charge;
	size_t n_chunks = 0, slot_i = SIZE_MAX;
	uint32_t code = KVBP_OK;
	bool pinned = false;
	int rc;

	memset(r, 0, sizeof(*r));
	/* The request itself. */
	if (!q->n_segments)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "fuse_open needs at least one segment");
	if (!q->n_checks && !q->reuse_only)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "fuse_open needs at least one check layer "
			    "(or reuse_only, for plain reuse)");
	if (q->n_checks && q->reuse_only)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "a reuse_only session has no check "
			    "layers; got %zu", q->n_checks);
	if (q->n_ratios != q->n_checks)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "%zu check layers but %zu ratios; give one "
			    "ratio per check layer", q->n_checks, q->n_ratios);
	for (size_t i = 0; i < q->n_checks; i++) {
		if (q->check_layers[i] >= m->num_layers)
			return fail(err, errlen, KVBP_BAD_ARGUMENT, "check layer %" PRIu32 " is not a "
				    "layer of the %" PRIu32 "-layer model", q->check_layers[i],
				    m->num_layers);
		if (i && q->check_layers[i] <= q->check_layers[i - 1])
			return fail(err, errlen, KVBP_BAD_ARGUMENT, "check layers must increase; got "
				    "%" PRIu32 " after %" PRIu32, q->check_layers[i],
				    q->check_layers[i - 1]);
		if (!(q->ratios[i] >= 0 && q->ratios[i] <= 1))
			return fail(err, errlen, KVBP_BAD_ARGUMENT, "ratio %g is not in [0, 1]",
				    q->ratios[i]);
		if (i && q->ratios[i] > q->ratios[i - 1])
			return fail(err, errlen, KVBP_BAD_ARGUMENT, "ratios must not increase; got %g "
				    "after %g", q->ratios[i], q->ratios[i - 1]);
	}
	if (q->metric > 1)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "metric %" PRIu32 " unknown; expected 0 "
			    "(value) or 1 (key)", q->metric);
	for (size_t i = 0; i < q->n_segments; i++) {
		const struct kvbp_segment *g = &q->segments[i];

		if (g->fresh && !g->count)
			return fail(err, errlen, KVBP_BAD_SHAPE, "segment %zu: fresh segment of 0 "
				    "tokens", i);
		if (!g->fresh && g->count)
			return fail(err, errlen, KVBP_BAD_ARGUMENT, "segment %zu: a chunk segment "
				    "takes its token count from the chunk; count must be 0", i);
		n_chunks += !g->fresh;
	}
	s = calloc(1, sizeof(*s));
	if (!s)
		return fail(err, errlen, KVBP_LIMIT, "out of memory");
	pthread_mutex_init(&s->lock, NULL);
	pthread_cond_init(&s->cond, NULL);
	s->m = *m;
	snprintf(s->owner, sizeof(s->owner), "%s", owner);
	s->metric = q->metric;
	s->n_checks = q->n_checks;
	if (q->n_checks) {
		memcpy(s->checks, q->check_layers, q->n_checks * sizeof(uint32_t));
		memcpy(s->ratios, q->ratios, q->n_checks * sizeof(double));
	}
	s->first = s->n_checks ? s->checks[0] : 0;
	s->next_layer = s->first;
	s->chunks = calloc(n_chunks ? n_chunks : 1, sizeof(*s->chunks));
	r->missing = calloc(n_chunks ? n_chunks : 1, KVBP_HASH_LEN);
	if (!s->chunks || !r->missing) {
		code = fail(err, errlen, KVBP_LIMIT, "out of memory");
		goto fail;
	}
	/* Pin first, then look up: a chunk deleted in between shows as missing. */
	pthread_mutex_lock(&t->lock);
	rc = 0;
	for (size_t i = 0; i < q->n_segments && !rc; i++)
		if (!q->segments[i].fresh)
			rc = pin_add(t, m->id, q->segments[i].hash);
	if (rc) {
		for (size_t i = 0; i < q->n_segments; i++)
			if (!q->segments[i].fresh)
				pin_drop(t, m->id, q->segments[i].hash);
	}
	pthread_mutex_unlock(&t->lock);
	if (rc) {
		code = fail(err, errlen, KVBP_LIMIT, "out of memory");
		goto fail;
	}
	pinned = true;
	for (size_t i = 0; i < q->n_segments; i++) {
		const struct kvbp_segment *g = &q->segments[i];
		uint64_t count = g->count;

		if (!g->fresh) {
			struct store_chunk_info ci;

			rc = store_chunk_info(t->store, m, g->hash, &ci);
			if (rc == -ENOENT) {
				memcpy(r->missing[r->n_missing++], g->hash, KVBP_HASH_LEN);
				continue;
			}
			if (rc) {
				code = fail(err, errlen, rc == -EBADMSG ? KVBP_CORRUPT : KVBP_INTERNAL,
					    "lookup failed: %s", rc == -EBADMSG ?
					    "a chunk record failed its checksum" : strerror(-rc));
				goto fail;
			}
			count = ci.num_tokens;
			memcpy(s->chunks[s->n_chunks].hash, g->hash, KVBP_HASH_LEN);
			s->chunks[s->n_chunks].off = (uint32_t)n;
			s->chunks[s->n_chunks].tokens = ci.num_tokens;
			s->chunks[s->n_chunks].base_pos = ci.base_pos;
			s->n_chunks++;
			s->n_cached += ci.num_tokens;
		}
		if ((uint64_t)g->pos + count > UINT32_MAX) {
			code = fail(err, errlen, KVBP_BAD_SHAPE, "segment %zu: positions %" PRIu32
				    "+%" PRIu64 " overflow", i, g->pos, count);
			goto fail;
		}
		if (g->pos + count > max_pos_end)
			max_pos_end = g->pos + count;
		n += count;
		if (n > t->lim.max_tokens) {
			code = fail(err, errlen, KVBP_LIMIT, "the session would hold more than "
				    "fuse_max_tokens %" PRIu64 " tokens", t->lim.max_tokens);
			goto fail;
		}
	}
	if (r->n_missing) {
		code = fail(err, errlen, KVBP_NOT_FOUND, "%zu of %zu chunks are not stored; prefill "
			    "and store them, then open again", r->n_missing, n_chunks);
		goto fail;
	}
	s->n = (uint32_t)n;
	s->shape.heads = m->num_kv_heads;
	s->shape.head_dim = m->head_dim;
	s->shape.rotary_dim = m->rotary_dim ? m->rotary_dim : m->head_dim;
	s->shape.style = m->rope_style ? ROPE_GPTJ : ROPE_NEOX;
	s->shape.dtype = (enum blend_dtype)m->dtype;
	s->row_bytes = (size_t)m->num_kv_heads * m->head_dim * m->elem_size;
	/* Rotation tables; chunk i's token t sits at the position of its segment plus t. */
	fuse_rope_config(m, &rc_cfg);
	{
		size_t ci = 0;

		s->fresh = malloc((n - s->n_cached + 1) * sizeof(int32_t));
		s->sel = malloc((n + 1) * sizeof(int32_t));
		if (!s->fresh || !s->sel) {
			code = fail(err, errlen, KVBP_LIMIT, "out of memory");
			goto fail;
		}
		for (size_t i = 0, row = 0; i < q->n_segments; i++) {
			const struct kvbp_segment *g = &q->segments[i];

			if (g->fresh) {
				for (uint32_t k = 0; k < g->count; k++)
					s->fresh[s->n_fresh++] = (int32_t)(row + k);
				row += g->count;
				continue;
			}
			{
				struct chunk_ref *c = &s->chunks[ci++];

				/* Dynamic NTK: the chunk was prefilled alone (a sequence of
				 * base_pos + T positions); the fused prompt spans max_pos_end. */
				rc = rope_table_build(&rc_cfg, m->k_pre_rope, c->tokens, c->base_pos,
						      (uint64_t)c->base_pos + c->tokens, g->pos,
						      max_pos_end, &c->rot);
				if (rc) {
					code = fail(err, errlen, KVBP_INTERNAL, "rotation table: %s",
						    strerror(-rc));
					goto fail;
				}
				row += c->tokens;
			}
		}
	}
	/* Reuse only: the fresh tokens are the selection from the start. */
	if (!s->n_checks) {
		memcpy(s->sel, s->fresh, s->n_fresh * sizeof(int32_t));
		s->n_sel = s->n_fresh;
	}
	if (q->has_land) {
		code = land_setup(t, s, &q->land, owner, err, errlen);
		if (code)
			goto fail;
		/* No ring: a slot per check layer, and one to stage a layer in when the
		 * node's layout does not keep a chunk's rows together. */
		ring_bytes = ((uint64_t)s->n_checks + !s->direct) * 2 * n * s->row_bytes;
	} else {
		/* The ring: re-rotated stored K and V of a few layers, all tokens each. */
		s->n_ring = (uint32_t)(t->lim.ring < m->num_layers - s->first
					       ? t->lim.ring
					       : m->num_layers - s->first) + 1;
		ring_bytes = (uint64_t)s->n_ring * 2 * n * s->row_bytes;
		if (t->dev) {
			/* And the same ring on the device, with room for the node's rows. */
			s->dv = calloc(1, sizeof(*s->dv));
			if (s->dv)
				s->dv->tabs = calloc(s->n_chunks + 1, sizeof(*s->dv->tabs));
			if (!s->dv || !s->dv->tabs) {
				code = fail(err, errlen, KVBP_LIMIT, "out of memory");
				goto fail;
			}
			s->dv->slot_bytes = 2 * n * s->row_bytes;
			s->dv->scratch_bytes = t->dev->select_scratch(t->dev, n);
			if (!s->dv->scratch_bytes) {
				char why[160];

				code = fail(err, errlen, KVBP_INTERNAL, "top-k scratch: %s",
					    compute_error(t, DEV_FAILED, why, sizeof(why)));
				goto fail;
			}
			s->dv->blk_bytes = dev_layout(s, s->dv, NULL);
		}
	}
	/* Host ring and device block both count against fuse_max_bytes. */
	charge = ring_bytes + (s->dv ? s->dv->blk_bytes : 0);
	pthread_mutex_lock(&t->lock);
	if (t->bytes + charge > t->lim.max_bytes) {
		pthread_mutex_unlock(&t->lock);
		code = fail(err, errlen, KVBP_LIMIT, "fuse sessions would hold %" PRIu64 " bytes; "
			    "fuse_max_bytes is %" PRIu64, t->bytes + charge, t->lim.max_bytes);
		goto fail;
	}
	{
		uint64_t held = 0;

		for (uint64_t i = 0; i < t->lim.max_sessions; i++)
			held += t->sessions[i] && !strcmp(t->sessions[i]->owner, owner);
		if (held >= t->lim.per_owner) {
			pthread_mutex_unlock(&t->lock);
			code = fail(err, errlen, KVBP_LIMIT, "this client holds %" PRIu64 " open fuse "
				    "sessions (client_fuse_sessions); close one first", held);
			goto fail;
		}
	}
	for (uint64_t i = 0; i < t->lim.max_sessions && slot_i == SIZE_MAX; i++)
		if (!t->sessions[i])
			slot_i = i;
	if (slot_i == SIZE_MAX) {
		pthread_mutex_unlock(&t->lock);
		code = fail(err, errlen, KVBP_LIMIT, "%" PRIu64 " fuse sessions are open; that is "
			    "fuse_max_sessions", t->lim.max_sessions);
		goto fail;
	}
	t->bytes += charge;
	s->bytes = charge;
	t->sessions[slot_i] = s; /* reserved; not findable until it has an id */
	pthread_mutex_unlock(&t->lock);
	/*
	 * The ring: one more slot than the layers loaded ahead, for the layer the node
	 * is reading. Shared when the client asked and shared memory allows; zeroed, as
	 * fresh tokens' rows are read by deviation but never served from the store.
	 */
	if (s->land) {
		if (land_alloc(s, ring_bytes)) {
			pthread_mutex_lock(&t->lock);
			t->sessions[slot_i] = NULL;
			t->bytes -= charge;
			pthread_mutex_unlock(&t->lock);
			code = fail(err, errlen, KVBP_LIMIT, "out of memory for the session");
			goto fail;
		}
		goto opened;
	}
	s->ring = calloc(s->n_ring, sizeof(*s->ring));
	if (s->ring && q->shared_ring) {
		uint64_t sid;

		if (shm_create_ring(t->shm, ring_bytes, owner, &sid, &r->shm_size) == 0) {
			void *base = NULL;

			if (shm_hold(t->shm, sid, &base) == 0) {
				s->shm_id = sid;
				s->ring_mem = base;
			} else {
				shm_detach(t->shm, sid, NULL);
			}
		}
	}
	if (s->ring && !s->ring_mem && !s->dv)
		s->ring_mem = calloc(1, ring_bytes);
	if (s->ring && s->dv) {
		rc = dev_sess_setup(t, s, ring_bytes, q->device_out && t->dev->ipc_export);
		if (!rc) {
			/* Cached blocks may be larger than asked: charge what the session holds. */
			uint64_t held = s->dv->blk_bytes +
					(s->dv->hring ? s->dv->hring_bytes : ring_bytes);

			pthread_mutex_lock(&t->lock);
			if (t->bytes - charge + held > t->lim.max_bytes) {
				rc = -ENOSPC;
			} else {
				t->bytes = t->bytes - charge + held;
				charge = held;
				s->bytes = held;
			}
			pthread_mutex_unlock(&t->lock);
		}
		if (rc) {
			char why[160];

			pthread_mutex_lock(&t->lock);
			t->sessions[slot_i] = NULL;
			t->bytes -= charge;
			pthread_mutex_unlock(&t->lock);
			if (rc == -ENOSPC)
				code = fail(err, errlen, KVBP_LIMIT, "fuse sessions would hold more than "
					    "fuse_max_bytes %" PRIu64 " with this session's device "
					    "blocks", t->lim.max_bytes);
			else
				code = fail(err, errlen, rc == -ENOMEM ? KVBP_LIMIT : KVBP_INTERNAL,
					    "the session's ring on the device: %s",
					    compute_error(t, rc, why, sizeof(why)));
			goto fail;
		}
		block_trim(t); /* the cache gives way to open sessions */
	}
	if (!s->ring || !s->ring_mem) {
		pthread_mutex_lock(&t->lock);
		t->sessions[slot_i] = NULL;
		t->bytes -= charge;
		pthread_mutex_unlock(&t->lock);
		code = fail(err, errlen, KVBP_LIMIT, "out of memory for the session ring");
		goto fail;
	}
	for (uint32_t i = 0; i < s->n_ring; i++) {
		s->ring[i].layer = -1;
		s->ring[i].k = s->ring_mem + (uint64_t)i * 2 * n * s->row_bytes;
		s->ring[i].v = s->ring[i].k + (uint64_t)n * s->row_bytes;
	}
	if (s->dv && q->device_out && t->dev->ipc_export) {
		struct dev_sess *d = s->dv;

		/* The block was zeroed before anything was put in it (dev_sess_setup). Without
		 * an export the node takes the layers from host memory. */
		rc = t->dev->ipc_export(t->dev, d->blk, r->ipc_handle, r->device_pci,
					sizeof(r->device_pci));
		if (!rc) {
			d->exported = true;
			r->has_ipc = true;
			r->ipc_offset = (uint64_t)(d->ring - d->blk);
		} else {
			char why[160];

			log_warn("fuse session: cannot export its device ring: %s",
				 compute_error(t, dev_rc(rc), why, sizeof(why)));
		}
	}
opened:
	s->served = -1;
	clock_gettime(CLOCK_MONOTONIC, &s->opened);
	s->last_used = s->opened;
	{
		uint64_t id = 0;

		/* Unguessable, so that one client cannot drive another's session. */
		if (getrandom(&id, sizeof(id), 0) != sizeof(id) || !id)
			id = (uint64_t)(uintptr_t)s ^ ((uint64_t)s->opened.tv_nsec << 20) ^ 1;
		pthread_mutex_lock(&t->lock);
		s->id = id;
		s->ready = true;
		pthread_mutex_unlock(&t->lock);
	}
	r->id = s->id;
	r->num_tokens = s->n;
	r->next_layer = s->next_layer;
	r->rows_next = s->n_checks ? s->n : s->n_fresh;
	r->ring_slots = s->n_ring;
	if (s->land) {
		/* Layers before land_begin are the node's own: in place from the start. */
		land_publish(s, s->land_begin);
		r->next_layer = s->n_checks ? s->checks[0] : m->num_layers;
		r->rows_next = s->n_checks ? s->n : 0;
	}
	r->slot_bytes = s->land ? 0 : 2 * (uint64_t)n * s->row_bytes;
	if (!s->n_checks) {
		r->rows = malloc((s->n_fresh + 1) * sizeof(int32_t));
		if (r->rows) {
			memcpy(r->rows, s->fresh, s->n_fresh * sizeof(int32_t));
			r->n_rows = s->n_fresh;
		}
	}
	r->shm_id = s->shm_id;
	if (!s->shm_id)
		r->shm_size = 0;
	free(r->missing);
	r->missing = NULL;
	return KVBP_OK;
fail:
	if (pinned) {
		pthread_mutex_lock(&t->lock);
		for (size_t i = 0; i < q->n_segments; i++)
			if (!q->segments[i].fresh)
				pin_drop(t, m->id, q->segments[i].hash);
		pthread_mutex_unlock(&t->lock);
	}
	if (!r->n_missing) {
		free(r->missing);
		r->missing = NULL;
	}
	session_free(t, s);
	return code;
}

/* ---- loading a layer into the ring ---- */

struct load_job {
	struct fuse_table *t;
	struct fuse_session *s;
	struct slot *slot;
	uint32_t layer;
	int err;
};

struct rotate_ctx {
	const struct blend_backend *be;
	const struct fuse_session *s;
	const struct chunk_ref *c;
	int err; /* a backend (device) failure: the load fails with it */
};

/* The K transform of a chunk's load: re-rotate rows as they leave LMDB (codec.h). */
static void rotate_rows(void *arg, const void *src, void *dst, size_t off, size_t len)
{
	struct rotate_ctx *x = arg;
	int rc;

	if (x->err)
		return;
	rc = x->be->rotate(x->be, &x->s->shape, &x->c->rot, src, dst,
			   (uint32_t)(off / x->s->row_bytes), (uint32_t)(len / x->s->row_bytes));
	if (rc)
		x->err = rc;
}

static int load_chunk(void *arg, size_t i)
{
	struct load_job *j = arg;
	struct fuse_session *s = j->s;
	struct chunk_ref *c = &s->chunks[i];
	struct rotate_ctx rx = { j->t->be, s, c, 0 };
	struct codec_xform x = { rotate_rows, &rx, s->row_bytes };
	int rc;

	/* One pass: verify the stored bytes and write them re-rotated into the slot. */
	rc = store_chunk_get_layer(j->t->store, &s->m, c->hash, j->layer,
				   j->slot->k + (size_t)c->off * s->row_bytes,
				   j->slot->v + (size_t)c->off * s->row_bytes,
				   (uint64_t)c->tokens * s->row_bytes, &x);
	return rc ? rc : rx.err;
}

/* Load layer into slot; called without the session lock, with the slot marked LOADING. */
static int load_layer(struct fuse_table *t, struct fuse_session *s, struct slot *slot,
		      uint32_t layer)
{
	struct load_job j = { t, s, slot, layer, 0 };

	if (s->dv)
		return dev_load(t, s, slot, layer);
	return pool_run(t->pool, s->n_chunks, load_chunk, &j);
}

/*
 * Load layer into sl, with the session lock held on entry and exit (dropped while
 * loading; the slot is marked LOADING meanwhile). Returns the store errno.
 */
static int load_slot_locked(struct fuse_table *t, struct fuse_session *s, struct slot *sl,
			    uint32_t layer)
{
	struct timespec t0;
	int rc;

	sl->layer = layer;
	sl->state = SLOT_LOADING;
	pthread_mutex_unlock(&s->lock);
	clock_gettime(CLOCK_MONOTONIC, &t0);
	rc = load_layer(t, s, sl, layer);
	pthread_mutex_lock(&s->lock);
	s->ns_load += ns_since(&t0);
	sl->state = rc ? SLOT_FAILED : SLOT_READY;
	sl->err = rc;
	pthread_cond_broadcast(&s->cond);
	return rc;
}

/* Make layer's slot READY (loading it here if nobody is); with the session lock held. */
static int ensure_layer(struct fuse_table *t, struct fuse_session *s, uint32_t layer,
			struct slot **out)
{
	struct slot *sl = &s->ring[(layer - s->first) % s->n_ring];

	for (;;) {
		if (sl->layer == layer && sl->state == SLOT_READY)
			break;
		if (sl->layer == layer && sl->state == SLOT_LOADING) {
			pthread_cond_wait(&s->cond, &s->lock);
			continue;
		}
		if (sl->state == SLOT_LOADING) { /* a prefetch of another layer: wait it out */
			pthread_cond_wait(&s->cond, &s->lock);
			continue;
		}
		if (load_slot_locked(t, s, sl, layer))
			break;
	}
	*out = sl;
	if (sl->state == SLOT_FAILED) {
		int rc = sl->err;

		sl->layer = -1;
		sl->state = SLOT_EMPTY;
		return rc;
	}
	return 0;
}

/* ---- landing: the layers go into the node's own buffers ---- */

/* Offset in the node's segment of row t of layer l, from base (k_offset or v_offset). */
static inline uint64_t land_off(const struct fuse_session *s, uint64_t base, uint32_t l,
				uint32_t t)
{
	const struct kvbp_layout *y = &s->lay;

	base += (uint64_t)l * y->layer_stride;
	if (y->page_tokens)
		return base + (uint64_t)y->pages[t / y->page_tokens] * y->page_stride +
		       (uint64_t)(t % y->page_tokens) * y->token_stride;
	return base + (uint64_t)t * y->token_stride;
}

/* Copy rows [a, b) of slot sl (K and V) into layer l of the node's buffers. */
static void land_rows(const struct fuse_session *s, const struct slot *sl, uint32_t l, uint32_t a,
		      uint32_t b)
{
	size_t hb = (size_t)s->m.head_dim * s->m.elem_size;

	for (uint32_t t = a; t < b; t++)
		for (int i = 0; i < 2; i++) {
			const uint8_t *src = (i ? sl->v : sl->k) + (size_t)t * s->row_bytes;
			uint8_t *dst = s->land_mem +
				       land_off(s, i ? s->lay.v_offset : s->lay.k_offset, l, t);

			if (s->lay.head_stride == hb) {
				memcpy(dst, src, s->row_bytes);
				continue;
			}
			for (uint32_t h = 0; h < s->m.num_kv_heads; h++)
				memcpy(dst + h * s->lay.head_stride, src + h * hb, hb);
		}
}

struct land_job {
	struct fuse_table *t;
	struct fuse_session *s;
	const struct slot *from; /* the layer is loaded here already (a check layer), or NULL */
	uint32_t layer;
};

/* Land chunk i of a layer: straight from the store when its rows lie together, else staged. */
static int land_chunk(void *arg, size_t i)
{
	struct land_job *j = arg;
	struct fuse_session *s = j->s;
	struct chunk_ref *c = &s->chunks[i];
	struct load_job lj = { j->t, s, &s->stage, j->layer, 0 };
	int rc;

	if (j->from) {
		land_rows(s, j->from, j->layer, c->off, c->off + c->tokens);
		return 0;
	}
	if (s->direct) {
		struct rotate_ctx rx = { j->t->be, s, c };
		struct codec_xform x = { rotate_rows, &rx, s->row_bytes };

		/* One pass: verify, re-rotate, write where the node keeps the rows. */
		return store_chunk_get_layer(j->t->store, &s->m, c->hash, j->layer,
					     s->land_mem + land_off(s, s->lay.k_offset, j->layer, c->off),
					     s->land_mem + land_off(s, s->lay.v_offset, j->layer, c->off),
					     (uint64_t)c->tokens * s->row_bytes, &x);
	}
	rc = load_chunk(&lj, i);
	if (!rc)
		land_rows(s, &s->stage, j->layer, c->off, c->off + c->tokens);
	return rc;
}

/* Make check slot i READY, loading it here unless another thread is; session lock held. */
static int ensure_cslot(struct fuse_table *t, struct fuse_session *s, size_t i)
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

static uint32_t store_code(int rc)
{
	return rc == -EBADMSG ? KVBP_CORRUPT : KVBP_INTERNAL;
}

/* Landing stopped at layer l for store errno rc: tell the node (session lock held). */
static void land_failed(struct fuse_session *s, uint32_t l, int rc)
{
	s->land_code = store_code(rc);
	log_warn("fuse session %016" PRIx64 ": layer %" PRIu32 " cannot be landed: %s", s->id, l,
		 rc == -EBADMSG ? "a chunk failed its checksum" : strerror(-rc));
	land_publish(s, KVBP_LAND_FAILED | s->land_code << 24 | s->land_next);
}

/*
 * Land the session's next layer (or first load the first check layer, which the
 * node asks about before any layer lands). Called by the prefetch thread holding
 * a reference; returns whether there is more to do, so that sessions take turns.
 */
static bool land_step(struct fuse_table *t, struct fuse_session *s)
{
	struct land_job j = { t, s, NULL, 0 };
	struct timespec t0;
	bool more;
	int rc = 0;

	pthread_mutex_lock(&s->lock);
	if (s->closed || s->land_stop || s->land_code || s->landing ||
	    s->land_next >= s->m.num_layers) {
		pthread_mutex_unlock(&s->lock);
		return false;
	}
	if (s->n_checks && s->cslot[0].state == SLOT_EMPTY) {
		rc = ensure_cslot(t, s, 0);
		if (rc)
			land_failed(s, s->checks[0], rc);
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
	pthread_mutex_unlock(&s->lock);
	clock_gettime(CLOCK_MONOTONIC, &t0);
	if (!rc)
		rc = pool_run(t->pool, s->n_chunks, land_chunk, &j);
	pthread_mutex_lock(&s->lock);
	s->ns_land += ns_since(&t0);
	s->landing = false;
	if (rc) {
		land_failed(s, j.layer, rc);
	} else if (!s->land_stop) {
		s->land_next++;
		s->layers_served++;
		s->bytes_out += 2 * (uint64_t)s->n_cached * s->row_bytes;
		land_publish(s, s->land_next);
	}
	pthread_cond_broadcast(&s->cond);
	more = !rc && !s->land_stop && s->land_next < s->m.num_layers;
	pthread_mutex_unlock(&s->lock);
	return more;
}

bool fuse_prefetch(struct fuse_table *t, uint64_t id)
{
	struct fuse_session *s = session_get(t, id, NULL);

	if (!s)
		return false;
	if (s->land) {
		bool more = land_step(t, s);

		session_put(t, s);
		return more;
	}
	pthread_mutex_lock(&s->lock);
	/* n_ring - 1 layers ahead: one slot holds the layer the node is reading. */
	for (uint32_t l = s->next_layer; !s->closed && l < s->m.num_layers &&
					 l < s->next_layer + s->n_ring - 1; l++) {
		struct slot *sl = &s->ring[(l - s->first) % s->n_ring];

		if (sl->layer == l || sl->state == SLOT_LOADING || sl->state == SLOT_SERVED)
			continue;
		if (load_slot_locked(t, s, sl, l))
			break;
	}
	pthread_mutex_unlock(&s->lock);
	session_put(t, s);
	return false;
}

/* ---- one layer ---- */

uint32_t fuse_layer_begin(struct fuse_table *t, uint64_t id, const char *owner, uint32_t layer,
			  struct fuse_session **sp, struct fuse_layer_plan *plan, char *err,
			  size_t errlen)
{
	struct fuse_session *s = session_get(t, id, owner);
	bool is_check;

	if (!s)
		return fail(err, errlen, KVBP_UNKNOWN_SESSION, "fuse session %016" PRIx64 " is not "
			    "open (closed, expired, or never opened)", id);
	pthread_mutex_lock(&s->lock);
	while (s->busy)
		pthread_cond_wait(&s->cond, &s->lock);
	if (s->land && s->next_check >= s->n_checks) {
		bool reuse = !s->n_checks;

		pthread_mutex_unlock(&s->lock);
		session_put(t, s);
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "%s: its layers land in the node's "
			    "buffers by themselves (wait on the progress word)", reuse ?
			    "a reuse-only session takes no layer requests" : "every check layer "
			    "of this session is done");
	}
	if (s->land && layer != s->checks[s->next_check]) {
		uint32_t want = s->checks[s->next_check];

		pthread_mutex_unlock(&s->lock);
		session_put(t, s);
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "layer %" PRIu32 " is not the session's "
			    "next check layer %" PRIu32 ": only check layers take requests; the "
			    "others land in the node's buffers", layer, want);
	}
	if (s->land) {
		/* A check layer: the rows of the metric's plane in, the selection out. */
		s->busy = true;
		memset(plan, 0, sizeof(*plan));
		plan->rows_in = s->next_check == 0 ? s->n : (uint32_t)s->n_sel;
		plan->row_bytes = s->row_bytes;
		plan->num_tokens = s->n;
		plan->selection_out = true;
		plan->land = true;
		pthread_mutex_unlock(&s->lock);
		*sp = s;
		return KVBP_OK;
	}
	if (layer < s->first) {
		pthread_mutex_unlock(&s->lock);
		session_put(t, s);
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "layer %" PRIu32 " comes before the first "
			    "check layer %" PRIu32 ": the node prefills it alone", layer, s->first);
	}
	if (s->next_layer >= s->m.num_layers) {
		pthread_mutex_unlock(&s->lock);
		session_put(t, s);
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "every layer has been served; close the "
			    "session");
	}
	if (layer != s->next_layer) {
		uint32_t want = s->next_layer;

		pthread_mutex_unlock(&s->lock);
		session_put(t, s);
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "layer %" PRIu32 " out of order; the "
			    "session expects layer %" PRIu32, layer, want);
	}
	s->busy = true;
	is_check = s->next_check < s->n_checks && s->checks[s->next_check] == layer;
	plan->rows_in = s->n_checks && s->next_check == 0 ? s->n : (uint32_t)s->n_sel;
	plan->row_bytes = s->row_bytes;
	plan->num_tokens = s->n;
	plan->land = false;
	plan->selection_out = is_check;
	plan->fused_out = !(is_check && s->next_check == 0);
	plan->shared_ring = s->shm_id != 0;
	plan->device_ring = s->dv && s->dv->exported;
	pthread_mutex_unlock(&s->lock);
	*sp = s;
	return KVBP_OK;
}

struct dev_job {
	const struct blend_backend *be;
	const struct blend_shape *shape;
	const uint8_t *fresh; /* row i at fresh + i * stride */
	const uint8_t *stored;
	const int32_t *idx;
	size_t n, parts, row_bytes, stride;
	float *out;
};

static int dev_part(void *arg, size_t i)
{
	const struct dev_job *j = arg;
	size_t a = j->n * i / j->parts, b = j->n * (i + 1) / j->parts;

	if (b <= a)
		return 0;
	if (j->stride == j->row_bytes)
		return j->be->deviation(j->be, j->shape, j->fresh + a * j->row_bytes, j->stored,
					j->idx + a, b - a, j->out + a);
	/* Strided rows (e.g. a slice of the node's fused QKV output): one row at a time. */
	for (size_t r = a; r < b; r++) {
		int rc = j->be->deviation(j->be, j->shape, j->fresh + r * j->stride, j->stored,
					  j->idx + r, 1, j->out + r);

		if (rc)
			return rc;
	}
	return 0;
}

static size_t parts_for(struct fuse_table *t, size_t bytes)
{
	size_t threads = pool_threads(t->pool) + 1;

	/* Below a few hundred KiB a hand-off costs more than it saves. */
	return bytes < (256u << 10) ? 1 : threads;
}

/*
 * HKVD at the session's next check layer: the deviation of every row sent (the
 * metric's plane, rows stride bytes apart) from the stored row of the same token
 * in plane (the re-rotated stored layer), then the top-k cached tokens plus every
 * fresh one. *sel is malloc'd, sorted. The session is not changed.
 */
static uint32_t check_select(struct fuse_table *t, struct fuse_session *s, const uint8_t *rows_in,
			     size_t stride, const uint8_t *plane, int32_t **sel_out, size_t *n_out,
			     char *err, size_t errlen)
{
	size_t rows = s->next_check == 0 ? s->n : s->n_sel, n_cand;
	int32_t *idx = malloc((rows + 1) * sizeof(int32_t));
	int32_t *cand = malloc((rows + 1) * sizeof(int32_t));
	float *dev = malloc((rows + 1) * sizeof(float));
	int32_t *sel = malloc((s->n + 1) * sizeof(int32_t));
	struct dev_job dj;
	long n_sel;
	int rc;

	if (!idx || !cand || !dev || !sel) {
		free(idx);
		free(cand);
		free(dev);
		free(sel);
		return fail(err, errlen, KVBP_LIMIT, "out of memory");
	}
	for (size_t i = 0; i < rows; i++)
		idx[i] = s->next_check == 0 ? (int32_t)i : s->sel[i];
	dj = (struct dev_job){ t->be, &s->shape, rows_in, plane, idx, rows, 1, s->row_bytes,
			       stride, dev };
	dj.parts = parts_for(t, rows * s->row_bytes);
	rc = pool_run(t->pool, dj.parts, dev_part, &dj);
	if (rc) {
		char why[160];

		free(idx);
		free(cand);
		free(dev);
		free(sel);
		return fail(err, errlen, KVBP_INTERNAL, "deviation: %s",
			    compute_error(t, rc, why, sizeof(why)));
	}
	/* Candidates: the cached tokens among the rows (fresh ones are always kept). */
	n_cand = candidates(s, idx, rows, dev, cand);
	n_sel = t->be->select(t->be, cand, dev, n_cand,
			      hkvd_count(s->ratios[s->next_check], s->n_cached), s->fresh,
			      s->n_fresh, sel);
	free(idx);
	free(cand);
	free(dev);
	if (n_sel < 0) {
		char why[160];

		free(sel);
		if (n_sel == -ENOMEM)
			return fail(err, errlen, KVBP_LIMIT, "out of memory");
		return fail(err, errlen, KVBP_INTERNAL, "HKVD selection: %s",
			    compute_error(t, (int)n_sel, why, sizeof(why)));
	}
	*sel_out = sel;
	*n_out = (size_t)n_sel;
	return KVBP_OK;
}

/*
 * Fuse in place: the fresh rows of the selected tokens overwrite their stored rows
 * in the slot, which then holds the fused layer. Only |S| rows move.
 */
static void scatter_fresh(const struct fuse_session *s, struct slot *sl, const uint8_t *k_in,
			  const uint8_t *v_in)
{
	for (size_t j = 0; j < s->n_sel; j++) {
		size_t t = (size_t)s->sel[j];

		memcpy(sl->k + t * s->row_bytes, k_in + j * s->row_bytes, s->row_bytes);
		memcpy(sl->v + t * s->row_bytes, v_in + j * s->row_bytes, s->row_bytes);
	}
}

uint32_t fuse_layer_run(struct fuse_table *t, struct fuse_session *s, const void *k_in,
			const void *v_in, void *k_out, void *v_out, bool on_device,
			struct fuse_layer_result *r, char *err, size_t errlen)
{
	uint32_t layer = s->next_layer, code = KVBP_OK;
	bool is_check = s->next_check < s->n_checks && s->checks[s->next_check] == layer;
	bool first_check = is_check && s->next_check == 0;
	uint64_t rows_in = first_check ? s->n : s->n_sel;
	struct timespec t0;
	struct slot *sl;
	int rc;

	memset(r, 0, sizeof(*r));
	pthread_mutex_lock(&s->lock);
	/* This request says the node is done with the layer served before. */
	if (s->served >= 0) {
		s->ring[s->served].layer = -1;
		s->ring[s->served].state = SLOT_EMPTY;
		s->served = -1;
	}
	rc = ensure_layer(t, s, layer, &sl);
	pthread_mutex_unlock(&s->lock);
	if (rc) {
		char why[160];

		return fail(err, errlen, rc == -EBADMSG ? KVBP_CORRUPT : KVBP_INTERNAL,
			    "layer %" PRIu32 ": cannot read stored chunks: %s", layer,
			    rc == -EBADMSG ? "a chunk failed its checksum" :
			    compute_error(t, rc, why, sizeof(why)));
	}
	clock_gettime(CLOCK_MONOTONIC, &t0);
	if (s->dv) {
		int32_t *sel = NULL;
		size_t n_sel = 0;

		rc = dev_layer(t, s, sl, rows_in, k_in, v_in, is_check,
			       !first_check && !(on_device && s->dv->exported), k_out, v_out, &sel,
			       &n_sel);
		if (rc) {
			char why[160];
			const char *msg = compute_error(t, rc, why, sizeof(why));

			/* What the slot holds now is unknown: load it again next time. */
			pthread_mutex_lock(&s->lock);
			sl->layer = -1;
			sl->state = SLOT_EMPTY;
			pthread_mutex_unlock(&s->lock);
			/* The operator sees it too: a device that keeps failing is one to replace. */
			log_warn("fuse session %016" PRIx64 " layer %" PRIu32 ": %s", s->id, layer, msg);
			return fail(err, errlen, rc == -ENOMEM ? KVBP_LIMIT : KVBP_INTERNAL,
				    "layer %" PRIu32 ": %s", layer, msg);
		}
		if (is_check) {
			memcpy(s->sel, sel, n_sel * sizeof(int32_t));
			s->n_sel = n_sel;
			r->selection = sel;
			r->n_selection = n_sel;
			s->next_check++;
		}
	} else if (is_check) {
		int32_t *sel;
		size_t n_sel;

		code = check_select(t, s, s->metric ? k_in : v_in, s->row_bytes,
				    s->metric ? sl->k : sl->v, &sel, &n_sel, err, errlen);
		if (code)
			return code;
		/* At later check layers the fused output still uses the selection before it narrows. */
		if (s->next_check > 0)
			scatter_fresh(s, sl, k_in, v_in);
		memcpy(s->sel, sel, n_sel * sizeof(int32_t));
		s->n_sel = n_sel;
		r->selection = sel;
		r->n_selection = n_sel;
		s->next_check++;
	} else {
		scatter_fresh(s, sl, k_in, v_in);
	}
	if (!s->dv && !first_check && k_out) {
		memcpy(k_out, sl->k, (size_t)s->n * s->row_bytes);
		memcpy(v_out, sl->v, (size_t)s->n * s->row_bytes);
	}
	pthread_mutex_lock(&s->lock);
	s->ns_compute += ns_since(&t0);
	s->layers_served++;
	s->bytes_in += 2 * rows_in * s->row_bytes;
	s->bytes_out += first_check ? 0 : 2 * (uint64_t)s->n * s->row_bytes;
	s->next_layer++;
	if (first_check) {
		/* Nothing served from it: a prefetch may reuse the slot now. */
		sl->layer = -1;
		sl->state = SLOT_EMPTY;
	} else {
		sl->state = SLOT_SERVED;
		s->served = sl - s->ring;
		r->ring_slot = (uint32_t)s->served;
	}
	r->next_layer = s->next_layer;
	r->rows_next = (uint32_t)s->n_sel;
	r->done = s->next_layer >= s->m.num_layers;
	pthread_mutex_unlock(&s->lock);
	return code;
}

uint32_t fuse_check_run(struct fuse_table *t, struct fuse_session *s, const void *rows,
			size_t stride, struct fuse_layer_result *r, char *err, size_t errlen)
{
	uint32_t layer = s->checks[s->next_check], code;
	size_t prev = s->next_check == 0 ? s->n : s->n_sel, n_sel, nd = 0;
	struct timespec t0;
	int32_t *sel, *dropped;
	int rc;

	memset(r, 0, sizeof(*r));
	pthread_mutex_lock(&s->lock);
	rc = ensure_cslot(t, s, s->next_check);
	pthread_mutex_unlock(&s->lock);
	if (rc) {
		char why[160];

		return fail(err, errlen, store_code(rc), "layer %" PRIu32 ": cannot read stored "
			    "chunks: %s", layer, rc == -EBADMSG ? "a chunk failed its checksum" :
			    compute_error(t, rc, why, sizeof(why)));
	}
	clock_gettime(CLOCK_MONOTONIC, &t0);
	code = check_select(t, s, rows, stride, s->metric ? s->cslot[s->next_check].k :
			    s->cslot[s->next_check].v, &sel, &n_sel, err, errlen);
	if (code)
		return code;
	/* The rows the node sent but computes no more: sorted, as both lists are. */
	dropped = malloc((prev + 1) * sizeof(int32_t));
	if (!dropped) {
		free(sel);
		return fail(err, errlen, KVBP_LIMIT, "out of memory");
	}
	for (size_t i = 0, j = 0; i < prev; i++) {
		int32_t tok = s->next_check == 0 ? (int32_t)i : s->sel[i];

		while (j < n_sel && sel[j] < tok)
			j++;
		if (j == n_sel || sel[j] != tok)
			dropped[nd++] = tok;
	}
	pthread_mutex_lock(&s->lock);
	memcpy(s->sel, sel, n_sel * sizeof(int32_t));
	s->n_sel = n_sel;
	s->next_check++;
	s->ns_compute += ns_since(&t0);
	s->bytes_in += (uint64_t)prev * s->row_bytes;
	r->selection = sel;
	r->n_selection = n_sel;
	r->dropped = dropped;
	r->n_dropped = nd;
	r->next_layer = s->next_check < s->n_checks ? s->checks[s->next_check] : s->m.num_layers;
	r->rows_next = (uint32_t)n_sel;
	r->done = s->next_check >= s->n_checks;
	pthread_mutex_unlock(&s->lock);
	return KVBP_OK;
}

void fuse_layer_end(struct fuse_table *t, struct fuse_session *s)
{
	pthread_mutex_lock(&s->lock);
	s->busy = false;
	pthread_cond_broadcast(&s->cond);
	pthread_mutex_unlock(&s->lock);
	session_put(t, s);
}

uint32_t fuse_close(struct fuse_table *t, uint64_t id, const char *owner, struct kvbp_stat **stats,
		    size_t *n, char *err, size_t errlen)
{
	struct fuse_session *s = NULL;
	struct kvbp_stat *st;
	size_t k = 0;

	*stats = NULL;
	*n = 0;
	/*
	 * Take it out of the table holding a reference of our own: a layer request on
	 * another worker or the prefetch thread may hold it too, and whoever drops the
	 * last reference frees it, so the stats below must be read before ours goes.
	 */
	pthread_mutex_lock(&t->lock);
	for (uint64_t i = 0; i < t->lim.max_sessions && !s; i++)
		if (session_is(t, i, id, owner)) {
			s = t->sessions[i];
			s->refs++;
			session_remove(t, i);
		}
	pthread_mutex_unlock(&t->lock);
	if (!s)
		return fail(err, errlen, KVBP_UNKNOWN_SESSION, "fuse session %016" PRIx64 " is not "
			    "open (closed, expired, or never opened)", id);
	/* Nothing may land in the node's buffers once it has its reply: the node reuses them. */
	pthread_mutex_lock(&s->lock);
	s->land_stop = true;
	while (s->landing)
		pthread_cond_wait(&s->cond, &s->lock);
	pthread_mutex_unlock(&s->lock);
	st = calloc(13, sizeof(*st));
	if (st) {
		pthread_mutex_lock(&s->lock);
#define STAT(nm, v) (snprintf(st[k].name, sizeof(st[k].name), "%s", nm), st[k++].value = (double)(v))
		STAT("tokens", s->n);
		STAT("cached_tokens", s->n_cached);
		STAT("selected_tokens", s->n_sel);
		STAT("layers_served", s->layers_served);
		STAT("load_ms", s->ns_load / 1e6);
		STAT("compute_ms", s->ns_compute / 1e6);
		STAT("lifetime_ms", ns_since(&s->opened) / 1e6); /* from open to close */
		STAT("ring_bytes", s->bytes);
		STAT("bytes_in", s->bytes_in);
		STAT("bytes_out", s->bytes_out);
		if (s->land) {
			STAT("land_ms", s->ns_land / 1e6);
			STAT("layers_landed", s->land_next - s->land_begin);
			STAT("land_failed", s->land_code != 0);
		}
#undef STAT
		pthread_mutex_unlock(&s->lock);
		*stats = st;
		*n = k;
	}
	session_put(t, s);
	return KVBP_OK;
}

unsigned fuse_expire(struct fuse_table *t)
{
	struct timespec now;
	unsigned n = 0;

	/* Freed after the lock is dropped: a session's device blocks go back under it. */
	struct fuse_session **gone = calloc(t->lim.max_sessions + 1, sizeof(*gone));

	if (!gone)
		return 0;
	clock_gettime(CLOCK_MONOTONIC, &now);
	pthread_mutex_lock(&t->lock);
	for (uint64_t i = 0; i < t->lim.max_sessions; i++) {
		struct fuse_session *s = t->sessions[i];

		if (!s || !s->ready || s->refs || (uint64_t)(now.tv_sec - s->last_used.tv_sec) < t->lim.idle_s)
			continue;
		log_info("fuse session %016" PRIx64 " idle for %" PRIu64 " s: released", s->id,
			 (uint64_t)(now.tv_sec - s->last_used.tv_sec));
		session_remove(t, i);
		gone[n++] = s;
	}
	pthread_mutex_unlock(&t->lock);
	for (unsigned i = 0; i < n; i++)
		session_free(t, gone[i]);
	free(gone);
	return n;
}

void fuse_usage(struct fuse_table *t, uint64_t *sessions, uint64_t *bytes, uint64_t *pins)
{
	uint64_t n = 0;

	pthread_mutex_lock(&t->lock);
	for (uint64_t i = 0; i < t->lim.max_sessions; i++)
		n += t->sessions[i] && t->sessions[i]->ready;
	*sessions = n;
	*bytes = t->bytes;
	*pins = t->n_pins;
	pthread_mutex_unlock(&t->lock);
}
