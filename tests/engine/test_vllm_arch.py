"""CacheBlend inside vLLM for Mistral, Qwen2, Qwen3, Phi-3 and Qwen3-MoE, against kvblend.hf, in real engines.

Run with the engine venv's python (.ci/engine-env), KVBLEND_LIB set to the build's
libkvblend and KVBLEND_ENGINE_MODEL (or --model) to SmolLM2-135M-Instruct's directory.
The five models are SmolLM2's real weights under each architecture's config
(make_arch_models.py, built beside it on first use): Mistral the same tensors, Qwen2 with
QKV biases, Qwen3 with per-head Q/K norms, Phi-3 with fused projections and a partial
rotary factor of 0.75, Qwen3-MoE with Qwen3's norms and each MLP cut into four experts of
which a deterministic-pattern router picks two per token (vLLM's fused MoE kernel routes
the recomputed rows in the engine, transformers' experts in kvblend.hf).

(a) refusals, no engine: a Gemma config and a Mixtral config (a mixture of experts the
    pass does not drive) give no blend settings (plain reuse) with the log line naming
    them, and so does a Mistral config with Llama 4 attention scaling; a real
    transformers Gemma model is refused by kvblend.hf (Unsupported) and by the vLLM pass's
    adapter (BlendRefused), naming it;
then for each architecture in turn, with one daemon:
(b) kvblend.hf: the prompt of test_vllm_blend (three stored chunks, fresh separators, a
    question) blended at layer 1, r = 0.15 (value metric), and 16 greedy tokens from it;
    at r = 1.0 (every token recomputed) the fused KV equals transformers' own full prefill
    of the model within TOL: the check that fails when an adapter skips Qwen3's norms or
    Qwen2's bias (a skipped step changes K and V by far more than TOL: for Qwen2 and
    Qwen3 the printed "path" figure is how far their full-prefill KV lies from the same
    tensors without the bias or the norms, i.e. Mistral's); and the first generated
    token's KL from a full prefill, at r = 0.15 by the value metric and by the default
    (anchored), below full reuse's;
(c) one engine (KvblendConnector with blend at layer 1, r = 0.15, max_model_len 512): the
    same request; the rows read back from vLLM's cache equal kvblend.hf's fused KV within
    TOL of each layer's scale, and vLLM's 16 greedy tokens equal kvblend.hf's.
Run by pytest (tests/engine/run.sh --pytest, as ctest does); skipped when KVBLEND_SKIP_ENGINE=1.
"""

import argparse
import gc
import logging
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

from kvbtest import fail, worst_dev  # noqa: E402

HERE = Path(__file__).resolve().parent
MAX_TOKENS = 16
CHECKS, RATIOS = (1,), (0.15,)
ARCHS = ("mistral", "qwen2", "qwen3", "phi3", "qwen3moe")
# As test_vllm_blend: vLLM's modules against transformers' on the same float32 weights,
# written into and read back from the cache bit for bit; and test_hf_blend's for the
# blend at r = 1.0 against transformers' own prefill (float32 sums in other orders).
TOL = 1e-4


def check_refusals(model_dirs):
    """(a)."""
    import transformers

    import kvblend.hf as kh
    from kvblend.vllm import blend as vb
    from kvblend.vllm import config

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log = logging.getLogger(config.logger.name)
    log.addHandler(Keep())
    for d in model_dirs.values():
        cfg = transformers.AutoConfig.from_pretrained(d)
        if config.config_from_extra({"blend": {}}, cfg.architectures[0], 30, cfg) is None:
            fail(f"{cfg.architectures[0]}: blending refused: {lines}")
    cfg = transformers.AutoConfig.from_pretrained(model_dirs["mistral"])
    cfg.llama_4_scaling = {"original_max_position_embeddings": 8192, "beta": 0.1}
    gcfg = transformers.GemmaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                    num_attention_heads=2, num_key_value_heads=1, head_dim=32,
                                    vocab_size=128)
    mcfg = transformers.MixtralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=2, num_key_value_heads=1,
                                      vocab_size=128, num_local_experts=4)
    for name, c, words in (("GemmaForCausalLM", gcfg, "GemmaForCausalLM is not supported"),
                           ("MixtralForCausalLM", mcfg, "MixtralForCausalLM is not supported"),
                           ("MistralForCausalLM", cfg, "Llama 4 attention scaling")):
        lines.clear()
        if config.config_from_extra({"blend": {}}, name, 30, c) is not None:
            fail(f"{name} ({words}) was not refused for blending")
        if len(lines) != 1 or words not in lines[0] or "served as plain reuse" not in lines[0]:
            fail(f"{name}: log lines {lines}")
        print(f"  (a) logged: {lines[0]}")
    gemma = transformers.GemmaForCausalLM(gcfg)
    for what, make, err in (("kvblend.hf", lambda: kh.model_spec(gemma), kh.Unsupported),
                            ("the vLLM pass", lambda: vb.VllmLlamaOps(gemma), vb.BlendRefused)):
        try:
            make()
            fail(f"{what} accepted a GemmaForCausalLM")
        except err as e:
            if "GemmaForCausalLM is not supported for blending" not in str(e):
                fail(f"{what}: message {e!r}")
            print(f"  (a) {what} refuses: {e}")


def reference(arch, model_dir, endpoint, name, tok):
    """(b): kvblend.hf's blends of the request; returns what (c) compares against.

    ``tok`` is SmolLM2's tokenizer: the prompt is the same ids for every architecture
    (transformers gives the Qwen2 directory its own Qwen2Tokenizer, 247 tokens for 250).
    """
    import numpy as np
    import torch
    import transformers

    import kvblend
    import kvblend.hf as kh
    from kvbtest import build_segments, chunk_segments, store_chunks

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    segs = build_segments(tok)
    with kvblend.Client(endpoint, timeout_ms=120000) as c:
        b = kh.Blender(model, c, name=name)
        store_chunks(b, segs)
        ref = b.blend(segs, CHECKS, RATIOS)
        tokens = b.generate(segs, MAX_TOKENS, blend=ref)
        everything = b.blend(segs, CHECKS, (1.0,))
        full = b.prefill_kv(ref.ids)
        reuse = b.blend(segs, (), ())  # full reuse: only the fresh tokens computed
        default = b.blend(segs)  # the connector's default: anchored, r = 0.15
        b.close()
        with torch.no_grad():
            plain = torch.log_softmax(model(torch.as_tensor(ref.ids)[None]).logits[0, -1], -1)
    kl = {what: float((plain.exp() * (plain - torch.log_softmax(x.logits, -1))).sum())
          for what, x in (("value r=0.15", ref), ("anchored r=0.15", default),
                          ("full reuse", reuse))}
    for what in ("value r=0.15", "anchored r=0.15"):
        if not kl[what] < kl["full reuse"]:
            fail(f"{arch}: the first token's KL from a full prefill at {what} ({kl[what]:.3g}) "
                 f"is not below full reuse's ({kl['full reuse']:.3g})")
    dev = worst_dev(everything.kv.numpy(), full)
    if dev > TOL:
        fail(f"{arch}: kvblend.hf at r=1.0 differs from transformers' full prefill by {dev:.2e} "
             f"of a layer's scale (tolerance {TOL:g})")
    chunks, n = chunk_segments(segs)
    print(f"  (b) {arch}: kvblend.hf: {n} tokens, {ref.selections[0].size} rows recomputed after "
          f"layer {CHECKS[0]}; at r=1.0 within {dev:.1e} of transformers' full prefill; "
          f"first-token KL value {kl['value r=0.15']:.3g}, anchored "
          f"{kl['anchored r=0.15']:.3g}, full reuse {kl['full reuse']:.3g}; "
          f"continuation {tok.decode(tokens)!r}")
    del model
    return ref, tokens, chunks, np.asarray(full)


def run_engine(arch, model_dir, endpoint, name, ref, tokens, chunks, dump_dir):
    """(c): one engine; returns the deviation of its cache from kvblend.hf's fused KV."""
    import numpy as np
    from kvbtest import connector_llm, read_cache
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    for old in dump_dir.glob("load-*.npz"):
        old.unlink()
    # load_cost_check off: every blend asked for is run (test_vllm_connector (k) tests it)
    extra = {"endpoint": endpoint, "model_name": name, "timeout_ms": 60000,
             "blend": {"check_layers": list(CHECKS), "ratios": list(RATIOS)},
             "load_cost_check": False}
    t0 = time.monotonic()
    llm = connector_llm(model_dir, extra, max_model_len=512, enable_prefix_caching=False)
    t1 = time.monotonic()
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                        extra_args={"kv_transfer_params": {"kvblend": {"segments": chunks}}})
    out = llm.generate([TokensPrompt(prompt_token_ids=[int(i) for i in ref.ids])], [sp],
                       use_tqdm=False)
    got = list(out[0].outputs[0].token_ids)
    t2 = time.monotonic()
    del llm, out
    gc.collect()
    dumps = sorted(dump_dir.glob("load-*.npz"))
    if len(dumps) != 1:
        fail(f"{arch}: {len(dumps)} load dumps, expected the one blend")
    n = chunks[-1][0] + chunks[-1][1]  # the claim: up to the end of the last chunk
    dev = worst_dev(read_cache(np.load(dumps[0]), n), ref.kv.numpy()[:, :, :n])
    if dev > TOL:
        fail(f"{arch}: vLLM's cache differs from kvblend.hf's blend by {dev:.2e} of a layer's "
             f"scale (tolerance {TOL:g})")
    if got != tokens:
        fail(f"{arch}: vLLM's continuation {got} != kvblend.hf's {tokens}")
    print(f"  (c) {arch}: vLLM's cache after the blend: {n} rows within {dev:.1e} of kvblend.hf's "
          f"fused KV; {len(got)} greedy tokens equal (engine start {t1 - t0:.0f} s, request "
          f"{t2 - t1:.1f} s)")
    return dev


def test_vllm_arch(engine_model, pytestconfig):
    # --model: SmolLM2-135M-Instruct's directory (the others are built beside it); --arch
    # (repeatable): only these; --no-engine ARCH (repeatable): kvblend.hf's part only for
    # this one, no engine start (tests/conftest.py has the options)
    args = argparse.Namespace(model=engine_model, arch=pytestconfig.getoption("arch"),
                              no_engine=pytestconfig.getoption("no_engine"))
    unknown = (set(args.arch or ()) | set(args.no_engine)) - set(ARCHS)
    if unknown:
        fail(f"no such architecture {sorted(unknown)}: {', '.join(ARCHS)}")
    t0 = time.monotonic()
    sys.path.insert(0, str(HERE))
    from make_arch_models import ensure
    from kvbtest import engine_env

    archs = args.arch or list(ARCHS)
    model_dirs = {a: str(d) for a, d in ensure(args.model).items()}
    print(f"  models ready in {time.monotonic() - t0:.0f} s")
    tmp = engine_env("kvblend-arch.")
    dump_dir = tmp / "dump"
    check_refusals(model_dirs)

    from harness import Daemon

    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    # A landing session's node calls the daemon only at check layers: on a loaded machine
    # the layers after the last one may outlast the default 60 s fuse_idle.
    d = Daemon("--fuse-idle", "600")
    devs, fulls = {}, {}
    try:
        for arch in archs:
            name = f"arch-test-{arch}"
            ref, tokens, chunks, fulls[arch] = reference(arch, model_dirs[arch], d.endpoint, name,
                                                         tok)
            if arch in args.no_engine:
                print(f"  (c) {arch}: no engine start (--no-engine)")
                continue
            devs[arch] = run_engine(arch, model_dirs[arch], d.endpoint, name, ref, tokens, chunks,
                                    dump_dir)
    finally:
        d.stop()
    for arch, base, what in (("qwen2", "mistral", "bias"), ("qwen3", "mistral", "norms"),
                             ("qwen3moe", "qwen3", "experts (a dense MLP)")):
        if arch in fulls and base in fulls:
            path = worst_dev(fulls[arch], fulls[base])
            if path < 100 * TOL:
                fail(f"{arch}: its full prefill is within {path:.1e} of the same tensors without "
                     f"its {what}: the test would not see them skipped")
            print(f"  path: {arch}'s full-prefill KV lies {path:.2f} of a layer's scale from "
                  f"the same tensors without its {what}")
    shutil.rmtree(tmp, ignore_errors=True)
    worst = ", ".join(f"{a} {v:.1e}" for a, v in devs.items())
    print(f"test_vllm_arch: all passed in {time.monotonic() - t0:.0f} s (max deviation {worst})")
