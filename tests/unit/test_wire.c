/* Unit tests of proto/wire: round trips, malformed headers, limits, code numbering. */
#include <errno.h>
#include <locale.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "client/include/kvblend.h"
#include "proto/wire.h"

static void test_request_roundtrip(void **state)
{
	struct kvbp_request q = { .version = 1, .request_id = 1ull << 40, .op = KVBP_OP_PUT,
				  .has_model = true, .has_hash = true, .num_tokens = 77,
				  .base_pos = 5, .layer_begin = 1, .layer_end = 3,
				  .payload_frames = 6, .dtype = 2, .has_shm = true, .shm_id = 9,
				  .shm_offset = 4096, .shm_length = 1 << 20 };
	struct kvbp_request d;
	uint8_t *buf, hashes[2][KVBP_HASH_LEN];
	size_t len;
	char err[256];

	(void)state;
	snprintf(q.model_name, sizeof(q.model_name), "llama-3-8b");
	snprintf(q.model.name, sizeof(q.model.name), "llama-3-8b");
	q.model.desc.num_layers = 32;
	q.model.desc.rope_theta = 500000;
	q.model.desc.scaling = 2;
	q.model.desc.high_freq_factor = 4;
	q.model.desc.k_pre_rope = true;
	for (int i = 0; i < KVBP_HASH_LEN; i++)
		q.hash[i] = (uint8_t)i;
	memset(hashes, 0xab, sizeof(hashes));
	q.hashes = hashes;
	q.n_hashes = 2;
	assert_int_equal(kvbp_request_encode(&q, &buf, &len), 0);
	assert_int_equal(kvbp_request_decode(buf, len, &d, err, sizeof(err)), KVBP_OK);
	assert_int_equal(d.request_id, q.request_id);
	assert_int_equal(d.op, KVBP_OP_PUT);
	assert_string_equal(d.model_name, "llama-3-8b");
	assert_true(d.has_model && d.model.desc.num_layers == 32 &&
		    d.model.desc.rope_theta == 500000);
	assert_true(d.model.desc.scaling == 2 && d.model.desc.high_freq_factor == 4 &&
		    d.model.desc.k_pre_rope);
	assert_true(d.has_hash);
	assert_memory_equal(d.hash, q.hash, KVBP_HASH_LEN);
	assert_int_equal(d.n_hashes, 2);
	assert_memory_equal(d.hashes, hashes, sizeof(hashes));
	assert_true(d.has_shm && d.shm_id == 9 && d.shm_offset == 4096 && d.shm_length == 1 << 20);
	assert_int_equal(d.dtype, 2);
	kvbp_request_clear(&d);
	assert_null(d.hashes);
	/* Every proper prefix is either rejected or decodes to something else, never a crash. */
	for (size_t cut = 1; cut < len; cut++) {
		int rc = kvbp_request_decode(buf, cut, &d, err, sizeof(err));

		if (rc == KVBP_OK)
			kvbp_request_clear(&d);
		else
			assert_true(rc == KVBP_BAD_REQUEST || rc == KVBP_BAD_ARGUMENT);
	}
	free(buf);
}

static void test_request_malformed(void **state)
{
	struct kvbp_request q = { .version = 1, .op = KVBP_OP_GET }, d;
	uint8_t *buf;
	size_t len;
	char err[256];

	(void)state;
	assert_int_equal(kvbp_request_decode("", 0, &d, err, sizeof(err)), KVBP_BAD_REQUEST);
	assert_string_equal(err, "empty request header frame");
	assert_int_equal(kvbp_request_decode("\xff\xff\xff\xff", 4, &d, err, sizeof(err)),
			 KVBP_BAD_REQUEST);
	assert_non_null(strstr(err, "not a valid protobuf Request"));
	/* A 65-byte model name: too long. Built by hand, since the struct cannot hold it. */
	{
		uint8_t raw[2 + 65];

		raw[0] = (5 << 3) | 2; /* field 5 (model_name), length-delimited */
		raw[1] = 65;
		memset(raw + 2, 'a', 65);
		assert_int_equal(kvbp_request_decode(raw, sizeof(raw), &d, err, sizeof(err)),
				 KVBP_BAD_ARGUMENT);
		assert_string_equal(err, "model name is 65 bytes long; the limit is 64");
	}
	/* A 31-byte hash, in a request with id 300: refused, but its id can be read. */
	{
		uint8_t raw[2 + 31 + 3] = { (6 << 3) | 2, 31 };
		uint64_t id = 0;

		raw[33] = 2 << 3; /* field 2 (request_id), varint 300 */
		raw[34] = 0xac;
		raw[35] = 0x02;
		assert_int_equal(kvbp_request_decode(raw, sizeof(raw), &d, err, sizeof(err)),
				 KVBP_BAD_ARGUMENT);
		assert_string_equal(err, "chunk hash is 31 bytes; it must be 32");
		assert_int_equal(kvbp_request_peek_id(raw, sizeof(raw), &id), 0);
		assert_int_equal(id, 300);
		id = 7;
		assert_int_equal(kvbp_request_peek_id("\xff\xff\xff\xff", 4, &id), -EINVAL);
		assert_int_equal(kvbp_request_peek_id("", 0, &id), -EINVAL);
		assert_int_equal(id, 7);
	}
	assert_int_equal(kvbp_request_encode(&q, &buf, &len), 0);
	assert_int_equal(kvbp_request_decode(buf, len, &d, err, sizeof(err)), KVBP_OK);
	assert_false(d.has_hash);
	assert_false(d.has_model);
	assert_false(d.has_shm);
	free(buf);
}

static void test_reply_roundtrip(void **state)
{
	struct kvbp_reply r = { .version = 1, .request_id = 3, .code = KVBP_NOT_FOUND,
				.existed = true, .payload_frames = 4, .shm_id = 2,
				.shm_size = 1 << 26 };
	struct kvbp_reply d;
	struct kvbp_model m = { .name = "x", .desc.num_layers = 2 };
	struct kvbp_chunk ch[2] = { { .found = true, .num_tokens = 9 }, { .found = false } };
	struct kvbp_stat st = { .name = "chunks", .value = 12 };
	uint8_t *buf;
	size_t len;
	char err[256];

	(void)state;
	snprintf(r.message, sizeof(r.message), "get: not found");
	snprintf(r.shm_name, sizeof(r.shm_name), "/kvblend-1-2-abc");
	r.models = &m;
	r.n_models = 1;
	r.chunks = ch;
	r.n_chunks = 2;
	r.stats = &st;
	r.n_stats = 1;
	assert_int_equal(kvbp_reply_encode(&r, &buf, &len), 0);
	assert_int_equal(kvbp_reply_decode(buf, len, &d, err, sizeof(err)), KVBP_OK);
	assert_int_equal(d.code, KVBP_NOT_FOUND);
	assert_string_equal(d.message, "get: not found");
	assert_string_equal(d.shm_name, "/kvblend-1-2-abc");
	assert_int_equal(d.n_models, 1);
	assert_string_equal(d.models[0].name, "x");
	assert_int_equal(d.n_chunks, 2);
	assert_true(d.chunks[0].found && d.chunks[0].num_tokens == 9 && !d.chunks[1].found);
	assert_int_equal(d.n_stats, 1);
	assert_true(d.stats[0].value == 12);
	assert_true(d.existed);
	kvbp_reply_clear(&d);
	kvbp_reply_clear(NULL);
	free(buf);
}

/*
 * bulk_parts (FETCH replies, REPLICATE requests on a bulk connection) round-trip both
 * ways; more than KVBP_BULK_PARTS_MAX are refused, naming the limit.
 */
static void test_bulk_parts(void **state)
{
	uint64_t parts[3] = { 1, 1ull << 40, 7 }, *many = calloc(KVBP_BULK_PARTS_MAX + 1, 8);
	struct kvbp_request q = { .version = 1, .op = KVBP_OP_REPLICATE, .request_id = 9,
				  .has_bulk_ticket = true, .bulk_parts = parts, .n_bulk_parts = 3 };
	struct kvbp_reply r = { .version = 1, .request_id = 9, .bulk_bytes = 12,
				.bulk_parts = parts, .n_bulk_parts = 3 };
	struct kvbp_request dq;
	struct kvbp_reply dr;
	uint8_t *buf;
	size_t len;
	char err[256];

	(void)state;
	assert_non_null(many);
	assert_int_equal(kvbp_request_encode(&q, &buf, &len), 0);
	assert_int_equal(kvbp_request_decode(buf, len, &dq, err, sizeof(err)), KVBP_OK);
	free(buf);
	assert_int_equal(dq.n_bulk_parts, 3);
	assert_memory_equal(dq.bulk_parts, parts, sizeof(parts));
	kvbp_request_clear(&dq);
	assert_null(dq.bulk_parts);
	assert_int_equal(kvbp_reply_encode(&r, &buf, &len), 0);
	assert_int_equal(kvbp_reply_decode(buf, len, &dr, err, sizeof(err)), KVBP_OK);
	free(buf);
	assert_int_equal(dr.n_bulk_parts, 3);
	assert_memory_equal(dr.bulk_parts, parts, sizeof(parts));
	kvbp_reply_clear(&dr);
	assert_null(dr.bulk_parts);

	q.bulk_parts = r.bulk_parts = many;
	q.n_bulk_parts = r.n_bulk_parts = KVBP_BULK_PARTS_MAX + 1;
	assert_int_equal(kvbp_request_encode(&q, &buf, &len), 0);
	assert_int_equal(kvbp_request_decode(buf, len, &dq, err, sizeof(err)), KVBP_TOO_LARGE);
	assert_non_null(strstr(err, "bulk_parts"));
	free(buf);
	assert_int_equal(kvbp_reply_encode(&r, &buf, &len), 0);
	assert_int_equal(kvbp_reply_decode(buf, len, &dr, err, sizeof(err)), KVBP_BAD_REQUEST);
	assert_non_null(strstr(err, "bulk_parts"));
	free(buf);
	free(many);
}

/* STATS in a cluster: members round-trip; an id or endpoint longer than its field is cut. */
static void test_members(void **state)
{
	struct kvbp_reply r = { .version = 1, .request_id = 5 }, d;
	struct kvbp_member m[2] = {
		{ .id = "b", .endpoint = "tcp://10.0.0.2:7000", .state = 1, .pushes_owed = 3,
		  .last_reply_age_ms = 412.5, .chunks = 9, .stored_bytes = 1u << 30 },
		{ .id = "c", .endpoint = "tcp://10.0.0.3:7000", .state = -1,
		  .last_reply_age_ms = -1 },
	};
	uint8_t *buf;
	size_t len;
	char err[256];

	(void)state;
	r.members = m;
	r.n_members = 2;
	assert_int_equal(kvbp_reply_encode(&r, &buf, &len), 0);
	assert_int_equal(kvbp_reply_decode(buf, len, &d, err, sizeof(err)), KVBP_OK);
	assert_int_equal(d.n_members, 2);
	assert_string_equal(d.members[0].id, "b");
	assert_string_equal(d.members[0].endpoint, "tcp://10.0.0.2:7000");
	assert_int_equal(d.members[0].state, 1);
	assert_int_equal(d.members[0].pushes_owed, 3);
	assert_true(d.members[0].last_reply_age_ms == 412.5);
	assert_int_equal(d.members[0].chunks, 9);
	assert_int_equal(d.members[0].stored_bytes, 1u << 30);
	assert_int_equal(d.members[1].state, -1);
	assert_true(d.members[1].last_reply_age_ms == -1);
	kvbp_reply_clear(&d);
	assert_null(d.members);
	free(buf);
	{
		/* Another sender's strings past the fields: cut, never overrun. A Reply with
		 * one Member (field 27) of a 200-byte id and a 1000-byte endpoint, by hand. */
		uint8_t raw[1300], *p = raw;
		size_t mlen = 1 + 2 + 200 + 1 + 2 + 1000;

		*p++ = 27 << 3 | 2, *p++ = 0x01; /* tag 218 as a varint */
		*p++ = (uint8_t)(0x80 | (mlen & 0x7f)), *p++ = (uint8_t)(mlen >> 7);
		*p++ = 1 << 3 | 2, *p++ = 0x80 | (200 & 0x7f), *p++ = 200 >> 7;
		memset(p, 'i', 200), p += 200;
		*p++ = 2 << 3 | 2, *p++ = (uint8_t)(0x80 | (1000 & 0x7f)), *p++ = 1000 >> 7;
		memset(p, 'e', 1000), p += 1000;
		assert_int_equal(kvbp_reply_decode(raw, (size_t)(p - raw), &d, err, sizeof(err)),
				 KVBP_OK);
		assert_int_equal(d.n_members, 1);
		assert_int_equal(strlen(d.members[0].id), sizeof(d.members[0].id) - 1);
		assert_int_equal(strlen(d.members[0].endpoint), sizeof(d.members[0].endpoint) - 1);
		kvbp_reply_clear(&d);
	}
}

static void test_fuse_fields(void **state)
{
	struct kvbp_segment segs[2] = { { .fresh = false, .pos = 7 }, { .fresh = true, .count = 5,
									  .pos = 99 } };
	uint32_t checks[2] = { 1, 4 };
	double ratios[2] = { 0.25, 0.125 };
	int32_t sel[3] = { 2, 9, 40 };
	struct kvbp_request q = { .version = 1, .op = KVBP_OP_FUSE_OPEN, .segments = segs,
				  .n_segments = 2, .check_layers = checks, .n_checks = 2,
				  .ratios = ratios, .n_ratios = 2, .metric = 1, .session_id = 5,
				  .layer = 3, .rows = 17, .shared_ring = true, .rerotate = true,
				  .target_pos = 4096 };
	struct kvbp_reply r = { .version = 1, .selection = sel, .n_selection = 3,
				.has_selection = true, .has_fused = true, .ring_slot = 2,
				.ring_slots = 4, .slot_bytes = 1 << 20, .session_id = 1ull << 63 };
	struct kvbp_request dq;
	struct kvbp_reply dr;
	uint8_t *buf;
	size_t len;
	char err[256];

	(void)state;
	memset(segs[0].hash, 0x5a, KVBP_HASH_LEN);
	assert_int_equal(kvbp_request_encode(&q, &buf, &len), 0);
	assert_int_equal(kvbp_request_decode(buf, len, &dq, err, sizeof(err)), KVBP_OK);
	free(buf);
	assert_int_equal(dq.n_segments, 2);
	assert_false(dq.segments[0].fresh);
	assert_memory_equal(dq.segments[0].hash, segs[0].hash, KVBP_HASH_LEN);
	assert_true(dq.segments[1].fresh && dq.segments[1].count == 5 && dq.segments[1].pos == 99);
	assert_int_equal(dq.n_checks, 2);
	assert_int_equal(dq.check_layers[1], 4);
	assert_true(dq.n_ratios == 2 && dq.ratios[1] == 0.125);
	assert_true(dq.metric == 1 && dq.session_id == 5 && dq.layer == 3 && dq.rows == 17);
	assert_true(dq.shared_ring && dq.rerotate && dq.target_pos == 4096);
	kvbp_request_clear(&dq);
	assert_int_equal(kvbp_reply_encode(&r, &buf, &len), 0);
	assert_int_equal(kvbp_reply_decode(buf, len, &dr, err, sizeof(err)), KVBP_OK);
	free(buf);
	assert_int_equal(dr.n_selection, 3);
	assert_int_equal(dr.selection[2], 40);
	assert_true(dr.has_selection && dr.has_fused && dr.ring_slot == 2 && dr.ring_slots == 4);
	assert_true(dr.slot_bytes == 1 << 20 && dr.session_id == 1ull << 63);
	kvbp_reply_clear(&dr);
	/* a segment hash of the wrong size is refused */
	{
		/* field 16 (segments), length 4: field 1 (hash), length 2 */
		uint8_t raw[] = { 0x82, 0x01, 4, (1 << 3) | 2, 2, 0xaa, 0xbb };

		assert_int_equal(kvbp_request_decode(raw, sizeof(raw), &dq, err, sizeof(err)),
				 KVBP_BAD_ARGUMENT);
		assert_string_equal(err, "segment 0: chunk hash is 2 bytes; it must be 32");
	}
}

/* The client's KVB_E_* values are -(1000 + wire code), for every code. */
static void test_code_numbering(void **state)
{
	(void)state;
	assert_int_equal(KVB_E_BAD_REQUEST, -1000 - KVBP_BAD_REQUEST);
	assert_int_equal(KVB_E_BAD_VERSION, -1000 - KVBP_BAD_VERSION);
	assert_int_equal(KVB_E_UNKNOWN_OP, -1000 - KVBP_UNKNOWN_OP);
	assert_int_equal(KVB_E_BAD_SHAPE, -1000 - KVBP_BAD_SHAPE);
	assert_int_equal(KVB_E_UNKNOWN_MODEL, -1000 - KVBP_UNKNOWN_MODEL);
	assert_int_equal(KVB_E_DTYPE_MISMATCH, -1000 - KVBP_DTYPE_MISMATCH);
	assert_int_equal(KVB_E_BAD_FRAMES, -1000 - KVBP_BAD_FRAMES);
	assert_int_equal(KVB_E_TOO_LARGE, -1000 - KVBP_TOO_LARGE);
	assert_int_equal(KVB_E_MODEL_CONFLICT, -1000 - KVBP_MODEL_CONFLICT);
	assert_int_equal(KVB_E_NOT_FOUND, -1000 - KVBP_NOT_FOUND);
	assert_int_equal(KVB_E_CORRUPT, -1000 - KVBP_CORRUPT);
	assert_int_equal(KVB_E_FULL, -1000 - KVBP_FULL);
	assert_int_equal(KVB_E_LIMIT, -1000 - KVBP_LIMIT);
	assert_int_equal(KVB_E_INTERNAL, -1000 - KVBP_INTERNAL);
	assert_int_equal(KVB_E_BAD_ARGUMENT, -1000 - KVBP_BAD_ARGUMENT);
	assert_int_equal(KVB_E_BAD_SHM, -1000 - KVBP_BAD_SHM);
	assert_int_equal(KVB_E_UNKNOWN_SESSION, -1000 - KVBP_UNKNOWN_SESSION);
	assert_int_equal(KVB_E_BUSY, -1000 - KVBP_BUSY);
	assert_int_equal(KVBP_CODE_COUNT, 19);
	assert_string_equal(kvbp_code_name(KVBP_CORRUPT), "corrupt");
	assert_string_equal(kvbp_op_name(KVBP_OP_LOOKUP), "lookup");
	assert_string_equal(kvbp_op_name(999), "unknown");
	assert_int_equal(kvbp_dtype_size(3), 4);
	assert_int_equal(kvbp_dtype_size(7), 0);
}

/* kvbp_utf8_escape against the C library's UTF-8 decoder: invalid bytes escaped, valid
 * sequences kept, truncation at a character's boundary (issue 55, defect 7). */
static void test_utf8_escape(void **state)
{
	static const char *const bad[] = { "\xff", "a\xc0\xaf", "\xed\xa0\x80", "\xf4\x90\x80\x80",
					   "\xe2\x82", "x\x80y", "\xc3" };
	char out[KVBP_MESSAGE_MAX], small[6];
	struct kvbp_reply rep = { .version = 1, .code = KVBP_NOT_FOUND }, back;
	uint8_t *buf;
	size_t len;
	char err[128];

	(void)state;
	assert_non_null(setlocale(LC_CTYPE, "C.UTF-8"));
	assert_false(kvbp_utf8_escape("plain \xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80", out,
				      sizeof(out)));
	assert_string_equal(out, "plain \xc3\xa9\xe2\x82\xac\xf0\x9f\x98\x80");
	for (size_t i = 0; i < sizeof(bad) / sizeof(*bad); i++) {
		assert_true(kvbp_utf8_escape(bad[i], out, sizeof(out)));
		assert_true(mbstowcs(NULL, out, 0) != (size_t)-1);
	}
	kvbp_utf8_escape("x\x80y", out, sizeof(out));
	assert_string_equal(out, "x\\x80y");
	/* what glibc's decoder lets through and protobuf does not: a surrogate, past
	 * U+10FFFF, an overlong '/' */
	kvbp_utf8_escape("\xed\xa0\x80", out, sizeof(out));
	assert_string_equal(out, "\\xed\\xa0\\x80");
	kvbp_utf8_escape("\xf4\x90\x80\x80", out, sizeof(out));
	assert_string_equal(out, "\\xf4\\x90\\x80\\x80");
	kvbp_utf8_escape("a\xc0\xaf", out, sizeof(out));
	assert_string_equal(out, "a\\xc0\\xaf");
	/* cut whole: "ab" and then an escape that does not fit in 6 */
	assert_true(kvbp_utf8_escape("ab\xff", small, sizeof(small)));
	assert_string_equal(small, "ab");
	assert_true(kvbp_utf8_escape("abcd\xc3\xa9", small, sizeof(small)));
	assert_string_equal(small, "abcd");
	/* the encoder applies it */
	snprintf(rep.message, sizeof(rep.message), "model 'm\xff' not registered");
	assert_int_equal(kvbp_reply_encode(&rep, &buf, &len), 0);
	assert_int_equal(kvbp_reply_decode(buf, len, &back, err, sizeof(err)), 0);
	assert_string_equal(back.message, "model 'm\\xff' not registered");
	kvbp_reply_clear(&back);
	free(buf);
	setlocale(LC_CTYPE, "C");
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_request_roundtrip),
		cmocka_unit_test(test_request_malformed),
		cmocka_unit_test(test_reply_roundtrip),
		cmocka_unit_test(test_code_numbering),
		cmocka_unit_test(test_members),
		cmocka_unit_test(test_fuse_fields),
		cmocka_unit_test(test_bulk_parts),
		cmocka_unit_test(test_utf8_escape),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
