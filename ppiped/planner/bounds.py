"""A combinatorial upper bound on the MILP's objective that knows vGPUs come in whole units.

The LP relaxation lets a pool hold 8.0007 GPUs; the true optimum cannot, and CBC spends nearly
all its time proving that. This bound prices the GPU types, drops the per-partition-index
rounding, and then solves for each model on its own an exact integer knapsack: the most
throughput a priced budget of ``u`` buys with integer vGPU counts. Combining the models is then
one-dimensional. The bound is valid for any non-negative prices, so a few price vectors can be
tried and the smallest bound kept; it caps ``z`` in the MILP, and when an incumbent reaches it
the search is over. With one binding GPU type the bound is almost always the exact optimum.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, field

import numba
import numpy as np

from ..cluster import Cluster
from .configs import PipelineConfig

# Budget units per GPU of the cheapest priced type: 1/48 GPU, which splits 1, 2, 3, 4, 6, 8,
# 12, 16, 24 and 48 all divide, so with one priced type every vGPU costs a whole number.
_UNITS_PER_GPU = 48
# Above this many units the resolution is coarsened (costs round down: still a valid bound).
_MAX_UNITS = 40_000

Pick = tuple[PipelineConfig, tuple[int, ...]]


@dataclass
class ModelKnapsack:
    """One model's exact knapsack table under one price vector."""

    F: np.ndarray  # F[u]: most throughput with at most u units
    arg: np.ndarray  # last item bought at u, -1 when F[u] = F[u-1]
    cost: np.ndarray
    what: list[Pick]

    def units_for(self, demand: float) -> int:
        """Fewest units that buy ``demand`` (len(F) when none do)."""
        return int(np.searchsorted(self.F, demand * (1 - 1e-12), side="left"))

    def pick(self, u: int) -> list[Pick]:
        """The pipelines the table bought for ``u`` units."""
        got = []
        while u > 0:
            i = int(self.arg[u])
            if i < 0:
                u -= 1
                continue
            got.append(self.what[i])
            u -= int(self.cost[i])
        return got


@dataclass
class KnapsackBound:
    """The bound, and for each model the pipelines the relaxation bought to reach it."""

    bound: float
    picks: dict[str, list[Pick]] = field(default_factory=dict)
    tables: dict[str, ModelKnapsack] = field(default_factory=dict)


Prices = Mapping[str | tuple[str, int], float]


def _price(prices: Prices, gpu: str, d: int) -> float:
    """Price of one GPU of ``gpu`` at partition index ``d``: per pool if given, else per type."""
    p = prices.get((gpu, d))
    return float(prices.get(gpu, 0.0) if p is None else p)


def knapsack_bound(
    configs: dict[str, list[PipelineConfig]],
    weights: dict[str, float],
    cluster: Cluster,
    prices: Prices,
    z_cap: float,
) -> KnapsackBound:
    """Upper bound on max-min weighted throughput under GPU ``prices`` (inf if it cannot bind).

    Prices are per GPU type, or per (type, partition index) pool; with pool prices a type's
    budget is valued at its dearest pool, which keeps the bound valid. ``z_cap`` is any known
    upper bound (the LP's): no model needs more than weight × cap.
    """
    depth = max((len(c.segments) for cs in configs.values() for c in cs), default=1)
    top = {g: max(_price(prices, g, d) for d in range(depth)) for g in cluster.gpus}
    budget = sum(p * cluster.gpus[g].count for g, p in top.items() if p > 0)
    positive = [_price(prices, g, d) for g in cluster.gpus for d in range(depth) if _price(prices, g, d) > 0]
    if budget <= 0 or not configs:
        return KnapsackBound(math.inf)
    unit = max(min(positive) / _UNITS_PER_GPU, budget / _MAX_UNITS)
    total = int(math.floor(budget / unit + 1e-9))
    tables = knapsack_tables(configs, weights, prices, unit, total, z_cap)
    if tables is None:
        return KnapsackBound(math.inf)
    models = list(configs)
    z, units = _combine([tables[mm].F for mm in models], [weights[mm] for mm in models], total)
    picks = {mm: tables[mm].pick(u) for mm, u in zip(models, units, strict=True)}
    return KnapsackBound(z, picks, tables)


def knapsack_tables(configs, weights, prices: Prices, unit: float, total: int,
                    z_cap: float) -> dict[str, ModelKnapsack] | None:
    """Each model's knapsack table up to ``total`` units of ``unit`` price each (None when some
    model has a pipeline that costs nothing at these prices)."""
    tables: dict[str, ModelKnapsack] = {}
    for mm, cfgs in configs.items():
        items = _items(cfgs, prices, unit, weights[mm] * z_cap)
        if items is None:
            return None
        cost, gain, what = items
        if (cost <= 0).any():
            return None  # resolution too coarse to price some pipeline
        F, arg = _unbounded_knapsack(cost, gain, total)
        tables[mm] = ModelKnapsack(F, arg, cost, what)
    return tables


def _items(cfgs: list[PipelineConfig], prices: Prices, unit: float, need: float):
    """Pipeline instances at every efficient size: costs (units), throughputs, what they are.

    An instance is efficient when some pool is exactly as large as the throughput needs; any
    real pipeline is matched by one that costs no more and carries as much. ``None`` when some
    configuration runs on unpriced GPUs only (the relaxation then cannot bound that model).
    """
    costs: list[int] = []
    gains: list[float] = []
    what: list[Pick] = []
    for c in cfgs:
        t = [s.rps_per_vgpu for s in c.segments]
        price = [_price(prices, s.gpu, d) / s.split for d, s in enumerate(c.segments)]
        if not any(price):
            return None
        if c.tied:
            r = min(t)
            for n in range(1, max(1, math.ceil(need / r - 1e-9)) + 1):
                costs.append(int(math.floor(sum(price) * n / unit + 1e-9)))
                gains.append(r * n)
                what.append((c, (n,) * len(t)))
            continue
        levels = set()
        for td in t:
            levels.update(td * n for n in range(1, max(1, math.ceil(need / td - 1e-9)) + 1))
        for x in levels:
            ns = tuple(math.ceil(x / td - 1e-9) for td in t)
            costs.append(int(math.floor(sum(n * p for n, p in zip(ns, price, strict=True)) / unit + 1e-9)))
            gains.append(min(n * td for n, td in zip(ns, t, strict=True)))
            what.append((c, ns))
    cost = np.array(costs, dtype=np.int64)
    gain = np.array(gains, dtype=np.float64)
    # Per cost keep the best gain, and drop items a cheaper item beats; sorted by cost.
    order = np.lexsort((-gain, cost))
    c_s, g_s = cost[order], gain[order]
    first = np.r_[True, c_s[1:] != c_s[:-1]]
    sel = first & (g_s >= np.maximum.accumulate(g_s))
    idx = order[sel]
    return cost[idx], gain[idx], [what[i] for i in idx]


@numba.njit(cache=True)
def _unbounded_knapsack(cost: np.ndarray, gain: np.ndarray, total: int) -> tuple[np.ndarray, np.ndarray]:
    """F[u]: most throughput buyable with at most u units (items repeat); arg[u]: last item
    bought for it, -1 when F[u] = F[u-1]. Items come sorted by cost."""
    F = np.zeros(total + 1)
    arg = np.full(total + 1, -1, dtype=np.int64)
    n = cost.shape[0]
    for u in range(1, total + 1):
        best = F[u - 1]
        bi = -1
        for i in range(n):
            c = cost[i]
            if c > u:
                break
            v = F[u - c] + gain[i]
            if v > best:
                best = v
                bi = i
        F[u] = best
        arg[u] = bi
    return F, arg


def _combine(curves: list[np.ndarray], weights: list[float], total: int) -> tuple[float, list[int]]:
    """Largest z such that buying w_m·z for every model fits in ``total`` units, and the units
    each model then needs."""
    cands = np.unique(np.concatenate([F / w for F, w in zip(curves, weights, strict=True)]))

    def need(z: float) -> list[int]:
        return [int(np.searchsorted(F, w * z * (1 - 1e-12), side="left"))
                for F, w in zip(curves, weights, strict=True)]

    lo, hi = 0, len(cands) - 1
    if sum(need(cands[lo])) > total:
        return 0.0, [0] * len(curves)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if sum(need(cands[mid])) <= total:
            lo = mid
        else:
            hi = mid - 1
    return float(cands[lo]), need(cands[lo])
