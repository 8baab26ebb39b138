"""The model vLLM runs, made reachable to kvblend's connector in the worker process.

vLLM hands a KV connector its cache tensors but never the model; CacheBlend's blend pass
needs the model's layer modules. kvblend registers a ``vllm.general_plugins`` entry point
(``kvblend = "kvblend.vllm.plugin:register"`` in client/python's pyproject.toml), which
vLLM calls in every process it starts (the front end, EngineCore, each worker) before it
builds the worker. :func:`register` wraps vLLM's ``get_model_loader`` so that every model
loader it hands out records the model its ``load_model`` returns; the connector's worker
side then asks :func:`loaded_model` for the model of its own ``vllm_config``.

Why there: every model runner (CPU, GPU) loads its model through
``vllm.model_executor.model_loader.get_model``, which looks ``get_model_loader`` up in its
module at each call, whatever loader class the load format picks. It holds as long as
that stays so (vLLM 0.32 to 0.34; :data:`SUPPORTED_VLLM`); where it does not, the wrapper is not
installed, :func:`loaded_model` raises :class:`ModelUnreachable` with the reason, and the
connector refuses to blend (docs/vllm-reference.md, "Getting at the model").

The second hook, :func:`lock_runner_steps`, is installed by the connector's worker side when
it stores on a miss: vLLM's model runner then holds :data:`STEPS` while it computes a step,
so that kvblend's own thread never computes beside it (:mod:`kvblend.vllm.misses` says why).

This module imports nothing from torch or vLLM until :func:`register` runs (nor does
:mod:`kvblend.vllm`, whose connector is imported only when asked for).
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
import time
from typing import Any

# SUPPORTED_VLLM is also the releases whose model loading this hook is written against:
# get_model_loader and get_model are the same in 0.32, 0.33 and 0.34.
from .versions import SUPPORTED_VLLM, supported_text, version_supported  # noqa: F401

_lock = threading.Lock()
_state: dict[str, Any] = {"registered": False, "why_not": "the kvblend vLLM plugin did not run"}
_models: list[tuple[Any, Any, str]] = []  # (model, model_config, prefix), in load order


class ModelUnreachable(RuntimeError):
    """The model vLLM runs is not reachable from the connector; the message says why."""


def _record(model: Any, model_config: Any, prefix: str) -> None:
    with _lock:
        _models.append((model, model_config, prefix))


def _wrap_loader(loader: Any) -> Any:
    """Make one loader instance record the models it loads (its class is left alone)."""
    if getattr(loader, "_kvblend_wrapped", False):
        return loader
    load = loader.load_model

    def load_model(*args: Any, **kwargs: Any) -> Any:
        model = load(*args, **kwargs)
        model_config = kwargs.get("model_config", args[1] if len(args) > 1 else None)
        prefix = kwargs.get("prefix", args[2] if len(args) > 2 else "")
        _record(model, model_config, prefix)
        return model

    loader.load_model = load_model
    loader._kvblend_wrapped = True
    return loader


def _give_up(why: str) -> None:
    _state["why_not"] = why
    logging.getLogger("vllm.kvblend").warning("kvblend: model-loading hook not installed: %s", why)


def register() -> None:
    """Install the model-loading hook (vLLM's ``vllm.general_plugins`` entry point).

    Safe to call more than once (vLLM does, per process). Never raises: where the hook
    cannot be installed (another vLLM version, a changed module), the reason is kept
    for :func:`loaded_model` and logged once.
    """
    with _lock:
        if _state["registered"]:
            return
        _state["registered"] = True
    try:
        import vllm
        import vllm.model_executor.model_loader as ml
    except Exception as e:  # noqa: BLE001 - any failure is a reason not to hook, not to crash
        _give_up(f"vLLM's model loader could not be imported: {e}")
        return
    version = getattr(vllm, "__version__", "?")
    if not version_supported(version):
        _give_up(f"vLLM {version}: the model-loading hook is written for vLLM {supported_text()}")
        return
    original = getattr(ml, "get_model_loader", None)
    if not callable(original) or not callable(getattr(ml, "get_model", None)):
        _give_up("vllm.model_executor.model_loader has no get_model_loader/get_model to hook")
        return
    if getattr(original, "_kvblend_hook", False):
        _state["why_not"] = ""
        return

    def get_model_loader(*args: Any, **kwargs: Any) -> Any:
        return _wrap_loader(original(*args, **kwargs))

    get_model_loader._kvblend_hook = True  # type: ignore[attr-defined]
    get_model_loader.__wrapped__ = original  # type: ignore[attr-defined]
    ml.get_model_loader = get_model_loader
    _state["why_not"] = ""


def loaded_model(vllm_config: Any) -> Any:
    """Return the model this process loaded for ``vllm_config`` (vLLM's ``nn.Module``).

    The main model: the last one loaded for ``vllm_config.model_config`` with an empty
    prefix (a draft model for speculative decoding has its own config or prefix).

    Raises
    ------
    ModelUnreachable
        The plugin did not run in this process (kvblend not installed in vLLM's
        environment as a package, or ``VLLM_PLUGINS`` leaves ``kvblend`` out), the hook
        could not be installed (the reason is given), or no model was loaded yet.
    """
    want = vllm_config.model_config
    with _lock:
        why = _state["why_not"]
        found = [
            m
            for m, cfg, prefix in _models
            if not prefix and (cfg is want or getattr(cfg, "model", None) == want.model)
        ]
    if why:
        raise ModelUnreachable(
            f"kvblend: the model is not reachable from the connector: {why} (install kvblend "
            "as a package in vLLM's environment (uv pip install ./client/python, docs/vllm.md "
            "\"Install\"), so that "
            "its vllm.general_plugins entry point loads, and keep 'kvblend' in VLLM_PLUGINS "
            "if that is set)"
        )
    if not found:
        raise ModelUnreachable(
            "kvblend: the model is not reachable from the connector: no model was loaded "
            "through vLLM's model loader in this process yet"
        )
    return found[-1]


#: Held by vLLM's model runner around each step (:func:`lock_runner_steps`) and by the
#: store-on-miss thread around each layer (:mod:`kvblend.vllm.misses`): one per process.
STEPS = threading.RLock()

#: The model runner's methods that compute (inputs and metadata, forward, sampling).
RUNNER_METHODS = ("execute_model", "sample_tokens")
#: Where vLLM defines its GPUModelRunner (the CPU runner is a subclass): 0.32 and 0.33 have
#: both modules, 0.34 only the second.
RUNNER_MODULES = ("vllm.v1.worker.gpu_model_runner", "vllm.v1.worker.gpu.model_runner")


#: What the runner is doing: how many of its calls are computing (0 or 1), and when the
#: last one ended (time.monotonic()); written under STEPS, read by :class:`BetweenSteps`.
_runner: dict[str, float] = {"busy": 0, "last_end": 0.0}
#: :class:`BetweenSteps` looks at the runner this often while it waits.
POLL_S = 0.005
#: The longest a unit of background work waits for the runner to idle: under a load that
#: never idles, one unit (a layer of a missed chunk) runs this often, no more.
PATIENCE_S = 0.25


def _held(fn: Any) -> Any:
    @functools.wraps(fn)
    def locked(self: Any, *args: Any, **kwargs: Any) -> Any:
        with STEPS:
            _runner["busy"] += 1
            try:
                return fn(self, *args, **kwargs)
            finally:
                _runner["busy"] -= 1
                _runner["last_end"] = time.monotonic()

    locked._kvblend_steps = True  # type: ignore[attr-defined]
    return locked


class BetweenSteps:
    """Hold :data:`STEPS` for one unit of background work, after the runner idles.

    Entering waits until the model runner has computed nothing for ``idle_s`` (the engine
    has no step to run: it waits for requests), or for :data:`PATIENCE_S` at most, then
    takes :data:`STEPS`. So background work (the store-on-miss thread's layers) runs while
    the engine idles, and under a load that never idles one unit runs every
    :data:`PATIENCE_S`: a request's steps are held up by one unit in that time at most.
    ``idle_s`` 0: take the lock at once (the runner's next step waits for the unit).
    ``waited_out``: the units that ran because the patience ran out.
    """

    def __init__(
        self,
        idle_s: float,
        patience_s: float = PATIENCE_S,
        clock: Any = time.monotonic,
        sleep: Any = time.sleep,
    ) -> None:
        self.idle_s = idle_s
        self.patience_s = patience_s
        self.clock = clock
        self.sleep = sleep
        self.waited_out = 0

    def wait(self) -> None:
        """Return once the runner idled ``idle_s``, or after ``patience_s``."""
        if self.idle_s <= 0:
            return
        t0 = self.clock()
        while True:
            now = self.clock()
            if not _runner["busy"] and now - _runner["last_end"] >= self.idle_s:
                return
            if now - t0 >= self.patience_s:
                self.waited_out += 1
                return
            self.sleep(POLL_S)

    def __enter__(self) -> BetweenSteps:
        self.wait()
        STEPS.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        STEPS.release()


def lock_runner_steps() -> str | None:
    """Make vLLM's model runners hold :data:`STEPS` while they compute a step.

    Wraps ``execute_model`` and ``sample_tokens`` of each ``GPUModelRunner`` loaded from
    :data:`RUNNER_MODULES` (the CPU runner is a subclass) and of every loaded subclass that
    defines its own, once per process. Returns None, or why it could not (no runner's
    module is loaded in this process, or its runner lacks a method).
    """
    bases = [
        b for b in (getattr(sys.modules.get(m), "GPUModelRunner", None) for m in RUNNER_MODULES)
        if b is not None
    ]
    if not bases:
        return ("vLLM's model runner (GPUModelRunner in " + " or ".join(RUNNER_MODULES)
                + ") is not loaded here")
    classes, todo = [], list(bases)
    while todo:
        cls = todo.pop()
        if cls in classes:
            continue
        classes.append(cls)
        todo.extend(cls.__subclasses__())
    for base in bases:
        for name in RUNNER_METHODS:
            if not callable(getattr(base, name, None)):
                return f"vLLM's GPUModelRunner ({base.__module__}) has no {name}"
    for cls in classes:
        for name in RUNNER_METHODS:
            fn = cls.__dict__.get(name)
            if fn is not None and not getattr(fn, "_kvblend_steps", False):
                setattr(cls, name, _held(fn))
    return None
