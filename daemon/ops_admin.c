/* ops_admin — HELLO, models, STATS and shared-memory segments; see ops_impl.h. */
#include "ops_impl.h"

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

#include "clients.h"
#include "cluster.h"
#include "cuda/cuda.h"
#include "fdguard.h"
#include "log.h"
#include "metrics.h"
#include "pool.h"
#include "rope.h"

#ifndef KVBLEND_VERSION
#define KVBLEND_VERSION "0.0.0"
#endif

void op_hello(struct req *q)
{
	if (no_payload(q))
		return;
	snprintf(q->out->rep.server_version, sizeof(q->out->rep.server_version), "%s",
		 KVBLEND_VERSION);
	if (q->h.local_only) { /* another member's heartbeat: what this store holds */
		struct store_totals t;

		if (!store_totals(q->srv->store, &t)) {
			struct kvbp_stat *st = calloc(2, sizeof(*st));

			if (st) {
				snprintf(st[0].name, sizeof(st[0].name), "chunks");
				st[0].value = (double)t.chunks;
				snprintf(st[1].name, sizeof(st[1].name), "stored_bytes");
				st[1].value = (double)t.stored_bytes;
				q->out->rep.stats = st;
				q->out->rep.n_stats = 2;
			}
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
		fail(q, KVBP_MODEL_CONFLICT, "model '%s' exists with a different layout or RoPE "
		     "configuration", q->h.model.name);
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
			 sm.num_layers, sm.num_kv_heads, sm.head_dim, kvbp_dtype_name(sm.dtype));
}

void op_model_list(struct req *q)
{
	struct store_model *ms = NULL;
	size_t n = 0;
	int rc;

	if (no_payload(q))
		return;
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

struct member_stats {
	struct kvbp_stat *s;
	size_t *n, cap;
	struct kvbp_reply *rep; /* and each member in full (with its endpoint) */
	size_t cap_members;
};

static void member_stat(void *ctx, const struct cluster_member *mb)
{
	struct member_stats *m = ctx;
	struct timespec now;

	clock_gettime(CLOCK_REALTIME, &now);
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
		e->last_reply_age_ms = mb->last_reply_ms ? (double)now.tv_sec * 1e3 +
								   now.tv_nsec / 1e6 -
								   (double)mb->last_reply_ms
							 : -1;
		e->chunks = mb->held_chunks;
		e->stored_bytes = mb->held_bytes;
	}
	if (*m->n + 5 > m->cap)
		return;
	/* member:ID 1 alive, 0 suspect, -1 gone; the rest per member, names cut at 63 */
	snprintf(m->s[*m->n].name, sizeof(m->s[0].name), "member:%.56s", mb->id);
	m->s[(*m->n)++].value = mb->state;
	snprintf(m->s[*m->n].name, sizeof(m->s[0].name), "owed:%.58s", mb->id);
	m->s[(*m->n)++].value = (double)mb->owed;
	snprintf(m->s[*m->n].name, sizeof(m->s[0].name), "seen_ms:%.55s", mb->id);
	m->s[(*m->n)++].value =
		mb->last_reply_ms ? (double)now.tv_sec * 1e3 + now.tv_nsec / 1e6 -
					    (double)mb->last_reply_ms
				  : -1;
	snprintf(m->s[*m->n].name, sizeof(m->s[0].name), "chunks:%.56s", mb->id);
	m->s[(*m->n)++].value = (double)mb->held_chunks;
	snprintf(m->s[*m->n].name, sizeof(m->s[0].name), "bytes:%.57s", mb->id);
	m->s[(*m->n)++].value = (double)mb->held_bytes;
}

/* Per store codec: chunks, model-dtype bytes and stored bytes (stats). */
struct codec_use {
	const struct store_model *models;
	size_t n_models;
	uint64_t chunks[4], raw[4], stored[4];
};

static int codec_use_add(void *ctx, uint32_t model_id, const uint8_t *hash,
			 const struct store_chunk_info *info)
{
	struct codec_use *u = ctx;

	(void)hash;
	for (size_t i = 0; i < u->n_models; i++)
		if (u->models[i].id == model_id && u->models[i].store_codec < 4) {
			uint32_t c = u->models[i].store_codec;

			u->chunks[c]++;
			u->raw[c] += info->raw_bytes;
			u->stored[c] += info->stored_bytes;
			break;
		}
	return 0;
}

void op_stats(struct req *q)
{
	struct server *srv = q->srv;
	struct store_totals t;
	struct timespec now;
	uint64_t shm_n, shm_bytes;
	struct kvbp_stat *s;
	size_t n = 0, cap = 128 + 3 * KVBP_OP_COUNT + KVBP_CODE_COUNT + 5 * 1024;
	struct codec_use use = { 0 };
	struct store_model *models = NULL;
	int rc;

	if (no_payload(q))
		return;
	rc = store_totals(srv->store, &t);
	if (rc) {
		fail_store(q, rc, "stats");
		return;
	}
	s = calloc(cap, sizeof(*s));
	if (!s) {
		fail(q, KVBP_LIMIT, "out of memory");
		return;
	}
	shm_usage(srv->shm, &shm_n, &shm_bytes);
	clock_gettime(CLOCK_MONOTONIC, &now);
#define STAT(nm, v)                                                        \
	do {                                                               \
		snprintf(s[n].name, sizeof(s[n].name), "%s", nm);          \
		s[n++].value = (double)(v);                                \
	} while (0)
	STAT("uptime_seconds", (double)(now.tv_sec - srv->started.tv_sec) +
				       (now.tv_nsec - srv->started.tv_nsec) / 1e9);
	STAT("workers", srv->n_workers);
	STAT("models", t.models);
	STAT("chunks", t.chunks);
	STAT("raw_bytes", t.raw_bytes);
	STAT("stored_bytes", t.stored_bytes);
	STAT("compression_ratio", t.stored_bytes ? (double)t.raw_bytes / t.stored_bytes : 1.0);
	/* What each store codec holds: one scan of the chunk records (48 bytes each). */
	if (store_model_list(srv->store, &models, &use.n_models) == 0) {
		static const char *const names[] = { "dtype", "fp8", "int8", "int4" };

		use.models = models;
		store_chunk_scan(srv->store, codec_use_add, &use);
		for (int c = 0; c < 4; c++) {
			char nm[64];

			if (!use.chunks[c])
				continue;
			snprintf(nm, sizeof(nm), "store_%s_chunks", names[c]);
			STAT(nm, use.chunks[c]);
			snprintf(nm, sizeof(nm), "store_%s_raw_bytes", names[c]);
			STAT(nm, use.raw[c]);
			snprintf(nm, sizeof(nm), "store_%s_stored_bytes", names[c]);
			STAT(nm, use.stored[c]);
		}
		free(models);
	}
	STAT("map_size_bytes", t.map_size);
	STAT("map_used_bytes", t.map_used);
	if (srv->cluster) {
		struct cluster_stats cs;

		cluster_stats(srv->cluster, &cs);
		STAT("cluster_members", cs.members);
		STAT("cluster_suspect", cs.suspect);
		STAT("cluster_pushes_owed", cs.pushes_owed);
		STAT("cluster_pushes_done", cs.pushes_done);
		STAT("cluster_push_failures", cs.push_failures);
		STAT("cluster_remote_hits", cs.remote_hits);
		STAT("cluster_remote_misses", cs.remote_misses);
		STAT("cluster_fetch_failures", cs.fetch_failures);
		STAT("cluster_fetched_bytes", cs.fetched_bytes);
		STAT("cluster_fetch_ms", cs.fetch_ms);
		STAT("cluster_rebalance_pushes", cs.rebalance_pushes);
		STAT("cluster_rebalance_skipped", cs.rebalance_skipped);
		STAT("cluster_membership_changes", cs.membership_changes);
		STAT("cluster_peer_busy", cs.peer_busy);
		if (cs.etcd) {
			STAT("cluster_etcd_ok", cs.etcd_ok);
			STAT("cluster_etcd_errors", cs.etcd_errors);
			STAT("cluster_etcd_last_ok_ms", cs.etcd_last_ok_ms);
		}
		/* per member: member:ID, owed:ID, seen_ms:ID, chunks:ID, bytes:ID */
		{
			struct member_stats ms = { s, &n, cap, &q->out->rep, 0 };

			cluster_members(srv->cluster, member_stat, &ms);
		}
	}
	STAT("shm_segments", shm_n);
	STAT("shm_bytes", shm_bytes);
	STAT("bytes_in", atomic_load(&srv->stats.bytes_in));
	STAT("bytes_out", atomic_load(&srv->stats.bytes_out));
	STAT("lookup_hits", atomic_load(&srv->stats.lookup_hits));
	STAT("lookup_misses", atomic_load(&srv->stats.lookup_misses));
	STAT("corrupt_removed", atomic_load(&srv->stats.corrupt_removed));
	{
		uint64_t held, n_clients;

		clients_usage(srv->clients, &held, &n_clients);
		STAT("inflight_bytes", held);
		STAT("clients", n_clients);
		STAT("connections", atomic_load(&srv->connections));
		STAT("connections_refused", atomic_load(&srv->refused_clients));
		STAT("curve_keys_refused", atomic_load(&srv->refused_keys));
		STAT("connections_dropped_no_fd", fdguard_dropped());
		STAT("replies_from_pages", atomic_load(&srv->held.count));
		STAT("connections_cut_unread", atomic_load(&srv->held.cut));
		STAT("max_clients", srv->max_clients);
	}
	{
		struct evict_stats es;

		evictor_stats(srv->evict, &es);
		STAT("capacity_bytes", srv->cfg->capacity);
		STAT("evictions", es.evicted);
		STAT("evicted_bytes", es.evicted_bytes);
		STAT("pinned_chunks", es.pins);
	}
	{
		uint64_t fs, fb, fp;

		fuse_usage(srv->fuse, &fs, &fb, &fp);
		STAT("fuse_sessions", fs);
		STAT("fuse_ring_bytes", fb);
		STAT("fuse_pinned_chunks", fp);
	}
	for (uint32_t op = 1; op <= KVBP_OP_COUNT; op++) {
		char nm[64];

		snprintf(nm, sizeof(nm), "requests_%s",
			 op < KVBP_OP_COUNT ? kvbp_op_name(op) : "unknown");
		STAT(nm, atomic_load(&srv->stats.requests[op]));
	}
	for (uint32_t c = 1; c < KVBP_CODE_COUNT; c++) {
		char nm[64];

		snprintf(nm, sizeof(nm), "errors_%s", kvbp_code_name(c));
		STAT(nm, atomic_load(&srv->stats.errors[c]));
	}
	/* Latency by operation: mean, and the 99th percentile as its bucket's upper bound. */
	for (uint32_t op = 1; op < KVBP_OP_COUNT; op++) {
		uint64_t cnt = atomic_load(&srv->stats.lat_count[op]), cum = 0;
		char nm[64];
		unsigned b = 0;

		if (!cnt)
			continue;
		snprintf(nm, sizeof(nm), "latency_ms_mean_%s", kvbp_op_name(op));
		STAT(nm, atomic_load(&srv->stats.lat_sum_ns[op]) / 1e6 / cnt);
		for (; b < METRICS_BUCKETS; b++) {
			cum += atomic_load(&srv->stats.lat_bucket[op][b]);
			if (cum * 100 >= cnt * 99)
				break;
		}
		snprintf(nm, sizeof(nm), "latency_ms_p99_le_%s", kvbp_op_name(op));
		STAT(nm, b + 1 < METRICS_BUCKETS ? metrics_bucket_le[b] * 1e3 : -1);
	}
	{
		char nm[64];

		snprintf(nm, sizeof(nm), "backend_%s", srv->blend->name);
		STAT(nm, 1);
		if (srv->gpu) {
			size_t k = (size_t)snprintf(nm, sizeof(nm), "device_name_%s",
						    blend_cuda_name(srv->gpu));

			/* The name as a stat name: words joined by '_' ("NVIDIA_H200"). */
			for (k = k < sizeof(nm) ? k : sizeof(nm) - 1; k-- > 12;)
				if (nm[k] == ' ')
					nm[k] = '_';
			STAT(nm, 1);
			STAT("device_cuda_ordinal", blend_cuda_ordinal(srv->gpu));
		}
		if (srv->dev) {
			uint64_t held, total;

			snprintf(nm, sizeof(nm), "device_%s", srv->dev->name);
			STAT(nm, 1);
			srv->dev->memory(srv->dev, &held, &total);
			STAT("device_memory_bytes", held);
			STAT("device_memory_total_bytes", total);
		}
	}
#undef STAT
	q->out->rep.stats = s;
	q->out->rep.n_stats = n;
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
