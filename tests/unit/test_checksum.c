/* Unit tests of store/checksum: the SIMD build agrees with libxxhash, fused copy is exact. */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <xxhash.h>

#include <cmocka.h>

#include "store/checksum.h"

static void test_matches_reference(void **state)
{
	const size_t sizes[] = { 0, 1, 3, 16, 17, 128, 129, 240, 241, 1000, 16384, 16385, 65536 + 7,
				 (1u << 20) + 3 };
	size_t max = (1u << 20) + 3;
	uint8_t *a = malloc(max + 1), *b = malloc(max + 4);

	(void)state;
	for (size_t i = 0; i < max + 1; i++)
		a[i] = (uint8_t)(i * 2654435761u >> 13);
	for (size_t s = 0; s < sizeof(sizes) / sizeof(sizes[0]); s++) {
		/* libxxhash's own build is the independent reference */
		uint64_t ref = XXH3_64bits(a + 1, sizes[s]);

		assert_int_equal(checksum(a + 1, sizes[s]), ref);
		memset(b, 0, max + 4);
		assert_int_equal(checksum_copy(b + 3, a + 1, sizes[s]), ref);
		assert_memory_equal(b + 3, a + 1, sizes[s]);
		assert_int_equal(b[3 + sizes[s]], 0); /* nothing written past the end */
	}
	assert_non_null(checksum_impl());
	free(a);
	free(b);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_matches_reference),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
