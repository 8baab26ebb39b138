/*
 * bulk — the daemon's bulk connections (docs/protocol.md#bulk-connections): plain TCP
 * connections beside the ZeroMQ endpoints on which GET payloads travel instead of
 * ZeroMQ frames, written from the store's pages by the worker that served the GET. A
 * client asks for one in a HELLO over TCP and gets a port, a random ticket and, when it
 * asked over CURVE, a fresh AES-256-GCM key; it connects, sends the hello (the ticket,
 * and a tag under the key) and the connection is bound to that client's identity. Records
 * on a sealed connection are AES-256-GCM sealed (proto/bulk.h); ZeroMQ never sees them,
 * so nothing is encrypted twice. One accept thread takes connections, checks hellos and
 * notices closed ones; the workers write.
 */
#ifndef KVBLEND_DAEMON_BULK_H
#define KVBLEND_DAEMON_BULK_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/uio.h>

#include "../proto/wire.h"

struct bulk;

/*
 * Listen on host:port (port 0: a free one) and start the accept thread. send_timeout_ms
 * (0: none) bounds one payload's sending (reply_timeout_ms): a client that reads slower
 * loses its connection.
 * 0 and *out, or -errno (log_err says why).
 */
int bulk_start(struct bulk **out, const char *host, unsigned port, unsigned send_timeout_ms);
/* The port it listens on. */
unsigned bulk_port(const struct bulk *b);
/* Stop the thread, close every connection. Accepts NULL; sets *b to NULL. */
void bulk_stop(struct bulk **b);

/*
 * A ticket for principal, waiting (10 s) for its connection; with sealed a fresh key
 * too (into key). 0, or -EDQUOT (the principal holds BULK_PER_PRINCIPAL), -ENOSPC (the
 * table is full), -EIO (no randomness).
 */
int bulk_open(struct bulk *b, const char *principal, bool sealed,
	      uint8_t ticket[KVBP_BULK_TICKET_LEN], uint8_t key[KVBP_BULK_KEY_LEN]);

/*
 * Send the iov[0..n) bytes of request request_id on principal's connection of ticket,
 * in records (sealed when its ticket was). 0 and *sent; -ENOENT: no such connection of
 * this principal (send the payload as frames instead); -EPIPE, -ETIMEDOUT, -EIO: the
 * connection failed and was closed (the client learns it from the reply).
 */
int bulk_send(struct bulk *b, const uint8_t ticket[KVBP_BULK_TICKET_LEN],
	      const char *principal, uint64_t request_id, const struct iovec *iov, size_t n,
	      uint64_t *sent);

/* Connections open now, records sealed and bytes sent so far (stats). */
void bulk_counts(struct bulk *b, uint64_t *open, uint64_t *sealed_records, uint64_t *bytes);

#endif
