"""A Lagrangian bound that keeps PPipe's whole-GPU rounding per (model, partition index, type).

With three or four binding GPU types the MILP's gap is the rounding of each model's pools up to
whole GPUs, and neither the LP relaxation (blind to it) nor the knapsack bound of :mod:`.bounds`
(which keeps whole vGPUs but drops the rounding) sees it. This bound keeps the rounding and
relaxes the rest: price the GPU types; then each model alone buys the cheapest integer GPU
counts ``G_p`` per pool ``p`` = (partition index, type) whose fluid throughput (vGPU counts
continuous) reaches its share of ``z``. A plan serving ``z`` gives every model such counts, and
their priced sum is at most the priced cluster; so the largest ``z`` whose model costs fit is an
upper bound on the optimum, for any non-negative prices.

Each model's problem is a small integer program: 6-12 integer pool sizes and a continuous flow
over its configurations. CBC needs 0.1-15 s for one; the branch-and-bound here, with a dense
simplex compiled by numba (a dozen rows), needs milliseconds, which is what makes the bound
affordable inside a plan's time limit. A node cap keeps it bounded: a search cut short returns
the smallest bound of its open nodes, still a valid lower bound on the cost.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numba
import numpy as np

from ..cluster import Cluster
from .configs import PipelineConfig

# Relative tolerance of the branch-and-bound: a node is pruned when its LP cost is within this
# of the incumbent; the cost returned is lowered by it, so the bound stays valid.
_REL_TOL = 1e-9
# Nodes one model's search may open before it stops with the best bound of its open nodes,
# as configurations × nodes (a node's LP costs about its configurations' count).
WORK_CAP = 1_000_000


@dataclass
class ModelPools:
    """One model's configurations as a matrix: GPUs of pool ``p`` per request/s of config ``c``."""

    model: str
    pools: list[tuple[int, str]]  # (partition index, GPU type)
    use: np.ndarray  # [configs, pools]
    count: np.ndarray  # GPUs of each pool's type in the cluster (the pool's upper bound)


def model_pools(model: str, configs: list[PipelineConfig], cluster: Cluster) -> ModelPools:
    """The use matrix of ``configs``. A tied (DART-r) configuration runs every partition at the
    slowest one's rate, so each of its partitions holds its vGPUs for that rate."""
    pools = sorted({(d, s.gpu) for c in configs for d, s in enumerate(c.segments)})
    col = {p: i for i, p in enumerate(pools)}
    use = np.zeros((len(configs), len(pools)))
    for i, c in enumerate(configs):
        slow = min(s.rps_per_vgpu for s in c.segments)
        for d, s in enumerate(c.segments):
            rate = slow if c.tied else s.rps_per_vgpu
            use[i, col[(d, s.gpu)]] += 1.0 / (rate * s.split)
    count = np.array([float(cluster.gpus[g].count) for _, g in pools])
    return ModelPools(model, pools, _undominated(use), count)


def _undominated(use: np.ndarray) -> np.ndarray:
    """The rows no other row beats: with vGPU counts continuous, a configuration that needs at
    least as much of every pool as another (splits and batch sizes no longer matter) can go."""
    if len(use) == 0:
        return use
    keep = []
    order = np.lexsort(use.T[::-1])
    use = use[order]
    for i in range(len(use)):
        if not keep:
            keep.append(i)
            continue
        k = use[keep]
        if not np.any(np.all(k <= use[i], axis=1)):
            keep.append(i)
    return use[keep]


def min_cost(mp: ModelPools, prices: Mapping[str, float], demand: float,
             node_cap: int | None = None) -> tuple[float, np.ndarray, int]:
    """Lower bound on the cheapest whole-GPU pool counts serving ``demand`` requests/s (exact
    unless the node cap was hit), the counts found, and the nodes opened; inf when the cluster
    cannot serve it."""
    pi = np.array([max(0.0, float(prices.get(g, 0.0))) for _, g in mp.pools])
    if demand <= 0:
        return 0.0, np.zeros(len(mp.pools)), 0
    if len(mp.use) == 0:
        return math.inf, np.zeros(len(mp.pools)), 0
    return _branch_and_bound(mp.use * demand, pi, mp.count, _node_cap(mp, node_cap), *no_caps(len(mp.pools)),
                             False)


def _node_cap(mp: ModelPools, node_cap: int | None) -> int:
    return node_cap if node_cap is not None else max(200, WORK_CAP // max(1, len(mp.use)))


def no_caps(pools: int) -> tuple[np.ndarray, np.ndarray]:
    """``cap_of`` and ``caps`` of :func:`_branch_and_bound` for pools bounded one by one only."""
    return np.full(pools, -1, dtype=np.int64), np.zeros(0)


def min_capped(mp: ModelPools, priced: str, caps: Mapping[str, float], demand: float,
               node_cap: int | None = None) -> tuple[float, np.ndarray]:
    """A lower bound on the fewest whole GPUs of type ``priced`` in the pools serving ``demand``
    requests/s (vGPU counts continuous) when the pools of each type ``g`` in ``caps`` hold at
    most ``caps[g]`` GPUs together (exact unless the node cap was hit), inf when none serve it;
    and the best pool counts found."""
    if demand <= 0:
        return 0.0, np.zeros(len(mp.pools))
    if len(mp.use) == 0:
        return math.inf, np.zeros(len(mp.pools))
    names = list(caps)
    pi = np.array([1.0 if g == priced else 0.0 for _, g in mp.pools])
    cap_of = np.array([names.index(g) if g in caps else -1 for _, g in mp.pools], dtype=np.int64)
    lower, G, _ = _branch_and_bound(mp.use * demand, pi, mp.count, _node_cap(mp, node_cap), cap_of,
                                    np.array([float(caps[g]) for g in names]), True)
    return lower, G


def lagrangian_bound(pools: dict[str, ModelPools], weights: Mapping[str, float], cluster: Cluster,
                     prices: Mapping[str, float], lo: float, hi: float, rel_tol: float = 1e-7,
                     node_cap: int | None = None, deadline: float = math.inf,
                     floor: Callable[[str, float], float] | None = None) -> tuple[float, dict]:
    """Smallest ``z`` in (lo, hi] found not to fit at ``prices`` (``hi`` if all of it fits).

    ``lo`` must be achievable (an incumbent's objective): the relaxation of a feasible plan
    always fits, so the search only narrows (lo, hi]. It stops at ``deadline``
    (``time.perf_counter()``) with the bound it has. ``floor(model, demand)``: another lower
    bound on a model's priced cost at the same prices (the knapsack's, which keeps whole vGPUs
    but not the rounding); each model is charged the larger. Returns the bound and its cost.
    """
    budget = sum(max(0.0, float(prices.get(g, 0.0))) * t.count for g, t in cluster.gpus.items())
    stats = {"solves": 0, "nodes": 0}

    def fits(z: float) -> bool | None:
        """Whether ``z`` fits the priced cluster; None when the deadline came first."""
        total = 0.0
        for mm, mp in pools.items():
            if time.perf_counter() > deadline:
                return None
            c, _, nodes = min_cost(mp, prices, weights[mm] * z, node_cap)
            stats["solves"] += 1
            stats["nodes"] += nodes
            total += c if floor is None else max(c, floor(mm, weights[mm] * z))
            if total > budget * (1 + 1e-12) + 1e-12:
                return False
        return True

    if budget <= 0 or hi <= lo:
        return hi, stats
    step = rel_tol * hi
    while hi - lo > step:
        mid = 0.5 * (lo + hi)
        ok = fits(mid)
        if ok is None:
            stats["stopped"] = True
            break
        if ok:
            lo = mid
        else:
            hi = mid
    return hi, stats


# ---------------------------------------------------------------- the compiled search

@numba.njit(cache=True)
def _pivot(T, b, obj, basis, r, j):
    """Pivot the tableau on row ``r``, column ``j`` (the objective row ``obj`` included)."""
    m, ncol = T.shape
    piv = T[r, j]
    for k in range(ncol):
        T[r, k] /= piv
    b[r] /= piv
    for i in range(m):
        if i != r:
            f = T[i, j]
            if f != 0.0:
                for k in range(ncol):
                    T[i, k] -= f * T[r, k]
                b[i] -= f * b[r]
    f = obj[j]
    if f != 0.0:
        for k in range(ncol):
            obj[k] -= f * T[r, k]
        obj[ncol] -= f * b[r]
    basis[r] = j


@numba.njit(cache=True)
def _simplex(T, b, obj, basis, allowed):
    """Primal simplex on a feasible tableau: Dantzig's rule, Bland's once it stalls. Returns
    False if it ran out of iterations (never seen; the caller then treats the node as open)."""
    m, ncol = T.shape
    limit = 50 * (m + ncol)
    for it in range(limit):
        bland = it > 5 * (m + ncol)
        j = -1
        best = -1e-10
        for k in range(ncol):
            if allowed[k] and obj[k] < best:
                j = k
                if bland:
                    break
                best = obj[k]
        if j < 0:
            return True
        r = -1
        ratio = np.inf
        for i in range(m):
            if T[i, j] > 1e-11:
                q = b[i] / T[i, j]
                if q < ratio - 1e-12 or (q <= ratio + 1e-12 and r >= 0 and basis[i] < basis[r]):
                    ratio = q
                    r = i
        if r < 0:
            return False  # unbounded: cannot happen, every configuration uses a bounded pool
        _pivot(T, b, obj, basis, r, j)
    return False


@numba.njit(cache=True)
def _capacity_rows(T, b, basis, A, rhs, slack0):
    """Rows p < P of a tableau: the configurations' use of pool p plus its slack (column
    ``slack0 + p``, basic) equals ``rhs[p]``."""
    n, P = A.shape
    for p in range(P):
        for c in range(n):
            T[p, c] = A[c, p]
        T[p, slack0 + p] = 1.0
        b[p] = rhs[p]
        basis[p] = slack0 + p


@numba.njit(cache=True)
def _node_lp(A, pi, L, U, G, cap_of, caps):
    """LP of a node: min pi·G with A^T x <= G, sum(x) >= 1, L <= G <= U, and for every cap ``r``
    the pools ``p`` with ``cap_of[p] == r`` summing to at most ``caps[r]``. Writes G; returns the
    cost, or inf when infeasible (nan when the simplex gave up)."""
    n, P = A.shape
    R = caps.shape[0]
    m = 2 * P + R + 1
    ncol = n + 3 * P + R + 2
    sh = n + 3 * P + R  # the shortfall's column; the surplus is next
    dr = 2 * P + R  # the demand row
    T = np.zeros((m, ncol))
    b = np.zeros(m)
    basis = np.empty(m, dtype=np.int64)
    # columns: x (n) | e = G - L (P) | capacity slacks (P) | upper slacks (P) | cap slacks (R) |
    # shortfall s | surplus t
    _capacity_rows(T, b, basis, A, L, n + P)
    for p in range(P):
        T[p, n + p] = -1.0
        T[P + p, n + p] = 1.0
        T[P + p, n + 2 * P + p] = 1.0
        b[P + p] = U[p] - L[p]
        basis[P + p] = n + 2 * P + p
    for r in range(R):
        room = caps[r]
        for p in range(P):
            if cap_of[p] == r:
                T[2 * P + r, n + p] = 1.0
                room -= L[p]
        if room < -1e-9:
            return np.inf
        T[2 * P + r, n + 3 * P + r] = 1.0
        b[2 * P + r] = max(room, 0.0)
        basis[2 * P + r] = n + 3 * P + r
    for c in range(n):
        T[dr, c] = 1.0
    T[dr, sh] = 1.0
    T[dr, sh + 1] = -1.0
    b[dr] = 1.0
    basis[dr] = sh
    allowed = np.ones(ncol, dtype=np.bool_)
    # phase 1: drive the shortfall to zero
    obj = np.zeros(ncol + 1)
    obj[sh] = 1.0
    for k in range(ncol):
        obj[k] -= T[dr, k]
    obj[ncol] = -b[dr]
    if not _simplex(T, b, obj, basis, allowed):
        return np.nan
    if -obj[ncol] > 1e-9:
        return np.inf
    # phase 2: the pool costs. The shortfall never re-enters, and where phase 1 left it basic
    # at a rounding-level zero, a price above any saving keeps it from growing back.
    allowed[sh] = False
    obj[:] = 0.0
    big = 1.0
    for p in range(P):
        obj[n + p] = pi[p]
        big += pi[p] * U[p]
    obj[sh] = 1e6 * big
    for i in range(m):
        cb = obj[basis[i]]
        if cb != 0.0:
            for k in range(ncol):
                obj[k] -= cb * T[i, k]
            obj[ncol] -= cb * b[i]
    if not _simplex(T, b, obj, basis, allowed):
        return np.nan
    for p in range(P):
        G[p] = L[p]
    for i in range(m):
        k = basis[i]
        if n <= k < n + P:
            G[k - n] += b[i]
    cost = 0.0
    for p in range(P):
        cost += pi[p] * G[p]
    return cost



@numba.njit(cache=True)
def _branch_and_bound(A, pi, count, node_cap, cap_of, caps, integral):
    """Cheapest integer G (0 <= G <= count, and the pools of each cap ``r`` (``cap_of[p] == r``,
    -1 for none; one entry per pool)
    summing to at most ``caps[r]``) whose fluid throughput A^T x <= G reaches 1. ``integral``:
    every cost attained is a whole number (prices 0 and 1), which prunes more.

    Depth-first; each node's LP solution rounded up is an incumbent when it keeps the caps
    (rounding G up keeps the flow feasible). Returns (a lower bound on the optimum, the best G,
    nodes opened)."""
    n, P = A.shape
    depth = 1
    for p in range(P):
        depth += int(count[p]) + 1
    stack_L = np.zeros((depth + 1, P))
    stack_U = np.zeros((depth + 1, P))
    stack_bound = np.zeros(depth + 1)
    for p in range(P):
        stack_U[0, p] = count[p]
        if pi[p] <= 0.0 and cap_of[p] < 0:  # a free pool: take all of it
            stack_L[0, p] = count[p]
    top = 1
    best = np.inf
    best_G = np.zeros(P)
    G = np.zeros(P)
    Gc = np.zeros(P)
    used = np.zeros(caps.shape[0])
    open_bound = np.inf  # smallest bound of nodes left unexplored (cap or a failed LP)
    nodes = 0
    scale = 0.0
    for p in range(P):
        scale += pi[p] * count[p]
    tol = _REL_TOL * (scale + 1.0)
    while top > 0:
        top -= 1
        L = stack_L[top].copy()
        U = stack_U[top].copy()
        parent = stack_bound[top]
        if parent >= best - tol:
            continue
        if nodes >= node_cap:
            open_bound = min(open_bound, parent)
            continue
        nodes += 1
        cost = _node_lp(A, pi, L, U, G, cap_of, caps)
        if np.isnan(cost):
            open_bound = min(open_bound, parent)
            continue
        cost = max(cost, parent)  # a child's LP costs at least its parent's: a lower figure is the simplex's error
        if integral:
            cost = max(cost, math.ceil(cost - 1e-6))
        if cost >= best - tol:
            continue
        # a node LP whose answer lies outside its own bounds (17.117 for U = 17 was seen) is not
        # believed: its subtree stays open at the parent's bound, which is a valid one. (A branch
        # on it repeated its parent and wrote past the stack.) A hair outside is clamped.
        off = False
        for p in range(P):
            eps = 1e-6 * (1.0 + U[p])
            if G[p] < L[p] - eps or G[p] > U[p] + eps:
                off = True
            G[p] = min(max(G[p], L[p]), U[p])
        if off:
            open_bound = min(open_bound, parent)
            continue
        rc = 0.0
        used[:] = 0.0
        for p in range(P):
            Gc[p] = min(U[p], math.ceil(G[p] - 1e-7))
            rc += pi[p] * Gc[p]
            if cap_of[p] >= 0:
                used[cap_of[p]] += Gc[p]
        capped = True
        for r in range(caps.shape[0]):
            if used[r] > caps[r] + 1e-9:
                capped = False
        # the rounded-up LP answer is an incumbent when it carries the flow (checked: pruning
        # against a cost nothing attains would cut off the optimum)
        if capped and (rc < best or rc <= cost + tol) and fluid_throughput(A, Gc) >= 1.0 - 1e-9:
            if rc < best:
                best = rc
                best_G[:] = Gc
            if rc <= cost + tol:
                continue
        # branch on the fractional pool whose rounding costs most; under caps, on the most
        # fractional free one when no priced pool is fractional
        jb = -1
        wb = 0.0
        for p in range(P):
            f = G[p] - math.floor(G[p] + 1e-7)
            if f > 1e-7:
                w = pi[p] * (1.0 - f)
                if w > wb:
                    wb = w
                    jb = p
        if jb < 0 and caps.shape[0] > 0:
            for p in range(P):
                f = G[p] - math.floor(G[p] + 1e-7)
                if f > 1e-7 and min(f, 1.0 - f) + 1.0 > wb:
                    wb = min(f, 1.0 - f) + 1.0
                    jb = p
        up = 0.0
        down = 0.0
        if jb >= 0:
            up = math.ceil(G[jb] - 1e-7)
            down = math.floor(G[jb] + 1e-7)
        else:
            # whole within the tolerance, yet its rounding does not carry the flow (2 + 1e-7
            # GPUs rounded to 2): branch on the largest fraction however small, and where there
            # is none keep the node's cost as a bound; dropping it lost the optimum (the cost
            # came back inf with a free pool that nearly served the demand alone)
            wb = 0.0
            for p in range(P):
                f = G[p] - math.floor(G[p])
                if f > wb and math.floor(G[p]) < math.ceil(G[p]):
                    wb = f
                    jb = p
            if jb < 0:
                open_bound = min(open_bound, cost)
                continue
            up = math.ceil(G[jb])
            down = math.floor(G[jb])
        if top + 2 > depth + 1:  # cannot happen (each branch narrows a range); never write past it
            open_bound = min(open_bound, cost)
            continue
        # up child below the down child, so the cheaper (down) side is searched first
        stack_L[top] = L
        stack_U[top] = U
        stack_L[top, jb] = up
        stack_bound[top] = cost
        top += 1
        stack_L[top] = L
        stack_U[top] = U
        stack_U[top, jb] = down
        stack_bound[top] = cost
        top += 1
    lower = min(best, open_bound) - tol
    return lower, best_G, nodes


@numba.njit(cache=True)
def fluid_throughput(A, G):
    """Most requests/s the pools ``G`` carry together (vGPU counts continuous): max sum(x)
    with A^T x <= G, x >= 0, by the simplex from the origin."""
    n, P = A.shape
    ncol = n + P
    T = np.zeros((P, ncol))
    b = np.zeros(P)
    basis = np.empty(P, dtype=np.int64)
    _capacity_rows(T, b, basis, A, G, n)
    obj = np.zeros(ncol + 1)
    for c in range(n):
        obj[c] = -1.0
    allowed = np.ones(ncol, dtype=np.bool_)
    if not _simplex(T, b, obj, basis, allowed):
        return 0.0
    return obj[ncol]
