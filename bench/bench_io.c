/*
 * bench_io — PUT and GET throughput of kvblendd over IPC, the codec's speed and
 * ratio, and memcpy of the same bytes in the same run, as GB/s and as ratios
 * to memcpy. Starts its own kvblendd on a temporary directory.
 *
 * usage: bench_io [--daemon PATH] [--sync] [--seconds S] [--sizes 1,8,32]
 *                 [--verify once|always|scrub-only]
 *
 * "2 copies": two memcpys of the same size at once, one on each of two threads, as
 * the bytes a second through both: what a GET into a private buffer (the daemon's
 * copy into the shared segment, the client's copy out of it, overlapped) can reach
 * at best on this machine, where two copies at once may share one memory bandwidth.
 *
 * --verify: the daemon's verify setting (docs/storage.md#verification; once, the
 * daemon's default): GETs read the same chunks again and again, so under once
 * only the first GET of a chunk computes its checksums.
 */
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "store/codec.h"
#include "bench/bench_common.h"
#include "client/include/kvblend.h"

/* Mistral-7B-shaped KV: 32 layers, 8 KV heads, head_dim 128, f16: 128 KiB a token. */
static const struct kvb_model model = { .name = "bench-mistral", .num_layers = 32,
					.num_kv_heads = 8, .head_dim = 128, .dtype = KVB_F16,
					.rope_theta = 1e6 };

static uint16_t f16_from_f32(float f)
{
	uint32_t x, sign, exp, man;

	memcpy(&x, &f, 4);
	sign = (x >> 16) & 0x8000;
	exp = (x >> 23) & 0xff;
	man = x & 0x7fffff;
	if (exp == 0xff)
		return (uint16_t)(sign | 0x7c00 | (man ? 0x200 : 0));
	if (exp > 142)
		return (uint16_t)(sign | 0x7c00);
	if (exp < 103)
		return (uint16_t)sign;
	if (exp < 113) { /* subnormal */
		man |= 0x800000;
		return (uint16_t)(sign | (man >> (126 - exp)));
	}
	/* round to nearest even */
	{
		uint32_t h = sign | (exp - 112) << 10 | man >> 13;
		uint32_t rem = man & 0x1fff;

		if (rem > 0x1000 || (rem == 0x1000 && (h & 1)))
			h++;
		return (uint16_t)h;
	}
}

/* Roughly Gaussian values, with a few channels of large magnitude, like real K and V. */
static void fill_kv(uint16_t *p, size_t n, uint64_t seed)
{
	uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;

	for (size_t i = 0; i < n; i += 2) {
		double u1, u2, r;

		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		u1 = ((x >> 11) + 1) / 9007199254740993.0;
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		u2 = (x >> 11) / 9007199254740992.0;
		r = sqrt(-2 * log(u1));
		for (int k = 0; k < 2 && i + k < n; k++) {
			double g = r * (k ? sin(2 * M_PI * u2) : cos(2 * M_PI * u2));
			size_t ch = (i + k) % model.head_dim;

			p[i + k] = f16_from_f32((float)(g * (ch < 4 ? 20.0 : 1.0)));
		}
	}
}

/*
 * Repeat the operation for at least 5 runs and min_s seconds; the median rate in
 * GB/s. Every figure of one size is measured in the same run as its memcpy, so
 * ratios compare neighbours on a shared, noisy machine.
 */
#define MAX_RUNS 4096
#define MEASURE(gbps, bytes, min_s, ...)                                               \
	do {                                                                           \
		static double rates_[MAX_RUNS];                                        \
		double t_end_ = now_s() + (min_s);                                     \
		int runs_ = 0;                                                         \
		while ((runs_ < 5 || now_s() < t_end_) && runs_ < MAX_RUNS) {          \
			double t0_ = now_s();                                          \
			__VA_ARGS__;                                                   \
			rates_[runs_++] = (bytes) / (now_s() - t0_) / 1e9;             \
		}                                                                      \
		qsort(rates_, (size_t)runs_, sizeof(double), cmp_double);              \
		(gbps) = rates_[runs_ / 2];                                            \
	} while (0)

/*
 * PUT src (bytes, tokens) through c as a chunk never stored before: its hash (into h)
 * that of the sequence number *seq, which is then advanced. A refusal is said on stderr.
 */
static void put_new(kvb_client *c, uint64_t *seq, uint8_t h[KVB_HASH_LEN], uint32_t tokens,
		    const void *src, size_t bytes)
{
	uint32_t id[2] = { (uint32_t)*seq, (uint32_t)(*seq >> 32) };

	++*seq;
	kvb_chunk_hash(id, 2, h);
	if (kvb_put(c, model.name, h, KVB_F16, tokens, 0, src, bytes, NULL))
		fprintf(stderr, "put: %s\n", kvb_last_error(c));
}

int main(int argc, char **argv)
{
	char daemon_path[512];
	unsigned sizes_mib[8] = { 1, 8, 32 }, n_sizes = 3;
	double seconds = 1.0;
	bool sync = false;
	const char *extra[] = { "--verify", "once", NULL };
	struct daemon d;
	kvb_client *shm_c, *frame_c;
	uint64_t seq = 1;
	struct bench_copier cp = { 0 };

	bench_daemon_arg(&argc, argv, daemon_path, sizeof(daemon_path));
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--sync"))
			sync = true;
		else if (!strcmp(argv[i], "--seconds") && i + 1 < argc)
			seconds = atof(argv[++i]);
		else if (!strcmp(argv[i], "--verify") && i + 1 < argc)
			extra[1] = argv[++i];
		else if (!strcmp(argv[i], "--sizes") && i + 1 < argc) {
			n_sizes = bench_parse_list(argv[++i], sizes_mib, 8);
		} else {
			fprintf(stderr, "usage: bench_io [--daemon PATH] [--sync] [--seconds S] "
					"[--sizes 1,8,32] [--verify once|always|scrub-only]\n");
			return 2;
		}
	}
	bench_start_daemon(&d, daemon_path, sync, extra);
	shm_c = bench_connect(&d, 60000, false);
	frame_c = bench_connect(&d, 60000, true);
	if (kvb_model_register(shm_c, &model, NULL)) {
		fprintf(stderr, "bench_io: cannot register the model\n");
		bench_stop_daemon(&d);
		return 1;
	}
	printf("kvblend bench_io: model %u layers x %u kv heads x head_dim %u f16 (%u KiB/token); "
	       "%s commits; >= %.1f s per cell; verify = %s\n", model.num_layers,
	       model.num_kv_heads, model.head_dim,
	       2 * model.num_layers * model.num_kv_heads * model.head_dim * 2 / 1024,
	       sync ? "fsync'd" : "no-sync", seconds, extra[1]);
	printf("median GB/s, and in parentheses the ratio to memcpy of the same bytes in this "
	       "run\n\n");
	printf("| chunk | memcpy | 2 copies | file write | PUT shm | PUT frames | GET shm | "
	       "GET shm-buf | GET frames | codec compress | codec decompress | codec ratio |\n");
	printf("|---|---|---|---|---|---|---|---|---|---|---|---|\n");
	if (bench_copier_start(&cp)) {
		fprintf(stderr, "bench_io: cannot start the copier thread\n");
		bench_stop_daemon(&d);
		return 1;
	}
	for (unsigned s = 0; s < n_sizes; s++) {
		size_t bytes = (size_t)sizes_mib[s] << 20;
		size_t tok_bytes = (size_t)2 * model.num_layers * model.num_kv_heads * model.head_dim * 2;
		uint32_t tokens = (uint32_t)(bytes / tok_bytes);
		size_t tb = bytes / model.num_layers / 2;
		uint16_t *src = malloc(bytes), *dst = malloc(bytes);
		uint8_t *enc = malloc(codec_bound(tb)), h[KVB_HASH_LEN];
		uint16_t *src2 = malloc(bytes), *dst2 = malloc(bytes);
		double c_memcpy, c_two, c_write, c_put, c_put_fr, c_get, c_get_direct, c_get_fr, c_comp,
			c_decomp;
		size_t enc_total = 0, len = 0;
		char wpath[400];
		int wfd;
		void *sbuf;

		snprintf(wpath, sizeof(wpath), "%s/data/write-peer", d.dir);
		fill_kv(src, bytes / 2, s + 1);
		memset(dst, 1, bytes);
		MEASURE(c_memcpy, bytes, seconds, memcpy(dst, src, bytes));
		memcpy(src2, src, bytes);
		memset(dst2, 1, bytes);
		cp.src = src2;
		cp.dst = dst2;
		cp.len = bytes;
		MEASURE(c_two, bytes, seconds, bench_two_copies(&cp, dst, src, bytes));
		/* The disk's own sustained speed for the same bytes: appended to a file in the
		 * data directory (and fsync'd with --sync), kept until the cell ends so that
		 * writeback throttles it as it throttles LMDB. The peer of PUT. */
		wfd = open(wpath, O_WRONLY | O_CREAT | O_TRUNC | O_APPEND, 0600);
		MEASURE(c_write, bytes, seconds, {
			if (wfd < 0 || write(wfd, src, bytes) != (ssize_t)bytes || (sync && fsync(wfd)))
				perror("write peer");
		});
		close(wfd);
		unlink(wpath);
		/* codec alone, forced to compress (min_saving 0), on each tensor */
		MEASURE(c_comp, bytes, seconds, {
			enc_total = 0;
			for (unsigned t = 0; t < 2 * model.num_layers; t++) {
				codec_encode((uint8_t *)src + t * tb, tb, 2, 0.0, enc, codec_bound(tb),
					     &len);
				enc_total += len;
			}
		});
		codec_encode(src, tb, 2, 0.0, enc, codec_bound(tb), &len);
		MEASURE(c_decomp, bytes, seconds, {
			for (unsigned t = 0; t < 2 * model.num_layers; t++)
				codec_decode(enc, len, (uint8_t *)dst + t * tb, tb, NULL);
		});
		MEASURE(c_put, bytes, seconds, put_new(shm_c, &seq, h, tokens, src, bytes));
		MEASURE(c_put_fr, bytes, seconds, put_new(frame_c, &seq, h, tokens, src, bytes));
		MEASURE(c_get, bytes, seconds, {
			if (kvb_get(shm_c, model.name, h, 0, 0, dst, bytes, NULL))
				fprintf(stderr, "get: %s\n", kvb_last_error(shm_c));
		});
		if (memcmp(src, dst, bytes))
			fprintf(stderr, "bench_io: GET returned different bytes!\n");
		sbuf = kvb_shared_buffer(shm_c, bytes);
		MEASURE(c_get_direct, bytes, seconds, {
			if (kvb_get(shm_c, model.name, h, 0, 0, sbuf, bytes, NULL))
				fprintf(stderr, "get: %s\n", kvb_last_error(shm_c));
		});
		MEASURE(c_get_fr, bytes, seconds, {
			if (kvb_get(frame_c, model.name, h, 0, 0, dst, bytes, NULL))
				fprintf(stderr, "get: %s\n", kvb_last_error(frame_c));
		});
		printf("| %3u MiB | %5.2f | %5.2f (%.2fx) | %5.2f | %5.2f (%.2fx; %.2fx of write) | "
		       "%5.2f (%.2fx) | %5.2f (%.2fx; %.2fx of 2 copies) | %5.2f (%.2fx) | "
		       "%5.2f (%.2fx) | %5.2f (%.2fx) | %5.2f (%.2fx) | %.3fx |\n",
		       sizes_mib[s], c_memcpy, c_two, c_two / c_memcpy, c_write, c_put,
		       c_put / c_memcpy, c_put / c_write, c_put_fr, c_put_fr / c_memcpy, c_get,
		       c_get / c_memcpy, c_get / c_two, c_get_direct,
		       c_get_direct / c_memcpy, c_get_fr, c_get_fr / c_memcpy, c_comp,
		       c_comp / c_memcpy, c_decomp, c_decomp / c_memcpy,
		       (double)bytes / (double)enc_total);
		fflush(stdout);
		free(src);
		free(dst);
		free(src2);
		free(dst2);
		free(enc);
	}
	bench_copier_stop(&cp);
	kvb_close(&shm_c);
	kvb_close(&frame_c);
	bench_stop_daemon(&d);
	printf("\nshm: through the client's shared-memory segment (the default on ipc://); "
	       "shm-buf: into kvb_shared_buffer(), no client-side copy; frames: ZeroMQ payload "
	       "frames (the tcp:// path). PUT is also given as a ratio to the file write. 2 copies: "
	       "two memcpys of the chunk at once on two threads, the bound of a GET into a "
	       "private buffer (two copies, overlapped); GET shm is also given as a ratio to "
	       "it.\n");
	return 0;
}
