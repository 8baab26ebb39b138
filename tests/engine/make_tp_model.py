"""Small random-weight models with 4 KV heads, for tensor parallelism 2 in vLLM's CPU build.

SmolLM2-135M has 3 KV heads, which 2 ranks cannot split; this model has 4 (8 query
heads, head_dim 32, hidden 256, 4 layers, the SmolLM2 tokenizer and its vocabulary), so
that each of 2 ranks holds 2. Weights are float32, drawn from a fixed seed in a fixed
order (the same file on every machine); initializer 0.1 and an lm_head 10x wider than
that, so that greedy choices are not decided by rounding (TP = 1 and TP = 2 sum in
other orders: their logits differ by about 1e-5).

The same shapes as a Qwen3-MoE (``family="qwen3moe"``, ``qwen3moe4kv-random``): Qwen3's
per-head Q/K norms and, in every layer, 4 experts (intermediate 256 each) of which 2 are
routed to each token (weights renormalized over them), so that the blend pass's routed
experts run sharded over 2 ranks. Its experts are written per expert
(``mlp.experts.E.{gate,up,down}_proj.weight``), the layout vLLM loads.

And as a Gemma 3 (``family="gemma3"``, ``gemma3-4kv-random``): its Q/K and sandwich norms,
scaled embedding and GELU MLP, local layers (0 and 2) with a sliding window of 48 tokens
and RoPE base 10,000, full layers (1 and 3) with base 1,000,000, so that the blend pass's
windows and the daemon's two bases run over 2 ranks (Gemma-3-270M itself has one KV head,
which 2 ranks cannot split).

Built beside the base model (``llama4kv-random``, ``qwen3moe4kv-random``) under a temporary
name and renamed into place; an existing build of this version is kept. Usage (the engine
venv's python)::

    python tests/engine/make_tp_model.py --base SMOLLM2_DIR [--family qwen3moe|gemma3]

prints the directory; :func:`ensure` does the same for a test.
"""

import argparse
import os
import shutil
import sys
import tempfile
from pathlib import Path

VERSION = "1"
STAMP = "kvblend-model-version"
SEED = 1234
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "vocab.json", "merges.txt", "chat_template.jinja")


def _stamp(d: Path) -> str | None:
    try:
        return (d / STAMP).read_text().strip()
    except OSError:
        return None


#: The models, by family: directory name and (config class, model class) in transformers.
FAMILIES = {"llama": ("llama4kv-random", "LlamaConfig", "LlamaForCausalLM"),
            "qwen3moe": ("qwen3moe4kv-random", "Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
            "gemma3": ("gemma3-4kv-random", "Gemma3TextConfig", "Gemma3ForCausalLM")}
MOE_EXPERTS, MOE_TOP_K = 4, 2


def _build(base: Path, out: Path, family: str = "llama") -> None:
    import torch
    import transformers

    _, config_class, model_class = FAMILIES[family]
    shape = dict(
        vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, hidden_act="silu",
        max_position_embeddings=2048, initializer_range=0.1, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    if family == "llama":
        shape.update(mlp_bias=False)
    elif family == "gemma3":
        for k in ("hidden_act", "rope_theta", "attention_bias"):
            del shape[k]
        shape.update(hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=32,
                     sliding_window=48, layer_types=["sliding_attention", "full_attention"] * 2,
                     rope_parameters={"full_attention": {"rope_type": "default",
                                                         "rope_theta": 1e6},
                                      "sliding_attention": {"rope_type": "default",
                                                            "rope_theta": 1e4}},
                     attn_logit_softcapping=None, final_logit_softcapping=None)
    else:
        shape.update(num_experts=MOE_EXPERTS, num_experts_per_tok=MOE_TOP_K,
                     moe_intermediate_size=256, norm_topk_prob=True, decoder_sparse_step=1,
                     mlp_only_layers=[], use_sliding_window=False, router_aux_loss_coef=0.0)
    cfg = getattr(transformers, config_class)(**shape)
    cfg.architectures = [model_class]
    model = getattr(transformers, model_class)(cfg)
    g = torch.Generator().manual_seed(SEED)
    with torch.no_grad():
        for name, p in sorted(model.named_parameters()):
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                std = 1.0 if name == "lm_head.weight" else cfg.initializer_range
                p.copy_(torch.randn(p.shape, generator=g) * std)
    model.config.torch_dtype = "float32"
    model.save_pretrained(out, safe_serialization=True)
    for f in TOKENIZER_FILES:
        if (base / f).exists():
            shutil.copy(base / f, out / f)


def ensure(base, out_root=None, family="llama") -> Path:
    """Build the family's model if this version is not there yet; return its directory."""
    base = Path(base).resolve()
    root = Path(out_root).resolve() if out_root else base.parent
    name = FAMILIES[family][0]
    d = root / name
    if _stamp(d) == VERSION:
        return d
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{name}.", dir=root))
    try:
        _build(base, work, family)
        (work / STAMP).write_text(VERSION + "\n")
        for f in work.iterdir():
            f.chmod(0o644)
        work.chmod(0o755)
        if d.exists():
            shutil.rmtree(d)
        try:
            os.rename(work, d)
        except OSError:  # another run put it there first
            if _stamp(d) != VERSION:
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return d


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, help="SmolLM2-135M-Instruct's directory")
    ap.add_argument("--out-root", default=None)
    ap.add_argument("--family", choices=sorted(FAMILIES), default="llama")
    args = ap.parse_args()
    print(ensure(args.base, args.out_root, args.family))
    return 0


if __name__ == "__main__":
    sys.exit(main())
