"""kvblend.hf: CacheBlend over the real Gemma-3-270M (float32) in transformers and kvblendd.

Run with the engine venv's python (tests/engine/run.sh --pytest, as ctest does);
KVBLEND_GEMMA_MODEL names the model directory (default /var/cache/kvblend/models/gemma-3-270m,
which .ci/engine-env builds with tests/engine/make_gemma_model.py; without it the test is
skipped). Gemma 3's layer differs from Llama's in the Q and K norms,
the sandwich norms, the scaled embedding and the attention scale, and in its local layers
(5 of every 6): a sliding window of 512 tokens and a RoPE base of their own (10,000; the
full layers' is 1,000,000). One long prompt of five stored chunks (about 700 tokens, past
the window) and three short ones (about 250 tokens each):

(a) the sliding window, unit-level: a local layer's output through kvblend.hf's attention
    (kvblend.blend.attention.causal_attention with the layer's window) for scattered rows
    of the long prompt, over the layer's whole KV, equals transformers' own decoder layer
    (its hidden states) within TOL_LAYER; and a window one token shorter or longer does not
    (a row at p reads keys p - 511 .. p: transformers' kv > q - window);
(b) r = 1.0 (every token recomputed from the check layer on) over the long prompt: the fused
    KV equals transformers' own full prefill's within TOL_FUSED, and the greedy continuation
    equals generate()'s token for token; the question metric at r = 1.0 (its preview runs
    over the sliding windows) likewise; and Blender.prefill_kv (what store() puts) of a
    chunk longer than the window keeps all its rows (transformers' own cache keeps only
    the last 511 of a local layer): the full prefill's first 600 rows within TOL_FUSED;
(c) the vLLM connector's config check takes Gemma 3 with the same windows (test_vllm_gemma
    blends it inside an engine);
(d) the daemon's two RoPE bases (kvblend.types.Model.rope_local_theta, full_every):
    kvblend.hf describes the model with them; a chunk re-rotated by the daemon to positions
    37.. and 600.. equals transformers' prefill of the chunk alone at those positions on
    every layer, local and full, within TOL_MOVED; full reuse (no check layer) lands each
    chunk as the daemon's own re-rotation of it (GET re-rotated) bit for bit; and on every prompt
    the first token's KL divergence from the full prefill at r = 0.15 (value metric, layer
    1) is below full reuse's;
(e) bfloat16 (the KV held as raw bits on the host): r = 1.0 over the long prompt gives
    transformers' bfloat16 full prefill's KV within one bfloat16 unit (2^-8) of a layer's
    scale, and the default blend (the anchored metric: its compressed preview over the
    windows) runs, with finite KV and a selection.
Skipped when KVBLEND_SKIP_ENGINE=1.
"""

import os
import time

import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

import numpy as np  # noqa: E402
import torch  # noqa: E402
import transformers  # noqa: E402
from transformers import DynamicCache  # noqa: E402

import kvblend  # noqa: E402
import kvblend.hf as kh  # noqa: E402
from kvblend.blend import arch as _arch  # noqa: E402
from kvblend.blend.attention import causal_attention  # noqa: E402
from cacheblend import kl_top1  # noqa: E402
from harness import Daemon  # noqa: E402
from kvbtest import DOCS, QUESTION, fail, worst_dev  # noqa: E402

MODEL = os.environ.get("KVBLEND_GEMMA_MODEL", "/var/cache/kvblend/models/gemma-3-270m")
MAX_TOKENS = 8
# (a) One decoder layer, kvblend.hf's attention for some rows vs transformers' whole layer:
# both float32, the same modules, the same scaled dot-product attention kernel family; the
# rows' softmax sums over another mask shape (a boolean [rows, N] mask against transformers'
# own), so the order of a reduction may differ: ~1e-7 of the scale per operation, over one
# layer. 1e-5 of the layer's largest |value| is 100x that, and a window off by one is
# further off (511 drops a key of the rows past the window, 513 adds one: ~1e-4 of the
# scale each; measured below, printed).
TOL_LAYER = 1e-5
# (b) Fused KV at r = 1.0 vs transformers' full prefill: every row is computed by the same
# float32 modules in the same order (measured bit for bit equal here); a reduction summed in
# another order (the boolean mask of the check layer's rows, another thread count) is ~1e-7
# relative per operation, ~1e-6 after 18 residual layers. 1e-5 of a layer's largest |value|
# is 10x that and far below a wrong window (without it, the KV of the rows past 512 differs
# by more than the scale itself) or a wrong RoPE base.
TOL_FUSED = 1e-5
# (d) A chunk re-rotated by the daemon (float64 angles, float32 arithmetic) vs transformers'
# prefill of it alone at the new positions (float32 angles p * inv_freq, and attention
# scores that depend on relative positions only up to that rounding): measured up to 2.2e-5
# of a layer's scale (V included: the hidden states move by that rounding). 1e-4 is 5x that;
# a local layer re-rotated with the full layers' base is off by 0.2 to 2 of the scale
# (measured with one base for all layers).
TOL_MOVED = 1e-4


@pytest.fixture(scope="module")
def gemma():
    if not os.path.isfile(os.path.join(MODEL, "config.json")):
        pytest.skip(f"no Gemma 3 model at {MODEL} (tests/engine/make_gemma_model.py writes it)")
    t0 = time.monotonic()
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(MODEL)
    print(f"{type(model).__name__} loaded in {time.monotonic() - t0:.1f} s")
    return model, tok


def prompt(tok, docs, question=QUESTION):
    """A prompt [("fresh"|"chunk", ids)]: <bos> and an instruction, the chunks, the question.

    Only the first segment gets <bos> (the tokenizer adds it to every encode otherwise)."""
    segs = [("fresh", tok.encode("Answer the question using the documents.\n\nDocument 1:\n"))]
    for i, d in enumerate(docs):
        segs.append(("chunk", tok.encode(d, add_special_tokens=False)))
        tail = (f"\n\nDocument {i + 2}:\n" if i + 1 < len(docs) else
                f"\n\nQuestion: {question}\nAnswer:")
        segs.append(("fresh", tok.encode(tail, add_special_tokens=False)))
    return segs


def prompts(tok):
    """The long prompt (five chunks of two documents each, past the window) and three short."""
    pairs = [DOCS[0] + " " + DOCS[1], DOCS[1] + " " + DOCS[2], DOCS[2] + " " + DOCS[0],
             DOCS[0] + " " + DOCS[2], DOCS[2] + " " + DOCS[1]]
    long = prompt(tok, pairs)
    short = [prompt(tok, DOCS), prompt(tok, DOCS[::-1]),
             prompt(tok, DOCS[1:] + DOCS[:1], "What guides ships at night, and how far?")]
    return long, short


def ids_of(segs):
    return np.concatenate([np.asarray(t, np.int64) for _, t in segs])


@torch.no_grad()
def full_prefill(model, ids):
    """transformers' own prefill of ids: KV [layers, 2, N, kv_heads, d], last logits, the
    hidden states (a cache without sliding layers, which would keep 511 rows of each)."""
    x = torch.as_tensor(ids)[None]
    out = model(x, past_key_values=DynamicCache(), use_cache=True, output_hidden_states=True)
    pkv = out.past_key_values
    kv = np.stack([np.stack([pkv.layers[i].keys[0].transpose(0, 1).numpy(),
                             pkv.layers[i].values[0].transpose(0, 1).numpy()])
                   for i in range(len(pkv.layers))])
    return kv, out.logits[0, -1].float().numpy(), out.hidden_states


def test_hf_gemma(gemma):
    model, tok = gemma
    t0 = time.monotonic()
    long, short = prompts(tok)
    ids = ids_of(long)
    if ids.size <= 600 or ids[0] != tok.bos_token_id:
        fail(f"the long prompt: {ids.size} tokens, first {ids[0]} (<bos> {tok.bos_token_id})")
    full_kv, _, hidden = full_prefill(model, ids)
    check_window(model, ids, hidden)
    check_vllm_config(model)
    d = Daemon()
    try:
        with kvblend.Client(d.endpoint, timeout_ms=120000) as c:
            b = kh.Blender(model, c)
            check_everything(model, b, long, ids, full_kv)
            check_reuse(model, b, c, [long] + short)
            b.close()
            check_bf16(c, long)
    finally:
        d.stop()
    print(f"test_hf_gemma: passed in {time.monotonic() - t0:.0f} s")


@torch.no_grad()
def check_window(model, ids, hidden):
    """(a): a local layer's rows through kvblend.hf's attention vs transformers' layer."""
    arch = kh._check_model(model)
    ops = kh._HfOps(model, model.config.head_dim, arch)
    layer = 0
    window = ops.window(layer)
    if window != model.config.sliding_window or ops.window(5) is not None:
        fail(f"windows: layer 0 {window}, layer 5 {ops.window(5)}")
    n = ids.size
    ops.begin(n)
    h = ops.embed(torch.as_tensor(ids))
    if not torch.equal(h, hidden[0][0]):
        fail("the scaled embedding differs from transformers' input to layer 0")
    _, k, v = ops.qkv(layer, h, torch.arange(n))
    rows = torch.as_tensor([0, 7, window - 2, window - 1, window, window + 1, n // 2 + 300,
                            n - 2, n - 1])
    q, _, _ = ops.qkv(layer, h[rows], rows)
    want = hidden[layer + 1][0, rows]
    got = ops.attend(layer, h[rows], q, k, v, rows)
    scale = float(want.abs().max())
    err = float((got - want).abs().max()) / scale
    if err > TOL_LAYER:
        fail(f"(a) layer {layer}: rows differ from transformers' layer by {err:.2e} of its scale")
    attn = model.model.layers[layer].self_attn
    moved = []
    for w in (window - 1, window + 1):
        a = causal_attention(q, k, v, rows, attn.scaling, w)
        off = float((ops.finish(layer, h[rows], a) - want).abs().max()) / scale
        moved.append(off)
        if off <= TOL_LAYER:  # the tolerance tells the two windows apart
            fail(f"(a) a window of {w} gives transformers' layer too ({off:.1e})")
    print(f"  (a) local layer {layer}, {rows.numel()} scattered rows of {n}: within {err:.1e} "
          f"of transformers' layer; a window of {window - 1} / {window + 1} is off by "
          f"{moved[0]:.1e} / {moved[1]:.1e}")


def check_vllm_config(model):
    """(c): the vLLM connector's config check (the one both of its processes make) takes
    Gemma 3 and reads the same windows (test_vllm_gemma blends it in an engine)."""
    arch = _arch.check_config("Gemma3ForCausalLM", model.config, "kvblend: blending refused")
    windows = _arch.sliding_windows(arch, model.config, "kvblend")
    full = [i for i, w in enumerate(windows) if w is None]
    if full != [5, 11, 17] or any(w != 512 for w in windows if w is not None):
        fail(f"(c) windows {windows}")
    print(f"  (c) vLLM's config check takes it: full layers {full}, windows of 512 elsewhere")


def check_everything(model, b, segs, ids, full_kv):
    """(b): r = 1.0 over the long prompt against transformers' full prefill and generate()."""
    t = time.monotonic()
    for t_ in (t for k, t in segs if k == "chunk"):
        b.store(t_)
    everything = b.blend(segs, (1,), (1.0,))
    if everything.selections[0].size != ids.size:
        fail(f"(b) r=1.0 selected {everything.selections[0].size} of {ids.size} rows")
    err = worst_dev(everything.kv.numpy(), full_kv)
    if err > TOL_FUSED:
        fail(f"(b) r=1.0: fused KV differs from the full prefill's by {err:.2e} of a scale")
    x = torch.as_tensor(ids)[None]
    with torch.no_grad():
        full = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=MAX_TOKENS,
                              do_sample=False, temperature=None, top_p=None, top_k=None)
    full = full[0, ids.size:].tolist()
    got = b.generate(segs, MAX_TOKENS, blend=everything)
    if got != full:
        fail(f"(b) r=1.0 continuation {got} != generate()'s {full}")
    q = b.blend(segs, ratios=(1.0,), metric="question")
    err_q = worst_dev(q.kv.numpy(), full_kv)
    if err_q > TOL_FUSED:
        fail(f"(b) question metric r=1.0: fused KV off by {err_q:.2e} of a scale")
    kv600 = b.prefill_kv(ids[:600])  # another length: GEMMs blocked otherwise (TOL_FUSED)
    if kv600.shape != full_kv[:, :, :600].shape:
        fail(f"(b) prefill_kv of 600 tokens: {kv600.shape}")
    err_p = worst_dev(kv600, full_kv[:, :, :600])
    if err_p > TOL_FUSED:
        fail(f"(b) prefill_kv of 600 tokens: off the full prefill's first rows by {err_p:.2e}")
    print(f"  (b) r=1.0 over {ids.size} tokens: fused KV within {err:.1e} of transformers' "
          f"full prefill (question metric: {err_q:.1e}); {len(got)} greedy tokens equal to "
          f"generate()'s; prefill_kv of 600 tokens keeps every row (within {err_p:.1e}) "
          f"({time.monotonic() - t:.1f} s)")


def check_reuse(model, b, c, all_segs):
    """(d): the daemon's re-rotation per layer; r = 0.15 beats full reuse's KL."""
    spec = b.spec
    local = float(model.config.rope_parameters["sliding_attention"]["rope_theta"])
    if (spec.rope_local_theta, spec.full_every) != (local, 6):
        fail(f"(d) Gemma 3 described with rope_local_theta {spec.rope_local_theta}, "
             f"full_every {spec.full_every} (its config: {local:g}, every 6th layer full)")
    check_moved(model, b, c, all_segs[0])
    rows = []
    for i, segs in enumerate(all_segs):
        ids = ids_of(segs)
        hashes = [b.store(t) for k, t in segs if k == "chunk"]
        reuse = b.blend(segs, (), ())
        got, pos, j = reuse.kv.numpy(), 0, 0
        for kind, t in segs:
            if kind == "chunk":
                want = c.get_rerotated(spec.name, hashes[j], pos=pos)
                if not np.array_equal(got[:, :, pos:pos + len(t)], want):
                    fail(f"(d) prompt {i}: full reuse's chunk {j} is not the daemon's "
                         "re-rotation of it")
                j += 1
            pos += len(t)
        _, ref, _ = full_prefill(model, ids)
        blend = b.blend(segs, (1,), (0.15,))
        kl_reuse = float(kl_top1(ref[None], reuse.logits.numpy()[None])[0][0])
        kl_blend = float(kl_top1(ref[None], blend.logits.numpy()[None])[0][0])
        rows.append((ids.size, kl_reuse, kl_blend))
        if not kl_blend < kl_reuse:
            fail(f"(d) prompt {i} ({ids.size} tokens): KL at r=0.15 {kl_blend:.4f} not below "
                 f"full reuse's {kl_reuse:.4f}")
    print(f"  (d) local base {spec.rope_local_theta:g}, full every {spec.full_every}: full reuse "
          "lands the daemon's re-rotation bit for bit; first-token KL vs full prefill (tokens: "
          "full reuse -> r=0.15): " + ", ".join(f"{n}: {a:.4f} -> {z:.4f}" for n, a, z in rows))


@torch.no_grad()
def prefill_at(model, t, pos):
    """transformers' prefill of ids t alone at positions pos..: [layers, 2, T, kv_heads, d]."""
    out = model(torch.as_tensor(t)[None], position_ids=torch.arange(pos, pos + len(t))[None],
                past_key_values=DynamicCache(), use_cache=True)
    pkv = out.past_key_values
    return np.ascontiguousarray(np.stack([
        torch.stack([pkv.layers[la].keys[0], pkv.layers[la].values[0]]).transpose(1, 2).numpy()
        for la in range(len(pkv.layers))]))


@torch.no_grad()
def check_moved(model, b, c, segs):
    """(d): the daemon's re-rotation of a chunk vs transformers' prefill of it elsewhere."""
    t = np.asarray(next(t for k, t in segs if k == "chunk"), np.int64)
    h = b.store(t)
    worst = [0.0, 0.0]  # local layers, full layers
    windows = kh._HfOps(model, model.config.head_dim, kh._check_model(model)).windows
    for pos in (37, 600):
        got = c.get_rerotated(b.spec.name, h, pos=pos)
        kv = prefill_at(model, t, pos)
        for la in range(kv.shape[0]):
            want = kv[la]
            for p in range(2):
                e = float(np.abs(got[la, p] - want[p]).max() / np.abs(want[p]).max())
                worst[windows[la] is None] = max(worst[windows[la] is None], e)
                if e > TOL_MOVED:
                    fail(f"(d) layer {la} ({'local' if windows[la] else 'full'}) {'KV'[p]}: the "
                         f"daemon's re-rotation to {pos} is off transformers' by {e:.2e}")
    print(f"  (d) a chunk of {t.size} tokens re-rotated to 37 and 600 by the daemon: within "
          f"{worst[0]:.1e} (local layers) and {worst[1]:.1e} (full) of transformers' prefill "
          "there")


def check_bf16(c, segs):
    """(e): the model in bfloat16: r = 1.0 against its own full prefill, the default blend."""
    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.bfloat16)
    model.eval()
    b = kh.Blender(model, c)
    for t in (t for k, t in segs if k == "chunk"):
        b.store(t)
    ids = ids_of(segs)
    everything = b.blend(segs, (1,), (1.0,))
    with torch.no_grad():
        pkv = model(torch.as_tensor(ids)[None], past_key_values=DynamicCache(),
                    use_cache=True).past_key_values
    full = torch.stack([torch.stack([pkv.layers[i].keys[0].transpose(0, 1),
                                     pkv.layers[i].values[0].transpose(0, 1)])
                        for i in range(len(pkv.layers))]).float()
    worst = worst_dev(everything.kv.float().numpy(), full.numpy())
    if everything.kv.dtype != torch.bfloat16 or worst > 2.0 ** -8:
        fail(f"(e) bf16: r=1.0 ({everything.kv.dtype}) off the full prefill by {worst:.2e}")
    default = b.blend(segs)
    if not bool(torch.isfinite(default.kv.float()).all()) or not default.selections[-1].size:
        fail("(e) bf16: the anchored default gave no selection or values that are not finite")
    print(f"  (e) bf16: r=1.0 within {worst:.1e} of the full prefill's scale; the anchored "
          f"default recomputes {default.selections[-1].size} of {ids.size} rows")
    b.close()
