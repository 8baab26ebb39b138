/*
 * wire_fuzz_msg — messages and frames for fuzz_wire_daemon (wire_fuzz.h): build, send
 * and receive them, keep the last ones sent, save those to a .kvbw file when a check
 * fails, and send such files again (--replay).
 *
 * A .kvbw file: the magic KVBW_MAGIC, then for each message a byte (1: an empty
 * delimiter frame goes first), a frame count (u32), and each frame as a length (u32)
 * and its bytes; integers in the host's byte order.
 */
#include <dirent.h>
#include <errno.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

#include <zmq.h>

#include "proto/wire.h"
#include "tests/fuzz/wire_fuzz.h"

#define KVBW_MAGIC "KVBWIRE1"

/* The last LOG_MSGS messages sent, for the report of a failure. */
struct msg logbuf[LOG_MSGS];
static uint64_t n_logged;

/* ---- messages ---- */

void msg_init(struct msg *m, const char *kind)
{
	memset(m, 0, sizeof(*m));
	m->delim = true;
	m->expect_reply = true;
	m->kind = kind;
	m->learn_idx = -1;
}

void msg_free(struct msg *m)
{
	for (size_t i = 0; i < m->n; i++)
		free(m->f[i].data);
	free(m->f);
	m->f = NULL;
	m->n = m->cap = 0;
}

/* Append a frame of len bytes (copied from data, or random when data is NULL). */
uint8_t *msg_add(struct msg *m, const void *data, size_t len)
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

void msg_add_header(struct msg *m, const struct kvbp_request *q)
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

void log_msg(const struct msg *m)
{
	struct msg *slot = &logbuf[n_logged % LOG_MSGS];

	msg_free(slot);
	msg_copy(slot, m);
	n_logged++;
}

int send_msg(void *sock, const struct msg *m)
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
int recv_msg(void *sock, int ms, struct msg *out)
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

void save_log(const char *why)
{
	char path[4096];
	uint64_t first = n_logged > LOG_MSGS ? n_logged - LOG_MSGS : 0;
	FILE *f;

	wf_failed = true;
	say("FAILED: %s (after %" PRIu64 " messages, seed %" PRIu64 ")", why, wf_st.sent, wf_opt.seed);
	for (uint64_t i = n_logged > 5 ? n_logged - 5 : 0; i < n_logged; i++) {
		const struct msg *m = &logbuf[i % LOG_MSGS];

		say("  message %" PRIu64 " (%s): %zu frames%s, header %zu bytes", i, m->kind, m->n,
		    m->delim ? " after a delimiter" : "", m->n ? m->f[0].len : 0);
	}
	if (!wf_opt.save)
		return;
	mkdir(wf_opt.save, 0755);
	snprintf(path, sizeof(path), "%s/wire-seed%" PRIu64 "-msg%" PRIu64 ".kvbw", wf_opt.save, wf_opt.seed,
		 wf_st.sent);
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
			if (m->f[i].len > 2 * wf_opt.max_message)
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
		else if (wf_opt.every == 1 && !liveness("during the replay"))
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

int replay_all(void)
{
	int rc = 0;

	for (int i = 0; i < wf_opt.n_replay; i++) {
		struct stat s;
		struct dirent **names;
		int n;

		if (stat(wf_opt.replay[i], &s)) {
			say("%s: %s", wf_opt.replay[i], strerror(errno));
			return 2;
		}
		if (!S_ISDIR(s.st_mode)) {
			int r = replay_file(wf_opt.replay[i]);

			rc = r > rc ? r : rc;
			continue;
		}
		n = scandir(wf_opt.replay[i], &names, NULL, by_name);
		for (int j = 0; j < n; j++) {
			size_t l = strlen(names[j]->d_name);
			char path[4096];

			if (l > 5 && !strcmp(names[j]->d_name + l - 5, ".kvbw")) {
				int r;

				snprintf(path, sizeof(path), "%s/%s", wf_opt.replay[i], names[j]->d_name);
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
