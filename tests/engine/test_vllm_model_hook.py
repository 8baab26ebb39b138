"""kvblend's vllm.general_plugins hook in a real vLLM 0.32 engine: the connector gets the model.

Run with the engine venv's python (.ci/engine-env), KVBLEND_LIB set to the build's
libkvblend and KVBLEND_ENGINE_MODEL (or --model) to the model directory.

(a) client/python is installed as a package (pip --target into a temporary folder,
    without the bundled library: $KVBLEND_LIB names the build's), and its metadata
    carries the ``vllm.general_plugins`` entry point ``kvblend``;
(b) in a process where the plugin did not run, ``loaded_model`` refuses with the reason;
(c) one engine start, with that folder on the engine's path and a probe connector
    (model_hook_probe.py): in the worker, ``loaded_model`` returns vLLM's Llama model,
    from the installed package, and the attention module at every KV cache's name in
    it is the module vLLM registered for the layer; at the first forward pass the
    forward context's attention modules are that model's; in the scheduler process
    (no model there) ``loaded_model`` raises with a message saying so; the engine
    generates the same 16 greedy tokens for a prompt as transformers does;
(d) in that worker, at the first forward pass, kvblend.vllm.blend.blend_prompt over
    vLLM's model: its selection equals kvblend.hf's for the same request (test_hf_blend's,
    its chunks stored by kvblend.hf under the same model name, against a real daemon) and
    its fused KV is within TOL_VLLM of kvblend.hf's; then the connector's way with the
    attention metric (question-aware selection, issue 24): blend_prompt over the context
    up to the last chunk with the question after it: its A (the question's preview over
    vLLM's modules) equals eval/qsel.py's preview on the NumPy model holding the same
    weights within TOL_A, and its selection equals kvblend.hf's (which test_hf_blend holds
    bit for bit to eval/cacheblend.py's attention_select).
Run by pytest (tests/engine/run.sh --pytest, as ctest does); skipped when KVBLEND_SKIP_ENGINE=1.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

from kvbtest import fail  # noqa: E402

HERE = Path(__file__).resolve().parent
PROMPT = "The capital of France is"
MAX_TOKENS = 16
NAME = "smollm2-hook-test"
CHECKS, RATIOS, METRIC = (1,), (0.15,), "value"
# vLLM's modules (its CPU linear, RMSNorm and rotary kernels) vs transformers' on the same
# float32 weights: another order of summation in every operation, and vLLM's rotary takes
# cos/sin from its own float32 cache; measured 3.3e-6 of a layer's largest |value| over 30
# layers. 1e-4 is 30x that and far below a wrong row (O(1) of the scale; test_hf_blend).
TOL_VLLM = 1e-4
TOL_A = 1e-4  # as test_hf_blend's (A off by float32 rounding through 30 layers)


def read_facts(path):
    facts = {}
    for line in Path(path).read_text().splitlines():
        rec = json.loads(line)
        facts.setdefault(rec["event"], rec)
    return facts


def reference(args, endpoint):
    """kvblend.hf's blend of test_hf_blend's request (chunks stored under NAME), and
    transformers' greedy continuation of PROMPT."""
    import torch
    import transformers

    import kvblend
    import kvblend.hf as kh
    from kvbtest import build_segments, numpy_twin, store_chunks

    from cacheblend import Request
    from qsel import preview

    model = transformers.AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(args.model)
    segs = build_segments(tok)
    with kvblend.Client(endpoint, timeout_ms=120000) as c:
        b = kh.Blender(model, c, name=NAME)
        store_chunks(b, segs)
        ref = b.blend(segs, CHECKS, RATIOS, METRIC)
        ref.att = b.blend(segs, CHECKS, RATIOS, "attention")
        twin = numpy_twin(model)
        req = Request([(k, list(t)) for k, t in segs],
                      [c.get(NAME, kvblend.chunk_hash(t)) for k, t in segs if k == "chunk"],
                      twin.cfg)
        ref.att_numpy, _ = preview(twin, req, req.placed)
        b.close()
    fuse_segs, n = [], 0
    for kind, t in segs:
        h = kvblend.chunk_hash(t)
        fuse_segs.append([h.hex(), n] if kind == "chunk" else [len(t), n])
        n += len(t)
    x = torch.tensor([tok.encode(PROMPT)])
    with torch.no_grad():
        greedy = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                                min_new_tokens=MAX_TOKENS, do_sample=False, temperature=None,
                                top_p=None, top_k=None)[0, x.shape[1]:].tolist()
    return ref, fuse_segs, greedy, tok


def check_blend(facts, ref, out_path):
    """(d): vLLM's modules blend as transformers' do."""
    import numpy as np

    bl = facts.get("blend")
    if bl is None or bl["error"]:
        fail(f"blend pass in the worker: {bl}")
    got = np.load(out_path)
    for i, sel in enumerate(ref.selections):
        if not np.array_equal(got[f"sel{i}"], sel):
            fail(f"check layer {CHECKS[i]}: vLLM's pass selected "
                 f"{np.setxor1d(got[f'sel{i}'], sel).size} rows unlike kvblend.hf's")
    n = len(ref.ids) - bl["question"]  # the context: up to the last chunk
    want = ref.att.selections[0][ref.att.selections[0] < n]
    if not np.array_equal(got["att_sel0"], want):
        fail(f"attention: vLLM's pass selected {np.setxor1d(got['att_sel0'], want).size} rows "
             f"unlike kvblend.hf's")
    a, a_ref = got["attention"], ref.att_numpy
    if a.shape != a_ref.shape:
        fail(f"A of shape {a.shape}, eval/qsel.py's {a_ref.shape}")
    err_a = float(np.abs(a - a_ref).max() / np.abs(a_ref).max())
    if err_a > TOL_A:
        fail(f"A from vLLM's modules differs from eval/qsel.py's by {err_a:.2e} of its largest")
    kv, want = got["kv"], ref.kv.numpy()
    worst = 0.0
    for layer in range(want.shape[0]):
        for p in range(2):
            err = float(np.abs(kv[layer, p] - want[layer, p]).max()
                        / np.abs(want[layer, p]).max())
            worst = max(worst, err)
            if err > TOL_VLLM:
                fail(f"layer {layer} {'KV'[p]}: vLLM's blend differs from kvblend.hf's by "
                     f"{err:.2e} of its scale (tolerance {TOL_VLLM:g})")
    print(f"  (d) blend pass over vLLM's modules in the worker ({bl['tokens']} tokens, "
          f"{bl['seconds']:.2f} s): selection equal to kvblend.hf's "
          f"({ref.selections[0].size} rows), fused KV within {worst:.1e} of each layer's scale")
    print(f"  (d) attention metric ({n} tokens of context, {len(ref.ids) - n} of question, "
          f"preview {bl['preview_ms']:.0f} ms): A within {err_a:.1e} of eval/qsel.py's, "
          f"selection equal to kvblend.hf's ({got['att_sel0'].size} rows)")


def test_vllm_model_hook(engine_model):
    args = argparse.Namespace(model=engine_model)
    t0 = time.monotonic()
    from kvbtest import install

    tmp = tempfile.mkdtemp(prefix="kvblend-hook.")
    site = Path(tmp) / "site"
    install(site)
    # The engine's processes import kvblend from the installed copy (with its metadata),
    # and the probe connector from here.
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), str(HERE)])
    sys.path[:0] = [str(site), str(HERE)]
    for name in [m for m in sys.modules if m == "kvblend" or m.startswith("kvblend.")]:
        del sys.modules[name]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")

    from kvblend.vllm import plugin

    class _Cfg:  # the attributes loaded_model reads of a VllmConfig
        class model_config:  # noqa: N801
            model = args.model

    try:
        plugin.loaded_model(_Cfg)
        fail("loaded_model answered before the plugin ran")
    except plugin.ModelUnreachable as e:
        if "plugin did not run" not in str(e) or "pip install" not in str(e):
            fail(f"unclear refusal: {e}")
        print(f"  (b) without the plugin: {e}")

    from harness import Daemon

    # fuse sessions idle up to 600 s (default 60): on a loaded machine the blend loop's
    # layers between two daemon calls have taken longer (the session expired under it)
    d = Daemon("--fuse-idle", "600")
    try:
        ref, fuse_segs, greedy, tok = reference(args, d.endpoint)
        run_engine(args, tmp, site, d.endpoint, ref, fuse_segs, greedy, tok)
    finally:
        d.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"test_vllm_model_hook: all passed in {time.monotonic() - t0:.0f} s")


def run_engine(args, tmp, site, endpoint, ref, fuse_segs, greedy, tok):
    """(c) and (d): one engine with the probe connector."""
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    facts_path = Path(tmp) / "facts.jsonl"
    out_path = Path(tmp) / "blend.npz"
    q = len(ref.ids) - fuse_segs[-1][1]  # the last segment, fresh: the question
    blend = {"endpoint": endpoint, "name": NAME, "ids": [int(i) for i in ref.ids],
             "segments": fuse_segs, "question": q, "checks": list(CHECKS), "ratios": list(RATIOS),
             "metric": METRIC, "out": str(out_path)}
    llm = LLM(model=args.model, enforce_eager=True, dtype="float32", max_model_len=4096,
              seed=0, enable_prefix_caching=False,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="ModelHookProbe", kv_connector_module_path="model_hook_probe",
                  kv_role="kv_both",
                  kv_connector_extra_config={"facts_path": str(facts_path), "blend": blend}))
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                                ignore_eos=True), use_tqdm=False)
    got = list(out[0].outputs[0].token_ids)
    del llm
    facts = read_facts(facts_path)
    w = facts.get("worker")
    if w is None or w["error"]:
        fail(f"worker: {w}")
    if not w["kvblend_file"].startswith(str(site)):
        fail(f"the worker imported kvblend from {w['kvblend_file']}, not the installed copy")
    if not w["model_class"].endswith("LlamaForCausalLM") or "vllm." not in w["model_class"]:
        fail(f"model class {w['model_class']}")
    if w["same_attention_modules"] != w["kv_cache_names"] or w["decoder_layers"] != 30:
        fail(f"the model's attention modules are not vLLM's layers: {w}")
    print(f"  (c) worker: {w['model_class']}, {w['decoder_layers']} decoder layers; the "
          f"attention modules at all {w['kv_cache_names']} KV cache names are vLLM's")
    print(f"      decoder layer: {w['layer_children']}, self_attn: {w['attn_children']}")
    fw = facts.get("forward")
    if fw is None or fw["same"] != 30:
        fail(f"forward context: {fw}")
    print(f"  (c) first forward pass: its {fw['same']} attention layers are the model's")
    s = facts.get("scheduler")
    if s is None or not s["error"] or "no model was loaded" not in s["error"]:
        fail(f"scheduler process: {s}")
    print(f"  (c) scheduler process: {s['error']}")
    if got != greedy:
        fail(f"vLLM with the hook generated {got}, transformers {greedy}")
    print(f"  (c) 16 greedy tokens equal to transformers': {tok.decode(got)!r}")
    check_blend(facts, ref, out_path)
