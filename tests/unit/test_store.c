/*
 * Unit tests of store/: models, commit and visibility, immutability, corruption
 * of tensors and of records, the format 1 upgrade, reopen, a full file system.
 */
#include <errno.h>
#include <fcntl.h>
#include <lmdb.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "store/checksum.h"
#include "store/codec.h"
#include "store/store.h"
#include "tests/data_file.h"
#include "tests/fixture.h"

struct fixture {
	char dir[64];
	struct store *s;
	struct store_model m;
};

static int open_store(struct fixture *f, uint64_t map_size)
{
	struct store_opts o = { .dir = f->dir, .map_size = map_size, .max_readers = 16,
				.min_saving = 0.1 };

	return store_open(&o, &f->s);
}

static int setup(void **state)
{
	struct fixture *f = calloc(1, sizeof(*f));

	snprintf(f->dir, sizeof(f->dir), "/tmp/kvb-store-XXXXXX");
	assert_non_null(mkdtemp(f->dir));
	assert_int_equal(open_store(f, 64u << 20), 0);
	f->m = (struct store_model){ .name = "m", .desc.num_layers = 4, .desc.num_kv_heads = 2,
				     .desc.head_dim = 16, .desc.dtype = 1, .desc.rope_theta = 1e4 };
	assert_int_equal(store_model_register(f->s, &f->m), 0);
	assert_int_equal(f->m.elem_size, 2);
	*state = f;
	return 0;
}

static int teardown(void **state)
{
	struct fixture *f = *state;
	char cmd[128];

	store_close(&f->s);
	assert_null(f->s);
	store_close(&f->s); /* NULL is fine */
	snprintf(cmd, sizeof(cmd), "%s/fs", f->dir);
	umount2(cmd, MNT_DETACH); /* test_disk_full's, if it failed half-way */
	snprintf(cmd, sizeof(cmd), "rm -rf %s", f->dir);
	assert_int_equal(system(cmd), 0);
	free(f);
	return 0;
}

/* A chunk's tensors: one buffer [L, 2, T, H, D] and pointers into it. */
static uint8_t *make_chunk(const struct store_model *m, uint32_t t, uint32_t seed,
			   const void **tensors)
{
	uint64_t tb = store_tensor_bytes(m, t);
	uint8_t *buf = malloc(2 * tb * m->desc.num_layers);

	uint64_t x = 0x9e3779b97f4a7c15ull ^ seed;

	/* Random bytes: incompressible, so sizes below are what LMDB must hold. */
	for (uint64_t i = 0; i < 2 * tb * m->desc.num_layers; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		buf[i] = (uint8_t)(x >> 32);
	}
	for (uint32_t i = 0; i < 2 * m->desc.num_layers; i++)
		tensors[i] = buf + i * tb;
	return buf;
}

static void hash_n(uint8_t *h, int n)
{
	memset(h, 0, STORE_HASH_LEN);
	h[0] = (uint8_t)n;
	h[31] = 0xaa;
}

static void test_models(void **state)
{
	struct fixture *f = *state;
	struct store_model same = f->m, other = f->m, found, *all;
	size_t n;

	assert_int_equal(store_model_register(f->s, &same), 1);
	assert_int_equal(same.id, f->m.id);
	other.desc.rope_theta = 5e5;
	assert_int_equal(store_model_register(f->s, &other), -EEXIST);
	snprintf(other.name, sizeof(other.name), "another");
	assert_int_equal(store_model_register(f->s, &other), 0);
	assert_int_not_equal(other.id, f->m.id);
	assert_int_equal(store_model_find(f->s, "another", &found), 0);
	assert_true(found.desc.rope_theta == 5e5);
	assert_int_equal(store_model_find(f->s, "missing", &found), -ENOENT);
	assert_int_equal(store_model_list(f->s, &all, &n), 0);
	assert_int_equal(n, 2);
	assert_string_equal(all[0].name, "another");
	free(all);
	other.desc.dtype = 9;
	snprintf(other.name, sizeof(other.name), "bad");
	assert_int_equal(store_model_register(f->s, &other), -EINVAL);
}

static void test_put_get_delete(void **state)
{
	struct fixture *f = *state;
	const void *t[8];
	uint8_t h[STORE_HASH_LEN], *kv = make_chunk(&f->m, 10, 1, t);
	uint64_t tb = store_tensor_bytes(&f->m, 10), total = 2 * tb * 4;
	uint8_t *out = malloc(total);
	struct store_chunk_info ci;
	struct store_totals tot;
	struct store_chunk_entry *list;
	size_t n;

	hash_n(h, 1);
	assert_int_equal(store_chunk_put(f->s, &f->m, h, 10, 3, t, &ci), 0);
	assert_int_equal(ci.num_tokens, 10);
	assert_int_equal(ci.raw_bytes, total);
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 0, 4, out, total, &ci), 0);
	assert_memory_equal(kv, out, total);
	assert_int_equal(ci.base_pos, 3);
	/* layers 2..3 */
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 2, 4, out, total / 2, NULL), 0);
	assert_memory_equal(kv + total / 2, out, total / 2);
	/* wrong size, bad range */
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 0, 4, out, total - 1, NULL), -ENOBUFS);
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 3, 3, out, 0, NULL), -EINVAL);
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 0, 5, out, total, NULL), -EINVAL);
	assert_int_equal(store_totals(f->s, &tot), 0);
	assert_int_equal(tot.chunks, 1);
	assert_int_equal(tot.raw_bytes, total);
	assert_int_equal(store_chunk_list(f->s, &f->m, &list, &n), 0);
	assert_int_equal(n, 1);
	assert_memory_equal(list[0].hash, h, STORE_HASH_LEN);
	free(list);
	assert_int_equal(store_chunk_delete(f->s, &f->m, h), 0);
	assert_int_equal(store_chunk_delete(f->s, &f->m, h), -ENOENT);
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 0, 4, out, total, NULL), -ENOENT);
	assert_int_equal(store_totals(f->s, &tot), 0);
	assert_int_equal(tot.chunks, 0);
	assert_int_equal(tot.raw_bytes, 0);
	assert_int_equal(tot.stored_bytes, 0);
	free(kv);
	free(out);
}

static void test_immutable(void **state)
{
	struct fixture *f = *state;
	const void *t1[8], *t2[8];
	uint8_t h[STORE_HASH_LEN], *a = make_chunk(&f->m, 5, 1, t1), *b = make_chunk(&f->m, 5, 2, t2);
	uint64_t total = 2 * store_tensor_bytes(&f->m, 5) * 4;
	uint8_t *out = malloc(total);
	struct store_chunk_info ci;

	hash_n(h, 2);
	assert_int_equal(store_chunk_put(f->s, &f->m, h, 5, 0, t1, NULL), 0);
	assert_int_equal(store_chunk_put(f->s, &f->m, h, 5, 7, t2, &ci), 1);
	assert_int_equal(ci.base_pos, 0); /* describes the stored chunk */
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 0, 4, out, total, NULL), 0);
	assert_memory_equal(a, out, total);
	free(a);
	free(b);
	free(out);
}

/* A put that does not fit leaves nothing behind: not the chunk, not a layer, not a count. */
static void test_full_put_leaves_nothing(void **state)
{
	struct fixture *f = *state;
	struct store_model big = f->m;
	const void *t[8];
	uint8_t h[STORE_HASH_LEN], *kv;
	uint32_t tokens = 150000; /* 4 x 2 x 150000 x 2 x 16 x 2 bytes = 77 MB > the 64 MiB map */
	struct store_totals before, after;
	struct store_chunk_info ci;
	bool found;

	snprintf(big.name, sizeof(big.name), "big");
	assert_int_equal(store_model_register(f->s, &big), 0);
	kv = make_chunk(&big, 20000, 3, t);
	hash_n(h, 3);
	assert_int_equal(store_chunk_put(f->s, &big, h, 20000, 0, t, NULL), 0);
	free(kv);
	assert_int_equal(store_totals(f->s, &before), 0);
	kv = make_chunk(&big, tokens, 4, t);
	hash_n(h, 4);
	assert_int_equal(store_chunk_put(f->s, &big, h, tokens, 0, t, NULL), -ENOSPC);
	assert_int_equal(store_chunk_lookup(f->s, &big, (const uint8_t(*)[32])h, 1, &ci, &found),
			 0);
	assert_false(found);
	assert_int_equal(store_totals(f->s, &after), 0);
	assert_int_equal(after.chunks, before.chunks);
	assert_int_equal(after.stored_bytes, before.stored_bytes);
	free(kv);
}

static void test_reopen_keeps_chunks(void **state)
{
	struct fixture *f = *state;
	const void *t[8];
	uint8_t h[STORE_HASH_LEN], *kv = make_chunk(&f->m, 9, 5, t);
	uint64_t total = 2 * store_tensor_bytes(&f->m, 9) * 4;
	uint8_t *out = malloc(total);
	struct store_model m;

	hash_n(h, 5);
	assert_int_equal(store_chunk_put(f->s, &f->m, h, 9, 0, t, NULL), 0);
	store_close(&f->s);
	assert_int_equal(open_store(f, 64u << 20), 0);
	assert_int_equal(store_model_find(f->s, "m", &m), 0);
	assert_int_equal(m.id, f->m.id);
	assert_int_equal(store_chunk_get(f->s, &m, h, 0, 4, out, total, NULL), 0);
	assert_memory_equal(kv, out, total);
	free(kv);
	free(out);
}

/* Export from one store, import into another: equal bytes; any flipped byte refused. */
struct blobs {
	uint8_t *b[4];
	size_t len[4];
};

static int grab(void *ctx, uint32_t layer, const void *bytes, size_t len)
{
	struct blobs *x = ctx;

	x->b[layer] = malloc(len);
	memcpy(x->b[layer], bytes, len);
	x->len[layer] = len;
	return 0;
}

static int count_owed(void *ctx, const char *peer, uint32_t model_id, const uint8_t *hash)
{
	(void)model_id;
	(void)hash;
	*(int *)ctx += !strcmp(peer, "node-b") ? 1 : 100;
	return 0;
}

static void test_export_import(void **state)
{
	struct fixture *f = *state, g = { .dir = "/tmp/kvb-store2-XXXXXX" };
	const void *t[8];
	uint8_t h[STORE_HASH_LEN], *kv = make_chunk(&f->m, 12, 7, t), *a, *b;
	uint64_t total = 2 * store_tensor_bytes(&f->m, 12) * 4;
	struct store_chunk_info ci, cj;
	struct store_model m2 = f->m;
	struct blobs x = { 0 };
	const void *bl[4];
	char cmd[128];
	int owed = 0;

	hash_n(h, 9);
	assert_int_equal(store_chunk_put(f->s, &f->m, h, 12, 5, t, &ci), 0);
	assert_int_equal(store_chunk_export(f->s, &f->m, h, &cj, grab, &x), 0);
	assert_int_equal(cj.num_tokens, 12);
	assert_int_equal(cj.base_pos, 5);
	assert_non_null(mkdtemp(g.dir));
	assert_int_equal(open_store(&g, 64u << 20), 0);
	assert_int_equal(store_model_register(g.s, &m2), 0);
	for (int l = 0; l < 4; l++)
		bl[l] = x.b[l];
	/* a flipped byte anywhere in a tensor: refused, nothing stored */
	for (size_t at = 0; at < x.len[2]; at += 97) {
		x.b[2][at] ^= 0x10;
		assert_int_equal(store_chunk_import(g.s, &m2, h, 12, 5, bl, x.len, NULL, NULL),
				 -EBADMSG);
		x.b[2][at] ^= 0x10;
	}
	x.len[3]--;
	assert_int_equal(store_chunk_import(g.s, &m2, h, 12, 5, bl, x.len, NULL, NULL), -EBADMSG);
	x.len[3]++;
	assert_int_equal(store_chunk_import(g.s, &m2, h, 11, 5, bl, x.len, NULL, NULL), -EBADMSG);
	assert_int_equal(store_chunk_info(g.s, &m2, h, &cj), -ENOENT);
	/* the real thing: the same bytes come back */
	assert_int_equal(store_chunk_import(g.s, &m2, h, 12, 5, bl, x.len, &cj, NULL), 0);
	assert_int_equal(cj.stored_bytes, ci.stored_bytes);
	assert_int_equal(store_chunk_import(g.s, &m2, h, 12, 5, bl, x.len, NULL, NULL), 1);
	a = malloc(total);
	b = malloc(total);
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 0, 4, a, total, NULL), 0);
	assert_int_equal(store_chunk_get(g.s, &m2, h, 0, 4, b, total, NULL), 0);
	assert_memory_equal(a, b, total);
	assert_memory_equal(a, kv, total);
	/* owed pushes survive a reopen */
	assert_int_equal(store_owed_put(g.s, "node-b", m2.id, h, true), 0);
	assert_int_equal(store_owed_put(g.s, "node-b", m2.id, h, true), 0);
	assert_int_equal(store_owed_put(g.s, "", m2.id, h, true), -EINVAL);
	store_close(&g.s);
	assert_int_equal(open_store(&g, 64u << 20), 0);
	assert_int_equal(store_owed_scan(g.s, count_owed, &owed), 0);
	assert_int_equal(owed, 1);
	assert_int_equal(store_owed_put(g.s, "node-b", m2.id, h, false), 0);
	assert_int_equal(store_owed_put(g.s, "node-b", m2.id, h, false), 0);
	owed = 0;
	assert_int_equal(store_owed_scan(g.s, count_owed, &owed), 0);
	assert_int_equal(owed, 0);
	store_close(&g.s);
	snprintf(cmd, sizeof(cmd), "rm -rf %s", g.dir);
	assert_int_equal(system(cmd), 0);
	for (int l = 0; l < 4; l++)
		free(x.b[l]);
	free(a);
	free(b);
	free(kv);
}

static void test_corruption_reported(void **state)
{
	struct fixture *f = *state;
	const void *t[8];
	uint8_t h[STORE_HASH_LEN], *kv = make_chunk(&f->m, 6, 6, t);
	uint64_t total = 2 * store_tensor_bytes(&f->m, 6) * 4;
	uint8_t *out = malloc(total), *copy;
	MDB_env *env;
	MDB_txn *txn;
	MDB_dbi dbi;
	MDB_cursor *cur;
	MDB_val k, v;

	hash_n(h, 6);
	assert_int_equal(store_chunk_put(f->s, &f->m, h, 6, 0, t, NULL), 0);
	store_close(&f->s);
	/* Flip one byte of layer 2's K payload directly in LMDB. */
	assert_int_equal(mdb_env_create(&env), 0);
	mdb_env_set_maxdbs(env, 8);
	assert_int_equal(mdb_env_open(env, f->dir, 0, 0640), 0);
	assert_int_equal(mdb_txn_begin(env, NULL, 0, &txn), 0);
	assert_int_equal(mdb_dbi_open(txn, "layers", 0, &dbi), 0);
	assert_int_equal(mdb_cursor_open(txn, dbi, &cur), 0);
	assert_int_equal(mdb_cursor_get(cur, &k, &v, MDB_FIRST), 0);
	assert_int_equal(mdb_cursor_get(cur, &k, &v, MDB_NEXT), 0);
	assert_int_equal(mdb_cursor_get(cur, &k, &v, MDB_NEXT), 0);
	copy = malloc(v.mv_size);
	memcpy(copy, v.mv_data, v.mv_size);
	copy[40] ^= 0x01;
	v.mv_data = copy;
	assert_int_equal(mdb_cursor_put(cur, &k, &v, MDB_CURRENT), 0);
	mdb_cursor_close(cur);
	assert_int_equal(mdb_txn_commit(txn), 0);
	mdb_env_close(env);
	free(copy);
	assert_int_equal(open_store(f, 64u << 20), 0);
	/* Layers 0..1 are intact; any read that touches layer 2 reports corruption. */
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 0, 2, out, total / 2, NULL), 0);
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 0, 4, out, total, NULL), -EBADMSG);
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 2, 3, out, total / 4, NULL), -EBADMSG);
	free(kv);
	free(out);
}

static void test_concurrent_readers(void **state)
{
	struct fixture *f = *state;
	const void *t[8];
	uint8_t h[STORE_HASH_LEN], *kv = make_chunk(&f->m, 3, 7, t);
	uint64_t total = 2 * store_tensor_bytes(&f->m, 3) * 4;
	uint8_t *out = malloc(total);

	hash_n(h, 7);
	assert_int_equal(store_chunk_put(f->s, &f->m, h, 3, 0, t, NULL), 0);
	/* Far more reads than reader slots: transactions must be recycled. */
	for (int i = 0; i < 1000; i++)
		assert_int_equal(store_chunk_get(f->s, &f->m, h, 0, 4, out, total, NULL), 0);
	assert_memory_equal(kv, out, total);
	free(kv);
	free(out);
}

/* ---- records damaged on disk: opened with LMDB itself, the store closed ---- */

static MDB_env *raw_open(const char *dir, MDB_txn **txn)
{
	MDB_env *env;

	assert_int_equal(mdb_env_create(&env), 0);
	mdb_env_set_maxdbs(env, 8);
	assert_int_equal(mdb_env_open(env, dir, 0, 0640), 0);
	assert_int_equal(mdb_txn_begin(env, NULL, 0, txn), 0);
	return env;
}

static void raw_close(MDB_env *env, MDB_txn *txn)
{
	assert_int_equal(mdb_txn_commit(txn), 0);
	mdb_env_close(env);
}

/* Flip one bit of the record stored under key in database db. */
static void flip_bit(const char *dir, const char *db, const void *key, size_t key_len,
		     size_t off, unsigned bit)
{
	MDB_txn *txn;
	MDB_env *env = raw_open(dir, &txn);
	MDB_val k = { key_len, (void *)key }, v;
	MDB_dbi dbi;
	uint8_t *copy;

	assert_int_equal(mdb_dbi_open(txn, db, 0, &dbi), 0);
	assert_int_equal(mdb_get(txn, dbi, &k, &v), 0);
	assert_true(off < v.mv_size);
	copy = malloc(v.mv_size);
	memcpy(copy, v.mv_data, v.mv_size);
	copy[off] ^= (uint8_t)(1u << bit);
	v.mv_data = copy;
	assert_int_equal(mdb_put(txn, dbi, &k, &v, 0), 0);
	raw_close(env, txn);
	free(copy);
}

static void chunk_key_of(uint8_t *key, uint32_t model_id, const uint8_t *hash)
{
	key[0] = (uint8_t)(model_id >> 24);
	key[1] = (uint8_t)(model_id >> 16);
	key[2] = (uint8_t)(model_id >> 8);
	key[3] = (uint8_t)model_id;
	memcpy(key + 4, hash, STORE_HASH_LEN);
}

static int count_chunk(void *ctx, uint32_t model_id, const uint8_t *hash,
		       const struct store_chunk_info *info)
{
	(void)model_id, (void)hash, (void)info;
	++*(int *)ctx;
	return 0;
}

/* Layers left in LMDB under a chunk's key: a delete must leave none. */
static int raw_layers_of(const char *dir, uint32_t model_id, const uint8_t *hash)
{
	uint8_t key[4 + STORE_HASH_LEN];
	MDB_txn *txn;
	MDB_env *env = raw_open(dir, &txn);
	MDB_cursor *cur;
	MDB_val k = { sizeof(key), key }, v;
	MDB_dbi dbi;
	int n = 0, rc;

	chunk_key_of(key, model_id, hash);
	assert_int_equal(mdb_dbi_open(txn, "layers", 0, &dbi), 0);
	assert_int_equal(mdb_cursor_open(txn, dbi, &cur), 0);
	for (rc = mdb_cursor_get(cur, &k, &v, MDB_SET_RANGE);
	     rc == 0 && k.mv_size > sizeof(key) && !memcmp(k.mv_data, key, sizeof(key));
	     rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT))
		n++;
	mdb_cursor_close(cur);
	raw_close(env, txn);
	return n;
}

/*
 * One flipped bit of a chunk record (base_pos at offset 8, num_tokens at 4):
 * every read path reports -EBADMSG instead of serving a wrongly placed chunk,
 * the walkers never hand it on, and a delete or a new PUT clears it.
 */
static void check_chunk_record_flip(struct fixture *f, size_t off, unsigned bit, int seed)
{
	const void *t[8];
	uint8_t h[STORE_HASH_LEN], key[4 + STORE_HASH_LEN], *kv = make_chunk(&f->m, 6, seed, t);
	uint64_t tb = store_tensor_bytes(&f->m, 6), total = 2 * tb * 4;
	uint8_t *out = malloc(total);
	struct store_chunk_info ci, infos[2];
	struct store_chunk_entry *list = NULL;
	struct store_totals tot;
	uint8_t hashes[2][STORE_HASH_LEN];
	bool found[2];
	size_t n = 0;
	int seen = 0;

	hash_n(h, seed);
	assert_int_equal(store_chunk_put(f->s, &f->m, h, 6, 3, t, NULL), 0);
	store_close(&f->s);
	chunk_key_of(key, f->m.id, h);
	flip_bit(f->dir, "chunks", key, sizeof(key), off, bit);
	assert_int_equal(open_store(f, 64u << 20), 0);

	assert_int_equal(store_chunk_info(f->s, &f->m, h, &ci), -EBADMSG);
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 0, 4, out, total, NULL), -EBADMSG);
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 1, 2, out, total / 4, NULL), -EBADMSG);
	assert_int_equal(store_chunk_get_layer(f->s, &f->m, h, 2, out, out + tb, tb, NULL),
			 -EBADMSG);
	memcpy(hashes[0], h, STORE_HASH_LEN);
	hash_n(hashes[1], 200);
	assert_int_equal(store_chunk_lookup(f->s, &f->m, (const uint8_t(*)[STORE_HASH_LEN])hashes,
					    2, infos, found),
			 -EBADMSG);
	assert_int_equal(store_chunk_list(f->s, &f->m, &list, &n), -EBADMSG);
	assert_int_equal(store_chunk_scan(f->s, count_chunk, &seen), 0);
	assert_int_equal(seen, 0);
	/* The totals never depended on the record: still one chunk. */
	assert_int_equal(store_totals(f->s, &tot), 0);
	assert_int_equal(tot.chunks, 1);

	/* A PUT of the same chunk replaces the corrupt one (it is no chunk). */
	assert_int_equal(store_chunk_put(f->s, &f->m, h, 6, 3, t, &ci), 0);
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 0, 4, out, total, &ci), 0);
	assert_memory_equal(out, kv, total);
	assert_int_equal(ci.base_pos, 3);
	assert_int_equal(store_totals(f->s, &tot), 0);
	assert_int_equal(tot.chunks, 1);
	assert_int_equal(tot.raw_bytes, total);

	/* Damage it again: a DELETE clears the record and every layer, and the totals. */
	store_close(&f->s);
	flip_bit(f->dir, "chunks", key, sizeof(key), off, bit);
	assert_int_equal(open_store(f, 64u << 20), 0);
	assert_int_equal(store_chunk_info(f->s, &f->m, h, &ci), -EBADMSG);
	assert_int_equal(store_chunk_delete(f->s, &f->m, h), 0);
	assert_int_equal(store_chunk_info(f->s, &f->m, h, &ci), -ENOENT);
	assert_int_equal(store_chunk_delete(f->s, &f->m, h), -ENOENT);
	assert_int_equal(store_totals(f->s, &tot), 0);
	assert_int_equal(tot.chunks, 0);
	assert_int_equal(tot.raw_bytes, 0);
	assert_int_equal(tot.stored_bytes, 0);
	store_close(&f->s);
	assert_int_equal(raw_layers_of(f->dir, f->m.id, h), 0);
	assert_int_equal(open_store(f, 64u << 20), 0);
	free(list);
	free(kv);
	free(out);
}

static void test_chunk_record_base_pos_flip(void **state)
{
	check_chunk_record_flip(*state, 8, 0, 20); /* base_pos 3 -> 2 */
}

static void test_chunk_record_num_tokens_flip(void **state)
{
	check_chunk_record_flip(*state, 4, 1, 21); /* num_tokens 6 -> 4 */
}

static void test_chunk_record_checksum_flip(void **state)
{
	check_chunk_record_flip(*state, 45, 7, 22); /* the checksum itself */
}

/*
 * One flipped bit of a model record (rope_theta): lookups report -EBADMSG,
 * nothing crashes, the record is not overwritten, other models still work.
 */
static void test_model_record_flip(void **state)
{
	struct fixture *f = *state;
	struct store_model m2 = f->m, same = f->m, found, *all = NULL;
	size_t n = 0;
	const size_t theta_off = 65 + 4 * 10 + 7; /* top byte of the first double */

	snprintf(m2.name, sizeof(m2.name), "other");
	assert_int_equal(store_model_register(f->s, &m2), 0);
	store_close(&f->s);
	flip_bit(f->dir, "models", "m", 1, theta_off, 0);
	assert_int_equal(open_store(f, 64u << 20), 0);

	assert_int_equal(store_model_find(f->s, "m", &found), -EBADMSG);
	assert_int_equal(store_model_by_id(f->s, f->m.id, &found), -EBADMSG);
	assert_int_equal(store_model_list(f->s, &all, &n), -EBADMSG);
	assert_int_equal(store_model_register(f->s, &same), -EBADMSG);
	/* The sound model is found by name and by id, past the corrupt one. */
	assert_int_equal(store_model_find(f->s, "other", &found), 0);
	assert_int_equal(found.id, m2.id);
	assert_int_equal(store_model_by_id(f->s, m2.id, &found), 0);
	assert_string_equal(found.name, "other");
	free(all);
}

/*
 * A model whose local layers rotate with their own base (rope_local_theta, full_every):
 * a record of its own length, read back whole after a reopen, with or without a store
 * codec; the same name without the layers is another model; a flipped bit in the local
 * base is caught by the record's checksum.
 */
static void test_model_layers(void **state)
{
	struct fixture *f = *state;
	struct store_model g = f->m, q = f->m, plain, found;

	snprintf(g.name, sizeof(g.name), "g");
	g.desc.rope_local_theta = 1e4;
	g.desc.full_every = 2;
	assert_int_equal(store_model_register(f->s, &g), 0);
	snprintf(q.name, sizeof(q.name), "gq");
	q.desc.rope_local_theta = 1e4;
	q.desc.full_every = 3;
	q.desc.store_codec = 1;
	assert_int_equal(store_model_register(f->s, &q), 0);
	plain = g;
	plain.desc.rope_local_theta = 0;
	plain.desc.full_every = 0;
	assert_int_equal(store_model_register(f->s, &plain), -EEXIST);
	plain.desc.rope_local_theta = 1e4; /* without full_every */
	assert_int_equal(store_model_register(f->s, &plain), -EINVAL);
	store_close(&f->s);
	assert_int_equal(open_store(f, 64u << 20), 0);
	assert_int_equal(store_model_find(f->s, "g", &found), 0);
	assert_true(store_model_same(&found, &g));
	assert_true(found.desc.rope_local_theta == 1e4 && found.desc.full_every == 2);
	assert_int_equal(store_model_find(f->s, "gq", &found), 0);
	assert_true(store_model_same(&found, &q));
	assert_int_equal(found.desc.store_codec, 1);
	store_close(&f->s);
	/* top byte of rope_local_theta: after the body (65 + 40 + 48 + 1) and the codec's 8 */
	flip_bit(f->dir, "models", "g", 1, 65 + 40 + 48 + 1 + 8 + 7, 0);
	assert_int_equal(open_store(f, 64u << 20), 0);
	assert_int_equal(store_model_find(f->s, "g", &found), -EBADMSG);
	assert_int_equal(store_model_find(f->s, "gq", &found), 0);
}

/*
 * A damaged model counter must never hand out the id of a model that has
 * chunks: the chunks of one would be served as the other's.
 */
static void test_next_model_flip(void **state)
{
	struct fixture *f = *state;
	struct store_model a = f->m, b = f->m, found;
	const void *t[8];
	uint8_t h[STORE_HASH_LEN], *kv = make_chunk(&f->m, 2, 30, t);
	struct store_chunk_info ci;

	hash_n(h, 30);
	assert_int_equal(store_chunk_put(f->s, &f->m, h, 2, 0, t, NULL), 0);
	snprintf(a.name, sizeof(a.name), "a");
	assert_int_equal(store_model_register(f->s, &a), 0);
	assert_int_equal(a.id, 2);
	store_close(&f->s);
	flip_bit(f->dir, "meta", "next_model", 10, 0, 1); /* next id 3 -> 1, the id of "m" */
	assert_int_equal(open_store(f, 64u << 20), 0);
	snprintf(b.name, sizeof(b.name), "b");
	b.desc.rope_theta = 5e5;
	assert_int_equal(store_model_register(f->s, &b), 0);
	assert_int_not_equal(b.id, f->m.id);
	assert_int_not_equal(b.id, a.id);
	assert_int_equal(store_chunk_info(f->s, &b, h, &ci), -ENOENT);
	assert_int_equal(store_model_by_id(f->s, b.id, &found), 0);
	assert_string_equal(found.name, "b");
	free(kv);
}

/* Damaged totals are counted again from the chunk records, not believed. */
static void test_totals_flip(void **state)
{
	struct fixture *f = *state;
	const void *t[8];
	uint8_t h[STORE_HASH_LEN], *kv = make_chunk(&f->m, 4, 31, t);
	struct store_totals before, after;

	hash_n(h, 31);
	assert_int_equal(store_chunk_put(f->s, &f->m, h, 4, 0, t, NULL), 0);
	assert_int_equal(store_totals(f->s, &before), 0);
	store_close(&f->s);
	flip_bit(f->dir, "meta", "totals", 6, 20, 6); /* stored bytes + 2^38 */
	assert_int_equal(open_store(f, 64u << 20), 0);
	assert_int_equal(store_totals(f->s, &after), 0);
	assert_int_equal(after.chunks, before.chunks);
	assert_int_equal(after.raw_bytes, before.raw_bytes);
	assert_int_equal(after.stored_bytes, before.stored_bytes);
	/* and a write puts a sound record back */
	assert_int_equal(store_chunk_delete(f->s, &f->m, h), 0);
	assert_int_equal(store_totals(f->s, &after), 0);
	assert_int_equal(after.chunks, 0);
	assert_int_equal(after.stored_bytes, 0);
	free(kv);
}

/* ---- format 1 (no record checksums), written here byte by byte ---- */

static void le(uint8_t *p, uint64_t v, int n)
{
	for (int i = 0; i < n; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

static void raw_put(MDB_txn *txn, MDB_dbi dbi, const void *key, size_t key_len, const void *val,
		    size_t val_len)
{
	MDB_val k = { key_len, (void *)key }, v = { val_len, (void *)val };

	assert_int_equal(mdb_put(txn, dbi, &k, &v, 0), 0);
}

static void raw_get(MDB_txn *txn, MDB_dbi dbi, const char *key, MDB_val *v)
{
	MDB_val k = { strlen(key), (void *)key };

	assert_int_equal(mdb_get(txn, dbi, &k, v), 0);
}

/* A format 1 model record: name[65], ten u32, six f64, k_pre_rope; 154 bytes. */
static void v1_model(uint8_t *p, const struct store_model *m)
{
	const struct kvb_model_desc *md = &m->desc;
	const uint32_t u[10] = { m->id,	   md->num_layers, md->num_kv_heads, md->head_dim, md->dtype,
				 md->rope_style, md->rotary_dim, md->scaling, md->max_pos,
				 md->original_max_pos };
	const double d[6] = { md->rope_theta, md->factor, md->low_freq_factor, md->high_freq_factor,
			      md->beta_fast, md->beta_slow };
	uint8_t *q = p + 65;

	memset(p, 0, 154);
	memcpy(p, m->name, strlen(m->name));
	for (int i = 0; i < 10; i++, q += 4)
		le(q, u[i], 4);
	for (int i = 0; i < 6; i++, q += 8) {
		uint64_t x;

		memcpy(&x, &d[i], 8);
		le(q, x, 8);
	}
	*q = m->desc.k_pre_rope;
}

/*
 * A store as format 1 left it (one model, one chunk, a malformed chunk record
 * with a layer, a counter and totals without checksums) is upgraded in place
 * at open: the chunk reads back, the malformed one is gone, and the records
 * now carry checksums, so the same flipped bit is caught.
 */
static void test_upgrade_from_v1(void **state)
{
	struct fixture *f = *state;
	struct store_model m = f->m, found, next = f->m;
	const void *t[8];
	uint8_t h[STORE_HASH_LEN], hbad[STORE_HASH_LEN], *kv = make_chunk(&m, 5, 40, t);
	uint64_t tb = store_tensor_bytes(&m, 5), total = 2 * tb * 4, stored = 0;
	uint8_t *out = malloc(total), *enc = malloc(2 * codec_bound(tb));
	uint8_t key[4 + STORE_HASH_LEN + 4], rec[154];
	struct store_chunk_info ci;
	struct store_totals tot;
	MDB_dbi meta, models, chunks, layers;
	MDB_txn *txn;
	MDB_env *env;
	MDB_val v;
	size_t lk, lv;
	char cmd[192];

	/* Start from an empty directory: format 1 from scratch, no help from store.c. */
	store_close(&f->s);
	snprintf(cmd, sizeof(cmd), "rm -f %s/data.mdb %s/lock.mdb", f->dir, f->dir);
	assert_int_equal(system(cmd), 0);
	env = raw_open(f->dir, &txn);
	assert_int_equal(mdb_dbi_open(txn, "meta", MDB_CREATE, &meta), 0);
	assert_int_equal(mdb_dbi_open(txn, "models", MDB_CREATE, &models), 0);
	assert_int_equal(mdb_dbi_open(txn, "chunks", MDB_CREATE, &chunks), 0);
	assert_int_equal(mdb_dbi_open(txn, "layers", MDB_CREATE, &layers), 0);
	le(rec, 1, 4);
	raw_put(txn, meta, "format", 6, rec, 4);
	le(rec, 2, 4);
	raw_put(txn, meta, "next_model", 10, rec, 4);
	m.id = 1;
	v1_model(rec, &m);
	raw_put(txn, models, "m", 1, rec, 154);
	/* Enough more models that the records, growing by their checksum, split pages. */
	for (int i = 0; i < 60; i++) {
		struct store_model mi = m;

		snprintf(mi.name, sizeof(mi.name), "model-%02d", i);
		mi.id = 100 + (uint32_t)i;
		v1_model(rec, &mi);
		raw_put(txn, models, mi.name, strlen(mi.name), rec, 154);
	}
	hash_n(h, 40);
	for (uint32_t l = 0; l < 4; l++) {
		assert_int_equal(codec_encode(t[2 * l], tb, 2, 0.1, enc, codec_bound(tb), &lk), 0);
		assert_int_equal(codec_encode(t[2 * l + 1], tb, 2, 0.1, enc + lk,
					      2 * codec_bound(tb) - lk, &lv), 0);
		chunk_key_of(key, 1, h);
		key[36] = key[37] = key[38] = 0;
		key[39] = (uint8_t)l;
		raw_put(txn, layers, key, 40, enc, lk + lv);
		stored += lk + lv;
	}
	memset(rec, 0, 48);
	le(rec, 1, 4);
	le(rec + 4, 5, 4);
	le(rec + 8, 7, 4); /* base_pos */
	le(rec + 12, 4, 4);
	le(rec + 16, total, 8);
	le(rec + 24, stored, 8);
	le(rec + 32, 1700000000, 8);
	raw_put(txn, chunks, key, 36, rec, 48);
	/* Many records of another model (no layers, no bytes): enough to span pages. */
	for (int i = 0; i < 300; i++) {
		uint8_t hk[4 + STORE_HASH_LEN] = { 0, 0, 0, 100, (uint8_t)i, (uint8_t)(i >> 8) };
		uint8_t r[48] = { 1 };

		le(r + 4, 1, 4);
		le(r + 8, (uint64_t)i, 4);
		le(r + 12, 4, 4);
		raw_put(txn, chunks, hk, sizeof(hk), r, sizeof(r));
	}
	/* A record format 1 itself would reject (short), with one layer behind it. */
	hash_n(hbad, 41);
	chunk_key_of(key, 1, hbad);
	raw_put(txn, chunks, key, 36, rec, 40);
	key[36] = key[37] = key[38] = key[39] = 0;
	raw_put(txn, layers, key, 40, enc, lk + lv);
	le(rec, 2, 8); /* totals that count the bad one too */
	le(rec + 8, total * 2, 8);
	le(rec + 16, stored * 2, 8);
	raw_put(txn, meta, "totals", 6, rec, 24);
	raw_close(env, txn);

	assert_int_equal(open_store(f, 64u << 20), 0);
	assert_int_equal(store_model_find(f->s, "m", &found), 0);
	assert_int_equal(found.id, 1);
	assert_int_equal(found.desc.num_layers, 4);
	assert_true(found.desc.rope_theta == 1e4);
	assert_int_equal(store_chunk_get(f->s, &found, h, 0, 4, out, total, &ci), 0);
	assert_memory_equal(out, kv, total);
	assert_int_equal(ci.base_pos, 7);
	assert_int_equal(ci.created, 1700000000);
	assert_int_equal(store_chunk_info(f->s, &found, hbad, &ci), -ENOENT);
	assert_int_equal(store_totals(f->s, &tot), 0);
	assert_int_equal(tot.chunks, 301);
	assert_int_equal(tot.raw_bytes, total);
	assert_int_equal(tot.stored_bytes, stored);
	{
		int seen = 0;

		assert_int_equal(store_chunk_scan(f->s, count_chunk, &seen), 0);
		assert_int_equal(seen, 301); /* every record upgraded passes its checks */
	}
	snprintf(next.name, sizeof(next.name), "next");
	{
		struct store_model *all = NULL;
		size_t n = 0;

		assert_int_equal(store_model_list(f->s, &all, &n), 0);
		assert_int_equal(n, 61);
		assert_string_equal(all[60].name, "model-59");
		assert_int_equal(all[60].id, 159);
		free(all);
	}
	assert_int_equal(store_model_register(f->s, &next), 0);
	assert_int_equal(next.id, 160); /* past every model, though the counter said 2 */
	store_close(&f->s);

	/* On disk: format 2, and the records carry their checksums. */
	env = raw_open(f->dir, &txn);
	assert_int_equal(mdb_dbi_open(txn, "meta", 0, &meta), 0);
	assert_int_equal(mdb_dbi_open(txn, "models", 0, &models), 0);
	raw_get(txn, meta, "format", &v);
	assert_int_equal(v.mv_size, 4);
	assert_int_equal(((const uint8_t *)v.mv_data)[0], 2);
	raw_get(txn, models, "m", &v);
	assert_int_equal(v.mv_size, 162);
	raw_close(env, txn);
	assert_int_equal(raw_layers_of(f->dir, 1, hbad), 0);

	/* Reopening does not upgrade again; the same flip is now caught. */
	chunk_key_of(key, 1, h);
	flip_bit(f->dir, "chunks", key, 36, 8, 0);
	assert_int_equal(open_store(f, 64u << 20), 0);
	assert_int_equal(store_chunk_info(f->s, &found, h, &ci), -EBADMSG);
	assert_int_equal(store_model_find(f->s, "next", &found), 0);
	free(kv);
	free(out);
	free(enc);
}

/* A store of a format this code does not know is refused, not guessed at. */
static void test_newer_format_refused(void **state)
{
	struct fixture *f = *state;
	MDB_txn *txn;
	MDB_env *env;
	MDB_dbi meta;
	uint8_t fmt[4] = { 9, 0, 0, 0 };

	store_close(&f->s);
	env = raw_open(f->dir, &txn);
	assert_int_equal(mdb_dbi_open(txn, "meta", 0, &meta), 0);
	raw_put(txn, meta, "format", 6, fmt, 4);
	raw_close(env, txn);
	assert_int_equal(open_store(f, 64u << 20), -EPROTO);
	assert_null(f->s);
}

/* ---- a full file system: a real one, a small tmpfs (root only; skipped otherwise) ---- */

/*
 * Fill an 8 MiB file system: the PUT that does not fit fails with -ENOSPC
 * (LMDB itself says EIO for the short write), leaves nothing behind, the store
 * keeps serving what it holds, and after a delete the next PUT fits.
 */
static void test_disk_full(void **state)
{
	struct fixture *f = *state;
	char mnt[96], data[128];
	struct store_opts o = { .dir = data, .map_size = 64u << 20, .max_readers = 16,
				.min_saving = 0.1 };
	struct store_model big = f->m;
	struct store *s = NULL;
	const void *t[8];
	uint32_t tokens = 4096; /* 4 layers x 2 x 4096 x 2 heads x 16 x 2 bytes = 2 MiB a chunk */
	uint8_t h[STORE_HASH_LEN], h0[STORE_HASH_LEN], *kv = make_chunk(&big, tokens, 50, t);
	uint64_t total = 2 * store_tensor_bytes(&big, tokens) * 4;
	uint8_t *out = malloc(total);
	struct store_totals before, after;
	struct store_chunk_info ci;
	int rc = 0, stored = 0;
	bool found;

	snprintf(mnt, sizeof(mnt), "%s/fs", f->dir);
	snprintf(data, sizeof(data), "%s/data", mnt);
	assert_int_equal(mkdir(mnt, 0700), 0);
	if (mount("tmpfs", mnt, "tmpfs", 0, "size=8m,mode=0700")) {
		free(kv);
		free(out);
		skip(); /* not root, or no mount in this container */
	}
	assert_int_equal(store_open(&o, &s), 0);
	assert_int_equal(store_model_register(s, &big), 0);
	for (int i = 0; i < 20 && rc == 0; i++) {
		hash_n(h, 60 + i);
		kv[0] = (uint8_t)i; /* the chunks differ */
		assert_int_equal(store_totals(s, &before), 0);
		rc = store_chunk_put(s, &big, h, tokens, 0, t, NULL);
		stored += rc == 0;
	}
	assert_int_equal(rc, -ENOSPC);
	assert_true(stored >= 2);
	assert_int_equal(store_totals(s, &after), 0);
	assert_int_equal(after.chunks, before.chunks);
	assert_int_equal(after.stored_bytes, before.stored_bytes);
	assert_true(after.disk_avail < total);
	assert_int_equal(store_chunk_lookup(s, &big, (const uint8_t(*)[32])h, 1, &ci, &found), 0);
	assert_false(found);
	/* Still serving: every chunk acknowledged reads back. */
	for (int i = 0; i < stored; i++) {
		hash_n(h0, 60 + i);
		kv[0] = (uint8_t)i;
		assert_int_equal(store_chunk_get(s, &big, h0, 0, 4, out, total, NULL), 0);
		assert_memory_equal(out, kv, total);
	}
	/* Full again: the same answer, and nothing leaks. */
	assert_int_equal(store_chunk_put(s, &big, h, tokens, 0, t, NULL), -ENOSPC);
	/* Room made by a delete is used by the next PUT. */
	hash_n(h0, 60);
	assert_int_equal(store_chunk_delete(s, &big, h0), 0);
	kv[0] = (uint8_t)stored;
	assert_int_equal(store_chunk_put(s, &big, h, tokens, 0, t, NULL), 0);
	assert_int_equal(store_chunk_get(s, &big, h, 0, 4, out, total, NULL), 0);
	assert_memory_equal(out, kv, total);
	/* and it survives a reopen */
	store_close(&s);
	assert_int_equal(store_open(&o, &s), 0);
	assert_int_equal(store_chunk_get(s, &big, h, 0, 4, out, total, NULL), 0);
	assert_memory_equal(out, kv, total);
	store_close(&s);
	assert_int_equal(umount2(mnt, MNT_DETACH), 0);
	free(kv);
	free(out);
}

/*
 * The disk filled by someone else (a log, another cache), with no failed PUT
 * of ours that left room behind: a delete still works (the store keeps a little
 * disk allocated past its data), and the room it frees takes the next PUT.
 */
static void test_disk_filled_by_another(void **state)
{
	struct fixture *f = *state;
	char mnt[96], data[128], filler[128], buf[65536];
	struct store_opts o = { .dir = data, .map_size = 64u << 20, .max_readers = 16,
				.min_saving = 0.1 };
	struct store_model big = f->m;
	struct store *s = NULL;
	const void *t[8];
	uint32_t tokens = 4096; /* 2 MiB a chunk */
	uint8_t h[STORE_HASH_LEN], *kv = make_chunk(&big, tokens, 51, t);
	uint64_t total = 2 * store_tensor_bytes(&big, tokens) * 4;
	uint8_t *out = malloc(total);
	FILE *fp;

	snprintf(mnt, sizeof(mnt), "%s/fs", f->dir);
	snprintf(data, sizeof(data), "%s/data", mnt);
	snprintf(filler, sizeof(filler), "%s/filler", mnt);
	assert_int_equal(mkdir(mnt, 0700), 0);
	if (mount("tmpfs", mnt, "tmpfs", 0, "size=12m,mode=0700")) {
		free(kv);
		free(out);
		skip();
	}
	assert_int_equal(store_open(&o, &s), 0);
	assert_int_equal(store_model_register(s, &big), 0);
	for (int i = 0; i < 2; i++) {
		hash_n(h, 80 + i);
		kv[0] = (uint8_t)i;
		assert_int_equal(store_chunk_put(s, &big, h, tokens, 0, t, NULL), 0);
	}
	fp = fopen(filler, "w");
	assert_non_null(fp);
	memset(buf, 0x5a, sizeof(buf));
	while (fwrite(buf, 1, sizeof(buf), fp) == sizeof(buf))
		;
	fclose(fp); /* may fail too: the disk is full either way */
	hash_n(h, 82);
	assert_int_equal(store_chunk_put(s, &big, h, tokens, 0, t, NULL), -ENOSPC);
	hash_n(h, 80);
	assert_int_equal(store_chunk_delete(s, &big, h), 0);
	hash_n(h, 82);
	kv[0] = 2;
	assert_int_equal(store_chunk_put(s, &big, h, tokens, 0, t, NULL), 0);
	assert_int_equal(store_chunk_get(s, &big, h, 0, 4, out, total, NULL), 0);
	assert_memory_equal(out, kv, total);
	hash_n(h, 81);
	kv[0] = 1;
	assert_int_equal(store_chunk_get(s, &big, h, 0, 4, out, total, NULL), 0);
	assert_memory_equal(out, kv, total);
	store_close(&s);
	assert_int_equal(umount2(mnt, MNT_DETACH), 0);
	free(kv);
	free(out);
}

/* ---- totals per store codec: kept by every write, never counted by a read ---- */

/* What a walk of every chunk record gives per store codec (how STATS counted it before). */
struct codec_scan {
	struct store_model *models;
	size_t n_models;
	struct store_codec_use all, codec[STORE_CODECS];
};

static int codec_scan_one(void *ctx, uint32_t model_id, const uint8_t *hash,
			  const struct store_chunk_info *info)
{
	struct codec_scan *cs = ctx;

	(void)hash;
	cs->all.chunks++;
	cs->all.raw_bytes += info->raw_bytes;
	cs->all.stored_bytes += info->stored_bytes;
	for (size_t i = 0; i < cs->n_models; i++)
		if (cs->models[i].id == model_id) {
			struct store_codec_use *u = &cs->codec[cs->models[i].desc.store_codec];

			u->chunks++;
			u->raw_bytes += info->raw_bytes;
			u->stored_bytes += info->stored_bytes;
		}
	return 0;
}

/* The kept totals equal a full scan's, and reading them walked no chunk record. */
static void check_totals_match_scan(struct store *s)
{
	struct codec_scan cs = { 0 };
	struct store_totals t;
	uint64_t walks = store_chunk_walks(s);

	assert_int_equal(store_totals(s, &t), 0);
	assert_int_equal(store_chunk_walks(s), walks);
	assert_int_equal(store_model_list(s, &cs.models, &cs.n_models), 0);
	assert_int_equal(store_chunk_scan(s, codec_scan_one, &cs), 0);
	assert_int_equal(store_chunk_walks(s), walks + 1);
	assert_int_equal(t.chunks, cs.all.chunks);
	assert_int_equal(t.raw_bytes, cs.all.raw_bytes);
	assert_int_equal(t.stored_bytes, cs.all.stored_bytes);
	for (int c = 0; c < STORE_CODECS; c++) {
		assert_int_equal(t.codec[c].chunks, cs.codec[c].chunks);
		assert_int_equal(t.codec[c].raw_bytes, cs.codec[c].raw_bytes);
		assert_int_equal(t.codec[c].stored_bytes, cs.codec[c].stored_bytes);
	}
	free(cs.models);
}

/* Finite f16 values (exponent field at most 14), which every store codec can quantize. */
static uint8_t *make_finite_chunk(const struct store_model *m, uint32_t t, uint32_t seed,
				  const void **tensors)
{
	uint8_t *buf = make_chunk(m, t, seed, tensors);
	uint64_t n = 2 * store_tensor_bytes(m, t) * m->desc.num_layers;

	for (uint64_t i = 1; i < n; i += 2)
		buf[i] &= 0xbb;
	return buf;
}

static uint64_t rnd(uint64_t *x)
{
	*x ^= *x << 13;
	*x ^= *x >> 7;
	*x ^= *x << 17;
	return *x;
}

#define N_CODEC_MODELS 4
#define N_HASHES 24

/*
 * A random run of puts, imports, deletes, re-puts (no-ops), the removal of a
 * corrupt chunk and reopens, over models of all four store codecs: after each
 * step the kept per-codec totals equal what a walk of every chunk record says.
 */
static void test_codec_totals_kept(void **state)
{
	struct fixture *f = *state;
	struct store_model ms[N_CODEC_MODELS];
	uint64_t x = 0x2545f4914f6cdd1dull;
	uint8_t key[4 + STORE_HASH_LEN];
	int puts = 0, imports = 0, deletes = 0, repeats = 0;

	for (int i = 0; i < N_CODEC_MODELS; i++) {
		ms[i] = f->m;
		snprintf(ms[i].name, sizeof(ms[i].name), "codec%d", i);
		ms[i].desc.store_codec = (uint32_t)i;
		ms[i].desc.store_group = i == 3 ? 16 : 0;
		assert_int_equal(store_model_register(f->s, &ms[i]), 0);
	}
	for (int step = 0; step < 400; step++) {
		struct store_model *m = &ms[rnd(&x) % N_CODEC_MODELS];
		uint32_t tokens = 1 + (uint32_t)(rnd(&x) % 8);
		unsigned op = (unsigned)(rnd(&x) % 10);
		uint8_t h[STORE_HASH_LEN], h2[STORE_HASH_LEN];
		struct store_chunk_info ci;
		const void *t[8];
		uint8_t *kv;
		int rc;

		hash_n(h, (int)(rnd(&x) % N_HASHES));
		if (op < 4) { /* put: stored, or there already (a no-op) */
			kv = make_finite_chunk(m, tokens, (uint32_t)step, t);
			rc = store_chunk_put(f->s, m, h, tokens, 0, t, NULL);
			assert_true(rc == 0 || rc == 1);
			puts += rc == 0;
			repeats += rc == 1;
			free(kv);
		} else if (op < 6) { /* import another chunk's stored bytes under a new hash */
			struct blobs b = { 0 };
			const void *bl[4];

			if (store_chunk_export(f->s, m, h, &ci, grab, &b) == 0) {
				for (int l = 0; l < 4; l++)
					bl[l] = b.b[l];
				hash_n(h2, (int)(rnd(&x) % N_HASHES));
				rc = store_chunk_import(f->s, m, h2, ci.num_tokens, 0, bl, b.len, NULL,
							NULL);
				assert_true(rc == 0 || rc == 1);
				imports += rc == 0;
				repeats += rc == 1;
				for (int l = 0; l < 4; l++)
					free(b.b[l]);
			}
		} else if (op < 9) {
			rc = store_chunk_delete(f->s, m, h);
			assert_true(rc == 0 || rc == -ENOENT);
			deletes += rc == 0;
		} else if (step % 3 == 0 && store_chunk_info(f->s, m, h, &ci) == 0) {
			/* a corrupt record: its chunk is cleared by a delete */
			store_close(&f->s);
			chunk_key_of(key, m->id, h);
			flip_bit(f->dir, "chunks", key, sizeof(key), 5, 1);
			assert_int_equal(open_store(f, 64u << 20), 0);
			assert_int_equal(store_chunk_info(f->s, m, h, &ci), -EBADMSG);
			assert_int_equal(store_chunk_delete(f->s, m, h), 0);
		} else { /* a restart: the totals come back from their record, not a walk */
			store_close(&f->s);
			assert_int_equal(open_store(f, 64u << 20), 0);
			assert_int_equal(store_chunk_walks(f->s), 0);
		}
		check_totals_match_scan(f->s);
	}
	/* the run did what it says */
	assert_true(puts > 50 && imports > 10 && deletes > 50 && repeats > 20);
}

/*
 * STATS' regression: the per-codec totals are read from one record. Reading them
 * walks no chunk record at any store size (today's walk is what made STATS cost
 * 10 ms at 100,000 chunks); a store whose totals record has the older layout
 * (no per-codec figures) is counted once, at open, and written back.
 */
static void test_totals_read_no_walk(void **state)
{
	struct fixture *f = *state;
	struct store_model q = f->m;
	struct store_totals t, t2;
	uint8_t rec[32], h[STORE_HASH_LEN];
	const char *key = "totals";
	MDB_txn *txn;
	MDB_env *env;
	MDB_dbi meta;
	MDB_val k = { 6, (void *)key }, v;

	snprintf(q.name, sizeof(q.name), "q8");
	q.desc.store_codec = 2;
	assert_int_equal(store_model_register(f->s, &q), 0);
	for (int i = 0; i < 300; i++) {
		const void *tn[8];
		uint8_t *kv = make_finite_chunk(i % 2 ? &q : &f->m, 2, (uint32_t)i, tn);

		hash_n(h, i % 256);
		h[1] = (uint8_t)(i / 256);
		assert_int_equal(store_chunk_put(f->s, i % 2 ? &q : &f->m, h, 2, 0, tn, NULL), 0);
		free(kv);
	}
	assert_int_equal(store_chunk_walks(f->s), 0);
	for (int i = 0; i < 100; i++)
		assert_int_equal(store_totals(f->s, &t), 0);
	assert_int_equal(store_chunk_walks(f->s), 0);
	assert_int_equal(t.chunks, 300);
	assert_int_equal(t.codec[0].chunks, 150);
	assert_int_equal(t.codec[2].chunks, 150);
	assert_int_equal(t.codec[1].chunks + t.codec[3].chunks, 0);
	assert_int_equal(t.codec[0].raw_bytes + t.codec[2].raw_bytes, t.raw_bytes);
	assert_int_equal(t.codec[0].stored_bytes + t.codec[2].stored_bytes, t.stored_bytes);

	/* The record as a kvblend without per-codec totals wrote it: 3 x u64 and a checksum. */
	store_close(&f->s);
	env = raw_open(f->dir, &txn);
	assert_int_equal(mdb_dbi_open(txn, "meta", 0, &meta), 0);
	le(rec, t.chunks, 8);
	le(rec + 8, t.raw_bytes, 8);
	le(rec + 16, t.stored_bytes, 8);
	{
		uint8_t buf[6 + 24];

		memcpy(buf, key, 6);
		memcpy(buf + 6, rec, 24);
		le(rec + 24, checksum(buf, sizeof(buf)), 8);
	}
	v.mv_size = sizeof(rec);
	v.mv_data = rec;
	assert_int_equal(mdb_put(txn, meta, &k, &v, 0), 0);
	raw_close(env, txn);
	assert_int_equal(open_store(f, 64u << 20), 0);
	assert_int_equal(store_chunk_walks(f->s), 1); /* counted once, at open */
	for (int i = 0; i < 100; i++)
		assert_int_equal(store_totals(f->s, &t2), 0);
	assert_int_equal(store_chunk_walks(f->s), 1);
	assert_memory_equal(t2.codec, t.codec, sizeof(t.codec));
	assert_int_equal(t2.chunks, t.chunks);
	store_close(&f->s);
	assert_int_equal(open_store(f, 64u << 20), 0);
	assert_int_equal(store_chunk_walks(f->s), 0); /* and written back: not again */
	check_totals_match_scan(f->s);
}


/* ---- verification once per residency (store.h, enum store_verify) ---- */

static int reopen_verify(struct fixture *f, enum store_verify mode)
{
	struct store_opts o = { .dir = f->dir, .map_size = 64u << 20, .max_readers = 16,
				.min_saving = 0.1, .verify = mode };

	store_close(&f->s);
	return store_open(&o, &f->s);
}

/* ONCE: the first read verifies each layer, the next ones trust it; bytes changed in the
 * data file by another writer are caught on the next read all the same. */
static void test_verify_once(void **state)
{
	struct fixture *f = *state;
	const void *t[8];
	uint32_t tokens = 128; /* 8 KiB a tensor: values larger than a page */
	uint8_t h[STORE_HASH_LEN], *kv = make_chunk(&f->m, tokens, 40, t);
	uint64_t total = 2 * store_tensor_bytes(&f->m, tokens) * 4;
	uint8_t *out = malloc(total);
	struct store_verify_counts c0, c1, c2, c3;

	assert_int_equal(reopen_verify(f, STORE_VERIFY_ONCE), 0);
	hash_n(h, 40);
	assert_int_equal(store_chunk_put(f->s, &f->m, h, tokens, 0, t, NULL), 0);
	store_verify_counts(f->s, &c0);
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 0, 4, out, total, NULL), 0);
	assert_memory_equal(out, kv, total);
	store_verify_counts(f->s, &c1);
	assert_int_equal(c1.verified - c0.verified, 4);
	assert_int_equal(c1.trusted - c0.trusted, 0);
	memset(out, 0, total);
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 0, 4, out, total, NULL), 0);
	assert_memory_equal(out, kv, total);
	store_verify_counts(f->s, &c2);
	assert_int_equal(c2.verified - c1.verified, 0);
	assert_int_equal(c2.trusted - c1.trusted, 4);
	/* A byte of layer 1's V changed in the page cache by another writer. */
	flip_in_data_file(f->dir, (const uint8_t *)t[3] + 100, false);
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 0, 4, out, total, NULL), -EBADMSG);
	store_verify_counts(f->s, &c3);
	assert_int_equal(c3.forgotten - c2.forgotten, 1);
	/* The untouched layers were verified again, and are trusted after. */
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 2, 4, out, total / 2, NULL), 0);
	assert_int_equal(store_chunk_get(f->s, &f->m, h, 2, 4, out, total / 2, NULL), 0);
	store_verify_counts(f->s, &c1);
	assert_true(c1.trusted - c3.trusted >= 2);
	free(kv);
	free(out);
}

/* A read of one plane (the first check layer's, by the value or key metric) verifies and
 * returns that plane only: remembered as that plane's verification, so the next read of
 * the plane is trusted, but never as the layer's, whose whole read still checks both; a
 * flipped byte in the plane not read is caught by the next whole read. */
static void test_verify_one_plane(void **state)
{
	struct fixture *f = *state;
	const void *t[8];
	uint32_t tokens = 128;
	uint8_t h[STORE_HASH_LEN], *kv = make_chunk(&f->m, tokens, 42, t);
	uint64_t tb = store_tensor_bytes(&f->m, tokens);
	uint8_t *k = malloc(tb), *v = malloc(tb);
	struct store_verify_counts c0, c1, c2, c3;

	assert_int_equal(reopen_verify(f, STORE_VERIFY_ONCE), 0);
	hash_n(h, 42);
	assert_int_equal(store_chunk_put(f->s, &f->m, h, tokens, 0, t, NULL), 0);
	assert_int_equal(store_chunk_get_layer(f->s, &f->m, h, 1, NULL, NULL, tb, NULL), -EINVAL);
	store_verify_counts(f->s, &c0);
	memset(v, 0, tb);
	assert_int_equal(store_chunk_get_layer(f->s, &f->m, h, 1, NULL, v, tb, NULL), 0);
	assert_memory_equal(v, t[3], tb);
	memset(k, 0, tb);
	assert_int_equal(store_chunk_get_layer(f->s, &f->m, h, 0, k, NULL, tb, NULL), 0);
	assert_memory_equal(k, t[0], tb);
	store_verify_counts(f->s, &c1);
	assert_int_equal(c1.verified - c0.verified, 2);
	assert_int_equal(c1.trusted - c0.trusted, 0);
	/* the same plane again: trusted */
	memset(v, 0, tb);
	assert_int_equal(store_chunk_get_layer(f->s, &f->m, h, 1, NULL, v, tb, NULL), 0);
	assert_memory_equal(v, t[3], tb);
	store_verify_counts(f->s, &c2);
	assert_int_equal(c2.verified - c1.verified, 0);
	assert_int_equal(c2.trusted - c1.trusted, 1);
	/* not the whole layer after half of it: that read verifies both */
	assert_int_equal(store_chunk_get_layer(f->s, &f->m, h, 1, k, v, tb, NULL), 0);
	assert_memory_equal(k, t[2], tb);
	store_verify_counts(f->s, &c3);
	assert_int_equal(c3.verified - c2.verified, 1);
	assert_int_equal(c3.trusted - c2.trusted, 0);
	/* and its other plane alone is trusted after the whole read */
	assert_int_equal(store_chunk_get_layer(f->s, &f->m, h, 1, k, NULL, tb, NULL), 0);
	store_verify_counts(f->s, &c1);
	assert_int_equal(c1.trusted - c3.trusted, 1);
	/* a byte of layer 2's K changed: V alone still reads; the whole layer is refused */
	flip_in_data_file(f->dir, (const uint8_t *)t[4] + 100, false);
	assert_int_equal(store_chunk_get_layer(f->s, &f->m, h, 2, NULL, v, tb, NULL), 0);
	assert_memory_equal(v, t[5], tb);
	assert_int_equal(store_chunk_get_layer(f->s, &f->m, h, 2, k, v, tb, NULL), -EBADMSG);
	free(kv);
	free(k);
	free(v);
}

/* ALWAYS: every read computes the checksums. */
static void test_verify_always(void **state)
{
	struct fixture *f = *state;
	const void *t[8];
	uint32_t tokens = 128;
	uint8_t h[STORE_HASH_LEN], *kv = make_chunk(&f->m, tokens, 41, t);
	uint64_t total = 2 * store_tensor_bytes(&f->m, tokens) * 4;
	uint8_t *out = malloc(total);
	struct store_verify_counts c0, c1;

	assert_int_equal(reopen_verify(f, STORE_VERIFY_ALWAYS), 0);
	hash_n(h, 41);
	assert_int_equal(store_chunk_put(f->s, &f->m, h, tokens, 0, t, NULL), 0);
	store_verify_counts(f->s, &c0);
	for (int i = 0; i < 3; i++)
		assert_int_equal(store_chunk_get(f->s, &f->m, h, 0, 4, out, total, NULL), 0);
	store_verify_counts(f->s, &c1);
	assert_int_equal(c1.verified - c0.verified, 12);
	assert_int_equal(c1.trusted, 0);
	free(kv);
	free(out);
}

struct scrub_seen {
	int n;
	uint32_t model_id;
	uint8_t hash[STORE_HASH_LEN];
};

static void scrub_corrupt(void *ctx, uint32_t model_id, const uint8_t *hash)
{
	struct scrub_seen *s = ctx;

	s->n++;
	s->model_id = model_id;
	memcpy(s->hash, hash, STORE_HASH_LEN);
}

/* The scrub walks the store in budgets, resumes where it stopped, and names the chunk a
 * flipped byte is in (SCRUB_ONLY: reads skip the checksums, the scrub is the check). */
static void test_scrub(void **state)
{
	struct fixture *f = *state;
	const void *t[8];
	uint32_t tokens = 128;
	uint8_t h[STORE_HASH_LEN], bad[STORE_HASH_LEN], *kv[3];
	uint64_t total = 2 * store_tensor_bytes(&f->m, tokens) * 4;
	struct store_scrub sc = { 0 };
	struct scrub_seen seen = { 0 };
	struct store_verify_counts c;
	uint64_t all = 0;
	int calls = 0;
	int64_t r;

	assert_int_equal(reopen_verify(f, STORE_VERIFY_SCRUB_ONLY), 0);
	for (int i = 0; i < 3; i++) {
		kv[i] = make_chunk(&f->m, tokens, 50 + i, t);
		hash_n(h, 50 + i);
		assert_int_equal(store_chunk_put(f->s, &f->m, h, tokens, 0, t, NULL), 0);
		if (i == 1) {
			memcpy(bad, h, STORE_HASH_LEN);
			flip_in_data_file(f->dir, (const uint8_t *)t[4] + 64, false);
		}
	}
	/* A budget of one value at a time: 12 values, one pass, one chunk reported. */
	do {
		r = store_scrub(f->s, &sc, 1, scrub_corrupt, &seen);
		assert_true(r >= 0);
		all += (uint64_t)r;
		calls++;
	} while (sc.started && calls < 100);
	assert_int_equal(calls, 12);
	assert_true(all >= total * 3);
	assert_int_equal(seen.n, 1);
	assert_int_equal(seen.model_id, f->m.id);
	assert_memory_equal(seen.hash, bad, STORE_HASH_LEN);
	store_verify_counts(f->s, &c);
	assert_int_equal(c.scrub_passes, 1);
	assert_int_equal(c.scrubbed_bytes, all);
	/* Once the chunk is gone, a whole pass in one call finds nothing. */
	assert_int_equal(store_chunk_delete(f->s, &f->m, bad), 0);
	seen.n = 0;
	r = store_scrub(f->s, &sc, UINT64_MAX, scrub_corrupt, &seen);
	assert_true(r > 0 && (uint64_t)r >= total * 2);
	assert_int_equal(seen.n, 0);
	for (int i = 0; i < 3; i++)
		free(kv[i]);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		fixture_test(test_models),
		fixture_test(test_put_get_delete),
		fixture_test(test_immutable),
		fixture_test(test_full_put_leaves_nothing),
		fixture_test(test_reopen_keeps_chunks),
		fixture_test(test_export_import),
		fixture_test(test_corruption_reported),
		fixture_test(test_concurrent_readers),
		fixture_test(test_chunk_record_base_pos_flip),
		fixture_test(test_chunk_record_num_tokens_flip),
		fixture_test(test_chunk_record_checksum_flip),
		fixture_test(test_model_record_flip),
		fixture_test(test_model_layers),
		fixture_test(test_next_model_flip),
		fixture_test(test_totals_flip),
		fixture_test(test_upgrade_from_v1),
		fixture_test(test_newer_format_refused),
		fixture_test(test_disk_full),
		fixture_test(test_disk_filled_by_another),
		fixture_test(test_codec_totals_kept),
		fixture_test(test_totals_read_no_walk),
		fixture_test(test_verify_once),
		fixture_test(test_verify_one_plane),
		fixture_test(test_verify_always),
		fixture_test(test_scrub),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
