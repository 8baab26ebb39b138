/*
 * fixture — the cmocka table entry of a test that runs on a fresh fixture: a test file
 * whose tests each start from the same state defines static setup() and teardown()
 * (cmocka's signatures) and lists its tests as fixture_test(test_name). Include after
 * <cmocka.h>.
 */
#ifndef KVBLEND_TESTS_FIXTURE_H
#define KVBLEND_TESTS_FIXTURE_H

#define fixture_test(f) cmocka_unit_test_setup_teardown(f, setup, teardown)

#endif
