"""Wire headers: µs to decode and encode each hot message, msgpack-python plus Python checks
(the wire module before its typed structs, #16) against msgspec's array-like structs (today's).

    .venv/bin/python bench/wire.py [--baseline cef514c] [--n 100000] [--repeat 5]

The baseline is ``ppiped/wire.py`` as of ``--baseline`` (read with ``git show``), so both run
in this process on the same bytes. Decoding reads a memoryview, as a ``zmq.Frame``'s buffer;
both sides check version, type, arity and every field's type. One JSON line per message and
direction: best of ``--repeat`` rounds of ``--n`` calls.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import types
from collections.abc import Callable
from pathlib import Path

import msgspec

from ppiped import wire

ROOT = Path(__file__).resolve().parents[1]
BASELINE = "cef514c"  # the last commit whose wire.py decoded with msgpack-python


def old_wire(rev: str) -> types.ModuleType:
    src = subprocess.run(["git", "-C", str(ROOT), "show", f"{rev}:ppiped/wire.py"], check=True,
                         capture_output=True, text=True).stdout
    mod = types.ModuleType("wire_before_structs")
    exec(compile(src, f"{rev}:ppiped/wire.py", "exec"), mod.__dict__)  # noqa: S102 - our own source
    return mod


def best_us(f: Callable[[], object], n: int, repeat: int) -> float:
    best = float("inf")
    for _ in range(repeat):
        t0 = time.perf_counter()
        for _ in range(n):
            f()
        best = min(best, time.perf_counter() - t0)
    return 1e6 * best / n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--baseline", default=BASELINE, help="git revision of the msgpack-python wire.py")
    ap.add_argument("--n", type=int, default=100_000)
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    old = old_wire(args.baseline)
    ids16 = list(range(10_000, 10_016))
    meta = [["<f2", [16, 10], "logits"]]
    fb: list[int] = []
    for hop in range(2):  # a two-hop batch, as an executor reports it
        fb += [hop, 77, hop, 1_234_567_890 + hop, 1_234_567_990 + hop, 1_234_569_000 + hop]
    sent = 9_876_543_210
    # (name, the arguments of the constructor of that name): the scheduler's hot messages
    hot = [
        ("submit", "SUBMIT-1", ("tiny", 0, [12_345], 0, sent)),
        ("submit", "SUBMIT-32", ("tiny", 0, list(range(5_000, 5_032)), 0, sent)),
        ("result", "RESULT", (77, ids16, meta, [], fb)),
        ("feedback", "FEEDBACK", (fb * 4,)),
        ("dispatch", "DISPATCH", (77, [0, 5], [1_234_567_890, 1_234_568_890], ids16)),
        ("heartbeat", "HEARTBEAT", (1_234_567_890, 3)),
        ("reply", "REPLY", (ids16, wire.Status.OK, "", meta)),
    ]
    for ctor, name, fields in hot:
        raw = getattr(old, ctor)(*fields)
        assert getattr(wire, ctor)(*fields) == raw, name  # the bytes on the wire do not change
        buf = memoryview(raw)
        new = wire.decode(buf)
        assert list(msgspec.structs.astuple(new)) == old.decode(buf), name
        row = {"bench": "wire", "op": "decode", "msg": name, "bytes": len(raw),
               "old_us": best_us(lambda b=buf: old.decode(b), args.n, args.repeat),
               "new_us": best_us(lambda b=buf: wire.decode(b), args.n, args.repeat)}
        row["speedup"] = row["old_us"] / row["new_us"]
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    for ctor, name, fields in hot:
        if ctor not in ("dispatch", "reply", "result"):  # what the daemon and executors send per batch
            continue
        fo, fn = getattr(old, ctor), getattr(wire, ctor)
        row = {"bench": "wire", "op": "encode", "msg": name,
               "old_us": best_us(lambda f=fo, a=fields: f(*a), args.n, args.repeat),
               "new_us": best_us(lambda f=fn, a=fields: f(*a), args.n, args.repeat)}
        row["speedup"] = row["old_us"] / row["new_us"]
        print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
