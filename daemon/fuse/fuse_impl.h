/*
 * fuse_impl — what the modules of the fuse session engine (daemon/fuse/) share, and
 * no one else: the session and table structures and each module's entry points.
 * The public contract is daemon/fuse/fuse.h. The modules, each over the ones below it:
 *
 *   loader.c   the engine's thread: layers loaded ahead and landed for the sessions
 *              the workers kick, idle sessions freed (calls layer, session)
 *   open.c     fuse_open, in the steps it takes (calls session, land, device)
 *   layer.c    what an open session serves: prefetch, layer and check requests
 *              (calls session, land, load, device)
 *   session.c  the table: sessions' lifecycle, lookup, close, expiry, pins, usage
 *              (calls device)
 *   land.c     landing layers in the node's own buffers (calls load, dland)
 *   dland.c    landing into the node's device memory (calls device)
 *   load.c     loading a layer of stored chunks, re-rotated, into a ring slot
 *              (calls device)
 *   device.c   the device path: a session's ring in device memory, its block cache
 *
 * No module calls one above it. Locking: the table lock guards the session table,
 * the memory budget, the pins and the block cache; a session's lock guards its
 * slots and counters. Functions returning a kvbp code write a message to err.
 */
#ifndef KVBLEND_DAEMON_FUSE_IMPL_H
#define KVBLEND_DAEMON_FUSE_IMPL_H

#include <errno.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <time.h>

#include "store/codec.h"
#include "blend/device.h"
#include "daemon/fuse/fuse.h"

enum slot_state { SLOT_EMPTY = 0, SLOT_LOADING, SLOT_READY, SLOT_FAILED, SLOT_SERVED };

struct slot {
	int64_t layer; /* -1: none */
	enum slot_state state;
	int err;    /* store errno when SLOT_FAILED */
	uint8_t *k; /* [N, heads, head_dim]: re-rotated stored keys; fresh rows zero */
	uint8_t *v; /* right after k in one allocation or shared segment */
	uint8_t skip; /* a plane nothing reads, not loaded (host loads only): SKIP_K, SKIP_V */
};

enum { SKIP_K = 1, SKIP_V = 2 };

struct chunk_ref {
	uint8_t hash[KVBP_HASH_LEN];
	uint32_t off; /* first row in the session's token order */
	uint32_t tokens;
	uint32_t base_pos; /* where its keys were rotated when stored */
	struct rope_table rot[2]; /* rope_tables_for_desc: [1] for a model's local layers */
	_Atomic bool corrupt; /* a read of it failed its checksum: removed when the session goes */
};

struct fuse_session {
	uint64_t id;
	pthread_mutex_t lock;
	pthread_cond_t cond; /* a slot finished loading, or the session became free */
	unsigned refs;	     /* under the table lock */
	bool busy;	     /* a layer request holds the session */
	bool closed;	     /* removed from the table; freed by the last ref */
	bool ready;	     /* published in the table: findable by id (under the table lock) */
	bool expired;	     /* released for idleness, not closed by its node */
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
	uint32_t metric; /* KVBP_METRIC_*: 0 value, 1 key, 2 attention */
	float *attn;	 /* attention metric: A [n_cached, heads], the last the node sent, or NULL */
	int32_t *sel;	 /* current selection, sorted; room for n */
	size_t n_sel;
	uint32_t next_layer;
	size_t next_check; /* index into checks of the next check layer */
	struct slot *ring;
	uint32_t n_ring;
	int64_t served; /* slot holding the fused layer the node reads now, or -1 */
	uint8_t *ring_mem;
	uint64_t shm_id; /* the ring is this shared segment (0: heap) */
	uint64_t bytes;	 /* ring memory (host), against fuse_max_bytes */
	uint64_t dev_bytes; /* its device block, against the device budget */
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
	uint32_t land_h0, land_hn; /* the node's heads: stored heads [land_h0, land_h0 + land_hn) */
	bool landing;	   /* a layer is being landed (by the prefetch thread) */
	bool land_stop;	   /* closing: land nothing more */
	uint32_t land_code; /* a layer failed to land: its kvbp code (0: none) */
	bool direct;	   /* a device landing: chunks decoded whole into the host staging */
	bool stream;	   /* rows written with non-temporal stores (land.c) */
	struct slot *cslot; /* one per check layer: K and V of all tokens */
	uint8_t *land_buf;  /* memory of cslot[] */
	uint64_t ns_land;
	struct dev_sess *dv; /* the session's ring on the device (the table has one), or NULL */
	struct dev_land *dl; /* landing into the node's device memory (device.c), or NULL */
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

/* A session's streams and ring events, kept for the next session (n_ev >= its ring). */
struct dev_streams {
	struct blend_stream *copy, *comp;
	struct blend_event **ev;
	uint32_t n_ev;
};

struct arena; /* arena.h: the reserve's bookkeeping */

/* Nodes' device allocations landed into at once (struct fuse_table's imports), and of
 * those one client may have had mapped (an engine has one cache allocation a GPU). */
#define FUSE_IMPORTS_MAX 16
#define FUSE_IMPORTS_PER_OWNER 4

struct fuse_table {
	struct fuse_limits lim;
	struct fuse_loader *loader; /* its thread (loader.c), once started; stopped before
				     * the table is freed (fuse_loader_stop) */
	struct store *store;
	/* told of each chunk a session found corrupt, once the session has let go of it
	 * (fuse_on_corrupt; NULL: left to the next read or the scrub) */
	void (*on_corrupt)(void *arg, uint32_t model_id, const uint8_t *hash);
	void *corrupt_arg;
	struct pool *pool;
	const struct blend_backend *be;
	const struct blend_device *dev; /* sessions keep their rings here (NULL: host only) */
	bool dev_down; /* dev failed for good (logged once): new sessions run on the CPU */
	uint64_t dev_budget;   /* lim.dev_max_bytes resolved (UINT64_MAX: none) */
	uint64_t dev_bytes;    /* device blocks of open sessions (under lock) */
	uint64_t dev_fallbacks; /* sessions sent to the host path (under lock) */
	struct dblock *cache;		/* under lock */
	size_t n_cache, cap_cache;
	uint64_t cached;     /* host and device blocks kept */
	uint64_t cached_dev; /* of which device blocks */
	/* Exported blocks of expired sessions: their node may still map them, so they are
	 * freed only at exit, and stay charged to the device budget (under lock). */
	struct dblock *orphans;
	size_t n_orphans;
	/* Blocks given up on a session's path, freed later by block_reap() (under lock):
	 * cudaFree and cudaFreeHost stall the whole device, so not while a node waits. */
	struct dblock *reap;
	size_t n_reap, cap_reap;
	/* Streams and events of closed sessions, for the next ones (under lock). */
	struct dev_streams *spool;
	size_t n_spool, cap_spool;
	/* Device and pinned blocks allocated (cache misses), and shared rings pinned in
	 * place (host_register) and unpinned, since the table was made. */
	_Atomic uint64_t n_allocs, n_registrations, n_unregistrations;
	/* Sizes a session's open had to allocate (a cache miss), the latest first: the
	 * expiry thread allocates a spare of each into the cache, off the sessions' path,
	 * so that the next session of that shape finds one (under lock). */
	struct dblock want[8];
	size_t n_want;
	_Atomic uint64_t n_spares; /* spares allocated so */
	/* lim.dev_reserve's memory, allocated when the table is made ([0] device, [1]
	 * pinned host; NULL: none), and the arenas sessions' blocks are carved from
	 * (under lock). */
	void *reserve[2];
	struct arena *arena[2];
	struct shm_table *shm;
	/* Nodes' device allocations that landing sessions write into, mapped by their IPC
	 * handles or the descriptors they handed in: each mapped once per client while its
	 * sessions use it, unmapped when the last one closes (under lock). */
	struct dimport {
		uint8_t handle[KVBP_DEVICE_HANDLE_LEN];
		char pci[KVBP_DEVICE_PCI_MAX]; /* the device the node named */
		char owner[SHM_OWNER_MAX];     /* the client that mapped it */
		void *base;
		uint64_t bytes;
		uint32_t refs;
		/* mapped from descriptors (fd_open; fd_close with ctx): the places in [0,
		 * bytes) that are mapped, every layer of a layout checked to lie in one */
		bool by_fd;
		void *ctx;
		uint32_t n_segs;
		struct dimport_seg {
			uint64_t offset, size;
		} *segs;
		/* IMPORT_OPENING or IMPORT_CLOSING: the driver maps or unmaps it, the table
		 * lock dropped; a session after the same handle waits (imports_cond) */
		uint8_t state;
	} imports[FUSE_IMPORTS_MAX];
	pthread_cond_t imports_cond; /* an import finished opening or closing */
	pthread_mutex_t lock; /* sessions, bytes, pins, imports */
	struct fuse_session **sessions;
	uint64_t bytes;
	struct pin *pins;
	size_t n_pins, cap_pins;
};

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
	struct blend_event **loaded; /* per ring slot: uploaded and re-rotated (n_loaded) */
	uint32_t n_loaded;
	uint8_t *blk;		     /* the device block everything below is carved from */
	size_t blk_bytes;
	uint8_t *hring; /* the pinned host ring, from the cache (heap rings) */
	size_t hring_bytes;
	/*
	 * Pinned staging, from the cache too: a request's fresh rows (from its frames) go
	 * up from hk, hv, and the host's arrays of a check layer live in hidx .. hsel, so
	 * that no copy reads or writes pageable memory (those block the worker and run
	 * at a fraction of PCIe speed).
	 */
	uint8_t *hstage;
	size_t hstage_bytes;
	uint8_t *hk, *hv;
	int32_t *hidx, *hcand, *hsel;
	float *hdev;
	/* What the open uploads: the fresh tokens, and the spans and rotation tables in
	 * the layout they have at the end of the device block (dev_layout). */
	int32_t *halways;
	uint8_t *hspans;
	uint32_t allocs;  /* blocks the open allocated (not from the cache) */
	bool registered; /* the shared ring is pinned in place */
	bool reg_fresh;	 /* this open pinned it (else it was pinned already: shm_pin) */
	size_t reg_bytes; /* its size */
	bool exported;	 /* the block is mapped by the node (CUDA IPC): never reused */
	uint64_t zeroed; /* bytes of the pinned host ring zeroed at open */
	uint64_t slot_bytes;
	uint8_t *ring;	 /* n_ring slots, K then V of all tokens each */
	uint8_t *fk, *fv; /* a request's fresh rows, up to n each */
	int32_t *idx, *cand, *always, *sel, *out;
	float *dev, *cdev;
	uint8_t *scratch;
	size_t scratch_bytes;
	/* host array: chunk i's rotation table of kind k, on the device, at
	 * k * (n_chunks + 1) + i */
	struct blend_dev_table *tabs;
	/* The chunks as spans of a layer (device memory, uploaded at open): a layer's keys
	 * are re-rotated in one launch. A group of n_chunks + 1 spans per rotation kind
	 * (rot_kind), each n_spans long: chunks with tokens; span_rows: their rows. */
	struct blend_dev_span *spans;
	uint32_t n_spans, span_rows;
};

/*
 * A call of the table's device failed (its -EIO, carried under a code of its own so
 * that a store's -EIO, a read error, is not taken for one).
 */
#define DEV_FAILED (-EREMOTEIO)

static inline int dev_rc(int rc)
{
	return rc == -EIO ? DEV_FAILED : rc;
}

__attribute__((format(printf, 4, 5))) static inline uint32_t fail(char *err, size_t errlen,
								  uint32_t code, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(err, errlen, fmt, ap);
	va_end(ap);
	return code;
}

static inline uint64_t ns_since(const struct timespec *t0)
{
	struct timespec now;

	clock_gettime(CLOCK_MONOTONIC, &now);
	return (uint64_t)(now.tv_sec - t0->tv_sec) * 1000000000u + (uint64_t)now.tv_nsec -
	       (uint64_t)t0->tv_nsec;
}

/*
 * The kvbp code of a store errno that stopped a load: corrupt only for a failed
 * check (the chunk is removed); a sound chunk quantized in rows a load cannot take
 * (-ENOTSUP: not one per token) is bad_shape, and stays.
 */
static inline uint32_t store_code(int rc)
{
	return rc == -EBADMSG ? KVBP_CORRUPT : rc == -ENOTSUP ? KVBP_BAD_SHAPE : KVBP_INTERNAL;
}

/* Cached tokens among rows idx[0..rows) with their deviations, compacted into cand, dev. */
static inline size_t candidates(const struct fuse_session *s, const int32_t *idx, size_t rows,
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

/* ---- session.c: the table ---- */

/* Pin chunk hash of model_id for a session (under the table lock): 0 or -ENOMEM. */
int pin_add(struct fuse_table *t, uint32_t model_id, const uint8_t *hash);
/* Drop one pin of the chunk, if held (under the table lock). */
void pin_drop(struct fuse_table *t, uint32_t model_id, const uint8_t *hash);
/* Free session s and everything it holds (its device blocks to the cache). Accepts NULL. */
void session_free(struct fuse_table *t, struct fuse_session *s);
/* Find owner's session id (NULL: any owner) and take a reference, or NULL. */
struct fuse_session *session_get(struct fuse_table *t, uint64_t id, const char *owner);
/* Drop a reference; the last one of a closed session frees it. */
void session_put(struct fuse_table *t, struct fuse_session *s);

/* ---- device.c: the device path ---- */

/* Device and pinned blocks are carved and sized at this alignment. */
#define DEV_ALIGN 256

static inline size_t dev_align(size_t x)
{
	return (x + DEV_ALIGN - 1) / DEV_ALIGN * DEV_ALIGN;
}

/*
 * The device path's block cache (device.c), which device landings (dland.c) take
 * their staging from. block_take: a block of at least bytes (device, or pinned host
 * memory): a cached one of up to 1.25 times that, else one carved from the reserve
 * (unless reserve is false), else a new one, counted in *allocs; *got: its real size.
 * block_give: keep it for the next session while within budget, else free it later.
 * block_free_later: freed by the next block_reap(), off a session's path.
 */
int block_take(struct fuse_table *t, bool host, size_t bytes, void **out, size_t *got,
	       uint32_t *allocs, bool reserve);
void block_give(struct fuse_table *t, bool host, void *p, size_t bytes);
void block_free_later(struct fuse_table *t, bool host, void *p, size_t bytes);
/* Bytes of the chunks' spans and rotation tables, which end a session's device block. */
size_t dev_setup_bytes(const struct fuse_session *s);

/*
 * Whether a new session may put its ring on the table's device: false without one,
 * and once the device failed for good (a sticky error: its broken()), which the
 * first call to see it logs, dropping the block cache. Such sessions run on the CPU
 * path, as with --device cpu.
 */
bool dev_usable(struct fuse_table *t);
/*
 * Make the shared-memory table pin rings on the device (on), or stop, unpinning every
 * ring still pinned (off: at exit, with no session left). Nothing without a device.
 */
void dev_pinner_set(struct fuse_table *t, bool on);
/* Why a load or a kernel failed: the device's own message (in buf) for DEV_FAILED, else the errno's. */
const char *compute_error(const struct fuse_table *t, int rc, char *buf, size_t len);
/* Why a load of stored chunks stopped (a store errno), in words; else compute_error()'s. */
const char *load_error(const struct fuse_table *t, int rc, char *buf, size_t len);
/* Drop every cached block and free those waiting for block_reap() (to make room on the
 * device; and at exit, with the pooled streams). */
void block_flush(struct fuse_table *t);
/* Free the blocks sessions gave up since the last call (off the sessions' path: the
 * thread that expires sessions calls it, once a second). */
void block_reap(struct fuse_table *t);
/*
 * Allocate into the cache a spare block of each size a session's open had to allocate
 * since the last call, within the budgets (off the sessions' path: the thread that
 * expires sessions calls it, once a second, after block_reap()).
 */
void block_spares(struct fuse_table *t);
/* Allocate lim.dev_reserve of device and pinned memory for sessions' blocks (a failure
 * is logged: blocks are then allocated as sessions need them). */
void dev_reserve_open(struct fuse_table *t);
/* Free the reserved memory (at exit, after block_flush()). */
void dev_reserve_close(struct fuse_table *t);
/* Free the pooled streams and events (at exit). */
void dev_streams_flush(struct fuse_table *t);
/* Free the orphaned blocks (at exit, when no node maps them any more). */
void block_orphans_free(struct fuse_table *t);
/* Drop cached blocks until sessions and cache together fit in fuse_max_bytes. */
void block_trim(struct fuse_table *t);
/* Carve (or, with base NULL, only measure) a session's device block; returns its size. */
size_t dev_layout(const struct fuse_session *s, struct dev_sess *d, uint8_t *base);
/* Drop s->dv before its setup began (nothing on the device yet). Accepts none. */
void dev_drop(struct fuse_session *s);
/* Free s->dv (its blocks back to the cache unless exported or failed). Accepts none. */
void dev_sess_free(struct fuse_table *t, struct fuse_session *s);
/* The device half of a session's open: 0, a negative errno or DEV_FAILED. */
int dev_sess_setup(struct fuse_table *t, struct fuse_session *s, size_t ring_bytes, bool zero);
/* Load layer into ring slot sl on the device: 0, the store's errno, or DEV_FAILED. */
int dev_load(struct fuse_table *t, struct fuse_session *s, struct slot *sl, uint32_t layer);
/* The node's layer on the device (fuse_layer_run's work for a device session). */
int dev_layer(struct fuse_table *t, struct fuse_session *s, struct slot *sl, uint64_t rows_in,
	      const void *k_in, const void *v_in, bool is_check, bool out, void *k_out,
	      void *v_out, int32_t **sel, size_t *n_sel);

/* ---- load.c: a layer into the ring ---- */

struct load_job {
	struct fuse_table *t;
	struct fuse_session *s;
	struct slot *slot;
	uint32_t layer;
	int err;
};

/*
 * The kinds of rotation a session's model has (kvb_model_desc_kinds), and the kind of
 * layer l (an index into chunk_ref.rot, and into the device's groups of spans).
 */
static inline size_t rot_kinds(const struct fuse_session *s)
{
	return kvb_model_desc_kinds(&s->m.desc);
}

static inline size_t rot_kind(const struct fuse_session *s, uint32_t l)
{
	return kvb_model_desc_local(&s->m.desc, l);
}

struct rotate_ctx {
	const struct blend_backend *be;
	const struct fuse_session *s;
	const struct chunk_ref *c;
	const struct rope_table *rot; /* of c's layer: rope_table_of_layer() */
	int err; /* a backend (device) failure: the load fails with it */
};


/* The K transform of a chunk's load: re-rotate rows as they leave LMDB (codec.h). */
void rotate_rows(void *arg, const void *src, void *dst, size_t off, size_t len);
/* Load chunk i of j->layer (a struct load_job) into j->slot, verified and re-rotated. */
int load_chunk(void *arg, size_t i);
/*
 * Load layer into sl, with the session lock held on entry and exit (dropped while
 * loading; the slot is marked LOADING meanwhile). Returns the store errno.
 */
int load_slot_locked(struct fuse_table *t, struct fuse_session *s, struct slot *sl,
		     uint32_t layer);
/* Make layer's slot READY (loading it here if nobody is); with the session lock held. */
int ensure_layer(struct fuse_table *t, struct fuse_session *s, uint32_t layer, struct slot **out);

/* ---- land.c: layers into the node's buffers ---- */

/* Publish that layers 0 .. v-1 are in place (or, with KVBP_LAND_FAILED, that landing stopped). */
void land_publish(struct fuse_session *s, uint32_t v);
/* Check the node's layout y for s against its segment and hold the segment: a kvbp code. */
uint32_t land_setup(struct fuse_table *t, struct fuse_session *s, const struct kvbp_layout *y,
		    const char *owner, char *err, size_t errlen);
/* The check-layer slots, in one allocation of bytes (fresh rows zeroed): 0 or -ENOMEM. */
int land_alloc(struct fuse_session *s, uint64_t bytes);
/* Make check slot i READY, loading it here unless another thread is; session lock held. */
int ensure_cslot(struct fuse_table *t, struct fuse_session *s, size_t i);
/* Land the session's next layer (prefetch thread, holding a reference): whether there is more. */
bool land_step(struct fuse_table *t, struct fuse_session *s);

/*
 * Landing into the node's device memory (device.c): y's offsets are into the
 * allocation behind y's IPC handle, which is mapped (once per handle) and must hold
 * the end bytes the layout spans. Each layer is landed by the host into pinned
 * staging as rows (s->lay becomes that contiguous layout), then copied up and
 * written into the node's cache by the device's land kernel. dland_setup checks and
 * maps (a kvbp code); dland_bytes gives the staging's pinned and device bytes, which
 * the open charges before dland_alloc takes them (a kvbp code).
 */
/* k_span, v_span: the bytes one layer's K and V span from their layer's start (their
 * offset + l * layer_stride), every layer of which must lie in one mapped place of an
 * allocation mapped from descriptors (a segment each). */
uint32_t dland_setup(struct fuse_table *t, struct fuse_session *s, const struct kvbp_layout *y,
		     const char *owner, uint64_t end, uint64_t k_span, uint64_t v_span,
		     char *err, size_t errlen);
void dland_bytes(const struct fuse_session *s, uint64_t *host, uint64_t *dev);
uint32_t dland_alloc(struct fuse_table *t, struct fuse_session *s, char *err, size_t errlen);
/* Layer l from its staging buffer on its way into the node's device memory; *done:
 * the layers (from 0) in place now, to publish (the last layer's landing is waited
 * for; another's completes while the host reads the next one). raw: the host wrote
 * the chunks' keys as stored, and the device re-rotates them (every chunk's in one
 * launch) before they land; else the host rotated them (a check layer's slot). */
int dland_layer(struct fuse_table *t, struct fuse_session *s, uint32_t l, bool raw,
		uint32_t *done);
/* Wait for everything queued (a close, or a landing that failed); returns how many
 * layers from 0 are in place: next, or fewer when the device failed meanwhile. */
uint32_t dland_quiesce(struct fuse_table *t, struct fuse_session *s, uint32_t next);
void dland_free(struct fuse_table *t, struct fuse_session *s);
/* The pinned staging buffer the host lands layer l into. */
uint8_t *dland_stage(const struct fuse_session *s, uint32_t l);

#endif
