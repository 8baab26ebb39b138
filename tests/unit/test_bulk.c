/*
 * Unit tests of proto/bulk: record headers (round trip, every malformed field refused),
 * the seal against NIST's AES-256-GCM known answers (an independent reference), and
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

#include "bulk.h"

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
	assert_int_equal(kvbb_aead_new(&h.a, key), 0);
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

static void test_seal_tamper(void **state)
{
	uint8_t key[KVBP_BULK_KEY_LEN], other[KVBP_BULK_KEY_LEN], ad[KVBB_HDR_LEN];
	static uint8_t plain[N], ct[N], buf[N];
	uint8_t tag[KVBB_TAG_LEN], t2[KVBB_TAG_LEN];
	struct iovec iov[3] = { { plain, 1 }, { plain + 1, 2999 }, { plain + 3000, N - 3000 } };
	struct kvbb_hdr h = { 0, 7, N, 0, N };
	struct kvbb_aead *a = NULL, *b = NULL;

	(void)state;
	for (int i = 0; i < N; i++)
		plain[i] = (uint8_t)(i * 31 + 7);
	memset(key, 0x5a, sizeof(key));
	memset(other, 0xa5, sizeof(other));
	kvbb_hdr_put(ad, &h);
	assert_int_equal(kvbb_aead_new(&a, key), 0);
	assert_int_equal(kvbb_aead_new(&b, other), 0);
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
		assert_int_equal(kvbb_open(a, 9, KVBB_DIR_RECORDS, ad, sizeof(ad), buf, N, tag),
				 -EBADMSG);
	}
	/* a bit of the header (request id, offset, length, total, flags) */
	for (size_t pos = 0; pos < sizeof(ad); pos++) {
		memcpy(buf, ct, N);
		ad[pos] ^= 1;
		assert_int_equal(kvbb_open(a, 9, KVBB_DIR_RECORDS, ad, sizeof(ad), buf, N, tag),
				 -EBADMSG);
		ad[pos] ^= 1;
	}
	/* the tag */
	memcpy(t2, tag, sizeof(t2));
	t2[15] ^= 0x80;
	memcpy(buf, ct, N);
	assert_int_equal(kvbb_open(a, 9, KVBB_DIR_RECORDS, ad, sizeof(ad), buf, N, t2), -EBADMSG);
	/* the record at another place on the connection (moved, replayed), the other
	 * direction, another connection's key, cut short */
	memcpy(buf, ct, N);
	assert_int_equal(kvbb_open(a, 10, KVBB_DIR_RECORDS, ad, sizeof(ad), buf, N, tag), -EBADMSG);
	memcpy(buf, ct, N);
	assert_int_equal(kvbb_open(a, 9, KVBB_DIR_HELLO, ad, sizeof(ad), buf, N, tag), -EBADMSG);
	memcpy(buf, ct, N);
	assert_int_equal(kvbb_open(b, 9, KVBB_DIR_RECORDS, ad, sizeof(ad), buf, N, tag), -EBADMSG);
	memcpy(buf, ct, N);
	assert_int_equal(kvbb_open(a, 9, KVBB_DIR_RECORDS, ad, sizeof(ad), buf, N - 1, tag),
			 -EBADMSG);
	kvbb_aead_free(&a);
	kvbb_aead_free(&b);
}

static void test_hello(void **state)
{
	uint8_t key[KVBP_BULK_KEY_LEN], ticket[KVBP_BULK_TICKET_LEN], got[KVBP_BULK_TICKET_LEN];
	uint8_t hello[KVBB_HELLO_LEN], x[KVBB_HELLO_LEN];
	struct kvbb_aead *a = NULL, *b = NULL;

	(void)state;
	memset(key, 3, sizeof(key));
	memset(ticket, 0xcc, sizeof(ticket));
	assert_int_equal(kvbb_aead_new(&a, key), 0);
	key[0] ^= 1;
	assert_int_equal(kvbb_aead_new(&b, key), 0);
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
		cmocka_unit_test(test_seal_tamper),
		cmocka_unit_test(test_hello),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
