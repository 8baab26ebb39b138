"""kvblend.vllm against the published sources of every vLLM it supports (issue 33).

Only vLLM 0.32 has a CPU build on PyPI, so the engine tests run on 0.32; this test holds
the connector to the source release of each version in SUPPORTED_VLLM (PyPI's sdist,
downloaded once into $KVBLEND_ENGINE_CACHE/vllm-src, its sha256 checked against PyPI's
index), read with ``ast``, nothing imported:

(a) every abstract method of KVConnectorBase_V1 is defined by KvblendConnector;
(b) every public method KvblendConnector defines overrides one of the base, with the
    same parameters and the same kind (class method or not), __init__ included (a hook of
    a later release, which an earlier one never calls, may be missing from its base);
(c) the base's methods are those of 0.32 plus the ones in NEW, each with the choice
    kvblend made for it: a hook added in a later release fails here until it is decided;
(d) every name kvblend imports from vllm (``from vllm.x import y`` in client/python/src)
    is defined in that module of every supported version;
(e) the connector's start-up gate takes those versions and no other.

Beside the sources (the engine venv's vLLM 0.32 imported): (f) the connector's answers to
0.34's hooks: kv_cache_access from kv_connector_extra_config and the platform,
may_load_async by async_loads and the request's parameters.

Run by pytest (tests/engine/run.sh --pytest, as ctest does); skipped when KVBLEND_SKIP_ENGINE=1.
"""

import ast
import hashlib
import json
import os
import sys
import tarfile
import urllib.request
from pathlib import Path

import pytest

if os.environ.get("KVBLEND_SKIP_ENGINE") == "1":
    pytest.skip("KVBLEND_SKIP_ENGINE=1", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[2]
SRC = ROOT / "client" / "python" / "src"
CACHE = Path(os.environ.get("KVBLEND_ENGINE_CACHE", "/var/cache/kvblend")) / "vllm-src"
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
CLASS = "KVConnectorBase_V1"

# The connector's interface in 0.32 is the reference; what later releases add, and why
# kvblend is right with it.
NEW = {
    "0.33": {
        "supports_sleep_mode": "overridden: False, so vLLM refuses enable_sleep_mode",
        "unregister_kv_caches": "the base's no-op: only sleep mode calls it",
        "restore_kv_caches": "the base's no-op: only sleep mode calls it",
    },
    "0.34": {
        "kv_cache_access": "overridden: EXPORTS_FD where loads land through a local "
                           "kvblendd's CUDA device (ipc://, CUDA, device_landing 'auto'), "
                           "which imports the growable cache by fd; else IN_PROCESS",
        "may_load_async": "overridden: True for a reuse request with async_loads on (the "
                          "default on 0.34): its load starts while the batch is full and "
                          "lands between steps; False for a blend (its pass needs the "
                          "request's own forward), a request without kvblend parameters, "
                          "or async_loads off",
        "supports_lookahead_block_hashes": "the base's False: EAGLE's block-drop hashing "
                                           "stays off (kvblend neither loads nor fences by "
                                           "the drafter's look-ahead window)",
    },
}

# Names kvblend imports from vllm that only later releases define: each import sits in a
# method only that release calls (a lazy import), so the earlier ones never run it.
SINCE = {("vllm.config.kv_transfer", "KVCacheAccess"): "0.34"}

failures = []


def check(name, ok, detail=""):
    print(f"{'ok  ' if ok else 'FAIL'} {name}{': ' + detail if detail else ''}", flush=True)
    if not ok:
        failures.append(name)


def sdist(version):
    """The path of vLLM's sdist for version, downloaded (and checked) on first use."""
    path = CACHE / f"vllm-{version}.tar.gz"
    if path.exists():
        return path
    req = urllib.request.Request("https://pypi.org/simple/vllm/",
                                 headers={"Accept": "application/vnd.pypi.simple.v1+json"})
    with urllib.request.urlopen(req, timeout=60) as r:
        files = json.load(r)["files"]
    f = next(x for x in files if x["filename"] == f"vllm-{version}.tar.gz")
    CACHE.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".part")
    with urllib.request.urlopen(f["url"], timeout=600) as r, open(tmp, "wb") as out:
        h = hashlib.sha256()
        while chunk := r.read(1 << 20):
            h.update(chunk)
            out.write(chunk)
    if h.hexdigest() != f["hashes"]["sha256"]:
        tmp.unlink()
        raise RuntimeError(f"vllm-{version}.tar.gz: sha256 differs from PyPI's index")
    tmp.rename(path)
    return path


class Source:
    """The Python files of one vLLM release, read from its sdist on demand."""

    def __init__(self, version):
        self.version = version
        self.tar = tarfile.open(sdist(version))
        self.prefix = f"vllm-{version}/"
        self.names = set(self.tar.getnames())

    def read(self, rel):
        name = self.prefix + rel
        if name not in self.names:
            return None
        return self.tar.extractfile(name).read().decode()

    def module(self, dotted):
        """The AST of module dotted (a .py file or a package's __init__.py), or None."""
        rel = dotted.replace(".", "/")
        text = self.read(rel + ".py") or self.read(rel + "/__init__.py")
        return None if text is None else ast.parse(text)


def methods(tree, cls):
    """{name: (kind, parameter names, abstract)} of class cls in tree."""
    node = next(n for n in ast.walk(tree) if isinstance(n, ast.ClassDef) and n.name == cls)
    out = {}
    for f in node.body:
        if not isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        decos = {d.id if isinstance(d, ast.Name) else getattr(d, "attr", "") for d in
                 f.decorator_list}
        kind = "classmethod" if "classmethod" in decos else \
            "staticmethod" if "staticmethod" in decos else "method"
        a = f.args
        params = [x.arg for x in a.posonlyargs + a.args + a.kwonlyargs]
        out[f.name] = (kind, params, "abstractmethod" in decos)
    return out


def defined_names(tree):
    """Names a module defines at its top level (defs, classes, assignments, imports)."""
    names = set()
    for n in tree.body:
        if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(n.name)
        elif isinstance(n, (ast.Assign, ast.AnnAssign)):
            targets = n.targets if isinstance(n, ast.Assign) else [n.target]
            names.update(t.id for t in targets if isinstance(t, ast.Name))
        elif isinstance(n, (ast.Import, ast.ImportFrom)):
            names.update((a.asname or a.name).split(".")[0] for a in n.names)
        elif isinstance(n, (ast.If, ast.Try)):  # TYPE_CHECKING blocks, fallbacks
            names |= defined_names(ast.Module(body=n.body + getattr(n, "orelse", []),
                                              type_ignores=[]))
    return names


def kvblend_imports():
    """{(module, name): files} of every ``from vllm... import name`` in the package."""
    out = {}
    for p in sorted(SRC.rglob("*.py")):
        for n in ast.walk(ast.parse(p.read_text())):
            if isinstance(n, ast.ImportFrom) and n.module and n.level == 0 and (
                    n.module == "vllm" or n.module.startswith("vllm.")):
                for a in n.names:
                    out.setdefault((n.module, a.name), []).append(p.relative_to(SRC).as_posix())
    return out


def hooks():
    """(f) kv_cache_access and may_load_async, with the engine venv's vLLM (0.32) imported.

    KVCacheAccess is 0.34's: a stand-in with its members goes in vllm.config.kv_transfer
    for the call, as the real one is there on 0.34; the platform is CUDA or not by a patch
    of vllm.platforms.current_platform.is_cuda.
    """
    import enum

    import vllm.config.kv_transfer as kt
    from kvblend.vllm.connector import KvblendConnector
    from vllm.platforms import current_platform

    class KVCacheAccess(enum.IntFlag):  # vllm/config/kv_transfer.py of 0.34
        IN_PROCESS = 0
        REGISTERS = enum.auto()
        EXPORTS_FD = enum.auto()
        EXPORTS_FABRIC = enum.auto()
        LEGACY_IPC = enum.auto()

    class Config:
        def __init__(self, **extra):
            self.kv_connector_extra_config = extra

    had = hasattr(kt, "KVCacheAccess")
    kt.KVCacheAccess = getattr(kt, "KVCacheAccess", KVCacheAccess)
    real = current_platform.is_cuda
    ipc, tcp = "ipc:///tmp/kvb.sock", "tcp://127.0.0.1:5555"
    cases = [  # (extra, on CUDA, want EXPORTS_FD)
        ({"endpoint": ipc}, True, True),
        ({"endpoint": ipc, "device_landing": "auto"}, True, True),
        ({"endpoint": ipc, "device_landing": "off"}, True, False),
        ({"endpoint": tcp}, True, False),
        ({"endpoint": ipc}, False, False),  # the CPU: vLLM refuses EXPORTS_FD there
    ]
    try:
        for extra, cuda, want in cases:
            current_platform.is_cuda = (lambda c=cuda: c)
            got = KvblendConnector.kv_cache_access(Config(**extra))
            check(f"(f) kv_cache_access {extra} {'CUDA' if cuda else 'CPU'}: "
                  f"{'EXPORTS_FD' if want else 'IN_PROCESS'}",
                  got == (kt.KVCacheAccess.EXPORTS_FD if want else kt.KVCacheAccess.IN_PROCESS),
                  repr(got))
        current_platform.is_cuda = lambda: True
        try:
            KvblendConnector.kv_cache_access(Config(endpoint=ipc, device_landing="on"))
            check("(f) kv_cache_access refuses device_landing 'on'", False)
        except ValueError as e:
            check("(f) kv_cache_access refuses device_landing 'on', naming the key",
                  "device_landing" in str(e), str(e))
    finally:
        current_platform.is_cuda = real
        if not had:
            del kt.KVCacheAccess

    class Request:
        request_id = "r"
        kv_transfer_params = {"kvblend": {"segments": [[0, 64, "chunk"]]},
                              "do_remote_prefill": True}

    from types import SimpleNamespace

    from kvblend.vllm.scheduler import SchedulerSide

    def answer(request, **config):
        down = config.pop("down", False)
        conn = object.__new__(KvblendConnector)
        conn.scheduler = object.__new__(SchedulerSide)
        conn.scheduler.config = SimpleNamespace(**{"async_loads": True, "blend": None,
                                                   "endpoint": "ipc:///tmp/kvb.sock",
                                                   **config})
        conn.scheduler._off = None
        conn.scheduler.daemon = SimpleNamespace(is_open=down)
        return KvblendConnector.may_load_async(conn, request)

    class Plain:
        request_id = "p"
        kv_transfer_params = None

    class NoBlend(Request):
        kv_transfer_params = {"kvblend": {"segments": [[0, 64, "chunk"]], "blend": False}}

    from kvblend.vllm.config import async_loads_wanted

    got = [async_loads_wanted({}, v) for v in ("0.32.0", "0.33.1", "0.34.0", "0.35.0")]
    got += [async_loads_wanted({"async_loads": x}, "0.32.0") for x in (True, False, "auto")]
    check("(f) async_loads: 'auto' (the default) on from vLLM 0.34, true and false as said",
          got == [False, False, True, True, True, False, False], str(got))
    for bad in ("yes", 1, None):
        try:
            async_loads_wanted({"async_loads": bad}, "0.34.0")
            why = "accepted"
        except ValueError as e:
            why = str(e)
        check(f"(f) async_loads {bad!r} refused, naming the key", "async_loads must be" in why,
              why)
    check("(f) may_load_async: True for a reuse request with async_loads on",
          answer(Request()) is True)
    class Fresh(Request):
        kv_transfer_params = {"kvblend": {"segments": [[0, 64, "fresh"]]}}

    check("(f) may_load_async: False with async_loads off, for a request without kvblend "
          "parameters or without a chunk, for a blend, with a tcp:// daemon and while the "
          "daemon is down; True for \"blend\": false",
          [answer(Request(), async_loads=False), answer(Plain()), answer(Fresh()),
           answer(Request(), blend=object()), answer(Request(), endpoint="tcp://h:1"),
           answer(Request(), down=True), answer(NoBlend(), blend=object())]
          == [False, False, False, False, False, False, True])


def test_vllm_interface():
    sys.path.insert(0, str(SRC))
    from kvblend.vllm.config import SUPPORTED_VLLM, version_supported  # the engine venv

    cases = {"0.32.0": True, "0.32.1": True, "0.33.0": True, "0.33.2.post1": True,
             "0.34.0": True, "0.34.1": True, "0.35.0": False,
             "0.31.9": False, "0.3": False, "0.320.0": False, "0.340.0": False}
    got = {v: version_supported(v) for v in cases}
    check("(e) the start-up gate takes 0.32.x, 0.33.x and 0.34.x only", got == cases, str(got))
    from kvblend.vllm import plugin
    check("(e) the plugin's gate is the connector's", plugin.SUPPORTED_VLLM is SUPPORTED_VLLM)

    ours = methods(ast.parse((SRC / "kvblend/vllm/connector.py").read_text()),
                   "KvblendConnector")
    imports = kvblend_imports()
    reference = None
    for minor in SUPPORTED_VLLM:
        src = Source(f"{minor}.0")
        base = methods(ast.parse(src.read(BASE)), CLASS)
        if reference is None:
            reference = base
        v = src.version
        abstract = sorted(n for n, (_, _, ab) in base.items() if ab)
        missing = [n for n in abstract if n not in ours]
        check(f"{v}: the base's {len(abstract)} abstract methods are all defined",
              not missing, f"missing {missing}")
        wrong = []
        later = {n for m, d in NEW.items() if m > minor for n in d}  # not called here
        for name, (kind, params, _) in sorted(ours.items()):
            if name.startswith("_") and name != "__init__":
                continue  # the connector's own helpers
            if name not in base:
                if name not in later:
                    wrong.append(f"{name}: not in the base")
            elif base[name][:2] != (kind, params):
                wrong.append(f"{name}: ours {kind} {params}, the base's {base[name][:2]}")
        check(f"{v}: the connector's {len(ours)} methods override the base's, same parameters",
              not wrong, "; ".join(wrong))
        added = sorted(set(base) - set(reference))
        gone = sorted(set(reference) - set(base))
        decided = {n: why for m, d in NEW.items() if m <= minor for n, why in d.items()}
        check(f"{v}: the base's methods beyond 0.32's are decided",
              set(added) == set(decided) and not gone,
              f"added {added}, removed {gone}, decided {sorted(decided)}")
        for name in added:
            print(f"     {name}: {decided.get(name, 'NOT DECIDED')}")
        unresolved = []
        for (mod, name), files in sorted(imports.items()):
            if SINCE.get((mod, name), minor) > minor:
                continue  # imported only where that later release calls
            tree = src.module(mod)
            sub = src.module(f"{mod}.{name}")  # from package import submodule
            if tree is None or (name not in defined_names(tree) and sub is None):
                unresolved.append(f"{mod}.{name} ({', '.join(files)})")
        check(f"{v}: the {len(imports)} names kvblend imports from vllm are there",
              not unresolved, "; ".join(unresolved))
    check("the connector refuses sleep mode", "supports_sleep_mode" in ours)
    hooks()
    print("test_vllm_interface: " + ("FAILED " + ", ".join(failures) if failures else "passed"))
    assert not failures, "failed: " + "; ".join(failures)
