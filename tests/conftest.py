"""pytest's setup for the tests under tests/ (ctest: python3 -m pytest -q -p no:cacheprovider
FILE OPTIONS, tests/CMakeLists.txt): this build's programs and the tests' settings as
command-line options, each a fixture of the same name (a test that needs one that was not
given fails, naming it), and a run whose every test was skipped exits 77, ctest's skip.

    python3 -m pytest tests/integration/test_curve.py \\
        --kvblendd build/bin/kvblendd --kvblend build/bin/kvblend
"""

import pytest

# option: (fixture, help); the options' values are strings unless typed below
_PROGRAMS = {
    "--kvblendd": ("kvblendd", "this build's kvblendd"),
    "--kvblend": ("kvblend", "this build's kvblend CLI"),
    "--place-tool": ("place_tool", "this build's place_tool (tests/integration/place_tool.c)"),
    "--crash-put": ("crash_put", "this build's crash_put (tests/crash/crash_put.c)"),
    "--blend-tool": ("blend_tool", "this build's blend_tool (tests/blend/blend_tool.c)"),
}


def pytest_addoption(parser):
    g = parser.getgroup("kvblend", "kvblend's tests")
    for opt, (dest, text) in _PROGRAMS.items():
        g.addoption(opt, dest=dest, help=text)
    g.addoption("--part", help="test_cluster_ops.py: the part to run (join, hedge, ...)")
    g.addoption("--backend", help="test_blend.py: blend_tool's --backend (cpu, cuda)")
    g.addoption("--kills", type=int, default=5, help="crash_test.py: SIGKILLs (default 5)")
    g.addoption("--clients", type=int, default=3, help="crash_test.py: PUT clients (default 3)")
    g.addoption("--seed", type=int, default=1, help="crash_test.py: the random seed (default 1)")
    g.addoption("--no-sync", action="store_true", help="crash_test.py: kvblendd --no-sync")


def _option(request, dest):
    value = request.config.getoption(dest)
    if value is None:
        pytest.fail(f"this test needs --{dest.replace('_', '-')}", pytrace=False)
    return value


@pytest.fixture(scope="session")
def kvblendd(request):
    return _option(request, "kvblendd")


@pytest.fixture(scope="session")
def kvblend(request):
    return _option(request, "kvblend")


@pytest.fixture(scope="session")
def place_tool(request):
    return _option(request, "place_tool")


@pytest.fixture(scope="session")
def crash_put(request):
    return _option(request, "crash_put")


@pytest.fixture(scope="session")
def blend_tool(request):
    return _option(request, "blend_tool")


@pytest.fixture(scope="session")
def part(request):
    return _option(request, "part")


def pytest_sessionfinish(session, exitstatus):
    """Every collected test skipped: exit 77, which ctest's SKIP_RETURN_CODE reads as a skip
    (pytest itself exits 0 then)."""
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    stats = reporter.stats if reporter else {}
    if exitstatus == 0 and stats.get("skipped") and not any(
            stats.get(k) for k in ("passed", "failed", "error", "xpassed", "xfailed")):
        session.exitstatus = 77
