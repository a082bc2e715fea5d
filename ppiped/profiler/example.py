"""The embedded example: a small ResNet-style CNN built with onnx.helper from seeded weights.

It exists so that ``make demo`` and the tests have a real model to cut, time and serve with no
download. Its residual blocks all cost the same FLOPs (channels double as the side halves, and
down-sampling blocks use a 3x3 strided shortcut), so ten blocks come out balanced; the skip
connections make every cut inside a residual block invalid, which exercises the cut-point logic.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

EXAMPLE_NAME = "example"
OPSET = 17


class _Builder:
    def __init__(self, seed: int) -> None:
        self.rng = np.random.default_rng(seed)
        self.nodes: list[onnx.NodeProto] = []
        self.inits: list[onnx.TensorProto] = []
        self.count: dict[str, int] = {}

    def _name(self, prefix: str) -> str:
        k = self.count.get(prefix, 0)
        self.count[prefix] = k + 1
        return f"{prefix}{k}"

    def _weight(self, name: str, a: np.ndarray) -> str:
        self.inits.append(numpy_helper.from_array(a.astype(np.float32), name))
        return name

    def conv(self, x: str, cin: int, cout: int, k: int, stride: int = 1, pad: int | None = None) -> str:
        name = self._name("conv")
        w = self.rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / (cin * k * k))
        wn = self._weight(f"{name}.weight", w)
        p = k // 2 if pad is None else pad
        out = f"{name}.out"
        self.nodes.append(helper.make_node("Conv", [x, wn], [out], name=name, kernel_shape=[k, k],
                                           strides=[stride, stride], pads=[p, p, p, p]))
        return out

    def bn(self, x: str, c: int, gamma: float = 1.0) -> str:
        name = self._name("bn")
        r = self.rng
        ins = [x,
               self._weight(f"{name}.scale", gamma * (1.0 + 0.1 * r.standard_normal(c))),
               self._weight(f"{name}.bias", 0.1 * r.standard_normal(c)),
               self._weight(f"{name}.mean", 0.1 * r.standard_normal(c)),
               self._weight(f"{name}.var", r.uniform(0.8, 1.2, c))]
        out = f"{name}.out"
        self.nodes.append(helper.make_node("BatchNormalization", ins, [out], name=name, epsilon=1e-5))
        return out

    def op(self, op: str, ins: Sequence[str], **attrs) -> str:
        name = self._name(op.lower())
        out = f"{name}.out"
        self.nodes.append(helper.make_node(op, list(ins), [out], name=name, **attrs))
        return out

    def basic_block(self, x: str, cin: int, cout: int, stride: int) -> str:
        y = self.op("Relu", [self.bn(self.conv(x, cin, cout, 3, stride), cout)])
        y = self.bn(self.conv(y, cout, cout, 3), cout, gamma=0.5)
        # A strided 3x3 shortcut keeps a down-sampling block's FLOPs equal to the others'.
        short = x if stride == 1 and cin == cout else self.bn(self.conv(x, cin, cout, 3, stride), cout)
        return self.op("Relu", [self.op("Add", [y, short])])

    def stages_and_head(self, y: str, c: int, widths: Sequence[int], depths: Sequence[int],
                        classes: int) -> str:
        """Residual stages (the first block of each later stage strided), global pool and a
        linear classifier writing ``logits``: the body of the example CNN and of the example
        app's classifier."""
        for s, (w, d) in enumerate(zip(widths, depths, strict=True)):
            for i in range(d):
                y = self.basic_block(y, c, w, 2 if s > 0 and i == 0 else 1)
                c = w
        y = self.op("Flatten", [self.op("GlobalAveragePool", [y])], axis=1)
        fc_w = self._weight("fc.weight", self.rng.standard_normal((classes, c)) / np.sqrt(c))
        fc_b = self._weight("fc.bias", 0.01 * self.rng.standard_normal(classes))
        self.nodes.append(helper.make_node("Gemm", [y, fc_w, fc_b], ["logits"], name="fc", transB=1))
        return "logits"


def build_example_model(seed: int = 0, image: int = 128, widths: Sequence[int] = (32, 64, 128),
                        depths: Sequence[int] = (4, 3, 3), classes: int = 100) -> onnx.ModelProto:
    """A ResNet-style CNN: patchify stem, residual stages, global pool, classifier (fp32)."""
    b = _Builder(seed)
    x = "input"
    c = widths[0]
    # A 4x4 stride-4 stem keeps the full-resolution part cheap, as in ConvNeXt.
    y = b.op("Relu", [b.bn(b.conv(x, 3, c, 4, 4, pad=0), c)])
    b.stages_and_head(y, c, widths, depths, classes)
    graph = helper.make_graph(
        b.nodes, EXAMPLE_NAME,
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", 3, image, image])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        b.inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="ppiped example-model")
    model.ir_version = 8  # readable by onnxruntime >= 1.14 and TensorRT 8.6+
    onnx.checker.check_model(model)
    return model


def build_tiny_model(seed: int = 0) -> onnx.ModelProto:
    """A few-layer version for fast tests (same structure, 32x32 input)."""
    return build_example_model(seed, image=32, widths=(8, 16), depths=(2, 2), classes=10)


def parse_gpu_splits(text: str) -> list[tuple[str, list[int]]]:
    """'V100:1-4,P4:1' -> [('V100', [1, 2, 3, 4]), ('P4', [1])]."""
    from ..errors import InputError
    from .profile import MAX_SPLIT

    out = []
    for part in text.split(","):
        gpu, _, sp = part.partition(":")
        try:
            lo, _, hi = (sp or "1").partition("-")
            splits = list(range(int(lo), int(hi or lo) + 1))
        except ValueError:
            raise InputError(f"bad GPU spec {part!r}: expected NAME:1-4 or NAME:1") from None
        if not gpu or not splits or splits[0] < 1:
            raise InputError(f"bad GPU spec {part!r}: expected NAME:1-4 or NAME:1")
        if splits[-1] > MAX_SPLIT:
            raise InputError(f"bad GPU spec {part!r}: a GPU splits into at most {MAX_SPLIT} vGPUs")
        if any(g == gpu for g, _ in out):
            raise InputError(f"bad GPU spec {text!r}: {gpu} is given twice")
        out.append((gpu, splits))
    return out


def make_example(out_dir, gpus: str = "V100:1-4,P4:1", blocks: int = 10, max_batch: int = 8,
                 seed: int = 0, progress: bool = False):
    """Build the example model and its estimate profile for a small heterogeneous cluster.

    The first GPU listed is the SLO reference. Returns (profile, profile path, onnx path).
    """
    import tempfile
    from pathlib import Path

    from .profile import ProfileRequest, profile_model

    out_dir = Path(out_dir)
    specs = parse_gpu_splits(gpus)
    model = build_example_model(seed)
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / f"{EXAMPLE_NAME}.onnx"
        onnx.save(model, str(src))
        prof = path = None
        for k, (gpu, splits) in enumerate(specs):
            req = ProfileRequest(model_path=src, out_dir=out_dir, backend="estimate", gpu=gpu,
                                 blocks=blocks, max_batch=max_batch, splits=splits,
                                 replace=k == 0, slo_reference=specs[0][0], progress=progress,
                                 partition_cost="flops")
            prof, path = profile_model(req)
    assert prof is not None and path is not None
    return prof, path, out_dir / EXAMPLE_NAME / "model.onnx"


def example_with_model(directory: str | Path, scratch: str | Path) -> Path:
    """The example's profile path in ``directory`` when the model file it names is there, else
    the same files built in ``scratch``: model files are not committed, so a fresh clone has
    only the profile, and serving real inference needs the model."""
    import json

    path = Path(directory) / f"{EXAMPLE_NAME}.json"
    if path.is_file():
        onnx_rel = json.loads(path.read_text()).get("onnx")
        if onnx_rel and (path.parent / onnx_rel).is_file():
            return path
    return make_example(Path(scratch))[1]
