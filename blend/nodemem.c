/* nodemem — a node's stand-in device allocation; see nodemem.h. */
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/types.h>
#include <unistd.h>

#include "blend/nodemem.h"

int nodemem_open(struct nodemem *m, const char *which, size_t bytes, char *err, size_t errlen)
{
	struct blend_devices_info info;
	int fd, rc;

	memset(m, 0, sizeof(*m));
	m->bytes = bytes;
	if (!strcmp(which, "emulated")) {
		/* a memfd sealed against shrinking and growing: what the emulated device maps */
		fd = memfd_create("kvb-nodemem", MFD_CLOEXEC | MFD_ALLOW_SEALING);
		if (fd < 0 || ftruncate(fd, (off_t)bytes) ||
		    fcntl(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW)) {
			snprintf(err, errlen, "memfd: %s", strerror(errno));
			if (fd >= 0)
				close(fd);
			return -errno;
		}
		m->base = mmap(NULL, bytes, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
		if (m->base == MAP_FAILED) {
			m->base = NULL;
			close(fd);
			snprintf(err, errlen, "mmap: %s", strerror(errno));
			return -ENOMEM;
		}
		m->fd = fd; /* kept open: the caller hands it to the daemon (the handle) */
		snprintf(m->pci, sizeof(m->pci), "emulated");
		return 0;
	}
	if (strcmp(which, "cuda")) {
		snprintf(err, errlen, "device %s: cuda or emulated", which);
		return -EINVAL;
	}
	if (blend_devices_open(0, "cpu", NULL, &m->devs, &info) || !info.dev) {
		snprintf(err, errlen, "%s", info.line);
		blend_devices_close(&m->devs);
		return 77;
	}
	m->dv = info.dev;
	rc = m->dv->stream_new(m->dv, &m->st);
	if (!rc)
		rc = m->dv->alloc(m->dv, bytes, (void **)&m->base);
	if (!rc)
		rc = m->dv->ipc_export(m->dv, m->base, m->handle, m->pci, sizeof(m->pci));
	if (rc) {
		m->dv->last_error(m->dv, err, errlen);
		nodemem_close(m);
	}
	return rc;
}

int nodemem_fill(struct nodemem *m, uint8_t b)
{
	uint8_t *h;
	int rc;

	if (!m->dv) {
		memset(m->base, b, m->bytes);
		return 0;
	}
	rc = m->dv->host_alloc(m->dv, m->bytes, (void **)&h);
	if (rc)
		return rc;
	memset(h, b, m->bytes);
	rc = m->dv->upload(m->dv, m->st, m->base, h, m->bytes);
	if (!rc)
		rc = m->dv->stream_sync(m->dv, m->st);
	m->dv->host_free(m->dv, h);
	return rc;
}

int nodemem_read(struct nodemem *m, size_t off, void *host, size_t n)
{
	int rc;

	if (off > m->bytes || n > m->bytes - off)
		return -EINVAL;
	if (!m->dv) {
		memcpy(host, m->base + off, n);
		return 0;
	}
	rc = m->dv->download(m->dv, m->st, host, m->base + off, n);
	return rc ? rc : m->dv->stream_sync(m->dv, m->st);
}

void nodemem_close(struct nodemem *m)
{
	if (!m->dv) {
		if (m->base)
			munmap(m->base, m->bytes);
		if (m->base)
			close(m->fd);
	} else {
		if (m->base)
			m->dv->free(m->dv, m->base, m->bytes);
		if (m->st)
			m->dv->stream_free(m->dv, m->st);
		blend_devices_close(&m->devs);
	}
	memset(m, 0, sizeof(*m));
}
