/*
 * verified — the layer values read and found sound since their pages were last
 * read from disk ("verify once per residency", docs/storage.md#verification).
 *
 * An entry is a 64-bit fingerprint of a layer value: its key, where it sits in
 * the map, its length and both tensors' checksums. A value that moved, was
 * rewritten or was replaced has another fingerprint, so it is verified again.
 * An entry counts only while
 *   - it is younger than the time to live (the kernel may have dropped and
 *     re-read the pages without the store seeing it: the age bound limits that);
 *   - every page of the value is resident at the read (mincore(): a page not
 *     resident is read from disk by this access, so the bytes must be checked);
 *   - the epoch it was added in is current: st_verified_clear() starts a new one
 *     (someone else wrote the data file).
 * Entries are dropped when their chunk is deleted or evicted. The table has a
 * fixed size (4-way buckets); a full bucket forgets its oldest entry, which then
 * is simply verified again. Thread-safe.
 */
#ifndef KVBLEND_STORE_VERIFIED_H
#define KVBLEND_STORE_VERIFIED_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct st_verified;

/* A table of about `entries` entries that live ttl_s seconds; NULL when out of memory. */
struct st_verified *st_verified_new(size_t entries, unsigned ttl_s);
void st_verified_free(struct st_verified *t);

/* Whether every page of [p, p + len) is in the page cache now. */
bool st_resident(const void *p, size_t len);

bool st_verified_has(struct st_verified *t, uint64_t fp);
void st_verified_add(struct st_verified *t, uint64_t fp);
void st_verified_drop(struct st_verified *t, uint64_t fp);

/* Forget every entry (a new epoch). */
void st_verified_clear(struct st_verified *t);

#endif
