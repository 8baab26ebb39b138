/*
 * wire_fuzz_state — what fuzz_wire_daemon knows of the daemon it fuzzes (wire_fuzz.h):
 * the models it registered, the chunks it stored, the segments it attached, the fuse
 * sessions it opened. setup() makes a little of each; learn() keeps them up to date
 * from the replies, so that the generators aim at things the daemon has.
 */
#include <fcntl.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <inttypes.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "tests/fuzz/samples.h"
#include "proto/wire.h"
#include "tests/fuzz/wire_fuzz.h"

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

struct shm_info canary, landseg;
struct dev_handles devh;
static char desc_path[108]; /* the daemon's descriptor socket (an SHM_ATTACH reply's) */

int shms_mapped(void)
{
	int n = 0;

	for (int i = 0; i < n_shms; i++)
		n += shms[i].map != NULL;
	return n;
}

size_t canary_changed(void)
{
	for (size_t i = 0; canary.map && i < canary.size; i++)
		if (canary.map[i] != CANARY_BYTE)
			return i + 1;
	/* another process's memory, by its handle: never written for us either */
	for (size_t i = 0; devh.foreign_map && i < DEV_BYTES; i++)
		if (devh.foreign_map[i] != CANARY_BYTE)
			return i + 1;
	return 0;
}

/* A PUT that reads its tensors from segment s: s counts as used (shm_idle). */
static void segment_keep(const struct shm_info *s)
{
	struct kvbp_request q;
	struct kvbp_reply rep;
	uint64_t tb;

	if (!s->map || !n_models)
		return;
	memset(&q, 0, sizeof(q));
	tb = (uint64_t)models[0].m.desc.num_kv_heads * models[0].m.desc.head_dim *
	     (models[0].m.desc.dtype == 3 ? 4 : 2);
	snprintf(q.model_name, sizeof(q.model_name), "%s", models[0].m.name);
	q.has_hash = true;
	fill_random(q.hash, KVBP_HASH_LEN);
	q.num_tokens = 1;
	q.has_shm = true;
	q.shm_id = s->id;
	q.shm_length = 2 * (uint64_t)models[0].m.desc.num_layers * tb;
	if (q.shm_length > s->size)
		return;
	memset(&rep, 0, sizeof(rep));
	ping_one(KVBP_OP_PUT, &q, &rep); /* (ok, or full, or anything: the read is what counts) */
	kvbp_reply_clear(&rep);
}

void canary_keep(void)
{
	segment_keep(&canary);
	segment_keep(&landseg);
}

void shm_forget(int i)
{
	if (shms[i].map)
		munmap(shms[i].map, shms[i].size);
	shms[i] = shms[--n_shms];
	memset(&shms[n_shms], 0, sizeof(shms[n_shms]));
}

/*
 * The descriptor of segment id, from the daemon's descriptor socket at path (shm.h:
 * the 8-byte id, little-endian; one status byte back with the descriptor). -1 if not.
 */
static int shm_fetch_fd(const char *path, uint64_t id)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	uint8_t req[8], status = 1;
	union {
		char buf[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} u;
	struct iovec iov = { &status, 1 };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			     .msg_controllen = sizeof(u.buf) };
	struct cmsghdr *cm;
	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0), fd = -1;

	if (s < 0)
		return -1;
	snprintf(a.sun_path, sizeof(a.sun_path), "%s", path);
	for (int i = 0; i < 8; i++)
		req[i] = (uint8_t)(id >> (8 * i));
	if (connect(s, (struct sockaddr *)&a, sizeof(a)) == 0 &&
	    send(s, req, sizeof(req), MSG_NOSIGNAL) == sizeof(req) && recvmsg(s, &mh, 0) == 1 &&
	    status == 0 && (cm = CMSG_FIRSTHDR(&mh)) && cm->cmsg_type == SCM_RIGHTS)
		memcpy(&fd, CMSG_DATA(cm), sizeof(fd));
	close(s);
	return fd;
}

/* A segment attached (rep: SHM_ATTACH's reply), mapped here: 0 and *out, or -1. */
int shm_map_reply(const struct kvbp_reply *rep, struct shm_info *out)
{
	struct shm_info s = { rep->shm_id, rep->shm_size, NULL };
	int fd;

	if (!rep->shm_id || !rep->shm_name[0] || !rep->shm_size || rep->shm_size > SHM_MAP_MAX)
		return -1;
	fd = shm_fetch_fd(rep->shm_name, rep->shm_id);
	if (fd < 0)
		return -1;
	snprintf(desc_path, sizeof(desc_path), "%s", rep->shm_name);
	s.map = mmap(NULL, rep->shm_size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (s.map == MAP_FAILED)
		return -1;
	*out = s;
	return 0;
}

/* Segment s among the known ones (the oldest random one makes room). */
static void learn_shm_info(const struct shm_info *s)
{
	if (n_shms == MAX_SHMS)
		shm_forget((int)below(MAX_SHMS));
	shms[n_shms++] = *s;
}

static void learn_shm(const struct kvbp_reply *rep)
{
	struct shm_info s = { rep->shm_id, rep->shm_size, NULL };

	if (!rep->shm_id || !rep->shm_name[0])
		return;
	shm_map_reply(rep, &s); /* (unmapped when it cannot be: still a segment to name) */
	learn_shm_info(&s);
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
		if (m->landing) {
			wf_st.land_opens++;
			wf_st.land_ok += rep->code == KVBP_OK;
			wf_st.land_shape += rep->code == KVBP_BAD_SHAPE;
			/* a segment the daemon released (shm_idle) or never had: aim elsewhere */
			if (rep->code == KVBP_BAD_SHM && strstr(rep->message, "smaller than the ")) {
				unsigned long long span = strtoull(strstr(rep->message, "smaller than "
									  "the ") + 17, NULL, 10);

				for (int i = 0; i < n_shms; i++)
					if (shms[i].id == m->land_shm && span <= shms[i].size) {
						shm_forget(i);
						break;
					}
			}
		}
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
	case LEARN_SHM_DETACH:
		for (int i = 0; rep->code == KVBP_OK && i < n_shms; i++)
			if (shms[i].id == m->learn_session) {
				shm_forget(i);
				break;
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

/* SHM_ATTACH of 1 MiB: true and *out when attached (out->map: mapped here, or NULL). */
static bool setup_segment(struct shm_info *out)
{
	struct kvbp_request q = { .version = KVBP_VERSION, .op = KVBP_OP_SHM_ATTACH,
				  .shm_size = 1u << 20 };
	struct kvbp_reply rep;
	struct msg m;
	bool ok = false;

	q.request_id = next_id++;
	msg_init(&m, "setup");
	msg_add_header(&m, &q);
	m.id = q.request_id;
	if (setup_request(&m, &rep)) {
		if (rep.code == KVBP_OK) {
			*out = (struct shm_info){ rep.shm_id, rep.shm_size, NULL };
			shm_map_reply(&rep, out);
			ok = true;
		}
		kvbp_reply_clear(&rep);
	}
	msg_free(&m);
	return ok;
}

/*
 * Hand fd in on the descriptor socket (shm.h, KVBP_DEPOSIT_REQUEST): the status byte
 * (its token into *token when 0), or -1 when the socket did not answer.
 */
static int deposit(int fd, uint64_t *token)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	union {
		char buf[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} u;
	uint8_t req[28] = { 0 }, rep[9] = { 0 };
	struct iovec iov = { req, sizeof(req) };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			     .msg_controllen = sizeof(u.buf) };
	struct cmsghdr *cm;
	ssize_t got = 0, r;
	int s = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

	if (s < 0)
		return -1;
	snprintf(a.sun_path, sizeof(a.sun_path), "%s", desc_path);
	/* the magic, one segment, at offset 0, size 0 (the whole file) */
	for (int i = 0; i < 8; i++)
		req[i] = (uint8_t)(KVBP_DEPOSIT_REQUEST >> (8 * i));
	req[8] = 1;
	memset(&u, 0, sizeof(u));
	cm = CMSG_FIRSTHDR(&mh);
	cm->cmsg_level = SOL_SOCKET;
	cm->cmsg_type = SCM_RIGHTS;
	cm->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(cm), &fd, sizeof(int));
	if (connect(s, (struct sockaddr *)&a, sizeof(a)) ||
	    sendmsg(s, &mh, MSG_NOSIGNAL) != (ssize_t)sizeof(req)) {
		close(s);
		return -1;
	}
	while (got < 9 && (r = recv(s, rep + got, (size_t)(9 - got), 0)) > 0) {
		got += r;
		if (rep[0])
			break;
	}
	close(s);
	if (got < 1 || (!rep[0] && got < 9))
		return -1;
	*token = 0;
	for (int i = 8; i >= 1; i--)
		*token = *token << 8 | rep[i];
	return rep[0];
}

/* A memfd of DEV_BYTES sealed against shrinking (what the emulated device maps), or -1. */
static int dev_memfd(void)
{
	int fd = memfd_create("kvb-fuzz-dev", MFD_CLOEXEC | MFD_ALLOW_SEALING);

	if (fd >= 0 && (ftruncate(fd, DEV_BYTES) ||
			fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW))) {
		close(fd);
		fd = -1;
	}
	return fd;
}

/*
 * Device-landing handles to aim at (issue 55, defect 3): a sound one (our memfd, handed
 * in), another process's (a child hands in a memfd we map filled with CANARY_BYTE and
 * lives as long as we do: a landing by its handle must never reach it), and the daemon's
 * own segment handed in, which must be refused. -1 (said) when the daemon takes a
 * segment of its own.
 */
static int setup_device_handles(void)
{
	uint64_t token = 0;
	int fd, pipefd[2], st;

	if (!desc_path[0])
		return 0;
	fd = dev_memfd();
	if (fd >= 0 && deposit(fd, &token) == 0) {
		snprintf((char *)devh.own, sizeof(devh.own), "kvbfd:%016" PRIx64, token);
		devh.own_fd = fd; /* kept: the deposit is the daemon's copy, ours is this */
	} else if (fd >= 0) {
		close(fd);
	}
	fd = dev_memfd();
	if (fd >= 0 && !pipe(pipefd)) {
		devh.foreign_map = mmap(NULL, DEV_BYTES, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		if (devh.foreign_map == MAP_FAILED)
			devh.foreign_map = NULL;
		else
			memset(devh.foreign_map, CANARY_BYTE, DEV_BYTES);
		devh.child = fork();
		if (devh.child == 0) {
			/* another principal: hand the memfd in, say the token, live until we die */
			prctl(PR_SET_PDEATHSIG, SIGKILL);
			token = 0;
			st = deposit(fd, &token);
			if (write(pipefd[1], &token, sizeof(token)) != sizeof(token) || st)
				_exit(1);
			for (;;)
				pause();
		}
		close(pipefd[1]);
		if (devh.child > 0 && read(pipefd[0], &token, sizeof(token)) == sizeof(token) &&
		    token)
			snprintf((char *)devh.foreign, sizeof(devh.foreign), "kvbfd:%016" PRIx64,
				 token);
		close(pipefd[0]);
		devh.foreign_fd = fd;
	}
	/* the daemon's own segment, handed back in: refused (3), never a device to land in */
	fd = landseg.id ? shm_fetch_fd(desc_path, landseg.id) : -1;
	if (fd >= 0) {
		st = deposit(fd, &token);
		close(fd);
		if (st != 3) {
			say("setup: the daemon took its own segment handed in as device memory "
			    "(status %d, not 3)", st);
			return -1;
		}
	}
	return 0;
}

int setup(void)
{
	static const size_t model_samples[] = { 1, 2, 3 };
	double deadline = now_s() + 30;
	struct shm_info seg;
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
		up = ping_one(KVBP_OP_HELLO, NULL, &rep);
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
			mi->row = (size_t)mi->m.desc.num_kv_heads * mi->m.desc.head_dim *
				  kvbp_dtype_size(mi->m.desc.dtype);
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
	if (setup_segment(&seg))
		learn_shm_info(&seg);
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
	/* The canary (issue 30): a segment no request names, filled with a pattern and
	 * checked at every liveness check; a landing layout whose extent check missed a
	 * wrap writes outside its own segment, into a guard page (the daemon dies) or into
	 * another segment (this one shows it). And the segment landing layouts name most
	 * often, kept alive the same way. */
	if (setup_segment(&canary) && canary.map)
		memset(canary.map, CANARY_BYTE, canary.size);
	setup_segment(&landseg);
	if (setup_device_handles())
		return -1;
	setup_templates();
	say("setup: %d models, %d chunks, %d shared-memory segments (%d mapped here), a "
	    "canary segment%s, %d stored chunks to replicate; device handles: ours %s, "
	    "another process's %s", n_models, n_chunks, n_shms, shms_mapped(),
	    canary.map ? "" : " NOT mapped", n_tmpls, devh.own[0] ? "handed in" : "none",
	    devh.foreign[0] ? "handed in" : "none");
	return 0;
}
