"""Executor backends: how one vGPU turns a batch into outputs.

* ``emulate``: no computation; the batch takes the profiled latency (a timer, so hundreds of
  emulated vGPUs share one process) and its input frames pass through, so the last hop echoes
  every request's own frame back — replies can be checked end to end.
* ``ort``: ONNX Runtime on CPU, one session per vGPU run in its own thread (ORT releases the GIL
  while it runs, so the event loop goes on serving control messages meanwhile).
* ``trt``: TensorRT engine with pycuda buffers (``ppiped/executor/trt.py``, imported lazily).

A blocking backend's :meth:`run` is called from a worker thread; the emulator's never is.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..wire import Assignment

if TYPE_CHECKING:  # onnx is only needed by ort and trt; emulated executors start without it
    from .onnxio import PartitionModel

ModelSource = tuple[Callable[[], Any], str]  # (loader returning an onnx.ModelProto, name for messages)

Outputs = tuple[list, Any, list[tuple[int, str]]]

# Most seconds a vGPU spends warming up batch sizes (each at least once, from 1, until then).
WARM_UP_BUDGET_S = 2.0  # frames, meta, [(input index, reason)] failed


class Backend:
    name = "base"
    blocking = True

    def __init__(self, a: Assignment) -> None:
        self.a = a
        self.first = a.partition == 0
        self.last = a.last

    def load(self) -> None:
        """Heavy set-up (model load, engine build); runs in a worker thread before registration ends."""

    def duration_us(self, bs: int) -> float:
        """The profiled latency at batch size ``bs`` (profiles stop at some size; extrapolate linearly)."""
        lat = self.a.lat_us
        if bs <= len(lat):
            return lat[bs - 1]
        step = lat[-1] - lat[-2] if len(lat) > 1 else lat[-1]
        return lat[-1] + step * (bs - len(lat))

    def run(self, frames: list, meta: Any, n: int) -> Outputs:
        """Run a batch of ``n`` requests: per-request frames on the first hop, else the feature
        maps of the cut before this partition, one frame each."""
        raise NotImplementedError

    def close(self) -> None:
        pass


class EmulateBackend(Backend):
    name = "emulate"
    blocking = False

    def __init__(self, a: Assignment, load_ms: int = 0, jitter: float = 0.0) -> None:
        super().__init__(a)
        self.load_ms = load_ms
        self.jitter = jitter
        self._rng = None
        if jitter > 0:
            import numpy as np

            self._rng = np.random.default_rng(1_000_003 * a.vgpu + 17)

    def duration_us(self, bs: int) -> float:
        """The profiled latency, times a lognormal factor (median 1, log-sd ``executor.
        emulate_jitter``) when set: executors whose latency wanders, as real ones do."""
        d = super().duration_us(bs)
        if self._rng is None:
            return d
        return d * float(self._rng.lognormal(0.0, self.jitter))

    def load(self) -> None:
        """Takes ``executor.emulate_load_ms`` (0 by default): a stand-in for an engine load, so a
        migration's preloading can be measured on an emulated cluster. Called off the event loop."""
        if self.load_ms:
            import time

            time.sleep(self.load_ms / 1000)

    def run(self, frames: list, meta: Any, n: int) -> Outputs:
        return frames, meta, []


class _TensorBackend(Backend):
    """Shared by ort, trt and torch: frames ⇄ tensors around an ``infer(batch) -> outputs`` call."""

    def __init__(self, a: Assignment, source: ModelSource) -> None:
        super().__init__(a)
        self.source = source
        self.part: PartitionModel | None = None

    def prepare(self) -> PartitionModel:
        from .onnxio import prepare_partition

        load, name = self.source
        self.part = prepare_partition(load(), name, self.first, self.last)
        return self.part

    def infer(self, feeds):  # dict[str, np.ndarray] -> list[np.ndarray], one per output
        raise NotImplementedError

    def run(self, frames: list, meta: Any, n: int) -> Outputs:
        from .onnxio import feeds_from_frames, frames_to_batch, split_results

        part = self.part
        assert part is not None
        failed: list[tuple[int, str]] = []
        if self.first:
            batch, kept, bad = frames_to_batch(frames, part.input)
            failed = [(i, f"bad-input: frame of {len(getattr(frames[i], 'buffer', frames[i]))} bytes, the model "
                       f"input {part.input.name} {list(part.input.shape)} {part.input.dtype} needs "
                       f"{part.input.sample_bytes}") for i in bad]
            if batch is None:
                return [], None, failed
            feeds = {part.input.name: batch}
            n = batch.shape[0]
        else:
            feeds = feeds_from_frames(frames, meta, part.inputs, n)
            if isinstance(feeds, str):
                return [], None, [(i, f"executor-error: {feeds}") for i in range(n)]
        outs = self.infer(feeds)
        if self.last:
            return split_results(outs, n), [o.meta() for o in part.outputs], failed
        # one frame per tensor of the cut, each the whole batch's
        return ([memoryview(o.reshape(-1).view("u1")) for o in outs],
                [spec.meta(n) for spec in part.outputs], failed)


class OrtBackend(_TensorBackend):
    name = "ort"

    def __init__(self, a: Assignment, source: ModelSource, threads: int = 1) -> None:
        super().__init__(a, source)
        self.threads = threads
        self.sess = None

    def load(self) -> None:
        import onnxruntime as ort

        part = self.prepare()
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.log_severity_level = 4  # errors reach the caller as exceptions, in its own words
        # Idle intra-op threads would spin on cores the other vGPUs' runs and the event loop need.
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        so.add_session_config_entry("session.inter_op.allow_spinning", "0")
        self.sess = ort.InferenceSession(part.onnx_bytes, so, providers=["CPUExecutionProvider"])
        self._outs = [o.name for o in part.outputs]
        self.warm_up()

    def warm_up(self) -> None:
        """One run at every batch size the plan may send, before the vGPU registers: ONNX Runtime
        plans its memory on the first run of a shape, which takes several times the profiled
        latency and would make the first real batch of each size overrun its reservation."""
        import time

        import numpy as np

        part = self.part
        assert part is not None
        t0 = time.monotonic()
        for bs in range(1, max(1, len(self.a.lat_us)) + 1):
            if bs > 1 and time.monotonic() - t0 > WARM_UP_BUDGET_S:
                break  # a model this slow hardly notices a first run's overhead
            self.infer({s.name: np.zeros((bs, *s.shape), dtype=s.dtype) for s in part.inputs})

    def infer(self, feeds):
        import numpy as np

        return [np.ascontiguousarray(o) for o in self.sess.run(self._outs, feeds)]


def make_backend(kind: str, a: Assignment, source: ModelSource | None = None, **opts: Any) -> Backend:
    """``source``: how to get the partition's ONNX graph (ort, trt, torch); ``opts``: threads, engine_path,
    device, fp16, split, load_ms and jitter (emulate)."""
    if kind == "emulate":
        return EmulateBackend(a, load_ms=opts.get("load_ms", 0), jitter=opts.get("jitter", 0.0))
    if source is None:
        raise ValueError(f"the {kind} backend needs the partition's ONNX model")
    if kind == "ort":
        return OrtBackend(a, source, threads=opts.get("threads", 1))
    if kind == "trt":
        from .trt import TrtBackend  # TensorRT and pycuda exist only with the gpu extra

        return TrtBackend(a, source, engine_path=Path(opts["engine_path"]), device=opts.get("device", 0),
                          fp16=opts.get("fp16", True), split=opts.get("split", 0))
    if kind == "torch":
        from .torch_cuda import TorchBackend  # PyTorch with CUDA, imported on GPU hosts only

        return TorchBackend(a, source, device=opts.get("device", 0), split=opts.get("split", 0))
    raise ValueError(f"unknown backend {kind!r}")
