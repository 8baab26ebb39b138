/*
 * internal — what the CUDA backend's two units share (cuda.cu: kernels, device state,
 * the staged table; table.cu: the device table the daemon's pipeline calls). Not a
 * public header: blend/cuda/cuda.h is.
 */
#ifndef KVB_BLEND_CUDA_INTERNAL_CUH
#define KVB_BLEND_CUDA_INTERNAL_CUH

#include <cuda_runtime.h>

#include <pthread.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

extern "C" {
#include "blend/cuda/cuda.h"
}

/* Host calls that stage rows through the device run on one of these at a time. */
#define LANES 4
/* Events time nothing, and a host that waits on one sleeps instead of spinning. */
#define EVENT_FLAGS (cudaEventDisableTiming | cudaEventBlockingSync)
/* Device buffers are carved at this alignment (the widest vector access, with room). */
#define ALIGN 256

struct lane {
	cudaStream_t st;
	uint8_t *dev; /* device staging */
	uint8_t *host; /* pinned staging (gathers) */
	size_t dev_cap, host_cap;
	bool busy;
};

struct blend_cuda {
	int ordinal;
	char name[256];
	uint64_t total;
	uint64_t held; /* __atomic */
	struct blend_backend table;
	struct blend_device dtable;
	pthread_mutex_t lock; /* lanes, last_err */
	pthread_cond_t cond;
	struct lane lanes[LANES];
	char last_err[256];
	bool broken; /* __atomic: a sticky error; every later call fails until a restart */
	bool blocking; /* waiting threads sleep (cudaDeviceScheduleBlockingSync) */
};

struct blend_cuda_stream {
	struct blend_cuda *d;
	cudaStream_t st;
	cudaEvent_t ev; /* recorded for blend_cuda_stream_wait (0 in a lane's stand-in) */
};

/*
 * e as an errno (0 on success), with what failed kept for blend_cuda_last_error; a
 * sticky error marks d broken. cudaError_t stops here.
 */
int cuda_xlate(struct blend_cuda *d, cudaError_t e, const char *what);

/*
 * The select pass's scratch for n candidates: CUB's radix sort at *cub_off, *cub_bytes
 * long, after the keys.
 */
cudaError_t cuda_select_layout(size_t n, size_t *cub_off, size_t *cub_bytes);

static inline unsigned blocks_for(uint64_t threads, unsigned per_block)
{
	return (unsigned)((threads + per_block - 1) / per_block);
}

#endif
