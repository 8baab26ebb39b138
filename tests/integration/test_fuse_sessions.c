/*
 * Fuse sessions through the real kvblendd and libkvblend: every error of the
 * protocol (with the session still usable afterwards), limits, pinning, an
 * abandoned session that expires and frees its memory, and concurrent sessions
 * from several clients that must all get the same answer.
 */
#include <dlfcn.h>
#include <errno.h>
#include <lmdb.h>
#include <math.h>
#include <stdbool.h>
#include <pthread.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>
#include <xxhash.h>

#include "tests/fixture.h"
#include "tests/integration/harness.h"
#include "tests/integration/rawreq.h"

#define L 4
#define H 2
#define D 8
#define ROW (H * D * 2)

static const struct kvb_model model = TEST_MODEL_F16("fm", L, H, D);

struct fixture {
	struct daemon d;
	kvb_client *c;
	uint8_t hash[3][KVB_HASH_LEN];
	uint32_t tokens[3];
};

static int setup(void **state)
{
	struct fixture *f = calloc(1, sizeof(*f));
	const char *args[] = { "--fuse-max-sessions", "3", "--fuse-idle", "2", "--fuse-max-tokens",
			       "1000", NULL };

	f->c = daemon_start_client(&f->d, args, &model, 0);
	for (uint32_t i = 0; i < 3; i++) {
		uint32_t ids[2] = { 77, i };

		f->tokens[i] = 10 + 7 * i;
		put_test_chunk(f->c, &model, ids, 2, f->tokens[i], 0, i + 1, f->hash[i]);
	}
	*state = f;
	return 0;
}

static int teardown(void **state)
{
	struct fixture *f = *state;

	daemon_end(&f->d, &f->c);
	free(f);
	return 0;
}

/* chunk 0 at 0, 3 fresh at 10, chunk 1 at 13 (17 tokens): 30 tokens */
static size_t segments(struct fixture *f, struct kvb_segment *s)
{
	return fresh_after_first_chunk(s, f->hash, f->tokens, 2, 3);
}

static const uint32_t checks[2] = { 1, 2 };
static const double ratios[2] = { 0.5, 0.25 };

/* Run every layer of f with rows taken from a deterministic "fresh KV"; return fused layers. */
static int drive(kvb_client *c, kvb_fuse *fu, uint8_t *out_all, int32_t *sel_out, size_t *n_sel)
{
	uint32_t n = kvb_fuse_tokens(fu);
	uint8_t *k = malloc((size_t)n * ROW), *v = malloc((size_t)n * ROW);
	uint16_t *fresh = malloc((size_t)L * 2 * n * ROW);
	int rc = 0;

	fill_f16(fresh, (size_t)L * 2 * n * H * D, 999);
	for (uint32_t l = kvb_fuse_next_layer(fu); l < L && !rc; l++) {
		const int32_t *rows;
		size_t nr = kvb_fuse_rows(fu, &rows);
		int fused = 0;

		for (size_t i = 0; i < nr; i++) {
			memcpy(k + i * ROW, (uint8_t *)fresh + ((size_t)l * 2 * n + rows[i]) * ROW, ROW);
			memcpy(v + i * ROW, (uint8_t *)fresh + ((size_t)(l * 2 + 1) * n + rows[i]) * ROW,
			       ROW);
		}
		rc = kvb_fuse_layer(c, fu, l, k, v, out_all + (size_t)l * 2 * n * ROW,
				    out_all + ((size_t)l * 2 + 1) * n * ROW, &fused);
		if (!rc && fused) {
			const void *rk, *rv;

			/* In place (shared ring) the same bytes are readable without a copy. */
			if (kvb_fuse_output(fu, &rk, &rv) == 0 &&
			    (memcmp(rk, out_all + (size_t)l * 2 * n * ROW, (size_t)n * ROW) ||
			     memcmp(rv, out_all + ((size_t)l * 2 + 1) * n * ROW, (size_t)n * ROW)))
				rc = -EPROTO;
		}
	}
	if (!rc) {
		const int32_t *sel;

		*n_sel = kvb_fuse_rows(fu, &sel);
		memcpy(sel_out, sel, *n_sel * sizeof(int32_t));
	}
	free(k);
	free(v);
	free(fresh);
	return rc;
}

static void test_protocol_errors(void **state)
{
	struct fixture *f = *state;
	struct kvb_segment s[3];
	struct kvb_fuse_params p = { checks, ratios, 2, KVB_METRIC_VALUE };
	kvb_fuse *fu;
	uint8_t buf[64 * ROW], out[64 * ROW], out2[64 * ROW];
	uint8_t *all = calloc(L * 2 * 30, ROW);
	int32_t sel[64];
	size_t n_sel;
	int fused;

	assert_int_equal(kvb_fuse_open(f->c, "fm", s, segments(f, s), &p, &fu, NULL, NULL), 0);
	assert_int_equal(kvb_fuse_tokens(fu), 30);
	assert_int_equal(kvb_fuse_next_layer(fu), 1);
	memset(buf, 0, sizeof(buf));
	/* a layer before the first check layer */
	assert_int_equal(kvb_fuse_layer(f->c, fu, 0, buf, buf, out, out2, &fused),
			 KVB_E_BAD_ARGUMENT);
	assert_non_null(strstr(kvb_last_error(f->c), "before the first check layer 1"));
	/* out of order */
	assert_int_equal(kvb_fuse_layer(f->c, fu, 3, buf, buf, out, out2, &fused),
			 KVB_E_BAD_ARGUMENT);
	assert_non_null(strstr(kvb_last_error(f->c), "layer 3 out of order; the session expects "
							 "layer 1"));
	/* the session is still usable: the whole fuse runs, and gives 30 tokens' worth */
	assert_int_equal(drive(f->c, fu, all, sel, &n_sel), 0);
	/* 27 cached tokens: 0.5 -> 13, then 0.25 -> floor(6.75) = 6 cached, plus 3 fresh */
	assert_int_equal(n_sel, 6 + 3);
	assert_int_equal(sel[0] <= sel[1], 1);
	/* every layer served: another is refused */
	assert_int_equal(kvb_fuse_layer(f->c, fu, 4, buf, buf, out, out2, &fused),
			 KVB_E_BAD_ARGUMENT);
	assert_int_equal(kvb_fuse_close(f->c, &fu, NULL, NULL), 0);
	assert_null(fu);
	free(all);
}

/* segments()'s prompt as wire segments: chunk 0 at 0, 3 fresh at 10, chunk 1 at 13. */
static void raw_segments(struct fixture *f, struct kvbp_segment segs[3])
{
	memset(segs, 0, 3 * sizeof(*segs));
	memcpy(segs[0].hash, f->hash[0], KVB_HASH_LEN);
	segs[1].fresh = true;
	segs[1].count = 3;
	segs[1].pos = 10;
	memcpy(segs[2].hash, f->hash[1], KVB_HASH_LEN);
	segs[2].pos = 13;
}

/*
 * A FUSE_OPEN of segments()'s prompt as a raw request (check layer 1, r 0.5, model "fm";
 * the test may change it before sending it): the request and what it points into.
 */
struct raw_prompt_open {
	struct kvbp_segment segs[3];
	uint32_t check;
	double ratio;
	struct kvbp_request q;
};

static void raw_prompt_open_init(struct fixture *f, struct raw_prompt_open *o)
{
	raw_segments(f, o->segs);
	o->check = 1;
	o->ratio = 0.5;
	raw_fuse_open_request(&o->q, "fm", o->segs, 3, &o->check, &o->ratio, 1);
}

/* Wrong numbers of fresh rows and frames, sent as raw requests: clear errors, session usable. */
static void test_wrong_rows(void **state)
{
	struct fixture *f = *state;
	struct raw r;
	struct kvbp_reply rep;
	struct raw_prompt_open o;
	struct kvbp_request q;
	uint8_t *zeros = calloc(30, ROW);
	const void *pl[2] = { zeros, zeros };
	size_t len[2] = { 30 * ROW, 30 * ROW };
	uint64_t sid = 0;
	char msg[256];

	raw_open(&r, f->d.endpoint, 10000);
	raw_prompt_open_init(f, &o);
	assert_int_equal(raw_call(&r, &o.q, NULL, NULL, 0, &rep), KVBP_OK);
	sid = rep.session_id;
	/* the reply carries the session's model, as the client named it: no lookup needed */
	assert_int_equal(rep.n_models, 1);
	assert_string_equal(rep.models[0].name, "fm");
	assert_int_equal(rep.models[0].desc.num_layers, L);
	assert_int_equal(rep.models[0].desc.num_kv_heads, H);
	assert_int_equal(rep.models[0].desc.head_dim, D);
	assert_int_equal(rep.models[0].desc.dtype, KVB_F16);
	kvbp_reply_clear(&rep);
	assert_true(sid != 0);
	q = (struct kvbp_request){ .op = KVBP_OP_FUSE_LAYER, .session_id = sid, .layer = 1,
				   .rows = 29 };
	assert_int_equal(raw_call_msg(&r, &q, pl, len, 2, msg, sizeof(msg)), KVBP_BAD_SHAPE);
	assert_non_null(strstr(msg, "takes fresh K and V for 30 tokens (all of them); the request "
				    "declares 29"));
	q.rows = 30;
	len[1] = 29 * ROW;
	assert_int_equal(raw_call_msg(&r, &q, pl, len, 2, msg, sizeof(msg)), KVBP_BAD_SHAPE);
	assert_non_null(strstr(msg, "fresh V is 928 bytes; expected 960"));
	assert_int_equal(raw_call_msg(&r, &q, pl, len, 1, msg, sizeof(msg)), KVBP_BAD_FRAMES);
	assert_non_null(strstr(msg, "takes 2 payload frames"));
	q.session_id = sid + 1;
	len[1] = 30 * ROW;
	assert_int_equal(raw_call_msg(&r, &q, pl, len, 2, msg, sizeof(msg)), KVBP_UNKNOWN_SESSION);
	/* the session is still usable with the right request */
	q.session_id = sid;
	assert_int_equal(raw_call_msg(&r, &q, pl, len, 2, msg, sizeof(msg)), KVBP_OK);
	q = (struct kvbp_request){ .op = KVBP_OP_FUSE_CLOSE, .session_id = sid };
	assert_int_equal(raw_call_msg(&r, &q, NULL, NULL, 0, msg, sizeof(msg)), KVBP_OK);
	raw_close(&r);
	free(zeros);
}

/*
 * The attention metric's A on the wire (issue 24), sent raw: a size that is not chunk
 * tokens x kv heads x 4, NaN, A with no frame, A for another metric or at the open, an
 * unknown metric, recompute with check layers: each refused by name, and the session
 * takes the right request afterwards.
 */
static void test_attention_wire(void **state)
{
	struct fixture *f = *state;
	struct raw r;
	struct kvbp_reply rep;
	int32_t rec[1] = { 2 };
	struct raw_prompt_open o;
	struct kvbp_request *open = &o.q;
	struct kvbp_request q;
	uint8_t *zeros = calloc(30, ROW);
	float a[27 * H + 1];
	const void *pl[3] = { zeros, zeros, a };
	size_t len[3] = { 30 * ROW, 30 * ROW, sizeof(float) * 27 * H };
	uint64_t sid, vsid;
	char msg[256];

	for (size_t i = 0; i < 27 * H; i++)
		a[i] = (float)(i % 5);
	raw_open(&r, f->d.endpoint, 10000);
	raw_prompt_open_init(f, &o);
	open->metric = 3;
	assert_int_equal(raw_call_msg(&r, open, NULL, NULL, 0, msg, sizeof(msg)),
			 KVBP_BAD_ARGUMENT);
	assert_non_null(strstr(msg, "metric 3 unknown; expected 0 (value), 1 (key) or 2 "
				    "(attention)"));
	open->attention = true;
	open->metric = KVBP_METRIC_ATTENTION;
	assert_int_equal(raw_call_msg(&r, open, NULL, NULL, 0, msg, sizeof(msg)),
			 KVBP_BAD_ARGUMENT);
	assert_non_null(strstr(msg, "not with the open"));
	open->attention = false;
	open->recompute = rec;
	open->n_recompute = 1;
	assert_int_equal(raw_call_msg(&r, open, NULL, NULL, 0, msg, sizeof(msg)),
			 KVBP_BAD_ARGUMENT);
	assert_non_null(strstr(msg, "recompute names the tokens of a session without check "
				    "layers"));
	open->recompute = NULL;
	open->n_recompute = 0;
	assert_int_equal(raw_call(&r, open, NULL, NULL, 0, &rep), KVBP_OK);
	sid = rep.session_id;
	kvbp_reply_clear(&rep);
	open->metric = KVBP_METRIC_VALUE;
	assert_int_equal(raw_call(&r, open, NULL, NULL, 0, &rep), KVBP_OK);
	vsid = rep.session_id;
	kvbp_reply_clear(&rep);

	q = (struct kvbp_request){ .op = KVBP_OP_FUSE_LAYER, .session_id = sid, .layer = 1,
				   .rows = 30, .attention = true };
	/* K and V only: the last frame (V) is taken for A, and its size is wrong */
	assert_int_equal(raw_call_msg(&r, &q, pl, len, 2, msg, sizeof(msg)), KVBP_BAD_SHAPE);
	assert_non_null(strstr(msg, "A is 960 bytes; expected 216 (float32, chunk tokens x kv "
				    "heads)"));
	len[2] = 215;
	assert_int_equal(raw_call_msg(&r, &q, pl, len, 3, msg, sizeof(msg)), KVBP_BAD_SHAPE);
	assert_non_null(strstr(msg, "A is 215 bytes; expected 216"));
	len[2] = sizeof(float) * 27 * H;
	assert_int_equal(raw_call_msg(&r, &q, NULL, NULL, 0, msg, sizeof(msg)), KVBP_BAD_FRAMES);
	assert_non_null(strstr(msg, "carries A but has no payload frame"));
	a[2 * H + 1] = NAN;
	assert_int_equal(raw_call_msg(&r, &q, pl, len, 3, msg, sizeof(msg)), KVBP_BAD_ARGUMENT);
	assert_non_null(strstr(msg, "A[token 2, head 1] is nan: attention weights must be finite "
				    "and >= 0"));
	a[2 * H + 1] = 1;
	/* no A at all: the check layer cannot score */
	q.attention = false;
	assert_int_equal(raw_call_msg(&r, &q, pl, len, 2, msg, sizeof(msg)), KVBP_BAD_ARGUMENT);
	assert_non_null(strstr(msg, "the attention metric needs A (float32 [27 chunk tokens, 2 kv "
				    "heads])"));
	/* A to a session of the value metric */
	q.session_id = vsid;
	q.attention = true;
	assert_int_equal(raw_call_msg(&r, &q, pl, len, 3, msg, sizeof(msg)), KVBP_BAD_ARGUMENT);
	assert_non_null(strstr(msg, "only by a session opened with the attention metric"));
	/* the right request: selection of floor(0.5 x 27) = 13 cached tokens + 3 fresh */
	q.session_id = sid;
	assert_int_equal(raw_call(&r, &q, pl, len, 3, &rep), KVBP_OK);
	assert_true(rep.has_selection);
	assert_int_equal(rep.n_selection, 13 + 3);
	kvbp_reply_clear(&rep);
	for (int i = 0; i < 2; i++) {
		q = (struct kvbp_request){ .op = KVBP_OP_FUSE_CLOSE, .session_id = i ? vsid : sid };
		assert_int_equal(raw_call_msg(&r, &q, NULL, NULL, 0, msg, sizeof(msg)), KVBP_OK);
	}
	raw_close(&r);
	free(zeros);
}

static void test_open_errors(void **state)
{
	struct fixture *f = *state;
	struct kvb_segment s[3];
	struct kvb_fuse_params p = { checks, ratios, 2, KVB_METRIC_VALUE };
	uint8_t(*missing)[KVB_HASH_LEN] = NULL;
	size_t n_missing = 0;
	kvb_fuse *fu = NULL;
	uint32_t bad_checks[2] = { 2, 1 }, big_check[1] = { 9 };
	double up[2] = { 0.1, 0.5 }, one[1] = { 0.3 };
	struct kvb_fuse_params q;

	/* Missing chunks: the list names exactly the missing ones. */
	segments(f, s);
	s[0].hash[0] ^= 1;
	s[2].hash[5] ^= 1;
	assert_int_equal(kvb_fuse_open(f->c, "fm", s, 3, &p, &fu, &missing, &n_missing),
			 KVB_E_NOT_FOUND);
	assert_null(fu);
	assert_int_equal(n_missing, 2);
	assert_memory_equal(missing[0], s[0].hash, KVB_HASH_LEN);
	assert_memory_equal(missing[1], s[2].hash, KVB_HASH_LEN);
	free(missing);
	segments(f, s);
	q = (struct kvb_fuse_params){ bad_checks, ratios, 2, KVB_METRIC_VALUE };
	assert_int_equal(kvb_fuse_open(f->c, "fm", s, 3, &q, &fu, NULL, NULL), KVB_E_BAD_ARGUMENT);
	assert_non_null(strstr(kvb_last_error(f->c), "check layers must increase"));
	q = (struct kvb_fuse_params){ checks, up, 2, KVB_METRIC_VALUE };
	assert_int_equal(kvb_fuse_open(f->c, "fm", s, 3, &q, &fu, NULL, NULL), KVB_E_BAD_ARGUMENT);
	assert_non_null(strstr(kvb_last_error(f->c), "ratios must not increase"));
	q = (struct kvb_fuse_params){ big_check, one, 1, KVB_METRIC_VALUE };
	assert_int_equal(kvb_fuse_open(f->c, "fm", s, 3, &q, &fu, NULL, NULL), KVB_E_BAD_ARGUMENT);
	assert_non_null(strstr(kvb_last_error(f->c), "check layer 9 is not a layer"));
	q = (struct kvb_fuse_params){ checks, ratios, 2, (enum kvb_metric)7 };
	assert_int_equal(kvb_fuse_open(f->c, "fm", s, 3, &q, &fu, NULL, NULL), KVB_E_BAD_ARGUMENT);
	s[1].count = 0;
	assert_int_equal(kvb_fuse_open(f->c, "fm", s, 3, &p, &fu, NULL, NULL), KVB_E_BAD_SHAPE);
	assert_non_null(strstr(kvb_last_error(f->c), "fresh segment of 0 tokens"));
	/* Too many tokens for fuse_max_tokens (1000 here). */
	segments(f, s);
	s[1].count = 990;
	assert_int_equal(kvb_fuse_open(f->c, "fm", s, 3, &p, &fu, NULL, NULL), KVB_E_LIMIT);
	assert_non_null(strstr(kvb_last_error(f->c), "fuse_max_tokens"));
	/* unknown model, unknown session */
	segments(f, s);
	assert_int_equal(kvb_fuse_open(f->c, "nope", s, 3, &p, &fu, NULL, NULL),
			 KVB_E_UNKNOWN_MODEL);
	assert_int_equal((uint64_t)daemon_stat(f->c, "fuse_sessions"), 0);
	assert_int_equal((uint64_t)daemon_stat(f->c, "fuse_pinned_chunks"), 0);
}

static void test_limits_and_pins(void **state)
{
	struct fixture *f = *state;
	struct kvb_segment s[3];
	struct kvb_fuse_params p = { checks, ratios, 2, KVB_METRIC_VALUE };
	kvb_fuse *fu[4] = { 0 };

	segments(f, s);
	for (int i = 0; i < 3; i++)
		assert_int_equal(kvb_fuse_open(f->c, "fm", s, 3, &p, &fu[i], NULL, NULL), 0);
	assert_int_equal(kvb_fuse_open(f->c, "fm", s, 3, &p, &fu[3], NULL, NULL), KVB_E_LIMIT);
	assert_non_null(strstr(kvb_last_error(f->c), "fuse_max_sessions"));
	assert_int_equal((uint64_t)daemon_stat(f->c, "fuse_sessions"), 3);
	/* A chunk under an open session cannot be deleted. */
	assert_int_equal(kvb_delete(f->c, "fm", f->hash[0]), KVB_E_BUSY);
	assert_non_null(strstr(kvb_last_error(f->c), "in use by an open fuse session"));
	for (int i = 0; i < 3; i++)
		assert_int_equal(kvb_fuse_close(f->c, &fu[i], NULL, NULL), 0);
	assert_int_equal((uint64_t)daemon_stat(f->c, "fuse_pinned_chunks"), 0);
	assert_int_equal((uint64_t)daemon_stat(f->c, "fuse_ring_bytes"), 0);
	/* closed twice: the second close finds nothing */
	{
		kvb_fuse *g;

		assert_int_equal(kvb_fuse_open(f->c, "fm", s, 3, &p, &g, NULL, NULL), 0);
		assert_int_equal(kvb_fuse_close(f->c, &g, NULL, NULL), 0);
	}
	assert_int_equal(kvb_delete(f->c, "fm", f->hash[2]), 0);
}

static void test_abandoned_session_expires(void **state)
{
	struct fixture *f = *state;
	struct kvb_segment s[3];
	struct kvb_fuse_params p = { checks, ratios, 2, KVB_METRIC_VALUE };
	kvb_fuse *fu;
	uint8_t buf[30 * ROW], o1[30 * ROW], o2[30 * ROW];
	int fused;

	segments(f, s);
	assert_int_equal(kvb_fuse_open(f->c, "fm", s, 3, &p, &fu, NULL, NULL), 0);
	assert_int_equal((uint64_t)daemon_stat(f->c, "fuse_sessions"), 1);
	assert_true((uint64_t)daemon_stat(f->c, "fuse_ring_bytes") > 0);
	assert_int_equal((uint64_t)daemon_stat(f->c, "fuse_pinned_chunks"), 2);
	sleep(4); /* fuse_idle is 2 s; the main loop checks every second */
	assert_int_equal((uint64_t)daemon_stat(f->c, "fuse_sessions"), 0);
	assert_int_equal((uint64_t)daemon_stat(f->c, "fuse_ring_bytes"), 0);
	assert_int_equal((uint64_t)daemon_stat(f->c, "fuse_pinned_chunks"), 0);
	memset(buf, 0, sizeof(buf));
	assert_int_equal(kvb_fuse_layer(f->c, fu, 1, buf, buf, o1, o2, &fused),
			 KVB_E_UNKNOWN_SESSION);
	assert_int_equal(kvb_fuse_close(f->c, &fu, NULL, NULL), KVB_E_UNKNOWN_SESSION);
	/* its chunks can be deleted now */
	assert_int_equal(kvb_delete(f->c, "fm", f->hash[1]), 0);
}

struct runner {
	struct fixture *f;
	int no_shm;
	uint8_t *out;
	int32_t sel[64];
	size_t n_sel;
	int rc;
};

static void *run_one(void *arg)
{
	struct runner *r = arg;
	kvb_client *c = daemon_client(&r->f->d, r->no_shm);
	struct kvb_segment s[3];
	struct kvb_fuse_params p = { checks, ratios, 2, KVB_METRIC_VALUE };
	kvb_fuse *fu;

	for (int rep = 0; rep < 5 && !r->rc; rep++) {
		r->rc = kvb_fuse_open(c, "fm", s, segments(r->f, s), &p, &fu, NULL, NULL);
		if (!r->rc)
			r->rc = drive(c, fu, r->out, r->sel, &r->n_sel);
		if (!r->rc)
			r->rc = kvb_fuse_close(c, &fu, NULL, NULL);
	}
	kvb_close(&c);
	return NULL;
}

static void test_concurrent_sessions(void **state)
{
	struct fixture *f = *state;
	pthread_t t[3];
	struct runner r[3];

	for (int i = 0; i < 3; i++) {
		r[i] = (struct runner){ f, i == 1, calloc(L * 2 * 30, ROW) };
		pthread_create(&t[i], NULL, run_one, &r[i]);
	}
	for (int i = 0; i < 3; i++)
		pthread_join(t[i], NULL);
	for (int i = 0; i < 3; i++) {
		assert_int_equal(r[i].rc, 0);
		assert_int_equal(r[i].n_sel, r[0].n_sel);
		assert_memory_equal(r[i].sel, r[0].sel, r[0].n_sel * sizeof(int32_t));
		/* fused layers from the second check layer on */
		assert_memory_equal(r[i].out + 2 * 2 * 30 * ROW, r[0].out + 2 * 2 * 30 * ROW,
				    (L - 2) * 2 * 30 * ROW);
		free(r[i].out);
	}
	assert_int_equal((uint64_t)daemon_stat(f->c, "fuse_sessions"), 0);
}

/*
 * An ordinary model shape (issue 7): 8 KV heads x 128 bf16, three check layers
 * narrowing the selection to a few rows. The fresh rows of the later check
 * layers come in frames of a few KiB, which ZeroMQ may hand over at any address,
 * and a client's shared buffer may sit at any offset: the daemon must give the
 * same bits as through aligned memory (under UBSan a typed load at an odd
 * address aborts it).
 */
#define WL 6
#define WH 8
#define WD 128
#define WROW (WH * WD * 2)

/* Keeps the first two payload frames of 30 rows (layer 3's K and V) at arg. */
static void keep_fused(size_t index, const void *data, size_t size, void *arg)
{
	if (index < 2 && size == 30 * ROW)
		memcpy((uint8_t *)arg + index * size, data, size);
}

/*
 * One raw session driven through layers 1..3 with deterministic fresh rows; with dv,
 * asking for the device ring (FUSE_OPEN) and the layers kept there (layers 1 and 2).
 * Returns the first FUSE_LAYER code that is not ok; sels gets the selections of
 * layers 1 and 2, fused the K and V frames of layer 3, *exported whether the open's
 * reply carried a handle.
 */
static uint32_t raw_session(struct fixture *f, struct raw *r, bool dv, int32_t sels[2][32],
			    size_t n_sels[2], uint8_t *fused, bool *exported, char *msg)
{
	struct kvbp_segment segs[3] = { 0 };
	uint32_t ck[2] = { 1, 2 }, rows = 30;
	double rt[2] = { 0.5, 0.25 };
	struct kvbp_request q;
	struct kvbp_reply rep;
	uint16_t *fresh = malloc(2 * 30 * ROW);
	uint64_t sid = 0;
	uint32_t code = KVBP_OK;
	char err[256];

	raw_segments(f, segs);
	raw_fuse_open_request(&q, "fm", segs, 3, ck, rt, 2);
	q.device_out = dv;
	for (uint32_t l = 0; l <= 3 && code == KVBP_OK; l++) {
		const void *pl[2] = { fresh, (uint8_t *)fresh + (size_t)rows * ROW };
		size_t len[2] = { (size_t)rows * ROW, (size_t)rows * ROW }, n_frames = 0;

		if (l) {
			fill_f16(fresh, (size_t)2 * rows * H * D, 40 + l);
			q = (struct kvbp_request){ .op = KVBP_OP_FUSE_LAYER, .session_id = sid,
						   .layer = l, .rows = rows,
						   .device_out = dv && l < 3 };
		}
		raw_send(r, &q, pl, len, l ? 2 : 0);
		code = raw_recv_frames(r, &rep, &n_frames, l == 3 ? keep_fused : NULL, fused);
		snprintf(msg, 256, "%s", rep.message);
		if (code == KVBP_OK && !l) {
			sid = rep.session_id;
			*exported = rep.has_ipc;
			if (rep.has_ipc)
				assert_string_equal(rep.device_pci, "emulated");
		} else if (code == KVBP_OK) {
			/* Layers kept on the device come with no frames; the others with K and V. */
			assert_int_equal(n_frames, l == 1 || (dv && l < 3) ? 0 : 2);
			if (l < 3) {
				assert_true(rep.n_selection <= 32);
				memcpy(sels[l - 1], rep.selection, rep.n_selection * sizeof(int32_t));
				n_sels[l - 1] = rep.n_selection;
			}
			rows = (uint32_t)rep.rows_next;
		}
		kvbp_reply_clear(&rep);
	}
	if (sid) {
		q = (struct kvbp_request){ .op = KVBP_OP_FUSE_CLOSE, .session_id = sid };
		assert_int_equal(raw_call_msg(r, &q, NULL, NULL, 0, err, sizeof(err)), KVBP_OK);
	}
	free(fresh);
	return code;
}

/*
 * device_out through raw requests. A daemon on the emulated device exports the ring
 * (a handle nothing can map) and keeps layers there when asked: the selections and
 * the fused layer after them equal a session's that never asked (with the export's
 * zeroing of the block before the rotation tables went in). A daemon on the CPU
 * exports nothing and refuses a layer kept on the device, naming why.
 */
static void raw_device_out(struct fixture *f, bool emulated)
{
	struct raw r;
	int32_t sels[2][2][32];
	size_t n_sels[2][2];
	uint8_t *fused = calloc(4, 30 * ROW);
	bool exported[2] = { false, false };
	char msg[256];

	raw_open(&r, f->d.endpoint, 10000);
	assert_int_equal(raw_session(f, &r, false, sels[0], n_sels[0], fused, &exported[0], msg),
			 KVBP_OK);
	assert_false(exported[0]);
	if (emulated) {
		assert_int_equal(raw_session(f, &r, true, sels[1], n_sels[1], fused + 60 * ROW,
					     &exported[1], msg), KVBP_OK);
		assert_true(exported[1]);
		for (int i = 0; i < 2; i++) {
			assert_int_equal(n_sels[1][i], n_sels[0][i]);
			assert_memory_equal(sels[1][i], sels[0][i], n_sels[0][i] * sizeof(int32_t));
		}
		assert_memory_equal(fused + 60 * ROW, fused, 60 * ROW);
	} else {
		assert_int_equal(raw_session(f, &r, true, sels[1], n_sels[1], fused + 60 * ROW,
					     &exported[1], msg), KVBP_BAD_ARGUMENT);
		assert_false(exported[1]);
		assert_non_null(strstr(msg, "device_out: this session's ring is not exported"));
	}
	raw_close(&r);
	free(fused);
}

/*
 * Copy n bytes of device memory (a pointer kvb_fuse_output_device() gave) to host,
 * through the NVIDIA driver loaded here as the client library loads it. 0 or -1.
 */
static int device_to_host(void *dst, const void *src, size_t n)
{
	static void *lib;
	static int (*init)(unsigned), (*dev_get)(int *, int), (*retain)(void **, int);
	static int (*push)(void *), (*pop)(void **), (*copy)(void *, unsigned long long, size_t);
	void *ctx, *popped;
	int dev, rc;

	if (!lib) {
		lib = dlopen("libcuda.so.1", RTLD_NOW);
		if (!lib)
			return -1;
		*(void **)&init = dlsym(lib, "cuInit");
		*(void **)&dev_get = dlsym(lib, "cuDeviceGet");
		*(void **)&retain = dlsym(lib, "cuDevicePrimaryCtxRetain");
		*(void **)&push = dlsym(lib, "cuCtxPushCurrent_v2");
		*(void **)&pop = dlsym(lib, "cuCtxPopCurrent_v2");
		*(void **)&copy = dlsym(lib, "cuMemcpyDtoH_v2");
		if (!init || !dev_get || !retain || !push || !pop || !copy || init(0))
			return -1;
	}
	/* The daemon's device is device 0 (gpu_run.sh); the mapping is in its primary context. */
	if (dev_get(&dev, 0) || retain(&ctx, dev) || push(ctx))
		return -1;
	rc = copy(dst, (unsigned long long)(uintptr_t)src, n) ? -1 : 0;
	pop(&popped);
	return rc;
}

/*
 * Fused layers on the GPU (CUDA IPC): with a daemon on a CUDA device and a driver
 * here, the session maps the daemon's device ring and the layers left there equal,
 * bit for bit, those another session gets in host memory. Without a driver,
 * kvb_fuse_device() says so and sessions keep working in host memory; with a daemon
 * not on a CUDA device, the session is not on the device and a raw request asking
 * for device output is refused, naming why.
 */
static void test_device_output(void **state)
{
	struct fixture *f = *state;
	struct kvb_segment s[3];
	struct kvb_fuse_params p = { checks, ratios, 2, KVB_METRIC_VALUE };
	const char *dev = getenv("KVBLEND_TEST_DEVICE");
	bool on_cuda = dev && !strncmp(dev, "cuda", 4);
	kvb_client *c = daemon_client(&f->d, 0);
	size_t layer = (size_t)2 * 30 * ROW, n_sel, n_sel2;
	uint8_t *want = calloc(L, layer), *got = calloc(L, layer);
	int32_t sel[64], sel2[64];
	kvb_fuse *fu;
	int rc = kvb_fuse_device(c);
	void *dk, *dv;

	/* The reference: host memory. */
	assert_int_equal(kvb_fuse_open(f->c, "fm", s, segments(f, s), &p, &fu, NULL, NULL), 0);
	assert_int_equal(drive(f->c, fu, want, sel, &n_sel), 0);
	assert_int_equal(kvb_fuse_close(f->c, &fu, NULL, NULL), 0);
	if (rc) {
		assert_int_equal(rc, -ENODEV);
		assert_non_null(strstr(kvb_last_error(c), "fused layers on the GPU: "));
		assert_false(on_cuda); /* the GPU suite runs where there is a driver */
	}
	assert_int_equal(kvb_fuse_open(c, "fm", s, segments(f, s), &p, &fu, NULL, NULL), 0);
	assert_int_equal(kvb_fuse_on_device(fu), rc == 0 && on_cuda);
	if (!kvb_fuse_on_device(fu)) {
		assert_int_equal(kvb_fuse_output_device(fu, &dk, &dv), -ENODATA);
		assert_int_equal(drive(c, fu, got, sel2, &n_sel2), 0);
	} else {
		uint32_t n = kvb_fuse_tokens(fu);
		uint16_t *fresh = malloc((size_t)L * 2 * n * ROW);
		uint8_t *k = malloc((size_t)n * ROW), *v = malloc((size_t)n * ROW);
		const int32_t *rows;

		/* drive()'s rows, with no host buffers: every fused layer stays on the device */
		fill_f16(fresh, (size_t)L * 2 * n * H * D, 999);
		for (uint32_t l = kvb_fuse_next_layer(fu); l < L; l++) {
			size_t nr = kvb_fuse_rows(fu, &rows);
			int fused = 0;

			for (size_t i = 0; i < nr; i++) {
				memcpy(k + i * ROW, (uint8_t *)fresh + ((size_t)l * 2 * n + rows[i]) * ROW,
				       ROW);
				memcpy(v + i * ROW,
				       (uint8_t *)fresh + ((size_t)(l * 2 + 1) * n + rows[i]) * ROW, ROW);
			}
			assert_int_equal(kvb_fuse_layer(c, fu, l, k, v, NULL, NULL, &fused), 0);
			if (!fused) {
				memcpy(got + l * layer, want + l * layer, layer); /* no output */
				continue;
			}
			assert_int_equal(kvb_fuse_output_device(fu, &dk, &dv), 0);
			assert_int_equal(device_to_host(got + l * layer, dk, layer / 2), 0);
			assert_int_equal(device_to_host(got + l * layer + layer / 2, dv, layer / 2), 0);
		}
		n_sel2 = kvb_fuse_rows(fu, &rows);
		memcpy(sel2, rows, n_sel2 * sizeof(int32_t));
		free(fresh);
		free(k);
		free(v);
	}
	assert_int_equal(n_sel2, n_sel);
	assert_memory_equal(sel2, sel, n_sel * sizeof(int32_t));
	assert_memory_equal(got + layer * 2, want + layer * 2, layer * (L - 2));
	assert_int_equal(kvb_fuse_close(c, &fu, NULL, NULL), 0);
	if (!on_cuda)
		raw_device_out(f, dev && !strcmp(dev, "emulated"));
	kvb_close(&c);
	free(want);
	free(got);
}

static void fill_bf16(uint16_t *p, size_t n, uint32_t seed)
{
	uint32_t x = seed * 2654435761u + 7;

	for (size_t i = 0; i < n; i++) {
		x = x * 1103515245u + 12345u;
		/* sign, exponent 125..128, random mantissa: magnitudes 2^-2..2^1 */
		p[i] = (uint16_t)((x >> 31) << 15 | (125 + (x >> 28 & 3)) << 7 | (x >> 8 & 0x7f));
	}
}

static int drive_wide(kvb_client *c, kvb_fuse *fu, const uint8_t *fresh, uint8_t *out_all,
		      int32_t *sel_out, size_t *n_sel)
{
	uint32_t n = kvb_fuse_tokens(fu);
	uint8_t *k = malloc((size_t)n * WROW), *v = malloc((size_t)n * WROW);
	int rc = 0;

	for (uint32_t l = kvb_fuse_next_layer(fu); l < WL && !rc; l++) {
		const int32_t *rows;
		size_t nr = kvb_fuse_rows(fu, &rows);
		int fused = 0;

		for (size_t i = 0; i < nr; i++) {
			memcpy(k + i * WROW, fresh + ((size_t)l * 2 * n + rows[i]) * WROW, WROW);
			memcpy(v + i * WROW, fresh + ((size_t)(l * 2 + 1) * n + rows[i]) * WROW,
			       WROW);
		}
		rc = kvb_fuse_layer(c, fu, l, k, v, out_all + (size_t)l * 2 * n * WROW,
				    out_all + ((size_t)l * 2 + 1) * n * WROW, &fused);
	}
	if (!rc) {
		const int32_t *sel;

		*n_sel = kvb_fuse_rows(fu, &sel);
		memcpy(sel_out, sel, *n_sel * sizeof(int32_t));
	}
	free(k);
	free(v);
	return rc;
}

static void test_wide_bf16_unaligned(void **state)
{
	static const struct kvb_model wide = { .name = "wide", .num_layers = WL,
					       .num_kv_heads = WH, .head_dim = WD,
					       .dtype = KVB_BF16, .rope_theta = 1e6 };
	/* 40 cached tokens: 8 rows, then 2, then 1 (frames of 16, 4 and 2 KiB) */
	static const uint32_t wchecks[3] = { 1, 2, 3 };
	static const double wratios[3] = { 0.2, 0.05, 0.025 };
	struct kvb_fuse_params p = { wchecks, wratios, 3, KVB_METRIC_VALUE };
	struct fixture *f = *state;
	const uint32_t T[2] = { 24, 16 }, n = 40;
	uint8_t hash[2][KVB_HASH_LEN], *shared, *ref, *fresh, *out[2];
	kvb_client *plain = daemon_client(&f->d, 1); /* frames only, no shared memory */
	size_t bytes = (size_t)WL * 2 * T[0] * WROW, n_sel[2];
	int32_t sel[2][64];

	assert_int_equal(kvb_model_register(f->c, &wide, NULL), 0);
	for (uint32_t i = 0; i < 2; i++) {
		uint32_t ids[2] = { 88, i };
		size_t elems = (size_t)WL * 2 * T[i] * WH * WD;
		uint16_t *kv = malloc(elems * 2);

		fill_bf16(kv, elems, 40 + i);
		kvb_chunk_hash(ids, 2, hash[i]);
		assert_int_equal(kvb_put(f->c, "wide", hash[i], KVB_BF16, T[i], 0, kv, elems * 2,
					 NULL), 0);
		free(kv);
	}
	/* The same fuse through shared memory and through frames: the same bits. */
	fresh = malloc((size_t)WL * 2 * n * WROW);
	fill_bf16((uint16_t *)fresh, (size_t)WL * 2 * n * WH * WD, 999);
	for (int i = 0; i < 2; i++) {
		kvb_client *c = i ? plain : f->c;
		struct kvb_segment s[2] = { { 0 } };
		kvb_fuse *fu;

		memcpy(s[0].hash, hash[0], KVB_HASH_LEN);
		memcpy(s[1].hash, hash[1], KVB_HASH_LEN);
		s[1].pos = T[0];
		out[i] = calloc((size_t)WL * 2 * n, WROW);
		assert_int_equal(kvb_fuse_open(c, "wide", s, 2, &p, &fu, NULL, NULL), 0);
		assert_int_equal(drive_wide(c, fu, fresh, out[i], sel[i], &n_sel[i]), 0);
		assert_int_equal(kvb_fuse_close(c, &fu, NULL, NULL), 0);
	}
	assert_int_equal(n_sel[0], 1);
	assert_int_equal(n_sel[1], 1);
	assert_int_equal(sel[0][0], sel[1][0]);
	/* fused layers from the second check layer on */
	assert_memory_equal(out[0] + 2 * 2 * (size_t)n * WROW, out[1] + 2 * 2 * (size_t)n * WROW,
			    (WL - 2) * 2 * (size_t)n * WROW);
	free(out[0]);
	free(out[1]);
	free(fresh);

	/* GET re-rotated straight into a shared buffer at an odd offset. */
	ref = malloc(bytes);
	shared = kvb_shared_buffer(f->c, bytes + 1);
	assert_non_null(shared);
	assert_int_equal(kvb_get_rerotated(plain, "wide", hash[0], 0, 0, 100, ref, bytes, NULL), 0);
	assert_int_equal(kvb_get_rerotated(f->c, "wide", hash[0], 0, 0, 100, shared + 1, bytes,
					   NULL), 0);
	assert_memory_equal(shared + 1, ref, bytes);
	free(ref);
	kvb_close(&plain);
}

/* ---- a quantized chunk laid out other than one row per token (issue 55, defect 4) ---- */

#define QT 16 /* tokens of the chunk */
#define QC (H * D) /* channels of a token */

static const struct kvb_model qmodel = { .name = "fq", .num_layers = L, .num_kv_heads = H,
					 .head_dim = D, .dtype = KVB_F16, .rope_theta = 10000,
					 .store_codec = KVB_STORE_INT8 };

static void put_le(uint8_t *p, uint64_t v, int n)
{
	for (int i = 0; i < n; i++)
		p[i] = (uint8_t)(v >> (8 * i));
}

/*
 * One encoded tensor as docs/storage.md describes it ("Encoded tensor", "Quantized
 * storage"), written here from the page: int8 codes of a rows x channels layout, scales
 * along axis (0 per channel, 1 per row), every scale 2^-7, so that the same codes in
 * any layout of the same size decode to the same values. The codes come from seed in
 * row-major order. Returns the encoded length (header and payload).
 */
static size_t int8_tensor(uint8_t *out, uint32_t rows, uint32_t channels, int axis,
			  uint32_t seed)
{
	uint8_t *p = out + 32;
	size_t ns = axis ? rows : channels, len = 16 + 4 * ns + (size_t)rows * channels;
	uint32_t x = seed * 2654435761u + 1;

	memset(p, 0, 16);
	put_le(p, rows, 4);
	put_le(p + 4, channels, 4);
	p[8] = (uint8_t)axis;
	p[9] = 1;  /* decoded dtype f16 */
	p[12] = 2; /* int8 */
	for (size_t i = 0; i < ns; i++)
		put_le(p + 16 + 4 * i, 0x3c000000u, 4); /* 2^-7 as an f32 */
	for (size_t i = 0; i < (size_t)rows * channels; i++) {
		x = x * 1103515245u + 12345u;
		p[16 + 4 * ns + i] = (uint8_t)(int8_t)((int)(x >> 16 & 0xff) % 201 - 100);
	}
	memcpy(out, "KVBT", 4);
	out[4] = 1; /* format version */
	out[5] = 2; /* quantized */
	out[6] = 2; /* f16 */
	out[7] = 0;
	put_le(out + 8, (uint64_t)rows * channels * 2, 8);
	put_le(out + 16, len, 8);
	put_le(out + 24, XXH3_64bits(p, len), 8);
	return 32 + len;
}

/* The layer records of a chunk: K then V per layer, each tensor the token rows of the
 * model (one row per token) unless k_rows or v_rows says otherwise (QC x QT elements). */
struct qchunk {
	uint8_t buf[L][2][32 + 16 + 4 * 2 * QT + 2 * QT * QC];
	const void *frames[L];
	size_t lens[L];
};

static void qchunk_make(struct qchunk *q, uint32_t k_rows, uint32_t v_rows)
{
	for (uint32_t l = 0; l < L; l++) {
		size_t k = int8_tensor(q->buf[l][0], k_rows, QT * QC / k_rows, 0, 10 * l + 1);
		size_t v = int8_tensor(q->buf[l][0] + k, v_rows, QT * QC / v_rows, 1, 10 * l + 2);

		q->frames[l] = q->buf[l][0];
		q->lens[l] = k + v;
	}
}

/* REPLICATE of q's layer records as chunk hash of fq (QT tokens at 0), as a member sends
 * it; the reply's code and message. */
static uint32_t qreplicate(const struct daemon *d, const uint8_t *hash, const struct qchunk *q,
			   char *msg, size_t len)
{
	struct kvbp_request req = { .op = KVBP_OP_REPLICATE, .has_hash = true, .num_tokens = QT };
	struct raw r;
	uint32_t code;

	snprintf(req.model_name, sizeof(req.model_name), "fq");
	memcpy(req.hash, hash, KVB_HASH_LEN);
	raw_open(&r, d->endpoint, 10000);
	code = raw_call_msg(&r, &req, q->frames, q->lens, L, msg, len);
	raw_close(&r);
	return code;
}

static int setup_quant(void **state)
{
	struct fixture *f = calloc(1, sizeof(*f));
	const char *args[] = { "--fuse-idle", "30", NULL };

	f->c = daemon_start_client(&f->d, args, &qmodel, 0);
	for (uint32_t i = 0; i < 3; i++) {
		uint32_t ids[2] = { 55, i };

		kvb_chunk_hash(ids, 2, f->hash[i]);
	}
	*state = f;
	return 0;
}

/*
 * A REPLICATE of quantized tensors whose rows x channels multiply out to the chunk's
 * tensor but are not one row per token of the model's channels: GET could decode
 * them, a fuse session could not (its re-rotation takes a token row at a time), and
 * took them for corrupt and removed the chunk. The import is refused, naming the
 * layout it got and the one it takes, and nothing is stored: a bad K, then a bad V.
 * The same tensors one row per token are stored and read back.
 */
static void test_replicate_refuses_quant_layout(void **state)
{
	struct fixture *f = *state;
	struct qchunk *q = calloc(1, sizeof(*q));
	size_t n = (size_t)L * 2 * QT * ROW;
	uint8_t *back = malloc(n);
	char msg[KVBP_MESSAGE_MAX];
	uint32_t code;

	qchunk_make(q, 2 * QT, QT); /* K as 32 rows of 8 channels */
	code = qreplicate(&f->d, f->hash[1], q, msg, sizeof(msg));
	print_message("REPLICATE of K as %d rows x %d channels: %s: %s\n", 2 * QT, QC / 2,
		      kvbp_code_name(code), msg);
	assert_int_equal(code, KVBP_BAD_SHAPE);
	assert_non_null(strstr(msg, "layer 0's K is quantized as 32 rows x 8 channels"));
	assert_non_null(strstr(msg, "16 rows x 16 channels"));
	assert_non_null(strstr(msg, "nothing stored"));
	assert_int_equal(kvb_get(f->c, "fq", f->hash[1], 0, 0, back, n, NULL), KVB_E_NOT_FOUND);

	qchunk_make(q, QT, QT / 2); /* V as 8 rows of 32 channels */
	code = qreplicate(&f->d, f->hash[2], q, msg, sizeof(msg));
	assert_int_equal(code, KVBP_BAD_SHAPE);
	assert_non_null(strstr(msg, "layer 0's V is quantized as 8 rows x 32 channels"));
	assert_int_equal(kvb_get(f->c, "fq", f->hash[2], 0, 0, back, n, NULL), KVB_E_NOT_FOUND);
	assert_int_equal((uint64_t)daemon_stat(f->c, "chunks"), 0);

	/* one row per token: stored, and read back */
	qchunk_make(q, QT, QT);
	assert_int_equal(qreplicate(&f->d, f->hash[0], q, msg, sizeof(msg)), KVBP_OK);
	assert_int_equal(kvb_get(f->c, "fq", f->hash[0], 0, 0, back, n, NULL), 0);
	assert_int_equal((uint64_t)daemon_stat(f->c, "chunks"), 1);
	free(back);
	free(q);
}

/* Replace every layer record in the daemon's data file (stopped) with q's. */
static void rewrite_layers(const char *data_dir, const struct qchunk *q)
{
	MDB_cursor *cur = data_layers_open(data_dir);
	MDB_val k, v;
	uint32_t l = 0;
	int rc;

	for (rc = mdb_cursor_get(cur, &k, &v, MDB_FIRST); rc == 0;
	     rc = mdb_cursor_get(cur, &k, &v, MDB_NEXT), l++) {
		uint8_t key[64];

		assert_true(l < L && k.mv_size <= sizeof(key)); /* the store holds the one chunk */
		/* the key copied first: a value of another size moves the node it points into */
		memcpy(key, k.mv_data, k.mv_size);
		k.mv_data = key;
		v.mv_data = (void *)q->frames[l];
		v.mv_size = q->lens[l];
		assert_int_equal(mdb_cursor_put(cur, &k, &v, MDB_CURRENT), 0);
	}
	assert_int_equal(rc, MDB_NOTFOUND);
	assert_int_equal(l, L);
	data_layers_close(cur);
}

/*
 * A chunk already stored with a layout a fuse session cannot read (imported before
 * REPLICATE checked it; here written into the data file while the daemon is stopped):
 * its checksums hold and GET reads it, so a fuse session's read must not call it
 * corrupt. The session fails with an error that says why (bad_shape), the chunk stays
 * (nothing counted in corrupt_removed once the session is closed), and GET still
 * serves it.
 */
static void test_fuse_keeps_unreadable_layout(void **state)
{
	struct fixture *f = *state;
	struct qchunk *q = calloc(1, sizeof(*q));
	static const uint32_t ck[1] = { 1 };
	static const double rt[1] = { 0.5 };
	struct kvb_fuse_params p = { ck, rt, 1, KVB_METRIC_VALUE };
	size_t n = (size_t)L * 2 * QT * ROW, n_sel;
	uint8_t *ref = malloc(n), *back = malloc(n), *all = calloc(L * 2 * (QT + 3), ROW);
	const char *args[] = { "--fuse-idle", "30", NULL };
	struct kvb_segment s[2] = { { 0 } };
	char msg[KVBP_MESSAGE_MAX];
	int32_t sel[64];
	kvb_fuse *fu;
	int rc;

	qchunk_make(q, QT, QT);
	assert_int_equal(qreplicate(&f->d, f->hash[0], q, msg, sizeof(msg)), KVBP_OK);
	assert_int_equal(kvb_get(f->c, "fq", f->hash[0], 0, 0, ref, n, NULL), 0);
	kvb_close(&f->c);
	daemon_stop(&f->d);
	qchunk_make(q, 2 * QT, QT); /* the same codes, K as 32 rows of 8 channels */
	rewrite_layers(f->d.data_dir, q);
	daemon_restart(&f->d, args);
	f->c = daemon_client(&f->d, 0);
	/* GET decodes it: the same values */
	assert_int_equal(kvb_get(f->c, "fq", f->hash[0], 0, 0, back, n, NULL), 0);
	assert_memory_equal(back, ref, n);

	memcpy(s[0].hash, f->hash[0], KVB_HASH_LEN);
	s[1].fresh = 1;
	s[1].pos = QT;
	s[1].count = 3;
	assert_int_equal(kvb_fuse_open(f->c, "fq", s, 2, &p, &fu, NULL, NULL), 0);
	rc = drive(f->c, fu, all, sel, &n_sel);
	print_message("fuse session over it: %d: %s\n", rc, kvb_last_error(f->c));
	assert_int_not_equal(rc, KVB_E_CORRUPT);
	/* the host's load re-rotates K a token row at a time, and cannot take these rows; a
	 * device's load (KVBLEND_TEST_DEVICE) copies the chunk up as stored, which reads them */
	if (rc || !getenv("KVBLEND_TEST_DEVICE")) {
		assert_int_equal(rc, KVB_E_BAD_SHAPE);
		assert_non_null(strstr(kvb_last_error(f->c), "one row per token"));
	}
	assert_int_equal(kvb_fuse_close(f->c, &fu, NULL, NULL), 0);
	/* a corrupt chunk would be removed as the session is freed: give it the time */
	for (int i = 0; i < 100 && daemon_stat(f->c, "corrupt_removed") < 1; i++)
		usleep(10000);
	assert_int_equal((uint64_t)daemon_stat(f->c, "corrupt_removed"), 0);
	assert_int_equal(kvb_get(f->c, "fq", f->hash[0], 0, 0, back, n, NULL), 0);
	assert_memory_equal(back, ref, n);
	free(ref);
	free(back);
	free(all);
	free(q);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		fixture_test(test_protocol_errors),
		fixture_test(test_wrong_rows),
		fixture_test(test_attention_wire),
		fixture_test(test_open_errors),
		fixture_test(test_limits_and_pins),
		fixture_test(test_abandoned_session_expires),
		fixture_test(test_concurrent_sessions),
		fixture_test(test_wide_bf16_unaligned),
		fixture_test(test_device_output),
		cmocka_unit_test_setup_teardown(test_replicate_refuses_quant_layout, setup_quant,
						teardown),
		cmocka_unit_test_setup_teardown(test_fuse_keeps_unreadable_layout, setup_quant,
						teardown),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
