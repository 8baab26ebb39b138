/*
 * bench_fuse — fuse throughput of kvblendd over IPC for a Mistral-7B-shaped
 * model (32 layers, 8 KV heads, head_dim 128, f16) at 1K, 4K and 8K tokens,
 * r = 0.15, 4-8 stored chunks plus 32 fresh tokens: fused bytes per second and
 * its ratio to memcpy of the same bytes in the same run, the per-layer time
 * the node waits, and the daemon's own time per layer. Starts its own daemon.
 *
 * usage: bench_fuse [--daemon PATH] [--tokens 1024,4096,8192] [--repeats N] [--node-ms MS]
 *                   [--device auto|cpu|cuda[:N]|emulated] [--on-device] [--reserve SIZE]
 *
 * --node-ms: the node's own work per layer (its recompute of the selected
 * tokens), simulated by a sleep between layer calls; the daemon's loads run
 * meanwhile, as they would next to a real GPU. Only the layer calls are timed.
 * --device: where the daemon's fuse computes (its --device; default auto). With
 * cuda, the host-to-device bandwidth of the same bytes (pinned, one stream) is
 * measured in the same run, and fused layers per second are given against it.
 * --on-device: the in-place runs take the fused layers on the GPU (CUDA IPC,
 * kvb_fuse_device()) instead of the shared ring. --reserve: the daemon's
 * --fuse-device-reserve (sessions' blocks carved from memory reserved at start).
 */
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench/bench_common.h"
#include "blend/device.h"
#include "client/include/kvblend.h"

static const struct kvb_model model = { .name = "bench-mistral", .num_layers = 32,
					.num_kv_heads = 8, .head_dim = 128, .dtype = KVB_F16,
					.rope_theta = 1e6 };
#define ROW (8 * 128 * 2)
#define FRESH 32

/* CPU seconds (user and system) process pid has used, from /proc; 0 if unreadable. */
static double cpu_seconds(pid_t pid)
{
	char path[64], buf[1024], *p;
	unsigned long long ut = 0, stt = 0;
	FILE *f;
	size_t n;

	snprintf(path, sizeof(path), "/proc/%d/stat", (int)pid);
	f = fopen(path, "r");
	if (!f)
		return 0;
	n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = 0;
	p = strrchr(buf, ')'); /* the name may hold spaces: fields 3.. follow its ')' */
	if (!p || sscanf(p + 2, "%*c %*d %*d %*d %*d %*d %*u %*u %*u %*u %*u %llu %llu", &ut,
			 &stt) != 2)
		return 0;
	return (double)(ut + stt) / (double)sysconf(_SC_CLK_TCK);
}

/*
 * Host-to-device bandwidth on CUDA device `ordinal` (opened through blend/'s device
 * table, as the daemon opens it): `count` copies of `bytes` from pinned memory on one
 * stream, GB/s; 0 when there is no device (why on stderr).
 */
static double h2d_gbps(int ordinal, size_t bytes, unsigned count)
{
	struct blend_devices *devs = NULL;
	struct blend_devices_info info;
	const struct blend_device *d;
	struct blend_stream *st = NULL;
	void *host = NULL, *dev = NULL;
	double t = 0;
	int rc = blend_devices_open(ordinal, "cpu", NULL, &devs, &info);

	if (rc) {
		fprintf(stderr, "bench_fuse: no host-to-device reference: %s\n", info.line);
		return 0;
	}
	d = info.dev;
	rc = d->stream_new(d, &st);
	if (!rc)
		rc = d->host_alloc(d, bytes, &host);
	if (!rc)
		rc = d->alloc(d, bytes, &dev);
	if (!rc) {
		memset(host, 1, bytes);
		rc = d->upload(d, st, dev, host, bytes) || d->stream_sync(d, st);
	}
	if (!rc) {
		t = now_s();
		for (unsigned i = 0; i < count && !rc; i++)
			rc = d->upload(d, st, dev, host, bytes);
		rc = rc || d->stream_sync(d, st);
		t = now_s() - t;
	}
	if (st)
		d->stream_free(d, st);
	if (dev)
		d->free(d, dev, bytes);
	if (host)
		d->host_free(d, host);
	blend_devices_close(&devs);
	return rc || t <= 0 ? 0 : (double)bytes * count / t / 1e9;
}

int main(int argc, char **argv)
{
	char daemon_path[512];
	unsigned sizes[8] = { 1024, 4096, 8192 }, n_sizes = 3, repeats = 3;
	double node_ms = 0;
	bool on_device = false;
	int cuda = -1; /* the daemon's CUDA device, for the host-to-device reference */
	/* the daemon's --device, and --fuse-device-reserve when asked */
	const char *device[5] = { "--device", "auto", NULL, NULL, NULL };
	kvb_client *c;
	struct daemon d;

	bench_daemon_arg(&argc, argv, daemon_path, sizeof(daemon_path));
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--node-ms") && i + 1 < argc) {
			node_ms = atof(argv[++i]);
		} else if (!strcmp(argv[i], "--repeats") && i + 1 < argc) {
			repeats = (unsigned)atoi(argv[++i]);
		} else if (!strcmp(argv[i], "--device") && i + 1 < argc) {
			device[1] = argv[++i];
			if (!strncmp(device[1], "cuda", 4))
				cuda = device[1][4] == ':' ? atoi(device[1] + 5) : 0;
		} else if (!strcmp(argv[i], "--on-device")) {
			on_device = true;
		} else if (!strcmp(argv[i], "--reserve") && i + 1 < argc) {
			device[2] = "--fuse-device-reserve";
			device[3] = argv[++i];
		} else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) {
			n_sizes = bench_parse_list(argv[++i], sizes, 8);
		} else {
			fprintf(stderr, "usage: bench_fuse [--daemon PATH] [--tokens 1024,4096,8192] "
					"[--repeats N] [--node-ms MS] [--device D] [--on-device] "
					"[--reserve SIZE]\n");
			return 2;
		}
	}
	bench_start_daemon(&d, daemon_path, false, device);
	c = bench_connect(&d, 120000, false);
	if (kvb_model_register(c, &model, NULL)) {
		fprintf(stderr, "bench_fuse: model: %s\n", kvb_last_error(c));
		bench_stop_daemon(&d);
		return 1;
	}
	if (on_device && kvb_fuse_device(c)) {
		fprintf(stderr, "bench_fuse: --on-device: %s\n", kvb_last_error(c));
		kvb_close(&c);
		bench_stop_daemon(&d);
		return 1;
	}
	{
		/* The backend the daemon picked for --device (its stats say backend_NAME). */
		struct kvb_stat *st = NULL;
		size_t n_st = 0;
		const char *be = "?";

		if (!kvb_stats(c, &st, &n_st))
			for (size_t i = 0; i < n_st; i++)
				if (!strncmp(st[i].name, "backend_", 8))
					be = st[i].name + 8;
		printf("kvblend bench_fuse: %u layers x %u kv heads x head_dim %u f16, r = 0.15, "
		       "check layer 1, %d fresh tokens, node work %.1f ms per layer, median of %u "
		       "runs; device %s, backend %s; in place: %s\n\n",
		       model.num_layers, model.num_kv_heads, model.head_dim, FRESH, node_ms, repeats,
		       device[1], be, on_device ? "on the GPU (CUDA IPC)" : "the shared ring");
		free(st);
	}
	printf("| tokens | chunks | selected | fused GB/s in place | ratio | fused GB/s copied out | "
	       "ratio | memcpy GB/s | layer wait ms (memcpy of its bytes ms) | daemon merge "
	       "ms/layer | daemon load ms/layer | H2D GB/s | in place / H2D | open ms | daemon CPU "
	       "ms/layer | on device | allocs per open (first; later) | pins per open (first; "
	       "later) |\n");
	printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
	for (unsigned si = 0; si < n_sizes; si++) {
		unsigned n_tokens = sizes[si], n_chunks = n_tokens >= 4096 ? 8 : 4;
		unsigned cached = n_tokens - FRESH, per = cached / n_chunks;
		struct kvb_segment *segs = calloc(n_chunks + 1, sizeof(*segs));
		size_t layer_bytes = (size_t)n_tokens * ROW, chunk_bytes;
		uint16_t *fresh_kv = malloc(2 * layer_bytes);
		uint8_t *kin = malloc(layer_bytes), *vin = malloc(layer_bytes);
		uint8_t *kout = malloc(layer_bytes), *vout = malloc(layer_bytes);
		double *rates = calloc(repeats, sizeof(double)), *waits = calloc(repeats, sizeof(double));
		double *rates_copy = calloc(repeats, sizeof(double));
		double *memcpys = calloc(repeats, sizeof(double)), merge_ms = 0, load_ms = 0;
		double *opens = calloc(2 * repeats, sizeof(double)), cpu0, on_dev = -1;
		/* the close's device_allocs and ring_registrations: first session, the rest */
		double allocs[2] = { -1, 0 }, pins[2] = { -1, 0 };
		char pool_cols[96] = "– | –";
		unsigned all_layers = 0;
		double h2d = cuda >= 0 ? h2d_gbps(cuda, 2 * layer_bytes, model.num_layers) : 0;
		char h2d_cols[64] = "– | –";
		size_t n_sel = 0;
		unsigned pos = 0;

		/* Store the chunks (the last takes the remainder). */
		for (unsigned k = 0; k < n_chunks; k++) {
			unsigned t = k + 1 < n_chunks ? per : cached - per * (n_chunks - 1);
			uint32_t id[2] = { n_tokens, k };
			uint16_t *kv;

			chunk_bytes = (size_t)model.num_layers * 2 * t * ROW;
			kv = malloc(chunk_bytes);
			fill_f16(kv, chunk_bytes / 2, 100 * n_tokens + k);
			kvb_chunk_hash(id, 2, segs[k].hash);
			if (kvb_put(c, model.name, segs[k].hash, KVB_F16, t, 0, kv, chunk_bytes, NULL))
				fprintf(stderr, "put: %s\n", kvb_last_error(c));
			free(kv);
			segs[k].pos = pos;
			pos += t;
		}
		segs[n_chunks].fresh = 1;
		segs[n_chunks].count = FRESH;
		segs[n_chunks].pos = pos;
		fill_f16(fresh_kv, layer_bytes, 7);
		cpu0 = cpu_seconds(d.pid);
		for (unsigned r = 0; r < 2 * repeats; r++) {
			/* even runs: fused layers read in place (shared ring); odd: copied out */
			bool copy_out = r % 2;
			uint32_t check = 1;
			double ratio = 0.15, t0, t_layers = 0, t_mem;
			struct kvb_fuse_params p = { &check, &ratio, 1, KVB_METRIC_VALUE };
			struct kvb_stat *st;
			size_t n_st, fused_bytes = 0;
			unsigned layers = 0;
			kvb_fuse *fu;

			t0 = now_s();
			if (kvb_fuse_open(c, model.name, segs, n_chunks + 1, &p, &fu, NULL, NULL)) {
				fprintf(stderr, "fuse_open: %s\n", kvb_last_error(c));
				break;
			}
			opens[r] = (now_s() - t0) * 1e3;
			/* The node prefills layer 0 itself meanwhile; the daemon loads ahead. */
			usleep(2000);
			t0 = now_s();
			for (uint32_t l = 1; l < model.num_layers; l++) {
				const int32_t *rows;
				size_t nr = kvb_fuse_rows(fu, &rows);
				int fused = 0;
				double tl;

				for (size_t i = 0; i < nr; i++) {
					memcpy(kin + i * ROW, (uint8_t *)fresh_kv + (size_t)rows[i] * ROW, ROW);
					memcpy(vin + i * ROW,
					       (uint8_t *)fresh_kv + layer_bytes + (size_t)rows[i] * ROW, ROW);
				}
				if (node_ms > 0)
					usleep((useconds_t)(node_ms * 1000));
				tl = now_s();
				if (kvb_fuse_layer(c, fu, l, kin, vin, copy_out ? kout : NULL,
						   copy_out ? vout : NULL, &fused)) {
					fprintf(stderr, "fuse_layer: %s\n", kvb_last_error(c));
					break;
				}
				if (fused) {
					t_layers += now_s() - tl;
					fused_bytes += 2 * layer_bytes;
					layers++;
				}
			}
			(void)t0;
			n_sel = kvb_fuse_rows(fu, NULL);
			kvb_fuse_close(c, &fu, &st, &n_st);
			for (size_t i = 0; i < n_st; i++) {
				if (!strcmp(st[i].name, "compute_ms"))
					merge_ms = st[i].value / (model.num_layers - 1);
				if (!strcmp(st[i].name, "load_ms"))
					load_ms = st[i].value / (model.num_layers - 1);
				if (!strcmp(st[i].name, "on_device"))
					on_dev = st[i].value;
				if (!strcmp(st[i].name, "device_allocs"))
					allocs[r > 0] = r ? allocs[1] + st[i].value : st[i].value;
				if (!strcmp(st[i].name, "ring_registrations"))
					pins[r > 0] = r ? pins[1] + st[i].value : st[i].value;
			}
			all_layers += model.num_layers - 1;
			free(st);
			/* memcpy of the same bytes: each fused layer's K and V once */
			t_mem = now_s();
			for (unsigned l = 0; l < layers; l++) {
				memcpy(kout, kin, layer_bytes);
				memcpy(vout, vin, layer_bytes);
			}
			t_mem = now_s() - t_mem;
			if (copy_out) {
				rates_copy[r / 2] = fused_bytes / t_layers / 1e9;
				continue;
			}
			rates[r / 2] = fused_bytes / t_layers / 1e9;
			memcpys[r / 2] = fused_bytes / t_mem / 1e9;
			waits[r / 2] = t_layers / layers * 1e3;
		}
		qsort(rates_copy, repeats, sizeof(double), cmp_double);
		qsort(rates, repeats, sizeof(double), cmp_double);
		qsort(memcpys, repeats, sizeof(double), cmp_double);
		qsort(waits, repeats, sizeof(double), cmp_double);
		qsort(opens, 2 * repeats, sizeof(double), cmp_double);
		cpu0 = cpu_seconds(d.pid) - cpu0;
		if (h2d > 0)
			snprintf(h2d_cols, sizeof(h2d_cols), "%.2f | %.2fx", h2d,
				 rates[repeats / 2] / h2d);
		if (allocs[0] >= 0)
			snprintf(pool_cols, sizeof(pool_cols), "%.0f; %.2f | %.0f; %.2f", allocs[0],
				 allocs[1] / (2 * repeats - 1), pins[0], pins[1] / (2 * repeats - 1));
		printf("| %u | %u | %zu | %.2f | %.2fx | %.2f | %.2fx | %.2f | %.3f (%.3f) | %.3f | %.3f "
		       "| %s | %.2f | %.3f | %s | %s |\n",
		       n_tokens, n_chunks, n_sel, rates[repeats / 2],
		       rates[repeats / 2] / memcpys[repeats / 2], rates_copy[repeats / 2],
		       rates_copy[repeats / 2] / memcpys[repeats / 2], memcpys[repeats / 2],
		       waits[repeats / 2], 2 * layer_bytes / memcpys[repeats / 2] / 1e6, merge_ms,
		       load_ms, h2d_cols, opens[repeats], all_layers ? cpu0 * 1e3 / all_layers : 0,
		       on_dev < 0 ? "–" : on_dev > 0 ? "yes" : "no", pool_cols);
		fflush(stdout);
		free(segs);
		free(fresh_kv);
		free(kin);
		free(vin);
		free(kout);
		free(vout);
		free(rates);
		free(waits);
		free(memcpys);
		free(rates_copy);
		free(opens);
	}
	printf("\nfused GB/s: K and V of all tokens delivered to the node per second of layer "
	       "calls; in place: read where the daemon fused them (kvb_fuse_output(), the shared "
	       "ring); copied out: into the node's own buffers. Ratios are to memcpy of the same "
	       "bytes in this run. Layer wait: one layer call as the node sees it (sending the selected "
	       "rows, merging, receiving all rows); daemon merge/load: the daemon's own time per "
	       "layer, load (read, decode, re-rotate) overlapped with the node's work by the "
	       "prefetch ring. H2D: with --device cuda, pinned host-to-device copies of a layer's K "
	       "and V on one stream in this run (target: in place >= 0.7x of it). Open: one "
	       "kvb_fuse_open() as the node sees it (median). Daemon CPU: the daemon's user and "
	       "system CPU time over the size's runs per layer served (threads that spin waiting "
	       "for a device show here). On device: where the daemon computed the session "
	       "(FUSE_CLOSE's on_device). Allocs and pins per open: device and pinned blocks the "
	       "session's open allocated (its pools had none to give) and shared rings it pinned "
	       "(cudaHostRegister), for the size's first session and on average for the later ones "
	       "(FUSE_CLOSE's device_allocs and ring_registrations; the goal is 0 for the later "
	       "ones: pooled, pinned once per segment).\n");
	kvb_close(&c);
	bench_stop_daemon(&d);
	return 0;
}
