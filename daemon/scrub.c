/* scrub — the store's background re-verification; see scrub.h. */
#include "daemon/scrub.h"

#include <errno.h>
#include <pthread.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "daemon/log.h"

#define TICK_NS 100000000ull /* each tick checks a tenth of a second's worth */

struct scrubber {
	struct store *store;
	uint64_t rate;
	void (*corrupt)(void *ctx, uint32_t model_id, const uint8_t *hash);
	void *ctx;
	pthread_t thread;
	pthread_mutex_t lock;
	pthread_cond_t cond;
	bool stop;
};

static uint64_t now_ns(void)
{
	struct timespec ts;

	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

/* Sleep until `until` (monotonic ns) or a stop; whether to go on. */
static bool nap(struct scrubber *sc, uint64_t until)
{
	struct timespec ts = { (time_t)(until / 1000000000ull), (long)(until % 1000000000ull) };
	bool go;

	pthread_mutex_lock(&sc->lock);
	while (!sc->stop && now_ns() < until)
		pthread_cond_timedwait(&sc->cond, &sc->lock, &ts);
	go = !sc->stop;
	pthread_mutex_unlock(&sc->lock);
	return go;
}

static void *scrub_main(void *arg)
{
	struct scrubber *sc = arg;
	struct store_scrub pos = { 0 };
	uint64_t budget = sc->rate / (1000000000ull / TICK_NS), t = now_ns();
	bool warned = false;

	if (!budget)
		budget = 1;
	while (nap(sc, t)) {
		int64_t r = store_scrub(sc->store, &pos, budget, sc->corrupt, sc->ctx);

		if (r < 0 && !warned) {
			log_warn("scrub: reading the store failed (%s); retrying each tick",
				 strerror((int)-r));
			warned = true;
		} else if (r >= 0) {
			warned = false;
		}
		/* The time those bytes are worth at the rate, at least one tick's pause when
		 * the store is empty or the pass ended early. */
		t = now_ns();
		if (r > 0)
			t += (uint64_t)r * 1000000000ull / sc->rate;
		else
			t += TICK_NS;
	}
	return NULL;
}

int scrubber_new(struct store *store, uint64_t bytes_per_s,
		 void (*corrupt)(void *ctx, uint32_t model_id, const uint8_t *hash), void *ctx,
		 struct scrubber **out)
{
	struct scrubber *sc;
	pthread_condattr_t ca;
	int rc;

	if (!bytes_per_s)
		return -EINVAL;
	sc = calloc(1, sizeof(*sc));
	if (!sc)
		return -ENOMEM;
	sc->store = store;
	sc->rate = bytes_per_s;
	sc->corrupt = corrupt;
	sc->ctx = ctx;
	pthread_mutex_init(&sc->lock, NULL);
	pthread_condattr_init(&ca);
	pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
	pthread_cond_init(&sc->cond, &ca);
	pthread_condattr_destroy(&ca);
	rc = -pthread_create(&sc->thread, NULL, scrub_main, sc);
	if (rc) {
		pthread_cond_destroy(&sc->cond);
		pthread_mutex_destroy(&sc->lock);
		free(sc);
		return rc;
	}
	*out = sc;
	return 0;
}

void scrubber_free(struct scrubber **sp)
{
	struct scrubber *sc = sp ? *sp : NULL;

	if (!sc)
		return;
	pthread_mutex_lock(&sc->lock);
	sc->stop = true;
	pthread_cond_signal(&sc->cond);
	pthread_mutex_unlock(&sc->lock);
	pthread_join(sc->thread, NULL);
	pthread_cond_destroy(&sc->cond);
	pthread_mutex_destroy(&sc->lock);
	free(sc);
	*sp = NULL;
}
