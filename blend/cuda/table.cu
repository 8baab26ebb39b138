/* table — the CUDA backend's device table (device.h), for the daemon's pipeline: the
 * functions of cuda.cu behind blend_device's pointers, and the landing kernel. */
#include <cuda.h> /* the driver's types only: its functions are looked up in libcuda */
#include <cuda_runtime.h>

#include <dlfcn.h>
#include <errno.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blend/cuda/internal.cuh"
#include "blend/elem.h"

/*
 * Landing: rows[r]'s heads from src (token t's row at t * rb) to another process's
 * cache (blend_dev_land), in words of W (16 bytes when every head, stride and base
 * allows, else 4): one thread a word.
 */
template <typename W>
__global__ void k_land(uint8_t *dst, const uint8_t *src, const int32_t *rows, uint32_t n_rows,
		       uint32_t head0, uint32_t heads, uint32_t wph, uint64_t rb, uint64_t ts,
		       uint64_t hs, uint64_t ps, uint32_t pt, const uint32_t *pages)
{
	uint64_t i = (uint64_t)blockIdx.x * blockDim.x + threadIdx.x;
	uint64_t per_row = (uint64_t)heads * wph;

	if (i >= (uint64_t)n_rows * per_row)
		return;
	{
		uint32_t r = (uint32_t)(i / per_row), rem = (uint32_t)(i % per_row);
		uint32_t h = rem / wph, w = rem % wph, t = (uint32_t)rows[r];
		uint64_t off = pt ? (uint64_t)pages[t / pt] * ps + (uint64_t)(t % pt) * ts
				  : (uint64_t)t * ts;

		((W *)(dst + off + h * hs))[w] =
			((const W *)(src + t * rb + (uint64_t)(head0 + h) * wph * sizeof(W)))[w];
	}
}

/* ---- the table: cuda.cu's functions behind blend_device's pointers ---- */

/* A table's stream is a blend_cuda_stream; an event is this. */
struct blend_event {
	cudaEvent_t e;
};

static struct blend_cuda *D(const struct blend_device *t)
{
	return (struct blend_cuda *)t->ctx;
}

static struct blend_cuda_stream *S(struct blend_stream *st)
{
	return (struct blend_cuda_stream *)st;
}

/*
 * The calling thread works on d's device (a runtime setting per thread). Every
 * function of the table binds first: the daemon's threads call it in any order, and
 * an unbound thread would otherwise start a context on device 0.
 */
static int bind(struct blend_cuda *d)
{
	return cuda_xlate(d, cudaSetDevice(d->ordinal), "cudaSetDevice");
}

static int t_alloc(const struct blend_device *t, size_t bytes, void **out)
{
	return blend_cuda_alloc(D(t), bytes, out);
}

static void t_free(const struct blend_device *t, void *p, size_t bytes)
{
	blend_cuda_free(D(t), p, bytes);
}

static int t_host_alloc(const struct blend_device *t, size_t bytes, void **out)
{
	int rc = bind(D(t));

	return rc ? rc : blend_cuda_host_alloc(D(t), bytes, out);
}

static void t_host_free(const struct blend_device *t, void *p)
{
	if (!bind(D(t)))
		blend_cuda_host_free(D(t), p);
}

/* A refusal is not an error of the device (the caller goes on unpinned): not kept as one. */
static int t_host_register(const struct blend_device *t, void *p, size_t bytes)
{
	int rc = bind(D(t));

	if (!rc && cudaHostRegister(p, bytes, cudaHostRegisterPortable) != cudaSuccess) {
		(void)cudaGetLastError();
		rc = -EIO;
	}
	return rc;
}

static void t_host_unregister(const struct blend_device *t, void *p)
{
	if (!bind(D(t)))
		cudaHostUnregister(p);
}

static int t_stream_new(const struct blend_device *t, struct blend_stream **out)
{
	return blend_cuda_stream_new(D(t), (struct blend_cuda_stream **)out);
}

static void t_stream_free(const struct blend_device *t, struct blend_stream *st)
{
	struct blend_cuda_stream *s = S(st);

	if (!bind(D(t)))
		blend_cuda_stream_free(&s);
}

static int t_stream_sync(const struct blend_device *t, struct blend_stream *st)
{
	int rc = bind(D(t));

	return rc ? rc : blend_cuda_stream_sync(S(st));
}

static int t_event_new(const struct blend_device *t, struct blend_event **out)
{
	struct blend_event *ev = (struct blend_event *)calloc(1, sizeof(*ev));
	int rc;

	if (!ev)
		return -ENOMEM;
	rc = bind(D(t));
	if (!rc)
		rc = cuda_xlate(D(t), cudaEventCreateWithFlags(&ev->e, EVENT_FLAGS),
			   "cudaEventCreate");
	if (rc) {
		free(ev);
		return rc;
	}
	*out = ev;
	return 0;
}

static void t_event_free(const struct blend_device *t, struct blend_event *ev)
{
	if (!ev)
		return;
	if (!bind(D(t)))
		cudaEventDestroy(ev->e);
	free(ev);
}

static int t_event_record(const struct blend_device *t, struct blend_event *ev,
			  struct blend_stream *st)
{
	int rc = bind(D(t));

	return rc ? rc : cuda_xlate(D(t), cudaEventRecord(ev->e, S(st)->st), "cudaEventRecord");
}

static int t_event_wait(const struct blend_device *t, struct blend_stream *st,
			struct blend_event *ev)
{
	int rc = bind(D(t));

	return rc ? rc : cuda_xlate(D(t), cudaStreamWaitEvent(S(st)->st, ev->e, 0),
			       "cudaStreamWaitEvent");
}

static int t_event_sync(const struct blend_device *t, struct blend_event *ev)
{
	int rc = bind(D(t));

	return rc ? rc : cuda_xlate(D(t), cudaEventSynchronize(ev->e), "cudaEventSynchronize");
}

static int t_upload(const struct blend_device *t, struct blend_stream *st, void *dev,
		    const void *host, size_t n)
{
	int rc = bind(D(t));

	return rc ? rc : blend_cuda_upload(S(st), dev, host, n);
}

static int t_upload2d(const struct blend_device *t, struct blend_stream *st, void *dev,
		      size_t dpitch, const void *host, size_t spitch, size_t width, size_t height)
{
	int rc = bind(D(t));

	if (rc || !width || !height)
		return rc;
	return cuda_xlate(D(t), cudaMemcpy2DAsync(dev, dpitch, host, spitch, width, height,
						  cudaMemcpyHostToDevice, S(st)->st),
			  "host-to-device copy (2D)");
}

static int t_download(const struct blend_device *t, struct blend_stream *st, void *host,
		      const void *dev, size_t n)
{
	int rc = bind(D(t));

	return rc ? rc : blend_cuda_download(S(st), host, dev, n);
}

static int t_copy(const struct blend_device *t, struct blend_stream *st, void *dst,
		  const void *src, size_t n)
{
	int rc = bind(D(t));

	return rc ? rc : blend_cuda_copy(S(st), dst, src, n);
}

static int t_zero(const struct blend_device *t, struct blend_stream *st, void *dev, size_t n)
{
	int rc = n ? bind(D(t)) : 0;

	return rc || !n ? rc : cuda_xlate(D(t), cudaMemsetAsync(dev, 0, n, S(st)->st), "cudaMemset");
}

static int t_rotate(const struct blend_device *t, struct blend_stream *st,
		    const struct blend_shape *s, const struct blend_dev_table *tab, const void *src,
		    void *dst, uint32_t n)
{
	struct blend_cuda_table ct = { tab->cos, tab->sin, tab->rows, tab->scale };
	int rc = bind(D(t));

	return rc ? rc : blend_cuda_rotate_dev(S(st), s, &ct, src, dst, n);
}

static int t_rotate_spans(const struct blend_device *t, struct blend_stream *st,
			  const struct blend_shape *s, const struct blend_dev_span *spans,
			  uint32_t n_spans, uint32_t rows, void *base)
{
	int rc = bind(D(t));

	return rc ? rc : blend_cuda_rotate_spans_dev(S(st), s, spans, n_spans, rows, base);
}

static int t_deviation(const struct blend_device *t, struct blend_stream *st,
		       const struct blend_shape *s, const void *fresh, const void *stored,
		       const int32_t *idx, size_t n, float *out)
{
	int rc = bind(D(t));

	return rc ? rc : blend_cuda_deviation_dev(S(st), s, fresh, stored, idx, n, out);
}

static size_t t_select_scratch(const struct blend_device *t, size_t n)
{
	size_t off, cub_bytes;
	cudaError_t e;

	if (bind(D(t)))
		return 0;
	e = cuda_select_layout(n, &off, &cub_bytes);
	if (e != cudaSuccess) {
		cuda_xlate(D(t), e, "select scratch size"); /* last_error says why */
		return 0;
	}
	return off + cub_bytes;
}

static int t_select(const struct blend_device *t, struct blend_stream *st, const int32_t *cand,
		    const float *dev, size_t n_cand, size_t k, const int32_t *always,
		    size_t n_always, int32_t *out, void *scratch, size_t scratch_bytes,
		    size_t *n_out)
{
	int rc = bind(D(t));

	return rc ? rc : blend_cuda_select_dev(S(st), cand, dev, n_cand, k, always, n_always,
					       out, scratch, scratch_bytes, n_out);
}

static int t_scatter(const struct blend_device *t, struct blend_stream *st,
		     const struct blend_shape *s, void *layer, const void *fresh,
		     const int32_t *sel, size_t n_sel)
{
	int rc = bind(D(t));

	return rc ? rc : blend_cuda_scatter_dev(S(st), s, layer, fresh, sel, n_sel);
}

static int t_ipc_export(const struct blend_device *t, void *dev, uint8_t handle[64], char *pci,
			size_t pcilen)
{
	cudaIpcMemHandle_t h;
	int rc = bind(D(t));

	static_assert(sizeof(h) == 64, "a CUDA IPC memory handle is 64 bytes");
	if (!rc)
		rc = cuda_xlate(D(t), cudaIpcGetMemHandle(&h, dev), "cudaIpcGetMemHandle");
	if (!rc)
		rc = cuda_xlate(D(t), cudaDeviceGetPCIBusId(pci, (int)pcilen, D(t)->ordinal),
			   "cudaDeviceGetPCIBusId");
	if (!rc)
		memcpy(handle, &h, sizeof(h));
	return rc;
}

/*
 * The calling thread on d's device, and the other process's memory on it: 0; -ENODEV
 * when pci (the bus id the other process names its device by) is another device's.
 */
static int on_this_device(struct blend_cuda *d, const char *pci)
{
	char mine[32];
	int rc = bind(d);

	if (!rc)
		rc = cuda_xlate(d, cudaDeviceGetPCIBusId(mine, (int)sizeof(mine), d->ordinal),
				"cudaDeviceGetPCIBusId");
	return rc ? rc : strcasecmp(mine, pci) ? -ENODEV : 0;
}

/* d's last error, for a failure the runtime did not report. Returns rc. */
static int say(struct blend_cuda *d, int rc, const char *msg)
{
	pthread_mutex_lock(&d->lock);
	snprintf(d->last_err, sizeof(d->last_err), "%s", msg);
	pthread_mutex_unlock(&d->lock);
	return rc;
}

/* The driver's cuMemGetAddressRange_v2 (libcuda, loaded already by the runtime), or NULL. */
typedef int (*addr_range_fn)(unsigned long long *base, size_t *size, unsigned long long ptr);

static addr_range_fn addr_range(void)
{
	static addr_range_fn fn;
	static pthread_once_t once = PTHREAD_ONCE_INIT;

	pthread_once(&once, [] {
		void *drv = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);

		if (drv)
			fn = (addr_range_fn)dlsym(drv, "cuMemGetAddressRange_v2");
	});
	return fn;
}

static int t_ipc_open(const struct blend_device *t, const uint8_t handle[64], const char *pci,
		      void **dev, uint64_t *bytes)
{
	struct blend_cuda *d = D(t);
	cudaIpcMemHandle_t h;
	unsigned long long base = 0;
	size_t size = 0;
	void *p = NULL;
	addr_range_fn range = addr_range();
	int rc = on_this_device(d, pci);

	if (rc)
		return rc;
	if (!range)
		return say(d, -ENOTSUP, "the driver has no cuMemGetAddressRange_v2: an imported "
			   "allocation's size is unknown");
	memcpy(&h, handle, sizeof(h));
	rc = cuda_xlate(d, cudaIpcOpenMemHandle(&p, h, cudaIpcMemLazyEnablePeerAccess),
		   "cudaIpcOpenMemHandle");
	if (rc)
		return rc;
	if (range(&base, &size, (unsigned long long)(uintptr_t)p) != 0 ||
	    base != (unsigned long long)(uintptr_t)p) {
		(void)cudaIpcCloseMemHandle(p);
		return say(d, -EIO, "cuMemGetAddressRange_v2 did not give the imported "
			   "allocation's size");
	}
	*dev = p;
	*bytes = size;
	return 0;
}

static void t_ipc_close(const struct blend_device *t, void *dev, uint64_t bytes)
{
	(void)bytes;
	if (dev && !bind(D(t)))
		(void)cuda_xlate(D(t), cudaIpcCloseMemHandle(dev), "cudaIpcCloseMemHandle");
}

/*
 * The driver's virtual memory functions (libcuda, loaded already by the runtime), for
 * memory another process exported as POSIX fds (cuMemExportToShareableHandle): import
 * each segment's allocation, map it at its offset of a range reserved here, allow this
 * device to read and write it. NULL members when the driver has not got them.
 */
struct vmm_fns {
	CUresult (*import)(CUmemGenericAllocationHandle *, void *, CUmemAllocationHandleType);
	CUresult (*reserve)(CUdeviceptr *, size_t, size_t, CUdeviceptr, unsigned long long);
	CUresult (*free_range)(CUdeviceptr, size_t);
	CUresult (*map)(CUdeviceptr, size_t, size_t, CUmemGenericAllocationHandle,
			unsigned long long);
	CUresult (*unmap)(CUdeviceptr, size_t);
	CUresult (*set_access)(CUdeviceptr, size_t, const CUmemAccessDesc *, size_t);
	CUresult (*release)(CUmemGenericAllocationHandle);
	CUresult (*granularity)(size_t *, const CUmemAllocationProp *,
				CUmemAllocationGranularity_flags);
};

static const struct vmm_fns *vmm(void)
{
	static struct vmm_fns f;
	static bool ok;
	static pthread_once_t once = PTHREAD_ONCE_INIT;

	pthread_once(&once, [] {
		void *drv = dlopen("libcuda.so.1", RTLD_LAZY | RTLD_NOLOAD);

		if (!drv)
			return;
		*(void **)&f.import = dlsym(drv, "cuMemImportFromShareableHandle");
		*(void **)&f.reserve = dlsym(drv, "cuMemAddressReserve");
		*(void **)&f.free_range = dlsym(drv, "cuMemAddressFree");
		*(void **)&f.map = dlsym(drv, "cuMemMap");
		*(void **)&f.unmap = dlsym(drv, "cuMemUnmap");
		*(void **)&f.set_access = dlsym(drv, "cuMemSetAccess");
		*(void **)&f.release = dlsym(drv, "cuMemRelease");
		*(void **)&f.granularity = dlsym(drv, "cuMemGetAllocationGranularity");
		ok = f.import && f.reserve && f.free_range && f.map && f.unmap && f.set_access &&
		     f.release && f.granularity;
	});
	return ok ? &f : NULL;
}

/* What t_fd_open mapped: the range and each segment's mapping in it. */
struct vmm_import {
	CUdeviceptr base;
	size_t range;
	size_t n;
	struct {
		size_t off, len;
	} seg[];
};

static void vmm_import_free(const struct vmm_fns *f, struct vmm_import *m)
{
	for (size_t k = 0; k < m->n; k++)
		(void)f->unmap(m->base + m->seg[k].off, m->seg[k].len);
	if (m->base)
		(void)f->free_range(m->base, m->range);
	free(m);
}

static int vmm_fail(struct blend_cuda *d, const char *what, CUresult r)
{
	char msg[160];

	snprintf(msg, sizeof(msg), "%s: CUDA driver error %d", what, (int)r);
	return say(d, r == CUDA_ERROR_OUT_OF_MEMORY ? -ENOMEM : -EIO, msg);
}

static int t_fd_open(const struct blend_device *t, const struct blend_fd_seg *segs, size_t n,
		     const char *pci, uint64_t want_bytes, void **dev, uint64_t *bytes,
		     void **ctx)
{
	struct blend_cuda *d = D(t);
	const struct vmm_fns *f = vmm();
	CUmemAllocationProp prop = {};
	CUmemAccessDesc access = {};
	struct vmm_import *m;
	size_t gran = 0, end = 0;
	CUresult r;
	int rc = on_this_device(d, pci);

	if (rc)
		return rc;
	if (!f)
		return say(d, -ENOTSUP, "the driver has no virtual memory functions "
			   "(cuMemImportFromShareableHandle, cuMemMap)");
	if (!n)
		return -EINVAL;
	prop.type = CU_MEM_ALLOCATION_TYPE_PINNED;
	prop.location.type = CU_MEM_LOCATION_TYPE_DEVICE;
	prop.location.id = d->ordinal;
	prop.requestedHandleTypes = CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR;
	r = f->granularity(&gran, &prop, CU_MEM_ALLOC_GRANULARITY_MINIMUM);
	if (r != CUDA_SUCCESS || !gran)
		return vmm_fail(d, "cuMemGetAllocationGranularity", r);
	m = (struct vmm_import *)calloc(1, sizeof(*m) + n * sizeof(m->seg[0]));
	if (!m)
		return -ENOMEM;
	/* each segment's length: its own, or (one alone, of size 0) the node's word; whole
	 * granules, which the exporter's allocation holds (cuMemMap refuses past its end) */
	for (size_t k = 0; k < n; k++) {
		uint64_t len = segs[k].size ? segs[k].size : want_bytes;

		if (!len || segs[k].offset % gran || len > SIZE_MAX - gran) {
			free(m);
			return -EINVAL;
		}
		m->seg[k].off = (size_t)segs[k].offset;
		m->seg[k].len = (size_t)((len + gran - 1) / gran * gran);
		end = m->seg[k].off + m->seg[k].len; /* (in order: the daemon checked) */
	}
	m->range = end;
	r = f->reserve(&m->base, m->range, gran, 0, 0);
	if (r != CUDA_SUCCESS) {
		m->base = 0;
		vmm_import_free(f, m);
		return vmm_fail(d, "cuMemAddressReserve", r);
	}
	access.location = prop.location;
	access.flags = CU_MEM_ACCESS_FLAGS_PROT_READWRITE;
	for (size_t k = 0; k < n; k++) {
		CUmemGenericAllocationHandle h;

		r = f->import(&h, (void *)(uintptr_t)segs[k].fd,
			      CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR);
		if (r != CUDA_SUCCESS) {
			m->n = k;
			vmm_import_free(f, m);
			return vmm_fail(d, "cuMemImportFromShareableHandle", r);
		}
		r = f->map(m->base + m->seg[k].off, m->seg[k].len, 0, h, 0);
		(void)f->release(h); /* the mapping holds the allocation from now on */
		if (r != CUDA_SUCCESS) {
			m->n = k;
			vmm_import_free(f, m);
			return vmm_fail(d, "cuMemMap of a segment (past its allocation's end?)", r);
		}
		m->n = k + 1;
		r = f->set_access(m->base + m->seg[k].off, m->seg[k].len, &access, 1);
		if (r != CUDA_SUCCESS) {
			vmm_import_free(f, m);
			return vmm_fail(d, "cuMemSetAccess", r);
		}
	}
	*dev = (void *)(uintptr_t)m->base;
	*bytes = m->range;
	*ctx = m;
	return 0;
}

static void t_fd_close(const struct blend_device *t, void *dev, uint64_t bytes, void *ctx)
{
	const struct vmm_fns *f = vmm();

	(void)dev;
	(void)bytes;
	if (ctx && f && !bind(D(t)))
		vmm_import_free(f, (struct vmm_import *)ctx);
}

static int t_land(const struct blend_device *t, struct blend_stream *st,
		  const struct blend_shape *s, const struct blend_dev_land *L, const void *src,
		  const int32_t *rows, uint32_t n_rows)
{
	size_t hb = (size_t)s->head_dim * blend_dtype_size(s->dtype);
	size_t rb = (size_t)s->heads * hb;
	uintptr_t all = (uintptr_t)L->dst | (uintptr_t)src | L->token_stride | L->head_stride |
			L->page_stride | hb;
	bool wide = all % 16 == 0;
	uint32_t wph = (uint32_t)(wide ? hb / 16 : hb / 4);
	uint32_t heads = L->heads ? L->heads : s->heads;
	uint64_t threads = (uint64_t)n_rows * heads * wph;
	int rc = bind(D(t));

	if (rc)
		return rc;
	if (!hb || all % 4 || (uint64_t)L->head0 + heads > s->heads)
		return -EINVAL;
	if (!threads)
		return 0;
	if (wide)
		k_land<uint4><<<blocks_for(threads, 256), 256, 0, S(st)->st>>>(
			L->dst, (const uint8_t *)src, rows, n_rows, L->head0, heads, wph, rb,
			L->token_stride, L->head_stride, L->page_stride, L->page_tokens, L->pages);
	else
		k_land<uint32_t><<<blocks_for(threads, 256), 256, 0, S(st)->st>>>(
			L->dst, (const uint8_t *)src, rows, n_rows, L->head0, heads, wph, rb,
			L->token_stride, L->head_stride, L->page_stride, L->page_tokens, L->pages);
	return cuda_xlate(D(t), cudaGetLastError(), "land kernel");
}

static void t_memory(const struct blend_device *t, uint64_t *held, uint64_t *total)
{
	blend_cuda_memory(D(t), held, total);
}

static void t_last_error(const struct blend_device *t, char *buf, size_t len)
{
	blend_cuda_last_error(D(t), buf, len);
}

static bool t_broken(const struct blend_device *t)
{
	return __atomic_load_n(&D(t)->broken, __ATOMIC_RELAXED);
}

extern "C" const struct blend_device *blend_cuda_device(struct blend_cuda *d)
{
	struct blend_device *t = &d->dtable;

	t->name = "cuda";
	t->ctx = d;
	t->alloc = t_alloc;
	t->free = t_free;
	t->host_alloc = t_host_alloc;
	t->host_free = t_host_free;
	t->host_register = t_host_register;
	t->host_unregister = t_host_unregister;
	t->stream_new = t_stream_new;
	t->stream_free = t_stream_free;
	t->stream_sync = t_stream_sync;
	t->event_new = t_event_new;
	t->event_free = t_event_free;
	t->event_record = t_event_record;
	t->event_wait = t_event_wait;
	t->event_sync = t_event_sync;
	t->upload = t_upload;
	t->upload2d = t_upload2d;
	t->download = t_download;
	t->copy = t_copy;
	t->zero = t_zero;
	t->rotate = t_rotate;
	t->rotate_spans = t_rotate_spans;
	t->deviation = t_deviation;
	t->select_scratch = t_select_scratch;
	t->select = t_select;
	t->scatter = t_scatter;
	t->ipc_export = t_ipc_export;
	t->ipc_open = t_ipc_open;
	t->ipc_close = t_ipc_close;
	t->fd_open = t_fd_open;
	t->fd_close = t_fd_close;
	t->land = t_land;
	t->memory = t_memory;
	t->last_error = t_last_error;
	t->broken = t_broken;
	return t;
}
