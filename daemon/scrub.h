/*
 * scrub — a background thread that re-verifies the store's chunks at a bounded
 * rate (store_scrub(), in a loop over the store), so that damage nobody reads
 * is found too, and layers trusted under verify=once are checked again within a
 * pass. A corrupt chunk is handed to the owner's callback (which removes and
 * counts it as a read would).
 */
#ifndef KVBLEND_DAEMON_SCRUB_H
#define KVBLEND_DAEMON_SCRUB_H

#include <stdint.h>

#include "store/store.h"

struct scrubber;

/* Start the thread: bytes_per_s of stored data checked per second (> 0). */
int scrubber_new(struct store *store, uint64_t bytes_per_s,
		 void (*corrupt)(void *ctx, uint32_t model_id, const uint8_t *hash), void *ctx,
		 struct scrubber **out);
/* Stop the thread (within one tick) and free. Accepts NULL. */
void scrubber_free(struct scrubber **sp);

#endif
