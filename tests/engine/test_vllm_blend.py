"""CacheBlend inside a real vLLM 0.32 engine: KvblendConnector with blend configured.

Run with the engine venv's python (.ci/engine-env), KVBLEND_LIB set to the build's
libkvblend and KVBLEND_ENGINE_MODEL (or --model) to the model directory.

(a) the connector's blend settings are checked (no engine): malformed ones raise naming
    the key; an architecture the pass does not drive (Gemma) gives None (plain reuse);
(b) the reference: test_hf_blend's request through kvblend.hf against a real daemon
    (chunks stored by kvblend.hf under the connector's model name), value metric at
    layer 1, r = 0.15: fused KV and 16-token greedy continuation;
(c) one engine (client/python installed with pip so that its vllm.general_plugins entry
    point loads; the connector with ``blend`` set, ``model_name`` the reference's): the
    request's prompt with its chunk segments in kv_transfer_params. The scheduler claims
    the context up to the end of the last chunk; the worker blends it over vLLM's own
    modules and writes it into vLLM's paged cache: the rows read back from the cache (the
    connector's debug dump, decoded with the CPU "vec" layout) equal kvblend.hf's fused
    KV within TOL (not full reuse's: those differ by O(1) after the check layer), and the
    greedy continuation vLLM computes over them equals kvblend.hf's token for token;
    and the worker's RoPE self-test ran at start over all 30 layers against the daemon;
(d) in the same engine, the same prompt with its own settings ({"blend": {"ratios":
    [1.0]}} in its parameters): the cache rows equal kvblend.hf's r=1.0 blend (every token
    recomputed) and so does the continuation; and with {"blend": {"metric": "question"}}
    (A alone, no check layer) and "anchored" (QCFuse-style): the cache rows and
    continuation equal kvblend.hf's;
(e) prefix caching on (the engine runs with it): behind a system prompt of more than a
    block, a blend after the prefix-cache hit equals the blend with nothing cached, and
    the same prompt without kvblend is never handed blended blocks (prefix_caching);
(f) store on a miss with the text separator "<|endoftext|>": chunks missed by concurrent
    separator-split requests stored once, equal to store_documents', and the same
    documents in another order blended (store_on_miss);
(g) blends batched: three requests of (c) and (d) in one generate call; those of one step
    are blended in one pass over the layers, each equal to its own blend alone (batched,
    run after (d)).
Run by pytest (tests/engine/run.sh --pytest, as ctest does); skipped when KVBLEND_SKIP_ENGINE=1.
"""

import os
import shutil
import sys
import time
from pathlib import Path

import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from kvbtest import fail, read_cache  # noqa: E402

MAX_TOKENS = 16
NAME = "smollm2-blend-test"
CHECKS, RATIOS = (1,), (0.15,)
# vLLM's modules vs transformers' on the same float32 weights (test_vllm_model_hook:
# measured 3.3e-6 of a layer's largest |value|), written into and read back from the cache
# bit for bit.
TOL = 1e-4


def check_config():
    """(a)."""
    from kvblend.vllm import config, plan

    good = config.config_from_extra({"blend": {}}, "LlamaForCausalLM", 30)
    if good != plan.BlendConfig((), (0.15,), "anchored"):
        fail(f"defaults: {good}")
    # settings written for the value metric's check layers keep meaning what they meant
    # (check layers and no metric: value), whichever metric is the default
    for raw, want in (({"check_layers": [1], "ratios": [0.3]}, ((1,), (0.3,), "value")),
                      ({"check_layers": [2]}, ((2,), (0.15,), "value")),
                      ({"check_layers": [], "ratios": []}, ((), (), "value")),
                      ({"metric": "value"}, ((1,), (0.15,), "value")),
                      ({"ratios": [0.05]}, ((), (0.05,), "anchored"))):
        got = config.config_from_extra({"blend": raw}, "LlamaForCausalLM", 30)
        if got != plan.BlendConfig(*want):
            fail(f"{raw}: {got}, expected {want}")
        over = plan.blend_settings(raw, 30, good, "kvblend.blend")  # a request's own
        if over != plan.BlendConfig(*want):
            fail(f"a request's {raw} over the defaults: {over}, expected {want}")
    q = config.config_from_extra({"blend": {"metric": "question"}}, "LlamaForCausalLM", 30)
    if q != plan.BlendConfig((), (0.15,), "question"):
        fail(f"the question metric's defaults: {q}")
    if config.config_from_extra({}, "LlamaForCausalLM", 30) is not None:
        fail("no blend key should mean no blending")
    bad = [({"blend": []}, "blend must be a dict"),
           ({"blend": {"ratio": [0.1]}}, "unknown keys"),
           ({"blend": {"check_layers": [3, 1], "ratios": [0.3, 0.1]}}, "increasing"),
           ({"blend": {"check_layers": [30]}}, "in 0..29"),
           ({"blend": {"ratios": [1.5]}}, "in [0, 1]"),
           ({"blend": {"check_layers": [1, 2], "ratios": [0.1, 0.3]}}, "not increasing"),
           ({"blend": {"check_layers": [1, 2], "ratios": [0.1]}}, "one ratio per"),
           ({"blend": {"metric": "cosine"}}, "'value', 'key', 'attention', 'question'"),
           ({"blend": {"metric": "question", "check_layers": [1]}}, "must be empty"),
           ({"blend": {"metric": "question", "ratios": [0.3, 0.1]}}, "one ratio for the"),
           ({"blend": {"check_layers": [1.7]}}, "list of ints")]
    for extra, words in bad:
        try:
            config.config_from_extra(extra, "LlamaForCausalLM", 30)
            fail(f"{extra} accepted")
        except ValueError as e:
            if words not in str(e):
                fail(f"{extra}: message {e!r} lacks {words!r}")
    if config.config_from_extra({"blend": {}}, "GemmaForCausalLM", 30) is not None:
        fail("an architecture the pass does not drive should fall back to reuse")
    # A request's own settings: stripped for the reuse planner, merged over the connector's.
    segs = [[0, 4, "chunk"]]
    kvp = {"kvblend": {"segments": segs, "blend": {"ratios": [1.0]}}}
    if plan.split_override(kvp) != ({"kvblend": {"segments": segs}}, {"ratios": [1.0]}):
        fail(f"split_override: {plan.split_override(kvp)}")
    off = {"kvblend": {"segments": segs, "blend": False}}
    if plan.parse_request(off, list(range(8)), 0, 30, None, good).blend is not None:
        fail("'blend': false should plan full reuse")
    try:
        plan.parse_request({"kvblend": {"segments": segs, "blend": {"ratios": [2]}}},
                           list(range(8)), 0, 30, None, good)
        fail("a request's malformed blend settings were accepted")
    except ValueError as e:  # ParamError: the request is served as plain vLLM, logged
        if "kvblend.blend.ratios" not in str(e):
            fail(f"message {e!r}")
    print(f"  (a) blend settings: defaults (anchored, 0.15; check layers without a metric "
          f"mean value), {len(bad)} malformed ones refused by name, "
          "GemmaForCausalLM served as plain reuse; a request's own settings split off, "
          "'blend': false is full reuse, a malformed override is a parameter error")


def reference(model_dir, endpoint):
    """(b)."""
    import torch
    import transformers

    import kvblend
    import kvblend.hf as kh
    from kvbtest import build_segments, chunk_segments, store_chunks

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    segs = build_segments(tok)
    with kvblend.Client(endpoint, timeout_ms=120000) as c:
        b = kh.Blender(model, c, name=NAME)
        store_chunks(b, segs)
        ref = b.blend(segs, CHECKS, RATIOS)
        tokens = b.generate(segs, MAX_TOKENS, blend=ref)
        reuse = b.blend(segs, (), ())
        everything = b.blend(segs, CHECKS, (1.0,))
        tokens_all = b.generate(segs, MAX_TOKENS, blend=everything)
        question = {}  # the metrics with no check layer: the node's own selection
        for m in ("question", "anchored"):
            question[m] = b.blend(segs, ratios=RATIOS, metric=m)
            question[m].tokens = b.generate(segs, MAX_TOKENS, blend=question[m])
        b.close()
    chunks, n = chunk_segments(segs)
    print(f"  (b) kvblend.hf: {n} tokens, {ref.selections[0].size} rows recomputed after layer "
          f"{CHECKS[0]}; continuation {tok.decode(tokens)!r}")
    return ref, reuse, tokens, chunks, everything, tokens_all, question


def test_vllm_blend(engine_model):
    t0 = time.monotonic()
    from kvbtest import engine_env

    tmp = engine_env("kvblend-blend.")
    dump_dir = tmp / "dump"
    check_config()

    from harness import Daemon

    d = Daemon()
    try:
        ref, reuse, tokens, chunks, everything, tokens_all, question = reference(
            engine_model, d.endpoint)
        run_engine(engine_model, d.endpoint, ref, reuse, tokens, chunks, dump_dir,
                   everything, tokens_all, question)
    finally:
        d.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"test_vllm_blend: all passed in {time.monotonic() - t0:.0f} s")


def compare_cache(dump, want, plain, n, what):
    """The rows 0..n-1 read back from vLLM's cache against kvblend.hf's fused KV."""
    import numpy as np

    kv = read_cache(dump, n)
    want, plain = want.numpy()[:, :, :n], plain.numpy()[:, :, :n]
    worst = far = 0.0
    for layer in range(want.shape[0]):
        for p in range(2):
            scale = float(np.abs(want[layer, p]).max())
            err = float(np.abs(kv[layer, p] - want[layer, p]).max()) / scale
            worst = max(worst, err)
            far = max(far, float(np.abs(plain[layer, p] - want[layer, p]).max()) / scale)
            if err > TOL:
                fail(f"{what}: layer {layer} {'KV'[p]}: vLLM's cache differs from kvblend.hf's "
                     f"blend by {err:.2e} of its scale (tolerance {TOL:g})")
    print(f"  (c) {what}: vLLM's cache after the blend: {n} rows within {worst:.1e} of "
          f"kvblend.hf's fused KV (full reuse differs by up to {far:.2f})")


def run_engine(model_dir, endpoint, ref, reuse, tokens, chunks, dump_dir, everything,
               tokens_all, question):
    """(c), and (d): the same prompt with its own settings, ratios [1.0], and the question
    metric."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvbtest import connector_llm

    # load_cost_check off: every blend asked for is run (test_vllm_connector (k) tests it)
    extra = {"endpoint": endpoint, "model_name": NAME, "timeout_ms": 60000,
             "blend": {"check_layers": list(CHECKS), "ratios": list(RATIOS)},
             "chunk_separator_text": SEPARATOR, "load_cost_check": False}
    # prefix caching on (vLLM's default): (c) and (d) have no exact prefix of a full
    # block (the header is shorter than one), (e) has one
    llm = connector_llm(model_dir, extra, max_model_len=4096, enable_prefix_caching=True)
    rope_self_test(endpoint)
    ids = [int(i) for i in ref.ids]
    got = []
    for params in ({"segments": chunks}, {"segments": chunks, "blend": {"ratios": [1.0]}},
                   *({"segments": chunks, "blend": {"metric": m, "ratios": list(RATIOS)}}
                     for m in ("question", "anchored"))):
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                            extra_args={"kv_transfer_params": {"kvblend": params}})
        out = llm.generate([TokensPrompt(prompt_token_ids=ids)], [sp], use_tqdm=False)
        got.append(list(out[0].outputs[0].token_ids))
    dumps = sorted(dump_dir.glob("load-*.npz"))
    if len(dumps) != 4:
        fail(f"{len(dumps)} load dumps, expected the four blends")
    batched(llm, ids, chunks, dump_dir, ref, everything, got)
    prefix_caching(llm, ids, chunks)
    store_on_miss(llm, endpoint)
    del llm
    n = chunks[-1][0] + chunks[-1][1]  # the claim: up to the end of the last chunk
    compare_cache(np.load(dumps[0]), ref.kv, reuse.kv, n, "r=0.15")
    if got[0] != tokens:
        fail(f"vLLM's continuation {got[0]} != kvblend.hf's {tokens}")
    print(f"  (c) r=0.15: {len(got[0])} greedy tokens equal to kvblend.hf's continuation")
    compare_cache(np.load(dumps[1]), everything.kv, reuse.kv, n, "the request's r=1.0")
    if got[1] != tokens_all:
        fail(f"r=1.0: vLLM's continuation {got[1]} != kvblend.hf's {tokens_all}")
    print(f"  (d) the request's own ratios [1.0]: {len(got[1])} greedy tokens equal to "
          "kvblend.hf's at r=1.0")
    for i, m in ((2, "question"), (3, "anchored")):
        want = question[m]
        compare_cache(np.load(dumps[i]), want.kv, reuse.kv, n, f"the request's {m} metric")
        if got[i] != want.tokens:
            fail(f"{m} metric: vLLM's continuation {got[i]} != kvblend.hf's {want.tokens}")
        print(f"  (d) the request's {m} metric (no check layer, r=0.15): {len(got[i])} greedy "
              "tokens equal to kvblend.hf's")


def rope_self_test(endpoint):
    """The worker ran its RoPE self-test at start (kvblend.vllm.selftest) against the
    daemon, over every layer, and it passed (the engine started)."""
    import kvblend

    with kvblend.Client(endpoint, timeout_ms=10000) as c:
        probes = [(m.name, m.num_layers) for m in c.model_list()
                  if m.name.startswith("kvblend-selftest-")]
    if len(probes) != 1 or probes[0][1] != 30:
        fail(f"no RoPE self-test of the model's 30 layers in the daemon: {probes}")
    print(f"  the RoPE self-test ran at start over all 30 layers ({probes[0][0]})")


def batched(llm, ids, chunks, dump_dir, ref, everything, got):
    """(g) blends batched: (c)'s and (d)'s requests and a second r=0.15 one in one generate
    call; those scheduled in one step are blended in one pass over the layers (the dumps
    say how many: 2 or 3); each one's cache rows and continuation equal its blend alone."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    before = set(dump_dir.glob("load-*.npz"))
    settings = [{"segments": chunks}, {"segments": chunks, "blend": {"ratios": [1.0]}},
                {"segments": chunks}]
    sps = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                          extra_args={"kv_transfer_params": {"kvblend": p}}) for p in settings]
    outs = llm.generate([TokensPrompt(prompt_token_ids=ids)] * 3, sps, use_tqdm=False)
    toks = [list(o.outputs[0].token_ids) for o in outs]
    want = [got[0], got[1], got[0]]
    if toks != want:
        fail(f"batched blends: continuations {toks} != alone {want}")
    dumps = sorted(set(dump_dir.glob("load-*.npz")) - before,
                   key=lambda x: int(x.stem.split("-")[1]))
    if len(dumps) != 3:
        fail(f"batched blends: {len(dumps)} load dumps, expected 3")
    # vLLM schedules what has arrived when a step starts: the first request may have a
    # step of its own, the others arrive during its blend and share the next one
    batches = [int(np.load(x)["batch"]) for x in dumps]
    if max(batches) < 2 or any(batches.count(b) % b for b in batches):
        fail(f"batched blends: passes of {batches} requests, expected one pass of 2 or 3")
    n = chunks[-1][0] + chunks[-1][1]
    refs = {"r=0.15": ref.kv.numpy(), "r=1.0": everything.kv.numpy()}
    for x in dumps:  # each dump is one of the two blends (the order is vLLM's)
        kv = read_cache(np.load(x), n)
        errs = {k: max(float(np.abs(kv[la, p] - w[la, p, :n]).max())
                       / float(np.abs(w[la, p, :n]).max())
                       for la in range(kv.shape[0]) for p in range(2))
                for k, w in refs.items()}
        if min(errs.values()) > TOL:
            fail(f"batched blends: {x.name} matches no blend alone ({errs})")
    print(f"  (g) 3 requests (r=0.15, r=1.0, r=0.15) in one generate call, blended in passes of "
          f"{sorted(set(batches))} requests: each one's cache rows within {TOL:g} of its blend "
          "alone, continuations equal")


SYSTEM = ("<|im_start|>system\nYou are a careful assistant for a library of short documents "
          "about nature. Read every document before you answer. Answer in one or two plain "
          "sentences, name the document your answer comes from, and say so when no document "
          "answers the question. Do not invent facts, figures or names that the documents do "
          "not give, and do not repeat the question. Keep the tone friendly and the wording "
          "simple, as if for a curious twelve-year-old reader. When two documents disagree, "
          "say which one says what and do not pick a side. When a question asks for a number, "
          "give the number with its unit exactly as the document writes it. When a question "
          "is about a place, name the place and the document. Answer in English even when a "
          "document quotes another language, and quote at most one short phrase from any "
          "document.<|im_end|>\n<|im_start|>user\n")


def prefix_caching(llm, ids, chunks):
    """(e) prefix caching on: an exact system prompt is a prefix-cache hit, a blend after it
    equals the same blend with nothing cached (the value metric's, whose pass computes the
    hit rows, and the anchored metric's, whose pass reads them from vLLM's cache), and
    blended blocks are never handed out.

    The prompt: a system prompt of more than one block, then the stored chunks with the
    fresh text between them and the question. (1) blended with nothing cached (after
    ``reset_prefix_cache``): the reference; (2) again: vLLM's prefix cache holds the
    system prompt's full blocks (exact: computed after the same prefix), so the connector
    is asked from there on and blends the rest, writing only the rows after the hit; its
    greedy tokens and first logprobs must equal (1)'s; (3) the same prompt opted out of
    kvblend (``segments: []``, plain vLLM): its prefix-cache hit must stop at the system
    prompt, because the blocks after it hold blended KV (not what the prefix computes;
    the connector fences them out of the prefix cache), and its logprobs must equal the
    same prompt's with ``skip_reading_prefix_cache`` (a full prefill).
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(llm.llm_engine.model_config.tokenizer)
    sys_ids = tok.encode(SYSTEM)
    head = chunks[0][0]  # the old prompt's fresh header, replaced by the system prompt
    prompt = sys_ids + ids[head:]
    segs = [[s - head + len(sys_ids), n, k] for s, n, k in chunks]
    bs = llm.llm_engine.vllm_config.cache_config.block_size
    exact = len(sys_ids) // bs * bs
    if exact == 0:
        fail(f"(e) the system prompt ({len(sys_ids)} tokens) is shorter than a block ({bs})")

    def run(params, **kw):
        sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5,
                            extra_args={"kv_transfer_params": {"kvblend": params}}, **kw)
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], [sp], use_tqdm=False)[0]
        first = out.outputs[0].logprobs[0]
        # vLLM's own prefix-cache hits, as the connector's response parameters say them
        # (RequestOutput.num_cached_tokens counts the connector's tokens too)
        said = (out.kv_transfer_params or {}).get("kvblend") or {}
        if "prefix_cached" not in said:
            fail(f"(e) no kvblend provenance in the response: {out.kv_transfer_params}")
        return (list(out.outputs[0].token_ids), {t: lp.logprob for t, lp in first.items()},
                said["prefix_cached"])

    def gap(a, b):
        return max(abs(a[t] - b[t]) for t in a) if set(a) == set(b) else float("inf")

    # the engine's value metric (check layers: the pass computes the hit rows, which the
    # daemon's selection reads) and the anchored metric (no check layer: the pass reads
    # the hit rows from vLLM's cache and computes none of them)
    for name, blend in (("value", {}), ("anchored", {"blend": {"metric": "anchored",
                                                                "ratios": list(RATIOS)}})):
        llm.reset_prefix_cache()
        ref_tokens, ref_lp, cached = run({"segments": segs, **blend})
        if cached:
            fail(f"(e) {name}: {cached} prefix-cache hits after reset_prefix_cache")
        tokens, lp, cached = run({"segments": segs, **blend})
        if cached != exact:
            fail(f"(e) {name}: blend after the system prompt: {cached} prefix-cache hits, "
                 f"expected the system prompt's {exact} (full blocks)")
        if tokens != ref_tokens or gap(lp, ref_lp) > 1e-3:
            fail(f"(e) {name}: the blend after a prefix-cache hit differs from the one "
                 f"without: tokens {tokens} vs {ref_tokens}, first logprobs "
                 f"{gap(lp, ref_lp):.2e} apart")
        print(f"  (e) {name} metric: blend after {cached} prefix-cache hits (the system "
              f"prompt): greedy tokens equal to the blend with nothing cached, first "
              f"logprobs {gap(lp, ref_lp):.1e} apart")
    plain_tokens, plain_lp, cached = run({"segments": []})
    # (after it: a full prefill caches exact blocks the plain request would then hit)
    full_tokens, full_lp, _ = run({"segments": []}, skip_reading_prefix_cache=True)
    if cached > exact:
        fail(f"(e) a plain request got {cached} prefix-cache hits: past the system prompt "
             f"({exact}), blocks holding blended KV were handed out")
    if plain_tokens != full_tokens or gap(plain_lp, full_lp) > 1e-3:
        fail(f"(e) the plain request after blends differs from a full prefill: first "
             f"logprobs {gap(plain_lp, full_lp):.2e} apart")
    away = gap(lp, full_lp)
    away = "another top 5" if away == float("inf") else f"{away:.2f} away"
    print(f"  (e) the same prompt without kvblend: {cached} prefix-cache hits (the system "
          f"prompt only), output equal to a full prefill (first logprobs "
          f"{gap(plain_lp, full_lp):.1e} apart; the blend's: {away})")


SEPARATOR = "<|endoftext|>"  # SmolLM2's id 0: a separator its tokenizer keeps apart
MISSED = [
    "Glaciers form where more snow falls in winter than melts in summer. Year after year the "
    "snow is pressed into dense ice that flows slowly downhill under its own weight, carving "
    "valleys, carrying rocks and leaving lakes behind when it retreats.",
    "Coral reefs are built by tiny animals called polyps that take calcium from sea water to "
    "make hard skeletons. Reefs grow only a few centimetres a year, need clear warm water and "
    "sunlight, and shelter about a quarter of all fish species in the ocean.",
]


def store_on_miss(llm, endpoint):
    """(f) store on a miss: separator-split requests whose documents are not stored.

    Three concurrent requests "instruction SEP d1 SEP d2 SEP question" miss both chunks
    ("d SEP"); each chunk is prefilled alone on the worker's thread and stored once (two
    PUTs, not six); its KV equals what store_documents stores for the same ids; then the
    same documents in the other order are blended (the response says so).
    """
    import numpy as np
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    import kvblend
    from kvblend.vllm import store_documents

    tok = llm.get_tokenizer()
    enc = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    sep = enc(SEPARATOR)
    if sep != [0]:
        fail(f"(f) {SEPARATOR!r} is {sep}, expected [0]")
    instr = enc("<|im_start|>user\nAnswer from the documents.")
    docs = [enc(d) for d in MISSED]
    question = enc("Which document talks about ice?<|im_end|>\n<|im_start|>assistant\n")

    def prompt(order):
        return instr + sep + [t for i in order for t in docs[i] + sep] + question

    hashes = [kvblend.chunk_hash(d + sep) for d in docs]
    # 64 tokens each, past any end: the stores run on the worker's thread during these
    # requests' decode steps too (a41efd6: a store racing a step's logits gave NaN)
    sp = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    c = kvblend.Client(endpoint, timeout_ms=10000)
    puts0 = c.stats().get("requests_put", 0)
    outs = llm.generate([TokensPrompt(prompt_token_ids=prompt([0, 1]))] * 3, [sp] * 3,
                        use_tqdm=False)
    said = [(o.kv_transfer_params or {}).get("kvblend", {}) for o in outs]
    deadline = time.monotonic() + 120
    while not all(i.found for i in c.lookup(NAME, hashes)):
        if time.monotonic() > deadline:
            fail("(f) the missed chunks were not stored within 120 s")
        time.sleep(0.5)
    puts = c.stats().get("requests_put", 0) - puts0
    if puts != 2:
        fail(f"(f) 3 requests missing the same 2 chunks made {puts} PUTs, expected 2")
    print(f"  (f) 3 concurrent requests missed 2 chunks: stored once each ({puts} PUTs), "
          f"responses {said[0]}")
    # the stores ran on the worker's thread beside these requests' steps: their outputs
    # must be what the same prompt gives alone, with nothing stored meanwhile
    plain = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True, extra_args={
        "kv_transfer_params": {"kvblend": {"segments": []}}})
    alone = llm.generate([TokensPrompt(prompt_token_ids=prompt([0, 1]))], [plain],
                         use_tqdm=False)[0]
    got = [list(o.outputs[0].token_ids) for o in outs]
    if any(g != list(alone.outputs[0].token_ids) for g in got):
        fail(f"(f) requests whose misses were being stored: {got}, alone: "
             f"{list(alone.outputs[0].token_ids)}")
    missed_kv = [c.get(NAME, h) for h in hashes]
    for h in hashes:
        c.delete(NAME, h)
    store_documents(llm, [d + sep for d in docs])
    # a third opinion: transformers' prefill of the same ids (kvblend.hf)
    import torch
    import transformers

    import kvblend.hf as kh

    hf_model = transformers.AutoModelForCausalLM.from_pretrained(
        llm.llm_engine.model_config.model, dtype=torch.float32).eval()
    hf = kh.Blender(hf_model, c, name=NAME + "-hf")
    doc_kv = [c.get(NAME, h) for h in hashes]
    for i, d in enumerate(docs):
        want = hf.prefill_kv(d + sep)
        for what, got_kv in (("stored on a miss", missed_kv[i]), ("store_documents", doc_kv[i])):
            errs = [float(np.abs(got_kv[la, p] - want[la, p]).max()
                          / np.abs(want[la, p]).max())
                    for la in range(want.shape[0]) for p in range(2)]
            print(f"  (f) chunk {i} {what} against transformers' prefill: worst "
                  f"{max(errs):.1e} of a layer's scale (first layer off: "
                  f"{next((j // 2 for j, e in enumerate(errs) if e > TOL), None)})")
    worst, where = 0.0, None
    for i, h in enumerate(hashes):
        ref = c.get(NAME, h)
        for layer in range(ref.shape[0]):
            for p in range(2):
                scale = float(np.abs(ref[layer, p]).max())
                diff = np.abs(missed_kv[i][layer, p] - ref[layer, p]).max(axis=(1, 2))
                err = float(diff.max()) / scale
                if err > worst:
                    worst, where = err, (i, layer, "KV"[p], int(np.argmax(diff > TOL * scale)))
    if worst > TOL:
        fail(f"(f) a chunk stored on a miss differs from store_documents' by {worst:.2e} of "
             f"a layer's scale (tolerance {TOL:g}; chunk, layer, K/V, first token off: "
             f"{where})")
    print(f"  (f) the chunks stored on a miss equal store_documents' within {worst:.1e} of "
          "each layer's scale")
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt([1, 0]))], [sp],
                       use_tqdm=False)[0]
    said = (out.kv_transfer_params or {}).get("kvblend", {})
    n_ctx = len(instr) + len(sep) + sum(len(d) + len(sep) for d in docs)
    if said.get("blended", 0) + said.get("prefix_cached", 0) != n_ctx:
        fail(f"(f) the documents in the other order: not blended as a whole context: {said}")
    print(f"  (f) the same documents in the other order: blended ({said})")
    c.close()
