/* samples — well-formed requests of every operation; see samples.h. */
#include "tests/fuzz/samples.h"

#include <stdio.h>
#include <string.h>

static uint8_t sample_hashes[3][KVBP_HASH_LEN] = {
	{ 0x01, 0x02, 0x03, 0x04, 0x05, 0x06, 0x07, 0x08, 0x09, 0x0a, 0x0b, 0x0c, 0x0d, 0x0e, 0x0f,
	  0x10, 0x11, 0x12, 0x13, 0x14, 0x15, 0x16, 0x17, 0x18, 0x19, 0x1a, 0x1b, 0x1c, 0x1d, 0x1e,
	  0x1f, 0x20 },
	{ 0xff, 0xee, 0xdd, 0xcc, 0xbb, 0xaa, 0x99, 0x88 },
	{ 0x00 },
};

static struct kvbp_segment sample_segments[3] = {
	{ .fresh = false, .hash = { 0x01, 0x02, 0x03 }, .pos = 0, .count = 0 },
	{ .fresh = true, .pos = 10, .count = 3 },
	{ .fresh = false, .hash = { 0xff, 0xee }, .pos = 13, .count = 0 },
};

static uint32_t sample_checks[2] = { 1, 2 };
static double sample_ratios[2] = { 0.5, 0.25 };

enum sample_id {
	S_HELLO,
	S_REGISTER_NEOX,
	S_REGISTER_YARN,
	S_REGISTER_LLAMA3,
	S_REGISTER_LINEAR,
	S_REGISTER_DYNAMIC,
	S_MODEL_LIST,
	S_PUT_FRAMES,
	S_PUT_SHM,
	S_GET,
	S_GET_RANGE_REROTATE,
	S_GET_SHM_PROGRESS,
	S_LOOKUP,
	S_DELETE,
	S_STATS,
	S_LIST,
	S_SHM_ATTACH,
	S_SHM_DETACH,
	S_FUSE_OPEN,
	S_FUSE_OPEN_SHARED_RING,
	S_FUSE_LAYER,
	S_FUSE_LAYER_SHM,
	S_FUSE_CLOSE,
	S_PIN,
	S_UNPIN,
	S_BAD_VERSION,
	S_UNKNOWN_OP,
	S_COUNT
};

static const char *const sample_names[S_COUNT] = {
	[S_HELLO] = "hello",
	[S_REGISTER_NEOX] = "model_register-neox-f16",
	[S_REGISTER_YARN] = "model_register-gptj-yarn-f32",
	[S_REGISTER_LLAMA3] = "model_register-llama3-bf16-pre-rope",
	[S_REGISTER_LINEAR] = "model_register-linear",
	[S_REGISTER_DYNAMIC] = "model_register-dynamic",
	[S_MODEL_LIST] = "model_list",
	[S_PUT_FRAMES] = "put-frames",
	[S_PUT_SHM] = "put-shm",
	[S_GET] = "get",
	[S_GET_RANGE_REROTATE] = "get-range-rerotate",
	[S_GET_SHM_PROGRESS] = "get-shm-progress",
	[S_LOOKUP] = "lookup",
	[S_DELETE] = "delete",
	[S_STATS] = "stats",
	[S_LIST] = "list",
	[S_SHM_ATTACH] = "shm_attach",
	[S_SHM_DETACH] = "shm_detach",
	[S_FUSE_OPEN] = "fuse_open",
	[S_FUSE_OPEN_SHARED_RING] = "fuse_open-shared-ring",
	[S_FUSE_LAYER] = "fuse_layer",
	[S_FUSE_LAYER_SHM] = "fuse_layer-shm",
	[S_FUSE_CLOSE] = "fuse_close",
	[S_PIN] = "pin",
	[S_UNPIN] = "unpin",
	[S_BAD_VERSION] = "bad-version",
	[S_UNKNOWN_OP] = "unknown-op",
};

size_t fuzz_sample_count(void)
{
	return S_COUNT;
}

static void model(struct kvbp_model *m, const char *name, uint32_t layers, uint32_t heads,
		  uint32_t dim, uint32_t dtype)
{
	memset(m, 0, sizeof(*m));
	snprintf(m->name, sizeof(m->name), "%s", name);
	m->desc.num_layers = layers;
	m->desc.num_kv_heads = heads;
	m->desc.head_dim = dim;
	m->desc.dtype = dtype;
	m->desc.rope_theta = 10000;
}

void fuzz_sample(size_t i, struct kvbp_request *q, const char **name)
{
	memset(q, 0, sizeof(*q));
	q->version = KVBP_VERSION;
	q->request_id = 1000 + i;
	snprintf(q->model_name, sizeof(q->model_name), "fz");
	*name = i < S_COUNT ? sample_names[i] : "none";
	switch ((enum sample_id)i) {
	case S_HELLO:
		q->op = KVBP_OP_HELLO;
		q->model_name[0] = 0;
		break;
	case S_REGISTER_NEOX:
		q->op = KVBP_OP_MODEL_REGISTER;
		q->has_model = true;
		model(&q->model, "fz", 3, 2, 8, 1);
		break;
	case S_REGISTER_YARN:
		q->op = KVBP_OP_MODEL_REGISTER;
		q->has_model = true;
		model(&q->model, "fz-yarn", 2, 1, 8, 3);
		q->model.desc.rope_style = 1;
		q->model.desc.rotary_dim = 4;
		q->model.desc.scaling = 3;
		q->model.desc.factor = 4;
		q->model.desc.original_max_pos = 4096;
		q->model.desc.beta_fast = 32;
		q->model.desc.beta_slow = 1;
		break;
	case S_REGISTER_LLAMA3:
		q->op = KVBP_OP_MODEL_REGISTER;
		q->has_model = true;
		model(&q->model, "fz-llama3", 2, 2, 4, 2);
		q->model.desc.rope_theta = 500000;
		q->model.desc.scaling = 2;
		q->model.desc.factor = 8;
		q->model.desc.low_freq_factor = 1;
		q->model.desc.high_freq_factor = 4;
		q->model.desc.original_max_pos = 8192;
		q->model.desc.k_pre_rope = true;
		break;
	case S_REGISTER_LINEAR:
		q->op = KVBP_OP_MODEL_REGISTER;
		q->has_model = true;
		model(&q->model, "fz-linear", 1, 1, 2, 1);
		q->model.desc.scaling = 1;
		q->model.desc.factor = 2;
		break;
	case S_REGISTER_DYNAMIC:
		q->op = KVBP_OP_MODEL_REGISTER;
		q->has_model = true;
		model(&q->model, "fz-dynamic", 1, 1, 2, 1);
		q->model.desc.scaling = 4;
		q->model.desc.factor = 2;
		q->model.desc.max_pos = 2048;
		break;
	case S_MODEL_LIST:
		q->op = KVBP_OP_MODEL_LIST;
		break;
	case S_PUT_FRAMES:
		q->op = KVBP_OP_PUT;
		q->has_hash = true;
		memcpy(q->hash, sample_hashes[0], KVBP_HASH_LEN);
		q->num_tokens = 10;
		q->dtype = 1;
		q->payload_frames = 6;
		break;
	case S_PUT_SHM:
		q->op = KVBP_OP_PUT;
		q->has_hash = true;
		memcpy(q->hash, sample_hashes[1], KVBP_HASH_LEN);
		q->num_tokens = 17;
		q->base_pos = 100;
		q->has_shm = true;
		q->shm_id = 0x1234567890abcdefull;
		q->shm_offset = 4096;
		q->shm_length = 3 * 2 * 17 * 2 * 8 * 2;
		break;
	case S_GET:
		q->op = KVBP_OP_GET;
		q->has_hash = true;
		memcpy(q->hash, sample_hashes[0], KVBP_HASH_LEN);
		break;
	case S_GET_RANGE_REROTATE:
		q->op = KVBP_OP_GET;
		q->has_hash = true;
		memcpy(q->hash, sample_hashes[0], KVBP_HASH_LEN);
		q->layer_begin = 1;
		q->layer_end = 3;
		q->rerotate = true;
		q->target_pos = 512;
		break;
	case S_GET_SHM_PROGRESS:
		q->op = KVBP_OP_GET;
		q->has_hash = true;
		memcpy(q->hash, sample_hashes[1], KVBP_HASH_LEN);
		q->has_shm = true;
		q->shm_id = 0x1234567890abcdefull;
		q->shm_offset = 64;
		q->shm_length = 1 << 20;
		q->progress = 1 + 0;
		break;
	case S_LOOKUP:
		q->op = KVBP_OP_LOOKUP;
		q->hashes = sample_hashes;
		q->n_hashes = 3;
		break;
	case S_DELETE:
		q->op = KVBP_OP_DELETE;
		q->has_hash = true;
		memcpy(q->hash, sample_hashes[2], KVBP_HASH_LEN);
		break;
	case S_STATS:
		q->op = KVBP_OP_STATS;
		q->model_name[0] = 0;
		break;
	case S_LIST:
		q->op = KVBP_OP_LIST;
		break;
	case S_SHM_ATTACH:
		q->op = KVBP_OP_SHM_ATTACH;
		q->model_name[0] = 0;
		q->shm_size = 1 << 20;
		break;
	case S_SHM_DETACH:
		q->op = KVBP_OP_SHM_DETACH;
		q->model_name[0] = 0;
		q->has_shm = true;
		q->shm_id = 0x1234567890abcdefull;
		break;
	case S_FUSE_OPEN:
		q->op = KVBP_OP_FUSE_OPEN;
		q->segments = sample_segments;
		q->n_segments = 3;
		q->check_layers = sample_checks;
		q->n_checks = 2;
		q->ratios = sample_ratios;
		q->n_ratios = 2;
		break;
	case S_FUSE_OPEN_SHARED_RING:
		q->op = KVBP_OP_FUSE_OPEN;
		q->segments = sample_segments;
		q->n_segments = 2;
		q->check_layers = sample_checks;
		q->n_checks = 1;
		q->ratios = sample_ratios;
		q->n_ratios = 1;
		q->metric = 1;
		q->shared_ring = true;
		break;
	case S_FUSE_LAYER:
		q->op = KVBP_OP_FUSE_LAYER;
		q->model_name[0] = 0;
		q->session_id = 0xfeedfacecafebeefull;
		q->layer = 1;
		q->rows = 30;
		q->payload_frames = 2;
		break;
	case S_FUSE_LAYER_SHM:
		q->op = KVBP_OP_FUSE_LAYER;
		q->model_name[0] = 0;
		q->session_id = 0xfeedfacecafebeefull;
		q->layer = 2;
		q->rows = 7;
		q->has_shm = true;
		q->shm_id = 0x1234567890abcdefull;
		q->shm_length = 2 * 7 * 32;
		q->has_shm_out = true;
		q->shm_out_id = 0x1234567890abcdefull;
		q->shm_out_offset = 8192;
		q->shm_out_length = 2 * 30 * 32;
		break;
	case S_FUSE_CLOSE:
		q->op = KVBP_OP_FUSE_CLOSE;
		q->model_name[0] = 0;
		q->session_id = 0xfeedfacecafebeefull;
		break;
	case S_PIN:
		q->op = KVBP_OP_PIN;
		q->has_hash = true;
		memcpy(q->hash, sample_hashes[0], KVBP_HASH_LEN);
		q->ttl = 60;
		break;
	case S_UNPIN:
		q->op = KVBP_OP_UNPIN;
		q->has_hash = true;
		memcpy(q->hash, sample_hashes[0], KVBP_HASH_LEN);
		break;
	case S_BAD_VERSION:
		q->op = KVBP_OP_HELLO;
		q->version = 2;
		break;
	case S_UNKNOWN_OP:
	case S_COUNT:
		q->op = 99;
		break;
	}
}
