"""The connector in bfloat16 inside a real vLLM 0.32 engine (what models run in on GPUs).

Run with the engine venv's python (.ci/engine-env), KVBLEND_LIB set to the build's
libkvblend and KVBLEND_ENGINE_MODEL (or --model) to the model directory.

NumPy has no bfloat16: kvblend holds a bf16 model's KV as its raw 16 bits, and the
connector's copy path, blend pass, stores and store on a miss view them as bfloat16
(kvblend.blend.host). vLLM's CPU build picks its attention ISA by the CPU: bfloat16 on a
CPU with AMX tiles (this machine's) gets the "amx" ISA, whose cache layout (tiles of
token groups) the connector does not know and refuses; on a CPU without AMX (AVX-512
only) it gets "vec", the layout the connector knows. The engine here runs as on such a
CPU: a ``sitecustomize`` in its processes' path answers ``torch.cpu.
_is_amx_tile_supported()`` with False, the one thing vLLM's ISA choice asks; every kernel
still runs for real.

(a) the reference: test_hf_blend's request through kvblend.hf in bfloat16 against a real
    daemon (chunks stored under the connector's model name): blends at r = 1.0 and by the
    anchored default, and their 16-token greedy continuations;
(b) one engine in bfloat16, "vec" ISA (client/python installed with its entry
    point; ``"blend": {}``, the text separator, prefix caching on): the request's prompt
    with its chunk segments, at r = 1.0: the rows read back from vLLM's cache (the
    connector's debug dump, raw bits) equal kvblend.hf's fused KV within bfloat16's
    rounding (TOL_MODULES), and vLLM's continuation equals the plain request's;
(c) the anchored default (r = 0.15): vLLM's cache rows equal kvblend.hf's anchored blend
    within bfloat16's rounding (vLLM's modules against transformers': the same weights in
    bfloat16, other kernels), and the continuation is kvblend.hf's;
(d) a reuse-only load copied from the daemon's reply (the copy path, as on a GPU, forced
    by KVBLEND_VLLM_COPY_FILE): the rows in vLLM's cache are the daemon's GET re-rotated
    bit for bit;
(e) store on a miss: a separator-split request whose two documents are not stored gets
    them stored from its worker's thread; each stored chunk equals store_documents' for
    the same ids within bfloat16's rounding; the request's output equals the plain one's.
Run by pytest (tests/engine/run.sh --pytest, as ctest does); skipped when KVBLEND_SKIP_ENGINE=1.
"""

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from kvbtest import fail, read_cache  # noqa: E402

MAX_TOKENS = 16
NAME = "smollm2-bf16-test"
SEPARATOR = "<|endoftext|>"  # SmolLM2's id 0
ULP = 2.0 ** -8  # bfloat16 keeps 8 bits of mantissa
# vLLM's modules against transformers' in bfloat16: each operation rounds to 8 bits, and
# the two sum in other orders; after 30 layers rows differ by some units in the last
# place of the layer's scale (a wrong row, of another token or mask, by O(1) of it).
TOL_MODULES = 16 * ULP
# A CPU without AMX tiles, as vLLM's attention ISA choice sees it (the module docstring).
NO_AMX = '''import os
if os.environ.get("KVBLEND_TEST_NO_AMX") == "1":
    import torch.cpu
    torch.cpu._is_amx_tile_supported = lambda: False
'''
DOCS = [
    "Glaciers form where more snow falls in winter than melts in summer, and the snow is "
    "pressed into ice that flows slowly downhill under its own weight.",
    "Coral reefs grow in warm, shallow, clear water, built over centuries by colonies of "
    "tiny animals that lay down skeletons of calcium carbonate.",
]


def reference(model_dir, endpoint):
    """(a)."""
    import torch
    import transformers

    import kvblend
    import kvblend.hf as kh
    from kvbtest import build_segments, chunk_segments, store_chunks

    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    model.eval()
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    segs = build_segments(tok)
    with kvblend.Client(endpoint, timeout_ms=120000) as c:
        b = kh.Blender(model, c, name=NAME)
        hashes = store_chunks(b, segs)
        everything = b.blend(segs, (1,), (1.0,))
        everything.tokens = b.generate(segs, MAX_TOKENS, blend=everything)
        anchored = b.blend(segs)
        anchored.tokens = b.generate(segs, MAX_TOKENS, blend=anchored)
        b.close()
    chunks, n = chunk_segments(segs)
    print(f"  (a) kvblend.hf in bfloat16: {n} tokens; the anchored default recomputed "
          f"{anchored.selections[-1].size} rows")
    return everything, anchored, chunks, hashes


def compare(dump, want, n, tol, what):
    """vLLM's cache rows 0..n-1 (raw bits) against kvblend.hf's fused KV (bfloat16)."""
    import numpy as np
    import torch

    got = torch.from_numpy(read_cache(dump, n).view(np.int16)).view(torch.bfloat16).float()
    want = want[:, :, :n].float()
    worst = max(float((got[la, p] - want[la, p]).abs().max() / want[la, p].abs().max())
                for la in range(want.shape[0]) for p in range(2))
    if worst > tol:
        fail(f"{what}: vLLM's cache differs from kvblend.hf's blend by {worst:.2e} of a "
             f"layer's scale (tolerance {tol:.2e})")
    return worst


def test_vllm_bf16(engine_model):
    t0 = time.monotonic()
    from kvbtest import engine_env

    noamx = Path(tempfile.mkdtemp(prefix="kvblend-noamx."))
    (noamx / "sitecustomize.py").write_text(NO_AMX)
    os.environ["KVBLEND_TEST_NO_AMX"] = "1"
    exec(NO_AMX)  # this process too (the engine's scheduler side starts here)
    tmp = engine_env("kvblend-bf16.", first=[noamx])
    dump_dir = tmp / "dump"
    copy_flag = tmp / "copy"
    os.environ["KVBLEND_VLLM_COPY_FILE"] = str(copy_flag)

    from harness import Daemon

    d = Daemon()
    try:
        ref = reference(engine_model, d.endpoint)
        run_engine(engine_model, d.endpoint, ref, dump_dir, copy_flag)
    finally:
        d.stop()
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.rmtree(noamx, ignore_errors=True)
    print(f"test_vllm_bf16: all passed in {time.monotonic() - t0:.0f} s")


def run_engine(model_dir, endpoint, ref, dump_dir, copy_flag):
    """(b) to (e)."""
    import numpy as np
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    import kvblend
    from kvbtest import connector_llm

    everything, anchored, chunks, hashes = ref
    extra = {"endpoint": endpoint, "model_name": NAME, "timeout_ms": 60000, "blend": {},
             "chunk_separator_text": SEPARATOR, "load_cost_check": False}
    llm = connector_llm(model_dir, extra, dtype="bfloat16", max_model_len=4096,
                        enable_prefix_caching=True)
    ids = [int(i) for i in everything.ids]
    n = chunks[-1][0] + chunks[-1][1]  # the claim: up to the end of the last chunk

    def generate(prompt, params, max_tokens=MAX_TOKENS):
        extra = None if params is None else {"kv_transfer_params": {"kvblend": params}}
        sp = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
                            extra_args=extra)
        out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], [sp], use_tqdm=False)[0]
        return list(out.outputs[0].token_ids), (out.kv_transfer_params or {}).get("kvblend", {})

    got, said = generate(ids, {"segments": chunks, "blend": {"ratios": [1.0]}})
    dumps = sorted(dump_dir.glob("load-*.npz"))
    if len(dumps) != 1:
        fail(f"(b) {len(dumps)} load dumps after the r=1.0 blend, expected 1 ({said})")
    worst_r1 = compare(np.load(dumps[0]), everything.kv, n, TOL_MODULES, "(b) r=1.0")
    r1 = got
    got, said = generate(ids, {"segments": chunks})
    dumps = sorted(dump_dir.glob("load-*.npz"))
    worst = compare(np.load(dumps[1]), anchored.kv, n, TOL_MODULES, "(c) anchored")
    same = sum(a == b for a, b in zip(got, anchored.tokens))
    if got[:8] != anchored.tokens[:8]:
        fail(f"(c) anchored: vLLM's continuation {got} against kvblend.hf's {anchored.tokens}")
    print(f"  (c) the anchored default in bfloat16 ({said}): vLLM's cache within {worst:.1e} "
          f"of kvblend.hf's; {same} of {len(got)} greedy tokens equal to kvblend.hf's")

    # (d) the copy path: reuse only, the loads copied from the daemon's GET. vLLM takes a
    # load as the prompt's next tokens after what it has, so the two chunks lead the
    # prompt, in the other order: the first at 0 as stored, the second re-rotated
    (a0, l0, _), (a1, l1, _) = chunks[:2]
    prompt = ids[a1 : a1 + l1] + ids[a0 : a0 + l0] + ids[-12:]
    copy_flag.write_text("")
    _, said = generate(prompt, {"segments": [[0, l1, "chunk"], [l1, l0, "chunk"]],
                                "blend": False})
    copy_flag.unlink()
    dumps = sorted(dump_dir.glob("load-*.npz"))
    if len(dumps) != 3:
        fail(f"(d) no load dump for the reuse-only request ({said})")
    dump = np.load(dumps[2])
    if str(dump["path"]) != "copied":
        fail(f"(d) the load was {dump['path']}, not copied ({said})")
    rows = read_cache(dump, l1 + l0)
    with kvblend.Client(endpoint, timeout_ms=10000) as c:
        for h, start, length in ((hashes[1], 0, l1), (hashes[0], l1, l0)):
            want = c.get_rerotated(NAME, h, pos=start)
            if not np.array_equal(rows[:, :, start : start + length], want):
                fail(f"(d) the chunk at {start} in vLLM's cache is not the daemon's GET "
                     "re-rotated, bit for bit")
    print(f"  (d) copied from the daemon's reply ({said}): 2 chunks in vLLM's cache bit for "
          f"bit the daemon's rows (one as stored, one re-rotated to {l1})")
    # plain last: its blocks, computed by vLLM, would be prefix-cache hits for the above
    plain, _ = generate(ids, {"segments": []})
    if r1 != plain:
        fail(f"(b) r=1.0: vLLM's continuation {r1} != the plain request's {plain}")
    print(f"  (b) r=1.0 in bfloat16: vLLM's cache within {worst_r1:.1e} of kvblend.hf's fused KV; "
          f"{len(r1)} greedy tokens equal to plain vLLM's")
    store_on_miss(llm, endpoint, generate)


def store_on_miss(llm, endpoint, generate):
    """(e)."""
    import numpy as np
    import torch

    import kvblend
    from kvblend.vllm import store_documents

    tok = llm.get_tokenizer()
    enc = lambda t: tok.encode(t, add_special_tokens=False)  # noqa: E731
    sep = enc(SEPARATOR)
    docs = [enc(d) for d in DOCS]
    prompt = (enc("<|im_start|>user\nAnswer from the documents.") + sep
              + [t for d in docs for t in d + sep]
              + enc("What do glaciers carve?<|im_end|>\n<|im_start|>assistant\n"))
    hashes = [kvblend.chunk_hash(d + sep) for d in docs]
    c = kvblend.Client(endpoint, timeout_ms=10000)
    got, said = generate(prompt, None, 32)  # no kvblend key: split by the separator
    deadline = time.monotonic() + 120
    while not all(i.found for i in c.lookup(NAME, hashes)):
        if time.monotonic() > deadline:
            fail(f"(e) the missed chunks were not stored within 120 s ({said})")
        time.sleep(0.5)
    missed = [c.get(NAME, h) for h in hashes]
    plain, _ = generate(prompt, {"segments": []}, 32)
    if got != plain:
        fail(f"(e) the request whose misses were stored: {got}, plain: {plain}")
    for h in hashes:
        c.delete(NAME, h)
    store_documents(llm, [d + sep for d in docs])
    worst = 0.0
    for i, h in enumerate(hashes):
        want = torch.from_numpy(c.get(NAME, h).view(np.int16)).view(torch.bfloat16).float()
        have = torch.from_numpy(missed[i].view(np.int16)).view(torch.bfloat16).float()
        for la in range(want.shape[0]):
            for p in range(2):
                worst = max(worst, float((have[la, p] - want[la, p]).abs().max()
                                         / want[la, p].abs().max()))
    if worst > TOL_MODULES:
        fail(f"(e) a chunk stored on a miss differs from store_documents' by {worst:.2e} of a "
             f"layer's scale")
    c.close()
    print(f"  (e) store on a miss in bfloat16: 2 chunks stored, within {worst:.1e} of "
          "store_documents'; the request's output equals the plain one's")
