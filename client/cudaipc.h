/*
 * cudaipc — the client's side of the CUDA IPC hand-off: the NVIDIA driver
 * (libcuda.so.1) loaded at run time, so that libkvblend links no CUDA and runs
 * where there is none, and the daemon's exported device memory mapped into this
 * process, in the primary context of the same GPU (found by its PCI bus id,
 * since device numbers differ between processes). Functions return 0 or a
 * negative errno with a message in err: -ENODEV (no driver, or no such device
 * here), -EIO (another driver error).
 */
#ifndef KVBLEND_CLIENT_CUDAIPC_H
#define KVBLEND_CLIENT_CUDAIPC_H

#include <stddef.h>
#include <stdint.h>

struct kvb_cuda;

int kvb_cuda_load(struct kvb_cuda **out, char *err, size_t errlen);
/* Map the allocation behind a 64-byte IPC memory handle; *dptr is its base. */
int kvb_cuda_map(struct kvb_cuda *cu, const char *pci, const uint8_t handle[64], uint64_t *dptr,
		 char *err, size_t errlen);
void kvb_cuda_unmap(struct kvb_cuda *cu, uint64_t dptr);
void kvb_cuda_free(struct kvb_cuda **cu);

#endif
