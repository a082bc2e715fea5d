"""Timing backends. Each turns an ONNX (sub-)model into a session that runs it at a batch size.

``ort`` (ONNX Runtime, CPU) ships with ppiped; ``trt`` (TensorRT) and ``torch`` (CUDA through
PyTorch, for GPU machines without TensorRT) import their libraries only when chosen, so ppiped
imports on machines without them. ``estimate`` has no session: see :mod:`.estimate`.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from ...errors import InputError

BACKENDS = ("ort", "trt", "torch", "estimate")
GPU_BACKENDS = ("trt", "torch")


class Session(Protocol):
    def timed(self, bs: int, n: int) -> float:
        """Seconds taken by ``n`` back-to-back inferences at batch size ``bs`` (device-side)."""

    def close(self) -> None: ...


class Runtime(Protocol):
    name: str

    def open(self, model_path: Path, max_batch: int) -> Session: ...

    def info(self) -> dict[str, Any]:
        """What the profile records about the machine: device, library version, resources."""


@dataclass(frozen=True)
class Timing:
    """trtexec-like: warm up for ``warmup_s``, then ``rounds`` rounds of at least ``round_s``.

    The result is the median over rounds of the mean per-inference time: the median discards
    rounds disturbed by other work on the machine, the mean within a round smooths jitter.
    """

    warmup_s: float = 0.05
    round_s: float = 0.02
    rounds: int = 7


class Measurement(NamedTuple):
    median_us: float
    dispersion: float  # interquartile range / median of the rounds


def dispersion(samples: Sequence[float]) -> float:
    """IQR / median: how far rounds disagree, robust to the odd round disturbed by other work
    (a max-min or standard-deviation figure would be that round's); 0 for fewer than 2 rounds."""
    if len(samples) < 2:
        return 0.0
    q1, med, q3 = np.percentile(np.asarray(samples, dtype=np.float64), [25, 50, 75])
    return float((q3 - q1) / med) if med > 0 else 0.0


def measure(session: Session, bs: int, timing: Timing) -> Measurement:
    """Warm up, then time ``timing.rounds`` rounds: their median per inference and dispersion."""
    t0 = time.perf_counter()
    per_run = session.timed(bs, 1)
    calls = 1
    while calls < 2 or time.perf_counter() - t0 < timing.warmup_s:
        per_run = session.timed(bs, 1)
        calls += 1
    n = max(1, int(timing.round_s / max(per_run, 1e-7)))
    samples = [session.timed(bs, n) / n for _ in range(max(1, timing.rounds))]
    return Measurement(statistics.median(samples) * 1e6, dispersion(samples))


def measure_us(session: Session, bs: int, timing: Timing) -> float:
    return measure(session, bs, timing).median_us


def make_runtime(name: str, split: int = 1, **opts: Any) -> Runtime:
    if name == "ort":
        from .ort import OrtRuntime

        return OrtRuntime(split=split, **opts)
    if name == "trt":
        from .trt import TrtRuntime

        return TrtRuntime(split=split, **opts)
    if name == "torch":
        from .torch_cuda import TorchRuntime

        return TorchRuntime(split=split, **opts)
    raise InputError(f"unknown timing backend {name!r} (choose from {', '.join(BACKENDS)})")
