/*
 * bench_cluster — chunks moving between two kvblendd over TCP on loopback, against a
 * plain TCP socket copy of the same bytes in the same run, with and without CURVE.
 *
 * Two daemons, a and b, are members of a static cluster (R = 1); the chunks are put
 * on a, which owns them (a third, c, knows a only: the frames fetch). Measured, per
 * chunk size:
 *   plain       one TCP stream between two threads of this process: send() of the
 *               chunk's bytes, recv() into a buffer (the peer of the others);
 *   GET tcp     a client GETs the chunk from a over tcp:// into its buffer, as libkvblend
 *               does by default: the payload on the bulk connection (sealed under CURVE:
 *               AEGIS-128L where both ends have AES instructions), received straight
 *               into the buffer;
 *   GCM         under CURVE, the same GET by a client that asks for AES-256-GCM
 *               (KVBLEND_BULK_CIPHER=aes-256-gcm): the seal the daemon falls back to;
 *   frames      the same GET by a client with the bulk connection off (KVBLEND_NO_BULK=1):
 *               the payload in ZeroMQ frames (encrypted by CURVE), copied into the buffer;
 *   frames kept the same GET with kvb_get_layers(): the layers left in the frames;
 *   PUT tcp     a client PUTs the same chunk to a over tcp:// from its buffer, as
 *               libkvblend does by default: the payload on the bulk connection (sealed
 *               under CURVE), read by the daemon into a buffer of its own; the chunk is
 *               stored already, so what is timed is the transfer, not the disk (the
 *               daemon reads the whole payload before it looks the chunk up);
 *   PUT frames  the same PUT with the bulk connection off: ZeroMQ frames (CURVE);
 *   fetch       a client GETs, through b's IPC socket, a chunk only a holds: b fetches
 *               it (FETCH over TCP), verifies and stores it, then serves it; the
 *               figure is b's own fetch time (stats cluster_fetch_ms), the client's
 *               wall time beside it; b moves it on its bulk connection to a
 *               (cluster_bulk), sealed under CURVE;
 *   wire        of that fetch, the time until the bytes were on b (stats
 *               cluster_fetch_wire_ms: the request, a's export, the transfer; not the
 *               checks and the store), as a ratio to the plain copy; beside it the same
 *               for a third daemon c that fetches from a in ZeroMQ frames
 *               (cluster_bulk false; CURVE-encrypted), in the same rounds;
 *   PUT         a local PUT on b of the same bytes (IPC): the least that storing a
 *               fetched copy costs, the disk's share of the fetch;
 *   fuse open   a fuse session opened on b over 8 chunks held only on a (they are
 *               fetched in parallel before the open answers), against the same open
 *               once they are local.
 * GB/s are of the chunk's bytes (KV in f16); medians over --repeats. The plain copy and
 * the three GETs over TCP are timed in rounds (one of each per round, after WARMUP
 * rounds), and their ratios are the medians of each round's ratio: on a machine whose
 * load moves, a ratio compares figures taken moments apart.
 *
 * The benchmark's process runs with glibc's malloc defaults, as a user's does;
 * --malloc-tune calls kvb_malloc_tune() first (what the frames paths needed to be fast).
 *
 * usage: bench_cluster [--daemon PATH] [--sizes 8,32] [--repeats N] [--no-curve]
 *                      [--curve-only] [--malloc-tune] [--get-only]
 *
 * --get-only: the plain copy and the three GETs over TCP only (one PUT per size, no
 * fetch, local PUT or fuse columns: they print 0), for repeated runs on a busy machine.
 */
#include <arpa/inet.h>
#include <errno.h>
#include <math.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <pthread.h>
#include <signal.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include "bench/bench_common.h"
#include "client/include/kvblend.h"
#include "cluster/place.h"

#define MAX_REPEATS 64
/* Untimed rounds first, on the same connection: TCP's window and the allocators' pools
 * grow over the first transfers, and a serving node's connection is long-lived. */
#define WARMUP 20

/* Mistral-7B-shaped KV: 32 layers, 8 KV heads, head_dim 128, f16: 128 KiB a token. */
static const struct kvb_model model = { .name = "bench-mistral", .num_layers = 32,
					.num_kv_heads = 8, .head_dim = 128, .dtype = KVB_F16,
					.rope_theta = 1e6 };

/* ---- the plain socket copy ---- */

/* One loopback TCP stream between two threads, kept for every round: the sender sends
 * the bytes each time the receiver asks (one byte), the receiver recv()s them into dst. */
struct plain {
	int listen_fd, fd;
	const uint8_t *src;
	size_t bytes;
	pthread_t t;
};

static void *plain_sender(void *arg)
{
	struct plain *p = arg;
	int fd = accept(p->listen_fd, NULL, NULL);
	char go;

	while (fd >= 0 && recv(fd, &go, 1, MSG_WAITALL) == 1) {
		size_t off = 0;

		while (off < p->bytes) {
			ssize_t n = send(fd, p->src + off, p->bytes - off, 0);

			if (n <= 0)
				break;
			off += (size_t)n;
		}
	}
	if (fd >= 0)
		close(fd);
	return NULL;
}

static void plain_open(struct plain *p, const uint8_t *src, size_t bytes)
{
	struct sockaddr_in a = { .sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK) };
	socklen_t len = sizeof(a);

	p->listen_fd = socket(AF_INET, SOCK_STREAM, 0);
	p->src = src;
	p->bytes = bytes;
	bind(p->listen_fd, (struct sockaddr *)&a, sizeof(a));
	getsockname(p->listen_fd, (struct sockaddr *)&a, &len);
	listen(p->listen_fd, 1);
	pthread_create(&p->t, NULL, plain_sender, p);
	p->fd = socket(AF_INET, SOCK_STREAM, 0);
	if (connect(p->fd, (struct sockaddr *)&a, sizeof(a))) {
		perror("plain connect");
		exit(1);
	}
}

/* GB/s of one copy of the bytes over the stream into dst. */
static double plain_round(struct plain *p, uint8_t *dst)
{
	double t0 = now_s();
	size_t off = 0;

	if (send(p->fd, "g", 1, 0) != 1) {
		perror("plain send");
		exit(1);
	}
	while (off < p->bytes) {
		ssize_t n = recv(p->fd, dst + off, p->bytes - off, 0);

		if (n <= 0) {
			perror("plain recv");
			exit(1);
		}
		off += (size_t)n;
	}
	return p->bytes / (now_s() - t0) / 1e9;
}

static void plain_close(struct plain *p)
{
	close(p->fd);
	pthread_join(p->t, NULL);
	close(p->listen_fd);
}

/* ---- the daemons ---- */

struct node {
	struct daemon d; /* its IPC endpoint: d.endpoint */
	char tcp[64], key_file[300];
	int port;
};

static char pub_a[41], sec_a[41], pub_b[41], sec_b[41], pub_c[41], sec_c[41];

static void start_node(const char *daemon, struct node *n, const char *id, const char *peers,
		       bool curve, const char *secret, bool frames)
{
	char auth[300];
	/* no drain on the way out: the benchmark keeps nothing */
	const char *extra[20] = { "--listen", n->tcp, "--node-id", id, "--cluster-peers", peers,
				  "--cluster-replicas", "1", "--cluster-timeout-ms", "30000",
				  "--cluster-drain-timeout", "0" };
	int k = 12;

	if (frames) { /* fetches in ZeroMQ frames, as before bulk connections between members */
		extra[k++] = "--cluster-bulk";
		extra[k++] = "false";
	}

	/* the daemon as every benchmark starts one (bench_common.h), on IPC and TCP */
	snprintf(auth, sizeof(auth), "%s/authorized", n->d.dir);
	if (curve) {
		FILE *f;

		snprintf(n->key_file, sizeof(n->key_file), "%s/key", n->d.dir);
		f = fopen(n->key_file, "w");
		fprintf(f, "%s\n", secret);
		fclose(f);
		f = fopen(auth, "w");
		fprintf(f, "%s a\n%s b\n%s client\n", pub_a, pub_b, pub_c);
		fclose(f);
		extra[k++] = "--curve-secret-key-file";
		extra[k++] = n->key_file;
		extra[k++] = "--curve-authorized-keys";
		extra[k++] = auth;
	}
	bench_spawn_daemon(&n->d, daemon, false, extra);
}

static kvb_client *connect_to(const char *ep, const char *server_key, const char *client_sec)
{
	struct kvb_connect_opts o = { .timeout_ms = 60000, .server_key = server_key,
				      .client_secret_key = client_sec };
	char err[256];
	kvb_client *c;

	if (kvb_connect(ep, &o, &c, err, sizeof(err))) {
		fprintf(stderr, "bench_cluster: connect %s: %s\n", ep, err);
		exit(1);
	}
	return c;
}

static double stat_of(kvb_client *c, const char *name)
{
	struct kvb_stat *s;
	size_t n;
	double v = 0;

	if (kvb_stats(c, &s, &n))
		return 0;
	for (size_t i = 0; i < n; i++)
		if (!strcmp(s[i].name, name))
			v = s[i].value;
	free(s);
	return v;
}

static uint64_t rng_state = 88172645463325252ull;

static uint64_t rnd(void)
{
	rng_state ^= rng_state << 13;
	rng_state ^= rng_state >> 7;
	rng_state ^= rng_state << 17;
	return rng_state;
}

/* A chunk hash that member a (want 0) or b (want 1) owns among {a, b}. */
static void hash_owned_by(uint8_t h[KVB_HASH_LEN], size_t want)
{
	struct place_member m[2] = { { place_seed("a"), 1.0 }, { place_seed("b"), 1.0 } };

	for (;;) {
		size_t own;

		for (int i = 0; i < KVB_HASH_LEN; i += 8) {
			uint64_t x = rnd();

			memcpy(h + i, &x, 8);
		}
		place_owners(m, 2, h, 1, &own);
		if (own == want)
			return;
	}
}

/* Roughly Gaussian f16 values (their bits do not compress: as real KV). */
/*
 * f16 of magnitude 2^-2..2^1 with random mantissas and signs: like real KV, it does not
 * compress by the 10% that compress_min_saving asks, so it is stored raw, as real KV is
 * (SmolLM2's KV: 1.004x). (Until 2026-11-30 this was uniform on (-2, 2), which
 * bitshuffle+LZ4 shrinks 1.14x: stored compressed, every GET decompressed it.)
 */
static void fill(uint16_t *p, size_t n)
{
	for (size_t i = 0; i < n; i++) {
		uint64_t x = rnd();

		p[i] = (uint16_t)((x >> 63) << 15 | (13 + (x >> 20 & 3)) << 10 | (x & 0x3ff));
	}
}

/* GB/s of one kvb_put() of src (a chunk stored already) by c; exits naming what on failure. */
static double timed_put(kvb_client *c, const uint8_t *hash, const void *src, uint32_t tokens,
			size_t bytes, const char *what)
{
	double t0 = now_s();
	int existed = 0;

	if (kvb_put(c, model.name, hash, KVB_F16, tokens, 0, src, bytes, &existed) || !existed) {
		fprintf(stderr, "%s: %s\n", what, existed ? kvb_last_error(c) : "not stored yet");
		exit(1);
	}
	return bytes / (now_s() - t0) / 1e9;
}

/* GB/s of one kvb_get() of hash into dst by c, with the variable var set to val meanwhile
 * (var may be NULL); exits naming what on failure. */
static double timed_get(kvb_client *c, const uint8_t *hash, void *dst, size_t bytes,
			const char *var, const char *val, const char *what)
{
	double t0;

	if (var)
		setenv(var, val, 1);
	t0 = now_s();
	if (kvb_get(c, model.name, hash, 0, 0, dst, bytes, NULL)) {
		fprintf(stderr, "%s: %s\n", what, kvb_last_error(c));
		exit(1);
	}
	t0 = now_s() - t0;
	if (var)
		unsetenv(var);
	return bytes / t0 / 1e9;
}

static void run(const char *daemon, bool curve, const unsigned *sizes, unsigned n_sizes,
		int repeats, bool get_only)
{
	struct node a = { 0 }, b = { 0 }, c = { 0 };
	char peers[400], peers_c[400];
	kvb_client *ca, *cb, *cc, *ct, *cf, *cg;
	const char *sk = curve ? pub_a : NULL, *ck = curve ? sec_c : NULL;

	if (daemon_prepare(&a.d, "/tmp/kvb-bcl-a") || daemon_prepare(&b.d, "/tmp/kvb-bcl-b") ||
	    daemon_prepare(&c.d, "/tmp/kvb-bcl-c")) {
		perror("mkdtemp");
		exit(1);
	}
	a.port = free_tcp_port();
	b.port = free_tcp_port();
	c.port = free_tcp_port();
	snprintf(a.tcp, sizeof(a.tcp), "tcp://127.0.0.1:%d", a.port);
	snprintf(b.tcp, sizeof(b.tcp), "tcp://127.0.0.1:%d", b.port);
	snprintf(c.tcp, sizeof(c.tcp), "tcp://127.0.0.1:%d", c.port);
	if (curve)
		snprintf(peers, sizeof(peers), "a=%s=%s,b=%s=%s", a.tcp, pub_a, b.tcp, pub_b);
	else
		snprintf(peers, sizeof(peers), "a=%s,b=%s", a.tcp, b.tcp);
	/* c knows a only, fetches from it in frames (its key is the client's, which a
	 * authorizes), and is no member a knows of */
	if (curve)
		snprintf(peers_c, sizeof(peers_c), "a=%s=%s", a.tcp, pub_a);
	else
		snprintf(peers_c, sizeof(peers_c), "a=%s", a.tcp);
	start_node(daemon, &a, "a", peers, curve, sec_a, false);
	start_node(daemon, &b, "b", peers, curve, sec_b, false);
	if (!get_only)
		start_node(daemon, &c, "c", peers_c, curve, sec_c, true);
	ca = connect_to(a.d.endpoint, NULL, NULL);
	cb = connect_to(b.d.endpoint, NULL, NULL);
	cc = get_only ? NULL : connect_to(c.d.endpoint, NULL, NULL);
	ct = connect_to(a.tcp, sk, ck);
	cf = connect_to(a.tcp, sk, ck);
	cg = connect_to(a.tcp, sk, ck);
	kvb_model_register(ca, &model, NULL);
	kvb_model_register(cb, &model, NULL);
	if (cc)
		kvb_model_register(cc, &model, NULL);
	for (unsigned s = 0; s < n_sizes; s++) {
		size_t tok_bytes = (size_t)2 * model.num_layers * model.num_kv_heads * model.head_dim * 2;
		uint32_t tokens = (uint32_t)(((size_t)sizes[s] << 20) / tok_bytes);
		size_t bytes = (size_t)tokens * tok_bytes;
		uint16_t *src = malloc(bytes), *dst = malloc(bytes);
		uint8_t(*hashes)[KVB_HASH_LEN] = calloc((size_t)2 * repeats + 8 * 4, KVB_HASH_LEN);
		double r_plain, r_get[MAX_REPEATS], r_fetch[MAX_REPEATS], r_wall[MAX_REPEATS];
		double r_wire[MAX_REPEATS], r_cwire[MAX_REPEATS];
		double r_frames[MAX_REPEATS], r_nobulk[MAX_REPEATS], r_plains[MAX_REPEATS];
		double q_get[MAX_REPEATS], q_nobulk[MAX_REPEATS], q_frames[MAX_REPEATS];
		double r_gcm[MAX_REPEATS], q_gcm[MAX_REPEATS];
		double r_tput[MAX_REPEATS], q_tput[MAX_REPEATS], r_fput[MAX_REPEATS];
		double q_fput[MAX_REPEATS];
		char gcm[32];
		struct plain pl;
		double r_put[MAX_REPEATS];
		double t_open_remote[4], t_open_local[4];
		int k = 0;

		fill(src, bytes / 2);
		/* chunks on a only (b fetches them); the first one also for GET over TCP */
		for (int i = 0; i < (get_only ? 1 : 2 * repeats + 8 * 4); i++) {
			hash_owned_by(hashes[i], 0);
			((uint8_t *)src)[i % 64] ^= 1; /* distinct bytes per chunk */
			if (kvb_put(ca, model.name, hashes[i], KVB_F16, tokens, 0, src, bytes, NULL)) {
				fprintf(stderr, "put: %s\n", kvb_last_error(ca));
				exit(1);
			}
		}
		/* The PUTs above left up to GBs of dirty pages (the daemons run --no-sync): write
		 * them back now, not in the kernel's background during the timed GETs. */
		sync();
		/* Rounds: the plain copy, then each GET, so that every ratio compares figures
		 * taken moments apart (this machine's load moves); the ratios printed are the
		 * medians of the rounds' ratios. The client without the bulk connection reads
		 * KVBLEND_NO_BULK at its first GET, which decides for it. */
		plain_open(&pl, (const uint8_t *)src, bytes);
		for (int r = -WARMUP; r < repeats; r++) {
			double p = plain_round(&pl, (uint8_t *)dst), t0, g, f, l, m = 0, u, v;
			struct kvb_layers *lay;

			g = timed_get(ct, hashes[0], dst, bytes, NULL, NULL, "get tcp");
			/* each client's first GET opens its bulk connection, as its variables say */
			if (curve)
				m = timed_get(cg, hashes[0], dst, bytes, "KVBLEND_BULK_CIPHER",
					      "aes-256-gcm", "get tcp gcm");
			f = timed_get(cf, hashes[0], dst, bytes, "KVBLEND_NO_BULK", "1",
				      "get tcp frames");
			t0 = now_s();
			if (kvb_get_layers(ct, model.name, hashes[0], 0, 0, &lay)) {
				fprintf(stderr, "get layers tcp: %s\n", kvb_last_error(ct));
				exit(1);
			}
			l = bytes / (now_s() - t0) / 1e9;
			kvb_layers_free(&lay);
			/* the chunk back, over the bulk connection, then in frames (cf has it off) */
			u = timed_put(ct, hashes[0], src, tokens, bytes, "put tcp");
			v = timed_put(cf, hashes[0], src, tokens, bytes, "put tcp frames");
			if (r < 0)
				continue;
			r_tput[r] = u;
			q_tput[r] = u / p;
			r_fput[r] = v;
			q_fput[r] = v / p;
			r_plains[r] = p;
			r_get[r] = g;
			r_nobulk[r] = f;
			r_frames[r] = l;
			q_get[r] = g / p;
			r_gcm[r] = m;
			q_gcm[r] = m / p;
			q_nobulk[r] = f / p;
			q_frames[r] = l / p;
		}
		plain_close(&pl);
		r_plain = bench_median(r_plains, repeats);
		for (int r = 0; r < repeats && get_only; r++)
			r_fetch[r] = r_wall[r] = r_put[r] = r_wire[r] = r_cwire[r] = 0;
		for (int r = 0; r < 4 && get_only; r++)
			t_open_remote[r] = t_open_local[r] = 0;
		/* rounds of: a fetch by b (on its bulk connection), one by c (in frames) */
		for (int r = 0; r < repeats && !get_only; r++, k++) {
			double ms0 = stat_of(cb, "cluster_fetch_ms"), t0 = now_s(), ms;
			double w0 = stat_of(cb, "cluster_fetch_wire_ms"), cw0;

			if (kvb_get(cb, model.name, hashes[k], 0, 0, dst, bytes, NULL)) {
				fprintf(stderr, "get via b: %s\n", kvb_last_error(cb));
				exit(1);
			}
			r_wall[r] = bytes / (now_s() - t0) / 1e9;
			ms = stat_of(cb, "cluster_fetch_ms") - ms0;
			r_fetch[r] = ms > 0 ? bytes / (ms / 1e3) / 1e9 : 0;
			ms = stat_of(cb, "cluster_fetch_wire_ms") - w0;
			r_wire[r] = ms > 0 ? bytes / (ms / 1e3) / 1e9 : 0;
			cw0 = stat_of(cc, "cluster_fetch_wire_ms");
			if (kvb_get(cc, model.name, hashes[repeats + 8 * 4 + r], 0, 0, dst, bytes,
				    NULL)) {
				fprintf(stderr, "get via c: %s\n", kvb_last_error(cc));
				exit(1);
			}
			ms = stat_of(cc, "cluster_fetch_wire_ms") - cw0;
			r_cwire[r] = ms > 0 ? bytes / (ms / 1e3) / 1e9 : 0;
		}
		/* the local PUT on b of the same bytes (a chunk b owns: nothing pushed): what
		 * storing a fetched copy costs at least */
		for (int r = 0; r < repeats && !get_only; r++) {
			uint8_t h[KVB_HASH_LEN];
			double t0;

			hash_owned_by(h, 1);
			t0 = now_s();
			if (kvb_put(cb, model.name, h, KVB_F16, tokens, 0, src, bytes, NULL)) {
				fprintf(stderr, "put on b: %s\n", kvb_last_error(cb));
				exit(1);
			}
			r_put[r] = bytes / (now_s() - t0) / 1e9;
		}
		/* a fuse open on b over 8 chunks held on a only, then the same once local */
		for (int r = 0; r < 4 && !get_only; r++) {
			struct kvb_segment seg[8];
			uint32_t check = 1;
			double ratio = 0.15;
			struct kvb_fuse_params fp = { &check, &ratio, 1, KVB_METRIC_VALUE };

			for (int j = 0; j < 8; j++) {
				seg[j].fresh = 0;
				memcpy(seg[j].hash, hashes[k + j], KVB_HASH_LEN);
				seg[j].pos = (uint32_t)j * tokens;
				seg[j].count = 0;
			}
			for (int pass = 0; pass < 2; pass++) {
				kvb_fuse *f = NULL;
				double t0 = now_s();

				if (kvb_fuse_open(cb, model.name, seg, 8, &fp, &f, NULL, NULL)) {
					fprintf(stderr, "fuse open: %s\n", kvb_last_error(cb));
					exit(1);
				}
				(pass ? t_open_local : t_open_remote)[r] = (now_s() - t0) * 1e3;
				kvb_fuse_close(cb, &f, NULL, NULL);
			}
			k += 8;
		}
		if (curve)
			snprintf(gcm, sizeof(gcm), "%5.2f (%.2fx)", bench_median(r_gcm, repeats),
				 bench_median(q_gcm, repeats));
		else
			snprintf(gcm, sizeof(gcm), "-");
		printf("| %s | %3u MiB | %5.2f | %5.2f (%.2fx) | %s | %5.2f (%.2fx) | %5.2f (%.2fx) "
		       "| %5.2f (%.2fx) | %5.2f (%.2fx) "
		       "| %5.2f (%.2fx; %.2fx of PUT) | %5.2f (%.2fx) | %5.2f (%.2fx) | %5.2f | %5.2f "
		       "| %6.1f ms (%.2f GB/s) | %5.1f ms |\n",
		       curve ? "CURVE" : "plain", sizes[s], r_plain, bench_median(r_get, repeats),
		       bench_median(q_get, repeats), gcm, bench_median(r_nobulk, repeats),
		       bench_median(q_nobulk, repeats), bench_median(r_frames, repeats),
		       bench_median(q_frames, repeats), bench_median(r_tput, repeats),
		       bench_median(q_tput, repeats), bench_median(r_fput, repeats),
		       bench_median(q_fput, repeats), bench_median(r_fetch, repeats),
		       bench_median(r_fetch, repeats) / r_plain,
		       bench_median(r_fetch, repeats) / bench_median(r_put, repeats),
		       bench_median(r_wire, repeats), bench_median(r_wire, repeats) / r_plain,
		       bench_median(r_cwire, repeats), bench_median(r_cwire, repeats) / r_plain,
		       bench_median(r_wall, repeats), bench_median(r_put, repeats),
		       bench_median(t_open_remote, 4),
		       8.0 * bytes / (bench_median(t_open_remote, 4) / 1e3) / 1e9,
		       bench_median(t_open_local, 4));
		fflush(stdout);
		free(src);
		free(dst);
		free(hashes);
	}
	kvb_close(&ca);
	kvb_close(&cb);
	if (cc)
		kvb_close(&cc);
	kvb_close(&ct);
	kvb_close(&cf);
	kvb_close(&cg);
	/* the others first: each drains what it owns to a on its way out */
	bench_stop_daemon(&c.d);
	bench_stop_daemon(&b.d);
	bench_stop_daemon(&a.d);
}

/* The first three fields of /proc/loadavg: the machine's load when the run began. */
static const char *loadavg(void)
{
	static char buf[64] = "?";
	double l1, l5, l15;
	FILE *f = fopen("/proc/loadavg", "r");

	if (f) {
		if (fscanf(f, "%lf %lf %lf", &l1, &l5, &l15) == 3)
			snprintf(buf, sizeof(buf), "%.2f %.2f %.2f", l1, l5, l15);
		fclose(f);
	}
	return buf;
}

int main(int argc, char **argv)
{
	char daemon_path[512];
	unsigned sizes[8] = { 8, 32 }, n_sizes = 2;
	int repeats = 7;
	bool curve = true, plain = true, tune = false, get_only = false;

	bench_daemon_arg(&argc, argv, daemon_path, sizeof(daemon_path));
	for (int i = 1; i < argc; i++) {
		if (!strcmp(argv[i], "--repeats") && i + 1 < argc) {
			repeats = bench_count_arg("--repeats", argv[++i], MAX_REPEATS);
		} else if (!strcmp(argv[i], "--sizes") && i + 1 < argc) {
			char *s = argv[++i];

			for (n_sizes = 0; *s && n_sizes < 8; n_sizes++) {
				sizes[n_sizes] = (unsigned)strtoul(s, &s, 10);
				if (!sizes[n_sizes] || sizes[n_sizes] > 1024) {
					fprintf(stderr, "--sizes: MiB, 1..1024, comma-separated\n");
					return 2;
				}
				if (*s == ',')
					s++;
			}
		} else if (!strcmp(argv[i], "--no-curve")) {
			curve = false;
		} else if (!strcmp(argv[i], "--curve-only")) {
			plain = false;
		} else if (!strcmp(argv[i], "--get-only")) {
			get_only = true;
		} else if (!strcmp(argv[i], "--malloc-tune")) {
			tune = true;
		} else {
			fprintf(stderr, "usage: bench_cluster [--daemon PATH] [--sizes 8,32] "
					"[--repeats N] [--no-curve] [--curve-only] [--malloc-tune] "
					"[--get-only]\n");
			return 2;
		}
	}
	if (tune && kvb_malloc_tune(0)) {
		fprintf(stderr, "bench_cluster: kvb_malloc_tune failed\n");
		return 1;
	}
	signal(SIGPIPE, SIG_IGN);
	if (kvb_curve_keypair(pub_a, sec_a) || kvb_curve_keypair(pub_b, sec_b) ||
	    kvb_curve_keypair(pub_c, sec_c)) {
		fprintf(stderr, "bench_cluster: no CURVE key pairs\n");
		return 1;
	}
	printf("Two kvblendd on loopback TCP, Mistral-7B-shaped chunks (f16); GB/s of the chunk's "
	       "bytes, medians of %d; GET and PUT ratios: medians of each round's ratio to the plain "
	       "socket copy of the same round; client "
	       "malloc %s; load average %s.\n\n",
	       repeats, tune ? "tuned (kvb_malloc_tune)" : "glibc's defaults", loadavg());
	printf("| transport | chunk | plain TCP copy | GET over TCP | same, AES-256-GCM | GET, "
	       "frames | GET, frames kept | PUT over TCP (stored already) | PUT, frames | fetch "
	       "b<-a | its wire, bulk | c<-a's wire, frames | GET via b (wall) | local PUT on b "
	       "| fuse open on b, 8 remote chunks | same, local |\n");
	printf("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|\n");
	if (plain || !curve)
		run(daemon_path, false, sizes, n_sizes, repeats, get_only);
	if (curve)
		run(daemon_path, true, sizes, n_sizes, repeats, get_only);
	return 0;
}
