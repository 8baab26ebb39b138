"""The connector's scheduler-side logic against a real kvblendd, without an engine.

Parsing of kv_transfer_params and the claim (kvblend.vllm.plan.plan_request, what
KvblendConnector.get_num_new_matched_tokens answers) for: all chunks found, a middle
chunk missing, a fresh span in the middle, nothing found, the whole prompt covered (one
token left to vLLM), a resumed request (num_computed > 0), bad parameters, and a chunk
stored with another length; and chunk boundaries by a configured separator token sequence
(the prefix through the first separator is fresh, each chunk ends with its closing
separator, the rest is fresh; explicit parameters win; bad
configurations refused; blended when blending is configured); a separator given as text
(kvblend.vllm.separator's boundary check with SmolLM2's tokenizer, and the connector's
configuration reading it through vLLM's tokenizer); chunk keys scoped by LoRA adapter (its
weights' digest) and cache salt (kvblend.scoped_chunk_hash, the planner's lookups, the
scheduler's stores), and the chunks a storing request's response names; and the worker's
region for vLLM's KV cache (kvblend.vllm.landing.CacheRegion): the one
allocation taken, and refusals that name the daemon's setting (shm_max) or the endpoint;
and the blend pass's regions kept between blends (kvblend.vllm.regions.RegionPool) against
the daemon's count of segments.

Run by pytest (tests/engine/run.sh --pytest, as ctest does); skipped when KVBLEND_SKIP_ENGINE=1.
"""

import os
import time

import numpy as np
import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

import kvblend  # noqa: E402
from harness import Daemon  # noqa: E402
from kvblend.vllm import layout, plan  # noqa: E402

MODEL = kvblend.Model("plan-test", 2, 1, 8, dtype="f32", rope_theta=1e5)
failures = []


def answer(*args):
    """plan.plan_request's claim as (tokens, chunk loads)."""
    p = plan.plan_request(*args)
    return p.tokens, p.loads


def check(what, got, want):
    ok = got == want
    print(f"{'ok  ' if ok else 'FAIL'} {what}: {got}" + ("" if ok else f" (want {want})"))
    if not ok:
        failures.append(what)


def test_plan():
    d = Daemon()
    try:
        run(d)
    finally:
        d.stop()
    d = Daemon("--shm-max", "1M")
    try:
        region(d)
    finally:
        d.stop()
    d = Daemon("--shm-max", "17M", "--shm-total", "24M")
    try:
        region_pool(d)
    finally:
        d.stop()
    print("test_plan: " + ("FAILED " + ", ".join(failures) if failures else "passed"))
    assert not failures, "failed: " + "; ".join(failures)


def run(d):
    rng = np.random.default_rng(0)
    prompt = [int(x) for x in rng.integers(0, 50000, 100)]
    a, b, c = prompt[0:30], prompt[30:50], prompt[50:90]   # q = prompt[90:100]
    with kvblend.Client(d.endpoint) as cl:
        cl.model_register(MODEL)
        for ids in (a, c):
            cl.put(MODEL.name, kvblend.chunk_hash(ids),
                   rng.standard_normal(MODEL.kv_shape(len(ids))).astype(np.float32))
        # a chunk stored under b's hash with the wrong length is not b
        cl.put(MODEL.name, kvblend.chunk_hash(prompt[90:95]),
               np.zeros(MODEL.kv_shape(3), np.float32))

        def claim(segs, nc=0, ids=prompt, store=False):
            n, loads = answer(cl, MODEL.name, MODEL.num_layers,
                              {"kvblend": {"segments": segs, "store": store}}, ids, nc)
            return n, [(ld.start, ld.first, ld.last) for ld in loads]

        A, B, C = [0, 30, "chunk"], [30, 20, "chunk"], [50, 40, "chunk"]
        Q = [90, 10, "fresh"]
        check("a, b missing, c: a only", claim([A, B, C, Q]), (30, [(0, 0, 30)]))
        check("a, fresh, c: a only", claim([A, [30, 20, "fresh"], C, Q]), (30, [(0, 0, 30)]))
        check("nothing found", claim([B, Q]), (0, []))
        check("first segment fresh", claim([[0, 30, "fresh"], C]), (0, []))
        check("a then a gap: a only", claim([A, C]), (30, [(0, 0, 30)]))
        cl.put(MODEL.name, kvblend.chunk_hash(b),
               rng.standard_normal(MODEL.kv_shape(len(b))).astype(np.float32))
        check("all found, fresh question", claim([A, B, C, Q]),
              (90, [(0, 0, 30), (30, 30, 50), (50, 50, 90)]))
        check("all found, no segment for the question", claim([A, B, C]),
              (90, [(0, 0, 30), (30, 30, 50), (50, 50, 90)]))
        check("whole prompt covered: one token left", claim([A, B, C], ids=prompt[:90]),
              (89, [(0, 0, 30), (30, 30, 50), (50, 50, 89)]))
        check("one-chunk prompt (store shape) found", claim([[0, 30, "chunk"]], ids=a),
              (29, [(0, 0, 29)]))
        check("resumed at 40: rest of b and c", claim([A, B, C, Q], nc=40),
              (50, [(30, 40, 50), (50, 50, 90)]))
        check("resumed past the chunks", claim([A, B, C, Q], nc=95), (0, []))
        check("stored with another length", claim([[90, 5, "chunk"]]), (0, []))
        check("no kvblend key", answer(cl, MODEL.name, 2, {"x": 1}, prompt, 0), (0, []))

        def question(kvb):
            r = plan.plan_request(cl, MODEL.name, MODEL.num_layers, {"kvblend": kvb}, prompt,
                                  0, blend=plan.DEFAULT_CONFIG)
            return r.tokens, None if r.blend is None else r.blend.question

        check("blend: the question is the prompt after the context",
              question({"segments": [A, B, C]}), (90, prompt[90:]))
        check("blend: question_end stops the question there",
              question({"segments": [A, B, C], "question_end": 94}), (90, prompt[90:94]))
        check("blend: question_end inside the context: the whole tail",
              question({"segments": [A, B, C], "question_end": 60}), (90, prompt[90:]))
        check("no params", answer(cl, MODEL.name, 2, None, prompt, 0), (0, []))
        check("unknown model: daemon error",
              _raises(lambda: plan.plan_request(cl, "nope", 2, {"kvblend": {"segments": [A]}},
                                                prompt, 0)), "UnknownModel")
        separator(cl, rng, a, b, c, prompt[90:])
        one_lookup(cl, prompt)
        scoped(cl, rng, prompt)
    separator_text()
    separator_config()
    scheduler_store_scope()
    scheduler_budget(d)

    bad = [
        ("kvblend not a dict", {"kvblend": [1]}),
        ("segments not a list", {"kvblend": {"segments": "x"}}),
        ("segment of 2", {"kvblend": {"segments": [[0, 3]]}}),
        ("start a string", {"kvblend": {"segments": [["0", 3, "chunk"]]}}),
        ("length a bool", {"kvblend": {"segments": [[0, True, "chunk"]]}}),
        ("length 0", {"kvblend": {"segments": [[0, 0, "chunk"]]}}),
        ("negative start", {"kvblend": {"segments": [[-1, 3, "chunk"]]}}),
        ("past the prompt", {"kvblend": {"segments": [[90, 11, "chunk"]]}}),
        ("overlap", {"kvblend": {"segments": [[0, 10, "chunk"], [5, 10, "chunk"]]}}),
        ("out of order", {"kvblend": {"segments": [[50, 10, "chunk"], [0, 10, "chunk"]]}}),
        ("bad kind", {"kvblend": {"segments": [[0, 10, "chunks"]]}}),
        ("store not a bool", {"kvblend": {"segments": [], "store": 1}}),
        ("unknown key", {"kvblend": {"segment": []}}),
        ("question_end 0", {"kvblend": {"segments": [], "question_end": 0}}),
        ("question_end past the prompt", {"kvblend": {"segments": [], "question_end": 101}}),
        ("question_end a float", {"kvblend": {"segments": [], "question_end": 50.0}}),
        ("params not a dict", [1, 2]),
    ]
    for what, p in bad:
        check(f"bad params: {what}", _raises(lambda p=p: plan.parse_params(p, 100)), "ParamError")
    p = plan.parse_params({"kvblend": {"segments": [[0, 100, "chunk"]], "store": True}}, 100)
    check("store shape ok", plan.store_shape_error(p, 100), None)
    p = plan.parse_params({"kvblend": {"segments": [[0, 50, "chunk"]], "store": True}}, 100)
    check("store shape refused", plan.store_shape_error(p, 100) is not None, True)
    check("full blocks of 100..300 (bs 64)", list(layout.full_blocks(100, 300, 64)), [2, 3])
    check("full blocks of 0..128 (bs 128)", list(layout.full_blocks(0, 128, 128)), [0])
    check("full blocks of 0..127 (bs 128)", list(layout.full_blocks(0, 127, 128)), [])


class Counting:
    """A client that counts its lookups (the planner asks the daemon once per request)."""

    def __init__(self, cl):
        self.cl, self.lookups = cl, 0

    def lookup(self, *args):
        self.lookups += 1
        return self.cl.lookup(*args)


def one_lookup(cl, prompt):
    """With blending configured: one lookup per request, a declined blend planned from it."""
    A, B, C = [0, 30, "chunk"], [30, 20, "chunk"], [50, 40, "chunk"]
    h = [kvblend.chunk_hash(prompt[s:e]) for s, e in ((0, 30), (30, 50), (50, 90))]
    for what, segs, ids, want in (
            ("a blend of the context", [A, B, C, [90, 10, "fresh"]], prompt,
             (90, [], list(zip(h, (0, 30, 50))))),
            ("declined (the last chunk ends the prompt): reuse", [A, B, C], prompt[:90],
             (89, [(0, 0, 30), (30, 30, 50), (50, 50, 89)], None)),
            ("declined (nothing found): reuse", [[0, 30, "fresh"], [30, 60, "chunk"]], prompt,
             (0, [], None))):
        counting = Counting(cl)
        p = plan.plan_request(counting, MODEL.name, MODEL.num_layers,
                              {"kvblend": {"segments": segs}}, ids, 0, None, plan.DEFAULT_CONFIG)
        got = (p.tokens, [(ld.start, ld.first, ld.last) for ld in p.loads],
               p.blend.segments if p.blend else None)
        check(f"blend configured, {what}", got, want)
        check(f"blend configured, {what}: lookups", counting.lookups, 1)
    p = plan.parse_request({"kvblend": {"segments": [[0, 30, "chunk"]], "store": True}},
                           prompt[:30], 0, MODEL.num_layers, None, plan.DEFAULT_CONFIG)
    check("blend configured, a store request is not blended", p.blend, None)
    check("a store request's chunk hashed once, by the planner", p.hashes, (h[0],))


def separator(cl, rng, a, b, c, q):
    """Chunk boundaries by a separator (LMCache's convention): the text through the first
    separator is a prefix (fresh), each piece between two separators with its closing
    one is a chunk (stored as document + separator), the rest is fresh."""
    sep = [50001, 50002]  # outside the random prompt's ids (< 50000)
    pre = [11, 12, 13] + sep  # an instruction and the first separator
    sa, sb = a + sep, b + sep
    for ids in (sa, sb):
        cl.put(MODEL.name, kvblend.chunk_hash(ids),
               rng.standard_normal(MODEL.kv_shape(len(ids))).astype(np.float32))

    def sclaim(ids, nc=0, params=None):
        n, loads = answer(cl, MODEL.name, MODEL.num_layers, params, ids, nc, sep)
        return n, [(ld.start, ld.first, ld.last) for ld in loads]

    npre, na, nb = len(pre), len(sa), len(sb)
    # plain reuse loads only what follows tokens vLLM has: the prefix is fresh
    check("separator: the prefix is fresh: nothing claimed", sclaim(pre + sa + sb + q), (0, []))
    check("separator: the prefix computed (a prefix-cache hit): both chunks",
          sclaim(pre + sa + sb + q, nc=npre),
          (na + nb, [(npre, npre, npre + na), (npre + na, npre + na, npre + na + nb)]))
    check("separator: none in the prompt", sclaim(a + b + q), (0, []))
    check("separator: one in the prompt: no chunk", sclaim(pre + q, nc=npre), (0, []))
    check("separator: explicit parameters win",
          sclaim(sa + sb + q, params={"kvblend": {"segments": [[0, na, "chunk"]]}}),
          (na, [(0, 0, na)]))
    check("separator: without one configured", answer(
        cl, MODEL.name, MODEL.num_layers, None, pre + sa + sb + q, 0), (0, []))

    def sblend(ids, nc=0, params=None):
        p = plan.plan_request(cl, MODEL.name, MODEL.num_layers, params, ids, nc, sep,
                              plan.DEFAULT_CONFIG)
        return (p.tokens, [(ld.start, ld.first, ld.last) for ld in p.loads],
                p.blend.segments if p.blend else None)

    ha, hb = kvblend.chunk_hash(sa), kvblend.chunk_hash(sb)
    nc_ = len(c) + len(sep)
    check("separator, blend configured: a blend of both chunks after the prefix",
          sblend(pre + sa + sb + q),
          (npre + na + nb, [], [(npre, 0), (ha, npre), (hb, npre + na)]))
    check("separator, blend configured: another order, the same chunks",
          sblend(pre + sb + sa + q),
          (npre + na + nb, [], [(npre, 0), (hb, npre), (ha, npre + nb)]))
    check("separator, blend configured: a chunk not stored is fresh in the blend",
          sblend(pre + sa + c + sep + sb + q),
          (npre + na + nc_ + nb, [], [(npre, 0), (ha, npre), (nc_, npre + na),
                                      (hb, npre + na + nc_)]))
    check("separator, blend configured: last chunk ends the prompt: no blend",
          sblend(pre + sa + sb), (0, [], None))
    # tokens vLLM has (a prefix-cache hit, a resumed request): the pass blends the whole
    # context and writes from there on
    check("separator, blend configured: after computed tokens: a blend from there",
          sblend(pre + sa + sb + q, nc=npre + 3),
          (na + nb - 3, [], [(npre, 0), (ha, npre), (hb, npre + na)]))
    check("separator, blend configured: segments [] opts out",
          sblend(pre + sa + sb + q, params={"kvblend": {"segments": []}}), (0, [], None))
    check("separator, blend configured: explicit parameters win",
          sblend(sa + sb + q, params={"kvblend": {"segments": [[0, na, "chunk"]]}}),
          (na, [], [(ha, 0)]))
    check("separator, blend configured: explicit blend false: reuse",
          sblend(sa + sb + q, params={"kvblend": {"segments": [[0, na, "chunk"]],
                                                  "blend": False}}),
          (na, [(0, 0, na)], None))
    parsed = plan.parse_request(None, pre + sa + sb + q, 0, MODEL.num_layers, sep,
                                plan.DEFAULT_CONFIG)
    check("separator, blend configured: the connector's settings", parsed.blend,
          plan.DEFAULT_CONFIG)
    parsed = plan.parse_request(None, pre + sa + sb + q, 0, MODEL.num_layers, sep, None)
    check("separator, blend not configured: not blended", parsed.blend, None)

    def segs(ids, sp):
        p = plan.separator_params(ids, sp)
        return None if p is None else [(x.start, x.length, x.kind) for x in p.segments]

    check("split: leading and doubled separators", segs([9, 9, 1, 9, 9, 9, 9, 2], [9, 9]),
          [(0, 2, "fresh"), (2, 3, "chunk"), (5, 2, "chunk"), (7, 1, "fresh")])
    check("split: not overlapping", segs([5, 5, 5, 1], [5, 5]), [(0, 2, "fresh"), (2, 2, "fresh")])
    check("split: the separator alone", segs([3], [3]), [(0, 1, "fresh")])
    check("split: prefix, two documents, question",
          segs([1, 0, 2, 2, 0, 3, 0, 4], [0]),
          [(0, 2, "fresh"), (2, 3, "chunk"), (5, 2, "chunk"), (7, 1, "fresh")])
    check("split: a partial separator at the end", segs([1, 2, 3, 4], [4, 5]), None)
    check("split: too many separators",
          _raises(lambda: plan.separator_params([7] * 5000, [7])), "ParamError")
    check("config: a list of ids", plan.parse_separator([0, 4294967295]), (0, 4294967295))
    check("config: none", plan.parse_separator(None), None)
    for what, raw in (("empty", []), ("a string", "\n\n"), ("negative", [-1]),
                      ("a bool", [True]), ("too large", [2**32]), ("too long", [1] * 65),
                      ("a float", [1.0])):
        check(f"config refused: {what}", _raises(lambda r=raw: plan.parse_separator(r)),
              "ParamError")


def scoped(cl, rng, prompt):
    """Chunk keys scoped by LoRA adapter and cache salt (kvblend.scoped_chunk_hash)."""
    import hashlib
    import shutil
    import tempfile
    from types import SimpleNamespace as Ns

    ids = prompt[:30]
    # two adapters under the same name and id, other weights: keyed by their content
    # (client/python/tests/test_vllm_scope.py holds the digest's rules)
    tmp = tempfile.mkdtemp(prefix="kvb-lora-")
    for name in ("v1", "v2"):
        os.mkdir(f"{tmp}/{name}")
        with open(f"{tmp}/{name}/adapter_config.json", "w") as f:
            f.write('{"r": 8}')
        with open(f"{tmp}/{name}/adapter_model.safetensors", "wb") as f:
            f.write(name.encode() * 64)
    lora = Ns(lora_name="sql", lora_int_id=1, lora_path=f"{tmp}/v1")
    s_none = plan.request_scope(Ns(lora_request=None, cache_salt=None))
    s_salt = plan.request_scope(Ns(lora_request=None, cache_salt="tenant-a"))
    s_salt2 = plan.request_scope(Ns(lora_request=None, cache_salt="tenant-b"))
    s_lora = plan.request_scope(Ns(lora_request=lora, cache_salt=None))
    s_lora2 = plan.request_scope(Ns(lora_request=Ns(lora_name="sql", lora_int_id=1,
                                                    lora_path=f"{tmp}/v2"), cache_salt=None))
    s_both = plan.request_scope(Ns(lora_request=lora, cache_salt="tenant-a"))
    digest = plan.adapter_digest(lora)
    shutil.rmtree(tmp)
    check("scope: none", s_none, b"")
    check("scope: an empty salt is none", plan.request_scope(Ns(cache_salt="")), b"")
    check("scope: salt", s_salt, b'{"salt":"tenant-a"}')
    check("scope: adapter and salt", s_both,
          b'{"lora":"' + digest.encode() + b'","salt":"tenant-a"}')
    check("scoped hash: no scope is chunk_hash", kvblend.scoped_chunk_hash(ids, s_none),
          kvblend.chunk_hash(ids))
    hashes = [kvblend.scoped_chunk_hash(ids, s)
              for s in (s_none, s_salt, s_salt2, s_lora, s_lora2, s_both)]
    check("scoped hash: one per salt and adapter", len(set(hashes)), 6)
    want = hashlib.blake2b(len(s_salt).to_bytes(4, "little") + s_salt
                           + np.asarray(ids, "<u4").tobytes(), digest_size=32,
                           person=b"kvblend scope v1").digest()
    check("scoped hash: the documented formula", kvblend.scoped_chunk_hash(ids, s_salt), want)
    check("scoped hash: a str scope refused",
          _raises(lambda: kvblend.scoped_chunk_hash(ids, "x")), "BadArgument")

    # prompt[:30] is stored under tenant-a's key only (a model of its own)
    params = {"kvblend": {"segments": [[0, 30, "chunk"]]}}
    long = prompt[:30] + [7] * 20

    def sclaim(scope, sep=None, p=params, ids=long, nc=0):
        r = plan.plan_request(cl, "plan-test-scoped", MODEL.num_layers, p, ids, nc, sep, None,
                              scope)
        return r.tokens, [(ld.hash, ld.start, ld.last) for ld in r.loads]

    cl.model_register(kvblend.Model("plan-test-scoped", 2, 1, 8, dtype="f32", rope_theta=1e5))
    cl.put("plan-test-scoped", kvblend.scoped_chunk_hash(ids, s_salt),
           rng.standard_normal(MODEL.kv_shape(len(ids))).astype(np.float32))
    check("scoped lookup: the same salt finds it", sclaim(s_salt),
          (30, [(kvblend.scoped_chunk_hash(ids, s_salt), 0, 30)]))
    check("scoped lookup: no scope does not", sclaim(b""), (0, []))
    check("scoped lookup: another salt does not", sclaim(s_salt2), (0, []))
    check("scoped lookup: an adapter does not", sclaim(s_both), (0, []))
    sep = [50001, 50002]
    sd = ids + sep
    cl.put("plan-test-scoped", kvblend.scoped_chunk_hash(sd, s_lora),
           rng.standard_normal(MODEL.kv_shape(len(sd))).astype(np.float32))
    check("scoped lookup: separator chunks under the adapter",
          sclaim(s_lora, sep, None, sep + sd + [7] * 5, 2),
          (32, [(kvblend.scoped_chunk_hash(sd, s_lora), 2, 34)]))
    check("scoped lookup: separator chunks, another adapter's weights (same name and id)",
          sclaim(s_lora2, sep, None, sep + sd + [7] * 5, 2), (0, []))
    p = plan.parse_request({"kvblend": {"segments": [[0, 30, "chunk"]], "store": True}},
                           ids, 0, MODEL.num_layers, None, None, s_both)
    check("scoped store: the store's key is scoped", p.hashes,
          (kvblend.scoped_chunk_hash(ids, s_both),))
    p = plan.parse_request({"kvblend": {"segments": [[0, 30, "chunk"]]}}, long, 0,
                           MODEL.num_layers, None, plan.DEFAULT_CONFIG, s_salt)
    r = plan.lookup_plan(cl, "plan-test-scoped", MODEL.num_layers, p, 0)
    check("scoped blend: its segments carry the scoped key", r.blend.segments if r.blend else None,
          [(kvblend.scoped_chunk_hash(ids, s_salt), 0)])


def separator_text():
    """chunk_separator_text: the boundary check with SmolLM2's tokenizer (transformers)."""
    from kvblend.vllm import separator as sp
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(os.environ["KVBLEND_ENGINE_MODEL"])

    def encode(text):
        return tok.encode(text, add_special_tokens=False)

    special = set(tok.all_special_ids)
    vocab = ["" if i in special else tok.decode([i]) for i in range(len(tok))]
    pairs = sp.contexts(vocab)
    check("separator text: contexts are deterministic", pairs == sp.contexts(vocab), True)
    check("separator text: contexts, fixed and sampled", len(pairs),
          2 * len(sp.EDGES) + sp.SAMPLES)
    check("separator text: another seed, other contexts", pairs != sp.contexts(vocab, seed=1),
          True)
    # What each candidate does with this tokenizer (docs/vllm.md quotes these lines).
    passing = []
    for c in sp.CANDIDATES + ("\n\n###\n\n", "<|im_end|>", "<file_sep>"):
        why = sp.boundary_error(c, encode, pairs)
        print(f"     {c!r}: {encode(c)}: {'passes' if why is None else why}")
        if why is None:
            passing.append(c)
    check("separator text: SmolLM2's passing strings", passing,
          ["<|endoftext|>", "<|im_end|>", "<file_sep>"])
    check("separator text: <|endoftext|> is its id",
          sp.check_separator("<|endoftext|>", encode, vocab), tuple(encode("<|endoftext|>")))
    for text, where in ((" # # ", "between '' and 'word'"),
                        ("\n\n###\n\n", "between '' and 'word'")):
        try:
            sp.check_separator(text, encode, vocab)
            msg = None
        except sp.SeparatorError as e:
            msg = str(e)
        check(f"separator text: {text!r} refused", msg is not None, True)
        msg = msg or ""
        check(f"separator text: {text!r}: one line naming the context and an alternative",
              ("\n" not in msg, where in msg, "'<|endoftext|>' passes for this tokenizer" in msg),
              (True, True, True))
    # a tokenizer that merges everything: no candidate passes, the ids are the way out
    try:
        sp.check_separator("##", lambda t: [len(t)] if t else [], vocab[:1000])
        msg = ""
    except sp.SeparatorError as e:
        msg = str(e)
    check("separator text: nothing passes: says give chunk_separator",
          "give chunk_separator (token ids) instead" in msg, True)
    # one id per character: every separator is a stable boundary
    check("separator text: a character tokenizer",
          sp.check_separator(" # # ", lambda t: [ord(ch) for ch in t], vocab[:1000]),
          (32, 35, 32, 35, 32))
    for bad in ("", None, 5):
        check(f"separator text: {bad!r} refused",
              _raises(lambda b=bad: sp.check_separator(b, encode, vocab)), "SeparatorError")


def separator_config():
    """The connector's configuration reads chunk_separator_text through vLLM's tokenizer."""
    from types import SimpleNamespace as Ns

    from kvblend.vllm import config

    mc = Ns(tokenizer=os.environ["KVBLEND_ENGINE_MODEL"], runner_type="generate",
            tokenizer_mode="auto", tokenizer_revision=None, trust_remote_code=False,
            skip_tokenizer_init=False, hf_config=None)  # what cached_tokenizer_from_config reads
    vc = Ns(model_config=mc)

    def ids(extra):
        try:
            return config.separator_from_extra(extra, vc)
        except config.Refused as e:
            return str(e)

    check("separator config: text", ids({"chunk_separator_text": "<|endoftext|>"}), (0,))
    check("separator config: ids", ids({"chunk_separator": [5, 6]}), (5, 6))
    check("separator config: none", ids({}), None)
    check("separator config: both refused",
          ids({"chunk_separator_text": "<|endoftext|>", "chunk_separator": [0]}),
          "kvblend: kv_connector_extra_config: give chunk_separator (token ids) or "
          "chunk_separator_text, not both")
    got = ids({"chunk_separator_text": " # # "})
    check("separator config: ' # # ' refused, naming an alternative",
          got.startswith("kvblend: kv_connector_extra_config: chunk_separator_text ' # # ' is "
                         "not a stable token boundary: between") and got.endswith(
                             "'<|endoftext|>' passes for this tokenizer"), True)
    check("separator config: no tokenizer refused",
          _raises(lambda: config.separator_from_extra(
              {"chunk_separator_text": "x"}, Ns(model_config=Ns(skip_tokenizer_init=True)))),
          "Refused")


def scheduler_store_scope():
    """A store vLLM did not ask about first is keyed in the request's scope too."""
    from types import SimpleNamespace as Ns

    from kvblend.vllm.scheduler import SchedulerSide

    ids = list(range(100, 140))
    side = SchedulerSide(Ns(block_size=16, load_cost_margin=1.0, load_cost_check=True,
                            model_name="plan-test", store_on_miss=True), None)
    req = Ns(request_id="r1", prompt_token_ids=ids, lora_request=None, cache_salt="tenant-a",
             kv_transfer_params={"kvblend": {"segments": [[0, 40, "chunk"]], "store": True}})
    side.update_state_after_alloc(req, Ns(get_block_ids=lambda: ([3, 4, 5],)), 0)
    pending = side._stores.get("r1")
    check("scheduler: an unplanned store's key is scoped", pending and pending.hash,
          kvblend.scoped_chunk_hash(ids, b'{"salt":"tenant-a"}'))
    # what the finished requests said, summed for vLLM's connector stats
    from kvblend.vllm.stats import KvblendStats

    side._said["r1"] = {"prompt_tokens": 40, "prefix_cached": 0, "reused": 30, "blended": 0,
                        "computed": 10, "stored": 40, "load_declined": 0}
    side._said["r2"] = {"prompt_tokens": 50, "prefix_cached": 16, "reused": 0, "blended": 0,
                        "computed": 34, "stored": 0, "load_declined": 20}
    r1 = side.request_finished(req, [])[1]
    check("scheduler: the response names the chunk it stores (kvblend.stores)",
          r1["kvblend"].get("stores"),
          {"model": "plan-test", "chunks": [pending.hash.hex() if pending else None]})
    side.request_finished(Ns(request_id="r2"), [])
    # a separator-split request that missed two chunks queues both and names them; a
    # second one missing the same chunks queues nothing more (stored 0) but names them too:
    # they are what its client waits for
    sep = [50001]
    prompt = [1, 2] + sep + [3, 4, 5] + sep + [6, 7] + sep + [8]
    parsed = plan.parse_request(None, prompt, 0, MODEL.num_layers, sep, None)
    missing = [(h, s.start, s.length) for h, s in
               zip(parsed.hashes, plan.chunk_segments(parsed.params))]
    said = []
    for rid in ("r3", "r4"):
        side._said[rid] = {"prompt_tokens": len(prompt), "prefix_cached": 0, "reused": 0,
                           "blended": 0, "computed": len(prompt), "stored": 0,
                           "load_declined": 0}
        side._plans[rid] = plan.Plan(parsed=parsed, missing=missing)
        side.update_state_after_alloc(Ns(request_id=rid, prompt_token_ids=prompt),
                                      Ns(get_block_ids=lambda: ([1],)), 0)
        said.append(side.request_finished(Ns(request_id=rid), [])[1]["kvblend"])
    want = {"model": "plan-test", "chunks": [h.hex() for h in parsed.hashes]}
    check("scheduler: missed chunks queued and named",
          (said[0]["stored"], said[0].get("stores"), len(parsed.hashes)), (7, want, 2))
    check("scheduler: the same chunks missed again: none queued, still named",
          (said[1]["stored"], said[1].get("stores")), (0, want))
    side.take_stats()
    side._said["r1"] = {"prompt_tokens": 40, "prefix_cached": 0, "reused": 30, "blended": 0,
                        "computed": 10, "stored": 40, "load_declined": 0}
    side._said["r2"] = {"prompt_tokens": 50, "prefix_cached": 16, "reused": 0, "blended": 0,
                        "computed": 34, "stored": 0, "load_declined": 20}
    side.request_finished(req, [])
    side.request_finished(Ns(request_id="r2"), [])
    side.update_connector_output(Ns(kv_connector_worker_meta=None))
    st = KvblendStats(data=side.take_stats())
    other = KvblendStats(data={"requests": 1, "recomputed_after_failure": 7})
    got = st.aggregate(other).reduce()
    check("scheduler: connector stats sum the finished requests",
          (got["requests"], got["prompt_tokens"], got["prefix_cached"], got["reused"],
           got["computed"], got["load_declined"], got["stored"],
           got["recomputed_after_failure"]), (3, 90, 16, 30, 44, 20, 40, 7))
    check("scheduler: stats taken are reset", side.take_stats(), None)


def scheduler_budget(d):
    """A blend asked for by a latency budget (budget_ms): vLLM's scheduler side picks the
    ratio from its cost model's fit (the largest whose predicted pass fits, never past
    the prefill it replaces, at least min_ratio) and the response says it (blend_ratio);
    before the fit is determined, the settings' ratio."""
    import logging
    from types import SimpleNamespace as Ns

    from kvblend.vllm import cost
    from kvblend.vllm.config import ConnectorConfig
    from kvblend.vllm.daemon import DaemonLink
    from kvblend.vllm.scheduler import SchedulerSide

    prompt = list(range(3000, 3400))
    doc = prompt[40:340]  # 40 fresh tokens, a 300-token chunk, then the question
    with kvblend.Client(d.endpoint) as cl:
        cl.model_register(MODEL)
        cl.put(MODEL.name, kvblend.chunk_hash(doc), np.zeros(MODEL.kv_shape(len(doc)),
                                                            np.float32))
    blend = plan.blend_settings({"budget_ms": 200, "min_ratio": 0.05}, MODEL.num_layers,
                                plan.DEFAULT_CONFIG, "blend")
    cfg = ConnectorConfig(d.endpoint, 5000, MODEL.name, None, MODEL, 16, blend,
                          load_cost_check=False)
    side = SchedulerSide(cfg, DaemonLink(d.endpoint, 5000, None, logging.getLogger("b")))

    def ratio(rid, override=None):
        kvp = {"kvblend": {"segments": [[40, 300, "chunk"]]}}
        if override is not None:
            kvp["kvblend"]["blend"] = override
        req = Ns(request_id=rid, prompt_token_ids=prompt, kv_transfer_params=kvp,
                 lora_request=None, cache_salt=None, block_hashes=[])
        claimed = side.get_num_new_matched_tokens(req, 0)[0]
        said = side.request_finished(req, [])[1]["kvblend"]
        return claimed, round(said.get("blend_ratio", -1.0), 6)

    check("budget: before a cost fit, the settings' ratio", ratio("b0"), (340, 0.15))
    # blends that cost 0.1 ms a context token and 1 ms a computed row; prefill 1 ms a token
    side.cost.note([(cost.BLEND, n, 1e-4 * n + 1e-3 * c, c, n)
                    for n, c in ((300, 50), (300, 200), (600, 100), (600, 400))])
    side.cost.note([(cost.PREFILL, 512, 0.512)] * cost.MIN_SAMPLES)
    # 200 ms: 34 ms of context, 40 fresh rows, then (200 - 34 - 40) / 300 of the chunk
    check("budget: the largest ratio whose predicted pass fits in 200 ms", ratio("b1"),
          (340, round((0.2 - 0.034 - 0.040) / 1e-3 / 300, 6)))
    check("budget: a request's own budget below the floor gets the floor (0.05)",
          ratio("b2", {"budget_ms": 50}), (340, 0.05))
    # 5 s is above the 340-token prefill (0.34 s): the prefill bounds it
    check("budget: never more than the prefill it replaces", ratio("b3", {"budget_ms": 5000}),
          (340, round((0.34 - 0.034 - 0.040) / 1e-3 / 300, 6)))
    check("budget: a fixed ratio is said too", ratio("b4", {"metric": "value"}), (340, 0.15))


def region_pool(d):
    """kvblend.vllm.regions.RegionPool: the blend pass's regions kept between blends, against
    the daemon's own count of segments (shm_max 17M, shm_total 24M)."""
    from kvblend.vllm import regions

    mib = 1 << 20
    with kvblend.Client(d.endpoint) as cl:
        def segments():
            return int(cl.stats()["shm_segments"])

        pool = regions.regions_of(cl)
        check("pool: one per client", regions.regions_of(cl) is pool, True)
        r1 = pool.take(5 * mib + 1)
        check("pool: a new region, rounded up", (r1.nbytes, segments()), (8 * mib, 1))
        r1[:] = 7
        pool.give(r1)
        check("pool: given back, kept (the daemon still holds it)",
              (pool.kept(), segments()), (1, 1))
        r2 = pool.take(3 * mib)
        check("pool: the next blend that fits gets it, pages and all",
              (r2.ctypes.data == r1.ctypes.data, int(r2[123]), pool.kept(), segments()),
              (True, 7, 0, 1))
        r3 = pool.take(2 * mib)  # r2 is taken: a second region
        pool.give(r2)
        pool.give(r3)
        check("pool: the smallest kept one that fits",
              pool.take(mib).ctypes.data == r3.ctypes.data, True)
        pool.give(r3)
        # shm_total 24M holds r2 (8M) and r3 (4M): 16M more is refused until they go
        r4 = pool.take(16 * mib)
        check("pool: a size the daemon refuses frees the kept ones first",
              (r4.nbytes, pool.kept(), segments()), (16 * mib, 0, 1))
        pool.give(r4)
        check("pool: clear frees them at the daemon", (pool.clear(), pool.kept(),
                                                      segments()), (None, 0, 0))
        kept = [pool.take(mib) for _ in range(regions.POOL_REGIONS + 1)]
        for r in kept:
            pool.give(r)
        check("pool: at most POOL_REGIONS kept, the rest freed",
              (pool.kept(), segments()), (regions.POOL_REGIONS, regions.POOL_REGIONS))
        old_idle = regions.POOL_IDLE_S
        regions.POOL_IDLE_S = 0.0
        try:
            time.sleep(0.01)
            r5 = pool.take(mib)  # expires every kept one first, then a new one
            check("pool: kept past POOL_IDLE_S, freed", (pool.kept(), segments()), (0, 1))
            # an engine left idle: the timer frees them, with no blend to look
            regions.POOL_IDLE_S = 0.2
            pool.give(r5)
            check("pool: given back before the timer", (pool.kept(), segments()), (1, 1))
            time.sleep(1.6)
            check("pool: an idle engine's kept regions freed by the timer",
                  (pool.kept(), segments()), (0, 0))
        finally:
            regions.POOL_IDLE_S = old_idle
        # rounded up past shm_max (17M) where the size itself fits: the exact size
        r6 = pool.take(16 * mib + 1)
        check("pool: the exact size when the rounded one passes shm_max",
              (r6.nbytes, segments()), (16 * mib + 1, 1))


def region(d):
    """The allocation context vLLM's KV cache goes through (torch, no engine)."""
    import logging

    import torch
    from kvblend.vllm.landing import CacheRegion

    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    log = logging.getLogger("test_plan.region")
    log.addHandler(Keep())
    size = 512 << 10
    r = CacheRegion(d.endpoint, 2000, size, log)
    ctx = r.context()
    check("region: a context", ctx is not None, True)
    with ctx:
        other = torch.zeros(size + 8, dtype=torch.int8)
        cache = torch.zeros(size, dtype=torch.int8, device="cpu")
        again = torch.zeros(size, dtype=torch.int8)
    check("region: the cache is the region", cache.data_ptr() == r.buf.ctypes.data, True)
    check("region: other allocations are not", other.data_ptr() != r.buf.ctypes.data
          and again.data_ptr() != r.buf.ctypes.data, True)
    cache[7] = 5
    check("region: writes reach the region", int(r.buf[7]), 5)
    check("region: taken once", r.taken, True)
    # a load the daemon cannot land (a chunk after a prefix-cached head, or loaded from
    # past its first token) is copied: start() says None and open() False, no session
    from kvblend.vllm.layout import blocks_of
    from kvblend.vllm.plan import ChunkLoad, landable

    r.active, r.block_size = True, 16
    after = ChunkLoad(b"a" * 32, 16, 10, 16, 26)
    tail = ChunkLoad(b"b" * 32, 0, 20, 4, 20)
    check("region: loads not landable from position 0 are copied (start None, open False)",
          [(r.start("m", "r", [x], [1, 2]), r.open("m", "r", [x], [1, 2]))
           for x in (after, tail)], [(None, False), (None, False)])
    check("region: no session opened for them", r.sessions, {})
    r.active = False
    check("landable: whole chunks back to back from 0",
          [landable([ChunkLoad(b"a" * 32, 0, 10, 0, 10), ChunkLoad(b"b" * 32, 10, 5, 10, 15)]),
           landable([after]), landable([tail]), landable([])], [15, None, None, None])
    check("blocks_of: positions past the block table have no block",
          blocks_of([5, 6], [(0, 100), (40, 40)], 16), {5, 6})
    big = CacheRegion(d.endpoint, 2000, 2 << 20, log)
    check("region: too large for shm_max: no context", big.context(), None)
    check("region: the log line names shm_max", "shm_max" in lines[-1], True)
    tcp = CacheRegion("tcp://127.0.0.1:1", 2000, size, log)
    check("region: tcp: no context", tcp.context(), None)
    check("region: the log line names the endpoint", "not ipc://" in lines[-1], True)
    unused = CacheRegion(d.endpoint, 2000, size, log)
    with unused.context():
        torch.zeros(size, dtype=torch.float32)
    unused.attach([], None, 128)
    check("region: not taken: landing off", (unused.active, unused.buf), (False, None))
    check("region: the log line says why", "did not allocate" in lines[-1], True)


def _raises(fn):
    try:
        fn()
    except Exception as e:  # the class name is what is checked
        return type(e).__name__
    return None
