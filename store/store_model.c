/*
 * store_model — models: register, find, list, by id, and the next id; their records'
 * bytes are store_record.c's. See store.h for the contract.
 */
#include "store/store_impl.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/ckd.h"

const MDB_val st_next_model_key = { 10, "next_model" };

uint32_t st_token_channels(const struct store_model *m)
{
	/* ckd-ok: two u32, in 64 bits */
	uint64_t n = (uint64_t)m->desc.num_kv_heads * m->desc.head_dim;

	return n > UINT32_MAX ? 0 : (uint32_t)n;
}

uint64_t store_tensor_bytes(const struct store_model *m, uint32_t num_tokens)
{
	uint64_t n = num_tokens;

	if (ckd_mul3(&n, n, m->desc.num_kv_heads, m->desc.head_dim) ||
	    ckd_mul(&n, n, (uint64_t)st_dtype_size(m->desc.dtype)))
		return 0;
	return n;
}

int st_next_model_write(struct store *s, MDB_txn *txn, uint32_t id)
{
	uint8_t buf[NEXT_MODEL_LEN];
	MDB_val v = { sizeof(buf), buf };

	le_put(buf, id, 4);
	le_put(buf + 4, st_rec_sum(&st_next_model_key, buf, 4), 8);
	return st_err_from_mdb(mdb_put(txn, s->meta, (MDB_val *)&st_next_model_key, &v, 0));
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
	int rc = mdb_get(txn, s->meta, (MDB_val *)&st_next_model_key, &v);

	if (rc == MDB_SUCCESS && st_rec_sum_ok(&st_next_model_key, &v, 4))
		next = le_get(v.mv_data, 4);
	else if (rc != MDB_SUCCESS && rc != MDB_NOTFOUND)
		return st_err_from_mdb(rc);
	rc = mdb_cursor_open(txn, s->models, &cur);
	if (rc)
		return st_err_from_mdb(rc);
	for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); rc == MDB_SUCCESS;
	     rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
		struct store_model m;

		if (!st_model_rec_decode(&k, &v, &m) && m.id >= next)
			next = (uint64_t)m.id + 1;
	}
	mdb_cursor_close(cur);
	if (rc != MDB_NOTFOUND)
		return st_err_from_mdb(rc);
	rc = mdb_cursor_open(txn, s->chunks, &cur);
	if (rc)
		return st_err_from_mdb(rc);
	rc = mdb_cursor_get(cur, &k, &v, MDB_LAST);
	mdb_cursor_close(cur);
	if (rc == MDB_SUCCESS && k.mv_size >= 4 && get_be32(k.mv_data) >= next)
		next = (uint64_t)get_be32(k.mv_data) + 1;
	else if (rc != MDB_SUCCESS && rc != MDB_NOTFOUND)
		return st_err_from_mdb(rc);
	if (next > UINT32_MAX)
		return -EOVERFLOW;
	*out = (uint32_t)next;
	return 0;
}

bool store_model_same(const struct store_model *a, const struct store_model *b)
{
	return !kvb_model_desc_diff(&a->desc, &b->desc);
}

int store_model_register(struct store *s, struct store_model *m)
{
	size_t name_len = strnlen(m->name, STORE_NAME_MAX + 1);
	MDB_val k = { name_len, m->name }, v;
	uint8_t rec[MODEL_REC_MAX];
	struct store_model old, nm = *m;
	MDB_txn *txn;
	int rc;

	if (name_len == 0 || name_len > STORE_NAME_MAX || !st_dtype_size(m->desc.dtype) ||
	    m->desc.store_codec > 3 || (m->desc.store_codec == 3) != (m->desc.store_group != 0) ||
	    m->desc.store_group > 1024 ||
	    (m->desc.rope_local_theta > 0) != (m->desc.full_every != 0))
		return -EINVAL;
	nm.elem_size = st_dtype_size(m->desc.dtype);
	rc = st_err_from_mdb(mdb_txn_begin(s->env, NULL, 0, &txn));
	if (rc)
		return rc;
	rc = st_err_from_mdb(mdb_get(txn, s->models, &k, &v));
	if (rc == 0) {
		/* A record that fails its checks is reported, never overwritten. */
		rc = st_model_rec_decode(&k, &v, &old);
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
		rc = nm.id == UINT32_MAX ? -EOVERFLOW : st_next_model_write(s, txn, nm.id + 1);
	if (rc)
		goto out;
	v.mv_size = st_model_rec_encode(rec, &nm);
	v.mv_data = rec;
	rc = st_err_from_mdb(mdb_put(txn, s->models, &k, &v, MDB_NOOVERWRITE));
	if (rc)
		goto out;
	rc = st_commit(s, txn, 0);
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
	rc = st_rtxn_begin(s, &txn);
	if (rc)
		return rc;
	rc = st_err_from_mdb(mdb_get(txn, s->models, &k, &v));
	if (rc == 0)
		rc = st_model_rec_decode(&k, &v, &m);
	st_rtxn_end(s, txn);
	if (rc == 0)
		*out = m;
	return rc;
}

static int model_item(const MDB_val *k, const MDB_val *v, void *item)
{
	return st_model_rec_decode(k, v, item);
}

int store_model_list(struct store *s, struct store_model **out, size_t *n)
{
	return st_collect(s, s->models, NULL, 0, sizeof(struct store_model), model_item,
		       (void **)out, n);
}

struct model_search {
	uint32_t id;
	bool corrupt; /* a record failed its checks: the model may be that one */
	struct store_model m;
};

static int model_search_one(void *ctx, const MDB_val *k, const MDB_val *v)
{
	struct model_search *ms = ctx;

	if (st_model_rec_decode(k, v, &ms->m)) {
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
	int rc = st_cursor_walk(s, s->models, NULL, 0, model_search_one, &ms);

	if (rc == 1)
		*out = ms.m;
	else if (rc == 0)
		rc = ms.corrupt ? -EBADMSG : -ENOENT;
	return rc == 1 ? 0 : rc;
}
