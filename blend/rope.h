/*
 * rope — rotary position embedding: inverse frequencies for every scaling
 * variant, and the rotation tables that move stored keys from the positions
 * they were rotated at to the positions where a chunk now sits.
 *
 * Angles are computed in double precision, applied in fp32 by the backends
 * (backend.h), and stored in the model's dtype. A library: no I/O, no globals.
 * Errors: -EINVAL for a configuration outside the documented ranges, -ENOMEM.
 */
#ifndef KVBLEND_BLEND_ROPE_H
#define KVBLEND_BLEND_ROPE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "common/model_desc.h"

enum rope_style {
	ROPE_NEOX = 0, /* pairs (j, j + rotary_dim/2): GPT-NeoX, Llama "rotate_half" */
	ROPE_GPTJ = 1, /* pairs (2j, 2j + 1): GPT-J, interleaved */
};

enum rope_scaling {
	ROPE_SCALING_NONE = 0,
	ROPE_SCALING_LINEAR = 1,
	ROPE_SCALING_LLAMA3 = 2,
	ROPE_SCALING_YARN = 3,
	ROPE_SCALING_DYNAMIC = 4,
};

struct rope_config {
	uint32_t head_dim;
	uint32_t rotary_dim; /* even, <= head_dim; dims from rotary_dim on are not rotated */
	enum rope_style style;
	double theta;
	enum rope_scaling scaling;
	double factor;		   /* linear, llama3, yarn, dynamic */
	double low_freq_factor;	   /* llama3 */
	double high_freq_factor;   /* llama3 */
	uint32_t original_max_pos; /* llama3, yarn */
	double beta_fast;	   /* yarn */
	double beta_slow;	   /* yarn */
	uint32_t max_pos;	   /* dynamic: max_position_embeddings */
};

/*
 * The RoPE configuration of model description d (common/model_desc.h): every RoPE
 * field as it is, rotary_dim 0 read as head_dim; with local, that of d's local layers
 * (kvb_model_desc_local): default RoPE of base rope_local_theta, no scaling. The one
 * place a configuration is built from a model; d is not checked (rope_config_check()
 * does that).
 */
void rope_config_from_desc(const struct kvb_model_desc *d, bool local, struct rope_config *c);

/*
 * Check c; returns 0, or -EINVAL with the rule c breaks written to why (a sentence that
 * names the fields, at most whylen bytes with its NUL; why may be NULL).
 */
int rope_config_check(const struct rope_config *c, char *why, size_t whylen);

/*
 * The rotary_dim/2 inverse frequencies of c into inv_freq, and the attention
 * factor (YaRN's magnitude, 1 otherwise) into *attention_factor (may be NULL).
 * seq_len matters only for dynamic scaling: the length of the sequence the
 * rotation was (or will be) computed for. Returns 0 or -EINVAL.
 */
int rope_inv_freq(const struct rope_config *c, uint64_t seq_len, double *inv_freq,
		  double *attention_factor);

/*
 * A rotation table for one chunk of `tokens` keys: token t moves from position
 * old_pos + t (under the configuration as it was for old_seq_len) to new_pos + t
 * (for new_seq_len). When the angle does not depend on t (post-RoPE keys, same
 * frequencies on both sides) the table has one row; otherwise one per token.
 * For pre-RoPE keys (pre_rope) there is nothing to undo: the table rotates from
 * zero to new_pos + t and applies the attention factor once.
 */
struct rope_table {
	uint32_t rows; /* 1, or tokens */
	uint32_t half; /* rotary_dim / 2 */
	float *cos;    /* [rows][half] */
	float *sin;    /* [rows][half] */
	float scale;   /* magnitude: attention factor ratio (1 unless it changes) */
};

int rope_table_build(const struct rope_config *c, bool pre_rope, uint32_t tokens, uint32_t old_pos,
		     uint64_t old_seq_len, uint32_t new_pos, uint64_t new_seq_len,
		     struct rope_table *out);

/* Free a table's arrays. Accepts NULL and zeroed tables. */
void rope_table_free(struct rope_table *t);

/*
 * A chunk's rotation tables under model description d (rope_table_build's arguments,
 * pre_rope d's k_pre_rope): out[0] for its full-attention layers (every layer, when d
 * has no local ones), out[1] for its local layers (zeroed when d has none). On an
 * error neither is left allocated.
 */
int rope_tables_for_desc(const struct kvb_model_desc *d, uint32_t tokens, uint32_t old_pos,
			 uint64_t old_seq_len, uint32_t new_pos, uint64_t new_seq_len,
			 struct rope_table out[2]);

/* The table of rope_tables_for_desc's pair t that rotates layer l of d. */
static inline const struct rope_table *rope_table_of_layer(const struct kvb_model_desc *d,
							   const struct rope_table t[2], uint32_t l)
{
	return &t[kvb_model_desc_local(d, l)];
}

#endif
