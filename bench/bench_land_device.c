/*
 * bench_land_device — landing into another process's device memory (issue 33): this
 * process is the node. Its KV cache is a device allocation in vLLM's GPU layout
 * (paged, 16 tokens a block, each token's K then V per head: LBNHC), exported by
 * its CUDA IPC handle (nodemem.h); a real kvblendd with --device DEV maps it and
 * lands every layer of a reuse-only session of stored chunks there
 * (kvb_fuse_open_into_device). Per size: the landing's GB/s (K and V of the cached
 * tokens, all layers, from the open to the last layer landed, the median of the
 * repeats) against, measured in the same run, a pinned host-to-device copy and a
 * device-to-device copy of the same bytes, and the host landing of the same session
 * into a region of the same layout (kvb_fuse_open_into). Parity: the device cache
 * read back equals the host landing's region byte for byte (printed; a mismatch
 * exits 1). Target on a GPU: landing at least 25 GB/s (half of PCIe 5 x16).
 *
 * Chunks hold f16 values spread as a model's K and V are (the store keeps them raw:
 * bitshuffle+LZ4 saves less than compress_min_saving), or with --compressible 1 values
 * the store compresses (each read then decodes them).
 *
 * usage: bench_land_device [--device cuda|emulated] [--tokens 4096,16384] [--repeats 5]
 *                          [--daemon PATH] [--compressible 0|1]
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <unistd.h>

#include "blend/nodemem.h"
#include "bench/bench_common.h"
#include "client/include/kvblend.h"

#define LAYERS 32
#define HEADS 8
#define HD 128
#define CHUNK 512
#define PT 16
#define ROW ((size_t)HEADS * HD * 2)

static int parity_failed;
static int compressible; /* --compressible: chunks the store keeps bitshuffle+LZ4 */
/* The daemon, stopped at any exit: one left running would hold the pipe a caller
 * reads this program's output through (gpu.sh's tee) open, and the caller waits. */
static struct daemon node_daemon;

static void stop_daemon(void)
{
	if (node_daemon.pid)
		bench_stop_daemon(&node_daemon);
}

/* vLLM's GPU layout over base for tokens (LBNHC), its block table pages (shuffled). */
static struct kvb_kv_layout layout(uint8_t *base, uint32_t tokens, const uint32_t *pages)
{
	uint32_t blocks = (tokens + PT - 1) / PT;
	struct kvb_kv_layout y = { .k = base, .v = base + HD * 2, .token_stride = 2 * ROW,
				   .head_stride = 2 * HD * 2, .page_tokens = PT,
				   .page_stride = (size_t)PT * 2 * ROW, .pages = pages,
				   .n_pages = blocks };

	y.layer_stride = (size_t)blocks * y.page_stride;
	return y;
}

/* One session landed, open to the last layer in place: its seconds. */
static double land_once(kvb_client *c, const struct kvb_segment *segs, size_t ns,
			const struct kvb_kv_layout *y, const struct kvb_device_mem *dm)
{
	kvb_fuse *f = NULL;
	double t0 = now_s(), t;
	int rc = dm ? kvb_fuse_open_into_device(c, "bench", segs, ns, NULL, y, dm, &f, NULL, NULL)
		    : kvb_fuse_open_into(c, "bench", segs, ns, NULL, y, &f, NULL, NULL);

	if (rc) {
		fprintf(stderr, "bench_land_device: open: %s\n", kvb_last_error(c));
		exit(1);
	}
	for (uint32_t l = 0; l < LAYERS; l++)
		if (kvb_fuse_wait(c, f, l, 60000)) {
			fprintf(stderr, "bench_land_device: wait: %s\n", kvb_last_error(c));
			exit(1);
		}
	t = now_s() - t0;
	kvb_fuse_close(c, &f, NULL, NULL);
	return t;
}

/* Seconds of a device copy (d2d) or pinned upload of n bytes on m's device (median of 5). */
static double copy_s(struct nodemem *m, size_t n, int d2d)
{
	const struct blend_device *dv = m->dv;
	double t[5];
	void *src = NULL;
	int rc;

	if (!dv) { /* emulated: host memory both ways */
		uint8_t *a = malloc(n);

		memset(a, 1, n);
		for (int i = 0; i < 5; i++) {
			double t0 = now_s();

			memcpy(m->base, a, n);
			t[i] = now_s() - t0;
		}
		free(a);
		return bench_median(t, 5);
	}
	rc = d2d ? dv->alloc(dv, n, &src) : dv->host_alloc(dv, n, &src);
	if (rc) {
		fprintf(stderr, "bench_land_device: no memory for the reference copy\n");
		exit(1);
	}
	if (!d2d)
		memset(src, 1, n);
	for (int i = 0; i < 5; i++) {
		double t0 = now_s();

		rc = d2d ? dv->copy(dv, m->st, m->base, src, n) : dv->upload(dv, m->st, m->base, src, n);
		if (!rc)
			rc = dv->stream_sync(dv, m->st);
		t[i] = now_s() - t0;
	}
	if (d2d)
		dv->free(dv, src, n);
	else
		dv->host_free(dv, src);
	return bench_median(t, 5);
}

static void run_size(kvb_client *c, const char *which, uint32_t tokens, int repeats)
{
	uint32_t chunks = tokens / CHUNK, blocks = (tokens + PT - 1) / PT;
	size_t layer = (size_t)blocks * PT * 2 * ROW, cache = (size_t)LAYERS * layer;
	size_t bytes = (size_t)LAYERS * 2 * tokens * ROW; /* K and V landed, all layers */
	struct kvb_segment *segs = calloc(chunks, sizeof(*segs));
	uint32_t *pages = malloc(blocks * sizeof(uint32_t));
	struct nodemem m;
	struct kvb_device_mem dm = { 0 };
	struct kvb_kv_layout dy, hy;
	uint8_t *region, *got;
	double *td = malloc(repeats * sizeof(double)), *th = malloc(repeats * sizeof(double));
	double d2d, h2d, land, host;
	char err[256] = "";
	size_t diff = 0;
	int rc;

	for (uint32_t i = 0; i < blocks; i++)
		pages[i] = (uint32_t)(((uint64_t)i * 7919) % blocks); /* 7919 prime: a permutation */
	for (uint32_t i = 0; i < chunks; i++) {
		size_t n = (size_t)LAYERS * 2 * CHUNK * ROW / 2;
		uint16_t *kv = malloc(n * 2);
		uint32_t ids[3] = { 4242, tokens, i };

		for (size_t e = 0; e < n; e++) {
			uint32_t r = (uint32_t)((e + 1) * 2654435761u) ^ (uint32_t)(i * 40503u);

			r ^= r >> 15;
			r *= 2246822519u;
			r ^= r >> 13;
			if (compressible) /* small magnitudes: 4 bits of 16 constant */
				kv[e] = (uint16_t)(0x3000 | (r & 0x0fff));
			else /* a sign, exponents over 16 values, a full mantissa: as a model's
			      * K and V, which bitshuffle+LZ4 shrinks too little to keep */
				kv[e] = (uint16_t)((r & 0x83ff) | (8 + (r >> 16) % 16) << 10);
		}
		kvb_chunk_hash(ids, 3, segs[i].hash);
		segs[i].pos = i * CHUNK;
		if (kvb_put(c, "bench", segs[i].hash, KVB_F16, CHUNK, 0, kv, n * 2, NULL)) {
			fprintf(stderr, "bench_land_device: put: %s\n", kvb_last_error(c));
			exit(1);
		}
		free(kv);
	}
	rc = nodemem_open(&m, which, cache, err, sizeof(err));
	if (rc) {
		fprintf(stderr, "bench_land_device: %s\n", err);
		exit(rc == 77 ? 77 : 1);
	}
	/* emulated: the memfd handed to the daemon, which names it by the handle */
	if (!m.dv && kvb_device_handle_from_fd(c, m.fd, m.handle)) {
		fprintf(stderr, "bench_land_device: %s\n", kvb_last_error(c));
		exit(1);
	}
	region = kvb_region_alloc(c, cache + 4096);
	got = malloc(cache);
	if (!region || !got) {
		fprintf(stderr, "bench_land_device: no region of %zu bytes: %s\n", cache,
			kvb_last_error(c));
		exit(1);
	}
	dm.base = m.base;
	dm.bytes = m.bytes;
	memcpy(dm.ipc_handle, m.handle, sizeof(dm.ipc_handle));
	memcpy(dm.pci, m.pci, sizeof(dm.pci));
	dm.progress = region + cache;
	dy = layout(m.base, tokens, pages);
	hy = layout(region, tokens, pages);
	for (int r = 0; r < repeats; r++) {
		th[r] = land_once(c, segs, chunks, &hy, NULL);
		td[r] = land_once(c, segs, chunks, &dy, &dm);
	}
	if (nodemem_read(&m, 0, got, cache)) {
		fprintf(stderr, "bench_land_device: cannot read the device cache back\n");
		exit(1);
	}
	for (size_t i = 0; i < cache; i++)
		diff += got[i] != region[i];
	parity_failed |= diff != 0;
	land = bench_median(td, repeats);
	host = bench_median(th, repeats);
	h2d = copy_s(&m, bytes, 0);
	d2d = copy_s(&m, bytes, 1);
	printf("| %u | %u | %.1f | %.2f | %.2f | %.2f | %.2fx | %.2f | %.2fx | %.2f | %.2fx | %s |\n",
	       tokens, chunks, bytes / 1048576.0, land * 1e3, bytes / land / 1e9,
	       bytes / h2d / 1e9, h2d / land, bytes / d2d / 1e9, d2d / land, bytes / host / 1e9,
	       host / land, diff ? "DIFFERS" : "byte for byte");
	if (diff)
		printf("  parity: %zu of %zu bytes differ from the host landing\n", diff, cache);
	fflush(stdout);
	kvb_region_free(c, region);
	nodemem_close(&m);
	free(got);
	free(segs);
	free(pages);
	free(td);
	free(th);
}

int main(int argc, char **argv)
{
	const char *which = "cuda";
	char daemon_path[512], list[256] = "4096,16384";
	unsigned sizes[16];
	unsigned n_sizes;
	int repeats = 5;
	kvb_client *c;
	struct kvb_model model = { .name = "bench", .num_layers = LAYERS, .num_kv_heads = HEADS,
				   .head_dim = HD, .dtype = KVB_F16, .rope_theta = 1000000 };

	bench_daemon_arg(&argc, argv, daemon_path, sizeof(daemon_path));
	for (int i = 1; i + 1 < argc; i += 2) {
		if (!strcmp(argv[i], "--device"))
			which = argv[i + 1];
		else if (!strcmp(argv[i], "--tokens"))
			snprintf(list, sizeof(list), "%s", argv[i + 1]);
		else if (!strcmp(argv[i], "--repeats"))
			repeats = atoi(argv[i + 1]);
		else if (!strcmp(argv[i], "--compressible") && !strcmp(argv[i + 1], "1"))
			compressible = 1;
		else if (!strcmp(argv[i], "--compressible") && !strcmp(argv[i + 1], "0"))
			compressible = 0;
		else {
			fprintf(stderr, "usage: bench_land_device [--device cuda|emulated] "
				"[--tokens N,...] [--repeats N] [--daemon PATH] [--compressible 0|1]\n");
			return 2;
		}
	}
	n_sizes = bench_parse_list(list, sizes, 16);
	if (repeats < 1 || !n_sizes) {
		fprintf(stderr, "bench_land_device: bad arguments\n");
		return 2;
	}
	{
		/* the host landing's region spans the whole cache: 2 GiB at 16K tokens */
		const char *extra[] = { "--device", which, "--shm-max", "16G", "--shm-total", "32G",
					NULL };

		bench_start_daemon(&node_daemon, daemon_path, false, extra);
		atexit(stop_daemon);
	}
	c = bench_connect(&node_daemon, 0, false);
	if (kvb_model_register(c, &model, NULL)) {
		fprintf(stderr, "bench_land_device: model: %s\n", kvb_last_error(c));
		return 1;
	}
	printf("kvblend bench_land_device: %d layers x %d kv heads x head_dim %d f16, chunks of %d "
	       "tokens, vLLM's GPU layout (blocks of %d tokens, K then V per head), reuse only; "
	       "device %s; median of %d; chunks %s\n\n", LAYERS, HEADS, HD, CHUNK, PT, which,
	       repeats, compressible ? "compressible (stored bitshuffle+LZ4)"
				     : "as a model's KV (stored raw: compression saves too little)");
	printf("| tokens | chunks | MiB landed | land ms | land GB/s | H2D GB/s | land / H2D | "
	       "D2D GB/s | land / D2D | host landing GB/s | device / host | parity |\n");
	printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
	for (unsigned i = 0; i < n_sizes; i++)
		run_size(c, which, sizes[i], repeats);
	printf("\nland GB/s: K and V of every cached token of every layer, from the open to the "
	       "last layer in place (kvb_fuse_wait), into the node's device allocation. H2D: a "
	       "pinned host-to-device copy of the same bytes; D2D: a device-to-device copy (on "
	       "the emulated device both are memcpy). Host landing: the same session into a "
	       "region of the same layout (the CPU path). Target on a GPU: land >= 25 GB/s.\n");
	kvb_close(&c);
	stop_daemon();
	return parity_failed ? 1 : 0;
}
