/*
 * bench_quant — quantized storage against storage in the model's dtype, in one
 * run: stored bytes per token, PUT rate (model-dtype bytes per second, the
 * encode included), and the rate at which a landing fuse session delivers
 * fused layers into the node's cache (model-dtype GB/s of the cached tokens'
 * K and V, over the daemon's landing time) with each codec, as a ratio to the
 * model's dtype. Mistral-7B shape (32 layers, 8 KV heads x 128, f16), 8 chunks
 * of 512 tokens + 32 fresh (4K tokens), r = 0.15, check layer 1. Starts its
 * own daemon. The landing runs take turns, one of each store per round, so a
 * slow phase of a shared machine lands on every store alike, not on one.
 *
 * usage: bench_quant [--daemon PATH] [--stores dtype,fp8,int8,int4,int4:128] [--repeats N]
 *                    [--kv FILE.npy]
 *
 * --kv: a real chunk's KV ([layers, 2, T, 8, 128] f16 .npy) instead of
 * synthetic normal values with outlier channels; its first layers are reused
 * for every chunk and layer.
 */
#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "bench/bench_common.h"
#include "common/half.h"
#include "client/include/kvblend.h"

#define L 32
#define H 8
#define D 128
#define ROW (H * D * 2)
#define CHUNKS 8
#define PER 512
#define FRESH 32
#define N (CHUNKS * PER + FRESH)

/* Normal values, every 31st channel 20x larger (the key outlier channels of KIVI). */
static void synth(uint16_t *p, size_t rows, uint64_t seed)
{
	uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;

	for (size_t r = 0; r < rows; r++)
		for (size_t c = 0; c < H * D; c++) {
			double u, v;

			x ^= x << 13, x ^= x >> 7, x ^= x << 17;
			u = ((x >> 11) + 1) / 9007199254740993.0;
			x ^= x << 13, x ^= x >> 7, x ^= x << 17;
			v = (x >> 11) / 9007199254740992.0;
			p[r * H * D + c] = f32_to_f16((float)(sqrt(-2 * log(u)) * cos(6.2831853 * v) *
							      (c % 31 == 7 ? 20 : 1)));
		}
}

/* One store under test: its model, chunks, figures. */
struct store_run {
	char spec[32];
	struct kvb_model m;
	struct kvb_segment segs[CHUNKS + 1];
	double put_s, stored, rates[32];
};

/* Land every layer of r's chunks once; the daemon's landing rate in model-dtype GB/s, or < 0. */
static double land_once(kvb_client *c, struct store_run *r, const struct kvb_kv_layout *y,
			const uint8_t *vplane)
{
	uint32_t check = 1;
	double ratio = 0.15, land_ms = 0;
	struct kvb_fuse_params p = { &check, &ratio, 1, KVB_METRIC_VALUE };
	struct kvb_stat *st = NULL;
	size_t n_st = 0;
	kvb_fuse *fu;

	if (kvb_fuse_open_into(c, r->m.name, r->segs, CHUNKS + 1, &p, y, &fu, NULL, NULL) ||
	    kvb_fuse_check(c, fu, 1, vplane, 0, NULL, NULL) || kvb_fuse_wait(c, fu, L - 1, 60000)) {
		fprintf(stderr, "fuse %s: %s\n", r->spec, kvb_last_error(c));
		return -1;
	}
	kvb_fuse_close(c, &fu, &st, &n_st);
	for (size_t i = 0; i < n_st; i++)
		if (!strcmp(st[i].name, "land_ms"))
			land_ms = st[i].value;
	free(st);
	return (double)(L - 2) * 2 * CHUNKS * PER * ROW / (land_ms / 1e3) / 1e9;
}

int main(int argc, char **argv)
{
	char daemon_path[512], stores[256] = "dtype,fp8,int8,int4,int4:128";
	const char *kv_file = NULL;
	const char *extra[] = { "--shm-max", "4G", "--compress-min-saving", "100", NULL };
	unsigned repeats = 5;
	size_t chunk_bytes = (size_t)L * 2 * PER * ROW, layer_bytes = (size_t)N * ROW, n_runs = 0;
	uint16_t *kv = malloc(chunk_bytes);
	uint8_t *cache, *vplane = malloc(layer_bytes);
	struct store_run runs[8];
	double base_rate = 0, base_bpt = 0;
	struct kvb_kv_layout y;
	kvb_client *c;
	struct daemon d;

	bench_daemon_arg(&argc, argv, daemon_path, sizeof(daemon_path));
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--stores") && i + 1 < argc)
			snprintf(stores, sizeof(stores), "%s", argv[++i]);
		else if (!strcmp(argv[i], "--repeats") && i + 1 < argc)
			repeats = (unsigned)atoi(argv[++i]);
		else if (!strcmp(argv[i], "--kv") && i + 1 < argc)
			kv_file = argv[++i];
		else {
			fprintf(stderr, "usage: bench_quant [--daemon PATH] [--stores dtype,fp8,int8,int4] "
					"[--repeats N] [--kv FILE.npy]\n");
			return 2;
		}
	}
	if (!repeats || repeats > 32)
		repeats = 5;
	if (kv_file) {
		/* a real chunk: [layers, 2, T, 8, 128] f16; tiled over our chunks' rows */
		FILE *f = fopen(kv_file, "rb");
		char hdr[256];
		size_t got;
		uint16_t hlen;

		if (!f || fread(hdr, 1, 10, f) != 10) {
			fprintf(stderr, "bench_quant: cannot read %s\n", kv_file);
			return 1;
		}
		memcpy(&hlen, hdr + 8, 2);
		if (fseek(f, 10 + hlen, SEEK_SET)) {
			fprintf(stderr, "bench_quant: %s: bad header\n", kv_file);
			return 1;
		}
		got = fread(kv, 1, chunk_bytes, f) / 2;
		fclose(f);
		if (!got) {
			fprintf(stderr, "bench_quant: %s: no data\n", kv_file);
			return 1;
		}
		for (size_t i = got; i < chunk_bytes / 2; i++)
			kv[i] = kv[i % got];
	}
	bench_start_daemon(&d, daemon_path, false, extra);
	c = bench_connect(&d, 120000, false);
	cache = kvb_region_alloc(c, 2 * (size_t)L * layer_bytes);
	if (!cache) {
		fprintf(stderr, "region: %s\n", kvb_last_error(c));
		return 1;
	}
	memset(cache, 0, 2 * (size_t)L * layer_bytes);
	y = (struct kvb_kv_layout){ cache, cache + (size_t)L * layer_bytes, layer_bytes, ROW, D * 2,
				    0, 0, NULL, 0 };
	synth((uint16_t *)vplane, N, 99);
	/* Store every codec's chunks first, then land them in turns. */
	for (char *save, *spec = strtok_r(stores, ",", &save); spec && n_runs < 8;
	     spec = strtok_r(NULL, ",", &save)) {
		struct store_run *r = &runs[n_runs];

		memset(r, 0, sizeof(*r));
		snprintf(r->spec, sizeof(r->spec), "%s", spec);
		r->m = (struct kvb_model){ .num_layers = L, .num_kv_heads = H, .head_dim = D,
					   .dtype = KVB_F16, .rope_theta = 1e6 };
		snprintf(r->m.name, sizeof(r->m.name), "bq-%s", spec);
		if (kvb_store_parse(spec, &r->m) || kvb_model_register(c, &r->m, NULL)) {
			fprintf(stderr, "model %s: %s\n", spec, kvb_last_error(c));
			continue;
		}
		for (uint32_t k = 0; k < CHUNKS; k++) {
			uint32_t id[2] = { k, 77 };
			struct kvb_chunk_info info;
			double t;

			if (!kv_file)
				synth(kv, (size_t)L * 2 * PER, 1000 + k);
			kvb_chunk_hash(id, 2, r->segs[k].hash);
			r->segs[k].pos = k * PER;
			t = now_s();
			if (kvb_put(c, r->m.name, r->segs[k].hash, KVB_F16, PER, 0, kv, chunk_bytes,
				    NULL)) {
				fprintf(stderr, "put: %s\n", kvb_last_error(c));
				return 1;
			}
			r->put_s += now_s() - t;
			if (kvb_lookup(c, r->m.name, (const uint8_t(*)[KVB_HASH_LEN])r->segs[k].hash, 1,
				       &info) == 0)
				r->stored += (double)info.stored_bytes;
		}
		r->segs[CHUNKS].fresh = 1;
		r->segs[CHUNKS].count = FRESH;
		r->segs[CHUNKS].pos = CHUNKS * PER;
		n_runs++;
	}
	/* a round before the measured ones maps each store's pages */
	for (unsigned round = 0; round <= repeats; round++)
		for (size_t i = 0; i < n_runs; i++) {
			double rate = land_once(c, &runs[i], &y, vplane);

			if (rate < 0)
				return 1;
			if (round)
				runs[i].rates[round - 1] = rate;
		}
	printf("kvblend bench_quant: %d layers x %d KV heads x %d f16, %d chunks of %d tokens + %d "
	       "fresh, %s KV, landing r = 0.15, median of %u rounds (stores in turn)\n\n", L, H, D,
	       CHUNKS, PER, FRESH, kv_file ? kv_file : "synthetic (outlier channels)", repeats);
	printf("| store | bytes/token (all layers) | vs dtype | PUT GB/s (model dtype) | landed GB/s "
	       "(model dtype) | landed min-max | vs dtype |\n|---|---|---|---|---|---|---|\n");
	for (size_t i = 0; i < n_runs; i++) {
		qsort(runs[i].rates, repeats, sizeof(double), cmp_double);
		if (!strcmp(runs[i].spec, "dtype")) {
			base_bpt = runs[i].stored / (CHUNKS * PER);
			base_rate = runs[i].rates[repeats / 2];
		}
	}
	for (size_t i = 0; i < n_runs; i++) {
		struct store_run *r = &runs[i];
		double bpt = r->stored / (CHUNKS * PER), med = r->rates[repeats / 2];

		printf("| %s | %.0f | %.2fx | %.2f | %.2f | %.1f-%.1f | %s%.2fx |\n", r->spec, bpt,
		       base_bpt ? base_bpt / bpt : 0, (double)CHUNKS * chunk_bytes / r->put_s / 1e9, med,
		       r->rates[0], r->rates[repeats - 1], base_rate ? "" : "n/a ",
		       base_rate ? med / base_rate : 0);
	}
	printf("\nbytes/token: stored bytes of a chunk (K and V of every layer, headers and scales "
	       "included) per token; the model's dtype is %d. PUT: the model-dtype bytes of a chunk "
	       "per second of kvb_put through shared memory (quantizing included). landed: the "
	       "cached tokens' K and V of every landed layer, in the model's dtype, per second of "
	       "the daemon's landing time (read, verify, dequantize, re-rotate, write).\n",
	       2 * L * ROW);
	kvb_close(&c);
	bench_stop_daemon(&d);
	free(kv);
	free(vplane);
	return 0;
}
