"""Bad models, flags and output paths given to ``profile``, ``example-model`` and ``example-app``
end in one line ``ppiped CMD: error: ...`` (exit 2), never a traceback, and leave nothing behind:
no half-written model folder, and a good profile that a failed ``--replace`` run meant to
overwrite stays byte-identical.

Each case runs the CLI in a subprocess with a timeout, on the example model built in a temporary
directory (and copies of it broken with the onnx package); profiles use the fast estimate backend.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import numpy as np
import onnx
import pytest
from conftest import assert_refused as refused
from conftest import run_cli
from onnx import TensorProto

ROOT = Path(__file__).resolve().parents[1]


def ppiped(argv: list[str], timeout: float = 120.0) -> subprocess.CompletedProcess[str]:
    return run_cli(["ppiped.cli", *argv], timeout)


def assert_refused(p: subprocess.CompletedProcess[str], fragment: str, rc: int = 2) -> None:
    refused(p, fragment, rc, prefix=f"ppiped {p.args[3]}: error: ")


def snapshot(d: Path) -> dict[str, bytes]:
    """Every file under ``d`` (hidden ones too) by relative path, with its bytes."""
    return {str(f.relative_to(d)): f.read_bytes() for f in sorted(d.rglob("*")) if f.is_file()} \
        if d.exists() else {}


def _edit(src: Path, dst: Path, fn) -> Path:
    m = onnx.load(str(src))
    fn(m)
    onnx.save(m, str(dst))
    return dst


@pytest.fixture(scope="module")
def work(tmp_path_factory) -> dict[str, Path]:
    """The example model and broken copies of it, and calibration files, in one folder."""
    d = tmp_path_factory.mktemp("bad_profile")
    p = ppiped(["example-model", "-o", str(d / "ex"), "--gpus", "V100:1"])
    assert p.returncode == 0, p.stderr
    good = d / "ex" / "example" / "model.onnx"

    def zero(m):
        m.graph.input[0].type.tensor_type.shape.dim[1].dim_value = 0

    def opset(m):
        m.opset_import[0].version = 99

    def int64(m):
        m.graph.input[0].type.tensor_type.elem_type = TensorProto.INT64

    def no_outputs(m):
        del m.graph.output[:]

    def wrong_output_shape(m):  # ONNX Runtime runs it anyway; served, it would be cut short
        dims = m.graph.output[0].type.tensor_type.shape.dim
        del dims[1:]
        dims.add().dim_value = 5

    files = {"good": good, "dir": d / "ex"}
    for name, fn in (("zero", zero), ("opset", opset), ("int64", int64), ("no_outputs", no_outputs),
                     ("wrong_output_shape", wrong_output_shape)):
        files[name] = _edit(good, d / f"{name}.onnx", fn)
    (d / "empty.onnx").write_bytes(b"")
    files["empty"] = d / "empty.onnx"
    np.save(d / "wrong_shape.npy", np.zeros((2, 3, 64, 64), np.float32))
    np.save(d / "nan.npy", np.full((2, 3, 128, 128), np.nan, np.float32))
    np.save(d / "ints.npy", np.zeros((2, 3, 128, 128), np.int32))
    np.save(d / "none.npy", np.zeros((0, 3, 128, 128), np.float32))
    (d / "notes.txt").write_text("not an array\n")
    (d / "no_images").mkdir()
    (d / "no_images" / "readme.txt").write_text("x\n")
    (d / "a_file").write_text("x\n")
    files["root"] = d
    return files


PROFILE = ["--backend", "estimate", "--gpu", "V100", "--batch-sizes", "1-2"]

# model variant, extra flags ({d}: the work folder), message fragment
PROFILE_CASES = {
    "zero-dim": ("zero", [], "size 0 at axis 1"),
    "opset-99": ("opset", [], "ONNX Runtime cannot load the model"),
    "int64-input": ("int64", [], "not a float"),
    "no-outputs": ("no_outputs", [], "no outputs"),
    "output-declared-wrong": ("wrong_output_shape", [], "is declared with shape [5] per request but the model computes"),
    "empty-file": ("empty", [], "not a valid ONNX model"),
    "directory": ("dir", [], "is a directory"),
    "blocks-0": ("good", ["--blocks", "0"], "argument --blocks"),
    "blocks-negative": ("good", ["--blocks", "-1"], "argument --blocks"),
    "partitions-reversed": ("good", ["--partitions", "4-0"], "reversed"),
    "partitions-empty": ("good", ["--partitions", "0-0"], "reversed or empty"),
    "partitions-too-far": ("good", ["--partitions", "0-100"], "blocks 0..9"),
    "input-shape-huge": ("good", ["--input-shape", "3x100000x100000"], "elements per sample"),
    "name-absolute": ("good", ["--name", "{d}/abs"], "not a plain file name"),
    "name-parent": ("good", ["--name", "../x"], "not a plain file name"),
    "name-empty": ("good", ["--name", ""], "not a plain file name"),
    "name-dot": ("good", ["--name", "."], "not a plain file name"),
    "rounds-0": ("good", ["--rounds", "0"], "argument --rounds"),
    "rounds-negative": ("good", ["--rounds", "-1"], "argument --rounds"),
    "threads-0": ("good", ["--threads", "0"], "argument --threads"),
    "threads-negative": ("good", ["--threads", "-3"], "argument --threads"),
    "splits-duplicate": ("good", ["--splits", "1,1"], "given twice"),
    "splits-huge": ("good", ["--splits", "1000"], "at most 8"),
    "batch-sizes-huge": ("good", ["--batch-sizes", "1-100000"], "at most 1-1024"),
    "slo-reference-unprofiled": ("good", ["--slo-reference", "P4"], "no latencies for it"),
    "calibration-shape": ("good", ["--calibration", "{d}/wrong_shape.npy"], "shape"),
    "calibration-nan": ("good", ["--calibration", "{d}/nan.npy"], "NaN"),
    "calibration-int": ("good", ["--calibration", "{d}/ints.npy"], "dtype int32"),
    "calibration-empty": ("good", ["--calibration", "{d}/none.npy"], "no samples"),
    "calibration-not-npy": ("good", ["--calibration", "{d}/notes.txt"], "expected a .npy file"),
    "calibration-no-images": ("good", ["--calibration", "{d}/no_images"], "holds no .npy or image"),
}


@pytest.mark.parametrize("case", list(PROFILE_CASES), ids=list(PROFILE_CASES))
def test_profile_refuses_and_leaves_nothing(work, tmp_path, case):
    variant, extra, fragment = PROFILE_CASES[case]
    out = tmp_path / "out"
    extra = [a.replace("{d}", str(work["root"])) for a in extra]
    p = ppiped(["profile", str(work[variant]), *PROFILE, "-o", str(out), *extra])
    assert_refused(p, fragment)
    assert snapshot(out) == {}, sorted(snapshot(out))  # no model folder, block files or temp dir
    assert not (work["root"] / "abs").exists() and not (ROOT.parent / "x").exists()


@pytest.mark.parametrize("variant,extra", [
    ("zero", []),
    ("opset", []),
    # other blocks, so files written before the failure would differ from the good ones
    ("good", ["--blocks", "5", "--calibration", "{d}/nan.npy"]),
    ("good", ["--blocks", "5", "--calibration", "{d}/none.npy"]),
    ("good", ["--blocks", "5", "--partitions", "0-8"]),
], ids=["zero-dim", "opset", "calibration-nan", "calibration-empty", "partitions"])
def test_failed_replace_keeps_the_good_profile(work, tmp_path, variant, extra):
    out = tmp_path / "ex2"
    base = ["profile", str(work["good"]), *PROFILE, "--name", "example", "-o", str(out)]
    assert ppiped([*base, "--partitions", "0-4"]).returncode == 0
    before = snapshot(out)
    assert "example/block_09.onnx" in before and "example/partition_00_04.onnx" in before
    extra = [a.replace("{d}", str(work["root"])) for a in extra]
    p = ppiped(["profile", str(work[variant]), *PROFILE, "--name", "example", "-o", str(out),
                "--replace", *extra])
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr[-2000:]
    assert snapshot(out) == before
    assert sorted(x.name for x in out.iterdir()) == ["example", "example.json"]


def test_merge_run_commits_and_cleans_up(work, tmp_path):
    """A second GPU type merges into the profile, keeps earlier partition files, no temp dir."""
    out = tmp_path / "m"
    base = ["profile", str(work["good"]), "--backend", "estimate", "--batch-sizes", "1-2",
            "--name", "example", "-o", str(out)]
    assert ppiped([*base, "--gpu", "V100", "--partitions", "0-4"]).returncode == 0
    p = ppiped([*base, "--gpu", "P4", "--slo-reference", "V100"])
    assert p.returncode == 0, p.stderr
    assert sorted(x.name for x in out.iterdir()) == ["example", "example.json"]
    assert (out / "example" / "partition_00_04.onnx").is_file()


def _out_cases(root: Path) -> dict[str, tuple[str, str]]:
    return {"file": (str(root / "a_file"), "not a directory"),
            "under-file": (str(root / "a_file" / "x"), "is a file, not a directory"),
            "uncreatable": ("/proc/ppiped-x", "cannot create")}


@pytest.mark.parametrize("cmd", ["profile", "example-model", "example-app"])
@pytest.mark.parametrize("where", ["file", "under-file", "uncreatable"])
def test_output_path_checked_first(work, cmd, where):
    path, fragment = _out_cases(work["root"])[where]
    argv = [cmd, "-o", path] + ([str(work["good"]), *PROFILE] if cmd == "profile" else [])
    p = ppiped(argv)
    assert_refused(p, fragment)
    assert (work["root"] / "a_file").read_text() == "x\n"


@pytest.mark.parametrize("cmd,extra,fragment", [
    ("example-model", ["--seed", "-1"], "argument --seed"),
    ("example-app", ["--seed", "-1"], "argument --seed"),
    ("example-model", ["--max-batch", "100000"], "argument --max-batch"),
    ("example-app", ["--max-batch", "100000"], "argument --max-batch"),
    ("example-model", ["--gpus", "V100:1-1000"], "at most 8"),
    ("example-model", ["--gpus", "V100:1,V100:2"], "given twice"),
], ids=["model-seed", "app-seed", "model-max-batch", "app-max-batch", "model-splits", "model-gpu-twice"])
def test_example_commands_refuse(tmp_path, cmd, extra, fragment):
    out = tmp_path / "o"
    p = ppiped([cmd, "-o", str(out), *extra])
    assert_refused(p, fragment)
    assert snapshot(out) == {}


def test_example_app_cluster_follows_gpus(tmp_path):
    out = tmp_path / "app"
    p = ppiped(["example-app", "-o", str(out), "--gpus", "P4:1", "--max-batch", "2"], timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    text = (out / "cluster.toml").read_text()
    assert "[gpus.P4]" in text and "V100" not in text
