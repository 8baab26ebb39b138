/*
 * wire_fuzz_gen — the random choices of fuzz_wire_daemon and its generators of requests
 * (wire_fuzz.h): every op shaped like a real request with random and boundary values
 * (gen_op), correct PUTs (gen_put), fuse flows (gen_fuse), mutated headers
 * (gen_mutated), frame-level oddities (gen_frames), and generate(), which picks one of
 * these, gen_handmade (wire_fuzz_handmade.c) or gen_peer (wire_fuzz_peer.c).
 */
#include <inttypes.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "tests/fuzz/samples.h"
#include "proto/wire.h"
#include "tests/fuzz/wire_fuzz.h"

uint64_t rng_state;

/* ---- random choices ---- */

/* splitmix64: small, seedable, good enough to drive choices. */
uint64_t rnd(void)
{
	uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

uint32_t below(uint32_t n)
{
	return n ? (uint32_t)(rnd() % n) : 0;
}

bool chance(unsigned percent)
{
	return below(100) < percent;
}

void fill_random(void *p, size_t n)
{
	uint8_t *b = p;

	for (size_t i = 0; i < n; i++)
		b[i] = (uint8_t)rnd();
}

/* Tensor bytes: mostly small finite f16/f32-ish values, sometimes raw bits (NaN, Inf). */
void fill_tensor(void *p, size_t n)
{
	uint8_t *b = p;

	if (chance(30)) {
		fill_random(p, n);
		return;
	}
	for (size_t i = 0; i + 1 < n; i += 2) {
		uint64_t x = rnd();

		b[i] = (uint8_t)x;
		b[i + 1] = (uint8_t)((x >> 8 & 0x80) | (0x30 + (x >> 16 & 7)));
	}
	if (n & 1)
		b[n - 1] = 0;
}

static const uint64_t interesting[] = {
	0, 1, 2, 3, 7, 8, 15, 16, 31, 32, 33, 63, 64, 65, 127, 128, 255, 256, 1023, 1024, 1025,
	4095, 4096, 4097, 65535, 65536, 65537, 1u << 20, (1u << 20) + 1, 1u << 24, 0x7fffffff,
	0x80000000, 0xfffffffe, 0xffffffff, 1ull << 32, (1ull << 32) + 1, 1ull << 40, 1ull << 62,
	1ull << 63, UINT64_MAX - 1, UINT64_MAX,
};

uint64_t pick_u64(void)
{
	switch (below(4)) {
	case 0:
		return below(70);
	case 1:
		return rnd();
	default:
		return interesting[below(sizeof(interesting) / sizeof(interesting[0]))];
	}
}

uint32_t pick_u32(void)
{
	return (uint32_t)pick_u64();
}

double pick_double(void)
{
	static const double d[] = { 0, -0.0, 1, -1, 0.5, 0.15, 1e-300, 1e300, 2, 10000, 500000 };

	switch (below(4)) {
	case 0:
		return NAN;
	case 1:
		return chance(50) ? INFINITY : -INFINITY;
	case 2: {
		uint64_t bits = rnd();
		double x;

		memcpy(&x, &bits, sizeof(x));
		return x;
	}
	default:
		return d[below(sizeof(d) / sizeof(d[0]))];
	}
}

/* ---- generators ---- */

int pick_model(void)
{
	return n_models ? (int)below((uint32_t)n_models) : -1;
}

static void set_model_name(struct kvbp_request *q, int mi)
{
	static const char *const odd[] = { "", "nope", "a b", "x/../y", "\xc3\xa9t\xc3\xa9",
					   "\xff\xfe", "fz\n", "%s%n%s", "#", "alice#m", "a#b#c",
					   "#fz", "fz#" };

	if (mi >= 0 && chance(85)) {
		snprintf(q->model_name, sizeof(q->model_name), "%s", models[mi].m.name);
		return;
	}
	if (chance(30)) {
		memset(q->model_name, 'm', KVBP_NAME_MAX);
		q->model_name[KVBP_NAME_MAX] = 0;
		return;
	}
	snprintf(q->model_name, sizeof(q->model_name), "%s", odd[below(sizeof(odd) / sizeof(*odd))]);
}

/* A known chunk of model mi (or any), else a random hash. */
const struct chunk_info *pick_chunk(int mi)
{
	int cand[MAX_CHUNKS], n = 0;

	for (int i = 0; i < n_chunks; i++)
		if (mi < 0 || chunks[i].model == mi)
			cand[n++] = i;
	return n ? &chunks[cand[below((uint32_t)n)]] : NULL;
}

void set_hash(uint8_t *hash, int mi)
{
	const struct chunk_info *c = pick_chunk(mi);

	if (c && chance(75))
		memcpy(hash, c->hash, KVBP_HASH_LEN);
	else if (chance(20))
		memset(hash, 0, KVBP_HASH_LEN);
	else
		fill_random(hash, KVBP_HASH_LEN);
}

/* An shm reference: a known segment with a fitting or odd span, or a random one. */
static void set_shm(uint64_t *id, uint64_t *off, uint64_t *len, uint64_t want)
{
	if (n_shms && chance(80)) {
		const struct shm_info *s = &shms[below((uint32_t)n_shms)];

		*id = s->id;
		*off = chance(60) ? 0 : chance(50) ? below(4096) * 8 : pick_u64();
		*len = chance(60) ? want : pick_u64();
		if (chance(10) && s->size >= want) {
			*off = s->size - want; /* flush with the end */
			*len = want;
		}
		if (chance(10))
			*off = s->size - (want ? want - 1 : 0); /* one past the end */
		return;
	}
	*id = chance(20) ? 0 : chance(20) ? UINT64_MAX : rnd();
	*off = pick_u64();
	*len = chance(50) ? want : pick_u64();
}

/* Put data into a known segment where a request will point, so the daemon reads real bytes. */
static void shm_fill(uint64_t id, uint64_t off, uint64_t len)
{
	for (int i = 0; i < n_shms; i++)
		if (shms[i].id == id && shms[i].map && off <= shms[i].size &&
		    len <= shms[i].size - off && len <= SHM_MAP_MAX)
			fill_tensor(shms[i].map + off, (size_t)len);
}

static uint64_t tensor_bytes(int mi, uint32_t tokens)
{
	return mi >= 0 ? (uint64_t)tokens * models[mi].row : 0;
}

/* Payload frames for a PUT of `tokens` tokens of model mi: mostly right, sometimes not. */
static void put_payload(struct msg *m, struct kvbp_request *q, int mi, uint32_t tokens)
{
	uint32_t layers = mi >= 0 ? models[mi].m.desc.num_layers : 1 + below(4);
	uint64_t tb = tensor_bytes(mi, tokens);
	uint32_t n = 2 * layers;

	if (tb > (256u << 10))
		tb = 256u << 10;
	switch (below(10)) {
	case 0:
		n = below(2 * layers + 3);
		break;
	case 1:
		n = 2 * layers + 1;
		break;
	default:
		break;
	}
	q->payload_frames = chance(90) ? n : pick_u32();
	msg_add_header(m, q);
	for (uint32_t i = 0; i < n; i++) {
		size_t len = (size_t)tb;

		if (chance(3))
			len = chance(50) ? (size_t)tb + 1 : (tb ? (size_t)tb - 1 : 1);
		if (chance(1))
			len = 0;
		msg_add(m, NULL, len);
	}
}

/* Random values in random fields: the shape of the request stays, its values go wild. */
static int32_t recompute_buf[16]; /* FUSE_OPEN's recompute: the node's own selection */

static void perturb(struct kvbp_request *q, unsigned n)
{
	for (unsigned i = 0; i < n; i++) {
		switch (below(25)) {
		case 0:
			q->version = pick_u32();
			break;
		case 1:
			q->num_tokens = pick_u32();
			break;
		case 2:
			q->base_pos = pick_u32();
			break;
		case 3:
			q->layer_begin = pick_u32();
			break;
		case 4:
			q->layer_end = pick_u32();
			break;
		case 5:
			q->payload_frames = pick_u32();
			break;
		case 6:
			q->dtype = chance(50) ? below(5) : pick_u32();
			break;
		case 7:
			q->has_shm = true;
			q->shm_id = chance(50) ? q->shm_id : pick_u64();
			q->shm_offset = pick_u64();
			break;
		case 8:
			q->has_shm = true;
			q->shm_length = pick_u64();
			break;
		case 9:
			q->shm_size = pick_u64();
			break;
		case 10:
			q->metric = chance(50) ? below(3) : pick_u32();
			break;
		case 11:
			q->session_id = chance(30) ? 0 : pick_u64();
			break;
		case 12:
			q->layer = pick_u32();
			break;
		case 13:
			q->rows = pick_u32();
			break;
		case 14:
			q->has_shm_out = true;
			q->shm_out_id = pick_u64();
			q->shm_out_offset = pick_u64();
			q->shm_out_length = pick_u64();
			break;
		case 15:
			q->rerotate = !q->rerotate;
			q->target_pos = pick_u32();
			break;
		case 16:
			q->shared_ring = !q->shared_ring;
			break;
		case 17:
			q->ttl = pick_u32();
			break;
		case 18:
			q->progress = chance(50) ? 1 + 8 * (uint64_t)below(1024) : pick_u64();
			break;
		case 19:
			q->has_hash = !q->has_hash;
			break;
		case 20:
			q->op = chance(80) ? below(KVBP_OP_COUNT + 2) : pick_u32();
			break;
		case 21:
			q->device_out = !q->device_out;
			break;
		case 22:
			q->attention = !q->attention; /* A as the last payload frame */
			break;
		case 23:
			/* recompute: in or out of order, in range or not */
			q->n_recompute = below(17);
			for (size_t j = 0; j < q->n_recompute; j++)
				recompute_buf[j] = chance(70) ? (int32_t)(j * 3 + below(3)) :
								(int32_t)pick_u32();
			q->recompute = q->n_recompute ? recompute_buf : NULL;
			break;
		default:
			q->request_id = pick_u64();
			break;
		}
	}
}

static void perturb_model(struct kvbp_model *m, unsigned n)
{
	for (unsigned i = 0; i < n; i++) {
		switch (below(14)) {
		case 0:
			m->desc.num_layers = pick_u32();
			break;
		case 1:
			m->desc.num_kv_heads = pick_u32();
			break;
		case 2:
			m->desc.head_dim = pick_u32();
			break;
		case 3:
			m->desc.dtype = pick_u32();
			break;
		case 4:
			m->desc.rope_theta = pick_double();
			break;
		case 5:
			m->desc.rope_style = chance(50) ? below(3) : pick_u32();
			break;
		case 6:
			m->desc.rotary_dim = pick_u32();
			break;
		case 7:
			m->desc.scaling = chance(70) ? below(6) : pick_u32();
			break;
		case 8:
			m->desc.factor = pick_double();
			break;
		case 9:
			m->desc.low_freq_factor = pick_double();
			m->desc.high_freq_factor = pick_double();
			break;
		case 10:
			m->desc.original_max_pos = pick_u32();
			m->desc.max_pos = pick_u32();
			break;
		case 11:
			m->desc.beta_fast = pick_double();
			m->desc.beta_slow = pick_double();
			break;
		case 12:
			m->desc.k_pre_rope = !m->desc.k_pre_rope;
			break;
		default:
			snprintf(m->name, sizeof(m->name), "fzr%u", below(6));
			break;
		}
	}
}

/* Samples of one op (samples.c), to start a request of that op from. */
static void sample_for_op(uint32_t op, struct kvbp_request *q)
{
	size_t idx[64], n = 0;
	const char *name;

	for (size_t i = 0; i < fuzz_sample_count() && n < 64; i++) {
		fuzz_sample(i, q, &name);
		if (q->op == op && q->version == KVBP_VERSION)
			idx[n++] = i;
	}
	if (!n) {
		memset(q, 0, sizeof(*q));
		q->version = KVBP_VERSION;
		q->op = op;
		return;
	}
	fuzz_sample(idx[below((uint32_t)n)], q, &name);
}

static struct kvbp_segment seg_buf[KVBP_SEGMENTS_MAX + 8];
static uint32_t check_buf[KVBP_CHECKS_MAX + 8];
static double ratio_buf[KVBP_CHECKS_MAX + 8];
uint8_t hash_buf[1024][KVBP_HASH_LEN];

static void gen_fuse(struct msg *m);

/* A request of a random op, shaped like a real one, with known names and random values. */
static void gen_op(struct msg *m)
{
	struct kvbp_request q;
	uint32_t op = chance(97) ? 1 + below(KVBP_OP_COUNT - 1) : pick_u32();
	int mi = pick_model();

	if ((op == KVBP_OP_FUSE_OPEN || op == KVBP_OP_FUSE_LAYER) && chance(70)) {
		gen_fuse(m);
		return;
	}
	sample_for_op(op, &q);
	q.request_id = next_id++;
	m->id = q.request_id;
	m->know_id = true;
	if (q.model_name[0] || chance(10))
		set_model_name(&q, mi);
	if (q.has_hash)
		set_hash(q.hash, mi);
	if (q.has_model) {
		if (mi >= 0 && chance(40))
			q.model = models[mi].m;
		perturb_model(&q.model, below(4));
	}
	if (q.n_hashes) {
		size_t n = chance(80) ? 1 + below(16) : below(1024);

		for (size_t i = 0; i < n; i++)
			set_hash(hash_buf[i], mi);
		q.hashes = hash_buf;
		q.n_hashes = n;
	}
	if (q.has_shm) {
		uint64_t want = mi >= 0 ? 2 * models[mi].m.desc.num_layers *
						  tensor_bytes(mi, q.num_tokens) : 4096;

		set_shm(&q.shm_id, &q.shm_offset, &q.shm_length, want);
		shm_fill(q.shm_id, q.shm_offset, q.shm_length);
		if (q.progress)
			q.progress = chance(70) ? 1 + 8 * (uint64_t)below(64) : pick_u64();
	}
	if (op == KVBP_OP_SHM_ATTACH) {
		q.shm_size = chance(60) ? (uint64_t)(1 + below(64)) << 12 : pick_u64();
		m->learn = LEARN_SHM_ATTACH;
	}
	if (op == KVBP_OP_SHM_DETACH && n_shms && chance(10)) {
		int i = (int)below((uint32_t)n_shms);

		q.shm_id = shms[i].id;
		shm_forget(i);
	}
	if (q.has_hash && q.op == op && (op == KVBP_OP_GET || op == KVBP_OP_PIN ||
					 op == KVBP_OP_DELETE || op == KVBP_OP_UNPIN)) {
		m->learn = LEARN_CHUNK;
		m->learn_delete = op == KVBP_OP_DELETE;
		memcpy(m->learn_hash, q.hash, KVBP_HASH_LEN);
	}
	if (op == KVBP_OP_GET && chance(30)) {
		q.layer_begin = below(4);
		q.layer_end = below(5);
	}
	if (op == KVBP_OP_PIN)
		q.ttl = chance(60) ? 1 + below(30) : pick_u32();
	if (op == KVBP_OP_FUSE_LAYER || op == KVBP_OP_FUSE_CLOSE) {
		const struct session_info *s = &sessions[below(MAX_SESSIONS)];

		q.session_id = s->open && chance(70) ? s->id : pick_u64();
	}
	perturb(&q, chance(50) ? 0 : 1 + below(3));
	if (q.op == KVBP_OP_SHM_DETACH && m->learn == LEARN_NONE) {
		m->learn = LEARN_SHM_DETACH;
		m->learn_session = q.shm_id;
	}
	if (q.op == KVBP_OP_PUT && !q.has_shm) {
		uint32_t tokens = q.num_tokens;

		if (tokens > 4096 && chance(80))
			tokens = q.num_tokens = 1 + below(64);
		put_payload(m, &q, mi, tokens);
		if (mi >= 0 && q.has_hash) {
			m->learn = LEARN_PUT;
			m->learn_model = mi;
			m->learn_tokens = q.num_tokens;
			memcpy(m->learn_hash, q.hash, KVBP_HASH_LEN);
		}
		m->id = q.request_id;
		return;
	}
	msg_add_header(m, &q);
	m->id = q.request_id;
	/* Payload where none belongs, now and then. */
	if (chance(5))
		for (uint32_t i = 0, n = 1 + below(4); i < n; i++)
			msg_add(m, NULL, below(64));
}

/* A correct PUT of a fresh chunk: grows the state the other generators use. */
void gen_put(struct msg *m, int mi, uint32_t tokens)
{
	struct kvbp_request q;
	uint64_t tb = tensor_bytes(mi, tokens);

	memset(&q, 0, sizeof(q));
	q.version = KVBP_VERSION;
	q.request_id = next_id++;
	q.op = KVBP_OP_PUT;
	snprintf(q.model_name, sizeof(q.model_name), "%s", models[mi].m.name);
	q.has_hash = true;
	fill_random(q.hash, KVBP_HASH_LEN);
	q.num_tokens = tokens;
	q.base_pos = chance(70) ? 0 : below(100000);
	q.dtype = models[mi].m.desc.dtype;
	m->id = q.request_id;
	m->know_id = true;
	m->learn = LEARN_PUT;
	m->learn_model = mi;
	m->learn_tokens = tokens;
	memcpy(m->learn_hash, q.hash, KVBP_HASH_LEN);
	if (n_shms && chance(30)) {
		q.has_shm = true;
		set_shm(&q.shm_id, &q.shm_offset, &q.shm_length,
			2 * models[mi].m.desc.num_layers * tb);
		shm_fill(q.shm_id, q.shm_offset, q.shm_length);
		msg_add_header(m, &q);
		return;
	}
	q.payload_frames = 2 * models[mi].m.desc.num_layers;
	msg_add_header(m, &q);
	for (uint32_t i = 0; i < q.payload_frames; i++)
		msg_add(m, NULL, (size_t)tb);
}

/* Fuse flows: open, layers in and out of order, close, with right and wrong values. */
/* A value that breaks a stride or an offset: near 2^64 (a wrap), huge, zero, odd. */
static uint64_t hostile_u64(void)
{
	switch (below(5)) {
	case 0:
		return UINT64_MAX - below(8);
	case 1:
		return (uint64_t)1 << (32 + below(32));
	case 2:
		return 0;
	case 3:
		return UINT64_MAX / (2 + below(64));
	default:
		return pick_u64();
	}
}

/*
 * A landing layout for FUSE_OPEN of n tokens of model mi into one of our segments
 * (issue 30): contiguous, paged, with K's own strides (vLLM's CPU layout transposes K
 * per page), mostly fitting the segment, and often with one to three fields made
 * hostile. The daemon must refuse what does not fit, and never write outside the
 * segment named (the canary and the guard pages see it).
 */
static void gen_layout(struct kvbp_request *q, int mi, uint64_t n)
{
	static uint32_t page_buf[256];
	const struct kvbp_model *md = &models[mi].m;
	const struct shm_info *s = landseg.map && (!n_shms || chance(70))
					   ? &landseg : &shms[below((uint32_t)n_shms)];
	uint64_t e = md->desc.dtype == 3 ? 4 : 2,
		 row = (uint64_t)md->desc.num_kv_heads * md->desc.head_dim * e;
	uint64_t L = md->desc.num_layers, side;
	struct kvbp_layout *y = &q->land;

	if (!n)
		n = 1;
	memset(y, 0, sizeof(*y));
	q->has_land = true;
	y->shm_id = chance(95) ? s->id : pick_u64();
	y->token_stride = row;
	y->head_stride = md->desc.head_dim * e;
	y->layer_stride = n * row;
	if (chance(35)) { /* paged: a block table, pages in any order */
		uint32_t pt = 1 + below(16), np = (uint32_t)((n + pt - 1) / pt);

		if (np > 256)
			np = 256;
		y->page_tokens = pt;
		y->page_stride = pt * row;
		for (uint32_t i = 0; i < np; i++)
			page_buf[i] = chance(95) ? below(np) : pick_u32();
		y->pages = page_buf;
		y->n_pages = chance(90) ? np : below(np + 1);
		y->layer_stride = np * y->page_stride;
	}
	if (chance(35)) { /* K by its own strides: transposed per page, or per token */
		y->k_dim_stride = y->page_tokens ? (uint64_t)y->page_tokens * e : e;
		y->k_token_stride = y->page_tokens ? e : row;
		y->k_head_stride = md->desc.head_dim * (y->page_tokens ? y->page_tokens * e : e);
	}
	side = L * y->layer_stride;
	y->k_offset = 0;
	y->v_offset = side;
	y->progress = 2 * side;
	if (y->progress + 4 > s->size || chance(10))
		y->progress = 4 * (uint64_t)below((uint32_t)(s->size / 4));
	/* into device memory (issue 55, defect 3): by our own handle, or one the daemon
	 * must refuse (another process's, a path to our memfd or to the daemon's own
	 * descriptors, a token never handed in, bytes) */
	if (chance(12)) {
		uint8_t *h = y->device_handle;

		y->has_device = true;
		memset(h, 0, KVBP_DEVICE_HANDLE_LEN);
		snprintf(y->device_pci, sizeof(y->device_pci), "%s",
			 chance(90) ? "emulated" : "0000:3b:00.0");
		y->device_bytes = chance(90) ? DEV_BYTES : pick_u64();
		switch (below(6)) {
		case 0:
			if (devh.own[0]) {
				memcpy(h, devh.own, KVBP_DEVICE_HANDLE_LEN);
				break;
			}
			/* fall through */
		case 1:
			if (devh.foreign[0]) {
				memcpy(h, devh.foreign, KVBP_DEVICE_HANDLE_LEN);
				break;
			}
			/* fall through */
		case 2:
			snprintf((char *)h, KVBP_DEVICE_HANDLE_LEN, "emu:/proc/%ld/fd/%u",
				 wf_opt.pid > 0 ? wf_opt.pid : (long)getpid(), below(64));
			break;
		case 3:
			snprintf((char *)h, KVBP_DEVICE_HANDLE_LEN, "emu:/proc/%d/fd/%d",
				 devh.child > 0 ? devh.child : (int)getpid(), devh.foreign_fd);
			break;
		case 4:
			snprintf((char *)h, KVBP_DEVICE_HANDLE_LEN, "kvbfd:%016" PRIx64, pick_u64());
			break;
		default:
			fill_random(h, KVBP_DEVICE_HANDLE_LEN);
			break;
		}
	}
	for (uint32_t k = chance(50) ? 1 + below(3) : 0; k > 0; k--) {
		uint64_t v = hostile_u64();

		switch (below(11)) {
		case 0: y->k_offset = v; break;
		case 1: y->v_offset = v; break;
		case 2: y->layer_stride = v; break;
		case 3: y->token_stride = v; break;
		case 4: y->head_stride = v; break;
		case 5: y->page_stride = v; break;
		case 6: y->progress = v & ~(uint64_t)3; break;
		case 7: y->k_token_stride = v; break;
		case 8: y->k_head_stride = v; break;
		case 9: y->k_dim_stride = v; break;
		default: y->page_tokens = (uint32_t)v; break;
		}
	}
}

static void gen_fuse(struct msg *m)
{
	struct kvbp_request q;
	int si = (int)below(MAX_SESSIONS), mi, open[MAX_SESSIONS], n_open = 0;
	struct session_info *s;

	for (int i = 0; i < MAX_SESSIONS; i++)
		if (sessions[i].open)
			open[n_open++] = i;
	if (n_open && chance(75))
		si = open[below((uint32_t)n_open)];
	if (sessions[si].open && chance(15)) {
		/* Open another: in a free slot, so that no session of ours is forgotten open. */
		for (int i = 0; i < MAX_SESSIONS; i++)
			if (!sessions[i].open)
				si = i;
	}
	s = &sessions[si];

	memset(&q, 0, sizeof(q));
	q.version = KVBP_VERSION;
	q.request_id = next_id++;
	m->id = q.request_id;
	m->know_id = true;
	if (n_orphans) {
		q.op = KVBP_OP_FUSE_CLOSE;
		q.session_id = orphans[--n_orphans];
		msg_add_header(m, &q);
		return;
	}
	if (!s->open) {
		uint32_t pos = 0, n_seg = chance(90) ? 1 + below(5) : below(KVBP_SEGMENTS_MAX + 2);
		uint32_t layers;

		mi = pick_model();
		if (mi < 0) {
			gen_op(m);
			return;
		}
		layers = models[mi].m.desc.num_layers;
		q.op = KVBP_OP_FUSE_OPEN;
		snprintf(q.model_name, sizeof(q.model_name), "%s", models[mi].m.name);
		for (uint32_t i = 0; i < n_seg; i++) {
			struct kvbp_segment *g = &seg_buf[i];
			const struct chunk_info *c = pick_chunk(mi);

			memset(g, 0, sizeof(*g));
			if (c && chance(65)) {
				memcpy(g->hash, c->hash, KVBP_HASH_LEN);
				g->pos = pos;
				pos += c->tokens;
			} else if (chance(85)) {
				g->fresh = true;
				g->count = 1 + below(20);
				g->pos = pos;
				pos += g->count;
			} else {
				g->fresh = chance(50);
				if (!g->fresh)
					fill_random(g->hash, KVBP_HASH_LEN);
				g->count = pick_u32();
				g->pos = pick_u32();
			}
			if (chance(5))
				g->pos = chance(50) ? (i ? seg_buf[i - 1].pos : 0) : pick_u32();
		}
		q.segments = seg_buf;
		q.n_segments = n_seg;
		/* Increasing check layers inside the model, non-increasing ratios in [0, 1]. */
		q.n_checks = 0;
		for (uint32_t l = below(layers); l < layers && q.n_checks < 3; l += 1 + below(2))
			check_buf[q.n_checks++] = l;
		q.n_ratios = q.n_checks;
		for (size_t i = 0; i < q.n_ratios; i++)
			ratio_buf[i] = (i ? ratio_buf[i - 1] : 1.0) * (double)below(101) / 100;
		/* and now and then not */
		if (chance(10))
			q.n_checks = below(KVBP_CHECKS_MAX + 1);
		if (chance(5))
			q.n_ratios = below(5);
		for (size_t i = 0; i < q.n_checks; i++)
			if (chance(3))
				check_buf[i] = pick_u32();
		for (size_t i = 0; i < q.n_ratios; i++)
			if (chance(3))
				ratio_buf[i] = pick_double();
		q.check_layers = check_buf;
		q.ratios = ratio_buf;
		q.metric = chance(90) ? below(3) : pick_u32(); /* value, key, attention */
		if (chance(10)) {
			/* reuse only with a selection of the node's (often valid: increasing) */
			q.n_checks = q.n_ratios = 0;
			q.reuse_only = true;
			q.n_recompute = below(17);
			for (size_t i = 0; i < q.n_recompute; i++)
				recompute_buf[i] = chance(90) ? (int32_t)(i * 3 + below(3)) :
								(int32_t)pick_u32();
			q.recompute = q.n_recompute ? recompute_buf : NULL;
		}
		if ((n_shms || landseg.map) && chance(40)) {
			gen_layout(&q, mi, pos);
			m->landing = true;
			m->land_shm = q.land.shm_id;
			if (chance(60)) { /* otherwise sound, reuse only: it lands at once */
				q.reuse_only = true;
				q.n_checks = q.n_ratios = q.n_recompute = 0;
				q.recompute = NULL;
				q.metric = 0;
			}
		}
		q.shared_ring = chance(30);
		q.device_out = chance(30); /* export the device ring (a device daemon) */
		if (chance(10))
			perturb(&q, 1);
		m->id = q.request_id;
		m->learn = LEARN_FUSE_OPEN;
		m->learn_idx = si;
		m->learn_model = mi;
		msg_add_header(m, &q);
		return;
	}
	mi = s->model;
	q.session_id = chance(95) ? s->id : s->id ^ (1ull << below(64));
	if (chance(10) || sessions_full ||
	    (s->next_layer >= models[mi].m.desc.num_layers && chance(90))) {
		sessions_full = false;
		q.op = KVBP_OP_FUSE_CLOSE;
		m->learn = LEARN_FUSE_CLOSE;
		m->learn_idx = si;
		m->learn_session = q.session_id;
		msg_add_header(m, &q);
		return;
	}
	q.op = KVBP_OP_FUSE_LAYER;
	q.layer = chance(80) ? s->next_layer : chance(50) ? s->next_layer + 1 - 2 * below(2) :
								 pick_u32();
	q.rows = chance(85) ? s->rows_next : chance(50) ? s->rows_next + 1 : pick_u32();
	q.device_out = chance(15); /* keep the layer on the device: refused unless exported */
	m->learn = LEARN_FUSE_LAYER;
	m->learn_idx = si;
	{
		uint64_t in = tensor_bytes(mi, q.rows);

		if (in > (1u << 20))
			in = 1u << 20;
		if (n_shms && chance(25)) {
			q.has_shm = true;
			set_shm(&q.shm_id, &q.shm_offset, &q.shm_length, 2 * in);
			shm_fill(q.shm_id, q.shm_offset, q.shm_length);
			if (chance(20)) {
				q.has_shm_out = true;
				set_shm(&q.shm_out_id, &q.shm_out_offset, &q.shm_out_length, 2 * in);
			}
			msg_add_header(m, &q);
			return;
		}
		/* A (attention metric): chunk tokens x heads floats, as far as the generator
		 * knows them (the session's tokens, some of them fresh), or a wrong size. */
		q.attention = chance(20);
		q.payload_frames = (chance(90) ? 2 : below(5)) + q.attention;
		msg_add_header(m, &q);
		for (uint32_t i = 0, n = chance(90) ? 2 : below(5); i < n; i++) {
			size_t len = (size_t)in;

			if (chance(10))
				len = chance(50) || !len ? len + 1 + below(2) : len - 1;
			msg_add(m, NULL, len);
		}
		if (q.attention)
			msg_add(m, NULL, chance(80) ? 4 * (size_t)models[mi].m.desc.num_kv_heads *
							  (s->tokens - below(s->tokens + 1)) :
						      below(4096));
	}
}

/* A real request, then its header bytes mutated. */
static void gen_mutated(struct msg *m)
{
	uint8_t *h;
	size_t len;

	if (chance(30))
		gen_fuse(m);
	else
		gen_op(m);
	if (!m->n)
		return;
	m->know_id = false;
	m->learn = LEARN_NONE;
	h = m->f[0].data;
	len = m->f[0].len;
	for (unsigned k = 0, n = 1 + below(8); k < n; k++) {
		size_t at = len ? below((uint32_t)len) : 0;

		switch (below(7)) {
		case 0:
			if (len)
				h[at] ^= (uint8_t)(1u << below(8));
			break;
		case 1: {
			static const uint8_t v[] = { 0, 0x01, 0x7f, 0x80, 0xff };

			if (len)
				h[at] = v[below(5)];
			break;
		}
		case 2:
			if (len)
				len = below((uint32_t)len);
			break;
		case 3:
		case 4: { /* insert random bytes, or a copy of a piece of itself */
			size_t add = 1 + below(16);
			uint8_t *nb = malloc(len + add);

			if (!nb)
				abort();
			memcpy(nb, h, at);
			if (k & 1 && len >= add)
				memcpy(nb + at, h + below((uint32_t)(len - add + 1)), add);
			else
				fill_random(nb + at, add);
			memcpy(nb + at + add, h + at, len - at);
			free(h);
			h = nb;
			len += add;
			break;
		}
		case 5:
			if (len > 2) {
				size_t cut = 1 + below((uint32_t)(len - at));

				memmove(h + at, h + at + cut, len - at - cut);
				len -= cut;
			}
			break;
		default: /* a varint byte with its continuation bit set at the very end */
			if (len)
				h[len - 1] |= 0x80;
			break;
		}
	}
	m->f[0].data = h;
	m->f[0].len = len;
}

/* Frame-level oddities: envelopes, counts, sizes. */
static void gen_frames(struct msg *m)
{
	switch (below(9)) {
	case 0: /* only the delimiter, or nothing but empty frames */
		for (uint32_t i = 0, n = below(4); i < n; i++)
			msg_add(m, "", 0);
		m->delim = chance(80);
		if (!m->delim && !m->n)
			msg_add(m, "", 0);
		break;
	case 1: /* empty frames before the header */
		for (uint32_t i = 0, n = 1 + below(3); i < n; i++)
			msg_add(m, "", 0);
		gen_op(m);
		m->know_id = false;
		break;
	case 2: { /* many payload frames, around the daemon's per-message frame cap */
		static const uint32_t ns[] = { 30, 40, 41, 42, 43, 100, 2060, 5000 };
		struct kvbp_request q;
		int mi = pick_model();
		uint32_t n = ns[below(8)];

		memset(&q, 0, sizeof(q));
		q.version = KVBP_VERSION;
		q.request_id = next_id++;
		q.op = chance(50) ? KVBP_OP_PUT : 1 + below(KVBP_OP_COUNT - 1);
		if (mi >= 0)
			snprintf(q.model_name, sizeof(q.model_name), "%s", models[mi].m.name);
		q.has_hash = true;
		fill_random(q.hash, KVBP_HASH_LEN);
		q.num_tokens = 1;
		q.payload_frames = n;
		msg_add_header(m, &q);
		m->id = q.request_id;
		m->know_id = true;
		for (uint32_t i = 0; i < n; i++)
			msg_add(m, NULL, mi >= 0 ? models[mi].row : 4);
		break;
	}
	case 3: /* random bytes as the header */
		msg_add(m, NULL, below(200));
		break;
	case 4: /* a big payload frame: under, at and over max_message */
	{
		uint64_t sizes[] = { wf_opt.max_message - 1, wf_opt.max_message + 1,
				     wf_opt.max_message + (1u << 20) + 1 };
		size_t len = (size_t)sizes[below(3)];

		gen_op(m);
		msg_add(m, NULL, len);
		break;
	}
	case 5: /* a frame over the hard cap: ZeroMQ drops the connection, no reply comes */
		if (chance(10)) {
			gen_op(m);
			msg_add(m, NULL, (size_t)(2 * wf_opt.max_message + 1));
			m->expect_reply = false;
		} else {
			gen_op(m);
		}
		break;
	default: /* a real request without the delimiter */
		gen_op(m);
		m->delim = false;
		break;
	}
	if (chance(20))
		m->delim = !m->delim;
	if (!m->delim && !m->n)
		msg_add(m, "", 0);
}

const char *const kind_names[WF_KINDS] = { "op", "fuse", "put", "mutated", "handmade",
					    "frames", "peer" };

void generate(struct msg *m)
{
	unsigned k = below(100);

	if (k < 30) {
		msg_init(m, kind_names[0]);
		gen_op(m);
	} else if (k < 50) {
		msg_init(m, kind_names[1]);
		gen_fuse(m);
	} else if (k < 55 && n_models) {
		int mi = pick_model();

		msg_init(m, kind_names[2]);
		gen_put(m, mi, 1 + below(chance(90) ? 48 : 2000));
	} else if (k < 75) {
		msg_init(m, kind_names[3]);
		gen_mutated(m);
	} else if (k < 82) {
		msg_init(m, kind_names[4]);
		gen_handmade(m);
	} else if (k < 88) {
		msg_init(m, kind_names[6]);
		gen_peer(m);
	} else {
		msg_init(m, kind_names[5]);
		gen_frames(m);
	}
	if (chance(5))
		m->delim = false;
	if (!m->delim && !m->n)
		msg_add(m, "", 0);
}
