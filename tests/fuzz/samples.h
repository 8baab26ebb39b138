/*
 * samples — one well-formed request of every operation (and a few variants),
 * the seeds of the libFuzzer corpus and the bases the wire fuzzer mutates.
 */
#ifndef KVBLEND_TESTS_FUZZ_SAMPLES_H
#define KVBLEND_TESTS_FUZZ_SAMPLES_H

#include <stddef.h>

#include "proto/wire.h"

/* How many samples there are. */
size_t fuzz_sample_count(void);

/*
 * Fill *req with sample i (i < fuzz_sample_count()) and *name with a short file
 * name for it. The arrays req points to are static and read-only: never pass
 * *req to kvbp_request_clear().
 */
void fuzz_sample(size_t i, struct kvbp_request *req, const char **name);

#endif
