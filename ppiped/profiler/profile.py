"""Orchestration of the offline phase: analyse, pre-partition, export, time, merge, save.

A profile describes one block partition of one model. Runs for other GPU types reuse the blocks
recorded in the existing profile and add their latencies to it, so all GPU types of a cluster end
up in one file that the planner reads.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import math
import os
import shutil
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from tqdm import tqdm

from ..errors import InputError
from ..profiles import (
    PROFILE_FORMAT,
    Profile,
    ProfileError,
    load_profile,
    profile_from_json,
    save_profile,
)
from .backends import BACKENDS, GPU_BACKENDS, Timing
from .backends import estimate as est
from .export import Exporter, blocks_from_extra
from .gpus import GPUS, gpu_spec
from .graph import (
    DEFAULT_MAX_CUT_TENSORS,
    MAX_CUT_TENSORS_LIMIT,
    ModelGraph,
    analyze,
    load_onnx,
    ort_run,
    ort_session,
)
from .harness import Job, Mps, run_split, timing_dispersion
from .partition import Block, block_costs, choose_cuts, max_deviation

EQUIVALENCE_TOLERANCE = 1e-2
MAX_BATCH = 1024
"""Largest batch size a profile may hold: every size 1..B is timed, and beyond this no GPU
batch is served (the estimate grows linearly, a measured run for hours)."""
MAX_SPLIT = 8
"""Most vGPUs one GPU may be split into (MPS runs up to 48 clients, PPipe uses up to 4)."""
SEGMENTS_PER_BLOCK = 4  # measured backends time at most this many candidate pieces per block
LAYOUTS = {
    "block_latency_layout": "block_latency_us[gpu][vgpu_split][block][batch_size-1]; "
                            "vgpu_split v = 1/v of a GPU via MPS, all v running together",
    "boundary_bytes_layout": "boundary_bytes[i] = fp16 bytes of the feature map leaving block i "
                             "(batch size 1), i = 0..num_blocks-2",
    "whole_model_latency_layout": "latency of the unpartitioned model, batch size 1, whole GPU "
                                  "(split 1); latency_source says how each GPU's figures were made",
}


@dataclass
class ProfileRequest:
    """Everything one ``ppiped profile`` run needs."""

    model_path: Path
    out_dir: Path
    backend: str = "ort"
    gpu: str | None = None
    blocks: int = 10
    max_batch: int = 8
    splits: Sequence[int] = (1,)
    name: str | None = None
    input_shape: tuple[int, ...] | None = None
    timing: Timing = field(default_factory=Timing)
    threads: int | None = None  # ort: cores that split 1 uses
    clock: str = "auto"  # ort: wall | cpu | auto (CPU time for one-thread copies)
    mps: str = "auto"  # auto | on | off (GPU backends, splits > 1)
    concurrent: bool = True
    method: str = "balanced"
    max_cut_tensors: int = DEFAULT_MAX_CUT_TENSORS  # tensors one cut may carry (1: PPipe's rule)
    partition_cost: str = "backend"  # backend: this run's own latencies; flops: device-neutral
    replace: bool = False
    slo_reference: str | None = None
    partitions: Sequence[tuple[int, int]] = ()
    progress: bool = True
    verify: bool = True  # run the block chain against the whole model with ONNX Runtime
    calibration: Path | None = None  # .npy file or folder of .npy/images for that check

    def __post_init__(self) -> None:
        if self.calibration is None:
            return
        self.calibration = Path(self.calibration)
        if not self.verify:
            raise InputError("--calibration feeds the equivalence check, which --no-verify skips")
        if not self.calibration.exists():
            raise InputError(f"calibration input {self.calibration} does not exist")


def parse_batch_sizes(text: str) -> int:
    """'1-8' or '8' -> 8. Profiles index batch sizes 1..B, so only such ranges are accepted."""
    t = text.strip()
    try:
        if "-" in t:
            lo, hi = (int(x) for x in t.split("-", 1))
        else:
            lo, hi = 1, int(t)
    except ValueError:
        raise InputError(f"bad --batch-sizes {text!r}: expected a range like 1-8") from None
    if lo != 1 or hi < 1:
        raise InputError(f"bad --batch-sizes {text!r}: profiles hold batch sizes 1..B, give 1-B")
    if hi > MAX_BATCH:
        raise InputError(f"bad --batch-sizes {text!r}: at most 1-{MAX_BATCH} (every size is profiled)")
    return hi


def parse_splits(text: str) -> list[int]:
    try:
        items = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise InputError(f"bad --splits {text!r}: expected e.g. 1,2,3,4") from None
    out = sorted(set(items))
    if not out or out[0] < 1:
        raise InputError(f"bad --splits {text!r}: splits are positive integers")
    if len(out) != len(items):
        raise InputError(f"bad --splits {text!r}: a split is given twice")
    if out[-1] > MAX_SPLIT:
        raise InputError(f"bad --splits {text!r}: a GPU splits into at most {MAX_SPLIT} vGPUs")
    return out


def parse_ranges(text: str) -> list[tuple[int, int]]:
    """'0-4,4-10' -> [(0, 4), (4, 10)] (block ranges [i, j))."""
    out = []
    for part in text.split(","):
        try:
            i, j = (int(x) for x in part.split("-"))
        except ValueError:
            raise InputError(f"bad partition range {part!r}: expected I-J like 0-4") from None
        if i >= j:
            raise InputError(f"bad partition range {part!r}: reversed or empty (I-J with I < J, "
                             "blocks I..J-1)")
        out.append((i, j))
    return out


def check_ranges(ranges: Sequence[tuple[int, int]], blocks: int) -> None:
    """Partition ranges that fit ``blocks`` blocks, checked before any file is written."""
    for i, j in ranges:
        if i >= j:
            raise InputError(f"bad partition range {i}-{j}: reversed or empty (I-J with I < J)")
        if i < 0 or j > blocks:
            raise InputError(f"bad partition range {i}-{j}: the profile has blocks 0..{blocks - 1} "
                             f"(ranges within 0-{blocks})")


def check_name(name: str) -> str:
    """A model name is a plain file name: it names ``DIR/<name>.json`` and ``DIR/<name>/``, so
    a path (``../x``, ``/abs``) would write outside ``-o``."""
    if not name or "/" in name or "\\" in name or name in (".", "..") or "\0" in name:
        raise InputError(f"model name {name!r} is not a plain file name (no '/', not '.', '..' "
                         "or empty)")
    return name


def _version() -> str:
    try:
        return metadata.version("ppiped")
    except metadata.PackageNotFoundError:
        return "dev"


def units_of(graph: ModelGraph) -> list[tuple[int, int]]:
    """Indivisible layer ranges [start, end) between consecutive valid cuts."""
    bounds = [0, *[c.after + 1 for c in graph.cuts], len(graph.layers)]
    return list(zip(bounds[:-1], bounds[1:], strict=True))


def make_blocks(graph: ModelGraph, ranges: Sequence[tuple[int, int]]) -> list[Block]:
    """Block records (with boundary tensor names and fp16 bytes) for consecutive layer ranges."""
    cuts = {c.after: c for c in graph.cuts}
    out: list[Block] = []
    for k, (s, e) in enumerate(ranges):
        ins = (graph.input_name,) if s == 0 else cuts[s - 1].tensors
        last = e == len(graph.layers)
        outs = tuple(graph.output_names) if last else cuts[e - 1].tensors
        out.append(Block(k, s, e, ins, outs, 0 if last else cuts[e - 1].fp16_bytes))
    return out


def _group(ranges: Sequence[tuple[int, int]], cuts_after: Sequence[int]) -> list[tuple[int, int]]:
    out = []
    start = 0
    for e in [*cuts_after, len(ranges) - 1]:
        out.append((ranges[start][0], ranges[e][1]))
        start = e + 1
    return out


class _Progress:
    def __init__(self, total: int, desc: str, enabled: bool) -> None:
        self.bar = tqdm(total=total, desc=desc, file=sys.stderr, disable=not enabled,
                        unit="run", leave=False)

    def tick(self) -> None:
        self.bar.update(1)

    def close(self) -> None:
        self.bar.close()


def _existing(req: ProfileRequest, path: Path, sha: str) -> Profile | None:
    if not path.exists() or req.replace:
        return None
    prof = load_profile(path)
    old = prof.extra.get("onnx_sha256")
    if old != sha:
        widths = {a.shape[1] for sp in prof.latency.values() for a in sp.values()}
        if (widths == {1}) != (req.max_batch == 1):
            # batch size 1 alone lets the analysis fix every size in the graph, batch included
            raise InputError(f"{path} was profiled at batch size{' 1 only' if widths == {1} else 's above 1'} and "
                             f"this run asks for {'1 only' if req.max_batch == 1 else 'more'}: the model is "
                             "analysed differently for each, so the runs cannot merge; give the same "
                             "--batch-sizes kind, or pass --replace to start a new profile")
        raise InputError(f"{path} was made from a different model (sha256 {str(old)[:12]}… vs "
                         f"{sha[:12]}…); pass --replace to start a new profile")
    if prof.num_blocks != req.blocks:
        raise InputError(f"{path} has {prof.num_blocks} blocks, this run asks for {req.blocks}; "
                         "merged runs must share the blocks (pass --replace to start over)")
    return prof


def _find_unsafe_cuts(equivalence: dict, exporter: Exporter, n: int, model_dir: Path, whole_path: Path,
                      inp: Any, req: ProfileRequest) -> None:
    """The blocks in sequence differ from the whole model: find the cuts whose fp16 hop does it
    (each cut alone, the model in two there) and record them in ``equivalence`` as
    ``unsafe_cuts``, which plans never cut at (a feature map past fp16's range, or one so small
    it underflows). Warns naming them; with every cut unsafe the model can still be served
    whole."""
    from .calibration import cut_errors

    tmp = model_dir / ".cuts"
    tmp.mkdir(exist_ok=True)
    pairs = []
    for c in range(1, n):
        a, b = tmp / f"before_{c:02d}.onnx", tmp / f"after_{c:02d}.onnx"
        onnx.save(exporter.partition(0, c), str(a))
        onnx.save(exporter.partition(c, n), str(b))
        pairs.append((c, a, b))
    try:
        errs = cut_errors(whole_path, pairs, inp, req.calibration, req.max_batch)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    unsafe = [c for c, e in errs.items() if not e <= EQUIVALENCE_TOLERANCE]
    equivalence["cut_errors"] = {str(c): (float(f"{e:.3g}") if math.isfinite(e) else None) for c, e in errs.items()}
    equivalence["unsafe_cuts"] = unsafe
    err = equivalence["max_rel_error"]
    print(f"ppiped profile: warning: the blocks in sequence differ from the whole model on output "
          f"{equivalence['worst_output']!r} by {'NaN (fp16 overflow)' if err is None else err} of its range, above "
          f"{EQUIVALENCE_TOLERANCE} ({equivalence['input']}): "
          + (f"the fp16 hop at the cut(s) before block(s) {', '.join(map(str, unsafe))} does it; plans will not cut there"
             if unsafe else "no single cut does it alone; plans with many partitions may stray"), file=sys.stderr)


def _check_runs(graph: ModelGraph, original: onnx.ModelProto, max_batch: int) -> None:
    """The analysed model must load and run in ONNX Runtime at batch size 1 (an opset ORT does
    not know, a zero-sized dimension: said here, before any file is written), and at batch size
    2 when its batch axis is fixed: a model exported with batch size 1 may hard-code it (Reshape
    to [1, -1])."""
    sess = ort_session(graph.model.SerializeToString(), "the model")
    dtype = onnx.helper.tensor_dtype_to_np_dtype(graph.dtypes.get(graph.input_name, 1))
    outs = ort_run(sess, {graph.input_name: np.zeros((1, *graph.input_shape), dtype=dtype)},
                   "the model at batch size 1")
    for o, y in zip([o.name for o in sess.get_outputs()], outs, strict=True):
        # executors size each request's output from the shape the model declares (ORT does not
        # hold a model to it): a wrong declaration would be served cut short, without an error
        want = graph.shapes.get(o)
        if want is not None and tuple(np.shape(y)) != tuple(want):
            raise InputError(f"output {o!r} is declared with shape {list(want[1:])} per request but the "
                             f"model computes {list(np.shape(y)[1:])}: fix the output's shape in the export "
                             "(or leave it undeclared)")
    inits = {t.name for t in original.graph.initializer}
    inp = next(i for i in original.graph.input if i.name not in inits)
    dim0 = inp.type.tensor_type.shape.dim[0] if inp.type.tensor_type.shape.dim else None
    if max_batch == 1 or dim0 is None or dim0.HasField("dim_param"):
        return
    try:
        x = np.zeros((2, *graph.input_shape), dtype=dtype)
        sess.run(None, {graph.input_name: x})
    except Exception as e:
        raise InputError(f"the model's batch axis is fixed at {dim0.dim_value} and does not run at "
                         f"batch size 2 ({str(e).splitlines()[0]}); export it with a dynamic batch "
                         "axis or profile with --batch-sizes 1") from None


def _measured_unit_costs(req: ProfileRequest, graph: ModelGraph, exporter_dir: Path,
                         ranges: Sequence[tuple[int, int]]) -> list[float]:
    """Time each candidate piece alone at batch 1, split 1: the costs pre-partitioning balances."""
    pieces = make_blocks(graph, ranges)
    ex = Exporter(graph.model, pieces)
    exporter_dir.mkdir(parents=True, exist_ok=True)
    jobs = []
    for p in pieces:
        path = exporter_dir / f"piece_{p.index:03d}.onnx"
        onnx.save(ex.partition(p.index, p.index + 1), str(path))
        jobs.append(Job(path, (1,)))
    prog = _Progress(len(jobs), "pre-partition: timing pieces", req.progress)
    try:
        res = run_split(req.backend, _backend_opts(req), 1, jobs, req.timing, 1, tick=prog.tick)
    finally:
        prog.close()
    for j in jobs:
        j.path.unlink(missing_ok=True)
    exporter_dir.rmdir()
    return [row[0] for row in res.latency_us]


def _backend_opts(req: ProfileRequest) -> dict[str, Any]:
    if req.backend == "ort":
        return {"threads": req.threads, "clock": req.clock}
    return {}


def _check_block_count(req: ProfileRequest, graph: ModelGraph) -> None:
    units = units_of(graph)
    if req.blocks > len(units):
        if len(units) == 1:
            raise InputError(f"the model has no valid cut point, so it cannot be partitioned: "
                             f"{graph.blocked or 'it has a single layer'}")
        raise InputError(f"cannot make {req.blocks} blocks: the model has only {len(units) - 1} valid "
                         f"cut points (at most {len(units)} blocks); lower --blocks")


def _partition(req: ProfileRequest, graph: ModelGraph, work_dir: Path) -> tuple[list[Block], dict]:
    units = units_of(graph)
    by_end = {c.after + 1: len(c.tensors) - 1 for c in graph.cuts}  # extra tensors of the cut at a layer

    def extra(ranges: Sequence[tuple[int, int]]) -> list[int]:
        return [by_end[e] for _, e in ranges[:-1]]

    spec = gpu_spec(req.gpu) if req.backend == "estimate" else GPUS.get(req.gpu or "", GPUS["V100"])
    est_cost = [est.range_us(graph.layers[s:e], spec, 1, 1) - est.ENGINE_OVERHEAD_LAUNCHES * spec.launch_us
                for s, e in units]
    if req.partition_cost == "flops":
        pieces = units
        costs = [sum(la.flops for la in graph.layers[s:e]) / 1e6 for s, e in units]
        source = "MFLOPs per piece (device-neutral)"
    elif req.partition_cost != "backend":
        raise InputError(f"unknown partition cost {req.partition_cost!r} (backend, flops)")
    elif req.backend == "estimate":
        pieces, costs, source = units, est_cost, f"estimate for {spec.name}, batch 1"
    else:
        n_pieces = min(len(units), SEGMENTS_PER_BLOCK * req.blocks)
        pieces = units if n_pieces == len(units) else _group(units, choose_cuts(est_cost, n_pieces,
                                                                             extra_tensors=extra(units)))
        costs = _measured_unit_costs(req, graph, work_dir, pieces)
        source = f"{req.backend} on {req.gpu}, batch 1, split 1, each piece alone"
    cuts = choose_cuts(costs, req.blocks, req.method, extra(pieces))
    blocks = make_blocks(graph, _group(pieces, cuts))
    bc = block_costs(costs, cuts)
    tensors = [len(b.outputs) for b in blocks[:-1]]
    info = {"method": req.method, "cost_source": source, "pieces": len(pieces),
            "max_cut_tensors": req.max_cut_tensors, "cut_tensors": tensors,
            "block_cost": [round(c, 3) for c in bc], "max_deviation_from_mean": round(max_deviation(bc), 4)}
    span = _uncuttable(graph, blocks, bc)
    if span is not None:
        info["uncuttable"] = span
    return blocks, info


# A block at least this many times the mean block, with no valid cut inside, is reported.
UNCUTTABLE_FACTOR = 2.0


def _uncuttable(graph: ModelGraph, blocks: Sequence[Block], costs: Sequence[float]) -> dict | None:
    """The heaviest block when it is far above the mean and no valid cut falls inside it: the
    plan cannot split it, whatever ``--blocks`` asks (RetinaNet's heads at K = 4: layers 199-383
    of 383 in one block, 48 % of the model's time on an H100)."""
    if len(blocks) < 2:
        return None
    i = int(np.argmax(costs))
    mean = sum(costs) / len(costs)
    b = blocks[i]
    if not (mean > 0 and costs[i] >= UNCUTTABLE_FACTOR * mean) or any(
            b.start < c.after + 1 < b.end for c in graph.cuts):
        return None
    return {"block": i, "layers": [b.start, b.end], "share": round(costs[i] / sum(costs), 4)}


def _block_extra(graph: ModelGraph, blocks: Sequence[Block], name: str) -> list[dict[str, Any]]:
    out = []
    for b in blocks:
        layers = graph.layers[b.start:b.end]
        out.append({
            "index": b.index, "first_layer": b.start, "end_layer": b.end,
            "first_node": layers[0].name, "last_node": layers[-1].name,
            "inputs": list(b.inputs), "outputs": list(b.outputs), "out_bytes": b.out_bytes,
            "mflops": round(sum(la.flops for la in layers) / 1e6, 3),
            "file": f"{name}/block_{b.index:02d}.onnx",
        })
    return out


def _estimate_latencies(req: ProfileRequest, graph: ModelGraph, blocks: Sequence[Block]) -> tuple[dict, float, dict]:
    spec = gpu_spec(req.gpu or "")
    lat = {v: np.array([[est.range_us(graph.layers[b.start:b.end], spec, v, bs)
                         for bs in range(1, req.max_batch + 1)] for b in blocks])
           for v in req.splits}
    whole = est.range_us(graph.layers, spec, 1, 1)
    source = {"backend": "estimate", "measured": False, "what_if": True, "gpu_spec": vars(spec),
              "note": "roofline estimate from datasheet figures (ppiped.profiler.backends.estimate); "
                      "not a measurement"}
    return lat, whole, source


def _cpu_time_share(req: ProfileRequest, split: int) -> float:
    """How many times longer a batch takes on one of ``split`` ORT vGPUs of a CPU "GPU" (its
    ``--threads`` cores) than alone with the same threads, when the copies outnumber the cores.

    Copies time-slicing a core, timed together, overlap only in part (each finishes its rounds at
    its own pace), so their figures swing between 1x and v x; what a vGPU that gets 1/v of a
    core's time takes is v x what one copy takes alone (cache contention aside), and one copy's
    CPU time is also what other load on the host leaves untouched. 1 when no core is shared.
    """
    if req.backend != "ort" or split <= 1:
        return 1.0
    from .backends.ort import cpu_count

    total = req.threads or cpu_count()
    per = max(1, total // split)
    return split * per / total


def _measure_latencies(req: ProfileRequest, graph: ModelGraph, blocks: Sequence[Block],
                       files: Sequence[Path], whole_path: Path) -> tuple[dict, float, dict]:
    bss = tuple(range(1, req.max_batch + 1))
    total = sum(len(blocks) * len(bss) + (1 if v == 1 else 0) for v in req.splits)
    prog = _Progress(total, f"profiling {req.backend} on {req.gpu}", req.progress)
    lat: dict[int, np.ndarray] = {}
    whole = float("nan")
    per_split: dict[str, Any] = {}
    mps = Mps()
    mps_on = False
    try:
        for v in req.splits:
            jobs = [Job(p, bss) for p in files]
            if v == 1:
                jobs.append(Job(whole_path, (1,)))
            copies = v if req.concurrent else 1
            env: dict[str, str] = {}
            mode = "whole device" if v == 1 else "cpu threads"
            share = _cpu_time_share(req, v)
            if share > 1:  # more copies than cores: each vGPU is a share of a core's time
                copies, mode = 1, f"time-shared: one copy timed alone, x{share:g}"
            if req.backend in GPU_BACKENDS and v > 1:
                mode = "time-sliced (no MPS)"
                if req.mps != "off" and not mps_on and mps.error is None:
                    mps_on = mps.start()
                    if not mps_on and req.mps == "on":
                        raise ProfileError(f"--mps on, but {mps.error}")
                    if not mps_on:
                        print(f"ppiped profile: warning: MPS unavailable ({mps.error}); timing splits "
                              "> 1 with the copies time-sharing the whole GPU", file=sys.stderr)
                if mps_on:
                    env = {**mps.env(), "CUDA_MPS_ACTIVE_THREAD_PERCENTAGE": f"{100.0 / v:g}"}
                    mode = "mps"
            res = run_split(req.backend, _backend_opts(req), v, jobs, req.timing, copies, env, prog.tick)
            if v == 1:
                whole = res.latency_us[-1][0]
                res.latency_us = res.latency_us[:-1]
            lat[v] = np.array(res.latency_us) * max(1.0, share)
            per_split[str(v)] = {"copies_running_together": copies, "sharing": mode,
                                 "active_thread_percentage": round(100.0 / v, 2) if mode == "mps" else None,
                                 "copy_spread": round(res.spread, 4), "workers": res.info["workers"]}
    finally:
        mps.stop()
        prog.close()
    if 1 not in req.splits:
        res = run_split(req.backend, _backend_opts(req), 1, [Job(whole_path, (1,))], req.timing, 1)
        whole = res.latency_us[0][0]
    source = {"backend": req.backend, "measured": True, "what_if": False, "splits": per_split,
              "timing": vars(req.timing),
              "timing_dispersion": timing_dispersion(per_split, len(blocks), req.gpu)}
    return lat, whole, source


def profile_model(req: ProfileRequest) -> tuple[Profile, Path]:
    """Run the whole offline phase for one model and one GPU type; returns the merged profile."""
    if req.backend not in BACKENDS:
        raise InputError(f"unknown backend {req.backend!r} (choose from {', '.join(BACKENDS)})")
    if req.max_batch < 1:
        raise InputError("batch sizes must include 1")
    if not req.splits or min(req.splits) < 1:
        raise InputError("splits must be positive integers")
    if req.backend == "estimate":
        if not req.gpu:
            raise InputError(f"--gpu is required with --backend estimate (one of {', '.join(GPUS)})")
        req.gpu = gpu_spec(req.gpu).name
    elif req.backend == "ort" and not req.gpu:
        req.gpu = "CPU"
    elif not req.gpu:
        raise InputError(f"--gpu is required with --backend {req.backend} (a short name such as "
                         "H100; it keys the profile's latencies)")
    if req.blocks < 1:
        raise InputError(f"--blocks must be at least 1, got {req.blocks}")
    if req.max_batch > MAX_BATCH:
        raise InputError(f"batch sizes go up to {MAX_BATCH}, got {req.max_batch}")
    if max(req.splits) > MAX_SPLIT or len(set(req.splits)) != len(req.splits):
        raise InputError(f"splits must be distinct, 1..{MAX_SPLIT}: got {list(req.splits)}")
    check_ranges(req.partitions, req.blocks)
    name = check_name(req.name if req.name is not None else req.model_path.stem)
    original = load_onnx(req.model_path)
    graph = analyze(original, req.input_shape, req.max_cut_tensors, batched=req.max_batch > 1,
                    max_batch=req.max_batch)
    _check_runs(graph, original, req.max_batch)
    _check_block_count(req, graph)
    inp = None
    if req.verify:
        from .calibration import ModelInput

        inp = ModelInput(graph.input_name, tuple(graph.input_shape),
                         onnx.helper.tensor_dtype_to_np_dtype(graph.dtypes.get(graph.input_name, 1)))
        if req.calibration is not None:
            _precheck_calibration(req.calibration, inp)
    sha = hashlib.sha256(graph.model.SerializeToString()).hexdigest()
    created = _make_out_dir(req.out_dir)
    prof_path = req.out_dir / f"{name}.json"
    try:
        existing = _existing(req, prof_path, sha)
        _check_slo_reference(req, existing)
        stage = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".tmp", dir=req.out_dir))
    except BaseException:
        _remove_created(created)
        raise
    try:
        prof = _profile_into(req, graph, existing, sha, name, stage, inp)
        save_profile(prof, stage / f"{name}.json")
        _commit(stage, req.out_dir, name, keep_old=existing is not None)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        _remove_created(created)
        raise
    shutil.rmtree(stage, ignore_errors=True)
    return prof, prof_path


def _profile_into(req: ProfileRequest, graph: ModelGraph, existing: Profile | None, sha: str,
                  name: str, stage: Path, inp) -> Profile:
    """Export, check and time everything in ``stage`` (the caller moves it into place)."""
    model_dir = stage / name
    model_dir.mkdir()
    whole_path = model_dir / "model.onnx"
    onnx.save(graph.model, str(whole_path))
    if existing is not None and "blocks" in existing.extra:
        blocks = blocks_from_extra(existing.extra["blocks"])
        part_info = existing.extra.get("partitioning", {})
    else:
        blocks, part_info = _partition(req, graph, model_dir / "pieces")
    check_ranges(req.partitions, len(blocks))
    span = part_info.get("uncuttable")
    if span and "blocks" not in (existing.extra if existing is not None else {}):
        more = (f"a larger --max-cut-tensors (now {req.max_cut_tensors}, at most {MAX_CUT_TENSORS_LIMIT}) may "
                "cut it" if req.max_cut_tensors < MAX_CUT_TENSORS_LIMIT else "no cut limit splits it")
        print(f"ppiped profile: warning: block {span['block']} (layers {span['layers'][0]}-{span['layers'][1] - 1} "
              f"of {len(graph.layers)}) takes {100 * span['share']:.0f} % of the model's cost and has no valid "
              f"cut inside with at most {req.max_cut_tensors} tensors crossing: plans cannot split it; {more}", file=sys.stderr)
    exporter = Exporter(graph.model, blocks)
    files = []
    for b in blocks:
        path = model_dir / f"block_{b.index:02d}.onnx"
        onnx.save(exporter.partition(b.index, b.index + 1), str(path))
        files.append(path)
    for i, j in req.partitions:
        onnx.save(exporter.partition(i, j), str(model_dir / f"partition_{i:02d}_{j:02d}.onnx"))
    equivalence = None
    if req.verify:
        from .calibration import check_equivalence

        equivalence = check_equivalence(whole_path, files, inp, req.calibration, req.max_batch,
                                        EQUIVALENCE_TOLERANCE)
        if not equivalence["passed"] or equivalence["overflow"]:
            _find_unsafe_cuts(equivalence, exporter, len(blocks), model_dir, whole_path, inp, req)
        if equivalence["input_insensitive"] and equivalence["samples"] > 1:
            print(f"ppiped profile: warning: output(s) {', '.join(equivalence['input_insensitive'])} came "
                  f"out the same for every sample ({equivalence['input']}): the blocks' check proves "
                  "little there; give --calibration inputs that the model tells apart", file=sys.stderr)
    if req.backend == "estimate":
        lat, whole, source = _estimate_latencies(req, graph, blocks)
    else:
        lat, whole, source = _measure_latencies(req, graph, blocks, files, whole_path)
    source["profiler"] = f"ppiped {_version()}"
    if source["measured"]:  # estimates carry no date, so the example profile is reproducible
        source["date"] = dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds")
    prof = _merge(existing, req, graph, blocks, lat, whole, source, part_info, sha, name)
    if equivalence is not None:
        prof.extra["equivalence"] = equivalence
    return prof


def _precheck_calibration(path: Path, inp) -> None:
    """Refuse calibration input that cannot fit the model before anything is exported: the
    folder's file list, and each ``.npy`` file's shape and dtype (read from its header)."""
    from .calibration import Calibration, _open_npy

    cal = Calibration(path, inp)
    for f in cal.files:
        if f.suffix.lower() == ".npy":
            _open_npy(f, inp)


def _make_out_dir(out: Path) -> list[Path]:
    """Create ``-o`` (and missing parents), or say in one line why not; returns the folders it
    created, so a failed run can take them away again."""
    if out.exists() and not out.is_dir():
        raise InputError(f"-o {out}: not a directory")
    missing = []
    p = out
    while not p.exists():
        missing.append(p)
        if p.parent == p:
            break
        p = p.parent
    if p.exists() and not p.is_dir():
        raise InputError(f"-o {out}: {p} is a file, not a directory")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"-o {out}: cannot create the directory ({e.strerror or e})") from None
    if not os.access(out, os.W_OK | os.X_OK):
        _remove_created(missing)
        raise InputError(f"-o {out}: directory is not writable")
    return missing


def _remove_created(dirs: Sequence[Path]) -> None:
    for d in dirs:  # deepest first; only the ones still empty
        try:
            d.rmdir()
        except OSError:
            return


def _check_slo_reference(req: ProfileRequest, existing: Profile | None) -> None:
    """``--slo-reference`` must be a GPU type the profile will hold after this run."""
    if req.slo_reference is None:
        return
    have = [*(existing.gpus if existing is not None else []), req.gpu or ""]
    if req.slo_reference not in have:
        raise InputError(f"--slo-reference {req.slo_reference}: the profile has no latencies for it "
                         f"(it will hold {', '.join(dict.fromkeys(have))}); profile that GPU first")


def _commit(stage: Path, out: Path, name: str, keep_old: bool) -> None:
    """Move the staged model folder, then the profile, into ``out`` (each a rename): a run that
    failed earlier left the old ones untouched. A merged run keeps the old folder's extra files
    (partition exports of earlier runs) that it did not write again."""
    new_dir, old_dir = stage / name, out / name
    backup = stage / "old"
    if old_dir.is_dir() and not old_dir.is_symlink():
        if keep_old:
            for f in old_dir.iterdir():
                if f.is_file() and not (new_dir / f.name).exists():
                    shutil.copy2(f, new_dir / f.name)
        os.replace(old_dir, backup)
    elif old_dir.exists() or old_dir.is_symlink():
        raise InputError(f"{old_dir} exists and is not a directory; move it away")
    try:
        os.replace(new_dir, old_dir)
        os.replace(stage / f"{name}.json", out / f"{name}.json")
    except BaseException:
        if backup.exists():
            if old_dir.exists():
                shutil.rmtree(old_dir, ignore_errors=True)
            os.replace(backup, old_dir)
        raise


def _merge(existing: Profile | None, req: ProfileRequest, graph: ModelGraph, blocks: Sequence[Block],
           lat: dict[int, np.ndarray], whole: float, source: dict, part_info: dict, sha: str,
           name: str) -> Profile:
    gpu = req.gpu or ""
    latency = {g: dict(sp) for g, sp in existing.latency.items()} if existing else {}
    latency.setdefault(gpu, {}).update(lat)
    whole_all = dict(existing.whole_model_latency_us) if existing else {}
    whole_all[gpu] = whole
    extra: dict[str, Any] = dict(existing.extra) if existing else {}
    extra.update(LAYOUTS)
    extra.update({
        "onnx": f"{name}/model.onnx",
        "onnx_sha256": sha,
        "onnx_source": req.model_path.name,
        "input": {"name": graph.input_name, "shape": list(graph.input_shape),
                  "dtype": onnx.helper.tensor_dtype_to_np_dtype(graph.dtypes.get(graph.input_name, 1)).name},
        "boundary_dtype": "float16",
        "blocks": _block_extra(graph, blocks, name),
        "partitioning": part_info,
    })
    sources = dict(extra.get("latency_source", {}))
    sources[gpu] = source
    extra["latency_source"] = sources
    ref = req.slo_reference or extra.get("slo_reference_gpu") or gpu
    if ref not in latency:
        ref = gpu
    extra["slo_reference_gpu"] = ref
    extra["slo_note"] = ("SLO = multiplier x whole_model_latency_us[slo_reference_gpu] "
                         "(batch 1, whole GPU), as in PPipe")
    d = {
        "format": PROFILE_FORMAT, "model": name, "num_blocks": len(blocks),
        "block_latency_us": {g: {str(v): np.round(a, 3).tolist() for v, a in sorted(sp.items())}
                             for g, sp in latency.items()},
        "boundary_bytes": [b.out_bytes for b in blocks[:-1]],
        "whole_model_latency_us": {g: round(float(x), 3) for g, x in whole_all.items()},
        **extra,
    }
    return profile_from_json(d, f"{name} (new profile)")
