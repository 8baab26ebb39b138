/*
 * The store's data file at start, through the real kvblendd (issues 34 and 55): a
 * data.mdb cut short by something other than the daemon is set aside, kept for
 * inspection, and the daemon serves with an empty store, which takes chunks again.
 * Cut below its last page; cut below LMDB's two meta pages (which LMDB cannot even
 * open); symlinked to another disk (set aside there, the link and the disk kept); and
 * set aside more than once in a second (no set-aside overwrites another).
 */
#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/integration/harness.h"

#define TOKENS 4096

static const struct kvb_model tiny = TEST_MODEL_F16("tiny", 3, 2, 8);
/* the scrub off: nothing but the start is to look at the file */
static const char *const restart_args[] = { "--max-message", "4M", "--max-tokens", "4096",
					    "--scrub-mb-per-s", "0", NULL };

static const size_t chunk_len = (size_t)3 * 2 * TOKENS * 2 * 8 * 2;

static void hash_of(uint32_t seed, uint8_t h[KVB_HASH_LEN])
{
	uint32_t ids[4] = { seed, seed + 1, seed + 2, 7 };

	kvb_chunk_hash(ids, 4, h);
}

static int setup(void **state)
{
	return daemon_setup(state, restart_args);
}

/* Register tiny (again, in a new store) and store chunks seed .. seed + n - 1. */
static void store_chunks(const struct daemon *d, uint32_t seed, uint32_t n)
{
	uint16_t *kv = malloc(chunk_len);
	uint8_t h[KVB_HASH_LEN];
	kvb_client *c = daemon_client(d, 0);

	assert_int_equal(kvb_model_register(c, &tiny, NULL), 0);
	for (uint32_t i = seed; i < seed + n; i++) {
		hash_of(i, h);
		fill_f16(kv, chunk_len / 2, i);
		assert_int_equal(kvb_put(c, "tiny", h, KVB_F16, TOKENS, 0, kv, chunk_len, NULL), 0);
	}
	kvb_close(&c);
	free(kv);
}

/*
 * The daemon serves an empty store: chunks seed .. seed + n - 1 are misses, and a new
 * chunk (new_seed) is stored and read back.
 */
static void serves_empty_store(const struct daemon *d, uint32_t seed, uint32_t n,
			       uint32_t new_seed)
{
	uint16_t *kv = malloc(chunk_len), *back = malloc(chunk_len);
	uint8_t h[KVB_HASH_LEN];
	kvb_client *c = daemon_client(d, 0);

	/* the store is new: the model too */
	assert_int_equal(kvb_model_register(c, &tiny, NULL), 0);
	for (uint32_t i = seed; i < seed + n; i++) {
		hash_of(i, h);
		assert_int_equal(kvb_get(c, "tiny", h, 0, 0, back, chunk_len, NULL),
				 KVB_E_NOT_FOUND);
	}
	hash_of(new_seed, h);
	fill_f16(kv, chunk_len / 2, new_seed);
	assert_int_equal(kvb_put(c, "tiny", h, KVB_F16, TOKENS, 0, kv, chunk_len, NULL), 0);
	assert_int_equal(kvb_get(c, "tiny", h, 0, 0, back, chunk_len, NULL), 0);
	assert_memory_equal(kv, back, chunk_len);
	kvb_close(&c);
	free(kv);
	free(back);
}

static off_t size_of(const char *path)
{
	struct stat st;

	assert_int_equal(stat(path, &st), 0);
	return st.st_size;
}

/* Stop the daemon, cut the file at path to size bytes, start it again (asserts it answers). */
static void cut_and_restart(struct daemon *d, const char *path, off_t size)
{
	daemon_stop(d);
	assert_true(size_of(path) > size);
	assert_int_equal(truncate(path, size), 0);
	daemon_restart(d, restart_args);
}

/*
 * The files in dir named base.truncated-*: their count, and their sizes into sizes[]
 * (at most max; the rest counted only).
 */
static size_t set_asides(const char *dir, const char *base, off_t *sizes, size_t max)
{
	char prefix[NAME_MAX + 1], path[PATH_MAX];
	struct dirent *e;
	DIR *dp = opendir(dir);
	size_t n = 0;

	assert_non_null(dp);
	snprintf(prefix, sizeof(prefix), "%s.truncated-", base);
	while ((e = readdir(dp))) {
		if (strncmp(e->d_name, prefix, strlen(prefix)))
			continue;
		snprintf(path, sizeof(path), "%s/%s", dir, e->d_name);
		if (n < max)
			sizes[n] = size_of(path);
		n++;
	}
	closedir(dp);
	return n;
}

/* Whether one of the n sizes is size. */
static int has_size(const off_t *sizes, size_t n, off_t size)
{
	for (size_t i = 0; i < n; i++)
		if (sizes[i] == size)
			return 1;
	return 0;
}

static int log_has(const struct daemon *d, const char *needle)
{
	static char log[1 << 20];
	FILE *f = fopen(d->log_path, "r");
	size_t got;

	assert_non_null(f);
	got = fread(log, 1, sizeof(log) - 1, f);
	log[got] = 0;
	fclose(f);
	return strstr(log, needle) != NULL;
}

/*
 * A data file cut short by something other than the daemon (LMDB never shortens it):
 * reading a page past its end stopped the daemon with SIGBUS. At start it now moves
 * the file aside (kept, named data.mdb.truncated-TIME), logs why, and serves with an
 * empty store, which takes chunks again.
 */
static void test_truncated_file_set_aside(void **state)
{
	struct daemon *d = *state;
	char path[400];
	off_t sizes[4], cut;

	store_chunks(d, 500, 8);
	snprintf(path, sizeof(path), "%s/data.mdb", d->data_dir);
	assert_true(size_of(path) > 4 * (off_t)chunk_len);
	cut = size_of(path) / 2;
	cut_and_restart(d, path, cut);
	serves_empty_store(d, 500, 8, 600);
	/* the cut file kept as it was, and the log names the problem */
	assert_int_equal(set_asides(d->data_dir, "data.mdb", sizes, 4), 1);
	assert_int_equal(sizes[0], cut);
	assert_true(log_has(d, "was truncated by something other than kvblendd"));
}

/*
 * A data file cut below LMDB's two meta pages (issue 55, defect 5): LMDB cannot read
 * it as a store at all, so the daemon refused to start at every restart (a systemd
 * loop). It is set aside like any other cut file: cut into the first page, and cut
 * just past it (the first meta page whole, the second short).
 */
static void test_short_file_set_aside(void **state)
{
	struct daemon *d = *state;
	off_t page = sysconf(_SC_PAGESIZE), sizes[4];
	char path[400];

	store_chunks(d, 700, 2);
	snprintf(path, sizeof(path), "%s/data.mdb", d->data_dir);
	cut_and_restart(d, path, 100);
	serves_empty_store(d, 700, 2, 710);
	assert_int_equal(set_asides(d->data_dir, "data.mdb", sizes, 4), 1);
	assert_int_equal(sizes[0], 100);
	assert_true(log_has(d, "was truncated by something other than kvblendd (100 bytes"));

	cut_and_restart(d, path, page + 100);
	serves_empty_store(d, 710, 1, 720);
	assert_int_equal(set_asides(d->data_dir, "data.mdb", sizes, 4), 2);
	assert_true(has_size(sizes, 2, 100) && has_size(sizes, 2, page + 100));
}

/*
 * A data.mdb that is a symlink to a file on another disk (issue 55, defect 5): the
 * link itself was renamed and LMDB made a new regular data.mdb in the data directory,
 * so the store moved off its disk without a word. The target is set aside next to
 * itself, the link stays, and the new store is made at the target, on its disk.
 */
static void test_symlinked_file_set_aside(void **state)
{
	struct daemon *d = *state;
	char link[400], disk[400], target[440], back[PATH_MAX];
	off_t sizes[4], cut;
	struct stat st;
	ssize_t n;

	store_chunks(d, 800, 8);
	daemon_stop(d);
	snprintf(link, sizeof(link), "%s/data.mdb", d->data_dir);
	snprintf(disk, sizeof(disk), "%s/disk2", d->dir);
	snprintf(target, sizeof(target), "%s/kv.mdb", disk);
	assert_int_equal(mkdir(disk, 0750), 0);
	assert_int_equal(rename(link, target), 0);
	assert_int_equal(symlink(target, link), 0);
	cut = size_of(target) / 2;
	cut_and_restart(d, target, cut);
	serves_empty_store(d, 800, 8, 900);
	/* the link is kept, pointing where it did, at the new store (a regular file) */
	assert_int_equal(lstat(link, &st), 0);
	assert_true(S_ISLNK(st.st_mode));
	n = readlink(link, back, sizeof(back) - 1);
	assert_true(n > 0);
	back[n] = 0;
	assert_string_equal(back, target);
	assert_int_equal(lstat(target, &st), 0);
	assert_true(S_ISREG(st.st_mode));
	/* the cut file kept beside its target, on its disk; nothing in the data directory */
	assert_int_equal(set_asides(disk, "kv.mdb", sizes, 4), 1);
	assert_int_equal(sizes[0], cut);
	assert_int_equal(set_asides(d->data_dir, "data.mdb", sizes, 4), 0);
	assert_true(log_has(d, target));
	/* the new store is the one at the target: its chunk is there after a restart */
	daemon_restart(d, restart_args);
	{
		uint16_t *kv = malloc(chunk_len);
		uint8_t h[KVB_HASH_LEN];
		kvb_client *c = daemon_client(d, 0);

		hash_of(900, h);
		assert_int_equal(kvb_get(c, "tiny", h, 0, 0, kv, chunk_len, NULL), 0);
		kvb_close(&c);
		free(kv);
	}
	assert_int_equal(lstat(link, &st), 0);
	assert_true(S_ISLNK(st.st_mode));
}

/*
 * Set-asides in the same second never overwrite each other (issue 55, defect 5): the
 * name carried the second alone, and rename() replaced an earlier file of that name.
 * Files of that name for every second around the restarts are there before them and
 * must be there, unchanged, after; two cuts in a row give two more files.
 */
static void test_set_asides_never_collide(void **state)
{
	struct daemon *d = *state;
	char path[400], name[460];
	time_t now = time(NULL);
	off_t sizes[256], first, second;
	size_t n;

	store_chunks(d, 1000, 4);
	snprintf(path, sizeof(path), "%s/data.mdb", d->data_dir);
	for (time_t t = now - 2; t < now + 120; t++) {
		FILE *f;

		snprintf(name, sizeof(name), "%s.truncated-%lld", path, (long long)t);
		f = fopen(name, "w");
		assert_non_null(f);
		fputs("earlier", f);
		fclose(f);
	}
	first = size_of(path) / 2;
	cut_and_restart(d, path, first);
	serves_empty_store(d, 1000, 4, 1010);
	second = size_of(path) / 2;
	cut_and_restart(d, path, second);
	serves_empty_store(d, 1010, 1, 1020);
	assert_true(time(NULL) < now + 120); /* the placeholders covered every second */
	n = set_asides(d->data_dir, "data.mdb", sizes, 256);
	assert_int_equal(n, 122 + 2);
	for (time_t t = now - 2; t < now + 120; t++) {
		snprintf(name, sizeof(name), "%s.truncated-%lld", path, (long long)t);
		assert_int_equal(size_of(name), 7);
	}
	assert_true(has_size(sizes, n, first) && has_size(sizes, n, second));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		daemon_test(test_truncated_file_set_aside),
		daemon_test(test_short_file_set_aside),
		daemon_test(test_symlinked_file_set_aside),
		daemon_test(test_set_asides_never_collide),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
