"""The offline phase: cut points, pre-partitioning, sub-model export, block equivalence, profiles."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from ppiped.cli import main
from ppiped.errors import InputError
from ppiped.profiler.backends import Timing
from ppiped.profiler.backends import estimate as est
from ppiped.profiler.example import build_tiny_model, parse_gpu_splits
from ppiped.profiler.export import Exporter, chain_error, partition_from_profile
from ppiped.profiler.gpus import gpu_name_from_device, gpu_spec
from ppiped.profiler.graph import analyze, parse_shape
from ppiped.profiler.partition import block_costs, choose_cuts, max_deviation
from ppiped.profiler.profile import (
    ProfileRequest,
    make_blocks,
    parse_batch_sizes,
    parse_splits,
    profile_model,
    units_of,
)
from ppiped.profiles import load_profile

FAST = Timing(warmup_s=0.0, round_s=0.0, rounds=1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("tiny") / "tiny.onnx"
    onnx.save(build_tiny_model(), str(path))
    return path


def _chain_model(skip_all: bool = False, custom_op: bool = False, dynamic_hw: bool = False) -> onnx.ModelProto:
    """x -> Relu -> Relu -> Relu -> (+ x if skip_all): a skip over everything leaves no valid cut."""
    nodes = [helper.make_node("Relu", ["x"], ["a"], name="r0"),
             helper.make_node("Relu", ["a"], ["b"], name="r1"),
             helper.make_node("Relu", ["b"], ["c"], name="r2")]
    if skip_all:
        nodes.append(helper.make_node("Add", ["c", "x"], ["y"], name="add"))
    else:
        nodes.append(helper.make_node("Identity", ["c"], ["y"], name="id"))
    if custom_op:
        nodes[1] = helper.make_node("FancyOp", ["a"], ["b"], name="r1", domain="com.example")
    dims = ["N", 4, "H", 8] if dynamic_hw else ["N", 4, 8, 8]
    g = helper.make_graph(nodes, "chain", [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, dims)])
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid("com.example", 1)] if custom_op else [])
    return helper.make_model(g, opset_imports=opsets, ir_version=8)


# --- graph analysis -------------------------------------------------------------------------

def test_cut_points_skip_residual_interiors(tiny):
    g = analyze(onnx.load(str(tiny)), max_cut_tensors=1)  # PPipe's rule
    ops = [la.op for la in g.layers]
    after = [c.after for c in g.cuts]
    # Every valid cut follows a stem layer, a residual Add or its Relu, or the pooling head.
    assert {ops[k] for k in after} <= {"Conv", "BatchNormalization", "Relu", "Add", "GlobalAveragePool",
                                       "Flatten"}
    for k in after:
        if ops[k] in ("Conv", "BatchNormalization"):
            assert k < 3, "convolutions inside residual blocks must not be cut after"
    adds = [i for i, op in enumerate(ops) if op == "Add"]
    assert all(a in after for a in adds)
    # Inside a residual block two tensors are live (branch and shortcut): no cut there.
    first_block = range(adds[0] - 5, adds[0])
    assert not set(first_block) & set(after)
    for c in g.cuts:
        assert len(c.tensors) == 1 and c.fp16_bytes == 2 * c.elems[0]
    assert g.cut_at(adds[0]).tensors == (g.layers[adds[0]].outputs[0],)
    # With two tensors allowed, a residual block's interior is cuttable: branch and shortcut cross.
    g2 = analyze(onnx.load(str(tiny)), max_cut_tensors=2)
    assert set(after) < {c.after for c in g2.cuts}
    inner = [c for c in g2.cuts if c.after in first_block]
    assert inner and all(len(c.tensors) == 2 for c in inner)
    assert all(c.fp16_bytes == 2 * sum(c.elems) for c in inner)


def test_cut_points_ignore_weights_and_count_graph_inputs():
    g = analyze(_chain_model())
    assert [c.after for c in g.cuts] == [0, 1, 2]
    assert [c.tensors for c in g.cuts] == [("a",), ("b",), ("c",)]
    assert all(c.elems == (4 * 8 * 8,) for c in g.cuts)
    assert analyze(_chain_model(skip_all=True), max_cut_tensors=1).cuts == []
    # With two tensors per cut the skip no longer blocks: the graph input crosses beside the chain.
    two = analyze(_chain_model(skip_all=True), max_cut_tensors=2)
    assert [c.tensors for c in two.cuts] == [("x", "a"), ("x", "b"), ("x", "c")]
    with pytest.raises(InputError, match="max-cut-tensors"):
        analyze(_chain_model(), max_cut_tensors=0)


def _segmenter(size_read_last: bool = False) -> onnx.ModelProto:
    """A segmentation model as torch exports one: the input's height and width read with Shape
    (at the top, or right before the final Resize), two stride-2 convolutions, and a Resize of
    the result back to [batch, C] of the features + the input's [H, W]."""
    rng = np.random.default_rng(0)
    w1 = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w1")
    w2 = numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32), "w2")
    consts = [numpy_helper.from_array(np.array(v, dtype=np.int64), n)
              for n, v in (("two", [2]), ("four", [4]), ("zero", [0]))]
    reads = [helper.make_node("Shape", ["x"], ["xs"]), helper.make_node("Slice", ["xs", "two", "four"], ["hw"])]
    convs = [helper.make_node("Conv", ["x", "w1"], ["c1"], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c1"], ["r1"]),
             helper.make_node("Conv", ["r1", "w2"], ["c2"], strides=[2, 2], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r2"])]
    head = [helper.make_node("Shape", ["r2"], ["rs"]), helper.make_node("Slice", ["rs", "zero", "two"], ["nc"]),
            helper.make_node("Concat", ["nc", "hw"], ["sizes"], axis=0),
            helper.make_node("Resize", ["r2", "", "", "sizes"], ["y"], mode="linear")]
    nodes = convs + reads + head if size_read_last else reads + convs + head
    g = helper.make_graph(nodes, "seg", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 16, 16])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 16, 16])],
                          [w1, w2, *consts])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


@pytest.mark.parametrize("size_read_last", [False, True])
def test_sizes_read_from_the_input_are_folded(size_read_last, tmp_path):
    """torch's ``x.shape[-2:]`` for a final Resize: the input's fixed H and W become constants, so
    neither two int64 scalars (read at the top: torchvision's DeepLabV3 had no valid cut) nor the
    input itself (read at the end: LR-ASPP sent it with every feature map) cross a cut. The
    batch, read off the features, stays a node: the blocks run at batch size 2 and equal the
    whole model."""
    g = analyze(_segmenter(size_read_last), max_cut_tensors=2)
    assert [c.tensors for c in g.cuts] == [("c1",), ("r1",), ("c2",), ("r2",)]
    ops = [n.op_type for n in g.model.graph.node]
    assert ops.count("Shape") == 1 and "Slice" in ops  # the batch-following read of the features
    path = tmp_path / "seg.onnx"
    onnx.save(_segmenter(size_read_last), str(path))
    req = ProfileRequest(model_path=path, out_dir=tmp_path / "out", backend="estimate", gpu="V100", blocks=3,
                         max_batch=2, progress=False, max_cut_tensors=1)
    profile_model(req)
    prof = json.loads((tmp_path / "out" / "seg.json").read_text())
    assert prof["num_blocks"] == 3 and prof["boundary_bytes"] == [2 * 4 * 8 * 8, 2 * 4 * 4 * 4]
    assert prof["equivalence"]["passed"] and prof["equivalence"]["max_rel_error"] <= 1e-2


def test_a_cut_blocked_by_a_tensor_that_may_not_cross_is_named(tmp_path):
    """A boolean mask of the input's content live to the end blocks every cut: the error names it
    instead of blaming the number of activations."""
    zero = numpy_helper.from_array(np.zeros((), np.float32), "zero")
    nodes = [helper.make_node("Greater", ["x", "zero"], ["mask"]),
             helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Relu", ["b"], ["c"]), helper.make_node("Where", ["mask", "c", "zero"], ["y"])]
    g = helper.make_graph(nodes, "masked", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])], [zero])
    path = tmp_path / "masked.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    req = ProfileRequest(model_path=path, out_dir=tmp_path, backend="estimate", gpu="V100", blocks=2,
                         max_batch=1, progress=False, max_cut_tensors=4)
    with pytest.raises(InputError, match=r"no valid cut point.*tensor 'mask' \(bool, shape \[1, 4, 8, 8\]\) "
                                         r"is live there and may not cross a cut.* at 4 of 4 positions"):
        profile_model(req)


def test_a_check_on_outputs_the_input_does_not_move_is_flagged(tmp_path, capsys):
    """Blocks equal to the whole model prove little where the output is the same for every
    sample (weights that ignore the input: torchvision's googlenet with seeded weights): the
    profile names such outputs and the command warns."""
    zero = numpy_helper.from_array(np.zeros((), np.float32), "zero")
    bias = numpy_helper.from_array(np.full((1, 4, 1, 1), 0.5, np.float32), "bias")
    nodes = [helper.make_node("Mul", ["x", "zero"], ["a"]), helper.make_node("Relu", ["a"], ["b"]),
             helper.make_node("Add", ["b", "bias"], ["y"])]
    g = helper.make_graph(nodes, "flat", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])], [zero, bias])
    path = tmp_path / "flat.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), str(path))
    req = ProfileRequest(model_path=path, out_dir=tmp_path / "out", backend="estimate", gpu="V100", blocks=2,
                         max_batch=2, progress=False)
    profile_model(req)
    eq = json.loads((tmp_path / "out" / "flat.json").read_text())["equivalence"]
    assert eq["passed"] and eq["input_insensitive"] == ["y"]
    assert "came out the same for every sample" in capsys.readouterr().err


def test_layer_costs(tiny):
    g = analyze(onnx.load(str(tiny)))
    conv = g.layers[0]  # 3 -> 8 channels, 4x4 stride 4 on 32x32 -> 8x8 outputs
    assert conv.op == "Conv"
    assert conv.flops == pytest.approx(2 * 8 * 8 * 8 * 3 * 4 * 4)
    assert conv.weight_bytes == 4 * 8 * 3 * 4 * 4
    fc = g.layers[-1]
    assert fc.op == "Gemm" and fc.flops == pytest.approx(2 * 10 * 16)
    assert g.input_shape == (3, 32, 32)


def test_errors_for_bad_models(tmp_path):
    with pytest.raises(InputError, match="unsupported operator com.example::FancyOp"):
        analyze(_chain_model(custom_op=True))
    with pytest.raises(InputError, match="dynamic dimension 'H'.*--input-shape"):
        analyze(_chain_model(dynamic_hw=True))
    g = analyze(_chain_model(dynamic_hw=True), input_shape=parse_shape("4x8x8"))
    assert g.input_shape == (4, 8, 8)
    path = tmp_path / "skip.onnx"
    onnx.save(_chain_model(skip_all=True), str(path))
    req = ProfileRequest(model_path=path, out_dir=tmp_path, backend="estimate", gpu="V100", blocks=2,
                         max_batch=1, progress=False, max_cut_tensors=1)
    with pytest.raises(InputError, match=r"no valid cut point.*more than 1 activations cross "
                                         r"\(raise --max-cut-tensors\) at 3 of 3 positions"):
        profile_model(req)
    with pytest.raises(InputError, match="not a readable ONNX"):
        (tmp_path / "junk.onnx").write_bytes(b"not a model")
        profile_model(ProfileRequest(model_path=tmp_path / "junk.onnx", out_dir=tmp_path,
                                     backend="estimate", gpu="V100", progress=False))


# --- pre-partitioning -----------------------------------------------------------------------

def test_choose_cuts_equal_units():
    assert choose_cuts([1.0] * 10, 5) == [1, 3, 5, 7]
    assert choose_cuts([1.0] * 10, 5, "greedy") == [1, 3, 5, 7]
    assert choose_cuts([3.0], 1) == []


def test_choose_cuts_balanced_beats_greedy():
    rng = np.random.default_rng(1)
    for _ in range(20):
        costs = rng.uniform(0.1, 3.0, 30)
        sq = {}
        for method in ("greedy", "balanced"):
            cuts = choose_cuts(costs, 6, method)
            assert len(cuts) == 5 and cuts == sorted(set(cuts))
            bc = block_costs(costs, cuts)
            assert sum(bc) == pytest.approx(costs.sum())
            sq[method] = float(np.sum((np.array(bc) - costs.sum() / 6) ** 2))
        assert sq["balanced"] <= sq["greedy"] + 1e-9


def test_choose_cuts_uneven_example():
    # A large unit cannot be split; the others still balance around it.
    costs = [1, 1, 1, 1, 6, 1, 1, 1, 1]
    cuts = choose_cuts(costs, 3)
    assert block_costs(costs, cuts) == [4.0, 6.0, 4.0]
    assert max_deviation([4.0, 6.0, 4.0]) == pytest.approx(6 / (14 / 3) - 1)


def test_choose_cuts_too_many_blocks():
    with pytest.raises(InputError, match="only 2 valid cut points"):
        choose_cuts([1, 1, 1], 4)


# --- export and equivalence -----------------------------------------------------------------

def _blocks(tiny_path: Path, n: int):
    g = analyze(onnx.load(str(tiny_path)))
    units = units_of(g)
    costs = [sum(la.flops for la in g.layers[s:e]) for s, e in units]
    cuts = choose_cuts(costs, n)
    ranges, start = [], 0
    for e in [*cuts, len(units) - 1]:
        ranges.append((units[start][0], units[e][1]))
        start = e + 1
    return g, make_blocks(g, ranges)


def test_export_blocks_and_ranges(tiny, tmp_path):
    g, blocks = _blocks(tiny, 4)
    ex = Exporter(g.model, blocks)
    paths = []
    for b in blocks:
        m = ex.partition(b.index, b.index + 1)
        onnx.checker.check_model(m)
        ins = [i for i in m.graph.input]
        assert [i.name for i in ins] == list(b.inputs)
        assert [o.name for o in m.graph.output] == list(b.outputs)
        want_in = TensorProto.FLOAT if b.index == 0 else TensorProto.FLOAT16
        want_out = TensorProto.FLOAT if b.index == len(blocks) - 1 else TensorProto.FLOAT16
        assert {i.type.tensor_type.elem_type for i in ins} == {want_in}
        assert {o.type.tensor_type.elem_type for o in m.graph.output} == {want_out}
        p = tmp_path / f"b{b.index}.onnx"
        onnx.save(m, str(p))
        paths.append(str(p))
    whole = tmp_path / "whole.onnx"
    onnx.save(g.model, str(whole))
    err = chain_error(str(whole), paths)
    assert 0.0 < err <= 1e-2  # fp16 at the boundaries rounds, but only a little
    # A multi-block partition equals its blocks run in sequence.
    mid = tmp_path / "mid.onnx"
    onnx.save(ex.partition(1, 3), str(mid))
    onnx.save(ex.partition(0, len(blocks)), str(tmp_path / "all.onnx"))
    assert chain_error(str(whole), [paths[0], str(mid), *paths[3:]]) <= 1e-2
    assert chain_error(str(whole), [str(tmp_path / "all.onnx")]) < 1e-6
    with pytest.raises(InputError, match="outside"):
        ex.partition(2, 2)


def test_chain_error_detects_a_wrong_block(tiny, tmp_path):
    g, blocks = _blocks(tiny, 3)
    ex = Exporter(g.model, blocks)
    paths = []
    for b in blocks:
        m = ex.partition(b.index, b.index + 1)
        if b.index == 1:  # corrupt one weight: the check must notice
            t = next(t for t in m.graph.initializer if t.name.endswith(".weight"))
            a = numpy_helper.to_array(t).copy()
            a *= -1.0
            t.CopyFrom(numpy_helper.from_array(a, t.name))
        p = tmp_path / f"b{b.index}.onnx"
        onnx.save(m, str(p))
        paths.append(str(p))
    whole = tmp_path / "whole.onnx"
    onnx.save(g.model, str(whole))
    assert chain_error(str(whole), paths) > 1e-2


# --- estimate -------------------------------------------------------------------------------

def test_estimate_is_monotone_and_orders_gpus(tiny):
    g = analyze(onnx.load(str(tiny)))
    v100, p4 = gpu_spec("v100"), gpu_spec("P4")
    by_bs = [est.range_us(g.layers, v100, 1, bs) for bs in range(1, 9)]
    assert by_bs == sorted(by_bs) and by_bs[0] > 0
    assert est.range_us(g.layers, v100, 4, 8) >= est.range_us(g.layers, v100, 1, 8)
    assert est.range_us(g.layers, p4, 1, 1) > est.range_us(g.layers, v100, 1, 1)
    with pytest.raises(InputError, match="unknown GPU"):
        gpu_spec("Z9000")
    assert gpu_name_from_device("NVIDIA H100 80GB HBM3") == "H100"
    assert gpu_name_from_device("Tesla V100-SXM2-16GB") == "V100"


# --- whole runs -----------------------------------------------------------------------------

def test_profile_estimate_merges_gpus(tiny, tmp_path):
    out = tmp_path / "profiles"
    prof, path = profile_model(ProfileRequest(model_path=tiny, out_dir=out, backend="estimate", gpu="V100",
                                              blocks=4, max_batch=4, splits=[1, 2], progress=False))
    assert path == out / "tiny.json"
    prof2, _ = profile_model(ProfileRequest(model_path=tiny, out_dir=out, backend="estimate", gpu="P4",
                                            blocks=4, max_batch=4, splits=[1], progress=False))
    p = load_profile(path)  # the planner's loader validates it
    assert p.num_blocks == 4 and sorted(p.gpus) == ["P4", "V100"]
    assert p.splits("V100") == [1, 2] and p.max_batch("P4", 1) == 4
    assert p.extra["latency_source"]["V100"]["what_if"] is True
    assert p.extra["slo_reference_gpu"] == "V100"
    assert p.extra["blocks"] == prof.extra["blocks"]
    assert p.extra["equivalence"]["max_rel_error"] <= 1e-2
    assert list(p.boundary_bytes) == [b["out_bytes"] for b in p.extra["blocks"][:-1]]
    for b in p.extra["blocks"]:
        assert (out / b["file"]).exists()
    assert (out / p.extra["onnx"]).exists()
    m = partition_from_profile(str(path), 1, 3)
    assert m.graph.input[0].name == p.extra["blocks"][1]["inputs"][0]
    assert m.graph.output[0].name == p.extra["blocks"][2]["outputs"][0]
    with pytest.raises(InputError, match="blocks"):
        profile_model(ProfileRequest(model_path=tiny, out_dir=out, backend="estimate", gpu="T4",
                                     blocks=3, max_batch=4, progress=False))
    other = tmp_path / "other.onnx"
    onnx.save(build_tiny_model(seed=5), str(other))
    with pytest.raises(InputError, match="different model"):
        profile_model(ProfileRequest(model_path=other, out_dir=out, name="tiny", backend="estimate",
                                     gpu="T4", blocks=4, max_batch=4, progress=False))


def test_profile_ort_with_concurrent_splits(tiny, tmp_path):
    req = ProfileRequest(model_path=tiny, out_dir=tmp_path, backend="ort", blocks=3, max_batch=2,
                         splits=[1, 2], timing=FAST, threads=2, progress=False,
                         partitions=[(0, 2)])
    prof, path = profile_model(req)
    p = load_profile(path)
    assert p.gpus == ["CPU"] and p.splits("CPU") == [1, 2]
    assert p.latency["CPU"][2].shape == (3, 2)
    assert p.whole_model_latency_us["CPU"] > 0
    src = p.extra["latency_source"]["CPU"]
    assert src["measured"] is True and src["splits"]["2"]["copies_running_together"] == 2
    assert [w["threads"] for w in src["splits"]["2"]["workers"]] == [1, 1]
    # One thread per copy: CPU time; two threads: the wall clock.
    assert [w["clock"] for w in src["splits"]["2"]["workers"]] == ["cpu", "cpu"]
    assert src["splits"]["1"]["workers"][0]["clock"] == "wall"
    assert src["splits"]["2"]["sharing"] == "cpu threads"
    # Rounds' dispersion per block and batch size, summarised for the GPU type.
    assert [len(r) for r in src["splits"]["2"]["workers"][0]["dispersion"]] == [2, 2, 2]
    assert [len(r) for r in src["splits"]["1"]["workers"][0]["dispersion"]] == [2, 2, 2, 1]  # + whole
    assert src["timing_dispersion"]["timings"] == 2 * 3 * 2 + 3 * 2 + 1
    assert p.extra["partitioning"]["cost_source"].startswith("ort")
    assert (tmp_path / "tiny" / "partition_00_02.onnx").exists()


def test_cli_profile_and_example(tiny, tmp_path, capsys):
    rc = main(["profile", str(tiny), "--backend", "estimate", "--gpu", "T4", "--blocks", "3",
               "--batch-sizes", "1-2", "--splits", "1,2", "-o", str(tmp_path / "p"), "-q"])
    assert rc == 0
    out = capsys.readouterr().out
    assert "tiny: 3 blocks, T4 (estimate)" in out and "block balance" in out
    rc = main(["profile", str(tiny), "--backend", "estimate", "-o", str(tmp_path / "p")])
    assert rc == 2 and "--gpu is required" in capsys.readouterr().err
    rc = main(["example-model", "-o", str(tmp_path / "ex"), "--gpus", "V100:1-2,P4:1", "--max-batch", "2"])
    assert rc == 0
    d = json.loads((tmp_path / "ex" / "example.json").read_text())
    assert d["num_blocks"] == 10 and set(d["block_latency_us"]) == {"V100", "P4"}
    assert d["slo_reference_gpu"] == "V100" and d["equivalence"]["max_rel_error"] <= 1e-2
    assert all(s["backend"] == "estimate" for s in d["latency_source"].values())


def test_parsers():
    assert parse_batch_sizes("1-8") == 8 and parse_batch_sizes("4") == 4
    assert parse_splits("4,1,2") == [1, 2, 4]
    assert parse_gpu_splits("V100:1-4,P4:1") == [("V100", [1, 2, 3, 4]), ("P4", [1])]
    with pytest.raises(InputError):
        parse_batch_sizes("2-8")
    with pytest.raises(InputError):
        parse_splits("0,1")
    with pytest.raises(InputError):
        parse_shape("3xAx4")


def _weights_as_constant_nodes(model: onnx.ModelProto) -> onnx.ModelProto:
    """The same model with every initializer a Constant node just before its first reader, as
    some frameworks export weights."""
    m = onnx.ModelProto()
    m.CopyFrom(model)
    g = m.graph
    inits = {t.name: t for t in g.initializer}
    nodes, placed = [], set()
    for n in g.node:
        for t in n.input:
            if t in inits and t not in placed:
                nodes.append(helper.make_node("Constant", [], [t], value=inits[t]))
                placed.add(t)
        nodes.append(n)
    del g.initializer[:]
    del g.node[:]
    g.node.extend(nodes)
    keep = [i for i in g.input if i.name not in inits]
    del g.input[:]
    g.input.extend(keep)
    return m


def test_constant_node_weights_are_not_layers(tiny, tmp_path):
    plain = analyze(onnx.load(str(tiny)))
    const = _weights_as_constant_nodes(onnx.load(str(tiny)))
    assert sum(n.op_type == "Constant" for n in const.graph.node) > 10
    g = analyze(const)
    assert [c.tensors for c in g.cuts] == [c.tensors for c in plain.cuts]
    assert [la.op for la in g.layers] == [la.op for la in plain.layers]
    units = units_of(g)
    costs = [sum(la.flops for la in g.layers[s:e]) for s, e in units]
    ranges, start = [], 0
    for e in [*choose_cuts(costs, 4), len(units) - 1]:
        ranges.append((units[start][0], units[e][1]))
        start = e + 1
    blocks = make_blocks(g, ranges)
    ex = Exporter(g.model, blocks)
    paths = []
    for b in blocks:
        p = tmp_path / f"c{b.index}.onnx"
        onnx.save(ex.partition(b.index, b.index + 1), str(p))
        paths.append(str(p))
    whole = tmp_path / "const-whole.onnx"
    onnx.save(const, str(whole))
    assert chain_error(str(whole), paths) <= 1e-2


def test_cpu_splits_that_share_a_core_are_timed_as_a_share_of_its_time(tiny, tmp_path):
    """On a CPU "GPU" of one core, a split-2 vGPU gets half the core: its figure is twice one
    copy's time alone (copies time-slicing a core and timed together overlap only in part)."""
    from ppiped.profiler.profile import _cpu_time_share

    def share(threads, v, backend="ort"):
        return _cpu_time_share(ProfileRequest(model_path=tiny, out_dir=tmp_path, backend=backend,
                                              threads=threads), v)

    assert share(1, 2) == 2 and share(1, 4) == 4 and share(2, 4) == 2
    assert share(4, 2) == 1 and share(1, 1) == 1 and share(1, 2, backend="trt") == 1
    prof, _ = profile_model(ProfileRequest(model_path=tiny, out_dir=tmp_path / "p", backend="ort", blocks=2,
                                           max_batch=1, splits=[1, 2], threads=1, timing=FAST, progress=False))
    mode = prof.extra["latency_source"]["CPU"]["splits"]["2"]
    assert mode["sharing"].startswith("time-shared") and mode["copies_running_together"] == 1


def test_a_batch_fixed_inside_the_model_is_named(tmp_path):
    """A Reshape to [1, -1] runs at batch size 2 but mixes the requests: the profiler says so
    (its output does not follow the batch axis) unless only batch size 1 is profiled."""
    nodes = [helper.make_node("Relu", ["x"], ["a"]), helper.make_node("Reshape", ["a", "shp"], ["y0"]),
             helper.make_node("Relu", ["y0"], ["y"])]
    g = helper.make_graph(nodes, "fixed", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [1, 4, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [1, 256])],
                          [numpy_helper.from_array(np.array([1, -1], dtype=np.int64), "shp")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    with pytest.raises(InputError, match=r"output 'y' does not follow the batch axis.*--batch-sizes 1"):
        analyze(m)
    assert analyze(m, batched=False).output_names == ["y"]


def test_partitions_never_reuse_a_name_the_model_has():
    """The casts and pass-throughs a cut adds are named after the boundary tensor; a model whose
    own tensors already carry those names (``a/to_fp32``, ``a/fp32``) still splits and runs."""
    from ppiped.profiler.partition import Block

    rng = np.random.default_rng(0)
    w0 = numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32) * 0.3, "w0")
    w1 = numpy_helper.from_array(rng.standard_normal((4, 4, 3, 3)).astype(np.float32) * 0.3, "w1")
    conv = {"kernel_shape": [3, 3], "pads": [1, 1, 1, 1]}
    nodes = [helper.make_node("Conv", ["x", "w0"], ["a"], name="a", **conv),
             helper.make_node("Relu", ["a"], ["a/to_fp32"], name="a/to_fp32"),
             helper.make_node("Add", ["a", "a/to_fp32"], ["s"], name="s/pass"),
             helper.make_node("Conv", ["s", "w1"], ["a/fp32"], name="a/fp32", **conv),
             helper.make_node("Relu", ["a/fp32"], ["y"], name="y")]
    g = helper.make_graph(nodes, "clash", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])], [w0, w1])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(m, full_check=True)
    blocks = [Block(0, 0, 1, ("x",), ("a",), 512), Block(1, 1, 5, ("a",), ("y",), 0)]
    ex = Exporter(onnx.shape_inference.infer_shapes(m), blocks)
    parts = [ex.partition(0, 1), ex.partition(1, 2)]
    for p in parts:
        onnx.checker.check_model(p, full_check=True)
        names = [o for n in p.graph.node for o in n.output]
        assert len(names) == len(set(names))
    import onnxruntime as ort

    run = [ort.InferenceSession(p.SerializeToString(), providers=["CPUExecutionProvider"]) for p in (m, *parts)]
    x = rng.standard_normal((2, 3, 8, 8)).astype(np.float32)
    (whole,) = run[0].run(None, {"x": x})
    (mid,) = run[1].run(None, {"x": x})
    assert mid.dtype == np.float16
    (y,) = run[2].run(None, {run[2].get_inputs()[0].name: mid})
    assert np.abs(y - whole).max() <= 1e-2 * np.abs(whole).max()


def _batchdiv_model() -> onnx.ModelProto:
    """A convolution scaled by 1 + batch // 4, the batch read off its output's shape."""
    rng = np.random.default_rng(1)
    ints = {"i0": 0, "four": 4, "one": 1}
    inits = [numpy_helper.from_array(np.array(v, dtype=np.int64), k) for k, v in ints.items()]
    inits.append(numpy_helper.from_array(rng.standard_normal((4, 3, 3, 3)).astype(np.float32), "w"))
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]),
             helper.make_node("Shape", ["c"], ["sh"]),
             helper.make_node("Gather", ["sh", "i0"], ["b"], axis=0),
             helper.make_node("Div", ["b", "four"], ["q"]),
             helper.make_node("Add", ["q", "one"], ["q1"]),
             helper.make_node("Cast", ["q1"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["c", "f"], ["y"])]
    g = helper.make_graph(nodes, "batchdiv", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 8, 8])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4, 8, 8])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_shape_arithmetic_that_follows_the_batch_is_not_folded():
    """A size computed as batch // 4 is 0 at batch sizes 1 and 2 and 1 at 4: with batch sizes up
    to 4 profiled it stays a node, and the analysed model equals the original at every size."""
    import onnxruntime as ort

    m = _batchdiv_model()

    def run(model, bs):
        s = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return s.run(None, {"x": np.ones((bs, 3, 8, 8), np.float32)})[0]

    four = analyze(m, max_batch=4).model
    assert any(n.op_type == "Div" for n in four.graph.node)
    for bs in (1, 2, 3, 4, 5):
        np.testing.assert_allclose(run(four, bs), run(m, bs), rtol=1e-6)
    two = analyze(m, max_batch=2).model  # batch sizes 1 and 2 only: the value is fixed there
    assert not any(n.op_type == "Div" for n in two.graph.node)
    for bs in (1, 2):
        np.testing.assert_allclose(run(two, bs), run(m, bs), rtol=1e-6)


def _conv_model(in_dims: list, unsqueeze: bool) -> onnx.ModelProto:
    w = numpy_helper.from_array(np.full((4, 3, 3, 3), 0.1, np.float32), "w")
    inits, nodes, x = [w], [], "x"
    if unsqueeze:
        inits.append(numpy_helper.from_array(np.array([0], np.int64), "ax"))
        nodes.append(helper.make_node("Unsqueeze", ["x", "ax"], ["x4"]))
        x = "x4"
    nodes.append(helper.make_node("Conv", [x, "w"], ["c"], kernel_shape=[3, 3], pads=[1, 1, 1, 1]))
    nodes.append(helper.make_node("Squeeze", ["c", "ax"], ["y"]) if unsqueeze else helper.make_node("Relu", ["c"], ["y"]))
    out = [4, 8, 8] if unsqueeze else [in_dims[0], 4, 8, 8]
    g = helper.make_graph(nodes, "m", [helper.make_tensor_value_info("x", TensorProto.FLOAT, in_dims)],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, out)], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8)


def test_fixed_batch_exports_run_and_a_missing_batch_axis_is_named():
    """Exported for a fixed batch of 4, a CNN analyses at any batch size; one without a batch
    axis (it adds its own inside) is refused with a note on the axis taken as the batch."""
    g = analyze(_conv_model([4, 3, 8, 8], unsqueeze=False))
    assert g.input_shape == (3, 8, 8)
    with pytest.raises(InputError, match="first axis fixed at 3, taken here as the batch axis"):
        analyze(_conv_model([3, 8, 8], unsqueeze=True))


def test_a_boundary_past_fp16_range_is_reported_as_overflow(tmp_path):
    """Hops carry fp16: a feature map of 1e6 becomes inf at the cut though the whole model stays
    finite; chain_errors says so per output (the profile then refuses the cut model)."""
    from ppiped.profiler.export import chain_errors
    from ppiped.profiler.partition import Block

    inits = [numpy_helper.from_array(np.array(v, np.float32), k) for k, v in (("big", 1e6), ("small", 1e-6))]
    nodes = [helper.make_node("Mul", ["x", "big"], ["a"], name="up"),
             helper.make_node("Mul", ["a", "small"], ["y"], name="down")]
    g = helper.make_graph(nodes, "ovf", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4])], inits)
    m = onnx.shape_inference.infer_shapes(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)],
                                                            ir_version=8))
    ex = Exporter(m, [Block(0, 0, 1, ("x",), ("a",), 8), Block(1, 1, 2, ("a",), ("y",), 0)])
    paths = []
    for i, p in enumerate((m, ex.partition(0, 1), ex.partition(1, 2))):
        paths.append(str(tmp_path / f"{i}.onnx"))
        onnx.save(p, paths[-1])
    overflow: dict[str, bool] = {}
    chain_errors(paths[0], paths[1:], [np.full((2, 4), 0.5, np.float32)], overflow=overflow)
    assert overflow == {"y": True}
    chain_errors(paths[0], paths[1:], [np.full((2, 4), 1e-3, np.float32)], overflow=overflow)
    assert overflow == {"y": False}  # 1e3 fits fp16


def test_a_batch_1_profile_and_a_batched_run_do_not_merge_and_say_why(tmp_path, capsys):
    """Profiled at batch size 1 only, the model's batch-dependent sizes are fixed; a later run with
    larger batch sizes analyses another graph, and is refused naming that, not "another model"."""
    path = tmp_path / "batchdiv.onnx"
    onnx.save(_batchdiv_model(), path)
    base = ["profile", str(path), "--backend", "estimate", "--blocks", "1", "-o", str(tmp_path / "p")]
    assert main([*base, "--gpu", "V100", "--batch-sizes", "1"]) == 0
    capsys.readouterr()
    assert main([*base, "--gpu", "P4", "--batch-sizes", "1-2"]) == 2
    err = capsys.readouterr().err
    assert "profiled at batch size 1 only" in err and "different model" not in err, err


def _float64_reshape_mlp() -> onnx.ModelProto:
    """A float64 MLP behind torch's Shape -> Gather -> Concat -> Reshape flatten: the reshape's
    target is known only by running the model on a float64 input."""
    rng = np.random.default_rng(3)
    inits = [numpy_helper.from_array(np.array([0], np.int64), "i0"),
             numpy_helper.from_array(np.array([-1], np.int64), "m1")]
    nodes = [helper.make_node("Shape", ["x"], ["sh"]),
             helper.make_node("Gather", ["sh", "i0"], ["n"], axis=0),
             helper.make_node("Concat", ["n", "m1"], ["tgt"], axis=0),
             helper.make_node("Reshape", ["x", "tgt"], ["h0"])]
    width = 48
    for k in range(4):
        inits.append(numpy_helper.from_array(rng.standard_normal((width, 32)) / 6, f"w{k}"))
        nodes += [helper.make_node("MatMul", [f"h{k}", f"w{k}"], [f"a{k}"]),
                  helper.make_node("Relu", [f"a{k}"], [f"h{k + 1}"])]
        width = 32
    g = helper.make_graph(nodes, "f64", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, ["N", 3, 4, 4])],
                          [helper.make_tensor_value_info("h4", TensorProto.DOUBLE, ["N", 32])], inits)
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8)


def test_a_float64_model_whose_shapes_need_a_run_profiles(tmp_path):
    """float64 is an admitted input type: the runs that find un-inferable shapes feed float64."""
    path = tmp_path / "f64.onnx"
    onnx.save(_float64_reshape_mlp(), path)
    assert main(["profile", str(path), "--backend", "ort", "--threads", "1", "--rounds", "2", "--blocks", "3",
                 "--batch-sizes", "1-2", "--splits", "1", "-q", "-o", str(tmp_path / "out")]) == 0
    prof = json.loads((tmp_path / "out" / "f64.json").read_text())
    assert prof["num_blocks"] == 3 and prof["equivalence"]["passed"]


def test_an_output_that_barely_moves_is_judged_against_its_magnitude():
    """One score per sample that two noise inputs move by 1.5e-4: fp16 rounding (2e-6) is no 1 %
    error; a wrong value still is, as is an error on an output with a large constant offset."""
    from ppiped.profiler.export import range_relative_error

    whole = np.array([[0.47682643], [0.4769786]])
    assert range_relative_error(whole + 1.7e-6, whole) < 5e-3
    assert range_relative_error(whole + 0.01, whole) > 1e-2
    logits = 100.0 + np.linspace(-1.0, 1.0, 10)[None, :]
    assert range_relative_error(logits + 0.3, logits) > 1e-2


def _with_external_weights(tmp: Path, name: str = "ext.onnx") -> Path:
    """The tiny example CNN with its weights saved beside it in ``w.bin``."""
    m = build_tiny_model()
    path = tmp / name
    onnx.save_model(m, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="w.bin", size_threshold=0)
    return path


PROFILE_ARGS = ["--backend", "estimate", "--gpu", "V100", "--blocks", "3", "--batch-sizes", "1-2", "-q"]


def test_external_data_is_read_only_from_the_models_folder(tmp_path, capsys):
    """onnx 1.15 (which the dependency range admits) followed a symlink in the model's folder to
    any file and read it as a weight; ppiped now resolves every location itself first."""
    a = tmp_path / "a"
    a.mkdir()
    path = _with_external_weights(a)
    assert main(["profile", str(path), *PROFILE_ARGS, "-o", str(tmp_path / "ok")]) == 0
    secret = tmp_path / "secret.bin"
    (a / "w.bin").rename(secret)
    (a / "w.bin").symlink_to(secret)
    assert main(["profile", str(path), *PROFILE_ARGS, "-o", str(tmp_path / "bad")]) == 2
    err = capsys.readouterr().err
    assert "keeps its data in 'w.bin', which is not a file in the model's folder" in err and "Traceback" not in err


def test_external_data_past_2_gib_is_refused_before_it_is_read(tmp_path, capsys):
    """A 225-byte model naming an 8 GB sparse file took 16 GB of memory, then crashed in onnx."""
    path = _with_external_weights(tmp_path)
    m = onnx.load(str(path), load_external_data=False)
    with open(tmp_path / "big.bin", "wb") as f:
        f.truncate(3 << 30)  # sparse: no disk, no memory
    t = m.graph.initializer[0]
    del t.external_data[:]
    for k, v in (("location", "big.bin"), ("offset", "0"), ("length", str(3 << 30))):
        t.external_data.add(key=k, value=v)
    onnx.save(m, str(path))
    assert main(["profile", str(path), *PROFILE_ARGS, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "external data of 3.0 GiB or more" in err and "less than 2 GiB" in err


def test_a_broken_graph_is_named_by_its_file(tmp_path, capsys):
    """ORT's reasons said "the model"; the error line names the file."""
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"]),
                           helper.make_node("Add", ["y", "ghost"], ["z"])], "g",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                          [helper.make_tensor_value_info("z", TensorProto.FLOAT, ["N", 4])])
    path = tmp_path / "dangling.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], ir_version=8), path)
    assert main(["profile", str(path), *PROFILE_ARGS, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"ppiped profile: error: {path}: ")


def test_choose_cuts_coarsens_a_very_long_graph(monkeypatch):
    """Past MAX_DP_UNITS units the exact programme ran for minutes (150,000 layers: killed at
    120 s); runs of units are merged, the cuts stay valid and the blocks about as even."""
    from ppiped.profiler import partition as P

    costs = np.random.default_rng(0).random(2_000)
    extra = np.zeros(1_999, dtype=int)
    exact = choose_cuts(costs, 10, extra_tensors=extra)
    monkeypatch.setattr(P, "MAX_DP_UNITS", 300)
    coarse = choose_cuts(costs, 10, extra_tensors=extra)
    assert coarse != exact and len(coarse) == 9 and coarse == sorted(set(coarse))
    assert coarse[0] >= 0 and coarse[-1] < len(costs) - 1
    assert all((c + 1) % 7 == 0 for c in coarse)  # 2,000 units in runs of 7: cuts only between runs
    # each block's two edges may each move by at most one run of 7 units from where the exact
    # programme put them
    dev = max_deviation(block_costs(costs, coarse))
    assert dev <= max_deviation(block_costs(costs, exact)) + 2 * 7 * costs.max() / (costs.sum() / 10)


def test_a_tensor_past_the_size_cap_is_refused_before_anything_runs(tmp_path, capsys):
    """A 249-byte model expanding its input to 20,000 x 25,000 per channel asked ONNX Runtime
    for 12 GB; the inferred shape says so before anything runs."""
    shape = numpy_helper.from_array(np.array([1, 3, 40_000, 30_000], dtype=np.int64), "shape")
    g = helper.make_graph([helper.make_node("Expand", ["x", "shape"], ["big"]),
                           helper.make_node("ReduceMean", ["big"], ["y"], keepdims=0)], "expand",
                          [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3, 1, 1])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])], [shape])
    path = tmp_path / "expand.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)], ir_version=8), path)
    assert main(["profile", str(path), *PROFILE_ARGS, "-o", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "tensor 'big' holds 3,600,000,000 elements per sample" in err, err
