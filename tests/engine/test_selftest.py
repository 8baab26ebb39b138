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
    call fails at once without the daemon; a sound one passes once, then asks nothing.

Exit 0 when every check passes, 1 on a failure, 77 when KVBLEND_SKIP_ENGINE=1.
"""

import os
import sys

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    print("test_selftest: skipped (KVBLEND_SKIP_ENGINE=1)")
    sys.exit(77)

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import kvblend  # noqa: E402
from kvblend.vllm import selftest  # noqa: E402

from fixtures import Daemon  # noqa: E402

failures = []
HD, HEADS, MAXPOS = 64, 2, 4096
TORCH = {"f32": torch.float32, "f16": torch.float16, "bf16": torch.bfloat16}
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 512}
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}


def check(what, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {what}" + (f": {detail}" if detail else ""))
    if not ok:
        failures.append(what)


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


def main():
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
            worker_gate(c, VllmConfig())
            left = [m.name for m in c.model_list() if m.name.startswith("kvblend-selftest-")]
            held = sum(len(c.list(n)) for n in left)
            check("(c) nothing stored afterwards", held == 0 and len(left) > 0,
                  f"{held} chunks under {len(left)} test models")
    finally:
        d.stop()
    print("test_selftest: " + ("FAILED " + ", ".join(failures) if failures else "passed"))
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
