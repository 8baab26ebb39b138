/* kvblend — command-line client of kvblendd. */
#include <errno.h>
#include <stdarg.h>
#include <inttypes.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "kvblend.h"
#include "npy.h"

#ifndef KVBLEND_VERSION
#define KVBLEND_VERSION "0.0.0"
#endif

static const char usage_text[] =
	"usage: kvblend [--endpoint E] [--timeout MS] COMMAND [ARGS]\n"
	"\n"
	"Client of kvblendd, the kvblend KV-cache daemon. The endpoint defaults to\n"
	"$KVBLEND_ENDPOINT, else ipc:///run/kvblend/kvblend.sock. On tcp:// endpoints\n"
	"$KVBLEND_SERVER_KEY (the daemon's CURVE public key) turns on CURVE, with\n"
	"$KVBLEND_CLIENT_KEY as this client's secret key.\n"
	"\n"
	"commands:\n"
	"  ping                                   check that the daemon answers; print its version\n"
	"  stats [--json]                         daemon counters\n"
	"  model add NAME --layers L --kv-heads H --head-dim D --dtype f16|bf16|f32\n"
	"            --rope-theta T [--rope-style neox|gptj] [--rotary-dim R]\n"
	"            [--rope-scaling SPEC] [--k-pre-rope] [--store CODEC]\n"
	"                                         register a model (SPEC: none | linear:F |\n"
	"                                         llama3:F,LOW,HIGH,ORIG_MAX | yarn:F,ORIG_MAX[,BF,BS]\n"
	"                                         | dynamic:F,MAX_POS; CODEC, how its chunks are\n"
	"                                         stored: dtype (lossless, default) | fp8 | int8 |\n"
	"                                         int4[:GROUP], lossy, docs/storage.md)\n"
	"  model ls [--json]                      list models\n"
	"  put --model NAME --kv FILE.npy (--tokens FILE | --hash HEX) [--pos P]\n"
	"                                         store a chunk; KV is [layers,2,T,heads,dim];\n"
	"                                         --tokens: .npy of integer ids or a text file of\n"
	"                                         ids (hash = BLAKE2b-256 of the ids as <u4); prints\n"
	"                                         the chunk hash\n"
	"  get --model NAME --hash HEX --out FILE.npy [--layers A:B]\n"
	"                                         read a chunk (layers A..B-1) into a .npy file\n"
	"  get-rerotated --model NAME --hash HEX --pos P --out FILE.npy [--layers A:B]\n"
	"                                         read a chunk with its keys re-rotated to start\n"
	"                                         at position P\n"
	"  fuse --model NAME --chunk HEX@POS... [--fresh COUNT@POS...] --new NEW.npy\n"
	"       --ratio R[,R...] --check-layers C[,C...] [--metric value|key]\n"
	"       --out FUSED.npy [--selected SEL.npy] [--json]\n"
	"                                         fuse stored chunks into a new prompt\n"
	"                                         (CacheBlend), layer by layer, with the fresh KV\n"
	"                                         of all tokens in NEW ([layers,2,N,heads,dim])\n"
	"  ls --model NAME [--json]               list a model's chunks\n"
	"  lookup --model NAME HEX...             which chunks are stored\n"
	"  rm --model NAME --hash HEX             delete a chunk\n"
	"  pin --model NAME --hash HEX --ttl SECONDS\n"
	"                                         keep a chunk from eviction (until a restart)\n"
	"  unpin --model NAME --hash HEX          let it be evicted again\n"
	"  hash --tokens FILE                     print the chunk hash of token ids\n"
	"  keygen                                 print a new CURVE key pair (public, secret)\n"
	"  cluster status [--json]                the cluster as this daemon sees it: each other\n"
	"                                         member, its endpoint, alive, suspect or gone,\n"
	"                                         pushes owed to\n"
	"                                         it, ms since its last reply, the chunks and\n"
	"                                         bytes its store holds; the cluster counters\n"
	"  demo                                   register a small model, store chunks, read them\n"
	"                                         back and verify them, printing each step\n"
	"\n"
	"Exit status: 0 on success, 1 on an error (one line on stderr), 2 on bad usage.\n";

struct args {
	int argc;
	char **argv;
	int i;
};

static int die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static int die(const char *fmt, ...)
{
	va_list ap;

	fputs("kvblend: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	return 1;
}

static int client_err(kvb_client *c, int rc, const char *what)
{
	const char *msg = kvb_last_error(c);

	return die("%s: %s%s%s", what, kvb_strerror(rc), *msg ? ": " : "", msg);
}

/* Options of one command: a flat list of "--name" -> value (or "1" for switches). */
struct opts {
	const char *names[16];
	const char *values[16];
	bool is_switch[16];
	int n;
	const char *positional[64];
	int npos;
};

static void opt_decl(struct opts *o, const char *name, bool is_switch)
{
	o->names[o->n] = name;
	o->is_switch[o->n] = is_switch;
	o->values[o->n++] = NULL;
}

static int opt_parse(struct opts *o, struct args *a)
{
	for (; a->i < a->argc; a->i++) {
		const char *arg = a->argv[a->i];
		int k;

		if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
			fputs(usage_text, stdout);
			exit(0);
		}
		if (strncmp(arg, "--", 2)) {
			if (o->npos == 64)
				return die("too many arguments");
			o->positional[o->npos++] = arg;
			continue;
		}
		for (k = 0; k < o->n && strcmp(o->names[k], arg); k++)
			;
		if (k == o->n)
			return die("unknown option %s (see kvblend --help)", arg);
		if (o->is_switch[k]) {
			o->values[k] = "1";
		} else {
			if (a->i + 1 >= a->argc)
				return die("%s needs a value", arg);
			o->values[k] = a->argv[++a->i];
		}
	}
	return 0;
}

static const char *opt(const struct opts *o, const char *name)
{
	for (int k = 0; k < o->n; k++)
		if (!strcmp(o->names[k], name))
			return o->values[k];
	return NULL;
}

static int need(const struct opts *o, const char *name, const char **out)
{
	*out = opt(o, name);
	return *out ? 0 : die("%s is required", name);
}

static int parse_u32(const char *s, const char *what, uint32_t *out)
{
	char *end;
	unsigned long long v;

	errno = 0;
	v = strtoull(s, &end, 10);
	if (!*s || *s == '-' || *end || errno || v > UINT32_MAX)
		return die("%s: '%s' is not a whole number from 0 to %u", what, s, UINT32_MAX);
	*out = (uint32_t)v;
	return 0;
}

static int parse_hash(const char *s, uint8_t h[KVB_HASH_LEN])
{
	if (kvb_hash_parse(s, h))
		return die("'%s' is not a chunk hash (64 hex digits)", s);
	return 0;
}

/* Token ids from a .npy of integers or a text file of whitespace-separated ids. */
static int read_tokens(const char *path, uint32_t **ids, size_t *n)
{
	char err[512];
	struct npy a;
	FILE *f = fopen(path, "rb");
	char magic[6] = { 0 };
	size_t cap = 0;

	if (!f)
		return die("%s: %s", path, strerror(errno));
	if (fread(magic, 1, 6, f) == 6 && !memcmp(magic, "\x93NUMPY", 6)) {
		fclose(f);
		if (npy_read(path, &a, err, sizeof(err)))
			return die("%s", err);
		if (a.ndim != 1 || a.descr[1] == 'f') {
			npy_free(&a);
			return die("%s: token ids must be a 1-D integer array", path);
		}
		*ids = malloc((a.count ? a.count : 1) * sizeof(**ids));
		if (!*ids) {
			npy_free(&a);
			return die("out of memory");
		}
		for (uint64_t i = 0; i < a.count; i++) {
			int64_t v = a.elem_size == 8 ? ((int64_t *)a.data)[i]
				    : a.descr[1] == 'i' ? ((int32_t *)a.data)[i]
							: (int64_t)((uint32_t *)a.data)[i];

			if (a.descr[1] == 'u' && a.elem_size == 8 && ((uint64_t *)a.data)[i] > UINT32_MAX)
				v = -1;
			if (v < 0 || v > UINT32_MAX) {
				npy_free(&a);
				free(*ids);
				return die("%s: token id %" PRIu64 " is out of range 0..%u", path, i,
					   UINT32_MAX);
			}
			(*ids)[i] = (uint32_t)v;
		}
		*n = a.count;
		npy_free(&a);
		return 0;
	}
	rewind(f);
	*ids = NULL;
	*n = 0;
	for (;;) {
		char word[32];
		char *end;
		unsigned long long v;
		int r = fscanf(f, "%31s", word);

		if (r != 1)
			break;
		errno = 0;
		v = strtoull(word, &end, 10);
		if (*end || errno || v > UINT32_MAX || word[0] == '-') {
			fclose(f);
			free(*ids);
			return die("%s: '%s' is not a token id (0..%u)", path, word, UINT32_MAX);
		}
		if (*n == cap) {
			uint32_t *p = realloc(*ids, (cap ? 2 * cap : 256) * sizeof(*p));

			if (!p) {
				fclose(f);
				free(*ids);
				return die("out of memory");
			}
			*ids = p;
			cap = cap ? 2 * cap : 256;
		}
		(*ids)[(*n)++] = (uint32_t)v;
	}
	fclose(f);
	if (!*n)
		return die("%s: no token ids", path);
	return 0;
}

static const char *npy_descr(enum kvb_dtype d)
{
	return d == KVB_F32 ? "<f4" : d == KVB_BF16 ? "<u2" : "<f2";
}

static void json_str(const char *s)
{
	putchar('"');
	for (; *s; s++) {
		if (*s == '"' || *s == '\\')
			printf("\\%c", *s);
		else if ((unsigned char)*s < 0x20)
			printf("\\u%04x", *s);
		else
			putchar(*s);
	}
	putchar('"');
}

static int cmd_keygen(kvb_client *c, struct args *a)
{
	struct opts o = { 0 };
	char pub[41], sec[41];

	(void)c;
	if (opt_parse(&o, a))
		return 2;
	if (kvb_curve_keypair(pub, sec))
		return die("this libzmq has no CURVE support");
	printf("public %s\nsecret %s\n", pub, sec);
	return 0;
}

static int cmd_ping(kvb_client *c, struct args *a)
{
	struct opts o = { 0 };
	char version[64];
	struct timespec t0, t1;
	int rc;

	if (opt_parse(&o, a))
		return 2;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	rc = kvb_ping(c, version, sizeof(version));
	clock_gettime(CLOCK_MONOTONIC, &t1);
	if (rc)
		return client_err(c, rc, "ping");
	printf("kvblendd %s answered in %.3f ms\n", version,
	       (t1.tv_sec - t0.tv_sec) * 1e3 + (t1.tv_nsec - t0.tv_nsec) / 1e6);
	return 0;
}

static int cmd_stats(kvb_client *c, struct args *a)
{
	struct opts o = { 0 };
	struct kvb_stat *s;
	size_t n;
	int rc;

	opt_decl(&o, "--json", true);
	if (opt_parse(&o, a))
		return 2;
	rc = kvb_stats(c, &s, &n);
	if (rc)
		return client_err(c, rc, "stats");
	if (opt(&o, "--json")) {
		printf("{");
		for (size_t i = 0; i < n; i++) {
			printf("%s", i ? ", " : "");
			json_str(s[i].name);
			printf(": %.17g", s[i].value);
		}
		printf("}\n");
	} else {
		for (size_t i = 0; i < n; i++)
			printf("%-28s %.6g\n", s[i].name, s[i].value);
	}
	free(s);
	return 0;
}

static int cmd_cluster(kvb_client *c, struct args *a)
{
	const char *sub = a->i < a->argc ? a->argv[a->i++] : "";
	struct opts o = { 0 };
	struct kvb_stat *s;
	struct kvb_member *mb;
	size_t n, n_mb;
	bool json, first = true;
	int rc;

	if (strcmp(sub, "status"))
		return die("cluster: expected 'status'") ? 2 : 2;
	opt_decl(&o, "--json", true);
	if (opt_parse(&o, a))
		return 2;
	json = opt(&o, "--json") != NULL;
	rc = kvb_cluster_members(c, &mb, &n_mb, &s, &n);
	if (rc)
		return client_err(c, rc, "cluster status");
	{
		bool any = false;

		for (size_t i = 0; i < n; i++)
			any |= !strcmp(s[i].name, "cluster_members");
		if (!any) {
			free(s);
			free(mb);
			return die("cluster status: this daemon is in no cluster (neither cluster_peers "
				   "nor cluster_etcd set)")
				       ? 1 : 1;
		}
	}
	if (json)
		printf("{\"members\": [");
	else
		printf("%-16s %-24s %-8s %11s %14s %10s %14s\n", "member", "endpoint", "state",
		       "pushes owed", "last reply ms", "chunks", "stored bytes");
	for (size_t i = 0; i < n_mb; i++) {
		const struct kvb_member *m = &mb[i];
		const char *state = m->state > 0 ? "alive" : m->state == 0 ? "suspect" : "gone";

		if (json) {
			printf("%s{\"id\": ", first ? "" : ", ");
			json_str(m->id);
			printf(", \"endpoint\": ");
			json_str(m->endpoint);
			printf(", \"state\": \"%s\", \"pushes_owed\": %" PRIu64 ", \"last_reply_ms\": "
			       "%.0f, \"chunks\": %" PRIu64 ", \"stored_bytes\": %" PRIu64 "}",
			       state, m->pushes_owed, m->last_reply_age_ms, m->chunks, m->stored_bytes);
		} else {
			char seen[24];

			if (m->last_reply_age_ms < 0)
				snprintf(seen, sizeof(seen), "never");
			else
				snprintf(seen, sizeof(seen), "%.0f", m->last_reply_age_ms);
			printf("%-16s %-24s %-8s %11" PRIu64 " %14s %10" PRIu64 " %14" PRIu64 "\n",
			       m->id, m->endpoint, state, m->pushes_owed, seen, m->chunks,
			       m->stored_bytes);
		}
		first = false;
	}
	free(mb);
	if (json) {
		printf("]");
		for (size_t i = 0; i < n; i++)
			if (!strncmp(s[i].name, "cluster_", 8)) {
				printf(", ");
				json_str(s[i].name);
				printf(": %.17g", s[i].value);
			}
		printf("}\n");
	} else {
		for (size_t i = 0; i < n; i++)
			if (!strncmp(s[i].name, "cluster_", 8))
				printf("%-28s %.6g\n", s[i].name, s[i].value);
	}
	free(s);
	return 0;
}

static void print_model_json(const struct kvb_model *m)
{
	char spec[128], store[32];

	kvb_rope_scaling_format(m, spec, sizeof(spec));
	printf("{\"name\": ");
	json_str(m->name);
	kvb_store_format(m, store, sizeof(store));
	printf(", \"layers\": %" PRIu32 ", \"kv_heads\": %" PRIu32 ", \"head_dim\": %" PRIu32
	       ", \"dtype\": \"%s\", \"rope_theta\": %.17g, \"rope_style\": \"%s\", "
	       "\"rotary_dim\": %" PRIu32 ", \"rope_scaling\": \"%s\", \"k_pre_rope\": %s, "
	       "\"store\": \"%s\"}",
	       m->num_layers, m->num_kv_heads, m->head_dim, kvb_dtype_name(m->dtype), m->rope_theta,
	       m->rope_style == KVB_ROPE_GPTJ ? "gptj" : "neox", m->rotary_dim, spec,
	       m->k_pre_rope ? "true" : "false", store);
}

static int cmd_model(kvb_client *c, struct args *a)
{
	const char *sub = a->i < a->argc ? a->argv[a->i++] : "";
	struct opts o = { 0 };
	int rc;

	if (!strcmp(sub, "ls")) {
		struct kvb_model *ms;
		size_t n;

		opt_decl(&o, "--json", true);
		if (opt_parse(&o, a))
			return 2;
		rc = kvb_model_list(c, &ms, &n);
		if (rc)
			return client_err(c, rc, "model ls");
		if (opt(&o, "--json")) {
			printf("[");
			for (size_t i = 0; i < n; i++) {
				printf("%s", i ? ", " : "");
				print_model_json(&ms[i]);
			}
			printf("]\n");
		} else {
			for (size_t i = 0; i < n; i++) {
				char spec[128], store[32];

				kvb_rope_scaling_format(&ms[i], spec, sizeof(spec));
				kvb_store_format(&ms[i], store, sizeof(store));
				printf("%s\tlayers=%" PRIu32 " kv_heads=%" PRIu32 " head_dim=%" PRIu32
				       " dtype=%s rope_theta=%g rope_style=%s rotary_dim=%" PRIu32
				       " rope_scaling=%s store=%s%s\n", ms[i].name, ms[i].num_layers,
				       ms[i].num_kv_heads, ms[i].head_dim, kvb_dtype_name(ms[i].dtype),
				       ms[i].rope_theta, ms[i].rope_style ? "gptj" : "neox",
				       ms[i].rotary_dim, spec, store, ms[i].k_pre_rope ? " k_pre_rope" : "");
			}
		}
		free(ms);
		return 0;
	}
	if (!strcmp(sub, "add")) {
		struct kvb_model m = { 0 };
		const char *v;
		char *end;
		int existed = 0;

		opt_decl(&o, "--layers", false);
		opt_decl(&o, "--kv-heads", false);
		opt_decl(&o, "--head-dim", false);
		opt_decl(&o, "--dtype", false);
		opt_decl(&o, "--rope-theta", false);
		opt_decl(&o, "--rope-style", false);
		opt_decl(&o, "--rotary-dim", false);
		opt_decl(&o, "--rope-scaling", false);
		opt_decl(&o, "--k-pre-rope", true);
		opt_decl(&o, "--store", false);
		if (opt_parse(&o, a))
			return 2;
		if (o.npos != 1)
			return die("model add takes one NAME") ? 2 : 2;
		if (strlen(o.positional[0]) > KVB_NAME_MAX)
			return die("model name longer than %d bytes", KVB_NAME_MAX);
		snprintf(m.name, sizeof(m.name), "%s", o.positional[0]);
		if (need(&o, "--layers", &v) || parse_u32(v, "--layers", &m.num_layers) ||
		    need(&o, "--kv-heads", &v) || parse_u32(v, "--kv-heads", &m.num_kv_heads) ||
		    need(&o, "--head-dim", &v) || parse_u32(v, "--head-dim", &m.head_dim) ||
		    need(&o, "--dtype", &v))
			return 2;
		m.dtype = kvb_dtype_parse(v);
		if (!m.dtype)
			return die("--dtype: '%s' is not f16, bf16 or f32", v) ? 2 : 2;
		if (need(&o, "--rope-theta", &v))
			return 2;
		m.rope_theta = strtod(v, &end);
		if (*end || !(m.rope_theta > 0))
			return die("--rope-theta: '%s' is not a positive number", v) ? 2 : 2;
		v = opt(&o, "--rope-style");
		if (v && strcmp(v, "neox") && strcmp(v, "gptj"))
			return die("--rope-style: '%s' is not neox or gptj", v) ? 2 : 2;
		m.rope_style = v && !strcmp(v, "gptj") ? KVB_ROPE_GPTJ : KVB_ROPE_NEOX;
		v = opt(&o, "--rotary-dim");
		if (v && parse_u32(v, "--rotary-dim", &m.rotary_dim))
			return 2;
		v = opt(&o, "--rope-scaling");
		if (v && kvb_rope_scaling_parse(v, &m))
			return die("--rope-scaling: '%s' is not a valid SPEC (see kvblend --help)", v)
				       ? 2 : 2;
		m.k_pre_rope = opt(&o, "--k-pre-rope") != NULL;
		v = opt(&o, "--store");
		if (v && kvb_store_parse(v, &m))
			return die("--store: '%s' is not dtype, fp8, int8, int4 or int4:GROUP "
				   "(1..1024)", v) ? 2 : 2;
		rc = kvb_model_register(c, &m, &existed);
		if (rc)
			return client_err(c, rc, "model add");
		printf("%s %s\n", existed ? "model already registered:" : "registered model", m.name);
		return 0;
	}
	return die("model: expected 'add' or 'ls'") ? 2 : 2;
}

static int cmd_hash(kvb_client *c, struct args *a)
{
	struct opts o = { 0 };
	uint32_t *ids;
	size_t n;
	uint8_t h[KVB_HASH_LEN];
	char hex[2 * KVB_HASH_LEN + 1];
	const char *v;

	(void)c;
	opt_decl(&o, "--tokens", false);
	if (opt_parse(&o, a) || need(&o, "--tokens", &v))
		return 2;
	if (read_tokens(v, &ids, &n))
		return 1;
	kvb_chunk_hash(ids, n, h);
	free(ids);
	kvb_hash_format(h, hex);
	printf("%s\n", hex);
	return 0;
}

static int cmd_put(kvb_client *c, struct args *a)
{
	struct opts o = { 0 };
	const char *model, *kvpath, *tok = NULL, *hexs = NULL, *v;
	struct kvb_model m;
	struct npy kv = { 0 };
	uint8_t h[KVB_HASH_LEN];
	char err[512], hex[2 * KVB_HASH_LEN + 1];
	uint32_t pos = 0;
	int existed = 0, rc = 1;

	opt_decl(&o, "--model", false);
	opt_decl(&o, "--kv", false);
	opt_decl(&o, "--tokens", false);
	opt_decl(&o, "--hash", false);
	opt_decl(&o, "--pos", false);
	if (opt_parse(&o, a) || need(&o, "--model", &model) || need(&o, "--kv", &kvpath))
		return 2;
	tok = opt(&o, "--tokens");
	hexs = opt(&o, "--hash");
	if (!tok == !hexs)
		return die("put needs exactly one of --tokens and --hash") ? 2 : 2;
	if ((v = opt(&o, "--pos")) && parse_u32(v, "--pos", &pos))
		return 2;
	if (hexs && parse_hash(hexs, h))
		return 2;
	rc = kvb_model_get(c, model, &m);
	if (rc)
		return client_err(c, rc, "put");
	if (npy_read(kvpath, &kv, err, sizeof(err)))
		return die("%s", err);
	rc = 1;
	if (strcmp(kv.descr, npy_descr(m.dtype))) {
		die("%s: dtype %s does not match model '%s' (%s, stored as %s)", kvpath, kv.descr,
		    m.name, kvb_dtype_name(m.dtype), npy_descr(m.dtype));
		goto out;
	}
	if (kv.ndim != 5 || kv.shape[0] != m.num_layers || kv.shape[1] != 2 ||
	    kv.shape[3] != m.num_kv_heads || kv.shape[4] != m.head_dim || !kv.shape[2] ||
	    kv.shape[2] > UINT32_MAX) {
		die("%s: shape must be [%" PRIu32 ", 2, T, %" PRIu32 ", %" PRIu32 "] for model '%s'",
		    kvpath, m.num_layers, m.num_kv_heads, m.head_dim, m.name);
		goto out;
	}
	if (tok) {
		uint32_t *ids;
		size_t n;

		if (read_tokens(tok, &ids, &n))
			goto out;
		if (n != kv.shape[2]) {
			free(ids);
			die("%s has %zu token ids but %s holds %" PRIu64 " tokens", tok, n, kvpath,
			    kv.shape[2]);
			goto out;
		}
		kvb_chunk_hash(ids, n, h);
		free(ids);
	}
	rc = kvb_put(c, model, h, m.dtype, (uint32_t)kv.shape[2], pos, kv.data,
		     kv.count * kv.elem_size, &existed);
	if (rc) {
		rc = client_err(c, rc, "put");
		goto out;
	}
	kvb_hash_format(h, hex);
	printf("%s%s\n", hex, existed ? " (already stored)" : "");
out:
	npy_free(&kv);
	return rc;
}

static int get_cmd(kvb_client *c, struct args *a, bool rerotate)
{
	struct opts o = { 0 };
	const char *model, *hexs, *out, *layers;
	struct kvb_model m;
	struct kvb_chunk_info info;
	uint8_t h[KVB_HASH_LEN];
	uint32_t lb = 0, le, pos = 0;
	uint64_t shape[5];
	size_t bytes;
	char err[512];
	void *buf;
	int rc;

	opt_decl(&o, "--model", false);
	opt_decl(&o, "--hash", false);
	opt_decl(&o, "--out", false);
	opt_decl(&o, "--layers", false);
	if (rerotate)
		opt_decl(&o, "--pos", false);
	if (opt_parse(&o, a) || need(&o, "--model", &model) || need(&o, "--hash", &hexs) ||
	    need(&o, "--out", &out) || parse_hash(hexs, h))
		return 2;
	if (rerotate && (need(&o, "--pos", &layers) || parse_u32(layers, "--pos", &pos)))
		return 2;
	rc = kvb_model_get(c, model, &m);
	if (rc)
		return client_err(c, rc, "get");
	le = m.num_layers;
	if ((layers = opt(&o, "--layers"))) {
		unsigned long long x, y;
		char tail;

		if (sscanf(layers, "%llu:%llu%c", &x, &y, &tail) != 2 || x >= y || y > m.num_layers)
			return die("--layers: '%s' is not A:B with 0 <= A < B <= %" PRIu32, layers,
				   m.num_layers) ? 2 : 2;
		lb = (uint32_t)x;
		le = (uint32_t)y;
	}
	rc = kvb_lookup(c, model, (const uint8_t(*)[KVB_HASH_LEN])h, 1, &info);
	if (rc)
		return client_err(c, rc, "get");
	if (!info.found)
		return die("get: chunk %s not found in model '%s'", hexs, model);
	shape[0] = le - lb;
	shape[1] = 2;
	shape[2] = info.num_tokens;
	shape[3] = m.num_kv_heads;
	shape[4] = m.head_dim;
	bytes = (size_t)shape[0] * 2 * info.num_tokens * m.num_kv_heads * m.head_dim *
		kvb_dtype_size(m.dtype);
	buf = malloc(bytes);
	if (!buf)
		return die("out of memory for %zu bytes", bytes);
	rc = rerotate ? kvb_get_rerotated(c, model, h, lb, le, pos, buf, bytes, &info)
		      : kvb_get(c, model, h, lb, le, buf, bytes, &info);
	if (rc) {
		free(buf);
		return client_err(c, rc, "get");
	}
	rc = npy_write(out, npy_descr(m.dtype), 5, shape, buf, bytes, err, sizeof(err));
	free(buf);
	if (rc)
		return die("%s", err);
	printf("wrote %s: layers %" PRIu32 ":%" PRIu32 ", %" PRIu32 " tokens at base_pos %" PRIu32
	       "\n", out, lb, le, info.num_tokens, info.base_pos);
	return 0;
}

static int cmd_get(kvb_client *c, struct args *a)
{
	return get_cmd(c, a, false);
}

static int cmd_get_rerotated(kvb_client *c, struct args *a)
{
	return get_cmd(c, a, true);
}

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

static int cmd_fuse(kvb_client *c, struct args *a)
{
	struct opts o = { 0 };
	const char *model, *newp, *outp, *ratio_s, *checks_s, *v;
	struct kvb_segment *segs = calloc((size_t)a->argc, sizeof(*segs));
	size_t n_segs = 0, n_stats = 0;
	double ratios[64], checks_d[64], t0, t_layers = 0;
	uint32_t checks[64];
	struct kvb_fuse_params p = { checks, ratios, 0, KVB_METRIC_VALUE };
	struct kvb_model m;
	struct npy nw = { 0 };
	kvb_fuse *f = NULL;
	struct kvb_stat *stats = NULL;
	uint8_t (*missing)[KVB_HASH_LEN] = NULL, *fused = NULL, *kin = NULL, *vin = NULL;
	size_t n_missing = 0, row_bytes, layer_bytes;
	uint64_t sent = 0, received = 0;
	char err[512];
	int nr, nc, rc = 1;

	if (!segs)
		return die("out of memory");
	/* Segments keep the order they are given in: scan for them first. */
	for (int i = a->i; i + 1 < a->argc; i++) {
		const char *arg = a->argv[i], *val = a->argv[i + 1], *at = strchr(val, '@');
		struct kvb_segment *g = &segs[n_segs];

		if (strcmp(arg, "--chunk") && strcmp(arg, "--fresh"))
			continue;
		if (!at) {
			free(segs);
			return die("%s: '%s' is not X@POS", arg, val) ? 2 : 2;
		}
		{
			char left[80];
			uint32_t pos = 0;

			snprintf(left, sizeof(left), "%.*s", (int)(at - val), val);
			if (parse_u32(at + 1, arg, &pos)) {
				free(segs);
				return 2;
			}
			g->pos = pos;
			if (!strcmp(arg, "--chunk")) {
				if (parse_hash(left, g->hash)) {
					free(segs);
					return 2;
				}
			} else {
				g->fresh = 1;
				if (parse_u32(left, "--fresh", &g->count) || !g->count) {
					free(segs);
					return die("--fresh: COUNT must be at least 1") ? 2 : 2;
				}
			}
		}
		n_segs++;
		i++;
	}
	opt_decl(&o, "--model", false);
	opt_decl(&o, "--chunk", false);
	opt_decl(&o, "--fresh", false);
	opt_decl(&o, "--new", false);
	opt_decl(&o, "--ratio", false);
	opt_decl(&o, "--check-layers", false);
	opt_decl(&o, "--metric", false);
	opt_decl(&o, "--out", false);
	opt_decl(&o, "--selected", false);
	opt_decl(&o, "--json", true);
	if (opt_parse(&o, a) || need(&o, "--model", &model) || need(&o, "--new", &newp) ||
	    need(&o, "--out", &outp) || need(&o, "--ratio", &ratio_s) ||
	    need(&o, "--check-layers", &checks_s)) {
		free(segs);
		return 2;
	}
	if (!n_segs) {
		free(segs);
		return die("fuse needs at least one --chunk or --fresh") ? 2 : 2;
	}
	nr = parse_list(ratio_s, ratios, 64);
	nc = parse_list(checks_s, checks_d, 64);
	if (nr <= 0 || nc <= 0 || nr != nc) {
		free(segs);
		return die("--ratio and --check-layers need the same number of comma-separated "
			   "values") ? 2 : 2;
	}
	for (int i = 0; i < nc; i++) {
		if (checks_d[i] < 0 || checks_d[i] > UINT32_MAX || checks_d[i] != (uint32_t)checks_d[i]) {
			free(segs);
			return die("--check-layers: '%s' is not a list of layer numbers", checks_s) ? 2 : 2;
		}
		checks[i] = (uint32_t)checks_d[i];
	}
	p.n_checks = (size_t)nc;
	if ((v = opt(&o, "--metric"))) {
		if (strcmp(v, "value") && strcmp(v, "key")) {
			free(segs);
			return die("--metric: '%s' is not value or key", v) ? 2 : 2;
		}
		p.metric = !strcmp(v, "key") ? KVB_METRIC_KEY : KVB_METRIC_VALUE;
	}
	rc = kvb_model_get(c, model, &m);
	if (rc) {
		free(segs);
		return client_err(c, rc, "fuse");
	}
	if (npy_read(newp, &nw, err, sizeof(err))) {
		free(segs);
		return die("%s", err);
	}
	rc = 1;
	if (strcmp(nw.descr, npy_descr(m.dtype))) {
		die("%s: dtype %s does not match model '%s' (%s)", newp, nw.descr, m.name,
		    npy_descr(m.dtype));
		goto out;
	}
	t0 = now_ms();
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
	row_bytes = (size_t)m.num_kv_heads * m.head_dim * kvb_dtype_size(m.dtype);
	layer_bytes = (size_t)kvb_fuse_tokens(f) * row_bytes;
	fused = malloc(nw.count * nw.elem_size);
	kin = malloc(layer_bytes + 1);
	vin = malloc(layer_bytes + 1);
	if (!fused || !kin || !vin) {
		die("out of memory");
		goto out;
	}
	/* Layers before the first check layer: the node's own prefill. */
	memcpy(fused, nw.data, (size_t)kvb_fuse_next_layer(f) * 2 * layer_bytes);
	for (uint32_t l = kvb_fuse_next_layer(f); l < m.num_layers; l++) {
		const uint8_t *src = (const uint8_t *)nw.data + (size_t)l * 2 * layer_bytes;
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
		t_layers += now_ms() - tl;
		if (rc) {
			rc = client_err(c, rc, "fuse");
			goto out;
		}
		rc = 1;
		sent += 2 * n * row_bytes;
		if (got)
			received += 2 * layer_bytes;
		else /* the first check layer: fused = the node's fresh KV */
			memcpy(dst, src, 2 * layer_bytes);
	}
	{
		uint64_t shape[5] = { nw.shape[0], 2, nw.shape[2], nw.shape[3], nw.shape[4] };
		const int32_t *sel;
		uint64_t n_sel = kvb_fuse_rows(f, &sel);

		if (npy_write(outp, nw.descr, 5, shape, fused, nw.count * nw.elem_size, err,
			      sizeof(err))) {
			die("%s", err);
			goto out;
		}
		if ((v = opt(&o, "--selected")) &&
		    npy_write(v, "<i4", 1, &n_sel, sel, n_sel * sizeof(int32_t), err, sizeof(err))) {
			die("%s", err);
			goto out;
		}
		if (opt(&o, "--json")) {
			printf("{\"tokens\": %" PRIu32 ", \"selected\": %" PRIu64 ", \"layers\": %"
			       PRIu32 ", \"first_check_layer\": %" PRIu32 ", \"bytes_sent\": %" PRIu64
			       ", \"bytes_received\": %" PRIu64 ", \"layer_ms\": %.3f",
			       kvb_fuse_tokens(f), n_sel, m.num_layers, checks[0], sent, received,
			       t_layers);
		} else {
			printf("fused %" PRIu32 " tokens over %" PRIu32 " layers; %" PRIu64
			       " selected for recompute; %.3f ms in layer calls\n", kvb_fuse_tokens(f),
			       m.num_layers, n_sel, t_layers);
		}
	}
	rc = kvb_fuse_close(c, &f, &stats, &n_stats);
	if (rc) {
		rc = client_err(c, rc, "fuse close");
		goto out;
	}
	if (opt(&o, "--json")) {
		printf(", \"total_ms\": %.3f, \"daemon\": {", now_ms() - t0);
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
	free(kin);
	free(vin);
	free(segs);
	npy_free(&nw);
	return rc;
}

static void print_chunks(const struct kvb_chunk_info *ci, size_t n, bool json, bool show_found)
{
	char hex[2 * KVB_HASH_LEN + 1];

	if (json)
		printf("[");
	for (size_t i = 0; i < n; i++) {
		kvb_hash_format(ci[i].hash, hex);
		if (json) {
			printf("%s{\"hash\": \"%s\", \"found\": %s, \"tokens\": %" PRIu32
			       ", \"base_pos\": %" PRIu32 ", \"raw_bytes\": %" PRIu64
			       ", \"stored_bytes\": %" PRIu64 "}", i ? ", " : "", hex,
			       ci[i].found ? "true" : "false", ci[i].num_tokens, ci[i].base_pos,
			       ci[i].raw_bytes, ci[i].stored_bytes);
		} else if (show_found && !ci[i].found) {
			printf("%s\tmissing\n", hex);
		} else {
			printf("%s\ttokens=%" PRIu32 " base_pos=%" PRIu32 " raw=%" PRIu64
			       " stored=%" PRIu64 "\n", hex, ci[i].num_tokens, ci[i].base_pos,
			       ci[i].raw_bytes, ci[i].stored_bytes);
		}
	}
	if (json)
		printf("]\n");
}

static int cmd_ls(kvb_client *c, struct args *a)
{
	struct opts o = { 0 };
	struct kvb_chunk_info *ci;
	const char *model;
	size_t n;
	int rc;

	opt_decl(&o, "--model", false);
	opt_decl(&o, "--json", true);
	if (opt_parse(&o, a) || need(&o, "--model", &model))
		return 2;
	rc = kvb_list(c, model, &ci, &n);
	if (rc)
		return client_err(c, rc, "ls");
	print_chunks(ci, n, opt(&o, "--json") != NULL, false);
	free(ci);
	return 0;
}

static int cmd_lookup(kvb_client *c, struct args *a)
{
	struct opts o = { 0 };
	struct kvb_chunk_info *ci;
	uint8_t(*h)[KVB_HASH_LEN];
	const char *model;
	int rc;

	opt_decl(&o, "--model", false);
	opt_decl(&o, "--json", true);
	if (opt_parse(&o, a) || need(&o, "--model", &model))
		return 2;
	if (!o.npos)
		return die("lookup needs at least one hash") ? 2 : 2;
	h = calloc((size_t)o.npos, sizeof(*h));
	ci = calloc((size_t)o.npos, sizeof(*ci));
	if (!h || !ci) {
		free(h);
		free(ci);
		return die("out of memory");
	}
	rc = 0;
	for (int i = 0; i < o.npos && !rc; i++)
		rc = parse_hash(o.positional[i], h[i]);
	if (!rc) {
		rc = kvb_lookup(c, model, (const uint8_t(*)[KVB_HASH_LEN])h, (size_t)o.npos, ci);
		if (rc)
			rc = client_err(c, rc, "lookup");
		else
			print_chunks(ci, (size_t)o.npos, opt(&o, "--json") != NULL, true);
	} else {
		rc = 2;
	}
	free(h);
	free(ci);
	return rc;
}

static int cmd_pin_common(kvb_client *c, struct args *a, bool pin)
{
	struct opts o = { 0 };
	const char *model, *hexs, *ttl_s;
	uint8_t h[KVB_HASH_LEN];
	uint32_t ttl = 0;
	int rc;

	opt_decl(&o, "--model", false);
	opt_decl(&o, "--hash", false);
	if (pin)
		opt_decl(&o, "--ttl", false);
	if (opt_parse(&o, a) || need(&o, "--model", &model) || need(&o, "--hash", &hexs) ||
	    parse_hash(hexs, h))
		return 2;
	if (pin && (need(&o, "--ttl", &ttl_s) || parse_u32(ttl_s, "--ttl", &ttl)))
		return 2;
	rc = pin ? kvb_pin(c, model, h, ttl) : kvb_unpin(c, model, h);
	if (rc)
		return client_err(c, rc, pin ? "pin" : "unpin");
	if (pin)
		printf("pinned %s for %" PRIu32 " s\n", hexs, ttl);
	else
		printf("unpinned %s\n", hexs);
	return 0;
}

static int cmd_pin(kvb_client *c, struct args *a)
{
	return cmd_pin_common(c, a, true);
}

static int cmd_unpin(kvb_client *c, struct args *a)
{
	return cmd_pin_common(c, a, false);
}

static int cmd_rm(kvb_client *c, struct args *a)
{
	struct opts o = { 0 };
	const char *model, *hexs;
	uint8_t h[KVB_HASH_LEN];
	int rc;

	opt_decl(&o, "--model", false);
	opt_decl(&o, "--hash", false);
	if (opt_parse(&o, a) || need(&o, "--model", &model) || need(&o, "--hash", &hexs) ||
	    parse_hash(hexs, h))
		return 2;
	rc = kvb_delete(c, model, h);
	if (rc)
		return client_err(c, rc, "rm");
	printf("deleted %s\n", hexs);
	return 0;
}

/* Values shaped like real KV: mostly N(0,1) with a few channels of large magnitude. */
static uint16_t f32_to_f16(float f)
{
	uint32_t x;
	uint32_t sign, exp, man;

	memcpy(&x, &f, 4);
	sign = (x >> 16) & 0x8000;
	exp = (x >> 23) & 0xff;
	man = x & 0x7fffff;
	if (exp < 113)
		return (uint16_t)sign; /* tiny values flush to zero: fine for demo data */
	if (exp > 142)
		return (uint16_t)(sign | 0x7bff);
	return (uint16_t)(sign | (exp - 112) << 10 | man >> 13);
}

static int cmd_demo(kvb_client *c, struct args *a)
{
	struct opts o = { 0 };
	struct kvb_model m = { .name = "demo-tiny", .num_layers = 4, .num_kv_heads = 2,
			       .head_dim = 64, .dtype = KVB_F16, .rope_theta = 10000 };
	enum { CHUNKS = 3, T = 128 };
	size_t bytes = (size_t)m.num_layers * 2 * T * m.num_kv_heads * m.head_dim * 2;
	uint16_t *kv = malloc(bytes), *back = malloc(bytes);
	uint8_t hashes[CHUNKS][KVB_HASH_LEN];
	struct kvb_chunk_info info[CHUNKS + 1];
	uint64_t rng = 0x9e3779b97f4a7c15ull;
	char hex[2 * KVB_HASH_LEN + 1], version[64];
	int existed, rc = 1;

	if (opt_parse(&o, a)) {
		free(kv);
		free(back);
		return 2;
	}
	if (!kv || !back) {
		free(kv);
		free(back);
		return die("out of memory");
	}
	if ((rc = kvb_ping(c, version, sizeof(version)))) {
		rc = client_err(c, rc, "demo");
		goto out;
	}
	printf("connected to kvblendd %s\n", version);
	rc = kvb_model_register(c, &m, &existed);
	if (rc) {
		rc = client_err(c, rc, "demo: model add");
		goto out;
	}
	printf("model %s: %u layers, %u kv heads, head_dim %u, f16 (%s)\n", m.name, m.num_layers,
	       m.num_kv_heads, m.head_dim, existed ? "already registered" : "registered");
	for (int ch = 0; ch < CHUNKS; ch++) {
		uint32_t ids[T];

		for (int t = 0; t < T; t++)
			ids[t] = (uint32_t)(1000 * ch + t);
		kvb_chunk_hash(ids, T, hashes[ch]);
		for (size_t i = 0; i < bytes / 2; i++) {
			/* xorshift + Box-Muller-free approximation: sum of uniforms ~ Gaussian */
			float g = 0;

			for (int k = 0; k < 4; k++) {
				rng ^= rng << 13;
				rng ^= rng >> 7;
				rng ^= rng << 17;
				g += (float)(rng >> 40) / (float)(1 << 24) - 0.5f;
			}
			kv[i] = f32_to_f16(i % m.head_dim == 3 ? g * 40.0f : g * 1.7f);
		}
		rc = kvb_put(c, m.name, hashes[ch], KVB_F16, T, 0, kv, bytes, &existed);
		if (rc) {
			rc = client_err(c, rc, "demo: put");
			goto out;
		}
		kvb_hash_format(hashes[ch], hex);
		printf("put chunk %d: %u tokens, %zu bytes, hash %.16s... %s\n", ch, (unsigned)T, bytes,
		       hex,
		       existed ? "(already stored)" : "stored");
		rc = kvb_get(c, m.name, hashes[ch], 0, 0, back, bytes, &info[ch]);
		if (rc) {
			rc = client_err(c, rc, "demo: get");
			goto out;
		}
		if (memcmp(kv, back, bytes)) {
			rc = die("demo: chunk %d read back differs from what was stored", ch);
			goto out;
		}
		printf("get chunk %d: %zu bytes read back, identical (stored as %" PRIu64
		       " bytes)\n", ch, bytes, info[ch].stored_bytes);
	}
	{
		uint8_t q[CHUNKS + 1][KVB_HASH_LEN];
		uint32_t other[1] = { 7 };

		memcpy(q, hashes, sizeof(hashes));
		kvb_chunk_hash(other, 1, q[CHUNKS]);
		rc = kvb_lookup(c, m.name, (const uint8_t(*)[KVB_HASH_LEN])q, CHUNKS + 1, info);
		if (rc) {
			rc = client_err(c, rc, "demo: lookup");
			goto out;
		}
		printf("lookup of %d hashes: %d %d %d found, unknown hash %s\n", CHUNKS + 1,
		       info[0].found, info[1].found, info[2].found,
		       info[3].found ? "found (unexpected)" : "missing (as expected)");
	}
	printf("demo done\n");
	rc = 0;
out:
	free(kv);
	free(back);
	return rc;
}

int main(int argc, char **argv)
{
	static const struct {
		const char *name;
		int (*fn)(kvb_client *, struct args *);
		bool needs_daemon;
	} cmds[] = {
		{ "ping", cmd_ping, true },   { "stats", cmd_stats, true },
		{ "model", cmd_model, true }, { "put", cmd_put, true },
		{ "get", cmd_get, true },     { "ls", cmd_ls, true },
		{ "lookup", cmd_lookup, true }, { "rm", cmd_rm, true },
		{ "hash", cmd_hash, false },  { "demo", cmd_demo, true },
		{ "fuse", cmd_fuse, true },   { "get-rerotated", cmd_get_rerotated, true },
		{ "pin", cmd_pin, true },     { "unpin", cmd_unpin, true },
		{ "keygen", cmd_keygen, false }, { "cluster", cmd_cluster, true },
	};
	struct kvb_connect_opts copts = { 0 };
	struct args a = { argc, argv, 1 };
	const char *endpoint = NULL;
	kvb_client *c = NULL;
	char err[600];
	int rc;

	while (a.i < argc && !strncmp(argv[a.i], "--", 2)) {
		const char *arg = argv[a.i];

		if (!strcmp(arg, "--help") || !strcmp(arg, "-h")) {
			fputs(usage_text, stdout);
			return 0;
		}
		if (!strcmp(arg, "--version")) {
			printf("kvblend %s\n", KVBLEND_VERSION);
			return 0;
		}
		if (a.i + 1 >= argc) {
			die("%s needs a value", arg);
			return 2;
		}
		if (!strcmp(arg, "--endpoint")) {
			endpoint = argv[a.i + 1];
		} else if (!strcmp(arg, "--timeout")) {
			uint32_t t = 0;

			if (parse_u32(argv[a.i + 1], "--timeout", &t) || !t || t > 3600000) {
				die("--timeout: expected 1..3600000 milliseconds");
				return 2;
			}
			copts.timeout_ms = (int)t;
		} else {
			die("unknown option %s (see kvblend --help)", arg);
			return 2;
		}
		a.i += 2;
	}
	if (a.i >= argc) {
		fputs(usage_text, stderr);
		return 2;
	}
	for (size_t k = 0; k < sizeof(cmds) / sizeof(cmds[0]); k++) {
		if (strcmp(cmds[k].name, argv[a.i]))
			continue;
		a.i++;
		/* `kvblend COMMAND --help` answers without a daemon */
		for (int j = a.i; j < argc; j++)
			if (!strcmp(argv[j], "--help") || !strcmp(argv[j], "-h")) {
				fputs(usage_text, stdout);
				return 0;
			}
		if (cmds[k].needs_daemon) {
			rc = kvb_connect(endpoint, &copts, &c, err, sizeof(err));
			if (rc)
				return die("%s", err);
		}
		rc = cmds[k].fn(c, &a);
		kvb_close(&c);
		return rc;
	}
	die("unknown command '%s' (see kvblend --help)", argv[a.i]);
	return 2;
}
