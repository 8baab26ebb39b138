/* Unit tests of daemon/config: defaults, values, ranges and their messages, files, layering. */
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

#include "daemon/config.h"

static void test_defaults(void **state)
{
	struct config c;

	(void)state;
	setenv("STATE_DIRECTORY", "/var/lib/kvb-a:/var/lib/kvb-b", 1);
	setenv("RUNTIME_DIRECTORY", "/run/kvb", 1);
	config_defaults(&c);
	assert_string_equal(c.data_dir, "/var/lib/kvb-a");
	assert_int_equal(c.n_listen, 1);
	assert_string_equal(c.listen[0], "ipc:///run/kvb/kvblend.sock");
	assert_int_equal(c.map_size, 256ull << 30);
	assert_int_equal(c.max_message, 1ull << 30);
	assert_int_equal(c.compress_min_saving, 10);
	assert_int_equal(c.socket_mode, 0660);
	assert_false(c.no_sync);
	unsetenv("STATE_DIRECTORY");
	unsetenv("RUNTIME_DIRECTORY");
}

static void test_values_and_ranges(void **state)
{
	struct config c;
	char err[256];

	(void)state;
	config_defaults(&c);
	assert_int_equal(config_set(&c, "map-size", "2G", CONFIG_FLAG, err, sizeof(err)), 0);
	assert_int_equal(c.map_size, 2ull << 30);
	assert_int_equal(config_set(&c, "map_size", "512MiB", CONFIG_FLAG, err, sizeof(err)), 0);
	assert_int_equal(c.map_size, 512ull << 20);
	assert_int_equal(config_set(&c, "map_size", "1K", CONFIG_FLAG, err, sizeof(err)), -ERANGE);
	assert_string_equal(err, "map_size: invalid value '1K'; expected a size from 16777216 to "
				 "70368744177664 bytes (suffixes K, M, G, T)");
	assert_int_equal(config_set(&c, "map_size", "lots", CONFIG_FLAG, err, sizeof(err)),
			 -EINVAL);
	assert_int_equal(config_set(&c, "map_size", "-5G", CONFIG_FLAG, err, sizeof(err)),
			 -EINVAL);
	assert_int_equal(config_set(&c, "map_size", "99999999999T", CONFIG_FLAG, err,
				    sizeof(err)), -ERANGE);
	assert_int_equal(config_set(&c, "workers", "300", CONFIG_FLAG, err, sizeof(err)), -ERANGE);
	assert_string_equal(err, "workers: invalid value '300'; expected an integer from 0 to 256");
	assert_int_equal(config_set(&c, "workers", "8x", CONFIG_FLAG, err, sizeof(err)), -EINVAL);
	assert_int_equal(config_set(&c, "workers", "8", CONFIG_FLAG, err, sizeof(err)), 0);
	assert_int_equal(c.workers, 8);
	assert_int_equal(config_set(&c, "socket-mode", "0600", CONFIG_FLAG, err, sizeof(err)), 0);
	assert_int_equal(c.socket_mode, 0600);
	assert_int_equal(config_set(&c, "socket-mode", "0999", CONFIG_FLAG, err, sizeof(err)),
			 -EINVAL);
	assert_int_equal(config_set(&c, "no-sync", "yes", CONFIG_FLAG, err, sizeof(err)), 0);
	assert_true(c.no_sync);
	assert_int_equal(config_set(&c, "no-sync", "perhaps", CONFIG_FLAG, err, sizeof(err)),
			 -EINVAL);
	assert_int_equal(config_set(&c, "log-level", "debug", CONFIG_FLAG, err, sizeof(err)), 0);
	assert_int_equal(config_set(&c, "log-level", "loud", CONFIG_FLAG, err, sizeof(err)),
			 -EINVAL);
	assert_int_equal(config_set(&c, "colour", "red", CONFIG_FLAG, err, sizeof(err)), -ENOENT);
	assert_string_equal(err, "unknown setting 'colour' (see kvblendd --help)");
	assert_int_equal(config_set(&c, "compress_min_saving", "101", CONFIG_FLAG, err,
				    sizeof(err)), -ERANGE);
	assert_true(config_key_is_bool("no-sync"));
	assert_false(config_key_is_bool("workers"));
	/* device: auto, cpu, cuda (device 0), cuda:N, emulated */
	assert_int_equal(c.device, CONFIG_DEVICE_AUTO); /* the default */
	assert_int_equal(config_set(&c, "device", "cuda:3", CONFIG_FLAG, err, sizeof(err)), 0);
	assert_int_equal(c.device, 3);
	assert_int_equal(config_set(&c, "device", "cuda", CONFIG_FLAG, err, sizeof(err)), 0);
	assert_int_equal(c.device, 0);
	assert_int_equal(config_set(&c, "device", "cpu", CONFIG_FLAG, err, sizeof(err)), 0);
	assert_int_equal(c.device, CONFIG_DEVICE_CPU);
	assert_int_equal(config_set(&c, "device", "emulated", CONFIG_FLAG, err, sizeof(err)), 0);
	assert_int_equal(c.device, CONFIG_DEVICE_EMULATED);
	assert_int_equal(config_set(&c, "device", "auto", CONFIG_FLAG, err, sizeof(err)), 0);
	assert_int_equal(c.device, CONFIG_DEVICE_AUTO);
	assert_int_equal(config_set(&c, "device", "gpu", CONFIG_FLAG, err, sizeof(err)), -EINVAL);
	assert_string_equal(err, "device: invalid value 'gpu'; expected auto, cpu, cuda, cuda:N or "
				 "emulated");
	assert_int_equal(config_set(&c, "device", "cuda:", CONFIG_FLAG, err, sizeof(err)), -EINVAL);
	assert_int_equal(config_set(&c, "device", "cuda:-1", CONFIG_FLAG, err, sizeof(err)),
			 -EINVAL);
	assert_int_equal(config_set(&c, "device", "cuda:1024", CONFIG_FLAG, err, sizeof(err)),
			 -EINVAL);
	assert_string_equal(err, "device: invalid device 'cuda:1024'; expected cuda:N with N in "
				 "0..1023");
	assert_int_equal(config_set(&c, "device", "cuda:2x", CONFIG_FLAG, err, sizeof(err)),
			 -EINVAL);
	assert_int_equal(c.device, CONFIG_DEVICE_AUTO); /* failures change nothing */
}

static void test_listen(void **state)
{
	struct config c;
	char err[256];

	(void)state;
	config_defaults(&c);
	/* The first value from a later source replaces the defaults; more values append. */
	assert_int_equal(config_set(&c, "listen", "ipc:///tmp/a.sock, tcp://127.0.0.1:7450",
				    CONFIG_FILE, err, sizeof(err)), 0);
	assert_int_equal(c.n_listen, 2);
	assert_int_equal(config_set(&c, "listen", "tcp://127.0.0.1:7451", CONFIG_FLAG, err,
				    sizeof(err)), 0);
	assert_int_equal(c.n_listen, 1);
	assert_int_equal(config_set(&c, "listen", "ipc:///tmp/b.sock", CONFIG_FLAG, err,
				    sizeof(err)), 0);
	assert_int_equal(c.n_listen, 2);
	assert_string_equal(c.listen[1], "ipc:///tmp/b.sock");
	assert_int_equal(config_set(&c, "listen", "http://x", CONFIG_FLAG, err, sizeof(err)),
			 -EINVAL);
	assert_string_equal(err, "listen: invalid endpoint 'http://x'; expected ipc://PATH or "
				 "tcp://HOST:PORT");
}

static void write_file(const char *path, const char *text)
{
	FILE *f = fopen(path, "w");

	assert_non_null(f);
	fputs(text, f);
	fclose(f);
}

static void test_file(void **state)
{
	struct config c;
	char err[512], path[] = "/tmp/kvb-config-XXXXXX";
	int fd = mkstemp(path);

	(void)state;
	assert_true(fd >= 0);
	config_defaults(&c);
	write_file(path, "; comment\n[kvblendd]\ndata_dir = /srv/kvb\nmap-size = 8G\n"
			 "listen = ipc:///tmp/x.sock\nlisten = tcp://127.0.0.1:1\n");
	assert_int_equal(config_load_file(&c, path, err, sizeof(err)), 0);
	assert_string_equal(c.data_dir, "/srv/kvb");
	assert_int_equal(c.map_size, 8ull << 30);
	assert_int_equal(c.n_listen, 2);
	write_file(path, "workers = 4\nworkers = 1000\n");
	assert_int_equal(config_load_file(&c, path, err, sizeof(err)), -ERANGE);
	assert_non_null(strstr(err, ":2: workers: invalid value '1000'"));
	write_file(path, "[other]\nworkers = 4\n");
	assert_int_equal(config_load_file(&c, path, err, sizeof(err)), -EINVAL);
	assert_non_null(strstr(err, "unknown section [other]"));
	write_file(path, "this is not ini\n");
	assert_true(config_load_file(&c, path, err, sizeof(err)) < 0);
	assert_non_null(strstr(err, ":1:"));
	unlink(path);
	assert_int_equal(config_load_file(&c, path, err, sizeof(err)), -ENOENT);
	assert_non_null(strstr(err, "cannot read config file"));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_defaults),
		cmocka_unit_test(test_values_and_ranges),
		cmocka_unit_test(test_listen),
		cmocka_unit_test(test_file),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
