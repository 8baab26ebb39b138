/*
 * Hostile clients against the real kvblendd: each case reproduces a defect an
 * adversarial review found (issue 7) and checks that the daemon holds and keeps
 * serving. Requests are sent with raw ZeroMQ sockets where the client library
 * would never send them, so that the daemon sees what an attacker sends.
 */
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <setjmp.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <cmocka.h>

#include "proto/fdsock.h"
#include "tests/integration/harness.h"
#include "tests/integration/rawreq.h"

/* ---- a model and a few chunks ---- */

#define L 4
#define H 8
#define D 64
#define ROW (H * D * 2)
#define T 32

static const struct kvb_model model = TEST_MODEL_F16("hm", L, H, D);

static void put_chunk(kvb_client *c, uint32_t id, uint8_t hash[KVB_HASH_LEN])
{
	uint32_t ids[2] = { 4242, id };

	put_test_chunk(c, &model, ids, 2, T, 0, id, hash);
}

static void fuse_open_req(struct kvbp_request *q, const uint8_t *hash, struct kvbp_segment *seg,
			  uint32_t *check, double *ratio)
{
	memset(seg, 0, sizeof(*seg));
	memcpy(seg->hash, hash, KVBP_HASH_LEN);
	*check = 1;
	*ratio = 0.25;
	raw_fuse_open_request(q, model.name, seg, 1, check, ratio, 1);
}

/* The daemon still answers a plain request. */
static void assert_serving(const struct daemon *d)
{
	kvb_client *c = daemon_client(d, 1);

	assert_int_equal(kvb_ping(c, NULL, 0), 0);
	kvb_close(&c);
}

/*
 * Defect 1: FUSE_CLOSE while a layer request of the same session runs on another
 * worker. The close must not read the session after the other holder frees it
 * (ASan in the daemon turns a use-after-free into a non-zero exit at stop).
 */
static void close_during_layer(void **state)
{
	struct daemon d;
	const char *args[] = { "--workers", "4", NULL };
	uint8_t hash[KVB_HASH_LEN];
	struct raw a, b;
	kvb_client *c;
	size_t bytes = (size_t)T * ROW;
	uint8_t *k = calloc(1, bytes), *v = calloc(1, bytes);
	const void *pl[2] = { k, v };
	size_t lens[2] = { bytes, bytes };
	unsigned closed_first = 0;

	(void)state;
	c = daemon_start_client(&d, args, &model, 1);
	put_chunk(c, 1, hash);
	raw_open(&a, d.endpoint, 20000);
	raw_open(&b, d.endpoint, 20000);
	for (int i = 0; i < 3000; i++) {
		struct kvbp_request q;
		struct kvbp_reply rep = { 0 };
		struct kvbp_segment seg;
		uint32_t check;
		double ratio;
		uint64_t id;

		fuse_open_req(&q, hash, &seg, &check, &ratio);
		assert_int_equal(raw_call(&a, &q, NULL, NULL, 0, &rep), KVBP_OK);
		id = rep.session_id;
		kvbp_reply_clear(&rep);
		memset(&q, 0, sizeof(q));
		q.op = KVBP_OP_FUSE_LAYER;
		q.session_id = id;
		q.layer = 1;
		q.rows = T;
		raw_send(&a, &q, pl, lens, 2);
		memset(&q, 0, sizeof(q));
		q.op = KVBP_OP_FUSE_CLOSE;
		q.session_id = id;
		assert_int_equal(raw_call(&b, &q, NULL, NULL, 0, &rep), KVBP_OK);
		kvbp_reply_clear(&rep);
		/* The layer either ran before the close or found the session gone. */
		rep = (struct kvbp_reply){ 0 };
		closed_first += raw_recv(&a, &rep) == KVBP_UNKNOWN_SESSION;
		kvbp_reply_clear(&rep);
	}
	print_message("%u of 3000 layer requests arrived after the close\n", closed_first);
	raw_close(&a);
	raw_close(&b);
	assert_serving(&d);
	daemon_end(&d, &c);
	free(k);
	free(v);
}


/*
 * Defect 15: a client that omits the empty delimiter and sends an empty payload
 * frame used to get its own header echoed back and the wrong frame decoded. The
 * envelope is [delimiter] [header] [payload...]; anything else is refused with
 * bad_frames, answered with a delimiter of the daemon's own.
 */
static void envelope_without_delimiter(void **state)
{
	struct daemon d;
	struct kvbp_request q = { .version = KVBP_VERSION, .op = KVBP_OP_HELLO, .request_id = 7 };
	struct kvbp_reply rep;
	zmq_msg_t f[8];
	uint8_t *hdr;
	size_t hlen, n;
	struct raw r;
	char err[256];

	(void)state;
	daemon_start(&d, NULL);
	raw_open(&r, d.endpoint, 20000);
	assert_int_equal(kvbp_request_encode(&q, &hdr, &hlen), 0);
	/* [header] [empty payload] */
	assert_true(zmq_send(r.sock, hdr, hlen, ZMQ_SNDMORE) >= 0);
	assert_int_equal(zmq_send(r.sock, "", 0, 0), 0);
	n = raw_recv_all(&r, f, 8);
	assert_int_equal(n, 2);
	assert_int_equal(zmq_msg_size(&f[0]), 0);
	memset(&rep, 0, sizeof(rep));
	assert_int_equal(kvbp_reply_decode(zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), &rep, err,
					   sizeof(err)), 0);
	assert_int_equal(rep.code, KVBP_BAD_FRAMES);
	assert_non_null(strstr(rep.message, "delimiter"));
	kvbp_reply_clear(&rep);
	for (size_t i = 0; i < n; i++)
		zmq_msg_close(&f[i]);
	/* [header] alone */
	assert_true(zmq_send(r.sock, hdr, hlen, 0) >= 0);
	n = raw_recv_all(&r, f, 8);
	assert_int_equal(n, 2);
	assert_int_equal(zmq_msg_size(&f[0]), 0);
	memset(&rep, 0, sizeof(rep));
	assert_int_equal(kvbp_reply_decode(zmq_msg_data(&f[1]), zmq_msg_size(&f[1]), &rep, err,
					   sizeof(err)), 0);
	assert_int_equal(rep.code, KVBP_BAD_FRAMES);
	kvbp_reply_clear(&rep);
	for (size_t i = 0; i < n; i++)
		zmq_msg_close(&f[i]);
	/* and the same header with the delimiter is served */
	memset(&rep, 0, sizeof(rep));
	q.request_id = 8;
	assert_int_equal(raw_call(&r, &q, NULL, NULL, 0, &rep), KVBP_OK);
	assert_true(rep.request_id == 8);
	kvbp_reply_clear(&rep);
	free(hdr);
	raw_close(&r);
	daemon_stop(&d);
	daemon_cleanup(&d);
}

#define PUT_TOKENS 4096

/*
 * Send n PUTs of 32 MiB chunks (PUT_TOKENS tokens, every layer the same bytes) without
 * waiting, request ids 1..n, chunk i hashed from (tag, i); hashes (may be NULL) gets
 * them.
 */
static void send_big_puts(struct raw *r, int n, uint32_t tag, uint8_t (*hashes)[KVB_HASH_LEN])
{
	size_t bytes = (size_t)PUT_TOKENS * ROW;
	uint8_t *layer = malloc(bytes);
	const void *pl[2 * L];
	size_t lens[2 * L];

	fill_f16((uint16_t *)layer, bytes / 2, tag);
	for (int i = 0; i < 2 * L; i++) {
		pl[i] = layer;
		lens[i] = bytes;
	}
	for (int i = 0; i < n; i++) {
		struct kvbp_request q = { .op = KVBP_OP_PUT, .has_hash = true,
					  .num_tokens = PUT_TOKENS, .request_id = (uint64_t)i + 1 };
		uint32_t ids[2] = { tag, (uint32_t)i };

		snprintf(q.model_name, sizeof(q.model_name), "%s", model.name);
		kvb_chunk_hash(ids, 2, q.hash);
		if (hashes)
			memcpy(hashes[i], q.hash, KVB_HASH_LEN);
		raw_send(r, &q, pl, lens, 2 * L);
	}
	free(layer);
}

/*
 * Defect 11: SIGTERM while PUTs are in progress. Each gets its reply (ok, or busy
 * for one that arrived after the stop began), the daemon exits cleanly, and every
 * acknowledged chunk is there after a restart.
 */
static void sigterm_answers_inflight(void **state)
{
	enum { PUTS = 6 };
	const char *drain_args[] = { "--drain-timeout", "120", NULL };
	struct daemon d;
	uint8_t hashes[PUTS][KVB_HASH_LEN];
	uint32_t codes[PUTS];
	size_t n_ok = 0;
	kvb_client *c;
	struct raw r;

	(void)state;
	/* a drain long enough for a sanitized build on a busy machine */
	c = daemon_start_client(&d, drain_args, &model, 1);
	kvb_close(&c);
	raw_open(&r, d.endpoint, 20000);
	send_big_puts(&r, PUTS, 777, hashes);
	/*
	 * A HELLO after the PUTs: the daemon reads one connection's messages in order, so
	 * when its reply is here every PUT has reached the daemon (none is still in the
	 * socket when the stop begins), and the first PUTs are being stored.
	 */
	{
		struct kvbp_request q = { .op = KVBP_OP_HELLO, .request_id = 1000 };

		raw_send(&r, &q, NULL, NULL, 0);
	}
	for (int i = 0; i < PUTS; i++)
		codes[i] = UINT32_MAX;
	for (int got = 0; got < PUTS;) {
		struct kvbp_reply rep = { 0 };
		uint32_t code = raw_recv(&r, &rep);

		if (rep.request_id == 1000) {
			assert_int_equal(code, KVBP_OK);
			kill(d.pid, SIGTERM);
			kvbp_reply_clear(&rep);
			continue;
		}
		/* replies come as workers finish, each with its request's id */
		assert_true(code == KVBP_OK || code == KVBP_BUSY);
		assert_true(rep.request_id >= 1 && rep.request_id <= PUTS);
		assert_int_equal(codes[rep.request_id - 1], UINT32_MAX);
		codes[rep.request_id - 1] = code;
		n_ok += code == KVBP_OK;
		got++;
		kvbp_reply_clear(&rep);
	}
	print_message("%zu of %d PUTs acknowledged, the rest answered busy\n", n_ok, PUTS);
	raw_close(&r);
	daemon_wait(&d);
	daemon_restart(&d, drain_args);
	c = daemon_client(&d, 1);
	for (int i = 0; i < PUTS; i++) {
		struct kvb_chunk_info info;

		assert_int_equal(kvb_lookup(c, model.name, &hashes[i], 1, &info), 0);
		if (codes[i] == KVBP_OK)
			assert_true(info.found);
	}
	daemon_end(&d, &c);
}

struct scribbler {
	volatile uint8_t *p;
	size_t len;
	atomic_bool stop;
};

static void *scribble(void *arg)
{
	struct scribbler *w = arg;
	uint32_t x = 12345;

	while (!atomic_load(&w->stop))
		for (size_t i = 0; i < w->len; i += 4096) {
			x = x * 1103515245u + 12345u;
			w->p[i + (x >> 20) % 4096 % (w->len - i)] = (uint8_t)x;
		}
	return NULL;
}

/*
 * Defect 9: a PUT from shared memory while the client writes its segment was
 * acknowledged, then read back as corrupt and deleted. Every acknowledged PUT
 * must read back whole.
 */
static void put_from_changing_shm(void **state)
{
	struct daemon d;
	size_t bytes = (size_t)L * 2 * T * ROW;
	struct scribbler w = { 0 };
	kvb_client *c, *reader;
	uint8_t *out = malloc(bytes);
	pthread_t th;

	(void)state;
	daemon_start(&d, NULL);
	c = daemon_client(&d, 0);
	reader = daemon_client(&d, 1);
	assert_int_equal(kvb_model_register(c, &model, NULL), 0);
	w.p = kvb_shared_buffer(c, bytes);
	assert_non_null((void *)w.p);
	fill_f16((uint16_t *)w.p, bytes / 2, 5);
	w.len = bytes;
	assert_int_equal(pthread_create(&th, NULL, scribble, &w), 0);
	for (uint32_t i = 0; i < 30; i++) {
		uint8_t hash[KVB_HASH_LEN];
		uint32_t ids[2] = { 31337, i };
		struct kvb_chunk_info info;
		int rc;

		kvb_chunk_hash(ids, 2, hash);
		assert_int_equal(kvb_put(c, model.name, hash, KVB_F16, T, 0, (const void *)w.p, bytes,
					 NULL), 0);
		rc = kvb_get(reader, model.name, hash, 0, 0, out, bytes, &info);
		if (rc)
			fail_msg("PUT %u acknowledged, GET says %s", i, kvb_last_error(reader));
	}
	atomic_store(&w.stop, true);
	pthread_join(th, NULL);
	assert_true(daemon_stat(reader, "corrupt_removed") == 0);
	kvb_close(&reader);
	daemon_end(&d, &c);
	free(out);
}

/* Names in /dev/shm of the daemon pid (kvblendd used to name its segments kvblend-PID-...). */
static unsigned names_in_dev_shm(pid_t pid)
{
	char cmd[128];
	FILE *p;
	unsigned n = 0;

	snprintf(cmd, sizeof(cmd), "ls /dev/shm 2>/dev/null | grep -c '^kvblend-%d-' || true", (int)pid);
	p = popen(cmd, "r");
	assert_non_null(p);
	if (fscanf(p, "%u", &n) != 1)
		n = 0;
	pclose(p);
	return n;
}

/* Open a fuse session over hash with a shared ring; returns the reply (caller clears). */
static void raw_fuse_open(struct raw *r, const uint8_t *hash, struct kvbp_reply *rep)
{
	struct kvbp_request q;
	struct kvbp_segment seg;
	uint32_t check;
	double ratio;

	fuse_open_req(&q, hash, &seg, &check, &ratio);
	q.shared_ring = true;
	memset(rep, 0, sizeof(*rep));
	assert_int_equal(raw_call(r, &q, NULL, NULL, 0, rep), KVBP_OK);
}

/*
 * Defect 4: a request naming a ring's id must not reach the ring (it used to unlink
 * its name, so the next session could not map it), and a client that does not map
 * its ring gets the fused layers in frames.
 */
static void ring_not_reachable_by_requests(void **state)
{
	struct daemon d;
	uint8_t hash[KVB_HASH_LEN];
	size_t bytes = (size_t)T * ROW, n_payload;
	uint8_t *k = calloc(1, bytes), *v = calloc(1, bytes);
	const void *pl[2] = { k, v };
	size_t lens[2] = { bytes, bytes };
	struct kvbp_reply rep, open;
	struct kvbp_request q;
	kvb_client *c;
	struct raw r;

	(void)state;
	c = daemon_start_client(&d, NULL, &model, 0);
	put_chunk(c, 1, hash);
	raw_open(&r, d.endpoint, 20000);
	raw_fuse_open(&r, hash, &open);
	assert_true(open.shm_id != 0);
	/* a GET into the ring, a detach of it: neither reaches it */
	memset(&q, 0, sizeof(q));
	q.op = KVBP_OP_GET;
	snprintf(q.model_name, sizeof(q.model_name), "%s", model.name);
	q.has_hash = true;
	memcpy(q.hash, hash, KVB_HASH_LEN);
	q.has_shm = true;
	q.shm_id = open.shm_id;
	q.shm_length = open.shm_size;
	memset(&rep, 0, sizeof(rep));
	assert_int_equal(raw_call(&r, &q, NULL, NULL, 0, &rep), KVBP_BAD_SHM);
	kvbp_reply_clear(&rep);
	memset(&q, 0, sizeof(q));
	q.op = KVBP_OP_SHM_DETACH;
	q.has_shm = true;
	q.shm_id = open.shm_id;
	memset(&rep, 0, sizeof(rep));
	assert_int_equal(raw_call(&r, &q, NULL, NULL, 0, &rep), KVBP_BAD_SHM);
	kvbp_reply_clear(&rep);
	/* this client never maps the ring: layers come in frames */
	{
		uint32_t rows = T;

		for (uint32_t layer = 1; layer < L; layer++) {
			memset(&q, 0, sizeof(q));
			q.op = KVBP_OP_FUSE_LAYER;
			q.session_id = open.session_id;
			q.layer = layer;
			q.rows = rows;
			lens[0] = lens[1] = (size_t)rows * ROW;
			raw_send(&r, &q, pl, lens, 2);
			memset(&rep, 0, sizeof(rep));
			assert_int_equal(raw_recv_frames(&r, &rep, &n_payload, raw_frame_sized,
							 &bytes), KVBP_OK);
			assert_int_equal(n_payload, layer == 1 ? 0 : 2);
			rows = rep.rows_next;
			if (layer + 1 < L)
				kvbp_reply_clear(&rep);
		}
	}
	kvbp_reply_clear(&rep);
	kvbp_reply_clear(&open);
	/* a session of the library, which maps its ring, gets its layers in place */
	{
		struct kvb_segment seg = { .pos = 0 };
		uint32_t checks[1] = { 1 };
		double ratios[1] = { 0.25 };
		struct kvb_fuse_params p = { .check_layers = checks, .ratios = ratios, .n_checks = 1 };
		kvb_fuse *f;
		const void *rk, *rv;

		memcpy(seg.hash, hash, KVB_HASH_LEN);
		assert_int_equal(kvb_fuse_open(c, model.name, &seg, 1, &p, &f, NULL, NULL), 0);
		for (uint32_t layer = 1; layer < L; layer++) {
			const int32_t *rows;
			size_t nr = kvb_fuse_rows(f, &rows);
			int fused;

			(void)nr;
			assert_int_equal(kvb_fuse_layer(c, f, layer, k, v, NULL, NULL, &fused), 0);
			if (layer > 1)
				assert_int_equal(kvb_fuse_output(f, &rk, &rv), 0);
		}
		assert_int_equal(kvb_fuse_close(c, &f, NULL, NULL), 0);
	}
	assert_int_equal(names_in_dev_shm(d.pid), 0);
	raw_close(&r);
	daemon_end(&d, &c);
	free(k);
	free(v);
}

/*
 * Defect 3: a ring belongs to one client. Another process's session never gets
 * this one's ring (its memory starts zeroed, not holding our fused KV), cannot
 * fetch our ring's descriptor, and no ring has a name in /dev/shm to open.
 */
static void ring_not_shared_across_clients(void **state)
{
	struct daemon d;
	uint8_t hash[KVB_HASH_LEN];
	char sock_path[700];
	struct kvbp_reply open;
	kvb_client *c;
	struct raw r;
	pid_t pid;
	int status, fds[2];
	uint64_t child_ring = 0;

	(void)state;
	c = daemon_start_client(&d, NULL, &model, 0);
	put_chunk(c, 1, hash);
	/* our session: fused KV of the chunk lands in our ring */
	{
		struct kvb_segment seg = { .pos = 100 };
		uint32_t checks[1] = { 1 };
		double ratios[1] = { 0.25 };
		struct kvb_fuse_params p = { .check_layers = checks, .ratios = ratios, .n_checks = 1 };
		uint8_t *k = calloc(1, (size_t)T * ROW), *v = calloc(1, (size_t)T * ROW);
		kvb_fuse *f;

		memcpy(seg.hash, hash, KVB_HASH_LEN);
		assert_int_equal(kvb_fuse_open(c, model.name, &seg, 1, &p, &f, NULL, NULL), 0);
		for (uint32_t layer = 1; layer < L; layer++)
			assert_int_equal(kvb_fuse_layer(c, f, layer, k, v, NULL, NULL, NULL), 0);
		assert_int_equal(kvb_fuse_close(c, &f, NULL, NULL), 0);
		free(k);
		free(v);
	}
	snprintf(sock_path, sizeof(sock_path), "%s.shm", d.endpoint + 6);
	/* another process opens a session; its ring must be new memory */
	assert_int_equal(pipe(fds), 0);
	pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		struct raw cr;
		int fd, bad = 0;

		raw_open(&cr, d.endpoint, 20000);
		raw_fuse_open(&cr, hash, &open);
		fd = kvbp_segment_fd(sock_path, open.shm_id);
		if (fd < 0) {
			bad = 2;
		} else {
			const uint8_t *m = mmap(NULL, open.shm_size, PROT_READ, MAP_SHARED, fd, 0);

			/* the prefetch may fill the first slots; the last one is untouched */
			for (uint64_t i = open.shm_size - open.slot_bytes; m != MAP_FAILED &&
			     i < open.shm_size; i++)
				bad |= m[i] != 0;
		}
		if (write(fds[1], &open.shm_id, 8) != 8)
			bad = 3;
		sleep(1); /* keep the session open while the parent tries our ring */
		_exit(bad);
	}
	close(fds[1]);
	assert_int_equal(read(fds[0], &child_ring, 8), 8);
	close(fds[0]);
	/* we may not fetch the other client's ring */
	assert_int_equal(kvbp_segment_fd(sock_path, child_ring), -1);
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_true(WIFEXITED(status));
	assert_int_equal(WEXITSTATUS(status), 0);
	assert_int_equal(names_in_dev_shm(d.pid), 0);
	raw_open(&r, d.endpoint, 20000);
	raw_close(&r);
	daemon_end(&d, &c);
}

/*
 * Defect 8: a client truncating its segment used to kill the daemon with SIGBUS.
 * Segments are sealed: the truncation fails, and the daemon serves on.
 */
static void segment_cannot_be_truncated(void **state)
{
	struct daemon d;
	uint8_t hash[KVB_HASH_LEN];
	size_t bytes = (size_t)L * 2 * T * ROW;
	struct kvbp_request q = { .op = KVBP_OP_SHM_ATTACH, .shm_size = 8u << 20 };
	struct kvbp_reply rep = { 0 };
	kvb_client *c;
	struct raw r;
	int fd;

	(void)state;
	c = daemon_start_client(&d, NULL, &model, 1);
	put_chunk(c, 1, hash);
	raw_open(&r, d.endpoint, 20000);
	assert_int_equal(raw_call(&r, &q, NULL, NULL, 0, &rep), KVBP_OK);
	fd = kvbp_segment_fd(rep.shm_name, rep.shm_id);
	assert_true(fd >= 0);
	assert_int_equal(ftruncate(fd, 0), -1);
	assert_int_equal(errno, EPERM);
	/* a GET into it: served whole */
	memset(&q, 0, sizeof(q));
	q.op = KVBP_OP_GET;
	snprintf(q.model_name, sizeof(q.model_name), "%s", model.name);
	q.has_hash = true;
	memcpy(q.hash, hash, KVB_HASH_LEN);
	q.has_shm = true;
	q.shm_id = rep.shm_id;
	q.shm_length = bytes;
	kvbp_reply_clear(&rep);
	memset(&rep, 0, sizeof(rep));
	assert_int_equal(raw_call(&r, &q, NULL, NULL, 0, &rep), KVBP_OK);
	kvbp_reply_clear(&rep);
	close(fd);
	raw_close(&r);
	assert_serving(&d);
	daemon_end(&d, &c);
}

/* Open shared-memory segments and fuse sessions until refused; returns how many. */
static unsigned take_all(struct raw *r, const uint8_t *hash, bool sessions, char *msg, size_t len)
{
	unsigned n = 0;

	for (;;) {
		struct kvbp_reply rep = { 0 };
		uint32_t code;

		if (sessions) {
			struct kvbp_request q;
			struct kvbp_segment seg;
			uint32_t check;
			double ratio;

			fuse_open_req(&q, hash, &seg, &check, &ratio);
			code = raw_call(r, &q, NULL, NULL, 0, &rep);
		} else {
			struct kvbp_request q = { .op = KVBP_OP_SHM_ATTACH, .shm_size = 1u << 20 };

			code = raw_call(r, &q, NULL, NULL, 0, &rep);
		}
		if (code) {
			assert_int_equal(code, KVBP_LIMIT);
			snprintf(msg, len, "%s", rep.message);
			kvbp_reply_clear(&rep);
			return n;
		}
		kvbp_reply_clear(&rep);
		n++;
		assert_true(n < 1000);
	}
}

/*
 * Defect 13: one client could take every shared-memory slot and every fuse
 * session. Each client has a share; the message names the limit that was hit, and
 * another client is still served.
 */
static void per_client_shares(void **state)
{
	struct daemon d;
	const char *args[] = { "--client-shm-segments", "5", "--client-fuse-sessions", "3",
			       "--fuse-max-sessions", "8", NULL };
	uint8_t hash[KVB_HASH_LEN];
	char msg[256];
	kvb_client *c;
	struct raw r;
	pid_t pid;
	int status;

	(void)state;
	c = daemon_start_client(&d, args, &model, 1);
	put_chunk(c, 1, hash);
	raw_open(&r, d.endpoint, 20000);
	assert_int_equal(take_all(&r, hash, false, msg, sizeof(msg)), 5);
	assert_non_null(strstr(msg, "client_shm_segments"));
	assert_int_equal(take_all(&r, hash, true, msg, sizeof(msg)), 3);
	assert_non_null(strstr(msg, "client_fuse_sessions"));
	/* another process still gets its own share */
	pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		struct raw cr;
		char m2[256];
		unsigned a, b;

		raw_open(&cr, d.endpoint, 20000);
		a = take_all(&cr, hash, false, m2, sizeof(m2));
		b = take_all(&cr, hash, true, m2, sizeof(m2));
		/* the daemon-wide session limit (8) is not hit by 3 + 3 */
		_exit(a == 5 && b == 3 ? 0 : 1);
	}
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_true(WIFEXITED(status));
	assert_int_equal(WEXITSTATUS(status), 0);
	raw_close(&r);
	daemon_end(&d, &c);
}

/* A line of /proc/PID/status in KiB (VmRSS, VmHWM). */
static uint64_t proc_kib(pid_t pid, const char *key)
{
	char path[64], line[256];
	uint64_t v = 0;
	FILE *f;

	snprintf(path, sizeof(path), "/proc/%d/status", (int)pid);
	f = fopen(path, "r");
	assert_non_null(f);
	while (fgets(line, sizeof(line), f))
		if (!strncmp(line, key, strlen(key)) && line[strlen(key)] == ':')
			v = strtoull(line + strlen(key) + 1, NULL, 10);
	fclose(f);
	return v;
}

/*
 * Defect 6, replies: a client that sends GETs and never reads the replies used to
 * make the daemon hold every reply (150 x 16 MiB: 2.4 GiB). Unread replies count
 * against the client's share; beyond it its GETs get `limit`, and other clients
 * are served meanwhile.
 */
static void unread_replies_are_bounded(void **state)
{
	enum { GETS = 120, BIG_T = 1024 };
	const char *args[] = { "--client-inflight-bytes", "64M", NULL };
	size_t bytes = (size_t)L * 2 * BIG_T * ROW; /* 8 MiB */
	uint8_t hash[KVB_HASH_LEN], *kv = malloc(bytes), *out = malloc(bytes);
	uint32_t ids[2] = { 5150, 1 };
	struct daemon d;
	kvb_client *c;
	uint64_t rss0, rss1;
	unsigned ok = 0, limited = 0;
	int one = 1, small = 4096;
	struct raw r;

	(void)state;
	c = daemon_start_client(&d, args, &model, 1);
	fill_f16((uint16_t *)kv, bytes / 2, 3);
	kvb_chunk_hash(ids, 2, hash);
	assert_int_equal(kvb_put(c, model.name, hash, KVB_F16, BIG_T, 0, kv, bytes, NULL), 0);
	assert_int_equal(kvb_get(c, model.name, hash, 0, 0, out, bytes, NULL), 0);
	rss0 = proc_kib(d.pid, "VmRSS");
	/* a reader that reads nothing: its socket holds one message at most */
	r.ctx = zmq_ctx_new();
	r.sock = zmq_socket(r.ctx, ZMQ_DEALER);
	zmq_setsockopt(r.sock, ZMQ_RCVHWM, &one, sizeof(one));
	zmq_setsockopt(r.sock, ZMQ_RCVBUF, &small, sizeof(small));
	assert_int_equal(zmq_connect(r.sock, d.endpoint), 0);
	for (int i = 0; i < GETS; i++) {
		struct kvbp_request q = { .op = KVBP_OP_GET, .has_hash = true,
					  .request_id = (uint64_t)i + 1 };

		snprintf(q.model_name, sizeof(q.model_name), "%s", model.name);
		memcpy(q.hash, hash, KVB_HASH_LEN);
		raw_send(&r, &q, NULL, NULL, 0);
	}
	sleep(1);
	/* meanwhile another client (another process: this one's connections share a budget)
	 * is served */
	{
		pid_t pid = fork();
		int status;

		assert_true(pid >= 0);
		if (pid == 0) {
			struct kvb_connect_opts o = { .timeout_ms = 10000, .no_shm = 1 };
			kvb_client *other = NULL;
			int bad = kvb_connect(d.endpoint, &o, &other, NULL, 0) != 0;

			for (int i = 0; i < 5 && !bad; i++)
				bad = kvb_get(other, model.name, hash, 0, 0, out, bytes, NULL) != 0;
			_exit(bad);
		}
		assert_int_equal(waitpid(pid, &status, 0), pid);
		assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	}
	rss1 = proc_kib(d.pid, "VmRSS");
	print_message("daemon RSS %" PRIu64 " MiB before, %" PRIu64 " MiB with %d unread 8 MiB "
		      "GET replies requested\n", rss0 >> 10, rss1 >> 10, GETS);
	/* 120 x 8 MiB would be 960 MiB; the share is 64 MiB (ASan keeps some freed memory) */
	assert_true(rss1 < rss0 + (400u << 10));
	{
		int timeout = 20000;

		zmq_setsockopt(r.sock, ZMQ_RCVTIMEO, &timeout, sizeof(timeout));
	}
	for (int i = 0; i < GETS; i++) {
		struct kvbp_reply rep = { 0 };
		uint32_t code = raw_recv(&r, &rep);

		assert_true(code == KVBP_OK || code == KVBP_LIMIT);
		if (code == KVBP_LIMIT)
			assert_non_null(strstr(rep.message, "client_inflight_bytes"));
		ok += code == KVBP_OK;
		limited += code == KVBP_LIMIT;
		kvbp_reply_clear(&rep);
	}
	print_message("%u served, %u refused with limit\n", ok, limited);
	assert_true(ok >= 1 && limited >= 1);
	raw_close(&r);
	/* all released but the stats request's own header */
	assert_true(daemon_stat(c, "inflight_bytes") < 4096);
	daemon_end(&d, &c);
	free(kv);
	free(out);
}

/*
 * Defect 6, requests: 40 pipelined 32 MiB PUTs used to be held whole (1.3-1.7 GiB
 * peak for 60). Beyond the client's share they are refused at once and freed.
 */
static void pipelined_puts_are_bounded(void **state)
{
	enum { PUTS = 40 };
	const char *args[] = { "--client-inflight-bytes", "64M", "--no-sync", "true", NULL };
	struct daemon d;
	kvb_client *c;
	uint64_t hwm0, hwm1;
	unsigned ok = 0, limited = 0;
	struct raw r;

	(void)state;
	c = daemon_start_client(&d, args, &model, 1);
	hwm0 = proc_kib(d.pid, "VmHWM");
	raw_open(&r, d.endpoint, 20000);
	send_big_puts(&r, PUTS, 6160, NULL);
	for (int i = 0; i < PUTS; i++) {
		struct kvbp_reply rep = { 0 };
		uint32_t code = raw_recv(&r, &rep);

		assert_true(code == KVBP_OK || code == KVBP_LIMIT);
		ok += code == KVBP_OK;
		limited += code == KVBP_LIMIT;
		kvbp_reply_clear(&rep);
	}
	hwm1 = proc_kib(d.pid, "VmHWM");
	print_message("daemon peak RSS %" PRIu64 " MiB before, %" PRIu64 " MiB after %d pipelined "
		      "32 MiB PUTs: %u stored, %u refused\n", hwm0 >> 10, hwm1 >> 10, PUTS, ok,
		      limited);
	assert_true(ok >= 1);
	/* 40 x 32 MiB = 1.25 GiB sent */
	assert_true(hwm1 < hwm0 + (640u << 10));
	raw_close(&r);
	assert_serving(&d);
	daemon_end(&d, &c);
}

/*
 * Defect 5: about 1000 IPC connections aborted the daemon (libzmq asserts on
 * EMFILE in its IPC listener). Here the daemon's descriptor limit is cut to 400
 * while it runs, and 1000 clients connect at once: beyond max_clients (300)
 * handshakes are refused, beyond the descriptors connections are dropped, and
 * the daemon serves on.
 */
static void many_connections(void **state)
{
	enum { CONNS = 1000 };
	const char *args[] = { "--max-clients", "300", NULL };
	struct rlimit lim = { 400, 400 };
	struct daemon d;
	void *ctx, **socks = calloc(CONNS, sizeof(void *));
	char *served = calloc(CONNS, 1);
	unsigned answered = 0;
	kvb_client *c;
	int zero = 0, timeout = 3000;

	(void)state;
	daemon_start(&d, args);
	assert_int_equal(prlimit(d.pid, RLIMIT_NOFILE, &lim, NULL), 0);
	ctx = zmq_ctx_new();
	zmq_ctx_set(ctx, ZMQ_MAX_SOCKETS, CONNS + 16);
	for (int i = 0; i < CONNS; i++) {
		struct kvbp_request q = { .version = KVBP_VERSION, .op = KVBP_OP_HELLO };
		uint8_t *hdr;
		size_t hlen;

		socks[i] = zmq_socket(ctx, ZMQ_DEALER);
		assert_non_null(socks[i]);
		zmq_setsockopt(socks[i], ZMQ_LINGER, &zero, sizeof(zero));
		zmq_setsockopt(socks[i], ZMQ_RCVTIMEO, &timeout, sizeof(timeout));
		assert_int_equal(zmq_connect(socks[i], d.endpoint), 0);
		assert_int_equal(kvbp_request_encode(&q, &hdr, &hlen), 0);
		zmq_send(socks[i], "", 0, ZMQ_SNDMORE);
		zmq_send(socks[i], hdr, hlen, 0);
		free(hdr);
	}
	/*
	 * Collect replies for 3 s, so that every client has tried (and those refused
	 * retried) to connect meanwhile: the daemon is at its limits the whole time. No
	 * blocking receive: a socket the daemon refused would hold the sweep for its
	 * whole timeout (20 of them took a minute in CUDA builds).
	 */
	for (int sweep = 0; sweep < 30; sweep++) {
		for (int i = 0; i < CONNS; i++) {
			zmq_msg_t m;

			if (served[i])
				continue;
			zmq_msg_init(&m);
			if (zmq_msg_recv(&m, socks[i], ZMQ_DONTWAIT) >= 0) {
				answered++;
				while (zmq_msg_more(&m) && zmq_msg_recv(&m, socks[i], 0) >= 0)
					;
				served[i] = 1;
			}
			zmq_msg_close(&m);
		}
		usleep(100000);
	}
	print_message("%u of %d connections served (max_clients 300, 400 descriptors)\n",
		      answered, CONNS);
	assert_true(answered >= 20);
	assert_true(answered < CONNS);
	/* the daemon holds */
	assert_int_equal(kill(d.pid, 0), 0);
	for (int i = 0; i < CONNS; i++)
		zmq_close(socks[i]);
	zmq_ctx_term(ctx);
	free(socks);
	free(served);
	/* all gone: served again, and it says what it refused */
	sleep(1);
	c = daemon_client(&d, 1);
	print_message("refused %g handshakes, dropped %g connections for want of descriptors\n",
		      daemon_stat(c, "connections_refused"),
		      daemon_stat(c, "connections_dropped_no_fd"));
	assert_true(daemon_stat(c, "connections_refused") + daemon_stat(c,
		    "connections_dropped_no_fd") > 0);
	daemon_end(&d, &c);
}

/*
 * The other client of a tenants test, run as uid in a child: it must see none of
 * the first tenant's chunks. Returns a bit per check that failed.
 */
static int tenant_probe(const struct daemon *d, uid_t uid, const uint8_t *hash, bool writes)
{
	struct kvb_connect_opts o = { .timeout_ms = 10000 };
	size_t bytes = (size_t)L * 2 * T * ROW;
	uint8_t *kv = malloc(bytes);
	struct kvb_chunk_info info;
	struct kvb_model *ms = NULL;
	kvb_client *c = NULL;
	size_t n = 0;
	int existed = -1, bad = 0;

	if (setgid(uid) || setuid(uid))
		return 1 << 0;
	if (kvb_connect(d->endpoint, &o, &c, NULL, 0))
		return 1 << 1;
	/* the same model name is a model of its own here */
	bad |= kvb_model_register(c, &model, &existed) != 0 || existed != 0 ? 1 << 2 : 0;
	bad |= kvb_lookup(c, model.name, (const uint8_t(*)[KVB_HASH_LEN])hash, 1, &info) != 0 ||
	       info.found ? 1 << 3 : 0;
	bad |= kvb_get(c, model.name, hash, 0, 0, kv, bytes, NULL) != KVB_E_NOT_FOUND ? 1 << 4 : 0;
	bad |= kvb_unpin(c, model.name, hash) != KVB_E_NOT_FOUND ? 1 << 5 : 0;
	bad |= kvb_delete(c, model.name, hash) != KVB_E_NOT_FOUND ? 1 << 6 : 0;
	if (writes) {
		/* "poison" the hash: stored in its own namespace, not over the other's */
		memset(kv, 0x7b, bytes);
		existed = -1;
		bad |= kvb_put(c, model.name, hash, KVB_F16, T, 0, kv, bytes, &existed) != 0 ||
		       existed != 0 ? 1 << 7 : 0;
		bad |= kvb_delete(c, model.name, hash) != 0 ? 1 << 8 : 0;
		bad |= kvb_put(c, model.name, hash, KVB_F16, T, 0, kv, bytes, NULL) != 0 ? 1 << 9 : 0;
	}
	bad |= kvb_model_list(c, &ms, &n) != 0 || n != 1 || strcmp(ms[0].name, model.name) ?
		       1 << 10 : 0;
	free(ms);
	kvb_close(&c);
	free(kv);
	return bad;
}

static int run_as(const struct daemon *d, uid_t uid, const uint8_t *hash, bool writes)
{
	pid_t pid = fork();
	int status;

	assert_true(pid >= 0);
	if (pid == 0)
		_exit(tenant_probe(d, uid, hash, writes));
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_true(WIFEXITED(status));
	return WEXITSTATUS(status);
}

/*
 * The daemon of a tenants test, its tenants file /tmp/kvb-tenants-PID (text, into path)
 * read with --tenants-file, its socket and directory open to the other users (the
 * other tenants), capacity (or NULL) its --capacity; a client of it as this process
 * (alice, uid 0) with the model registered. end_tenants_test undoes it all.
 */
static kvb_client *start_tenants_daemon(struct daemon *d, char path[64], const char *text,
					const char *capacity)
{
	const char *args[] = { "--tenants-file", path, "--socket-mode", "0666",
			       capacity ? "--capacity" : NULL, capacity, NULL };
	kvb_client *c;

	snprintf(path, 64, "/tmp/kvb-tenants-%d", (int)getpid());
	write_text_file(path, text);
	daemon_start(d, args);
	assert_int_equal(chmod(d->dir, 0755), 0);
	c = daemon_client(d, 0);
	assert_int_equal(kvb_model_register(c, &model, NULL), 0);
	return c;
}

static void end_tenants_test(struct daemon *d, kvb_client *c, const char *path)
{
	daemon_end(d, &c);
	unlink(path);
}

/*
 * Tenants: with a tenants file, alice (uid 0) and bob (uid 65534) each have their
 * own namespace, and a client bound to neither (uid 1) the default one. None of
 * them can read, overwrite, delete or unpin another's chunk under the same model
 * name and hash (cache poisoning across tenants).
 */
static void tenants_are_isolated(void **state)
{
	char tenants[64];
	size_t bytes = (size_t)L * 2 * T * ROW;
	uint8_t hash[KVB_HASH_LEN], *mine = malloc(bytes), *back = malloc(bytes);
	uint32_t ids[2] = { 8080, 1 };
	struct kvb_model *ms = NULL;
	struct daemon d;
	kvb_client *c;
	size_t n = 0;
	int rc;

	(void)state;
	if (geteuid() != 0)
		skip(); /* the other tenants are other users */
	c = start_tenants_daemon(&d, tenants,
				 "# name  who\nalice uid=0\nbob   uid=65534   # nobody\n", NULL);
	fill_f16((uint16_t *)mine, bytes / 2, 77);
	kvb_chunk_hash(ids, 2, hash);
	assert_int_equal(kvb_put(c, model.name, hash, KVB_F16, T, 0, mine, bytes, NULL), 0);
	assert_int_equal(kvb_pin(c, model.name, hash, 600), 0);
	rc = run_as(&d, 65534, hash, true);
	if (rc)
		fail_msg("bob saw alice's namespace: checks 0x%x failed", rc);
	rc = run_as(&d, 1, hash, false);
	if (rc)
		fail_msg("a client of the default namespace saw alice's: checks 0x%x failed", rc);
	/* alice's chunk is hers, whole, and her model list holds her model only */
	assert_int_equal(kvb_get(c, model.name, hash, 0, 0, back, bytes, NULL), 0);
	assert_memory_equal(back, mine, bytes);
	assert_int_equal(kvb_model_list(c, &ms, &n), 0);
	assert_int_equal(n, 1);
	assert_string_equal(ms[0].name, model.name);
	free(ms);
	assert_int_equal(kvb_unpin(c, model.name, hash), 0);
	end_tenants_test(&d, c, tenants);
	free(mine);
	free(back);
}

/* Put chunks first..first+n-1 of 64 tokens (512 KiB) as the current client. */
static int put_small(kvb_client *c, uint32_t first, uint32_t n)
{
	enum { ST = 64 };
	size_t bytes = (size_t)L * 2 * ST * ROW;
	uint16_t *kv = malloc(bytes);
	int rc = 0;

	for (uint32_t i = first; i < first + n && !rc; i++) {
		uint8_t hash[KVB_HASH_LEN];
		uint32_t ids[2] = { 9090, i };

		fill_f16(kv, bytes / 2, i);
		kvb_chunk_hash(ids, 2, hash);
		rc = kvb_put(c, model.name, hash, KVB_F16, ST, 0, kv, bytes, NULL);
	}
	free(kv);
	return rc;
}

/* Which of chunks first..first+n-1 are stored, as a bit mask. */
static uint64_t present(kvb_client *c, uint32_t first, uint32_t n)
{
	uint64_t mask = 0;

	for (uint32_t i = first; i < first + n; i++) {
		uint8_t hash[KVB_HASH_LEN];
		uint32_t ids[2] = { 9090, i };
		struct kvb_chunk_info info;

		kvb_chunk_hash(ids, 2, hash);
		assert_int_equal(kvb_lookup(c, model.name, (const uint8_t(*)[KVB_HASH_LEN])hash, 1,
					    &info), 0);
		mask |= (uint64_t)(info.found != 0) << (i - first);
	}
	return mask;
}

/*
 * Tenants and capacity: alice owns 3 MB of an 8 MiB cache. Bob, with no capacity
 * of his own, floods it: eviction takes his chunks, never hers. Alice then goes
 * over her own 3 MiB: her own least recently used chunks go.
 */
static void tenants_cannot_evict_each_other(void **state)
{
	char tenants[64];
	struct daemon d;
	kvb_client *c;
	uint64_t mine;
	pid_t pid;
	int status;

	(void)state;
	if (geteuid() != 0)
		skip(); /* the other tenant is another user */
	c = start_tenants_daemon(&d, tenants, "alice uid=0 capacity=3M\nbob uid=65534\n", "8M");
	assert_int_equal(put_small(c, 0, 6), 0); /* about 2 MB stored, within her 3 MiB */
	pid = fork();
	assert_true(pid >= 0);
	if (pid == 0) {
		struct kvb_connect_opts o = { .timeout_ms = 10000 };
		kvb_client *b = NULL;

		if (setgid(65534) || setuid(65534) || kvb_connect(d.endpoint, &o, &b, NULL, 0) ||
		    kvb_model_register(b, &model, NULL))
			_exit(1);
		_exit(put_small(b, 100, 20) ? 2 : 0); /* 10 MiB */
	}
	assert_int_equal(waitpid(pid, &status, 0), pid);
	assert_true(WIFEXITED(status) && WEXITSTATUS(status) == 0);
	sleep(3);
	assert_true(daemon_stat(c, "evictions") > 0);
	mine = present(c, 0, 6);
	print_message("after bob's flood: %g chunks evicted, alice keeps 0x%" PRIx64 " of 0x3f\n",
		      daemon_stat(c, "evictions"), mine);
	assert_true(mine == 0x3f);
	/* alice over her own capacity: 10 chunks of about 330 KB stored in 3 MiB */
	assert_int_equal(put_small(c, 6, 4), 0);
	sleep(3);
	mine = present(c, 0, 10);
	print_message("alice after her own flood keeps 0x%" PRIx64 " of 0x3ff\n", mine);
	assert_true((mine & 0x3c0) == 0x3c0); /* her newest stay */
	/* within her high watermark (90% of 3 MiB: 8 chunks), her oldest gone */
	assert_true(__builtin_popcountll(mine) <= 8 && (mine & 0x3f) != 0x3f);
	end_tenants_test(&d, c, tenants);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(close_during_layer),
		cmocka_unit_test(envelope_without_delimiter),
		cmocka_unit_test(sigterm_answers_inflight),
		cmocka_unit_test(put_from_changing_shm),
		cmocka_unit_test(ring_not_reachable_by_requests),
		cmocka_unit_test(ring_not_shared_across_clients),
		cmocka_unit_test(segment_cannot_be_truncated),
		cmocka_unit_test(per_client_shares),
		cmocka_unit_test(unread_replies_are_bounded),
		cmocka_unit_test(pipelined_puts_are_bounded),
		cmocka_unit_test(many_connections),
		cmocka_unit_test(tenants_are_isolated),
		cmocka_unit_test(tenants_cannot_evict_each_other),
	};

	signal(SIGPIPE, SIG_IGN);
	if (getenv("KVB_TEST_FILTER")) /* e.g. KVB_TEST_FILTER='tenants*' */
		cmocka_set_test_filter(getenv("KVB_TEST_FILTER"));
	return cmocka_run_group_tests(tests, NULL, NULL);
}
