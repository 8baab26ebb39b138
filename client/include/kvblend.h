/*
 * kvblend.h — C client library for kvblendd, the kvblend KV-cache daemon.
 *
 * A client holds one connection to one daemon (ZeroMQ, ipc:// or tcp://). All
 * calls are synchronous, wait at most the connection's timeout, and return 0 on
 * success or a negative code: a negative errno for local failures (-EINVAL bad
 * argument, -ENOMEM, -ETIMEDOUT no reply in time, -EIO socket error), or a
 * KVB_E_* code for an error the daemon replied with. kvb_last_error() then
 * holds a message naming the problem.
 *
 * Thread-safety: a kvb_client must not be used by two threads at once; use one
 * client per thread (they are cheap). Functions without a client are
 * thread-safe.
 *
 * Tensors are little-endian, laid out [layers, 2, tokens, kv_heads, head_dim]
 * with K before V, in the model's dtype (bfloat16 as raw 16-bit patterns).
 *
 * Shared memory: on an ipc:// endpoint the client maps a shared-memory segment
 * of the daemon's, and bulk tensors cross through it instead of the socket.
 * Data placed in kvb_shared_buffer() crosses with no client-side copy at all.
 *
 * ABI: libkvblend.so.1; every function below is bound to symbol version KVBLEND_1
 * (client/kvblend.map; kvb_fuse_open_into_strided and the node's selections to KVBLEND_1.1,
 * kvb_set_timeout to KVBLEND_1.2, kvb_last_code to KVBLEND_1.3, the device and option
 * landing calls to KVBLEND_1.4, the two-step check to KVBLEND_1.5, kvb_get_opts to
 * KVBLEND_1.6, kvb_device_handle_from_fd and _fds to KVBLEND_1.7), and nothing else is
 * exported. A compatible addition (a new
 * function, enum value or error code) keeps the soname: its functions go into a new
 * version node (KVBLEND_1.1, ...) that inherits the last. Any other change (a field
 * added to, removed from or moved in a struct the caller allocates or reads, such as
 * struct kvb_model; a function's parameters, return value or meaning; a function
 * removed) raises the soname, and the version nodes start over at KVBLEND_<soname>.
 * Soname 0 is retired: struct kvb_model grew under it. See docs/python.md.
 */
#ifndef KVBLEND_H
#define KVBLEND_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

/* Only the functions below are exported from libkvblend.so. */
#if defined(__GNUC__)
#define KVB_API __attribute__((visibility("default")))
#else
#define KVB_API
#endif

#define KVB_HASH_LEN 32
#define KVB_NAME_MAX 64
#define KVB_PROTOCOL_VERSION 1

enum kvb_dtype { KVB_F16 = 1, KVB_BF16 = 2, KVB_F32 = 3 };
enum kvb_rope_style { KVB_ROPE_NEOX = 0, KVB_ROPE_GPTJ = 1 };
/*
 * How a model's chunks are stored: in its dtype (lossless), or quantized and
 * decoded back to its dtype on every read (docs/storage.md): fp8 e4m3 and int8
 * with per-channel key scales and per-token value scales, int4 in groups.
 */
enum kvb_store_codec {
	KVB_STORE_DTYPE = 0,
	KVB_STORE_FP8 = 1,
	KVB_STORE_INT8 = 2,
	KVB_STORE_INT4 = 3,
};
enum kvb_rope_scaling {
	KVB_SCALING_NONE = 0,
	KVB_SCALING_LINEAR = 1,
	KVB_SCALING_LLAMA3 = 2,
	KVB_SCALING_YARN = 3,
	KVB_SCALING_DYNAMIC = 4,
};

/* Errors the daemon replies with: -(1000 + wire code). */
enum kvb_error {
	KVB_E_BAD_REQUEST = -1001,    /* header frame missing, empty or not a request */
	KVB_E_BAD_VERSION = -1002,    /* protocol version not spoken by the daemon */
	KVB_E_UNKNOWN_OP = -1003,     /* operation not known */
	KVB_E_BAD_SHAPE = -1004,      /* sizes or dimensions wrong, zero, too big or overflowing */
	KVB_E_UNKNOWN_MODEL = -1005,  /* no model of that name */
	KVB_E_DTYPE_MISMATCH = -1006, /* payload dtype differs from the model's */
	KVB_E_BAD_FRAMES = -1007,     /* wrong number of payload frames */
	KVB_E_TOO_LARGE = -1008,      /* message above the daemon's max_message */
	KVB_E_MODEL_CONFLICT = -1009, /* model name taken by a different layout */
	KVB_E_NOT_FOUND = -1010,      /* no such chunk */
	KVB_E_CORRUPT = -1011,	      /* stored chunk failed its checksum; removed, treat as a miss */
	KVB_E_FULL = -1012,	      /* store full */
	KVB_E_LIMIT = -1013,	      /* a resource limit of the daemon was reached */
	KVB_E_INTERNAL = -1014,	      /* daemon-side failure */
	KVB_E_BAD_ARGUMENT = -1015,   /* a field is missing or out of range */
	KVB_E_BAD_SHM = -1016,	      /* shared-memory reference unknown, expired or out of range */
	KVB_E_UNKNOWN_SESSION = -1017, /* no open fuse session of that id (closed or expired) */
	KVB_E_BUSY = -1018,	      /* the chunk is in use by an open fuse session */
	KVB_E_PROTOCOL = -1100,	      /* the reply could not be understood */
};

struct kvb_model {
	char name[KVB_NAME_MAX + 1];
	uint32_t num_layers;
	uint32_t num_kv_heads;
	uint32_t head_dim;
	enum kvb_dtype dtype;
	double rope_theta;
	enum kvb_rope_style rope_style;
	uint32_t rotary_dim; /* 0 = head_dim */
	enum kvb_rope_scaling scaling;
	double factor;		   /* linear, llama3, yarn, dynamic */
	double low_freq_factor;	   /* llama3 */
	double high_freq_factor;   /* llama3 */
	uint32_t original_max_pos; /* llama3, yarn */
	double beta_fast;	   /* yarn (0 and 0 = defaults 32 and 1) */
	double beta_slow;	   /* yarn */
	uint32_t max_pos;	   /* dynamic */
	int k_pre_rope;		   /* keys are stored before RoPE */
	enum kvb_store_codec store_codec; /* lossy storage; KVB_STORE_DTYPE: lossless */
	uint32_t store_group;		  /* int4: elements per group (0: the default, 32) */
};

/*
 * KVBLEND_1.8: a model whose layers do not all rotate alike, which struct kvb_model
 * (fixed) cannot say. Gemma 3 rotates its sliding-window ("local") layers with one
 * RoPE base and its full-attention layers with another: with rope_local_theta > 0,
 * layer l (from 0) is a full-attention layer, rotated as struct kvb_model says, when
 * (l + 1) % full_every == 0, and a local one otherwise, rotated by default RoPE (no
 * scaling) of base rope_local_theta; full_every is 2..num_layers. Both 0: every layer
 * rotates alike (what kvb_model_register registers). Part of the model's identity.
 */
struct kvb_model_layers {
	double rope_local_theta;
	uint32_t full_every;
};

struct kvb_chunk_info {
	uint8_t hash[KVB_HASH_LEN];
	int found;
	uint32_t num_tokens;
	uint32_t base_pos; /* position of the chunk's first token when its keys were rotated */
	uint32_t num_layers;
	uint64_t raw_bytes;
	uint64_t stored_bytes;
};

struct kvb_stat {
	char name[64];
	double value;
};

struct kvb_connect_opts {
	int timeout_ms;	   /* per call; 0 = 5000 */
	int no_shm;	   /* never use shared memory */
	uint64_t shm_size; /* initial segment size; 0 = 64 MiB; grows on demand */
	/* tcp:// with CURVE: the daemon's public key (Z85, 40 characters; NULL:
	 * $KVBLEND_SERVER_KEY, unset = no CURVE) and this client's secret key (NULL:
	 * $KVBLEND_CLIENT_KEY, unset = a new key pair per connection, which a daemon
	 * with curve_authorized_keys refuses). */
	const char *server_key;
	const char *client_secret_key;
};

typedef struct kvb_client kvb_client;

/*
 * Connect to endpoint (NULL: $KVBLEND_ENDPOINT, else the default socket) and
 * check that a daemon answers within the timeout. opts may be NULL.
 * Returns 0 and *out; -ETIMEDOUT when no daemon answered; -EINVAL for a bad
 * endpoint; or a KVB_E_* code. On failure *out is NULL and, if err is not
 * NULL, err (errlen bytes) holds the reason.
 */
KVB_API int kvb_connect(const char *endpoint, const struct kvb_connect_opts *opts, kvb_client **out,
		char *err, size_t errlen);

/* Close the connection and release its shared memory. Accepts NULL; sets *c to NULL. */
KVB_API void kvb_close(kvb_client **c);

/*
 * Set the per-call timeout of every later call on c (timeout_ms > 0), e.g. short before
 * closing a connection whose daemon stopped answering, so that the close's own calls
 * (sessions, regions) do not each wait the full timeout. Returns 0, or -EINVAL for
 * timeout_ms <= 0. Since KVBLEND_1.2.
 */
KVB_API int kvb_set_timeout(kvb_client *c, int timeout_ms);

/* Message of the client's last failed call ("" after a success). Owned by the client. */
KVB_API const char *kvb_last_error(const kvb_client *c);
/* Code of the client's last failed call, as the call would have returned it (a negative
 * errno or a KVB_E_* code; 0 after a success): for the calls that return a pointer
 * (kvb_region_alloc(), kvb_shared_buffer()), whose NULL does not say why. */
KVB_API int kvb_last_code(const kvb_client *c);

/* Static description of a code returned by any call. */
KVB_API const char *kvb_strerror(int code);

/* The endpoint a NULL endpoint resolves to: $KVBLEND_ENDPOINT, else
 * ipc:///run/kvblend/kvblend.sock, else (not root, and that socket absent)
 * ipc://$XDG_RUNTIME_DIR/kvblend.sock. Thread-local storage, valid until the next call. */
KVB_API const char *kvb_default_endpoint(void);

/* Server version string into buf. */
KVB_API int kvb_ping(kvb_client *c, char *version, size_t len);

/* Register a model. *existed (may be NULL) is 1 when an identical model was there. */
KVB_API int kvb_model_register(kvb_client *c, const struct kvb_model *m, int *existed);

/* All models, in a malloc'd array the caller frees with free(). */
KVB_API int kvb_model_list(kvb_client *c, struct kvb_model **models, size_t *n);

/* One model by name; KVB_E_UNKNOWN_MODEL if there is none. */
KVB_API int kvb_model_get(kvb_client *c, const char *name, struct kvb_model *out);

/*
 * kvb_model_register and kvb_model_get with the model's layers (KVBLEND_1.8): layers
 * NULL registers (or reads) every layer rotating alike. kvb_model_get and
 * kvb_model_list do not say a model's layers; a model with local layers is listed
 * with its full-attention layers' RoPE.
 */
KVB_API int kvb_model_register_layers(kvb_client *c, const struct kvb_model *m,
				      const struct kvb_model_layers *layers, int *existed);
KVB_API int kvb_model_get_layers(kvb_client *c, const char *name, struct kvb_model *out,
				 struct kvb_model_layers *layers);

/*
 * Store a chunk of num_tokens tokens whose keys were rotated at positions
 * base_pos.. . kv holds kv_bytes = layers x 2 x T x heads x head_dim x
 * dtype size bytes. *existed (may be NULL) is 1 when the chunk was already
 * stored (nothing is written: chunks are immutable). Over tcp:// the payload
 * goes on the client's bulk connection where the daemon takes it there
 * (docs/protocol.md#bulk-connections), sealed over CURVE, else in frames.
 */
KVB_API int kvb_put(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
	    enum kvb_dtype dtype, uint32_t num_tokens, uint32_t base_pos, const void *kv,
	    size_t kv_bytes, int *existed);

/*
 * Read layers [layer_begin, layer_end) of a chunk (layer_end 0 = all) into out,
 * which must be exactly the size of those layers; use kvb_lookup() to learn
 * num_tokens first. *info (may be NULL) describes the chunk.
 * KVB_E_NOT_FOUND if absent; KVB_E_CORRUPT if it failed its checksum (the
 * daemon removed it). -ENOBUFS when out_bytes does not match (info is filled).
 * Over tcp:// the payload comes on the client's bulk connection (opened at the first
 * GET, docs/protocol.md#bulk-connections), received straight into out, sealed over
 * CURVE (AEGIS where both ends run it, else AES-256-GCM; KVBLEND_BULK_CIPHER names one):
 * no malloc tuning needed. KVB_E_PROTOCOL when a record of it was
 * altered on the wire or came out of order (kvb_last_error() names it; the
 * connection is closed, the next GET opens another). On any error out's contents
 * are unspecified. KVBLEND_NO_BULK=1 in the environment keeps a client to frames.
 */
KVB_API int kvb_get(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
	    uint32_t layer_begin, uint32_t layer_end, void *out, size_t out_bytes,
	    struct kvb_chunk_info *info);

/* Which of n hashes are stored: out[i].found, with sizes for those that are. */
KVB_API int kvb_lookup(kvb_client *c, const char *model, const uint8_t (*hashes)[KVB_HASH_LEN], size_t n,
	       struct kvb_chunk_info *out);

/* Delete a chunk; KVB_E_NOT_FOUND if absent. */
KVB_API int kvb_delete(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN]);

/* Keep a chunk from eviction for ttl_s seconds (1 .. 30 days; pinning again resets
 * the TTL). Pins live in the daemon's memory: a restart drops them. */
KVB_API int kvb_pin(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
		    uint32_t ttl_s);
/* Remove a pin; KVB_E_NOT_FOUND if the chunk was not pinned. */
KVB_API int kvb_unpin(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN]);

/*
 * A chunk's layers [layer_begin, layer_end) (layer_end 0 = all) left in the
 * message frames they arrived in: no copy into a caller's buffer, for nodes
 * that move each layer on (to their device, their own cache) anyway. Over TCP
 * this is the fastest read: the daemon sends the stored pages, the client only
 * receives. k[i] and v[i] are layer layer_begin + i, tensor_bytes each, at no
 * particular alignment; valid until kvb_layers_free(), also after other calls
 * on c or kvb_close(). Over IPC, kvb_get() into kvb_shared_buffer() crosses
 * with fewer copies. Errors as kvb_get(); *out is set only on success.
 */
struct kvb_layers {
	uint32_t layer_begin, layer_end;
	size_t tensor_bytes;
	const void **k, **v;
	struct kvb_chunk_info info;
	void *frames_; /* the frames, owned; not for the caller */
};

KVB_API int kvb_get_layers(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
			   uint32_t layer_begin, uint32_t layer_end, struct kvb_layers **out);

/* Free what kvb_get_layers() returned. Accepts NULL; sets *l to NULL. */
KVB_API void kvb_layers_free(struct kvb_layers **l);

/*
 * Optional, process-wide: tune glibc's malloc for receiving large chunks in frames over
 * TCP: kvb_get_layers(), and kvb_get() where no bulk connection is offered (an older
 * daemon, tcp_bulk off, KVBLEND_NO_BULK=1); kvb_get() over a bulk connection does not
 * need it. ZeroMQ allocates each received frame (a layer's K or V) with malloc; by default
 * glibc maps frames that large with mmap, or returns the freed heap to the system,
 * so every GET faults its memory in again (measured: a 32 MiB GET over loopback TCP
 * at 1.2-1.7 GB/s in a process that had read 8 MiB chunks before, 4-5 GB/s tuned).
 * This keeps allocations up to 256 MiB in the heap and up to keep_bytes (0: 512
 * MiB) of freed heap for reuse: the process's resident memory stays near its peak.
 * kvblendd does the same for itself. Returns 0, or -ENOTSUP when malloc is not
 * glibc's (AddressSanitizer's, jemalloc: nothing to tune this way).
 */
KVB_API int kvb_malloc_tune(size_t keep_bytes);

/* All chunks of a model, in a malloc'd array the caller frees with free(). */
KVB_API int kvb_list(kvb_client *c, const char *model, struct kvb_chunk_info **out, size_t *n);

/* Daemon counters, in a malloc'd array the caller frees with free(). */
KVB_API int kvb_stats(kvb_client *c, struct kvb_stat **out, size_t *n);

/* Another member of the daemon's cluster, as the daemon sees it. */
struct kvb_member {
	char id[65];
	char endpoint[256];	  /* where the daemon reaches it (tcp://HOST:PORT) */
	int state;		  /* 1 alive, 0 suspect (missed a deadline), -1 gone */
	uint64_t pushes_owed;	  /* chunk copies queued for it */
	double last_reply_age_ms; /* since its last answer; -1 never */
	uint64_t chunks, stored_bytes; /* its store at its last heartbeat */
};

/*
 * The other members of the daemon's cluster, in a malloc'd array the caller frees
 * with free() (n 0 and a 1-element array when the daemon is in no cluster); with
 * stats not NULL, also the daemon's counters from the same reply (as kvb_stats(),
 * freed with free()): one STATS request for both.
 */
KVB_API int kvb_cluster_members(kvb_client *c, struct kvb_member **out, size_t *n,
				struct kvb_stat **stats, size_t *n_stats);

/*
 * The cluster's replication check (kvblend cluster check): the daemon lists the
 * chunks every member in placement holds (one LIST per member and model), places
 * each, and answers its counters (as kvb_stats(), freed with free()) with the
 * check's: per member check_answered:ID, check_chunks:ID, check_owned:ID,
 * check_beyond:ID (copies beyond R: held there, owned elsewhere),
 * check_missing:ID (copies it owns but lacks), check_unverified:ID (copies it
 * owns that could not be asked: it did not answer); in total check_members,
 * check_answered, check_under (chunks with fewer than R copies among their
 * owners), check_beyond. A daemon in no cluster answers no check_* at all.
 */
KVB_API int kvb_cluster_check(kvb_client *c, struct kvb_stat **stats, size_t *n_stats);

/*
 * A buffer of at least size bytes inside the shared-memory segment, valid until
 * the next call on c that needs a larger one, or kvb_close(); calls given private
 * buffers stage their data in the same segment and overwrite its contents. If the daemon
 * restarts, calls attach a new segment by themselves; the old buffer stays
 * readable and writable but no longer crosses without a copy. Tensors passed to
 * kvb_put() or kvb_get() from here cross without a client-side copy. NULL when
 * shared memory is not available (tcp endpoint, disabled, or too large).
 */
KVB_API void *kvb_shared_buffer(kvb_client *c, size_t size);

/*
 * Like kvb_get(), with the keys re-rotated from the positions they were stored
 * at to positions pos.. (exact RoPE delta rotation, as the model's configuration
 * says): for nodes that blend themselves.
 */
KVB_API int kvb_get_rerotated(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
			      uint32_t layer_begin, uint32_t layer_end, uint32_t pos, void *out,
			      size_t out_bytes, struct kvb_chunk_info *info);

/*
 * Everything a GET can be told (ABI KVBLEND_1.6), for kvb_get_opts(). size:
 * sizeof(struct kvb_get_opts) as the caller was built (later versions add fields at
 * the end). Layers [layer_begin, layer_end) (layer_end 0 = all). rerotate: the keys
 * moved to positions pos.. (as kvb_get_rerotated). head_begin, head_count: only the
 * stored KV heads [head_begin, head_begin + head_count), each token's head_count
 * heads back to back (a tensor-parallel rank's share of a chunk stored with every
 * head); head_count 0: every head. out_bytes must then be exactly those heads' bytes
 * (layers x 2 x tokens x head_count x head_dim x element), since the chunk's info
 * does not say its heads: -ENOBUFS (over shared memory KVB_E_BAD_SHM) otherwise. A
 * GET with a head range goes out as protocol version 2, which a kvblendd older than
 * these fields refuses (KVB_E_BAD_VERSION) rather than answering every head. Errors
 * as kvb_get(), and KVB_E_BAD_ARGUMENT for a range beyond the model's heads (the
 * message names them); -EINVAL for head_begin without head_count or a size smaller
 * than this struct's.
 */
struct kvb_get_opts {
	size_t size;
	uint32_t layer_begin, layer_end;
	int rerotate;
	uint32_t pos;
	uint32_t head_begin, head_count;
};

KVB_API int kvb_get_opts(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
			 const struct kvb_get_opts *opts, void *out, size_t out_bytes,
			 struct kvb_chunk_info *info);

/* ---- Fuse sessions (CacheBlend) ----
 *
 * A session fuses the KV of stored chunks into a new prompt. The node opens it
 * with the ordered segments of the prompt (stored chunks at their new
 * positions, fresh tokens such as the question), prefills the layers before
 * the first check layer itself, then calls kvb_fuse_layer() for every layer
 * from the first check layer on, in order, with fresh K and V for the tokens
 * kvb_fuse_rows() names: all tokens at the first check layer, the selected
 * (HKVD) tokens after it. At the first check layer the daemon selects tokens
 * and returns no KV (fused = the fresh KV the node has); at every later layer
 * it returns the fused K and V of all tokens: fresh for the selected ones,
 * stored and re-rotated for the rest. Later check layers narrow the selection.
 */
/*
 * How check layers pick tokens. VALUE and KEY: HKVD, the squared deviation of the
 * fresh from the stored V (K) row. ATTENTION (question-aware, docs/fuse.md): per KV
 * head the squared K and V deviation, each divided by its head's mean over the
 * candidates, weighted by where the question attends: score = sum over heads of
 * A[j,h] * sqrt(dK + dV), with A from the node (kvb_fuse_attention()).
 */
enum kvb_metric { KVB_METRIC_VALUE = 0, KVB_METRIC_KEY = 1, KVB_METRIC_ATTENTION = 2 };

struct kvb_segment {
	int fresh;		    /* 1: count fresh tokens; 0: the stored chunk `hash` */
	uint8_t hash[KVB_HASH_LEN]; /* chunk segments */
	uint32_t pos;		    /* absolute position of the segment's first token */
	uint32_t count;		    /* fresh segments: how many tokens */
};

struct kvb_fuse_params {
	const uint32_t *check_layers; /* increasing */
	const double *ratios;	      /* one per check layer, in [0, 1], not increasing */
	size_t n_checks;
	enum kvb_metric metric;
};

typedef struct kvb_fuse kvb_fuse;

/*
 * Open a session. With p NULL or no check layers it is reuse-only: nothing cached
 * is recomputed, the layer calls start at layer 0 and carry the fresh tokens'
 * rows (kvb_fuse_rows()). On KVB_E_NOT_FOUND, *missing (if not NULL) receives the
 * hashes of the chunks that are not stored (malloc'd, *n_missing of them; the
 * caller frees it): prefill and store them, then open again.
 */
KVB_API int kvb_fuse_open(kvb_client *c, const char *model, const struct kvb_segment *segs,
			  size_t n_segs, const struct kvb_fuse_params *p, kvb_fuse **out,
			  uint8_t (**missing)[KVB_HASH_LEN], size_t *n_missing);

/*
 * Like kvb_fuse_open() (dst NULL) or kvb_fuse_open_into() (dst set) for a session
 * without check layers in which the node recomputes, besides the fresh tokens, the
 * cached tokens recompute[0..n_recompute) (prompt indices, increasing) at every
 * layer from layer 0: a selection the node made itself (e.g. the top tokens of its
 * attention preview). kvb_fuse_rows() gives the union, sorted. n_recompute 0 is
 * reuse only. A token out of range, repeated, out of order or fresh is refused
 * (KVB_E_BAD_ARGUMENT). Since KVBLEND_1.1.
 */
struct kvb_kv_layout; /* below, with the landing sessions */
KVB_API int kvb_fuse_open_recompute(kvb_client *c, const char *model,
				    const struct kvb_segment *segs, size_t n_segs,
				    const int32_t *recompute, size_t n_recompute,
				    const struct kvb_kv_layout *dst, kvb_fuse **out,
				    uint8_t (**missing)[KVB_HASH_LEN], size_t *n_missing);

/*
 * A for a session with the attention metric: how much the question attends to each
 * chunk token through each KV head, float32 [chunk tokens, kv_heads], the chunk
 * tokens being the tokens of the session's stored chunks in prompt order (fresh
 * tokens skipped), each value finite and >= 0. Copied here and sent with the next
 * kvb_fuse_layer() or kvb_fuse_check(); the daemon keeps it for that and every later
 * check layer (until A is sent again). A check layer needs A by then. Returns 0,
 * -EINVAL (n is not chunk tokens x kv_heads, or the metric is not attention) or
 * -ENOMEM. Since KVBLEND_1.1.
 */
KVB_API int kvb_fuse_attention(kvb_client *c, kvb_fuse *f, const float *a, size_t n);

/* Tokens in the session (the sum of its segments). */
KVB_API uint32_t kvb_fuse_tokens(const kvb_fuse *f);
/* The layer the next kvb_fuse_layer() call must be for. */
KVB_API uint32_t kvb_fuse_next_layer(const kvb_fuse *f);
/* The tokens (sorted indices into the prompt) whose fresh K and V that call carries. */
KVB_API size_t kvb_fuse_rows(const kvb_fuse *f, const int32_t **tokens);

/*
 * Serve one layer. k and v hold the fresh rows for kvb_fuse_rows(), each
 * [rows, kv_heads, head_dim]. k_out and v_out (either may be NULL) receive the
 * fused K and V of all tokens ([tokens, kv_heads, head_dim]) when *fused is set
 * to 1; at the first check layer *fused is 0 and they are untouched. A failed
 * call leaves the session as it was (retry with the right layer or rows).
 */
KVB_API int kvb_fuse_layer(kvb_client *c, kvb_fuse *f, uint32_t layer, const void *k,
			   const void *v, void *k_out, void *v_out, int *fused);

/*
 * Where the last kvb_fuse_layer() left the fused K and V without a copy: in the
 * daemon's shared ring (ipc:// endpoints), read-only, valid until the next call
 * on f. Returns 0, or -ENODATA when the last call returned no fused layer or the
 * ring is not shared (then pass k_out and v_out to kvb_fuse_layer()).
 */
KVB_API int kvb_fuse_output(const kvb_fuse *f, const void **k, const void **v);

/*
 * Fused layers on the GPU, for a node on the daemon's machine whose KV cache is on
 * the GPU the daemon fuses on (its --device cuda), through CUDA IPC. After this
 * call, kvb_fuse_open() on c asks the daemon to export each session's ring in
 * device memory, and maps it into this process (in the primary context of the
 * same GPU, found by its PCI bus id); then kvb_fuse_layer() with k_out and v_out
 * NULL leaves the fused layer on the device, where kvb_fuse_output_device()
 * points, with no copy through host memory. The NVIDIA driver (libcuda.so.1) is
 * loaded at run time: libkvblend links no CUDA. Returns 0, or -ENODEV where there
 * is no driver or GPU (kvb_last_error() says which): the node keeps using host
 * memory.
 */
KVB_API int kvb_fuse_device(kvb_client *c);

/* 1 when f's fused layers can stay on the device (kvb_fuse_device(), a daemon on a
 * CUDA device, the mapping made); else 0: they come in host memory. */
KVB_API int kvb_fuse_on_device(const kvb_fuse *f);

/*
 * Where the last kvb_fuse_layer() left the fused K and V on the device: device
 * pointers (CUdeviceptr) valid in this process's primary context of the daemon's
 * GPU, [tokens, kv_heads, head_dim] each in the model's dtype, read-only, valid
 * until the next call on f. The daemon replies once the layer is complete, so any
 * stream may read it at once. Returns 0, or -ENODATA when the last call left no
 * fused layer on the device.
 */
KVB_API int kvb_fuse_output_device(const kvb_fuse *f, void **k, void **v);

/* Close the session and free f. *stats (if not NULL) gets timings and byte
 * counts, malloc'd, *n_stats of them. Accepts *f == NULL. The session's device ring
 * (kvb_fuse_on_device()) is unmapped first, before the close reaches the daemon,
 * which frees it: pointers from kvb_fuse_output_device() are invalid from the call
 * on, and no stream may still be reading them. */
KVB_API int kvb_fuse_close(kvb_client *c, kvb_fuse **f, struct kvb_stat **stats,
			   size_t *n_stats);

/* ---- Landing fuse sessions: the fused layers go into the node's own KV cache ----
 *
 * An engine keeps its KV cache in its own memory and computes layer after layer.
 * With a landing session the daemon writes the stored, re-rotated K and V rows of
 * each layer straight into that cache, in the engine's layout, ahead of the node,
 * and publishes per layer that it is in place. The node computes its own rows
 * (the selected tokens) and writes them into its cache itself: nothing it computes
 * travels to the daemon except, at check layers, the one plane the metric needs.
 *
 *   1. Put the KV cache in a region (kvb_region_alloc(): shared memory the daemon
 *      can write; ipc:// endpoints only) and describe it (struct kvb_kv_layout).
 *   2. kvb_fuse_open_into(). Layers up to and including the first check layer are
 *      the node's: it computes all tokens there.
 *   3. At each check layer call kvb_fuse_check() with the metric's plane (V rows,
 *      or K rows for the key metric) of the kvb_fuse_rows() tokens; afterwards
 *      kvb_fuse_rows() is the new selection and *dropped the rows to stop computing.
 *   4. For every layer after the first check layer: compute the selected rows, call
 *      kvb_fuse_wait(layer), then write the selected rows into the cache and
 *      attend. Never write a landed layer's rows before kvb_fuse_wait() returns:
 *      the daemon writes every cached token's row of the layer.
 *   5. kvb_fuse_close(): once it returns, the daemon writes nothing more.
 *
 * A reuse-only session (params NULL or no check layers) recomputes nothing
 * cached: every layer lands from layer 0, the node computes the fresh tokens only.
 */

/*
 * Shared memory for the node's own buffers: size bytes, zeroed, page-aligned,
 * readable and writable, valid until kvb_region_free() or kvb_close(). NULL when
 * shared memory is not available (tcp://, or the daemon refuses: kvb_last_error()).
 * A client holds at most 16 regions.
 */
KVB_API void *kvb_region_alloc(kvb_client *c, size_t size);
KVB_API int kvb_region_free(kvb_client *c, void *region);

/*
 * Where element d of head h of token t (0 .. tokens-1, prompt order) of layer l
 * lives: k (or v) + l * layer_stride + page(t) * page_stride + slot(t) *
 * token_stride + h * head_stride + d * dtype size, where page(t) = pages[t /
 * page_tokens] and slot(t) = t % page_tokens for a paged cache (page_tokens > 0),
 * else page(t) = 0 and slot(t) = t. K and V lie in one region; they may interleave.
 */
struct kvb_kv_layout {
	void *k; /* layer 0, token 0 (page 0, slot 0), head 0 */
	void *v;
	size_t layer_stride;
	size_t token_stride;
	size_t head_stride;
	uint32_t page_tokens; /* 0: not paged */
	size_t page_stride;
	const uint32_t *pages; /* the block table: at least ceil(tokens / page_tokens) */
	size_t n_pages;
};

/* Like kvb_fuse_open(), landing every fused layer in dst. p NULL (or no check
 * layers): reuse only. */
KVB_API int kvb_fuse_open_into(kvb_client *c, const char *model, const struct kvb_segment *segs,
			       size_t n_segs, const struct kvb_fuse_params *p,
			       const struct kvb_kv_layout *dst, kvb_fuse **out,
			       uint8_t (**missing)[KVB_HASH_LEN], size_t *n_missing);

/*
 * K's own strides for a landing layout whose K is not laid out like V (ABI
 * KVBLEND_1.1): element d of head h of token t of layer l of K lives at k +
 * l * layer_stride + page(t) * page_stride + slot(t) * token_stride + h *
 * head_stride + d * dim_stride (layer_stride, page_stride, pages: the layout's).
 * dim_stride is not the dtype size when head_dim is not contiguous: vLLM's CPU
 * cache keeps K transposed per block and head, [head_dim, page_tokens], so
 * token_stride = dtype size and dim_stride = page_tokens * dtype size.
 */
struct kvb_kv_strides {
	size_t token_stride;
	size_t head_stride;
	size_t dim_stride; /* > 0 */
};

/* kvb_fuse_open_into() with K placed by k_strides (V by dst). k_strides NULL: as
 * kvb_fuse_open_into(). Returns -ENOTSUP when the daemon does not honour K strides
 * (a kvblendd older than this call): the session is closed again, but it may have
 * written K rows by dst's strides already; rewrite the tokens' rows before use. */
KVB_API int kvb_fuse_open_into_strided(kvb_client *c, const char *model,
				       const struct kvb_segment *segs, size_t n_segs,
				       const struct kvb_fuse_params *p,
				       const struct kvb_kv_layout *dst,
				       const struct kvb_kv_strides *k_strides, kvb_fuse **out,
				       uint8_t (**missing)[KVB_HASH_LEN], size_t *n_missing);

/*
 * The node's KV cache in device memory (ABI KVBLEND_1.4): a landing layout whose k
 * and v are pointers into an allocation on a GPU, as this process sees it. A
 * kvblendd whose fuse runs on that GPU (--device cuda, or auto with one) maps the
 * allocation by its CUDA IPC memory handle, or by a descriptor this process handed
 * in (kvb_device_handle_from_fd), once per handle and client while sessions use it
 * and writes each landed layer's rows there with its own kernels; the progress word
 * kvb_fuse_wait() reads stays in host memory, in a region of this client. The
 * daemon checks the layout's extent against the allocation's size as its driver
 * reports it.
 */
struct kvb_device_mem {
	const void *base;	/* the allocation's start (cudaMalloc's pointer here) */
	size_t bytes;		/* its size */
	uint8_t ipc_handle[64]; /* cudaIpcGetMemHandle(base), or kvb_device_handle_from_fd() */
	char pci[32];		/* its GPU's PCI bus id (cudaDeviceGetPCIBusId), NUL-terminated */
	void *progress;		/* inside a region of this client (kvb_region_alloc) */
};

/*
 * Hand the descriptor fd of the node's device allocation to the daemon (ABI
 * KVBLEND_1.7), for a local IPC client: it goes over the daemon's descriptor socket
 * (SCM_RIGHTS), the daemon keeps its own copy, for this process only, until the
 * process exits (the same file handed in again keeps its handle), and handle (64 bytes)
 * receives the name to put in kvb_device_mem's ipc_handle. Only this process's
 * sessions can land by that name: a handle another process learns names nothing for
 * it. The emulated device takes a memfd sealed against shrinking (F_SEAL_SHRINK) this
 * way, and takes memory no other way. fd stays the caller's. Returns 0;
 * KVB_E_BAD_ARGUMENT when the daemon refuses it (one of its own segments: the message
 * says why), KVB_E_LIMIT (16 from this process, or 64 from all, are held), -ENOTSUP
 * (not a local IPC client), -EINVAL, or a transport error.
 */
KVB_API int kvb_device_handle_from_fd(kvb_client *c, int fd, uint8_t handle[64]);

/* Most descriptors one kvb_device_handle_from_fds() hands in. */
#define KVB_DEVICE_SEGMENTS_MAX 128

/*
 * kvb_device_handle_from_fd() for memory in n segments (ABI KVBLEND_1.7): descriptor
 * fds[k]'s memory sits at offsets[k] of one extent, sizes[k] bytes (a GPU cache that
 * reserves one range of addresses and backs each segment by its own allocation,
 * exported by cuMemExportToShareableHandle as a POSIX fd). The daemon maps them at the
 * same offsets of one range of its own; mem.base is the extent's start, and each layer
 * of a landing layout must lie in one segment. offsets in increasing order, page-aligned
 * (CUDA: granule-aligned), not overlapping; a size of 0 only for one alone (the whole
 * file). 1 to KVB_DEVICE_SEGMENTS_MAX descriptors. Returns as kvb_device_handle_from_fd,
 * and KVB_E_BAD_ARGUMENT for places the daemon refuses.
 */
KVB_API int kvb_device_handle_from_fds(kvb_client *c, const int *fds, const uint64_t *offsets,
				       const uint64_t *sizes, size_t n, uint8_t handle[64]);

/* kvb_fuse_open_into() into device memory: dst's k and v lie in mem's allocation, K
 * laid out as V (token_stride, head_stride; paged or not). Returns kvb_fuse_open()'s
 * errors, and KVB_E_BAD_ARGUMENT (the message says why) when the daemon has no CUDA
 * device or not this GPU, or cannot map the handle. */
KVB_API int kvb_fuse_open_into_device(kvb_client *c, const char *model,
				      const struct kvb_segment *segs, size_t n_segs,
				      const struct kvb_fuse_params *p,
				      const struct kvb_kv_layout *dst,
				      const struct kvb_device_mem *mem, kvb_fuse **out,
				      uint8_t (**missing)[KVB_HASH_LEN], size_t *n_missing);

/*
 * Everything a landing session can be told beside its layout (ABI KVBLEND_1.4), for
 * kvb_fuse_open_into_opts(). size: sizeof(struct kvb_land_opts) as the caller was
 * built (later versions add fields at the end). k_strides: K's own strides (as
 * kvb_fuse_open_into_strided). device: the cache is in a GPU's memory (as
 * kvb_fuse_open_into_device; not with k_strides). head_begin, head_count: the node's
 * cache holds only the stored heads [head_begin, head_begin + head_count), as its
 * heads 0 .. head_count - 1 (a tensor-parallel rank's share; dst's strides are for
 * that many heads); head_count 0: every head. A session with a head range blends by
 * the value or key metric only, its check layers in two steps
 * (kvb_fuse_check_deviation, kvb_fuse_check_select). Such an open (and one into device memory)
 * goes out as protocol version 2, which a kvblendd older than these fields refuses
 * (KVB_E_BAD_VERSION) instead of landing by the wrong layout. size: at least this
 * (KVBLEND_1.4) struct's; a caller built against a later header may pass a larger
 * one, whose fields past this library's must be zero (-EINVAL otherwise).
 */
struct kvb_land_opts {
	size_t size;
	const struct kvb_kv_strides *k_strides;
	const struct kvb_device_mem *device;
	uint32_t head_begin;
	uint32_t head_count;
};

KVB_API int kvb_fuse_open_into_opts(kvb_client *c, const char *model,
				    const struct kvb_segment *segs, size_t n_segs,
				    const struct kvb_fuse_params *p,
				    const struct kvb_kv_layout *dst,
				    const struct kvb_land_opts *opts, kvb_fuse **out,
				    uint8_t (**missing)[KVB_HASH_LEN], size_t *n_missing);

/*
 * Wait until layer is in the node's buffers (immediately for layers the node
 * computes whole). Spins briefly, then sleeps on the progress word (a futex).
 * Returns 0; -ETIMEDOUT after timeout_ms (-1: no limit); or the daemon's code
 * (e.g. KVB_E_CORRUPT) when landing stopped: close the session.
 */
KVB_API int kvb_fuse_wait(kvb_client *c, kvb_fuse *f, uint32_t layer, int timeout_ms);

/*
 * A check layer of a landing session: rows holds the metric plane's rows of the
 * kvb_fuse_rows() tokens, row i at rows + i * row_stride (0: rows packed); for the
 * attention metric row i is the token's K row followed at once by its V row (as
 * in a fused QKV output; packed: 2 x row size apart). Rows in
 * a region or the shared buffer are read where they are (no copy); others are
 * copied packed into the shared buffer (overwriting it), or sent in a frame where
 * shared memory is not available or the daemon no longer knows the segment. Afterwards
 * kvb_fuse_rows() is the new selection; *dropped (if not NULL) the tokens that
 * were sent and are no longer selected, valid until the next call on f.
 */
KVB_API int kvb_fuse_check(kvb_client *c, kvb_fuse *f, uint32_t layer, const void *rows,
			   size_t row_stride, const int32_t **dropped, size_t *n_dropped);

/*
 * A check layer split in two, for tensor-parallel ranks whose sessions land head ranges
 * (struct kvb_land_opts): each rank sends its heads' rows of the metric's plane (value
 * or key metric) to kvb_fuse_check_deviation(), which writes each kvb_fuse_rows() row's
 * deviation over those heads into dev (kvb_fuse_rows() floats) and selects nothing;
 * the ranks sum their dev (the deviation is a sum of squares over heads, so the sum is
 * the whole model's) and each calls kvb_fuse_check_select() with the sum: the daemon
 * selects by it as kvb_fuse_check() does by its own, so every rank gets the same
 * selection. kvb_fuse_check() itself is refused on a head range (bad_argument). Also
 * valid without a head range. ABI KVBLEND_1.5.
 */
KVB_API int kvb_fuse_check_deviation(kvb_client *c, kvb_fuse *f, uint32_t layer,
				     const void *rows, size_t row_stride, float *dev);
KVB_API int kvb_fuse_check_select(kvb_client *c, kvb_fuse *f, uint32_t layer, const float *dev,
				  const int32_t **dropped, size_t *n_dropped);

/* Default chunk hash: BLAKE2b-256 over the token ids as little-endian uint32. */
KVB_API void kvb_chunk_hash(const uint32_t *token_ids, size_t n, uint8_t out[KVB_HASH_LEN]);

/* A new CURVE key pair, Z85 (41 bytes each with the NUL). Returns 0 or -ENOTSUP. */
KVB_API int kvb_curve_keypair(char public_key[41], char secret_key[41]);

/* Hex (64 lowercase digits, NUL-terminated) to and from hashes. parse returns 0 or -EINVAL. */
KVB_API int kvb_hash_parse(const char *hex, uint8_t out[KVB_HASH_LEN]);
KVB_API void kvb_hash_format(const uint8_t hash[KVB_HASH_LEN], char out[2 * KVB_HASH_LEN + 1]);

/* Bytes per element; 0 for an unknown dtype. */
KVB_API size_t kvb_dtype_size(enum kvb_dtype dtype);
/* "f16", "bf16", "f32"; parse returns the dtype or 0. */
KVB_API const char *kvb_dtype_name(enum kvb_dtype dtype);
KVB_API enum kvb_dtype kvb_dtype_parse(const char *s);

/*
 * Parse a RoPE scaling SPEC into m's scaling fields: none | linear:FACTOR |
 * llama3:FACTOR,LOW,HIGH,ORIGINAL_MAX_POS | yarn:FACTOR,ORIGINAL_MAX_POS[,BETA_FAST,BETA_SLOW]
 * | dynamic:FACTOR,MAX_POS. Returns 0 or -EINVAL (m untouched).
 */
KVB_API int kvb_rope_scaling_parse(const char *spec, struct kvb_model *m);
/* The inverse, into buf. */
/*
 * A store codec SPEC, as the CLI's --store takes it: "dtype" (or ""), "fp8",
 * "int8", "int4" or "int4:GROUP" (1..1024). Sets m->store_codec and
 * m->store_group; returns 0 or -EINVAL. Format writes the SPEC of m.
 */
KVB_API int kvb_store_parse(const char *spec, struct kvb_model *m);
KVB_API void kvb_store_format(const struct kvb_model *m, char *buf, size_t len);
KVB_API void kvb_rope_scaling_format(const struct kvb_model *m, char *buf, size_t len);

#ifdef __cplusplus
}
#endif

#endif
