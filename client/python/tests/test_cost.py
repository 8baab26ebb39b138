"""kvblend.vllm.cost: the load-or-compute decision from measured rates (no engine)."""

from __future__ import annotations

from kvblend.vllm import cost


class Clock:
    """A clock the test moves."""

    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def model(**kw):
    clock = Clock()
    return cost.CostModel(clock=clock, **kw), clock


def test_loads_until_both_rates_are_measured():
    m, _ = model()
    assert m.pays(cost.REUSE, 512)[0]
    m.note([(cost.REUSE, 512, 10.0)] * cost.MIN_SAMPLES)  # very slow, but no prefill rate
    assert m.pays(cost.REUSE, 512)[0]
    m.note([(cost.PREFILL, 512, 0.5)] * (cost.MIN_SAMPLES - 1))  # not enough steps yet
    assert m.pays(cost.REUSE, 512)[0]
    assert m.declined_loads == 0
    m.note([(cost.PREFILL, 512, 0.5)])
    assert not m.pays(cost.REUSE, 512)[0]


def test_decode_steps_do_not_measure_the_prefill():
    m, _ = model()
    m.note([(cost.PREFILL, cost.MIN_STEP_TOKENS - 1, 5.0), (cost.REUSE, 100, 1.0)])
    assert cost.PREFILL not in m.spt
    assert m.pays(cost.REUSE, 100)[0]


def test_a_load_that_loses_is_computed_and_counted():
    m, clock = model()
    m.note([(cost.PREFILL, 1000, 1.0)] * 3)  # 1 ms a token
    m.note([(cost.REUSE, 1000, 0.05)] * 3)  # 50 us a token: loading pays
    ok, d, changed = m.pays(cost.REUSE, 300)
    assert ok and d.pays and not changed
    for _ in range(20):  # the daemon slows down: 5 ms a token
        m.note([(cost.REUSE, 1000, 5.0)])
    ok, d, changed = m.pays(cost.REUSE, 300)
    assert not ok and not d.pays and changed
    assert d.load_spt > d.prefill_spt
    ok, _, changed = m.pays(cost.REUSE, 200)
    assert not ok and not changed
    assert (m.declined_loads, m.declined_tokens) == (2, 500)
    # blends are judged on their own rate
    assert m.pays(cost.BLEND, 300)[0]


def test_a_probe_measures_again_and_a_recovered_daemon_is_used():
    m, clock = model()
    m.note([(cost.PREFILL, 1000, 1.0)] * 3 + [(cost.REUSE, 1000, 5.0)] * 5)
    assert not m.pays(cost.REUSE, 100)[0]
    clock.t += cost.PROBE_S - 1
    assert not m.pays(cost.REUSE, 100)[0]
    clock.t += 1
    assert m.pays(cost.REUSE, 100)[0]  # the probe goes ahead
    assert not m.pays(cost.REUSE, 100)[0]  # and only one
    for _ in range(20):  # what the probes measure: the daemon is fast again
        m.note([(cost.REUSE, 1000, 0.01)])
    ok, d, changed = m.pays(cost.REUSE, 100)
    assert ok and d.pays and changed


def test_margin_and_off_switch():
    m, _ = model(margin=3.0)
    m.note([(cost.PREFILL, 1000, 1.0), (cost.REUSE, 1000, 2.0)] * 3)
    assert m.pays(cost.REUSE, 100)[0]  # twice the prefill's time, within 3x
    off, _ = model(enabled=False)
    off.note([(cost.PREFILL, 1000, 1.0), (cost.REUSE, 1000, 50.0)] * 3)
    assert off.pays(cost.REUSE, 100)[0]
    assert off.declined_loads == 0


def blend_sample(context, computed, a=0.0003, b=0.0012):
    """A blend pass's sample with a known cost: ``a`` per context token, ``b`` per computed."""
    return (cost.BLEND, context, a * context + b * computed, computed, context)


def test_a_blend_is_judged_by_its_share_of_stored_tokens():
    m, _ = model()
    m.note([(cost.PREFILL, 1000, 1.0)] * 3)  # 1 ms a token
    # passes of several shapes: 0.3 ms a context token and 1.2 ms a computed one
    m.note([blend_sample(800, 300), blend_sample(900, 150), blend_sample(700, 350)])
    a, b = m.blend_coefficients()
    assert abs(a - 0.0003) < 1e-9 and abs(b - 0.0012) < 1e-9
    # mostly stored (150 of 900 computed): 0.47 s against 0.9 s of prefill
    ok, d, _ = m.pays(cost.BLEND, 900, 900, 150)
    assert ok and abs(d.load_spt - (0.0003 * 900 + 0.0012 * 150) / 900) < 1e-12
    # mostly missing (700 of 900 computed): 1.11 s against 0.9 s: computed instead
    ok, d, changed = m.pays(cost.BLEND, 900, 900, 700)
    assert not ok and changed and d.load_spt > d.prefill_spt
    # the scalar rate alone (no counts given) would have let it through
    assert m.spt[cost.BLEND] < m.spt[cost.PREFILL]
    assert m.pays(cost.BLEND, 900)[0]


def test_the_blend_fit_waits_for_samples_that_determine_it():
    m, _ = model()
    m.note([(cost.PREFILL, 1000, 1.0)] * 3)
    m.note([blend_sample(1000, 300)] * 3)  # one shape: a and b not told apart
    assert m.blend_coefficients() is None
    # the per-token rate decides then: 0.66 ms a token, whatever the request's share
    assert m.pays(cost.BLEND, 900, 900, 850)[0]
    # old samples fade: a slower daemon shows within a few passes
    m.note([blend_sample(1000, 200), blend_sample(600, 500)])
    assert m.blend_coefficients() is not None
    for _ in range(20):
        m.note([blend_sample(1000, 200, a=0.002), blend_sample(600, 500, a=0.002)])
    a, _ = m.blend_coefficients()
    assert a > 0.0019
    assert not m.pays(cost.BLEND, 900, 900, 150)[0]
