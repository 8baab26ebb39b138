/*
 * Unit tests of cluster/bulk.c's end of a FETCH (issue 55): the payload a member's
 * reply announces, read from a socket pair standing for the bulk connection. A reply
 * may claim any size (up to 2^32-1 tokens), so it is bounded by max_message before
 * anything is allocated for it, as a REPLICATE's is; the same bound holds for a reply
 * in frames (fetch_size_check). A payload that makes no progress for stall_ms is given
 * up (-ETIME), one that keeps coming is not, however long it takes in all.
 */
#include <errno.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "cluster/cluster_impl.h"
#include "proto/bulk.h"
#include "tests/fixture.h"

#define MAX_MESSAGE (1u << 20)
#define REQ_ID 77
#define LAYERS 4

/* The cluster tests' model "cm": 4 layers, 2 KV heads, head_dim 16, f16: a chunk's K and V
 * take 512 bytes a token. */
static const struct store_model cm = { .name = "cm", .desc.num_layers = LAYERS,
				       .desc.num_kv_heads = 2, .desc.head_dim = 16,
				       .desc.dtype = 1, .elem_size = 2 };

struct fixture {
	struct cluster *c;
	struct psock ps;
	int peer; /* the member's end of the bulk connection */
	struct kvbp_chunk chunk;
	uint64_t parts[LAYERS];
	struct call_out o;
};

static int setup(void **state)
{
	struct fixture *f = calloc(1, sizeof(*f));
	int sv[2];

	assert_non_null(f);
	f->c = calloc(1, sizeof(*f->c));
	assert_non_null(f->c);
	f->c->max_message = MAX_MESSAGE;
	assert_int_equal(socketpair(AF_UNIX, SOCK_STREAM, 0, sv), 0);
	f->ps.fd = sv[0];
	f->peer = sv[1];
	f->o.rep.request_id = REQ_ID;
	f->o.rep.chunks = &f->chunk;
	f->o.rep.n_chunks = 1;
	f->o.rep.bulk_parts = f->parts;
	f->o.rep.n_bulk_parts = LAYERS;
	*state = f;
	return 0;
}

static int teardown(void **state)
{
	struct fixture *f = *state;

	free(f->o.bulk);
	close(f->ps.fd);
	close(f->peer);
	free(f->c);
	free(f);
	return 0;
}

/* The reply announces a chunk of tokens, its layers part bytes each. */
static void announce(struct fixture *f, uint32_t tokens, uint64_t part)
{
	f->chunk.num_tokens = tokens;
	for (int l = 0; l < LAYERS; l++)
		f->parts[l] = part;
	f->o.rep.bulk_bytes = part * LAYERS;
}

static int64_t mono_ms(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (int64_t)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

/* Above max_message: refused at once, nothing allocated, both sizes named. */
static void test_oversized_refused(void **state)
{
	struct fixture *f = *state;
	char why[256] = "";
	int64_t t0 = mono_ms();

	/* 2^20 tokens: 512 MiB of K and V, announced as stored in 512 MiB */
	announce(f, 1u << 20, 128ull << 20);
	assert_int_equal(psock_fetch_payload(f->c, &f->ps, &cm, &f->o, t0 + 2000, 0, why,
					     sizeof(why)), -EMSGSIZE);
	assert_null(f->o.bulk);
	assert_non_null(strstr(why, "(536870912 bytes) is above max_message 1048576"));
	assert_true(mono_ms() - t0 < 1000); /* no wait for records */
	/* the most a reply can claim: 2^32-1 tokens (2 TiB) */
	announce(f, UINT32_MAX, 4ull << 30);
	assert_int_equal(psock_fetch_payload(f->c, &f->ps, &cm, &f->o, t0 + 2000, 0, why,
					     sizeof(why)), -EMSGSIZE);
	assert_null(f->o.bulk);
	assert_non_null(strstr(why, "4294967295 tokens"));
	/* just within: 2048 tokens are 1 MiB; stored bytes above what they may take are not */
	announce(f, 2048, 2ull << 20);
	assert_int_equal(psock_fetch_payload(f->c, &f->ps, &cm, &f->o, t0 + 2000, 0, why,
					     sizeof(why)), -EPROTO);
	assert_null(f->o.bulk);
}

/* The frames path's check: the same bound on the reply's tokens and stored bytes. */
static void test_frames_size_check(void **state)
{
	struct fixture *f = *state;
	char why[256] = "";

	assert_int_equal(fetch_size_check(f->c, &cm, 2048, 1u << 20, why, sizeof(why)), 0);
	assert_int_equal(fetch_size_check(f->c, &cm, 2049, 1u << 20, why, sizeof(why)),
			 -EMSGSIZE);
	assert_non_null(strstr(why, "(1049088 bytes) is above max_message 1048576"));
	assert_int_equal(fetch_size_check(f->c, &cm, UINT32_MAX, 1, why, sizeof(why)), -EMSGSIZE);
	assert_int_equal(fetch_size_check(f->c, &cm, 5, 0, why, sizeof(why)), -EPROTO);
	assert_int_equal(fetch_size_check(f->c, &cm, 0, 10, why, sizeof(why)), -EPROTO);
	/* 5 tokens: 2560 bytes, at most twice that and 4 KiB a layer stored */
	assert_int_equal(fetch_size_check(f->c, &cm, 5, 5120 + 4 * 4096, why, sizeof(why)), 0);
	assert_int_equal(fetch_size_check(f->c, &cm, 5, 5121 + 4 * 4096, why, sizeof(why)),
			 -EPROTO);
}

/* A whole record of the payload [off, off + len) of total bytes, plain (no seal). */
static void send_record(int fd, uint64_t off, uint32_t len, uint64_t total, const uint8_t *bytes)
{
	struct kvbb_hdr h = { off + len == total ? KVBB_LAST : 0, REQ_ID, total, off, len };
	uint8_t hdr[KVBB_HDR_LEN];

	kvbb_hdr_put(hdr, &h);
	assert_int_equal(write(fd, hdr, sizeof(hdr)), (ssize_t)sizeof(hdr));
	assert_int_equal(write(fd, bytes + off, len), (ssize_t)len);
}

/* Nothing after the reply: given up after stall_ms (not the deadline), named a stall. */
static void test_stall_given_up(void **state)
{
	struct fixture *f = *state;
	char why[256] = "";
	int64_t t0 = mono_ms(), dt;

	announce(f, 5, 100);
	assert_int_equal(psock_fetch_payload(f->c, &f->ps, &cm, &f->o, t0 + 5000, 100, why,
					     sizeof(why)), -ETIME);
	dt = mono_ms() - t0;
	assert_true(dt >= 100 && dt < 2500);
	assert_non_null(strstr(why, "stalled: no byte for 100 ms after 0 of 400 bytes"));
	free(f->o.bulk); /* (the caller's, as cluster_fetch's call_out_free) */
	f->o.bulk = NULL;
	/* without the progress rule only the deadline ends it */
	assert_int_equal(psock_fetch_payload(f->c, &f->ps, &cm, &f->o, mono_ms() + 150, 0, why,
					     sizeof(why)), -ETIMEDOUT);
}

struct trickle {
	int fd;
	uint8_t bytes[400];
};

/* The payload in two records, each with its header and bytes apart: four writes 150 ms
 * apart, 450 ms in all. */
static void *trickle_main(void *arg)
{
	struct trickle *t = arg;
	struct kvbb_hdr h[2] = { { 0, REQ_ID, 400, 0, 200 }, { KVBB_LAST, REQ_ID, 400, 200, 200 } };
	uint8_t hdr[KVBB_HDR_LEN];

	for (int r = 0; r < 2; r++) {
		kvbb_hdr_put(hdr, &h[r]);
		if (r)
			usleep(150 * 1000);
		if (write(t->fd, hdr, sizeof(hdr)) != (ssize_t)sizeof(hdr))
			return NULL;
		usleep(150 * 1000);
		if (write(t->fd, t->bytes + h[r].offset, h[r].len) != (ssize_t)h[r].len)
			return NULL;
	}
	return NULL;
}

/* A payload that keeps coming, each gap within stall_ms, is read whole though it takes
 * longer than stall_ms in all (the rule spans the records' headers and bytes). */
static void test_progress_keeps_it(void **state)
{
	struct fixture *f = *state;
	struct trickle t = { .fd = f->peer };
	char why[256] = "";
	pthread_t th;

	for (size_t i = 0; i < sizeof(t.bytes); i++)
		t.bytes[i] = (uint8_t)(i * 7 + 3);
	announce(f, 5, 100);
	assert_int_equal(pthread_create(&th, NULL, trickle_main, &t), 0);
	assert_int_equal(psock_fetch_payload(f->c, &f->ps, &cm, &f->o, mono_ms() + 10000, 400,
					     why, sizeof(why)), 0);
	pthread_join(th, NULL);
	assert_memory_equal(f->o.bulk, t.bytes, sizeof(t.bytes));
}

/* A payload at once, in one record: read whole, as before. */
static void test_whole_payload(void **state)
{
	struct fixture *f = *state;
	uint8_t bytes[400];
	char why[256] = "";

	for (size_t i = 0; i < sizeof(bytes); i++)
		bytes[i] = (uint8_t)i;
	announce(f, 5, 100);
	send_record(f->peer, 0, 400, 400, bytes);
	assert_int_equal(psock_fetch_payload(f->c, &f->ps, &cm, &f->o, mono_ms() + 2000, 100, why,
					     sizeof(why)), 0);
	assert_memory_equal(f->o.bulk, bytes, sizeof(bytes));
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		fixture_test(test_oversized_refused),
		fixture_test(test_frames_size_check),
		fixture_test(test_stall_given_up),
		fixture_test(test_progress_keeps_it),
		fixture_test(test_whole_payload),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
