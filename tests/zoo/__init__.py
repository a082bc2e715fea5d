"""A zoo of small ONNX models built by code, for profiler tests (issue #15).

Each builder returns a model shaped like one that real exporters emit (FPN skips, YOLO heads,
attention, weights as ``Constant`` nodes, dynamic dims) but small enough to profile on a CPU in
seconds. Weights are seeded and He-scaled so activations stay O(1) and the fp16 boundaries of a
partition change outputs only a little. Nothing is downloaded and nothing needs torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
IR_VERSION = 8
BATCH = "N"

__all__ = ["INPUT_SHAPES", "ZOO", "attention", "constant_weights", "dynamic_hw", "dynamic_output",
           "fpn", "two_inputs", "yolo"]


class _Net:
    """Collects nodes and weights; weights become initializers, or ``Constant`` nodes placed just
    before their first reader when ``const_nodes`` (as some non-PyTorch exporters write them)."""

    def __init__(self, seed: int, const_nodes: bool = False) -> None:
        self.rng = np.random.default_rng(seed)
        self.const_nodes = const_nodes
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.used: dict[str, int] = {}

    def _unique(self, name: str) -> str:
        k = self.used.get(name, 0)
        self.used[name] = k + 1
        return name if k == 0 else f"{name}_{k}"

    def tensor(self, name: str, value: np.ndarray) -> str:
        name = self._unique(name)
        t = numpy_helper.from_array(np.asarray(value), name)
        if self.const_nodes:
            self.nodes.append(helper.make_node("Constant", [], [name], name=f"{name}/const", value=t))
        else:
            self.inits.append(t)
        return name

    def ints(self, name: str, values: Sequence[int]) -> str:
        return self.tensor(name, np.array(values, dtype=np.int64))

    def floats(self, name: str, values: Sequence[float]) -> str:
        return self.tensor(name, np.array(values, dtype=np.float32))

    def he(self, name: str, shape: Sequence[int], fan_in: int, gain: float = 2.0) -> str:
        w = self.rng.standard_normal(tuple(shape)) * np.sqrt(gain / fan_in)
        return self.tensor(name, w.astype(np.float32))

    def bias(self, name: str, n: int) -> str:
        return self.tensor(name, (0.05 * self.rng.standard_normal(n)).astype(np.float32))

    def op(self, op: str, inputs: Sequence[str], name: str, **attrs) -> str:
        name = self._unique(name)
        self.nodes.append(helper.make_node(op, list(inputs), [name], name=name, **attrs))
        return name

    def conv(self, x: str, cin: int, cout: int, name: str, k: int = 3, stride: int = 1,
             act: str | None = "relu") -> str:
        w = self.he(f"{name}.weight", (cout, cin, k, k), cin * k * k)
        b = self.bias(f"{name}.bias", cout)
        p = k // 2
        y = self.op("Conv", [x, w, b], name, kernel_shape=[k, k], strides=[stride, stride],
                    pads=[p, p, p, p])
        if act == "relu":
            return self.op("Relu", [y], f"{name}.relu")
        if act == "silu":
            s = self.op("Sigmoid", [y], f"{name}.sigmoid")
            return self.op("Mul", [y, s], f"{name}.silu")
        return y

    def linear(self, x: str, cin: int, cout: int, name: str, gain: float = 2.0) -> str:
        """x @ W + b over the last axis (MatMul + Add, as transformer exports write it)."""
        w = self.he(f"{name}.weight", (cin, cout), cin, gain)
        y = self.op("MatMul", [x, w], f"{name}.matmul")
        return self.op("Add", [y, self.bias(f"{name}.bias", cout)], name)

    def resize(self, x: str, factor: int, name: str) -> str:
        scales = self.floats(f"{name}.scales", [1.0, 1.0, float(factor), float(factor)])
        return self.op("Resize", [x, "", scales], name, mode="nearest")

    def model(self, name: str, inputs: Sequence[onnx.ValueInfoProto],
              outputs: Sequence[onnx.ValueInfoProto]) -> onnx.ModelProto:
        g = helper.make_graph(self.nodes, name, list(inputs), list(outputs), initializer=self.inits)
        m = helper.make_model(g, opset_imports=[helper.make_opsetid("", OPSET)],
                              ir_version=IR_VERSION, producer_name="ppiped-test-zoo")
        onnx.checker.check_model(m, full_check=True)
        return m


def _image(name: str, c: int | str, h: int | str, w: int | str) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, TensorProto.FLOAT, [BATCH, c, h, w])


def _out(name: str, *dims: int | str | None, dtype: int = TensorProto.FLOAT) -> onnx.ValueInfoProto:
    return helper.make_tensor_value_info(name, dtype, [BATCH, *dims])


def constant_weights() -> onnx.ModelProto:
    """A plain classifier whose every weight is a ``Constant`` node, none an initializer."""
    n = _Net(seed=1, const_nodes=True)
    x = n.conv("image", 3, 8, "features.0")
    x = n.op("MaxPool", [x], "features.pool", kernel_shape=[2, 2], strides=[2, 2])
    x = n.conv(x, 8, 16, "features.1")
    x = n.conv(x, 16, 32, "features.2", stride=2)
    x = n.conv(x, 32, 32, "features.3")
    x = n.op("GlobalAveragePool", [x], "gap")
    x = n.op("Flatten", [x], "flatten", axis=1)
    w = n.he("fc.weight", (10, 32), 32, gain=1.0)
    n.op("Gemm", [x, w, n.bias("fc.bias", 10)], "logits", transB=1)
    return n.model("constant_weights", [_image("image", 3, 32, 32)], [_out("logits", 10)])


def fpn(size: int = 48) -> onnx.ModelProto:
    """DBNet-like text detector: 4 backbone stages (strides 2-16), an FPN neck whose lateral
    maps all stay live until the final Concat, and a probability-map head; ``size`` x ``size``
    input (a multiple of 16)."""
    n = _Net(seed=2)
    chans = [8, 16, 24, 32]
    feats, x, cin = [], "image", 3
    for i, c in enumerate(chans):
        x = n.conv(x, cin, c, f"backbone.stage{i + 1}.down", stride=2)
        for r in range(3):  # real backbones stack several convolutions per stage
            x = n.conv(x, c, c, f"backbone.stage{i + 1}.conv{r}")
        feats.append(x)
        cin = c
    inner = 16
    lat = {i: n.conv(feats[i], chans[i], inner, f"neck.lateral{i + 1}", k=1, act=None)
           for i in (3, 2, 1, 0)}
    top = [lat[3]]
    for i in (2, 1, 0):
        up = n.resize(top[0], 2, f"neck.up{i + 1}")
        top.insert(0, n.op("Add", [lat[i], up], f"neck.td{i + 1}"))
    outs = []
    for i, t in enumerate(top):
        p = n.conv(t, inner, 4, f"neck.smooth{i + 1}", act=None)
        outs.append(p if i == 0 else n.resize(p, 2 ** i, f"neck.fuse_up{i + 1}"))
    x = n.op("Concat", outs[::-1], "neck.concat", axis=1)
    x = n.conv(x, 16, 4, "head.conv")
    w = n.he("head.deconv.weight", (4, 1, 2, 2), 4, gain=1.0)
    x = n.op("ConvTranspose", [x, w, n.bias("head.deconv.bias", 1)], "head.deconv",
             kernel_shape=[2, 2], strides=[2, 2])
    n.op("Sigmoid", [x], "prob_map")
    return n.model("fpn", [_image("image", 3, size, size)], [_out("prob_map", 1, size, size)])


def yolo(num_classes: int = 4, size: int = 64) -> onnx.ModelProto:
    """YOLOv5-like detector: SiLU backbone with a residual stage and 3 output scales, a PAN neck
    (upsample + concat down, strided conv + concat up) and 3 heads reshaped into one box list;
    ``size`` x ``size`` input (a multiple of 32)."""
    n = _Net(seed=3)
    anchors, per_box = 3, 5 + num_classes
    x = n.conv("image", 3, 8, "backbone.stem", stride=2, act="silu")
    x = n.conv(x, 8, 16, "backbone.down1", stride=2, act="silu")
    for k in range(2):  # C3-style residual bottlenecks
        r = n.conv(x, 16, 8, f"backbone.c3.{k}.cv1", k=1, act="silu")
        r = n.conv(r, 8, 16, f"backbone.c3.{k}.cv2", act="silu")
        x = n.op("Add", [x, r], f"backbone.c3.{k}.add")
    c3 = n.conv(x, 16, 24, "backbone.down2", stride=2, act="silu")
    c3 = n.conv(c3, 24, 24, "backbone.c3b", act="silu")
    c4 = n.conv(c3, 24, 32, "backbone.down3", stride=2, act="silu")
    c4 = n.conv(c4, 32, 32, "backbone.c4b", act="silu")
    c5 = n.conv(c4, 32, 48, "backbone.down4", stride=2, act="silu")
    c5 = n.conv(c5, 48, 48, "backbone.c5b", act="silu")
    p5 = n.conv(c5, 48, 32, "neck.reduce5", k=1, act="silu")
    x = n.op("Concat", [n.resize(p5, 2, "neck.up5"), c4], "neck.cat4", axis=1)
    p4 = n.conv(x, 64, 24, "neck.reduce4", k=1, act="silu")
    x = n.op("Concat", [n.resize(p4, 2, "neck.up4"), c3], "neck.cat3", axis=1)
    x = n.conv(x, 48, 16, "neck.out3.cv1", k=1, act="silu")
    out3 = n.conv(x, 16, 24, "neck.out3.cv2", act="silu")
    x = n.op("Concat", [n.conv(out3, 24, 24, "neck.down3", stride=2, act="silu"), p4],
             "neck.pan4", axis=1)
    out4 = n.conv(x, 48, 32, "neck.out4", act="silu")
    x = n.op("Concat", [n.conv(out4, 32, 32, "neck.down4", stride=2, act="silu"), p5],
             "neck.pan5", axis=1)
    out5 = n.conv(x, 64, 48, "neck.out5", act="silu")
    boxes = []
    grids = (size // 8, size // 16, size // 32)
    for i, (t, c, hw) in enumerate(zip((out3, out4, out5), (24, 32, 48), grids, strict=True)):
        y = n.conv(t, c, anchors * per_box, f"head.m{i}", k=1, act=None)
        y = n.op("Reshape", [y, n.ints(f"head.m{i}.shape5", [0, anchors, per_box, hw, hw])],
                 f"head.m{i}.view")
        y = n.op("Transpose", [y], f"head.m{i}.permute", perm=[0, 1, 3, 4, 2])
        y = n.op("Sigmoid", [y], f"head.m{i}.sigmoid")
        boxes.append(n.op("Reshape", [y, n.ints(f"head.m{i}.shape3", [0, -1, per_box])],
                          f"head.m{i}.flat"))
    n.op("Concat", boxes, "detections", axis=1)
    total = anchors * sum(g * g for g in grids)
    return n.model("yolo", [_image("image", 3, size, size)], [_out("detections", total, per_box)])


def dynamic_hw() -> onnx.ModelProto:
    """Fully convolutional classifier with input [N, 3, H, W]: any resolution runs, so the
    profiler needs ``--input-shape`` to know what to time."""
    n = _Net(seed=4)
    x = n.conv("image", 3, 8, "conv1", stride=2)
    x = n.conv(x, 8, 16, "conv2", stride=2)
    x = n.conv(x, 16, 32, "conv3", stride=2)
    x = n.conv(x, 32, 32, "conv4")
    x = n.op("GlobalAveragePool", [x], "gap")
    x = n.op("Flatten", [x], "flatten", axis=1)
    w = n.he("fc.weight", (10, 32), 32, gain=1.0)
    n.op("Gemm", [x, w, n.bias("fc.bias", 10)], "logits", transB=1)
    return n.model("dynamic_hw", [_image("image", 3, "H", "W")], [_out("logits", 10)])


def dynamic_output() -> onnx.ModelProto:
    """CenterNet-like peak picker: a heatmap's scores above 0.5 (at least one), top-k with k
    taken from the data, so shape inference cannot know the output's second dim ("K")."""
    n = _Net(seed=5)
    x = n.conv("image", 3, 8, "backbone.conv1", stride=2)
    x = n.conv(x, 8, 16, "backbone.conv2", stride=2)
    x = n.conv(x, 16, 16, "backbone.conv3")
    x = n.conv(x, 16, 1, "head.heatmap", k=1, act=None)
    s = n.op("Sigmoid", [x], "head.sigmoid")
    s = n.op("Reshape", [s, n.ints("head.flat.shape", [0, -1])], "head.scores")
    hit = n.op("Greater", [s, n.floats("head.threshold", [0.5])], "head.hit")
    hit = n.op("Cast", [hit], "head.hit_float", to=TensorProto.FLOAT)
    count = n.op("ReduceSum", [hit, n.ints("head.count.axes", [1])], "head.count", keepdims=0)
    k = n.op("ReduceMax", [count], "head.k_max", keepdims=1)
    k = n.op("Max", [k, n.floats("head.k_min", [1.0])], "head.k_at_least_1")
    k = n.op("Cast", [k], "head.k", to=TensorProto.INT64)
    vals = helper.make_node("TopK", [s, k], ["peaks", "peak_index"], name="head.topk", axis=-1)
    n.nodes.append(vals)
    return n.model("dynamic_output", [_image("image", 3, 32, 32)], [_out("peaks", "K")])


def attention(num_classes: int = 37, width: int = 64) -> onnx.ModelProto:
    """Text-recognizer-like: conv stem, columns as a sequence [N, T, C], one post-norm
    transformer block (self-attention + FFN), per-step class probabilities; a 32 x ``width``
    text line (``width`` a multiple of 4: T = width / 4 steps)."""
    n = _Net(seed=6)
    c = 32
    x = n.conv("image", 3, 8, "stem.conv1", stride=2)
    x = n.conv(x, 8, 16, "stem.conv2", stride=2)
    x = n.conv(x, 16, c, "stem.conv3")
    x = n.op("MaxPool", [x], "stem.pool_h", kernel_shape=[8, 1], strides=[8, 1])
    x = n.op("Squeeze", [x, n.ints("stem.squeeze.axes", [2])], "stem.squeeze")
    x = n.op("Transpose", [x], "seq", perm=[0, 2, 1])
    q = n.linear(x, c, c, "attn.q", gain=1.0)
    k = n.linear(x, c, c, "attn.k", gain=1.0)
    v = n.linear(x, c, c, "attn.v", gain=1.0)
    kt = n.op("Transpose", [k], "attn.k_t", perm=[0, 2, 1])
    s = n.op("MatMul", [q, kt], "attn.scores")
    s = n.op("Mul", [s, n.floats("attn.scale", [1.0 / np.sqrt(c)])], "attn.scaled")
    a = n.op("Softmax", [s], "attn.softmax", axis=-1)
    y = n.op("MatMul", [a, v], "attn.context")
    y = n.linear(y, c, c, "attn.proj", gain=1.0)
    x = n.op("Add", [x, y], "attn.residual")
    x = n.op("LayerNormalization", [x, n.floats("norm1.weight", [1.0] * c),
                                    n.floats("norm1.bias", [0.0] * c)], "norm1", axis=-1)
    f = n.op("Relu", [n.linear(x, c, 2 * c, "ffn.fc1")], "ffn.relu")
    x = n.op("Add", [x, n.linear(f, 2 * c, c, "ffn.fc2", gain=1.0)], "ffn.residual")
    x = n.op("LayerNormalization", [x, n.floats("norm2.weight", [1.0] * c),
                                    n.floats("norm2.bias", [0.0] * c)], "norm2", axis=-1)
    x = n.linear(x, c, num_classes, "classifier", gain=1.0)
    n.op("Softmax", [x], "char_probs", axis=-1)
    return n.model("attention", [_image("image", 3, 32, width)], [_out("char_probs", width // 4, num_classes)])


def two_inputs() -> onnx.ModelProto:
    """Two image inputs (e.g. a frame and a reference): not a single-input CNN."""
    n = _Net(seed=7)
    a = n.conv("image_a", 3, 8, "branch_a.conv", stride=2)
    b = n.conv("image_b", 3, 8, "branch_b.conv", stride=2)
    x = n.op("Add", [a, b], "fuse")
    x = n.conv(x, 8, 16, "trunk.conv", stride=2)
    x = n.op("GlobalAveragePool", [x], "gap")
    x = n.op("Flatten", [x], "flatten", axis=1)
    w = n.he("fc.weight", (10, 16), 16, gain=1.0)
    n.op("Gemm", [x, w, n.bias("fc.bias", 10)], "logits", transB=1)
    return n.model("two_inputs", [_image("image_a", 3, 32, 32), _image("image_b", 3, 32, 32)],
                   [_out("logits", 10)])


ZOO: dict[str, Callable[[], onnx.ModelProto]] = {
    "constant_weights": constant_weights,
    "fpn": fpn,
    "yolo": yolo,
    "dynamic_hw": dynamic_hw,
    "dynamic_output": dynamic_output,
    "attention": attention,
    "two_inputs": two_inputs,
}

INPUT_SHAPES: dict[str, str] = {"dynamic_hw": "3x64x64"}
