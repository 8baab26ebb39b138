/*
 * fuse — the client's side of a fuse session: FUSE_OPEN, the layer calls (fused
 * layers out of the daemon's shared ring, its device ring, or frames), the landing
 * sessions that write into a region of the node (kvb_fuse_open_into, kvb_fuse_wait,
 * kvb_fuse_check), and FUSE_CLOSE.
 */
#include <errno.h>
#include <inttypes.h>
#include <linux/futex.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#include "client/client_impl.h"
#include "common/ckd.h"

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
	/* the attention metric: A to send with the next layer or check call (or NULL) */
	uint32_t metric;
	size_t attn_count; /* chunk tokens x kv_heads */
	float *attn;
	size_t node_row_bytes; /* a head range's session: a row of the node's heads; else 0 */
};

/*
 * The landing part of a FUSE_OPEN request: dst's K and V must lie in one region of
 * this client, which must have a free progress word (*word, zeroed here). Returns 0,
 * -EINVAL, -EMFILE or -ENOMEM with c->err set; on failure req holds nothing new.
 */
static int fuse_land_request(kvb_client *c, const struct kvb_kv_layout *dst,
			     const struct kvb_land_opts *o, struct kvbp_request *req,
			     struct region **reg_out, unsigned *word_out)
{
	static const struct kvb_land_opts none = { sizeof(none), NULL, NULL, 0, 0 };
	const struct kvb_kv_strides *ks = (o = o ? o : &none)->k_strides;
	const struct kvb_device_mem *mem = o->device;
	struct region *reg;
	unsigned word = 0;
	const uint8_t *base;

	if (mem) {
		/* K and V in the node's device allocation; the progress word in a region. */
		base = mem->base;
		reg = kvbc_region_of(c, mem->progress, 1);
		if (!reg)
			return kvbc_set_err(c, -EINVAL, "a device landing needs a region of this "
					    "client (kvb_region_alloc) for its progress word");
		if (!base || !mem->bytes || (const uint8_t *)dst->k < base ||
		    (const uint8_t *)dst->v < base ||
		    (size_t)((const uint8_t *)dst->k - base) >= mem->bytes ||
		    (size_t)((const uint8_t *)dst->v - base) >= mem->bytes)
			return kvbc_set_err(c, -EINVAL, "the landing layout's K and V must lie in "
					    "the device allocation [base, base + bytes)");
		if (!memchr(mem->pci, 0, sizeof(mem->pci)) || !mem->pci[0])
			return kvbc_set_err(c, -EINVAL, "a device landing needs the device's PCI "
					    "bus id (NUL-terminated)");
		if (ks)
			return kvbc_set_err(c, -EINVAL, "a device landing takes K laid out as V");
	} else {
		/* The node's buffers: a region of this client; a progress word in its head. */
		reg = kvbc_region_of(c, dst->k, 1);
		if (!reg || kvbc_region_of(c, dst->v, 1) != reg)
			return kvbc_set_err(c, -EINVAL, "the landing layout's K and V must lie in "
					    "one region of this client (kvb_region_alloc)");
		base = reg->base;
	}
	while (word < REGION_WORDS && (reg->used[word / 64] >> (word % 64) & 1))
		word++;
	if (word == REGION_WORDS)
		return kvbc_set_err(c, -EMFILE, "%u landing sessions use this region already",
				    REGION_WORDS);
	if (dst->page_tokens && !dst->pages)
		return kvbc_set_err(c, -EINVAL, "a paged layout needs its block table");
	if (ks && !ks->dim_stride)
		return kvbc_set_err(c, -EINVAL, "K strides need a dim_stride (> 0)");
	if (!o->head_count && o->head_begin)
		return kvbc_set_err(c, -EINVAL, "head_begin without head_count");
	req->has_land = true;
	req->land.head_begin = o->head_begin;
	req->land.head_count = o->head_count;
	/* an older daemon would ignore these and land by the wrong layout: it refuses v2 */
	if (o->head_count || mem)
		req->version = KVBP_VERSION_MAX;
	if (ks) {
		req->land.k_token_stride = ks->token_stride;
		req->land.k_head_stride = ks->head_stride;
		req->land.k_dim_stride = ks->dim_stride;
	}
	req->land.shm_id = reg->id;
	req->land.k_offset = (uint64_t)((const uint8_t *)dst->k - base);
	req->land.v_offset = (uint64_t)((const uint8_t *)dst->v - base);
	if (mem) {
		req->land.has_device = true;
		memcpy(req->land.device_handle, mem->ipc_handle, KVBP_DEVICE_HANDLE_LEN);
		memcpy(req->land.device_pci, mem->pci, strlen(mem->pci) + 1);
		req->land.device_bytes = mem->bytes;
	}
	req->land.layer_stride = dst->layer_stride;
	req->land.token_stride = dst->token_stride;
	req->land.head_stride = dst->head_stride;
	req->land.page_tokens = dst->page_tokens;
	req->land.page_stride = dst->page_stride;
	req->land.progress = 4 * (uint64_t)word;
	if (dst->page_tokens && dst->n_pages) {
		req->land.pages = malloc(dst->n_pages * sizeof(uint32_t));
		if (!req->land.pages)
			return kvbc_set_err(c, -ENOMEM, "out of memory");
		memcpy(req->land.pages, dst->pages, dst->n_pages * sizeof(uint32_t));
		req->land.n_pages = dst->n_pages;
	}
	atomic_store_explicit((_Atomic uint32_t *)(reg->base + 4 * (size_t)word), 0,
			      memory_order_relaxed);
	*reg_out = reg;
	*word_out = word;
	return 0;
}

/*
 * The segments and check layers of a FUSE_OPEN request (p NULL: reuse only). Returns
 * 0 or -ENOMEM; what it allocated kvbc_call_done() frees either way.
 */
static int fuse_open_request(kvb_client *c, struct kvbp_request *req,
			     const struct kvb_segment *segs, size_t n_segs,
			     const struct kvb_fuse_params *p, const int32_t *recompute,
			     size_t n_recompute)
{
	size_t n_checks = p ? p->n_checks : 0;

	req->segments = calloc(n_segs, sizeof(*req->segments));
	req->check_layers = malloc((n_checks + 1) * sizeof(uint32_t));
	req->ratios = malloc((n_checks + 1) * sizeof(double));
	if (!req->segments || !req->check_layers || !req->ratios)
		return kvbc_set_err(c, -ENOMEM, "out of memory");
	for (size_t i = 0; i < n_segs; i++) {
		req->segments[i].fresh = segs[i].fresh != 0;
		memcpy(req->segments[i].hash, segs[i].hash, KVB_HASH_LEN);
		req->segments[i].pos = segs[i].pos;
		req->segments[i].count = segs[i].fresh ? segs[i].count : 0;
	}
	req->n_segments = n_segs;
	if (n_checks) {
		memcpy(req->check_layers, p->check_layers, n_checks * sizeof(uint32_t));
		memcpy(req->ratios, p->ratios, n_checks * sizeof(double));
	}
	req->n_checks = req->n_ratios = n_checks;
	req->reuse_only = n_checks == 0;
	req->metric = p ? (uint32_t)p->metric : 0;
	if (n_recompute) {
		req->recompute = malloc(n_recompute * sizeof(int32_t));
		if (!req->recompute)
			return kvbc_set_err(c, -ENOMEM, "out of memory");
		memcpy(req->recompute, recompute, n_recompute * sizeof(int32_t));
		req->n_recompute = n_recompute;
	}
	return 0;
}

/*
 * The session a FUSE_OPEN reply opened, for a model of row_bytes per token: its rows,
 * its device ring mapped if the daemon exported one, and (unless land) its shared
 * ring mapped read-only. Returns 0 and *out, or -ENOMEM, KVB_E_PROTOCOL.
 */
static int fuse_from_reply(kvb_client *c, const struct kvbp_reply *rep, size_t row_bytes,
			   bool land, kvb_fuse **out)
{
	kvb_fuse *f;

	if (rep->n_selection > rep->num_tokens)
		return kvbc_set_err(c, KVB_E_PROTOCOL, "more rows than tokens in a fuse_open reply");
	f = calloc(1, sizeof(*f));
	if (f)
		f->rows = malloc(((size_t)rep->num_tokens + 1) * sizeof(int32_t));
	if (f && f->rows)
		f->dropped = malloc(((size_t)rep->num_tokens + 1) * sizeof(int32_t));
	if (!f || !f->rows || !f->dropped) {
		if (f)
			free(f->rows);
		free(f);
		return kvbc_set_err(c, -ENOMEM, "out of memory");
	}
	f->id = rep->session_id;
	f->tokens = rep->num_tokens;
	f->next_layer = f->first_check = rep->next_layer;
	f->row_bytes = row_bytes;
	if (rep->has_selection) {
		/* Reuse only: the node computes the fresh tokens, at every layer. */
		if (rep->n_selection)
			memcpy(f->rows, rep->selection, rep->n_selection * sizeof(int32_t));
		f->n_rows = rep->n_selection;
	} else {
		for (uint32_t i = 0; i < f->tokens; i++)
			f->rows[i] = (int32_t)i;
		f->n_rows = f->tokens;
	}
	f->slot_bytes = rep->slot_bytes;
	f->ring_slots = rep->ring_slots;
	if (rep->has_ipc && c->cuda && rep->slot_bytes == 2 * (uint64_t)f->tokens * f->row_bytes) {
		/* Without the mapping the session still works: the layers come in host memory. */
		if (kvb_cuda_map(c->cuda, rep->device_pci, rep->ipc_handle, &f->dev_base, c->err,
				 sizeof(c->err)) == 0) {
			f->dev_ring = f->dev_base + rep->ipc_offset;
			c->err[0] = 0;
		}
	}
	if (!land && rep->shm_name[0] && rep->shm_size &&
	    rep->slot_bytes == 2 * (uint64_t)f->tokens * f->row_bytes) {
		/* Map it read-only: nothing this side can write the daemon's memory. If that
		 * fails the session still works; the layers then come in frames. The ring is
		 * populated now: the node reads every page of it, layer after layer. */
		void *p_ring;

		if (kvbc_map_segment(c, rep->shm_name, rep->shm_id, rep->shm_size, PROT_READ,
				     MAP_SHARED | MAP_POPULATE, &p_ring) == 0) {
			f->ring = p_ring;
			f->ring_bytes = rep->shm_size;
		}
		c->err[0] = 0;
	}
	*out = f;
	return 0;
}

/* Fresh tokens among the segments. */
static size_t fresh_tokens(const struct kvb_segment *segs, size_t n_segs)
{
	size_t n = 0;

	for (size_t i = 0; i < n_segs; i++)
		n += segs[i].fresh ? segs[i].count : 0;
	return n;
}

/*
 * The model of a session a FUSE_OPEN reply opened: the one it carries, or (an older
 * kvblendd) looked up. Shapes outside what a daemon registers are a protocol error.
 */
static int session_model(kvb_client *c, const struct kvbp_reply *rep, const char *name,
			 struct kvb_model *m)
{
	const struct kvbp_model *w = rep->n_models == 1 ? &rep->models[0] : NULL;
	uint64_t row;

	if (!w)
		return kvb_model_get(c, name, m);
	kvbc_model_from_wire(w, m);
	snprintf(m->name, sizeof(m->name), "%s", name);
	if (!m->num_kv_heads || !m->head_dim || !kvb_dtype_size(m->dtype) ||
	    ckd_mul(&row, (uint64_t)m->num_kv_heads * m->head_dim, kvb_dtype_size(m->dtype)) ||
	    row > UINT32_MAX)
		return kvbc_set_err(c, KVB_E_PROTOCOL, "fuse_open reply with a model of %" PRIu32
				    " heads of %" PRIu32 ", dtype %d", m->num_kv_heads, m->head_dim,
				    (int)m->dtype);
	return 0;
}

/* Close a session this side cannot use (its model could not be read): best effort. */
static void close_orphan(kvb_client *c, uint64_t id)
{
	struct call k = { .req = { .op = KVBP_OP_FUSE_CLOSE, .session_id = id } };

	kvbc_call_quiet(c, &k);
}

static int fuse_open_common(kvb_client *c, const char *model, const struct kvb_segment *segs,
			    size_t n_segs, const struct kvb_fuse_params *p,
			    const int32_t *recompute, size_t n_recompute,
			    const struct kvb_kv_layout *dst, const struct kvb_land_opts *o,
			    kvb_fuse **out, uint8_t (**missing)[KVB_HASH_LEN], size_t *n_missing)
{
	const struct kvb_kv_strides *ks = o ? o->k_strides : NULL;
	struct call k = { .req = { .op = KVBP_OP_FUSE_OPEN } };
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
	if ((rc = kvbc_set_name(c, &k, model)))
		return rc;
	if (!n_segs)
		return kvbc_set_err(c, -EINVAL, "a fuse needs at least one segment");
	if (dst && (rc = fuse_land_request(c, dst, o, &k.req, &reg, &word)))
		return rc;
	if ((rc = fuse_open_request(c, &k.req, segs, n_segs, p, recompute, n_recompute)))
		goto out;
	k.req.shared_ring = c->shm_ok && !dst;
	k.req.device_out = c->cuda && !dst;
	rc = kvbc_call(c, &k);
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
	/* The row size, for the layer calls to check their buffers against: from the reply
	 * (a kvblendd older than 2026-12-05 sends no model: look it up). */
	rc = session_model(c, &k.rep, model, &m);
	if (!rc)
		rc = fuse_from_reply(c, &k.rep,
				     (size_t)m.num_kv_heads * m.head_dim * kvb_dtype_size(m.dtype),
				     dst != NULL, &f);
	if (rc) {
		if (k.rep.session_id)
			close_orphan(c, k.rep.session_id);
		goto out;
	}
	f->metric = p ? (uint32_t)p->metric : 0;
	f->attn_count = (size_t)(f->tokens - fresh_tokens(segs, n_segs)) * m.num_kv_heads;
	if (dst) {
		f->land = true;
		f->region = reg;
		f->region_id = reg->id;
		f->word = word;
		f->progress = (_Atomic uint32_t *)(reg->base + 4 * (size_t)word);
		reg->used[word / 64] |= 1ull << (word % 64);
	}
	if (o && o->head_count)
		f->node_row_bytes = (size_t)o->head_count * m.head_dim * kvb_dtype_size(m.dtype);
	if (o && o->head_count && !k.rep.land_heads) {
		/* An older daemon ignored the head range: it lands every head. */
		kvb_fuse_close(c, &f, NULL, NULL);
		rc = kvbc_set_err(c, -ENOTSUP, "this kvblendd does not land a head range: it is "
				  "older than the client");
		goto out;
	}
	if (ks && !k.rep.land_k_strided) {
		/* An older daemon ignored the K strides: it lands K as V is laid out. */
		kvb_fuse_close(c, &f, NULL, NULL);
		rc = kvbc_set_err(c, -ENOTSUP, "this kvblendd does not land K by its own "
				  "strides (transposed K): it is older than the client");
		goto out;
	}
	*out = f;
out:
	kvbc_call_done(&k);
	return rc;
}

int kvb_fuse_open(kvb_client *c, const char *model, const struct kvb_segment *segs,
		  size_t n_segs, const struct kvb_fuse_params *p, kvb_fuse **out,
		  uint8_t (**missing)[KVB_HASH_LEN], size_t *n_missing)
{
	return fuse_open_common(c, model, segs, n_segs, p, NULL, 0, NULL, NULL, out, missing,
				n_missing);
}

int kvb_fuse_open_recompute(kvb_client *c, const char *model, const struct kvb_segment *segs,
			    size_t n_segs, const int32_t *recompute, size_t n_recompute,
			    const struct kvb_kv_layout *dst, kvb_fuse **out,
			    uint8_t (**missing)[KVB_HASH_LEN], size_t *n_missing)
{
	if (n_recompute && !recompute) {
		*out = NULL;
		return kvbc_set_err(c, -EINVAL, "kvb_fuse_open_recompute: recompute is NULL");
	}
	return fuse_open_common(c, model, segs, n_segs, NULL, recompute, n_recompute, dst, NULL,
				out, missing, n_missing);
}

int kvb_fuse_attention(kvb_client *c, kvb_fuse *f, const float *a, size_t n)
{
	float *copy;

	if (f->metric != KVB_METRIC_ATTENTION)
		return kvbc_set_err(c, -EINVAL, "kvb_fuse_attention: the session's metric is not "
				    "attention");
	if (n != f->attn_count || (n && !a))
		return kvbc_set_err(c, -EINVAL, "kvb_fuse_attention: A has %zu values; the session "
				    "needs %zu (chunk tokens x kv_heads)", n, f->attn_count);
	copy = malloc((n + 1) * sizeof(float));
	if (!copy)
		return kvbc_set_err(c, -ENOMEM, "out of memory");
	if (n)
		memcpy(copy, a, n * sizeof(float));
	free(f->attn);
	f->attn = copy;
	return 0;
}

int kvb_fuse_open_into(kvb_client *c, const char *model, const struct kvb_segment *segs,
		       size_t n_segs, const struct kvb_fuse_params *p,
		       const struct kvb_kv_layout *dst, kvb_fuse **out,
		       uint8_t (**missing)[KVB_HASH_LEN], size_t *n_missing)
{
	if (!dst) {
		*out = NULL;
		return kvbc_set_err(c, -EINVAL, "kvb_fuse_open_into needs a layout");
	}
	return fuse_open_common(c, model, segs, n_segs, p, NULL, 0, dst, NULL, out, missing,
				n_missing);
}

int kvb_fuse_open_into_strided(kvb_client *c, const char *model, const struct kvb_segment *segs,
			       size_t n_segs, const struct kvb_fuse_params *p,
			       const struct kvb_kv_layout *dst,
			       const struct kvb_kv_strides *k_strides, kvb_fuse **out,
			       uint8_t (**missing)[KVB_HASH_LEN], size_t *n_missing)
{
	if (!dst) {
		*out = NULL;
		return kvbc_set_err(c, -EINVAL, "kvb_fuse_open_into_strided needs a layout");
	}
	struct kvb_land_opts o = { sizeof(o), k_strides, NULL, 0, 0 };

	return fuse_open_common(c, model, segs, n_segs, p, NULL, 0, dst, &o, out, missing,
				n_missing);
}

int kvb_fuse_open_into_device(kvb_client *c, const char *model, const struct kvb_segment *segs,
			      size_t n_segs, const struct kvb_fuse_params *p,
			      const struct kvb_kv_layout *dst, const struct kvb_device_mem *mem,
			      kvb_fuse **out, uint8_t (**missing)[KVB_HASH_LEN], size_t *n_missing)
{
	struct kvb_land_opts o = { sizeof(o), NULL, mem, 0, 0 };

	if (!mem) {
		*out = NULL;
		return kvbc_set_err(c, -EINVAL, "kvb_fuse_open_into_device needs the device "
				    "allocation");
	}
	return kvb_fuse_open_into_opts(c, model, segs, n_segs, p, dst, &o, out, missing,
				       n_missing);
}

int kvb_fuse_open_into_opts(kvb_client *c, const char *model, const struct kvb_segment *segs,
			    size_t n_segs, const struct kvb_fuse_params *p,
			    const struct kvb_kv_layout *dst, const struct kvb_land_opts *opts,
			    kvb_fuse **out, uint8_t (**missing)[KVB_HASH_LEN], size_t *n_missing)
{
	struct kvb_land_opts o = { sizeof(o), NULL, NULL, 0, 0 };

	if (!dst) {
		*out = NULL;
		return kvbc_set_err(c, -EINVAL, "kvb_fuse_open_into_opts needs a layout");
	}
	if (opts) {
		size_t n = opts->size < sizeof(o) ? opts->size : sizeof(o);

		if (opts->size < offsetof(struct kvb_land_opts, head_count) + sizeof(uint32_t)) {
			*out = NULL;
			return kvbc_set_err(c, -EINVAL, "struct kvb_land_opts of %zu bytes: its size "
					    "field must be set", opts->size);
		}
		/* a newer caller's fields past this build's must be unset: never ignored */
		for (size_t i = sizeof(o); i < opts->size; i++)
			if (((const uint8_t *)opts)[i]) {
				*out = NULL;
				return kvbc_set_err(c, -EINVAL, "struct kvb_land_opts sets fields "
						    "this libkvblend does not know");
			}
		memcpy(&o, opts, n); /* only what the caller has */
		o.size = sizeof(o);
	}
	return fuse_open_common(c, model, segs, n_segs, p, NULL, 0, dst, &o, out, missing,
				n_missing);
}

int kvb_fuse_wait(kvb_client *c, kvb_fuse *f, uint32_t layer, int timeout_ms)
{
	struct timespec t0, now;
	uint32_t v;

	if (!f->land)
		return kvbc_set_err(c, -EINVAL, "kvb_fuse_wait is for landing sessions "
				    "(kvb_fuse_open_into)");
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (unsigned spin = 0;; spin++) {
		int64_t left_ms;

		v = atomic_load_explicit(f->progress, memory_order_acquire);
		if (v & KVBP_LAND_FAILED) {
			int code = (int)(v >> 24 & 0x7f);

			return kvbc_set_err(c, -1000 - code, "the daemon stopped landing at layer "
					    "%u (%s); close the session", v & KVBP_LAND_COUNT,
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
			return kvbc_set_err(c, -ETIMEDOUT, "layer %u not landed within %d ms (%u "
					    "layers in place)", layer, timeout_ms,
					    v & KVBP_LAND_COUNT);
		{
			/* Sleep until the daemon publishes again (a shared futex), 100 ms at most. */
			struct timespec ts = { 0, 100000000 };

			if (timeout_ms >= 0 && left_ms < 100)
				ts.tv_nsec = left_ms * 1000000;
			syscall(SYS_futex, (uint32_t *)f->progress, FUTEX_WAIT, v, &ts, NULL, 0);
		}
	}
}

/*
 * The check layer request of a landing session, in its three modes: 0 rows in, the
 * selection out; 1 rows in, their deviations out (dev_out, one a row; nothing
 * selected); 2 deviations in (dev_in), the selection out.
 */
static int check_once(kvb_client *c, kvb_fuse *f, uint32_t layer, uint32_t mode,
		      const void *rows, size_t row_stride, const float *dev_in, float *dev_out,
		      const int32_t **dropped, size_t *n_dropped, bool stage, bool *staged)
{
	struct call k = { .req = { .op = KVBP_OP_FUSE_LAYER, .session_id = f->id, .layer = layer,
				   .rows = (uint32_t)f->n_rows, .check_mode = mode } };
	/* the attention metric reads K then V of each row; the others one plane (of the
	 * node's heads, for a head range) */
	size_t one = f->node_row_bytes ? f->node_row_bytes : f->row_bytes;
	size_t row = f->metric == KVB_METRIC_ATTENTION ? 2 * one : one;
	size_t stride = row_stride ? row_stride : row, span = 0;
	static const uint8_t empty[1];
	const void *ptrs[2] = { rows, f->attn };
	size_t lens[2] = { 0, f->attn_count * sizeof(float) };
	uint8_t *packed = NULL;
	struct region *r;
	int rc;

	if (dropped)
		*dropped = NULL;
	if (n_dropped)
		*n_dropped = 0;
	if (!f->land)
		return kvbc_set_err(c, -EINVAL, "kvb_fuse_check is for landing sessions "
				    "(kvb_fuse_open_into); use kvb_fuse_layer");
	if (mode == 2) {
		/* the deviations, one frame: A was sent with the deviation request */
		ptrs[0] = f->n_rows ? (const void *)dev_in : empty;
		lens[0] = f->n_rows * sizeof(float);
		k.payload = ptrs;
		k.payload_len = lens;
		k.n_payload = 1;
		goto call;
	}
	if (stride < row)
		return kvbc_set_err(c, -EINVAL, "row stride %zu is below the row size %zu", stride,
				    row);
	if (f->n_rows)
		span = (f->n_rows - 1) * stride + row;
	k.req.attention = f->attn != NULL;
	if (span && (r = kvbc_region_of(c, rows, span)) != NULL) {
		/* Read where they are: the daemon maps this region. */
		k.req.has_shm = true;
		k.req.shm_id = r->id;
		k.req.shm_offset = (uint64_t)((const uint8_t *)rows - r->base);
		k.req.shm_length = span;
		k.req.row_stride = stride;
	} else if (span && kvbc_in_shm(c, rows, span)) {
		k.req.has_shm = true;
		k.req.shm_id = c->shm_id;
		k.req.shm_offset = (uint64_t)((const uint8_t *)rows - (uint8_t *)c->shm_base);
		k.req.shm_length = span;
		k.req.row_stride = stride;
	} else if (span && stage && c->shm_ok &&
		   (c->shm_base ? c->shm_size >= f->n_rows * row
				: kvbc_shm_ensure(c, f->n_rows * row))) {
		/* Rows on the heap: staged in the client's segment, one copy (as a layer's fresh
		 * rows are), which costs less than a frame through the socket. A segment too
		 * small is not replaced here: the caller may hold pointers into it (dev_out). */
		uint8_t *to = c->shm_base;

		if (stride == row) {
			memcpy(to, rows, f->n_rows * row);
		} else {
			for (size_t i = 0; i < f->n_rows; i++)
				memcpy(to + i * row, (const uint8_t *)rows + i * stride, row);
		}
		k.req.has_shm = true;
		k.req.shm_id = c->shm_id;
		k.req.shm_offset = 0;
		k.req.shm_length = f->n_rows * row;
		k.req.row_stride = row;
		*staged = true;
	} else {
		lens[0] = f->n_rows * row;
		if (!f->n_rows) {
			ptrs[0] = empty;
		} else if (stride != row) {
			packed = malloc(lens[0]);
			if (!packed)
				return kvbc_set_err(c, -ENOMEM, "out of memory");
			for (size_t i = 0; i < f->n_rows; i++)
				memcpy(packed + i * row, (const uint8_t *)rows + i * stride, row);
			ptrs[0] = packed;
		}
	}
	/* The rows' frame (unless they are in shared memory), then A if there is one. */
	k.payload = k.req.has_shm ? ptrs + 1 : ptrs;
	k.payload_len = k.req.has_shm ? lens + 1 : lens;
	k.n_payload = (k.req.has_shm ? 0 : 1) + (f->attn != NULL);
	if (!f->attn_count && f->attn)
		ptrs[1] = empty;
call:
	rc = kvbc_call(c, &k);
	free(packed);
	if (rc)
		goto out;
	if (mode != 2) {
		free(f->attn); /* the daemon keeps it */
		f->attn = NULL;
	}
	if (mode == 1) {
		if (k.rep.n_deviation != f->n_rows) {
			rc = kvbc_set_err(c, KVB_E_PROTOCOL, "deviation reply with %zu values for %zu "
					  "rows", k.rep.n_deviation, f->n_rows);
			goto out;
		}
		if (f->n_rows)
			memcpy(dev_out, k.rep.deviation, f->n_rows * sizeof(float));
		goto out;
	}
	if (!k.rep.has_selection || k.rep.n_selection > f->tokens ||
	    k.rep.n_dropped > f->n_rows) {
		rc = kvbc_set_err(c, KVB_E_PROTOCOL, "check layer reply without a valid selection");
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
	kvbc_call_done(&k);
	return rc;
}

/* Once with heap rows staged in the segment; again in a frame if the daemon no longer
 * knew the segment (it expired while idle: nothing of the request was used). */
static int check_call(kvb_client *c, kvb_fuse *f, uint32_t layer, uint32_t mode,
		      const void *rows, size_t row_stride, const float *dev_in, float *dev_out,
		      const int32_t **dropped, size_t *n_dropped)
{
	bool staged = false;
	int rc = check_once(c, f, layer, mode, rows, row_stride, dev_in, dev_out, dropped,
			    n_dropped, true, &staged);

	if (staged && kvbc_shm_lost(c, rc, true))
		rc = check_once(c, f, layer, mode, rows, row_stride, dev_in, dev_out, dropped,
				n_dropped, false, &staged);
	return rc;
}

int kvb_fuse_check(kvb_client *c, kvb_fuse *f, uint32_t layer, const void *rows,
		   size_t row_stride, const int32_t **dropped, size_t *n_dropped)
{
	return check_call(c, f, layer, 0, rows, row_stride, NULL, NULL, dropped, n_dropped);
}

int kvb_fuse_check_deviation(kvb_client *c, kvb_fuse *f, uint32_t layer, const void *rows,
			     size_t row_stride, float *dev)
{
	if (!dev && f->n_rows)
		return kvbc_set_err(c, -EINVAL, "kvb_fuse_check_deviation needs room for %zu "
				    "deviations", f->n_rows);
	return check_call(c, f, layer, 1, rows, row_stride, NULL, dev, NULL, NULL);
}

int kvb_fuse_check_select(kvb_client *c, kvb_fuse *f, uint32_t layer, const float *dev,
			  const int32_t **dropped, size_t *n_dropped)
{
	if (!dev && f->n_rows)
		return kvbc_set_err(c, -EINVAL, "kvb_fuse_check_select needs %zu deviations",
				    f->n_rows);
	return check_call(c, f, layer, 2, NULL, 0, dev, NULL, dropped, n_dropped);
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
	const void *ptrs[3] = { k_in, v_in, f->attn };
	size_t lens[3] = { in_bytes, in_bytes, f->attn_count * sizeof(float) };
	bool shm = in_bytes && c->shm_ok && kvbc_shm_ensure(c, 2 * in_bytes);
	int rc;

	if (fused)
		*fused = 0;
	if (f->land)
		return kvbc_set_err(c, -EINVAL, "a landing session takes kvb_fuse_check() at check "
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
		/* A, if any, is the one frame */
		k.payload = ptrs + 2;
		k.payload_len = lens + 2;
		k.n_payload = f->attn != NULL;
	} else {
		k.payload = ptrs;
		k.payload_len = lens;
		k.n_payload = 2 + (f->attn != NULL);
	}
	k.req.attention = f->attn != NULL;
	rc = kvbc_call(c, &k);
	if (rc)
		goto out;
	free(f->attn); /* the daemon keeps it */
	f->attn = NULL;
	f->last = NULL;
	f->dev_last = 0;
	if (k.rep.has_fused) {
		if (k.req.device_out) {
			if (k.rep.ring_slot >= f->ring_slots) {
				rc = kvbc_set_err(c, KVB_E_PROTOCOL, "ring slot %u outside the ring",
						  k.rep.ring_slot);
				goto out;
			}
			f->dev_last = f->dev_ring + (uint64_t)k.rep.ring_slot * f->slot_bytes;
		} else if (f->ring) {
			if ((uint64_t)(k.rep.ring_slot + 1) * f->slot_bytes > f->ring_bytes) {
				rc = kvbc_set_err(c, KVB_E_PROTOCOL, "ring slot %u outside the ring",
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
			rc = kvbc_set_err(c, KVB_E_PROTOCOL, "fused layer reply of unexpected size");
			goto out;
		}
		if (fused)
			*fused = 1;
	}
	if (k.rep.has_selection) {
		if (k.rep.n_selection > f->tokens) {
			rc = kvbc_set_err(c, KVB_E_PROTOCOL, "selection larger than the session");
			goto out;
		}
		if (k.rep.n_selection)
			memcpy(f->rows, k.rep.selection, k.rep.n_selection * sizeof(int32_t));
		f->n_rows = k.rep.n_selection;
	}
	f->next_layer = k.rep.next_layer;
out:
	kvbc_call_done(&k);
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
	/*
	 * The device ring is unmapped before the close goes: the daemon frees the block
	 * when the session closes, and a block freed under a mapping is undefined
	 * behaviour (and its memory may serve a later session).
	 */
	if (f->dev_base) {
		kvb_cuda_unmap(c->cuda, f->dev_base);
		f->dev_base = f->dev_ring = f->dev_last = 0;
	}
	rc = kvbc_call(c, &k);
	if (!rc && stats && n_stats && k.rep.n_stats) {
		*stats = calloc(k.rep.n_stats, sizeof(**stats));
		for (size_t i = 0; *stats && i < k.rep.n_stats; i++) {
			snprintf((*stats)[i].name, sizeof((*stats)[i].name), "%s", k.rep.stats[i].name);
			(*stats)[i].value = k.rep.stats[i].value;
		}
		*n_stats = *stats ? k.rep.n_stats : 0;
	}
	kvbc_call_done(&k);
	if (f->ring)
		munmap((void *)f->ring, f->ring_bytes);
	if (f->land && f->region->id == f->region_id)
		f->region->used[f->word / 64] &= ~(1ull << (f->word % 64));
	free(f->rows);
	free(f->dropped);
	free(f->attn);
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
	return rc ? kvbc_set_err(c, rc, "fused layers on the GPU: %s", why) : 0;
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
