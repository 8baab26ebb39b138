"""kvblend.blend.arch: which architectures each engine's blend pass drives, and Gemma 3's
local layers read from a config; no engine, no daemon, no torch."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from kvblend.blend import arch


def gemma_config(**kw):
    base = dict(num_hidden_layers=6, sliding_window=512, layer_types=None,
                sliding_window_pattern=None, attn_logit_softcapping=None,
                final_logit_softcapping=None, use_bidirectional_attention=False)
    base.update(kw)
    return SimpleNamespace(**base)


GEMMA = arch.ARCHITECTURES["Gemma3ForCausalLM"]
TYPES = ["sliding_attention"] * 5 + ["full_attention"]


def test_gemma3_is_blended_by_both_engines():
    assert arch.lookup("Gemma3ForCausalLM", "kvblend") is GEMMA
    assert arch.check_config("Gemma3ForCausalLM", gemma_config(layer_types=TYPES),
                             "kvblend") is GEMMA
    assert "Gemma3ForCausalLM" in arch.supported()
    # Gemma 1 and 2 stay refused
    for name in ("GemmaForCausalLM", "Gemma2ForCausalLM"):
        with pytest.raises(arch.ArchRefused, match=f"{name} is not supported"):
            arch.lookup(name, "x")


def test_sliding_windows_from_layer_types_and_pattern():
    by_types = arch.sliding_windows(GEMMA, gemma_config(layer_types=TYPES), "x")
    assert by_types == [512] * 5 + [None]
    # older configs: every pattern-th layer (1-based) is full
    by_pattern = arch.sliding_windows(GEMMA, gemma_config(sliding_window_pattern=6), "x")
    assert by_pattern == by_types
    two = arch.sliding_windows(GEMMA, gemma_config(sliding_window_pattern=2), "x")
    assert two == [512, None, 512, None, 512, None]
    # an architecture without local layers: all full, whatever the config says
    llama = arch.ARCHITECTURES["LlamaForCausalLM"]
    assert arch.sliding_windows(llama, gemma_config(layer_types=TYPES), "x") == [None] * 6


@pytest.mark.parametrize("cfg, words", [
    (gemma_config(), "neither layer_types nor sliding_window_pattern"),
    (gemma_config(layer_types=TYPES, sliding_window=None), "without a sliding window"),
    (gemma_config(layer_types=TYPES[:-1] + ["chunked_attention"]), "layer types"),
    (gemma_config(layer_types=TYPES[:4]), "layer types"),
    (gemma_config(layer_types=TYPES, attn_logit_softcapping=50.0), "attention logit softcap"),
    (gemma_config(layer_types=TYPES, final_logit_softcapping=30.0), "final logit softcap"),
    (gemma_config(layer_types=TYPES, use_bidirectional_attention=True), "bidirectional"),
])
def test_gemma3_configs_refused(cfg, words):
    with pytest.raises(arch.ArchRefused, match=words):
        arch.check_config("Gemma3ForCausalLM", cfg, "kvblend.hf")


def test_gemma3_config_taken():
    cfg = gemma_config(layer_types=TYPES)
    assert arch.check_config("Gemma3ForCausalLM", cfg, "kvblend.hf") is GEMMA
