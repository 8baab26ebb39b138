/*
 * device — the table a pipelined fuse drives a compute device through: device
 * memory, streams and events, asynchronous copies, and the fuse kernels on
 * device memory. The CUDA backend fills it for its GPU (blend_cuda_device() in
 * cuda/cuda.h); emu.c fills it with host memory and the CPU kernels, running
 * every call at once, so that the daemon's device path runs (and is tested)
 * where there is no GPU.
 *
 * Work queued on one stream runs in order; work on different streams may
 * overlap unless an event orders it. Pointers named dev are device memory from
 * alloc; host pointers may be any host memory, and copies from pinned memory
 * (host_alloc, or host_register'ed) are the fast ones. Tensors on the device
 * are aligned to their element size, index and float arrays to 4 bytes.
 *
 * Every function returns 0 or a negative errno: -ENOMEM (device or pinned
 * memory), -EIO (the device failed: last_error says how; outputs undefined),
 * -EINVAL (a shape the kernels do not take, or scratch too small).
 */
#ifndef KVBLEND_BLEND_DEVICE_H
#define KVBLEND_BLEND_DEVICE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "blend/backend.h"

struct blend_stream;
struct blend_event;

/* A rotation table in device memory: cos and sin of rows x (rotary_dim / 2) floats,
 * rows 1 or n (then row r rotates row r of the rows given), and its scale. */
struct blend_dev_table {
	const float *cos, *sin;
	uint32_t rows;
	float scale;
};

/*
 * One chunk of a layer's batched rotation (rotate_spans): rows [off, off + tokens)
 * of the layer, rotated by t (t.rows 1, or tokens: then row r of t rotates row
 * off + r); first: the rows of the spans before this one (a prefix sum).
 */
struct blend_dev_span {
	struct blend_dev_table t;
	uint32_t off, tokens, first;
};

/*
 * Where land() writes one tensor (K or V) of a layer in another process's cache:
 * row t's head h starts at dst + page(t) * page_stride + slot(t) * token_stride +
 * h * head_stride, where page(t) = pages[t / page_tokens] and slot(t) = t %
 * page_tokens when page_tokens > 0, else page(t) = 0 and slot(t) = t. pages: device
 * memory. A head's head_dim elements are contiguous. (With head0, heads: h counts
 * the cache's heads.)
 */
struct blend_dev_land {
	uint8_t *dst;
	uint64_t token_stride, head_stride, page_stride;
	uint32_t page_tokens;
	const uint32_t *pages;
	/* the cache's heads h = 0 .. heads - 1 are src's heads head0 + h (a tensor-parallel
	 * rank's range); heads 0: all of them */
	uint32_t head0, heads;
};

/* One descriptor of memory another process handed over, at its place in the extent. */
struct blend_fd_seg {
	int fd;
	uint64_t offset, size; /* size 0: the whole file (one segment alone) */
};

struct blend_device {
	const char *name; /* "cuda", "emulated" */
	void *ctx;

	int (*alloc)(const struct blend_device *d, size_t bytes, void **dev);
	void (*free)(const struct blend_device *d, void *dev, size_t bytes);
	int (*host_alloc)(const struct blend_device *d, size_t bytes, void **host);
	void (*host_free)(const struct blend_device *d, void *host);
	/* Pin host memory the caller already has (a shared-memory segment). */
	int (*host_register)(const struct blend_device *d, void *host, size_t bytes);
	void (*host_unregister)(const struct blend_device *d, void *host);

	int (*stream_new)(const struct blend_device *d, struct blend_stream **out);
	void (*stream_free)(const struct blend_device *d, struct blend_stream *st);
	int (*stream_sync)(const struct blend_device *d, struct blend_stream *st);
	int (*event_new)(const struct blend_device *d, struct blend_event **out);
	void (*event_free)(const struct blend_device *d, struct blend_event *ev);
	/* ev marks what is queued on st now; wait: st's later work waits for it; sync:
	 * the host does. */
	int (*event_record)(const struct blend_device *d, struct blend_event *ev,
			    struct blend_stream *st);
	int (*event_wait)(const struct blend_device *d, struct blend_stream *st,
			  struct blend_event *ev);
	int (*event_sync)(const struct blend_device *d, struct blend_event *ev);

	int (*upload)(const struct blend_device *d, struct blend_stream *st, void *dev,
		      const void *host, size_t n);
	/* height rows of width bytes, host's at spitch, to dev at dpitch (a head range of each
	 * of a layer's rows, packed) */
	int (*upload2d)(const struct blend_device *d, struct blend_stream *st, void *dev,
			size_t dpitch, const void *host, size_t spitch, size_t width,
			size_t height);
	int (*download)(const struct blend_device *d, struct blend_stream *st, void *host,
			const void *dev, size_t n);
	/* Device memory to device memory (the references benchmarks measure against). */
	int (*copy)(const struct blend_device *d, struct blend_stream *st, void *dst,
		    const void *src, size_t n);
	int (*zero)(const struct blend_device *d, struct blend_stream *st, void *dev, size_t n);

	/* The kernels, with the contracts of cuda.h's *_dev functions. */
	int (*rotate)(const struct blend_device *d, struct blend_stream *st,
		      const struct blend_shape *s, const struct blend_dev_table *t, const void *src,
		      void *dst, uint32_t n);
	/*
	 * A layer's chunks in one launch: every span's rows of the layer at base rotated
	 * in place (dims from rotary_dim on unchanged), as rotate() does per span. spans:
	 * n_spans entries in device memory, in order of first, not overlapping; rows:
	 * their tokens together (the last first + tokens).
	 */
	int (*rotate_spans)(const struct blend_device *d, struct blend_stream *st,
			    const struct blend_shape *s, const struct blend_dev_span *spans,
			    uint32_t n_spans, uint32_t rows, void *base);
	int (*deviation)(const struct blend_device *d, struct blend_stream *st,
			 const struct blend_shape *s, const void *fresh, const void *stored,
			 const int32_t *idx, size_t n, float *out);
	/* Scratch bytes a select over n tokens needs; 0 when the device cannot say. */
	size_t (*select_scratch)(const struct blend_device *d, size_t n);
	int (*select)(const struct blend_device *d, struct blend_stream *st, const int32_t *cand,
		      const float *dev, size_t n_cand, size_t k, const int32_t *always,
		      size_t n_always, int32_t *out, void *scratch, size_t scratch_bytes,
		      size_t *n_out);
	int (*scatter)(const struct blend_device *d, struct blend_stream *st,
		       const struct blend_shape *s, void *layer, const void *fresh,
		       const int32_t *sel, size_t n_sel);

	/*
	 * Export the allocation at dev (an alloc'd pointer) to other processes on this
	 * machine: its CUDA IPC memory handle, and the device's PCI bus id, by which
	 * the other process finds the device in its own numbering. NULL where the
	 * device cannot. (The emulated device's handle maps nowhere: bus id "emulated".)
	 */
	int (*ipc_export)(const struct blend_device *d, void *dev, uint8_t handle[64], char *pci,
			  size_t pcilen);

	/*
	 * Map another process's allocation on this device by its CUDA IPC memory handle:
	 * *dev its base in this process, *bytes its size (the driver's, not the
	 * caller's word). pci: the bus id the other process names its device by;
	 * -ENODEV when that is not this device. ipc_close unmaps it. NULL where the
	 * device cannot (the emulated device: it takes descriptors only).
	 */
	int (*ipc_open)(const struct blend_device *d, const uint8_t handle[64], const char *pci,
			void **dev, uint64_t *bytes);
	void (*ipc_close)(const struct blend_device *d, void *dev, uint64_t bytes);
	/*
	 * Map memory another process handed over as descriptors (its caller keeps the
	 * fds; the mapping does not need them afterwards): segs[0..n) each at its offset
	 * of one extent, mapped at the same offsets of one range here (*dev its start,
	 * *bytes its length, *ctx what fd_close needs), as another process reserves one
	 * range of addresses and backs each segment by its own allocation. want_bytes:
	 * the other process's word for the extent where the descriptors cannot tell it
	 * (CUDA's exported allocations: their mapping is refused when it passes their
	 * end). pci: as ipc_open (-ENODEV). The emulated device maps memfds sealed
	 * against shrinking, shared (a size of 0 for one alone: the whole file), as
	 * nodemem.c makes them; -EPERM for any other file or a segment past its file's
	 * end. CUDA maps allocations exported by cuMemExportToShareableHandle (POSIX
	 * fds). NULL where the device cannot.
	 */
	int (*fd_open)(const struct blend_device *d, const struct blend_fd_seg *segs, size_t n,
		       const char *pci, uint64_t want_bytes, void **dev, uint64_t *bytes,
		       void **ctx);
	void (*fd_close)(const struct blend_device *d, void *dev, uint64_t bytes, void *ctx);
	/*
	 * Landing: rows rows[0 .. n_rows) (token indices, device memory) of src (device
	 * memory, token t's row at src + t * heads * head_dim * dtype size) written
	 * where L says, as the host's landing writes a node's buffers. -EINVAL for a
	 * shape or alignment the kernel does not take (head_dim * dtype size and the
	 * strides must be multiples of 4).
	 */
	int (*land)(const struct blend_device *d, struct blend_stream *st,
		    const struct blend_shape *s, const struct blend_dev_land *L, const void *src,
		    const int32_t *rows, uint32_t n_rows);

	/* Device memory held through this table (and by the backend), and the total. */
	void (*memory)(const struct blend_device *d, uint64_t *held, uint64_t *total);
	/* The message of the last failure ("" if none). */
	void (*last_error)(const struct blend_device *d, char *buf, size_t len);
	/*
	 * Whether the device failed for good: a sticky error (CUDA's illegal address, a
	 * kernel's fault) after which every call fails until the process restarts. Its
	 * user stops giving it work; last_error names the failure.
	 */
	bool (*broken)(const struct blend_device *d);
};

/*
 * The emulated device: host memory for device memory, the CPU backend's kernels,
 * every call done when it returns. fail_after > 0 makes the fail_after-th call
 * that queues work (a copy or a kernel) fail with -EIO, as a device error would:
 * for tests of how callers survive one. With sticky, that failure is a sticky
 * one, as CUDA's illegal address is: every later call that queues work or
 * synchronizes fails too, and broken() says so. Where the environment names a
 * file in KVBLEND_EMULATED_LOG, the device appends a line "WHAT ADDR" to it for
 * each alloc, free, host_alloc, host_free, host_register ("register") and
 * host_unregister ("unregister"), and for each copy from or to host memory that is
 * neither host_alloc'd nor registered ("pageable_upload", "pageable_download": on
 * a GPU, a copy that blocks and runs slowly): tests of when an exported block is
 * freed and of what a session allocates, pins and copies. With
 * KVBLEND_EMULATED_SCRATCH_FAIL=1 in the environment, select_scratch answers 0 (the
 * device cannot say), as CUB's size query does when it fails. Returns 0 or -ENOMEM.
 */
int blend_emu_open(uint64_t fail_after, bool sticky, struct blend_device **out);
void blend_emu_close(struct blend_device **d);

/*
 * Where the daemon's fuse sessions keep their rings (blend/devices.c): the one way the
 * daemon reaches a device, CUDA or emulated, so that nothing outside blend/ calls the
 * CUDA backend by name. which: BLEND_DEVICE_CPU (none), BLEND_DEVICE_AUTO (CUDA device
 * 0 when it is there and usable, else none), BLEND_DEVICE_EMULATED (the emulated
 * device, with emu's test hooks), or a CUDA ordinal (that device, or the open fails).
 */
#define BLEND_DEVICE_AUTO (-2)
#define BLEND_DEVICE_CPU (-1)
#define BLEND_DEVICE_EMULATED (-3)

struct blend_devices;

/* The emulated device's test hooks (blend_emu_open). */
struct blend_emu_opts {
	uint64_t fail_after;
	bool sticky;
	bool as_auto; /* sessions placed as device auto places them (dev_host false) */
};

/* What blend_devices_open() chose, and the lines that say so for the daemon's log. */
struct blend_devices_info {
	const struct blend_device *dev; /* NULL: sessions on the host (the CPU backend) */
	/* Sessions whose node takes its layers in host memory run on dev too (a device
	 * named, or emulated); false under device auto (no PCIe round trip). */
	bool dev_host;
	const char *model; /* the hardware's name ("NVIDIA H200"), "" without CUDA */
	int ordinal;	   /* the CUDA ordinal, -1 without CUDA */
	int level;	   /* of line: 0 info, 1 warning, 2 error (the open failed) */
	char line[1024];   /* what was chosen and why (the driver floor included) */
	char line2[256];   /* a second info line, or "" */
};

/*
 * Open the device for which: 0 (info filled, *out set, possibly with no device), or
 * -ENODEV (a named CUDA device is not usable: info->line says why) or -ENOMEM. cpu is
 * the CPU backend's name, for the lines. *out is closed with blend_devices_close()
 * after every session that used its device.
 */
int blend_devices_open(int which, const char *cpu, const struct blend_emu_opts *emu,
		       struct blend_devices **out, struct blend_devices_info *info);
/* Accepts NULL; sets *d to NULL. */
void blend_devices_close(struct blend_devices **d);
/* Whether this build has the CUDA backend, and the NVIDIA driver its runtime needs
 * (one line, static text: for --help). */
bool blend_devices_cuda_built(void);
const char *blend_devices_cuda_floor(void);

#endif
