/*
 * fake_libcuda — a stand-in for the NVIDIA driver (built as libcuda.so.1, found by
 * the client's dlopen through LD_LIBRARY_PATH) for tests of the CUDA IPC hand-off
 * against the emulated device: it "maps" a handle of the emulated export (which
 * holds the daemon's address) by returning that address, never touching it, and
 * appends "map ADDR" and "unmap ADDR" to the file FAKE_CUDA_LOG names, one write
 * per line, so that the daemon's "free ADDR" lines (KVBLEND_EMULATED_LOG, the same
 * file) fall in between in the order things happened.
 */
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

typedef struct {
	char reserved[64];
} fake_handle;

/* The driver's entry points the client resolves (client/cudaipc.c), as it calls them. */
int cuInit(unsigned flags);
int cuDeviceGetByPCIBusId(int *dev, const char *pci);
int cuDevicePrimaryCtxRetain(void **ctx, int dev);
int cuDevicePrimaryCtxRelease_v2(int dev);
int cuCtxPushCurrent_v2(void *ctx);
int cuCtxPopCurrent_v2(void **ctx);
int cuIpcOpenMemHandle_v2(unsigned long long *p, fake_handle h, unsigned flags);
int cuIpcCloseMemHandle(unsigned long long p);
int cuGetErrorString(int r, const char **s);

static void note(const char *what, unsigned long long p)
{
	const char *path = getenv("FAKE_CUDA_LOG");
	char line[64];
	int fd, n;

	if (!path)
		return;
	fd = open(path, O_WRONLY | O_APPEND | O_CREAT, 0600);
	if (fd < 0)
		return;
	n = snprintf(line, sizeof(line), "%s %llx\n", what, p);
	if (write(fd, line, (size_t)n) != n)
		perror("fake_libcuda: write");
	close(fd);
}

int cuInit(unsigned flags)
{
	(void)flags;
	return 0;
}

int cuDeviceGetByPCIBusId(int *dev, const char *pci)
{
	*dev = 0;
	return strcmp(pci, "emulated") ? 101 /* CUDA_ERROR_INVALID_DEVICE */ : 0;
}

int cuDevicePrimaryCtxRetain(void **ctx, int dev)
{
	(void)dev;
	*ctx = (void *)1;
	return 0;
}

int cuDevicePrimaryCtxRelease_v2(int dev)
{
	(void)dev;
	return 0;
}

int cuCtxPushCurrent_v2(void *ctx)
{
	(void)ctx;
	return 0;
}

int cuCtxPopCurrent_v2(void **ctx)
{
	*ctx = (void *)1;
	return 0;
}

int cuIpcOpenMemHandle_v2(unsigned long long *p, fake_handle h, unsigned flags)
{
	(void)flags;
	memcpy(p, h.reserved, sizeof(*p));
	note("map", *p);
	return 0;
}

int cuIpcCloseMemHandle(unsigned long long p)
{
	note("unmap", p);
	return 0;
}

int cuGetErrorString(int r, const char **s)
{
	(void)r;
	*s = "fake driver error";
	return 0;
}
