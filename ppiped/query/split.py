"""Planning apps: split each app's end-to-end SLO across its stages, then plan every stage of
every app, beside plain models, in one joint MILP (issue #17).

Every stage becomes a model of the plan. Its load weight is the app's weight times the stage's
rate factor (the fan-outs on its path), so one max–min objective covers queries and plain
models alike, and its SLO is its budget: the share of the app's SLO the split gave it. On every
root-to-leaf path the budgets plus one glue step per edge fit the SLO (:meth:`App.end_us`).

Split methods (:data:`SPLITS`):

- ``dp`` (Nexus): budgets on a grid of ``1/steps`` of the SLO. Per stage and grid budget a cost,
  the GPUs one request/s of the stage needs at that budget: the cluster's GPU count over what
  the configurations the planner would offer (``algo_configs``) can carry on the whole cluster
  (``fluid_bound``). A DP over the tree picks the budgets that minimise the sum over stages of
  rate factor × cost, paths within the SLO. No MILP runs per grid point: only the joint one at
  the end. The batching-delay rate behind the costs starts at none (no delay) and is then set
  to the stage's share of the fluid estimate of the query rate, and the DP runs again.
- ``even``: budgets proportional to each stage's whole-model batch-1 latency on the reference
  GPU (``params.slo_reference_gpu`` when every stage's profile has it, else the fastest GPU of
  the cluster), scaled so that the tightest path fills the SLO.
- ``fixed``: the budgets the apps file gives (``budget_ms`` on every stage).

With every method each leaf's budget is then stretched to the end of its path: a larger budget
never costs more, and the whole SLO is used. Each stage's budget is its model's SLO in the plan,
so the planner's SLO margin applies per stage. The reported cost of an ``even`` or ``fixed``
stage is at its budget without batching delay (those splits estimate no rates).
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..cluster import Cluster
from ..errors import InputError
from ..plan import WEIGHT_MAX, WEIGHT_MIN, Plan, PlanParams, model_slo_us
from ..planner.api import ALGOS, algo_configs, plan_cluster
from ..planner.bounds import fluid_bound
from ..planner.configs import latency_budget_us
from ..profiles import Profile
from ..readfile import read_json, read_toml
from .app import App, apps_from_json

SPLITS = ("dp", "even", "fixed")
GRID_STEPS = 20  # the DP's grid: budgets in steps of 5 % of the SLO
_DP_ROUNDS = 3  # DP runs at most: once without batching delay, then with estimated rates
_EPS = 1e-9


@dataclass
class AppSplit:
    """What the split decided: the apps with budgets and the joint planning call's inputs."""

    apps: list[App]
    models: list[str]  # plain models first, then every app's stages in order
    weights: list[float]
    slos_us: list[float]
    report: dict[str, Any] = field(default_factory=dict)  # goes to plan.solver["apps"]
    seconds: float = 0.0  # the split's own time (plan.solver["split_s"])


def split_apps(
    profiles: Mapping[str, Profile],
    apps: Sequence[App],
    cluster: Cluster,
    params: PlanParams | None = None,
    algo: str = "ppipe",
    method: str = "dp",
    models: Sequence[str] = (),
    weights: Sequence[float] | None = None,
    slos_us: Sequence[float] | None = None,
    steps: int = GRID_STEPS,
    time_limit: float = math.inf,
) -> AppSplit:
    """Split every app's SLO with ``method``; ``models``/``weights``/``slos_us`` are the plain
    models planned beside the apps (their SLOs default to ``params``' scale rule).

    ``time_limit`` is the whole plan's: the DP's refining rounds run only in its first half,
    and a first round that overruns it is an error (the joint MILP still needs its time).
    Raises :class:`InputError` naming the app and stage when no split can meet a stage.
    """
    t0 = time.perf_counter()
    params = params or PlanParams()
    if method not in SPLITS:
        raise InputError(f"unknown SLO split {method!r} (choose from {', '.join(SPLITS)})")
    if algo not in ALGOS:
        raise InputError(f"unknown algorithm {algo!r} (choose from {', '.join(ALGOS)})")
    if not apps:
        raise InputError("no apps to plan")
    if steps < 2:
        raise InputError(f"the split grid needs at least 2 steps, got {steps}")
    plain, pw, ps = _plain_models(profiles, models, weights, slos_us, params)
    _check_apps(profiles, apps, plain, cluster)
    total_gpus = float(sum(g.count for g in cluster.gpus.values()))
    report: dict[str, Any] = {}
    done: list[App] = []
    if method == "dp":
        done, report = _dp_all(profiles, apps, cluster, params, algo, steps, plain, pw, ps, total_gpus,
                               t0, time_limit)
    else:
        for a in apps:
            if method == "fixed":
                if not a.split_done:
                    raise InputError(f"app {a.name!r}: the fixed split needs budget_ms on every stage")
                b = [s.budget_us for s in a.stages]
            else:
                b = _even_budgets(profiles, a, cluster, params)
            b = _stretch_leaves(a, b)
            for i, s in enumerate(a.stages):
                if not algo_configs(profiles[s.model], cluster, params, algo, b[i], None, max_batch=1):
                    raise InputError(_stage_miss(profiles[s.model], a, i, cluster, params, algo, b[i],
                                                 f"its {method} budget"))
            done.append(a.with_budgets(b, method))
            report[a.name] = _app_report(a, b, method, [_cost(profiles[s.model], cluster, params, algo,
                                                              b[i], None, total_gpus)
                                                        for i, s in enumerate(a.stages)])
    out_models, out_w, out_slo = list(plain), list(pw), list(ps)
    for a in done:
        for i, s in enumerate(a.stages):
            w = a.weight * a.rate_factor(i)
            if not WEIGHT_MIN <= w <= WEIGHT_MAX:
                raise InputError(f"app {a.name!r}, stage {s.name!r}: its load weight, the app's weight "
                                 f"{a.weight:g} x the fan-outs on its path {a.rate_factor(i):g} = {w:g}, is "
                                 f"outside [{WEIGHT_MIN:g}, {WEIGHT_MAX:g}] (scale the weights or fan-outs)")
            out_models.append(s.model)
            out_w.append(w)
            out_slo.append(s.budget_us)
    return AppSplit(done, out_models, out_w, out_slo, report, time.perf_counter() - t0)


def plan_apps(
    profiles: Mapping[str, Profile],
    apps: Sequence[App],
    cluster: Cluster,
    params: PlanParams | None = None,
    algo: str = "ppipe",
    method: str = "dp",
    models: Sequence[str] = (),
    weights: Sequence[float] | None = None,
    slos_us: Sequence[float] | None = None,
    time_limit: float = 60.0,
    batch_delay_rates: Mapping[str, float] | None = None,
    threads: int = 1,
    mip_gap: float = 1e-6,
    steps: int = GRID_STEPS,
) -> Plan:
    """Split the apps' SLOs, then plan their stages and the plain models in one ``plan_cluster``
    call. ``batch_delay_rates``, keyed by model, must cover every model when given."""
    t0 = time.perf_counter()
    sp = split_apps(profiles, apps, cluster, params, algo, method, models, weights, slos_us, steps, time_limit)
    rates = None
    if batch_delay_rates is not None:
        missing = [m for m in sp.models if m not in batch_delay_rates]
        if missing:
            raise InputError(f"no batch-delay rate for model(s) {', '.join(missing)}")
        rates = [float(batch_delay_rates[m]) for m in sp.models]
    left = max(0.5, time_limit - (time.perf_counter() - t0))
    plan = plan_cluster(profiles, sp.models, sp.weights, cluster, params, algo, left, rates, threads,
                        sp.slos_us, mip_gap)
    return attach_split(plan, sp)


def attach_split(plan: Plan, split: AppSplit) -> Plan:
    """Give a plan made from ``split``'s inputs its apps and the split's report."""
    plan.apps = list(split.apps)
    plan.solver["apps"] = split.report
    plan.solver["split_s"] = split.seconds
    return plan


# --- inputs ------------------------------------------------------------------------------------


def _plain_models(profiles, models, weights, slos_us, params) -> tuple[list[str], list[float], list[float]]:
    models = list(models)
    weights = [1.0] * len(models) if weights is None else [float(w) for w in weights]
    if len(weights) != len(models):
        raise InputError(f"{len(models)} models but {len(weights)} weights")
    if slos_us is not None and len(slos_us) != len(models):
        raise InputError(f"{len(models)} models but {len(slos_us)} SLOs")
    missing = [m for m in models if m not in profiles]
    if missing:
        raise InputError(f"no profile for model(s) {', '.join(missing)} "
                         f"(profiles: {', '.join(sorted(profiles)) or 'none'})")
    slos = []
    for i, m in enumerate(models):
        s = float(slos_us[i]) if slos_us is not None else model_slo_us(profiles[m], params)
        if s is None:
            raise InputError(f"no SLO for {m}: give SLOs explicitly or a scale and a reference GPU "
                             f"the profile has (it has {', '.join(profiles[m].whole_model_latency_us)})")
        slos.append(s)
    return models, weights, slos


def _check_apps(profiles, apps, plain, cluster) -> None:
    seen: dict[str, str] = {}
    names = set()
    for a in apps:
        a.validate()
        if a.name in names:
            raise InputError(f"two apps are named {a.name!r}")
        names.add(a.name)
        for s in a.stages:
            w = f"app {a.name!r}, stage {s.name!r}"
            if s.model not in profiles:
                raise InputError(f"{w}: no profile for model {s.model!r} "
                                 f"(profiles: {', '.join(sorted(profiles)) or 'none'})")
            if s.model in plain:
                raise InputError(f"{w}: model {s.model!r} is also listed as a plain model; a model "
                                 "serves one stage of one app or is planned on its own, not both")
            if s.model in seen:
                raise InputError(f"{w}: model {s.model!r} already serves a stage of app "
                                 f"{seen[s.model]!r} (a model serves one stage)")
            seen[s.model] = a.name
            if not any(g in profiles[s.model].latency for g, t in cluster.gpus.items() if t.count > 0):
                raise InputError(f"{w}: model {s.model!r} is not profiled on any GPU type of the "
                                 f"cluster ({', '.join(cluster.gpus)})")


# --- costs -------------------------------------------------------------------------------------


def _cost(profile, cluster, params, algo, budget_us, rate, total_gpus) -> float:
    """GPUs per request/s at ``budget_us``: the cluster over what the configurations the planner
    would offer can carry on it (inf when none meets the budget)."""
    cs = algo_configs(profile, cluster, params, algo, budget_us, rate)
    if not cs:
        return math.inf
    x = fluid_bound(cs, cluster)
    return total_gpus / x if x > 0 else math.inf


def _fastest_us(profile: Profile, cluster: Cluster) -> float:
    return min((profile.partition_latency_us(g, 1, 0, profile.num_blocks, 1)
                for g, t in cluster.gpus.items()
                if t.count > 0 and g in profile.latency and 1 in profile.latency[g]), default=math.inf)


def _stage_miss(profile, app: App, i: int, cluster, params, algo, budget_us, what: str) -> str:
    s = app.stages[i]
    fast = _fastest_us(profile, cluster)
    need = fast / (1 - params.slo_margin) if params.slo_margin < 1 else math.inf
    return (f"app {app.name!r}, stage {s.name!r} (model {s.model}): no {algo} pipeline meets {what} "
            f"({budget_us / 1e3:.1f} ms; {latency_budget_us(budget_us, params) / 1e3:.1f} ms after the "
            f"{params.slo_margin:.0%} SLO margin) within the app's SLO of {app.slo_us / 1e3:.1f} ms; the "
            f"fastest whole GPU of this cluster takes {fast / 1e3:.1f} ms at batch size 1, so the stage "
            f"needs a budget of at least {need / 1e3:.1f} ms")


# --- the splits --------------------------------------------------------------------------------


def _stretch_leaves(app: App, budgets: Sequence[float]) -> list[float]:
    """Give each leaf what its path leaves over (a leaf lies on one path only)."""
    b = list(budgets)
    for p in app.paths():
        leaf = p[-1]
        above = sum(b[j] for j in p[:-1])
        b[leaf] = max(b[leaf], app.slo_us - app.glue_us * (len(p) - 1) - above)
    return b


def _even_budgets(profiles, app: App, cluster: Cluster, params: PlanParams) -> list[float]:
    ref = params.slo_reference_gpu
    if ref is not None and all(ref in profiles[s.model].whole_model_latency_us for s in app.stages):
        lat = [profiles[s.model].whole_model_latency_us[ref] for s in app.stages]
    else:
        lat = [_fastest_us(profiles[s.model], cluster) for s in app.stages]
    for i, x in enumerate(lat):
        if not (x > 0 and math.isfinite(x)):
            s = app.stages[i]
            raise InputError(f"app {app.name!r}, stage {s.name!r}: no batch-1 latency of model "
                             f"{s.model} on the reference GPU or this cluster to split by")
    scale = min((app.slo_us - app.glue_us * (len(p) - 1)) / sum(lat[j] for j in p) for p in app.paths())
    return [scale * x for x in lat]


def _dp_all(profiles, apps, cluster, params, algo, steps, plain, pw, ps, total_gpus, t0, time_limit):
    """The DP for every app, rerun with batching-delay rates from its own fluid estimate while
    half the time limit is left."""
    rates: dict[str, float | None] = {m: None for a in apps for m in (s.model for s in a.stages)}
    rates.update(dict.fromkeys(plain))
    chosen: dict[str, list[int]] = {}
    results: dict[str, tuple] = {}
    rounds = 0
    while rounds < _DP_ROUNDS:
        if rounds and time.perf_counter() - t0 > time_limit / 2:
            break
        rounds += 1
        prev = dict(chosen)
        for a in apps:
            costs = []
            for i, s in enumerate(a.stages):
                if rounds == 1 and time.perf_counter() - t0 > time_limit:
                    n = sum(len(x.stages) for x in apps)
                    raise InputError(f"the dp split ran past the time limit ({time_limit:g} s) at app {a.name!r}, "
                                     f"stage {i + 1} of {len(a.stages)} ({n} stages, {steps} budgets each): "
                                     "give more time or use --split even")
                costs.append([_cost(profiles[s.model], cluster, params, algo, k * a.slo_us / steps,
                                    rates[s.model], total_gpus) for k in range(1, steps + 1)])
            ks, obj = _dp(a, costs, steps)
            if ks is None:
                raise InputError(_dp_failure(profiles, a, costs, steps, cluster, params, algo))
            chosen[a.name] = ks
            results[a.name] = (ks, obj, costs)
        # The fluid estimate of the max-min query rate: what the cluster carries with every
        # model at the cost of its chosen budget.
        load = sum(w * _cost(profiles[m], cluster, params, algo, s, rates[m], total_gpus)
                   for m, w, s in zip(plain, pw, ps, strict=True))
        load += sum(a.weight * results[a.name][1] for a in apps)
        x = total_gpus / load if load > 0 and math.isfinite(load) else None
        if x is None or chosen == prev:
            break
        for m, w in zip(plain, pw, strict=True):
            rates[m] = w * x
        for a in apps:
            for i, s in enumerate(a.stages):
                rates[s.model] = a.weight * a.rate_factor(i) * x
    done, report = [], {}
    for a in apps:
        ks, obj, costs = results[a.name]
        u = a.slo_us / steps
        b = _stretch_leaves(a, [k * u for k in ks])
        done.append(a.with_budgets(b, "dp"))
        stage_costs = [costs[i][k - 1] for i, k in enumerate(ks)]
        r = _app_report(a, b, "dp", stage_costs)
        r["dp"] = {
            "grid_steps": steps, "rounds": rounds, "objective_gpus_per_query_rps": obj,
            "batch_delay_rates_rps": {s.model: rates[s.model] for s in a.stages},
            "costs_gpus_per_rps": {s.name: [[round((k + 1) * u / 1e3, 6), _json_num(c)]
                                            for k, c in enumerate(costs[i])]
                                   for i, s in enumerate(a.stages)},
        }
        report[a.name] = r
    return done, report


def _dp(app: App, costs: list[list[float]], steps: int) -> tuple[list[int] | None, float]:
    """Grid units per stage minimising Σ rate factor × cost, every path within the SLO.

    ``best[i][m]``: the least cost of stage ``i``'s subtree when its ancestors used ``m`` units.
    Children come after their parents, so one backward pass fills every table.
    """
    n = len(app.stages)
    u = app.slo_us / steps
    depth = [len(app.path(i)) - 1 for i in range(n)]
    kids = [app.children(i) for i in range(n)]
    best = [[math.inf] * (steps + 1) for _ in range(n)]
    arg = [[0] * (steps + 1) for _ in range(n)]
    for i in range(n - 1, -1, -1):
        rf = app.rate_factor(i)
        for m in range(steps):
            for k in range(steps - m, 0, -1):  # larger budgets first: ties keep the larger
                if (m + k) * u + depth[i] * app.glue_us > app.slo_us * (1 + _EPS):
                    continue
                c = costs[i][k - 1]
                if not math.isfinite(c):
                    break  # smaller budgets cost no less
                total = rf * c + sum(best[j][m + k] for j in kids[i])
                if total < best[i][m]:
                    best[i][m], arg[i][m] = total, k
    if not math.isfinite(best[0][0]):
        return None, math.inf
    ks = [0] * n
    used = [0] * n  # units used above each stage
    for i in range(n):
        ks[i] = arg[i][used[i]]
        for j in kids[i]:
            used[j] = used[i] + ks[i]
    return ks, best[0][0]


def _dp_failure(profiles, app: App, costs, steps, cluster, params, algo) -> str:
    """Why no split fits: a stage that misses even its largest grid budget, or a path whose
    stages' smallest workable budgets add up to more than the SLO."""
    u = app.slo_us / steps
    paths = app.paths()
    kmin = []
    for i, s in enumerate(app.stages):
        longest = max((p for p in paths if i in p), key=len)
        kmax = math.floor((app.slo_us - app.glue_us * (len(longest) - 1)) / u + 1e-6) - (len(longest) - 1)
        if kmax < 1 or not math.isfinite(costs[i][kmax - 1]):
            return _stage_miss(profiles[s.model], app, i, cluster, params, algo, max(kmax, 0) * u,
                               f"the largest grid budget its path {_path_name(app, longest)} leaves it")
        kmin.append(next(k for k in range(1, steps + 1) if math.isfinite(costs[i][k - 1])))
    for p in paths:
        need = sum(kmin[j] for j in p) * u + app.glue_us * (len(p) - 1)
        if need > app.slo_us * (1 + _EPS):
            parts = ", ".join(f"{app.stages[j].name} {kmin[j] * u / 1e3:.1f} ms" for j in p)
            return (f"app {app.name!r}: no split of the SLO of {app.slo_us / 1e3:.1f} ms meets every stage "
                    f"on the path {_path_name(app, p)}: the smallest workable budgets ({parts}) and "
                    f"{len(p) - 1} glue step(s) of {app.glue_us / 1e3:.1f} ms need {need / 1e3:.1f} ms")
    return f"app {app.name!r}: no split of the SLO meets every stage"  # pragma: no cover


def _path_name(app: App, p: Sequence[int]) -> str:
    return " -> ".join(app.stages[j].name for j in p)


def _json_num(x: float) -> float | None:
    return x if math.isfinite(x) else None


def _app_report(app: App, budgets: Sequence[float], method: str, costs: Sequence[float]) -> dict[str, Any]:
    return {
        "method": method, "slo_ms": app.slo_us / 1e3, "glue_ms": app.glue_us / 1e3, "weight": app.weight,
        "stages": [{"stage": s.name, "model": s.model,
                    "after": app.stages[s.parent].name if s.parent >= 0 else None,
                    "fanout": s.fanout, "rate_factor": app.rate_factor(i),
                    "weight": app.weight * app.rate_factor(i),
                    "budget_ms": budgets[i] / 1e3, "share": budgets[i] / app.slo_us,
                    "cost_gpus_per_rps": _json_num(costs[i])}
                   for i, s in enumerate(app.stages)],
    }


def load_apps(path: str | Path) -> list[App]:
    """Apps from a TOML or JSON file with a top-level ``apps`` list (``[[apps]]`` tables)."""
    p = Path(path)
    d = read_json(p, InputError) if p.suffix.lower() == ".json" else read_toml(p, InputError)
    if not isinstance(d, dict) or "apps" not in d:
        raise InputError(f"{path}: expected a top-level 'apps' list ([[apps]] tables in TOML)")
    extra = sorted(set(d) - {"apps"})
    if extra:
        raise InputError(f"{path}: unknown top-level key(s) {', '.join(extra)} (known: apps)")
    return apps_from_json(d["apps"], str(path))
