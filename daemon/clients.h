/*
 * clients — the bytes kvblendd holds for each client, so that memory is bounded
 * per client and in total, in bytes rather than messages: a request's frames
 * from the moment the main thread reads them until its reply is sent, and each
 * reply's payload until ZeroMQ has written it to the client (an unread reply
 * stays held).
 *
 * A client is a principal (server.c: a process on IPC, a CURVE key or an address
 * on TCP), not a connection, so that many connections of one process share one
 * budget. Records are reference-counted; thread-safe.
 */
#ifndef KVBLEND_DAEMON_CLIENTS_H
#define KVBLEND_DAEMON_CLIENTS_H

#include <stdint.h>

struct clients;
struct client_acct;

/* total: bytes held for all clients together; per_client: for one. */
int clients_new(uint64_t total, uint64_t per_client, struct clients **out);
/* Free the table; every record must have been put back. Accepts NULL. */
void clients_free(struct clients **t);

/* principal's record with a reference taken (created on first use); NULL without memory. */
struct client_acct *clients_get(struct clients *t, const char *principal);
/* Another reference to a record the caller holds. */
void clients_ref(struct clients *t, struct client_acct *a);
/* Drop a reference; the record goes with the last. Accepts NULL. */
void clients_put(struct clients *t, struct client_acct *a);

/*
 * Hold bytes more for a. A client that holds nothing is always admitted if the
 * total allows, so one request of any admissible size goes through. Returns 0,
 * -EDQUOT when a's share would be exceeded, -ENOBUFS when the total would be.
 */
int clients_reserve(struct clients *t, struct client_acct *a, uint64_t bytes);
/*
 * As clients_reserve, for more bytes of a request whose own `own` bytes a holds
 * already (a PUT's payload read after its header): admitted as one request of own +
 * bytes would be, so always when a holds nothing but that request.
 */
int clients_reserve_more(struct clients *t, struct client_acct *a, uint64_t bytes,
			 uint64_t own);
void clients_release(struct clients *t, struct client_acct *a, uint64_t bytes);

/* Bytes a holds now; bytes all hold now; clients with a record. */
uint64_t clients_held(const struct client_acct *a);
void clients_usage(struct clients *t, uint64_t *bytes, uint64_t *n_clients);

#endif
