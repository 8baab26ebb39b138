/*
 * fuse — CacheBlend fuse sessions: a serving node opens a session over an
 * ordered list of stored chunks and fresh tokens, then sends, layer by layer,
 * fresh K and V for the tokens the protocol asks for; the daemon answers with
 * the HKVD selection at check layers and with the fused KV of all tokens
 * otherwise (semantics in docs/DESIGN.md, "Fuse semantics").
 *
 * Memory per session is a ring of a few layers of re-rotated stored KV, loaded
 * ahead of the node (the loader's fuse_prefetch after each reply), independent of the layer
 * count. Fresh rows are merged into a ring slot in place, so a fused layer is
 * produced where it was loaded; with a shared ring the slots are a
 * shared-memory segment the local client maps, and a fused layer reaches the
 * node with no copy at all. A served slot stays valid until the next layer
 * request of the session. A landing session (fuse_open with q->land) has no ring:
 * its layers are written into the node's own buffers (a client segment, in the
 * node's layout) by fuse_prefetch, a layer per call, and check layers take only
 * the metric's plane (fuse_check_run). Chunks of an open session are pinned: DELETE refuses them. Sessions
 * idle longer than idle_s are freed. Thread-safe; one layer request per
 * session runs at a time.
 *
 * Functions that can fail with a reason for the client return a kvbp_code
 * (wire.h; 0 = ok) and write a message to err.
 */
#ifndef KVBLEND_DAEMON_FUSE_FUSE_H
#define KVBLEND_DAEMON_FUSE_FUSE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "proto/wire.h"
#include "store/store.h"
#include "blend/backend.h"
#include "blend/device.h"
#include "daemon/pool.h"
#include "daemon/shm.h"

struct fuse_limits {
	uint64_t max_sessions;
	uint64_t max_tokens; /* per session */
	uint64_t max_bytes;  /* ring memory of all sessions together */
	uint64_t ring;	     /* layers loaded ahead per session */
	uint64_t idle_s;
	uint64_t per_owner; /* sessions one client may hold open */
	/* Device memory of all sessions' device blocks and the blocks kept for the next
	 * (the device's own budget); 0: nine tenths of the device's memory, or no limit
	 * where the device does not say (emulated). A session whose block does not fit,
	 * or for which the device is out of memory, runs on the host path. */
	uint64_t dev_max_bytes;
	/*
	 * Whether a session whose node takes its fused layers in host memory (the reply's
	 * frames or the shared ring; no device export asked) runs on the device too. Off:
	 * only sessions whose node maps the device ring run there, the rest on the CPU
	 * path, where no layer crosses PCIe twice (the choice device auto makes).
	 */
	bool dev_host;
	/*
	 * Device memory, and as much pinned host memory, allocated when the table is made,
	 * from which sessions' blocks are carved (0: none): a session's open then calls
	 * nothing on the device to allocate, nor its close to free. Blocks that do not
	 * fit, and device rings a node maps (CUDA IPC maps a whole allocation), are
	 * allocated as without it. Counts against neither budget until sessions hold it.
	 */
	uint64_t dev_reserve;
};

struct fuse_table;
struct fuse_session;

/*
 * backend computes on host rows (landing sessions, and every session when device
 * is NULL). With a device, a session's ring lives in device memory: layers are
 * read and verified on the pool's threads into pinned host memory, copied to the
 * device on one stream and re-rotated there, and the node's layer is selected and
 * merged on another stream; device blocks are kept for the next session.
 */
int fuse_table_new(const struct fuse_limits *l, struct store *store, struct pool *pool,
		   const struct blend_backend *backend, const struct blend_device *device,
		   struct shm_table *shm, struct fuse_table **out);
/* Free every session (unpinning its chunks). Accepts NULL. */
void fuse_table_free(struct fuse_table **t);

/*
 * fn(arg, model_id, hash) for each chunk a session's read found corrupt (a checksum
 * failed), called when that session is freed, its pins dropped, so that fn can remove
 * the chunk (fuse_delete_chunk) as a GET's corrupt read does. Set before any session.
 */
void fuse_on_corrupt(struct fuse_table *t, void (*fn)(void *arg, uint32_t model_id,
						      const uint8_t *hash), void *arg);

/* Delete a chunk unless an open session pins it: 0, -EBUSY, or a store errno. */
int fuse_delete_chunk(struct fuse_table *t, const struct store_model *m, const uint8_t *hash);

struct fuse_open_result {
	uint64_t id;
	uint32_t num_tokens;
	uint32_t next_layer; /* the first check layer */
	uint32_t rows_next;  /* rows the next layer request carries (all tokens) */
	uint32_t ring_slots;
	uint64_t slot_bytes; /* K then V of all tokens */
	uint64_t shm_id;     /* shared ring: its segment (0: none) */
	uint64_t shm_size;   /* and that segment's size (at least the ring's) */
	int32_t *rows;	     /* reuse only: the fresh tokens, the rows the node computes (malloc'd) */
	size_t n_rows;
	uint8_t (*missing)[KVBP_HASH_LEN]; /* malloc'd on KVBP_NOT_FOUND; caller frees */
	size_t n_missing;
	/* q->device_out on a CUDA device: the device ring exported (CUDA IPC). Slot i is
	 * at ipc_offset + i * slot_bytes of the allocation, K then V. */
	bool has_ipc;
	uint8_t ipc_handle[KVBP_IPC_HANDLE_LEN];
	uint64_t ipc_offset;
	char device_pci[32];
	bool land_k_strided; /* a landing layout's own K strides are honoured */
	bool land_heads;     /* and its head range */
};

/*
 * Open a session for model m over request q's segments and check layers, owned by
 * owner (a client principal): only requests of that owner reach it, and its shared
 * ring, if any, is that owner's.
 */
uint32_t fuse_open(struct fuse_table *t, const struct store_model *m, const struct kvbp_request *q,
		   const char *owner, struct fuse_open_result *r, char *err, size_t errlen);

/* What one layer request of a session takes and gives, known before it runs. */
struct fuse_layer_plan {
	uint32_t rows_in;  /* fresh rows expected, K and V each */
	size_t row_bytes;  /* bytes of one row: heads x head_dim x dtype size */
	uint32_t num_tokens;
	bool fused_out;	   /* the reply carries fused K and V of all tokens */
	bool selection_out;
	bool shared_ring;  /* fused K and V are left in the shared ring, not copied out */
	bool land;	   /* a check layer of a landing session: fuse_check_run(), one plane in */
	bool device_ring;  /* the ring is exported: the fused layer may stay on the device */
	bool head_range;   /* a landing session of a head range (a tensor-parallel rank's) */
	/* Bytes of one row a landing check layer reads: row_bytes (the metric's plane), or
	 * for the attention metric 2 x row_bytes (K, then V, of the token). */
	size_t check_row_bytes;
	/* The session's metric is attention: a request may carry A, of attn_bytes bytes (4 x
	 * chunk tokens x kv_heads). */
	bool attn;
	uint64_t attn_bytes;
};

/*
 * Begin a layer request: find and lock owner's session id (another owner's is
 * unknown_session), check that layer is the one expected. On success *s is held until fuse_layer_end().
 */
uint32_t fuse_layer_begin(struct fuse_table *t, uint64_t id, const char *owner, uint32_t layer,
			  struct fuse_session **s, struct fuse_layer_plan *plan, char *err,
			  size_t errlen);

struct fuse_layer_result {
	int32_t *selection; /* malloc'd when the layer was a check layer; caller frees */
	size_t n_selection;
	uint32_t next_layer;
	uint32_t rows_next;
	int32_t *dropped;   /* landing check layer: rows sent, no longer selected (malloc'd) */
	size_t n_dropped;
	float *deviation;   /* FUSE_CHECK_DEVIATION: one a row sent (malloc'd) */
	size_t n_deviation;
	uint32_t ring_slot; /* where the fused layer is, in a shared ring */
	bool done;	    /* the last layer was served */
};

/*
 * Run it: k_in/v_in hold plan.rows_in rows each; k_out/v_out room for all
 * tokens when plan.fused_out and the ring is not shared (else NULL). on_device
 * (plan.device_ring only): the fused layer stays in the exported device ring, at
 * r->ring_slot, and is not copied to host memory. attn: NULL, or A (plan.attn_bytes
 * bytes, any alignment; attention metric only), checked (finite, >= 0), kept by the
 * session for this and later check layers. On failure the session is unchanged and
 * usable.
 */
uint32_t fuse_layer_run(struct fuse_table *t, struct fuse_session *s, const void *k_in,
			const void *v_in, void *k_out, void *v_out, bool on_device,
			const void *attn, struct fuse_layer_result *r, char *err, size_t errlen);

/* What a landing session's check layer request asks (Request.check_mode). */
enum {
	FUSE_CHECK_SELECT = 0,	  /* the rows in, the selection out */
	FUSE_CHECK_DEVIATION = 1, /* the rows in, their deviations out; nothing selected */
	FUSE_CHECK_SELECT_BY = 2, /* deviations in (summed over ranks), the selection out */
};

/*
 * A check layer of a landing session (plan.land): rows holds plan.rows_in rows of
 * plan.check_row_bytes (the metric's plane: V, or K for the key metric; K then V
 * for the attention metric; a head range's session: its heads of it), stride bytes
 * apart; attn as for fuse_layer_run(). mode FUSE_CHECK_SELECT answers with the
 * selection and the rows dropped from the previous one (refused for a head range:
 * the ranks' selections must agree). FUSE_CHECK_DEVIATION answers with each row's
 * deviation over the session's heads (r->deviation), the session unchanged, so that
 * tensor-parallel ranks can sum theirs; FUSE_CHECK_SELECT_BY then selects by dev_in
 * (plan.rows_in floats, no rows) as FUSE_CHECK_SELECT does by its own. The last two:
 * value and key metrics only.
 */
uint32_t fuse_check_run(struct fuse_table *t, struct fuse_session *s, int mode, const void *rows,
			size_t stride, const void *attn, const float *dev_in,
			struct fuse_layer_result *r, char *err, size_t errlen);

void fuse_layer_end(struct fuse_table *t, struct fuse_session *s);

/*
 * Load the layers ahead of session id into its ring, or, for a session that lands
 * in the node's buffers, land its next layer. Called after a reply is sent. Returns
 * true when a landing session has more to land: call again (after other sessions).
 */
bool fuse_prefetch(struct fuse_table *t, uint64_t id);

/*
 * The loader: the table's thread that calls fuse_prefetch for the sessions it is kicked
 * for (fuse_kick, after a reply that leaves work: layers to load ahead or to land),
 * landing sessions taking turns a layer at a time, and fuse_expire once a second, off
 * the threads that serve sockets. Start it once (its thread takes no signals); stop it
 * with fuse_loader_stop before fuse_table_free. 0, -EALREADY, -ENOMEM or -errno.
 */
int fuse_loader_start(struct fuse_table *t);
/* Queue session id for the loader (once: a session queued already is not queued twice;
 * room for every session). No-op without a loader or for id 0. */
void fuse_kick(struct fuse_table *t, uint64_t id);
/* Stop the loader after its current turn; accepts a table without one. */
void fuse_loader_stop(struct fuse_table *t);

/* Close owner's session id; stats (a malloc'd array of n name/value pairs) describe it. */
uint32_t fuse_close(struct fuse_table *t, uint64_t id, const char *owner, struct kvbp_stat **stats,
		    size_t *n, char *err, size_t errlen);

/*
 * Free sessions idle longer than idle_s, and the device memory sessions gave up since
 * the last call (pinned shared rings released, too), and allocate spare blocks for the
 * next sessions; returns how many sessions. Waits for their device work and frees
 * device memory, which stalls the device: call it off the thread that serves
 * sockets (the loader, once a second).
 */
unsigned fuse_expire(struct fuse_table *t);

/* Open sessions, ring bytes held, chunks pinned. */
void fuse_usage(struct fuse_table *t, uint64_t *sessions, uint64_t *bytes, uint64_t *pins);

/*
 * Sessions that would have run on the device but run on the host path: its budget
 * (dev_max_bytes) was full, its memory short, or it had failed for good. 0 without one.
 */
uint64_t fuse_device_fallbacks(struct fuse_table *t);

/*
 * What the device path allocated and pinned, since the table was made (all 0 without a
 * device): device and pinned host blocks allocated because the cache had none to give
 * (a session's open costs none once the pools are warm), shared rings pinned in place
 * (cudaHostRegister: once per segment, not per session) and unpinned, rings pinned
 * now, and spare blocks allocated off the sessions' path (fuse_expire's thread) for
 * the next session of a shape an open had to allocate for; and the reserve
 * (dev_reserve, 0 without one) and what sessions hold of it, [0] device, [1] pinned.
 */
struct fuse_device_counts {
	uint64_t allocs, registrations, unregistrations, pinned_rings, spares;
	uint64_t reserve_bytes, reserve_used[2];
};
void fuse_device_counts(struct fuse_table *t, struct fuse_device_counts *c);

#endif
