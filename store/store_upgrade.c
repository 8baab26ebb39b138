/*
 * store_upgrade — the on-disk format upgrades, run by store_open() (store.c) in its
 * write transaction; over the chunk and model records (store_record.c, store_chunk.c,
 * store_model.c), which know nothing of it. See store_impl.h.
 */
#include "store/store_impl.h"

#include <errno.h>
#include <lmdb.h>
#include <stdlib.h>
#include <string.h>

/*
 * Format 1 -> 2, in the open's write transaction: every record gets its
 * checksum. A chunk record that fails format 1's own checks is dropped with its
 * layers (a cache loses a chunk rather than serve one nobody can vouch for); a
 * malformed model record is left as it is and reads of it report corruption.
 */
int st_upgrade_v1(struct store *s, MDB_txn *txn)
{
	MDB_cursor *cur = NULL;
	uint8_t *bad = NULL, *models = NULL, rec[MODEL_REC_LEN];
	size_t n_bad = 0, cap_bad = 0, n_models = 0, cap_models = 0;
	struct store_codec_use dropped = { 0 };
	struct totals_rec t;
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

		if (v.mv_size != MODEL_REC_LEN_V1 || st_model_body_decode(v.mv_data, &m) ||
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
		st_model_rec_encode(models + MODEL_REC_LEN * n_models++, &m);
	}
	if (cur)
		mdb_cursor_close(cur);
	cur = NULL;
	rc = rc == MDB_NOTFOUND ? 0 : st_err_from_mdb(rc);
	for (size_t i = 0; i < n_models && !rc; i++) {
		uint8_t *r = models + MODEL_REC_LEN * i;

		k.mv_size = strnlen((const char *)r, STORE_NAME_MAX);
		k.mv_data = r;
		v.mv_size = MODEL_REC_LEN;
		v.mv_data = r;
		rc = st_err_from_mdb(mdb_put(txn, s->models, &k, &v, 0));
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
		st_chunk_rec_fields(v.mv_data, &ci);
		st_chunk_rec_encode(rec, &k, &ci);
		rc = mdb_cursor_put(cur, &k, &nv, MDB_CURRENT);
		if (rc)
			break;
	}
	if (cur)
		mdb_cursor_close(cur);
	rc = rc == MDB_NOTFOUND ? 0 : st_err_from_mdb(rc);
	for (size_t i = 0; i < n_bad && !rc; i++)
		rc = st_chunk_purge(s, txn, bad + CHUNK_KEY_LEN * i, &dropped);
	free(bad);
	if (rc)
		return rc;
	/* Format 1's counters: the next model id as it was, the totals counted again. */
	rc = mdb_get(txn, s->meta, (MDB_val *)&st_next_model_key, &v);
	if (rc == MDB_SUCCESS && v.mv_size == 4)
		rc = st_next_model_write(s, txn, (uint32_t)le_get(v.mv_data, 4));
	else if (rc == MDB_SUCCESS) /* malformed: next_model_id() works it out without it */
		rc = st_err_from_mdb(mdb_del(txn, s->meta, (MDB_val *)&st_next_model_key, NULL));
	else
		rc = rc == MDB_NOTFOUND ? 0 : st_err_from_mdb(rc);
	if (!rc)
		rc = st_totals_recount(s, txn, &t);
	if (!rc)
		rc = st_totals_write(s, txn, &t);
	return rc;
}
