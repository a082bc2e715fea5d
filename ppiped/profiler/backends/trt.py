"""TensorRT: build an fp16 engine per (sub-)model and time it like trtexec (GPU compute time).

tensorrt and pycuda are optional (``pip install ppiped[gpu]``) and imported only here, when the
backend is chosen. Engines are cached next to the ONNX file, keyed by TensorRT version, GPU and
max batch, so the v concurrent copies at split v load the engine copy 0 built.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ...errors import InputError

WORKSPACE_BYTES = 1 << 30


def _import():
    try:
        import pycuda.autoinit  # noqa: F401  (creates the context in this process)
        import pycuda.driver as cuda
        import tensorrt as trt
    except ImportError as e:
        raise InputError(f"the trt backend needs tensorrt and pycuda ({e}); install ppiped[gpu] on a "
                         "machine with an NVIDIA GPU, or use --backend ort / estimate") from None
    return trt, cuda


class TrtSession:
    def __init__(self, rt: TrtRuntime, engine_bytes: bytes, max_batch: int) -> None:
        trt, cuda = rt.trt, rt.cuda
        self.cuda = cuda
        self.engine = rt.runtime.deserialize_cuda_engine(engine_bytes)
        if self.engine is None:
            raise InputError("TensorRT could not deserialize the engine")
        self.ctx = self.engine.create_execution_context()
        self.stream = cuda.Stream()
        self.names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in self.names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.bufs = []
        for n in self.names:
            shape = list(self.engine.get_tensor_shape(n))
            shape[0] = max_batch
            dtype = np.dtype(trt.nptype(self.engine.get_tensor_dtype(n)))
            nbytes = int(np.prod(shape)) * dtype.itemsize
            buf = cuda.mem_alloc(nbytes)
            cuda.memset_d8(buf, 0, nbytes)  # zeros: garbage fp16 may hold NaNs that slow kernels
            self.bufs.append(buf)
            self.ctx.set_tensor_address(n, int(buf))
        self.sample = {n: tuple(self.engine.get_tensor_shape(n))[1:] for n in self.inputs}
        self.start, self.end = cuda.Event(), cuda.Event()

    def timed(self, bs: int, n: int) -> float:
        for name in self.inputs:
            self.ctx.set_input_shape(name, (bs, *self.sample[name]))
        self.start.record(self.stream)
        for _ in range(n):
            self.ctx.execute_async_v3(self.stream.handle)
        self.end.record(self.stream)
        self.end.synchronize()
        return self.end.time_since(self.start) / 1e3

    def close(self) -> None:
        for b in self.bufs:
            b.free()
        self.bufs = []
        self.ctx = None
        self.engine = None


class TrtRuntime:
    name = "trt"

    def __init__(self, split: int = 1, fp16: bool = True) -> None:
        self.trt, self.cuda = _import()
        self.split = split
        self.fp16 = fp16
        self.logger = self.trt.Logger(self.trt.Logger.ERROR)
        self.runtime = self.trt.Runtime(self.logger)
        dev = self.cuda.Context.get_device()
        self.device = dev.name()
        self.sms = dev.get_attribute(self.cuda.device_attribute.MULTIPROCESSOR_COUNT)

    def engine_path(self, model_path: Path, max_batch: int) -> Path:
        tag = "".join(ch for ch in self.device if ch.isalnum())
        prec = "fp16" if self.fp16 else "fp32"
        return model_path.with_suffix(f".trt{self.trt.__version__}.{tag}.b{max_batch}.{prec}.engine")

    def build(self, model_path: Path, max_batch: int) -> bytes:
        trt = self.trt
        builder = trt.Builder(self.logger)
        flags = 0
        if hasattr(trt.NetworkDefinitionCreationFlag, "EXPLICIT_BATCH") and int(trt.__version__.split(".")[0]) < 10:
            flags = 1 << int(trt.NetworkDefinitionCreationFlag.EXPLICIT_BATCH)
        network = builder.create_network(flags)
        parser = trt.OnnxParser(network, self.logger)
        if not parser.parse(model_path.read_bytes()):
            errs = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
            raise InputError(f"TensorRT cannot parse {model_path.name}: {errs}")
        config = builder.create_builder_config()
        config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, WORKSPACE_BYTES)
        # Newer TensorRT releases drop these weak-typing knobs; then the ONNX types decide.
        if self.fp16 and getattr(builder, "platform_has_fast_fp16", True) and hasattr(trt.BuilderFlag, "FP16"):
            config.set_flag(trt.BuilderFlag.FP16)
        profile = builder.create_optimization_profile()
        for i in range(network.num_inputs):
            t = network.get_input(i)
            rest = tuple(t.shape)[1:]
            if any(d < 0 for d in rest):
                raise InputError(f"{model_path.name}: input {t.name} has dynamic non-batch dims {rest}")
            profile.set_shape(t.name, (1, *rest), (max_batch, *rest), (max_batch, *rest))
        config.add_optimization_profile(profile)
        plan = builder.build_serialized_network(network, config)
        if plan is None:
            raise InputError(f"TensorRT failed to build an engine for {model_path.name}")
        return bytes(plan)

    def open(self, model_path: Path, max_batch: int) -> TrtSession:
        path = self.engine_path(model_path, max_batch)
        if path.exists():
            data = path.read_bytes()
        else:
            data = self.build(model_path, max_batch)
            tmp = path.with_suffix(".tmp")
            tmp.write_bytes(data)
            tmp.replace(path)
        return TrtSession(self, data, max_batch)

    def info(self) -> dict[str, Any]:
        return {"device": self.device, "sms_visible": self.sms, "library": f"tensorrt {self.trt.__version__}",
                "precision": "fp16" if self.fp16 else "fp32"}
