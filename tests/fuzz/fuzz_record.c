/*
 * fuzz_record — libFuzzer harness over cluster/record.c's parser of etcd member
 * records (issue 19: one record with a JSON null endpoint crashed every daemon).
 * Any input: record_parse() either refuses it with a reason, leaving the output
 * untouched, or gives a record within its documented limits, which
 * record_format() writes and record_parse() reads back to the same record.
 * A broken invariant prints what and aborts, so libFuzzer saves the input.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/fuzz.h"
#include "cluster/record.h"

#define CHECK(cond)                                                             \
	do {                                                                    \
		if (!(cond)) {                                                  \
			fprintf(stderr, "fuzz_record: invariant broken: %s\n", #cond); \
			abort();                                                \
		}                                                               \
	} while (0)

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	struct member_record r, before, back;
	char err[200] = "", buf[1024];
	int rc, n;

	memset(&before, 0x5c, sizeof(before));
	r = before;
	rc = record_parse((const char *)data, size, &r, err, sizeof(err));
	if (rc) {
		CHECK(rc == -EINVAL || rc == -ENOMEM);
		CHECK(err[0] != 0);
		CHECK(!memcmp(&r, &before, sizeof(r)));
		return 0;
	}
	CHECK(record_endpoint_ok(r.endpoint, strlen(r.endpoint)));
	CHECK(strlen(r.key) == 0 || strlen(r.key) == RECORD_KEY_LEN);
	CHECK(r.capacity > 0);
	CHECK(memchr(r.version, 0, sizeof(r.version)) != NULL);
	n = record_format("fuzz", &r, buf, sizeof(buf));
	CHECK(n > 0);
	memset(&back, 0, sizeof(back));
	CHECK(record_parse(buf, (size_t)n, &back, err, sizeof(err)) == 0);
	CHECK(!strcmp(back.endpoint, r.endpoint) && !strcmp(back.key, r.key) &&
	      back.capacity == r.capacity && !strcmp(back.version, r.version));
	return 0;
}
