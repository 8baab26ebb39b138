/*
 * shm — shared-memory segments that local clients map, so that bulk tensors
 * cross between the daemon and a client on the same machine without socket
 * copies. ZeroMQ then carries only the header frames.
 *
 * A segment is a sealed memfd: its size cannot change (F_SEAL_SHRINK, GROW),
 * so a client cannot truncate it under the daemon, and it has no name in
 * /dev/shm that another local user could open. The client gets its file
 * descriptor over a Unix socket beside the IPC endpoint (shm_serve), which
 * checks the peer's credentials: only the segment's owner receives it.
 *
 * Every segment belongs to one owner, the principal of the client that made it
 * (server.c: "ipc:UID:GID:PID"), and is of one kind: a client segment (the
 * client's requests name it) or a fuse ring (only the daemon uses it; the
 * client maps it read-only). Requests reach only client segments of their own
 * owner. A released ring is kept for a later session of the same owner.
 * Segments unused for shm_idle seconds are released. Thread-safe.
 */
#ifndef KVBLEND_DAEMON_SHM_H
#define KVBLEND_DAEMON_SHM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct shm_table;

/* Longest owner string, NUL included. */
#define SHM_OWNER_MAX 96

/*
 * max_one: largest segment; max_total: all together (0 disables); idle_s: lifetime
 * unused; per_owner: client segments one owner may hold at once.
 */
int shm_table_new(uint64_t max_one, uint64_t max_total, uint64_t idle_s, unsigned per_owner,
		  struct shm_table **out);
/* Stop serving descriptors, unmap and close every segment. Accepts NULL. */
void shm_table_free(struct shm_table **t);

/*
 * Hand out segment descriptors on a Unix stream socket at path (created with
 * mode; an old file there is replaced): a client connects, sends the 8-byte
 * segment id (little-endian) and receives one status byte (0: ok) with the
 * descriptor attached (SCM_RIGHTS) when its credentials are the segment's owner.
 * Returns 0 or a negative errno. Until this runs, shm_path() is empty.
 */
int shm_serve(struct shm_table *t, const char *path, unsigned mode);
/* The socket path clients fetch descriptors from ("" when not serving). */
const char *shm_path(const struct shm_table *t);

/*
 * Memory handed in: a client sends KVBP_DEPOSIT_REQUEST (proto/wire.h), a 4-byte count
 * n (1 to SHM_DEPOSIT_SEGMENTS_MAX) and n (offset, size) pairs of 8 bytes each, all
 * little-endian, with the n descriptors attached (SCM_RIGHTS) in that order: descriptor
 * k's memory is [offset, offset + size) of one extent (a GPU cache reserved as one range
 * of addresses and backed by one allocation per segment; a memfd alone: offset 0, size
 * 0 for the whole file). It gets a status byte, and when it is SHM_DEPOSIT_OK the
 * deposit's 8-byte token (little-endian). The daemon keeps the descriptors, for that
 * client (its credentials: "ipc:UID:GID:PID") only, until the process exits (a pidfd
 * tells); the same files at the same places handed in again keep their token. It
 * refuses one of its own segments (a client holds those descriptors). This is how a
 * node names memory the daemon is to write into (device landing): by descriptors only
 * it could send, never a path or number another local process could name too.
 */
#define SHM_DEPOSIT_SEGMENTS_MAX 128
#define SHM_DEPOSIT_EXTENT_MAX (UINT64_C(1) << 44) /* 16 TiB */
enum shm_deposit_status {
	SHM_DEPOSIT_OK = 0,
	SHM_DEPOSIT_REFUSED = 1,  /* cannot be kept (its process cannot be watched) */
	SHM_DEPOSIT_NO_FD = 2,	  /* no descriptor came with the request */
	SHM_DEPOSIT_OWN = 3,	  /* one of kvblendd's own segments */
	SHM_DEPOSIT_TOO_MANY = 4, /* the client holds 16 already */
	SHM_DEPOSIT_FULL = 5,	  /* 64 are held, all clients together */
	SHM_DEPOSIT_MALFORMED = 6, /* the table: a count or place out of range, out of
				    * order, or not one descriptor each */
};

/* One descriptor of a deposit, at its place in the extent. */
struct shm_fd_seg {
	int fd;
	uint64_t offset, size; /* size 0: the whole file (a deposit of one) */
};

/*
 * New descriptors (the caller closes each and frees *out) of what owner handed in under
 * token, with their places: 0 and *out[*n], or -ENOENT (no such token, another
 * owner's, or its process has exited), -ENOMEM, -errno.
 */
int shm_deposit_take(struct shm_table *t, uint64_t token, const char *owner,
		     struct shm_fd_seg **out, unsigned *n);

/*
 * Create a client segment of size bytes for owner. Returns 0 with its id, -E2BIG
 * above max_one (or for 0), -ENOSPC when max_total would be exceeded, -EMFILE when
 * every slot is taken, -EDQUOT when owner holds per_owner segments already, or a
 * negative errno from memfd_create/ftruncate/mmap.
 */
int shm_create(struct shm_table *t, uint64_t size, const char *owner, uint64_t *id);

/*
 * A fuse session's ring for owner: like shm_create(), but not counted against
 * per_owner, and when it is released it stays mapped in a small cache, so that a
 * later ring of the same owner and size (up to twice smaller) reuses it: no page
 * faults, no zeroing. Rings are never reused across owners. *actual receives the
 * segment's size.
 */
int shm_create_ring(struct shm_table *t, uint64_t size, const char *owner, uint64_t *id,
		    uint64_t *actual);

/*
 * Borrow [offset, offset+length) of owner's client segment id for one request;
 * returns 0 and the address, -ENOENT for an id that is unknown, a ring, or
 * another owner's, -ERANGE when the span is outside the segment. Every
 * successful call is paired with shm_release().
 */
int shm_acquire(struct shm_table *t, uint64_t id, const char *owner, uint64_t offset,
		uint64_t length, void **addr);
void shm_release(struct shm_table *t, uint64_t id);

/* Hold the whole of segment id (any kind) for the daemon's own use. Pair with shm_release(). */
int shm_hold(struct shm_table *t, uint64_t id, void **base);

/*
 * Release a segment now (it is unmapped once no request uses it). With an owner,
 * only that owner's client segment; with NULL (the daemon itself), any. -ENOENT
 * if there is no such segment.
 */
int shm_detach(struct shm_table *t, uint64_t id, const char *owner);

/* Release segments idle for longer than idle_s; returns how many. Call periodically. */
unsigned shm_expire(struct shm_table *t);

/* Segments attached and their bytes. */
void shm_usage(struct shm_table *t, uint64_t *count, uint64_t *bytes);

/*
 * Pinning in place: the fuse device's page-locking of a ring segment (CUDA's
 * cudaHostRegister), so that copies between the ring and the device run at full
 * speed. A segment is pinned once for its life, not per session: it stays pinned
 * while it waits in the ring cache for its owner's next session, and is unpinned
 * only before it is unmapped. Unpinning stalls the device, so a pinned segment's
 * unmapping, wherever it is decided (a detach, an eviction from the cache, an idle
 * expiry on the thread that serves sockets), is deferred to shm_reap(), which the
 * caller runs on a thread of its own. The bytes of a segment waiting there no longer
 * count against max_total (it is unmapped within one reap).
 */
struct shm_pinner {
	int (*pin)(void *ctx, void *base, size_t bytes); /* 0 or a negative errno */
	void (*unpin)(void *ctx, void *base);
	void *ctx;
};

/*
 * Install pinner p (copied), or with NULL remove it: every segment still pinned is
 * unpinned first (call it when no session holds one: at shutdown, before the device
 * goes) and those waiting for shm_reap() are unmapped.
 */
void shm_set_pinner(struct shm_table *t, const struct shm_pinner *p);

/*
 * Pin segment id (held by the caller: shm_hold()) in place, all of its size, unless
 * it is pinned already. Returns 0 with *fresh true when this call pinned it and false
 * when it was pinned before (a ring reused from the cache); -ENOENT for an unknown
 * id, -ENODEV with no pinner, -EBUSY while another thread pins it, or the pinner's
 * errno (the segment is then not pinned; a later call tries again).
 */
int shm_pin(struct shm_table *t, uint64_t id, bool *fresh);

/*
 * Unpin and unmap the pinned segments released since the last call. Call it off the
 * thread that serves sockets (kvblendd: the fuse's expiry thread, once a second).
 * Returns how many.
 */
unsigned shm_reap(struct shm_table *t);

/* Segments pinned now, and pins and unpins since the table was made. */
void shm_pin_counts(struct shm_table *t, uint64_t *pinned, uint64_t *pins, uint64_t *unpins);

#endif
