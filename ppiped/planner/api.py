"""``plan_cluster``: from profiles, a cluster and a load mix to a checked ``ppiped-plan/1`` plan.

Three algorithms share the enumeration and the MILP and differ only in the configurations they
offer it (DESIGN.md, "Control plane"):

- ``ppipe``: up to ``max_partitions`` partitions per pipeline, any allowed vGPU split;
- ``np``: one partition, whole GPUs;
- ``dart-r``: chained pipelines are one partition on each of two GPU types with one whole GPU
  of each per replica (a low+high pair, replicated), beside whole-model pipelines on whole GPUs.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from collections.abc import Mapping, Sequence

from ..cluster import Cluster
from ..errors import InputError
from ..plan import ModelPlan, Partition, Pipeline, Plan, PlanParams, check_weights, model_slo_us
from ..profiles import Profile
from .configs import PipelineConfig, enumerate_configs, latency_budget_us, prune_dominated
from .milp import Allocation, NoSolution, SolveInfo, solve_allocation

log = logging.getLogger(__name__)

ALGOS = ("ppipe", "np", "dart-r")

# NP plans that derive their own batching-delay rates: stop when no rate moves by more than
# this fraction, or after this many re-solves.
_RATE_TOL = 0.01
_RATE_ROUNDS = 4
# NP's configuration space with vGPU splits allowed: the stand-in for NP's rates when NP cannot
# place every model on whole GPUs.
_NP_VGPUS = "np-vgpus"


def plan_cluster(
    profiles: Mapping[str, Profile],
    models: Sequence[str],
    weights: Sequence[float],
    cluster: Cluster,
    params: PlanParams | None = None,
    algo: str = "ppipe",
    time_limit: float = 60.0,
    batch_delay_rates: Sequence[float] | None = None,
    threads: int = 1,
    slos_us: Sequence[float] | None = None,
    mip_gap: float = 1e-6,
) -> Plan:
    """Plan ``models`` (load ``weights``) on ``cluster`` with ``algo`` in about ``time_limit`` s.

    ``batch_delay_rates`` is λ (requests/s) of each model's initial-batching-delay estimate;
    by default it is the model's throughput in the NP plan of the same cluster and weights,
    which is planned first. ``slos_us`` overrides ``params``' SLO rule (scale × reference GPU
    latency). Raises :class:`InputError` for inputs no plan can satisfy.
    """
    t0 = time.perf_counter()
    params = params or PlanParams()
    req = _validate(profiles, models, weights, cluster, params, algo, time_limit, batch_delay_rates,
                    slos_us)
    if not 0 <= mip_gap < 1:
        raise InputError(f"MIP gap is a fraction in [0, 1), got {mip_gap}")
    slo = req["slo"]
    for m in models:  # fail fast, naming the algorithm asked for, if even bs 1 misses the SLO
        # (a whole model on one GPU at batch size 1 settles it for most models at once; a profile
        # where a larger batch is quicker, as some measured ones are, is tried at every size)
        one = dataclasses.replace(params, max_partitions=1) if algo == "ppipe" else params
        end = t0 + time_limit
        if not algo_configs(profiles[m], cluster, one, algo, slo[m], None, 1, end) and \
                not algo_configs(profiles[m], cluster, params, algo, slo[m], None, None, end):
            raise InputError(_no_config_message(profiles[m], cluster, params, algo, slo[m]))
    rates: dict[str, float]
    np_plan: Plan | None = None
    if batch_delay_rates is not None:
        rates = dict(zip(models, (float(r) for r in batch_delay_rates), strict=True))
        rates_from = "given"
    else:
        try:
            rates, np_plan = _np_rates(profiles, models, req["weights"], cluster, params, slo,
                                       t0 + time_limit, threads, mip_gap)
            rates_from = "np"
        except InputError as e:
            # Fewer GPUs than models (a small CPU host, say): NP cannot place every model on whole
            # GPUs, but one partition per model on vGPUs may; its throughputs stand in for NP's.
            try:
                rates, _ = _np_rates(profiles, models, req["weights"], cluster, params, slo,
                                     t0 + time_limit, threads, mip_gap, algo=_NP_VGPUS)
                rates_from = _NP_VGPUS
                log.warning("planner: the NP plan has no solution (%s); batching-delay rates come from "
                            "one partition per model on vGPUs instead", e)
            except InputError:
                raise InputError(f"{e} (the NP plan sets each model's batching-delay rate; give the "
                                 "rates explicitly to plan without it)") from None
    deadline = t0 + time_limit
    plan = _plan_once(profiles, models, req["weights"], cluster, params, algo, slo, rates,
                      max(0.5, deadline - time.perf_counter()), threads, mip_gap,
                      np_plan if algo == "ppipe" else None)
    plan.solver["plan_s"] = time.perf_counter() - t0
    plan.solver["batch_delay_rates_from"] = rates_from
    return plan


def _validate(profiles, models, weights, cluster, params, algo, time_limit, rates, slos_us) -> dict:
    if algo not in ALGOS:
        raise InputError(f"unknown algorithm {algo!r} (choose from {', '.join(ALGOS)})")
    if not models:
        raise InputError("no models to plan")
    if len(set(models)) != len(models):
        raise InputError(f"a model is listed twice: {', '.join(models)}")
    weights = check_weights(list(weights), list(models))
    if rates is not None and len(rates) != len(models):
        raise InputError(f"{len(models)} models but {len(rates)} batch-delay rates")
    if rates is not None and any(not (r > 0 and math.isfinite(r)) for r in rates):
        raise InputError(f"batch-delay rates must be positive requests/s, got {list(rates)}")
    if slos_us is not None and len(slos_us) != len(models):
        raise InputError(f"{len(models)} models but {len(slos_us)} SLOs")
    if params.max_partitions < 1:
        raise InputError(f"max partitions must be at least 1, got {params.max_partitions}")
    if not 0 <= params.slo_margin < 1:
        raise InputError(f"SLO margin is a fraction of the SLO in [0, 1), got {params.slo_margin}")
    if not time_limit > 0:
        raise InputError(f"time limit must be positive, got {time_limit}")
    if sum(g.count for g in cluster.gpus.values()) == 0:
        raise InputError("the cluster has no GPUs")
    missing = [m for m in models if m not in profiles]
    if missing:
        raise InputError(f"no profile for model(s) {', '.join(missing)} "
                         f"(profiles: {', '.join(sorted(profiles)) or 'none'})")
    for g in cluster.gpus:
        if cluster.gpus[g].count > 0 and not any(g in profiles[m].latency for m in models):
            known = sorted({k for m in models for k in profiles[m].latency})
            raise InputError(f"unknown GPU type {g!r}: no model is profiled on it "
                             f"(profiled: {', '.join(known)})")
    slo = {}
    for i, m in enumerate(models):
        s = float(slos_us[i]) if slos_us is not None else model_slo_us(profiles[m], params)
        if s is None:
            raise InputError(f"no SLO for {m}: give SLOs explicitly or a scale and a reference GPU "
                             f"the profile has (it has {', '.join(profiles[m].whole_model_latency_us)})")
        if not s > 0:
            raise InputError(f"SLO of {m} must be positive, got {s}")
        slo[m] = s
    return {"slo": slo, "weights": dict(zip(models, (float(w) for w in weights), strict=True))}


def _np_rates(profiles, models, weights, cluster, params, slo, deadline, threads,
              mip_gap, algo: str = "np") -> tuple[dict[str, float], Plan]:
    """λ for the batching-delay estimate: each model's throughput in the NP plan; and that plan.

    The NP plan needs λ itself, so it is solved first without the delay estimate and then
    again with its own throughputs until they settle (a few rounds at most).
    """
    rates: dict[str, float | None] = dict.fromkeys(models)
    for rnd in range(_RATE_ROUNDS + 1):
        p = _plan_once(profiles, models, weights, cluster, params, algo, slo, rates,
                       max(0.5, (deadline - time.perf_counter()) / 4), threads, mip_gap)
        new = {m.model: m.throughput_rps for m in p.models}
        settled = all(r is not None and abs(new[m] - r) <= _RATE_TOL * r for m, r in rates.items())
        log.info("NP rates round %d: %s", rnd, ", ".join(f"{m} {x:.1f}" for m, x in new.items()))
        rates = dict(new)
        if settled:
            break
    return {m: float(r) for m, r in rates.items()}, p  # type: ignore[arg-type]


def algo_configs(profile: Profile, cluster: Cluster, params: PlanParams, algo: str, slo_us: float,
                 rate_rps: float | None, max_batch: int | None = None,
                 deadline: float = math.inf) -> list[PipelineConfig]:
    """The configurations ``algo`` offers the MILP for one model, after pruning (an InputError
    once ``deadline`` passes while they are enumerated)."""
    whole = {g: (1,) for g in cluster.gpus}
    if algo == "np":
        return prune_dominated(enumerate_configs(profile, cluster, params, slo_us, rate_rps, 1, whole,
                                                 max_batch, deadline))
    if algo == _NP_VGPUS:
        return prune_dominated(enumerate_configs(profile, cluster, params, slo_us, rate_rps, 1, None,
                                                 max_batch, deadline))
    if algo == "dart-r":
        return _dart_configs(profile, cluster, params, slo_us, rate_rps, max_batch, deadline)
    return prune_dominated(enumerate_configs(profile, cluster, params, slo_us, rate_rps,
                                             params.max_partitions, None, max_batch, deadline))


def _dart_configs(profile, cluster, params, slo_us, rate_rps, max_batch=None,
                  deadline: float = math.inf) -> list[PipelineConfig]:
    """DART-r: the best whole-model pipeline per GPU type, and the best low+high pair per pair
    of types (whole GPUs, one of each per replica, so one count serves both partitions).

    Within a pair every replica uses one GPU of each type whatever the order and cut, so only
    the pair's best per-replica throughput matters; likewise for whole-model pipelines.
    """
    whole = {g: (1,) for g in cluster.gpus}
    best: dict[tuple[str, ...], PipelineConfig] = {}
    rate: dict[tuple[str, ...], float] = {}
    parts = min(2, params.max_partitions)
    for c in enumerate_configs(profile, cluster, params, slo_us, rate_rps, parts, whole, max_batch, deadline):
        types = c.gpus
        if len(types) == 2 and types[0] == types[1]:
            continue
        key = tuple(sorted(types))
        x = min(s.rps_per_vgpu for s in c.segments)
        if x > rate.get(key, 0.0):
            best[key], rate[key] = c, x
    out = []
    for key, c in sorted(best.items()):
        out.append(PipelineConfig(c.model, c.batch_size, c.segments, c.latency_us, tied=len(key) == 2))
    return out


# Share of a plan's time limit spent first on its configurations of at most two partitions.
_SHORT_SHARE = 0.25


def _plan_once(profiles, models, weights, cluster, params, algo, slo, rates, time_limit, threads,
               mip_gap, seed: Plan | None = None) -> Plan:
    deadline = time.perf_counter() + time_limit
    configs = {}
    for m in models:
        cs = algo_configs(profiles[m], cluster, params, algo, slo[m], rates[m], deadline=deadline)
        if not cs:
            raise InputError(_no_config_message(profiles[m], cluster, params, algo, slo[m]))
        configs[m] = cs
    time_limit = max(0.5, deadline - time.perf_counter())  # what the enumeration left
    seeds = [a] if seed is not None and (a := _as_allocation(seed, configs)) else []
    short = {m: [c for c in cs if len(c.segments) <= 2] for m, cs in configs.items()}
    if all(short.values()) and any(len(short[m]) < len(configs[m]) for m in models):
        # A longer partition limit searches a superset, but in a larger MILP that may not get as
        # far in the time: the best plan of at most two partitions, found first in a share of
        # the time, seeds it, so raising --max-partitions never gives a worse plan.
        try:
            sub, _ = solve_allocation(short, weights, cluster, _SHORT_SHARE * time_limit, threads, mip_gap,
                                      share_gpus=params.share_gpus, seeds=seeds)
            seeds.append(sub)
        except NoSolution:
            pass
        time_limit = max(0.5, deadline - time.perf_counter())
    try:
        allocs, info = solve_allocation(configs, weights, cluster, time_limit, threads, mip_gap,
                                        share_gpus=params.share_gpus, seeds=seeds)
    except NoSolution as e:
        if e.proven:
            raise InputError("the cluster is too small to serve every model at once") from None
        raise InputError(f"no plan serves every model on this cluster within {time_limit:.0f} s: "
                         f"{e}") from None
    plan = build_plan(allocs, info, models, weights, cluster, params, algo, slo, rates)
    if plan.normalized_throughput <= 0:
        starved = ", ".join(m.model for m in plan.models if m.throughput_rps <= 0)
        if info.status != "optimal" and info.bound > 0:
            # the solve ran out of time, not the cluster out of GPUs: say which
            raise InputError(f"no plan serving every model found within {time_limit:.0f} s (none for "
                             f"{starved} yet, though the solver's bound says one may exist): give more time")
        raise InputError(f"the cluster is too small to serve every model at once (no GPUs left for {starved})")
    return plan


def _as_allocation(plan: Plan, configs: dict[str, list[PipelineConfig]]) -> list[Allocation]:
    """``plan``'s pipelines as allocations of ``configs`` (the same shapes), or [] if one is not
    among them (pruned as dominated, or over the SLO at these batching-delay rates)."""
    index = {(m, c.batch_size, tuple((s.start, s.end, s.gpu, s.split) for s in c.segments)): c
             for m, cs in configs.items() for c in cs}
    out = []
    for mp in plan.models:
        for p in mp.pipelines:
            c = index.get((mp.model, p.batch_size, tuple((*q.blocks, q.gpu, q.vgpu_split) for q in p.partitions)))
            if c is None:
                return []
            out.append(Allocation(c, tuple(q.num_vgpus for q in p.partitions)))
    return out


def _no_config_message(profile, cluster, params, algo, slo_us) -> str:
    budget = latency_budget_us(slo_us, params)
    usable = [g for g, t in cluster.gpus.items() if t.count > 0 and 1 in t.splits
              and g in profile.latency and 1 in profile.latency[g]]
    head = (f"{profile.model}: no {algo} pipeline meets the SLO of {slo_us / 1e3:.3g} ms: after the "
            f"{params.slo_margin:.0%} margin {budget / 1e3:.3g} ms remain")
    if not usable:
        return (f"{head}, and no GPU type of this cluster (with GPUs, split 1 allowed) is profiled "
                f"for it (profiled: {', '.join(sorted(profile.latency)) or 'none'})")
    g = min(usable, key=lambda g: profile.partition_latency_us(g, 1, 0, profile.num_blocks, 1))
    fastest = profile.partition_latency_us(g, 1, 0, profile.num_blocks, 1)
    return (f"{head}, and the fastest whole GPU in this cluster ({g}) takes {fastest / 1e3:.3g} ms at "
            "batch size 1 (with the batching delay and any transfers on top)")


def build_plan(allocs: list[Allocation], info: SolveInfo, models, weights, cluster, params, algo,
               slo, rates) -> Plan:
    """Turn the solver's allocation into a plan; every figure is recomputed from the configs."""
    by_model: dict[str, list[Pipeline]] = {m: [] for m in models}
    for a in allocs:
        c = a.config
        parts = [Partition((s.start, s.end), s.gpu, s.split, n, s.lat_infer_us, s.lat_trans_us,
                           n * s.rps_per_vgpu, c.batch_size)
                 for s, n in zip(c.segments, a.vgpus, strict=True)]
        by_model[c.model].append(Pipeline(c.batch_size, min(q.throughput_rps for q in parts),
                                          c.latency_us, parts))
    mplans = []
    for m in models:
        pipes = sorted(by_model[m], key=lambda p: -p.throughput_rps)
        mplans.append(ModelPlan(m, slo[m], weights[m], sum(p.throughput_rps for p in pipes), pipes,
                                float(rates[m]) if rates[m] is not None else 0.0))
    obj = min(mp.throughput_rps / mp.weight for mp in mplans)
    solver = info.to_json()
    solver["objective"] = obj
    solver["gpu_rule"] = "shared-across-models" if params.share_gpus else "ppipe-per-model"
    return Plan(cluster, params, mplans, obj, algo, solver)
