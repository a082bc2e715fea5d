"""An exact search over per-model GPU-type vectors: under PPipe's rule models share only budgets.

PPipe rounds each model's pools up to whole GPUs on their own (model, partition index, type), so
a plan is, per model, an integer vector of GPUs per type that serves the model's share, and the
vectors sum to at most the cluster. Fix one type as the last (the most numerous) and let
``T_m(a)`` be the fewest GPUs of it that serve ``w_m z`` when model ``m`` may use at most ``a_k``
of every other type ``k``. Then ``z`` is feasible exactly when

    min over a_1 + ... + a_M <= B (the other types' budgets) of  sum_m T_m(a_m)  <=  B_last,

a min-plus convolution over a small grid (26 x 26 points on L4:25,V100:25,T4:50). ``T_m`` is
nonincreasing in ``a``, so one value ``T_m(p)`` bounds it from below on every ``a <= p`` and from
above on every ``a >= p``.

The tables are filled lazily, cheapest bound first, only where the convolution's best split
needs them: a priced bound everywhere (the Lagrangian cost of :mod:`.lagrange` at a few price
vectors), then, at a point the split uses, the model's MILP with fractional vGPUs (whole GPUs
kept), then refutations of "at most LB GPUs of the last type", each raising the point's lower
bound LB by one and letting the split move elsewhere (CBC refutes a count below the optimum in
tens of ms, where proving the optimum can take it seconds), then its exact MILP. When the best
split's values are all exact and fit, its solutions
are a plan serving ``z``; when even its lower bounds exceed ``B_last``, nothing serves ``z``.
A bisection on ``z`` between an incumbent and a bound ends with a plan proven optimal (where
the whole problem's MILP may take minutes to prove the same: it does not know the models are
independent). A dozen to a few hundred small MILPs per ``z`` on the scale bench's clusters.

Why not only the MILP: CBC's bound on the full problem moves slowly with three and more binding
GPU types (gaps of 0.2-2 % after 10 s, optimal only after 30-90 s). Why beside it, not instead:
some models' own MILPs are hard for CBC too (convnext: 5-30 s for one point), and there CBC on
the whole problem gets there first. Up to three GPU types: with four, the points a test needs
grow by an order of magnitude and the search only took CBC's cores.
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from dataclasses import dataclass, field

import mip
import numba
import numpy as np

from ..cluster import Cluster
from .configs import PipelineConfig
from .lagrange import min_capped, min_cost, model_pools

INF = math.inf
# Relative prices of the other types (the last at 1) whose Lagrangian costs seed the tables.
_PRICES = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0)
# Grids larger than this (points per model), more types or more models are left to the full MILP.
# Four GPU types (three others, 26^3 points on the scale bench) took hundreds of per-model
# MILPs a test: beside CBC the search cost more proofs than it gave (3 of 12 at 20 s against
# 4-6 without it), so it stops at three. With refutations by a cutoff it broke even (5 and 5 of
# 12 against 2 and 4 without it, the same day): alone on apcnet+atss+gcnet 1-1-1 its proof took
# 28 s, 17.7 of them in 684 per-model MILPs and 7.1 in the split's min-plus convolutions.
MAX_POINTS = 20_000
MAX_OTHER_TYPES = 2
MAX_MODELS = 8
# Seconds one per-model MILP may take before the search gives up on the point.
_ORACLE_S = 5.0
# ... and with its pools' GPUs fixed at the fractional-vGPU optimum's.
_FIXED_S = 0.5
# ... and asked only whether it can do with at most a given count (see _Oracle.refute).
_REFUTE_S = 1.0
# CBC settings of the per-model MILPs: without cuts, 0.7 s against 1.35 s on four hard points
# of a 3-type group (CBC's times on these vary a lot with its settings: 3-30 s on convnext's).
_CBC_OPTS: dict = {"cuts": 0}
# A refutation first tries the usual minimization this long: it finds a plan within the count
# where there is one (the cutoff form of _Oracle._reach is slow at that), and refutes counts far
# below the optimum in tens of ms.
_REFUTE_QUICK_S = 0.08
# The cutoff form refutes "serves at least (1 - this) x the demand, less _ABS req/s": a hair
# below it, since CBC keeps only what beats its cutoff by a tolerance of its own (a plan serving
# exactly 20 req/s was lost to a cutoff 2e-5 below it, found under one 1e-4 below).
_REACH_SLACK = 1e-6
_REACH_SLACK_ABS = 1e-3
# What CBC reports as the objective of an incumbent it does not have (1e50).
_NO_VALUE = 1e30


@dataclass
class DecomposeResult:
    """The best plan found (configurations and vGPU counts), its objective, and the smallest
    ``z`` proven infeasible (``inf`` when none was)."""

    allocs: list[tuple[PipelineConfig, tuple[int, ...]]]
    objective: float
    bound: float
    stats: dict = field(default_factory=dict)


class _Grid:
    """The other types' caps, one flat index per point (row-major, the last type excluded)."""

    def __init__(self, counts: list[int]):
        self.dims = np.array([c + 1 for c in counts], dtype=np.int64)
        self.strides = np.ones(len(counts), dtype=np.int64)
        for k in range(len(counts) - 2, -1, -1):
            self.strides[k] = self.strides[k + 1] * self.dims[k + 1]
        self.size = int(np.prod(self.dims)) if len(counts) else 1
        self.coords = np.ascontiguousarray(np.array(np.unravel_index(np.arange(self.size), tuple(self.dims))).T
                                           if len(counts) else np.zeros((1, 0), dtype=np.int64)).astype(np.int64)

    def caps(self, p: int) -> tuple[int, ...]:
        return tuple(int(x) for x in self.coords[p])


class _Oracle:
    """One model's exact MILP (whole vGPUs, whole GPUs per pool) with caps on the other types and
    a demand: the fewest GPUs of the last type. Every count may go one GPU past the cluster
    (the answer then reads "does not fit"), so no optimum sits at a variable's bound: CBC
    2.935 called such instances infeasible (min G, G <= 4, optimum 4), the bound propagation
    that :func:`.milp.cbc_model` turns off aside."""

    def __init__(self, model: str, configs: list[PipelineConfig], cluster: Cluster, others: list[str],
                 last: str):
        self.model, self.others, self.last, self.cluster = model, others, last, cluster
        from .milp import cbc_model

        m = cbc_model(mip.MINIMIZE)
        m.threads = 1
        pools: dict[tuple[int, str], list[tuple[int, mip.Var]]] = defaultdict(list)
        self.xs: list[tuple[PipelineConfig, list[mip.Var]]] = []
        xs = []
        for c in configs:
            x = m.add_var(lb=0.0)
            ub = [(cluster.gpus[s.gpu].count + 1) * s.split for s in c.segments]
            if c.tied:
                n = m.add_var(var_type=mip.INTEGER, lb=0, ub=max(ub))
                m += x <= min(s.rps_per_vgpu for s in c.segments) * n
                ns = [n] * len(c.segments)
            else:
                ns = [m.add_var(var_type=mip.INTEGER, lb=0, ub=u) for u in ub]
                for s, n in zip(c.segments, ns, strict=True):
                    m += x <= s.rps_per_vgpu * n
            for d, (s, n) in enumerate(zip(c.segments, ns, strict=True)):
                pools[(d, s.gpu)].append((s.split, n))
            self.xs.append((c, ns))
            xs.append(x)
        self.served = mip.xsum(xs)
        self.demand_row = m.add_constr(self.served >= 0.0)
        per_type: dict[str, list[mip.Var]] = defaultdict(list)
        self.pool_gpus: dict[tuple[int, str], mip.Var] = {}
        for (d, g), terms in pools.items():
            G = self.pool_gpus[(d, g)] = m.add_var(var_type=mip.INTEGER, lb=0, ub=cluster.gpus[g].count + 1)
            lcm = math.lcm(*(split for split, _ in terms))
            m += mip.xsum((lcm // split) * n for split, n in terms) <= lcm * G
            per_type[g].append(G)
        self.cap_rows = {g: m.add_constr(mip.xsum(per_type[g]) <= cluster.gpus[g].count)
                         for g in others if per_type.get(g)}
        self.last_gpus = per_type.get(last, [])
        # what the caller knows already (the fractional-vGPU bound, the neighbours' values):
        # CBC's root bound starts there, and where a plan meets it, it is done at once
        self.count = mip.xsum(self.last_gpus)
        self.known_row = m.add_constr(self.count >= 0.0)
        # a refutation's cap on them; outside one, the sum of the pools' own bounds (never binding)
        self.no_most = (cluster.gpus[last].count + 1) * len(self.last_gpus)
        self.most_row = m.add_constr(self.count <= self.no_most)
        m.objective = mip.minimize(self.count)
        m.max_mip_gap = 1e-9
        m.max_mip_gap_abs = 0.5  # the objective counts whole GPUs
        # with CBC's default (1e-6 of a vGPU, it seems) demands up to 1e-5 of a vGPU's rate above a
        # breakpoint (2000.00003 for 2 x 1000) were called infeasible
        m.integer_tol = 1e-9
        for k, v in _CBC_OPTS.items():
            setattr(m, k, v)
        self.m = m
        self.calls = 0

    def refute(self, caps: tuple[int, ...], demand: float, most: int, limit_s: float
               ) -> tuple[float, float, list | None]:
        """Whether the model can do with at most ``most`` GPUs of the last type: the answer
        of :meth:`solve` restricted so, where "infeasible" proves the fewest above ``most``.
        Why: far below the optimum CBC refutes such a count in tens of ms, while its proof of
        the optimum itself can take seconds to minutes (efficientnet-b8, L4 <= 7, V100 <= 14:
        <= 12 refuted in 0.08 s, the optimum 14 proven in 14-17 s), and a test of ``z`` often
        needs only the lower bound raised a step or two."""
        self.most_row.rhs = most
        try:
            t0 = time.perf_counter()
            r = (0.0, INF, None)
            if _REFUTE_QUICK_S > 0:
                r = self.solve(caps, demand, min(_REFUTE_QUICK_S, limit_s))
                if r[2] is not None or r[0] == INF:
                    return r
            left = limit_s - (time.perf_counter() - t0)
            return self._reach(caps, demand, left) if left > 0.05 else r
        finally:
            self.most_row.rhs = self.no_most

    def _reach(self, caps: tuple[int, ...], demand: float, limit_s: float) -> tuple[float, float, list | None]:
        """The most the model serves under the rows as they stand, with every node that cannot
        reach ``demand`` cut off: (inf, inf, None) when none can, else the first plan that does
        (or none, out of time). CBC prunes by that bound, where the demand as a row leaves it
        only infeasible LPs to prune by (efficientnet-b8 at z = 1,082: six hard refutations in
        0.34 s against 3.95 s), but it finds a plan that exists more slowly than the
        minimization does (the quick try in :meth:`refute`)."""
        m = self.m
        self.calls += 1
        self._pose(caps, 0.0, 0.0)
        cutoff, max_solutions = m.cutoff, m.solver.get_max_solutions()
        gaps = m.max_mip_gap, m.max_mip_gap_abs
        target = demand * (1 - _REACH_SLACK) - _REACH_SLACK_ABS
        t0 = time.perf_counter()
        m.objective = mip.maximize(self.served)
        # no gap: the count's whole-GPU gap of 0.5 would prune nodes within 0.5 req/s above
        # the cutoff; and the cutoff a little under the demand, so that a plan serving just it
        # is not lost to CBC's tolerances (a false refutation would be an invalid bound)
        m.max_mip_gap, m.max_mip_gap_abs = 0.0, 0.0
        m.cutoff = target
        m.solver.set_max_solutions(1)
        try:
            st = m.optimize(max_seconds=max(0.05, limit_s))
            if st == mip.OptimizationStatus.INFEASIBLE:
                return INF, INF, None
            plan = self._plan_reaching(m, target, caps)
            if plan is not None or (st != mip.OptimizationStatus.OPTIMAL and not m.num_solutions):
                return plan or (0.0, INF, None)
            # CBC also closes the tree as "optimal" with no plan, and hands back plans that
            # break the rows (an objective of 1e50, or vGPUs in pools without their GPUs), both
            # where nothing reaches the cutoff and where a plan does (one serving 178.5 of
            # 113.2 req/s was there): then the plain maximum decides
            m.cutoff = cutoff
            m.solver.set_max_solutions(max_solutions)
            left = limit_s - (time.perf_counter() - t0)
            if left <= 0.05:
                return 0.0, INF, None
            st = m.optimize(max_seconds=left)
            if st == mip.OptimizationStatus.OPTIMAL and self._valued(m) and m.objective_value < target:
                return INF, INF, None
            return self._plan_reaching(m, target, caps) or (0.0, INF, None)
        finally:
            m.cutoff = cutoff
            m.max_mip_gap, m.max_mip_gap_abs = gaps
            m.solver.set_max_solutions(max_solutions)
            m.objective = mip.minimize(self.count)

    def _plan_reaching(self, m: mip.Model, target: float, caps: tuple[int, ...]) -> tuple | None:
        """CBC's solution as (0, count, picks) if it serves ``target`` within the rows, else None.
        The count is the plan's own GPUs of the last type: under the cutoff CBC has handed back
        vGPUs in pools whose GPU counts did not hold them, so its GPU variables can understate
        what the plan needs (a split then fit that broke PPipe's rule)."""
        if not self._valued(m) or m.objective_value < target:
            return None
        picks = self._picks()
        if _served(picks) < target:
            return None
        count = self._own_count(picks, caps)
        if count is None or count > self.most_row.rhs:
            return None
        return 0.0, count, picks

    @staticmethod
    def _valued(m: mip.Model) -> bool:
        """Whether CBC holds a solution with a real objective value."""
        return bool(m.num_solutions) and m.objective_value is not None and abs(m.objective_value) < _NO_VALUE

    def _own_count(self, picks: list, caps: tuple[int, ...]) -> float | None:
        """A plan's GPUs of the last type under PPipe's rounding, or None where it breaks a cap
        on the others: what CBC hands back is checked, never trusted (its GPU variables have
        understated a plan's needs)."""
        from .milp import gpu_budget_used  # milp imports this module

        used = gpu_budget_used(_allocs(picks))
        if any(used.get(g, 0) > cap for g, cap in zip(self.others, caps, strict=True)):
            return None
        return float(used.get(self.last, 0))

    def _pose(self, caps: tuple[int, ...], demand: float, known: float) -> None:
        self.demand_row.rhs = demand
        self.known_row.rhs = known if math.isfinite(known) else 0.0
        for g, cap in zip(self.others, caps, strict=True):
            if g in self.cap_rows:
                self.cap_rows[g].rhs = cap

    def solve(self, caps: tuple[int, ...], demand: float, limit_s: float, known: float = 0.0,
              fixed: dict[tuple[int, str], int] | None = None) -> tuple[float, float, list | None]:
        """(lower bound, value of a solution or inf, its (config, counts) list or None). The
        solution may serve a hair (CBC's tolerance) less than ``demand``: the caller checks."""
        if fixed is not None:
            # the pools' GPUs fixed: whether whole vGPUs fill them, asked as the most they
            # serve with nodes below the demand cut off (efficientnet-b8: 22 such questions
            # in 0.62 s against 1.9 s minimized)
            for key, G in self.pool_gpus.items():
                G.lb = G.ub = fixed.get(key, 0)
            try:
                r = self._reach(caps, demand, limit_s)
            finally:
                for (_, g), G in self.pool_gpus.items():
                    G.lb, G.ub = 0, self.cluster.gpus[g].count + 1
            return (known, r[1], r[2]) if r[2] is not None else (known, INF, None)
        self.calls += 1
        self._pose(caps, demand, known)
        m = self.m
        st = m.optimize(max_seconds=max(0.05, limit_s))
        if st == mip.OptimizationStatus.INFEASIBLE:
            return INF, INF, None
        lo = _whole(float(m.objective_bound)) if m.objective_bound is not None else 0.0
        lo = lo if math.isfinite(lo) else 0.0
        if not m.num_solutions:
            return max(0.0, lo), INF, None
        if st == mip.OptimizationStatus.OPTIMAL:
            lo = max(lo, float(round(self.count.x)))  # the gap is below one GPU
        picks = self._picks()
        val = self._own_count(picks, caps)
        if val is None:
            return max(0.0, lo), INF, None
        return min(lo, val), val, picks

    def _picks(self) -> list:
        """The current solution's (config, counts) list."""
        picks = []
        for c, ns in self.xs:
            counts = tuple(int(round(n.x)) for n in ns)
            if min(counts) > 0:
                picks.append((c, counts))
        return picks


def _shape(configs: dict[str, list[PipelineConfig]], cluster: Cluster) -> tuple[str, list[str], _Grid] | None:
    """The last type, the others and their grid; None where the search does not apply."""
    types = [g for g in cluster.gpus if cluster.gpus[g].count > 0
             and any(s.gpu == g for cs in configs.values() for c in cs for s in c.segments)]
    if not types or len(configs) > MAX_MODELS or len(types) - 1 > MAX_OTHER_TYPES:
        return None
    last = max(types, key=lambda g: cluster.gpus[g].count)
    others = [g for g in types if g != last]
    if math.prod(cluster.gpus[g].count + 1 for g in others) > MAX_POINTS:
        return None
    return last, others, _Grid([cluster.gpus[g].count for g in others])


def applies(configs: dict[str, list[PipelineConfig]], cluster: Cluster) -> bool:
    """Whether :func:`decompose_search` searches these inputs (or answers None at once)."""
    return _shape(configs, cluster) is not None


def decompose_search(configs: dict[str, list[PipelineConfig]], weights: dict[str, float], cluster: Cluster,
                     z_lo: float, z_hi: float, deadline: float, rel_gap: float) -> DecomposeResult | None:
    """Search (z_lo, z_hi] for the optimum (module docstring) until ``deadline``; None when the
    grid is too large for it. ``z_lo`` is an incumbent's objective, ``z_hi`` a valid bound."""
    shape = _shape(configs, cluster)
    if shape is None:
        return None
    last, others, grid = shape
    models = list(configs)
    S = _State(configs, weights, cluster, models, others, last, grid, deadline)
    best: list = []
    best_z = -1.0
    bound = INF
    tests = []
    prove = True
    z_top = z_hi if math.isfinite(z_hi) else 0.0
    while time.perf_counter() < deadline:
        lo = max(z_lo, best_z)
        hi = min(z_hi, bound)
        if hi <= lo * (1 + rel_gap) * (1 + 1e-9) + 1e-9 * z_top:
            break
        # alternately: is the best plan optimal (a test just above it), and a bisection step;
        # the first settles most searches, the second bounds how many steps the rest take
        z = lo * (1 + rel_gap) * (1 + 1e-12) if prove else 0.5 * (lo + hi)
        t = time.perf_counter()
        n0 = S.exact_solves()
        fit, picks = S.test(z)
        tests.append([round(z, 6), fit, round(time.perf_counter() - t, 3), S.exact_solves() - n0])
        if fit is None:
            break
        prove = not prove or not fit
        if fit:
            z_got = _objective(picks, weights)
            if z_got > best_z:
                best, best_z = picks, z_got
            if z_got < z * (1 - 1e-9):  # a solver tolerance: never test the same z again
                z_lo = max(z_lo, z)
        else:
            bound = min(bound, z)
    stats = {"tests": tests, "fluid_solves": S.fluid_solves,
             "exact_solves": S.exact_solves(), "grid": grid.size, "last": last}
    return DecomposeResult(best, best_z, bound, stats)


def _whole(x: float) -> float:
    """A lower bound on a count of whole GPUs, rounded up (a hair below a whole number is it)."""
    return float(math.ceil(x - 1e-6)) if math.isfinite(x) else x


def _allocs(picks):
    from .milp import Allocation  # milp imports this module

    return [Allocation(c, counts) for c, counts in picks]


def _served(picks) -> float:
    return sum(a.throughput_rps for a in _allocs(picks))


def _objective(picks, weights) -> float:
    from .milp import _objective

    return _objective(_allocs(picks), weights)


class _State:
    """The tables' bounds across tests of ``z``: what one demand showed bounds the others."""

    def __init__(self, configs, weights, cluster, models, others, last, grid: _Grid, deadline: float):
        self.configs, self.weights, self.cluster = configs, weights, cluster
        self.models, self.others, self.last, self.grid = models, others, last, grid
        self.deadline = deadline
        self.b_last = cluster.gpus[last].count
        self.oracles = {m: _Oracle(m, configs[m], cluster, others, last) for m in models}
        self.pools = {m: model_pools(m, configs[m], cluster) for m in models}
        # per model, of every bound or solution found: (demand, point, lower bound, value, picks,
        # throughput the picks serve); a lower bound holds at any higher demand, a solution at
        # any demand up to what it serves
        self.seen: dict[str, list[tuple[float, int, float, float, list | None, float]]] = {m: [] for m in models}
        self.fluid_solves = 0

    def exact_solves(self) -> int:
        return sum(o.calls for o in self.oracles.values())

    def _priced(self, m: str, demand: float) -> np.ndarray:
        """Lagrangian lower bounds on T_m over the grid at ``demand``."""
        mp = self.pools[m]
        lb = np.zeros(self.grid.size)
        co = self.grid.coords.astype(float)
        K = len(self.others)
        for idx in np.ndindex(*([len(_PRICES)] * K)):
            pi = {g: _PRICES[i] for g, i in zip(self.others, idx, strict=True)}
            pi[self.last] = 1.0
            c, _, _ = min_cost(mp, pi, demand)
            if not math.isfinite(c):
                return np.full(self.grid.size, INF)
            vec = np.array([pi[g] for g in self.others]) if K else np.zeros(0)
            np.maximum(lb, c - co @ vec, out=lb)
        return np.ceil(lb - 1e-6)

    def test(self, z: float) -> tuple[bool | None, list]:
        """Whether some plan serves ``z`` (and one), or None when time ran out."""
        g = self.grid
        M = len(self.models)
        LB = np.zeros((M, g.size))
        UB = np.full((M, g.size), INF)
        SRC = np.full((M, g.size), -1, dtype=np.int64)
        fluid_done = np.zeros((M, g.size), dtype=np.bool_)
        fluid_pools: dict[tuple[int, int], tuple[float, dict]] = {}  # its bound and whole pools
        climb_done = np.zeros((M, g.size), dtype=np.bool_)
        exact_s = np.full((M, g.size), _ORACLE_S)  # a point's next exact MILP may take this long
        exact_done = np.zeros((M, g.size), dtype=np.bool_)
        demands = [self.weights[m] * z for m in self.models]
        for i, m in enumerate(self.models):
            LB[i] = self._priced(m, demands[i])
            for j, (d, p, lo, val, picks, served) in enumerate(self.seen[m]):
                if picks is not None and served >= demands[i] * (1 - 1e-12):
                    _cap_upper(UB[i], SRC[i], g.dims, g.strides, p, val, j)
                if d <= demands[i] and lo > 0:
                    _lift_lower(LB[i], g.dims, g.strides, p, lo)
        lower, upper = _Split(g, M), _Split(g, M)
        while True:
            if time.perf_counter() > self.deadline:
                return None, []
            if upper.dirty and np.all(UB[:, -1] < INF):  # only once every model has a plan
                v_ub, pts_ub = upper.best(UB)
                if v_ub <= self.b_last:
                    return True, self._picks(SRC, pts_ub)
            v, pts = lower.best(LB)
            if v > self.b_last:
                return False, []
            progress = False
            for i, m in enumerate(self.models):
                p = int(pts[i])
                if LB[i, p] >= UB[i, p]:
                    continue
                exact = bool(fluid_done[i, p])
                if exact and exact_done[i, p]:
                    continue
                left = self.deadline - time.perf_counter()
                caps = g.caps(p)
                climbing = exact and not climb_done[i, p]
                lo, val, picks = INF, INF, None
                if exact and (i, p) in fluid_pools:
                    fixed_lo, pools_at = fluid_pools.pop((i, p))
                    if LB[i, p] == fixed_lo:
                        # where the fractional bound binds, whole vGPUs usually fill its pools
                        # (CBC took 30 s to find such a plan on its own, 0.1 s this way)
                        lo, val, picks = self.oracles[m].solve(caps, demands[i], min(_FIXED_S, left), LB[i, p],
                                                               pools_at)
                if picks is not None:
                    climbing = False
                elif climbing:
                    # one step up from the lower bound: refuted, the bound rises by one and the
                    # split is looked at again (it may no longer need this point)
                    most = int(LB[i, p])
                    lo, val, picks = self.oracles[m].refute(caps, demands[i], most, min(_REFUTE_S, left))
                    if picks is None and lo == INF:
                        lo = most + 1.0
                    else:
                        # out of time (the exact MILP comes next), or a plan within the bound
                        # (the bound is then its value: the point is settled)
                        lo = LB[i, p]
                        climb_done[i, p] = True
                elif exact:
                    lo, val, picks = self.oracles[m].solve(caps, demands[i], min(exact_s[i, p], left), LB[i, p])
                else:
                    mp = self.pools[m]
                    lo, G = min_capped(mp, self.last, dict(zip(self.others, caps, strict=True)), demands[i])
                    lo = _whole(lo)
                    last = sum(n for (_, t), n in zip(mp.pools, G, strict=True) if t == self.last)
                    if math.isfinite(lo) and abs(last - lo) < 1e-9:
                        fluid_pools[(i, p)] = (lo, {key: int(round(n)) for key, n in zip(mp.pools, G, strict=True)})
                    val, picks = INF, None
                    self.fluid_solves += 1
                if not exact:
                    fluid_done[i, p] = True
                elif not climbing or picks is not None:
                    exact_done[i, p] = True
                progress = True
                if lo > LB[i, p]:
                    _lift_lower(LB[i], g.dims, g.strides, p, lo)
                    lower.changed(i)
                if lo > 0:
                    self.seen[m].append((demands[i], p, lo, INF, None, 0.0))
                if exact and picks is not None and _served(picks) < demands[i] * (1 - 1e-12):
                    # within CBC's tolerance of the demand but short of it: a plan must serve
                    # it, so the solution comes from a demand a hair higher (its bound holds there)
                    d_up = demands[i] * (1 + 1e-5)
                    left = self.deadline - time.perf_counter()
                    lo_up, val, picks = self.oracles[m].solve(caps, d_up, min(_ORACLE_S, left))
                    self.seen[m].append((d_up, p, lo_up, INF, None, 0.0))
                if exact and picks is not None and (served := _served(picks)) >= demands[i] * (1 - 1e-12):
                    self.seen[m].append((demands[i], p, 0.0, val, picks, served))
                    if val < UB[i, p]:
                        _cap_upper(UB[i], SRC[i], g.dims, g.strides, p, val, len(self.seen[m]) - 1)
                        upper.changed(i)
            if not progress:
                # an exact MILP ran out of time on a point the split needs: again, twice as
                # long, while the deadline allows (efficientnet-b8 at L4 <= 7, V100 <= 9: out of
                # time at 5 s, proven in 5.7 s of the next 10)
                left = self.deadline - time.perf_counter()
                for i in range(M):
                    p = int(pts[i])
                    if LB[i, p] < UB[i, p] and exact_done[i, p] and 2 * exact_s[i, p] <= 4 * left:
                        exact_done[i, p] = False
                        exact_s[i, p] *= 2
                        progress = True
                if not progress:
                    return None, []

    def _picks(self, SRC, pts) -> list:
        out = []
        for i, m in enumerate(self.models):
            j = int(SRC[i, int(pts[i])])
            out.extend(self.seen[m][j][4] or [])
        return out


# ------------------------------------------------------------------ the compiled grid work

@numba.njit(cache=True)
def _box_next(c, f, lo, hi, strides):
    """Odometer step over the box [lo, hi]: returns the next flat index, or -1 after the last."""
    k = c.shape[0] - 1
    while k >= 0:
        if c[k] < hi[k]:
            c[k] += 1
            return f + strides[k]
        f -= (c[k] - lo[k]) * strides[k]
        c[k] = lo[k]
        k -= 1
    return -1


@numba.njit(cache=True)
def _unflat(p, dims, out):
    for k in range(dims.shape[0] - 1, -1, -1):
        out[k] = p % dims[k]
        p //= dims[k]


@numba.njit(cache=True)
def _lift_lower(T, dims, strides, p, val):
    """T[a] = max(T[a], val) for every a <= p."""
    K = dims.shape[0]
    hi = np.empty(K, dtype=np.int64)
    _unflat(p, dims, hi)
    lo = np.zeros(K, dtype=np.int64)
    c = lo.copy()
    f = 0
    while f >= 0:
        if T[f] < val:
            T[f] = val
        f = _box_next(c, f, lo, hi, strides)


@numba.njit(cache=True)
def _cap_upper(T, SRC, dims, strides, p, val, src):
    """T[a] = min(T[a], val) for every a >= p, recording where the value came from."""
    K = dims.shape[0]
    lo = np.empty(K, dtype=np.int64)
    _unflat(p, dims, lo)
    hi = dims - 1
    c = lo.copy()
    f = p
    while f >= 0:
        if val < T[f]:
            T[f] = val
            SRC[f] = src
        f = _box_next(c, f, lo, hi, strides)


class _Split:
    """The best split of the grid's far corner among the models' tables (:func:`_master`),
    keeping the convolutions of the leading tables between calls: a table that changed makes
    only its own stage and those after it be computed again."""

    def __init__(self, grid: _Grid, M: int):
        self.grid, self.M = grid, M
        self.stages: list[tuple[np.ndarray, np.ndarray] | None] = [None] * M
        self.dirty = set(range(M))

    def changed(self, i: int) -> None:
        self.dirty.add(i)

    def best(self, T: np.ndarray) -> tuple[float, np.ndarray]:
        g, M = self.grid, self.M
        if M == 1:
            self.dirty.clear()
            return float(T[0, g.size - 1]), np.array([g.size - 1], dtype=np.int64)
        first = min(self.dirty, default=M - 1)
        for j in range(max(first, 1), M - 1):
            prev = T[0] if j == 1 else self.stages[j - 1][0]
            self.stages[j] = _conv(prev, T[j], g.coords, g.dims, g.strides)
        self.dirty.clear()
        cur = T[0] if M == 2 else self.stages[M - 2][0]
        args = np.zeros((M, g.size), dtype=np.int64)
        for j in range(1, M - 1):
            args[j] = self.stages[j][1]
        return _finish(cur, T[M - 1], args)


def _master(T: np.ndarray, dims: np.ndarray, strides: np.ndarray) -> tuple[float, np.ndarray]:
    """min over a_1 + ... + a_M <= the grid's far corner of sum_m T[m, a_m], and the a_m.

    Each table is nonincreasing, so splitting the whole corner loses nothing; one min-plus
    convolution per model but the last, whose share is then read off at the corner."""
    grid = _Grid([int(d) - 1 for d in dims])
    return _Split(grid, T.shape[0]).best(T)


@numba.njit(cache=True)
def _finish(cur, last, args):
    """The last model's share of the far corner given the others' convolution ``cur``, and
    every model's point, walked back through the convolutions' ``args``."""
    M, n = args.shape
    top = n - 1
    best = np.inf
    ba = 0
    for a in range(n):
        v = cur[top - a] + last[a]
        if v < best:
            best = v
            ba = a
    pts = np.zeros(M, dtype=np.int64)
    pts[M - 1] = ba
    r = top - ba
    for j in range(M - 2, 0, -1):
        pts[j] = args[j, r]
        r -= pts[j]
    pts[0] = r
    return best, pts


@numba.njit(cache=True)
def _corners(T, coords, strides):
    """The points where a nonincreasing table drops in every direction it can step back: the
    only ones a best split uses (a point no lower than one below it wastes budget)."""
    n, K = coords.shape
    out = np.empty(n, dtype=np.int64)
    m = 0
    for a in range(n):
        if not T[a] < np.inf:
            continue
        ok = True
        for k in range(K):
            if coords[a, k] > 0 and not T[a] < T[a - strides[k]]:
                ok = False
                break
        if ok:
            out[m] = a
            m += 1
    return out[:m]


@numba.njit(cache=True)
def _conv(prev, T, coords, dims, strides):
    """new[r] = min over a <= r of prev[r - a] + T[a], and the a. Over pairs of the two tables'
    corners only, then a running minimum along each axis (26^3 points: 0.11 s over every pair
    of points, a few ms this way)."""
    n, K = coords.shape
    new = np.full(n, np.inf)
    arg = np.zeros(n, dtype=np.int64)
    c1s = _corners(prev, coords, strides)
    c2s = _corners(T, coords, strides)
    for c1 in c1s:
        for c2 in c2s:
            ok = True
            for k in range(K):
                if coords[c1, k] + coords[c2, k] >= dims[k]:
                    ok = False
                    break
            if not ok:
                continue
            v = prev[c1] + T[c2]
            pos = c1 + c2
            if v < new[pos]:
                new[pos] = v
                arg[pos] = c2
    for k in range(K):
        for r in range(n):
            if coords[r, k] > 0:
                q = r - strides[k]
                if new[q] < new[r]:
                    new[r] = new[q]
                    arg[r] = arg[q]
    return new, arg
