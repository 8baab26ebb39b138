/* Unit tests of daemon/tenants: the file format, its errors, and who lands where. */
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

#include "daemon/tenants.h"
#include "tests/fixture.h"

#define KEY "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"

static void write_file(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");

	assert_non_null(f);
	fputs(text, f);
	fclose(f);
}

/* Each test's tenants file: an empty temporary file, its name in *state; removed after. */
static int setup(void **state)
{
	char *path = strdup("/tmp/kvb-tenants-XXXXXX");
	int fd;

	assert_non_null(path);
	fd = mkstemp(path);
	assert_true(fd >= 0);
	close(fd);
	*state = path;
	return 0;
}

static int teardown(void **state)
{
	unlink(*state);
	free(*state);
	return 0;
}

static void test_bindings(void **state)
{
	const char *path = *state;
	struct tenants *t = NULL;
	char err[256];

	write_file(path, "# tenants\n\nalice uid=1000 key=" KEY " capacity=3G\nbob gid=2000  # group\n"
			 "alice uid=1001\n");
	assert_int_equal(tenants_load(path, &t, err, sizeof(err)), 0);
	assert_int_equal(tenants_count(t), 2);
	assert_string_equal(tenants_of(t, "ipc:1000:5:77"), "alice");
	assert_string_equal(tenants_of(t, "ipc:1001:2000:77"), "bob"); /* first line wins */
	assert_string_equal(tenants_of(t, "ipc:1001:5:77"), "alice");
	assert_string_equal(tenants_of(t, "ipc:3000:2000:77"), "bob");
	assert_string_equal(tenants_of(t, "ipc:3000:3000:77"), "");
	assert_string_equal(tenants_of(t, "key:" KEY), "alice");
	assert_string_equal(tenants_of(t, "tcp:127.0.0.1"), "");
	assert_string_equal(tenants_of(t, "ipc:garbage"), "");
	assert_true(tenants_capacity(t, "alice") == 3ull << 30);
	assert_true(tenants_capacity(t, "bob") == 0);
	assert_true(tenants_capacity(t, "") == 0);
	assert_true(tenants_quota_any(t));
	tenants_free(&t);
	assert_null(t);
}

static void test_errors(void **state)
{
	const char *path = *state;
	struct tenants *t = NULL;
	char err[256];

	write_file(path, "ok uid=1\nthis-name-is-far-too-long uid=2\n");
	assert_int_equal(tenants_load(path, &t, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, ":2: tenant name 'this-name-is-far-too-long'"));
	write_file(path, "a uid=x\n");
	assert_int_equal(tenants_load(path, &t, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, ":1: 'uid=x' is not uid=N, gid=N, key=KEY"));
	write_file(path, "a\n");
	assert_int_equal(tenants_load(path, &t, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "tenant 'a' has no uid=, gid= or key="));
	write_file(path, "a key=short\n");
	assert_int_equal(tenants_load(path, &t, err, sizeof(err)), -EINVAL);
	write_file(path, "a uid=1 capacity=12Q\n");
	assert_int_equal(tenants_load(path, &t, err, sizeof(err)), -EINVAL);
	write_file(path, "a capacity=1G\n"); /* a capacity binds no one */
	assert_int_equal(tenants_load(path, &t, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "has no uid=, gid= or key="));
	unlink(path);
	assert_int_equal(tenants_load(path, &t, err, sizeof(err)), -ENOENT);
	assert_non_null(strstr(err, path));
	assert_null(t);
	/* no file: everyone in the default namespace */
	assert_int_equal(tenants_load("", &t, err, sizeof(err)), 0);
	assert_string_equal(tenants_of(t, "ipc:0:0:1"), "");
	tenants_free(&t);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		fixture_test(test_bindings),
		fixture_test(test_errors),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
