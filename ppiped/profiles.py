"""Profile format ``ppiped-profile/1``: per-block latencies and boundary sizes of one model.

The layout is that of the PPipe artifact's profiling data, so ``../shared/data/ppipe/models``
loads as is. Latencies are microseconds, bytes are at batch size 1 (fp16 feature maps).
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .readfile import read_json

PROFILE_FORMAT = "ppiped-profile/1"


class ProfileError(ValueError):
    """A profile file is malformed; the message names the file and the field."""


@dataclass
class Profile:
    """One model's profile, with latencies as arrays for fast range sums.

    ``latency[gpu][split]`` has shape (num_blocks, max_batch) in µs; ``cum[gpu][split]`` is its
    prefix sum over blocks with a leading zero row, so any block range costs two lookups.
    """

    model: str
    num_blocks: int
    latency: dict[str, dict[int, np.ndarray]]
    boundary_bytes: np.ndarray
    whole_model_latency_us: dict[str, float]
    extra: dict[str, Any] = field(default_factory=dict)
    source: str = "<memory>"
    cum: dict[str, dict[int, np.ndarray]] = field(init=False, repr=False)

    def __post_init__(self) -> None:
        self.cum = {
            g: {v: np.vstack([np.zeros((1, a.shape[1])), np.cumsum(a, axis=0)]) for v, a in sp.items()}
            for g, sp in self.latency.items()
        }

    @property
    def gpus(self) -> list[str]:
        return list(self.latency)

    def unsafe_cuts(self) -> frozenset[int]:
        """Block boundaries (a cut before block c) where the profiler found the fp16 hop changes
        the model's outputs beyond its tolerance (``extra.equivalence.unsafe_cuts``): no plan
        cuts there. Entries that are not boundaries of this profile are ignored."""
        eq = self.extra.get("equivalence")
        cuts = eq.get("unsafe_cuts") if isinstance(eq, dict) else None
        if not isinstance(cuts, list):
            return frozenset()
        return frozenset(c for c in cuts if type(c) is int and 0 < c < self.num_blocks)

    def input_spec(self) -> dict[str, Any] | None:
        """The model input as profiled (``{"name", "shape", "dtype", "bytes"}``, shape without
        the batch axis), or None when the profile does not record it (estimate-only profiles)."""
        spec = self.extra.get("input")
        if not isinstance(spec, dict):
            return None
        shape, dtype = spec.get("shape"), spec.get("dtype")
        try:
            n = int(np.prod([int(d) for d in shape])) * np.dtype(dtype).itemsize
        except (TypeError, ValueError):
            return None
        return {"name": spec.get("name"), "shape": list(shape), "dtype": str(dtype), "bytes": n}

    def splits(self, gpu: str) -> list[int]:
        return sorted(self.latency.get(gpu, {}))

    def max_batch(self, gpu: str, split: int) -> int:
        """Largest profiled batch size at this GPU and split (0 if not profiled)."""
        a = self.latency.get(gpu, {}).get(split)
        return 0 if a is None else int(a.shape[1])

    def partition_latency_us(self, gpu: str, split: int, start: int, end: int, bs: int) -> float:
        """Inference latency of blocks [start, end) at batch size ``bs``."""
        c = self.cum[gpu][split]
        return float(c[end, bs - 1] - c[start, bs - 1])

    def transfer_us(self, end: int, bs: int, nic_gbps: float) -> float:
        """Time to send the feature map leaving block ``end - 1`` for a batch (0 after the last block)."""
        if end >= self.num_blocks:
            return 0.0
        return float(self.boundary_bytes[end - 1]) * bs * 8.0 / (nic_gbps * 1e3)

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": PROFILE_FORMAT,
            "model": self.model,
            "num_blocks": self.num_blocks,
            "block_latency_us": {
                g: {str(v): a.tolist() for v, a in sorted(sp.items())} for g, sp in self.latency.items()
            },
            "boundary_bytes": [int(b) for b in self.boundary_bytes],
            "whole_model_latency_us": dict(self.whole_model_latency_us),
        }
        out.update(self.extra)
        return out


def _num(x: Any, where: str) -> float:
    if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or x <= 0:
        raise ProfileError(f"{where}: expected a positive finite number, got {x!r}")
    return float(x)


# A latency outside these (µs) is no measurement of a GPU kernel (1 ns .. 3 hours): planning
# with one sized instance tables by the billion, or took 1e-10 requests/s for an optimum.
MIN_LATENCY_US = 1e-3
MAX_LATENCY_US = 1e10


def _latency(x: Any, where: str) -> float:
    v = _num(x, where)
    if not MIN_LATENCY_US <= v <= MAX_LATENCY_US:
        raise ProfileError(f"{where}: {v:g} µs is outside {MIN_LATENCY_US:g}..{MAX_LATENCY_US:g} µs "
                           "(latencies are microseconds)")
    return v


def profile_from_json(d: Any, source: str = "<memory>") -> Profile:
    """Validate a decoded profile and build a :class:`Profile`. Errors name ``source`` and the field."""
    if not isinstance(d, dict):
        raise ProfileError(f"{source}: a profile is a JSON object, got {type(d).__name__}")
    fmt = d.get("format", PROFILE_FORMAT)
    if fmt != PROFILE_FORMAT:
        what = "an unsupported profile format version" if _is_profile_format(fmt) else "not a profile format"
        raise ProfileError(f"{source}: field format: {fmt!r} is {what} (this ppiped reads {PROFILE_FORMAT!r})")
    for key in ("model", "num_blocks", "block_latency_us", "boundary_bytes", "whole_model_latency_us"):
        if key not in d:
            raise ProfileError(f"{source}: missing field {key!r}")
    model = d["model"]
    if not isinstance(model, str) or not model:
        raise ProfileError(f"{source}: field model: expected a non-empty string")
    nb = d["num_blocks"]
    if isinstance(nb, bool) or not isinstance(nb, int) or nb < 1:
        raise ProfileError(f"{source}: field num_blocks: expected a positive integer, got {nb!r}")
    bl = d["block_latency_us"]
    if not isinstance(bl, dict) or not bl:
        raise ProfileError(f"{source}: field block_latency_us: expected a non-empty object keyed by GPU")
    latency: dict[str, dict[int, np.ndarray]] = {}
    for gpu, per_split in bl.items():
        if not isinstance(per_split, dict) or not per_split:
            raise ProfileError(f"{source}: field block_latency_us.{gpu}: expected an object keyed by split")
        latency[gpu] = {}
        for sk, blocks in per_split.items():
            where = f"{source}: field block_latency_us.{gpu}.{sk[:20]}"
            if not (sk.isascii() and sk.isdigit()) or len(sk) > 6:  # int() would also take " 2 ",
                # "+2", "1_0", and refuse 5,000 digits with a ValueError
                raise ProfileError(f"{where}: split key must be an integer like '1'")
            split = int(sk)
            if split < 1:
                raise ProfileError(f"{where}: split must be >= 1")
            if split in latency[gpu]:  # "1" and "01": one would silently replace the other
                raise ProfileError(f"{where}: split {split} is given twice (keys "
                                   f"{', '.join(repr(k) for k in per_split if k.isdigit() and int(k) == split)})")
            if not isinstance(blocks, list) or len(blocks) != nb:
                n = len(blocks) if isinstance(blocks, list) else type(blocks).__name__
                raise ProfileError(f"{where}: expected {nb} blocks (num_blocks), got {n}")
            widths = {len(b) if isinstance(b, list) else -1 for b in blocks}
            if len(widths) != 1 or min(widths) < 1:
                raise ProfileError(f"{where}: every block needs the same non-empty list of batch sizes")
            arr = np.array(
                [[_latency(x, f"{where}[{i}][{j}]") for j, x in enumerate(b)] for i, b in enumerate(blocks)],
                dtype=np.float64,
            )
            latency[gpu][split] = arr
    bb = d["boundary_bytes"]
    if not isinstance(bb, list) or len(bb) != nb - 1:
        n = len(bb) if isinstance(bb, list) else type(bb).__name__
        raise ProfileError(f"{source}: field boundary_bytes: expected {nb - 1} entries, got {n}")
    boundary = np.array([_num(x, f"{source}: field boundary_bytes[{i}]") for i, x in enumerate(bb)])
    wm = d["whole_model_latency_us"]
    if not isinstance(wm, dict) or not wm:
        raise ProfileError(f"{source}: field whole_model_latency_us: expected an object keyed by GPU")
    whole = {g: _latency(x, f"{source}: field whole_model_latency_us.{g}") for g, x in wm.items()}
    known = {"format", "model", "num_blocks", "block_latency_us", "boundary_bytes", "whole_model_latency_us"}
    extra = {k: v for k, v in d.items() if k not in known}
    return Profile(model, nb, latency, boundary, whole, extra, source)


def load_profile(path: str | Path) -> Profile:
    path = Path(path)
    return profile_from_json(read_json(path, ProfileError), str(path))


def load_profiles(directory: str | Path, models: Iterable[str] | None = None) -> dict[str, Profile]:
    """Load every ``*.json`` profile in ``directory`` (or only ``models``), keyed by model name.

    One rule for every tool: model ``m``'s profile is ``directory/m.json`` and says it is ``m``.
    A name that is a path (``../x``) or a file holding another model is refused, so that no tool
    serves a profile another tool would not find."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ProfileError(f"{directory}: profile directory does not exist")
    out: dict[str, Profile] = {}
    wanted = None if models is None else list(models)
    if wanted is not None:
        for m in wanted:
            if not m or "/" in m or "\\" in m or m.startswith("."):
                raise ProfileError(f"model name {m!r}: a model name is a file name in the profile "
                                   "directory (no '/', '\\' or leading '.')")
            p = directory / f"{m}.json"
            if not p.exists():
                have = sorted(q.stem for q in directory.glob("*.json") if not _declares_other_format(q))
                raise ProfileError(f"unknown model {m!r}: no {p} (profiles here: {', '.join(have) or 'none'})")
            out[m] = _named(load_profile(p), p)
        return out
    for p in sorted(directory.glob("*.json")):
        if _declares_other_format(p):
            continue
        prof = _named(load_profile(p), p)
        out[prof.model] = prof
    if not out:
        raise ProfileError(f"{directory}: no profile files (*.json)")
    return out


def _named(prof: Profile, path: Path) -> Profile:
    if prof.model != path.stem:
        raise ProfileError(f"{path}: holds the profile of {prof.model!r}; model {prof.model!r}'s profile "
                           f"must be {prof.model}.json (rename the file or the model)")
    return prof


def _is_profile_format(fmt: Any) -> bool:
    return isinstance(fmt, str) and fmt.startswith(PROFILE_FORMAT.split("/")[0] + "/")


def _declares_other_format(path: Path) -> bool:
    """A plan or other ppiped file kept beside the profiles: not a profile, and not an error.

    A profile of another format version is not skipped: :func:`load_profile` says its version
    is unsupported (skipping it would end in "no profile files" or "unknown model"). Unreadable
    files are not skipped either, so that loading them names the file and the problem.
    """
    try:
        d = json.loads(path.read_bytes())
    except (OSError, ValueError, RecursionError):  # ValueError: bad JSON or bytes that are not UTF-8
        return False
    return isinstance(d, dict) and not _is_profile_format(d.get("format", PROFILE_FORMAT))


def save_profile(profile: Profile, path: str | Path) -> None:
    Path(path).write_text(json.dumps(profile.to_json(), indent=1) + "\n")
