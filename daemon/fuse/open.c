/*
 * fuse/open — fuse_open, in the steps it takes: check the request, pin and look up
 * its chunks, build the rotation tables, size the session, reserve its memory and a
 * table slot, set up its landing target or ring (and the ring on the device), then
 * publish it. See fuse.h for the contract, fuse_impl.h for the modules it drives.
 */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/random.h>
#include <time.h>

#include "common/ckd.h"
#include "daemon/fuse/fuse_impl.h"
#include "daemon/log.h"

/* What the steps of one open work out and hand on. */
struct open_plan {
	size_t n_chunks;      /* chunk segments in the request */
	uint64_t n;	      /* tokens */
	uint64_t max_pos_end; /* one past the last position the prompt spans */
	uint64_t ring_bytes;  /* the ring (or, landing, the check and staging slots) */
	uint64_t charge;      /* what the session is charged against fuse_max_bytes */
	uint64_t dev_charge;  /* and against the device budget (its device block) */
	uint64_t land_host, land_dev; /* landing into device memory: its staging */
	size_t slot;	      /* its reserved place in the table */
};

/* The request itself: check layers, ratios, metric, segments. Counts the chunk segments. */
static uint32_t open_check_request(const struct store_model *m, const struct kvbp_request *q,
				   struct open_plan *p, char *err, size_t errlen)
{
	if (!q->n_segments)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "fuse_open needs at least one segment");
	if (!q->n_checks && !q->reuse_only)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "fuse_open needs at least one check layer "
			    "(or reuse_only, for plain reuse)");
	if (q->n_checks && q->reuse_only)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "a reuse_only session has no check "
			    "layers; got %zu", q->n_checks);
	if (q->n_ratios != q->n_checks)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "%zu check layers but %zu ratios; give one "
			    "ratio per check layer", q->n_checks, q->n_ratios);
	for (size_t i = 0; i < q->n_checks; i++) {
		if (q->check_layers[i] >= m->desc.num_layers)
			return fail(err, errlen, KVBP_BAD_ARGUMENT, "check layer %" PRIu32 " is not a "
				    "layer of the %" PRIu32 "-layer model", q->check_layers[i],
				    m->desc.num_layers);
		if (i && q->check_layers[i] <= q->check_layers[i - 1])
			return fail(err, errlen, KVBP_BAD_ARGUMENT, "check layers must increase; got "
				    "%" PRIu32 " after %" PRIu32, q->check_layers[i],
				    q->check_layers[i - 1]);
		if (!(q->ratios[i] >= 0 && q->ratios[i] <= 1))
			return fail(err, errlen, KVBP_BAD_ARGUMENT, "ratio %g is not in [0, 1]",
				    q->ratios[i]);
		if (i && q->ratios[i] > q->ratios[i - 1])
			return fail(err, errlen, KVBP_BAD_ARGUMENT, "ratios must not increase; got %g "
				    "after %g", q->ratios[i], q->ratios[i - 1]);
	}
	if (q->metric > KVBP_METRIC_ATTENTION)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "metric %" PRIu32 " unknown; expected 0 "
			    "(value), 1 (key) or 2 (attention)", q->metric);
	if (q->n_recompute && !q->reuse_only)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "recompute names the tokens of a session "
			    "without check layers (reuse_only); this one has %zu", q->n_checks);
	for (size_t i = 0; i < q->n_segments; i++) {
		const struct kvbp_segment *g = &q->segments[i];

		if (g->fresh && !g->count)
			return fail(err, errlen, KVBP_BAD_SHAPE, "segment %zu: fresh segment of 0 "
				    "tokens", i);
		if (!g->fresh && g->count)
			return fail(err, errlen, KVBP_BAD_ARGUMENT, "segment %zu: a chunk segment "
				    "takes its token count from the chunk; count must be 0", i);
		p->n_chunks += !g->fresh;
	}
	return KVBP_OK;
}

/* The new session s (zeroed) from the request: owner, checks, and room for its chunks. */
static uint32_t open_session_init(struct fuse_session *s, const struct store_model *m,
				  const struct kvbp_request *q, const char *owner,
				  const struct open_plan *p, struct fuse_open_result *r, char *err,
				  size_t errlen)
{
	pthread_mutex_init(&s->lock, NULL);
	pthread_cond_init(&s->cond, NULL);
	s->m = *m;
	snprintf(s->owner, sizeof(s->owner), "%s", owner);
	s->metric = q->metric;
	s->n_checks = q->n_checks;
	if (q->n_checks) {
		memcpy(s->checks, q->check_layers, q->n_checks * sizeof(uint32_t));
		memcpy(s->ratios, q->ratios, q->n_checks * sizeof(double));
	}
	s->first = s->n_checks ? s->checks[0] : 0;
	s->next_layer = s->first;
	s->chunks = calloc(p->n_chunks ? p->n_chunks : 1, sizeof(*s->chunks));
	r->missing = calloc(p->n_chunks ? p->n_chunks : 1, KVBP_HASH_LEN);
	if (!s->chunks || !r->missing)
		return fail(err, errlen, KVBP_LIMIT, "out of memory");
	return KVBP_OK;
}

/* Pin every chunk of the request, or none. */
static uint32_t open_pin(struct fuse_table *t, const struct store_model *m,
			 const struct kvbp_request *q, char *err, size_t errlen)
{
	int rc;

	/* Pin first, then look up: a chunk deleted in between shows as missing. */
	pthread_mutex_lock(&t->lock);
	rc = 0;
	for (size_t i = 0; i < q->n_segments && !rc; i++)
		if (!q->segments[i].fresh)
			rc = pin_add(t, m->id, q->segments[i].hash);
	if (rc) {
		for (size_t i = 0; i < q->n_segments; i++)
			if (!q->segments[i].fresh)
				pin_drop(t, m->id, q->segments[i].hash);
	}
	pthread_mutex_unlock(&t->lock);
	if (rc)
		return fail(err, errlen, KVBP_LIMIT, "out of memory");
	return KVBP_OK;
}

/*
 * Look up the request's chunks (the missing ones into r->missing) and lay out the
 * session's tokens: chunk offsets, token and position counts within the limits.
 */
static uint32_t open_resolve_chunks(struct fuse_table *t, const struct store_model *m,
				    const struct kvbp_request *q, struct fuse_session *s,
				    struct open_plan *p, struct fuse_open_result *r, char *err,
				    size_t errlen)
{
	int rc;

	for (size_t i = 0; i < q->n_segments; i++) {
		const struct kvbp_segment *g = &q->segments[i];
		uint64_t count = g->count, end;

		if (!g->fresh) {
			struct store_chunk_info ci;

			rc = store_chunk_info(t->store, m, g->hash, &ci);
			if (rc == -ENOENT) {
				memcpy(r->missing[r->n_missing++], g->hash, KVBP_HASH_LEN);
				continue;
			}
			if (rc)
				return fail(err, errlen, rc == -EBADMSG ? KVBP_CORRUPT : KVBP_INTERNAL,
					    "lookup failed: %s", rc == -EBADMSG ?
					    "a chunk record failed its checksum" : strerror(-rc));
			count = ci.num_tokens;
			memcpy(s->chunks[s->n_chunks].hash, g->hash, KVBP_HASH_LEN);
			s->chunks[s->n_chunks].off = (uint32_t)p->n;
			s->chunks[s->n_chunks].tokens = ci.num_tokens;
			s->chunks[s->n_chunks].base_pos = ci.base_pos;
			s->n_chunks++;
			s->n_cached += ci.num_tokens;
		}
		if (ckd_add(&end, (uint64_t)g->pos, count) || end > UINT32_MAX)
			return fail(err, errlen, KVBP_BAD_SHAPE, "segment %zu: positions %" PRIu32
				    "+%" PRIu64 " overflow", i, g->pos, count);
		if (end > p->max_pos_end)
			p->max_pos_end = end;
		p->n += count;
		if (p->n > t->lim.max_tokens)
			return fail(err, errlen, KVBP_LIMIT, "the session would hold more than "
				    "fuse_max_tokens %" PRIu64 " tokens", t->lim.max_tokens);
	}
	if (r->n_missing)
		return fail(err, errlen, KVBP_NOT_FOUND, "%zu of %zu chunks are not stored; prefill "
			    "and store them, then open again", r->n_missing, p->n_chunks);
	return KVBP_OK;
}

/*
 * The selection of a session without check layers: its fresh tokens and the cached
 * tokens the node said it recomputes (q->recompute: increasing prompt indices of
 * cached tokens), merged in order.
 */
static uint32_t open_recompute(const struct kvbp_request *q, struct fuse_session *s, char *err,
			       size_t errlen)
{
	size_t fi = 0, n = 0;

	for (size_t i = 0; i < q->n_recompute; i++) {
		int32_t t = q->recompute[i];

		if (t < 0 || (uint32_t)t >= s->n)
			return fail(err, errlen, KVBP_BAD_ARGUMENT, "recompute[%zu] = %" PRId32 " is "
				    "not a token of the %" PRIu32 "-token prompt", i, t, s->n);
		if (i && t <= q->recompute[i - 1])
			return fail(err, errlen, KVBP_BAD_ARGUMENT, "recompute must increase; got %"
				    PRId32 " after %" PRId32, t, q->recompute[i - 1]);
		while (fi < s->n_fresh && s->fresh[fi] < t)
			s->sel[n++] = s->fresh[fi++];
		if (fi < s->n_fresh && s->fresh[fi] == t)
			return fail(err, errlen, KVBP_BAD_ARGUMENT, "recompute[%zu] = %" PRId32 " is a "
				    "fresh token (computed anyway); name cached tokens only", i, t);
		s->sel[n++] = t;
	}
	while (fi < s->n_fresh)
		s->sel[n++] = s->fresh[fi++];
	s->n_sel = n;
	return KVBP_OK;
}

/*
 * The session's shape, its fresh tokens, and a rotation table per chunk; for reuse
 * only, the first selection.
 */
static uint32_t open_rotation_tables(const struct store_model *m, const struct kvbp_request *q,
				     struct fuse_session *s, const struct open_plan *p, char *err,
				     size_t errlen)
{
	struct rope_config rc_cfg;
	uint64_t n = p->n;
	int rc;

	rope_config_from_desc(&m->desc, false, &rc_cfg);
	s->n = (uint32_t)n;
	s->shape.heads = m->desc.num_kv_heads;
	s->shape.head_dim = m->desc.head_dim;
	s->shape.rotary_dim = rc_cfg.rotary_dim;
	s->shape.style = rc_cfg.style;
	s->shape.dtype = (enum blend_dtype)m->desc.dtype;
	s->row_bytes = (size_t)m->desc.num_kv_heads * m->desc.head_dim * m->elem_size;
	/* Rotation tables; chunk i's token t sits at the position of its segment plus t. */
	{
		size_t ci = 0;

		s->fresh = malloc((n - s->n_cached + 1) * sizeof(int32_t));
		s->sel = malloc((n + 1) * sizeof(int32_t));
		if (!s->fresh || !s->sel)
			return fail(err, errlen, KVBP_LIMIT, "out of memory");
		for (size_t i = 0, row = 0; i < q->n_segments; i++) {
			const struct kvbp_segment *g = &q->segments[i];

			if (g->fresh) {
				for (uint32_t k = 0; k < g->count; k++)
					s->fresh[s->n_fresh++] = (int32_t)(row + k);
				row += g->count; /* ckd-ok: row + count <= n, counted above */
				continue;
			}
			{
				struct chunk_ref *c = &s->chunks[ci++];

				/* Dynamic NTK: the chunk was prefilled alone (a sequence of
				 * base_pos + T positions); the fused prompt spans max_pos_end. */
				rc = rope_tables_for_desc(&m->desc, c->tokens, c->base_pos,
							  (uint64_t)c->base_pos + c->tokens, g->pos,
							  p->max_pos_end, c->rot);
				if (rc)
					return fail(err, errlen, KVBP_INTERNAL, "rotation table: %s",
						    strerror(-rc));
				row += c->tokens;
			}
		}
	}
	/* Reuse only: the fresh tokens (and those the node recomputes) are the selection. */
	if (!s->n_checks)
		return open_recompute(q, s, err, errlen);
	return KVBP_OK;
}

/*
 * Size the session: a landing session's target and slots, or the ring (and, with a
 * device, the session's device block). Sets p->ring_bytes.
 */
static uint32_t open_size(struct fuse_table *t, const struct store_model *m,
			  const struct kvbp_request *q, const char *owner, struct fuse_session *s,
			  struct open_plan *p, char *err, size_t errlen)
{
	uint64_t n = p->n;
	uint32_t code;

	if (q->has_land) {
		code = land_setup(t, s, &q->land, owner, err, errlen);
		if (code)
			return code;
		/* No ring: a slot per check layer. Other layers go from the store to the
		 * node's buffers in one pass (land.c), however the node lays them out. */
		p->ring_bytes = (uint64_t)s->n_checks * 2 * n * s->row_bytes;
		dland_bytes(s, &p->land_host, &p->land_dev);
		return KVBP_OK;
	}
	/* The ring: re-rotated stored K and V of a few layers, all tokens each. */
	s->n_ring = (uint32_t)(t->lim.ring < m->desc.num_layers - s->first
				       ? t->lim.ring
				       : m->desc.num_layers - s->first) + 1;
	p->ring_bytes = (uint64_t)s->n_ring * 2 * n * s->row_bytes;
	if (t->dev && s->metric == KVBP_METRIC_ATTENTION) {
		/* The device path selects by HKVD only: this session runs on the host path. */
	} else if (t->dev && !dev_usable(t)) {
		pthread_mutex_lock(&t->lock);
		t->dev_fallbacks++;
		pthread_mutex_unlock(&t->lock);
	} else if (t->dev && (t->lim.dev_host || q->device_out)) {
		/* And the same ring on the device, with room for the node's rows (a node that
		 * takes its layers in host memory only where dev_host allows: per session). */
		s->dv = calloc(1, sizeof(*s->dv));
		if (s->dv)
			s->dv->tabs = calloc(rot_kinds(s) * (s->n_chunks + 1),
					     sizeof(*s->dv->tabs));
		if (!s->dv || !s->dv->tabs)
			return fail(err, errlen, KVBP_LIMIT, "out of memory");
		s->dv->slot_bytes = 2 * n * s->row_bytes;
		s->dv->scratch_bytes = t->dev->select_scratch(t->dev, n);
		if (!s->dv->scratch_bytes) {
			char why[160];

			return fail(err, errlen, KVBP_INTERNAL, "top-k scratch: %s",
				    compute_error(t, DEV_FAILED, why, sizeof(why)));
		}
		s->dv->blk_bytes = dev_layout(s, s->dv, NULL);
	}
	return KVBP_OK;
}

/*
 * Charge the session's memory and reserve its place in the table (not findable
 * until it has an id), within fuse_max_bytes, the owner's and the table's limits.
 */
static uint32_t open_reserve(struct fuse_table *t, const char *owner, struct fuse_session *s,
			     struct open_plan *p, char *err, size_t errlen)
{
	uint64_t charge;
	size_t slot_i = SIZE_MAX;

	/* The ring counts against fuse_max_bytes, the device block against the device's
	 * budget; a session whose block does not fit there runs on the host path. */
	charge = p->ring_bytes + p->land_host; /* ckd-ok: both sized from n < 2^32 rows */
	pthread_mutex_lock(&t->lock);
	if (t->bytes + charge > t->lim.max_bytes) {
		pthread_mutex_unlock(&t->lock);
		return fail(err, errlen, KVBP_LIMIT, "fuse sessions would hold %" PRIu64 " bytes; "
			    "fuse_max_bytes is %" PRIu64, t->bytes + charge, t->lim.max_bytes);
	}
	if (p->land_dev && t->dev_bytes + p->land_dev > t->dev_budget) {
		pthread_mutex_unlock(&t->lock);
		return fail(err, errlen, KVBP_LIMIT, "landing into device memory: its staging of %"
			    PRIu64 " bytes would pass the device budget (%" PRIu64 " held of %"
			    PRIu64 ")", p->land_dev, t->dev_bytes, t->dev_budget);
	}
	{
		uint64_t held = 0;

		for (uint64_t i = 0; i < t->lim.max_sessions; i++)
			held += t->sessions[i] && !strcmp(t->sessions[i]->owner, owner);
		if (held >= t->lim.per_owner) {
			pthread_mutex_unlock(&t->lock);
			return fail(err, errlen, KVBP_LIMIT, "this client holds %" PRIu64 " open fuse "
				    "sessions (client_fuse_sessions); close one first", held);
		}
	}
	for (uint64_t i = 0; i < t->lim.max_sessions && slot_i == SIZE_MAX; i++)
		if (!t->sessions[i])
			slot_i = i;
	if (slot_i == SIZE_MAX) {
		pthread_mutex_unlock(&t->lock);
		return fail(err, errlen, KVBP_LIMIT, "%" PRIu64 " fuse sessions are open; that is "
			    "fuse_max_sessions", t->lim.max_sessions);
	}
	t->bytes += charge;
	s->bytes = charge;
	t->sessions[slot_i] = s; /* reserved; not findable until it has an id */
	p->dev_charge = 0;
	if (s->dv && t->dev_bytes + s->dv->blk_bytes > t->dev_budget) {
		t->dev_fallbacks++;
		dev_drop(s);
	} else if (s->dv) {
		t->dev_bytes += s->dv->blk_bytes;
		s->dev_bytes = p->dev_charge = s->dv->blk_bytes;
	} else if (p->land_dev) {
		t->dev_bytes += p->land_dev;
		s->dev_bytes = p->dev_charge = p->land_dev;
	}
	pthread_mutex_unlock(&t->lock);
	p->charge = charge;
	p->slot = slot_i;
	return KVBP_OK;
}

/* Give back what open_reserve() took (a later step failed). */
static void open_unreserve(struct fuse_table *t, const struct open_plan *p)
{
	pthread_mutex_lock(&t->lock);
	t->sessions[p->slot] = NULL;
	t->bytes -= p->charge;
	t->dev_bytes -= p->dev_charge;
	pthread_mutex_unlock(&t->lock);
}

/*
 * The session's device half given up before it ran (the device budget is full, or
 * its memory short): the session runs on the host path. With the device setup
 * begun, dev_sess_free() gives back what it took.
 */
static void open_to_host(struct fuse_table *t, struct fuse_session *s, struct open_plan *p)
{
	bool hring = s->dv && s->dv->hring && s->ring_mem == s->dv->hring;

	dev_sess_free(t, s);
	if (hring)
		s->ring_mem = NULL; /* went back with the device half; the host path allocates */
	pthread_mutex_lock(&t->lock);
	t->dev_bytes -= p->dev_charge;
	s->dev_bytes = p->dev_charge = 0;
	t->dev_fallbacks++;
	pthread_mutex_unlock(&t->lock);
}

/*
 * The ring on the device (s->dv): dev_sess_setup(), then the session charged what it
 * holds. Short of device memory the session goes to the host path (s->dv NULL, and
 * KVBP_OK); on another failure the reservation is given back.
 */
static uint32_t open_ring_device(struct fuse_table *t, const struct kvbp_request *q,
				 struct fuse_session *s, struct open_plan *p, char *err,
				 size_t errlen)
{
	int rc = dev_sess_setup(t, s, p->ring_bytes, q->device_out && t->dev->ipc_export);

	if (!rc) {
		/* Cached blocks may be larger than asked: charge what the session holds. */
		uint64_t held = (s->dv->hring ? s->dv->hring_bytes : p->ring_bytes) +
				s->dv->hstage_bytes;
		uint64_t dheld = s->dv->blk_bytes;

		pthread_mutex_lock(&t->lock);
		if (t->bytes - p->charge + held > t->lim.max_bytes) {
			rc = -ENOSPC;
		} else if (t->dev_bytes - p->dev_charge + dheld > t->dev_budget) {
			rc = -ENOMEM; /* a cached block larger than the budget has room for */
		} else {
			t->bytes = t->bytes - p->charge + held;
			p->charge = held;
			s->bytes = held;
			t->dev_bytes = t->dev_bytes - p->dev_charge + dheld;
			p->dev_charge = dheld;
			s->dev_bytes = dheld;
		}
		pthread_mutex_unlock(&t->lock);
	}
	if (rc == -ENOMEM) {
		open_to_host(t, s, p);
		return KVBP_OK;
	}
	if (rc) {
		char why[160];

		open_unreserve(t, p);
		if (rc == -ENOSPC)
			return fail(err, errlen, KVBP_LIMIT, "fuse sessions would hold more than "
				    "fuse_max_bytes %" PRIu64 " with this session's pinned "
				    "ring", t->lim.max_bytes);
		return fail(err, errlen, KVBP_INTERNAL, "the session's ring on the device: %s",
			    compute_error(t, rc, why, sizeof(why)));
	}
	block_trim(t); /* the cache gives way to open sessions */
	return KVBP_OK;
}

/* Export the device ring to the node (CUDA IPC) when asked; a failure is only logged. */
static void open_export(struct fuse_table *t, const struct kvbp_request *q, struct fuse_session *s,
			struct fuse_open_result *r)
{
	int rc;

	if (s->dv && q->device_out && t->dev->ipc_export) {
		struct dev_sess *d = s->dv;

		/* The block was zeroed before anything was put in it (dev_sess_setup). Without
		 * an export the node takes the layers from host memory. */
		rc = t->dev->ipc_export(t->dev, d->blk, r->ipc_handle, r->device_pci,
					sizeof(r->device_pci));
		if (!rc) {
			d->exported = true;
			r->has_ipc = true;
			r->ipc_offset = (uint64_t)(d->ring - d->blk);
		} else {
			char why[160];

			log_warn("fuse session: cannot export its device ring: %s",
				 compute_error(t, dev_rc(rc), why, sizeof(why)));
		}
	}
}

/*
 * The ring: one more slot than the layers loaded ahead, for the layer the node
 * is reading. Shared when the client asked and shared memory allows; zeroed, as
 * fresh tokens' rows are read by deviation but never served from the store.
 * On failure the reservation is given back.
 */
static uint32_t open_ring(struct fuse_table *t, const struct kvbp_request *q, const char *owner,
			  struct fuse_session *s, struct open_plan *p, struct fuse_open_result *r,
			  char *err, size_t errlen)
{
	uint64_t n = p->n;
	uint32_t code;

	s->ring = calloc(s->n_ring, sizeof(*s->ring));
	if (s->ring && q->shared_ring) {
		uint64_t sid;

		if (shm_create_ring(t->shm, p->ring_bytes, owner, &sid, &r->shm_size) == 0) {
			void *base = NULL;

			if (shm_hold(t->shm, sid, &base) == 0) {
				s->shm_id = sid;
				s->ring_mem = base;
			} else {
				shm_detach(t->shm, sid, NULL);
			}
		}
	}
	if (s->ring && s->dv) {
		code = open_ring_device(t, q, s, p, err, errlen);
		if (code)
			return code;
	}
	if (s->ring && !s->ring_mem) /* the host path (also a session the device had no room for) */
		s->ring_mem = calloc(1, p->ring_bytes);
	if (!s->ring || !s->ring_mem) {
		open_unreserve(t, p);
		return fail(err, errlen, KVBP_LIMIT, "out of memory for the session ring");
	}
	for (uint32_t i = 0; i < s->n_ring; i++) {
		s->ring[i].layer = -1;
		s->ring[i].k = s->ring_mem + (uint64_t)i * 2 * n * s->row_bytes;
		s->ring[i].v = s->ring[i].k + (uint64_t)n * s->row_bytes;
	}
	open_export(t, q, s, r);
	return KVBP_OK;
}

/* The session is set up: give it an id, make it findable, and fill in the reply. */
static void open_publish(struct fuse_table *t, const struct store_model *m,
			 struct fuse_session *s, const struct open_plan *p,
			 struct fuse_open_result *r)
{
	s->served = -1;
	clock_gettime(CLOCK_MONOTONIC, &s->opened);
	s->last_used = s->opened;
	{
		uint64_t id = 0;

		/* Unguessable, so that one client cannot drive another's session. */
		if (getrandom(&id, sizeof(id), 0) != sizeof(id) || !id)
			id = (uint64_t)(uintptr_t)s ^ ((uint64_t)s->opened.tv_nsec << 20) ^ 1;
		pthread_mutex_lock(&t->lock);
		s->id = id;
		s->ready = true;
		pthread_mutex_unlock(&t->lock);
	}
	r->id = s->id;
	r->num_tokens = s->n;
	r->next_layer = s->next_layer;
	r->rows_next = s->n_checks ? s->n : (uint32_t)s->n_sel;
	r->ring_slots = s->n_ring;
	if (s->land) {
		/* Layers before land_begin are the node's own: in place from the start. */
		land_publish(s, s->land_begin);
		r->next_layer = s->n_checks ? s->checks[0] : m->desc.num_layers;
		r->rows_next = s->n_checks ? s->n : 0;
		r->land_k_strided = s->lay.k_dim_stride != 0;
		r->land_heads = true; /* head_begin and head_count are read (land_setup) */
	}
	r->slot_bytes = s->land ? 0 : 2 * (uint64_t)p->n * s->row_bytes;
	if (!s->n_checks) {
		r->rows = malloc((s->n_sel + 1) * sizeof(int32_t));
		if (r->rows) {
			memcpy(r->rows, s->sel, s->n_sel * sizeof(int32_t));
			r->n_rows = s->n_sel;
		}
	}
	r->shm_id = s->shm_id;
	if (!s->shm_id)
		r->shm_size = 0;
	free(r->missing);
	r->missing = NULL;
}

uint32_t fuse_open(struct fuse_table *t, const struct store_model *m, const struct kvbp_request *q,
		   const char *owner, struct fuse_open_result *r, char *err, size_t errlen)
{
	struct fuse_session *s = NULL;
	struct open_plan p = { 0 };
	uint32_t code = KVBP_OK;
	bool pinned = false;

	memset(r, 0, sizeof(*r));
	code = open_check_request(m, q, &p, err, errlen);
	if (code)
		return code;
	s = calloc(1, sizeof(*s));
	if (!s)
		return fail(err, errlen, KVBP_LIMIT, "out of memory");
	code = open_session_init(s, m, q, owner, &p, r, err, errlen);
	if (code)
		goto fail;
	code = open_pin(t, m, q, err, errlen);
	if (code)
		goto fail;
	pinned = true;
	code = open_resolve_chunks(t, m, q, s, &p, r, err, errlen);
	if (!code)
		code = open_rotation_tables(m, q, s, &p, err, errlen);
	if (!code)
		code = open_size(t, m, q, owner, s, &p, err, errlen);
	if (!code)
		code = open_reserve(t, owner, s, &p, err, errlen);
	if (code)
		goto fail;
	if (s->land) {
		if (land_alloc(s, p.ring_bytes)) {
			open_unreserve(t, &p);
			code = fail(err, errlen, KVBP_LIMIT, "out of memory for the session");
			goto fail;
		}
		if (s->dl && (code = dland_alloc(t, s, err, errlen))) {
			open_unreserve(t, &p);
			goto fail;
		}
	} else {
		code = open_ring(t, q, owner, s, &p, r, err, errlen);
		if (code)
			goto fail;
	}
	open_publish(t, m, s, &p, r);
	return KVBP_OK;
fail:
	if (pinned) {
		pthread_mutex_lock(&t->lock);
		for (size_t i = 0; i < q->n_segments; i++)
			if (!q->segments[i].fresh)
				pin_drop(t, m->id, q->segments[i].hash);
		pthread_mutex_unlock(&t->lock);
	}
	if (!r->n_missing) {
		free(r->missing);
		r->missing = NULL;
	}
	session_free(t, s);
	return code;
}
