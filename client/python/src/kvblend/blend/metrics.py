"""The blend's selection metrics, defined once (docs/fuse.md, "Selection").

Each metric says how the tokens to recompute are chosen:

- the HKVD metrics (``"value"``, ``"key"``, ``"attention"``) run at check layers in the
  daemon, which compares the fresh plane with the stored, re-rotated rows (the
  ``"attention"`` metric weighs that by A, the question's preview);
- the node's metrics (``"question"``, ``"anchored"``) have no check layer: the node
  previews the question over the stored rows and recomputes the chunk tokens it reads
  most at every layer (:func:`kvblend.blend.preview.node_selection`).

A new metric is a row of :data:`METRICS` and its implementation (the daemon's code or the
preview's); the connector's settings, :mod:`kvblend.hf`, the client and the planner read
this table. Imports nothing but the standard library.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    """One selection metric.

    ``daemon``: its code in a fuse session's parameters (``kvb_fuse_params.metric``), or
    None for a metric the node selects by with no check layer. ``preview``: how much of
    the question's preview it runs before the pass: ``"none"``, ``"full"`` (every layer)
    or ``"anchored"`` (anchor tokens up to the critical layer,
    :func:`kvblend.blend.preview.anchors`). ``checks``, ``ratios``: its check layers and
    ratios when settings name the metric and not them.
    """

    name: str
    daemon: int | None
    preview: str
    checks: tuple[int, ...]
    ratios: tuple[float, ...]

    @property
    def node_selects(self) -> bool:
        """Whether the node makes the selection itself (no check layer, one ratio)."""
        return self.daemon is None


#: Every metric, by name, in the order error messages list them.
METRICS = {
    m.name: m
    for m in (
        Metric("value", 0, "none", (1,), (0.15,)),
        Metric("key", 1, "none", (1,), (0.15,)),
        Metric("attention", 2, "full", (1,), (0.15,)),
        Metric("question", None, "full", (), (0.15,)),
        Metric("anchored", None, "anchored", (), (0.15,)),
    )
}
#: The metrics' names.
NAMES = tuple(METRICS)
#: The metrics whose selection the node makes from its preview, with no check layer.
NODE_SELECTS = tuple(n for n, m in METRICS.items() if m.node_selects)
#: The daemon's code of each metric it selects by at check layers.
DAEMON_CODES = {n: m.daemon for n, m in METRICS.items() if m.daemon is not None}
#: The default metric (docs/EVAL.md, "The default, from bench_rag").
DEFAULT = "anchored"


def node_selects(metric: str) -> bool:
    """Whether ``metric`` (a name of :data:`METRICS`) is one the node selects by."""
    return METRICS[metric].node_selects


def check_name(metric: object, where: str = "metric") -> str:
    """Return ``metric`` if it names a metric; raise ValueError naming them all otherwise."""
    if metric not in METRICS:
        raise ValueError(f"{where} {metric!r}: {', '.join(map(repr, NAMES))}")
    return str(metric)
