/*
 * cli_common — what every command of the kvblend CLI shares: the usage text, the
 * error line and exit codes, option parsing, and the parsers of numbers, hashes and
 * token files. See cli.h.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/cli.h"
#include "client/npy.h"

const char usage_text[] =
	"usage: kvblend [--endpoint E] [--timeout MS] COMMAND [ARGS]\n"
	"\n"
	"Client of kvblendd, the kvblend KV-cache daemon. The endpoint defaults to\n"
	"$KVBLEND_ENDPOINT, else ipc:///run/kvblend/kvblend.sock. On tcp:// endpoints\n"
	"$KVBLEND_SERVER_KEY (the daemon's CURVE public key) turns on CURVE, with\n"
	"$KVBLEND_CLIENT_KEY as this client's secret key. A GET or PUT over TCP moves its\n"
	"payload on a bulk connection ($KVBLEND_NO_BULK=1: in ZeroMQ frames), sealed under CURVE\n"
	"with the fastest cipher both ends run ($KVBLEND_BULK_CIPHER=aes-256-gcm,\n"
	"aegis-128l or aegis-128x2 names one).\n"
	"\n"
	"commands:\n"
	"  ping                                   check that the daemon answers; print its version\n"
	"  stats [--json]                         daemon counters\n"
	"  model add NAME --layers L --kv-heads H --head-dim D --dtype f16|bf16|f32\n"
	"            --rope-theta T [--rope-style neox|gptj] [--rotary-dim R]\n"
	"            [--rope-scaling SPEC] [--k-pre-rope] [--store CODEC]\n"
	"            [--rope-local-theta T --full-every N]\n"
	"                                         register a model (SPEC: none | linear:F |\n"
	"                                         llama3:F,LOW,HIGH,ORIG_MAX | yarn:F,ORIG_MAX[,BF,BS]\n"
	"                                         | dynamic:F,MAX_POS; CODEC, how its chunks are\n"
	"                                         stored: dtype (lossless, default) | fp8 | int8 |\n"
	"                                         int4[:GROUP], lossy, docs/storage.md; local\n"
	"                                         layers, Gemma 3's: each Nth layer (from 1) is a\n"
	"                                         full-attention one, the others rotate with base\n"
	"                                         T, no scaling)\n"
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
	"       --ratio R[,R...] --check-layers C[,C...] [--metric value|key|attention]\n"
	"       [--attention A.npy] --out FUSED.npy [--selected SEL.npy] [--json]\n"
	"                                         fuse stored chunks into a new prompt\n"
	"                                         (CacheBlend), layer by layer, with the fresh KV\n"
	"                                         of all tokens in NEW ([layers,2,N,heads,dim]);\n"
	"                                         --metric attention scores by A, float32\n"
	"                                         [chunk tokens, heads] (docs/fuse.md)\n"
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
	"  cluster check [--json]                 the replication check, per member: chunks held,\n"
	"                                         owned, copies beyond R, copies it owns but\n"
	"                                         lacks; the chunks with fewer than R copies;\n"
	"                                         exit status 1 when any (or a member did not\n"
	"                                         answer)\n"
	"  demo                                   register a small model, store chunks, read them\n"
	"                                         back and verify them, printing each step\n"
	"\n"
	"Exit status: 0 on success, 1 on an error (one line on stderr), 2 on bad usage.\n";

int die(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
int die(const char *fmt, ...)
{
	va_list ap;

	fputs("kvblend: ", stderr);
	va_start(ap, fmt);
	vfprintf(stderr, fmt, ap);
	va_end(ap);
	fputc('\n', stderr);
	return 1;
}

int client_err(kvb_client *c, int rc, const char *what)
{
	const char *msg = kvb_last_error(c);

	return die("%s: %s%s%s", what, kvb_strerror(rc), *msg ? ": " : "", msg);
}

void opt_decl(struct opts *o, const char *name, bool is_switch)
{
	o->names[o->n] = name;
	o->is_switch[o->n] = is_switch;
	o->values[o->n++] = NULL;
}

int opt_parse(struct opts *o, struct args *a)
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

const char *opt(const struct opts *o, const char *name)
{
	for (int k = 0; k < o->n; k++)
		if (!strcmp(o->names[k], name))
			return o->values[k];
	return NULL;
}

int need(const struct opts *o, const char *name, const char **out)
{
	*out = opt(o, name);
	return *out ? 0 : die("%s is required", name);
}

int parse_u32(const char *s, const char *what, uint32_t *out)
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

int parse_hash(const char *s, uint8_t h[KVB_HASH_LEN])
{
	if (kvb_hash_parse(s, h))
		return die("'%s' is not a chunk hash (64 hex digits)", s);
	return 0;
}

/* Token ids from a .npy of integers or a text file of whitespace-separated ids. */
int read_tokens(const char *path, uint32_t **ids, size_t *n)
{
	char err[512];
	struct npy a;
	FILE *f = fopen(path, "rb");
	char magic[6] = { 0 };
	size_t cap = 0;

	char *piped = NULL;
	size_t got;

	if (!f)
		return die("%s: %s", path, strerror(errno));
	got = fread(magic, 1, 6, f);
	if (got == 6 && !memcmp(magic, "\x93NUMPY", 6)) {
		if (fseek(f, 0, SEEK_SET)) {
			fclose(f);
			return die("%s: a .npy of token ids must be a file, not a pipe", path);
		}
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
	if (fseek(f, 0, SEEK_SET)) {
		/* A pipe: the bytes taken for the .npy check are gone from f, so read it whole
		 * after them and parse that (rewind() would silently lose them). */
		size_t len = got, cap_b = 4096;
		FILE *mem;

		piped = malloc(cap_b);
		if (!piped) {
			fclose(f);
			return die("out of memory");
		}
		memcpy(piped, magic, got);
		for (;;) {
			size_t r;

			if (len == cap_b) {
				char *p = cap_b < (1u << 30) ? realloc(piped, 2 * cap_b) : NULL;

				if (!p) {
					fclose(f);
					free(piped);
					return die("%s: too large (or out of memory)", path);
				}
				piped = p;
				cap_b *= 2;
			}
			r = fread(piped + len, 1, cap_b - len, f);
			if (!r)
				break;
			len += r;
		}
		fclose(f);
		mem = len ? fmemopen(piped, len, "r") : NULL;
		if (!mem) {
			free(piped);
			return die("%s: no token ids", path);
		}
		f = mem;
	}
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
			free(piped);
			free(*ids);
			return die("%s: '%s' is not a token id (0..%u)", path, word, UINT32_MAX);
		}
		if (*n == cap) {
			uint32_t *p = realloc(*ids, (cap ? 2 * cap : 256) * sizeof(*p));

			if (!p) {
				fclose(f);
				free(piped);
				free(*ids);
				return die("out of memory");
			}
			*ids = p;
			cap = cap ? 2 * cap : 256;
		}
		(*ids)[(*n)++] = (uint32_t)v;
	}
	fclose(f);
	free(piped);
	if (!*n)
		return die("%s: no token ids", path);
	return 0;
}

const char *npy_descr(enum kvb_dtype d)
{
	return d == KVB_F32 ? "<f4" : d == KVB_BF16 ? "<u2" : "<f2";
}

void json_str(const char *s)
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
