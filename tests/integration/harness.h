/*
 * harness — start and stop a real kvblendd for integration tests: a fresh
 * temporary data directory and IPC socket, extra flags as given, readiness
 * checked by a real ping through libkvblend. The cmocka side of harness_core.h
 * (which the benchmarks share): each call here asserts what the core returns.
 */
#ifndef KVBLEND_TESTS_HARNESS_H
#define KVBLEND_TESTS_HARNESS_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

#include <lmdb.h>

#include "client/include/kvblend.h"
#include "tests/integration/harness_core.h"

/* The initializer of a test's model: f16 K and V, RoPE theta 10000, the name and shape given. */
#define TEST_MODEL_F16(model_name, layers, kv_heads, dim)                                  \
	{ .name = model_name, .num_layers = (layers), .num_kv_heads = (kv_heads),           \
	  .head_dim = (dim), .dtype = KVB_F16, .rope_theta = 10000 }

/* Start kvblendd with the given extra arguments (NULL-terminated); asserts it answers. */
void daemon_start(struct daemon *d, const char *const *extra_args);
/* Start again on the same data directory and endpoint. */
void daemon_restart(struct daemon *d, const char *const *extra_args);
/* SIGTERM and wait; asserts a clean exit (status 0: no sanitizer findings). */
void daemon_stop(struct daemon *d);
/* Wait up to 30 s for it to exit (after a signal the test sent); asserts a clean exit. */
void daemon_wait(struct daemon *d);
/* Stop (if running) and remove the temporary directory. */
void daemon_cleanup(struct daemon *d);
/* The end of a test's daemon: close its client *c, daemon_stop, then daemon_cleanup. */
void daemon_end(struct daemon *d, kvb_client **c);
/* The daemon's counter name from kvb_stats(); asserts that it exists. */
double daemon_stat(kvb_client *c, const char *name);

/*
 * A fresh CURVE key pair for d's server: the secret written to keyfile (d->dir/server.key,
 * for --curve-secret-key-file), the public key into pub (Z85, 40 characters and NUL).
 */
void daemon_curve_key(const struct daemon *d, char keyfile[400], char pub[41]);

/*
 * Store through c a chunk of m (its name and shape, f16 K and V) of tokens tokens at
 * position pos, its values fill_f16(seed), under the hash of the n_ids words ids (into
 * hash). Asserts the PUT.
 */
void put_test_chunk(kvb_client *c, const struct kvb_model *m, const uint32_t *ids, size_t n_ids,
		    uint32_t tokens, uint32_t pos, uint32_t seed, uint8_t hash[KVB_HASH_LEN]);

/*
 * The request the session tests open: chunk 0 at 0, fresh tokens after it, then chunks 1
 * to n_chunks - 1 one after another (hash[i] of tokens[i] tokens), into s[n_chunks + 1];
 * returns n_chunks + 1.
 */
size_t fresh_after_first_chunk(struct kvb_segment *s, const uint8_t (*hash)[KVB_HASH_LEN],
			       const uint32_t *tokens, size_t n_chunks, uint32_t fresh);

/* A client connected to d; asserts success. */
kvb_client *daemon_client(const struct daemon *d, int no_shm);

/*
 * The start of most tests: daemon_start(d, extra_args), a daemon_client(d, no_shm) and
 * model m registered through it. Asserts each step; the client is the caller's.
 */
kvb_client *daemon_start_client(struct daemon *d, const char *const *extra_args,
				const struct kvb_model *m, int no_shm);

/*
 * The cmocka fixture of a test that needs nothing but a daemon: daemon_setup starts one
 * (extra arguments as for daemon_start) in a struct daemon it allocates into *state;
 * daemon_teardown stops it, removes its directory and frees it. Both return 0.
 */
int daemon_setup(void **state, const char *const *extra_args);
int daemon_teardown(void **state);
/* The table entry of a test on such a daemon, started by the file's static setup(). */
#define daemon_test(f) cmocka_unit_test_setup_teardown(f, setup, daemon_teardown)

/*
 * A write cursor over the "layers" table of the data file in data_dir, for tests that
 * tamper with a stopped daemon's records; data_layers_close commits its transaction and
 * closes the file. Both assert success.
 */
MDB_cursor *data_layers_open(const char *data_dir);
void data_layers_close(MDB_cursor *cur);

/* Write text to path (created or truncated); asserts success. */
void write_text_file(const char *path, const char *text);

#endif
