/* libkvblend — client of kvblendd; see include/kvblend.h for the contract. */
#include "kvblend.h"

#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <malloc.h>
#include <pthread.h>
#include <sodium.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <linux/futex.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "../proto/wire.h"
#include "cudaipc.h"

#define DEFAULT_TIMEOUT_MS 5000
#define DEFAULT_SHM (64u << 20)
#define DEFAULT_ENDPOINT "ipc:///run/kvblend/kvblend.sock"

/*
 * A region starts with REGION_HEAD bytes of progress words (one per landing
 * session using it) before the memory handed to the caller.
 */
#define REGION_MAX 16
#define REGION_HEAD 4096u
#define REGION_WORDS (REGION_HEAD / 4)

struct region {
	uint64_t id; /* 0: slot free */
	uint8_t *base;
	size_t size;
	uint64_t used[REGION_WORDS / 64]; /* progress words taken */
};

struct kvb_client {
	void *ctx;
	void *sock;
	char endpoint[512];
	int timeout_ms;
	bool curve;
	char server_key[41], public_key[41], secret_key[41];
	uint64_t next_id;
	char err[512];
	/* Payload frames ZeroMQ still reads from the caller's memory (zero-copy sends). */
	atomic_int in_flight;
	/* shared memory */
	bool shm_ok; /* may try shared memory */
	uint64_t shm_id;
	void *shm_base;
	size_t shm_size;
	size_t shm_initial;
	/* Segments the daemon lost (a restart): still mapped, so that buffers the caller
	 * got from kvb_shared_buffer() stay valid, until kvb_close(). */
	void *lost_base[8];
	size_t lost_size[8];
	unsigned n_lost;
	/* regions: segments holding the node's own buffers (kvb_region_alloc) */
	struct region regions[REGION_MAX];
	struct kvb_cuda *cuda; /* kvb_fuse_device(): fused layers taken on the GPU */
};

struct call {
	/* while waiting for the reply: called between polls; returns 1 if it made progress */
	int (*while_waiting)(void *ctx);
	void *waiting_ctx;
	struct kvbp_request req;
	const void *const *payload; /* frames to send after the header */
	const size_t *payload_len;
	size_t n_payload;
	struct kvbp_reply rep;
	zmq_msg_t *frames; /* received payload frames; freed by call_done() */
	size_t n_frames;
	/* or, with sink set: each payload frame copied there as it arrives and freed at once
	 * (the copy overlaps the rest of the transfer, and the frames' memory is reused);
	 * sink_got counts the payload's bytes, also those beyond sink_len (not copied) */
	uint8_t *sink;
	size_t sink_len, sink_got;
};

_Static_assert(KVB_E_BUSY == -1000 - KVBP_BUSY, "client codes drifted from the wire");

__attribute__((format(printf, 3, 4))) static int set_err(kvb_client *c, int rc, const char *fmt,
							 ...)
{
	va_list ap;

	va_start(ap, fmt);
	vsnprintf(c->err, sizeof(c->err), fmt, ap);
	va_end(ap);
	return rc;
}

const char *kvb_last_error(const kvb_client *c)
{
	return c ? c->err : "";
}

const char *kvb_strerror(int code)
{
	static const char *const server[] = {
		[KVBP_BAD_REQUEST] = "bad request",
		[KVBP_BAD_VERSION] = "protocol version not supported",
		[KVBP_UNKNOWN_OP] = "unknown operation",
		[KVBP_BAD_SHAPE] = "bad shape",
		[KVBP_UNKNOWN_MODEL] = "unknown model",
		[KVBP_DTYPE_MISMATCH] = "dtype mismatch",
		[KVBP_BAD_FRAMES] = "wrong number of frames",
		[KVBP_TOO_LARGE] = "message too large",
		[KVBP_MODEL_CONFLICT] = "model exists with another layout",
		[KVBP_NOT_FOUND] = "not found",
		[KVBP_CORRUPT] = "stored chunk corrupt",
		[KVBP_FULL] = "store full",
		[KVBP_LIMIT] = "daemon resource limit reached",
		[KVBP_INTERNAL] = "internal daemon error",
		[KVBP_BAD_ARGUMENT] = "bad argument",
		[KVBP_BAD_SHM] = "bad shared-memory reference",
		[KVBP_UNKNOWN_SESSION] = "unknown fuse session",
		[KVBP_BUSY] = "chunk in use by a fuse session",
	};

	if (code == 0)
		return "success";
	if (code == KVB_E_PROTOCOL)
		return "unreadable reply";
	if (code <= -1001 && code > -1000 - KVBP_CODE_COUNT)
		return server[-code - 1000];
	return strerror(-code);
}

const char *kvb_default_endpoint(void)
{
	static __thread char buf[300];
	const char *e = getenv("KVBLEND_ENDPOINT"), *xdg = getenv("XDG_RUNTIME_DIR");

	if (e && *e)
		return e;
	/* Mirror kvblendd's default: the system socket, else the user's runtime dir. */
	if (access(DEFAULT_ENDPOINT + 6, F_OK) == 0 || !xdg || !*xdg || geteuid() == 0)
		return DEFAULT_ENDPOINT;
	snprintf(buf, sizeof(buf), "ipc://%s/kvblend.sock", xdg);
	return buf;
}

size_t kvb_dtype_size(enum kvb_dtype dtype)
{
	return kvbp_dtype_size((uint32_t)dtype);
}

const char *kvb_dtype_name(enum kvb_dtype dtype)
{
	return kvbp_dtype_name((uint32_t)dtype);
}

enum kvb_dtype kvb_dtype_parse(const char *s)
{
	if (!strcmp(s, "f16") || !strcmp(s, "float16"))
		return KVB_F16;
	if (!strcmp(s, "bf16") || !strcmp(s, "bfloat16"))
		return KVB_BF16;
	if (!strcmp(s, "f32") || !strcmp(s, "float32"))
		return KVB_F32;
	return 0;
}

void kvb_chunk_hash(const uint32_t *ids, size_t n, uint8_t out[KVB_HASH_LEN])
{
	crypto_generichash_state st;
	uint8_t le[4 * 256];

	/* Hash little-endian bytes whatever the host order, 256 ids at a time. */
	crypto_generichash_init(&st, NULL, 0, KVB_HASH_LEN);
	while (n) {
		size_t k = n < 256 ? n : 256;

		for (size_t i = 0; i < k; i++) {
			le[4 * i] = (uint8_t)ids[i];
			le[4 * i + 1] = (uint8_t)(ids[i] >> 8);
			le[4 * i + 2] = (uint8_t)(ids[i] >> 16);
			le[4 * i + 3] = (uint8_t)(ids[i] >> 24);
		}
		crypto_generichash_update(&st, le, 4 * k);
		ids += k;
		n -= k;
	}
	crypto_generichash_final(&st, out, KVB_HASH_LEN);
}

int kvb_curve_keypair(char public_key[41], char secret_key[41])
{
	return zmq_curve_keypair(public_key, secret_key) ? -ENOTSUP : 0;
}

int kvb_hash_parse(const char *hex, uint8_t out[KVB_HASH_LEN])
{
	uint8_t h[KVB_HASH_LEN];

	if (!hex || strlen(hex) != 2 * KVB_HASH_LEN)
		return -EINVAL;
	for (int i = 0; i < 2 * KVB_HASH_LEN; i++) {
		int c = hex[i], v;

		if (c >= '0' && c <= '9')
			v = c - '0';
		else if (c >= 'a' && c <= 'f')
			v = c - 'a' + 10;
		else if (c >= 'A' && c <= 'F')
			v = c - 'A' + 10;
		else
			return -EINVAL;
		if (i % 2)
			h[i / 2] = (uint8_t)(h[i / 2] | v);
		else
			h[i / 2] = (uint8_t)(v << 4);
	}
	memcpy(out, h, KVB_HASH_LEN);
	return 0;
}

void kvb_hash_format(const uint8_t hash[KVB_HASH_LEN], char out[2 * KVB_HASH_LEN + 1])
{
	static const char digits[] = "0123456789abcdef";

	for (int i = 0; i < KVB_HASH_LEN; i++) {
		out[2 * i] = digits[hash[i] >> 4];
		out[2 * i + 1] = digits[hash[i] & 15];
	}
	out[2 * KVB_HASH_LEN] = 0;
}

static int parse_doubles(const char *s, double *v, int max)
{
	int n = 0;

	while (*s && n < max) {
		char *end;

		errno = 0;
		v[n++] = strtod(s, &end);
		if (errno || end == s)
			return -1;
		if (*end == ',')
			end++;
		else if (*end)
			return -1;
		s = end;
	}
	return *s ? -1 : n;
}

int kvb_rope_scaling_parse(const char *spec, struct kvb_model *m)
{
	const char *colon = strchr(spec, ':');
	size_t kind_len = colon ? (size_t)(colon - spec) : strlen(spec);
	double v[4];
	int n = colon ? parse_doubles(colon + 1, v, 4) : 0;
	struct kvb_model t = *m;

	t.scaling = KVB_SCALING_NONE;
	t.factor = t.low_freq_factor = t.high_freq_factor = t.beta_fast = t.beta_slow = 0;
	t.original_max_pos = t.max_pos = 0;
	if (n < 0)
		return -EINVAL;
	if (kind_len == 4 && !strncmp(spec, "none", 4) && !colon) {
		/* nothing to set */
	} else if (kind_len == 6 && !strncmp(spec, "linear", 6) && n == 1 && v[0] > 0) {
		t.scaling = KVB_SCALING_LINEAR;
		t.factor = v[0];
	} else if (kind_len == 6 && !strncmp(spec, "llama3", 6) && n == 4 && v[0] > 0 &&
		   v[1] > 0 && v[2] > v[1] && v[3] >= 1 && v[3] <= UINT32_MAX) {
		t.scaling = KVB_SCALING_LLAMA3;
		t.factor = v[0];
		t.low_freq_factor = v[1];
		t.high_freq_factor = v[2];
		t.original_max_pos = (uint32_t)v[3];
	} else if (kind_len == 4 && !strncmp(spec, "yarn", 4) && (n == 2 || n == 4) && v[0] > 0 &&
		   v[1] >= 1 && v[1] <= UINT32_MAX) {
		t.scaling = KVB_SCALING_YARN;
		t.factor = v[0];
		t.original_max_pos = (uint32_t)v[1];
		t.beta_fast = n == 4 ? v[2] : 32;
		t.beta_slow = n == 4 ? v[3] : 1;
		if (!(t.beta_fast > t.beta_slow && t.beta_slow > 0))
			return -EINVAL;
	} else if (kind_len == 7 && !strncmp(spec, "dynamic", 7) && n == 2 && v[0] > 0 &&
		   v[1] >= 1 && v[1] <= UINT32_MAX) {
		t.scaling = KVB_SCALING_DYNAMIC;
		t.factor = v[0];
		t.max_pos = (uint32_t)v[1];
	} else {
		return -EINVAL;
	}
	*m = t;
	return 0;
}

void kvb_rope_scaling_format(const struct kvb_model *m, char *buf, size_t len)
{
	switch (m->scaling) {
	case KVB_SCALING_LINEAR:
		snprintf(buf, len, "linear:%g", m->factor);
		break;
	case KVB_SCALING_LLAMA3:
		snprintf(buf, len, "llama3:%g,%g,%g,%" PRIu32, m->factor, m->low_freq_factor,
			 m->high_freq_factor, m->original_max_pos);
		break;
	case KVB_SCALING_YARN:
		snprintf(buf, len, "yarn:%g,%" PRIu32 ",%g,%g", m->factor, m->original_max_pos,
			 m->beta_fast, m->beta_slow);
		break;
	case KVB_SCALING_DYNAMIC:
		snprintf(buf, len, "dynamic:%g,%" PRIu32, m->factor, m->max_pos);
		break;
	default:
		snprintf(buf, len, "none");
		break;
	}
}

int kvb_store_parse(const char *spec, struct kvb_model *m)
{
	static const char *const names[] = { "dtype", "fp8", "int8", "int4" };
	const char *colon = spec ? strchr(spec, ':') : NULL;
	size_t len = colon ? (size_t)(colon - spec) : (spec ? strlen(spec) : 0);

	if (!spec || !*spec) {
		m->store_codec = KVB_STORE_DTYPE;
		m->store_group = 0;
		return 0;
	}
	for (int i = 0; i < 4; i++) {
		char *end;
		unsigned long g = 0;

		if (strlen(names[i]) != len || strncmp(spec, names[i], len))
			continue;
		if (colon) {
			if (i != KVB_STORE_INT4)
				return -EINVAL;
			errno = 0;
			g = strtoul(colon + 1, &end, 10);
			if (errno || *end || end == colon + 1 || g < 1 || g > 1024)
				return -EINVAL;
		}
		m->store_codec = (enum kvb_store_codec)i;
		m->store_group = (uint32_t)g;
		return 0;
	}
	return -EINVAL;
}

void kvb_store_format(const struct kvb_model *m, char *buf, size_t len)
{
	static const char *const names[] = { "dtype", "fp8", "int8", "int4" };
	unsigned c = (unsigned)m->store_codec;

	if (c > 3)
		snprintf(buf, len, "?");
	else if (c == KVB_STORE_INT4)
		snprintf(buf, len, "int4:%" PRIu32, m->store_group ? m->store_group : 32);
	else
		snprintf(buf, len, "%s", names[c]);
}

static void model_to_wire(const struct kvb_model *m, struct kvbp_model *w)
{
	memset(w, 0, sizeof(*w));
	snprintf(w->name, sizeof(w->name), "%s", m->name);
	w->num_layers = m->num_layers;
	w->num_kv_heads = m->num_kv_heads;
	w->head_dim = m->head_dim;
	w->dtype = (uint32_t)m->dtype;
	w->rope_theta = m->rope_theta;
	w->rope_style = (uint32_t)m->rope_style;
	w->rotary_dim = m->rotary_dim;
	w->scaling = (uint32_t)m->scaling;
	w->factor = m->factor;
	w->low_freq_factor = m->low_freq_factor;
	w->high_freq_factor = m->high_freq_factor;
	w->original_max_pos = m->original_max_pos;
	w->beta_fast = m->beta_fast;
	w->beta_slow = m->beta_slow;
	w->max_pos = m->max_pos;
	w->k_pre_rope = m->k_pre_rope != 0;
	w->store_codec = (uint32_t)m->store_codec;
	w->store_group = m->store_group;
}

static void model_from_wire(const struct kvbp_model *w, struct kvb_model *m)
{
	memset(m, 0, sizeof(*m));
	snprintf(m->name, sizeof(m->name), "%s", w->name);
	m->num_layers = w->num_layers;
	m->num_kv_heads = w->num_kv_heads;
	m->head_dim = w->head_dim;
	m->dtype = (enum kvb_dtype)w->dtype;
	m->rope_theta = w->rope_theta;
	m->rope_style = (enum kvb_rope_style)w->rope_style;
	m->rotary_dim = w->rotary_dim;
	m->scaling = (enum kvb_rope_scaling)w->scaling;
	m->factor = w->factor;
	m->low_freq_factor = w->low_freq_factor;
	m->high_freq_factor = w->high_freq_factor;
	m->original_max_pos = w->original_max_pos;
	m->beta_fast = w->beta_fast;
	m->beta_slow = w->beta_slow;
	m->max_pos = w->max_pos;
	m->k_pre_rope = w->k_pre_rope;
	m->store_codec = (enum kvb_store_codec)w->store_codec;
	m->store_group = w->store_group;
}

static void chunk_from_wire(const struct kvbp_chunk *w, struct kvb_chunk_info *c)
{
	memcpy(c->hash, w->hash, KVB_HASH_LEN);
	c->found = w->found;
	c->num_tokens = w->num_tokens;
	c->base_pos = w->base_pos;
	c->num_layers = w->num_layers;
	c->raw_bytes = w->raw_bytes;
	c->stored_bytes = w->stored_bytes;
}

static int open_socket(kvb_client *c)
{
	int zero = 0;

	c->sock = zmq_socket(c->ctx, ZMQ_DEALER);
	if (!c->sock)
		return -errno;
	zmq_setsockopt(c->sock, ZMQ_LINGER, &zero, sizeof(zero));
	if (c->curve && (zmq_setsockopt(c->sock, ZMQ_CURVE_SERVERKEY, c->server_key, 41) ||
			 zmq_setsockopt(c->sock, ZMQ_CURVE_PUBLICKEY, c->public_key, 41) ||
			 zmq_setsockopt(c->sock, ZMQ_CURVE_SECRETKEY, c->secret_key, 41))) {
		int e = errno;

		zmq_close(c->sock);
		c->sock = NULL;
		return -e;
	}
	if (zmq_connect(c->sock, c->endpoint)) {
		int e = errno;

		zmq_close(c->sock);
		c->sock = NULL;
		return -e;
	}
	return 0;
}

static void payload_sent(void *data, void *hint)
{
	(void)data;
	atomic_fetch_sub(&((kvb_client *)hint)->in_flight, 1);
}

/* Wait until ZeroMQ has let go of every zero-copy payload, so the caller may reuse it. */
static void wait_payloads(kvb_client *c)
{
	for (int i = 0; atomic_load(&c->in_flight) > 0 && i < 100000; i++) {
		struct timespec ts = { 0, 100000 };

		nanosleep(&ts, NULL);
	}
}

/* After a timeout: drop the socket so a late reply cannot answer the next request. */
static void reset_socket(kvb_client *c)
{
	if (c->sock)
		zmq_close(c->sock);
	c->sock = NULL;
	wait_payloads(c);
	open_socket(c);
}

static void call_done(struct call *k)
{
	for (size_t i = 0; i < k->n_frames; i++)
		zmq_msg_close(&k->frames[i]);
	free(k->frames);
	k->frames = NULL;
	k->n_frames = 0;
	kvbp_reply_clear(&k->rep);
	kvbp_request_clear(&k->req);
}

static int recv_reply(kvb_client *c, struct call *k, int64_t deadline_ms)
{
	for (;;) {
		zmq_msg_t parts[3];
		size_t np = 0, cap = 0;
		struct timespec now;
		int64_t left;
		zmq_pollitem_t it = { c->sock, 0, ZMQ_POLLIN, 0 };
		int more = 1, rc;
		char derr[256];

		clock_gettime(CLOCK_MONOTONIC, &now);
		left = deadline_ms - (now.tv_sec * 1000 + now.tv_nsec / 1000000);
		if (left <= 0)
			return -ETIMEDOUT;
		if (k->while_waiting) {
			/* Work alongside the daemon: poll without blocking, do what is ready. */
			rc = zmq_poll(&it, 1, 0);
			if (rc == 0) {
				if (!k->while_waiting(k->waiting_ctx)) {
					struct timespec ts = { 0, 20000 };

					nanosleep(&ts, NULL);
				}
				continue;
			}
		} else {
			rc = zmq_poll(&it, 1, (long)left);
		}
		if (rc < 0 && errno == EINTR)
			continue;
		if (rc < 0)
			return -EIO;
		if (rc == 0)
			return -ETIMEDOUT;
		/* delimiter, header, then payload frames */
		for (; more && np < 2; np++) {
			zmq_msg_init(&parts[np]);
			if (zmq_msg_recv(&parts[np], c->sock, 0) < 0)
				return -EIO;
			more = zmq_msg_more(&parts[np]);
		}
		if (k->sink && more) {
			/* the header first, so that a late reply to an earlier request never
			 * touches the caller's buffer */
			struct kvbp_reply rep;
			bool ours = np == 2 && zmq_msg_size(&parts[0]) == 0 &&
				    !kvbp_reply_decode(zmq_msg_data(&parts[1]),
						       zmq_msg_size(&parts[1]), &rep, derr,
						       sizeof(derr));

			if (ours) {
				ours = rep.request_id == k->req.request_id;
				kvbp_reply_clear(&rep);
			}
			k->sink_got = 0;
			while (more) {
				zmq_msg_t f;
				size_t n;

				zmq_msg_init(&f);
				if (zmq_msg_recv(&f, c->sock, 0) < 0) {
					zmq_msg_close(&f);
					for (size_t i = 0; i < np; i++)
						zmq_msg_close(&parts[i]);
					return -EIO;
				}
				n = zmq_msg_size(&f);
				if (ours && k->sink_got <= k->sink_len &&
				    n <= k->sink_len - k->sink_got)
					memcpy(k->sink + k->sink_got, zmq_msg_data(&f), n);
				k->sink_got += n;
				more = zmq_msg_more(&f);
				zmq_msg_close(&f);
			}
		}
		while (more) {
			if (k->n_frames == cap) {
				size_t ncap = cap ? 2 * cap : 16;
				zmq_msg_t *p = realloc(k->frames, ncap * sizeof(*p));

				if (!p)
					return -ENOMEM;
				k->frames = p;
				cap = ncap;
			}
			zmq_msg_init(&k->frames[k->n_frames]);
			if (zmq_msg_recv(&k->frames[k->n_frames], c->sock, 0) < 0)
				return -EIO;
			more = zmq_msg_more(&k->frames[k->n_frames++]);
		}
		rc = np == 2 && zmq_msg_size(&parts[0]) == 0
			     ? kvbp_reply_decode(zmq_msg_data(&parts[1]), zmq_msg_size(&parts[1]),
						 &k->rep, derr, sizeof(derr))
			     : KVBP_BAD_REQUEST;
		for (size_t i = 0; i < np; i++)
			zmq_msg_close(&parts[i]);
		if (rc)
			return set_err(c, KVB_E_PROTOCOL, "unreadable reply from %s", c->endpoint);
		if (k->rep.request_id == k->req.request_id)
			return 0;
		/* A late reply to an earlier request: drop it, keep waiting. */
		kvbp_reply_clear(&k->rep);
		for (size_t i = 0; i < k->n_frames; i++)
			zmq_msg_close(&k->frames[i]);
		k->n_frames = 0;
	}
}

/* Send k->req with its payload and wait for the matching reply. */
static int call(kvb_client *c, struct call *k)
{
	struct timespec now;
	uint8_t *hdr = NULL;
	size_t len;
	int rc;

	c->err[0] = 0;
	if (!c->sock && open_socket(c))
		return set_err(c, -EIO, "cannot open a socket to %s", c->endpoint);
	k->req.version = KVBP_VERSION;
	k->req.request_id = ++c->next_id;
	k->req.payload_frames = (uint32_t)k->n_payload;
	if (kvbp_request_encode(&k->req, &hdr, &len))
		return set_err(c, -ENOMEM, "out of memory encoding a request");
	rc = zmq_send(c->sock, "", 0, ZMQ_SNDMORE) < 0 ||
	     zmq_send(c->sock, hdr, len, k->n_payload ? ZMQ_SNDMORE : 0) < 0;
	free(hdr);
	for (size_t i = 0; !rc && i < k->n_payload; i++) {
		zmq_msg_t m;

		if (k->payload_len[i] == 0) {
			zmq_msg_init(&m);
		} else {
			atomic_fetch_add(&c->in_flight, 1);
			zmq_msg_init_data(&m, (void *)k->payload[i], k->payload_len[i], payload_sent,
					  c);
		}
		if (zmq_msg_send(&m, c->sock, i + 1 < k->n_payload ? ZMQ_SNDMORE : 0) < 0) {
			zmq_msg_close(&m);
			rc = 1;
		}
	}
	if (rc) {
		reset_socket(c);
		return set_err(c, -EIO, "cannot send to %s: %s", c->endpoint,
			       zmq_strerror(zmq_errno()));
	}
	clock_gettime(CLOCK_MONOTONIC, &now);
	rc = recv_reply(c, k, now.tv_sec * 1000 + now.tv_nsec / 1000000 + c->timeout_ms);
	if (rc == -ETIMEDOUT) {
		reset_socket(c);
		return set_err(c, rc, "no reply from kvblendd at %s within %d ms", c->endpoint,
			       c->timeout_ms);
	}
	wait_payloads(c);
	if (rc)
		return c->err[0] ? rc : set_err(c, rc, "receive from %s failed", c->endpoint);
	if (k->rep.code)
		return set_err(c, -1000 - (int)k->rep.code, "%s", k->rep.message);
	return 0;
}

int kvb_connect(const char *endpoint, const struct kvb_connect_opts *opts, kvb_client **out,
		char *err, size_t errlen)
{
	kvb_client *c;
	int rc;

	*out = NULL;
	if (!endpoint)
		endpoint = kvb_default_endpoint();
	if ((strncmp(endpoint, "ipc://", 6) && strncmp(endpoint, "tcp://", 6)) ||
	    strlen(endpoint) >= sizeof(c->endpoint)) {
		if (err)
			snprintf(err, errlen, "invalid endpoint '%s'; expected ipc://PATH or "
				 "tcp://HOST:PORT", endpoint);
		return -EINVAL;
	}
	if (sodium_init() < 0) {
		if (err)
			snprintf(err, errlen, "libsodium failed to initialise");
		return -EIO;
	}
	c = calloc(1, sizeof(*c));
	if (!c)
		return -ENOMEM;
	snprintf(c->endpoint, sizeof(c->endpoint), "%s", endpoint);
	c->timeout_ms = opts && opts->timeout_ms > 0 ? opts->timeout_ms : DEFAULT_TIMEOUT_MS;
	c->shm_ok = !strncmp(endpoint, "ipc://", 6) && !(opts && opts->no_shm);
	c->shm_initial = opts && opts->shm_size ? opts->shm_size : DEFAULT_SHM;
	if (!strncmp(endpoint, "tcp://", 6)) {
		const char *sk = opts && opts->server_key ? opts->server_key
							  : getenv("KVBLEND_SERVER_KEY");
		const char *ck = opts && opts->client_secret_key ? opts->client_secret_key
								 : getenv("KVBLEND_CLIENT_KEY");
		uint8_t bin[32];

		if (sk && *sk) {
			if (strlen(sk) != 40 || !zmq_z85_decode(bin, sk) ||
			    (ck && *ck && (strlen(ck) != 40 || !zmq_z85_decode(bin, ck)))) {
				if (err)
					snprintf(err, errlen, "CURVE keys must be 40-character Z85 "
						 "strings (see kvblend keygen)");
				free(c);
				return -EINVAL;
			}
			c->curve = true;
			memcpy(c->server_key, sk, 41);
			if (ck && *ck) {
				memcpy(c->secret_key, ck, 41);
				rc = zmq_curve_public(c->public_key, c->secret_key);
			} else {
				rc = zmq_curve_keypair(c->public_key, c->secret_key);
			}
			if (rc) {
				if (err)
					snprintf(err, errlen, "this libzmq has no CURVE support");
				free(c);
				return -ENOTSUP;
			}
		}
	}
	c->ctx = zmq_ctx_new();
	rc = c->ctx ? open_socket(c) : -ENOMEM;
	if (rc) {
		if (err)
			snprintf(err, errlen, "cannot connect to %s: %s", endpoint, zmq_strerror(-rc));
		kvb_close(&c);
		return rc;
	}
	rc = kvb_ping(c, NULL, 0);
	if (rc) {
		if (err)
			snprintf(err, errlen, "%s", rc == -ETIMEDOUT ? c->err : c->err);
		kvb_close(&c);
		return rc;
	}
	*out = c;
	return 0;
}

static void shm_unmap(kvb_client *c, bool tell)
{
	if (!c->shm_base)
		return;
	munmap(c->shm_base, c->shm_size);
	if (tell) {
		struct call k = { .req = { .op = KVBP_OP_SHM_DETACH, .has_shm = true,
					   .shm_id = c->shm_id } };

		call(c, &k);
		call_done(&k);
	}
	c->shm_base = NULL;
	c->shm_size = 0;
	c->shm_id = 0;
}

/*
 * zmq_ctx_term() with a bound: libzmq can block in it for good after a CURVE
 * handshake the server refused, on a loaded machine, whatever the linger. Past
 * the bound the context is left to a detached thread (and leaked if it never
 * ends), so that closing a client never hangs its caller.
 */
struct term_job {
	void *ctx;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	bool done, abandoned;
};

static void term_job_free(struct term_job *j)
{
	pthread_cond_destroy(&j->cond);
	pthread_mutex_destroy(&j->lock);
	free(j);
}

static void *term_main(void *arg)
{
	struct term_job *j = arg;
	bool orphan;

	zmq_ctx_term(j->ctx);
	pthread_mutex_lock(&j->lock);
	j->done = true;
	orphan = j->abandoned;
	pthread_cond_signal(&j->cond);
	pthread_mutex_unlock(&j->lock);
	if (orphan)
		term_job_free(j);
	return NULL;
}

static void ctx_term_bounded(void *ctx, int ms)
{
	struct term_job *j = calloc(1, sizeof(*j));
	struct timespec until;
	pthread_t t;
	bool done;

	if (!j) {
		zmq_ctx_term(ctx);
		return;
	}
	j->ctx = ctx;
	pthread_mutex_init(&j->lock, NULL);
	pthread_cond_init(&j->cond, NULL);
	if (pthread_create(&t, NULL, term_main, j)) {
		term_job_free(j);
		zmq_ctx_term(ctx);
		return;
	}
	clock_gettime(CLOCK_REALTIME, &until);
	until.tv_sec += ms / 1000;
	until.tv_nsec += (long)(ms % 1000) * 1000000;
	if (until.tv_nsec >= 1000000000) {
		until.tv_sec++;
		until.tv_nsec -= 1000000000;
	}
	pthread_mutex_lock(&j->lock);
	while (!j->done && pthread_cond_timedwait(&j->cond, &j->lock, &until) == 0)
		;
	done = j->done;
	j->abandoned = !done;
	pthread_mutex_unlock(&j->lock);
	pthread_detach(t);
	if (done)
		term_job_free(j);
}

void kvb_close(kvb_client **cp)
{
	kvb_client *c = cp ? *cp : NULL;

	if (!c)
		return;
	if (c->sock)
		shm_unmap(c, true);
	for (unsigned i = 0; i < REGION_MAX; i++)
		if (c->regions[i].id)
			kvb_region_free(c, c->regions[i].base + REGION_HEAD);
	if (c->sock)
		zmq_close(c->sock);
	wait_payloads(c);
	if (c->ctx)
		ctx_term_bounded(c->ctx, 2000);
	for (unsigned i = 0; i < c->n_lost; i++)
		munmap(c->lost_base[i], c->lost_size[i]);
	kvb_cuda_free(&c->cuda);
	free(c);
	*cp = NULL;
}

/*
 * The descriptor of shared-memory segment id, from the daemon's descriptor socket
 * at path (the SHM_ATTACH or FUSE_OPEN reply names it): send the id, receive a
 * status byte with the descriptor attached. The daemon hands it only to the
 * process that owns the segment. Returns the descriptor or -1.
 */
static int segment_fd(const char *path, uint64_t id)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	struct timeval tv = { 2, 0 };
	union {
		char buf[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} u;
	uint8_t req[8], status = 1;
	struct iovec iov = { &status, 1 };
	struct msghdr mh = { .msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.buf,
			     .msg_controllen = sizeof(u.buf) };
	struct cmsghdr *cm;
	int sock, fd = -1;

	if (strlen(path) >= sizeof(a.sun_path))
		return -1;
	strcpy(a.sun_path, path);
	sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (sock < 0)
		return -1;
	for (int i = 0; i < 8; i++)
		req[i] = (uint8_t)(id >> (8 * i));
	setsockopt(sock, SOL_SOCKET, SO_RCVTIMEO, &tv, sizeof(tv));
	setsockopt(sock, SOL_SOCKET, SO_SNDTIMEO, &tv, sizeof(tv));
	memset(&u, 0, sizeof(u));
	if (connect(sock, (struct sockaddr *)&a, sizeof(a)) ||
	    send(sock, req, sizeof(req), MSG_NOSIGNAL) != (ssize_t)sizeof(req) ||
	    recvmsg(sock, &mh, MSG_CMSG_CLOEXEC) != 1)
		goto out;
	cm = CMSG_FIRSTHDR(&mh);
	if (cm && cm->cmsg_level == SOL_SOCKET && cm->cmsg_type == SCM_RIGHTS &&
	    cm->cmsg_len == CMSG_LEN(sizeof(int)))
		memcpy(&fd, CMSG_DATA(cm), sizeof(int));
	if (status != 0 && fd >= 0) {
		close(fd);
		fd = -1;
	}
out:
	close(sock);
	return fd;
}

/* Make sure a segment of at least size bytes is mapped; false if shared memory is unusable. */
static bool shm_ensure(kvb_client *c, size_t size)
{
	struct call k = { .req = { .op = KVBP_OP_SHM_ATTACH } };
	size_t want;
	void *base;
	int fd, rc;
	struct stat st;

	if (!c->shm_ok)
		return false;
	if (c->shm_base && c->shm_size >= size)
		return true;
	want = size > c->shm_initial ? size : c->shm_initial;
	want = (want + (1u << 20) - 1) & ~(size_t)((1u << 20) - 1);
	shm_unmap(c, true);
	k.req.shm_size = want;
	rc = call(c, &k);
	if (rc) {
		/* The daemon refuses this size (or any): fall back to frames for it. */
		if (rc != KVB_E_BAD_ARGUMENT && rc != KVB_E_LIMIT)
			c->shm_ok = false;
		call_done(&k);
		return false;
	}
	fd = segment_fd(k.rep.shm_name, k.rep.shm_id);
	if (fd < 0 || fstat(fd, &st) || (uint64_t)st.st_size < want) {
		if (fd >= 0)
			close(fd);
		c->shm_ok = false; /* e.g. another user without access: use the socket */
		call_done(&k);
		return false;
	}
	base = mmap(NULL, want, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	close(fd);
	if (base == MAP_FAILED) {
		c->shm_ok = false;
		call_done(&k);
		return false;
	}
	c->shm_base = base;
	c->shm_size = want;
	c->shm_id = k.rep.shm_id;
	call_done(&k);
	return true;
}

void *kvb_shared_buffer(kvb_client *c, size_t size)
{
	return shm_ensure(c, size) ? c->shm_base : NULL;
}

static bool in_shm(const kvb_client *c, const void *p, size_t len)
{
	const uint8_t *b = c->shm_base, *q = p;

	return b && q >= b && len <= c->shm_size && (size_t)(q - b) <= c->shm_size - len;
}

int kvb_ping(kvb_client *c, char *version, size_t len)
{
	struct call k = { .req = { .op = KVBP_OP_HELLO } };
	int rc = call(c, &k);

	if (!rc && version && len)
		snprintf(version, len, "%s", k.rep.server_version);
	call_done(&k);
	return rc;
}

static int set_name(kvb_client *c, struct call *k, const char *model)
{
	if (!model || !*model || strlen(model) > KVB_NAME_MAX)
		return set_err(c, -EINVAL, "model name must be 1..%d bytes", KVB_NAME_MAX);
	snprintf(k->req.model_name, sizeof(k->req.model_name), "%s", model);
	return 0;
}

int kvb_model_register(kvb_client *c, const struct kvb_model *m, int *existed)
{
	struct call k = { .req = { .op = KVBP_OP_MODEL_REGISTER, .has_model = true } };
	int rc;

	if (strnlen(m->name, sizeof(m->name)) > KVB_NAME_MAX)
		return set_err(c, -EINVAL, "model name longer than %d bytes", KVB_NAME_MAX);
	model_to_wire(m, &k.req.model);
	rc = call(c, &k);
	if (!rc && existed)
		*existed = k.rep.existed;
	call_done(&k);
	return rc;
}

int kvb_model_list(kvb_client *c, struct kvb_model **models, size_t *n)
{
	struct call k = { .req = { .op = KVBP_OP_MODEL_LIST } };
	int rc = call(c, &k);

	if (!rc) {
		*models = calloc(k.rep.n_models ? k.rep.n_models : 1, sizeof(**models));
		if (!*models)
			rc = set_err(c, -ENOMEM, "out of memory");
		for (size_t i = 0; !rc && i < k.rep.n_models; i++)
			model_from_wire(&k.rep.models[i], &(*models)[i]);
		*n = rc ? 0 : k.rep.n_models;
	}
	call_done(&k);
	return rc;
}

int kvb_model_get(kvb_client *c, const char *name, struct kvb_model *out)
{
	struct kvb_model *ms;
	size_t n;
	int rc = kvb_model_list(c, &ms, &n);

	if (rc)
		return rc;
	rc = set_err(c, KVB_E_UNKNOWN_MODEL, "unknown model '%s'", name);
	for (size_t i = 0; i < n; i++)
		if (!strcmp(ms[i].name, name)) {
			*out = ms[i];
			c->err[0] = 0;
			rc = 0;
			break;
		}
	free(ms);
	return rc;
}

static int put_once(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
		    enum kvb_dtype dtype, uint32_t num_tokens, uint32_t base_pos, const void *kv,
		    size_t kv_bytes, int *existed);
static int get_once(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
		    uint32_t layer_begin, uint32_t layer_end, bool rerotate, uint32_t pos,
		    void *out, size_t out_bytes, struct kvb_chunk_info *info);

/*
 * The daemon no longer knows our segment (it restarted, or let it expire): forget
 * it, so the next call attaches a new one. Data the caller placed in the old
 * segment is still mapped; a retry copies it again.
 */
static bool shm_lost(kvb_client *c, int rc, bool used_shm)
{
	if (rc != KVB_E_BAD_SHM || !used_shm || !c->shm_base)
		return false;
	if (c->n_lost == 8) {
		munmap(c->lost_base[0], c->lost_size[0]);
		memmove(c->lost_base, c->lost_base + 1, 7 * sizeof(void *));
		memmove(c->lost_size, c->lost_size + 1, 7 * sizeof(size_t));
		c->n_lost--;
	}
	c->lost_base[c->n_lost] = c->shm_base;
	c->lost_size[c->n_lost++] = c->shm_size;
	c->shm_base = NULL;
	c->shm_size = 0;
	c->shm_id = 0;
	return true;
}

int kvb_put(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
	    enum kvb_dtype dtype, uint32_t num_tokens, uint32_t base_pos, const void *kv,
	    size_t kv_bytes, int *existed)
{
	bool had = c->shm_base != NULL;
	int rc = put_once(c, model, hash, dtype, num_tokens, base_pos, kv, kv_bytes, existed);

	/* Once, with a new segment; kv stays readable if it was in the lost one. */
	if (shm_lost(c, rc, had))
		rc = put_once(c, model, hash, dtype, num_tokens, base_pos, kv, kv_bytes, existed);
	return rc;
}

static int put_once(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
		    enum kvb_dtype dtype, uint32_t num_tokens, uint32_t base_pos, const void *kv,
		    size_t kv_bytes, int *existed)
{
	struct call k = { .req = { .op = KVBP_OP_PUT, .has_hash = true, .dtype = (uint32_t)dtype,
				   .num_tokens = num_tokens, .base_pos = base_pos } };
	const void **ptrs = NULL;
	size_t *lens = NULL, esize = kvb_dtype_size(dtype), per_tokens;
	int rc;

	if ((rc = set_name(c, &k, model)))
		return rc;
	if (!esize)
		return set_err(c, -EINVAL, "unknown dtype %d", (int)dtype);
	if (!num_tokens || !kv_bytes || kv_bytes % (2 * (size_t)num_tokens * esize))
		return set_err(c, -EINVAL, "%zu bytes cannot hold K and V of %" PRIu32 " tokens "
			       "of %zu-byte elements", kv_bytes, num_tokens, esize);
	memcpy(k.req.hash, hash, KVB_HASH_LEN);
	if (in_shm(c, kv, kv_bytes) || (c->shm_ok && shm_ensure(c, kv_bytes))) {
		if (!in_shm(c, kv, kv_bytes))
			memcpy(c->shm_base, kv, kv_bytes);
		k.req.has_shm = true;
		k.req.shm_id = c->shm_id;
		k.req.shm_offset = in_shm(c, kv, kv_bytes)
					   ? (uint64_t)((const uint8_t *)kv - (uint8_t *)c->shm_base)
					   : 0;
		k.req.shm_length = kv_bytes;
		rc = call(c, &k);
	} else {
		/* Without a model lookup we do not know the layer count; the daemon checks it.
		 * Frames are split per tensor: one K and one V per layer. */
		struct kvb_model m;

		rc = kvb_model_get(c, model, &m);
		if (rc)
			goto out;
		per_tokens = (size_t)num_tokens * m.num_kv_heads * m.head_dim * esize;
		if (kv_bytes != per_tokens * 2 * m.num_layers) {
			rc = set_err(c, -EINVAL, "%zu bytes do not hold %" PRIu32 " layers x 2 x %"
				     PRIu32 " tokens x %" PRIu32 " heads x %" PRIu32 " dims",
				     kv_bytes, m.num_layers, num_tokens, m.num_kv_heads, m.head_dim);
			goto out;
		}
		k.n_payload = 2 * (size_t)m.num_layers;
		ptrs = calloc(k.n_payload, sizeof(*ptrs));
		lens = calloc(k.n_payload, sizeof(*lens));
		if (!ptrs || !lens) {
			rc = set_err(c, -ENOMEM, "out of memory");
			goto out;
		}
		for (size_t i = 0; i < k.n_payload; i++) {
			ptrs[i] = (const uint8_t *)kv + i * per_tokens;
			lens[i] = per_tokens;
		}
		k.payload = ptrs;
		k.payload_len = lens;
		rc = call(c, &k);
	}
	if (!rc && existed)
		*existed = k.rep.existed;
out:
	free(ptrs);
	free(lens);
	call_done(&k);
	return rc;
}

/* Shared segment layout for a GET: a progress word at 0, the data from here on. */
#define SHM_DATA_OFF 4096
/* Below this a GET is quicker to wait for (blocking) and copy at once. */
#define COPY_BEHIND_MIN (4u << 20)

struct copy_behind {
	_Atomic uint64_t *progress;
	const uint8_t *src;
	uint8_t *dst;
	size_t len, done;
};

static int copy_behind(void *arg)
{
	struct copy_behind *cb = arg;
	uint64_t ready = atomic_load_explicit(cb->progress, memory_order_acquire);

	if (ready > cb->len || ready <= cb->done)
		return 0;
	memcpy(cb->dst + cb->done, cb->src + cb->done, ready - cb->done);
	cb->done = ready;
	return 1;
}

static int get_common(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
		      uint32_t layer_begin, uint32_t layer_end, bool rerotate, uint32_t pos,
		      void *out, size_t out_bytes, struct kvb_chunk_info *info)
{
	bool had = c->shm_base != NULL;
	int rc = get_once(c, model, hash, layer_begin, layer_end, rerotate, pos, out, out_bytes,
			  info);

	if (shm_lost(c, rc, had))
		rc = get_once(c, model, hash, layer_begin, layer_end, rerotate, pos, out, out_bytes,
			      info);
	return rc;
}

static int get_once(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
		    uint32_t layer_begin, uint32_t layer_end, bool rerotate, uint32_t pos,
		    void *out, size_t out_bytes, struct kvb_chunk_info *info)
{
	struct call k = { .req = { .op = KVBP_OP_GET, .has_hash = true, .layer_begin = layer_begin,
				   .layer_end = layer_end, .rerotate = rerotate,
				   .target_pos = pos } };
	bool direct = in_shm(c, out, out_bytes);
	uint8_t *dst = out;
	size_t got = 0;
	struct copy_behind cb = { 0 };
	int rc;

	if ((rc = set_name(c, &k, model)))
		return rc;
	memcpy(k.req.hash, hash, KVB_HASH_LEN);
	if (direct || (c->shm_ok && shm_ensure(c, out_bytes + SHM_DATA_OFF))) {
		k.req.has_shm = true;
		k.req.shm_id = c->shm_id;
		k.req.shm_offset = direct ? (uint64_t)(dst - (uint8_t *)c->shm_base) : SHM_DATA_OFF;
		k.req.shm_length = out_bytes;
		cb.src = (const uint8_t *)c->shm_base + SHM_DATA_OFF;
		cb.dst = dst;
		cb.len = out_bytes;
		if (!direct && out_bytes >= COPY_BEHIND_MIN) {
			/* Copy out behind the daemon as it publishes finished layers. */
			cb.progress = (_Atomic uint64_t *)c->shm_base;
			atomic_store_explicit(cb.progress, 0, memory_order_relaxed);
			k.req.progress = 1; /* 1 + offset 0 */
			k.while_waiting = copy_behind;
			k.waiting_ctx = &cb;
		}
	}
	if (!k.req.has_shm) {
		k.sink = dst;
		k.sink_len = out_bytes;
	}
	rc = call(c, &k);
	if (rc == KVB_E_BAD_SHM && strstr(c->err, "too small")) {
		/* the reply names the chunk, so that the caller learns its size */
		if (info && k.rep.n_chunks == 1)
			chunk_from_wire(&k.rep.chunks[0], info);
		rc = set_err(c, -ENOBUFS, "buffer of %zu bytes does not match the chunk", out_bytes);
		goto out;
	}
	if (rc)
		goto out;
	if (k.rep.n_chunks != 1) {
		rc = set_err(c, KVB_E_PROTOCOL, "get reply without chunk info");
		goto out;
	}
	if (info)
		chunk_from_wire(&k.rep.chunks[0], info);
	if (k.req.has_shm) {
		/* The daemon filled the span it needed; it must be all of out. */
		uint64_t need = k.rep.chunks[0].raw_bytes / (k.rep.chunks[0].num_layers
							      ? k.rep.chunks[0].num_layers : 1) *
				(k.rep.layer_end - k.rep.layer_begin);

		if (need != out_bytes) {
			rc = set_err(c, -ENOBUFS, "buffer of %zu bytes does not match the %" PRIu64
				     " bytes of the requested layers", out_bytes, need);
			goto out;
		}
		if (!direct) {
			if (cb.done > out_bytes)
				cb.done = 0;
			memcpy(dst + cb.done, cb.src + cb.done, out_bytes - cb.done);
		}
		goto out;
	}
	got = k.sink_got; /* the frames went straight into dst as they arrived */
	if (got != out_bytes) {
		rc = set_err(c, -ENOBUFS, "buffer of %zu bytes does not match the %zu bytes of the "
			     "requested layers", out_bytes, got);
		goto out;
	}
out:
	call_done(&k);
	return rc;
}

int kvb_malloc_tune(size_t keep_bytes)
{
	if (!keep_bytes)
		keep_bytes = (size_t)512 << 20;
	if (keep_bytes > INT_MAX)
		keep_bytes = INT_MAX;
	/* mallopt() takes an int and answers 1 on success; an allocator that replaces
	 * glibc's (AddressSanitizer's, jemalloc) answers 0. */
	if (mallopt(M_MMAP_THRESHOLD, 256 << 20) != 1 ||
	    mallopt(M_TRIM_THRESHOLD, (int)keep_bytes) != 1)
		return -ENOTSUP;
	return 0;
}

/* What kvb_layers holds: the frames and the two pointer arrays, freed together. */
struct layers_impl {
	struct kvb_layers pub;
	zmq_msg_t *frames;
	size_t n_frames;
};

void kvb_layers_free(struct kvb_layers **lp)
{
	struct layers_impl *l = lp && *lp ? (struct layers_impl *)*lp : NULL;

	if (!l)
		return;
	for (size_t i = 0; i < l->n_frames; i++)
		zmq_msg_close(&l->frames[i]);
	free(l->frames);
	free(l->pub.k);
	free(l->pub.v);
	free(l);
	*lp = NULL;
}

int kvb_get_layers(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
		   uint32_t layer_begin, uint32_t layer_end, struct kvb_layers **out)
{
	struct call k = { .req = { .op = KVBP_OP_GET, .has_hash = true, .layer_begin = layer_begin,
				   .layer_end = layer_end } };
	struct layers_impl *l = NULL;
	struct kvb_chunk_info info;
	uint32_t n;
	int rc;

	if ((rc = set_name(c, &k, model)))
		return rc;
	memcpy(k.req.hash, hash, KVB_HASH_LEN);
	rc = call(c, &k); /* no shared memory, no sink: the frames stay as they came */
	if (rc)
		goto out;
	if (k.rep.n_chunks != 1 || k.rep.layer_end <= k.rep.layer_begin) {
		rc = set_err(c, KVB_E_PROTOCOL, "get reply without chunk info or layers");
		goto out;
	}
	chunk_from_wire(&k.rep.chunks[0], &info);
	n = k.rep.layer_end - k.rep.layer_begin;
	if (k.n_frames != 2 * (size_t)n) {
		rc = set_err(c, KVB_E_PROTOCOL, "get reply has %zu frames for %" PRIu32 " layers",
			     k.n_frames, n);
		goto out;
	}
	for (size_t i = 0; i < k.n_frames; i++)
		if (zmq_msg_size(&k.frames[i]) != zmq_msg_size(&k.frames[0])) {
			rc = set_err(c, KVB_E_PROTOCOL, "get reply frames differ in size");
			goto out;
		}
	l = calloc(1, sizeof(*l));
	if (l) {
		l->pub.k = calloc(n, sizeof(*l->pub.k));
		l->pub.v = calloc(n, sizeof(*l->pub.v));
	}
	if (!l || !l->pub.k || !l->pub.v) {
		rc = set_err(c, -ENOMEM, "out of memory");
		goto out;
	}
	l->pub.layer_begin = k.rep.layer_begin;
	l->pub.layer_end = k.rep.layer_end;
	l->pub.tensor_bytes = zmq_msg_size(&k.frames[0]);
	l->pub.info = info;
	/* The frames move into the result: call_done() then has none to close. */
	l->frames = k.frames;
	l->n_frames = k.n_frames;
	k.frames = NULL;
	k.n_frames = 0;
	for (uint32_t i = 0; i < n; i++) {
		l->pub.k[i] = zmq_msg_data(&l->frames[2 * i]);
		l->pub.v[i] = zmq_msg_data(&l->frames[2 * i + 1]);
	}
	l->pub.frames_ = l->frames;
	*out = &l->pub;
	l = NULL;
out:
	if (l) {
		struct kvb_layers *p = &l->pub;

		kvb_layers_free(&p);
	}
	call_done(&k);
	return rc;
}

int kvb_get(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
	    uint32_t layer_begin, uint32_t layer_end, void *out, size_t out_bytes,
	    struct kvb_chunk_info *info)
{
	return get_common(c, model, hash, layer_begin, layer_end, false, 0, out, out_bytes, info);
}

int kvb_get_rerotated(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
		      uint32_t layer_begin, uint32_t layer_end, uint32_t pos, void *out,
		      size_t out_bytes, struct kvb_chunk_info *info)
{
	return get_common(c, model, hash, layer_begin, layer_end, true, pos, out, out_bytes, info);
}

struct kvb_fuse {
	uint64_t id;
	uint32_t tokens;
	uint32_t next_layer;
	uint32_t first_check;
	size_t row_bytes;
	int32_t *rows; /* tokens of the next call: all at first, the selection after */
	size_t n_rows;
	/* the daemon's shared ring, mapped read-only: fused layers arrive with no copy */
	const uint8_t *ring;
	size_t ring_bytes;
	uint64_t slot_bytes;
	const uint8_t *last; /* the fused layer of the last call (K, then V), or NULL */
	/* the daemon's device ring, mapped (CUDA IPC; kvb_fuse_device()): 0 if not */
	uint64_t dev_base;  /* the mapped allocation */
	uint64_t dev_ring;  /* slot 0 in it */
	uint32_t ring_slots;
	uint64_t dev_last; /* the fused layer of the last call on the device, or 0 */
	/* landing sessions: the daemon writes into the node's region */
	bool land;
	struct region *region;
	uint64_t region_id; /* the region's segment when the session opened */
	unsigned word;	    /* the progress word's index in the region's head */
	_Atomic uint32_t *progress;
	int32_t *dropped;
	size_t n_dropped;
};

static int map_segment(kvb_client *c, const char *path, uint64_t id, size_t size, int prot,
		       int flags, void **out)
{
	struct stat st;
	void *p;
	int fd = segment_fd(path, id);

	if (fd < 0)
		return set_err(c, -EACCES, "cannot fetch shared-memory segment %" PRIu64 " from %s",
			       id, path);
	if (fstat(fd, &st) || (uint64_t)st.st_size < size) {
		close(fd);
		return set_err(c, -EIO, "shared-memory segment %" PRIu64 " is smaller than %zu bytes",
			       id, size);
	}
	p = mmap(NULL, size, prot, flags, fd, 0);
	close(fd);
	if (p == MAP_FAILED)
		return set_err(c, -errno, "cannot map shared-memory segment: %s", strerror(errno));
	*out = p;
	return 0;
}

void *kvb_region_alloc(kvb_client *c, size_t size)
{
	struct call k = { .req = { .op = KVBP_OP_SHM_ATTACH } };
	struct region *r = NULL;
	size_t page = (size_t)sysconf(_SC_PAGESIZE), want;
	void *base;

	for (unsigned i = 0; i < REGION_MAX && !r; i++)
		if (!c->regions[i].id)
			r = &c->regions[i];
	if (!r) {
		set_err(c, -EMFILE, "this client holds %d regions already", REGION_MAX);
		return NULL;
	}
	if (!size || size > SIZE_MAX - REGION_HEAD - page) {
		set_err(c, -EINVAL, "region of %zu bytes", size);
		return NULL;
	}
	if (strncmp(c->endpoint, "ipc://", 6)) {
		set_err(c, -ENOTSUP, "regions are shared memory: only on ipc:// endpoints, not %s",
			c->endpoint);
		return NULL;
	}
	want = (size + REGION_HEAD + page - 1) / page * page;
	k.req.shm_size = want;
	if (call(c, &k) ||
	    map_segment(c, k.rep.shm_name, k.rep.shm_id, want, PROT_READ | PROT_WRITE, MAP_SHARED,
			&base)) {
		if (k.rep.shm_id) {
			struct call d = { .req = { .op = KVBP_OP_SHM_DETACH, .has_shm = true,
						   .shm_id = k.rep.shm_id } };
			char keep[sizeof(c->err)];

			memcpy(keep, c->err, sizeof(keep));
			call(c, &d);
			call_done(&d);
			memcpy(c->err, keep, sizeof(keep));
		}
		call_done(&k);
		return NULL;
	}
	memset(r, 0, sizeof(*r));
	r->id = k.rep.shm_id;
	r->base = base;
	r->size = want;
	call_done(&k);
	return r->base + REGION_HEAD;
}

int kvb_region_free(kvb_client *c, void *region)
{
	for (unsigned i = 0; i < REGION_MAX; i++) {
		struct region *r = &c->regions[i];
		struct call k = { .req = { .op = KVBP_OP_SHM_DETACH, .has_shm = true } };
		int rc;

		if (!r->id || (uint8_t *)region != r->base + REGION_HEAD)
			continue;
		k.req.shm_id = r->id;
		rc = call(c, &k);
		call_done(&k);
		munmap(r->base, r->size);
		memset(r, 0, sizeof(*r));
		/* A daemon that restarted no longer has it: unmapped here all the same. */
		return rc == KVB_E_BAD_SHM ? 0 : rc;
	}
	return set_err(c, -EINVAL, "not a region of this client");
}

/* The region holding [p, p + len), or NULL. */
static struct region *region_of(kvb_client *c, const void *p, size_t len)
{
	const uint8_t *q = p;

	for (unsigned i = 0; i < REGION_MAX; i++) {
		struct region *r = &c->regions[i];

		if (r->id && q >= r->base && len <= r->size && (size_t)(q - r->base) <= r->size - len)
			return r;
	}
	return NULL;
}

static int fuse_open_common(kvb_client *c, const char *model, const struct kvb_segment *segs,
			    size_t n_segs, const struct kvb_fuse_params *p,
			    const struct kvb_kv_layout *dst, kvb_fuse **out,
			    uint8_t (**missing)[KVB_HASH_LEN], size_t *n_missing)
{
	struct call k = { .req = { .op = KVBP_OP_FUSE_OPEN } };
	size_t n_checks = p ? p->n_checks : 0;
	struct region *reg = NULL;
	unsigned word = 0;
	struct kvb_model m;
	kvb_fuse *f = NULL;
	int rc;

	*out = NULL;
	if (missing)
		*missing = NULL;
	if (n_missing)
		*n_missing = 0;
	if ((rc = set_name(c, &k, model)))
		return rc;
	if (!n_segs)
		return set_err(c, -EINVAL, "a fuse needs at least one segment");
	/* The row size, for the layer calls to check their buffers against. */
	rc = kvb_model_get(c, model, &m);
	if (rc)
		return rc;
	if (dst) {
		/* The node's buffers: a region of this client; a progress word in its head. */
		reg = region_of(c, dst->k, 1);
		if (!reg || region_of(c, dst->v, 1) != reg)
			return set_err(c, -EINVAL, "the landing layout's K and V must lie in one "
				       "region of this client (kvb_region_alloc)");
		while (word < REGION_WORDS && (reg->used[word / 64] >> (word % 64) & 1))
			word++;
		if (word == REGION_WORDS)
			return set_err(c, -EMFILE, "%u landing sessions use this region already",
				       REGION_WORDS);
		if (dst->page_tokens && !dst->pages)
			return set_err(c, -EINVAL, "a paged layout needs its block table");
		k.req.has_land = true;
		k.req.land.shm_id = reg->id;
		k.req.land.k_offset = (uint64_t)((uint8_t *)dst->k - reg->base);
		k.req.land.v_offset = (uint64_t)((uint8_t *)dst->v - reg->base);
		k.req.land.layer_stride = dst->layer_stride;
		k.req.land.token_stride = dst->token_stride;
		k.req.land.head_stride = dst->head_stride;
		k.req.land.page_tokens = dst->page_tokens;
		k.req.land.page_stride = dst->page_stride;
		k.req.land.progress = 4 * (uint64_t)word;
		if (dst->page_tokens && dst->n_pages) {
			k.req.land.pages = malloc(dst->n_pages * sizeof(uint32_t));
			if (!k.req.land.pages)
				return set_err(c, -ENOMEM, "out of memory");
			memcpy(k.req.land.pages, dst->pages, dst->n_pages * sizeof(uint32_t));
			k.req.land.n_pages = dst->n_pages;
		}
		atomic_store_explicit((_Atomic uint32_t *)(reg->base + 4 * (size_t)word), 0,
				      memory_order_relaxed);
	}
	k.req.segments = calloc(n_segs, sizeof(*k.req.segments));
	k.req.check_layers = malloc((n_checks + 1) * sizeof(uint32_t));
	k.req.ratios = malloc((n_checks + 1) * sizeof(double));
	if (!k.req.segments || !k.req.check_layers || !k.req.ratios) {
		rc = set_err(c, -ENOMEM, "out of memory");
		goto out;
	}
	for (size_t i = 0; i < n_segs; i++) {
		k.req.segments[i].fresh = segs[i].fresh != 0;
		memcpy(k.req.segments[i].hash, segs[i].hash, KVB_HASH_LEN);
		k.req.segments[i].pos = segs[i].pos;
		k.req.segments[i].count = segs[i].fresh ? segs[i].count : 0;
	}
	k.req.n_segments = n_segs;
	if (n_checks) {
		memcpy(k.req.check_layers, p->check_layers, n_checks * sizeof(uint32_t));
		memcpy(k.req.ratios, p->ratios, n_checks * sizeof(double));
	}
	k.req.n_checks = k.req.n_ratios = n_checks;
	k.req.reuse_only = n_checks == 0;
	k.req.metric = p ? (uint32_t)p->metric : 0;
	k.req.shared_ring = c->shm_ok && !dst;
	k.req.device_out = c->cuda && !dst;
	rc = call(c, &k);
	if (rc == KVB_E_NOT_FOUND && missing && n_missing && k.rep.n_chunks) {
		*missing = malloc(k.rep.n_chunks * KVB_HASH_LEN);
		if (*missing) {
			for (size_t i = 0; i < k.rep.n_chunks; i++)
				memcpy((*missing)[i], k.rep.chunks[i].hash, KVB_HASH_LEN);
			*n_missing = k.rep.n_chunks;
		}
	}
	if (rc)
		goto out;
	if (k.rep.n_selection > k.rep.num_tokens) {
		rc = set_err(c, KVB_E_PROTOCOL, "more rows than tokens in a fuse_open reply");
		goto out;
	}
	f = calloc(1, sizeof(*f));
	if (f)
		f->rows = malloc(((size_t)k.rep.num_tokens + 1) * sizeof(int32_t));
	if (f && f->rows)
		f->dropped = malloc(((size_t)k.rep.num_tokens + 1) * sizeof(int32_t));
	if (!f || !f->rows || !f->dropped) {
		if (f)
			free(f->rows);
		free(f);
		f = NULL;
		rc = set_err(c, -ENOMEM, "out of memory");
		goto out;
	}
	f->id = k.rep.session_id;
	f->tokens = k.rep.num_tokens;
	f->next_layer = f->first_check = k.rep.next_layer;
	f->row_bytes = (size_t)m.num_kv_heads * m.head_dim * kvb_dtype_size(m.dtype);
	if (k.rep.has_selection) {
		/* Reuse only: the node computes the fresh tokens, at every layer. */
		if (k.rep.n_selection)
			memcpy(f->rows, k.rep.selection, k.rep.n_selection * sizeof(int32_t));
		f->n_rows = k.rep.n_selection;
	} else {
		for (uint32_t i = 0; i < f->tokens; i++)
			f->rows[i] = (int32_t)i;
		f->n_rows = f->tokens;
	}
	f->slot_bytes = k.rep.slot_bytes;
	f->ring_slots = k.rep.ring_slots;
	if (k.rep.has_ipc && c->cuda && k.rep.slot_bytes == 2 * (uint64_t)f->tokens * f->row_bytes) {
		/* Without the mapping the session still works: the layers come in host memory. */
		if (kvb_cuda_map(c->cuda, k.rep.device_pci, k.rep.ipc_handle, &f->dev_base, c->err,
				 sizeof(c->err)) == 0) {
			f->dev_ring = f->dev_base + k.rep.ipc_offset;
			c->err[0] = 0;
		}
	}
	if (dst) {
		f->land = true;
		f->region = reg;
		f->region_id = reg->id;
		f->word = word;
		f->progress = (_Atomic uint32_t *)(reg->base + 4 * (size_t)word);
		reg->used[word / 64] |= 1ull << (word % 64);
	} else if (k.rep.shm_name[0] && k.rep.shm_size &&
		   k.rep.slot_bytes == 2 * (uint64_t)f->tokens * f->row_bytes) {
		/* Map it read-only: nothing this side can write the daemon's memory. If that
		 * fails the session still works; the layers then come in frames. The ring is
		 * populated now: the node reads every page of it, layer after layer. */
		void *p_ring;

		if (map_segment(c, k.rep.shm_name, k.rep.shm_id, k.rep.shm_size, PROT_READ,
				MAP_SHARED | MAP_POPULATE, &p_ring) == 0) {
			f->ring = p_ring;
			f->ring_bytes = k.rep.shm_size;
		}
		c->err[0] = 0;
	}
	*out = f;
out:
	call_done(&k);
	return rc;
}

int kvb_fuse_open(kvb_client *c, const char *model, const struct kvb_segment *segs,
		  size_t n_segs, const struct kvb_fuse_params *p, kvb_fuse **out,
		  uint8_t (**missing)[KVB_HASH_LEN], size_t *n_missing)
{
	return fuse_open_common(c, model, segs, n_segs, p, NULL, out, missing, n_missing);
}

int kvb_fuse_open_into(kvb_client *c, const char *model, const struct kvb_segment *segs,
		       size_t n_segs, const struct kvb_fuse_params *p,
		       const struct kvb_kv_layout *dst, kvb_fuse **out,
		       uint8_t (**missing)[KVB_HASH_LEN], size_t *n_missing)
{
	if (!dst) {
		*out = NULL;
		return set_err(c, -EINVAL, "kvb_fuse_open_into needs a layout");
	}
	return fuse_open_common(c, model, segs, n_segs, p, dst, out, missing, n_missing);
}

int kvb_fuse_wait(kvb_client *c, kvb_fuse *f, uint32_t layer, int timeout_ms)
{
	struct timespec t0, now;
	uint32_t v;

	if (!f->land)
		return set_err(c, -EINVAL, "kvb_fuse_wait is for landing sessions "
			       "(kvb_fuse_open_into)");
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (unsigned spin = 0;; spin++) {
		int64_t left_ms;

		v = atomic_load_explicit(f->progress, memory_order_acquire);
		if (v & KVBP_LAND_FAILED) {
			int code = (int)(v >> 24 & 0x7f);

			return set_err(c, -1000 - code, "the daemon stopped landing at layer %u (%s); "
				       "close the session", v & KVBP_LAND_COUNT,
				       kvb_strerror(-1000 - code));
		}
		if ((v & KVBP_LAND_COUNT) > layer)
			return 0;
		if (spin < 2000) {
			/* The layer is usually moments away: stay on the CPU a little. */
			__builtin_ia32_pause();
			continue;
		}
		clock_gettime(CLOCK_MONOTONIC, &now);
		left_ms = timeout_ms - ((now.tv_sec - t0.tv_sec) * 1000 +
					(now.tv_nsec - t0.tv_nsec) / 1000000);
		if (timeout_ms >= 0 && left_ms <= 0)
			return set_err(c, -ETIMEDOUT, "layer %u not landed within %d ms (%u layers "
				       "in place)", layer, timeout_ms, v & KVBP_LAND_COUNT);
		{
			/* Sleep until the daemon publishes again (a shared futex), 100 ms at most. */
			struct timespec ts = { 0, 100000000 };

			if (timeout_ms >= 0 && left_ms < 100)
				ts.tv_nsec = left_ms * 1000000;
			syscall(SYS_futex, (uint32_t *)f->progress, FUTEX_WAIT, v, &ts, NULL, 0);
		}
	}
}

int kvb_fuse_check(kvb_client *c, kvb_fuse *f, uint32_t layer, const void *rows,
		   size_t row_stride, const int32_t **dropped, size_t *n_dropped)
{
	struct call k = { .req = { .op = KVBP_OP_FUSE_LAYER, .session_id = f->id, .layer = layer,
				   .rows = (uint32_t)f->n_rows } };
	size_t stride = row_stride ? row_stride : f->row_bytes, span = 0;
	static const uint8_t empty[1];
	const void *ptrs[1] = { rows };
	size_t lens[1];
	uint8_t *packed = NULL;
	struct region *r;
	int rc;

	if (dropped)
		*dropped = NULL;
	if (n_dropped)
		*n_dropped = 0;
	if (!f->land)
		return set_err(c, -EINVAL, "kvb_fuse_check is for landing sessions "
			       "(kvb_fuse_open_into); use kvb_fuse_layer");
	if (stride < f->row_bytes)
		return set_err(c, -EINVAL, "row stride %zu is below the row size %zu", stride,
			       f->row_bytes);
	if (f->n_rows)
		span = (f->n_rows - 1) * stride + f->row_bytes;
	if (span && (r = region_of(c, rows, span)) != NULL) {
		/* Read where they are: the daemon maps this region. */
		k.req.has_shm = true;
		k.req.shm_id = r->id;
		k.req.shm_offset = (uint64_t)((const uint8_t *)rows - r->base);
		k.req.shm_length = span;
		k.req.row_stride = stride;
	} else if (span && in_shm(c, rows, span)) {
		k.req.has_shm = true;
		k.req.shm_id = c->shm_id;
		k.req.shm_offset = (uint64_t)((const uint8_t *)rows - (uint8_t *)c->shm_base);
		k.req.shm_length = span;
		k.req.row_stride = stride;
	} else {
		lens[0] = f->n_rows * f->row_bytes;
		if (!f->n_rows) {
			ptrs[0] = empty;
		} else if (stride != f->row_bytes) {
			packed = malloc(lens[0]);
			if (!packed)
				return set_err(c, -ENOMEM, "out of memory");
			for (size_t i = 0; i < f->n_rows; i++)
				memcpy(packed + i * f->row_bytes, (const uint8_t *)rows + i * stride,
				       f->row_bytes);
			ptrs[0] = packed;
		}
		k.payload = ptrs;
		k.payload_len = lens;
		k.n_payload = 1;
	}
	rc = call(c, &k);
	free(packed);
	if (rc)
		goto out;
	if (!k.rep.has_selection || k.rep.n_selection > f->tokens ||
	    k.rep.n_dropped > f->n_rows) {
		rc = set_err(c, KVB_E_PROTOCOL, "check layer reply without a valid selection");
		goto out;
	}
	if (k.rep.n_dropped)
		memcpy(f->dropped, k.rep.dropped, k.rep.n_dropped * sizeof(int32_t));
	f->n_dropped = k.rep.n_dropped;
	if (k.rep.n_selection)
		memcpy(f->rows, k.rep.selection, k.rep.n_selection * sizeof(int32_t));
	f->n_rows = k.rep.n_selection;
	f->next_layer = k.rep.next_layer;
	if (dropped)
		*dropped = f->dropped;
	if (n_dropped)
		*n_dropped = f->n_dropped;
out:
	call_done(&k);
	return rc;
}

uint32_t kvb_fuse_tokens(const kvb_fuse *f)
{
	return f->tokens;
}

uint32_t kvb_fuse_next_layer(const kvb_fuse *f)
{
	return f->next_layer;
}

size_t kvb_fuse_rows(const kvb_fuse *f, const int32_t **tokens)
{
	if (tokens)
		*tokens = f->rows;
	return f->n_rows;
}

int kvb_fuse_layer(kvb_client *c, kvb_fuse *f, uint32_t layer, const void *k_in, const void *v_in,
		   void *k_out, void *v_out, int *fused)
{
	struct call k = { .req = { .op = KVBP_OP_FUSE_LAYER, .session_id = f->id, .layer = layer,
				   .rows = (uint32_t)f->n_rows } };
	size_t in_bytes = f->n_rows * f->row_bytes, out_bytes = (size_t)f->tokens * f->row_bytes;
	const void *ptrs[2] = { k_in, v_in };
	size_t lens[2] = { in_bytes, in_bytes };
	bool shm = in_bytes && c->shm_ok && shm_ensure(c, 2 * in_bytes);
	int rc;

	if (fused)
		*fused = 0;
	if (f->land)
		return set_err(c, -EINVAL, "a landing session takes kvb_fuse_check() at check "
			       "layers and kvb_fuse_wait() for the others, not kvb_fuse_layer()");
	/* Fused layers in the ring only if we mapped it; else the daemon sends frames. On the
	 * device when it is mapped and the caller gave no host buffers. */
	k.req.shared_ring = f->ring != NULL;
	k.req.device_out = f->dev_base && !k_out && !v_out;
	if (shm) {
		/* Fresh rows through the client's segment: K, then V. */
		memcpy(c->shm_base, k_in, in_bytes);
		memcpy((uint8_t *)c->shm_base + in_bytes, v_in, in_bytes);
		k.req.has_shm = true;
		k.req.shm_id = c->shm_id;
		k.req.shm_offset = 0;
		k.req.shm_length = 2 * in_bytes;
	} else {
		k.payload = ptrs;
		k.payload_len = lens;
		k.n_payload = 2;
	}
	rc = call(c, &k);
	if (rc)
		goto out;
	f->last = NULL;
	f->dev_last = 0;
	if (k.rep.has_fused) {
		if (k.req.device_out) {
			if (k.rep.ring_slot >= f->ring_slots) {
				rc = set_err(c, KVB_E_PROTOCOL, "ring slot %u outside the ring",
					     k.rep.ring_slot);
				goto out;
			}
			f->dev_last = f->dev_ring + (uint64_t)k.rep.ring_slot * f->slot_bytes;
		} else if (f->ring) {
			if ((uint64_t)(k.rep.ring_slot + 1) * f->slot_bytes > f->ring_bytes) {
				rc = set_err(c, KVB_E_PROTOCOL, "ring slot %u outside the ring",
					     k.rep.ring_slot);
				goto out;
			}
			f->last = f->ring + (uint64_t)k.rep.ring_slot * f->slot_bytes;
			if (k_out)
				memcpy(k_out, f->last, out_bytes);
			if (v_out)
				memcpy(v_out, f->last + out_bytes, out_bytes);
		} else if (k.n_frames == 2 && zmq_msg_size(&k.frames[0]) == out_bytes &&
			   zmq_msg_size(&k.frames[1]) == out_bytes) {
			if (k_out)
				memcpy(k_out, zmq_msg_data(&k.frames[0]), out_bytes);
			if (v_out)
				memcpy(v_out, zmq_msg_data(&k.frames[1]), out_bytes);
		} else {
			rc = set_err(c, KVB_E_PROTOCOL, "fused layer reply of unexpected size");
			goto out;
		}
		if (fused)
			*fused = 1;
	}
	if (k.rep.has_selection) {
		if (k.rep.n_selection > f->tokens) {
			rc = set_err(c, KVB_E_PROTOCOL, "selection larger than the session");
			goto out;
		}
		if (k.rep.n_selection)
			memcpy(f->rows, k.rep.selection, k.rep.n_selection * sizeof(int32_t));
		f->n_rows = k.rep.n_selection;
	}
	f->next_layer = k.rep.next_layer;
out:
	call_done(&k);
	return rc;
}

int kvb_fuse_close(kvb_client *c, kvb_fuse **fp, struct kvb_stat **stats, size_t *n_stats)
{
	kvb_fuse *f = fp ? *fp : NULL;
	struct call k = { .req = { .op = KVBP_OP_FUSE_CLOSE } };
	int rc;

	if (stats)
		*stats = NULL;
	if (n_stats)
		*n_stats = 0;
	if (!f)
		return 0;
	k.req.session_id = f->id;
	rc = call(c, &k);
	if (!rc && stats && n_stats && k.rep.n_stats) {
		*stats = calloc(k.rep.n_stats, sizeof(**stats));
		for (size_t i = 0; *stats && i < k.rep.n_stats; i++) {
			snprintf((*stats)[i].name, sizeof((*stats)[i].name), "%s", k.rep.stats[i].name);
			(*stats)[i].value = k.rep.stats[i].value;
		}
		*n_stats = *stats ? k.rep.n_stats : 0;
	}
	call_done(&k);
	if (f->ring)
		munmap((void *)f->ring, f->ring_bytes);
	if (f->dev_base)
		kvb_cuda_unmap(c->cuda, f->dev_base);
	if (f->land && f->region->id == f->region_id)
		f->region->used[f->word / 64] &= ~(1ull << (f->word % 64));
	free(f->rows);
	free(f->dropped);
	free(f);
	*fp = NULL;
	return rc;
}

int kvb_fuse_device(kvb_client *c)
{
	char why[256];
	int rc;

	if (c->cuda)
		return 0;
	rc = kvb_cuda_load(&c->cuda, why, sizeof(why));
	return rc ? set_err(c, rc, "fused layers on the GPU: %s", why) : 0;
}

int kvb_fuse_on_device(const kvb_fuse *f)
{
	return f->dev_base != 0;
}

int kvb_fuse_output_device(const kvb_fuse *f, void **k, void **v)
{
	if (!f->dev_last)
		return -ENODATA;
	*k = (void *)(uintptr_t)f->dev_last;
	*v = (void *)(uintptr_t)(f->dev_last + f->slot_bytes / 2);
	return 0;
}

int kvb_fuse_output(const kvb_fuse *f, const void **k, const void **v)
{
	if (!f->last)
		return -ENODATA;
	*k = f->last;
	*v = f->last + f->slot_bytes / 2;
	return 0;
}

int kvb_lookup(kvb_client *c, const char *model, const uint8_t (*hashes)[KVB_HASH_LEN], size_t n,
	       struct kvb_chunk_info *out)
{
	struct call k = { .req = { .op = KVBP_OP_LOOKUP } };
	int rc;

	if ((rc = set_name(c, &k, model)))
		return rc;
	if (!n)
		return set_err(c, -EINVAL, "lookup of no hashes");
	k.req.hashes = malloc(n * KVB_HASH_LEN);
	if (!k.req.hashes)
		return set_err(c, -ENOMEM, "out of memory");
	memcpy(k.req.hashes, hashes, n * KVB_HASH_LEN);
	k.req.n_hashes = n;
	rc = call(c, &k);
	if (!rc && k.rep.n_chunks != n)
		rc = set_err(c, KVB_E_PROTOCOL, "lookup of %zu hashes answered with %zu", n,
			     k.rep.n_chunks);
	for (size_t i = 0; !rc && i < n; i++)
		chunk_from_wire(&k.rep.chunks[i], &out[i]);
	call_done(&k);
	return rc;
}

/* A request about one chunk, answered with a code only (DELETE, PIN, UNPIN). */
static int chunk_call(kvb_client *c, uint32_t op, const char *model,
		      const uint8_t hash[KVB_HASH_LEN], uint32_t ttl)
{
	struct call k = { .req = { .op = op, .has_hash = true, .ttl = ttl } };
	int rc;

	if ((rc = set_name(c, &k, model)))
		return rc;
	memcpy(k.req.hash, hash, KVB_HASH_LEN);
	rc = call(c, &k);
	call_done(&k);
	return rc;
}

int kvb_pin(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN], uint32_t ttl_s)
{
	return chunk_call(c, KVBP_OP_PIN, model, hash, ttl_s);
}

int kvb_unpin(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN])
{
	return chunk_call(c, KVBP_OP_UNPIN, model, hash, 0);
}

int kvb_delete(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN])
{
	return chunk_call(c, KVBP_OP_DELETE, model, hash, 0);
}

int kvb_list(kvb_client *c, const char *model, struct kvb_chunk_info **out, size_t *n)
{
	struct call k = { .req = { .op = KVBP_OP_LIST } };
	int rc;

	if ((rc = set_name(c, &k, model)))
		return rc;
	rc = call(c, &k);
	if (!rc) {
		*out = calloc(k.rep.n_chunks ? k.rep.n_chunks : 1, sizeof(**out));
		if (!*out)
			rc = set_err(c, -ENOMEM, "out of memory");
		for (size_t i = 0; !rc && i < k.rep.n_chunks; i++)
			chunk_from_wire(&k.rep.chunks[i], &(*out)[i]);
		*n = rc ? 0 : k.rep.n_chunks;
	}
	call_done(&k);
	return rc;
}

/* The counters of a STATS reply into a malloc'd array (0 or -ENOMEM). */
static int stats_out(kvb_client *c, const struct kvbp_reply *rep, struct kvb_stat **out,
		     size_t *n)
{
	struct kvb_stat *s = calloc(rep->n_stats ? rep->n_stats : 1, sizeof(*s));

	if (!s)
		return set_err(c, -ENOMEM, "out of memory");
	for (size_t i = 0; i < rep->n_stats; i++) {
		snprintf(s[i].name, sizeof(s[i].name), "%s", rep->stats[i].name);
		s[i].value = rep->stats[i].value;
	}
	*out = s;
	*n = rep->n_stats;
	return 0;
}

int kvb_cluster_members(kvb_client *c, struct kvb_member **out, size_t *n,
			struct kvb_stat **stats, size_t *n_stats)
{
	struct call k = { .req = { .op = KVBP_OP_STATS } };
	struct kvb_member *m = NULL;
	int rc = call(c, &k);

	if (!rc) {
		m = calloc(k.rep.n_members ? k.rep.n_members : 1, sizeof(*m));
		if (!m)
			rc = set_err(c, -ENOMEM, "out of memory");
	}
	for (size_t i = 0; !rc && i < k.rep.n_members; i++) {
		const struct kvbp_member *w = &k.rep.members[i];

		snprintf(m[i].id, sizeof(m[i].id), "%s", w->id);
		snprintf(m[i].endpoint, sizeof(m[i].endpoint), "%s", w->endpoint);
		m[i].state = w->state;
		m[i].pushes_owed = w->pushes_owed;
		m[i].last_reply_age_ms = w->last_reply_age_ms;
		m[i].chunks = w->chunks;
		m[i].stored_bytes = w->stored_bytes;
	}
	if (!rc && stats)
		rc = stats_out(c, &k.rep, stats, n_stats);
	if (rc) {
		free(m);
	} else {
		*out = m;
		*n = k.rep.n_members;
	}
	call_done(&k);
	return rc;
}

int kvb_stats(kvb_client *c, struct kvb_stat **out, size_t *n)
{
	struct call k = { .req = { .op = KVBP_OP_STATS } };
	int rc = call(c, &k);

	if (!rc)
		rc = stats_out(c, &k.rep, out, n);
	call_done(&k);
	return rc;
}
