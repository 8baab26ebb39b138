"""The connector's link to kvblendd when the daemon dies, against a real kvblendd (no engine).

kvblend.vllm.daemon.DaemonLink, the circuit breaker every connector call goes through:
a daemon killed with SIGKILL costs the first call one timeout, then every call fails at
once (no wait) during the back-off, a retry probes the socket and fails at once while
the daemon is gone, one log line opens the outage and one closes it when a restarted
daemon on the same socket answers again. A daemon that accepts but does not answer
(stopped with SIGSTOP): the scheduler side's lookup waits at most its lookup_timeout_ms
(0.3 s here), then requests wait for nothing during the back-off, and the link closes
once the daemon runs again. kvblend.vllm.daemon.wait_layer: a landing wait
on a layer the daemon will not land (it waits for a check plane) ends within about one
probe slice when the daemon is killed, not after its timeout. And the planner's
``first_inexact`` (the position from which the scheduler fences blocks out of vLLM's
prefix cache) and a blend over a prefix vLLM already holds. The link's close after a failure
(an open session and a region) takes well under one timeout. The scheduler side with no
daemon: requests without kvblend parameters never wait, those with them wait one timeout
once and then none. The scheduler side's prefix-cache fence with vLLM 0.34's 64-token
blocks (and 16, 128, 48; a hash block of 16 under a block of 64): the hashes of the block
holding the first inexact position and after are replaced, the ones before kept, put back
when the plan changes before the blocks were computed, and kept when a resumed request
gets its own fenced blocks back from the prefix cache. A request whose external tokens
vLLM will not read (0.34's ``skip_reading_external_kv``, 0.32's
``skip_reading_prefix_cache``: prompt logprobs) is neither looked up nor fenced, claims
nothing and still stores when it asks to, with one info line per engine.

Run by pytest (tests/engine/run.sh --pytest, as ctest does); skipped when KVBLEND_SKIP_ENGINE=1.
"""

import logging
import os
import signal
import time

import numpy as np
import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

import kvblend  # noqa: E402
from harness import Daemon  # noqa: E402
from kvbtest import Checks, LogLines  # noqa: E402
from kvblend.vllm import plan  # noqa: E402
from kvblend.vllm.daemon import DaemonDown, DaemonLink, probe, wait_layer  # noqa: E402

MODEL = kvblend.Model("link-test", 4, 1, 8, dtype="f32", rope_theta=1e5)
check = Checks("test_daemon_link")


def timed(fn):
    t0 = time.monotonic()
    try:
        fn()
        err = None
    except (kvblend.KvblendError, TimeoutError) as e:
        err = e
    return time.monotonic() - t0, err


def breaker(d):
    log = logging.getLogger("test-link")
    lines = LogLines()
    log.addHandler(lines)
    log.propagate = False
    link = DaemonLink(d.endpoint, 2000, MODEL, log)
    h = kvblend.chunk_hash([1, 2, 3])
    link.client().lookup(MODEL.name, [h])
    link.ok()
    check("a live daemon: no log line", lines.lines == [], str(lines.lines))
    check("probe of a live daemon", probe(d.endpoint, 1.0) is None)

    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    check("probe of a killed daemon fails", probe(d.endpoint, 1.0) is not None,
          str(probe(d.endpoint, 1.0)))
    secs, err = timed(lambda: link.client().lookup(MODEL.name, [h]))
    check("the first call after the kill fails within the timeout", err is not None
          and secs < 3.0, f"{secs:.2f} s, {err!r}")
    link.failed(err)
    check("the link opens with one log line", len(lines.lines) == 1 and link.is_open,
          str(lines.lines))
    secs, err = timed(link.client)
    check("during the back-off a call fails at once", isinstance(err, DaemonDown)
          and secs < 0.05, f"{secs * 1000:.1f} ms")
    time.sleep(1.1)
    secs, err = timed(link.client)
    check("after it, a probe fails at once while the daemon is gone",
          isinstance(err, DaemonDown) and secs < 0.5, f"{secs * 1000:.1f} ms, {err}")
    worst = 0.0
    for _ in range(200):  # the scheduler asking for 200 requests during the outage
        s, err = timed(link.client)
        worst = max(worst, s)
    check("200 calls during the outage wait at most 50 ms each", worst < 0.05,
          f"worst {worst * 1000:.2f} ms")
    check("still one log line", len(lines.lines) == 1, str(lines.lines))

    # a daemon restarted on the same socket: the next retry (2 s back-off) reconnects
    d.start(wait=False)  # (its log appended to the first run's)
    deadline, back = time.monotonic() + 15, None
    while time.monotonic() < deadline:
        try:
            link.client().lookup(MODEL.name, [h])
            link.ok()
            back = time.monotonic()
            break
        except kvblend.KvblendError as e:
            link.failed(e)
            time.sleep(0.1)
    check("a restarted daemon is used again", back is not None and not link.is_open)
    check("one log line closes the outage", len(lines.lines) == 2
          and "answers again" in lines.lines[-1], str(lines.lines[-1:]))


class NeverLands:
    """A landing session whose next layer never lands.

    The daemon lands a real session's layers as soon as it is opened (microseconds for a
    test chunk), so a kill cannot be timed to fall before a layer; this stands in for
    the session's futex wait, timing out as kvb_fuse_wait does. The daemon, its kill
    and the probe that ends the wait are real.
    """

    def wait(self, layer, timeout):
        time.sleep(timeout)
        raise TimeoutError(f"layer {layer} not landed within {timeout * 1000:.0f} ms")


def landing_wait(d):
    """A landing wait and the connection's close when the daemon is killed under them."""
    link = DaemonLink(d.endpoint, 5000, MODEL, logging.getLogger("test-link"))
    c = link.client()
    n = 16
    kv = np.random.default_rng(1).standard_normal(MODEL.kv_shape(n)).astype(np.float32)
    h = kvblend.chunk_hash(list(range(n)))
    c.put(MODEL.name, h, kv, base_pos=0)
    shape = MODEL.kv_shape(n + 4)
    nbytes = int(np.prod(shape)) * 4
    region = c.region(nbytes)
    buf = region[:nbytes].view(np.float32).reshape(shape)
    sess = c.fuse_open_into(MODEL.name, [(h, 0), (4, n)], buf[:, 0], buf[:, 1], [1], [0.5])
    wait_layer(sess, 0, 2.0, d.endpoint)  # a live daemon: lands at once
    secs, err = timed(lambda: wait_layer(NeverLands(), 1, 0.6, d.endpoint))
    check("a live daemon: a layer that does not land times out after its timeout",
          0.55 < secs < 1.5 and type(err) is TimeoutError, f"{secs:.2f} s, {err!r}")
    d.proc.send_signal(signal.SIGKILL)
    d.proc.wait()
    t0 = time.monotonic()
    try:
        wait_layer(NeverLands(), 2, 10.0, d.endpoint)
        err = None
    except (kvblend.KvblendError, TimeoutError) as e:
        err = e
    secs = time.monotonic() - t0
    check("a landing wait ends soon after the daemon is killed (timeout 10 s)",
          isinstance(err, kvblend.errors.Unavailable) and secs < 1.0, f"{secs:.2f} s, {err!r}")
    # the link closes the connection, its open session and its region (timeout 5 s each)
    secs, _ = timed(lambda: link.failed(err))
    check("closing the connection after the failure takes under 1.5 s", secs < 1.5,
          f"{secs:.2f} s")


def first_inexact():
    cfg = plan.DEFAULT_CONFIG
    ld = plan.ChunkLoad
    p = plan.Plan(10, [ld(b"a", 0, 10, 0, 10)])
    check("a chunk at position 0 is exact", p.first_inexact is None)
    p = plan.Plan(20, [ld(b"a", 0, 10, 0, 10), ld(b"b", 10, 10, 10, 20)])
    check("the second chunk is the first inexact position", p.first_inexact == 10)
    p = plan.Plan(15, [ld(b"b", 5, 10, 5, 15)])
    check("a chunk after a prefix vLLM has", p.first_inexact == 5)
    b = plan.BlendLoad(list(range(30)), [(4, 0), (b"a", 4), (b"b", 14)], cfg, [], 0)
    check("a blend: its first chunk's position", plan.Plan(28, [], b).first_inexact == 4)
    check("nothing loaded", plan.Plan(0).first_inexact is None)


def blend_after_prefix(d):
    """A blend planned for a request whose first 8 tokens are prefix-cache hits."""
    c = kvblend.Client(d.endpoint, timeout_ms=5000)
    c.model_register(MODEL)
    prompt = list(range(100, 140))
    doc = prompt[10:30]
    kv = np.zeros(MODEL.kv_shape(len(doc)), np.float32)
    c.put(MODEL.name, kvblend.chunk_hash(doc), kv, base_pos=0)
    kvp = {"kvblend": {"segments": [[10, 20, "chunk"]]}}
    p = plan.plan_request(c, MODEL.name, 4, kvp, prompt, 8, None, plan.DEFAULT_CONFIG)
    check("a blend after 8 computed tokens claims up to the chunk's end",
          p.blend is not None and p.tokens == 22 and p.blend.skip == 8
          and p.blend.ids == prompt[:30], f"tokens {p.tokens}")
    p = plan.plan_request(c, MODEL.name, 4, kvp, prompt, 32, None, plan.DEFAULT_CONFIG)
    check("vLLM has everything up to the chunk's end: no blend, no claim",
          p.blend is None and p.tokens == 0, f"tokens {p.tokens}")
    c.close()


class Request:
    """The attributes of vLLM's Request that the scheduler side reads (no engine here)."""

    def __init__(self, rid, ids, kv_transfer_params=None, hash_block=None):
        self.request_id = rid
        self.prompt_token_ids = ids
        self.kv_transfer_params = kv_transfer_params
        # one 32-byte hash per full hash block, as vLLM chains them (their values do not
        # matter here: only which are replaced)
        self.block_hashes = [] if hash_block is None else [
            bytes([i]) * 32 for i in range(len(ids) // hash_block)]
        self.cache_salt = None
        self.lora_request = None


class Blocks:
    """vLLM's KVCacheBlocks as update_state_after_alloc reads them."""

    def __init__(self, ids):
        self.ids = ids

    def get_block_ids(self):
        return (self.ids,)


class HashBlocks:
    """vLLM's KVCacheConfig as the fence reads it (its hash_block_size)."""

    def __init__(self, n):
        self.hash_block_size = n


def fences(d):
    """The fence with 64-token blocks (vLLM 0.34's default) and others, against kvblendd."""
    from kvblend.vllm.config import ConnectorConfig
    from kvblend.vllm.scheduler import SchedulerSide

    c = kvblend.Client(d.endpoint, timeout_ms=5000)
    c.model_register(MODEL)
    rng = np.random.default_rng(5)
    prompt = [int(x) for x in rng.integers(100, 30000, 400)]

    def put(ids):
        c.put(MODEL.name, kvblend.chunk_hash(ids), np.zeros(MODEL.kv_shape(len(ids)), np.float32))

    # (a chunk's start, the block size, the hash block size): the first fenced hash
    cases = [(70, 64, 64, 1), (64, 64, 64, 1), (63, 64, 64, 0), (130, 64, 64, 2),
             (70, 64, 16, 4), (70, 16, 16, 4), (200, 128, 128, 1), (100, 48, 48, 2)]
    for start, bs, hbs, first in cases:
        doc = prompt[start : start + 120]
        put(doc)
        cfg = ConnectorConfig(d.endpoint, 5000, MODEL.name, None, MODEL, bs, None,
                              prefix_caching=True)
        side = SchedulerSide(cfg, DaemonLink(d.endpoint, 5000, None, logging.getLogger("f")),
                             HashBlocks(hbs))
        kvp = {"kvblend": {"segments": [[start, 120, "chunk"]]}}
        req = Request(f"f-{start}-{bs}-{hbs}", prompt, kvp, hbs)
        orig = list(req.block_hashes)
        got = side.get_num_new_matched_tokens(req, start)  # vLLM computed the prefix
        kept = req.block_hashes[:first] == orig[:first]
        changed = all(a != b for a, b in zip(req.block_hashes[first:], orig[first:]))
        check(f"fence: a chunk at {start}, blocks of {bs}, hashes of {hbs}: hashes from "
              f"{first} on replaced, the {first} before kept",
              got == (120, False) and kept and changed
              and len(req.block_hashes) == len(orig), f"claim {got}")
        fenced = list(req.block_hashes)
        # resumed after a preemption: vLLM's prefix cache gave the request back its own
        # blocks past the fence (found under the fenced hashes), whose KV is the load's
        got = side.get_num_new_matched_tokens(req, (first + 1) * hbs)
        check(f"fence: blocks of {bs}: resumed on its own fenced blocks, the fence stays",
              req.block_hashes == fenced, f"claim {got}")
        side.get_num_new_matched_tokens(req, 0)  # asked again, no prefix hit: no load
        check(f"fence: blocks of {bs}: a later plan without a load puts the hashes back",
              req.block_hashes == orig)
        side.request_finished(req, [])
    c.close()


def skipped_external(d):
    """A request whose external tokens vLLM drops: no lookup, no fence, no claim, a store."""
    from kvblend.vllm.config import ConnectorConfig
    from kvblend.vllm.scheduler import SchedulerSide

    c = kvblend.Client(d.endpoint, timeout_ms=5000)
    c.model_register(MODEL)
    prompt = list(range(1000, 1256))
    doc = prompt[70:190]
    c.put(MODEL.name, kvblend.chunk_hash(doc), np.zeros(MODEL.kv_shape(len(doc)), np.float32))
    cfg = ConnectorConfig(d.endpoint, 5000, MODEL.name, None, MODEL, 64, None,
                          prefix_caching=True)
    log = logging.getLogger("vllm.kvblend.vllm")
    lines = LogLines()
    log.addHandler(lines)
    log.setLevel(logging.INFO)
    side = SchedulerSide(cfg, DaemonLink(d.endpoint, 5000, None, log), HashBlocks(64))
    kvp = {"kvblend": {"segments": [[70, 120, "chunk"]]}}
    calls = []
    client = side.daemon.client
    side.daemon.client = lambda: calls.append(1) or client()  # each lookup asks for it
    try:
        for attr in ("skip_reading_external_kv", "skip_reading_prefix_cache"):
            for i in range(2):
                req = Request(f"lp-{attr}-{i}", prompt, kvp, 64)
                setattr(req, attr, True)  # 0.32 and 0.33 have only skip_reading_prefix_cache
                orig = list(req.block_hashes)
                got = side.get_num_new_matched_tokens(req, 64)
                side.update_state_after_alloc(req, Blocks([3, 4, 5, 6]), 0)
                check(f"{attr} (prompt logprobs): not looked up, nothing claimed or fenced",
                      got == (0, False) and req.block_hashes == orig and not calls,
                      f"{got}, {len(calls)} lookups")
                side.request_finished(req, [])
        meta = side.build_connector_meta(Output())
        check("prompt logprobs: nothing loaded, no missed chunk queued",
              not meta.loads and not meta.misses)
        said = [m for m in lines.lines if "reads no external KV" in m]
        check("prompt logprobs: one info line for the engine", len(said) == 1, str(said))
        # asks to store its prompt: computed in full, stored all the same
        store = Request("lp-store", prompt, {"kvblend": {"segments": [[0, len(prompt), "chunk"]],
                                                     "store": True}}, 64)
        store.skip_reading_external_kv = True
        side.get_num_new_matched_tokens(store, 0)
        side.update_state_after_alloc(store, Blocks(list(range(4))), 0)
        check("prompt logprobs with store: the prompt is still stored",
              "lp-store" in side._stores and side._stores["lp-store"].length == len(prompt))
        # the same request without the attribute: looked up, claimed and fenced
        req = Request("lp-none", prompt, kvp, 64)
        orig = list(req.block_hashes)
        got = side.get_num_new_matched_tokens(req, 70)
        check("the same request reading external KV: looked up, claimed and fenced",
              got == (120, False) and req.block_hashes[:1] == orig[:1] and len(calls) == 1
              and all(a != b for a, b in zip(req.block_hashes[1:], orig[1:])), str(got))
    finally:
        log.removeHandler(lines)
    c.close()


class Output:
    """vLLM's SchedulerOutput as build_connector_meta reads it (nothing scheduled)."""

    total_num_scheduled_tokens = 0
    new_block_ids_to_zero = None
    num_scheduled_tokens = {}
    scheduled_new_reqs = []

    class scheduled_cached_reqs:  # noqa: N801 - an attribute holder
        req_ids = []
        new_block_ids = []
        resumed_req_ids = set()
        num_computed_tokens = []


def scheduler_outage():
    """The scheduler side with no daemon at its endpoint: a request without kvblend
    parameters or separator never waits; one with them waits one timeout once, then none."""
    from kvblend.vllm.config import ConnectorConfig
    from kvblend.vllm.scheduler import SchedulerSide

    endpoint = "tcp://127.0.0.1:9"  # the discard port: nothing listens, the connect fails
    cfg = ConnectorConfig(endpoint, 1500, MODEL.name, (50001,), MODEL, 16, None)
    log = logging.getLogger("test-link-sched")
    lines = LogLines()
    log.addHandler(lines)
    log.propagate = False
    side = SchedulerSide(cfg, DaemonLink(endpoint, 1500, None, log))
    ids = list(range(100, 160))
    worst = 0.0
    for i in range(100):
        t0 = time.monotonic()
        got = side.get_num_new_matched_tokens(Request(f"plain-{i}", ids), 0)
        worst = max(worst, time.monotonic() - t0)
    check("100 plain requests with the daemon down: none waits (and nothing claimed)",
          worst < 0.05 and got == (0, False) and not lines.lines,
          f"worst {worst * 1000:.2f} ms, {lines.lines}")
    sep_ids = [1, 2, 50001, 3, 4, 50001, 5, 6, 50001, 7]
    kvp = {"kvblend": {"segments": [[0, 30, "chunk"]]}}
    secs, _ = timed(lambda: side.get_num_new_matched_tokens(Request("kvb-0", ids, kvp), 0))
    check("the first kvblend request waits at most about one timeout (1.5 s)",
          secs < 2.5 and len(lines.lines) == 1, f"{secs:.2f} s, {lines.lines}")
    worst = 0.0
    for i in range(100):
        req = Request(f"kvb-{i + 1}", sep_ids) if i % 2 else Request(f"kvb-{i + 1}", ids, kvp)
        t0 = time.monotonic()
        got = side.get_num_new_matched_tokens(req, 0)
        worst = max(worst, time.monotonic() - t0)
    check("100 more kvblend requests (segments, separators) during the outage: none waits",
          worst < 0.05 and got == (0, False) and len(lines.lines) == 1,
          f"worst {worst * 1000:.2f} ms")


def scheduler_stopped_daemon(d):
    """The scheduler side against a daemon that accepts connections but does not answer
    (SIGSTOP): one lookup waits its lookup deadline, the next requests none, and the link
    closes when the daemon answers again."""
    from kvblend.vllm.config import ConnectorConfig
    from kvblend.vllm.scheduler import SchedulerSide

    cfg = ConnectorConfig(d.endpoint, 5000, MODEL.name, None, MODEL, 16, None,
                          lookup_timeout_ms=300)
    log = logging.getLogger("test-link-stopped")
    lines = LogLines()
    log.addHandler(lines)
    log.propagate = False
    # the connector gives the scheduler's link lookup_timeout_ms (connector.py)
    side = SchedulerSide(cfg, DaemonLink(d.endpoint, cfg.lookup_timeout_ms, None, log))
    ids = list(range(100, 160))
    kvp = {"kvblend": {"segments": [[0, 30, "chunk"]]}}
    secs, _ = timed(lambda: side.get_num_new_matched_tokens(Request("live", ids, kvp), 0))
    check("a lookup of a live daemon", secs < 0.3 and not side.daemon.is_open,
          f"{secs * 1000:.1f} ms")
    d.proc.send_signal(signal.SIGSTOP)
    try:
        secs, _ = timed(lambda: side.get_num_new_matched_tokens(Request("s-0", ids, kvp), 0))
        check("a stopped daemon: the lookup waits about lookup_timeout_ms (0.3 s), not "
              "timeout_ms (5 s)", 0.25 < secs < 1.5 and side.daemon.is_open
              and len(lines.lines) == 1, f"{secs:.2f} s, {lines.lines}")
        worst = 0.0
        for i in range(50):
            t0 = time.monotonic()
            got = side.get_num_new_matched_tokens(Request(f"s-{i + 1}", ids, kvp), 0)
            worst = max(worst, time.monotonic() - t0)
        check("50 requests during the back-off wait for nothing and claim nothing",
              worst < 0.05 and got == (0, False), f"worst {worst * 1000:.2f} ms, {got}")
    finally:
        d.proc.send_signal(signal.SIGCONT)
    deadline, back = time.monotonic() + 15, False
    while time.monotonic() < deadline and not back:
        side.get_num_new_matched_tokens(Request("again", ids, kvp), 0)
        back = not side.daemon.is_open
        time.sleep(0.1)
    check("the daemon running again: the link closes, one line says so", back
          and len(lines.lines) == 2 and "answers again" in lines.lines[-1],
          str(lines.lines))


def test_daemon_link():
    first_inexact()
    scheduler_outage()
    d = Daemon()
    try:
        fences(d)
        skipped_external(d)
        blend_after_prefix(d)
        scheduler_stopped_daemon(d)
        breaker(d)
    finally:
        d.stop()
    d = Daemon()
    try:
        landing_wait(d)
    finally:
        d.stop()
    check.done()
