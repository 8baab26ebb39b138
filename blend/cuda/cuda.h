/*
 * cuda — the CUDA backend of blend/: the fuse kernels (re-rotation, deviation,
 * HKVD top-k, merge) on an NVIDIA GPU, bit-identical to the CPU backend (they
 * share the per-element math of elem.h), behind a plain-C header. Built when
 * CMake finds nvcc (KVB_CUDA); without it every function here exists and
 * blend_cuda_open() answers -ENODEV "built without CUDA".
 *
 * Two ways in. blend_cuda_backend() fills the backend table (backend.h) on host
 * memory: each call stages its rows through the device and waits; the table
 * is thread-safe (calls take one of a few staging lanes, each with its own
 * stream and buffers). The *_dev functions run on device memory the caller
 * holds (blend_cuda_alloc) and queue on a stream the caller names, for
 * pipelines that keep a layer on the device.
 *
 * A CUDA error is translated once, here: functions return -ENODEV (no usable
 * device), -ENOMEM (device or pinned memory), -EIO (any other CUDA error; the
 * message of the last one is kept for blend_cuda_last_error()), -EINVAL (a shape
 * the kernels do not take, or scratch too small).
 */
#ifndef KVBLEND_BLEND_CUDA_H
#define KVBLEND_BLEND_CUDA_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "blend/backend.h"
#include "blend/device.h"

struct blend_cuda;

/* Whether this build has the CUDA backend compiled in. */
bool blend_cuda_built(void);

/*
 * Open CUDA device `ordinal` for the fuse. Returns 0 and *out, or -ENODEV with the
 * cause in err ("built without CUDA", the driver's own message when there is no
 * driver or device, "device 2 not present: 1 CUDA device"), -ENOMEM or -EIO.
 */
int blend_cuda_open(int ordinal, struct blend_cuda **out, char *err, size_t errlen);

/*
 * Is there a CUDA device `ordinal`? Its name into name, without creating a context
 * on it (no device memory taken). Returns 0, or -ENODEV with the cause in err.
 */
int blend_cuda_probe(int ordinal, char *name, size_t namelen, char *err, size_t errlen);

/*
 * The NVIDIA driver this build's CUDA runtime needs, as one line for logs and
 * --help ("CUDA runtime 13.0 (linked statically) needs NVIDIA driver 580 or
 * newer"); "built without CUDA" without it. Static text: creates no context.
 */
const char *blend_cuda_driver_floor(void);

/*
 * The CUDA version the installed driver supports (cudaDriverGetVersion: 12080
 * for 12.8), 0 when there is no driver, or -ENODEV built without CUDA. A driver
 * older than this build's runtime makes blend_cuda_open() answer -ENODEV.
 */
int blend_cuda_driver_version(void);

/* Wait for the device's work and free everything. Accepts NULL. */
void blend_cuda_close(struct blend_cuda **d);

/* The device's name ("NVIDIA H200"), its ordinal, and its memory. */
const char *blend_cuda_name(const struct blend_cuda *d);
int blend_cuda_ordinal(const struct blend_cuda *d);
/* Whether threads waiting on d sleep (blocking sync, set at open) rather than spin. */
bool blend_cuda_blocking_sync(const struct blend_cuda *d);
/* Device memory this backend holds now (staging and caller allocations), and the
 * device's total. */
void blend_cuda_memory(const struct blend_cuda *d, uint64_t *held, uint64_t *total);

/* Copy the message of the last CUDA error any call on d met ("" if none) into buf. */
void blend_cuda_last_error(struct blend_cuda *d, char *buf, size_t len);

/* The backend table on d (name "cuda"), valid until blend_cuda_close(). */
const struct blend_backend *blend_cuda_backend(struct blend_cuda *d);

/* The device table (device.h, name "cuda") on d, for the daemon's pipelined fuse:
 * the functions below behind one table. Valid until blend_cuda_close(). */
const struct blend_device *blend_cuda_device(struct blend_cuda *d);

/* ---- device memory and streams, for pipelines ---- */

/* A stream of d's (not the legacy default stream). */
struct blend_cuda_stream;
int blend_cuda_stream_new(struct blend_cuda *d, struct blend_cuda_stream **out);
void blend_cuda_stream_free(struct blend_cuda_stream **st);
/* Wait until everything queued on st has run: 0 or -EIO. */
int blend_cuda_stream_sync(struct blend_cuda_stream *st);
/* Make work queued on waiter from now on wait for what is queued on `on` now (an
 * event): copies on one stream, kernels on another, without the host waiting. */
int blend_cuda_stream_wait(struct blend_cuda_stream *waiter, struct blend_cuda_stream *on);

/* Device memory (counted in blend_cuda_memory's held), and pinned host memory. */
int blend_cuda_alloc(struct blend_cuda *d, size_t bytes, void **out);
void blend_cuda_free(struct blend_cuda *d, void *p, size_t bytes);
int blend_cuda_host_alloc(struct blend_cuda *d, size_t bytes, void **out);
void blend_cuda_host_free(struct blend_cuda *d, void *p);

/* Asynchronous copies on st: host to device, device to host, device to device. */
int blend_cuda_upload(struct blend_cuda_stream *st, void *dev, const void *host, size_t n);
int blend_cuda_download(struct blend_cuda_stream *st, void *host, const void *dev, size_t n);
int blend_cuda_copy(struct blend_cuda_stream *st, void *dst, const void *src, size_t n);

/*
 * The kernels on device memory, queued on st; tensors aligned to their element
 * size, index and float arrays to 4 bytes. A rotation table on the device:
 * cos and sin of rows x (rotary_dim / 2) floats, rows 1 or n (then row r of the
 * table rotates row r of src), and its scale.
 */
struct blend_cuda_table {
	const float *cos, *sin;
	uint32_t rows;
	float scale;
};

/* dst[r] = rotate(src[r]) for r in [0, n); src and dst may be the same. */
int blend_cuda_rotate_dev(struct blend_cuda_stream *st, const struct blend_shape *s,
			  const struct blend_cuda_table *t, const void *src, void *dst, uint32_t n);

/* A layer's chunks rotated in place in one launch: device.h's rotate_spans. */
int blend_cuda_rotate_spans_dev(struct blend_cuda_stream *st, const struct blend_shape *s,
				const struct blend_dev_span *spans, uint32_t n_spans,
				uint32_t rows, void *base);

/* out[i] = deviation of fresh row i from stored row idx[i], i in [0, n). */
int blend_cuda_deviation_dev(struct blend_cuda_stream *st, const struct blend_shape *s,
			     const void *fresh, const void *stored, const int32_t *idx, size_t n,
			     float *out);

/*
 * HKVD top-k on the device (CUB radix sort of elem_hkvd_key keys): writes the k
 * chosen of cand (by dev) and all of always, sorted ascending, to out (room for
 * min(k, n_cand) + n_always); *n_out gets that count. scratch: at least
 * blend_cuda_select_scratch(n_cand + n_always) device bytes.
 */
size_t blend_cuda_select_scratch(size_t n); /* 0: CUDA failed; for the current device */
int blend_cuda_select_dev(struct blend_cuda_stream *st, const int32_t *cand, const float *dev,
			  size_t n_cand, size_t k, const int32_t *always, size_t n_always,
			  int32_t *out, void *scratch, size_t scratch_bytes, size_t *n_out);

/* Merge in place: row sel[j] of layer becomes row j of fresh, j in [0, n_sel). */
int blend_cuda_scatter_dev(struct blend_cuda_stream *st, const struct blend_shape *s, void *layer,
			   const void *fresh, const int32_t *sel, size_t n_sel);

#endif
