/*
 * bench_stats — what a STATS costs, and what STATS in flight cost everyone else.
 * Starts its own kvblendd, stores small chunks, and prints:
 *   - STATS latency (median, p99) at SMALL and at LARGE chunks, and their ratio
 *     (1.0 when STATS costs the same at any store size);
 *   - a GET's latency (median, p99) at LARGE chunks with no STATS in flight, with
 *     16 clients sending STATS back to back, and with 16 sending PINGs (the
 *     cheapest request: what any flood of requests costs a GET), and the ratios.
 * No pass/fail: figures and ratios measured in the same run.
 *
 * usage: bench_stats [--daemon PATH] [--small N] [--large N] [--reps N] [--gets N]
 *                    [--loaders N]
 */
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_common.h"

/* One token, one layer, one head of 16 f16: 64 bytes of K and V per chunk. */
static const struct kvb_model model = { .name = "bench_stats", .num_layers = 1, .num_kv_heads = 1,
					.head_dim = 16, .dtype = KVB_F16, .rope_theta = 10000 };
#define KV_BYTES 64

static void hash_of(uint32_t i, uint8_t h[KVB_HASH_LEN])
{
	uint32_t ids[2] = { i, 0x5eed };

	kvb_chunk_hash(ids, 2, h);
}

static void die(kvb_client *c, const char *what)
{
	fprintf(stderr, "bench_stats: %s: %s\n", what, c ? kvb_last_error(c) : "failed");
	exit(1);
}

/* Store chunks [from, to). */
static void fill_store(kvb_client *c, uint32_t from, uint32_t to)
{
	uint8_t kv[KV_BYTES], h[KVB_HASH_LEN];

	for (uint32_t i = from; i < to; i++) {
		for (int b = 0; b < KV_BYTES; b++)
			kv[b] = (uint8_t)(i * 31 + b);
		hash_of(i, h);
		if (kvb_put(c, model.name, h, KVB_F16, 1, 0, kv, sizeof(kv), NULL))
			die(c, "put");
	}
}

struct lat {
	double median_ms, p99_ms;
};

static struct lat summarize(double *t, int n)
{
	qsort(t, (size_t)n, sizeof(*t), cmp_double);
	return (struct lat){ t[n / 2] * 1e3, t[(int)(n * 0.99)] * 1e3 };
}

static struct lat time_stats(kvb_client *c, int reps)
{
	double *t = calloc((size_t)reps, sizeof(*t));
	struct lat l;

	for (int i = 0; i < reps + 5; i++) {
		struct kvb_stat *s;
		size_t n;
		double t0 = now_s();

		if (kvb_stats(c, &s, &n))
			die(c, "stats");
		if (i >= 5) /* the first few warm up */
			t[i - 5] = now_s() - t0;
		free(s);
	}
	l = summarize(t, reps);
	free(t);
	return l;
}

static struct lat time_gets(kvb_client *c, int gets, uint32_t chunks)
{
	double *t = calloc((size_t)gets, sizeof(*t));
	uint8_t out[KV_BYTES], h[KVB_HASH_LEN];
	uint64_t x = 88172645463325252ull;
	struct lat l;

	for (int i = 0; i < gets; i++) {
		double t0;

		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		hash_of((uint32_t)(x % chunks), h);
		t0 = now_s();
		if (kvb_get(c, model.name, h, 0, 0, out, sizeof(out), NULL))
			die(c, "get");
		t[i] = now_s() - t0;
	}
	l = summarize(t, gets);
	free(t);
	return l;
}

struct loader {
	pthread_t th;
	const char *ep;
	atomic_int *stop;
	int ping; /* send PINGs (the cheapest request) instead: the peer to compare with */
	uint64_t done;
};

static void *stats_loop(void *arg)
{
	struct loader *ld = arg;
	kvb_client *c = NULL;

	if (kvb_connect(ld->ep, NULL, &c, NULL, 0))
		die(NULL, "connect");
	while (!atomic_load(ld->stop)) {
		struct kvb_stat *s;
		size_t n;

		if (ld->ping) {
			if (kvb_ping(c, NULL, 0))
				die(c, "ping (load)");
		} else {
			if (kvb_stats(c, &s, &n))
				die(c, "stats (load)");
			free(s);
		}
		ld->done++;
	}
	kvb_close(&c);
	return NULL;
}

/* GETs while `loaders` clients send STATS (or PINGs) back to back; their rate into *rate. */
static struct lat time_loaded(kvb_client *c, const char *ep, struct loader *ld, unsigned loaders,
			      int ping, int gets, uint32_t chunks, double *rate)
{
	atomic_int stop = 0;
	uint64_t done = 0;
	struct lat l;
	double t0;

	for (unsigned i = 0; i < loaders; i++) {
		ld[i] = (struct loader){ .ep = ep, .stop = &stop, .ping = ping };
		pthread_create(&ld[i].th, NULL, stats_loop, &ld[i]);
	}
	usleep(200000); /* the loaders connected and busy */
	t0 = now_s();
	l = time_gets(c, gets, chunks);
	*rate = now_s() - t0;
	atomic_store(&stop, 1);
	for (unsigned i = 0; i < loaders; i++) {
		pthread_join(ld[i].th, NULL);
		done += ld[i].done;
	}
	*rate = done / *rate;
	return l;
}

int main(int argc, char **argv)
{
	unsigned small = 1000, large = 100000, reps = 200, gets = 2000, loaders = 16;
	char daemon[512];
	struct lat st_small, st_large, get_idle, get_busy, get_ping;
	struct loader *ld;
	kvb_client *c = NULL;
	double t0, stats_rate, ping_rate;
	struct daemon d;

	bench_daemon_arg(&argc, argv, daemon, sizeof(daemon));
	for (int i = 1; i + 1 < argc; i += 2) {
		if (!strcmp(argv[i], "--small"))
			small = (unsigned)atoi(argv[i + 1]);
		else if (!strcmp(argv[i], "--large"))
			large = (unsigned)atoi(argv[i + 1]);
		else if (!strcmp(argv[i], "--reps"))
			reps = (unsigned)atoi(argv[i + 1]);
		else if (!strcmp(argv[i], "--gets"))
			gets = (unsigned)atoi(argv[i + 1]);
		else if (!strcmp(argv[i], "--loaders"))
			loaders = (unsigned)atoi(argv[i + 1]);
	}
	if (!small || large < small || reps < 10 || gets < 100) {
		fprintf(stderr, "usage: bench_stats [--daemon PATH] [--small N] [--large N] "
				"[--reps N>=10] [--gets N>=100] [--loaders N]\n");
		return 2;
	}
	bench_start_daemon(&d, daemon, false, NULL);
	c = bench_connect(&d, 0, false);
	if (kvb_model_register(c, &model, NULL))
		die(c, "model");

	fill_store(c, 0, small);
	st_small = time_stats(c, (int)reps);
	t0 = now_s();
	fill_store(c, small, large);
	fprintf(stderr, "bench_stats: %u chunks stored in %.1f s\n", large - small, now_s() - t0);
	st_large = time_stats(c, (int)reps);

	get_idle = time_gets(c, (int)gets, large);
	ld = calloc(loaders ? loaders : 1, sizeof(*ld));
	get_busy = time_loaded(c, d.endpoint, ld, loaders, 0, (int)gets, large, &stats_rate);
	get_ping = time_loaded(c, d.endpoint, ld, loaders, 1, (int)gets, large, &ping_rate);

	printf("daemon: %s\n", daemon);
	printf("%-36s %12s %12s\n", "", "median ms", "p99 ms");
	printf("STATS at %-9u chunks %17.3f %12.3f\n", small, st_small.median_ms, st_small.p99_ms);
	printf("STATS at %-9u chunks %17.3f %12.3f\n", large, st_large.median_ms, st_large.p99_ms);
	printf("GET, no STATS in flight %25.3f %12.3f\n", get_idle.median_ms, get_idle.p99_ms);
	printf("GET, %2u clients sending STATS %19.3f %12.3f\n", loaders, get_busy.median_ms,
	       get_busy.p99_ms);
	printf("GET, %2u clients sending PING %20.3f %12.3f\n", loaders, get_ping.median_ms,
	       get_ping.p99_ms);
	printf("STATS latency ratio %u / %u chunks: %.2fx\n", large, small,
	       st_large.median_ms / st_small.median_ms);
	printf("GET under STATS load / idle: median %.2fx, p99 %.2fx (%.0f STATS/s served meanwhile)\n",
	       get_busy.median_ms / get_idle.median_ms, get_busy.p99_ms / get_idle.p99_ms,
	       stats_rate);
	printf("GET under STATS load / under PING load (the cheapest request): median %.2fx, "
	       "p99 %.2fx (%.0f PING/s)\n", get_busy.median_ms / get_ping.median_ms,
	       get_busy.p99_ms / get_ping.p99_ms, ping_rate);
	kvb_close(&c);
	free(ld);
	bench_stop_daemon(&d);
	return 0;
}
