/*
 * pool — a fixed set of helper threads that split one request's bulk work (a
 * large GET's layers, a fuse layer's chunks) across the CPUs. The calling
 * thread takes part, so a pool of zero threads runs everything inline.
 */
#ifndef KVBLEND_DAEMON_POOL_H
#define KVBLEND_DAEMON_POOL_H

#include <stddef.h>

struct pool;

/* Start n helper threads (0 is valid). Returns 0 or a negative errno. */
int pool_new(unsigned n, struct pool **out);
/* Stop and join the helpers. Accepts NULL; sets *p to NULL. */
void pool_free(struct pool **p);

/*
 * Run fn(arg, i) for every i in [0, n) across the helpers and the caller (p
 * not NULL);
 * return when all have returned. Any number of threads may call this at once.
 * fn returns 0 or a negative errno; the result is the first failure (by
 * completion order), or 0.
 */
int pool_run(struct pool *p, size_t n, int (*fn)(void *arg, size_t i), void *arg);

unsigned pool_threads(const struct pool *p);

#endif
