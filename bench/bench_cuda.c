/*
 * bench_cuda — the CUDA backend's fuse kernels on a Mistral-7B-shaped layer (8 KV
 * heads, head_dim 128, f16; 32 layers, r = 0.15, check layer 1, chunks of 512
 * tokens), on device memory:
 *
 *   kernels: per layer, re-rotate K of every chunk, then (check layer) the V
 *   deviation of every token and the top-k, then scatter the fresh K and V rows
 *   of the selection; the time per layer against a device-to-device copy of the
 *   layer's K and V measured in the same run (ratio = copy time / kernel time;
 *   target >= 0.7).
 *
 *   pipelined: stored K and V of each layer uploaded from pinned host memory on
 *   one stream while the kernels of the layer before run on another (a ring of
 *   three layers on the device): fused layers per second, as bytes, against
 *   the host-to-device bandwidth of the same uploads alone (target >= 0.7).
 *
 * It drives the device through blend/'s device table (device.h), opened as the daemon
 * opens it (blend_devices_open), so that --device emulated runs the same code on host
 * memory: a check that the benchmark runs (CI), not a figure. Exits 77 with the
 * reason when the CUDA device is not usable.
 *
 * usage: bench_cuda [--tokens 4096,32768] [--repeats N] [--device N|emulated]
 */
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "bench/bench_common.h"
#include "blend/device.h"
#include "blend/hkvd.h"
#include "blend/rope.h"

#define HEADS 8
#define DIM 128
#define ROW (HEADS * DIM * 2)
#define LAYERS 32
#define CHUNK 512
#define FRESH 32
#define RING 3

static double median(double *v, unsigned n)
{
	qsort(v, n, sizeof(*v), cmp_double);
	return n % 2 ? v[n / 2] : (v[n / 2 - 1] + v[n / 2]) / 2;
}

#define CHECK(call)                                                                        \
	do {                                                                               \
		int rc_ = (call);                                                          \
		if (rc_) {                                                                 \
			char why_[256];                                                    \
			d->last_error(d, why_, sizeof(why_));                              \
			fprintf(stderr, "bench_cuda: %s: %d (%s)\n", #call, rc_, why_);    \
			exit(1);                                                           \
		}                                                                          \
	} while (0)

/* Work queued on waiter from now on waits for what is queued on `on` now (through ev). */
static int stream_wait(const struct blend_device *d, struct blend_stream *waiter,
		       struct blend_stream *on, struct blend_event *ev)
{
	int rc = d->event_record(d, ev, on);

	return rc ? rc : d->event_wait(d, waiter, ev);
}

struct layer_bufs {
	void *k, *v;
};

/* One size's device state: what a layer's kernels read and write besides the layer. */
struct run {
	const struct blend_device *d;
	struct blend_stream *cs; /* the kernels' stream */
	struct blend_shape s;
	unsigned tokens, n_chunks;
	const struct blend_dev_table *tabs; /* one per chunk */
	void *fresh_all, *dev_out, *cand, *always, *sel, *scr, *fk, *fv;
	size_t k, n_sel, scratch, n_sel_out;
};

/* Queue layer l's kernels on b: re-rotate K per chunk; at the check layer (1) the V
 * deviation and the top-k; from it on the scatter of the selected fresh rows. */
static void layer_kernels(struct run *r, unsigned l, struct layer_bufs *b)
{
	const struct blend_device *d = r->d;

	for (unsigned c = 0; c < r->n_chunks; c++) {
		unsigned rows = c + 1 < r->n_chunks ? CHUNK : r->tokens - c * CHUNK;
		uint8_t *kc = (uint8_t *)b->k + (size_t)c * CHUNK * ROW;

		CHECK(d->rotate(d, r->cs, &r->s, &r->tabs[c], kc, kc, rows));
	}
	if (l == 1) {
		CHECK(d->deviation(d, r->cs, &r->s, r->fresh_all, b->v, NULL, r->tokens,
				   r->dev_out));
		CHECK(d->select(d, r->cs, r->cand, r->dev_out, r->tokens - FRESH, r->k, r->always,
				FRESH, r->sel, r->scr, r->scratch, &r->n_sel_out));
	}
	if (l >= 1) {
		CHECK(d->scatter(d, r->cs, &r->s, b->k, r->fk, r->sel, r->n_sel));
		CHECK(d->scatter(d, r->cs, &r->s, b->v, r->fv, r->sel, r->n_sel));
	}
}

int main(int argc, char **argv)
{
	unsigned sizes[8] = { 4096, 32768 }, n_sizes = 2, repeats = 5;
	int which = 0;
	struct blend_devices *devs;
	struct blend_devices_info info;
	const struct blend_device *d;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--repeats") && i + 1 < argc) {
			repeats = (unsigned)atoi(argv[++i]);
		} else if (!strcmp(argv[i], "--device") && i + 1 < argc) {
			i++;
			which = !strcmp(argv[i], "emulated") ? BLEND_DEVICE_EMULATED : atoi(argv[i]);
		} else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) {
			n_sizes = bench_parse_list(argv[++i], sizes, 8);
		} else {
			fprintf(stderr, "usage: bench_cuda [--tokens 4096,32768] [--repeats N] "
					"[--device N|emulated]\n");
			return 2;
		}
	}
	if (!repeats)
		repeats = 1;
	if (blend_devices_open(which, "cpu", NULL, &devs, &info)) {
		printf("bench_cuda: skipped: %s\n", info.line);
		return 77;
	}
	d = info.dev;
	printf("kvblend bench_cuda on %s: %d layers x %d kv heads x head_dim %d f16, r = 0.15, "
	       "check layer 1, chunks of %d tokens, %d fresh; median of %u runs\n\n",
	       which == BLEND_DEVICE_EMULATED ? "the emulated device" : info.model, LAYERS, HEADS, DIM, CHUNK, FRESH, repeats);
	printf("| tokens | kernels ms/layer | D2D copy ms/layer | ratio | pipelined fused GB/s | "
	       "H2D GB/s | ratio |\n|---|---|---|---|---|---|---|\n");
	for (unsigned si = 0; si < n_sizes; si++) {
		unsigned T = sizes[si], n_chunks = (T + CHUNK - 1) / CHUNK;
		size_t plane = (size_t)T * ROW, k = hkvd_count(0.15, T - FRESH);
		size_t n_sel = k + FRESH, scratch = d->select_scratch(d, T);
		struct blend_shape s = { HEADS, DIM, DIM, ROPE_NEOX, BLEND_F16 };
		struct rope_config rc = { .head_dim = DIM, .rotary_dim = DIM, .style = ROPE_NEOX,
					  .theta = 1e6 };
		struct blend_stream *cs, *xs;
		struct blend_event *ev;
		struct layer_bufs ring[RING];
		void *fk, *fv, *fresh_all, *scr, *tab, *dev_out, *cand, *always, *sel, *copy;
		uint16_t *host;
		int32_t *hcand, *halw;
		double *t_kern = calloc(repeats, sizeof(double));
		double *t_copy = calloc(repeats, sizeof(double));
		double *t_pipe = calloc(repeats, sizeof(double));
		double *t_h2d = calloc(repeats, sizeof(double));
		struct blend_dev_table *tabs = calloc(n_chunks, sizeof(*tabs));
		struct run run;

		CHECK(d->stream_new(d, &cs));
		CHECK(d->stream_new(d, &xs));
		CHECK(d->event_new(d, &ev));
		for (int r = 0; r < RING; r++) {
			CHECK(d->alloc(d, plane, &ring[r].k));
			CHECK(d->alloc(d, plane, &ring[r].v));
		}
		CHECK(d->alloc(d, n_sel * ROW, &fk));
		CHECK(d->alloc(d, n_sel * ROW, &fv));
		CHECK(d->alloc(d, plane, &fresh_all));
		CHECK(d->alloc(d, 2 * plane, &copy));
		CHECK(d->alloc(d, scratch ? scratch : 1, &scr));
		CHECK(d->alloc(d, (size_t)T * 4, &dev_out));
		CHECK(d->alloc(d, (size_t)T * 4, &cand));
		CHECK(d->alloc(d, FRESH * 4, &always));
		CHECK(d->alloc(d, (size_t)T * 4, &sel));
		CHECK(d->alloc(d, (size_t)n_chunks * 2 * DIM / 2 * 4, &tab));
		CHECK(d->host_alloc(d, 2 * plane, (void **)&host));
		hcand = malloc((size_t)T * 4);
		halw = malloc(FRESH * 4);
		/* Stored K and V: random f16 of magnitude 2^-2..2^1; candidates are the cached
		 * tokens, the fresh ones the last FRESH. */
		{
			uint64_t x = 88172645463325252ull;

			for (size_t i = 0; i < plane; i++) {
				x ^= x << 13, x ^= x >> 7, x ^= x << 17;
				host[i] = (uint16_t)((x >> 63) << 15 | (13 + (x >> 20 & 3)) << 10 |
						     (x & 0x3ff));
			}
		}
		for (unsigned i = 0; i < T - FRESH; i++)
			hcand[i] = (int32_t)i;
		for (unsigned i = 0; i < FRESH; i++)
			halw[i] = (int32_t)(T - FRESH + i);
		CHECK(d->upload(d, cs, cand, hcand, (size_t)(T - FRESH) * 4));
		CHECK(d->upload(d, cs, always, halw, FRESH * 4));
		for (int r = 0; r < RING; r++) {
			CHECK(d->upload(d, cs, ring[r].k, host, plane));
			CHECK(d->upload(d, cs, ring[r].v, host + plane / 2, plane));
		}
		CHECK(d->upload(d, cs, fresh_all, host + plane / 4, plane));
		/* One rotation table per chunk: post-RoPE keys moved by (new - old), one row. */
		for (unsigned c = 0; c < n_chunks; c++) {
			struct rope_table t;
			float *dc = (float *)tab + (size_t)c * DIM;

			if (rope_table_build(&rc, false, CHUNK, 7 * c, 0, c * CHUNK, T, &t))
				return 1;
			CHECK(d->upload(d, cs, dc, t.cos, DIM / 2 * 4));
			CHECK(d->upload(d, cs, dc + DIM / 2, t.sin, DIM / 2 * 4));
			tabs[c] = (struct blend_dev_table){ dc, dc + DIM / 2, 1, t.scale };
			CHECK(d->stream_sync(d, cs));
			rope_table_free(&t);
		}
		CHECK(d->stream_sync(d, cs));
		run = (struct run){ .d = d, .cs = cs, .s = s, .tokens = T, .n_chunks = n_chunks,
				    .tabs = tabs, .fresh_all = fresh_all, .dev_out = dev_out,
				    .cand = cand, .always = always, .sel = sel, .scr = scr,
				    .fk = fk, .fv = fv, .k = k, .n_sel = n_sel,
				    .scratch = scratch };

		for (unsigned rep = 0; rep < repeats + 1; rep++) {
			double t0;

			/* Kernels alone, on a layer already on the device. */
			t0 = now_s();
			for (unsigned l = 0; l < LAYERS; l++)
				layer_kernels(&run, l, &ring[l % RING]);
			CHECK(d->stream_sync(d, cs));
			if (rep)
				t_kern[rep - 1] = (now_s() - t0) / LAYERS;

			/* The same bytes, device to device. */
			t0 = now_s();
			for (unsigned l = 0; l < LAYERS; l++) {
				struct layer_bufs *b = &ring[l % RING];

				CHECK(d->copy(d, cs, copy, b->k, plane));
				CHECK(d->copy(d, cs, (uint8_t *)copy + plane, b->v, plane));
			}
			CHECK(d->stream_sync(d, cs));
			if (rep)
				t_copy[rep - 1] = (now_s() - t0) / LAYERS;

			/* Host-to-device bandwidth of the layers' uploads alone. */
			t0 = now_s();
			for (unsigned l = 0; l < LAYERS; l++) {
				struct layer_bufs *b = &ring[l % RING];

				CHECK(d->upload(d, xs, b->k, host, plane));
				CHECK(d->upload(d, xs, b->v, host + plane / 2, plane));
			}
			CHECK(d->stream_sync(d, xs));
			if (rep)
				t_h2d[rep - 1] = now_s() - t0;

			/* Pipelined: upload layer l on xs while cs runs layer l - 1's kernels.
			 * Each wait is taken before the other stream's next work is queued: the
			 * upload into layer l's slot waits for the kernels up to layer l - 2 (the
			 * slot's last user was l - 3), the kernels of l - 1 for its upload. */
			t0 = now_s();
			for (unsigned l = 0; l < LAYERS + 1; l++) {
				if (l < LAYERS)
					CHECK(stream_wait(d, xs, cs, ev));
				if (l >= 1)
					CHECK(stream_wait(d, cs, xs, ev));
				if (l >= 1)
					layer_kernels(&run, l - 1, &ring[(l - 1) % RING]);
				if (l < LAYERS) {
					struct layer_bufs *b = &ring[l % RING];

					CHECK(d->upload(d, xs, b->k, host, plane));
					CHECK(d->upload(d, xs, b->v, host + plane / 2, plane));
				}
			}
			CHECK(d->stream_sync(d, cs));
			CHECK(d->stream_sync(d, xs));
			if (rep)
				t_pipe[rep - 1] = now_s() - t0;
		}
		{
			double kern = median(t_kern, repeats), cp = median(t_copy, repeats);
			double h2d = 2.0 * plane * LAYERS / median(t_h2d, repeats) / 1e9;
			double pipe = 2.0 * plane * LAYERS / median(t_pipe, repeats) / 1e9;

			printf("| %u | %.3f | %.3f | %.2fx | %.2f | %.2f | %.2fx |\n", T, kern * 1e3,
			       cp * 1e3, cp / kern, pipe, h2d, pipe / h2d);
		}
		if (run.n_sel_out != n_sel)
			fprintf(stderr, "bench_cuda: selected %zu, expected %zu\n", run.n_sel_out,
				n_sel);
		for (int r = 0; r < RING; r++) {
			d->free(d, ring[r].k, plane);
			d->free(d, ring[r].v, plane);
		}
		d->free(d, fk, n_sel * ROW);
		d->free(d, fv, n_sel * ROW);
		d->free(d, fresh_all, plane);
		d->free(d, copy, 2 * plane);
		d->free(d, scr, scratch ? scratch : 1);
		d->free(d, dev_out, (size_t)T * 4);
		d->free(d, cand, (size_t)T * 4);
		d->free(d, always, FRESH * 4);
		d->free(d, sel, (size_t)T * 4);
		d->free(d, tab, (size_t)n_chunks * DIM * 4);
		d->host_free(d, host);
		d->stream_free(d, cs);
		d->stream_free(d, xs);
		d->event_free(d, ev);
		free(hcand);
		free(halw);
		free(tabs);
		free(t_kern);
		free(t_copy);
		free(t_pipe);
		free(t_h2d);
	}
	blend_devices_close(&devs);
	return 0;
}
