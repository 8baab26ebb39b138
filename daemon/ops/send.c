/*
 * ops/send — the one way out for a reply (ops.h ops_send): the header and the payload
 * in frames, or the payload on the client's bulk connection, handed to a sender thread
 * (bulk.h) with what it needs to verify each layer as it goes and to remove the chunk
 * when one fails. A worker and the lane both call it; no caller waits on a client.
 */
#include "daemon/ops/impl.h"

#include <errno.h>
#include <inttypes.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/uio.h>
#include <openssl/crypto.h>

#include "daemon/bulk.h"
#include "daemon/held.h"
#include "daemon/pool.h"

/* Layers whose payload a bulk diversion lists on the stack (more: malloc). */
#define LAYERS_IOV 128

struct view_check {
	const struct store_view *v;
	uint32_t n, parts;
};

static int view_check_part(void *arg, size_t i)
{
	const struct view_check *c = arg;
	uint32_t a = (uint32_t)((uint64_t)c->n * i / c->parts);
	uint32_t b = (uint32_t)((uint64_t)c->n * (i + 1) / c->parts);

	for (uint32_t l = a; l < b; l++)
		if (store_view_verify(c->v, l))
			return -EBADMSG;
	return 0;
}

int view_verify_all(struct server *srv, const struct store_view *v)
{
	uint32_t n = v->layer_end - v->layer_begin;
	unsigned threads = pool_threads(srv->pool) + 1;
	struct view_check c = { v, n, threads < n ? threads : n };

	return pool_run(srv->pool, c.parts, view_check_part, &c) ? -EBADMSG : 0;
}

/* out's chunk failed its checksum: removed, and out becomes the `corrupt` error. */
static void reply_corrupt(struct server *srv, struct reply_out *out)
{
	char h[2 * KVBP_HASH_LEN + 1];

	drop_corrupt(srv, &out->verify_model, out->verify_hash, h);
	out->rep.code = KVBP_CORRUPT;
	snprintf(out->rep.message, sizeof(out->rep.message), "chunk %s failed its checksum and "
		 "was removed; treat it as a miss", h);
}

/*
 * The header and any payload frames of out, after the envelope (and an empty delimiter
 * when add_delim).
 */
static void send_frames(struct server *srv, const struct ops_dest *to, struct reply_out *out)
{
	uint8_t *hdr = NULL;
	size_t len = 0;
	uint64_t bytes = 0;
	bool payload = out->rep.code == KVBP_OK && out->n_payload;

	if (!payload)
		out->rep.payload_frames = 0;
	for (size_t i = 0; i < to->n_env; i++)
		if (zmq_msg_send(&to->env[i], to->sock, ZMQ_SNDMORE) < 0)
			zmq_msg_close(&to->env[i]);
	if (to->add_delim)
		zmq_send(to->sock, "", 0, ZMQ_SNDMORE);
	if (kvbp_reply_encode(&out->rep, &hdr, &len)) {
		/* Out of memory: still answer, with an empty frame, rather than leave a hang. */
		zmq_send(to->sock, "", 0, 0);
		return;
	}
	zmq_send(to->sock, hdr, len, payload ? ZMQ_SNDMORE : 0);
	bytes += len;
	if (out->rep.has_bulk_key) { /* the key lives on only in the bulk connection */
		OPENSSL_cleanse(hdr, len);
		OPENSSL_cleanse(out->rep.bulk_key, sizeof(out->rep.bulk_key));
	}
	free(hdr);
	for (size_t i = 0; payload && i < out->n_payload; i++) {
		bytes += zmq_msg_size(&out->payload[i]);
		zmq_msg_send(&out->payload[i], to->sock, i + 1 < out->n_payload ? ZMQ_SNDMORE : 0);
	}
	atomic_fetch_add(&srv->stats.bytes_out, bytes);
}

/* A payload on a sender thread: its frames (they hold the view and the client's bytes). */
struct bulk_reply {
	struct server *srv;
	zmq_msg_t *payload;
	size_t n_payload;
	const struct store_view *verify_view; /* NULL: verified already */
	struct store_model model;
	uint8_t hash[KVBP_HASH_LEN];
};

/* Before frame i of an unverified view goes out: its layer's checksums (frames K, V). */
static int bulk_reply_check(void *arg, size_t i)
{
	const struct bulk_reply *r = arg;

	return i % 2 ? 0 : (store_view_verify(r->verify_view, (uint32_t)(i / 2)) ? -EBADMSG : 0);
}

/* The sender is done with the payload (bulk.h bulk_done_fn). */
static void bulk_reply_done(void *arg, int rc, uint64_t sent)
{
	struct bulk_reply *r = arg;

	for (size_t i = 0; i < r->n_payload; i++)
		zmq_msg_close(&r->payload[i]);
	free(r->payload);
	if (rc == -EBADMSG) { /* once the frames let go of the view */
		char h[2 * KVBP_HASH_LEN + 1];

		drop_corrupt(r->srv, &r->model, r->hash, h);
	}
	if (!rc)
		atomic_fetch_add(&r->srv->stats.bytes_out, sent);
	free(r);
}

/* A reply that cannot go out on the bulk connection after all: code and message. */
static void bulk_refused(struct reply_out *out, uint32_t code, const char *msg)
{
	for (size_t i = 0; i < out->n_payload; i++)
		zmq_msg_close(&out->payload[i]);
	out->n_payload = 0;
	out->rep.code = code;
	out->rep.bulk_bytes = 0;
	out->rep.n_bulk_parts = 0;
	snprintf(out->rep.message, sizeof(out->rep.message), "%s", msg);
}

/*
 * A payload that asked for the bulk connection: the payload handed to the connection's
 * sender first (it goes out behind the payloads queued before it, each layer of an
 * unverified view checked just before it is sent: a layer that fails voids the payload
 * with an abort record, and the chunk is removed), then the reply without the frames.
 * A ticket this daemon does not know (expired, another client's) leaves the frames to
 * ZeroMQ, verified first (false: the caller sends the reply as usual). A client with
 * too many payloads waiting is refused (`limit`).
 */
static bool bulk_divert(struct server *srv, const struct ops_dest *to, struct reply_out *out)
{
	struct iovec iov[2 * LAYERS_IOV];
	size_t n = out->n_payload;
	struct iovec *v = n <= 2 * LAYERS_IOV ? iov : malloc(n * sizeof(*v));
	struct bulk_reply *r = malloc(sizeof(*r));
	struct bulk_conn *bc;
	uint64_t total = 0;
	int rc;

	if (v && (out->flags & OPF_BULK_PARTS))
		out->rep.bulk_parts = malloc(n * sizeof(uint64_t));
	if (!v || !r || ((out->flags & OPF_BULK_PARTS) && !out->rep.bulk_parts) ||
	    bulk_take(srv->bulk, out->bulk_ticket, to->principal, zmq_msg_data(&to->env[1]),
		      zmq_msg_size(&to->env[1]), &bc)) {
		/* frames after all, every layer verified first */
		if (v != iov)
			free(v);
		free(r);
		if (out->verify_view && view_verify_all(srv, out->verify_view)) {
			/* the reply: corrupt, no frames (closed first: they hold the view) */
			for (size_t i = 0; i < n; i++)
				zmq_msg_close(&out->payload[i]);
			out->n_payload = 0;
			reply_corrupt(srv, out);
		}
		return false;
	}
	for (size_t i = 0; i < n; i++) {
		v[i].iov_base = zmq_msg_data(&out->payload[i]);
		v[i].iov_len = zmq_msg_size(&out->payload[i]);
		total += v[i].iov_len;
		if (out->rep.bulk_parts)
			out->rep.bulk_parts[i] = v[i].iov_len;
	}
	*r = (struct bulk_reply){ srv, out->payload, n, out->verify_view, out->verify_model,
				  { 0 } };
	memcpy(r->hash, out->verify_hash, sizeof(r->hash));
	/* The sender has its own deadline: the ZeroMQ connection is not the one to cut while
	 * it writes (held.h). */
	if (out->held)
		held_remove(&srv->held, out->held);
	rc = bulk_post(srv->bulk, bc, out->rep.request_id, v, n,
		       out->verify_view ? &(struct bulk_check){ bulk_reply_check, r } : NULL,
		       bulk_reply_done, r);
	if (v != iov)
		free(v);
	if (rc) {
		free(r);
		if (rc == -EDQUOT)
			bulk_refused(out, KVBP_LIMIT, "this client has 32 payloads waiting on its "
				     "bulk connections (at most 32 a client): read them first");
		else if (rc == -ESHUTDOWN)
			bulk_refused(out, KVBP_BUSY, "kvblendd is shutting down; retry when it is "
				     "back");
		else
			bulk_refused(out, KVBP_LIMIT, "out of memory");
		return false;
	}
	/* the frames are the sender's now */
	out->payload = NULL;
	out->n_payload = 0;
	out->rep.payload_frames = 0;
	out->rep.bulk_bytes = total;
	out->rep.n_bulk_parts = out->rep.bulk_parts ? n : 0;
	send_frames(srv, to, out);
	return true;
}

void ops_send(struct server *srv, const struct ops_dest *to, struct reply_out *out)
{
	if (out->has_bulk && srv->bulk && out->rep.code == KVBP_OK && out->n_payload &&
	    bulk_divert(srv, to, out))
		return;
	send_frames(srv, to, out);
}
