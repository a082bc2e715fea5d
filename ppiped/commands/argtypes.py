"""argparse types and checks the commands share.

A bad flag value fails while the command line is parsed, with argparse's own
``ppiped CMD: error: argument --x: ...`` and exit status 2, instead of a traceback, a hang or a
wasted solve much later. Checks that need two flags at once raise :class:`InputError` from the
command (same prefix, same exit status); :class:`CommandFailed` is for a command that could not
do its work though its input was fine (no daemon answering, say): the same one line, exit 1.
"""

from __future__ import annotations

import argparse
import math
import os
import re
from collections.abc import Callable
from pathlib import Path

from ..errors import InputError

MAX_REQUESTS = 50_000_000
"""Most requests one simulated run (or one sweep point) may generate. The whole arrival trace is
drawn up front and the simulator keeps about 100 bytes of state per request, so this is ~5 GB:
more would exhaust the memory of the hosts this runs on (a load factor of 1e9 asked for
hundreds of TiB) long before it told anything a shorter run does not."""

MAX_LOADGEN_REQUESTS = 10_000_000
"""Most requests one ``ppiped loadgen`` run may offer. Its arrival trace is drawn before the
first send and every request keeps Python bookkeeping (~100+ bytes) until answered; one client
process sends some tens of thousands per second, so 10 M is already minutes of load, and a
larger ask (1e9 req/s, say) would spend its time and memory drawing a trace it can never send."""

MAX_FRAME_BYTES = 64 << 20
"""Largest ``--frame-bytes``: loadgen holds 64 frames per model (the daemon's default
``max_payload_bytes`` is 16 MiB)."""


class CommandFailed(Exception):
    """The command could not do its work (its input was fine): one line on stderr, exit 1."""


def _g(x: float) -> str:
    return str(x) if isinstance(x, int) else f"{x:g}"


def _range_text(lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> str:
    if lo is not None and hi is not None:
        return f"in {'(' if lo_open else '['}{_g(lo)}, {_g(hi)}{')' if hi_open else ']'}"
    if lo is not None:
        return f"{'>' if lo_open else '>='} {_g(lo)}"
    if hi is not None:
        return f"{'<' if hi_open else '<='} {_g(hi)}"
    return ""


def _inside(x: float, lo: float | None, hi: float | None, lo_open: bool, hi_open: bool) -> bool:
    if lo is not None and (x <= lo if lo_open else x < lo):
        return False
    return not (hi is not None and (x >= hi if hi_open else x > hi))


def number(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
           hi_open: bool = False, inf_ok: bool = False) -> Callable[[str], float]:
    """A float within [lo, hi] (``lo_open``/``hi_open``: strict); never NaN, and infinite only
    with ``inf_ok`` (and bounds that admit it)."""
    what = ("a number" if inf_ok else "a finite number") + (
        " " + _range_text(lo, hi, lo_open, hi_open) if lo is not None or hi is not None else "")
    if inf_ok:
        what += " (or inf)" if hi is None else ""

    def parse(s: str) -> float:
        try:
            x = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if math.isnan(x) or (math.isinf(x) and not inf_ok) or not _inside(x, lo, hi, lo_open, hi_open):
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return x

    parse.__name__ = "number"
    parse.what = what  # type: ignore[attr-defined]
    return parse


def integer(lo: int | None = None, hi: int | None = None, what: str | None = None) -> Callable[[str], int]:
    """A base-10 integer within [lo, hi] (``what`` describes them in the error)."""
    if what is None:
        what = "an integer" + (" " + _range_text(lo, hi, False, False) if lo is not None or hi is not None else "")

    def parse(s: str) -> int:
        try:
            x = int(s, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}") from None
        if not _inside(x, lo, hi, False, False):
            raise argparse.ArgumentTypeError(f"expected {what}, got {s!r}")
        return x

    parse.__name__ = "integer"
    return parse


def numbers(lo: float | None = None, hi: float | None = None, *, lo_open: bool = False,
            hi_open: bool = False, max_ratio: float | None = None) -> Callable[[str], list[float]]:
    """Comma-separated :func:`number` values (at least one); ``max_ratio`` bounds largest/smallest."""
    one = number(lo, hi, lo_open=lo_open, hi_open=hi_open)

    def parse(s: str) -> list[float]:
        items = [x.strip() for x in s.split(",") if x.strip()]
        if not items:
            raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}")
        out = []
        for x in items:
            try:
                out.append(one(x))
            except argparse.ArgumentTypeError:
                raise argparse.ArgumentTypeError(f"{x!r} in {s!r} is not {one.what}") from None  # type: ignore[attr-defined]
        if max_ratio is not None and max(out) > max_ratio * min(out):
            raise argparse.ArgumentTypeError(
                f"{s!r}: the largest is more than {_g(max_ratio)} x the smallest")
        return out

    parse.__name__ = "numbers"
    return parse


SEED = integer(0, 2**63 - 1, "a non-negative integer below 2**63")
"""Seeds: numpy's generators take non-negative integers only; the core keeps 64 bits."""

DURATION = number(0, 86_400, lo_open=True)
"""Simulated seconds of arrivals: a day at most (the clock, GC ticks and reports are per µs)."""

CV = number(0.01, 20)
"""Bursty arrivals: cv in [0.01, 20] (NaN never draws a gap that ends the trace; at 1e-300 the
gamma shape 1/cv^2 overflowed; beyond 20 it underflows into a few giant bursts)."""

JITTER = number(0, 2)
"""Lognormal sigma of executor latency: 2 already makes one batch in 20 take ~27 x its profile;
larger (or NaN) makes batches that never end on the simulated clock."""

LOAD_FACTOR = number(0, 1000, lo_open=True)
"""Multiples of a plan's throughput; the request cap (:data:`MAX_REQUESTS`) bounds it further."""

FRACTION = number(0, 1)
POSITIVE = number(0, lo_open=True)
POSITIVE_INT = integer(1)
MAX_JOBS = 256
JOBS = integer(1, MAX_JOBS)
"""Worker processes: at most 256 (each is a forked simulator; 100,000 of them hung the host)."""


def model_names(s: str) -> list[str]:
    """Comma-separated model names: each names ``DIR/<name>.json`` in ``--profiles``, so it is
    a file stem, never a path (``../x`` would read a profile from outside the directory)."""
    names = [m.strip() for m in s.split(",")]
    if not any(names):
        raise argparse.ArgumentTypeError(f"expected comma-separated model names, got {s!r}")
    if not all(names):  # "a,,b" or "a,": a name left out by mistake, not nothing
        raise argparse.ArgumentTypeError(f"an empty model name in {s!r}")
    for m in names:
        if "/" in m or "\\" in m or m in (".", ".."):
            raise argparse.ArgumentTypeError(
                f"{m!r} is a path: give model names (the profiles' file stems in --profiles DIR)")
    return names


def gpu_counts(s: str) -> str:
    """``NAME:COUNT,...`` with every GPU type once (a repeated type would silently take the last)."""
    seen: set[str] = set()
    for item in (x.strip() for x in s.split(",") if x.strip()):
        name, sep, n = item.partition(":")
        name = name.strip()
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"expected NAME:COUNT items, got {item!r}")
        try:
            count = int(n, 10)
        except ValueError:
            raise argparse.ArgumentTypeError(f"count of {name} is not an integer: {n!r}") from None
        if count < 0:
            raise argparse.ArgumentTypeError(f"count of {name} is negative: {count}")
        if name in seen:
            raise argparse.ArgumentTypeError(f"GPU type {name} is given twice in {s!r}")
        seen.add(name)
    if not seen:
        raise argparse.ArgumentTypeError(f"expected NAME:COUNT items, got {s!r}")
    return s


def trace_kind(s: str) -> str:
    """``poisson``, ``bursty`` or a readable trace file (a missing path says so, not 'unknown')."""
    if s in ("poisson", "bursty"):
        return s
    p = Path(s)
    if not p.exists():
        raise argparse.ArgumentTypeError(f"{s}: no such file (give poisson, bursty or an Azure "
                                         "Functions trace file)")
    if not p.is_file():
        raise argparse.ArgumentTypeError(f"{s}: not a file (give poisson, bursty or an Azure "
                                         "Functions trace file)")
    if not os.access(p, os.R_OK):
        raise argparse.ArgumentTypeError(f"{s}: not readable")
    return s


def existing_file(s: str) -> str:
    """A file that exists now (so a typo is not silently replaced by a default)."""
    p = Path(s)
    if not p.exists():
        raise argparse.ArgumentTypeError(f"{s}: no such file")
    if not p.is_file():
        raise argparse.ArgumentTypeError(f"{s}: not a file")
    return s


PLOT_FORMATS = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def plot_file(s: str) -> str:
    """An :func:`output_file` whose extension is an image format the plots can write (checked
    first: an unknown one failed in matplotlib after the whole run)."""
    if Path(s).suffix.lower() not in PLOT_FORMATS:
        raise argparse.ArgumentTypeError(f"{s}: a plot is written as {', '.join(PLOT_FORMATS)}")
    return output_file(s)


def output_file(s: str) -> str:
    """A file the command can write when it is done: checked first, so that a long solve or
    run is not lost to a typo in the output path. Nothing is created here."""
    p = Path(s)
    if not s or p.is_dir():
        raise argparse.ArgumentTypeError(f"{s or repr(s)}: is a directory, not a file")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise argparse.ArgumentTypeError(f"{s}: directory {parent} does not exist")
    if p.exists() and not os.access(p, os.W_OK):
        raise argparse.ArgumentTypeError(f"{s}: not writable")
    if not p.exists() and not os.access(parent, os.W_OK | os.X_OK):
        raise argparse.ArgumentTypeError(f"{s}: directory {parent} is not writable")
    return s


_TCP = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.\-]+):(\d{1,5})$")


def client_endpoint(s: str) -> str:
    """An endpoint a client can connect to: ``tcp://HOST:PORT`` or ``ipc://PATH`` (ZeroMQ
    raises a bare 'Invalid argument' for anything else)."""
    if s.startswith("ipc://") and len(s) > 6:
        if len(s) - 6 > 100:
            raise argparse.ArgumentTypeError(f"{s}: ipc path longer than 100 characters (unix socket limit)")
        return s
    m = _TCP.match(s)
    if m and 0 < int(m.group(2)) < 65536:
        return s
    raise argparse.ArgumentTypeError(f"{s!r} is not tcp://HOST:PORT or ipc://PATH")


def check_request_count(expected: float, how: str, cap: int = MAX_REQUESTS) -> None:
    """Refuse a run that would generate more than ``cap`` requests (``expected`` is rate x
    duration; ``how`` says which flags made it)."""
    if not expected <= cap:  # also NaN
        raise InputError(f"{how} makes about {expected:.3g} requests; at most {cap:,} are generated "
                         "per run (they are all drawn up front): lower the load or --duration")


def output_dir(s: str) -> Path:
    """A directory the command can write into (made if missing): checked first, so a file, a
    path under a file or an unwritable place is refused before any work. Nothing is left
    created here (a probe folder is made and removed at once)."""
    import tempfile

    p = Path(s)
    if not s:
        raise argparse.ArgumentTypeError("'': empty path")
    if p.exists() and not p.is_dir():
        raise argparse.ArgumentTypeError(f"{s}: not a directory")
    top = p
    while not top.exists() and top.parent != top:
        top = top.parent
    if top.exists() and not top.is_dir():
        raise argparse.ArgumentTypeError(f"{s}: {top} is a file, not a directory")
    try:
        os.rmdir(tempfile.mkdtemp(prefix=".ppiped-probe-", dir=top))
    except OSError as e:
        raise argparse.ArgumentTypeError(f"{s}: cannot create files under {top} "
                                         f"({e.strerror or e})") from None
    return p


def file_name(s: str) -> str:
    """A plain file name (it names ``DIR/<name>.json`` and ``DIR/<name>/``): a path such as
    ``../x`` or ``/abs`` would write outside the output directory."""
    if not s or "/" in s or "\\" in s or "\0" in s or s in (".", ".."):
        raise argparse.ArgumentTypeError(f"{s!r} is not a plain file name (no '/', not '.', '..' "
                                         "or empty)")
    return s
