/*
 * bench_client — the C client's side of bench/bench_python.py: GETs of one chunk
 * through libkvblend into a private buffer, against a daemon that is already
 * running and holds the chunk. Prints one line of JSON: the median latency and
 * the median throughput over the repetitions, so that the Python binding can be
 * measured on the same calls in the same run.
 *
 * usage: bench_client ENDPOINT MODEL HASH_HEX BYTES REPEATS
 */
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "bench/bench_common.h"

int main(int argc, char **argv)
{
	uint8_t hash[KVB_HASH_LEN];
	kvb_client *c = NULL;
	char err[512];
	size_t bytes;
	double *t;
	void *buf;
	int reps;

	if (argc != 6 || kvb_hash_parse(argv[3], hash)) {
		fprintf(stderr, "usage: bench_client ENDPOINT MODEL HASH_HEX BYTES REPEATS\n");
		return 2;
	}
	bytes = strtoull(argv[4], NULL, 10);
	reps = atoi(argv[5]);
	if (!bytes || reps < 1 || kvb_connect(argv[1], NULL, &c, err, sizeof(err))) {
		fprintf(stderr, "bench_client: %s\n", bytes && reps > 0 ? err : "bad arguments");
		return 1;
	}
	buf = malloc(bytes);
	t = calloc((size_t)reps, sizeof(*t));
	if (!buf || !t)
		return 1;
	/* one untimed call: the segment attached, the pages of buf touched */
	if (kvb_get(c, argv[2], hash, 0, 0, buf, bytes, NULL)) {
		fprintf(stderr, "bench_client: get: %s\n", kvb_last_error(c));
		return 1;
	}
	for (int i = 0; i < reps; i++) {
		double t0 = now_s();

		if (kvb_get(c, argv[2], hash, 0, 0, buf, bytes, NULL)) {
			fprintf(stderr, "bench_client: get: %s\n", kvb_last_error(c));
			return 1;
		}
		t[i] = now_s() - t0;
	}
	qsort(t, (size_t)reps, sizeof(*t), cmp_double);
	printf("{\"median_s\": %.9f, \"gbps\": %.4f}\n", t[reps / 2], bytes / t[reps / 2] / 1e9);
	kvb_close(&c);
	free(buf);
	free(t);
	return 0;
}
