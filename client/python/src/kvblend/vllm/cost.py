"""Whether a load pays: its expected time against the prefill it replaces.

A load is worth it only while it costs the engine less than computing the same tokens
(the SIFT paper's warning: on a slow link or a loaded daemon, loading a chunk can take
longer than the prefill it replaces, and then a connector makes TTFT worse). The worker
measures both rates as the engine runs and reports them to the scheduler each step
(:class:`kvblend.vllm.metadata.KvblendWorkerMeta`); the scheduler asks
:meth:`CostModel.pays` before it claims a request's tokens, and computes them instead
when loading would lose.

Rates are seconds per token, exponentially weighted (:data:`WEIGHT` to the newest
sample, :data:`SLOWER_WEIGHT` to one slower than the rate): a load's time is what the
engine spent on it (a copied load or a blend pass: its whole time; a landing session:
opening it, the time the engine waited for its layers (the daemon lands them beside the
forward pass) and closing it); the prefill's is the forward pass of steps
that computed at least :data:`MIN_STEP_TOKENS` tokens and loaded nothing. Until both
have :data:`MIN_SAMPLES` samples, loads go ahead (the first loads measure them). Once
loading loses, one load every :data:`PROBE_S` seconds still goes ahead to measure the
daemon again, so a daemon that recovers is used again.

A blend is judged request by request. Its pass computes every context token through
the check layers and only the selected ones after them, so its time depends on how much
of the context was found stored: a blend whose chunks are mostly missing costs what a
prefill costs, plus the landing. The worker's blend samples carry both counts
(``(BLEND, claimed tokens, seconds, computed, context)``, computed = the rows recomputed
after the last check layer, fresh tokens included), and the model fits
``seconds = a * context + b * computed`` by least squares with both terms at least 0
over the recent samples (:data:`FIT_KEEP` per sample). Passes the line explains poorly
(blends at ``ratio`` 1.0, dearer a token than the default ratio's passes predict) make
one term of the unconstrained fit negative (more tokens would cost less); the fit is then
the best one with that term at 0. A request's blend goes ahead when ``a * context + b *
predicted computed`` is at most ``margin`` times the prefill of the tokens it claims.
Until the fit is first determined (samples of one shape only) it uses the blend's
per-token rate; a later run of one shape keeps the last determined fit.

Pure Python (no torch, no vLLM): unit-tested on its own.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

#: Weight of the newest sample in the running rates; a sample slower than the rate
#: weighs :data:`SLOWER_WEIGHT` (a daemon that slows down is noticed within a load or two,
#: one that recovers is trusted again more slowly, through probes).
WEIGHT = 0.3
SLOWER_WEIGHT = 0.6
#: Steps that computed fewer tokens (decode steps) say little about the prefill rate.
MIN_STEP_TOKENS = 64
#: While loading loses, one load in this many seconds goes ahead to measure again.
PROBE_S = 30.0
#: Samples of a kind (and of prefill steps) before a decision: the first loads and steps
#: of an engine carry one-time costs (allocations, first calls) that say nothing of the rate.
MIN_SAMPLES = 3

#: Weight kept by the blend fit's sums at each new sample (about 1 / (1 - FIT_KEEP)
#: recent samples count).
FIT_KEEP = 0.85

#: Sample kinds: tokens loaded as stored (re-rotated), tokens blended, tokens prefilled.
REUSE, BLEND, PREFILL = "reuse", "blend", "prefill"


@dataclass
class Decision:
    """The last answer for a kind of load, for the log line when it changes."""

    pays: bool = True
    load_spt: float | None = None
    prefill_spt: float | None = None


@dataclass
class CostModel:
    """Running load and prefill rates, and the decision they give.

    Parameters
    ----------
    margin : float
        A load goes ahead while its seconds per token are at most ``margin`` times the
        prefill's (1.0: whichever is faster).
    enabled : bool
        False: every load goes ahead (``load_cost_check: false``).
    clock : callable
        Seconds, monotonic (tests pass their own).
    """

    margin: float = 1.0
    enabled: bool = True
    clock: Callable[[], float] = time.monotonic
    spt: dict[str, float] = field(default_factory=dict)
    samples: dict[str, int] = field(default_factory=dict)
    declined_loads: int = 0
    declined_tokens: int = 0
    _last: dict[str, Decision] = field(default_factory=dict)
    _probed: dict[str, float] = field(default_factory=dict)
    #: The blend fit's decayed sums: n*n, n*m, m*m, n*y, m*y (n context, m computed).
    _fit: list[float] = field(default_factory=lambda: [0.0] * 5)
    #: The last fit the samples determined: kept while a run of one shape (say, blends at
    #: ratio 1.0 only) fades the others out of the sums and leaves both terms undetermined.
    _last_fit: tuple[float, float] | None = None

    def note(self, samples: Iterable[tuple]) -> None:
        """Take the worker's samples: ``(kind, tokens, seconds)`` each.

        A blend's may add ``computed, context``: the rows its pass recomputed after the
        last check layer and the tokens of its context (the fit's two counts).
        """
        for kind, tokens, seconds, *rest in samples:
            if tokens <= 0 or seconds < 0:
                continue
            if kind == BLEND and len(rest) == 2 and rest[1] > 0:
                n, m = float(rest[1]), float(min(max(rest[0], 0), rest[1]))
                self._fit = [
                    FIT_KEEP * a + b
                    for a, b in zip(self._fit, (n * n, n * m, m * m, n * seconds, m * seconds))
                ]
            if kind == PREFILL and tokens < MIN_STEP_TOKENS:
                continue
            rate = seconds / tokens
            self.samples[kind] = self.samples.get(kind, 0) + 1
            old = self.spt.get(kind)
            w = SLOWER_WEIGHT if old is not None and rate > old else WEIGHT
            self.spt[kind] = rate if old is None else (1 - w) * old + w * rate

    def blend_coefficients(self) -> tuple[float, float] | None:
        """Return the fit's (seconds per context token, seconds per computed token), or None.

        The least squares fit with both terms at least 0 (non-negative least squares on
        the two normal equations): the unconstrained solution when both of its terms are,
        else the better, by squared error, of the two one-term fits (context only,
        computed only). While the samples do not determine both terms (all of one shape),
        the last fit they did determine; None before there was one (the blend's per-token
        rate is used then).
        """
        nn, nm, mm, ny, my = self._fit
        det = nn * mm - nm * nm
        if nn <= 0 or mm <= 0 or det <= 0.01 * nn * mm:
            return self._last_fit
        a, b = (ny * mm - my * nm) / det, (my * nn - ny * nm) / det
        if a < 0 or b < 0:
            # A term at 0: the squared error is sum(y*y) - ny*ny/nn with b = 0 and
            # sum(y*y) - my*my/mm with a = 0 (times are never negative, so both slopes
            # are at least 0); the smaller error wins.
            a, b = (ny / nn, 0.0) if ny * ny * mm >= my * my * nn else (0.0, my / mm)
        self._last_fit = (a, b)
        return a, b

    def blend_ratio(
        self,
        tokens: int,
        context: int,
        fresh: int,
        chunk: int,
        budget_s: float,
        floor: float,
        default: float,
    ) -> tuple[float, str]:
        """The ratio of a blend asked for by a latency budget: ``(r, why)``.

        The largest share r of the ``chunk`` stored chunk tokens the pass may recompute
        whose predicted pass (``a * context + b * (fresh + r * chunk)``, the fit)
        fits in ``budget_s`` and costs no more than the prefill of the ``tokens`` it
        claims; at least ``floor`` (the quality floor: a blend that must recompute more
        than the prefill costs is then declined by :meth:`pays`), at most 1. Before the fit
        is determined, or without a prefill rate, ``default`` (the settings' ratio),
        raised to ``floor``. ``why`` says which bound decided, for the log.
        """
        fit, prefill = self.blend_coefficients(), self.spt.get(PREFILL)
        if fit is None or prefill is None or chunk == 0:
            return max(default, floor), "the settings' ratio (no cost fit yet)"
        a, b = fit
        limit, why = budget_s, "the latency budget"
        if prefill * tokens < limit:
            limit, why = prefill * tokens, "the prefill it replaces"
        if b <= 0:
            r = 1.0 if a * context <= limit else 0.0
        else:
            r = ((limit - a * context) / b - fresh) / chunk
        r = min(max(r, 0.0), 1.0)
        if r < floor:
            return floor, "the quality floor"
        return r, why

    def pays(
        self, kind: str, tokens: int, context: int | None = None, computed: int | None = None
    ) -> tuple[bool, Decision, bool]:
        """Whether to load ``tokens`` tokens of this kind rather than compute them.

        A blend may say its pass's ``context`` tokens and how many it will compute
        (``computed``): its time is then predicted by the fit (see the module's text),
        and :attr:`Decision.load_spt` is that prediction per claimed token.

        Returns ``(load, decision, changed)``: ``changed`` is true when the decision for
        this kind differs from the last one (the caller logs it once per change). A
        declined load is counted in :attr:`declined_loads` and :attr:`declined_tokens`.
        """
        load, prefill = self.spt.get(kind), self.spt.get(PREFILL)
        fit = self.blend_coefficients() if kind == BLEND and computed is not None else None
        if fit is not None and tokens > 0:
            n = tokens if context is None else context
            load = (fit[0] * n + fit[1] * min(computed, n)) / tokens
        d = Decision(True, load, prefill)
        measured = min(self.samples.get(kind, 0), self.samples.get(PREFILL, 0)) >= MIN_SAMPLES
        if self.enabled and tokens > 0 and measured:
            d.pays = load <= prefill * self.margin
        last = self._last.get(kind, Decision())
        changed = d.pays != last.pays
        self._last[kind] = d
        if d.pays:
            return True, d, changed
        now = self.clock()
        if changed:
            self._probed[kind] = now  # the window starts when loading starts to lose
        elif now - self._probed.get(kind, now) >= PROBE_S:
            self._probed[kind] = now
            return True, d, changed  # a probe: this load measures the daemon again
        self.declined_loads += 1
        self.declined_tokens += tokens
        return False, d, changed
