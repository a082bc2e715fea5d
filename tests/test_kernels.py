"""Property tests of the compiled building blocks against plain-Python statements of them."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st
from ppiped.kernels import depq, tables
from ppiped.kernels import state as S

from ppiped.core.reference import RefTables

# times on a coarse grid so that touching intervals and ties are common
times = st.integers(0, 60).map(float)
durations = st.integers(1, 12).map(float)

table_ops = st.lists(
    st.one_of(
        st.tuples(st.just("reserve"), st.lists(st.integers(0, 2), min_size=1, max_size=2, unique=True),
                  times, durations),
        st.tuples(st.just("gc"), st.integers(0, 10).map(float)),
        st.tuples(st.just("report"), st.integers(0, 40), st.integers(-5, 15).map(float),
                  st.integers(-3, 15).map(float)),
    ),
    max_size=60,
)




def _check_summaries(F, tb, r, row):
    """tail = end of the last interval; gfrom = start of the gapless run that ends there."""
    tail, gfrom = F[tb[6] + r], F[tb[7] + r]
    if not row:
        assert tail == gfrom == -np.inf
        return
    assert tail == row[-1][1]
    i = len(row) - 1
    while i > 0 and row[i - 1][1] == row[i][0]:
        i -= 1
    assert gfrom == row[i][0]


def _check_row(row):
    for (s0, e0, _), (s1, e1, _) in zip(row, row[1:], strict=False):
        assert s0 < e0 and s1 < e1
        assert e0 <= s1, f"overlap {row}"


@settings(max_examples=150, deadline=None)
@given(table_ops, st.sampled_from([4, 64]), st.booleans())
def test_tables_match_reference(ops, cap, pull):
    """earliest slot is the earliest free start; inserts never overlap; reports and GC agree,
    with and without work-conserving pulls."""
    F, A, tb = tables.new_tables(3, cap)
    ref = RefTables(3)
    now = 0.0
    handles = []
    for op in ops:
        if op[0] == "reserve":
            _, rs, t, d = op
            t += now
            if len(rs) == 1:
                s = tables.earliest1(F, A, tb, rs[0], t, d)
            else:
                s = tables.earliest2(F, A, tb, rs[0], rs[1], t, d)
            assert s == ref.earliest(rs, t, d)
            assert s >= t
            if all(tables.room(A, tb, r) > 0 for r in rs):
                for r in rs:
                    h = len(handles) << S.HANDLE_SHIFT | r
                    handles.append(h)
                    tables.insert(F, A, tb, r, s, s + d, h)
                    ref.insert(r, s, s + d, h)
        elif op[0] == "gc":
            now += op[1]
            n = sum(tables.gc_row(F, A, tb, r, now) for r in range(3))
            assert n == ref.gc(now)
        elif handles:
            _, k, a, b = op
            h = handles[k % len(handles)]
            r = h & S.HANDLE_MASK
            a += now
            b += a
            if tables.correct(F, A, tb, r, h, a, b, now, pull) == 0:
                ref.correct(r, h, a, b, now, pull)
        for r in range(3):
            row = tables.row(F, A, tb, r)
            _check_row(row)
            assert row == ref.rows[r]
            _check_summaries(F, tb, r, row)


def test_earliest_fills_gaps_not_only_appends():
    F, A, tb = tables.new_tables(2, 8)
    tables.insert(F, A, tb, 0, 0.0, 10.0, 1)
    tables.insert(F, A, tb, 0, 20.0, 30.0, 2)
    assert tables.earliest1(F, A, tb, 0, 0.0, 5.0) == 10.0  # the gap [10, 20)
    assert tables.earliest1(F, A, tb, 0, 0.0, 11.0) == 30.0  # too long for the gap
    tables.insert(F, A, tb, 1, 8.0, 14.0, 3)
    assert tables.earliest2(F, A, tb, 0, 1, 0.0, 5.0) == 14.0  # both free 14..19
    # the cut-off variant gives up once the slot cannot end by the limit
    assert tables.earliest1_cut(F, A, tb, 0, 0.0, 5.0, 0.0, 15.0) == 10.0
    assert tables.earliest1_cut(F, A, tb, 0, 0.0, 5.0, 0.0, 14.9) == np.inf


def test_correct_late_report_pushes_later_reservations_back():
    F, A, tb = tables.new_tables(1, 8)
    for h, (s, e) in enumerate([(0.0, 10.0), (10.0, 20.0), (25.0, 30.0), (40.0, 50.0)]):
        tables.insert(F, A, tb, 0, s, e, h)
    assert tables.correct(F, A, tb, 0, 0, 1.0, 17.0, -np.inf, False) == 0
    assert tables.row(F, A, tb, 0) == [(1.0, 17.0, 0), (17.0, 27.0, 1), (27.0, 32.0, 2), (40.0, 50.0, 3)]
    # early end: the interval shrinks, nothing else moves
    tables.correct(F, A, tb, 0, 1, 17.0, 21.0, -np.inf, False)
    assert tables.row(F, A, tb, 0)[1] == (17.0, 21.0, 1)
    # did not run: gone
    tables.correct(F, A, tb, 0, 2, 5.0, 5.0, -np.inf, False)
    assert [x[2] for x in tables.row(F, A, tb, 0)] == [0, 1, 3]
    # a report starting inside a still-reserved interval cuts that one short
    tables.correct(F, A, tb, 0, 3, 10.0, 12.0, -np.inf, False)
    assert tables.row(F, A, tb, 0)[:2] == [(1.0, 10.0, 0), (10.0, 12.0, 3)]


def test_gc_keeps_rows_bounded_with_compaction():
    F, A, tb = tables.new_tables(2, 4)
    for k in range(100):
        s = 10.0 * k
        tables.gc_row(F, A, tb, 1, s)
        assert tables.room(A, tb, 1) > 0
        tables.insert(F, A, tb, 1, s, s + 5.0, k)
    assert tables.row(F, A, tb, 1) == [(990.0, 995.0, 99)]
    assert tables.row(F, A, tb, 0) == []


depq_ops = st.lists(
    st.one_of(
        st.tuples(st.just("push"), st.one_of(st.integers(0, 8).map(float), st.floats(0, 1e6))),
        st.tuples(st.just("min")),
        st.tuples(st.just("max")),
        st.tuples(st.just("remove"), st.integers(0, 1000)),
    ),
    max_size=200,
)


@settings(max_examples=200, deadline=None)
@given(depq_ops, st.integers(0, 2))
def test_depq_pops_in_order(ops, q):
    """Min-max heap vs a plain dict: pop-min / pop-max give the extremes, remove works anywhere,
    positions stay consistent; queue q of three shares the buffers with the other two."""
    cap = 256
    F, A, dq = depq.new_queues(3, cap, cap)
    free = list(range(cap))
    live: dict[int, float] = {}
    for op in ops:
        if op[0] == "push" and free:
            s = free.pop()
            F[s] = op[1]
            depq.push(F, A, dq, q, s)
            live[s] = op[1]
        elif op[0] == "min" and live:
            s = depq.pop_min(F, A, dq, q)
            assert F[s] == min(live.values())
            del live[s]
            free.append(s)
        elif op[0] == "max" and live:
            s = depq.pop_max(F, A, dq, q)
            assert F[s] == max(live.values())
            del live[s]
            free.append(s)
        elif op[0] == "remove" and live:
            s = sorted(live)[op[1] % len(live)]
            assert depq.remove_slot(F, A, dq, q, s)
            assert not depq.remove_slot(F, A, dq, q, s)
            del live[s]
            free.append(s)
        n = depq.size(A, dq, q)
        assert n == len(live)
        row = [int(x) for x in A[dq[0] + q * cap:dq[0] + q * cap + n]]
        assert sorted(row) == sorted(live)
        assert all(A[dq[4] + slot] == i for i, slot in enumerate(row))
        if live:
            assert F[depq.peek_min(A, dq, q)] == min(live.values())
    assert all(depq.size(A, dq, other) == 0 for other in range(3) if other != q)
    out = [F[depq.pop_min(F, A, dq, q)] for _ in range(len(live))]
    assert out == sorted(live.values())


def test_section_constants_follow_sections():
    for k, (name, kind, _) in enumerate(S.SECTIONS):
        assert getattr(S, f"X_{name.upper()}") == k
        assert kind in "if"
    a = S.Arena({d: 3 for d in S.DIM_SLOTS})
    assert a.view("t_start").shape == (3, 3)
    assert a.view("pool_v0").shape == (4,)
    a.view("t_start")[1, 2] = 2.5
    a.A[S.H_SEQ] = 7
    b = a.grown(C=5)
    assert b.view("t_start")[1, 2] == 2.5 and b.view("t_start").shape == (3, 5)
    assert b.A[S.H_SEQ] == 7 and b.A[S.H_C] == 5
