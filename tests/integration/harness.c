/* harness — real kvblendd for integration tests; see harness.h. */
#include "tests/integration/harness.h"

#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

/* Fail the test unless daemon_reap said rc == 0 (a clean exit: no sanitizer findings). */
static void daemon_expect_exit(const struct daemon *d, int rc)
{
	if (rc == -ETIMEDOUT)
		fail_msg("kvblendd did not stop within 30 s; killed (see %s)", d->log_path);
	if (rc)
		fail_msg("kvblendd exited with status 0x%x (sanitizer finding or crash?)", rc);
}

/* The options every test's daemon starts with, before the test's own. */
static void spawn(struct daemon *d, const char *const *extra)
{
	const char *defaults[16] = { "--map-size", "1G", "--workers", "3", "--log-level", "debug" };
	int n = 6, rc;

	/* The parity suite (tests/gpu_run.sh) runs the same tests with the fuse on a GPU. */
	if (getenv("KVBLEND_TEST_DEVICE")) {
		defaults[n++] = "--device";
		defaults[n++] = getenv("KVBLEND_TEST_DEVICE");
	}
	rc = daemon_spawn(d, KVBLENDD_PATH, defaults, extra);
	if (rc == -ECHILD)
		fail_msg("kvblendd exited during start-up; see %s", d->log_path);
	if (rc)
		fail_msg("kvblendd did not answer within 10 s (%d); see %s", rc, d->log_path);
}

void daemon_start(struct daemon *d, const char *const *extra)
{
	int rc = daemon_prepare(d, "/tmp/kvb-test");

	if (rc)
		fail_msg("daemon_prepare: %s", strerror(-rc));
	spawn(d, extra);
}

void daemon_restart(struct daemon *d, const char *const *extra)
{
	daemon_stop(d);
	spawn(d, extra);
}

void daemon_stop(struct daemon *d)
{
	if (d->pid)
		daemon_expect_exit(d, daemon_reap(d, 1));
}

void daemon_wait(struct daemon *d)
{
	daemon_expect_exit(d, daemon_reap(d, 0));
}

void daemon_cleanup(struct daemon *d)
{
	daemon_remove(d);
}

void daemon_end(struct daemon *d, kvb_client **c)
{
	kvb_close(c);
	daemon_stop(d);
	daemon_cleanup(d);
}

kvb_client *daemon_client(const struct daemon *d, int no_shm)
{
	struct kvb_connect_opts o = { .timeout_ms = 10000, .no_shm = no_shm };
	kvb_client *c = NULL;
	char err[512];
	int rc = kvb_connect(d->endpoint, &o, &c, err, sizeof(err));

	if (rc)
		fail_msg("connect: %s", err);
	return c;
}

kvb_client *daemon_start_client(struct daemon *d, const char *const *extra_args,
				const struct kvb_model *m, int no_shm)
{
	kvb_client *c;

	daemon_start(d, extra_args);
	c = daemon_client(d, no_shm);
	assert_int_equal(kvb_model_register(c, m, NULL), 0);
	return c;
}

void put_test_chunk(kvb_client *c, const struct kvb_model *m, const uint32_t *ids, size_t n_ids,
		    uint32_t tokens, uint32_t pos, uint32_t seed, uint8_t hash[KVB_HASH_LEN])
{
	size_t n = (size_t)m->num_layers * 2 * tokens * m->num_kv_heads * m->head_dim;
	uint16_t *kv = malloc(n * 2);

	assert_non_null(kv);
	fill_f16(kv, n, seed);
	kvb_chunk_hash(ids, n_ids, hash);
	assert_int_equal(kvb_put(c, m->name, hash, KVB_F16, tokens, pos, kv, n * 2, NULL), 0);
	free(kv);
}

size_t fresh_after_first_chunk(struct kvb_segment *s, const uint8_t (*hash)[KVB_HASH_LEN],
			       const uint32_t *tokens, size_t n_chunks, uint32_t fresh)
{
	uint32_t pos = tokens[0] + fresh;

	memset(s, 0, (n_chunks + 1) * sizeof(*s));
	memcpy(s[0].hash, hash[0], KVB_HASH_LEN);
	s[1].fresh = 1;
	s[1].count = fresh;
	s[1].pos = tokens[0];
	for (size_t i = 1; i < n_chunks; i++) {
		memcpy(s[i + 1].hash, hash[i], KVB_HASH_LEN);
		s[i + 1].pos = pos;
		pos += tokens[i];
	}
	return n_chunks + 1;
}

double daemon_stat(kvb_client *c, const char *name)
{
	struct kvb_stat *s;
	size_t n;
	double v = -1;

	assert_int_equal(kvb_stats(c, &s, &n), 0);
	for (size_t i = 0; i < n; i++)
		if (!strcmp(s[i].name, name))
			v = s[i].value;
	free(s);
	if (v < 0)
		fail_msg("no stat %s", name);
	return v;
}

void daemon_curve_key(const struct daemon *d, char keyfile[400], char pub[41])
{
	char sec[41];
	FILE *f;

	snprintf(keyfile, 400, "%s/server.key", d->dir);
	assert_int_equal(kvb_curve_keypair(pub, sec), 0);
	f = fopen(keyfile, "w");
	assert_non_null(f);
	fprintf(f, "%s\n", sec);
	fclose(f);
}

int daemon_setup(void **state, const char *const *extra_args)
{
	struct daemon *d = calloc(1, sizeof(*d));

	assert_non_null(d);
	daemon_start(d, extra_args);
	*state = d;
	return 0;
}

int daemon_teardown(void **state)
{
	struct daemon *d = *state;

	daemon_stop(d);
	daemon_cleanup(d);
	free(d);
	return 0;
}

MDB_cursor *data_layers_open(const char *data_dir)
{
	MDB_env *env;
	MDB_txn *txn;
	MDB_dbi dbi;
	MDB_cursor *cur;

	assert_int_equal(mdb_env_create(&env), 0);
	assert_int_equal(mdb_env_set_maxdbs(env, 8), 0);
	assert_int_equal(mdb_env_set_mapsize(env, 1u << 30), 0);
	assert_int_equal(mdb_env_open(env, data_dir, 0, 0640), 0);
	assert_int_equal(mdb_txn_begin(env, NULL, 0, &txn), 0);
	assert_int_equal(mdb_dbi_open(txn, "layers", 0, &dbi), 0);
	assert_int_equal(mdb_cursor_open(txn, dbi, &cur), 0);
	return cur;
}

void data_layers_close(MDB_cursor *cur)
{
	MDB_txn *txn = mdb_cursor_txn(cur);
	MDB_env *env = mdb_txn_env(txn);

	mdb_cursor_close(cur);
	assert_int_equal(mdb_txn_commit(txn), 0);
	mdb_env_close(env);
}

void write_text_file(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");

	assert_non_null(f);
	fputs(text, f);
	fclose(f);
}
