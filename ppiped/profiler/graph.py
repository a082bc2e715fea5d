"""Graph analysis of an ONNX CNN: topological order, valid cut points, per-layer cost.

A cut between two layers is *valid* when at most K activation tensors cross it (K = 1 is PPipe's
rule, §5.1: one feature map sent between GPUs). Skip connections (FPN necks, YOLO heads, residual
stages) keep two to four tensors live over long spans, which with K = 1 leaves one uncuttable span
holding most of the model; the default K = 4 lets such models split, each crossing tensor sent as
fp16 and the boundary's bytes their sum. Weights and tensors computed from weights alone never
cross; each side keeps its own copy. A graph output must come out of the last block, so no cut
lies where one is already computed.
"""

from __future__ import annotations

import contextlib
import copy
import os
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper, shape_inference

from ..errors import InputError

BATCH_DIM = "batch"
# Operator domains whose operators ONNX Runtime and TensorRT both know.
STANDARD_DOMAINS = {"", "ai.onnx"}
# Control flow hides layers inside attributes; a cut through it is meaningless.
CONTROL_FLOW = {"If", "Loop", "Scan", "SequenceMap"}
# Operators a GPU library fuses into the preceding convolution / GEMM (no launch of their own).
ELEMENTWISE = {
    "Relu", "LeakyRelu", "Sigmoid", "HardSigmoid", "HardSwish", "Tanh", "Clip", "Elu", "Selu",
    "Mul", "Add", "Sub", "Div", "BatchNormalization", "Identity", "Cast", "Erf", "Gelu",
    "PRelu", "Softplus", "Mish", "Neg", "Sqrt", "Pow", "Exp", "Log", "Abs", "Dropout",
}
# Tensors a cut may carry: feature maps (sent as fp16). Masks and indices stay inside a block.
FEATURE_TYPES = {TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE, TensorProto.BFLOAT16}
# Input element types a profile can feed (calibration and timing inputs are floats).
INPUT_TYPES = {TensorProto.FLOAT: "float32", TensorProto.FLOAT16: "float16", TensorProto.DOUBLE: "float64"}
MAX_EXTERNAL_BYTES = 2**31 - 2**24
"""Most bytes of external data a model may bring: the profiler inlines it, and protobuf holds
no message past 2 GiB."""
MAX_TENSOR_ELEMENTS = 2**30
"""Most elements one sample's tensor may hold anywhere in the model (inferred shapes)."""
MAX_INPUT_ELEMENTS = 2**28
"""Most elements one input sample may hold (1 GiB of float32): timing and the equivalence check
allocate whole batches of it, so a larger ask (``--input-shape 3x100000x100000`` wanted 447 GiB)
only ends in an allocation failure deep inside ONNX Runtime."""
# Ops whose outputs depend only on their inputs' shapes, and ops that must never be folded.
SHAPE_READS = {"Shape", "Size"}
RANDOM_OPS = {"RandomNormal", "RandomUniform", "RandomNormalLike", "RandomUniformLike", "Multinomial",
              "Bernoulli"}
MAX_FOLDED_ELEMENTS = 4096
RESHAPES = {"Flatten", "Reshape", "Squeeze", "Unsqueeze", "Transpose", "Shape", "Gather",
            "Concat", "Slice", "Split", "Constant", "ConstantOfShape", "Expand", "Tile"}


@dataclass
class Layer:
    """One ONNX node with its cost at batch size 1 (FLOPs and bytes moved, fp32 elements x 4)."""

    index: int
    name: str
    op: str
    inputs: list[str]
    outputs: list[str]
    flops: float = 0.0
    act_bytes: float = 0.0  # activations read and written
    weight_bytes: float = 0.0
    out_elems: float = 0.0
    fusable: bool = False


# Above this, a "cut" is no longer a narrow boundary worth a network hop.
MAX_CUT_TENSORS_LIMIT = 16
# Tensors a cut may carry by default (``ppiped profile --max-cut-tensors``; 1 is PPipe's rule).
DEFAULT_MAX_CUT_TENSORS = 4


@dataclass
class Cut:
    """A valid cut after layer ``after``: ``tensors`` cross it, in the order they were produced."""

    after: int
    tensors: tuple[str, ...]
    elems: tuple[int, ...]  # per tensor, elements at batch size 1
    dtypes: tuple[int, ...]  # per tensor, onnx TensorProto elem type

    @property
    def fp16_bytes(self) -> int:
        """Bytes on the wire at batch size 1: float feature maps travel as fp16."""
        total = 0
        for n, dt in zip(self.elems, self.dtypes, strict=True):
            if dt in (TensorProto.FLOAT, TensorProto.FLOAT16, TensorProto.DOUBLE):
                total += 2 * n
            else:
                total += n * helper.tensor_dtype_to_np_dtype(dt).itemsize
        return total


@dataclass
class ModelGraph:
    """An ONNX model with a symbolic batch axis, its layers in topological order and its cuts."""

    model: onnx.ModelProto  # shape-inferred, batch axis named BATCH_DIM
    layers: list[Layer]
    cuts: list[Cut]  # valid cuts in layer order
    input_name: str
    input_shape: tuple[int, ...]  # without the batch axis
    output_names: list[str]
    shapes: dict[str, tuple[int, ...]] = field(repr=False)  # at batch size 1
    dtypes: dict[str, int] = field(repr=False)
    blocked: str = ""  # why positions between layers are not valid cuts (the most common reason)

    @property
    def total_flops(self) -> float:
        return float(sum(layer.flops for layer in self.layers))

    def cut_at(self, after: int) -> Cut:
        for c in self.cuts:
            if c.after == after:
                return c
        raise KeyError(after)


def _dims(vi: onnx.ValueInfoProto) -> list[int | str | None]:
    out: list[int | str | None] = []
    for d in vi.type.tensor_type.shape.dim:
        if d.HasField("dim_value"):
            out.append(int(d.dim_value))
        elif d.HasField("dim_param"):
            out.append(d.dim_param)
        else:
            out.append(None)
    return out


def parse_shape(text: str) -> tuple[int, ...]:
    """``3x224x224`` -> (3, 224, 224): the per-sample input shape the user fixes."""
    try:
        dims = tuple(int(x) for x in text.lower().replace(",", "x").split("x") if x)
    except ValueError:
        raise InputError(f"bad --input-shape {text!r}: expected e.g. 3x224x224") from None
    if not dims or min(dims) < 1:
        raise InputError(f"bad --input-shape {text!r}: expected positive dimensions like 3x224x224")
    _check_input_size(dims, f"--input-shape {text}")
    return dims


def _check_input_size(dims, what: str) -> None:
    n = 1
    for d in dims:
        n *= int(d)
    if n > MAX_INPUT_ELEMENTS:
        raise InputError(f"{what}: {n:,} elements per sample, more than the {MAX_INPUT_ELEMENTS:,} "
                         "(1 GiB of float32) a profiled input may hold (every timed batch and the "
                         "equivalence check allocate whole batches of it)")


def ort_session(source, what: str):
    """An ONNX Runtime CPU session, or an :class:`InputError` naming ``what`` and ORT's reason
    (an opset it does not know, a malformed graph) instead of ORT's traceback."""
    import onnxruntime as ort

    ort.set_default_logger_severity(4)  # (its own log, before the session's applies, printed
    # allocator errors on stderr beside ppiped's one line)
    so = ort.SessionOptions()
    so.log_severity_level = 4  # errors reach the caller as exceptions, in its own words
    try:
        return ort.InferenceSession(source, so, providers=["CPUExecutionProvider"])
    except Exception as e:
        raise InputError(f"ONNX Runtime cannot load {what}: {_ort_reason(e)}") from None


def ort_run(sess, feeds: dict, what: str, outputs=None) -> list:
    """``sess.run`` with ORT's failures (a shape it rejects, an allocation failure) as one
    :class:`InputError` naming ``what``."""
    try:
        return sess.run(outputs, feeds)
    except Exception as e:
        raise InputError(f"ONNX Runtime cannot run {what}: {_ort_reason(e)}") from None


def _ort_reason(e: Exception) -> str:
    """ORT's message without its source-file prefix, on one line."""
    text = " ".join(str(e).split())
    for marker in ("Status Message:", "ONNX Runtime only"):
        k = text.find(marker)
        if k >= 0:
            text = text[k:].removeprefix("Status Message:").strip()
            break
    return text[:400]


def load_onnx(path: str | Path) -> onnx.ModelProto:
    path = Path(path)
    if path.is_dir():
        raise InputError(f"{path}: is a directory, not an ONNX file")
    if not path.is_file():
        raise InputError(f"{path}: no such ONNX file")
    try:
        m = onnx.load(str(path), load_external_data=False)
    except Exception as e:  # onnx raises DecodeError and friends
        raise InputError(f"{path}: not a readable ONNX model ({type(e).__name__}: {e})") from None
    _load_external_data(m, path)
    if not m.graph.node and not m.graph.input:  # protobuf reads an empty or foreign file as {}
        raise InputError(f"{path}: not a valid ONNX model (no graph: empty or not an ONNX file)")
    if not m.graph.output:
        raise InputError(f"{path}: the model has no outputs, so there is nothing to serve")
    return m


def _load_external_data(m: onnx.ModelProto, path: Path) -> None:
    """Read the tensors ``m`` keeps in external files, after ppiped's own checks: each file a
    regular file inside the model's folder once symlinks are resolved (onnx 1.15, which the
    dependency range admits, read a symlink to /etc/passwd into a weight), and all of them
    together within MAX_EXTERNAL_BYTES (a 225-byte model naming an 8 GB sparse file took 16 GB
    of memory, then crashed in onnx: the profiler works on an inlined copy, which protobuf
    cannot hold past 2 GiB anyway)."""
    from onnx.external_data_helper import ExternalDataInfo, uses_external_data

    base = path.resolve().parent
    total = 0
    ext = [t for t in _all_tensors(m.graph) if uses_external_data(t)]
    for t in ext:
        info = ExternalDataInfo(t)
        loc = info.location or ""
        f = None if not loc or "\0" in loc or os.path.isabs(loc) else (base / loc).resolve()
        if f is None or not f.is_relative_to(base) or not f.is_file():
            raise InputError(f"{path}: tensor {t.name!r} keeps its data in {loc!r}, which is not a file in "
                             f"the model's folder {base}")
        size = f.stat().st_size - (info.offset or 0)
        if (info.length or 0) > size or size < 0:
            raise InputError(f"{path}: tensor {t.name!r} claims {info.length} bytes at offset {info.offset or 0} of "
                             f"{loc!r}, which holds {f.stat().st_size}")
        total += info.length if info.length else size
        if total > MAX_EXTERNAL_BYTES:
            raise InputError(f"{path}: external data of {total / 2**30:.1f} GiB or more (tensor {t.name!r} in "
                             f"{loc!r}): ppiped profiles models of less than 2 GiB")
    if ext:
        from onnx.external_data_helper import load_external_data_for_model

        try:
            load_external_data_for_model(m, str(base))
        except Exception as e:  # noqa: BLE001 - onnx's own checks, in its words
            raise InputError(f"{path}: cannot read its external data ({type(e).__name__}: {e})") from None


def _all_tensors(g: onnx.GraphProto):
    """Every tensor a graph holds: initializers and node attributes, subgraphs included."""
    yield from g.initializer
    for sp in g.sparse_initializer:
        yield sp.values
        yield sp.indices
    for n in g.node:
        for a in n.attribute:
            if a.HasField("t"):
                yield a.t
            yield from a.tensors
            if a.HasField("g"):
                yield from _all_tensors(a.g)
            for sub in a.graphs:
                yield from _all_tensors(sub)


def _check_ops(graph: onnx.GraphProto) -> None:
    for i, n in enumerate(graph.node):
        where = f"node {i} ({n.name or n.op_type})"
        if n.domain not in STANDARD_DOMAINS:
            raise InputError(f"unsupported operator {n.domain}::{n.op_type} at {where}: "
                             "only standard ONNX operators (domain ai.onnx) can be partitioned")
        if n.op_type in CONTROL_FLOW:
            raise InputError(f"unsupported operator {n.op_type} at {where}: control flow "
                             "cannot be partitioned; export the model without it")


def fix_batch_axis(model: onnx.ModelProto, input_shape: tuple[int, ...] | None = None) -> onnx.ModelProto:
    """Return a copy whose single input is [batch, *fixed dims] and whose outputs have a batch axis.

    Non-batch axes must be fixed (or fixed by ``input_shape``): block latencies and boundary bytes
    are only defined for one input resolution.
    """
    m = copy.deepcopy(model)
    inits = {t.name for t in m.graph.initializer}
    inputs = [i for i in m.graph.input if i.name not in inits]
    if len(inputs) != 1:
        names = ", ".join(i.name for i in inputs)
        raise InputError(f"the model has {len(inputs)} inputs ({names}); ppiped profiles CNNs with one image input")
    inp = inputs[0]
    dims = _dims(inp)
    if not dims:
        raise InputError(f"input {inp.name!r} has no shape; fix it with --input-shape, e.g. 3x224x224")
    if inp.type.tensor_type.elem_type not in INPUT_TYPES:
        name = TensorProto.DataType.Name(inp.type.tensor_type.elem_type).lower()
        raise InputError(f"input {inp.name!r} is {name}, not a float: ppiped profiles models whose "
                         f"input is one of {', '.join(INPUT_TYPES.values())}")
    rest = dims[1:]
    if input_shape is not None:
        if len(input_shape) != len(rest):
            raise InputError(f"--input-shape has {len(input_shape)} dims but input {inp.name!r} has "
                             f"{len(rest)} besides the batch axis")
        rest = list(input_shape)
    for ax, d in enumerate(rest, start=1):
        if not isinstance(d, int):
            raise InputError(f"input {inp.name!r} has dynamic dimension {d!r} at axis {ax}; "
                             "fix it with --input-shape, e.g. 3x224x224")
        if d < 1:
            raise InputError(f"input {inp.name!r} has size {d} at axis {ax}: a sample holds no data; "
                             "fix it with --input-shape, e.g. 3x224x224")
    _check_input_size(rest, f"input {inp.name!r} of shape {rest}")
    shape = inp.type.tensor_type.shape
    del shape.dim[:]
    shape.dim.add().dim_param = BATCH_DIM
    for d in rest:
        shape.dim.add().dim_value = int(d)
    for out in m.graph.output:
        od = out.type.tensor_type.shape.dim
        if len(od):
            od[0].Clear()
            od[0].dim_param = BATCH_DIM
    del m.graph.value_info[:]
    return m


def fold_constant_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """Turn ``Constant`` nodes into initializers, in place: exporters of some frameworks store
    every weight that way, and a weight must never look like a layer (a cut point of its own,
    an empty block) or be left behind by a block that needs it."""
    g = model.graph
    keep = []
    for n in g.node:
        if n.op_type != "Constant" or n.domain not in ("", "ai.onnx") or len(n.output) != 1:
            keep.append(n)
            continue
        a = {x.name: x for x in n.attribute}
        if "value" in a:
            t = onnx.TensorProto()
            t.CopyFrom(a["value"].t)
        elif "value_float" in a:
            t = numpy_helper.from_array(np.array(a["value_float"].f, dtype=np.float32))
        elif "value_floats" in a:
            t = numpy_helper.from_array(np.array(list(a["value_floats"].floats), dtype=np.float32))
        elif "value_int" in a:
            t = numpy_helper.from_array(np.array(a["value_int"].i, dtype=np.int64))
        elif "value_ints" in a:
            t = numpy_helper.from_array(np.array(list(a["value_ints"].ints), dtype=np.int64))
        else:  # sparse or string constants: left as nodes
            keep.append(n)
            continue
        t.name = n.output[0]
        g.initializer.append(t)
    if len(keep) != len(g.node):
        del g.node[:]
        g.node.extend(keep)
    return model


def fold_static_shapes(model: onnx.ModelProto, batched: bool = True, max_batch: int = 2) -> onnx.ModelProto:
    """In place: values computed from tensor shapes alone (``Shape``/``Size`` and arithmetic on
    them, with weights) that are equal at batch sizes 1, 2, 3, 4 and ``max_batch`` (those up to
    ``max_batch``: the sizes a plan may run) become initializers, and the nodes that made them go.
    Equal at 1 and 2 alone is not enough: ``N // 4`` is 0 at both.

    Why: exporters read sizes at the top of a forward pass (torch's ``x.shape[-2:]`` for a
    segmentation head's final Resize). Left as nodes, two int64 scalars, or the input itself,
    stay live across every cut: torchvision's DeepLabV3 had no valid cut, and LR-ASPP sent the
    input image along with every feature map. A size that follows the batch stays a node.
    ``batched=False``: the model runs at batch size 1 only, and every size is fixed."""
    g = model.graph
    inits = {t.name for t in g.initializer}
    derived: set[str] = set()
    for n in g.node:
        ins = [t for t in n.input if t]
        if n.op_type in RANDOM_OPS:
            continue
        if n.op_type in SHAPE_READS or (any(t in derived for t in ins)
                                        and all(t in derived or t in inits for t in ins)):
            derived.update(t for t in n.output if t)
    if not derived:
        return model
    names = sorted(derived - {o.name for o in g.output})
    sizes = sorted({b for b in (2, 3, 4, max_batch) if 2 <= b <= max(2, max_batch)}) if batched else []
    try:
        at1 = _run_for(model, names, batch=1)
        others = [_run_for(model, names, batch=b, seed=b - 1) for b in sizes]
    except InputError:
        return model  # the analysis that follows says why the model does not run
    fixed = {t for t in names if at1[t].size <= MAX_FOLDED_ELEMENTS
             and all(at[t].shape == at1[t].shape and np.array_equal(at[t], at1[t]) for at in others)}
    used = {t for n in g.node for t in n.input} | {o.name for o in g.output}
    keep, folded = [], []
    for n in g.node:
        outs = [t for t in n.output if t]
        if outs and all(t in derived for t in outs) and all(t in fixed or t not in used for t in outs):
            folded += [t for t in outs if t in fixed]
            continue
        keep.append(n)
    if not folded:
        return model
    for t in folded:
        g.initializer.append(numpy_helper.from_array(at1[t], t))
    while True:  # the shape reads no longer used, and what only they fed
        used = {t for n in keep for t in n.input} | {o.name for o in g.output}
        live = [n for n in keep if not all(t in derived for t in n.output if t)
                or any(t in used for t in n.output)]
        if len(live) == len(keep):
            break
        keep = live
    del g.node[:]
    g.node.extend(keep)
    return model


def _infer(model: onnx.ModelProto) -> onnx.ModelProto:
    try:
        return shape_inference.infer_shapes(model, data_prop=True)
    except Exception as e:
        raise InputError(f"ONNX shape inference failed: {e}") from None


def _numel(dims: tuple[int, ...]) -> int:
    return int(np.prod(dims, dtype=np.int64)) if dims else 1


def _layer_cost(layer: Layer, shapes: dict[str, tuple[int, ...]], consts: set[str],
                inits: dict[str, onnx.TensorProto], attrs: dict) -> None:
    """Fill FLOPs and bytes of one layer at batch size 1 (the estimate backend scales by batch)."""
    ins = [t for t in layer.inputs if t]
    acts = [t for t in ins if t not in consts]
    out_elems = sum(_numel(shapes.get(t, ())) for t in layer.outputs if t)
    in_elems = sum(_numel(shapes.get(t, ())) for t in acts)
    layer.out_elems = float(out_elems)
    layer.act_bytes = 4.0 * (in_elems + out_elems)
    layer.weight_bytes = 4.0 * sum(_numel(tuple(inits[t].dims)) for t in ins if t in inits)
    op = layer.op
    if op in ("Conv", "ConvTranspose") and len(ins) >= 2 and ins[1] in shapes:
        w = shapes[ins[1]]  # (Cout, Cin/group, kh, kw...) ; ConvTranspose: (Cin, Cout/group, ...)
        per_out = _numel(w[1:]) if op == "Conv" else _numel(w[2:]) * w[0] // max(1, attrs.get("group", 1))
        layer.flops = 2.0 * out_elems * per_out
    elif op in ("Gemm", "MatMul") and len(ins) >= 2:
        a = shapes.get(ins[0], ())
        k = a[-1] if a else 1
        if op == "Gemm" and attrs.get("transA", 0) and len(a) == 2:
            k = a[0]
        layer.flops = 2.0 * out_elems * k
    elif op in ("MaxPool", "AveragePool", "LpPool"):
        k = attrs.get("kernel_shape", [1])
        layer.flops = float(out_elems * _numel(tuple(k)))
    elif op in ("GlobalAveragePool", "GlobalMaxPool", "ReduceMean", "ReduceSum", "ReduceMax"):
        layer.flops = float(in_elems)
    elif op in ("Softmax", "LogSoftmax", "LRN", "InstanceNormalization", "LayerNormalization"):
        layer.flops = 5.0 * out_elems
    elif op in RESHAPES:
        layer.flops = 0.0
    else:
        layer.flops = float(out_elems) * (2.0 if op == "BatchNormalization" else 1.0)
    layer.fusable = op in ELEMENTWISE


def analyze(model: onnx.ModelProto, input_shape: tuple[int, ...] | None = None,
            max_cut_tensors: int = DEFAULT_MAX_CUT_TENSORS, batched: bool = True,
            max_batch: int = 2) -> ModelGraph:
    """Fix the batch axis, infer shapes, list layers and the valid cuts (at most
    ``max_cut_tensors`` tensors crossing) between them. ``batched=False`` (only batch size 1
    is profiled) takes batch-1 shapes as they are, for a model that fixes its batch inside;
    ``max_batch``: the largest batch size profiled (sizes up to it must not change a folded value)."""
    if not 1 <= max_cut_tensors <= MAX_CUT_TENSORS_LIMIT:
        raise InputError(f"--max-cut-tensors must be 1..{MAX_CUT_TENSORS_LIMIT}, got {max_cut_tensors}")
    try:
        return _analyze(model, input_shape, max_cut_tensors, batched, max_batch)
    except InputError as e:
        # a model exported for a fixed batch of 8 runs at any batch size once axis 0 is named;
        # one with no batch axis at all fails somewhere later, for a reason that hides this one
        inputs = [i for i in model.graph.input if i.name not in {t.name for t in model.graph.initializer}]
        first = _dims(inputs[0])[:1] if len(inputs) == 1 else []
        if first and isinstance(first[0], int) and first[0] > 1:
            raise InputError(f"{e} (note: input {inputs[0].name!r} has its first axis fixed at {first[0]}, "
                             "taken here as the batch axis; a model without a batch axis must be exported "
                             "with one first)") from None
        raise


def _analyze(model: onnx.ModelProto, input_shape: tuple[int, ...] | None, max_cut_tensors: int,
             batched: bool, max_batch: int) -> ModelGraph:
    _check_ops(model.graph)
    m = _infer(fold_static_shapes(fold_constant_nodes(fix_batch_axis(model, input_shape)), batched, max_batch))
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    inp = next(i for i in g.input if i.name not in inits)
    # Shapes at batch size 1, from a copy whose batch axis is 1.
    one = copy.deepcopy(m)
    for vi in list(one.graph.input) + list(one.graph.output):
        dims = vi.type.tensor_type.shape.dim
        if len(dims) and dims[0].dim_param == BATCH_DIM:
            dims[0].Clear()
            dims[0].dim_value = 1
    del one.graph.value_info[:]
    one = _infer(one)
    shapes: dict[str, tuple[int, ...]] = {}
    dtypes: dict[str, int] = {}
    unknown: list[str] = []
    for vi in list(one.graph.input) + list(one.graph.value_info) + list(one.graph.output):
        dims = _dims(vi)
        dtypes[vi.name] = vi.type.tensor_type.elem_type
        if vi.type.tensor_type.HasField("shape") and all(isinstance(d, int) for d in dims):
            shapes[vi.name] = tuple(int(d) for d in dims)  # type: ignore[arg-type]
    for name, dims in shapes.items():  # before anything runs: a 249-byte Expand asked for 12 GB
        n = int(np.prod(dims, dtype=object)) if dims else 1
        if n > MAX_TENSOR_ELEMENTS:
            raise InputError(f"tensor {name!r} holds {n:,} elements per sample (shape {list(dims)}), more than "
                             f"the {MAX_TENSOR_ELEMENTS:,} (4 GiB of float32) a profiled tensor may hold")
    for t in inits.values():
        shapes[t.name] = tuple(t.dims)
        dtypes[t.name] = t.data_type

    # Constant tensors: initializers and everything computed from them alone.
    consts: set[str] = set(inits)
    for n in g.node:
        if all((t in consts) for t in n.input if t):
            consts.update(t for t in n.output if t)
    for n in g.node:
        for t in n.output:
            if t and t not in consts and t not in shapes:
                unknown.append(t)
    if unknown:
        shapes.update(_shapes_by_running(one, unknown))
    batched, at2 = _batched_tensors(m, shapes, dtypes, consts, run=batched)
    for o in g.output:
        if o.name not in batched:
            dims = _dims(o)
            two = at2.get(o.name)
            if two is not None and shapes.get(o.name, (0,))[:1] == (1,) and two[:1] != (2,):
                raise InputError(
                    f"output {o.name!r} does not follow the batch axis (shape {list(shapes[o.name])} at "
                    f"batch size 1, {list(two)} at 2): the model fixes its batch size inside (e.g. a "
                    "Reshape to [1, -1]); export it with a dynamic batch axis, or profile with --batch-sizes 1")
            raise InputError(
                f"output {o.name!r} has no fixed size per request (shape {dims}, its size depends on "
                "the input's content or could not be determined): ppiped serves outputs of a fixed "
                "shape; if it follows the input's size, fix that with --input-shape, otherwise export "
                "the model with a fixed-size output (e.g. padded to a maximum number of detections)")
    layers = [
        Layer(i, n.name or f"{n.op_type}_{i}", n.op_type, list(n.input), list(n.output))
        for i, n in enumerate(g.node)
    ]
    _check_topological(g, inits)
    for layer, n in zip(layers, g.node, strict=True):
        attrs = {a.name: helper.get_attribute_value(a) for a in n.attribute}
        _layer_cost(layer, shapes, consts, inits, attrs)
    crossable = {t for t in batched if dtypes.get(t) in FEATURE_TYPES}
    why: dict[str, int] = {}
    cuts = _valid_cuts(g, consts, shapes, dtypes, max_cut_tensors, crossable, why)
    blocked = ""
    if why:
        reason, count = max(why.items(), key=lambda kv: kv[1])
        blocked = f"{reason} at {count} of {len(g.node) - 1} positions between layers"
    return ModelGraph(m, layers, cuts, inp.name, tuple(shapes[inp.name][1:]),
                      [o.name for o in g.output], shapes, dtypes, blocked)


def _check_topological(g: onnx.GraphProto, inits: dict) -> None:
    seen = {i.name for i in g.input} | set(inits) | {""}
    for i, n in enumerate(g.node):
        for t in n.input:
            if t not in seen:
                raise InputError(f"node {i} ({n.name or n.op_type}) reads {t!r} before it is produced: "
                                 "the graph is not in topological order (run onnx.checker / onnxsim)")
        seen.update(n.output)


def _valid_cuts(g: onnx.GraphProto, consts: set[str], shapes: dict[str, tuple[int, ...]],
                dtypes: dict[str, int], max_tensors: int = 1, crossable: set[str] | None = None,
                why: dict[str, int] | None = None) -> list[Cut]:
    """Cuts with 1..``max_tensors`` activations crossing, all of them ``crossable`` (feature maps
    of a fixed shape per request) and no graph output among them, by a sweep over live ranges
    [producer, last use). ``why`` counts the reasons the other positions fail."""
    n = len(g.node)
    produced: dict[str, int] = {i.name: -1 for i in g.input if i.name not in consts}
    last_use: dict[str, int] = {}
    for idx, node in enumerate(g.node):
        for t in node.input:
            if t and t not in consts:
                last_use[t] = idx
        for t in node.output:
            if t and t not in consts:
                produced[t] = idx
    for o in g.output:
        last_use[o.name] = n  # graph outputs stay live to the end
    starts: dict[int, list[str]] = {}
    ends: dict[int, list[str]] = {}
    for t, p in produced.items():
        e = last_use.get(t)
        if e is None or e <= p:
            continue
        starts.setdefault(p, []).append(t)
        ends.setdefault(e, []).append(t)
    outputs = {o.name for o in g.output}
    live: set[str] = set(starts.get(-1, []))
    cuts: list[Cut] = []
    for k in range(n - 1):  # cut between node k and node k + 1
        live.update(starts.get(k, []))
        live.difference_update(ends.get(k, []))
        if all(t in consts for t in g.node[k].output if t):
            continue  # after a node computing constants only: the same cut as before it
        stuck = live - crossable if crossable is not None else set()
        if 1 <= len(live) <= max_tensors and not (live & outputs) and not stuck:
            ts = tuple(sorted(live, key=lambda t: (produced[t], t)))
            cuts.append(Cut(k, ts, tuple(_numel(shapes.get(t, (1,))) for t in ts),
                            tuple(dtypes.get(t, TensorProto.FLOAT) for t in ts)))
        elif why is not None:
            if stuck:
                t = min(stuck, key=lambda t: (produced[t], t))
                dt = TensorProto.DataType.Name(dtypes.get(t, TensorProto.FLOAT)).lower()
                r = (f"tensor {t!r} ({dt}, shape {list(shapes.get(t, ()))}) is live there and may not cross "
                     "a cut (only float feature maps with a batch axis and a fixed shape per request do)")
            elif live & outputs:
                r = "a graph output is already computed"
            elif not live:
                r = "no activation crosses (what follows does not read what came before)"
            else:
                r = f"more than {max_tensors} activations cross (raise --max-cut-tensors)"
            why[r] = why.get(r, 0) + 1
    return cuts


def _batched_tensors(m: onnx.ModelProto, shapes: dict[str, tuple[int, ...]], dtypes: dict[str, int],
                     consts: set[str], run: bool = True) -> tuple[set[str], dict[str, tuple[int, ...]]]:
    """Activations with a batch axis and a fixed shape per request: proven by shape inference, or
    else seen so on runs at batch sizes 1 and 2 with different inputs. Only these may cross a cut
    or leave the model (executors size every boundary from its spec). The observed ones get their
    shapes written into ``m``'s value_info, so every exported piece carries full shapes. Also
    returns the shapes seen at batch size 2 (of the tensors inference left unproven)."""
    g = m.graph
    proven: set[str] = set()
    declared: dict[str, onnx.ValueInfoProto] = {}
    for vi in [*g.input, *g.value_info, *g.output]:
        declared[vi.name] = vi
        dims = _dims(vi)
        if dims and dims[0] == BATCH_DIM and all(isinstance(d, int) for d in dims[1:]):
            proven.add(vi.name)
    acts = [t for n in g.node for t in n.output if t and t not in consts]
    rest = [t for t in acts if t not in proven and t in shapes]
    if not rest:
        return proven, {}
    seen: dict[str, tuple[int, ...]] = {}
    if run:  # (a model that does not run at batch size 2 fixes its batch: profile_model says so)
        with contextlib.suppress(InputError):
            seen = _shapes_by_running(m, rest, batch=2, seed=1)
    if not seen:  # only batch size 1 is profiled, or all there is: the batch-1 shapes
        seen = {t: (2, *shapes[t][1:]) for t in rest}
    observed = {t for t in rest if shapes[t][:1] == (1,) and seen[t] == (2, *shapes[t][1:])}
    for t in observed:
        vi = declared.get(t)
        if vi is None:
            vi = g.value_info.add()
            vi.name = t
            vi.type.tensor_type.elem_type = dtypes.get(t) or TensorProto.FLOAT
        shape = vi.type.tensor_type.shape
        del shape.dim[:]
        shape.dim.add().dim_param = BATCH_DIM
        for d in shapes[t][1:]:
            shape.dim.add().dim_value = int(d)
    return proven | observed, seen


def _shapes_by_running(model: onnx.ModelProto, names: list[str], batch: int = 1,
                       seed: int = 0) -> dict[str, tuple[int, ...]]:
    """Shapes that inference could not derive, read off one ONNX Runtime run (at ``batch`` when
    the model's batch axis is symbolic, on a random input drawn with ``seed``)."""
    return {t: tuple(int(d) for d in a.shape) for t, a in _run_for(model, names, batch, seed).items()}


def _run_for(model: onnx.ModelProto, names: list[str], batch: int = 1, seed: int = 0) -> dict[str, np.ndarray]:
    """The values of tensors ``names`` on one ONNX Runtime run of ``model`` on a random input."""
    m = copy.deepcopy(model)
    have = {o.name for o in m.graph.output}
    for t in names:
        if t not in have:
            m.graph.output.append(helper.make_empty_tensor_value_info(t))
    try:
        sess = ort_session(m.SerializeToString(), "the model")
        feeds = {i.name: _random_input(i, batch, seed) for i in sess.get_inputs()}
        outs = sess.run(names, feeds)
    except InputError:
        raise
    except Exception as e:
        raise InputError(f"cannot determine the shapes of {len(names)} tensors "
                         f"(first: {names[0]!r}) by inference or by running the model: {e}") from None
    return dict(zip(names, (np.asarray(o) for o in outs), strict=True))


# ONNX Runtime's names of the input types INPUT_TYPES admits: a float64 model fed float32 fails.
ORT_INPUT_DTYPES = {"tensor(float)": np.float32, "tensor(float16)": np.float16, "tensor(double)": np.float64}


def _random_input(meta, batch: int = 1, seed: int = 0) -> np.ndarray:
    shape = [d if isinstance(d, int) else (batch if k == 0 else 1) for k, d in enumerate(meta.shape)]
    dt = ORT_INPUT_DTYPES.get(meta.type, np.float32)
    return np.random.default_rng(seed).standard_normal(shape).astype(dt)
