/*
 * Unit tests of cluster/record: member records as etcd holds them. Anyone who can
 * write to the cluster's prefix can write anything there (issue 19: a record whose
 * endpoint was JSON null crashed every daemon watching), so every malformed
 * record must be refused with a reason and leave the output untouched. And the
 * cluster's pusher's wait (cluster_impl.h), a pure function.
 */
#include <errno.h>
#include <setjmp.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cmocka.h>

#include "cluster/cluster_impl.h"
#include "cluster/record.h"

#define KEY "rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]yf7"

static int parse(const char *json, struct member_record *r, char *err, size_t errlen)
{
	return record_parse(json, strlen(json), r, err, errlen);
}

static void test_good_records(void **state)
{
	struct member_record r;
	char err[200] = "";

	(void)state;
	assert_int_equal(parse("{\"id\":\"n1\",\"endpoint\":\"tcp://10.0.0.1:7001\",\"curve_public_key\":"
			       "\"" KEY "\",\"capacity\":1073741824,\"version\":\"0.9\"}",
			       &r, err, sizeof(err)), 0);
	assert_string_equal(r.endpoint, "tcp://10.0.0.1:7001");
	assert_string_equal(r.key, KEY);
	assert_int_equal(r.capacity, 1073741824);
	assert_string_equal(r.version, "0.9");
	/* no key, no id, no version, and a field from a newer daemon */
	assert_int_equal(parse("{\"endpoint\":\"tcp://h:1\",\"capacity\":5,\"zone\":[1,{}]}", &r, err,
			       sizeof(err)), 0);
	assert_string_equal(r.key, "");
	assert_string_equal(r.version, "");
	assert_int_equal(parse("{\"endpoint\":\"tcp://h:1\",\"curve_public_key\":\"\",\"capacity\":5}",
			       &r, err, sizeof(err)), 0);
}

/* Each bad record: -EINVAL, a reason naming the problem, *out unchanged. */
static void test_bad_records(void **state)
{
	static const struct {
		const char *json, *reason;
	} bad[] = {
		{ "{\"endpoint\":null,\"capacity\":5}", "\"endpoint\" is null" },
		{ "{\"endpoint\":\"tcp://h:1\",\"curve_public_key\":null,\"capacity\":5}",
		  "\"curve_public_key\" is null" },
		{ "{\"endpoint\":\"tcp://h:1\",\"capacity\":null}", "\"capacity\" must be" },
		{ "{\"endpoint\":\"tcp://h:1\",\"capacity\":\"5\"}", "\"capacity\" must be" },
		{ "{\"endpoint\":\"tcp://h:1\",\"capacity\":5.5}", "\"capacity\" must be" },
		{ "{\"endpoint\":\"tcp://h:1\",\"capacity\":0}", "\"capacity\" must be" },
		{ "{\"endpoint\":\"tcp://h:1\",\"capacity\":-3}", "\"capacity\" must be" },
		{ "{\"endpoint\":\"tcp://h:1\"}", "no \"capacity\"" },
		{ "{\"capacity\":5}", "no \"endpoint\"" },
		{ "{\"endpoint\":7,\"capacity\":5}", "\"endpoint\" is int" },
		{ "{\"endpoint\":[\"tcp://h:1\"],\"capacity\":5}", "\"endpoint\" is array" },
		{ "{\"endpoint\":{},\"capacity\":5}", "\"endpoint\" is object" },
		{ "{\"endpoint\":true,\"capacity\":5}", "\"endpoint\" is boolean" },
		{ "{\"endpoint\":\"http://h:1\",\"capacity\":5}", "is not tcp://HOST:PORT" },
		{ "{\"endpoint\":\"tcp://a:1,tcp://b:2\",\"capacity\":5}", "is not tcp://HOST:PORT" },
		{ "{\"endpoint\":\"tcp://a:1\\u0000x\",\"capacity\":5}", "is not tcp://HOST:PORT" },
		{ "{\"endpoint\":\"tcp://h:1\",\"curve_public_key\":\"short\",\"capacity\":5}",
		  "not empty nor 40 Z85" },
		{ "{\"endpoint\":\"tcp://h:1\",\"curve_public_key\":\"rq:rM>}U?@Lns47E1%kR.o@n%FcmmsL/@{H8]y\\\"7\","
		  "\"capacity\":5}", "not empty nor 40 Z85" },
		{ "{\"endpoint\":\"tcp://h:1\",\"curve_public_key\":7,\"capacity\":5}",
		  "\"curve_public_key\" is int" },
		{ "{\"endpoint\":\"tcp://h:1\",\"capacity\":5,\"id\":null}", "\"id\" is null" },
		{ "{\"endpoint\":\"tcp://h:1\",\"capacity\":5,\"version\":{}}", "\"version\" is object" },
		{ "null", "not a JSON object" },
		{ "[1,2]", "not a JSON object" },
		{ "\"tcp://h:1\"", "not a JSON object" },
		{ "42", "not a JSON object" },
		{ "", "not JSON" },
		{ "{\"endpoint\":\"tcp://h:1\",\"capacity\":5", "not JSON" },
		{ "{endpoint:tcp}", "not JSON" },
	};
	struct member_record r, before;
	char err[200];

	(void)state;
	memset(&before, 0xa5, sizeof(before));
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
		r = before;
		err[0] = 0;
		if (parse(bad[i].json, &r, err, sizeof(err)) != -EINVAL)
			fail_msg("accepted: %s", bad[i].json);
		if (!strstr(err, bad[i].reason))
			fail_msg("%s: reason '%s', expected it to say '%s'", bad[i].json, err,
				 bad[i].reason);
		assert_memory_equal(&r, &before, sizeof(r));
	}
	/* an endpoint as long as fits, and one longer */
	{
		char json[600], ep[300];

		memset(ep, 'a', sizeof(ep));
		memcpy(ep, "tcp://", 6);
		ep[RECORD_ENDPOINT_MAX] = 0;
		snprintf(json, sizeof(json), "{\"endpoint\":\"%s\",\"capacity\":1}", ep);
		assert_int_equal(parse(json, &r, err, sizeof(err)), -EINVAL);
		assert_non_null(strstr(err, "at most 255"));
		ep[RECORD_ENDPOINT_MAX - 1] = 0;
		snprintf(json, sizeof(json), "{\"endpoint\":\"%s\",\"capacity\":1}", ep);
		assert_int_equal(parse(json, &r, err, sizeof(err)), 0);
	}
	/* no room for a reason is fine */
	assert_int_equal(parse("null", &r, NULL, 0), -EINVAL);
}

/* Not NUL-terminated: only len bytes are read. */
static void test_length_bounded(void **state)
{
	const char *json = "{\"endpoint\":\"tcp://h:1\",\"capacity\":5}";
	size_t n = strlen(json);
	char *exact = malloc(n);
	struct member_record r;
	char err[200];

	(void)state;
	assert_non_null(exact);
	memcpy(exact, json, n);
	assert_int_equal(record_parse(exact, n, &r, err, sizeof(err)), 0);
	assert_int_equal(record_parse(exact, n - 1, &r, err, sizeof(err)), -EINVAL);
	free(exact);
}

static void test_format_round_trip(void **state)
{
	struct member_record r = { .endpoint = "tcp://host-1:7001", .key = KEY,
				   .capacity = 3ull << 40, .version = "1.2.3" }, back;
	char buf[1024], err[200];
	int n;

	(void)state;
	n = record_format("n1", &r, buf, sizeof(buf));
	assert_true(n > 0);
	assert_int_equal(record_parse(buf, (size_t)n, &back, err, sizeof(err)), 0);
	assert_memory_equal(&back, &r, sizeof(r));
	assert_int_equal(record_format("n1", &r, buf, 10), -ENOSPC);
}

/*
 * The pusher's sleep when every queued push waits: until the rebalance rate allows
 * the next one, not a fixed 100 ms poll (which held a join to one push per 100 ms
 * and sender whatever cluster_rebalance_rate allowed).
 */
static void test_push_wait(void **state)
{
	const int64_t ms = 1000000, t = 1000 * ms;

	(void)state;
	/* one waits for the rate (others may wait for peers): until it allows */
	assert_int_equal(push_wait_ns(true, t + ms / 2, t), ms / 2);
	/* the rate allows already: at once (1 ns, a wait that returns) */
	assert_int_equal(push_wait_ns(true, t - 5 * ms, t), 1);
	assert_int_equal(push_wait_ns(true, t, t), 1);
	/* a rate far behind (a huge push at a low rate): polled every 100 ms still */
	assert_int_equal(push_wait_ns(true, t + 7000 * ms, t), 100 * ms);
	/* none waits for the rate (peers suspect or gone, or the queue empty): 100 ms */
	assert_int_equal(push_wait_ns(false, t + ms / 2, t), 100 * ms);
	assert_int_equal(push_wait_ns(false, t - ms, t), 100 * ms);
}

int main(void)
{
	const struct CMUnitTest tests[] = {
		cmocka_unit_test(test_good_records),
		cmocka_unit_test(test_bad_records),
		cmocka_unit_test(test_length_bounded),
		cmocka_unit_test(test_format_round_trip),
		cmocka_unit_test(test_push_wait),
	};

	return cmocka_run_group_tests(tests, NULL, NULL);
}
