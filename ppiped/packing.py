"""How the vGPUs of one rounding group sit on whole GPUs: the one packing every tool uses.

PPipe's budget rule rounds each group's GPU use (vGPUs / split, summed) up to whole GPUs. Whether
that many GPUs really hold the group is a bin-packing question: 3 half, 3 third and 2 quarter
vGPUs fill exactly 3 GPUs, but first fit, larger first, opens a fourth. The checker, the
planner's fit test and the serving layout all count with :func:`pack`, so a plan the checker
passes is a plan the daemon can place.

Same-split vGPUs fill whole GPUs first; the few left over (fewer than the split, per split) are
packed by an exact search, bounded: past ``_NODE_CAP`` nodes it keeps the best packing found.
With splits of 1 to 4 every group fits in the rounded-up count (``tests/test_packing.py`` tries
every leftover mix).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

_NODE_CAP = 200_000


def pack(members: Sequence[tuple[int, int]]) -> tuple[int, list[list[int]]]:
    """Place ``members`` = [(split, vGPU count), ...] on whole GPUs.

    Returns the number of GPUs and, per member, the GPU index (0-based) of each of its vGPUs.
    Larger vGPUs come first; among equal splits, members keep their order.
    """
    gpus: list[list[int]] = [[] for _ in members]
    order = sorted(range(len(members)), key=lambda i: members[i][0])
    unit = math.lcm(*(max(1, v) for v, _ in members)) if members else 1
    n_gpus = 0
    leftovers: list[tuple[int, int]] = []  # (size in units, member)
    i = 0
    while i < len(order):
        v = members[order[i]][0]
        same = []
        while i < len(order) and members[order[i]][0] == v:
            same.append(order[i])
            i += 1
        queue = [m for m in same for _ in range(members[m][1])]
        whole = len(queue) // v
        for k in range(whole * v):
            gpus[queue[k]].append(n_gpus + k // v)
        n_gpus += whole
        leftovers += [(unit // v, m) for m in queue[whole * v:]]
    if leftovers:
        bins = _pack_items([s for s, _ in leftovers], unit)
        for (_, m), b in zip(leftovers, bins, strict=True):
            gpus[m].append(n_gpus + b)
        n_gpus += max(bins) + 1
    return n_gpus, gpus


def pack_count(members: Sequence[tuple[int, int]]) -> int:
    """GPUs :func:`pack` needs for ``members``."""
    return pack(members)[0]


def _pack_items(sizes: list[int], cap: int) -> list[int]:
    """Bin of each item (sizes in units, bins of ``cap`` units, sizes non-increasing): first fit,
    then a depth-first search for fewer bins down to the volume bound."""
    first = _first_fit(sizes, cap)
    best_n = max(first) + 1
    lower = -(-sum(sizes) // cap)
    if best_n <= lower:
        return first
    best = list(first)
    free: list[int] = []
    at = [0] * len(sizes)
    nodes = 0

    def dfs(k: int) -> bool:
        nonlocal best_n, best, nodes
        nodes += 1
        if nodes > _NODE_CAP:
            return True
        if k == len(sizes):
            if len(free) < best_n:
                best_n, best = len(free), list(at)
            return best_n <= lower
        tried: set[int] = set()
        for b in range(len(free)):
            if free[b] >= sizes[k] and free[b] not in tried:  # bins of equal room are alike
                tried.add(free[b])
                free[b] -= sizes[k]
                at[k] = b
                if dfs(k + 1):
                    return True
                free[b] += sizes[k]
        if len(free) + 1 < best_n:
            free.append(cap - sizes[k])
            at[k] = len(free) - 1
            if dfs(k + 1):
                return True
            free.pop()
        return False

    dfs(0)
    return best


def _first_fit(sizes: list[int], cap: int) -> list[int]:
    free: list[int] = []
    out = []
    for s in sizes:
        for b, room in enumerate(free):
            if room >= s:
                free[b] -= s
                out.append(b)
                break
        else:
            free.append(cap - s)
            out.append(len(free) - 1)
    return out
