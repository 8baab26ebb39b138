/*
 * model_fields — the fields of a model's description, listed once. A model has four shapes
 * in C: the public struct kvb_model (client/include/kvblend.h), the wire's struct
 * kvbp_model (proto/wire.h), the protobuf message Kvblend__Model (proto/kvblend.proto) and
 * the store's struct store_model (store/store.h). Each has a member of each name below
 * (besides its name and, in the store, its id and element size); the copies between
 * shapes and the store's "same description" test are written over this list, so a new
 * field is added to the shapes' definitions, here, and to what is particular to it (its
 * check in the daemon's REGISTER, its place in the store's model record, the Python
 * binding), and to no copy.
 *
 * KVB_MODEL_FIELDS(X, a, b) expands X(a, b, field) for each field, in the order of the
 * wire's struct. Types differ between shapes only as C converts them by assignment (an enum and
 * its uint32_t, a flag as int, bool or protobuf_c_boolean). Header-only. Not installed.
 */
#ifndef KVBLEND_COMMON_MODEL_FIELDS_H
#define KVBLEND_COMMON_MODEL_FIELDS_H

#define KVB_MODEL_FIELDS(X, a, b) \
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

/* Copy every field from *src to *dst (pointers to any two shapes). */
#define KVB_MODEL_COPY(dst, src)                                                             \
	do {                                                                                 \
		KVB_MODEL_FIELDS(KVB_MODEL_COPY_ONE_, dst, src)                              \
	} while (0)
#define KVB_MODEL_COPY_ONE_(d, s, f) (d)->f = (s)->f;

/* True when every field of *x equals that of *y (any two shapes; the name is not one). */
#define KVB_MODEL_SAME(x, y) (KVB_MODEL_FIELDS(KVB_MODEL_SAME_ONE_, x, y) 1)
#define KVB_MODEL_SAME_ONE_(x, y, f) (x)->f == (y)->f &&

/* The name of the first field in which *x and *y differ, or NULL (any two shapes). */
#define KVB_MODEL_FIRST_DIFF(x, y) (KVB_MODEL_FIELDS(KVB_MODEL_DIFF_ONE_, x, y) (const char *)0)
#define KVB_MODEL_DIFF_ONE_(x, y, f) (x)->f != (y)->f ? #f :

#endif
