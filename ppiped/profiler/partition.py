"""Pre-partitioning: group consecutive layers into N blocks of about equal runtime (PPipe §5.1).

The planner only ever cuts at block boundaries, so blocks bound how finely work can be balanced
across GPUs; equal blocks keep that granularity uniform. Cuts are taken only at valid points.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from ..errors import InputError


@dataclass(frozen=True)
class Block:
    """Layers [start, end) of the topological order; ``cut_in``/``cut_out`` are tensor names."""

    index: int
    start: int
    end: int
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    out_bytes: int  # fp16 bytes of the boundary leaving the block, batch size 1 (0 for the last)


# A cut that carries t tensors costs (t - 1) x (this share of the mean block)^2 in the balanced
# rule: a cut of several tensors (more bytes, more frames per hop) is taken only where it
# balances the blocks clearly better than a one-tensor cut would.
EXTRA_TENSOR_SHARE = 0.25
# Units the balanced rule's exact programme takes as they are; a longer graph is coarsened.
MAX_DP_UNITS = 4000


def choose_cuts(unit_cost: Sequence[float], n_blocks: int, method: str = "balanced",
                extra_tensors: Sequence[int] | None = None) -> list[int]:
    """Split units (indivisible runs of layers) into ``n_blocks`` groups of about equal cost.

    Returns the ``n_blocks - 1`` unit indices after which a new block starts. ``greedy`` is the
    paper's rule: fill a block until it is closest to an equal share of what is left. ``balanced``
    minimises the sum of squared deviations from the mean block exactly (dynamic programming),
    plus :data:`EXTRA_TENSOR_SHARE`'s charge for each tensor a cut carries beyond one
    (``extra_tensors[i]`` for the cut after unit ``i``); both see the same valid cut points.
    """
    costs = np.asarray(unit_cost, dtype=np.float64)
    m = len(costs)
    if n_blocks < 1:
        raise InputError("--blocks must be at least 1")
    if n_blocks > m:
        raise InputError(f"cannot make {n_blocks} blocks: the model has only {m - 1} valid cut points "
                         f"(at most {m} blocks)")
    if np.any(costs < 0):
        raise ValueError("unit costs must be non-negative")
    if method == "greedy":
        return _greedy(costs, n_blocks)
    if method == "balanced":
        extra = np.zeros(max(0, m - 1)) if extra_tensors is None else np.asarray(extra_tensors, dtype=np.float64)
        if len(extra) != max(0, m - 1):
            raise ValueError(f"extra_tensors has {len(extra)} entries for {m - 1} cuts")
        if m <= MAX_DP_UNITS or m <= n_blocks * 4:
            return _balanced(costs, n_blocks, extra)
        # Past MAX_DP_UNITS units the exact programme (blocks x units^2) ran for minutes (150,000
        # one-layer units: killed after 120 s): runs of g consecutive units become one, and only
        # the cuts between runs are offered; each block still spans hundreds of runs.
        g = -(-m // MAX_DP_UNITS)
        starts = np.arange(0, m, g)
        grouped = np.add.reduceat(costs, starts)
        cuts = _balanced(grouped, n_blocks, extra[starts[1:] - 1])
        return [int(min(m - 1, (c + 1) * g) - 1) for c in cuts]
    raise InputError(f"unknown partition method {method!r} (greedy, balanced)")


def _greedy(costs: np.ndarray, n: int) -> list[int]:
    cum = np.concatenate([[0.0], np.cumsum(costs)])
    m = len(costs)
    cuts: list[int] = []
    start = 0
    for b in range(n - 1):
        share = (cum[m] - cum[start]) / (n - b)
        # Block ends after unit e (start <= e); leave at least one unit per remaining block.
        last = m - (n - b - 1) - 1
        ends = np.arange(start, last + 1)
        e = int(ends[np.argmin(np.abs(cum[ends + 1] - cum[start] - share))])
        cuts.append(e)
        start = e + 1
    return cuts


def _balanced(costs: np.ndarray, n: int, extra: np.ndarray) -> list[int]:
    cum = np.concatenate([[0.0], np.cumsum(costs)])
    m = len(costs)
    mean = cum[m] / n
    # charge[i]: what starting a block at unit i costs (the cut after unit i - 1); none at 0
    charge = np.concatenate([[0.0], extra * (EXTRA_TENSOR_SHARE * mean) ** 2])
    # best[b][j]: least sum of squared deviations from the mean covering units [0, j) with b
    # blocks. Squares punish the worst block hardest yet still balance all the others (a pure
    # min-max leaves every block but the worst arbitrary).
    best = np.full((n + 1, m + 1), np.inf)
    arg = np.zeros((n + 1, m + 1), dtype=np.int64)
    best[0][0] = 0.0
    for b in range(1, n + 1):
        for j in range(b, m - (n - b) + 1):
            i = np.arange(b - 1, j)
            total = best[b - 1][i] + (cum[j] - cum[i] - mean) ** 2 + charge[i]
            k = int(np.argmin(total))
            best[b][j] = total[k]
            arg[b][j] = i[k]
    cuts: list[int] = []
    j = m
    for b in range(n, 0, -1):
        i = int(arg[b][j])
        if b > 1:
            cuts.append(i - 1)
        j = i
    return sorted(cuts)


def block_costs(unit_cost: Sequence[float], cuts: Sequence[int]) -> list[float]:
    """Cost of each block given the unit indices after which blocks end."""
    out: list[float] = []
    start = 0
    for e in [*cuts, len(unit_cost) - 1]:
        out.append(float(sum(unit_cost[start:e + 1])))
        start = e + 1
    return out


def max_deviation(costs: Sequence[float]) -> float:
    """Largest |block - mean| / mean: the balance figure the issue asks for."""
    a = np.asarray(costs, dtype=np.float64)
    mean = a.mean()
    return float(np.max(np.abs(a - mean)) / mean) if mean > 0 else 0.0
