"""Partition models at the executor: fp16 boundaries, batching frames into tensors and back.

Feature maps cross the network as fp16 (half the bytes of fp32, as the profiles assume). Rather
than casting in Python, the executor rewrites the partition's ONNX graph once at load time: a
Cast to fp16 after a float boundary output and a Cast from fp16 before a float boundary input.
ONNX Runtime then casts in its own kernels and TensorRT on the GPU, with one code path for both.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper

from ..errors import InputError
from ..wire import brief

_FLOATS = (TensorProto.FLOAT, TensorProto.DOUBLE, TensorProto.BFLOAT16)
FP16_SUFFIX = "__fp16"


@dataclass
class TensorSpec:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]  # per sample, without the batch axis

    @property
    def sample_bytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize

    def meta(self, batch: int | None = None) -> list:
        shape = list(self.shape) if batch is None else [batch, *self.shape]
        return [self.dtype.str, shape, self.name]


def _elem_type(vi: onnx.ValueInfoProto) -> int:
    return vi.type.tensor_type.elem_type


def _sample_shape(vi: onnx.ValueInfoProto, where: str) -> tuple[int, ...]:
    dims = vi.type.tensor_type.shape.dim
    if not dims:
        raise InputError(f"{where}: tensor {vi.name!r} has no shape")
    out = []
    for d in list(dims)[1:]:
        if not d.HasField("dim_value") or d.dim_value <= 0:
            raise InputError(f"{where}: tensor {vi.name!r} needs static dimensions after the batch "
                             f"axis, got {d.dim_param or '?'}")
        out.append(int(d.dim_value))
    return tuple(out)


def fp16_boundaries(model: onnx.ModelProto, cast_input: bool, cast_outputs: bool) -> onnx.ModelProto:
    """Return a copy whose float input (if ``cast_input``) and float outputs (if ``cast_outputs``) are fp16."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    init_names = {t.name for t in g.initializer}
    if cast_input:
        for vi in g.input:
            if vi.name in init_names or _elem_type(vi) not in _FLOATS:
                continue
            orig, orig_type = vi.name, _elem_type(vi)
            new = orig + FP16_SUFFIX
            vi.name = new
            vi.type.tensor_type.elem_type = TensorProto.FLOAT16
            g.node.insert(0, helper.make_node("Cast", [new], [orig], name=f"ppiped_cast_in_{orig}",
                                              to=orig_type))
    if cast_outputs:
        for vo in g.output:
            if _elem_type(vo) not in _FLOATS:
                continue
            orig = vo.name
            new = orig + FP16_SUFFIX
            g.node.append(helper.make_node("Cast", [orig], [new], name=f"ppiped_cast_out_{orig}",
                                           to=TensorProto.FLOAT16))
            vo.name = new
            vo.type.tensor_type.elem_type = TensorProto.FLOAT16
    return m


@dataclass
class PartitionModel:
    """A partition ready to load: serialized ONNX with fp16 boundaries and its tensor specs."""

    onnx_bytes: bytes
    inputs: list[TensorSpec]  # the first partition: the model's image input; later ones: a cut's tensors
    outputs: list[TensorSpec]
    source: str

    @property
    def input(self) -> TensorSpec:
        """The first input (the only one of a first partition)."""
        return self.inputs[0]


def load_model_file(path: Path) -> onnx.ModelProto:
    try:
        return onnx.load(str(path))
    except FileNotFoundError:
        raise InputError(f"{path}: partition model does not exist") from None
    except Exception as e:  # protobuf decode errors have no common base
        raise InputError(f"{path}: not an ONNX model: {e}") from None


def prepare_partition(model: onnx.ModelProto, source: str, first: bool, last: bool) -> PartitionModel:
    """Check a partition's graph; non-first partitions take fp16, non-last ones emit fp16.

    A first partition takes the model's one input; a later one takes every tensor of the cut
    before it, and a non-last one emits every tensor of the cut after it (``ppiped profile
    --max-cut-tensors``). Sub-models exported by ``ppiped profile`` already have fp16 boundaries;
    then nothing changes.
    """
    init_names = {t.name for t in model.graph.initializer}
    inputs = [vi for vi in model.graph.input if vi.name not in init_names]
    if not inputs or (first and len(inputs) != 1):
        raise InputError(f"{source}: a {'first ' if first else ''}partition takes "
                         f"{'exactly one input tensor' if first else 'at least one input tensor'}, "
                         f"this one takes {[vi.name for vi in inputs]}")
    if not model.graph.output:
        raise InputError(f"{source}: the partition has no output")
    model = fp16_boundaries(model, cast_input=not first, cast_outputs=not last)
    g = model.graph
    ins = [TensorSpec(vi.name, np.dtype(helper.tensor_dtype_to_np_dtype(_elem_type(vi))),
                      _sample_shape(vi, source)) for vi in g.input if vi.name not in init_names]
    outs = [TensorSpec(vo.name, np.dtype(helper.tensor_dtype_to_np_dtype(_elem_type(vo))),
                       _sample_shape(vo, source)) for vo in g.output]
    return PartitionModel(model.SerializeToString(), ins, outs, source)


def frames_to_batch(frames: list, spec: TensorSpec) -> tuple[np.ndarray | None, list[int], list[int]]:
    """Stack per-request frames into one input batch; returns (batch, kept indices, bad indices)."""
    want = spec.sample_bytes
    kept, bad, bufs = [], [], []
    for i, f in enumerate(frames):
        b = getattr(f, "buffer", f)
        if len(b) == want:
            kept.append(i)
            bufs.append(b)
        else:
            bad.append(i)
    if not kept:
        return None, kept, bad
    arr = np.frombuffer(b"".join(bufs), dtype=spec.dtype).reshape(len(kept), *spec.shape)
    return arr, kept, bad


def feeds_from_frames(frames: list, meta, specs: list[TensorSpec], n: int) -> dict[str, np.ndarray] | str:
    """A later hop's inputs, one per tensor of the cut, from the previous hop's frames and their
    ``[dtype, shape, name]`` metas, in order (a cut's tensors leave one partition and enter the
    next in the same order; names may differ, e.g. for a tensor passed through); checked against
    this partition's specs, so a malformed forward becomes an error text, never an exception."""
    if not isinstance(meta, list) or len(meta) != len(frames) or len(meta) != len(specs):
        got = len(meta) if isinstance(meta, list) else "no"
        return (f"the previous hop sent {len(frames)} frame(s) with {got} tensor spec(s), this "
                f"partition takes {len(specs)} tensor(s)")
    feeds: dict[str, np.ndarray] = {}
    for k, spec in enumerate(specs):
        try:
            # the dtype is compared as text, never parsed: np.dtype() runs a parser of its own
            # on peer strings (',' raised SyntaxError, past the except below)
            dtype, shape = meta[k][0], tuple(int(d) for d in meta[k][1])
        except (TypeError, ValueError, IndexError, KeyError, OverflowError):
            return f"malformed tensor spec for {spec.name} from the previous hop"
        if dtype not in (spec.dtype.str, spec.dtype.name) or shape != (n, *spec.shape):
            return (f"tensor {spec.name}: the previous hop sent {brief(dtype)} {brief(list(shape))}, this "
                    f"partition takes {spec.dtype} {[n, *spec.shape]}")
        buf = getattr(frames[k], "buffer", frames[k])
        if len(buf) != n * spec.sample_bytes:
            return f"tensor {spec.name}: {len(buf)} bytes, {list(shape)} {spec.dtype} needs {n * spec.sample_bytes}"
        feeds[spec.name] = np.frombuffer(buf, dtype=spec.dtype).reshape(shape)
    return feeds


def split_results(outputs: list[np.ndarray], n: int) -> list[bytes]:
    """One frame per request: its slice of every output, concatenated in output order."""
    if len(outputs) == 1:
        o = np.ascontiguousarray(outputs[0])
        return [o[i].tobytes() for i in range(n)]
    return [b"".join(np.ascontiguousarray(o[i]).tobytes() for o in outputs) for i in range(n)]
