/*
 * bulk — the daemon's bulk connections (docs/protocol.md#bulk-connections): plain TCP
 * connections beside the ZeroMQ endpoints on which GET payloads travel instead of
 * ZeroMQ frames, written from the store's pages by a sender thread (never the worker
 * that served the GET: a client that does not read holds no worker), and PUT payloads
 * the other way, read by the worker that stores them. A
 * client asks for one in a HELLO over TCP and gets a port, a random ticket and, when it
 * asked over CURVE, a fresh key and the cipher (AEGIS where both ends run it, else
 * AES-256-GCM); it connects, sends the hello (the ticket, and a tag under the key) and
 * the connection is bound to that client's identity. Records on a sealed connection are
 * sealed (proto/bulk.h); ZeroMQ never sees them, so nothing is encrypted twice. One
 * accept thread takes connections, checks hellos and notices closed ones; sender
 * threads write, each to its share of the connections with non-blocking sends; the
 * workers read.
 */
#ifndef KVBLEND_DAEMON_BULK_H
#define KVBLEND_DAEMON_BULK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "proto/wire.h"

struct bulk;

/* Longest ZeroMQ routing id a ticket is bound to (ZeroMQ's own limit). */
#define BULK_CONN_ID_MAX 255

/*
 * Listen on host:port (port 0: a free one) and start the accept thread and `senders`
 * sender threads (1..8). send_timeout_ms (0: none) bounds one payload's sending, the
 * wait behind earlier payloads on its connection included (reply_timeout_ms); a
 * connection whose socket takes no byte for BULK_STALL_MS (2 s) while a payload waits
 * is cut as well: a client that reads slower loses its connection.
 * 0 and *out, or -errno (log_err says why).
 */
int bulk_start(struct bulk **out, const char *host, unsigned port, unsigned send_timeout_ms,
	       unsigned senders);
/* The port it listens on. */
unsigned bulk_port(const struct bulk *b);
/*
 * The daemon is stopping: cut every connection at once (shutdown(2): a worker writing
 * a payload returns at once with -EPIPE) and take no payload from now on (bulk_take
 * says -ENOENT: frames). Tickets still waiting are dropped. Accepts NULL.
 */
void bulk_shutdown(struct bulk *b);
/* Stop the thread, close every connection. Accepts NULL; sets *b to NULL. */
void bulk_stop(struct bulk **b);

/*
 * A ticket for principal on its ZeroMQ connection conn_id (the routing id, at most
 * BULK_CONN_ID_MAX bytes), waiting (10 s) for its connection; with sealed a fresh key
 * too (into key), for cipher (KVBP_AEAD_*). 0, or -EDQUOT (the principal holds
 * BULK_PER_PRINCIPAL), -ENOSPC (the table is full), -EIO (no randomness), -ENOTSUP
 * (the cipher is not available here), -EINVAL (conn_id too long).
 */
int bulk_open(struct bulk *b, const char *principal, const void *conn_id, size_t conn_id_len,
	      bool sealed, uint32_t cipher, uint8_t ticket[KVBP_BULK_TICKET_LEN],
	      uint8_t key[KVBP_BULK_KEY_LEN]);

/* One payload's hold on a connection (bulk_take), until its bulk_post, bulk_recv or bulk_cut. */
struct bulk_conn;

/*
 * Take principal's connection of ticket for one payload, asked for on the ZeroMQ
 * connection conn_id: 0 and *out, or -ENOENT (no such connection of this principal
 * and ZeroMQ connection: send the payload as frames instead). Every *out is given to
 * bulk_post, bulk_recv or bulk_cut, once.
 */
int bulk_take(struct bulk *b, const uint8_t ticket[KVBP_BULK_TICKET_LEN], const char *principal,
	      const void *conn_id, size_t conn_id_len, struct bulk_conn **out);

/* Called (on a sender thread) before the first byte of piece i of a payload goes out:
 * 0, or nonzero to void the payload there (an abort record ends it). */
struct bulk_check {
	int (*fn)(void *arg, size_t i);
	void *arg;
};

/*
 * A posted payload is done (called once, on a sender thread, or in bulk_stop; no lock
 * held): rc 0, every byte written to the socket (sent: the payload's size); -EBADMSG,
 * the check refused a piece and the abort record replaced it (the connection stays
 * usable); -ETIMEDOUT (the deadline, or no progress for BULK_STALL_MS), -EPIPE (the
 * client left, or the daemon stops), -EIO, -ENOMEM: the connection was cut (the client
 * sees its stream end mid-payload). The payload's bytes are the caller's until then.
 */
typedef void bulk_done_fn(void *arg, int rc, uint64_t sent);

/*
 * Queue the iov[0..n) bytes of request request_id on c, to go out in records (sealed
 * when its ticket was) after the payloads queued before it, each piece after check
 * (may be NULL, called on the sender thread) passed it. Returns at once: 0, and done
 * is called once when the payload is out or failed; or, with c given back as it was
 * and done never called, -EDQUOT (c's principal has BULK_QUEUED_PER_PRINCIPAL, 32,
 * payloads waiting on its connections), -ESHUTDOWN (the daemon stops, or c was cut),
 * -ENOMEM. The iov array is copied; the bytes it points to must stay until done.
 */
int bulk_post(struct bulk *b, struct bulk_conn *c, uint64_t request_id,
	      const struct iovec *iov, size_t n, const struct bulk_check *check,
	      bulk_done_fn *done, void *arg);

/*
 * Receive the total bytes of PUT request request_id from c into buf, record by record
 * (opened when its ticket was sealed; every header checked before its bytes land), and
 * give c back. Bounded by send_timeout_ms (30 s when that is 0), the wait for the
 * connection's receive lock included, and by a schedule: the first record within
 * 200 ms, then at least 100 MB/s (bulk.c PUT_START_MS): the worker waits on no slow
 * client. 0; or the connection is closed (its stream is out of step; the client's
 * writes fail at once) and why says what happened: -EPROTO (a malformed or
 * out-of-order record), -EBADMSG (altered on the wire), -ETIMEDOUT (fell behind, or
 * the deadline), -EPIPE, -errno.
 */
int bulk_recv(struct bulk *b, struct bulk_conn *c, uint64_t request_id, void *buf,
	      uint64_t total, char *why, size_t why_len);
/* Give c back closed, its records unread (the PUT was refused before its payload), so
 * that the client's writes fail at once and its stream never falls out of step. */
void bulk_cut(struct bulk *b, struct bulk_conn *c);

/* What the bulk connections did so far (stats). */
struct bulk_stats {
	uint64_t open;		  /* connections open now */
	uint64_t sealed_records;  /* records sealed (GET payloads) */
	uint64_t bytes;		  /* GET payload bytes sent */
	uint64_t opened_records;  /* sealed records received and opened (PUT payloads) */
	uint64_t bytes_in;	  /* PUT payload bytes received */
};
void bulk_counts(struct bulk *b, struct bulk_stats *out);

#endif
