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
	unsigned users; /* workers sending on it */
	uint64_t counter; /* records sent: the next nonce */
	uint64_t rcounter; /* PUT records received, plus one (the hello): the next nonce */
	pthread_mutex_t send_lock, recv_lock;
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

/*
 * Write all of iov (modified) to fd (non-blocking) by deadline_ms (CLOCK_MONOTONIC):
 * 0, -ETIMEDOUT, -EPIPE or -errno. The deadline is the whole payload's, not one
 * write's: a reader that drains a few bytes at a time cannot stretch it.
 */
static int write_all(int fd, struct iovec *iov, int n, int64_t deadline_ms)
{
	while (n > 0) {
		struct msghdr m = { .msg_iov = iov, .msg_iovlen = (size_t)n };
		ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);

		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
			struct pollfd p = { fd, POLLOUT, 0 };
			int64_t left = deadline_ms - now_ms();

			if (left <= 0)
				return -ETIMEDOUT;
			if (poll(&p, 1, left > 1000 ? 1000 : (int)left) < 0 && errno != EINTR)
				return -errno;
			if (p.revents & (POLLERR | POLLHUP | POLLNVAL))
				return -EPIPE; /* cut by bulk_shutdown, or the client left */
			continue;
		}
		if (w < 0)
			return -errno;
		kvbb_iov_advance(&iov, &n, (size_t)w);
	}
	return 0;
}

/* The abort record at off: no bytes, the last of the payload (sealed: its tag). */
static int send_abort(struct bulk_conn *c, uint64_t request_id, uint64_t total, uint64_t off,
		      int64_t deadline)
{
	struct kvbb_hdr h = { KVBB_LAST | KVBB_ABORT, request_id, total, off, 0 };
	uint8_t hdr[KVBB_HDR_LEN], tag[KVBB_TAG_LEN];
	struct iovec msg[2] = { { hdr, sizeof(hdr) }, { tag, sizeof(tag) } };

	kvbb_hdr_put(hdr, &h);
	if (c->sealed && kvbb_seal(c->aead, c->counter, KVBB_DIR_RECORDS, hdr, sizeof(hdr), NULL,
				   0, NULL, tag))
		return -EIO;
	c->counter++;
	return write_all(c->fd, msg, c->sealed ? 2 : 1, deadline);
}

/* The records of one payload, on c (its send_lock held). */
static int send_records(struct bulk *b, struct bulk_conn *c, uint64_t request_id,
			const struct iovec *iov, size_t n, const struct bulk_check *check,
			uint64_t total, uint8_t *bounce, int64_t deadline)
{
	size_t rec = c->sealed ? KVBB_SEAL_BYTES : KVBB_RECORD_MAX, fi = 0, fpos = 0;
	uint64_t off = 0;

	do {
		struct iovec part[IOV_PER_RECORD], msg[IOV_PER_RECORD + 2];
		uint8_t hdr[KVBB_HDR_LEN], tag[KVBB_TAG_LEN];
		struct kvbb_hdr h = { 0, request_id, total, off, 0 };
		int np = 0, nm = 0, rc;

		/* up to rec bytes from the frames, at most IOV_PER_RECORD pieces, each
		 * checked before its first byte is taken */
		while (fi < n && np < IOV_PER_RECORD && h.len < rec) {
			size_t take = iov[fi].iov_len - fpos;

			if (!fpos && check && check->fn(check->arg, fi)) {
				/* nothing of this record went out yet: the abort replaces it */
				rc = send_abort(c, request_id, total, off, deadline);
				return rc ? rc : -EBADMSG;
			}
			if (take > rec - h.len)
				take = rec - h.len;
			if (take) {
				part[np].iov_base = (uint8_t *)iov[fi].iov_base + fpos;
				part[np++].iov_len = take;
				h.len += (uint32_t)take;
				fpos += take;
			}
			if (fpos == iov[fi].iov_len) {
				fi++;
				fpos = 0;
			}
		}
		if (off + h.len == total)
			h.flags = KVBB_LAST;
		kvbb_hdr_put(hdr, &h);
		msg[nm].iov_base = hdr;
		msg[nm++].iov_len = sizeof(hdr);
		if (c->sealed) {
			if (kvbb_seal(c->aead, c->counter, KVBB_DIR_RECORDS, hdr, sizeof(hdr), part,
				      (size_t)np, bounce, tag))
				return -EIO;
			msg[nm].iov_base = bounce;
			msg[nm++].iov_len = h.len;
			msg[nm].iov_base = tag;
			msg[nm++].iov_len = sizeof(tag);
			atomic_fetch_add(&b->sealed_records, 1);
		} else {
			memcpy(msg + nm, part, (size_t)np * sizeof(*part));
			nm += np;
		}
		c->counter++;
		/* counted before the write: a client that has read the last byte finds it
		 * counted (taken back if the write fails) */
		atomic_fetch_add(&b->bytes, h.len);
		rc = write_all(c->fd, msg, nm, deadline);
		if (rc) {
			atomic_fetch_sub(&b->bytes, h.len);
			return rc;
		}
		off += h.len;
	} while (off < total);
	return 0;
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

int bulk_send(struct bulk *b, struct bulk_conn *c, uint64_t request_id,
	      const struct iovec *iov, size_t n, const struct bulk_check *check, uint64_t *sent)
{
	const char *principal = c->principal;
	uint8_t *bounce = NULL;
	uint64_t total = 0;
	/*
	 * As for replies from the pages in frames (held.h): the whole payload, the wait
	 * for the connection's send lock included, within the timeout, so that a client
	 * reading a trickle (or not at all) holds a worker no longer than that.
	 */
	int64_t deadline = b->send_timeout_ms ? now_ms() + b->send_timeout_ms : INT64_MAX;
	struct timespec until = { deadline / 1000, (deadline % 1000) * 1000000 };
	int rc;

	for (size_t i = 0; i < n; i++)
		total += iov[i].iov_len;
	rc = b->send_timeout_ms ? -pthread_mutex_clocklock(&c->send_lock, CLOCK_MONOTONIC, &until)
				: -pthread_mutex_lock(&c->send_lock);
	if (!rc) {
		if (c->sealed && !(bounce = malloc(KVBB_SEAL_BYTES)))
			rc = -ENOMEM;
		else
			rc = send_records(b, c, request_id, iov, n, check, total, bounce,
					  deadline);
		pthread_mutex_unlock(&c->send_lock);
	}
	free(bounce);
	/* a half-sent payload leaves the stream unusable: the client opens another */
	conn_give_back(b, c, rc && rc != -EBADMSG, principal, strerror(-rc));
	if (!rc)
		*sent = total;
	return rc;
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

int bulk_start(struct bulk **out, const char *host, unsigned port, unsigned send_timeout_ms)
{
	struct bulk *b = calloc(1, sizeof(*b));
	sigset_t all, old;
	int rc;

	if (!b)
		return -ENOMEM;
	b->listen_fd = b->wake[0] = b->wake[1] = -1;
	b->send_timeout_ms = send_timeout_ms;
	pthread_mutex_init(&b->lock, NULL);
	for (unsigned i = 0; i < BULK_MAX; i++) {
		b->conns[i].fd = -1;
		b->conns[i].rcounter = 1;
		pthread_mutex_init(&b->conns[i].send_lock, NULL);
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
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc)
		goto fail;
	b->started = true;
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
	for (unsigned i = 0; i < BULK_SHAKES; i++)
		if (b->shakes[i].fd >= 0)
			close(b->shakes[i].fd);
	for (unsigned i = 0; i < BULK_MAX; i++) {
		if (b->conns[i].used)
			conn_free(&b->conns[i]); /* the workers have stopped */
		pthread_mutex_destroy(&b->conns[i].send_lock);
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
