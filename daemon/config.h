/*
 * config — kvblendd settings: one table of keys with types, defaults, ranges
 * and help, read from built-in defaults, then an INI file (--config), then
 * command-line flags (--KEY VALUE, dashes or underscores). Every key of the
 * file is also a flag. A bad value names the key and the allowed range.
 */
#ifndef KVBLEND_DAEMON_CONFIG_H
#define KVBLEND_DAEMON_CONFIG_H

#include <limits.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>

#define CONFIG_MAX_LISTEN 8
#define CONFIG_ENDPOINT_MAX 256

#define CONFIG_DEVICE_AUTO (-2)
#define CONFIG_DEVICE_CPU (-1)
#define CONFIG_DEVICE_EMULATED (-3) /* the device path on host memory (tests) */

struct config {
	char data_dir[PATH_MAX];
	char listen[CONFIG_MAX_LISTEN][CONFIG_ENDPOINT_MAX];
	unsigned n_listen;
	int listen_layer; /* which source set listen: later sources replace, not append */
	uint64_t workers;
	uint64_t bulk_threads;
	uint64_t map_size;
	uint64_t max_message;
	uint64_t max_tokens;
	uint64_t max_layers;
	uint64_t max_kv_heads;
	uint64_t max_head_dim;
	uint64_t compress_min_saving; /* percent */
	uint64_t socket_mode;	      /* octal */
	bool no_sync;
	int verify;		 /* enum store_verify: 0 once, 1 always, 2 scrub-only */
	uint64_t verify_ttl;	 /* seconds */
	uint64_t scrub_mb_per_s; /* 0: no scrub */
	uint64_t shm_max;
	uint64_t shm_total;
	uint64_t shm_idle;
	uint64_t max_readers;
	uint64_t fuse_max_sessions;
	uint64_t fuse_max_tokens;
	uint64_t fuse_max_bytes;
	uint64_t fuse_device_max_bytes;
	uint64_t fuse_device_reserve;
	uint64_t fuse_ring;
	uint64_t fuse_idle;
	uint64_t capacity;
	uint64_t evict_high;
	uint64_t evict_low;
	uint64_t metrics_port;
	char curve_secret_key_file[PATH_MAX];
	char curve_authorized_keys[PATH_MAX];
	bool tcp_insecure;
	bool tcp_bulk;		/* bulk connections for TCP clients' GET payloads */
	bool tcp_bulk_aegis;	/* sealed with AEGIS where the client can */
	uint64_t tcp_bulk_port; /* their port; 0 = a free one */
	char tenants_file[PATH_MAX];
	uint64_t drain_timeout;
	uint64_t max_clients;
	uint64_t max_inflight_bytes;
	uint64_t client_inflight_bytes;
	uint64_t reply_timeout_ms;
	uint64_t client_shm_segments;
	uint64_t client_fuse_sessions;
	char node_id[PATH_MAX];
	char cluster_peers[PATH_MAX];
	char cluster_etcd[PATH_MAX];
	char cluster_etcd_ca_file[PATH_MAX];
	char cluster_etcd_cert_file[PATH_MAX];
	char cluster_etcd_key_file[PATH_MAX];
	char cluster_etcd_user[PATH_MAX];
	char cluster_etcd_password_file[PATH_MAX];
	char cluster_name[PATH_MAX];
	uint64_t cluster_lease_ttl;
	uint64_t cluster_forget_after;
	char cluster_advertise[PATH_MAX];
	uint64_t cluster_rebalance_rate;
	uint64_t cluster_repair_interval;
	uint64_t cluster_replicas;
	uint64_t cluster_timeout_ms;
	uint64_t cluster_hedge_ms;
	bool cluster_bulk;
	uint64_t cluster_grace;
	uint64_t cluster_cache_pct;
	uint64_t cluster_drain_timeout;
	int log_level;
	int device; /* CONFIG_DEVICE_AUTO, _CPU, _EMULATED, or a CUDA ordinal */
};

enum config_source { CONFIG_DEFAULT = 0, CONFIG_FILE = 1, CONFIG_FLAG = 2 };

/* Fill *c with the built-in defaults (data dir and socket depend on uid and
 * the systemd STATE_DIRECTORY / RUNTIME_DIRECTORY variables). */
void config_defaults(struct config *c);

/*
 * Set key (dashes or underscores) to value. Returns 0, -ENOENT for an unknown
 * key, -EINVAL or -ERANGE with a message in err naming the key and range.
 */
int config_set(struct config *c, const char *key, const char *value, enum config_source src,
	       char *err, size_t errlen);

/* Is key a boolean (a flag that may stand without a value)? */
bool config_key_is_bool(const char *key);

/* Read an INI file (keys at top level or in [kvblendd]). Returns 0 or -errno / -EINVAL. */
int config_load_file(struct config *c, const char *path, char *err, size_t errlen);

/* Print the key table (flags, defaults, ranges, help) and the current values. */
void config_print_help(FILE *f);
void config_print(FILE *f, const struct config *c);
/* An example config file: every key commented out at its default, with its help and range. */
void config_print_example(FILE *f);

/* Parse "64M", "1G", "4096" (suffixes K M G T, powers of 1024). Returns 0 or -EINVAL/-ERANGE. */
int config_parse_size(const char *s, uint64_t *out);

#endif
