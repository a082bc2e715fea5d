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
    """The second of three blocks of the tiny model: fp16 in, fp16 out, a residual stage inside."""
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
    inp = model.graph.input[0]
    shape = [2, *[d.dim_value for d in inp.type.tensor_type.shape.dim[1:]]]
    x = np.random.default_rng(0).standard_normal(shape).astype(np.float16)
    ref = ort.InferenceSession(str(middle_block), providers=["CPUExecutionProvider"]).run(None, {inp.name: x})[0]
    prog = OnnxProgram(onnx.load(str(middle_block)), torch, torch.nn.functional)
    with torch.inference_mode():
        got = prog.run(torch.from_numpy(x).cuda())[0].float().cpu().numpy()
    assert np.max(np.abs(got - ref.astype(np.float32))) / np.max(np.abs(ref)) < 1e-2
    rt = TorchRuntime()
    sess = rt.open(middle_block, 4)
    assert measure_us(sess, 4, Timing(rounds=3)) > 0
    sess.close()
