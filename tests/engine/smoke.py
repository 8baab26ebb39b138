"""Smoke test of the engine environment: a real vLLM on the CPU, with and without a connector.

Run with the engine venv's python (see .ci/engine-env)::

    python tests/engine/smoke.py --model DIR [--out FACTS.json]

Two phases, each in its own process (vLLM spawns an engine process per LLM):

* ``plain``: ``vllm.LLM`` on the model, greedy generation of 16 tokens for two
  prompts; prints the outputs and the engine start time.
* ``probe``: the same with tests/engine/probe_connector.py loaded as a v1 KV
  connector (``kv_both``), the first prompt carrying ``kv_transfer_params``
  through ``SamplingParams.extra_args``. The connector logs what vLLM hands it.

Then this process checks that both phases generated the same text, that the
request carried its ``kv_transfer_params`` to the scheduler side, and which
of three readings of a CPU KV-cache block holds layer 0's keys and values, by
computing them with transformers from the same model directory. It writes every observation to
one JSON file and exits non-zero when a check fails.
"""

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
PROMPTS = [
    "The capital of France is",
    "Here is a list of the planets of the solar system: Mercury,",
]
MAX_TOKENS = 16
TRANSFER_PARAMS = {"kvblend_probe": "carried", "chunks": [1, 2, 3]}


def engine_env():
    """The environment vLLM needs on this machine, kept where the caller set it."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    # The engine process imports the connector module by name.
    path = os.environ.get("PYTHONPATH", "")
    if str(HERE) not in path.split(os.pathsep):
        os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (str(HERE), path) if p)
    if str(HERE) not in sys.path:
        sys.path.insert(0, str(HERE))


def run_phase(phase, model, result_path, facts_path, dump_path):
    """Start an engine, generate, and write what happened to result_path."""
    engine_env()
    from vllm import LLM, SamplingParams

    kwargs = {}
    if phase == "probe":
        from vllm.config import KVTransferConfig

        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="ProbeConnector",
            kv_connector_module_path="probe_connector",
            kv_role="kv_both",
            kv_connector_extra_config={"facts_path": facts_path, "dump_path": dump_path},
        )
    t0 = time.monotonic()
    llm = LLM(model=model, enforce_eager=True, dtype="float32", max_model_len=4096, seed=0,
              **kwargs)
    start_s = time.monotonic() - t0

    params = [SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
              for _ in PROMPTS]
    if phase == "probe":
        params[0] = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                                   extra_args={"kv_transfer_params": TRANSFER_PARAMS})
    t0 = time.monotonic()
    outs = llm.generate(PROMPTS, params, use_tqdm=False)
    gen_s = time.monotonic() - t0
    result = {
        "phase": phase,
        "engine_start_s": round(start_s, 1),
        "generate_s": round(gen_s, 2),
        "outputs": [{"prompt": o.prompt, "prompt_token_ids": list(o.prompt_token_ids),
                     "text": o.outputs[0].text, "token_ids": list(o.outputs[0].token_ids)}
                    for o in outs],
    }
    with open(result_path, "w") as f:
        json.dump(result, f, indent=1)
    for o in result["outputs"]:
        print(f"[{phase}] {o['prompt']!r} -> {o['text']!r}")
    print(f"[{phase}] engine start {start_s:.1f} s, generation {gen_s:.2f} s")


def reference_layer0(model, prompt_ids):
    """Layer 0's K (post-RoPE) and V [tokens, kv_heads, head_dim] per prompt, by transformers."""
    import torch
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32)
    m.eval()
    refs = []
    with torch.no_grad():
        for ids in prompt_ids:
            out = m(torch.tensor([ids]), use_cache=True)
            cache = out.past_key_values
            if hasattr(cache, "layers"):
                k, v = cache.layers[0].keys, cache.layers[0].values
            else:
                k, v = cache[0]
            refs.append((k[0].transpose(0, 1).contiguous(), v[0].transpose(0, 1).contiguous()))
    return refs


# Where K(s, d) and V(s, d) of slot s, dimension d sit inside one block and head,
# in elements from the start of that head's 2*block_size*head_dim region.
READINGS = {
    # K rows of the block's slots, then its V rows (VLLM-NOTES.md)
    "k_rows_then_v_rows": (lambda s, d, bs, hd: s * hd + d, lambda s, d, bs, hd: (bs + s) * hd + d),
    # K transposed ([head_dim, block_size]), then V rows
    "k_columns_then_v_rows": (lambda s, d, bs, hd: d * bs + s,
                              lambda s, d, bs, hd: (bs + s) * hd + d),
    # K and V side by side in each slot's row, as the [.., block_size, 2*head_dim] view reads
    "k_v_side_by_side": (lambda s, d, bs, hd: s * 2 * hd + d,
                         lambda s, d, bs, hd: s * 2 * hd + hd + d),
}


def read_kv(dump, reading):
    """K and V [tokens, heads, head_dim] of the dumped slots under one reading."""
    import torch

    raw = dump["raw"]  # [blocks, heads, block_size, 2*head_dim]
    nblk, heads, bs, two_hd = raw.shape
    hd = two_hd // 2
    region = raw.reshape(nblk, heads, 2 * bs * hd)
    index_of = {int(b): i for i, b in enumerate(dump["blocks"].tolist())}
    kpos, vpos = READINGS[reading]
    d = torch.arange(hd)
    ks, vs = [], []
    for slot in dump["slot_mapping"].tolist():
        blk, s = index_of[slot // bs], slot % bs
        ks.append(region[blk][:, kpos(s, d, bs, hd)])
        vs.append(region[blk][:, vpos(s, d, bs, hd)])
    return torch.stack(ks), torch.stack(vs)


def check_layout(model, results, dump_path):
    """Which reading of the dumped layer-0 blocks gives transformers' K and V."""
    import torch

    dump = torch.load(dump_path)
    qsl = dump["query_start_loc"].tolist()
    prompt_ids = [o["prompt_token_ids"] for o in results["probe"]["outputs"]]
    refs = reference_layer0(model, prompt_ids)
    found = {"block_size": dump["block_size"], "query_start_loc": qsl,
             "slot_mapping": dump["slot_mapping"].tolist(), "blocks": dump["blocks"].tolist(),
             "max_abs_diff": {}}
    for reading in READINGS:
        k_all, v_all = read_kv(dump, reading)
        worst_k = worst_v = None
        for i in range(len(qsl) - 1):
            a, b = qsl[i], qsl[i + 1]
            # the step's requests are matched to prompts by length (the prompts differ)
            for k_ref, v_ref in refs:
                if k_ref.shape[0] == b - a:
                    dk = (k_all[a:b] - k_ref).abs().max().item()
                    dv = (v_all[a:b] - v_ref).abs().max().item()
                    worst_k = dk if worst_k is None else max(worst_k, dk)
                    worst_v = dv if worst_v is None else max(worst_v, dv)
        found["max_abs_diff"][reading] = {"k": worst_k, "v": worst_v}
    # float32 throughout, but vLLM's kernels (fused qkv GEMM, its RoPE) and
    # transformers' round differently: agreement to 1e-3 against values of
    # order 1-10 separates the right reading from a wrong one, which is off
    # by the values themselves.
    found["matches"] = [r for r, d in found["max_abs_diff"].items()
                        if d["k"] is not None and d["k"] < 1e-3 and d["v"] < 1e-3]
    return found


def summarise_facts(facts_path):
    """The probe's JSON lines, grouped by event."""
    by_event = {}
    with open(facts_path) as f:
        for line in f:
            rec = json.loads(line)
            by_event.setdefault(rec["event"], []).append(rec)
    return by_event


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True, help="HF model directory (.ci/engine-env)")
    ap.add_argument("--out", default=None, help="JSON file for all observations")
    ap.add_argument("--phase", choices=("plain", "probe"), help=argparse.SUPPRESS)
    ap.add_argument("--result", help=argparse.SUPPRESS)
    ap.add_argument("--facts", help=argparse.SUPPRESS)
    ap.add_argument("--dump", help=argparse.SUPPRESS)
    args = ap.parse_args()

    if args.phase:
        run_phase(args.phase, args.model, args.result, args.facts, args.dump)
        return 0

    engine_env()
    work = Path(tempfile.mkdtemp(prefix="kvblend-smoke."))
    facts, dump = work / "probe.jsonl", work / "layer0.pt"
    results = {}
    for phase in ("plain", "probe"):
        result = work / f"{phase}.json"
        t0 = time.monotonic()
        rc = subprocess.call([sys.executable, __file__, "--model", args.model, "--phase", phase,
                              "--result", str(result), "--facts", str(facts),
                              "--dump", str(dump)])
        if rc != 0 or not result.exists():
            print(f"smoke: phase {phase} failed (exit {rc})", file=sys.stderr)
            return 1
        results[phase] = json.loads(result.read_text())
        results[phase]["process_s"] = round(time.monotonic() - t0, 1)

    failures = []
    same = [a["token_ids"] == b["token_ids"]
            for a, b in zip(results["plain"]["outputs"], results["probe"]["outputs"])]
    if not all(same):
        failures.append(f"outputs differ with the probe connector: {same}")
    if any(len(o["token_ids"]) != MAX_TOKENS for p in results.values() for o in p["outputs"]):
        failures.append("a prompt did not get its 16 tokens")

    events = summarise_facts(facts)
    seen = [r["kv_transfer_params"] for r in events.get("get_num_new_matched_tokens", [])]
    if TRANSFER_PARAMS not in seen:
        failures.append(f"kv_transfer_params did not reach the scheduler: {seen}")
    for needed in ("register_kv_caches", "build_connector_meta", "start_load_kv",
                   "save_kv_layer", "wait_for_save"):
        if needed not in events:
            failures.append(f"the probe never saw {needed}")

    layout = check_layout(args.model, results, dump) if dump.exists() else None
    if layout is None:
        failures.append("no layer-0 dump")
    elif len(layout["matches"]) != 1:
        failures.append(f"no single reading of the cache gives layer 0's K and V: "
                        f"{layout['max_abs_diff']}")

    report = {"results": results, "probe": events, "layer0_layout": layout,
              "failures": failures, "work_dir": str(work)}
    out = Path(args.out) if args.out else work / "smoke.json"
    out.write_text(json.dumps(report, indent=1, default=repr))
    print(f"smoke: engine start plain {results['plain']['engine_start_s']} s, "
          f"probe {results['probe']['engine_start_s']} s; report in {out}")
    if layout is not None:
        print(f"smoke: layer-0 K and V found as {layout['matches']}; max |diff| per reading "
              f"{layout['max_abs_diff']}")
    for f in failures:
        print(f"smoke: FAIL {f}", file=sys.stderr)
    print("smoke: " + ("FAILED" if failures else "passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
