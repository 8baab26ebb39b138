/*
 * cli_fuse — `kvblend fuse`: one fuse session driven from files, the fresh KV of the
 * prompt in, the fused KV (and the selected tokens) out.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client/cli.h"
#include "client/npy.h"

/* "A,B,C" into up to max numbers; returns the count or -1. */
static int parse_list(const char *s, double *out, int max)
{
	int n = 0;

	while (*s) {
		char *end;

		if (n == max)
			return -1;
		errno = 0;
		out[n++] = strtod(s, &end);
		if (end == s || errno)
			return -1;
		s = *end == ',' ? end + 1 : end;
		if (*end && *end != ',')
			return -1;
	}
	return n;
}

static double now_ms(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec * 1e3 + ts.tv_nsec / 1e6;
}

/* What a fuse run moved and how long it took, for the summary. */
struct fuse_totals {
	double t0, layer_ms;
	uint64_t sent, received;
};

/*
 * The --chunk HASH@POS and --fresh COUNT@POS arguments, in the order they are given,
 * into segs (room for one per argument): 0 and *n_segs, or 2 after die().
 */
static int fuse_segments(const struct args *a, struct kvb_segment *segs, size_t *n_segs)
{
	*n_segs = 0;
	for (int i = a->i; i + 1 < a->argc; i++) {
		const char *arg = a->argv[i], *val = a->argv[i + 1], *at = strchr(val, '@');
		struct kvb_segment *g = &segs[*n_segs];
		char left[80];
		uint32_t pos = 0;

		if (strcmp(arg, "--chunk") && strcmp(arg, "--fresh"))
			continue;
		if (!at) {
			die("%s: '%s' is not X@POS", arg, val);
			return 2;
		}
		snprintf(left, sizeof(left), "%.*s", (int)(at - val), val);
		if (parse_u32(at + 1, arg, &pos))
			return 2;
		g->pos = pos;
		if (!strcmp(arg, "--chunk")) {
			if (parse_hash(left, g->hash))
				return 2;
		} else {
			g->fresh = 1;
			if (parse_u32(left, "--fresh", &g->count) || !g->count) {
				die("--fresh: COUNT must be at least 1");
				return 2;
			}
		}
		(*n_segs)++;
		i++;
	}
	return 0;
}

/*
 * --ratio and --check-layers (as many values each, at most 64) into checks and ratios,
 * which p points to, and --metric into p: 0, or 2 after die().
 */
static int fuse_checks(const struct opts *o, uint32_t checks[64], double ratios[64],
		       struct kvb_fuse_params *p)
{
	const char *checks_s = opt(o, "--check-layers"), *v;
	double checks_d[64];
	int nr = parse_list(opt(o, "--ratio"), ratios, 64), nc = parse_list(checks_s, checks_d, 64);

	if (nr <= 0 || nc <= 0 || nr != nc) {
		die("--ratio and --check-layers need the same number of comma-separated values");
		return 2;
	}
	for (int i = 0; i < nc; i++) {
		if (checks_d[i] < 0 || checks_d[i] > UINT32_MAX ||
		    checks_d[i] != (uint32_t)checks_d[i]) {
			die("--check-layers: '%s' is not a list of layer numbers", checks_s);
			return 2;
		}
		checks[i] = (uint32_t)checks_d[i];
	}
	p->n_checks = (size_t)nc;
	if ((v = opt(o, "--metric"))) {
		if (strcmp(v, "value") && strcmp(v, "key") && strcmp(v, "attention")) {
			die("--metric: '%s' is not value, key or attention", v);
			return 2;
		}
		p->metric = !strcmp(v, "key")	      ? KVB_METRIC_KEY
			    : !strcmp(v, "attention") ? KVB_METRIC_ATTENTION
						      : KVB_METRIC_VALUE;
	}
	if ((p->metric == KVB_METRIC_ATTENTION) != (opt(o, "--attention") != NULL)) {
		die("--attention A.npy goes with --metric attention, and that metric needs it");
		return 2;
	}
	return 0;
}

/* --attention A.npy (float32 [chunk tokens, kv heads]) to session f: 0, or 1 after die(). */
static int fuse_attention(kvb_client *c, kvb_fuse *f, const struct kvb_model *m, const char *path)
{
	struct npy a = { 0 };
	char err[512];
	int rc;

	if (npy_read(path, &a, err, sizeof(err)))
		return die("%s", err);
	if (strcmp(a.descr, "<f4") || a.ndim != 2 || a.shape[1] != m->num_kv_heads) {
		rc = die("%s: A must be float32 (<f4) [chunk tokens, %" PRIu32 "]", path,
			 m->num_kv_heads);
	} else {
		rc = kvb_fuse_attention(c, f, a.data, a.count);
		if (rc)
			rc = client_err(c, rc, "fuse --attention");
	}
	npy_free(&a);
	return rc ? 1 : 0;
}

/*
 * The layers of session f into fused (shaped as nw): those before the first check layer
 * are the node's own prefill; from there on the rows the daemon asks for go out of nw
 * and the fused layer comes back (at the first check layer: the node's fresh KV).
 * Returns 0, or 1 after die().
 */
static int fuse_layers(kvb_client *c, kvb_fuse *f, const struct kvb_model *m,
		       const struct npy *nw, uint8_t *fused, struct fuse_totals *t)
{
	size_t row_bytes = (size_t)m->num_kv_heads * m->head_dim * kvb_dtype_size(m->dtype);
	size_t layer_bytes = (size_t)kvb_fuse_tokens(f) * row_bytes;
	uint8_t *kin = malloc(layer_bytes + 1), *vin = malloc(layer_bytes + 1);
	int rc = 1;

	if (!kin || !vin) {
		die("out of memory");
		goto out;
	}
	memcpy(fused, nw->data, (size_t)kvb_fuse_next_layer(f) * 2 * layer_bytes);
	for (uint32_t l = kvb_fuse_next_layer(f); l < m->num_layers; l++) {
		const uint8_t *src = (const uint8_t *)nw->data + (size_t)l * 2 * layer_bytes;
		uint8_t *dst = fused + (size_t)l * 2 * layer_bytes;
		const int32_t *rows;
		size_t n = kvb_fuse_rows(f, &rows);
		double tl;
		int got = 0;

		for (size_t i = 0; i < n; i++) {
			memcpy(kin + i * row_bytes, src + (size_t)rows[i] * row_bytes, row_bytes);
			memcpy(vin + i * row_bytes, src + layer_bytes + (size_t)rows[i] * row_bytes,
			       row_bytes);
		}
		tl = now_ms();
		rc = kvb_fuse_layer(c, f, l, kin, vin, dst, dst + layer_bytes, &got);
		t->layer_ms += now_ms() - tl;
		if (rc) {
			rc = client_err(c, rc, "fuse");
			goto out;
		}
		rc = 1;
		t->sent += 2 * n * row_bytes;
		if (got)
			t->received += 2 * layer_bytes;
		else /* the first check layer: fused = the node's fresh KV */
			memcpy(dst, src, 2 * layer_bytes);
	}
	rc = 0;
out:
	free(kin);
	free(vin);
	return rc;
}

/*
 * The fused KV into --out, the selected tokens into --selected, and the summary: a line,
 * or with --json the start of the object (cmd_fuse() ends it). Returns 0, or 1 after die().
 */
static int fuse_write(const struct opts *o, kvb_fuse *f, const struct kvb_model *m,
		      const struct npy *nw, const uint8_t *fused, uint32_t first_check,
		      const struct fuse_totals *t)
{
	uint64_t shape[5] = { nw->shape[0], 2, nw->shape[2], nw->shape[3], nw->shape[4] };
	const int32_t *sel;
	uint64_t n_sel = kvb_fuse_rows(f, &sel);
	const char *v;
	char err[512];

	if (npy_write(opt(o, "--out"), nw->descr, 5, shape, fused, nw->count * nw->elem_size, err,
		      sizeof(err)))
		return die("%s", err);
	if ((v = opt(o, "--selected")) &&
	    npy_write(v, "<i4", 1, &n_sel, sel, n_sel * sizeof(int32_t), err, sizeof(err)))
		return die("%s", err);
	if (opt(o, "--json")) {
		printf("{\"tokens\": %" PRIu32 ", \"selected\": %" PRIu64 ", \"layers\": %"
		       PRIu32 ", \"first_check_layer\": %" PRIu32 ", \"bytes_sent\": %" PRIu64
		       ", \"bytes_received\": %" PRIu64 ", \"layer_ms\": %.3f",
		       kvb_fuse_tokens(f), n_sel, m->num_layers, first_check, t->sent, t->received,
		       t->layer_ms);
	} else {
		printf("fused %" PRIu32 " tokens over %" PRIu32 " layers; %" PRIu64
		       " selected for recompute; %.3f ms in layer calls\n", kvb_fuse_tokens(f),
		       m->num_layers, n_sel, t->layer_ms);
	}
	return 0;
}

int cmd_fuse(kvb_client *c, struct args *a)
{
	struct opts o = { 0 };
	const char *model, *newp, *outp, *ratio_s, *checks_s;
	struct kvb_segment *segs = calloc((size_t)a->argc, sizeof(*segs));
	size_t n_segs = 0, n_stats = 0;
	double ratios[64];
	uint32_t checks[64];
	struct kvb_fuse_params p = { checks, ratios, 0, KVB_METRIC_VALUE };
	struct fuse_totals t = { 0 };
	struct kvb_model m;
	struct npy nw = { 0 };
	kvb_fuse *f = NULL;
	struct kvb_stat *stats = NULL;
	uint8_t (*missing)[KVB_HASH_LEN] = NULL, *fused = NULL;
	size_t n_missing = 0;
	char err[512];
	int rc = 1;

	if (!segs)
		return die("out of memory");
	/* Segments keep the order they are given in: scan for them first. */
	rc = fuse_segments(a, segs, &n_segs);
	if (rc)
		goto out;
	opt_decl(&o, "--model", false);
	opt_decl(&o, "--chunk", false);
	opt_decl(&o, "--fresh", false);
	opt_decl(&o, "--new", false);
	opt_decl(&o, "--ratio", false);
	opt_decl(&o, "--check-layers", false);
	opt_decl(&o, "--metric", false);
	opt_decl(&o, "--attention", false);
	opt_decl(&o, "--out", false);
	opt_decl(&o, "--selected", false);
	opt_decl(&o, "--json", true);
	rc = 2;
	if (opt_parse(&o, a) || need(&o, "--model", &model) || need(&o, "--new", &newp) ||
	    need(&o, "--out", &outp) || need(&o, "--ratio", &ratio_s) ||
	    need(&o, "--check-layers", &checks_s))
		goto out;
	if (!n_segs) {
		die("fuse needs at least one --chunk or --fresh");
		goto out;
	}
	if ((rc = fuse_checks(&o, checks, ratios, &p)))
		goto out;
	rc = kvb_model_get(c, model, &m);
	if (rc) {
		rc = client_err(c, rc, "fuse");
		goto out;
	}
	rc = 1;
	if (npy_read(newp, &nw, err, sizeof(err))) {
		die("%s", err);
		goto out;
	}
	if (strcmp(nw.descr, npy_descr(m.dtype))) {
		die("%s: dtype %s does not match model '%s' (%s)", newp, nw.descr, m.name,
		    npy_descr(m.dtype));
		goto out;
	}
	t.t0 = now_ms();
	rc = kvb_fuse_open(c, model, segs, n_segs, &p, &f, &missing, &n_missing);
	if (rc) {
		if (rc == KVB_E_NOT_FOUND && n_missing) {
			char hex[2 * KVB_HASH_LEN + 1];

			kvb_hash_format(missing[0], hex);
			die("fuse: %zu chunk(s) not stored, first %s; store them and retry", n_missing,
			    hex);
			rc = 1;
		} else {
			rc = client_err(c, rc, "fuse");
		}
		goto out;
	}
	rc = 1;
	if (nw.ndim != 5 || nw.shape[0] != m.num_layers || nw.shape[1] != 2 ||
	    nw.shape[2] != kvb_fuse_tokens(f) || nw.shape[3] != m.num_kv_heads ||
	    nw.shape[4] != m.head_dim) {
		die("%s: shape must be [%" PRIu32 ", 2, %" PRIu32 ", %" PRIu32 ", %" PRIu32 "]: the "
		    "fresh KV of every token of the fused prompt", newp, m.num_layers,
		    kvb_fuse_tokens(f), m.num_kv_heads, m.head_dim);
		goto out;
	}
	if (opt(&o, "--attention") && fuse_attention(c, f, &m, opt(&o, "--attention")))
		goto out;
	fused = malloc(nw.count * nw.elem_size);
	if (!fused) {
		die("out of memory");
		goto out;
	}
	if (fuse_layers(c, f, &m, &nw, fused, &t) ||
	    fuse_write(&o, f, &m, &nw, fused, checks[0], &t))
		goto out;
	rc = kvb_fuse_close(c, &f, &stats, &n_stats);
	if (rc) {
		rc = client_err(c, rc, "fuse close");
		goto out;
	}
	if (opt(&o, "--json")) {
		printf(", \"total_ms\": %.3f, \"daemon\": {", now_ms() - t.t0);
		for (size_t i = 0; i < n_stats; i++) {
			printf("%s", i ? ", " : "");
			json_str(stats[i].name);
			printf(": %.17g", stats[i].value);
		}
		printf("}}\n");
	}
	rc = 0;
out:
	if (f)
		kvb_fuse_close(c, &f, NULL, NULL);
	free(stats);
	free(missing);
	free(fused);
	free(segs);
	npy_free(&nw);
	return rc;
}
