"""kvblend.vllm.KvblendConnector in a real vLLM 0.32 engine on the CPU, against a real kvblendd.

Run with the engine venv's python (.ci/engine-env), KVBLEND_LIB set to the build's
libkvblend and KVBLEND_ENGINE_MODEL (or --model) to the model directory. One engine start
serves every request:

(a) three documents stored with kvblend.vllm.store_documents: the daemon holds 3 chunks;
(b) doc1 + question as [chunk, fresh]: 16 greedy tokens equal plain vLLM's for the same
    prompt (no kv_transfer_params, same engine), and the daemon landed the chunk straight
    into vLLM's cache (vLLM's cache is in a kvblend region: one fuse_open, no GET);
(c) doc2 + doc1 + question, landed by the daemon and then copied by the connector (a test
    hook): the K and V in vLLM's cache (the connector's debug dump of the raw blocks,
    decoded here with the layout of notes/engine-facts.md, K transposed) equal the daemon's
    stored chunks with the keys rotated to their new positions by NumPy;
(d) doc1 + an unstored document + question: served, output equal to plain vLLM's;
(e) bad parameters: output equal to plain vLLM's, and the engine serves the next request;
(f) the daemon killed: a reuse request's output equals plain vLLM's, and so do 4 plain
    requests and a second reuse request during the outage (their times go to the report;
    test_vllm_daemon_link bounds the circuit breaker's waits);
(g) a load that fails in the worker (a test hook): vLLM recomputes, output equals plain;
(h) chunk boundaries by the configured separator (no request parameters): doc3 + SEP stored,
    SEP + doc3 + SEP + question is split (the fresh prefix SEP, the chunk doc3 + SEP, the
    question), the chunk looked up and found, nothing loaded without blending (a chunk after
    a fresh prefix needs the blend pass), output equal to plain vLLM's;
(i) a storing request prefilled in two steps (chunked prefill: the engine takes 256 tokens
    a step): stored once complete, and its exact-prefix reuse equals plain vLLM;
(j) preemption: six reuse requests at once in a cache of 7 usable blocks (each needs a
    second block as it decodes): vLLM preempts and resumes some, which load again; every
    output equals plain vLLM's;
(k) a daemon slowed on purpose (stopped with SIGSTOP 990 ms in every second, so each of
    its answers waits up to 1 s): the first reuse requests' loads cost the engine more
    than prefilling their tokens, the connector measures it, and the later reuse requests
    are computed instead ("load_declined" in the response, no landing opened); every
    output equals plain vLLM's (kvblend.vllm.cost).
The engine runs with a small cache (8 blocks of 128 tokens) and 256 tokens a step, so that
(i) and (j) happen, and with async_loads on: every reuse load is asynchronous (landed
between the engine's steps, reported done in get_finished; (b) checks that it was), but
(k)'s, synchronous by a test hook (KVBLEND_VLLM_SYNC_FILE).
Run by pytest (tests/engine/run.sh --pytest, as ctest does); skipped when KVBLEND_SKIP_ENGINE=1.
"""

import argparse
import json
import os
import shutil
import signal
import sys
import tempfile
import threading
import time
from pathlib import Path

import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

from kvbtest import Checks  # noqa: E402

HERE = Path(__file__).resolve().parent
SRC = HERE.parent.parent / "client" / "python" / "src"
MAX_TOKENS = 16
THETA = 1e5  # SmolLM2-135M: rope_theta 1e5, neox, head_dim 64, 3 KV heads, 30 layers

DOCS = [
    "The Amazon rainforest covers much of the Amazon basin of South America. The basin "
    "encompasses seven million square kilometres, of which five and a half million are "
    "covered by the rainforest. The region includes territory belonging to nine nations; "
    "the majority of the forest is contained within Brazil, followed by Peru and Colombia. "
    "It represents over half of the planet's remaining rainforests and comprises the largest "
    "and most biodiverse tract of tropical rainforest in the world, with an estimated 390 "
    "billion individual trees divided into 16,000 species.",
    "The Great Wall of China is a series of fortifications that were built across the "
    "historical northern borders of ancient Chinese states and Imperial China as protection "
    "against various nomadic groups from the Eurasian Steppe. Several walls were built from "
    "as early as the 7th century BC, with selective stretches later joined by Qin Shi Huang, "
    "the first emperor of China. Little of the Qin wall remains. Later on, many successive "
    "dynasties built and maintained multiple stretches of border walls. The best-known "
    "sections of the wall were built by the Ming dynasty.",
    "Photosynthesis is a process used by plants and other organisms to convert light energy "
    "into chemical energy that, through cellular respiration, can later be released to fuel "
    "the organism's activities. Some of this chemical energy is stored in carbohydrate "
    "molecules, such as sugars and starches, which are synthesized from carbon dioxide and "
    "water. Most plants, algae, and cyanobacteria perform photosynthesis; such organisms are "
    "called photoautotrophs.",
]
UNSTORED = ("The violin is a wooden chordophone, the smallest and highest-pitched instrument "
            "in regular use in the violin family. It has four strings tuned in perfect fifths.")
QUESTION = "\nQuestion: Summarise the text above in one sentence.\nAnswer:"
SEP = [49150, 49151]  # chunk_separator: two ids of SmolLM2's vocabulary no text here holds

check = Checks("test_connector")


def rope_rotate(k, delta, theta=THETA):
    """Rotate neox-style keys [..., tokens, heads, hd] by ``delta`` positions (float64)."""
    import numpy as np

    hd = k.shape[-1]
    inv = theta ** (-np.arange(0, hd, 2, dtype=np.float64) / hd)
    ang = delta * inv  # the same angle for every token: a shift by delta
    c, s = np.cos(ang), np.sin(ang)
    x = k.astype(np.float64)
    x1, x2 = x[..., : hd // 2], x[..., hd // 2 :]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def decode_dump(path, positions):
    """K and V [layers, tokens, heads, hd] at prompt positions, from a raw-block dump.

    The layout (notes/engine-facts.md, measured against transformers): per block and KV
    head, K transposed [head_dim, block_size], then V rows [block_size, head_dim].
    """
    import numpy as np

    z = np.load(path)
    raw, blocks, table, bs = z["raw"], list(z["blocks"]), z["block_ids"], int(z["block_size"])
    L, n, H, _, two_hd = raw.shape
    hd = two_hd // 2
    a = raw.reshape(L, n, H, 2, bs * hd)
    k = a[:, :, :, 0].reshape(L, n, H, hd, bs).swapaxes(-1, -2)  # [L, n, H, bs, hd]
    v = a[:, :, :, 1].reshape(L, n, H, bs, hd)
    idx = np.array([blocks.index(table[p // bs]) for p in positions])
    off = np.array([p % bs for p in positions])
    return k[:, idx, :, off].swapaxes(0, 1), v[:, idx, :, off].swapaxes(0, 1)


def check_landed_rows(d, hashes, spans, dump, how, report, np, kvblend):
    """K and V of each (length, start) chunk span in a load's dump against NumPy."""
    worst = {}
    with kvblend.Client(d.endpoint) as c:
        for (n, start), name, h in zip(spans, ("doc2", "doc1"), (hashes[1], hashes[0])):
            stored = c.get("smollm2-test", h)  # [L, 2, T, H, hd], keys at positions 0..
            rerot = c.get_rerotated("smollm2-test", h, pos=start)
            ref_k = rope_rotate(stored[:, 0], start)
            k, v = decode_dump(dump, list(range(start, start + n)))
            # float32 rotation of keys of magnitude up to ~20: a few 1e-5 apart from
            # a float64 reference; a wrong position or layout is off by the keys' size.
            worst[name] = {
                "k": float(np.abs(k - ref_k).max()),
                "v": float(np.abs(v - stored[:, 1]).max()),
                "daemon_k": float(np.abs(rerot[:, 0] - ref_k).max()),
                "shift_size": float(np.abs(ref_k - stored[:, 0]).max()),
            }
    report[f"c_{how}_max_abs_diff"] = worst
    for name, w in worst.items():
        check(f"(c) {how}: {name} K equals NumPy re-rotation", w["k"] < 1e-3, str(w))
        check(f"(c) {how}: {name} V equals stored V", w["v"] == 0.0)
        check(f"(c) {how}: {name} daemon re-rotation equals NumPy", w["daemon_k"] < 1e-3)


def test_connector(engine_model):
    args = argparse.Namespace(model=engine_model)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(SRC), str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    sys.path[:0] = [str(SRC), str(HERE)]
    dump_dir = Path(tempfile.mkdtemp(prefix="kvblend-dump."))
    os.environ["KVBLEND_VLLM_DUMP_DIR"] = str(dump_dir)
    os.environ["KVBLEND_VLLM_FAIL_LOAD_FILE"] = str(dump_dir / "fail-next-load")
    os.environ["KVBLEND_VLLM_COPY_FILE"] = str(dump_dir / "copy-loads")
    os.environ["KVBLEND_VLLM_SYNC_FILE"] = str(dump_dir / "sync-loads")

    import numpy as np
    import kvblend
    from harness import Daemon

    d = Daemon()
    report = {}
    try:
        run(args.model, d, dump_dir, report, np, kvblend)
    finally:
        d.stop()
        shutil.rmtree(dump_dir, ignore_errors=True)
    print("test_connector: " + json.dumps(report))
    check.done()


def run(model_dir, d, dump_dir, report, np, kvblend):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from kvblend.vllm import store_documents
    from kvbtest import connector_llm

    t0 = time.monotonic()
    # lookup_timeout_ms as timeout_ms: (k) slows the daemon to answers of up to 1 s, and
    # its lookups must get through to test the loads
    llm = connector_llm(model_dir, {"endpoint": d.endpoint, "timeout_ms": 2000,
                                    "lookup_timeout_ms": 2000, "model_name": "smollm2-test",
                                    "chunk_separator": SEP, "async_loads": True},
                        max_model_len=896, enable_prefix_caching=False,
                        num_gpu_blocks_override=8, max_num_batched_tokens=256)
    report["engine_start_s"] = round(time.monotonic() - t0, 1)
    tok = llm.get_tokenizer()
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    docs = [enc(t) for t in DOCS]
    q, unstored = enc(QUESTION), enc(UNSTORED)

    def gen(prompts, params_list, timed=None):
        sp = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             extra_args=None if p is None else {"kv_transfer_params": p})
              for p in params_list]
        t = time.monotonic()
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], sp,
                            use_tqdm=False)
        if timed:
            report[timed] = round(time.monotonic() - t, 3)
        return [list(o.outputs[0].token_ids) for o in outs]

    def segs(*s):
        return {"kvblend": {"segments": [list(x) for x in s]}}

    # (a)
    hashes = store_documents(llm, docs)
    st = d.stats()
    # the worker's RoPE self-test PUTs (and deletes) one chunk at start when the model is
    # reachable (the kvblend plugin installed in vLLM's environment)
    with kvblend.Client(d.endpoint, timeout_ms=10000) as c:
        probes = sum(m.name.startswith("kvblend-selftest-") for m in c.model_list())
    check("(a) 3 documents stored", st["chunks"] == 3 and st["requests_put"] == 3 + probes,
          f"chunks {st['chunks']}, puts {st['requests_put']} (self-test {probes}), "
          f"lengths {[len(x) for x in docs]}")
    check("(a) hashes are chunk_hash of the ids",
          hashes == [kvblend.chunk_hash(x) for x in docs])

    # (b)
    l1 = len(docs[0])
    p_b = docs[0] + q
    plain_b = gen([p_b], [None], "plain_request_s")[0]
    st0 = d.stats()
    reuse_b = gen([p_b], [segs((0, l1, "chunk"), (l1, len(q), "fresh"))], "reuse_request_s")[0]
    st1 = d.stats()
    opens = st1["requests_fuse_open"] - st0["requests_fuse_open"]
    gets = st1["requests_get"] - st0["requests_get"]
    check("(b) exact prefix: output equals plain vLLM", reuse_b == plain_b,
          f"{tok.decode(reuse_b)!r} vs {tok.decode(plain_b)!r}")
    # Landed: the daemon wrote the chunk into vLLM's cache itself (a landing session).
    check("(b) daemon landed the chunk", opens == 1 and gets == 0,
          f"fuse_open +{opens}, get +{gets}")
    dumps = list(dump_dir.glob("load-*.npz"))
    check("(b) one load dumped, landed", len(dumps) == 1 and all(
        str(np.load(f)["path"]) == "landed" for f in dumps))
    check("(b) the load was asynchronous (landed between steps)",
          len(dumps) == 1 and bool(np.load(dumps[0])["early"]))

    # (c) landed, then copied (the test hook): both against NumPy
    l2 = len(docs[1])
    p_c = docs[1] + docs[0] + q
    seg_c = segs((0, l2, "chunk"), (l2, l1, "chunk"), (l2 + l1, len(q), "fresh"))
    for how in ("landed", "copied"):
        for f in dump_dir.glob("load-*.npz"):
            f.unlink()
        if how == "copied":
            (dump_dir / "copy-loads").touch()
        reuse_c = gen([p_c], [seg_c])[0]
        (dump_dir / "copy-loads").unlink(missing_ok=True)
        dumps = sorted(dump_dir.glob("load-*.npz"))
        check(f"(c) one load dumped, {how}",
              len(dumps) == 1 and str(np.load(dumps[0])["path"]) == how)
        if dumps:
            check_landed_rows(d, hashes, [(l2, 0), (l1, l2)], dumps[0], how, report, np,
                              kvblend)
    plain_c = gen([p_c], [None])[0]
    report["c_output_equals_plain"] = reuse_c == plain_c  # not required: no cross-attention

    # time to first token, plain vs reuse of three chunks (min of 3, alternating)
    p_t = docs[1] + docs[0] + docs[2] + q
    a, b = l2 + l1, l2 + l1 + len(docs[2])
    reuse_t = segs((0, l2, "chunk"), (l2, l1, "chunk"), (a, b - a, "chunk"), (b, len(q), "fresh"))
    times = {"plain": [], "reuse": []}
    for _ in range(3):
        for mode, p in (("plain", None), ("reuse", reuse_t)):
            sp = SamplingParams(temperature=0.0, max_tokens=1,
                                extra_args=None if p is None else {"kv_transfer_params": p})
            t = time.monotonic()
            llm.generate([TokensPrompt(prompt_token_ids=p_t)], [sp], use_tqdm=False)
            times[mode].append(time.monotonic() - t)
    report["ttft_tokens"] = len(p_t)
    report["ttft_plain_s"] = round(min(times["plain"]), 3)
    report["ttft_reuse_s"] = round(min(times["reuse"]), 3)

    # (d)
    lu = len(unstored)
    p_d = docs[0] + unstored + q
    got = gen([p_d, p_d], [segs((0, l1, "chunk"), (l1, lu, "chunk"), (l1 + lu, len(q), "fresh")),
                           None])
    check("(d) missing chunk: output equals plain vLLM", got[0] == got[1])
    p_d2 = unstored + q
    got = gen([p_d2, p_d2], [segs((0, lu, "chunk")), None])
    check("(d) nothing stored: output equals plain vLLM", got[0] == got[1])

    # (e)
    n = len(p_b)
    bad = [
        {"kvblend": "x"},
        {"kvblend": {"segments": [[0, "a", "chunk"]]}},
        {"kvblend": {"segments": [[0, n + 5, "chunk"]]}},
        {"kvblend": {"segments": [[-3, 10, "chunk"]]}},
        {"kvblend": {"segments": [[0, l1, "chunk"], [5, 4, "fresh"]]}},
        {"kvblend": {"segments": [[0, l1, "blob"]]}},
        {"kvblend": {"segments": [[0, l1, "chunk"]], "store": "yes"}},
        {"kvblend": {"segments": [[0, l1, "chunk"]], "store": True}},  # store refused: shape
    ]
    got = gen([p_b] * len(bad), bad)
    check("(e) bad parameters: outputs equal plain vLLM", all(g == plain_b for g in got),
          str([g == plain_b for g in got]))
    check("(e) nothing stored by a refused store", d.stats()["chunks"] == 3)
    after = gen([p_b], [segs((0, l1, "chunk"))])[0]
    check("(e) engine still serves", after == plain_b)

    # (g) a load that fails in the worker: vLLM recomputes the blocks
    (dump_dir / "fail-next-load").touch()
    got = gen([p_b], [segs((0, l1, "chunk"), (l1, len(q), "fresh"))])[0]
    check("(g) failed load: injected", not (dump_dir / "fail-next-load").exists())
    check("(g) failed load: output equals plain vLLM", got == plain_b,
          f"{tok.decode(got)!r}")

    # (h) the separator (LMCache's convention): the prefix through the first separator is
    # fresh, each piece between two separators (with its closing one) is a chunk, the rest
    # is fresh. Without blending, only chunks after tokens vLLM already has can be loaded:
    # the request is split and looked up, nothing is claimed after its fresh prefix
    s3 = docs[2] + SEP
    store_documents(llm, [s3])
    p_h = SEP + s3 + q
    plain_h = gen([p_h], [{"kvblend": {"segments": []}}])[0]
    st0 = d.stats()
    got = gen([p_h], [None])[0]
    st1 = d.stats()
    check("(h) separator: the chunk between two separators is looked up and found",
          st1["lookup_hits"] - st0["lookup_hits"] == 1,
          f"{st1['lookup_hits'] - st0['lookup_hits']} hits")
    check("(h) separator, no blending: nothing loaded after the fresh prefix",
          st1["requests_fuse_open"] == st0["requests_fuse_open"])
    check("(h) separator: output equals plain vLLM", got == plain_h, f"{tok.decode(got)!r}")

    # (i) a storing request over two steps (chunked prefill), then reused as a prefix
    long_doc = docs[0] + docs[1] + docs[2]
    check("(i) the document takes two steps", len(long_doc) > 256, str(len(long_doc)))
    before = d.stats()["chunks"]
    h_long = store_documents(llm, [long_doc])[0]
    with kvblend.Client(d.endpoint) as c:
        info = c.lookup("smollm2-test", [h_long])[0]
    check("(i) chunked prefill: stored", d.stats()["chunks"] == before + 1 and info.found
          and info.num_tokens == len(long_doc))
    p_i = long_doc + q
    plain_i = gen([p_i], [None])[0]
    got = gen([p_i], [segs((0, len(long_doc), "chunk"), (len(long_doc), len(q), "fresh"))])[0]
    check("(i) chunked prefill: reuse equals plain vLLM", got == plain_i, f"{tok.decode(got)!r}")

    # (j) preemption: 6 x 137 tokens need 2 blocks each at the end; 7 are usable
    n_j = 6
    st0 = d.stats()
    got = gen([p_b] * n_j, [segs((0, l1, "chunk"), (l1, len(q), "fresh"))] * n_j)
    st1 = d.stats()
    opens = st1["requests_fuse_open"] - st0["requests_fuse_open"]
    report["j_loads"] = opens
    check("(j) preempted and resumed requests loaded again", opens > n_j, f"{opens} loads")
    check("(j) preemption: every output equals plain vLLM",
          all(g == plain_b for g in got), str([g == plain_b for g in got]))

    # (k) a slowed daemon: a load that loses is computed instead. Synchronous loads (the
    # test hook): an asynchronous one opens right after its lookup, in the same moment
    # the throttled daemon runs, and is not slow
    (dump_dir / "sync-loads").touch()
    slowed_loads(llm, d, p_b, plain_b, l1, len(q), report)
    (dump_dir / "sync-loads").unlink()

    # (f) the daemon killed between requests: outputs equal plain vLLM's. The times go to
    # the report only (a shared machine makes them noisy); test_vllm_daemon_link holds the
    # circuit breaker to its bounds without an engine
    def timed_plain():
        t = time.monotonic()
        out = gen([p_c] * 4, [None] * 4)
        return time.monotonic() - t, out

    base_s, _ = timed_plain()
    d.stop()
    t = time.monotonic()
    got = gen([p_b], [segs((0, l1, "chunk"), (l1, len(q), "fresh"))])[0]
    report["daemon_down_request_s"] = round(time.monotonic() - t, 2)
    check("(f) daemon killed: output equals plain vLLM", got == plain_b)
    down_s, outs = timed_plain()
    report["plain_4_s"], report["plain_4_daemon_down_s"] = round(base_s, 2), round(down_s, 2)
    check("(f) engine still serves plain requests", all(o == plain_c for o in outs))
    t = time.monotonic()
    got = gen([p_b], [segs((0, l1, "chunk"), (l1, len(q), "fresh"))])[0]
    report["daemon_down_second_request_s"] = round(time.monotonic() - t, 2)
    check("(f) a second kvblend request during the outage: output equals plain vLLM",
          got == plain_b)

def slowed_loads(llm, d, prompt, plain, n_chunk, n_fresh, report):
    """(k) Loads from a daemon slowed on purpose lose to prefill: computed instead."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    seg = {"kvblend": {"segments": [[0, n_chunk, "chunk"], [n_chunk, n_fresh, "fresh"]]}}
    stop = threading.Event()

    def throttle():  # the daemon runs 10 ms in every second
        pid = d.proc.pid
        while not stop.is_set():
            os.kill(pid, signal.SIGSTOP)
            time.sleep(0.99)
            os.kill(pid, signal.SIGCONT)
            time.sleep(0.01)
        os.kill(pid, signal.SIGCONT)

    opens0 = d.stats()["requests_fuse_open"]
    th = threading.Thread(target=throttle, daemon=True)
    th.start()
    said, got, secs = [], [], []
    try:
        for _ in range(4):
            sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                extra_args={"kv_transfer_params": seg})
            t = time.monotonic()
            out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], [sp], use_tqdm=False)[0]
            secs.append(round(time.monotonic() - t, 2))
            said.append((out.kv_transfer_params or {}).get("kvblend", {}))
            got.append(list(out.outputs[0].token_ids))
    finally:
        stop.set()
        th.join()
    opens = d.stats()["requests_fuse_open"] - opens0
    report["k_request_s"], report["k_said"], report["k_opens"] = secs, said, opens
    check("(k) slowed daemon: every output equals plain vLLM", all(g == plain for g in got),
          str([g == plain for g in got]))
    declined = [s.get("load_declined", 0) for s in said]
    loaded = [s.get("reused", 0) for s in said]
    check("(k) slow loads measured, then the requests are computed instead",
          loaded[0] == n_chunk and declined[0] == 0 and declined[-1] == n_chunk
          and all(x in (0, n_chunk) for x in declined)
          and all((a == 0) != (b == 0) for a, b in zip(loaded, declined))
          and opens == sum(1 for x in loaded if x),
          f"load_declined {declined}, reused {loaded}, landings opened {opens}, said {said}")
