/*
 * bench_common — what the benchmarks share: a monotonic clock, medians, copies to
 * measure against, and their kvblendd's options (started and stopped through the test
 * harness's core, tests/integration/harness_core.h). Header-only; benchmarks only.
 */
#ifndef KVBLEND_BENCH_COMMON_H
#define KVBLEND_BENCH_COMMON_H

#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "client/include/kvblend.h"
#include "tests/integration/harness_core.h"

static inline double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

static inline int cmp_double(const void *a, const void *b)
{
	double x = *(const double *)a, y = *(const double *)b;

	return x < y ? -1 : x > y;
}

/*
 * "2 copies": a thread that copies src to dst (len bytes) each time the caller makes
 * its own copy in bench_two_copies(), so that two memcpys run at once: the bound of a
 * GET into a private buffer (two copies, overlapped). bench_copier_start() before,
 * bench_copier_stop() after; link with Threads::Threads.
 */
struct bench_copier {
	pthread_barrier_t go, done;
	pthread_t thread;
	const void *src;
	void *dst;
	size_t len;
	bool stop;
};

static inline void *bench_copier_main(void *arg)
{
	struct bench_copier *c = arg;

	for (;;) {
		pthread_barrier_wait(&c->go);
		if (c->stop)
			return NULL;
		memcpy(c->dst, c->src, c->len);
		pthread_barrier_wait(&c->done);
	}
}

/* 0, or -1 when the thread cannot be started. */
static inline int bench_copier_start(struct bench_copier *c)
{
	c->stop = false;
	pthread_barrier_init(&c->go, NULL, 2);
	pthread_barrier_init(&c->done, NULL, 2);
	return pthread_create(&c->thread, NULL, bench_copier_main, c) ? -1 : 0;
}

/* Copy len bytes from src to dst here while the copier makes its copy; both done. */
static inline void bench_two_copies(struct bench_copier *c, void *dst, const void *src,
				    size_t len)
{
	pthread_barrier_wait(&c->go);
	memcpy(dst, src, len);
	pthread_barrier_wait(&c->done);
}

static inline void bench_copier_stop(struct bench_copier *c)
{
	c->stop = true;
	pthread_barrier_wait(&c->go);
	pthread_join(c->thread, NULL);
	pthread_barrier_destroy(&c->go);
	pthread_barrier_destroy(&c->done);
}

/* The median of v[0..n) (sorts v); n >= 1. */
static inline double bench_median(double *v, int n)
{
	qsort(v, (size_t)n, sizeof(double), cmp_double);
	return v[n / 2];
}

/*
 * A count option's value s (name: the option, for the message): 1..max, else said on
 * stderr and the benchmark exits 2 (a usage error).
 */
static inline int bench_count_arg(const char *name, const char *s, int max)
{
	int n = atoi(s);

	if (n < 1 || n > max) {
		fprintf(stderr, "%s: 1..%d\n", name, max);
		exit(2);
	}
	return n;
}

/* A comma-separated list of counts ("4096,32768") into v, at most max of them; how many. */
static inline unsigned bench_parse_list(char *s, unsigned *v, unsigned max)
{
	char *save, *tok;
	unsigned n = 0;

	for (tok = strtok_r(s, ",", &save); tok && n < max; tok = strtok_r(NULL, ",", &save))
		v[n++] = (unsigned)atoi(tok);
	return n;
}

/*
 * The kvblendd a benchmark starts, into path: the one given as --daemon PATH, taken out
 * of argv (*argc lessened by 2: the caller's option loop never sees it), else the one
 * next to the benchmark's binary (argv[0]).
 */
static inline void bench_daemon_arg(int *argc, char **argv, char *path, size_t len)
{
	const char *slash = strrchr(argv[0], '/');

	snprintf(path, len, "%.*skvblendd", slash ? (int)(slash - argv[0] + 1) : 0, argv[0]);
	for (int i = 1; i + 1 < *argc; i++) {
		if (strcmp(argv[i], "--daemon"))
			continue;
		snprintf(path, len, "%s", argv[i + 1]);
		memmove(&argv[i], &argv[i + 2], (size_t)(*argc - i - 1) * sizeof(*argv));
		*argc -= 2;
		break;
	}
}

/* The options of every benchmark's daemon: room for the largest chunks, warnings only. */
#define BENCH_DAEMON_OPTIONS "--map-size", "64G", "--max-message", "1G", "--log-level", "warn"

/*
 * Start the kvblendd at path on d, prepared with daemon_prepare() (files its options name
 * may lie in d->dir): the benchmarks' options, --no-sync unless sync, then extra
 * (NULL-terminated, or NULL). Exits, d removed, when it does not answer.
 */
static inline void bench_spawn_daemon(struct daemon *d, const char *path, bool sync,
				      const char *const *extra)
{
	static const char *const quick[] = { BENCH_DAEMON_OPTIONS, "--no-sync", NULL };
	static const char *const durable[] = { BENCH_DAEMON_OPTIONS, NULL };
	int rc = daemon_spawn(d, path, sync ? durable : quick, extra);

	if (rc) {
		fprintf(stderr, "benchmark: kvblendd (%s) did not start: %s; see %s\n", path,
			strerror(-rc), d->log_path);
		daemon_remove(d);
		exit(1);
	}
}

/* bench_spawn_daemon on a fresh temporary directory; exits when either fails. */
static inline void bench_start_daemon(struct daemon *d, const char *path, bool sync,
				      const char *const *extra)
{
	int rc = daemon_prepare(d, "/tmp/kvb-bench");

	if (rc) {
		fprintf(stderr, "benchmark: no temporary directory: %s\n", strerror(-rc));
		exit(1);
	}
	bench_spawn_daemon(d, path, sync, extra);
}

/*
 * A client of d, timeout_ms its calls' limit (0: libkvblend's 5 s), over frames only when
 * no_shm; exits, d removed, when it cannot connect.
 */
static inline kvb_client *bench_connect(struct daemon *d, int timeout_ms, bool no_shm)
{
	struct kvb_connect_opts o = { .timeout_ms = timeout_ms, .no_shm = no_shm };
	kvb_client *c;
	char err[256];

	if (kvb_connect(d->endpoint, &o, &c, err, sizeof(err))) {
		fprintf(stderr, "benchmark: cannot connect to %s: %s\n", d->endpoint, err);
		daemon_remove(d);
		exit(1);
	}
	return c;
}

/* SIGTERM the daemon (said on stderr when it exits unclean) and remove its directory. */
static inline void bench_stop_daemon(struct daemon *d)
{
	int rc = daemon_reap(d, 1);

	if (rc)
		fprintf(stderr, "benchmark: kvblendd exited unclean (%d); its log above\n", rc);
	daemon_remove(d);
}

#endif
