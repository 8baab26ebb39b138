/*
 * store_chunk — chunks: put, get, view, info, lookup, delete, list, scan; their
 * records' bytes are store_record.c's. See store.h.
 */
#include "store/store_impl.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/ckd.h"
#include "store/codec.h"

/*
 * Delete a chunk's record and every layer stored under its key, whatever the
 * record says (it may be corrupt). Adds what the layers held to *freed.
 */
int st_chunk_purge(struct store *s, MDB_txn *txn, const uint8_t *key,
		   struct store_codec_use *freed)
{
	MDB_val k = { CHUNK_KEY_LEN, (void *)key }, v;
	MDB_cursor *cur = NULL;
	int rc = mdb_del(txn, s->chunks, &k, NULL);

	if (rc == MDB_SUCCESS)
		freed->chunks++;
	else if (rc != MDB_NOTFOUND)
		return st_err_from_mdb(rc);
	rc = mdb_cursor_open(txn, s->layers, &cur);
	if (rc)
		return st_err_from_mdb(rc);
	rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE);
	while (rc == MDB_SUCCESS && k.mv_size == LAYER_KEY_LEN &&
	       !memcmp(k.mv_data, key, CHUNK_KEY_LEN)) {
		struct codec_header hk, hv;

		st_layer_forget(s, k.mv_data, &v);
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
	return rc == MDB_NOTFOUND ? 0 : st_err_from_mdb(rc);
}

static int chunk_item(const MDB_val *k, const MDB_val *v, void *item)
{
	struct store_chunk_entry *e = item;

	if (k->mv_size != CHUNK_KEY_LEN)
		return -EBADMSG;
	memcpy(e->hash, (const uint8_t *)k->mv_data + 4, STORE_HASH_LEN);
	return st_chunk_rec_decode(k, v, &e->info);
}

int store_chunk_list(struct store *s, const struct store_model *m, struct store_chunk_entry **out,
		     size_t *n)
{
	uint8_t prefix[4];

	be32(prefix, m->id);
	return st_collect(s, s->chunks, prefix, 4, sizeof(struct store_chunk_entry), chunk_item,
		       (void **)out, n);
}

/* 1 when a chunk with a sound record is stored under key, 0 when none (or a corrupt one) is. */
int st_chunk_exists(struct store *s, const uint8_t *key)
{
	MDB_val k = { CHUNK_KEY_LEN, (void *)key }, v;
	struct store_chunk_info ci;
	MDB_txn *txn;
	int rc = st_rtxn_begin(s, &txn);

	if (rc)
		return rc;
	rc = mdb_get(txn, s->chunks, &k, &v);
	if (rc == MDB_SUCCESS)
		rc = st_chunk_rec_decode(&k, &v, &ci) ? 0 : 1;
	else
		rc = rc == MDB_NOTFOUND ? 0 : st_err_from_mdb(rc);
	st_rtxn_end(s, txn);
	return rc;
}

/*
 * Write a chunk in one transaction: each layer's value encoded from tensors by
 * plans, or (blobs) copied from stored bytes a peer sent (lens[l] bytes each).
 */
int st_chunk_write(struct store *s, const struct store_model *m, const uint8_t *hash,
		   const void *const tensors[], const struct codec_plan *plans,
		   const void *const blobs[], const size_t *lens, struct store_chunk_info *ci)
{
	uint8_t key[LAYER_KEY_LEN], rec[CHUNK_REC_LEN];
	struct store_codec_use add, replaced = { 0 };
	struct store_chunk_info ci_old;
	MDB_val k = { CHUNK_KEY_LEN, key }, v;
	MDB_txn *txn;
	int rc = st_err_from_mdb(mdb_txn_begin(s->env, NULL, 0, &txn));

	if (rc)
		return rc;
	chunk_key(key, m->id, hash);
	rc = mdb_get(txn, s->chunks, &k, &v);
	if (rc == MDB_SUCCESS && st_chunk_rec_decode(&k, &v, &ci_old) == 0)
		rc = 1;
	else if (rc == MDB_SUCCESS)
		/* A corrupt record is no chunk: clear it and its layers, then store this one. */
		rc = st_chunk_purge(s, txn, key, &replaced);
	else
		rc = rc == MDB_NOTFOUND ? 0 : st_err_from_mdb(rc);
	/* MDB_RESERVE: encode straight into LMDB's pages, one copy of the data. */
	for (uint32_t l = 0; l < m->desc.num_layers && !rc; l++) {
		const struct codec_plan *pk = blobs ? NULL : &plans[2 * l];
		const struct codec_plan *pv = blobs ? NULL : &plans[2 * l + 1];

		layer_key(key, m->id, hash, l);
		k.mv_size = LAYER_KEY_LEN;
		v.mv_size = blobs ? lens[l] : pk->encoded_len + pv->encoded_len;
		v.mv_data = NULL;
		rc = st_err_write(s, mdb_put(txn, s->layers, &k, &v, MDB_RESERVE), ci->stored_bytes);
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
	ci->raw_bytes = 2 * store_tensor_bytes(m, ci->num_tokens) * m->desc.num_layers;
	ci->created = (uint64_t)time(NULL);
	k.mv_size = CHUNK_KEY_LEN;
	st_chunk_rec_encode(rec, &k, ci);
	v.mv_size = CHUNK_REC_LEN;
	v.mv_data = rec;
	rc = st_err_write(s, mdb_put(txn, s->chunks, &k, &v, MDB_NOOVERWRITE), ci->stored_bytes);
	add = (struct store_codec_use){ 1, ci->raw_bytes, ci->stored_bytes };
	/* A corrupt record replaced was under the same key: the same model, the same codec. */
	if (!rc)
		rc = st_totals_update(s, txn, m->desc.store_codec, &add, &replaced);
	if (rc)
		goto abort;
	return st_commit(s, txn, ci->stored_bytes);
abort:
	mdb_txn_abort(txn);
	return rc;
}

int store_chunk_put(struct store *s, const struct store_model *m,
		    const uint8_t hash[STORE_HASH_LEN], uint32_t num_tokens, uint32_t base_pos,
		    const void *const tensors[], struct store_chunk_info *info)
{
	uint64_t tb = store_tensor_bytes(m, num_tokens);
	size_t bound = codec_bound(tb), n_tensors = 2 * (size_t)m->desc.num_layers, total;
	uint8_t key[CHUNK_KEY_LEN], *scratch = NULL;
	struct store_chunk_info ci = { .num_tokens = num_tokens, .base_pos = base_pos,
				       .num_layers = m->desc.num_layers };
	struct codec_plan *plans = NULL;
	int rc;

	if (!num_tokens || !tb || !bound || !m->desc.num_layers ||
	    ckd_mul(&total, bound, n_tensors))
		return -EINVAL;
	chunk_key(key, m->id, hash);
	rc = st_chunk_exists(s, key);
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
		rc = m->desc.store_codec
			     ? codec_plan_quant(tensors[i], tb, m->desc.dtype,
						m->desc.num_kv_heads * m->desc.head_dim,
						(int)(i % 2), (int)m->desc.store_codec, m->desc.store_group,
						s->min_saving,
						scratch + i * bound, bound, &plans[i])
			     : codec_plan(tensors[i], tb, m->elem_size, s->min_saving,
					  scratch + i * bound, bound, &plans[i]);
		ci.stored_bytes += plans[i].encoded_len;
	}
	if (rc)
		goto out;
	rc = st_chunk_write(s, m, hash, tensors, plans, NULL, NULL, &ci);
	/* Full: the room freed just before (a delete, an eviction) is usable one commit later. */
	if (rc == -ENOSPC && st_txn_advance(s) == 0)
		rc = st_chunk_write(s, m, hash, tensors, plans, NULL, NULL, &ci);
	if (rc == 0 && info)
		*info = ci;
out:
	free(scratch);
	free(plans);
	if (rc == 1 && info && store_chunk_info(s, m, hash, info))
		memset(info, 0, sizeof(*info));
	return rc;
}

int st_chunk_info_txn(struct store *s, MDB_txn *txn, uint32_t model_id, const uint8_t *hash,
		      struct store_chunk_info *ci)
{
	uint8_t key[CHUNK_KEY_LEN];
	MDB_val k = { CHUNK_KEY_LEN, key }, v;
	int rc;

	chunk_key(key, model_id, hash);
	rc = st_err_from_mdb(mdb_get(txn, s->chunks, &k, &v));
	return rc ? rc : st_chunk_rec_decode(&k, &v, ci);
}

int store_chunk_info(struct store *s, const struct store_model *m,
		     const uint8_t hash[STORE_HASH_LEN], struct store_chunk_info *info)
{
	struct store_chunk_info ci;
	MDB_txn *txn;
	int rc = st_rtxn_begin(s, &txn);

	if (rc)
		return rc;
	rc = st_chunk_info_txn(s, txn, m->id, hash, &ci);
	st_rtxn_end(s, txn);
	if (!rc)
		*info = ci;
	return rc;
}

/*
 * A chunk's record, checked against its model: as many layers, and a tensor size
 * (into *tb) that is not zero. -EBADMSG when they disagree; st_chunk_info_txn()'s errors.
 */
static int chunk_shape_txn(struct store *s, MDB_txn *txn, const struct store_model *m,
			   const uint8_t *hash, struct store_chunk_info *ci, uint64_t *tb)
{
	int rc = st_chunk_info_txn(s, txn, m->id, hash, ci);

	if (rc)
		return rc;
	*tb = store_tensor_bytes(m, ci->num_tokens);
	return ci->num_layers != m->desc.num_layers || !*tb ? -EBADMSG : 0;
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

	if (layer_begin >= layer_end || layer_end > m->desc.num_layers)
		return -EINVAL;
	rc = st_rtxn_begin(s, &txn);
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
		rc = st_err_from_mdb(mdb_get(txn, s->layers, &k, &v));
		if (rc == -ENOENT)
			rc = -EBADMSG; /* the chunk record exists, so its layers must */
		if (!rc) {
			uint64_t fp;
			unsigned fl = st_read_flags(s, key, &v, &fp);

			rc = codec_decode_flags(v.mv_data, v.mv_size, out, tb, &used, fl);
			if (!rc)
				rc = codec_decode_flags((const uint8_t *)v.mv_data + used,
							v.mv_size - used, out + tb, tb, NULL, fl);
			st_read_done(s, fp, fl, rc);
		}
		if (rc == -EINVAL)
			rc = -EBADMSG;
		out += 2 * tb;
	}
out:
	st_rtxn_end(s, txn);
	return rc;
}

/* A view and what it holds: the transaction, and each tensor's encoded record. */
struct view_impl {
	struct store_view pub;
	MDB_txn *txn;
	uint32_t dtype, channels;
	const uint8_t **enc; /* [2 * i] K, [2 * i + 1] V: header and payload */
	size_t *enc_len;
	struct store *s;
	unsigned *flags;     /* [i]: st_read_flags() of layer i, taken before anything read it */
	uint64_t *fp;
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

	if (layer_begin >= layer_end || layer_end > m->desc.num_layers)
		return -EINVAL;
	w = calloc(1, sizeof(*w));
	if (!w)
		return -ENOMEM;
	w->pub.k = calloc(n, sizeof(*w->pub.k));
	w->pub.v = calloc(n, sizeof(*w->pub.v));
	w->enc = calloc(2 * (size_t)n, sizeof(*w->enc));
	w->enc_len = calloc(2 * (size_t)n, sizeof(*w->enc_len));
	w->flags = calloc(n, sizeof(*w->flags));
	w->fp = calloc(n, sizeof(*w->fp));
	w->s = s;
	if (!w->pub.k || !w->pub.v || !w->enc || !w->enc_len || !w->flags || !w->fp) {
		rc = -ENOMEM;
		goto fail;
	}
	/* Its own transaction, not the pool's: it outlives this call and may end on
	 * another thread (the environment is MDB_NOTLS). */
	rc = st_err_from_mdb(mdb_txn_begin(s->env, NULL, MDB_RDONLY, &w->txn));
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
	w->dtype = m->desc.dtype;
	w->channels = st_token_channels(m);
	for (uint32_t i = 0; i < n; i++) {
		MDB_val k = { LAYER_KEY_LEN, key }, v;
		const uint8_t *p;
		size_t left;

		layer_key(key, m->id, hash, layer_begin + i);
		rc = st_err_from_mdb(mdb_get(w->txn, s->layers, &k, &v));
		if (rc) {
			rc = rc == -ENOENT ? -EBADMSG : rc; /* the record exists: so must its layers */
			goto fail;
		}
		w->flags[i] = st_read_flags(s, key, &v, &w->fp[i]);
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
	int rc = 0;

	for (int t = 0; t < 2 && !rc && !(w->flags[i] & CODEC_TRUSTED); t++)
		if (codec_verify(w->enc[2 * i + t], w->enc_len[2 * i + t], v->tensor_bytes, w->dtype,
				 w->channels, NULL, &used))
			rc = -EBADMSG;
	st_read_done(w->s, w->fp[i], w->flags[i], rc);
	return rc;
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
	free(w->flags);
	free(w->fp);
	free(w);
	*vp = NULL;
}

/* The value of one layer of a chunk, in txn, after checking the chunk against m and tensor_bytes. */
static int layer_value(struct store *s, MDB_txn *txn, const struct store_model *m,
		       const uint8_t hash[STORE_HASH_LEN], uint32_t layer, uint64_t tensor_bytes,
		       MDB_val *v)
{
	struct store_chunk_info ci;
	uint8_t key[LAYER_KEY_LEN];
	MDB_val k = { LAYER_KEY_LEN, key };
	int rc = st_chunk_info_txn(s, txn, m->id, hash, &ci);

	if (rc)
		return rc;
	if (ci.num_layers != m->desc.num_layers)
		return -EBADMSG;
	if (store_tensor_bytes(m, ci.num_tokens) != tensor_bytes)
		return -ENOBUFS;
	layer_key(key, m->id, hash, layer);
	rc = st_err_from_mdb(mdb_get(txn, s->layers, &k, v));
	return rc == -ENOENT ? -EBADMSG : rc;
}

/* What to do with one layer's value: decode it into place, or hand it to transforms. */
struct layer_use {
	void *k_dst, *v_dst;				/* get: the destinations */
	const struct codec_xform *k_xform, *v_xform;	/* apply: v_xform set */
	uint64_t tensor_bytes;
};

static int use_layer(const MDB_val *v, const struct layer_use *u, unsigned fl)
{
	size_t used = 0;
	int rc;

	if (u->v_xform) {
		rc = codec_apply(v->mv_data, v->mv_size, u->tensor_bytes, &used, u->k_xform, fl);
		if (!rc)
			rc = codec_apply((const uint8_t *)v->mv_data + used, v->mv_size - used,
					 u->tensor_bytes, NULL, u->v_xform, fl);
		return rc;
	}
	if (!u->k_dst) {
		/* V only: K's header says where V starts */
		struct codec_header h;

		rc = codec_peek(v->mv_data, v->mv_size, &h);
		if (!rc) /* ckd-ok: peek checked stored_size against the value's size */
			used = CODEC_HEADER_SIZE + (size_t)h.stored_size;
	} else {
		rc = u->k_xform ? codec_decode_xform(v->mv_data, v->mv_size, u->k_dst,
						     u->tensor_bytes, &used, u->k_xform, fl)
				: codec_decode_flags(v->mv_data, v->mv_size, u->k_dst,
						     u->tensor_bytes, &used, fl);
	}
	if (!rc && u->v_dst)
		rc = codec_decode_flags((const uint8_t *)v->mv_data + used, v->mv_size - used,
					u->v_dst, u->tensor_bytes, NULL, fl);
	return rc;
}

/* One layer of a chunk, checked against m and u->tensor_bytes, used as u says, in a read txn. */
static int with_layer(struct store *s, const struct store_model *m,
		      const uint8_t hash[STORE_HASH_LEN], uint32_t layer, const struct layer_use *u)
{
	MDB_val v;
	MDB_txn *txn;
	int rc;

	if (layer >= m->desc.num_layers)
		return -EINVAL;
	rc = st_rtxn_begin(s, &txn);
	if (rc)
		return rc;
	rc = layer_value(s, txn, m, hash, layer, u->tensor_bytes, &v);
	if (!rc) {
		uint8_t key[LAYER_KEY_LEN];
		uint64_t fp;
		unsigned fl;

		layer_key(key, m->id, hash, layer);
		/* a read of one plane verifies that plane only: remembered apart */
		fl = st_read_flags_part(s, key, &v, u->v_xform || (u->k_dst && u->v_dst) ? 0 :
						    u->k_dst ? 1 : 2, &fp);
		rc = use_layer(&v, u, fl);
		st_read_done(s, fp, fl, rc);
	}
	if (rc == -EINVAL)
		rc = -EBADMSG;
	st_rtxn_end(s, txn);
	return rc;
}

int store_chunk_get_layer(struct store *s, const struct store_model *m,
			  const uint8_t hash[STORE_HASH_LEN], uint32_t layer, void *k_dst,
			  void *v_dst, uint64_t tensor_bytes, const struct codec_xform *k_xform)
{
	struct layer_use u = { k_dst, v_dst, k_xform, NULL, tensor_bytes };

	if (!k_dst && !v_dst)
		return -EINVAL;
	return with_layer(s, m, hash, layer, &u);
}

int store_chunk_apply_layer(struct store *s, const struct store_model *m,
			    const uint8_t hash[STORE_HASH_LEN], uint32_t layer,
			    uint64_t tensor_bytes, const struct codec_xform *k_xform,
			    const struct codec_xform *v_xform)
{
	struct layer_use u = { NULL, NULL, k_xform, v_xform, tensor_bytes };

	if (!v_xform || !k_xform)
		return -EINVAL;
	return with_layer(s, m, hash, layer, &u);
}

int store_chunk_lookup(struct store *s, const struct store_model *m,
		       const uint8_t (*hashes)[STORE_HASH_LEN], size_t n,
		       struct store_chunk_info *infos, bool *found)
{
	MDB_txn *txn;
	int rc = st_rtxn_begin(s, &txn);

	if (rc)
		return rc;
	for (size_t i = 0; i < n; i++) {
		rc = st_chunk_info_txn(s, txn, m->id, hashes[i], &infos[i]);
		found[i] = rc == 0;
		if (rc == -ENOENT)
			memset(&infos[i], 0, sizeof(infos[i]));
		else if (rc)
			break;
		rc = 0;
	}
	st_rtxn_end(s, txn);
	return rc;
}

int store_chunk_delete(struct store *s, const struct store_model *m,
		       const uint8_t hash[STORE_HASH_LEN])
{
	uint8_t key[CHUNK_KEY_LEN];
	struct store_chunk_info ci;
	struct store_codec_use freed = { 0 }, none = { 0 };
	MDB_txn *txn;
	bool sound;
	int rc = st_err_from_mdb(mdb_txn_begin(s->env, NULL, 0, &txn));

	if (rc)
		return rc;
	chunk_key(key, m->id, hash);
	/* A corrupt record goes too, with its layers: that is how corruption is cleared. */
	rc = st_chunk_info_txn(s, txn, m->id, hash, &ci);
	if (rc && rc != -EBADMSG)
		goto fail;
	sound = rc == 0;
	rc = st_chunk_purge(s, txn, key, &freed);
	/* The record's own figures when it can be trusted, else what its layers held. */
	if (sound)
		freed = (struct store_codec_use){ 1, ci.raw_bytes, ci.stored_bytes };
	if (!rc)
		rc = st_totals_update(s, txn, m->desc.store_codec, &none, &freed);
	if (rc)
		goto fail;
	return st_commit(s, txn, 0);
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
	if (st_chunk_rec_decode(k, v, &ci))
		return 0;
	return sc->fn(sc->ctx, get_be32(key), key + 4, &ci);
}

int store_chunk_scan(struct store *s,
		     int (*fn)(void *ctx, uint32_t model_id, const uint8_t *hash,
			       const struct store_chunk_info *info),
		     void *ctx)
{
	struct scan sc = { fn, ctx };

	return st_cursor_walk(s, s->chunks, NULL, 0, scan_one, &sc);
}
