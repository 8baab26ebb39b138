/*
 * state — the daemon's shared state: the store, the tables and counters, the sockets
 * and threads that server.c starts and runs. Request handlers (ops*.c), the fuse
 * engine's callers and the metrics endpoint read it; only server.c (which drives
 * them) creates and changes its structure. A header of data alone, so that the
 * modules that read it and the server that drives them do not import each other.
 */
#ifndef KVBLEND_DAEMON_STATE_H
#define KVBLEND_DAEMON_STATE_H

#include <pthread.h>
#include <stdatomic.h>
#include <stdint.h>
#include <time.h>
#include <zmq.h>

#include "daemon/held.h"
#include "daemon/clients.h"
#include "daemon/config.h"
#include "daemon/tenants.h"
#include "daemon/evict.h"
#include "daemon/scrub.h"
#include "daemon/fuse/fuse.h"
#include "daemon/shm.h"
#include "proto/wire.h"
#include "store/store.h"

struct metrics; /* metrics.h: the Prometheus endpoint */

/* Upper bounds of the latency buckets, in seconds (the last bucket is +Inf); defined in
 * metrics.c, which exports the histogram. */
#define METRICS_BUCKETS 14
extern const double metrics_bucket_le[METRICS_BUCKETS];

struct server_stats {
	atomic_uint_fast64_t requests[KVBP_OP_COUNT + 1]; /* last: unknown ops */
	atomic_uint_fast64_t errors[KVBP_CODE_COUNT];
	atomic_uint_fast64_t bytes_in;
	atomic_uint_fast64_t bytes_out;
	atomic_uint_fast64_t lookup_hits;
	atomic_uint_fast64_t lookup_misses;
	atomic_uint_fast64_t corrupt_removed;
	/* request latency by operation (last: unknown), histogram + sum + count */
	atomic_uint_fast64_t lat_bucket[KVBP_OP_COUNT + 1][METRICS_BUCKETS];
	atomic_uint_fast64_t lat_sum_ns[KVBP_OP_COUNT + 1];
	atomic_uint_fast64_t lat_count[KVBP_OP_COUNT + 1];
};

struct server {
	const struct config *cfg;
	struct store *store;
	struct shm_table *shm;
	struct clients *clients; /* bytes held per client */
	struct tenants *tenants; /* namespaces of client identities */
	struct pool *pool; /* helpers that split one request's bulk work */
	struct fuse_table *fuse;
	struct evictor *evict;
	struct scrubber *scrub;	 /* NULL: scrub_mb_per_s 0 */
	struct cluster *cluster; /* NULL: no cluster */
	struct metrics *metrics;
	const struct blend_backend *blend; /* fuse compute backend */
	struct blend_devices *devices; /* the device opened for it (blend/device.h) */
	const struct blend_device *dev; /* where fuse sessions keep their rings (NULL: host) */
	const char *dev_model; /* the CUDA device's name, "" when none */
	int dev_ordinal;       /* its CUDA ordinal, -1 when none */
	/* Sessions whose node takes its layers in host memory run on dev too (device cuda,
	 * emulated); false under device auto, where they run on the CPU (no PCIe round trip). */
	bool dev_host;
	void *zctx;
	/* ROUTERs bound to cfg->listen: [0] plain (IPC, and TCP without CURVE), [1] CURVE
	 * (TCP when a server key is configured). A message carries the index of its frontend
	 * as the first frame through the workers, so that the reply goes back the same way. */
	void *frontends[2];
	struct curve_auth *zap;
	struct bulk *bulk; /* bulk connections for TCP clients (NULL: none) */
	void *monitors[2]; /* connection events of frontends[i] (PAIR) */
	atomic_uint_fast64_t connections; /* live, counted from the monitors */
	atomic_uint_fast64_t refused_clients; /* handshakes refused beyond max_clients */
	atomic_uint_fast64_t refused_keys;    /* CURVE handshakes with an unlisted key */
	uint64_t max_clients; /* cfg->max_clients, or less to fit the descriptor limit */
	void *backend;	/* DEALER, inproc, workers connect: their replies */
	struct work *work; /* requests to the workers, taken by the idle ones (work.h) */
	void *lane_out;	/* PULL, inproc: the lane's replies (lane.h) */
	struct lane *lane;	/* costly requests, off the workers */
	pthread_t *threads;
	unsigned n_workers;
	unsigned n_bound; /* endpoints of cfg->listen bound so far */
	atomic_uint running_workers;
	atomic_bool stop_workers;
	/* main thread only: frames of one incoming request, requests with the workers */
	zmq_msg_t *in_frames;
	size_t in_cap;
	uint64_t inflight;
	/* draining: requests not yet started are answered `busy` (set by the main thread,
	 * read by workers too) */
	atomic_bool stopping;
	struct server_stats stats;
	struct held_replies held; /* replies sent from the store's pages (held.h) */
	struct timespec started;
};

#endif
