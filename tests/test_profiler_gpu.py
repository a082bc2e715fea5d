"""GPU timing backends on a real block: TensorRT (needs tensorrt + pycuda) and torch-CUDA.

Skipped on machines without them; run on a GPU machine with ``pytest -m gpu``.
"""

from __future__ import annotations

import importlib.util

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from conftest import cuda_torch

from ppiped.profiler.example import build_tiny_model
from ppiped.profiler.export import Exporter
from ppiped.profiler.graph import analyze
from ppiped.profiler.profile import make_blocks, units_of

pytestmark = pytest.mark.gpu


def _has_trt() -> bool:
    return all(importlib.util.find_spec(m) is not None for m in ("tensorrt", "pycuda")) and _pycuda_sees_gpu()


def _pycuda_sees_gpu() -> bool:
    try:
        import pycuda.driver as cuda

        cuda.init()
        return cuda.Device.count() > 0
    except Exception:
        return False


@pytest.fixture
def middle_block(tmp_path):
    """The second of three blocks of the tiny model: fp16 in, fp16 out, a residual stage inside;
    with cuts of several tensors (the default) it takes two."""
    g = analyze(build_tiny_model())
    units = units_of(g)
    third = len(units) // 3
    ranges = [(units[0][0], units[third][0]), (units[third][0], units[2 * third][0]),
              (units[2 * third][0], units[-1][1])]
    ex = Exporter(g.model, make_blocks(g, ranges))
    path = tmp_path / "block_01.onnx"
    onnx.save(ex.partition(1, 2), str(path))
    return path


@pytest.mark.skipif(not _has_trt(), reason="needs tensorrt, pycuda and an NVIDIA GPU")
def test_trt_builds_and_runs_a_block_engine(middle_block):
    from ppiped.profiler.backends import Timing, measure_us
    from ppiped.profiler.backends.trt import TrtRuntime

    rt = TrtRuntime()
    sess = rt.open(middle_block, 4)
    assert rt.engine_path(middle_block, 4).exists()  # cached for the concurrent copies
    t1 = measure_us(sess, 1, Timing(rounds=3))
    t4 = measure_us(sess, 4, Timing(rounds=3))
    assert t1 > 0 and t4 > 0
    sess.close()
    assert rt.info()["library"].startswith("tensorrt")


@pytest.mark.skipif(not cuda_torch(), reason="needs PyTorch with a CUDA GPU")
def test_torch_backend_matches_onnxruntime(middle_block):
    import torch

    from ppiped.profiler.backends import Timing, measure_us
    from ppiped.profiler.backends.torch_cuda import OnnxProgram, TorchRuntime

    model = onnx.load(str(middle_block))
    rng = np.random.default_rng(0)
    feeds = {i.name: rng.standard_normal([2, *[d.dim_value for d in i.type.tensor_type.shape.dim[1:]]])
             .astype(np.float16) for i in model.graph.input}
    assert len(feeds) == 2
    ref = ort.InferenceSession(str(middle_block), providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    prog = OnnxProgram(onnx.load(str(middle_block)), torch, torch.nn.functional)
    with torch.inference_mode():
        got = prog.run(*(torch.from_numpy(feeds[n]).cuda() for n in prog.inputs))[0].float().cpu().numpy()
    assert np.max(np.abs(got - ref.astype(np.float32))) / np.max(np.abs(ref)) < 1e-2
    rt = TorchRuntime()
    sess = rt.open(middle_block, 4)
    assert measure_us(sess, 4, Timing(rounds=3)) > 0
    sess.close()


@pytest.mark.skipif(not cuda_torch(), reason="needs PyTorch with a CUDA GPU")
@pytest.mark.parametrize("build", ["fpn", "yolo", "attention", "constant_weights"])
def test_torch_program_runs_exported_detector_shapes_like_onnxruntime(build):
    """Resize, ConvTranspose, Reshape/Transpose heads, attention (Softmax, LayerNormalization,
    Squeeze) and Constant nodes, as real exported detectors and recognizers have them: the
    whole model in fp16 on the GPU against ONNX Runtime in fp32."""
    import torch
    import zoo

    from ppiped.profiler.backends.torch_cuda import OnnxProgram

    model = getattr(zoo, build)()
    rng = np.random.default_rng(1)
    feeds = {}
    for i in model.graph.input:
        dims = [d.dim_value if d.dim_value > 0 else 2 for d in i.type.tensor_type.shape.dim]
        feeds[i.name] = rng.random(dims).astype(np.float32)
    refs = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    prog = OnnxProgram(model, torch, torch.nn.functional)
    with torch.inference_mode():
        got = prog.run(*(torch.from_numpy(feeds[n]).cuda().half() for n in prog.inputs))
    assert len(got) == len(refs)
    for g, r in zip(got, refs, strict=True):
        g = g.float().cpu().numpy()
        assert g.shape == r.shape
        span = float(r.max() - r.min()) or 1.0
        assert float(np.abs(g - r).max()) / span < 2e-2, build
