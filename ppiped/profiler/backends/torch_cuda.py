"""CUDA through PyTorch, for GPU machines where TensorRT cannot be installed.

A small interpreter maps the ONNX operators CNNs use onto torch ops in fp16 (channels-last,
BatchNormalization folded into the preceding convolution, as TensorRT does) and replays each batch
size from a CUDA graph, so the figure is GPU time without Python's per-op launch cost. It is not
TensorRT: it fuses less, so its latencies are an upper bound of what an engine would take, and the
profile labels them ``torch``. torch is imported only when this backend is chosen.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...errors import InputError

SUPPORTED = {"Conv", "ConvTranspose", "BatchNormalization", "Relu", "Add", "Sub", "Mul", "Div", "MaxPool",
             "AveragePool", "GlobalAveragePool", "Flatten", "Gemm", "MatMul", "Cast", "Identity", "Sigmoid",
             "Clip", "Concat", "HardSwish", "HardSigmoid", "Tanh", "Resize", "Reshape", "Transpose", "Softmax",
             "LayerNormalization", "Squeeze", "Unsqueeze", "Constant", "Erf", "ReduceMean", "Shape", "Gather",
             "Slice"}
# Inputs read as numbers (shapes, scales, axes, slice bounds, indices), not as tensors: constants,
# or values computed on the host from tensor shapes (see HOST_OPS).
_STATIC_INPUTS = {"Resize": (1, 2, 3), "Reshape": (1,), "Squeeze": (1,), "Unsqueeze": (1,), "ReduceMean": (1,),
                  "Slice": (1, 2, 3, 4), "Gather": (1,)}
# Operators evaluated on the host, with numpy, when every input is a constant or such a host value:
# the shape arithmetic exporters emit around a batch-following Reshape or a Resize to an input's
# size (Shape -> Gather -> Unsqueeze -> Concat -> Reshape). Its values are fixed per batch size, so
# a CUDA graph captured at that size replays them.
HOST_OPS = {"Shape", "Gather", "Slice", "Concat", "Unsqueeze", "Squeeze", "Cast", "Add", "Sub", "Mul", "Div",
            "Identity"}


def import_torch():
    """torch and its functional API, or a clear error where torch or a CUDA GPU is missing."""
    try:
        import torch
        import torch.nn.functional as F  # noqa: N812
    except ImportError as e:
        raise InputError(f"the torch backend needs PyTorch with CUDA ({e})") from None
    if not torch.cuda.is_available():
        raise InputError("the torch backend needs a CUDA GPU, and torch sees none")
    return torch, F


def device_input(torch, bs: int, sample) -> Any:
    """A zero fp16 batch on the GPU for one input of ``sample`` shape (channels-last if 4-D):
    the fixed address a CUDA graph reads."""
    x = torch.zeros((bs, *sample), device="cuda", dtype=torch.half)
    return x.contiguous(memory_format=torch.channels_last) if x.dim() == 4 else x


def _constant_value(n) -> np.ndarray:
    """The value of a Constant node (a tensor, or one of the scalar and list forms)."""
    for at in n.attribute:
        v = helper.get_attribute_value(at)
        if at.name in ("value", "sparse_value"):
            return numpy_helper.to_array(v)
        if at.name in ("value_float", "value_floats"):
            return np.asarray(v, dtype=np.float32)
        if at.name in ("value_int", "value_ints"):
            return np.asarray(v, dtype=np.int64)
    raise InputError(f"Constant node {n.name} has no value the torch backend reads")


class OnnxProgram:
    """The model's nodes as torch calls over fp16 tensors on the GPU."""

    def __init__(self, model: onnx.ModelProto, torch, F, device: str = "cuda", dtype: Any = None) -> None:  # noqa: N803
        """``device``/``dtype``: where and in which float type the program runs (CUDA fp16 by
        default, as profiled; the tests run it on the CPU in fp32 against onnxruntime)."""
        self.torch, self.F = torch, F
        dev = torch.device(device)
        dtype = torch.half if dtype is None else dtype
        self.dev, self.dtype = dev, dtype
        g = model.graph
        self.consts = consts = {t.name: numpy_helper.to_array(t) for t in g.initializer}
        host: set[str] = set()  # tensors computed on the host from shapes (per batch size)
        self._cache: dict = {}  # host values read as tensors, by value: made once, before a capture
        nodes = []
        for n in g.node:
            if n.op_type not in SUPPORTED:
                raise InputError(f"the torch backend does not support operator {n.op_type} "
                                 f"(node {n.name}); use --backend trt or ort")
            if n.op_type == "Constant":
                consts[n.output[0]] = _constant_value(n)
                continue
            if n.op_type in HOST_OPS and n.op_type != "Shape" and all(not t or t in consts for t in n.input):
                # arithmetic on constants only (an exporter's Identity of a shared weight, a Cast):
                # folded once here, not redone (and copied to the device) at every run
                consts[n.output[0]] = np.asarray(self._host(n, _attrs(n), {}))
                continue
            if n.op_type == "Shape" or (n.op_type in HOST_OPS and all(
                    not t or t in consts or t in host for t in n.input)):
                host.update(n.output)
            for i in _STATIC_INPUTS.get(n.op_type, ()):
                if i < len(n.input) and n.input[i] and n.input[i] not in consts and n.input[i] not in host:
                    raise InputError(f"the torch backend needs input {i} of {n.op_type} node {n.name} to be a "
                                     "constant or computed from tensor shapes (it is computed from tensor "
                                     "values); use --backend trt or ort")
            nodes.append(n)
        self.host = host
        self.nodes = self._fold_bn(nodes, consts)
        self.w = {k: torch.from_numpy(np.array(v, copy=True)).to(dev) for k, v in consts.items()}
        for k, v in self.w.items():
            if v.is_floating_point():
                v = v.to(dtype)
                self.w[k] = v.contiguous(memory_format=torch.channels_last) if v.dim() == 4 else v
        # a first block takes the image; a later one every tensor of the cut before it
        self.inputs = [i.name for i in g.input if i.name not in consts]
        self.outputs = [o.name for o in g.output]

    @staticmethod
    def _fold_bn(nodes: list, consts: dict[str, np.ndarray]) -> list:
        uses: dict[str, int] = {}
        for n in nodes:
            for t in n.input:
                uses[t] = uses.get(t, 0) + 1
        producer = {t: n for n in nodes for t in n.output}
        out = []
        for n in nodes:
            if n.op_type == "BatchNormalization" and n.input[0] in producer:
                conv = producer[n.input[0]]
                if conv.op_type == "Conv" and uses.get(n.input[0]) == 1 and all(t in consts for t in n.input[1:5]):
                    eps = next((a.f for a in n.attribute if a.name == "epsilon"), 1e-5)
                    scale, bias, mean, var = (consts[t].astype(np.float64) for t in n.input[1:5])
                    k = scale / np.sqrt(var + eps)
                    w = consts[conv.input[1]].astype(np.float64) * k.reshape(-1, 1, 1, 1)
                    b0 = consts[conv.input[2]].astype(np.float64) if len(conv.input) > 2 else 0.0
                    wn, bn = f"{conv.name}/folded_w", f"{conv.name}/folded_b"
                    consts[wn] = w.astype(np.float32)
                    consts[bn] = ((b0 - mean) * k + bias).astype(np.float32)
                    x_in = conv.input[0]
                    del conv.input[:]
                    conv.input.extend([x_in, wn, bn])
                    del conv.output[:]
                    conv.output.append(n.output[0])
                    continue
            out.append(n)
        return out

    def _conv_transpose(self, n, a: dict, ins: list):
        if "output_shape" in a or a.get("auto_pad", b"NOTSET") not in (b"NOTSET", "NOTSET"):
            raise InputError(f"the torch backend runs ConvTranspose (node {n.name}) with explicit pads only")
        pads = list(a.get("pads", [0, 0, 0, 0]))
        h = len(pads) // 2
        if pads[:h] != pads[h:]:
            raise InputError(f"the torch backend runs ConvTranspose (node {n.name}) with symmetric pads only")
        return self.F.conv_transpose2d(ins[0], ins[1], ins[2] if len(ins) > 2 else None,
                                       tuple(a.get("strides", [1, 1])), tuple(pads[:h]),
                                       tuple(a.get("output_padding", [0, 0])), a.get("group", 1),
                                       tuple(a.get("dilations", [1, 1])))

    def _tensor(self, v):
        """A host value where a tensor is read (a size a computation scales by), on the device:
        made once per value, so the warm-up runs make it and a CUDA graph captured after them
        reads it (a host-to-device copy cannot be captured)."""
        if not isinstance(v, np.ndarray):
            return v
        key = (v.dtype.str, v.shape, v.tobytes())
        t = self._cache.get(key)
        if t is None:
            t = self.torch.tensor(v, device=self.dev)
            t = self._cache[key] = t.to(self.dtype) if t.is_floating_point() else t
        return t

    def _num(self, name: str, env: dict) -> np.ndarray | None:
        """A numeric input: a constant, or a value the program computed on the host."""
        if name in self.consts:
            return self.consts[name]
        v = env.get(name)
        return v if isinstance(v, np.ndarray) else None

    def _axes(self, n, a: dict, env: dict) -> list[int]:
        """Squeeze/Unsqueeze/ReduceMean axes: the input (opset 13/18 on) or the attribute."""
        if len(n.input) > 1 and n.input[1]:
            return [int(v) for v in self._num(n.input[1], env)]
        return list(a.get("axes", []))

    def _host(self, n, a: dict, env: dict) -> np.ndarray:
        """One shape-arithmetic node on the host (numpy), ONNX semantics."""
        op = n.op_type
        if op == "Shape":
            shape = np.array(env[n.input[0]].shape, dtype=np.int64)
            return shape[a.get("start", 0):a.get("end")]
        ins = [self._num(t, env) if t else None for t in n.input]
        x = ins[0]
        if op == "Gather":
            return np.take(x, ins[1], axis=a.get("axis", 0))
        if op == "Slice":
            for ax, r in _slices(x.shape, *ins[1:5]):
                x = np.take(x, np.asarray(r, dtype=np.int64), axis=ax)
            return x
        if op == "Concat":
            return np.concatenate([np.atleast_1d(v) for v in ins], axis=a.get("axis", 0))
        if op in ("Unsqueeze", "Squeeze"):
            axes = self._axes(n, a, env)
            if op == "Unsqueeze":
                out = x.ndim + len(axes)
                return np.expand_dims(x, tuple(sorted(v % out for v in axes)))
            return np.squeeze(x, tuple(v % x.ndim for v in axes)) if axes else np.squeeze(x)
        if op == "Cast":
            return x.astype(helper.tensor_dtype_to_np_dtype(a["to"]))
        if op in ("Add", "Sub", "Mul"):
            return {"Add": np.add, "Sub": np.subtract, "Mul": np.multiply}[op](x, ins[1])
        if op == "Div":
            if np.issubdtype(x.dtype, np.integer) and np.issubdtype(ins[1].dtype, np.integer):
                return (np.trunc(x / ins[1])).astype(np.result_type(x, ins[1]))
            return x / ins[1]
        return x  # Identity

    def _resize(self, n, a: dict, x, env: dict):
        """ONNX Resize of the spatial axes, as F.interpolate does it: nearest (floor of the
        asymmetric source for ``asymmetric``, rounded half-pixel otherwise) or linear."""
        def text(key, default):
            v = a.get(key, default)
            return v.decode() if isinstance(v, bytes) else v

        mode, ctm = text("mode", "nearest"), text("coordinate_transformation_mode", "half_pixel")
        scales = self._num(n.input[2], env) if len(n.input) > 2 and n.input[2] else None
        sizes = self._num(n.input[3], env) if len(n.input) > 3 and n.input[3] else None
        kw: dict[str, Any] = {}
        if sizes is not None and len(sizes):
            kw["size"] = tuple(int(v) for v in sizes[2:])
        elif scales is not None and len(scales):
            if any(float(v) != 1.0 for v in scales[:2]):
                raise InputError(f"the torch backend resizes spatial axes only (node {n.name})")
            kw["scale_factor"] = tuple(float(v) for v in scales[2:])
        else:
            raise InputError(f"Resize node {n.name} has neither scales nor sizes")
        if mode == "nearest":
            kw["mode"] = "nearest" if ctm == "asymmetric" else "nearest-exact"
        elif mode == "linear" and ctm in ("half_pixel", "pytorch_half_pixel", "align_corners"):
            kw["mode"] = "bilinear" if x.dim() == 4 else "linear"
            kw["align_corners"] = ctm == "align_corners"
        else:
            raise InputError(f"the torch backend does not support Resize mode {mode!r} with "
                             f"{ctm!r} coordinates (node {n.name}); use --backend trt or ort")
        return self.F.interpolate(x, **kw)

    def run(self, *xs):
        """The outputs for one tensor per input, in the graph's input order."""
        if len(xs) != len(self.inputs):
            raise InputError(f"the block takes {len(self.inputs)} input tensor(s), got {len(xs)}")
        env = dict(self.w)
        env.update(zip(self.inputs, xs, strict=True))
        for n in self.nodes:
            try:
                env[n.output[0]] = self._node(n, env)
            except InputError:
                raise
            except Exception as e:  # noqa: BLE001 - named, so a failing export says where
                raise InputError(f"the torch backend failed on {n.op_type} node {n.name or n.output[0]}: "
                                 f"{type(e).__name__}: {e}") from e
        return [env[o] for o in self.outputs]

    def _node(self, n, env: dict):
        """One node's output: on the host for shape arithmetic, else a torch call on the device."""
        torch, F = self.torch, self.F
        a = _attrs(n)
        if n.output[0] in self.host:
            return np.asarray(self._host(n, a, env))
        ins = [self._tensor(env[t]) if t else None for t in n.input]
        op = n.op_type
        if op == "Conv":
            pads = list(a.get("pads", [0, 0, 0, 0]))
            h = len(pads) // 2
            x0 = ins[0]
            if pads[:h] != pads[h:]:
                x0 = F.pad(x0, [p for i in reversed(range(h)) for p in (pads[i], pads[i + h])])
                pads = [0] * (2 * h)
            y = F.conv2d(x0, ins[1], ins[2] if len(ins) > 2 else None, tuple(a.get("strides", [1, 1])),
                         tuple(pads[:h]), tuple(a.get("dilations", [1, 1])), a.get("group", 1))
        elif op == "ConvTranspose":
            y = self._conv_transpose(n, a, ins)
        elif op == "Resize":
            y = self._resize(n, a, ins[0], env)
        elif op == "Reshape":
            shape = [int(d) for d in self._num(n.input[1], env)]
            if not a.get("allowzero", 0):
                shape = [ins[0].shape[i] if d == 0 else d for i, d in enumerate(shape)]
            y = torch.reshape(ins[0], shape)
        elif op == "Transpose":
            y = ins[0].permute(*a.get("perm", range(ins[0].dim() - 1, -1, -1)))
        elif op == "Softmax":
            y = torch.softmax(ins[0], a.get("axis", -1))
        elif op == "LayerNormalization":
            ax = a.get("axis", -1) % ins[0].dim()
            y = F.layer_norm(ins[0], tuple(ins[0].shape[ax:]), ins[1], ins[2] if len(ins) > 2 else None,
                             a.get("epsilon", 1e-5))
        elif op in ("Squeeze", "Unsqueeze"):
            axes = self._axes(n, a, env)
            y = ins[0]
            if op == "Squeeze":
                axes = sorted((x % y.dim() for x in axes), reverse=True) or \
                    [i for i in range(y.dim() - 1, -1, -1) if y.shape[i] == 1]
                for x in axes:
                    y = y.squeeze(x)
            else:
                out_dim = y.dim() + len(axes)
                for x in sorted(x % out_dim for x in axes):
                    y = y.unsqueeze(x)
        elif op == "Erf":
            y = torch.erf(ins[0])
        elif op == "ReduceMean":
            axes = self._axes(n, a, env)
            if not axes and a.get("noop_with_empty_axes", 0):
                y = ins[0]
            else:
                y = ins[0].mean(dim=tuple(axes or range(ins[0].dim())), keepdim=bool(a.get("keepdims", 1)))
        elif op == "Slice":
            y = ins[0]
            for ax, r in _slices(y.shape, *(self._num(t, env) if t else None for t in n.input[1:5])):
                if r.step > 0:  # (torch slices with positive steps only)
                    y = y.narrow(ax, r.start, max(r.stop - r.start, 0))[(slice(None),) * ax + (slice(None, None, r.step),)]
                else:
                    y = y.index_select(ax, self._tensor(np.asarray(r, dtype=np.int64)))
        elif op == "Gather":
            idx = self._num(n.input[1], env)
            ax = a.get("axis", 0) % ins[0].dim()
            if idx.ndim == 0:
                y = ins[0].select(ax, int(idx) % ins[0].shape[ax])
            else:
                t = self._tensor(np.where(idx < 0, idx + ins[0].shape[ax], idx).astype(np.int64).reshape(-1))
                y = ins[0].index_select(ax, t).reshape(
                    *ins[0].shape[:ax], *idx.shape, *ins[0].shape[ax + 1:])
        elif op == "BatchNormalization":
            y = F.batch_norm(ins[0], ins[3], ins[4], ins[1], ins[2], False, 0.0, a.get("epsilon", 1e-5))
        elif op == "Relu":
            y = F.relu(ins[0])
        elif op in ("Add", "Sub", "Mul", "Div"):
            y = {"Add": torch.add, "Sub": torch.sub, "Mul": torch.mul, "Div": torch.div}[op](ins[0], ins[1])
        elif op in ("MaxPool", "AveragePool"):
            k = tuple(a["kernel_shape"])
            pads = list(a.get("pads", [0] * 2 * len(k)))
            fn = F.max_pool2d if op == "MaxPool" else F.avg_pool2d
            y = fn(ins[0], k, tuple(a.get("strides", k)), tuple(pads[:len(k)]), ceil_mode=bool(a.get("ceil_mode", 0)))
        elif op == "GlobalAveragePool":
            y = ins[0].mean(dim=(2, 3), keepdim=True)
        elif op == "Flatten":
            y = torch.flatten(ins[0], a.get("axis", 1))
        elif op == "Gemm":
            aa = ins[0].t() if a.get("transA", 0) else ins[0]
            bb = ins[1].t() if a.get("transB", 0) else ins[1]
            y = a.get("alpha", 1.0) * (aa @ bb)
            if len(ins) > 2 and ins[2] is not None:
                y = y + a.get("beta", 1.0) * ins[2]
        elif op == "MatMul":
            y = ins[0] @ ins[1]
        elif op in ("Cast", "Identity"):
            y = ins[0]  # everything runs in fp16, as an fp16 engine does
        elif op == "Sigmoid":
            y = torch.sigmoid(ins[0])
        elif op == "Tanh":
            y = torch.tanh(ins[0])
        elif op == "HardSigmoid":
            y = torch.clamp(a.get("alpha", 0.2) * ins[0] + a.get("beta", 0.5), 0, 1)
        elif op == "HardSwish":
            y = F.hardswish(ins[0])
        elif op == "Clip":
            lo = ins[1] if len(ins) > 1 and ins[1] is not None else a.get("min")
            hi = ins[2] if len(ins) > 2 and ins[2] is not None else a.get("max")
            y = torch.clamp(ins[0], lo, hi)
        else:  # Concat
            y = torch.cat(ins, dim=a.get("axis", 1))
        return y


def _attrs(n) -> dict[str, Any]:
    return {at.name: helper.get_attribute_value(at) for at in n.attribute}


def _slices(shape, starts, ends, axes=None, steps=None) -> list[tuple[int, range]]:
    """ONNX Slice bounds as (axis, the indices it keeps): negatives count from the end, and the
    bounds clamp as ONNX clamps them (for a negative step the start to dim - 1 and the end to -1,
    where Python's slices differ)."""
    axes = range(len(starts)) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    out = []
    for s0, e0, ax, st in zip(starts, ends, axes, steps, strict=True):
        ax, st = int(ax) % len(shape), int(st)
        d = int(shape[ax])
        s0, e0 = (int(v) + d if int(v) < 0 else int(v) for v in (s0, e0))
        if st > 0:
            s0, e0 = min(max(s0, 0), d), min(max(e0, 0), d)
        else:
            s0, e0 = min(max(s0, 0), d - 1), min(max(e0, -1), d - 1)
        out.append((ax, range(s0, e0, st)))
    return out


class TorchSession:
    def __init__(self, rt: TorchRuntime, model_path: Path, max_batch: int) -> None:
        torch = rt.torch
        self.torch = torch
        model = onnx.load(str(model_path))
        self.prog = OnnxProgram(model, torch, rt.F)
        shapes = {i.name: [d.dim_value for d in i.type.tensor_type.shape.dim[1:]] for i in model.graph.input}
        self.samples = [shapes[n] for n in self.prog.inputs]
        self.graphs: dict[int, Any] = {}
        self.stream = torch.cuda.Stream()

    def _graph(self, bs: int):
        torch = self.torch
        if bs not in self.graphs:
            xs = [device_input(torch, bs, sample) for sample in self.samples]
            with torch.inference_mode():
                self.stream.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(self.stream):
                    for _ in range(3):
                        self.prog.run(*xs)
                torch.cuda.current_stream().wait_stream(self.stream)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    out = self.prog.run(*xs)
            self.graphs[bs] = (g, xs, out)
        return self.graphs[bs][0]

    def timed(self, bs: int, n: int) -> float:
        torch = self.torch
        g = self._graph(bs)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(n):
            g.replay()
        end.record()
        end.synchronize()
        return start.elapsed_time(end) / 1e3

    def close(self) -> None:
        self.graphs.clear()


class TorchRuntime:
    name = "torch"

    def __init__(self, split: int = 1) -> None:
        self.torch, self.F = import_torch()
        self.torch.backends.cudnn.benchmark = True
        self.split = split
        props = self.torch.cuda.get_device_properties(0)
        self.device, self.sms = props.name, props.multi_processor_count

    def open(self, model_path: Path, max_batch: int) -> TorchSession:
        return TorchSession(self, model_path, max_batch)

    def info(self) -> dict[str, Any]:
        return {"device": self.device, "sms_visible": self.sms,
                "library": f"torch {self.torch.__version__} (CUDA graphs, fp16, cudnn)"}
