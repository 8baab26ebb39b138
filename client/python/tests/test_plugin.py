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

    mod = types.ModuleType(plugin.RUNNER_MODULES[0])
    mod.GPUModelRunner = Runner
    monkeypatch.setitem(sys.modules, plugin.RUNNER_MODULES[0], mod)
    return Runner, CpuRunner


def test_not_loaded_says_why(monkeypatch):
    for m in plugin.RUNNER_MODULES:
        monkeypatch.delitem(sys.modules, m, raising=False)
    why = plugin.lock_runner_steps()
    assert why is not None and "GPUModelRunner" in why


@pytest.mark.parametrize("module", [0, 1])
def test_missing_method_says_which(monkeypatch, module):
    """vLLM 0.32/0.33's runner module and 0.34's (vllm.v1.worker.gpu.model_runner)."""
    for m in plugin.RUNNER_MODULES:
        monkeypatch.delitem(sys.modules, m, raising=False)
    name = plugin.RUNNER_MODULES[module]
    mod = types.ModuleType(name)
    mod.GPUModelRunner = type("GPUModelRunner", (), {"execute_model": lambda self: None})
    monkeypatch.setitem(sys.modules, name, mod)
    why = plugin.lock_runner_steps()
    assert why is not None and why.startswith("vLLM's GPUModelRunner (")
    assert why.endswith(") has no sample_tokens")


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


class Clock:
    """A clock that moves only when the waiter sleeps."""

    def __init__(self) -> None:
        self.t = 100.0
        self.slept = 0

    def __call__(self) -> float:
        return self.t

    def sleep(self, s: float) -> None:
        self.slept += 1
        self.t += s


def test_background_work_waits_for_the_runner_to_idle(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(plugin, "_runner", {"busy": 0, "last_end": clock.t - 0.001})
    b = plugin.BetweenSteps(0.02, patience_s=0.25, clock=clock, sleep=clock.sleep)
    b.wait()  # the last step ended 1 ms ago: waits until 20 ms have passed since
    assert 100.019 - 1e-9 <= clock.t <= 100.019 + plugin.POLL_S + 1e-9
    assert b.waited_out == 0
    clock.slept = 0
    b.wait()  # idle since: at once
    assert clock.slept == 0


def test_background_work_runs_after_its_patience(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(plugin, "_runner", {"busy": 1, "last_end": 0.0})  # a step running
    b = plugin.BetweenSteps(0.02, patience_s=0.25, clock=clock, sleep=clock.sleep)
    with b:
        assert held()
    assert 100.25 - 1e-9 <= clock.t <= 100.25 + plugin.POLL_S + 1e-9
    assert b.waited_out == 1 and not held()


def test_idle_zero_takes_the_lock_at_once(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(plugin, "_runner", {"busy": 1, "last_end": 0.0})
    with plugin.BetweenSteps(0, clock=clock, sleep=clock.sleep):
        assert held()
    assert clock.slept == 0


def test_the_runner_marks_its_steps(monkeypatch):
    class Runner:
        def execute_model(self):
            return plugin._runner["busy"]

        def sample_tokens(self):
            return plugin._runner["busy"]

    mod = types.ModuleType(plugin.RUNNER_MODULES[0])
    mod.GPUModelRunner = Runner
    monkeypatch.setitem(sys.modules, plugin.RUNNER_MODULES[0], mod)
    monkeypatch.setattr(plugin, "_runner", {"busy": 0, "last_end": 0.0})
    assert plugin.lock_runner_steps() is None
    assert Runner().execute_model() == 1 and Runner().sample_tokens() == 1  # busy inside
    assert plugin._runner["busy"] == 0 and plugin._runner["last_end"] > 0  # idle after
