"""Public datasheet figures of the GPUs the estimate backend can model.

Peak throughputs are dense (no sparsity), boost clock. ``fp16_tflops`` is what an fp16 TensorRT
engine can reach: tensor-core peak where the GPU has tensor cores; P4 has no fast fp16, so its
engines run fp32 kernels and its entry repeats the fp32 peak. Launch overhead is not a datasheet
figure: it is the per-kernel enqueue + scheduling gap typical of TensorRT on that generation.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import InputError


@dataclass(frozen=True)
class GpuSpec:
    name: str
    fp32_tflops: float
    fp16_tflops: float
    mem_gbps: float  # GB/s
    sms: int
    launch_us: float
    source: str


GPUS: dict[str, GpuSpec] = {
    g.name: g
    for g in [
        GpuSpec("P4", 5.5, 5.5, 192.0, 20, 5.0, "NVIDIA Tesla P4 datasheet (GP104, 75 W)"),
        GpuSpec("T4", 8.1, 65.0, 320.0, 40, 4.0, "NVIDIA T4 datasheet (TU104, 70 W)"),
        GpuSpec("V100", 15.7, 125.0, 900.0, 80, 3.0, "NVIDIA V100 SXM2 datasheet (GV100)"),
        GpuSpec("L4", 30.3, 121.0, 300.0, 58, 3.0, "NVIDIA L4 datasheet (AD104, 72 W)"),
        GpuSpec("A100", 19.5, 312.0, 2039.0, 108, 2.5, "NVIDIA A100 80GB SXM datasheet (GA100)"),
        GpuSpec("H100", 67.0, 989.4, 3350.0, 132, 2.5, "NVIDIA H100 SXM5 datasheet (GH100)"),
    ]
}


def gpu_spec(name: str) -> GpuSpec:
    key = {k.lower(): k for k in GPUS}.get(name.lower())
    if key is None:
        raise InputError(f"unknown GPU {name!r} for the estimate backend (known: {', '.join(GPUS)})")
    return GPUS[key]


def gpu_name_from_device(device_name: str) -> str:
    """Short table name for a CUDA device name, e.g. 'NVIDIA H100 80GB HBM3' -> 'H100'."""
    words = device_name.replace("-", " ").split()
    for w in words:
        for k in GPUS:
            if w.upper() == k:
                return k
    return "".join(ch for ch in device_name.replace("NVIDIA", "") if ch.isalnum()) or "GPU"
