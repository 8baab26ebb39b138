/*
 * bench_onecopy — the ways to move a chunk's bytes from one process's page cache
 * into another process's private buffer, against memcpy in the same run: why a GET
 * into a private buffer goes through the shared segment (two copies, overlapped)
 * and not one of the kernel's one-copy paths (docs/benchmarks.md, issue 34).
 *
 * usage: bench_onecopy [--sizes 8,32] [--rounds N]
 *
 * For each size: a file of that size in $TMPDIR (or /tmp), read once so that it is
 * in the page cache, and mapped MAP_SHARED read-only (as kvblendd maps LMDB):
 *   memcpy       from the mapping into a private buffer, one thread;
 *   2 copies     two such memcpys at once on two threads (the bytes a second through
 *                both: a GET through the shared segment can reach this at best);
 *   vmsplice     a child process vmsplice()s the mapping into a pipe of 1 MiB, the
 *                parent read()s it into its private buffer (one copy, by the kernel);
 *   vm_writev    a child process_vm_writev()s the mapping into the parent's buffer
 *                (one copy, by the kernel; needs ptrace rights over the target).
 * Each figure is the median GB/s of N rounds, and its ratio to memcpy's.
 */
#ifndef _GNU_SOURCE
#define _GNU_SOURCE
#endif
#include <errno.h>
#include <fcntl.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "bench/bench_common.h"

#define PIPE_BYTES (1u << 20)
#define MAX_ROUNDS 1000

/* Read exactly n bytes from fd into p; 0 or -1. */
static int read_all(int fd, uint8_t *p, size_t n)
{
	while (n) {
		ssize_t k = read(fd, p, n);

		if (k <= 0) {
			if (k < 0 && errno == EINTR)
				continue;
			return -1;
		}
		p += k;
		n -= (size_t)k;
	}
	return 0;
}

/*
 * After the rounds of one method (what): reap its child and check that dst holds fill.
 * 0, or -1 said on stderr.
 */
static int child_moved_fill(pid_t pid, const uint8_t *dst, const uint8_t *fill, size_t bytes,
			    const char *what)
{
	waitpid(pid, NULL, 0);
	if (!memcmp(dst, fill, bytes))
		return 0;
	fprintf(stderr, "bench_onecopy: %s moved other bytes\n", what);
	return -1;
}

static int one_size(size_t bytes, int rounds)
{
	char path[256];
	const char *tmp = getenv("TMPDIR");
	uint8_t *src, *dst = malloc(bytes), *dst2 = malloc(bytes), *fill = malloc(bytes);
	double mc[MAX_ROUNDS], two[MAX_ROUNDS], vs[MAX_ROUNDS], pw[MAX_ROUNDS];
	int fd, p[2] = { -1, -1 }, q[2] = { -1, -1 }, rc = 1;
	struct bench_copier cp = { 0 };
	pid_t pid;

	snprintf(path, sizeof(path), "%s/kvb-onecopy-XXXXXX", tmp && *tmp ? tmp : "/tmp");
	fd = mkstemp(path);
	if (fd < 0 || !dst || !dst2 || !fill)
		return 1;
	unlink(path);
	for (size_t i = 0; i < bytes; i++)
		fill[i] = (uint8_t)(i * 131 + 7);
	if (pwrite(fd, fill, bytes, 0) != (ssize_t)bytes)
		return 1;
	src = mmap(NULL, bytes, PROT_READ, MAP_SHARED, fd, 0);
	if (src == MAP_FAILED)
		return 1;
	memcpy(dst, src, bytes); /* in the page cache, mapped */
	memset(dst2, 1, bytes);
	cp.src = src;
	cp.dst = dst2;
	cp.len = bytes;
	for (int r = 0; r < rounds; r++) {
		double t = now_s();

		memcpy(dst, src, bytes);
		mc[r] = (double)bytes / (now_s() - t) / 1e9;
	}
	if (bench_copier_start(&cp))
		return 1;
	for (int r = 0; r < rounds; r++) {
		double t = now_s();

		bench_two_copies(&cp, dst, src, bytes);
		two[r] = (double)bytes / (now_s() - t) / 1e9;
	}
	bench_copier_stop(&cp);
	/* vmsplice: the child gives the mapping's pages to a pipe, the parent reads them */
	if (pipe(p) || pipe(q))
		return 1;
	fcntl(p[1], F_SETPIPE_SZ, (int)PIPE_BYTES);
	pid = fork();
	if (pid == 0) {
		char c;

		close(p[0]);
		for (int r = 0; r < rounds; r++) {
			if (read(q[0], &c, 1) != 1)
				_exit(1);
			for (size_t off = 0; off < bytes;) {
				struct iovec v = { src + off, bytes - off };
				ssize_t k = vmsplice(p[1], &v, 1, 0);

				if (k <= 0)
					_exit(1);
				off += (size_t)k;
			}
		}
		_exit(0);
	}
	close(p[1]);
	p[1] = -1;
	memset(dst, 0, bytes);
	for (int r = 0; r < rounds; r++) {
		double t = now_s();

		if (write(q[1], "g", 1) != 1 || read_all(p[0], dst, bytes))
			goto out;
		vs[r] = (double)bytes / (now_s() - t) / 1e9;
	}
	if (child_moved_fill(pid, dst, fill, bytes, "vmsplice"))
		goto out;
	close(p[0]);
	close(q[0]);
	close(q[1]);
	p[0] = q[0] = q[1] = -1;
	/* process_vm_writev: the child writes straight into the parent's buffer */
	if (pipe(p) || pipe(q))
		return 1;
	memset(dst, 0, bytes);
	{
		pid_t parent = getpid();

		pid = fork();
		if (pid == 0) {
			char c;

			for (int r = 0; r < rounds; r++) {
				struct iovec l = { src, bytes }, rv = { dst, bytes };

				if (read(p[0], &c, 1) != 1 ||
				    process_vm_writev(parent, &l, 1, &rv, 1, 0) != (ssize_t)bytes)
					_exit(1);
				if (write(q[1], &c, 1) != 1)
					_exit(1);
			}
			_exit(0);
		}
	}
	for (int r = 0; r < rounds; r++) {
		char c = 'w';
		double t = now_s();

		if (write(p[1], &c, 1) != 1 || read(q[0], &c, 1) != 1) {
			fprintf(stderr, "bench_onecopy: process_vm_writev failed (ptrace rights?)\n");
			goto out;
		}
		pw[r] = (double)bytes / (now_s() - t) / 1e9;
	}
	if (child_moved_fill(pid, dst, fill, bytes, "process_vm_writev"))
		goto out;
	{
		double m = bench_median(mc, rounds), t2 = bench_median(two, rounds), v = bench_median(vs, rounds),
		       w = bench_median(pw, rounds);

		printf("| %3zu MiB | %5.2f | %5.2f (%.2fx) | %5.2f (%.2fx) | %5.2f (%.2fx) |\n",
		       bytes >> 20, m, t2, t2 / m, v, v / m, w, w / m);
	}
	rc = 0;
out:
	for (int i = 0; i < 2; i++) {
		if (p[i] >= 0)
			close(p[i]);
		if (q[i] >= 0)
			close(q[i]);
	}
	munmap(src, bytes);
	close(fd);
	free(dst);
	free(dst2);
	free(fill);
	return rc;
}

int main(int argc, char **argv)
{
	unsigned sizes[8] = { 8, 32 }, n = 2;
	int rounds = 100;

	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--sizes") && i + 1 < argc) {
			n = bench_parse_list(argv[++i], sizes, 8);
		} else if (!strcmp(argv[i], "--rounds") && i + 1 < argc) {
			rounds = atoi(argv[++i]);
			if (rounds < 1 || rounds > MAX_ROUNDS)
				rounds = 100;
		} else {
			fprintf(stderr, "usage: bench_onecopy [--sizes 8,32] [--rounds N]\n");
			return 2;
		}
	}
	signal(SIGPIPE, SIG_IGN);
	printf("kvblend bench_onecopy: from a page-cache mapping into a private buffer, median "
	       "GB/s of %d rounds (ratio to memcpy in this run)\n\n", rounds);
	printf("| chunk | memcpy | 2 copies at once | vmsplice + read | process_vm_writev |\n");
	printf("|---|---|---|---|---|\n");
	for (unsigned s = 0; s < n; s++)
		if (one_size((size_t)sizes[s] << 20, rounds))
			return 1;
	return 0;
}
