/* place — weighted rendezvous hashing; see place.h. */
#include "cluster/place.h"

#include <math.h>
#include <string.h>

#define XXH_INLINE_ALL
#include <xxhash.h>

uint64_t place_seed(const char *id)
{
	return XXH3_64bits(id, strlen(id));
}

double place_score(const struct place_member *m, const uint8_t hash[PLACE_HASH_LEN])
{
	uint64_t h = XXH3_64bits_withSeed(hash, PLACE_HASH_LEN, m->seed);
	/* 53 random bits, centred in their interval: u in (0, 1), never 0 or 1 */
	double u = ((double)(h >> 11) + 0.5) * 0x1p-53;

	return -m->weight / log(u);
}

size_t place_owners(const struct place_member *members, size_t n,
		    const uint8_t hash[PLACE_HASH_LEN], size_t r, size_t *out)
{
	double best[64];
	size_t k = 0;

	if (r > 64)
		r = 64;
	for (size_t i = 0; i < n; i++) {
		double s = place_score(&members[i], hash);
		size_t j = k < r ? k++ : r;

		/* insertion into the top r, best first */
		while (j > 0 && (s > best[j - 1] ||
				 (s == best[j - 1] && members[i].seed < members[out[j - 1]].seed))) {
			if (j < r) {
				best[j] = best[j - 1];
				out[j] = out[j - 1];
			}
			j--;
		}
		if (j < r) {
			best[j] = s;
			out[j] = i;
		}
	}
	return k;
}
