/* kvblendd — the kvblend KV-cache daemon: start-up, signals and shutdown. */
#include <errno.h>
#include <fcntl.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <unistd.h>

#include "config.h"
#include "log.h"
#include "notify.h"
#include "server.h"

#ifndef KVBLEND_VERSION
#define KVBLEND_VERSION "0.0.0"
#endif

static volatile int stop_requested;

static void on_signal(int sig)
{
	/* A second SIGTERM or SIGINT exits at once, without a graceful shutdown. */
	if (stop_requested)
		_exit(128 + sig);
	stop_requested = sig;
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: kvblendd [--config FILE] [--KEY VALUE ...]\n"
		"\n"
		"kvblend KV-cache daemon: stores per-layer KV chunks of LLM prompts in LMDB and\n"
		"serves them over ZeroMQ (IPC for local serving nodes, TCP for peers).\n"
		"\n"
		"  --config FILE            read settings from an INI file (KEY = VALUE, at the top\n"
		"                           or in [kvblendd]); flags given after override it\n"
		"  --print-config           print the effective settings and exit\n"
		"  --print-config-example   print a config file with every key at its default\n"
		"  --help, --version\n"
		"\n"
		"Settings (each also a key of the config file, with underscores):\n");
	config_print_help(f);
	fprintf(f, "\nSIGTERM or SIGINT stop gracefully; a second one exits at once.\n");
}

static int parse_args(int argc, char **argv, struct config *cfg, int *print_config)
{
	char err[512];
	int i, rc;

	/* The file first, so that flags override it wherever they stand. */
	for (i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--config") || !strncmp(argv[i], "--config=", 9)) {
			const char *path = argv[i][8] == '=' ? argv[i] + 9 : argv[i + 1];

			if (!path) {
				fprintf(stderr, "kvblendd: --config needs a file\n");
				return -EINVAL;
			}
			rc = config_load_file(cfg, path, err, sizeof(err));
			if (rc) {
				fprintf(stderr, "kvblendd: %s\n", err);
				return rc;
			}
			i += argv[i][8] != '=';
		}
	}
	for (i = 1; i < argc; i++) {
		char key[64];
		const char *arg = argv[i], *eq, *value;

		if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
			usage(stdout);
			exit(0);
		}
		if (!strcmp(arg, "--version")) {
			printf("kvblendd %s\n", KVBLEND_VERSION);
			exit(0);
		}
		if (!strcmp(arg, "--print-config")) {
			*print_config = 1;
			continue;
		}
		if (!strcmp(arg, "--print-config-example")) {
			config_print_example(stdout);
			exit(0);
		}
		if (!strcmp(arg, "--config")) {
			i++;
			continue;
		}
		if (!strncmp(arg, "--config=", 9))
			continue;
		if (strncmp(arg, "--", 2)) {
			fprintf(stderr, "kvblendd: unexpected argument '%s' (see --help)\n", arg);
			return -EINVAL;
		}
		eq = strchr(arg, '=');
		snprintf(key, sizeof(key), "%.*s", (int)(eq ? eq - arg - 2 : (long)strlen(arg) - 2),
			 arg + 2);
		if (eq)
			value = eq + 1;
		else if (config_key_is_bool(key) && (i + 1 >= argc || !strncmp(argv[i + 1], "--", 2)))
			value = "true";
		else if (i + 1 < argc)
			value = argv[++i];
		else {
			fprintf(stderr, "kvblendd: --%s needs a value\n", key);
			return -EINVAL;
		}
		rc = config_set(cfg, key, value, CONFIG_FLAG, err, sizeof(err));
		if (rc) {
			fprintf(stderr, "kvblendd: %s\n", err);
			return rc;
		}
	}
	return 0;
}

/* One kvblendd per data directory: LMDB would allow two, but they would race on sockets. */
static int lock_data_dir(const char *dir, int *fd_out)
{
	char path[PATH_MAX + 32];
	int fd;

	snprintf(path, sizeof(path), "%s/kvblendd.lock", dir);
	fd = open(path, O_RDWR | O_CREAT | O_CLOEXEC, 0640);
	if (fd < 0)
		return -errno;
	if (flock(fd, LOCK_EX | LOCK_NB)) {
		int e = errno;

		close(fd);
		return e == EWOULDBLOCK ? -EBUSY : -e;
	}
	*fd_out = fd;
	return 0;
}

static int mkdir_p(const char *dir)
{
	char buf[PATH_MAX];

	snprintf(buf, sizeof(buf), "%s", dir);
	for (char *p = buf + 1;; p++) {
		if (*p && *p != '/')
			continue;
		char c = *p;

		*p = 0;
		if (mkdir(buf, 0750) && errno != EEXIST)
			return -errno;
		if (!c)
			return 0;
		*p = c;
	}
}

static void tick(struct server *srv)
{
	(void)srv;
	notify_watchdog();
}

int main(int argc, char **argv)
{
	struct sigaction sa = { .sa_handler = on_signal };
	struct store_opts sopts = { 0 };
	struct server srv = { 0 };
	struct store *store = NULL;
	struct config cfg;
	int print_config = 0, lock_fd = -1, rc;

	config_defaults(&cfg);
	if (parse_args(argc, argv, &cfg, &print_config))
		return 2;
	if (print_config) {
		config_print(stdout, &cfg);
		return 0;
	}
	log_init((enum log_level)cfg.log_level);
	if (cfg.evict_low >= cfg.evict_high) {
		fprintf(stderr, "kvblendd: evict_low (%llu) must be below evict_high (%llu)\n",
			(unsigned long long)cfg.evict_low, (unsigned long long)cfg.evict_high);
		return 2;
	}
	/* Reply buffers of many MiB come and go per request: keep them in the heap for reuse
	 * rather than mmap'ing (and page-faulting) fresh ones every time. */
	mallopt(M_MMAP_THRESHOLD, 256 << 20);
	mallopt(M_TRIM_THRESHOLD, 512 << 20);
	sigemptyset(&sa.sa_mask);
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	signal(SIGPIPE, SIG_IGN);

	notify_status("opening store at %s", cfg.data_dir);
	rc = mkdir_p(cfg.data_dir);
	if (!rc)
		rc = lock_data_dir(cfg.data_dir, &lock_fd);
	if (rc) {
		log_err("data directory %s: %s", cfg.data_dir,
			rc == -EBUSY ? "in use by another kvblendd" : strerror(-rc));
		return 1;
	}
	sopts.dir = cfg.data_dir;
	sopts.map_size = cfg.map_size;
	sopts.max_readers = (unsigned)cfg.max_readers;
	sopts.min_saving = (double)cfg.compress_min_saving / 100.0;
	sopts.no_sync = cfg.no_sync;
	rc = store_open(&sopts, &store);
	if (rc) {
		log_err("cannot open store in %s: %s", cfg.data_dir,
			rc == -EPROTO ? "written by an incompatible kvblend version" : strerror(-rc));
		close(lock_fd);
		return 1;
	}
	notify_status("binding sockets");
	rc = server_start(&srv, &cfg, store);
	if (rc) {
		server_stop(&srv);
		store_close(&store);
		close(lock_fd);
		return 1;
	}
	log_info("kvblendd %s ready; data in %s", KVBLEND_VERSION, cfg.data_dir);
	notify_ready();
	server_run(&srv, &stop_requested, tick);

	notify_stopping();
	log_info("received %s; shutting down", strsignal(stop_requested));
	server_stop(&srv);
	store_close(&store);
	close(lock_fd);
	log_info("stopped");
	return 0;
}
