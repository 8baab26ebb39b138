"""kvblend.hf: CacheBlend over the real SmolLM2-135M in transformers, against a real kvblendd.

Run with the engine venv's python (.ci/engine-env), KVBLEND_LIB set to the build's
libkvblend and KVBLEND_ENGINE_MODEL (or --model) to the model directory. No engine start:
the model loads in a few seconds. One request of three stored chunks, fresh separators and
a question (about 330 tokens):

(a) selection: at every check layer the daemon's selection equals eval/cacheblend.py's
    hkvd_select over the same fresh plane the node sent (value metric at layer 1, r=0.15;
    key metric with gradual filtering at layers 1 and 4, r=0.3 then 0.15);
(b) fused KV: equals eval/cacheblend.py's blend_forward on a NumPy model holding the same
    weights, forced to the daemon's selection, whose stored rows are re-rotated by NumPy
    (TOL_FUSED below says why that tolerance); full reuse (no check layer) likewise;
(c) the landing session and the classic one (what tcp:// gets) fuse bit for bit alike;
(d) greedy continuation: r = 1.0 (every token recomputed) equals transformers' own full
    prefill + generate() token for token, and its fused KV equals the full prefill's KV;
    r = 0.15 twice gives the same fused KV bit for bit and the same tokens, and the same
    tokens as generate() from the NumPy reference's fused KV;
(e) an architecture kvblend.hf does not drive (GPT-2) is refused with kvblend.hf.Unsupported
    (Mistral, Qwen2 and Qwen3: test_vllm_arch.py; Gemma 3: test_hf_gemma.py).
(f) the attention metric (question-aware selection, issue 24) at layer 1, r=0.15: A from
    kvblend's preview (kvblend.blend.preview, the connector's too) equals eval/qsel.py's
    preview on the NumPy model within TOL_A, and the daemon's selection equals
    eval/cacheblend.py's attention_select bit for bit, over the K and V the node sent, the
    daemon's own re-rotated stored rows (get_rerotated) and the A it was given.
(g) the question metric (A alone, no check layer, issue 35) at r=0.15: its selection is
    eval/qsel.py's alone_selection over the same A, and the fused KV and last-token logits
    equal eval/cacheblend.py's blend_forward recomputing those rows at every layer; at
    r=1.0 the fused KV equals transformers' full prefill, at r=0 full reuse's.
(h) the anchored metric (QCFuse-style compressed preview, issue 35) at r=0.15: A summed
    over heads equals eval/rules.py's qcfuse_score over eval/qsel.py's question_pass with
    the same anchors and critical layer within TOL_A, the selection is its top tokens, and
    the fused KV equals blend_forward recomputing them, and a classic session's bit for bit;
    blend(segments) with no metric nor check layers is that blend (the default), and
    blend(segments, (1,), (0.15,)) the value metric's.
(i) bfloat16 (what models run in on GPUs; the blend pass keeps its KV as raw bits on the
    host, kvblend.blend.host): the same model in bfloat16 stores each chunk as its own
    prefill's bits; full reuse lands every chunk row as the daemon's re-rotation of it
    (GET re-rotated) bit for bit; r = 1.0 gives transformers' bfloat16 full prefill's KV;
    the landing and classic sessions fuse bit for bit alike; the anchored default runs.
Run by pytest (tests/engine/run.sh --pytest, as ctest does); skipped when KVBLEND_SKIP_ENGINE=1.
"""

import os
import time

import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402

import kvblend  # noqa: E402
import kvblend.hf as kh  # noqa: E402
from kvblend.blend import host  # noqa: E402
from kvblend.blend.preview import critical_layer  # noqa: E402
# the reference: eval/'s cacheblend.py, model.py, ... (eval/ is on PYTHONPATH: run.sh)
from cacheblend import (  # noqa: E402
    Request,
    attention_select,
    blend_forward,
    deviation,
    hkvd_select,
    select_count,
)
from harness import Daemon  # noqa: E402
from kvbtest import build_segments, fail, numpy_twin  # noqa: E402
from qsel import alone_selection, preview, question_pass  # noqa: E402
from rules import CRITICAL_LAYER, anchors, qcfuse_score, top_tokens  # noqa: E402

MAX_TOKENS = 16
# Fused KV, HF node vs NumPy reference: both are float32 with the same operations, but the
# matmuls (torch's oneDNN/MKL GEMM vs NumPy's OpenBLAS) and reductions (RMSNorm, softmax)
# sum in different orders, ~1e-7 relative per operation; across 30 residual layers this
# grows to ~1e-5 of a layer's largest |value| (measured: 2.0e-6 to 5.4e-6 here). 1e-4 of the
# layer's max |value| is 10x that and still 100x below a wrong row (a row of the wrong
# token, or one attended with the wrong mask, differs by O(1) of the scale).
TOL_FUSED = 1e-4
# The daemon's re-rotation (float64 angles, float32 arithmetic) vs NumPy's (the same,
# another order of operations) on a stored row: a few ulps of the layer's largest |k|.
TOL_ROTATE = 2e-5
# A, kvblend's preview (torch, transformers' modules, the daemon's re-rotation) vs
# eval/qsel.py's (NumPy, NumPy's re-rotation): softmax weights summed over ~20 queries, 28
# layers and 3 heads, each weight off by float32 rounding carried through 30 layers;
# measured 9.2e-8 of A's largest entry here (vLLM's modules in test_vllm_model_hook: see
# there). 1e-4 stays far below a wrong layer range, head grouping or mask (each moves A by
# 1e-2 or more of its largest entry).
TOL_A = 1e-4

def check_selection(bl, req, checks, ratios, metric):
    """(a): the daemon's selection at each check layer against hkvd_select on the same plane."""
    m = 1 if metric == "value" else 0
    fresh = np.flatnonzero(~req.cached)
    n_cached = int(req.cached.sum())
    for i, layer in enumerate(checks):
        S, plane = bl.sent[layer], bl.checked[layer]
        is_cached = req.cached[S]
        dev = deviation(plane[is_cached], req.placed[layer, m, S[is_cached]])
        k = select_count(ratios[i], n_cached)
        ref = hkvd_select(dev, S[is_cached], k, fresh)
        srt = np.sort(dev)[::-1]
        gap = (srt[k - 1] - srt[k]) / srt[k - 1] if k < srt.size else 1.0
        if not np.array_equal(ref, bl.selections[i]):
            fail(f"{metric} check layer {layer}: daemon selected {bl.selections[i].size} rows, "
                 f"reference {ref.size}; {np.setxor1d(ref, bl.selections[i]).size} differ "
                 f"(relative gap at the cut {gap:.2e})")
        print(f"  {metric} layer {layer} r={ratios[i]}: {k} of {n_cached} cached + "
              f"{fresh.size} fresh = {ref.size} rows, equal (relative gap at the cut {gap:.1e})")


def compare_fused(kv, ref, what):
    """(b): fused KV [L, 2, N, H, d] against the reference, per layer and plane."""
    worst = 0.0
    for layer in range(ref.shape[0]):
        for p in range(2):
            scale = float(np.abs(ref[layer, p]).max())
            err = float(np.abs(kv[layer, p] - ref[layer, p]).max()) / scale
            worst = max(worst, err)
            if err > TOL_FUSED:
                fail(f"{what}: layer {layer} {'KV'[p]} differs by {err:.2e} of its scale "
                     f"(tolerance {TOL_FUSED:g})")
    print(f"  {what}: fused KV equal to the reference, worst {worst:.1e} of a layer's scale")
    return worst


def test_hf_blend(engine_model):
    torch.manual_seed(0)
    t0 = time.monotonic()
    model = transformers.AutoModelForCausalLM.from_pretrained(engine_model, dtype=torch.float32)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(engine_model)
    twin = numpy_twin(model)
    print(f"model loaded in {time.monotonic() - t0:.1f} s")
    segs = build_segments(tok)
    d = Daemon()
    try:
        with kvblend.Client(d.endpoint, timeout_ms=120000) as c:
            run(model, twin, c, segs)
            del twin
            check_bf16(engine_model, c, segs)
    finally:
        d.stop()
    print(f"test_hf_blend: all passed in {time.monotonic() - t0:.0f} s")


def run(model, twin, c, segs):
    b = kh.Blender(model, c)
    if b.session_kind != "landing":
        fail(f"an ipc:// daemon should get a landing session, got {b.session_kind}")
    hashes = [b.store(t) for kind, t in segs if kind == "chunk"]
    stored = [c.get(b.spec.name, h) for h in hashes]
    req = Request([(k, list(t)) for k, t in segs], stored, twin.cfg)
    ids = req.ids
    print(f"request: {req.N} tokens, {int(req.cached.sum())} in {len(hashes)} stored chunks")

    # (a) + (b): CacheBlend, value metric at layer 1 and key metric with gradual filtering.
    worst = {}
    for checks, ratios, metric in (((1,), (0.15,), "value"), ((1, 4), (0.3, 0.15), "key")):
        bl = b.blend(segs, checks, ratios, metric, keep_checks=True)
        check_selection(bl, req, checks, ratios, metric)
        ref_logits, ref_kv, _ = blend_forward(twin, req, np.array([req.N - 1]), list(checks),
                                              list(ratios), metric, force=bl.selections)
        worst[metric] = compare_fused(bl.kv.numpy(), ref_kv, f"{metric} {checks} {ratios}")
        lg = float(np.abs(bl.logits.numpy() - ref_logits[0]).max() / np.abs(ref_logits).max())
        if lg > TOL_FUSED:
            fail(f"{metric}: last-token logits differ by {lg:.2e} of their scale")
    # A stored row no check selected: exactly the stored row re-rotated (daemon vs NumPy).
    sel = bl.selections[-1]
    rest = np.setdiff1d(np.flatnonzero(req.cached), sel)
    worst_rot = 0.0
    for layer in (5, 29):
        for p in range(2):
            e = float(np.abs(bl.kv[layer, p, rest].numpy() - req.placed[layer, p, rest]).max())
            e /= float(np.abs(req.placed[layer, p, rest]).max())
            worst_rot = max(worst_rot, e)
            if e > TOL_ROTATE:
                fail(f"layer {layer} {'KV'[p]}: a stored row re-rotated by the daemon differs "
                     f"from NumPy's by {e:.2e} of the scale")
    print(f"  {rest.size} unselected rows at layers 5 and 29 equal the stored rows re-rotated "
          f"(worst {worst_rot:.1e} of the scale)")
    # Full reuse through a reuse-only landing session.
    bl = b.blend(segs, (), ())
    _, ref_kv, _ = blend_forward(twin, req, np.array([req.N - 1]))
    compare_fused(bl.kv.numpy(), ref_kv, "full reuse")

    # (c) landing vs classic.
    land = b.blend(segs, (1,), (0.15,))
    classic = kh.Blender(model, c, landing=False)
    cl = classic.blend(segs, (1,), (0.15,))
    if cl.session != "classic" or land.session != "landing":
        fail(f"session kinds {land.session}, {cl.session}")
    if not torch.equal(cl.kv, land.kv) or not all(
            np.array_equal(x, y) for x, y in zip(cl.selections, land.selections)):
        fail(f"classic vs landing: fused KV differs by {float((cl.kv - land.kv).abs().max())}")
    print("  (c) classic session: same selection, fused KV bit for bit equal to landing")

    # (d) greedy continuations.
    x = torch.as_tensor(ids)[None]
    with torch.no_grad():
        full = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                              do_sample=False, temperature=None, top_p=None, top_k=None)
        full = full[0, req.N:].tolist()
        pkv = model(x, use_cache=True).past_key_values
    everything = b.blend(segs, (1,), (1.0,))
    if everything.selections[0].size != req.N:
        fail(f"r=1.0 selected {everything.selections[0].size} of {req.N} rows")
    full_kv = np.stack([np.stack([pkv.layers[i].keys[0].transpose(0, 1).numpy(),
                                  pkv.layers[i].values[0].transpose(0, 1).numpy()])
                        for i in range(twin.cfg.n_layers)])
    compare_fused(everything.kv.numpy(), full_kv, "r=1.0 vs transformers' full prefill")
    got = b.generate(segs, MAX_TOKENS, blend=everything)
    if got != full:
        fail(f"r=1.0 continuation {got} != full prefill's {full}")
    print(f"  (d) r=1.0: {len(got)} greedy tokens equal to the full prefill's")
    again = b.blend(segs, (1,), (0.15,))
    if not torch.equal(again.kv, land.kv):
        fail("r=0.15 twice: fused KV differs")
    g1 = b.generate(segs, MAX_TOKENS, blend=land)
    g2 = b.generate(segs, MAX_TOKENS, blend=again)
    _, ref_kv, _ = blend_forward(twin, req, np.array([req.N - 1]), [1], [0.15], "value",
                                 force=land.selections)
    ref_blend = kh.Blend(ids=ids, kv=torch.from_numpy(ref_kv), logits=torch.empty(0))
    g3 = b.generate(segs, MAX_TOKENS, blend=ref_blend)
    if not g1 == g2 == g3:
        fail(f"r=0.15 continuations differ: {g1}, {g2}, reference's {g3}")
    same = sum(a == f for a, f in zip(g1, full))
    print(f"  (d) r=0.15: deterministic, equal to the NumPy reference's fused KV's continuation "
          f"({same} of {len(g1)} tokens at the same place as the full prefill's)")
    b.close()

    check_attention(b, c, req, twin, hashes)
    check_question(b, req, twin, full_kv)
    check_anchored(b, req, twin)

    # (e) another architecture (GPT-2: learned positions, no RoPE, a layer the pass does not
    # reproduce; Gemma 3 is blended: test_hf_gemma.py)
    gcfg = transformers.GPT2Config(n_embd=64, n_layer=1, n_head=2, vocab_size=128,
                                   n_positions=64, bos_token_id=1, eos_token_id=1)
    try:
        kh.Blender(transformers.GPT2LMHeadModel(gcfg), c)
        fail("a GPT2LMHeadModel was not refused")
    except kh.Unsupported as e:
        if "GPT2LMHeadModel is not supported" not in str(e):
            fail(f"refusal message: {e}")
        print(f"  (e) refused: {e}")


def check_bf16(path, c, segs):
    """(i): the blend pass in bfloat16, its KV held as raw bits on the host."""
    model = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    model.eval()
    b = kh.Blender(model, c)
    if b.spec.dtype != "bf16":
        fail(f"a bfloat16 model described as {b.spec.dtype}")
    chunks = [(k, np.asarray(t, np.int64)) for k, t in segs]
    hashes = [b.store(t) for k, t in chunks if k == "chunk"]
    first = next(t for k, t in chunks if k == "chunk")
    stored = c.get(b.spec.name, hashes[0])
    if stored.dtype != np.uint16 or not np.array_equal(stored, b.prefill_kv(first)):
        fail("(i) bf16: the stored chunk is not its prefill's bits")
    ids = np.concatenate([t for _, t in chunks])
    x = torch.as_tensor(ids)[None]
    with torch.no_grad():
        pkv = model(x, use_cache=True).past_key_values
    full = torch.stack([torch.stack([pkv.layers[i].keys[0].transpose(0, 1),
                                     pkv.layers[i].values[0].transpose(0, 1)])
                        for i in range(len(pkv.layers))]).float()
    reuse = b.blend(segs, (), ())
    if reuse.kv.dtype != torch.bfloat16:
        fail(f"(i) bf16: fused KV of {reuse.kv.dtype}")
    got = host.array(reuse.kv)
    pos, i = 0, 0
    for kind, t in chunks:
        if kind == "chunk":
            want = c.get_rerotated(b.spec.name, hashes[i], pos=pos)
            if not np.array_equal(got[:, :, pos : pos + t.size], want):
                fail(f"(i) bf16: full reuse's chunk {i} rows are not the daemon's re-rotation")
            i += 1
        pos += t.size
    everything = b.blend(segs, (1,), (1.0,))
    worst = max(float((everything.kv[la, p].float() - full[la, p]).abs().max()
                      / full[la, p].abs().max()) for la in range(full.shape[0]) for p in range(2))
    # bfloat16 has 8 bits of mantissa: one unit in the last place is 2^-8 of a value
    if worst > 2.0 ** -8:
        fail(f"(i) bf16: r=1.0 differs from the full prefill by {worst:.2e} of a layer's scale")
    land = b.blend(segs, (1,), (0.15,))
    cl = kh.Blender(model, c, landing=False).blend(segs, (1,), (0.15,))
    if not torch.equal(cl.kv, land.kv):
        fail("(i) bf16: the classic session's fused KV differs from the landing one's")
    default = b.blend(segs)
    if not bool(torch.isfinite(default.kv.float()).all()) or not default.selections[-1].size:
        fail("(i) bf16: the anchored default gave no selection or values that are not finite")
    print(f"  (i) bf16: stored bits, full reuse's rows bit for bit, r=1.0 within {worst:.1e} of "
          f"the full prefill's scale, landing = classic, anchored default "
          f"{default.selections[-1].size} rows")
    b.close()


def check_attention(b, c, req, twin, hashes):
    """(f): the attention metric's A and selection against eval/qsel.py and cacheblend.py."""
    layer, r = 1, 0.15
    bl = b.blend([(k, list(t)) for k, t in req.segments], (layer,), (r,), "attention",
                 keep_checks=True)
    a_ref, _ = preview(twin, req, req.placed)
    a = bl.attention
    if a is None or a.shape != a_ref.shape:
        fail(f"A: {None if a is None else a.shape}, reference {a_ref.shape}")
    err = float(np.abs(a - a_ref).max() / np.abs(a_ref).max())
    if err > TOL_A:
        fail(f"A differs from eval/qsel.py's preview by {err:.2e} of its largest entry")
    S, plane = bl.sent[layer], bl.checked[layer]  # [rows, 2, kv_heads, d]: K then V
    is_cached = req.cached[S]
    cand = S[is_cached]
    placed = np.zeros((2, req.N) + plane.shape[2:], np.float32)  # the daemon's re-rotation
    for (kind, s, t), h in zip([sp for sp in req.spans if sp[0] == "chunk"], hashes):
        placed[:, s:s + t] = c.get_rerotated(b.spec.name, h, pos=s)[layer, :, :t]
    cached_ord = np.searchsorted(np.flatnonzero(req.cached), cand)
    k = select_count(r, int(req.cached.sum()))
    ref = attention_select(plane[is_cached, 0], plane[is_cached, 1], placed[0, cand],
                           placed[1, cand], a, cand, cached_ord, k, np.flatnonzero(~req.cached))
    if not np.array_equal(ref, bl.selections[0]):
        fail(f"attention: the daemon selected {bl.selections[0].size} rows, the reference "
             f"{ref.size}; {np.setxor1d(ref, bl.selections[0]).size} differ")
    top = np.flatnonzero(req.cached)[np.argsort(-a.sum(1))[:3]]
    print(f"  (f) attention r={r}: A [{a.shape[0]}, {a.shape[1]}] within {err:.1e} of "
          f"eval/qsel.py's (most read: tokens {top.tolist()}); {k} of {cand.size} cached "
          f"selected, equal to attention_select bit for bit")


def check_question(b, req, twin, full_kv):
    """(g): the question metric against the NumPy node recomputing the same rows."""
    r = 0.15
    bl = b.blend(req.segments, ratios=(r,), metric="question")
    fresh = np.flatnonzero(~req.cached)
    k = select_count(r, int(req.cached.sum()))
    sel = alone_selection(bl.attention, req, k)
    if len(bl.selections) != 1 or not np.array_equal(bl.selections[0], np.union1d(fresh, sel)):
        fail(f"question: rows computed {[x.size for x in bl.selections]}, expected "
             f"{fresh.size} fresh + {sel.size} selected")
    logits, ref_kv, _ = blend_forward(twin, req, np.array([req.N - 1]), recompute=sel)
    worst = compare_fused(bl.kv.numpy(), ref_kv, f"question r={r}")
    lg = float(np.abs(bl.logits.numpy() - logits[0]).max() / np.abs(logits).max())
    if lg > TOL_FUSED:
        fail(f"question: last-token logits differ by {lg:.2e} of their scale")
    everything = b.blend(req.segments, ratios=(1.0,), metric="question")
    compare_fused(everything.kv.numpy(), full_kv, "question r=1.0 vs transformers' full prefill")
    none = b.blend(req.segments, ratios=(0.0,), metric="question")
    _, reuse_kv, _ = blend_forward(twin, req, np.array([req.N - 1]))
    compare_fused(none.kv.numpy(), reuse_kv, "question r=0 vs full reuse")
    try:
        b.blend(req.segments, (1,), (r,), "question")
        fail("the question metric with a check layer was not refused")
    except ValueError as e:
        print(f"  (g) refused with a check layer: {e}")
    print(f"  (g) question r={r}: {sel.size} chunk tokens by A alone, the NumPy node's "
          f"selection; fused KV within {worst:.1e}, logits within {lg:.1e}")


def check_anchored(b, req, twin):
    """(h): the anchored metric against eval/rules.py's QCFuse-style score and selection."""
    r = 0.15
    if critical_layer(twin.cfg.n_layers) != CRITICAL_LAYER:
        fail(f"critical layer {critical_layer(twin.cfg.n_layers)}, eval's {CRITICAL_LAYER}")
    bl = b.blend(req.segments, ratios=(r,), metric="anchored")
    att, _ = question_pass(twin, req, req.placed, view=anchors(req), last_layer=CRITICAL_LAYER)
    ref = qcfuse_score(att, CRITICAL_LAYER)
    got = bl.attention.sum(axis=1)
    err = float(np.abs(got - ref).max() / np.abs(ref).max())
    if err > TOL_A:
        fail(f"anchored: A differs from eval/rules.py's qcfuse_score by {err:.2e}")
    k = select_count(r, int(req.cached.sum()))
    sel = top_tokens(ref, req, k)
    fresh = np.flatnonzero(~req.cached)
    if not np.array_equal(bl.selections[0], np.union1d(fresh, sel)):
        fail(f"anchored: {np.setxor1d(bl.selections[0], np.union1d(fresh, sel)).size} rows "
             "differ from eval's top tokens")
    logits, ref_kv, _ = blend_forward(twin, req, np.array([req.N - 1]), recompute=sel)
    worst = compare_fused(bl.kv.numpy(), ref_kv, f"anchored r={r}")
    classic = kh.Blender(b.model, b.client, landing=False)
    cl = classic.blend(req.segments, ratios=(r,), metric="anchored")
    if not torch.equal(cl.kv, bl.kv) or not np.array_equal(cl.selections[0], bl.selections[0]):
        fail("anchored: the classic session's blend differs from the landing one's")
    # the default: no metric and no check layers is the anchored metric at 0.15 (the
    # connector's default too); check layers and no metric stay the value metric
    dflt = b.blend(req.segments)
    if not torch.equal(dflt.kv, bl.kv) or not np.array_equal(dflt.selections[0],
                                                             bl.selections[0]):
        fail("blend(segments) is not the anchored metric at r = 0.15")
    val = b.blend(req.segments, (1,), (r,))
    if val.attention is not None or len(val.selections) != 1 or np.array_equal(
            val.selections[0], bl.selections[0]):
        fail("blend(segments, (1,), (0.15,)) is not the value metric at layer 1")
    print(f"  (h) anchored r={r}: A within {err:.1e} of eval's qcfuse_score (anchors every 32, "
          f"layer {CRITICAL_LAYER}); {sel.size} tokens, eval's selection; fused KV within "
          f"{worst:.1e}, the classic session's bit for bit; blend(segments) is this blend "
          "(the default), blend(segments, (1,), (0.15,)) the value metric's")
