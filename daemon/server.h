/*
 * server — kvblendd's sockets, worker threads and main loop.
 *
 * ROUTER sockets bound to the configured endpoints (a CURVE one for TCP when a
 * server key is configured); the main thread moves requests from them into one queue
 * that idle worker threads take from (work.h), and the workers' replies (on an inproc
 * DEALER that keeps the routing envelope) back to them. The main thread also acts on signal flags, expires
 * shared-memory segments and pings the systemd watchdog. Workers decode a
 * request, run it (ops/ops.c) and reply.
 */
#ifndef KVBLEND_DAEMON_SERVER_H
#define KVBLEND_DAEMON_SERVER_H

#include "daemon/state.h"

/* Bind sockets and start workers. Returns 0 or a negative errno with a message logged. */
int server_start(struct server *srv, const struct config *cfg, struct store *store);

/*
 * Serve until *stop becomes non-zero (set from a signal handler). Returns 0.
 * tick() is called about once a second from the main loop (watchdog, status).
 */
int server_run(struct server *srv, volatile int *stop, void (*tick)(struct server *));

/* Stop accepting, drain workers, close sockets and the ZeroMQ context. Accepts a half-started server. */
void server_stop(struct server *srv);

#endif
