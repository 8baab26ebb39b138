#!/usr/bin/env python3
"""Import rules of the Python side, read statically (ast): nothing is imported or run.

usage: check_imports.py [SOURCE_ROOT]   (default: the checkout this file is in)

- The kvblend package (client/python/src/kvblend): the module-level imports between its
  modules form no cycle (imports inside functions and under ``if TYPE_CHECKING:`` do not
  run at import and are not counted); no module is a flat ``_vllm*`` or ``_blend*`` one
  (a folder says which modules belong together), and no Python file of the checkout has
  a line starting ``from _vllm`` or ``from ._vllm``.
- What importing reaches, following module-level imports: ``import kvblend`` never
  torch, vLLM or transformers; ``kvblend.vllm`` (the package vLLM's plugin loader and
  connector factory import) and ``kvblend.vllm.plugin`` neither torch nor vLLM;
  ``kvblend.blend`` and ``kvblend.vllm.plan`` no torch or vLLM.
- eval/ and bench/ import no test module (a module of a file under tests/) and put no
  ``"tests"`` folder on a path: tests may import eval/, never the reverse.
- The tests (tests/, client/python/tests/) reach eval/ without editing sys.path: no
  statement that changes sys.path names eval (tests/pytest.ini, client/python's
  pyproject.toml and tests/engine/run.sh put it on the path).

Prints one line per failed check and closes with "N passed, N failed"; exit 1 on a
failure. ctest: test_python_imports (label unit).
"""

import ast
import os
import re
import sys
from pathlib import Path

ROOT = Path(sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parent.parent)
SRC = ROOT / "client" / "python" / "src"
HEAVY = {"torch", "vllm", "transformers"}

passed = 0
failed = 0


def check(ok, what):
    global passed, failed
    if ok:
        passed += 1
    else:
        failed += 1
        print(f"FAIL: {what}")


def package_modules():
    """Map each module name of the kvblend package to its file."""
    mods = {}
    for path in sorted((SRC / "kvblend").rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        mods[".".join(parts)] = path
    return mods


def is_package(mods, name):
    return name in mods and mods[name].name == "__init__.py"


def module_level_imports(tree):
    """Yield the Import/ImportFrom nodes that run when the module is imported."""
    def walk(body):
        for node in body:
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                yield node
            elif isinstance(node, ast.If):
                test = ast.unparse(node.test)
                if test not in ("TYPE_CHECKING", "typing.TYPE_CHECKING"):
                    yield from walk(node.body)
                yield from walk(node.orelse)
            elif isinstance(node, ast.Try):
                for part in (node.body, node.orelse, node.finalbody):
                    yield from walk(part)
                for h in node.handlers:
                    yield from walk(h.body)
            elif isinstance(node, (ast.With, ast.For, ast.While)):
                yield from walk(node.body)
    yield from walk(tree.body)


def all_imports(tree):
    """Yield every Import/ImportFrom node, wherever it is."""
    for node in ast.walk(tree):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node


def resolve(mods, importer, node):
    """The names a module-level import statement of ``importer`` imports (absolute)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    if node.level:
        base = importer.split(".")
        if not is_package(mods, importer):
            base = base[:-1]
        base = base[: len(base) - (node.level - 1)]
        target = ".".join(base + ([node.module] if node.module else []))
    else:
        target = node.module
    names = [target]
    for a in node.names:
        if f"{target}.{a.name}" in mods:
            names.append(f"{target}.{a.name}")
    return names


def graph(mods):
    """Module-level dependencies: internal edges and the external top-level names."""
    internal, external = {}, {}
    for name, path in mods.items():
        tree = ast.parse(path.read_text(), str(path))
        deps, ext = set(), set()
        own_ancestors = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 1)}
        for node in module_level_imports(tree):
            for target in resolve(mods, name, node):
                if target.split(".")[0] != "kvblend":
                    ext.add(target.split(".")[0])
                    continue
                parts = target.split(".")
                # importing a.b.c runs a and a.b first; the importer's own packages are
                # already being imported (not an edge)
                for i in range(1, len(parts) + 1):
                    dep = ".".join(parts[:i])
                    if dep in mods and dep not in own_ancestors and dep != name:
                        deps.add(dep)
        internal[name], external[name] = deps, ext
    return internal, external


def cycles(internal):
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in internal[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in internal[v]:
                out.append(sorted(comp))

    for v in sorted(internal):
        if v not in index:
            visit(v)
    return out


def reach(internal, external, start):
    """The external top-level modules importing ``start`` imports, and via which module."""
    parts = start.split(".")
    todo = [".".join(parts[:i]) for i in range(1, len(parts) + 1)]  # its packages run first
    seen, found = set(), {}
    while todo:
        m = todo.pop()
        if m in seen or m not in internal:
            continue
        seen.add(m)
        for e in external[m]:
            found.setdefault(e, m)
        todo.extend(internal[m])
    return found


def check_package():
    mods = package_modules()
    check(mods, f"no kvblend package under {SRC}")
    internal, external = graph(mods)
    in_cycle = {m: comp for comp in cycles(internal) for m in comp}
    for m in sorted(mods):
        check(m not in in_cycle, f"{m} is in an import cycle among {in_cycle.get(m)}")
    flat = [m for m in mods if re.fullmatch(r"_(vllm|blend)\w*", m.split(".")[-1])]
    check(not flat, f"flat modules that belong in a folder: {flat}")
    for start, banned in (("kvblend", HEAVY), ("kvblend.vllm", HEAVY),
                          ("kvblend.vllm.plugin", HEAVY), ("kvblend.blend", HEAVY),
                          ("kvblend.vllm.plan", HEAVY)):
        check(start in mods, f"{start} is missing")
        got = reach(internal, external, start)
        bad = {e: via for e, via in got.items() if e in banned}
        via = ", ".join(f"{e} (in {v})" for e, v in bad.items())
        check(not bad, f"import {start} imports {via}")


def python_files(*dirs):
    for d in dirs:
        for dirpath, dirnames, filenames in os.walk(ROOT / d):
            dirnames[:] = [x for x in dirnames if not x.startswith((".", "build"))
                           and x != "__pycache__"]
            for f in filenames:
                if f.endswith(".py"):
                    yield Path(dirpath) / f


def check_flat_imports():
    pat = re.compile(r"^from \.?_vllm", re.M)
    bad = [str(p.relative_to(ROOT)) for p in python_files("client", "tests", "eval", "bench")
           if pat.search(p.read_text(errors="replace"))]
    check(not bad, f"lines starting 'from _vllm' or 'from ._vllm' in {bad}")


def docstrings(tree):
    """The ids of the string constants that are docstrings."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                out.add(id(body[0].value))
    return out


def check_eval_bench():
    test_modules = {p.stem for p in python_files("tests")}
    own = {p.stem for p in python_files("eval", "bench")}
    banned = (test_modules - own) | {"tests"}
    files = sorted(python_files("eval", "bench"))
    check(files, "no Python files under eval/ or bench/")
    for path in files:
        tree = ast.parse(path.read_text(), str(path))
        rel = path.relative_to(ROOT)
        names = set()
        for node in all_imports(tree):
            if isinstance(node, ast.Import):
                names |= {a.name.split(".")[0] for a in node.names}
            elif node.level == 0 and node.module:
                names.add(node.module.split(".")[0])
        bad = sorted(names & banned)
        check(not bad, f"{rel} imports test modules {bad}")
        docs = docstrings(tree)
        paths = [n.lineno for n in ast.walk(tree)
                 if isinstance(n, ast.Constant) and n.value == "tests" and id(n) not in docs]
        check(not paths, f"{rel} names the tests folder (line {paths}) to import from it")


def check_tests_path():
    for path in sorted(python_files("tests", os.path.join("client", "python", "tests"))):
        text = path.read_text()
        lines = text.splitlines()
        tree = ast.parse(text, str(path)) if "sys.path" in text else ast.Module([], [])
        bad = []
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Expr, ast.Assign, ast.AugAssign)):
                continue
            seg = "\n".join(lines[node.lineno - 1:node.end_lineno])
            if re.search(r"\bsys\.path\b", seg) and re.search(r"eval", seg, re.I) and (
                    isinstance(node, (ast.Assign, ast.AugAssign)) or
                    re.search(r"sys\.path\.(insert|append|extend)\(", seg)):
                bad.append(node.lineno)
        check(not bad, f"{path.relative_to(ROOT)} edits sys.path to reach eval/ (line {bad})")


check_package()
check_flat_imports()
check_eval_bench()
check_tests_path()
print(f"{passed} passed, {failed} failed")
sys.exit(1 if failed else 0)
