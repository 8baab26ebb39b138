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
 *
 * The code is split by concern over wire_fuzz*.c; wire_fuzz.h says which file holds what.
 */
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdarg.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <zmq.h>

#include "proto/wire.h"
#include "tests/fuzz/wire_fuzz.h"

#define FUZZ_SOCKETS 3
#define PING_ID_BASE 0xfeed000000000000ull

struct opts wf_opt = { .seed = 1, .count = 1000000, .seconds = 30, .every = 100,
		       .reply_ms = 2000, .ping_ms = 20000, .max_message = 4u << 20 };
struct wf_stats wf_st;
void *wf_ctrl;
bool wf_failed;

static void *zctx;
static void *socks[FUZZ_SOCKETS];
static unsigned workers = 2;

/* ---- small helpers ---- */

__attribute__((format(printf, 1, 2))) void say(const char *fmt, ...)
{
	va_list ap;

	va_start(ap, fmt);
	fprintf(stderr, "fuzz_wire_daemon: ");
	vfprintf(stderr, fmt, ap);
	fprintf(stderr, "\n");
	va_end(ap);
}

double now_s(void)
{
	struct timespec t;

	clock_gettime(CLOCK_MONOTONIC, &t);
	return (double)t.tv_sec + t.tv_nsec / 1e9;
}

/* ---- is the daemon alive? ---- */

bool process_alive(void)
{
	char path[64], buf[512], *p;
	FILE *f;
	size_t n;

	if (wf_opt.pid <= 0)
		return true;
	snprintf(path, sizeof(path), "/proc/%ld/stat", wf_opt.pid);
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

	wf_st.strict_checked++;
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
bool ping_one(uint32_t op, struct kvbp_request *q_in, struct kvbp_reply *rep)
{
	struct kvbp_request q;
	struct msg m, r;
	double deadline = now_s() + wf_opt.ping_ms / 1000.0;
	uint64_t id = PING_ID_BASE + wf_st.pings++;

	if (q_in)
		q = *q_in;
	else
		memset(&q, 0, sizeof(q));
	q.version = KVBP_VERSION;
	q.request_id = id;
	q.op = op;
	msg_init(&m, "ping");
	msg_add_header(&m, &q);
	m.know_id = true;
	m.id = id;
	if (send_msg(wf_ctrl, &m)) {
		msg_free(&m);
		return false;
	}
	for (;;) {
		int left = (int)((deadline - now_s()) * 1000), rc;
		char err[256];

		if (left <= 0 || !process_alive())
			break;
		rc = recv_msg(wf_ctrl, left < 200 ? left : 200, &r);
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
	double deadline = now_s() + wf_opt.ping_ms / 1000.0;
	uint64_t base = PING_ID_BASE + wf_st.pings;
	struct kvbp_request q;

	memset(&q, 0, sizeof(q));
	q.version = KVBP_VERSION;
	q.op = KVBP_OP_HELLO;
	for (unsigned i = 0; i < n; i++) {
		struct msg m;

		q.request_id = base + i;
		msg_init(&m, "ping");
		msg_add_header(&m, &q);
		if (send_msg(wf_ctrl, &m)) {
			msg_free(&m);
			return false;
		}
		msg_free(&m);
	}
	wf_st.pings += n;
	while (got < n) {
		int left = (int)((deadline - now_s()) * 1000), rc;
		struct kvbp_reply rep;
		struct msg r;
		char err[256];

		if (left <= 0 || !process_alive())
			return false;
		rc = recv_msg(wf_ctrl, left < 200 ? left : 200, &r);
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

bool liveness(const char *when)
{
	struct kvbp_reply rep;

	if (!process_alive()) {
		say("the daemon (pid %ld) is dead %s", wf_opt.pid, when);
		save_log("daemon process died");
		return false;
	}
	if (!ping_one(KVBP_OP_HELLO, NULL, &rep) || !rep.server_version[0]) {
		say("no answer to HELLO within %d ms %s", wf_opt.ping_ms, when);
		save_log(process_alive() ? "daemon stopped answering HELLO" : "daemon process died");
		return false;
	}
	kvbp_reply_clear(&rep);
	if (!ping_one(KVBP_OP_STATS, NULL, &rep)) {
		say("no answer to STATS within %d ms %s", wf_opt.ping_ms, when);
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
		    2 * workers + 1, wf_opt.ping_ms, when);
		save_log(process_alive() ? "a worker stopped answering" : "daemon process died");
		return false;
	}
	if (!process_alive()) {
		save_log("daemon process died");
		return false;
	}
	if (canary_changed()) {
		say("byte %zu of the canary segment, which no request names, was written %s",
		    canary_changed() - 1, when);
		save_log("a write outside the named segment (the canary changed)");
		return false;
	}
	canary_keep();
	return true;
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
	if (zmq_connect(s, wf_opt.endpoint)) {
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
		wf_st.sent_by_op[q.op]++;
		wf_st.ok_by_op[q.op] += code == KVBP_OK;
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
	wf_st.retired++;
	if (!socks[si]) {
		say("cannot reconnect: %s", zmq_strerror(errno));
		return -1;
	}
	return 0;
}

int fuzz_one(const struct msg *m, int si)
{
	struct msg r;
	double sent, deadline;
	int rc;

	log_msg(m);
	wf_st.sent++;
	for (size_t i = 0; i < sizeof(kind_names) / sizeof(*kind_names); i++)
		if (m->kind == kind_names[i])
			wf_st.by_kind[i]++;
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
	deadline = sent + wf_opt.reply_ms / 1000.0;
	for (;;) {
		int left = (int)((deadline - now_s()) * 1000);
		struct kvbp_reply rep;
		double took;

		if (left <= 0) {
			wf_st.unanswered++;
			if (wf_opt.verbose)
				describe(m, "no reply within the time");
			if (retire_socket(si))
				return -1;
			/* Slow, stuck or dead? Find out now, not at the next scheduled check. */
			return liveness("after a message got no reply") ? 0 : -1;
		}
		rc = recv_msg(socks[si], left < 200 ? left : 200, &r);
		if (rc == 0 && !process_alive()) {
			say("the daemon (pid %ld) died while a '%s' message waited for its reply",
			    wf_opt.pid, m->kind);
			save_log("daemon process died");
			return -1;
		}
		if (rc <= 0)
			continue;
		took = now_s() - sent;
		if (took > wf_st.slowest) {
			wf_st.slowest = took;
			if (wf_opt.verbose && took > 0.5)
				describe(m, "slowest reply so far");
		}
		memset(&rep, 0, sizeof(rep));
		wf_st.answered++;
		if (check_reply(m, &r, &rep)) {
			wf_st.codes[rep.code < KVBP_CODE_COUNT ? rep.code : KVBP_CODE_COUNT]++;
			if (rep.code == KVBP_OK)
				wf_st.ok++;
			else
				wf_st.errors++;
			cur_message = rep.message;
			count_op(m, rep.code);
			if (wf_opt.verbose && wf_opt.n_replay)
				say("reply: %s, request id %" PRIu64 ": %s", kvbp_code_name(rep.code),
				    rep.request_id, rep.message);
			if (rep.code == KVBP_INTERNAL) {
				wf_st.internal++;
				if (wf_opt.verbose)
					say("internal error for a '%s' message: %s", m->kind,
					    rep.message);
			}
			learn(m, &rep);
			kvbp_reply_clear(&rep);
		}
		msg_free(&r);
		return wf_failed ? -1 : 0;
	}
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
			wf_opt.verbose = true;
		} else if (!strcmp(a, "--replay")) {
			wf_opt.replay = argv + i + 1;
			wf_opt.n_replay = argc - i - 1;
			return wf_opt.n_replay ? 0 : -1;
		} else if (!v) {
			return -1;
		} else if (!strcmp(a, "--endpoint")) {
			wf_opt.endpoint = v, i++;
		} else if (!strcmp(a, "--pid")) {
			wf_opt.pid = strtol(v, NULL, 10), i++;
		} else if (!strcmp(a, "--seed")) {
			wf_opt.seed = strtoull(v, NULL, 0), i++;
		} else if (!strcmp(a, "--count")) {
			wf_opt.count = strtoull(v, NULL, 0), i++;
		} else if (!strcmp(a, "--seconds")) {
			wf_opt.seconds = strtod(v, NULL), i++;
		} else if (!strcmp(a, "--every")) {
			wf_opt.every = (unsigned)strtoul(v, NULL, 0), i++;
		} else if (!strcmp(a, "--reply-ms")) {
			wf_opt.reply_ms = atoi(v), i++;
		} else if (!strcmp(a, "--ping-ms")) {
			wf_opt.ping_ms = atoi(v), i++;
		} else if (!strcmp(a, "--max-message")) {
			wf_opt.max_message = parse_size(v), i++;
		} else if (!strcmp(a, "--save")) {
			wf_opt.save = v, i++;
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
	    wf_st.sent, wf_st.by_kind[0], wf_st.by_kind[1], wf_st.by_kind[2], wf_st.by_kind[3], wf_st.by_kind[4],
	    wf_st.by_kind[5], wf_st.by_kind[6], wf_st.answered, wf_st.ok, wf_st.errors, wf_st.internal, wf_st.unanswered, wf_st.retired,
	    wf_st.strict_checked, wf_st.pings, wf_st.slowest * 1e3);
	say("landing layouts: %" PRIu64 " FUSE_OPENs, %" PRIu64 " opened, %" PRIu64
	    " refused bad_shape; the canary segment %s", wf_st.land_opens, wf_st.land_ok,
	    wf_st.land_shape, !canary.map ? "NOT mapped" : canary_changed() ? "CHANGED" : "intact");
	if (wf_opt.verbose)
		for (unsigned op = 0; op < KVBP_OP_COUNT; op++)
			say("  %-16s %8" PRIu64 " answered, %8" PRIu64 " ok", kvbp_op_name(op),
			    wf_st.sent_by_op[op], wf_st.ok_by_op[op]);
	if (wf_opt.verbose)
		for (unsigned c = 0; c <= KVBP_CODE_COUNT; c++)
			if (wf_st.codes[c])
				say("  %-16s %" PRIu64, c < KVBP_CODE_COUNT ? kvbp_code_name(c) : "?",
				    wf_st.codes[c]);
}

int main(int argc, char **argv)
{
	double start, end;
	int rc = 0;

	if (parse_args(argc, argv) || !wf_opt.endpoint || wf_opt.every == 0) {
		usage(stderr);
		return 2;
	}
	signal(SIGPIPE, SIG_IGN);
	rng_state = wf_opt.seed;
	zctx = zmq_ctx_new();
	wf_ctrl = zctx ? new_socket() : NULL;
	for (int i = 0; wf_ctrl && i < FUZZ_SOCKETS; i++)
		if (!(socks[i] = new_socket()))
			wf_ctrl = NULL;
	if (!wf_ctrl) {
		say("cannot connect to %s: %s", wf_opt.endpoint, zmq_strerror(errno));
		return 2;
	}
	if (setup()) {
		rc = process_alive() ? 2 : 1;
		goto out;
	}
	if (wf_opt.n_replay) {
		rc = replay_all();
		report();
		goto out;
	}
	start = now_s();
	end = start + wf_opt.seconds;
	say("fuzzing %s: seed %" PRIu64 ", at most %" PRIu64 " messages and %.0f s", wf_opt.endpoint,
	    wf_opt.seed, wf_opt.count, wf_opt.seconds);
	for (uint64_t i = 0; i < wf_opt.count && now_s() < end; i++) {
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
		if ((i + 1) % wf_opt.every == 0 && !liveness("during the run")) {
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
	if (wf_ctrl)
		zmq_close(wf_ctrl);
	if (zctx)
		zmq_ctx_term(zctx);
	while (n_shms)
		shm_forget(n_shms - 1);
	for (int i = 0; i < LOG_MSGS; i++)
		msg_free(&logbuf[i]);
	return rc;
}
