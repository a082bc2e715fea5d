"""ONNX Runtime on CPU. A split ``v`` gets 1/v of the cores as intra-op threads, the CPU analogue
of an MPS share; the profiler runs the v copies together so they contend as vGPUs would.

A copy with one thread is timed by its CPU time, not the wall clock: on a shared machine the
wall clock also counts the time other processes held the core, which is not the block's cost,
while contention for caches and memory bandwidth still shows in CPU time. Several threads need
the wall clock (CPU time would add their times up).
"""

from __future__ import annotations

import os
import time
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort

from ...errors import InputError

_NP = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


def cpu_count() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


class OrtSession:
    def __init__(self, model_path: Path, threads: int, clock: str = "auto") -> None:
        if clock not in ("auto", "wall", "cpu"):
            raise InputError(f"unknown clock {clock!r} (auto, wall, cpu)")
        if clock == "cpu" and threads > 1:
            raise InputError("CPU-time clock needs one thread per copy")
        self.clock_name = "cpu" if clock == "cpu" or (clock == "auto" and threads == 1) else "wall"
        self.clock = time.process_time if self.clock_name == "cpu" else time.perf_counter
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        so.log_severity_level = 4  # errors reach the caller as exceptions, in its own words
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
        try:
            self.sess = ort.InferenceSession(str(model_path), so, providers=["CPUExecutionProvider"])
        except Exception as e:
            raise InputError(f"ONNX Runtime cannot load {model_path}: {e}") from None
        self.inputs = self.sess.get_inputs()
        self._feeds: dict[int, dict[str, np.ndarray]] = {}

    def feeds(self, bs: int) -> dict[str, np.ndarray]:
        if bs not in self._feeds:
            rng = np.random.default_rng(bs)
            self._feeds[bs] = {
                i.name: rng.standard_normal([bs, *[d if isinstance(d, int) else 1 for d in i.shape[1:]]])
                .astype(_NP.get(i.type, np.float32))
                for i in self.inputs
            }
        return self._feeds[bs]

    def timed(self, bs: int, n: int) -> float:
        feeds = self.feeds(bs)
        run, clock = self.sess.run, self.clock
        t0 = clock()
        for _ in range(n):
            run(None, feeds)
        return clock() - t0

    def close(self) -> None:
        self.sess = None  # type: ignore[assignment]


class OrtRuntime:
    name = "ort"

    def __init__(self, split: int = 1, threads: int | None = None, clock: str = "auto") -> None:
        total = threads or cpu_count()
        self.split = split
        self.threads = max(1, total // split)
        self.clock = clock
        self.clock_used = ""

    def open(self, model_path: Path, max_batch: int) -> OrtSession:
        sess = OrtSession(model_path, self.threads, self.clock)
        self.clock_used = sess.clock_name
        return sess

    def info(self) -> dict[str, Any]:
        return {"device": "CPU", "cpus": cpu_count(), "threads": self.threads, "clock": self.clock_used,
                "library": f"onnxruntime {ort.__version__}"}
