/* devices — the daemon's one way to a device (CUDA or emulated); see device.h. */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>

#include "blend/cuda/cuda.h"
#include "blend/device.h"

struct blend_devices {
	struct blend_cuda *gpu;	  /* a CUDA device (NULL: none) */
	struct blend_device *emu; /* the emulated one (NULL: none) */
};

bool blend_devices_cuda_built(void)
{
	return blend_cuda_built();
}

const char *blend_devices_cuda_floor(void)
{
	return blend_cuda_driver_floor();
}

/* The driver floor, and what the driver here supports: the outcome line ends with it. */
static void driver_line(char *out, size_t len)
{
	int v = blend_cuda_driver_version();

	if (v > 0)
		snprintf(out, len, "%s; the driver here supports CUDA %d.%d",
			 blend_cuda_driver_floor(), v / 1000, v % 1000 / 10);
	else
		snprintf(out, len, "%s; no NVIDIA driver here", blend_cuda_driver_floor());
}

int blend_devices_open(int which, const char *cpu, const struct blend_emu_opts *emu,
		       struct blend_devices **out, struct blend_devices_info *info)
{
	struct blend_devices *d = calloc(1, sizeof(*d));
	char why[256], name[256], drv[256];
	int ordinal = which == BLEND_DEVICE_AUTO ? 0 : which, rc;
	uint64_t held, total;

	*info = (struct blend_devices_info){ .model = "", .ordinal = -1 };
	if (!d)
		return -ENOMEM;
	if (which == BLEND_DEVICE_CPU) {
		snprintf(info->line, sizeof(info->line), "fuse backend %s (device cpu)", cpu);
		goto done;
	}
	if (which == BLEND_DEVICE_EMULATED) {
		if (blend_emu_open(emu ? emu->fail_after : 0, emu && emu->sticky, &d->emu)) {
			free(d);
			return -ENOMEM;
		}
		info->dev = d->emu;
		info->dev_host = !(emu && emu->as_auto);
		snprintf(info->line, sizeof(info->line), "fuse backend %s, sessions on the "
			 "emulated device (host memory standing in for a GPU's, for tests: slower "
			 "than device cpu)%s", cpu,
			 info->dev_host ? "" : "; sessions placed as device auto places them");
		goto done;
	}
	driver_line(drv, sizeof(drv));
	if (which == BLEND_DEVICE_AUTO && blend_cuda_probe(0, name, sizeof(name), why, sizeof(why))) {
		snprintf(info->line, sizeof(info->line), "fuse backend %s (device auto: %s) [%s]",
			 cpu, why, drv);
		goto done;
	}
	rc = blend_cuda_open(ordinal, &d->gpu, why, sizeof(why));
	if (rc && which == BLEND_DEVICE_AUTO) {
		info->level = 1;
		snprintf(info->line, sizeof(info->line), "fuse backend %s (device auto: CUDA device "
			 "0, %s, is there but not usable: %s) [%s]", cpu, name, why, drv);
		goto done;
	}
	if (rc) {
		info->level = 2;
		snprintf(info->line, sizeof(info->line), "device cuda:%d: %s [%s]", ordinal, why, drv);
		free(d);
		return -ENODEV;
	}
	blend_cuda_memory(d->gpu, &held, &total);
	info->dev = blend_cuda_device(d->gpu);
	info->dev_host = which != BLEND_DEVICE_AUTO;
	info->model = blend_cuda_name(d->gpu);
	info->ordinal = blend_cuda_ordinal(d->gpu);
	snprintf(info->line, sizeof(info->line), "fuse sessions on CUDA device %d (%s, %" PRIu64
		 " MiB%s, %s); landing sessions and re-rotated GETs on %s [%s]", ordinal,
		 info->model, total >> 20, which == BLEND_DEVICE_AUTO ? ", device auto" : "",
		 blend_cuda_blocking_sync(d->gpu) ? "waits block" : "waits spin: blocking sync "
		 "refused", cpu, drv);
	if (!info->dev_host)
		snprintf(info->line2, sizeof(info->line2), "device auto: a session runs on CUDA "
			 "device %d when its node maps the device ring, else on %s (its layers "
			 "would cross PCIe twice)", ordinal, cpu);
done:
	*out = d;
	return 0;
}

void blend_devices_close(struct blend_devices **dp)
{
	struct blend_devices *d = dp ? *dp : NULL;

	if (!d)
		return;
	blend_cuda_close(&d->gpu);
	blend_emu_close(&d->emu);
	free(d);
	*dp = NULL;
}
