"""kvblend.blend.metrics (the metric table read by the client, kvblend.hf and the connector)
and kvblend.blend.driver's segment layout; no engine, no daemon."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest

from kvblend import _lib
from kvblend.blend import metrics
from kvblend.vllm import plan

HEADER = Path(__file__).resolve().parents[2] / "include" / "kvblend.h"


def test_daemon_codes_are_the_c_headers():
    # enum kvb_metric in the public header: the codes the fuse session's parameters carry
    if not HEADER.exists():  # an installed package's tests without the checkout
        pytest.skip(f"{HEADER} not found")
    enum = re.search(r"enum kvb_metric \{([^}]*)\}", HEADER.read_text()).group(1)
    codes = {
        m.group(1).lower(): int(m.group(2))
        for m in re.finditer(r"KVB_METRIC_(\w+)\s*=\s*(\d+)", enum)
    }
    assert codes == metrics.DAEMON_CODES == _lib.METRICS


def test_one_table():
    assert plan.METRICS == metrics.NAMES == tuple(metrics.METRICS)
    assert set(plan.NODE_SELECTS) == {"question", "anchored"}
    # a node metric has no check layer and one ratio; an HKVD one a ratio per check layer
    for name, m in metrics.METRICS.items():
        assert plan.METRIC_DEFAULTS[name] == (m.checks, m.ratios)
        assert (m.checks == ()) == m.node_selects
        assert len(m.ratios) == (1 if m.node_selects else len(m.checks))
    assert plan.DEFAULT_CONFIG.metric == metrics.DEFAULT


def test_unknown_metric_named_with_the_known_ones():
    with pytest.raises(ValueError, match="'median'.*'value', 'key', 'attention'"):
        metrics.check_name("median")
    with pytest.raises(ValueError, match=r"blend\.metric 'median'"):
        plan.blend_settings({"metric": "median"}, 30, plan.DEFAULT_CONFIG, "blend")


def test_chunk_layout():
    driver = pytest.importorskip("kvblend.blend.driver")  # imports torch
    segs = [(3, 0), (b"a" * 32, 3), (b"b" * 32, 7), (np.int64(2), 12)]
    cached, spans = driver.chunk_layout(14, segs)
    assert spans == [(3, 4), (7, 5)]
    assert cached.tolist() == [False] * 3 + [True] * 9 + [False] * 2
    assert driver.is_fresh(segs[-1]) and not driver.is_fresh(segs[1])
