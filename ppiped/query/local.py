"""An app run by hand: its stages one after another in this process, with ONNX Runtime on whole
models — the root model on the frame, each edge's glue, the child model on every input the glue
made. It is the oracle the served outputs must equal (within the fp16 rounding at partition
boundaries), and it needs no daemon, plan or executor, so a test can trust it.

Glue is called exactly as the daemon's glue workers call it (:mod:`ppiped.query.glue`), through
the same code: each parent request's outputs are packed as an executor sends them (bytes and
``[dtype, shape, name]`` meta), the frame as the client's bytes, and :func:`~ppiped.query.glue.run_glue`
decodes both and calls ``fn(outputs, frame, spec)`` with the spec
:func:`~ppiped.query.glue.glue_spec` builds, checking the children against the contract. So a
glue that works served works by hand, and one that breaks the contract fails here too.
Requests are keyed as :meth:`ppiped.query.tracker.QueryTracker.outputs` keys them: the root ``()``,
the j-th input a glue made from request ``k`` is ``(*k, j)``.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError
from .app import App
from .glue import GlueError, GlueSpec, child_input, glue_spec, load_callable, pack_outputs, run_glue

MAX_CHILDREN = 256  # the daemon's default glue.max_children

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
    """The callable named ``module:function`` (as a glue worker imports it)."""
    try:
        return load_callable(ref)
    except (ImportError, AttributeError, TypeError) as e:
        raise InputError(f"glue {ref!r} cannot be loaded: {e}") from None


def onnx_input_spec(sess: Any) -> dict[str, Any] | None:
    """A session's first input as :meth:`ppiped.profiles.Profile.input_spec` gives it (None:
    not static after the batch axis, or not a tensor type numpy knows)."""
    inp = sess.get_inputs()[0]
    shape, dtype = inp.shape[1:], _ORT_TYPES.get(inp.type)
    if dtype is None or not all(isinstance(d, int) and d > 0 for d in shape):
        return None
    n = int(np.prod(shape, dtype=np.int64)) * np.dtype(dtype).itemsize
    return {"name": inp.name, "shape": list(shape), "dtype": np.dtype(dtype).name, "bytes": n}


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
    """An app with one ONNX Runtime session per stage, kept across :meth:`run` calls.

    ``inputs``: the stage models' inputs by model, as the daemon knows them (its profiles'
    :meth:`~ppiped.profiles.Profile.input_spec`); default: the ONNX models' own. They make the
    glue's spec. ``max_children``: as the daemon's ``glue.max_children``."""

    def __init__(self, app: App, models: Mapping[str, str | Path], threads: int = 1,
                 inputs: Mapping[str, Mapping[str, Any] | None] | None = None,
                 max_children: int = MAX_CHILDREN) -> None:
        import onnxruntime as ort

        missing = [s.model for s in app.stages if s.model not in models]
        if missing:
            raise InputError(f"app {app.name!r}: no model file for {', '.join(missing)}")
        so = ort.SessionOptions()
        so.log_severity_level = 4  # errors reach the caller as exceptions, in its own words
        so.intra_op_num_threads = threads
        self.app = app
        self.max_children = max_children
        self.sessions = {s.model: ort.InferenceSession(str(models[s.model]), so,
                                                       providers=["CPUExecutionProvider"])
                         for s in app.stages}
        if inputs is None:
            inputs = {m: onnx_input_spec(sess) for m, sess in self.sessions.items()}
        self.glue = {i: load_glue(s.glue) for i, s in enumerate(app.stages) if s.parent >= 0}
        self.specs: dict[int, GlueSpec] = {i: glue_spec(app, i, inputs) for i in self.glue}

    def infer(self, model: str, inputs: np.ndarray) -> dict[str, np.ndarray]:
        """The whole model on a batch (first axis) of inputs."""
        sess = self.sessions[model]
        inp = sess.get_inputs()[0]
        x = np.ascontiguousarray(inputs, dtype=_ORT_TYPES.get(inp.type))
        outs = sess.run(None, {inp.name: x})
        return {o.name: v for o, v in zip(sess.get_outputs(), outs, strict=True)}

    def call_glue(self, stage: int, outputs: Mapping[str, np.ndarray], frame: bytes) -> list[np.ndarray]:
        """Stage ``stage``'s glue on one parent request's outputs (by name, in model order) and
        the frame's bytes, as a glue worker runs it: the children as the child model's inputs.
        A contract breach raises :class:`GlueError` naming the stage (served: ``glue-error``)."""
        spec = self.specs[stage]
        data, meta = pack_outputs(outputs.items())
        try:
            made = run_glue(self.glue[stage], data, meta, frame, spec, self.max_children)
        except GlueError as e:
            raise GlueError(f"app {self.app.name!r}, stage {spec.stage!r}: {e}") from None
        return [child_input(b, spec) for b in made]

    def run(self, frame: np.ndarray, keep_all: bool = False) -> list[StageOutput]:
        """The query's results: every leaf stage request's outputs (every stage's with
        ``keep_all``), by stage order then key. A glue yielding nothing ends its branch."""
        app = self.app
        root = self.sessions[app.stages[0].model].get_inputs()[0]
        frame = np.ascontiguousarray(frame, dtype=_ORT_TYPES.get(root.type))  # as a client sends it
        raw = frame.tobytes()
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
                    kids.extend(((*k, j), x) for j, x in enumerate(self.call_glue(c, out, raw)))
        leaves = set(app.leaves())
        return [StageOutput(app.stages[i].name, k, i in leaves, out)
                for i in range(len(app.stages)) if keep_all or i in leaves
                for k, out in sorted(results[i], key=lambda r: r[0])]


def run_local(app: App, frame: np.ndarray, models: Mapping[str, str | Path],
              keep_all: bool = False) -> list[StageOutput]:
    """One query of ``app`` by hand (see :class:`LocalApp`)."""
    return LocalApp(app, models).run(frame, keep_all)
