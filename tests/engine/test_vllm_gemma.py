"""CacheBlend inside vLLM on the real Gemma-3-270M (float32), against kvblend.hf, in one engine.

Run with the engine venv's python (tests/engine/run.sh --pytest, as ctest does);
KVBLEND_GEMMA_MODEL names the model directory (default /var/cache/kvblend/models/gemma-3-270m,
which .ci/engine-env builds with tests/engine/make_gemma_model.py; without it the test is
skipped). The prompt is test_hf_gemma's long one: five stored chunks and fresh separators,
about 700 tokens, past the 512-token sliding window of Gemma 3's local layers, so the pass's
window (vLLM's own CPU kernel, told each layer's window) decides what the recomputed rows of
the later chunks read.

(a) kvblend.hf: the prompt blended at layer 1, r = 0.15 (value metric), and its 16 greedy
    tokens (test_hf_gemma checks kvblend.hf itself against transformers);
(b) one engine (KvblendConnector with blend at layer 1, r = 0.15; prefix caching off): the
    connector starts (its RoPE self-test passes over both kinds of layers, or the engine
    would not start), the same request's rows read back from vLLM's cache equal kvblend.hf's
    fused KV within TOL of each layer's scale, and vLLM's greedy tokens equal kvblend.hf's;
(c) the same engine: the request at r = 1.0 (every token recomputed from layer 1) gives the
    greedy tokens of a plain request of the same prompt (no kvblend segments); and
    exact-prefix reuse (blend off; the prompt's head, <bos> and the instruction, stored as
    a chunk: vLLM's scheduler takes only a prefix of loaded tokens) gives the plain
    request's tokens, its rows in vLLM's cache the stored chunk's bit for bit (GET).
Skipped when KVBLEND_SKIP_ENGINE=1.
"""

import gc
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

from kvbtest import fail, worst_dev  # noqa: E402

HERE = Path(__file__).resolve().parent
MODEL = os.environ.get("KVBLEND_GEMMA_MODEL", "/var/cache/kvblend/models/gemma-3-270m")
MAX_TOKENS = 16
CHECKS, RATIOS = (1,), (0.15,)
# vLLM's modules against transformers' on the same float32 weights (test_vllm_arch's TOL)
TOL = 1e-4


def reference(endpoint, name):
    """(a): the prompt, kvblend.hf's blend of it and its greedy tokens."""
    import numpy as np
    import torch
    import transformers

    import kvblend
    import kvblend.hf as kh
    from kvbtest import chunk_segments, store_chunks
    from test_hf_gemma import ids_of, prompts

    model = transformers.AutoModelForCausalLM.from_pretrained(MODEL, dtype=torch.float32)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(MODEL)
    segs, _ = prompts(tok)
    with kvblend.Client(endpoint, timeout_ms=120000) as c:
        b = kh.Blender(model, c, name=name)
        store_chunks(b, segs)
        b.store(segs[0][1])  # the head, for (c)'s exact-prefix reuse
        ref = b.blend(segs, CHECKS, RATIOS)
        tokens = b.generate(segs, MAX_TOKENS, blend=ref)
        b.close()
    chunks, n = chunk_segments(segs)
    ids = ids_of(segs)
    print(f"  (a) kvblend.hf: {n} tokens, {ref.selections[0].size} rows recomputed after "
          f"layer {CHECKS[0]}; continuation {tok.decode(tokens)!r}")
    del model
    gc.collect()
    return ids, chunks, np.asarray(ref.kv.numpy()), tokens, len(segs[0][1])


def one_dump(dump_dir, what):
    """The one load dump of the request just run (then removed)."""
    import numpy as np

    dumps = sorted(dump_dir.glob("load-*.npz"))
    if len(dumps) != 1:
        fail(f"{what}: {len(dumps)} load dumps, expected one")
    d = dict(np.load(dumps[0]))
    dumps[0].unlink()
    return d


def test_vllm_gemma(tmp_path):
    if not os.path.isfile(os.path.join(MODEL, "config.json")):
        pytest.skip(f"no Gemma 3 model at {MODEL} (tests/engine/make_gemma_model.py writes it)")
    t0 = time.monotonic()
    sys.path.insert(0, str(HERE))
    from kvbtest import engine_env

    tmp = engine_env("kvblend-gemma.")
    dump_dir = tmp / "dump"
    from harness import Daemon

    import kvblend

    d = Daemon("--fuse-idle", "600")
    name = "gemma-test"
    try:
        ids, chunks, ref_kv, tokens, head = reference(d.endpoint, name)
        from kvbtest import connector_llm, read_cache
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        extra = {"endpoint": d.endpoint, "model_name": name, "timeout_ms": 60000,
                 "blend": {"check_layers": list(CHECKS), "ratios": list(RATIOS)},
                 "load_cost_check": False}
        t1 = time.monotonic()
        llm = connector_llm(MODEL, extra, max_model_len=1024, enable_prefix_caching=False)
        t2 = time.monotonic()
        prompt = [TokensPrompt(prompt_token_ids=[int(i) for i in ids])]

        def gen(params):
            sp = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS,
                                extra_args={"kv_transfer_params": params} if params else None)
            out = llm.generate(prompt, [sp], use_tqdm=False)
            return list(out[0].outputs[0].token_ids)

        # (b) the default request: blend at layer 1, r = 0.15
        got = gen({"kvblend": {"segments": chunks}})
        n = chunks[-1][0] + chunks[-1][1]
        dev = worst_dev(read_cache(one_dump(dump_dir, "(b)"), n), ref_kv[:, :, :n])
        if dev > TOL:
            fail(f"(b) vLLM's cache differs from kvblend.hf's blend by {dev:.2e} of a layer's "
                 f"scale (tolerance {TOL:g})")
        if got != tokens:
            fail(f"(b) vLLM's continuation {got} != kvblend.hf's {tokens}")
        print(f"  (b) vLLM's cache after the blend: {n} rows within {dev:.1e} of kvblend.hf's "
              f"fused KV; {len(got)} greedy tokens equal (engine start {t2 - t1:.0f} s)")

        # (c) r = 1.0 against a plain request; full reuse against GET re-rotated
        plain = gen(None)
        every = gen({"kvblend": {"segments": chunks, "blend": {"ratios": [1.0]}}})
        one_dump(dump_dir, "(c) r = 1.0")
        if every != plain:
            fail(f"(c) r = 1.0 gives {every}, a plain request {plain}")
        reuse = gen({"kvblend": {"segments": [[0, head, "chunk"]], "blend": False}})
        cache = read_cache(one_dump(dump_dir, "(c) exact-prefix reuse"), head)
        with kvblend.Client(d.endpoint, timeout_ms=60000) as c:
            stored = c.get(name, kvblend.chunk_hash(ids[:head]))
        if not (cache == stored).all():
            fail("(c) exact-prefix reuse: vLLM's cache rows differ from the stored chunk")
        if reuse != plain:
            fail(f"(c) exact-prefix reuse gives {reuse}, a plain request {plain}")
        print(f"  (c) r = 1.0: {len(every)} tokens equal a plain request's; exact-prefix reuse "
              f"of the {head}-token head: the stored rows in vLLM's cache bit for bit, "
              f"{len(reuse)} tokens equal the plain request's")
        del llm
        gc.collect()
    finally:
        d.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    print(f"test_vllm_gemma: all passed in {time.monotonic() - t0:.0f} s")
