/*
 * held — replies the daemon is still sending from the store's pages (zero-copy
 * GETs). Each holds an LMDB read snapshot until ZeroMQ has sent its last frame,
 * and while a snapshot is held, pages freed after it cannot be reused: a client
 * that never reads its replies would grow the map for everyone until every PUT is
 * answered `full`. So every such reply is registered here with the connection it
 * goes to, and a connection that leaves one unsent past a deadline is shut down:
 * ZeroMQ then drops what it still queued for it, which ends the snapshot.
 */
#ifndef KVBLEND_DAEMON_HELD_H
#define KVBLEND_DAEMON_HELD_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <sys/types.h>

/* One reply in the registry; embedded in the reply's buffer. */
struct held_reply {
	struct held_reply *prev, *next;
	int fd;		  /* the connection's descriptor (ZeroMQ's), -1 unknown */
	ino_t ino;	  /* its socket's inode when registered: the same connection later */
	int64_t since_ms; /* monotonic */
	bool cut;	  /* its connection was shut down already */
	char who[96];	  /* the client, for the log */
};

struct held_replies {
	pthread_mutex_t lock;
	struct held_reply head; /* oldest first after head */
	atomic_uint_fast64_t count, cut; /* held now; connections shut down */
};

void held_init(struct held_replies *h);
void held_destroy(struct held_replies *h);

/* Register r, sent over connection fd (-1: unknown, never shut down) to who. */
void held_add(struct held_replies *h, struct held_reply *r, int fd, const char *who);
/* r was sent or dropped: unregister it. Safe for an r never added (zeroed). */
void held_remove(struct held_replies *h, struct held_reply *r);

/*
 * Shut down (SHUT_RDWR, never close: the descriptor stays ZeroMQ's) the connection
 * of every reply held longer than timeout_ms, once each, if it is still the same
 * socket. Returns how many connections were shut down; logs each (warn).
 */
unsigned held_expire(struct held_replies *h, int64_t timeout_ms);

/*
 * The store's map is full (a PUT's write failed for room): the same for replies held
 * longer than timeout_ms (a short grace, far below reply_timeout_ms: a reader that
 * keeps up has taken its reply by then), then wait up to wait_ms for their snapshots
 * to end. An unread reply must not make the store `full` for everyone for the whole
 * reply_timeout_ms. Returns how many connections were shut down.
 */
unsigned held_expire_for_room(struct held_replies *h, int64_t timeout_ms, int64_t wait_ms);

#endif
