/*
 * model — the model record: dtype names, the rope-scaling and store-codec specs,
 * the record to and from the wire, and the MODEL_REGISTER and MODEL_LIST calls.
 */
#include <errno.h>
#include <inttypes.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "client/client_impl.h"

size_t kvb_dtype_size(enum kvb_dtype dtype)
{
	return kvbp_dtype_size((uint32_t)dtype);
}

const char *kvb_dtype_name(enum kvb_dtype dtype)
{
	return kvbp_dtype_name((uint32_t)dtype);
}

enum kvb_dtype kvb_dtype_parse(const char *s)
{
	if (!strcmp(s, "f16") || !strcmp(s, "float16"))
		return KVB_F16;
	if (!strcmp(s, "bf16") || !strcmp(s, "bfloat16"))
		return KVB_BF16;
	if (!strcmp(s, "f32") || !strcmp(s, "float32"))
		return KVB_F32;
	return 0;
}


static int parse_doubles(const char *s, double *v, int max)
{
	int n = 0;

	while (*s && n < max) {
		char *end;

		errno = 0;
		v[n++] = strtod(s, &end);
		if (errno || end == s)
			return -1;
		if (*end == ',')
			end++;
		else if (*end)
			return -1;
		s = end;
	}
	return *s ? -1 : n;
}

int kvb_rope_scaling_parse(const char *spec, struct kvb_model *m)
{
	const char *colon = strchr(spec, ':');
	size_t kind_len = colon ? (size_t)(colon - spec) : strlen(spec);
	double v[4];
	int n = colon ? parse_doubles(colon + 1, v, 4) : 0;
	struct kvb_model t = *m;

	t.scaling = KVB_SCALING_NONE;
	t.factor = t.low_freq_factor = t.high_freq_factor = t.beta_fast = t.beta_slow = 0;
	t.original_max_pos = t.max_pos = 0;
	if (n < 0)
		return -EINVAL;
	if (kind_len == 4 && !strncmp(spec, "none", 4) && !colon) {
		/* nothing to set */
	} else if (kind_len == 6 && !strncmp(spec, "linear", 6) && n == 1 && v[0] > 0) {
		t.scaling = KVB_SCALING_LINEAR;
		t.factor = v[0];
	} else if (kind_len == 6 && !strncmp(spec, "llama3", 6) && n == 4 && v[0] > 0 &&
		   v[1] > 0 && v[2] > v[1] && v[3] >= 1 && v[3] <= UINT32_MAX) {
		t.scaling = KVB_SCALING_LLAMA3;
		t.factor = v[0];
		t.low_freq_factor = v[1];
		t.high_freq_factor = v[2];
		t.original_max_pos = (uint32_t)v[3];
	} else if (kind_len == 4 && !strncmp(spec, "yarn", 4) && (n == 2 || n == 4) && v[0] > 0 &&
		   v[1] >= 1 && v[1] <= UINT32_MAX) {
		t.scaling = KVB_SCALING_YARN;
		t.factor = v[0];
		t.original_max_pos = (uint32_t)v[1];
		t.beta_fast = n == 4 ? v[2] : 32;
		t.beta_slow = n == 4 ? v[3] : 1;
		if (!(t.beta_fast > t.beta_slow && t.beta_slow > 0))
			return -EINVAL;
	} else if (kind_len == 7 && !strncmp(spec, "dynamic", 7) && n == 2 && v[0] > 0 &&
		   v[1] >= 1 && v[1] <= UINT32_MAX) {
		t.scaling = KVB_SCALING_DYNAMIC;
		t.factor = v[0];
		t.max_pos = (uint32_t)v[1];
	} else {
		return -EINVAL;
	}
	*m = t;
	return 0;
}

void kvb_rope_scaling_format(const struct kvb_model *m, char *buf, size_t len)
{
	switch (m->scaling) {
	case KVB_SCALING_LINEAR:
		snprintf(buf, len, "linear:%g", m->factor);
		break;
	case KVB_SCALING_LLAMA3:
		snprintf(buf, len, "llama3:%g,%g,%g,%" PRIu32, m->factor, m->low_freq_factor,
			 m->high_freq_factor, m->original_max_pos);
		break;
	case KVB_SCALING_YARN:
		snprintf(buf, len, "yarn:%g,%" PRIu32 ",%g,%g", m->factor, m->original_max_pos,
			 m->beta_fast, m->beta_slow);
		break;
	case KVB_SCALING_DYNAMIC:
		snprintf(buf, len, "dynamic:%g,%" PRIu32, m->factor, m->max_pos);
		break;
	default:
		snprintf(buf, len, "none");
		break;
	}
}

int kvb_store_parse(const char *spec, struct kvb_model *m)
{
	static const char *const names[] = { "dtype", "fp8", "int8", "int4" };
	const char *colon = spec ? strchr(spec, ':') : NULL;
	size_t len = colon ? (size_t)(colon - spec) : (spec ? strlen(spec) : 0);

	if (!spec || !*spec) {
		m->store_codec = KVB_STORE_DTYPE;
		m->store_group = 0;
		return 0;
	}
	for (int i = 0; i < 4; i++) {
		char *end;
		unsigned long g = 0;

		if (strlen(names[i]) != len || strncmp(spec, names[i], len))
			continue;
		if (colon) {
			if (i != KVB_STORE_INT4)
				return -EINVAL;
			errno = 0;
			g = strtoul(colon + 1, &end, 10);
			if (errno || *end || end == colon + 1 || g < 1 || g > 1024)
				return -EINVAL;
		}
		m->store_codec = (enum kvb_store_codec)i;
		m->store_group = (uint32_t)g;
		return 0;
	}
	return -EINVAL;
}

void kvb_store_format(const struct kvb_model *m, char *buf, size_t len)
{
	static const char *const names[] = { "dtype", "fp8", "int8", "int4" };
	unsigned c = (unsigned)m->store_codec;

	if (c > 3)
		snprintf(buf, len, "?");
	else if (c == KVB_STORE_INT4)
		snprintf(buf, len, "int4:%" PRIu32, m->store_group ? m->store_group : 32);
	else
		snprintf(buf, len, "%s", names[c]);
}

void kvbc_model_to_wire(const struct kvb_model *m, struct kvbp_model *w)
{
	memset(w, 0, sizeof(*w));
	snprintf(w->name, sizeof(w->name), "%s", m->name);
	KVB_MODEL_DESC_COPY(&w->desc, m);
}

void kvbc_model_from_wire(const struct kvbp_model *w, struct kvb_model *m)
{
	memset(m, 0, sizeof(*m));
	snprintf(m->name, sizeof(m->name), "%s", w->name);
	KVB_MODEL_DESC_COPY(m, &w->desc);
}

int kvb_model_register(kvb_client *c, const struct kvb_model *m, int *existed)
{
	return kvb_model_register_layers(c, m, NULL, existed);
}

int kvb_model_register_layers(kvb_client *c, const struct kvb_model *m,
			      const struct kvb_model_layers *layers, int *existed)
{
	struct call k = { .req = { .op = KVBP_OP_MODEL_REGISTER, .has_model = true } };
	int rc;

	if (strnlen(m->name, sizeof(m->name)) > KVB_NAME_MAX)
		return kvbc_set_err(c, -EINVAL, "model name longer than %d bytes", KVB_NAME_MAX);
	kvbc_model_to_wire(m, &k.req.model);
	if (layers)
		KVB_MODEL_DESC_COPY_LAYERS(&k.req.model.desc, layers);
	rc = kvbc_call(c, &k);
	if (!rc && existed)
		*existed = k.rep.existed;
	kvbc_call_done(&k);
	return rc;
}

/* MODEL_LIST; naming a model (or NULL), which a daemon in a cluster that lacks it
 * asks the other members for first. */
static int model_list(kvb_client *c, const char *name, struct kvb_model **models, size_t *n)
{
	struct call k = { .req = { .op = KVBP_OP_MODEL_LIST } };
	int rc;

	if (name)
		snprintf(k.req.model_name, sizeof(k.req.model_name), "%s", name);
	rc = kvbc_call(c, &k);

	if (!rc) {
		*models = calloc(k.rep.n_models ? k.rep.n_models : 1, sizeof(**models));
		if (!*models)
			rc = kvbc_set_err(c, -ENOMEM, "out of memory");
		for (size_t i = 0; !rc && i < k.rep.n_models; i++)
			kvbc_model_from_wire(&k.rep.models[i], &(*models)[i]);
		*n = rc ? 0 : k.rep.n_models;
	}
	kvbc_call_done(&k);
	return rc;
}

int kvb_model_list(kvb_client *c, struct kvb_model **models, size_t *n)
{
	return model_list(c, NULL, models, n);
}

int kvb_model_get(kvb_client *c, const char *name, struct kvb_model *out)
{
	return kvb_model_get_layers(c, name, out, NULL);
}

int kvb_model_get_layers(kvb_client *c, const char *name, struct kvb_model *out,
			 struct kvb_model_layers *layers)
{
	struct call k = { .req = { .op = KVBP_OP_MODEL_LIST } };
	int rc;

	snprintf(k.req.model_name, sizeof(k.req.model_name), "%s", name);
	rc = kvbc_call(c, &k);
	if (rc)
		return rc;
	rc = kvbc_set_err(c, KVB_E_UNKNOWN_MODEL, "unknown model '%s'", name);
	for (size_t i = 0; i < k.rep.n_models; i++)
		if (!strcmp(k.rep.models[i].name, name)) {
			kvbc_model_from_wire(&k.rep.models[i], out);
			if (layers) {
				memset(layers, 0, sizeof(*layers));
				KVB_MODEL_DESC_COPY_LAYERS(layers, &k.rep.models[i].desc);
			}
			c->err[0] = 0;
			rc = 0;
			break;
		}
	kvbc_call_done(&k);
	return rc;
}
