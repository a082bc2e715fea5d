"""Compiled data plane of ppiped (installed as ``ppiped.kernels``; import it by that name).

- :mod:`.state`   the scheduler's whole state as one int64 arena, its sections and constants
- :mod:`.tables`  reservation tables: sorted interval rows, earliest slot, insert, correct, GC
- :mod:`.depq`    min-max heaps of request slots keyed by deadline
- :mod:`.sched`   probe / reserve, the batching decision (ppipe, reactive), reports, failures

Everything is numba ``njit(cache=True)`` with explicit signatures, compiled on first import and
loaded from numba's on-disk cache afterwards. The Python face is :mod:`ppiped.core`; the
simulator may call :mod:`.sched`'s entry points from its own compiled loop.

Numba keys a cached function on its own file only, so a function that inlined code from another
kernel file would keep running the old code after that file changed. Importing this package
therefore drops the kernels' cache files whenever any kernel source differs from the last import.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

_MODULES = ("state", "tables", "depq", "sched")


def _cache_dirs(here: Path) -> list[Path]:
    try:
        from numba.core import caching, config

        if config.CACHE_DIR:
            sub = caching._UserProvidedCacheLocator.get_suitable_cache_subpath(str(here / "sched.py"))
            return [Path(config.CACHE_DIR) / sub]
    except Exception:  # numba internals moved: fall back to the in-tree cache only
        pass
    return [here / "__pycache__"]


def _drop_stale_cache() -> None:
    here = Path(__file__).resolve().parent
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in sorted(here.glob("*.py")))).hexdigest()
    for d in _cache_dirs(here):
        stamp = d / "ppiped-kernels.stamp"
        try:
            if stamp.read_text() == digest:
                continue
        except OSError:
            pass
        try:
            for f in d.glob("*.nb[ic]"):
                if f.name.split(".", 1)[0] in _MODULES:
                    f.unlink(missing_ok=True)
            d.mkdir(parents=True, exist_ok=True)
            stamp.write_text(digest)
        except OSError:  # read-only install: numba will not cache there either
            pass


_drop_stale_cache()
