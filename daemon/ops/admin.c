/* ops/admin — HELLO, models, STATS and shared-memory segments; see impl.h. */
#include "daemon/ops/impl.h"

#include <ctype.h>
#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "daemon/bulk.h"
#include "proto/bulk.h"
#include "daemon/clients.h"
#include "daemon/counters.h"
#include "cluster/cluster.h"
#include "daemon/fdguard.h"
#include "daemon/lane.h"
#include "daemon/log.h"
#include "daemon/metrics.h"
#include "daemon/pool.h"
#include "blend/rope.h"

#ifndef KVBLEND_VERSION
#define KVBLEND_VERSION "0.0.0"
#endif

/*
 * A bulk connection for a TCP client (bulk.h): sealed when the request came over CURVE,
 * whose channel alone carries the key. None for IPC clients (they have shared memory),
 * on a daemon without bulk connections, or beyond the limits: the reply then has no
 * bulk_port and the client keeps to frames.
 */
/*
 * Who may run the cluster's replication check (docs/operations.md#limits-per-client):
 * another member (cluster_is_member: its key, or its address on a keyless cluster)
 * and an administrator, a local client on IPC running as root or as the daemon's own
 * user (`kvblend cluster check` on a member's machine). Anyone else could make every
 * member walk its whole store on demand.
 */
static bool may_check_cluster(const struct req *q)
{
	unsigned long uid;
	char *end;

	if (cluster_is_member(q->srv->cluster, q->principal))
		return true;
	if (strncmp(q->principal, "ipc:", 4))
		return false;
	uid = strtoul(q->principal + 4, &end, 10);
	return *end == ':' && (uid == 0 || uid == (unsigned long)geteuid());
}

/* A cluster check asked for by someone who may not: refused, naming who may. */
static bool refuse_check(struct req *q)
{
	if (may_check_cluster(q))
		return false;
	fail(q, KVBP_BAD_ARGUMENT, "cluster_check is for the cluster's members and for "
	     "administrators (root or the daemon's user on its IPC endpoint); %s is neither",
	     q->principal);
	return true;
}

static void hello_bulk(struct req *q)
{
	struct kvbp_reply *r = &q->out->rep;
	bool sealed = !strncmp(q->principal, "key:", 4) || !strncmp(q->principal, "curve:", 6);
	uint32_t cipher;
	int rc;

	if (!q->srv->bulk || (!sealed && strncmp(q->principal, "tcp:", 4)))
		return;
	/* the fastest AEGIS both ends run, when allowed; else AES-256-GCM */
	cipher = q->srv->cfg->tcp_bulk_aegis ? kvbb_aead_pick(q->h.bulk_aeads & kvbb_aeads())
					     : KVBP_AEAD_AES256GCM;
	rc = bulk_open(q->srv->bulk, q->principal, q->conn_id, q->conn_id_len, sealed, cipher,
		       r->bulk_ticket, r->bulk_key);
	if (rc) {
		log_debug("no bulk connection for %s: %s", q->principal, strerror(-rc));
		return;
	}
	r->bulk_port = bulk_port(q->srv->bulk);
	r->has_bulk_key = sealed;
	r->bulk_aead = cipher;
	r->bulk_put = true;
}

void op_hello(struct req *q)
{
	if (no_payload(q))
		return;
	snprintf(q->out->rep.server_version, sizeof(q->out->rep.server_version), "%s",
		 KVBLEND_VERSION);
	/* a local client's descriptor socket (shm.h): where it hands in device memory */
	if (!strncmp(q->principal, "ipc:", 4))
		snprintf(q->out->rep.shm_name, sizeof(q->out->rep.shm_name), "%s",
			 shm_path(q->srv->shm));
	if (q->h.bulk_open)
		hello_bulk(q);
	if (q->h.local_only) { /* another member's heartbeat: what this store holds */
		struct store_totals t;
		struct kvbp_stat *st = calloc(2, sizeof(*st));
		size_t n = 0;

		if (st && !store_totals(q->srv->store, &t)) {
			snprintf(st[n].name, sizeof(st[0].name), "chunks");
			st[n++].value = (double)t.chunks;
			snprintf(st[n].name, sizeof(st[0].name), "stored_bytes");
			st[n++].value = (double)t.stored_bytes;
		}
		/* kvblend cluster check on another member: check this member's share, in
		 * the background (the gauge), and answer at once */
		if (q->h.cluster_check && q->srv->cluster) {
			if (refuse_check(q)) {
				free(st);
				return;
			}
			cluster_check_wanted(q->srv->cluster);
		}
		if (st && n) {
			q->out->rep.stats = st;
			q->out->rep.n_stats = n;
		} else {
			free(st);
		}
	}
}

void op_model_register(struct req *q)
{
	struct store_model sm;
	int rc;

	if (no_payload(q))
		return;
	if (!q->h.has_model) {
		fail(q, KVBP_BAD_ARGUMENT, "model_register needs a model");
		return;
	}
	if (model_check(q, &q->h.model))
		return;
	model_to_store(&q->h.model, &sm);
	if (stored_name(q, q->h.model.name, sm.name))
		return;
	rc = store_model_register(q->srv->store, &sm);
	if (rc == -EEXIST) {
		struct store_model old;
		const char *field = store_model_find(q->srv->store, sm.name, &old)
					    ? NULL : kvb_model_desc_diff(&old.desc, &sm.desc);

		/* the field named, so that a client can say what changed (issue 55, defect 8) */
		if (field)
			fail(q, KVBP_MODEL_CONFLICT, "model '%s' exists with a different layout or "
			     "RoPE configuration: its %s differs (stored chunks were computed under "
			     "the registered one; register under a new name, or delete the model's "
			     "chunks first)", q->h.model.name, field);
		else
			fail(q, KVBP_MODEL_CONFLICT, "model '%s' exists with a different layout or "
			     "RoPE configuration", q->h.model.name);
		return;
	}
	if (rc < 0) {
		fail_store(q, rc, "model_register");
		return;
	}
	q->out->rep.existed = rc == 1;
	q->out->rep.models = calloc(1, sizeof(struct kvbp_model));
	if (!q->out->rep.models) {
		fail(q, KVBP_LIMIT, "out of memory");
		return;
	}
	model_from_store(&sm, q->out->rep.models);
	snprintf(q->out->rep.models->name, sizeof(q->out->rep.models->name), "%s",
		 q->h.model.name);
	q->out->rep.n_models = 1;
	if (rc == 0)
		log_info("model '%s' registered: %u layers, %u kv heads, head_dim %u, %s", sm.name,
			 sm.desc.num_layers, sm.desc.num_kv_heads, sm.desc.head_dim,
			 kvbp_dtype_name(sm.desc.dtype));
}

/*
 * MODEL_LIST naming a model, from a member (cluster_model_find): that model alone,
 * named as stored ("TENANT#NAME" for a tenant's), or none.
 */
static void model_for_member(struct req *q)
{
	struct store_model sm;
	int rc = store_model_find(q->srv->store, q->h.model_name, &sm);

	if (rc == -ENOENT)
		return;
	if (rc) {
		fail_store(q, rc, "model_list");
		return;
	}
	q->out->rep.models = calloc(1, sizeof(struct kvbp_model));
	if (!q->out->rep.models) {
		fail(q, KVBP_LIMIT, "out of memory");
		return;
	}
	model_from_store(&sm, q->out->rep.models);
	q->out->rep.n_models = 1;
}

void op_model_list(struct req *q)
{
	struct store_model *ms = NULL;
	size_t n = 0;
	int rc;

	if (no_payload(q))
		return;
	if (q->h.model_name[0] && cluster_is_member(q->srv->cluster, q->principal)) {
		model_for_member(q);
		return;
	}
	if (q->h.model_name[0] && !strchr(q->h.model_name, '#') && q->srv->cluster &&
	    !q->h.local_only) {
		/* a client looking for one model (kvb_model_get): one registered on another
		 * member is registered here first (a name with '#' is listed as before: as no
		 * model of the client's) */
		char name[STORE_NAME_MAX + 1];
		struct store_model sm;

		if (stored_name(q, q->h.model_name, name))
			return;
		if (store_model_find(q->srv->store, name, &sm) == -ENOENT &&
		    model_from_members(q, name, &sm) == -EINVAL)
			return;
	}
	rc = store_model_list(q->srv->store, &ms, &n);
	if (rc) {
		fail_store(q, rc, "model_list");
		return;
	}
	if (n) {
		q->out->rep.models = calloc(n, sizeof(struct kvbp_model));
		if (!q->out->rep.models) {
			free(ms);
			fail(q, KVBP_LIMIT, "out of memory");
			return;
		}
		for (size_t i = 0; i < n; i++) {
			const char *name = client_name(q, ms[i].name);
			struct kvbp_model *m = &q->out->rep.models[q->out->rep.n_models];

			if (!name) /* another namespace's */
				continue;
			model_from_store(&ms[i], m);
			snprintf(m->name, sizeof(m->name), "%s", name);
			q->out->rep.n_models++;
		}
	}
	free(ms);
}

/* The STATS reply's list, filled part by part: each part is what one module reports. */
struct stat_list {
	struct kvbp_stat *s;
	size_t n, cap;
};

static void stat_add(struct stat_list *l, const char *name, double value)
{
	if (l->n == l->cap)
		return; /* (sized for every part at its largest) */
	snprintf(l->s[l->n].name, sizeof(l->s[0].name), "%s", name);
	l->s[l->n++].value = value;
}

/* One member of the cluster: five stats, and the member in full in the reply. */
struct member_stats {
	struct stat_list *l;
	struct kvbp_reply *rep;
	size_t cap_members;
};

static void member_stat(void *ctx, const struct cluster_member *mb)
{
	struct member_stats *m = ctx;
	struct timespec now;
	double age;
	char nm[64];

	clock_gettime(CLOCK_REALTIME, &now);
	age = mb->last_reply_ms ? (double)now.tv_sec * 1e3 + now.tv_nsec / 1e6 -
					  (double)mb->last_reply_ms
				: -1;
	if (m->rep->n_members == m->cap_members) {
		size_t cap = m->cap_members ? 2 * m->cap_members : 8;
		struct kvbp_member *p = realloc(m->rep->members, cap * sizeof(*p));

		if (p) {
			m->rep->members = p;
			m->cap_members = cap;
		}
	}
	if (m->rep->n_members < m->cap_members) {
		struct kvbp_member *e = &m->rep->members[m->rep->n_members++];

		snprintf(e->id, sizeof(e->id), "%s", mb->id);
		snprintf(e->endpoint, sizeof(e->endpoint), "%s", mb->endpoint);
		e->state = mb->state;
		e->pushes_owed = mb->owed;
		e->last_reply_age_ms = age;
		e->chunks = mb->held_chunks;
		e->stored_bytes = mb->held_bytes;
	}
	if (m->l->n + 5 > m->l->cap)
		return;
	/* member:ID 1 alive, 0 suspect, -1 gone; the rest per member, names cut at 63 */
	snprintf(nm, sizeof(nm), "member:%.56s", mb->id);
	stat_add(m->l, nm, mb->state);
	snprintf(nm, sizeof(nm), "owed:%.58s", mb->id);
	stat_add(m->l, nm, (double)mb->owed);
	snprintf(nm, sizeof(nm), "seen_ms:%.55s", mb->id);
	stat_add(m->l, nm, age);
	snprintf(nm, sizeof(nm), "chunks:%.56s", mb->id);
	stat_add(m->l, nm, (double)mb->held_chunks);
	snprintf(nm, sizeof(nm), "bytes:%.57s", mb->id);
	stat_add(m->l, nm, (double)mb->held_bytes);
}

/* The store's chunks per codec, from its kept totals (no walk of the chunks). */
static void stats_codecs(struct stat_list *l, const struct store_totals *t)
{
	static const char *const names[STORE_CODECS] = { "dtype", "fp8", "int8", "int4" };

	for (int c = 0; c < STORE_CODECS; c++) {
		char nm[64];

		if (!t->codec[c].chunks)
			continue;
		snprintf(nm, sizeof(nm), "store_%s_chunks", names[c]);
		stat_add(l, nm, (double)t->codec[c].chunks);
		snprintf(nm, sizeof(nm), "store_%s_raw_bytes", names[c]);
		stat_add(l, nm, (double)t->codec[c].raw_bytes);
		snprintf(nm, sizeof(nm), "store_%s_stored_bytes", names[c]);
		stat_add(l, nm, (double)t->codec[c].stored_bytes);
	}
}

/*
 * STATS with cluster_check: the whole cluster's replication check (cluster_check_all),
 * per member (check_answered:ID, check_chunks:ID, check_owned:ID, check_beyond:ID,
 * check_missing:ID, check_unverified:ID) and in total (check_members, check_answered,
 * check_under, check_beyond).
 */
static void stats_check(struct stat_list *l, struct cluster *c)
{
	struct cluster_check_member *m;
	uint64_t under = 0, beyond = 0, answered = 0;
	size_t n;

	if (cluster_check_all(c, &m, &n, &under))
		return;
	for (size_t i = 0; i < n; i++) {
		const struct cluster_check *k = &m[i].check;
		const double v[6] = { m[i].answered, (double)k->chunks, (double)k->owned,
				      (double)k->beyond, (double)k->missing, (double)k->unverified };
		static const char *const names[6] = { "check_answered", "check_chunks",
						      "check_owned", "check_beyond",
						      "check_missing", "check_unverified" };
		char nm[64];

		for (int j = 0; j < 6; j++) {
			snprintf(nm, sizeof(nm), "%s:%.*s", names[j], (int)(62 - strlen(names[j])),
				 m[i].id);
			stat_add(l, nm, v[j]);
		}
		answered += m[i].answered;
		beyond += k->beyond;
	}
	stat_add(l, "check_members", (double)n);
	stat_add(l, "check_answered", (double)answered);
	stat_add(l, "check_under", (double)under);
	stat_add(l, "check_beyond", (double)beyond);
	free(m);
}

/* Each member of the cluster (member_stat): in the stats and in the reply. */
static void stats_members(struct stat_list *l, struct cluster *c, struct kvbp_reply *rep)
{
	struct member_stats ms = { l, rep, 0 };

	cluster_members(c, member_stat, &ms);
}

/* Requests and errors by kind; latency by operation: mean, and the 99th percentile as its
 * bucket's upper bound. */
static void stats_requests(struct stat_list *l, const struct server_stats *st)
{
	char nm[64];

	for (uint32_t op = 1; op <= KVBP_OP_COUNT; op++) {
		snprintf(nm, sizeof(nm), "requests_%s",
			 op < KVBP_OP_COUNT ? kvbp_op_name(op) : "unknown");
		stat_add(l, nm, (double)atomic_load(&st->requests[op]));
	}
	for (uint32_t c = 1; c < KVBP_CODE_COUNT; c++) {
		snprintf(nm, sizeof(nm), "errors_%s", kvbp_code_name(c));
		stat_add(l, nm, (double)atomic_load(&st->errors[c]));
	}
	for (uint32_t op = 1; op < KVBP_OP_COUNT; op++) {
		uint64_t cnt = atomic_load(&st->lat_count[op]), cum = 0;
		unsigned b = 0;

		if (!cnt)
			continue;
		snprintf(nm, sizeof(nm), "latency_ms_mean_%s", kvbp_op_name(op));
		stat_add(l, nm, (double)atomic_load(&st->lat_sum_ns[op]) / 1e6 / (double)cnt);
		for (; b < METRICS_BUCKETS; b++) {
			cum += atomic_load(&st->lat_bucket[op][b]);
			if (cum * 100 >= cnt * 99)
				break;
		}
		snprintf(nm, sizeof(nm), "latency_ms_p99_le_%s", kvbp_op_name(op));
		stat_add(l, nm, b + 1 < METRICS_BUCKETS ? metrics_bucket_le[b] * 1e3 : -1);
	}
}

/* The fuse backend and the device it runs on, by name (the figures are counters.c's). */
static void stats_device(struct stat_list *l, struct server *srv)
{
	char nm[64];

	snprintf(nm, sizeof(nm), "backend_%s", srv->blend->name);
	stat_add(l, nm, 1);
	if (srv->dev_ordinal >= 0) {
		size_t k = (size_t)snprintf(nm, sizeof(nm), "device_name_%s", srv->dev_model);

		/* The name as a stat name: words joined by '_' ("NVIDIA_H200"). */
		for (k = k < sizeof(nm) ? k : sizeof(nm) - 1; k-- > 12;)
			if (nm[k] == ' ')
				nm[k] = '_';
		stat_add(l, nm, 1);
		stat_add(l, "device_cuda_ordinal", srv->dev_ordinal);
	}
	if (srv->dev) {
		snprintf(nm, sizeof(nm), "device_%s", srv->dev->name);
		stat_add(l, nm, 1);
	}
}

/* STATS: the parts in a fixed order (clients and tests read them by name). */
void op_stats(struct req *q)
{
	struct server *srv = q->srv;
	struct stat_list l = { .cap = 128 + 3 * KVBP_OP_COUNT + KVBP_CODE_COUNT + 12 * 1024 };
	struct counter_snap snap;

	if (no_payload(q))
		return;
	if (srv->cluster && q->h.cluster_check) {
		if (refuse_check(q))
			return;
		if (!q->lane) { /* every chunk of every model: not on a worker (lane.h) */
			q->out->defer = true;
			return;
		}
	}
	l.s = calloc(l.cap, sizeof(*l.s));
	if (!l.s) {
		fail(q, KVBP_LIMIT, "out of memory");
		return;
	}
	if (srv->cluster && q->h.cluster_check)
		stats_check(&l, srv->cluster); /* first: the gauges below then show it */
	counters_snap(srv, &snap);
	if (!snap.have_totals) {
		free(l.s);
		fail_store(q, store_totals(srv->store, &snap.t), "stats");
		return;
	}
	for (size_t i = 0; i < n_counters; i++)
		if (counters[i].stat && counter_present(&counters[i], &snap))
			stat_add(&l, counters[i].stat, counters[i].value(&snap));
	stats_codecs(&l, &snap.t);
	if (srv->cluster)
		stats_members(&l, srv->cluster, &q->out->rep);
	stats_requests(&l, &srv->stats);
	stats_device(&l, srv);
	q->out->rep.stats = l.s;
	q->out->rep.n_stats = l.n;
}

void op_shm_attach(struct req *q)
{
	const struct config *cfg = q->srv->cfg;
	uint64_t id;
	int rc;

	if (no_payload(q))
		return;
	if (!shm_path(q->srv->shm)[0]) {
		fail(q, KVBP_BAD_ARGUMENT, "shared memory is only for clients on an ipc:// endpoint "
		     "of this daemon");
		return;
	}
	if (strncmp(q->principal, "ipc:", 4)) {
		fail(q, KVBP_BAD_ARGUMENT, "shared memory is only for clients on an ipc:// "
		     "endpoint; this one came over TCP");
		return;
	}
	rc = shm_create(q->srv->shm, q->h.shm_size, q->principal, &id);
	switch (rc) {
	case 0:
		break;
	case -E2BIG:
		fail(q, KVBP_BAD_ARGUMENT, "shared-memory size %" PRIu64 " out of range 1..%" PRIu64
		     " (shm_max)", q->h.shm_size, cfg->shm_max);
		return;
	case -ENOSPC:
		fail(q, KVBP_LIMIT, "shared memory exhausted: all segments together may hold %"
		     PRIu64 " bytes (shm_total)", cfg->shm_total);
		return;
	case -EMFILE:
		fail(q, KVBP_LIMIT, "all 256 shared-memory segments of the daemon are in use");
		return;
	case -EDQUOT:
		fail(q, KVBP_LIMIT, "this client holds %" PRIu64 " shared-memory segments already "
		     "(client_shm_segments); detach one first", cfg->client_shm_segments);
		return;
	default:
		fail(q, KVBP_INTERNAL, "cannot create shared memory: %s", strerror(-rc));
		return;
	}
	q->out->rep.shm_id = id;
	q->out->rep.shm_size = q->h.shm_size;
	snprintf(q->out->rep.shm_name, sizeof(q->out->rep.shm_name), "%s", shm_path(q->srv->shm));
}

void op_shm_detach(struct req *q)
{
	if (no_payload(q))
		return;
	if (!q->h.has_shm) {
		fail(q, KVBP_BAD_ARGUMENT, "shm_detach needs a shared-memory reference");
		return;
	}
	if (shm_detach(q->srv->shm, q->h.shm_id, q->principal))
		fail(q, KVBP_BAD_SHM, "shared-memory segment %" PRIu64 " unknown, expired or not "
		     "this client's", q->h.shm_id);
}
