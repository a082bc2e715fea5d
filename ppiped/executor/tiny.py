"""A tiny two-block CNN with its partitions, profile and plan: a fixture for the serving path.

The end-to-end tests, the ort smoke run and the TensorRT check need a real model whose partitions
load in milliseconds; this one has two blocks (conv+relu | conv+pool+gemm) with one fp32
feature map between them, and a plan that gives each block its own pool of vGPUs.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..plan import PLAN_FORMAT, batch_delay_us, slo_margin_us

MODEL = "tiny"
INPUT_SHAPE = (3, 16, 16)
CLASSES = 10


def _init(name: str, arr: np.ndarray) -> onnx.TensorProto:
    return numpy_helper.from_array(arr.astype(np.float32), name)


def tiny_cnn(seed: int = 0) -> onnx.ModelProto:
    """input [N,3,16,16] → conv3x3(8)+relu → conv3x3(16)+relu → global avg pool → gemm(10)."""
    rng = np.random.default_rng(seed)
    inits = [
        _init("w1", rng.normal(0, 0.3, (8, 3, 3, 3))), _init("b1", rng.normal(0, 0.1, 8)),
        _init("w2", rng.normal(0, 0.2, (16, 8, 3, 3))), _init("b2", rng.normal(0, 0.1, 16)),
        _init("w3", rng.normal(0, 0.3, (CLASSES, 16))), _init("b3", rng.normal(0, 0.1, CLASSES)),
    ]
    nodes = [
        helper.make_node("Conv", ["x", "w1", "b1"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
        helper.make_node("Relu", ["c1"], ["f1"], name="relu1"),
        helper.make_node("Conv", ["f1", "w2", "b2"], ["c2"], pads=[1, 1, 1, 1], name="conv2"),
        helper.make_node("Relu", ["c2"], ["r2"], name="relu2"),
        helper.make_node("GlobalAveragePool", ["r2"], ["p2"], name="gap"),
        helper.make_node("Flatten", ["p2"], ["fl"], axis=1, name="flatten"),
        helper.make_node("Gemm", ["fl", "w3", "b3"], ["logits"], transB=1, name="fc"),
    ]
    g = helper.make_graph(
        nodes, "tiny",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["batch", *INPUT_SHAPE])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", CLASSES])],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="ppiped-tiny")
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def _sub(model: onnx.ModelProto, nodes: list[str], inp: tuple[str, tuple], out: tuple[str, tuple],
         name: str) -> onnx.ModelProto:
    keep = [n for n in model.graph.node if n.name in nodes]
    used = {i for n in keep for i in n.input}
    inits = [t for t in model.graph.initializer if t.name in used]
    g = helper.make_graph(
        keep, name,
        [helper.make_tensor_value_info(inp[0], TensorProto.FLOAT, ["batch", *inp[1]])],
        [helper.make_tensor_value_info(out[0], TensorProto.FLOAT, ["batch", *out[1]])],
        inits,
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)], producer_name="ppiped-tiny")
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m


def write_partitions(directory: str | Path, seed: int = 0) -> dict[str, Path]:
    """Write ``tiny.onnx`` and the partitions ``tiny/0-1.onnx``, ``tiny/1-2.onnx``."""
    d = Path(directory)
    (d / MODEL).mkdir(parents=True, exist_ok=True)
    whole = tiny_cnn(seed)
    fmap = (8, *INPUT_SHAPE[1:])
    parts = {
        "whole": (whole, d / f"{MODEL}.onnx"),
        "0-1": (_sub(whole, ["conv1", "relu1"], ("x", INPUT_SHAPE), ("f1", fmap), "tiny_0_1"),
                d / MODEL / "0-1.onnx"),
        "1-2": (_sub(whole, ["conv2", "relu2", "gap", "flatten", "fc"], ("f1", fmap), ("logits", (CLASSES,)),
                     "tiny_1_2"), d / MODEL / "1-2.onnx"),
    }
    for m, p in parts.values():
        onnx.save(m, str(p))
    return {k: p for k, (_, p) in parts.items()}


def profile_json(block_us: tuple[float, float] = (2000.0, 3000.0), max_bs: int = 8,
                 gpu: str = "CPU", model: str = MODEL) -> dict:
    """A ``ppiped-profile/1`` for the tiny model: latency grows by 25% of batch 1 per extra request."""
    lat = [[b * (1 + 0.25 * (k - 1)) for k in range(1, max_bs + 1)] for b in block_us]
    fmap_fp16 = 2 * 8 * INPUT_SHAPE[1] * INPUT_SHAPE[2]
    return {
        "format": "ppiped-profile/1", "model": model, "num_blocks": 2,
        "block_latency_us": {gpu: {"1": lat}},
        "boundary_bytes": [fmap_fp16],
        "whole_model_latency_us": {gpu: sum(block_us)},
    }


def plan_json(profile: dict, vgpus: tuple[int, int] = (2, 2), bs: int = 4, slo_ms: float = 60.0,
              nic_gbps: float = 10.0, gpu: str = "CPU") -> dict:
    """A two-partition ``ppiped-plan/1`` for the tiny model; figures follow the plan rules."""
    lat = profile["block_latency_us"][gpu]["1"]
    trans = profile["boundary_bytes"][0] * bs * 8 / (nic_gbps * 1e3)
    slo_us = slo_ms * 1000
    parts = []
    xs = []
    for i, n in enumerate(vgpus):
        x = n * bs * 1e6 / lat[i][bs - 1]
        xs.append(x)
        parts.append({"blocks": [i, i + 1], "gpu": gpu, "vgpu_split": 1, "num_vgpus": n,
                      "lat_infer_us": lat[i][bs - 1], "lat_trans_us": trans if i == 0 else 0.0,
                      "throughput_rps": x, "batch_size": bs})
    x = min(xs)
    rate = x
    latency = sum(p["lat_infer_us"] + p["lat_trans_us"] for p in parts) + batch_delay_us(bs, rate, 1.3)
    assert latency + slo_margin_us(slo_us, 0.4) <= slo_us, "tiny plan: SLO too tight for this batch size"
    return {
        "format": PLAN_FORMAT, "algo": "hand",
        "cluster": {"nic_gbps": nic_gbps, "gpus": {gpu: {"count": sum(vgpus), "per_server": 1, "splits": [1]}}},
        "params": {"slo_margin": 0.4, "batch_delay_factor": 1.3, "max_partitions": 2, "slo_scale": None,
                   "slo_reference_gpu": None},
        "objective": {"normalized_throughput": x},
        "solver": {},
        "models": [{"model": profile["model"], "slo_us": slo_us, "weight": 1.0, "throughput_rps": x,
                    "batch_delay_rate_rps": rate,
                    "pipelines": [{"batch_size": bs, "throughput_rps": x, "latency_us": latency,
                                   "partitions": parts}]}],
    }


def write_example(directory: str | Path, profile: dict | None = None, **plan_kw) -> tuple[Path, Path]:
    """Write partitions, ``profiles/<model>.json`` and ``plan.json`` under ``directory``."""
    d = Path(directory)
    write_partitions(d / "parts")
    prof = profile or profile_json()
    (d / "profiles").mkdir(parents=True, exist_ok=True)
    (d / "profiles" / f"{prof['model']}.json").write_text(json.dumps(prof))
    (d / "plan.json").write_text(json.dumps(plan_json(prof, **plan_kw), indent=1))
    return d / "plan.json", d / "profiles"


def random_frame(rng: np.random.Generator | None = None) -> bytes:
    rng = rng or np.random.default_rng()
    return rng.normal(0, 1, INPUT_SHAPE).astype(np.float32).tobytes()
