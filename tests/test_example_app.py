"""The example app of #17: deterministic models, crop glue, and the by-hand reference runner."""

from __future__ import annotations

import glob
import hashlib
import json
from pathlib import Path

import numpy as np
import onnxruntime as ort
import pytest

from ppiped.cli import main
from ppiped.profiler.example_app import (
    CLASSIFIER,
    DETECTOR,
    build_classifier,
    build_detector,
    example_frames,
    example_scenes,
)
from ppiped.query import example_glue
from ppiped.query.example_glue import CROP_SHAPE, crop, decode
from ppiped.query.local import LocalApp, model_paths, run_local
from ppiped.query.split import load_apps

PLANS = Path(__file__).resolve().parent.parent / "plans" / "example-app"


def _session(path: Path) -> ort.InferenceSession:
    so = ort.SessionOptions()
    so.log_severity_level = 3
    so.intra_op_num_threads = 1
    return ort.InferenceSession(str(path), so, providers=["CPUExecutionProvider"])


def _run(sess: ort.InferenceSession, x: np.ndarray) -> dict[str, np.ndarray]:
    outs = sess.run(None, {sess.get_inputs()[0].name: x})
    return {o.name: v for o, v in zip(sess.get_outputs(), outs, strict=True)}


def _digests(d: Path) -> dict[str, str]:
    return {str(p.relative_to(d)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(d.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def built(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("app") / "example-app"
    assert main(["example-app", "-o", str(d)]) == 0
    return d


@pytest.fixture(scope="module")
def det_outputs(built):
    frames, scenes = example_scenes(16, 0)
    out = _run(_session(built / DETECTOR / "model.onnx"), frames)
    per = [{k: v[i] for k, v in out.items()} for i in range(len(frames))]
    return frames, scenes, per


def test_deterministic(built, tmp_path, capsys):
    assert build_detector(0).SerializeToString() == build_detector(0).SerializeToString()
    assert build_classifier(0).SerializeToString() == build_classifier(0).SerializeToString()
    assert build_detector(1).SerializeToString() != build_detector(0).SerializeToString()
    again = tmp_path / "example-app"
    assert main(["example-app", "-o", str(again)]) == 0
    assert "fan-out: " in capsys.readouterr().out
    first = _digests(built)
    assert first == _digests(again)
    assert {"apps.toml", "cluster.toml", "detector.json", "classifier.json", "detector/model.onnx",
            "detector/block_09.onnx", "classifier/block_05.onnx"} <= set(first)
    # The committed files are what the command writes (the equivalence figure is ORT's).
    assert (PLANS / "apps.toml").read_text() == (built / "apps.toml").read_text()
    assert (PLANS / "cluster.toml").read_text() == (built / "cluster.toml").read_text()
    for name in (DETECTOR, CLASSIFIER):
        a, b = (json.loads((d / f"{name}.json").read_text()) for d in (PLANS, built))
        a.pop("equivalence")
        b.pop("equivalence")
        assert a == b
    # Same outputs on a rebuild's model.
    x = example_frames(2, 3)
    a, b = (_run(_session(d / DETECTOR / "model.onnx"), x) for d in (built, again))
    assert all(np.array_equal(a[k], b[k]) for k in a)


def test_app_file(built):
    (app,) = load_apps(built / "apps.toml")
    assert [s.model for s in app.stages] == [DETECTOR, CLASSIFIER]
    assert app.stages[1].glue == "ppiped.query.example_glue:crop" and app.stages[1].fanout >= 1
    cls = _session(built / CLASSIFIER / "model.onnx").get_inputs()[0]
    assert tuple(cls.shape[1:]) == CROP_SHAPE and cls.type == "tensor(float)"
    det = _session(built / DETECTOR / "model.onnx")
    assert tuple(det.get_inputs()[0].shape[1:]) == example_glue.FRAME_SHAPE
    assert tuple(o.name for o in det.get_outputs()) == example_glue.OUTPUT_NAMES


def test_glue_crops(det_outputs):
    frames, scenes, per = det_outputs
    counts = []
    hits = total = 0
    for f, rects, out in zip(frames, scenes, per, strict=True):
        crops = crop(out, f)
        boxes = decode(out)
        assert len(crops) == len(boxes) <= example_glue.TOP_K
        counts.append(len(crops))
        for c in crops:
            assert c.shape == CROP_SHAPE and c.dtype == np.float32
            assert c.min() >= 0.0 and c.max() <= 1.0
        for b in boxes:
            ious = example_glue._iou_matrix(np.array([b[:4], *[r[:4] for r in rects]], dtype=np.float64))[0, 1:]
            hits += bool(ious.size and ious.max() > 0.3)
            total += 1
    assert len(set(counts)) >= 3 and 0 in counts
    assert 1.0 <= np.mean(counts) <= 6.0
    assert hits >= 0.75 * total  # boxes land on the painted rectangles
    # The worker pool's calling form: outputs as a list in model order, a spec, a raw frame.
    i = int(np.argmax(counts))
    out = per[i]
    listed = crop([out[n] for n in example_glue.OUTPUT_NAMES], np.frombuffer(frames[i].tobytes(), np.uint8), None)
    assert len(listed) == counts[i]
    assert all(np.array_equal(a, b) for a, b in zip(listed, crop(out, frames[i]), strict=True))


def test_crop_resize():
    f = np.zeros((3, 128, 128), np.float32)
    f[:, 40:72, 20:52] = np.arange(32, dtype=np.float32)[None, None, :] / 32
    c = example_glue.resize_crop(f, (20, 40, 52, 72))  # a 32x32 box: resampled exactly
    assert np.allclose(c, f[:, 40:72, 20:52])


def test_local_composes(built, det_outputs):
    frames, _, per = det_outputs
    (app,) = load_apps(built / "apps.toml")
    paths = model_paths(app, built)
    local = LocalApp(app, paths)
    det, cls = _session(paths[DETECTOR]), _session(paths[CLASSIFIER])
    counts = [len(decode(o)) for o in per]
    for i in (int(np.argmax(counts)), counts.index(0)):
        got = local.run(frames[i], keep_all=True)
        # By hand, step by step: the detector on the frame, the glue as a worker calls it (a list
        # in model order, the frame decoded from its bytes, the spec), the classifier on each crop.
        d = _run(det, frames[i][None])
        d = {k: v[0] for k, v in d.items()}
        crops = crop([d[n] for n in example_glue.OUTPUT_NAMES], frames[i], local.specs[1])
        assert got[0].stage == "detect" and got[0].key == () and not got[0].final
        assert all(np.array_equal(got[0].outputs[k], d[k]) for k in d)
        leaves = got[1:]
        assert [(r.stage, r.key, r.final) for r in leaves] == [("classify", (j,), True) for j in range(len(crops))]
        for r, c in zip(leaves, crops, strict=True):
            want = _run(cls, c[None])["logits"][0]
            np.testing.assert_allclose(r.outputs["logits"], want, rtol=1e-5, atol=1e-5)
        assert [r.key for r in run_local(app, frames[i], paths)] == [r.key for r in leaves]


def test_local_calls_glue_as_the_worker_pool_does(built, det_outputs):
    """LocalApp calls ``fn(outputs list, frame, spec)`` through glue.run_glue, with the spec the
    daemon builds from the profiles, and holds the children to the same contract."""
    from ppiped.profiles import load_profile
    from ppiped.query.glue import GlueError, glue_spec

    frames, _, per = det_outputs
    (app,) = load_apps(built / "apps.toml")
    local = LocalApp(app, model_paths(app, built))
    served = {m: load_profile(built / f"{m}.json").input_spec() for m in (DETECTOR, CLASSIFIER)}
    assert local.specs[1] == glue_spec(app, 1, served)  # the daemon's spec (Queries._spec)
    assert local.specs[1].shape == CROP_SHAPE and local.specs[1].frame_shape == example_glue.FRAME_SHAPE
    calls = []

    def record(outputs, frame, spec):
        calls.append((outputs, frame, spec))
        return crop(outputs, frame, spec)

    i = int(np.argmax([len(decode(o)) for o in per]))
    want = local.run(frames[i])
    local.glue[1] = record
    assert [(r.key, r.outputs["logits"].tobytes()) for r in local.run(frames[i])] == \
        [(r.key, r.outputs["logits"].tobytes()) for r in want]
    [(outputs, frame, spec)] = calls
    assert isinstance(outputs, list) and [o.shape for o in outputs] == [per[i][n].shape for n in example_glue.OUTPUT_NAMES]
    assert all(np.array_equal(o, per[i][n]) for o, n in zip(outputs, example_glue.OUTPUT_NAMES, strict=True))
    assert frame.shape == example_glue.FRAME_SHAPE and frame.dtype == np.float32 and not frame.flags.writeable
    assert np.array_equal(frame, frames[i]) and spec.stage == "classify" and spec.parent == "detect"
    local.glue[1] = lambda outputs, frame, spec: [np.zeros(7, np.float32)]  # the wrong size
    with pytest.raises(GlueError, match="stage 'classify': child 0 has 28 bytes"):
        local.run(frames[i])
    local.glue[1] = lambda outputs, frame: []  # the old two-argument form fails as it would served
    with pytest.raises(TypeError):
        local.run(frames[i])


def _chain(block_paths: list[str], x: np.ndarray) -> dict[str, np.ndarray]:
    feed = {"_": x}
    for k, p in enumerate(block_paths):
        s = _session(Path(p))
        feed = _run(s, x if k == 0 else feed[s.get_inputs()[0].name])
    return feed


def test_blocks_equal_whole_on_real_frames(built, det_outputs):
    frames, _, per = det_outputs
    blocks = sorted(glob.glob(str(built / DETECTOR / "block_*.onnx")))
    assert len(blocks) == 10
    chained = _chain(blocks, frames)
    crops = []
    for i, whole in enumerate(per):
        assert set(chained) == set(whole)
        for k in whole:
            scale = float(np.ptp(whole[k])) or 1.0
            assert np.max(np.abs(chained[k][i] - whole[k])) / scale <= 1e-2
        got = decode({k: v[i] for k, v in chained.items()})
        want = decode(whole)
        assert len(got) == len(want)  # fp16 boundaries change no box
        if want:
            assert np.max(np.abs(np.array(got) - np.array(want))) < 0.5
        crops.extend(crop(whole, frames[i]))
    assert max(float(o["heat"].max()) for o in per) > 0.9  # the check is not on an empty map
    x = np.stack(crops)
    cblocks = sorted(glob.glob(str(built / CLASSIFIER / "block_*.onnx")))
    assert len(cblocks) == 6
    whole = _run(_session(built / CLASSIFIER / "model.onnx"), x)["logits"]
    chained_c = _chain(cblocks, x)["logits"]
    assert np.max(np.abs(chained_c - whole)) / float(np.ptp(whole)) <= 1e-2
    assert np.array_equal(chained_c.argmax(1), whole.argmax(1))


def test_glue_under_the_worker_pool_contract(det_outputs):
    """ppiped.query.glue calls ``fn(outputs list, frame, spec)`` on a result's bytes and meta."""
    from ppiped.query.glue import GlueSpec, run_glue

    frames, _, per = det_outputs
    i = int(np.argmax([len(decode(o)) for o in per]))
    outs = [np.ascontiguousarray(per[i][n]) for n in example_glue.OUTPUT_NAMES]
    meta = [[o.dtype.str, list(o.shape), n] for o, n in zip(outs, example_glue.OUTPUT_NAMES, strict=True)]
    spec = GlueSpec("detect-classify", "classify", "detect", CLASSIFIER, CROP_SHAPE, "float32",
                    int(np.prod(CROP_SHAPE)) * 4, example_glue.FRAME_SHAPE, "float32")
    kids = run_glue(crop, b"".join(o.tobytes() for o in outs), meta, frames[i].tobytes(), spec, 16)
    assert kids == [c.tobytes() for c in crop(per[i], frames[i])] and len(kids) >= 2
