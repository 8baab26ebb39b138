/*
 * bulk — libkvblend's end of a bulk connection (docs/protocol.md#bulk-connections): PUT
 * payloads over TCP leave as records on it, sealed from the caller's buffer; GET
 * payloads over TCP arrive as records on a plain TCP connection, received straight into
 * the caller's buffer (no ZeroMQ frame is allocated, so no page of it is faulted in per
 * GET) and, when the daemon handed a key over CURVE, opened in place with the cipher the
 * daemon chose: AEGIS-128X2 or AEGIS-128L where this CPU has the AES instructions for
 * it (and KVBLEND_BULK_CIPHER does not say otherwise), else AES-256-GCM. See
 * client_impl.h.
 */
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/socket.h>
#include <unistd.h>

#include <openssl/crypto.h>

#include "client/client_impl.h"

void kvbc_bulk_close(kvb_client *c)
{
	if (c->bulk_fd >= 0)
		close(c->bulk_fd);
	c->bulk_fd = -1;
	kvbb_aead_free(&c->bulk_aead);
	OPENSSL_cleanse(c->bulk_ticket, sizeof(c->bulk_ticket));
	c->bulk_counter = 0;
	c->bulk_scounter = 1;
	c->bulk_put = false;
	c->bulk_have_hdr = false;
	if (c->bulk_state > 0)
		c->bulk_state = 0;
}

/* Connect to the host of c->endpoint at port, within the client's timeout: fd or -errno. */
static int connect_bulk(kvb_client *c, unsigned port)
{
	struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
				  .ai_flags = AI_NUMERICSERV }, *ai = NULL;
	struct timeval tv = { c->timeout_ms / 1000, (c->timeout_ms % 1000) * 1000 };
	char host[512], serv[8];
	int fd, one = 1;

	if (kvbb_endpoint_host(c->endpoint, host, sizeof(host)))
		return -EINVAL;
	snprintf(serv, sizeof(serv), "%u", port);
	if (getaddrinfo(host, serv, &hints, &ai))
		return -EHOSTUNREACH;
	fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	/* blocking, each wait bounded by the timeout (connect too, on Linux) */
	if (fd < 0 || setsockopt(fd, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv)) ||
	    setsockopt(fd, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv)) ||
	    setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) ||
	    connect(fd, ai->ai_addr, ai->ai_addrlen)) {
		int e = errno;

		if (fd >= 0)
			close(fd);
		freeaddrinfo(ai);
		return -e;
	}
	freeaddrinfo(ai);
	return fd;
}

uint32_t kvbc_bulk_offer(void)
{
	const char *want = getenv("KVBLEND_BULK_CIPHER");
	uint32_t mask = kvbb_aeads();

	if (!want || !*want)
		return mask;
	for (uint32_t c = 0; c <= KVBP_AEAD_MAX; c++)
		if (!strcasecmp(want, kvbb_cipher_name(c)))
			return mask & (c ? 1u << c : 0);
	return mask;
}

int kvbc_bulk_attach(kvb_client *c, struct kvbp_reply *rep, uint32_t offer)
{
	uint8_t hello[KVBB_HELLO_LEN], ack = 1;
	int rc;

	if (!rep->bulk_port)
		return -ENOTSUP; /* an older daemon, tcp_bulk off, its limits: frames it is */
	if ((c->curve && !rep->has_bulk_key) ||
	    (rep->bulk_aead != KVBP_AEAD_AES256GCM && !(offer & 1u << rep->bulk_aead))) {
		/* over CURVE, never take payloads in the clear; nor a cipher not offered */
		OPENSSL_cleanse(rep->bulk_key, sizeof(rep->bulk_key));
		return -EPROTO;
	}
	memcpy(c->bulk_ticket, rep->bulk_ticket, sizeof(c->bulk_ticket));
	rc = rep->has_bulk_key ? kvbb_aead_new(&c->bulk_aead, rep->bulk_key, rep->bulk_aead) : 0;
	OPENSSL_cleanse(rep->bulk_key, sizeof(rep->bulk_key));
	if (!rc)
		rc = connect_bulk(c, rep->bulk_port);
	if (rc < 0)
		return rc;
	c->bulk_fd = rc;
	c->bulk_counter = 0;
	c->bulk_scounter = 1;
	c->bulk_put = rep->bulk_put;
	rc = kvbb_hello_put(hello, c->bulk_ticket, c->bulk_aead);
	if (!rc && (send(c->bulk_fd, hello, sizeof(hello), MSG_NOSIGNAL) != sizeof(hello) ||
		    recv(c->bulk_fd, &ack, 1, MSG_WAITALL) != 1 || ack != 0))
		rc = -ECONNREFUSED;
	return rc;
}

/* Fill iov[0..n) (modified) from fd: 0, -ETIMEDOUT or -EIO. */
static int recv_iov_all(int fd, struct iovec *iov, int n)
{
	kvbb_iov_advance(&iov, &n, 0); /* empty pieces first */
	while (n > 0) {
		struct msghdr m = { .msg_iov = iov, .msg_iovlen = (size_t)n };
		ssize_t r = recvmsg(fd, &m, MSG_WAITALL);

		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK))
			return -ETIMEDOUT;
		if (r <= 0)
			return -EIO;
		kvbb_iov_advance(&iov, &n, (size_t)r);
	}
	return 0;
}

/* Receive exactly len bytes into p: 0, -ETIMEDOUT or -EIO. */
static int recv_all(int fd, uint8_t *p, size_t len)
{
	struct iovec v = { p, len };

	return recv_iov_all(fd, &v, 1);
}

static int bulk_fail(kvb_client *c, int rc, const char *fmt, ...)
	__attribute__((format(printf, 3, 4)));

/* Write all of iov[0..n) (modified) to fd (blocking, each wait bounded): 0, -ETIMEDOUT, -EPIPE. */
static int send_iov_all(int fd, struct iovec *iov, int n)
{
	kvbb_iov_advance(&iov, &n, 0);
	while (n > 0) {
		struct msghdr m = { .msg_iov = iov, .msg_iovlen = (size_t)n };
		ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL);

		if (w < 0 && errno == EINTR)
			continue;
		if (w < 0)
			return errno == EAGAIN || errno == EWOULDBLOCK ? -ETIMEDOUT : -EPIPE;
		kvbb_iov_advance(&iov, &n, (size_t)w);
	}
	return 0;
}

int kvbc_bulk_send(kvb_client *c, const struct call *k)
{
	size_t rec = c->bulk_aead ? KVBB_SEAL_BYTES : KVBB_RECORD_MAX, off = 0;
	uint8_t *bounce = NULL;
	int rc = 0;

	if (c->bulk_aead && !(bounce = malloc(KVBB_SEAL_BYTES)))
		return bulk_fail(c, -ENOMEM, "out of memory for a bulk record");
	do {
		size_t len = k->bulk_out_len - off < rec ? k->bulk_out_len - off : rec;
		struct kvbb_hdr h = { off + len == k->bulk_out_len ? KVBB_LAST : 0,
				      k->req.request_id, k->bulk_out_len, off, (uint32_t)len };
		uint8_t hdr[KVBB_HDR_LEN], tag[KVBB_TAG_LEN];
		struct iovec v[3] = { { hdr, sizeof(hdr) },
				      { (void *)(k->bulk_out + off), len },
				      { tag, 0 } };

		kvbb_hdr_put(hdr, &h);
		if (c->bulk_aead) {
			if (kvbb_seal(c->bulk_aead, c->bulk_scounter, KVBB_DIR_PUT, hdr, sizeof(hdr),
				      &v[1], 1, bounce, tag)) {
				rc = -EIO;
				break;
			}
			v[1].iov_base = bounce;
			v[2].iov_len = sizeof(tag);
		}
		c->bulk_scounter++;
		if ((rc = send_iov_all(c->bulk_fd, v, 3)))
			break;
		off += len;
	} while (off < k->bulk_out_len);
	free(bounce);
	if (rc)
		return bulk_fail(c, rc, "the bulk connection to %s %s after %zu of the PUT's %zu "
				 "bytes", c->endpoint, rc == -ETIMEDOUT ? "timed out"
				 : rc == -EIO ? "could not seal a record" : "closed", off,
				 k->bulk_out_len);
	return 0;
}

static int bulk_fail(kvb_client *c, int rc, const char *fmt, ...)
{
	va_list ap;

	kvbc_bulk_close(c);
	va_start(ap, fmt);
	vsnprintf(c->err, sizeof(c->err), fmt, ap);
	va_end(ap);
	c->err_code = rc;
	return rc;
}

int kvbc_bulk_record(kvb_client *c, struct call *k)
{
	uint8_t hdr[KVBB_HDR_LEN], tag[KVBB_TAG_LEN];
	struct kvbb_hdr h;
	struct iovec v[3];
	ssize_t first = 1;
	int rc = 0;

	if (c->bulk_have_hdr) { /* came with the record before */
		memcpy(hdr, c->bulk_hdr, sizeof(hdr));
		c->bulk_have_hdr = false;
	} else {
		first = recv(c->bulk_fd, hdr, 1, 0);
		if (first == 0 && !k->bulk_got) {
			/* closed between payloads (the daemon restarted, or cut an idle reader):
			 * this reply comes in frames if at all; the next GET opens another */
			kvbc_bulk_close(c);
			return 1;
		}
		rc = first == 1 ? recv_all(c->bulk_fd, hdr + 1, sizeof(hdr) - 1)
		     : first < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) ? -ETIMEDOUT : -EIO;
	}
	if (rc)
		return bulk_fail(c, rc, "the bulk connection to %s %s", c->endpoint,
				 rc == -ETIMEDOUT ? "timed out" : "closed mid-payload");
	if (kvbb_hdr_get(hdr, &h))
		return bulk_fail(c, KVB_E_PROTOCOL, "the bulk connection to %s sent a malformed "
				 "record header", c->endpoint);
	/* every size checked before a byte lands in the caller's buffer */
	if (h.request_id != k->req.request_id || h.offset != k->bulk_got || k->bulk_last ||
	    h.len > h.total - h.offset || h.total < h.offset ||
	    (!(h.flags & KVBB_ABORT) && ((h.flags & KVBB_LAST) != 0) != (h.offset + h.len == h.total)))
		return bulk_fail(c, KVB_E_PROTOCOL, "bulk record of request %llu at byte %llu is "
				 "out of order (expected request %llu at byte %zu)",
				 (unsigned long long)h.request_id, (unsigned long long)h.offset,
				 (unsigned long long)k->req.request_id, k->bulk_got);
	if (h.total > k->sink_len)
		return bulk_fail(c, -ENOBUFS, "buffer of %zu bytes does not match the %llu bytes "
				 "of the requested layers", k->sink_len,
				 (unsigned long long)h.total);
	/* the bytes, the tag, and the next record's header when one follows (the daemon
	 * sends a payload's records back to back): one receive a record */
	v[0] = (struct iovec){ k->sink + h.offset, h.len };
	v[1] = (struct iovec){ tag, c->bulk_aead ? sizeof(tag) : 0 };
	v[2] = (struct iovec){ c->bulk_hdr, h.flags & KVBB_LAST ? 0 : sizeof(c->bulk_hdr) };
	rc = recv_iov_all(c->bulk_fd, v, 3);
	if (rc)
		return bulk_fail(c, rc, "the bulk connection to %s %s", c->endpoint,
				 rc == -ETIMEDOUT ? "timed out" : "closed mid-payload");
	if (c->bulk_aead && kvbb_open(c->bulk_aead, c->bulk_counter, KVBB_DIR_RECORDS, hdr,
				      sizeof(hdr), k->sink + h.offset, h.len, tag))
		return bulk_fail(c, KVB_E_PROTOCOL, "bulk record %llu (bytes %llu..%llu of request "
				 "%llu) failed its %s check: altered on the wire; the payload is "
				 "refused", (unsigned long long)c->bulk_counter,
				 (unsigned long long)h.offset,
				 (unsigned long long)(h.offset + h.len),
				 (unsigned long long)h.request_id, kvbb_aead_name(c->bulk_aead));
	c->bulk_counter++;
	c->bulk_have_hdr = !(h.flags & KVBB_LAST);
	k->bulk_got += h.len;
	k->bulk_last = h.flags & KVBB_LAST;
	/* the daemon's copy failed its checksum as it was sent: the connection is still in
	 * step (this record ends the payload); the call fails once its reply is in */
	k->bulk_abort = h.flags & KVBB_ABORT;
	return 0;
}
