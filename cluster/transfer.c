/*
 * transfer — the cluster's calls between members (see cluster.h): a pool of
 * sockets per peer and one call with a deadline, the read path (fetch, lookup)
 * and the write path (the push queue and its thread).
 */
#include "cluster/cluster_impl.h"

#include <errno.h>
#include <inttypes.h>
#include <limits.h>
#include <pthread.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/ckd.h"

/* ---- calls to a peer ---- */

static struct psock *sock_get(struct cluster *c, struct peer *p)
{
	struct psock *ps = NULL;
	char endpoint[CLUSTER_ENDPOINT_MAX], key[41];

	pthread_mutex_lock(&p->lock);
	if (p->n_idle)
		ps = p->idle[--p->n_idle];
	memcpy(endpoint, p->endpoint, sizeof(endpoint));
	memcpy(key, p->key, sizeof(key));
	pthread_mutex_unlock(&p->lock);
	return ps ? ps : psock_new(c, endpoint, key);
}

static void sock_put(struct peer *p, struct psock *ps, bool good)
{
	pthread_mutex_lock(&p->lock);
	if (good && !ps->spoilt && p->n_idle < POOL) {
		p->idle[p->n_idle++] = ps;
		ps = NULL;
	}
	pthread_mutex_unlock(&p->lock);
	psock_free(ps); /* a late reply can never answer a later call */
}

void call_out_free(struct call_out *o)
{
	for (size_t i = 0; i < o->n_frames; i++)
		zmq_msg_close(&o->frames[i]);
	free(o->frames);
	free(o->bulk);
	o->bulk = NULL;
	o->frames = NULL;
	o->n_frames = 0;
	kvbp_reply_clear(&o->rep);
}

/* One call under way to a peer: the socket it went out on and the reply it waits for. */
struct call {
	struct peer *p;
	struct psock *ps;
	uint64_t id;
	int64_t deadline; /* ms, monotonic */
};

static void call_end(struct cluster *c, struct call *cl, int rc);

/*
 * Send req (and its payload frames) to p; with bulk, asking for the reply's payload on
 * the socket's bulk connection when it has one. Returns 0 with cl under way (call_end
 * must follow), or -EBUSY (the in-flight cap; p not marked), -EIO (p marked
 * when the send failed) or -ENOMEM, the call then over.
 */
static int call_send(struct cluster *c, struct peer *p, struct kvbp_request *req,
		     const void *const *frames, const size_t *lens, size_t n_frames, bool bulk,
		     struct call *cl)
{
	uint8_t *hdr = NULL;
	uint64_t *parts = NULL;
	size_t hlen;
	bool on_bulk;
	int rc = 0;

	if (atomic_fetch_add(&p->in_flight, 1) >= PEER_INFLIGHT_MAX) {
		atomic_fetch_sub(&p->in_flight, 1);
		atomic_fetch_add(&c->peer_busy, 1);
		return -EBUSY; /* the peer is not marked: it is busy, not gone */
	}
	cl->p = p;
	cl->deadline = now_ms() + c->timeout_ms;
	cl->ps = sock_get(c, p);
	if (!cl->ps) {
		/* a new socket's HELLO (bulk.c) went unanswered: as a call that missed its
		 * deadline, the peer is skipped for a while */
		atomic_store(&p->suspect_until, now_ms() + SUSPECT_MS);
		cl_warn(c, "cluster: member '%s': no answer to a new connection's HELLO within "
			"cluster_timeout_ms; skipped for %d ms", p->id, SUSPECT_MS);
		atomic_fetch_sub(&p->in_flight, 1);
		return -EIO;
	}
	/* a payload goes on the bulk connection when the peer takes it there (bulk_put) */
	req->has_bulk_ticket = bulk && cl->ps->fd >= 0 && (!n_frames || cl->ps->put);
	if (req->has_bulk_ticket) {
		memcpy(req->bulk_ticket, cl->ps->ticket, sizeof(req->bulk_ticket));
		if (n_frames && !(parts = malloc(n_frames * sizeof(*parts)))) {
			sock_put(p, cl->ps, true);
			atomic_fetch_sub(&p->in_flight, 1);
			return -ENOMEM;
		}
		for (size_t i = 0; parts && i < n_frames; i++)
			parts[i] = lens[i];
		req->bulk_parts = parts;
		req->n_bulk_parts = parts ? n_frames : 0;
	}
	on_bulk = req->has_bulk_ticket && n_frames;
	req->version = KVBP_VERSION;
	req->request_id = cl->id = atomic_fetch_add(&c->next_id, 1) + 1;
	req->local_only = true; /* the peer answers from its own store: no call back */
	req->payload_frames = on_bulk ? 0 : (uint32_t)n_frames;
	rc = kvbp_request_encode(req, &hdr, &hlen) ? -ENOMEM : 0;
	req->bulk_parts = NULL; /* the caller's request never points at parts freed here */
	req->n_bulk_parts = 0;
	free(parts);
	if (rc) {
		sock_put(p, cl->ps, true);
		atomic_fetch_sub(&p->in_flight, 1);
		return rc;
	}
	if (zmq_send(cl->ps->s, "", 0, ZMQ_SNDMORE | ZMQ_DONTWAIT) < 0 ||
	    zmq_send(cl->ps->s, hdr, hlen, (n_frames && !on_bulk ? ZMQ_SNDMORE : 0) |
		     ZMQ_DONTWAIT) < 0)
		rc = -EIO;
	free(hdr);
	for (size_t i = 0; !rc && !on_bulk && i < n_frames; i++)
		if (zmq_send(cl->ps->s, frames[i], lens[i],
			     (i + 1 < n_frames ? ZMQ_SNDMORE : 0) | ZMQ_DONTWAIT) < 0)
			rc = -EIO;
	if (!rc && on_bulk) {
		int brc = psock_send_payload(cl->ps, cl->id, frames, lens, n_frames,
					     cl->deadline);

		/* the peer may have refused the request and cut the connection before
		 * reading (its reply says why), or fallen behind: the connection is out of
		 * step either way, and the reply or the deadline ends the call */
		if (brc) {
			cl_warn(c, "cluster: member '%s': the bulk connection %s mid-payload",
				p->id, brc == -ETIMEDOUT ? "timed out" : "closed");
			cl->ps->spoilt = true;
		}
	}
	if (rc)
		call_end(c, cl, rc); /* (call_end is defined below) */
	return rc;
}

/*
 * Read one reply off cl's socket (readable). Returns 0 with out filled (the
 * reply to this call), 1 for someone else's late reply (out empty: keep
 * waiting), or -EIO / -ENOMEM.
 */
static int call_recv(struct call *cl, struct call_out *out)
{
	zmq_msg_t parts[2];
	size_t np = 0, cap = 0;
	int more = 1, rc = 0;
	char derr[128];

	memset(out, 0, sizeof(*out));
	for (; more && np < 2; np++) {
		zmq_msg_init(&parts[np]);
		if (zmq_msg_recv(&parts[np], cl->ps->s, ZMQ_DONTWAIT) < 0) {
			zmq_msg_close(&parts[np]);
			rc = np == 0 && zmq_errno() == EAGAIN ? 1 : -EIO;
			break;
		}
		more = zmq_msg_more(&parts[np]);
	}
	while (!rc && more) {
		if (out->n_frames == cap) {
			zmq_msg_t *f = realloc(out->frames, (cap = cap ? 2 * cap : 16) * sizeof(*f));

			if (!f) {
				rc = -ENOMEM;
				break;
			}
			out->frames = f;
		}
		zmq_msg_init(&out->frames[out->n_frames]);
		if (zmq_msg_recv(&out->frames[out->n_frames], cl->ps->s, 0) < 0) {
			zmq_msg_close(&out->frames[out->n_frames]);
			rc = -EIO;
			break;
		}
		more = zmq_msg_more(&out->frames[out->n_frames++]);
	}
	if (!rc && (np != 2 || zmq_msg_size(&parts[0]) != 0 ||
		    kvbp_reply_decode(zmq_msg_data(&parts[1]), zmq_msg_size(&parts[1]), &out->rep,
				      derr, sizeof(derr))))
		rc = -EIO;
	for (size_t i = 0; i < np; i++)
		zmq_msg_close(&parts[i]);
	if (!rc && out->rep.request_id != cl->id)
		rc = 1; /* someone else's late reply */
	if (rc)
		call_out_free(out);
	return rc;
}

/*
 * The end of a call: rc 0 (answered: the peer is heard from), -ETIME (a FETCH
 * answered whose payload then stalled: skipped for SUSPECT_MS whatever else it
 * answers meanwhile), another negative errno (it missed the deadline or failed:
 * suspect for SUSPECT_MS, until it answers again), or 1 (abandoned, another member
 * answered first: the socket is closed, the peer not marked).
 */
static void call_end(struct cluster *c, struct call *cl, int rc)
{
	struct peer *p = cl->p;

	if (rc == -ETIME) {
		atomic_store(&p->stall_until, now_ms() + SUSPECT_MS);
		atomic_fetch_add(&c->fetch_stalls, 1);
		cl_warn(c, "cluster: member '%s': a FETCH payload stalled past cluster_hedge_ms; "
			"its reads skipped for %d ms (heartbeats it answers do not clear this)",
			p->id, SUSPECT_MS);
	} else if (rc < 0) {
		atomic_store(&p->suspect_until, now_ms() + SUSPECT_MS);
		cl_warn(c, "cluster: member '%s': %s; skipped for %d ms", p->id,
			rc == -ETIMEDOUT ? "no reply within cluster_timeout_ms" : "call failed",
			SUSPECT_MS);
	} else if (rc == 0) {
		atomic_store(&p->suspect_until, 0);
		atomic_store(&p->last_reply, wall_ms());
	}
	sock_put(p, cl->ps, rc == 0);
	atomic_fetch_sub(&p->in_flight, 1);
}

/* peer_call, its payload on the socket's bulk connection when bulk and the peer takes it */
static int peer_call_once(struct cluster *c, struct peer *p, struct kvbp_request *req,
			  const void *const *frames, const size_t *lens, size_t n_frames,
			  bool bulk, struct call_out *out)
{
	struct call cl;
	int rc;

	memset(out, 0, sizeof(*out));
	rc = call_send(c, p, req, frames, lens, n_frames, bulk, &cl);
	if (rc)
		return rc;
	for (;;) {
		zmq_pollitem_t it = { cl.ps->s, 0, ZMQ_POLLIN, 0 };
		int64_t left = cl.deadline - now_ms();

		if (left <= 0) {
			rc = -ETIMEDOUT;
			break;
		}
		if (zmq_poll(&it, 1, (long)left) <= 0)
			continue; /* EINTR or timeout: the loop checks the deadline */
		rc = call_recv(&cl, out);
		if (rc <= 0)
			break;
		rc = 0; /* someone else's late reply: keep waiting */
	}
	/* a payload the peer refused on the bulk connection: it closed the connection
	 * (out of step), so this socket is closed too; the next opens another */
	if (!rc && n_frames && req->has_bulk_ticket && out->rep.code == KVBP_BAD_FRAMES)
		cl.ps->spoilt = true;
	call_end(c, &cl, rc);
	return rc;
}

int peer_call(struct cluster *c, struct peer *p, struct kvbp_request *req,
	      const void *const *frames, const size_t *lens, size_t n_frames,
	      struct call_out *out)
{
	bool bulk = c->bulk && n_frames;
	int rc = peer_call_once(c, p, req, frames, lens, n_frames, bulk, out);

	/* refused on the bulk connection (the peer fell behind reading it, a record
	 * altered on the way): once more in frames, as libkvblend does a PUT */
	if (!rc && bulk && req->has_bulk_ticket && out->rep.code == KVBP_BAD_FRAMES) {
		cl_warn(c, "cluster: member '%s' refused a payload on the bulk connection (%s); "
			"sent again in frames", p->id, out->rep.message);
		call_out_free(out);
		rc = peer_call_once(c, p, req, frames, lens, n_frames, false, out);
	}
	if (!rc && bulk && req->has_bulk_ticket && out->rep.code == KVBP_OK)
		atomic_fetch_add(&c->bulk_pushes, 1);
	return rc;
}

/* ---- read path ---- */

/*
 * A FETCH reply o from p: store the chunk here. 0 stored, -ENOENT when p does
 * not have it (or sent what fails its checks, or a quantized layout this store
 * refuses: the next member may have it whole), another
 * negative errno when this store cannot take it.
 */
static int fetch_store(struct cluster *c, const struct store_model *m, const uint8_t *hash,
		       struct peer *p, struct call_out *o, int64_t t0_ns, int64_t wire_ns)
{
	struct store_tensor_shape bad = { 0 };
	const void **blobs;
	size_t *lens;
	uint64_t bytes = 0;
	int rc;

	if (o->rep.code == KVBP_NOT_FOUND)
		return -ENOENT;
	if (o->rep.code || o->rep.n_chunks != 1 ||
	    (o->bulk ? o->rep.n_bulk_parts : o->n_frames) != m->desc.num_layers) {
		cl_warn(c, "cluster: fetch from '%s': %s", p->id,
			o->rep.code ? o->rep.message : "reply of the wrong shape");
		atomic_fetch_add(&c->fetch_failures, 1);
		return -ENOENT;
	}
	if (!o->bulk) { /* (a bulk payload's size was checked before it came: bulk.c) */
		uint64_t stored = 0;
		char why[192];

		for (size_t l = 0; l < m->desc.num_layers; l++)
			if (ckd_add(&stored, stored, zmq_msg_size(&o->frames[l])))
				stored = UINT64_MAX;
		if (fetch_size_check(c, m, o->rep.chunks[0].num_tokens, stored, why, sizeof(why))) {
			cl_warn(c, "cluster: fetch from '%s' in frames: %s", p->id, why);
			atomic_fetch_add(&c->fetch_failures, 1);
			return -ENOENT;
		}
	}
	blobs = calloc(m->desc.num_layers, sizeof(*blobs));
	lens = calloc(m->desc.num_layers, sizeof(*lens));
	if (!blobs || !lens) {
		free(blobs);
		free(lens);
		return -ENOMEM;
	}
	for (size_t l = 0; l < m->desc.num_layers; l++) {
		/* bulk: the parts were checked to add up to the bytes received */
		blobs[l] = o->bulk ? o->bulk + bytes : zmq_msg_data(&o->frames[l]);
		lens[l] = o->bulk ? o->rep.bulk_parts[l] : zmq_msg_size(&o->frames[l]);
		bytes += lens[l];
	}
	rc = store_chunk_import(c->store, m, hash, o->rep.chunks[0].num_tokens,
				o->rep.chunks[0].base_pos, blobs, lens, NULL, &bad);
	free(blobs);
	free(lens);
	if (rc >= 0) {
		if (o->bulk)
			atomic_fetch_add(&c->bulk_fetches, 1);
		atomic_fetch_add(&c->remote_hits, 1);
		atomic_fetch_add(&c->fetched_bytes, bytes);
		atomic_fetch_add(&c->fetch_ns, (uint64_t)(now_ns() - t0_ns));
		atomic_fetch_add(&c->fetch_wire_ns, (uint64_t)wire_ns);
		return 0;
	}
	if (rc == -ENOTSUP)
		cl_warn(c, "cluster: chunk from '%s' refused: layer %" PRIu32 "'s %s is quantized as "
			"%" PRIu32 " rows x %" PRIu32 " channels, not one row per token", p->id,
			bad.layer, bad.plane ? "V" : "K", bad.rows, bad.channels);
	else
		cl_warn(c, "cluster: chunk from '%s' refused: %s", p->id,
			rc == -EBADMSG ? "its bytes fail their checks" : strerror(-rc));
	atomic_fetch_add(&c->fetch_failures, 1);
	return rc == -EBADMSG || rc == -ENOTSUP ? -ENOENT : rc;
}

#define HEDGE_MAX 3 /* FETCHes of one chunk in flight at once */

/* Is a member among idx[next..n) one cluster_fetch would still ask (live, not suspect)? */
static bool left_to_ask(struct cluster *c, const size_t *idx, size_t next, size_t n)
{
	for (; next < n; next++) {
		struct peer *p = idx[next] ? peer_at(c, idx[next] - 1) : NULL;

		if (p && !suspect(p) && peer_live(c, p))
			return true;
	}
	return false;
}

/*
 * The members in placement order (owners first, then the others: a chunk may
 * sit where it used to belong), skipping suspect and departed ones. A member
 * that has not answered within cluster_hedge_ms is not waited for: the next
 * one is asked too (up to HEDGE_MAX at once), and the first to answer with the
 * chunk wins; the others are abandoned (not marked: they may just be slower).
 * The hedge holds over the whole transfer: a payload on a bulk connection that
 * makes no progress for cluster_hedge_ms, while another member is under way or
 * left to ask, is given up and its member skipped as one that missed its
 * deadline (call_end, -ETIME); the next is asked. A member that misses its
 * deadline is marked suspect.
 */
int cluster_fetch(struct cluster *c, const struct store_model *m, const uint8_t *hash)
{
	/* place_owners ranks at most 64: the owners first, then the rest in order */
	size_t idx[64], n = ranked(c, hash, 64, idx), next = 0, n_cl = 0;
	struct call cl[HEDGE_MAX];
	int64_t t0[HEDGE_MAX], next_hedge = 0;
	int rc = -ENOENT;

	while (rc == -ENOENT) {
		zmq_pollitem_t it[HEDGE_MAX];
		int64_t now = now_ms(), wake;

		/* a new call: none under way, or the hedge delay passed */
		if (next < n && n_cl < HEDGE_MAX && (!n_cl || (c->hedge_ms && now >= next_hedge))) {
			struct peer *p = idx[next] ? peer_at(c, idx[next] - 1) : NULL;
			struct kvbp_request q = { .op = KVBP_OP_FETCH, .has_model = true,
						  .has_hash = true };

			next++;
			if (!p || suspect(p) || !peer_live(c, p))
				continue;
			c->describe(m, &q.model);
			snprintf(q.model_name, sizeof(q.model_name), "%s", m->name);
			memcpy(q.hash, hash, KVBP_HASH_LEN);
			if (call_send(c, p, &q, NULL, NULL, 0, c->bulk, &cl[n_cl])) {
				atomic_fetch_add(&c->fetch_failures, 1);
				continue;
			}
			if (n_cl)
				atomic_fetch_add(&c->hedged, 1);
			t0[n_cl++] = now_ns();
			next_hedge = now + c->hedge_ms;
			continue;
		}
		if (!n_cl)
			break; /* no member left to ask */
		wake = cl[0].deadline;
		for (size_t i = 0; i < n_cl; i++) {
			it[i] = (zmq_pollitem_t){ cl[i].ps->s, 0, ZMQ_POLLIN, 0 };
			if (cl[i].deadline < wake)
				wake = cl[i].deadline;
		}
		if (next < n && n_cl < HEDGE_MAX && c->hedge_ms && next_hedge < wake)
			wake = next_hedge;
		zmq_poll(it, (int)n_cl, (long)(wake > now ? wake - now : 0));
		now = now_ms();
		for (size_t i = 0; i < n_cl && rc == -ENOENT;) {
			struct call_out o;
			int r = 1;

			if (it[i].revents & ZMQ_POLLIN)
				r = call_recv(&cl[i], &o);
			if (r == 1 && now >= cl[i].deadline)
				r = -ETIMEDOUT;
			if (r == 1) {
				i++;
				continue;
			}
			if (r == 0 && o.rep.code == KVBP_OK && o.rep.bulk_bytes) {
				int64_t stall = 0;
				char why[192];

				/* read here, the others waiting: while another member may
				 * answer, a payload without a byte for the hedge delay is
				 * given up */
				if (c->hedge_ms && (n_cl > 1 || left_to_ask(c, idx, next, n)))
					stall = c->hedge_ms;
				r = psock_fetch_payload(c, cl[i].ps, m, &o, cl[i].deadline, stall,
							why, sizeof(why));
				if (r) {
					cl_warn(c, "cluster: fetch from '%s' on its bulk connection: "
						"%s", cl[i].p->id, why);
					cl[i].ps->spoilt = true;
					call_out_free(&o);
					r = r == -ETIMEDOUT || r == -ETIME ? r : -EIO;
				} else {
					atomic_store(&cl[i].p->stall_until, 0);
				}
			}
			call_end(c, &cl[i], r);
			if (r == 0) {
				/* the bytes are here: the wire's share, before checks and store */
				rc = fetch_store(c, m, hash, cl[i].p, &o, t0[i], now_ns() - t0[i]);
				call_out_free(&o);
			} else {
				atomic_fetch_add(&c->fetch_failures, 1);
			}
			/* this call is over: the last one takes its place */
			n_cl--;
			cl[i] = cl[n_cl];
			t0[i] = t0[n_cl];
			it[i] = it[n_cl];
		}
	}
	for (size_t i = 0; i < n_cl; i++)
		call_end(c, &cl[i], 1); /* abandoned: another member answered */
	if (rc == -ENOENT)
		atomic_fetch_add(&c->remote_misses, 1);
	return rc;
}

size_t cluster_lookup(struct cluster *c, const struct store_model *m,
		      const uint8_t (*hashes)[KVBP_HASH_LEN], size_t n, bool *found,
		      struct store_chunk_info *infos)
{
	size_t got = 0;

	size_t np = n_peers(c);

	/* one batched LOOKUP per peer, for the missing hashes it owns */
	for (size_t pi = 0; pi < np; pi++) {
		struct peer *p = peer_at(c, pi);
		struct kvbp_request q = { .op = KVBP_OP_LOOKUP };
		size_t *which = NULL, k = 0;
		struct call_out o;

		if (!p || suspect(p) || !peer_live(c, p))
			continue;
		for (size_t i = 0; i < n; i++) {
			size_t idx[16], r;

			if (found[i])
				continue;
			r = ranked(c, hashes[i], c->replicas < 16 ? c->replicas : 16, idx);
			for (size_t j = 0; j < r; j++)
				if (idx[j] == pi + 1) {
					if (!which) {
						which = calloc(n, sizeof(*which));
						q.hashes = calloc(n, KVBP_HASH_LEN);
						if (!which || !q.hashes)
							goto next;
					}
					memcpy(q.hashes[k], hashes[i], KVBP_HASH_LEN);
					which[k++] = i;
				}
		}
		if (!k)
			goto next;
		q.n_hashes = k;
		snprintf(q.model_name, sizeof(q.model_name), "%s", m->name);
		if (peer_call(c, p, &q, NULL, NULL, 0, &o))
			goto next;
		if (o.rep.code == KVBP_OK && o.rep.n_chunks == k)
			for (size_t j = 0; j < k; j++)
				if (o.rep.chunks[j].found && !found[which[j]]) {
					struct store_chunk_info *ci = &infos[which[j]];

					found[which[j]] = true;
					memset(ci, 0, sizeof(*ci));
					ci->num_tokens = o.rep.chunks[j].num_tokens;
					ci->base_pos = o.rep.chunks[j].base_pos;
					ci->num_layers = o.rep.chunks[j].num_layers;
					ci->raw_bytes = o.rep.chunks[j].raw_bytes;
					ci->stored_bytes = o.rep.chunks[j].stored_bytes;
					got++;
				}
		call_out_free(&o);
next:
		free(which);
		kvbp_request_clear(&q);
	}
	return got;
}

void cluster_owners_hold(struct cluster *c, const struct store_model *m,
			 const uint8_t (*hashes)[KVBP_HASH_LEN], size_t n, bool *held)
{
	size_t R = c->replicas < 16 ? c->replicas : 16, np = n_peers(c);
	size_t (*own)[16] = calloc(n ? n : 1, sizeof(*own));
	unsigned *left = calloc(n ? n : 1, sizeof(*left)); /* owners not yet known to hold it */
	size_t *which = calloc(n ? n : 1, sizeof(*which));

	for (size_t i = 0; i < n; i++)
		held[i] = false;
	if (!own || !left || !which)
		goto out;
	for (size_t i = 0; i < n; i++) {
		size_t r = ranked(c, hashes[i], R, own[i]);

		left[i] = (unsigned)r;
		for (size_t j = 0; j < r; j++)
			if (own[i][j] == 0)
				left[i] = UINT_MAX; /* owned here after all: not a cache copy */
		if (r < R && r < 16)
			own[i][r] = SIZE_MAX;
	}
	for (size_t pi = 0; pi < np; pi++) {
		struct peer *p = peer_at(c, pi);
		struct kvbp_request q = { .op = KVBP_OP_LOOKUP };
		struct call_out o;
		size_t k = 0;

		if (!p)
			continue;
		for (size_t i = 0; i < n; i++)
			for (size_t j = 0; j < R && left[i] != UINT_MAX && own[i][j] != SIZE_MAX; j++)
				if (own[i][j] == pi + 1)
					which[k++] = i;
		if (!k || suspect(p) || !peer_live(c, p))
			continue; /* an owner not asked: its chunks stay unconfirmed */
		q.hashes = calloc(k, KVBP_HASH_LEN);
		if (!q.hashes)
			continue;
		for (size_t j = 0; j < k; j++)
			memcpy(q.hashes[j], hashes[which[j]], KVBP_HASH_LEN);
		q.n_hashes = k;
		snprintf(q.model_name, sizeof(q.model_name), "%s", m->name);
		if (!peer_call(c, p, &q, NULL, NULL, 0, &o)) {
			if (o.rep.code == KVBP_OK && o.rep.n_chunks == k)
				for (size_t j = 0; j < k; j++)
					if (o.rep.chunks[j].found && left[which[j]] != UINT_MAX)
						left[which[j]]--;
			call_out_free(&o);
		}
		kvbp_request_clear(&q);
	}
	for (size_t i = 0; i < n; i++)
		held[i] = left[i] == 0;
out:
	free(own);
	free(left);
	free(which);
}

/* ---- write path ---- */

/* Queue a push (the queue lock held); false when the queue is full. */
static bool enqueue(struct cluster *c, uint32_t peer, uint32_t model_id, const uint8_t *hash,
		    bool rebalance)
{
	struct push *e;

	if (c->q_len == QUEUE_MAX) {
		c->rescan = true; /* it stays owed in the store: read again when there is room */
		return false;
	}
	e = &c->q[(c->q_head + c->q_len++) % QUEUE_MAX];
	c->q_rebalance += rebalance;
	e->peer = peer;
	e->model_id = model_id;
	e->rebalance = rebalance;
	memcpy(e->hash, hash, KVBP_HASH_LEN);
	pthread_cond_signal(&c->qcond);
	return true;
}

/* Record (store first: a crash from here on still pushes it) and queue a push. */
void owe(struct cluster *c, size_t peer, uint32_t model_id, const uint8_t *hash,
	 bool rebalance)
{
	struct peer *p = peer_at(c, peer);

	if (!p)
		return;
	if (store_owed_put(c->store, p->id, model_id, hash, true))
		cl_warn(c, "cluster: cannot record a push owed to '%s'; pushing it anyway", p->id);
	pthread_mutex_lock(&c->qlock);
	enqueue(c, (uint32_t)peer, model_id, hash, rebalance);
	pthread_mutex_unlock(&c->qlock);
}

void cluster_stored(struct cluster *c, const struct store_model *m, const uint8_t *hash)
{
	size_t idx[16], r = ranked(c, hash, c->replicas < 16 ? c->replicas : 16, idx);

	for (size_t i = 0; i < r; i++)
		if (idx[i])
			owe(c, idx[i] - 1, m->id, hash, false);
}

struct export_buf {
	const void **blobs;
	size_t *lens;
	uint32_t n;
};

static int export_layer(void *ctx, uint32_t layer, const void *bytes, size_t len)
{
	struct export_buf *b = ctx;

	if (layer >= b->n)
		return -EBADMSG;
	b->blobs[layer] = malloc(len ? len : 1);
	if (!b->blobs[layer])
		return -ENOMEM;
	memcpy((void *)b->blobs[layer], bytes, len);
	b->lens[layer] = len;
	return 0;
}

/* Push one chunk to one peer: 0 done (or nothing to do), -EAGAIN retry later. *bytes sent. */
int push_one(struct cluster *c, const struct push *e, uint64_t *bytes)
{
	struct peer *p = peer_at(c, e->peer);
	struct store_model m;
	struct store_chunk_info ci;
	struct export_buf b = { 0 };
	struct kvbp_request q = { .op = KVBP_OP_REPLICATE, .has_model = true, .has_hash = true };
	struct call_out o;
	int rc = store_model_by_id(c->store, e->model_id, &m);

	*bytes = 0;
	if (!p)
		return 0;
	if (rc) /* the model is gone, or its record is unreadable: nothing to push */
		goto done;
	b.n = m.desc.num_layers;
	b.blobs = calloc(b.n, sizeof(*b.blobs));
	b.lens = calloc(b.n, sizeof(*b.lens));
	if (!b.blobs || !b.lens) {
		rc = -EAGAIN;
		goto out;
	}
	rc = store_chunk_export(c->store, &m, e->hash, &ci, export_layer, &b);
	if (rc == -ENOENT || rc == -EBADMSG) /* deleted or corrupt here: not ours to send */
		goto done;
	if (rc) {
		rc = -EAGAIN;
		goto out;
	}
	c->describe(&m, &q.model);
	snprintf(q.model_name, sizeof(q.model_name), "%s", m.name);
	memcpy(q.hash, e->hash, KVBP_HASH_LEN);
	q.num_tokens = ci.num_tokens;
	q.base_pos = ci.base_pos;
	if (peer_call(c, p, &q, (const void *const *)b.blobs, b.lens, b.n, &o)) {
		rc = -EAGAIN;
		goto out;
	}
	for (uint32_t l = 0; l < b.n; l++)
		*bytes += b.lens[l];
	if (o.rep.code == KVBP_OK) {
		atomic_fetch_add(&c->pushes_done, 1);
		if (e->rebalance)
			atomic_fetch_add(&c->rebalance_pushes, 1);
	} else if (o.rep.code == KVBP_FULL || o.rep.code == KVBP_LIMIT || o.rep.code == KVBP_BUSY ||
		   o.rep.code == KVBP_INTERNAL) {
		/* the peer may take it later */
		call_out_free(&o);
		rc = -EAGAIN;
		goto out;
	} else {
		cl_warn(c, "cluster: '%s' refused a chunk of '%s': %s", p->id, m.name, o.rep.message);
		atomic_fetch_add(&c->push_failures, 1);
	}
	call_out_free(&o);
done:
	rc = 0;
	if (store_owed_put(c->store, p->id, e->model_id, e->hash, false))
		cl_warn(c, "cluster: cannot clear a push owed to '%s'", p->id);
out:
	for (uint32_t l = 0; b.blobs && l < b.n; l++)
		free((void *)b.blobs[l]);
	free(b.blobs);
	free(b.lens);
	return rc;
}

static int load_owed(void *ctx, const char *peer, uint32_t model_id, const uint8_t *hash)
{
	struct cluster *c = ctx;
	size_t np = n_peers(c);

	for (size_t i = 0; i < np; i++) {
		struct peer *p = peer_at(c, i);

		if (p && !strcmp(p->id, peer))
			return enqueue(c, (uint32_t)i, model_id, hash, false) ? 0 : 1;
	}
	return 0; /* a member not known (yet): read again when the membership changes */
}

size_t pushes_pending(struct cluster *c)
{
	size_t n;

	pthread_mutex_lock(&c->qlock);
	n = atomic_load(&c->in_flight);
	for (size_t i = 0; i < c->q_len; i++) {
		struct peer *p = peer_at(c, c->q[(c->q_head + i) % QUEUE_MAX].peer);

		n += p && peer_live(c, p) && !suspect(p);
	}
	pthread_mutex_unlock(&c->qlock);
	return n;
}

void *pusher_main(void *arg)
{
	struct cluster *c = arg;
	unsigned waiting = 0; /* entries in a row that must wait: peer suspect or gone, or rate */
	bool rate_wait = false; /* one of them waits only for the rebalance rate */

	pthread_mutex_lock(&c->qlock);
	store_owed_scan(c->store, load_owed, c); /* what the last run still owed */
	while (!c->stop) {
		struct push e;
		struct peer *p;
		uint64_t bytes;
		int rc;

		if (!c->q_len && c->rescan) {
			c->rescan = false;
			store_owed_scan(c->store, load_owed, c);
		}
		if (!c->q_len || (waiting && waiting >= c->q_len)) {
			/*
			 * Every entry waits. Those held only by the rebalance rate may go
			 * when it allows, not at the next 100 ms poll: a push of 2 MiB at
			 * 4 GiB/s owes half a millisecond, and a poll there capped a join
			 * at one push per 100 ms and sender (bench_join: 0.02x of a copy).
			 */
			wait_ns(&c->qcond, &c->qlock,
				push_wait_ns(waiting && rate_wait, c->rebalance_next_ns, now_ns()));
			waiting = 0;
			rate_wait = false;
			continue;
		}
		e = c->q[c->q_head];
		c->q_head = (c->q_head + 1) % QUEUE_MAX;
		c->q_len--;
		c->q_rebalance -= e.rebalance;
		p = peer_at(c, e.peer);
		if (p && (suspect(p) || !peer_live(c, p))) {
			enqueue(c, e.peer, e.model_id, e.hash, e.rebalance);
			waiting++;
			continue;
		}
		if (p && e.rebalance && now_ns() < c->rebalance_next_ns) {
			enqueue(c, e.peer, e.model_id, e.hash, e.rebalance);
			rate_wait = true;
			/* only rebalance pushes queued: none may go before the rate allows,
			 * so wait for it now instead of turning the whole queue over (up to
			 * QUEUE_MAX entries, the lock held) after every push */
			waiting = c->q_rebalance == c->q_len ? (unsigned)c->q_len : waiting + 1;
			continue;
		}
		waiting = 0;
		rate_wait = false;
		atomic_fetch_add(&c->in_flight, 1);
		pthread_mutex_unlock(&c->qlock);
		rc = push_one(c, &e, &bytes);
		pthread_mutex_lock(&c->qlock);
		if (e.rebalance && bytes) { /* the rate limit: this push's share of a second */
			int64_t t = now_ns();

			if (c->rebalance_next_ns < t)
				c->rebalance_next_ns = t;
			c->rebalance_next_ns += (int64_t)((double)bytes * 1e9 /
							  (double)c->rebalance_rate);
		}
		if (rc == -EAGAIN)
			enqueue(c, e.peer, e.model_id, e.hash, e.rebalance);
		atomic_fetch_sub(&c->in_flight, 1);
	}
	pthread_mutex_unlock(&c->qlock);
	return NULL;
}

int cluster_model_find(struct cluster *c, const char *name, struct kvbp_model *out)
{
	/* the live members in turn, each within the deadline, until one has it */
	for (size_t i = 0;; i++) {
		struct peer *p = peer_at(c, i);
		struct kvbp_request q = { .op = KVBP_OP_MODEL_LIST };
		struct call_out o;

		if (!p)
			return -ENOENT;
		if (!peer_live(c, p) || suspect(p))
			continue;
		snprintf(q.model_name, sizeof(q.model_name), "%s", name);
		if (peer_call(c, p, &q, NULL, NULL, 0, &o))
			continue;
		for (size_t j = 0; !o.rep.code && j < o.rep.n_models; j++)
			if (!strcmp(o.rep.models[j].name, name)) {
				*out = o.rep.models[j];
				call_out_free(&o);
				cl_info(c, "cluster: model '%s' described by member '%s'", name,
					p->id);
				return 0;
			}
		call_out_free(&o);
	}
}
