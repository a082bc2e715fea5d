"""The example app of issue #17: a detector-like CNN, crop glue, a classifier CNN, built from code.

Neither model is trained. The detector is the example's residual backbone (seeded random
weights, so it costs what a real one would and splits the same way) with one channel wired as a
luminance path: the stem makes channel 0 the patch brightness above a background level, every
residual branch leaves channel 0 alone and every down-sampling shortcut blurs it. The head reads
that channel with fixed 5x5 kernels on a 16x16 grid (stride 8): ``heat`` is the objectness of a
blurred bright blob (plus a little of the random channels, so the output depends on the whole
feature map), ``boxes`` its centroid and extent in frame pixels. So bright objects on a dark
frame give boxes, their number varies with the frame, and the outputs are a deterministic
function of the seed. The classifier is a small residual CNN on 3x32x32 crops (10 logits).

Frames (:func:`example_frames`) are synthetic: a dark, noisy gradient with a few bright
rectangles and a dim one the detector should miss.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..query.example_glue import CROP_SHAPE, FRAME_SHAPE, OUTPUT_NAMES
from .example import OPSET, _Builder

DETECTOR = "detector"
CLASSIFIER = "classifier"
APP = "detect-classify"
GLUE = "ppiped.query.example_glue:crop"
STRIDE = 8  # frame pixels per grid cell
BACKGROUND = 0.2  # luminance the stem subtracts (the frames' background stays below it)
HEAT_GAIN, HEAT_BIAS = 14.0, 3.5  # heat = sigmoid(GAIN * blurred luminance - BIAS + random part)
RANDOM_MIX = 0.02  # weight of each random channel in the heat logit
EPS = 1e-3
DETECTOR_BLOCKS, CLASSIFIER_BLOCKS = 10, 6
FANOUT_FRAMES = 32  # frames measured for the app's fan-out
SLO_SCALE = 5.0  # the app's SLO: this many times the stages' whole-model latencies, plus glue
APP_GLUE_MS = 2.0  # crop() takes ~0.4 ms (median), ~1 ms (p90) on a busy 2-core VM, plus IPC
CLUSTER_TOML = """\
# The small cluster the example app is planned on: two V100s beside six P4s.
nic_gbps = 10

[gpus.V100]
count = 2
per_server = 2
splits = [1, 2, 3, 4]

[gpus.P4]
count = 6
per_server = 2
splits = [1]
"""


DEFAULT_COUNTS = {"V100": 2, "P4": 6}
"""GPUs of each type in the example cluster (other types: two each, one server)."""


def cluster_toml(specs: Sequence[tuple[str, Sequence[int]]]) -> str:
    """The cluster file for the GPU types and splits of ``--gpus`` (the default ones give
    :data:`CLUSTER_TOML`), named as the profiles key them."""
    from .gpus import gpu_spec

    if [(g, list(sp)) for g, sp in specs] == [("V100", [1, 2, 3, 4]), ("P4", [1])]:
        return CLUSTER_TOML
    parts = []
    lines = ["nic_gbps = 10"]
    for gpu, splits in specs:
        name = gpu_spec(gpu).name
        count = DEFAULT_COUNTS.get(name, 2)
        parts.append(f"{count} x {name}")
        lines += ["", f"[gpus.{name}]", f"count = {count}", "per_server = 2",
                  f"splits = [{', '.join(str(v) for v in splits)}]"]
    return f"# The cluster the example app is planned on (--gpus): {', '.join(parts)}.\n" + \
        "\n".join(lines) + "\n"


class _AppBuilder(_Builder):
    """The example's builder with explicit weights, for the detector's wired channel."""

    def he(self, cin: int, cout: int, k: int) -> np.ndarray:
        return self.rng.standard_normal((cout, cin, k, k)) * np.sqrt(2.0 / (cin * k * k))

    def conv_w(self, x: str, w: np.ndarray, stride: int = 1, pad: int | None = None,
               bias: np.ndarray | None = None) -> str:
        name = self._name("conv")
        k = w.shape[-1]
        ins = [x, self._weight(f"{name}.weight", w)]
        if bias is not None:
            ins.append(self._weight(f"{name}.bias", bias))
        p = k // 2 if pad is None else pad
        out = f"{name}.out"
        self.nodes.append(helper.make_node("Conv", ins, [out], name=name, kernel_shape=[k, k],
                                           strides=[stride, stride], pads=[p, p, p, p]))
        return out

    def bn_params(self, c: int, gamma: float = 1.0) -> list[np.ndarray]:
        r = self.rng
        return [gamma * (1.0 + 0.1 * r.standard_normal(c)), 0.1 * r.standard_normal(c),
                0.1 * r.standard_normal(c), r.uniform(0.8, 1.2, c)]

    def bn_p(self, x: str, p: Sequence[np.ndarray]) -> str:
        name = self._name("bn")
        ins = [x, *(self._weight(f"{name}.{k}", a) for k, a in zip(("scale", "bias", "mean", "var"), p, strict=True))]
        out = f"{name}.out"
        self.nodes.append(helper.make_node("BatchNormalization", ins, [out], name=name, epsilon=1e-5))
        return out

    def const(self, name: str, a: np.ndarray, dtype: Any = np.float32) -> str:
        self.inits.append(numpy_helper.from_array(np.asarray(a, dtype=dtype), name))
        return name


def _identity_ch0(p: list[np.ndarray]) -> list[np.ndarray]:
    """BatchNorm parameters that pass channel 0 through unchanged."""
    scale, bias, mean, var = (a.copy() for a in p)
    scale[0], bias[0], mean[0], var[0] = 1.0, 0.0, 0.0, 1.0 - 1e-5
    return [scale, bias, mean, var]


def _luma_block(b: _AppBuilder, x: str, cin: int, cout: int, stride: int) -> str:
    """A residual block whose channel 0 is its input's channel 0 (blurred when down-sampling)."""
    y = b.op("Relu", [b.bn_p(b.conv_w(x, b.he(cin, cout, 3), stride), b.bn_params(cout))])
    p2 = b.bn_params(cout, gamma=0.5)
    p2[0][0], p2[1][0] = 0.0, 0.0  # the branch adds nothing to channel 0
    y = b.bn_p(b.conv_w(y, b.he(cout, cout, 3)), p2)
    if stride == 1 and cin == cout:
        short = x
    else:
        w = b.he(cin, cout, 3)
        w[0] = 0.0
        w[0, 0] = np.outer([1, 2, 1], [1, 2, 1]) / 16.0  # a tent blur of channel 0
        short = b.bn_p(b.conv_w(x, w, stride), _identity_ch0(b.bn_params(cout)))
    return b.op("Relu", [b.op("Add", [y, short])])


def _head_kernels(c: int, rng: np.random.Generator) -> tuple[np.ndarray, np.ndarray]:
    """The 5x5 head conv over the features: 7 maps of the luminance channel (see the module
    docstring), plus a small random read of the other channels in the heat logit."""
    d = np.arange(-2, 3, dtype=np.float64)
    g1 = np.exp(-(d ** 2) / 2.0)
    gauss = np.outer(g1, g1) / np.outer(g1, g1).sum()
    w = np.zeros((7, c, 5, 5))
    w[0, 0] = HEAT_GAIN * gauss
    w[0, 1:, 2, 2] = RANDOM_MIX * rng.standard_normal(c - 1)
    w[1, 0] = 1.0  # window mass
    w[2, 0] = STRIDE * d[None, :]  # x moment, in pixels
    w[3, 0] = STRIDE * d[:, None]  # y moment
    w[4, 0, 2, :] = STRIDE  # row through the cell: extent in x
    w[5, 0, :, 2] = STRIDE  # column: extent in y
    w[6, 0, 2, 2] = 1.0  # the cell itself
    bias = np.array([-HEAT_BIAS, EPS, 0, 0, 0, 0, EPS])
    return w, bias


def build_detector(seed: int = 0, image: int = FRAME_SHAPE[1], widths: Sequence[int] = (24, 48),
                   depths: Sequence[int] = (4, 6)) -> onnx.ModelProto:
    """The detector-like CNN: ``frame`` [N, 3, H, W] -> ``heat`` [N, 1, G, G] (objectness in
    [0, 1]) and ``boxes`` [N, 4, G, G] (centre x, centre y, width, height in frame pixels)."""
    b = _AppBuilder(seed)
    c = widths[0]
    w = b.he(3, c, 4)
    w[0] = 1.0 / 48.0  # channel 0: mean brightness of the 4x4 patch
    p = _identity_ch0(b.bn_params(c))
    p[1][0] = -BACKGROUND
    y = b.op("Relu", [b.bn_p(b.conv_w("frame", w, 4, pad=0), p)])
    for s, (width, depth) in enumerate(zip(widths, depths, strict=True)):
        for i in range(depth):
            y = _luma_block(b, y, c, width, 2 if s > 0 and i == 0 else 1)
            c = width
    grid = image // STRIDE
    kw, kb = _head_kernels(c, b.rng)
    k = b.conv_w(y, kw, bias=kb)
    parts = [f"head.{n}" for n in ("score", "mass", "mx", "my", "rx", "ry", "centre")]
    b.nodes.append(helper.make_node("Split", [k, b.const("head.split", [1] * 7, np.int64)], parts,
                                    name="head.split", axis=1))
    score, mass, mx, my, rx, ry, centre = parts
    b.nodes.append(helper.make_node("Sigmoid", [score], [OUTPUT_NAMES[0]], name="heat"))
    pos = (np.arange(grid) + 0.5) * STRIDE
    cx = b.op("Add", [b.op("Div", [mx, mass]), b.const("head.gx", pos.reshape(1, 1, 1, grid))])
    cy = b.op("Add", [b.op("Div", [my, mass]), b.const("head.gy", pos.reshape(1, 1, grid, 1))])
    lo, hi = b.const("head.min", float(STRIDE)), b.const("head.max", float(8 * STRIDE))
    bw = b.op("Clip", [b.op("Div", [rx, centre]), lo, hi])
    bh = b.op("Clip", [b.op("Div", [ry, centre]), lo, hi])
    b.nodes.append(helper.make_node("Concat", [cx, cy, bw, bh], [OUTPUT_NAMES[1]], name="boxes", axis=1))
    graph = helper.make_graph(
        b.nodes, DETECTOR,
        [helper.make_tensor_value_info("frame", TensorProto.FLOAT, ["batch", 3, image, image])],
        [helper.make_tensor_value_info(OUTPUT_NAMES[0], TensorProto.FLOAT, ["batch", 1, grid, grid]),
         helper.make_tensor_value_info(OUTPUT_NAMES[1], TensorProto.FLOAT, ["batch", 4, grid, grid])],
        b.inits,
    )
    return _finish(graph)


def build_classifier(seed: int = 0, image: int = CROP_SHAPE[1], widths: Sequence[int] = (32, 64, 128),
                     depths: Sequence[int] = (2, 2, 2), classes: int = 10) -> onnx.ModelProto:
    """The classifier: ``crop`` [N, 3, 32, 32] -> ``logits`` [N, classes]; a 3x3 stride-2 stem,
    then residual stages of equal FLOPs per block, as the example."""
    b = _AppBuilder(seed + 1)
    c = widths[0]
    y = b.op("Relu", [b.bn(b.conv("crop", 3, c, 3, 2), c)])
    b.stages_and_head(y, c, widths, depths, classes)
    graph = helper.make_graph(
        b.nodes, CLASSIFIER,
        [helper.make_tensor_value_info("crop", TensorProto.FLOAT, ["batch", 3, image, image])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        b.inits,
    )
    return _finish(graph)


def _finish(graph: onnx.GraphProto) -> onnx.ModelProto:
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)],
                              producer_name="ppiped example-app")
    model.ir_version = 8  # as the example: onnxruntime >= 1.14, TensorRT 8.6+
    onnx.checker.check_model(model)
    return model


def example_scenes(n: int, seed: int = 0, shape: tuple[int, int, int] = FRAME_SHAPE
                   ) -> tuple[np.ndarray, list[list[tuple[int, int, int, int, float]]]]:
    """``n`` synthetic frames [n, 3, H, W] float32 in [0, 1] and their rectangles (x0, y0, x1, y1,
    mean brightness), painted in order: a dark noisy gradient, 0-6 bright rectangles (12-40 px)
    and one dim one, last, which the detector should miss."""
    rng = np.random.default_rng(seed)
    c, H, W = shape
    yy, xx = np.mgrid[0:H, 0:W] / max(H, W)
    frames = np.empty((n, c, H, W), dtype=np.float32)
    scenes = []
    for f in frames:
        f[:] = 0.04 + 0.06 * (rng.uniform() * xx + rng.uniform() * yy) + 0.02 * rng.standard_normal((c, H, W))
        paint = [(rng.uniform(0.6, 1.0, c), int(rng.integers(12, 41)), int(rng.integers(12, 41)))
                 for _ in range(int(rng.integers(0, 7)))]
        paint.append((rng.uniform(0.15, 0.25, c), int(rng.integers(12, 41)), int(rng.integers(12, 41))))
        rects = []
        for colour, h, w in paint:
            y0, x0 = int(rng.integers(0, H - h)), int(rng.integers(0, W - w))
            f[:, y0:y0 + h, x0:x0 + w] = colour[:, None, None]
            rects.append((x0, y0, x0 + w, y0 + h, float(colour.mean())))
        np.clip(f, 0.0, 1.0, out=f)
        scenes.append(rects)
    return frames, scenes


def example_frames(n: int, seed: int = 0) -> np.ndarray:
    """The frames of :func:`example_scenes`: what the app's fan-out is measured on."""
    return example_scenes(n, seed)[0]


def measure_fanout(detector_path: str | Path, frames: np.ndarray) -> list[int]:
    """Crops per frame: the detector run whole with ONNX Runtime, then the glue."""
    import onnxruntime as ort

    from ..query.example_glue import crop

    so = ort.SessionOptions()
    so.log_severity_level = 4  # errors reach the caller as exceptions, in its own words
    sess = ort.InferenceSession(str(detector_path), so, providers=["CPUExecutionProvider"])
    names = [o.name for o in sess.get_outputs()]
    outs = sess.run(None, {sess.get_inputs()[0].name: frames})
    return [len(crop({k: v[i] for k, v in zip(names, outs, strict=True)}, frames[i]))
            for i in range(len(frames))]


def app_slo_ms(stage_us: Sequence[float]) -> float:
    """``SLO_SCALE`` x the stages' whole-model latencies on the reference GPU plus one glue step,
    rounded up to 0.5 ms (as PPipe sets a model's SLO from its latency)."""
    return math.ceil((SLO_SCALE * sum(stage_us) / 1e3 + APP_GLUE_MS) * 2) / 2


def apps_toml(fanout: int, measured: Sequence[int], slo_ms: float) -> str:
    """The app file: the two stages, the glue, the measured fan-out (rounded), one SLO."""
    mean = sum(measured) / max(1, len(measured))
    return f"""\
# The example app of issue #17 (written by `ppiped example-app`): a detector, then a classifier
# on each box it finds, cropped by the glue. fanout: crops per frame, the mean over
# {len(measured)} seeded example frames ({mean:.3f}, min {min(measured)}, max {max(measured)}), rounded.
# slo_ms: {SLO_SCALE:g} x the two models' whole latencies on the SLO reference GPU, plus glue_ms.

[[apps]]
name = "{APP}"
slo_ms = {slo_ms}
glue_ms = {APP_GLUE_MS}

[[apps.stages]]
name = "detect"
model = "{DETECTOR}"

[[apps.stages]]
name = "classify"
model = "{CLASSIFIER}"
after = "detect"
fanout = {fanout}
glue = "{GLUE}"
"""


def make_example_app(out_dir: str | Path, gpus: str = "V100:1-4,P4:1", max_batch: int = 8,
                     seed: int = 0, progress: bool = False) -> dict[str, Any]:
    """Write both models' profiles and model directories, ``apps.toml`` and ``cluster.toml`` to
    ``out_dir``; returns what was written and the measured fan-out."""
    import tempfile

    from .example import parse_gpu_splits
    from .profile import ProfileRequest, profile_model

    out = Path(out_dir)
    specs = parse_gpu_splits(gpus)
    profiles = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, model, blocks in ((DETECTOR, build_detector(seed), DETECTOR_BLOCKS),
                                    (CLASSIFIER, build_classifier(seed), CLASSIFIER_BLOCKS)):
            src = Path(tmp) / f"{name}.onnx"
            onnx.save(model, str(src))
            for k, (gpu, splits) in enumerate(specs):
                req = ProfileRequest(model_path=src, out_dir=out, backend="estimate", gpu=gpu,
                                     blocks=blocks, max_batch=max_batch, splits=splits,
                                     replace=k == 0, slo_reference=specs[0][0], progress=progress,
                                     partition_cost="flops")
                profiles[name] = profile_model(req)
    counts = measure_fanout(out / DETECTOR / "model.onnx", example_frames(FANOUT_FRAMES, seed))
    fanout = max(1, round(sum(counts) / len(counts)))
    ref = specs[0][0]
    slo = app_slo_ms([profiles[m][0].whole_model_latency_us[ref] for m in (DETECTOR, CLASSIFIER)])
    (out / "apps.toml").write_text(apps_toml(fanout, counts, slo))
    (out / "cluster.toml").write_text(cluster_toml(specs))
    return {"profiles": profiles, "fanout": fanout, "counts": counts,
            "mean": sum(counts) / len(counts), "apps": out / "apps.toml", "cluster": out / "cluster.toml"}
