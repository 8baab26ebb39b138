/*
 * place — where a chunk lives in a cluster: weighted rendezvous hashing
 * (highest random weight). Every member scores every chunk hash with
 * -weight / ln(u), u a uniform number in (0, 1) drawn from XXH3-64 of the
 * chunk hash seeded by the member's id; the R highest scores own the chunk.
 * Members then hold chunks in proportion to their weight (capacity), and a
 * member that joins or leaves changes only the owner sets it enters or leaves:
 * about R / N of the chunks move, and only to or from that member.
 *
 * Pure functions: no allocation, no state; every daemon computes the same
 * owners from the same member list, whatever its order.
 */
#ifndef KVBLEND_CLUSTER_PLACE_H
#define KVBLEND_CLUSTER_PLACE_H

#include <stddef.h>
#include <stdint.h>

#define PLACE_HASH_LEN 32

struct place_member {
	uint64_t seed; /* place_seed() of the member's id */
	double weight; /* > 0; capacity in any unit, equal for equal members */
};

/* The seed of a member id (a string): XXH3-64 of its bytes. */
uint64_t place_seed(const char *id);

/* Member m's score for a chunk hash. */
double place_score(const struct place_member *m, const uint8_t hash[PLACE_HASH_LEN]);

/*
 * The r highest-scoring of the n members for hash, best first, as indices into
 * members (ties, which need equal 64-bit hashes, go to the lower seed). Returns
 * how many were written: min(r, n).
 */
size_t place_owners(const struct place_member *members, size_t n,
		    const uint8_t hash[PLACE_HASH_LEN], size_t r, size_t *out);

#endif
