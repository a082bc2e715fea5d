"""An app run by hand: its stages one after another in this process, with ONNX Runtime on whole
models — the root model on the frame, each edge's glue, the child model on every input the glue
made. It is the oracle the served outputs must equal (within the fp16 rounding at partition
boundaries), and it needs no daemon, plan or executor, so a test can trust it.

Glue is called as in :mod:`ppiped.query.example_glue`'s contract: ``fn(outputs, frame)`` with the
parent request's outputs as a dict name -> array (batch axis removed) and the frame as given.
Requests are keyed as :meth:`ppiped.query.tracker.QueryTracker.outputs` keys them: the root ``()``,
the j-th input a glue made from request ``k`` is ``(*k, j)``.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from .app import App

_ORT_TYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64,
              "tensor(uint8)": np.uint8, "tensor(int8)": np.int8, "tensor(int32)": np.int32,
              "tensor(int64)": np.int64}


@dataclass(frozen=True)
class StageOutput:
    """One stage request's result."""

    stage: str
    key: tuple[int, ...]
    final: bool  # a leaf stage's request: part of the query's answer
    outputs: dict[str, np.ndarray]  # by output name, in model order, batch axis removed


def load_glue(ref: str) -> Callable[..., Any]:
    """The callable named ``module:function``."""
    module, _, name = ref.partition(":")
    try:
        fn = getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError) as e:
        raise InputError(f"glue {ref!r} cannot be loaded: {e}") from None
    if not callable(fn):
        raise InputError(f"glue {ref!r} is a {type(fn).__name__}, not a callable")
    return fn


def model_paths(app: App, profiles_dir: str | Path) -> dict[str, Path]:
    """Each stage model's whole ONNX file, as its profile in ``profiles_dir`` records it."""
    from ..profiles import load_profile

    d = Path(profiles_dir)
    out = {}
    for s in app.stages:
        prof = d / f"{s.model}.json"
        rel = load_profile(prof).extra.get("onnx") if prof.exists() else None
        path = d / (rel or f"{s.model}/model.onnx")
        if not path.is_file():
            raise InputError(f"app {app.name!r}, stage {s.name!r}: no model file {path}")
        out[s.model] = path
    return out


class LocalApp:
    """An app with one ONNX Runtime session per stage, kept across :meth:`run` calls."""

    def __init__(self, app: App, models: Mapping[str, str | Path], threads: int = 1) -> None:
        import onnxruntime as ort

        missing = [s.model for s in app.stages if s.model not in models]
        if missing:
            raise InputError(f"app {app.name!r}: no model file for {', '.join(missing)}")
        so = ort.SessionOptions()
        so.log_severity_level = 3
        so.intra_op_num_threads = threads
        self.app = app
        self.sessions = {s.model: ort.InferenceSession(str(models[s.model]), so,
                                                       providers=["CPUExecutionProvider"])
                         for s in app.stages}
        self.glue = {i: load_glue(s.glue) for i, s in enumerate(app.stages) if s.parent >= 0}

    def infer(self, model: str, inputs: np.ndarray) -> dict[str, np.ndarray]:
        """The whole model on a batch (first axis) of inputs."""
        sess = self.sessions[model]
        inp = sess.get_inputs()[0]
        x = np.ascontiguousarray(inputs, dtype=_ORT_TYPES.get(inp.type))  # glue may give float64
        outs = sess.run(None, {inp.name: x})
        return {o.name: v for o, v in zip(sess.get_outputs(), outs, strict=True)}

    def run(self, frame: np.ndarray, keep_all: bool = False) -> list[StageOutput]:
        """The query's results: every leaf stage request's outputs (every stage's with
        ``keep_all``), by stage order then key. A glue yielding nothing ends its branch."""
        app = self.app
        frame = np.asarray(frame)
        results: dict[int, list[tuple[tuple[int, ...], dict[str, np.ndarray]]]] = {}
        todo: dict[int, list[tuple[tuple[int, ...], np.ndarray]]] = {0: [((), frame)]}
        for i, s in enumerate(app.stages):  # a parent is listed before its children
            reqs = todo.pop(i, [])
            if not reqs:
                results[i] = []
                continue
            batch = self.infer(s.model, np.stack([x for _, x in reqs]))
            results[i] = [(k, {n: v[j] for n, v in batch.items()}) for j, (k, _) in enumerate(reqs)]
            for c in app.children(i):
                kids = todo.setdefault(c, [])
                for k, out in results[i]:
                    made = self.glue[c](out, frame)
                    kids.extend(((*k, j), np.asarray(x)) for j, x in enumerate(made))
        leaves = set(app.leaves())
        return [StageOutput(app.stages[i].name, k, i in leaves, out)
                for i in range(len(app.stages)) if keep_all or i in leaves
                for k, out in sorted(results[i], key=lambda r: r[0])]


def run_local(app: App, frame: np.ndarray, models: Mapping[str, str | Path],
              keep_all: bool = False) -> list[StageOutput]:
    """One query of ``app`` by hand (see :class:`LocalApp`)."""
    return LocalApp(app, models).run(frame, keep_all)
