/* store_owed — pushes owed to cluster peers, kept across restarts; see store.h. */
#include "store/store_impl.h"

#include <errno.h>
#include <string.h>

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
	rc = st_err_from_mdb(mdb_txn_begin(s->env, NULL, 0, &txn));
	if (rc)
		return rc;
	rc = owed ? st_err_write(s, mdb_put(txn, s->owed, &k, &v, 0), OWED_KEY_MAX)
		  : st_err_from_mdb(mdb_del(txn, s->owed, &k, NULL));
	if (rc == -ENOENT && !owed)
		rc = 0;
	if (rc) {
		mdb_txn_abort(txn);
		return rc;
	}
	return st_commit(s, txn, OWED_KEY_MAX);
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

	return st_cursor_walk(s, s->owed, NULL, 0, owed_one, &o);
}
