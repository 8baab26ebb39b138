/*
 * crash_put — the client side of the crash test (crash_test.py).
 *
 *   crash_put put ENDPOINT SEED LOG      PUT chunks until SIGTERM, reconnecting when the
 *                                        daemon dies; each acknowledged PUT is appended to LOG
 *   crash_put verify ENDPOINT SEED LOG   every acknowledged chunk is there, byte for byte
 *   crash_put scan ENDPOINT              every visible chunk reads back whole (no layer
 *                                        missing, every checksum good)
 * Model "crash": 4 layers, 2 KV heads, head_dim 64, f16. Exit 0 when all is well.
 */
#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "client/include/kvblend.h"

static const struct kvb_model model = { .name = "crash", .num_layers = 4, .num_kv_heads = 2,
					.head_dim = 64, .dtype = KVB_F16, .rope_theta = 1e4 };
#define TOKEN_BYTES (4 * 2 * 2 * 64 * 2)
/* A bound on what one client stores, a few hundred chunks a second, so that the map
 * (16G in crash_test.py) never fills and nothing acknowledged is evicted. */
#define MAX_CHUNKS 100000

static volatile sig_atomic_t stop;

static void on_term(int sig)
{
	(void)sig;
	stop = 1;
}

static uint32_t tokens_of(uint32_t i)
{
	return 8 + (i * 7) % 57;
}

static void chunk_of(uint32_t seed, uint32_t i, uint8_t *kv, uint8_t h[KVB_HASH_LEN])
{
	uint32_t ids[2] = { seed, i };
	uint64_t x = ((uint64_t)seed << 32 | i) * 0x9e3779b97f4a7c15ull + 1;
	size_t n = (size_t)tokens_of(i) * TOKEN_BYTES;

	kvb_chunk_hash(ids, 2, h);
	for (size_t k = 0; k < n; k++) {
		x ^= x << 13, x ^= x >> 7, x ^= x << 17;
		kv[k] = (uint8_t)(x >> 40);
	}
}

static kvb_client *connect_retry(const char *ep)
{
	struct kvb_connect_opts o = { .timeout_ms = 1000 };
	kvb_client *c = NULL;

	while (!stop && kvb_connect(ep, &o, &c, NULL, 0))
		usleep(50000);
	return c;
}

static int do_put(const char *ep, uint32_t seed, const char *log)
{
	uint8_t *kv = malloc(64 * TOKEN_BYTES), h[KVB_HASH_LEN];
	FILE *f = fopen(log, "a");
	kvb_client *c = NULL;
	uint32_t i = 0;

	signal(SIGTERM, on_term);
	if (!f)
		return 2;
	while (!stop) {
		int rc;

		if (i >= MAX_CHUNKS) {
			usleep(100000);
			continue;
		}
		if (!c && !(c = connect_retry(ep)))
			break;
		kvb_model_register(c, &model, NULL);
		chunk_of(seed, i, kv, h);
		rc = kvb_put(c, "crash", h, KVB_F16, tokens_of(i), 0, kv,
			     (size_t)tokens_of(i) * TOKEN_BYTES, NULL);
		if (rc == 0) {
			/* acknowledged: the daemon committed it before replying */
			fprintf(f, "%u\n", i);
			fflush(f);
			i++;
			usleep(2000);
		} else {
			kvb_close(&c);
		}
	}
	kvb_close(&c);
	fclose(f);
	free(kv);
	return 0;
}

static int do_verify(const char *ep, uint32_t seed, const char *log)
{
	uint8_t *kv = malloc(64 * TOKEN_BYTES), *back = malloc(64 * TOKEN_BYTES), h[KVB_HASH_LEN];
	FILE *f = fopen(log, "r");
	kvb_client *c = connect_retry(ep);
	unsigned i, n = 0, bad = 0;

	if (!f || !c)
		return 2;
	while (fscanf(f, "%u", &i) == 1) {
		size_t len = (size_t)tokens_of(i) * TOKEN_BYTES;
		int rc;

		chunk_of(seed, i, kv, h);
		rc = kvb_get(c, "crash", h, 0, 0, back, len, NULL);
		if (rc || memcmp(kv, back, len)) {
			fprintf(stderr, "seed %u chunk %u: %s\n", seed, i,
				rc ? kvb_last_error(c) : "different bytes");
			bad++;
		}
		n++;
	}
	printf("%u acknowledged chunks checked, %u bad\n", n, bad);
	fclose(f);
	kvb_close(&c);
	free(kv);
	free(back);
	return bad ? 1 : 0;
}

static int do_scan(const char *ep)
{
	kvb_client *c = connect_retry(ep);
	struct kvb_chunk_info *list;
	uint8_t *back = malloc(64 * TOKEN_BYTES);
	size_t n;
	unsigned bad = 0;

	if (!c)
		return 2;
	if (kvb_list(c, "crash", &list, &n)) {
		/* no model yet: nothing was ever stored */
		printf("0 visible chunks\n");
		kvb_close(&c);
		free(back);
		return 0;
	}
	for (size_t k = 0; k < n; k++) {
		size_t len = (size_t)list[k].num_tokens * TOKEN_BYTES;
		int rc = list[k].num_tokens <= 64 && list[k].num_layers == 4
				 ? kvb_get(c, "crash", list[k].hash, 0, 0, back, len, NULL)
				 : KVB_E_BAD_SHAPE;

		if (rc) {
			fprintf(stderr, "visible chunk %zu does not read back: %s\n", k,
				kvb_last_error(c));
			bad++;
		}
	}
	printf("%zu visible chunks read back, %u bad\n", n, bad);
	free(list);
	free(back);
	kvb_close(&c);
	return bad ? 1 : 0;
}

int main(int argc, char **argv)
{
	if (argc == 5 && !strcmp(argv[1], "put"))
		return do_put(argv[2], (uint32_t)atoi(argv[3]), argv[4]);
	if (argc == 5 && !strcmp(argv[1], "verify"))
		return do_verify(argv[2], (uint32_t)atoi(argv[3]), argv[4]);
	if (argc == 3 && !strcmp(argv[1], "scan"))
		return do_scan(argv[2]);
	fprintf(stderr, "usage: see the comment at the top of crash_put.c\n");
	return 2;
}
