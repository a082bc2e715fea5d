"""Real inference of a cut model: its partitions served by real executors (``ort`` on this host's
CPU by default, or a GPU backend), every output compared with the whole model run by ONNX Runtime.

A plan is only worth serving if its pipeline computes what the model computes: activations cross
each cut in fp16, so a pipeline's output differs from the whole model's by a rounding error, and
anything larger means a wrong cut, a wrong tensor order or a wrong boundary. ``ppiped demo`` and
the tests use this to show that on the example CNN.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .errors import InputError
from .profiles import Profile, load_profile

Cut = tuple[tuple[int, int], str]  # a partition: its blocks [a, b) and its GPU class
TOLERANCE = 1e-2  # of the whole model's output range: fp16 boundaries, nothing more


def one_vgpu_plan(profile: Profile, partitions: Sequence[Cut], batch_size: int = 2,
                  nic_gbps: float = 10.0) -> dict[str, Any]:
    """A ``ppiped-plan/1`` object serving ``profile``'s model along one pipeline, each partition on
    one vGPU of its GPU class: the smallest cluster on which a planned cut runs as it would at
    scale. The SLO is seconds, since ORT on a CPU core is far slower than the profiled GPUs."""
    n = profile.num_blocks
    parts = []
    for (a, b), gpu in partitions:
        if profile.max_batch(gpu, 1) < batch_size:
            raise InputError(f"{profile.model}: batch size {batch_size} is not profiled on {gpu} "
                             f"(up to {profile.max_batch(gpu, 1)})")
        parts.append({"blocks": [a, b], "gpu": gpu, "vgpu_split": 1, "num_vgpus": 1,
                      "lat_infer_us": profile.partition_latency_us(gpu, 1, a, b, batch_size),
                      "lat_trans_us": profile.transfer_us(b, batch_size, nic_gbps) if b < n else 0.0,
                      "throughput_rps": 1.0, "batch_size": batch_size})
    counts: dict[str, int] = {}
    for _, gpu in partitions:
        counts[gpu] = counts.get(gpu, 0) + 1
    gpus = {g: {"count": c, "per_server": c, "splits": [1]} for g, c in counts.items()}
    model = {"model": profile.model, "slo_us": 5e6, "weight": 1.0, "throughput_rps": 1.0,
             "batch_delay_rate_rps": 1.0,
             "pipelines": [{"batch_size": batch_size, "throughput_rps": 1.0, "latency_us": 1e4,
                            "partitions": parts}]}
    return {"format": "ppiped-plan/1", "algo": "hand", "cluster": {"nic_gbps": nic_gbps, "gpus": gpus},
            "params": {"slo_scale": None, "slo_reference_gpu": None},
            "objective": {"normalized_throughput": 1.0}, "models": [model]}


@dataclass
class RealCheck:
    """What :func:`serve_and_compare` saw; ``equal`` is the verdict."""

    partitions: list[Cut]
    frames: int
    input_shape: list[int]
    max_diff: float = 0.0
    output_range: float = 0.0
    equal: bool = False
    tolerance: float = TOLERANCE
    errors: list[str] = field(default_factory=list)
    backend: str = "ort"

    def to_json(self) -> dict[str, Any]:
        d = asdict(self)
        d["partitions"] = [{"blocks": list(b), "gpu": g} for b, g in self.partitions]
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> RealCheck:
        parts = [((p["blocks"][0], p["blocks"][1]), p["gpu"]) for p in d["partitions"]]
        return cls(**{**d, "partitions": parts})


def serve_and_compare(work: Path, profile_path: Path, partitions: Sequence[Cut], frames: int = 8,
                      seed: int = 2, batch_size: int = 2, tolerance: float = TOLERANCE,
                      backend: str = "ort") -> RealCheck:
    """Serve ``partitions`` of the model profiled at ``profile_path`` (the executors cut them from
    the model file the profile names) with ``backend`` executors, one process per partition, submit
    ``frames`` seeded frames shaped as the scheduler announces the input, and compare every
    output with the whole model. ``work`` must be short (ipc socket paths)."""
    import onnxruntime as ort

    from .client import Client
    from .daemon.launch import LocalCluster, split_groups, write_config

    profile_path = Path(profile_path).resolve()  # the daemon reads it from its own directory
    profile = load_profile(profile_path)
    model_path = profile_path.parent / profile.extra["onnx"]
    plan = work / "real-plan.json"
    plan.write_text(json.dumps(one_vgpu_plan(profile, partitions, batch_size)))
    cfg = write_config(work, plan, Path(profile_path).parent, backend=backend,
                       scheduler={"wait_guard_us": 1e6})
    n = len(partitions)
    with LocalCluster(cfg, split_groups(n, n), log_dir=work) as c, \
            Client(c.client_endpoint, timeout_s=60) as cl:
        spec = cl.info()["models"][profile.model]["input"]
        shape = list(spec["shape"])
        x = np.random.default_rng(seed).standard_normal((frames, *shape)).astype(spec.get("dtype") or np.float32)
        out = cl.submit_many(profile.model, [xi.tobytes() for xi in x])
    check = RealCheck(list(partitions), frames, shape, tolerance=tolerance, backend=backend)
    so = ort.SessionOptions()
    so.log_severity_level = 3  # (exports keep initializers the graph no longer reads: ORT warns of each)
    sess = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
    # one frame at a time: a model profiled at batch size 1 only may fix its batch inside
    runs = [sess.run(None, {sess.get_inputs()[0].name: x[i:i + 1]}) for i in range(len(x))]
    want = [np.concatenate([r[k] for r in runs]) for k in range(len(runs[0]))]
    worst = -1.0
    for i, r in enumerate(out):
        if isinstance(r, Exception):
            check.errors.append(f"frame {i}: {r}")
            continue
        got = r.arrays()
        if len(got) != len(want):
            check.errors.append(f"frame {i}: {len(got)} outputs, the whole model has {len(want)}")
            continue
        for y, w in zip(got, want, strict=True):
            span = float(w.max() - w.min()) or 1.0
            diff = float(np.abs(y.reshape(w[i].shape).astype(np.float64) - w[i]).max())
            if diff / span > worst:
                worst, check.max_diff, check.output_range = diff / span, diff, span
    check.equal = not check.errors and worst <= tolerance
    return check


def format_check(c: RealCheck) -> str:
    """One line: which cut ran where, and whether it equals the whole model."""
    path = " → ".join(f"[{a},{b}) {g}" for (a, b), g in c.partitions)
    where = "ONNX Runtime on this CPU" if c.backend == "ort" else f"{c.backend} executors"
    head = f"real inference: partitions {path} served by {where}: {c.frames} frames"
    if c.errors:
        more = f" (and {len(c.errors) - 1} more)" if len(c.errors) > 1 else ""
        return f"{head}, FAILED: {c.errors[0]}{more}"
    verdict = ("equal to the whole model" if c.equal
               else f"DIFFERS from the whole model (more than {c.tolerance:g} x the range)")
    return f"{head}, max |diff| {c.max_diff:.2g} (range {c.output_range:.3g}) — {verdict}"
