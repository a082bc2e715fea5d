"""Plan format ``ppiped-plan/1``, the importer for PPipe reference plans, and the plan checker.

The checker is the single statement of the control-plane rules (DESIGN.md, "Control plane"):
the planner's output, imported reference plans and anything an operator hand-edits all go
through :func:`check`, which recomputes every figure from the profiles.
"""

from __future__ import annotations

import json
import math
import numbers
import re
from collections import defaultdict
from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, field, fields, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cluster import MAX_SPLIT, MAX_VGPUS, Cluster, ClusterError, cluster_from_json
from .packing import pack_count
from .profiles import Profile
from .readfile import read_json
from .wire import brief

if TYPE_CHECKING:
    from .query.app import App

PLAN_FORMAT = "ppiped-plan/1"

# Relative and absolute slack for comparing recomputed floats with stated ones.
REL_TOL = 1e-6
ABS_TOL_US = 1.0
WEIGHT_MIN, WEIGHT_MAX, WEIGHT_MAX_RATIO = 1e-6, 1e6, 1e6
"""Load weights are relative shares; the MILP's objective is throughput / weight, and CBC's
tolerances (~1e-9) make plans wrong (1e9) or crash its child (1e300) far outside this range."""


def check_weights(weights: Any, models: list[str]) -> list[float]:
    """``weights`` as floats, one per model in [WEIGHT_MIN, WEIGHT_MAX] and at most
    WEIGHT_MAX_RATIO apart; raises :class:`~ppiped.errors.InputError` naming what is wrong."""
    from .errors import InputError  # (errors imports this module)

    if not isinstance(weights, (list, tuple)) or len(weights) != len(models):
        raise InputError(f"weights: expected {len(models)} (one per model: {', '.join(models)}), got {brief(weights, 80)}")
    bad = [w for w in weights if isinstance(w, bool) or not isinstance(w, numbers.Real)
           or not WEIGHT_MIN <= w <= WEIGHT_MAX]
    if bad:
        raise InputError(f"weights: expected numbers in [{WEIGHT_MIN:g}, {WEIGHT_MAX:g}], got {brief(bad[0])}")
    if max(weights) > WEIGHT_MAX_RATIO * min(weights):
        raise InputError(f"weights {brief(list(weights), 200)}: the largest is more than {WEIGHT_MAX_RATIO:g} x the smallest")
    return [float(w) for w in weights]


class PlanError(ValueError):
    """A plan file cannot be read; the message names the file and the field."""


@dataclass
class PlanParams:
    """Planning rules a plan was made under; the checker needs them to recompute latencies."""

    slo_margin: float = 0.4
    batch_delay_factor: float = 1.3
    max_partitions: int = 2
    slo_scale: float | None = 5.0
    slo_reference_gpu: str | None = "L4"
    # Let slices of different models share one physical GPU (gpu-lets' spatial sharing). Off by
    # default: PPipe's rule gives every model whole GPUs, and sharing needs an interference
    # model to be honest. A plan made with it is never compared with a reference plan.
    share_gpus: bool = False


@dataclass
class Partition:
    blocks: tuple[int, int]
    gpu: str
    vgpu_split: int
    num_vgpus: int
    lat_infer_us: float
    lat_trans_us: float
    throughput_rps: float
    batch_size: int

    @property
    def num_gpus(self) -> float:
        """Physical GPUs this pool occupies (vGPUs of one GPU stay together)."""
        return self.num_vgpus / self.vgpu_split


@dataclass
class Pipeline:
    batch_size: int
    throughput_rps: float
    latency_us: float
    partitions: list[Partition]


@dataclass
class ModelPlan:
    model: str
    slo_us: float
    weight: float
    throughput_rps: float
    pipelines: list[Pipeline]
    batch_delay_rate_rps: float


@dataclass
class Plan:
    cluster: Cluster
    params: PlanParams
    models: list[ModelPlan]
    normalized_throughput: float
    algo: str = ""
    solver: dict[str, Any] = field(default_factory=dict)
    source: str = "<memory>"
    apps: list[App] = field(default_factory=list)  # multi-model queries over the plan's models

    def model(self, name: str) -> ModelPlan:
        for m in self.models:
            if m.model == name:
                return m
        raise KeyError(f"model {name!r} is not in the plan (it has {', '.join(m.model for m in self.models)})")

    def to_json(self) -> dict[str, Any]:
        models = []
        for m in self.models:
            md = asdict(m)
            for p in md["pipelines"]:
                for q in p["partitions"]:
                    q["blocks"] = list(q["blocks"])
            models.append(md)
        return {
            "format": PLAN_FORMAT,
            "algo": self.algo,
            "cluster": self.cluster.to_json(),
            "params": asdict(self.params),
            "objective": {"normalized_throughput": self.normalized_throughput},
            "solver": self.solver,
            "models": models,
            **({"apps": [a.to_json() for a in self.apps]} if self.apps else {}),
        }


# --- the rules (used by the checker and the planner alike) --------------------------------


def slo_margin_us(slo_us: float, margin: float) -> float:
    """SLO headroom kept for run-time effects; whole microseconds, as the reference plans have it."""
    return float(math.floor(margin * slo_us))


def batch_delay_us(bs: int, rate_rps: float, factor: float) -> float:
    """Estimated wait to build a batch of ``bs`` at arrival rate ``rate_rps`` (PPipe §5.3)."""
    if bs <= 1:
        return 0.0
    return factor * (bs - 1) / rate_rps * 1e6


def nic_cap_rps(profile: Profile, boundary_end: int, split: int, per_server: int, nic_gbps: float) -> float:
    """Per-vGPU request rate one server's NIC allows across the boundary after block ``boundary_end - 1``."""
    t_us = profile.transfer_us(boundary_end, 1, nic_gbps)
    if t_us <= 0:
        return math.inf
    return 1e6 / (t_us * split * per_server)


def per_vgpu_throughput_rps(
    profile: Profile, cluster: Cluster, gpu: str, split: int, start: int, end: int, bs: int
) -> float:
    """Requests/s one vGPU sustains on blocks [start, end): compute- or NIC-bound."""
    lat = profile.partition_latency_us(gpu, split, start, end, bs)
    x = bs * 1e6 / lat
    ps = cluster.gpus[gpu].per_server
    if start > 0:
        x = min(x, nic_cap_rps(profile, start, split, ps, cluster.nic_gbps))
    if end < profile.num_blocks:
        x = min(x, nic_cap_rps(profile, end, split, ps, cluster.nic_gbps))
    return x


def model_slo_us(profile: Profile, params: PlanParams) -> float | None:
    if params.slo_scale is None or params.slo_reference_gpu is None:
        return None
    ref = profile.whole_model_latency_us.get(params.slo_reference_gpu)
    return None if ref is None else params.slo_scale * ref


def slo_not_judged(plan: Plan, profiles: Mapping[str, Profile]) -> list[str]:
    """The models whose SLO rule :func:`check` cannot judge: the plan derives SLOs from a
    reference GPU their profile has no whole-model latency for. ``ppiped check`` names them
    beside its verdict (it used to print "ok" without a word)."""
    pr = plan.params
    if pr.slo_scale is None or pr.slo_reference_gpu is None:
        return []
    staged = {s.model for a in plan.apps for s in a.stages}
    return [m.model for m in plan.models if m.model in profiles and m.model not in staged
            and model_slo_us(profiles[m.model], pr) is None]


def gpus_used(pools: Iterable[tuple[str, int, str, int, int]], share_gpus: bool = False) -> dict[str, dict]:
    """Physical GPUs per type under PPipe's ``force_sum_gpu_integer_per_partition`` rule.

    ``pools`` holds (model, partition index, GPU type, vGPU split, vGPU count). The vGPUs of each
    (model, partition index, type) take whole GPUs of their own, as :func:`ppiped.packing.pack`
    places them (the use rounded up, wherever the splits allow), summed over models and indices;
    with ``share_gpus`` a group is a (partition index, type) across models. Returns, per type,
    ``{"total": n, "groups": {key: n}}`` with the group counts.
    """
    groups: dict[tuple, list[tuple[int, int]]] = defaultdict(list)
    for model, d, gpu, split, n in pools:
        groups[(gpu, d) if share_gpus else (gpu, model, d)].append((split, n))
    out: dict[str, dict] = {}
    for key, members in sorted(groups.items(), key=lambda kv: tuple(map(str, kv[0]))):
        e = out.setdefault(key[0], {"total": 0, "groups": {}})
        n = pack_count(members)
        e["groups"][key[1:]] = n
        e["total"] += n
    return out


# Rules a served plan must not break: its answers would be wrong, not merely slow.
SERVING_RULES = ("unsafe-cut",)


def refuse_for_serving(plan: Plan, profiles: dict[str, Profile]) -> list[Violation]:
    """Raise PlanError for a plan the daemon must not serve: one cutting a model where its
    profile found the fp16 hop changes the output (served, answers were off by half the
    output's range). Returns the other broken rules, which are logged and served (the data
    plane copes)."""
    vs = check(plan, profiles)
    bad = [v for v in vs if v.rule in SERVING_RULES]
    if bad:
        raise PlanError(f"{plan.source}: not served: {bad[0]}" + (f" (and {len(bad) - 1} more)" if len(bad) > 1 else ""))
    return vs


# --- the checker --------------------------------------------------------------------------


@dataclass
class Violation:
    rule: str
    message: str
    model: str | None = None
    pipeline: int | None = None
    partition: int | None = None

    def __str__(self) -> str:
        where = []
        if self.model is not None:
            where.append(f"model {self.model}")
        if self.pipeline is not None:
            where.append(f"pipeline {self.pipeline}")
        if self.partition is not None:
            where.append(f"partition {self.partition}")
        loc = ", ".join(where) or "plan"
        return f"{loc}: [{self.rule}] {self.message}"


def _close(a: float, b: float, abs_tol: float = 1e-6) -> bool:
    return abs(a - b) <= max(abs_tol, REL_TOL * max(abs(a), abs(b)))


def _over(stated: float, bound: float) -> bool:
    return stated > bound * (1 + REL_TOL) + 1e-6


def check(plan: Plan, profiles: dict[str, Profile], cluster: Cluster | None = None) -> list[Violation]:
    """Recompute every latency, throughput and GPU count of ``plan``; return each rule it breaks."""
    cl = cluster or plan.cluster
    pr = plan.params
    out: list[Violation] = []
    pools: list[tuple[str, int, str, int, int]] = []
    model_ratios = []
    staged = {s.model for a in plan.apps for s in a.stages}  # an app stage's SLO is its budget
    for m in plan.models:
        V = lambda rule, msg, pi=None, qi=None, _m=m.model: out.append(Violation(rule, msg, _m, pi, qi))  # noqa: E731
        prof = profiles.get(m.model)
        if prof is None:
            V("unknown-model", "no profile for this model")
            continue
        if m.weight <= 0:
            V("weight", f"weight must be positive, got {m.weight}")
        slo_ref = model_slo_us(prof, pr)
        if slo_ref is not None and m.model not in staged and _over(m.slo_us, slo_ref):
            V("slo", f"slo_us {m.slo_us:.1f} exceeds {pr.slo_scale} x whole-model "
              f"{pr.slo_reference_gpu} latency = {slo_ref:.1f}")
        margin = slo_margin_us(m.slo_us, pr.slo_margin)
        unsafe = prof.unsafe_cuts()
        total = 0.0
        for pi, p in enumerate(m.pipelines):
            bs = p.batch_size
            if not p.partitions:
                V("pipeline-empty", "pipeline has no partitions", pi)
                continue
            if len(p.partitions) > pr.max_partitions:
                V("max-partitions", f"{len(p.partitions)} partitions, at most {pr.max_partitions}", pi)
            nxt = 0
            for qi, q in enumerate(p.partitions):
                a, b = q.blocks
                if a != nxt or b <= a:
                    V("blocks-contiguous", f"blocks [{a}, {b}) do not follow [.., {nxt})", pi, qi)
                if qi and a in unsafe:
                    V("unsafe-cut", f"cuts before block {a}, where the profile found the fp16 hop changes "
                      "the model's outputs", pi, qi)
                nxt = b
            if nxt != prof.num_blocks:
                V("blocks-contiguous", f"partitions end at block {nxt}, the model has {prof.num_blocks}", pi)
            if any(q.batch_size != bs for q in p.partitions):
                V("batch-size-mixed", f"partition batch sizes {[q.batch_size for q in p.partitions]} "
                  f"differ from the pipeline's {bs}", pi)
            lat_sum = 0.0
            part_x = []
            ok = True
            for qi, q in enumerate(p.partitions):
                a, b = q.blocks
                if q.gpu not in cl.gpus:
                    V("unknown-gpu", f"GPU type {q.gpu!r} is not in the cluster", pi, qi)
                    ok = False
                    continue
                if q.vgpu_split not in cl.gpus[q.gpu].splits:
                    V("split-not-allowed", f"split 1/{q.vgpu_split} of {q.gpu} is not allowed "
                      f"(allowed: {list(cl.gpus[q.gpu].splits)})", pi, qi)
                if prof.max_batch(q.gpu, q.vgpu_split) < bs or bs < 1:
                    V("batch-size-unprofiled", f"batch size {bs} is not profiled for {q.gpu} at split "
                      f"1/{q.vgpu_split}", pi, qi)
                    ok = False
                    continue
                if not (0 <= a < b <= prof.num_blocks):
                    ok = False
                    continue
                if q.num_vgpus < 1 or q.num_vgpus != int(q.num_vgpus):
                    V("vgpu-count", f"num_vgpus must be a positive integer, got {q.num_vgpus}", pi, qi)
                lat = prof.partition_latency_us(q.gpu, q.vgpu_split, a, b, bs)
                trans = prof.transfer_us(b, bs, cl.nic_gbps)
                if not _close(lat, q.lat_infer_us, 1e-3):
                    V("latency-mismatch", f"lat_infer_us {q.lat_infer_us:.1f}, profiles give {lat:.1f}", pi, qi)
                if not _close(trans, q.lat_trans_us, 1e-3):
                    V("latency-mismatch", f"lat_trans_us {q.lat_trans_us:.1f}, profiles give {trans:.1f}", pi, qi)
                lat_sum += lat + trans
                x = q.num_vgpus * per_vgpu_throughput_rps(prof, cl, q.gpu, q.vgpu_split, a, b, bs)
                if _over(q.throughput_rps, x):
                    V("throughput-inflated", f"partition throughput {q.throughput_rps:.2f} rps, "
                      f"{q.num_vgpus} vGPUs sustain {x:.2f}", pi, qi)
                part_x.append(min(x, q.throughput_rps))
                pools.append((m.model, qi, q.gpu, q.vgpu_split, q.num_vgpus))
            if not ok:
                continue
            delay = batch_delay_us(bs, m.batch_delay_rate_rps, pr.batch_delay_factor)
            lat_total = lat_sum + delay
            if lat_total + margin > m.slo_us + ABS_TOL_US:
                V("latency-slo", f"latency {lat_total:.1f} us (inference + transfer + batching "
                  f"{delay:.1f}) + margin {margin:.0f} exceeds SLO {m.slo_us:.1f} us", pi)
            if p.latency_us + ABS_TOL_US < lat_total:
                V("latency-mismatch", f"pipeline latency_us {p.latency_us:.1f} understates {lat_total:.1f}", pi)
            px = min(part_x) if part_x else 0.0
            if _over(p.throughput_rps, px):
                V("throughput-inflated", f"pipeline throughput {p.throughput_rps:.2f} rps exceeds its "
                  f"slowest pool's {px:.2f}", pi)
            total += min(px, p.throughput_rps)
        if _over(m.throughput_rps, total):
            V("throughput-inflated", f"model throughput {m.throughput_rps:.2f} rps exceeds the sum "
              f"of its pipelines {total:.2f}")
        if m.weight > 0:
            model_ratios.append(min(total, m.throughput_rps) / m.weight)
    for g, use in gpus_used(pools, pr.share_gpus).items():
        if g in cl.gpus and use["total"] > cl.gpus[g].count:
            rule = "per (partition index, type), shared across models" if pr.share_gpus else \
                "per (model, partition index, type)"
            detail = ", ".join(f"{'/'.join(map(str, k))}: {n}" for k, n in use["groups"].items())
            out.append(Violation("gpu-budget", f"{use['total']} {g} GPUs used, rounded up {rule} "
                                 f"({detail}); cluster has {cl.gpus[g].count}"))
    out.extend(_check_apps(plan))
    if model_ratios and _over(plan.normalized_throughput, min(model_ratios)):
        out.append(Violation("throughput-inflated", f"objective {plan.normalized_throughput:.3f} "
                             f"exceeds min weighted model throughput {min(model_ratios):.3f}"))
    return out


def _check_apps(plan: Plan) -> list[Violation]:
    """An app's stages are planned models whose SLO is the stage's budget, the budgets plus
    glue fit the app's SLO on every path (else its deadlines could not all be met), and every
    glue callable imports (the daemon refuses to start otherwise)."""
    out: list[Violation] = []
    names = {m.model: m for m in plan.models}
    for a in plan.apps:
        w = f"app {a.name!r}"
        if not a.split_done:
            out.append(Violation("app-split", f"{w}: its SLO is not split (a stage has no budget)"))
            continue
        for s in a.stages:
            m = names.get(s.model)
            if m is None:
                out.append(Violation("app-model", f"{w}, stage {s.name!r}: model {s.model!r} is not in the plan"))
            elif not _close(m.slo_us, s.budget_us, ABS_TOL_US):
                out.append(Violation("app-budget", f"{w}, stage {s.name!r}: the model's slo_us {m.slo_us:.1f} "
                                     f"is not the stage budget {s.budget_us:.1f}", s.model))
        for p in a.paths():
            end = a.end_us(p[-1])
            if _over(end, a.slo_us):
                path = " -> ".join(a.stages[j].name for j in p)
                out.append(Violation("app-slo", f"{w}: budgets on the path {path} plus {len(p) - 1} glue "
                                     f"step(s) take {end / 1e3:.3f} ms, over the SLO of {a.slo_us / 1e3:.3f} ms"))
    if plan.apps:
        from .query.glue import glue_problems

        for a, s, why in glue_problems(plan.apps):
            out.append(Violation("glue-import", f"app {a.name!r}, stage {s.name!r}: glue {s.glue} "
                                 f"cannot be imported: {why}"))
    return out


# --- reading and writing ------------------------------------------------------------------

_TOP_KEYS = ("format", "algo", "cluster", "params", "objective", "solver", "models", "apps")
_MODEL_KEYS = tuple(f.name for f in fields(ModelPlan))
_PIPELINE_KEYS = tuple(f.name for f in fields(Pipeline))
_PARTITION_KEYS = tuple(f.name for f in fields(Partition))


def _get(d: Any, key: str, where: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise PlanError(f"{where}: missing field {key!r}")
    return d[key]


def _no_unknown(d: dict, known: Iterable[str], where: str) -> None:
    """A misspelt key would otherwise be ignored and its field silently take a default."""
    unknown = sorted(set(d) - set(known), key=str)
    if unknown:
        raise PlanError(f"{where}: unknown field(s) {', '.join(map(repr, unknown))} "
                        f"(known: {', '.join(known)})")


def _is_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _is_int(x: Any) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool)


def _real(x: Any, key: str, where: str) -> float:
    """A JSON number as a float; a string such as ``"1500"`` is refused, not converted."""
    if not _is_real(x):
        raise PlanError(f"{where}: field {key}: expected a number, got {brief(x, 60)}")
    try:
        return float(x)
    except OverflowError:  # an integer past the float range
        raise PlanError(f"{where}: field {key}: expected a finite number, got {brief(x, 60)}") from None


def _integer(x: Any, key: str, where: str) -> int:
    """A JSON integer; ``5.0`` is accepted as 5, ``2.5`` is refused rather than truncated."""
    if isinstance(x, float) and x.is_integer():
        return int(x)
    if not _is_int(x):
        raise PlanError(f"{where}: field {key}: expected an integer, got {brief(x, 60)}")
    return int(x)


def _at(source: str, model: str | None = None, pi: int | None = None, qi: int | None = None) -> str:
    where = [source]
    if model is not None:
        where.append(f"model {model!r}")
    if pi is not None:
        where.append(f"pipeline {pi}")
    if qi is not None:
        where.append(f"partition {qi}")
    return ", ".join(where)


def _partition_from_json(q: Any, bs: int, where: str) -> Partition:
    if not isinstance(q, dict):
        raise PlanError(f"{where}: a partition is a JSON object, got {q!r}")
    _no_unknown(q, _PARTITION_KEYS, where)
    blocks = _get(q, "blocks", where)
    if not isinstance(blocks, list) or len(blocks) != 2:
        raise PlanError(f"{where}: field blocks: expected [start, end), got {blocks!r}")
    gpu = _get(q, "gpu", where)
    if not isinstance(gpu, str):
        raise PlanError(f"{where}: field gpu: expected a GPU type name, got {gpu!r}")
    return Partition(
        (_integer(blocks[0], "blocks", where), _integer(blocks[1], "blocks", where)), gpu,
        _integer(_get(q, "vgpu_split", where), "vgpu_split", where),
        _integer(_get(q, "num_vgpus", where), "num_vgpus", where),
        _real(_get(q, "lat_infer_us", where), "lat_infer_us", where),
        _real(_get(q, "lat_trans_us", where), "lat_trans_us", where),
        _real(_get(q, "throughput_rps", where), "throughput_rps", where),
        _integer(q.get("batch_size", bs), "batch_size", where),
    )


def _model_from_json(m: Any, mi: int, source: str) -> ModelPlan:
    where = f"{source}: models[{mi}]"
    if not isinstance(m, dict):
        raise PlanError(f"{where}: a model is a JSON object, got {m!r}")
    name = _get(m, "model", where)
    if not isinstance(name, str) or not name:
        raise PlanError(f"{where}: field model: expected a model name, got {name!r}")
    where = _at(source, name)
    _no_unknown(m, _MODEL_KEYS, where)
    pipes_in = _get(m, "pipelines", where)
    if not isinstance(pipes_in, list):
        raise PlanError(f"{where}: field pipelines: expected a list, got {pipes_in!r}")
    pipes = []
    for pi, p in enumerate(pipes_in):
        wp = _at(source, name, pi)
        if not isinstance(p, dict):
            raise PlanError(f"{wp}: a pipeline is a JSON object, got {p!r}")
        _no_unknown(p, _PIPELINE_KEYS, wp)
        bs = _integer(_get(p, "batch_size", wp), "batch_size", wp)
        parts_in = _get(p, "partitions", wp)
        if not isinstance(parts_in, list):
            raise PlanError(f"{wp}: field partitions: expected a list, got {parts_in!r}")
        parts = [_partition_from_json(q, bs, _at(source, name, pi, qi)) for qi, q in enumerate(parts_in)]
        pipes.append(Pipeline(bs, _real(_get(p, "throughput_rps", wp), "throughput_rps", wp),
                              _real(_get(p, "latency_us", wp), "latency_us", wp), parts))
    return ModelPlan(
        name, _real(_get(m, "slo_us", where), "slo_us", where), _real(_get(m, "weight", where), "weight", where),
        _real(_get(m, "throughput_rps", where), "throughput_rps", where), pipes,
        _real(_get(m, "batch_delay_rate_rps", where), "batch_delay_rate_rps", where),
    )


def _params_from_json(p: Any, source: str) -> PlanParams:
    where = f"{source}: params"
    if not isinstance(p, dict):
        raise PlanError(f"{where}: expected an object, got {p!r}")
    _no_unknown(p, [f.name for f in fields(PlanParams)], where)
    return PlanParams(**p)


def _bad(where: str, key: str, want: str, got: Any) -> PlanError:
    return PlanError(f"{where}: field {key}: expected {want}, got {brief(got, 60)}")


def _finite(x: Any) -> bool:
    """A real number a float holds (an int of 400 digits raised OverflowError in isfinite)."""
    try:
        return _is_real(x) and math.isfinite(x)
    except OverflowError:
        return False


def _positive(x: Any) -> bool:
    return _finite(x) and x > 0


def _non_negative(x: Any) -> bool:
    return _finite(x) and x >= 0


def validate_plan(plan: Plan) -> None:
    """Refuse what no rule of :func:`check` can judge and what would crash or hang the checker,
    the simulator or the daemon: NaN and infinite figures, empty or duplicate models, empty
    pipelines, non-positive sizes and counts, absurd vGPU totals. Raises :class:`PlanError`
    naming the model, pipeline and partition and the bad value; says nothing of the profiles
    (:meth:`Layout.from_plan` checks a plan against them)."""
    src = plan.source
    pr = plan.params
    wp = f"{src}: params"
    if not (_is_real(pr.slo_margin) and 0 <= pr.slo_margin < 1):
        raise _bad(wp, "slo_margin", "a fraction of the SLO in [0, 1)", pr.slo_margin)
    if not _positive(pr.batch_delay_factor):
        raise _bad(wp, "batch_delay_factor", "a positive number", pr.batch_delay_factor)
    if not (_is_int(pr.max_partitions) and pr.max_partitions >= 1):
        raise _bad(wp, "max_partitions", "an integer >= 1", pr.max_partitions)
    if pr.slo_scale is not None and not _positive(pr.slo_scale):
        raise _bad(wp, "slo_scale", "a positive number or null", pr.slo_scale)
    if pr.slo_reference_gpu is not None and not (isinstance(pr.slo_reference_gpu, str) and pr.slo_reference_gpu):
        raise _bad(wp, "slo_reference_gpu", "a GPU type name or null", pr.slo_reference_gpu)
    if not isinstance(pr.share_gpus, bool):
        raise _bad(wp, "share_gpus", "true or false", pr.share_gpus)
    if not isinstance(plan.models, list) or not plan.models:
        raise PlanError(f"{src}: field models: expected a non-empty list of models, got {plan.models!r}")
    if not _non_negative(plan.normalized_throughput):
        raise _bad(f"{src}: objective", "normalized_throughput", "a finite number >= 0",
                   plan.normalized_throughput)
    seen: dict[str, int] = {}
    vgpus = 0
    for mi, m in enumerate(plan.models):
        if m.model in seen:
            raise PlanError(f"{src}: model {m.model!r} appears twice (models[{seen[m.model]}] and "
                            f"models[{mi}]); a model has one entry with all its pipelines")
        seen[m.model] = mi
        w = _at(src, m.model)
        if not _positive(m.slo_us):
            raise _bad(w, "slo_us", "a positive finite number of µs", m.slo_us)
        if not _positive(m.weight):
            raise _bad(w, "weight", "a positive finite number", m.weight)
        if not _non_negative(m.throughput_rps):
            raise _bad(w, "throughput_rps", "a finite number >= 0", m.throughput_rps)
        if not _non_negative(m.batch_delay_rate_rps):
            raise _bad(w, "batch_delay_rate_rps", "a finite number >= 0", m.batch_delay_rate_rps)
        for pi, p in enumerate(m.pipelines):
            wp = _at(src, m.model, pi)
            if not (_is_int(p.batch_size) and p.batch_size >= 1):
                raise _bad(wp, "batch_size", "an integer >= 1", p.batch_size)
            if p.batch_size > 1 and m.batch_delay_rate_rps == 0:
                raise PlanError(f"{wp}: batch size {p.batch_size} with batch_delay_rate_rps 0: at no "
                                "arrivals a batch of more than one never forms")
            if not _non_negative(p.throughput_rps):
                raise _bad(wp, "throughput_rps", "a finite number >= 0", p.throughput_rps)
            if not _non_negative(p.latency_us):
                raise _bad(wp, "latency_us", "a finite number >= 0", p.latency_us)
            if not p.partitions:
                raise PlanError(f"{wp}: field partitions: a pipeline has at least one partition, got []")
            for qi, q in enumerate(p.partitions):
                wq = _at(src, m.model, pi, qi)
                a, b = q.blocks
                if not (_is_int(a) and _is_int(b) and 0 <= a < b):
                    raise _bad(wq, "blocks", "[start, end) with 0 <= start < end", list(q.blocks))
                if not (isinstance(q.gpu, str) and q.gpu):
                    raise _bad(wq, "gpu", "a GPU type name", q.gpu)
                if not (_is_int(q.vgpu_split) and q.vgpu_split >= 1):
                    raise _bad(wq, "vgpu_split", "an integer >= 1", q.vgpu_split)
                if not (_is_int(q.num_vgpus) and q.num_vgpus >= 1):
                    raise _bad(wq, "num_vgpus", "an integer >= 1", q.num_vgpus)
                if not (_is_int(q.batch_size) and q.batch_size >= 1):
                    raise _bad(wq, "batch_size", "an integer >= 1", q.batch_size)
                for key in ("lat_infer_us", "lat_trans_us", "throughput_rps"):
                    if not _non_negative(getattr(q, key)):
                        raise _bad(wq, key, "a finite number >= 0", getattr(q, key))
                vgpus += q.num_vgpus
    if vgpus > MAX_VGPUS:
        raise PlanError(f"{src}: the plan has {vgpus} vGPUs in all, more than {MAX_VGPUS:,} "
                        "(num_vgpus is per pool)")


def plan_from_json(d: Any, source: str = "<memory>") -> Plan:
    """Parse and validate (:func:`validate_plan`) a ``ppiped-plan/1`` object."""
    if not isinstance(d, dict):
        raise PlanError(f"{source}: a plan is a JSON object")
    fmt = d.get("format")
    if fmt != PLAN_FORMAT:
        raise PlanError(f"{source}: field format: expected {PLAN_FORMAT!r}, got {fmt!r}")
    try:
        cluster = cluster_from_json(_get(d, "cluster", source), f"{source}: cluster")
    except ClusterError as e:
        raise PlanError(str(e)) from None
    _no_unknown(d, _TOP_KEYS, source)
    params = _params_from_json(_get(d, "params", source), source)
    models_in = _get(d, "models", source)
    if not isinstance(models_in, list) or not models_in:
        raise PlanError(f"{source}: field models: expected a non-empty list of models, got {models_in!r}")
    models = [_model_from_json(m, mi, source) for mi, m in enumerate(models_in)]
    objective = _get(d, "objective", source)
    if not isinstance(objective, dict):
        raise _bad(source, "objective", "an object", objective)
    _no_unknown(objective, ("normalized_throughput",), f"{source}: objective")
    obj = _real(_get(objective, "normalized_throughput", f"{source}: objective"), "normalized_throughput",
                f"{source}: objective")
    algo, solver = d.get("algo", ""), d.get("solver", {})
    if not isinstance(algo, str):
        raise _bad(source, "algo", "a string", algo)
    if not isinstance(solver, dict):
        raise _bad(source, "solver", "an object", solver)
    plan = Plan(cluster, params, models, obj, algo, dict(solver), source)
    validate_plan(plan)
    if d.get("apps") is not None:
        from .errors import InputError
        from .query.app import apps_from_json

        try:
            plan.apps = apps_from_json(d["apps"], source)
        except InputError as e:
            raise PlanError(str(e)) from None
        names = {m.model for m in plan.models}
        for a in plan.apps:
            missing = [s.model for s in a.stages if s.model not in names]
            if missing:
                raise PlanError(f"{source}: app {a.name!r} names model(s) the plan does not serve: "
                                f"{', '.join(missing)}")
    return plan


_REF_NAME = re.compile(
    r"(?:_(?P<w>[\d.]+(?:-[\d.]+)*))?_(?P<ga>[A-Za-z0-9]+)-(?P<gb>[A-Za-z0-9]+)_(?P<na>\d+)-(?P<nb>\d+)"
    r"_bw-gbps-(?P<bw>[\d.]+)_sla-multiplier-(?P<sla>[\d.]+)_(?P<algo>[\w-]+)\.json$"
)
REFERENCE_ALGOS = {"v4": "ppipe", "bl": "np", "dart-r": "dart-r"}


def reference_name_info(path: str | Path, models: list[str] | None = None) -> dict[str, Any]:
    """Cluster parameters encoded in a reference plan's file name (``weights`` is None when the
    name has no weights segment, as single-model plans have not).

    ``models``: the plan's model names, which the file name starts with joined by ``-``; the
    rest is then read from just after them, so a name ending in ``_<number>``
    (``wide_resnet101_2``) is never taken for a weight.
    """
    name = Path(path).name
    prefix = "-".join(models or [])
    m = _REF_NAME.match(name, len(prefix)) if prefix and name.startswith(prefix) else None
    m = m or _REF_NAME.search(name)
    if not m:
        raise PlanError(f"{path}: not a reference plan file name (…_<weights>_<gpuA>-<gpuB>_"
                        "<countA>-<countB>_bw-gbps-<B>_sla-multiplier-<S>_<algo>.json)")
    try:
        weights = [float(x) for x in m["w"].split("-")] if m["w"] else None
        nic, sla = float(m["bw"]), float(m["sla"])
    except ValueError:  # the pattern lets "1..2" through
        raise PlanError(f"{path}: the file name's numbers are malformed") from None
    if weights is not None and not all(_positive(w) for w in weights):
        raise PlanError(f"{path}: the file name's weights must be positive, got {weights}")
    return {
        "weights": weights,
        "gpus": {m["ga"]: int(m["na"]), m["gb"]: int(m["nb"])},
        "nic_gbps": nic,
        "slo_scale": sla,
        "algo": REFERENCE_ALGOS.get(m["algo"], m["algo"]),
    }


def reference_plan_set(data: str | Path, plan_set: str = "maf21") -> Path:
    """The folder of a set of PPipe reference plans: ``plan_set`` itself when it is a path, else
    the folder of that name under the data set's ``reference-plans``."""
    p = Path(plan_set)
    return p if p.is_dir() or len(p.parts) > 1 else Path(data) / "reference-plans" / plan_set


def _mps_levels(n: int, where: str) -> list[int]:
    """Splits 1..n of a reference file's ``num_mps_levels``, refused past MAX_SPLIT before the
    list is built (a level of 10^9 took 17 GB to build)."""
    if not 1 <= n <= MAX_SPLIT:
        raise PlanError(f"{where}: num_mps_levels {str(n)[:20]}: expected 1 to {MAX_SPLIT} (MPS serves at most "
                        f"{MAX_SPLIT} clients per GPU)")
    return list(range(1, n + 1))


def import_reference(path: str | Path, cluster: Cluster | None = None,
                     weights: list[float] | None = None) -> Plan:
    """Read a PPipe reference plan (a JSON list, one entry per model) as a :class:`Plan`.

    GPU counts and weights come from ``cluster``/``weights`` when given, else from the file name;
    splits, GPUs per server, NIC and SLO come from each entry's ``config``. The result passes
    :func:`validate_plan`, as a ``ppiped-plan/1`` file would.
    """
    path = Path(path)
    d = read_json(path, PlanError)
    if not isinstance(d, list) or not d:
        raise PlanError(f"{path}: a reference plan is a non-empty JSON list of models")
    for i, e in enumerate(d):
        if not isinstance(e, dict):
            raise PlanError(f"{path}[{i}]: a reference plan entry is a JSON object, got {e!r}")
    info = None
    if cluster is None or weights is None:
        cfgs = [e.get("config") for e in d]
        names = [c.get("dnn_name") if isinstance(c, dict) else None for c in cfgs]
        info = reference_name_info(path, names if all(isinstance(n, str) for n in names) else None)
    if weights is None:
        weights = info["weights"]  # type: ignore[index]
        if weights is None:
            if len(d) != 1:
                raise PlanError(f"{path}: {len(d)} models but the file name gives no weights")
            weights = [1.0]
    if len(weights) != len(d):
        raise PlanError(f"{path}: {len(d)} models but {len(weights)} weights")
    w0 = f"{path}[0].config"
    cfg0 = _get(d[0], "config", f"{path}[0]")

    def num(c: Any, key: str, where: str) -> float:
        return _real(_get(c, key, where), key, where)

    def arr(c: Any, key: str, where: str) -> list:
        v = _get(c, key, where)
        if not isinstance(v, list):
            raise _bad(where, key, "a list", v)
        return v

    if cluster is None:
        names = arr(cfg0, "gpu_name_arr", w0)
        per_server = arr(cfg0, "num_gpu_per_server_arr", w0)
        levels = arr(cfg0, "num_mps_levels", w0)
        if not len(names) == len(per_server) == len(levels):
            raise PlanError(f"{w0}: gpu_name_arr, num_gpu_per_server_arr and num_mps_levels differ in length")
        counts = info["gpus"]  # type: ignore[index]
        unnamed = [g for g in names if g not in counts]
        if unnamed:
            raise PlanError(f"{w0}: GPU type(s) {', '.join(map(repr, unnamed))} are not in the file name's "
                            f"cluster ({', '.join(counts)})")
        cluster = cluster_from_json({
            "nic_gbps": num(cfg0, "bw_gbps", w0),
            "gpus": {
                g: {"count": counts[g], "per_server": _integer(ps, "num_gpu_per_server_arr", w0),
                    "splits": _mps_levels(_integer(nm, "num_mps_levels", w0), w0)}
                for g, ps, nm in zip(names, per_server, levels, strict=True)
            },
        }, f"{path}: cluster")
    sla0 = num(cfg0, "sla", w0)
    if not _positive(sla0):
        raise _bad(w0, "sla", "a positive number of µs", sla0)
    margin = num(cfg0, "hist_adjustment", w0) / sla0
    params = PlanParams(
        slo_margin=round(margin, 4) if math.isfinite(margin) else margin,
        batch_delay_factor=num(cfg0, "batch_build_factor", w0),
        max_partitions=_integer(_get(cfg0, "max_num_parts", w0), "max_num_parts", w0),
        slo_scale=info["slo_scale"] if info else None,
        slo_reference_gpu="L4" if info else None,
    )
    models = []
    for i, (entry, w) in enumerate(zip(d, weights, strict=True)):
        where = f"{path}[{i}]"
        cfg = _get(entry, "config", where)
        wc = f"{where}.config"
        name = _get(cfg, "dnn_name", wc)
        if not isinstance(name, str) or not name:
            raise _bad(wc, "dnn_name", "a model name", name)
        rate = num(cfg, "est_xput", wc)
        pipes = []
        for pi, p in enumerate(arr(entry, "pipelines", where)):
            wp = f"{where}.pipelines[{pi}]"
            parts = []
            for qi, q in enumerate(arr(p, "partitions", wp)):
                wq = f"{wp}.partitions[{qi}]"
                layers = _get(q, "layers", wq)
                if not isinstance(layers, list) or len(layers) != 2:
                    raise _bad(wq, "layers", "[start, end)", layers)
                gpu = _get(q, "gpu", wq)
                if not isinstance(gpu, str):
                    raise _bad(wq, "gpu", "a GPU type name", gpu)
                split = _integer(_get(q, "mps", wq), "mps", wq) + 1
                vgpus = num(q, "num_gpu", wq) * split
                if not (math.isfinite(vgpus) and vgpus >= 1 - 1e-6
                        and abs(vgpus - round(vgpus)) <= 1e-6 * max(1.0, vgpus)):
                    raise _bad(wq, "num_gpu", f"GPUs making a whole number (>= 1) of vGPUs at split {split} "
                               "(num_gpu x (mps + 1))", q["num_gpu"])
                bs = _integer(_get(q, "bs", wq), "bs", wq)
                if bs < 1:
                    raise _bad(wq, "bs", "a batch size >= 1", bs)
                parts.append(Partition(
                    (_integer(layers[0], "layers", wq), _integer(layers[1], "layers", wq)), gpu, split,
                    int(round(vgpus)), num(q, "lat_infer", wq), num(q, "lat_trans", wq), num(q, "xput", wq), bs,
                ))
            if not parts:
                raise PlanError(f"{wp}: field partitions: a pipeline has at least one partition, got []")
            bs = parts[0].batch_size
            lat = sum(q.lat_infer_us + q.lat_trans_us for q in parts)
            if bs > 1 and rate > 0:  # else validate_plan names the problem
                lat += batch_delay_us(bs, rate, params.batch_delay_factor)
            pipes.append(Pipeline(bs, num(p, "xput", wp), lat, parts))
        models.append(ModelPlan(name, num(cfg, "sla", wc), float(w), num(entry, "xput", where), pipes, rate))
    algo = info["algo"] if info else ""
    solver = {"gap": d[0]["mipgap"], "solve_s": d[0].get("runtime")} if "mipgap" in d[0] else {}
    plan = Plan(cluster, params, models, 0.0, algo, solver, str(path))
    validate_plan(plan)  # before the objective, which divides by the weights
    plan.normalized_throughput = min(m.throughput_rps / m.weight for m in models)
    return plan


def load_plan(path: str | Path, cluster: Cluster | None = None, own_cluster: bool = False) -> Plan:
    """Read a ``ppiped-plan/1`` file, or a PPipe reference plan file as is. ``cluster``, when
    given, is the cluster the plan is judged and served on, in place of the one it names (so
    check, sim and serve given the same ``--cluster`` agree); with ``own_cluster`` it is used for
    a reference file only, and a ``ppiped-plan/1`` file keeps its own (a replan to a plan made
    for a grown cluster)."""
    path = Path(path)
    d = read_json(path, PlanError)
    if isinstance(d, list):
        return import_reference(path, cluster)
    plan = plan_from_json(d, str(path))
    return plan if cluster is None or own_cluster else replace(plan, cluster=cluster)


def save_plan(plan: Plan, path: str | Path) -> None:
    Path(path).write_text(json.dumps(plan.to_json(), indent=1) + "\n")


def format_plan_table(plan: Plan) -> str:
    """Human-readable table of a plan: one row per partition."""
    rows = [("model", "pipe", "bs", "blocks", "gpu", "split", "vGPUs", "GPUs", "infer ms", "trans ms",
             "part rps", "pipe rps", "lat ms", "slo ms")]
    for m in plan.models:
        for pi, p in enumerate(m.pipelines):
            for qi, q in enumerate(p.partitions):
                first = qi == 0
                rows.append((
                    m.model[:28] if first else "", str(pi) if first else "", str(p.batch_size) if first else "",
                    f"[{q.blocks[0]},{q.blocks[1]})", q.gpu, f"1/{q.vgpu_split}", str(q.num_vgpus),
                    f"{q.num_gpus:g}", f"{q.lat_infer_us / 1e3:.2f}", f"{q.lat_trans_us / 1e3:.2f}",
                    f"{q.throughput_rps:.1f}", f"{p.throughput_rps:.1f}" if first else "",
                    f"{p.latency_us / 1e3:.1f}" if first else "", f"{m.slo_us / 1e3:.1f}" if first else "",
                ))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    lines.append("")
    for m in plan.models:
        lines.append(f"{m.model}: {m.throughput_rps:.1f} rps, weight {m.weight:g}, "
                     f"{m.throughput_rps / m.weight:.1f} rps/weight")
    lines.append(f"objective (min throughput/weight): {plan.normalized_throughput:.2f}")
    solver = {k: v for k, v in plan.solver.items() if k != "apps"}  # apps: their own table
    if solver:
        lines.append("solver: " + ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                                            for k, v in solver.items()))
    if plan.apps:
        lines.append("")
        lines.append(format_apps_table(plan))
    return "\n".join(lines)


def format_apps_table(plan: Plan) -> str:
    """The apps' SLO split: one row per stage, with its planned throughput per query."""
    rows = [("app", "split", "stage", "model", "after", "fan-out", "rate x", "budget ms", "share",
             "slo ms", "rps", "queries/s")]
    served = {m.model: m.throughput_rps for m in plan.models}
    for a in plan.apps:
        for i, s in enumerate(a.stages):
            rf = a.rate_factor(i)
            x = served.get(s.model)
            rows.append((a.name if i == 0 else "", a.split if i == 0 else "", s.name, s.model[:28],
                         a.stages[s.parent].name if s.parent >= 0 else "-", f"{s.fanout:g}", f"{rf:g}",
                         f"{s.budget_us / 1e3:.1f}", f"{s.budget_us / a.slo_us:.0%}",
                         f"{a.slo_us / 1e3:.1f}" if i == 0 else "",
                         "-" if x is None else f"{x:.1f}", "-" if x is None else f"{x / rf:.1f}"))
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    lines.insert(1, "  ".join("-" * w for w in widths))
    for a in plan.apps:
        q = min((served[s.model] / a.rate_factor(i) for i, s in enumerate(a.stages) if s.model in served),
                default=0.0)
        glue = f", glue {a.glue_us / 1e3:g} ms per step" if a.glue_us else ""
        lines.append(f"app {a.name}: {q:.1f} queries/s (its slowest stage per query), "
                     f"weight {a.weight:g}{glue}")
    return "\n".join(lines)
