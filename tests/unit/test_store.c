/* Unit tests of store/: models, commit and visibility, immutability, corruption, reopen. */
#include <errno.h>
#include <lmdb.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "store.h"

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
	f->m = (struct store_model){ .name = "m", .num_layers = 4, .num_kv_heads = 2,
				     .head_dim = 16, .dtype = 1, .rope_theta = 1e4 };
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
	uint8_t *buf = malloc(2 * tb * m->num_layers);

	uint64_t x = 0x9e3779b97f4a7c15ull ^ seed;

	/* Random bytes: incompressible, so sizes below are what LMDB must hold. */
	for (uint64_t i = 0; i < 2 * tb * m->num_layers; i++) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		buf[i] = (uint8_t)(x >> 32);
	}
	for (uint32_t i = 0; i < 2 * m->num_layers; i++)
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
	other.rope_theta = 5e5;
	assert_int_equal(store_model_register(f->s, &other), -EEXIST);
	snprintf(other.name, sizeof(other.name), "another");
	assert_int_equal(store_model_register(f->s, &other), 0);
	assert_int_not_equal(other.id, f->m.id);
	assert_int_equal(store_model_find(f->s, "another", &found), 0);
	assert_true(found.rope_theta == 5e5);
	assert_int_equal(store_model_find(f->s, "missing", &found), -ENOENT);
	assert_int_equal(store_model_list(f->s, &all, &n), 0);
	assert_int_equal(n, 2);
	assert_string_equal(all[0].name, "another");
	free(all);
	other.dtype = 9;
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

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test_setup_teardown(test_models, setup, teardown),
		cmocka_unit_test_setup_teardown(test_put_get_delete, setup, teardown),
		cmocka_unit_test_setup_teardown(test_immutable, setup, teardown),
		cmocka_unit_test_setup_teardown(test_full_put_leaves_nothing, setup, teardown),
		cmocka_unit_test_setup_teardown(test_reopen_keeps_chunks, setup, teardown),
		cmocka_unit_test_setup_teardown(test_corruption_reported, setup, teardown),
		cmocka_unit_test_setup_teardown(test_concurrent_readers, setup, teardown),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
