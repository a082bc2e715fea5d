"""The profiler against a zoo of realistic small models (issue #15): each profiles on CPU with its
blocks equal to the whole model, or is refused at profile time with a message saying what to do,
never only when an executor loads it."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from zoo import INPUT_SHAPES, ZOO

from ppiped.cli import main
from ppiped.errors import InputError
from ppiped.executor.onnxio import prepare_partition
from ppiped.profiler.backends import Timing
from ppiped.profiler.export import partition_from_profile
from ppiped.profiler.graph import analyze, parse_shape
from ppiped.profiler.profile import ProfileRequest, profile_model, units_of
from ppiped.profiles import Profile, load_profile
from ppiped.realcheck import one_vgpu_plan

FAST = Timing(warmup_s=0.0, round_s=0.0, rounds=1)
BLOCKS = 4
# Models that must profile as they are; dynamic_output and two_inputs have their own tests.
PROFILED = ["constant_weights", "fpn", "yolo", "dynamic_hw", "attention"]


def largest_span_share(model: onnx.ModelProto, input_shape: tuple[int, ...] | None = None,
                       **analyze_opts: int) -> float:
    """Share of the model's FLOPs in its costliest uncuttable span (layers between consecutive
    valid cuts): no partition can balance blocks finer than that."""
    g = analyze(model, input_shape, **analyze_opts)
    spans = [sum(la.flops for la in g.layers[s:e]) for s, e in units_of(g)]
    return max(spans) / g.total_flops


def _shape(name: str) -> tuple[int, ...] | None:
    return parse_shape(INPUT_SHAPES[name]) if name in INPUT_SHAPES else None


def _save(d: Path, name: str) -> Path:
    path = d / f"{name}.onnx"
    onnx.save(ZOO[name](), str(path))
    return path


def _scenes(n: int, shape: tuple[int, ...]) -> np.ndarray:
    """Image-like calibration frames: smooth gradients with bright rectangles (text lines,
    objects) on them, in [0, 1]; what a detector's output responds to, unlike noise."""
    rng = np.random.default_rng(11)
    c, h, w = shape
    yy, xx = np.mgrid[0:h, 0:w] / max(h, w)
    out = np.empty((n, c, h, w), dtype=np.float32)
    for i in range(n):
        img = 0.3 + 0.3 * (np.cos(3 * xx + i) * np.sin(2 * yy - i))
        for _ in range(4):
            y0, x0 = rng.integers(0, h - h // 4), rng.integers(0, w - w // 4)
            img[y0:y0 + h // 6 + 1, x0:x0 + w // 3 + 1] = rng.uniform(0.7, 1.0)
        out[i] = np.clip(img, 0, 1)[None] * rng.uniform(0.8, 1.0, (c, 1, 1))
    return out


def _request(path: Path, out: Path, **kw) -> ProfileRequest:
    opts = {"backend": "ort", "blocks": BLOCKS, "max_batch": 2, "splits": [1], "timing": FAST,
            "threads": 1, "progress": False, **kw}
    return ProfileRequest(model_path=path, out_dir=out, **opts)


def _load_partitions(path: Path, prof: Profile) -> None:
    """What an ort executor does with each block a plan could give it: cut, check, open."""
    n = prof.num_blocks
    for i in range(n):
        part = prepare_partition(partition_from_profile(str(path), i, i + 1), f"{path}[{i}:{i + 1}]",
                                 first=i == 0, last=i == n - 1)
        ort.InferenceSession(part.onnx_bytes, providers=["CPUExecutionProvider"])


@pytest.fixture(scope="module")
def profiled(tmp_path_factory):
    """Profile each model once per module run; tests share the result."""
    done: dict[str, tuple[Profile, Path]] = {}

    def get(name: str) -> tuple[Profile, Path]:
        if name not in done:
            d = tmp_path_factory.mktemp(name)
            model = _save(d, name)
            shape = _shape(name) or tuple(int(x.dim_value) for x in
                                          ZOO[name]().graph.input[0].type.tensor_type.shape.dim[1:])
            np.save(d / "calibration.npy", _scenes(4, shape))
            _, path = profile_model(_request(model, d / "profiles", input_shape=_shape(name),
                                             calibration=d / "calibration.npy"))
            done[name] = (load_profile(path), path)
        return done[name]

    return get


# --- the zoo itself -------------------------------------------------------------------------

@pytest.mark.parametrize("name", list(ZOO))
def test_zoo_models_are_valid_and_run_at_batch_1_and_2(name):
    m = ZOO[name]()
    onnx.checker.check_model(m, full_check=True)
    assert m.ir_version == 8 and m.opset_import[0].version == 17
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    fixed = _shape(name)
    for bs in (1, 2):
        feeds = {}
        for i in sess.get_inputs():
            assert i.shape[0] == "N"
            shape = [bs, *(fixed or i.shape[1:])]
            feeds[i.name] = np.random.default_rng(bs).standard_normal(shape).astype(np.float32)
        for o in sess.run(None, feeds):
            assert o.shape[0] == bs and np.all(np.isfinite(o))


def test_zoo_structure():
    const = ZOO["constant_weights"]()
    assert not const.graph.initializer
    assert sum(n.op_type == "Constant" for n in const.graph.node) >= 8
    dims = ZOO["dynamic_hw"]().graph.input[0].type.tensor_type.shape.dim
    assert [d.dim_param for d in dims[2:]] == ["H", "W"]
    topk = ZOO["dynamic_output"]()
    topk.graph.output[0].type.tensor_type.ClearField("shape")
    out = onnx.shape_inference.infer_shapes(topk, data_prop=True).graph.output[0]
    assert out.name == "peaks" and not out.type.tensor_type.shape.dim[1].HasField("dim_value")
    assert len(ZOO["two_inputs"]().graph.input) == 2
    for name in PROFILED:
        flops = analyze(ZOO[name](), _shape(name)).total_flops
        assert 2e5 < flops < 1e7, f"{name}: {flops / 1e6:.2f} MFLOPs"


# --- profiling ------------------------------------------------------------------------------

@pytest.mark.parametrize("name", PROFILED)
def test_profiles_with_ort_and_blocks_match_the_model(name, profiled):
    prof, _ = profiled(name)
    assert prof.num_blocks == BLOCKS and prof.gpus == ["CPU"]
    assert prof.latency["CPU"][1].shape == (BLOCKS, 2)
    eq = prof.extra["equivalence"]
    assert eq["max_rel_error"] <= 1e-2 and eq["passed"] and eq["samples"] == 4
    assert eq["input"].startswith("calibration:")


@pytest.mark.parametrize("name", PROFILED)
def test_executor_loads_every_block(name, profiled):
    prof, path = profiled(name)
    _load_partitions(path, prof)


def test_two_inputs_refused_naming_the_inputs(tmp_path):
    path = _save(tmp_path, "two_inputs")
    with pytest.raises(InputError, match="image_a.*image_b"):
        profile_model(_request(path, tmp_path / "profiles"))


def test_dynamic_hw_needs_input_shape(tmp_path, profiled):
    path = _save(tmp_path, "dynamic_hw")
    with pytest.raises(InputError, match=r"dynamic dimension 'H'.*--input-shape"):
        profile_model(_request(path, tmp_path / "profiles"))
    prof, _ = profiled("dynamic_hw")
    assert prof.extra["input"]["shape"] == [3, 64, 64]


def test_cli_refusals_are_one_line_errors(tmp_path, capsys):
    for name, want in [("two_inputs", "image_a"), ("dynamic_hw", "--input-shape")]:
        rc = main(["profile", str(_save(tmp_path, name)), "-o", str(tmp_path / "p"), "--blocks", "4",
                   "--batch-sizes", "1-2", "--rounds", "1", "-q"])
        err = capsys.readouterr().err
        assert rc == 2 and want in err and "Traceback" not in err


@pytest.mark.parametrize("cut_opts", [{}, {"max_cut_tensors": 1}], ids=["default", "single_tensor"])
def test_dynamic_output_is_refused_up_front(tmp_path, cut_opts):
    """An output dim only known at run time ("K") has no fixed size per request: the profiler
    says so, naming the tensor and what to do, instead of an executor failing at serving time."""
    path = _save(tmp_path, "dynamic_output")
    with pytest.raises(InputError, match=r"output 'peaks' has no fixed size per request.*fixed-size output"):
        profile_model(_request(path, tmp_path / "profiles", **cut_opts))


def test_cuts_carry_only_batched_feature_maps():
    """Masks, counts and other tensors without a batch axis never cross a cut, whatever K."""
    m = ZOO["dynamic_output"]()
    m.graph.output[0].type.tensor_type.shape.dim[1].Clear()
    m.graph.output[0].type.tensor_type.shape.dim[1].dim_value = 1
    topk = next(n for n in m.graph.node if n.op_type == "TopK")
    # stands in for a head whose size is fixed: everything before the data-dependent TopK
    g = analyze(_truncated_before(m, topk), max_cut_tensors=8)
    for c in g.cuts:
        for t in c.tensors:
            assert g.dtypes[t] in (onnx.TensorProto.FLOAT, onnx.TensorProto.FLOAT16), t
            assert g.shapes[t][0] == 1


def _truncated_before(m: onnx.ModelProto, node: onnx.NodeProto) -> onnx.ModelProto:
    """The model up to (not including) ``node``, whose first input becomes the output."""
    out_name = node.input[0]
    keep = []
    for n in m.graph.node:
        if n is node or n == node:
            break
        keep.append(n)
    out = onnx.ModelProto()
    out.CopyFrom(m)
    del out.graph.node[:]
    out.graph.node.extend(keep)
    del out.graph.output[:]
    out.graph.output.append(onnx.helper.make_empty_tensor_value_info(out_name))
    return out


# --- structure: what single-tensor cuts cannot split ----------------------------------------

@pytest.mark.parametrize("name", ["fpn", "yolo"])
def test_skip_connections_leave_a_large_span_with_single_tensor_cuts(name):
    assert largest_span_share(ZOO[name](), max_cut_tensors=1) > 0.4


@pytest.mark.parametrize("name", ["fpn", "yolo"])
def test_multi_tensor_cuts_split_skip_connections(name, tmp_path):
    """With K = 4 no uncuttable span holds more than a quarter of the FLOPs, and ten blocks
    balance within 50 % of the mean."""
    assert largest_span_share(ZOO[name]()) <= 0.25
    prof, _ = profile_model(ProfileRequest(model_path=_save(tmp_path, name), out_dir=tmp_path / "p",
                                           backend="estimate", gpu="T4", blocks=10, max_batch=1,
                                           partition_cost="flops", progress=False, verify=False))
    part = prof.extra["partitioning"]
    assert part["max_deviation_from_mean"] <= 0.5, part
    assert max(part["cut_tensors"]) > 1  # some boundary needs more than one tensor


@pytest.mark.parametrize("name", ["fpn", "yolo"])
def test_a_block_no_cut_can_split_is_named(name, tmp_path, capsys):
    """At K = 1 the skip connections leave a span of over 40 % of the FLOPs uncuttable: the
    profile records that block and warns, naming the flag that may split it; at K = 4 (the
    default) the blocks balance and nothing is reported."""
    def profile(k: int) -> dict:
        prof, _ = profile_model(ProfileRequest(model_path=_save(tmp_path, name), out_dir=tmp_path / f"p{k}",
                                               backend="estimate", gpu="T4", blocks=10, max_batch=1,
                                               partition_cost="flops", progress=False, verify=False,
                                               max_cut_tensors=k))
        return prof.extra["partitioning"]

    part = profile(1)
    span = part["uncuttable"]
    assert span["share"] > 0.4 and span["share"] == pytest.approx(max(part["block_cost"]) / sum(part["block_cost"]), abs=1e-3)
    err = capsys.readouterr().err
    assert f"block {span['block']} (layers {span['layers'][0]}-{span['layers'][1] - 1}" in err
    assert "no valid cut inside with at most 1 tensors crossing" in err and "--max-cut-tensors" in err
    assert "uncuttable" not in profile(4)
    assert "no valid cut inside" not in capsys.readouterr().err


# --- serving: every zoo model through ort executors ------------------------------------------

def _two_partition_model(name: str, prof: Profile) -> dict:
    """The model cut in two at its boundary with the most tensors (so hops carry several), each
    partition on one CPU vGPU."""
    cut = max(range(1, prof.num_blocks), key=lambda b: (len(prof.extra["blocks"][b - 1]["outputs"]), -abs(b - 2)))
    plan = one_vgpu_plan(prof, [((0, cut), "CPU"), ((cut, prof.num_blocks), "CPU")])
    return plan["models"][0]


def test_zoo_served_end_to_end_equal_to_the_whole_model(profiled):
    """All five profiled models in one plan, each cut in two, served by ort executors: every
    output equals whole-model ONNX Runtime within 1e-2 of the output's range."""
    import json
    import shutil

    from ppiped.client import Client
    from ppiped.daemon.launch import LocalCluster, short_tmpdir, write_config

    with short_tmpdir("ppiped-zoo-") as d:
        d = Path(d)
        profiles = d / "profiles"
        profiles.mkdir()
        models, whole, cuts = [], {}, {}
        for name in PROFILED:
            prof, path = profiled(name)
            shutil.copy(path, profiles / path.name)
            shutil.copytree(path.parent / name, profiles / name)
            spec = _two_partition_model(name, prof)
            models.append(spec)
            cuts[name] = len(prof.extra["blocks"][spec["pipelines"][0]["partitions"][0]["blocks"][1] - 1]["outputs"])
            whole[name] = ort.InferenceSession(str(profiles / name / "model.onnx"), providers=["CPUExecutionProvider"])
        assert max(cuts.values()) > 1, cuts  # some hop carries several tensors
        n = 2 * len(models)
        plan = {"format": "ppiped-plan/1", "algo": "hand",
                "cluster": {"nic_gbps": 10.0, "gpus": {"CPU": {"count": n, "per_server": n, "splits": [1]}}},
                "params": {"slo_scale": None, "slo_reference_gpu": None},
                "objective": {"normalized_throughput": 1.0}, "models": models}
        (d / "plan.json").write_text(json.dumps(plan))
        cfg = write_config(d, d / "plan.json", profiles, backend="ort", scheduler={"wait_guard_us": 1e6})
        with LocalCluster(cfg, [list(range(n))]) as c, Client(c.client_endpoint, timeout_s=60) as cl:
            info = cl.info()["models"]
            for name in PROFILED:
                shape = info[name]["input"]["shape"]
                x = np.random.default_rng(7).uniform(0, 1, (4, *shape)).astype(np.float32)
                out = cl.submit_many(name, [xi.tobytes() for xi in x])
                want = whole[name].run(None, {whole[name].get_inputs()[0].name: x})
                for i, r in enumerate(out):
                    got = r.arrays()
                    assert len(got) == len(want), name
                    for y, w in zip(got, want, strict=True):
                        scale = float(w.max() - w.min()) or 1.0
                        assert float(np.abs(y.reshape(w[i].shape) - w[i]).max()) <= 1e-2 * scale, name


def _fp16_classifier() -> onnx.ModelProto:
    """A small CNN in half precision throughout, input included (as fp16 exports are)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(4)
    inits, nodes, x, cin = [], [], "image", 3
    for i, cout in enumerate((8, 8, 16, 16)):
        w = (rng.standard_normal((cout, cin, 3, 3)) * np.sqrt(2 / (9 * cin))).astype(np.float16)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes += [helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], name=f"conv{i}", kernel_shape=[3, 3],
                                   pads=[1, 1, 1, 1], strides=[2 if i == 2 else 1] * 2),
                  helper.make_node("Relu", [f"c{i}"], [f"r{i}"], name=f"relu{i}")]
        x, cin = f"r{i}", cout
    g = helper.make_graph(nodes, "fp16", [helper.make_tensor_value_info("image", TensorProto.FLOAT16, ["N", 3, 16, 16])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT16, ["N", 16, 8, 8])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_realcheck_serves_a_half_precision_model(tmp_path):
    """serve_and_compare sends frames in the model's own input type (fp16 here), not float32."""
    from ppiped.daemon.launch import short_tmpdir
    from ppiped.realcheck import serve_and_compare

    path = tmp_path / "fp16.onnx"
    onnx.save(_fp16_classifier(), path)
    _, prof_path = profile_model(_request(path, tmp_path / "profiles", blocks=3))
    assert load_profile(prof_path).input_spec()["dtype"] == "float16"
    with short_tmpdir("ppiped-f16-") as d:
        check = serve_and_compare(Path(d), prof_path, [((0, 1), "CPU"), ((1, 3), "CPU")], frames=4)
    assert check.errors == [] and check.equal, check


def _blow_up_model() -> onnx.ModelProto:
    """Six 3x3 convolutions; the third's output is scaled by 1e6 and the fourth's back by 1e-6,
    so the feature maps between them pass fp16's range while every output stays O(1)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(2)
    inits, nodes, x = [], [], "image"
    for i in range(6):
        cin = 3 if i == 0 else 8
        w = (rng.standard_normal((8, cin, 3, 3)) * np.sqrt(2 / (9 * cin))).astype(np.float32)
        inits.append(numpy_helper.from_array(w, f"w{i}"))
        nodes.append(helper.make_node("Conv", [x, f"w{i}"], [f"c{i}"], name=f"conv{i}", kernel_shape=[3, 3],
                                      pads=[1, 1, 1, 1]))
        x = f"c{i}"
        if i in (2, 3):
            inits.append(numpy_helper.from_array(np.array(1e6 if i == 2 else 1e-6, np.float32), f"s{i}"))
            nodes.append(helper.make_node("Mul", [x, f"s{i}"], [f"m{i}"], name=f"scale{i}"))
            x = f"m{i}"
        nodes.append(helper.make_node("Relu", [x], [f"r{i}"], name=f"relu{i}"))
        x = f"r{i}"
    g = helper.make_graph(nodes, "blowup", [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["N", 3, 8, 8])],
                          [helper.make_tensor_value_info(x, TensorProto.FLOAT, ["N", 8, 8, 8])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_cuts_whose_fp16_hop_spoils_the_outputs_are_never_planned(tmp_path, capsys):
    """The profile finds which cuts pass a feature map past fp16 (each cut alone against the
    whole model), records them, warns naming them, and exits 0: the planner never cuts there,
    and ``check`` flags a plan that does; every other cut stays usable."""
    from ppiped.cluster import cluster_from_json
    from ppiped.plan import PlanParams, check, plan_from_json
    from ppiped.planner.api import algo_configs

    path = tmp_path / "blowup.onnx"
    onnx.save(_blow_up_model(), path)
    _, prof_path = profile_model(_request(path, tmp_path / "profiles", blocks=6))
    prof = load_profile(prof_path)
    eq = prof.extra["equivalence"]
    unsafe = prof.unsafe_cuts()
    assert unsafe and not eq["passed"] and set(eq["unsafe_cuts"]) == unsafe
    assert all(eq["cut_errors"][str(c)] is None or eq["cut_errors"][str(c)] > eq["tolerance"] for c in unsafe)
    safe = set(range(1, prof.num_blocks)) - unsafe
    assert safe and all(eq["cut_errors"][str(c)] <= eq["tolerance"] for c in safe)
    assert "plans will not cut there" in capsys.readouterr().err
    cluster = cluster_from_json({"nic_gbps": 10, "gpus": {"CPU": {"count": 4, "per_server": 4, "splits": [1]}}})
    params = PlanParams(slo_scale=None, slo_reference_gpu=None, max_partitions=prof.num_blocks)
    cuts = {s.start for c in algo_configs(prof, cluster, params, "ppipe", 1e9, 10.0) for s in c.segments[1:]}
    assert cuts and cuts <= safe
    rules = {c: [v.rule for v in check(plan_from_json(one_vgpu_plan(prof, [((0, c), "CPU"),
                                                                          ((c, prof.num_blocks), "CPU")]), "hand"),
                                          {prof.model: prof})]
             for c in (min(unsafe), min(safe))}
    assert "unsafe-cut" in rules[min(unsafe)] and "unsafe-cut" not in rules[min(safe)]


def test_realcheck_refuses_an_unprofiled_batch_size_by_name():
    from ppiped.errors import InputError as Refused

    lat = {"CPU": {1: np.full((2, 1), 100.0)}}
    prof = Profile("m", 2, lat, np.array([1000.0]), {"CPU": 200.0})
    with pytest.raises(Refused, match="batch size 2 is not profiled on CPU"):
        one_vgpu_plan(prof, [((0, 1), "CPU"), ((1, 2), "CPU")], batch_size=2)
