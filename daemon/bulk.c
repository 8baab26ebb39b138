/* bulk — the daemon's bulk connections; see bulk.h and docs/protocol.md#bulk-connections. */
#include "daemon/bulk.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <openssl/crypto.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include "proto/bulk.h"
#include "daemon/log.h"

#define BULK_MAX 256		/* connections and waiting tickets, all clients */
#define BULK_PER_PRINCIPAL 16	/* of one client identity */
#define BULK_SHAKES 64		/* connections still sending their hello */
#define TICKET_MS 10000		/* a ticket waits this long for its connection */
#define HELLO_MS 5000		/* a new connection has this long to send its hello */
#define IOV_PER_RECORD 64
/*
 * A GET's payload goes out from a sender thread, never a worker (issue 55): a client that
 * never reads holds no worker. The sender cuts a connection whose payload makes no
 * progress (no byte taken by its socket) for BULK_STALL_MS, or that is not done by the
 * reply deadline; one principal may have BULK_QUEUED_PER_PRINCIPAL payloads waiting on
 * its connections (their bytes are held on its client_inflight_bytes too). A sender
 * writes at most PUMP_BYTES to one connection before it turns to the next.
 */
#define BULK_STALL_MS 2000
#define BULK_QUEUED_PER_PRINCIPAL 32
#define BULK_SENDERS_MAX 8
#define PUMP_BYTES (8u << 20)
/*
 * A PUT's records hold the worker that reads them, so they must come as fast as a
 * client that sends them right after its request does: the first within PUT_START_MS
 * of the worker taking the PUT (a client writes them before ZeroMQ has even passed the
 * request on), every byte at most PUT_START_MS behind a rate of PUT_MIN_BYTES_PER_MS
 * (100 MB/s) after that. A client that sends nothing, trickles, or sits behind a slower
 * link is cut at once and sends its PUT in frames instead (libkvblend does), which
 * ZeroMQ receives without a worker; no client holds a worker long for nothing.
 */
#define PUT_START_MS 200
#define PUT_MIN_BYTES_PER_MS 100000

/* One payload posted to a connection (bulk_post), until its done call. */
struct bulk_job {
	struct bulk_job *next;
	uint64_t request_id, total;
	uint64_t off;	     /* payload bytes put into records so far */
	size_t fi, fpos;     /* where the next record's bytes start: piece fi, byte fpos */
	int64_t deadline_ms; /* the whole payload's, the wait behind earlier ones included */
	struct bulk_check check;
	bulk_done_fn *done;
	void *arg;
	int rc;		     /* when finished: what done is told */
	bool aborting;	     /* the record being written is the abort record */
	uint32_t rec_len;    /* payload bytes of the record being written (counted) */
	/* the record being written: msg[0..nm) less what went out (mp, mn) */
	struct iovec msg[IOV_PER_RECORD + 2], *mp;
	int mn;
	uint8_t hdr[KVBB_HDR_LEN], tag[KVBB_TAG_LEN];
	size_t n;
	struct iovec iov[]; /* the caller's pieces */
};

struct bulk_conn {
	bool used;
	bool sealed;
	bool dead; /* failed or closed by its client: freed when no worker holds it */
	uint8_t ticket[KVBP_BULK_TICKET_LEN];
	char principal[96];
	/* the ZeroMQ connection the ticket was issued on (its routing id): only requests
	 * on that connection may send payloads here, so that on loopback, where every
	 * local process is one address, no other process can divert its payload here */
	uint8_t conn_id[BULK_CONN_ID_MAX];
	size_t conn_id_len;
	struct kvbb_aead *aead;
	int fd; /* -1: the ticket waits for its connection */
	int64_t deadline_ms;
	unsigned users; /* workers on it, and payloads queued on it */
	uint64_t counter; /* records sent: the next nonce (its sender's) */
	uint64_t rcounter; /* PUT records received, plus one (the hello): the next nonce */
	pthread_mutex_t recv_lock;
	/* payloads waiting, the first being written (b->lock; only the sender pops) */
	struct bulk_job *head, *tail;
	unsigned queued;
	int64_t progress_ms; /* the sender's: when its socket last took a byte */
	uint8_t *bounce;     /* the sender's: a sealed record's bytes */
};

struct shake {
	int fd; /* -1: slot free */
	size_t got;
	int64_t deadline_ms;
	uint8_t buf[KVBB_HELLO_LEN];
};

struct bulk {
	int listen_fd, wake[2];
	unsigned port, send_timeout_ms;
	pthread_t thread;
	bool started;
	atomic_bool stop;
	/* the senders: connection i is sender i % n_senders's */
	struct sender {
		struct bulk *b;
		unsigned k;
		int wake[2];
		pthread_t thread;
		bool started;
	} senders[BULK_SENDERS_MAX];
	unsigned n_senders;
	bool closing; /* bulk_shutdown: no payload starts, every connection is cut (lock) */
	pthread_mutex_t lock; /* the table: used, fd, users, dead, deadline */
	struct bulk_conn conns[BULK_MAX];
	struct shake shakes[BULK_SHAKES]; /* the accept thread's only */
	atomic_uint_fast64_t sealed_records, bytes, opened_records, bytes_in;
};

static int64_t now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

/* With b->lock held, and no worker on it. */
static void conn_free(struct bulk_conn *c)
{
	if (c->fd >= 0)
		close(c->fd);
	kvbb_aead_free(&c->aead);
	OPENSSL_cleanse(c->ticket, sizeof(c->ticket));
	free(c->bounce);
	c->bounce = NULL;
	c->fd = -1;
	c->used = c->dead = false;
	c->users = 0;
	c->counter = 0;
	c->rcounter = 1;
}

/* With b->lock held: free it, or if a worker is writing, cut it and let the worker free it. */
static void conn_drop(struct bulk_conn *c)
{
	if (c->users) {
		c->dead = true;
		if (c->fd >= 0)
			shutdown(c->fd, SHUT_RDWR);
	} else {
		conn_free(c);
	}
}

int bulk_open(struct bulk *b, const char *principal, const void *conn_id, size_t conn_id_len,
	      bool sealed, uint32_t cipher, uint8_t ticket[KVBP_BULK_TICKET_LEN],
	      uint8_t key[KVBP_BULK_KEY_LEN])
{
	struct bulk_conn *slot = NULL;
	unsigned mine = 0;
	uint8_t t[KVBP_BULK_TICKET_LEN], k[KVBP_BULK_KEY_LEN];
	int rc = 0;

	if (conn_id_len > BULK_CONN_ID_MAX)
		return -EINVAL;
	if (getrandom(t, sizeof(t), 0) != sizeof(t) ||
	    (sealed && getrandom(k, sizeof(k), 0) != sizeof(k)))
		return -EIO;
	pthread_mutex_lock(&b->lock);
	for (unsigned i = 0; i < BULK_MAX; i++) {
		struct bulk_conn *c = &b->conns[i];

		if (!c->used) {
			if (!slot)
				slot = c;
		} else if (!c->dead && !strcmp(c->principal, principal)) {
			mine++;
		}
	}
	if (mine >= BULK_PER_PRINCIPAL)
		rc = -EDQUOT;
	else if (!slot)
		rc = -ENOSPC;
	else if (sealed)
		rc = kvbb_aead_new(&slot->aead, k, cipher);
	if (!rc) {
		slot->used = true;
		slot->sealed = sealed;
		slot->fd = -1;
		slot->deadline_ms = now_ms() + TICKET_MS;
		memcpy(slot->ticket, t, sizeof(t));
		snprintf(slot->principal, sizeof(slot->principal), "%s", principal);
		memcpy(slot->conn_id, conn_id, conn_id_len);
		slot->conn_id_len = conn_id_len;
		memcpy(ticket, t, sizeof(t));
		if (sealed)
			memcpy(key, k, sizeof(k));
	}
	pthread_mutex_unlock(&b->lock);
	OPENSSL_cleanse(k, sizeof(k));
	return rc;
}

int bulk_take(struct bulk *b, const uint8_t ticket[KVBP_BULK_TICKET_LEN], const char *principal,
	      const void *conn_id, size_t conn_id_len, struct bulk_conn **out)
{
	struct bulk_conn *c = NULL;

	pthread_mutex_lock(&b->lock);
	for (unsigned i = 0; i < BULK_MAX && !c && !b->closing; i++) {
		struct bulk_conn *x = &b->conns[i];

		if (x->used && !x->dead && x->fd >= 0 && !strcmp(x->principal, principal) &&
		    x->conn_id_len == conn_id_len && !memcmp(x->conn_id, conn_id, conn_id_len) &&
		    !CRYPTO_memcmp(x->ticket, ticket, KVBP_BULK_TICKET_LEN))
			c = x;
	}
	if (c)
		c->users++;
	pthread_mutex_unlock(&b->lock);
	if (!c)
		return -ENOENT;
	*out = c;
	return 0;
}

/* A worker is done with c: with cut, close it (logged with why unless NULL); freed when
 * no other worker holds it and it is closed. */
static void conn_give_back(struct bulk *b, struct bulk_conn *c, bool cut, const char *principal,
			   const char *why)
{
	pthread_mutex_lock(&b->lock);
	c->users--;
	if (cut) {
		if (why)
			log_warn("bulk connection of %s closed: %s", principal, why);
		c->dead = true;
		if (c->fd >= 0)
			shutdown(c->fd, SHUT_RDWR);
	}
	if (c->dead && !c->users)
		conn_free(c);
	pthread_mutex_unlock(&b->lock);
}

/* Wake sender k (its poll), e.g. for a payload just queued or a connection cut. */
static void sender_wake(struct bulk *b, unsigned k)
{
	if (b->senders[k].started && write(b->senders[k].wake[1], "", 1) < 0) {
		/* the pipe is full: the sender is woken already */
	}
}

static unsigned sender_of(const struct bulk *b, const struct bulk_conn *c)
{
	return (unsigned)(c - b->conns) % b->n_senders;
}

int bulk_post(struct bulk *b, struct bulk_conn *c, uint64_t request_id,
	      const struct iovec *iov, size_t n, const struct bulk_check *check,
	      bulk_done_fn *done, void *arg)
{
	struct bulk_job *j = malloc(sizeof(*j) + n * sizeof(*iov));
	unsigned queued = 0;
	int rc = 0;

	if (!j) {
		conn_give_back(b, c, false, c->principal, NULL);
		return -ENOMEM;
	}
	*j = (struct bulk_job){ .request_id = request_id, .done = done, .arg = arg, .n = n,
				.deadline_ms = b->send_timeout_ms ? now_ms() + b->send_timeout_ms
								  : INT64_MAX };
	if (check)
		j->check = *check;
	for (size_t i = 0; i < n; i++) {
		j->iov[i] = iov[i];
		j->total += iov[i].iov_len;
	}
	pthread_mutex_lock(&b->lock);
	for (unsigned i = 0; i < BULK_MAX; i++)
		if (b->conns[i].used && !strcmp(b->conns[i].principal, c->principal))
			queued += b->conns[i].queued;
	if (b->closing || c->dead)
		rc = -ESHUTDOWN;
	else if (queued >= BULK_QUEUED_PER_PRINCIPAL)
		rc = -EDQUOT;
	if (!rc) {
		/* the worker's hold on c becomes the payload's */
		if (c->tail)
			c->tail->next = j;
		else
			c->head = j, c->progress_ms = now_ms();
		c->tail = j;
		c->queued++;
	} else {
		c->users--;
		if (c->dead && !c->users)
			conn_free(c);
	}
	pthread_mutex_unlock(&b->lock);
	if (rc) {
		free(j);
		return rc;
	}
	sender_wake(b, sender_of(b, c));
	return 0;
}

/* With b->lock held: take c's first payload off, done with rc, onto *fin. */
static void job_pop(struct bulk_conn *c, int rc, struct bulk_job **fin)
{
	struct bulk_job *j = c->head;

	c->head = j->next;
	if (!c->head)
		c->tail = NULL;
	c->queued--;
	c->users--;
	j->rc = rc;
	j->next = *fin;
	*fin = j;
}

/* With b->lock held: cut c (logged with why) and finish every payload on it with rc. */
static void conn_fail(struct bulk *b, struct bulk_conn *c, int rc, const char *why,
		      struct bulk_job **fin)
{
	if (why && !c->dead)
		log_warn("bulk connection of %s closed: %s", c->principal, why);
	if (c->head && c->head->rec_len && c->head->mn) /* its record did not go out whole */
		atomic_fetch_sub(&b->bytes, c->head->rec_len);
	while (c->head)
		job_pop(c, rc, fin);
	c->dead = true;
	if (c->fd >= 0) {
		/* a reset, not a FIN: a reader that stopped reading has closed its window, so
		 * a FIN would wait behind the unsent bytes and it would never see the end;
		 * and the kernel lets go of those bytes at once */
		struct linger now = { 1, 0 };

		setsockopt(c->fd, SOL_SOCKET, SO_LINGER, &now, sizeof(now));
		shutdown(c->fd, SHUT_RDWR);
	}
	if (!c->users)
		conn_free(c);
}

/* Tell each finished payload's owner (no lock held: an owner may take its time). */
static void jobs_done(struct bulk_job *fin)
{
	while (fin) {
		struct bulk_job *next = fin->next;

		fin->done(fin->arg, fin->rc, fin->rc ? 0 : fin->total);
		free(fin);
		fin = next;
	}
}

/*
 * The next record of j on c into j->msg: up to a record's bytes from the pieces, at
 * most IOV_PER_RECORD of them, each checked before its first byte is taken; or, when
 * the check refuses one, the abort record instead (nothing of it went out yet). 0 or
 * -EIO (the seal failed) / -ENOMEM.
 */
static int job_record(struct bulk *b, struct bulk_conn *c, struct bulk_job *j)
{
	size_t rec = c->sealed ? KVBB_SEAL_BYTES : KVBB_RECORD_MAX;
	struct kvbb_hdr h = { 0, j->request_id, j->total, j->off, 0 };
	struct iovec part[IOV_PER_RECORD];
	int np = 0;

	j->mn = 0;
	while (j->fi < j->n && np < IOV_PER_RECORD && h.len < rec) {
		size_t take = j->iov[j->fi].iov_len - j->fpos;

		if (!j->fpos && j->check.fn && j->check.fn(j->check.arg, j->fi)) {
			h = (struct kvbb_hdr){ KVBB_LAST | KVBB_ABORT, j->request_id, j->total,
					       j->off, 0 };
			np = 0;
			j->aborting = true;
			break;
		}
		if (take > rec - h.len)
			take = rec - h.len;
		if (take) {
			part[np].iov_base = (uint8_t *)j->iov[j->fi].iov_base + j->fpos;
			part[np++].iov_len = take;
			h.len += (uint32_t)take;
			j->fpos += take;
		}
		if (j->fpos == j->iov[j->fi].iov_len) {
			j->fi++;
			j->fpos = 0;
		}
	}
	if (!j->aborting && j->off + h.len == j->total)
		h.flags = KVBB_LAST;
	kvbb_hdr_put(j->hdr, &h);
	j->msg[j->mn++] = (struct iovec){ j->hdr, sizeof(j->hdr) };
	if (c->sealed) {
		if (!c->bounce && !(c->bounce = malloc(KVBB_SEAL_BYTES)))
			return -ENOMEM;
		if (kvbb_seal(c->aead, c->counter, KVBB_DIR_RECORDS, j->hdr, sizeof(j->hdr), part,
			      (size_t)np, c->bounce, j->tag))
			return -EIO;
		if (h.len)
			j->msg[j->mn++] = (struct iovec){ c->bounce, h.len };
		j->msg[j->mn++] = (struct iovec){ j->tag, sizeof(j->tag) };
		if (!j->aborting) /* (the stat counts the payload's records) */
			atomic_fetch_add(&b->sealed_records, 1);
	} else {
		memcpy(j->msg + j->mn, part, (size_t)np * sizeof(*part));
		j->mn += np;
	}
	c->counter++;
	j->off += h.len;
	j->rec_len = h.len;
	/* counted before the write: a client that has read the last byte finds it counted
	 * (taken back if the record does not go out whole) */
	atomic_fetch_add(&b->bytes, h.len);
	j->mp = j->msg;
	return 0;
}

/*
 * Write what c's socket takes now (at most PUMP_BYTES), record after record, payload
 * after payload; finished payloads onto *fin. 0 (the socket is full, or the turn is
 * over), or -errno: c is to be cut.
 */
static int conn_pump(struct bulk *b, struct bulk_conn *c, struct bulk_job **fin)
{
	size_t budget = PUMP_BYTES;
	struct bulk_job *j;
	int rc;

	pthread_mutex_lock(&b->lock);
	j = c->dead ? NULL : c->head;
	pthread_mutex_unlock(&b->lock);
	while (j && budget) {
		struct msghdr m;
		ssize_t w;

		if (!j->mn && (rc = job_record(b, c, j)))
			return rc;
		m = (struct msghdr){ .msg_iov = j->mp, .msg_iovlen = (size_t)j->mn };
		w = sendmsg(c->fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			return 0;
		if (w < 0)
			return errno == EPIPE || errno == ECONNRESET ? -EPIPE : -errno;
		kvbb_iov_advance(&j->mp, &j->mn, (size_t)w);
		budget = (size_t)w < budget ? budget - (size_t)w : 0;
		c->progress_ms = now_ms();
		if (j->mn)
			continue;
		j->rec_len = 0;
		if (!j->aborting && j->off < j->total)
			continue;
		/* the payload went out whole (or was voided): the next one starts its clock */
		pthread_mutex_lock(&b->lock);
		job_pop(c, j->aborting ? -EBADMSG : 0, fin);
		j = c->dead ? NULL : c->head;
		pthread_mutex_unlock(&b->lock);
	}
	return 0;
}

/* One turn of sender s: payloads past their deadline or stalled cut, the others written. */
static void sender_turn(struct sender *s)
{
	struct bulk *b = s->b;
	struct pollfd p[1 + BULK_MAX];
	unsigned who[1 + BULK_MAX], np = 0;
	struct bulk_job *fin = NULL;
	int64_t now = now_ms(), wake = now + 250;
	char why[160];

	p[np++] = (struct pollfd){ s->wake[0], POLLIN, 0 };
	pthread_mutex_lock(&b->lock);
	for (unsigned i = s->k; i < BULK_MAX; i += b->n_senders) {
		struct bulk_conn *c = &b->conns[i];

		if (!c->used || !c->head)
			continue;
		if (c->dead || b->closing || c->fd < 0) {
			conn_fail(b, c, -EPIPE, NULL, &fin);
		} else if (now >= c->head->deadline_ms) {
			snprintf(why, sizeof(why), "payload of request %" PRIu64 " not read within "
				 "reply_timeout_ms (%u ms)", c->head->request_id, b->send_timeout_ms);
			conn_fail(b, c, -ETIMEDOUT, why, &fin);
		} else if (now - c->progress_ms >= BULK_STALL_MS) {
			snprintf(why, sizeof(why), "payload of request %" PRIu64 ": nothing read "
				 "for %d ms (%" PRIu64 " of %" PRIu64 " bytes sent)",
				 c->head->request_id, BULK_STALL_MS,
				 c->head->off - c->head->rec_len, c->head->total);
			conn_fail(b, c, -ETIMEDOUT, why, &fin);
		} else {
			who[np] = i;
			p[np++] = (struct pollfd){ c->fd, POLLOUT, 0 };
			if (c->head->deadline_ms < wake)
				wake = c->head->deadline_ms;
			if (c->progress_ms + BULK_STALL_MS < wake)
				wake = c->progress_ms + BULK_STALL_MS;
		}
	}
	pthread_mutex_unlock(&b->lock);
	jobs_done(fin);
	fin = NULL;
	if (poll(p, np, (int)(wake > now ? wake - now : 0)) <= 0)
		return;
	if (p[0].revents & POLLIN) {
		char drain[64];

		while (read(s->wake[0], drain, sizeof(drain)) == (ssize_t)sizeof(drain))
			;
	}
	for (unsigned k = 1; k < np; k++) {
		struct bulk_conn *c = &b->conns[who[k]];
		int rc = 0;

		if (!p[k].revents)
			continue;
		if (p[k].revents & (POLLERR | POLLHUP | POLLNVAL))
			rc = -EPIPE; /* cut by bulk_shutdown, or the client left */
		else
			rc = conn_pump(b, c, &fin);
		if (rc) {
			pthread_mutex_lock(&b->lock);
			conn_fail(b, c, rc, rc == -EPIPE ? NULL : strerror(-rc), &fin);
			pthread_mutex_unlock(&b->lock);
		}
	}
	jobs_done(fin);
}

static void *sender_main(void *arg)
{
	struct sender *s = arg;

	while (!atomic_load(&s->b->stop))
		sender_turn(s);
	return NULL;
}

/*
 * Fill iov[0..n) (modified) from fd by deadline_ms: 0, -ETIMEDOUT, -EPIPE (closed, cut
 * or failed) or -errno. Blocking reads of all that is asked (the kernel wakes the
 * reader when it is there, not at every segment), each bounded by SO_RCVTIMEO, at most
 * a second, so that the deadline is the whole payload's: a client that sends a few
 * bytes at a time cannot stretch it. bulk_shutdown's shutdown(2) ends a read at once.
 */
static int read_all(int fd, struct iovec *iov, int n, int64_t deadline_ms)
{
	kvbb_iov_advance(&iov, &n, 0);
	while (n > 0) {
		struct msghdr m = { .msg_iov = iov, .msg_iovlen = (size_t)n };
		int64_t left = deadline_ms - now_ms();
		struct timeval tv;
		ssize_t r;

		if (left <= 0)
			return -ETIMEDOUT;
		if (left > 1000)
			left = 1000;
		tv = (struct timeval){ left / 1000, (suseconds_t)(left % 1000) * 1000 };
		if (setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)))
			return -errno;
		r = recvmsg(fd, &m, MSG_WAITALL);
		if (r < 0 && (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK))
			continue; /* (the deadline is checked above) */
		if (r == 0)
			return -EPIPE;
		if (r < 0)
			return -errno;
		kvbb_iov_advance(&iov, &n, (size_t)r);
	}
	return 0;
}

/* When the bytes up to offset `upto` of a PUT started at start_ms are due (not after end). */
static int64_t put_due(int64_t start_ms, uint64_t upto, int64_t end_ms)
{
	/* (upto is at most max_message: the sum cannot overflow) */
	int64_t due = start_ms + PUT_START_MS + (int64_t)(upto / PUT_MIN_BYTES_PER_MS);

	return due < end_ms ? due : end_ms;
}

/* why for a read of a PUT's records that failed with rc, off bytes in, due at due. */
static void put_failed(char *why, size_t why_len, int rc, uint64_t off, uint64_t total,
		       int64_t start_ms, int64_t due, int64_t end_ms)
{
	if (rc == -ETIMEDOUT && due < end_ms)
		snprintf(why, why_len, "the bulk connection fell behind: %" PRIu64 " of the "
			 "payload's %" PRIu64 " bytes in %lld ms (a PUT's records must start "
			 "within %d ms and keep up with %d MB/s; send it in frames instead)", off,
			 total, (long long)(now_ms() - start_ms), PUT_START_MS,
			 PUT_MIN_BYTES_PER_MS / 1000);
	else
		snprintf(why, why_len, "the bulk connection %s after %" PRIu64 " of the "
			 "payload's %" PRIu64 " bytes", rc == -ETIMEDOUT ? "timed out" : "closed",
			 off, total);
}

/* The records of one PUT payload into buf[0..total), on c (its recv_lock held), started
 * at start_ms, whole by deadline. */
static int recv_records(struct bulk *b, struct bulk_conn *c, uint64_t request_id,
			uint8_t *buf, uint64_t total, int64_t start_ms, int64_t deadline,
			char *why, size_t why_len)
{
	uint8_t hdr[KVBB_HDR_LEN], next[KVBB_HDR_LEN];
	bool have = false;
	uint64_t off = 0;
	int rc;

	do {
		int64_t due = put_due(start_ms, off + sizeof(hdr), deadline);
		uint8_t tag[KVBB_TAG_LEN];
		struct kvbb_hdr h;
		struct iovec v[3];

		v[0] = (struct iovec){ hdr, sizeof(hdr) };
		if (have) /* came with the record before */
			memcpy(hdr, next, sizeof(hdr));
		else if ((rc = read_all(c->fd, v, 1, due))) {
			put_failed(why, why_len, rc, off, total, start_ms, due, deadline);
			return rc;
		}
		/* every size checked before a byte lands in buf */
		if (kvbb_hdr_get(hdr, &h) || (h.flags & KVBB_ABORT)) {
			snprintf(why, why_len, "bulk record %" PRIu64 " has a malformed header",
				 c->rcounter);
			return -EPROTO;
		}
		if (h.request_id != request_id || h.total != total || h.offset != off ||
		    h.len > total - off || (!h.len && total) ||
		    ((h.flags & KVBB_LAST) != 0) != (off + h.len == total)) {
			snprintf(why, why_len, "bulk record of request %" PRIu64 " at byte %" PRIu64
				 " of %" PRIu64 " (%" PRIu32 " bytes) does not follow: expected "
				 "request %" PRIu64 " at byte %" PRIu64 " of %" PRIu64, h.request_id,
				 h.offset, h.total, h.len, request_id, off, total);
			return -EPROTO;
		}
		/* the bytes, the tag, and the next record's header when one follows (a client
		 * sends a payload's records back to back): one read a record */
		have = !(h.flags & KVBB_LAST);
		v[0] = (struct iovec){ buf + off, h.len };
		v[1] = (struct iovec){ tag, c->sealed ? sizeof(tag) : 0 };
		v[2] = (struct iovec){ next, have ? sizeof(next) : 0 };
		due = put_due(start_ms, off + h.len, deadline);
		if ((rc = read_all(c->fd, v, 3, due))) {
			put_failed(why, why_len, rc, off, total, start_ms, due, deadline);
			return rc;
		}
		if (c->sealed) {
			if (kvbb_open(c->aead, c->rcounter, KVBB_DIR_PUT, hdr, sizeof(hdr), buf + off,
				      h.len, tag)) {
				snprintf(why, why_len, "bulk record %" PRIu64 " (bytes %" PRIu64
					 "..%" PRIu64 ") failed its %s check: altered on the wire",
					 c->rcounter, off, off + h.len, kvbb_aead_name(c->aead));
				return -EBADMSG;
			}
			atomic_fetch_add(&b->opened_records, 1);
		}
		c->rcounter++;
		off += h.len;
		atomic_fetch_add(&b->bytes_in, h.len);
	} while (off < total);
	return 0;
}

int bulk_recv(struct bulk *b, struct bulk_conn *c, uint64_t request_id, void *buf,
	      uint64_t total, char *why, size_t why_len)
{
	const char *principal = c->principal;
	/* a PUT's payload is never unbounded in time: without a reply timeout, 30 s */
	int64_t start = now_ms(), deadline = start + (b->send_timeout_ms ? b->send_timeout_ms
									     : 30000);
	struct timespec until = { deadline / 1000, (deadline % 1000) * 1000000 };
	int rc = -pthread_mutex_clocklock(&c->recv_lock, CLOCK_MONOTONIC, &until);

	if (rc) {
		snprintf(why, why_len, "another payload held the bulk connection past the "
			 "deadline");
	} else {
		rc = recv_records(b, c, request_id, buf, total, start, deadline, why, why_len);
		pthread_mutex_unlock(&c->recv_lock);
	}
	/* its records not (all) read: the stream is out of step, the client opens
	 * another (its writes fail at once instead of waiting for a reader) */
	conn_give_back(b, c, rc != 0, principal, why);
	return rc;
}

void bulk_cut(struct bulk *b, struct bulk_conn *c)
{
	conn_give_back(b, c, true, c->principal, NULL);
}

/* A whole hello arrived on s: bind its connection to the ticket's entry, or refuse it. */
static void hello_done(struct bulk *b, struct shake *s)
{
	uint8_t ticket[KVBP_BULK_TICKET_LEN], ok = 1;
	struct bulk_conn *c = NULL;

	if (!kvbb_hello_ticket(s->buf, ticket)) {
		pthread_mutex_lock(&b->lock);
		for (unsigned i = 0; i < BULK_MAX && !c; i++) {
			struct bulk_conn *x = &b->conns[i];

			if (x->used && !x->dead && x->fd < 0 &&
			    !CRYPTO_memcmp(x->ticket, ticket, sizeof(ticket)))
				c = x;
		}
		/* over CURVE, the hello proves it comes from who got the key */
		if (c && (!c->sealed || !kvbb_hello_check(s->buf, c->aead))) {
			int one = 1;

			/* blocking: writers send with MSG_DONTWAIT and poll against their
			 * payload's deadline (write_all); readers wait in the kernel (read_all) */
			setsockopt(s->fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
			c->fd = s->fd;
			ok = 0;
		}
		pthread_mutex_unlock(&b->lock);
	}
	if (send(s->fd, &ok, 1, MSG_DONTWAIT | MSG_NOSIGNAL) != 1 || ok) {
		if (ok)
			log_warn("bulk connection refused: %s", c ? "its hello failed the key's check"
								 : "unknown or used ticket");
		if (!ok) { /* the client is gone already */
			pthread_mutex_lock(&b->lock);
			conn_drop(c);
			pthread_mutex_unlock(&b->lock);
		} else {
			close(s->fd);
		}
	}
	s->fd = -1;
}

static void accept_one(struct bulk *b, int64_t now)
{
	int fd = accept4(b->listen_fd, NULL, NULL, SOCK_CLOEXEC);

	if (fd < 0)
		return;
	for (unsigned i = 0; i < BULK_SHAKES; i++)
		if (b->shakes[i].fd < 0) {
			b->shakes[i] = (struct shake){ fd, 0, now + HELLO_MS, { 0 } };
			return;
		}
	close(fd); /* too many hellos at once */
}

/* One turn of the accept thread: new connections, hellos, closed connections, expiry. */
static void accept_turn(struct bulk *b)
{
	struct pollfd p[2 + BULK_SHAKES + BULK_MAX];
	int who[2 + BULK_SHAKES + BULK_MAX]; /* shake i, or -1 - conn index */
	unsigned np = 0;
	int64_t now;

	p[np++] = (struct pollfd){ b->wake[0], POLLIN, 0 };
	p[np++] = (struct pollfd){ b->listen_fd, POLLIN, 0 };
	for (unsigned i = 0; i < BULK_SHAKES; i++)
		if (b->shakes[i].fd >= 0) {
			who[np] = (int)i;
			p[np++] = (struct pollfd){ b->shakes[i].fd, POLLIN, 0 };
		}
	pthread_mutex_lock(&b->lock);
	for (unsigned i = 0; i < BULK_MAX; i++)
		if (b->conns[i].used && !b->conns[i].dead && b->conns[i].fd >= 0) {
			who[np] = -1 - (int)i;
			/* not POLLIN: a PUT's records may wait there for their worker */
			p[np++] = (struct pollfd){ b->conns[i].fd, POLLRDHUP, 0 };
		}
	pthread_mutex_unlock(&b->lock);
	if (poll(p, np, 250) < 0)
		return;
	now = now_ms();
	if (p[1].revents & POLLIN)
		accept_one(b, now);
	for (unsigned k = 2; k < np; k++) {
		if (!p[k].revents)
			continue;
		if (who[k] >= 0) {
			struct shake *s = &b->shakes[who[k]];
			ssize_t r = recv(s->fd, s->buf + s->got, sizeof(s->buf) - s->got,
					 MSG_DONTWAIT);

			if (r > 0 && (s->got += (size_t)r) == sizeof(s->buf)) {
				hello_done(b, s);
			} else if (r == 0 || (r < 0 && errno != EAGAIN && errno != EINTR)) {
				close(s->fd);
				s->fd = -1;
			}
		} else {
			/* the client closed it (or it failed): a worker reading a PUT from it
			 * has what was sent before; the rest fails there */
			struct bulk_conn *c = &b->conns[-1 - who[k]];

			pthread_mutex_lock(&b->lock);
			if (c->used && c->fd == p[k].fd && !c->dead)
				conn_drop(c);
			pthread_mutex_unlock(&b->lock);
		}
	}
	for (unsigned i = 0; i < BULK_SHAKES; i++)
		if (b->shakes[i].fd >= 0 && now > b->shakes[i].deadline_ms) {
			close(b->shakes[i].fd);
			b->shakes[i].fd = -1;
		}
	pthread_mutex_lock(&b->lock);
	for (unsigned i = 0; i < BULK_MAX; i++) {
		struct bulk_conn *c = &b->conns[i];

		if (c->used && !c->dead && c->fd < 0 && now > c->deadline_ms)
			conn_drop(c);
	}
	pthread_mutex_unlock(&b->lock);
}

static void *accept_main(void *arg)
{
	struct bulk *b = arg;

	while (!atomic_load(&b->stop))
		accept_turn(b);
	return NULL;
}

static int listen_on(const char *host, unsigned port, int *fd_out, unsigned *port_out)
{
	struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
				  .ai_flags = AI_PASSIVE | AI_NUMERICSERV }, *ai = NULL;
	struct sockaddr_storage a;
	socklen_t len = sizeof(a);
	char serv[8];
	int fd = -1, one = 1, rc;

	snprintf(serv, sizeof(serv), "%u", port);
	rc = getaddrinfo(!strcmp(host, "*") ? NULL : host, serv, &hints, &ai);
	if (rc) {
		log_err("bulk connections: cannot resolve %s: %s", host, gai_strerror(rc));
		return -EINVAL;
	}
	fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one)) ||
	    bind(fd, ai->ai_addr, ai->ai_addrlen) || listen(fd, 64) ||
	    getsockname(fd, (struct sockaddr *)&a, &len)) {
		rc = -errno;
		log_err("bulk connections: cannot listen on %s port %u: %s", host, port,
			strerror(-rc));
		if (fd >= 0)
			close(fd);
		freeaddrinfo(ai);
		return rc;
	}
	freeaddrinfo(ai);
	*fd_out = fd;
	*port_out = ntohs(a.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&a)->sin6_port
						  : ((struct sockaddr_in *)&a)->sin_port);
	return 0;
}

int bulk_start(struct bulk **out, const char *host, unsigned port, unsigned send_timeout_ms,
	       unsigned senders)
{
	struct bulk *b = calloc(1, sizeof(*b));
	sigset_t all, old;
	int rc;

	if (!b)
		return -ENOMEM;
	b->listen_fd = b->wake[0] = b->wake[1] = -1;
	b->send_timeout_ms = send_timeout_ms;
	b->n_senders = senders < 1 ? 1 : senders > BULK_SENDERS_MAX ? BULK_SENDERS_MAX : senders;
	for (unsigned k = 0; k < BULK_SENDERS_MAX; k++)
		b->senders[k] = (struct sender){ b, k, { -1, -1 }, 0, false };
	pthread_mutex_init(&b->lock, NULL);
	for (unsigned i = 0; i < BULK_MAX; i++) {
		b->conns[i].fd = -1;
		b->conns[i].rcounter = 1;
		pthread_mutex_init(&b->conns[i].recv_lock, NULL);
	}
	for (unsigned i = 0; i < BULK_SHAKES; i++)
		b->shakes[i].fd = -1;
	rc = listen_on(host, port, &b->listen_fd, &b->port);
	if (!rc && pipe2(b->wake, O_CLOEXEC))
		rc = -errno;
	if (rc)
		goto fail;
	/* the accept thread takes no signals: the main loop handles them */
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	rc = -pthread_create(&b->thread, NULL, accept_main, b);
	b->started = !rc;
	for (unsigned k = 0; !rc && k < b->n_senders; k++) {
		struct sender *s = &b->senders[k];

		if (pipe2(s->wake, O_CLOEXEC | O_NONBLOCK))
			rc = -errno;
		else
			rc = -pthread_create(&s->thread, NULL, sender_main, s);
		s->started = !rc;
	}
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc)
		goto fail;
	*out = b;
	return 0;
fail:
	bulk_stop(&b);
	return rc;
}

unsigned bulk_port(const struct bulk *b)
{
	return b->port;
}

void bulk_stop(struct bulk **bp)
{
	struct bulk *b = bp ? *bp : NULL;

	if (!b)
		return;
	if (b->started) {
		atomic_store(&b->stop, true);
		if (write(b->wake[1], "", 1) < 0) {
			/* the poll's timeout ends the thread anyway */
		}
		pthread_join(b->thread, NULL);
	}
	for (unsigned k = 0; k < BULK_SENDERS_MAX; k++) {
		struct sender *s = &b->senders[k];

		if (s->started) {
			sender_wake(b, k);
			pthread_join(s->thread, NULL);
		}
		if (s->wake[0] >= 0) {
			close(s->wake[0]);
			close(s->wake[1]);
		}
	}
	/* payloads still queued (a stop without bulk_shutdown): their owners let go now */
	for (unsigned i = 0; i < BULK_MAX; i++) {
		struct bulk_job *fin = NULL;

		pthread_mutex_lock(&b->lock);
		if (b->conns[i].used && b->conns[i].head)
			conn_fail(b, &b->conns[i], -EPIPE, NULL, &fin);
		pthread_mutex_unlock(&b->lock);
		jobs_done(fin);
	}
	for (unsigned i = 0; i < BULK_SHAKES; i++)
		if (b->shakes[i].fd >= 0)
			close(b->shakes[i].fd);
	for (unsigned i = 0; i < BULK_MAX; i++) {
		if (b->conns[i].used)
			conn_free(&b->conns[i]); /* the workers and senders have stopped */
		pthread_mutex_destroy(&b->conns[i].recv_lock);
	}
	pthread_mutex_destroy(&b->lock);
	if (b->listen_fd >= 0)
		close(b->listen_fd);
	if (b->wake[0] >= 0) {
		close(b->wake[0]);
		close(b->wake[1]);
	}
	free(b);
	*bp = NULL;
}

void bulk_shutdown(struct bulk *b)
{
	unsigned cut = 0;

	if (!b)
		return;
	pthread_mutex_lock(&b->lock);
	b->closing = true;
	for (unsigned i = 0; i < BULK_MAX; i++) {
		struct bulk_conn *c = &b->conns[i];

		if (c->used && !c->dead) {
			cut += c->fd >= 0;
			conn_drop(c);
		}
	}
	pthread_mutex_unlock(&b->lock);
	for (unsigned k = 0; k < b->n_senders; k++)
		sender_wake(b, k); /* their payloads end now */
	if (cut)
		log_info("stopping: %u bulk connections cut (payloads in flight end there)", cut);
}

void bulk_counts(struct bulk *b, struct bulk_stats *out)
{
	uint64_t n = 0;

	pthread_mutex_lock(&b->lock);
	for (unsigned i = 0; i < BULK_MAX; i++)
		n += b->conns[i].used && !b->conns[i].dead && b->conns[i].fd >= 0;
	pthread_mutex_unlock(&b->lock);
	out->open = n;
	out->sealed_records = atomic_load(&b->sealed_records);
	out->bytes = atomic_load(&b->bytes);
	out->opened_records = atomic_load(&b->opened_records);
	out->bytes_in = atomic_load(&b->bytes_in);
}
