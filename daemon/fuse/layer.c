/* fuse/layer — what an open session serves: prefetch after a reply, layer and check requests; see fuse_impl.h. */
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/fuse/fuse_impl.h"
#include "blend/hkvd.h"
#include "daemon/log.h"
#include "blend/qsel.h"

bool fuse_prefetch(struct fuse_table *t, uint64_t id)
{
	struct fuse_session *s = session_get(t, id, NULL);

	if (!s)
		return false;
	if (s->land) {
		bool more = land_step(t, s);

		session_put(t, s);
		return more;
	}
	pthread_mutex_lock(&s->lock);
	/* n_ring - 1 layers ahead: one slot holds the layer the node is reading. */
	for (uint32_t l = s->next_layer; !s->closed && l < s->m.desc.num_layers &&
					 l < s->next_layer + s->n_ring - 1; l++) {
		struct slot *sl = &s->ring[(l - s->first) % s->n_ring];

		if (sl->layer == l || sl->state == SLOT_LOADING || sl->state == SLOT_SERVED)
			continue;
		if (load_slot_locked(t, s, sl, l))
			break;
	}
	pthread_mutex_unlock(&s->lock);
	session_put(t, s);
	return false;
}

/* ---- one layer ---- */

/* Bytes of A for s: float32 [chunk tokens, kv_heads] with the attention metric, else 0. */
static uint64_t attn_bytes(const struct fuse_session *s)
{
	return s->metric == KVBP_METRIC_ATTENTION ? 4 * (uint64_t)s->n_cached * s->shape.heads : 0;
}

/*
 * A request's A (in: attn_bytes(s) bytes, any alignment, or NULL) checked and copied
 * to *out (malloc'd; NULL when in is).
 */
static uint32_t attn_take(const struct fuse_session *s, const void *in, float **out, char *err,
			  size_t errlen)
{
	size_t count = (size_t)s->n_cached * s->shape.heads;
	float *a;
	long bad;

	*out = NULL;
	if (!in)
		return KVBP_OK;
	if (s->metric != KVBP_METRIC_ATTENTION)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "this session's metric is %s: only the "
			    "attention metric takes A", s->metric ? "key" : "value");
	a = malloc((count + 1) * sizeof(float));
	if (!a)
		return fail(err, errlen, KVBP_LIMIT, "out of memory");
	memcpy(a, in, count * sizeof(float));
	bad = qsel_first_bad(a, count);
	if (bad >= 0) {
		float x = a[bad];

		free(a);
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "A[token %ld, head %ld] is %g: attention "
			    "weights must be finite and >= 0", bad / (long)s->shape.heads,
			    bad % (long)s->shape.heads, (double)x);
	}
	*out = a;
	return KVBP_OK;
}

uint32_t fuse_layer_begin(struct fuse_table *t, uint64_t id, const char *owner, uint32_t layer,
			  struct fuse_session **sp, struct fuse_layer_plan *plan, char *err,
			  size_t errlen)
{
	struct fuse_session *s = session_get(t, id, owner);
	bool is_check;

	if (!s)
		return fail(err, errlen, KVBP_UNKNOWN_SESSION, "fuse session %016" PRIx64 " is not "
			    "open (closed, expired, or never opened)", id);
	pthread_mutex_lock(&s->lock);
	while (s->busy)
		pthread_cond_wait(&s->cond, &s->lock);
	if (s->land && s->next_check >= s->n_checks) {
		bool reuse = !s->n_checks;

		pthread_mutex_unlock(&s->lock);
		session_put(t, s);
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "%s: its layers land in the node's "
			    "buffers by themselves (wait on the progress word)", reuse ?
			    "a reuse-only session takes no layer requests" : "every check layer "
			    "of this session is done");
	}
	if (s->land && layer != s->checks[s->next_check]) {
		uint32_t want = s->checks[s->next_check];

		pthread_mutex_unlock(&s->lock);
		session_put(t, s);
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "layer %" PRIu32 " is not the session's "
			    "next check layer %" PRIu32 ": only check layers take requests; the "
			    "others land in the node's buffers", layer, want);
	}
	if (s->land) {
		/* A check layer: the rows of the metric's plane in, the selection out. */
		s->busy = true;
		memset(plan, 0, sizeof(*plan));
		plan->rows_in = s->next_check == 0 ? s->n : (uint32_t)s->n_sel;
		plan->row_bytes = s->row_bytes;
		plan->num_tokens = s->n;
		plan->selection_out = true;
		plan->land = true;
		plan->check_row_bytes = s->metric == KVBP_METRIC_ATTENTION ? 2 * s->row_bytes
									   : s->row_bytes;
		if (s->land_hn < s->m.desc.num_kv_heads) /* a rank's rows: its heads only */
			plan->check_row_bytes =
				(size_t)s->land_hn * s->m.desc.head_dim * s->m.elem_size;
		plan->head_range = s->land_hn < s->m.desc.num_kv_heads;
		plan->attn = s->metric == KVBP_METRIC_ATTENTION;
		plan->attn_bytes = attn_bytes(s);
		pthread_mutex_unlock(&s->lock);
		*sp = s;
		return KVBP_OK;
	}
	if (layer < s->first) {
		pthread_mutex_unlock(&s->lock);
		session_put(t, s);
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "layer %" PRIu32 " comes before the first "
			    "check layer %" PRIu32 ": the node prefills it alone", layer, s->first);
	}
	if (s->next_layer >= s->m.desc.num_layers) {
		pthread_mutex_unlock(&s->lock);
		session_put(t, s);
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "every layer has been served; close the "
			    "session");
	}
	if (layer != s->next_layer) {
		uint32_t want = s->next_layer;

		pthread_mutex_unlock(&s->lock);
		session_put(t, s);
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "layer %" PRIu32 " out of order; the "
			    "session expects layer %" PRIu32, layer, want);
	}
	s->busy = true;
	is_check = s->next_check < s->n_checks && s->checks[s->next_check] == layer;
	plan->rows_in = s->n_checks && s->next_check == 0 ? s->n : (uint32_t)s->n_sel;
	plan->row_bytes = s->row_bytes;
	plan->num_tokens = s->n;
	plan->land = false;
	plan->selection_out = is_check;
	plan->fused_out = !(is_check && s->next_check == 0);
	plan->shared_ring = s->shm_id != 0;
	plan->device_ring = s->dv && s->dv->exported;
	plan->check_row_bytes = s->row_bytes;
	plan->attn = s->metric == KVBP_METRIC_ATTENTION;
	plan->attn_bytes = attn_bytes(s);
	pthread_mutex_unlock(&s->lock);
	*sp = s;
	return KVBP_OK;
}

struct dev_job {
	const struct blend_backend *be;
	const struct blend_shape *shape;
	const uint8_t *fresh; /* row i at fresh + i * stride */
	const uint8_t *stored;
	const int32_t *idx;
	size_t n, parts, row_bytes, stride;
	float *out;
};

static int dev_part(void *arg, size_t i)
{
	const struct dev_job *j = arg;
	size_t a = j->n * i / j->parts, b = j->n * (i + 1) / j->parts;

	if (b <= a)
		return 0;
	if (j->stride == j->row_bytes)
		return j->be->deviation(j->be, j->shape, j->fresh + a * j->row_bytes, j->stored,
					j->idx + a, b - a, j->out + a);
	/* Strided rows (e.g. a slice of the node's fused QKV output): one row at a time. */
	for (size_t r = a; r < b; r++) {
		int rc = j->be->deviation(j->be, j->shape, j->fresh + r * j->stride, j->stored,
					  j->idx + r, 1, j->out + r);

		if (rc)
			return rc;
	}
	return 0;
}

static size_t parts_for(struct fuse_table *t, size_t bytes)
{
	size_t threads = pool_threads(t->pool) + 1;

	/* Below a few hundred KiB a hand-off costs more than it saves. */
	return bytes < (256u << 10) ? 1 : threads;
}

/*
 * The attention metric's scores of the candidates cand[0..n_cand) (cached tokens,
 * increasing; ci[i] the row sent for cand[i]): per-head K and V deviation of the
 * rows sent (k_in, v_in, stride bytes apart) from the stored rows (k_st, v_st),
 * weighted by the session's A (qsel.h). Returns 0 or -ENOMEM.
 */
static int attention_scores(const struct fuse_session *s, const float *attn, const uint8_t *k_in,
			    const uint8_t *v_in, size_t stride, const uint8_t *k_st,
			    const uint8_t *v_st, const int32_t *cand, const size_t *ci,
			    size_t n_cand, float *score)
{
	size_t heads = s->shape.heads, fi = 0;
	float *dk = malloc((n_cand * heads + 1) * 3 * sizeof(float)), *dv, *a;
	int rc;

	if (!dk)
		return -ENOMEM;
	dv = dk + n_cand * heads + 1;
	a = dv + n_cand * heads + 1;
	for (size_t i = 0; i < n_cand; i++) {
		size_t ord;

		qsel_head_deviation(&s->shape, k_in + ci[i] * stride, stride, k_st, &cand[i], 1,
				    dk + i * heads);
		qsel_head_deviation(&s->shape, v_in + ci[i] * stride, stride, v_st, &cand[i], 1,
				    dv + i * heads);
		/* A's row of a cached token: its index less the fresh tokens before it. */
		while (fi < s->n_fresh && s->fresh[fi] < cand[i])
			fi++;
		ord = (size_t)cand[i] - fi;
		memcpy(a + i * heads, attn + ord * heads, heads * sizeof(float));
	}
	rc = qsel_score(dk, dv, a, n_cand, (uint32_t)heads, score);
	free(dk);
	return rc;
}

/*
 * The selection at the session's next check layer from the rows sent (k_in and
 * v_in, stride bytes apart; HKVD reads the metric's plane only) and the re-rotated
 * stored layer (k_st, v_st): the top-k cached tokens by deviation (value or key
 * metric) or by attention score (attn: A, for the attention metric), plus every
 * fresh one. *sel is malloc'd, sorted. The session is not changed.
 */
static uint32_t select_from(struct fuse_table *t, struct fuse_session *s, int32_t *cand,
			    float *dev, size_t n_cand, int32_t *sel, int32_t **sel_out,
			    size_t *n_out, char *err, size_t errlen);

static uint32_t check_select(struct fuse_table *t, struct fuse_session *s, const uint8_t *k_in,
			     const uint8_t *v_in, size_t stride, const uint8_t *k_st,
			     const uint8_t *v_st, const float *attn, int32_t **sel_out,
			     size_t *n_out, char *err, size_t errlen)
{
	size_t rows = s->next_check == 0 ? s->n : s->n_sel, n_cand;
	int32_t *idx = malloc((rows + 1) * sizeof(int32_t));
	int32_t *cand = malloc((rows + 1) * sizeof(int32_t));
	float *dev = malloc((rows + 1) * sizeof(float));
	int32_t *sel = malloc((s->n + 1) * sizeof(int32_t));
	size_t *ci = NULL;
	bool by_attn = s->metric == KVBP_METRIC_ATTENTION;
	struct dev_job dj;
	int rc;

	if (by_attn)
		ci = malloc((rows + 1) * sizeof(size_t));
	if (!idx || !cand || !dev || !sel || (by_attn && !ci) || (by_attn && !attn && s->n_cached)) {
		free(idx);
		free(cand);
		free(dev);
		free(sel);
		free(ci);
		if (by_attn && !attn && s->n_cached)
			return fail(err, errlen, KVBP_BAD_ARGUMENT, "the attention metric needs A "
				    "(float32 [%" PRIu32 " chunk tokens, %" PRIu32 " kv heads]) with "
				    "this check layer or an earlier layer request", s->n_cached,
				    s->shape.heads);
		return fail(err, errlen, KVBP_LIMIT, "out of memory");
	}
	for (size_t i = 0; i < rows; i++)
		idx[i] = s->next_check == 0 ? (int32_t)i : s->sel[i];
	if (by_attn) {
		size_t fi = 0;

		/* Candidates (the cached tokens among the rows) and their rows, then scores. */
		n_cand = 0;
		for (size_t i = 0; i < rows; i++) {
			while (fi < s->n_fresh && s->fresh[fi] < idx[i])
				fi++;
			if (fi < s->n_fresh && s->fresh[fi] == idx[i])
				continue;
			cand[n_cand] = idx[i];
			ci[n_cand++] = i;
		}
		rc = attention_scores(s, attn, k_in, v_in, stride, k_st, v_st, cand, ci, n_cand,
				      dev);
		free(ci);
		if (rc) {
			free(idx);
			free(cand);
			free(dev);
			free(sel);
			return fail(err, errlen, KVBP_LIMIT, "out of memory");
		}
	} else {
		dj = (struct dev_job){ t->be, &s->shape, s->metric == KVBP_METRIC_KEY ? k_in : v_in,
				       s->metric == KVBP_METRIC_KEY ? k_st : v_st, idx, rows, 1,
				       s->row_bytes, stride, dev };
		dj.parts = parts_for(t, rows * s->row_bytes);
		rc = pool_run(t->pool, dj.parts, dev_part, &dj);
		if (rc) {
			char why[160];

			free(idx);
			free(cand);
			free(dev);
			free(sel);
			return fail(err, errlen, KVBP_INTERNAL, "deviation: %s",
				    compute_error(t, rc, why, sizeof(why)));
		}
		/* Candidates: the cached tokens among the rows (fresh ones are always kept). */
		n_cand = candidates(s, idx, rows, dev, cand);
	}
	free(idx);
	return select_from(t, s, cand, dev, n_cand, sel, sel_out, n_out, err, errlen);
}

/*
 * HKVD's choice among n_cand candidates (cached tokens, cand) by their deviations dev,
 * the fresh tokens always kept, into sel (room for all tokens). Takes cand, dev and
 * sel: frees the first two, and sel on failure (else *sel_out = sel).
 */
static uint32_t select_from(struct fuse_table *t, struct fuse_session *s, int32_t *cand,
			    float *dev, size_t n_cand, int32_t *sel, int32_t **sel_out,
			    size_t *n_out, char *err, size_t errlen)
{
	long n_sel = t->be->select(t->be, cand, dev, n_cand,
				   hkvd_count(s->ratios[s->next_check], s->n_cached), s->fresh,
				   s->n_fresh, sel);

	free(cand);
	free(dev);
	if (n_sel < 0) {
		char why[160];

		free(sel);
		if (n_sel == -ENOMEM)
			return fail(err, errlen, KVBP_LIMIT, "out of memory");
		return fail(err, errlen, KVBP_INTERNAL, "HKVD selection: %s",
			    compute_error(t, (int)n_sel, why, sizeof(why)));
	}
	*sel_out = sel;
	*n_out = (size_t)n_sel;
	return KVBP_OK;
}

/*
 * Fuse in place: the fresh rows of the selected tokens overwrite their stored rows
 * in the slot, which then holds the fused layer. Only |S| rows move.
 */
static void scatter_fresh(const struct fuse_session *s, struct slot *sl, const uint8_t *k_in,
			  const uint8_t *v_in)
{
	for (size_t j = 0; j < s->n_sel; j++) {
		size_t t = (size_t)s->sel[j];

		memcpy(sl->k + t * s->row_bytes, k_in + j * s->row_bytes, s->row_bytes);
		memcpy(sl->v + t * s->row_bytes, v_in + j * s->row_bytes, s->row_bytes);
	}
}

uint32_t fuse_layer_run(struct fuse_table *t, struct fuse_session *s, const void *k_in,
			const void *v_in, void *k_out, void *v_out, bool on_device,
			const void *attn, struct fuse_layer_result *r, char *err, size_t errlen)
{
	uint32_t layer = s->next_layer, code = KVBP_OK;
	bool is_check = s->next_check < s->n_checks && s->checks[s->next_check] == layer;
	bool first_check = is_check && s->next_check == 0;
	uint64_t rows_in = first_check ? s->n : s->n_sel;
	struct timespec t0;
	struct slot *sl;
	float *a_new;
	int rc;

	memset(r, 0, sizeof(*r));
	code = attn_take(s, attn, &a_new, err, errlen);
	if (code)
		return code;
	pthread_mutex_lock(&s->lock);
	/* This request says the node is done with the layer served before. */
	if (s->served >= 0) {
		s->ring[s->served].layer = -1;
		s->ring[s->served].state = SLOT_EMPTY;
		s->served = -1;
	}
	rc = ensure_layer(t, s, layer, &sl);
	pthread_mutex_unlock(&s->lock);
	if (rc) {
		char why[160];

		free(a_new);
		return fail(err, errlen, store_code(rc), "layer %" PRIu32 ": cannot read stored "
			    "chunks: %s", layer, load_error(t, rc, why, sizeof(why)));
	}
	clock_gettime(CLOCK_MONOTONIC, &t0);
	if (s->dv) {
		int32_t *sel = NULL;
		size_t n_sel = 0;

		rc = dev_layer(t, s, sl, rows_in, k_in, v_in, is_check,
			       !first_check && !(on_device && s->dv->exported), k_out, v_out, &sel,
			       &n_sel);
		if (rc) {
			char why[160];
			const char *msg = compute_error(t, rc, why, sizeof(why));

			/* What the slot holds now is unknown: load it again next time. */
			pthread_mutex_lock(&s->lock);
			sl->layer = -1;
			sl->state = SLOT_EMPTY;
			pthread_mutex_unlock(&s->lock);
			/* The operator sees it too: a device that keeps failing is one to replace. */
			log_warn("fuse session %016" PRIx64 " layer %" PRIu32 ": %s", s->id, layer, msg);
			free(a_new);
			return fail(err, errlen, rc == -ENOMEM ? KVBP_LIMIT : KVBP_INTERNAL,
				    "layer %" PRIu32 ": %s", layer, msg);
		}
		if (is_check) {
			memcpy(s->sel, sel, n_sel * sizeof(int32_t));
			s->n_sel = n_sel;
			r->selection = sel;
			r->n_selection = n_sel;
			s->next_check++;
		}
	} else if (is_check) {
		int32_t *sel;
		size_t n_sel;

		code = check_select(t, s, k_in, v_in, s->row_bytes, sl->k, sl->v,
				    a_new ? a_new : s->attn, &sel, &n_sel, err, errlen);
		if (code) {
			free(a_new);
			return code;
		}
		/* At later check layers the fused output still uses the selection before it narrows. */
		if (s->next_check > 0)
			scatter_fresh(s, sl, k_in, v_in);
		memcpy(s->sel, sel, n_sel * sizeof(int32_t));
		s->n_sel = n_sel;
		r->selection = sel;
		r->n_selection = n_sel;
		s->next_check++;
	} else {
		scatter_fresh(s, sl, k_in, v_in);
	}
	if (!s->dv && !first_check && k_out) {
		memcpy(k_out, sl->k, (size_t)s->n * s->row_bytes);
		memcpy(v_out, sl->v, (size_t)s->n * s->row_bytes);
	}
	pthread_mutex_lock(&s->lock);
	if (a_new) {
		free(s->attn);
		s->attn = a_new;
	}
	s->ns_compute += ns_since(&t0);
	s->layers_served++;
	s->bytes_in += 2 * rows_in * s->row_bytes;
	s->bytes_out += first_check ? 0 : 2 * (uint64_t)s->n * s->row_bytes;
	s->next_layer++;
	if (first_check) {
		/* Nothing served from it: a prefetch may reuse the slot now. */
		sl->layer = -1;
		sl->state = SLOT_EMPTY;
	} else {
		sl->state = SLOT_SERVED;
		s->served = sl - s->ring;
		r->ring_slot = (uint32_t)s->served;
	}
	r->next_layer = s->next_layer;
	r->rows_next = (uint32_t)s->n_sel;
	r->done = s->next_layer >= s->m.desc.num_layers;
	pthread_mutex_unlock(&s->lock);
	return code;
}

/*
 * The deviation of each current row over the session's heads at the check layer (value
 * or key metric): rows are those heads of each row, stride bytes apart. A head range's
 * stored rows are compacted to that range first, so that the backend reads rows of
 * those heads; a session of every head reads its slot as it is. *dev_out: one float a
 * current row, malloc'd.
 */
static uint32_t heads_deviation(struct fuse_table *t, struct fuse_session *s, const uint8_t *rows,
			       size_t stride, float **dev_out, char *err, size_t errlen)
{
	const struct slot *cs = &s->cslot[s->next_check];
	const uint8_t *st = s->metric == KVBP_METRIC_KEY ? cs->k : cs->v;
	size_t n = s->next_check == 0 ? s->n : s->n_sel;
	/* ckd-ok: heads x head_dim x elem_size of a registered model (checked at register) */
	size_t hb = (size_t)s->m.desc.head_dim * s->m.elem_size, w = (size_t)s->land_hn * hb;
	struct blend_shape sh = s->shape;
	int32_t *idx = malloc((n + 1) * sizeof(int32_t));
	float *dev = malloc((n + 1) * sizeof(float));
	/* ckd-ok: n tokens of w <= row_bytes, the session's own sizes */
	uint8_t *stored = w < s->row_bytes ? malloc((size_t)s->n * w + 1) : NULL;
	struct dev_job dj;
	int rc;

	if (!idx || !dev || (w < s->row_bytes && !stored)) {
		free(idx);
		free(dev);
		free(stored);
		return fail(err, errlen, KVBP_LIMIT, "out of memory");
	}
	sh.heads = s->land_hn;
	for (size_t i = 0; i < n; i++) {
		idx[i] = s->next_check == 0 ? (int32_t)i : s->sel[i];
		if (stored) /* ckd-ok: a token's row of the slot, the range inside it */
			memcpy(stored + (size_t)idx[i] * w,
			       st + (size_t)idx[i] * s->row_bytes + (size_t)s->land_h0 * hb, w);
	}
	dj = (struct dev_job){ t->be, &sh, rows, stored ? stored : st, idx, n, 1, w, stride, dev };
	dj.parts = parts_for(t, n * w);
	rc = pool_run(t->pool, dj.parts, dev_part, &dj);
	free(idx);
	free(stored);
	if (rc) {
		char why[160];

		free(dev);
		return fail(err, errlen, KVBP_INTERNAL, "deviation: %s",
			    compute_error(t, rc, why, sizeof(why)));
	}
	*dev_out = dev;
	return KVBP_OK;
}

/* The selection by deviations the node gives (one a current row, summed over ranks). */
static uint32_t select_by(struct fuse_table *t, struct fuse_session *s, const float *dev_in,
			  int32_t **sel_out, size_t *n_out, char *err, size_t errlen)
{
	size_t rows = s->next_check == 0 ? s->n : s->n_sel, n_cand;
	int32_t *idx = malloc((rows + 1) * sizeof(int32_t));
	int32_t *cand = malloc((rows + 1) * sizeof(int32_t));
	float *dev = malloc((rows + 1) * sizeof(float));
	int32_t *sel = malloc((s->n + 1) * sizeof(int32_t));

	if (!idx || !cand || !dev || !sel) {
		free(idx);
		free(cand);
		free(dev);
		free(sel);
		return fail(err, errlen, KVBP_LIMIT, "out of memory");
	}
	for (size_t i = 0; i < rows; i++)
		idx[i] = s->next_check == 0 ? (int32_t)i : s->sel[i];
	if (rows)
		memcpy(dev, dev_in, rows * sizeof(float));
	n_cand = candidates(s, idx, rows, dev, cand);
	free(idx);
	return select_from(t, s, cand, dev, n_cand, sel, sel_out, n_out, err, errlen);
}

uint32_t fuse_check_run(struct fuse_table *t, struct fuse_session *s, int mode, const void *rows,
			size_t stride, const void *attn, const float *dev_in,
			struct fuse_layer_result *r, char *err, size_t errlen)
{
	uint32_t layer = s->checks[s->next_check], code;
	size_t prev = s->next_check == 0 ? s->n : s->n_sel, n_sel, nd = 0;
	bool ranged = s->land_hn < s->m.desc.num_kv_heads;
	struct timespec t0;
	int32_t *sel, *dropped;
	const uint8_t *k_in = rows, *v_in = rows;
	float *a_new = NULL;
	int rc;

	memset(r, 0, sizeof(*r));
	if (mode == FUSE_CHECK_SELECT && ranged)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "check layer %" PRIu32 ": this session "
			    "lands heads [%" PRIu32 ", %" PRIu32 ") of %" PRIu32 ": its rank's "
			    "deviation covers those only, and every rank must select the same "
			    "tokens; ask for the deviation (check_mode 1), sum it over the ranks, and "
			    "select by the sum (check_mode 2)", layer, s->land_h0,
			    s->land_h0 + s->land_hn, s->m.desc.num_kv_heads);
	if (mode != FUSE_CHECK_SELECT && s->metric == KVBP_METRIC_ATTENTION)
		return fail(err, errlen, KVBP_BAD_ARGUMENT, "check layer %" PRIu32 ": check_mode %d "
			    "is for the value and key metrics; this session's is attention", layer,
			    mode);
	if (mode != FUSE_CHECK_SELECT_BY) {
		code = attn_take(s, attn, &a_new, err, errlen);
		if (code)
			return code;
		pthread_mutex_lock(&s->lock);
		rc = ensure_cslot(t, s, s->next_check);
		pthread_mutex_unlock(&s->lock);
		if (rc) {
			char why[160];

			free(a_new);
			return fail(err, errlen, store_code(rc), "layer %" PRIu32 ": cannot read "
				    "stored chunks: %s", layer, load_error(t, rc, why, sizeof(why)));
		}
	}
	clock_gettime(CLOCK_MONOTONIC, &t0);
	if (mode == FUSE_CHECK_DEVIATION) {
		/* The rank's share only: the selection and the session stay as they are. */
		code = heads_deviation(t, s, rows, stride, &r->deviation, err, errlen);
		if (code)
			return code;
		r->n_deviation = prev;
		pthread_mutex_lock(&s->lock);
		s->ns_compute += ns_since(&t0);
		s->bytes_in += (uint64_t)prev * stride;
		r->selection = NULL;
		r->next_layer = layer;
		r->rows_next = (uint32_t)prev;
		pthread_mutex_unlock(&s->lock);
		return KVBP_OK;
	}
	if (mode == FUSE_CHECK_SELECT_BY) {
		code = select_by(t, s, dev_in, &sel, &n_sel, err, errlen);
	} else {
		if (s->metric == KVBP_METRIC_ATTENTION)
			v_in = k_in + s->row_bytes; /* each row: K, then V */
		code = check_select(t, s, k_in, v_in, stride, s->cslot[s->next_check].k,
				    s->cslot[s->next_check].v, a_new ? a_new : s->attn, &sel,
				    &n_sel, err, errlen);
	}
	if (code) {
		free(a_new);
		return code;
	}
	/* The rows the node sent but computes no more: sorted, as both lists are. */
	dropped = malloc((prev + 1) * sizeof(int32_t));
	if (!dropped) {
		free(sel);
		free(a_new);
		return fail(err, errlen, KVBP_LIMIT, "out of memory");
	}
	for (size_t i = 0, j = 0; i < prev; i++) {
		int32_t tok = s->next_check == 0 ? (int32_t)i : s->sel[i];

		while (j < n_sel && sel[j] < tok)
			j++;
		if (j == n_sel || sel[j] != tok)
			dropped[nd++] = tok;
	}
	pthread_mutex_lock(&s->lock);
	if (a_new) {
		free(s->attn);
		s->attn = a_new;
	}
	memcpy(s->sel, sel, n_sel * sizeof(int32_t));
	s->n_sel = n_sel;
	s->next_check++;
	s->ns_compute += ns_since(&t0);
	if (mode == FUSE_CHECK_SELECT)
		s->bytes_in += (uint64_t)prev * s->row_bytes *
			       (s->metric == KVBP_METRIC_ATTENTION ? 2 : 1);
	r->selection = sel;
	r->n_selection = n_sel;
	r->dropped = dropped;
	r->n_dropped = nd;
	r->next_layer = s->next_check < s->n_checks ? s->checks[s->next_check]
						       : s->m.desc.num_layers;
	r->rows_next = (uint32_t)n_sel;
	r->done = s->next_check >= s->n_checks;
	pthread_mutex_unlock(&s->lock);
	return KVBP_OK;
}

void fuse_layer_end(struct fuse_table *t, struct fuse_session *s)
{
	pthread_mutex_lock(&s->lock);
	s->busy = false;
	pthread_cond_broadcast(&s->cond);
	pthread_mutex_unlock(&s->lock);
	session_put(t, s);
}
