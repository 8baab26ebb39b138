/*
 * blend_tool — runs one blend/ function on .npy files, so that the NumPy
 * reference tests (test_blend.py) can check it from outside.
 *
 *   blend_tool probe                                          CUDA device 0's name, or 77
 *   blend_tool invfreq  ROPE... --seq L --out F.npy           inv_freq (<f8), then attention factor
 *   blend_tool rotate   ROPE... --dtype DT --in K.npy --out O.npy --old-pos P --new-pos Q
 *                       [--old-seq L] [--new-seq L] [--pre-rope] [--isa ISA]
 *   blend_tool deviation --dtype DT --fresh F.npy --stored S.npy --idx I.npy --out D.npy [--isa]
 *   blend_tool select   --cand C.npy --dev D.npy --ratio R --n-cached N --always A.npy --out S.npy
 *                       [--isa]
 *   blend_tool merge    --dtype DT --stored S.npy --fresh F.npy --sel I.npy --out O.npy [--isa]
 * --isa: baseline, avx2, avx512 (CPU builds) or cuda (the CUDA backend on device 0);
 * exits 77 with the reason on stdout when this machine has no such backend.
 * ROPE: --head-dim D --rotary-dim R --style neox|gptj --theta T --scaling SPEC
 * Tensors are [rows, heads, head_dim]; bf16 as <u2.
 *
 *   blend_tool batch   one command a line on stdin (its arguments as above, split at
 *                      white space), each answered on stdout by what it prints, a
 *                      newline, and a line of 0x1e and its exit code (2 for a line
 *                      too long or of too many words): one process for a whole test,
 *                      so that a GPU's context starts once (536 starts took 167 s on an
 *                      H200), and the CUDA device opened once.
 */
#include <errno.h>
#include <math.h>
#include <setjmp.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "blend/backend.h"
#include "blend/cuda/cuda.h"
#include "blend/hkvd.h"
#include "client/include/kvblend.h"
#include "client/npy.h"
#include "blend/rope.h"

/* In batch mode a command's exit returns to the loop instead (batch()). */
static jmp_buf *batch_jmp;

static void die(int code)
{
	if (batch_jmp)
		longjmp(*batch_jmp, code + 1);
	exit(code);
}

static const char *arg(int argc, char **argv, const char *name)
{
	for (int i = 2; i < argc - 1; i++)
		if (!strcmp(argv[i], name))
			return argv[i + 1];
	return NULL;
}

static bool flag(int argc, char **argv, const char *name)
{
	for (int i = 2; i < argc; i++)
		if (!strcmp(argv[i], name))
			return true;
	return false;
}

static const char *need(int argc, char **argv, const char *name)
{
	const char *v = arg(argc, argv, name);

	if (!v) {
		fprintf(stderr, "blend_tool: %s is required\n", name);
		die(2);
	}
	return v;
}

static struct npy load(const char *path)
{
	struct npy a;
	char err[512];

	if (npy_read(path, &a, err, sizeof(err))) {
		fprintf(stderr, "blend_tool: %s\n", err);
		die(1);
	}
	return a;
}

static void save(const char *path, const char *descr, int ndim, const uint64_t *shape,
		 const void *data, size_t len)
{
	char err[512];

	if (npy_write(path, descr, ndim, shape, data, len, err, sizeof(err))) {
		fprintf(stderr, "blend_tool: %s\n", err);
		die(1);
	}
}

static struct rope_config rope_from_args(int argc, char **argv)
{
	struct rope_config c = { 0 };
	struct kvb_model m = { 0 };
	const char *style = need(argc, argv, "--style");

	c.head_dim = (uint32_t)atoi(need(argc, argv, "--head-dim"));
	c.rotary_dim = (uint32_t)atoi(need(argc, argv, "--rotary-dim"));
	c.style = !strcmp(style, "gptj") ? ROPE_GPTJ : ROPE_NEOX;
	c.theta = atof(need(argc, argv, "--theta"));
	if (kvb_rope_scaling_parse(need(argc, argv, "--scaling"), &m)) {
		fprintf(stderr, "blend_tool: bad --scaling\n");
		die(2);
	}
	c.scaling = (enum rope_scaling)m.scaling;
	c.factor = m.factor;
	c.low_freq_factor = m.low_freq_factor;
	c.high_freq_factor = m.high_freq_factor;
	c.original_max_pos = m.original_max_pos;
	c.beta_fast = m.beta_fast;
	c.beta_slow = m.beta_slow;
	c.max_pos = m.max_pos;
	return c;
}

static enum blend_dtype dtype_from_args(int argc, char **argv)
{
	const char *d = need(argc, argv, "--dtype");

	return !strcmp(d, "f32") ? BLEND_F32 : !strcmp(d, "bf16") ? BLEND_BF16 : BLEND_F16;
}

static const struct blend_backend *backend_from_args(int argc, char **argv)
{
	const char *isa = arg(argc, argv, "--isa");
	const struct blend_backend *b;

	if (isa && !strcmp(isa, "cuda")) {
		static struct blend_cuda *dev; /* opened once, open until exit */
		char why[256];

		if (!dev && blend_cuda_open(0, &dev, why, sizeof(why))) {
			printf("skip: %s\n", why);
			die(77);
		}
		return blend_cuda_backend(dev);
	}
	b = isa ? blend_cpu_backend_isa(isa) : blend_cpu_backend();
	if (!b) {
		printf("skip: this CPU lacks %s\n", isa);
		die(77);
	}
	return b;
}

/* A backend call failed (only a device can): say why. */
static int failed(const struct blend_backend *b)
{
	char why[256] = "";

	if (b->ctx)
		blend_cuda_last_error(b->ctx, why, sizeof(why));
	fprintf(stderr, "%s: call failed %s\n", b->name, why);
	return 1;
}

static int run_cmd(int argc, char **argv)
{
	const char *cmd = argc > 1 ? argv[1] : "";

	if (!strcmp(cmd, "probe")) {
		/* Is there a usable CUDA device 0? Its name, or the reason and 77. */
		struct blend_cuda *dev;
		char why[256];

		if (blend_cuda_open(0, &dev, why, sizeof(why))) {
			printf("skip: %s\n", why);
			return 77;
		}
		printf("%s\n", blend_cuda_name(dev));
		blend_cuda_close(&dev);
		return 0;
	}
	if (!strcmp(cmd, "invfreq")) {
		struct rope_config c = rope_from_args(argc, argv);
		uint64_t n = c.rotary_dim / 2 + 1;
		double *f = calloc(n, sizeof(double));

		if (rope_inv_freq(&c, (uint64_t)atoll(need(argc, argv, "--seq")), f, &f[n - 1]))
			return 1;
		save(need(argc, argv, "--out"), "<f8", 1, &n, f, n * sizeof(double));
		free(f);
		return 0;
	}
	if (!strcmp(cmd, "rotate")) {
		struct rope_config c = rope_from_args(argc, argv);
		struct npy k = load(need(argc, argv, "--in"));
		struct blend_shape s = { (uint32_t)k.shape[1], c.head_dim, c.rotary_dim, c.style,
					 dtype_from_args(argc, argv) };
		const char *os = arg(argc, argv, "--old-seq"), *ns = arg(argc, argv, "--new-seq");
		uint32_t op = (uint32_t)atoll(need(argc, argv, "--old-pos"));
		uint32_t np = (uint32_t)atoll(need(argc, argv, "--new-pos"));
		const struct blend_backend *b = backend_from_args(argc, argv);
		struct rope_table t;
		uint32_t rows = (uint32_t)k.shape[0];

		if (rope_table_build(&c, flag(argc, argv, "--pre-rope"), rows, op,
				     os ? (uint64_t)atoll(os) : op + rows, np,
				     ns ? (uint64_t)atoll(ns) : np + rows, &t))
			return 1;
		/* In two halves, as the daemon splits work: row0 must index the table. */
		if (b->rotate(b, &s, &t, k.data, k.data, 0, rows / 2) ||
		    b->rotate(b, &s, &t,
			      (uint8_t *)k.data + (size_t)(rows / 2) * s.heads * s.head_dim *
							  k.elem_size,
			      (uint8_t *)k.data + (size_t)(rows / 2) * s.heads * s.head_dim *
							  k.elem_size,
			      rows / 2, rows - rows / 2))
			return failed(b);
		save(need(argc, argv, "--out"), k.descr, k.ndim, k.shape, k.data,
		     k.count * k.elem_size);
		rope_table_free(&t);
		npy_free(&k);
		return 0;
	}
	if (!strcmp(cmd, "deviation")) {
		struct npy f = load(need(argc, argv, "--fresh")), st = load(need(argc, argv, "--stored"));
		struct npy idx = load(need(argc, argv, "--idx"));
		struct blend_shape s = { (uint32_t)f.shape[1], (uint32_t)f.shape[2], 0, ROPE_NEOX,
					 dtype_from_args(argc, argv) };
		float *out = calloc(idx.count + 1, sizeof(float));
		uint64_t n = idx.count;

		const struct blend_backend *b = backend_from_args(argc, argv);

		if (b->deviation(b, &s, f.data, st.data, idx.data, n, out))
			return failed(b);
		save(need(argc, argv, "--out"), "<f4", 1, &n, out, n * 4);
		free(out);
		npy_free(&f);
		npy_free(&st);
		npy_free(&idx);
		return 0;
	}
	if (!strcmp(cmd, "select")) {
		struct npy cand = load(need(argc, argv, "--cand")), dev = load(need(argc, argv, "--dev"));
		struct npy al = load(need(argc, argv, "--always"));
		size_t k = hkvd_count(atof(need(argc, argv, "--ratio")),
				      (size_t)atoll(need(argc, argv, "--n-cached")));
		int32_t *out = calloc(cand.count + al.count + 1, sizeof(int32_t));
		const struct blend_backend *b = backend_from_args(argc, argv);
		long n = b->select(b, cand.data, dev.data, cand.count, k, al.data, al.count, out);
		uint64_t shape = (uint64_t)n;

		if (n < 0)
			return 1;
		save(need(argc, argv, "--out"), "<i4", 1, &shape, out, (size_t)n * 4);
		free(out);
		npy_free(&cand);
		npy_free(&dev);
		npy_free(&al);
		return 0;
	}
	if (!strcmp(cmd, "merge")) {
		struct npy st = load(need(argc, argv, "--stored")), f = load(need(argc, argv, "--fresh"));
		struct npy sel = load(need(argc, argv, "--sel"));
		struct blend_shape s = { (uint32_t)st.shape[1], (uint32_t)st.shape[2], 0, ROPE_NEOX,
					 dtype_from_args(argc, argv) };
		void *out = malloc(st.count * st.elem_size + 1);
		size_t rows = st.shape[0], half = rows / 3;
		const struct blend_backend *b = backend_from_args(argc, argv);

		/* In three row ranges, as the daemon splits a layer across threads. */
		if (b->merge(b, &s, st.data, f.data, sel.data, sel.count, out, 0, half) ||
		    b->merge(b, &s, st.data, f.data, sel.data, sel.count, out, half, half) ||
		    b->merge(b, &s, st.data, f.data, sel.data, sel.count, out, 2 * half,
			     rows - 2 * half))
			return failed(b);
		save(need(argc, argv, "--out"), st.descr, st.ndim, st.shape, out,
		     st.count * st.elem_size);
		free(out);
		npy_free(&st);
		npy_free(&f);
		npy_free(&sel);
		return 0;
	}
	fprintf(stderr, "usage: see the comment at the top of blend_tool.c\n");
	return 2;
}

/* Commands from stdin, one a line, each followed on stdout by 0x1e and its exit code. */
static int batch(void)
{
	static char line[16384];

	while (fgets(line, sizeof(line), stdin)) {
		char *av[256], *save = NULL, *tok;
		int ac = 0, rc, j, c;
		jmp_buf jb;

		if (!strchr(line, '\n') && !feof(stdin)) {
			/* longer than the buffer: the whole line refused, never run in parts */
			while ((c = getchar()) != EOF && c != '\n')
				;
			fprintf(stderr, "blend_tool batch: a line longer than %zu bytes\n",
				sizeof(line) - 1);
			printf("\n\x1e%d\n", 2);
			fflush(stdout);
			continue;
		}
		av[ac++] = "blend_tool";
		for (tok = strtok_r(line, " \t\n", &save); tok && ac < 255;
		     tok = strtok_r(NULL, " \t\n", &save))
			av[ac++] = tok;
		av[ac] = NULL;
		if (tok) { /* more words than av holds: refused, not cut short */
			fprintf(stderr, "blend_tool batch: more than 254 words on a line\n");
			printf("\n\x1e%d\n", 2);
			fflush(stdout);
			continue;
		}
		j = setjmp(jb);
		if (j == 0) {
			batch_jmp = &jb;
			rc = ac > 1 && !strcmp(av[1], "batch") ? 2 : run_cmd(ac, av);
		} else {
			rc = j - 1;
		}
		batch_jmp = NULL;
		fflush(stderr);
		/* on a line of its own even after output with no newline at its end */
		printf("\n\x1e%d\n", rc);
		fflush(stdout);
	}
	return 0;
}

int main(int argc, char **argv)
{
	if (argc > 1 && !strcmp(argv[1], "batch"))
		return batch();
	return run_cmd(argc, argv);
}
