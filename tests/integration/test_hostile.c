/*
 * Hostile clients against the real kvblendd: each case reproduces a defect an
 * adversarial review found (issue 7) and checks that the daemon holds and keeps
 * serving. Requests are sent with raw ZeroMQ sockets where the client library
 * would never send them, so that the daemon sees what an attacker sends.
 */
#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include <zmq.h>

#include "harness.h"
#include "wire.h"

/* ---- raw requests ---- */

struct raw {
	void *ctx;
	void *sock;
};

static void raw_open(struct raw *r, const char *endpoint)
{
	int zero = 0, timeout = 20000;

	r->ctx = zmq_ctx_new();
	r->sock = zmq_socket(r->ctx, ZMQ_DEALER);
	zmq_setsockopt(r->sock, ZMQ_LINGER, &zero, sizeof(zero));
	zmq_setsockopt(r->sock, ZMQ_RCVTIMEO, &timeout, sizeof(timeout));
	assert_int_equal(zmq_connect(r->sock, endpoint), 0);
}

static void raw_close(struct raw *r)
{
	zmq_close(r->sock);
	zmq_ctx_term(r->ctx);
}

/* Send req with the empty delimiter, then n payload frames; does not wait. */
static void raw_send(struct raw *r, struct kvbp_request *req, const void *const *payload,
		     const size_t *lens, size_t n)
{
	uint8_t *hdr;
	size_t hlen;

	req->version = KVBP_VERSION;
	req->payload_frames = (uint32_t)n;
	assert_int_equal(kvbp_request_encode(req, &hdr, &hlen), 0);
	assert_int_equal(zmq_send(r->sock, "", 0, ZMQ_SNDMORE), 0);
	assert_true(zmq_send(r->sock, hdr, hlen, n ? ZMQ_SNDMORE : 0) >= 0);
	for (size_t i = 0; i < n; i++)
		assert_true(zmq_send(r->sock, payload[i], lens[i], i + 1 < n ? ZMQ_SNDMORE : 0) >= 0);
	free(hdr);
}

/* Receive one reply into *rep (cleared by the caller); payload frames are dropped. */
static uint32_t raw_recv(struct raw *r, struct kvbp_reply *rep)
{
	char err[256];
	zmq_msg_t m;
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
	}
	zmq_msg_close(&m);
	return rep->code;
}

static uint32_t raw_call(struct raw *r, struct kvbp_request *req, const void *const *payload,
			 const size_t *lens, size_t n, struct kvbp_reply *rep)
{
	raw_send(r, req, payload, lens, n);
	return raw_recv(r, rep);
}

/* ---- a model and a few chunks ---- */

#define L 4
#define H 8
#define D 64
#define ROW (H * D * 2)
#define T 32

static const struct kvb_model model = { .name = "hm", .num_layers = L, .num_kv_heads = H,
					.head_dim = D, .dtype = KVB_F16, .rope_theta = 10000 };

static void fill(uint16_t *p, size_t n, uint32_t seed)
{
	uint32_t x = seed * 2654435761u + 7;

	for (size_t i = 0; i < n; i++) {
		x = x * 1103515245u + 12345u;
		p[i] = (uint16_t)((x >> 31) << 15 | (13 + (x >> 28 & 3)) << 10 | (x >> 8 & 0x3ff));
	}
}

static void put_chunk(kvb_client *c, uint32_t id, uint8_t hash[KVB_HASH_LEN])
{
	size_t n = (size_t)L * 2 * T * H * D;
	uint16_t *kv = malloc(n * 2);
	uint32_t ids[2] = { 4242, id };

	fill(kv, n, id);
	kvb_chunk_hash(ids, 2, hash);
	assert_int_equal(kvb_put(c, model.name, hash, KVB_F16, T, 0, kv, n * 2, NULL), 0);
	free(kv);
}

static void fuse_open_req(struct kvbp_request *q, const uint8_t *hash, struct kvbp_segment *seg,
			  uint32_t *check, double *ratio)
{
	memset(q, 0, sizeof(*q));
	memset(seg, 0, sizeof(*seg));
	q->op = KVBP_OP_FUSE_OPEN;
	snprintf(q->model_name, sizeof(q->model_name), "%s", model.name);
	memcpy(seg->hash, hash, KVBP_HASH_LEN);
	q->segments = seg;
	q->n_segments = 1;
	*check = 1;
	*ratio = 0.25;
	q->check_layers = check;
	q->n_checks = 1;
	q->ratios = ratio;
	q->n_ratios = 1;
}

/* The daemon still answers a plain request. */
static void assert_serving(const struct daemon *d)
{
	kvb_client *c = daemon_client(d, 1);

	assert_int_equal(kvb_ping(c, NULL, 0), 0);
	kvb_close(&c);
}

/*
 * Defect 1: FUSE_CLOSE while a layer request of the same session runs on another
 * worker. The close must not read the session after the other holder frees it
 * (ASan in the daemon turns a use-after-free into a non-zero exit at stop).
 */
static void close_during_layer(void **state)
{
	struct daemon d;
	const char *args[] = { "--workers", "4", NULL };
	uint8_t hash[KVB_HASH_LEN];
	struct raw a, b;
	kvb_client *c;
	size_t bytes = (size_t)T * ROW;
	uint8_t *k = calloc(1, bytes), *v = calloc(1, bytes);
	const void *pl[2] = { k, v };
	size_t lens[2] = { bytes, bytes };
	unsigned closed_first = 0;

	(void)state;
	daemon_start(&d, args);
	c = daemon_client(&d, 1);
	assert_int_equal(kvb_model_register(c, &model, NULL), 0);
	put_chunk(c, 1, hash);
	raw_open(&a, d.endpoint);
	raw_open(&b, d.endpoint);
	for (int i = 0; i < 3000; i++) {
		struct kvbp_request q;
		struct kvbp_reply rep = { 0 };
		struct kvbp_segment seg;
		uint32_t check;
		double ratio;
		uint64_t id;

		fuse_open_req(&q, hash, &seg, &check, &ratio);
		assert_int_equal(raw_call(&a, &q, NULL, NULL, 0, &rep), KVBP_OK);
		id = rep.session_id;
		kvbp_reply_clear(&rep);
		memset(&q, 0, sizeof(q));
		q.op = KVBP_OP_FUSE_LAYER;
		q.session_id = id;
		q.layer = 1;
		q.rows = T;
		raw_send(&a, &q, pl, lens, 2);
		memset(&q, 0, sizeof(q));
		q.op = KVBP_OP_FUSE_CLOSE;
		q.session_id = id;
		assert_int_equal(raw_call(&b, &q, NULL, NULL, 0, &rep), KVBP_OK);
		kvbp_reply_clear(&rep);
		/* The layer either ran before the close or found the session gone. */
		rep = (struct kvbp_reply){ 0 };
		closed_first += raw_recv(&a, &rep) == KVBP_UNKNOWN_SESSION;
		kvbp_reply_clear(&rep);
	}
	print_message("%u of 3000 layer requests arrived after the close\n", closed_first);
	raw_close(&a);
	raw_close(&b);
	assert_serving(&d);
	kvb_close(&c);
	daemon_stop(&d);
	daemon_cleanup(&d);
	free(k);
	free(v);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(close_during_layer),
	};

	signal(SIGPIPE, SIG_IGN);
	return cmocka_run_group_tests(tests, NULL, NULL);
}
