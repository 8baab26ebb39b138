/*
 * store — the chunk store: models and per-layer KV chunks in one LMDB environment.
 *
 * A chunk is keyed by (model, 32-byte hash) and holds T tokens of K and V per
 * layer. All layers and the chunk record are written in one LMDB write
 * transaction, so a chunk is visible whole or not at all. Chunks are immutable.
 * Every tensor is encoded by codec.h and its checksum verified when read (once
 * per residency in the page cache by default: enum store_verify); every chunk, model and counter record carries an XXH3-64 checksum of its key
 * and bytes, verified on every read too (docs/storage.md).
 *
 * Thread-safety: one struct store may be used from any number of threads.
 * Errors are negative errno values; LMDB codes never leave store/:
 *   -ENOENT  no such model or chunk       -EEXIST  model name taken by another layout
 *   -ENOSPC  the LMDB map or the file system (or a disk quota) is full; the write
 *            was rolled back whole and the store stays usable (see store_totals()
 *            for which of the two is short)
 *   -EBADMSG a stored record failed its checks (corrupt)
 *   -ENOTSUP a quantized tensor, sound, in rows a read cannot take (not one per token):
 *            refused by store_chunk_import(); a read with a transform that meets one
 *            stored before that check returns this, never -EBADMSG
 *   -EINVAL  bad argument                 -ENOBUFS destination size does not match the chunk
 *   -ENOMEM, -EIO, -EAGAIN (reader table full or map resized by another process)
 */
#ifndef KVBLEND_STORE_STORE_H
#define KVBLEND_STORE_STORE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/model_desc.h"

#define STORE_HASH_LEN 32
#define STORE_NAME_MAX 64

struct store;

/*
 * When a read checks the tensors' checksums (docs/storage.md#verification):
 * ONCE (the default) the first read of a value since its pages came from disk,
 * then again when any page left the page cache, when the entry is older than
 * verify_ttl_s, or when another process wrote the data file; ALWAYS every read;
 * SCRUB_ONLY never on reads (only store_scrub() checks).
 */
enum store_verify { STORE_VERIFY_ONCE, STORE_VERIFY_ALWAYS, STORE_VERIFY_SCRUB_ONLY };

struct store_opts {
	const char *dir;      /* LMDB environment directory; created (0750) if missing */
	uint64_t map_size;    /* bytes; a sparse upper bound on the data file */
	unsigned max_readers; /* concurrent read transactions */
	double min_saving;    /* codec: store compressed only if it saves this share (0..1) */
	bool no_sync;	      /* skip fsync at commit (faster, loses recent chunks on power loss) */
	enum store_verify verify;
	unsigned verify_ttl_s;	/* ONCE: how long a verified value stays trusted; 0: 300 */
	size_t verify_entries;	/* ONCE: layer values remembered; 0: 1M (16 MiB) */
};

/*
 * A model: its name, its id in this store and its description (common/model_desc.h,
 * kept as given). elem_size is derived from desc.dtype.
 */
struct store_model {
	uint32_t id; /* assigned by store_model_register() */
	char name[STORE_NAME_MAX + 1];
	struct kvb_model_desc desc;
	uint32_t elem_size; /* bytes per element, derived from desc.dtype */
};

struct store_chunk_info {
	uint32_t num_tokens;
	uint32_t base_pos;
	uint32_t num_layers;
	uint64_t raw_bytes;    /* K and V of all layers, decoded */
	uint64_t stored_bytes; /* encoded, headers included */
	uint64_t created;      /* unix seconds */
};

struct store_chunk_entry {
	uint8_t hash[STORE_HASH_LEN];
	struct store_chunk_info info;
};

/* Store codecs: a model's store_codec, 0 lossless in dtype, 1 fp8, 2 int8, 3 int4. */
#define STORE_CODECS 4

/* What the chunks of the models of one store codec hold. */
struct store_codec_use {
	uint64_t chunks;
	uint64_t raw_bytes;    /* their K and V decoded, in the model's dtype */
	uint64_t stored_bytes; /* as stored, headers included */
};

struct store_totals {
	uint64_t models;
	uint64_t chunks;
	uint64_t raw_bytes;
	uint64_t stored_bytes;
	uint64_t map_size;
	uint64_t map_used; /* bytes of the map in use (last page number x page size) */
	uint64_t disk_size;  /* the data directory's file system: its size */
	uint64_t disk_avail; /* and the bytes still free to an unprivileged writer */
	/* chunks, raw_bytes and stored_bytes by the store_codec of each chunk's model */
	struct store_codec_use codec[STORE_CODECS];
};

/*
 * Open (creating if needed) the environment. A store of on-disk format 1 (no
 * record checksums) is upgraded to the current format in one transaction
 * first. Returns 0 and *out, -EPROTO for a store of a format this code does
 * not know (a newer kvblend's), -EUCLEAN for a data file shorter than its last
 * page (truncated by something else: reading it would fault) or, not empty, shorter
 * than LMDB's two meta pages (cut below what LMDB can open), or another negative
 * errno.
 */
int store_open(const struct store_opts *opts, struct store **out);

/* Close; commits nothing pending (there is nothing pending between calls). Accepts NULL. */
void store_close(struct store **s);

/* Bytes of one K or V tensor of a chunk: T x heads x head_dim x elem_size; 0 on overflow. */
uint64_t store_tensor_bytes(const struct store_model *m, uint32_t num_tokens);

/*
 * Register model m (m->id ignored on input). Returns 0 when it was created,
 * 1 when an identical model of that name existed, in both cases with m->id
 * set; -EEXIST when the name is taken by a different layout or RoPE setup.
 */
int store_model_register(struct store *s, struct store_model *m);

/* Whether a and b describe the same model (layout, RoPE, store codec; not name or id). */
bool store_model_same(const struct store_model *a, const struct store_model *b);

/* Find a model by name. Returns 0 and *out, -ENOENT, or -EBADMSG (its record is corrupt). */
int store_model_find(struct store *s, const char *name, struct store_model *out);

/*
 * Find a model by id. Returns 0 and *out; -ENOENT; -EBADMSG when no sound
 * record has that id and some record is corrupt (it may have been the one).
 */
int store_model_by_id(struct store *s, uint32_t id, struct store_model *out);

/* All models, sorted by name, in a malloc'd array the caller frees; -EBADMSG if one is corrupt. */
int store_model_list(struct store *s, struct store_model **out, size_t *n);

/*
 * Store a chunk of num_tokens tokens. tensors[2*l] and tensors[2*l+1] point to
 * layer l's K and V, each store_tensor_bytes() long. Returns 0 when stored, 1
 * when the chunk already existed (nothing written), -ENOSPC when the map or the
 * file system is full (nothing written). A chunk whose record is corrupt is
 * replaced. *info (may be NULL) describes the chunk as stored.
 */
int store_chunk_put(struct store *s, const struct store_model *m,
		    const uint8_t hash[STORE_HASH_LEN], uint32_t num_tokens, uint32_t base_pos,
		    const void *const tensors[], struct store_chunk_info *info);

/*
 * Decode layers [layer_begin, layer_end) into dst, laid out as
 * [layers, 2, T, heads, head_dim]; dst_len must equal
 * (layer_end - layer_begin) * 2 * store_tensor_bytes(). Returns 0; -ENOENT;
 * -ENOBUFS with *info filled when dst_len does not match; -EINVAL for a bad
 * layer range; -EBADMSG when a record is missing or fails its checksum (dst
 * must then not be used). *info may be NULL.
 */
int store_chunk_get(struct store *s, const struct store_model *m,
		    const uint8_t hash[STORE_HASH_LEN], uint32_t layer_begin, uint32_t layer_end,
		    void *dst, uint64_t dst_len, struct store_chunk_info *info);

/*
 * A chunk's layers served without a copy: views of the stored K and V bytes of
 * layers [layer_begin, layer_end) inside the map. A read transaction stays open
 * until store_view_free(), so the pages stay put even if the chunk is deleted or
 * evicted meanwhile (MVCC); free it soon (it holds a reader slot and keeps the
 * pages from reuse). Only chunks whose requested layers are all stored raw have
 * views: -EAGAIN otherwise (decode them with store_chunk_get()). The bytes are
 * not verified yet: serve layer i only after store_view_verify(v, i) == 0.
 * Returns 0, -ENOENT, -EINVAL (bad layer range), -EBADMSG (a record missing or
 * malformed), -EAGAIN, -ENOMEM, or an LMDB errno. *info (may be NULL) describes
 * the chunk. The view may be verified and freed from any thread.
 */
struct store_view {
	uint32_t layer_begin, layer_end;
	uint64_t tensor_bytes;	/* of each K and each V */
	const uint8_t **k, **v; /* [layer - layer_begin]: the raw bytes in the map */
};

int store_chunk_view(struct store *s, const struct store_model *m,
		     const uint8_t hash[STORE_HASH_LEN], uint32_t layer_begin, uint32_t layer_end,
		     struct store_chunk_info *info, struct store_view **out);

/* Check layer layer_begin + i of a view against its checksums: 0 or -EBADMSG. */
int store_view_verify(const struct store_view *v, uint32_t i);

/* End a view's transaction and free it. Accepts NULL. */
void store_view_free(struct store_view **v);

/*
 * Decode one layer's K into k_dst and V into v_dst, each tensor_bytes =
 * store_tensor_bytes() long (checked against the chunk). k_xform (may be NULL;
 * codec.h) transforms K on its way out, in the same pass that verifies it.
 * One of k_dst and v_dst may be NULL: that plane is neither decoded nor
 * verified; under verify = once the read is remembered as that plane's
 * verification, not the layer's (a whole read still checks both, and a plane
 * read is trusted after either). Same errors as store_chunk_get(); -EINVAL when
 * both are NULL; with k_xform, -ENOTSUP for a K quantized in rows other than one
 * per token (sound bytes, not corruption: codec_decode_xform()).
 */
struct codec_xform;
int store_chunk_get_layer(struct store *s, const struct store_model *m,
			  const uint8_t hash[STORE_HASH_LEN], uint32_t layer, void *k_dst,
			  void *v_dst, uint64_t tensor_bytes, const struct codec_xform *k_xform);

/*
 * Verify one layer's K and V and hand each, a cache-sized block at a time, to
 * its transform (codec_apply(): the transforms write the rows where they go;
 * tensor_bytes as for store_chunk_get_layer()). One pass over stored raw
 * tensors. Same errors as store_chunk_get_layer(), plus -ENOMEM; on an error the
 * transforms may have written part of the layer.
 */
int store_chunk_apply_layer(struct store *s, const struct store_model *m,
			    const uint8_t hash[STORE_HASH_LEN], uint32_t layer,
			    uint64_t tensor_bytes, const struct codec_xform *k_xform,
			    const struct codec_xform *v_xform);

/*
 * A chunk as stored, for copying it to another daemon: its record into *info,
 * then fn(ctx, layer, bytes, len) for every layer with the layer's stored value
 * (encoded K then encoded V, as codec.h writes them), in one read transaction
 * (the bytes are valid only during the call). Returns 0, -ENOENT, -EBADMSG (a
 * corrupt record or a missing layer), fn's non-zero return, or a negative errno.
 */
int store_chunk_export(struct store *s, const struct store_model *m,
		       const uint8_t hash[STORE_HASH_LEN], struct store_chunk_info *info,
		       int (*fn)(void *ctx, uint32_t layer, const void *bytes, size_t len), void *ctx);

/* A tensor store_chunk_import() refused for its layout: where it is, and its rows x channels. */
struct store_tensor_shape {
	uint32_t layer;
	uint32_t plane; /* 0 K, 1 V */
	uint32_t rows, channels;
};

/*
 * Store a chunk from its stored bytes (another daemon's store_chunk_export):
 * blobs[l] of lens[l] bytes per layer. Every tensor's header must match the
 * model and pass its checksum (codec_verify) before anything is written; the
 * bytes are stored as they are, never decoded and re-encoded. A quantized tensor
 * must be laid out as every read takes it, one row per token of the model's
 * num_kv_heads x head_dim channels. Returns like store_chunk_put(), -EBADMSG for
 * bytes that fail, -ENOTSUP for a sound quantized tensor laid out otherwise (the
 * first such one in *bad when bad is not NULL). Nothing is stored on an error.
 */
int store_chunk_import(struct store *s, const struct store_model *m,
		       const uint8_t hash[STORE_HASH_LEN], uint32_t num_tokens, uint32_t base_pos,
		       const void *const blobs[], const size_t lens[], struct store_chunk_info *info,
		       struct store_tensor_shape *bad);

/*
 * One chunk's record. Returns 0 and *info, -ENOENT, -EBADMSG (the record failed
 * its checksum: the chunk must not be served; delete it), or another negative errno.
 */
int store_chunk_info(struct store *s, const struct store_model *m,
		     const uint8_t hash[STORE_HASH_LEN], struct store_chunk_info *info);

/*
 * Look up n hashes in one read transaction; found[i] says which exist.
 * -EBADMSG when one of the records is corrupt.
 */
int store_chunk_lookup(struct store *s, const struct store_model *m,
		       const uint8_t (*hashes)[STORE_HASH_LEN], size_t n,
		       struct store_chunk_info *infos, bool *found);

/*
 * Delete a chunk and all its layers, also when its record is corrupt (which is
 * how a corrupt chunk is cleared). Returns 0 or -ENOENT.
 */
int store_chunk_delete(struct store *s, const struct store_model *m,
		       const uint8_t hash[STORE_HASH_LEN]);

/*
 * Chunks of a model, in hash order, in a malloc'd array the caller frees;
 * -EBADMSG if one of their records is corrupt.
 */
int store_chunk_list(struct store *s, const struct store_model *m,
		     struct store_chunk_entry **out, size_t *n);

/*
 * Call fn for every chunk of every model, in key order, inside one read
 * transaction (fn must not call back into the store). A chunk whose record
 * fails its checksum is skipped (reads of it report -EBADMSG). Returns 0, fn's
 * first non-zero return, or a negative errno.
 */
int store_chunk_scan(struct store *s,
		     int (*fn)(void *ctx, uint32_t model_id, const uint8_t *hash,
			       const struct store_chunk_info *info),
		     void *ctx);

/*
 * The store's figures: models, chunks and their bytes (in all and per store
 * codec), the map and the file system. The chunk figures are kept up to date by
 * every write that adds or removes a chunk record (put, import, delete, the
 * clearing of a corrupt chunk, the format 1 upgrade), in that write's own
 * transaction, so they are crash-consistent with the chunks, and reading them
 * costs one record at any store size: no walk of the chunk records
 * (store_chunk_walks() does not move). A chunk counts under the store codec of
 * the model it was written with. Exception: a totals record that fails its
 * checksum is counted again from the chunk records (a walk; per codec only for
 * chunks whose model record is sound) until the next write replaces it; a store
 * written by a kvblend without per-codec totals is counted once, at open.
 * Returns 0 and *out, or a negative errno (*out untouched).
 */
int store_totals(struct store *s, struct store_totals *out);

/*
 * How many times the chunk records were walked since store_open(): by
 * store_chunk_scan(), store_chunk_list() and the totals counted again from the
 * chunk records. For tests and benchmarks that must know whether an operation
 * walked the store. Never fails.
 */
uint64_t store_chunk_walks(struct store *s);

/*
 * Pushes owed to cluster peers, kept across restarts: a peer id (1 ..
 * STORE_OWED_PEER_MAX bytes) and a chunk. put with owed true records one, with
 * false clears it (clearing one that is not there is 0). scan calls fn for every
 * one in key order, in one read transaction (fn must not call the store);
 * returns 0, fn's non-zero return, or a negative errno.
 */
#define STORE_OWED_PEER_MAX 64
int store_owed_put(struct store *s, const char *peer, uint32_t model_id, const uint8_t *hash,
		   bool owed);
/* Reads by how their checksums were handled since store_open(). */
struct store_verify_counts {
	uint64_t verified;	/* layer values whose checksums a read computed */
	uint64_t trusted;	/* layer values served without, verified earlier (ONCE) */
	uint64_t forgotten;	/* times every entry was dropped: the data file written by another process */
	uint64_t scrubbed_bytes; /* bytes store_scrub() checked */
	uint64_t scrub_passes;	/* whole passes store_scrub() finished */
};

void store_verify_counts(struct store *s, struct store_verify_counts *out);

/*
 * The scrub: check stored layer values against their checksums, in key order,
 * resuming where the last call stopped (sc starts zeroed), until about budget
 * bytes were read; after the last value the next call starts over. A value that
 * passes counts as verified (ONCE); for a corrupt one corrupt(ctx, model_id,
 * hash) is called (once per chunk per call, after the scrub's read transaction
 * ended, so it may delete the chunk). Returns the bytes read (0 with an empty
 * store) or a negative errno.
 */
struct store_scrub {
	uint8_t pos[4 + STORE_HASH_LEN + 4]; /* the last layer key checked */
	bool started;
};

int64_t store_scrub(struct store *s, struct store_scrub *sc, uint64_t budget,
		    void (*corrupt)(void *ctx, uint32_t model_id, const uint8_t *hash),
		    void *ctx);

int store_owed_scan(struct store *s,
		    int (*fn)(void *ctx, const char *peer, uint32_t model_id, const uint8_t *hash),
		    void *ctx);

#endif
