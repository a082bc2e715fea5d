"""The packing of a rounding group's vGPUs on whole GPUs (ppiped.packing)."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

from hypothesis import given, settings
from hypothesis import strategies as st

from ppiped.packing import pack


def _check_placement(members, n, placed):
    room = [Fraction(1)] * n
    for (v, count), where in zip(members, placed, strict=True):
        assert len(where) == count
        for g in where:
            room[g] -= Fraction(1, v)
    assert all(r >= 0 for r in room)
    assert all(r < 1 for r in room)  # no GPU left empty


def test_splits_one_to_four_always_fit_the_rounded_up_count():
    """Every mix of 0-5 vGPUs of each split 1-4 (so every leftover mix past whole GPUs): the
    group fits in ceil(sum of 1/split), PPipe's rounding, which the planner's MILP uses."""
    for counts in itertools.product(range(6), repeat=4):
        members = [(v, c) for v, c in zip((1, 2, 3, 4), counts, strict=True) if c]
        if not members:
            continue
        n, placed = pack(members)
        _check_placement(members, n, placed)
        assert n == math.ceil(sum(Fraction(c, v) for v, c in members))


def test_members_keep_plan_order_among_equal_splits():
    n, placed = pack([(2, 1), (2, 1), (1, 1)])
    assert n == 2 and placed == [[1], [1], [0]]


@settings(max_examples=200, deadline=None)
@given(st.lists(st.tuples(st.integers(1, 12), st.integers(1, 30)), min_size=1, max_size=6))
def test_any_splits_place_every_vgpu_within_the_gpus_counted(members):
    n, placed = pack(members)
    _check_placement(members, n, placed)
    assert n >= math.ceil(sum(Fraction(c, v) for v, c in members))
