/* server — the composition of kvblendd: sockets bound, services and backends started,
 * threads started, and the stop in reverse order; see server.h and server_impl.h. */
#include "daemon/server.h"

#include <arpa/inet.h>
#include <errno.h>
#include <inttypes.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <unistd.h>
#include <openssl/crypto.h>
#include <zmq.h>

#include "daemon/bulk.h"
#include "daemon/work.h"
#include "proto/bulk.h"
#include "daemon/clients.h"
#include "cluster/cluster.h"
#include "daemon/curve.h"
#include "daemon/fdguard.h"
#include "daemon/lane.h"
#include "daemon/log.h"
#include "daemon/metrics.h"
#include "daemon/notify.h"
#include "daemon/ops/ops.h"
#include "daemon/pool.h"
#include "daemon/server_impl.h"

/* Complete requests queued per client connection in the frontend socket. */
static const int rcvhwm = 16;

static int mkdir_parents(const char *path, mode_t mode)
{
	char buf[PATH_MAX];

	snprintf(buf, sizeof(buf), "%s", path);
	for (char *p = buf + 1; *p; p++) {
		if (*p != '/')
			continue;
		*p = 0;
		if (mkdir(buf, mode) && errno != EEXIST)
			return -errno;
		*p = '/';
	}
	return 0;
}

/* Is a process already accepting on this IPC path? Then we must not steal it. */
static bool ipc_in_use(const char *path)
{
	struct sockaddr_un a = { .sun_family = AF_UNIX };
	int fd, rc;

	if (strlen(path) >= sizeof(a.sun_path))
		return false;
	strcpy(a.sun_path, path);
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return false;
	rc = connect(fd, (struct sockaddr *)&a, sizeof(a));
	close(fd);
	return rc == 0;
}

static bool tcp_is_loopback(const char *ep)
{
	const char *host = ep + 6;

	return !strncmp(host, "127.", 4) || !strncmp(host, "localhost:", 10) ||
	       !strncmp(host, "[::1]:", 6);
}

static int bind_endpoint(struct server *srv, const char *ep)
{
	const struct config *cfg = srv->cfg;
	void *sock = srv->frontends[0];

	if (!strncmp(ep, "ipc://", 6)) {
		const char *path = ep + 6;
		int rc = mkdir_parents(path, 0755);

		if (rc) {
			log_err("cannot create the directory of %s: %s", path, strerror(-rc));
			return rc;
		}
		if (ipc_in_use(path)) {
			log_err("another process is serving %s; is kvblendd already running?", ep);
			return -EADDRINUSE;
		}
	} else if (srv->frontends[1]) {
		sock = srv->frontends[1];
	} else if (!tcp_is_loopback(ep) && !cfg->tcp_insecure) {
		log_err("%s leaves the machine unencrypted: set curve_secret_key_file (CURVE), or "
			"tcp_insecure = true to accept that", ep);
		return -EPERM;
	} else if (!tcp_is_loopback(ep)) {
		log_warn("%s is not a loopback address and traffic on it is not encrypted "
			 "(tcp_insecure)", ep);
	}
	if (zmq_bind(sock, ep)) {
		int e = errno;

		log_err("cannot bind %s: %s", ep, zmq_strerror(e));
		return -e;
	}
	if (!strncmp(ep, "ipc://", 6) && chmod(ep + 6, (mode_t)cfg->socket_mode)) {
		int e = errno;

		log_err("cannot set mode %04o on %s: %s", (unsigned)cfg->socket_mode, ep + 6,
			strerror(e));
		return -e;
	}
	log_info("listening on %s%s", ep, sock == srv->frontends[1] ? " (CURVE)" : "");
	return 0;
}

/*
 * Bulk connections (bulk.h) on the host of the first tcp:// endpoint: "tcp://HOST:PORT",
 * HOST a name, an address, [v6] or *. None without a TCP endpoint or with tcp_bulk off.
 */
static int start_bulk(struct server *srv)
{
	const struct config *cfg = srv->cfg;
	char host[CONFIG_ENDPOINT_MAX], sealed[96] = "";
	uint32_t best;
	unsigned i;
	char *colon;
	long cpus;
	int rc;

	for (i = 0; i < cfg->n_listen && strncmp(cfg->listen[i], "tcp://", 6); i++)
		;
	if (!cfg->tcp_bulk || i == cfg->n_listen)
		return 0;
	snprintf(host, sizeof(host), "%s", cfg->listen[i] + 6);
	colon = strrchr(host, ':');
	if (colon)
		*colon = 0;
	if (host[0] == '[' && host[strlen(host) - 1] == ']') {
		memmove(host, host + 1, strlen(host));
		host[strlen(host) - 1] = 0;
	}
	/* senders: one per two cores, 1..4 (a sender seals and writes at several GB/s) */
	cpus = sysconf(_SC_NPROCESSORS_ONLN);
	rc = bulk_start(&srv->bulk, host, (unsigned)cfg->tcp_bulk_port,
			(unsigned)cfg->reply_timeout_ms,
			cpus < 4 ? 1 : cpus > 8 ? 4 : (unsigned)(cpus / 2));
	if (rc) {
		log_err("tcp_bulk: no bulk connections on %s (tcp_bulk_port %" PRIu64 "; set "
			"tcp_bulk = false to go without)", host, cfg->tcp_bulk_port);
		return rc;
	}
	/* the best a CURVE client can get here: the CPU's fastest AEGIS, when allowed */
	best = cfg->tcp_bulk_aegis ? kvbb_aead_pick(kvbb_aeads()) : KVBP_AEAD_AES256GCM;
	if (srv->frontends[1])
		snprintf(sealed, sizeof(sealed), " (sealed for CURVE clients: %s%s)",
			 kvbb_cipher_name(best),
			 best ? " where the client runs it, else AES-256-GCM" : "");
	log_info("bulk connections on %s port %u%s", host, bulk_port(srv->bulk), sealed);
	return 0;
}

/*
 * Shared memory for local clients: segment descriptors are handed out on a Unix
 * socket beside the first IPC endpoint ("PATH.shm"). Without an IPC endpoint, or
 * with shm_total 0, there is none.
 */
static int start_shm_server(struct server *srv)
{
	const struct config *cfg = srv->cfg;
	char path[PATH_MAX];
	int rc;

	if (!cfg->shm_total)
		return 0;
	for (unsigned i = 0; i < cfg->n_listen; i++) {
		if (strncmp(cfg->listen[i], "ipc://", 6))
			continue;
		snprintf(path, sizeof(path), "%s.shm", cfg->listen[i] + 6);
		rc = shm_serve(srv->shm, path, (unsigned)cfg->socket_mode);
		if (rc == -ENAMETOOLONG) {
			log_warn("no shared memory: %s is too long for a socket path", path);
			return 0;
		}
		if (rc) {
			log_err("cannot serve shared memory on %s: %s", path, strerror(-rc));
			return rc;
		}
		log_info("shared memory descriptors on %s", path);
		return 0;
	}
	return 0;
}

/*
 * File descriptors: the soft limit is raised to the hard one, and max_clients is
 * kept below what that leaves after the daemon's own needs, so that accepting a
 * connection never meets EMFILE (libzmq aborts on EMFILE in its IPC listener).
 */
#define FD_RESERVE 512

static void budget_descriptors(struct server *srv)
{
	struct rlimit rl;
	uint64_t room;

	srv->max_clients = srv->cfg->max_clients;
	if (getrlimit(RLIMIT_NOFILE, &rl))
		return;
	if (rl.rlim_cur < rl.rlim_max) {
		rlim_t was = rl.rlim_cur;

		rl.rlim_cur = rl.rlim_max;
		if (setrlimit(RLIMIT_NOFILE, &rl) == 0)
			log_info("file descriptor limit raised from %llu to %llu",
				 (unsigned long long)was, (unsigned long long)rl.rlim_cur);
		else
			getrlimit(RLIMIT_NOFILE, &rl);
	}
	if (rl.rlim_cur == RLIM_INFINITY)
		return;
	room = rl.rlim_cur > 2 * FD_RESERVE ? rl.rlim_cur - FD_RESERVE : rl.rlim_cur / 2;
	if (srv->max_clients > room) {
		log_warn("max_clients %" PRIu64 " does not fit the file descriptor limit %llu; "
			 "serving %" PRIu64 " clients at most (raise LimitNOFILE)", srv->max_clients,
			 (unsigned long long)rl.rlim_cur, room);
		srv->max_clients = room;
	}
}

/*
 * Every handshake on a frontend goes to the ZAP handler (curve.c), which refuses
 * connections beyond max_clients; a socket monitor counts them as they come and go.
 * A client that connects and never completes its handshake is dropped after
 * HANDSHAKE_MS.
 */
#define HANDSHAKE_MS 10000

static int guard_frontend(struct server *srv, int f)
{
	char ep[64];
	int ivl = HANDSHAKE_MS;

	zmq_setsockopt(srv->frontends[f], ZMQ_ZAP_DOMAIN, "kvblend", 7);
	zmq_setsockopt(srv->frontends[f], ZMQ_HANDSHAKE_IVL, &ivl, sizeof(ivl));
	snprintf(ep, sizeof(ep), "inproc://kvblend-monitor-%d", f);
	if (zmq_socket_monitor(srv->frontends[f], ep, ZMQ_EVENT_ACCEPTED | ZMQ_EVENT_DISCONNECTED))
		return -errno;
	srv->monitors[f] = zmq_socket(srv->zctx, ZMQ_PAIR);
	if (!srv->monitors[f] || zmq_connect(srv->monitors[f], ep))
		return -errno;
	return 0;
}

/* The ZAP handler that every handshake passes (curve.c), before any endpoint binds. */
static int start_auth(struct server *srv)
{
	const struct config *cfg = srv->cfg;
	struct auth_limits lim = { &srv->connections, srv->max_clients, &srv->refused_clients,
				   &srv->refused_keys };
	char err[512];
	int rc;

	rc = curve_auth_start(srv->zctx, cfg->curve_secret_key_file[0] ? cfg->curve_authorized_keys
									: "",
			      &lim, &srv->zap, err, sizeof(err));
	if (rc)
		log_err("%s", err);
	return rc;
}

/* The CURVE frontend, when a server key is configured. */
static int start_curve(struct server *srv, int64_t maxmsg)
{
	const struct config *cfg = srv->cfg;
	char secret[41], public_key[41], err[512];
	int zero = 0, one = 1, rc;

	if (!cfg->curve_secret_key_file[0])
		return 0;
	if (!zmq_has("curve")) {
		log_err("curve_secret_key_file is set but this libzmq has no CURVE support");
		return -ENOTSUP;
	}
	rc = curve_load_secret(cfg->curve_secret_key_file, secret, public_key, err, sizeof(err));
	if (rc) {
		log_err("%s", err);
		return rc;
	}
	srv->frontends[1] = zmq_socket(srv->zctx, ZMQ_ROUTER);
	if (!srv->frontends[1])
		return -errno;
	zmq_setsockopt(srv->frontends[1], ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
	zmq_setsockopt(srv->frontends[1], ZMQ_LINGER, &zero, sizeof(zero));
	zmq_setsockopt(srv->frontends[1], ZMQ_RCVHWM, &rcvhwm, sizeof(rcvhwm));
	zmq_setsockopt(srv->frontends[1], ZMQ_CURVE_SERVER, &one, sizeof(one));
	zmq_setsockopt(srv->frontends[1], ZMQ_CURVE_SECRETKEY, secret, 41);
	memset(secret, 0, sizeof(secret));
	rc = guard_frontend(srv, 1);
	if (rc)
		return rc;
	log_info("CURVE public key %s", public_key);
	return 0;
}

/* The evictor's question, in a cluster: is this daemon one of the chunk's owners? */
static bool owns_chunk(void *ctx, const uint8_t *hash)
{
	return cluster_owns(ctx, hash);
}

/* And before a cache copy goes: do its owners hold it? */
static void owners_hold(void *ctx, uint32_t model_id, const uint8_t (*hashes)[STORE_HASH_LEN],
			size_t n, bool *held)
{
	struct cluster *c = ctx;
	struct store_model m;

	if (store_model_by_id(cluster_store(c), model_id, &m)) {
		memset(held, 0, n * sizeof(*held));
		return;
	}
	cluster_owners_hold(c, &m, hashes, n, held);
}

/*
 * Where the fuse computes, for the device setting. Sessions whose ring can live on
 * a device (all but landing sessions) run there: CUDA device N (cuda[:N], else a
 * refusal to start naming the cause), device 0 when there is a working one (auto),
 * or the emulated device. Work that starts and ends in host memory (landing
 * sessions, re-rotated GETs) stays on the CPU's SIMD kernels: moving it over PCIe
 * and back costs more than it saves. One log line says which and why.
 */
static int pick_backend(struct server *srv, int device)
{
	const char *fa = getenv("KVBLEND_EMULATED_FAIL_AFTER");
	const char *sticky = getenv("KVBLEND_EMULATED_STICKY");
	const char *as_auto = getenv("KVBLEND_EMULATED_AUTO");
	/* The emulated device's test hooks: the Nth device call fails, as a CUDA error
	 * would; with KVBLEND_EMULATED_STICKY=1 for good, as an illegal address does; with
	 * KVBLEND_EMULATED_AUTO=1 sessions are placed as device auto places them. */
	struct blend_emu_opts emu = { fa ? strtoull(fa, NULL, 10) : 0,
				      sticky && !strcmp(sticky, "1"),
				      as_auto && !strcmp(as_auto, "1") };
	struct blend_devices_info info;
	int which = device == CONFIG_DEVICE_AUTO	 ? BLEND_DEVICE_AUTO
		    : device == CONFIG_DEVICE_CPU	 ? BLEND_DEVICE_CPU
		    : device == CONFIG_DEVICE_EMULATED ? BLEND_DEVICE_EMULATED
						       : device;
	int rc;

	srv->blend = blend_cpu_backend();
	rc = blend_devices_open(which, srv->blend->name, &emu, &srv->devices, &info);
	if (rc == -ENOMEM)
		return rc;
	log_msg(info.level == 2 ? LOG_LVL_ERROR : info.level ? LOG_LVL_WARN : LOG_LVL_INFO, "%s",
		info.line);
	if (rc)
		return rc;
	if (info.line2[0])
		log_info("%s", info.line2);
	srv->dev = info.dev;
	srv->dev_host = info.dev_host;
	srv->dev_model = info.model;
	srv->dev_ordinal = info.ordinal;
	return 0;
}

/* The cluster's log lines, at the daemon's levels. */
static void cluster_log(int level, const char *msg)
{
	log_msg(level == CLUSTER_LOG_ERR ? LOG_LVL_ERROR :
		level == CLUSTER_LOG_WARN ? LOG_LVL_WARN : LOG_LVL_INFO, "%s", msg);
}

/* The cluster (cluster_new) as cfg's cluster settings describe it; *out NULL for none. */
static int cluster_start(const struct config *cfg, struct store *store, const char *secret,
			 const char *public_key, struct cluster **out, char *err, size_t errlen)
{
	struct cluster_opts o = {
		.node_id = cfg->node_id,
		.peers = cfg->cluster_peers,
		.etcd = cfg->cluster_etcd,
		.etcd_ca_file = cfg->cluster_etcd_ca_file,
		.etcd_cert_file = cfg->cluster_etcd_cert_file,
		.etcd_key_file = cfg->cluster_etcd_key_file,
		.etcd_user = cfg->cluster_etcd_user,
		.etcd_password_file = cfg->cluster_etcd_password_file,
		.name = cfg->cluster_name,
		.advertise = cfg->cluster_advertise,
		.replicas = (unsigned)cfg->cluster_replicas,
		.timeout_ms = (int)cfg->cluster_timeout_ms,
		.hedge_ms = (int)cfg->cluster_hedge_ms,
		.bulk = cfg->cluster_bulk,
		.max_message = cfg->max_message,
		.rebalance_rate = cfg->cluster_rebalance_rate,
		.repair_interval_s = cfg->cluster_repair_interval,
		.lease_ttl_s = (int)cfg->cluster_lease_ttl,
		.forget_after_s = cfg->cluster_forget_after,
		.grace_s = cfg->cluster_grace,
		.drain_timeout_s = cfg->cluster_drain_timeout,
		.capacity = cfg->capacity ? cfg->capacity : cfg->map_size,
		.curve_secret = secret,
		.curve_public = public_key,
		.store = store,
		.log = cluster_log,
		.describe = model_from_store,
	};

	for (unsigned i = 0; i < cfg->n_listen && !o.listen_tcp; i++)
		if (!strncmp(cfg->listen[i], "tcp://", 6))
			o.listen_tcp = cfg->listen[i];
	return cluster_new(&o, out, err, errlen);
}

int server_start(struct server *srv, const struct config *cfg, struct store *store)
{
	unsigned n_workers = (unsigned)cfg->workers;
	int zero = 0, rc;
	int64_t maxmsg;
	sigset_t all, old;

	memset(srv, 0, sizeof(*srv));
	srv->dev_model = "";
	srv->dev_ordinal = -1;
	held_init(&srv->held);
	srv->cfg = cfg;
	srv->store = store;
	clock_gettime(CLOCK_MONOTONIC, &srv->started);
	/* First: a refused device stops the start before any socket is bound. */
	rc = pick_backend(srv, cfg->device);
	if (rc)
		return rc;
	rc = clients_new(cfg->max_inflight_bytes, cfg->client_inflight_bytes, &srv->clients);
	if (rc)
		return rc;
	{
		char err[512];

		rc = tenants_load(cfg->tenants_file, &srv->tenants, err, sizeof(err));
		if (rc) {
			log_err("%s", err);
			return rc;
		}
		if (tenants_count(srv->tenants))
			log_info("%zu tenants from %s; other clients share the default namespace",
				 tenants_count(srv->tenants), cfg->tenants_file);
	}
	rc = shm_table_new(cfg->shm_max, cfg->shm_total, cfg->shm_idle,
			   (unsigned)cfg->client_shm_segments, &srv->shm);
	if (rc)
		return rc;
	srv->zctx = zmq_ctx_new();
	if (!srv->zctx)
		return -errno;
	srv->frontends[0] = zmq_socket(srv->zctx, ZMQ_ROUTER);
	srv->backend = zmq_socket(srv->zctx, ZMQ_DEALER);
	srv->lane_out = zmq_socket(srv->zctx, ZMQ_PULL);
	if (!srv->frontends[0] || !srv->backend || !srv->lane_out)
		return -errno;
	/* A hard cap per frame, above the soft max_message that gets a proper error reply,
	 * so that a peer cannot make us buffer unbounded memory. */
	maxmsg = cfg->max_message > INT64_MAX / 2 ? INT64_MAX : (int64_t)(cfg->max_message * 2);
	zmq_setsockopt(srv->frontends[0], ZMQ_MAXMSGSIZE, &maxmsg, sizeof(maxmsg));
	zmq_setsockopt(srv->frontends[0], ZMQ_LINGER, &zero, sizeof(zero));
	/* Few messages queued per connection before the socket pushes back on the client;
	 * what the main thread takes is bounded in bytes (clients.h). */
	zmq_setsockopt(srv->frontends[0], ZMQ_RCVHWM, &rcvhwm, sizeof(rcvhwm));
	zmq_setsockopt(srv->backend, ZMQ_LINGER, &zero, sizeof(zero));
	budget_descriptors(srv);
	rc = fdguard_init();
	if (!rc)
		rc = start_auth(srv);
	if (!rc)
		rc = guard_frontend(srv, 0);
	if (!rc)
		rc = start_curve(srv, maxmsg);
	if (rc)
		return rc;
	for (unsigned i = 0; i < cfg->n_listen; i++) {
		rc = bind_endpoint(srv, cfg->listen[i]);
		if (rc)
			return rc;
		srv->n_bound++;
	}
	if (zmq_bind(srv->backend, WORKER_ENDPOINT) || zmq_bind(srv->lane_out, LANE_ENDPOINT))
		return -errno;
	rc = start_bulk(srv);
	if (rc)
		return rc;
	rc = start_shm_server(srv);
	if (rc)
		return rc;
	/* [routing id] [delimiter] [header] and K and V of every layer */
	srv->in_cap = 2 * (size_t)cfg->max_layers + 3;
	srv->in_frames = calloc(srv->in_cap, sizeof(zmq_msg_t));
	if (!srv->in_frames)
		return -ENOMEM;
	{
		long c = sysconf(_SC_NPROCESSORS_ONLN);
		unsigned bulk = (unsigned)cfg->bulk_threads;

		if (!n_workers)
			n_workers = c < 2 ? 2 : (unsigned)c;
		if (!bulk)
			bulk = c < 1 ? 1 : (unsigned)c;
		rc = pool_new(bulk - 1, &srv->pool);
		if (rc)
			return rc;
	}
	{
		struct fuse_limits fl = { cfg->fuse_max_sessions, cfg->fuse_max_tokens,
					  cfg->fuse_max_bytes, cfg->fuse_ring, cfg->fuse_idle,
					  cfg->client_fuse_sessions, cfg->fuse_device_max_bytes,
					  srv->dev_host, cfg->fuse_device_reserve };

		rc = fuse_table_new(&fl, store, srv->pool, srv->blend, srv->dev, srv->shm,
				    &srv->fuse);
		if (rc)
			return rc;
		/* a chunk a session finds corrupt is removed as the scrub removes one */
		fuse_on_corrupt(srv->fuse, ops_chunk_corrupt, srv);
	}
	{
		/* Towards other members the daemon speaks with its own CURVE key, if it has one. */
		char secret[41] = "", public_key[41] = "", err[512];

		if (cfg->curve_secret_key_file[0] &&
		    curve_load_secret(cfg->curve_secret_key_file, secret, public_key, err,
				      sizeof(err))) {
			log_err("%s", err);
			return -EINVAL;
		}
		err[0] = 0;
		rc = cluster_start(cfg, store, secret, public_key, &srv->cluster, err, sizeof(err));
		memset(secret, 0, sizeof(secret));
		if (rc) {
			log_err("%s", err[0] ? err : strerror(-rc));
			return rc;
		}
	}
	srv->threads = calloc(n_workers, sizeof(*srv->threads));
	if (!srv->threads || work_new(WORK_QUEUE, &srv->work))
		return -ENOMEM;
	/* Threads start with signals blocked; only the main thread takes them. */
	sigfillset(&all);
	pthread_sigmask(SIG_BLOCK, &all, &old);
	rc = evictor_new(store, srv->fuse, srv->tenants, cfg->capacity, (unsigned)cfg->evict_high,
			 (unsigned)cfg->evict_low, &srv->evict);
	if (!rc && srv->cluster) {
		uint64_t room = cfg->capacity ? cfg->capacity : cfg->map_size;

		evictor_set_owner(srv->evict, owns_chunk, srv->cluster);
		evictor_set_cache(srv->evict, owners_hold,
				  room / 100 * cfg->cluster_cache_pct +
					  room % 100 * cfg->cluster_cache_pct / 100);
	}
	if (!rc && cfg->scrub_mb_per_s)
		rc = scrubber_new(store, cfg->scrub_mb_per_s * 1000000, ops_chunk_corrupt, srv,
				  &srv->scrub);
	for (unsigned i = 0; !rc && i < n_workers; i++) {
		atomic_fetch_add(&srv->running_workers, 1);
		rc = pthread_create(&srv->threads[i], NULL, server_worker_main, srv);
		if (rc) {
			atomic_fetch_sub(&srv->running_workers, 1);
			break;
		}
		srv->n_workers++;
	}
	if (!rc)
		rc = -fuse_loader_start(srv->fuse);
	if (!rc)
		rc = -lane_start(&srv->lane, srv->zctx, LANE_ENDPOINT, server_lane_run, srv, LANE_WAITING);
	pthread_sigmask(SIG_SETMASK, &old, NULL);
	if (rc) {
		log_err("cannot start worker threads: %s", strerror(rc));
		return -rc;
	}
	log_info("%u workers started", n_workers);
	if (cfg->metrics_port) {
		rc = metrics_start(srv, (uint16_t)cfg->metrics_port, &srv->metrics);
		if (rc)
			return rc;
	}
	return 0;
}

/* Let the replies still queued in a frontend leave before it closes. */
#define CLOSE_LINGER_MS 2000

void server_stop(struct server *srv)
{
	struct timespec start, now;

	if (srv->frontends[0] && srv->backend && srv->n_workers) {
		uint64_t limit_ms = srv->cfg->drain_timeout * 1000;
		zmq_pollitem_t items[4] = { { srv->backend, 0, ZMQ_POLLIN, 0 },
					    { srv->frontends[0], 0, ZMQ_POLLIN, 0 },
					    { srv->frontends[1], 0, ZMQ_POLLIN, 0 } };
		int n_items = srv->frontends[1] ? 3 : 2;
		int64_t waited_ms = 0;

		items[n_items] = (zmq_pollitem_t){ srv->lane_out, 0, ZMQ_POLLIN, 0 };

		/*
		 * Stop accepting: no new local client finds the socket files; requests that
		 * still arrive are answered `busy` at once. Connections stay open so that
		 * the replies of requests in progress reach their clients.
		 */
		atomic_store(&srv->stopping, true);
		/* a payload to a slow bulk reader must not hold the drain: cut them all */
		bulk_shutdown(srv->bulk);
		for (unsigned i = 0; i < srv->n_bound; i++)
			if (!strncmp(srv->cfg->listen[i], "ipc://", 6))
				unlink(srv->cfg->listen[i] + 6);
		clock_gettime(CLOCK_MONOTONIC, &start);
		while (srv->inflight && waited_ms < (int64_t)limit_ms) {
			int rc;

			server_gate_frontends(srv, items + 1, n_items - 1);
			rc = zmq_poll(items, n_items + 1, 50);

			if (rc > 0 && (items[0].revents & ZMQ_POLLIN))
				while (server_forward_out(srv) == 0)
					;
			if (rc > 0 && (items[n_items].revents & ZMQ_POLLIN))
				while (server_forward_reply(srv, srv->lane_out) == 0)
					;
			for (int i = 1; rc > 0 && i < n_items; i++)
				if (items[i].revents & ZMQ_POLLIN)
					server_forward_in(srv, (unsigned)i - 1);
			clock_gettime(CLOCK_MONOTONIC, &now);
			waited_ms = (now.tv_sec - start.tv_sec) * 1000 +
				    (now.tv_nsec - start.tv_nsec) / 1000000;
		}
		if (srv->inflight)
			log_warn("%" PRIu64 " requests still in progress after drain_timeout (%" PRIu64
				 " s); their clients get no reply", srv->inflight,
				 srv->cfg->drain_timeout);
		else
			log_info("every request in progress answered");
		/* a clean stop: what this member owns to its owners without it, then leave */
		if (srv->cluster) {
			notify_status("draining: the chunks this member owns to the others");
			cluster_drain(srv->cluster);
		}
	}
	bulk_shutdown(srv->bulk); /* (again: a stop without the drain) */
	atomic_store(&srv->stop_workers, true);
	for (unsigned i = 0; i < srv->n_workers; i++)
		pthread_join(srv->threads[i], NULL);
	fuse_loader_stop(srv->fuse);
	free(srv->threads);
	srv->threads = NULL;
	srv->n_workers = 0;
	lane_stop(&srv->lane);
	work_free(&srv->work); /* requests never started: their clients get no reply */
	bulk_stop(&srv->bulk); /* after the workers: none writes on a connection now */
	/* Replies produced in the last moments. */
	while (srv->backend && server_forward_out(srv) == 0)
		;
	while (srv->lane_out && server_forward_reply(srv, srv->lane_out) == 0)
		;
	for (int f = 0; f < 2; f++)
		if (srv->monitors[f]) {
			zmq_socket_monitor(srv->frontends[f], NULL, 0);
			zmq_close(srv->monitors[f]);
			srv->monitors[f] = NULL;
		}
	for (int f = 0; f < 2; f++)
		if (srv->frontends[f]) {
			int linger = CLOSE_LINGER_MS;

			zmq_setsockopt(srv->frontends[f], ZMQ_LINGER, &linger, sizeof(linger));
			zmq_close(srv->frontends[f]);
		}
	if (srv->backend)
		zmq_close(srv->backend);
	if (srv->lane_out)
		zmq_close(srv->lane_out);
	srv->frontends[0] = srv->frontends[1] = srv->backend = srv->lane_out = NULL;
	curve_auth_stop(&srv->zap);
	if (srv->zctx)
		zmq_ctx_term(srv->zctx);
	srv->zctx = NULL;
	/* (A drained stop unlinked them already; one started since may own the path now.) */
	for (unsigned i = 0; i < srv->n_bound && !atomic_load(&srv->stopping); i++)
		if (!strncmp(srv->cfg->listen[i], "ipc://", 6))
			unlink(srv->cfg->listen[i] + 6);
	free(srv->in_frames);
	srv->in_frames = NULL;
	/* the metrics thread and the evictor's (owns_chunk, owners_hold) call into the
	 * cluster: both stopped before it is freed (ASan caught the evictor's call ending on
	 * a freed member at a stop) */
	metrics_stop(&srv->metrics);
	scrubber_free(&srv->scrub); /* it removes chunks through the fuse table */
	evictor_free(&srv->evict);
	cluster_free(&srv->cluster);
	fuse_loader_stop(srv->fuse); /* (stopped already, unless the start failed) */
	fuse_table_free(&srv->fuse);
	blend_devices_close(&srv->devices); /* after the sessions that used it */
	shm_table_free(&srv->shm);
	pool_free(&srv->pool);
	clients_free(&srv->clients); /* after the context: ZeroMQ released every reply */
	tenants_free(&srv->tenants);
	held_destroy(&srv->held);
}
