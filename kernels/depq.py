"""Double-ended priority queues: min-max heaps of request slots keyed by deadline.

Pending requests live in slots (indices into per-request arrays such as the deadline). Queue
``q`` is row ``q`` of a heap section of slot indices, with its length in a size section; even
levels hold minima of their subtrees, odd levels maxima (Atkinson et al., 1986), so both the
earliest and the latest deadline are at hand: PPipe takes from the min end, PARD's
High-Budget-First would take from the max end. A position section tracks each slot's heap index
so any slot can be removed in O(log n). Push, pop-min, pop-max and remove are O(log n); equal
keys pop in any order.

Storage is two flat buffers, ``F`` (float64: the keys) and ``A`` (int64: heap rows, sizes,
positions), and a descriptor ``dq = (heap, row_len, size, key, pos)`` of offsets into them, so
the scheduler's arena works without building array views (numba slices cost ~30 ns each).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .state import DQ, F1, I1, b1, i8, none


@njit(cache=True, inline="always")
def _is_min_level(i):
    # level of node i is floor(log2(i + 1)); even levels are min levels
    lvl = 0
    j = i + 1
    while j > 1:
        j >>= 1
        lvl += 1
    return (lvl & 1) == 0


@njit(cache=True, inline="always")
def _swap(A, hb, pb, i, j):
    a = A[hb + i]
    b = A[hb + j]
    A[hb + i] = b
    A[hb + j] = a
    A[pb + b] = i
    A[pb + a] = j


@njit(cache=True, inline="always")
def _less(F, A, hb, kb, i, j, is_min):
    """Heap index ``i`` must be above ``j`` on a min level (``is_min``) or a max level."""
    ki = F[kb + A[hb + i]]
    kj = F[kb + A[hb + j]]
    return ki < kj if is_min else ki > kj


@njit(none(F1, I1, i8, i8, i8, i8, b1), cache=True)
def _bubble_up_dir(F, A, hb, kb, pb, i, is_min):
    # compare with grandparents only, on levels of the same kind
    while i >= 3:
        gp = (((i - 1) >> 1) - 1) >> 1
        if _less(F, A, hb, kb, i, gp, is_min):
            _swap(A, hb, pb, i, gp)
            i = gp
        else:
            break


@njit(none(F1, I1, i8, i8, i8, i8), cache=True)
def _bubble_up(F, A, hb, kb, pb, i):
    if i == 0:
        return
    p = (i - 1) >> 1
    on_min = _is_min_level(i)
    # a node on a min level that is larger than its (max-level) parent belongs up there
    if _less(F, A, hb, kb, i, p, not on_min):
        _swap(A, hb, pb, i, p)
        _bubble_up_dir(F, A, hb, kb, pb, p, not on_min)
    else:
        _bubble_up_dir(F, A, hb, kb, pb, i, on_min)


@njit(none(F1, I1, i8, i8, i8, i8, i8), cache=True)
def _trickle_down(F, A, hb, kb, pb, i, n):
    is_min = _is_min_level(i)
    while True:
        c = 2 * i + 1
        if c >= n:
            return
        m = c  # best among children and grandchildren
        for j in range(c + 1, min(c + 2, n)):
            if _less(F, A, hb, kb, j, m, is_min):
                m = j
        g0 = 2 * c + 1
        for j in range(g0, min(g0 + 4, n)):
            if _less(F, A, hb, kb, j, m, is_min):
                m = j
        if not _less(F, A, hb, kb, m, i, is_min):
            return
        _swap(A, hb, pb, i, m)
        if m < g0:
            return  # a child: done
        p = (m - 1) >> 1
        if _less(F, A, hb, kb, p, m, is_min):
            _swap(A, hb, pb, m, p)
        i = m


@njit(none(F1, I1, DQ, i8, i8), cache=True)
def push(F, A, dq, q, slot):
    """Add ``slot`` to queue ``q``; the caller guarantees room."""
    hb = dq[0] + q * dq[1]
    i = A[dq[2] + q]
    A[hb + i] = slot
    A[dq[4] + slot] = i
    A[dq[2] + q] = i + 1
    _bubble_up(F, A, hb, dq[3], dq[4], i)


@njit(i8(F1, I1, DQ, i8, i8), cache=True)
def remove_at(F, A, dq, q, i):
    """Remove and return the slot at heap index ``i`` of queue ``q``."""
    hb = dq[0] + q * dq[1]
    pb = dq[4]
    n = A[dq[2] + q] - 1
    out = A[hb + i]
    A[dq[2] + q] = n
    A[pb + out] = -1
    if i < n:
        last = A[hb + n]
        A[hb + i] = last
        A[pb + last] = i
        # the moved element may be out of order above (bubble up) or below (trickle down)
        _bubble_up(F, A, hb, dq[3], pb, i)
        _trickle_down(F, A, hb, dq[3], pb, i, n)
    return out


@njit(cache=True, inline="always")
def size(A, dq, q):
    return A[dq[2] + q]


@njit(cache=True, inline="always")
def peek_min(A, dq, q):
    """Slot with the earliest deadline (the queue must not be empty)."""
    return A[dq[0] + q * dq[1]]


@njit(i8(F1, I1, DQ, i8), cache=True)
def max_index(F, A, dq, q):
    n = A[dq[2] + q]
    if n <= 2:
        return n - 1
    hb = dq[0] + q * dq[1]
    return 1 if F[dq[3] + A[hb + 1]] >= F[dq[3] + A[hb + 2]] else 2


@njit(i8(F1, I1, DQ, i8), cache=True)
def pop_min(F, A, dq, q):
    return remove_at(F, A, dq, q, 0)


@njit(i8(F1, I1, DQ, i8), cache=True)
def pop_max(F, A, dq, q):
    return remove_at(F, A, dq, q, max_index(F, A, dq, q))


@njit(b1(F1, I1, DQ, i8, i8), cache=True)
def remove_slot(F, A, dq, q, slot):
    """Remove ``slot`` from queue ``q`` wherever it sits; False if it is not queued there."""
    i = A[dq[4] + slot]
    if i < 0 or i >= A[dq[2] + q] or A[dq[0] + q * dq[1] + i] != slot:
        return False
    remove_at(F, A, dq, q, i)
    return True


def new_queues(n_queues: int, row_len: int, n_slots: int):
    """Standalone queues ``(F, A, dq)``: keys ``F[:n_slots]``, positions initialised to -1."""
    F = np.zeros(n_slots)
    A = np.zeros(n_queues * row_len + n_queues + n_slots, dtype=np.int64)
    dq = (0, row_len, n_queues * row_len, 0, n_queues * row_len + n_queues)
    A[dq[4]:] = -1
    return F, A, dq
