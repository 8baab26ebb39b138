/*
 * place_tool — the owners of chunk hashes as a cluster computes them, for tests.
 *
 * usage: place_tool R ID[:WEIGHT] ...   (chunk hashes, 64 hex digits, one per line on stdin)
 * prints, per hash: HASH OWNER1 OWNER2 ... (the R best members, best first)
 */
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "cluster/place.h"

int main(int argc, char **argv)
{
	struct place_member m[256];
	const char *ids[256];
	char line[256];
	size_t n = 0, r;

	if (argc < 3 || (r = strtoul(argv[1], NULL, 10)) < 1 || r > 64 || argc - 2 > 256) {
		fprintf(stderr, "usage: place_tool R ID[:WEIGHT] ...  < hashes\n");
		return 2;
	}
	for (int i = 2; i < argc; i++, n++) {
		char *colon = strchr(argv[i], ':');

		m[n].weight = colon ? strtod(colon + 1, NULL) : 1.0;
		if (colon)
			*colon = 0;
		ids[n] = argv[i];
		m[n].seed = place_seed(argv[i]);
	}
	while (fgets(line, sizeof(line), stdin)) {
		unsigned char h[PLACE_HASH_LEN];
		size_t out[64], k;

		line[strcspn(line, "\r\n")] = 0;
		if (strlen(line) != 2 * PLACE_HASH_LEN)
			continue;
		for (size_t i = 0; i < PLACE_HASH_LEN; i++) {
			unsigned v;

			if (sscanf(line + 2 * i, "%2x", &v) != 1)
				return 1;
			h[i] = (unsigned char)v;
		}
		k = place_owners(m, n, h, r, out);
		printf("%s", line);
		for (size_t j = 0; j < k; j++)
			printf(" %s", ids[out[j]]);
		printf("\n");
	}
	return 0;
}
