/*
 * Unit tests of proto/bulk and proto/aegis: record headers (round trip, every malformed
 * field refused), the seals against known answers from independent references (NIST's
 * for AES-256-GCM, the CFRG specification's for AEGIS-128L), and, for both ciphers,
 * every alteration a wire attacker can make refused: a flipped bit of the bytes, the
 * associated header or the tag, another nonce (record moved or replayed), another
 * direction, another key; the hello likewise.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include <cmocka.h>

#include "proto/aegis.h"
#include "proto/bulk.h"

static uint32_t gcm = KVBP_AEAD_AES256GCM, aegis = KVBP_AEAD_AEGIS128L,
		aegis_x2 = KVBP_AEAD_AEGIS128X2;

/* The cipher a test runs with; skipped (with its reason) for an AEGIS variant on a CPU
 * without the AES instructions it needs. */
static uint32_t cipher_of(void **state)
{
	uint32_t c = *(uint32_t *)*state;

	if (c != KVBP_AEAD_AES256GCM && !(kvbb_aeads() & 1u << c)) {
		print_message("%s: this CPU lacks its AES instructions\n", kvbb_cipher_name(c));
		skip();
	}
	return c;
}

static enum kvb_aegis_variant variant_of(uint32_t cipher)
{
	return cipher == KVBP_AEAD_AEGIS128X2 ? KVB_AEGIS_128X2 : KVB_AEGIS_128L;
}

static void test_hdr_roundtrip(void **state)
{
	struct kvbb_hdr h = { KVBB_LAST, 0x0102030405060708ull, 1ull << 33, (1ull << 33) - 77, 77 };
	struct kvbb_hdr d;
	uint8_t b[KVBB_HDR_LEN];

	(void)state;
	kvbb_hdr_put(b, &h);
	assert_memory_equal(b, "KVBR", 4);
	assert_int_equal(kvbb_hdr_get(b, &d), 0);
	assert_int_equal(d.flags, h.flags);
	assert_true(d.request_id == h.request_id && d.total == h.total && d.offset == h.offset);
	assert_int_equal(d.len, h.len);
}

static void test_hdr_malformed(void **state)
{
	struct kvbb_hdr h = { 0, 1, 100, 0, 100 }, d;
	uint8_t b[KVBB_HDR_LEN], x[KVBB_HDR_LEN];

	(void)state;
	kvbb_hdr_put(b, &h);
	memcpy(x, b, sizeof(x));
	x[0] ^= 1; /* magic */
	assert_int_equal(kvbb_hdr_get(x, &d), -EPROTO);
	memcpy(x, b, sizeof(x));
	x[4] = 2; /* an unknown flag */
	assert_int_equal(kvbb_hdr_get(x, &d), -EPROTO);
	memcpy(x, b, sizeof(x));
	x[39] = 1; /* reserved */
	assert_int_equal(kvbb_hdr_get(x, &d), -EPROTO);
	memcpy(x, b, sizeof(x));
	x[4] = KVBB_ABORT; /* an abort that is not the last record */
	assert_int_equal(kvbb_hdr_get(x, &d), -EPROTO);
	x[4] = KVBB_ABORT | KVBB_LAST; /* an abort with bytes */
	assert_int_equal(kvbb_hdr_get(x, &d), -EPROTO);
	h.flags = KVBB_ABORT | KVBB_LAST; /* the abort record: no bytes */
	h.len = 0;
	kvbb_hdr_put(x, &h);
	assert_int_equal(kvbb_hdr_get(x, &d), 0);
	assert_int_equal(d.flags, KVBB_ABORT | KVBB_LAST);
	h.flags = 0;
	h.len = KVBB_RECORD_MAX + 1; /* above the largest record */
	kvbb_hdr_put(x, &h);
	assert_int_equal(kvbb_hdr_get(x, &d), -EPROTO);
}

static void unhex(const char *s, uint8_t *out)
{
	for (size_t i = 0; s[2 * i]; i++) {
		unsigned v;

		sscanf(s + 2 * i, "%2x", &v);
		out[i] = (uint8_t)v;
	}
}

/* NIST GCM test cases 13 and 14 (AES-256, zero key, zero 96-bit IV = counter 0, dir 0). */
static void test_seal_known_answers(void **state)
{
	uint8_t key[KVBP_BULK_KEY_LEN] = { 0 }, zero[16] = { 0 }, ct[16], tag[16], want[16];
	struct iovec iov = { zero, 16 };
	struct kvb_aead_holder {
		struct kvbb_aead *a;
	} h = { NULL };

	(void)state;
	assert_int_equal(kvbb_aead_new(&h.a, key, KVBP_AEAD_AES256GCM), 0);
	assert_int_equal(kvbb_seal(h.a, 0, 0, NULL, 0, NULL, 0, NULL, tag), 0);
	unhex("530f8afbc74536b9a963b4f1c4cb738b", want);
	assert_memory_equal(tag, want, 16);
	assert_int_equal(kvbb_seal(h.a, 0, 0, NULL, 0, &iov, 1, ct, tag), 0);
	unhex("cea7403d4d606b6e074ec5d3baf39d18", want);
	assert_memory_equal(ct, want, 16);
	unhex("d0d1c8a799996bf0265b98b5d48ab919", want);
	assert_memory_equal(tag, want, 16);
	assert_int_equal(kvbb_open(h.a, 0, 0, NULL, 0, ct, 16, tag), 0);
	assert_memory_equal(ct, zero, 16);
	kvbb_aead_free(&h.a);
	assert_null(h.a);
	kvbb_aead_free(&h.a); /* accepts NULL */
}

#define N 5000

/* A refused record (-EBADMSG) leaves no byte of its unauthenticated plaintext behind. */
static void refused(int rc, const uint8_t *buf, size_t len)
{
	assert_int_equal(rc, -EBADMSG);
	for (size_t i = 0; i < len; i++)
		if (buf[i])
			fail_msg("byte %zu of a refused record left in the buffer: %02x", i, buf[i]);
}

static void test_seal_tamper(void **state)
{
	uint8_t key[KVBP_BULK_KEY_LEN], other[KVBP_BULK_KEY_LEN], ad[KVBB_HDR_LEN];
	static uint8_t plain[N], ct[N], buf[N];
	uint8_t tag[KVBB_TAG_LEN], t2[KVBB_TAG_LEN];
	struct iovec iov[3] = { { plain, 1 }, { plain + 1, 2999 }, { plain + 3000, N - 3000 } };
	struct kvbb_hdr h = { 0, 7, N, 0, N };
	struct kvbb_aead *a = NULL, *b = NULL;
	uint32_t cipher = cipher_of(state);

	for (int i = 0; i < N; i++)
		plain[i] = (uint8_t)(i * 31 + 7);
	memset(key, 0x5a, sizeof(key));
	memset(other, 0xa5, sizeof(other));
	kvbb_hdr_put(ad, &h);
	assert_int_equal(kvbb_aead_new(&a, key, cipher), 0);
	assert_int_equal(kvbb_aead_new(&b, other, cipher), 0);
	/* pieces across frames seal as the whole */
	assert_int_equal(kvbb_seal(a, 9, KVBB_DIR_RECORDS, ad, sizeof(ad), iov, 3, ct, tag), 0);
	assert_memory_not_equal(ct, plain, N);
	memcpy(buf, ct, N);
	assert_int_equal(kvbb_open(a, 9, KVBB_DIR_RECORDS, ad, sizeof(ad), buf, N, tag), 0);
	assert_memory_equal(buf, plain, N);
	/* a bit of the bytes, anywhere */
	for (size_t pos = 0; pos < N; pos += 997) {
		memcpy(buf, ct, N);
		buf[pos] ^= 0x10;
		refused(kvbb_open(a, 9, KVBB_DIR_RECORDS, ad, sizeof(ad), buf, N, tag), buf, N);
	}
	/* a bit of the header (request id, offset, length, total, flags) */
	for (size_t pos = 0; pos < sizeof(ad); pos++) {
		memcpy(buf, ct, N);
		ad[pos] ^= 1;
		refused(kvbb_open(a, 9, KVBB_DIR_RECORDS, ad, sizeof(ad), buf, N, tag), buf, N);
		ad[pos] ^= 1;
	}
	/* the tag */
	memcpy(t2, tag, sizeof(t2));
	t2[15] ^= 0x80;
	memcpy(buf, ct, N);
	refused(kvbb_open(a, 9, KVBB_DIR_RECORDS, ad, sizeof(ad), buf, N, t2), buf, N);
	/* the record at another place on the connection (moved, replayed), the other
	 * direction, another connection's key, cut short */
	memcpy(buf, ct, N);
	refused(kvbb_open(a, 10, KVBB_DIR_RECORDS, ad, sizeof(ad), buf, N, tag), buf, N);
	memcpy(buf, ct, N);
	refused(kvbb_open(a, 9, KVBB_DIR_HELLO, ad, sizeof(ad), buf, N, tag), buf, N);
	memcpy(buf, ct, N);
	refused(kvbb_open(b, 9, KVBB_DIR_RECORDS, ad, sizeof(ad), buf, N, tag), buf, N);
	memcpy(buf, ct, N);
	refused(kvbb_open(a, 9, KVBB_DIR_RECORDS, ad, sizeof(ad), buf, N - 1, tag), buf, N - 1);
	kvbb_aead_free(&a);
	kvbb_aead_free(&b);
}

/*
 * AEGIS-128L and AEGIS-128X2 against the test vectors of draft-irtf-cfrg-aegis-aead
 * (appendix A): the module alone (any nonce), with the message in pieces split at every
 * byte, and opened back; then through bulk.c, whose nonce is (counter, dir, 0).
 */
struct aegis_vector {
	const char *key, *nonce, *ad, *msg, *ct, *tag;
};

#define X2_MSG "0405060704050607040506070405060704050607040506070405060704050607" \
	       "0405060704050607040506070405060704050607040506070405060704050607" \
	       "0405060704050607040506070405060704050607040506070405060704050607" \
	       "040506070405060704050607040506070405060704050607"
/* AEGIS-128X2: its initial-state vector (no message) and its vector 2 (120 bytes). */
static const struct aegis_vector aegis_x2_vectors[] = {
	{ "000102030405060708090a0b0c0d0e0f", "101112131415161718191a1b1c1d1e1f", "", "", "",
	  "63117dc57756e402819a82e13eca8379" },
	{ "000102030405060708090a0b0c0d0e0f", "101112131415161718191a1b1c1d1e1f",
	  "0102030401020304", X2_MSG,
	  "5795544301997f93621b278809d6331b3bfa6f18e90db12c4aa35965b5e98c5f"
	  "c6fb4e54bcb6111842c20637252eff747cb3a8f85b37de80919a589fe0f24872"
	  "bc926360696739e05520647e390989e1eb5fd42f99678a0276a498f8c454761c"
	  "9d6aacb647ad56be62b29c22cd4b5761b38f43d5a5ee062f",
	  "1aebc200804f405cab637f2adebb6d77" },
};

static const struct aegis_vector aegis_vectors[] = {
	{ "00000000000000000000000000000000", "00000000000000000000000000000000", "",
	  "00000000000000000000000000000000", "41de9000a7b5e40e2d68bb64d99ebb19",
	  "f4d997cc9b94227ada4fe4165422b1c8" },
	{ "00000000000000000000000000000000", "00000000000000000000000000000000", "", "", "",
	  "83cc600dc4e3e7e62d4055826174f149" },
	{ "10010000000000000000000000000000", "10000200000000000000000000000000",
	  "0001020304050607",
	  "000102030405060708090a0b0c0d0e0f101112131415161718191a1b1c1d1e1f",
	  "79d94593d8c2119d7e8fd9b8fc77845c5c077a05b2528b6ac54b563aed8efe84",
	  "cc6f3372f6aa1bb82388d695c3962d9a" },
	{ "10010000000000000000000000000000", "10000200000000000000000000000000",
	  "0001020304050607", "000102030405060708090a0b0c0d", "79d94593d8c2119d7e8fd9b8fc77",
	  "5c04b3dba849b2701effbe32c7f0fab7" },
};

static void test_aegis_known_answers(void **state)
{
	uint32_t cipher = cipher_of(state);
	enum kvb_aegis_variant var = variant_of(cipher);
	const struct aegis_vector *vs = cipher == KVBP_AEAD_AEGIS128X2 ? aegis_x2_vectors
								       : aegis_vectors;
	size_t nv = cipher == KVBP_AEAD_AEGIS128X2
			    ? sizeof(aegis_x2_vectors) / sizeof(aegis_x2_vectors[0])
			    : sizeof(aegis_vectors) / sizeof(aegis_vectors[0]);

	for (size_t v = 0; v < nv; v++) {
		const struct aegis_vector *t = &vs[v];
		uint8_t key[16], nonce[16], ad[16], msg[128], want[128], want_tag[16], out[128];
		uint8_t tag[16];
		size_t ad_len = strlen(t->ad) / 2, len = strlen(t->msg) / 2;

		unhex(t->key, key);
		unhex(t->nonce, nonce);
		unhex(t->ad, ad);
		unhex(t->msg, msg);
		unhex(t->ct, want);
		unhex(t->tag, want_tag);
		for (size_t cut = 0; cut <= len; cut++) {
			struct iovec iov[3] = { { msg, cut }, { msg + cut, 0 }, { msg + cut, len - cut } };

			memset(out, 0, sizeof(out));
			assert_int_equal(kvb_aegis_seal(var, key, nonce, ad, ad_len, iov, 3, out, tag),
					 0);
			assert_memory_equal(out, want, len);
			assert_memory_equal(tag, want_tag, 16);
		}
		memcpy(out, want, len);
		assert_int_equal(kvb_aegis_open(var, key, nonce, ad, ad_len, out, len, want_tag), 0);
		assert_memory_equal(out, msg, len);
		want_tag[0] ^= 1; /* test vector 5's kind: the wrong tag is refused, no plaintext */
		memcpy(out, want, len);
		assert_int_equal(kvb_aegis_open(var, key, nonce, ad, ad_len, out, len, want_tag),
				 -EBADMSG);
		for (size_t i = 0; i < len; i++)
			assert_int_equal(out[i], 0);
	}
}

/* bulk.c's AEGIS: the key's first 16 bytes, nonce LE64(counter) || LE32(dir) || 0. */
static void test_aegis_bulk_nonce(void **state)
{
	uint32_t cipher = cipher_of(state);
	const struct aegis_vector *t = &aegis_vectors[2];
	uint8_t key[KVBP_BULK_KEY_LEN], nonce[16], ad[8], msg[32], ct[32], tag[16], want[32];
	uint8_t want_tag[16];
	struct iovec iov = { msg, sizeof(msg) };
	struct kvbb_aead *a = NULL;

	memset(key, 0xee, sizeof(key)); /* bytes 16..31: not AEGIS's */
	unhex(t->key, key);
	unhex(t->ad, ad);
	unhex(t->msg, msg);
	memset(nonce, 0, sizeof(nonce));
	nonce[0] = 0x2a;      /* counter 0x102a */
	nonce[1] = 0x10;
	nonce[8] = KVBB_DIR_RECORDS;
	assert_int_equal(kvb_aegis_seal(variant_of(cipher), key, nonce, ad, sizeof(ad), &iov, 1,
					want, want_tag), 0);
	assert_int_equal(kvbb_aead_new(&a, key, cipher), 0);
	assert_string_equal(kvbb_aead_name(a), kvbb_cipher_name(cipher));
	assert_int_equal(kvbb_seal(a, 0x102a, KVBB_DIR_RECORDS, ad, sizeof(ad), &iov, 1, ct, tag), 0);
	assert_memory_equal(ct, want, sizeof(ct));
	assert_memory_equal(tag, want_tag, sizeof(tag));
	assert_int_equal(kvbb_open(a, 0x102a, KVBB_DIR_RECORDS, ad, sizeof(ad), ct, sizeof(ct), tag), 0);
	assert_memory_equal(ct, msg, sizeof(msg));
	kvbb_aead_free(&a);
	assert_int_equal(kvbb_aead_new(&a, key, 7), -ENOTSUP); /* an unknown cipher */
	assert_null(a);
}

/* The daemon's choice: the fastest both ends run; AES-256-GCM when they share none. */
static void test_cipher_pick(void **state)
{
	(void)state;
	assert_int_equal(kvbb_aead_pick(0), KVBP_AEAD_AES256GCM);
	assert_int_equal(kvbb_aead_pick(1u << KVBP_AEAD_AEGIS128L), KVBP_AEAD_AEGIS128L);
	assert_int_equal(kvbb_aead_pick(1u << KVBP_AEAD_AEGIS128L | 1u << KVBP_AEAD_AEGIS128X2),
			 KVBP_AEAD_AEGIS128X2);
	assert_int_equal(kvbb_aead_pick(1u << 9), KVBP_AEAD_AES256GCM); /* unknown bits */
	assert_string_equal(kvbb_cipher_name(KVBP_AEAD_AES256GCM), "AES-256-GCM");
	assert_string_equal(kvbb_cipher_name(KVBP_AEAD_AEGIS128X2), "AEGIS-128X2");
}

/* Lengths around every block boundary, pieces of odd sizes: seal then open gives the
 * bytes back, and the pieces seal as the whole. */
static void test_seal_lengths(void **state)
{
	uint32_t cipher = cipher_of(state);
	static uint8_t plain[700], whole[700], parts[700];
	uint8_t key[KVBP_BULK_KEY_LEN], t1[KVBB_TAG_LEN], t2[KVBB_TAG_LEN];
	struct kvbb_aead *a = NULL;

	memset(key, 0x42, sizeof(key));
	for (size_t i = 0; i < sizeof(plain); i++)
		plain[i] = (uint8_t)(i * 131 + 17);
	assert_int_equal(kvbb_aead_new(&a, key, cipher), 0);
	for (size_t len = 0; len <= sizeof(plain); len += len < 70 ? 1 : 61) {
		struct iovec one = { plain, len };
		struct iovec many[5] = { { plain, len / 7 },
					 { plain + len / 7, len / 5 },
					 { plain + len / 7 + len / 5, 1 < len ? 1 : 0 },
					 { plain + len / 7 + len / 5 + (1 < len ? 1 : 0), 0 },
					 { plain + len / 7 + len / 5 + (1 < len ? 1 : 0),
					   len - len / 7 - len / 5 - (1 < len ? 1 : 0) } };

		assert_int_equal(kvbb_seal(a, len, 1, plain, 40, &one, 1, whole, t1), 0);
		assert_int_equal(kvbb_seal(a, len, 1, plain, 40, many, 5, parts, t2), 0);
		assert_memory_equal(parts, whole, len);
		assert_memory_equal(t1, t2, sizeof(t1));
		assert_int_equal(kvbb_open(a, len, 1, plain, 40, whole, len, t1), 0);
		assert_memory_equal(whole, plain, len);
	}
	kvbb_aead_free(&a);
}

static void test_hello(void **state)
{
	uint8_t key[KVBP_BULK_KEY_LEN], ticket[KVBP_BULK_TICKET_LEN], got[KVBP_BULK_TICKET_LEN];
	uint8_t hello[KVBB_HELLO_LEN], x[KVBB_HELLO_LEN];
	struct kvbb_aead *a = NULL, *b = NULL;
	uint32_t cipher = cipher_of(state);

	memset(key, 3, sizeof(key));
	memset(ticket, 0xcc, sizeof(ticket));
	assert_int_equal(kvbb_aead_new(&a, key, cipher), 0);
	key[0] ^= 1;
	assert_int_equal(kvbb_aead_new(&b, key, cipher), 0);
	assert_int_equal(kvbb_hello_put(hello, ticket, a), 0);
	assert_int_equal(kvbb_hello_ticket(hello, got), 0);
	assert_memory_equal(got, ticket, sizeof(ticket));
	assert_int_equal(kvbb_hello_check(hello, a), 0);
	assert_int_equal(kvbb_hello_check(hello, b), -EBADMSG); /* not who got the key */
	for (size_t pos = 0; pos < sizeof(hello); pos++) {
		memcpy(x, hello, sizeof(x));
		x[pos] ^= 4;
		assert_int_equal(kvbb_hello_check(x, a), -EBADMSG);
	}
	memcpy(x, hello, sizeof(x));
	x[4] = 2; /* another version */
	assert_int_equal(kvbb_hello_ticket(x, got), -EPROTO);
	/* without a key: the ticket alone, zeros for the tag */
	assert_int_equal(kvbb_hello_put(x, ticket, NULL), 0);
	assert_int_equal(kvbb_hello_ticket(x, got), 0);
	for (size_t i = 24; i < sizeof(x); i++)
		assert_int_equal(x[i], 0);
	kvbb_aead_free(&a);
	kvbb_aead_free(&b);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_hdr_roundtrip),
		cmocka_unit_test(test_hdr_malformed),
		cmocka_unit_test(test_seal_known_answers),
		cmocka_unit_test_prestate(test_aegis_known_answers, &aegis),
		cmocka_unit_test_prestate(test_aegis_known_answers, &aegis_x2),
		cmocka_unit_test_prestate(test_aegis_bulk_nonce, &aegis),
		cmocka_unit_test_prestate(test_aegis_bulk_nonce, &aegis_x2),
		cmocka_unit_test_prestate(test_cipher_pick, NULL),
		cmocka_unit_test_prestate(test_seal_tamper, &gcm),
		cmocka_unit_test_prestate(test_seal_tamper, &aegis),
		cmocka_unit_test_prestate(test_seal_tamper, &aegis_x2),
		cmocka_unit_test_prestate(test_seal_lengths, &gcm),
		cmocka_unit_test_prestate(test_seal_lengths, &aegis),
		cmocka_unit_test_prestate(test_seal_lengths, &aegis_x2),
		cmocka_unit_test_prestate(test_hello, &gcm),
		cmocka_unit_test_prestate(test_hello, &aegis),
		cmocka_unit_test_prestate(test_hello, &aegis_x2),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
