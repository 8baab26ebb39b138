/*
 * chunk — calls about stored chunks: hashing token ids, PUT, GET (into a buffer,
 * copied out behind the daemon, or kept as frames), LOOKUP, PIN, UNPIN, DELETE, LIST.
 */
#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <malloc.h>
#include <sodium.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client/client_impl.h"

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
static int put_once(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
		    enum kvb_dtype dtype, uint32_t num_tokens, uint32_t base_pos, const void *kv,
		    size_t kv_bytes, int *existed, bool *bulk_failed);
static int bulk_ready(kvb_client *c);
static int get_once(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
		    const struct kvb_get_opts *g, void *out, size_t out_bytes,
		    struct kvb_chunk_info *info);

/* After a PUT's bulk payload failed, PUTs go in frames this long. */
#define BULK_PUT_BACKOFF_MS 60000

static int64_t mono_ms(void)
{
	struct timespec now;

	clock_gettime(CLOCK_MONOTONIC, &now);
	return now.tv_sec * 1000 + now.tv_nsec / 1000000;
}

/* Whether a PUT may try the bulk connection now (not within the backoff of a failed one). */
static bool bulk_put_ok(const kvb_client *c)
{
	return !c->bulk_put_after_ms || mono_ms() >= c->bulk_put_after_ms;
}

int kvb_put(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
	    enum kvb_dtype dtype, uint32_t num_tokens, uint32_t base_pos, const void *kv,
	    size_t kv_bytes, int *existed)
{
	bool had = c->shm_base != NULL, bulk_failed = false;
	int rc = put_once(c, model, hash, dtype, num_tokens, base_pos, kv, kv_bytes, existed,
			  &bulk_failed);

	/* Once, with a new segment; kv stays readable if it was in the lost one. Once, in
	 * frames, when its bulk connection failed, the daemon no longer had it (a restart,
	 * an idle connection cut), or the payload fell behind the daemon's schedule (a slow
	 * link): nothing of it was stored. PUTs stay in frames for a minute after. */
	if (bulk_failed)
		c->bulk_put_after_ms = mono_ms() + BULK_PUT_BACKOFF_MS;
	if (kvbc_shm_lost(c, rc, had) || bulk_failed)
		rc = put_once(c, model, hash, dtype, num_tokens, base_pos, kv, kv_bytes, existed,
			      &bulk_failed);
	return rc;
}

static int put_once(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
		    enum kvb_dtype dtype, uint32_t num_tokens, uint32_t base_pos, const void *kv,
		    size_t kv_bytes, int *existed, bool *bulk_failed)
{
	struct call k = { .req = { .op = KVBP_OP_PUT, .has_hash = true, .dtype = (uint32_t)dtype,
				   .num_tokens = num_tokens, .base_pos = base_pos } };
	const void **ptrs = NULL;
	size_t *lens = NULL, esize = kvb_dtype_size(dtype), per_tokens;
	int rc;

	if ((rc = kvbc_set_name(c, &k, model)))
		return rc;
	if (!esize)
		return kvbc_set_err(c, -EINVAL, "unknown dtype %d", (int)dtype);
	if (!num_tokens || !kv_bytes || kv_bytes % (2 * (size_t)num_tokens * esize))
		return kvbc_set_err(c, -EINVAL, "%zu bytes cannot hold K and V of %" PRIu32
				    " tokens of %zu-byte elements", kv_bytes, num_tokens, esize);
	memcpy(k.req.hash, hash, KVB_HASH_LEN);
	if (!kvbc_in_shm(c, kv, kv_bytes) && bulk_put_ok(c) && bulk_ready(c) == 1 && c->bulk_put) {
		/* over TCP: the payload on the bulk connection, straight from kv */
		k.req.has_bulk_ticket = true;
		memcpy(k.req.bulk_ticket, c->bulk_ticket, sizeof(k.req.bulk_ticket));
		k.bulk_out = kv;
		k.bulk_out_len = kv_bytes;
		rc = kvbc_call(c, &k);
		/* the daemon refused the records (bad_frames), or no reply came after the
		 * connection failed: again in frames; a refusal of the request itself
		 * (unknown model, a limit, ...) stands */
		*bulk_failed = rc == KVB_E_BAD_FRAMES || (k.bulk_out_rc && rc < 0 && rc > -1000);
		if (rc) /* a failed PUT's connection the daemon closed: the next call opens one */
			kvbc_bulk_close(c);
	} else if (kvbc_in_shm(c, kv, kv_bytes) ||
		   (c->shm_ok && kvbc_shm_ensure(c, kv_bytes))) {
		if (!kvbc_in_shm(c, kv, kv_bytes))
			memcpy(c->shm_base, kv, kv_bytes);
		k.req.has_shm = true;
		k.req.shm_id = c->shm_id;
		k.req.shm_offset = kvbc_in_shm(c, kv, kv_bytes)
					   ? (uint64_t)((const uint8_t *)kv - (uint8_t *)c->shm_base)
					   : 0;
		k.req.shm_length = kv_bytes;
		rc = kvbc_call(c, &k);
	} else {
		/* Without a model lookup we do not know the layer count; the daemon checks it.
		 * Frames are split per tensor: one K and one V per layer. */
		struct kvb_model m;

		rc = kvb_model_get(c, model, &m);
		if (rc)
			goto out;
		per_tokens = (size_t)num_tokens * m.num_kv_heads * m.head_dim * esize;
		if (kv_bytes != per_tokens * 2 * m.num_layers) {
			rc = kvbc_set_err(c, -EINVAL, "%zu bytes do not hold %" PRIu32
					  " layers x 2 x %" PRIu32 " tokens x %" PRIu32 " heads x %"
					  PRIu32 " dims",
					  kv_bytes, m.num_layers, num_tokens, m.num_kv_heads, m.head_dim);
			goto out;
		}
		k.n_payload = 2 * (size_t)m.num_layers;
		ptrs = calloc(k.n_payload, sizeof(*ptrs));
		lens = calloc(k.n_payload, sizeof(*lens));
		if (!ptrs || !lens) {
			rc = kvbc_set_err(c, -ENOMEM, "out of memory");
			goto out;
		}
		for (size_t i = 0; i < k.n_payload; i++) {
			ptrs[i] = (const uint8_t *)kv + i * per_tokens;
			lens[i] = per_tokens;
		}
		k.payload = ptrs;
		k.payload_len = lens;
		rc = kvbc_call(c, &k);
	}
	if (!rc && existed)
		*existed = k.rep.existed;
out:
	free(ptrs);
	free(lens);
	kvbc_call_done(&k);
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

/* The HELLO that asks for a bulk connection, then the connection (kvbc_bulk_attach). */
static int open_bulk(kvb_client *c)
{
	uint32_t offer = kvbc_bulk_offer();
	struct call k = { .req = { .op = KVBP_OP_HELLO, .bulk_open = true, .bulk_aeads = offer } };
	int rc = kvbc_call(c, &k);

	if (!rc)
		rc = kvbc_bulk_attach(c, &k.rep, offer);
	kvbc_call_done(&k);
	return rc;
}

/*
 * Whether GET payloads may come on the bulk connection: opens it on first use (a HELLO
 * with bulk_open, then the TCP connection and its hello). 1: yes; 0: frames, over IPC,
 * with KVBLEND_NO_BULK=1 in the environment, and for good when the daemon offers none
 * (older, tcp_bulk off) or the connection cannot be made; or the HELLO's error
 * (-ETIMEDOUT, -EIO, a KVB_E_* code; c->err says it), which the GET would meet too.
 */
static int bulk_ready(kvb_client *c)
{
	const char *off = getenv("KVBLEND_NO_BULK");
	int rc;

	if (c->bulk_state > 0)
		return 1;
	if (c->bulk_state < 0 || strncmp(c->endpoint, "tcp://", 6) || (off && *off == '1'))
		return 0;
	rc = open_bulk(c);
	if (rc == -ETIMEDOUT || rc == -EIO || rc <= -1000) {
		/* the daemon did not answer the HELLO: the GET would fail the same way */
		kvbc_bulk_close(c);
		return rc;
	}
	if (rc) {
		/* none offered, or the connection could not be made: frames, for good */
		kvbc_bulk_close(c);
		c->bulk_state = -1;
		c->err[0] = 0;
		return 0;
	}
	c->bulk_state = 1;
	return 1;
}

static int get_common(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
		      const struct kvb_get_opts *g, void *out, size_t out_bytes,
		      struct kvb_chunk_info *info)
{
	bool had = c->shm_base != NULL;
	int rc = get_once(c, model, hash, g, out, out_bytes, info);

	if (kvbc_shm_lost(c, rc, had))
		rc = get_once(c, model, hash, g, out, out_bytes, info);
	return rc;
}

static int get_once(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
		    const struct kvb_get_opts *g, void *out, size_t out_bytes,
		    struct kvb_chunk_info *info)
{
	struct call k = { .req = { .op = KVBP_OP_GET, .has_hash = true,
				   .layer_begin = g->layer_begin, .layer_end = g->layer_end,
				   .rerotate = g->rerotate != 0, .target_pos = g->pos,
				   .head_begin = g->head_begin, .head_count = g->head_count } };
	bool direct = kvbc_in_shm(c, out, out_bytes);
	uint8_t *dst = out;
	size_t got = 0;
	struct copy_behind cb = { 0 };
	int rc;

	if ((rc = kvbc_set_name(c, &k, model)))
		return rc;
	memcpy(k.req.hash, hash, KVB_HASH_LEN);
	/* an older daemon would ignore the head range and answer every head: it refuses v2 */
	if (g->head_count)
		k.req.version = KVBP_VERSION_MAX;
	if (direct || (c->shm_ok && kvbc_shm_ensure(c, out_bytes + SHM_DATA_OFF))) {
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
		/* over TCP: the payload on the bulk connection, straight into dst */
		rc = bulk_ready(c);
		if (rc < 0)
			goto out;
		if (rc) {
			rc = 0;
			k.bulk = true;
			k.req.has_bulk_ticket = true;
			memcpy(k.req.bulk_ticket, c->bulk_ticket, sizeof(k.req.bulk_ticket));
		}
	}
	rc = kvbc_call(c, &k);
	if (rc == KVB_E_BAD_SHM && (strstr(c->err, "too small") || strstr(c->err, "does not match"))) {
		/* the reply names the chunk, so that the caller learns its size */
		if (info && k.rep.n_chunks == 1)
			chunk_from_wire(&k.rep.chunks[0], info);
		rc = kvbc_set_err(c, -ENOBUFS, "buffer of %zu bytes does not match the chunk",
				  out_bytes);
		goto out;
	}
	if (rc)
		goto out;
	if (k.rep.n_chunks != 1) {
		rc = kvbc_set_err(c, KVB_E_PROTOCOL, "get reply without chunk info");
		goto out;
	}
	if (info)
		chunk_from_wire(&k.rep.chunks[0], info);
	if (k.req.has_shm) {
		/* The daemon filled the span it needed; it must be all of out (a head range's
		 * span it checked itself: the chunk's info does not say its heads). */
		uint64_t need = g->head_count ? out_bytes
				      : k.rep.chunks[0].raw_bytes / (k.rep.chunks[0].num_layers
								     ? k.rep.chunks[0].num_layers
								     : 1) *
					(k.rep.layer_end - k.rep.layer_begin);

		if (need != out_bytes) {
			rc = kvbc_set_err(c, -ENOBUFS, "buffer of %zu bytes does not match the %"
					  PRIu64 " bytes of the requested layers", out_bytes, need);
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
		rc = kvbc_set_err(c, -ENOBUFS, "buffer of %zu bytes does not match the %zu bytes "
				  "of the requested layers", out_bytes, got);
		goto out;
	}
out:
	kvbc_call_done(&k);
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

	if ((rc = kvbc_set_name(c, &k, model)))
		return rc;
	memcpy(k.req.hash, hash, KVB_HASH_LEN);
	rc = kvbc_call(c, &k); /* no shared memory, no sink: the frames stay as they came */
	if (rc)
		goto out;
	if (k.rep.n_chunks != 1 || k.rep.layer_end <= k.rep.layer_begin) {
		rc = kvbc_set_err(c, KVB_E_PROTOCOL, "get reply without chunk info or layers");
		goto out;
	}
	chunk_from_wire(&k.rep.chunks[0], &info);
	n = k.rep.layer_end - k.rep.layer_begin;
	if (k.n_frames != 2 * (size_t)n) {
		rc = kvbc_set_err(c, KVB_E_PROTOCOL, "get reply has %zu frames for %" PRIu32
				  " layers", k.n_frames, n);
		goto out;
	}
	for (size_t i = 0; i < k.n_frames; i++)
		if (zmq_msg_size(&k.frames[i]) != zmq_msg_size(&k.frames[0])) {
			rc = kvbc_set_err(c, KVB_E_PROTOCOL, "get reply frames differ in size");
			goto out;
		}
	l = calloc(1, sizeof(*l));
	if (l) {
		l->pub.k = calloc(n, sizeof(*l->pub.k));
		l->pub.v = calloc(n, sizeof(*l->pub.v));
	}
	if (!l || !l->pub.k || !l->pub.v) {
		rc = kvbc_set_err(c, -ENOMEM, "out of memory");
		goto out;
	}
	l->pub.layer_begin = k.rep.layer_begin;
	l->pub.layer_end = k.rep.layer_end;
	l->pub.tensor_bytes = zmq_msg_size(&k.frames[0]);
	l->pub.info = info;
	/* The frames move into the result: kvbc_call_done() then has none to close. */
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
	kvbc_call_done(&k);
	return rc;
}

int kvb_get(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
	    uint32_t layer_begin, uint32_t layer_end, void *out, size_t out_bytes,
	    struct kvb_chunk_info *info)
{
	struct kvb_get_opts g = { .size = sizeof(g), .layer_begin = layer_begin,
				  .layer_end = layer_end };

	return get_common(c, model, hash, &g, out, out_bytes, info);
}

int kvb_get_rerotated(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
		      uint32_t layer_begin, uint32_t layer_end, uint32_t pos, void *out,
		      size_t out_bytes, struct kvb_chunk_info *info)
{
	struct kvb_get_opts g = { .size = sizeof(g), .layer_begin = layer_begin,
				  .layer_end = layer_end, .rerotate = 1, .pos = pos };

	return get_common(c, model, hash, &g, out, out_bytes, info);
}

int kvb_get_opts(kvb_client *c, const char *model, const uint8_t hash[KVB_HASH_LEN],
		 const struct kvb_get_opts *opts, void *out, size_t out_bytes,
		 struct kvb_chunk_info *info)
{
	if (!opts || opts->size < sizeof(*opts))
		return kvbc_set_err(c, -EINVAL, "kvb_get_opts: opts->size %zu is less than this "
				    "library's struct kvb_get_opts (%zu)", opts ? opts->size : 0,
				    sizeof(*opts));
	if (!opts->head_count && opts->head_begin)
		return kvbc_set_err(c, -EINVAL, "head_begin %" PRIu32 " without head_count",
				    opts->head_begin);
	return get_common(c, model, hash, opts, out, out_bytes, info);
}


int kvb_lookup(kvb_client *c, const char *model, const uint8_t (*hashes)[KVB_HASH_LEN], size_t n,
	       struct kvb_chunk_info *out)
{
	struct call k = { .req = { .op = KVBP_OP_LOOKUP } };
	int rc;

	if ((rc = kvbc_set_name(c, &k, model)))
		return rc;
	if (!n)
		return kvbc_set_err(c, -EINVAL, "lookup of no hashes");
	k.req.hashes = malloc(n * KVB_HASH_LEN);
	if (!k.req.hashes)
		return kvbc_set_err(c, -ENOMEM, "out of memory");
	memcpy(k.req.hashes, hashes, n * KVB_HASH_LEN);
	k.req.n_hashes = n;
	rc = kvbc_call(c, &k);
	if (!rc && k.rep.n_chunks != n)
		rc = kvbc_set_err(c, KVB_E_PROTOCOL, "lookup of %zu hashes answered with %zu", n,
				  k.rep.n_chunks);
	for (size_t i = 0; !rc && i < n; i++)
		chunk_from_wire(&k.rep.chunks[i], &out[i]);
	kvbc_call_done(&k);
	return rc;
}

/* A request about one chunk, answered with a code only (DELETE, PIN, UNPIN). */
static int chunk_call(kvb_client *c, uint32_t op, const char *model,
		      const uint8_t hash[KVB_HASH_LEN], uint32_t ttl)
{
	struct call k = { .req = { .op = op, .has_hash = true, .ttl = ttl } };
	int rc;

	if ((rc = kvbc_set_name(c, &k, model)))
		return rc;
	memcpy(k.req.hash, hash, KVB_HASH_LEN);
	rc = kvbc_call(c, &k);
	kvbc_call_done(&k);
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

	if ((rc = kvbc_set_name(c, &k, model)))
		return rc;
	rc = kvbc_call(c, &k);
	if (!rc) {
		*out = calloc(k.rep.n_chunks ? k.rep.n_chunks : 1, sizeof(**out));
		if (!*out)
			rc = kvbc_set_err(c, -ENOMEM, "out of memory");
		for (size_t i = 0; !rc && i < k.rep.n_chunks; i++)
			chunk_from_wire(&k.rep.chunks[i], &(*out)[i]);
		*n = rc ? 0 : k.rep.n_chunks;
	}
	kvbc_call_done(&k);
	return rc;
}
