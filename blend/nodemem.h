/*
 * nodemem — a node's stand-in device allocation for the tests and benchmarks of
 * landing into device memory: on "cuda", device memory allocated through blend/'s
 * device table in this process and exported by its CUDA IPC handle, as an engine's
 * KV cache would be; on "emulated", a memfd sealed against shrinking, mapped shared,
 * whose descriptor (fd) the caller hands to the daemon for its handle
 * (kvb_device_handle_from_fd), as the emulated device takes memory. Either way the
 * daemon, another process, maps it and writes there.
 */
#ifndef KVBLEND_BLEND_NODEMEM_H
#define KVBLEND_BLEND_NODEMEM_H

#include <stddef.h>
#include <stdint.h>

#include "blend/device.h"

struct nodemem {
	const struct blend_device *dv; /* the device the memory is on (emulated: NULL) */
	struct blend_devices *devs;
	struct blend_stream *st;
	uint8_t *base; /* device memory (cuda) or the mapping (emulated) */
	size_t bytes;
	uint8_t handle[64]; /* cuda: its IPC handle; emulated: the caller's to fill */
	char pci[32];
	int fd; /* emulated: the memfd */
};

/* Returns 0; 77 when which is "cuda" and there is no usable CUDA device (err says
 * why); or a negative errno. */
int nodemem_open(struct nodemem *m, const char *which, size_t bytes, char *err, size_t errlen);
/* Every byte set to b. */
int nodemem_fill(struct nodemem *m, uint8_t b);
/* n bytes from offset off into host memory. */
int nodemem_read(struct nodemem *m, size_t off, void *host, size_t n);
void nodemem_close(struct nodemem *m);

#endif
