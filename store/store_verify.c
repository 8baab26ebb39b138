/*
 * store_verify — when a read checks checksums (enum store_verify), and the
 * scrub. See store.h and docs/storage.md#verification.
 */
#include <errno.h>
#include <stdlib.h>

#include "store/checksum.h"
#include "store/codec.h"
#include "store/store_impl.h"
#include "store/verified.h"

/* Values smaller than a page sit in LMDB's leaf pages, which the lookup itself
 * has touched (so mincore() says nothing about them): always verified. */
#define TRUST_MIN 4096

int st_verify_open(struct store *s, const struct store_opts *o)
{
	s->verify = o->verify;
	s->data_fd = -1;
	if (mdb_env_get_fd(s->env, &s->data_fd))
		s->data_fd = -1;
	atomic_store(&s->own_mtime, st_file_mtime(s));
	if (s->verify != STORE_VERIFY_ONCE)
		return 0;
	s->verified = st_verified_new(o->verify_entries ? o->verify_entries : 1u << 20,
				      o->verify_ttl_s ? o->verify_ttl_s : 300);
	return s->verified ? 0 : -ENOMEM;
}

void st_verify_close(struct store *s)
{
	st_verified_free(s->verified);
	s->verified = NULL;
}

/*
 * The data file was written by someone else since this store's last commit (a
 * repair tool, a second writer, a test flipping bytes): nothing verified before
 * can be trusted. A commit of ours racing this check only costs a new epoch.
 */
static void watch_file(struct store *s)
{
	int64_t now = st_file_mtime(s);

	if (now == atomic_load(&s->own_mtime))
		return;
	st_verified_clear(s->verified);
	atomic_store(&s->own_mtime, now);
	atomic_fetch_add(&s->n_forgotten, 1);
}

/* The fingerprint of a layer value: its key, place, length and both tensors' checksums. */
static uint64_t layer_fp(const uint8_t *key, const MDB_val *v)
{
	struct codec_header hk, hv;
	struct {
		uint8_t key[LAYER_KEY_LEN];
		uint64_t addr, len, sum_k, sum_v;
	} f;

	if (codec_peek(v->mv_data, v->mv_size, &hk) ||
	    codec_peek((const uint8_t *)v->mv_data + CODEC_HEADER_SIZE + hk.stored_size,
		       v->mv_size - CODEC_HEADER_SIZE - hk.stored_size, &hv))
		return 0;
	memset(&f, 0, sizeof(f));
	memcpy(f.key, key, LAYER_KEY_LEN);
	f.addr = (uint64_t)(uintptr_t)v->mv_data;
	f.len = v->mv_size;
	f.sum_k = hk.checksum;
	f.sum_v = hv.checksum;
	return checksum(&f, sizeof(f));
}

/* The fingerprint of one plane of a layer value (part 1 K, 2 V): a read of that plane
 * alone is remembered apart from the whole layer's. */
static uint64_t part_fp(uint64_t whole, unsigned part)
{
	uint64_t p = whole ^ (0x9e3779b97f4a7c15ull * part);

	return whole && part ? (p ? p : 1) : whole;
}

unsigned st_read_flags_part(struct store *s, const uint8_t *key, const MDB_val *v,
			    unsigned part, uint64_t *fp)
{
	uint64_t whole;

	*fp = 0;
	if (s->verify == STORE_VERIFY_SCRUB_ONLY)
		return CODEC_TRUSTED;
	if (s->verify != STORE_VERIFY_ONCE || v->mv_size < TRUST_MIN)
		return 0;
	/* First: whether this read brings any page from disk (before anything touches them). */
	if (!st_resident(v->mv_data, v->mv_size)) {
		*fp = part_fp(layer_fp(key, v), part);
		return 0;
	}
	watch_file(s);
	whole = layer_fp(key, v);
	*fp = part_fp(whole, part);
	/* a plane is trusted once the whole layer or that plane alone was verified */
	return whole && (st_verified_has(s->verified, whole) ||
			 (part && st_verified_has(s->verified, *fp))) ? CODEC_TRUSTED : 0;
}

unsigned st_read_flags(struct store *s, const uint8_t *key, const MDB_val *v, uint64_t *fp)
{
	return st_read_flags_part(s, key, v, 0, fp);
}

void st_read_done(struct store *s, uint64_t fp, unsigned flags, int rc)
{
	if (flags & CODEC_TRUSTED) {
		atomic_fetch_add(&s->n_trusted, 1);
		return;
	}
	atomic_fetch_add(&s->n_verified, 1);
	if (!rc && fp && s->verified)
		st_verified_add(s->verified, fp);
}

void st_layer_forget(struct store *s, const uint8_t *key, const MDB_val *v)
{
	uint64_t fp;

	if (!s->verified || v->mv_size < TRUST_MIN)
		return;
	fp = layer_fp(key, v);
	if (fp)
		for (unsigned part = 0; part < 3; part++)
			st_verified_drop(s->verified, part_fp(fp, part));
}

void store_verify_counts(struct store *s, struct store_verify_counts *out)
{
	out->verified = atomic_load(&s->n_verified);
	out->trusted = atomic_load(&s->n_trusted);
	out->forgotten = atomic_load(&s->n_forgotten);
	out->scrubbed_bytes = atomic_load(&s->n_scrubbed);
	out->scrub_passes = atomic_load(&s->n_passes);
}

/* Check both tensors of one layer value against their own headers. */
static int check_value(const MDB_val *v, void **scratch, size_t *cap)
{
	size_t used = 0;
	int rc = codec_check(v->mv_data, v->mv_size, scratch, cap, &used);

	if (!rc)
		rc = codec_check((const uint8_t *)v->mv_data + used, v->mv_size - used, scratch,
				 cap, &used);
	return rc;
}

#define SCRUB_BAD_MAX 16

int64_t store_scrub(struct store *s, struct store_scrub *sc, uint64_t budget,
		    void (*corrupt)(void *ctx, uint32_t model_id, const uint8_t *hash), void *ctx)
{
	uint8_t bad[SCRUB_BAD_MAX][CHUNK_KEY_LEN];
	size_t nbad = 0, cap = 0;
	void *scratch = NULL;
	uint64_t done = 0;
	MDB_cursor *cur;
	MDB_txn *txn;
	MDB_val k, v;
	int rc = st_rtxn_begin(s, &txn);

	if (rc)
		return rc;
	rc = mdb_cursor_open(txn, s->layers, &cur);
	if (rc) {
		st_rtxn_end(s, txn);
		return st_err_from_mdb(rc);
	}
	if (sc->started) {
		k.mv_size = LAYER_KEY_LEN;
		k.mv_data = sc->pos;
		rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE);
		/* Resume after the last key checked (it may be gone: then at its successor). */
		if (rc == MDB_SUCCESS && k.mv_size == LAYER_KEY_LEN &&
		    !memcmp(k.mv_data, sc->pos, LAYER_KEY_LEN))
			rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT);
	} else {
		rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST);
	}
	while (rc == MDB_SUCCESS && done < budget && nbad < SCRUB_BAD_MAX) {
		int r = k.mv_size == LAYER_KEY_LEN ? check_value(&v, &scratch, &cap) : -EBADMSG;

		if (r == -ENOMEM) {
			rc = ENOMEM;
			break;
		}
		done += v.mv_size;
		if (r == 0 && s->verified && v.mv_size >= TRUST_MIN) {
			uint64_t fp = layer_fp(k.mv_data, &v);

			if (fp)
				st_verified_add(s->verified, fp);
		}
		if (r && k.mv_size >= CHUNK_KEY_LEN &&
		    (!nbad || memcmp(bad[nbad - 1], k.mv_data, CHUNK_KEY_LEN)))
			memcpy(bad[nbad++], k.mv_data, CHUNK_KEY_LEN);
		if (k.mv_size == LAYER_KEY_LEN) {
			memcpy(sc->pos, k.mv_data, LAYER_KEY_LEN);
			sc->started = true;
		}
		rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT);
	}
	mdb_cursor_close(cur);
	st_rtxn_end(s, txn);
	free(scratch);
	atomic_fetch_add(&s->n_scrubbed, done);
	if (rc == MDB_NOTFOUND) {
		sc->started = false; /* the end: the next call starts over */
		atomic_fetch_add(&s->n_passes, 1);
		rc = 0;
	} else if (rc == ENOMEM) {
		return -ENOMEM;
	} else if (rc != MDB_SUCCESS) {
		return st_err_from_mdb(rc);
	}
	for (size_t i = 0; i < nbad && corrupt; i++)
		corrupt(ctx, get_be32(bad[i]), bad[i] + 4);
	return (int64_t)done;
}
