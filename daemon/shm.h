/*
 * shm — shared-memory segments that local clients attach to, so that bulk
 * tensors cross between the daemon and a client on the same machine without
 * socket copies. ZeroMQ then carries only the header frames.
 *
 * The daemon creates each segment (POSIX shm, mode from socket_mode), the
 * client maps it by name; the name is unlinked at the first request that uses
 * it, so a crash of either side leaves nothing behind. Segments unused for
 * shm_idle seconds are released. Thread-safe.
 *
 * Trust: a local client that truncates its segment while the daemon copies into
 * it makes the daemon fault; IPC clients are trusted local users (the socket is
 * mode 0660), as they are for everything else they can do to the cache.
 */
#ifndef KVBLEND_DAEMON_SHM_H
#define KVBLEND_DAEMON_SHM_H

#include <stddef.h>
#include <stdint.h>

struct shm_table;

/* max_one: largest segment; max_total: all together (0 disables); idle_s: lifetime unused. */
int shm_table_new(uint64_t max_one, uint64_t max_total, uint64_t idle_s, unsigned mode,
		  struct shm_table **out);
/* Unmap and unlink every segment. Accepts NULL. */
void shm_table_free(struct shm_table **t);

/*
 * Create a segment of size bytes. Returns 0 with its id and name (name_len >=
 * 64), -E2BIG above max_one, -ENOSPC when max_total would be exceeded, or a
 * negative errno from shm_open/ftruncate/mmap.
 */
int shm_create(struct shm_table *t, uint64_t size, uint64_t *id, char *name, size_t name_len);

/*
 * A segment for a fuse session's shared ring: like shm_create(), but when it is
 * released it stays (named, mapped) in a small cache, and a later ring of the
 * same size (up to twice smaller) reuses it: no page faults, no zeroing. Its
 * name is never unlinked while cached; stale ones of a dead daemon are swept at
 * start. *actual receives the segment's size.
 */
int shm_create_ring(struct shm_table *t, uint64_t size, uint64_t *id, char *name, size_t name_len,
		    uint64_t *actual);

/*
 * Borrow [offset, offset+length) of segment id for one request; returns 0 and
 * the address, -ENOENT for an unknown id, -ERANGE when the span is outside the
 * segment. Every successful call is paired with shm_release().
 */
int shm_acquire(struct shm_table *t, uint64_t id, uint64_t offset, uint64_t length, void **addr);
void shm_release(struct shm_table *t, uint64_t id);

/*
 * Hold the whole of segment id for the daemon's own use (a fuse session's
 * shared ring), without unlinking its name: the client has yet to map it.
 * Pair with shm_release(). Returns 0 or -ENOENT.
 */
int shm_hold(struct shm_table *t, uint64_t id, void **base);

/* Release a segment now (it is unmapped once no request uses it). -ENOENT if unknown. */
int shm_detach(struct shm_table *t, uint64_t id);

/* Release segments idle for longer than idle_s; returns how many. Call periodically. */
unsigned shm_expire(struct shm_table *t);

/* Segments attached and their bytes. */
void shm_usage(struct shm_table *t, uint64_t *count, uint64_t *bytes);

#endif
