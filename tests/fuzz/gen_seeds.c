/*
 * gen_seeds — write the samples (samples.c) as encoded request headers, one
 * file per sample, into a directory: the seed corpus of the decode harness.
 *
 * usage: fuzz_gen_seeds DIR   (files are named seed-NN-OPERATION)
 */
#include <stdio.h>
#include <stdlib.h>

#include "tests/fuzz/samples.h"

int main(int argc, char **argv)
{
	if (argc != 2) {
		fprintf(stderr, "usage: %s DIR\n", argv[0]);
		return 2;
	}
	for (size_t i = 0; i < fuzz_sample_count(); i++) {
		struct kvbp_request q;
		const char *name;
		char path[4096];
		uint8_t *buf;
		size_t len;
		FILE *f;

		fuzz_sample(i, &q, &name);
		if (kvbp_request_encode(&q, &buf, &len)) {
			fprintf(stderr, "%s: out of memory\n", argv[0]);
			return 1;
		}
		snprintf(path, sizeof(path), "%s/seed-%02zu-%s", argv[1], i, name);
		f = fopen(path, "wb");
		if (!f || fwrite(buf, 1, len, f) != len || fclose(f)) {
			perror(path);
			free(buf);
			return 1;
		}
		free(buf);
	}
	printf("%zu seeds written to %s\n", fuzz_sample_count(), argv[1]);
	return 0;
}
