/*
 * wire — encode and decode the header frame of kvblend messages.
 *
 * Frame 1 of every request and reply is a protobuf message (proto/kvblend.proto).
 * This module converts between those bytes and the plain C structs below, so
 * that protobuf-c types never leave wire.c. Payload frames are not handled here.
 */
#ifndef KVBLEND_PROTO_WIRE_H
#define KVBLEND_PROTO_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/model_desc.h"

#define KVBP_VERSION 1
/*
 * Requests a daemon must understand whole or refuse go out as version 2: a landing
 * with a head range or into device memory, whose fields an older daemon (which
 * takes version 1 only) would ignore and then write the node's memory by the wrong
 * layout. A daemon takes versions KVBP_VERSION .. KVBP_VERSION_MAX and replies 1.
 */
#define KVBP_VERSION_MAX 2
#define KVBP_HASH_LEN 32
#define KVBP_NAME_MAX 64
/* The shared-memory descriptor socket's path, NUL included: a Unix socket path's most
 * (sizeof sockaddr_un.sun_path on Linux). */
#define KVBP_SHM_PATH_MAX 108
#define KVBP_MESSAGE_MAX 256
/* Upper bound on hashes in one LOOKUP; the message size limit applies too. */
#define KVBP_LOOKUP_MAX 65536
/* Upper bounds on a fuse request's segments and check layers. */
#define KVBP_SEGMENTS_MAX 4096
#define KVBP_CHECKS_MAX 64
/* Fuse metrics (Request.metric). */
#define KVBP_METRIC_VALUE 0
#define KVBP_METRIC_KEY 1
#define KVBP_METRIC_ATTENTION 2
/* Tokens a FUSE_OPEN's recompute list may name (the daemon checks them against the session). */
#define KVBP_RECOMPUTE_MAX (1u << 24)
/* Upper bound on the block table of a landing layout (pages of a session). */
#define KVBP_PAGES_MAX (1u << 20)
/* A CUDA IPC memory handle, and room for a PCI bus id ("0000:3b:00.0") with its NUL. */
#define KVBP_DEVICE_HANDLE_LEN 64
/* The 8-byte request on the descriptor socket that hands a descriptor in (daemon/shm.h);
 * any other value asks for that segment's descriptor. */
#define KVBP_DEPOSIT_REQUEST UINT64_C(0xfffffffffffffffe)
#define KVBP_DEVICE_PCI_MAX 32
/*
 * The 32-bit progress word of a landing fuse session: layers 0 .. (v & KVBP_LAND_COUNT)-1
 * are in place; with KVBP_LAND_FAILED set landing stopped, and bits 24..30 hold the
 * reply code saying why.
 */
#define KVBP_LAND_FAILED 0x80000000u
#define KVBP_LAND_COUNT 0x00ffffffu
/* A bulk connection's ticket and AES-256-GCM key (docs/protocol.md#bulk-connections). */
#define KVBP_BULK_TICKET_LEN 16
#define KVBP_BULK_KEY_LEN 32
#define KVBP_BULK_PARTS_MAX 4096 /* parts of a bulk payload named in one message (layers) */
/* A sealed bulk connection's cipher (Reply.bulk_aead). */
#define KVBP_AEAD_AES256GCM 0u
#define KVBP_AEAD_AEGIS128L 1u	/* under the key's first 16 bytes */
#define KVBP_AEAD_AEGIS128X2 2u /* likewise */
#define KVBP_AEAD_MAX KVBP_AEAD_AEGIS128X2

enum kvbp_op {
	KVBP_OP_NONE = 0,
	KVBP_OP_HELLO = 1,
	KVBP_OP_MODEL_REGISTER = 2,
	KVBP_OP_MODEL_LIST = 3,
	KVBP_OP_PUT = 4,
	KVBP_OP_GET = 5,
	KVBP_OP_LOOKUP = 6,
	KVBP_OP_DELETE = 7,
	KVBP_OP_STATS = 8,
	KVBP_OP_LIST = 9,
	KVBP_OP_SHM_ATTACH = 10,
	KVBP_OP_SHM_DETACH = 11,
	KVBP_OP_FUSE_OPEN = 12,
	KVBP_OP_FUSE_LAYER = 13,
	KVBP_OP_FUSE_CLOSE = 14,
	KVBP_OP_PIN = 15,
	KVBP_OP_UNPIN = 16,
	KVBP_OP_FETCH = 17,
	KVBP_OP_REPLICATE = 18,
	KVBP_OP_COUNT
};

/* Reply codes, as on the wire (enum Code in kvblend.proto). */
enum kvbp_code {
	KVBP_OK = 0,
	KVBP_BAD_REQUEST = 1,
	KVBP_BAD_VERSION = 2,
	KVBP_UNKNOWN_OP = 3,
	KVBP_BAD_SHAPE = 4,
	KVBP_UNKNOWN_MODEL = 5,
	KVBP_DTYPE_MISMATCH = 6,
	KVBP_BAD_FRAMES = 7,
	KVBP_TOO_LARGE = 8,
	KVBP_MODEL_CONFLICT = 9,
	KVBP_NOT_FOUND = 10,
	KVBP_CORRUPT = 11,
	KVBP_FULL = 12,
	KVBP_LIMIT = 13,
	KVBP_INTERNAL = 14,
	KVBP_BAD_ARGUMENT = 15,
	KVBP_BAD_SHM = 16,
	KVBP_UNKNOWN_SESSION = 17,
	KVBP_BUSY = 18,
	KVBP_CODE_COUNT
};

/* A model on the wire: its name and its description (common/model_desc.h). */
struct kvbp_model {
	char name[KVBP_NAME_MAX + 1];
	struct kvb_model_desc desc;
};

struct kvbp_chunk {
	uint8_t hash[KVBP_HASH_LEN];
	bool found;
	uint32_t num_tokens;
	uint32_t base_pos;
	uint32_t num_layers;
	uint64_t raw_bytes;
	uint64_t stored_bytes;
};

struct kvbp_stat {
	char name[64];
	double value;
};

#define KVBP_ENDPOINT_MAX 256

struct kvbp_member {
	char id[KVBP_NAME_MAX + 1];
	char endpoint[KVBP_ENDPOINT_MAX];
	int32_t state; /* 1 alive, 0 suspect, -1 gone */
	uint64_t pushes_owed;
	double last_reply_age_ms; /* -1: never */
	uint64_t chunks, stored_bytes;
};

struct kvbp_segment {
	bool fresh; /* no hash: count fresh tokens */
	uint8_t hash[KVBP_HASH_LEN];
	uint32_t pos;
	uint32_t count;
};

/* KvLayout in kvblend.proto: where a landing fuse session writes fused K and V. */
struct kvbp_layout {
	uint64_t shm_id;
	uint64_t k_offset;
	uint64_t v_offset;
	uint64_t layer_stride;
	uint64_t token_stride;
	uint64_t head_stride;
	uint32_t page_tokens;
	uint64_t page_stride;
	uint32_t *pages; /* owned by a decoded request */
	size_t n_pages;
	uint64_t progress;
	/* K's own strides when k_dim_stride > 0 (else K is laid out like V) */
	uint64_t k_token_stride;
	uint64_t k_head_stride;
	uint64_t k_dim_stride;
	/* landing into device memory (has_device): the node's allocation by its CUDA IPC
	 * memory handle, its device's PCI bus id and size; offsets are into it, and the
	 * segment shm_id holds only the progress word */
	bool has_device;
	uint8_t device_handle[KVBP_DEVICE_HANDLE_LEN];
	char device_pci[KVBP_DEVICE_PCI_MAX];
	uint64_t device_bytes;
	/* the node's heads: stored heads [head_begin, head_begin + head_count); 0: all */
	uint32_t head_begin, head_count;
};

struct kvbp_request {
	uint32_t version;
	uint64_t request_id;
	uint32_t op;
	bool has_model;
	struct kvbp_model model;
	char model_name[KVBP_NAME_MAX + 1];
	bool has_hash;
	uint8_t hash[KVBP_HASH_LEN];
	uint32_t num_tokens;
	uint32_t base_pos;
	uint32_t layer_begin;
	uint32_t layer_end;
	uint32_t payload_frames;
	uint32_t dtype;
	uint8_t (*hashes)[KVBP_HASH_LEN]; /* owned, freed by kvbp_request_clear() */
	size_t n_hashes;
	bool has_shm;
	uint64_t shm_id;
	uint64_t shm_offset;
	uint64_t shm_length;
	uint64_t shm_size;
	/* fuse */
	struct kvbp_segment *segments; /* owned */
	size_t n_segments;
	uint32_t *check_layers; /* owned */
	size_t n_checks;
	double *ratios; /* owned, n_ratios may differ from n_checks: checked by the handler */
	size_t n_ratios;
	uint32_t metric;
	uint64_t session_id;
	uint32_t layer;
	uint32_t rows;
	bool has_shm_out;
	uint64_t shm_out_id;
	uint64_t shm_out_offset;
	uint64_t shm_out_length;
	bool rerotate;
	uint32_t target_pos;
	bool shared_ring;
	uint32_t ttl; /* PIN: seconds */
	/* GET into shared memory: 1 + the segment offset of a 64-bit word where the daemon
	 * publishes how many bytes are ready, so the client can copy while it decodes */
	uint64_t progress;
	bool has_land; /* FUSE_OPEN into the node's buffers */
	struct kvbp_layout land;
	bool reuse_only;
	uint64_t row_stride;
	uint32_t check_mode; /* FUSE_LAYER, landing check: 0 select, 1 deviation, 2 select by */
	/* GET: stored heads [head_begin, head_begin + head_count) only; 0: every head */
	uint32_t head_begin, head_count;
	bool local_only; /* no cluster fetch: set by daemons calling each other */
	bool device_out; /* FUSE_OPEN: export the device ring; FUSE_LAYER: leave the layer there */
	bool attention;	 /* FUSE_LAYER: the last payload frame is A (metric attention) */
	int32_t *recompute; /* FUSE_OPEN, reuse_only: cached tokens the node recomputes (owned) */
	size_t n_recompute;
	bool cluster_check; /* STATS, HELLO: run the replication check (kvblend cluster check) */
	bool bulk_open; /* HELLO: open a bulk connection */
	uint32_t bulk_aeads; /* HELLO with bulk_open: 1 << KVBP_AEAD_* the client can open */
	bool has_bulk_ticket; /* GET: send the payload on this bulk connection; PUT: it comes there */
	uint8_t bulk_ticket[KVBP_BULK_TICKET_LEN];
	/* REPLICATE with a bulk ticket: each layer's stored bytes, in order (at most
	 * KVBP_BULK_PARTS_MAX); the caller's array on encode, owned on decode (freed by
	 * kvbp_request_clear()) */
	uint64_t *bulk_parts;
	size_t n_bulk_parts;
};

#define KVBP_IPC_HANDLE_LEN 64 /* a CUDA IPC memory handle */

struct kvbp_reply {
	uint32_t version;
	uint64_t request_id;
	uint32_t code;
	char message[KVBP_MESSAGE_MAX];
	char server_version[32];
	struct kvbp_model *models; /* owned arrays, freed by kvbp_reply_clear() */
	size_t n_models;
	struct kvbp_chunk *chunks;
	size_t n_chunks;
	struct kvbp_stat *stats;
	size_t n_stats;
	struct kvbp_member *members; /* owned */
	size_t n_members;
	bool existed;
	uint32_t payload_frames;
	uint32_t layer_begin;
	uint32_t layer_end;
	uint64_t shm_id;
	uint64_t shm_size;
	char shm_name[KVBP_SHM_PATH_MAX]; /* the descriptor socket's path */
	uint64_t session_id;
	uint32_t num_tokens;
	int32_t *selection; /* owned */
	size_t n_selection;
	bool has_selection;
	bool has_fused;
	uint32_t next_layer;
	uint32_t rows_next;
	uint32_t ring_slot;
	uint32_t ring_slots;
	uint64_t slot_bytes;
	int32_t *dropped; /* owned */
	size_t n_dropped;
	float *deviation; /* owned: FUSE_LAYER with check_mode 1 */
	size_t n_deviation;
	bool has_ipc; /* FUSE_OPEN: the device ring, exported */
	uint8_t ipc_handle[KVBP_IPC_HANDLE_LEN];
	uint64_t ipc_offset;
	char device_pci[32]; /* "0000:41:00.0" */
	bool land_k_strided; /* FUSE_OPEN: the landing layout's K strides are honoured */
	bool land_heads;     /* FUSE_OPEN: the landing layout's head range is honoured */
	uint32_t bulk_port; /* HELLO with bulk_open: 0 = no bulk connection */
	uint8_t bulk_ticket[KVBP_BULK_TICKET_LEN];
	bool has_bulk_key; /* sealed bulk records (the HELLO came over CURVE) */
	uint8_t bulk_key[KVBP_BULK_KEY_LEN];
	uint32_t bulk_aead; /* with bulk_key: KVBP_AEAD_* */
	uint64_t bulk_bytes; /* GET with a bulk ticket: payload bytes sent there */
	bool bulk_put; /* HELLO with bulk_open: PUT payloads may come on the connection */
	uint64_t *bulk_parts; /* FETCH with a bulk ticket: each layer's stored bytes (owned) */
	size_t n_bulk_parts;
};

/*
 * Encode into a freshly malloc'd buffer (*buf, *len); the caller frees it.
 * Returns 0, or -ENOMEM.
 */
int kvbp_request_encode(const struct kvbp_request *req, uint8_t **buf, size_t *len);
/* (A message that is not valid UTF-8, e.g. one naming a request's bytes, goes out with
 * kvbp_utf8_escape applied: proto3 strings must be UTF-8, and protobuf's C++ and upb
 * parsers refuse a reply whose string is not.) */
int kvbp_reply_encode(const struct kvbp_reply *rep, uint8_t **buf, size_t *len);

/*
 * Copy the NUL-terminated in to out[0..cap) as valid UTF-8: every byte that does not
 * start a well-formed sequence (RFC 3629: no overlong forms, surrogates or code points
 * past U+10FFFF) becomes the four characters \xNN; cut at a character's boundary
 * when it does not fit. Returns true when anything was escaped or cut.
 */
bool kvbp_utf8_escape(const char *in, char *out, size_t cap);

/*
 * Decode len bytes into *out (zeroed first). Returns KVBP_OK, or a positive
 * kvbp_code (KVBP_BAD_REQUEST for bytes that are not a header, KVBP_BAD_ARGUMENT
 * for a field out of range) with a message naming the problem written to err.
 * On failure *out holds nothing that needs clearing.
 */
int kvbp_request_decode(const void *buf, size_t len, struct kvbp_request *out, char *err,
			size_t errlen);
int kvbp_reply_decode(const void *buf, size_t len, struct kvbp_reply *out, char *err,
		      size_t errlen);

/*
 * The request_id of a header that kvbp_request_decode() refused, so that the error
 * reply can still name the request: 0 and *id when the bytes are a protobuf Request
 * at all (whatever their fields), else -EINVAL and *id untouched.
 */
int kvbp_request_peek_id(const void *buf, size_t len, uint64_t *id);

/* Free the arrays a decoded or hand-built message owns. Accept NULL. */
void kvbp_request_clear(struct kvbp_request *req);
void kvbp_reply_clear(struct kvbp_reply *rep);

/* Name of an operation or a code, for logs and stats ("put", "not_found"). */
const char *kvbp_op_name(uint32_t op);
const char *kvbp_code_name(uint32_t code);

/* Bytes per element of a wire dtype, 0 for an unknown one. */
size_t kvbp_dtype_size(uint32_t dtype);
const char *kvbp_dtype_name(uint32_t dtype);

#endif
