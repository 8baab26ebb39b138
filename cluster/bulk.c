/*
 * bulk — a member's end of bulk connections to its peers (docs/protocol.md#bulk-connections,
 * docs/cluster.md): each pooled socket to a peer over tcp:// asks, once, for a bulk
 * connection (HELLO with bulk_open), connects to the peer's bulk port with the ticket,
 * and then receives FETCH payloads there as records (opened with the connection's key
 * when the ticket came over CURVE), straight into one buffer, instead of as ZeroMQ
 * frames (which CURVE encrypts at a fraction of a socket's speed). A peer that offers
 * no bulk connection (tcp_bulk off, an older daemon, its limits) is called in frames.
 */
#include "cluster/cluster_impl.h"

#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

#include <openssl/crypto.h>

#include "common/ckd.h"
#include "proto/bulk.h"

void psock_free(struct psock *ps)
{
	if (!ps)
		return;
	if (ps->s)
		zmq_close(ps->s);
	if (ps->fd >= 0)
		close(ps->fd);
	kvbb_aead_free(&ps->aead);
	OPENSSL_cleanse(ps->ticket, sizeof(ps->ticket));
	free(ps);
}

/* Wait until fd is ready for events or the deadline (ms, monotonic): 0, -ETIMEDOUT, -EIO. */
static int wait_fd(int fd, short events, int64_t deadline)
{
	for (;;) {
		struct pollfd pf = { fd, events, 0 };
		int64_t left = deadline - now_ms();
		int r;

		if (left <= 0)
			return -ETIMEDOUT;
		r = poll(&pf, 1, (int)(left > INT_MAX ? INT_MAX : left));
		if (r > 0)
			return pf.revents & (events | POLLHUP | POLLERR) ? 0 : -EIO;
		if (r < 0 && errno != EINTR)
			return -EIO;
	}
}

/*
 * Fill iov[0..n) (modified) from fd by the deadline: 0, -ETIMEDOUT, -EIO (closed). With
 * stall_ms > 0, also -ETIME when no byte came for stall_ms since *last (ms, monotonic),
 * which each byte received moves on (so that the rule spans calls: one payload's
 * records).
 */
static int recv_iov(int fd, struct iovec *iov, int n, int64_t deadline, int64_t stall_ms,
		    int64_t *last)
{
	kvbb_iov_advance(&iov, &n, 0);
	while (n > 0) {
		struct msghdr m = { .msg_iov = iov, .msg_iovlen = (size_t)n };
		ssize_t r = recvmsg(fd, &m, MSG_DONTWAIT);
		int64_t due = deadline;
		int rc;

		if (r > 0) {
			kvbb_iov_advance(&iov, &n, (size_t)r);
			if (stall_ms > 0)
				*last = now_ms();
			continue;
		}
		if (r == 0 || (errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR))
			return -EIO;
		if (stall_ms > 0 && *last + stall_ms < deadline)
			due = *last + stall_ms;
		if ((rc = wait_fd(fd, POLLIN, due)))
			return rc == -ETIMEDOUT && due < deadline ? -ETIME : rc;
	}
	return 0;
}

/* Send all of iov[0..n) (modified) on fd by the deadline: 0, -ETIMEDOUT, -EIO. */
static int send_iov(int fd, struct iovec *iov, int n, int64_t deadline)
{
	kvbb_iov_advance(&iov, &n, 0);
	while (n > 0) {
		struct msghdr m = { .msg_iov = iov, .msg_iovlen = (size_t)n };
		ssize_t w = sendmsg(fd, &m, MSG_NOSIGNAL | MSG_DONTWAIT);
		int rc;

		if (w > 0) {
			kvbb_iov_advance(&iov, &n, (size_t)w);
			continue;
		}
		if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
			return -EIO;
		if ((rc = wait_fd(fd, POLLOUT, deadline)))
			return rc;
	}
	return 0;
}

/* A TCP connection to port on the host of endpoint (tcp://HOST:PORT) by the deadline. */
static int connect_to(const char *endpoint, unsigned port, int64_t deadline)
{
	struct addrinfo hints = { .ai_family = AF_UNSPEC, .ai_socktype = SOCK_STREAM,
				  .ai_flags = AI_NUMERICSERV }, *ai = NULL;
	char host[CLUSTER_ENDPOINT_MAX], serv[8];
	int fd, one = 1, rc = 0, err = 0;
	socklen_t elen = sizeof(err);

	if (kvbb_endpoint_host(endpoint, host, sizeof(host)))
		return -EINVAL;
	snprintf(serv, sizeof(serv), "%u", port);
	if (getaddrinfo(host, serv, &hints, &ai))
		return -EHOSTUNREACH;
	fd = socket(ai->ai_family, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0) {
		freeaddrinfo(ai);
		return -errno;
	}
	setsockopt(fd, IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
	if (connect(fd, ai->ai_addr, ai->ai_addrlen) && errno != EINPROGRESS)
		rc = -errno;
	freeaddrinfo(ai);
	if (!rc && (rc = wait_fd(fd, POLLOUT, deadline)) == 0 &&
	    (getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &elen) || err))
		rc = err ? -err : -EIO;
	if (rc) {
		close(fd);
		return rc;
	}
	return fd;
}

/*
 * Ask ps's peer for a bulk connection and open it, all by the deadline. Leaves ps as
 * it was (frames) when the peer offers none or anything fails; only a HELLO not
 * answered by the deadline is an error (-ETIMEDOUT, -EIO: the peer is not there).
 */
static int psock_bulk(struct cluster *c, struct psock *ps, const char *endpoint, bool curve,
		      int64_t deadline)
{
	struct kvbp_request q = { .version = KVBP_VERSION, .op = KVBP_OP_HELLO, .bulk_open = true,
				  .bulk_aeads = kvbb_aeads() };
	struct kvbp_reply rep;
	uint8_t *hdr = NULL, hello[KVBB_HELLO_LEN], ack = 1;
	size_t hlen;
	int rc;

	q.request_id = atomic_fetch_add(&c->next_id, 1) + 1;
	if (kvbp_request_encode(&q, &hdr, &hlen))
		return 0;
	rc = zmq_send(ps->s, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
	     zmq_send(ps->s, hdr, hlen, ZMQ_DONTWAIT) < 0 ? -EIO : 0;
	free(hdr);
	for (memset(&rep, 0, sizeof(rep)); !rc;) {
		zmq_pollitem_t it = { ps->s, 0, ZMQ_POLLIN, 0 };
		int64_t left = deadline - now_ms();
		zmq_msg_t parts[2];
		char derr[128];
		int n = 0, more = 1, r;

		if (left <= 0) {
			rc = -ETIMEDOUT;
			break;
		}
		r = zmq_poll(&it, 1, (long)left);
		if (r < 0 && zmq_errno() != EINTR) {
			rc = -EIO; /* the context is ending */
			break;
		}
		if (r <= 0)
			continue;
		for (; more && n < 2; n++) {
			zmq_msg_init(&parts[n]);
			if (zmq_msg_recv(&parts[n], ps->s, ZMQ_DONTWAIT) < 0) {
				zmq_msg_close(&parts[n]);
				rc = -EIO;
				break;
			}
			more = zmq_msg_more(&parts[n]);
		}
		if (!rc && (n != 2 || more || zmq_msg_size(&parts[0]) ||
			    kvbp_reply_decode(zmq_msg_data(&parts[1]), zmq_msg_size(&parts[1]), &rep,
					      derr, sizeof(derr))))
			rc = -EIO;
		for (int i = 0; i < n; i++)
			zmq_msg_close(&parts[i]);
		if (!rc && rep.request_id == q.request_id)
			break;
		kvbp_reply_clear(&rep); /* not ours (cannot be, on a fresh socket): skip */
	}
	if (rc)
		return rc;
	/* over CURVE never take records in the clear; nor a cipher not offered */
	if (rep.code || !rep.bulk_port || (curve && !rep.has_bulk_key) ||
	    (rep.bulk_aead != KVBP_AEAD_AES256GCM && !(q.bulk_aeads & 1u << rep.bulk_aead)))
		goto out;
	if (rep.has_bulk_key && kvbb_aead_new(&ps->aead, rep.bulk_key, rep.bulk_aead))
		goto out;
	memcpy(ps->ticket, rep.bulk_ticket, sizeof(ps->ticket));
	ps->put = rep.bulk_put;
	ps->fd = connect_to(endpoint, rep.bulk_port, deadline);
	if (ps->fd < 0 || kvbb_hello_put(hello, ps->ticket, ps->aead) ||
	    send_iov(ps->fd, &(struct iovec){ hello, sizeof(hello) }, 1, deadline) ||
	    recv_iov(ps->fd, &(struct iovec){ &ack, 1 }, 1, deadline, 0, NULL) || ack) {
		cl_warn(c, "cluster: no bulk connection to %s (port %u): %s; its payloads in "
			"frames", endpoint, rep.bulk_port,
			ps->fd < 0 ? strerror(-ps->fd) : "refused");
		if (ps->fd >= 0)
			close(ps->fd);
		ps->fd = -1;
		kvbb_aead_free(&ps->aead);
	}
out:
	OPENSSL_cleanse(rep.bulk_key, sizeof(rep.bulk_key));
	kvbp_reply_clear(&rep);
	return 0;
}

struct psock *psock_new(struct cluster *c, const char *endpoint, const char *key)
{
	struct psock *ps = calloc(1, sizeof(*ps));
	bool curve = key[0] && c->secret[0];
	int64_t maxmsg = c->max_message > INT64_MAX / 2 ? INT64_MAX : (int64_t)c->max_message * 2;
	int zero = 0;

	if (!ps)
		return NULL;
	ps->fd = -1;
	ps->scounter = 1; /* the hello was 0 */
	ps->s = zmq_socket(c->zctx, ZMQ_DEALER);
	if (!ps->s)
		goto fail;
	zmq_setsockopt(ps->s, ZMQ_LINGER, &zero, sizeof(zero));
	/* A hard cap per frame, as on the daemon's own sockets (twice max_message): a reply
	 * frame above it drops the connection before ZeroMQ allocates it (a FETCH reply in
	 * frames is then checked against max_message itself, fetch_size_check). */
	zmq_setsockopt(ps->s, ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
	if (curve && (zmq_setsockopt(ps->s, ZMQ_CURVE_SERVERKEY, key, 40) ||
		      zmq_setsockopt(ps->s, ZMQ_CURVE_PUBLICKEY, c->public_key, 40) ||
		      zmq_setsockopt(ps->s, ZMQ_CURVE_SECRETKEY, c->secret, 40)))
		goto fail;
	if (!endpoint[0] || zmq_connect(ps->s, endpoint))
		goto fail;
	if (c->bulk && !strncmp(endpoint, "tcp://", 6)) {
		/* With hedging, the HELLO is waited for cluster_hedge_ms at most, so that a
		 * silent peer delays a fetch on a new socket by that, not by
		 * cluster_timeout_ms (test_cluster_hedge). Unanswered by then, the socket
		 * goes on in frames for this one call (its reply to the HELLO, when it
		 * comes, is skipped as a late one), and is closed after it. Without
		 * hedging, the peer did not answer within the call's own deadline, and
		 * neither would the call. */
		int64_t wait = c->hedge_ms;
		bool hedged = c->hedge_ms > 0 && wait < c->timeout_ms;
		int rc = psock_bulk(c, ps, endpoint, curve,
				    now_ms() + (hedged ? wait : c->timeout_ms));

		if (rc && !hedged)
			goto fail;
		ps->spoilt = rc != 0;
	}
	return ps;
fail:
	psock_free(ps);
	return NULL;
}

int fetch_size_check(const struct cluster *c, const struct store_model *m,
		     uint32_t num_tokens, uint64_t stored, char *why, size_t why_len)
{
	uint64_t tb = store_tensor_bytes(m, num_tokens), raw, bound;

	if (!num_tokens) {
		snprintf(why, why_len, "a chunk of 0 tokens");
		return -EPROTO;
	}
	/* as a REPLICATE's (the daemon's chunk_bytes): K and V of every layer, raw */
	if (!tb || ckd_mul3(&raw, tb, 2ull, m->desc.num_layers)) {
		snprintf(why, why_len, "a chunk of %u tokens, whose size overflows; refused, "
			 "nothing allocated", num_tokens);
		return -EMSGSIZE;
	}
	if (raw > c->max_message) {
		snprintf(why, why_len, "a chunk of %u tokens (%llu bytes) is above max_message "
			 "%llu; refused, nothing allocated", num_tokens, (unsigned long long)raw,
			 (unsigned long long)c->max_message);
		return -EMSGSIZE;
	}
	if (kvbb_stored_max(raw, m->desc.num_layers, &bound) || stored > bound || stored == 0) {
		snprintf(why, why_len, "%llu stored bytes for a chunk of %u tokens (%llu bytes)",
			 (unsigned long long)stored, num_tokens, (unsigned long long)raw);
		return -EPROTO;
	}
	return 0;
}

/*
 * The parts of a FETCH reply's payload on ps's bulk connection: the reply must name
 * one part per layer of m, adding up to its bulk_bytes, for a chunk within
 * fetch_size_check's bounds. 0, or -EMSGSIZE / -EPROTO with why.
 */
static int check_parts(const struct cluster *c, const struct store_model *m,
		       const struct kvbp_reply *rep, char *why, size_t why_len)
{
	uint64_t sum = 0;

	if (rep->n_bulk_parts != m->desc.num_layers || rep->n_chunks != 1) {
		snprintf(why, why_len, "%zu parts for a %u-layer model", rep->n_bulk_parts,
			 m->desc.num_layers);
		return -EPROTO;
	}
	for (size_t i = 0; i < rep->n_bulk_parts; i++)
		if (ckd_add(&sum, sum, rep->bulk_parts[i])) {
			snprintf(why, why_len, "parts that overflow");
			return -EPROTO;
		}
	if (sum != rep->bulk_bytes) {
		snprintf(why, why_len, "%llu bytes in parts adding up to %llu",
			 (unsigned long long)rep->bulk_bytes, (unsigned long long)sum);
		return -EPROTO;
	}
	return fetch_size_check(c, m, rep->chunks[0].num_tokens, sum, why, why_len);
}

int psock_fetch_payload(struct cluster *c, struct psock *ps, const struct store_model *m,
			struct call_out *o, int64_t deadline, int64_t stall_ms, char *why,
			size_t why_len)
{
	uint8_t hdr[KVBB_HDR_LEN], tag[KVBB_TAG_LEN];
	uint64_t got = 0;
	int64_t moved = now_ms(); /* the last byte, for stall_ms: the reply counts as one */
	bool last = false;
	int rc;

	if (ps->fd < 0) {
		snprintf(why, why_len, "a bulk payload on a socket without a bulk connection");
		return -EPROTO;
	}
	if ((rc = check_parts(c, m, &o->rep, why, why_len)))
		return rc;
	o->bulk = malloc(o->rep.bulk_bytes);
	if (!o->bulk) {
		snprintf(why, why_len, "out of memory for %llu bytes",
			 (unsigned long long)o->rep.bulk_bytes);
		return -ENOMEM;
	}
	while (!last) {
		struct kvbb_hdr h;
		struct iovec v[2];

		if ((rc = recv_iov(ps->fd, &(struct iovec){ hdr, sizeof(hdr) }, 1, deadline,
				   stall_ms, &moved)))
			break;
		/* every size checked before a byte lands */
		if (kvbb_hdr_get(hdr, &h) || h.request_id != o->rep.request_id || h.offset != got ||
		    h.total != o->rep.bulk_bytes || h.len > h.total - h.offset ||
		    h.len > KVBB_RECORD_MAX || !h.len || (h.flags & KVBB_ABORT) ||
		    ((h.flags & KVBB_LAST) != 0) != (h.offset + h.len == h.total)) {
			snprintf(why, why_len, "record at byte %llu of %llu malformed, out of order "
				 "or aborted", (unsigned long long)h.offset,
				 (unsigned long long)o->rep.bulk_bytes);
			return -EPROTO;
		}
		v[0] = (struct iovec){ o->bulk + h.offset, h.len };
		v[1] = (struct iovec){ tag, ps->aead ? sizeof(tag) : 0 };
		if ((rc = recv_iov(ps->fd, v, 2, deadline, stall_ms, &moved)))
			break;
		if (ps->aead && kvbb_open(ps->aead, ps->rcounter, KVBB_DIR_RECORDS, hdr, sizeof(hdr),
					  o->bulk + h.offset, h.len, tag)) {
			snprintf(why, why_len, "record %llu (bytes %llu..%llu) failed its %s check: "
				 "altered on the wire", (unsigned long long)ps->rcounter,
				 (unsigned long long)h.offset,
				 (unsigned long long)(h.offset + h.len), kvbb_aead_name(ps->aead));
			return -EBADMSG;
		}
		ps->rcounter++;
		got += h.len;
		last = h.flags & KVBB_LAST;
	}
	if (rc == -ETIME)
		snprintf(why, why_len, "the payload stalled: no byte for %lld ms after %llu of "
			 "%llu bytes", (long long)stall_ms, (unsigned long long)got,
			 (unsigned long long)o->rep.bulk_bytes);
	else if (rc)
		snprintf(why, why_len, "the bulk connection %s after %llu of %llu bytes",
			 rc == -ETIMEDOUT ? "timed out" : "closed", (unsigned long long)got,
			 (unsigned long long)o->rep.bulk_bytes);
	return rc;
}

int psock_send_payload(struct psock *ps, uint64_t request_id, const void *const *blobs,
		       const size_t *lens, size_t n, int64_t deadline)
{
	size_t rec = ps->aead ? KVBB_SEAL_BYTES : KVBB_RECORD_MAX, b = 0, boff = 0;
	uint64_t total = 0, off = 0;
	struct iovec *v = calloc(n + 3, sizeof(*v));
	uint8_t *bounce = ps->aead ? malloc(KVBB_SEAL_BYTES) : NULL;
	int rc = 0;

	for (size_t i = 0; i < n; i++)
		total += lens[i];
	if (!v || (ps->aead && !bounce)) {
		rc = -ENOMEM;
		goto out;
	}
	do {
		size_t len = total - off < rec ? (size_t)(total - off) : rec, got = 0;
		struct kvbb_hdr h = { off + len == total ? KVBB_LAST : 0, request_id, total, off,
				      (uint32_t)len };
		uint8_t hdr[KVBB_HDR_LEN], tag[KVBB_TAG_LEN];
		int nv = 1;

		/* the record's bytes: the rest of blob b from boff, then whole blobs, then
		 * the start of the one it ends in */
		while (got < len) {
			size_t take = lens[b] - boff < len - got ? lens[b] - boff : len - got;

			v[nv++] = (struct iovec){ (uint8_t *)blobs[b] + boff, take };
			got += take;
			boff += take;
			if (boff == lens[b]) {
				b++;
				boff = 0;
			}
		}
		kvbb_hdr_put(hdr, &h);
		v[0] = (struct iovec){ hdr, sizeof(hdr) };
		if (ps->aead) {
			if (kvbb_seal(ps->aead, ps->scounter, KVBB_DIR_PUT, hdr, sizeof(hdr), v + 1,
				      (size_t)nv - 1, bounce, tag)) {
				rc = -EIO;
				break;
			}
			v[1] = (struct iovec){ bounce, len };
			v[2] = (struct iovec){ tag, sizeof(tag) };
			nv = 3;
		}
		ps->scounter++;
		if ((rc = send_iov(ps->fd, v, nv, deadline)))
			break;
		off += len;
		while (b < n && boff == 0 && lens[b] == 0)
			b++; /* empty blobs carry nothing */
	} while (off < total);
out:
	free(v);
	free(bounce);
	return rc;
}
