/* emu — the emulated device: device.h's table on host memory and the CPU kernels. */
#include <errno.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <fcntl.h>
#include <unistd.h>

#include "blend/device.h"
#include "blend/hkvd.h"

struct emu {
	struct blend_device table;
	const char *log; /* KVBLEND_EMULATED_LOG: where frees are noted (tests), or NULL */
	const struct blend_backend *cpu;
	_Atomic uint64_t held;
	_Atomic uint64_t calls; /* calls that queue work, for fail_after */
	uint64_t fail_after;
	bool sticky;		/* the injected failure is for good */
	bool no_scratch;	/* KVBLEND_EMULATED_SCRATCH_FAIL: select_scratch fails */
	_Atomic int failed;	/* a failure was injected: last_error says so */
	/* Host memory that is pinned (host_alloc'd or registered), so that a copy from or
	 * to any other host memory, pageable on a GPU, is noted (tests of finding 5). */
	pthread_mutex_t lock;
	struct pinned {
		const uint8_t *p;
		size_t bytes;
	} *pinned;
	size_t n_pinned, cap_pinned;
};

/* Streams and events exist only as distinct handles: all work is done at once. */
struct blend_stream {
	int unused;
};
struct blend_event {
	int unused;
};

static struct emu *E(const struct blend_device *d)
{
	return d->ctx;
}

/* -EIO once a sticky failure was injected: every later call fails, as on a GPU. */
static int dead(const struct blend_device *d)
{
	return E(d)->sticky && atomic_load(&E(d)->failed) ? -EIO : 0;
}

/* Count a call that queues work; -EIO at the injected failure (and after a sticky one). */
static int step(const struct blend_device *d)
{
	struct emu *e = E(d);
	uint64_t n = atomic_fetch_add(&e->calls, 1) + 1;

	if (dead(d))
		return -EIO;
	if (e->fail_after && n == e->fail_after) {
		atomic_store(&e->failed, 1);
		return -EIO;
	}
	return 0;
}

/*
 * "WHAT ADDR" appended to the log, one write: tests read when a block is freed (the
 * close order) and what a session allocates and pins ("alloc", "host_alloc",
 * "register", "unregister", "free"), and any copy from or to pageable memory
 * ("pageable_upload", "pageable_download").
 */
static void note(const struct emu *e, const char *what, const void *p)
{
	char line[64];
	int n;
	FILE *f;

	if (!e->log || !(f = fopen(e->log, "a")))
		return;
	n = snprintf(line, sizeof(line), "%s %llx\n", what, (unsigned long long)(uintptr_t)p);
	setvbuf(f, NULL, _IONBF, 0);
	fwrite(line, 1, (size_t)n, f);
	fclose(f);
}

static int e_alloc(const struct blend_device *d, size_t bytes, void **out)
{
	void *p;

	if (dead(d))
		return -EIO;
	p = malloc(bytes ? bytes : 1);
	if (!p)
		return -ENOMEM;
	atomic_fetch_add(&E(d)->held, bytes);
	note(E(d), "alloc", p);
	*out = p;
	return 0;
}

static void e_free(const struct blend_device *d, void *p, size_t bytes)
{
	if (!p)
		return;
	note(E(d), "free", p);
	free(p);
	atomic_fetch_sub(&E(d)->held, bytes);
}

/* Note [p, p + bytes) as pinned: 0 or -ENOMEM. */
static int pinned_add(struct emu *e, const void *p, size_t bytes)
{
	int rc = 0;

	pthread_mutex_lock(&e->lock);
	if (e->n_pinned == e->cap_pinned) {
		size_t cap = e->cap_pinned ? 2 * e->cap_pinned : 16;
		struct pinned *np = realloc(e->pinned, cap * sizeof(*np));

		if (np) {
			e->pinned = np;
			e->cap_pinned = cap;
		}
	}
	if (e->n_pinned < e->cap_pinned)
		e->pinned[e->n_pinned++] = (struct pinned){ p, bytes };
	else
		rc = -ENOMEM;
	pthread_mutex_unlock(&e->lock);
	return rc;
}

static void pinned_drop(struct emu *e, const void *p)
{
	pthread_mutex_lock(&e->lock);
	for (size_t i = 0; i < e->n_pinned; i++)
		if (e->pinned[i].p == p) {
			e->pinned[i] = e->pinned[--e->n_pinned];
			break;
		}
	pthread_mutex_unlock(&e->lock);
}

/* Whether [p, p + n) lies in pinned host memory. */
static bool is_pinned(struct emu *e, const void *p, size_t n)
{
	uintptr_t x = (uintptr_t)p;
	bool in = false;

	pthread_mutex_lock(&e->lock);
	for (size_t i = 0; i < e->n_pinned && !in; i++) {
		uintptr_t b = (uintptr_t)e->pinned[i].p;

		in = x >= b && x - b <= e->pinned[i].bytes && n <= e->pinned[i].bytes - (x - b);
	}
	pthread_mutex_unlock(&e->lock);
	return in;
}

static int e_host_alloc(const struct blend_device *d, size_t bytes, void **out)
{
	void *p = malloc(bytes ? bytes : 1);

	if (!p)
		return -ENOMEM;
	if (pinned_add(E(d), p, bytes)) {
		free(p);
		return -ENOMEM;
	}
	note(E(d), "host_alloc", p);
	*out = p;
	return 0;
}

static void e_host_free(const struct blend_device *d, void *p)
{
	if (!p)
		return;
	pinned_drop(E(d), p);
	note(E(d), "host_free", p);
	free(p);
}

static int e_host_register(const struct blend_device *d, void *p, size_t bytes)
{
	int rc = pinned_add(E(d), p, bytes);

	if (!rc)
		note(E(d), "register", p);
	return rc;
}

static void e_host_unregister(const struct blend_device *d, void *p)
{
	pinned_drop(E(d), p);
	note(E(d), "unregister", p);
}

static int e_stream_new(const struct blend_device *d, struct blend_stream **out)
{
	if (dead(d))
		return -EIO;
	*out = calloc(1, sizeof(**out));
	return *out ? 0 : -ENOMEM;
}

static void e_stream_free(const struct blend_device *d, struct blend_stream *st)
{
	(void)d;
	free(st);
}

static int e_stream_sync(const struct blend_device *d, struct blend_stream *st)
{
	(void)st;
	return dead(d);
}

static int e_event_new(const struct blend_device *d, struct blend_event **out)
{
	if (dead(d))
		return -EIO;
	*out = calloc(1, sizeof(**out));
	return *out ? 0 : -ENOMEM;
}

static void e_event_free(const struct blend_device *d, struct blend_event *ev)
{
	(void)d;
	free(ev);
}

static int e_event_record(const struct blend_device *d, struct blend_event *ev,
			  struct blend_stream *st)
{
	(void)ev;
	(void)st;
	return dead(d);
}

static int e_event_wait(const struct blend_device *d, struct blend_stream *st,
			struct blend_event *ev)
{
	(void)ev;
	(void)st;
	return dead(d);
}

static int e_event_sync(const struct blend_device *d, struct blend_event *ev)
{
	(void)ev;
	return dead(d);
}

static int e_copy(const struct blend_device *d, struct blend_stream *st, void *dst,
		  const void *src, size_t n)
{
	int rc = step(d);

	(void)st;
	if (!rc && n)
		memmove(dst, src, n);
	return rc;
}

static int e_upload(const struct blend_device *d, struct blend_stream *st, void *dev,
		    const void *host, size_t n)
{
	if (n && E(d)->log && !is_pinned(E(d), host, n))
		note(E(d), "pageable_upload", host);
	return e_copy(d, st, dev, host, n);
}

static int e_upload2d(const struct blend_device *d, struct blend_stream *st, void *dev,
		      size_t dpitch, const void *host, size_t spitch, size_t width, size_t height)
{
	int rc = step(d);

	(void)st;
	if (rc)
		return rc;
	if (width > dpitch || width > spitch)
		return -EINVAL;
	if (height && E(d)->log && !is_pinned(E(d), host, width))
		note(E(d), "pageable_upload", host);
	for (size_t r = 0; r < height; r++)
		memcpy((uint8_t *)dev + r * dpitch, (const uint8_t *)host + r * spitch, width);
	return 0;
}

static int e_download(const struct blend_device *d, struct blend_stream *st, void *host,
		      const void *dev, size_t n)
{
	if (n && E(d)->log && !is_pinned(E(d), host, n))
		note(E(d), "pageable_download", host);
	return e_copy(d, st, host, dev, n);
}

static int e_zero(const struct blend_device *d, struct blend_stream *st, void *dev, size_t n)
{
	int rc = step(d);

	(void)st;
	if (!rc && n)
		memset(dev, 0, n);
	return rc;
}

static int e_rotate(const struct blend_device *d, struct blend_stream *st,
		    const struct blend_shape *s, const struct blend_dev_table *t, const void *src,
		    void *dst, uint32_t n)
{
	const struct blend_backend *cpu = E(d)->cpu;
	struct rope_table rt = { t->rows, s->rotary_dim / 2, (float *)t->cos, (float *)t->sin,
				 t->scale };
	int rc = step(d);

	(void)st;
	return rc ? rc : cpu->rotate(cpu, s, &rt, src, dst, 0, n);
}

static int e_rotate_spans(const struct blend_device *d, struct blend_stream *st,
			  const struct blend_shape *s, const struct blend_dev_span *sp,
			  uint32_t n_spans, uint32_t rows, void *base)
{
	const struct blend_backend *cpu = E(d)->cpu;
	size_t rb = (size_t)s->heads * s->head_dim * blend_dtype_size(s->dtype);
	int rc = step(d);

	(void)st;
	(void)rows;
	for (uint32_t i = 0; !rc && i < n_spans; i++) {
		struct rope_table rt = { sp[i].t.rows, s->rotary_dim / 2, (float *)sp[i].t.cos,
					 (float *)sp[i].t.sin, sp[i].t.scale };
		uint8_t *x = (uint8_t *)base + (size_t)sp[i].off * rb;

		rc = cpu->rotate(cpu, s, &rt, x, x, 0, sp[i].tokens);
	}
	return rc;
}

static int e_deviation(const struct blend_device *d, struct blend_stream *st,
		       const struct blend_shape *s, const void *fresh, const void *stored,
		       const int32_t *idx, size_t n, float *out)
{
	const struct blend_backend *cpu = E(d)->cpu;
	int rc = step(d);

	(void)st;
	return rc ? rc : cpu->deviation(cpu, s, fresh, stored, idx, n, out);
}

/* 0 (the device cannot say, as a failed CUB size query) with KVBLEND_EMULATED_SCRATCH_FAIL. */
static size_t e_select_scratch(const struct blend_device *d, size_t n)
{
	(void)n;
	return E(d)->no_scratch ? 0 : 1;
}

static int e_select(const struct blend_device *d, struct blend_stream *st, const int32_t *cand,
		    const float *dev, size_t n_cand, size_t k, const int32_t *always,
		    size_t n_always, int32_t *out, void *scratch, size_t scratch_bytes,
		    size_t *n_out)
{
	int rc = step(d);
	long n;

	(void)st;
	(void)scratch;
	if (rc)
		return rc;
	if (scratch_bytes < 1)
		return -EINVAL;
	n = hkvd_select(cand, dev, n_cand, k, always, n_always, out);
	if (n < 0)
		return (int)n;
	*n_out = (size_t)n;
	return 0;
}

static int e_scatter(const struct blend_device *d, struct blend_stream *st,
		     const struct blend_shape *s, void *layer, const void *fresh,
		     const int32_t *sel, size_t n_sel)
{
	size_t rb = (size_t)s->heads * s->head_dim * blend_dtype_size(s->dtype);
	int rc = step(d);

	(void)st;
	if (rc)
		return rc;
	if (!rb)
		return -EINVAL;
	for (size_t j = 0; j < n_sel; j++)
		memcpy((uint8_t *)layer + (size_t)sel[j] * rb, (const uint8_t *)fresh + j * rb, rb);
	return 0;
}

/*
 * An "export" no process can map (there is no such GPU), so that the daemon's
 * export path runs in tests: the handle holds the address, the bus id says
 * "emulated". A client with a driver fails to find that device and stays on the host.
 */
/*
 * The emulated import: memfds of the node's (nodemem.c) that it handed over itself,
 * sealed against shrinking, each mapped shared at its offset of one range reserved
 * here (as CUDA maps a reservation's segments). Never a file named by a path or a
 * number, which any local process could name too, nor one that can shrink under the
 * mapping (a write there would fault the daemon).
 */
/* The bytes segment g maps: its size, or its sealed memfd's whole size; 0 if refused. */
static uint64_t e_seg_bytes(const struct blend_fd_seg *g)
{
	struct stat st;
	int seals = fcntl(g->fd, F_GET_SEALS);

	if (seals < 0 || !(seals & F_SEAL_SHRINK) || fstat(g->fd, &st) || !S_ISREG(st.st_mode) ||
	    st.st_size <= 0 || g->size > (uint64_t)st.st_size)
		return 0;
	return g->size ? g->size : (uint64_t)st.st_size;
}

static int e_fd_open(const struct blend_device *d, const struct blend_fd_seg *segs, size_t n,
		     const char *pci, uint64_t want_bytes, void **dev, uint64_t *bytes,
		     void **ctx)
{
	uint64_t extent = 0;
	uint8_t *base;
	int rc = dead(d);

	(void)want_bytes; /* a memfd knows its size */
	if (rc)
		return rc;
	if (strcmp(pci, "emulated"))
		return -ENODEV;
	if (!n)
		return -EINVAL;
	for (size_t k = 0; k < n; k++) {
		uint64_t b = e_seg_bytes(&segs[k]);

		if (!b)
			return -EPERM;
		/* (the daemon checked the places: page-aligned, in order, within 2^44) */
		extent = segs[k].offset + b;
	}
	base = mmap(NULL, (size_t)extent, PROT_NONE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE,
		    -1, 0);
	if (base == MAP_FAILED)
		return -ENOMEM;
	for (size_t k = 0; k < n; k++) {
		uint64_t b = e_seg_bytes(&segs[k]);

		if (!b || mmap(base + segs[k].offset, (size_t)b, PROT_READ | PROT_WRITE,
			       MAP_SHARED | MAP_FIXED, segs[k].fd, 0) == MAP_FAILED) {
			munmap(base, (size_t)extent);
			return b ? -ENOMEM : -EPERM;
		}
	}
	*dev = base;
	*bytes = extent;
	*ctx = NULL;
	return 0;
}

static void e_fd_close(const struct blend_device *d, void *dev, uint64_t bytes, void *ctx)
{
	(void)d;
	(void)ctx;
	if (dev)
		munmap(dev, (size_t)bytes); /* the reservation and every segment in it */
}

static int e_land(const struct blend_device *d, struct blend_stream *st,
		  const struct blend_shape *s, const struct blend_dev_land *L, const void *src,
		  const int32_t *rows, uint32_t n_rows)
{
	size_t hb = (size_t)s->head_dim * blend_dtype_size(s->dtype);
	size_t rb = (size_t)s->heads * hb;
	int rc = step(d);

	(void)st;
	if (rc)
		return rc;
	if (!hb || hb % 4 || L->token_stride % 4 || L->head_stride % 4 || L->page_stride % 4 ||
	    (uint64_t)L->head0 + (L->heads ? L->heads : s->heads) > s->heads)
		return -EINVAL;
	for (uint32_t i = 0; i < n_rows; i++) {
		uint32_t t = (uint32_t)rows[i];
		uint64_t off = L->page_tokens ? (uint64_t)L->pages[t / L->page_tokens] *
							L->page_stride +
						(uint64_t)(t % L->page_tokens) * L->token_stride
					      : (uint64_t)t * L->token_stride;

		for (uint32_t h = 0; h < (L->heads ? L->heads : s->heads); h++)
			memcpy(L->dst + off + h * L->head_stride,
			       (const uint8_t *)src + (size_t)t * rb + (L->head0 + h) * hb, hb);
	}
	return 0;
}

static int e_ipc_export(const struct blend_device *d, void *dev, uint8_t handle[64], char *pci,
			size_t pcilen)
{
	uint64_t a = (uint64_t)(uintptr_t)dev;
	int rc = step(d);

	if (rc)
		return rc;
	memset(handle, 0, 64);
	memcpy(handle, &a, sizeof(a));
	snprintf(pci, pcilen, "emulated");
	return 0;
}

static void e_memory(const struct blend_device *d, uint64_t *held, uint64_t *total)
{
	*held = atomic_load(&E(d)->held);
	*total = 0;
}

static void e_last_error(const struct blend_device *d, char *buf, size_t len)
{
	if (E(d)->no_scratch && !atomic_load(&E(d)->failed)) {
		snprintf(buf, len, "emulated device: the top-k scratch size query failed "
			 "(KVBLEND_EMULATED_SCRATCH_FAIL)");
		return;
	}
	snprintf(buf, len, "%s", !atomic_load(&E(d)->failed) ? "" : E(d)->sticky ?
		 "emulated device: injected sticky failure (fail_after, sticky)" :
		 "emulated device: injected failure (fail_after)");
}

static bool e_broken(const struct blend_device *d)
{
	return dead(d) != 0;
}

int blend_emu_open(uint64_t fail_after, bool sticky, struct blend_device **out)
{
	struct emu *e = calloc(1, sizeof(*e));

	if (!e)
		return -ENOMEM;
	e->cpu = blend_cpu_backend();
	e->fail_after = fail_after;
	e->sticky = sticky;
	e->log = getenv("KVBLEND_EMULATED_LOG");
	e->no_scratch = getenv("KVBLEND_EMULATED_SCRATCH_FAIL") &&
			!strcmp(getenv("KVBLEND_EMULATED_SCRATCH_FAIL"), "1");
	pthread_mutex_init(&e->lock, NULL);
	e->table = (struct blend_device){
		.name = "emulated",
		.ctx = e,
		.alloc = e_alloc,
		.free = e_free,
		.host_alloc = e_host_alloc,
		.host_free = e_host_free,
		.host_register = e_host_register,
		.host_unregister = e_host_unregister,
		.stream_new = e_stream_new,
		.stream_free = e_stream_free,
		.stream_sync = e_stream_sync,
		.event_new = e_event_new,
		.event_free = e_event_free,
		.event_record = e_event_record,
		.event_wait = e_event_wait,
		.event_sync = e_event_sync,
		.upload = e_upload,
		.upload2d = e_upload2d,
		.download = e_download,
		.copy = e_copy,
		.zero = e_zero,
		.rotate = e_rotate,
		.rotate_spans = e_rotate_spans,
		.deviation = e_deviation,
		.select_scratch = e_select_scratch,
		.select = e_select,
		.scatter = e_scatter,
		.ipc_export = e_ipc_export,
		.fd_open = e_fd_open,
		.fd_close = e_fd_close,
		.land = e_land,
		.memory = e_memory,
		.last_error = e_last_error,
		.broken = e_broken,
	};
	*out = &e->table;
	return 0;
}

void blend_emu_close(struct blend_device **dp)
{
	struct blend_device *d = dp ? *dp : NULL;

	if (!d)
		return;
	pthread_mutex_destroy(&E(d)->lock);
	free(E(d)->pinned);
	free(d->ctx);
	*dp = NULL;
}
