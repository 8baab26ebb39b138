/*
 * kvblend — command-line client of kvblendd: the global options, the command table and
 * `kvblend demo`. The commands live in cli_admin.c, cli_chunk.c and cli_fuse.c; what
 * they share in cli_common.c (cli.h).
 */
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <inttypes.h>

#include "client/cli.h"

#ifndef KVBLEND_VERSION
#define KVBLEND_VERSION "0.0.0"
#endif

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
