"""The torch backend's ONNX interpreter against onnxruntime, on the CPU in fp32 (wherever PyTorch
is installed; CI has none, the GPU machine has it): the operators real exports carry beyond plain
CNN layers (Erf in GELU, ReduceMean, slices, gathers) and the shape arithmetic around a
batch-following Reshape or a Resize to an input's size, which the interpreter evaluates on the
host at each batch size."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from onnx import TensorProto, helper, numpy_helper

from ppiped.errors import InputError

torch = pytest.importorskip("torch")
from ppiped.profiler.backends.torch_cuda import OnnxProgram  # noqa: E402

C, H, W = 8, 6, 10


def _model(nodes, inits, out_shape_rank: int, opset: int = 17, name: str = "y") -> onnx.ModelProto:
    x = helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", C, H, W])
    y = helper.make_tensor_value_info(name, TensorProto.FLOAT, [None] * out_shape_rank)
    g = helper.make_graph(nodes, "g", [x], [y], [numpy_helper.from_array(v, k) for k, v in inits.items()])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)], ir_version=8)
    onnx.checker.check_model(m)
    return m


def _agree(m: onnx.ModelProto, batches=(1, 3)) -> None:
    prog = OnnxProgram(m, torch, torch.nn.functional, device="cpu", dtype=torch.float32)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    for bs in batches:
        x = np.random.default_rng(bs).standard_normal((bs, C, H, W)).astype(np.float32)
        want = sess.run(None, {"x": x})
        with torch.inference_mode():
            got = prog.run(torch.from_numpy(x))
        assert len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert tuple(g.shape) == w.shape
            np.testing.assert_allclose(g.numpy(), w, rtol=1e-5, atol=1e-5)


def _i64(*v):
    return np.array(v, dtype=np.int64)


def test_gelu_and_layer_mean():
    """ConvNeXt's GELU (Erf) and a ReduceMean with axes as attribute (opset 17) and as input (18)."""
    gelu = [helper.make_node("Div", ["x", "sq2"], ["d"]), helper.make_node("Erf", ["d"], ["e"]),
            helper.make_node("Add", ["e", "one"], ["e1"]), helper.make_node("Mul", ["x", "e1"], ["g"]),
            helper.make_node("Mul", ["g", "half"], ["gh"])]
    inits = {"sq2": np.array(1.4142135, np.float32), "one": np.array(1.0, np.float32),
             "half": np.array(0.5, np.float32)}
    _agree(_model([*gelu, helper.make_node("ReduceMean", ["gh"], ["y"], axes=[2, 3], keepdims=1)], inits, 4))
    _agree(_model([*gelu, helper.make_node("ReduceMean", ["gh", "ax"], ["y"], keepdims=0)],
                  {**inits, "ax": _i64(1, 3)}, 2, opset=18))


def test_batch_following_reshape_and_channel_split():
    """ShuffleNet's channel shuffle and split: the Reshape's shape and the Slice's bounds come
    from Shape(x) (the batch size among them), so they change with the batch."""
    nodes = [
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Gather", ["s", "i0"], ["n"], axis=0),
        helper.make_node("Gather", ["s", "i1"], ["c"], axis=0),
        helper.make_node("Div", ["c", "two"], ["c2"]),
        helper.make_node("Unsqueeze", ["n", "ax0"], ["nu"]),
        helper.make_node("Unsqueeze", ["c2", "ax0"], ["c2u"]),
        helper.make_node("Concat", ["nu", "twoa", "c2u", "hw"], ["shape"], axis=0),
        helper.make_node("Reshape", ["x", "shape"], ["r"]),
        helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1, 3, 4]),
        helper.make_node("Shape", ["x"], ["s2"]),
        helper.make_node("Reshape", ["t", "s2"], ["sh"]),
        helper.make_node("Slice", ["sh", "c2u", "big", "ax1"], ["y"]),  # the second half of the channels
    ]
    inits = {"i0": np.array(0, np.int64), "i1": np.array(1, np.int64), "two": np.array(2, np.int64),
             "ax0": _i64(0), "twoa": _i64(2), "hw": _i64(H, W), "big": _i64(2**63 - 1), "ax1": _i64(1)}
    _agree(_model(nodes, inits, 4))


def test_resize_to_a_computed_size_and_gathers_of_tensors():
    """A segmentation head resized to the input's own size (sizes = Concat(Shape(x)[:2], ...)),
    then a Gather of channels by a constant index list and of one row by a scalar index."""
    nodes = [
        helper.make_node("MaxPool", ["x"], ["p"], kernel_shape=[2, 2], strides=[2, 2]),
        helper.make_node("Shape", ["x"], ["s"]),
        helper.make_node("Slice", ["s", "z", "four"], ["hw4"]),
        helper.make_node("Resize", ["p", "", "", "hw4"], ["u"], mode="linear",
                         coordinate_transformation_mode="half_pixel"),
        helper.make_node("Gather", ["u", "ch"], ["gc"], axis=1),
        helper.make_node("Gather", ["gc", "row"], ["y"], axis=2),
    ]
    inits = {"z": _i64(0), "four": _i64(4), "ch": _i64(5, 0, -1), "row": np.array(-2, np.int64)}
    _agree(_model(nodes, inits, 3))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(-12, 12), st.integers(-12, 12), st.sampled_from([1, 2, -1, -3])),
                min_size=1, max_size=3, unique_by=lambda t: t),
       st.permutations([1, 2, 3]))
def test_slices_follow_onnx_semantics(bounds, axes):
    """Any starts, ends (past either end: clamped) and steps, negative ones included."""
    axes = axes[:len(bounds)]
    starts, ends, steps = (_i64(*(b[i] for b in bounds)) for i in range(3))
    nodes = [helper.make_node("Slice", ["x", "st", "en", "ax", "sp"], ["y"])]
    _agree(_model(nodes, {"st": starts, "en": ends, "ax": _i64(*axes), "sp": steps}, 4), batches=(2,))


def test_a_shape_computed_from_tensor_values_is_refused_by_name():
    """A Reshape whose shape is read off the data (not off shapes) cannot be replayed from a CUDA
    graph: the program refuses it when built, naming the node."""
    nodes = [helper.make_node("ReduceMean", ["x"], ["m"], axes=[1, 2, 3], keepdims=0),
             helper.make_node("Cast", ["m"], ["mi"], to=TensorProto.INT64),
             helper.make_node("Concat", ["mi", "rest"], ["shape"], axis=0),
             helper.make_node("Reshape", ["x", "shape"], ["y"], name="data_reshape")]
    m = _model(nodes, {"rest": _i64(-1)}, 2)
    with pytest.raises(InputError, match="Reshape node data_reshape .* computed from tensor values"):
        OnnxProgram(m, torch, torch.nn.functional, device="cpu", dtype=torch.float32)


def test_a_node_that_fails_at_run_time_is_named():
    """A broken export (a Reshape to a size the tensor does not have) fails as a one-line error
    naming the node, not as a torch traceback from inside the interpreter."""
    m = _model([helper.make_node("Reshape", ["x", "shape"], ["y"], name="bad_reshape")], {"shape": _i64(7, -1)}, 2)
    prog = OnnxProgram(m, torch, torch.nn.functional, device="cpu", dtype=torch.float32)
    with pytest.raises(InputError, match="failed on Reshape node bad_reshape: RuntimeError"):
        prog.run(torch.zeros((1, C, H, W)))
