"""Two serving nodes sharing chunks through a static kvblendd cluster (ctest test_vllm_cluster).

Run with the engine venv's python (.ci/engine-env; tests/engine/run.sh sets KVBLEND_LIB,
KVBLENDD and KVBLEND_ENGINE_MODEL). ``--place-tool`` names the daemons' placement code as
a program (tests/integration/place_tool.c; default: beside $KVBLENDD).

Two kvblendd, node-a and node-b, on one static member list (eval/harness.py's
``cluster``: each its own data directory, an IPC socket for its engine and a loopback TCP
port for the other), with ``cluster_replicas`` 1: every chunk has one owner, so the chunks
node-b owns reach it pushed after node-a's PUT, and those node-a owns are fetched from
node-a when node-b's engine asks (with two members and the default R = 2 both own
everything and nothing is ever fetched). The four documents below are placed two on each
(checked with place_tool, so a change of documents that leaves one path unused fails).
Engines run one at a time, each a vLLM LLM with the KvblendConnector on its own daemon,
the separator ``<|endoftext|>`` and ``blend`` (value metric, layer 1, r = 0.15),
prefix caching on and reset before each request whose output is compared:

(a) engine A on node-a: plain vLLM's outputs of every prompt (opted out, prefix cache
    skipped); a separator-split request "instruction SEP d1 SEP d2 SEP question" misses
    both document chunks: computed by vLLM, the chunks stored on the miss; two more
    documents stored with store_documents; every stored value finite; then that prompt
    and the same documents in the other order blended (the whole context before the
    question), and each stored document at position 0 followed by a question reused as
    stored ("blend": false): exact, so its greedy tokens equal plain vLLM's;
(b) engine A shut down, node-a's pushes done: node-b holds exactly the chunks
    placement gives it, node-a all four, node-b's engine has PUT nothing (but its RoPE
    self-test's chunk, kvblend.vllm.selftest);
(c) engine B on node-b, the same requests, in the same order: every chunk found through
    the cluster (nothing stored, nothing missed): each blend's greedy tokens and first
    top-5 logprobs equal engine A's blend (which differs from plain vLLM's by more than
    the tolerance: a node that computed the prompt itself would fail), each exact
    reuse's equal A's and plain vLLM's;
(d) node-b's counters: the chunks node-a owns fetched from node-a once each
    (``cluster_remote_hits``, ``cluster_fetched_bytes``), no fetch failed and no miss
    went unserved, no PUT but the RoPE self-test's; node-b now holds all four, equal to
    node-a's bit for bit.
Run by pytest (tests/engine/run.sh --pytest, as ctest does); skipped when KVBLEND_SKIP_ENGINE=1.
"""

import argparse
import gc
import math
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

NODES = ("node-a", "node-b")
MAX_TOKENS = 16
SEPARATOR = "<|endoftext|>"  # SmolLM2's id 0: a separator its tokenizer keeps apart
# Engine B computes over the same stored bytes as engine A (node-b's copies are checked bit
# for bit) with the same kernels and batch shapes: measured 0 apart. A blend's first top 5
# is not plain vLLM's (here other tokens), so this tolerance tells them apart.
TOL = 1e-4
INSTRUCTION = "<|im_start|>user\nAnswer the traveller's question from these notes."
DOCS = [  # chunks "d SEP" of the separator-split requests (stored on a miss)
    ("The night train to the coast leaves platform 4 at 22:40 every day except Sunday. "
     "Sleeper cabins hold two beds, and breakfast is served in the dining car from 6:30 "
     "until the train arrives at 8:15."),
    ("Bicycles travel free on regional trains outside the morning rush from 7 to 9. On the "
     "night train a bicycle needs a reserved space, which costs 10 euros and can be booked "
     "up to an hour before departure."),
]
QUESTION = "When is breakfast served on the night train?<|im_end|>\n<|im_start|>assistant\n"
EXACT = [  # chunks at position 0 (stored with store_documents), each with its question
    (("Lost property found on trains is kept at the central station's service desk for "
      "thirty days. Items can be collected with an identity card from 8 to 18 on weekdays; "
      "after thirty days they are given to charity."),
     "\nQuestion: How long is lost property kept?\nAnswer:"),
    (("Season tickets are valid for twelve months from the first day of travel. A lost "
      "season ticket is replaced once a year for a fee of 15 euros at any ticket office."),
     "\nQuestion: What does a new season ticket cost?\nAnswer:"),
]


def fail(msg):
    print(f"FAIL: {msg}")
    sys.exit(1)


def owners(place_tool, hashes):
    """{hash: owner} by the daemons' placement code, R = 1 over NODES (weights 1)."""
    r = subprocess.run([place_tool, "1", *NODES], input="".join(h.hex() + "\n" for h in hashes),
                       capture_output=True, text=True, check=True)
    return {bytes.fromhex(ln.split()[0]): ln.split()[1] for ln in r.stdout.splitlines()}


class Prompts:
    """The test's prompts as token ids, and their chunks' hashes."""

    def __init__(self, tok):
        import kvblend

        def enc(text):
            return tok.encode(text, add_special_tokens=False)

        sep = enc(SEPARATOR)
        if sep != [0]:
            fail(f"{SEPARATOR!r} is {sep}, expected [0]")
        instr, docs, q = enc(INSTRUCTION), [enc(d) + sep for d in DOCS], enc(QUESTION)
        # "instruction SEP d1 SEP d2 SEP question", and the documents the other way round
        self.split = [instr + sep + docs[0] + docs[1] + q, instr + sep + docs[1] + docs[0] + q]
        self.prefix = len(instr) + len(sep)  # fresh: computed, or a prefix-cache hit
        self.context = self.prefix + len(docs[0]) + len(docs[1])
        self.exact_docs = [enc(d) for d, _ in EXACT]
        self.exact = [enc(d) + enc(question) for d, question in EXACT]
        self.hashes = [kvblend.chunk_hash(d) for d in docs + self.exact_docs]

    def requests(self):
        """(what, prompt ids, kvblend parameters) of every request compared between nodes:
        the separator-split prompts (no parameters: the separator splits them), then the
        exact ones (the document a chunk at position 0, reused as stored)."""
        out = [(f"separator prompt {i + 1}", p, None) for i, p in enumerate(self.split)]
        for i, (d, p) in enumerate(zip(self.exact_docs, self.exact, strict=True)):
            out.append((f"document {i + 1} at position 0", p,
                        {"segments": [[0, len(d), "chunk"]], "blend": False}))
        return out


def start_engine(model_dir, endpoint):
    from kvbtest import connector_llm

    # load_cost_check off: a fetch from the other member is slow, and must be loaded here
    extra = {"endpoint": endpoint, "timeout_ms": 60000, "chunk_separator_text": SEPARATOR,
             "blend": {"metric": "value"}, "load_cost_check": False}
    t0 = time.monotonic()
    llm = connector_llm(model_dir, extra, max_model_len=1024, enable_prefix_caching=True)
    return llm, time.monotonic() - t0


def stop_engine(llm):
    """Shut the engine down (its EngineCore process ends, its daemon connections close)."""
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def generate(llm, ids, kvblend_params, fresh=True, **kw):
    """Greedy tokens, first top-5 logprobs and the connector's counts of one request.

    ``kvblend_params`` None sends none (the separator decides); ``fresh`` empties vLLM's
    prefix cache first, so that both engines compute each compared request from the same
    state.
    """
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if fresh:
        llm.reset_prefix_cache()
    extra = {} if kvblend_params is None else {
        "kv_transfer_params": {"kvblend": kvblend_params}}
    sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, logprobs=5, extra_args=extra,
                        **kw)
    out = llm.generate([TokensPrompt(prompt_token_ids=ids)], [sp], use_tqdm=False)[0]
    said = (out.kv_transfer_params or {}).get("kvblend")
    if not isinstance(said, dict):
        fail(f"no kvblend counts in the response: {out.kv_transfer_params}")
    first = out.outputs[0].logprobs[0]
    return list(out.outputs[0].token_ids), {t: lp.logprob for t, lp in first.items()}, said


def gap(a, b):
    """Largest difference of two top-5 logprob dicts: inf when their tokens differ or a
    logprob is not finite (a NaN would pass any comparison)."""
    if set(a) != set(b) or not all(math.isfinite(v) for v in (*a.values(), *b.values())):
        return float("inf")
    return max(abs(a[t] - b[t]) for t in a)


def run_a(llm, p, client):
    """(a): plain vLLM's outputs, the stores, and engine A's outputs of every request.

    Returns plain vLLM's and engine A's (tokens, first logprobs, counts) per request of
    ``p.requests()``, and the four chunks as node-a holds them.
    """
    import numpy as np
    from kvblend.vllm import store_documents

    reqs = p.requests()
    plain = [generate(llm, ids, {"segments": []}, skip_reading_prefix_cache=True)
             for _, ids, _ in reqs]
    for (what, _, _), (_, _, said) in zip(reqs, plain, strict=True):
        if said["reused"] or said["blended"] or said["stored"]:
            fail(f"(a) {what} opted out was not plain vLLM: {said}")
    # The first separator prompt misses both chunks: vLLM computes it, the worker's thread
    # stores them. (Its output is not compared: the thread's prefill runs beside the
    # engine's decoding steps, test_vllm_blend (f)'s concern, not the cluster's.)
    _, _, said = generate(llm, p.split[0], None)
    if (said["stored"] != p.context - p.prefix or said["computed"] != said["prompt_tokens"]
            or said["reused"] or said["blended"]):
        fail(f"(a) separator prompt 1: expected it computed and its {len(DOCS)} chunks "
             f"({p.context - p.prefix} tokens) stored on the miss: {said}")
    store_documents(llm, p.exact_docs)
    deadline = time.monotonic() + 120
    while not all(c.found for c in client.lookup(p.name, p.hashes)):
        if time.monotonic() > deadline:
            fail("(a) the documents were not all stored in node-a within 120 s")
        time.sleep(0.5)
    stored = [client.get(p.name, h) for h in p.hashes]
    bad = [i for i, kv in enumerate(stored) if not np.isfinite(kv).all()]
    if bad:  # what the other node would load: a NaN row spreads to every blended token
        fail(f"(a) chunks {bad} (of {len(stored)}) stored with values that are not finite")
    print(f"  (a) engine A: separator prompt 1 computed ({said}), its {len(DOCS)} chunks "
          f"stored on the miss; {len(EXACT)} documents stored with store_documents")
    got = []
    for (what, ids, params), ref in zip(reqs, plain, strict=True):
        tokens, lp, said = generate(llm, ids, params)
        if said["stored"]:
            fail(f"(a) {what} stored again: {said}")
        if not all(math.isfinite(v) for v in lp.values()):
            fail(f"(a) {what}: first logprobs not finite: {lp}")
        if params is None:
            if said["blended"] + said["prefix_cached"] != p.context:
                fail(f"(a) {what}: not blended as a whole context ({p.context} tokens): {said}")
            apart = gap(lp, ref[1])
            if apart <= 10 * TOL:
                fail(f"(a) {what}: the blend's first logprobs lie {apart:.1e} from plain "
                     f"vLLM's: too close for (c) to tell a blend from a prefill")
            apart = "another top 5" if apart == float("inf") else f"{apart:.2e} apart"
            print(f"  (a) {what} blended: {said}; first logprobs against plain vLLM's: {apart}")
        else:
            n = params["segments"][0][1]
            if said["reused"] != n:
                fail(f"(a) {what}: {said['reused']} tokens reused, expected its {n}: {said}")
            if tokens != ref[0]:
                fail(f"(a) {what} reused exactly: {tokens}, plain vLLM {ref[0]}")
            print(f"  (a) {what} reused exactly: {said}; greedy tokens equal plain vLLM's")
        got.append((tokens, lp, said))
    return plain, got, stored


def check_placement(p, own, a, b):
    """(b): after engine A, node-a holds every chunk, node-b the ones it owns (pushed)."""
    import kvblend

    deadline = time.monotonic() + 60
    while a.stats().get("cluster_pushes_owed", 0):
        if time.monotonic() > deadline:
            fail(f"(b) node-a still owes pushes after 60 s: {a.stats()}")
        time.sleep(0.2)

    def held(d):
        with kvblend.Client(d.endpoint, timeout_ms=10000) as c:
            try:
                return {i.hash for i in c.list(p.name)}  # LIST: this daemon's own store
            except kvblend.NotFound:  # the model is not known there (nothing pushed)
                return set()

    on_b = {h for h in p.hashes if own[h] == "node-b"}
    if held(a) != set(p.hashes):
        fail(f"(b) node-a holds {len(held(a))} chunks, expected all {len(p.hashes)}")
    if held(b) != on_b:
        fail(f"(b) node-b holds {len(held(b))} chunks before its engine ran, expected the "
             f"{len(on_b)} it owns")
    sb = b.stats()
    if sb.get("requests_put", 0) or sb.get("cluster_remote_hits", 0):
        fail(f"(b) node-b took a PUT or fetched before its engine ran: {sb}")
    print(f"  (b) node-a pushed {int(a.stats()['cluster_pushes_done'])} chunks: node-b "
          f"holds the {len(on_b)} it owns, node-a all {len(p.hashes)}")
    return on_b


def run_b(llm, p, plain, got_a):
    """(c): engine B's outputs of the same requests, against engine A's and plain vLLM's."""
    for (what, ids, params), ref, (tokens_a, lp_a, said_a) in zip(p.requests(), plain, got_a,
                                                                   strict=True):
        tokens, lp, said = generate(llm, ids, params)
        if said["stored"]:
            fail(f"(c) {what}: node-b missed chunks and stored them: {said}")
        if said != said_a:
            fail(f"(c) {what}: engine B's counts {said}, engine A's {said_a}")
        if tokens != tokens_a or gap(lp, lp_a) > TOL:
            fail(f"(c) {what}: engine B's greedy tokens {tokens} (first logprobs "
                 f"{gap(lp, lp_a):.1e} from A's), engine A's {tokens_a}")
        mode = "blended" if params is None else "reused exactly"
        also = "" if params is None else " and plain vLLM's"
        if params is not None and tokens != ref[0]:
            fail(f"(c) {what}: engine B's greedy tokens {tokens}, plain vLLM's {ref[0]}")
        print(f"  (c) {what} {mode} on node-b ({said}): greedy tokens equal engine A's{also}, "
              f"first logprobs {gap(lp, lp_a):.1e} from A's")


def check_fetches(p, b, on_b, stored):
    """(d): what node-b did not own came from node-a, each chunk once; node-b's copies
    are node-a's chunks bit for bit."""
    import kvblend
    import numpy as np

    st = b.stats()
    on_a = len(p.hashes) - len(on_b)
    if st.get("cluster_remote_hits") != on_a or st.get("cluster_fetched_bytes", 0) <= 0:
        fail(f"(d) node-b fetched {st.get('cluster_remote_hits')} chunks "
             f"({st.get('cluster_fetched_bytes')} bytes), expected the {on_a} node-a owns")
    if st.get("cluster_fetch_failures") or st.get("cluster_remote_misses"):
        fail(f"(d) node-b: fetch failures or unserved misses: {st}")
    if st.get("requests_put", 0) != 1:  # the worker's RoPE self-test stores one chunk
        fail(f"(d) node-b took {st['requests_put']} PUTs, expected only the RoPE self-test's: "
             "its engine stored chunks")
    with kvblend.Client(b.endpoint, timeout_ms=10000) as c:
        held = {i.hash for i in c.list(p.name)}
        if held != set(p.hashes):
            fail(f"(d) node-b holds {len(held)} chunks after its engine ran, expected all")
        differ = [i for i, (h, kv) in enumerate(zip(p.hashes, stored, strict=True))
                  if not np.array_equal(c.get(p.name, h), kv)]
    if differ:
        fail(f"(d) node-b's copies of chunks {differ} differ from node-a's")
    print(f"  (d) node-b fetched the {on_a} chunks node-a owns from node-a "
          f"({int(st['cluster_fetched_bytes'])} bytes in {int(st['cluster_fetch_ms'])} ms), "
          "no failure, no PUT; it holds all four now, equal to node-a's bit for bit")


def test_vllm_cluster(engine_model, pytestconfig):
    # --place-tool: place_tool (default: beside $KVBLENDD)
    args = argparse.Namespace(model=engine_model, place_tool=pytestconfig.getoption("place_tool"))
    if not os.environ.get("KVBLENDD"):
        fail("no daemon: run through tests/engine/run.sh")
    place_tool = args.place_tool or str(Path(os.environ["KVBLENDD"]).parent / "place_tool")
    t0 = time.monotonic()
    from kvbtest import cluster, install_temp

    # kvblend installed with pip (its vllm.general_plugins entry point: the blend pass and
    # the stores on a miss need the model in the worker), and imported from there
    tmp, site = install_temp("kvblend-cluster.")
    os.environ["PYTHONPATH"] = str(site)
    sys.path[:0] = [str(site)]
    for name in [m for m in sys.modules if m == "kvblend" or m.startswith("kvblend.")]:
        del sys.modules[name]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    import kvblend
    from transformers import AutoTokenizer

    p = Prompts(AutoTokenizer.from_pretrained(args.model))
    own = owners(place_tool, p.hashes)
    kinds = [sorted(own[h] for h in p.hashes[:2]), sorted(own[h] for h in p.hashes[2:])]
    if kinds != [list(NODES)] * 2:
        fail(f"placement puts the separator chunks on {kinds[0]}, the exact ones on "
             f"{kinds[1]}: the test wants one of each kind on each node (fetched and "
             "pushed), choose other documents")
    # a landing session's node calls the daemon only at check layers: on a loaded machine
    # the layers after the last one may outlast the default 60 s fuse_idle
    a, b = cluster(NODES, "--cluster-replicas", "1", "--fuse-idle", "600")
    ok = False
    try:
        llm, secs_a = start_engine(args.model, a.endpoint)
        print(f"  engine A on node-a started in {secs_a:.0f} s")
        # the model's name as the connector registered it (vllm:<model>:<dtype>): engine B
        # must derive the same one
        with kvblend.Client(a.endpoint, timeout_ms=10000) as c:
            # beside the engine's model, its worker's RoPE self-test's (kvblend.vllm.selftest)
            names = [m.name for m in c.model_list()
                     if not m.name.startswith("kvblend-selftest-")]
            if len(names) != 1:
                fail(f"node-a knows the models {names}, expected the engine's one")
            p.name = names[0]
            plain, got_a, stored = run_a(llm, p, c)
        stop_engine(llm)
        on_b = check_placement(p, own, a, b)
        llm, secs_b = start_engine(args.model, b.endpoint)
        print(f"  engine B on node-b started in {secs_b:.0f} s")
        run_b(llm, p, plain, got_a)
        stop_engine(llm)
        check_fetches(p, b, on_b, stored)
        ok = True
    finally:
        for d in (b, a):
            d.stop(keep=not ok)
        if not ok:
            print(f"daemon logs kept: {a.dir}/kvblendd.log, {b.dir}/kvblendd.log")
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"test_vllm_cluster: all passed in {time.monotonic() - t0:.0f} s")
