/* metrics — Prometheus endpoint of kvblendd; see metrics.h. */
#include "daemon/metrics.h"

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "cluster/cluster.h"
#include "daemon/counters.h"
#include "daemon/log.h"
#include "daemon/state.h"

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

/*
 * Connections are served from one poll loop, never one at a time: a client that
 * connects and sends nothing, or sends slowly, or does not read its answer, only
 * holds its own slot until its deadline, and stop wakes the loop at once through
 * an eventfd instead of waiting on any client.
 */
#define METRICS_MAX_CONNS 16
#define METRICS_REQ_MAX 4096	 /* request head; larger ones get 431 */
#define METRICS_TIMEOUT_MS 2000 /* to send the request head, and again to read the reply */

struct metrics_conn {
	int fd;			/* -1: free slot */
	uint64_t deadline_ms;	/* CLOCK_MONOTONIC */
	size_t got;
	char *out;		/* the reply, once the request is in */
	size_t out_len, out_sent;
	char req[METRICS_REQ_MAX];
};

struct metrics {
	struct server *srv;
	int fd;
	int wake; /* eventfd: metrics_stop writes it */
	pthread_t thread;
	atomic_bool stop;
	uint64_t accept_after_ms; /* after accept failed for lack of descriptors or memory */
	struct metrics_conn conns[METRICS_MAX_CONNS];
};

static void gauge(FILE *f, const char *name, const char *help, const char *type, double v)
{
	fprintf(f, "# HELP %s %s\n# TYPE %s %s\n%s %.17g\n", name, help, name, type, name, v);
}

/* A label value as the exposition format wants it: backslash, quote and newline escaped. */
static void label_value(FILE *f, const char *v)
{
	for (; *v; v++) {
		if (*v == '\\' || *v == '"')
			fputc('\\', f);
		if (*v == '\n')
			fputs("\\n", f);
		else
			fputc(*v, f);
	}
}

struct member_list {
	struct cluster_member *m;
	size_t n, cap;
};

static void collect_member(void *ctx, const struct cluster_member *mb)
{
	struct member_list *l = ctx;

	if (l->n == l->cap) {
		size_t cap = l->cap ? 2 * l->cap : 16;
		struct cluster_member *p = realloc(l->m, cap * sizeof(*p));

		if (!p)
			return; /* a member short in this scrape, not a failed one */
		l->m = p;
		l->cap = cap;
	}
	l->m[l->n++] = *mb;
}

/*
 * One series per other member for each of its figures, labelled with its id and
 * endpoint: its state, the pushes owed to it, the age of its last answer, and its
 * store at its last heartbeat.
 */
static void member_series(FILE *f, struct cluster *c)
{
	static const struct {
		const char *name, *help, *type;
	} fam[] = {
		{ "kvblend_cluster_member_state", "A member as this daemon sees it: 1 alive, 0 "
		  "suspect (missed a deadline), -1 gone (left, still owed pushes).", "gauge" },
		{ "kvblend_cluster_member_pushes_owed", "Chunk copies queued for a member.", "gauge" },
		{ "kvblend_cluster_member_last_reply_age_seconds", "Since a member's last answer "
		  "(-1: none yet).", "gauge" },
		{ "kvblend_cluster_member_chunks", "Chunks a member held at its last heartbeat.",
		  "gauge" },
		{ "kvblend_cluster_member_bytes", "Stored bytes a member held at its last heartbeat.",
		  "gauge" },
	};
	struct member_list l = { 0 };
	struct timespec now;
	double now_ms;

	cluster_members(c, collect_member, &l);
	clock_gettime(CLOCK_REALTIME, &now);
	now_ms = (double)now.tv_sec * 1e3 + now.tv_nsec / 1e6;
	for (size_t k = 0; k < sizeof(fam) / sizeof(fam[0]) && l.n; k++) {
		fprintf(f, "# HELP %s %s\n# TYPE %s %s\n", fam[k].name, fam[k].help, fam[k].name,
			fam[k].type);
		for (size_t i = 0; i < l.n; i++) {
			const struct cluster_member *mb = &l.m[i];
			double v = k == 0   ? (double)mb->state
				   : k == 1 ? (double)mb->owed
				   : k == 2 ? (mb->last_reply_ms ? (now_ms - (double)mb->last_reply_ms) / 1e3
								 : -1)
				   : k == 3 ? (double)mb->held_chunks
					    : (double)mb->held_bytes;

			fprintf(f, "%s{member=\"", fam[k].name);
			label_value(f, mb->id);
			fputs("\",endpoint=\"", f);
			label_value(f, mb->endpoint);
			fprintf(f, "\"} %.17g\n", v);
		}
	}
	free(l.m);
}

void metrics_write(struct server *srv, FILE *f)
{
	struct server_stats *st = &srv->stats;
	struct counter_snap snap;

	counters_snap(srv, &snap);
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
	/* every single-valued figure, from the table STATS prints too (counters.h) */
	for (size_t i = 0; i < n_counters; i++)
		if (counters[i].prom && counter_present(&counters[i], &snap))
			gauge(f, counters[i].prom, counters[i].help,
			      counters[i].monotonic ? "counter" : "gauge", counters[i].value(&snap));
	if (srv->cluster)
		member_series(f, srv->cluster);
	fprintf(f, "# HELP kvblend_backend_info The fuse compute backend in use, and its device.\n"
		   "# TYPE kvblend_backend_info gauge\nkvblend_backend_info{backend=\"%s\","
		   "device=\"", srv->blend->name);
	label_value(f, srv->dev_model[0] ? srv->dev_model : srv->dev ? srv->dev->name : "cpu");
	fputs("\"} 1\n", f);
}

static uint64_t now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000u + (uint64_t)ts.tv_nsec / 1000000u;
}

static void conn_close(struct metrics_conn *c)
{
	if (c->fd >= 0) {
		char sink[4096];

		/* Unread input would turn the close into a reset that can discard the
		 * answer on its way: take what is there (bounded, never waiting). */
		if (c->out && c->out_sent == c->out_len)
			for (int i = 0; i < 16 && recv(c->fd, sink, sizeof(sink), MSG_DONTWAIT) > 0;
			     i++)
				;
		close(c->fd);
	}
	free(c->out);
	c->fd = -1;
	c->out = NULL;
	c->got = c->out_len = c->out_sent = 0;
}

/* Is the request head complete (blank line), or can no more of it come? */
static bool head_complete(const struct metrics_conn *c)
{
	return c->got == sizeof(c->req) - 1 || strstr(c->req, "\r\n\r\n") ||
	       strstr(c->req, "\n\n");
}

static void conn_write(struct metrics_conn *c)
{
	while (c->out_sent < c->out_len) {
		ssize_t n = send(c->fd, c->out + c->out_sent, c->out_len - c->out_sent,
				 MSG_NOSIGNAL | MSG_DONTWAIT);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			return;
		if (n <= 0) {
			conn_close(c);
			return;
		}
		c->out_sent += (size_t)n;
	}
	conn_close(c);
}

/* Build the reply for the request read so far; the connection then only writes. */
static void conn_answer(struct metrics *m, struct metrics_conn *c)
{
	const char *status = "200 OK", *ctype = "text/plain; version=0.0.4";
	char *body = NULL, head[256];
	size_t body_len = 0;
	FILE *f = open_memstream(&body, &body_len);
	int n;

	if (!f) {
		conn_close(c);
		return;
	}
	if (c->got == sizeof(c->req) - 1 && !strstr(c->req, "\r\n\r\n") &&
	    !strstr(c->req, "\n\n")) {
		status = "431 Request Header Fields Too Large";
		ctype = "text/plain";
		fprintf(f, "request head larger than %d bytes\n", METRICS_REQ_MAX - 1);
	} else if (!strncmp(c->req, "GET /metrics ", 13) || !strncmp(c->req, "GET /metrics?", 13)) {
		metrics_write(m->srv, f);
	} else {
		status = "404 Not Found";
		ctype = "text/plain";
		fprintf(f, "not found: kvblendd serves /metrics\n");
	}
	if (fclose(f)) {
		free(body);
		conn_close(c);
		return;
	}
	n = snprintf(head, sizeof(head), "HTTP/1.1 %s\r\nContent-Type: %s\r\nContent-Length: "
		     "%zu\r\nConnection: close\r\n\r\n", status, ctype, body_len);
	c->out = malloc((size_t)n + body_len);
	if (!c->out) {
		free(body);
		conn_close(c);
		return;
	}
	memcpy(c->out, head, (size_t)n);
	memcpy(c->out + n, body, body_len);
	free(body);
	c->out_len = (size_t)n + body_len;
	c->out_sent = 0;
	c->deadline_ms = now_ms() + METRICS_TIMEOUT_MS;
	conn_write(c); /* usually all of it fits in the socket buffer at once */
}

static void conn_read(struct metrics *m, struct metrics_conn *c)
{
	for (;;) {
		ssize_t n = recv(c->fd, c->req + c->got, sizeof(c->req) - 1 - c->got, 0);

		if (n < 0 && errno == EINTR)
			continue;
		if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			return;
		if (n <= 0) {
			/* The peer closed its side: answer what came, if it was a request. */
			if (n == 0 && c->got)
				conn_answer(m, c);
			else
				conn_close(c);
			return;
		}
		c->got += (size_t)n;
		c->req[c->got] = 0;
		if (head_complete(c)) {
			conn_answer(m, c);
			return;
		}
	}
}

static void accept_all(struct metrics *m)
{
	for (size_t i = 0; i < METRICS_MAX_CONNS; i++) {
		struct metrics_conn *c = &m->conns[i];

		if (c->fd >= 0)
			continue;
		c->fd = accept4(m->fd, NULL, NULL, SOCK_CLOEXEC | SOCK_NONBLOCK);
		if (c->fd < 0) {
			/* EMFILE and the like leave the connection pending: pause rather
			 * than spin on a listening socket that stays readable. */
			if (errno == EMFILE || errno == ENFILE || errno == ENOBUFS ||
			    errno == ENOMEM)
				m->accept_after_ms = now_ms() + 100;
			return;
		}
		c->deadline_ms = now_ms() + METRICS_TIMEOUT_MS;
	}
}

static void *metrics_main(void *arg)
{
	struct metrics *m = arg;
	struct pollfd p[2 + METRICS_MAX_CONNS];
	struct metrics_conn *who[2 + METRICS_MAX_CONNS];

	while (!atomic_load(&m->stop)) {
		uint64_t now = now_ms(), next = now + 1000;
		size_t n = 0, busy = 0;
		int timeout;

		p[n++] = (struct pollfd){ m->wake, POLLIN, 0 };
		for (size_t i = 0; i < METRICS_MAX_CONNS; i++) {
			struct metrics_conn *c = &m->conns[i];

			if (c->fd < 0)
				continue;
			if (now >= c->deadline_ms) {
				/* A request line without the rest of its head still gets its
				 * answer; a client too slow to send one, or to read the
				 * answer, is dropped. */
				if (!c->out && memchr(c->req, '\n', c->got))
					conn_answer(m, c);
				else
					conn_close(c);
				if (c->fd < 0)
					continue;
			}
			if (c->deadline_ms < next)
				next = c->deadline_ms;
			who[n] = c;
			p[n++] = (struct pollfd){ c->fd, c->out ? POLLOUT : POLLIN, 0 };
			busy++;
		}
		/* With every slot taken, new connections wait in the backlog. */
		if (busy < METRICS_MAX_CONNS && now >= m->accept_after_ms) {
			who[n] = NULL;
			p[n++] = (struct pollfd){ m->fd, POLLIN, 0 };
		} else if (busy < METRICS_MAX_CONNS && m->accept_after_ms < next) {
			next = m->accept_after_ms;
		}
		timeout = (int)(next - now);
		if (poll(p, (nfds_t)n, timeout) <= 0)
			continue;
		if (p[0].revents)
			break;
		for (size_t i = 1; i < n; i++) {
			if (!p[i].revents)
				continue;
			if (!who[i])
				accept_all(m);
			else if (who[i]->out)
				conn_write(who[i]);
			else
				conn_read(m, who[i]);
		}
	}
	for (size_t i = 0; i < METRICS_MAX_CONNS; i++)
		conn_close(&m->conns[i]);
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
	for (size_t i = 0; i < METRICS_MAX_CONNS; i++)
		m->conns[i].fd = -1;
	m->wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
	m->fd = socket(AF_INET, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (m->wake < 0 || m->fd < 0 ||
	    setsockopt(m->fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) ||
	    bind(m->fd, (struct sockaddr *)&a, sizeof(a)) || listen(m->fd, 16)) {
		rc = -errno;
		log_err("metrics: cannot listen on 127.0.0.1:%u: %s", port, strerror(-rc));
		if (m->fd >= 0)
			close(m->fd);
		if (m->wake >= 0)
			close(m->wake);
		free(m);
		return rc;
	}
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	rc = pthread_create(&m->thread, NULL, metrics_main, m);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc) {
		close(m->fd);
		close(m->wake);
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
	/* Wakes the poll at once, whatever the clients are doing. */
	if (eventfd_write(m->wake, 1))
		log_warn("metrics: cannot wake the thread: %s", strerror(errno));
	pthread_join(m->thread, NULL);
	close(m->fd);
	close(m->wake);
	free(m);
	*mp = NULL;
}
