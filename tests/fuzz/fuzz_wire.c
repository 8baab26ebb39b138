/*
 * fuzz_wire — libFuzzer harness over the header decoder of proto/wire.c.
 *
 * Built in two modes from this one file:
 *  - decode (default): kvbp_request_decode() on arbitrary bytes; a success must
 *    give a request within the documented limits whose arrays are as long as
 *    their counts say, a failure must give a known code, a message, and leave
 *    the out-parameter untouched.
 *  - roundtrip (-DKVB_FUZZ_ROUNDTRIP): what decodes must encode and decode back
 *    to the same request; a reply built from it (every reply field filled) must
 *    survive kvbp_reply_encode() + kvbp_reply_decode(); and the same bytes read
 *    as a Reply (what a client parses) must round-trip as well.
 * A broken invariant prints what differs and aborts, so libFuzzer saves the input.
 */
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "tests/fuzz/fuzz.h"
#include "proto/wire.h"

#define ERR_LEN 256

__attribute__((noreturn)) static void defect(const char *what)
{
	fprintf(stderr, "fuzz_wire: invariant broken: %s\n", what);
	abort();
}

#define CHECK(cond)                         \
	do {                                \
		if (!(cond))                \
			defect(#cond);      \
	} while (0)

/* Read every byte of an owned array, so that a short allocation is an ASan report. */
static unsigned touch(const void *p, size_t n)
{
	const volatile uint8_t *b = p;
	unsigned sum = 0;

	for (size_t i = 0; i < n; i++)
		sum += b[i];
	return sum;
}

static bool terminated(const char *s, size_t cap)
{
	return memchr(s, 0, cap) != NULL;
}

static void check_decoded_request(const struct kvbp_request *r)
{
	CHECK(terminated(r->model_name, sizeof(r->model_name)));
	CHECK(strlen(r->model_name) <= KVBP_NAME_MAX);
	CHECK(!r->has_model || terminated(r->model.name, sizeof(r->model.name)));
	CHECK(r->n_hashes <= KVBP_LOOKUP_MAX);
	CHECK(r->n_segments <= KVBP_SEGMENTS_MAX);
	CHECK(r->n_checks <= KVBP_CHECKS_MAX && r->n_ratios <= KVBP_CHECKS_MAX);
	CHECK(!r->n_hashes == !r->hashes);
	CHECK(!r->n_segments == !r->segments);
	CHECK(!r->n_checks == !r->check_layers);
	CHECK(!r->n_ratios == !r->ratios);
	touch(r->hashes, r->n_hashes * KVBP_HASH_LEN);
	touch(r->segments, r->n_segments * sizeof(*r->segments));
	touch(r->check_layers, r->n_checks * sizeof(*r->check_layers));
	touch(r->ratios, r->n_ratios * sizeof(*r->ratios));
}

static void fuzz_decode(const uint8_t *data, size_t size)
{
	struct kvbp_request r, sentinel;
	char err[ERR_LEN];
	int rc;

	memset(&sentinel, 0xa5, sizeof(sentinel));
	r = sentinel;
	memset(err, 0, sizeof(err));
	rc = kvbp_request_decode(data, size, &r, err, sizeof(err));
	if (rc == KVBP_OK) {
		check_decoded_request(&r);
		kvbp_request_clear(&r);
		CHECK(!r.hashes && !r.segments && !r.check_layers && !r.ratios);
		return;
	}
	CHECK(rc == KVBP_BAD_REQUEST || rc == KVBP_BAD_ARGUMENT || rc == KVBP_TOO_LARGE ||
	      rc == KVBP_INTERNAL);
	CHECK(err[0] != 0 && terminated(err, sizeof(err)));
	/* STYLE: out-parameters are left untouched on failure. */
	CHECK(memcmp(&r, &sentinel, sizeof(r)) == 0);
	/* A small err buffer is truncated, never overrun. */
	{
		char small[4] = { 'x', 'x', 'x', 'x' };

		CHECK(kvbp_request_decode(data, size, &r, small, 3) == rc);
		CHECK(small[2] == 0 && small[3] == 'x');
		CHECK(kvbp_request_decode(data, size, &r, NULL, 0) == rc);
	}
}

#ifdef KVB_FUZZ_ROUNDTRIP

/*
 * Bit for bit (NaN payloads included), except that a proto3 singular -0.0 is a default
 * value: protobuf-c leaves it out, and it comes back as +0.0. They compare equal in C,
 * so no check in the daemon can tell them apart.
 */
static bool same_double(double a, double b)
{
	return memcmp(&a, &b, sizeof(a)) == 0 || (a == 0 && b == 0);
}

static bool same_model(const struct kvbp_model *a, const struct kvbp_model *b)
{
	const struct kvb_model_desc *x = &a->desc, *y = &b->desc;

	return !strcmp(a->name, b->name) && x->num_layers == y->num_layers &&
	       x->num_kv_heads == y->num_kv_heads && x->head_dim == y->head_dim &&
	       x->dtype == y->dtype && same_double(x->rope_theta, y->rope_theta) &&
	       x->rope_style == y->rope_style && x->rotary_dim == y->rotary_dim &&
	       x->scaling == y->scaling && same_double(x->factor, y->factor) &&
	       same_double(x->low_freq_factor, y->low_freq_factor) &&
	       same_double(x->high_freq_factor, y->high_freq_factor) &&
	       x->original_max_pos == y->original_max_pos &&
	       same_double(x->beta_fast, y->beta_fast) && same_double(x->beta_slow, y->beta_slow) &&
	       x->max_pos == y->max_pos && x->k_pre_rope == y->k_pre_rope;
}

#define SAME(f)                                            \
	do {                                               \
		if (a->f != b->f)                          \
			defect("round trip changed " #f);  \
	} while (0)

static void same_request(const struct kvbp_request *a, const struct kvbp_request *b)
{
	SAME(version);
	SAME(request_id);
	SAME(op);
	SAME(has_model);
	if (a->has_model && !same_model(&a->model, &b->model))
		defect("round trip changed model");
	if (strcmp(a->model_name, b->model_name))
		defect("round trip changed model_name");
	SAME(has_hash);
	if (a->has_hash && memcmp(a->hash, b->hash, KVBP_HASH_LEN))
		defect("round trip changed hash");
	SAME(num_tokens);
	SAME(base_pos);
	SAME(layer_begin);
	SAME(layer_end);
	SAME(payload_frames);
	SAME(dtype);
	SAME(n_hashes);
	if (a->n_hashes && memcmp(a->hashes, b->hashes, a->n_hashes * KVBP_HASH_LEN))
		defect("round trip changed hashes");
	SAME(has_shm);
	SAME(shm_id);
	SAME(shm_offset);
	SAME(shm_length);
	SAME(shm_size);
	SAME(n_segments);
	for (size_t i = 0; i < a->n_segments; i++) {
		const struct kvbp_segment *x = &a->segments[i], *y = &b->segments[i];

		if (x->fresh != y->fresh || x->pos != y->pos || x->count != y->count ||
		    (!x->fresh && memcmp(x->hash, y->hash, KVBP_HASH_LEN)))
			defect("round trip changed a segment");
	}
	SAME(n_checks);
	if (a->n_checks && memcmp(a->check_layers, b->check_layers, a->n_checks * 4))
		defect("round trip changed check_layers");
	SAME(n_ratios);
	if (a->n_ratios && memcmp(a->ratios, b->ratios, a->n_ratios * sizeof(double)))
		defect("round trip changed ratios");
	SAME(metric);
	SAME(session_id);
	SAME(layer);
	SAME(rows);
	SAME(has_shm_out);
	SAME(shm_out_id);
	SAME(shm_out_offset);
	SAME(shm_out_length);
	SAME(rerotate);
	SAME(target_pos);
	SAME(shared_ring);
	SAME(ttl);
	SAME(progress);
	SAME(attention);
	SAME(n_recompute);
	if (a->n_recompute && memcmp(a->recompute, b->recompute, a->n_recompute * 4))
		defect("round trip changed recompute");
}

static void same_reply(const struct kvbp_reply *a, const struct kvbp_reply *b)
{
	SAME(version);
	SAME(request_id);
	SAME(code);
	{
		/* the encoder sends a message as valid UTF-8 (kvbp_utf8_escape): what comes
		 * back is the message escaped, and escaping that again changes nothing */
		char esc[KVBP_MESSAGE_MAX], again[KVBP_MESSAGE_MAX];

		kvbp_utf8_escape(a->message, esc, sizeof(esc));
		if (strcmp(esc, b->message))
			defect("round trip changed message");
		if (kvbp_utf8_escape(b->message, again, sizeof(again)) || strcmp(again, esc))
			defect("a message came back as invalid UTF-8");
	}
	if (strcmp(a->server_version, b->server_version))
		defect("round trip changed server_version");
	if (strcmp(a->shm_name, b->shm_name))
		defect("round trip changed shm_name");
	SAME(n_models);
	for (size_t i = 0; i < a->n_models; i++)
		if (!same_model(&a->models[i], &b->models[i]))
			defect("round trip changed a model");
	SAME(n_chunks);
	for (size_t i = 0; i < a->n_chunks; i++) {
		const struct kvbp_chunk *x = &a->chunks[i], *y = &b->chunks[i];

		if (memcmp(x->hash, y->hash, KVBP_HASH_LEN) || x->found != y->found ||
		    x->num_tokens != y->num_tokens || x->base_pos != y->base_pos ||
		    x->num_layers != y->num_layers || x->raw_bytes != y->raw_bytes ||
		    x->stored_bytes != y->stored_bytes)
			defect("round trip changed a chunk");
	}
	SAME(n_stats);
	for (size_t i = 0; i < a->n_stats; i++)
		if (strcmp(a->stats[i].name, b->stats[i].name) ||
		    !same_double(a->stats[i].value, b->stats[i].value)) {
			fprintf(stderr, "fuzz_wire: stat %zu: '%s' = %a became '%s' = %a\n", i,
				a->stats[i].name, a->stats[i].value, b->stats[i].name,
				b->stats[i].value);
			defect("round trip changed a stat");
		}
	SAME(existed);
	SAME(payload_frames);
	SAME(layer_begin);
	SAME(layer_end);
	SAME(shm_id);
	SAME(shm_size);
	SAME(session_id);
	SAME(num_tokens);
	SAME(n_selection);
	if (a->n_selection && memcmp(a->selection, b->selection, a->n_selection * 4))
		defect("round trip changed selection");
	SAME(has_selection);
	SAME(has_fused);
	SAME(next_layer);
	SAME(rows_next);
	SAME(ring_slot);
	SAME(ring_slots);
	SAME(slot_bytes);
}

#undef SAME

/* encode(a) must decode to a again. */
static void reply_roundtrip(const struct kvbp_reply *a)
{
	struct kvbp_reply b;
	char err[ERR_LEN];
	uint8_t *buf = NULL;
	size_t len = 0;
	int rc;

	if (kvbp_reply_encode(a, &buf, &len))
		return; /* out of memory: not a defect */
	rc = kvbp_reply_decode(buf, len, &b, err, sizeof(err));
	if (rc != KVBP_OK) {
		fprintf(stderr, "fuzz_wire: encoded reply does not decode: %s\n", err);
		defect("kvbp_reply_decode(kvbp_reply_encode(reply)) failed");
	}
	same_reply(a, &b);
	kvbp_reply_clear(&b);
	free(buf);
}

/* Truncating on purpose, as the daemon's fail() does into reply.message. */
__attribute__((format(printf, 3, 4))) static void put_text(char *dst, size_t cap,
							   const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(dst, cap, fmt, ap);
	va_end(ap);
}

/* A reply that uses every field, filled from what the request carried. */
static void reply_from_request(const struct kvbp_request *q, const char *err)
{
	struct kvbp_reply rep;
	struct kvbp_chunk *chunks = NULL;
	struct kvbp_stat *stats = NULL;
	int32_t *sel = NULL;

	memset(&rep, 0, sizeof(rep));
	rep.version = q->version;
	rep.request_id = q->request_id;
	rep.code = q->op;
	/* The daemon writes client-chosen text into these (vsnprintf into a fixed array). */
	put_text(rep.message, sizeof(rep.message), "unknown model '%s' (%s): %s%s%s%s",
		 q->model_name, err, q->model.name, q->model.name, q->model.name, q->model.name);
	put_text(rep.server_version, sizeof(rep.server_version), "%s", q->model.name);
	put_text(rep.shm_name, sizeof(rep.shm_name), "/%s", q->model_name);
	if (q->has_model) {
		rep.models = (struct kvbp_model *)&q->model;
		rep.n_models = 1;
	}
	if (q->n_hashes && (chunks = calloc(q->n_hashes, sizeof(*chunks)))) {
		for (size_t i = 0; i < q->n_hashes; i++) {
			memcpy(chunks[i].hash, q->hashes[i], KVBP_HASH_LEN);
			chunks[i].found = i & 1;
			chunks[i].num_tokens = q->num_tokens;
			chunks[i].base_pos = q->base_pos + (uint32_t)i;
			chunks[i].num_layers = q->layer_end;
			chunks[i].raw_bytes = q->shm_length;
			chunks[i].stored_bytes = q->shm_offset;
		}
		rep.chunks = chunks;
		rep.n_chunks = q->n_hashes;
	}
	if (q->n_segments && (stats = calloc(q->n_segments, sizeof(*stats)))) {
		for (size_t i = 0; i < q->n_segments; i++) {
			put_text(stats[i].name, sizeof(stats[i].name), "%s_%zu", q->model_name, i);
			stats[i].value = q->n_ratios ? q->ratios[i % q->n_ratios] :
						       (double)q->segments[i].pos;
		}
		rep.stats = stats;
		rep.n_stats = q->n_segments;
	}
	if (q->n_checks && (sel = calloc(q->n_checks, sizeof(*sel)))) {
		for (size_t i = 0; i < q->n_checks; i++)
			sel[i] = (int32_t)q->check_layers[i];
		rep.selection = sel;
		rep.n_selection = q->n_checks;
	}
	rep.existed = q->rerotate;
	rep.payload_frames = q->payload_frames;
	rep.layer_begin = q->layer_begin;
	rep.layer_end = q->layer_end;
	rep.shm_id = q->shm_id;
	rep.shm_size = q->shm_size;
	rep.session_id = q->session_id;
	rep.num_tokens = q->num_tokens;
	rep.has_selection = q->shared_ring;
	rep.has_fused = q->has_shm_out;
	rep.next_layer = q->layer;
	rep.rows_next = q->rows;
	rep.ring_slot = q->ttl;
	rep.ring_slots = q->metric;
	rep.slot_bytes = q->progress;
	reply_roundtrip(&rep);
	free(chunks);
	free(stats);
	free(sel);
}

static void fuzz_roundtrip(const uint8_t *data, size_t size)
{
	struct kvbp_request a, b;
	struct kvbp_reply ra;
	char err[ERR_LEN] = "";
	uint8_t *buf = NULL;
	size_t len = 0;
	int rc;

	if (kvbp_request_decode(data, size, &a, err, sizeof(err)) == KVBP_OK) {
		/*
		 * All defaults encode to nothing, and an empty header frame is bad_request by
		 * design (docs/protocol.md); such a request has version 0 and is refused anyway.
		 */
		if (kvbp_request_encode(&a, &buf, &len) == 0 && len == 0) {
			CHECK(a.version == 0 && a.op == 0 && a.request_id == 0);
			free(buf);
		} else if (buf) {
			rc = kvbp_request_decode(buf, len, &b, err, sizeof(err));
			if (rc != KVBP_OK) {
				fprintf(stderr, "fuzz_wire: re-encoded request does not decode: %s\n",
					err);
				defect("kvbp_request_decode(kvbp_request_encode(request)) failed");
			}
			same_request(&a, &b);
			kvbp_request_clear(&b);
			free(buf);
		}
		reply_from_request(&a, err);
		kvbp_request_clear(&a);
	}
	/* The same bytes as a reply: what libkvblend parses from a daemon or a peer. */
	if (kvbp_reply_decode(data, size, &ra, err, sizeof(err)) == KVBP_OK) {
		CHECK(terminated(ra.message, sizeof(ra.message)));
		CHECK(terminated(ra.server_version, sizeof(ra.server_version)));
		CHECK(terminated(ra.shm_name, sizeof(ra.shm_name)));
		touch(ra.models, ra.n_models * sizeof(*ra.models));
		touch(ra.chunks, ra.n_chunks * sizeof(*ra.chunks));
		touch(ra.stats, ra.n_stats * sizeof(*ra.stats));
		touch(ra.selection, ra.n_selection * sizeof(*ra.selection));
		reply_roundtrip(&ra);
		kvbp_reply_clear(&ra);
	}
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	fuzz_decode(data, size);
	fuzz_roundtrip(data, size);
	return 0;
}

#else

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	fuzz_decode(data, size);
	return 0;
}

#endif
