"""Calibration input for the block-equivalence check, and its range-relative metric."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ppiped.cli import main
from ppiped.errors import InputError
from ppiped.profiler.calibration import Calibration, ModelInput, check_equivalence, rebatch
from ppiped.profiler.example import build_tiny_model
from ppiped.profiler.export import chain_errors, range_relative_error
from ppiped.profiler.profile import ProfileRequest, profile_model

TINY_INPUT = ModelInput("input", (3, 32, 32), np.dtype(np.float32))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.onnx"
    onnx.save(build_tiny_model(), str(path))
    return path


def _profile(tiny: Path, out: Path, **kw):
    req = ProfileRequest(model_path=tiny, out_dir=out, backend="estimate", gpu="V100", blocks=3,
                         max_batch=kw.pop("max_batch", 3), progress=False, **kw)
    return profile_model(req)[0].extra["equivalence"]


def _save_png(path: Path, h: int, w: int, seed: int, mode: str = "RGB") -> None:
    from PIL import Image

    rng = np.random.default_rng(seed)
    a = rng.integers(0, 256, (h, w, 3) if mode == "RGB" else (h, w), dtype=np.uint8)
    Image.fromarray(a, mode).save(path)


# --- the metric -------------------------------------------------------------------------------

def test_metric_is_relative_to_the_output_range():
    rng = np.random.default_rng(0)
    whole = 1000.0 + rng.random((4, 10))  # a large constant offset, a signal of range ~1
    chain = whole.copy()
    chain[0, 0] += 0.05
    # max |whole| hides the error (5e-5, under the 1e-2 tolerance); the range shows it.
    assert 0.05 / np.max(np.abs(whole)) < 1e-4
    assert range_relative_error(chain, whole) == pytest.approx(0.05 / np.ptp(whole))
    assert range_relative_error(chain, whole) > 1e-2
    const = np.full((2, 3), -4.0)
    assert range_relative_error(const + 0.02, const) == pytest.approx(0.005)  # no range: / max |whole|
    zeros = np.zeros(3)
    assert range_relative_error(zeros + 0.5, zeros) == pytest.approx(0.5)
    assert np.isnan(range_relative_error(np.array([np.nan, 1.0]), np.array([0.0, 1.0])))
    with pytest.raises(InputError, match="shape"):
        range_relative_error(np.zeros(3), np.zeros(4))


def _offset_models(tmp_path: Path, scale_in_block: float) -> tuple[str, list[str]]:
    """Whole: y = 2x + 1000. Blocks: a = s * x, then y = a + 1000 (s = 2 is right)."""
    def model(nodes, inits, inp, out, name):
        g = helper.make_graph(nodes, name, [helper.make_tensor_value_info(inp, TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info(out, TensorProto.FLOAT, ["N", 4])],
                              [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in inits.items()])
        path = tmp_path / f"{name}.onnx"
        onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
        return str(path)

    whole = model([helper.make_node("Mul", ["x", "two"], ["a"]), helper.make_node("Add", ["a", "k"], ["y"])],
                  {"two": 2.0, "k": 1000.0}, "x", "y", "whole")
    b0 = model([helper.make_node("Mul", ["x", "s"], ["a"])], {"s": scale_in_block}, "x", "a", "b0")
    b1 = model([helper.make_node("Add", ["a", "k"], ["y"])], {"k": 1000.0}, "a", "y", "b1")
    return whole, [b0, b1]


def test_chain_with_a_wrong_block_behind_an_offset_fails(tmp_path):
    x = [np.random.default_rng(1).random((6, 4)).astype(np.float32)]
    whole, blocks = _offset_models(tmp_path, 2.0)
    errs, n = chain_errors(whole, blocks, x)
    assert n == 6 and errs["y"] < 1e-6
    whole, blocks = _offset_models(tmp_path, 2.1)
    errs, _ = chain_errors(whole, blocks, x)
    assert errs["y"] > 1e-2  # about 0.1 / range 2: the old max |whole| figure was 1e-4
    inp = ModelInput("x", (4,), np.dtype(np.float32))
    rec = check_equivalence(whole, blocks, inp, None, 8, 1e-2)
    assert rec["passed"] is False and rec["worst_output"] == "y" and rec["per_output"]["y"] > 1e-2
    assert rec["input"].startswith("random uniform [0,1)") and rec["batch"] == 2


# --- calibration files ------------------------------------------------------------------------

def test_profile_records_a_npy_calibration_file(tiny, tmp_path, capsys):
    cal = tmp_path / "cal.npy"
    np.save(cal, np.random.default_rng(0).random((7, 3, 32, 32)))  # float64: cast to the model's float32
    eq = _profile(tiny, tmp_path / "p", calibration=cal)
    assert eq["input"] == f"calibration: {cal}, 7 samples"
    assert eq["samples"] == 7 and eq["batch"] == 3 and eq["calibration"] == str(cal)
    assert eq["passed"] is True and eq["max_rel_error"] <= eq["tolerance"] == 1e-2
    assert set(eq["per_output"]) == {"logits"} and "max - min" in eq["metric"]
    rc = main(["profile", str(tiny), "--backend", "estimate", "--gpu", "T4", "--blocks", "3",
               "--batch-sizes", "1-2", "-o", str(tmp_path / "cli"), "-q", "--calibration", str(cal)])
    assert rc == 0 and f"calibration: {cal}, 7 samples" in capsys.readouterr().out


def test_profile_records_a_folder_of_npy_and_images(tiny, tmp_path):
    pytest.importorskip("PIL")
    d = tmp_path / "cal"
    d.mkdir()
    np.save(d / "a_one.npy", np.random.default_rng(0).random((3, 32, 32)).astype(np.float32))
    np.save(d / "b_batch.npy", np.random.default_rng(1).random((2, 3, 32, 32)).astype(np.float32))
    _save_png(d / "c.png", 40, 50, 2)  # resized to 32 x 32
    _save_png(d / "d.pgm", 32, 32, 3, mode="L")  # grey: replicated to RGB
    (d / "notes.txt").write_text("not a sample")
    eq = _profile(tiny, tmp_path / "p", calibration=d, max_batch=4)
    assert eq["input"] == f"calibration: {d}, 5 samples" and eq["passed"] is True
    xs = list(Calibration(d, TINY_INPUT).samples())
    assert [x.shape[0] for x in xs] == [1, 2, 1, 1]
    img = xs[2]
    assert img.shape == (1, 3, 32, 32) and img.dtype == np.float32 and 0.0 <= img.min() <= img.max() <= 1.0
    assert np.array_equal(xs[3][0, 0], xs[3][0, 2])


def test_calibration_errors_name_the_file(tiny, tmp_path, monkeypatch):
    bad = tmp_path / "bad.npy"
    np.save(bad, np.zeros((2, 3, 16, 16), np.float32))
    with pytest.raises(InputError, match=r"bad\.npy: shape \[2, 3, 16, 16\].*'input' wants \[3, 32, 32\]"):
        _profile(tiny, tmp_path / "p", calibration=bad)
    ints = tmp_path / "ints.npy"
    np.save(ints, np.zeros((3, 32, 32), np.int64))
    with pytest.raises(InputError, match=r"ints\.npy: dtype int64.*float32"):
        list(Calibration(ints, TINY_INPUT).samples())
    nan = tmp_path / "nan.npy"
    np.save(nan, np.full((3, 32, 32), np.nan, np.float32))
    with pytest.raises(InputError, match="NaN"):
        list(Calibration(nan, TINY_INPUT).samples())
    junk = tmp_path / "junk.npy"
    junk.write_bytes(b"not numpy")
    with pytest.raises(InputError, match=r"junk\.npy: not a readable"):
        list(Calibration(junk, TINY_INPUT).samples())
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match="no .npy or image files"):
        Calibration(tmp_path / "empty", TINY_INPUT)
    with pytest.raises(InputError, match="does not exist"):
        ProfileRequest(model_path=tiny, out_dir=tmp_path, calibration=tmp_path / "missing.npy")
    with pytest.raises(InputError, match="--no-verify"):
        ProfileRequest(model_path=tiny, out_dir=tmp_path, calibration=bad, verify=False)
    (tmp_path / "img").mkdir()
    img = tmp_path / "img" / "x.png"
    img.write_bytes(b"not a png")
    with pytest.raises(InputError, match=r"x\.png: cannot read the image"):
        list(Calibration(img.parent, TINY_INPUT).batches(2))
    with pytest.raises(InputError, match="images fit a float input"):
        list(Calibration(img, ModelInput("x", (4, 8, 8), np.dtype(np.float32))).samples())
    monkeypatch.setitem(sys.modules, "PIL", None)  # as if Pillow were not installed
    with pytest.raises(InputError, match=r"x\.png: reading images needs Pillow"):
        list(Calibration(img, TINY_INPUT).samples())


def test_without_calibration_the_profile_says_random(tiny, tmp_path):
    eq = _profile(tiny, tmp_path / "p")
    assert eq["input"].startswith("random uniform [0,1), 2 samples (no calibration input given)")
    assert eq["calibration"] is None and eq["passed"] is True


def test_a_failing_check_warns_naming_the_output(tiny, tmp_path, monkeypatch, capsys):
    import ppiped.profiler.export as export

    monkeypatch.setattr(export, "chain_errors", lambda whole, blocks, batches, varies, overflow: ({"logits": 0.25}, 2))
    eq = _profile(tiny, tmp_path / "p")
    assert eq["passed"] is False and eq["max_rel_error"] == 0.25
    err = capsys.readouterr().err
    assert "output 'logits' by 0.25 of its range, above 0.01" in err


def test_rebatch():
    chunks = [np.arange(n * 2).reshape(n, 2) for n in (1, 4, 2)]
    out = list(rebatch(chunks, 3))
    assert [len(b) for b in out] == [3, 3, 1]
    assert np.array_equal(np.concatenate(out), np.concatenate(chunks))
