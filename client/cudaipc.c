/* cudaipc — mapping the daemon's device memory through the driver API; see cudaipc.h. */
#include "client/cudaipc.h"

#include <dlfcn.h>
#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

/* The few driver API types used here, as the driver's ABI defines them (cuda.h). */
typedef int cu_result;		  /* CUresult: 0 is CUDA_SUCCESS */
typedef int cu_device;		  /* CUdevice */
typedef void *cu_context;	  /* CUcontext */
typedef unsigned long long cu_ptr; /* CUdeviceptr */
typedef struct {
	char reserved[64];
} cu_ipc_handle; /* CUipcMemHandle */
#define CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS 0x1

struct mapping {
	cu_ptr base;
	cu_device dev; /* whose primary context it was opened in */
};

struct kvb_cuda {
	void *lib;
	cu_result (*init)(unsigned);
	cu_result (*device_by_pci)(cu_device *, const char *);
	cu_result (*ctx_retain)(cu_context *, cu_device);
	cu_result (*ctx_release)(cu_device);
	cu_result (*ctx_push)(cu_context);
	cu_result (*ctx_pop)(cu_context *);
	cu_result (*ipc_open)(cu_ptr *, cu_ipc_handle, unsigned);
	cu_result (*ipc_close)(cu_ptr);
	cu_result (*error_string)(cu_result, const char **);
	pthread_mutex_t lock; /* maps */
	struct mapping *maps;
	size_t n_maps, cap_maps;
};

static int driver_err(struct kvb_cuda *cu, cu_result r, const char *what, char *err, size_t len)
{
	const char *s = NULL;

	if (cu->error_string)
		cu->error_string(r, &s);
	snprintf(err, len, "%s: CUDA driver error %d (%s)", what, r, s ? s : "unknown");
	return r == 100 /* CUDA_ERROR_NO_DEVICE */ ? -ENODEV : -EIO;
}

int kvb_cuda_load(struct kvb_cuda **out, char *err, size_t errlen)
{
	struct kvb_cuda *cu = calloc(1, sizeof(*cu));
	cu_result r;

	if (!cu) {
		snprintf(err, errlen, "out of memory");
		return -ENOMEM;
	}
	cu->lib = dlopen("libcuda.so.1", RTLD_NOW | RTLD_LOCAL);
	if (!cu->lib) {
		snprintf(err, errlen, "no NVIDIA driver (libcuda.so.1 not found)");
		free(cu);
		return -ENODEV;
	}
#define SYM(field, name)                                                                  \
	do {                                                                              \
		*(void **)&cu->field = dlsym(cu->lib, name);                              \
		if (!cu->field) {                                                         \
			snprintf(err, errlen, "the NVIDIA driver lacks %s: too old", name); \
			dlclose(cu->lib);                                                 \
			free(cu);                                                         \
			return -ENODEV;                                                   \
		}                                                                         \
	} while (0)
	SYM(init, "cuInit");
	SYM(device_by_pci, "cuDeviceGetByPCIBusId");
	SYM(ctx_retain, "cuDevicePrimaryCtxRetain");
	SYM(ctx_release, "cuDevicePrimaryCtxRelease_v2");
	SYM(ctx_push, "cuCtxPushCurrent_v2");
	SYM(ctx_pop, "cuCtxPopCurrent_v2");
	SYM(ipc_open, "cuIpcOpenMemHandle_v2");
	SYM(ipc_close, "cuIpcCloseMemHandle");
	SYM(error_string, "cuGetErrorString");
#undef SYM
	r = cu->init(0);
	if (r) {
		int rc = driver_err(cu, r, "cuInit", err, errlen);

		dlclose(cu->lib);
		free(cu);
		return rc;
	}
	pthread_mutex_init(&cu->lock, NULL);
	*out = cu;
	return 0;
}

int kvb_cuda_map(struct kvb_cuda *cu, const char *pci, const uint8_t handle[64], uint64_t *dptr,
		 char *err, size_t errlen)
{
	cu_ipc_handle h;
	cu_device dev;
	cu_context ctx, popped;
	cu_ptr p = 0;
	cu_result r;
	int rc = 0;

	memcpy(h.reserved, handle, sizeof(h.reserved));
	r = cu->device_by_pci(&dev, pci);
	if (r) {
		driver_err(cu, r, "the daemon's GPU", err, errlen);
		snprintf(err + strlen(err), errlen - strlen(err), ": %s is not a device here", pci);
		return -ENODEV;
	}
	r = cu->ctx_retain(&ctx, dev);
	if (r)
		return driver_err(cu, r, "cuDevicePrimaryCtxRetain", err, errlen);
	r = cu->ctx_push(ctx);
	if (!r) {
		r = cu->ipc_open(&p, h, CU_IPC_MEM_LAZY_ENABLE_PEER_ACCESS);
		cu->ctx_pop(&popped);
		if (r)
			rc = driver_err(cu, r, "cuIpcOpenMemHandle", err, errlen);
	} else {
		rc = driver_err(cu, r, "cuCtxPushCurrent", err, errlen);
	}
	pthread_mutex_lock(&cu->lock);
	if (!rc && cu->n_maps == cu->cap_maps) {
		size_t cap = cu->cap_maps ? 2 * cu->cap_maps : 4;
		struct mapping *m = realloc(cu->maps, cap * sizeof(*m));

		if (m) {
			cu->maps = m;
			cu->cap_maps = cap;
		}
	}
	if (!rc && cu->n_maps < cu->cap_maps)
		cu->maps[cu->n_maps++] = (struct mapping){ p, dev };
	else if (!rc) {
		snprintf(err, errlen, "out of memory");
		rc = -ENOMEM;
	}
	pthread_mutex_unlock(&cu->lock);
	if (rc) {
		if (p)
			cu->ipc_close(p);
		cu->ctx_release(dev); /* the context stays retained only while mapped */
		return rc;
	}
	*dptr = p;
	return 0;
}

void kvb_cuda_unmap(struct kvb_cuda *cu, uint64_t dptr)
{
	cu_context ctx, popped;
	cu_device dev = -1;

	pthread_mutex_lock(&cu->lock);
	for (size_t i = 0; i < cu->n_maps; i++)
		if (cu->maps[i].base == dptr) {
			dev = cu->maps[i].dev;
			cu->maps[i] = cu->maps[--cu->n_maps];
			break;
		}
	pthread_mutex_unlock(&cu->lock);
	if (dev < 0)
		return;
	if (!cu->ctx_retain(&ctx, dev)) {
		if (!cu->ctx_push(ctx)) {
			cu->ipc_close(dptr);
			cu->ctx_pop(&popped);
		}
		cu->ctx_release(dev);
	}
	cu->ctx_release(dev); /* the map's own */
}

void kvb_cuda_free(struct kvb_cuda **cup)
{
	struct kvb_cuda *cu = cup ? *cup : NULL;

	if (!cu)
		return;
	while (cu->n_maps)
		kvb_cuda_unmap(cu, cu->maps[0].base);
	free(cu->maps);
	pthread_mutex_destroy(&cu->lock);
	/* libcuda stays loaded: unloading a driver with live contexts is not safe. */
	free(cu);
	*cup = NULL;
}
