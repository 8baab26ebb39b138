/*
 * cli_admin — the kvblend commands about the daemon rather than chunks: keygen, ping,
 * stats, cluster and model.
 */
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "client/cli.h"

/* A counter as a person reads it: whole numbers in full (bytes, chunks), the rest in %g. */
static void print_stat(const char *name, double v)
{
	if (v == (double)(int64_t)v && fabs(v) < 9007199254740992.0) /* 2^53: exact */
		printf("%-28s %" PRId64 "\n", name, (int64_t)v);
	else
		printf("%-28s %.6g\n", name, v);
}

int cmd_keygen(kvb_client *c, struct args *a)
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

int cmd_ping(kvb_client *c, struct args *a)
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

int cmd_stats(kvb_client *c, struct args *a)
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
			print_stat(s[i].name, s[i].value);
	}
	free(s);
	return 0;
}

/* stat "NAME:id" of s (NAN when absent). */
static double stat_of(const struct kvb_stat *s, size_t n, const char *name, const char *id)
{
	char nm[sizeof(s[0].name)];

	snprintf(nm, sizeof(nm), "%s%s%s", name, id ? ":" : "", id ? id : "");
	for (size_t i = 0; i < n; i++)
		if (!strcmp(s[i].name, nm))
			return s[i].value;
	return NAN;
}

/*
 * kvblend cluster check: each member's share of the replication check, as
 * `redis-cli --cluster check`; exit status 1 when a chunk has fewer than R copies
 * or a member could not be checked.
 */
static int cluster_check(kvb_client *c, struct args *a)
{
	static const char *const cols[] = { "chunks", "owned", "beyond", "missing", "unverified" };
	struct opts o = { 0 };
	struct kvb_stat *s;
	size_t n;
	double under, beyond, members, answered;
	bool json, first = true;
	int rc;

	opt_decl(&o, "--json", true);
	if (opt_parse(&o, a))
		return 2;
	json = opt(&o, "--json") != NULL;
	rc = kvb_cluster_check(c, &s, &n);
	if (rc)
		return client_err(c, rc, "cluster check");
	under = stat_of(s, n, "check_under", NULL);
	beyond = stat_of(s, n, "check_beyond", NULL);
	members = stat_of(s, n, "check_members", NULL);
	answered = stat_of(s, n, "check_answered", NULL);
	if (isnan(under)) {
		free(s);
		return die("cluster check: this daemon is in no cluster (neither cluster_peers nor "
			   "cluster_etcd set), or too old to check") ? 1 : 1;
	}
	if (json)
		printf("{\"members\": [");
	else
		printf("%-16s %-8s %10s %10s %10s %10s %10s\n", "member", "checked", "chunks",
		       "owned", "beyond R", "missing", "unverified");
	for (size_t i = 0; i < n; i++) {
		const char *id;
		bool ok;

		if (strncmp(s[i].name, "check_answered:", 15))
			continue;
		id = s[i].name + 15;
		ok = s[i].value != 0;
		if (json) {
			printf("%s{\"id\": ", first ? "" : ", ");
			json_str(id);
			printf(", \"answered\": %s", ok ? "true" : "false");
			for (int j = 0; j < 5; j++) {
				char nm[32];

				snprintf(nm, sizeof(nm), "check_%s", cols[j]);
				printf(", \"%s\": %.0f", cols[j], stat_of(s, n, nm, id));
			}
			printf("}");
		} else {
			printf("%-16s %-8s", id, ok ? "yes" : "NO");
			for (int j = 0; j < 5; j++) {
				char nm[32];

				snprintf(nm, sizeof(nm), "check_%s", cols[j]);
				printf(" %10.0f", stat_of(s, n, nm, id));
			}
			printf("\n");
		}
		first = false;
	}
	if (json)
		printf("], \"under_replicated\": %.0f, \"copies_beyond_r\": %.0f, \"checked\": "
		       "%.0f, \"of\": %.0f}\n", under, beyond, answered, members);
	else
		printf("%.0f chunks with fewer than R copies, %.0f copies beyond R; %.0f of %.0f "
		       "members checked\n", under, beyond, answered, members);
	free(s);
	if (answered < members)
		fprintf(stderr, "kvblend: cluster check: %.0f members did not answer\n",
			members - answered);
	return under > 0 || answered < members ? 1 : 0;
}

int cmd_cluster(kvb_client *c, struct args *a)
{
	const char *sub = a->i < a->argc ? a->argv[a->i++] : "";
	struct opts o = { 0 };
	struct kvb_stat *s;
	struct kvb_member *mb;
	size_t n, n_mb;
	bool json, first = true;
	int rc;

	if (!strcmp(sub, "check"))
		return cluster_check(c, a);
	if (strcmp(sub, "status"))
		return die("cluster: expected 'status' or 'check'") ? 2 : 2;
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
				print_stat(s[i].name, s[i].value);
	}
	free(s);
	return 0;
}

static void print_model_json(const struct kvb_model *m, const struct kvb_model_layers *ly)
{
	char spec[128], store[32];

	kvb_rope_scaling_format(m, spec, sizeof(spec));
	printf("{\"name\": ");
	json_str(m->name);
	kvb_store_format(m, store, sizeof(store));
	printf(", \"layers\": %" PRIu32 ", \"kv_heads\": %" PRIu32 ", \"head_dim\": %" PRIu32
	       ", \"dtype\": \"%s\", \"rope_theta\": %.17g, \"rope_style\": \"%s\", "
	       "\"rotary_dim\": %" PRIu32 ", \"rope_scaling\": \"%s\", \"k_pre_rope\": %s, "
	       "\"store\": \"%s\", \"rope_local_theta\": %.17g, \"full_every\": %" PRIu32 "}",
	       m->num_layers, m->num_kv_heads, m->head_dim, kvb_dtype_name(m->dtype), m->rope_theta,
	       m->rope_style == KVB_ROPE_GPTJ ? "gptj" : "neox", m->rotary_dim, spec,
	       m->k_pre_rope ? "true" : "false", store, ly->rope_local_theta, ly->full_every);
}

int cmd_model(kvb_client *c, struct args *a)
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
		printf("%s", opt(&o, "--json") ? "[" : "");
		for (size_t i = 0; i < n; i++) {
			struct kvb_model_layers ly = { 0 };
			char spec[128], local[64] = "", store[32];

			/* the layers of each model (kvb_model_list does not say them) */
			rc = kvb_model_get_layers(c, ms[i].name, &ms[i], &ly);
			if (rc) {
				free(ms);
				return client_err(c, rc, "model ls");
			}
			if (opt(&o, "--json")) {
				printf("%s", i ? ", " : "");
				print_model_json(&ms[i], &ly);
				continue;
			}
			kvb_rope_scaling_format(&ms[i], spec, sizeof(spec));
			kvb_store_format(&ms[i], store, sizeof(store));
			if (ly.full_every)
				snprintf(local, sizeof(local), " rope_local_theta=%g full_every=%" PRIu32,
					 ly.rope_local_theta, ly.full_every);
			printf("%s\tlayers=%" PRIu32 " kv_heads=%" PRIu32 " head_dim=%" PRIu32
			       " dtype=%s rope_theta=%g rope_style=%s rotary_dim=%" PRIu32
			       " rope_scaling=%s%s store=%s%s\n", ms[i].name, ms[i].num_layers,
			       ms[i].num_kv_heads, ms[i].head_dim, kvb_dtype_name(ms[i].dtype),
			       ms[i].rope_theta, ms[i].rope_style ? "gptj" : "neox",
			       ms[i].rotary_dim, spec, local, store,
			       ms[i].k_pre_rope ? " k_pre_rope" : "");
		}
		printf("%s", opt(&o, "--json") ? "]\n" : "");
		free(ms);
		return 0;
	}
	if (!strcmp(sub, "add")) {
		struct kvb_model m = { 0 };
		struct kvb_model_layers ly = { 0 };
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
		opt_decl(&o, "--rope-local-theta", false);
		opt_decl(&o, "--full-every", false);
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
		v = opt(&o, "--rope-local-theta");
		if (v) {
			ly.rope_local_theta = strtod(v, &end);
			if (*end || !(ly.rope_local_theta > 0))
				return die("--rope-local-theta: '%s' is not a positive number", v)
					       ? 2 : 2;
		}
		v = opt(&o, "--full-every");
		if (v && parse_u32(v, "--full-every", &ly.full_every))
			return 2;
		if ((ly.rope_local_theta > 0) != (ly.full_every != 0))
			return die("--rope-local-theta and --full-every go together") ? 2 : 2;
		rc = kvb_model_register_layers(c, &m, &ly, &existed);
		if (rc)
			return client_err(c, rc, "model add");
		printf("%s %s\n", existed ? "model already registered:" : "registered model", m.name);
		return 0;
	}
	return die("model: expected 'add' or 'ls'") ? 2 : 2;
}
