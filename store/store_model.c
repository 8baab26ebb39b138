/* store_model — model records; see store.h for the contract. */
#include "store/store_impl.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "common/ckd.h"
#include "common/model_fields.h"

const MDB_val st_next_model_key = { 10, "next_model" };

uint32_t st_dtype_size(uint32_t dtype)
{
	return dtype == 3 ? 4 : (dtype == 1 || dtype == 2) ? 2 : 0;
}

uint32_t st_token_channels(const struct store_model *m)
{
	uint64_t n = (uint64_t)m->num_kv_heads * m->head_dim; /* ckd-ok: two u32, in 64 bits */

	return n > UINT32_MAX ? 0 : (uint32_t)n;
}

uint64_t store_tensor_bytes(const struct store_model *m, uint32_t num_tokens)
{
	uint64_t n = num_tokens;

	if (ckd_mul3(&n, n, m->num_kv_heads, m->head_dim) ||
	    ckd_mul(&n, n, (uint64_t)st_dtype_size(m->dtype)))
		return 0;
	return n;
}

/* Encode m's record into p (MODEL_QREC_LEN bytes of room); returns its length. */
size_t st_model_rec_encode(uint8_t *p, const struct store_model *m)
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
	le_put(p + body, st_rec_sum(&k, p, body), 8);
	return body + 8;
}

/* The fields of a model record body (format 1 and 2 share it). */
int st_model_body_decode(const uint8_t *p, struct store_model *out)
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
	m.elem_size = st_dtype_size(m.dtype);
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
int st_model_rec_decode(const MDB_val *k, const MDB_val *v, struct store_model *m)
{
	const uint8_t *p = v->mv_data;
	struct store_model t;
	int rc;

	if (v->mv_size == MODEL_QREC_LEN) {
		if (!st_rec_sum_ok(k, v, MODEL_QBODY_LEN))
			return -EBADMSG;
		rc = st_model_body_decode(p, &t);
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
	if (!st_rec_sum_ok(k, v, MODEL_BODY_LEN))
		return -EBADMSG;
	return st_model_body_decode(v->mv_data, m);
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
	return KVB_MODEL_SAME(a, b);
}

int store_model_register(struct store *s, struct store_model *m)
{
	size_t name_len = strnlen(m->name, STORE_NAME_MAX + 1);
	MDB_val k = { name_len, m->name }, v;
	uint8_t rec[MODEL_QREC_LEN];
	struct store_model old, nm = *m;
	MDB_txn *txn;
	int rc;

	if (name_len == 0 || name_len > STORE_NAME_MAX || !st_dtype_size(m->dtype) ||
	    m->store_codec > 3 || (m->store_codec == 3) != (m->store_group != 0) ||
	    m->store_group > 1024)
		return -EINVAL;
	nm.elem_size = st_dtype_size(m->dtype);
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
