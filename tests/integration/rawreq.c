/* rawreq — raw protocol requests for the integration tests; see rawreq.h. */
#include "tests/integration/rawreq.h"

#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>

#include <cmocka.h>

void raw_open_curve(struct raw *r, const char *endpoint, int recv_timeout_ms,
		    const char *server_key, const char *client_secret)
{
	int zero = 0;

	r->ctx = zmq_ctx_new();
	r->sock = zmq_socket(r->ctx, ZMQ_DEALER);
	zmq_setsockopt(r->sock, ZMQ_LINGER, &zero, sizeof(zero));
	zmq_setsockopt(r->sock, ZMQ_RCVTIMEO, &recv_timeout_ms, sizeof(recv_timeout_ms));
	if (server_key) {
		char pub[41];

		assert_int_equal(zmq_curve_public(pub, client_secret), 0);
		zmq_setsockopt(r->sock, ZMQ_CURVE_SERVERKEY, server_key, 40);
		zmq_setsockopt(r->sock, ZMQ_CURVE_PUBLICKEY, pub, 40);
		zmq_setsockopt(r->sock, ZMQ_CURVE_SECRETKEY, client_secret, 40);
	}
	assert_int_equal(zmq_connect(r->sock, endpoint), 0);
}

void raw_open(struct raw *r, const char *endpoint, int recv_timeout_ms)
{
	raw_open_curve(r, endpoint, recv_timeout_ms, NULL, NULL);
}

void raw_fuse_open_request(struct kvbp_request *q, const char *model,
			   struct kvbp_segment *segments, size_t n_segments, uint32_t *checks,
			   double *ratios, size_t n_checks)
{
	*q = (struct kvbp_request){ .op = KVBP_OP_FUSE_OPEN, .segments = segments,
				    .n_segments = n_segments, .check_layers = checks,
				    .n_checks = n_checks, .ratios = ratios, .n_ratios = n_checks };
	snprintf(q->model_name, sizeof(q->model_name), "%s", model);
}

void raw_close(struct raw *r)
{
	zmq_close(r->sock);
	zmq_ctx_term(r->ctx);
}

/* Send frames[0..n), each but the last with more to come. */
static void send_parts(struct raw *r, const void *const *frames, const size_t *lens, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		int flags = i + 1 < n ? ZMQ_SNDMORE : 0;

		assert_true(zmq_send(r->sock, frames[i], lens[i], flags) >= 0);
	}
}

void raw_send_frames(struct raw *r, const void *const *frames, const size_t *lens, size_t n)
{
	assert_int_equal(zmq_send(r->sock, "", 0, n ? ZMQ_SNDMORE : 0), 0);
	send_parts(r, frames, lens, n);
}

void raw_send_as_is(struct raw *r, const struct kvbp_request *req, const void *const *payload,
		    const size_t *lens, size_t n)
{
	uint8_t *hdr;
	size_t hlen;

	assert_int_equal(kvbp_request_encode(req, &hdr, &hlen), 0);
	assert_int_equal(zmq_send(r->sock, "", 0, ZMQ_SNDMORE), 0);
	assert_true(zmq_send(r->sock, hdr, hlen, n ? ZMQ_SNDMORE : 0) >= 0);
	free(hdr);
	send_parts(r, payload, lens, n);
}

void raw_send(struct raw *r, struct kvbp_request *req, const void *const *payload,
	      const size_t *lens, size_t n)
{
	req->version = KVBP_VERSION;
	req->payload_frames = (uint32_t)n;
	raw_send_as_is(r, req, payload, lens, n);
}

void raw_frame_sized(size_t index, const void *data, size_t size, void *arg)
{
	(void)index;
	(void)data;
	assert_int_equal(size, *(const size_t *)arg);
}

uint32_t raw_recv_frames(struct raw *r, struct kvbp_reply *rep, size_t *n_payload,
			 raw_frame_fn *each_frame, void *arg)
{
	char err[256];
	zmq_msg_t m;
	size_t n = 0;
	int more;

	zmq_msg_init(&m);
	assert_true(zmq_msg_recv(&m, r->sock, 0) >= 0); /* delimiter */
	assert_int_equal(zmq_msg_size(&m), 0);
	assert_true(zmq_msg_recv(&m, r->sock, 0) >= 0);
	more = zmq_msg_more(&m);
	assert_int_equal(kvbp_reply_decode(zmq_msg_data(&m), zmq_msg_size(&m), rep, err,
					   sizeof(err)), 0);
	while (more) {
		assert_true(zmq_msg_recv(&m, r->sock, 0) >= 0);
		more = zmq_msg_more(&m);
		if (each_frame)
			each_frame(n, zmq_msg_data(&m), zmq_msg_size(&m), arg);
		n++;
	}
	zmq_msg_close(&m);
	if (n_payload)
		*n_payload = n;
	return rep->code;
}

uint32_t raw_recv(struct raw *r, struct kvbp_reply *rep)
{
	return raw_recv_frames(r, rep, NULL, NULL, NULL);
}

uint32_t raw_recv_msg(struct raw *r, char *msg, size_t len)
{
	struct kvbp_reply rep;
	uint32_t code = raw_recv(r, &rep);

	snprintf(msg, len, "%s", rep.message);
	kvbp_reply_clear(&rep);
	return code;
}

uint32_t raw_call(struct raw *r, struct kvbp_request *req, const void *const *payload,
		  const size_t *lens, size_t n, struct kvbp_reply *rep)
{
	raw_send(r, req, payload, lens, n);
	return raw_recv(r, rep);
}

uint32_t raw_call_msg(struct raw *r, struct kvbp_request *req, const void *const *payload,
		      const size_t *lens, size_t n, char *msg, size_t len)
{
	raw_send(r, req, payload, lens, n);
	return raw_recv_msg(r, msg, len);
}

size_t raw_recv_all(struct raw *r, zmq_msg_t *frames, size_t cap)
{
	size_t n = 0;
	int more = 1;

	while (more && n < cap) {
		zmq_msg_init(&frames[n]);
		assert_true(zmq_msg_recv(&frames[n], r->sock, 0) >= 0);
		more = zmq_msg_more(&frames[n++]);
	}
	assert_false(more);
	return n;
}
