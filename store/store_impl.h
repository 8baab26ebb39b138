/*
 * store_impl — what the store's own modules share and nobody else may use: the
 * environment (struct store), the on-disk layout of keys and records, the
 * transaction helpers and the translation of LMDB codes. The contract for
 * callers is store.h; nothing here is part of it.
 *
 * The modules, each calling only ones below it (tests/lint/check_module_maps.py
 * holds this list to the folder's files):
 *   store.c           the environment's life: open (databases, format, the data
 *                     file's checks) and close (calls upgrade, totals, verify, txn)
 *   store_upgrade.c   format 1 -> 2, in the open's write transaction (calls chunk,
 *                     model, totals, record, txn)
 *   store_transfer.c  chunks as stored, between members: export, import (calls
 *                     chunk, model, txn, codec)
 *   store_chunk.c     chunks: put, get, view, info, lookup, delete, list, scan,
 *                     purge (calls model, totals, verify, record, txn, codec)
 *   store_owed.c      pushes owed to cluster peers (calls txn)
 *   store_model.c     models: register, find, list, by id; the next id (calls
 *                     record, txn)
 *   store_totals.c    the totals record, kept by every write; recount, repair
 *                     (calls record, txn)
 *   store_verify.c    when a read checks checksums, the scrub (calls txn,
 *                     verified, codec, checksum)
 *   store_txn.c       the one translation of LMDB codes, commits, read
 *                     transactions, walks (calls none)
 *   store_record.c    the bytes of chunk and model records, their checksums
 *                     (calls checksum)
 * and below them the store's parts with a header of their own: codec.c (tensor
 * encodings; calls quant, checksum), verified.c (the layers verified in this
 * residency), quant.c and checksum.c. The one circle is by design: quant_avx2.c
 * and checksum_avx2.c are quant_impl.h's and checksum_impl.h's body built for
 * AVX2, which quant.c and checksum.c pick at run time and which call back into
 * them for the one helper both builds share (quant_fp8_encode,
 * checksum_apply_block).
 *
 * Conventions as in store.h: 0 or a negative errno; MDB_* codes are turned into
 * errno values by st_err_from_mdb() and never leave these files.
 */
#ifndef KVBLEND_STORE_STORE_IMPL_H
#define KVBLEND_STORE_STORE_IMPL_H

#include <lmdb.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <string.h>

#include "store/store.h"

/*
 * On-disk format. 2: every chunk, model and counter record carries an XXH3-64
 * checksum of its key and bytes, verified on every read. 1 (no record
 * checksums) is upgraded in place by store_open().
 */
#define STORE_FORMAT 2
#define STORE_FORMAT_V1 1
#define RTXN_POOL_MAX 64
#define CHUNK_KEY_LEN (4 + STORE_HASH_LEN)
#define LAYER_KEY_LEN (CHUNK_KEY_LEN + 4)
#define CHUNK_REC_LEN 48
#define CHUNK_REC_SUM 40 /* offset of the checksum in a chunk record */
#define MODEL_BODY_LEN (STORE_NAME_MAX + 1 + 4 * 10 + 8 * 6 + 1)
#define MODEL_REC_LEN (MODEL_BODY_LEN + 8)
#define MODEL_REC_LEN_V1 MODEL_BODY_LEN
/* A model with a store codec: the body has 8 more bytes (codec, group). */
#define MODEL_QBODY_LEN (MODEL_BODY_LEN + 8)
#define MODEL_QREC_LEN (MODEL_QBODY_LEN + 8)
/* A model with local layers: the codec's 8 bytes (zero without one), then
 * rope_local_theta (f64) and full_every (u32), 4 zero bytes. */
#define MODEL_LBODY_LEN (MODEL_QBODY_LEN + 16)
#define MODEL_LREC_LEN (MODEL_LBODY_LEN + 8)
#define MODEL_REC_MAX MODEL_LREC_LEN
/* chunks, raw bytes, stored bytes; the same for each of the STORE_CODECS; checksum */
#define TOTALS_LEN (8 * 3 * (1 + STORE_CODECS) + 8)
#define NEXT_MODEL_LEN 12 /* next id, checksum */
#define REC_SUM_MAX 256	  /* longest key + record body that st_rec_sum() hashes */
/* Slack on top of a write's payload when judging whether the file system ran out. */
#define WRITE_SLACK (1u << 20)
/* Disk kept allocated past the last page, so that deletes work on a full file system. */
#define DISK_RESERVE (2u << 20)

struct store {
	MDB_env *env;
	MDB_dbi meta;	/* "format", "totals", "next_model" */
	MDB_dbi models; /* name -> model record */
	MDB_dbi chunks; /* model id (BE) + hash -> chunk record */
	MDB_dbi layers; /* chunk key + layer (BE) -> encoded K then encoded V */
	MDB_dbi owed;	/* peer id length (1) + peer id + chunk key -> 1 byte (cluster pushes) */
	double min_saving;
	pthread_mutex_t pool_lock;
	MDB_txn *pool[RTXN_POOL_MAX]; /* reset read transactions, renewed on use */
	unsigned pool_n;
	atomic_uint_least64_t chunk_walks; /* store_chunk_walks() */
	/* Verification (store_verify.c). */
	enum store_verify verify;
	struct st_verified *verified;	  /* ONCE */
	int data_fd;			  /* the data file, for its modification time */
	/* ns: the data file's after this store's last commit (st_mtime_note()) */
	atomic_int_least64_t own_mtime;
	atomic_uint_least64_t n_verified, n_trusted, n_forgotten, n_scrubbed, n_passes;
};

/* The totals record: in all, and by the store codec of each chunk's model. */
struct totals_rec {
	struct store_codec_use all;
	struct store_codec_use codec[STORE_CODECS];
};

/* ---- byte order and keys ---- */

static inline void be32(uint8_t *p, uint32_t v)
{
	p[0] = (uint8_t)(v >> 24);
	p[1] = (uint8_t)(v >> 16);
	p[2] = (uint8_t)(v >> 8);
	p[3] = (uint8_t)v;
}

static inline uint32_t get_be32(const uint8_t *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static inline void le_put(uint8_t *p, uint64_t v, int n)
{
	for (int i = 0; i < n; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static inline uint64_t le_get(const uint8_t *p, int n)
{
	uint64_t v = 0;

	for (int i = n - 1; i >= 0; i--)
		v = v << 8 | p[i];
	return v;
}

static inline void le_put_f64(uint8_t *p, double d)
{
	uint64_t v;

	memcpy(&v, &d, 8);
	le_put(p, v, 8);
}

static inline double le_get_f64(const uint8_t *p)
{
	uint64_t v = le_get(p, 8);
	double d;

	memcpy(&d, &v, 8);
	return d;
}

static inline void chunk_key(uint8_t *key, uint32_t model_id, const uint8_t *hash)
{
	be32(key, model_id);
	memcpy(key + 4, hash, STORE_HASH_LEN);
}

static inline void layer_key(uint8_t *key, uint32_t model_id, const uint8_t *hash,
			     uint32_t layer)
{
	chunk_key(key, model_id, hash);
	be32(key + CHUNK_KEY_LEN, layer);
}

/* ---- store_txn.c: errors, transactions, walks ---- */

/* The "format" key of the meta database. */
extern const MDB_val st_format_key;

/* The one place LMDB codes become errno values. */
int st_err_from_mdb(int rc);

/* The error of a failed write of about `need` bytes: a short write on a full disk is -ENOSPC. */
int st_err_write(struct store *s, int mdb_rc, uint64_t need);

/* Keep DISK_RESERVE bytes allocated past the data file's last page; best effort. */
void st_disk_reserve(struct store *s);

/*
 * The data file's modification time in ns (-1 when it cannot be read), and its
 * note after each commit of this store (own_mtime), which store_verify.c compares.
 */
int64_t st_file_mtime(const struct store *s);
void st_mtime_note(struct store *s);

/* Commit a write transaction (ended either way); renews the disk reserve when need > 0. */
int st_commit(struct store *s, MDB_txn *txn, uint64_t need);

/* Commit a transaction that changes nothing: the pages freed before become reusable. */
int st_txn_advance(struct store *s);

/* A read transaction from the pool (renewed), and back to it (reset). */
int st_rtxn_begin(struct store *s, MDB_txn **out);
void st_rtxn_end(struct store *s, MDB_txn *t);

/*
 * Walk the records of one database (those whose key starts with prefix, when
 * prefix_len > 0) in key order inside one read transaction, calling fn on each;
 * stops at fn's first non-zero return, which it returns.
 */
typedef int (*walk_fn)(void *ctx, const MDB_val *k, const MDB_val *v);
int st_cursor_walk(struct store *s, MDB_dbi dbi, const uint8_t *prefix, size_t prefix_len,
		   walk_fn fn, void *ctx);

/* Walk as st_cursor_walk() and decode each record by fn into a malloc'd array (*out). */
typedef int (*cursor_fn)(const MDB_val *k, const MDB_val *v, void *item);
int st_collect(struct store *s, MDB_dbi dbi, const uint8_t *prefix, size_t prefix_len,
	       size_t item_size, cursor_fn fn, void **out, size_t *n_out);

/* ---- store_record.c: the bytes of chunk and model records ---- */

/* XXH3-64 of a record's key and body; whether v is body_len bytes plus a matching sum. */
uint64_t st_rec_sum(const MDB_val *k, const void *body, size_t body_len);
bool st_rec_sum_ok(const MDB_val *k, const MDB_val *v, size_t body_len);

/* Bytes per element of a dtype (1 f16, 2 bf16, 3 f32); 0 for another. */
uint32_t st_dtype_size(uint32_t dtype);

/* Encode m's record into p (MODEL_REC_MAX bytes of room); returns its length. */
size_t st_model_rec_encode(uint8_t *p, const struct store_model *m);

/* The fields of a model record body (format 1 and 2 share it); -EBADMSG. */
int st_model_body_decode(const uint8_t *p, struct store_model *out);

/* Decode and verify the model record v stored under name k. *m is untouched on -EBADMSG. */
int st_model_rec_decode(const MDB_val *k, const MDB_val *v, struct store_model *m);

/* A chunk record: version, tokens, base_pos, layers, raw, stored, created, checksum. */
void st_chunk_rec_encode(uint8_t *p, const MDB_val *k, const struct store_chunk_info *c);
void st_chunk_rec_fields(const uint8_t *p, struct store_chunk_info *c);

/* Decode and verify the chunk record v stored under key k. *c is untouched on -EBADMSG. */
int st_chunk_rec_decode(const MDB_val *k, const MDB_val *v, struct store_chunk_info *c);

/* ---- store_verify.c: verification of layer values ---- */

/*
 * Verification of a layer value v read under layer key `key` (store_verify.c):
 * st_read_flags() says whether the read may skip the checksums (CODEC_TRUSTED)
 * and fills *fp (0: not to be remembered); st_read_done() records the outcome.
 * st_mtime_note() (store_txn.c) follows each commit; st_layer_forget() each
 * deleted value.
 */
unsigned st_read_flags(struct store *s, const uint8_t *key, const MDB_val *v, uint64_t *fp);
/* The same for a read of one plane (part 1: K, 2: V): trusted when the whole layer or
 * that plane was verified; *fp is the plane's, which st_read_done() remembers. */
unsigned st_read_flags_part(struct store *s, const uint8_t *key, const MDB_val *v,
			    unsigned part, uint64_t *fp);
void st_read_done(struct store *s, uint64_t fp, unsigned flags, int rc);
void st_layer_forget(struct store *s, const uint8_t *key, const MDB_val *v);
int st_verify_open(struct store *s, const struct store_opts *o);
void st_verify_close(struct store *s);

/* ---- store_upgrade.c ---- */

/*
 * Format 1 -> 2 in txn (store_upgrade.c): every record gets its checksum; chunk records
 * that fail format 1's own checks are dropped with their layers. 0 or a negative errno.
 */
int st_upgrade_v1(struct store *s, MDB_txn *txn);

/* ---- store_totals.c: the totals record ---- */

/*
 * The totals: counted again from the chunk records (a walk: store_chunk_walks()),
 * and written. st_totals_update() adds `add` and takes `sub` off (never below
 * zero) in all and under store codec `codec` (the model's; none when out of
 * range), in txn: the write that adds or removes the chunk record.
 */
int st_totals_recount(struct store *s, MDB_txn *txn, struct totals_rec *t);
int st_totals_write(struct store *s, MDB_txn *txn, const struct totals_rec *t);
int st_totals_update(struct store *s, MDB_txn *txn, uint32_t codec,
		     const struct store_codec_use *add, const struct store_codec_use *sub);

/*
 * At open: a totals record of an older layout (no per-codec figures) or one
 * that fails its checksum is counted again and written back, once. Best
 * effort (a full disk leaves it to be counted at each read): returns nothing.
 */
void st_totals_repair(struct store *s);

/* ---- store_model.c: models ---- */

/* The "next_model" key of the meta database (store_model.c). */
extern const MDB_val st_next_model_key;

/*
 * The elements of one token row of a tensor of m (num_kv_heads x head_dim), as a
 * quantized tensor's header counts them; 0 (which no such header has) past 2^32 - 1.
 */
uint32_t st_token_channels(const struct store_model *m);

/* Write the next model id counter. */
int st_next_model_write(struct store *s, MDB_txn *txn, uint32_t id);

/* ---- store_chunk.c: chunks ---- */

/*
 * Delete a chunk's record and every layer stored under its key, whatever the
 * record says (it may be corrupt). Adds what the layers held to *freed.
 */
int st_chunk_purge(struct store *s, MDB_txn *txn, const uint8_t *key,
		   struct store_codec_use *freed);

/* 1 when a chunk with a sound record is stored under key, 0 when none (or a corrupt one) is. */
int st_chunk_exists(struct store *s, const uint8_t *key);

/*
 * Write a chunk in one transaction: each layer's value encoded from tensors by
 * plans, or (blobs) copied from stored bytes a peer sent (lens[l] bytes each).
 * Every layer, the record and the totals, or nothing. Returns 0, 1 when a sound
 * chunk is stored under the key already, or a negative errno. ci->raw_bytes and
 * ->created are filled here.
 */
struct codec_plan;
int st_chunk_write(struct store *s, const struct store_model *m, const uint8_t *hash,
		   const void *const tensors[], const struct codec_plan *plans,
		   const void *const blobs[], const size_t *lens, struct store_chunk_info *ci);

/* A chunk's record inside txn: 0, -ENOENT, -EBADMSG or another negative errno. */
int st_chunk_info_txn(struct store *s, MDB_txn *txn, uint32_t model_id, const uint8_t *hash,
		      struct store_chunk_info *ci);

#endif
