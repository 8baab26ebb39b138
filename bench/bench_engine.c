/*
 * bench_engine — what a serving node waits for per layer, with the classic fuse
 * session (kvb_fuse_layer: send the selected rows, receive every row, copy them
 * into the node's own KV cache) against a landing session (kvb_fuse_open_into:
 * the daemon writes the re-rotated rows into the node's cache ahead of it; the
 * node waits on a progress word), when the node's own compute per layer is 0, 1
 * and 3 ms, at 1K, 4K and 8K tokens; and, with no node compute, the rate at
 * which re-rotated rows land in the node's cache against memcpy of the same
 * bytes in the same run. r = 0.15, check layer 1, 32 fresh tokens, 4-8 chunks.
 * The node's cache is contiguous ([K|V][layers][tokens][heads][head_dim]) or paged
 * as vLLM's CPU cache is ([layers][blocks][heads][K|V][128 slots][head_dim], the
 * block table shuffled). Starts its own daemon.
 *
 * usage: bench_engine [--daemon PATH] [--shape mistral|smollm|both] [--tokens 1024,4096,8192]
 *                     [--node-ms 0,1,3] [--repeats N] [--layout rows|paged|both]
 *                     [--verify once|always|scrub-only]
 *
 * --verify: the daemon's verify setting (docs/storage.md#verification), once by
 * default as the daemon's; each landing reads the same chunks, so under once only
 * the first run of a size computes checksums.
 *
 * The node's compute is a sleep to a deadline (its GPU works; its CPU is free
 * for the daemon), so a layer's wait is the time the daemon was not hidden.
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
#include "client/include/kvblend.h"

#define FRESH 32
#define CHECK 1
#define RATIO 0.15
#define PAGE 128 /* vLLM's CPU block size */

struct shape {
	const char *what;
	struct kvb_model m;
};

static const struct shape shapes[] = {
	{ "Mistral-7B (32 layers, 8 KV heads x 128, f16)",
	  { .name = "be-mistral", .num_layers = 32, .num_kv_heads = 8, .head_dim = 128,
	    .dtype = KVB_F16, .rope_theta = 1e6 } },
	{ "SmolLM2-135M (30 layers, 3 KV heads x 64, f16)",
	  { .name = "be-smollm", .num_layers = 30, .num_kv_heads = 3, .head_dim = 64,
	    .dtype = KVB_F16, .rope_theta = 1e5 } },
};

/* The node's compute for one layer: sleep until t0 + ms. */
static void compute(double ms)
{
	struct timespec ts;

	if (ms <= 0)
		return;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	ts.tv_nsec += (long)(ms * 1e6);
	ts.tv_sec += ts.tv_nsec / 1000000000;
	ts.tv_nsec %= 1000000000;
	while (clock_nanosleep(CLOCK_MONOTONIC, TIMER_ABSTIME, &ts, NULL))
		;
}

struct run {
	kvb_client *c;
	const struct kvb_model *m;
	struct kvb_segment *segs;
	size_t n_segs;
	uint32_t n;   /* tokens */
	size_t row;   /* bytes of one row */
	uint8_t *kv;  /* the node's fresh K and V of one layer, [2][n] rows (same every layer) */
	uint8_t *pk;  /* packed rows scratch */
	uint8_t *cache; /* the node's KV cache: [2][layers][n] rows, in a region */
	uint8_t *src;	/* memcpy's source: as many bytes as land */
	double node_ms;
	uint32_t *table; /* paged: the block table (NULL: contiguous rows) */
	uint32_t n_blocks;
};

/* The node's cache as a landing layout. */
static struct kvb_kv_layout layout(const struct run *r)
{
	size_t hb = r->row / r->m->num_kv_heads, layer = (size_t)r->n * r->row;
	size_t hs = 2 * PAGE * hb, page = r->m->num_kv_heads * hs;

	if (!r->table)
		return (struct kvb_kv_layout){ r->cache, r->cache + (size_t)r->m->num_layers * layer,
					       layer, r->row, hb, 0, 0, NULL, 0 };
	return (struct kvb_kv_layout){ r->cache, r->cache + PAGE * hb, r->n_blocks * page, hb, hs,
				       PAGE, page, r->table, r->n_blocks };
}

/* Head h of token t's K (kv 0) or V (kv 1) in layer l of the node's cache. */
static uint8_t *at(const struct kvb_kv_layout *y, int kv, uint32_t l,
		   uint32_t t, uint32_t h)
{
	uint8_t *p = (uint8_t *)(kv ? y->v : y->k) + (size_t)l * y->layer_stride + h * y->head_stride;

	if (y->page_tokens)
		return p + (size_t)y->pages[t / y->page_tokens] * y->page_stride +
		       (size_t)(t % y->page_tokens) * y->token_stride;
	return p + (size_t)t * y->token_stride;
}

/* The node writes rows of a layer ([n][heads][head_dim] each of K and V) into its cache. */
static void put_rows(const struct run *r, uint32_t l, const uint8_t *k, const uint8_t *v,
		     const int32_t *rows, size_t nr)
{
	struct kvb_kv_layout y = layout(r);
	size_t hb = r->row / r->m->num_kv_heads;

	for (size_t i = 0; i < nr; i++) {
		uint32_t t = rows ? (uint32_t)rows[i] : (uint32_t)i;

		for (uint32_t h = 0; h < r->m->num_kv_heads; h++) {
			memcpy(at(&y, 0, l, t, h), k + (size_t)t * r->row + h * hb, hb);
			memcpy(at(&y, 1, l, t, h), v + (size_t)t * r->row + h * hb, hb);
		}
	}
}

/* memcpy of the bytes one landing writes (cached tokens, layers after the check), in
 * runs as long as the layout allows, from a source as large; returns GB/s. */
static double memcpy_rate(const struct run *r, uint32_t cached)
{
	struct kvb_kv_layout y = layout(r);
	const struct kvb_model *m = r->m;
	size_t hb = r->row / m->num_kv_heads, bytes = 0;
	const uint8_t *src = r->src;
	double t = now_s();

	for (uint32_t l = CHECK + 1; l < m->num_layers; l++)
		for (int kv = 0; kv < 2; kv++) {
			if (!r->table) {
				memcpy(at(&y, kv, l, 0, 0), src, cached * r->row);
				src += cached * r->row;
				bytes += cached * r->row;
				continue;
			}
			for (uint32_t t0 = 0; t0 < cached; t0 += PAGE) {
				uint32_t n = cached - t0 < PAGE ? cached - t0 : PAGE;

				for (uint32_t h = 0; h < m->num_kv_heads; h++) {
					memcpy(at(&y, kv, l, t0, h), src, n * hb);
					src += n * hb;
					bytes += n * hb;
				}
			}
		}
	return bytes / (now_s() - t) / 1e9;
}

/* Classic session: per layer after the check layer, the mean wait (ms) of call + copy-in. */
static double run_classic(struct run *r)
{
	const struct kvb_model *m = r->m;
	uint32_t check = CHECK;
	double ratio = RATIO, waited = 0;
	struct kvb_fuse_params p = { &check, &ratio, 1, KVB_METRIC_VALUE };
	size_t layer_bytes = (size_t)r->n * r->row;
	kvb_fuse *fu;

	if (kvb_fuse_open(r->c, m->name, r->segs, r->n_segs, &p, &fu, NULL, NULL)) {
		fprintf(stderr, "fuse_open: %s\n", kvb_last_error(r->c));
		exit(1);
	}
	for (uint32_t l = 0; l < m->num_layers; l++) {
		const int32_t *rows;
		size_t nr = kvb_fuse_rows(fu, &rows);
		const void *fk, *fv;
		double t;
		int fused = 0;

		compute(r->node_ms);
		if (l < CHECK)
			continue;
		for (size_t i = 0; i < nr; i++) {
			memcpy(r->pk + i * r->row, r->kv + (size_t)rows[i] * r->row, r->row);
			memcpy(r->pk + (nr + i) * r->row, r->kv + layer_bytes + (size_t)rows[i] * r->row,
			       r->row);
		}
		t = now_s();
		if (kvb_fuse_layer(r->c, fu, l, r->pk, r->pk + nr * r->row, NULL, NULL, &fused)) {
			fprintf(stderr, "fuse_layer: %s\n", kvb_last_error(r->c));
			exit(1);
		}
		/* The node's attention reads its own cache: the fused layer goes there. */
		if (fused && kvb_fuse_output(fu, &fk, &fv) == 0) {
			if (r->table) {
				put_rows(r, l, fk, fv, NULL, r->n);
			} else {
				memcpy(r->cache + (size_t)l * layer_bytes, fk, layer_bytes);
				memcpy(r->cache + ((size_t)m->num_layers + l) * layer_bytes, fv,
				       layer_bytes);
			}
		}
		if (l > CHECK)
			waited += now_s() - t;
	}
	kvb_fuse_close(r->c, &fu, NULL, NULL);
	return waited * 1e3 / (m->num_layers - CHECK - 1);
}

/*
 * Landing session: the mean wait per layer after the check layer; *land_s the time
 * from open until the last layer had landed, *check_ms the check call.
 */
static double run_landing(struct run *r, double *land_s, double *check_ms, double *daemon_s)
{
	struct kvb_stat *st = NULL;
	size_t n_st = 0;
	const struct kvb_model *m = r->m;
	uint32_t check = CHECK;
	double ratio = RATIO, waited = 0, t_open, t;
	struct kvb_fuse_params p = { &check, &ratio, 1, KVB_METRIC_VALUE };
	size_t layer_bytes = (size_t)r->n * r->row;
	struct kvb_kv_layout y = layout(r);
	kvb_fuse *fu;

	t_open = now_s();
	if (kvb_fuse_open_into(r->c, m->name, r->segs, r->n_segs, &p, &y, &fu, NULL, NULL)) {
		fprintf(stderr, "fuse_open_into: %s\n", kvb_last_error(r->c));
		exit(1);
	}
	for (uint32_t l = 0; l < m->num_layers; l++) {
		const int32_t *rows;
		size_t nr = kvb_fuse_rows(fu, &rows);

		compute(r->node_ms);
		if (l == CHECK) {
			/* the V plane of every token, from the heap: one frame */
			t = now_s();
			if (kvb_fuse_check(r->c, fu, l, r->kv + layer_bytes, 0, NULL, NULL)) {
				fprintf(stderr, "fuse_check: %s\n", kvb_last_error(r->c));
				exit(1);
			}
			*check_ms = (now_s() - t) * 1e3;
		}
		if (l <= CHECK)
			continue;
		t = now_s();
		if (kvb_fuse_wait(r->c, fu, l, 60000)) {
			fprintf(stderr, "fuse_wait: %s\n", kvb_last_error(r->c));
			exit(1);
		}
		waited += now_s() - t;
		if (l + 1 == m->num_layers)
			*land_s = now_s() - t_open;
		/* then the node writes its own rows of the layer */
		put_rows(r, l, r->kv, r->kv + layer_bytes, rows, nr);
	}
	kvb_fuse_close(r->c, &fu, &st, &n_st);
	for (size_t i = 0; i < n_st; i++)
		if (!strcmp(st[i].name, "land_ms"))
			*daemon_s = st[i].value / 1e3;
	free(st);
	return waited * 1e3 / (m->num_layers - CHECK - 1);
}

/*
 * Reuse-only landing session (no check layer: what a serving node's plain reuse of
 * re-rotated chunks opens): the time from open until every layer had landed, and the
 * daemon's own landing time, both in seconds.
 */
static void run_reuse(struct run *r, double *land_s, double *daemon_s)
{
	struct kvb_stat *st = NULL;
	size_t n_st = 0;
	struct kvb_kv_layout y = layout(r);
	double t_open = now_s();
	kvb_fuse *fu;

	if (kvb_fuse_open_into(r->c, r->m->name, r->segs, r->n_segs, NULL, &y, &fu, NULL, NULL)) {
		fprintf(stderr, "fuse_open_into (reuse): %s\n", kvb_last_error(r->c));
		exit(1);
	}
	for (uint32_t l = 0; l < r->m->num_layers; l++)
		if (kvb_fuse_wait(r->c, fu, l, 60000)) {
			fprintf(stderr, "fuse_wait (reuse): %s\n", kvb_last_error(r->c));
			exit(1);
		}
	*land_s = now_s() - t_open;
	kvb_fuse_close(r->c, &fu, &st, &n_st);
	for (size_t i = 0; i < n_st; i++)
		if (!strcmp(st[i].name, "land_ms"))
			*daemon_s = st[i].value / 1e3;
	free(st);
}

static double median(double *v, unsigned n)
{
	qsort(v, n, sizeof(double), cmp_double);
	return v[n / 2];
}

static void parse_list(char *s, double *v, unsigned *n)
{
	char *save, *tok;

	*n = 0;
	for (tok = strtok_r(s, ",", &save); tok && *n < 8; tok = strtok_r(NULL, ",", &save))
		v[(*n)++] = atof(tok);
}

int main(int argc, char **argv)
{
	char daemon_path[512];
	double sizes[8] = { 1024, 4096, 8192 }, node[8] = { 0, 1, 3 };
	unsigned n_sizes = 3, n_node = 3, repeats = 3, shape_lo = 0, shape_hi = 2;
	int layout_lo = 0, layout_hi = 1; /* 0 rows, 1 paged */
	/* Stored raw, as real KV is (bitshuffle+LZ4 saves under 1% on it; this fill would compress). */
	const char *extra[] = { "--shm-max", "4G", "--shm-total", "16G", "--compress-min-saving",
				"100", "--verify", "once", NULL };
	kvb_client *c;
	struct daemon d;

	bench_daemon_arg(&argc, argv, daemon_path, sizeof(daemon_path));
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--node-ms") && i + 1 < argc) {
			parse_list(argv[++i], node, &n_node);
		} else if (!strcmp(argv[i], "--tokens") && i + 1 < argc) {
			parse_list(argv[++i], sizes, &n_sizes);
		} else if (!strcmp(argv[i], "--repeats") && i + 1 < argc) {
			repeats = (unsigned)atoi(argv[++i]);
		} else if (!strcmp(argv[i], "--shape") && i + 1 < argc) {
			i++;
			shape_lo = !strcmp(argv[i], "smollm");
			shape_hi = !strcmp(argv[i], "mistral") ? 1 : 2;
		} else if (!strcmp(argv[i], "--verify") && i + 1 < argc) {
			extra[7] = argv[++i];
		} else if (!strcmp(argv[i], "--layout") && i + 1 < argc) {
			i++;
			layout_lo = !strcmp(argv[i], "paged");
			layout_hi = !strcmp(argv[i], "rows") ? 1 : 2;
		} else {
			fprintf(stderr, "usage: bench_engine [--daemon PATH] [--shape mistral|smollm|both] "
					"[--tokens 1024,4096,8192] [--node-ms 0,1,3] [--repeats N] "
					"[--layout rows|paged|both] [--verify once|always|scrub-only]\n");
			return 2;
		}
	}
	if (!repeats)
		repeats = 1;
	bench_start_daemon(&d, daemon_path, false, extra);
	c = bench_connect(&d, 120000, false);
	printf("kvblend bench_engine: r = %.2f, check layer %d, %d fresh tokens, median of %u runs, "
	       "verify = %s\n", RATIO, CHECK, FRESH, repeats, extra[7]);
	for (unsigned si = shape_lo; si < shape_hi; si++)
	for (int paged = layout_lo; paged < layout_hi; paged++) {
		const struct kvb_model *m = &shapes[si].m;
		size_t row = (size_t)m->num_kv_heads * m->head_dim * 2;

		if (kvb_model_register(c, m, NULL)) {
			fprintf(stderr, "model: %s\n", kvb_last_error(c));
			break;
		}
		printf("\n%s, %s\n\n", shapes[si].what,
		       paged ? "paged cache (vLLM's CPU layout: blocks of 128, per head K then V, "
			       "block table shuffled)"
			     : "contiguous cache");
		printf("| tokens | node ms/layer | classic wait ms/layer | landing wait ms/layer | "
		       "landing check ms | landed GB/s, wall (/memcpy) | landed GB/s, daemon "
		       "(/memcpy) | memcpy GB/s | reuse landed GB/s, wall (/memcpy) | reuse, "
		       "daemon (/memcpy) |\n");
		printf("|---|---|---|---|---|---|---|---|---|---|\n");
		for (unsigned zi = 0; zi < n_sizes; zi++) {
			uint32_t n = (uint32_t)sizes[zi], n_chunks = n >= 4096 ? 8 : 4;
			uint32_t cached = n - FRESH, per = cached / n_chunks, pos = 0;
			uint32_t nb = (n + PAGE - 1) / PAGE;
			size_t layer_bytes = (size_t)n * row, cache_bytes = 2 * m->num_layers * layer_bytes;
			struct run r = { c, m, calloc(n_chunks + 1, sizeof(struct kvb_segment)),
					 n_chunks + 1, n, row, malloc(2 * layer_bytes),
					 malloc(2 * layer_bytes), NULL, 0, 0, NULL, 0 };

			if (paged) {
				uint64_t x = 12345;

				r.n_blocks = nb;
				r.table = malloc(nb * sizeof(uint32_t));
				for (uint32_t b = 0; b < nb; b++)
					r.table[b] = b;
				for (uint32_t b = nb - 1; b > 0; b--) { /* shuffled, as a busy engine's are */
					uint32_t j, tmp;

					x = x * 6364136223846793005ull + 1442695040888963407ull;
					j = (uint32_t)((x >> 33) % (b + 1));
					tmp = r.table[b], r.table[b] = r.table[j], r.table[j] = tmp;
				}
				cache_bytes = (size_t)m->num_layers * nb * 2 * PAGE * row;
			}

			r.cache = kvb_region_alloc(c, cache_bytes);
			if (!r.cache) {
				fprintf(stderr, "region of %zu bytes: %s\n", cache_bytes, kvb_last_error(c));
				exit(1);
			}
			memset(r.cache, 0, cache_bytes); /* an engine's cache exists before requests */
			r.src = malloc(cache_bytes);
			fill_f16((uint16_t *)r.src, cache_bytes / 2, 3);
			fill_f16((uint16_t *)r.kv, layer_bytes, 7);
			for (uint32_t k = 0; k < n_chunks; k++) {
				uint32_t t = k + 1 < n_chunks ? per : cached - per * (n_chunks - 1);
				uint32_t id[3] = { n, k, si };
				size_t bytes = (size_t)m->num_layers * 2 * t * row;
				uint16_t *kv = malloc(bytes);

				fill_f16(kv, bytes / 2, 100 * n + k);
				kvb_chunk_hash(id, 3, r.segs[k].hash);
				if (kvb_put(c, m->name, r.segs[k].hash, KVB_F16, t, 0, kv, bytes, NULL))
					fprintf(stderr, "put: %s\n", kvb_last_error(c));
				free(kv);
				r.segs[k].pos = pos;
				pos += t;
			}
			r.segs[n_chunks].fresh = 1;
			r.segs[n_chunks].count = FRESH;
			r.segs[n_chunks].pos = pos;
			for (unsigned ni = 0; ni < n_node; ni++) {
				double cw[16], lw[16], ls[16], ck[16], mc[16], ds[16], rw[16], rd[16];
				size_t land_bytes = (size_t)(m->num_layers - CHECK - 1) * 2 * cached * row;
				size_t reuse_bytes = (size_t)m->num_layers * 2 * cached * row;

				r.node_ms = node[ni];
				/* one untimed run of each: pages of the cache mapped on both sides */
				run_classic(&r);
				run_landing(&r, &ls[0], &ck[0], &ds[0]);
				if (r.node_ms == 0)
					run_reuse(&r, &rw[0], &rd[0]);
				for (unsigned k = 0; k < repeats && k < 16; k++) {
					cw[k] = run_classic(&r);
					lw[k] = run_landing(&r, &ls[k], &ck[k], &ds[k]);
					if (r.node_ms == 0) {
						run_reuse(&r, &rw[k], &rd[k]);
						rw[k] = reuse_bytes / rw[k] / 1e9;
						rd[k] = reuse_bytes / rd[k] / 1e9;
					}
					/* memcpy of the bytes that landed, from a source as large (as the
					 * stored layers are), into the same cache */
					mc[k] = memcpy_rate(&r, cached);
					ls[k] = land_bytes / ls[k] / 1e9;
					ds[k] = land_bytes / ds[k] / 1e9;
				}
				{
					unsigned k = repeats < 16 ? repeats : 16;
					double land = median(ls, k), mem = median(mc, k), dl = median(ds, k);

					if (r.node_ms > 0) {
						printf("| %u | %.0f | %.3f | %.3f | %.3f | | | | | |\n", n,
						       r.node_ms, median(cw, k), median(lw, k), median(ck, k));
					} else {
						double rl = median(rw, k), rdl = median(rd, k);

						printf("| %u | 0 | %.3f | %.3f | %.3f | %.2f (%.2fx) | %.2f "
						       "(%.2fx) | %.2f | %.2f (%.2fx) | %.2f (%.2fx) |\n", n,
						       median(cw, k), median(lw, k), median(ck, k), land,
						       land / mem, dl, dl / mem, mem, rl, rl / mem, rdl, rdl / mem);
					}
					fflush(stdout);
				}
			}
			kvb_region_free(c, r.cache);
			free(r.segs);
			free(r.kv);
			free(r.pk);
			free(r.src);
			free(r.table);
		}
	}
	printf("\nwait: per layer after the check layer, the time the node is held beyond its own "
	       "compute. classic: kvb_fuse_layer (send the selected rows, receive all rows in the "
	       "shared ring) plus copying the fused layer into the node's cache; landing: "
	       "kvb_fuse_wait until the daemon has written the layer into the node's cache. land "
	       "GB/s (no node compute): the bytes of the cached tokens' K and V of every landed "
	       "layer over the time from open until the last layer landed; memcpy of the same "
	       "bytes into the same cache in the same run (from a source as large as the landed bytes); "
	       "daemon: the same bytes over the daemon's own landing time (land_ms). reuse: a "
	       "reuse-only landing session (no check layer, as plain reuse of re-rotated chunks "
	       "opens), every layer's cached K and V over the time from open until the last layer "
	       "landed, and over the daemon's land_ms.\n");
	kvb_close(&c);
	bench_stop_daemon(&d);
	return 0;
}
