/*
 * wire_fuzz_state — what fuzz_wire_daemon knows of the daemon it fuzzes (wire_fuzz.h):
 * the models it registered, the chunks it stored, the segments it attached, the fuse
 * sessions it opened. setup() makes a little of each; learn() keeps them up to date
 * from the replies, so that the generators aim at things the daemon has.
 */
#include <fcntl.h>
#include <stdbool.h>
#include <stdint.h>
#include <string.h>
#include <sys/mman.h>
#include <unistd.h>

#include "samples.h"
#include "wire.h"
#include "wire_fuzz.h"

uint64_t next_id = 1;

struct model_info models[MAX_MODELS];
int n_models;
struct chunk_info chunks[MAX_CHUNKS];
int n_chunks;
struct shm_info shms[MAX_SHMS];
int n_shms;
struct session_info sessions[MAX_SESSIONS];
bool sessions_full; /* an open hit fuse_max_sessions: close one of ours next */
/* Sessions opened by messages that did not mean to (mutated ones): closed at once. */
uint64_t orphans[16];
unsigned n_orphans;

/* ---- state learned from replies ---- */

void shm_forget(int i)
{
	if (shms[i].map)
		munmap(shms[i].map, shms[i].size);
	shms[i] = shms[--n_shms];
	memset(&shms[n_shms], 0, sizeof(shms[n_shms]));
}

static void learn_shm(const struct kvbp_reply *rep)
{
	struct shm_info s = { rep->shm_id, rep->shm_size, NULL };
	int fd;

	if (!rep->shm_id || !rep->shm_name[0])
		return;
	if (rep->shm_size && rep->shm_size <= SHM_MAP_MAX) {
		fd = shm_open(rep->shm_name, O_RDWR, 0);
		if (fd >= 0) {
			void *p = mmap(NULL, rep->shm_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);

			if (p != MAP_FAILED)
				s.map = p;
			close(fd);
		}
	}
	if (n_shms == MAX_SHMS)
		shm_forget((int)below(MAX_SHMS));
	shms[n_shms++] = s;
}

/* A chunk the daemon no longer has (deleted, evicted, removed as corrupt). */
static void forget_chunk(const uint8_t *hash)
{
	for (int i = 0; i < n_chunks; i++)
		if (!memcmp(chunks[i].hash, hash, KVBP_HASH_LEN)) {
			chunks[i] = chunks[--n_chunks];
			return;
		}
}

void learn(const struct msg *m, const struct kvbp_reply *rep)
{
	struct session_info *s;

	if (rep->code == KVBP_OK && rep->session_id && m->learn != LEARN_FUSE_OPEN &&
	    n_orphans < sizeof(orphans) / sizeof(*orphans))
		orphans[n_orphans++] = rep->session_id;
	switch (m->learn) {
	case LEARN_NONE:
		break;
	case LEARN_PUT:
		/* (one stored already counts when it is the same chunk: the seeded run after the
		 * corpus replay PUTs the replay's hashes again) */
		if (rep->code == KVBP_OK && n_chunks < MAX_CHUNKS &&
		    (!rep->existed || (rep->n_chunks == 1 &&
				       rep->chunks[0].num_tokens == m->learn_tokens))) {
			struct chunk_info *c = &chunks[n_chunks++];

			c->model = m->learn_model;
			c->tokens = m->learn_tokens;
			memcpy(c->hash, m->learn_hash, KVBP_HASH_LEN);
		}
		break;
	case LEARN_SHM_ATTACH:
		if (rep->code == KVBP_OK)
			learn_shm(rep);
		break;
	case LEARN_CHUNK:
		if (rep->code == KVBP_NOT_FOUND || (m->learn_delete && rep->code == KVBP_OK))
			forget_chunk(m->learn_hash);
		break;
	case LEARN_FUSE_OPEN:
		if (rep->code == KVBP_NOT_FOUND)
			for (size_t i = 0; i < rep->n_chunks; i++)
				forget_chunk(rep->chunks[i].hash);
		if (rep->code == KVBP_LIMIT)
			sessions_full = true;
		if (rep->code != KVBP_OK || m->learn_idx < 0)
			break;
		s = &sessions[m->learn_idx];
		s->open = true;
		s->id = rep->session_id;
		s->model = m->learn_model;
		s->tokens = rep->num_tokens;
		s->next_layer = rep->next_layer;
		s->rows_next = rep->rows_next;
		break;
	case LEARN_FUSE_LAYER:
		if (m->learn_idx < 0)
			break;
		s = &sessions[m->learn_idx];
		if (rep->code == KVBP_OK) {
			s->next_layer = rep->next_layer;
			s->rows_next = rep->rows_next;
		} else if (rep->code == KVBP_UNKNOWN_SESSION) {
			s->open = false;
		}
		break;
	case LEARN_FUSE_CLOSE:
		/* Closed, or gone; unless the request named it wrong on purpose. */
		if (m->learn_idx >= 0 && m->learn_session == sessions[m->learn_idx].id &&
		    (rep->code == KVBP_OK || rep->code == KVBP_UNKNOWN_SESSION))
			sessions[m->learn_idx].open = false;
		break;
	}
}

/* ---- setup: models, chunks and a segment for the generators to aim at ---- */

static bool setup_request(struct msg *m, struct kvbp_reply *rep)
{
	struct msg r;
	double deadline = now_s() + wf_opt.ping_ms / 1000.0;

	if (send_msg(wf_ctrl, m))
		return false;
	while (now_s() < deadline) {
		char err[256];

		if (recv_msg(wf_ctrl, 200, &r) <= 0)
			continue;
		if (r.n >= 2 && kvbp_reply_decode(r.f[1].data, r.f[1].len, rep, err,
						  sizeof(err)) == 0) {
			msg_free(&r);
			if (rep->request_id == m->id)
				return true;
			kvbp_reply_clear(rep);
			continue;
		}
		msg_free(&r);
	}
	return false;
}

int setup(void)
{
	static const size_t model_samples[] = { 1, 2, 3 };
	double deadline = now_s() + 30;
	struct kvbp_reply rep;
	bool up = false;

	/* The daemon may still be starting: HELLO until it answers. */
	while (!up && now_s() < deadline) {
		int saved = wf_opt.ping_ms;

		if (!process_alive()) {
			say("the daemon (pid %ld) is not running", wf_opt.pid);
			return -1;
		}
		wf_opt.ping_ms = 500;
		up = ping_one(KVBP_OP_HELLO, &rep);
		wf_opt.ping_ms = saved;
		if (up)
			kvbp_reply_clear(&rep);
	}
	if (!up) {
		say("no answer from %s within 30 s", wf_opt.endpoint);
		return -1;
	}
	for (size_t i = 0; i < sizeof(model_samples) / sizeof(*model_samples); i++) {
		struct kvbp_request q;
		const char *name;
		struct msg m;

		fuzz_sample(model_samples[i], &q, &name);
		q.request_id = next_id++;
		msg_init(&m, "setup");
		msg_add_header(&m, &q);
		m.id = q.request_id;
		if (!setup_request(&m, &rep)) {
			msg_free(&m);
			say("setup: no answer to MODEL_REGISTER");
			return -1;
		}
		msg_free(&m);
		if (rep.code == KVBP_OK && rep.n_models == 1) {
			struct model_info *mi = &models[n_models++];

			mi->m = rep.models[0];
			mi->row = (size_t)mi->m.num_kv_heads * mi->m.head_dim *
				  kvbp_dtype_size(mi->m.dtype);
		} else {
			say("setup: MODEL_REGISTER %s: %s %s", q.model.name, kvbp_code_name(rep.code),
			    rep.message);
		}
		kvbp_reply_clear(&rep);
	}
	if (!n_models) {
		say("setup: no model could be registered");
		return -1;
	}
	/* A segment to point PUTs, GETs and fuse layers at. */
	{
		struct kvbp_request q = { .version = KVBP_VERSION, .op = KVBP_OP_SHM_ATTACH,
					  .shm_size = 1u << 20 };
		struct msg m;

		q.request_id = next_id++;
		msg_init(&m, "setup");
		msg_add_header(&m, &q);
		m.id = q.request_id;
		if (setup_request(&m, &rep)) {
			if (rep.code == KVBP_OK)
				learn_shm(&rep);
			kvbp_reply_clear(&rep);
		}
		msg_free(&m);
	}
	for (int i = 0; i < 4 * n_models; i++) {
		struct msg m;

		msg_init(&m, "setup");
		gen_put(&m, i % n_models, 1 + below(40));
		if (setup_request(&m, &rep)) {
			learn(&m, &rep);
			kvbp_reply_clear(&rep);
		}
		msg_free(&m);
	}
	setup_templates();
	say("setup: %d models, %d chunks, %d shared-memory segments, %d stored chunks to "
	    "replicate", n_models, n_chunks, n_shms, n_tmpls);
	return 0;
}
