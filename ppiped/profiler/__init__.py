"""The offline phase (PPipe §5.1-5.2): ONNX model -> blocks -> sub-models -> ``ppiped-profile/1``.

graph (cut points, per-layer cost) -> partition (N balanced blocks) -> export (sub-models of any
block range) -> backends (ort / trt / torch timing, estimate) run by harness (one process per
vGPU, all together) -> profile (orchestration and merging of runs for several GPU types).
"""
