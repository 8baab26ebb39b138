"""kvblend.vllm.plugin.lock_runner_steps: vLLM's model runner holds the steps' lock.

vLLM itself is not needed: the hook wraps whatever class the runner's module holds, so a
module of that name with a runner class and a subclass shows what it does.
"""

from __future__ import annotations

import sys
import threading
import types

import pytest

from kvblend.vllm import plugin


def held() -> bool:
    """Whether this thread holds plugin.STEPS (another thread cannot take it then)."""
    got: list[bool] = []

    def probe() -> None:
        ok = plugin.STEPS.acquire(blocking=False)
        if ok:
            plugin.STEPS.release()
        got.append(ok)

    t = threading.Thread(target=probe)
    t.start()
    t.join(5)
    return not got[0]


@pytest.fixture
def runner_module(monkeypatch):
    class Runner:
        def execute_model(self, x):
            return ("execute", x, held())

        def sample_tokens(self, x):
            return ("sample", x, held())

        def prepare(self):
            return held()

    class CpuRunner(Runner):
        def execute_model(self, x):  # its own, as a subclass may define
            return ("cpu", x, held())

    mod = types.ModuleType(plugin.RUNNER_MODULE)
    mod.GPUModelRunner = Runner
    monkeypatch.setitem(sys.modules, plugin.RUNNER_MODULE, mod)
    return Runner, CpuRunner


def test_not_loaded_says_why(monkeypatch):
    monkeypatch.delitem(sys.modules, plugin.RUNNER_MODULE, raising=False)
    why = plugin.lock_runner_steps()
    assert why is not None and "GPUModelRunner" in why


def test_missing_method_says_which(monkeypatch):
    mod = types.ModuleType(plugin.RUNNER_MODULE)
    mod.GPUModelRunner = type("GPUModelRunner", (), {"execute_model": lambda self: None})
    monkeypatch.setitem(sys.modules, plugin.RUNNER_MODULE, mod)
    assert plugin.lock_runner_steps() == "vLLM's GPUModelRunner has no sample_tokens"


def test_runner_and_subclasses_hold_the_lock(runner_module):
    Runner, CpuRunner = runner_module
    assert Runner().execute_model(1) == ("execute", 1, False)
    assert plugin.lock_runner_steps() is None
    assert Runner().execute_model(1) == ("execute", 1, True)
    assert Runner().sample_tokens(2) == ("sample", 2, True)
    assert CpuRunner().execute_model(3) == ("cpu", 3, True)
    assert CpuRunner().sample_tokens(4) == ("sample", 4, True)
    assert Runner().prepare() is False  # other methods are left alone
    assert not held()  # released after each call
    # once per process: a second call wraps nothing twice
    wrapped = Runner.__dict__["execute_model"]
    assert plugin.lock_runner_steps() is None
    assert Runner.__dict__["execute_model"] is wrapped
    assert CpuRunner.execute_model.__name__ == "execute_model"


def test_a_step_waits_for_the_thread(runner_module):
    """While another thread holds the lock (a layer of a missed chunk), a step waits."""
    Runner, _ = runner_module
    assert plugin.lock_runner_steps() is None
    entered, leave, order = threading.Event(), threading.Event(), []

    def layer():
        with plugin.STEPS:
            entered.set()
            leave.wait(5)
            order.append("layer")

    t = threading.Thread(target=layer)
    t.start()
    entered.wait(5)
    step = threading.Thread(target=lambda: order.append(Runner().execute_model(0)[0]))
    step.start()
    step.join(0.2)
    assert step.is_alive()  # waiting for the layer
    leave.set()
    t.join(5)
    step.join(5)
    assert order == ["layer", "execute"]
