"""The connector's RoPE self-test (kvblend.vllm.selftest) against a real kvblendd (ctest
test_vllm_selftest), on vLLM's own rotary modules (``get_rope``), no engine.

(a) It passes for the RoPE kinds kvblend describes, each with the description the
    connector builds (kvblend.vllm.config): plain RoPE (theta 10000 and 1e6), linear and
    llama3 scaling, YaRN, a partial rotary dim, in float32, float16 and bfloat16;
(b) it refuses, naming the layer, a description that is wrong: theta off by 1%, the
    scaling left out, linear scaling's factor wrong, the rotary dim wrong; and a model
    whose last layer alone rotates differently is refused at that layer;
(c) it leaves nothing stored: the test chunk is deleted;
(d) the worker's gate (WorkerSide._self_test, as run before a load when the daemon was
    down at start): a wrong description fails once against the daemon, then every later
    call fails at once without the daemon; a sound one passes once, then asks nothing;
(e) a model-name clash at start (WorkerSide._start_self_test, as register_kv_caches runs
    it): chunks stored under the model's name with rope_theta 1e5 (or 3 KV heads), the
    engine's description says 1e4 (or 2): the start is refused with one line naming the
    model and the differing field, not taken for a daemon outage; the same description
    starts;
(f) the same clash found after a start with the daemon down: the first load turns
    kvblend off for good (one line), later loads fail at once without the daemon, and
    the worker's metadata tells the scheduler, which claims nothing from then on;
(g) the self-test's refusal at start is one line with one ``kvblend:`` prefix;
(h) a model whose local layers rotate with their own base (Gemma 3: 1e4, every third layer
    full at 1e6, each layer its own ``get_rope``): described with both bases, both kinds
    pass; described with one base, or with the full layers placed wrong, it is refused at
    the first layer it misplaces.

Run by pytest (tests/engine/run.sh --pytest, as ctest does); skipped when KVBLEND_SKIP_ENGINE=1.
"""

import logging
import os
from types import SimpleNamespace as Ns

import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

import torch

import kvblend  # noqa: E402
from kvblend.vllm import selftest  # noqa: E402

from harness import Daemon  # noqa: E402
from kvbtest import Checks  # noqa: E402

check = Checks("test_selftest")
HD, HEADS, MAXPOS = 64, 2, 4096
TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


def rope(params, dtype):
    from vllm.model_executor.layers.rotary_embedding import get_rope

    return get_rope(HD, MAXPOS, True, dict(params), TORCH[dtype])


def model(dtype, theta=10000.0, rotary_dim=0, scaling="none"):
    return kvblend.Model("selftest-case", 2, HEADS, HD, dtype=dtype, rope_theta=theta,
                         rotary_dim=rotary_dim, scaling=scaling)


def layers(params, dtype, n=2):
    r = rope(params, dtype)
    return [(f"model.layers.{i}.self_attn.rotary_emb", r) for i in range(n)]


def worker_gate(c, vllm_config):
    """(d) WorkerSide._self_test on a worker made without an engine (the attributes it reads)."""
    from types import SimpleNamespace

    from kvblend.vllm.worker import WorkerSide

    def worker(desc):
        w = WorkerSide.__new__(WorkerSide)
        w.config = SimpleNamespace(model=model("f32", **desc))
        w._vllm_config = vllm_config
        w._rope_bad = None
        w._rope_pending = layers({"rope_theta": 10000.0}, "f32")
        w._tp_rank = 0  # the test's seed (a rank's own under tensor parallelism)
        return w

    w = worker({"theta": 20000.0})
    try:
        w._self_test(c)
        check("(d) a wrong description fails the gate", False, "passed")
    except selftest.SelfTestFailed as e:
        check("(d) a wrong description fails the gate", "layer 0" in str(e), str(e))
    try:
        w._self_test(None)  # no daemon: a call would raise AttributeError
        check("(d) later loads fail at once, without the daemon", False, "passed")
    except selftest.SelfTestFailed as e:
        check("(d) later loads fail at once, without the daemon", "layer 0" in str(e))
    w = worker({})
    try:
        w._self_test(c)
        w._self_test(None)
        check("(d) a sound description passes once, then asks nothing",
              w._rope_pending is None and w._rope_bad is None)
    except (selftest.SelfTestFailed, AttributeError) as e:
        check("(d) a sound description passes once, then asks nothing", False, repr(e))


class Lines(logging.Handler):
    """The lines the connector's logger emits while attached (level, text)."""

    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append((record.levelname, record.getMessage()))

    def __enter__(self):
        from kvblend.vllm.config import logger

        self.level_was = logger.level
        logger.setLevel(logging.DEBUG)
        logger.addHandler(self)
        return self

    def __exit__(self, *exc):
        from kvblend.vllm.config import logger

        logger.removeHandler(self)
        logger.setLevel(self.level_was)


def start_worker(endpoint, vllm_config, m, rope_theta):
    """A WorkerSide as the connector makes it, its model's rotary modules at rope_theta."""
    from kvblend.vllm.config import logger
    from kvblend.vllm.daemon import DaemonLink
    from kvblend.vllm.worker import WorkerSide

    cfg = Ns(model=m, model_name=m.name, block_size=16, timeout_ms=2000, blend=None,
             store_on_miss=False)
    w = WorkerSide(cfg, DaemonLink(endpoint, 2000, m, logger), vllm_config, None)
    rot = layers({"rope_theta": rope_theta}, m.dtype, m.num_layers)
    w._blend_model = Ns(model=Ns(layers=[Ns(self_attn=Ns(rotary_emb=r)) for _, r in rot]))
    return w


def refused_at_start(w):
    """(the Refused's text, the lines logged) of w's start checks; text None: started."""
    from kvblend.vllm.config import Refused

    with Lines() as log:
        try:
            w._start_self_test()
            return None, log.lines
        except Refused as e:
            return str(e), log.lines


def start_checks(d, vllm_config):
    """(e), (f), (g): the worker's start against a real daemon."""
    from kvblend.vllm.metadata import LoadSpec
    from kvblend.vllm.plan import ChunkLoad
    from kvblend.vllm.scheduler import SchedulerSide

    name = "vllm:clash-test:f32"
    stored = kvblend.Model(name, 2, HEADS, HD, dtype="f32", rope_theta=1e5)
    with kvblend.Client(d.endpoint, timeout_ms=10000) as c:
        c.model_register(stored)
    for what, desc, field, values in (
        ("rope_theta", {"rope_theta": 1e4}, "rope_theta", ("100000", "10000")),
        ("the KV heads", {"num_kv_heads": HEADS + 1}, "num_kv_heads", (str(HEADS),
                                                                        str(HEADS + 1))),
    ):
        m = kvblend.Model(name, 2, **{"num_kv_heads": HEADS, "head_dim": HD, "dtype": "f32",
                                      "rope_theta": 1e5, **desc})
        msg, lines = refused_at_start(start_worker(d.endpoint, vllm_config, m, m.rope_theta))
        check(f"(e) a clash on {what}: the start is refused", msg is not None, str(lines))
        msg = msg or ""
        check(f"(e) a clash on {what}: naming the model and {field} (only)",
              f"'{name}'" in msg and field in msg and all(v in msg for v in values)
              and msg.count(" where this engine has ") == 1, msg)
        check(f"(e) a clash on {what}: one line, one prefix, no outage",
              len(lines) == 1 and lines[0][0] == "ERROR"
              and lines[0][1].startswith("kvblend: refusing to start: model ")
              and lines[0][1].count("kvblend:") == 1 and msg.count("kvblend:") == 1
              and "\n" not in lines[0][1], str(lines))
    msg, lines = refused_at_start(start_worker(d.endpoint, vllm_config, stored, 1e5))
    check("(e) the same description starts", msg is None
          and any("self-test passed" in t for _, t in lines), f"{msg} {lines}")

    # (f) down at start: no refusal then; the clash is found by the first load
    m = kvblend.Model(name, 2, HEADS, HD, dtype="f32", rope_theta=1e4)
    w = start_worker("ipc:///nonexistent/kvblend-clash.sock", vllm_config, m, 1e4)
    msg, _ = refused_at_start(w)
    check("(f) the daemon down at start: the start goes on", msg is None, msg)
    from kvblend.vllm.config import logger
    from kvblend.vllm.daemon import DaemonLink

    w.daemon = DaemonLink(d.endpoint, 2000, m, logger)  # the daemon is back
    ld = LoadSpec("r1", [ChunkLoad(b"\1" * 32, 0, 16, 0, 16)], [0], 16)
    with Lines() as log:
        w.start_load_kv(Ns(loads=[ld]))
    off = [t for lv, t in log.lines if lv == "ERROR"]
    check("(f) the first load finds the clash: kvblend off, one line naming the field",
          len(off) == 1 and f"'{name}'" in off[0] and "rope_theta" in off[0]
          and off[0].count("kvblend:") == 1, str(log.lines))
    check("(f) that load fails (vLLM recomputes it)", 0 in w.get_block_ids_with_load_errors())
    meta = w.build_worker_meta()
    check("(f) the worker's metadata tells the scheduler",
          "rope_theta" in (getattr(meta, "off", None) or ""), repr(meta))
    w.daemon = None  # any call from now on would raise AttributeError
    with Lines() as log:
        try:
            w.start_load_kv(Ns(loads=[ld]))
            ok = 0 in w.get_block_ids_with_load_errors()
        except AttributeError as e:
            ok = repr(e)
    check("(f) a later load fails at once, without the daemon", ok is True, str(ok))
    again = w.build_worker_meta()
    check("(f) ... and tells the scheduler once", again is None
          or not getattr(again, "off", None), repr(again))
    side = SchedulerSide(Ns(model=m, model_name=name, block_size=16, load_cost_margin=1.0,
                            load_cost_check=True, blend=None, separator=None,
                            tensor_parallel=1, prefix_caching=True, store_on_miss=False,
                            async_loads=True),
                         None)  # a lookup would raise AttributeError
    side.update_connector_output(Ns(kv_connector_worker_meta=meta))
    req = Ns(request_id="r2", prompt_token_ids=list(range(40)), lora_request=None,
             cache_salt=None, block_hashes=[],
             kv_transfer_params={"kvblend": {"segments": [[0, 32, "chunk"]]}})
    try:
        got = side.get_num_new_matched_tokens(req, 0)
    except AttributeError as e:
        got = repr(e)
    check("(f) the scheduler claims nothing, without a lookup", got == (0, False), str(got))

    # (g) a wrong description refused by the self-test: one line
    m = kvblend.Model("vllm:selftest-refusal:f32", 2, HEADS, HD, dtype="f32",
                      rope_theta=2e4)
    msg, lines = refused_at_start(start_worker(d.endpoint, vllm_config, m, 1e4))
    check("(g) the self-test refuses the start", msg is not None, str(lines))
    check("(g) in one line with one prefix",
          len(lines) == 1 and lines[0][1].startswith(
              "kvblend: refusing to start: RoPE self-test failed at layer 0")
          and (msg or "").startswith("kvblend: RoPE self-test failed")
          and (msg or "").count("kvblend:") == 1, f"{msg!r} {lines}")


def test_selftest():
    from vllm.config import VllmConfig, set_current_vllm_config

    d = Daemon()
    try:
        # vLLM's custom ops read the current config
        with set_current_vllm_config(VllmConfig()), \
                kvblend.Client(d.endpoint, timeout_ms=10000) as c:
            good = [
                ("plain RoPE", {"rope_theta": 10000.0}, {}),
                ("theta 1e6", {"rope_theta": 1e6}, {"theta": 1e6}),
                ("linear x4", {"rope_theta": 10000.0, "rope_type": "linear", "factor": 4.0},
                 {"scaling": "linear:4.0"}),
                ("llama3", {"rope_theta": 500000.0, **LLAMA3},
                 {"theta": 500000.0, "scaling": "llama3:8.0,1.0,4.0,512"}),
                ("YaRN x4", {"rope_theta": 10000.0, **YARN}, {"scaling": "yarn:4.0,1024,32,1"}),
                ("partial rotary 0.5", {"rope_theta": 10000.0, "partial_rotary_factor": 0.5},
                 {"rotary_dim": HD // 2}),
            ]
            for dtype in ("f32", "f16", "bf16"):
                for what, params, desc in good:
                    try:
                        line = selftest.run(c, model(dtype, **desc), layers(params, dtype))
                        check(f"(a) {what}, {dtype}: passes", "passed" in line, line)
                    except (selftest.SelfTestFailed, kvblend.KvblendError) as e:
                        check(f"(a) {what}, {dtype}: passes", False, str(e))
            bad = [
                ("theta off by 1%", {"rope_theta": 10000.0}, {"theta": 10100.0}),
                ("llama3 scaling left out", {"rope_theta": 500000.0, **LLAMA3},
                 {"theta": 500000.0}),
                ("linear factor 2 for 4",
                 {"rope_theta": 10000.0, "rope_type": "linear", "factor": 4.0},
                 {"scaling": "linear:2.0"}),
                ("rotary dim all for half",
                 {"rope_theta": 10000.0, "partial_rotary_factor": 0.5}, {}),
            ]
            for dtype in ("f32", "bf16"):
                for what, params, desc in bad:
                    try:
                        selftest.run(c, model(dtype, **desc), layers(params, dtype))
                        check(f"(b) {what}, {dtype}: refused", False, "passed")
                    except selftest.SelfTestFailed as e:
                        check(f"(b) {what}, {dtype}: refused, naming layer 0",
                              "layer 0 (model.layers.0.self_attn.rotary_emb)" in str(e), str(e))
            mixed = layers({"rope_theta": 10000.0}, "f32", 3)
            mixed[2] = (mixed[2][0], rope({"rope_theta": 20000.0}, "f32"))
            try:
                selftest.run(c, model("f32"), mixed)
                check("(b) one layer rotating differently: refused", False, "passed")
            except selftest.SelfTestFailed as e:
                check("(b) one layer rotating differently: refused at that layer",
                      "at layer 2 " in str(e), str(e))
            # (h) Gemma 3's two bases: local layers 1e4, every third layer full at 1e6
            local, full = rope({"rope_theta": 1e4}, "f32"), rope({"rope_theta": 1e6}, "f32")
            gemma = [(f"model.layers.{i}.self_attn.rotary_emb", full if i % 3 == 2 else local)
                     for i in range(6)]
            two = kvblend.Model("selftest-case", 2, HEADS, HD, dtype="f32", rope_theta=1e6,
                                rope_local_theta=1e4, full_every=3)
            try:
                line = selftest.run(c, two, gemma)
                check("(h) local layers with their own base: both kinds pass",
                      "passed: 6 layers" in line, line)
            except (selftest.SelfTestFailed, kvblend.KvblendError) as e:
                check("(h) local layers with their own base: both kinds pass", False, str(e))
            for what, desc, at in (
                    ("described with one base", {"rope_theta": 1e6}, "at layer 0 "),
                    ("with the full layers placed wrong", {"rope_theta": 1e6, "rope_local_theta": 1e4,
                                                  "full_every": 2}, "at layer 1 ")):
                try:
                    selftest.run(c, kvblend.Model("selftest-case", 2, HEADS, HD, dtype="f32",
                                                  **desc), gemma)
                    check(f"(h) local layers {what}: refused", False, "passed")
                except selftest.SelfTestFailed as e:
                    check(f"(h) local layers {what}: refused at the first layer it misplaces",
                          at in str(e), str(e))
            worker_gate(c, VllmConfig())
            start_checks(d, VllmConfig())
            left = [m.name for m in c.model_list() if m.name.startswith("kvblend-selftest-")]
            held = sum(len(c.list(n)) for n in left)
            check("(c) nothing stored afterwards", held == 0 and len(left) > 0,
                  f"{held} chunks under {len(left)} test models")
    finally:
        d.stop()
    check.done()
