/*
 * cli_chunk — the kvblend commands about chunks: hash, put, get, get-rerotated, ls,
 * lookup, pin, unpin and rm.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/cli.h"
#include "client/npy.h"

int cmd_hash(kvb_client *c, struct args *a)
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

int cmd_put(kvb_client *c, struct args *a)
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

int cmd_get(kvb_client *c, struct args *a)
{
	return get_cmd(c, a, false);
}

int cmd_get_rerotated(kvb_client *c, struct args *a)
{
	return get_cmd(c, a, true);
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

int cmd_ls(kvb_client *c, struct args *a)
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

int cmd_lookup(kvb_client *c, struct args *a)
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

int cmd_pin(kvb_client *c, struct args *a)
{
	return cmd_pin_common(c, a, true);
}

int cmd_unpin(kvb_client *c, struct args *a)
{
	return cmd_pin_common(c, a, false);
}

int cmd_rm(kvb_client *c, struct args *a)
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
