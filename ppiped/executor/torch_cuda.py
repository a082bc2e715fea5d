"""CUDA through PyTorch: the GPU backend for hosts where TensorRT cannot be installed.

Runs a partition with the profiler's ONNX interpreter (fp16, BatchNormalization folded, channels
last) replayed from one CUDA graph per batch size, so serving takes the same GPU time the
``torch`` profile measured. The input is converted to fp16 on the GPU, and an outgoing feature map
leaves the GPU already fp16 (a last partition's outputs are widened to fp32 there). It is not
TensorRT: it fuses less, so it is slower than an engine. torch is imported only when a vGPU's
backend is ``torch``; all CUDA work of one vGPU happens on its single worker thread.
"""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from ..errors import InputError
from ..wire import Assignment
from .backends import ModelSource, _TensorBackend


class TorchBackend(_TensorBackend):
    name = "torch"

    def __init__(self, a: Assignment, source: ModelSource, device: int = 0, split: int = 0) -> None:
        super().__init__(a, source)
        self.device = device
        self.split = split or a.split  # the config's [executors.ID] split wins over the plan's
        self.max_bs = max(1, len(a.lat_us))
        self.graphs: dict[int, tuple[Any, Any, list]] = {}

    def load(self) -> None:
        import onnx

        from ..profiler.backends.torch_cuda import OnnxProgram, import_torch

        if self.split > 1:  # MPS reads it when this process creates its first CUDA context
            os.environ.setdefault("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(100 // self.split))
        part = self.prepare()
        torch, F = import_torch()  # noqa: N806
        self.torch = torch
        torch.cuda.set_device(self.device)
        self.prog = OnnxProgram(onnx.load_from_string(part.onnx_bytes), torch, F)
        by_name = {spec.name: spec for spec in part.inputs}
        if sorted(self.prog.inputs) != sorted(by_name):
            raise InputError(f"{part.source}: the graph's inputs {self.prog.inputs} are not the partition's "
                             f"{sorted(by_name)}")
        self.specs = [by_name[n] for n in self.prog.inputs]  # in the order the program takes them
        self.stream = torch.cuda.Stream()
        self.wide = [spec.dtype == np.float32 for spec in part.outputs]
        # requests arrive in read-only frames: each tensor staged through pinned host memory to
        # the GPU in its own dtype, converted to fp16 there
        self.host, self.host_np, self.dev_in = [], [], []
        for spec in self.specs:
            shape = (self.max_bs, *spec.shape)
            dtype = torch.from_numpy(np.zeros(0, spec.dtype)).dtype
            self.host.append(torch.empty(shape, dtype=dtype, pin_memory=True))
            self.host_np.append(self.host[-1].numpy())
            self.dev_in.append(torch.empty(shape, dtype=dtype, device="cuda"))
        for bs in range(1, self.max_bs + 1):  # capture now: the first batch of a size pays nothing
            self._graph(bs)

    def _graph(self, bs: int) -> tuple[Any, list, list]:
        """A CUDA graph of the partition at batch size ``bs``, its inputs and its output tensors."""
        g = self.graphs.get(bs)
        if g is not None:
            return g
        from ..profiler.backends.torch_cuda import device_input

        torch = self.torch
        xs = [device_input(torch, bs, spec.shape) for spec in self.specs]
        with torch.inference_mode():
            self.stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(self.stream):
                for _ in range(2):  # warm-up outside the graph (cudnn picks its kernels)
                    self.prog.run(*xs)
            torch.cuda.current_stream().wait_stream(self.stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                outs = [(o.float() if wide else o).contiguous() for o, wide in zip(self.prog.run(*xs), self.wide,
                                                                                    strict=True)]
        self.graphs[bs] = g = (graph, xs, outs)
        return g

    def infer(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        batches = [feeds[spec.name] for spec in self.specs]
        n = batches[0].shape[0]
        if n > self.max_bs:
            out = [self.infer({k: v[i:i + self.max_bs] for k, v in feeds.items()})
                   for i in range(0, n, self.max_bs)]
            return [np.concatenate([o[k] for o in out]) for k in range(len(self.wide))]
        graph, xs, outs = self._graph(n)
        torch = self.torch
        with torch.inference_mode():
            for batch, host, host_np, dev, x in zip(batches, self.host, self.host_np, self.dev_in, xs, strict=True):
                np.copyto(host_np[:n], batch)
                dev[:n].copy_(host[:n], non_blocking=True)
                x.copy_(dev[:n])  # to fp16, on the GPU
            graph.replay()
            return [o.cpu().numpy() for o in outs]

    def close(self) -> None:
        self.graphs.clear()
        self.prog = None
        if getattr(self, "torch", None) is not None:
            self.torch.cuda.empty_cache()
