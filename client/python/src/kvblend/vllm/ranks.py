"""A tensor-parallel group blending together (:class:`kvblend.blend.loop.Ranks`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import torch


@dataclass
class TensorRanks:
    """This worker's tensor-parallel group, for a blend pass every rank runs together.

    ``group`` is vLLM's tensor-parallel GroupCoordinator (its ``cpu_group`` carries these
    small collectives); ``heads`` the rank's KV heads (first, count). Implements
    :class:`kvblend.blend.loop.Ranks`, and :meth:`agree_min` for the batch's size.
    """

    group: Any
    heads: tuple[int, int]

    def _reduce(self, t: torch.Tensor, op: Any = None) -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(t, op=op or dist.ReduceOp.SUM, group=self.group.cpu_group)
        return t

    def agree(self, ok: bool) -> bool:
        return int(self._reduce(torch.tensor([0 if ok else 1], dtype=torch.int32)).item()) == 0

    def agree_min(self, n: int) -> int:
        import torch.distributed as dist

        return int(self._reduce(torch.tensor([n], dtype=torch.int64), dist.ReduceOp.MIN).item())

    def total(self, x: np.ndarray) -> np.ndarray:
        """The ranks' x summed, in float64 (a node selection's scores)."""
        return self._reduce(torch.from_numpy(np.array(x, np.float64))).numpy()

    def sum(self, dev: np.ndarray, ok: bool) -> np.ndarray | None:
        t = torch.empty(dev.size + 1, dtype=torch.float32)
        t[0] = 0.0 if ok else 1.0
        t[1:] = torch.from_numpy(np.ascontiguousarray(dev, np.float32))
        self._reduce(t)
        return None if float(t[0]) > 0 else t[1:].numpy()

