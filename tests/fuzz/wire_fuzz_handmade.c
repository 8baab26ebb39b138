/*
 * wire_fuzz_handmade — request headers encoded by hand for fuzz_wire_daemon
 * (wire_fuzz.h): what the protobuf encoder never writes (wrong wire types, lengths past
 * the end, overlong varints, unknown fields and groups, repeated fields around and far
 * past the daemon's limits).
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "proto/wire.h"
#include "tests/fuzz/wire_fuzz.h"

/* ---- hand-encoded protobuf ---- */

struct pbw {
	uint8_t *b;
	size_t n, cap;
};

static void pb_bytes(struct pbw *w, const void *p, size_t n)
{
	if (w->n + n > w->cap) {
		size_t cap = (w->n + n) * 2 + 64;
		uint8_t *b = realloc(w->b, cap);

		if (!b)
			abort();
		w->b = b;
		w->cap = cap;
	}
	if (n)
		memcpy(w->b + w->n, p, n);
	w->n += n;
}

static void pb_varint(struct pbw *w, uint64_t v)
{
	uint8_t b[10];
	size_t n = 0;

	do {
		b[n] = (uint8_t)(v & 0x7f);
		v >>= 7;
		if (v)
			b[n] |= 0x80;
		n++;
	} while (v);
	pb_bytes(w, b, n);
}

static void pb_tag(struct pbw *w, uint32_t field, uint32_t wt)
{
	pb_varint(w, (uint64_t)field << 3 | wt);
}

static void pb_len(struct pbw *w, uint32_t field, const void *p, size_t n)
{
	pb_tag(w, field, 2);
	pb_varint(w, n);
	pb_bytes(w, p, n);
}

/* Every field of Request by number, with its proper wire type (0 varint, 1 fixed64, 2 len). */
static const uint8_t req_wire_type[29] = {
	[1] = 0,  [2] = 0,  [3] = 0,  [4] = 2,	[5] = 2,  [6] = 2,  [7] = 0,  [8] = 0,
	[9] = 0,  [10] = 0, [11] = 2, [12] = 0, [13] = 2, [14] = 0, [15] = 0, [16] = 2,
	[17] = 2, [18] = 2, [19] = 0, [20] = 0, [21] = 0, [22] = 0, [23] = 2, [24] = 0,
	[25] = 0, [26] = 0, [27] = 0, [28] = 0,
};

/* Packed check layers and ratios around the limit. */
static void pb_checks_around_limit(struct pbw *w)
{
	static const uint32_t ns[] = { 1, KVBP_CHECKS_MAX, KVBP_CHECKS_MAX + 1, 1000, 100000 };
	uint32_t n = ns[below(5)];
	struct pbw p = { 0 };

	for (uint32_t i = 0; i < n; i++)
		pb_varint(&p, chance(90) ? i : pick_u32());
	pb_len(w, 17, p.b, p.n);
	p.n = 0;
	for (uint32_t i = 0; i < n && chance(70); i++) {
		double r = chance(90) ? 0.5 : pick_double();

		pb_bytes(&p, &r, 8);
	}
	if (p.n)
		pb_len(w, 18, p.b, p.n);
	free(p.b);
}

/* Segments around the limit, odd hash lengths. */
static void pb_segments_around_limit(struct pbw *w)
{
	static const uint32_t ns[] = { 1, 7, KVBP_SEGMENTS_MAX, KVBP_SEGMENTS_MAX + 1, 20000 };
	uint32_t n = ns[below(5)];
	uint8_t h[40];

	fill_random(h, sizeof(h));
	for (uint32_t i = 0; i < n; i++) {
		struct pbw s = { 0 };
		uint32_t hl = chance(95) ? (chance(50) ? 0 : 32) : below(40);

		if (hl)
			pb_len(&s, 1, h, hl);
		pb_tag(&s, 2, 0);
		pb_varint(&s, chance(90) ? i : pick_u32());
		pb_tag(&s, 3, 0);
		pb_varint(&s, chance(90) ? 1 : pick_u64());
		pb_len(w, 16, s.b, s.n);
		free(s.b);
	}
	pb_tag(w, 17, 0);
	pb_varint(w, 0);
	pb_tag(w, 18, 1);
	pb_bytes(w, &(double){ 0.5 }, 8);
}

/* LOOKUP hashes around the limit, odd lengths. */
static void pb_hashes_around_limit(struct pbw *w)
{
	static const uint32_t ns[] = { 1, 100, KVBP_LOOKUP_MAX, KVBP_LOOKUP_MAX + 1 };
	uint32_t n = ns[below(4)];
	uint8_t h[40];

	fill_random(h, sizeof(h));
	for (uint32_t i = 0; i < n; i++)
		pb_len(w, 11, h, chance(99) || i + 1 < n ? 32 : below(40));
}

/* A model with odd strings and values. */
static void pb_odd_model(struct pbw *w)
{
	struct pbw s = { 0 };
	static const uint32_t ls[] = { 0, 1, 64, 65, 1000 };
	uint32_t nl = ls[below(5)];
	char *name = malloc(nl + 1);

	for (uint32_t i = 0; i < nl; i++)
		name[i] = chance(95) ? (char)('a' + below(26)) : (char)rnd();
	pb_len(&s, 1, name, nl);
	free(name);
	for (uint32_t f = 2; f <= 17; f++) {
		if (chance(40))
			continue;
		if (f == 6 || f == 10 || f == 11 || f == 12 || f == 14 || f == 15) {
			double d = pick_double();

			pb_tag(&s, f, 1);
			pb_bytes(&s, &d, 8);
		} else {
			pb_tag(&s, f, 0);
			pb_varint(&s, pick_u64());
		}
	}
	pb_len(w, 4, s.b, s.n);
	free(s.b);
}

void gen_handmade(struct msg *m)
{
	struct pbw w = { 0 };
	uint32_t op = 1 + below(KVBP_OP_COUNT - 1);
	int mi = pick_model();
	uint64_t id = next_id++;

	pb_tag(&w, 1, 0);
	pb_varint(&w, KVBP_VERSION);
	pb_tag(&w, 2, 0);
	pb_varint(&w, id);
	pb_tag(&w, 3, 0);
	pb_varint(&w, op);
	if (mi >= 0 && chance(80))
		pb_len(&w, 5, models[mi].m.name, strlen(models[mi].m.name));
	switch (below(14)) {
	case 0: { /* a field with the wrong wire type */
		uint32_t f = 1 + below(28), wt = req_wire_type[f];

		pb_tag(&w, f, wt == 2 ? (chance(50) ? 0 : 5) : chance(50) ? 2 : 1);
		if (wt == 2) {
			pb_varint(&w, pick_u64());
		} else {
			pb_varint(&w, 8);
			pb_bytes(&w, "\1\2\3\4\5\6\7\10", 8);
		}
		break;
	}
	case 1: /* a length beyond the end */
		pb_tag(&w, chance(50) ? 5 : 4, 2);
		pb_varint(&w, chance(50) ? 0xffffffffu : pick_u64());
		pb_bytes(&w, "abc", 3);
		break;
	case 2: /* packed check layers and ratios around the limit */
		pb_checks_around_limit(&w);
		break;
	case 3: /* segments around the limit, odd hash lengths */
		pb_segments_around_limit(&w);
		break;
	case 4: /* LOOKUP hashes around the limit, odd lengths */
		pb_hashes_around_limit(&w);
		break;
	case 5: /* a model with odd strings and values */
		pb_odd_model(&w);
		break;
	case 6: /* an overlong varint; a 64-bit value in a 32-bit field; a negative enum */
		pb_tag(&w, 7, 0);
		pb_bytes(&w, "\xff\xff\xff\xff\xff\xff\xff\xff\xff\xff\x01", chance(50) ? 11 : 10);
		pb_tag(&w, 15, 0);
		pb_varint(&w, chance(50) ? UINT64_MAX : 1ull << 33);
		break;
	case 7: /* unknown fields, groups, reserved wire types */
		pb_tag(&w, 29 + below(1000), below(8));
		pb_varint(&w, pick_u64());
		if (chance(50)) {
			pb_tag(&w, 99, 3);
			pb_tag(&w, 100, 0);
			pb_varint(&w, 1);
			if (chance(70))
				pb_tag(&w, 99, 4);
		}
		break;
	case 8: /* fields repeated: the last one wins, submessages merge */
		for (int i = 0; i < 3; i++) {
			pb_tag(&w, 3, 0);
			pb_varint(&w, below(KVBP_OP_COUNT + 3));
			pb_len(&w, 13, "\x08\x01\x10\x02\x18\x03", 6);
			pb_len(&w, 4, "\x0a\x02" "fz\x10\x03", 6);
		}
		break;
	case 9: /* field number 0, and the largest field number */
		pb_tag(&w, chance(50) ? 0 : (1u << 29) - 1, 0);
		pb_varint(&w, 1);
		break;
	case 10: /* a shm reference with extreme values */
	{
		struct pbw s = { 0 };

		pb_tag(&s, 1, 0);
		pb_varint(&s, n_shms && chance(70) ? shms[below((uint32_t)n_shms)].id : pick_u64());
		pb_tag(&s, 2, 0);
		pb_varint(&s, pick_u64());
		pb_tag(&s, 3, 0);
		pb_varint(&s, pick_u64());
		pb_len(&w, chance(70) ? 13 : 23, s.b, s.n);
		free(s.b);
		break;
	}
	case 11: /* truncated in the middle of a tag or a value */
		pb_tag(&w, 20, 0);
		pb_bytes(&w, "\xff\xff", 2);
		break;
	default: /* random sizes in every size field */
		for (uint32_t f = 7; f <= 28; f++)
			if (req_wire_type[f] == 0 && chance(50)) {
				pb_tag(&w, f, 0);
				pb_varint(&w, pick_u64());
			}
		break;
	}
	msg_add(m, w.b, w.n);
	free(w.b);
	m->id = id;
	/* Only an unmutated, well-formed header echoes the id we put in. */
	m->know_id = false;
	if (chance(20))
		for (uint32_t i = 0, n = below(6); i < n; i++)
			msg_add(m, NULL, below(128));
}
