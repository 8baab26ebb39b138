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


#: Blend passes shaped like issue 55's: a few default (r = 0.15) blends at 0.48 ms a token,
#: then per-request ``"ratios": [1.0]`` blends at 3.3-6.5 ms a token (seconds per token,
#: context tokens), which the linear model explains worse than the r = 0.15 ones.
ORDINARY = [blend_sample(n, int(0.15 * n)) for n in (800, 1000, 1200)]
FULL_RATIO = [
    (cost.BLEND, n, spt * n, n, n)
    for spt, n in ((0.0033, 1300), (0.0051, 900), (0.0065, 1300), (0.0042, 900),
                   (0.0038, 1300), (0.0059, 600), (0.0047, 1300), (0.0036, 900))
]
#: Passes where the context term dominates: r = 0.15 passes cost more a token than r = 1.0
#: ones (the computed term's unconstrained fit is negative).
CONTEXT_BOUND = [blend_sample(n, int(0.15 * n), a=0.001, b=0.0) for n in (800, 1000, 1200)] + [
    (cost.BLEND, n, 0.0009 * n, n, n) for n in (900, 1300, 600)
]


def decayed_sums(samples):
    """The fit's normal equations computed here from the samples, as the module's text
    defines them (weight FIT_KEEP ** age): nn, nm, mm, ny, my."""
    sums = [0.0] * 5
    for age, (_, _, y, m, n) in enumerate(reversed(samples)):
        w = cost.FIT_KEEP**age
        for i, v in enumerate((n * n, n * m, m * m, n * y, m * y)):
            sums[i] += w * v
    return sums


def test_the_blend_fit_has_no_negative_term():
    for samples in (ORDINARY + FULL_RATIO, CONTEXT_BOUND):
        m, _ = model()
        m.note(samples)
        nn, nm, mm, ny, my = decayed_sums(samples)
        det = nn * mm - nm * nm
        free = ((ny * mm - my * nm) / det, (my * nn - ny * nm) / det)
        assert min(free) < 0  # the unconstrained least squares has a negative term
        fit = m.blend_coefficients()
        assert fit is not None
        a, b = fit
        assert a >= 0 and b >= 0
        # the best fit with both terms >= 0 (the squared error is convex, so these
        # Karush-Kuhn-Tucker conditions make it the optimum): the error's slope is zero
        # along a positive term and does not fall into a zero term. Tolerance: the sums
        # are about 1e7 and agree to rounding, so 1e-9 of the scale.
        ga, gb = a * nn + b * nm - ny, a * nm + b * mm - my
        tol = 1e-9 * max(ny, my)
        assert (abs(ga) <= tol) if a > 0 else (ga >= -tol)
        assert (abs(gb) <= tol) if b > 0 else (gb >= -tol)
        assert a == 0 or b == 0  # here the optimum lies on a boundary


def test_a_run_of_full_ratio_blends_never_declines_an_ordinary_blend():
    m, _ = model()
    m.note([(cost.PREFILL, 1000, 1.2)] * 3)  # 1.2 ms a token
    m.note(ORDINARY)
    for sample in FULL_RATIO:
        m.note([sample])
        # a default blend of 900 context tokens recomputing 15%: 0.1-0.8 ms a token by
        # the fit against the prefill's 1.2 ms; the blends' per-token rate is 2-5 ms
        load, d, _ = m.pays(cost.BLEND, 900, 900, 135)
        assert load and d.pays, f"declined after {sample}: {d}"
        assert d.load_spt < d.prefill_spt
    assert m.spt[cost.BLEND] > m.spt[cost.PREFILL]  # the rate alone would have declined it
    assert m.declined_loads == 0


def test_a_long_run_of_full_ratio_blends_keeps_the_last_fit():
    """Thirty ratio-1.0 blends in a row fade the default ones out of the decayed sums (the
    fit alone would be undetermined again): the last determined fit still decides."""
    m, _ = model()
    m.note([(cost.PREFILL, 1000, 1.2)] * 3)
    m.note(ORDINARY)
    for i in range(30):
        m.note([FULL_RATIO[i % len(FULL_RATIO)]])
        load, d, _ = m.pays(cost.BLEND, 900, 900, 135)
        assert load and d.pays, f"declined after {i + 1} ratio-1.0 blends: {d}"
    nn, nm, mm = m._fit[:3]
    assert nn * mm - nm * nm <= 0.01 * nn * mm  # the sums alone no longer determine it
    assert m.declined_loads == 0


def fitted(a=1e-4, b=1e-3, prefill=2e-3):
    """A model whose blend fit is seconds = a * context + b * computed, prefill ``prefill``
    seconds a token (samples of two shapes determine both terms)."""
    m, _ = model()
    for n, c in ((1000, 100), (1000, 500), (2000, 300), (2000, 1000)):
        m.note([(cost.BLEND, n, a * n + b * c, c, n)])
    m.note([(cost.PREFILL, 512, 512 * prefill)] * cost.MIN_SAMPLES)
    return m


def test_a_latency_budget_picks_the_largest_ratio_that_fits():
    m = fitted()
    a, b = m.blend_coefficients()
    assert abs(a - 1e-4) < 1e-9 and abs(b - 1e-3) < 1e-9
    # 2000 tokens, 100 fresh, 1900 stored: 0.2 s + 1 ms a computed row
    r, why = m.blend_ratio(2000, 2000, 100, 1900, 0.6, 0.0, 0.15)
    assert why == "the latency budget"
    assert abs(r - (0.4 / 1e-3 - 100) / 1900) < 1e-9  # 300 of the 1900 rows
    assert abs(a * 2000 + b * (100 + r * 1900) - 0.6) < 1e-9
    # a budget the context alone passes: nothing but the fresh rows; a generous one: all
    assert m.blend_ratio(2000, 2000, 100, 1900, 0.1, 0.0, 0.15)[0] == 0.0
    assert m.blend_ratio(10000, 2000, 100, 1900, 60.0, 0.0, 0.15)[0] == 1.0


def test_a_budget_never_buys_more_than_the_prefill_it_replaces():
    m = fitted(prefill=5e-4)  # prefill 2000 tokens: 1 s, under the 5 s budget
    r, why = m.blend_ratio(2000, 2000, 100, 1900, 5.0, 0.0, 0.15)
    assert why == "the prefill it replaces"
    assert abs(0.2 + 1e-3 * (100 + r * 1900) - 1.0) < 1e-9
    assert m.pays(cost.BLEND, 2000, 2000, 100 + int(r * 1900))[0]


def test_the_quality_floor_and_the_ratio_before_a_fit():
    m = fitted()
    assert m.blend_ratio(2000, 2000, 100, 1900, 0.1, 0.25, 0.15) == (0.25, "the quality floor")
    # (a floor that costs more than the prefill: pays() then declines the blend)
    assert not fitted(prefill=1e-4).pays(cost.BLEND, 2000, 2000, 100 + int(0.9 * 1900))[0]
    fresh_model, _ = model()
    assert fresh_model.blend_ratio(2000, 2000, 100, 1900, 0.6, 0.0, 0.15)[0] == 0.15
    assert fresh_model.blend_ratio(2000, 2000, 100, 1900, 0.6, 0.3, 0.15)[0] == 0.3
