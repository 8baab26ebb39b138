/* Unit tests of client/npy: round trips and every malformed-file error. */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include "client/npy.h"

static void test_roundtrip(void **state)
{
	uint64_t shape[5] = { 2, 2, 3, 1, 4 };
	uint16_t data[48];
	struct npy a;
	char err[256], path[] = "/tmp/kvb-npy-XXXXXX";
	int fd = mkstemp(path);

	(void)state;
	assert_true(fd >= 0);
	for (int i = 0; i < 48; i++)
		data[i] = (uint16_t)(i * 1000);
	assert_int_equal(npy_write(path, "<f2", 5, shape, data, sizeof(data), err, sizeof(err)),
			 0);
	assert_int_equal(npy_read(path, &a, err, sizeof(err)), 0);
	assert_string_equal(a.descr, "<f2");
	assert_int_equal(a.ndim, 5);
	assert_memory_equal(a.shape, shape, sizeof(shape));
	assert_int_equal(a.count, 48);
	assert_memory_equal(a.data, data, sizeof(data));
	npy_free(&a);
	/* 1-D shapes are written "(n,)" */
	assert_int_equal(npy_write(path, "<i4", 1, shape, data, 8, err, sizeof(err)), 0);
	assert_int_equal(npy_read(path, &a, err, sizeof(err)), 0);
	assert_int_equal(a.ndim, 1);
	assert_int_equal(a.shape[0], 2);
	npy_free(&a);
	unlink(path);
	assert_int_equal(npy_read(path, &a, err, sizeof(err)), -ENOENT);
	assert_non_null(strstr(err, "No such file"));
}

static int parse_str(const char *hdr, size_t data_len, char *err)
{
	uint8_t buf[512] = "\x93NUMPY\x01\x00";
	size_t hl = strlen(hdr);
	struct npy a;
	int rc;

	buf[8] = (uint8_t)hl;
	buf[9] = 0;
	memcpy(buf + 10, hdr, hl);
	rc = npy_parse(buf, 10 + hl + data_len, &a, err, 256);
	if (rc == 0)
		npy_free(&a);
	return rc;
}

static void test_malformed(void **state)
{
	char err[256];
	struct npy a;

	(void)state;
	assert_int_equal(npy_parse("hello world", 11, &a, err, sizeof(err)), -EINVAL);
	assert_string_equal(err, "not a .npy file (bad magic)");
	assert_int_equal(parse_str("{'descr': '<f2', 'fortran_order': False, 'shape': (4,), }", 8,
				   err), 0);
	assert_int_equal(parse_str("{'descr': '<f2', 'fortran_order': False, 'shape': (4,), }", 6,
				   err), -EINVAL);
	assert_string_equal(err, ".npy data is shorter than its shape says (truncated file?)");
	assert_int_equal(parse_str("{'descr': '<f2', 'fortran_order': False, 'shape': (4,), }", 10,
				   err), -EINVAL);
	assert_int_equal(parse_str("{'descr': '>f2', 'fortran_order': False, 'shape': (4,), }", 8,
				   err), -EINVAL);
	assert_non_null(strstr(err, "unsupported .npy dtype"));
	assert_int_equal(parse_str("{'descr': '<f2', 'fortran_order': True, 'shape': (4,), }", 8,
				   err), -EINVAL);
	assert_string_equal(err, "Fortran-order .npy arrays are not supported");
	assert_int_equal(parse_str("{'descr': '<f2', 'fortran_order': False, }", 8, err), -EINVAL);
	assert_int_equal(parse_str("{'descr': '<f2', 'fortran_order': False, 'shape': "
				   "(4294967296, 4294967296, 4294967296), }", 8, err), -EINVAL);
	assert_string_equal(err, "bad or too large .npy shape");
	{
		uint8_t buf[12] = "\x93NUMPY\x01\x00\xff\x00";

		assert_int_equal(npy_parse(buf, 12, &a, err, sizeof(err)), -EINVAL);
		assert_string_equal(err, "truncated .npy header");
	}
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_roundtrip),
		cmocka_unit_test(test_malformed),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
