/*
 * test_device_parity — the device table's kernels (blend/device.h, the daemon's session
 * path) at large shapes, byte for byte against the CPU backend: re-rotation of a
 * 65K-token layer in bf16 and f16 with YaRN (one chunk per launch, and a layer's
 * chunks in one rotate_spans launch, with fresh rows between them left untouched),
 * the deviation over 32K rows picked from a longer layer, a merge of 9,000 rows,
 * and the top-k over 400K candidates with ties, NaN and always-kept tokens.
 *
 * usage: test_device_parity cuda|emulated [--small]
 * cuda opens CUDA device 0 (exit 77, saying why, without one: gpu_run.sh turns that
 * into a failure where nvidia-smi lists a GPU); emulated runs the same checks on the
 * emulated device (host memory, the CPU kernels), where --small shrinks the shapes
 * (2K tokens, 1K rows, 600 merged rows, 20K candidates) so that the CPU suite runs
 * them in seconds. Prints one line per check; exits 1 if any failed.
 */
#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blend/backend.h"
#include "blend/device.h"
#include "blend/elem.h"
#include "blend/rope.h"

static int failures;
static const struct blend_device *dv;
static struct blend_stream *st;
static const struct blend_backend *cpu;

static void check(const char *what, bool ok, const char *detail)
{
	printf("%s - %s%s%s\n", ok ? "ok" : "not ok", what, ok ? "" : ": ", ok ? "" : detail);
	failures += !ok;
}

/* A deterministic generator (xorshift64*), so that a failure reproduces. */
static uint64_t rng_state = 0x9e3779b97f4a7c15ull;

static uint64_t rnd(void)
{
	rng_state ^= rng_state >> 12;
	rng_state ^= rng_state << 25;
	rng_state ^= rng_state >> 27;
	return rng_state * 0x2545f4914f6cdd1dull;
}

/* Uniform in [-1, 1). */
static float rndf(void)
{
	return (float)((double)(rnd() >> 11) / (double)(1ull << 52) - 1.0);
}

static void *xmalloc(size_t n)
{
	void *p = malloc(n ? n : 1);

	if (!p) {
		fprintf(stderr, "out of memory (%zu bytes)\n", n);
		exit(2);
	}
	return p;
}

/* n elements of dtype dt, uniform in [-2, 2), into a new host array. */
static uint8_t *random_tensor(enum blend_dtype dt, size_t n)
{
	uint8_t *p = xmalloc(n * blend_dtype_size(dt));

	for (size_t i = 0; i < n; i++)
		elem_store(dt, p, i, 2 * rndf());
	return p;
}

/* Device memory holding a copy of host[0..n), or exit. */
static void *to_device(const void *host, size_t n)
{
	void *p;

	if (dv->alloc(dv, n, &p) || (n && dv->upload(dv, st, p, host, n)) ||
	    dv->stream_sync(dv, st)) {
		fprintf(stderr, "device: cannot allocate or upload %zu bytes\n", n);
		exit(2);
	}
	return p;
}

/* Copy n bytes of device memory back into a new host array, or exit. */
static void *from_device(const void *dev, size_t n)
{
	void *h = xmalloc(n);

	if ((n && dv->download(dv, st, h, dev, n)) || dv->stream_sync(dv, st)) {
		fprintf(stderr, "device: cannot download %zu bytes\n", n);
		exit(2);
	}
	return h;
}

/* The first differing byte of two arrays, as text for a failed check. */
static const char *first_diff(const void *a, const void *b, size_t n, char *buf, size_t len)
{
	const uint8_t *x = a, *y = b;

	for (size_t i = 0; i < n; i++)
		if (x[i] != y[i]) {
			snprintf(buf, len, "byte %zu of %zu: device %02x, cpu %02x", i, n, x[i], y[i]);
			return buf;
		}
	return "";
}

/*
 * Rotation: a layer of T tokens in three chunks (each 1/4 of T, fresh rows between
 * them), YaRN tables per token (pre-RoPE keys) for the first chunk and one row
 * (post-RoPE, moved positions) for the others. On the device each chunk once by
 * rotate (out of place), and the whole layer by rotate_spans (in place).
 */
static void test_rotate(enum blend_dtype dt, const char *dname, uint32_t T)
{
	struct rope_config c = { .head_dim = 128, .rotary_dim = 64, .style = ROPE_NEOX,
				 .theta = 1e6, .scaling = ROPE_SCALING_YARN, .factor = 4,
				 .original_max_pos = 32768, .beta_fast = 32, .beta_slow = 1 };
	struct blend_shape s = { 8, 128, 64, ROPE_NEOX, dt };
	size_t rb = (size_t)s.heads * s.head_dim * blend_dtype_size(dt), q = T / 4;
	uint32_t off[3] = { 0, (uint32_t)q + 7, (uint32_t)(2 * q + 19) };
	uint8_t *layer = random_tensor(dt, (size_t)T * s.heads * s.head_dim);
	uint8_t *want = xmalloc((size_t)T * rb);
	struct rope_table tab[3];
	struct blend_dev_span sp[3];
	uint8_t *dlayer, *dout, *got, *got_spans;
	void *dsp;
	char what[160], diff[160] = "";
	bool ok = true;

	memcpy(want, layer, (size_t)T * rb);
	for (int i = 0; i < 3; i++) {
		uint32_t old = i ? 100 + 1000 * (uint32_t)i : 0, now = off[i] + 4096;

		if (rope_table_build(&c, i == 0, (uint32_t)q, old, 4 * (uint64_t)T, now,
				     4 * (uint64_t)T, &tab[i])) {
			fprintf(stderr, "rope_table_build failed\n");
			exit(2);
		}
		cpu->rotate(cpu, &s, &tab[i], layer + off[i] * rb, want + off[i] * rb, 0,
			    (uint32_t)q);
		sp[i].t.cos = to_device(tab[i].cos, (size_t)tab[i].rows * tab[i].half * 4);
		sp[i].t.sin = to_device(tab[i].sin, (size_t)tab[i].rows * tab[i].half * 4);
		sp[i].t.rows = tab[i].rows;
		sp[i].t.scale = tab[i].scale;
		sp[i].off = off[i];
		sp[i].tokens = (uint32_t)q;
		sp[i].first = (uint32_t)(i * q);
	}
	/* One chunk per launch, out of place: rows outside the chunks stay as uploaded. */
	dlayer = to_device(layer, (size_t)T * rb);
	dout = to_device(layer, (size_t)T * rb);
	for (int i = 0; i < 3 && ok; i++)
		ok = !dv->rotate(dv, st, &s, &sp[i].t, dlayer + off[i] * rb, dout + off[i] * rb,
				 (uint32_t)q);
	got = from_device(dout, (size_t)T * rb);
	snprintf(what, sizeof(what), "rotate %s, %u tokens, YaRN x4, three chunks: as the CPU",
		 dname, T);
	check(what, ok && !memcmp(got, want, (size_t)T * rb),
	      ok ? first_diff(got, want, (size_t)T * rb, diff, sizeof(diff)) : "call failed");
	/* All three in one launch, in place; the fresh rows between them untouched. */
	dsp = to_device(sp, sizeof(sp));
	ok = !dv->rotate_spans(dv, st, &s, dsp, 3, (uint32_t)(3 * q), dlayer);
	got_spans = from_device(dlayer, (size_t)T * rb);
	snprintf(what, sizeof(what), "rotate_spans %s, %u tokens, one launch: as the CPU", dname,
		 T);
	check(what, ok && !memcmp(got_spans, want, (size_t)T * rb),
	      ok ? first_diff(got_spans, want, (size_t)T * rb, diff, sizeof(diff))
		 : "call failed");
	for (int i = 0; i < 3; i++) {
		dv->free(dv, (void *)sp[i].t.cos, (size_t)tab[i].rows * tab[i].half * 4);
		dv->free(dv, (void *)sp[i].t.sin, (size_t)tab[i].rows * tab[i].half * 4);
		rope_table_free(&tab[i]);
	}
	dv->free(dv, dsp, sizeof(sp));
	dv->free(dv, dlayer, (size_t)T * rb);
	dv->free(dv, dout, (size_t)T * rb);
	free(layer);
	free(want);
	free(got);
	free(got_spans);
}

/* Deviation of R fresh rows from stored rows picked (shuffled) out of R + R/4. */
static void test_deviation(uint32_t R)
{
	struct blend_shape s = { 8, 128, 128, ROPE_NEOX, BLEND_BF16 };
	size_t rb = (size_t)s.heads * s.head_dim * 2, N = R + R / 4;
	uint8_t *fresh = random_tensor(s.dtype, (size_t)R * s.heads * s.head_dim);
	uint8_t *stored = random_tensor(s.dtype, N * s.heads * s.head_dim);
	int32_t *idx = xmalloc(R * sizeof(int32_t));
	float *want = xmalloc(R * sizeof(float)), *got;
	void *df, *ds, *di, *dout;
	char what[128], diff[160] = "";
	bool ok;

	for (uint32_t i = 0; i < R; i++)
		idx[i] = (int32_t)(rnd() % N);
	cpu->deviation(cpu, &s, fresh, stored, idx, R, want);
	df = to_device(fresh, (size_t)R * rb);
	ds = to_device(stored, N * rb);
	di = to_device(idx, R * sizeof(int32_t));
	ok = !dv->alloc(dv, R * sizeof(float), &dout) &&
	     !dv->deviation(dv, st, &s, df, ds, di, R, dout);
	got = ok ? from_device(dout, R * sizeof(float)) : xmalloc(1);
	snprintf(what, sizeof(what), "deviation bf16 over %u rows: as the CPU, bit for bit", R);
	check(what, ok && !memcmp(got, want, R * sizeof(float)),
	      ok ? first_diff(got, want, R * sizeof(float), diff, sizeof(diff)) : "call failed");
	dv->free(dv, df, (size_t)R * rb);
	dv->free(dv, ds, N * rb);
	dv->free(dv, di, R * sizeof(int32_t));
	if (ok)
		dv->free(dv, dout, R * sizeof(float));
	free(fresh);
	free(stored);
	free(idx);
	free(want);
	free(got);
}

/* A merge of M fresh rows into a layer of 4M rows (f16, a row not a multiple of 16). */
static void test_merge(uint32_t M)
{
	struct blend_shape s = { 3, 40, 40, ROPE_NEOX, BLEND_F16 };
	size_t rb = (size_t)s.heads * s.head_dim * 2, N = 4 * (size_t)M, n_sel = 0;
	uint8_t *stored = random_tensor(s.dtype, N * s.heads * s.head_dim);
	uint8_t *fresh = random_tensor(s.dtype, (size_t)M * s.heads * s.head_dim);
	int32_t *sel = xmalloc(M * sizeof(int32_t));
	uint8_t *want = xmalloc(N * rb), *got;
	void *dl, *df, *dsel;
	char what[128], diff[160] = "";
	bool ok;

	/* M sorted distinct rows of N: each row taken with probability M/N, topped up. */
	for (size_t t = 0; t < N && n_sel < M; t++)
		if (rnd() % N < M || N - t == M - n_sel)
			sel[n_sel++] = (int32_t)t;
	cpu->merge(cpu, &s, stored, fresh, sel, n_sel, want, 0, N);
	dl = to_device(stored, N * rb);
	df = to_device(fresh, n_sel * rb);
	dsel = to_device(sel, n_sel * sizeof(int32_t));
	ok = !dv->scatter(dv, st, &s, dl, df, dsel, n_sel);
	got = from_device(dl, N * rb);
	snprintf(what, sizeof(what), "merge of %zu rows into %zu: as the CPU", n_sel, N);
	check(what, ok && n_sel == M && !memcmp(got, want, N * rb),
	      ok ? first_diff(got, want, N * rb, diff, sizeof(diff)) : "call failed");
	dv->free(dv, dl, N * rb);
	dv->free(dv, df, n_sel * rb);
	dv->free(dv, dsel, n_sel * sizeof(int32_t));
	free(stored);
	free(fresh);
	free(sel);
	free(want);
	free(got);
}

/*
 * Top-k over C candidates (every other token of 2C, ascending, as candidates() makes
 * them): deviations drawn from 64 values so that ties are many, one in 97 NaN; the
 * odd tokens below 2000 always kept. k of 15%.
 */
static void test_select(uint32_t C)
{
	size_t n_always = 1000, k = C / 100 * 15, cap = k + n_always, n_out = 0;
	int32_t *cand = xmalloc(C * sizeof(int32_t)), *always = xmalloc(n_always * 4);
	float *dev = xmalloc(C * sizeof(float));
	int32_t *want = xmalloc(cap * sizeof(int32_t)), *got;
	size_t scratch_bytes = dv->select_scratch(dv, C + n_always);
	void *dc, *dd, *da, *dout, *scratch = NULL;
	char what[128], diff[160] = "";
	long n_want;
	bool ok;

	for (uint32_t i = 0; i < C; i++) {
		cand[i] = (int32_t)(2 * i);
		dev[i] = rnd() % 97 == 0 ? NAN : (float)(rnd() % 64) / 8.0f;
	}
	for (size_t i = 0; i < n_always; i++)
		always[i] = (int32_t)(2 * i + 1);
	n_want = cpu->select(cpu, cand, dev, C, k, always, n_always, want);
	dc = to_device(cand, C * sizeof(int32_t));
	dd = to_device(dev, C * sizeof(float));
	da = to_device(always, n_always * sizeof(int32_t));
	ok = scratch_bytes && !dv->alloc(dv, scratch_bytes, &scratch) &&
	     !dv->alloc(dv, cap * sizeof(int32_t), &dout) &&
	     !dv->select(dv, st, dc, dd, C, k, da, n_always, dout, scratch, scratch_bytes,
			 &n_out);
	got = ok ? from_device(dout, n_out * sizeof(int32_t)) : xmalloc(1);
	snprintf(what, sizeof(what), "top-%zu of %u candidates (ties, NaN, %zu kept): as the CPU",
		 k, C, n_always);
	check(what, ok && n_want >= 0 && n_out == (size_t)n_want &&
			    !memcmp(got, want, n_out * sizeof(int32_t)),
	      !ok ? "call failed"
		  : n_out != (size_t)n_want
		  ? "counts differ"
		  : first_diff(got, want, n_out * sizeof(int32_t), diff, sizeof(diff)));
	/* Scratch one byte short of what the device asked for: an error, never a success
	 * with an empty (or any) selection (issue 23, finding 11). */
	if (ok) {
		size_t n_short = 12345;
		int rc = dv->select(dv, st, dc, dd, C, k, da, n_always, dout, scratch,
				    scratch_bytes - 1, &n_short);

		snprintf(what, sizeof(what), "top-%zu of %u candidates with too little scratch: "
			 "-EINVAL, no selection", k, C);
		check(what, rc == -EINVAL && n_short == 12345,
		      rc == 0 ? "succeeded" : "another error or a count written");
	}
	dv->free(dv, dc, C * sizeof(int32_t));
	dv->free(dv, dd, C * sizeof(float));
	dv->free(dv, da, n_always * sizeof(int32_t));
	if (ok) {
		dv->free(dv, dout, cap * sizeof(int32_t));
		dv->free(dv, scratch, scratch_bytes);
	}
	free(cand);
	free(always);
	free(dev);
	free(want);
	free(got);
}

int main(int argc, char **argv)
{
	const char *which = argc > 1 ? argv[1] : "";
	bool small = argc > 2 && !strcmp(argv[2], "--small");
	struct blend_devices *devs = NULL;
	struct blend_devices_info info;

	cpu = blend_cpu_backend();
	if (strcmp(which, "cuda") && strcmp(which, "emulated")) {
		fprintf(stderr, "usage: test_device_parity cuda|emulated [--small]\n");
		return 2;
	}
	/* Opened as the daemon opens its device (blend/devices.c). */
	if (blend_devices_open(strcmp(which, "cuda") ? BLEND_DEVICE_EMULATED : 0, cpu->name, NULL,
			       &devs, &info)) {
		printf("skip: %s\n", info.line);
		return 77;
	}
	dv = info.dev;
	if (dv->stream_new(dv, &st)) {
		fprintf(stderr, "cannot make a stream\n");
		return 2;
	}
	printf("# device %s, %s shapes, CPU reference %s\n", dv->name, small ? "small" : "full",
	       cpu->name);
	test_rotate(BLEND_BF16, "bf16", small ? 2048 : 65536);
	test_rotate(BLEND_F16, "f16", small ? 2048 : 65536);
	test_deviation(small ? 1024 : 32768);
	test_merge(small ? 600 : 9000);
	test_select(small ? 20000 : 400000);
	dv->stream_free(dv, st);
	blend_devices_close(&devs);
	return failures ? 1 : 0;
}
