"""pytest's setup for the tests under tests/ (ctest: python3 -m pytest -q -p no:cacheprovider
FILE OPTIONS, tests/CMakeLists.txt; tests/engine/run.sh --pytest): this build's programs,
the engine tests' model and the tests' settings as command-line options, the programs and
the model each a fixture (kvblendd, kvblend, place_tool, crash_put, blend_tool,
aegis_tool, engine_model; and part: a test that needs one that was not given fails, naming it), and a
run whose every test was skipped exits 77, ctest's skip.

    python3 -m pytest tests/integration/test_curve.py \\
        --kvblendd build/bin/kvblendd --kvblend build/bin/kvblend
"""

import os

import pytest

# option: (fixture, help): this build's programs and the engine tests' model
_PROGRAMS = {
    "--kvblendd": ("kvblendd", "this build's kvblendd"),
    "--kvblend": ("kvblend", "this build's kvblend CLI"),
    "--place-tool": ("place_tool", "this build's place_tool (tests/integration/place_tool.c)"),
    "--crash-put": ("crash_put", "this build's crash_put (tests/crash/crash_put.c)"),
    "--blend-tool": ("blend_tool", "this build's blend_tool (tests/blend/blend_tool.c)"),
    "--aegis-tool": ("aegis_tool", "this build's aegis_tool (tests/aegis/aegis_tool.c)"),
    "--model": ("engine_model", "the engine tests' model directory (default "
                "$KVBLEND_ENGINE_MODEL, as tests/engine/run.sh sets it)"),
}


def pytest_addoption(parser):
    g = parser.getgroup("kvblend", "kvblend's tests")
    for opt, (dest, text) in _PROGRAMS.items():
        g.addoption(opt, dest=dest, help=text,
                    default=os.environ.get("KVBLEND_ENGINE_MODEL") if opt == "--model" else None)
    g.addoption("--part", help="test_cluster_ops.py: the part to run (join, hedge, ...)")
    g.addoption("--arch", action="append",
                help="test_vllm_arch.py: only this architecture (repeatable)")
    g.addoption("--no-engine", action="append", default=[],
                help="test_vllm_arch.py: kvblend.hf's part only for this architecture, no "
                "engine start (repeatable)")
    g.addoption("--backend", help="test_blend.py: blend_tool's --backend (cpu, cuda)")
    g.addoption("--kills", type=int, default=5, help="crash_test.py: SIGKILLs (default 5)")
    g.addoption("--clients", type=int, default=3, help="crash_test.py: PUT clients (default 3)")
    g.addoption("--seed", type=int, default=1, help="crash_test.py: the random seed (default 1)")
    g.addoption("--no-sync", action="store_true", help="crash_test.py: kvblendd --no-sync")


def _required(dest, option):
    """A session fixture named dest: the value of option, which the test needs (it fails,
    naming the option, where it was not given)."""

    @pytest.fixture(scope="session", name=dest)
    def value(request):
        v = request.config.getoption(dest)
        if v is None:
            pytest.fail(f"this test needs {option}", pytrace=False)
        return v

    return value


# kvblendd, kvblend, place_tool, crash_put, blend_tool, aegis_tool, engine_model, part
for _option, (_dest, _) in _PROGRAMS.items():
    globals()[_dest] = _required(_dest, _option)
part = _required("part", "--part")


def pytest_sessionfinish(session, exitstatus):
    """Every test skipped: exit 77, which ctest's SKIP_RETURN_CODE reads as a skip (pytest
    itself exits 0 then, or 5, no tests collected, when a module skipped itself whole)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = reporter.stats if reporter else {}
    if exitstatus in (0, 5) and stats.get("skipped") and not any(
            stats.get(k) for k in ("passed", "failed", "error", "xpassed", "xfailed")):
        session.exitstatus = 77
