/* rope — RoPE frequencies and re-rotation tables; see rope.h. */
#include "blend/rope.h"

#include <errno.h>
#include <inttypes.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/model_desc.h"

static bool finite_pos(double x)
{
	return isfinite(x) && x > 0;
}

void rope_config_from_desc(const struct kvb_model_desc *d, bool local, struct rope_config *c)
{
	memset(c, 0, sizeof(*c));
	c->head_dim = d->head_dim;
	c->rotary_dim = d->rotary_dim ? d->rotary_dim : d->head_dim;
	c->style = (enum rope_style)d->rope_style;
	if (local) {
		c->theta = d->rope_local_theta;
		c->scaling = ROPE_SCALING_NONE;
		return;
	}
	c->theta = d->rope_theta;
	c->scaling = (enum rope_scaling)d->scaling;
	c->factor = d->factor;
	c->low_freq_factor = d->low_freq_factor;
	c->high_freq_factor = d->high_freq_factor;
	c->original_max_pos = d->original_max_pos;
	c->beta_fast = d->beta_fast;
	c->beta_slow = d->beta_slow;
	c->max_pos = d->max_pos;
}

__attribute__((format(printf, 3, 4))) static int broken(char *why, size_t whylen,
							 const char *fmt, ...)
{
	va_list ap;

	if (why && whylen) {
		va_start(ap, fmt);
		vsnprintf(why, whylen, fmt, ap);
		va_end(ap);
	}
	return -EINVAL;
}

int rope_config_check(const struct rope_config *c, char *why, size_t whylen)
{
	if (!c->head_dim || c->head_dim % 2)
		return broken(why, whylen, "head_dim %" PRIu32 " must be even and above 0",
			      c->head_dim);
	if (!finite_pos(c->theta))
		return broken(why, whylen, "rope_theta must be a positive number");
	if (c->style > ROPE_GPTJ)
		return broken(why, whylen, "rope_style %u unknown; expected neox or gptj",
			      (unsigned)c->style);
	if (!c->rotary_dim || c->rotary_dim % 2 || c->rotary_dim > c->head_dim)
		return broken(why, whylen, "rotary_dim %" PRIu32 " must be even and at most "
			      "head_dim %" PRIu32, c->rotary_dim, c->head_dim);
	switch (c->scaling) {
	case ROPE_SCALING_NONE:
		return 0;
	case ROPE_SCALING_LINEAR:
		return finite_pos(c->factor) ? 0
			: broken(why, whylen, "linear rope scaling needs factor > 0");
	case ROPE_SCALING_LLAMA3:
		return finite_pos(c->factor) && finite_pos(c->low_freq_factor) &&
			       isfinite(c->high_freq_factor) &&
			       c->high_freq_factor > c->low_freq_factor && c->original_max_pos
		       ? 0 : broken(why, whylen, "llama3 rope scaling needs factor > 0, "
				    "0 < low_freq_factor < high_freq_factor, original_max_pos > 0");
	case ROPE_SCALING_YARN:
		return finite_pos(c->factor) && c->original_max_pos && finite_pos(c->beta_slow) &&
			       isfinite(c->beta_fast) && c->beta_fast > c->beta_slow
		       ? 0 : broken(why, whylen, "yarn rope scaling needs factor > 0, "
				    "original_max_pos > 0, beta_fast > beta_slow > 0");
	case ROPE_SCALING_DYNAMIC:
		return finite_pos(c->factor) && c->max_pos ? 0
			: broken(why, whylen, "dynamic rope scaling needs factor > 0 and "
				 "max_pos > 0");
	}
	return broken(why, whylen, "rope scaling %u unknown", (unsigned)c->scaling);
}

/* Default RoPE: inv_freq[j] = 1 / base^(2j / dim) (RoFormer; HF
 * _compute_default_rope_parameters). */
static void default_inv_freq(double base, uint32_t dim, double *inv_freq)
{
	for (uint32_t j = 0; j < dim / 2; j++)
		inv_freq[j] = 1.0 / pow(base, (double)(2 * j) / dim);
}

/* YaRN's correction dimension: where a frequency makes num_rotations full turns over
 * max_pos positions (Peng et al. 2023, "YaRN", eq. 17; HF find_correction_dim). */
static double yarn_correction_dim(double num_rotations, uint32_t dim, double base, double max_pos)
{
	return (dim * log(max_pos / (num_rotations * 2 * M_PI))) / (2 * log(base));
}

/* YaRN's attention factor 0.1 ln(s) + 1 (YaRN eq. 21; HF get_mscale with mscale 1). */
static double yarn_mscale(double scale)
{
	return scale <= 1 ? 1.0 : 0.1 * log(scale) + 1.0;
}

int rope_inv_freq(const struct rope_config *c, uint64_t seq_len, double *inv_freq,
		  double *attention_factor)
{
	uint32_t dim = c->rotary_dim, half = dim / 2;
	double af = 1.0;

	if (rope_config_check(c, NULL, 0))
		return -EINVAL;
	switch (c->scaling) {
	case ROPE_SCALING_NONE:
		default_inv_freq(c->theta, dim, inv_freq);
		break;
	case ROPE_SCALING_LINEAR:
		/* Position interpolation (Chen et al. 2023; HF
		 * _compute_linear_scaling_rope_parameters): every frequency divided by factor. */
		default_inv_freq(c->theta, dim, inv_freq);
		for (uint32_t j = 0; j < half; j++)
			inv_freq[j] /= c->factor;
		break;
	case ROPE_SCALING_DYNAMIC: {
		/* Dynamic NTK (HF _compute_dynamic_ntk_parameters): for a sequence longer
		 * than max_pos the base grows to
		 * base * (factor * L / max_pos - (factor - 1))^(dim / (dim - 2)), L = seq_len;
		 * up to max_pos it is the default. */
		double len = (double)(seq_len > c->max_pos ? seq_len : c->max_pos);
		double base = c->theta;

		if (dim > 2)
			base *= pow(c->factor * len / c->max_pos - (c->factor - 1),
				    (double)dim / (dim - 2));
		default_inv_freq(base, dim, inv_freq);
		break;
	}
	case ROPE_SCALING_LLAMA3: {
		/* Llama 3.1 (HF _compute_llama3_parameters): wavelengths longer than
		 * original_max_pos / low_freq_factor are divided by factor, shorter than
		 * original_max_pos / high_freq_factor kept, and those between blended by
		 * smooth = (original_max_pos / wavelen - low) / (high - low). */
		double old_len = c->original_max_pos;
		double low_wavelen = old_len / c->low_freq_factor;
		double high_wavelen = old_len / c->high_freq_factor;

		default_inv_freq(c->theta, dim, inv_freq);
		for (uint32_t j = 0; j < half; j++) {
			double wavelen = 2 * M_PI / inv_freq[j];

			if (wavelen > low_wavelen) {
				inv_freq[j] /= c->factor;
			} else if (wavelen >= high_wavelen) {
				double smooth = (old_len / wavelen - c->low_freq_factor) /
						(c->high_freq_factor - c->low_freq_factor);

				inv_freq[j] = (1 - smooth) * inv_freq[j] / c->factor +
					      smooth * inv_freq[j];
			}
		}
		break;
	}
	case ROPE_SCALING_YARN: {
		/* YaRN (Peng et al. 2023; HF _compute_yarn_parameters, truncate = true):
		 * interpolate (divide by factor) below the correction range [low, high],
		 * extrapolate (keep) above it, blend linearly inside it. */
		double low = floor(yarn_correction_dim(c->beta_fast, dim, c->theta,
						       c->original_max_pos));
		double high = ceil(yarn_correction_dim(c->beta_slow, dim, c->theta,
						       c->original_max_pos));

		if (low < 0)
			low = 0;
		if (high > dim - 1)
			high = dim - 1;
		if (low == high)
			high += 0.001;
		default_inv_freq(c->theta, dim, inv_freq);
		for (uint32_t j = 0; j < half; j++) {
			double ramp = ((double)j - low) / (high - low);
			double extrapolation;

			ramp = ramp < 0 ? 0 : ramp > 1 ? 1 : ramp;
			extrapolation = 1 - ramp;
			inv_freq[j] = inv_freq[j] / c->factor * (1 - extrapolation) +
				      inv_freq[j] * extrapolation;
		}
		af = yarn_mscale(c->factor);
		break;
	}
	}
	if (attention_factor)
		*attention_factor = af;
	return 0;
}

void rope_table_free(struct rope_table *t)
{
	if (!t)
		return;
	free(t->cos);
	free(t->sin);
	memset(t, 0, sizeof(*t));
}

int rope_table_build(const struct rope_config *c, bool pre_rope, uint32_t tokens, uint32_t old_pos,
		     uint64_t old_seq_len, uint32_t new_pos, uint64_t new_seq_len,
		     struct rope_table *out)
{
	uint32_t half = c->rotary_dim / 2;
	double *f_old, *f_new, af_old = 1, af_new = 1;
	struct rope_table t = { .half = half };
	bool per_token;
	int rc;

	if (!tokens || !half)
		return -EINVAL;
	f_old = malloc(2 * half * sizeof(double));
	if (!f_old)
		return -ENOMEM;
	f_new = f_old + half;
	rc = rope_inv_freq(c, old_seq_len, f_old, &af_old);
	if (!rc)
		rc = rope_inv_freq(c, new_seq_len, f_new, &af_new);
	if (rc)
		goto out;
	/* With equal frequencies, (new + t) f - (old + t) f = (new - old) f for every t. */
	per_token = pre_rope || memcmp(f_old, f_new, half * sizeof(double)) != 0;
	t.rows = per_token ? tokens : 1;
	t.cos = malloc((size_t)t.rows * half * sizeof(float));
	t.sin = malloc((size_t)t.rows * half * sizeof(float));
	if (!t.cos || !t.sin) {
		rc = -ENOMEM;
		goto out;
	}
	/* Post-RoPE keys already carry the old attention factor: only a change is applied. */
	t.scale = (float)(pre_rope ? af_new : af_new / af_old);
	for (uint32_t r = 0; r < t.rows; r++) {
		for (uint32_t j = 0; j < half; j++) {
			double a;

			if (!per_token)
				a = ((double)new_pos - (double)old_pos) * f_new[j];
			else if (pre_rope)
				a = ((double)new_pos + r) * f_new[j];
			else
				a = ((double)new_pos + r) * f_new[j] - ((double)old_pos + r) * f_old[j];
			t.cos[(size_t)r * half + j] = (float)cos(a);
			t.sin[(size_t)r * half + j] = (float)sin(a);
		}
	}
	*out = t;
	t.cos = t.sin = NULL;
out:
	free(f_old);
	rope_table_free(&t);
	return rc;
}

int rope_tables_for_desc(const struct kvb_model_desc *d, uint32_t tokens, uint32_t old_pos,
			 uint64_t old_seq_len, uint32_t new_pos, uint64_t new_seq_len,
			 struct rope_table out[2])
{
	struct rope_config c;
	int rc = 0;

	memset(out, 0, 2 * sizeof(*out));
	for (unsigned local = 0; !rc && local < kvb_model_desc_kinds(d); local++) {
		rope_config_from_desc(d, local, &c);
		rc = rope_table_build(&c, d->k_pre_rope, tokens, old_pos, old_seq_len, new_pos,
				      new_seq_len, &out[local]);
	}
	if (rc) {
		rope_table_free(&out[0]);
		rope_table_free(&out[1]);
	}
	return rc;
}
