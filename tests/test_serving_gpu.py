"""The GPU backends on a real GPU: two partitions of the tiny CNN, the fp16 boundary made on the
GPU, results against ONNX Runtime on the whole model. ``trt`` needs TensorRT and pycuda, ``torch``
PyTorch with CUDA; each test is skipped where its library or a GPU is missing.

Also runs as a script (``python tests/test_serving_gpu.py [trt|torch]``) on a GPU host without pytest.
"""

from __future__ import annotations

import concurrent.futures
import sys
import tempfile
from pathlib import Path

import numpy as np

try:
    import pytest
except ImportError:  # the script form
    pytest = None


def run_check(tmp: Path, kind: str) -> dict:
    from ppiped.executor import tiny
    from ppiped.executor.backends import make_backend
    from ppiped.executor.onnxio import load_model_file
    from ppiped.wire import Assignment

    paths = tiny.write_partitions(tmp)
    lat = [100.0] * 8
    a0 = Assignment(0, "tiny", 0, 0, 0, 1, "GPU", 1, 0, False, lat, [0.0] * 8)
    a1 = Assignment(1, "tiny", 0, 1, 1, 2, "GPU", 1, 0, True, lat, [0.0] * 8)
    pools = [concurrent.futures.ThreadPoolExecutor(1) for _ in range(2)]  # one CUDA context each

    def backend(a, key, engine):
        p = paths[key]
        return make_backend(kind, a, (lambda: load_model_file(p), str(p)), engine_path=tmp / engine)

    b0, b1 = backend(a0, "0-1", "p0.engine"), backend(a1, "1-2", "p1.engine")
    pools[0].submit(b0.load).result()
    pools[1].submit(b1.load).result()
    x = np.random.default_rng(0).standard_normal((5, *tiny.INPUT_SHAPE)).astype(np.float32)
    frames = [xi.tobytes() for xi in x]
    f0, m0, bad0 = pools[0].submit(b0.run, frames + [b"short"], None, 6).result()
    f1, m1, bad1 = pools[1].submit(b1.run, f0, m0, 5).result()
    import onnxruntime as ort

    sess = ort.InferenceSession(str(paths["whole"]), providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": x})[0]
    got = np.stack([np.frombuffer(f, dtype=np.float32) for f in f1])
    err = float(np.abs(got - want).max() / np.abs(want).max())
    # a second load of the same partition (trt: finds the engine in the cache)
    b2 = backend(a0, "0-1", "p0.engine")
    pools[0].submit(b2.load).result()
    f2, m2, _ = pools[0].submit(b2.run, frames, None, 5).result()
    out = {"boundary_meta": m0, "bad_first_hop": bad0, "result_meta": m1, "max_rel_err": err,
           "reload_same": bytes(f2[0]) == bytes(f0[0]) and m2 == m0,
           "engines": sorted(p.name for p in tmp.glob("*.engine"))}
    for b, pool in ((b0, pools[0]), (b2, pools[0]), (b1, pools[1])):
        pool.submit(b.close).result()
    return out


def check(out: dict, kind: str) -> None:
    assert out["boundary_meta"][0][0] == "<f2", out  # the feature map left the GPU as fp16
    assert out["boundary_meta"][0][1] == [5, 8, 16, 16]
    assert [i for i, _ in out["bad_first_hop"]] == [5]
    assert out["result_meta"] == [["<f4", [10], "logits"]]
    assert out["max_rel_err"] < 2e-2, out
    assert out["reload_same"], out
    assert len(out["engines"]) == (2 if kind == "trt" else 0)


if pytest is not None:
    from conftest import cuda_torch

    @pytest.mark.gpu
    def test_trt_partitions_match_ort(tmp_path):
        pytest.importorskip("tensorrt")
        pytest.importorskip("pycuda.driver")
        check(run_check(tmp_path, "trt"), "trt")

    @pytest.mark.gpu
    @pytest.mark.skipif(not cuda_torch(), reason="needs PyTorch with a CUDA GPU")
    def test_torch_partitions_match_ort(tmp_path):
        check(run_check(tmp_path, "torch"), "torch")


if __name__ == "__main__":
    kind = sys.argv[1] if len(sys.argv) > 1 else "trt"
    with tempfile.TemporaryDirectory() as d:
        res = run_check(Path(d), kind)
    print(res)
    check(res, kind)
    print(f"{kind} backend OK")
    sys.exit(0)
