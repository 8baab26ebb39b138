/* cuda — the CUDA backend of blend/: kernels, device state, the staged table; see cuda.h
 * (the device table is table.cu). */
#include <cuda_runtime.h>
#include <cub/device/device_radix_sort.cuh>

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>

#include "blend/cuda/internal.cuh"
#include "blend/elem.h"

/* ---- errors: cudaError_t stops here ---- */

int cuda_xlate(struct blend_cuda *d, cudaError_t e, const char *what)
{
	if (e == cudaSuccess)
		return 0;
	(void)cudaGetLastError(); /* clear a non-sticky error so the next call starts clean */
	/*
	 * A sticky error (an illegal address, a kernel's fault) corrupts the context: the
	 * clear above does not take it, and every later call fails with it until the
	 * process restarts. Those the documentation names, and any that outlives the clear.
	 */
	if (d && (e == cudaErrorIllegalAddress || e == cudaErrorLaunchFailure ||
		  e == cudaErrorHardwareStackError || e == cudaErrorIllegalInstruction ||
		  e == cudaErrorMisalignedAddress || e == cudaErrorInvalidAddressSpace ||
		  e == cudaErrorInvalidPc || e == cudaErrorAssert ||
		  e == cudaErrorECCUncorrectable || e == cudaErrorLaunchTimeout ||
		  cudaPeekAtLastError() != cudaSuccess))
		__atomic_store_n(&d->broken, true, __ATOMIC_RELAXED);
	if (d) {
		pthread_mutex_lock(&d->lock);
		snprintf(d->last_err, sizeof(d->last_err), "%s: %s", what, cudaGetErrorString(e));
		pthread_mutex_unlock(&d->lock);
	}
	switch (e) {
	case cudaErrorMemoryAllocation:
		return -ENOMEM;
	case cudaErrorNoDevice:
	case cudaErrorInsufficientDriver:
		return -ENODEV;
	default:
		return -EIO;
	}
}

static size_t align_up(size_t x)
{
	return (x + ALIGN - 1) / ALIGN * ALIGN;
}


/* ---- kernels: the per-element math is elem.h's, as on the CPU ---- */

/*
 * One thread per pair (k < half) or per dimension past rotary_dim (copied):
 * rows x heads x (half + head_dim - rotary_dim) threads. In place is safe: a
 * thread reads its pair before writing it, and no other thread touches it.
 */
__global__ void k_rotate(int dt, int style, uint32_t heads, uint32_t hd, uint32_t half,
			 const float *cs, const float *sn, uint32_t trows, float sc,
			 const uint8_t *src, uint8_t *dst, uint32_t n)
{
	uint32_t per = half + (hd - 2 * half);
	uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
	size_t es = dt == BLEND_F32 ? 4 : 2;

	if (i >= (uint64_t)n * heads * per)
		return;
	{
		uint32_t k = (uint32_t)(i % per);
		uint64_t rh = i / per;
		uint32_t r = (uint32_t)(rh / heads);
		const uint8_t *x = src + rh * hd * es;
		uint8_t *y = dst + rh * hd * es;

		if (k < half) {
			size_t trow = trows == 1 ? 0 : (size_t)r * half;
			size_t a = style == ROPE_NEOX ? k : 2 * (size_t)k;
			size_t b = style == ROPE_NEOX ? (size_t)k + half : 2 * (size_t)k + 1;
			float y1, y2;

			elem_rotate_pair(elem_load(dt, x, a), elem_load(dt, x, b), cs[trow + k],
					 sn[trow + k], sc, &y1, &y2);
			elem_store(dt, y, a, y1);
			elem_store(dt, y, b, y2);
		} else if (x != y) {
			size_t j = 2 * (size_t)half + (k - half);

			memcpy(y + j * es, x + j * es, es);
		}
	}
}

/*
 * A layer's chunks in one launch, in place: one thread per pair of each span row's
 * heads (rows x heads x half threads; dims past rotary_dim stay as they are). The
 * thread's row g among the spans' rows finds its span by a binary search of first.
 */
__global__ void k_rotate_spans(int dt, int style, uint32_t heads, uint32_t hd, uint32_t half,
			       const struct blend_dev_span *sp, uint32_t n_sp, uint8_t *base,
			       uint32_t rows)
{
	uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
	size_t es = dt == BLEND_F32 ? 4 : 2;

	if (i >= (uint64_t)rows * heads * half)
		return;
	{
		uint32_t k = (uint32_t)(i % half);
		uint64_t gh = i / half;
		uint32_t h = (uint32_t)(gh % heads), g = (uint32_t)(gh / heads);
		uint32_t lo = 0, hi = n_sp;

		while (hi - lo > 1) { /* the last span with first <= g */
			uint32_t mid = (lo + hi) / 2;

			if (sp[mid].first <= g)
				lo = mid;
			else
				hi = mid;
		}
		{
			const struct blend_dev_span *c = &sp[lo];
			uint32_t r = g - c->first;
			size_t trow = c->t.rows == 1 ? 0 : (size_t)r * half;
			uint8_t *x = base + (((size_t)c->off + r) * heads + h) * hd * es;
			size_t a = style == ROPE_NEOX ? k : 2 * (size_t)k;
			size_t b = style == ROPE_NEOX ? (size_t)k + half : 2 * (size_t)k + 1;
			float y1, y2;

			elem_rotate_pair(elem_load(dt, x, a), elem_load(dt, x, b), c->t.cos[trow + k],
					 c->t.sin[trow + k], c->t.scale, &y1, &y2);
			elem_store(dt, x, a, y1);
			elem_store(dt, x, b, y2);
		}
	}
}

/*
 * Eight threads per row, thread `lane` summing the elements j % 8 == lane of every
 * head in the CPU's order (elem.h); the row's first thread reduces the eight in the
 * fixed tree. Blocks are whole warps, so a row's threads share a warp. idx NULL:
 * stored row i for fresh row i.
 */
__global__ void k_deviation(int dt, uint32_t heads, uint32_t hd, const uint8_t *fresh,
			    const uint8_t *stored, const int32_t *idx, size_t n, float *out)
{
	uint64_t g = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
	uint64_t row = g / 8;
	unsigned lane = (unsigned)(g % 8), base = (threadIdx.x & 31u) & ~7u;
	size_t es = dt == BLEND_F32 ? 4 : 2, rowel = (size_t)heads * hd;
	float acc = 0, a[8];

	if (row < n) {
		const uint8_t *f = fresh + row * rowel * es;
		const uint8_t *o = stored + (size_t)(idx ? idx[row] : (int64_t)row) * rowel * es;

		for (uint32_t h = 0; h < heads; h++)
			for (uint32_t j = lane; j < hd; j += 8) {
				size_t e_i = (size_t)h * hd + j;
				float e = elem_load(dt, f, e_i) - elem_load(dt, o, e_i);

				acc += e * e;
			}
	}
	for (int k = 0; k < 8; k++)
		a[k] = __shfl_sync(0xffffffffu, acc, base + k);
	if (row < n && lane == 0)
		out[row] = elem_lanes_reduce(a);
}

__global__ void k_keys(const int32_t *cand, const float *dev, size_t n, uint64_t *keys)
{
	uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;

	if (i < n)
		keys[i] = elem_hkvd_key(dev[i], cand[i]);
}

/* The k largest keys' tokens, then the always-kept ones, into out (unsorted). */
__global__ void k_take(const uint64_t *sorted, size_t k, const int32_t *always, size_t n_always,
		       int32_t *out)
{
	uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;

	if (i < k)
		out[i] = elem_hkvd_index(sorted[i]);
	else if (i < k + n_always)
		out[i] = always[i - k];
}

/* Row sel[j] - base of layer = row j of fresh; 16-byte words when wide, else bytes. */
__global__ void k_scatter(uint8_t *layer, const uint8_t *fresh, const int32_t *sel, size_t n_sel,
			  size_t rb, int64_t base, bool wide)
{
	uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
	size_t per = wide ? rb / 16 : rb;

	if (i >= (uint64_t)n_sel * per)
		return;
	{
		size_t j = (size_t)(i / per), w = (size_t)(i % per);
		size_t row = (size_t)(sel[j] - base);

		if (wide)
			((uint4 *)(layer + row * rb))[w] = ((const uint4 *)(fresh + j * rb))[w];
		else
			layer[row * rb + w] = fresh[j * rb + w];
	}
}

/* ---- device kernels on caller memory ---- */

static size_t row_bytes(const struct blend_shape *s)
{
	return (size_t)s->heads * s->head_dim * blend_dtype_size(s->dtype);
}

static bool shape_ok(const struct blend_shape *s)
{
	return blend_dtype_size(s->dtype) && s->heads && s->head_dim && s->rotary_dim % 2 == 0 &&
	       s->rotary_dim <= s->head_dim;
}

extern "C" int blend_cuda_rotate_dev(struct blend_cuda_stream *st, const struct blend_shape *s,
				     const struct blend_cuda_table *t, const void *src, void *dst,
				     uint32_t n)
{
	uint32_t half = s->rotary_dim / 2;
	uint64_t threads = (uint64_t)n * s->heads * (half + (s->head_dim - 2 * half));

	if (!shape_ok(s))
		return -EINVAL;
	if (!threads)
		return 0;
	k_rotate<<<blocks_for(threads, 256), 256, 0, st->st>>>(
		(int)s->dtype, (int)s->style, s->heads, s->head_dim, half, t->cos, t->sin, t->rows,
		t->scale, (const uint8_t *)src, (uint8_t *)dst, n);
	return cuda_xlate(st->d, cudaGetLastError(), "rotate kernel");
}

extern "C" int blend_cuda_rotate_spans_dev(struct blend_cuda_stream *st,
					   const struct blend_shape *s,
					   const struct blend_dev_span *spans, uint32_t n_spans,
					   uint32_t rows, void *base)
{
	uint32_t half = s->rotary_dim / 2;
	uint64_t threads = (uint64_t)rows * s->heads * half;

	if (!shape_ok(s))
		return -EINVAL;
	if (!threads || !n_spans)
		return 0;
	k_rotate_spans<<<blocks_for(threads, 256), 256, 0, st->st>>>(
		(int)s->dtype, (int)s->style, s->heads, s->head_dim, half, spans, n_spans,
		(uint8_t *)base, rows);
	return cuda_xlate(st->d, cudaGetLastError(), "rotate kernel");
}

extern "C" int blend_cuda_deviation_dev(struct blend_cuda_stream *st, const struct blend_shape *s,
					const void *fresh, const void *stored, const int32_t *idx,
					size_t n, float *out)
{
	if (!shape_ok(s))
		return -EINVAL;
	if (!n)
		return 0;
	k_deviation<<<blocks_for((uint64_t)n * 8, 256), 256, 0, st->st>>>(
		(int)s->dtype, s->heads, s->head_dim, (const uint8_t *)fresh,
		(const uint8_t *)stored, idx, n, out);
	return cuda_xlate(st->d, cudaGetLastError(), "deviation kernel");
}

/*
 * Scratch layout of a select over n: keys in, keys out, tokens, then CUB's own.
 * Returns CUB's error, never cudaSuccess when a size is missing: a size query that
 * failed, or that left a size of 0 for a sort that needs scratch, is an error the
 * caller returns (not an empty selection).
 */
cudaError_t cuda_select_layout(size_t n, size_t *cub_off, size_t *cub_bytes)
{
	size_t b64 = 0, b32 = 0;
	cudaError_t e;

	e = cub::DeviceRadixSort::SortKeysDescending(nullptr, b64, (const uint64_t *)nullptr,
						     (uint64_t *)nullptr, (int64_t)(n ? n : 1));
	if (e == cudaSuccess)
		e = cub::DeviceRadixSort::SortKeys(nullptr, b32, (const int32_t *)nullptr,
						   (int32_t *)nullptr, (int64_t)(n ? n : 1));
	if (e == cudaSuccess && (!b64 || !b32))
		e = cudaErrorInvalidValue;
	if (e != cudaSuccess)
		return e;
	*cub_off = 2 * align_up(n * 8) + align_up(n * 4);
	*cub_bytes = b64 > b32 ? b64 : b32;
	return cudaSuccess;
}

extern "C" size_t blend_cuda_select_scratch(size_t n)
{
	size_t off, bytes;

	if (cuda_select_layout(n, &off, &bytes) != cudaSuccess)
		return 0;
	return off + bytes;
}

extern "C" int blend_cuda_select_dev(struct blend_cuda_stream *st, const int32_t *cand,
				     const float *dev, size_t n_cand, size_t k,
				     const int32_t *always, size_t n_always, int32_t *out,
				     void *scratch, size_t scratch_bytes, size_t *n_out)
{
	size_t n = n_cand + n_always, off, cub_bytes;
	uint8_t *sc = (uint8_t *)scratch;
	uint64_t *kin = (uint64_t *)sc, *kout = (uint64_t *)(sc + align_up(n * 8));
	int32_t *tok = (int32_t *)(sc + 2 * align_up(n * 8));
	cudaError_t e = cudaSuccess;
	int rc;

	if (k > n_cand)
		k = n_cand;
	e = cuda_select_layout(n, &off, &cub_bytes);
	if (e != cudaSuccess)
		return cuda_xlate(st->d, e, "select scratch size"); /* never 0: e is an error */
	if (scratch_bytes < off + cub_bytes)
		return -EINVAL;
	if (k) {
		k_keys<<<blocks_for(n_cand, 256), 256, 0, st->st>>>(cand, dev, n_cand, kin);
		e = cub::DeviceRadixSort::SortKeysDescending(sc + off, cub_bytes, kin, kout,
							     (int64_t)n_cand, 0, 64, st->st);
	}
	if (e == cudaSuccess && k + n_always) {
		k_take<<<blocks_for(k + n_always, 256), 256, 0, st->st>>>(kout, k, always,
									  n_always, tok);
		e = cub::DeviceRadixSort::SortKeys(sc + off, cub_bytes, tok, out,
						   (int64_t)(k + n_always), 0, 32, st->st);
	}
	if (e == cudaSuccess)
		e = cudaGetLastError();
	rc = cuda_xlate(st->d, e, "select");
	if (!rc)
		*n_out = k + n_always;
	return rc;
}

extern "C" int blend_cuda_scatter_dev(struct blend_cuda_stream *st, const struct blend_shape *s,
				      void *layer, const void *fresh, const int32_t *sel,
				      size_t n_sel)
{
	size_t rb = row_bytes(s);
	bool wide = rb % 16 == 0 && (uintptr_t)layer % 16 == 0 && (uintptr_t)fresh % 16 == 0;
	uint64_t threads = (uint64_t)n_sel * (wide ? rb / 16 : rb);

	if (!shape_ok(s))
		return -EINVAL;
	if (!threads)
		return 0;
	k_scatter<<<blocks_for(threads, 256), 256, 0, st->st>>>(
		(uint8_t *)layer, (const uint8_t *)fresh, sel, n_sel, rb, 0, wide);
	return cuda_xlate(st->d, cudaGetLastError(), "scatter kernel");
}

/* ---- memory and streams ---- */

extern "C" int blend_cuda_alloc(struct blend_cuda *d, size_t bytes, void **out)
{
	void *p = NULL;
	int rc = cuda_xlate(d, cudaSetDevice(d->ordinal), "cudaSetDevice");

	if (!rc)
		rc = cuda_xlate(d, cudaMalloc(&p, bytes ? bytes : 1), "cudaMalloc");
	if (rc)
		return rc;
	__atomic_add_fetch(&d->held, bytes, __ATOMIC_RELAXED);
	*out = p;
	return 0;
}

extern "C" void blend_cuda_free(struct blend_cuda *d, void *p, size_t bytes)
{
	if (!p)
		return;
	cudaSetDevice(d->ordinal);
	cudaFree(p);
	__atomic_sub_fetch(&d->held, bytes, __ATOMIC_RELAXED);
}

extern "C" int blend_cuda_host_alloc(struct blend_cuda *d, size_t bytes, void **out)
{
	void *p = NULL;
	int rc = cuda_xlate(d, cudaMallocHost(&p, bytes ? bytes : 1), "cudaMallocHost");

	if (!rc)
		*out = p;
	return rc;
}

extern "C" void blend_cuda_host_free(struct blend_cuda *d, void *p)
{
	(void)d;
	if (p)
		cudaFreeHost(p);
}

extern "C" int blend_cuda_stream_new(struct blend_cuda *d, struct blend_cuda_stream **out)
{
	struct blend_cuda_stream *st = (struct blend_cuda_stream *)calloc(1, sizeof(*st));
	int rc;

	if (!st)
		return -ENOMEM;
	st->d = d;
	rc = cuda_xlate(d, cudaSetDevice(d->ordinal), "cudaSetDevice");
	if (!rc)
		rc = cuda_xlate(d, cudaStreamCreateWithFlags(&st->st, cudaStreamNonBlocking),
			   "cudaStreamCreate");
	if (!rc) {
		rc = cuda_xlate(d, cudaEventCreateWithFlags(&st->ev, EVENT_FLAGS),
			   "cudaEventCreate");
		if (rc)
			cudaStreamDestroy(st->st);
	}
	if (rc) {
		free(st);
		return rc;
	}
	*out = st;
	return 0;
}

extern "C" void blend_cuda_stream_free(struct blend_cuda_stream **stp)
{
	struct blend_cuda_stream *st = stp ? *stp : NULL;

	if (!st)
		return;
	cudaStreamSynchronize(st->st);
	cudaEventDestroy(st->ev);
	cudaStreamDestroy(st->st);
	free(st);
	*stp = NULL;
}

extern "C" int blend_cuda_stream_sync(struct blend_cuda_stream *st)
{
	return cuda_xlate(st->d, cudaStreamSynchronize(st->st), "stream");
}

extern "C" int blend_cuda_stream_wait(struct blend_cuda_stream *waiter,
				      struct blend_cuda_stream *on)
{
	int rc = cuda_xlate(on->d, cudaEventRecord(on->ev, on->st), "cudaEventRecord");

	return rc ? rc : cuda_xlate(on->d, cudaStreamWaitEvent(waiter->st, on->ev, 0),
			       "cudaStreamWaitEvent");
}

extern "C" int blend_cuda_upload(struct blend_cuda_stream *st, void *dev, const void *host,
				 size_t n)
{
	return n ? cuda_xlate(st->d, cudaMemcpyAsync(dev, host, n, cudaMemcpyHostToDevice, st->st),
			 "host-to-device copy")
		 : 0;
}

extern "C" int blend_cuda_download(struct blend_cuda_stream *st, void *host, const void *dev,
				   size_t n)
{
	return n ? cuda_xlate(st->d, cudaMemcpyAsync(host, dev, n, cudaMemcpyDeviceToHost, st->st),
			 "device-to-host copy")
		 : 0;
}

extern "C" int blend_cuda_copy(struct blend_cuda_stream *st, void *dst, const void *src, size_t n)
{
	return n ? cuda_xlate(st->d, cudaMemcpyAsync(dst, src, n, cudaMemcpyDeviceToDevice, st->st),
			 "device-to-device copy")
		 : 0;
}

/* ---- the staged backend table: host rows through a lane ---- */

/* Take a free lane with at least dev_bytes of device and host_bytes of pinned memory. */
static int lane_get(struct blend_cuda *d, size_t dev_bytes, size_t host_bytes, struct lane **out)
{
	struct lane *l = NULL;
	int rc;

	pthread_mutex_lock(&d->lock);
	for (;;) {
		for (int i = 0; i < LANES && !l; i++)
			if (!d->lanes[i].busy)
				l = &d->lanes[i];
		if (l)
			break;
		pthread_cond_wait(&d->cond, &d->lock);
	}
	l->busy = true;
	pthread_mutex_unlock(&d->lock);
	rc = cuda_xlate(d, cudaSetDevice(d->ordinal), "cudaSetDevice");
	if (!rc && l->dev_cap < dev_bytes) {
		size_t cap = dev_bytes > 2 * l->dev_cap ? dev_bytes : 2 * l->dev_cap;

		blend_cuda_free(d, l->dev, l->dev_cap);
		l->dev = NULL;
		l->dev_cap = 0;
		rc = blend_cuda_alloc(d, cap, (void **)&l->dev);
		if (!rc)
			l->dev_cap = cap;
	}
	if (!rc && l->host_cap < host_bytes) {
		size_t cap = host_bytes > 2 * l->host_cap ? host_bytes : 2 * l->host_cap;

		blend_cuda_host_free(d, l->host);
		l->host = NULL;
		l->host_cap = 0;
		rc = blend_cuda_host_alloc(d, cap, (void **)&l->host);
		if (!rc)
			l->host_cap = cap;
	}
	if (rc) {
		pthread_mutex_lock(&d->lock);
		l->busy = false;
		pthread_cond_signal(&d->cond);
		pthread_mutex_unlock(&d->lock);
		return rc;
	}
	*out = l;
	return 0;
}

/* Wait for the lane's work, give it back; returns rc, or the stream's error. */
static int lane_put(struct blend_cuda *d, struct lane *l, int rc)
{
	int sync = cuda_xlate(d, cudaStreamSynchronize(l->st), "staged call");

	pthread_mutex_lock(&d->lock);
	l->busy = false;
	pthread_cond_signal(&d->cond);
	pthread_mutex_unlock(&d->lock);
	return rc ? rc : sync;
}

static int staged_rotate(const struct blend_backend *be, const struct blend_shape *s,
			 const struct rope_table *t, const void *src, void *dst, uint32_t row0,
			 uint32_t n)
{
	struct blend_cuda *d = (struct blend_cuda *)be->ctx;
	struct blend_cuda_stream st = { d, 0, 0 };
	size_t data = (size_t)n * row_bytes(s), half = t->half;
	size_t trows = t->rows == 1 ? 1 : n, tab = trows * half * sizeof(float);
	size_t first = t->rows == 1 ? 0 : (size_t)row0 * half;
	struct blend_cuda_table dt;
	struct lane *l;
	int rc;

	if (!n)
		return 0;
	rc = lane_get(d, align_up(data) + 2 * align_up(tab), 0, &l);
	if (rc)
		return rc;
	st.st = l->st;
	dt.cos = (const float *)(l->dev + align_up(data));
	dt.sin = (const float *)(l->dev + align_up(data) + align_up(tab));
	dt.rows = (uint32_t)trows;
	dt.scale = t->scale;
	rc = blend_cuda_upload(&st, l->dev, src, data);
	if (!rc)
		rc = blend_cuda_upload(&st, (void *)dt.cos, t->cos + first, tab);
	if (!rc)
		rc = blend_cuda_upload(&st, (void *)dt.sin, t->sin + first, tab);
	if (!rc)
		rc = blend_cuda_rotate_dev(&st, s, &dt, l->dev, l->dev, n);
	if (!rc)
		rc = blend_cuda_download(&st, dst, l->dev, data);
	return lane_put(d, l, rc);
}

static int staged_deviation(const struct blend_backend *be, const struct blend_shape *s,
			    const void *fresh, const void *stored, const int32_t *idx, size_t n,
			    float *out)
{
	struct blend_cuda *d = (struct blend_cuda *)be->ctx;
	struct blend_cuda_stream st = { d, 0, 0 };
	size_t rb = row_bytes(s), data = n * rb;
	struct lane *l;
	int rc;

	if (!n)
		return 0;
	/* The stored rows idx picks are gathered on the host: the caller's array may be a
	 * whole layer of which a check reads a few rows. */
	rc = lane_get(d, 2 * align_up(data) + align_up(n * 4), data, &l);
	if (rc)
		return rc;
	st.st = l->st;
	for (size_t i = 0; i < n; i++)
		memcpy(l->host + i * rb, (const uint8_t *)stored + (idx ? (size_t)idx[i] : i) * rb,
		       rb);
	rc = blend_cuda_upload(&st, l->dev, fresh, data);
	if (!rc)
		rc = blend_cuda_upload(&st, l->dev + align_up(data), l->host, data);
	if (!rc)
		rc = blend_cuda_deviation_dev(&st, s, l->dev, l->dev + align_up(data), NULL, n,
					      (float *)(l->dev + 2 * align_up(data)));
	if (!rc)
		rc = blend_cuda_download(&st, out, l->dev + 2 * align_up(data), n * 4);
	return lane_put(d, l, rc);
}

static int staged_merge(const struct blend_backend *be, const struct blend_shape *s,
			const void *stored, const void *fresh, const int32_t *sel, size_t n_sel,
			void *out, size_t row0, size_t n)
{
	struct blend_cuda *d = (struct blend_cuda *)be->ctx;
	struct blend_cuda_stream st = { d, 0, 0 };
	size_t rb = row_bytes(s), data = n * rb, j0 = 0, j1, hi;
	struct lane *l;
	int rc;

	if (!n)
		return 0;
	/* The selected rows inside [row0, row0 + n): sel[j0 .. j1). */
	for (hi = n_sel; j0 < hi;) {
		size_t mid = (j0 + hi) / 2;

		if ((size_t)sel[mid] < row0)
			j0 = mid + 1;
		else
			hi = mid;
	}
	for (j1 = j0; j1 < n_sel && (size_t)sel[j1] < row0 + n; j1++)
		;
	rc = lane_get(d, align_up(data) + align_up((j1 - j0) * rb) + align_up((j1 - j0) * 4), 0,
		      &l);
	if (rc)
		return rc;
	st.st = l->st;
	{
		uint8_t *f = l->dev + align_up(data);
		int32_t *sl = (int32_t *)(f + align_up((j1 - j0) * rb));
		bool wide = rb % 16 == 0;
		uint64_t threads = (uint64_t)(j1 - j0) * (wide ? rb / 16 : rb);

		rc = blend_cuda_upload(&st, l->dev, (const uint8_t *)stored + row0 * rb, data);
		if (!rc)
			rc = blend_cuda_upload(&st, f, (const uint8_t *)fresh + j0 * rb,
					       (j1 - j0) * rb);
		if (!rc)
			rc = blend_cuda_upload(&st, sl, sel + j0, (j1 - j0) * 4);
		if (!rc && threads) {
			k_scatter<<<blocks_for(threads, 256), 256, 0, l->st>>>(
				l->dev, f, sl, j1 - j0, rb, (int64_t)row0, wide);
			rc = cuda_xlate(d, cudaGetLastError(), "scatter kernel");
		}
		if (!rc)
			rc = blend_cuda_download(&st, (uint8_t *)out + row0 * rb, l->dev, data);
	}
	return lane_put(d, l, rc);
}

static long staged_select(const struct blend_backend *be, const int32_t *cand, const float *dev,
			  size_t n_cand, size_t k, const int32_t *always, size_t n_always,
			  int32_t *out)
{
	struct blend_cuda *d = (struct blend_cuda *)be->ctx;
	struct blend_cuda_stream st = { d, 0, 0 };
	size_t n = n_cand + n_always, a4 = align_up(n * 4), scratch, got = 0;
	struct lane *l;
	int rc;

	/* CUB sizes its scratch for the calling thread's current device. */
	rc = cuda_xlate(d, cudaSetDevice(d->ordinal), "cudaSetDevice");
	if (rc)
		return rc;
	{
		size_t off, cub_bytes;
		cudaError_t e = cuda_select_layout(n, &off, &cub_bytes);

		if (e != cudaSuccess)
			return cuda_xlate(d, e, "select scratch size"); /* never 0: e is an error */
		scratch = off + cub_bytes;
	}
	rc = lane_get(d, 4 * a4 + scratch, 0, &l);
	if (rc)
		return rc;
	st.st = l->st;
	{
		int32_t *dc = (int32_t *)l->dev, *da = (int32_t *)(l->dev + a4);
		float *dd = (float *)(l->dev + 2 * a4);
		int32_t *dout = (int32_t *)(l->dev + 3 * a4);

		rc = blend_cuda_upload(&st, dc, cand, n_cand * 4);
		if (!rc)
			rc = blend_cuda_upload(&st, dd, dev, n_cand * 4);
		if (!rc)
			rc = blend_cuda_upload(&st, da, always, n_always * 4);
		if (!rc)
			rc = blend_cuda_select_dev(&st, dc, dd, n_cand, k, da, n_always, dout,
						   l->dev + 4 * a4, scratch, &got);
		if (!rc)
			rc = blend_cuda_download(&st, out, dout, got * 4);
	}
	rc = lane_put(d, l, rc);
	return rc ? rc : (long)got;
}

/* ---- the device ---- */

extern "C" bool blend_cuda_built(void)
{
	return true;
}

/* A kernel this build carries for the device: fails when no image or PTX fits it. */
__global__ void k_probe(int *x)
{
	*x = 1;
}

/*
 * The oldest driver each CUDA major release supports through minor-version
 * compatibility (NVIDIA's CUDA compatibility guide, table of minimum drivers): a
 * runtime of that major release runs on it. Newer releases than this table knows
 * say so instead of guessing.
 */
#define STR2(x) #x
#define STR(x) STR2(x)
#if CUDART_VERSION >= 14000
#define DRIVER_FLOOR "a driver for CUDA " STR(CUDART_VERSION) " (see NVIDIA's compatibility table)"
#elif CUDART_VERSION >= 13000
#define DRIVER_FLOOR "NVIDIA driver 580 or newer"
#elif CUDART_VERSION >= 12000
#define DRIVER_FLOOR "NVIDIA driver 525 or newer"
#else
#define DRIVER_FLOOR "NVIDIA driver 450 or newer"
#endif

extern "C" const char *blend_cuda_driver_floor(void)
{
	return "CUDA runtime " STR(__CUDACC_VER_MAJOR__) "." STR(__CUDACC_VER_MINOR__)
	       " (linked statically) needs " DRIVER_FLOOR;
}

extern "C" int blend_cuda_driver_version(void)
{
	int v = 0;

	if (cudaDriverGetVersion(&v) != cudaSuccess) {
		(void)cudaGetLastError();
		return 0;
	}
	return v;
}

/* The device count, or -ENODEV with the cause (no driver, none, not that one) in err. */
static int count_devices(int ordinal, char *err, size_t errlen)
{
	int n = 0;
	cudaError_t e = cudaGetDeviceCount(&n);

	if (e != cudaSuccess) {
		/* cudart says "driver version is insufficient" also when there is no driver. */
		void *drv = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);

		if (!drv)
			drv = dlopen("libcuda.so.1", RTLD_LAZY);
		if (!drv)
			snprintf(err, errlen, "no NVIDIA driver (libcuda.so.1 not found)");
		else if (e == cudaErrorInsufficientDriver)
			snprintf(err, errlen, "no usable CUDA device: %s (the driver supports "
				 "CUDA %d.%d; this build's %s)", cudaGetErrorString(e),
				 blend_cuda_driver_version() / 1000,
				 blend_cuda_driver_version() % 1000 / 10, blend_cuda_driver_floor());
		else
			snprintf(err, errlen, "no usable CUDA device: %s", cudaGetErrorString(e));
		if (drv)
			dlclose(drv);
		(void)cudaGetLastError();
		return -ENODEV;
	}
	if (n == 0) {
		snprintf(err, errlen, "no CUDA device (the NVIDIA driver reports none)");
		return -ENODEV;
	}
	if (ordinal < 0 || ordinal >= n) {
		snprintf(err, errlen, "CUDA device %d not present: %d CUDA device%s", ordinal, n,
			 n == 1 ? "" : "s");
		return -ENODEV;
	}
	return n;
}

extern "C" int blend_cuda_probe(int ordinal, char *name, size_t namelen, char *err,
				size_t errlen)
{
	struct cudaDeviceProp p;
	cudaError_t e;

	if (count_devices(ordinal, err, errlen) < 0)
		return -ENODEV;
	e = cudaGetDeviceProperties(&p, ordinal);
	if (e != cudaSuccess) {
		snprintf(err, errlen, "CUDA device %d: %s", ordinal, cudaGetErrorString(e));
		(void)cudaGetLastError();
		return -ENODEV;
	}
	snprintf(name, namelen, "%s", p.name);
	return 0;
}

extern "C" int blend_cuda_open(int ordinal, struct blend_cuda **out, char *err, size_t errlen)
{
	struct blend_cuda *d;
	struct cudaDeviceProp p;
	int *probe = NULL, one = 0;
	bool have_p = false;
	cudaError_t e;

	if (count_devices(ordinal, err, errlen) < 0)
		return -ENODEV;
	e = cudaGetDeviceProperties(&p, ordinal);
	have_p = e == cudaSuccess;
	if (e == cudaSuccess)
		e = cudaSetDevice(ordinal);
	/*
	 * Threads that wait for the device (stream and event syncs) sleep on the driver
	 * instead of spinning: the daemon's waiting workers would otherwise take the
	 * cores its chunk readers need. Set before the context starts (the malloc below
	 * starts it); on a context another part of the process started already the flag
	 * may be refused, which blend_cuda_blocking_sync() then says.
	 */
	if (e == cudaSuccess && cudaSetDeviceFlags(cudaDeviceScheduleBlockingSync) != cudaSuccess)
		(void)cudaGetLastError();
	if (e == cudaSuccess)
		e = cudaMalloc((void **)&probe, sizeof(int));
	if (e == cudaSuccess) {
		k_probe<<<1, 1>>>(probe);
		e = cudaGetLastError();
		if (e == cudaSuccess)
			e = cudaMemcpy(&one, probe, sizeof(int), cudaMemcpyDeviceToHost);
		cudaFree(probe);
	}
	if (e != cudaSuccess || one != 1) {
		if (have_p)
			snprintf(err, errlen,
				 "CUDA device %d (%s, compute capability %d.%d) unusable: %s",
				 ordinal, p.name, p.major, p.minor,
				 e == cudaSuccess ? "the probe kernel did not run"
						  : cudaGetErrorString(e));
		else
			snprintf(err, errlen, "CUDA device %d unusable: %s", ordinal,
				 cudaGetErrorString(e));
		(void)cudaGetLastError();
		return e == cudaErrorMemoryAllocation ? -ENOMEM : -ENODEV;
	}
	d = (struct blend_cuda *)calloc(1, sizeof(*d));
	if (!d) {
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	d->ordinal = ordinal;
	{
		unsigned flags = 0;

		d->blocking = cudaGetDeviceFlags(&flags) == cudaSuccess &&
			      (flags & cudaDeviceScheduleMask) == cudaDeviceScheduleBlockingSync;
		(void)cudaGetLastError();
	}
	snprintf(d->name, sizeof(d->name), "%s", p.name);
	d->total = p.totalGlobalMem;
	pthread_mutex_init(&d->lock, NULL);
	pthread_cond_init(&d->cond, NULL);
	for (int i = 0; i < LANES; i++) {
		e = cudaStreamCreateWithFlags(&d->lanes[i].st, cudaStreamNonBlocking);
		if (e != cudaSuccess) {
			snprintf(err, errlen, "CUDA device %d: creating a stream: %s", ordinal,
				 cudaGetErrorString(e));
			blend_cuda_close(&d);
			return -EIO;
		}
	}
	d->table.name = "cuda";
	d->table.ctx = d;
	d->table.rotate = staged_rotate;
	d->table.deviation = staged_deviation;
	d->table.merge = staged_merge;
	d->table.select = staged_select;
	*out = d;
	return 0;
}

extern "C" void blend_cuda_close(struct blend_cuda **dp)
{
	struct blend_cuda *d = dp ? *dp : NULL;

	if (!d)
		return;
	cudaSetDevice(d->ordinal);
	for (int i = 0; i < LANES; i++) {
		struct lane *l = &d->lanes[i];

		if (l->st) {
			cudaStreamSynchronize(l->st);
			cudaStreamDestroy(l->st);
		}
		blend_cuda_free(d, l->dev, l->dev_cap);
		blend_cuda_host_free(d, l->host);
	}
	pthread_mutex_destroy(&d->lock);
	pthread_cond_destroy(&d->cond);
	free(d);
	*dp = NULL;
}

extern "C" const char *blend_cuda_name(const struct blend_cuda *d)
{
	return d->name;
}

extern "C" bool blend_cuda_blocking_sync(const struct blend_cuda *d)
{
	return d->blocking;
}

extern "C" int blend_cuda_ordinal(const struct blend_cuda *d)
{
	return d->ordinal;
}

extern "C" void blend_cuda_memory(const struct blend_cuda *d, uint64_t *held, uint64_t *total)
{
	*held = __atomic_load_n(&d->held, __ATOMIC_RELAXED);
	*total = d->total;
}

extern "C" void blend_cuda_last_error(struct blend_cuda *d, char *buf, size_t len)
{
	pthread_mutex_lock(&d->lock);
	snprintf(buf, len, "%s", d->last_err);
	pthread_mutex_unlock(&d->lock);
}

extern "C" const struct blend_backend *blend_cuda_backend(struct blend_cuda *d)
{
	return &d->table;
}
