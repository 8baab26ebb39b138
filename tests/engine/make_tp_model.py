"""A small random-weight Llama with 4 KV heads, for tensor parallelism 2 in vLLM's CPU build.

SmolLM2-135M has 3 KV heads, which 2 ranks cannot split; this model has 4 (8 query
heads, head_dim 32, hidden 256, 4 layers, the SmolLM2 tokenizer and its vocabulary), so
that each of 2 ranks holds 2. Weights are float32, drawn from a fixed seed in a fixed
order (the same file on every machine); initializer 0.1 and an lm_head 10x wider than
that, so that greedy choices are not decided by rounding (TP = 1 and TP = 2 sum in
other orders: their logits differ by about 1e-5).

Built beside the base model (``llama4kv-random``) under a temporary name and renamed into
place; an existing build of this version is kept. Usage (the engine venv's python)::

    python tests/engine/make_tp_model.py --base SMOLLM2_DIR

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


def _build(base: Path, out: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(
        vocab_size=49152, hidden_size=256, intermediate_size=512, num_hidden_layers=4,
        num_attention_heads=8, num_key_value_heads=4, head_dim=32, hidden_act="silu",
        max_position_embeddings=2048, initializer_range=0.1, rms_norm_eps=1e-5,
        rope_theta=10000.0, tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    cfg.architectures = ["LlamaForCausalLM"]
    model = LlamaForCausalLM(cfg)
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


def ensure(base, out_root=None) -> Path:
    """Build the model if this version is not there yet; return its directory."""
    base = Path(base).resolve()
    root = Path(out_root).resolve() if out_root else base.parent
    d = root / "llama4kv-random"
    if _stamp(d) == VERSION:
        return d
    root.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=".llama4kv-random.", dir=root))
    try:
        _build(base, work)
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
    args = ap.parse_args()
    print(ensure(args.base, args.out_root))
    return 0


if __name__ == "__main__":
    sys.exit(main())
