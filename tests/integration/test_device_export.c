/*
 * test_device_export — the close order of a session whose ring the node maps (CUDA
 * IPC), on the emulated device: the client (libkvblend, with tests' fake driver
 * fake_libcuda as its libcuda.so.1) maps the exported block, and at close it
 * unmaps it before the daemon frees it. The fake driver and the emulated device
 * note "map", "unmap" and "free" with the block's address in one file, in the
 * order they happened; and a session that expires mapped keeps its block until the
 * daemon exits. What a session's open allocates and pins (the emulated device notes it):
 * a shared ring pinned once for its segment's life, no copy from pageable memory, pooled
 * blocks, spares allocated off the open path, and a reserve allocated at start. And device auto's placement per session: a node that takes its layers
 * in host memory is fused on the CPU, one that maps the ring on the device. Run with
 * KVBLEND_TEST_DEVICE=emulated and LD_LIBRARY_PATH
 * on the fake driver (tests/CMakeLists.txt).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/integration/harness.h"

#define L 3
#define H 2
#define D 8

static const struct kvb_model model = TEST_MODEL_F16("xm", L, H, D);

/* The line number (from 1) of "what ADDR" in the log, or 0. */
static int line_of(const char *log, const char *what, const char *addr)
{
	char want[96], line[96];
	FILE *f = fopen(log, "r");
	int n = 0, at = 0;

	snprintf(want, sizeof(want), "%s %s\n", what, addr);
	while (f && !at && fgets(line, sizeof(line), f)) {
		n++;
		if (!strcmp(line, want))
			at = n;
	}
	if (f)
		fclose(f);
	return at;
}

/* Lines of the log that begin with "what " (what the emulated device noted). */
static int lines_of(const char *log, const char *what)
{
	char line[256];
	size_t len = strlen(what);
	FILE *f = fopen(log, "r");
	int n = 0;

	while (f && fgets(line, sizeof(line), f))
		n += !strncmp(line, what, len) && line[len] == ' ';
	if (f)
		fclose(f);
	return n;
}

/* A close statistic by name (-1: not given). */
static double stat_of(const struct kvb_stat *st, size_t n, const char *name)
{
	for (size_t i = 0; i < n; i++)
		if (!strcmp(st[i].name, name))
			return st[i].value;
	return -1;
}

/* The address of the last "map ADDR" line of the fake driver's log into addr; asserts one. */
static void last_mapped(const char *log, char *addr, size_t len)
{
	char line[256];
	FILE *f = fopen(log, "r");

	assert_non_null(f);
	addr[0] = 0;
	while (fgets(line, sizeof(line), f))
		if (!strncmp(line, "map ", 4))
			snprintf(addr, len, "%.*s", (int)strcspn(line + 4, "\n"), line + 4);
	fclose(f);
	assert_true(addr[0]);
}

/* An empty file from the mkstemp template log (for the devices' notes); asserts success. */
static void make_log(char *log)
{
	int fd = mkstemp(log);

	assert_true(fd >= 0);
	close(fd);
}

/*
 * The request every session here opens: the chunk ids, T tokens of K and V from seed,
 * stored through c, then F fresh tokens at T, described in s[0] and s[1]. Asserts the PUT.
 */
static void put_cached_then_fresh(kvb_client *c, const uint32_t ids[2], uint32_t T, uint32_t F,
				  uint32_t seed, struct kvb_segment s[2])
{
	memset(s, 0, 2 * sizeof(*s));
	put_test_chunk(c, &model, ids, 2, T, 0, seed, s[0].hash);
	s[1].fresh = 1;
	s[1].count = F;
	s[1].pos = T;
}

/*
 * The end of a test that compared two sessions' layers: d's directory removed, the
 * emulated device's log (when one, else NULL) no longer given and removed, buffers freed.
 */
static void end_two_sessions(struct daemon *d, const char *log, uint8_t *out[2], uint8_t *rows)
{
	daemon_cleanup(d);
	if (log) {
		unsetenv("KVBLEND_EMULATED_LOG");
		unlink(log);
	}
	free(out[0]);
	free(out[1]);
	free(rows);
}

/*
 * The open session fu's layers from its next one to the last: the fresh rows sent (K at
 * rows, V after the selected ones, row bytes a token), the fused layer's K and V received
 * into out and out + layer / 2. Asserts each call.
 */
static void fuse_layers(kvb_client *c, kvb_fuse *fu, const uint8_t *rows, size_t row,
			uint8_t *out, size_t layer)
{
	int fused = 0;

	for (uint32_t l = kvb_fuse_next_layer(fu); l < L; l++) {
		const int32_t *sel;
		size_t nr = kvb_fuse_rows(fu, &sel);

		assert_int_equal(kvb_fuse_layer(c, fu, l, rows, rows + nr * row, out,
						out + layer / 2, &fused),
				 0);
	}
}

static void test_unmap_before_free(void **state)
{
	char log[] = "/tmp/kvb-export-XXXXXX", addr[32] = "";
	struct daemon d;
	kvb_client *c;
	uint8_t hash[2][KVB_HASH_LEN];
	uint32_t tokens[2] = { 12, 9 }, check = 1;
	double ratio = 0.5;
	struct kvb_segment s[2];
	struct kvb_fuse_params p = { &check, &ratio, 1, KVB_METRIC_VALUE };
	kvb_fuse *fu;

	(void)state;
	make_log(log);
	setenv("FAKE_CUDA_LOG", log, 1);
	setenv("KVBLEND_EMULATED_LOG", log, 1); /* the daemon inherits it */
	daemon_start(&d, NULL);
	c = daemon_client(&d, 0);
	assert_int_equal(kvb_fuse_device(c), 0); /* the fake driver */
	assert_int_equal(kvb_model_register(c, &model, NULL), 0);
	memset(s, 0, sizeof(s));
	for (uint32_t i = 0; i < 2; i++) {
		uint32_t ids[2] = { 5, i };

		put_test_chunk(c, &model, ids, 2, tokens[i], 0, i + 3, hash[i]);
		memcpy(s[i].hash, hash[i], KVB_HASH_LEN);
		s[i].pos = i ? tokens[0] : 0;
	}
	assert_int_equal(kvb_fuse_open(c, "xm", s, 2, &p, &fu, NULL, NULL), 0);
	assert_true(kvb_fuse_on_device(fu)); /* mapped through the fake driver */
	last_mapped(log, addr, sizeof(addr));
	assert_int_equal(line_of(log, "free", addr), 0); /* still the session's */
	assert_int_equal(kvb_fuse_close(c, &fu, NULL, NULL), 0);
	kvb_close(&c);
	daemon_stop(&d);
	/* Unmapped here, then freed there: never freed under the node's mapping. */
	assert_true(line_of(log, "unmap", addr) > 0);
	assert_true(line_of(log, "free", addr) > 0);
	assert_true(line_of(log, "unmap", addr) < line_of(log, "free", addr));
	daemon_cleanup(&d);
	unlink(log);
}

/*
 * A session whose node maps its ring but never closes it: when it expires the daemon
 * does not free the block (the node may map it still), and says so in its log; it
 * is freed at exit.
 */
static void test_expired_export_kept(void **state)
{
	char log[] = "/tmp/kvb-export-XXXXXX", addr[32] = "";
	const char *args[] = { "--fuse-idle", "1", NULL };
	struct daemon d;
	kvb_client *c;
	uint8_t hash[KVB_HASH_LEN];
	uint32_t ids[2] = { 7, 1 }, T = 16, check = 1;
	double ratio = 0.5;
	struct kvb_segment s[1];
	struct kvb_fuse_params p = { &check, &ratio, 1, KVB_METRIC_VALUE };
	kvb_fuse *fu;
	FILE *f;
	char *text;
	long len;

	(void)state;
	make_log(log);
	setenv("FAKE_CUDA_LOG", log, 1);
	setenv("KVBLEND_EMULATED_LOG", log, 1);
	daemon_start(&d, args);
	c = daemon_client(&d, 0);
	assert_int_equal(kvb_fuse_device(c), 0);
	assert_int_equal(kvb_model_register(c, &model, NULL), 0);
	put_test_chunk(c, &model, ids, 2, T, 0, 21, hash);
	memset(s, 0, sizeof(s));
	memcpy(s[0].hash, hash, KVB_HASH_LEN);
	assert_int_equal(kvb_fuse_open(c, "xm", s, 1, &p, &fu, NULL, NULL), 0);
	assert_true(kvb_fuse_on_device(fu));
	last_mapped(log, addr, sizeof(addr));
	sleep(4); /* past fuse_idle: the session expires */
	assert_int_not_equal(kvb_fuse_close(c, &fu, NULL, NULL), 0); /* gone */
	assert_true(line_of(log, "unmap", addr) > 0);
	assert_int_equal(line_of(log, "free", addr), 0); /* kept while the daemon runs */
	kvb_close(&c);
	daemon_stop(&d);
	assert_true(line_of(log, "free", addr) > line_of(log, "unmap", addr)); /* at exit */
	f = fopen(d.log_path, "r");
	assert_non_null(f);
	fseek(f, 0, SEEK_END);
	len = ftell(f);
	rewind(f);
	text = calloc(1, (size_t)len + 1);
	assert_int_equal(fread(text, 1, (size_t)len, f), (size_t)len);
	fclose(f);
	assert_non_null(strstr(text, "expired with its device ring exported"));
	free(text);
	daemon_cleanup(&d);
	unlink(log);
}

/*
 * A session on the emulated device whose pinned ring comes from the cache (the first
 * session's): only the fresh tokens' rows are zeroed at open, in every slot, not the
 * whole ring (ring_zeroed_bytes, in the close's statistics); and the fuse is still
 * that of the first, identical session.
 */
static void test_zero_only_fresh_rows(void **state)
{
	struct daemon d;
	kvb_client *c;
	uint32_t ids[2] = { 6, 1 }, T = 20, F = 4, n = T + F, check = 1;
	double ratio = 0.5;
	size_t row = (size_t)H * D * 2, layer = 2 * (size_t)n * row;
	struct kvb_segment s[2];
	struct kvb_fuse_params p = { &check, &ratio, 1, KVB_METRIC_VALUE };
	uint8_t *rows = malloc(layer), *out[2];
	double zeroed = -1, ring = -1, allocs[2] = { -1, -1 };
	char log[] = "/tmp/kvb-pool-XXXXXX";

	(void)state;
	make_log(log);
	setenv("KVBLEND_EMULATED_LOG", log, 1); /* the daemon notes its device frees there */
	/* no shared memory: the ring is the daemon's pinned one */
	c = daemon_start_client(&d, NULL, &model, 1);
	put_cached_then_fresh(c, ids, T, F, 11, s);
	fill_f16((uint16_t *)rows, layer / 2, 12);
	for (int round = 0; round < 2; round++) {
		kvb_fuse *fu;
		struct kvb_stat *st;
		size_t n_st;

		out[round] = calloc(1, layer);
		assert_int_equal(kvb_fuse_open(c, "xm", s, 2, &p, &fu, NULL, NULL), 0);
		assert_int_equal(kvb_fuse_tokens(fu), n);
		fuse_layers(c, fu, rows, row, out[round], layer);
		assert_int_equal(kvb_fuse_close(c, &fu, &st, &n_st), 0);
		zeroed = stat_of(st, n_st, "ring_zeroed_bytes");
		ring = stat_of(st, n_st, "ring_bytes");
		allocs[round] = stat_of(st, n_st, "device_allocs");
		free(st);
	}
	/* Fresh rows of K and V in each slot: a whole number of slots' worth, F of the n
	 * rows of the pinned ring (ring_bytes, what the session holds: at least the ring). */
	assert_true(zeroed > 0);
	assert_true((uint64_t)zeroed % (2 * F * row) == 0);
	assert_true((uint64_t)zeroed * n <= (uint64_t)ring * F);
	assert_memory_equal(out[0], out[1], layer);
	/* The second session took the first one's blocks: it allocated nothing, and no
	 * device memory was freed on the sessions' path (pooled), only at exit. */
	assert_true(allocs[0] >= 3); /* the pinned ring, the staging, the device block */
	assert_int_equal(allocs[1], 0);
	assert_int_equal(daemon_stat(c, "fuse_device_allocs"), allocs[0]);
	/* and the spares the expiry thread allocated for a next session (see below) */
	assert_int_equal(lines_of(log, "alloc") + lines_of(log, "host_alloc"),
			 allocs[0] + daemon_stat(c, "fuse_device_spares"));
	assert_int_equal(lines_of(log, "free") + lines_of(log, "host_free"), 0);
	/* Every copy to and from the device was from pinned memory (the rotation tables
	 * and spans too, staged), none from the request's frames or the reply. */
	assert_int_equal(lines_of(log, "pageable_upload") + lines_of(log, "pageable_download"),
			 0);
	kvb_close(&c);
	daemon_stop(&d);
	assert_true(lines_of(log, "free") > 0);
	end_two_sessions(&d, log, out, rows);
}

/*
 * A shared ring (the segment the client maps) is pinned for the device once for the
 * segment's life: the owner's second session reuses the segment from the ring cache,
 * pinned already, and pins nothing (ring_registrations 0, one "register" line on
 * the emulated device), nor allocates (device_allocs 0); no copy touches pageable
 * memory. Idle past shm_idle, the cached segment is unpinned ("unregister", after
 * the "register" of the same address) before it is unmapped.
 */
static void test_shared_ring_pinned_once(void **state)
{
	const char *args[] = { "--shm-idle", "3", NULL };
	uint32_t ids[2] = { 8, 2 }, T = 18, F = 2, n = T + F, check = 1;
	double ratio = 0.5, regs[2] = { -1, -1 }, allocs[2] = { -1, -1 };
	size_t row = (size_t)H * D * 2, layer = 2 * (size_t)n * row;
	struct kvb_fuse_params p = { &check, &ratio, 1, KVB_METRIC_VALUE };
	uint8_t *rows = malloc(layer), *out[2];
	struct kvb_segment s[2];
	char log[] = "/tmp/kvb-pin-XXXXXX", line[96], reg[32] = "";
	struct daemon d;
	kvb_client *c;
	FILE *f;

	(void)state;
	make_log(log);
	unsetenv("FAKE_CUDA_LOG");
	setenv("KVBLEND_EMULATED_LOG", log, 1);
	/* shared memory: the ring is a segment it maps */
	c = daemon_start_client(&d, args, &model, 0);
	put_cached_then_fresh(c, ids, T, F, 31, s);
	fill_f16((uint16_t *)rows, layer / 2, 32);
	for (int round = 0; round < 2; round++) {
		kvb_fuse *fu;
		struct kvb_stat *st;
		size_t n_st;
		const void *rk, *rv;

		out[round] = calloc(1, layer);
		assert_int_equal(kvb_fuse_open(c, "xm", s, 2, &p, &fu, NULL, NULL), 0);
		fuse_layers(c, fu, rows, row, out[round], layer);
		assert_int_equal(kvb_fuse_output(fu, &rk, &rv), 0); /* the ring is shared */
		assert_int_equal(kvb_fuse_close(c, &fu, &st, &n_st), 0);
		assert_true(stat_of(st, n_st, "on_device") == 1);
		regs[round] = stat_of(st, n_st, "ring_registrations");
		allocs[round] = stat_of(st, n_st, "device_allocs");
		free(st);
	}
	assert_memory_equal(out[0], out[1], layer);
	assert_true(regs[0] == 1);
	assert_true(regs[1] == 0);
	assert_true(allocs[0] >= 2); /* the staging, the device block */
	assert_true(allocs[1] == 0);
	assert_int_equal(lines_of(log, "register"), 1);
	assert_int_equal(lines_of(log, "unregister"), 0);
	assert_int_equal(lines_of(log, "pageable_upload") + lines_of(log, "pageable_download"),
			 0);
	assert_int_equal(daemon_stat(c, "fuse_device_registrations"), 1);
	assert_int_equal(daemon_stat(c, "fuse_device_pinned_rings"), 1);
	assert_int_equal(daemon_stat(c, "fuse_device_unregistrations"), 0);
	/* Past shm_idle the cached ring is released: unpinned, the address pinned before. */
	for (int i = 0; i < 100 && !lines_of(log, "unregister"); i++)
		usleep(100 * 1000);
	f = fopen(log, "r");
	assert_non_null(f);
	while (fgets(line, sizeof(line), f))
		if (!strncmp(line, "register ", 9))
			assert_int_equal(sscanf(line + 9, "%31s", reg), 1);
	fclose(f);
	assert_true(line_of(log, "register", reg) > 0);
	assert_true(line_of(log, "unregister", reg) > line_of(log, "register", reg));
	assert_int_equal(daemon_stat(c, "fuse_device_unregistrations"), 1);
	assert_int_equal(daemon_stat(c, "fuse_device_pinned_rings"), 0);
	kvb_close(&c);
	daemon_stop(&d);
	assert_int_equal(lines_of(log, "unregister"), 1);
	end_two_sessions(&d, log, out, rows);
}

/*
 * A session's open that had to allocate (the cache had nothing of its shape) makes
 * the expiry thread allocate a spare of each block into the cache, off the sessions'
 * path: a second session of that shape opened while the first is still open
 * allocates nothing on its open (device_allocs 0), and fuses as the first.
 */
static void test_spare_for_next_session(void **state)
{
	uint32_t ids[2] = { 9, 3 }, T = 14, F = 3, n = T + F, check = 1;
	double ratio = 0.5;
	size_t row = (size_t)H * D * 2, layer = 2 * (size_t)n * row;
	struct kvb_fuse_params p = { &check, &ratio, 1, KVB_METRIC_VALUE };
	uint8_t *rows = malloc(layer), *out[2];
	struct kvb_segment s[2];
	kvb_fuse *fu[2];
	double allocs[2];
	struct daemon d;
	kvb_client *c;

	(void)state;
	unsetenv("FAKE_CUDA_LOG");
	unsetenv("KVBLEND_EMULATED_LOG");
	/* the ring is the daemon's: pinned ring, staging, block */
	c = daemon_start_client(&d, NULL, &model, 1);
	put_cached_then_fresh(c, ids, T, F, 41, s);
	fill_f16((uint16_t *)rows, layer / 2, 42);
	assert_int_equal(kvb_fuse_open(c, "xm", s, 2, &p, &fu[0], NULL, NULL), 0);
	for (int i = 0; i < 50 && daemon_stat(c, "fuse_device_spares") < 3; i++)
		usleep(100 * 1000);
	assert_true(daemon_stat(c, "fuse_device_spares") >= 3);
	assert_int_equal(kvb_fuse_open(c, "xm", s, 2, &p, &fu[1], NULL, NULL), 0);
	for (int k = 0; k < 2; k++) {
		struct kvb_stat *st;
		size_t n_st;

		out[k] = calloc(1, layer);
		fuse_layers(c, fu[k], rows, row, out[k], layer);
		assert_int_equal(kvb_fuse_close(c, &fu[k], &st, &n_st), 0);
		allocs[k] = stat_of(st, n_st, "device_allocs");
		free(st);
	}
	assert_true(allocs[0] >= 3);
	assert_true(allocs[1] == 0);
	assert_memory_equal(out[0], out[1], layer);
	kvb_close(&c);
	daemon_stop(&d);
	end_two_sessions(&d, NULL, out, rows);
}

/*
 * With fuse_device_reserve, device and pinned memory are allocated once, at start
 * (one "alloc" and one "host_alloc" on the emulated device), and two sessions open at
 * once carve their blocks from it: neither open allocates (device_allocs 0), nothing
 * is freed until exit, and the reserve is all free again once they closed.
 */
static void test_reserve(void **state)
{
	const char *args[] = { "--fuse-device-reserve", "1M", NULL };
	uint32_t ids[2] = { 9, 4 }, T = 15, F = 2, n = T + F, check = 1;
	double ratio = 0.5, allocs[2];
	size_t row = (size_t)H * D * 2, layer = 2 * (size_t)n * row;
	struct kvb_fuse_params p = { &check, &ratio, 1, KVB_METRIC_VALUE };
	uint8_t *rows = malloc(layer), *out[2];
	char log[] = "/tmp/kvb-reserve-XXXXXX";
	struct kvb_segment s[2];
	kvb_fuse *fu[2];
	struct daemon d;
	kvb_client *c;

	(void)state;
	make_log(log);
	unsetenv("FAKE_CUDA_LOG");
	setenv("KVBLEND_EMULATED_LOG", log, 1);
	daemon_start(&d, args);
	c = daemon_client(&d, 1);
	assert_int_equal(lines_of(log, "alloc"), 1);
	assert_int_equal(lines_of(log, "host_alloc"), 1);
	assert_int_equal(daemon_stat(c, "fuse_device_reserve_bytes"), 1 << 20);
	assert_int_equal(kvb_model_register(c, &model, NULL), 0);
	put_cached_then_fresh(c, ids, T, F, 51, s);
	fill_f16((uint16_t *)rows, layer / 2, 52);
	assert_int_equal(kvb_fuse_open(c, "xm", s, 2, &p, &fu[0], NULL, NULL), 0);
	assert_int_equal(kvb_fuse_open(c, "xm", s, 2, &p, &fu[1], NULL, NULL), 0);
	assert_true(daemon_stat(c, "fuse_device_reserve_used_bytes") > 0);
	assert_true(daemon_stat(c, "fuse_pinned_reserve_used_bytes") > 0);
	for (int k = 0; k < 2; k++) {
		struct kvb_stat *st;
		size_t n_st;

		out[k] = calloc(1, layer);
		fuse_layers(c, fu[k], rows, row, out[k], layer);
		assert_int_equal(kvb_fuse_close(c, &fu[k], &st, &n_st), 0);
		assert_true(stat_of(st, n_st, "on_device") == 1);
		allocs[k] = stat_of(st, n_st, "device_allocs");
		free(st);
	}
	assert_true(allocs[0] == 0);
	assert_true(allocs[1] == 0);
	assert_memory_equal(out[0], out[1], layer);
	assert_int_equal(daemon_stat(c, "fuse_device_reserve_used_bytes"), 0);
	assert_int_equal(daemon_stat(c, "fuse_pinned_reserve_used_bytes"), 0);
	assert_int_equal(daemon_stat(c, "fuse_device_allocs"), 0);
	assert_int_equal(lines_of(log, "alloc") + lines_of(log, "host_alloc"), 2);
	assert_int_equal(lines_of(log, "free") + lines_of(log, "host_free"), 0);
	assert_int_equal(lines_of(log, "pageable_upload") + lines_of(log, "pageable_download"),
			 0);
	kvb_close(&c);
	daemon_stop(&d);
	assert_int_equal(lines_of(log, "free"), 1); /* the reserve, at exit */
	assert_int_equal(lines_of(log, "host_free"), 1);
	end_two_sessions(&d, log, out, rows);
}

/*
 * The placement device auto makes, per session (KVBLEND_EMULATED_AUTO=1 places the
 * emulated device's sessions so): a node that takes its layers in host memory is
 * fused on the CPU path (on_device 0: no layer crosses PCIe twice for it), with the
 * same layers as a device session; a node that maps the device ring (its client
 * called kvb_fuse_device) is fused on the device (on_device 1). Without the hook
 * (device cuda, emulated) both run on the device.
 */
static void test_auto_places_per_session(void **state)
{
	uint32_t ids[2] = { 7, 7 }, T = 16, F = 3, n = T + F, check = 1;
	double ratio = 0.5;
	size_t row = (size_t)H * D * 2, layer = 2 * (size_t)n * row;
	struct kvb_fuse_params p = { &check, &ratio, 1, KVB_METRIC_VALUE };
	uint8_t *rows = malloc(layer), *out[2];
	struct kvb_segment s[2];

	(void)state;
	unsetenv("KVBLEND_EMULATED_LOG");
	unsetenv("FAKE_CUDA_LOG");
	fill_f16((uint16_t *)rows, layer / 2, 22);
	for (int as_auto = 0; as_auto < 2; as_auto++) {
		struct daemon d;
		kvb_client *c;

		if (as_auto)
			setenv("KVBLEND_EMULATED_AUTO", "1", 1);
		c = daemon_start_client(&d, NULL, &model, 1);
		put_cached_then_fresh(c, ids, T, F, 21, s);
		/* Round 0: layers to host memory; round 1: the node maps the device ring. */
		for (int mapped = 0; mapped < 2; mapped++) {
			kvb_fuse *fu;
			struct kvb_stat *st;
			size_t n_st;

			if (mapped)
				assert_int_equal(kvb_fuse_device(c), 0); /* the fake driver */
			out[mapped] = calloc(1, layer);
			assert_int_equal(kvb_fuse_open(c, "xm", s, 2, &p, &fu, NULL, NULL), 0);
			assert_int_equal(kvb_fuse_on_device(fu) != 0, mapped);
			/* Mapped, the layers still come down when asked (k_out given). */
			fuse_layers(c, fu, rows, row, out[mapped], layer);
			assert_int_equal(kvb_fuse_close(c, &fu, &st, &n_st), 0);
			/* device auto: on the device only where the node maps it; else always. */
			assert_true(stat_of(st, n_st, "on_device") == (as_auto ? mapped : 1));
			free(st);
		}
		assert_memory_equal(out[0], out[1], layer);
		free(out[0]);
		free(out[1]);
		daemon_end(&d, &c);
		unsetenv("KVBLEND_EMULATED_AUTO");
	}
	free(rows);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_unmap_before_free),
		cmocka_unit_test(test_zero_only_fresh_rows),
		cmocka_unit_test(test_shared_ring_pinned_once),
		cmocka_unit_test(test_spare_for_next_session),
		cmocka_unit_test(test_reserve),
		cmocka_unit_test(test_expired_export_kept),
		cmocka_unit_test(test_auto_places_per_session),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
