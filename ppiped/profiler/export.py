"""Sub-model export: any contiguous block range [i, j) as its own ONNX model.

Executors build an engine for exactly the partition a plan gives them, so a partition must be a
stand-alone model. Feature maps between blocks travel as fp16 (that is what boundary bytes count),
so a sub-model takes and returns fp16 at internal boundaries and casts to the model's own type
inside, where TensorRT fuses the cast into the neighbouring layer.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

import onnx
import onnx.utils
from onnx import TensorProto, helper

from ..errors import InputError
from .partition import Block

FLOAT_TYPES = (TensorProto.FLOAT, TensorProto.DOUBLE)
# Name under which a partition outputs a tensor it takes as an input and leaves untouched.
PASS_SUFFIX = "/pass"


class Exporter:
    """Extract block ranges from one analysed model (reuses onnx's extractor across calls)."""

    def __init__(self, model: onnx.ModelProto, blocks: Sequence[Block]) -> None:
        self.model = model
        self.blocks = list(blocks)
        self._extractor = onnx.utils.Extractor(model)
        self._types = {vi.name: vi.type.tensor_type.elem_type
                       for vi in [*model.graph.input, *model.graph.value_info, *model.graph.output]}
        g = model.graph
        self._used = self._taken = {x for n in g.node for x in (*n.input, *n.output, n.name)} | \
            {t.name for t in (*g.initializer, *g.input, *g.output, *g.value_info)}

    def _fresh(self, base: str) -> str:
        """``base``, or ``base#k``, whichever the model does not use yet: the casts and pass-throughs
        added here must never collide with a user's tensor or node named ``x/fp32`` or the like."""
        name, k = base, 0
        while name in self._used:
            k += 1
            name = f"{base}#{k}"
        self._used.add(name)
        return name

    def partition(self, start: int, end: int, fp16_boundaries: bool = True) -> onnx.ModelProto:
        """Blocks [start, end) as a model; internal boundaries fp16 when ``fp16_boundaries``."""
        n = len(self.blocks)
        if not 0 <= start < end <= n:
            raise InputError(f"block range [{start}, {end}) is outside 0..{n}")
        inputs = list(self.blocks[start].inputs)
        outputs = list(self.blocks[end - 1].outputs)
        passing = [t for t in outputs if t in inputs]
        computed = [t for t in outputs if t not in passing]
        if not computed:
            raise InputError(f"blocks [{start}, {end}) compute nothing that leaves them")
        sub = self._extractor.extract_model(inputs, computed)
        self._used = set(self._taken)
        sub.graph.name = f"{self.model.graph.name or 'model'}_blocks_{start}_{end}"
        if fp16_boundaries:
            if start > 0:
                for t in inputs:
                    self._cast_input(sub, t)
            if end < n:
                for t in computed:
                    self._cast_output(sub, t)
        # A tensor that crosses both cuts passes through under a name of its own (a graph may
        # not output its input); consumers match a partition's tensors by position.
        vis = {vi.name: vi for vi in [*sub.graph.input, *sub.graph.output]}
        renamed = {}
        for t in passing:
            out = onnx.ValueInfoProto()
            out.CopyFrom(vis[t])
            out.name = renamed[t] = self._fresh(t + PASS_SUFFIX)
            vis[out.name] = out
            tt = out.type.tensor_type
            node = self._fresh(f"{t}/pass")
            if fp16_boundaries and end < n and tt.elem_type in FLOAT_TYPES:  # the model's own input
                tt.elem_type = TensorProto.FLOAT16
                sub.graph.node.append(helper.make_node("Cast", [t], [out.name], to=TensorProto.FLOAT16,
                                                       name=node))
            else:
                sub.graph.node.append(helper.make_node("Identity", [t], [out.name], name=node))
        order = [vis[renamed.get(t, t)] for t in outputs]
        del sub.graph.output[:]
        sub.graph.output.extend(order)
        del sub.graph.value_info[:]
        return sub

    def _cast_input(self, sub: onnx.ModelProto, name: str) -> None:
        typ = self._types.get(name, TensorProto.FLOAT)
        if typ not in FLOAT_TYPES:
            return
        inner = self._fresh(f"{name}/to_fp32")
        for node in sub.graph.node:
            for k, t in enumerate(node.input):
                if t == name:
                    node.input[k] = inner
        for vi in sub.graph.input:
            if vi.name == name:
                vi.type.tensor_type.elem_type = TensorProto.FLOAT16
        sub.graph.node.insert(0, helper.make_node("Cast", [name], [inner], to=typ, name=inner))

    def _cast_output(self, sub: onnx.ModelProto, name: str) -> None:
        typ = self._types.get(name, TensorProto.FLOAT)
        if typ not in FLOAT_TYPES:
            return
        inner = self._fresh(f"{name}/fp32")
        for node in sub.graph.node:
            for k, t in enumerate(node.output):
                if t == name:
                    node.output[k] = inner
            for k, t in enumerate(node.input):
                if t == name:
                    node.input[k] = inner
        for vi in sub.graph.output:
            if vi.name == name:
                vi.type.tensor_type.elem_type = TensorProto.FLOAT16
        sub.graph.node.append(helper.make_node("Cast", [inner], [name], to=TensorProto.FLOAT16,
                                               name=self._fresh(f"{name}/to_fp16")))


def blocks_from_extra(extra_blocks: Sequence[dict]) -> list[Block]:
    """Rebuild :class:`Block` records from a profile's ``extra['blocks']``."""
    try:
        return [Block(int(b["index"]), int(b["first_layer"]), int(b["end_layer"]),
                      tuple(b["inputs"]), tuple(b["outputs"]), int(b.get("out_bytes", 0)))
                for b in extra_blocks]
    except (KeyError, TypeError, ValueError) as e:
        raise InputError(f"profile field blocks is malformed ({e!r}); re-run ppiped profile") from None


# The narrowest range an output's error is measured against, as a share of its magnitude: the
# largest relative spacing of fp16 numbers, which the boundaries carry. Outputs that vary across
# the check batch by less than one fp16 step cannot show a wrong block by their range (one
# sigmoid score per sample under 2 noise inputs: range 1.5e-4 around 0.48, where fp16 rounding
# inside the blocks, 2e-6 at the output, read as a 1.3 % error and failed the check).
RANGE_FLOOR = 2.0**-10


class OutputError:
    """Running max |chain - whole| and the whole output's min, max and max |.| over batches.

    The error is relative to the output's range, not its largest magnitude: an output with a
    large constant offset (logits, a map around 100) would hide a wrong block behind max |whole|,
    and element-wise relative error is undefined where an output is near zero. A range narrower
    than ``RANGE_FLOOR`` of the magnitude counts as that (fp16's resolution). NaN propagates.
    """

    def __init__(self) -> None:
        self.diff = 0.0
        self.lo = float("inf")
        self.hi = float("-inf")
        self.absmax = 0.0
        self.first: Any = None  # the whole model's output for the first sample
        self.varies = False  # whether any other sample's output differs from it
        self.overflow = False  # the chain gave inf/NaN where the whole model is finite

    def add(self, chain: Any, whole: Any) -> None:
        import numpy as np

        w = np.asarray(whole, dtype=np.float64)
        c = np.asarray(chain, dtype=np.float64)
        if c.shape != w.shape:
            raise InputError(f"the blocks in sequence give shape {list(c.shape)} where the whole model "
                             f"gives {list(w.shape)}")
        if w.size == 0:
            return
        if w.ndim:  # per sample: a check on outputs the input does not move proves little
            if self.first is None:
                self.first = w[0].copy()
            self.varies = self.varies or any(not np.array_equal(x, self.first) for x in w)
        self.overflow = self.overflow or bool(np.any(~np.isfinite(c) & np.isfinite(w)))
        self.diff = float(np.max([self.diff, np.max(np.abs(c - w))]))
        self.lo = float(np.min([self.lo, np.min(w)]))
        self.hi = float(np.max([self.hi, np.max(w)]))
        self.absmax = float(np.max([self.absmax, np.max(np.abs(w))]))

    def error(self) -> float:
        """max |diff| / range (at least ``RANGE_FLOOR`` x max |whole|); / max |whole| for a
        constant output; the plain diff for all zeros."""
        spread = self.hi - self.lo
        scale = max(spread, RANGE_FLOOR * self.absmax) if spread > 0 else self.absmax
        return self.diff / scale if scale > 0 else self.diff


def range_relative_error(chain: Any, whole: Any) -> float:
    """max |chain - whole| / (max - min of whole): the equivalence metric for one output."""
    e = OutputError()
    e.add(chain, whole)
    return e.error()


def chain_errors(whole_path: str, block_paths: Sequence[str], batches: Iterable[Any],
                 varies: dict[str, bool] | None = None,
                 overflow: dict[str, bool] | None = None) -> tuple[dict[str, float], int]:
    """Run the block sub-models in sequence (fp16 at the boundaries) and the whole model with
    ONNX Runtime on each input batch; the error per whole-model output name (see
    :class:`OutputError`) and the number of samples run. ``varies``, if given, gets per output
    whether the whole model's output differed between samples; ``overflow``, whether the blocks
    gave a non-finite value where the whole model's was finite (a feature map past fp16's range)."""
    from .graph import ort_run, ort_session

    whole = ort_session(whole_path, "the model")
    blocks = [ort_session(p, f"block file {Path(p).name}") for p in block_paths]
    name = whole.get_inputs()[0].name
    names = [o.name for o in whole.get_outputs()]
    errs = {n: OutputError() for n in names}
    count = 0
    for x in batches:
        ref = ort_run(whole, {name: x}, "the model")
        outs: list = [x]
        for k, s in enumerate(blocks):  # a block's inputs are the previous block's outputs, in order
            outs = ort_run(s, {i.name: o for i, o in zip(s.get_inputs(), outs, strict=True)},
                           f"block {k}")
        for n, r, o in zip(names, ref, outs, strict=True):
            errs[n].add(o, r)
        count += len(x)
    if varies is not None:
        varies.update({n: e.varies for n, e in errs.items()})
    if overflow is not None:
        overflow.update({n: e.overflow for n, e in errs.items()})
    return {n: e.error() for n, e in errs.items()}, count


def chain_error(whole_path: str, block_paths: Sequence[str], batch: int = 2, seed: int = 0) -> float:
    """:func:`chain_errors` on one random batch, uniform in [0, 1) like an image; the largest
    error over the outputs (NaN if any is NaN)."""
    import numpy as np

    from .graph import ORT_INPUT_DTYPES, ort_session

    inp = ort_session(whole_path, "the model").get_inputs()[0]
    shape = [batch, *[d if isinstance(d, int) else 1 for d in inp.shape[1:]]]
    x = np.random.default_rng(seed).random(shape).astype(ORT_INPUT_DTYPES.get(inp.type, np.float32))
    errs, _ = chain_errors(whole_path, block_paths, [x])
    return float(np.max(list(errs.values())))


def partition_from_profile(profile_path: str, start: int, end: int,
                           fp16_boundaries: bool = True) -> onnx.ModelProto:
    """The sub-model for blocks [start, end) of a profiled model, rebuilt from the profile's
    recorded model file and block cuts: what an executor loads for the partition a plan assigns."""
    from pathlib import Path

    from ..profiles import load_profile

    prof = load_profile(profile_path)
    rel = prof.extra.get("onnx")
    if not rel or "blocks" not in prof.extra:
        raise InputError(f"{profile_path}: no model file or blocks recorded (not made by ppiped profile)")
    path = Path(profile_path).parent / rel
    if not path.exists():
        raise InputError(f"{path}: the profiled model is missing (re-run ppiped profile or example-model)")
    return Exporter(onnx.load(str(path)), blocks_from_extra(prof.extra["blocks"])).partition(
        start, end, fp16_boundaries)
