"""A combinatorial upper bound on the MILP's objective that knows vGPUs come in whole units.

The LP relaxation lets a pool hold 8.0007 GPUs; the true optimum cannot, and CBC spends nearly
all its time proving that. This bound prices the GPU types, drops the per-partition-index
rounding, and then solves for each model on its own an exact integer knapsack: the most
throughput a priced budget of ``u`` buys with integer vGPU counts. Combining the models is then
one-dimensional. The bound is valid for any non-negative prices, so a few price vectors can be
tried and the smallest bound kept; it caps ``z`` in the MILP, and when an incumbent reaches it
the search is over.

Pipelines on unpriced GPUs only cost nothing; what they can carry is bounded apart, by the
fluid bound of :func:`fluid_bound`. When a single GPU type is priced, PPipe's rounding of each
model's pools up to whole GPUs is kept too: a model that needs ``u`` GPUs' worth of that type
holds at least ``ceil(u)`` of them. With one binding type this bound is usually the optimum,
which the LP relaxation (blind to all rounding) is not.
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
    free: float = 0.0  # most throughput of the pipelines that cost nothing at these prices

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
    unit: float = 0.0  # price of one budget unit

    def money_for(self, model: str, demand: float) -> float:
        """A lower bound on the priced GPUs ``model`` needs for ``demand`` requests/s with
        whole vGPUs (instance costs were rounded down to units, so units × unit is below any
        real purchase); inf beyond the table."""
        t = self.tables[model]
        rest = demand - t.free
        if rest <= 0:
            return 0.0
        u = t.units_for(rest)
        return math.inf if u >= len(t.F) else u * self.unit


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
    instances: dict[str, Instances] | None = None,
    round_per_model: bool = False,
) -> KnapsackBound:
    """Upper bound on max-min weighted throughput under GPU ``prices`` (inf if it cannot bind).

    Prices are per GPU type, or per (type, partition index) pool; with pool prices a type's
    budget is valued at its dearest pool, which keeps the bound valid. ``z_cap`` is any known
    upper bound (the LP's): no model needs more than weight × cap. ``instances`` (from
    :func:`model_instances` with the same cap) saves re-enumerating them per price vector.
    ``round_per_model``: every model's use of a type is whole GPUs (PPipe's rule; not with
    GPUs shared across models); used when one type alone is priced.
    """
    depth = max((len(c.segments) for cs in configs.values() for c in cs), default=1)
    top = {g: max(_price(prices, g, d) for d in range(depth)) for g in cluster.gpus}
    budget = sum(p * cluster.gpus[g].count for g, p in top.items() if p > 0)
    positive = [_price(prices, g, d) for g in cluster.gpus for d in range(depth) if _price(prices, g, d) > 0]
    if budget <= 0 or not configs:
        return KnapsackBound(math.inf)
    unit = max(min(positive) / _UNITS_PER_GPU, budget / _MAX_UNITS)
    total = int(math.floor(budget / unit + 1e-9))
    if instances is None:
        instances = {mm: model_instances(cs, weights[mm] * z_cap, cluster) for mm, cs in configs.items()}
    tables = knapsack_tables(instances, prices, unit, total, cluster)
    priced = [g for g, p in top.items() if p > 0]
    whole = None
    if round_per_model and len(priced) == 1 and all(isinstance(k, str) for k in prices):
        g = priced[0]
        whole = (top[g] / unit, cluster.gpus[g].count)
    models = list(configs)
    z, units = _combine([tables[mm] for mm in models], [weights[mm] for mm in models], total, whole)
    picks = {mm: tables[mm].pick(u) for mm, u in zip(models, units, strict=True)}
    return KnapsackBound(z, picks, tables, unit)


def fluid_bound(configs: list[PipelineConfig], cluster: Cluster) -> float:
    """Upper bound on the throughput ``configs`` carry together with the whole cluster.

    A pipeline carrying x requests/s holds at least x·a_g GPUs of each type g it uses (a_g: its
    GPUs of g per request/s), so x ≤ (its GPUs of g) / a_g for every g; charge it on the type
    where a_g is largest. Each type then carries at most its count times the best rate charged
    to it, and all of them at most the sum over types. (Mixing pipelines on different types is
    what a bound over single pipelines would miss.)
    """
    rate: dict[str, float] = {}
    for c in configs:
        need: dict[str, float] = {}
        for s in c.segments:
            need[s.gpu] = need.get(s.gpu, 0.0) + 1.0 / s.rps_per_gpu
        g, a = max(need.items(), key=lambda kv: kv[1])
        rate[g] = max(rate.get(g, 0.0), 1.0 / a)
    return sum(cluster.gpus[g].count * r for g, r in rate.items())


@dataclass
class Instances:
    """Every efficient size of every pipeline of one model, independent of prices.

    An instance is efficient when some pool is exactly as large as its throughput needs; any
    real pipeline is matched by one that costs no more and carries as much. ``gpus[i, p]`` is
    the physical GPUs instance ``i`` holds in pool kind ``p`` = (type, partition index).
    """

    gpus: np.ndarray
    gain: np.ndarray
    pools: list[tuple[str, int]]
    config: np.ndarray
    counts: list[np.ndarray]  # per configuration, its instances' vGPU counts (rows from first[c])
    first: np.ndarray  # index of each configuration's first instance
    configs: list[PipelineConfig]

    def pick(self, i: int) -> Pick:
        """Instance ``i``'s configuration and vGPU counts (a tuple made on demand: millions of
        instances at 100,000 GPUs, and only the few a bound buys are ever read)."""
        c = int(self.config[i])
        return self.configs[c], tuple(int(n) for n in self.counts[c][i - self.first[c]])


def model_instances(cfgs: list[PipelineConfig], need: float, cluster: Cluster | None = None) -> Instances:
    """The efficient instances of ``cfgs`` up to throughput ``need`` (vectorised per config), and,
    given the ``cluster``, no larger than its pools: a pool of more vGPUs than the cluster has of
    that type is in no plan (and a profile of microsecond blocks on a few GPUs would otherwise
    list billions of sizes up to ``need``)."""
    pools = sorted({(s.gpu, d) for c in cfgs for d, s in enumerate(c.segments)})
    col = {p: i for i, p in enumerate(pools)}
    gpus, gains, owner, counts = [], [], [], []
    for ci, c in enumerate(cfgs):
        t = np.array([s.rps_per_vgpu for s in c.segments])
        top = need if cluster is None else min(
            need, min(s.rps_per_vgpu * cluster.gpus[s.gpu].count * s.split for s in c.segments))
        if c.tied:
            n = np.arange(1, max(1, math.ceil(top / t.min() - 1e-9)) + 1)
            ns = np.repeat(n[:, None], len(t), axis=1)
        else:
            levels = np.unique(np.concatenate([
                td * np.arange(1, max(1, math.ceil(top / td - 1e-9)) + 1) for td in t]))
            ns = np.ceil(levels[:, None] / t[None, :] - 1e-9).astype(np.int64)
        g = np.zeros((len(ns), len(pools)))
        for d, s in enumerate(c.segments):
            g[:, col[(s.gpu, d)]] += ns[:, d] / s.split
        gpus.append(g)
        gains.append((ns * t[None, :]).min(axis=1))
        owner.append(np.full(len(ns), ci))
        counts.append(ns)
    first = np.cumsum([0, *(len(n) for n in counts[:-1])]) if counts else np.zeros(0, dtype=np.int64)
    return Instances(np.concatenate(gpus), np.concatenate(gains), pools, np.concatenate(owner),
                     counts, first, list(cfgs))


def knapsack_tables(instances: dict[str, Instances], prices: Prices, unit: float, total: int,
                    cluster: Cluster) -> dict[str, ModelKnapsack]:
    """Each model's knapsack table up to ``total`` units of ``unit`` price each."""
    tables: dict[str, ModelKnapsack] = {}
    for mm, inst in instances.items():
        cost, gain, what, free = _items(inst, prices, unit)
        F, arg = _unbounded_knapsack(cost, gain, total)
        tables[mm] = ModelKnapsack(F, arg, cost, what, fluid_bound(free, cluster) if free else 0.0)
    return tables


def _items(inst: Instances, prices: Prices, unit: float):
    """The instances worth buying at ``prices``: costs (units ≥ 1), throughputs, what they are;
    and the configurations with an instance that costs less than a unit at these prices
    (bounded apart, as free)."""
    pv = np.array([_price(prices, g, d) for g, d in inst.pools])
    money = inst.gpus @ pv
    # An instance cheaper than one unit counts as free: charging it a whole unit would put the
    # table above what it really costs (only with prices thousands of times apart, where the
    # unit is set by the budget), and the bound and money_for must stay below it.
    paid = money >= unit  # so that every paid instance's floored cost is at least one unit
    free_cfg = sorted(set(inst.config[~paid].tolist()))
    cost = np.floor(money[paid] / unit + 1e-9).astype(np.int64)
    gain = inst.gain[paid]
    rows = np.flatnonzero(paid)
    # Per cost keep the best gain, and drop items a cheaper item beats; sorted by cost.
    order = np.lexsort((-gain, cost))
    c_s, g_s = cost[order], gain[order]
    first = np.r_[True, c_s[1:] != c_s[:-1]][: len(order)]
    idx = order[first & (g_s >= np.maximum.accumulate(g_s))]
    idx = idx[_undominated_by_copies(cost[idx], gain[idx])]
    return cost[idx], gain[idx], [inst.pick(rows[i]) for i in idx], [inst.configs[i] for i in free_cfg]


# Items tried as dominators: those of the best gain per unit (copies of them replace the rest).
_DOMINATORS = 32


def _undominated_by_copies(cost: np.ndarray, gain: np.ndarray) -> np.ndarray:
    """Mask of the items no whole number of copies of a better item beats (``floor(c_i / c_j)``
    copies of item j cost no more than item i; if they carry at least as much, an unbounded
    knapsack never needs i, and its table is the same without it). Only the best-ratio items
    are tried as j: on a 100,000-GPU cluster, 8,000-14,000 items came down to a handful, and the
    table's dynamic programme, which costs units x items, with them. Costs are distinct (one
    item per cost), so no two items remove each other."""
    keep = np.ones(len(cost), dtype=bool)
    for j in np.argsort(-gain / cost, kind="stable")[:_DOMINATORS]:
        copies = cost // cost[j]
        beaten = (copies >= 1) & (copies * gain[j] >= gain)
        beaten[j] = False
        keep &= ~beaten
    return keep


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


def _combine(tables: list[ModelKnapsack], weights: list[float], total: int,
             whole: tuple[float, int] | None = None) -> tuple[float, list[int]]:
    """Largest z such that buying w_m·z for every model fits in ``total`` units, and the units
    each model then needs. ``whole`` = (units per GPU, GPUs): one type alone is priced and each
    model's use of it is rounded up to whole GPUs before the sum is held to the count."""
    cands = np.unique(np.concatenate([(t.F + t.free) / w for t, w in zip(tables, weights, strict=True)]))

    def need(z: float) -> list[int]:
        out = []
        for t, w in zip(tables, weights, strict=True):
            rest = w * z * (1 - 1e-12) - t.free
            out.append(0 if rest <= 0 else int(np.searchsorted(t.F, rest, side="left")))
        return out

    def fits(units: list[int]) -> bool:
        if any(u >= len(t.F) for u, t in zip(units, tables, strict=True)):
            return False
        if whole is None:
            return sum(units) <= total
        per_gpu, count = whole
        return sum(math.ceil(u / per_gpu - 1e-6) for u in units) <= count

    lo, hi = 0, len(cands) - 1
    if not fits(need(cands[lo])):
        return 0.0, [0] * len(tables)
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if fits(need(cands[mid])):
            lo = mid
        else:
            hi = mid - 1
    return float(cands[lo]), need(cands[lo])
