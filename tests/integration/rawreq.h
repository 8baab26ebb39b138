/*
 * rawreq — raw protocol requests for the integration tests: a ZeroMQ DEALER
 * socket to a real kvblendd, requests encoded and sent frame by frame as the test
 * gives them (so that the daemon sees what libkvblend would never send), replies
 * received and decoded. Every function fails the running cmocka test on a send,
 * receive (timeout included) or decode error: the tests check codes and messages.
 */
#ifndef KVBLEND_TESTS_RAWREQ_H
#define KVBLEND_TESTS_RAWREQ_H

#include <stddef.h>
#include <stdint.h>

#include <zmq.h>

#include "proto/wire.h"

/* A DEALER socket and its own context (so that a forked child opens its own). */
struct raw {
	void *ctx;
	void *sock;
};

/* Connect r to endpoint: no linger, receives time out after recv_timeout_ms. */
void raw_open(struct raw *r, const char *endpoint, int recv_timeout_ms);
/* raw_open() over CURVE: the server's public key, this client's secret key (Z85). */
void raw_open_curve(struct raw *r, const char *endpoint, int recv_timeout_ms,
		    const char *server_key, const char *client_secret);
/* Close the socket and terminate its context. */
void raw_close(struct raw *r);

/*
 * A FUSE_OPEN request (q cleared first) of model over the n_segments segments, with
 * n_checks check layers and their ratios: the arrays borrowed by q, the caller's.
 */
void raw_fuse_open_request(struct kvbp_request *q, const char *model,
			   struct kvbp_segment *segments, size_t n_segments, uint32_t *checks,
			   double *ratios, size_t n_checks);

/* Send the empty delimiter, then frames[0..n) exactly as given (n = 0: the delimiter alone). */
void raw_send_frames(struct raw *r, const void *const *frames, const size_t *lens, size_t n);
/*
 * Encode req as it is (its version and payload_frames too, right or wrong) and send
 * it after the delimiter, followed by n payload frames; does not wait for the reply.
 */
void raw_send_as_is(struct raw *r, const struct kvbp_request *req, const void *const *payload,
		    const size_t *lens, size_t n);
/* raw_send_as_is() with req->version = KVBP_VERSION and req->payload_frames = n set first. */
void raw_send(struct raw *r, struct kvbp_request *req, const void *const *payload,
	      const size_t *lens, size_t n);

/* Called for each payload frame of a reply, index from 0; data is valid for the call only. */
typedef void raw_frame_fn(size_t index, const void *data, size_t size, void *arg);
/* A raw_frame_fn that asserts every frame is *(const size_t *)arg bytes. */
void raw_frame_sized(size_t index, const void *data, size_t size, void *arg);

/*
 * Receive one reply: the delimiter (asserted empty), the header decoded into *rep
 * (the caller owns it: kvbp_reply_clear()), then its payload frames, each handed to
 * each_frame (if not NULL) and dropped. *n_payload (if not NULL) gets their count.
 * Returns rep->code.
 */
uint32_t raw_recv_frames(struct raw *r, struct kvbp_reply *rep, size_t *n_payload,
			 raw_frame_fn *each_frame, void *arg);
/* raw_recv_frames() without a look at the payload frames. */
uint32_t raw_recv(struct raw *r, struct kvbp_reply *rep);
/* Receive one reply, copy its message into msg (truncated to len), clear it; its code. */
uint32_t raw_recv_msg(struct raw *r, char *msg, size_t len);

/* raw_send() then raw_recv(): the reply's code, the reply in *rep (caller clears). */
uint32_t raw_call(struct raw *r, struct kvbp_request *req, const void *const *payload,
		  const size_t *lens, size_t n, struct kvbp_reply *rep);
/* raw_send() then raw_recv_msg(): the reply's code and message. */
uint32_t raw_call_msg(struct raw *r, struct kvbp_request *req, const void *const *payload,
		      const size_t *lens, size_t n, char *msg, size_t len);

/*
 * Receive one whole message, whatever its frames: frames[0..count) initialised, the
 * caller closes each (zmq_msg_close). Asserts that it fits in cap frames.
 */
size_t raw_recv_all(struct raw *r, zmq_msg_t *frames, size_t cap);

#endif
