/* kvblendd — the kvblend KV-cache daemon: start-up, signals and shutdown. */
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <malloc.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/file.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "daemon/config.h"
#include "blend/device.h"
#include "cluster/etcd.h"
#include "daemon/log.h"
#include "daemon/notify.h"
#include "daemon/server.h"

#ifndef KVBLEND_VERSION
#define KVBLEND_VERSION "0.0.0"
#endif

static volatile int stop_requested;
static volatile sig_atomic_t reload_requested;

/* The command line, kept to re-read the config file (and re-apply the flags over it) on
 * SIGHUP exactly as at start. */
static int saved_argc;
static char **saved_argv;
static const char *config_path;

static void on_signal(int sig)
{
	/* A second SIGTERM or SIGINT exits at once, without a graceful shutdown. */
	if (stop_requested)
		_exit(128 + sig);
	stop_requested = sig;
}

static void on_hangup(int sig)
{
	(void)sig;
	reload_requested = 1;
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
	if (blend_devices_cuda_built())
		fprintf(f, "\nDevice cuda and auto: this build's\n  %s;\n"
			   "with an older driver device cuda refuses to start and auto runs the\n"
			   "fuse on the CPU, saying why in the log.\n", blend_devices_cuda_floor());
	else
		fprintf(f, "\nThis build has no CUDA backend: device cuda refuses to start and\n"
			   "auto runs the fuse on the CPU.\n");
	fprintf(f, "\nSIGTERM or SIGINT stop gracefully; a second one exits at once.\n"
		   "SIGHUP re-reads the --config file (flags still override it) and applies\n"
		   "log_level; other changed keys are logged and take effect at the next start.\n"
		   "A file with an error is logged and the running settings are kept.\n");
}

/*
 * Settings from the config file, then the flags over it. At start --help, --version and
 * --print-config-example answer and exit; on reload they cannot be there (the daemon
 * would not be running). Returns 0 or a negative errno with a message in err.
 */
static int parse_args(int argc, char **argv, struct config *cfg, int *print_config, char *err,
		      size_t errlen)
{
	int i, rc;

	/* The file first, so that flags override it wherever they stand. */
	for (i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--config") || !strncmp(argv[i], "--config=", 9)) {
			const char *path = argv[i][8] == '=' ? argv[i] + 9 : argv[i + 1];

			if (!path) {
				snprintf(err, errlen, "--config needs a file");
				return -EINVAL;
			}
			rc = config_load_file(cfg, path, err, errlen);
			if (rc)
				return rc;
			config_path = path;
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
			snprintf(err, errlen, "unexpected argument '%s' (see --help)", arg);
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
			snprintf(err, errlen, "--%s needs a value", key);
			return -EINVAL;
		}
		rc = config_set(cfg, key, value, CONFIG_FLAG, err, errlen);
		if (rc)
			return rc;
	}
	return 0;
}

/* Checks across keys, after every source is read. Returns 0 or -EINVAL with err. */
static int check_settings(const struct config *cfg, char *err, size_t errlen)
{
	if (cfg->evict_low >= cfg->evict_high) {
		snprintf(err, errlen, "evict_low (%llu) must be below evict_high (%llu)",
			 (unsigned long long)cfg->evict_low, (unsigned long long)cfg->evict_high);
		return -EINVAL;
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

/*
 * The keys whose values differ between a and b, comma-separated, from their printed
 * form (config_print), so that every key of the table is covered, now and later.
 * log_level is left out: it is the one applied at run time.
 */
static void changed_keys(const struct config *a, const struct config *b, char *out, size_t len)
{
	char *ta = NULL, *tb = NULL;
	size_t la = 0, lb = 0, n = 0;
	FILE *fa = open_memstream(&ta, &la), *fb = open_memstream(&tb, &lb);
	const char *pa, *pb;
	int rca, rcb;

	snprintf(out, len, "(unknown: out of memory)");
	if (!fa || !fb)
		goto out;
	config_print(fa, a);
	config_print(fb, b);
	rca = fclose(fa);
	rcb = fclose(fb);
	fa = fb = NULL;
	if (rca || rcb || !ta || !tb)
		goto out;
	*out = 0;
	/* Both list the same keys in the same order; a key may span lines (listen). */
	for (pa = ta, pb = tb; *pa && *pb;) {
		size_t ka = strcspn(pa, " "), ea = 0, eb = 0;
		const char *qa = pa, *qb = pb;

		while (!strncmp(qa, pa, ka + 1)) {
			qa += strcspn(qa, "\n");
			qa += *qa == '\n';
		}
		while (!strncmp(qb, pa, ka + 1)) {
			qb += strcspn(qb, "\n");
			qb += *qb == '\n';
		}
		ea = (size_t)(qa - pa);
		eb = (size_t)(qb - pb);
		if ((ea != eb || memcmp(pa, pb, ea)) && strncmp(pa, "log_level ", 10) && n < len)
			n += (size_t)snprintf(out + n, len - n, "%s%.*s", n ? ", " : "", (int)ka,
					      pa);
		if (qb == pb) /* cannot happen with one table; do not loop forever */
			break;
		pa = qa;
		pb = qb;
	}
out:
	if (fa)
		fclose(fa);
	if (fb)
		fclose(fb);
	free(ta);
	free(tb);
}

/*
 * SIGHUP: read the settings again as at start (file, then flags) and apply those that
 * can change while running: log_level. Others that changed are named, for a restart.
 * A file with an error changes nothing. Logs go to stderr (the journal): there is no
 * log file to reopen.
 */
static void reload(struct server *srv)
{
	char err[512], restart[512];
	enum log_level old = log_get_level(), level;
	struct config cfg;
	int print_config = 0;

	notify_reloading();
	config_defaults(&cfg);
	if (parse_args(saved_argc, saved_argv, &cfg, &print_config, err, sizeof(err)) ||
	    check_settings(&cfg, err, sizeof(err))) {
		log_err("SIGHUP: %s; keeping the running settings", err);
		notify_ready();
		return;
	}
	level = (enum log_level)cfg.log_level;
	changed_keys(srv->cfg, &cfg, restart, sizeof(restart));
	/* One line, under the more verbose of the two levels. */
	if (level > old)
		log_set_level(level);
	log_info("SIGHUP: reloaded %s: log_level %s%s%s%s%s",
		 config_path ? config_path : "the command line (no --config file)",
		 log_level_name(old), level == old ? " (unchanged)" : " -> ",
		 level == old ? "" : log_level_name(level),
		 *restart ? "; changed, applied at the next start only: " : "", restart);
	log_set_level(level);
	notify_ready();
}

static void tick(struct server *srv)
{
	if (reload_requested) {
		reload_requested = 0;
		reload(srv);
	}
	notify_watchdog();
}

/*
 * rename() that never replaces: -EEXIST when to is there. Where the file system has
 * no RENAME_NOREPLACE, a look first: the data directory's lock keeps every other
 * kvblendd out, and nothing else makes set-aside names.
 */
static int rename_new(const char *from, const char *to)
{
	struct stat st;

	if (renameat2(AT_FDCWD, from, AT_FDCWD, to, RENAME_NOREPLACE) == 0)
		return 0;
	if (errno != EINVAL && errno != ENOSYS)
		return -errno;
	if (lstat(to, &st) == 0)
		return -EEXIST;
	if (errno != ENOENT)
		return -errno;
	return rename(from, to) ? -errno : 0;
}

/*
 * Move the file at path aside as PATH.truncated-UNIXTIME, or, where a file of that
 * name is there already (an earlier set-aside in the same second),
 * PATH.truncated-UNIXTIME-N for the first N from 2 that is free. 0 with the name in
 * to, or a negative errno.
 */
static int move_aside(const char *path, char *to, size_t len)
{
	long long now = (long long)time(NULL);
	int rc = -EEXIST;

	for (int n = 1; n <= 1000 && rc == -EEXIST; n++) {
		int w = n == 1 ? snprintf(to, len, "%s.truncated-%lld", path, now)
			       : snprintf(to, len, "%s.truncated-%lld-%d", path, now, n);

		if (w < 0 || (size_t)w >= len)
			return -ENAMETOOLONG;
		rc = rename_new(path, to);
	}
	return rc;
}

/*
 * The data file is shorter than its last page, or than LMDB's two meta pages:
 * something other than kvblendd cut it (LMDB never shortens it), and reading a page
 * past its end would kill the daemon, or LMDB cannot open it at all. Its chunks are a
 * cache, which the nodes compute again: move the file aside, kept for inspection, so
 * that the daemon serves with an empty store. A data.mdb that is a symlink (the data
 * on another disk) stays one: the file it names is moved aside next to itself, and
 * an empty file made in its place, so that the new store is where the old one was.
 * 0, or -1 (logged) when it cannot be moved.
 */
static int set_aside(const char *dir)
{
	char link[PATH_MAX], file[PATH_MAX], real[PATH_MAX], to[PATH_MAX + 48];
	char lock[PATH_MAX], via[PATH_MAX + 32] = "";
	struct stat st;
	int rc, fd;

	if (snprintf(link, sizeof(link), "%s/data.mdb", dir) >= (int)sizeof(link) ||
	    snprintf(lock, sizeof(lock), "%s/lock.mdb", dir) >= (int)sizeof(lock)) {
		log_err("the data file in %s is truncated; the path is too long to move it aside",
			dir);
		return -1;
	}
	snprintf(file, sizeof(file), "%s", link);
	rc = lstat(link, &st) ? -errno : 0;
	if (!rc && S_ISLNK(st.st_mode)) {
		if (realpath(link, real)) {
			snprintf(file, sizeof(file), "%s", real);
			snprintf(via, sizeof(via), " (a symlink to %s)", real);
		} else {
			rc = -errno;
			snprintf(via, sizeof(via), " (a symlink)");
		}
	}
	if (!rc && stat(file, &st))
		rc = -errno;
	if (!rc)
		rc = move_aside(file, to, sizeof(to));
	if (rc) {
		log_err("the data file %s%s is truncated (shorter than its last page, or than LMDB's "
			"two meta pages) and cannot be moved aside: %s; move or remove it to start",
			link, via, strerror(-rc));
		return -1;
	}
	/* the link kept: the new store is made where it points, on its disk */
	if (via[0]) {
		fd = open(file, O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0640);
		if (fd < 0) {
			log_err("the truncated data file %s%s was moved to %s, and no new one can be "
				"made in its place: %s", link, via, to, strerror(errno));
			return -1;
		}
		close(fd);
	}
	unlink(lock); /* the reader table of the old file: LMDB makes a new one */
	log_err("the data file %s%s was truncated by something other than kvblendd (%lld bytes, "
		"%s): moved to %s; starting with an empty store, whose chunks the nodes store "
		"again", link, via, (long long)st.st_size,
		st.st_size < 2 * sysconf(_SC_PAGESIZE) ? "shorter than LMDB's two meta pages: it "
		"cannot be opened" : "shorter than its last page; reading past its end would stop "
		"the daemon", to);
	return 0;
}

int main(int argc, char **argv)
{
	struct sigaction sa = { .sa_handler = on_signal };
	struct store_opts sopts = { 0 };
	struct server srv = { 0 };
	struct store *store = NULL;
	struct config cfg;
	char err[512];
	int print_config = 0, lock_fd = -1, rc;

	config_defaults(&cfg);
	if (parse_args(argc, argv, &cfg, &print_config, err, sizeof(err))) {
		fprintf(stderr, "kvblendd: %s\n", err);
		return 2;
	}
	if (print_config) {
		config_print(stdout, &cfg);
		return 0;
	}
	if (check_settings(&cfg, err, sizeof(err))) {
		fprintf(stderr, "kvblendd: %s\n", err);
		return 2;
	}
	saved_argc = argc;
	saved_argv = argv;
	log_init((enum log_level)cfg.log_level);
	/* Reply buffers of many MiB come and go per request: keep them in the heap for reuse
	 * rather than mmap'ing (and page-faulting) fresh ones every time. */
	mallopt(M_MMAP_THRESHOLD, 256 << 20);
	mallopt(M_TRIM_THRESHOLD, 512 << 20);
	sigemptyset(&sa.sa_mask);
	sigaction(SIGTERM, &sa, NULL);
	sigaction(SIGINT, &sa, NULL);
	sa.sa_handler = on_hangup;
	sigaction(SIGHUP, &sa, NULL);
	signal(SIGPIPE, SIG_IGN);
	if (cfg.cluster_etcd[0] && etcd_global_init()) { /* before any thread: libcurl's rule */
		log_err("cannot initialize libcurl for etcd");
		return 1;
	}

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
	sopts.verify = (enum store_verify)cfg.verify;
	sopts.verify_ttl_s = (unsigned)cfg.verify_ttl;
	rc = store_open(&sopts, &store);
	if (rc == -EUCLEAN && set_aside(cfg.data_dir) == 0)
		rc = store_open(&sopts, &store); /* an empty store in its place */
	if (rc) {
		log_err("cannot open store in %s: %s", cfg.data_dir,
			rc == -EPROTO ? "written by an incompatible kvblend version" :
			rc == -EUCLEAN ? "its data file is truncated" : strerror(-rc));
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
