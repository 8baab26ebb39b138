"""Tensor parallelism 2 in a real vLLM 0.32 CPU engine with KvblendConnector.

Run with the engine venv's python (.ci/engine-env), KVBLEND_LIB set to the build's
libkvblend and KVBLEND_ENGINE_MODEL (or --model) to SmolLM2-135M-Instruct's directory,
whose tokenizer the test model (make_tp_model.py: a random-weight Llama with 4 KV heads,
float32, built beside it on first use) shares. One daemon; two engines, one after the
other, each in a process of its own (this script with --phase):

TP = 1: two documents stored (store_documents); plain outputs of three prompts; and the
re-rotated reuse of both documents (doc0 then doc1, each a chunk, then the question).
TP = 2 (each rank holds 2 of the 4 KV heads; vLLM's cache in a kvblend region):
(a) plain outputs equal TP = 1's (float32: the ranks' sums differ by about 1e-5);
    every rank's log names its head range and shows its loads done, none failed (a
    failed load is recomputed by vLLM, so an output equal to plain alone proves nothing);
(b) doc0 stored at TP = 1 reused as an exact prefix: 16 greedy tokens equal plain TP = 2,
    landed by the daemon (one landing session a rank, each its head range; no GET);
(c) the same load copied from the daemon's reply (a test hook): equal to plain; one
    re-rotated GET a rank, no landing;
(d) doc2 stored at TP = 2: one PUT (rank 0, the ranks' heads gathered to it), one chunk
    more, and its K and V equal transformers' float32 prefill of doc2 within 1e-4 of
    each layer's scale (heads in the wrong order or a rank's left out would be off by
    the values' size);
(e) doc2 reused as an exact prefix at TP = 2: equal to plain;
(f) the re-rotated reuse of doc0 then doc1 gives TP = 1's tokens;
(g) on vLLM's own config, no engine: refused with a line naming the cause, 8 ranks over
    4 KV heads, ``blend`` by the attention metric (each head's deviation weighed by its
    own A) and ``store_on_miss`` under TP; a
    separator alone runs, with store on a miss off by default;
(h) CacheBlend at TP = 2 (both engines configured with blend at layer 1, r = 0.15, the
    value metric; the reuse requests above opt out with "blend": false): doc1 then doc0
    blended at r = 1.0 equals plain TP = 2;
(i) at r = 0.15 it gives TP = 1's tokens (the ranks' deviations summed select as one
    rank's), and differs from plain;
(j) both blends in one generate call (one pass, the ranks agreeing on it) each equal
    their own;
(k) a blend that fails on rank 1 alone (the worker's failure hook, "rank 1") fails on rank
    0 too (the ranks agree on a step's blends), its output is plain's (vLLM recomputed
    it), and the next blend runs as before: no rank hangs;
(l) the question metric (A alone: each rank previews the question over its heads, the
    ranks select by A summed over all of them) at r = 1.0 equals plain TP = 2, and at
    r = 0.15 it gives TP = 1's tokens and differs from plain; the anchored metric at
    r = 0.15 gives TP = 1's tokens; a request naming the attention metric is served as
    plain vLLM with a line saying why;
(m) a failure inside the pass on rank 1 alone (the hook's "rank 1 layer 2": that layer's
    attention raises there) stops both ranks at that layer's agreement, before the
    layer's reducing projections, so rank 0 is not left in an all-reduce: its output is
    plain's and the next blend runs as before;
(n) the same inside the anchored metric's preview (the hook's "rank 1 preview 1": the
    preview raises there on rank 1): both ranks stop at that layer's agreement, the output
    is plain's, and the next anchored blend gives (l)'s tokens;
(o) a mixture of experts (make_tp_model.py's random Qwen3-MoE, 4 KV heads, 4 experts of
    which 2 are routed to each token), two engines more, TP = 1 then TP = 2: plain TP = 2
    equals TP = 1; the blend at r = 1.0 equals plain TP = 2; at r = 0.15 (value metric)
    and by the default (anchored) it gives TP = 1's tokens and differs from plain, every
    rank blending each request with no load failed: the pass's routed experts, sharded
    over the ranks and reduced inside vLLM's module, select and fuse as one rank's;
(p) the same for Gemma 3 (make_tp_model.py's random Gemma 3, 4 KV heads, local layers 0 and
    2 with a 48-token sliding window and RoPE base 1e4, full layers 1 and 3 with 1e6): the
    windows and the two bases over 2 ranks.
Run by pytest (tests/engine/run.sh --pytest, as ctest does); skipped when KVBLEND_SKIP_ENGINE=1.
Each engine runs in a child process: this file as a script with --phase TP (not by hand).
"""

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

from kvbtest import Checks  # noqa: E402

HERE = Path(__file__).resolve().parent
SRC = HERE.parent.parent / "client" / "python" / "src"
MAX_TOKENS = 16
NAME = "tp-test"
TOL = 1e-4
QUESTION = " Question: which of these places would you visit first, and why?"

check = Checks("test_vllm_tp")


def phase(tp, model_dir, endpoint, out_path, family="llama"):
    """One engine at TP = tp; its outputs (and the daemon's counters around them) to out_path.

    ``family`` "qwen3moe" or "gemma3": (o) and (p)'s requests only."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sys.path[:0] = [str(SRC), str(HERE)]
    import kvblend
    from kvblend.vllm import store_documents
    from kvbtest import DOCS, connector_llm

    t0 = time.monotonic()
    llm = connector_llm(model_dir, {"endpoint": endpoint, "timeout_ms": 20000,
                                    "model_name": NAME if family == "llama" else f"{NAME}-{family}",
                                    "blend": {"check_layers": [1], "ratios": [0.15]}},
                        tensor_parallel_size=tp,
                        distributed_executor_backend="mp" if tp > 1 else None,
                        max_model_len=512, enable_prefix_caching=False,
                        num_gpu_blocks_override=16)
    res = {"engine_start_s": round(time.monotonic() - t0, 1)}
    tok = llm.get_tokenizer()
    docs = [tok.encode(t, add_special_tokens=False) for t in DOCS[:3]]
    q = tok.encode(QUESTION, add_special_tokens=False)
    l0, l1, l2 = (len(d) for d in docs)

    def gen(prompts, params=None):
        params = params or [None] * len(prompts)
        sp = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             extra_args=None if p is None else {"kv_transfer_params": p})
              for p in params]
        outs = llm.generate([TokensPrompt(prompt_token_ids=ids) for ids in prompts], sp,
                            use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    def segs(*s, blend=False):
        # plain reuse unless a blend is asked for (the engines are configured to blend)
        return {"kvblend": {"segments": [list(x) for x in s], "blend": blend}}

    def stats():
        with kvblend.Client(endpoint, timeout_ms=10000) as c:
            return c.stats()

    def delta(a, b):
        return {k: b[k] - a[k] for k in ("requests_fuse_open", "requests_get", "requests_put",
                                          "chunks")}

    prompts = [docs[0] + q, docs[2] + q, docs[0] + docs[1] + q, docs[1] + docs[0] + q]
    two = ((0, l0, "chunk"), (l0, l1, "chunk"), (l0 + l1, len(q), "fresh"))
    rr = segs(*two)
    swapped = ((0, l1, "chunk"), (l1, l0, "chunk"), (l0 + l1, len(q), "fresh"))
    res["plain"] = gen(prompts)
    if family != "llama":  # (o)
        if tp == 1:
            store_documents(llm, docs[:2])
        else:
            res["blend1"] = gen([prompts[3]], [segs(*swapped, blend={"ratios": [1.0]})])[0]
        res["blend15"] = gen([prompts[3]], [segs(*swapped, blend={})])[0]
        res["anchored15"] = gen([prompts[3]], [segs(*swapped, blend={"metric": "anchored"})])[0]
    elif tp == 1:
        res["hashes"] = [h.hex() for h in store_documents(llm, docs[:2])]
        res["rerotated"] = gen([prompts[2]], [rr])[0]
        res["blend15"] = gen([prompts[3]], [segs(*swapped, blend={})])[0]
        res["question15"] = gen([prompts[3]], [segs(*swapped, blend={"metric": "question"})])[0]
        res["anchored15"] = gen([prompts[3]], [segs(*swapped, blend={"metric": "anchored"})])[0]
    else:
        s0 = stats()
        res["reuse0"] = gen([prompts[0]], [segs((0, l0, "chunk"), (l0, len(q), "fresh"))])[0]
        s1 = stats()
        res["reuse0_counts"] = delta(s0, s1)
        copy = os.environ["KVBLEND_VLLM_COPY_FILE"]
        Path(copy).touch()
        res["copy0"] = gen([prompts[0]], [segs((0, l0, "chunk"), (l0, len(q), "fresh"))])[0]
        os.unlink(copy)
        s2 = stats()
        res["copy0_counts"] = delta(s1, s2)
        res["doc2_hash"] = store_documents(llm, [docs[2]])[0].hex()
        s3 = stats()
        res["store2_counts"] = delta(s2, s3)
        res["doc2_ids"] = docs[2]
        res["reuse2"] = gen([prompts[1]], [segs((0, l2, "chunk"), (l2, len(q), "fresh"))])[0]
        res["rerotated"] = gen([prompts[2]], [rr])[0]
        # blends: at r = 1.0 (every token recomputed) and the engine's r = 0.15, doc1
        # then doc0 (doc0 away from where it was stored); then two at once (one pass)
        res["blend1"] = gen([prompts[3]], [segs(*swapped, blend={"ratios": [1.0]})])[0]
        res["blend15"] = gen([prompts[3]], [segs(*swapped, blend={})])[0]
        res["blend_pair"] = gen([prompts[3], prompts[3]],
                                [segs(*swapped, blend={"ratios": [1.0]}),
                                 segs(*swapped, blend={})])
        # a blend that fails on rank 1 alone (the worker's test hook): rank 0 fails it too
        # (the ranks agree on the step's blends), vLLM recomputes it, and the next blend
        # runs (no rank left waiting in a collective)
        Path(os.environ["KVBLEND_VLLM_FAIL_LOAD_FILE"]).write_text("rank 1\n")
        res["blend_failed"] = gen([prompts[3]], [segs(*swapped, blend={})])[0]
        res["blend_after"] = gen([prompts[3]], [segs(*swapped, blend={})])[0]
        # a failure inside the pass on rank 1 alone (the hook's "layer 2": its attention
        # there raises): both ranks stop at that layer's agreement, before its reducing
        # projections (rank 0 is not left in an all-reduce), vLLM recomputes, and the next
        # blend runs
        Path(os.environ["KVBLEND_VLLM_FAIL_LOAD_FILE"]).write_text("rank 1 layer 2\n")
        res["blend_pass_failed"] = gen([prompts[3]], [segs(*swapped, blend={})])[0]
        res["blend_after_pass"] = gen([prompts[3]], [segs(*swapped, blend={})])[0]
        # the question and anchored metrics: each rank previews over its heads, the
        # ranks select by A summed over all of them
        res["question1"] = gen([prompts[3]], [segs(*swapped, blend={"metric": "question",
                                                                     "ratios": [1.0]})])[0]
        res["question15"] = gen([prompts[3]], [segs(*swapped, blend={"metric": "question"})])[0]
        res["anchored15"] = gen([prompts[3]], [segs(*swapped, blend={"metric": "anchored"})])[0]
        # a failure inside the anchored metric's preview on rank 1 alone (the hook's
        # "preview 1"): both ranks stop at that layer's agreement, before its reducing
        # projections; vLLM recomputes, and the next anchored blend runs
        Path(os.environ["KVBLEND_VLLM_FAIL_LOAD_FILE"]).write_text("rank 1 preview 1\n")
        res["preview_failed"] = gen([prompts[3]], [segs(*swapped,
                                                        blend={"metric": "anchored"})])[0]
        res["anchored_after"] = gen([prompts[3]], [segs(*swapped,
                                                        blend={"metric": "anchored"})])[0]
        # a request naming the attention metric: served as plain vLLM, one line says why
        res["attention_req"] = gen([prompts[3]], [segs(*swapped,
                                                       blend={"metric": "attention"})])[0]
    Path(out_path).write_text(json.dumps(res))


def refusals(model_dir):
    """(g) What the connector refuses under TP, checked on vLLM's own config (no engine)."""
    from vllm.engine.arg_utils import EngineArgs

    from kvblend.vllm.config import Refused, connector_config
    from kvbtest import connector_transfer

    def config(tp, extra):
        return EngineArgs(
            model=model_dir, tensor_parallel_size=tp, distributed_executor_backend="mp",
            dtype="float32", enforce_eager=True, max_model_len=512,
            kv_transfer_config=connector_transfer(dict(extra, model_name=NAME)),
        ).create_engine_config()

    cases = [
        ("8 ranks, 4 KV heads (vLLM would replicate them)", 8, {}, "does not divide"),
        ("blend by the attention metric under TP", 2,
         {"blend": {"check_layers": [1], "ratios": [0.15], "metric": "attention"}},
         "takes the value, key, question or anchored metric"),
        ("store_on_miss under TP", 2, {"store_on_miss": True, "chunk_separator": [11]},
         "store_on_miss under tensor parallelism"),
    ]
    for what, tp, extra, want in cases:
        try:
            connector_config(config(tp, extra))
            check(f"(g) refused: {what}", False, "started")
        except Refused as e:
            check(f"(g) refused: {what}", want in str(e), str(e))
    c = connector_config(config(2, {"chunk_separator": [11]}))
    check("(g) a separator under TP: store on a miss off by default, reuse on",
          c.store_on_miss is False and c.model.num_kv_heads == 4)


def hf_kv(model_dir, ids):
    """transformers' float32 K (rotated) and V of ids from position 0: [L, 2, T, H, hd]."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        out = m(torch.tensor([ids]), use_cache=True)
    cache = out.past_key_values
    layers = []
    for i in range(m.config.num_hidden_layers):
        if hasattr(cache, "layers"):
            k, v = cache.layers[i].keys, cache.layers[i].values
        else:
            k, v = cache[i]
        # [1, H, T, hd] -> [T, H, hd]
        layers.append(np.stack([k[0].transpose(0, 1).numpy(), v[0].transpose(0, 1).numpy()]))
    return np.stack(layers)


def test_vllm_tp(engine_model):
    args = argparse.Namespace(model=engine_model)
    sys.path[:0] = [str(SRC), str(HERE)]
    import numpy as np
    import kvblend
    from harness import Daemon
    from kvbtest import install
    from make_tp_model import ensure

    t0 = time.monotonic()
    model_dir = str(ensure(args.model))
    moe_dir = str(ensure(args.model, family="qwen3moe"))
    gemma_dir = str(ensure(args.model, family="gemma3"))
    print(f"test models {model_dir}, {moe_dir}, {gemma_dir} ({time.monotonic() - t0:.1f} s)")
    work = Path(tempfile.mkdtemp(prefix="kvblend-tp."))
    # the blend pass reaches vLLM's model through the package's vllm.general_plugins entry
    # point: installed (with its metadata) into a folder of its own
    site = work / "site"
    install(site)
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (str(site), str(HERE), os.environ.get("PYTHONPATH", "")) if p)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    env["KVBLEND_VLLM_COPY_FILE"] = str(work / "copy-loads")
    env["KVBLEND_VLLM_FAIL_LOAD_FILE"] = str(work / "fail-next-load")
    d = Daemon()

    def engines(family, model):
        """Run the family's engines at TP = 1, then 2; their results and logs by TP."""
        res, logs = {}, {}
        for tp, bind in ((1, "nobind"), (2, "0|1")):
            # vLLM's CPU TP needs a core a rank ("auto" wants a NUMA node a rank)
            e = dict(env, VLLM_CPU_OMP_THREADS_BIND=bind)
            out = work / f"{family}-tp{tp}.json"
            t = time.monotonic()
            p = subprocess.run([sys.executable, __file__, "--model", model, "--phase",
                                str(tp), "--endpoint", d.endpoint, "--out", str(out),
                                "--family", family],
                               env=e, timeout=900, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
            rc, logs[tp] = p.returncode, p.stdout
            print(p.stdout)
            if rc != 0:
                check(f"{family} engine at TP = {tp} ran", False, f"exit {rc}")
                check.done()
            res[tp] = json.loads(out.read_text())
            print(f"{family} TP = {tp}: {time.monotonic() - t:.1f} s (engine start "
                  f"{res[tp]['engine_start_s']} s)")
        return res, logs

    try:
        res, logs = engines("llama", model_dir)
        one, two = res[1], res[2]
        # A load that fails is recomputed by vLLM, and its output is plain's: each rank's
        # log must show its loads done (landed, or copied) and none failed.
        done = {r: {"landed": 0, "copied": 0, "blended": 0} for r in (0, 1)}
        for m in re.finditer(r"\(Worker_TP(\d) pid=\d+\).*kvblend: loaded \d+ tokens of "
                             r"\S+ in [0-9.]+ s \((landed|copied)", logs[2]):
            done[int(m.group(1))][m.group(2)] += 1
        for m in re.finditer(r"\(Worker_TP(\d) pid=\d+\).*kvblend: blended \d+ tokens of ",
                             logs[2]):
            done[int(m.group(1))]["blended"] += 1
        bad = re.findall(r"kvblend: (?:load for \S+ failed|landing session for \S+ refused|"
                         r"landing stopped|landing off).*", logs[2])
        # the one failure on purpose: each rank fails it, by the hook or by the agreement
        meant = [b for b in bad if "injected" in b or "another tensor-parallel rank" in b]
        bad = [b for b in bad if b not in meant]
        check("TP = 2: each rank landed 3 loads, copied 1 and blended 10, none failed but "
              "the three failed on purpose",
              all(v == {"landed": 3, "copied": 1, "blended": 10} for v in done.values())
              and not bad, f"{done}, failures {bad[:3]}")

        def failed(why):
            return re.findall(r"\(Worker_TP(\d) pid=\d+\).*kvblend: load for \S+ failed \("
                              + why, logs[2])

        hook, agreed = failed("load failure injected"), failed(
            "another tensor-parallel rank could not start its blend")
        check("(k) a blend failed on rank 1 alone fails on rank 0 too (recomputed: plain)",
              hook == ["1"] and agreed == ["0"] and two["blend_failed"] == two["plain"][3],
              f"hook {hook}, agreed {agreed}")
        check("(k) and the next blend runs as before", two["blend_after"] == two["blend15"])
        hook = failed(r"kvblend: a failure injected in the blend pass at layer 2\)")
        # rank 0's by the agreement: (m)'s, then (n)'s
        agreed = failed(r"kvblend: another tensor-parallel rank's blend failed\)")
        check("(m) a failure inside the pass on rank 1 alone stops both ranks there "
              "(recomputed: plain)",
              hook == ["1"] and agreed == ["0", "0"]
              and two["blend_pass_failed"] == two["plain"][3],
              f"hook {hook}, agreed {agreed}")
        hook = failed(r"kvblend: a failure injected in the preview at layer 1\)")
        check("(n) a failure inside the anchored preview on rank 1 alone stops both ranks "
              "there (recomputed: plain)",
              hook == ["1"] and agreed == ["0", "0"]
              and two["preview_failed"] == two["plain"][3], f"hook {hook}, agreed {agreed}")
        check("(n) and the next anchored blend runs as before",
              two["anchored_after"] == two["anchored15"])
        check("(m) and the next blend runs as before (no rank left in a collective)",
              two["blend_after_pass"] == two["blend15"])
        check("(h) blend at r = 1.0 at TP = 2 equals plain TP = 2",
              two["blend1"] == two["plain"][3], f"{two['blend1']} vs {two['plain'][3]}")
        check("(i) blend at r = 0.15 at TP = 2 gives TP = 1's tokens (the ranks' summed "
              "deviations select as one rank's)", two["blend15"] == one["blend15"],
              f"{two['blend15']} vs {one['blend15']}")
        check("(i) the r = 0.15 blend is not plain (a blend, not a recompute)",
              two["blend15"] != two["plain"][3])
        check("(j) two blends in one pass at TP = 2: each equals its own",
              two["blend_pair"] == [two["blend1"], two["blend15"]],
              f"{two['blend_pair']}")
        check("(l) the question metric at r = 1.0 at TP = 2 equals plain TP = 2",
              two["question1"] == two["plain"][3], f"{two['question1']} vs {two['plain'][3]}")
        for m in ("question", "anchored"):
            check(f"(l) the {m} metric at r = 0.15 at TP = 2 gives TP = 1's tokens (the ranks' "
                  "summed A selects as one rank's)", two[f"{m}15"] == one[f"{m}15"],
                  f"{two[f'{m}15']} vs {one[f'{m}15']}")
        check("(l) the question metric at r = 0.15 is not plain",
              two["question15"] != two["plain"][3])
        check("(g) a request naming the attention metric under TP: plain vLLM, one line why",
              two["attention_req"] == two["plain"][3]
              and "kvblend.blend.metric 'attention' under tensor parallelism (2 ranks)"
              in logs[2])
        check("TP = 2: each rank logged its KV heads",
              "tensor-parallel rank 0 of 2: KV heads 0..1 of 4" in logs[2]
              and "tensor-parallel rank 1 of 2: KV heads 2..3 of 4" in logs[2])
        check("(a) plain TP = 2 equals plain TP = 1", one["plain"] == two["plain"])
        check("(b) doc0 stored at TP = 1, reused at TP = 2: equals plain",
              two["reuse0"] == two["plain"][0], f"{two['reuse0']} vs {two['plain'][0]}")
        c = two["reuse0_counts"]
        check("(b) landed: a session a rank, no GET",
              c["requests_fuse_open"] == 2 and c["requests_get"] == 0, str(c))
        check("(c) copied from the reply: equals plain", two["copy0"] == two["plain"][0])
        c = two["copy0_counts"]
        check("(c) copied: a GET a rank, no landing",
              c["requests_get"] == 2 and c["requests_fuse_open"] == 0, str(c))
        c = two["store2_counts"]
        check("(d) doc2 stored at TP = 2: one PUT, one chunk more",
              c["requests_put"] == 1 and c["chunks"] == 1, str(c))
        with kvblend.Client(d.endpoint, timeout_ms=10000) as cl:
            got = cl.get(NAME, bytes.fromhex(two["doc2_hash"]))
        want = hf_kv(model_dir, two["doc2_ids"])
        worst = 0.0
        for layer in range(want.shape[0]):
            for kv in range(2):
                scale = float(np.abs(want[layer, kv]).max())
                worst = max(worst, float(np.abs(got[layer, kv] - want[layer, kv]).max()) / scale)
        swapped = np.concatenate([want[:, :, :, 2:], want[:, :, :, :2]], axis=3)
        off = float(np.abs(swapped - want).max() / np.abs(want).max())
        check("(d) stored K and V equal transformers' prefill",
              got.shape == want.shape and worst < TOL,
              f"shape {got.shape}, worst {worst:.2e} of each layer's scale; the ranks' "
              f"halves swapped would be {off:.2f}")
        check("(e) doc2 reused at TP = 2: equals plain", two["reuse2"] == two["plain"][1])
        check("(f) re-rotated reuse at TP = 2 gives TP = 1's tokens",
              two["rerotated"] == one["rerotated"], f"{two['rerotated']} vs {one['rerotated']}")
        refusals(model_dir)
        for item, what, family, fam_dir in (("(o)", "MoE", "qwen3moe", moe_dir),
                                            ("(p)", "Gemma 3", "gemma3", gemma_dir)):
            fam, fam_logs = engines(family, fam_dir)
            one, two = fam[1], fam[2]
            blended = {r: len(re.findall(rf"\(Worker_TP{r} pid=\d+\).*kvblend: blended \d+ "
                                         "tokens of ", fam_logs[2])) for r in (0, 1)}
            bad = re.findall(r"kvblend: (?:load for \S+ failed|landing session for \S+ "
                             r"refused|landing stopped|landing off).*", fam_logs[2])
            check(f"{item} {what} at TP = 2: each rank blended the three requests, no load "
                  "failed", blended == {0: 3, 1: 3} and not bad, f"{blended}, failures {bad[:3]}")
            check(f"{item} {what}: plain TP = 2 equals plain TP = 1",
                  one["plain"] == two["plain"])
            check(f"{item} {what}: blend at r = 1.0 at TP = 2 equals plain TP = 2",
                  two["blend1"] == two["plain"][3], f"{two['blend1']} vs {two['plain'][3]}")
            for m in ("blend", "anchored"):
                check(f"{item} {what}: {m} at r = 0.15 at TP = 2 gives TP = 1's tokens, not "
                      "plain's",
                      two[f"{m}15"] == one[f"{m}15"] and two[f"{m}15"] != two["plain"][3],
                      f"{two[f'{m}15']} vs TP = 1 {one[f'{m}15']}, plain {two['plain'][3]}")
    finally:
        d.stop()
    check.done()


if __name__ == "__main__":  # one engine at TP = --phase, run by test_vllm_tp in a child
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--phase", type=int, required=True)
    ap.add_argument("--endpoint", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--family", default="llama")
    a = ap.parse_args()
    phase(a.phase, a.model, a.endpoint, a.out, a.family)
