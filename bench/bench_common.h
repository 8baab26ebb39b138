/*
 * bench_common — what the benchmarks share: a monotonic clock, medians, and a
 * kvblendd of their own on a temporary directory. Header-only; benchmarks only.
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

static inline double now_s(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec / 1e9;
}

/*
 * n f16 values of magnitude 2^-2..2^1 with random mantissas and signs, from seed (an
 * xorshift stream: the same seed gives the same values).
 */
static inline void bench_fill_f16(uint16_t *p, size_t n, uint64_t seed)
{
	uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;

	for (size_t i = 0; i < n; i++) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		p[i] = (uint16_t)((x >> 63) << 15 | (13 + (x >> 20 & 3)) << 10 | (x & 0x3ff));
	}
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

/* A comma-separated list of counts ("4096,32768") into v, at most max of them; how many. */
/* The median of v[0..n) (sorts v); n >= 1. */
static inline double bench_median(double *v, int n)
{
	qsort(v, (size_t)n, sizeof(double), cmp_double);
	return v[n / 2];
}

static inline unsigned bench_parse_list(char *s, unsigned *v, unsigned max)
{
	char *save, *tok;
	unsigned n = 0;

	for (tok = strtok_r(s, ",", &save); tok && n < max; tok = strtok_r(NULL, ",", &save))
		v[n++] = (unsigned)atoi(tok);
	return n;
}

/* The kvblendd next to this benchmark binary (argv0), into path. */
static inline void bench_default_daemon(const char *argv0, char *path, size_t len)
{
	const char *slash = strrchr(argv0, '/');

	snprintf(path, len, "%.*skvblendd", slash ? (int)(slash - argv0 + 1) : 0, argv0);
}

/*
 * Start kvblendd on dir/data and ipc://dir/kvblend.sock (endpoint written to ep)
 * with --no-sync unless sync, and wait until it answers. Exits on failure. extra:
 * more options, NULL-terminated; an extra --listen replaces the default one (it must
 * name ep among its endpoints: the wait connects there).
 */
static inline pid_t bench_start_daemon_with(const char *path, const char *dir, char *ep,
					    size_t ep_len, int sync, const char *const *extra)
{
	char data[300];
	pid_t pid;

	snprintf(data, sizeof(data), "%s/data", dir);
	snprintf(ep, ep_len, "ipc://%s/kvblend.sock", dir);
	pid = fork();
	if (pid == 0) {
		const char *argv[32] = { path, "--data-dir", data, "--map-size", "64G",
					 "--max-message", "1G", "--log-level", "warn" };
		int n = 9, listen = 0;

		for (int i = 0; extra && extra[i]; i++)
			listen |= !strcmp(extra[i], "--listen");
		if (!listen) {
			argv[n++] = "--listen";
			argv[n++] = ep;
		}
		if (!sync)
			argv[n++] = "--no-sync";
		for (int i = 0; extra && extra[i] && n < 31; i++)
			argv[n++] = extra[i];
		execv(path, (char *const *)argv);
		_exit(127);
	}
	for (int i = 0; i < 100; i++) {
		struct kvb_connect_opts o = { .timeout_ms = 200 };
		kvb_client *c;

		if (kvb_connect(ep, &o, &c, NULL, 0) == 0) {
			kvb_close(&c);
			return pid;
		}
		usleep(50000);
	}
	fprintf(stderr, "benchmark: kvblendd (%s) did not start\n", path);
	kill(pid, SIGKILL);
	exit(1);
}

static inline pid_t bench_start_daemon(const char *path, const char *dir, char *ep, size_t ep_len,
				       int sync)
{
	return bench_start_daemon_with(path, dir, ep, ep_len, sync, NULL);
}

/* Stop the daemon and remove its directory. */
static inline void bench_stop_daemon(pid_t pid, const char *dir)
{
	char cmd[300];
	int status;

	kill(pid, SIGTERM);
	waitpid(pid, &status, 0);
	snprintf(cmd, sizeof(cmd), "rm -rf '%s'", dir);
	if (system(cmd) < 0)
		perror("system");
}

#endif
