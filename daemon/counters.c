/* counters — the table STATS and /metrics print from; see counters.h. */
#include "daemon/counters.h"

#include <stdatomic.h>
#include <string.h>
#include <time.h>

#include "daemon/bulk.h"
#include "daemon/clients.h"
#include "daemon/fdguard.h"
#include "daemon/lane.h"
#include "daemon/shm.h"

void counters_snap(struct server *srv, struct counter_snap *s)
{
	struct timespec now, wall;

	memset(s, 0, sizeof(*s));
	s->srv = srv;
	s->have_totals = store_totals(srv->store, &s->t) == 0;
	if (!s->have_totals)
		memset(&s->t, 0, sizeof(s->t));
	s->chunk_walks = store_chunk_walks(srv->store);
	store_verify_counts(srv->store, &s->vc);
	evictor_stats(srv->evict, &s->es);
	fuse_usage(srv->fuse, &s->fuse_sessions, &s->fuse_bytes, &s->fuse_pins);
	shm_usage(srv->shm, &s->shm_n, &s->shm_bytes);
	clients_usage(srv->clients, &s->held, &s->n_clients);
	clock_gettime(CLOCK_MONOTONIC, &now);
	clock_gettime(CLOCK_REALTIME, &wall);
	s->uptime_s = (double)(now.tv_sec - srv->started.tv_sec) +
		      (double)(now.tv_nsec - srv->started.tv_nsec) / 1e9;
	s->wall_ms = (uint64_t)wall.tv_sec * 1000 + (uint64_t)wall.tv_nsec / 1000000;
	if (srv->cluster) {
		cluster_stats(srv->cluster, &s->cs);
		cluster_check_last(srv->cluster, &s->ck);
	}
	if (srv->bulk)
		bulk_counts(srv->bulk, &s->bulk);
	if (srv->lane)
		lane_counts(srv->lane, &s->lane_waiting, &s->lane_done);
	if (srv->dev) {
		srv->dev->memory(srv->dev, &s->dev_held, &s->dev_total);
		s->dev_broken = srv->dev->broken(srv->dev);
		s->dev_fallbacks = fuse_device_fallbacks(srv->fuse);
		fuse_device_counts(srv->fuse, &s->dc);
	}
}

bool counter_present(const struct counter *c, const struct counter_snap *s)
{
	switch (c->need) {
	case NEED_CLUSTER:
		return s->srv->cluster != NULL;
	case NEED_ETCD:
		return s->srv->cluster && s->cs.etcd;
	case NEED_BULK:
		return s->srv->bulk != NULL;
	case NEED_LANE:
		return s->srv->lane != NULL;
	case NEED_DEVICE:
		return s->srv->dev != NULL;
	default:
		return true;
	}
}

/* A value: one expression over the snapshot s. */
#define VALUE(name, expr)                                \
	static double name(const struct counter_snap *s) \
	{                                                \
		(void)s;                                 \
		return (double)(expr);                   \
	}
#define ATOMIC(field) atomic_load(&s->srv->stats.field)

VALUE(v_uptime, s->uptime_s)
VALUE(v_workers, s->srv->n_workers)
VALUE(v_models, s->t.models)
VALUE(v_chunks, s->t.chunks)
VALUE(v_raw, s->t.raw_bytes)
VALUE(v_stored, s->t.stored_bytes)
VALUE(v_ratio, s->t.stored_bytes ? (double)s->t.raw_bytes / (double)s->t.stored_bytes : 1.0)
VALUE(v_walks, s->chunk_walks)
VALUE(v_verified, s->vc.verified)
VALUE(v_trusted, s->vc.trusted)
VALUE(v_forgotten, s->vc.forgotten)
VALUE(v_scrubbed, s->vc.scrubbed_bytes)
VALUE(v_scrub_passes, s->vc.scrub_passes)
VALUE(v_map_size, s->t.map_size)
VALUE(v_map_used, s->t.map_used)
VALUE(v_shm_n, s->shm_n)
VALUE(v_shm_bytes, s->shm_bytes)
VALUE(v_bytes_in, ATOMIC(bytes_in))
VALUE(v_bytes_out, ATOMIC(bytes_out))
VALUE(v_hits, ATOMIC(lookup_hits))
VALUE(v_misses, ATOMIC(lookup_misses))
VALUE(v_corrupt, ATOMIC(corrupt_removed))
VALUE(v_inflight, s->held)
VALUE(v_clients, s->n_clients)
VALUE(v_connections, atomic_load(&s->srv->connections))
VALUE(v_refused, atomic_load(&s->srv->refused_clients))
VALUE(v_keys_refused, atomic_load(&s->srv->refused_keys))
VALUE(v_no_fd, fdguard_dropped())
VALUE(v_from_pages, atomic_load(&s->srv->held.count))
VALUE(v_cut_unread, atomic_load(&s->srv->held.cut))
VALUE(v_max_clients, s->srv->max_clients)
VALUE(v_lane_waiting, s->lane_waiting)
VALUE(v_lane_done, s->lane_done)
VALUE(v_bulk_open, s->bulk.open)
VALUE(v_bulk_sealed, s->bulk.sealed_records)
VALUE(v_bulk_bytes, s->bulk.bytes)
VALUE(v_bulk_opened, s->bulk.opened_records)
VALUE(v_bulk_bytes_in, s->bulk.bytes_in)
VALUE(v_capacity, s->srv->cfg->capacity)
VALUE(v_evicted, s->es.evicted)
VALUE(v_evicted_bytes, s->es.evicted_bytes)
VALUE(v_pins, s->es.pins)
VALUE(v_cache_bytes, s->es.cache_bytes)
VALUE(v_cache_reclaimed, s->es.cache_reclaimed)
VALUE(v_fuse_sessions, s->fuse_sessions)
VALUE(v_fuse_bytes, s->fuse_bytes)
VALUE(v_fuse_pins, s->fuse_pins)
VALUE(v_members, s->cs.members)
VALUE(v_suspect, s->cs.suspect)
VALUE(v_owed, s->cs.pushes_owed)
VALUE(v_pushed, s->cs.pushes_done)
VALUE(v_push_failures, s->cs.push_failures)
VALUE(v_remote_hits, s->cs.remote_hits)
VALUE(v_remote_misses, s->cs.remote_misses)
VALUE(v_fetch_failures, s->cs.fetch_failures)
VALUE(v_fetched, s->cs.fetched_bytes)
VALUE(v_fetch_ms, s->cs.fetch_ms)
VALUE(v_fetch_wire_ms, s->cs.fetch_wire_ms)
VALUE(v_fetch_s, s->cs.fetch_ms / 1e3)
VALUE(v_rebalance, s->cs.rebalance_pushes)
VALUE(v_rebalance_skipped, s->cs.rebalance_skipped)
VALUE(v_changes, s->cs.membership_changes)
VALUE(v_peer_busy, s->cs.peer_busy)
VALUE(v_hedged, s->cs.hedged)
VALUE(v_fetch_stalls, s->cs.fetch_stalls)
VALUE(v_bulk_fetches, s->cs.bulk_fetches)
VALUE(v_bulk_pushes, s->cs.bulk_pushes)
VALUE(v_etcd_ok, s->cs.etcd_ok)
VALUE(v_etcd_errors, s->cs.etcd_errors)
VALUE(v_etcd_age, s->cs.etcd_last_ok_ms ? (double)(s->wall_ms - s->cs.etcd_last_ok_ms) : -1)
VALUE(v_under, s->ck.under)
VALUE(v_beyond, s->ck.beyond)
VALUE(v_check_age, s->ck.at_ms ? (double)(s->wall_ms - s->ck.at_ms) : -1)
VALUE(v_dev_held, s->dev_held)
VALUE(v_dev_total, s->dev_total)
VALUE(v_dev_failed, s->dev_broken)
VALUE(v_dev_fallbacks, s->dev_fallbacks)
VALUE(v_dev_allocs, s->dc.allocs)
VALUE(v_dev_regs, s->dc.registrations)
VALUE(v_dev_unregs, s->dc.unregistrations)
VALUE(v_dev_pinned, s->dc.pinned_rings)
VALUE(v_dev_spares, s->dc.spares)
VALUE(v_dev_reserve, s->dc.reserve_bytes)
VALUE(v_dev_reserve_used, s->dc.reserve_used[0])
VALUE(v_pinned_reserve_used, s->dc.reserve_used[1])

#define G false /* a gauge */
#define C true	/* a counter */

const struct counter counters[] = {
	{ "uptime_seconds", "kvblend_uptime_seconds", "Seconds since start.", G, NEED_NONE,
	  v_uptime },
	{ "workers", NULL, NULL, G, NEED_NONE, v_workers },
	/* the store */
	{ "models", NULL, NULL, G, NEED_NONE, v_models },
	{ "chunks", "kvblend_chunks", "Chunks stored.", G, NEED_NONE, v_chunks },
	{ "raw_bytes", "kvblend_raw_bytes", "Bytes of chunks decoded.", G, NEED_NONE, v_raw },
	{ "stored_bytes", "kvblend_stored_bytes", "Bytes of chunks as stored (encoded).", G,
	  NEED_NONE, v_stored },
	{ "compression_ratio", "kvblend_compression_ratio", "Raw bytes over stored bytes.", G,
	  NEED_NONE, v_ratio },
	{ "store_chunk_walks", NULL, NULL, C, NEED_NONE, v_walks },
	{ "verify_checked", "kvblend_verify_checked_total",
	  "Chunk layers read whose checksums the read computed.", C, NEED_NONE, v_verified },
	{ "verify_trusted", "kvblend_verify_trusted_total",
	  "Chunk layers read without their checksums, verified earlier in the same residency "
	  "(verify=once).", C, NEED_NONE, v_trusted },
	{ "verify_forgotten", NULL, NULL, C, NEED_NONE, v_forgotten },
	{ "scrub_bytes", "kvblend_scrub_bytes_total", "Stored bytes the scrub re-verified.", C,
	  NEED_NONE, v_scrubbed },
	{ "scrub_passes", "kvblend_scrub_passes_total", "Whole passes of the scrub over the store.",
	  C, NEED_NONE, v_scrub_passes },
	{ "map_size_bytes", NULL, NULL, G, NEED_NONE, v_map_size },
	{ "map_used_bytes", "kvblend_map_used_bytes", "LMDB map in use.", G, NEED_NONE,
	  v_map_used },
	/* the cluster */
	{ "cluster_members", "kvblend_cluster_members",
	  "Members in placement, this daemon included.", G, NEED_CLUSTER, v_members },
	{ "cluster_suspect", "kvblend_cluster_suspect_members",
	  "Members skipped after a missed deadline.", G, NEED_CLUSTER, v_suspect },
	{ "cluster_pushes_owed", "kvblend_cluster_pushes_owed",
	  "Chunk copies still to send to their owners.", G, NEED_CLUSTER, v_owed },
	{ "cluster_pushes_done", "kvblend_cluster_pushes_total",
	  "Chunk copies sent to their owners.", C, NEED_CLUSTER, v_pushed },
	{ "cluster_push_failures", "kvblend_cluster_push_failures_total",
	  "Chunk copies an owner refused.", C, NEED_CLUSTER, v_push_failures },
	{ "cluster_remote_hits", "kvblend_cluster_remote_hits_total",
	  "Chunks fetched from other members.", C, NEED_CLUSTER, v_remote_hits },
	{ "cluster_remote_misses", "kvblend_cluster_remote_misses_total",
	  "Local misses no member could serve.", C, NEED_CLUSTER, v_remote_misses },
	{ "cluster_fetch_failures", "kvblend_cluster_fetch_failures_total",
	  "Fetches from a member that failed (no answer, bad bytes).", C, NEED_CLUSTER,
	  v_fetch_failures },
	{ "cluster_fetched_bytes", "kvblend_cluster_fetched_bytes_total",
	  "Stored bytes fetched from members.", C, NEED_CLUSTER, v_fetched },
	{ "cluster_fetch_ms", NULL, NULL, C, NEED_CLUSTER, v_fetch_ms },
	{ "cluster_fetch_wire_ms", NULL, NULL, C, NEED_CLUSTER, v_fetch_wire_ms },
	{ NULL, "kvblend_cluster_fetch_seconds_total", "Time in successful fetches.", C,
	  NEED_CLUSTER, v_fetch_s },
	{ "cluster_rebalance_pushes", "kvblend_cluster_rebalance_pushes_total",
	  "Chunk copies sent to members that joined or returned.", C, NEED_CLUSTER,
	  v_rebalance },
	{ "cluster_rebalance_skipped", NULL, NULL, C, NEED_CLUSTER, v_rebalance_skipped },
	{ "cluster_membership_changes", "kvblend_cluster_membership_changes_total",
	  "Changes of the membership seen.", C, NEED_CLUSTER, v_changes },
	{ "cluster_peer_busy", NULL, NULL, C, NEED_CLUSTER, v_peer_busy },
	{ "cluster_hedged", "kvblend_cluster_hedged_total",
	  "Fetches that also asked the next member after cluster_hedge_ms.", C, NEED_CLUSTER,
	  v_hedged },
	{ "cluster_fetch_stalls", "kvblend_cluster_fetch_stalls_total",
	  "Fetch payloads given up after cluster_hedge_ms without a byte, for the next member.",
	  C, NEED_CLUSTER, v_fetch_stalls },
	{ "cluster_bulk_fetches", "kvblend_cluster_bulk_fetches_total",
	  "Chunks fetched from members whose bytes came on a bulk connection.", C, NEED_CLUSTER,
	  v_bulk_fetches },
	{ "cluster_bulk_pushes", "kvblend_cluster_bulk_pushes_total",
	  "Chunks pushed to members whose bytes went on a bulk connection.", C, NEED_CLUSTER,
	  v_bulk_pushes },
	{ "cluster_etcd_ok", "kvblend_cluster_etcd_up", "Whether etcd answered the last call.",
	  G, NEED_ETCD, v_etcd_ok },
	{ "cluster_etcd_errors", NULL, NULL, C, NEED_ETCD, v_etcd_errors },
	{ "cluster_etcd_last_ok_age_ms", NULL, NULL, G, NEED_ETCD, v_etcd_age },
	{ "cluster_under_replicated", "kvblend_cluster_under_replicated_chunks",
	  "Chunks with fewer than cluster_replicas copies among their owners, counted here at "
	  "the last replication check (kvblend cluster check, repair passes).", G, NEED_CLUSTER,
	  v_under },
	{ "cluster_copies_beyond_r", "kvblend_cluster_copies_beyond_r",
	  "Chunks held here that this member does not own (copies beyond R), at the last "
	  "replication check.", G, NEED_CLUSTER, v_beyond },
	{ "cluster_check_age_ms", NULL, NULL, G, NEED_CLUSTER, v_check_age },
	/* the server */
	{ "shm_segments", "kvblend_shm_segments", "Shared-memory segments of clients.", G,
	  NEED_NONE, v_shm_n },
	{ "shm_bytes", NULL, NULL, G, NEED_NONE, v_shm_bytes },
	{ "bytes_in", "kvblend_received_bytes_total", "Bytes of requests received.", C,
	  NEED_NONE, v_bytes_in },
	{ "bytes_out", "kvblend_sent_bytes_total", "Bytes of replies sent over sockets.", C,
	  NEED_NONE, v_bytes_out },
	{ "lookup_hits", "kvblend_lookup_hits_total", "Lookups of stored chunks.", C, NEED_NONE,
	  v_hits },
	{ "lookup_misses", "kvblend_lookup_misses_total", "Lookups of chunks not stored.", C,
	  NEED_NONE, v_misses },
	{ "corrupt_removed", "kvblend_corrupt_removed_total",
	  "Chunks that failed a checksum and were removed.", C, NEED_NONE, v_corrupt },
	{ "inflight_bytes", NULL, NULL, G, NEED_NONE, v_inflight },
	{ "clients", NULL, NULL, G, NEED_NONE, v_clients },
	{ "connections", NULL, NULL, G, NEED_NONE, v_connections },
	{ "connections_refused", NULL, NULL, C, NEED_NONE, v_refused },
	{ "curve_keys_refused", NULL, NULL, C, NEED_NONE, v_keys_refused },
	{ "connections_dropped_no_fd", NULL, NULL, C, NEED_NONE, v_no_fd },
	{ "replies_from_pages", NULL, NULL, G, NEED_NONE, v_from_pages },
	{ "connections_cut_unread", NULL, NULL, C, NEED_NONE, v_cut_unread },
	{ "max_clients", NULL, NULL, G, NEED_NONE, v_max_clients },
	{ "lane_waiting", NULL, NULL, G, NEED_LANE, v_lane_waiting },
	{ "lane_done", NULL, NULL, C, NEED_LANE, v_lane_done },
	{ "bulk_connections", NULL, NULL, G, NEED_BULK, v_bulk_open },
	{ "bulk_records_sealed", NULL, NULL, C, NEED_BULK, v_bulk_sealed },
	{ "bulk_bytes", NULL, NULL, C, NEED_BULK, v_bulk_bytes },
	{ "bulk_records_opened", NULL, NULL, C, NEED_BULK, v_bulk_opened },
	{ "bulk_bytes_received", NULL, NULL, C, NEED_BULK, v_bulk_bytes_in },
	/* eviction and the fuse engine */
	{ "capacity_bytes", "kvblend_capacity_bytes", "Configured capacity (0: none).", G,
	  NEED_NONE, v_capacity },
	{ "evictions", "kvblend_evictions_total", "Chunks evicted.", C, NEED_NONE, v_evicted },
	{ "evicted_bytes", "kvblend_evicted_bytes_total", "Stored bytes freed by eviction.", C,
	  NEED_NONE, v_evicted_bytes },
	{ "pinned_chunks", "kvblend_pinned_chunks", "Chunks pinned against eviction with a TTL.",
	  G, NEED_NONE, v_pins },
	{ "cluster_cache_bytes", "kvblend_cluster_cache_bytes",
	  "Stored bytes of cache copies (chunks held here, owned elsewhere).", G, NEED_CLUSTER,
	  v_cache_bytes },
	{ "cluster_cache_reclaimed", "kvblend_cluster_cache_reclaimed_total",
	  "Cache copies evicted once their owners held them.", C, NEED_CLUSTER,
	  v_cache_reclaimed },
	{ "fuse_sessions", "kvblend_fuse_sessions", "Open fuse sessions.", G, NEED_NONE,
	  v_fuse_sessions },
	{ "fuse_ring_bytes", "kvblend_fuse_ring_bytes", "Memory held by fuse sessions' rings.",
	  G, NEED_NONE, v_fuse_bytes },
	{ "fuse_pinned_chunks", NULL, NULL, G, NEED_NONE, v_fuse_pins },
	/* the device */
	{ "device_memory_bytes", "kvblend_device_memory_bytes",
	  "Device memory the fuse holds on its device.", G, NEED_DEVICE, v_dev_held },
	{ "device_memory_total_bytes", "kvblend_device_memory_total_bytes",
	  "The CUDA device's memory.", G, NEED_DEVICE, v_dev_total },
	{ "device_failed", "kvblend_device_failed",
	  "1 once the device failed for good (a sticky error): new fuse sessions run on the CPU "
	  "until a restart.", G, NEED_DEVICE, v_dev_failed },
	{ "fuse_device_fallbacks", "kvblend_fuse_device_fallbacks_total",
	  "Fuse sessions that ran on the host path though the daemon has a device: its budget "
	  "(fuse_device_max_bytes) was full, its memory short, or it had failed.", C,
	  NEED_DEVICE, v_dev_fallbacks },
	{ "fuse_device_allocs", "kvblend_fuse_device_allocs_total",
	  "Device and pinned host blocks the fuse allocated because its pools had none to give "
	  "(a session's open allocates none once they are warm).", C, NEED_DEVICE, v_dev_allocs },
	{ "fuse_device_registrations", "kvblend_fuse_device_registrations_total",
	  "Shared rings pinned in place for the device (cudaHostRegister): once per segment, "
	  "not per session.", C, NEED_DEVICE, v_dev_regs },
	{ "fuse_device_unregistrations", "kvblend_fuse_device_unregistrations_total",
	  "Shared rings unpinned, before their segment is unmapped.", C, NEED_DEVICE,
	  v_dev_unregs },
	{ "fuse_device_pinned_rings", "kvblend_fuse_device_pinned_rings",
	  "Shared rings pinned now (in use, or kept for their owner's next session).", G,
	  NEED_DEVICE, v_dev_pinned },
	{ "fuse_device_spares", "kvblend_fuse_device_spares_total",
	  "Spare blocks allocated off the sessions' path, for the next session of a shape an "
	  "open had to allocate for.", C, NEED_DEVICE, v_dev_spares },
	{ "fuse_device_reserve_bytes", NULL, NULL, G, NEED_DEVICE, v_dev_reserve },
	{ "fuse_device_reserve_used_bytes", "kvblend_fuse_device_reserve_used_bytes",
	  "Bytes of the device reserve (fuse_device_reserve) sessions hold.", G, NEED_DEVICE,
	  v_dev_reserve_used },
	{ "fuse_pinned_reserve_used_bytes", NULL, NULL, G, NEED_DEVICE, v_pinned_reserve_used },
};

const size_t n_counters = sizeof(counters) / sizeof(counters[0]);
