/*
 * metrics — Prometheus text exposition of kvblendd's counters over HTTP at
 * http://127.0.0.1:PORT/metrics (loopback only; off unless metrics_port is
 * set), from one small thread. Also the latency histograms it exports, which
 * the workers fill.
 *
 * Limits: at most 16 connections at once (more wait in the listen backlog), a
 * request head of at most 4 KiB, 2 s to send it and 2 s to read the answer;
 * a slower client is dropped. One connection never delays another.
 */
#ifndef KVBLEND_DAEMON_METRICS_H
#define KVBLEND_DAEMON_METRICS_H

#include <stdint.h>
#include <stdio.h>

struct server;
struct metrics;

/* The latency buckets: METRICS_BUCKETS and metrics_bucket_le are in state.h, beside the
 * histogram they shape; metrics.c defines the bounds. */

/* Which bucket a latency falls in. */
unsigned metrics_bucket(uint64_t ns);

/* Start serving on 127.0.0.1:port. Returns 0 or a negative errno (logged). */
int metrics_start(struct server *srv, uint16_t port, struct metrics **out);
/* Stop the thread and close the socket and every connection, at once: it waits on
 * no client. Accepts NULL. */
void metrics_stop(struct metrics **m);

/* Write the exposition text to f (also used by tests through the endpoint). */
void metrics_write(struct server *srv, FILE *f);

#endif
