/* fuse/session — the session table: its lifecycle, lookup, expiry, pins and usage; see fuse_impl.h. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/arena.h"
#include "daemon/fuse/fuse_impl.h"
#include "daemon/log.h"

int fuse_table_new(const struct fuse_limits *l, struct store *store, struct pool *pool,
		   const struct blend_backend *backend, const struct blend_device *device,
		   struct shm_table *shm, struct fuse_table **out)
{
	struct fuse_table *t = calloc(1, sizeof(*t));

	if (!t)
		return -ENOMEM;
	t->sessions = calloc(l->max_sessions ? l->max_sessions : 1, sizeof(*t->sessions));
	if (!t->sessions) {
		free(t);
		return -ENOMEM;
	}
	t->lim = *l;
	t->store = store;
	t->pool = pool;
	t->be = backend;
	t->dev = device;
	t->dev_budget = UINT64_MAX;
	if (device) {
		uint64_t held, total;

		device->memory(device, &held, &total);
		if (l->dev_max_bytes)
			t->dev_budget = l->dev_max_bytes;
		else if (total)
			t->dev_budget = total / 10 * 9;
	}
	t->shm = shm;
	pthread_mutex_init(&t->lock, NULL);
	pthread_cond_init(&t->imports_cond, NULL);
	dev_pinner_set(t, true); /* shared rings pinned once for their life, not per session */
	dev_reserve_open(t);
	*out = t;
	return 0;
}

/* ---- pins (under the table lock) ---- */

static struct pin *pin_find(struct fuse_table *t, uint32_t model_id, const uint8_t *hash)
{
	for (size_t i = 0; i < t->n_pins; i++)
		if (t->pins[i].model_id == model_id && !memcmp(t->pins[i].hash, hash, KVBP_HASH_LEN))
			return &t->pins[i];
	return NULL;
}

int pin_add(struct fuse_table *t, uint32_t model_id, const uint8_t *hash)
{
	struct pin *p = pin_find(t, model_id, hash);

	if (p) {
		p->count++;
		return 0;
	}
	if (t->n_pins == t->cap_pins) {
		size_t cap = t->cap_pins ? 2 * t->cap_pins : 64;
		struct pin *np = realloc(t->pins, cap * sizeof(*np));

		if (!np)
			return -ENOMEM;
		t->pins = np;
		t->cap_pins = cap;
	}
	p = &t->pins[t->n_pins++];
	p->model_id = model_id;
	memcpy(p->hash, hash, KVBP_HASH_LEN);
	p->count = 1;
	return 0;
}

void pin_drop(struct fuse_table *t, uint32_t model_id, const uint8_t *hash)
{
	struct pin *p = pin_find(t, model_id, hash);

	if (p && --p->count == 0)
		*p = t->pins[--t->n_pins];
}

void fuse_on_corrupt(struct fuse_table *t, void (*fn)(void *arg, uint32_t model_id,
						      const uint8_t *hash), void *arg)
{
	t->on_corrupt = fn;
	t->corrupt_arg = arg;
}

int fuse_delete_chunk(struct fuse_table *t, const struct store_model *m, const uint8_t *hash)
{
	int rc;

	/* Under the lock, so that no session pins the chunk between the check and the delete. */
	pthread_mutex_lock(&t->lock);
	rc = pin_find(t, m->id, hash) ? -EBUSY : store_chunk_delete(t->store, m, hash);
	pthread_mutex_unlock(&t->lock);
	return rc;
}

/* ---- sessions ---- */

void session_free(struct fuse_table *t, struct fuse_session *s)
{
	bool heap_ring;

	if (!s)
		return;
	heap_ring = !s->dv || !s->dv->hring; /* else a pinned block, back to the cache */
	dev_sess_free(t, s); /* first: it unpins a shared ring */
	dland_free(t, s);
	if (s->shm_id) {
		shm_release(t->shm, s->shm_id);
		shm_detach(t->shm, s->shm_id, NULL);
	} else if (heap_ring) {
		free(s->ring_mem);
	}
	if (s->land_mem)
		shm_release(t->shm, s->land_shm);
	/* Unpinned by now (session_remove): a corrupt chunk goes as a GET's would. */
	for (size_t i = 0; t->on_corrupt && s->chunks && i < s->n_chunks; i++)
		if (atomic_load(&s->chunks[i].corrupt))
			t->on_corrupt(t->corrupt_arg, s->m.id, s->chunks[i].hash);
	free(s->lay.pages);
	free(s->cslot);
	free(s->land_buf);
	for (size_t i = 0; s->chunks && i < s->n_chunks; i++) {
		rope_table_free(&s->chunks[i].rot[0]);
		rope_table_free(&s->chunks[i].rot[1]);
	}
	free(s->ring);
	free(s->chunks);
	free(s->fresh);
	free(s->sel);
	free(s->attn);
	pthread_cond_destroy(&s->cond);
	pthread_mutex_destroy(&s->lock);
	free(s);
}

/* Take session s out of the table (under the table lock): unpin, release its memory budget. */
static void session_remove(struct fuse_table *t, size_t slot)
{
	struct fuse_session *s = t->sessions[slot];

	t->sessions[slot] = NULL;
	for (size_t i = 0; i < s->n_chunks; i++)
		pin_drop(t, s->m.id, s->chunks[i].hash);
	t->bytes -= s->bytes;
	t->dev_bytes -= s->dev_bytes;
	s->closed = true;
}

void fuse_table_free(struct fuse_table **tp)
{
	struct fuse_table *t = tp ? *tp : NULL;

	if (!t)
		return;
	t->on_corrupt = NULL; /* shutting down: left to the next start's reads */
	for (uint64_t i = 0; i < t->lim.max_sessions; i++)
		if (t->sessions[i]) {
			struct fuse_session *s = t->sessions[i];

			session_remove(t, i);
			session_free(t, s);
		}
	if (t->dev) {
		dev_pinner_set(t, false);
		block_flush(t);
		block_orphans_free(t);
		dev_streams_flush(t);
		dev_reserve_close(t);
	}
	free(t->sessions);
	free(t->pins);
	pthread_cond_destroy(&t->imports_cond);
	pthread_mutex_destroy(&t->lock);
	free(t);
	*tp = NULL;
}

/* Does slot i hold session id of owner (NULL: any owner)? Under the table lock. */
static bool session_is(struct fuse_table *t, uint64_t i, uint64_t id, const char *owner)
{
	const struct fuse_session *s = t->sessions[i];

	return s && s->ready && s->id == id && (!owner || !strcmp(s->owner, owner));
}

/* Find owner's session id and take a reference (the table lock protects refs). */
struct fuse_session *session_get(struct fuse_table *t, uint64_t id, const char *owner)
{
	struct fuse_session *s = NULL;

	pthread_mutex_lock(&t->lock);
	for (uint64_t i = 0; i < t->lim.max_sessions && !s; i++)
		if (session_is(t, i, id, owner))
			s = t->sessions[i];
	if (s)
		s->refs++;
	pthread_mutex_unlock(&t->lock);
	return s;
}

void session_put(struct fuse_table *t, struct fuse_session *s)
{
	bool last;

	pthread_mutex_lock(&t->lock);
	last = --s->refs == 0 && s->closed;
	clock_gettime(CLOCK_MONOTONIC, &s->last_used);
	pthread_mutex_unlock(&t->lock);
	if (last)
		session_free(t, s);
}

uint32_t fuse_close(struct fuse_table *t, uint64_t id, const char *owner, struct kvbp_stat **stats,
		    size_t *n, char *err, size_t errlen)
{
	struct fuse_session *s = NULL;
	struct kvbp_stat *st;
	size_t k = 0;

	*stats = NULL;
	*n = 0;
	/*
	 * Take it out of the table holding a reference of our own: a layer request on
	 * another worker or the prefetch thread may hold it too, and whoever drops the
	 * last reference frees it, so the stats below must be read before ours goes.
	 */
	pthread_mutex_lock(&t->lock);
	for (uint64_t i = 0; i < t->lim.max_sessions && !s; i++)
		if (session_is(t, i, id, owner)) {
			s = t->sessions[i];
			s->refs++;
			session_remove(t, i);
		}
	pthread_mutex_unlock(&t->lock);
	if (!s)
		return fail(err, errlen, KVBP_UNKNOWN_SESSION, "fuse session %016" PRIx64 " is not "
			    "open (closed, expired, or never opened)", id);
	/* Nothing may land in the node's buffers once it has its reply: the node reuses them. */
	pthread_mutex_lock(&s->lock);
	s->land_stop = true;
	while (s->landing)
		pthread_cond_wait(&s->cond, &s->lock);
	if (s->dl) /* and nothing still on its way into the node's device memory */
		dland_quiesce(t, s, s->land_next);
	pthread_mutex_unlock(&s->lock);
	st = calloc(16, sizeof(*st));
	if (st) {
		pthread_mutex_lock(&s->lock);
#define STAT(nm, v) (snprintf(st[k].name, sizeof(st[k].name), "%s", nm), st[k++].value = (double)(v))
		STAT("tokens", s->n);
		STAT("cached_tokens", s->n_cached);
		STAT("selected_tokens", s->n_sel);
		STAT("layers_served", s->layers_served);
		STAT("load_ms", s->ns_load / 1e6);
		STAT("compute_ms", s->ns_compute / 1e6);
		STAT("lifetime_ms", ns_since(&s->opened) / 1e6); /* from open to close */
		STAT("ring_bytes", s->bytes);
		STAT("bytes_in", s->bytes_in);
		STAT("bytes_out", s->bytes_out);
		if (!s->land) /* where its layers were computed: 1 on the device */
			STAT("on_device", s->dv != NULL);
		if (s->dv && s->dv->hring) /* the pinned ring's bytes zeroed at open */
			STAT("ring_zeroed_bytes", s->dv->zeroed);
		if (s->dv) { /* 0 and 0 when its open took everything from the pools */
			STAT("device_allocs", s->dv->allocs);
			STAT("ring_registrations", s->dv->reg_fresh);
		}
		if (s->land) {
			STAT("land_ms", s->ns_land / 1e6);
			STAT("layers_landed", s->land_next - s->land_begin);
			STAT("land_failed", s->land_code != 0);
		}
#undef STAT
		pthread_mutex_unlock(&s->lock);
		*stats = st;
		*n = k;
	}
	session_put(t, s);
	return KVBP_OK;
}

unsigned fuse_expire(struct fuse_table *t)
{
	struct timespec now;
	unsigned n = 0;

	/* Freed after the lock is dropped: a session's device blocks go back under it. */
	struct fuse_session **gone = calloc(t->lim.max_sessions + 1, sizeof(*gone));

	if (!gone)
		return 0;
	clock_gettime(CLOCK_MONOTONIC, &now);
	pthread_mutex_lock(&t->lock);
	for (uint64_t i = 0; i < t->lim.max_sessions; i++) {
		struct fuse_session *s = t->sessions[i];

		if (!s || !s->ready || s->refs || (uint64_t)(now.tv_sec - s->last_used.tv_sec) < t->lim.idle_s)
			continue;
		log_info("fuse session %016" PRIx64 " idle for %" PRIu64 " s: released", s->id,
			 (uint64_t)(now.tv_sec - s->last_used.tv_sec));
		s->expired = true;
		session_remove(t, i);
		gone[n++] = s;
	}
	pthread_mutex_unlock(&t->lock);
	for (unsigned i = 0; i < n; i++)
		session_free(t, gone[i]);
	free(gone);
	block_reap(t); /* device memory sessions gave up since the last call */
	block_spares(t); /* and blocks for the next sessions, off their path */
	if (t->dev && t->shm)
		shm_reap(t->shm); /* pinned rings released (on the socket thread too) */
	return n;
}

void fuse_device_counts(struct fuse_table *t, struct fuse_device_counts *c)
{
	memset(c, 0, sizeof(*c));
	if (!t->dev)
		return;
	c->allocs = atomic_load(&t->n_allocs);
	c->registrations = atomic_load(&t->n_registrations);
	c->unregistrations = atomic_load(&t->n_unregistrations);
	c->spares = atomic_load(&t->n_spares);
	pthread_mutex_lock(&t->lock);
	for (int host = 0; host < 2; host++) {
		size_t used = 0, bytes = 0;

		if (t->arena[host])
			arena_usage(t->arena[host], &used, &bytes);
		c->reserve_used[host] = used;
		c->reserve_bytes = bytes;
	}
	pthread_mutex_unlock(&t->lock);
	if (t->shm) {
		uint64_t pins, unpins;

		shm_pin_counts(t->shm, &c->pinned_rings, &pins, &unpins);
	}
}

uint64_t fuse_device_fallbacks(struct fuse_table *t)
{
	uint64_t n;

	pthread_mutex_lock(&t->lock);
	n = t->dev_fallbacks;
	pthread_mutex_unlock(&t->lock);
	return n;
}

void fuse_usage(struct fuse_table *t, uint64_t *sessions, uint64_t *bytes, uint64_t *pins)
{
	uint64_t n = 0;

	pthread_mutex_lock(&t->lock);
	for (uint64_t i = 0; i < t->lim.max_sessions; i++)
		n += t->sessions[i] && t->sessions[i]->ready;
	*sessions = n;
	*bytes = t->bytes;
	*pins = t->n_pins;
	pthread_mutex_unlock(&t->lock);
}
