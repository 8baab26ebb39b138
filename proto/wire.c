/* wire — protobuf-c glue for the kvblend header frame; see wire.h. */
#include "proto/wire.h"

#include <errno.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/un.h>

#include "kvblend.pb-c.h"

_Static_assert(KVBP_SHM_PATH_MAX == sizeof(((struct sockaddr_un *)0)->sun_path),
	       "KVBP_SHM_PATH_MAX is a Unix socket path's size");

_Static_assert((int)KVBLEND__OP__SHM_DETACH == (int)KVBP_OP_SHM_DETACH, "op numbering drifted");
_Static_assert((int)KVBLEND__CODE__BUSY == (int)KVBP_BUSY, "code numbering drifted");
_Static_assert((int)KVBLEND__OP__UNPIN == (int)KVBP_OP_UNPIN, "op numbering drifted");
_Static_assert(KVBLEND__DTYPE__F32 == 3, "dtype numbering drifted");

static const char *const op_names[KVBP_OP_COUNT] = {
	[KVBP_OP_NONE] = "none",	       [KVBP_OP_HELLO] = "hello",
	[KVBP_OP_MODEL_REGISTER] = "model_register", [KVBP_OP_MODEL_LIST] = "model_list",
	[KVBP_OP_PUT] = "put",		       [KVBP_OP_GET] = "get",
	[KVBP_OP_LOOKUP] = "lookup",	       [KVBP_OP_DELETE] = "delete",
	[KVBP_OP_STATS] = "stats",	       [KVBP_OP_LIST] = "list",
	[KVBP_OP_SHM_ATTACH] = "shm_attach",   [KVBP_OP_SHM_DETACH] = "shm_detach",
	[KVBP_OP_FUSE_OPEN] = "fuse_open",     [KVBP_OP_FUSE_LAYER] = "fuse_layer",
	[KVBP_OP_FUSE_CLOSE] = "fuse_close",   [KVBP_OP_PIN] = "pin",
	[KVBP_OP_UNPIN] = "unpin",	       [KVBP_OP_FETCH] = "fetch",
	[KVBP_OP_REPLICATE] = "replicate",
};

static const char *const code_names[KVBP_CODE_COUNT] = {
	[KVBP_OK] = "ok",
	[KVBP_BAD_REQUEST] = "bad_request",
	[KVBP_BAD_VERSION] = "bad_version",
	[KVBP_UNKNOWN_OP] = "unknown_op",
	[KVBP_BAD_SHAPE] = "bad_shape",
	[KVBP_UNKNOWN_MODEL] = "unknown_model",
	[KVBP_DTYPE_MISMATCH] = "dtype_mismatch",
	[KVBP_BAD_FRAMES] = "bad_frames",
	[KVBP_TOO_LARGE] = "too_large",
	[KVBP_MODEL_CONFLICT] = "model_conflict",
	[KVBP_NOT_FOUND] = "not_found",
	[KVBP_CORRUPT] = "corrupt",
	[KVBP_FULL] = "full",
	[KVBP_LIMIT] = "limit",
	[KVBP_INTERNAL] = "internal",
	[KVBP_BAD_ARGUMENT] = "bad_argument",
	[KVBP_BAD_SHM] = "bad_shm",
	[KVBP_UNKNOWN_SESSION] = "unknown_session",
	[KVBP_BUSY] = "busy",
};

const char *kvbp_op_name(uint32_t op)
{
	return op < KVBP_OP_COUNT ? op_names[op] : "unknown";
}

const char *kvbp_code_name(uint32_t code)
{
	return code < KVBP_CODE_COUNT ? code_names[code] : "unknown";
}

size_t kvbp_dtype_size(uint32_t dtype)
{
	switch (dtype) {
	case KVBLEND__DTYPE__F16:
	case KVBLEND__DTYPE__BF16:
		return 2;
	case KVBLEND__DTYPE__F32:
		return 4;
	default:
		return 0;
	}
}

const char *kvbp_dtype_name(uint32_t dtype)
{
	switch (dtype) {
	case KVBLEND__DTYPE__F16:
		return "f16";
	case KVBLEND__DTYPE__BF16:
		return "bf16";
	case KVBLEND__DTYPE__F32:
		return "f32";
	default:
		return "unknown";
	}
}

__attribute__((format(printf, 3, 4))) static void set_err(char *err, size_t errlen,
							   const char *fmt, ...)
{
	va_list ap;

	if (!err || !errlen)
		return;
	va_start(ap, fmt);
	vsnprintf(err, errlen, fmt, ap);
	va_end(ap);
}

static void model_to_pb(const struct kvbp_model *m, Kvblend__Model *pb)
{
	pb->name = (char *)m->name;
	KVB_MODEL_DESC_COPY(pb, &m->desc);
	KVB_MODEL_DESC_COPY_LAYERS(pb, &m->desc);
}

static int copy_name(char *dst, const char *src, const char *what, char *err, size_t errlen)
{
	size_t n = src ? strlen(src) : 0;

	if (n > KVBP_NAME_MAX) {
		set_err(err, errlen, "%s is %zu bytes long; the limit is %d", what, n,
			KVBP_NAME_MAX);
		return KVBP_BAD_ARGUMENT;
	}
	memcpy(dst, src ? src : "", n + 1);
	return KVBP_OK;
}

static int model_from_pb(const Kvblend__Model *pb, struct kvbp_model *m, char *err, size_t errlen)
{
	int rc = copy_name(m->name, pb->name, "model name", err, errlen);

	if (rc)
		return rc;
	KVB_MODEL_DESC_COPY(&m->desc, pb);
	KVB_MODEL_DESC_COPY_LAYERS(&m->desc, pb);
	return KVBP_OK;
}

static int pack_message(const ProtobufCMessage *msg, uint8_t **buf, size_t *len)
{
	size_t n = protobuf_c_message_get_packed_size(msg);
	/* malloc(0) may return NULL; an empty header is legal (all defaults). */
	uint8_t *b = malloc(n ? n : 1);

	if (!b)
		return -ENOMEM;
	*len = protobuf_c_message_pack(msg, b);
	*buf = b;
	return 0;
}

int kvbp_request_encode(const struct kvbp_request *req, uint8_t **buf, size_t *len)
{
	Kvblend__Request pb = KVBLEND__REQUEST__INIT;
	Kvblend__Model model = KVBLEND__MODEL__INIT;
	Kvblend__ShmRef shm = KVBLEND__SHM_REF__INIT, shm_out = KVBLEND__SHM_REF__INIT;
	Kvblend__KvLayout land = KVBLEND__KV_LAYOUT__INIT;
	Kvblend__Segment *segs = NULL, **seg_ptrs = NULL;
	ProtobufCBinaryData *hashes = NULL;
	int rc;

	pb.version = req->version;
	pb.request_id = req->request_id;
	pb.op = (Kvblend__Op)req->op;
	if (req->has_model) {
		model_to_pb(&req->model, &model);
		pb.model = &model;
	}
	pb.model_name = (char *)req->model_name;
	if (req->has_hash) {
		pb.hash.data = (uint8_t *)req->hash;
		pb.hash.len = KVBP_HASH_LEN;
	}
	pb.num_tokens = req->num_tokens;
	pb.base_pos = req->base_pos;
	pb.layer_begin = req->layer_begin;
	pb.layer_end = req->layer_end;
	pb.payload_frames = req->payload_frames;
	pb.dtype = (Kvblend__Dtype)req->dtype;
	pb.shm_size = req->shm_size;
	if (req->has_shm) {
		shm.shm_id = req->shm_id;
		shm.offset = req->shm_offset;
		shm.length = req->shm_length;
		pb.shm = &shm;
	}
	pb.metric = req->metric;
	pb.session_id = req->session_id;
	pb.layer = req->layer;
	pb.rows = req->rows;
	pb.rerotate = req->rerotate;
	pb.target_pos = req->target_pos;
	pb.shared_ring = req->shared_ring;
	pb.ttl = req->ttl;
	pb.progress = req->progress;
	pb.reuse_only = req->reuse_only;
	pb.row_stride = req->row_stride;
	pb.check_mode = req->check_mode;
	pb.head_begin = req->head_begin;
	pb.head_count = req->head_count;
	pb.local_only = req->local_only;
	pb.cluster_check = req->cluster_check;
	pb.device_out = req->device_out;
	pb.attention = req->attention;
	pb.recompute = req->recompute;
	pb.n_recompute = req->n_recompute;
	pb.bulk_open = req->bulk_open;
	pb.bulk_aeads = req->bulk_aeads;
	if (req->has_bulk_ticket) {
		pb.bulk_ticket.data = (uint8_t *)req->bulk_ticket;
		pb.bulk_ticket.len = KVBP_BULK_TICKET_LEN;
	}
	pb.bulk_parts = req->bulk_parts;
	pb.n_bulk_parts = req->n_bulk_parts;
	if (req->has_land) {
		land.shm_id = req->land.shm_id;
		land.k_offset = req->land.k_offset;
		land.v_offset = req->land.v_offset;
		land.layer_stride = req->land.layer_stride;
		land.token_stride = req->land.token_stride;
		land.head_stride = req->land.head_stride;
		land.page_tokens = req->land.page_tokens;
		land.page_stride = req->land.page_stride;
		land.pages = req->land.pages;
		land.n_pages = req->land.n_pages;
		land.progress = req->land.progress;
		land.k_token_stride = req->land.k_token_stride;
		land.k_head_stride = req->land.k_head_stride;
		land.k_dim_stride = req->land.k_dim_stride;
		if (req->land.has_device) {
			land.device_handle.data = (uint8_t *)req->land.device_handle;
			land.device_handle.len = KVBP_DEVICE_HANDLE_LEN;
			land.device_pci = (char *)req->land.device_pci;
			land.device_bytes = req->land.device_bytes;
		}
		land.head_begin = req->land.head_begin;
		land.head_count = req->land.head_count;
		pb.land = &land;
	}
	if (req->has_shm_out) {
		shm_out.shm_id = req->shm_out_id;
		shm_out.offset = req->shm_out_offset;
		shm_out.length = req->shm_out_length;
		pb.shm_out = &shm_out;
	}
	pb.check_layers = (uint32_t *)req->check_layers;
	pb.n_check_layers = req->n_checks;
	pb.ratios = (double *)req->ratios;
	pb.n_ratios = req->n_ratios;
	if (req->n_segments) {
		segs = calloc(req->n_segments, sizeof(*segs));
		seg_ptrs = calloc(req->n_segments, sizeof(*seg_ptrs));
		if (!segs || !seg_ptrs) {
			free(segs);
			free(seg_ptrs);
			return -ENOMEM;
		}
		for (size_t i = 0; i < req->n_segments; i++) {
			kvblend__segment__init(&segs[i]);
			if (!req->segments[i].fresh) {
				segs[i].hash.data = (uint8_t *)req->segments[i].hash;
				segs[i].hash.len = KVBP_HASH_LEN;
			}
			segs[i].pos = req->segments[i].pos;
			segs[i].count = req->segments[i].count;
			seg_ptrs[i] = &segs[i];
		}
		pb.segments = seg_ptrs;
		pb.n_segments = req->n_segments;
	}
	if (req->n_hashes) {
		hashes = calloc(req->n_hashes, sizeof(*hashes));
		if (!hashes) {
			free(segs);
			free(seg_ptrs);
			return -ENOMEM;
		}
		for (size_t i = 0; i < req->n_hashes; i++) {
			hashes[i].data = req->hashes[i];
			hashes[i].len = KVBP_HASH_LEN;
		}
		pb.hashes = hashes;
		pb.n_hashes = req->n_hashes;
	}
	rc = pack_message(&pb.base, buf, len);
	free(hashes);
	free(segs);
	free(seg_ptrs);
	return rc;
}

/* bulk_parts off the wire: at most KVBP_BULK_PARTS_MAX (else too_many, named), copied. */
static int parts_copy(const uint64_t *in, size_t n, uint64_t **out, size_t *n_out,
		      int too_many, char *err, size_t errlen)
{
	if (!n)
		return KVBP_OK;
	if (n > KVBP_BULK_PARTS_MAX) {
		set_err(err, errlen, "%zu bulk_parts; the limit is %d", n, KVBP_BULK_PARTS_MAX);
		return too_many;
	}
	*out = malloc(n * sizeof(uint64_t));
	if (!*out) {
		set_err(err, errlen, "out of memory for %zu bulk_parts", n);
		return KVBP_INTERNAL;
	}
	memcpy(*out, in, n * sizeof(uint64_t));
	*n_out = n;
	return KVBP_OK;
}

int kvbp_request_decode(const void *buf, size_t len, struct kvbp_request *out, char *err,
			size_t errlen)
{
	Kvblend__Request *pb;
	struct kvbp_request r;
	int rc = KVBP_OK;

	memset(&r, 0, sizeof(r));
	if (len == 0) {
		set_err(err, errlen, "empty request header frame");
		return KVBP_BAD_REQUEST;
	}
	pb = kvblend__request__unpack(NULL, len, buf);
	if (!pb) {
		set_err(err, errlen, "request header frame (%zu bytes) is not a valid protobuf Request",
			len);
		return KVBP_BAD_REQUEST;
	}
	r.version = pb->version;
	r.request_id = pb->request_id;
	r.op = pb->op;
	if (pb->model) {
		r.has_model = true;
		rc = model_from_pb(pb->model, &r.model, err, errlen);
		if (rc)
			goto out;
	}
	rc = copy_name(r.model_name, pb->model_name, "model name", err, errlen);
	if (rc)
		goto out;
	if (pb->hash.len) {
		if (pb->hash.len != KVBP_HASH_LEN) {
			set_err(err, errlen, "chunk hash is %zu bytes; it must be %d", pb->hash.len,
				KVBP_HASH_LEN);
			rc = KVBP_BAD_ARGUMENT;
			goto out;
		}
		r.has_hash = true;
		memcpy(r.hash, pb->hash.data, KVBP_HASH_LEN);
	}
	r.num_tokens = pb->num_tokens;
	r.base_pos = pb->base_pos;
	r.layer_begin = pb->layer_begin;
	r.layer_end = pb->layer_end;
	r.payload_frames = pb->payload_frames;
	r.dtype = pb->dtype;
	r.shm_size = pb->shm_size;
	if (pb->shm) {
		r.has_shm = true;
		r.shm_id = pb->shm->shm_id;
		r.shm_offset = pb->shm->offset;
		r.shm_length = pb->shm->length;
	}
	r.metric = pb->metric;
	r.session_id = pb->session_id;
	r.layer = pb->layer;
	r.rows = pb->rows;
	r.rerotate = pb->rerotate;
	r.target_pos = pb->target_pos;
	r.shared_ring = pb->shared_ring;
	r.ttl = pb->ttl;
	r.progress = pb->progress;
	r.reuse_only = pb->reuse_only;
	r.row_stride = pb->row_stride;
	r.check_mode = pb->check_mode;
	r.head_begin = pb->head_begin;
	r.head_count = pb->head_count;
	r.local_only = pb->local_only;
	r.cluster_check = pb->cluster_check;
	r.device_out = pb->device_out;
	r.attention = pb->attention;
	r.bulk_open = pb->bulk_open;
	r.bulk_aeads = pb->bulk_aeads;
	if (pb->bulk_ticket.len) {
		if (pb->bulk_ticket.len != KVBP_BULK_TICKET_LEN) {
			set_err(err, errlen, "bulk_ticket is %zu bytes; expected %d",
				pb->bulk_ticket.len, KVBP_BULK_TICKET_LEN);
			rc = KVBP_BAD_ARGUMENT;
			goto out;
		}
		r.has_bulk_ticket = true;
		memcpy(r.bulk_ticket, pb->bulk_ticket.data, KVBP_BULK_TICKET_LEN);
	}
	rc = parts_copy(pb->bulk_parts, pb->n_bulk_parts, &r.bulk_parts, &r.n_bulk_parts,
			KVBP_TOO_LARGE, err, errlen);
	if (rc)
		goto out;
	if (pb->n_recompute > KVBP_RECOMPUTE_MAX) {
		set_err(err, errlen, "%zu recompute tokens; the limit is %u", pb->n_recompute,
			KVBP_RECOMPUTE_MAX);
		rc = KVBP_TOO_LARGE;
		goto out;
	}
	if (pb->n_recompute) {
		r.recompute = malloc(pb->n_recompute * sizeof(int32_t));
		if (!r.recompute)
			goto nomem;
		memcpy(r.recompute, pb->recompute, pb->n_recompute * sizeof(int32_t));
		r.n_recompute = pb->n_recompute;
	}
	if (pb->land) {
		const Kvblend__KvLayout *g = pb->land;

		if (g->n_pages > KVBP_PAGES_MAX) {
			set_err(err, errlen, "%zu pages in a landing layout; the limit is %u",
				g->n_pages, KVBP_PAGES_MAX);
			rc = KVBP_TOO_LARGE;
			goto out;
		}
		r.has_land = true;
		r.land = (struct kvbp_layout){ g->shm_id, g->k_offset, g->v_offset,
					       g->layer_stride, g->token_stride, g->head_stride,
					       g->page_tokens, g->page_stride, NULL, 0,
					       g->progress, g->k_token_stride,
					       g->k_head_stride, g->k_dim_stride };
		r.land.head_begin = g->head_begin;
		r.land.head_count = g->head_count;
		if (g->device_handle.len) {
			size_t pl = g->device_pci ? strlen(g->device_pci) : 0;

			if (g->device_handle.len != KVBP_DEVICE_HANDLE_LEN ||
			    pl >= KVBP_DEVICE_PCI_MAX) {
				set_err(err, errlen, "a landing layout's device handle is %zu "
					"bytes and its PCI bus id %zu characters (must be %d and "
					"under %d)", g->device_handle.len, pl,
					KVBP_DEVICE_HANDLE_LEN, KVBP_DEVICE_PCI_MAX);
				rc = KVBP_BAD_ARGUMENT;
				goto out;
			}
			r.land.has_device = true;
			memcpy(r.land.device_handle, g->device_handle.data,
			       KVBP_DEVICE_HANDLE_LEN);
			if (pl)
				memcpy(r.land.device_pci, g->device_pci, pl + 1);
			r.land.device_bytes = g->device_bytes;
		} else if (g->device_bytes || (g->device_pci && *g->device_pci)) {
			set_err(err, errlen, "a landing layout names a device size or PCI bus "
				"id but no device handle");
			rc = KVBP_BAD_ARGUMENT;
			goto out;
		}
		if (g->n_pages) {
			r.land.pages = malloc(g->n_pages * sizeof(uint32_t));
			if (!r.land.pages)
				goto nomem;
			memcpy(r.land.pages, g->pages, g->n_pages * sizeof(uint32_t));
			r.land.n_pages = g->n_pages;
		}
	}
	if (pb->shm_out) {
		r.has_shm_out = true;
		r.shm_out_id = pb->shm_out->shm_id;
		r.shm_out_offset = pb->shm_out->offset;
		r.shm_out_length = pb->shm_out->length;
	}
	if (pb->n_check_layers > KVBP_CHECKS_MAX || pb->n_ratios > KVBP_CHECKS_MAX) {
		set_err(err, errlen, "%zu check layers and %zu ratios; the limit is %d",
			pb->n_check_layers, pb->n_ratios, KVBP_CHECKS_MAX);
		rc = KVBP_TOO_LARGE;
		goto out;
	}
	if (pb->n_segments > KVBP_SEGMENTS_MAX) {
		set_err(err, errlen, "%zu segments in one request; the limit is %d", pb->n_segments,
			KVBP_SEGMENTS_MAX);
		rc = KVBP_TOO_LARGE;
		goto out;
	}
	if (pb->n_check_layers) {
		r.check_layers = malloc(pb->n_check_layers * sizeof(uint32_t));
		if (!r.check_layers)
			goto nomem;
		memcpy(r.check_layers, pb->check_layers, pb->n_check_layers * sizeof(uint32_t));
		r.n_checks = pb->n_check_layers;
	}
	if (pb->n_ratios) {
		r.ratios = malloc(pb->n_ratios * sizeof(double));
		if (!r.ratios)
			goto nomem;
		memcpy(r.ratios, pb->ratios, pb->n_ratios * sizeof(double));
		r.n_ratios = pb->n_ratios;
	}
	if (pb->n_segments) {
		r.segments = calloc(pb->n_segments, sizeof(*r.segments));
		if (!r.segments)
			goto nomem;
		r.n_segments = pb->n_segments;
		for (size_t i = 0; i < pb->n_segments; i++) {
			const Kvblend__Segment *g = pb->segments[i];

			if (g->hash.len && g->hash.len != KVBP_HASH_LEN) {
				set_err(err, errlen, "segment %zu: chunk hash is %zu bytes; it must be %d",
					i, g->hash.len, KVBP_HASH_LEN);
				rc = KVBP_BAD_ARGUMENT;
				goto out;
			}
			r.segments[i].fresh = g->hash.len == 0;
			if (g->hash.len)
				memcpy(r.segments[i].hash, g->hash.data, KVBP_HASH_LEN);
			r.segments[i].pos = g->pos;
			r.segments[i].count = g->count;
		}
	}
	if (pb->n_hashes) {
		if (pb->n_hashes > KVBP_LOOKUP_MAX) {
			set_err(err, errlen, "%zu hashes in one request; the limit is %d",
				pb->n_hashes, KVBP_LOOKUP_MAX);
			rc = KVBP_TOO_LARGE;
			goto out;
		}
		r.hashes = malloc(pb->n_hashes * KVBP_HASH_LEN);
		if (!r.hashes) {
			set_err(err, errlen, "out of memory for %zu hashes", pb->n_hashes);
			rc = KVBP_INTERNAL;
			goto out;
		}
		for (size_t i = 0; i < pb->n_hashes; i++) {
			if (pb->hashes[i].len != KVBP_HASH_LEN) {
				set_err(err, errlen, "hash %zu is %zu bytes; it must be %d", i,
					pb->hashes[i].len, KVBP_HASH_LEN);
				rc = KVBP_BAD_ARGUMENT;
				goto out;
			}
			memcpy(r.hashes[i], pb->hashes[i].data, KVBP_HASH_LEN);
		}
		r.n_hashes = pb->n_hashes;
	}
	goto out;
nomem:
	set_err(err, errlen, "out of memory decoding a request");
	rc = KVBP_INTERNAL;
out:
	kvblend__request__free_unpacked(pb, NULL);
	if (rc) {
		kvbp_request_clear(&r);
		return rc;
	}
	*out = r;
	return KVBP_OK;
}

int kvbp_request_peek_id(const void *buf, size_t len, uint64_t *id)
{
	Kvblend__Request *pb = len ? kvblend__request__unpack(NULL, len, buf) : NULL;

	if (!pb)
		return -EINVAL;
	*id = pb->request_id;
	kvblend__request__free_unpacked(pb, NULL);
	return 0;
}

void kvbp_request_clear(struct kvbp_request *req)
{
	if (!req)
		return;
	free(req->hashes);
	free(req->segments);
	free(req->check_layers);
	free(req->ratios);
	free(req->land.pages);
	free(req->recompute);
	free(req->bulk_parts);
	req->bulk_parts = NULL;
	req->n_bulk_parts = 0;
	req->recompute = NULL;
	req->n_recompute = 0;
	req->land.pages = NULL;
	req->land.n_pages = 0;
	req->hashes = NULL;
	req->segments = NULL;
	req->check_layers = NULL;
	req->ratios = NULL;
	req->n_hashes = req->n_segments = req->n_checks = req->n_ratios = 0;
}

/* The length of the well-formed UTF-8 sequence at p (RFC 3629, table 3-7 of Unicode), or 0. */
static size_t utf8_seq(const unsigned char *p)
{
	unsigned char c = p[0];
	unsigned char lo = 0x80, hi = 0xbf;
	size_t n;

	if (c < 0x80)
		return 1;
	if (c >= 0xc2 && c <= 0xdf)
		n = 2;
	else if (c >= 0xe0 && c <= 0xef)
		n = 3;
	else if (c >= 0xf0 && c <= 0xf4)
		n = 4;
	else
		return 0;
	if (c == 0xe0)
		lo = 0xa0; /* overlong */
	else if (c == 0xed)
		hi = 0x9f; /* surrogates */
	else if (c == 0xf0)
		lo = 0x90; /* overlong */
	else if (c == 0xf4)
		hi = 0x8f; /* past U+10FFFF */
	if (p[1] < lo || p[1] > hi)
		return 0;
	for (size_t i = 2; i < n; i++)
		if (p[i] < 0x80 || p[i] > 0xbf)
			return 0;
	return n;
}

bool kvbp_utf8_escape(const char *in, char *out, size_t cap)
{
	const unsigned char *p = (const unsigned char *)in;
	size_t o = 0;
	bool changed = false;

	if (!cap)
		return *in != 0;
	while (*p) {
		size_t n = utf8_seq(p);
		char esc[5];
		const char *src = (const char *)p;
		size_t len = n;

		if (!n) {
			snprintf(esc, sizeof(esc), "\\x%02x", *p);
			src = esc;
			len = 4;
			n = 1;
			changed = true;
		}
		if (o + len >= cap) {
			changed = true;
			break;
		}
		memcpy(out + o, src, len);
		o += len;
		p += n;
	}
	out[o] = 0;
	return changed;
}

int kvbp_reply_encode(const struct kvbp_reply *rep, uint8_t **buf, size_t *len)
{
	char message[KVBP_MESSAGE_MAX];
	Kvblend__Reply pb = KVBLEND__REPLY__INIT;
	Kvblend__Model *models = NULL, **model_ptrs = NULL;
	Kvblend__ChunkInfo *chunks = NULL, **chunk_ptrs = NULL;
	Kvblend__Stat *stats = NULL, **stat_ptrs = NULL;
	Kvblend__Member *members = NULL, **member_ptrs = NULL;
	int rc = -ENOMEM;

	pb.version = rep->version;
	pb.request_id = rep->request_id;
	pb.code = (Kvblend__Code)rep->code;
	pb.message = (char *)rep->message;
	if (kvbp_utf8_escape(rep->message, message, sizeof(message)))
		pb.message = message;
	pb.server_version = (char *)rep->server_version;
	pb.existed = rep->existed;
	pb.payload_frames = rep->payload_frames;
	pb.layer_begin = rep->layer_begin;
	pb.layer_end = rep->layer_end;
	pb.shm_id = rep->shm_id;
	pb.shm_size = rep->shm_size;
	pb.shm_name = (char *)rep->shm_name;
	pb.session_id = rep->session_id;
	pb.num_tokens = rep->num_tokens;
	pb.selection = rep->selection;
	pb.n_selection = rep->n_selection;
	pb.has_selection = rep->has_selection;
	pb.dropped = rep->dropped;
	pb.n_dropped = rep->n_dropped;
	pb.deviation = rep->deviation;
	pb.n_deviation = rep->n_deviation;
	pb.has_fused = rep->has_fused;
	pb.next_layer = rep->next_layer;
	pb.rows_next = rep->rows_next;
	pb.ring_slot = rep->ring_slot;
	pb.ring_slots = rep->ring_slots;
	pb.slot_bytes = rep->slot_bytes;
	pb.land_k_strided = rep->land_k_strided;
	pb.land_heads = rep->land_heads;
	pb.bulk_port = rep->bulk_port;
	pb.bulk_bytes = rep->bulk_bytes;
	pb.bulk_put = rep->bulk_put;
	pb.bulk_parts = rep->bulk_parts;
	pb.n_bulk_parts = rep->n_bulk_parts;
	if (rep->bulk_port) {
		pb.bulk_ticket.data = (uint8_t *)rep->bulk_ticket;
		pb.bulk_ticket.len = KVBP_BULK_TICKET_LEN;
	}
	if (rep->bulk_port && rep->has_bulk_key) {
		pb.bulk_key.data = (uint8_t *)rep->bulk_key;
		pb.bulk_key.len = KVBP_BULK_KEY_LEN;
		pb.bulk_aead = rep->bulk_aead;
	}
	if (rep->has_ipc) {
		pb.ipc_handle.data = (uint8_t *)rep->ipc_handle;
		pb.ipc_handle.len = KVBP_IPC_HANDLE_LEN;
		pb.ipc_offset = rep->ipc_offset;
		pb.device_pci = (char *)rep->device_pci;
	}
	if (rep->n_models) {
		models = calloc(rep->n_models, sizeof(*models));
		model_ptrs = calloc(rep->n_models, sizeof(*model_ptrs));
		if (!models || !model_ptrs)
			goto out;
		for (size_t i = 0; i < rep->n_models; i++) {
			kvblend__model__init(&models[i]);
			model_to_pb(&rep->models[i], &models[i]);
			model_ptrs[i] = &models[i];
		}
		pb.models = model_ptrs;
		pb.n_models = rep->n_models;
	}
	if (rep->n_chunks) {
		chunks = calloc(rep->n_chunks, sizeof(*chunks));
		chunk_ptrs = calloc(rep->n_chunks, sizeof(*chunk_ptrs));
		if (!chunks || !chunk_ptrs)
			goto out;
		for (size_t i = 0; i < rep->n_chunks; i++) {
			const struct kvbp_chunk *c = &rep->chunks[i];

			kvblend__chunk_info__init(&chunks[i]);
			chunks[i].hash.data = (uint8_t *)c->hash;
			chunks[i].hash.len = KVBP_HASH_LEN;
			chunks[i].found = c->found;
			chunks[i].num_tokens = c->num_tokens;
			chunks[i].base_pos = c->base_pos;
			chunks[i].num_layers = c->num_layers;
			chunks[i].raw_bytes = c->raw_bytes;
			chunks[i].stored_bytes = c->stored_bytes;
			chunk_ptrs[i] = &chunks[i];
		}
		pb.chunks = chunk_ptrs;
		pb.n_chunks = rep->n_chunks;
	}
	if (rep->n_stats) {
		stats = calloc(rep->n_stats, sizeof(*stats));
		stat_ptrs = calloc(rep->n_stats, sizeof(*stat_ptrs));
		if (!stats || !stat_ptrs)
			goto out;
		for (size_t i = 0; i < rep->n_stats; i++) {
			kvblend__stat__init(&stats[i]);
			stats[i].name = (char *)rep->stats[i].name;
			stats[i].value = rep->stats[i].value;
			stat_ptrs[i] = &stats[i];
		}
		pb.stats = stat_ptrs;
		pb.n_stats = rep->n_stats;
	}
	if (rep->n_members) {
		members = calloc(rep->n_members, sizeof(*members));
		member_ptrs = calloc(rep->n_members, sizeof(*member_ptrs));
		if (!members || !member_ptrs)
			goto out;
		for (size_t i = 0; i < rep->n_members; i++) {
			const struct kvbp_member *m = &rep->members[i];

			kvblend__member__init(&members[i]);
			members[i].id = (char *)m->id;
			members[i].endpoint = (char *)m->endpoint;
			members[i].state = m->state;
			members[i].pushes_owed = m->pushes_owed;
			members[i].last_reply_age_ms = m->last_reply_age_ms;
			members[i].chunks = m->chunks;
			members[i].stored_bytes = m->stored_bytes;
			member_ptrs[i] = &members[i];
		}
		pb.members = member_ptrs;
		pb.n_members = rep->n_members;
	}
	rc = pack_message(&pb.base, buf, len);
out:
	free(models);
	free(model_ptrs);
	free(chunks);
	free(chunk_ptrs);
	free(stats);
	free(stat_ptrs);
	free(members);
	free(member_ptrs);
	return rc;
}

int kvbp_reply_decode(const void *buf, size_t len, struct kvbp_reply *out, char *err,
		      size_t errlen)
{
	Kvblend__Reply *pb;
	struct kvbp_reply r;
	int rc = KVBP_OK;

	memset(&r, 0, sizeof(r));
	pb = kvblend__reply__unpack(NULL, len, buf);
	if (!pb) {
		set_err(err, errlen, "reply header frame (%zu bytes) is not a valid protobuf Reply",
			len);
		return KVBP_BAD_REQUEST;
	}
	r.version = pb->version;
	r.request_id = pb->request_id;
	r.code = pb->code;
	snprintf(r.message, sizeof(r.message), "%s", pb->message ? pb->message : "");
	snprintf(r.server_version, sizeof(r.server_version), "%s",
		 pb->server_version ? pb->server_version : "");
	if (pb->shm_name && strlen(pb->shm_name) >= sizeof(r.shm_name)) {
		/* cut short, it would name another socket (a 64-byte field once did) */
		set_err(err, errlen, "reply's shared-memory socket path is %zu bytes; at most %zu",
			strlen(pb->shm_name), sizeof(r.shm_name) - 1);
		kvblend__reply__free_unpacked(pb, NULL);
		return KVBP_BAD_REQUEST;
	}
	snprintf(r.shm_name, sizeof(r.shm_name), "%s", pb->shm_name ? pb->shm_name : "");
	r.existed = pb->existed;
	r.payload_frames = pb->payload_frames;
	r.layer_begin = pb->layer_begin;
	r.layer_end = pb->layer_end;
	r.shm_id = pb->shm_id;
	r.shm_size = pb->shm_size;
	r.session_id = pb->session_id;
	r.num_tokens = pb->num_tokens;
	r.has_selection = pb->has_selection;
	r.has_fused = pb->has_fused;
	r.next_layer = pb->next_layer;
	r.rows_next = pb->rows_next;
	r.ring_slot = pb->ring_slot;
	r.ring_slots = pb->ring_slots;
	r.slot_bytes = pb->slot_bytes;
	r.land_k_strided = pb->land_k_strided;
	r.land_heads = pb->land_heads;
	r.bulk_bytes = pb->bulk_bytes;
	r.bulk_put = pb->bulk_put;
	if (pb->bulk_port) {
		if (pb->bulk_port > 65535 || pb->bulk_ticket.len != KVBP_BULK_TICKET_LEN ||
		    (pb->bulk_key.len && pb->bulk_key.len != KVBP_BULK_KEY_LEN) ||
		    pb->bulk_aead > KVBP_AEAD_MAX) {
			set_err(err, errlen, "reply's bulk port %u, ticket of %zu bytes, key of %zu "
				"bytes, cipher %u; expected a port, %d and 0 or %d bytes, cipher 0 "
				"to %u", pb->bulk_port, pb->bulk_ticket.len, pb->bulk_key.len,
				pb->bulk_aead, KVBP_BULK_TICKET_LEN, KVBP_BULK_KEY_LEN, KVBP_AEAD_MAX);
			kvblend__reply__free_unpacked(pb, NULL);
			return KVBP_BAD_REQUEST;
		}
		r.bulk_port = pb->bulk_port;
		memcpy(r.bulk_ticket, pb->bulk_ticket.data, KVBP_BULK_TICKET_LEN);
		r.has_bulk_key = pb->bulk_key.len == KVBP_BULK_KEY_LEN;
		if (r.has_bulk_key) {
			memcpy(r.bulk_key, pb->bulk_key.data, KVBP_BULK_KEY_LEN);
			r.bulk_aead = pb->bulk_aead;
		}
	}
	if (pb->ipc_handle.len) {
		if (pb->ipc_handle.len != KVBP_IPC_HANDLE_LEN || !pb->device_pci ||
		    strlen(pb->device_pci) >= sizeof(r.device_pci)) {
			set_err(err, errlen, "reply's CUDA IPC handle is %zu bytes with device '%.40s'; "
				"expected %d bytes and a PCI bus id", pb->ipc_handle.len,
				pb->device_pci ? pb->device_pci : "", KVBP_IPC_HANDLE_LEN);
			kvblend__reply__free_unpacked(pb, NULL);
			return KVBP_BAD_REQUEST;
		}
		r.has_ipc = true;
		memcpy(r.ipc_handle, pb->ipc_handle.data, KVBP_IPC_HANDLE_LEN);
		r.ipc_offset = pb->ipc_offset;
		snprintf(r.device_pci, sizeof(r.device_pci), "%s", pb->device_pci);
	}
	if (pb->n_selection) {
		r.selection = malloc(pb->n_selection * sizeof(int32_t));
		if (!r.selection)
			goto nomem;
		memcpy(r.selection, pb->selection, pb->n_selection * sizeof(int32_t));
		r.n_selection = pb->n_selection;
	}
	rc = parts_copy(pb->bulk_parts, pb->n_bulk_parts, &r.bulk_parts, &r.n_bulk_parts,
			KVBP_BAD_REQUEST, err, errlen);
	if (rc)
		goto out;
	if (pb->n_dropped) {
		r.dropped = malloc(pb->n_dropped * sizeof(int32_t));
		if (!r.dropped)
			goto nomem;
		memcpy(r.dropped, pb->dropped, pb->n_dropped * sizeof(int32_t));
		r.n_dropped = pb->n_dropped;
	}
	if (pb->n_deviation) {
		r.deviation = malloc(pb->n_deviation * sizeof(float));
		if (!r.deviation)
			goto nomem;
		memcpy(r.deviation, pb->deviation, pb->n_deviation * sizeof(float));
		r.n_deviation = pb->n_deviation;
	}
	if (pb->n_models) {
		r.models = calloc(pb->n_models, sizeof(*r.models));
		if (!r.models)
			goto nomem;
		r.n_models = pb->n_models;
		for (size_t i = 0; i < pb->n_models; i++) {
			rc = model_from_pb(pb->models[i], &r.models[i], err, errlen);
			if (rc)
				goto out;
		}
	}
	if (pb->n_chunks) {
		r.chunks = calloc(pb->n_chunks, sizeof(*r.chunks));
		if (!r.chunks)
			goto nomem;
		r.n_chunks = pb->n_chunks;
		for (size_t i = 0; i < pb->n_chunks; i++) {
			const Kvblend__ChunkInfo *c = pb->chunks[i];

			if (c->hash.len == KVBP_HASH_LEN)
				memcpy(r.chunks[i].hash, c->hash.data, KVBP_HASH_LEN);
			r.chunks[i].found = c->found;
			r.chunks[i].num_tokens = c->num_tokens;
			r.chunks[i].base_pos = c->base_pos;
			r.chunks[i].num_layers = c->num_layers;
			r.chunks[i].raw_bytes = c->raw_bytes;
			r.chunks[i].stored_bytes = c->stored_bytes;
		}
	}
	if (pb->n_stats) {
		r.stats = calloc(pb->n_stats, sizeof(*r.stats));
		if (!r.stats)
			goto nomem;
		r.n_stats = pb->n_stats;
		for (size_t i = 0; i < pb->n_stats; i++) {
			snprintf(r.stats[i].name, sizeof(r.stats[i].name), "%s",
				 pb->stats[i]->name ? pb->stats[i]->name : "");
			r.stats[i].value = pb->stats[i]->value;
		}
	}
	if (pb->n_members) {
		r.members = calloc(pb->n_members, sizeof(*r.members));
		if (!r.members)
			goto nomem;
		r.n_members = pb->n_members;
		for (size_t i = 0; i < pb->n_members; i++) {
			const Kvblend__Member *m = pb->members[i];

			/* Strings longer than the fields are cut, never overrun. */
			snprintf(r.members[i].id, sizeof(r.members[i].id), "%s", m->id ? m->id : "");
			snprintf(r.members[i].endpoint, sizeof(r.members[i].endpoint), "%s",
				 m->endpoint ? m->endpoint : "");
			r.members[i].state = m->state;
			r.members[i].pushes_owed = m->pushes_owed;
			r.members[i].last_reply_age_ms = m->last_reply_age_ms;
			r.members[i].chunks = m->chunks;
			r.members[i].stored_bytes = m->stored_bytes;
		}
	}
	goto out;
nomem:
	set_err(err, errlen, "out of memory decoding reply");
	rc = KVBP_INTERNAL;
out:
	kvblend__reply__free_unpacked(pb, NULL);
	if (rc) {
		kvbp_reply_clear(&r);
		return rc;
	}
	*out = r;
	return KVBP_OK;
}

void kvbp_reply_clear(struct kvbp_reply *rep)
{
	if (!rep)
		return;
	free(rep->models);
	free(rep->chunks);
	free(rep->stats);
	free(rep->members);
	rep->members = NULL;
	rep->n_members = 0;
	free(rep->selection);
	free(rep->dropped);
	free(rep->deviation);
	rep->deviation = NULL;
	rep->n_deviation = 0;
	free(rep->bulk_parts);
	rep->bulk_parts = NULL;
	rep->n_bulk_parts = 0;
	rep->dropped = NULL;
	rep->n_dropped = 0;
	rep->models = NULL;
	rep->chunks = NULL;
	rep->stats = NULL;
	rep->selection = NULL;
	rep->n_models = rep->n_chunks = rep->n_stats = rep->n_selection = 0;
}
