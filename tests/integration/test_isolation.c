/*
 * Tenant isolation by name (issue 19, defect 1): a tenant's models are stored as
 * "TENANT#NAME". A client bound to no tenant must not reach them by naming
 * "alice#m" in any request, REPLICATE and FETCH included; only a cluster member,
 * known by its CURVE key, carries another namespace's chunks between daemons.
 *
 * One real kvblendd: IPC for alice (uid 0 in the tenants file), a CURVE TCP
 * endpoint, and a static member list naming a second member, "b", by its key (b
 * itself is never started: this test plays b with b's key pair).
 */
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <cmocka.h>

#include <zmq.h>

#include "tests/integration/harness.h"
#include "tests/integration/rawreq.h"
#include "proto/wire.h"

#define L 2
#define H 2
#define D 64
#define T 16
#define ROW (H * D * 2)

static const struct kvb_model model = TEST_MODEL_F16("m", L, H, D);

struct setup {
	struct daemon d;
	char tcp[64];
	char server_pub[41], server_sec[41], member_pub[41], member_sec[41];
	char files[3][300];
	uint8_t hash[KVB_HASH_LEN];
	uint8_t *kv; /* alice's chunk */
	size_t bytes;
	kvb_client *alice;
};

/* The daemon, alice's model and one chunk of hers (pinned, so that eviction is out). */
static int setup(void **state)
{
	struct setup *s = calloc(1, sizeof(*s));
	char peers[400];
	const char *args[16];
	uint32_t ids[3] = { 19, 1, 4 };
	int port = free_tcp_port(), n = 0;

	assert_non_null(s);
	assert_int_equal(kvb_curve_keypair(s->server_pub, s->server_sec), 0);
	assert_int_equal(kvb_curve_keypair(s->member_pub, s->member_sec), 0);
	for (int i = 0; i < 3; i++)
		snprintf(s->files[i], sizeof(s->files[i]), "/tmp/kvb-isolation-%d-%d", (int)getpid(),
			 i);
	write_text_file(s->files[0], "alice uid=0\n");
	write_text_file(s->files[1], s->server_sec);
	snprintf(s->tcp, sizeof(s->tcp), "tcp://127.0.0.1:%d", port);
	snprintf(peers, sizeof(peers), "self=%s=%s,b=tcp://127.0.0.1:%d=%s", s->tcp, s->server_pub,
		 free_tcp_port(), s->member_pub);
	args[n++] = "--tenants-file";
	args[n++] = s->files[0];
	args[n++] = "--listen";
	args[n++] = s->tcp;
	args[n++] = "--curve-secret-key-file";
	args[n++] = s->files[1];
	args[n++] = "--node-id";
	args[n++] = "self";
	args[n++] = "--cluster-peers";
	args[n++] = peers;
	args[n++] = "--cluster-timeout-ms";
	args[n++] = "200";
	args[n] = NULL;
	s->alice = daemon_start_client(&s->d, args, &model, 0);
	s->bytes = (size_t)L * 2 * T * ROW;
	s->kv = malloc(s->bytes);
	assert_non_null(s->kv);
	fill_f16((uint16_t *)s->kv, s->bytes / 2, 1919);
	kvb_chunk_hash(ids, 3, s->hash);
	assert_int_equal(kvb_put(s->alice, model.name, s->hash, KVB_F16, T, 0, s->kv, s->bytes,
				 NULL), 0);
	*state = s;
	return 0;
}

static int teardown(void **state)
{
	struct setup *s = *state;

	daemon_end(&s->d, &s->alice);
	for (int i = 0; i < 3; i++)
		unlink(s->files[i]);
	free(s->kv);
	free(s);
	return 0;
}

/* A CURVE client of the daemon's TCP endpoint with the given secret key (NULL: new). */
static kvb_client *tcp_client(const struct setup *s, const char *secret)
{
	struct kvb_connect_opts o = { .timeout_ms = 10000, .no_shm = 1,
				      .server_key = s->server_pub, .client_secret_key = secret };
	char pub[41], sec[41];
	kvb_client *c = NULL;
	char err[256];

	if (!secret) {
		assert_int_equal(kvb_curve_keypair(pub, sec), 0);
		o.client_secret_key = sec;
	}
	if (kvb_connect(s->tcp, &o, &c, err, sizeof(err)))
		fail_msg("connect %s: %s", s->tcp, err);
	return c;
}

/* A raw socket over CURVE with the given secret key (NULL: a new key pair), as a daemon. */
static void peer_open(struct raw *r, const struct setup *s, const char *secret)
{
	char pub[41], sec[41];

	if (!secret) {
		assert_int_equal(kvb_curve_keypair(pub, sec), 0);
		secret = sec;
	}
	raw_open_curve(r, s->tcp, 10000, s->server_pub, secret);
}

/* A reply's payload frames, kept (raw_frame_fn). */
struct kept {
	void *data[L + 1];
	size_t len[L + 1];
	size_t n;
};

static void keep_frame(size_t index, const void *data, size_t size, void *arg)
{
	struct kept *k = arg;

	(void)index;
	if (k->n > L)
		return;
	k->data[k->n] = malloc(size ? size : 1);
	assert_non_null(k->data[k->n]);
	memcpy(k->data[k->n], data, size);
	k->len[k->n++] = size;
}

static void kept_free(struct kept *k)
{
	for (size_t i = 0; i < k->n; i++)
		free(k->data[i]);
	k->n = 0;
}

static void expect_refused(kvb_client *c, int rc, const char *what)
{
	if (rc != KVB_E_BAD_ARGUMENT)
		fail_msg("%s naming alice#m: expected bad_argument, got %d (%s)", what, rc,
			 kvb_last_error(c));
	assert_non_null(strstr(kvb_last_error(c), "'#'"));
}

/* Alice's chunk is hers, whole; nothing else was stored in her namespace. */
static void alice_intact(struct setup *s, const uint8_t *poison)
{
	uint8_t *back = malloc(s->bytes);
	struct kvb_chunk_info *list = NULL;
	struct kvb_model *ms = NULL;
	size_t n = 0;

	assert_non_null(back);
	assert_int_equal(kvb_get(s->alice, model.name, s->hash, 0, 0, back, s->bytes, NULL), 0);
	assert_memory_equal(back, s->kv, s->bytes);
	assert_int_equal(kvb_get(s->alice, model.name, poison, 0, 0, back, s->bytes, NULL),
			 KVB_E_NOT_FOUND);
	assert_int_equal(kvb_list(s->alice, model.name, &list, &n), 0);
	assert_int_equal(n, 1);
	free(list);
	assert_int_equal(kvb_model_list(s->alice, &ms, &n), 0);
	assert_true(n >= 1);
	for (size_t i = 0; i < n; i++) /* hers only: no "alice#..." or default-namespace one */
		assert_null(strchr(ms[i].name, '#'));
	assert_string_equal(ms[0].name, "m");
	free(ms);
	free(back);
}

/*
 * A client of the default namespace names alice's stored model: every request is
 * refused with bad_argument and a message naming the '#', and nothing of hers is
 * read, changed or added.
 */
static void default_namespace_cannot_name_a_tenant(void **state)
{
	struct setup *s = *state;
	kvb_client *c = tcp_client(s, NULL);
	uint8_t poison[KVB_HASH_LEN], *mine = malloc(s->bytes), *back = malloc(s->bytes);
	uint8_t hashes[2][KVB_HASH_LEN];
	struct kvb_chunk_info *list = NULL, info[2];
	struct kvb_model theirs = model;
	size_t n = 0;

	assert_non_null(mine);
	assert_non_null(back);
	memset(poison, 0x5a, sizeof(poison));
	fill_f16((uint16_t *)mine, s->bytes / 2, 666);
	/* its own namespace works: the refusals below are for the name, not the client */
	assert_int_equal(kvb_model_register(c, &model, NULL), 0);
	assert_int_equal(kvb_get(c, "m", s->hash, 0, 0, back, s->bytes, NULL), KVB_E_NOT_FOUND);

	expect_refused(c, kvb_get(c, "alice#m", s->hash, 0, 0, back, s->bytes, NULL), "GET");
	memcpy(hashes[0], s->hash, KVB_HASH_LEN);
	memcpy(hashes[1], poison, KVB_HASH_LEN);
	expect_refused(c, kvb_lookup(c, "alice#m", hashes, 2, info), "LOOKUP");
	expect_refused(c, kvb_list(c, "alice#m", &list, &n), "LIST");
	expect_refused(c, kvb_pin(c, "alice#m", s->hash, 60), "PIN");
	expect_refused(c, kvb_unpin(c, "alice#m", s->hash), "UNPIN");
	expect_refused(c, kvb_delete(c, "alice#m", s->hash), "DELETE");
	/* over TCP the PUT goes on the bulk connection and reaches the daemon, which
	 * refuses the name before it reads the payload (the library's frames path looks
	 * the model up first and fails with unknown_model; a raw PUT is in the next test) */
	expect_refused(c, kvb_put(c, "alice#m", poison, KVB_F16, T, 0, mine, s->bytes, NULL),
		       "PUT");
	/* the model registration refuses '#' as before */
	snprintf(theirs.name, sizeof(theirs.name), "alice#m2");
	assert_int_equal(kvb_model_register(c, &theirs, NULL), KVB_E_BAD_ARGUMENT);
	alice_intact(s, poison);
	kvb_close(&c);
	free(mine);
	free(back);
}

/*
 * The same through raw REPLICATE and FETCH, as a daemon that is not a member
 * would send them: REPLICATE cannot store bytes under alice's name nor register
 * "alice#m2" with another description ahead of her, FETCH cannot read hers.
 */
static void non_member_cannot_replicate_or_fetch(void **state)
{
	struct setup *s = *state;
	struct kvbp_request req = { .op = KVBP_OP_FETCH, .has_hash = true, .local_only = true };
	struct kvbp_reply rep = { 0 };
	struct kvb_model m2 = model;
	uint8_t *kv = malloc(s->bytes), junk[2][64] = { { 0 } };
	const void *frames[2] = { junk[0], junk[1] }, *one[1] = { kv };
	size_t lens[2] = { 64, 64 }, one_len[1] = { s->bytes }, n = 0;
	struct raw r;

	assert_non_null(kv);
	peer_open(&r, s, NULL);
	snprintf(req.model_name, sizeof(req.model_name), "alice#m");
	memcpy(req.hash, s->hash, KVB_HASH_LEN);
	assert_int_equal(raw_call(&r, &req, NULL, NULL, 0, &rep), KVBP_BAD_ARGUMENT);
	assert_non_null(strstr(rep.message, "'#'"));
	kvbp_reply_clear(&rep);

	/* a raw PUT of its own bytes under alice's model */
	memset(&req, 0, sizeof(req));
	req.op = KVBP_OP_PUT;
	req.has_hash = true;
	snprintf(req.model_name, sizeof(req.model_name), "alice#m");
	memset(req.hash, 0x77, KVB_HASH_LEN);
	req.num_tokens = T;
	req.dtype = 1; /* f16 */
	memset(kv, 0x3c, s->bytes);
	raw_send(&r, &req, one, one_len, 1);
	assert_int_equal(raw_recv_frames(&r, &rep, &n, NULL, NULL), KVBP_BAD_ARGUMENT);
	assert_int_equal(n, 0);
	assert_non_null(strstr(rep.message, "'#'"));
	kvbp_reply_clear(&rep);

	/* REPLICATE under alice#m2, with a model description of its own (4 heads) */
	memset(&req, 0, sizeof(req));
	req.op = KVBP_OP_REPLICATE;
	req.has_hash = true;
	req.has_model = true;
	snprintf(req.model_name, sizeof(req.model_name), "alice#m2");
	snprintf(req.model.name, sizeof(req.model.name), "alice#m2");
	req.model.desc.num_layers = L;
	req.model.desc.num_kv_heads = 4;
	req.model.desc.head_dim = D;
	req.model.desc.dtype = 1; /* f16 */
	req.model.desc.rope_theta = 10000;
	req.num_tokens = T;
	memset(req.hash, 0x77, KVB_HASH_LEN);
	assert_int_equal(raw_call(&r, &req, frames, lens, L, &rep), KVBP_BAD_ARGUMENT);
	kvbp_reply_clear(&rep);
	raw_close(&r);
	alice_intact(s, req.hash);
	/* alice's own m2 registers: nobody took the name before her */
	snprintf(m2.name, sizeof(m2.name), "m2");
	assert_int_equal(kvb_model_register(s->alice, &m2, NULL), 0);
	free(kv);
}

/*
 * A member (the key of "b" in the member list) carries alice's chunk: FETCH gives
 * its stored bytes under "alice#m", and REPLICATE of those bytes under another hash
 * lands in alice's namespace, where she reads it.
 */
static void members_carry_namespaces(void **state)
{
	struct setup *s = *state;
	struct kvbp_request req = { .op = KVBP_OP_FETCH, .has_hash = true, .local_only = true };
	struct kvbp_reply rep = { 0 };
	uint8_t copy_hash[KVB_HASH_LEN], *back = malloc(s->bytes);
	struct kept k = { .n = 0 };
	struct raw r;

	assert_non_null(back);
	peer_open(&r, s, s->member_sec);
	snprintf(req.model_name, sizeof(req.model_name), "alice#m");
	memcpy(req.hash, s->hash, KVB_HASH_LEN);
	req.version = KVBP_VERSION;
	raw_send(&r, &req, NULL, NULL, 0);
	if (raw_recv_frames(&r, &rep, NULL, keep_frame, &k))
		fail_msg("a member's FETCH of alice#m: %s", rep.message);
	assert_int_equal(k.n, L);
	kvbp_reply_clear(&rep);

	memset(&req, 0, sizeof(req));
	req.op = KVBP_OP_REPLICATE;
	req.has_hash = true;
	snprintf(req.model_name, sizeof(req.model_name), "alice#m");
	memset(copy_hash, 0x42, sizeof(copy_hash));
	memcpy(req.hash, copy_hash, KVB_HASH_LEN);
	req.num_tokens = T;
	if (raw_call(&r, &req, (const void *const *)k.data, k.len, k.n, &rep))
		fail_msg("a member's REPLICATE to alice#m: %s", rep.message);
	kvbp_reply_clear(&rep);
	kept_free(&k);
	raw_close(&r);
	assert_int_equal(kvb_get(s->alice, model.name, copy_hash, 0, 0, back, s->bytes, NULL), 0);
	assert_memory_equal(back, s->kv, s->bytes);
	assert_int_equal(kvb_delete(s->alice, model.name, copy_hash), 0);
	free(back);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(default_namespace_cannot_name_a_tenant),
		cmocka_unit_test(non_member_cannot_replicate_or_fetch),
		cmocka_unit_test(members_carry_namespaces),
	};

	if (geteuid() != 0) { /* alice is uid 0 in the tenants file */
		printf("skipped: the tenants file binds uid 0, and this runs as uid %d\n",
		       (int)geteuid());
		return 0;
	}
	return cmocka_run_group_tests(tests, setup, teardown);
}
