/*
 * wire_fuzz — a structured fuzzer for the wire protocol of a running kvblendd.
 *
 * It starts nothing: it connects ZeroMQ DEALER sockets to the IPC (or loopback)
 * endpoint of a daemon someone else started, sets up a little state (models,
 * chunks, a shared-memory segment), then sends, for a bounded count and time,
 * random and mutated messages: every operation with random and boundary field
 * values, mutated protobuf headers, hand-encoded headers with wrong wire types,
 * huge lengths and over-limit repeated fields, wrong frame counts and sizes, fuse
 * flows out of order, shared-memory references with random ids, offsets and
 * lengths, with and without the empty delimiter frame.
 *
 * After every --every messages, and at the end, it checks that the daemon still
 * answers: a HELLO, a STATS, and a burst of HELLOs that reaches every worker. It
 * also checks that each reply it can attribute is a well-formed Reply, and, given
 * --pid, that the process is alive. A failed check saves the last messages sent
 * (--save DIR, a .kvbw file that --replay sends again) and exits 1.
 *
 * Seeded: the same --seed makes the same choices (ids the daemon hands out differ
 * between runs, so a saved .kvbw file, not a seed, is the exact reproducer).
 *
 * usage: fuzz_wire_daemon --endpoint EP [--pid PID] [--seed N] [--count N]
 *        [--seconds S] [--every N] [--reply-ms MS] [--ping-ms MS] [--max-message BYTES]
 *        [--save DIR] [--verbose] [--replay FILE_OR_DIR ... ]
 * exit: 0 the daemon survived and answered; 1 a defect was found; 2 usage or setup.
 */
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <zmq.h>

#include "samples.h"
#include "wire.h"

#define FUZZ_SOCKETS 3
#define LOG_MSGS 256
#define MAX_MODELS 8
#define MAX_CHUNKS 64
#define MAX_SHMS 8
#define MAX_SESSIONS 6 /* below the wrapper's fuse_max_sessions (8): room for strays */
#define SHM_MAP_MAX (16u << 20)
#define PING_ID_BASE 0xfeed000000000000ull
#define KVBW_MAGIC "KVBWIRE1"

struct frame {
	uint8_t *data;
	size_t len;
};

/* What a message teaches us once answered. */
enum learn {
	LEARN_NONE,
	LEARN_PUT,
	LEARN_SHM_ATTACH,
	LEARN_FUSE_OPEN,
	LEARN_FUSE_LAYER,
	LEARN_FUSE_CLOSE,
	LEARN_CHUNK,	/* a request naming a chunk: a not_found reply (or a DELETE) drops it */
};

struct msg {
	struct frame *f;
	size_t n, cap;
	bool delim;	    /* an empty delimiter frame goes first */
	bool know_id;	    /* the header is ours, unmutated: the reply must echo id */
	bool expect_reply;  /* false for a frame above the daemon's hard cap */
	bool abandon;	    /* the client goes away without waiting for the reply */
	uint64_t id;
	const char *kind;   /* generator, for the report */
	enum learn learn;
	int learn_idx;	    /* session or chunk slot */
	uint32_t learn_tokens;
	uint8_t learn_hash[KVBP_HASH_LEN];
	int learn_model;
	bool learn_delete;
	uint64_t learn_session;
};

struct model_info {
	struct kvbp_model m;
	size_t row; /* bytes of one token row: heads x head_dim x elem */
};

struct chunk_info {
	int model;
	uint8_t hash[KVBP_HASH_LEN];
	uint32_t tokens;
};

struct shm_info {
	uint64_t id;
	uint64_t size;
	uint8_t *map; /* our mapping, NULL if we could not map it */
};

struct session_info {
	bool open;
	uint64_t id;
	int model;
	uint32_t tokens, next_layer, rows_next;
};

struct opts {
	const char *endpoint;
	long pid;
	uint64_t seed;
	uint64_t count;
	double seconds;
	unsigned every;
	int reply_ms, ping_ms;
	uint64_t max_message;
	const char *save;
	bool verbose;
	char **replay;
	int n_replay;
};

static struct opts opt = { .seed = 1, .count = 1000000, .seconds = 30, .every = 100,
			   .reply_ms = 2000, .ping_ms = 20000, .max_message = 4u << 20 };

static void *zctx;
static void *socks[FUZZ_SOCKETS];
static void *ctrl;
static uint64_t rng_state;
static uint64_t next_id = 1;

static struct model_info models[MAX_MODELS];
static int n_models;
static struct chunk_info chunks[MAX_CHUNKS];
static int n_chunks;
static struct shm_info shms[MAX_SHMS];
static int n_shms;
static struct session_info sessions[MAX_SESSIONS];
static unsigned workers = 2;
static bool sessions_full; /* an open hit fuse_max_sessions: close one of ours next */
/* Sessions opened by messages that did not mean to (mutated ones): closed at once. */
static uint64_t orphans[16];
static unsigned n_orphans;

/* The last LOG_MSGS messages sent, for the report of a failure. */
static struct msg logbuf[LOG_MSGS];
static uint64_t n_logged;

static struct {
	uint64_t sent, answered, unanswered, retired, ok, errors, strict_checked, pings, internal;
	double slowest;
	uint64_t by_kind[16];
	uint64_t codes[KVBP_CODE_COUNT + 1];
	uint64_t ok_by_op[KVBP_OP_COUNT], sent_by_op[KVBP_OP_COUNT];
} st;

static bool failed;

/* ---- small helpers ---- */

__attribute__((format(printf, 1, 2))) static void say(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	fprintf(stderr, "fuzz_wire_daemon: ");
	vfprintf(stderr, fmt, ap);
	fprintf(stderr, "\n");
	va_end(ap);
}

static double now_s(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec + t.tv_nsec / 1e9;
}

/* splitmix64: small, seedable, good enough to drive choices. */
static uint64_t rnd(void)
{
	uint64_t z = (rng_state += 0x9e3779b97f4a7c15ull);

	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
	z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
	return z ^ (z >> 31);
}

static uint32_t below(uint32_t n)
{
	return n ? (uint32_t)(rnd() % n) : 0;
}

static bool chance(unsigned percent)
{
	return below(100) < percent;
}

static void fill_random(void *p, size_t n)
{
	uint8_t *b = p;

	for (size_t i = 0; i < n; i++)
		b[i] = (uint8_t)rnd();
}

/* Tensor bytes: mostly small finite f16/f32-ish values, sometimes raw bits (NaN, Inf). */
static void fill_tensor(void *p, size_t n)
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

static uint64_t pick_u64(void)
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

static uint32_t pick_u32(void)
{
	return (uint32_t)pick_u64();
}

static double pick_double(void)
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

/* ---- messages ---- */

static void msg_init(struct msg *m, const char *kind)
{
	memset(m, 0, sizeof(*m));
	m->delim = true;
	m->expect_reply = true;
	m->kind = kind;
	m->learn_idx = -1;
}

static void msg_free(struct msg *m)
{
	for (size_t i = 0; i < m->n; i++)
		free(m->f[i].data);
	free(m->f);
	m->f = NULL;
	m->n = m->cap = 0;
}

/* Append a frame of len bytes (copied from data, or random when data is NULL). */
static uint8_t *msg_add(struct msg *m, const void *data, size_t len)
{
	uint8_t *b;

	if (m->n == m->cap) {
		size_t cap = m->cap ? 2 * m->cap : 8;
		struct frame *f = realloc(m->f, cap * sizeof(*f));

		if (!f)
			abort();
		m->f = f;
		m->cap = cap;
	}
	b = malloc(len ? len : 1);
	if (!b)
		abort();
	if (data)
		memcpy(b, data, len);
	else
		fill_tensor(b, len);
	m->f[m->n].data = b;
	m->f[m->n].len = len;
	m->n++;
	return b;
}

static void msg_add_header(struct msg *m, const struct kvbp_request *q)
{
	uint8_t *buf;
	size_t len;

	if (kvbp_request_encode(q, &buf, &len))
		abort();
	msg_add(m, buf, len);
	free(buf);
}

static void msg_copy(struct msg *dst, const struct msg *src)
{
	*dst = *src;
	dst->f = NULL;
	dst->n = dst->cap = 0;
	for (size_t i = 0; i < src->n; i++)
		msg_add(dst, src->f[i].data, src->f[i].len);
}

static void log_msg(const struct msg *m)
{
	struct msg *slot = &logbuf[n_logged % LOG_MSGS];

	msg_free(slot);
	msg_copy(slot, m);
	n_logged++;
}

static int send_msg(void *sock, const struct msg *m)
{
	size_t n = m->n + (m->delim ? 1 : 0);

	if (n == 0)
		return 0; /* nothing to send: a message has at least one frame */
	if (m->delim && zmq_send(sock, "", 0, m->n ? ZMQ_SNDMORE : 0) < 0)
		return -errno;
	for (size_t i = 0; i < m->n; i++)
		if (zmq_send(sock, m->f[i].data, m->f[i].len, i + 1 < m->n ? ZMQ_SNDMORE : 0) < 0)
			return -errno;
	return 0;
}

/* Receive one whole message within ms milliseconds: 1, 0 on timeout, <0 on error. */
static int recv_msg(void *sock, int ms, struct msg *out)
{
	zmq_pollitem_t it = { sock, 0, ZMQ_POLLIN, 0 };
	int more = 1, rc;

	msg_init(out, "reply");
	out->delim = false;
	rc = zmq_poll(&it, 1, ms);
	if (rc < 0)
		return -errno;
	if (rc == 0)
		return 0;
	while (more) {
		zmq_msg_t z;

		zmq_msg_init(&z);
		if (zmq_msg_recv(&z, sock, 0) < 0) {
			zmq_msg_close(&z);
			msg_free(out);
			return -errno;
		}
		msg_add(out, zmq_msg_data(&z), zmq_msg_size(&z));
		more = zmq_msg_more(&z);
		zmq_msg_close(&z);
	}
	return 1;
}

/* ---- the report of a failure ---- */

static void save_log(const char *why)
{
	char path[4096];
	uint64_t first = n_logged > LOG_MSGS ? n_logged - LOG_MSGS : 0;
	FILE *f;

	failed = true;
	say("FAILED: %s (after %" PRIu64 " messages, seed %" PRIu64 ")", why, st.sent, opt.seed);
	for (uint64_t i = n_logged > 5 ? n_logged - 5 : 0; i < n_logged; i++) {
		const struct msg *m = &logbuf[i % LOG_MSGS];

		say("  message %" PRIu64 " (%s): %zu frames%s, header %zu bytes", i, m->kind, m->n,
		    m->delim ? " after a delimiter" : "", m->n ? m->f[0].len : 0);
	}
	if (!opt.save)
		return;
	mkdir(opt.save, 0755);
	snprintf(path, sizeof(path), "%s/wire-seed%" PRIu64 "-msg%" PRIu64 ".kvbw", opt.save, opt.seed,
		 st.sent);
	f = fopen(path, "wb");
	if (!f) {
		say("cannot write %s: %s", path, strerror(errno));
		return;
	}
	fwrite(KVBW_MAGIC, 1, 8, f);
	for (uint64_t i = first; i < n_logged; i++) {
		const struct msg *m = &logbuf[i % LOG_MSGS];
		uint8_t d = m->delim;
		uint32_t n = (uint32_t)m->n;

		fwrite(&d, 1, 1, f);
		fwrite(&n, 4, 1, f);
		for (size_t j = 0; j < m->n; j++) {
			uint32_t len = (uint32_t)m->f[j].len;

			fwrite(&len, 4, 1, f);
			fwrite(m->f[j].data, 1, len, f);
		}
	}
	if (fclose(f))
		say("cannot write %s", path);
	else
		say("the last %" PRIu64 " messages are in %s (replay: --replay FILE)",
		    n_logged - first, path);
}

/* ---- is the daemon alive? ---- */

static bool process_alive(void)
{
	char path[64], buf[512], *p;
	FILE *f;
	size_t n;

	if (opt.pid <= 0)
		return true;
	snprintf(path, sizeof(path), "/proc/%ld/stat", opt.pid);
	f = fopen(path, "r");
	if (!f)
		return false;
	n = fread(buf, 1, sizeof(buf) - 1, f);
	fclose(f);
	buf[n] = 0;
	/* "pid (comm) S ...": a zombie (Z) or dead (X) process does not serve */
	p = strrchr(buf, ')');
	return p && p[1] == ' ' && p[2] != 'Z' && p[2] != 'X';
}

/*
 * The envelope (docs/protocol.md): an empty delimiter, then the header. A message whose
 * first frame is not empty is refused as a whole with bad_frames. The reply is always
 * [empty delimiter] [Reply] [payload ...].
 */
static bool envelope_ok(const struct msg *m)
{
	return m->delim || (m->n && m->f[0].len == 0);
}

/* The header frame of m as the daemon sees it, or NULL (none, or a refused envelope). */
static const struct frame *header_frame(const struct msg *m)
{
	size_t h = m->delim ? 0 : 1;

	return envelope_ok(m) && h < m->n ? &m->f[h] : NULL;
}

static const struct msg *cur_reply;

/* Frames of a message, each its size and first bytes in hex, for a report. */
static void hexdump(const char *what, const struct msg *m)
{
	say("  %s: %s%zu frames", what, m->delim ? "delimiter + " : "", m->n);
	for (size_t i = 0; i < m->n && i < 6; i++) {
		char line[3 * 48 + 1] = "";

		for (size_t j = 0; j < m->f[i].len && j < 48; j++)
			snprintf(line + 3 * j, 4, " %02x", m->f[i].data[j]);
		say("    [%zu] %zu bytes:%s%s", i, m->f[i].len, line, m->f[i].len > 48 ? " ..." : "");
	}
}

static void protocol_defect(const struct msg *m, const char *fmt, ...)
	__attribute__((format(printf, 2, 3)));

static void protocol_defect(const struct msg *m, const char *fmt, ...)
{
	char why[512];
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(why, sizeof(why), fmt, ap);
	va_end(ap);
	say("protocol defect answering a '%s' message: %s", m->kind, why);
	hexdump("request", m);
	if (cur_reply)
		hexdump("reply", cur_reply);
	save_log(why);
}

/* Check the reply r to m; decode it into *rep. True when *rep holds a reply to clear. */
static bool check_reply(const struct msg *m, const struct msg *r, struct kvbp_reply *rep)
{
	char err[256];
	int rc;

	st.strict_checked++;
	cur_reply = r;
	if (r->n < 2 || r->f[0].len != 0) {
		protocol_defect(m, "reply has %zu frames, the first %zu bytes long; expected an "
			       "empty delimiter and a header", r->n, r->n ? r->f[0].len : 0);
		return false;
	}
	rc = kvbp_reply_decode(r->f[1].data, r->f[1].len, rep, err, sizeof(err));
	if (rc) {
		protocol_defect(m, "reply header (%zu bytes) does not decode: %s", r->f[1].len, err);
		return false;
	}
	if (rep->version != KVBP_VERSION)
		protocol_defect(m, "reply version %" PRIu32, rep->version);
	else if (rep->code >= KVBP_CODE_COUNT)
		protocol_defect(m, "reply code %" PRIu32 " is not a known code", rep->code);
	else if (rep->code && !rep->message[0])
		protocol_defect(m, "error reply %s carries no message", kvbp_code_name(rep->code));
	else if (rep->payload_frames != r->n - 2)
		protocol_defect(m, "reply declares %" PRIu32 " payload frames and has %zu",
				rep->payload_frames, r->n - 2);
	else if (!envelope_ok(m) && rep->code != KVBP_BAD_FRAMES)
		protocol_defect(m, "a message without a delimiter got %s, not bad_frames",
				kvbp_code_name(rep->code));
	else if (envelope_ok(m) && m->know_id && rep->request_id != m->id)
		protocol_defect(m, "reply echoes request id %" PRIu64 ", not %" PRIu64,
				rep->request_id, m->id);
	cur_reply = NULL;
	return true;
}

/* Send HELLO or STATS on the control socket and wait for its own reply. */
static bool ping_one(uint32_t op, struct kvbp_reply *rep)
{
	struct kvbp_request q;
	struct msg m, r;
	double deadline = now_s() + opt.ping_ms / 1000.0;
	uint64_t id = PING_ID_BASE + st.pings++;

	memset(&q, 0, sizeof(q));
	q.version = KVBP_VERSION;
	q.request_id = id;
	q.op = op;
	msg_init(&m, "ping");
	msg_add_header(&m, &q);
	m.know_id = true;
	m.id = id;
	if (send_msg(ctrl, &m)) {
		msg_free(&m);
		return false;
	}
	for (;;) {
		int left = (int)((deadline - now_s()) * 1000), rc;
		char err[256];

		if (left <= 0 || !process_alive())
			break;
		rc = recv_msg(ctrl, left < 200 ? left : 200, &r);
		if (rc < 0)
			break;
		if (rc == 0)
			continue;
		if (r.n >= 2 && kvbp_reply_decode(r.f[1].data, r.f[1].len, rep, err,
						  sizeof(err)) == 0) {
			if (rep->request_id == id) {
				msg_free(&r);
				msg_free(&m);
				return rep->code == KVBP_OK;
			}
			kvbp_reply_clear(rep);
		}
		msg_free(&r);
	}
	msg_free(&m);
	return false;
}

/* A burst of HELLOs, more than there are workers, so each worker must answer one. */
static bool ping_burst(void)
{
	unsigned n = 2 * workers + 1, got = 0;
	double deadline = now_s() + opt.ping_ms / 1000.0;
	uint64_t base = PING_ID_BASE + st.pings;
	struct kvbp_request q;

	memset(&q, 0, sizeof(q));
	q.version = KVBP_VERSION;
	q.op = KVBP_OP_HELLO;
	for (unsigned i = 0; i < n; i++) {
		struct msg m;

		q.request_id = base + i;
		msg_init(&m, "ping");
		msg_add_header(&m, &q);
		if (send_msg(ctrl, &m)) {
			msg_free(&m);
			return false;
		}
		msg_free(&m);
	}
	st.pings += n;
	while (got < n) {
		int left = (int)((deadline - now_s()) * 1000), rc;
		struct kvbp_reply rep;
		struct msg r;
		char err[256];

		if (left <= 0 || !process_alive())
			return false;
		rc = recv_msg(ctrl, left < 200 ? left : 200, &r);
		if (rc < 0)
			return false;
		if (rc == 0)
			continue;
		if (r.n >= 2 && kvbp_reply_decode(r.f[1].data, r.f[1].len, &rep, err,
						  sizeof(err)) == 0) {
			if (rep.request_id >= base && rep.request_id < base + n && rep.code == KVBP_OK)
				got++;
			kvbp_reply_clear(&rep);
		}
		msg_free(&r);
	}
	return true;
}

static bool liveness(const char *when)
{
	struct kvbp_reply rep;

	if (!process_alive()) {
		say("the daemon (pid %ld) is dead %s", opt.pid, when);
		save_log("daemon process died");
		return false;
	}
	if (!ping_one(KVBP_OP_HELLO, &rep) || !rep.server_version[0]) {
		say("no answer to HELLO within %d ms %s", opt.ping_ms, when);
		save_log(process_alive() ? "daemon stopped answering HELLO" : "daemon process died");
		return false;
	}
	kvbp_reply_clear(&rep);
	if (!ping_one(KVBP_OP_STATS, &rep)) {
		say("no answer to STATS within %d ms %s", opt.ping_ms, when);
		save_log(process_alive() ? "daemon stopped answering STATS" : "daemon process died");
		return false;
	}
	for (size_t i = 0; i < rep.n_stats; i++)
		if (!strcmp(rep.stats[i].name, "workers") && rep.stats[i].value >= 1 &&
		    rep.stats[i].value <= 256)
			workers = (unsigned)rep.stats[i].value;
	kvbp_reply_clear(&rep);
	if (!ping_burst()) {
		say("a burst of %u HELLOs was not all answered within %d ms %s (a worker is stuck?)",
		    2 * workers + 1, opt.ping_ms, when);
		save_log(process_alive() ? "a worker stopped answering" : "daemon process died");
		return false;
	}
	if (!process_alive()) {
		save_log("daemon process died");
		return false;
	}
	return true;
}

/* ---- state learned from replies ---- */

static void shm_forget(int i)
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

static void learn(const struct msg *m, const struct kvbp_reply *rep)
{
	struct session_info *s;

	if (rep->code == KVBP_OK && rep->session_id && m->learn != LEARN_FUSE_OPEN &&
	    n_orphans < sizeof(orphans) / sizeof(*orphans))
		orphans[n_orphans++] = rep->session_id;
	switch (m->learn) {
	case LEARN_NONE:
		break;
	case LEARN_PUT:
		if (rep->code == KVBP_OK && !rep->existed && n_chunks < MAX_CHUNKS) {
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

/* ---- generators ---- */

static int pick_model(void)
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
static const struct chunk_info *pick_chunk(int mi)
{
	int cand[MAX_CHUNKS], n = 0;

	for (int i = 0; i < n_chunks; i++)
		if (mi < 0 || chunks[i].model == mi)
			cand[n++] = i;
	return n ? &chunks[cand[below((uint32_t)n)]] : NULL;
}

static void set_hash(uint8_t *hash, int mi)
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
	uint32_t layers = mi >= 0 ? models[mi].m.num_layers : 1 + below(4);
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
static void perturb(struct kvbp_request *q, unsigned n)
{
	for (unsigned i = 0; i < n; i++) {
		switch (below(23)) {
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
			m->num_layers = pick_u32();
			break;
		case 1:
			m->num_kv_heads = pick_u32();
			break;
		case 2:
			m->head_dim = pick_u32();
			break;
		case 3:
			m->dtype = pick_u32();
			break;
		case 4:
			m->rope_theta = pick_double();
			break;
		case 5:
			m->rope_style = chance(50) ? below(3) : pick_u32();
			break;
		case 6:
			m->rotary_dim = pick_u32();
			break;
		case 7:
			m->scaling = chance(70) ? below(6) : pick_u32();
			break;
		case 8:
			m->factor = pick_double();
			break;
		case 9:
			m->low_freq_factor = pick_double();
			m->high_freq_factor = pick_double();
			break;
		case 10:
			m->original_max_pos = pick_u32();
			m->max_pos = pick_u32();
			break;
		case 11:
			m->beta_fast = pick_double();
			m->beta_slow = pick_double();
			break;
		case 12:
			m->k_pre_rope = !m->k_pre_rope;
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
static uint8_t hash_buf[1024][KVBP_HASH_LEN];

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
		uint64_t want = mi >= 0 ? 2 * models[mi].m.num_layers *
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
static void gen_put(struct msg *m, int mi, uint32_t tokens)
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
	q.dtype = models[mi].m.dtype;
	m->id = q.request_id;
	m->know_id = true;
	m->learn = LEARN_PUT;
	m->learn_model = mi;
	m->learn_tokens = tokens;
	memcpy(m->learn_hash, q.hash, KVBP_HASH_LEN);
	if (n_shms && chance(30)) {
		q.has_shm = true;
		set_shm(&q.shm_id, &q.shm_offset, &q.shm_length, 2 * models[mi].m.num_layers * tb);
		shm_fill(q.shm_id, q.shm_offset, q.shm_length);
		msg_add_header(m, &q);
		return;
	}
	q.payload_frames = 2 * models[mi].m.num_layers;
	msg_add_header(m, &q);
	for (uint32_t i = 0; i < q.payload_frames; i++)
		msg_add(m, NULL, (size_t)tb);
}

/* Fuse flows: open, layers in and out of order, close, with right and wrong values. */
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
		layers = models[mi].m.num_layers;
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
		q.metric = chance(90) ? below(2) : pick_u32();
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
	if (chance(10) || sessions_full || (s->next_layer >= models[mi].m.num_layers && chance(90))) {
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
		q.payload_frames = chance(90) ? 2 : below(5);
		msg_add_header(m, &q);
		for (uint32_t i = 0, n = chance(90) ? 2 : below(5); i < n; i++) {
			size_t len = (size_t)in;

			if (chance(10))
				len = chance(50) || !len ? len + 1 + below(2) : len - 1;
			msg_add(m, NULL, len);
		}
	}
}

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

static void gen_handmade(struct msg *m)
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
	case 2: { /* packed check layers and ratios around the limit */
		static const uint32_t ns[] = { 1, KVBP_CHECKS_MAX, KVBP_CHECKS_MAX + 1, 1000, 100000 };
		uint32_t n = ns[below(5)];
		struct pbw p = { 0 };

		for (uint32_t i = 0; i < n; i++)
			pb_varint(&p, chance(90) ? i : pick_u32());
		pb_len(&w, 17, p.b, p.n);
		p.n = 0;
		for (uint32_t i = 0; i < n && chance(70); i++) {
			double r = chance(90) ? 0.5 : pick_double();

			pb_bytes(&p, &r, 8);
		}
		if (p.n)
			pb_len(&w, 18, p.b, p.n);
		free(p.b);
		break;
	}
	case 3: { /* segments around the limit, odd hash lengths */
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
			pb_len(&w, 16, s.b, s.n);
			free(s.b);
		}
		pb_tag(&w, 17, 0);
		pb_varint(&w, 0);
		pb_tag(&w, 18, 1);
		pb_bytes(&w, &(double){ 0.5 }, 8);
		break;
	}
	case 4: { /* LOOKUP hashes around the limit, odd lengths */
		static const uint32_t ns[] = { 1, 100, KVBP_LOOKUP_MAX, KVBP_LOOKUP_MAX + 1 };
		uint32_t n = ns[below(4)];
		uint8_t h[40];

		fill_random(h, sizeof(h));
		for (uint32_t i = 0; i < n; i++)
			pb_len(&w, 11, h, chance(99) || i + 1 < n ? 32 : below(40));
		break;
	}
	case 5: { /* a model with odd strings and values */
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
		pb_len(&w, 4, s.b, s.n);
		free(s.b);
		break;
	}
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
		uint64_t sizes[] = { opt.max_message - 1, opt.max_message + 1,
				     opt.max_message + (1u << 20) + 1 };
		size_t len = (size_t)sizes[below(3)];

		gen_op(m);
		msg_add(m, NULL, len);
		break;
	}
	case 5: /* a frame over the hard cap: ZeroMQ drops the connection, no reply comes */
		if (chance(10)) {
			gen_op(m);
			msg_add(m, NULL, (size_t)(2 * opt.max_message + 1));
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
static int n_tmpls;

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

static void gen_peer(struct msg *m)
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
				q.model.num_kv_heads += 1 + below(3); /* described differently */
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
			q.model.head_dim = chance(50) ? q.model.head_dim * 2 : pick_u32();
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
static void setup_templates(void)
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
		if (send_msg(ctrl, &m)) {
			msg_free(&m);
			continue;
		}
		msg_free(&m);
		for (deadline = now_s() + opt.ping_ms / 1000.0; now_s() < deadline;) {
			struct kvbp_reply rep;
			char err[256];
			bool mine;

			if (recv_msg(ctrl, 200, &r) <= 0)
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

static const char *const kind_names[] = { "op", "fuse", "put", "mutated", "handmade", "frames",
					  "peer" };

static void generate(struct msg *m)
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

/* ---- sending and checking one message ---- */

static void *new_socket(void)
{
	void *s = zmq_socket(zctx, ZMQ_DEALER);
	int zero = 0, tmo = 10000;

	if (!s)
		return NULL;
	zmq_setsockopt(s, ZMQ_LINGER, &zero, sizeof(zero));
	zmq_setsockopt(s, ZMQ_SNDTIMEO, &tmo, sizeof(tmo));
	if (zmq_connect(s, opt.endpoint)) {
		zmq_close(s);
		return NULL;
	}
	return s;
}

/* What a message asked for, for --verbose reports. */
static void describe(const struct msg *m, const char *what)
{
	const struct frame *hf = header_frame(m);
	struct kvbp_request q;
	char err[256];
	size_t h = m->delim ? 0 : 1;

	if (!hf || kvbp_request_decode(hf->data, hf->len, &q, err, sizeof(err))) {
		say("%s: a '%s' message of %zu frames, header not a request", what, m->kind, m->n);
		return;
	}
	say("%s: '%s' message id %" PRIu64 ", op %s, %zu frames (first payload %zu bytes), "
	    "model '%s', session %" PRIx64 " layer %" PRIu32 " rows %" PRIu32 ", tokens %" PRIu32
	    ", shm %d id %" PRIx64 " off %" PRIu64 " len %" PRIu64 ", %zu segments, %zu checks",
	    what, m->kind, q.request_id, kvbp_op_name(q.op), m->n, m->n > h + 1 ? m->f[h + 1].len : 0,
	    q.model_name, q.session_id, q.layer, q.rows, q.num_tokens, q.has_shm, q.shm_id,
	    q.shm_offset, q.shm_length, q.n_segments, q.n_checks);
	kvbp_request_clear(&q);
}

static const char *cur_message = "";

/* Requests and successes by operation, to see how deep the fuzzer gets. */
static void count_op(const struct msg *m, uint32_t code)
{
	const struct frame *hf = header_frame(m);
	const char *debug_op = getenv("KVB_FUZZ_DEBUG_OP");
	struct kvbp_request q;
	char err[64];

	if (!hf || kvbp_request_decode(hf->data, hf->len, &q, err, sizeof(err)))
		return;
	/* KVB_FUZZ_DEBUG_OP=N prints every error reply to operation N: why requests fail. */
	if (code && debug_op && q.op == (uint32_t)atoi(debug_op))
		say("debug: %s %s: %s", kvbp_op_name(q.op), kvbp_code_name(code), cur_message);
	if (q.op < KVBP_OP_COUNT) {
		st.sent_by_op[q.op]++;
		st.ok_by_op[q.op] += code == KVBP_OK;
	}
	kvbp_request_clear(&q);
}

/*
 * A socket whose message went unanswered (or that sent a frame over the daemon's cap)
 * is replaced, so that each socket has at most one request in flight and every reply
 * it receives answers the message just sent: no late reply is ever taken for another.
 */
static int retire_socket(int si)
{
	zmq_close(socks[si]);
	socks[si] = new_socket();
	st.retired++;
	if (!socks[si]) {
		say("cannot reconnect: %s", zmq_strerror(errno));
		return -1;
	}
	return 0;
}

static int fuzz_one(const struct msg *m, int si)
{
	struct msg r;
	double sent, deadline;
	int rc;

	log_msg(m);
	st.sent++;
	for (size_t i = 0; i < sizeof(kind_names) / sizeof(*kind_names); i++)
		if (m->kind == kind_names[i])
			st.by_kind[i]++;
	rc = send_msg(socks[si], m);
	if (rc) {
		say("send failed: %s", zmq_strerror(-rc));
		if (retire_socket(si))
			return -1;
		return liveness("after a failed send") ? 0 : -1;
	}
	if (!m->expect_reply || m->abandon)
		return retire_socket(si);
	sent = now_s();
	deadline = sent + opt.reply_ms / 1000.0;
	for (;;) {
		int left = (int)((deadline - now_s()) * 1000);
		struct kvbp_reply rep;
		double took;

		if (left <= 0) {
			st.unanswered++;
			if (opt.verbose)
				describe(m, "no reply within the time");
			if (retire_socket(si))
				return -1;
			/* Slow, stuck or dead? Find out now, not at the next scheduled check. */
			return liveness("after a message got no reply") ? 0 : -1;
		}
		rc = recv_msg(socks[si], left < 200 ? left : 200, &r);
		if (rc == 0 && !process_alive()) {
			say("the daemon (pid %ld) died while a '%s' message waited for its reply",
			    opt.pid, m->kind);
			save_log("daemon process died");
			return -1;
		}
		if (rc <= 0)
			continue;
		took = now_s() - sent;
		if (took > st.slowest) {
			st.slowest = took;
			if (opt.verbose && took > 0.5)
				describe(m, "slowest reply so far");
		}
		memset(&rep, 0, sizeof(rep));
		st.answered++;
		if (check_reply(m, &r, &rep)) {
			st.codes[rep.code < KVBP_CODE_COUNT ? rep.code : KVBP_CODE_COUNT]++;
			if (rep.code == KVBP_OK)
				st.ok++;
			else
				st.errors++;
			cur_message = rep.message;
			count_op(m, rep.code);
			if (opt.verbose && opt.n_replay)
				say("reply: %s, request id %" PRIu64 ": %s", kvbp_code_name(rep.code),
				    rep.request_id, rep.message);
			if (rep.code == KVBP_INTERNAL) {
				st.internal++;
				if (opt.verbose)
					say("internal error for a '%s' message: %s", m->kind,
					    rep.message);
			}
			learn(m, &rep);
			kvbp_reply_clear(&rep);
		}
		msg_free(&r);
		return failed ? -1 : 0;
	}
}

/* ---- setup: models, chunks and a segment for the generators to aim at ---- */

static bool setup_request(struct msg *m, struct kvbp_reply *rep)
{
	struct msg r;
	double deadline = now_s() + opt.ping_ms / 1000.0;

	if (send_msg(ctrl, m))
		return false;
	while (now_s() < deadline) {
		char err[256];

		if (recv_msg(ctrl, 200, &r) <= 0)
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

static int setup(void)
{
	static const size_t model_samples[] = { 1, 2, 3 };
	double deadline = now_s() + 30;
	struct kvbp_reply rep;
	bool up = false;

	/* The daemon may still be starting: HELLO until it answers. */
	while (!up && now_s() < deadline) {
		int saved = opt.ping_ms;

		if (!process_alive()) {
			say("the daemon (pid %ld) is not running", opt.pid);
			return -1;
		}
		opt.ping_ms = 500;
		up = ping_one(KVBP_OP_HELLO, &rep);
		opt.ping_ms = saved;
		if (up)
			kvbp_reply_clear(&rep);
	}
	if (!up) {
		say("no answer from %s within 30 s", opt.endpoint);
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

/* ---- replay of saved messages ---- */

static int read_kvbw(const char *path, struct msg **out, size_t *n_out)
{
	FILE *f = fopen(path, "rb");
	char magic[8];
	struct msg *ms = NULL;
	size_t n = 0;
	int rc = -1;

	if (!f) {
		say("%s: %s", path, strerror(errno));
		return -1;
	}
	if (fread(magic, 1, 8, f) != 8 || memcmp(magic, KVBW_MAGIC, 8)) {
		say("%s: not a .kvbw file", path);
		goto out;
	}
	for (;;) {
		uint8_t d;
		uint32_t nf;
		struct msg *m;

		if (fread(&d, 1, 1, f) != 1) {
			rc = 0;
			break;
		}
		if (fread(&nf, 4, 1, f) != 1 || nf > 100000)
			break;
		ms = realloc(ms, (n + 1) * sizeof(*ms));
		if (!ms)
			abort();
		m = &ms[n++];
		msg_init(m, "replay");
		m->delim = d;
		for (uint32_t i = 0; i < nf; i++) {
			uint32_t len;
			uint8_t *b;

			if (fread(&len, 4, 1, f) != 1 || len > (1u << 30))
				goto out;
			b = msg_add(m, NULL, len);
			if (len && fread(b, 1, len, f) != len)
				goto out;
		}
		/* A frame over the hard cap gets no reply, only a dropped connection. */
		for (size_t i = 0; i < m->n; i++)
			if (m->f[i].len > 2 * opt.max_message)
				m->expect_reply = false;
	}
out:
	if (rc) {
		say("%s: truncated or corrupt", path);
		for (size_t i = 0; i < n; i++)
			msg_free(&ms[i]);
		free(ms);
		ms = NULL;
		n = 0;
	}
	fclose(f);
	*out = ms;
	*n_out = n;
	return rc;
}

static int replay_file(const char *path)
{
	struct msg *ms;
	size_t n;
	int rc = 0;

	if (read_kvbw(path, &ms, &n))
		return 2;
	for (size_t i = 0; i < n && !rc; i++) {
		if (fuzz_one(&ms[i], 0))
			rc = 1;
		else if (opt.every == 1 && !liveness("during the replay"))
			rc = 1;
	}
	if (!rc && !liveness("after the replay"))
		rc = 1;
	say("replayed %zu messages of %s: %s", n, path, rc ? "FAILED" : "ok");
	for (size_t i = 0; i < n; i++)
		msg_free(&ms[i]);
	free(ms);
	return rc;
}

static int by_name(const struct dirent **a, const struct dirent **b)
{
	return strcmp((*a)->d_name, (*b)->d_name);
}

static int replay_all(void)
{
	int rc = 0;

	for (int i = 0; i < opt.n_replay; i++) {
		struct stat s;
		struct dirent **names;
		int n;

		if (stat(opt.replay[i], &s)) {
			say("%s: %s", opt.replay[i], strerror(errno));
			return 2;
		}
		if (!S_ISDIR(s.st_mode)) {
			int r = replay_file(opt.replay[i]);

			rc = r > rc ? r : rc;
			continue;
		}
		n = scandir(opt.replay[i], &names, NULL, by_name);
		for (int j = 0; j < n; j++) {
			size_t l = strlen(names[j]->d_name);
			char path[4096];

			if (l > 5 && !strcmp(names[j]->d_name + l - 5, ".kvbw")) {
				int r;

				snprintf(path, sizeof(path), "%s/%s", opt.replay[i], names[j]->d_name);
				r = replay_file(path);
				rc = r > rc ? r : rc;
			}
			free(names[j]);
		}
		if (n >= 0)
			free(names);
	}
	return rc;
}

/* ---- main ---- */

static uint64_t parse_size(const char *s)
{
	char *end;
	uint64_t v = strtoull(s, &end, 10);

	switch (*end) {
	case 'K':
	case 'k':
		return v << 10;
	case 'M':
	case 'm':
		return v << 20;
	case 'G':
	case 'g':
		return v << 30;
	default:
		return v;
	}
}

static void usage(FILE *f)
{
	fprintf(f,
		"usage: fuzz_wire_daemon --endpoint EP [options] [--replay FILE_OR_DIR...]\n"
		"  --endpoint EP       a running kvblendd (ipc://PATH or tcp://127.0.0.1:PORT)\n"
		"  --pid PID           its process: checked alive throughout\n"
		"  --seed N            choices are a function of the seed [1]\n"
		"  --count N           stop after N messages [1000000]\n"
		"  --seconds S         stop after S seconds [30]\n"
		"  --every N           liveness check after every N messages [100]\n"
		"  --reply-ms MS       wait this long for each reply [2000]\n"
		"  --ping-ms MS        a liveness check fails after this long [20000]\n"
		"  --max-message SIZE  the daemon's max_message, to size frames around it [4M]\n"
		"  --save DIR          on failure, write the last messages to DIR/*.kvbw\n"
		"  --replay PATH...    (last) send saved .kvbw messages (files, or directories of\n"
		"                      them) and check liveness; with --every 1 after each message\n"
		"  --verbose           report unanswered messages and internal errors\n");
}

static int parse_args(int argc, char **argv)
{
	for (int i = 1; i < argc; i++) {
		const char *a = argv[i];
		const char *v = i + 1 < argc ? argv[i + 1] : NULL;

		if (!strcmp(a, "--help")) {
			usage(stdout);
			exit(0);
		} else if (!strcmp(a, "--verbose")) {
			opt.verbose = true;
		} else if (!strcmp(a, "--replay")) {
			opt.replay = argv + i + 1;
			opt.n_replay = argc - i - 1;
			return opt.n_replay ? 0 : -1;
		} else if (!v) {
			return -1;
		} else if (!strcmp(a, "--endpoint")) {
			opt.endpoint = v, i++;
		} else if (!strcmp(a, "--pid")) {
			opt.pid = strtol(v, NULL, 10), i++;
		} else if (!strcmp(a, "--seed")) {
			opt.seed = strtoull(v, NULL, 0), i++;
		} else if (!strcmp(a, "--count")) {
			opt.count = strtoull(v, NULL, 0), i++;
		} else if (!strcmp(a, "--seconds")) {
			opt.seconds = strtod(v, NULL), i++;
		} else if (!strcmp(a, "--every")) {
			opt.every = (unsigned)strtoul(v, NULL, 0), i++;
		} else if (!strcmp(a, "--reply-ms")) {
			opt.reply_ms = atoi(v), i++;
		} else if (!strcmp(a, "--ping-ms")) {
			opt.ping_ms = atoi(v), i++;
		} else if (!strcmp(a, "--max-message")) {
			opt.max_message = parse_size(v), i++;
		} else if (!strcmp(a, "--save")) {
			opt.save = v, i++;
		} else {
			return -1;
		}
	}
	return 0;
}

static void report(void)
{
	say("%" PRIu64 " messages (op %" PRIu64 ", fuse %" PRIu64 ", put %" PRIu64 ", mutated %"
	    PRIu64 ", handmade %" PRIu64 ", frames %" PRIu64 ", peer %" PRIu64 "); %" PRIu64
	    " answered (%" PRIu64
	    " ok, %" PRIu64 " errors, %" PRIu64 " internal), %" PRIu64 " unanswered, %" PRIu64
	    " sockets replaced; %" PRIu64 " replies checked strictly; %" PRIu64 " liveness pings;"
	    " slowest reply %.0f ms",
	    st.sent, st.by_kind[0], st.by_kind[1], st.by_kind[2], st.by_kind[3], st.by_kind[4],
	    st.by_kind[5], st.by_kind[6], st.answered, st.ok, st.errors, st.internal, st.unanswered, st.retired,
	    st.strict_checked, st.pings, st.slowest * 1e3);
	if (opt.verbose)
		for (unsigned op = 0; op < KVBP_OP_COUNT; op++)
			say("  %-16s %8" PRIu64 " answered, %8" PRIu64 " ok", kvbp_op_name(op),
			    st.sent_by_op[op], st.ok_by_op[op]);
	if (opt.verbose)
		for (unsigned c = 0; c <= KVBP_CODE_COUNT; c++)
			if (st.codes[c])
				say("  %-16s %" PRIu64, c < KVBP_CODE_COUNT ? kvbp_code_name(c) : "?",
				    st.codes[c]);
}

int main(int argc, char **argv)
{
	double start, end;
	int rc = 0;

	if (parse_args(argc, argv) || !opt.endpoint || opt.every == 0) {
		usage(stderr);
		return 2;
	}
	signal(SIGPIPE, SIG_IGN);
	rng_state = opt.seed;
	zctx = zmq_ctx_new();
	ctrl = zctx ? new_socket() : NULL;
	for (int i = 0; ctrl && i < FUZZ_SOCKETS; i++)
		if (!(socks[i] = new_socket()))
			ctrl = NULL;
	if (!ctrl) {
		say("cannot connect to %s: %s", opt.endpoint, zmq_strerror(errno));
		return 2;
	}
	if (setup()) {
		rc = process_alive() ? 2 : 1;
		goto out;
	}
	if (opt.n_replay) {
		rc = replay_all();
		report();
		goto out;
	}
	start = now_s();
	end = start + opt.seconds;
	say("fuzzing %s: seed %" PRIu64 ", at most %" PRIu64 " messages and %.0f s", opt.endpoint,
	    opt.seed, opt.count, opt.seconds);
	for (uint64_t i = 0; i < opt.count && now_s() < end; i++) {
		struct msg m;
		int si = (int)below(FUZZ_SOCKETS);

		/* Now and then a client goes away with replies pending and a new one comes. */
		if (chance(1) && chance(20) && retire_socket(si)) {
			rc = 2;
			goto out;
		}
		generate(&m);
		m.abandon = chance(1);
		if (fuzz_one(&m, si)) {
			msg_free(&m);
			rc = 1;
			break;
		}
		msg_free(&m);
		if ((i + 1) % opt.every == 0 && !liveness("during the run")) {
			rc = 1;
			break;
		}
	}
	if (!rc && !liveness("at the end"))
		rc = 1;
	if (!rc && !process_alive()) {
		save_log("daemon process died");
		rc = 1;
	}
	report();
	say("%s after %.1f s", rc ? "FAILED" : "ok: the daemon survived and answers", now_s() - start);
out:
	for (int i = 0; i < FUZZ_SOCKETS; i++)
		if (socks[i])
			zmq_close(socks[i]);
	if (ctrl)
		zmq_close(ctrl);
	if (zctx)
		zmq_ctx_term(zctx);
	while (n_shms)
		shm_forget(n_shms - 1);
	for (int i = 0; i < LOG_MSGS; i++)
		msg_free(&logbuf[i]);
	return rc;
}
