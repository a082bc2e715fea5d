"""The pool-allocation MILP over pre-enumerated pipeline configurations (python-mip, CBC).

Variables: per configuration ``c`` a continuous throughput ``x_c`` and an integer vGPU count
``n_cd`` per partition ``d`` (one shared count for DART-r's tied pairs); per (model, partition
index, GPU type) an integer count ``G_mdk`` of physical GPUs that covers the fractional use of
its vGPUs, which is how PPipe's "round up to whole GPUs per model, partition index and type"
stays linear (with ``share_gpus``, one ``G_dk`` across models); and ``z``, the weighted
throughput of the worst model, which is maximised. There is no big-M anywhere: every bound
comes from the cluster's GPU counts.

Every branch-and-bound run happens in a forked child (:func:`_cbc`) that is killed when it
overruns its limit, so a solver that hangs costs the limit and no more; the best allocation
found before it is kept and the kill is reported.
"""

from __future__ import annotations

import contextlib
import gc
import inspect
import logging
import math
import os
import pickle
import select
import signal
import sys
import time
from collections import defaultdict
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import mip
import mip.cbc  # parse CBC's cffi declarations (0.4 s) once, before any child forks

from ..cluster import Cluster
from ..plan import gpus_used
from .bounds import fluid_bound, knapsack_bound, model_instances
from .configs import PipelineConfig
from .decompose import applies as decompose_applies
from .decompose import decompose_search
from .lagrange import lagrangian_bound, model_pools

log = logging.getLogger(__name__)


@dataclass
class Allocation:
    """A configuration the solver chose, with its vGPU count per partition."""

    config: PipelineConfig
    vgpus: tuple[int, ...]

    @property
    def throughput_rps(self) -> float:
        return min(n * s.rps_per_vgpu for n, s in zip(self.vgpus, self.config.segments, strict=True))


@dataclass
class SolveInfo:
    """What the solver did, reported as is (status, gap and bound are CBC's own)."""

    status: str
    objective: float
    bound: float
    gap: float
    solve_s: float
    num_configs: int
    num_vars: int
    num_int: int
    num_constrs: int
    threads: int
    time_limit_s: float
    extra: dict = field(default_factory=dict)
    mip_gap: float = 1e-6  # "optimal" means: gap at most this

    def to_json(self) -> dict:
        d = {
            "solver": "cbc", "status": self.status, "objective": self.objective,
            "bound": self.bound, "gap": self.gap, "mip_gap": self.mip_gap, "solve_s": self.solve_s,
            "configs": self.num_configs, "threads": self.threads, "time_limit_s": self.time_limit_s,
        }
        if self.num_vars:  # the full MILP ran (most plans are settled before it)
            d.update(vars=self.num_vars, int_vars=self.num_int, constrs=self.num_constrs)
        d.update(self.extra)
        return d


class NoSolution(RuntimeError):
    """No allocation serves every model: ``proven`` when the optimum is zero, else none was
    found within the time limit."""

    def __init__(self, message: str, proven: bool = False):
        super().__init__(message)
        self.proven = proven


@contextlib.contextmanager
def quiet_stdout() -> Iterator[None]:
    """Send file descriptor 1 to /dev/null while CBC runs: its LP code prints there whatever
    the log level, which would corrupt a CLI table or the planner child's JSON reply."""
    fd = 1
    with contextlib.suppress(AttributeError, OSError, ValueError):
        sys.stdout.flush()
    saved = os.dup(fd)
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, fd)
        yield
    finally:
        os.dup2(saved, fd)
        os.close(saved)
        os.close(devnull)


def cbc_model(sense: str) -> mip.Model:
    """A quiet CBC model without the bound propagation of CBC 2.935 (cbcbox): before the root LP
    and at nodes it called feasible MILPs infeasible ("FBBT divergence ... a Bellman-Ford
    positive-cycle certificate" on min G, x <= 51 n, x >= 265, n <= G <= 7), which at a node
    would prune the optimum and still report "optimal"."""
    m = mip.Model(sense=sense, solver_name=mip.CBC)
    m.verbose = 0
    mip.cbc.cbc_set_parameter(m.solver, "boundPropLevel", "off")
    mip.cbc.cbc_set_parameter(m.solver, "nodeBoundProp", "off")
    return m


def gpu_budget_used(allocs: list[Allocation], share_gpus: bool = False) -> dict[str, int]:
    """Physical GPUs per type under the checker's rounding rule (:func:`ppiped.plan.gpus_used`)."""
    pools = [(a.config.model, d, s.gpu, s.split, n) for a in allocs
             for d, (n, s) in enumerate(zip(a.vgpus, a.config.segments, strict=True))]
    return {g: u["total"] for g, u in gpus_used(pools, share_gpus).items()}


def in_child(fn: Callable[[], Any], limit_s: float) -> tuple[Any, str]:
    """``fn()`` in a forked child, its result pickled back; ("killed" | "crashed" | "ok").

    Every CBC model lives and dies in such a child, for two reasons. A solver that hangs or
    ignores its limit is killed ``limit_s`` in, and the caller keeps what it found before.
    And python-mip's models sit in reference cycles: when the cyclic collector frees one while
    another model is inside a cffi call (``ffi.new`` in ``set_start``), its ``__del__`` waits on
    a lock that call holds and the process hangs for good; the child never collects (and never
    frees: it leaves with ``os._exit``), and the parent never holds a model.

    ``os.fork`` rather than ``multiprocessing``: the child needs the configurations in memory
    (no pickling of thousands of them), and ``multiprocessing`` refuses children of daemonic
    processes such as a process pool's workers.
    """
    out: list[tuple[Any, str]] = []
    race([(fn, limit_s)], lambda _i, answer, how: out.append((answer, how)) or False)
    return next((o for o in out if o[1] == "ok"), out[-1] if out else (None, "crashed"))


def race(jobs: Sequence[tuple[Callable[[], Any], float]],
         settle: Callable[[int, Any, str], bool]) -> None:
    """Run every ``(fn, limit_s)`` of ``jobs`` at once, each in a forked child (see
    :func:`in_child`). ``settle(index, answer, "ok")`` is called for each answer as it arrives
    (a job that returns a generator sends one per item), and once more with None and "killed"
    (its limit passed), "crashed" or "stopped" (one that had sent nothing) for a child that did
    not finish cleanly. When ``settle`` returns True the children still running are stopped.
    How two searches share the cores: the first to settle the question ends both."""
    with contextlib.suppress(AttributeError, OSError, ValueError):
        sys.stdout.flush()
        sys.stderr.flush()
    now = time.monotonic()
    live: dict[int, list] = {}  # read fd -> [index, pid, end, buffer, answers so far]
    for i, (fn, limit_s) in enumerate(jobs):
        rfd, pid = _fork(fn)
        live[rfd] = [i, pid, now + limit_s, b"", 0]
    stop = False
    try:
        while live and not stop:
            left = min(c[2] for c in live.values()) - time.monotonic()
            ready = select.select(list(live), [], [], max(0.0, left))[0] if left > 0 else []
            for rfd in ready:
                child = live[rfd]
                b = os.read(rfd, 1 << 20)
                if b:
                    child[3] += b
                    while len(child[3]) >= 8 and len(child[3]) >= 8 + (n := int.from_bytes(child[3][:8], "little")):
                        frame, child[3] = child[3][8:8 + n], child[3][8 + n:]
                        try:
                            answer, how = pickle.loads(frame), "ok"
                        except Exception:  # noqa: BLE001 - garbled: no answer
                            answer, how = None, "crashed"
                        child[4] += 1
                        stop = settle(child[0], answer, how) or stop
                    continue
                del live[rfd]
                os.close(rfd)
                _, status = os.waitpid(child[1], 0)
                if status != 0 or child[3]:
                    stop = settle(child[0], None, "crashed") or stop
            for rfd in [r for r, c in live.items() if c[2] <= time.monotonic()]:
                stop = settle(_kill(rfd, live.pop(rfd))[0], None, "killed") or stop
    finally:
        for rfd in list(live):
            child = live.pop(rfd)
            if not _kill(rfd, child)[1]:
                settle(child[0], None, "stopped")


def _fork(fn: Callable[[], Any]) -> tuple[int, int]:
    """A child computing ``fn()`` (each item, if a generator) and writing it pickled, length
    first, to a pipe: (read end, pid)."""
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: compute, write the answer, leave without any clean-up
        code = 0
        try:
            os.close(rfd)
            gc.disable()
            out = fn()
            with os.fdopen(wfd, "wb") as f:
                for item in out if inspect.isgenerator(out) else [out]:
                    data = pickle.dumps(item)
                    f.write(len(data).to_bytes(8, "little") + data)
                    f.flush()
        except BaseException:  # noqa: BLE001 - the parent sees a missing answer and says so
            code = 1
        finally:
            os._exit(code)
    os.close(wfd)
    return rfd, pid


def _kill(rfd: int, child: list) -> tuple[int, int]:
    """Kill a child; (its job's index, the answers it sent)."""
    os.close(rfd)
    with contextlib.suppress(ProcessLookupError):
        os.kill(child[1], signal.SIGKILL)
    os.waitpid(child[1], 0)
    return child[0], child[4]


def solve_allocation(
    configs: dict[str, list[PipelineConfig]],
    weights: dict[str, float],
    cluster: Cluster,
    time_limit_s: float = 60.0,
    threads: int = 1,
    rel_gap: float = 1e-6,
    share_gpus: bool = False,
    seeds: Sequence[list[Allocation]] = (),
) -> tuple[list[Allocation], SolveInfo]:
    """Choose vGPU counts for ``configs`` that maximise min over models of throughput/weight.

    Phases, each skipped once an incumbent meets the best bound: the LP relaxation (a bound
    and GPU prices); knapsack bounds (:mod:`.bounds`) under the LP's prices and a few others,
    whose purchases are incumbents when they fit (as are ``seeds``: e.g. the NP plan, which
    PPipe's space contains, so PPipe never ends below it); a MILP restricted to a kernel of promising
    configurations, for a good incumbent quickly; the Lagrangian bound with PPipe's per-model
    whole-GPU rounding (:mod:`.lagrange`), which closes most of what is left when several GPU
    types bind; and the full MILP, warm-started from the incumbent, with ``z`` free (with time
    to spare, capped at the bound first), until ``time_limit_s``. The knapsack bound is usually
    the optimum, so most instances end without the full MILP; where it is not, the status is
    "feasible" and the gap is measured against the best bound found.
    """
    t0 = time.perf_counter()
    deadline = t0 + time_limit_s
    lp, how = in_child(lambda: _lp_relaxation(configs, weights, cluster, threads, share_gpus),
                       max(1.0, time_limit_s) + KILL_GRACE_S)
    if lp is None:
        return _without_lp(configs, weights, cluster, share_gpus, t0, time_limit_s, threads, how, seeds)
    if lp[0] is None:
        raise NoSolution("the LP relaxation has no solution")
    z_lp, lp_prices, lp_used = lp[0], lp[1], {id(c) for mm, i in lp[2] for c in [configs[mm][i]]}
    S = _Search(configs, weights, cluster, threads, rel_gap, deadline, z_lp, share_gpus, t0)
    S.keep |= lp_used
    S.phases["lp_bound"] = z_lp
    S.phases["bound_by"] = "lp"
    S.lap("lp")
    for seed in seeds:
        S.offer(seed, "seed")
        S.keep |= {id(a.config) for a in seed}
    S.try_prices(lp_prices)
    S.phases["knapsack_bound"] = S.bound
    for prices in _price_variants(lp_prices, cluster):
        if S.done() or time.perf_counter() > deadline:
            break
        S.try_prices(prices)
    S.lap("knapsack")
    if not S.best:  # an incumbent, however poor, before anything that may run out of time
        S.offer(_greedy(configs, weights, cluster, lp_prices, share_gpus), "greedy")
    if not S.done():
        # The kernel: what the LP and the knapsacks used, the most efficient configurations at
        # the LP's prices, and every single-partition one (the small pools that fill the last
        # fractional GPUs of a partition index are usually whole-model pipelines).
        S.keep |= _most_efficient(configs, lp_prices, _TOP_K)
        S.keep |= {id(c) for cs in configs.values() for c in cs if len(c.segments) == 1}
        S.restricted(min(_RESTRICTED_MAX_S, max(_RESTRICTED_S, _RESTRICTED_SHARE * (deadline - time.perf_counter()))))
        S.lap("restricted")
    if not S.done() and not share_gpus:
        S.lagrange(time.perf_counter() + _LAGRANGE_SHARE * (deadline - time.perf_counter()))
        S.lap("lagrange")
    stats = (0, 0, 0)
    if not S.done() and time.perf_counter() < deadline - _DEADLINE_MARGIN_S:
        # The full MILP with z free: under a cap the optimum does not attain, every node's LP
        # sits at the cap and CBC's bound cannot move until the whole tree above it is closed
        # (3 and 4 GPU types, 10 and 20 s: capped alone proved 1-4 and 1 of 12, free 7-8 and 5).
        # With time to spare, a capped run first: a search for a plan at the bound, sometimes
        # much the quicker (maf21 efficientnet V100-P4: 8 s capped, 53 s free); at 10-20 s
        # limits its share cost more proofs than it gave (capped first: 6 and 3 of 12).
        left = deadline - time.perf_counter() - _DEADLINE_MARGIN_S
        stats = S.full(left, _CAPPED_SHARE * left if left >= _CAPPED_MIN_LEFT_S else 0.0,
                       decompose=not share_gpus)
    cbc_proved = "optimal" in (S.phases.get("full_status"), S.phases.get("full_capped_status"))
    if not S.best:
        proven = cbc_proved or S.bound <= 1e-9
        raise NoSolution(f"no feasible allocation found in {time.perf_counter() - t0:.1f} s", proven)
    status = "optimal" if cbc_proved or S.done() else "feasible"
    solve_s = time.perf_counter() - t0
    allocs = [Allocation(a.config, _trim(a.config, a.vgpus)) for a in S.best if min(a.vgpus) > 0]
    info = SolveInfo(
        status=status, objective=S.best_z, bound=max(S.bound, S.best_z), gap=_gap(S.best_z, S.bound),
        solve_s=solve_s, num_configs=sum(len(v) for v in configs.values()), num_vars=stats[0],
        num_int=stats[1], num_constrs=stats[2], threads=threads, time_limit_s=time_limit_s,
        extra=S.phases, mip_gap=rel_gap,
    )
    log.info("planner %s: objective %.3f bound %.3f gap %.2e in %.2f s (%d configs, found by %s)",
             info.status, info.objective, info.bound, info.gap, solve_s, info.num_configs,
             S.phases.get("found_by"))
    return allocs, info


def _without_lp(configs, weights, cluster, share_gpus, t0, time_limit_s, threads, how, seeds
                ) -> tuple[list[Allocation], SolveInfo]:
    """When even the LP relaxation did not finish within the limit (its child was killed): the
    better of the seeds (the NP plan) and the greedy plan at equal GPU prices, reported
    ``feasible`` against the fluid bound, or NoSolution. The operator gets a plan and is told
    how good it may be, not a traceback."""
    log.warning("planner: the LP relaxation's child was %s (limit %.1f s, %d configurations); "
                "keeping the best of the NP plan and a greedy one", how, time_limit_s,
                sum(len(v) for v in configs.values()))
    tries = [(list(s), "seed") for s in seeds]
    tries.append((_greedy(configs, weights, cluster, dict.fromkeys(cluster.gpus, 1.0), share_gpus), "greedy"))
    tries = [(a, src) for a, src in tries if a and _fits(a, cluster, share_gpus) and _objective(a, weights) > 0]
    if not tries:
        raise NoSolution(f"the LP relaxation did not finish in {time_limit_s:.0f} s ({how}) and the greedy "
                         "plan serves not every model")
    allocs, found_by = max(tries, key=lambda t: _objective(t[0], weights))
    z = _objective(allocs, weights)
    bound = max(z, min(fluid_bound(configs[mm], cluster) / weights[mm] for mm in configs))
    allocs = [Allocation(a.config, _trim(a.config, a.vgpus)) for a in allocs if min(a.vgpus) > 0]
    info = SolveInfo(status="feasible", objective=z, bound=bound, gap=_gap(z, bound),
                     solve_s=time.perf_counter() - t0, num_configs=sum(len(v) for v in configs.values()),
                     num_vars=0, num_int=0, num_constrs=0, threads=threads, time_limit_s=time_limit_s,
                     extra={"lp": how, "found_by": found_by, "bound_by": "fluid"})
    return allocs, info


# Seconds kept back from CBC at the end for reading its answer and building the plan.
_DEADLINE_MARGIN_S = 1.0
# The restricted MILP gets this many seconds, or this share of what is left if more, but never
# more than the cap: it is there for an incumbent, and the full MILP proves anything left.
_RESTRICTED_S = 1.0
_RESTRICTED_SHARE = 0.1
_RESTRICTED_MAX_S = 5.0
# The full MILP's run with z capped at the bound, made when at least this much time is left,
# gets this share of it.
_CAPPED_MIN_LEFT_S = 30.0
_CAPPED_SHARE = 0.25
# The Lagrangian bound may take this share of what is left before the full MILP.
_LAGRANGE_SHARE = 0.3
# Configurations per model, cheapest per request/s at the LP's prices, in the restricted MILP.
_TOP_K = 8


def _most_efficient(configs, prices, k) -> set[int]:
    """The ``k`` configurations per model that cost least per request/s at ``prices``."""
    out: set[int] = set()
    for cs in configs.values():
        ranked = sorted(cs, key=lambda c: sum(prices.get(s.gpu, 0.0) / s.rps_per_gpu for s in c.segments))
        out |= {id(c) for c in ranked[:k]}
    return out


class _Search:
    """Incumbent, bound and the configurations worth a restricted MILP."""

    def __init__(self, configs, weights, cluster, threads, rel_gap, deadline, z_lp, share_gpus, t0):
        self.configs, self.weights, self.cluster = configs, weights, cluster
        self.share_gpus = share_gpus
        self.threads, self.rel_gap, self.deadline = threads, rel_gap, deadline
        self.bound = z_lp
        self.z_lp = z_lp
        self.best: list[Allocation] = []
        self.best_z = -1.0
        self.keep: set[int] = set()
        self.phases: dict = {}
        self.price_tries = 0
        self.instances = None
        # Knapsack tables by price vector, for the Lagrangian phase: the LP's and the best's.
        self.knapsacks: list[tuple[dict, Any]] = []
        self._t = t0

    def lap(self, phase: str) -> None:
        """Record the seconds spent in ``phase`` since the previous lap."""
        now = time.perf_counter()
        self.phases[f"{phase}_s"] = round(now - self._t, 4)
        self._t = now

    def done(self) -> bool:
        return self.best_z >= self.bound * (1 - self.rel_gap) - 1e-9 * abs(self.bound)

    def offer(self, allocs: list[Allocation], source: str) -> None:
        if allocs and _fits(allocs, self.cluster, self.share_gpus):
            z = _objective(allocs, self.weights)
            if z > self.best_z and (self.best_z <= 0 or z > self.best_z * (1 + 1e-12)):
                self.best, self.best_z = allocs, z
                self.phases["found_by"] = source

    def try_prices(self, prices: dict[str, float]) -> None:
        """Tighten the bound with one price vector; keep what it bought as an incumbent if it
        fits, and its configurations for the restricted MILP."""
        self.price_tries += 1
        if self.instances is None:
            self.instances = {mm: model_instances(cs, self.weights[mm] * self.z_lp, self.cluster)
                              for mm, cs in self.configs.items()}
        kb = knapsack_bound(self.configs, self.weights, self.cluster, prices, self.z_lp, self.instances,
                            round_per_model=not self.share_gpus)
        if not self.knapsacks:
            self.knapsacks.append((prices, kb))  # the first call prices at the LP's duals
        if kb.bound < self.bound:
            self.bound = kb.bound
            self.knapsacks[1:] = [] if self.knapsacks[0][1] is kb else [(prices, kb)]
            # The bound is checkable: knapsack_bound() with these prices gives it again.
            self.phases["bound_by"] = "knapsack"
            self.phases["bound_prices"] = {str(k): v for k, v in prices.items()}
        self.phases["price_vectors"] = self.price_tries
        guess = _merge_picks(kb.picks)
        self.offer(guess, "knapsack")
        self.keep |= {id(a.config) for a in guess}

    def lagrange(self, until: float) -> None:
        """Tighten the bound with PPipe's whole-GPU rounding per model kept (:mod:`.lagrange`)
        at the LP's prices, then at the best knapsack's, searching between the incumbent and
        the bound until ``until`` at most. Each model is charged the larger of its rounded
        fluid cost and its knapsack cost (whole vGPUs), both lower bounds at those prices."""
        pools = {mm: model_pools(mm, cs, self.cluster) for mm, cs in self.configs.items()}
        runs = []
        for prices, kb in self.knapsacks:
            if self.done() or time.perf_counter() >= until:
                break
            b, stats = lagrangian_bound(pools, self.weights, self.cluster, prices, max(0.0, self.best_z),
                                        self.bound, deadline=min(until, self.deadline), floor=kb.money_for)
            runs.append(stats)
            if b < self.bound:
                self.bound = b
                self.phases["bound_by"] = "lagrange"
                self.phases["bound_prices"] = {str(k): v for k, v in prices.items()}
        self.phases["lagrange"] = runs

    def _decompose_job(self, until: float) -> Callable[[], Any]:
        """The exact search over per-model type vectors (:mod:`.decompose`) until ``until``, as
        a child's job: picks as indices, objective, bound, stats (None: not applicable)."""
        def run():
            r = decompose_search(self.configs, self.weights, self.cluster, max(0.0, self.best_z),
                                 self.bound, until, self.rel_gap)
            if r is None:
                return None
            index = _index(self.configs)
            return [(index[id(c)], counts) for c, counts in r.allocs], r.objective, r.bound, r.stats
        return run

    def _absorb_decompose(self, answer, how: str) -> None:
        if how != "ok" or answer is None:
            self.phases["decompose"] = how if how != "ok" else "skipped"
            return
        picks, _obj, bound, stats = answer
        self.offer([Allocation(self.configs[mm][i], tuple(ns)) for (mm, i), ns in picks], "decompose")
        if bound < self.bound:
            self.bound = bound
            self.phases["bound_by"] = "decompose"
        self.phases["decompose"] = stats

    def full(self, seconds: float, capped_s: float, decompose: bool = False) -> tuple[int, int, int]:
        """The MILP over every configuration, warm-started from the incumbent, for ``seconds``:
        its first ``capped_s`` with ``z`` capped at the bound, then free. Returns its size
        (variables, integers, rows). With ``decompose``, the exact search of :mod:`.decompose`
        runs beside it on a core of its own (CBC gets one thread fewer), and whichever settles
        the optimum first ends both: the search proves in seconds what CBC takes minutes for
        on some inputs, and CBC what the search cannot on others (its per-model MILPs can be
        hard)."""
        threads = self.threads
        end = time.perf_counter() + seconds
        configs, weights, cluster, rel_gap, share = self.configs, self.weights, self.cluster, self.rel_gap, self.share_gpus
        bound, best = self.bound, self.best

        def cbc_runs():
            start = best
            if capped_s > 0:
                answer = _cbc_job(configs, weights, cluster, bound, capped_s, threads, rel_gap, start, share)()
                yield "full_capped", answer
                if answer[0] == "optimal":
                    return
                r = _cbc_result(answer, "ok", configs, bound, capped_s)
                if r.allocs and (not start or _objective(r.allocs, weights) > _objective(start, weights)):
                    start = r.allocs
            left = max(0.1, end - time.perf_counter())
            yield "full", _cbc_job(configs, weights, cluster, None, left, threads, rel_gap, start, share)()

        jobs = [(cbc_runs, seconds + KILL_GRACE_S)]
        if decompose and decompose_applies(configs, cluster):
            jobs.append((self._decompose_job(end), seconds + KILL_GRACE_S))
        size = [(0, 0, 0)]
        names = ["full_capped" if capped_s > 0 else "full"]  # the run under way

        def settle(i: int, answer, how: str) -> bool:
            if i == 1:
                self._absorb_decompose(answer, how)
                return self.done()
            if how != "ok":
                if how != "stopped":
                    self.phases[f"{names[-1]}_killed"] = True
                    self.phases[f"{names[-1]}_status"] = how
                    log.warning("planner: a CBC child was %s (limit %.1f s); keeping the best plan "
                                "found before it", how, seconds)
                return False
            name, answer = answer
            z_cap = bound if name == "full_capped" else None
            r = _cbc_result(answer, how, self.configs, z_cap, seconds)
            self.offer(r.allocs, name)
            if r.status == "optimal":
                if max(self.best_z, r.bound) < self.bound:
                    self.bound = max(self.best_z, r.bound)
                    self.phases["bound_by"] = "cbc"
            elif r.status in ("feasible", "no_solution_found", "other") and 0 < r.bound < self.bound:
                self.bound = r.bound
                self.phases["bound_by"] = "cbc"
            self.phases[f"{name}_status"] = r.status
            self.lap(name)
            names.append("full")
            size[0] = (r.num_vars, r.num_int, r.num_constrs)
            return self.done() or r.status == "optimal"

        race(jobs, settle)
        self.lap("full_rest")
        return size[0]

    def restricted(self, seconds: float) -> None:
        """A MILP over the kept configurations only, for a quick good incumbent."""
        left = self.deadline - time.perf_counter()
        if left <= 0:
            return
        sub = {mm: [c for c in cs if id(c) in self.keep] for mm, cs in self.configs.items()}
        if any(not cs for cs in sub.values()):
            return
        r = _cbc(sub, self.weights, self.cluster, self.bound, min(seconds, left),
                 self.threads, self.rel_gap, self.best, self.share_gpus)
        self.offer(r.allocs, "restricted")
        if r.killed:
            self.phases["restricted_killed"] = True
        self.phases["restricted_configs"] = sum(len(v) for v in sub.values())


def _price_variants(lp_prices: dict[str, float], cluster: Cluster) -> list[dict[str, float]]:
    """Price vectors to try after the LP's: the dominant type with the others discounted, and
    each type alone. Integer effects make the LP's relative prices rarely the best ones."""
    gs = [g for g in cluster.gpus if cluster.gpus[g].count > 0]
    if not gs:
        return []
    top = max(gs, key=lambda g: lp_prices.get(g, 0.0) * cluster.gpus[g].count)
    out = []
    if any(lp_prices.get(g, 0.0) > 0 for g in gs if g != top):
        for f in (0.5, 0.25, 0.75, 0.1):
            out.append({g: (p if g == top else p * f) for g, p in lp_prices.items()})
    for g in [top] + [g for g in gs if g != top]:
        out.append({h: (1.0 if h == g else 0.0) for h in gs})
    return out


@dataclass
class _CbcResult:
    status: str
    allocs: list[Allocation]
    objective: float
    bound: float
    num_vars: int
    num_int: int
    num_constrs: int
    killed: bool = False


# Seconds a branch-and-bound child may run past its own limit before it is killed.
KILL_GRACE_S = 3.0


def _cbc(configs, weights, cluster, z_cap, time_limit_s, threads, rel_gap, start,
         share_gpus) -> _CbcResult:
    """One CBC run on the MILP over ``configs`` with ``z`` capped at ``z_cap`` (None: free), in
    a child killed ``KILL_GRACE_S`` after ``time_limit_s``."""
    answer, how = in_child(_cbc_job(configs, weights, cluster, z_cap, time_limit_s, threads, rel_gap,
                                    start, share_gpus), time_limit_s + KILL_GRACE_S)
    return _cbc_result(answer, how, configs, z_cap, time_limit_s)


def _cbc_job(configs, weights, cluster, z_cap, time_limit_s, threads, rel_gap, start,
             share_gpus) -> Callable[[], tuple]:
    """A CBC run as a child's job; the child sends back only indices and counts."""
    def run():
        out = _cbc_in_process(configs, weights, cluster, z_cap, time_limit_s, threads, rel_gap,
                              start, share_gpus)
        index = _index(configs)
        return (out.status, [(index[id(a.config)], a.vgpus) for a in out.allocs], out.objective,
                out.bound, out.num_vars, out.num_int, out.num_constrs)
    return run


def _cbc_result(answer, how: str, configs, z_cap, time_limit_s) -> _CbcResult:
    if answer is None and how == "stopped":  # another search settled it first
        return _CbcResult(how, [], -1.0, math.inf if z_cap is None else z_cap, 0, 0, 0)
    if answer is None:
        log.warning("planner: a CBC child was %s (limit %.1f s); keeping the best plan found "
                    "before it", how, time_limit_s)
        return _CbcResult(how, [], -1.0, math.inf if z_cap is None else z_cap, 0, 0, 0, how == "killed")
    status, picks, obj, bound, nv, ni, nc = answer
    allocs = [Allocation(configs[mm][i], tuple(ns)) for (mm, i), ns in picks]
    return _CbcResult(status, allocs, obj, bound, nv, ni, nc)


def _index(configs) -> dict[int, tuple[str, int]]:
    return {id(c): (mm, i) for mm, cs in configs.items() for i, c in enumerate(cs)}


def _lp_relaxation(configs, weights, cluster, threads, share_gpus):
    """The LP relaxation's bound, GPU prices (duals of the budget rows) and the
    configurations it uses; (None, ...) when it has no solution."""
    lp = _build(configs, weights, cluster, integer=False, z_cap=None, threads=threads,
                share_gpus=share_gpus)
    with quiet_stdout():
        lp.model.optimize()
    if lp.model.num_solutions == 0:
        return None, {}, []
    index = _index(configs)
    return (float(lp.model.objective_value),
            {g: max(0.0, float(r.pi or 0.0)) for g, r in lp.budget_rows.items()},
            [index[id(c)] for c, x, _ in lp.xs if (x.x or 0.0) > 1e-9],
            {mm: abs(float(r.pi or 0.0)) for mm, r in lp.model_rows.items()})


def _cbc_in_process(configs, weights, cluster, z_cap, time_limit_s, threads, rel_gap, start,
                    share_gpus) -> _CbcResult:
    """The CBC run itself. A cap on ``z`` (a known bound) makes it a search for a plan at the
    bound: quick to find one there, slow to prove there is none."""
    cap = None if z_cap is None else z_cap * (1 + 1e-9) + 1e-9
    B = _build(configs, weights, cluster, integer=True, z_cap=cap, threads=threads, share_gpus=share_gpus)
    m = B.model
    m.max_mip_gap = rel_gap
    m.max_mip_gap_abs = 0.0  # the relative gap alone: objectives of any scale (an absolute one called 1e-10 optimal)
    if start:
        vals = _start_values(start, B.xs, weights, B.z)
        if vals:
            m.start = vals
    with quiet_stdout():
        st = m.optimize(max_seconds=time_limit_s)
    allocs = []
    obj = -1.0
    if m.num_solutions:
        for c, _x, ns in B.xs:
            counts = tuple(int(round(n.x)) for n in ns)
            if min(counts) > 0:
                allocs.append(Allocation(c, counts))
        obj = _objective(allocs, weights) if allocs else 0.0
    bound = float(m.objective_bound) if m.objective_bound is not None else (cap or math.inf)
    return _CbcResult(st.name.lower(), allocs, obj, bound, m.num_cols, m.num_int, m.num_rows)


def _gap(obj: float, bound: float) -> float:
    if obj <= 0:
        return math.inf if bound > 0 else 0.0
    return max(0.0, (bound - obj) / obj)


def _trim(c: PipelineConfig, counts: tuple[int, ...]) -> tuple[int, ...]:
    """Give each pool only the vGPUs the pipeline's slowest pool can feed."""
    if c.tied:
        return counts
    x = min(n * s.rps_per_vgpu for n, s in zip(counts, c.segments, strict=True))
    out = []
    for n, s in zip(counts, c.segments, strict=True):
        k = max(1, math.ceil(x / s.rps_per_vgpu - 1e-9))
        out.append(min(n, k) if k * s.rps_per_vgpu >= x * (1 - 1e-12) else n)
    return tuple(out)


def _start_values(start, xs, weights, z) -> list[tuple[mip.Var, float]]:
    """CBC's warm start from an allocation, clipped to the model's bounds (a model that got
    more than the cap needs keeps only what the bounds allow, which stays feasible)."""
    by_cfg = {id(a.config): a for a in start}
    vals: list[tuple[mip.Var, float]] = []
    tot: dict[str, float] = defaultdict(float)
    for c, x, ns in xs:
        a = by_cfg.get(id(c))
        if a is None:
            continue
        counts = [min(float(k), n.ub) for n, k in zip(ns, a.vgpus, strict=True)]
        xv = min(x.ub, min(k * s.rps_per_vgpu for k, s in zip(counts, c.segments, strict=True)))
        vals.append((x, xv))
        tot[c.model] += xv
        done = set()
        for n, k in zip(ns, counts, strict=True):
            if id(n) not in done:
                vals.append((n, k))
                done.add(id(n))
    if tot:
        vals.append((z, min(z.ub, min(tot.get(mm, 0.0) / w for mm, w in weights.items()))))
    return vals


@dataclass
class _Built:
    model: mip.Model
    xs: list[tuple[PipelineConfig, mip.Var, list[mip.Var]]]
    z: mip.Var
    budget_rows: dict[str, mip.Constr]
    model_rows: dict[str, mip.Constr]
    gpus: dict[str, list[mip.Var]]  # per type, its whole-GPU counts G


def _build(configs, weights, cluster: Cluster, integer: bool, z_cap: float | None, threads: int,
           share_gpus: bool = False, integer_gpus: bool = False) -> _Built:
    """The MILP (or its LP relaxation; ``integer_gpus``: only the vGPU counts relaxed). ``z_cap``
    is a known bound on the objective.

    With a cap, no model needs more than weight × cap: pipelines and pools may be bounded by
    that without losing any optimum (surplus vGPUs can always be taken away), which keeps the
    integer variables' ranges, and so CBC's branching, small.
    """
    m = cbc_model(mip.MAXIMIZE)
    m.threads = threads
    kind = mip.INTEGER if integer else mip.CONTINUOUS
    models = list(configs)
    z_ub = min(fluid_bound(configs[mm], cluster) / weights[mm] for mm in models)
    if z_cap is not None:
        z_ub = min(z_ub, z_cap)
    z = m.add_var("z", lb=0.0, ub=max(z_ub, 0.0))
    xs: list[tuple[PipelineConfig, mip.Var, list[mip.Var]]] = []
    model_rows: dict[str, mip.Constr] = {}
    # Pools whose vGPU use is rounded up together: PPipe's (model, index, type), or (index, type).
    pool_use: dict[tuple, list[tuple[float, mip.Var]]] = defaultdict(list)
    for mm in models:
        xm = []
        need = weights[mm] * z_ub
        for c in configs[mm]:
            tag = f"{len(xs)}"
            ub_x = min(min(cluster.gpus[s.gpu].count * s.rps_per_gpu for s in c.segments), need)
            x = m.add_var(f"x{tag}", lb=0.0, ub=ub_x)
            if c.tied:
                # One count for every partition, so each replica runs at the slowest one's rate.
                rate = min(s.rps_per_vgpu for s in c.segments)
                cnt = min(min(cluster.gpus[s.gpu].count * s.split for s in c.segments),
                          math.ceil(ub_x / rate - 1e-9))
                n = m.add_var(f"n{tag}", var_type=kind, lb=0, ub=cnt)
                ns = [n] * len(c.segments)
            else:
                ns = []
                for d, s in enumerate(c.segments):
                    ub_n = min(cluster.gpus[s.gpu].count * s.split, math.ceil(ub_x / s.rps_per_vgpu - 1e-9))
                    ns.append(m.add_var(f"n{tag}_{d}", var_type=kind, lb=0, ub=ub_n))
            for d, (s, n) in enumerate(zip(c.segments, ns, strict=True)):
                m += x <= s.rps_per_vgpu * n
                pool_use[(s.gpu, d) if share_gpus else (s.gpu, d, mm)].append((1.0 / s.split, n))
            xs.append((c, x, ns))
            xm.append(x)
        model_rows[mm] = m.add_constr(mip.xsum(xm) >= weights[mm] * z, name=f"serve_{len(model_rows)}")
    per_type: dict[str, list[mip.Var]] = defaultdict(list)
    for key, terms in pool_use.items():
        g = key[0]
        G = m.add_var(f"G{len(per_type[g])}_{g}", var_type=mip.INTEGER if integer_gpus else kind, lb=0,
                      ub=cluster.gpus[g].count)
        # Integer coefficients (in 1/lcm of the splits) let CBC derive knapsack and MIR cuts.
        lcm = math.lcm(*(round(1 / coef) for coef, _ in terms))
        m += mip.xsum(round(coef * lcm) * n for coef, n in terms) <= lcm * G
        per_type[g].append(G)
    rows = {}
    for g, Gs in per_type.items():
        rows[g] = m.add_constr(mip.xsum(Gs) <= cluster.gpus[g].count, name=f"budget_{g}")
    m.objective = mip.maximize(z)
    return _Built(m, xs, z, rows, model_rows, dict(per_type))


def _greedy(configs, weights, cluster: Cluster, prices: dict[str, float],
            share_gpus: bool) -> list[Allocation]:
    """A feasible plan in a fraction of a second: grow the worst-served model by one small
    balanced instance of the cheapest configuration (at ``prices``) that still fits the GPU
    rule, until no model can grow. Instances grow in steps of about 1 % of a type's GPUs, so
    the loop stays short on clusters of thousands."""
    def cost(c):
        return sum((prices.get(s.gpu, 0.0) or 1.0) / s.rps_per_gpu for s in c.segments)

    ranked = {mm: sorted(cs, key=cost) for mm, cs in configs.items()}
    frac: dict[tuple, float] = defaultdict(float)  # rounding group -> GPUs, fractional
    used: dict[str, int] = defaultdict(int)  # type -> GPUs after rounding
    got: dict[str, float] = dict.fromkeys(configs, 0.0)
    counts: dict[int, list] = {}
    open_models = set(configs)
    while open_models:
        mm = min(open_models, key=lambda k: got[k] / weights[k])
        for c in ranked[mm]:
            top = max(s.rps_per_vgpu for s in c.segments)
            step = max(1, min(cluster.gpus[s.gpu].count for s in c.segments) // 100)
            ns = [max(1, math.ceil(step * top / s.rps_per_vgpu - 1e-9)) for s in c.segments]
            if c.tied:
                ns = [max(ns)] * len(ns)
            delta: dict[str, int] = defaultdict(int)
            keys = []
            for d, (n, s) in enumerate(zip(ns, c.segments, strict=True)):
                key = (s.gpu, d) if share_gpus else (s.gpu, d, mm)
                keys.append((key, n / s.split))
            new = dict((k, frac[k]) for k, _ in keys)
            for k, g in keys:
                new[k] += g
            for k, v in new.items():
                delta[k[0]] += math.ceil(v - 1e-9) - math.ceil(frac[k] - 1e-9)
            if all(used[g] + dv <= cluster.gpus[g].count for g, dv in delta.items()):
                frac.update(new)
                for g, dv in delta.items():
                    used[g] += dv
                e = counts.setdefault(id(c), [c, [0] * len(ns)])
                e[1] = [a + b for a, b in zip(e[1], ns, strict=True)]
                got[mm] = sum(Allocation(cc, tuple(v)).throughput_rps for cc, v in counts.values()
                              if cc.model == mm)
                break
        else:
            open_models.discard(mm)
    return [Allocation(c, tuple(v)) for c, v in counts.values()]


def _merge_picks(picks: dict[str, list[tuple[PipelineConfig, tuple[int, ...]]]]) -> list[Allocation]:
    """One pipeline per configuration: pools of repeated picks add up."""
    merged: dict[int, list] = {}
    for items in picks.values():
        for c, ns in items:
            e = merged.setdefault(id(c), [c, [0] * len(ns)])
            e[1] = [a + b for a, b in zip(e[1], ns, strict=True)]
    return [Allocation(c, tuple(ns)) for c, ns in merged.values()]


def _fits(allocs: list[Allocation], cluster: Cluster, share_gpus: bool) -> bool:
    used = gpu_budget_used(allocs, share_gpus)
    return all(n <= cluster.gpus[g].count for g, n in used.items())


def _objective(allocs: list[Allocation], weights: dict[str, float]) -> float:
    tot: dict[str, float] = defaultdict(float)
    for a in allocs:
        tot[a.config.model] += a.throughput_rps
    return min(tot.get(mm, 0.0) / w for mm, w in weights.items())
