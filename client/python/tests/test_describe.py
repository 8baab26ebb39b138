"""kvblend.describe: a model's RoPE read from a Hugging Face config, for both engines.

Configs are attribute bags as transformers 4 and 5 write them; each described Model
goes through libkvblend's own parser of the scaling SPEC (Model._to_c), so a SPEC
the daemon would refuse fails here.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvblend import describe


def cfg(**kw):
    return SimpleNamespace(max_position_embeddings=4096, **kw)


def model(c, head_dim=64):
    m = describe.describe(c, name="d", dtype="bf16", num_layers=2, num_kv_heads=1,
                          head_dim=head_dim)
    m._to_c()  # libkvblend parses the SPEC
    return m


LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


@pytest.mark.parametrize("c, theta, scaling, rotary", [
    (cfg(rope_theta=1e4), 1e4, "none", 0),
    (cfg(rope_parameters={"rope_theta": 5e5, "rope_type": "default"}), 5e5, "none", 0),
    (cfg(rope_theta=1e4, rope_scaling={"type": "linear", "factor": 4.0}), 1e4,
     "linear:4.0", 0),
    (cfg(rope_parameters={"rope_theta": 5e5, **LLAMA3}), 5e5,
     "llama3:8.0,1.0,4.0,8192", 0),
    (cfg(rope_theta=1e4, rope_scaling={"rope_type": "yarn", "factor": 4.0,
                                       "original_max_position_embeddings": 1024}), 1e4,
     "yarn:4.0,1024,32,1", 0),
    (cfg(rope_theta=1e4, rope_scaling={"rope_type": "dynamic", "factor": 2.0}), 1e4,
     "dynamic:2.0,4096", 0),
    (cfg(rope_theta=1e4, partial_rotary_factor=0.5), 1e4, "none", 32),
    (cfg(rope_parameters={"rope_theta": 1e4, "partial_rotary_factor": 0.25}), 1e4, "none", 16),
])
def test_describes(c, theta, scaling, rotary):
    m = model(c)
    assert (m.rope_theta, m.rope_style, m.rotary_dim, m.k_pre_rope) == (theta, "neox", rotary,
                                                                        False)
    assert describe.scaling_spec(describe.rope_scaling(c), 4096) == scaling
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.dtype) == (2, 1, 64, "bf16")


@pytest.mark.parametrize("c, words", [
    (cfg(), "no rope_theta"),
    (cfg(rope_theta=1e4, rope_scaling={"rope_type": "longrope", "factor": 2.0}), "longrope"),
    (cfg(rope_theta=1e4, rope_scaling={"rope_type": "linear"}), "numeric factor"),
    (cfg(rope_theta=1e4, rope_scaling={"rope_type": "yarn", "factor": 4.0, "mscale": 0.7}),
     "mscale"),
])
def test_refuses_naming_the_field(c, words):
    with pytest.raises(describe.Undescribable, match=words):
        model(c)


GEMMA3_TYPES = (["sliding_attention"] * 5 + ["full_attention"]) * 3


@pytest.mark.parametrize("c", [
    # transformers 5: RoPE per layer type
    cfg(layer_types=GEMMA3_TYPES, rope_parameters={
        "full_attention": {"rope_theta": 1e6, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}},
        rope_scaling={"full_attention": {"rope_theta": 1e6, "rope_type": "default"},
                      "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}}),
    # transformers 4: rope_local_base_freq and sliding_window_pattern
    cfg(rope_theta=1e6, rope_local_base_freq=1e4, sliding_window_pattern=6),
])
def test_gemma3_local_layers(c):
    m = describe.describe(c, name="g", dtype="f32", num_layers=18, num_kv_heads=1,
                          head_dim=256)
    m._to_c()
    m._layers_to_c()
    assert (m.rope_theta, m.scaling, m.rope_local_theta, m.full_every) == (1e6, "none", 1e4, 6)
    assert [i for i in range(18) if not m.is_local(i)] == [5, 11, 17]


def test_gemma3_full_layers_keep_their_scaling():
    c = cfg(layer_types=GEMMA3_TYPES, rope_parameters={
        "full_attention": {"rope_theta": 1e6, "rope_type": "linear", "factor": 8.0},
        "sliding_attention": {"rope_theta": 1e4, "rope_type": "default"}})
    m = describe.describe(c, name="g", dtype="f32", num_layers=18, num_kv_heads=1,
                          head_dim=256)
    assert (m.scaling, m.rope_local_theta, m.full_every) == ("linear:8.0", 1e4, 6)


@pytest.mark.parametrize("c, why", [
    (cfg(layer_types=["sliding_attention", "full_attention", "full_attention"] * 6,
         rope_theta=1e6, rope_local_base_freq=1e4), "every Nth layer"),
    (cfg(layer_types=["full_attention", "sliding_attention"] * 9, rope_theta=1e6,
         rope_local_base_freq=1e4), "every Nth layer"),
    (cfg(layer_types=["sliding_attention"] * 18, rope_theta=1e6,
         rope_local_base_freq=1e4), "every layer is a sliding-window one"),
    (cfg(layer_types=["chunked_attention", "full_attention"] * 9, rope_theta=1e6,
         rope_local_base_freq=1e4), "chunked_attention"),
    (cfg(rope_theta=1e6, rope_local_base_freq=1e4), "without layer_types"),
    (cfg(layer_types=GEMMA3_TYPES, rope_parameters={
        "full_attention": {"rope_theta": 1e6, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 1e4, "rope_type": "linear", "factor": 2.0}}),
     "sliding-window layers with rope scaling"),
])
def test_local_layers_refused(c, why):
    with pytest.raises(describe.Undescribable, match=why):
        describe.describe(c, name="g", dtype="f32", num_layers=18, num_kv_heads=1,
                          head_dim=256)



DEEPSEEK_YARN = {"rope_type": "yarn", "rope_theta": 1e4, "factor": 40.0,
                 "original_max_position_embeddings": 4096, "beta_fast": 32, "beta_slow": 1,
                 "mscale": 0.707, "mscale_all_dim": 0.707}


def test_latent_attention():
    """DeepSeek-V2's MLA row (512 + 64) as one head of 288, its RoPE key gptj-rotated."""
    c = cfg(kv_lora_rank=512, qk_rope_head_dim=64, rope_parameters=dict(DEEPSEEK_YARN))
    m = describe.describe_latent(c, name="d", dtype="bf16", num_layers=27)
    m._to_c()
    assert (m.num_kv_heads, m.head_dim, m.rotary_dim, m.rope_style) == (1, 288, 64, "gptj")
    assert m.scaling == "yarn:40.0,4096,32,1" and not m.k_pre_rope
    # vLLM's deepseek_llama_scaling (attention_factor 1.0) rotates as its deepseek_yarn
    c.rope_parameters = {**DEEPSEEK_YARN, "attention_factor": 1.0}
    assert describe.describe_latent(c, name="d", dtype="bf16", num_layers=27).scaling == m.scaling
    with pytest.raises(describe.Undescribable, match="mscale=0.707"):
        describe.describe(c, name="d", dtype="bf16", num_layers=27, num_kv_heads=1,
                          head_dim=288)


@pytest.mark.parametrize("c, why", [
    (cfg(rope_theta=1e4), "no kv_lora_rank"),
    (cfg(rope_theta=1e4, kv_lora_rank=32, qk_rope_head_dim=64), "kv_lora_rank >= qk_rope"),
    (cfg(rope_theta=1e4, kv_lora_rank=511, qk_rope_head_dim=64), "even row"),
    (cfg(rope_theta=1e4, kv_lora_rank=512, qk_rope_head_dim=64,
         rope_scaling={"rope_type": "linear", "factor": 4.0}), "scaling 'linear'"),
    (cfg(rope_parameters={"rope_theta": 1e4, "rope_type": "llama3", "factor": 8.0,
                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                          "original_max_position_embeddings": 8192},
         kv_lora_rank=512, qk_rope_head_dim=64), "scaling 'llama3'"),
    (cfg(kv_lora_rank=512, qk_rope_head_dim=64), "no rope_theta"),
])
def test_latent_attention_refused(c, why):
    with pytest.raises(describe.Undescribable, match=why):
        describe.describe_latent(c, name="d", dtype="bf16", num_layers=2)


def test_latent_rows_split_and_join():
    import numpy as np

    from kvblend.latent import Latent

    lat = Latent(512, 64)
    rows = np.arange(2 * 3 * 576, dtype=np.float32).reshape(2, 3, 576)
    kv = lat.split(rows)
    assert kv.shape == (2, 2, 3, 1, 288)
    assert np.array_equal(kv[:, 0, :, 0, :64], rows[..., 512:])
    assert np.array_equal(lat.join(kv), rows)
    with pytest.raises(ValueError, match=r"expected \[..., tokens, 576\]"):
        lat.split(rows[0, 0])
    with pytest.raises(ValueError, match=r"expected \[..., 2, tokens, 1, 288\]"):
        lat.join(kv[0, 0, 0])
