/* store_transfer — chunks as stored, between members: export and import; see store.h. */
#include "store/store_impl.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

#include "store/codec.h"

int store_chunk_export(struct store *s, const struct store_model *m,
		       const uint8_t hash[STORE_HASH_LEN], struct store_chunk_info *info,
		       int (*fn)(void *ctx, uint32_t layer, const void *bytes, size_t len), void *ctx)
{
	uint8_t key[LAYER_KEY_LEN];
	MDB_val k = { LAYER_KEY_LEN, key }, v;
	MDB_txn *txn;
	int rc = st_rtxn_begin(s, &txn);

	if (rc)
		return rc;
	rc = st_chunk_info_txn(s, txn, m->id, hash, info);
	for (uint32_t l = 0; !rc && l < info->num_layers; l++) {
		layer_key(key, m->id, hash, l);
		rc = st_err_from_mdb(mdb_get(txn, s->layers, &k, &v));
		if (rc == -ENOENT)
			rc = -EBADMSG; /* a recorded layer is missing */
		if (!rc)
			rc = fn(ctx, l, v.mv_data, v.mv_size);
	}
	st_rtxn_end(s, txn);
	return rc;
}

int store_chunk_import(struct store *s, const struct store_model *m,
		       const uint8_t hash[STORE_HASH_LEN], uint32_t num_tokens, uint32_t base_pos,
		       const void *const blobs[], const size_t lens[], struct store_chunk_info *info,
		       struct store_tensor_shape *bad)
{
	uint64_t tb = store_tensor_bytes(m, num_tokens);
	uint32_t ch = st_token_channels(m);
	uint8_t key[CHUNK_KEY_LEN], *scratch = NULL;
	struct store_chunk_info ci = { .num_tokens = num_tokens, .base_pos = base_pos,
				       .num_layers = m->desc.num_layers };
	int rc;

	if (!num_tokens || !tb || !m->desc.num_layers)
		return -EINVAL;
	chunk_key(key, m->id, hash);
	rc = st_chunk_exists(s, key);
	if (rc)
		goto out;
	/* Each tensor must be what this model stores and pass its checksum. */
	scratch = malloc(tb);
	if (!scratch) {
		rc = -ENOMEM;
		goto out;
	}
	for (uint32_t l = 0; l < m->desc.num_layers && !rc; l++) {
		size_t used = 0, used_v = 0;

		rc = codec_verify(blobs[l], lens[l], tb, m->desc.dtype, ch, scratch, &used);
		if (!rc)
			rc = codec_verify((const uint8_t *)blobs[l] + used, lens[l] - used, tb,
					  m->desc.dtype, ch, scratch, &used_v);
		if (rc == -ENOTSUP && bad) {
			/* K (nothing used yet) or V, which starts where K ended */
			const uint8_t *t = (const uint8_t *)blobs[l] + used;

			bad->layer = l;
			bad->plane = used != 0;
			codec_quant_shape(t, lens[l] - used, &bad->rows, &bad->channels);
		}
		if (!rc && used + used_v != lens[l])
			rc = -EBADMSG;
		ci.stored_bytes += lens[l];
	}
	if (rc)
		goto out;
	rc = st_chunk_write(s, m, hash, NULL, NULL, blobs, lens, &ci);
	if (rc == -ENOSPC && st_txn_advance(s) == 0)
		rc = st_chunk_write(s, m, hash, NULL, NULL, blobs, lens, &ci);
	if (rc == 0 && info)
		*info = ci;
out:
	free(scratch);
	if (rc == 1 && info && store_chunk_info(s, m, hash, info))
		memset(info, 0, sizeof(*info));
	return rc;
}
