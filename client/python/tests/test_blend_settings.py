"""kvblend.vllm.plan: the connector's blend settings, the node-selecting metrics (no engine)."""

from __future__ import annotations

import pytest

from kvblend.vllm import plan

L = 30


def settings(raw, base=plan.DEFAULT_CONFIG):
    return plan.blend_settings(raw, L, base, "blend")


def test_defaults_are_the_anchored_metric():
    # docs/EVAL.md, "The default, from bench_rag"
    assert settings({}) == plan.BlendConfig((), (0.15,), "anchored")
    assert settings({"ratios": [0.3]}) == plan.BlendConfig((), (0.3,), "anchored")


@pytest.mark.parametrize(
    "raw, want",
    [
        ({"check_layers": [1], "ratios": [0.3]}, ((1,), (0.3,), "value")),
        ({"check_layers": [2, 5]}, None),  # value's one ratio for two layers: refused
        ({"check_layers": [4]}, ((4,), (0.15,), "value")),
        ({"check_layers": [], "ratios": []}, ((), (), "value")),  # full reuse, as before
        ({"metric": "key"}, ((1,), (0.15,), "key")),
    ],
)
def test_check_layers_without_a_metric_mean_value(raw, want):
    # settings written when value was the default keep their meaning
    if want is None:
        with pytest.raises(ValueError, match="one ratio per check layer"):
            settings(raw)
        return
    assert settings(raw) == plan.BlendConfig(*want)
    # and so does a request's override of the default
    assert settings(raw, settings({})) == plan.BlendConfig(*want)


@pytest.mark.parametrize("metric", plan.NODE_SELECTS)
def test_node_selecting_metric_takes_its_own_defaults(metric):
    # named over the check-layer default: no check layer, one ratio
    assert settings({"metric": metric}) == plan.BlendConfig((), (0.15,), metric)
    own = settings({"metric": metric, "ratios": [0.3]})
    assert own == plan.BlendConfig((), (0.3,), metric)
    # a request's override over it keeps its kind, or brings the check layer back
    assert settings({"ratios": [0.05]}, own) == plan.BlendConfig((), (0.05,), metric)
    assert settings({"metric": "value"}, own) == plan.BlendConfig((1,), (0.15,), "value")
    assert settings({"metric": "attention"}, own) == plan.BlendConfig((1,), (0.15,), "attention")


@pytest.mark.parametrize("metric", plan.NODE_SELECTS)
@pytest.mark.parametrize(
    "raw, words",
    [
        ({"check_layers": [1]}, "check_layers must be empty"),
        ({"ratios": [0.3, 0.1]}, "one ratio for the"),
        ({"ratios": []}, "one ratio for the"),
        ({"ratios": [1.5]}, "in [0, 1]"),
    ],
)
def test_node_selecting_metric_refuses_check_layers_and_ratio_lists(metric, raw, words):
    with pytest.raises(ValueError) as e:
        settings({"metric": metric, **raw})
    assert words in str(e.value)


def test_unknown_metric_names_every_metric():
    with pytest.raises(ValueError) as e:
        settings({"metric": "cosine"})
    for m in plan.METRICS:
        assert repr(m) in str(e.value)


def test_predicted_computed_counts_the_node_selection():
    # 100 context tokens: 20 fresh, then 80 of a chunk
    segs = [(20, 0), (b"\0" * 32, 20)]
    ids = list(range(100))
    q = plan.BlendLoad(ids, segs, plan.BlendConfig((), (0.25,), "anchored"))
    assert q.predicted_computed() == 20 + 20  # the fresh tokens and 0.25 of 80
    v = plan.BlendLoad(ids, segs, plan.BlendConfig((1,), (0.25,), "value"))
    assert v.predicted_computed() == 40
    reuse = plan.BlendLoad(ids, segs, plan.BlendConfig((), (), "value"))
    assert reuse.predicted_computed() == 20


def test_a_latency_budget_and_a_quality_floor():
    got = settings({"budget_ms": 250, "min_ratio": 0.05})
    assert (got.metric, got.budget_ms, got.min_ratio, got.ratios) == ("anchored", 250.0, 0.05,
                                                                       (0.15,))
    # a request's override keeps the connector's budget unless it names its own
    assert settings({"ratios": [0.3]}, got).budget_ms == 250.0
    assert settings({"budget_ms": 100}, got).budget_ms == 100.0
    # switching to a metric with check layers drops the budget (it picks one node ratio)
    assert settings({"metric": "value"}, got).budget_ms is None
    for raw, msg in (({"metric": "value", "budget_ms": 100}, "node metric"),
                     ({"budget_ms": 0}, "above 0"), ({"budget_ms": True}, "above 0"),
                     ({"budget_ms": "fast"}, "above 0"), ({"min_ratio": 1.5}, r"in \[0, 1\]")):
        with pytest.raises(ValueError, match=msg):
            settings(raw)


def test_prefix_hits_are_not_counted_as_computed_rows():
    cfg = settings({})  # anchored, r = 0.15
    # 10 fresh, a 100-token chunk, 20 fresh, a 70-token chunk; vLLM holds the first 64
    load = plan.BlendLoad(list(range(200)), [(10, 0), (b"a" * 32, 10), (20, 110),
                                             (b"b" * 32, 130)], cfg, skip=64)
    assert load.computable() == (20, 46 + 70)
    assert load.predicted_computed() == 20 + round(0.15 * 116)
    value = plan.BlendLoad(load.ids, load.segments, settings({"check_layers": [1]}), skip=64)
    assert value.computable() == (30, 170)  # check layers: every row through them
