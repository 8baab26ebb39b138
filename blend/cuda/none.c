/* none — the CUDA backend's functions in a build without CUDA (KVB_CUDA off); see cuda.h. */
#include "blend/cuda/cuda.h"

#include <errno.h>
#include <stdio.h>

bool blend_cuda_built(void)
{
	return false;
}

int blend_cuda_open(int ordinal, struct blend_cuda **out, char *err, size_t errlen)
{
	(void)ordinal;
	(void)out;
	snprintf(err, errlen, "built without CUDA (configure with nvcc on PATH, KVB_CUDA=ON)");
	return -ENODEV;
}

const char *blend_cuda_driver_floor(void)
{
	return "built without CUDA";
}

int blend_cuda_driver_version(void)
{
	return -ENODEV;
}

int blend_cuda_probe(int ordinal, char *name, size_t namelen, char *err, size_t errlen)
{
	(void)ordinal;
	(void)name;
	(void)namelen;
	snprintf(err, errlen, "built without CUDA (configure with nvcc on PATH, KVB_CUDA=ON)");
	return -ENODEV;
}

/* Nothing can be opened, so nothing below is ever reached with a device. */
void blend_cuda_close(struct blend_cuda **d)
{
	(void)d;
}

const char *blend_cuda_name(const struct blend_cuda *d)
{
	(void)d;
	return "";
}

int blend_cuda_ordinal(const struct blend_cuda *d)
{
	(void)d;
	return -1;
}

bool blend_cuda_blocking_sync(const struct blend_cuda *d)
{
	(void)d;
	return false;
}

void blend_cuda_memory(const struct blend_cuda *d, uint64_t *held, uint64_t *total)
{
	(void)d;
	*held = *total = 0;
}

void blend_cuda_last_error(struct blend_cuda *d, char *buf, size_t len)
{
	(void)d;
	snprintf(buf, len, "built without CUDA");
}

const struct blend_backend *blend_cuda_backend(struct blend_cuda *d)
{
	(void)d;
	return NULL;
}

const struct blend_device *blend_cuda_device(struct blend_cuda *d)
{
	(void)d;
	return NULL;
}

int blend_cuda_stream_new(struct blend_cuda *d, struct blend_cuda_stream **out)
{
	(void)d;
	(void)out;
	return -ENODEV;
}

void blend_cuda_stream_free(struct blend_cuda_stream **st)
{
	(void)st;
}

int blend_cuda_stream_sync(struct blend_cuda_stream *st)
{
	(void)st;
	return -ENODEV;
}

int blend_cuda_stream_wait(struct blend_cuda_stream *waiter, struct blend_cuda_stream *on)
{
	(void)waiter;
	(void)on;
	return -ENODEV;
}

int blend_cuda_alloc(struct blend_cuda *d, size_t bytes, void **out)
{
	(void)d;
	(void)bytes;
	(void)out;
	return -ENODEV;
}

void blend_cuda_free(struct blend_cuda *d, void *p, size_t bytes)
{
	(void)d;
	(void)p;
	(void)bytes;
}

int blend_cuda_host_alloc(struct blend_cuda *d, size_t bytes, void **out)
{
	(void)d;
	(void)bytes;
	(void)out;
	return -ENODEV;
}

void blend_cuda_host_free(struct blend_cuda *d, void *p)
{
	(void)d;
	(void)p;
}

int blend_cuda_upload(struct blend_cuda_stream *st, void *dev, const void *host, size_t n)
{
	(void)st;
	(void)dev;
	(void)host;
	(void)n;
	return -ENODEV;
}

int blend_cuda_download(struct blend_cuda_stream *st, void *host, const void *dev, size_t n)
{
	(void)st;
	(void)host;
	(void)dev;
	(void)n;
	return -ENODEV;
}

int blend_cuda_copy(struct blend_cuda_stream *st, void *dst, const void *src, size_t n)
{
	(void)st;
	(void)dst;
	(void)src;
	(void)n;
	return -ENODEV;
}

int blend_cuda_rotate_dev(struct blend_cuda_stream *st, const struct blend_shape *s,
			  const struct blend_cuda_table *t, const void *src, void *dst, uint32_t n)
{
	(void)st;
	(void)s;
	(void)t;
	(void)src;
	(void)dst;
	(void)n;
	return -ENODEV;
}

int blend_cuda_rotate_spans_dev(struct blend_cuda_stream *st, const struct blend_shape *s,
				const struct blend_dev_span *spans, uint32_t n_spans,
				uint32_t rows, void *base)
{
	(void)st;
	(void)s;
	(void)spans;
	(void)n_spans;
	(void)rows;
	(void)base;
	return -ENODEV;
}

int blend_cuda_deviation_dev(struct blend_cuda_stream *st, const struct blend_shape *s,
			     const void *fresh, const void *stored, const int32_t *idx, size_t n,
			     float *out)
{
	(void)st;
	(void)s;
	(void)fresh;
	(void)stored;
	(void)idx;
	(void)n;
	(void)out;
	return -ENODEV;
}

size_t blend_cuda_select_scratch(size_t n)
{
	(void)n;
	return 0;
}

int blend_cuda_select_dev(struct blend_cuda_stream *st, const int32_t *cand, const float *dev,
			  size_t n_cand, size_t k, const int32_t *always, size_t n_always,
			  int32_t *out, void *scratch, size_t scratch_bytes, size_t *n_out)
{
	(void)st;
	(void)cand;
	(void)dev;
	(void)n_cand;
	(void)k;
	(void)always;
	(void)n_always;
	(void)out;
	(void)scratch;
	(void)scratch_bytes;
	(void)n_out;
	return -ENODEV;
}

int blend_cuda_scatter_dev(struct blend_cuda_stream *st, const struct blend_shape *s, void *layer,
			   const void *fresh, const int32_t *sel, size_t n_sel)
{
	(void)st;
	(void)s;
	(void)layer;
	(void)fresh;
	(void)sel;
	(void)n_sel;
	return -ENODEV;
}
