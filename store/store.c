/* store — chunks and models in LMDB; see store.h for the contract. */
#include "store.h"

#include <errno.h>
#include <fcntl.h>
#include <lmdb.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>

#include "checksum.h"
#include "codec.h"

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
#define TOTALS_LEN 32	  /* chunks, raw bytes, stored bytes, checksum */
#define NEXT_MODEL_LEN 12 /* next id, checksum */
#define REC_SUM_MAX 256	  /* longest key + record body that rec_sum() hashes */
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
};

struct totals_rec {
	uint64_t chunks, raw_bytes, stored_bytes;
};

static const MDB_val totals_key = { 6, "totals" };
static const MDB_val next_model_key = { 10, "next_model" };
static const MDB_val format_key = { 6, "format" };

/* The one place LMDB codes become errno values. */
static int err_from_mdb(int rc)
{
	switch (rc) {
	case MDB_SUCCESS:
		return 0;
	case MDB_NOTFOUND:
		return -ENOENT;
	case MDB_MAP_FULL:
	case MDB_TXN_FULL:
	case EDQUOT: /* a quota is a full disk for us */
		return -ENOSPC;
	case MDB_READERS_FULL:
	case MDB_MAP_RESIZED:
		return -EAGAIN;
	case MDB_CORRUPTED:
	case MDB_PAGE_NOTFOUND:
	case MDB_INVALID:
	case MDB_VERSION_MISMATCH:
		return -EBADMSG;
	default:
		return rc > 0 ? -rc : -EIO;
	}
}

/*
 * The error of a failed write (a put that spilled pages, a commit). LMDB
 * reports a short write as EIO, and a file system that fills up in the middle
 * of a write gives exactly that: when the data file's file system has less room
 * left than the write needed, the EIO was a full disk. The failed transaction
 * is aborted by the caller: nothing it wrote is reachable, the pages written
 * past the end are reused by the next transaction, the environment stays usable.
 */
static int err_write(struct store *s, int mdb_rc, uint64_t need)
{
	int rc = err_from_mdb(mdb_rc);
	struct statvfs sv;
	int fd;

	if (rc != -EIO || mdb_env_get_fd(s->env, &fd) || fstatvfs(fd, &sv))
		return rc;
	if ((uint64_t)sv.f_bavail * sv.f_frsize < need + WRITE_SLACK)
		return -ENOSPC;
	return rc;
}

/*
 * Keep DISK_RESERVE bytes of the file system allocated to the data file past
 * its last page (without changing its size). A delete writes a few fresh pages
 * (LMDB never overwrites the last snapshot): when something else fills the
 * disk, they come from here, so eviction can still make room. Best effort: a
 * file system without fallocate() or without room simply keeps less.
 */
static void disk_reserve(struct store *s)
{
	MDB_envinfo ei;
	MDB_stat st;
	int fd;

	if (mdb_env_info(s->env, &ei) || mdb_env_stat(s->env, &st) || mdb_env_get_fd(s->env, &fd))
		return;
	(void)fallocate(fd, FALLOC_FL_KEEP_SIZE, (off_t)(ei.me_last_pgno + 1) * st.ms_psize,
			DISK_RESERVE);
}

static int commit(struct store *s, MDB_txn *txn, uint64_t need)
{
	int rc = err_write(s, mdb_txn_commit(txn), need);

	if (!rc && need)
		disk_reserve(s); /* the file grew into the reserve: renew it */
	return rc;
}

static void be32(uint8_t *p, uint32_t v)
{
	p[0] = (uint8_t)(v >> 24);
	p[1] = (uint8_t)(v >> 16);
	p[2] = (uint8_t)(v >> 8);
	p[3] = (uint8_t)v;
}

static uint32_t get_be32(const uint8_t *p)
{
	return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

static void le_put(uint8_t *p, uint64_t v, int n)
{
	for (int i = 0; i < n; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static uint64_t le_get(const uint8_t *p, int n)
{
	uint64_t v = 0;

	for (int i = n - 1; i >= 0; i--)
		v = v << 8 | p[i];
	return v;
}

static void le_put_f64(uint8_t *p, double d)
{
	uint64_t v;

	memcpy(&v, &d, 8);
	le_put(p, v, 8);
}

static double le_get_f64(const uint8_t *p)
{
	uint64_t v = le_get(p, 8);
	double d;

	memcpy(&d, &v, 8);
	return d;
}

/*
 * XXH3-64 of a record's key and body: a flipped bit anywhere in the record, or
 * a record that ended up under another key, fails the check.
 */
static uint64_t rec_sum(const MDB_val *k, const void *body, size_t body_len)
{
	uint8_t buf[REC_SUM_MAX];

	memcpy(buf, k->mv_data, k->mv_size);
	memcpy(buf + k->mv_size, body, body_len);
	return checksum(buf, k->mv_size + body_len);
}

static bool rec_sum_ok(const MDB_val *k, const MDB_val *v, size_t body_len)
{
	const uint8_t *p = v->mv_data;

	return k->mv_size + body_len <= REC_SUM_MAX && v->mv_size == body_len + 8 &&
	       le_get(p + body_len, 8) == rec_sum(k, p, body_len);
}

static uint32_t dtype_size(uint32_t dtype)
{
	return dtype == 3 ? 4 : (dtype == 1 || dtype == 2) ? 2 : 0;
}

uint64_t store_tensor_bytes(const struct store_model *m, uint32_t num_tokens)
{
	uint64_t n = num_tokens;

	if (__builtin_mul_overflow(n, (uint64_t)m->num_kv_heads, &n) ||
	    __builtin_mul_overflow(n, (uint64_t)m->head_dim, &n) ||
	    __builtin_mul_overflow(n, (uint64_t)dtype_size(m->dtype), &n))
		return 0;
	return n;
}

static void chunk_key(uint8_t *key, uint32_t model_id, const uint8_t *hash)
{
	be32(key, model_id);
	memcpy(key + 4, hash, STORE_HASH_LEN);
}

static void layer_key(uint8_t *key, uint32_t model_id, const uint8_t *hash, uint32_t layer)
{
	chunk_key(key, model_id, hash);
	be32(key + CHUNK_KEY_LEN, layer);
}

/* A chunk record: version, tokens, base_pos, layers, raw, stored, created, checksum. */
static void chunk_rec_encode(uint8_t *p, const MDB_val *k, const struct store_chunk_info *c)
{
	memset(p, 0, CHUNK_REC_LEN);
	le_put(p, STORE_FORMAT, 4);
	le_put(p + 4, c->num_tokens, 4);
	le_put(p + 8, c->base_pos, 4);
	le_put(p + 12, c->num_layers, 4);
	le_put(p + 16, c->raw_bytes, 8);
	le_put(p + 24, c->stored_bytes, 8);
	le_put(p + 32, c->created, 8);
	le_put(p + CHUNK_REC_SUM, rec_sum(k, p, CHUNK_REC_SUM), 8);
}

static void chunk_rec_fields(const uint8_t *p, struct store_chunk_info *c)
{
	c->num_tokens = (uint32_t)le_get(p + 4, 4);
	c->base_pos = (uint32_t)le_get(p + 8, 4);
	c->num_layers = (uint32_t)le_get(p + 12, 4);
	c->raw_bytes = le_get(p + 16, 8);
	c->stored_bytes = le_get(p + 24, 8);
	c->created = le_get(p + 32, 8);
}

/* Decode and verify the chunk record v stored under key k. *c is untouched on -EBADMSG. */
static int chunk_rec_decode(const MDB_val *k, const MDB_val *v, struct store_chunk_info *c)
{
	const uint8_t *p = v->mv_data;

	if (k->mv_size != CHUNK_KEY_LEN || !rec_sum_ok(k, v, CHUNK_REC_SUM) ||
	    le_get(p, 4) != STORE_FORMAT)
		return -EBADMSG;
	chunk_rec_fields(p, c);
	return 0;
}

/* Encode m's record into p (MODEL_QREC_LEN bytes of room); returns its length. */
static size_t model_rec_encode(uint8_t *p, const struct store_model *m)
{
	size_t body = m->store_codec ? MODEL_QBODY_LEN : MODEL_BODY_LEN;
	uint8_t *q = p + STORE_NAME_MAX + 1;
	size_t name_len = strnlen(m->name, STORE_NAME_MAX);
	MDB_val k = { name_len, (void *)m->name };
	const uint32_t u[10] = { m->id,	      m->num_layers, m->num_kv_heads,	  m->head_dim,
				 m->dtype,    m->rope_style, m->rotary_dim,	  m->scaling,
				 m->max_pos, m->original_max_pos };
	const double d[6] = { m->rope_theta,	   m->factor,	 m->low_freq_factor,
			      m->high_freq_factor, m->beta_fast, m->beta_slow };

	memset(p, 0, body + 8);
	memcpy(p, m->name, name_len);
	for (int i = 0; i < 10; i++, q += 4)
		le_put(q, u[i], 4);
	for (int i = 0; i < 6; i++, q += 8)
		le_put_f64(q, d[i]);
	*q = m->k_pre_rope;
	if (m->store_codec) {
		/* codec (u8), 3 zero bytes, group (u32) */
		p[MODEL_BODY_LEN] = (uint8_t)m->store_codec;
		le_put(p + MODEL_BODY_LEN + 4, m->store_group, 4);
	}
	le_put(p + body, rec_sum(&k, p, body), 8);
	return body + 8;
}

/* The fields of a model record body (format 1 and 2 share it). */
static int model_body_decode(const uint8_t *p, struct store_model *out)
{
	const uint8_t *q = p + STORE_NAME_MAX + 1;
	struct store_model m;
	uint32_t u[10];
	double d[6];

	if (p[STORE_NAME_MAX] != 0)
		return -EBADMSG;
	memset(&m, 0, sizeof(m));
	memcpy(m.name, p, STORE_NAME_MAX + 1);
	for (int i = 0; i < 10; i++, q += 4)
		u[i] = (uint32_t)le_get(q, 4);
	for (int i = 0; i < 6; i++, q += 8)
		d[i] = le_get_f64(q);
	m.id = u[0];
	m.num_layers = u[1];
	m.num_kv_heads = u[2];
	m.head_dim = u[3];
	m.dtype = u[4];
	m.elem_size = dtype_size(m.dtype);
	m.rope_style = u[5];
	m.rotary_dim = u[6];
	m.scaling = u[7];
	m.max_pos = u[8];
	m.original_max_pos = u[9];
	m.rope_theta = d[0];
	m.factor = d[1];
	m.low_freq_factor = d[2];
	m.high_freq_factor = d[3];
	m.beta_fast = d[4];
	m.beta_slow = d[5];
	m.k_pre_rope = *q != 0;
	if (!m.elem_size)
		return -EBADMSG;
	*out = m;
	return 0;
}

/* Decode and verify the model record v stored under name k. *m is untouched on -EBADMSG. */
static int model_rec_decode(const MDB_val *k, const MDB_val *v, struct store_model *m)
{
	const uint8_t *p = v->mv_data;
	struct store_model t;
	int rc;

	if (v->mv_size == MODEL_QREC_LEN) {
		if (!rec_sum_ok(k, v, MODEL_QBODY_LEN))
			return -EBADMSG;
		rc = model_body_decode(p, &t);
		if (rc)
			return rc;
		t.store_codec = p[MODEL_BODY_LEN];
		t.store_group = (uint32_t)le_get(p + MODEL_BODY_LEN + 4, 4);
		if (!t.store_codec || t.store_codec > 3 || p[MODEL_BODY_LEN + 1] ||
		    p[MODEL_BODY_LEN + 2] || p[MODEL_BODY_LEN + 3])
			return -EBADMSG;
		*m = t;
		return 0;
	}
	if (!rec_sum_ok(k, v, MODEL_BODY_LEN))
		return -EBADMSG;
	return model_body_decode(v->mv_data, m);
}
static int rtxn_begin(struct store *s, MDB_txn **out)
{
	MDB_txn *t = NULL;
	int rc;

	pthread_mutex_lock(&s->pool_lock);
	if (s->pool_n)
		t = s->pool[--s->pool_n];
	pthread_mutex_unlock(&s->pool_lock);
	if (t) {
		rc = mdb_txn_renew(t);
		if (rc == MDB_SUCCESS) {
			*out = t;
			return 0;
		}
		mdb_txn_abort(t);
	}
	rc = mdb_txn_begin(s->env, NULL, MDB_RDONLY, &t);
	if (rc)
		return err_from_mdb(rc);
	*out = t;
	return 0;
}

static void rtxn_end(struct store *s, MDB_txn *t)
{
	mdb_txn_reset(t);
	pthread_mutex_lock(&s->pool_lock);
	if (s->pool_n < RTXN_POOL_MAX) {
		s->pool[s->pool_n++] = t;
		t = NULL;
	}
	pthread_mutex_unlock(&s->pool_lock);
	if (t)
		mdb_txn_abort(t);
}

/*
 * Delete a chunk's record and every layer stored under its key, whatever the
 * record says (it may be corrupt). Adds what the layers held to *freed.
 */
static int chunk_purge(struct store *s, MDB_txn *txn, const uint8_t *key,
		       struct totals_rec *freed)
{
	MDB_val k = { CHUNK_KEY_LEN, (void *)key }, v;
	MDB_cursor *cur = NULL;
	int rc = mdb_del(txn, s->chunks, &k, NULL);

	if (rc == MDB_SUCCESS)
		freed->chunks++;
	else if (rc != MDB_NOTFOUND)
		return err_from_mdb(rc);
	rc = mdb_cursor_open(txn, s->layers, &cur);
	if (rc)
		return err_from_mdb(rc);
	rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE);
	while (rc == MDB_SUCCESS && k.mv_size == LAYER_KEY_LEN &&
	       !memcmp(k.mv_data, key, CHUNK_KEY_LEN)) {
		struct codec_header hk, hv;

		freed->stored_bytes += v.mv_size;
		/* Best effort: a layer too damaged to say its raw size counts nothing. */
		if (!codec_peek(v.mv_data, v.mv_size, &hk) &&
		    hk.stored_size <= v.mv_size - CODEC_HEADER_SIZE &&
		    !codec_peek((const uint8_t *)v.mv_data + CODEC_HEADER_SIZE + hk.stored_size,
				v.mv_size - CODEC_HEADER_SIZE - hk.stored_size, &hv))
			freed->raw_bytes += hk.raw_size + hv.raw_size;
		rc = mdb_cursor_del(cur, 0);
		if (rc == MDB_SUCCESS)
			rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT);
	}
	mdb_cursor_close(cur);
	return rc == MDB_NOTFOUND ? 0 : err_from_mdb(rc);
}

/* Sum the chunk records that pass their checks: the totals, when their record is lost. */
static int totals_recount(struct store *s, MDB_txn *txn, struct totals_rec *t)
{
	MDB_cursor *cur = NULL;
	MDB_val k, v;
	int rc = mdb_cursor_open(txn, s->chunks, &cur);

	memset(t, 0, sizeof(*t));
	if (rc)
		return err_from_mdb(rc);
	for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); rc == MDB_SUCCESS;
	     rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
		struct store_chunk_info ci;

		if (chunk_rec_decode(&k, &v, &ci))
			continue;
		t->chunks++;
		t->raw_bytes += ci.raw_bytes;
		t->stored_bytes += ci.stored_bytes;
	}
	mdb_cursor_close(cur);
	return rc == MDB_NOTFOUND ? 0 : err_from_mdb(rc);
}

/*
 * The totals. They decide no served byte, so a record that fails its checksum
 * is not an error: the totals are counted again from the chunk records.
 */
static int totals_read(struct store *s, MDB_txn *txn, struct totals_rec *t)
{
	MDB_val v;
	int rc = mdb_get(txn, s->meta, (MDB_val *)&totals_key, &v);

	memset(t, 0, sizeof(*t));
	if (rc == MDB_NOTFOUND)
		return 0;
	if (rc)
		return err_from_mdb(rc);
	if (!rec_sum_ok(&totals_key, &v, TOTALS_LEN - 8))
		return totals_recount(s, txn, t);
	t->chunks = le_get(v.mv_data, 8);
	t->raw_bytes = le_get((const uint8_t *)v.mv_data + 8, 8);
	t->stored_bytes = le_get((const uint8_t *)v.mv_data + 16, 8);
	return 0;
}

static int totals_write(struct store *s, MDB_txn *txn, const struct totals_rec *t)
{
	uint8_t buf[TOTALS_LEN];
	MDB_val v = { sizeof(buf), buf };

	le_put(buf, t->chunks, 8);
	le_put(buf + 8, t->raw_bytes, 8);
	le_put(buf + 16, t->stored_bytes, 8);
	le_put(buf + 24, rec_sum(&totals_key, buf, 24), 8);
	return err_from_mdb(mdb_put(txn, s->meta, (MDB_val *)&totals_key, &v, 0));
}

/* Add `add` to the totals and take `sub` off (never below zero). */
static int totals_update(struct store *s, MDB_txn *txn, const struct totals_rec *add,
			 const struct totals_rec *sub)
{
	struct totals_rec t;
	int rc = totals_read(s, txn, &t);

	if (rc)
		return rc;
	t.chunks += add->chunks;
	t.raw_bytes += add->raw_bytes;
	t.stored_bytes += add->stored_bytes;
	t.chunks -= t.chunks >= sub->chunks ? sub->chunks : t.chunks;
	t.raw_bytes -= t.raw_bytes >= sub->raw_bytes ? sub->raw_bytes : t.raw_bytes;
	t.stored_bytes -= t.stored_bytes >= sub->stored_bytes ? sub->stored_bytes : t.stored_bytes;
	return totals_write(s, txn, &t);
}

static int next_model_write(struct store *s, MDB_txn *txn, uint32_t id)
{
	uint8_t buf[NEXT_MODEL_LEN];
	MDB_val v = { sizeof(buf), buf };

	le_put(buf, id, 4);
	le_put(buf + 4, rec_sum(&next_model_key, buf, 4), 8);
	return err_from_mdb(mdb_put(txn, s->meta, (MDB_val *)&next_model_key, &v, 0));
}

/*
 * The id for a new model: past the recorded next id, every verified model and
 * the model of the last chunk key, so that a damaged counter can never hand
 * out an id whose chunks already exist.
 */
static int next_model_id(struct store *s, MDB_txn *txn, uint32_t *out)
{
	uint64_t next = 1;
	MDB_cursor *cur = NULL;
	MDB_val k, v;
	int rc = mdb_get(txn, s->meta, (MDB_val *)&next_model_key, &v);

	if (rc == MDB_SUCCESS && rec_sum_ok(&next_model_key, &v, 4))
		next = le_get(v.mv_data, 4);
	else if (rc != MDB_SUCCESS && rc != MDB_NOTFOUND)
		return err_from_mdb(rc);
	rc = mdb_cursor_open(txn, s->models, &cur);
	if (rc)
		return err_from_mdb(rc);
	for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); rc == MDB_SUCCESS;
	     rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
		struct store_model m;

		if (!model_rec_decode(&k, &v, &m) && m.id >= next)
			next = (uint64_t)m.id + 1;
	}
	mdb_cursor_close(cur);
	if (rc != MDB_NOTFOUND)
		return err_from_mdb(rc);
	rc = mdb_cursor_open(txn, s->chunks, &cur);
	if (rc)
		return err_from_mdb(rc);
	rc = mdb_cursor_get(cur, &k, &v, MDB_LAST);
	mdb_cursor_close(cur);
	if (rc == MDB_SUCCESS && k.mv_size >= 4 && get_be32(k.mv_data) >= next)
		next = (uint64_t)get_be32(k.mv_data) + 1;
	else if (rc != MDB_SUCCESS && rc != MDB_NOTFOUND)
		return err_from_mdb(rc);
	if (next > UINT32_MAX)
		return -EOVERFLOW;
	*out = (uint32_t)next;
	return 0;
}

/*
 * Format 1 -> 2, in the open's write transaction: every record gets its
 * checksum. A chunk record that fails format 1's own checks is dropped with its
 * layers (a cache loses a chunk rather than serve one nobody can vouch for); a
 * malformed model record is left as it is and reads of it report corruption.
 */
static int upgrade_v1(struct store *s, MDB_txn *txn)
{
	MDB_cursor *cur = NULL;
	uint8_t *bad = NULL, *models = NULL, rec[MODEL_REC_LEN];
	size_t n_bad = 0, cap_bad = 0, n_models = 0, cap_models = 0;
	struct totals_rec t = { 0 };
	MDB_val k, v;
	int rc;

	/*
	 * Model records grow by their checksum: collect them first and write them
	 * after the walk (a growing record may split the page under the cursor).
	 */
	rc = mdb_cursor_open(txn, s->models, &cur);
	for (rc = rc ? rc : mdb_cursor_get(cur, &k, &v, MDB_FIRST); rc == MDB_SUCCESS;
	     rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
		struct store_model m;

		if (v.mv_size != MODEL_REC_LEN_V1 || model_body_decode(v.mv_data, &m) ||
		    k.mv_size != strnlen(m.name, STORE_NAME_MAX) || memcmp(k.mv_data, m.name, k.mv_size))
			continue;
		if (n_models == cap_models) {
			void *p = realloc(models, (cap_models = cap_models ? 2 * cap_models : 16) *
							  MODEL_REC_LEN);

			if (!p) {
				rc = ENOMEM;
				break;
			}
			models = p;
		}
		model_rec_encode(models + MODEL_REC_LEN * n_models++, &m);
	}
	if (cur)
		mdb_cursor_close(cur);
	cur = NULL;
	rc = rc == MDB_NOTFOUND ? 0 : err_from_mdb(rc);
	for (size_t i = 0; i < n_models && !rc; i++) {
		uint8_t *r = models + MODEL_REC_LEN * i;

		k.mv_size = strnlen((const char *)r, STORE_NAME_MAX);
		k.mv_data = r;
		v.mv_size = MODEL_REC_LEN;
		v.mv_data = r;
		rc = err_from_mdb(mdb_put(txn, s->models, &k, &v, 0));
	}
	free(models);
	if (rc)
		return rc;
	rc = mdb_cursor_open(txn, s->chunks, &cur);
	for (rc = rc ? rc : mdb_cursor_get(cur, &k, &v, MDB_FIRST); rc == MDB_SUCCESS;
	     rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
		struct store_chunk_info ci;
		MDB_val nv = { CHUNK_REC_LEN, rec };

		if (k.mv_size != CHUNK_KEY_LEN || v.mv_size != CHUNK_REC_LEN ||
		    le_get(v.mv_data, 4) != STORE_FORMAT_V1) {
			if (n_bad == cap_bad) {
				void *p = realloc(bad, (cap_bad = cap_bad ? 2 * cap_bad : 16) *
							       CHUNK_KEY_LEN);

				if (!p) {
					rc = ENOMEM;
					break;
				}
				bad = p;
			}
			if (k.mv_size == CHUNK_KEY_LEN)
				memcpy(bad + CHUNK_KEY_LEN * n_bad++, k.mv_data, CHUNK_KEY_LEN);
			continue;
		}
		chunk_rec_fields(v.mv_data, &ci);
		chunk_rec_encode(rec, &k, &ci);
		rc = mdb_cursor_put(cur, &k, &nv, MDB_CURRENT);
		if (rc)
			break;
	}
	if (cur)
		mdb_cursor_close(cur);
	rc = rc == MDB_NOTFOUND ? 0 : err_from_mdb(rc);
	for (size_t i = 0; i < n_bad && !rc; i++)
		rc = chunk_purge(s, txn, bad + CHUNK_KEY_LEN * i, &t);
	free(bad);
	if (rc)
		return rc;
	/* Format 1's counters: the next model id as it was, the totals counted again. */
	rc = mdb_get(txn, s->meta, (MDB_val *)&next_model_key, &v);
	if (rc == MDB_SUCCESS && v.mv_size == 4)
		rc = next_model_write(s, txn, (uint32_t)le_get(v.mv_data, 4));
	else if (rc == MDB_SUCCESS) /* malformed: next_model_id() works it out without it */
		rc = err_from_mdb(mdb_del(txn, s->meta, (MDB_val *)&next_model_key, NULL));
	else
		rc = rc == MDB_NOTFOUND ? 0 : err_from_mdb(rc);
	if (!rc)
		rc = totals_recount(s, txn, &t);
	if (!rc)
		rc = totals_write(s, txn, &t);
	return rc;
}

static int open_dbs(struct store *s)
{
	MDB_txn *txn;
	MDB_val v;
	uint8_t fmt[4];
	int rc = mdb_txn_begin(s->env, NULL, 0, &txn);

	if (rc)
		return err_from_mdb(rc);
	if ((rc = mdb_dbi_open(txn, "meta", MDB_CREATE, &s->meta)) ||
	    (rc = mdb_dbi_open(txn, "models", MDB_CREATE, &s->models)) ||
	    (rc = mdb_dbi_open(txn, "chunks", MDB_CREATE, &s->chunks)) ||
	    (rc = mdb_dbi_open(txn, "layers", MDB_CREATE, &s->layers)) ||
	    (rc = mdb_dbi_open(txn, "owed", MDB_CREATE, &s->owed))) {
		rc = err_from_mdb(rc);
		goto fail;
	}
	rc = mdb_get(txn, s->meta, (MDB_val *)&format_key, &v);
	if (rc == MDB_SUCCESS && v.mv_size == 4 && le_get(v.mv_data, 4) == STORE_FORMAT_V1) {
		rc = upgrade_v1(s, txn);
		if (rc)
			goto fail;
		rc = MDB_NOTFOUND; /* write the new format below */
	} else if (rc == MDB_SUCCESS && (v.mv_size != 4 || le_get(v.mv_data, 4) != STORE_FORMAT)) {
		rc = -EPROTO; /* a store written by another format version */
		goto fail;
	}
	if (rc == MDB_NOTFOUND) {
		le_put(fmt, STORE_FORMAT, 4);
		v.mv_size = 4;
		v.mv_data = fmt;
		rc = mdb_put(txn, s->meta, (MDB_val *)&format_key, &v, 0);
	}
	if (rc) {
		rc = err_from_mdb(rc);
		goto fail;
	}
	return commit(s, txn, 0);
fail:
	mdb_txn_abort(txn);
	return rc;
}

int store_open(const struct store_opts *opts, struct store **out)
{
	struct store *s;
	/*
	 * Never MDB_WRITEMAP: writes then go through pwrite(), so a full file system
	 * fails a commit with an error (err_write()) instead of a SIGBUS on a store
	 * into the map.
	 */
	unsigned flags = MDB_NOTLS | MDB_NORDAHEAD | (opts->no_sync ? MDB_NOSYNC : 0);
	int rc;

	if (!opts->dir || !opts->map_size)
		return -EINVAL;
	if (mkdir(opts->dir, 0750) && errno != EEXIST)
		return -errno;
	s = calloc(1, sizeof(*s));
	if (!s)
		return -ENOMEM;
	pthread_mutex_init(&s->pool_lock, NULL);
	s->min_saving = opts->min_saving;
	rc = mdb_env_create(&s->env);
	if (rc) {
		rc = err_from_mdb(rc);
		s->env = NULL;
		goto fail;
	}
	if ((rc = mdb_env_set_mapsize(s->env, opts->map_size)) ||
	    (rc = mdb_env_set_maxreaders(s->env, opts->max_readers ? opts->max_readers : 126)) ||
	    (rc = mdb_env_set_maxdbs(s->env, 8)) ||
	    (rc = mdb_env_open(s->env, opts->dir, flags, 0640))) {
		rc = err_from_mdb(rc);
		goto fail;
	}
	/* Reader slots of processes that died (a killed daemon) would pin old pages. */
	{
		int dead = 0;

		mdb_reader_check(s->env, &dead);
	}
	rc = open_dbs(s);
	if (rc)
		goto fail;
	disk_reserve(s);
	*out = s;
	return 0;
fail:
	store_close(&s);
	return rc;
}

void store_close(struct store **sp)
{
	struct store *s = sp ? *sp : NULL;

	if (!s)
		return;
	for (unsigned i = 0; i < s->pool_n; i++)
		mdb_txn_abort(s->pool[i]);
	if (s->env)
		mdb_env_close(s->env);
	pthread_mutex_destroy(&s->pool_lock);
	free(s);
	*sp = NULL;
}

bool store_model_same(const struct store_model *a, const struct store_model *b)
{
	return a->num_layers == b->num_layers && a->num_kv_heads == b->num_kv_heads &&
	       a->head_dim == b->head_dim && a->dtype == b->dtype &&
	       a->rope_theta == b->rope_theta && a->rope_style == b->rope_style &&
	       a->rotary_dim == b->rotary_dim && a->scaling == b->scaling &&
	       a->factor == b->factor && a->low_freq_factor == b->low_freq_factor &&
	       a->high_freq_factor == b->high_freq_factor &&
	       a->original_max_pos == b->original_max_pos && a->beta_fast == b->beta_fast &&
	       a->beta_slow == b->beta_slow && a->max_pos == b->max_pos &&
	       a->k_pre_rope == b->k_pre_rope && a->store_codec == b->store_codec &&
	       a->store_group == b->store_group;
}

int store_model_register(struct store *s, struct store_model *m)
{
	size_t name_len = strnlen(m->name, STORE_NAME_MAX + 1);
	MDB_val k = { name_len, m->name }, v;
	uint8_t rec[MODEL_QREC_LEN];
	struct store_model old, nm = *m;
	MDB_txn *txn;
	int rc;

	if (name_len == 0 || name_len > STORE_NAME_MAX || !dtype_size(m->dtype) ||
	    m->store_codec > 3 || (m->store_codec == 3) != (m->store_group != 0) ||
	    m->store_group > 1024)
		return -EINVAL;
	nm.elem_size = dtype_size(m->dtype);
	rc = err_from_mdb(mdb_txn_begin(s->env, NULL, 0, &txn));
	if (rc)
		return rc;
	rc = err_from_mdb(mdb_get(txn, s->models, &k, &v));
	if (rc == 0) {
		/* A record that fails its checks is reported, never overwritten. */
		rc = model_rec_decode(&k, &v, &old);
		if (rc == 0)
			rc = store_model_same(&old, &nm) ? 1 : -EEXIST;
		if (rc == 1)
			m->id = old.id, m->elem_size = old.elem_size;
		goto out;
	}
	if (rc != -ENOENT)
		goto out;
	rc = next_model_id(s, txn, &nm.id);
	if (!rc)
		rc = nm.id == UINT32_MAX ? -EOVERFLOW : next_model_write(s, txn, nm.id + 1);
	if (rc)
		goto out;
	v.mv_size = model_rec_encode(rec, &nm);
	v.mv_data = rec;
	rc = err_from_mdb(mdb_put(txn, s->models, &k, &v, MDB_NOOVERWRITE));
	if (rc)
		goto out;
	rc = commit(s, txn, 0);
	txn = NULL;
	if (!rc)
		*m = nm;
out:
	if (txn)
		mdb_txn_abort(txn);
	return rc;
}

int store_model_find(struct store *s, const char *name, struct store_model *out)
{
	size_t len = strnlen(name, STORE_NAME_MAX + 1);
	MDB_val k = { len, (void *)name }, v;
	struct store_model m;
	MDB_txn *txn;
	int rc;

	if (len == 0 || len > STORE_NAME_MAX)
		return -ENOENT;
	rc = rtxn_begin(s, &txn);
	if (rc)
		return rc;
	rc = err_from_mdb(mdb_get(txn, s->models, &k, &v));
	if (rc == 0)
		rc = model_rec_decode(&k, &v, &m);
	rtxn_end(s, txn);
	if (rc == 0)
		*out = m;
	return rc;
}

/*
 * Walk the records of one database (those whose key starts with prefix, when
 * prefix_len > 0) in key order inside one read transaction, calling fn on each;
 * stops at fn's first non-zero return, which it returns.
 */
typedef int (*walk_fn)(void *ctx, const MDB_val *k, const MDB_val *v);

static int cursor_walk(struct store *s, MDB_dbi dbi, const uint8_t *prefix, size_t prefix_len,
		       walk_fn fn, void *ctx)
{
	MDB_val k = { prefix_len, (void *)prefix }, v;
	MDB_cursor *cur = NULL;
	MDB_cursor_op op = prefix_len ? MDB_SET_RANGE : MDB_FIRST;
	MDB_txn *txn;
	int rc = rtxn_begin(s, &txn);

	if (rc)
		return rc;
	rc = err_from_mdb(mdb_cursor_open(txn, dbi, &cur));
	while (rc == 0) {
		int mrc = mdb_cursor_get(cur, &k, &v, op);

		op = MDB_NEXT;
		if (mrc == MDB_NOTFOUND)
			break;
		if (mrc) {
			rc = err_from_mdb(mrc);
			break;
		}
		if (prefix_len && (k.mv_size < prefix_len || memcmp(k.mv_data, prefix, prefix_len)))
			break;
		rc = fn(ctx, &k, &v);
	}
	if (cur)
		mdb_cursor_close(cur);
	rtxn_end(s, txn);
	return rc;
}

/* Decode each walked record into a growing malloc'd array. */
typedef int (*cursor_fn)(const MDB_val *k, const MDB_val *v, void *item);

struct collection {
	cursor_fn fn;
	size_t item_size, n, cap;
	uint8_t *items;
};

static int collect_one(void *ctx, const MDB_val *k, const MDB_val *v)
{
	struct collection *c = ctx;

	if (c->n == c->cap) {
		size_t ncap = c->cap ? c->cap * 2 : 16;
		void *p = realloc(c->items, ncap * c->item_size);

		if (!p)
			return -ENOMEM;
		c->items = p;
		c->cap = ncap;
	}
	return c->fn(k, v, c->items + c->n++ * c->item_size);
}

static int collect(struct store *s, MDB_dbi dbi, const uint8_t *prefix, size_t prefix_len,
		   size_t item_size, cursor_fn fn, void **out, size_t *n_out)
{
	struct collection c = { fn, item_size, 0, 0, NULL };
	int rc = cursor_walk(s, dbi, prefix, prefix_len, collect_one, &c);

	if (rc) {
		free(c.items);
		return rc;
	}
	*out = c.items;
	*n_out = c.n;
	return 0;
}

static int model_item(const MDB_val *k, const MDB_val *v, void *item)
{
	return model_rec_decode(k, v, item);
}

int store_model_list(struct store *s, struct store_model **out, size_t *n)
{
	return collect(s, s->models, NULL, 0, sizeof(struct store_model), model_item,
		       (void **)out, n);
}

static int chunk_item(const MDB_val *k, const MDB_val *v, void *item)
{
	struct store_chunk_entry *e = item;

	if (k->mv_size != CHUNK_KEY_LEN)
		return -EBADMSG;
	memcpy(e->hash, (const uint8_t *)k->mv_data + 4, STORE_HASH_LEN);
	return chunk_rec_decode(k, v, &e->info);
}

int store_chunk_list(struct store *s, const struct store_model *m, struct store_chunk_entry **out,
		     size_t *n)
{
	uint8_t prefix[4];

	be32(prefix, m->id);
	return collect(s, s->chunks, prefix, 4, sizeof(struct store_chunk_entry), chunk_item,
		       (void **)out, n);
}

/* 1 when a chunk with a sound record is stored under key, 0 when none (or a corrupt one) is. */
static int chunk_exists(struct store *s, const uint8_t *key)
{
	MDB_val k = { CHUNK_KEY_LEN, (void *)key }, v;
	struct store_chunk_info ci;
	MDB_txn *txn;
	int rc = rtxn_begin(s, &txn);

	if (rc)
		return rc;
	rc = mdb_get(txn, s->chunks, &k, &v);
	if (rc == MDB_SUCCESS)
		rc = chunk_rec_decode(&k, &v, &ci) ? 0 : 1;
	else
		rc = rc == MDB_NOTFOUND ? 0 : err_from_mdb(rc);
	rtxn_end(s, txn);
	return rc;
}

/*
 * The write transaction of a PUT: every layer, the record and the totals, or
 * nothing. Returns 0, 1 when a sound chunk is stored under the key already, or
 * a negative errno. ci->raw_bytes and ->created are filled here.
 */
/*
 * Write a chunk in one transaction: each layer's value encoded from tensors by
 * plans, or (blobs) copied from stored bytes a peer sent (lens[l] bytes each).
 */
static int chunk_write(struct store *s, const struct store_model *m, const uint8_t *hash,
		       const void *const tensors[], const struct codec_plan *plans,
		       const void *const blobs[], const size_t *lens, struct store_chunk_info *ci)
{
	uint8_t key[LAYER_KEY_LEN], rec[CHUNK_REC_LEN];
	struct totals_rec add, replaced = { 0 };
	struct store_chunk_info ci_old;
	MDB_val k = { CHUNK_KEY_LEN, key }, v;
	MDB_txn *txn;
	int rc = err_from_mdb(mdb_txn_begin(s->env, NULL, 0, &txn));

	if (rc)
		return rc;
	chunk_key(key, m->id, hash);
	rc = mdb_get(txn, s->chunks, &k, &v);
	if (rc == MDB_SUCCESS && chunk_rec_decode(&k, &v, &ci_old) == 0)
		rc = 1;
	else if (rc == MDB_SUCCESS)
		/* A corrupt record is no chunk: clear it and its layers, then store this one. */
		rc = chunk_purge(s, txn, key, &replaced);
	else
		rc = rc == MDB_NOTFOUND ? 0 : err_from_mdb(rc);
	/* MDB_RESERVE: encode straight into LMDB's pages, one copy of the data. */
	for (uint32_t l = 0; l < m->num_layers && !rc; l++) {
		const struct codec_plan *pk = blobs ? NULL : &plans[2 * l];
		const struct codec_plan *pv = blobs ? NULL : &plans[2 * l + 1];

		layer_key(key, m->id, hash, l);
		k.mv_size = LAYER_KEY_LEN;
		v.mv_size = blobs ? lens[l] : pk->encoded_len + pv->encoded_len;
		v.mv_data = NULL;
		rc = err_write(s, mdb_put(txn, s->layers, &k, &v, MDB_RESERVE), ci->stored_bytes);
		if (rc)
			break;
		if (blobs) {
			memcpy(v.mv_data, blobs[l], lens[l]);
			continue;
		}
		codec_write(pk, tensors[2 * l], v.mv_data);
		codec_write(pv, tensors[2 * l + 1], (uint8_t *)v.mv_data + pk->encoded_len);
	}
	if (rc)
		goto abort;
	ci->raw_bytes = 2 * store_tensor_bytes(m, ci->num_tokens) * m->num_layers;
	ci->created = (uint64_t)time(NULL);
	k.mv_size = CHUNK_KEY_LEN;
	chunk_rec_encode(rec, &k, ci);
	v.mv_size = CHUNK_REC_LEN;
	v.mv_data = rec;
	rc = err_write(s, mdb_put(txn, s->chunks, &k, &v, MDB_NOOVERWRITE), ci->stored_bytes);
	add = (struct totals_rec){ 1, ci->raw_bytes, ci->stored_bytes };
	if (!rc)
		rc = totals_update(s, txn, &add, &replaced);
	if (rc)
		goto abort;
	return commit(s, txn, ci->stored_bytes);
abort:
	mdb_txn_abort(txn);
	return rc;
}

/*
 * Commit a transaction that changes nothing but its id. LMDB reuses the pages
 * a transaction freed only from the transaction after the next one on (the
 * last snapshot stays intact), so right after a delete or an eviction the
 * space it freed is not yet usable; after this it is.
 */
static int txn_advance(struct store *s)
{
	MDB_txn *txn;
	MDB_val v;
	uint8_t fmt[4];
	int rc = err_from_mdb(mdb_txn_begin(s->env, NULL, 0, &txn));

	if (rc)
		return rc;
	le_put(fmt, STORE_FORMAT, 4);
	v.mv_size = sizeof(fmt);
	v.mv_data = fmt;
	rc = err_from_mdb(mdb_put(txn, s->meta, (MDB_val *)&format_key, &v, 0));
	if (rc) {
		mdb_txn_abort(txn);
		return rc;
	}
	return commit(s, txn, 0);
}

int store_chunk_put(struct store *s, const struct store_model *m,
		    const uint8_t hash[STORE_HASH_LEN], uint32_t num_tokens, uint32_t base_pos,
		    const void *const tensors[], struct store_chunk_info *info)
{
	uint64_t tb = store_tensor_bytes(m, num_tokens);
	size_t bound = codec_bound(tb), n_tensors = 2 * (size_t)m->num_layers, total;
	uint8_t key[CHUNK_KEY_LEN], *scratch = NULL;
	struct store_chunk_info ci = { .num_tokens = num_tokens, .base_pos = base_pos,
				       .num_layers = m->num_layers };
	struct codec_plan *plans = NULL;
	int rc;

	if (!num_tokens || !tb || !bound || !m->num_layers ||
	    __builtin_mul_overflow(bound, n_tensors, &total))
		return -EINVAL;
	chunk_key(key, m->id, hash);
	rc = chunk_exists(s, key);
	if (rc)
		goto out;
	/*
	 * Decide each tensor's codec (and compress those worth it) outside the write
	 * transaction: writers are serialised, this is not. Scratch pages that no
	 * compression touches are never faulted in.
	 */
	scratch = malloc(total);
	plans = calloc(n_tensors, sizeof(*plans));
	if (!scratch || !plans) {
		rc = -ENOMEM;
		goto out;
	}
	for (size_t i = 0; i < n_tensors && !rc; i++) {
		/* Keys quantized per channel, values per token (quant.h). */
		rc = m->store_codec
			     ? codec_plan_quant(tensors[i], tb, m->dtype,
						m->num_kv_heads * m->head_dim, (int)(i % 2),
						(int)m->store_codec, m->store_group, s->min_saving,
						scratch + i * bound, bound, &plans[i])
			     : codec_plan(tensors[i], tb, m->elem_size, s->min_saving,
					  scratch + i * bound, bound, &plans[i]);
		ci.stored_bytes += plans[i].encoded_len;
	}
	if (rc)
		goto out;
	rc = chunk_write(s, m, hash, tensors, plans, NULL, NULL, &ci);
	/* Full: the room freed just before (a delete, an eviction) is usable one commit later. */
	if (rc == -ENOSPC && txn_advance(s) == 0)
		rc = chunk_write(s, m, hash, tensors, plans, NULL, NULL, &ci);
	if (rc == 0 && info)
		*info = ci;
out:
	free(scratch);
	free(plans);
	if (rc == 1 && info && store_chunk_info(s, m, hash, info))
		memset(info, 0, sizeof(*info));
	return rc;
}

static int chunk_info_txn(struct store *s, MDB_txn *txn, uint32_t model_id, const uint8_t *hash,
			  struct store_chunk_info *ci)
{
	uint8_t key[CHUNK_KEY_LEN];
	MDB_val k = { CHUNK_KEY_LEN, key }, v;
	int rc;

	chunk_key(key, model_id, hash);
	rc = err_from_mdb(mdb_get(txn, s->chunks, &k, &v));
	return rc ? rc : chunk_rec_decode(&k, &v, ci);
}

int store_chunk_info(struct store *s, const struct store_model *m,
		     const uint8_t hash[STORE_HASH_LEN], struct store_chunk_info *info)
{
	struct store_chunk_info ci;
	MDB_txn *txn;
	int rc = rtxn_begin(s, &txn);

	if (rc)
		return rc;
	rc = chunk_info_txn(s, txn, m->id, hash, &ci);
	rtxn_end(s, txn);
	if (!rc)
		*info = ci;
	return rc;
}

/*
 * A chunk's record, checked against its model: as many layers, and a tensor size
 * (into *tb) that is not zero. -EBADMSG when they disagree; chunk_info_txn()'s errors.
 */
static int chunk_shape_txn(struct store *s, MDB_txn *txn, const struct store_model *m,
			   const uint8_t *hash, struct store_chunk_info *ci, uint64_t *tb)
{
	int rc = chunk_info_txn(s, txn, m->id, hash, ci);

	if (rc)
		return rc;
	*tb = store_tensor_bytes(m, ci->num_tokens);
	return ci->num_layers != m->num_layers || !*tb ? -EBADMSG : 0;
}

int store_chunk_get(struct store *s, const struct store_model *m,
		    const uint8_t hash[STORE_HASH_LEN], uint32_t layer_begin, uint32_t layer_end,
		    void *dst, uint64_t dst_len, struct store_chunk_info *info)
{
	struct store_chunk_info ci;
	uint8_t key[LAYER_KEY_LEN];
	uint8_t *out = dst;
	uint64_t tb;
	MDB_txn *txn;
	int rc;

	if (layer_begin >= layer_end || layer_end > m->num_layers)
		return -EINVAL;
	rc = rtxn_begin(s, &txn);
	if (rc)
		return rc;
	rc = chunk_shape_txn(s, txn, m, hash, &ci, &tb);
	if (rc)
		goto out;
	if (info)
		*info = ci;
	if (dst_len != (uint64_t)(layer_end - layer_begin) * 2 * tb) {
		rc = -ENOBUFS;
		goto out;
	}
	for (uint32_t l = layer_begin; l < layer_end && !rc; l++) {
		MDB_val k = { LAYER_KEY_LEN, key }, v;
		size_t used = 0;

		layer_key(key, m->id, hash, l);
		rc = err_from_mdb(mdb_get(txn, s->layers, &k, &v));
		if (rc == -ENOENT)
			rc = -EBADMSG; /* the chunk record exists, so its layers must */
		if (!rc)
			rc = codec_decode(v.mv_data, v.mv_size, out, tb, &used);
		if (!rc)
			rc = codec_decode((const uint8_t *)v.mv_data + used, v.mv_size - used,
					  out + tb, tb, NULL);
		if (rc == -EINVAL)
			rc = -EBADMSG;
		out += 2 * tb;
	}
out:
	rtxn_end(s, txn);
	return rc;
}

/* A view and what it holds: the transaction, and each tensor's encoded record. */
struct view_impl {
	struct store_view pub;
	MDB_txn *txn;
	uint32_t dtype;
	const uint8_t **enc; /* [2 * i] K, [2 * i + 1] V: header and payload */
	size_t *enc_len;
};

int store_chunk_view(struct store *s, const struct store_model *m,
		     const uint8_t hash[STORE_HASH_LEN], uint32_t layer_begin, uint32_t layer_end,
		     struct store_chunk_info *info, struct store_view **out)
{
	struct store_chunk_info ci;
	uint8_t key[LAYER_KEY_LEN];
	struct view_impl *w;
	uint32_t n = layer_end - layer_begin;
	uint64_t tb;
	int rc;

	if (layer_begin >= layer_end || layer_end > m->num_layers)
		return -EINVAL;
	w = calloc(1, sizeof(*w));
	if (!w)
		return -ENOMEM;
	w->pub.k = calloc(n, sizeof(*w->pub.k));
	w->pub.v = calloc(n, sizeof(*w->pub.v));
	w->enc = calloc(2 * (size_t)n, sizeof(*w->enc));
	w->enc_len = calloc(2 * (size_t)n, sizeof(*w->enc_len));
	if (!w->pub.k || !w->pub.v || !w->enc || !w->enc_len) {
		rc = -ENOMEM;
		goto fail;
	}
	/* Its own transaction, not the pool's: it outlives this call and may end on
	 * another thread (the environment is MDB_NOTLS). */
	rc = err_from_mdb(mdb_txn_begin(s->env, NULL, MDB_RDONLY, &w->txn));
	if (rc)
		goto fail;
	rc = chunk_shape_txn(s, w->txn, m, hash, &ci, &tb);
	if (rc)
		goto fail;
	if (info)
		*info = ci;
	w->pub.layer_begin = layer_begin;
	w->pub.layer_end = layer_end;
	w->pub.tensor_bytes = tb;
	w->dtype = m->dtype;
	for (uint32_t i = 0; i < n; i++) {
		MDB_val k = { LAYER_KEY_LEN, key }, v;
		const uint8_t *p;
		size_t left;

		layer_key(key, m->id, hash, layer_begin + i);
		rc = err_from_mdb(mdb_get(w->txn, s->layers, &k, &v));
		if (rc) {
			rc = rc == -ENOENT ? -EBADMSG : rc; /* the record exists: so must its layers */
			goto fail;
		}
		p = v.mv_data;
		left = v.mv_size;
		for (int t = 0; t < 2; t++) {
			struct codec_header h;

			if (codec_peek(p, left, &h) || h.raw_size != tb) {
				rc = -EBADMSG;
				goto fail;
			}
			if (h.kind != CODEC_RAW) {
				rc = -EAGAIN; /* compressed or quantized: it must be decoded */
				goto fail;
			}
			w->enc[2 * i + t] = p;
			w->enc_len[2 * i + t] = CODEC_HEADER_SIZE + h.stored_size;
			(t ? w->pub.v : w->pub.k)[i] = p + CODEC_HEADER_SIZE;
			p += CODEC_HEADER_SIZE + h.stored_size;
			left -= CODEC_HEADER_SIZE + h.stored_size;
		}
	}
	*out = &w->pub;
	return 0;
fail:
	{
		struct store_view *pv = &w->pub;

		store_view_free(&pv);
	}
	return rc;
}

int store_view_verify(const struct store_view *v, uint32_t i)
{
	const struct view_impl *w = (const struct view_impl *)v;
	size_t used;

	for (int t = 0; t < 2; t++)
		if (codec_verify(w->enc[2 * i + t], w->enc_len[2 * i + t], v->tensor_bytes, w->dtype,
				 NULL, &used))
			return -EBADMSG;
	return 0;
}

void store_view_free(struct store_view **vp)
{
	struct view_impl *w = vp && *vp ? (struct view_impl *)*vp : NULL;

	if (!w)
		return;
	if (w->txn)
		mdb_txn_abort(w->txn);
	free(w->pub.k);
	free(w->pub.v);
	free(w->enc);
	free(w->enc_len);
	free(w);
	*vp = NULL;
}

int store_chunk_get_layer(struct store *s, const struct store_model *m,
			  const uint8_t hash[STORE_HASH_LEN], uint32_t layer, void *k_dst,
			  void *v_dst, uint64_t tensor_bytes, const struct codec_xform *k_xform)
{
	struct store_chunk_info ci;
	uint8_t key[LAYER_KEY_LEN];
	MDB_val k = { LAYER_KEY_LEN, key }, v;
	size_t used = 0;
	MDB_txn *txn;
	int rc;

	if (layer >= m->num_layers)
		return -EINVAL;
	rc = rtxn_begin(s, &txn);
	if (rc)
		return rc;
	rc = chunk_info_txn(s, txn, m->id, hash, &ci);
	if (rc)
		goto out;
	if (ci.num_layers != m->num_layers) {
		rc = -EBADMSG;
		goto out;
	}
	if (store_tensor_bytes(m, ci.num_tokens) != tensor_bytes) {
		rc = -ENOBUFS;
		goto out;
	}
	layer_key(key, m->id, hash, layer);
	rc = err_from_mdb(mdb_get(txn, s->layers, &k, &v));
	if (rc == -ENOENT)
		rc = -EBADMSG;
	if (!rc)
		rc = k_xform ? codec_decode_xform(v.mv_data, v.mv_size, k_dst, tensor_bytes, &used,
						  k_xform)
			     : codec_decode(v.mv_data, v.mv_size, k_dst, tensor_bytes, &used);
	if (!rc)
		rc = codec_decode((const uint8_t *)v.mv_data + used, v.mv_size - used, v_dst,
				  tensor_bytes, NULL);
	if (rc == -EINVAL)
		rc = -EBADMSG;
out:
	rtxn_end(s, txn);
	return rc;
}

int store_chunk_export(struct store *s, const struct store_model *m,
		       const uint8_t hash[STORE_HASH_LEN], struct store_chunk_info *info,
		       int (*fn)(void *ctx, uint32_t layer, const void *bytes, size_t len), void *ctx)
{
	uint8_t key[LAYER_KEY_LEN];
	MDB_val k = { LAYER_KEY_LEN, key }, v;
	MDB_txn *txn;
	int rc = rtxn_begin(s, &txn);

	if (rc)
		return rc;
	rc = chunk_info_txn(s, txn, m->id, hash, info);
	for (uint32_t l = 0; !rc && l < info->num_layers; l++) {
		layer_key(key, m->id, hash, l);
		rc = err_from_mdb(mdb_get(txn, s->layers, &k, &v));
		if (rc == -ENOENT)
			rc = -EBADMSG; /* a recorded layer is missing */
		if (!rc)
			rc = fn(ctx, l, v.mv_data, v.mv_size);
	}
	rtxn_end(s, txn);
	return rc;
}

int store_chunk_import(struct store *s, const struct store_model *m,
		       const uint8_t hash[STORE_HASH_LEN], uint32_t num_tokens, uint32_t base_pos,
		       const void *const blobs[], const size_t lens[], struct store_chunk_info *info)
{
	uint64_t tb = store_tensor_bytes(m, num_tokens);
	uint8_t key[CHUNK_KEY_LEN], *scratch = NULL;
	struct store_chunk_info ci = { .num_tokens = num_tokens, .base_pos = base_pos,
				       .num_layers = m->num_layers };
	int rc;

	if (!num_tokens || !tb || !m->num_layers)
		return -EINVAL;
	chunk_key(key, m->id, hash);
	rc = chunk_exists(s, key);
	if (rc)
		goto out;
	/* Each tensor must be what this model stores and pass its checksum. */
	scratch = malloc(tb);
	if (!scratch) {
		rc = -ENOMEM;
		goto out;
	}
	for (uint32_t l = 0; l < m->num_layers && !rc; l++) {
		size_t used = 0, used_v = 0;

		rc = codec_verify(blobs[l], lens[l], tb, m->dtype, scratch, &used);
		if (!rc)
			rc = codec_verify((const uint8_t *)blobs[l] + used, lens[l] - used, tb,
					  m->dtype, scratch, &used_v);
		if (!rc && used + used_v != lens[l])
			rc = -EBADMSG;
		ci.stored_bytes += lens[l];
	}
	if (rc)
		goto out;
	rc = chunk_write(s, m, hash, NULL, NULL, blobs, lens, &ci);
	if (rc == -ENOSPC && txn_advance(s) == 0)
		rc = chunk_write(s, m, hash, NULL, NULL, blobs, lens, &ci);
	if (rc == 0 && info)
		*info = ci;
out:
	free(scratch);
	if (rc == 1 && info && store_chunk_info(s, m, hash, info))
		memset(info, 0, sizeof(*info));
	return rc;
}

int store_chunk_lookup(struct store *s, const struct store_model *m,
		       const uint8_t (*hashes)[STORE_HASH_LEN], size_t n,
		       struct store_chunk_info *infos, bool *found)
{
	MDB_txn *txn;
	int rc = rtxn_begin(s, &txn);

	if (rc)
		return rc;
	for (size_t i = 0; i < n; i++) {
		rc = chunk_info_txn(s, txn, m->id, hashes[i], &infos[i]);
		found[i] = rc == 0;
		if (rc == -ENOENT)
			memset(&infos[i], 0, sizeof(infos[i]));
		else if (rc)
			break;
		rc = 0;
	}
	rtxn_end(s, txn);
	return rc;
}

int store_chunk_delete(struct store *s, const struct store_model *m,
		       const uint8_t hash[STORE_HASH_LEN])
{
	uint8_t key[CHUNK_KEY_LEN];
	struct store_chunk_info ci;
	struct totals_rec freed = { 0 }, none = { 0 };
	MDB_txn *txn;
	bool sound;
	int rc = err_from_mdb(mdb_txn_begin(s->env, NULL, 0, &txn));

	if (rc)
		return rc;
	chunk_key(key, m->id, hash);
	/* A corrupt record goes too, with its layers: that is how corruption is cleared. */
	rc = chunk_info_txn(s, txn, m->id, hash, &ci);
	if (rc && rc != -EBADMSG)
		goto fail;
	sound = rc == 0;
	rc = chunk_purge(s, txn, key, &freed);
	/* The record's own figures when it can be trusted, else what its layers held. */
	if (sound)
		freed = (struct totals_rec){ 1, ci.raw_bytes, ci.stored_bytes };
	if (!rc)
		rc = totals_update(s, txn, &none, &freed);
	if (rc)
		goto fail;
	return commit(s, txn, 0);
fail:
	mdb_txn_abort(txn);
	return rc;
}

struct scan {
	int (*fn)(void *ctx, uint32_t model_id, const uint8_t *hash,
		  const struct store_chunk_info *info);
	void *ctx;
};

static int scan_one(void *ctx, const MDB_val *k, const MDB_val *v)
{
	const struct scan *sc = ctx;
	const uint8_t *key = k->mv_data;
	struct store_chunk_info ci;

	/*
	 * A record that fails its checks is not handed on (its figures cannot be
	 * trusted) and does not stop the walk: reads of that chunk report it.
	 */
	if (chunk_rec_decode(k, v, &ci))
		return 0;
	return sc->fn(sc->ctx, get_be32(key), key + 4, &ci);
}

int store_chunk_scan(struct store *s,
		     int (*fn)(void *ctx, uint32_t model_id, const uint8_t *hash,
			       const struct store_chunk_info *info),
		     void *ctx)
{
	struct scan sc = { fn, ctx };

	return cursor_walk(s, s->chunks, NULL, 0, scan_one, &sc);
}

struct model_search {
	uint32_t id;
	bool corrupt; /* a record failed its checks: the model may be that one */
	struct store_model m;
};

static int model_search_one(void *ctx, const MDB_val *k, const MDB_val *v)
{
	struct model_search *ms = ctx;

	if (model_rec_decode(k, v, &ms->m)) {
		ms->corrupt = true;
		return 0;
	}
	return ms->m.id == ms->id;
}

/*
 * A model by id (for the evictor, which meets chunks by key). A corrupt record
 * of another model does not hide this one.
 */
int store_model_by_id(struct store *s, uint32_t id, struct store_model *out)
{
	struct model_search ms = { .id = id };
	int rc = cursor_walk(s, s->models, NULL, 0, model_search_one, &ms);

	if (rc == 1)
		*out = ms.m;
	else if (rc == 0)
		rc = ms.corrupt ? -EBADMSG : -ENOENT;
	return rc == 1 ? 0 : rc;
}

/* ---- pushes owed to cluster peers ---- */

#define OWED_KEY_MAX (1 + STORE_OWED_PEER_MAX + CHUNK_KEY_LEN)

static int owed_key(uint8_t *key, const char *peer, uint32_t model_id, const uint8_t *hash)
{
	size_t n = strlen(peer);

	if (!n || n > STORE_OWED_PEER_MAX)
		return -EINVAL;
	key[0] = (uint8_t)n;
	memcpy(key + 1, peer, n);
	chunk_key(key + 1 + n, model_id, hash);
	return (int)(1 + n + CHUNK_KEY_LEN);
}

int store_owed_put(struct store *s, const char *peer, uint32_t model_id, const uint8_t *hash,
		   bool owed)
{
	uint8_t key[OWED_KEY_MAX], one = 1;
	int len = owed_key(key, peer, model_id, hash), rc;
	MDB_val k, v = { 1, &one };
	MDB_txn *txn;

	if (len < 0)
		return len;
	k.mv_size = (size_t)len;
	k.mv_data = key;
	rc = err_from_mdb(mdb_txn_begin(s->env, NULL, 0, &txn));
	if (rc)
		return rc;
	rc = owed ? err_write(s, mdb_put(txn, s->owed, &k, &v, 0), OWED_KEY_MAX)
		  : err_from_mdb(mdb_del(txn, s->owed, &k, NULL));
	if (rc == -ENOENT && !owed)
		rc = 0;
	if (rc) {
		mdb_txn_abort(txn);
		return rc;
	}
	return commit(s, txn, OWED_KEY_MAX);
}

struct owed_scan {
	int (*fn)(void *ctx, const char *peer, uint32_t model_id, const uint8_t *hash);
	void *ctx;
};

static int owed_one(void *arg, const MDB_val *k, const MDB_val *v)
{
	struct owed_scan *o = arg;
	const uint8_t *p = k->mv_data;
	char peer[STORE_OWED_PEER_MAX + 1];
	size_t n;

	(void)v;
	if (k->mv_size < 1 || (n = p[0]) == 0 || n > STORE_OWED_PEER_MAX ||
	    k->mv_size != 1 + n + CHUNK_KEY_LEN)
		return 0; /* not ours: skip */
	memcpy(peer, p + 1, n);
	peer[n] = 0;
	return o->fn(o->ctx, peer, get_be32(p + 1 + n), p + 1 + n + 4);
}

int store_owed_scan(struct store *s,
		    int (*fn)(void *ctx, const char *peer, uint32_t model_id, const uint8_t *hash),
		    void *ctx)
{
	struct owed_scan o = { fn, ctx };

	return cursor_walk(s, s->owed, NULL, 0, owed_one, &o);
}

int store_totals(struct store *s, struct store_totals *out)
{
	struct totals_rec t;
	struct statvfs sv;
	MDB_envinfo ei;
	MDB_stat st, ms;
	MDB_txn *txn;
	int fd, rc = rtxn_begin(s, &txn);

	if (rc)
		return rc;
	rc = totals_read(s, txn, &t);
	if (!rc)
		rc = err_from_mdb(mdb_stat(txn, s->models, &ms));
	rtxn_end(s, txn);
	if (!rc)
		rc = err_from_mdb(mdb_env_info(s->env, &ei));
	if (!rc)
		rc = err_from_mdb(mdb_env_stat(s->env, &st));
	if (!rc)
		rc = err_from_mdb(mdb_env_get_fd(s->env, &fd));
	if (!rc && fstatvfs(fd, &sv))
		rc = -errno;
	if (rc)
		return rc;
	out->models = ms.ms_entries;
	out->chunks = t.chunks;
	out->raw_bytes = t.raw_bytes;
	out->stored_bytes = t.stored_bytes;
	out->map_size = ei.me_mapsize;
	out->map_used = (uint64_t)(ei.me_last_pgno + 1) * st.ms_psize;
	out->disk_size = (uint64_t)sv.f_blocks * sv.f_frsize;
	out->disk_avail = (uint64_t)sv.f_bavail * sv.f_frsize;
	return 0;
}
