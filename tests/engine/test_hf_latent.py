"""DeepSeek's latent attention (MLA) in kvblendd: the daemon's side (issue 58), against a
random DeepSeek-V2 in transformers and vLLM's own DeepSeek rotary module; no engine start.

kvblend.latent stores an MLA layer's cache row (the normalized latent c, then the RoPE key
k_pe) as one KV head of half the row, K = [k_pe | c[:h - R]], V = c[h - R:], and
kvblend.describe.describe_latent describes it (rotary_dim R, gptj pairs, YaRN with
DeepSeek's mscale). A two-layer DeepseekV2ForCausalLM with random weights (float32,
kv_lora_rank 128, qk_rope_head_dim 64, YaRN factor 4 with mscale 1 and mscale_all_dim
0.707, so every rotated key is scaled by 1.04) caches exactly
those rows in transformers' DynamicCache (keys: c, values: k_pe), as vLLM's MLA cache
holds them.

(a) split and join are inverses (NumPy and torch); rows kvblend cannot split are refused
    with the reason, and so is a config without MLA;
(b) the description: one KV head of 96, rotary_dim 64, gptj, YaRN's factor and original
    length, mscale accepted here while describe() still refuses it for a Llama-family model;
    a scaling other than YaRN refused (vLLM's DeepSeek layers rotate every one as YaRN);
(c) the daemon's re-rotation: the chunk's rows prefilled at position 0, stored, read back
    re-rotated to positions 37 and 600 (GET re-rotated, every layer): the latent comes back
    bit for bit, k_pe equals transformers' prefill of the same tokens there (RoPE attention
    depends on relative positions only, so the latent there equals the stored one within
    float32 noise, checked too), and the k_pe moved differs from the stored one;
(d) the same re-rotated k_pe equals vLLM's DeepseekScalingRotaryEmbedding (get_rope with
    the config's rope_parameters, is_neox_style False, as vLLM's DeepseekV2 layers build it)
    applied at those positions to the layer's unrotated k_pe.

Run by pytest (tests/engine/run.sh --pytest, as ctest does); skipped when
KVBLEND_SKIP_ENGINE=1.
"""

import os

import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import kvblend  # noqa: E402
from harness import Daemon  # noqa: E402
from kvblend.describe import Undescribable, describe, describe_latent  # noqa: E402
from kvblend.latent import Latent, latent_of  # noqa: E402

RANK, ROPE, LAYERS, TOKENS = 128, 64, 2, 48
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 256, "beta_fast": 32, "beta_slow": 1,
        "mscale": 1.0, "mscale_all_dim": 0.707}
# (c), (d): the daemon rotates in float32 with angles in float64; transformers and vLLM
# take the angle position x frequency in float32, off by up to ~600 x 6e-8 = 3.6e-5 rad at
# position 600, so their k_pe is off the exact one by up to ~4e-5 of its scale (2.1e-5
# measured). The latent there comes from a prefill at another position: only float32
# reduction order differs. A wrong pair style or base is off by O(1).
TOL = 1e-4


def config():
    return transformers.DeepseekV2Config(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=128,
        num_hidden_layers=LAYERS, num_attention_heads=4, num_key_value_heads=4,
        kv_lora_rank=RANK, q_lora_rank=None, qk_rope_head_dim=ROPE, qk_nope_head_dim=32,
        v_head_dim=32, first_k_dense_replace=LAYERS, max_position_embeddings=1024,
        rope_parameters=dict(YARN), tie_word_embeddings=False)


def rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.abs(a - b).max() / np.abs(b).max())


def test_split_join():
    """(a)"""
    lat = Latent(512, 64)
    rows = np.random.default_rng(1).standard_normal((3, 10, 576)).astype(np.float32)
    kv = lat.split(rows)
    assert kv.shape == (3, 2, 10, 1, 288)
    assert np.array_equal(kv[:, 0, :, 0, :64], rows[..., 512:])  # k_pe first: the rotated dims
    assert np.array_equal(kv[:, 0, :, 0, 64:], rows[..., :224])
    assert np.array_equal(kv[:, 1, :, 0, :], rows[..., 224:512])
    assert np.array_equal(lat.join(kv), rows)
    t = torch.from_numpy(rows)
    assert torch.equal(lat.join(lat.split(t)), t)
    for bad, why in (((63, 64), "even row"), ((32, 64), "kv_lora_rank >= qk_rope_head_dim"),
                     ((128, 63), "RoPE part even"), ((0, 64), "positive")):
        with pytest.raises(ValueError, match=why):
            Latent(*bad).split(rows)
    with pytest.raises(ValueError, match="width 576, expected 192"):
        Latent(128, 64).split(rows)
    with pytest.raises(ValueError, match=r"expected \[..., 2, tokens, 1, 288\]"):
        lat.join(kv[..., :100])


def test_describe():
    """(b)"""
    cfg = config()
    m = describe_latent(cfg, name="mla", dtype="f32", num_layers=LAYERS)
    assert (m.num_kv_heads, m.head_dim, m.rotary_dim, m.rope_style) == (1, 96, 64, "gptj")
    assert m.rope_theta == 10000.0 and not m.k_pre_rope
    assert m.scaling.startswith("yarn:4.0,256,32,1"), m.scaling
    with pytest.raises(Undescribable, match="mscale_all_dim=0.707"):  # the Llama family refuses
        describe(cfg, name="x", dtype="f32", num_layers=LAYERS, num_kv_heads=1, head_dim=96)
    plain = transformers.LlamaConfig()
    assert latent_of(plain) is None
    with pytest.raises(Undescribable, match="no kv_lora_rank"):
        describe_latent(plain, name="x", dtype="f32", num_layers=2)
    odd = config()
    odd.kv_lora_rank = 32
    with pytest.raises(Undescribable, match="kv_lora_rank >= qk_rope_head_dim"):
        describe_latent(odd, name="x", dtype="f32", num_layers=LAYERS)
    linear = config()
    linear.rope_parameters = {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0}
    with pytest.raises(Undescribable, match="scaling 'linear'"):  # vLLM: DeepSeek's YaRN
        describe_latent(linear, name="x", dtype="f32", num_layers=LAYERS)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    m = transformers.DeepseekV2ForCausalLM(config()).eval()
    assert type(m.model.layers[0].self_attn).__name__ == "DeepseekV2Attention"
    assert abs(m.model.rotary_emb.attention_scaling - 1.037) < 1e-3  # keys scaled: not 1
    return m


@torch.no_grad()
def prefill_rows(model, ids, pos):
    """[layers, tokens, RANK + ROPE]: the MLA cache rows of ids prefilled at pos.."""
    cache = DynamicCache()
    x = torch.as_tensor(ids)[None]
    model(x, position_ids=torch.arange(pos, pos + x.shape[1])[None], past_key_values=cache,
          use_cache=True)
    rows = []
    for la in range(LAYERS):
        c, k_pe = cache.layers[la].keys[0, 0], cache.layers[la].values[0, 0]
        assert c.shape[-1] == RANK and k_pe.shape[-1] == ROPE, (c.shape, k_pe.shape)
        rows.append(torch.cat([c, k_pe], -1))
    return torch.stack(rows).numpy()


@torch.no_grad()
def unrotated_k_pe(model, ids):
    """[layers, tokens, ROPE]: each layer's k_pe before RoPE (the prefill at 0's inputs)."""
    got = {}

    def hook(la):
        def f(mod, args, out):
            got[la] = out[0, :, RANK:].clone()
        return f

    hs = [model.model.layers[la].self_attn.kv_a_proj_with_mqa.register_forward_hook(hook(la))
          for la in range(LAYERS)]
    try:
        model(torch.as_tensor(ids)[None])
    finally:
        for h in hs:
            h.remove()
    return [got[la] for la in range(LAYERS)]


def test_daemon_rerotation(model):
    """(c) and (d)"""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.model_executor.layers.rotary_embedding import get_rope

    cfg = model.config
    lat = latent_of(cfg)
    spec = describe_latent(cfg, name="mla-test", dtype="f32", num_layers=LAYERS)
    ids = np.random.default_rng(7).integers(0, cfg.vocab_size, TOKENS)
    stored = prefill_rows(model, ids, 0)
    raw = unrotated_k_pe(model, ids)
    params = dict(cfg.rope_parameters)
    params["rope_type"] = "deepseek_yarn"  # as vLLM's DeepseekV2 attention rewrites it
    with set_current_vllm_config(VllmConfig()):
        vrope = get_rope(ROPE, max_position=cfg.max_position_embeddings, is_neox_style=False,
                         rope_parameters=params, dtype=torch.float32)
    d = Daemon()
    worst = {"k_pe": 0.0, "latent": 0.0, "vllm": 0.0}
    try:
        with kvblend.Client(d.endpoint, timeout_ms=60000) as c:
            c.model_register(spec)
            h = kvblend.chunk_hash(ids.tolist())
            c.put(spec.name, h, np.ascontiguousarray(lat.split(stored)))
            assert np.array_equal(lat.join(c.get(spec.name, h)), stored)
            for pos in (37, 600):
                got = lat.join(c.get_rerotated(spec.name, h, pos=pos))
                want = prefill_rows(model, ids, pos)
                assert np.array_equal(got[..., :RANK], stored[..., :RANK]), \
                    f"the daemon changed the latent moving the chunk to {pos}"
                assert rel(got[..., RANK:], stored[..., RANK:]) > 0.1, \
                    f"k_pe moved to {pos} equals the stored one: nothing was rotated"
                worst["k_pe"] = max(worst["k_pe"], rel(got[..., RANK:], want[..., RANK:]))
                worst["latent"] = max(worst["latent"], rel(got[..., :RANK], want[..., :RANK]))
                positions = torch.arange(pos, pos + TOKENS)
                for la in range(LAYERS):
                    q = torch.zeros(TOKENS, 1, ROPE)  # [tokens, heads, rope dims]
                    _, k = vrope.forward_native(positions, q, raw[la].clone()[:, None])
                    worst["vllm"] = max(worst["vllm"], rel(got[la, :, RANK:], k[:, 0].numpy()))
    finally:
        d.stop()
    print(f"  MLA chunk of {TOKENS} tokens moved to 37 and 600: k_pe within {worst['k_pe']:.1e} "
          f"of transformers' prefill there and {worst['vllm']:.1e} of vLLM's rotary; the "
          f"latent bit for bit ({worst['latent']:.1e} from the prefill there)")
    for what, e in worst.items():
        assert e < TOL, f"{what}: {e:.2e} off (tolerance {TOL})"
