"""Glue callables for tests and demos on emulated executors (which echo their input).

:func:`fan` reads what to do from the parent's output, which the emulator makes the client's
frame: its first byte ``k`` below 250 yields ``k`` children (each the frame's bytes with the
child's index appended, so every child is told apart end to end); 250 raises, 251 sleeps for 30 s
(past any test's ``glue.timeout_ms``), 252 kills its own worker process, 253 returns a non-list.
It lives in the package so glue worker processes can import it wherever tests run.
"""

from __future__ import annotations

import os
import time
from typing import Any

import numpy as np

RAISE, SLEEP, DIE, BAD = 250, 251, 252, 253


def fan(outputs: list[np.ndarray], frame: np.ndarray, spec: Any) -> Any:
    """``k`` children of the parent's first output byte (see the module docstring)."""
    data = outputs[0].tobytes()
    k = data[0] if data else 0
    if k == RAISE:
        raise ValueError("testing_glue.fan was told to fail")
    if k == SLEEP:
        time.sleep(30)
    if k == DIE:
        os._exit(3)
    if k == BAD:
        return 42
    return [data + bytes([j]) for j in range(k)]


def frame(k: int, tag: bytes = b"") -> bytes:
    """A client frame that makes :func:`fan` yield ``k`` children (or do RAISE, SLEEP, ...)."""
    return bytes([k]) + tag
