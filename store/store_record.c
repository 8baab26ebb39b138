/*
 * store_record — the bytes of chunk and model records: encoded, decoded and checked
 * (an XXH3-64 of key and body closes each record). No LMDB call and no other module
 * of the store: the records' callers read and write them; see store_impl.h.
 */
#include "store/store_impl.h"

#include <errno.h>
#include <string.h>

#include "store/checksum.h"

/*
 * XXH3-64 of a record's key and body: a flipped bit anywhere in the record, or
 * a record that ended up under another key, fails the check.
 */
uint64_t st_rec_sum(const MDB_val *k, const void *body, size_t body_len)
{
	uint8_t buf[REC_SUM_MAX];

	memcpy(buf, k->mv_data, k->mv_size);
	memcpy(buf + k->mv_size, body, body_len);
	return checksum(buf, k->mv_size + body_len);
}

bool st_rec_sum_ok(const MDB_val *k, const MDB_val *v, size_t body_len)
{
	const uint8_t *p = v->mv_data;

	return k->mv_size + body_len <= REC_SUM_MAX && v->mv_size == body_len + 8 &&
	       le_get(p + body_len, 8) == st_rec_sum(k, p, body_len);
}

uint32_t st_dtype_size(uint32_t dtype)
{
	return dtype == 3 ? 4 : (dtype == 1 || dtype == 2) ? 2 : 0;
}

/*
 * Encode m's record into p (MODEL_REC_MAX bytes of room); returns its length. Its
 * length says what it holds: a model with local layers MODEL_LREC_LEN, else one with
 * a store codec MODEL_QREC_LEN, else MODEL_REC_LEN (what stores before each wrote).
 */
size_t st_model_rec_encode(uint8_t *p, const struct store_model *m)
{
	bool layers = kvb_model_desc_kinds(&m->desc) == 2;
	size_t body = layers		   ? MODEL_LBODY_LEN
		      : m->desc.store_codec ? MODEL_QBODY_LEN
					    : MODEL_BODY_LEN;
	uint8_t *q = p + STORE_NAME_MAX + 1;
	size_t name_len = strnlen(m->name, STORE_NAME_MAX);
	MDB_val k = { name_len, (void *)m->name };
	const struct kvb_model_desc *md = &m->desc;
	const uint32_t u[10] = { m->id,		  md->num_layers, md->num_kv_heads, md->head_dim,
				 md->dtype,	  md->rope_style, md->rotary_dim,   md->scaling,
				 md->max_pos,	  md->original_max_pos };
	const double d[6] = { md->rope_theta,	    md->factor,	   md->low_freq_factor,
			      md->high_freq_factor, md->beta_fast, md->beta_slow };

	memset(p, 0, body + 8);
	memcpy(p, m->name, name_len);
	for (int i = 0; i < 10; i++, q += 4)
		le_put(q, u[i], 4);
	for (int i = 0; i < 6; i++, q += 8)
		le_put_f64(q, d[i]);
	*q = m->desc.k_pre_rope;
	if (m->desc.store_codec) {
		/* codec (u8), 3 zero bytes, group (u32) */
		p[MODEL_BODY_LEN] = (uint8_t)m->desc.store_codec;
		le_put(p + MODEL_BODY_LEN + 4, m->desc.store_group, 4);
	}
	if (layers) {
		le_put_f64(p + MODEL_QBODY_LEN, m->desc.rope_local_theta);
		le_put(p + MODEL_QBODY_LEN + 8, m->desc.full_every, 4);
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
	m.desc.num_layers = u[1];
	m.desc.num_kv_heads = u[2];
	m.desc.head_dim = u[3];
	m.desc.dtype = u[4];
	m.elem_size = st_dtype_size(m.desc.dtype);
	m.desc.rope_style = u[5];
	m.desc.rotary_dim = u[6];
	m.desc.scaling = u[7];
	m.desc.max_pos = u[8];
	m.desc.original_max_pos = u[9];
	m.desc.rope_theta = d[0];
	m.desc.factor = d[1];
	m.desc.low_freq_factor = d[2];
	m.desc.high_freq_factor = d[3];
	m.desc.beta_fast = d[4];
	m.desc.beta_slow = d[5];
	m.desc.k_pre_rope = *q != 0;
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

	if (v->mv_size == MODEL_QREC_LEN || v->mv_size == MODEL_LREC_LEN) {
		bool layers = v->mv_size == MODEL_LREC_LEN;

		if (!st_rec_sum_ok(k, v, layers ? MODEL_LBODY_LEN : MODEL_QBODY_LEN))
			return -EBADMSG;
		rc = st_model_body_decode(p, &t);
		if (rc)
			return rc;
		t.desc.store_codec = p[MODEL_BODY_LEN];
		t.desc.store_group = (uint32_t)le_get(p + MODEL_BODY_LEN + 4, 4);
		if ((!layers && !t.desc.store_codec) || t.desc.store_codec > 3 ||
		    p[MODEL_BODY_LEN + 1] || p[MODEL_BODY_LEN + 2] || p[MODEL_BODY_LEN + 3])
			return -EBADMSG;
		if (layers) {
			t.desc.rope_local_theta = le_get_f64(p + MODEL_QBODY_LEN);
			t.desc.full_every = (uint32_t)le_get(p + MODEL_QBODY_LEN + 8, 4);
			if (!(t.desc.rope_local_theta > 0) || !t.desc.full_every ||
			    le_get(p + MODEL_QBODY_LEN + 12, 4))
				return -EBADMSG;
		}
		*m = t;
		return 0;
	}
	if (!st_rec_sum_ok(k, v, MODEL_BODY_LEN))
		return -EBADMSG;
	return st_model_body_decode(v->mv_data, m);
}

/* A chunk record: version, tokens, base_pos, layers, raw, stored, created, checksum. */
void st_chunk_rec_encode(uint8_t *p, const MDB_val *k, const struct store_chunk_info *c)
{
	memset(p, 0, CHUNK_REC_LEN);
	le_put(p, STORE_FORMAT, 4);
	le_put(p + 4, c->num_tokens, 4);
	le_put(p + 8, c->base_pos, 4);
	le_put(p + 12, c->num_layers, 4);
	le_put(p + 16, c->raw_bytes, 8);
	le_put(p + 24, c->stored_bytes, 8);
	le_put(p + 32, c->created, 8);
	le_put(p + CHUNK_REC_SUM, st_rec_sum(k, p, CHUNK_REC_SUM), 8);
}

void st_chunk_rec_fields(const uint8_t *p, struct store_chunk_info *c)
{
	c->num_tokens = (uint32_t)le_get(p + 4, 4);
	c->base_pos = (uint32_t)le_get(p + 8, 4);
	c->num_layers = (uint32_t)le_get(p + 12, 4);
	c->raw_bytes = le_get(p + 16, 8);
	c->stored_bytes = le_get(p + 24, 8);
	c->created = le_get(p + 32, 8);
}

/* Decode and verify the chunk record v stored under key k. *c is untouched on -EBADMSG. */
int st_chunk_rec_decode(const MDB_val *k, const MDB_val *v, struct store_chunk_info *c)
{
	const uint8_t *p = v->mv_data;

	if (k->mv_size != CHUNK_KEY_LEN || !st_rec_sum_ok(k, v, CHUNK_REC_SUM) ||
	    le_get(p, 4) != STORE_FORMAT)
		return -EBADMSG;
	st_chunk_rec_fields(p, c);
	return 0;
}
