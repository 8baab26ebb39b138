/*
 * data_file — tamper with a store's data file (DIR/data.mdb) as another writer would, for
 * the tests that check that the store (or the daemon over it) catches it. Asserts with
 * cmocka.
 */
#ifndef KVBLEND_TESTS_DATA_FILE_H
#define KVBLEND_TESTS_DATA_FILE_H

#include <stdbool.h>
#include <stdint.h>

/*
 * Flip a bit (0x10) of the first byte where needle (16 bytes of a stored tensor) stands
 * in dir/data.mdb, at the first place or, with every, at all of them (older copies
 * LMDB's later transactions left in free pages too), with pwrite() while the store is
 * open: its map sees the page cache change. Asserts at least one place; returns how many.
 */
int flip_in_data_file(const char *dir, const uint8_t *needle, bool every);

#endif
