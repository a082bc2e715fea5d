"""Inputs for the block-equivalence check, and the check itself.

A detector's probability map is ~0 on noise, so comparing the block chain with the whole model on
random input says little: ``ppiped profile --calibration PATH`` runs it on real samples instead.
PATH is a ``.npy`` file holding a batch ``[B, *input_shape]`` or one sample ``[*input_shape]``,
an image (.png .jpg .jpeg .ppm .pgm .bmp), or a folder of such files (read in name order).

Images are decoded with Pillow, resized to the model's input H x W, and fed channels-first
(RGB, or grey for a one-channel input) as floats scaled to [0, 1]. A model trained with another
normalisation (ImageNet mean/std, [-1, 1], BGR) should be given ``.npy`` files prepared as it
expects: the check compares the blocks with the whole model, so inputs outside the model's usual
range make its figure less telling.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import InputError

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg", ".ppm", ".pgm", ".bmp")
RANDOM_SAMPLES = 2
NPY_CHUNK = 64  # samples read from a .npy file at a time
METRIC = ("per output: max |blocks in sequence (fp16 boundaries) - whole model| / (max - min of the "
          "whole model's output over the input; max |output| where that range is 0); the figure is "
          "the largest over the outputs")


@dataclass(frozen=True)
class ModelInput:
    """The model's input as the profile records it (shape without the batch axis)."""

    name: str
    shape: tuple[int, ...]
    dtype: np.dtype


class Calibration:
    """Samples from a ``.npy`` file or a folder, read lazily file by file (a large set need not
    fit in memory); every file is checked against the model's input as it is read."""

    def __init__(self, path: Path, inp: ModelInput) -> None:
        self.path = Path(path)
        self.inp = inp
        if self.path.is_dir():
            self.files = sorted(p for p in self.path.iterdir() if p.is_file() and not p.name.startswith(".")
                                and p.suffix.lower() in (".npy", *IMAGE_SUFFIXES))
            if not self.files:
                raise InputError(f"calibration folder {self.path} holds no .npy or image files "
                                 f"({', '.join(IMAGE_SUFFIXES)})")
        elif self.path.is_file():
            if self.path.suffix.lower() not in (".npy", *IMAGE_SUFFIXES):
                raise InputError(f"calibration input {self.path}: expected a .npy file, an image "
                                 "or a folder of them")
            self.files = [self.path]
        else:
            raise InputError(f"calibration input {self.path} does not exist")

    def samples(self) -> Iterator[np.ndarray]:
        """Each file's samples as ``[b, *input_shape]`` in the model's dtype."""
        for f in self.files:
            if f.suffix.lower() != ".npy":
                yield _load_image(f, self.inp)[None]
                continue
            x = _open_npy(f, self.inp)
            for k in range(0, len(x), NPY_CHUNK):  # a mapped file is read a slice at a time
                yield _cast(f, x[k:k + NPY_CHUNK], self.inp.dtype)

    def batches(self, size: int) -> Iterator[np.ndarray]:
        return rebatch(self.samples(), size)

    def describe(self, count: int) -> str:
        return f"calibration: {self.path}, {count} sample{'s' if count != 1 else ''}"


def rebatch(chunks: Iterable[np.ndarray], size: int) -> Iterator[np.ndarray]:
    """Regroup arrays of any batch length into batches of ``size`` (the last may be shorter)."""
    if size < 1:
        raise ValueError("batch size must be positive")
    buf: list[np.ndarray] = []
    held = 0
    for c in chunks:
        start = 0
        while start < len(c):
            take = c[start:start + size - held]
            buf.append(take)
            held += len(take)
            start += len(take)
            if held == size:
                yield np.ascontiguousarray(np.concatenate(buf))
                buf, held = [], 0
    if buf:
        yield np.ascontiguousarray(np.concatenate(buf))


def random_batches(inp: ModelInput, samples: int = RANDOM_SAMPLES, batch: int = 2,
                   seed: int = 0) -> tuple[list[np.ndarray], str]:
    """Image-like random input (uniform [0, 1) rather than N(0, 1), whose negative half a
    normalised-image model never sees) and how the profile names it."""
    rng = np.random.default_rng(seed)
    shape = (samples, *inp.shape)
    if np.issubdtype(inp.dtype, np.floating):
        x, what = rng.random(shape).astype(inp.dtype), "random uniform [0,1)"
    else:
        x, what = rng.integers(0, 256, shape).astype(inp.dtype), "random integers [0,256)"
    return list(rebatch([x], batch)), f"{what}, {samples} samples (no calibration input given)"


def _shape_text(shape: Sequence[int]) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _open_npy(path: Path, inp: ModelInput) -> np.ndarray:
    """The file's array (memory-mapped where numpy can), shape and dtype checked, batch axis added."""
    try:
        try:
            x = np.load(path, mmap_mode="r", allow_pickle=False)
        except ValueError:  # numpy cannot map some arrays (an empty one): read it whole
            x = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as e:
        raise InputError(f"calibration file {path}: not a readable .npy array ({e})") from None
    want = tuple(inp.shape)
    if x.shape == want:
        x = x[None]
    elif x.shape[1:] != want:
        raise InputError(f"calibration file {path}: shape {_shape_text(x.shape)}, but the model's input "
                         f"{inp.name!r} wants {_shape_text(want)} or a batch {_shape_text(('B', *want))}")
    floats = np.issubdtype(inp.dtype, np.floating)
    if x.dtype != inp.dtype and not (floats and np.issubdtype(x.dtype, np.floating)):
        raise InputError(f"calibration file {path}: dtype {x.dtype}, but the model's input {inp.name!r} "
                         f"wants {inp.dtype}" + (" (convert to float and normalise as the model expects)"
                                                 if floats else ""))
    return x


def _cast(path: Path, x: np.ndarray, dtype: np.dtype) -> np.ndarray:
    out = np.asarray(x, dtype=dtype)
    if np.issubdtype(dtype, np.floating) and not np.all(np.isfinite(out)):
        raise InputError(f"calibration file {path}: holds NaN or infinite values")
    return out


def _load_image(path: Path, inp: ModelInput) -> np.ndarray:
    shape = tuple(inp.shape)
    if len(shape) != 3 or shape[0] not in (1, 3) or not np.issubdtype(inp.dtype, np.floating):
        raise InputError(f"calibration file {path}: images fit a float input [C, H, W] with C = 1 or 3, "
                         f"but the model's input {inp.name!r} is {inp.dtype} {_shape_text(shape)}; "
                         "pass .npy arrays instead")
    try:
        from PIL import Image
    except ImportError:
        raise InputError(f"calibration file {path}: reading images needs Pillow (pip install pillow); "
                         "or pass .npy arrays") from None
    c, h, w = shape
    try:
        with Image.open(path) as im:
            im = im.convert("RGB" if c == 3 else "L").resize((w, h), Image.Resampling.BILINEAR)
            a = np.asarray(im, dtype=np.float32) / 255.0
    except (OSError, ValueError) as e:
        raise InputError(f"calibration file {path}: cannot read the image ({e})") from None
    a = a.transpose(2, 0, 1) if c == 3 else a[None]
    return a.astype(inp.dtype)


def _check_inputs(inp: ModelInput, calibration: Path | None, max_batch: int):
    """The batches a check runs (a fresh iterable per call), their batch size, and a function
    naming them given the sample count."""
    batch = max(1, max_batch)
    if calibration is not None:
        cal = Calibration(calibration, inp)
        return (lambda: cal.batches(batch)), batch, cal.describe
    xs, what = random_batches(inp, batch=min(2, batch))
    return (lambda: xs), min(2, batch), (lambda _count: what)


def check_equivalence(whole_path: Path | str, block_paths: Sequence[Path | str], inp: ModelInput,
                      calibration: Path | None, max_batch: int, tolerance: float) -> dict[str, Any]:
    """Run the blocks in sequence against the whole model with ONNX Runtime; the record the
    profile keeps under ``extra['equivalence']``."""
    from .export import chain_errors

    varies: dict[str, bool] = {}
    overflow: dict[str, bool] = {}
    batches, batch, describe = _check_inputs(inp, calibration, max_batch)
    errors, count = chain_errors(str(whole_path), [str(p) for p in block_paths], batches(), varies, overflow)
    if count == 0:
        raise InputError(f"calibration input {calibration} holds no samples")
    what = describe(count)
    worst = max(errors, key=lambda k: (np.isnan(errors[k]), errors[k]))
    err = errors[worst]
    return {
        "max_rel_error": _figure(err),
        "worst_output": worst,
        "per_output": {k: _figure(v) for k, v in errors.items()},
        "passed": bool(err <= tolerance),
        # outputs the inputs did not move: equal blocks there prove little (weights that
        # ignore the input, or a single sample)
        "input_insensitive": sorted(k for k, v in varies.items() if not v),
        "overflow": sorted(k for k, v in overflow.items() if v),
        "tolerance": tolerance,
        "metric": METRIC,
        "input": what,
        "calibration": str(calibration) if calibration is not None else None,
        "samples": count,
        "batch": batch,
        "backend": "ort",
    }


def cut_errors(whole_path: Path | str, pairs: Sequence[tuple[int, Path, Path]], inp: ModelInput,
               calibration: Path | None, max_batch: int) -> dict[int, float]:
    """Per cut ``c``: the model in two at that cut alone (``pairs``: (c, blocks before, blocks
    after) as files), fp16 at the cut only, against the whole model; the largest error over the
    outputs, NaN where the cut overflows fp16. Which cuts the fp16 hop itself spoils, where
    the check of every block in sequence only says that some do."""
    from .export import chain_errors

    batches, _, _ = _check_inputs(inp, calibration, max_batch)
    out: dict[int, float] = {}
    for c, a, b in pairs:
        overflow: dict[str, bool] = {}
        errors, _ = chain_errors(str(whole_path), [str(a), str(b)], batches(), None, overflow)
        out[c] = math.nan if any(overflow.values()) else max(errors.values())
    return out


def _figure(x: float) -> float | None:
    """Three significant digits; None for NaN/inf (JSON has no such numbers; 'passed' is false)."""
    return float(f"{x:.3g}") if np.isfinite(x) else None
