/*
 * call — one request to kvblendd and its reply over the client's DEALER socket:
 * encode, send (payload frames zero-copy from the caller's memory), wait with the
 * connection's timeout, match the reply to the request, decode. See client_impl.h.
 */
#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client/client_impl.h"

_Static_assert(KVB_E_BUSY == -1000 - KVBP_BUSY, "client codes drifted from the wire");

int kvbc_set_err(kvb_client *c, int rc, const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(c->err, sizeof(c->err), fmt, ap);
	va_end(ap);
	c->err_code = rc;
	return rc;
}


int kvbc_open_socket(kvb_client *c)
{
	int zero = 0;

	c->sock = zmq_socket(c->ctx, ZMQ_DEALER);
	if (!c->sock)
		return -errno;
	zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof(zero));
	if (c->curve && (zmq_setsockopt(c->sock, ZMQ_CURVE_SERVERKEY, c->server_key, 41) ||
			 zmq_setsockopt(c->sock, ZMQ_CURVE_PUBLICKEY, c->public_key, 41) ||
			 zmq_setsockopt(c->sock, ZMQ_CURVE_SECRETKEY, c->secret_key, 41))) {
		int e = errno;

		zmq_close(c->sock);
		c->sock = NULL;
		return -e;
	}
	if (zmq_connect(c->sock, c->endpoint)) {
		int e = errno;

		zmq_close(c->sock);
		c->sock = NULL;
		return -e;
	}
	return 0;
}

static void payload_sent(void *data, void *hint)
{
	(void)data;
	atomic_fetch_sub(&((kvb_client *)hint)->in_flight, 1);
}

/* Wait until ZeroMQ has let go of every zero-copy payload, so the caller may reuse it. */
void kvbc_wait_payloads(kvb_client *c)
{
	for (int i = 0; atomic_load(&c->in_flight) > 0 && i < 100000; i++) {
		struct timespec ts = { 0, 100000 };

		nanosleep(&ts, NULL);
	}
}

/* After a timeout: drop the socket so a late reply cannot answer the next request. */
static void reset_socket(kvb_client *c)
{
	if (c->sock)
		zmq_close(c->sock);
	c->sock = NULL;
	kvbc_bulk_close(c); /* its stream may hold a late payload too */
	kvbc_wait_payloads(c);
	kvbc_open_socket(c);
}

void kvbc_call_done(struct call *k)
{
	for (size_t i = 0; i < k->n_frames; i++)
		zmq_msg_close(&k->frames[i]);
	free(k->frames);
	k->frames = NULL;
	k->n_frames = 0;
	kvbp_reply_clear(&k->rep);
	kvbp_request_clear(&k->req);
}

static int recv_reply(kvb_client *c, struct call *k, int64_t deadline_ms)
{
	for (;;) {
		zmq_msg_t parts[3];
		size_t np = 0, cap = 0;
		struct timespec now;
		int64_t left;
		zmq_pollitem_t its[2] = { { c->sock, 0, ZMQ_POLLIN, 0 },
					  { NULL, c->bulk_fd, ZMQ_POLLIN, 0 } }, *it = its;
		int more = 1, rc, n_its = k->bulk && c->bulk_fd >= 0 && !k->bulk_last ? 2 : 1;
		char derr[256];

		clock_gettime(CLOCK_MONOTONIC, &now);
		left = deadline_ms - (now.tv_sec * 1000 + now.tv_nsec / 1000000);
		if (left <= 0)
			return -ETIMEDOUT;
		if (k->while_waiting) {
			/* Work alongside the daemon: poll without blocking, do what is ready. */
			rc = zmq_poll(its, 1, 0);
			if (rc == 0) {
				if (!k->while_waiting(k->waiting_ctx)) {
					struct timespec ts = { 0, 20000 };

					nanosleep(&ts, NULL);
				}
				continue;
			}
		} else {
			rc = zmq_poll(its, n_its, (long)left);
		}
		if (rc < 0 && errno == EINTR)
			continue;
		if (rc < 0)
			return -EIO;
		if (rc == 0)
			return -ETIMEDOUT;
		if (n_its == 2 && (its[1].revents & (ZMQ_POLLIN | ZMQ_POLLERR))) {
			/* records before the reply is read: take them as they arrive, one after
			 * the other (each receive bounded by the timeout) up to the last or the
			 * deadline, without a poll of the ZeroMQ socket for each */
			do {
				rc = kvbc_bulk_record(c, k);
				clock_gettime(CLOCK_MONOTONIC, &now);
			} while (!rc && !k->bulk_last && c->bulk_fd >= 0 &&
				 now.tv_sec * 1000 + now.tv_nsec / 1000000 < deadline_ms);
			if (rc < 0)
				return rc;
			if (!(its[0].revents & ZMQ_POLLIN))
				continue;
		}
		(void)it;
		/* delimiter, header, then payload frames */
		for (; more && np < 2; np++) {
			zmq_msg_init(&parts[np]);
			if (zmq_msg_recv(&parts[np], c->sock, 0) < 0)
				return -EIO;
			more = zmq_msg_more(&parts[np]);
		}
		if (k->sink && more) {
			/* the header first, so that a late reply to an earlier request never
			 * touches the caller's buffer */
			struct kvbp_reply rep;
			bool ours = np == 2 && zmq_msg_size(&parts[0]) == 0 &&
				    !kvbp_reply_decode(zmq_msg_data(&parts[1]),
						       zmq_msg_size(&parts[1]), &rep, derr,
						       sizeof(derr));

			if (ours) {
				ours = rep.request_id == k->req.request_id;
				kvbp_reply_clear(&rep);
			}
			k->sink_got = 0;
			while (more) {
				zmq_msg_t f;
				size_t n;

				zmq_msg_init(&f);
				if (zmq_msg_recv(&f, c->sock, 0) < 0) {
					zmq_msg_close(&f);
					for (size_t i = 0; i < np; i++)
						zmq_msg_close(&parts[i]);
					return -EIO;
				}
				n = zmq_msg_size(&f);
				if (ours && k->sink_got <= k->sink_len &&
				    n <= k->sink_len - k->sink_got)
					memcpy(k->sink + k->sink_got, zmq_msg_data(&f), n);
				k->sink_got += n;
				more = zmq_msg_more(&f);
				zmq_msg_close(&f);
			}
		}
		while (more) {
			if (k->n_frames == cap) {
				size_t ncap = cap ? 2 * cap : 16;
				zmq_msg_t *p = realloc(k->frames, ncap * sizeof(*p));

				if (!p)
					return -ENOMEM;
				k->frames = p;
				cap = ncap;
			}
			zmq_msg_init(&k->frames[k->n_frames]);
			if (zmq_msg_recv(&k->frames[k->n_frames], c->sock, 0) < 0)
				return -EIO;
			more = zmq_msg_more(&k->frames[k->n_frames++]);
		}
		rc = np == 2 && zmq_msg_size(&parts[0]) == 0
			     ? kvbp_reply_decode(zmq_msg_data(&parts[1]), zmq_msg_size(&parts[1]),
						 &k->rep, derr, sizeof(derr))
			     : KVBP_BAD_REQUEST;
		for (size_t i = 0; i < np; i++)
			zmq_msg_close(&parts[i]);
		if (rc)
			return kvbc_set_err(c, KVB_E_PROTOCOL, "unreadable reply from %s",
					    c->endpoint);
		if (k->rep.request_id == k->req.request_id)
			return 0;
		/* A late reply to an earlier request: drop it, keep waiting. */
		kvbp_reply_clear(&k->rep);
		for (size_t i = 0; i < k->n_frames; i++)
			zmq_msg_close(&k->frames[i]);
		k->n_frames = 0;
	}
}

/*
 * After the reply of a call whose payload may come on the bulk connection: the records
 * still on their way, then the count checked against the reply's. A reply that failed
 * with the stream part-sent (the daemon closed its end) closes ours.
 */
static int bulk_rest(kvb_client *c, struct call *k)
{
	int rc = 0;

	if (k->rep.code) {
		if (k->bulk_got || k->rep.code == KVBP_INTERNAL)
			kvbc_bulk_close(c);
		return 0;
	}
	if (!k->rep.bulk_bytes) {
		if (k->bulk_got) {
			kvbc_bulk_close(c);
			return kvbc_set_err(c, KVB_E_PROTOCOL, "bulk records came for a reply "
					    "that has its payload in frames");
		}
		return 0; /* the daemon sent frames (it no longer knew the ticket) */
	}
	while (!rc && !k->bulk_last && c->bulk_fd >= 0)
		rc = kvbc_bulk_record(c, k);
	if (rc < 0)
		return rc;
	if (k->bulk_abort)
		return kvbc_set_err(c, KVB_E_CORRUPT, "chunk failed its checksum on kvblendd at %s "
				    "as it was sent, and was removed there; treat it as a miss",
				    c->endpoint);
	if (!k->bulk_last || k->bulk_got != k->rep.bulk_bytes) {
		kvbc_bulk_close(c);
		return kvbc_set_err(c, KVB_E_PROTOCOL, "the reply says %llu payload bytes; the "
				    "bulk connection brought %zu",
				    (unsigned long long)k->rep.bulk_bytes, k->bulk_got);
	}
	k->sink_got = k->bulk_got;
	return 0;
}

/* Send k->req with its payload and wait for the matching reply. */
int kvbc_call(kvb_client *c, struct call *k)
{
	struct timespec now;
	uint8_t *hdr = NULL;
	size_t len;
	int rc;

	c->err[0] = 0;
	c->err_code = 0;
	if (!c->sock && kvbc_open_socket(c))
		return kvbc_set_err(c, -EIO, "cannot open a socket to %s", c->endpoint);
	if (!k->req.version) /* else a call that needs a daemon to understand it whole */
		k->req.version = KVBP_VERSION;
	k->req.request_id = ++c->next_id;
	k->req.payload_frames = (uint32_t)k->n_payload;
	if (kvbp_request_encode(&k->req, &hdr, &len))
		return kvbc_set_err(c, -ENOMEM, "out of memory encoding a request");
	rc = zmq_send(c->sock, "", 0, ZMQ_SNDMORE) < 0 ||
	     zmq_send(c->sock, hdr, len, k->n_payload ? ZMQ_SNDMORE : 0) < 0;
	free(hdr);
	for (size_t i = 0; !rc && i < k->n_payload; i++) {
		zmq_msg_t m;

		if (k->payload_len[i] == 0) {
			zmq_msg_init(&m);
		} else {
			atomic_fetch_add(&c->in_flight, 1);
			zmq_msg_init_data(&m, (void *)k->payload[i], k->payload_len[i], payload_sent,
					  c);
		}
		if (zmq_msg_send(&m, c->sock, i + 1 < k->n_payload ? ZMQ_SNDMORE : 0) < 0) {
			zmq_msg_close(&m);
			rc = 1;
		}
	}
	if (rc) {
		reset_socket(c);
		return kvbc_set_err(c, -EIO, "cannot send to %s: %s", c->endpoint,
				    zmq_strerror(zmq_errno()));
	}
	/* a PUT's payload on the bulk connection: if that fails, the daemon's reply (an
	 * error: it stores nothing it has not wholly received) still follows */
	if (k->bulk_out)
		k->bulk_out_rc = kvbc_bulk_send(c, k);
	clock_gettime(CLOCK_MONOTONIC, &now);
	rc = recv_reply(c, k, now.tv_sec * 1000 + now.tv_nsec / 1000000 + c->timeout_ms);
	if (rc == -ETIMEDOUT) {
		reset_socket(c);
		return kvbc_set_err(c, rc, "no reply from kvblendd at %s within %d ms", c->endpoint,
				    c->timeout_ms);
	}
	kvbc_wait_payloads(c);
	if (rc)
		return c->err[0] ? rc : kvbc_set_err(c, rc, "receive from %s failed", c->endpoint);
	if (k->bulk)
		rc = bulk_rest(c, k);
	if (rc)
		return rc;
	if (k->rep.code)
		return kvbc_set_err(c, -1000 - (int)k->rep.code, "%s", k->rep.message);
	if (k->bulk_out_rc) /* (a daemon never stores a payload it did not wholly receive) */
		return kvbc_set_err(c, KVB_E_PROTOCOL, "the daemon stored a PUT whose bulk payload "
				    "failed to send");
	return 0;
}


int kvbc_set_name(kvb_client *c, struct call *k, const char *model)
{
	if (!model || !*model || strlen(model) > KVB_NAME_MAX)
		return kvbc_set_err(c, -EINVAL, "model name must be 1..%d bytes", KVB_NAME_MAX);
	snprintf(k->req.model_name, sizeof(k->req.model_name), "%s", model);
	return 0;
}

void kvbc_call_quiet(kvb_client *c, struct call *k)
{
	char keep[sizeof(c->err)];
	int keep_code = c->err_code;

	memcpy(keep, c->err, sizeof(keep));
	kvbc_call(c, k);
	kvbc_call_done(k);
	memcpy(c->err, keep, sizeof(keep));
	c->err_code = keep_code;
}
