"""TensorRT backend: one engine per partition, pycuda device buffers, fp16 boundaries on the GPU.

Imported only when a vGPU's backend is ``trt`` (needs the ``gpu`` extra: tensorrt, pycuda).
The engine is built from the partition ONNX after :func:`onnxio.fp16_boundaries`, so the cast of
the outgoing feature map to fp16 (and of an incoming one back to fp32) are layers of the engine
and run on the GPU. Built engines are cached beside the ONNX (or at ``executor.engines``), named
by a hash of the graph, the TensorRT version and the GPU, so a stale engine is never loaded.

All CUDA work of one vGPU happens on its single worker thread, where its context stays current.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np

from ..errors import InputError
from ..wire import Assignment
from .backends import ModelSource, _TensorBackend

try:
    import pycuda.driver as cuda
    import tensorrt as trt
except ImportError as e:  # pragma: no cover - exercised only without the gpu extra
    raise InputError(f"the trt backend needs TensorRT and pycuda (pip install -e '.[gpu]'): {e}") from None

_LOGGER = trt.Logger(trt.Logger.WARNING)


class TrtBackend(_TensorBackend):
    name = "trt"

    def __init__(self, a: Assignment, source: ModelSource, engine_path: Path, device: int = 0,
                 fp16: bool = True, split: int = 0) -> None:
        super().__init__(a, source)
        self.engine_base = Path(engine_path)
        self.device = device
        self.fp16 = fp16
        self.split = split or a.split  # the config's [executors.ID] split wins over the plan's
        self.max_bs = max(1, len(a.lat_us))
        self.ctx = None

    # --- set-up (worker thread) ---------------------------------------------------------------

    def load(self) -> None:
        if self.split > 1:  # MPS reads it when this process creates its first CUDA context
            os.environ.setdefault("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", str(100 // self.split))
        part = self.prepare()
        cuda.init()
        dev = cuda.Device(self.device)
        self.ctx = dev.make_context()  # stays current on this worker thread
        self.engine_path = self._cache_name(part.onnx_bytes, dev.name())
        runtime = trt.Runtime(_LOGGER)
        blob = self._load_or_build(part)
        self.engine = runtime.deserialize_cuda_engine(blob)
        if self.engine is None:
            raise InputError(f"{self.engine_path}: TensorRT could not deserialize the engine")
        self.context = self.engine.create_execution_context()
        self.stream = cuda.Stream()
        self.tensors = {}
        for spec in [*part.inputs, *part.outputs]:
            want = np.dtype(trt.nptype(self.engine.get_tensor_dtype(spec.name)))
            if want != spec.dtype:
                raise InputError(f"{self.engine_path}: tensor {spec.name} is {want} in the engine, "
                                 f"{spec.dtype} in the ONNX graph")
            host = cuda.pagelocked_empty((self.max_bs, *spec.shape), spec.dtype)
            devbuf = cuda.mem_alloc(max(1, host.nbytes))
            self.context.set_tensor_address(spec.name, int(devbuf))
            self.tensors[spec.name] = (host, devbuf)

    def _cache_name(self, onnx_bytes: bytes, gpu_name: str) -> Path:
        h = hashlib.sha256(onnx_bytes)
        h.update(f"{trt.__version__}|{gpu_name}|{self.max_bs}|{self.fp16}".encode())
        base = self.engine_base
        return base.with_name(f"{base.stem}.{h.hexdigest()[:12]}{base.suffix or '.engine'}")

    def _load_or_build(self, part) -> bytes:
        if self.engine_path.exists():
            return self.engine_path.read_bytes()
        builder = trt.Builder(_LOGGER)
        flags = 0
        if int(trt.__version__.split(".")[0]) < 10:
            flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, _LOGGER)
        if not parser.parse(part.onnx_bytes):
            errs = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise InputError(f"{part.source}: TensorRT cannot parse the partition: {errs}")
        if not self.last:
            for i in range(network.num_outputs):
                network.get_output(i).dtype = trt.float16
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, 1 << 30)
        if self.fp16 and getattr(builder, "platform_has_fast_fp16", True):  # gone in TensorRT 10
            config.set_flag(trt.BuilderFlag.FP16)
        profile = builder.create_optimization_profile()
        for spec in part.inputs:
            shape = spec.shape
            profile.set_shape(spec.name, (1, *shape), (self.max_bs, *shape), (self.max_bs, *shape))
        config.add_optimization_profile(profile)
        blob = builder.build_serialized_network(network, config)
        if blob is None:
            raise InputError(f"{part.source}: TensorRT failed to build an engine (see the log above)")
        data = bytes(blob)
        self.engine_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.engine_path.with_suffix(".tmp")
        tmp.write_bytes(data)
        tmp.replace(self.engine_path)
        return data

    # --- inference (worker thread) ------------------------------------------------------------

    def infer(self, feeds: dict[str, np.ndarray]) -> list[np.ndarray]:
        part = self.part
        n = next(iter(feeds.values())).shape[0]
        if n > self.max_bs:
            out = [self.infer({k: v[i:i + self.max_bs] for k, v in feeds.items()})
                   for i in range(0, n, self.max_bs)]
            return [np.concatenate([o[k] for o in out]) for k in range(len(part.outputs))]
        for spec in part.inputs:
            host, dev = self.tensors[spec.name]
            host[:n] = feeds[spec.name]
            cuda.memcpy_htod_async(dev, host[:n], self.stream)
            self.context.set_input_shape(spec.name, (n, *spec.shape))
        if not self.context.execute_async_v3(self.stream.handle):
            raise RuntimeError(f"{part.source}: TensorRT execution failed")
        for spec in part.outputs:
            h, d = self.tensors[spec.name]
            cuda.memcpy_dtoh_async(h[:n], d, self.stream)
        self.stream.synchronize()
        return [self.tensors[s.name][0][:n].copy() for s in part.outputs]

    def close(self) -> None:
        if self.ctx is not None:
            self.tensors = {}
            self.context = None
            self.engine = None
            self.ctx.pop()
            self.ctx.detach()
            self.ctx = None
