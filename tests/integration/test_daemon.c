/*
 * Integration tests: the real kvblendd on a temporary data directory and IPC
 * socket, driven through libkvblend and, for malformed input, through a raw
 * ZeroMQ socket that sends exactly the bytes under test.
 */
#include <errno.h>
#include <lmdb.h>
#include <pthread.h>
#include <locale.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cmocka.h>

#include "tests/integration/harness.h"
#include "tests/integration/rawreq.h"

static const struct kvb_model tiny = TEST_MODEL_F16("tiny", 3, 2, 8);

static size_t chunk_bytes(const struct kvb_model *m, uint32_t t)
{
	return (size_t)m->num_layers * 2 * t * m->num_kv_heads * m->head_dim *
	       kvb_dtype_size(m->dtype);
}

static void fill(void *buf, size_t len, uint32_t seed)
{
	uint8_t *p = buf;
	uint32_t x = seed * 2654435761u + 1;

	for (size_t i = 0; i < len; i++) {
		x = x * 1103515245u + 12345u;
		p[i] = (uint8_t)(x >> 16);
	}
}

static void hash_of(uint32_t seed, uint8_t h[KVB_HASH_LEN])
{
	uint32_t ids[4] = { seed, seed + 1, seed + 2, 7 };

	kvb_chunk_hash(ids, 4, h);
}

static int setup(void **state)
{
	const char *args[] = { "--max-message", "4M", "--max-tokens", "4096", NULL };

	return daemon_setup(state, args);
}

static void register_tiny(kvb_client *c)
{
	int existed = -1;

	assert_int_equal(kvb_model_register(c, &tiny, &existed), 0);
}

static void roundtrip(struct daemon *d, int no_shm)
{
	kvb_client *c = daemon_client(d, no_shm);
	uint8_t h[3][KVB_HASH_LEN], missing[KVB_HASH_LEN];
	uint32_t tokens[3] = { 1, 17, 300 };
	struct kvb_chunk_info info[4];
	uint8_t q[4][KVB_HASH_LEN];
	int existed;

	register_tiny(c);
	for (int i = 0; i < 3; i++) {
		size_t n = chunk_bytes(&tiny, tokens[i]);
		uint8_t *kv = malloc(n), *back = malloc(n), *again = malloc(n);

		hash_of((uint32_t)(100 * no_shm + i), h[i]);
		fill(kv, n, (uint32_t)i);
		assert_int_equal(kvb_put(c, "tiny", h[i], KVB_F16, tokens[i], 5, kv, n, &existed), 0);
		assert_int_equal(existed, 0);
		assert_int_equal(kvb_get(c, "tiny", h[i], 0, 0, back, n, &info[0]), 0);
		assert_memory_equal(kv, back, n);
		assert_int_equal(info[0].num_tokens, tokens[i]);
		assert_int_equal(info[0].base_pos, 5);
		assert_int_equal(info[0].raw_bytes, n);
		/* Immutable: a second put with other bytes is a no-op reported as such. */
		fill(again, n, 99);
		assert_int_equal(kvb_put(c, "tiny", h[i], KVB_F16, tokens[i], 9, again, n, &existed),
				 0);
		assert_int_equal(existed, 1);
		assert_int_equal(kvb_get(c, "tiny", h[i], 0, 0, back, n, NULL), 0);
		assert_memory_equal(kv, back, n);
		/* A layer range: layers 1..2 only. */
		assert_int_equal(kvb_get(c, "tiny", h[i], 1, 3, back, n / 3 * 2, NULL), 0);
		assert_memory_equal(kv + n / 3, back, n / 3 * 2);
		/* A buffer of the wrong size is refused, not overrun, and info says the size
		 * (smaller and larger, so that both the shared-memory and the frames paths are
		 * taken). */
		memset(&info[0], 0, sizeof(info[0]));
		assert_int_equal(kvb_get(c, "tiny", h[i], 0, 0, back, n - 2, &info[0]), -ENOBUFS);
		assert_int_equal(info[0].raw_bytes, n);
		assert_int_equal(info[0].num_tokens, tokens[i]);
		memset(&info[0], 0, sizeof(info[0]));
		assert_int_equal(kvb_get(c, "tiny", h[i], 0, 0, back, 1, &info[0]), -ENOBUFS);
		assert_int_equal(info[0].raw_bytes, n);
		free(kv);
		free(back);
		free(again);
	}
	hash_of(777, missing);
	memcpy(q[0], h[0], KVB_HASH_LEN);
	memcpy(q[1], missing, KVB_HASH_LEN);
	memcpy(q[2], h[2], KVB_HASH_LEN);
	memcpy(q[3], h[1], KVB_HASH_LEN);
	assert_int_equal(kvb_lookup(c, "tiny", (const uint8_t(*)[KVB_HASH_LEN])q, 4, info), 0);
	assert_true(info[0].found && !info[1].found && info[2].found && info[3].found);
	assert_int_equal(info[2].num_tokens, 300);
	assert_int_equal(info[3].num_tokens, 17);
	assert_int_equal(kvb_delete(c, "tiny", h[1]), 0);
	assert_int_equal(kvb_delete(c, "tiny", h[1]), KVB_E_NOT_FOUND);
	{
		size_t n = chunk_bytes(&tiny, 17);
		void *b = malloc(n);

		assert_int_equal(kvb_get(c, "tiny", h[1], 0, 0, b, n, NULL), KVB_E_NOT_FOUND);
		free(b);
	}
	kvb_close(&c);
}

static void test_roundtrip_shm(void **state)
{
	roundtrip(*state, 0);
}

static void test_roundtrip_frames(void **state)
{
	roundtrip(*state, 1);
}

static void test_shared_buffer(void **state)
{
	kvb_client *c = daemon_client(*state, 0);
	size_t n = chunk_bytes(&tiny, 64);
	uint8_t h[KVB_HASH_LEN], *ref = malloc(n);
	uint8_t *buf;

	register_tiny(c);
	buf = kvb_shared_buffer(c, n);
	assert_non_null(buf);
	fill(buf, n, 42);
	memcpy(ref, buf, n);
	hash_of(4242, h);
	assert_int_equal(kvb_put(c, "tiny", h, KVB_F16, 64, 0, buf, n, NULL), 0);
	memset(buf, 0, n);
	assert_int_equal(kvb_get(c, "tiny", h, 0, 0, buf, n, NULL), 0);
	assert_memory_equal(ref, buf, n);
	assert_true((uint64_t)daemon_stat(c, "shm_segments") >= 1);
	free(ref);
	kvb_close(&c);
}

/* A chunk large enough that the daemon splits its GET: every path returns the same bytes. */
static void test_large_chunk_paths(void **state)
{
	const struct kvb_model big = { .name = "big16", .num_layers = 16, .num_kv_heads = 8,
				       .head_dim = 128, .dtype = KVB_BF16, .rope_theta = 1e4 };
	struct daemon d;
	kvb_client *shm, *frames;
	size_t n = (size_t)16 * 2 * 128 * 8 * 128 * 2; /* 16 MiB */
	uint8_t *kv = malloc(n), *back = malloc(n), h[KVB_HASH_LEN], *sb;

	(void)state;
	daemon_start(&d, NULL); /* the default max_message */
	shm = daemon_client(&d, 0);
	frames = daemon_client(&d, 1);

	assert_int_equal(kvb_model_register(shm, &big, NULL), 0);
	fill(kv, n, 1616);
	hash_of(1616, h);
	assert_int_equal(kvb_put(shm, "big16", h, KVB_BF16, 128, 0, kv, n, NULL), 0);
	/* private buffer: copied out behind the daemon as layers finish */
	memset(back, 0, n);
	assert_int_equal(kvb_get(shm, "big16", h, 0, 0, back, n, NULL), 0);
	assert_memory_equal(kv, back, n);
	/* a layer range, the same way */
	assert_int_equal(kvb_get(shm, "big16", h, 5, 12, back, n / 16 * 7, NULL), 0);
	assert_memory_equal(kv + n / 16 * 5, back, n / 16 * 7);
	/* straight into the shared buffer */
	sb = kvb_shared_buffer(shm, n);
	assert_non_null(sb);
	assert_int_equal(kvb_get(shm, "big16", h, 0, 0, sb, n, NULL), 0);
	assert_memory_equal(kv, sb, n);
	/* frames */
	memset(back, 0, n);
	assert_int_equal(kvb_get(frames, "big16", h, 0, 0, back, n, NULL), 0);
	assert_memory_equal(kv, back, n);
	/* frames kept: each layer's K and V where it arrived, usable after the client
	 * has gone (in a process with its malloc tuned for that, as it should be) */
#if defined(__SANITIZE_ADDRESS__)
	/* AddressSanitizer's allocator replaces glibc's: nothing to tune. */
	assert_int_equal(kvb_malloc_tune(0), -ENOTSUP);
#else
	assert_int_equal(kvb_malloc_tune(0), 0);
	assert_int_equal(kvb_malloc_tune((size_t)64 << 20), 0);
#endif
	{
		struct kvb_layers *l = NULL, *all = NULL;
		size_t tb = n / 32;
		uint8_t missing[KVB_HASH_LEN];

		assert_int_equal(kvb_get_layers(frames, "big16", h, 3, 9, &l), 0);
		assert_int_equal(l->layer_begin, 3);
		assert_int_equal(l->layer_end, 9);
		assert_int_equal(l->tensor_bytes, tb);
		assert_int_equal(l->info.num_tokens, 128);
		assert_int_equal(kvb_get_layers(frames, "big16", h, 0, 0, &all), 0);
		for (uint32_t i = 0; i < 6; i++) {
			assert_memory_equal(l->k[i], kv + (3 + i) * 2 * tb, tb);
			assert_memory_equal(l->v[i], kv + (3 + i) * 2 * tb + tb, tb);
		}
		kvb_close(&frames);
		assert_int_equal(all->layer_end, 16);
		assert_memory_equal(all->v[15], kv + n - tb, tb);
		kvb_layers_free(&l);
		kvb_layers_free(&all);
		assert_null(all);
		kvb_layers_free(NULL);
		frames = daemon_client(&d, 1);
		hash_of(1617, missing);
		assert_int_equal(kvb_get_layers(frames, "big16", missing, 0, 0, &l),
				 KVB_E_NOT_FOUND);
		assert_null(l);
		assert_int_equal(kvb_get_layers(frames, "big16", h, 9, 3, &l), KVB_E_BAD_ARGUMENT);
		assert_null(l);
	}
	free(kv);
	free(back);
	kvb_close(&shm);
	daemon_end(&d, &frames);
}

/* Heads [h0, h0 + hn) of every tensor of a chunk laid out [layers, 2, tokens, heads, d]. */
static void slice_heads(const uint8_t *all, uint8_t *out, size_t tensors, uint32_t tokens,
			uint32_t heads, size_t head_bytes, uint32_t h0, uint32_t hn)
{
	for (size_t i = 0; i < tensors * tokens; i++)
		memcpy(out + i * hn * head_bytes, all + (i * heads + h0) * head_bytes,
		       hn * head_bytes);
}

/* A GET of a head range (kvb_get_opts): each token's heads [h0, h0 + hn) of every layer,
 * through shared memory (a private buffer, copied behind; the shared buffer itself)
 * and through frames, re-rotated or not, over a layer range or all; a range beyond the
 * heads, a begin without a count, a short struct and a buffer of the wrong size are
 * refused by name. */
static void test_get_heads(void **state)
{
	const struct kvb_model big = { .name = "big16", .num_layers = 16, .num_kv_heads = 8,
				       .head_dim = 128, .dtype = KVB_BF16, .rope_theta = 1e4 };
	const size_t hb = 128 * 2; /* one head of one token */
	const uint32_t T = 128;
	struct daemon d;
	kvb_client *cl[2];
	size_t n = (size_t)16 * 2 * T * 8 * hb; /* 16 MiB */
	uint8_t *kv = malloc(n), *want = malloc(n), *back = malloc(n), *rot = malloc(n);
	uint8_t h[KVB_HASH_LEN];
	const uint32_t ranges[][2] = { { 0, 1 }, { 3, 2 }, { 6, 2 }, { 0, 8 }, { 1, 6 } };

	(void)state;
	daemon_start(&d, NULL);
	cl[0] = daemon_client(&d, 0);
	cl[1] = daemon_client(&d, 1);
	assert_int_equal(kvb_model_register(cl[0], &big, NULL), 0);
	fill(kv, n, 4242);
	hash_of(4242, h);
	assert_int_equal(kvb_put(cl[0], "big16", h, KVB_BF16, T, 3, kv, n, NULL), 0);
	assert_int_equal(kvb_get_rerotated(cl[0], "big16", h, 0, 0, 77, rot, n, NULL), 0);
	for (int c = 0; c < 2; c++) {
		for (size_t r = 0; r < sizeof(ranges) / sizeof(ranges[0]); r++) {
			uint32_t h0 = ranges[r][0], hn = ranges[r][1];
			size_t part = n / 8 * hn;
			struct kvb_get_opts o = { .size = sizeof(o), .head_begin = h0,
						  .head_count = hn };
			struct kvb_chunk_info info;

			slice_heads(kv, want, 32, T, 8, hb, h0, hn);
			memset(back, 0, n);
			assert_int_equal(kvb_get_opts(cl[c], "big16", h, &o, back, part, &info), 0);
			assert_memory_equal(want, back, part);
			assert_int_equal(info.num_tokens, T);
			/* layers 5..11 */
			o.layer_begin = 5;
			o.layer_end = 12;
			assert_int_equal(kvb_get_opts(cl[c], "big16", h, &o, back, part / 16 * 7,
						      NULL), 0);
			assert_memory_equal(want + part / 16 * 5, back, part / 16 * 7);
			/* re-rotated to 77: the full re-rotated GET's heads */
			o.layer_begin = o.layer_end = 0;
			o.rerotate = 1;
			o.pos = 77;
			slice_heads(rot, want, 32, T, 8, hb, h0, hn);
			assert_int_equal(kvb_get_opts(cl[c], "big16", h, &o, back, part, NULL), 0);
			assert_memory_equal(want, back, part);
			/* a buffer of the wrong size: refused, not overrun */
			assert_int_equal(kvb_get_opts(cl[c], "big16", h, &o, back, part + 64, NULL),
					 -ENOBUFS);
			assert_int_equal(kvb_get_opts(cl[c], "big16", h, &o, back, part - 64, NULL),
					 -ENOBUFS);
		}
	}
	{
		/* straight into the shared buffer */
		struct kvb_get_opts o = { .size = sizeof(o), .head_begin = 5, .head_count = 3 };
		uint8_t *sb = kvb_shared_buffer(cl[0], n / 8 * 3);

		assert_non_null(sb);
		slice_heads(kv, want, 32, T, 8, hb, 5, 3);
		assert_int_equal(kvb_get_opts(cl[0], "big16", h, &o, sb, n / 8 * 3, NULL), 0);
		assert_memory_equal(want, sb, n / 8 * 3);
		/* refusals, each by name; the daemon keeps serving */
		o.head_begin = 7;
		o.head_count = 2;
		assert_int_equal(kvb_get_opts(cl[0], "big16", h, &o, back, n / 4, NULL),
				 KVB_E_BAD_ARGUMENT);
		assert_non_null(strstr(kvb_last_error(cl[0]), "beyond the model's 8 KV heads"));
		o.head_begin = UINT32_MAX;
		o.head_count = UINT32_MAX;
		assert_int_equal(kvb_get_opts(cl[1], "big16", h, &o, back, n, NULL),
				 KVB_E_BAD_ARGUMENT);
		o.head_begin = 1;
		o.head_count = 0;
		assert_int_equal(kvb_get_opts(cl[0], "big16", h, &o, back, n, NULL), -EINVAL);
		assert_non_null(strstr(kvb_last_error(cl[0]), "without head_count"));
		o.size = sizeof(o) - 1;
		o.head_count = 1;
		assert_int_equal(kvb_get_opts(cl[0], "big16", h, &o, back, n / 8, NULL), -EINVAL);
		assert_int_equal(kvb_get(cl[0], "big16", h, 0, 0, back, n, NULL), 0);
		assert_memory_equal(kv, back, n);
	}
	{
		/* a small chunk (one decode part, no progress word): tiny's second head */
		size_t m = chunk_bytes(&tiny, 17), hbt = 8 * 2;
		struct kvb_get_opts o = { .size = sizeof(o), .head_begin = 1, .head_count = 1 };

		register_tiny(cl[0]);
		hash_of(4243, h);
		fill(kv, m, 4243);
		assert_int_equal(kvb_put(cl[0], "tiny", h, KVB_F16, 17, 0, kv, m, NULL), 0);
		slice_heads(kv, want, 6, 17, 2, hbt, 1, 1);
		for (int c = 0; c < 2; c++) {
			memset(back, 0, m);
			assert_int_equal(kvb_get_opts(cl[c], "tiny", h, &o, back, m / 2, NULL), 0);
			assert_memory_equal(want, back, m / 2);
		}
	}
	free(kv);
	free(want);
	free(back);
	free(rot);
	kvb_close(&cl[0]);
	kvb_close(&cl[1]);
	daemon_stop(&d);
	daemon_cleanup(&d);
}

static void test_models(void **state)
{
	kvb_client *c = daemon_client(*state, 0);
	struct kvb_model m = tiny, got;
	int existed = -1;

	register_tiny(c);
	assert_int_equal(kvb_model_register(c, &tiny, &existed), 0);
	assert_int_equal(existed, 1);
	m.head_dim = 16;
	assert_int_equal(kvb_model_register(c, &m, NULL), KVB_E_MODEL_CONFLICT);
	assert_non_null(strstr(kvb_last_error(c), "different layout"));
	assert_non_null(strstr(kvb_last_error(c), "its head_dim differs"));
	/* the field that differs is named (a changed config.json: issue 55, defect 8) */
	m = tiny;
	m.rope_theta = 2 * tiny.rope_theta + 1;
	assert_int_equal(kvb_model_register(c, &m, NULL), KVB_E_MODEL_CONFLICT);
	assert_non_null(strstr(kvb_last_error(c), "its rope_theta differs"));
	m = tiny;
	m.num_layers = 0;
	snprintf(m.name, sizeof(m.name), "zero-layers");
	assert_int_equal(kvb_model_register(c, &m, NULL), KVB_E_BAD_SHAPE);
	assert_non_null(strstr(kvb_last_error(c), "num_layers 0"));
	m = tiny;
	snprintf(m.name, sizeof(m.name), "absurd");
	m.num_kv_heads = 1u << 30;
	assert_int_equal(kvb_model_register(c, &m, NULL), KVB_E_BAD_SHAPE);
	assert_non_null(strstr(kvb_last_error(c), "num_kv_heads"));
	m = tiny;
	snprintf(m.name, sizeof(m.name), "odd-dim");
	m.head_dim = 7;
	assert_int_equal(kvb_model_register(c, &m, NULL), KVB_E_BAD_SHAPE);
	m = tiny;
	snprintf(m.name, sizeof(m.name), "bad name");
	assert_int_equal(kvb_model_register(c, &m, NULL), KVB_E_BAD_ARGUMENT);
	m = tiny;
	snprintf(m.name, sizeof(m.name), "llama3-bad");
	m.scaling = KVB_SCALING_LLAMA3;
	m.factor = 8;
	assert_int_equal(kvb_model_register(c, &m, NULL), KVB_E_BAD_ARGUMENT);
	assert_non_null(strstr(kvb_last_error(c), "llama3 rope scaling needs factor > 0"));
	assert_int_equal(kvb_rope_scaling_parse("yarn:4,32768", &m), 0);
	snprintf(m.name, sizeof(m.name), "yarn-ok");
	assert_int_equal(kvb_model_register(c, &m, NULL), 0);
	assert_int_equal(kvb_model_get(c, "yarn-ok", &got), 0);
	assert_int_equal(got.scaling, KVB_SCALING_YARN);
	assert_true(got.beta_fast == 32 && got.beta_slow == 1 && got.original_max_pos == 32768);
	assert_int_equal(got.rotary_dim, tiny.head_dim); /* 0 means head_dim */
	assert_int_equal(kvb_model_get(c, "nope", &got), KVB_E_UNKNOWN_MODEL);
	kvb_close(&c);
}

/* ---- raw protocol: exactly the bytes under test ---- */

/* Send req as it is (version, payload_frames: right or wrong); the reply's code and message. */
static uint32_t raw_request(struct raw *r, const struct kvbp_request *req,
			    const void *const *payload, const size_t *lens, size_t n, char *msg,
			    size_t msglen)
{
	raw_send_as_is(r, req, payload, lens, n);
	return raw_recv_msg(r, msg, msglen);
}

static struct kvbp_request put_req(uint32_t tokens, uint32_t frames, const uint8_t *hash)
{
	struct kvbp_request q = { .version = KVBP_VERSION, .request_id = 7, .op = KVBP_OP_PUT,
				  .has_hash = true, .num_tokens = tokens, .payload_frames = frames,
				  .dtype = 1 /* f16 */ };

	snprintf(q.model_name, sizeof(q.model_name), "tiny");
	memcpy(q.hash, hash, KVBP_HASH_LEN);
	return q;
}

static void expect_serving(kvb_client *c, uint64_t chunks_before)
{
	char v[32];

	assert_int_equal(kvb_ping(c, v, sizeof(v)), 0);
	assert_int_equal((uint64_t)daemon_stat(c, "chunks"), chunks_before);
}

#define EXPECT(code_, substr_)                                                              \
	do {                                                                                \
		if (code != (code_) || !strstr(msg, substr_))                               \
			fail_msg("line %d: got %s '%s', expected %s '...%s...'", __LINE__,   \
				 kvbp_code_name(code), msg, kvbp_code_name(code_), substr_); \
		expect_serving(c, chunks);                                                  \
	} while (0)

static void test_bad_input(void **state)
{
	struct daemon *d = *state;
	kvb_client *c = daemon_client(d, 1);
	struct raw r;
	char msg[512];
	uint32_t code;
	uint64_t chunks;
	uint8_t h[KVBP_HASH_LEN];
	size_t tb = 4 * 2 * 8 * 2; /* 4 tokens x 2 heads x 8 dims x f16 */
	uint8_t *t = calloc(1, 8 << 20);
	const void *p[8] = { t, t, t, t, t, t, t, t };
	size_t lens[8] = { tb, tb, tb, tb, tb, tb, tb, tb };
	struct kvbp_request q;

	register_tiny(c);
	chunks = (uint64_t)daemon_stat(c, "chunks");
	hash_of(555, h);
	raw_open(&r, d->endpoint, 10000);

	/* garbage and empty frames */
	{
		const void *f[1] = { "\xff\xff\xff garbage \x01" };
		size_t l[1] = { 13 };

		raw_send_frames(&r, f, l, 1);
		code = raw_recv_msg(&r, msg, sizeof(msg));
		EXPECT(KVBP_BAD_REQUEST, "not a valid protobuf");
		l[0] = 0;
		raw_send_frames(&r, f, l, 1);
		code = raw_recv_msg(&r, msg, sizeof(msg));
		EXPECT(KVBP_BAD_REQUEST, "empty request header");
		raw_send_frames(&r, f, l, 0);
		code = raw_recv_msg(&r, msg, sizeof(msg));
		EXPECT(KVBP_BAD_REQUEST, "empty request header");
	}
	/* a truncated protobuf: a valid header cut short */
	{
		uint8_t *hdr;
		size_t hlen;
		const void *f[1];
		size_t l[1];

		q = put_req(4, 6, h);
		assert_int_equal(kvbp_request_encode(&q, &hdr, &hlen), 0);
		f[0] = hdr;
		l[0] = hlen - 5;
		raw_send_frames(&r, f, l, 1);
		code = raw_recv_msg(&r, msg, sizeof(msg));
		free(hdr);
		EXPECT(KVBP_BAD_REQUEST, "not a valid protobuf");
	}
	/* unknown protocol version, unknown operation */
	q = put_req(4, 6, h);
	q.version = 99;
	code = raw_request(&r, &q, p, lens, 6, msg, sizeof(msg));
	EXPECT(KVBP_BAD_VERSION, "protocol version 99 not supported");
	q.version = 0;
	code = raw_request(&r, &q, p, lens, 6, msg, sizeof(msg));
	EXPECT(KVBP_BAD_VERSION, "protocol version 0 not supported");
	/* version 2 (a request a daemon must understand whole) is taken as 1 is */
	q = put_req(4, 0, h);
	q.op = KVBP_OP_STATS;
	q.version = KVBP_VERSION_MAX;
	code = raw_request(&r, &q, NULL, NULL, 0, msg, sizeof(msg));
	EXPECT(KVBP_OK, "");
	q = put_req(4, 0, h);
	q.op = 77;
	code = raw_request(&r, &q, NULL, NULL, 0, msg, sizeof(msg));
	EXPECT(KVBP_UNKNOWN_OP, "unknown operation 77");
	/* payload bytes that do not match the declared shape */
	q = put_req(4, 6, h);
	lens[3] = tb - 2;
	code = raw_request(&r, &q, p, lens, 6, msg, sizeof(msg));
	lens[3] = tb;
	EXPECT(KVBP_BAD_SHAPE, "payload frame 4 is 126 bytes; expected 128");
	/* a shape whose byte count overflows; zero and absurd token counts */
	q = put_req(4000000000u, 6, h);
	code = raw_request(&r, &q, p, lens, 6, msg, sizeof(msg));
	EXPECT(KVBP_BAD_SHAPE, "exceeds max_tokens");
	q = put_req(0, 6, h);
	code = raw_request(&r, &q, p, lens, 6, msg, sizeof(msg));
	EXPECT(KVBP_BAD_SHAPE, "num_tokens is 0");
	/* unknown model, dtype mismatch */
	q = put_req(4, 6, h);
	snprintf(q.model_name, sizeof(q.model_name), "no-such-model");
	code = raw_request(&r, &q, p, lens, 6, msg, sizeof(msg));
	EXPECT(KVBP_UNKNOWN_MODEL, "unknown model 'no-such-model'");
	q = put_req(4, 6, h);
	q.dtype = 3;
	code = raw_request(&r, &q, p, lens, 6, msg, sizeof(msg));
	EXPECT(KVBP_DTYPE_MISMATCH, "payload dtype f32 does not match model 'tiny' dtype f16");
	/* more frames than declared, and the right count declared but wrong for the model */
	q = put_req(4, 6, h);
	code = raw_request(&r, &q, p, lens, 7, msg, sizeof(msg));
	EXPECT(KVBP_BAD_FRAMES, "header declares 6 payload frames; the message has 7");
	q = put_req(4, 4, h);
	code = raw_request(&r, &q, p, lens, 4, msg, sizeof(msg));
	EXPECT(KVBP_BAD_FRAMES, "needs 6 payload frames");
	/* a get of a bad layer range, a lookup of nothing */
	{
		q = put_req(4, 0, h);
		q.op = KVBP_OP_GET;
		q.layer_begin = 2;
		q.layer_end = 9;
		code = raw_request(&r, &q, NULL, NULL, 0, msg, sizeof(msg));
		EXPECT(KVBP_BAD_ARGUMENT, "layer range 2:9 invalid for a 3-layer model");
		q = put_req(4, 0, h);
		q.op = KVBP_OP_LOOKUP;
		code = raw_request(&r, &q, NULL, NULL, 0, msg, sizeof(msg));
		EXPECT(KVBP_BAD_ARGUMENT, "lookup needs at least one hash");
	}
	/* a shared-memory reference to a segment that does not exist */
	q = put_req(4, 0, h);
	q.has_shm = true;
	q.shm_id = 12345;
	q.shm_length = 6 * tb;
	code = raw_request(&r, &q, NULL, NULL, 0, msg, sizeof(msg));
	EXPECT(KVBP_BAD_SHM, "unknown, expired or not this client's");
	/* Nothing of all that was stored: */
	{
		struct kvb_chunk_info ci;

		assert_int_equal(kvb_lookup(c, "tiny", (const uint8_t(*)[KVB_HASH_LEN])h, 1, &ci), 0);
		assert_false(ci.found);
	}
	/* ...and a well-formed put on the same raw socket works. */
	q = put_req(4, 6, h);
	code = raw_request(&r, &q, p, lens, 6, msg, sizeof(msg));
	assert_int_equal(code, KVBP_OK);
	assert_int_equal((uint64_t)daemon_stat(c, "chunks"), chunks + 1);
	assert_true((uint64_t)daemon_stat(c, "errors_bad_request") >= 4);
	raw_close(&r);
	free(t);
	kvb_close(&c);
}

static void test_message_too_large(void **state)
{
	struct daemon *d = *state;
	kvb_client *c = daemon_client(d, 1);
	struct raw r;
	char msg[512];
	uint32_t code;
	uint64_t chunks;
	uint8_t h[KVBP_HASH_LEN], *t = calloc(1, 1 << 20);
	const void *p[6] = { t, t, t, t, t, t };
	size_t lens[6];
	struct kvbp_request q;
	/* 4096 tokens x 2 heads x 8 dims x 2 bytes = 128 KiB a tensor, 768 KiB in all: fits;
	 * the frames below carry 1 MiB each, 6 MiB against the 4 MiB limit. */

	register_tiny(c);
	chunks = (uint64_t)daemon_stat(c, "chunks");
	hash_of(556, h);
	raw_open(&r, d->endpoint, 10000);
	for (int i = 0; i < 6; i++)
		lens[i] = 1u << 20;
	q = put_req(4096, 6, h);
	code = raw_request(&r, &q, p, lens, 6, msg, sizeof(msg));
	EXPECT(KVBP_TOO_LARGE, "exceeds max_message 4194304");
	raw_close(&r);
	free(t);
	kvb_close(&c);
}

/* A shape whose byte count overflows 64 bits, with every limit raised to its maximum. */
static void test_shape_overflow(void **state)
{
	struct daemon d;
	const char *args[] = { "--max-tokens", "16777216", "--max-kv-heads", "4096",
			       "--max-head-dim", "65536", "--max-layers", "4096", NULL };
	struct kvb_model huge = { .name = "huge", .num_layers = 4096, .num_kv_heads = 4096,
				  .head_dim = 65536, .dtype = KVB_F32, .rope_theta = 10000 };
	kvb_client *c;
	struct raw r;
	struct kvbp_request q;
	uint8_t h[KVBP_HASH_LEN];
	char msg[512];
	uint32_t code;
	uint64_t chunks;

	(void)state;
	c = daemon_start_client(&d, args, &huge, 1);
	chunks = (uint64_t)daemon_stat(c, "chunks");
	raw_open(&r, d.endpoint, 10000);
	hash_of(1, h);
	q = put_req(16777216, 0, h);
	snprintf(q.model_name, sizeof(q.model_name), "huge");
	q.dtype = 3;
	code = raw_request(&r, &q, NULL, NULL, 0, msg, sizeof(msg));
	EXPECT(KVBP_BAD_SHAPE, "chunk size overflows");
	raw_close(&r);
	daemon_end(&d, &c);
}

static void test_restart_keeps_chunks(void **state)
{
	struct daemon *d = *state;
	const char *args[] = { "--max-message", "4M", "--max-tokens", "4096", NULL };
	kvb_client *c = daemon_client(d, 0);
	size_t n = chunk_bytes(&tiny, 33);
	uint8_t h[5][KVB_HASH_LEN], *kv = malloc(n), *back = malloc(n);

	register_tiny(c);
	for (uint32_t i = 0; i < 5; i++) {
		hash_of(9000 + i, h[i]);
		fill(kv, n, 9000 + i);
		assert_int_equal(kvb_put(c, "tiny", h[i], KVB_F16, 33, i, kv, n, NULL), 0);
	}
	kvb_close(&c);
	daemon_restart(d, args);
	c = daemon_client(d, 0);
	for (uint32_t i = 0; i < 5; i++) {
		struct kvb_chunk_info ci;

		fill(kv, n, 9000 + i);
		assert_int_equal(kvb_get(c, "tiny", h[i], 0, 0, back, n, &ci), 0);
		assert_memory_equal(kv, back, n);
		assert_int_equal(ci.base_pos, i);
	}
	free(kv);
	free(back);
	kvb_close(&c);
}

/* Flip one byte in the stored payload of the first (or the last) layer record, with the
 * daemon stopped. */
static void corrupt_layer_at(const char *data_dir, MDB_cursor_op which)
{
	MDB_cursor *cur = data_layers_open(data_dir);
	MDB_val k, v;
	uint8_t *copy;

	assert_int_equal(mdb_cursor_get(cur, &k, &v, which), 0);
	copy = malloc(v.mv_size);
	memcpy(copy, v.mv_data, v.mv_size);
	copy[v.mv_size - 1] ^= 0x40; /* a payload byte of V, past every header */
	v.mv_data = copy;
	assert_int_equal(mdb_cursor_put(cur, &k, &v, MDB_CURRENT), 0);
	data_layers_close(cur);
	free(copy);
}

/* A corrupt chunk was removed: h is not found, and corrupt_removed counts one; then a
 * sound chunk (seed) is stored in its place. */
static void removed_then_put(kvb_client *c, uint8_t h[KVB_HASH_LEN], uint32_t seed,
			     uint32_t tokens, uint8_t *kv, size_t n)
{
	struct kvb_chunk_info ci;

	/* removed (and counted) just after the abort record went out: on a bulk GET the
	 * client may hear the abort first, and look the chunk up before it is gone */
	for (int i = 0; i < 500 && daemon_stat(c, "corrupt_removed") < 1; i++)
		usleep(10000);
	assert_int_equal((uint64_t)daemon_stat(c, "corrupt_removed"), 1);
	assert_int_equal(kvb_lookup(c, "tiny", (const uint8_t(*)[KVB_HASH_LEN])h, 1, &ci), 0);
	assert_false(ci.found);
	hash_of(seed, h);
	fill(kv, n, seed);
	assert_int_equal(kvb_put(c, "tiny", h, KVB_F16, tokens, 0, kv, n, NULL), 0);
}

/* Register tiny, store the chunk of `tokens` of seed under h (kv: its bytes, n long), stop
 * the daemon and flip a payload byte of the first or the last layer record on disk. */
static void put_then_corrupt(struct daemon *d, uint8_t h[KVB_HASH_LEN], uint32_t seed,
			     uint32_t tokens, uint8_t *kv, size_t n, MDB_cursor_op which)
{
	kvb_client *c = daemon_client(d, 0);

	register_tiny(c);
	hash_of(seed, h);
	fill(kv, n, seed);
	assert_int_equal(kvb_put(c, "tiny", h, KVB_F16, tokens, 0, kv, n, NULL), 0);
	kvb_close(&c);
	daemon_stop(d);
	corrupt_layer_at(d->data_dir, which);
}

/* A chunk of `tokens` stored, one payload byte flipped on disk: the GET says corrupt,
 * the chunk is gone, and a second chunk's GET of the same path still works. */
static void corrupt_chunk_removed(struct daemon *d, uint32_t tokens)
{
	/* no scrub: it would find the flipped byte before the GET does */
	const char *args[] = { "--max-message", "4M", "--max-tokens", "4096", "--scrub-mb-per-s",
			       "0", NULL };
	size_t n = chunk_bytes(&tiny, tokens);
	uint8_t h[KVB_HASH_LEN], *kv = malloc(n);
	kvb_client *c;

	put_then_corrupt(d, h, 31337, tokens, kv, n, MDB_FIRST);
	daemon_restart(d, args);
	c = daemon_client(d, 0);
	memset(kv, 0, n);
	assert_int_equal(kvb_get(c, "tiny", h, 0, 0, kv, n, NULL), KVB_E_CORRUPT);
	assert_non_null(strstr(kvb_last_error(c), "failed its checksum and was removed"));
	/* The same path serves a sound chunk afterwards. */
	removed_then_put(c, h, 31338, tokens, kv, n);
	{
		uint8_t *back = malloc(n);

		assert_int_equal(kvb_get(c, "tiny", h, 0, 0, back, n, NULL), 0);
		assert_memory_equal(kv, back, n);
		/* A layer range from the middle: the frames of layers 1..2 only. */
		assert_int_equal(kvb_get(c, "tiny", h, 1, 3, back, n / 3 * 2, NULL), 0);
		assert_memory_equal(kv + n / 3, back, n / 3 * 2);
		free(back);
	}
	free(kv);
	kvb_close(&c);
}

/* The scrub finds a flipped byte nobody reads: the chunk is removed and counted, and a
 * read after says it is not there. Sound chunks read twice are verified once
 * (verify=once, the default), then trusted. */
static void test_scrub_removes_corrupt(void **state)
{
	struct daemon *d = *state;
	const char *args[] = { "--max-message", "4M", "--scrub-mb-per-s", "100", NULL };
	uint32_t tokens = 2048;
	size_t n = chunk_bytes(&tiny, tokens);
	uint8_t h[KVB_HASH_LEN], sound[KVB_HASH_LEN], *kv = malloc(n), *back = malloc(n);
	struct kvb_chunk_info ci;
	kvb_client *c;
	double t0, t1;
	int i;

	put_then_corrupt(d, h, 777, tokens, kv, n, MDB_LAST);
	daemon_restart(d, args);
	c = daemon_client(d, 0);
	for (i = 0; i < 100 && daemon_stat(c, "corrupt_removed") < 1; i++)
		usleep(50000);
	assert_int_equal((uint64_t)daemon_stat(c, "corrupt_removed"), 1);
	assert_true(daemon_stat(c, "scrub_bytes") > 0);
	assert_int_equal(kvb_lookup(c, "tiny", (const uint8_t(*)[KVB_HASH_LEN])h, 1, &ci), 0);
	assert_false(ci.found);
	/* A sound chunk: its first GET computes the checksums, the second trusts them. */
	hash_of(778, sound);
	fill(kv, n, 778);
	assert_int_equal(kvb_put(c, "tiny", sound, KVB_F16, tokens, 0, kv, n, NULL), 0);
	t0 = daemon_stat(c, "verify_trusted");
	assert_int_equal(kvb_get(c, "tiny", sound, 0, 0, back, n, NULL), 0);
	assert_int_equal(kvb_get(c, "tiny", sound, 0, 0, back, n, NULL), 0);
	assert_memory_equal(kv, back, n);
	t1 = daemon_stat(c, "verify_trusted");
	assert_true(t1 - t0 >= 3); /* tiny has 3 layers: the second GET trusted them all */
	free(kv);
	free(back);
	kvb_close(&c);
}

/*
 * An IPC socket path of 100 bytes (its descriptor socket, PATH.shm, 104: under a Unix
 * socket path's 108). The reply named the descriptor socket in a 64-byte field, so any
 * path of 64 bytes or more was cut short, and every shared-memory use (a region, a PUT or
 * GET through the client's segment) failed with "cannot fetch shared-memory segment".
 */
static void test_shm_long_socket_path(void **state)
{
	struct daemon *d = *state;
	uint32_t tokens = 4096; /* 768 KiB: through the client's shared-memory segment */
	size_t n = chunk_bytes(&tiny, tokens);
	uint8_t h[KVB_HASH_LEN], *kv = malloc(n), *back = malloc(n);
	char sub[264], path[272];
	size_t len;
	kvb_client *c;
	void *region;

	daemon_stop(d);
	snprintf(sub, sizeof(sub), "%s/", d->dir);
	len = strlen(sub);
	assert_true(len < 100 - 7);
	memset(sub + len, 'd', 100 - 7 - len); /* DIR/ddd...d/s.sock: 100 bytes */
	sub[100 - 7] = '\0';
	assert_int_equal(mkdir(sub, 0700), 0);
	snprintf(path, sizeof(path), "%s/s.sock", sub);
	assert_int_equal(strlen(path), 100);
	snprintf(d->endpoint, sizeof(d->endpoint), "ipc://%s", path);
	daemon_restart(d, (const char *[]){ "--max-message", "4M", "--max-tokens", "4096", NULL });
	c = daemon_client(d, 0);
	register_tiny(c);
	region = kvb_region_alloc(c, 1u << 20);
	assert_non_null(region);
	memset(region, 0x5a, 1u << 20);
	hash_of(4100, h);
	fill(kv, n, 4100);
	assert_int_equal(kvb_put(c, "tiny", h, KVB_F16, tokens, 0, kv, n, NULL), 0);
	assert_int_equal(kvb_get(c, "tiny", h, 0, 0, back, n, NULL), 0);
	assert_memory_equal(kv, back, n);
	assert_true(daemon_stat(c, "shm_segments") >= 2); /* the region and the client's own */
	kvb_region_free(c, region);
	free(kv);
	free(back);
	kvb_close(&c);
}

/* A small chunk: decoded into a reply buffer. */
static void test_corrupt_chunk_removed(void **state)
{
	corrupt_chunk_removed(*state, 8);
}

/* 2048 tokens, 384 KiB: served from the store's pages (zero-copy), verified first. */
static void test_corrupt_large_chunk_removed(void **state)
{
	corrupt_chunk_removed(*state, 2048);
}

/*
 * A 768 KiB chunk over TCP, its payload on a bulk connection, where each layer is
 * verified just before it is sent (docs/protocol.md#bulk-connections): a flipped byte
 * in the last of its 3 layers voids the payload with an abort record, under CURVE after
 * the first two layers' sealed record (512 KiB) went out. The GET says corrupt, the chunk is gone
 * (counted), and the same client's next GET, on the same bulk connection, is exact.
 */
static void corrupt_chunk_removed_bulk(struct daemon *d, bool curve)
{
	char keyfile[400], pub[41], cpub[41], csec[41], tcp[64];
	/* the TCP endpoint beside the harness's IPC one */
	const char *args[] = { "--max-message", "4M", "--max-tokens", "4096", "--scrub-mb-per-s",
			       "0", "--listen", tcp, curve ? "--curve-secret-key-file" : NULL,
			       keyfile, NULL };
	uint32_t tokens = 4096;
	size_t n = chunk_bytes(&tiny, tokens);
	uint8_t h[KVB_HASH_LEN], *kv = malloc(n), *back = malloc(n);
	struct kvb_connect_opts o = { .timeout_ms = 10000, .no_shm = 1 };
	kvb_client *c, *t;

	assert_non_null(kv);
	assert_non_null(back);
	put_then_corrupt(d, h, 4242, tokens, kv, n, MDB_LAST); /* its last layer */
	snprintf(tcp, sizeof(tcp), "tcp://127.0.0.1:%d", free_tcp_port());
	snprintf(keyfile, sizeof(keyfile), "%s/server.key", d->dir);
	if (curve) {
		daemon_curve_key(d, keyfile, pub);
		assert_int_equal(kvb_curve_keypair(cpub, csec), 0);
		o.server_key = pub;
		o.client_secret_key = csec;
	}
	daemon_restart(d, args);
	assert_int_equal(kvb_connect(tcp, &o, &t, NULL, 0), 0);
	assert_int_equal(kvb_get(t, "tiny", h, 0, 0, back, n, NULL), KVB_E_CORRUPT);
	/* the abort record's words, not those of a reply in frames */
	assert_non_null(strstr(kvb_last_error(t), "failed its checksum on kvblendd at"));
	assert_non_null(strstr(kvb_last_error(t), "as it was sent"));
	c = daemon_client(d, 0);
	assert_int_equal((uint64_t)daemon_stat(c, "bulk_connections"), 1);
	/* under CURVE the first two layers' sealed record went out before the abort */
	assert_int_equal((uint64_t)daemon_stat(c, "bulk_records_sealed"), curve ? 1 : 0);
	/* a sound chunk, on the same bulk connection (still in step after the abort) */
	removed_then_put(c, h, 4243, tokens, kv, n);
	memset(back, 0, n);
	assert_int_equal(kvb_get(t, "tiny", h, 0, 0, back, n, NULL), 0);
	assert_memory_equal(kv, back, n);
	assert_int_equal((uint64_t)daemon_stat(c, "bulk_connections"), 1);
	assert_true(daemon_stat(c, "bulk_bytes") >= (double)n);
	kvb_close(&t);
	kvb_close(&c);
	free(kv);
	free(back);
}

static void test_corrupt_chunk_removed_bulk(void **state)
{
	corrupt_chunk_removed_bulk(*state, false);
}

static void test_corrupt_chunk_removed_bulk_curve(void **state)
{
	corrupt_chunk_removed_bulk(*state, true);
}

struct worker_arg {
	struct daemon *d;
	int id;
	int failures;
};

static void *worker(void *p)
{
	struct worker_arg *a = p;
	kvb_client *c = daemon_client(a->d, a->id % 2);
	size_t n = chunk_bytes(&tiny, 50);
	uint8_t *kv = malloc(n), *back = malloc(n), h[KVB_HASH_LEN];

	for (uint32_t i = 0; i < 25; i++) {
		uint32_t seed = (uint32_t)a->id * 1000 + i;

		hash_of(50000 + seed, h);
		fill(kv, n, seed);
		if (kvb_put(c, "tiny", h, KVB_F16, 50, 0, kv, n, NULL) ||
		    kvb_get(c, "tiny", h, 0, 0, back, n, NULL) || memcmp(kv, back, n))
			a->failures++;
	}
	free(kv);
	free(back);
	kvb_close(&c);
	return NULL;
}

static void test_concurrent_clients(void **state)
{
	struct daemon *d = *state;
	kvb_client *c = daemon_client(d, 0);
	pthread_t t[6];
	struct worker_arg a[6];
	uint64_t before;

	register_tiny(c);
	before = (uint64_t)daemon_stat(c, "chunks");
	for (int i = 0; i < 6; i++) {
		a[i] = (struct worker_arg){ d, i, 0 };
		pthread_create(&t[i], NULL, worker, &a[i]);
	}
	for (int i = 0; i < 6; i++) {
		pthread_join(t[i], NULL);
		assert_int_equal(a[i].failures, 0);
	}
	assert_int_equal((uint64_t)daemon_stat(c, "chunks"), before + 150);
	kvb_close(&c);
}

static void test_unreachable(void **state)
{
	struct kvb_connect_opts o = { .timeout_ms = 300 };
	kvb_client *c = NULL;
	char err[256];

	(void)state;
	assert_int_equal(kvb_connect("ipc:///tmp/kvb-no-such-daemon.sock", &o, &c, err,
				     sizeof(err)), -ETIMEDOUT);
	assert_null(c);
	assert_non_null(strstr(err, "no reply from kvblendd"));
	assert_int_equal(kvb_connect("http://x", &o, &c, err, sizeof(err)), -EINVAL);
}

/*
 * STATS reads the store's kept totals: however many arrive, none walks the chunk
 * records (it did, one walk per STATS, until the totals were kept per codec),
 * and the per-codec figures follow puts and deletes.
 */
static void test_stats_no_walk(void **state)
{
	struct daemon *d = *state;
	kvb_client *c = daemon_client(d, 0);
	size_t n = chunk_bytes(&tiny, 4);
	uint8_t *kv = malloc(n), h[KVB_HASH_LEN];
	double walks;

	register_tiny(c);
	for (uint32_t i = 0; i < 20; i++) {
		hash_of(5000 + i, h);
		fill(kv, n, i);
		assert_int_equal(kvb_put(c, "tiny", h, KVB_F16, 4, 0, kv, n, NULL), 0);
	}
	assert_int_equal(kvb_delete(c, "tiny", h), 0);
	walks = daemon_stat(c, "store_chunk_walks");
	for (int i = 0; i < 50; i++)
		assert_true(daemon_stat(c, "store_dtype_chunks") == 19);
	assert_true(daemon_stat(c, "store_dtype_raw_bytes") == 19.0 * n);
	assert_true(daemon_stat(c, "store_chunk_walks") == walks);
	kvb_close(&c);
	free(kv);
}

/*
 * A reply's message is a proto3 string and must be UTF-8 (issue 55, defect 7): a GET
 * naming a model with bytes that are not (0xff 0xfe) is answered with the bytes
 * escaped as \xff\xfe, and the whole message is valid UTF-8 by the C library's own
 * decoder (C.UTF-8), as protobuf's C++ and upb parsers require; the daemon serves on.
 */
static void test_reply_message_is_utf8(void **state)
{
	struct daemon *d = *state;
	struct kvbp_request q = { .op = KVBP_OP_GET, .request_id = 9, .has_hash = true };
	char msg[KVBP_MESSAGE_MAX];
	struct raw r;
	uint32_t code;
	kvb_client *c = daemon_client(d, 1);

	assert_non_null(setlocale(LC_CTYPE, "C.UTF-8"));
	snprintf(q.model_name, sizeof(q.model_name), "bad\xff\xfe" "name\xc3\xa9");
	hash_of(9, q.hash);
	raw_open(&r, d->endpoint, 10000);
	raw_send(&r, &q, NULL, NULL, 0);
	code = raw_recv_msg(&r, msg, sizeof(msg));
	print_message("reply to a model name with bytes 0xff 0xfe: %s: %s\n",
		      kvbp_code_name(code), msg);
	assert_int_not_equal(code, KVBP_OK);
	assert_true(mbstowcs(NULL, msg, 0) != (size_t)-1);
	assert_non_null(strstr(msg, "bad\\xff\\xfename\xc3\xa9")); /* é kept as it is */
	raw_close(&r);
	assert_int_equal(kvb_ping(c, NULL, 0), 0);
	kvb_close(&c);
	setlocale(LC_CTYPE, "C");
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		daemon_test(test_roundtrip_shm),
		daemon_test(test_roundtrip_frames),
		daemon_test(test_shared_buffer),
		cmocka_unit_test(test_large_chunk_paths),
		cmocka_unit_test(test_get_heads),
		daemon_test(test_models),
		daemon_test(test_bad_input),
		daemon_test(test_message_too_large),
		cmocka_unit_test(test_shape_overflow),
		daemon_test(test_restart_keeps_chunks),
		daemon_test(test_corrupt_chunk_removed),
		daemon_test(test_scrub_removes_corrupt),
		daemon_test(test_shm_long_socket_path),
		daemon_test(test_corrupt_large_chunk_removed),
		daemon_test(test_corrupt_chunk_removed_bulk),
		daemon_test(test_corrupt_chunk_removed_bulk_curve),
		daemon_test(test_concurrent_clients),
		daemon_test(test_stats_no_walk),
		cmocka_unit_test(test_unreachable),
		daemon_test(test_reply_message_is_utf8),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
