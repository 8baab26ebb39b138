/*
 * npy — read and write NumPy .npy files (format versions 1.0 to 3.0, C order,
 * little-endian), as the kvblend CLI exchanges tensors and token ids.
 */
#ifndef KVBLEND_CLIENT_NPY_H
#define KVBLEND_CLIENT_NPY_H

#include <stddef.h>
#include <stdint.h>

#define NPY_MAX_DIMS 8

struct npy {
	char descr[8]; /* "<f2", "<f4", "<u2", "<i4", "<u4", "<i8", "<u8" */
	int ndim;
	uint64_t shape[NPY_MAX_DIMS];
	size_t elem_size;
	uint64_t count; /* elements */
	void *data;	/* malloc'd, count * elem_size bytes */
};

/*
 * Read path into *out. Returns 0, or -errno / -EINVAL with a one-line reason in
 * err: not an .npy file, unsupported dtype, Fortran order, truncated data.
 */
int npy_read(const char *path, struct npy *out, char *err, size_t errlen);

/* Parse an in-memory .npy image (as npy_read does after reading the file). */
int npy_parse(const void *buf, size_t len, struct npy *out, char *err, size_t errlen);

/* Write a C-order array. Returns 0 or -errno with err set. */
int npy_write(const char *path, const char *descr, int ndim, const uint64_t *shape,
	      const void *data, size_t len, char *err, size_t errlen);

void npy_free(struct npy *a);

#endif
