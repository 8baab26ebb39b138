/*
 * wire_fuzz_peer — what members of a cluster send each other, as fuzz_wire_daemon
 * sends it (wire_fuzz.h), and the stored chunks it fetches at setup to send back mutated.
 */
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "proto/wire.h"
#include "tests/fuzz/wire_fuzz.h"

/*
 * What members send each other (FETCH, LOOKUP with local_only, REPLICATE), with model
 * names that reach into other namespaces ('#'), and REPLICATEs of real stored layers
 * (fetched at setup) mutated: bytes flipped, cut, grown, layers swapped, dropped or
 * added, another token count, another model description. The fuzzer is no member,
 * so a '#' must be refused; the rest must be checked before anything is stored.
 */
struct layer_tmpl {
	int model;
	uint32_t tokens, n;
	struct frame f[64];
};

static struct layer_tmpl tmpls[MAX_MODELS];
int n_tmpls;

static void set_peer_name(struct kvbp_request *q, int mi)
{
	const char *name = mi >= 0 ? models[mi].m.name : "fz";

	switch (chance(75) ? 0 : below(5)) {
	case 0:
		snprintf(q->model_name, sizeof(q->model_name), "%s", name);
		break;
	case 1:
		snprintf(q->model_name, sizeof(q->model_name), "t#%.50s", name);
		break;
	case 2:
		snprintf(q->model_name, sizeof(q->model_name), "#%.50s", name);
		break;
	case 3:
		snprintf(q->model_name, sizeof(q->model_name), "%.50s#", name);
		break;
	default:
		snprintf(q->model_name, sizeof(q->model_name), "a#%.20s#%.20s", name, name);
		break;
	}
}

void gen_peer(struct msg *m)
{
	struct kvbp_request q;
	int mi = pick_model();
	const struct layer_tmpl *t = n_tmpls ? &tmpls[below((uint32_t)n_tmpls)] : NULL;
	unsigned kind = below(10);

	memset(&q, 0, sizeof(q));
	q.version = KVBP_VERSION;
	q.request_id = next_id++;
	q.local_only = chance(80);
	m->id = q.request_id;
	m->know_id = true;
	if (kind < 2) { /* FETCH */
		q.op = KVBP_OP_FETCH;
		set_peer_name(&q, mi);
		q.has_hash = chance(95);
		set_hash(q.hash, mi);
		if (mi >= 0 && chance(40)) {
			q.has_model = true;
			q.model = models[mi].m;
			if (chance(30))
				/* described differently */
				q.model.desc.num_kv_heads += 1 + below(3);
		}
		msg_add_header(m, &q);
		return;
	}
	if (kind < 4) { /* LOOKUP */
		uint32_t n = 1 + below(chance(90) ? 8 : 64);

		q.op = KVBP_OP_LOOKUP;
		set_peer_name(&q, mi);
		for (uint32_t i = 0; i < n; i++)
			set_hash(hash_buf[i], mi);
		q.hashes = hash_buf;
		q.n_hashes = n;
		msg_add_header(m, &q);
		q.hashes = NULL;
		return;
	}
	/* REPLICATE */
	q.op = KVBP_OP_REPLICATE;
	if (t)
		mi = t->model;
	set_peer_name(&q, mi);
	q.has_hash = true;
	if (chance(10))
		set_hash(q.hash, mi); /* one it holds: existed */
	else
		fill_random(q.hash, KVBP_HASH_LEN);
	q.num_tokens = t ? t->tokens : 1 + below(40);
	if (chance(15))
		q.num_tokens = chance(50) ? q.num_tokens + 1 + below(4) : pick_u32();
	q.base_pos = chance(70) ? 0 : below(100000);
	if (mi >= 0 && chance(50)) {
		q.has_model = true;
		q.model = models[mi].m;
		snprintf(q.model.name, sizeof(q.model.name), "%s", q.model_name);
		if (chance(20))
			q.model.desc.head_dim = chance(50) ? q.model.desc.head_dim * 2 : pick_u32();
	}
	if (!t) {
		q.payload_frames = 1 + below(4);
		msg_add_header(m, &q);
		for (uint32_t i = 0; i < q.payload_frames; i++)
			fill_random(msg_add(m, NULL, 16 + below(256)), 16);
		return;
	}
	{
		uint32_t n = t->n, swap = below(t->n), drop = UINT32_MAX, mutate = below(8);

		if (mutate == 1 && n > 1)
			drop = below(n);
		q.payload_frames = n - (drop != UINT32_MAX) + (mutate == 2);
		msg_add_header(m, &q);
		for (uint32_t i = 0; i < n; i++) {
			const struct frame *src = &t->f[mutate == 3 ? (i == 0 ? swap : i == swap ? 0 : i) : i];
			size_t len = src->len;
			uint8_t *b;

			if (i == drop)
				continue;
			if (mutate == 4 && i == swap)
				len = below((uint32_t)len + 1); /* cut */
			if (mutate == 5 && i == swap)
				len += 1 + below(64); /* grown */
			b = msg_add(m, NULL, len);
			memcpy(b, src->data, len < src->len ? len : src->len);
			if (len > src->len)
				fill_random(b + src->len, len - src->len);
			if (mutate == 6 && i == swap && len) /* a flipped byte: header or data */
				b[chance(50) ? below((uint32_t)(len < 64 ? len : 64)) : below((uint32_t)len)] ^=
					(uint8_t)(1u << below(8));
		}
		if (mutate == 2) /* one frame too many */
			fill_random(msg_add(m, NULL, 32), 32);
	}
}

/* After setup: one chunk of each model fetched as stored, for gen_peer's REPLICATEs. */
void setup_templates(void)
{
	for (int mi = 0; mi < n_models && n_tmpls < MAX_MODELS; mi++) {
		const struct chunk_info *c = pick_chunk(mi);
		struct kvbp_request q;
		struct msg m, r;
		double deadline;

		if (!c)
			continue;
		memset(&q, 0, sizeof(q));
		q.version = KVBP_VERSION;
		q.request_id = next_id++;
		q.op = KVBP_OP_FETCH;
		q.local_only = true;
		q.has_hash = true;
		memcpy(q.hash, c->hash, KVBP_HASH_LEN);
		snprintf(q.model_name, sizeof(q.model_name), "%.*s", KVBP_NAME_MAX, models[mi].m.name);
		msg_init(&m, "setup");
		msg_add_header(&m, &q);
		if (send_msg(wf_ctrl, &m)) {
			msg_free(&m);
			continue;
		}
		msg_free(&m);
		for (deadline = now_s() + wf_opt.ping_ms / 1000.0; now_s() < deadline;) {
			struct kvbp_reply rep;
			char err[256];
			bool mine;

			if (recv_msg(wf_ctrl, 200, &r) <= 0)
				continue;
			if (r.n < 2 || kvbp_reply_decode(r.f[1].data, r.f[1].len, &rep, err,
							  sizeof(err))) {
				msg_free(&r);
				continue;
			}
			mine = rep.request_id == q.request_id;
			if (mine && rep.code == KVBP_OK && r.n - 2 <= 64 && r.n > 2) {
				struct layer_tmpl *t = &tmpls[n_tmpls++];

				t->model = mi;
				t->tokens = c->tokens;
				t->n = (uint32_t)(r.n - 2);
				for (uint32_t i = 0; i < t->n; i++) { /* taken over from the reply */
					t->f[i] = r.f[2 + i];
					r.f[2 + i].data = NULL;
					r.f[2 + i].len = 0;
				}
			}
			kvbp_reply_clear(&rep);
			msg_free(&r);
			if (mine)
				break;
		}
	}
}
