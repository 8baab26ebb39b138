/* store — chunks and models in LMDB; see store.h for the contract. */
#include "store.h"

#include <errno.h>
#include <lmdb.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>

#include "codec.h"

#define STORE_FORMAT 1
#define RTXN_POOL_MAX 64
#define CHUNK_KEY_LEN (4 + STORE_HASH_LEN)
#define LAYER_KEY_LEN (CHUNK_KEY_LEN + 4)
#define CHUNK_REC_LEN 48
#define MODEL_REC_LEN (STORE_NAME_MAX + 1 + 4 * 10 + 8 * 6 + 1)

struct store {
	MDB_env *env;
	MDB_dbi meta;	/* "format", "totals", "next_model" */
	MDB_dbi models; /* name -> model record */
	MDB_dbi chunks; /* model id (BE) + hash -> chunk record */
	MDB_dbi layers; /* chunk key + layer (BE) -> encoded K then encoded V */
	double min_saving;
	pthread_mutex_t pool_lock;
	MDB_txn *pool[RTXN_POOL_MAX]; /* reset read transactions, renewed on use */
	unsigned pool_n;
};

struct totals_rec {
	uint64_t chunks, raw_bytes, stored_bytes;
};

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

static void be32(uint8_t *p, uint32_t v)
{
	p[0] = (uint8_t)(v >> 24);
	p[1] = (uint8_t)(v >> 16);
	p[2] = (uint8_t)(v >> 8);
	p[3] = (uint8_t)v;
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

static void chunk_rec_encode(uint8_t *p, const struct store_chunk_info *c)
{
	memset(p, 0, CHUNK_REC_LEN);
	le_put(p, STORE_FORMAT, 4);
	le_put(p + 4, c->num_tokens, 4);
	le_put(p + 8, c->base_pos, 4);
	le_put(p + 12, c->num_layers, 4);
	le_put(p + 16, c->raw_bytes, 8);
	le_put(p + 24, c->stored_bytes, 8);
	le_put(p + 32, c->created, 8);
}

static int chunk_rec_decode(const MDB_val *v, struct store_chunk_info *c)
{
	const uint8_t *p = v->mv_data;

	if (v->mv_size != CHUNK_REC_LEN || le_get(p, 4) != STORE_FORMAT)
		return -EBADMSG;
	c->num_tokens = (uint32_t)le_get(p + 4, 4);
	c->base_pos = (uint32_t)le_get(p + 8, 4);
	c->num_layers = (uint32_t)le_get(p + 12, 4);
	c->raw_bytes = le_get(p + 16, 8);
	c->stored_bytes = le_get(p + 24, 8);
	c->created = le_get(p + 32, 8);
	return 0;
}

static void model_rec_encode(uint8_t *p, const struct store_model *m)
{
	uint8_t *q = p + STORE_NAME_MAX + 1;
	const uint32_t u[10] = { m->id,	      m->num_layers, m->num_kv_heads,	  m->head_dim,
				 m->dtype,    m->rope_style, m->rotary_dim,	  m->scaling,
				 m->max_pos, m->original_max_pos };
	const double d[6] = { m->rope_theta,	   m->factor,	 m->low_freq_factor,
			      m->high_freq_factor, m->beta_fast, m->beta_slow };

	memset(p, 0, MODEL_REC_LEN);
	memcpy(p, m->name, strnlen(m->name, STORE_NAME_MAX));
	for (int i = 0; i < 10; i++, q += 4)
		le_put(q, u[i], 4);
	for (int i = 0; i < 6; i++, q += 8)
		le_put_f64(q, d[i]);
	*q = m->k_pre_rope;
}

static int model_rec_decode(const MDB_val *v, struct store_model *m)
{
	const uint8_t *p = v->mv_data, *q = p + STORE_NAME_MAX + 1;
	uint32_t u[10];
	double d[6];

	if (v->mv_size != MODEL_REC_LEN || p[STORE_NAME_MAX] != 0)
		return -EBADMSG;
	memset(m, 0, sizeof(*m));
	memcpy(m->name, p, STORE_NAME_MAX + 1);
	for (int i = 0; i < 10; i++, q += 4)
		u[i] = (uint32_t)le_get(q, 4);
	for (int i = 0; i < 6; i++, q += 8)
		d[i] = le_get_f64(q);
	m->id = u[0];
	m->num_layers = u[1];
	m->num_kv_heads = u[2];
	m->head_dim = u[3];
	m->dtype = u[4];
	m->elem_size = dtype_size(m->dtype);
	m->rope_style = u[5];
	m->rotary_dim = u[6];
	m->scaling = u[7];
	m->max_pos = u[8];
	m->original_max_pos = u[9];
	m->rope_theta = d[0];
	m->factor = d[1];
	m->low_freq_factor = d[2];
	m->high_freq_factor = d[3];
	m->beta_fast = d[4];
	m->beta_slow = d[5];
	m->k_pre_rope = *q != 0;
	return m->elem_size ? 0 : -EBADMSG;
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

static int totals_read(MDB_txn *txn, MDB_dbi meta, struct totals_rec *t)
{
	MDB_val k = { 6, "totals" }, v;
	int rc = mdb_get(txn, meta, &k, &v);

	memset(t, 0, sizeof(*t));
	if (rc == MDB_NOTFOUND)
		return 0;
	if (rc)
		return err_from_mdb(rc);
	if (v.mv_size != 24)
		return -EBADMSG;
	t->chunks = le_get(v.mv_data, 8);
	t->raw_bytes = le_get((const uint8_t *)v.mv_data + 8, 8);
	t->stored_bytes = le_get((const uint8_t *)v.mv_data + 16, 8);
	return 0;
}

static int totals_write(MDB_txn *txn, MDB_dbi meta, const struct totals_rec *t)
{
	uint8_t buf[24];
	MDB_val k = { 6, "totals" }, v = { sizeof(buf), buf };

	le_put(buf, t->chunks, 8);
	le_put(buf + 8, t->raw_bytes, 8);
	le_put(buf + 16, t->stored_bytes, 8);
	return err_from_mdb(mdb_put(txn, meta, &k, &v, 0));
}

static int open_dbs(struct store *s)
{
	MDB_txn *txn;
	MDB_val k = { 6, "format" }, v;
	uint8_t fmt[4];
	int rc = mdb_txn_begin(s->env, NULL, 0, &txn);

	if (rc)
		return err_from_mdb(rc);
	if ((rc = mdb_dbi_open(txn, "meta", MDB_CREATE, &s->meta)) ||
	    (rc = mdb_dbi_open(txn, "models", MDB_CREATE, &s->models)) ||
	    (rc = mdb_dbi_open(txn, "chunks", MDB_CREATE, &s->chunks)) ||
	    (rc = mdb_dbi_open(txn, "layers", MDB_CREATE, &s->layers)))
		goto fail;
	rc = mdb_get(txn, s->meta, &k, &v);
	if (rc == MDB_NOTFOUND) {
		le_put(fmt, STORE_FORMAT, 4);
		v.mv_size = 4;
		v.mv_data = fmt;
		rc = mdb_put(txn, s->meta, &k, &v, 0);
	} else if (rc == MDB_SUCCESS && (v.mv_size != 4 || le_get(v.mv_data, 4) != STORE_FORMAT)) {
		mdb_txn_abort(txn);
		return -EPROTO; /* a store written by another format version */
	}
	if (rc)
		goto fail;
	return err_from_mdb(mdb_txn_commit(txn));
fail:
	mdb_txn_abort(txn);
	return err_from_mdb(rc);
}

int store_open(const struct store_opts *opts, struct store **out)
{
	struct store *s;
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

static bool model_same_layout(const struct store_model *a, const struct store_model *b)
{
	return a->num_layers == b->num_layers && a->num_kv_heads == b->num_kv_heads &&
	       a->head_dim == b->head_dim && a->dtype == b->dtype &&
	       a->rope_theta == b->rope_theta && a->rope_style == b->rope_style &&
	       a->rotary_dim == b->rotary_dim && a->scaling == b->scaling &&
	       a->factor == b->factor && a->low_freq_factor == b->low_freq_factor &&
	       a->high_freq_factor == b->high_freq_factor &&
	       a->original_max_pos == b->original_max_pos && a->beta_fast == b->beta_fast &&
	       a->beta_slow == b->beta_slow && a->max_pos == b->max_pos &&
	       a->k_pre_rope == b->k_pre_rope;
}

int store_model_register(struct store *s, struct store_model *m)
{
	size_t name_len = strnlen(m->name, STORE_NAME_MAX + 1);
	MDB_val k = { name_len, m->name }, v, nk = { 10, "next_model" };
	uint8_t rec[MODEL_REC_LEN], idbuf[4];
	struct store_model old, nm = *m;
	MDB_txn *txn;
	int rc;

	if (name_len == 0 || name_len > STORE_NAME_MAX || !dtype_size(m->dtype))
		return -EINVAL;
	nm.elem_size = dtype_size(m->dtype);
	rc = err_from_mdb(mdb_txn_begin(s->env, NULL, 0, &txn));
	if (rc)
		return rc;
	rc = mdb_get(txn, s->models, &k, &v);
	if (rc == MDB_SUCCESS) {
		rc = model_rec_decode(&v, &old);
		if (rc == 0)
			rc = model_same_layout(&old, &nm) ? 1 : -EEXIST;
		if (rc == 1)
			m->id = old.id, m->elem_size = old.elem_size;
		mdb_txn_abort(txn);
		return rc;
	}
	if (rc != MDB_NOTFOUND)
		goto fail;
	rc = mdb_get(txn, s->meta, &nk, &v);
	if (rc == MDB_NOTFOUND)
		nm.id = 1;
	else if (rc == MDB_SUCCESS && v.mv_size == 4)
		nm.id = (uint32_t)le_get(v.mv_data, 4);
	else if (rc == MDB_SUCCESS)
		rc = MDB_CORRUPTED;
	if (rc && rc != MDB_NOTFOUND)
		goto fail;
	le_put(idbuf, nm.id + 1, 4);
	v.mv_size = 4;
	v.mv_data = idbuf;
	if ((rc = mdb_put(txn, s->meta, &nk, &v, 0)))
		goto fail;
	model_rec_encode(rec, &nm);
	v.mv_size = sizeof(rec);
	v.mv_data = rec;
	if ((rc = mdb_put(txn, s->models, &k, &v, MDB_NOOVERWRITE)))
		goto fail;
	rc = mdb_txn_commit(txn);
	if (rc)
		return err_from_mdb(rc);
	*m = nm;
	return 0;
fail:
	mdb_txn_abort(txn);
	return err_from_mdb(rc);
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
		rc = model_rec_decode(&v, &m);
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
	(void)k;
	return model_rec_decode(v, item);
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
	return chunk_rec_decode(v, &e->info);
}

int store_chunk_list(struct store *s, const struct store_model *m, struct store_chunk_entry **out,
		     size_t *n)
{
	uint8_t prefix[4];

	be32(prefix, m->id);
	return collect(s, s->chunks, prefix, 4, sizeof(struct store_chunk_entry), chunk_item,
		       (void **)out, n);
}

static int chunk_exists(struct store *s, const uint8_t *key)
{
	MDB_val k = { CHUNK_KEY_LEN, (void *)key }, v;
	MDB_txn *txn;
	int rc = rtxn_begin(s, &txn);

	if (rc)
		return rc;
	rc = mdb_get(txn, s->chunks, &k, &v);
	rtxn_end(s, txn);
	return rc == MDB_SUCCESS ? 1 : rc == MDB_NOTFOUND ? 0 : err_from_mdb(rc);
}

int store_chunk_put(struct store *s, const struct store_model *m,
		    const uint8_t hash[STORE_HASH_LEN], uint32_t num_tokens, uint32_t base_pos,
		    const void *const tensors[], struct store_chunk_info *info)
{
	uint64_t tb = store_tensor_bytes(m, num_tokens);
	size_t bound = codec_bound(tb), n_tensors = 2 * (size_t)m->num_layers, total;
	uint8_t key[LAYER_KEY_LEN], rec[CHUNK_REC_LEN], *scratch = NULL;
	struct store_chunk_info ci = { .num_tokens = num_tokens, .base_pos = base_pos,
				       .num_layers = m->num_layers };
	struct codec_plan *plans = NULL;
	struct totals_rec tot;
	MDB_txn *txn = NULL;
	MDB_val k, v;
	int rc;

	if (!num_tokens || !tb || !bound || !m->num_layers ||
	    __builtin_mul_overflow(bound, n_tensors, &total))
		return -EINVAL;
	chunk_key(key, m->id, hash);
	rc = chunk_exists(s, key);
	if (rc)
		goto exists_or_fail;
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
		rc = codec_plan(tensors[i], tb, m->elem_size, s->min_saving, scratch + i * bound,
				bound, &plans[i]);
		ci.stored_bytes += plans[i].encoded_len;
	}
	if (rc)
		goto out;
	rc = err_from_mdb(mdb_txn_begin(s->env, NULL, 0, &txn));
	if (rc)
		goto out;
	k.mv_size = CHUNK_KEY_LEN;
	k.mv_data = key;
	rc = mdb_get(txn, s->chunks, &k, &v);
	if (rc != MDB_NOTFOUND) {
		rc = rc == MDB_SUCCESS ? 1 : err_from_mdb(rc);
		goto out;
	}
	rc = 0;
	/* MDB_RESERVE: encode straight into LMDB's pages, one copy of the data. */
	for (uint32_t l = 0; l < m->num_layers && !rc; l++) {
		const struct codec_plan *pk = &plans[2 * l], *pv = &plans[2 * l + 1];

		layer_key(key, m->id, hash, l);
		k.mv_size = LAYER_KEY_LEN;
		v.mv_size = pk->encoded_len + pv->encoded_len;
		v.mv_data = NULL;
		rc = err_from_mdb(mdb_put(txn, s->layers, &k, &v, MDB_RESERVE));
		if (rc)
			break;
		codec_write(pk, tensors[2 * l], v.mv_data);
		codec_write(pv, tensors[2 * l + 1], (uint8_t *)v.mv_data + pk->encoded_len);
	}
	if (rc)
		goto out;
	ci.raw_bytes = 2 * tb * m->num_layers;
	ci.created = (uint64_t)time(NULL);
	chunk_rec_encode(rec, &ci);
	k.mv_size = CHUNK_KEY_LEN;
	v.mv_size = CHUNK_REC_LEN;
	v.mv_data = rec;
	rc = err_from_mdb(mdb_put(txn, s->chunks, &k, &v, MDB_NOOVERWRITE));
	if (!rc)
		rc = totals_read(txn, s->meta, &tot);
	if (!rc) {
		tot.chunks++;
		tot.raw_bytes += ci.raw_bytes;
		tot.stored_bytes += ci.stored_bytes;
		rc = totals_write(txn, s->meta, &tot);
	}
	if (rc)
		goto out;
	rc = err_from_mdb(mdb_txn_commit(txn));
	txn = NULL;
	if (!rc && info)
		*info = ci;
out:
	if (txn)
		mdb_txn_abort(txn);
	free(scratch);
	free(plans);
exists_or_fail:
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
	return rc ? rc : chunk_rec_decode(&v, ci);
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
	rc = chunk_info_txn(s, txn, m->id, hash, &ci);
	if (rc)
		goto out;
	if (info)
		*info = ci;
	tb = store_tensor_bytes(m, ci.num_tokens);
	if (ci.num_layers != m->num_layers || !tb) {
		rc = -EBADMSG;
		goto out;
	}
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
	uint8_t key[LAYER_KEY_LEN];
	struct store_chunk_info ci;
	struct totals_rec tot;
	MDB_val k = { CHUNK_KEY_LEN, key };
	MDB_txn *txn;
	int rc = err_from_mdb(mdb_txn_begin(s->env, NULL, 0, &txn));

	if (rc)
		return rc;
	rc = chunk_info_txn(s, txn, m->id, hash, &ci);
	if (rc)
		goto fail;
	chunk_key(key, m->id, hash);
	rc = err_from_mdb(mdb_del(txn, s->chunks, &k, NULL));
	for (uint32_t l = 0; l < ci.num_layers && !rc; l++) {
		MDB_val lk = { LAYER_KEY_LEN, key };

		layer_key(key, m->id, hash, l);
		rc = mdb_del(txn, s->layers, &lk, NULL);
		rc = rc == MDB_NOTFOUND ? 0 : err_from_mdb(rc);
	}
	if (!rc)
		rc = totals_read(txn, s->meta, &tot);
	if (rc)
		goto fail;
	tot.chunks -= tot.chunks ? 1 : 0;
	tot.raw_bytes -= tot.raw_bytes >= ci.raw_bytes ? ci.raw_bytes : tot.raw_bytes;
	tot.stored_bytes -= tot.stored_bytes >= ci.stored_bytes ? ci.stored_bytes : tot.stored_bytes;
	rc = totals_write(txn, s->meta, &tot);
	if (rc)
		goto fail;
	return err_from_mdb(mdb_txn_commit(txn));
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

	if (k->mv_size != CHUNK_KEY_LEN || chunk_rec_decode(v, &ci))
		return 0; /* not ours to judge here; reads of it report corruption */
	return sc->fn(sc->ctx,
		      (uint32_t)key[0] << 24 | (uint32_t)key[1] << 16 | (uint32_t)key[2] << 8 | key[3],
		      key + 4, &ci);
}

int store_chunk_scan(struct store *s,
		     int (*fn)(void *ctx, uint32_t model_id, const uint8_t *hash,
			       const struct store_chunk_info *info),
		     void *ctx)
{
	struct scan sc = { fn, ctx };

	return cursor_walk(s, s->chunks, NULL, 0, scan_one, &sc);
}

/* A model by id (for the evictor, which meets chunks by key). */
int store_model_by_id(struct store *s, uint32_t id, struct store_model *out)
{
	struct store_model *all;
	size_t n;
	int rc = store_model_list(s, &all, &n);

	if (rc)
		return rc;
	rc = -ENOENT;
	for (size_t i = 0; i < n; i++)
		if (all[i].id == id) {
			*out = all[i];
			rc = 0;
			break;
		}
	free(all);
	return rc;
}

int store_totals(struct store *s, struct store_totals *out)
{
	struct totals_rec t;
	MDB_envinfo ei;
	MDB_stat st, ms;
	MDB_txn *txn;
	int rc = rtxn_begin(s, &txn);

	if (rc)
		return rc;
	rc = totals_read(txn, s->meta, &t);
	if (!rc)
		rc = err_from_mdb(mdb_stat(txn, s->models, &ms));
	rtxn_end(s, txn);
	if (!rc)
		rc = err_from_mdb(mdb_env_info(s->env, &ei));
	if (!rc)
		rc = err_from_mdb(mdb_env_stat(s->env, &st));
	if (rc)
		return rc;
	out->models = ms.ms_entries;
	out->chunks = t.chunks;
	out->raw_bytes = t.raw_bytes;
	out->stored_bytes = t.stored_bytes;
	out->map_size = ei.me_mapsize;
	out->map_used = (uint64_t)(ei.me_last_pgno + 1) * st.ms_psize;
	return 0;
}
