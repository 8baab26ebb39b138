/*
 * model_desc — one model's description: its KV layout, its RoPE configuration and how
 * its chunks are stored. The store's struct store_model (store/store.h) and the wire's
 * struct kvbp_model (proto/wire.h) embed it as their `desc`, so that a copy between them
 * is a struct assignment; the RoPE configuration of the blend is built from it in one
 * place, rope_config_from_desc() (blend/rope.h); the daemon's REGISTER checks it and
 * fills in its defaults (model_check, daemon/ops/reply.c).
 *
 * Two shapes cannot embed it: the public struct kvb_model (client/include/kvblend.h, a
 * fixed ABI) and the protobuf message Kvblend__Model (proto/kvblend.proto, generated).
 * They have a member of each name below (struct kvb_model those of KVB_MODEL_DESC_FIELDS,
 * struct kvb_model_layers those of KVB_MODEL_DESC_LAYER_FIELDS), and KVB_MODEL_DESC_COPY
 * (KVB_MODEL_DESC_COPY_LAYERS) copies between them and a description, in one function
 * each (client/model.c, proto/wire.c). A new field is added to the struct and the list
 * here, to those two shapes, to its check, to its place in the store's model record (store/store_record.c)
 * and, when it is a RoPE field, to struct rope_config and rope_config_from_desc().
 *
 * Ranges are those a registered model has (the daemon refuses others at REGISTER); a
 * description not yet checked may hold anything. Header-only. Not installed.
 */
#ifndef KVBLEND_COMMON_MODEL_DESC_H
#define KVBLEND_COMMON_MODEL_DESC_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct kvb_model_desc {
	/* The KV layout: per layer, K and V of [tokens, num_kv_heads, head_dim]. */
	uint32_t num_layers;   /* 1..max_layers (daemon config) */
	uint32_t num_kv_heads; /* 1..max_kv_heads (daemon config) */
	uint32_t head_dim;     /* even, 2..max_head_dim (daemon config) */
	uint32_t dtype;	       /* element type: 1 f16, 2 bf16, 3 f32 */
	/* RoPE (docs/DESIGN.md, "Data model"; formulas of HF transformers' RoPE utilities) */
	double rope_theta;     /* base of the frequencies, finite and > 0 */
	uint32_t rope_style;   /* 0 neox: pairs (j, j + rotary_dim/2); 1 gptj: (2j, 2j + 1) */
	uint32_t rotary_dim;   /* dims rotated, even, <= head_dim; 0 on the way in = head_dim */
	uint32_t scaling;      /* 0 none, 1 linear, 2 llama3, 3 yarn, 4 dynamic */
	double factor;	       /* linear, llama3, yarn, dynamic: > 0; else unused (0) */
	double low_freq_factor;	   /* llama3: > 0 */
	double high_freq_factor;   /* llama3: finite, > low_freq_factor */
	uint32_t original_max_pos; /* llama3, yarn: positions trained on, > 0 */
	double beta_fast;	   /* yarn: finite, > beta_slow (0 and 0 on the way in: 32, 1) */
	double beta_slow;	   /* yarn: > 0 */
	uint32_t max_pos;	   /* dynamic: max_position_embeddings, > 0 */
	bool k_pre_rope;	   /* keys are stored before RoPE (else after, the default) */
	/* Local layers (Gemma 3's sliding-window layers): with rope_local_theta > 0, layer l
	 * (from 0) is a full-attention layer, rotated as above, when (l + 1) % full_every
	 * == 0, and a local one otherwise, rotated by default RoPE (no scaling) of base
	 * rope_local_theta. 0 and 0: every layer rotates alike. */
	double rope_local_theta; /* 0, or finite and > 0 with full_every */
	uint32_t full_every;	 /* 0, or 2..num_layers with rope_local_theta */
	/* Storage (store/quant.h): 0 lossless in dtype, 1 fp8, 2 int8, 3 int4 in groups. */
	uint32_t store_codec;
	uint32_t store_group; /* int4: elements per group, 1..1024 (0 on the way in: 32); else 0 */
};

/*
 * KVB_MODEL_DESC_FIELDS(X, a, b) expands X(a, b, field) for each member of struct
 * kvb_model_desc that struct kvb_model has, in its order; KVB_MODEL_DESC_LAYER_FIELDS
 * those of struct kvb_model_layers (client/include/kvblend.h, KVBLEND_1.8), which the
 * fixed struct kvb_model could not take. The wire's Kvblend__Model has both. Types
 * differ between shapes only as C converts them by assignment (an enum and its uint32_t, a flag as int, bool or protobuf_c_boolean).
 */
#define KVB_MODEL_DESC_FIELDS(X, a, b) \
	X(a, b, num_layers) \
	X(a, b, num_kv_heads) \
	X(a, b, head_dim) \
	X(a, b, dtype) \
	X(a, b, rope_theta) \
	X(a, b, rope_style) \
	X(a, b, rotary_dim) \
	X(a, b, scaling) \
	X(a, b, factor) \
	X(a, b, low_freq_factor) \
	X(a, b, high_freq_factor) \
	X(a, b, original_max_pos) \
	X(a, b, beta_fast) \
	X(a, b, beta_slow) \
	X(a, b, max_pos) \
	X(a, b, k_pre_rope) \
	X(a, b, store_codec) \
	X(a, b, store_group)
#define KVB_MODEL_DESC_LAYER_FIELDS(X, a, b) \
	X(a, b, rope_local_theta) \
	X(a, b, full_every)

/* Copy every field from *src to *dst: a description and a shape that cannot embed one. */
#define KVB_MODEL_DESC_COPY(dst, src)                                                        \
	do {                                                                                 \
		KVB_MODEL_DESC_FIELDS(KVB_MODEL_DESC_COPY_ONE_, dst, src)                    \
	} while (0)
#define KVB_MODEL_DESC_COPY_ONE_(d, s, f) (d)->f = (s)->f;

/* Copy the fields of struct kvb_model_layers (KVB_MODEL_DESC_LAYER_FIELDS). */
#define KVB_MODEL_DESC_COPY_LAYERS(dst, src)                                                 \
	do {                                                                                 \
		KVB_MODEL_DESC_LAYER_FIELDS(KVB_MODEL_DESC_COPY_ONE_, dst, src)              \
	} while (0)

#define KVB_MODEL_DESC_DIFF_ONE_(x, y, f) (x)->f != (y)->f ? #f :

/*
 * The name of the first field in which a and b differ, or NULL when they describe the
 * same model (the store's "same model" test, and the field a REGISTER conflict names).
 * Fields compare with ==: a NaN never equals itself, so a description holding one is
 * never the same as any (REGISTER refuses NaN).
 */
static inline const char *kvb_model_desc_diff(const struct kvb_model_desc *a,
					      const struct kvb_model_desc *b)
{
	return KVB_MODEL_DESC_FIELDS(KVB_MODEL_DESC_DIFF_ONE_, a, b)
		KVB_MODEL_DESC_LAYER_FIELDS(KVB_MODEL_DESC_DIFF_ONE_, a, b) NULL;
}

/*
 * The kinds of rotation of a checked description d: 2 when it has local layers (a
 * rope_local_theta and a full_every, never one without the other), else 1; and whether
 * layer l is a local one (rotated with rope_local_theta), kind 1.
 */
static inline unsigned kvb_model_desc_kinds(const struct kvb_model_desc *d)
{
	return d->full_every ? 2 : 1;
}

static inline bool kvb_model_desc_local(const struct kvb_model_desc *d, uint32_t l)
{
	return d->full_every && (l + 1) % d->full_every != 0;
}

#endif
