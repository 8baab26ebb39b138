/*
 * backend — the table of functions a compute backend implements for the fuse:
 * re-rotating stored keys, measuring per-token KV deviation, and merging fresh
 * rows into stored ones. The CPU backend (cpu.c) is always built and is the
 * reference; the CUDA backend (cuda/cuda.h) implements the same table on its
 * device, bit-identical to it.
 *
 * Tensors are row-major [rows, heads, head_dim] in the model's dtype, in host
 * memory: a device backend stages them itself. Every function works on a range
 * of rows so that callers can split work across threads.
 *
 * Tensor pointers (src, dst, fresh, stored, and merge's out) may have any
 * alignment, odd addresses included: they point into payload frames and
 * shared-memory segments, which guarantee none. Index arrays (idx, sel) and
 * deviation's float out are the caller's own and naturally aligned.
 */
#ifndef KVBLEND_BLEND_BACKEND_H
#define KVBLEND_BLEND_BACKEND_H

#include <stddef.h>
#include <stdint.h>

#include "blend/rope.h"

enum blend_dtype { BLEND_F16 = 1, BLEND_BF16 = 2, BLEND_F32 = 3 };

/* Bytes per element of a dtype; 0 for an unknown one. */
static inline size_t blend_dtype_size(enum blend_dtype dt)
{
	return dt == BLEND_F32 ? 4 : (dt == BLEND_F16 || dt == BLEND_BF16) ? 2 : 0;
}

/*
 * Where rotate_to writes its rows: row r's head h at dst + r * row_stride +
 * h * head_stride (a node's own cache: paged, heads apart). With stream set the
 * stores may bypass the CPU's caches (non-temporal: for rows no one reads soon);
 * the caller then calls blend_stream_fence() before another thread reads them.
 */
struct blend_out {
	size_t row_stride;
	size_t head_stride;
	int stream;
};

struct blend_shape {
	uint32_t heads;
	uint32_t head_dim;
	uint32_t rotary_dim;
	enum rope_style style;
	enum blend_dtype dtype;
};

/*
 * Every function returns 0, or -EIO when the device failed (a CUDA error: the
 * outputs are then undefined and the caller fails its request); the CPU
 * backend's never fail. None allocates on the host, logs or keeps state between
 * calls that the caller can see. Each takes the table it was reached through.
 */
struct blend_backend {
	const char *name;
	void *ctx; /* the backend's own state (the CUDA device); NULL for the CPU */
	/*
	 * Rotate rows [row0, row0 + n) of a chunk's keys: dst[r] = rotate(src[r]) by
	 * table row (t->rows == 1 ? 0 : row0 + r), scaled by t->scale; dims from
	 * rotary_dim on are copied unchanged. src and dst point at row row0 and may
	 * be the same memory. Arithmetic in fp32 (elem_rotate_pair), stored rounded
	 * to nearest even.
	 */
	int (*rotate)(const struct blend_backend *be, const struct blend_shape *s,
		      const struct rope_table *t, const void *src, void *dst, uint32_t row0,
		      uint32_t n);
	/*
	 * out[i] = sum over heads x head_dim of (fresh[i] - stored[idx[i]])^2, in
	 * fp32 in the lane order of elem.h, for i in [0, n): fresh rows are
	 * consecutive, stored rows are picked by idx from an array of rows (idx
	 * NULL: stored row i, as the CUDA kernels take it).
	 */
	int (*deviation)(const struct blend_backend *be, const struct blend_shape *s,
			 const void *fresh, const void *stored, const int32_t *idx, size_t n,
			 float *out);
	/*
	 * out rows [row0, row0 + n) of the fused layer: row t is fresh[j] where
	 * sel[j] == t (sel sorted ascending, n_sel entries), else stored[t]. out,
	 * stored point at row 0 of their arrays; fresh at the row of sel[0].
	 */
	int (*merge)(const struct blend_backend *be, const struct blend_shape *s,
		     const void *stored, const void *fresh, const int32_t *sel, size_t n_sel,
		     void *out, size_t row0, size_t n);
	/*
	 * HKVD's top-k with hkvd_select()'s contract (hkvd.h): the k candidates of
	 * largest deviation (ties to the lower index, NaN largest) and every token of
	 * always, sorted ascending into out. Returns the count, -ENOMEM or -EIO.
	 */
	long (*select)(const struct blend_backend *be, const int32_t *cand, const float *dev,
		       size_t n_cand, size_t k, const int32_t *always, size_t n_always,
		       int32_t *out);
	/*
	 * rotate, with each output row and head placed by out (struct blend_out): the
	 * same bits as rotate into contiguous rows and a copy of each head. src rows
	 * are contiguous as rotate's; src and dst must not overlap unless out is
	 * rotate's own contiguous layout. NULL where the backend cannot write host
	 * memory in place (a device backend): the caller rotates, then copies.
	 */
	int (*rotate_to)(const struct blend_backend *be, const struct blend_shape *s,
			 const struct rope_table *t, const void *src, void *dst,
			 const struct blend_out *out, uint32_t row0, uint32_t n);
};

/*
 * Make the non-temporal stores this thread issued (rotate_to with stream,
 * blend_stream_copy) visible before what it publishes next: a store fence on x86.
 */
void blend_stream_fence(void);

/*
 * memcpy of n bytes, with non-temporal stores where dst and n are whole cache
 * lines (64 bytes) on x86; a plain memcpy elsewhere. Fence with
 * blend_stream_fence() as above.
 */
void blend_stream_copy(void *dst, const void *src, size_t n);

/* The CPU backend with the widest SIMD this CPU has (AVX-512, AVX2+F16C, or the
 * baseline). All give bit-identical results. Its name says which ("cpu-avx2"). */
const struct blend_backend *blend_cpu_backend(void);

/* The CPU backend built for one instruction set ("avx512", "avx2", "baseline"), or
 * NULL when this CPU lacks it. For tests and benchmarks. */
const struct blend_backend *blend_cpu_backend_isa(const char *isa);

#endif
