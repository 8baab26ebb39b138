/*
 * evict — keeps the store within its capacity: least recently used chunks are
 * evicted in the background once the stored bytes pass the high watermark,
 * down to the low one; a PUT that finds the LMDB map full makes room the same
 * way and retries. Accesses are recorded in memory (no write transaction per
 * read); chunks pinned by open fuse sessions or by an explicit pin with a TTL
 * are never evicted. Thread-safe.
 *
 * The order is least recent access first; chunks not read since the daemon
 * started come before all others, oldest first. Tenants (tenants.h) with a
 * capacity of their own are kept within it the same way, from their own chunks,
 * and while within it lose none to another namespace's pressure. In a cluster,
 * cache copies of other members' chunks go before owned chunks, and are held to
 * a budget of their own (evictor_set_cache).
 */
#ifndef KVBLEND_DAEMON_EVICT_H
#define KVBLEND_DAEMON_EVICT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "store/store.h"
#include "daemon/fuse/fuse.h"
#include "daemon/tenants.h"

struct evictor;

struct evict_stats {
	uint64_t evicted;	/* chunks */
	uint64_t evicted_bytes; /* stored bytes freed */
	uint64_t passes;
	uint64_t pins;		/* explicit pins in force */
	uint64_t cache_bytes;	/* cache copies' stored bytes at the last cache pass */
	uint64_t cache_reclaimed; /* cache copies evicted once their owners held them */
};

/*
 * capacity 0: no background eviction (a full map still makes room). high and low
 * are percentages of capacity, low < high, and of each tenant's own capacity
 * (tenants, borrowed; NULL for none). Starts the background thread.
 */
int evictor_new(struct store *store, struct fuse_table *fuse, const struct tenants *tenants,
		uint64_t capacity, unsigned high_pct, unsigned low_pct, struct evictor **out);
/* Stop the thread and free. Accepts NULL. */
void evictor_free(struct evictor **e);

/* Record an access (a GET, a lookup hit, a PUT, a fuse open). */
void evictor_touch(struct evictor *e, uint32_t model_id, const uint8_t *hash);
/* Ask the background thread to check the watermark now (after a PUT). */
void evictor_kick(struct evictor *e);

/* Pin a chunk against eviction for ttl_s seconds (a later pin replaces the TTL). */
int evictor_pin(struct evictor *e, uint32_t model_id, const uint8_t *hash, uint32_t ttl_s);
/* Remove a pin. Returns 0 or -ENOENT. */
int evictor_unpin(struct evictor *e, uint32_t model_id, const uint8_t *hash);

/*
 * Evict least recently used chunks until about `bytes` of stored data are
 * freed (for a PUT of namespace ns, "" the default, that found the map full):
 * never chunks of a tenant within its own capacity, unless ns is that tenant.
 * Returns the bytes freed, or -ENOSPC when nothing could be evicted.
 */
int64_t evictor_make_room(struct evictor *e, uint64_t bytes, const char *ns);

void evictor_stats(struct evictor *e, struct evict_stats *out);

/*
 * In a cluster: owns(ctx, hash) says whether this daemon owns a chunk; the
 * chunks it does not own (cache copies fetched from other members) are evicted
 * before all owned ones, least recently used first among each.
 */
void evictor_set_owner(struct evictor *e, bool (*owns)(void *ctx, const uint8_t *hash),
		       void *ctx);

/*
 * hold(ctx, model_id, hashes, n, held): for n cache copies of one model, whether
 * every owner is known to hold each (held[i]); ctx is evictor_set_owner's. With
 * it, cache copies are kept within budget bytes of their own: a cache pass
 * (after chunks arrive, at most every CACHE_PASS_S seconds, and every
 * CACHE_IDLE_S) evicts the least recently used beyond the budget, each only once
 * its owners hold it; one they lack stays (their pushes, rebalance or the repair
 * pass bring it to them) and the pass comes again after CACHE_PASS_S. hold is
 * called without the evictor's locks (it asks other members).
 */
typedef void (*evict_hold_fn)(void *ctx, uint32_t model_id,
			      const uint8_t (*hashes)[STORE_HASH_LEN], size_t n, bool *held);
void evictor_set_cache(struct evictor *e, evict_hold_fn hold, uint64_t budget);

#endif
