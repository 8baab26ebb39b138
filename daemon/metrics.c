/* metrics — Prometheus endpoint of kvblendd; see metrics.h. */
#include "metrics.h"

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "log.h"
#include "server.h"

const double metrics_bucket_le[METRICS_BUCKETS] = { 0.0001, 0.00025, 0.0005, 0.001, 0.0025,
						     0.005,  0.01,    0.025,  0.05,  0.1,
						     0.25,   1,	      5,      1e300 };

unsigned metrics_bucket(uint64_t ns)
{
	double s = ns / 1e9;
	unsigned b = 0;

	while (b + 1 < METRICS_BUCKETS && s > metrics_bucket_le[b])
		b++;
	return b;
}

struct metrics {
	struct server *srv;
	int fd;
	pthread_t thread;
	atomic_bool stop;
};

static void gauge(FILE *f, const char *name, const char *help, const char *type, double v)
{
	fprintf(f, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
}

void metrics_write(struct server *srv, FILE *f)
{
	struct server_stats *st = &srv->stats;
	struct store_totals t = { 0 };
	struct evict_stats es;
	struct timespec now;
	uint64_t fs, fb, fp, shm_n, shm_b;

	store_totals(srv->store, &t);
	evictor_stats(srv->evict, &es);
	fuse_usage(srv->fuse, &fs, &fb, &fp);
	shm_usage(srv->shm, &shm_n, &shm_b);
	clock_gettime(CLOCK_MONOTONIC, &now);
	fprintf(f, "# HELP kvblend_requests_total Requests handled, by operation.\n"
		   "# TYPE kvblend_requests_total counter\n");
	for (uint32_t op = 1; op <= KVBP_OP_COUNT; op++)
		fprintf(f, "kvblend_requests_total{op=\"%s\"} %" PRIu64 "\n",
			op < KVBP_OP_COUNT ? kvbp_op_name(op) : "unknown",
			(uint64_t)atomic_load(&st->requests[op]));
	fprintf(f, "# HELP kvblend_errors_total Error replies, by code.\n"
		   "# TYPE kvblend_errors_total counter\n");
	for (uint32_t c = 1; c < KVBP_CODE_COUNT; c++)
		fprintf(f, "kvblend_errors_total{code=\"%s\"} %" PRIu64 "\n", kvbp_code_name(c),
			(uint64_t)atomic_load(&st->errors[c]));
	fprintf(f, "# HELP kvblend_request_duration_seconds Time from receiving a request to "
		   "sending its reply, by operation.\n"
		   "# TYPE kvblend_request_duration_seconds histogram\n");
	for (uint32_t op = 1; op <= KVBP_OP_COUNT; op++) {
		const char *name = op < KVBP_OP_COUNT ? kvbp_op_name(op) : "unknown";
		uint64_t cum = 0;

		if (!atomic_load(&st->lat_count[op]))
			continue;
		for (unsigned b = 0; b < METRICS_BUCKETS; b++) {
			cum += atomic_load(&st->lat_bucket[op][b]);
			if (b + 1 < METRICS_BUCKETS)
				fprintf(f, "kvblend_request_duration_seconds_bucket{op=\"%s\",le=\"%g\"} "
					"%" PRIu64 "\n", name, metrics_bucket_le[b], cum);
			else
				fprintf(f, "kvblend_request_duration_seconds_bucket{op=\"%s\",le=\"+Inf\"} "
					"%" PRIu64 "\n", name, cum);
		}
		fprintf(f, "kvblend_request_duration_seconds_sum{op=\"%s\"} %.9f\n", name,
			atomic_load(&st->lat_sum_ns[op]) / 1e9);
		fprintf(f, "kvblend_request_duration_seconds_count{op=\"%s\"} %" PRIu64 "\n", name,
			(uint64_t)atomic_load(&st->lat_count[op]));
	}
	gauge(f, "kvblend_received_bytes_total", "Bytes of requests received.", "counter",
	      (double)atomic_load(&st->bytes_in));
	gauge(f, "kvblend_sent_bytes_total", "Bytes of replies sent over sockets.", "counter",
	      (double)atomic_load(&st->bytes_out));
	gauge(f, "kvblend_lookup_hits_total", "Lookups of stored chunks.", "counter",
	      (double)atomic_load(&st->lookup_hits));
	gauge(f, "kvblend_lookup_misses_total", "Lookups of chunks not stored.", "counter",
	      (double)atomic_load(&st->lookup_misses));
	gauge(f, "kvblend_evictions_total", "Chunks evicted.", "counter", (double)es.evicted);
	gauge(f, "kvblend_evicted_bytes_total", "Stored bytes freed by eviction.", "counter",
	      (double)es.evicted_bytes);
	gauge(f, "kvblend_corrupt_removed_total", "Chunks that failed a checksum and were removed.",
	      "counter", (double)atomic_load(&st->corrupt_removed));
	gauge(f, "kvblend_chunks", "Chunks stored.", "gauge", (double)t.chunks);
	gauge(f, "kvblend_stored_bytes", "Bytes of chunks as stored (encoded).", "gauge",
	      (double)t.stored_bytes);
	gauge(f, "kvblend_raw_bytes", "Bytes of chunks decoded.", "gauge", (double)t.raw_bytes);
	gauge(f, "kvblend_compression_ratio", "Raw bytes over stored bytes.", "gauge",
	      t.stored_bytes ? (double)t.raw_bytes / (double)t.stored_bytes : 1.0);
	gauge(f, "kvblend_capacity_bytes", "Configured capacity (0: none).", "gauge",
	      (double)srv->cfg->capacity);
	gauge(f, "kvblend_map_used_bytes", "LMDB map in use.", "gauge", (double)t.map_used);
	gauge(f, "kvblend_pinned_chunks", "Chunks pinned against eviction with a TTL.", "gauge",
	      (double)es.pins);
	gauge(f, "kvblend_fuse_sessions", "Open fuse sessions.", "gauge", (double)fs);
	gauge(f, "kvblend_fuse_ring_bytes", "Memory held by fuse sessions' rings.", "gauge",
	      (double)fb);
	gauge(f, "kvblend_shm_segments", "Shared-memory segments of clients.", "gauge",
	      (double)shm_n);
	gauge(f, "kvblend_uptime_seconds", "Seconds since start.", "gauge",
	      (double)(now.tv_sec - srv->started.tv_sec));
	fprintf(f, "# HELP kvblend_backend_info The fuse compute backend in use.\n"
		   "# TYPE kvblend_backend_info gauge\nkvblend_backend_info{backend=\"%s\"} 1\n",
		srv->blend->name);
}

static void serve_one(struct metrics *m, int c)
{
	char req[2048] = "", *body = NULL, head[256];
	size_t body_len = 0, got = 0;
	struct pollfd p = { c, POLLIN, 0 };
	FILE *f;
	int ok;

	/* The request line is all we need; wait briefly for it. */
	while (got < sizeof(req) - 1 && !memchr(req, '\n', got) && poll(&p, 1, 2000) > 0) {
		ssize_t n = recv(c, req + got, sizeof(req) - 1 - got, 0);

		if (n <= 0)
			break;
		got += (size_t)n;
	}
	req[got] = 0;
	ok = !strncmp(req, "GET /metrics ", 13) || !strncmp(req, "GET /metrics?", 13);
	f = open_memstream(&body, &body_len);
	if (!f)
		return;
	if (ok)
		metrics_write(m->srv, f);
	else
		fprintf(f, "not found: kvblendd serves /metrics\n");
	fclose(f);
	snprintf(head, sizeof(head), "HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: %zu\r\n"
		 "Connection: close\r\n\r\n", ok ? "200 OK" : "404 Not Found",
		 ok ? "text/plain; version=0.0.4" : "text/plain", body_len);
	if (send(c, head, strlen(head), MSG_NOSIGNAL) > 0)
		send(c, body, body_len, MSG_NOSIGNAL);
	free(body);
}

static void *metrics_main(void *arg)
{
	struct metrics *m = arg;

	while (!atomic_load(&m->stop)) {
		struct pollfd p = { m->fd, POLLIN, 0 };
		int c;

		if (poll(&p, 1, 200) <= 0)
			continue;
		c = accept4(m->fd, NULL, NULL, SOCK_CLOEXEC);
		if (c < 0)
			continue;
		serve_one(m, c);
		close(c);
	}
	return NULL;
}

int metrics_start(struct server *srv, uint16_t port, struct metrics **out)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_port = htons(port),
				 .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	struct metrics *m = calloc(1, sizeof(*m));
	int one = 1, rc;
	sigset_t all, old;

	if (!m)
		return -ENOMEM;
	m->srv = srv;
	m->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (m->fd < 0 || setsockopt(m->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) ||
	    bind(m->fd, (struct sockaddr *)&a, sizeof(a)) || listen(m->fd, 16)) {
		rc = -errno;
		log_err("metrics: cannot listen on 127.0.0.1:%u: %s", port, strerror(-rc));
		if (m->fd >= 0)
			close(m->fd);
		free(m);
		return rc;
	}
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	rc = pthread_create(&m->thread, NULL, metrics_main, m);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc) {
		close(m->fd);
		free(m);
		return -rc;
	}
	log_info("metrics on http://127.0.0.1:%u/metrics", port);
	*out = m;
	return 0;
}

void metrics_stop(struct metrics **mp)
{
	struct metrics *m = mp ? *mp : NULL;

	if (!m)
		return;
	atomic_store(&m->stop, true);
	pthread_join(m->thread, NULL);
	close(m->fd);
	free(m);
	*mp = NULL;
}
