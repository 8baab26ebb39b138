/* npy — NumPy .npy reader and writer; see npy.h. */
#include "client/npy.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/ckd.h"

static const struct {
	const char *descr;
	size_t size;
} dtypes[] = {
	{ "<f2", 2 }, { "<f4", 4 }, { "<u2", 2 }, { "<i4", 4 },
	{ "<u4", 4 }, { "<i8", 8 }, { "<u8", 8 },
};

static int bad(char *err, size_t errlen, const char *msg)
{
	snprintf(err, errlen, "%s", msg);
	return -EINVAL;
}

/* Find 'key': in the header dict and return the text after the colon. */
static const char *dict_value(const char *h, const char *key)
{
	const char *p = strstr(h, key);

	if (!p)
		return NULL;
	p = strchr(p + strlen(key), ':');
	if (!p)
		return NULL;
	p++;
	while (*p == ' ')
		p++;
	return p;
}

int npy_parse(const void *buf, size_t len, struct npy *out, char *err, size_t errlen)
{
	const uint8_t *b = buf;
	struct npy a;
	size_t hlen, off;
	char *h;
	const char *p;
	uint64_t bytes;

	memset(&a, 0, sizeof(a));
	if (len < 10 || memcmp(b, "\x93NUMPY", 6))
		return bad(err, errlen, "not a .npy file (bad magic)");
	if (b[6] == 1) {
		hlen = b[8] | (size_t)b[9] << 8;
		off = 10;
	} else if ((b[6] == 2 || b[6] == 3) && len >= 12) {
		hlen = b[8] | (size_t)b[9] << 8 | (size_t)b[10] << 16 | (size_t)b[11] << 24;
		off = 12;
	} else {
		return bad(err, errlen, "unsupported .npy format version");
	}
	if (hlen > len - off)
		return bad(err, errlen, "truncated .npy header");
	h = malloc(hlen + 1);
	if (!h)
		return -ENOMEM;
	memcpy(h, b + off, hlen);
	h[hlen] = 0;
	off += hlen;
	p = dict_value(h, "'descr'");
	if (!p || *p != '\'') {
		free(h);
		return bad(err, errlen, ".npy header has no descr");
	}
	for (size_t i = 0; i < sizeof(dtypes) / sizeof(dtypes[0]); i++) {
		size_t n = strlen(dtypes[i].descr);

		if (!strncmp(p + 1, dtypes[i].descr, n) && p[1 + n] == '\'') {
			strcpy(a.descr, dtypes[i].descr);
			a.elem_size = dtypes[i].size;
		}
	}
	if (!a.elem_size) {
		char msg[96];

		snprintf(msg, sizeof(msg), "unsupported .npy dtype %.12s (expected <f2, <f4, <u2, "
			 "<i4, <u4, <i8 or <u8)", p);
		free(h);
		return bad(err, errlen, msg);
	}
	p = dict_value(h, "'fortran_order'");
	if (!p || strncmp(p, "False", 5)) {
		free(h);
		return bad(err, errlen, "Fortran-order .npy arrays are not supported");
	}
	p = dict_value(h, "'shape'");
	if (!p || *p != '(') {
		free(h);
		return bad(err, errlen, ".npy header has no shape");
	}
	p++;
	a.count = 1;
	while (*p && *p != ')') {
		char *end;
		unsigned long long d;

		while (*p == ' ' || *p == ',')
			p++;
		if (*p == ')')
			break;
		errno = 0;
		d = strtoull(p, &end, 10);
		if (end == p || errno || a.ndim == NPY_MAX_DIMS ||
		    ckd_mul(&a.count, a.count, (uint64_t)d)) {
			free(h);
			return bad(err, errlen, "bad or too large .npy shape");
		}
		a.shape[a.ndim++] = d;
		p = end;
	}
	free(h);
	if (ckd_mul(&bytes, a.count, (uint64_t)a.elem_size) || bytes > len - off)
		return bad(err, errlen, ".npy data is shorter than its shape says (truncated file?)");
	if (bytes != len - off)
		return bad(err, errlen, ".npy data is longer than its shape says");
	a.data = malloc(bytes ? bytes : 1);
	if (!a.data)
		return -ENOMEM;
	memcpy(a.data, b + off, bytes);
	*out = a;
	return 0;
}

int npy_read(const char *path, struct npy *out, char *err, size_t errlen)
{
	FILE *f = fopen(path, "rb");
	uint8_t *buf;
	long len;
	int rc;

	if (!f) {
		rc = -errno;
		snprintf(err, errlen, "%s: %s", path, strerror(-rc));
		return rc;
	}
	if (fseek(f, 0, SEEK_END) || (len = ftell(f)) < 0 || fseek(f, 0, SEEK_SET)) {
		rc = -errno;
		fclose(f);
		snprintf(err, errlen, "%s: %s", path, strerror(-rc));
		return rc;
	}
	buf = malloc(len ? (size_t)len : 1);
	if (!buf) {
		fclose(f);
		return -ENOMEM;
	}
	if (fread(buf, 1, (size_t)len, f) != (size_t)len) {
		fclose(f);
		free(buf);
		snprintf(err, errlen, "%s: read failed", path);
		return -EIO;
	}
	fclose(f);
	rc = npy_parse(buf, (size_t)len, out, err, errlen);
	free(buf);
	if (rc == -EINVAL) {
		char inner[256];

		snprintf(inner, sizeof(inner), "%s", err);
		snprintf(err, errlen, "%s: %s", path, inner);
	}
	return rc;
}

int npy_write(const char *path, const char *descr, int ndim, const uint64_t *shape,
	      const void *data, size_t len, char *err, size_t errlen)
{
	char hdr[512], dims[256] = "";
	size_t n = 0, hl;
	FILE *f;
	int rc = 0;

	for (int i = 0; i < ndim; i++)
		n += (size_t)snprintf(dims + n, sizeof(dims) - n, "%llu%s",
				      (unsigned long long)shape[i], ndim == 1 || i + 1 < ndim ? "," : "");
	hl = (size_t)snprintf(hdr + 10, sizeof(hdr) - 10,
			      "{'descr': '%s', 'fortran_order': False, 'shape': (%s), }", descr, dims);
	/* Pad with spaces so data starts on a 64-byte boundary; end with a newline. */
	while ((10 + hl + 1) % 64)
		hdr[10 + hl++] = ' ';
	hdr[10 + hl++] = '\n';
	memcpy(hdr, "\x93NUMPY\x01\x00", 8);
	hdr[8] = (char)(hl & 0xff);
	hdr[9] = (char)(hl >> 8);
	f = fopen(path, "wb");
	if (!f) {
		rc = -errno;
		snprintf(err, errlen, "%s: %s", path, strerror(-rc));
		return rc;
	}
	if (fwrite(hdr, 1, 10 + hl, f) != 10 + hl || fwrite(data, 1, len, f) != len)
		rc = -EIO;
	if (fclose(f) && !rc)
		rc = -errno;
	if (rc)
		snprintf(err, errlen, "%s: write failed: %s", path, strerror(-rc));
	return rc;
}

void npy_free(struct npy *a)
{
	if (!a)
		return;
	free(a->data);
	a->data = NULL;
}
