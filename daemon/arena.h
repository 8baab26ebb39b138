/*
 * arena — ranges of one region the caller already holds, handed out and taken back
 * first-fit: the fuse's reserved device and pinned memory (fuse_device_reserve),
 * from which sessions' blocks are carved with no call into the device, so that a
 * session's open never waits on cudaMalloc or cudaMallocHost, and its close never
 * on a free. The arena owns only its bookkeeping, never the region. Not
 * thread-safe: the caller locks.
 */
#ifndef KVBLEND_DAEMON_ARENA_H
#define KVBLEND_DAEMON_ARENA_H

#include <stdbool.h>
#include <stddef.h>

struct arena;

/*
 * An arena over [base, base + bytes); ranges start at multiples of align (a power of
 * two) from base and have sizes rounded up to it. Returns 0, -EINVAL (align not a
 * power of two, or bytes 0) or -ENOMEM.
 */
int arena_new(void *base, size_t bytes, size_t align, struct arena **out);
/* Free the bookkeeping (not the region). Accepts NULL. */
void arena_free(struct arena **a);

/*
 * A range of at least bytes: 0 with *out and *got (its size, bytes rounded up to
 * align), -ENOMEM when no free range is that large (or on bookkeeping memory), and
 * -EINVAL for 0 bytes. *out and *got untouched on failure.
 */
int arena_take(struct arena *a, size_t bytes, void **out, size_t *got);

/* Give back the range at p (as arena_take gave it): 0, or -EINVAL when p starts none. */
int arena_give(struct arena *a, void *p);

/* Whether p lies in the arena's region. */
bool arena_owns(const struct arena *a, const void *p);

/* Bytes handed out now (rounded sizes), and the region's size. */
void arena_usage(const struct arena *a, size_t *used, size_t *bytes);

#endif
