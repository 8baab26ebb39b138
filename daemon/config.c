/* config — table-driven settings for kvblendd; see config.h. */
#include "daemon/config.h"

#include <errno.h>
#include <ini.h>
#include <inttypes.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/ckd.h"
#include "daemon/log.h"

enum key_type { T_PATH, T_LISTEN, T_UINT, T_SIZE, T_OCTAL, T_BOOL, T_LEVEL, T_DEVICE, T_VERIFY };

struct key {
	const char *name;
	const char *meta; /* the value's metavariable in --help; NULL: a flag without one */
	enum key_type type;
	size_t offset;
	uint64_t min, max;
	const char *def; /* shown in --help; NULL: computed at start */
	const char *help;
};

#define OFF(f) offsetof(struct config, f)
#define KiB (1ull << 10)
#define MiB (1ull << 20)
#define GiB (1ull << 30)
#define TiB (1ull << 40)

static const struct key keys[] = {
	{ "data_dir", "DIR", T_PATH, OFF(data_dir), 0, 0, NULL,
	  "LMDB environment directory (default: $STATE_DIRECTORY, /var/lib/kvblend as root, "
	  "else $XDG_STATE_HOME/kvblend or ~/.local/state/kvblend)" },
	{ "listen", "ENDPOINT[,ENDPOINT...]", T_LISTEN, OFF(listen), 1, CONFIG_MAX_LISTEN, NULL,
	  "endpoint to bind, repeatable or comma-separated: ipc://PATH or tcp://HOST:PORT "
	  "(default: ipc://$RUNTIME_DIRECTORY/kvblend.sock, ipc:///run/kvblend/kvblend.sock as "
	  "root, else ipc://$XDG_RUNTIME_DIR/kvblend.sock)" },
	{ "workers", "N", T_UINT, OFF(workers), 0, 256, "0",
	  "request worker threads; 0 = number of CPUs (at least 2)" },
	{ "bulk_threads", "N", T_UINT, OFF(bulk_threads), 0, 256, "0",
	  "threads that share one large request's decoding and merging, its worker included; "
	  "0 = number of CPUs, 1 = never split" },
	{ "map_size", "SIZE", T_SIZE, OFF(map_size), 16 * MiB, 64 * TiB, "256G",
	  "LMDB map size: the most the store can hold (sparse, costs no disk up front)" },
	{ "max_message", "SIZE", T_SIZE, OFF(max_message), 1 * MiB, 64 * GiB, "1G",
	  "largest request or reply payload; larger requests get a too_large error" },
	{ "max_tokens", "N", T_UINT, OFF(max_tokens), 1, 1u << 24, "262144",
	  "most tokens in one chunk" },
	{ "max_layers", "N", T_UINT, OFF(max_layers), 1, 4096, "1024", "most layers in a model" },
	{ "max_kv_heads", "N", T_UINT, OFF(max_kv_heads), 1, 4096, "1024",
	  "most KV heads in a model" },
	{ "max_head_dim", "N", T_UINT, OFF(max_head_dim), 2, 65536, "1024",
	  "largest head dimension in a model" },
	{ "compress_min_saving", "PERCENT", T_UINT, OFF(compress_min_saving), 0, 100, "10",
	  "percent a tensor must shrink by to be stored compressed; 100 = never compress" },
	{ "socket_mode", "MODE", T_OCTAL, OFF(socket_mode), 0, 0777, "0660",
	  "permissions of IPC socket files (the endpoint and its .shm descriptor socket)" },
	{ "no_sync", NULL, T_BOOL, OFF(no_sync), 0, 1, "false",
	  "skip fsync at each commit: faster PUTs; a power failure loses recent chunks "
	  "(a process crash loses nothing)" },
	{ "verify", "WHEN", T_VERIFY, OFF(verify), 0, 2, "once",
	  "when reads check stored tensors' checksums: once (the first read since the chunk's "
	  "pages came from disk, again after verify_ttl or when any page left the page "
	  "cache), always (every read), or scrub-only (never on reads; the scrub alone)" },
	{ "verify_ttl", "SECONDS", T_UINT, OFF(verify_ttl), 1, 86400, "300",
	  "verify=once: seconds a chunk layer, once verified, is served without its checksum" },
	{ "scrub_mb_per_s", "MB", T_UINT, OFF(scrub_mb_per_s), 0, 100000, "16",
	  "background scrub: megabytes of stored chunks re-verified per second, in a loop over "
	  "the store; a corrupt chunk is removed and counted as reads do; 0 = no scrub" },
	{ "shm_max", "SIZE", T_SIZE, OFF(shm_max), 1 * MiB, 64 * GiB, "1G",
	  "largest shared-memory segment one local client may attach" },
	{ "shm_total", "SIZE", T_SIZE, OFF(shm_total), 0, 1024 * GiB, "8G",
	  "all shared-memory segments together; 0 disables shared memory" },
	{ "shm_idle", "SECONDS", T_UINT, OFF(shm_idle), 1, 7 * 86400, "600",
	  "seconds an unused shared-memory segment lives before it is released" },
	{ "max_readers", "N", T_UINT, OFF(max_readers), 8, 65536, "512",
	  "LMDB reader slots (concurrent read transactions)" },
	{ "fuse_max_sessions", "N", T_UINT, OFF(fuse_max_sessions), 1, 65536, "64",
	  "fuse sessions open at once" },
	{ "fuse_max_tokens", "N", T_UINT, OFF(fuse_max_tokens), 1, 1u << 24, "131072",
	  "most tokens in one fuse session" },
	{ "fuse_max_bytes", "SIZE", T_SIZE, OFF(fuse_max_bytes), 1 * MiB, 1024 * GiB, "4G",
	  "memory all fuse sessions may hold for layers loaded ahead" },
	{ "fuse_device_max_bytes", "SIZE", T_SIZE, OFF(fuse_device_max_bytes), 0, 1024 * GiB,
	  "0",
	  "device memory all fuse sessions may hold on the device (their device blocks, and "
	  "blocks kept for the next session); 0: nine tenths of the device's memory. A session "
	  "that does not fit, or meets the device out of memory, runs on the host path" },
	{ "fuse_device_reserve", "SIZE", T_SIZE, OFF(fuse_device_reserve), 0, 1024 * GiB, "0",
	  "device memory, and as much pinned host memory, allocated at start for fuse sessions' "
	  "blocks on the device, so that no session's open allocates (or close frees) device or "
	  "pinned memory; 0: none, blocks are allocated as sessions need them and pooled" },
	{ "fuse_ring", "LAYERS", T_UINT, OFF(fuse_ring), 1, 64, "3",
	  "layers of a fuse session loaded (read, decoded, re-rotated) ahead of the node" },
	{ "fuse_idle", "SECONDS", T_UINT, OFF(fuse_idle), 1, 86400, "60",
	  "seconds an idle fuse session lives before it is closed and its memory freed" },
	{ "capacity", "SIZE", T_SIZE, OFF(capacity), 0, 64 * TiB, "0",
	  "bytes of stored chunks to keep; above evict_high percent of it the least recently "
	  "used chunks are evicted down to evict_low percent; 0 = no limit but the map size" },
	{ "evict_high", "PERCENT", T_UINT, OFF(evict_high), 1, 100, "90",
	  "percent of capacity at which eviction starts" },
	{ "evict_low", "PERCENT", T_UINT, OFF(evict_low), 0, 99, "80",
	  "percent of capacity eviction brings the store down to; below evict_high" },
	{ "metrics_port", "PORT", T_UINT, OFF(metrics_port), 0, 65535, "0",
	  "serve Prometheus metrics at http://127.0.0.1:PORT/metrics; 0 = off" },
	{ "curve_secret_key_file", "FILE", T_PATH, OFF(curve_secret_key_file), 0, 0, NULL,
	  "file with the server's CURVE secret key (Z85, from `kvblend keygen`): TCP endpoints "
	  "then encrypt and authenticate; unset = no CURVE" },
	{ "curve_authorized_keys", "FILE", T_PATH, OFF(curve_authorized_keys), 0, 0, NULL,
	  "file of client CURVE public keys allowed on TCP, one a line; unset = any client "
	  "that knows the server's public key" },
	{ "tenants_file", "FILE", T_PATH, OFF(tenants_file), 0, 0, NULL,
	  "file binding tenants to client identities, one a line: NAME uid=N|gid=N|key=Z85... "
	  "[capacity=SIZE]; each tenant's models and chunks are its own, and no other "
	  "namespace evicts them while within its capacity; unset = one namespace for all" },
	{ "tcp_insecure", NULL, T_BOOL, OFF(tcp_insecure), 0, 1, "false",
	  "allow a TCP endpoint off loopback without CURVE (unencrypted)" },
	{ "tcp_bulk", NULL, T_BOOL, OFF(tcp_bulk), 0, 1, "true",
	  "offer TCP clients a bulk connection for GET payloads (plain TCP beside the first "
	  "tcp:// endpoint, sealed for CURVE clients): GETs at the socket's speed; "
	  "false = payloads in ZeroMQ frames (encrypted by CURVE)" },
	{ "tcp_bulk_aegis", NULL, T_BOOL, OFF(tcp_bulk_aegis), 0, 1, "true",
	  "seal CURVE clients' bulk records with AEGIS-128X2 or AEGIS-128L when both ends have "
	  "the AES instructions for it (3-10x AES-GCM's speed); false = AES-256-GCM always "
	  "(where only NIST-approved ciphers may be used)" },
	{ "tcp_bulk_port", "PORT", T_UINT, OFF(tcp_bulk_port), 0, 65535, "0",
	  "port of bulk connections, on the host of the first tcp:// endpoint; 0 = a free port, "
	  "told to clients in the HELLO reply" },
	{ "drain_timeout", "SECONDS", T_UINT, OFF(drain_timeout), 0, 3600, "10",
	  "seconds a stop (SIGTERM) waits for requests in progress to be answered" },
	{ "max_clients", "N", T_UINT, OFF(max_clients), 1, 1u << 20, "1024",
	  "client connections at once, all endpoints together; more are refused (the file "
	  "descriptor limit is raised to fit at start)" },
	{ "max_inflight_bytes", "SIZE", T_SIZE, OFF(max_inflight_bytes), 1 * MiB, 1024 * GiB, "4G",
	  "request and unread reply bytes the daemon holds for all clients together; beyond it "
	  "requests get `limit`" },
	{ "client_inflight_bytes", "SIZE", T_SIZE, OFF(client_inflight_bytes), 1 * MiB, 1024 * GiB,
	  "1G",
	  "request and unread reply bytes held for one client (a process on IPC, a key or "
	  "address on TCP); one request and its reply are always admitted when the client "
	  "holds nothing else" },
	{ "reply_timeout_ms", "MS", T_UINT, OFF(reply_timeout_ms), 0, 3600000, "5000",
	  "a client that leaves a reply served from the store's pages (a GET of a raw chunk of "
	  "256 KiB or more) unsent this long is disconnected: such a reply holds a snapshot "
	  "of the store that keeps freed pages from reuse; a GET's payload on a bulk "
	  "connection must be read within it too (and its socket must take a byte every "
	  "2 s, whatever this is); 0 = never" },
	{ "client_shm_segments", "N", T_UINT, OFF(client_shm_segments), 1, 256, "16",
	  "shared-memory segments one client may hold (of 256 for all)" },
	{ "client_fuse_sessions", "N", T_UINT, OFF(client_fuse_sessions), 1, 65536, "16",
	  "fuse sessions one client may hold open (of fuse_max_sessions)" },
	{ "node_id", "NAME", T_PATH, OFF(node_id), 0, 0, NULL,
	  "this daemon's name in a cluster: letters, digits, ._- (default: the host name)" },
	{ "cluster_peers", "ID=ENDPOINT[=KEY],...", T_PATH, OFF(cluster_peers), 0, 0, NULL,
	  "the members of a static cluster, comma-separated, each ID=tcp://HOST:PORT[=KEY] "
	  "(KEY: the member's CURVE server key, Z85; this daemon may be listed too); chunks are "
	  "then placed on cluster_replicas members, pushed there after a PUT and fetched from "
	  "them on a miss (docs/cluster.md); not with cluster_etcd (the daemon refuses to start "
	  "with both); unset = no cluster" },
	{ "cluster_etcd", "URL[,URL...]", T_PATH, OFF(cluster_etcd), 0, 0, NULL,
	  "etcd endpoints, comma-separated, each http://HOST:PORT or https://HOST:PORT: this "
	  "daemon registers itself under cluster_name with a lease it keeps alive and learns the "
	  "other members from etcd (docs/cluster.md); not with cluster_peers (the daemon refuses "
	  "to start with both); unset = no etcd" },
	{ "cluster_etcd_ca_file", "FILE", T_PATH, OFF(cluster_etcd_ca_file), 0, 0, NULL,
	  "PEM file of the CA(s) etcd's server certificate must chain to (https:// endpoints; "
	  "the certificate must also name the endpoint's host); unset = the system's CAs" },
	{ "cluster_etcd_cert_file", "FILE", T_PATH, OFF(cluster_etcd_cert_file), 0, 0, NULL,
	  "PEM client certificate this daemon shows etcd (etcd's --client-cert-auth), with "
	  "cluster_etcd_key_file; etcd's JSON gateway refuses one with a Common Name: issue it "
	  "without (docs/cluster.md); unset = none" },
	{ "cluster_etcd_key_file", "FILE", T_PATH, OFF(cluster_etcd_key_file), 0, 0, NULL,
	  "PEM private key of cluster_etcd_cert_file" },
	{ "cluster_etcd_user", "NAME", T_PATH, OFF(cluster_etcd_user), 0, 0, NULL,
	  "etcd user this daemon authenticates as (etcd with authentication enabled; the user's "
	  "role needs read and write on /kvblend/NAME/); with cluster_etcd_password_file; "
	  "unset = no authentication" },
	{ "cluster_etcd_password_file", "FILE", T_PATH, OFF(cluster_etcd_password_file), 0, 0,
	  NULL,
	  "file whose first line is cluster_etcd_user's password (never given on the command "
	  "line: keep the file readable by the daemon only)" },
	{ "cluster_name", "NAME", T_PATH, OFF(cluster_name), 0, 0, "kvblend",
	  "the cluster's name in etcd (its members' keys are /kvblend/NAME/members/NODE_ID): "
	  "letters, digits, ._-" },
	{ "cluster_lease_ttl", "SECONDS", T_UINT, OFF(cluster_lease_ttl), 2, 3600, "10",
	  "seconds: a member that stops renewing its etcd lease leaves placement after this" },
	{ "cluster_forget_after", "SECONDS", T_UINT, OFF(cluster_forget_after), 1, 604800, "600",
	  "seconds: a member gone from etcd this long, with no pushes owed to it, is forgotten "
	  "(no longer in cluster status, stats or metrics)" },
	{ "cluster_grace", "SECONDS", T_UINT, OFF(cluster_grace), 0, 86400, "30",
	  "seconds a member gone from etcd (stopped, crashed or paused past its lease) keeps "
	  "its place before the others copy its chunks elsewhere: one back within it costs no "
	  "copies; 0 = copy at once" },
	{ "cluster_drain_timeout", "SECONDS", T_UINT, OFF(cluster_drain_timeout), 0, 3600, "30",
	  "on SIGTERM, how long a member spends pushing the chunks it owns to the members that "
	  "own them without it (and the pushes it still owes) before it leaves; 0 = no drain" },
	{ "cluster_cache_pct", "PERCENT", T_UINT, OFF(cluster_cache_pct), 0, 100, "10",
	  "percent of capacity (map_size without one) that cache copies may take: chunks held "
	  "here that this member does not own (a PUT's copy, read-through copies, a former "
	  "owner's); beyond it the least recently used go once their owners hold them" },
	{ "cluster_advertise", "ENDPOINT", T_PATH, OFF(cluster_advertise), 0, 0, NULL,
	  "the TCP endpoint other members reach this daemon at, tcp://HOST:PORT (default: the "
	  "first tcp:// of listen, a wildcard host replaced by the host name)" },
	{ "cluster_rebalance_rate", "SIZE", T_SIZE, OFF(cluster_rebalance_rate), 1 * MiB, 1 * TiB,
	  "256M",
	  "bytes per second at most of the chunks pushed to members that join or return" },
	{ "cluster_repair_interval", "SECONDS", T_UINT, OFF(cluster_repair_interval), 0, 604800, "600",
	  "seconds between repair passes: every chunk held here is offered to those of its "
	  "owners that lack it (one LOOKUP per 1024 chunks, pushes rate limited); 0 = never" },
	{ "cluster_replicas", "N", T_UINT, OFF(cluster_replicas), 1, 16, "2",
	  "members that own each chunk" },
	{ "cluster_timeout_ms", "MS", T_UINT, OFF(cluster_timeout_ms), 10, 600000, "1000",
	  "deadline of a call to another member; one that misses it is skipped for 2 s" },
	{ "cluster_hedge_ms", "MS", T_UINT, OFF(cluster_hedge_ms), 0, 600000, "100",
	  "a fetch from a member that has not answered this long also asks the next member "
	  "(the first answer wins), so a dead owner costs this, not cluster_timeout_ms; "
	  "0 = wait for each member's deadline" },
	{ "cluster_bulk", NULL, T_BOOL, OFF(cluster_bulk), 0, 1, "true",
	  "fetch chunks from members and push chunks to them over tcp:// on bulk connections "
	  "where they offer one (their tcp_bulk; sealed under CURVE): at the socket's speed; "
	  "false = in ZeroMQ frames (encrypted by CURVE)" },
	{ "log_level", "LEVEL", T_LEVEL, OFF(log_level), 0, 3, "info", "error, warn, info or debug" },
	{ "device", "DEVICE", T_DEVICE, OFF(device), 0, 1023, "auto",
	  "where fuse sessions compute: cpu, cuda[:N] (their rings on CUDA device N, 0 by "
	  "default; the daemon refuses to start without it), auto (CUDA device 0 when there "
	  "is a working one, for sessions whose node maps the device ring, the others on the "
	  "CPU; else the CPU; the log says which), or emulated (the device path with host "
	  "memory standing in for a GPU's: for tests)" },
};

#define N_KEYS (sizeof(keys) / sizeof(keys[0]))

static const struct key *find_key(const char *name)
{
	char norm[64];
	size_t i;

	for (i = 0; i < sizeof(norm) - 1 && name[i]; i++)
		norm[i] = name[i] == '-' ? '_' : name[i];
	norm[i] = 0;
	for (i = 0; i < N_KEYS; i++)
		if (!strcmp(keys[i].name, norm))
			return &keys[i];
	return NULL;
}

bool config_key_is_bool(const char *key)
{
	const struct key *k = find_key(key);

	return k && k->type == T_BOOL;
}

int config_parse_size(const char *s, uint64_t *out)
{
	char *end;
	uint64_t v, mul = 1;

	if (!*s || *s == '-')
		return -EINVAL;
	errno = 0;
	v = strtoull(s, &end, 10);
	if (errno || end == s)
		return -EINVAL;
	switch (*end) {
	case 'k': case 'K': mul = KiB; end++; break;
	case 'm': case 'M': mul = MiB; end++; break;
	case 'g': case 'G': mul = GiB; end++; break;
	case 't': case 'T': mul = TiB; end++; break;
	default: break;
	}
	if (*end == 'i' || *end == 'B')
		end += *end == 'i' ? 1 : 0;
	if (*end == 'B')
		end++;
	if (*end)
		return -EINVAL;
	if (ckd_mul(out, v, mul))
		return -ERANGE;
	return 0;
}

static int range_err(const struct key *k, const char *value, char *err, size_t errlen, int rc)
{
	if (k->type == T_SIZE)
		snprintf(err, errlen, "%s: invalid value '%s'; expected a size from %" PRIu64
			 " to %" PRIu64 " bytes (suffixes K, M, G, T)", k->name, value, k->min,
			 k->max);
	else if (k->type == T_OCTAL)
		snprintf(err, errlen, "%s: invalid value '%s'; expected octal permissions 0000..0777",
			 k->name, value);
	else
		snprintf(err, errlen, "%s: invalid value '%s'; expected an integer from %" PRIu64
			 " to %" PRIu64, k->name, value, k->min, k->max);
	return rc;
}

static int add_listen(struct config *c, const struct key *k, const char *value,
		      enum config_source src, char *err, size_t errlen)
{
	char buf[CONFIG_MAX_LISTEN * CONFIG_ENDPOINT_MAX];
	char *save = NULL, *tok;

	if ((int)src > c->listen_layer) {
		c->n_listen = 0;
		c->listen_layer = (int)src;
	}
	snprintf(buf, sizeof(buf), "%s", value);
	for (tok = strtok_r(buf, ", \t", &save); tok; tok = strtok_r(NULL, ", \t", &save)) {
		if (strncmp(tok, "ipc://", 6) && strncmp(tok, "tcp://", 6)) {
			snprintf(err, errlen, "%s: invalid endpoint '%s'; expected ipc://PATH or "
				 "tcp://HOST:PORT", k->name, tok);
			return -EINVAL;
		}
		if (strlen(tok) >= CONFIG_ENDPOINT_MAX || strlen(tok) <= 6) {
			snprintf(err, errlen, "%s: endpoint '%s' is empty or longer than %d bytes",
				 k->name, tok, CONFIG_ENDPOINT_MAX - 1);
			return -EINVAL;
		}
		if (c->n_listen == CONFIG_MAX_LISTEN) {
			snprintf(err, errlen, "%s: more than %d endpoints", k->name,
				 CONFIG_MAX_LISTEN);
			return -ERANGE;
		}
		snprintf(c->listen[c->n_listen++], CONFIG_ENDPOINT_MAX, "%s", tok);
	}
	if (!c->n_listen) {
		snprintf(err, errlen, "%s: no endpoint given", k->name);
		return -EINVAL;
	}
	return 0;
}

int config_set(struct config *c, const char *key, const char *value, enum config_source src,
	       char *err, size_t errlen)
{
	const struct key *k = find_key(key);
	void *field;
	uint64_t v = 0;
	char *end;
	int rc;

	if (!k) {
		snprintf(err, errlen, "unknown setting '%s' (see kvblendd --help)", key);
		return -ENOENT;
	}
	field = (char *)c + k->offset;
	switch (k->type) {
	case T_PATH:
		if (!*value || strlen(value) >= PATH_MAX) {
			snprintf(err, errlen, "%s: path is empty or too long", k->name);
			return -EINVAL;
		}
		snprintf(field, PATH_MAX, "%s", value);
		return 0;
	case T_LISTEN:
		return add_listen(c, k, value, src, err, errlen);
	case T_BOOL:
		if (!strcmp(value, "true") || !strcmp(value, "yes") || !strcmp(value, "1"))
			*(bool *)field = true;
		else if (!strcmp(value, "false") || !strcmp(value, "no") || !strcmp(value, "0"))
			*(bool *)field = false;
		else {
			snprintf(err, errlen, "%s: invalid value '%s'; expected true or false",
				 k->name, value);
			return -EINVAL;
		}
		return 0;
	case T_LEVEL:
		rc = log_level_parse(value);
		if (rc < 0) {
			snprintf(err, errlen, "%s: invalid value '%s'; expected error, warn, info "
				 "or debug", k->name, value);
			return -EINVAL;
		}
		*(int *)field = rc;
		return 0;
	case T_VERIFY:
		if (!strcmp(value, "once") || !strcmp(value, "always") ||
		    !strcmp(value, "scrub-only")) {
			*(int *)field = !strcmp(value, "once") ? 0 : !strcmp(value, "always") ? 1 : 2;
			return 0;
		}
		snprintf(err, errlen, "%s: invalid value '%s'; expected once, always or scrub-only",
			 k->name, value);
		return -EINVAL;
	case T_DEVICE:
		if (!strcmp(value, "auto") || !strcmp(value, "cpu") || !strcmp(value, "cuda") ||
		    !strcmp(value, "emulated")) {
			if (!strcmp(value, "auto"))
				*(int *)field = CONFIG_DEVICE_AUTO;
			else if (!strcmp(value, "emulated"))
				*(int *)field = CONFIG_DEVICE_EMULATED;
			else if (!strcmp(value, "cpu"))
				*(int *)field = CONFIG_DEVICE_CPU;
			else
				*(int *)field = 0;
			return 0;
		}
		if (strncmp(value, "cuda:", 5) || !value[5] || value[5] == '-' ||
		    value[5] == '+') {
			snprintf(err, errlen, "%s: invalid value '%s'; expected auto, cpu, cuda, "
				 "cuda:N or emulated", k->name, value);
			return -EINVAL;
		}
		errno = 0;
		v = strtoull(value + 5, &end, 10);
		if (errno || *end || v > k->max) {
			snprintf(err, errlen, "%s: invalid device '%s'; expected cuda:N with N in "
				 "0..%" PRIu64, k->name, value, k->max);
			return -EINVAL;
		}
		*(int *)field = (int)v;
		return 0;
	case T_SIZE:
		rc = config_parse_size(value, &v);
		if (rc)
			return range_err(k, value, err, errlen, rc);
		break;
	case T_OCTAL:
	case T_UINT:
		if (!*value || *value == '-')
			return range_err(k, value, err, errlen, -EINVAL);
		errno = 0;
		v = strtoull(value, &end, k->type == T_OCTAL ? 8 : 10);
		if (errno || *end)
			return range_err(k, value, err, errlen, -EINVAL);
		break;
	}
	if (v < k->min || v > k->max)
		return range_err(k, value, err, errlen, -ERANGE);
	*(uint64_t *)field = v;
	return 0;
}

void config_defaults(struct config *c)
{
	const char *state = getenv("STATE_DIRECTORY"), *run = getenv("RUNTIME_DIRECTORY");
	const char *home = getenv("HOME"), *xdg_state = getenv("XDG_STATE_HOME");
	const char *xdg_run = getenv("XDG_RUNTIME_DIR");
	char err[256];
	bool root = geteuid() == 0;

	memset(c, 0, sizeof(*c));
	for (size_t i = 0; i < N_KEYS; i++)
		if (keys[i].def)
			config_set(c, keys[i].name, keys[i].def, CONFIG_DEFAULT, err, sizeof(err));
	/* systemd may pass several directories separated by ':'; use the first. */
	if (state && *state)
		snprintf(c->data_dir, sizeof(c->data_dir), "%.*s", (int)strcspn(state, ":"), state);
	else if (root)
		snprintf(c->data_dir, sizeof(c->data_dir), "/var/lib/kvblend");
	else if (xdg_state && *xdg_state)
		snprintf(c->data_dir, sizeof(c->data_dir), "%s/kvblend", xdg_state);
	else
		snprintf(c->data_dir, sizeof(c->data_dir), "%s/.local/state/kvblend",
			 home ? home : "/tmp");
	if (run && *run)
		snprintf(c->listen[0], CONFIG_ENDPOINT_MAX, "ipc://%.*s/kvblend.sock",
			 (int)strcspn(run, ":"), run);
	else if (root || !xdg_run || !*xdg_run)
		snprintf(c->listen[0], CONFIG_ENDPOINT_MAX, "ipc:///run/kvblend/kvblend.sock");
	else
		snprintf(c->listen[0], CONFIG_ENDPOINT_MAX, "ipc://%s/kvblend.sock", xdg_run);
	c->n_listen = 1;
	c->listen_layer = CONFIG_DEFAULT;
}

struct ini_ctx {
	struct config *c;
	char *err;
	size_t errlen;
	int rc;
};

static int on_ini_line(void *user, const char *section, const char *name, const char *value)
{
	struct ini_ctx *x = user;

	if (*section && strcmp(section, "kvblendd")) {
		snprintf(x->err, x->errlen, "unknown section [%s]; settings go at the top or in "
			 "[kvblendd]", section);
		x->rc = -EINVAL;
		return 0;
	}
	x->rc = config_set(x->c, name, value, CONFIG_FILE, x->err, x->errlen);
	return x->rc == 0;
}

int config_load_file(struct config *c, const char *path, char *err, size_t errlen)
{
	struct ini_ctx x = { c, err, errlen, 0 };
	char inner[256] = "";
	FILE *f = fopen(path, "r");
	int line;

	if (!f) {
		int e = errno;

		snprintf(err, errlen, "cannot read config file %s: %s", path, strerror(e));
		return -e;
	}
	x.err = inner;
	x.errlen = sizeof(inner);
	line = ini_parse_file(f, on_ini_line, &x);
	fclose(f);
	if (line) {
		snprintf(err, errlen, "%s:%d: %s", path, line,
			 *inner ? inner : "syntax error (expected KEY = VALUE)");
		return x.rc ? x.rc : -EINVAL;
	}
	return 0;
}

/* A size as the table would write it: the largest binary suffix that divides it ("16M"). */
static void size_text(uint64_t v, char *buf, size_t len)
{
	static const char suffix[] = "KMGT";
	int i = -1;

	while (v && i < 3 && v % 1024 == 0) {
		v /= 1024;
		i++;
	}
	if (i < 0)
		snprintf(buf, len, "%" PRIu64, v);
	else
		snprintf(buf, len, "%" PRIu64 "%c", v, suffix[i]);
}

#define RANGE_TEXT_MAX 64

/* A key's range, "16M..64T" for sizes, "1..4096" for integers; "" for other types. */
static void range_text(const struct key *k, char buf[RANGE_TEXT_MAX])
{
	char lo[24], hi[24]; /* 20 digits, a suffix, the NUL */

	*buf = 0;
	if (k->type == T_SIZE) {
		size_text(k->min, lo, sizeof(lo));
		size_text(k->max, hi, sizeof(hi));
		snprintf(buf, RANGE_TEXT_MAX, "%s..%s", lo, hi);
	} else if (k->type == T_UINT) {
		snprintf(buf, RANGE_TEXT_MAX, "%" PRIu64 "..%" PRIu64, k->min, k->max);
	}
}

/* Print text wrapped at HELP_WIDTH columns, each line after the first indented by indent. */
#define HELP_WIDTH 100
static void print_wrapped(FILE *f, const char *text, int col, int indent)
{
	while (*text) {
		int room = HELP_WIDTH - col, n = (int)strlen(text);

		if (n > room) {
			n = room;
			while (n > 0 && text[n] != ' ')
				n--;
			if (!n) /* a word longer than the line: let it overflow */
				n = (int)strcspn(text, " ");
		}
		fprintf(f, "%.*s", n, text);
		text += n;
		while (*text == ' ')
			text++;
		if (*text) {
			fprintf(f, "\n%*s", indent, "");
			col = indent;
		}
	}
	fputc('\n', f);
}

void config_print_help(FILE *f)
{
	enum { FLAG_COL = 34 }; /* where the help text starts: 2 + 31 + 1 */

	for (size_t i = 0; i < N_KEYS; i++) {
		const struct key *k = &keys[i];
		char flag[96], text[1024], range[RANGE_TEXT_MAX];
		int n = snprintf(flag, sizeof(flag), "--%s", k->name);
		size_t t;

		for (char *p = flag + 2; *p; p++)
			if (*p == '_')
				*p = '-';
		if (k->meta)
			snprintf(flag + n, sizeof(flag) - (size_t)n, " %s", k->meta);
		t = (size_t)snprintf(text, sizeof(text), "%s", k->help);
		if (k->def && t < sizeof(text))
			t += (size_t)snprintf(text + t, sizeof(text) - t, " [default %s]", k->def);
		range_text(k, range);
		if (*range && t < sizeof(text))
			snprintf(text + t, sizeof(text) - t, " (range %s)", range);
		/* A flag wider than its column gets its help on the next line. */
		if (2 + (int)strlen(flag) + 1 > FLAG_COL)
			fprintf(f, "  %s\n%*s", flag, FLAG_COL, "");
		else
			fprintf(f, "  %-*s", FLAG_COL - 2, flag);
		print_wrapped(f, text, FLAG_COL, FLAG_COL);
	}
}

void config_print(FILE *f, const struct config *c)
{
	for (size_t i = 0; i < N_KEYS; i++) {
		const struct key *k = &keys[i];
		const void *field = (const char *)c + k->offset;

		switch (k->type) {
		case T_PATH:
			fprintf(f, "%s = %s\n", k->name, (const char *)field);
			break;
		case T_LISTEN:
			for (unsigned j = 0; j < c->n_listen; j++)
				fprintf(f, "%s = %s\n", k->name, c->listen[j]);
			break;
		case T_BOOL:
			fprintf(f, "%s = %s\n", k->name, *(const bool *)field ? "true" : "false");
			break;
		case T_LEVEL:
			fprintf(f, "%s = %s\n", k->name, log_level_name(*(const int *)field));
			break;
		case T_VERIFY: {
			static const char *const names[] = { "once", "always", "scrub-only" };

			fprintf(f, "%s = %s\n", k->name, names[*(const int *)field]);
			break;
		}
		case T_DEVICE: {
			int d = *(const int *)field;

			if (d < 0)
				fprintf(f, "%s = %s\n", k->name, d == CONFIG_DEVICE_CPU ? "cpu" :
					d == CONFIG_DEVICE_EMULATED ? "emulated" : "auto");
			else
				fprintf(f, "%s = cuda:%d\n", k->name, d);
			break;
		}
		case T_OCTAL:
			fprintf(f, "%s = %04" PRIo64 "\n", k->name, *(const uint64_t *)field);
			break;
		default:
			fprintf(f, "%s = %" PRIu64 "\n", k->name, *(const uint64_t *)field);
			break;
		}
	}
}

void config_print_example(FILE *f)
{
	fprintf(f, "# kvblendd configuration (INI). Every key is also a command-line flag\n"
		   "# (--data-dir for data_dir); flags override this file. The values shown,\n"
		   "# commented out, are the built-in defaults. See kvblendd(8).\n\n[kvblendd]\n");
	for (size_t i = 0; i < N_KEYS; i++) {
		const struct key *k = &keys[i];
		char range[RANGE_TEXT_MAX];

		/* Wrapped: inih reads lines of at most 200 bytes. */
		{
			const char *h = k->help;

			while (*h) {
				int n = (int)strlen(h);

				if (n > 74) {
					n = 74;
					while (n > 0 && h[n] != ' ')
						n--;
					if (!n)
						n = 74;
				}
				fprintf(f, "\n# %.*s", n, h);
				h += n;
				while (*h == ' ')
					h++;
			}
		}
		range_text(k, range);
		if (*range)
			fprintf(f, "\n# range %s%s", range,
				k->type == T_SIZE ? " bytes (suffixes K, M, G, T: powers of 1024)" : "");
		fprintf(f, "\n#%s = %s\n", k->name,
			k->def			     ? k->def
			: k->type == T_LISTEN	     ? "ipc:///run/kvblend/kvblend.sock"
			: !strcmp(k->name, "data_dir") ? "/var/lib/kvblend"
						     : "");
	}
}
