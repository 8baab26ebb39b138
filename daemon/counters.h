/*
 * counters — every single-valued figure kvblendd reports, in one table that both STATS
 * (ops/admin.c, `kvblend stats`) and the Prometheus endpoint (metrics.c) print from,
 * so that a figure added to one is in the other: its STATS name, its metric name and
 * help, its kind, and where its value comes from. Families of figures (per operation,
 * per error code, per member, per codec, latency histograms) stay with their printers.
 *
 * counters_snap() gathers, once, what every value reads (the store's totals, the
 * evictor's and the fuse engine's counts, the cluster's, the device's); a value is then
 * a function of the snapshot.
 */
#ifndef KVBLEND_DAEMON_COUNTERS_H
#define KVBLEND_DAEMON_COUNTERS_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "cluster/cluster.h"
#include "daemon/bulk.h"
#include "daemon/evict.h"
#include "daemon/fuse/fuse.h"
#include "daemon/state.h"

struct counter_snap {
	struct server *srv;
	struct store_totals t; /* zeroed when the store could not say */
	bool have_totals;
	uint64_t chunk_walks;
	struct store_verify_counts vc;
	struct evict_stats es;
	uint64_t fuse_sessions, fuse_bytes, fuse_pins;
	uint64_t shm_n, shm_bytes, held, n_clients;
	double uptime_s;
	uint64_t wall_ms;
	struct cluster_stats cs;	  /* with srv->cluster */
	struct cluster_check ck;	  /* with srv->cluster: the last check */
	struct bulk_stats bulk; /* with srv->bulk */
	unsigned lane_waiting;			     /* with srv->lane */
	unsigned long lane_done;
	uint64_t dev_held, dev_total; /* with srv->dev */
	bool dev_broken;
	uint64_t dev_fallbacks;
	struct fuse_device_counts dc;
};

/* What a figure needs to exist: a part the daemon may run without. */
enum counter_need {
	NEED_NONE = 0,
	NEED_CLUSTER,
	NEED_ETCD, /* a cluster whose members come from etcd */
	NEED_BULK,
	NEED_LANE,
	NEED_DEVICE,
};

struct counter {
	const char *stat; /* STATS name; NULL: /metrics only */
	const char *prom; /* metric name; NULL: STATS only */
	const char *help; /* the metric's help (with prom) */
	bool monotonic;	  /* a Prometheus counter, else a gauge */
	enum counter_need need;
	double (*value)(const struct counter_snap *s);
};

/* The table, in the order STATS prints it. */
extern const struct counter counters[];
extern const size_t n_counters;

/* Gather the snapshot of srv (no lock held across calls; each part is consistent). */
void counters_snap(struct server *srv, struct counter_snap *s);

/* Whether counter c exists for snapshot s (its part runs). */
bool counter_present(const struct counter *c, const struct counter_snap *s);

#endif
