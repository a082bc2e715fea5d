"""Plan format ``ppiped-plan/1``, the importer for PPipe reference plans, and the plan checker.

The checker is the single statement of the control-plane rules (DESIGN.md, "Control plane"):
the planner's output, imported reference plans and anything an operator hand-edits all go
through :func:`check`, which recomputes every figure from the profiles.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .cluster import Cluster, ClusterError, cluster_from_json

if TYPE_CHECKING:
    from .query.app import App
from .profiles import Profile
from .readfile import read_json

PLAN_FORMAT = "ppiped-plan/1"

# Relative and absolute slack for comparing recomputed floats with stated ones.
REL_TOL = 1e-6
ABS_TOL_US = 1.0


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


def gpus_used(pools: Iterable[tuple[str, int, str, float]], share_gpus: bool = False) -> dict[str, dict]:
    """Physical GPUs per type under PPipe's ``force_sum_gpu_integer_per_partition`` rule.

    ``pools`` holds (model, partition index, GPU type, physical GPUs as vGPUs / split). The use
    of each (model, partition index, type) is rounded up to whole GPUs, then summed over models
    and indices; with ``share_gpus`` the rounding is per (partition index, type) across models.
    Returns, per type, ``{"total": n, "groups": {key: n}}`` with the rounded group counts.
    """
    use: dict[tuple, float] = defaultdict(float)
    for model, d, gpu, g in pools:
        use[(gpu, d) if share_gpus else (gpu, model, d)] += g
    out: dict[str, dict] = {}
    for key, u in sorted(use.items(), key=lambda kv: tuple(map(str, kv[0]))):
        e = out.setdefault(key[0], {"total": 0, "groups": {}})
        n = math.ceil(u - 1e-6)
        e["groups"][key[1:]] = n
        e["total"] += n
    return out


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
    pools: list[tuple[str, int, str, float]] = []
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
                pools.append((m.model, qi, q.gpu, q.num_vgpus / q.vgpu_split))
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
    """An app's stages are planned models whose SLO is the stage's budget, and the budgets plus
    glue fit the app's SLO on every path (else its deadlines could not all be met)."""
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
    return out


# --- reading and writing ------------------------------------------------------------------


def _get(d: dict, key: str, where: str) -> Any:
    if not isinstance(d, dict) or key not in d:
        raise PlanError(f"{where}: missing field {key!r}")
    return d[key]


def plan_from_json(d: Any, source: str = "<memory>") -> Plan:
    if not isinstance(d, dict):
        raise PlanError(f"{source}: a plan is a JSON object")
    fmt = d.get("format")
    if fmt != PLAN_FORMAT:
        raise PlanError(f"{source}: field format: expected {PLAN_FORMAT!r}, got {fmt!r}")
    try:
        cluster = cluster_from_json(_get(d, "cluster", source), f"{source}: cluster")
    except ClusterError as e:
        raise PlanError(str(e)) from None
    try:
        params = PlanParams(**d.get("params", {}))
    except TypeError as e:
        raise PlanError(f"{source}: field params: {e}") from None
    models = []
    try:
        for mi, m in enumerate(_get(d, "models", source)):
            w = f"{source}: models[{mi}]"
            pipes = []
            for pi, p in enumerate(_get(m, "pipelines", w)):
                wp = f"{w}.pipelines[{pi}]"
                bs = int(_get(p, "batch_size", wp))
                parts = []
                for qi, q in enumerate(_get(p, "partitions", wp)):
                    wq = f"{wp}.partitions[{qi}]"
                    blocks = _get(q, "blocks", wq)
                    if not isinstance(blocks, list) or len(blocks) != 2:
                        raise PlanError(f"{wq}: field blocks: expected [start, end)")
                    parts.append(Partition(
                        (int(blocks[0]), int(blocks[1])), str(_get(q, "gpu", wq)),
                        int(_get(q, "vgpu_split", wq)), int(_get(q, "num_vgpus", wq)),
                        float(_get(q, "lat_infer_us", wq)), float(_get(q, "lat_trans_us", wq)),
                        float(_get(q, "throughput_rps", wq)), int(q.get("batch_size", bs)),
                    ))
                pipes.append(Pipeline(bs, float(_get(p, "throughput_rps", wp)),
                                      float(_get(p, "latency_us", wp)), parts))
            models.append(ModelPlan(
                str(_get(m, "model", w)), float(_get(m, "slo_us", w)), float(_get(m, "weight", w)),
                float(_get(m, "throughput_rps", w)), pipes, float(_get(m, "batch_delay_rate_rps", w)),
            ))
        obj = float(_get(_get(d, "objective", source), "normalized_throughput", f"{source}: objective"))
    except (TypeError, ValueError) as e:
        if isinstance(e, PlanError):
            raise
        raise PlanError(f"{source}: malformed value: {e}") from None
    plan = Plan(cluster, params, models, obj, str(d.get("algo", "")), dict(d.get("solver", {})), source)
    if d.get("apps"):
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
    return {
        "weights": [float(x) for x in m["w"].split("-")] if m["w"] else None,
        "gpus": {m["ga"]: int(m["na"]), m["gb"]: int(m["nb"])},
        "nic_gbps": float(m["bw"]),
        "slo_scale": float(m["sla"]),
        "algo": REFERENCE_ALGOS.get(m["algo"], m["algo"]),
    }


def import_reference(path: str | Path, cluster: Cluster | None = None,
                     weights: list[float] | None = None) -> Plan:
    """Read a PPipe reference plan (a JSON list, one entry per model) as a :class:`Plan`.

    GPU counts and weights come from ``cluster``/``weights`` when given, else from the file name;
    splits, GPUs per server, NIC and SLO come from each entry's ``config``.
    """
    path = Path(path)
    try:
        d = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise PlanError(f"{path}: cannot read reference plan: {e}") from None
    if not isinstance(d, list) or not d:
        raise PlanError(f"{path}: a reference plan is a non-empty JSON list of models")
    info = None
    if cluster is None or weights is None:
        names = [e.get("config", {}).get("dnn_name") for e in d if isinstance(e, dict)]
        info = reference_name_info(path, names if all(isinstance(n, str) for n in names) else None)
    if weights is None:
        weights = info["weights"]  # type: ignore[index]
        if weights is None:
            if len(d) != 1:
                raise PlanError(f"{path}: {len(d)} models but the file name gives no weights")
            weights = [1.0]
    if len(weights) != len(d):
        raise PlanError(f"{path}: {len(d)} models but {len(weights)} weights")
    cfg0 = _get(d[0], "config", f"{path}[0]")
    if cluster is None:
        names = cfg0["gpu_name_arr"]
        cluster = cluster_from_json({
            "nic_gbps": cfg0["bw_gbps"],
            "gpus": {
                g: {"count": info["gpus"][g], "per_server": int(ps), "splits": list(range(1, int(nm) + 1))}  # type: ignore[index]
                for g, ps, nm in zip(names, cfg0["num_gpu_per_server_arr"], cfg0["num_mps_levels"], strict=True)
            },
        }, f"{path}: cluster")
    margin = cfg0["hist_adjustment"] / cfg0["sla"]
    params = PlanParams(
        slo_margin=round(margin, 4),
        batch_delay_factor=float(cfg0["batch_build_factor"]),
        max_partitions=int(cfg0["max_num_parts"]),
        slo_scale=info["slo_scale"] if info else None,
        slo_reference_gpu="L4" if info else None,
    )
    models = []
    for i, (entry, w) in enumerate(zip(d, weights, strict=True)):
        where = f"{path}[{i}]"
        cfg = _get(entry, "config", where)
        pipes = []
        for p in _get(entry, "pipelines", where):
            parts = []
            for q in p["partitions"]:
                split = int(q["mps"]) + 1
                parts.append(Partition(
                    (int(q["layers"][0]), int(q["layers"][1])), q["gpu"], split,
                    int(round(q["num_gpu"] * split)), float(q["lat_infer"]), float(q["lat_trans"]),
                    float(q["xput"]), int(q["bs"]),
                ))
            bs = parts[0].batch_size
            lat = sum(q.lat_infer_us + q.lat_trans_us for q in parts)
            lat += batch_delay_us(bs, float(cfg["est_xput"]), params.batch_delay_factor)
            pipes.append(Pipeline(bs, float(p["xput"]), lat, parts))
        models.append(ModelPlan(cfg["dnn_name"], float(cfg["sla"]), float(w), float(entry["xput"]),
                                pipes, float(cfg["est_xput"])))
    obj = min(m.throughput_rps / m.weight for m in models)
    algo = info["algo"] if info else ""
    solver = {"gap": d[0]["mipgap"], "solve_s": d[0]["runtime"]} if "mipgap" in d[0] else {}
    return Plan(cluster, params, models, obj, algo, solver, str(path))


def load_plan(path: str | Path, cluster: Cluster | None = None) -> Plan:
    """Read a ``ppiped-plan/1`` file, or a PPipe reference plan file as is."""
    path = Path(path)
    d = read_json(path, PlanError)
    if isinstance(d, list):
        return import_reference(path, cluster)
    return plan_from_json(d, str(path))


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
