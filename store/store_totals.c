/*
 * store_totals — the totals record (chunks, raw and stored bytes, by codec) kept in the
 * meta table and updated with every write, its recount and repair, and store_totals();
 * see store.h and store_impl.h.
 */
#include "store/store_impl.h"

#include <errno.h>
#include <fcntl.h>
#include <lmdb.h>
#include <stdlib.h>
#include <string.h>
#include <sys/statvfs.h>

static const MDB_val totals_key = { 6, "totals" };

/* A model's id and store codec, for counting chunks by codec. */
struct model_codec {
	uint32_t id, codec;
};

/* The id and store codec of every model whose record is sound, in a malloc'd array. */
static int model_codecs(struct store *s, MDB_txn *txn, struct model_codec **out, size_t *n_out)
{
	struct model_codec *mc = NULL;
	size_t n = 0, cap = 0;
	MDB_cursor *cur = NULL;
	MDB_val k, v;
	int rc = mdb_cursor_open(txn, s->models, &cur);

	if (rc)
		return st_err_from_mdb(rc);
	for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); rc == MDB_SUCCESS;
	     rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
		struct store_model m;

		if (st_model_rec_decode(&k, &v, &m))
			continue;
		if (n == cap) {
			void *p = realloc(mc, (cap = cap ? 2 * cap : 16) * sizeof(*mc));

			if (!p) {
				rc = ENOMEM;
				break;
			}
			mc = p;
		}
		mc[n++] = (struct model_codec){ m.id, m.desc.store_codec };
	}
	mdb_cursor_close(cur);
	if (rc != MDB_NOTFOUND) {
		free(mc);
		return st_err_from_mdb(rc);
	}
	*out = mc;
	*n_out = n;
	return 0;
}

static void use_add(struct store_codec_use *u, const struct store_codec_use *add)
{
	u->chunks += add->chunks;
	u->raw_bytes += add->raw_bytes;
	u->stored_bytes += add->stored_bytes;
}

static void use_sub(struct store_codec_use *u, const struct store_codec_use *sub)
{
	u->chunks -= u->chunks >= sub->chunks ? sub->chunks : u->chunks;
	u->raw_bytes -= u->raw_bytes >= sub->raw_bytes ? sub->raw_bytes : u->raw_bytes;
	u->stored_bytes -= u->stored_bytes >= sub->stored_bytes ? sub->stored_bytes
								: u->stored_bytes;
}

/*
 * Sum the chunk records that pass their checks: the totals, when their record
 * is lost. A chunk counts under its model's store codec when the model's record
 * is sound (chunk keys start with the model id, so one lookup per model).
 */
int st_totals_recount(struct store *s, MDB_txn *txn, struct totals_rec *t)
{
	struct model_codec *mc = NULL;
	struct store_codec_use *by = NULL;
	uint32_t last_id = 0;
	MDB_cursor *cur = NULL;
	MDB_val k, v;
	size_t n_mc = 0;
	int rc;

	memset(t, 0, sizeof(*t));
	atomic_fetch_add_explicit(&s->chunk_walks, 1, memory_order_relaxed);
	rc = model_codecs(s, txn, &mc, &n_mc);
	if (rc)
		return rc;
	rc = mdb_cursor_open(txn, s->chunks, &cur);
	if (rc) {
		free(mc);
		return st_err_from_mdb(rc);
	}
	for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); rc == MDB_SUCCESS;
	     rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT)) {
		struct store_chunk_info ci;
		struct store_codec_use one;
		uint32_t id;

		if (st_chunk_rec_decode(&k, &v, &ci))
			continue;
		one = (struct store_codec_use){ 1, ci.raw_bytes, ci.stored_bytes };
		use_add(&t->all, &one);
		id = get_be32(k.mv_data);
		if (!by || id != last_id) {
			by = NULL;
			last_id = id;
			for (size_t i = 0; i < n_mc; i++)
				if (mc[i].id == id && mc[i].codec < STORE_CODECS)
					by = &t->codec[mc[i].codec];
		}
		if (by)
			use_add(by, &one);
	}
	mdb_cursor_close(cur);
	free(mc);
	return rc == MDB_NOTFOUND ? 0 : st_err_from_mdb(rc);
}

/* The totals record v, when it is sound and of the current layout: 1, else 0. */
static int totals_decode(const MDB_val *v, struct totals_rec *t)
{
	const uint8_t *p = v->mv_data;
	struct store_codec_use *u[1 + STORE_CODECS] = { &t->all };

	if (!st_rec_sum_ok(&totals_key, v, TOTALS_LEN - 8))
		return 0;
	for (int c = 0; c < STORE_CODECS; c++)
		u[1 + c] = &t->codec[c];
	for (int i = 0; i < 1 + STORE_CODECS; i++, p += 24) {
		u[i]->chunks = le_get(p, 8);
		u[i]->raw_bytes = le_get(p + 8, 8);
		u[i]->stored_bytes = le_get(p + 16, 8);
	}
	return 1;
}

/*
 * The totals. They decide no served byte, so a record that fails its checksum
 * (or one of an older layout, without per-codec figures) is not an error: the
 * totals are counted again from the chunk records. No record: an empty store.
 */
static int totals_read(struct store *s, MDB_txn *txn, struct totals_rec *t)
{
	MDB_val v;
	int rc = mdb_get(txn, s->meta, (MDB_val *)&totals_key, &v);

	memset(t, 0, sizeof(*t));
	if (rc == MDB_NOTFOUND)
		return 0;
	if (rc)
		return st_err_from_mdb(rc);
	if (!totals_decode(&v, t))
		return st_totals_recount(s, txn, t);
	return 0;
}

int st_totals_write(struct store *s, MDB_txn *txn, const struct totals_rec *t)
{
	uint8_t buf[TOTALS_LEN], *p = buf;
	const struct store_codec_use *u[1 + STORE_CODECS] = { &t->all };
	MDB_val v = { sizeof(buf), buf };

	for (int c = 0; c < STORE_CODECS; c++)
		u[1 + c] = &t->codec[c];
	for (int i = 0; i < 1 + STORE_CODECS; i++, p += 24) {
		le_put(p, u[i]->chunks, 8);
		le_put(p + 8, u[i]->raw_bytes, 8);
		le_put(p + 16, u[i]->stored_bytes, 8);
	}
	le_put(p, st_rec_sum(&totals_key, buf, TOTALS_LEN - 8), 8);
	return st_err_from_mdb(mdb_put(txn, s->meta, (MDB_val *)&totals_key, &v, 0));
}

int st_totals_update(struct store *s, MDB_txn *txn, uint32_t codec,
		     const struct store_codec_use *add, const struct store_codec_use *sub)
{
	struct totals_rec t;
	int rc = totals_read(s, txn, &t);

	if (rc)
		return rc;
	use_add(&t.all, add);
	use_sub(&t.all, sub);
	if (codec < STORE_CODECS) {
		use_add(&t.codec[codec], add);
		use_sub(&t.codec[codec], sub);
	}
	return st_totals_write(s, txn, &t);
}

void st_totals_repair(struct store *s)
{
	struct totals_rec t;
	MDB_txn *txn;
	MDB_val v;
	int rc;

	if (mdb_txn_begin(s->env, NULL, 0, &txn))
		return;
	rc = mdb_get(txn, s->meta, (MDB_val *)&totals_key, &v);
	if (rc || totals_decode(&v, &t) || st_totals_recount(s, txn, &t) ||
	    st_totals_write(s, txn, &t)) {
		mdb_txn_abort(txn);
		return;
	}
	(void)st_commit(s, txn, 0);
}

int store_totals(struct store *s, struct store_totals *out)
{
	struct totals_rec t;
	struct statvfs sv;
	MDB_envinfo ei;
	MDB_stat st, ms;
	MDB_txn *txn;
	int fd, rc = st_rtxn_begin(s, &txn);

	if (rc)
		return rc;
	rc = totals_read(s, txn, &t);
	if (!rc)
		rc = st_err_from_mdb(mdb_stat(txn, s->models, &ms));
	st_rtxn_end(s, txn);
	if (!rc)
		rc = st_err_from_mdb(mdb_env_info(s->env, &ei));
	if (!rc)
		rc = st_err_from_mdb(mdb_env_stat(s->env, &st));
	if (!rc)
		rc = st_err_from_mdb(mdb_env_get_fd(s->env, &fd));
	if (!rc && fstatvfs(fd, &sv))
		rc = -errno;
	if (rc)
		return rc;
	out->models = ms.ms_entries;
	out->chunks = t.all.chunks;
	out->raw_bytes = t.all.raw_bytes;
	out->stored_bytes = t.all.stored_bytes;
	memcpy(out->codec, t.codec, sizeof(out->codec));
	out->map_size = ei.me_mapsize;
	out->map_used = (uint64_t)(ei.me_last_pgno + 1) * st.ms_psize;
	out->disk_size = (uint64_t)sv.f_blocks * sv.f_frsize;
	out->disk_avail = (uint64_t)sv.f_bavail * sv.f_frsize;
	return 0;
}
