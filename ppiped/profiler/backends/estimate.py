"""What-if latencies from per-layer FLOPs and bytes and a GPU's datasheet (no GPU needed).

A roofline per layer, as an fp16 TensorRT engine would run it: time = max(FLOPs / usable compute,
bytes / usable bandwidth) + a kernel launch. Elementwise layers that TensorRT fuses into the
preceding kernel cost only their extra reads (a residual input) and no launch; reshapes are free.
At split v, MPS gives a vGPU 1/v of the SMs, and the v vGPUs running together share the memory
bandwidth. Small layers cannot fill a GPU: a layer uses one SM per ``ELEMS_PER_SM`` outputs.
The figures are labelled ``estimate`` in the profile: plan with them, never report them as measured.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from ..gpus import GpuSpec
from ..graph import RESHAPES, Layer

ELEMS_PER_SM = 4096  # outputs one SM covers per wave (a 64x64 tile of a convolution)
MATMUL_EFFICIENCY = 0.5  # of tensor-core peak reached by convolutions / GEMMs in practice
OTHER_EFFICIENCY = 0.5  # of fp32 peak for everything else
MEMORY_EFFICIENCY = 0.75  # of datasheet bandwidth reached by streaming kernels
ENGINE_OVERHEAD_LAUNCHES = 2  # an engine's enqueue costs about two kernel launches


def layer_us(layer: Layer, spec: GpuSpec, split: int, bs: int) -> float:
    if layer.op in RESHAPES:
        return 0.0
    bw = spec.mem_gbps * 1e9 * MEMORY_EFFICIENCY / split
    if layer.fusable:
        extra = max(0.0, layer.act_bytes - 8.0 * layer.out_elems) / 2.0  # fp16 residual reads
        return extra * bs / bw * 1e6
    sms = max(1, spec.sms // split)
    used = min(sms, max(1, math.ceil(layer.out_elems * bs / ELEMS_PER_SM)))
    if layer.op in ("Conv", "ConvTranspose", "Gemm", "MatMul"):
        peak = spec.fp16_tflops * MATMUL_EFFICIENCY
    else:
        peak = spec.fp32_tflops * OTHER_EFFICIENCY
    compute = layer.flops * bs / (peak * 1e12 * used / spec.sms)
    memory = (layer.act_bytes / 2.0 * bs + layer.weight_bytes / 2.0) / bw
    return max(compute, memory) * 1e6 + spec.launch_us


def range_us(layers: Sequence[Layer], spec: GpuSpec, split: int, bs: int) -> float:
    """Latency of running ``layers`` as one engine."""
    return sum(layer_us(la, spec, split, bs) for la in layers) + ENGINE_OVERHEAD_LAUNCHES * spec.launch_us
