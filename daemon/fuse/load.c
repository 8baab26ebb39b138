/* fuse/load — loading a layer of stored chunks, re-rotated, into a session's ring; see fuse_impl.h. */
#include <errno.h>
#include <pthread.h>
#include <time.h>

#include "daemon/fuse/fuse_impl.h"

void rotate_rows(void *arg, const void *src, void *dst, size_t off, size_t len)
{
	struct rotate_ctx *x = arg;
	int rc;

	if (x->err)
		return;
	rc = x->be->rotate(x->be, &x->s->shape, x->rot, src, dst,
			   (uint32_t)(off / x->s->row_bytes), (uint32_t)(len / x->s->row_bytes));
	if (rc)
		x->err = rc;
}

int load_chunk(void *arg, size_t i)
{
	struct load_job *j = arg;
	struct fuse_session *s = j->s;
	struct chunk_ref *c = &s->chunks[i];
	struct rotate_ctx rx = { j->t->be, s, c, rope_table_of_layer(&s->m.desc, c->rot, j->layer),
				 0 };
	struct codec_xform x = { rotate_rows, &rx, s->row_bytes };
	int rc;

	/* One pass: verify the stored bytes and write them re-rotated into the slot. */
	rc = store_chunk_get_layer(j->t->store, &s->m, c->hash, j->layer,
				   j->slot->skip & SKIP_K ? NULL :
				   j->slot->k + (size_t)c->off * s->row_bytes,
				   j->slot->skip & SKIP_V ? NULL :
				   j->slot->v + (size_t)c->off * s->row_bytes,
				   (uint64_t)c->tokens * s->row_bytes, &x);
	if (rc == -EBADMSG)
		atomic_store(&c->corrupt, true);
	return rc ? rc : rx.err;
}

/* Load layer into slot; called without the session lock, with the slot marked LOADING. */
static int load_layer(struct fuse_table *t, struct fuse_session *s, struct slot *slot,
		      uint32_t layer)
{
	struct load_job j = { t, s, slot, layer, 0 };

	if (s->dv)
		return dev_load(t, s, slot, layer);
	return pool_run(t->pool, s->n_chunks, load_chunk, &j);
}

/*
 * Load layer into sl, with the session lock held on entry and exit (dropped while
 * loading; the slot is marked LOADING meanwhile). Returns the store errno.
 */
int load_slot_locked(struct fuse_table *t, struct fuse_session *s, struct slot *sl,
		     uint32_t layer)
{
	struct timespec t0;
	int rc;

	sl->layer = layer;
	sl->state = SLOT_LOADING;
	pthread_mutex_unlock(&s->lock);
	clock_gettime(CLOCK_MONOTONIC, &t0);
	rc = load_layer(t, s, sl, layer);
	pthread_mutex_lock(&s->lock);
	s->ns_load += ns_since(&t0);
	sl->state = rc ? SLOT_FAILED : SLOT_READY;
	sl->err = rc;
	pthread_cond_broadcast(&s->cond);
	return rc;
}

/* Make layer's slot READY (loading it here if nobody is); with the session lock held. */
int ensure_layer(struct fuse_table *t, struct fuse_session *s, uint32_t layer,
		 struct slot **out)
{
	struct slot *sl = &s->ring[(layer - s->first) % s->n_ring];

	for (;;) {
		if (sl->layer == layer && sl->state == SLOT_READY)
			break;
		if (sl->layer == layer && sl->state == SLOT_LOADING) {
			pthread_cond_wait(&s->cond, &s->lock);
			continue;
		}
		if (sl->state == SLOT_LOADING) { /* a prefetch of another layer: wait it out */
			pthread_cond_wait(&s->cond, &s->lock);
			continue;
		}
		if (load_slot_locked(t, s, sl, layer))
			break;
	}
	*out = sl;
	if (sl->state == SLOT_FAILED) {
		int rc = sl->err;

		sl->layer = -1;
		sl->state = SLOT_EMPTY;
		return rc;
	}
	return 0;
}
