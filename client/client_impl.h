/*
 * client_impl.h — libkvblend's private declarations, shared by its modules and never
 * installed: the client and request structures, and the few functions one module of
 * the library offers the others. include/kvblend.h is the public contract; nothing
 * here is exported (hidden visibility, and kvblend.map lists kvblend.h's functions only).
 *
 * Modules and who uses whom (no cycles):
 *   bulk.c    the bulk connection (PUT and GET payloads    uses no other module
 *             over TCP)
 *   cudaipc.c the daemon's device memory mapped through    uses no other module
 *             the CUDA driver, loaded at run time (cudaipc.h)
 *   call.c    requests and replies over the socket        uses bulk
 *   shm.c     the shared segment and the regions           uses call
 *   model.c   model specs, wire records, register/list     uses call
 *   chunk.c   PUT, GET, LOOKUP, PIN, DELETE, LIST          uses call, shm, model, bulk
 *   admin.c   STATS and cluster members                    uses call
 *   client.c  connect, ping, close, error texts            uses call, shm, bulk, cudaipc
 *   fuse.c    fuse sessions, landing sessions              uses call, shm, model, cudaipc,
 *                                                          client (kvb_strerror)
 *
 * Not the library's, in the same folder: the kvblend CLI (cli.c, its commands in
 * cli_admin.c, cli_chunk.c and cli_fuse.c, what they share in cli_common.c; cli.h),
 * over the library, and npy.c (npy.h: .npy files, for the CLI and the tests).
 *
 * Thread-safety is the public header's: one client, one thread at a time.
 */
#ifndef KVBLEND_CLIENT_IMPL_H
#define KVBLEND_CLIENT_IMPL_H

#include <stdatomic.h>
#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>
#include <zmq.h>

#include "proto/bulk.h"
#include "proto/wire.h"
#include "client/cudaipc.h"
#include "client/include/kvblend.h"

/*
 * A region starts with REGION_HEAD bytes of progress words (one per landing
 * session using it) before the memory handed to the caller.
 */
#define REGION_MAX 16
#define REGION_HEAD 4096u
#define REGION_WORDS (REGION_HEAD / 4)

struct region {
	uint64_t id; /* 0: slot free */
	uint8_t *base;
	size_t size;
	uint64_t used[REGION_WORDS / 64]; /* progress words taken */
};

struct kvb_client {
	void *ctx;
	void *sock;
	char endpoint[512];
	int timeout_ms;
	bool curve;
	char server_key[41], public_key[41], secret_key[41];
	uint64_t next_id;
	char err[512];
	int err_code; /* the code kvbc_set_err() was given with err (kvb_last_code) */
	/* Payload frames ZeroMQ still reads from the caller's memory (zero-copy sends). */
	atomic_int in_flight;
	/* shared memory */
	bool shm_ok; /* may try shared memory */
	uint64_t shm_id;
	void *shm_base;
	size_t shm_size;
	size_t shm_initial;
	/* Segments the daemon lost (a restart): still mapped, so that buffers the caller
	 * got from kvb_shared_buffer() stay valid, until kvb_close(). */
	void *lost_base[8];
	size_t lost_size[8];
	unsigned n_lost;
	/* regions: segments holding the node's own buffers (kvb_region_alloc) */
	struct region regions[REGION_MAX];
	struct kvb_cuda *cuda; /* kvb_fuse_device(): fused layers taken on the GPU */
	/* the bulk connection (bulk.c): GET payloads over TCP, straight into the caller's
	 * buffer; sealed (AEGIS or AES-256-GCM) when the daemon gave a key over CURVE */
	int bulk_fd;	/* -1: none open */
	int bulk_state; /* 0: not tried yet, 1: open, -1: not offered (frames only) */
	uint8_t bulk_ticket[KVBP_BULK_TICKET_LEN];
	struct kvbb_aead *bulk_aead; /* NULL: records are not sealed */
	uint64_t bulk_counter;	     /* records received: the next nonce */
	uint64_t bulk_scounter;	     /* PUT records sent, plus one (the hello): the next nonce */
	bool bulk_put;		     /* the daemon takes PUT payloads on it */
	int64_t bulk_put_after_ms;   /* a PUT on it failed: PUTs in frames until then */
	/* the next record's header, received with the record before it (same payload) */
	bool bulk_have_hdr;
	uint8_t bulk_hdr[KVBB_HDR_LEN];
};

struct call {
	/* while waiting for the reply: called between polls; returns 1 if it made progress */
	int (*while_waiting)(void *ctx);
	void *waiting_ctx;
	struct kvbp_request req;
	const void *const *payload; /* frames to send after the header */
	const size_t *payload_len;
	size_t n_payload;
	struct kvbp_reply rep;
	zmq_msg_t *frames; /* received payload frames; freed by kvbc_call_done() */
	size_t n_frames;
	/* or, with sink set: each payload frame copied there as it arrives and freed at once
	 * (the copy overlaps the rest of the transfer, and the frames' memory is reused);
	 * sink_got counts the payload's bytes, also those beyond sink_len (not copied) */
	uint8_t *sink;
	size_t sink_len, sink_got;
	/* with bulk (and sink): the payload comes as records on c->bulk_fd (bulk.c) */
	bool bulk;
	size_t bulk_got;
	bool bulk_last;
	bool bulk_abort; /* the payload ended in an abort record (KVBB_ABORT) */
	/* or a PUT's payload, sent as records on c->bulk_fd after the request (bulk.c);
	 * bulk_out_rc: how that went (0, or the connection failed and was closed) */
	const uint8_t *bulk_out;
	size_t bulk_out_len;
	int bulk_out_rc;
};

/* ---- call.c: one request and its reply ---- */

/*
 * Format a message into c->err (what kvb_last_error() shows) and return rc, so that
 * a failure reads `return kvbc_set_err(c, -EINVAL, "...")`.
 */
__attribute__((format(printf, 3, 4))) int kvbc_set_err(kvb_client *c, int rc, const char *fmt,
							 ...);
/* Open c->sock (DEALER, CURVE when c->curve) and connect it to c->endpoint: 0 or -errno. */
int kvbc_open_socket(kvb_client *c);
/* Wait (a bounded while) until ZeroMQ lets go of every zero-copy payload frame. */
void kvbc_wait_payloads(kvb_client *c);
/*
 * Send k->req (version and request id filled in here) with k's payload frames, and wait
 * up to the client's timeout for the reply with the same id, into k->rep and k->frames
 * (or k->sink). Returns 0; -EIO (socket), -ETIMEDOUT (the socket is then reset so that
 * a late reply cannot answer the next request), -ENOMEM, KVB_E_PROTOCOL (unreadable
 * reply), or the daemon's KVB_E_* code; c->err says which. The payload may be reused
 * when it returns. Whatever it returns, kvbc_call_done(k) releases k.
 */
int kvbc_call(kvb_client *c, struct call *k);
/* Free what a call holds (request fields, reply, frames); k may be reused after. */
void kvbc_call_done(struct call *k);
/* A best-effort call made while failing (a cleanup: a detach, a close): kvbc_call() and
 * kvbc_call_done(), keeping the caller's error message and code as they were. */
void kvbc_call_quiet(kvb_client *c, struct call *k);
/* Copy model into k's request: 0, or -EINVAL if it is empty or longer than KVB_NAME_MAX. */
int kvbc_set_name(kvb_client *c, struct call *k, const char *model);

/* ---- model.c: the model record ---- */

/* The public model as the wire's (name and description) and back: the one place the
 * public struct, whose layout is the ABI's, meets struct kvb_model_desc. */
void kvbc_model_to_wire(const struct kvb_model *m, struct kvbp_model *w);
void kvbc_model_from_wire(const struct kvbp_model *w, struct kvb_model *m);

/* ---- bulk.c: the bulk connection ---- */

/* The ciphers to offer besides AES-256-GCM (1 << KVBP_AEAD_*): those this CPU runs, or
 * the one KVBLEND_BULK_CIPHER names (aes-256-gcm, aegis-128l, aegis-128x2). */
uint32_t kvbc_bulk_offer(void);
/*
 * The bulk connection a HELLO's reply rep offers (having offered offer): checked (over
 * CURVE a key, and a cipher offered), connected, its hello sent and acknowledged. The
 * key in rep is wiped. 0; -ENOTSUP (none offered), -EPROTO (an offer to refuse), or
 * -errno of the connection. bulk.c, below the call layer: the HELLO itself is the
 * caller's (chunk.c).
 */
int kvbc_bulk_attach(kvb_client *c, struct kvbp_reply *rep, uint32_t offer);
/* Close the bulk connection; the next GET over TCP opens another (chunk.c). */
void kvbc_bulk_close(kvb_client *c);
/*
 * Send k->bulk_out as the records of request k->req.request_id (sealed when the
 * connection is): 0, or -ETIMEDOUT / -EPIPE / -EIO with the connection closed and c->err
 * saying why (the daemon's reply, which follows, names its side).
 */
int kvbc_bulk_send(kvb_client *c, const struct call *k);
/*
 * Receive one record of k's payload into k->sink (straight from the socket, opened in
 * place when sealed). 0; 1 when the connection was closed before this payload began
 * (it is closed here too: the reply brings frames); -ENOBUFS (larger than the sink), KVB_E_PROTOCOL (a record out
 * of order, of another request, or altered on the wire: its tag failed), -EIO, -ETIMEDOUT;
 * on any error the connection is closed and c->err names the problem.
 */
int kvbc_bulk_record(kvb_client *c, struct call *k);

/* ---- shm.c: the shared segment and the regions ---- */

/*
 * Make sure the shared segment is mapped with at least size bytes (attaching a larger
 * one, rounded up to 1 MiB, if not). false if shared memory is not usable for this
 * size; c->shm_ok is cleared when it is not usable at all, so calls fall back to frames.
 */
bool kvbc_shm_ensure(kvb_client *c, size_t size);
/* Unmap the shared segment, and with tell, detach it at the daemon (SHM_DETACH). */
void kvbc_shm_unmap(kvb_client *c, bool tell);
/* Whether [p, p + len) lies inside the mapped shared segment. */
bool kvbc_in_shm(const kvb_client *c, const void *p, size_t len);
/*
 * After a call that used the segment failed with rc: if the daemon no longer knows it
 * (KVB_E_BAD_SHM), keep it mapped in c->lost_* (the caller's buffers in it stay valid
 * until kvb_close()) and forget it, so the next call attaches a new one. Returns true
 * if the call should be tried once more.
 */
bool kvbc_shm_lost(kvb_client *c, int rc, bool used_shm);
/*
 * Map size bytes of the daemon's segment id, whose descriptor the socket at path hands
 * out, with prot and flags: 0 and *out, or -EACCES (no descriptor), -EIO (segment too
 * small), -errno from mmap(); c->err says which. The caller munmap()s it.
 */
int kvbc_map_segment(kvb_client *c, const char *path, uint64_t id, size_t size, int prot,
		     int flags, void **out);
/* The region of this client holding [p, p + len), or NULL. */
struct region *kvbc_region_of(kvb_client *c, const void *p, size_t len);

#endif
