"""Reservation tables: per resource, a sorted array of future busy intervals.

All resources share three flat sections with a row of ``cap`` places each: start and end (µs,
in a float64 buffer ``F``) and the reservation's handle (in an int64 buffer ``A``, which also holds
``lo`` and ``hi``). Resource ``r`` owns places ``r * cap .. r * cap + cap - 1``; its live
intervals are row positions ``[lo[r], hi[r])``. Two dense float summaries per row let a probe
skip most rows without reading them: ``tail[r]``, the end of the last interval, and
``gfrom[r]``, the start of the gapless run of intervals that ends at the tail (both -inf when the
row is empty). A request that can start at ``t >= gfrom[r]`` cannot use a gap, so its slot is
``max(t, tail[r])``. A descriptor ``tb = (start, end, handle, lo, hi, cap, tail, gfrom)`` gives
the sections' offsets in the buffers, so the scheduler's arena is used in place (numba slices
cost ~30 ns each, more than a whole slot search).
Live intervals are sorted by start and never overlap, so they are sorted by end too and one
binary search finds the first interval that can matter for a time ``t``. Garbage collection only
moves ``lo`` forward; an insert into a row whose tail is full slides the live part back first.

Why sorted arrays and not a tree: a resource holds a handful of future intervals (the scheduler
reserves about one SLO ahead), so a binary search plus a short memmove beats a pointer
structure; ``bench/dispatch.py --tables`` measures it against an array-based treap.

Intervals are half-open ``[start, end)`` in µs (float64).
"""

from __future__ import annotations

import numpy as np
from numba import njit

from .state import F1, I1, TB, b1, f8, i8, none

# how close (µs) an interval's start must be to the previous one's end to count as queued
# right behind it: the core places such a start at exactly that end, a push keeps it there
_CHAIN_EPS = 1e-6


@njit(cache=True, inline="always")
def first_end_after(F, tb, base, a, b, t):
    """First row position in ``[a, b)`` whose interval ends after ``t`` (``b`` if none)."""
    oe = tb[1] + base
    while a < b:
        m = (a + b) >> 1
        if F[oe + m] > t:
            b = m
        else:
            a = m + 1
    return a


@njit(cache=True, inline="always")
def earliest1_cut(F, A, tb, r, t, d, extra, limit):
    """First start ``s >= t`` with ``[s, s + d)`` free on resource ``r`` (it fills gaps), or inf
    once ``s + d + extra > limit``.

    The probe uses the cut-off to stop scanning a vGPU as soon as it cannot beat the best one so
    far; ``extra`` lets the bound be computed exactly as the caller computes its finish time.
    """
    base = r * tb[5]
    os = tb[0] + base
    oe = tb[1] + base
    h = A[tb[4] + r]
    if h == A[tb[3] + r] or t >= F[oe + h - 1]:
        return t if t + d + extra <= limit else np.inf
    i = first_end_after(F, tb, base, A[tb[3] + r], h, t)
    s = t
    while i < h:
        if s + d + extra > limit:
            return np.inf
        if s + d <= F[os + i]:
            return s
        s = F[oe + i]
        i += 1
    return s if s + d + extra <= limit else np.inf


@njit(f8(F1, I1, TB, i8, f8, f8), cache=True)
def earliest1(F, A, tb, r, t, d):
    """First start ``s >= t`` with ``[s, s + d)`` free on resource ``r``; fills gaps."""
    return earliest1_cut(F, A, tb, r, t, d, 0.0, np.inf)


@njit(cache=True, inline="always")
def earliest2_cut(F, A, tb, ra, rb, t, d, extra, limit):
    """First start ``s >= t`` with ``[s, s + d)`` free on both ``ra`` and ``rb`` (with the cut-off
    of :func:`earliest1_cut`). Alternates between the rows; every step jumps to an interval end,
    so it stops within as many steps as the rows hold intervals past ``t``."""
    s = t
    while True:
        sa = earliest1_cut(F, A, tb, ra, s, d, extra, limit)
        if sa == np.inf:
            return sa
        sb = earliest1_cut(F, A, tb, rb, sa, d, extra, limit)
        if sb == sa or sb == np.inf:
            return sb
        s = sb


@njit(f8(F1, I1, TB, i8, i8, f8, f8), cache=True)
def earliest2(F, A, tb, ra, rb, t, d):
    return earliest2_cut(F, A, tb, ra, rb, t, d, 0.0, np.inf)


@njit(none(F1, I1, TB, i8, i8, i8), cache=True)
def _move(F, A, tb, base, dst, src):
    F[tb[0] + base + dst] = F[tb[0] + base + src]
    F[tb[1] + base + dst] = F[tb[1] + base + src]
    A[tb[2] + base + dst] = A[tb[2] + base + src]


@njit(none(F1, I1, TB, i8), cache=True)
def compact(F, A, tb, r):
    """Slide the live intervals of row ``r`` back to row position 0."""
    a = A[tb[3] + r]
    if a == 0:
        return
    base = r * tb[5]
    n = A[tb[4] + r] - a
    for k in range(n):
        _move(F, A, tb, base, k, a + k)
    A[tb[3] + r] = 0
    A[tb[4] + r] = n


@njit(cache=True, inline="always")
def room(A, tb, r):
    """Free places in row ``r`` once compacted."""
    return tb[5] - (A[tb[4] + r] - A[tb[3] + r])


@njit(none(F1, I1, TB, i8), cache=True)
def _retail(F, A, tb, r):
    """Recompute the row summaries ``tail`` and ``gfrom`` (see the module docstring)."""
    lo = A[tb[3] + r]
    i = A[tb[4] + r] - 1
    if i < lo:
        F[tb[6] + r] = -np.inf
        F[tb[7] + r] = -np.inf
        return
    os = tb[0] + r * tb[5]
    oe = tb[1] + r * tb[5]
    F[tb[6] + r] = F[oe + i]
    while i > lo and F[oe + i - 1] == F[os + i]:
        i -= 1
    F[tb[7] + r] = F[os + i]


@njit(cache=True, inline="always")
def _first_at_or_after(F, os, lo, hi, t):
    """Binary search over the starts ``F[os + lo:os + hi]`` (sorted): the first position whose
    interval starts at or after ``t``."""
    while lo < hi:
        m = (lo + hi) >> 1
        if F[os + m] < t:
            lo = m + 1
        else:
            hi = m
    return lo


@njit(cache=True, inline="always")
def _push_later(F, os, oe, q, hi, cur):
    """Shift the intervals from row position ``q`` on that start before ``cur`` to start at the
    end of the one before them, keeping their durations (a reservation ran long)."""
    while q < hi and F[os + q] < cur:
        dur = F[oe + q] - F[os + q]
        F[os + q] = cur
        F[oe + q] = cur + dur
        cur = F[oe + q]
        q += 1


@njit(cache=True, inline="always")
def _pull_earlier(F, os, oe, q, hi, old_end, new_end):
    """The mirror of :func:`_push_later` for a work-conserving resource: a reservation that
    ended at ``new_end`` instead of ``old_end`` lets the intervals queued right behind it (each
    starting where the one before it was to end) start that much sooner, keeping their
    durations. An interval after a gap waited for something else (its input) and stays."""
    while q < hi and new_end < old_end and abs(F[os + q] - old_end) <= _CHAIN_EPS:
        s = F[os + q]
        e = F[oe + q]
        F[os + q] = new_end
        F[oe + q] = e - (s - new_end)
        old_end = e
        new_end = F[oe + q]
        q += 1


@njit(i8(F1, I1, TB, i8, f8, f8, i8), cache=True)
def insert(F, A, tb, r, s, e, h):
    """Insert ``[s, e)`` with handle ``h`` into row ``r``; the caller guarantees that it overlaps
    nothing and that the row has room. Returns its row position."""
    if A[tb[4] + r] == tb[5]:
        compact(F, A, tb, r)
    base = r * tb[5]
    os = tb[0] + base
    hi = A[tb[4] + r]
    a = _first_at_or_after(F, os, A[tb[3] + r], hi, s)
    for k in range(hi, a, -1):
        _move(F, A, tb, base, k, k - 1)
    F[os + a] = s
    F[tb[1] + base + a] = e
    A[tb[2] + base + a] = h
    A[tb[4] + r] = hi + 1
    _retail(F, A, tb, r)
    return a


@njit(i8(I1, TB, i8, i8), cache=True)
def find_handle(A, tb, r, h):
    """Row position of the interval with handle ``h`` in row ``r``, or -1. Rows are short."""
    oh = tb[2] + r * tb[5]
    for i in range(A[tb[3] + r], A[tb[4] + r]):
        if A[oh + i] == h:
            return i
    return -1


@njit(i8(F1, I1, TB, i8, i8, f8), cache=True)
def find_handle_near(F, A, tb, r, h, t):
    """:func:`find_handle`, searching outwards from the intervals that start around ``t``: a
    report names a reservation that started about when it really ran, while the row also holds
    the reservations before it (until the next GC) and after it (about one SLO ahead)."""
    base = r * tb[5]
    os = tb[0] + base
    oh = tb[2] + base
    lo = A[tb[3] + r]
    hi = A[tb[4] + r]
    a = _first_at_or_after(F, os, lo, hi, t)
    i = a - 1
    j = a
    while i >= lo or j < hi:
        if j < hi:
            if A[oh + j] == h:
                return j
            j += 1
        if i >= lo:
            if A[oh + i] == h:
                return i
            i -= 1
    return -1


@njit(i8(F1, I1, TB, i8, i8, f8, f8, f8, b1), cache=True)
def correct(F, A, tb, r, h, a, b, horizon, pull):
    """Feedback correction: make row ``r`` say that reservation ``h`` really used ``[a, b)``.

    The old interval (if still there) is removed. If ``b <= a`` the use did not happen and that is
    all. Otherwise ``[a, b)`` goes in: an earlier interval still running at ``a`` is cut at ``a``
    (the resource moved on, so it had finished), and later intervals that now overlap are pushed
    back, keeping their lengths, as a FIFO executor would run them. With ``pull`` (the resource
    is work-conserving), a use that ended before its reserved end pulls the intervals queued
    right behind it forward by as much (:func:`_pull_earlier`). Nothing ending at or before
    ``horizon`` (the last GC time) is re-inserted. Returns 0, or 1 if the row is full (nothing
    changed then; grow the table and call again).
    """
    cap = tb[5]
    i = find_handle_near(F, A, tb, r, h, a)
    add = b > a and b > horizon
    if add and i < 0 and room(A, tb, r) <= 0:
        return 1
    base = r * cap
    if add and i >= 0:
        os = tb[0] + base
        lo = A[tb[3] + r]
        hi = A[tb[4] + r]
        if (i == lo or F[os + i - 1] < a) and (i + 1 == hi or F[os + i + 1] >= a):
            # the usual report: [a, b) keeps the old interval's place among the starts, so
            # removing and re-inserting it would put it back here; rewrite it in place
            oe = tb[1] + base
            if i > lo and F[oe + i - 1] > a:
                F[oe + i - 1] = a
            old_end = F[oe + i]
            F[os + i] = a
            F[oe + i] = b
            _push_later(F, os, oe, i + 1, hi, b)
            if pull:
                _pull_earlier(F, os, oe, i + 1, hi, old_end, b)
            _retail(F, A, tb, r)
            return 0
    old_end = -np.inf
    if i >= 0:
        old_end = F[tb[1] + base + i]
        for k in range(i, A[tb[4] + r] - 1):
            _move(F, A, tb, base, k, k + 1)
        A[tb[4] + r] -= 1
        _retail(F, A, tb, r)
    if not add:
        return 0
    if A[tb[4] + r] == cap:
        compact(F, A, tb, r)
    os = tb[0] + base
    oe = tb[1] + base
    lo = A[tb[3] + r]
    j = _first_at_or_after(F, os, lo, A[tb[4] + r], a)  # its predecessor is the last before a
    if j > lo and F[oe + j - 1] > a:
        F[oe + j - 1] = a
    pos = insert(F, A, tb, r, a, b, h)
    _push_later(F, os, oe, pos + 1, A[tb[4] + r], b)
    if pull:
        _pull_earlier(F, os, oe, pos + 1, A[tb[4] + r], old_end, b)
    _retail(F, A, tb, r)
    return 0



@njit(cache=True, inline="always")
def gc_row(F, A, tb, r, now):
    """Drop the intervals of row ``r`` that ended at or before ``now``; returns how many."""
    a = A[tb[3] + r]
    h = A[tb[4] + r]
    b = first_end_after(F, tb, r * tb[5], a, h, now)
    if b == h:
        A[tb[3] + r] = 0
        A[tb[4] + r] = 0
        F[tb[6] + r] = -np.inf
        F[tb[7] + r] = -np.inf
    elif b > a:
        A[tb[3] + r] = b
        # the gapless run may have begun among the dropped intervals
        F[tb[7] + r] = max(F[tb[7] + r], F[tb[0] + r * tb[5] + b])
    return b - a


@njit(cache=True, inline="always")
def clear_row(F, A, tb, r):
    A[tb[3] + r] = 0
    A[tb[4] + r] = 0
    F[tb[6] + r] = -np.inf
    F[tb[7] + r] = -np.inf


def new_tables(n_resources: int, capacity: int):
    """Empty standalone tables ``(F, A, tb)`` (the scheduler keeps its own in an arena)."""
    n = n_resources * capacity
    F = np.zeros(2 * n + 2 * n_resources)
    F[2 * n:] = -np.inf
    A = np.zeros(n + 2 * n_resources, dtype=np.int64)
    return F, A, (0, n, 0, n, n + n_resources, capacity, 2 * n, 2 * n + n_resources)


def row(F: np.ndarray, A: np.ndarray, tb: tuple, r: int) -> list[tuple[float, float, int]]:
    """Live intervals ``(start, end, handle)`` of row ``r``, for tests and inspection."""
    b = r * tb[5]
    return [(float(F[tb[0] + b + i]), float(F[tb[1] + b + i]), int(A[tb[2] + b + i]))
            for i in range(A[tb[3] + r], A[tb[4] + r])]
