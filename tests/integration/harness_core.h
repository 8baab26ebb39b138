/*
 * harness_core — a real kvblendd of one's own, for the tests and the benchmarks alike: a
 * fresh temporary directory (data, IPC socket, log), the daemon started there and
 * ready when a ping through libkvblend succeeds, stopped and removed. No cmocka: every
 * function returns what went wrong, and harness.h asserts it for the tests while
 * bench/bench_common.h exits.
 */
#ifndef KVBLEND_TESTS_HARNESS_CORE_H
#define KVBLEND_TESTS_HARNESS_CORE_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

struct daemon {
	pid_t pid; /* 0 when not running */
	char dir[256];
	char data_dir[300];
	char endpoint[320];
	char log_path[300];
};

/*
 * Clear d and make a fresh directory PREFIX-XXXXXX (prefix: "/tmp/kvb-test") for it:
 * d->data_dir, d->endpoint (ipc://DIR/kvblend.sock) and d->log_path lie inside. 0, or
 * -errno from mkdtemp (d->dir then empty).
 */
int daemon_prepare(struct daemon *d, const char *prefix);

/*
 * Start the kvblendd at path on d's directory (d prepared, not running): its arguments
 * --data-dir d->data_dir --listen d->endpoint, then defaults, then extra (both
 * NULL-terminated, either NULL; a later --listen adds an endpoint), its output appended
 * to d->log_path. Returns 0 once a ping on d->endpoint succeeds (within about 10 s);
 * -ECHILD when it exited first (the log's tail printed to stderr, d->pid 0), -ETIMEDOUT
 * when it never answered (still running: daemon_remove kills it), -errno from fork.
 */
int daemon_spawn(struct daemon *d, const char *path, const char *const *defaults,
		 const char *const *extra);

/*
 * Wait up to 30 s for the running daemon to exit (after a signal the caller sent, or
 * SIGTERM first when terminate); d->pid is 0 afterwards. 0 when it exited with status 0;
 * -ETIMEDOUT when it had to be killed; otherwise the wait status (positive), the log's
 * tail printed to stderr. 0 when d was not running.
 */
int daemon_reap(struct daemon *d, int terminate);

/* Kill the daemon if still running and remove d's directory (kept when KVB_KEEP_TMP is set). */
void daemon_remove(struct daemon *d);

/* The last lines of d's log to stderr. */
void daemon_log_tail(const struct daemon *d, int lines);

/* n deterministic small normal f16 values (sign, exponent 13..16, random mantissa) from seed. */
void fill_f16(uint16_t *p, size_t n, uint32_t seed);

/*
 * A TCP port on 127.0.0.1 that nothing listens on now and that this process never handed
 * out before; -1 (said on stderr) when none is found.
 */
int free_tcp_port(void);

#endif
