/*
 * bench_aead — the seals of bulk connections' records (proto/bulk.h) on one core: each
 * cipher this CPU runs (AES-256-GCM through OpenSSL, AEGIS-128L, AEGIS-128X2) sealing
 * and opening records of KVBB_SEAL_BYTES (512 KiB), as the daemon and libkvblend do;
 * ratios against AES-256-GCM, the fallback, measured in the same rounds, and memcpy of
 * the same record (cache-hot, as each record is when sealed or opened) for scale. GB/s of the record's
 * bytes; medians over --repeats rounds, each round timing every cipher and the copy
 * back to back.
 *
 * usage: bench_aead [--repeats N] [--record KIB]
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "bench/bench_common.h"
#include "proto/bulk.h"

#define MAX_REPEATS 64
#define TURNS 200 /* records per timing */

static volatile uint8_t sink; /* keeps the copies from being optimised away */

static double copy_rate(uint8_t *dst, const uint8_t *src, size_t len)
{
	double t0 = now_s();

	for (int i = 0; i < TURNS; i++) {
		memcpy(dst, src, len);
		sink ^= dst[i % len];
	}
	return (double)len * TURNS / (now_s() - t0) / 1e9;
}

static double seal_rate(struct kvbb_aead *a, uint8_t *dst, uint8_t *src, size_t len)
{
	uint8_t hdr[KVBB_HDR_LEN] = { 0 }, tag[KVBB_TAG_LEN];
	struct iovec iov = { src, len };
	double t0 = now_s();

	for (int i = 0; i < TURNS; i++)
		if (kvbb_seal(a, (uint64_t)i, KVBB_DIR_RECORDS, hdr, sizeof(hdr), &iov, 1, dst, tag)) {
			fprintf(stderr, "bench_aead: seal failed\n");
			exit(1);
		}
	return (double)len * TURNS / (now_s() - t0) / 1e9;
}

/* Open the same record again and again: each turn seals it back first (untimed). */
static double open_rate(struct kvbb_aead *a, uint8_t *buf, uint8_t *plain, size_t len)
{
	uint8_t hdr[KVBB_HDR_LEN] = { 0 }, tag[KVBB_TAG_LEN];
	struct iovec iov = { plain, len };
	double spent = 0;

	for (int i = 0; i < TURNS; i++) {
		double t0;

		kvbb_seal(a, (uint64_t)i, KVBB_DIR_RECORDS, hdr, sizeof(hdr), &iov, 1, buf, tag);
		t0 = now_s();
		if (kvbb_open(a, (uint64_t)i, KVBB_DIR_RECORDS, hdr, sizeof(hdr), buf, len, tag)) {
			fprintf(stderr, "bench_aead: open failed its check\n");
			exit(1);
		}
		spent += now_s() - t0;
	}
	return (double)len * TURNS / spent / 1e9;
}

int main(int argc, char **argv)
{
	int repeats = 9;
	size_t len = KVBB_SEAL_BYTES;
	uint8_t key[KVBP_BULK_KEY_LEN];
	uint32_t ciphers[3] = { KVBP_AEAD_AES256GCM, KVBP_AEAD_AEGIS128L, KVBP_AEAD_AEGIS128X2 };
	double copy[MAX_REPEATS], seal[3][MAX_REPEATS], open[3][MAX_REPEATS];
	struct kvbb_aead *a[3] = { NULL };
	uint8_t *src, *dst;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--repeats") && i + 1 < argc) {
			repeats = bench_count_arg("--repeats", argv[++i], MAX_REPEATS);
		} else if (!strcmp(argv[i], "--record") && i + 1 < argc) {
			long kib = atol(argv[++i]);

			if (kib < 1 || kib > (long)(KVBB_RECORD_MAX >> 10)) {
				fprintf(stderr, "--record: KiB, 1..%u\n", KVBB_RECORD_MAX >> 10);
				return 2;
			}
			len = (size_t)kib << 10;
		} else {
			fprintf(stderr, "usage: bench_aead [--repeats N] [--record KIB]\n");
			return 2;
		}
	}
	src = malloc(len);
	dst = malloc(len);
	if (!src || !dst)
		return 1;
	for (size_t i = 0; i < len; i++)
		src[i] = (uint8_t)(i * 131 + 7);
	memset(dst, 0, len);
	memset(key, 0x3c, sizeof(key));
	for (int c = 0; c < 3; c++)
		if (kvbb_aead_new(&a[c], key, ciphers[c]))
			a[c] = NULL; /* this CPU lacks its instructions */
	for (int r = -1; r < repeats; r++) { /* round -1: warm-up */
		double cp = copy_rate(dst, src, len);

		for (int c = 0; c < 3; c++) {
			double s = a[c] ? seal_rate(a[c], dst, src, len) : 0;
			double o = a[c] ? open_rate(a[c], dst, src, len) : 0;

			if (r >= 0) {
				seal[c][r] = s;
				open[c][r] = o;
			}
		}
		if (r >= 0)
			copy[r] = cp;
	}
	printf("Seals of %zu KiB records on one core; GB/s, medians of %d rounds; memcpy of "
	       "the record %.1f GB/s in the same rounds.\n\n", len >> 10, repeats,
	       bench_median(copy, repeats));
	printf("| cipher | seal | open | seal / AES-256-GCM's | open / AES-256-GCM's |\n"
	       "|---|---|---|---|---|\n");
	for (int c = 0; c < 3; c++) {
		if (!a[c]) {
			printf("| %s | - | - | - | - | (not on this CPU)\n", kvbb_cipher_name(ciphers[c]));
			continue;
		}
		printf("| %s | %.1f | %.1f | %.2fx | %.2fx |\n", kvbb_cipher_name(ciphers[c]),
		       bench_median(seal[c], repeats), bench_median(open[c], repeats),
		       bench_median(seal[c], repeats) / bench_median(seal[0], repeats),
		       bench_median(open[c], repeats) / bench_median(open[0], repeats));
	}
	for (int c = 0; c < 3; c++)
		kvbb_aead_free(&a[c]);
	free(src);
	free(dst);
	return 0;
}
