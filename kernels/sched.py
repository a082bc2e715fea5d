"""The compiled data plane: probe, reserve, the batching decision, reports, failures, GC.

Every entry point takes the arena ``A`` (see :mod:`state`) and plain scalars, so one call from
Python costs well under a microsecond on top of the work. Times are float64 µs on the caller's
clock; nothing here reads a clock.

Entry points return a status (``state.OK`` or a ``FULL_*`` code). A ``FULL_*`` status means a
fixed-size section ran out of room *before* anything was half-done: the caller grows the arena
and calls again, and the call carries on where it stopped (outputs accumulate until the next
``fresh`` decide).
"""

from __future__ import annotations

import numpy as np
from numba import njit, types

from .depq import peek_min, pop_max, pop_min, push, remove_at
from .state import (
    CLASS_HOLD_SLOS,
    DROP_DEADLINE,
    DROP_EARLY,
    DROP_NO_CAPACITY,
    F1,
    F_CLASS_ROOM,
    F_GUARD,
    F_LAST_NOW,
    F_MARGIN_MAX,
    F_MARGIN_PRIOR,
    F_MARGIN_Q,
    F_MARGIN_QHI,
    F_MARGIN_STEP,
    F_MIN_WAIT,
    F_NOISE_Z,
    F_PRESSURE_ROOM,
    F_ROOM_Q,
    F_SHARE_WINDOW,
    F_WAKE,
    FULL_BATCH,
    FULL_OUT,
    FULL_QUEUE,
    FULL_SLOTS,
    FULL_TABLE,
    H_B,
    H_BNFREE,
    H_CALL_PROBES,
    H_CT_DECIDE,
    H_CT_DISPATCH,
    H_CT_DROP,
    H_CT_GC,
    H_CT_PROBES,
    H_CT_REPORT,
    H_CT_RESERVE,
    H_CT_SHARE_HOLD,
    H_EARLY,
    H_K,
    H_M,
    H_NFREE,
    H_OD,
    H_OQ,
    H_OR,
    H_OUT_ND,
    H_OUT_NQ,
    H_OUT_NR,
    H_OUT_NX,
    H_OX,
    H_PARD,
    H_POLICY,
    H_PULL,
    H_Q,
    H_QC,
    H_R,
    H_SEQ,
    H_V,
    HANDLE_MASK,
    HANDLE_SHIFT,
    I1,
    KIND_CLAIM,
    KIND_DOWNLINK,
    KIND_INFER,
    KIND_UPLINK,
    LGAP_CAP,
    LGAP_STEP,
    MARGIN_RELAX_SLOS,
    MARGIN_STALE_SLOS,
    MARGIN_WARM,
    OK,
    OVERLOAD_EARLY,
    OVERLOAD_RATE,
    POLICY_REACTIVE,
    RK,
    ROOM_Q_BURST,
    ROOM_STEP,
    SH_ARATE,
    SH_N,
    SH_NA,
    SH_RATE,
    SH_T,
    SH_TOK,
    SH_W0,
    SHARE_BURST,
    SHARE_COLS,
    SHARE_OVER,
    SHARE_SHORT,
    SILENCE_GAPS,
    SILENCE_TICKS,
    SILENCE_TICKS_SLO,
    TB,
    X_B_FINAL,
    X_B_FREE,
    X_B_HANDLE,
    X_B_N,
    X_B_POOL,
    X_B_SLOTS,
    X_LAT,
    X_M_GAP,
    X_M_HI_UNTIL,
    X_M_HOLD,
    X_M_LAST,
    X_M_LGAP,
    X_M_NEAR,
    X_M_PARD,
    X_M_PGAP,
    X_M_ROOM,
    X_M_ROOM_B,
    X_M_SHARE,
    X_MODEL_PIPE0,
    X_OD_BS,
    X_OD_FINAL,
    X_OD_FINISH,
    X_OD_MODEL,
    X_OD_NHOPS,
    X_OD_NRES,
    X_OD_PATH,
    X_OD_PIPE,
    X_OD_REQ0,
    X_OD_RES0,
    X_OD_STAGE,
    X_OQ_RID,
    X_OQ_SRC,
    X_OR_END,
    X_OR_HANDLE,
    X_OR_HOP,
    X_OR_KIND,
    X_OR_RES,
    X_OR_START,
    X_OR_VGPU,
    X_OX_REASON,
    X_OX_RID,
    X_PIPE_BS,
    X_PIPE_MODEL,
    X_PIPE_NPOOLS,
    X_PIPE_POOL0,
    X_POOL_IDLE,
    X_POOL_LIVE,
    X_POOL_PIPE,
    X_POOL_STAGE,
    X_POOL_V0,
    X_PR_INF,
    X_PR_LDUR,
    X_PR_LPROF,
    X_PR_TDUR,
    X_PR_TX,
    X_PR_VG,
    X_Q_DIRTY,
    X_Q_HBF,
    X_Q_SIZE,
    X_Q_WAKE,
    X_REM,
    X_S_ARRIVAL,
    X_S_DEADLINE,
    X_S_FREE,
    X_S_PRIO,
    X_S_RID,
    X_S_SRC,
    X_SCAN_READY,
    X_SCAN_TX,
    X_SCAN_V,
    X_T_HI,
    X_T_LO,
    X_TENT_E,
    X_TENT_R,
    X_TENT_S,
    X_TIN,
    X_V_ALIVE,
    X_V_BUSY,
    X_V_HEARD,
    X_V_MARGIN,
    X_V_MARGIN_HI,
    X_V_NREP,
    X_V_POOL,
    X_V_RFIN,
    X_V_RH,
    X_V_RLEN,
    X_V_SERVER,
    b1,
    f8,
    i8,
    none,
    off,
    queues_desc,
    raw,
    tables_desc,
)
from .tables import (
    clear_row,
    correct,
    earliest1,
    earliest1_cut,
    earliest2_cut,
    gc_row,
    insert,
    room,
)

INF = np.inf
# A batch held for more requests leaves this many times the gap between its vGPUs' high and low
# margins: the 0.99 quantile alone left ~1 % of held batches late at light load, where every
# batch is held to its last moment; twice the gap reaches about the 0.999 quantile of lognormal
# noise
WAIT_TAIL = 2.0
WAIT_RHO = 0.5  # see _worth_waiting


# --- probe and reserve (ppipe) -----------------------------------------------------------


@njit(cache=True, inline="always")
def _slot2(A, F, tb, ra, rb, t, d, nt, extra, limit):
    """Joint NIC slot on ``ra`` and ``rb`` that also avoids this probe's own earlier hops;
    inf once ``slot + d + extra`` exceeds ``limit``."""
    o_tr = off(A, X_TENT_R)
    o_ts = off(A, X_TENT_S)
    o_te = off(A, X_TENT_E)
    s = t
    while True:
        s = earliest2_cut(F, A, tb, ra, rb, s, d, extra, limit)
        if s == INF:
            return s
        moved = False
        for j in range(nt):
            r = A[o_tr + j]
            if r in (ra, rb) and F[o_ts + j] < s + d and s < F[o_te + j]:
                s = F[o_te + j]
                moved = True
        if not moved:
            return s


@njit(cache=True, inline="always")
def _out_slot(F, A, tb, u, f, Tn, limit):
    """When a batch finishing at ``f`` on a vGPU whose server uplink is ``u`` could start sending
    its output (``Tn`` long) on it; ``Tn == 0`` (the last pool): ``f``. The row search stops (inf)
    once the slot is past ``limit``; the summaries answer most calls without it."""
    if Tn <= 0.0 or f >= F[tb[6] + u]:
        return f
    if f >= F[tb[7] + u]:
        return F[tb[6] + u]
    return earliest1_cut(F, A, tb, u, f, Tn, 0.0, limit + Tn)


@njit(cache=True, inline="always")
def _better(c, f, u, v, best_c, best_f, best_u, best_v):
    """The probe's order: earlier output slot, then earlier finish, then the earlier-free
    server uplink, then the lower vGPU id."""
    return c < best_c or (c == best_c and (f < best_f or (f == best_f and (
        u < best_u or (u == best_u and v < best_v)))))


@njit(types.Tuple((i8, f8, f8, b1, f8, f8))(I1, F1, TB, i8, i8, i8, f8, f8, f8, i8, f8, i8), cache=True)
def _scan_pool(A, F, tb, pool, k, prev_s, t, T, L, nt, Tn, o_mg):
    """Hop ``k`` of a probe: the live vGPU of ``pool`` whose output can leave first.

    A vGPU's score is its inference finish, or, when a transfer of ``Tn`` follows this pool
    (not the last), the first time at or after that finish at which its server's uplink is free
    for ``Tn``: a vGPU that finishes first but whose output then queues behind other transfers
    on a busy uplink loses to one that finishes a little later on a free one (the PPipe
    artifact's ``ReservationOffer.reserve`` scores a worker the same way). Ties go to the
    earlier finish, then to the vGPU whose server uplink frees first, then the lowest id:
    breaking them by id alone sends every batch's output through the first server's uplink and
    saturates it while the others idle.

    For each vGPU: its input's joint NIC slot when it comes from another server (one search
    per server: vGPUs of a server share its downlink), then its inference slot. Most rows have
    no usable gap after the ready time (``gfrom <= ready``), so their slot comes from the dense
    row summaries without reading the row; the others are searched afterwards, cut off as soon
    as they cannot beat the best score found. Returns (vgpu, finish, infer start, has transfer,
    transfer start); vgpu -1 if the pool has no live vGPU.
    """
    V = A[H_V]
    o_vs = off(A, X_V_SERVER)
    o_va = off(A, X_V_ALIVE)
    o_pv = off(A, X_POOL_V0)
    o_tail = tb[6]
    o_gf = tb[7]
    o_dv = off(A, X_SCAN_V)
    o_dr = off(A, X_SCAN_READY)
    o_dt = off(A, X_SCAN_TX)
    best_c = INF
    best_f = INF
    best_v = -1
    best_l = L
    best_s = 0.0
    best_tx = 0.0
    best_has_tx = False
    best_u = INF
    nd = 0
    last_sv = -2
    last_tx = 0.0
    cache_sv = -2
    cache_f = 0.0
    cache_c = 0.0
    for v in range(A[o_pv + pool], A[o_pv + pool + 1]):
        if A[o_va + v] == 0:
            continue
        sv = A[o_vs + v]
        has_tx = k > 0 and sv != prev_s and T > 0.0
        tx = 0.0
        ready = t
        if has_tx:
            if sv != last_sv:
                # the cut-off only tightens during the scan, so a cached slot (or inf) stays right
                last_sv = sv
                last_tx = _slot2(A, F, tb, V + 2 * prev_s, V + 2 * sv + 1, t, T, nt, L, best_c)
            tx = last_tx
            if tx == INF:
                continue
            ready = tx + T
        Lv = L * F[o_mg + v]
        if F[o_gf + v] <= ready:
            s = max(ready, F[o_tail + v])
            f = s + Lv
            if f > best_c:
                continue
            up = V + 2 * sv
            if sv != cache_sv or f != cache_f:
                # idle vGPUs of a server finish together: one uplink search for all of them
                # (a cached inf stays right: the cut-off only tightens)
                cache_sv = sv
                cache_f = f
                cache_c = _out_slot(F, A, tb, up, f, Tn, best_c)
            c = cache_c
            u = max(F[o_tail + up], t)
            if _better(c, f, u, v, best_c, best_f, best_u, best_v):
                best_c = c
                best_f = f
                best_u = u
                best_v = v
                best_s = s
                best_tx = tx
                best_has_tx = has_tx
                best_l = Lv
        elif ready + Lv <= best_c:
            A[o_dv + nd] = v if has_tx else -1 - v
            F[o_dr + nd] = ready
            F[o_dt + nd] = tx
            nd += 1
    for i in range(nd):
        v = A[o_dv + i]
        has_tx = v >= 0
        if not has_tx:
            v = -1 - v
        ready = F[o_dr + i]
        Lv = L * F[o_mg + v]
        s = earliest1_cut(F, A, tb, v, ready, Lv, 0.0, best_c)
        f = s + Lv
        if f > best_c:
            continue
        up = V + 2 * A[o_vs + v]
        c = _out_slot(F, A, tb, up, f, Tn, best_c)
        u = max(F[o_tail + up], t)
        if _better(c, f, u, v, best_c, best_f, best_u, best_v):
            best_c = c
            best_f = f
            best_u = u
            best_v = v
            best_s = s
            best_tx = F[o_dt + i]
            best_has_tx = has_tx
            best_l = Lv
    return best_v, best_f, best_s, best_has_tx, best_tx, best_l


# standard normal quantile of the high margin (its quantile, F_MARGIN_QHI, is 0.99 by default):
# log(high margin) / Z99 is the log-sd of a vGPU's latency noise
Z99 = 2.3263


@njit(cache=True, inline="always")
def _overloaded(A, F, m, now):
    """Whether model ``m``'s arrivals ran above ``OVERLOAD_RATE`` x its planned rate in its last
    NIC-share window, or in the current one once ``OVERLOAD_EARLY`` of it has passed."""
    gap = F[off(A, X_M_PGAP) + m]
    if not gap < INF:
        return True
    o = off(A, X_M_SHARE) + m * SHARE_COLS
    rate = F[o + SH_ARATE]
    el = now - F[o + SH_W0]
    if el >= OVERLOAD_EARLY * F[F_SHARE_WINDOW] * F[off(A, X_M_HOLD) + m]:
        rate = max(rate, F[o + SH_NA] / el)
    return rate * gap > OVERLOAD_RATE


@njit(cache=True, inline="always")
def _hot(A, F, m, now):
    """Whether model ``m``'s reservations take the vGPUs' high-quantile margins: under pressure
    while it is also overloaded, whatever the policy. Why: under sustained overload every table
    is booked back to back and only the high margins keep the late share under 1 % (with the
    low ones always, PARD: 4.2 % late at load 1.3); within the planned rate the high margins
    only cost capacity. In PARD's bursts at load 1.0 its drops already keep paths on time
    (shared plans, Gamma cv 1.5 / 2: 0.941 / 0.901 of capacity with them, 0.951 / 0.916 with
    the low margins and the burst room); under ``ppipe`` near capacity every drop put the
    model under pressure, the high margins then made its paths longer and its tables fuller,
    and so more drops (Figure 6, latency noise σ 0.05 / 0.1: 0.920 / 0.860 with them in every
    spell of pressure, 0.924 / 0.875 only under overload; σ 0 unchanged)."""
    if not F[off(A, X_Q_HBF) + m] > now:
        return False
    return _overloaded(A, F, m, now)


@njit(cache=True, inline="always")
def _room(A, F, m, now):
    """The room PARD model ``m`` books its deadlines ahead by under pressure: the learned room,
    or while the model is not overloaded the burst room (a lower quantile of the same lateness)."""
    if _overloaded(A, F, m, now):
        return F[off(A, X_M_ROOM) + m]
    return F[off(A, X_M_ROOM_B) + m]


@njit(types.UniTuple(f8, 2)(I1, F1, i8, i8, f8, i8), cache=True)
def probe(A, F, p, b, now, buf):
    """Walk pipeline ``p``'s pools at batch size ``b`` from ``now`` without reserving anything.

    Per pool, for each live vGPU: the joint uplink/downlink slot for its input (when it comes
    from another server), then its inference slot; the vGPU whose output can leave first wins
    (see :func:`_scan_pool`: its finish, and where a transfer follows, when its server's uplink
    is free for it; ties: the earlier finish, the earliest-free uplink, the lowest id). The path
    and its slots go to scratch buffer ``buf``. Returns ``(finish, waiting)``: waiting is the
    finish minus ``now`` minus the busy time of the path, i.e. the time the batch would spend
    queued for resources. ``(inf, inf)`` if a pool is dead.

    Each inference is reserved for its profiled latency times the vGPU's margin (a high
    quantile of its measured / profiled latency, :func:`_learn_margin`), so noise on one batch
    does not push the batches behind it past their deadlines; executors are work-conserving and
    a report that ends early pulls the batches queued behind it forward
    (:func:`tables.correct`), so the margin costs latency estimates, not capacity.
    """
    V = A[H_V]
    B = A[H_B]
    K = A[H_K]
    tb = tables_desc(A)
    o_vs = off(A, X_V_SERVER)
    o_lat = off(A, X_LAT)
    o_tin = off(A, X_TIN)
    pool0 = A[off(A, X_PIPE_POOL0) + p]
    npools = A[off(A, X_PIPE_NPOOLS) + p]
    A[H_CT_PROBES] += 1
    A[H_CALL_PROBES] += 1
    # margins at the high quantile while the model is under pressure and overloaded (see _hot)
    m = A[off(A, X_PIPE_MODEL) + p]
    o_mg = off(A, X_V_MARGIN_HI) if _hot(A, F, m, now) else off(A, X_V_MARGIN)
    t = now
    prev_s = -1
    busy = 0.0
    nt = 0
    z = F[F_NOISE_Z]
    var = 0.0
    o_hi = off(A, X_V_MARGIN_HI)
    for k in range(npools):
        pool = pool0 + k
        L = F[o_lat + pool * B + b - 1]
        T = F[o_tin + pool * B + b - 1]
        if A[off(A, X_POOL_LIVE) + pool] == 0 or not L < INF:
            return INF, INF
        Tn = F[o_tin + (pool + 1) * B + b - 1] if k + 1 < npools else 0.0
        best_v, best_f, best_s, best_has_tx, best_tx, Lr = _scan_pool(A, F, tb, pool, k, prev_s, t, T, L,
                                                                      nt, Tn, o_mg)
        if best_v < 0:
            return INF, INF
        sv = A[o_vs + best_v]
        j = buf * K + k
        A[off(A, X_PR_VG) + j] = best_v
        F[off(A, X_PR_TX) + j] = best_tx
        F[off(A, X_PR_INF) + j] = best_s
        F[off(A, X_PR_LDUR) + j] = Lr
        F[off(A, X_PR_LPROF) + j] = L
        if best_has_tx:
            F[off(A, X_PR_TDUR) + j] = T
            busy += T
            o_tr = off(A, X_TENT_R)
            o_ts = off(A, X_TENT_S)
            o_te = off(A, X_TENT_E)
            A[o_tr + nt] = V + 2 * prev_s
            F[o_ts + nt] = best_tx
            F[o_te + nt] = best_tx + T
            A[o_tr + nt + 1] = V + 2 * sv + 1
            F[o_ts + nt + 1] = best_tx
            F[o_te + nt + 1] = best_tx + T
            nt += 2
        else:
            F[off(A, X_PR_TDUR) + j] = 0.0
        busy += Lr
        t = best_f
        prev_s = sv
        if z > 0.0:
            # the noise this hop adds: its own run, and the runs booked on its vGPU before it
            # (back to back, they shift its start by their summed noise: the variance grows
            # with the time booked ahead, not with its square as a per-booking margin does)
            # (the learned high margin even while few reports back it: a cold vGPU's prior is
            # for the wait rule, and at light load it would stay, dropping what fits)
            sd = np.log(max(F[o_hi + best_v], 1.0)) * (1.0 / Z99)
            var += sd * sd * Lr * (Lr + max(best_s - now, 0.0))
    if z > 0.0:
        return t + z * np.sqrt(var), t - now - busy
    return t, t - now - busy


@njit(b1(I1, F1, TB, i8, i8, f8), cache=True)
def _has_room(A, F, tb, r, need, now):
    """Whether row ``r`` has ``need`` free places; else the caller grows the tables. (A full row
    once dropped its ended intervals here: but only the periodic GC may, or decisions depended on
    the table capacity: a late report pushes the intervals booked after it, ended ones too.)"""
    return room(A, tb, r) >= need


@njit(i8(I1, F1, i8, i8, i8, i8, f8, f8, b1), cache=True)
def _emit_res(A, F, r, kind, hop, v, s, e, table):
    """Number a reservation, enter it in ``r``'s table (``table``) and in the output."""
    seq = A[H_SEQ]
    h = (seq << HANDLE_SHIFT) | r
    A[H_SEQ] += 1
    A[H_CT_RESERVE] += 1
    if table:
        insert(F, A, tables_desc(A), r, s, e, h)
    i = A[H_OUT_NR]
    A[off(A, X_OR_HANDLE) + i] = h
    A[off(A, X_OR_RES) + i] = r
    A[off(A, X_OR_KIND) + i] = kind
    A[off(A, X_OR_HOP) + i] = hop
    A[off(A, X_OR_VGPU) + i] = v
    F[off(A, X_OR_START) + i] = s
    F[off(A, X_OR_END) + i] = e
    A[H_OUT_NR] = i + 1
    return h


@njit(cache=True, inline="always")
def _free_slot(A, slot):
    A[off(A, X_S_FREE) + A[H_NFREE]] = slot
    A[H_NFREE] += 1


@njit(none(I1, i8, i8), cache=True)
def _emit_drop(A, slot, reason):
    i = A[H_OUT_NX]
    A[off(A, X_OX_RID) + i] = A[off(A, X_S_RID) + slot]
    A[off(A, X_OX_REASON) + i] = reason
    A[H_OUT_NX] = i + 1
    A[H_CT_DROP] += 1
    _free_slot(A, slot)


@njit(cache=True, inline="always")
def _hiq(A, m):
    """Model ``m``'s high-priority queue. Why a queue of its own (Accordion's classes): a batch
    takes the high class first, so the high class sees only its own load; one DEPQ keyed by
    deadline could not give both the oldest request of each class and the oldest of all."""
    return A[H_Q] - A[H_M] + m


@njit(cache=True, inline="always")
def _pressure(A, F, m, now):
    """Model ``m`` dropped at ``now``: under pressure for its hold time (an SLO)."""
    F[off(A, X_Q_HBF) + m] = now + F[off(A, X_M_HOLD) + m]


@njit(none(I1, F1, i8, f8), cache=True)
def _relax(A, F, m, now):
    """Model ``m`` drops because no batch meets a deadline: each vGPU of its pools that has not
    reported for ``MARGIN_STALE_SLOS`` SLOs, and whose high margin is above the prior
    (``F_MARGIN_PRIOR``), has its margins relaxed towards that prior, with time constant
    ``MARGIN_RELAX_SLOS`` SLOs of that silence.

    Why: margins learn only from reports. After a slow spell (a throttled GPU, a busy MPS
    neighbour) they can make every path miss the SLO, or keep a vGPU off every chosen path;
    then nothing is dispatched to it, nothing reports, and the model would stay unserved (or
    short of its vGPUs) for as long as its traffic lasts. Such margins are stale evidence;
    relaxed, they let a batch through, whose report sets them anew (_report_one): high again if
    the spell goes on (one batch per few SLOs is risked), or low if it is over. Margins at or
    below the prior are what ordinary noise gives: an idle vGPU keeps them (relaxed towards 1,
    a vGPU left idle at 1.3x load lost its noise margin, and the high class its attainment).
    Idempotent at one ``now``."""
    o_h = off(A, X_V_HEARD)
    o_pv = off(A, X_POOL_V0)
    o_p0 = off(A, X_PIPE_POOL0)
    o_np = off(A, X_PIPE_NPOOLS)
    o_mp = off(A, X_MODEL_PIPE0)
    o_hi = off(A, X_V_MARGIN_HI)
    prior = F[F_MARGIN_PRIOR]
    stale = MARGIN_STALE_SLOS * F[off(A, X_M_HOLD) + m]
    tau = MARGIN_RELAX_SLOS * F[off(A, X_M_HOLD) + m]
    for p in range(A[o_mp + m], A[o_mp + m + 1]):
        for pool in range(A[o_p0 + p], A[o_p0 + p] + A[o_np + p]):
            for v in range(A[o_pv + pool], A[o_pv + pool + 1]):
                heard = F[o_h + 2 * v]
                if now - heard <= stale or F[o_hi + v] <= prior:
                    continue
                dt = now - max(heard + stale, F[o_h + 2 * v + 1])
                if dt > 0.0:
                    f = np.exp(-dt / tau)
                    for o in (off(A, X_V_MARGIN) + v, o_hi + v):
                        if F[o] > prior:
                            F[o] = prior + (F[o] - prior) * f
                    F[o_h + 2 * v + 1] = now


@njit(i8(I1, F1, i8, i8), cache=True)
def _drop_all(A, F, q, reason):
    dq = queues_desc(A)
    o_qs = off(A, X_Q_SIZE)
    qs = (q, _hiq(A, q)) if q < A[H_M] else (q, q)
    for qq in qs:
        while A[o_qs + qq] > 0:
            if A[H_OUT_NX] >= A[H_OX]:
                return FULL_OUT
            _emit_drop(A, pop_min(F, A, dq, qq), reason)
    return OK


@njit(cache=True, inline="always")
def _oldest(A, F, dq, m, hq):
    """(queue, deadline) of model ``m``'s earliest deadline over both classes; (-1, inf) if empty."""
    o_qs = off(A, X_Q_SIZE)
    o_dl = off(A, X_S_DEADLINE)
    q = -1
    d = INF
    if A[o_qs + m] > 0:
        q = m
        d = F[o_dl + peek_min(A, dq, m)]
    if A[o_qs + hq] > 0:
        dh = F[o_dl + peek_min(A, dq, hq)]
        if q < 0 or dh < d:
            q = hq
            d = dh
    return q, d


@njit(i8(I1, F1, i8, f8, f8, f8, i8), cache=True)
def _drop_before(A, F, m, f, s_lo, s_hi, reason):
    """Drop model ``m``'s requests (both classes) that a batch ending at ``f`` would serve late,
    earliest first: deadline less its class's shift (``s_lo``, ``s_hi``) before ``f``, the very
    expression the decision tested the oldest with (a threshold computed another way can differ
    from it by a rounding, drop nothing, and leave the decision looping forever)."""
    dq = queues_desc(A)
    hq = _hiq(A, m)
    o_qs = off(A, X_Q_SIZE)
    o_dl = off(A, X_S_DEADLINE)
    while True:
        q = -1
        d = INF
        if A[o_qs + m] > 0:
            dl = F[o_dl + peek_min(A, dq, m)]
            if dl - s_lo < f:
                q = m
                d = dl
        if A[o_qs + hq] > 0:
            dl = F[o_dl + peek_min(A, dq, hq)]
            if dl - s_hi < f and (q < 0 or dl < d):
                q = hq
        if q < 0:
            return OK
        if A[H_OUT_NX] >= A[H_OX]:
            return FULL_OUT
        _emit_drop(A, pop_min(F, A, dq, q), reason)


@njit(i8(I1, i8, i8, i8, i8, b1, i8), cache=True)
def _begin_dispatch(A, m, p, stage, nhops, final, bs):
    d = A[H_OUT_ND]
    A[off(A, X_OD_MODEL) + d] = m
    A[off(A, X_OD_PIPE) + d] = p
    A[off(A, X_OD_STAGE) + d] = stage
    A[off(A, X_OD_NHOPS) + d] = nhops
    A[off(A, X_OD_FINAL) + d] = 1 if final else 0
    A[off(A, X_OD_BS) + d] = bs
    A[off(A, X_OD_REQ0) + d] = A[H_OUT_NQ]
    A[off(A, X_OD_RES0) + d] = A[H_OUT_NR]
    return d


@njit(none(I1, F1, i8, f8), cache=True)
def _end_dispatch(A, F, d, finish):
    F[off(A, X_OD_FINISH) + d] = finish
    A[off(A, X_OD_NRES) + d] = A[H_OUT_NR] - A[off(A, X_OD_RES0) + d]
    A[H_OUT_ND] = d + 1
    A[H_CT_DISPATCH] += 1


@njit(cache=True, inline="always")
def _emit_req(A, slot, src):
    i = A[H_OUT_NQ]
    A[off(A, X_OQ_RID) + i] = A[off(A, X_S_RID) + slot]
    A[off(A, X_OQ_SRC) + i] = src
    A[H_OUT_NQ] = i + 1


@njit(cache=True, inline="always")
def _share_roll(A, F, m, now):
    """Close model ``m``'s dispatch-count window if it is over; refill its tokens."""
    o = off(A, X_M_SHARE) + m * SHARE_COLS
    w = F[F_SHARE_WINDOW] * F[off(A, X_M_HOLD) + m]
    if now - F[o + SH_W0] >= w:
        F[o + SH_RATE] = F[o + SH_N] / max(now - F[o + SH_W0], 1.0)
        F[o + SH_ARATE] = F[o + SH_NA] / max(now - F[o + SH_W0], 1.0)
        F[o + SH_N] = 0.0
        F[o + SH_NA] = 0.0
        F[o + SH_W0] = now
    gap = F[off(A, X_M_PGAP) + m]
    if gap < INF:
        burst = SHARE_BURST * F[off(A, X_M_HOLD) + m] / gap
        F[o + SH_TOK] = min(F[o + SH_TOK] + (now - F[o + SH_T]) * SHARE_OVER / gap, max(burst, 1.0))
    F[o + SH_T] = now


@njit(b1(I1, F1, i8, f8), cache=True)
def _share_capped(A, F, m, now):
    """Whether model ``m`` must wait for tokens: its bucket is empty while another model is
    under pressure and dispatched less than its planned rate in its last window. Why: models
    share the servers' NICs, and under overload the one that books furthest ahead takes the
    others' planned share of them."""
    if A[H_PARD] == 0 or A[off(A, X_M_PARD) + m] == 0 or F[off(A, X_M_HI_UNTIL) + m] > now:
        return False  # (nor while m has a high class: holding its low class back delays the high)
    o = off(A, X_M_SHARE) + m * SHARE_COLS
    if F[o + SH_TOK] >= 1.0:
        return False
    o_pg = off(A, X_M_PGAP)
    o_near = off(A, X_M_NEAR) + m * A[H_M]
    for j in range(A[H_M]):
        if j != m and A[o_near + j] != 0:
            oj = off(A, X_M_SHARE) + j * SHARE_COLS
            if (F[oj + SH_RATE] * F[o_pg + j] < SHARE_SHORT and F[o_pg + j] < INF
                    and F[oj + SH_ARATE] > 1.02 * F[oj + SH_RATE]):
                return True
    return False


@njit(i8(I1, F1, i8, i8, i8, i8, f8, f8, b1), cache=True)
def _commit_ppipe(A, F, m, p, take, buf, fin, now, from_max):
    """Reserve the path in scratch ``buf`` and dispatch ``take`` requests: the high class first
    (earliest deadlines), then the low class's earliest deadlines, or with ``from_max`` its
    latest (PARD's high-budget-first)."""
    V = A[H_V]
    K = A[H_K]
    npools = A[off(A, X_PIPE_NPOOLS) + p]
    if (A[H_OUT_ND] >= A[H_OD] or A[H_OUT_NR] + 3 * npools > A[H_OR]
            or A[H_OUT_NQ] + take > A[H_OQ]):
        return FULL_OUT
    tb = tables_desc(A)
    o_vs = off(A, X_V_SERVER)
    o_vg = off(A, X_PR_VG) + buf * K
    o_td = off(A, X_PR_TDUR) + buf * K
    prev_s = -1
    for k in range(npools):
        v = A[o_vg + k]
        sv = A[o_vs + v]
        if not _has_room(A, F, tb, v, 1, now):
            return FULL_TABLE
        if F[o_td + k] > 0.0 and not (_has_room(A, F, tb, V + 2 * prev_s, 2, now)
                                      and _has_room(A, F, tb, V + 2 * sv + 1, 2, now)):
            return FULL_TABLE
        prev_s = sv
    o_tx = off(A, X_PR_TX) + buf * K
    o_inf = off(A, X_PR_INF) + buf * K
    o_ld = off(A, X_PR_LDUR) + buf * K
    o_path = off(A, X_OD_PATH)
    d = _begin_dispatch(A, m, p, 0, npools, True, take)
    prev_s = -1
    for k in range(npools):
        v = A[o_vg + k]
        sv = A[o_vs + v]
        A[o_path + d * K + k] = v
        T = F[o_td + k]
        if T > 0.0:
            tx = F[o_tx + k]
            _emit_res(A, F, V + 2 * prev_s, KIND_UPLINK, k, v, tx, tx + T, True)
            _emit_res(A, F, V + 2 * sv + 1, KIND_DOWNLINK, k, v, tx, tx + T, True)
        s = F[o_inf + k]
        h = _emit_res(A, F, v, KIND_INFER, k, v, s, s + F[o_ld + k], True)
        j = v * RK + (h >> HANDLE_SHIFT) % RK
        A[off(A, X_V_RH) + j] = h
        F[off(A, X_V_RLEN) + j] = F[off(A, X_PR_LPROF) + buf * K + k]
        F[off(A, X_V_RFIN) + j] = s + F[o_ld + k] if k == npools - 1 else -INF
        prev_s = sv
    # the expected end is the last hop's booking (the probe's finish may hold the noise guard)
    fin = F[o_inf + npools - 1] + F[o_ld + npools - 1]
    dq = queues_desc(A)
    hq = _hiq(A, m)
    o_qs = off(A, X_Q_SIZE)
    for _ in range(take):
        if A[o_qs + hq] > 0:
            slot = pop_min(F, A, dq, hq)
        else:
            slot = pop_max(F, A, dq, m) if from_max else pop_min(F, A, dq, m)
        _emit_req(A, slot, -1)
        _free_slot(A, slot)
    _end_dispatch(A, F, d, fin)
    o = off(A, X_M_SHARE) + m * SHARE_COLS
    F[o + SH_N] += take
    # (a model dispatching while no neighbour is short owes at most this batch: debt run up
    # then would hold it back long after a neighbour turns short)
    F[o + SH_TOK] = max(F[o + SH_TOK] - take, 1.0 - take)
    return OK


@njit(f8(I1, F1, i8, i8, f8), cache=True)
def _hi_allowance(A, F, p, buf, now):
    """How much later the path in scratch ``buf`` would end with every hop at its vGPU's
    high-quantile margin instead of the margin the probe used (0 under pressure: it used it).
    A vGPU that has reported too few uses to know its quantile counts at ``F_MARGIN_PRIOR``."""
    if _hot(A, F, A[off(A, X_PIPE_MODEL) + p], now):
        return 0.0
    K = A[H_K]
    o_vg = off(A, X_PR_VG) + buf * K
    o_lp = off(A, X_PR_LPROF) + buf * K
    o_lo = off(A, X_V_MARGIN)
    o_hi = off(A, X_V_MARGIN_HI)
    o_n = off(A, X_V_NREP)
    extra = 0.0
    for k in range(A[off(A, X_PIPE_NPOOLS) + p]):
        v = A[o_vg + k]
        hi = F[o_hi + v] if A[o_n + v] >= MARGIN_WARM else max(F[o_hi + v], F[F_MARGIN_PRIOR])
        extra += (hi - F[o_lo + v]) * F[o_lp + k]
    return extra


@njit(b1(I1, F1, i8, i8, i8, i8), cache=True)
def _worth_waiting(A, F, m, p, n, b):
    """Whether holding ``n`` requests for a batch of ``b`` on pipeline ``p`` pays: only while
    the model's arrival rate is above ``WAIT_RHO`` of what batches of ``n`` could serve (the
    planned rate scaled by their efficiency on the pipeline's slowest pool). Below that, a
    smaller batch now costs nothing that is needed, and a held batch is a risk: held to its
    last moment, any overrun makes it late (at light load that was most of the misses left)."""
    B = A[H_B]
    o_lat = off(A, X_LAT)
    eff = 1.0
    p0 = A[off(A, X_PIPE_POOL0) + p]
    for k in range(A[off(A, X_PIPE_NPOOLS) + p]):
        row = o_lat + (p0 + k) * B
        eff = min(eff, n * F[row + b - 1] / (b * F[row + n - 1]))
    return F[off(A, X_M_PGAP) + m] >= WAIT_RHO * eff * F[off(A, X_M_GAP) + m]


@njit(f8(I1, F1, i8), cache=True, inline="always")
def _long_gap(A, F, m):
    """The length-weighted mean of model ``m``'s recent arrival gaps (E[g²] / E[g]): the length
    of the gap an instant falls in. It is twice the mean gap for Poisson arrivals and the tick
    for arrivals in ticks, however many come at once; 0 before any gap was seen."""
    o = off(A, X_M_LGAP) + 2 * m
    return F[o + 1] / F[o] if F[o] > 0.0 else 0.0


@njit(cache=True, inline="always")
def _learn_gap(A, F, m, gap):
    """One arrival gap into the EWMAs behind :func:`_long_gap`; a gap counts as at most
    ``LGAP_CAP`` times the current estimate, so one idle spell before a burst does not make the
    burst's tail wait as if for the next tick."""
    o = off(A, X_M_LGAP) + 2 * m
    L = _long_gap(A, F, m)
    if L <= 0.0:
        L = max(F[off(A, X_M_GAP) + m], F[off(A, X_M_PGAP) + m])
    g = min(gap, LGAP_CAP * L)
    a = 1.0 - LGAP_STEP
    s1 = a * F[o] + LGAP_STEP * g
    if s1 < 1e-200:  # a long run of simultaneous arrivals: start again rather than go subnormal
        F[o] = 0.0
        F[o + 1] = 0.0
    else:
        F[o] = s1
        F[o + 1] = a * F[o + 1] + LGAP_STEP * g * g


@njit(f8(I1, F1, i8, f8), cache=True, inline="always")
def _quiet_left(A, F, m, now):
    """How long model ``m``'s arrivals may stay silent before a held batch stops waiting for
    company: ``SILENCE_GAPS`` mean gaps (the recent or the planned, the longer) since the latest
    arrival, or ``SILENCE_TICKS`` length-weighted gaps (:func:`_long_gap`) up to
    ``SILENCE_TICKS_SLO`` of the SLO, the longer. Why: the mean gap learns only from arrivals,
    so after a burst it stays short however long the silence, and a partial batch was held to
    its last moment (7 requests sent at once with a 5 s SLO to an idle daemon: answered after
    4.97 s, now after 17 ms); but requests that come in ticks (a client sending each
    millisecond what it gathered) are silent between ticks by rhythm, and a tick's tail should
    wait for the next tick rather than leave as a partial batch (the tiny CNN on an H100 at
    20,000 rps in 1 ms ticks: mean batch 10.9 of 16, 2.7 % refused as overloaded). The SLO share
    bounds what a closed-loop client costs, whose next burst waits for this one's answers."""
    g = SILENCE_GAPS * max(F[off(A, X_M_GAP) + m], F[off(A, X_M_PGAP) + m])
    g = max(g, min(SILENCE_TICKS * _long_gap(A, F, m), SILENCE_TICKS_SLO * F[off(A, X_M_HOLD) + m]))
    return g - (now - F[off(A, X_M_LAST) + m])


@njit(i8(I1, F1, i8, f8), cache=True)
def _ppipe_queue(A, F, m, now):
    """PPipe Algorithm 1 for model ``m``'s queue, until it is empty or waiting.

    With PARD (``H_PARD``, for the models ``X_M_PARD`` marks): when a full batch served now would end after the oldest deadline
    and the queue holds more requests than it takes (or as many, while the model was overloaded
    within its hold time: a queue too short for a full batch shrinks it as PPipe does), the batch
    stays full and every request that even it cannot serve in time is dropped
    now (proactively, on the whole path's estimate: the probe) instead of shrinking the batch,
    which would cut throughput exactly when it is short; for the hold time after such a drop,
    while the model is overloaded (``_overloaded``), batches take the requests with the most
    budget left (high-budget-first), so that what is served under overload has room for noise
    (in bursts within the planned rate the earliest deadlines first served more in time: Gamma
    cv 2, 0.9114 against 0.9111 of capacity, and 0.9121 with the burst room at 0.93 too).
    Otherwise PPipe's low-budget-first (earliest
    deadline) order and batch shrinking apply: at low load nothing is dropped that a smaller
    batch could serve.
    """
    early = A[H_EARLY] != 0
    pard = A[H_PARD] != 0 and A[off(A, X_M_PARD) + m] != 0
    o_hbf = off(A, X_Q_HBF)
    min_wait = F[F_MIN_WAIT]
    guard = F[F_GUARD]
    dq = queues_desc(A)
    o_qs = off(A, X_Q_SIZE)
    o_qw = off(A, X_Q_WAKE)
    o_bs = off(A, X_PIPE_BS)
    o_mp = off(A, X_MODEL_PIPE0)
    hq = _hiq(A, m)
    while True:
        n = A[o_qs + m] + A[o_qs + hq]
        if n == 0:
            F[o_qw + m] = INF
            return OK
        _share_roll(A, F, m, now)
        if _share_capped(A, F, m, now):
            A[H_CT_SHARE_HOLD] += 1
            o = off(A, X_M_SHARE) + m * SHARE_COLS
            gap = F[off(A, X_M_PGAP) + m] / SHARE_OVER
            F[o_qw + m] = max(now + (1.0 - F[o + SH_TOK]) * gap, now + 1.0)
            return OK
        # under pressure, PARD books against the deadline less the model's learned room (how
        # much later than booked its paths end, at a high quantile): the tables are then full
        # only that far ahead, and the overruns that cascade through back-to-back bookings end
        # in the room instead of past the deadlines
        shift = _room(A, F, m, now) if pard and F[o_hbf + m] > now else 0.0
        if shift > 0.0 and F[off(A, X_M_HI_UNTIL) + m] > now:
            # the low class already leaves its class room; the two rooms do not add up
            shift = max(shift - F[F_CLASS_ROOM] * F[off(A, X_M_HOLD) + m], 0.0)
        oq, dh = _oldest(A, F, dq, m, hq)
        dh -= shift
        # 1. the pipeline with the least waiting at its planned batch size, among those that
        # meet the oldest deadline if any does (a batch that waited for the last moment of one
        # pipeline must not then move to a slower one that misses it)
        best_p = -1
        best_w = INF
        best_f = INF
        bbuf = 0
        late_p = -1  # while no pipeline meets dh: the least waiting of all
        late_w = INF
        late_f = INF
        lbuf = 0
        for p in range(A[o_mp + m], A[o_mp + m + 1]):
            cur = 1 - bbuf if best_p >= 0 else (1 - lbuf if late_p >= 0 else 0)
            f, w = probe(A, F, p, A[o_bs + p], now, cur)
            if f == INF:
                continue
            if f <= dh:
                if w < best_w:
                    best_p = p
                    best_w = w
                    best_f = f
                    bbuf = cur
            elif best_p < 0 and w < late_w:
                late_p = p
                late_w = w
                late_f = f
                lbuf = cur
        if best_p < 0:
            best_p = late_p
            best_f = late_f
            best_w = late_w
            bbuf = lbuf
        if best_p < 0:
            F[o_qw + m] = INF
            return _drop_all(A, F, m, DROP_NO_CAPACITY)
        # the rooms (PARD's, and the class room a low request's deadline leaves the high class)
        # never take more of the SLO than the path itself leaves, from empty tables at the
        # margins in use: else every request, a fresh one too, misses its shortened deadline,
        # each drop renews the pressure that keeps the margins high, and nothing is served
        # again (both rooms did so at latency noise σ 0.2, at half load)
        cls = 0.0
        if oq == m and F[off(A, X_M_HI_UNTIL) + m] > now:
            cls = F[F_CLASS_ROOM] * F[off(A, X_M_HOLD) + m]
        give = shift + cls - max(F[off(A, X_M_HOLD) + m] - (best_f - now - best_w), 0.0)
        s_hi = shift  # what the rooms take off each class's deadlines (the class room is in a
        s_lo = shift  # low request's deadline already: a negative shift gives it back)
        if give > 0.0:
            s_hi = max(shift - give, 0.0)
            s_lo = shift - give
            # the earliest of the two classes' heads, each less its own shift: a batch takes the
            # high class first, so the low head's deadline, given back its room, must not stand
            # for a high request's earlier one (high requests were served late)
            dh = F[off(A, X_S_DEADLINE) + peek_min(A, dq, m)] - s_lo if A[o_qs + m] > 0 else INF
            if A[o_qs + hq] > 0:
                dh = min(dh, F[off(A, X_S_DEADLINE) + peek_min(A, dq, hq)] - s_hi)
        # 2. the largest batch size <= planned whose finish meets the oldest deadline
        B = A[o_bs + best_p]
        chosen = 0
        cbuf = bbuf
        cfin = best_f
        fmin = best_f
        # PARD keeps batches full (drops what a full batch cannot serve instead of shrinking
        # it) when the queue holds more than a batch, or under pressure when it holds a batch
        # or arrivals come faster than planned: then a smaller batch would cut throughput
        # exactly when it is short; a short queue at light load shrinks the batch as PPipe does
        pressed = F[o_hbf + m] > now
        keep_full = pard and (n > B or (pressed and (
            n == B or F[off(A, X_M_GAP) + m] < F[off(A, X_M_PGAP) + m])))
        if best_f <= dh:
            chosen = B
        elif early and n < B:
            # Nexus-style early drop never shrinks a batch to save a deadline, but a short
            # queue is all a batch can take: the requests at hand, as the wait in 3b assumed
            # (a lone request held for company was dropped when it woke)
            f, w = probe(A, F, best_p, n, now, 1 - bbuf)
            fmin = min(fmin, f)
            if f <= dh:
                chosen = n
                cbuf = 1 - bbuf
                cfin = f
        elif not early and not keep_full:
            cur = 1 - bbuf
            for b in range(B - 1, 0, -1):
                f, w = probe(A, F, best_p, b, now, cur)
                fmin = min(fmin, f)
                if f <= dh:
                    chosen = b
                    cbuf = cur
                    cfin = f
                    break
        # 3a'. no size of that pipeline fits: another pipeline may still serve the oldest
        # request with the requests at hand (not under Nexus-style early drop, which never
        # shrinks, nor under PARD's full batches under pressure; a short queue at light load yes)
        if chosen == 0 and not early and not (keep_full and pressed):
            cur = 1 - bbuf
            for p in range(A[o_mp + m], A[o_mp + m + 1]):
                if p == best_p:
                    continue
                for b in range(min(A[o_bs + p], n), 0, -1):
                    f, w = probe(A, F, p, b, now, cur)
                    fmin = min(fmin, f)
                    if f <= dh:
                        chosen = b
                        break
                if chosen > 0:
                    best_p = p
                    cbuf = cur
                    cfin = f
                    break
        if chosen == 0 and keep_full:
            status = _drop_before(A, F, m, best_f, s_lo, s_hi, DROP_EARLY)
            if status != OK:
                return status
            # (set once the drops are out, so that a call repeated after FULL_OUT probes alike)
            _pressure(A, F, m, now)
            _relax(A, F, m, now)
            continue
        # 3a. no batch size fits: drop every request that no probed size serves in time
        if chosen == 0:
            status = _drop_before(A, F, m, fmin, s_lo, s_hi, DROP_EARLY if early else DROP_DEADLINE)
            if status != OK:
                return status
            _pressure(A, F, m, now)
            _relax(A, F, m, now)
            continue
        take = chosen
        buf = cbuf
        fin = cfin
        # 3b. too few requests: wait for more, but only while more are expected to come (the
        # model's mean arrival gap fits in the slack) and never past the moment that still
        # meets the oldest deadline with the high-quantile margins: a batch held to the last
        # moment of a light-load estimate is late whenever its path runs slow
        if n < chosen:
            take = n
            fn, w = probe(A, F, best_p, n, now, 1 - cbuf)
            if fn <= dh:
                room = dh - fn - WAIT_TAIL * _hi_allowance(A, F, best_p, 1 - cbuf, now)
                slack = room - guard
                gap = F[off(A, X_M_GAP) + m]
                if slack < max(min_wait, gap) and guard > 0.0 and (chosen - n) * gap <= 0.5 * room \
                        and _overloaded(A, F, m, now):
                    # overloaded, arrivals fill the batch well inside its slack: the guard
                    # against a late wake-up need not send it partial (the daemon's 1 ms guard
                    # cost 5 % of capacity at load 1.3); the fallback wake leaves half the slack
                    slack = 0.5 * room
                if slack >= min_wait and slack >= gap and _worth_waiting(A, F, m, best_p, n, chosen):
                    quiet = _quiet_left(A, F, m, now)
                    if quiet > 0.0:
                        F[o_qw + m] = now + min(slack, max(quiet, min_wait))
                        return OK
                buf = 1 - cbuf
                fin = fn
            # else (rare: the greedy path at the smaller size ends later): dispatch the n
            # requests now on the larger size's reservations, which do meet the deadline
        # 3c. reserve and dispatch
        status = _commit_ppipe(A, F, m, best_p, take, buf, fin, now, pard and _hot(A, F, m, now))
        if status != OK:
            return status


# --- reactive (no reservations) ----------------------------------------------------------


@njit(i8(I1, i8), cache=True)
def _feed_queue(A, pool):
    """The queue a pool takes batches from: its model's for a first pool, its own otherwise."""
    if A[off(A, X_POOL_STAGE) + pool] == 0:
        return A[off(A, X_PIPE_MODEL) + A[off(A, X_POOL_PIPE) + pool]]
    return A[H_M] + pool


@njit(i8(I1, F1, i8, f8), cache=True)
def _reactive_queue(A, F, q, now):
    """Per-pool adaptive batching, as long as queue ``q`` has requests and an idle vGPU."""
    M = A[H_M]
    B = A[H_B]
    dq = queues_desc(A)
    o_qs = off(A, X_Q_SIZE)
    o_dl = off(A, X_S_DEADLINE)
    o_src = off(A, X_S_SRC)
    o_vs = off(A, X_V_SERVER)
    o_va = off(A, X_V_ALIVE)
    o_vb = off(A, X_V_BUSY)
    o_pv = off(A, X_POOL_V0)
    o_pl = off(A, X_POOL_LIVE)
    o_pi = off(A, X_POOL_IDLE)
    o_pp = off(A, X_PIPE_POOL0)
    o_bsl = off(A, X_B_SLOTS)
    if q < M:
        pa = A[off(A, X_MODEL_PIPE0) + q]
        pb = A[off(A, X_MODEL_PIPE0) + q + 1]
    else:
        pa = 0
        pb = 1
    while A[o_qs + q] > 0:
        head = peek_min(A, dq, q)
        src = A[o_src + head]
        src_server = A[o_vs + src] if src >= 0 else -1
        live = False
        cp = -1
        cv = -1
        for j in range(pa, pb):
            pool = A[o_pp + j] if q < M else q - M
            if A[o_pl + pool] > 0:
                live = True
            if A[o_pi + pool] == 0:
                continue
            for v in range(A[o_pv + pool], A[o_pv + pool + 1]):
                if A[o_va + v] != 0 and A[o_vb + v] < 0:
                    if cv < 0:
                        cv = v
                    if A[o_vs + v] == src_server:
                        cv = v
                        break
            cp = pool
            break
        if not live:
            return _drop_all(A, F, q, DROP_NO_CAPACITY)
        if cv < 0:
            return OK
        p = A[off(A, X_POOL_PIPE) + cp]
        b = min(A[off(A, X_PIPE_BS) + p], A[o_qs + q])
        dh = F[o_dl + head]
        o_rem = off(A, X_REM) + cp * B
        while b >= 1 and now + F[o_rem + b - 1] > dh:
            b -= 1
        if b == 0:
            if A[H_OUT_NX] >= A[H_OX]:
                return FULL_OUT
            _emit_drop(A, pop_min(F, A, dq, q), DROP_DEADLINE)
            continue
        if A[H_OUT_ND] >= A[H_OD] or A[H_OUT_NR] + 1 > A[H_OR] or A[H_OUT_NQ] + b > A[H_OQ]:
            return FULL_OUT
        if A[H_BNFREE] == 0:
            return FULL_BATCH
        A[H_BNFREE] -= 1
        rec = A[off(A, X_B_FREE) + A[H_BNFREE]]
        stage = A[off(A, X_POOL_STAGE) + cp]
        final = stage == A[off(A, X_PIPE_NPOOLS) + p] - 1
        d = _begin_dispatch(A, A[off(A, X_PIPE_MODEL) + p], p, stage, 1, final, b)
        A[off(A, X_OD_PATH) + d * A[H_K]] = cv
        remote = False
        for i in range(b):
            slot = pop_min(F, A, dq, q)
            sv = A[o_src + slot]
            if sv >= 0 and A[o_vs + sv] != A[o_vs + cv]:
                remote = True
            _emit_req(A, slot, sv)
            if final:
                _free_slot(A, slot)
            else:
                A[o_bsl + rec * B + i] = slot
        T = F[off(A, X_TIN) + cp * B + b - 1] if remote else 0.0
        end = now + T + F[off(A, X_LAT) + cp * B + b - 1]
        h = _emit_res(A, F, cv, KIND_CLAIM, stage, cv, now + T, end, False)
        A[off(A, X_B_HANDLE) + rec] = h
        A[off(A, X_B_N) + rec] = 0 if final else b
        A[off(A, X_B_POOL) + rec] = cp
        A[off(A, X_B_FINAL) + rec] = 1 if final else 0
        A[o_vb + cv] = rec
        A[o_pi + cp] -= 1
        _end_dispatch(A, F, d, end)
    return OK


@njit(i8(I1, F1, i8, i8, b1), cache=True)
def _release_batch(A, F, v, rec, ok):
    """End reactive batch ``rec`` on vGPU ``v``: its requests move to the next pool's queue (ok) or
    back to the queue they came from (failure). FULL_QUEUE (and no change) if that has no room."""
    pool = A[off(A, X_B_POOL) + rec]
    n = A[off(A, X_B_N) + rec]
    if n > 0:
        q = A[H_M] + pool + 1 if ok else _feed_queue(A, pool)
        if A[off(A, X_Q_SIZE) + q] + n > A[H_QC]:
            return FULL_QUEUE
        dq = queues_desc(A)
        o_bsl = off(A, X_B_SLOTS) + rec * A[H_B]
        o_src = off(A, X_S_SRC)
        for i in range(n):
            slot = A[o_bsl + i]
            if ok:
                A[o_src + slot] = v
            push(F, A, dq, q, slot)
        A[off(A, X_Q_DIRTY) + q] = 1
    A[off(A, X_B_HANDLE) + rec] = -1
    A[off(A, X_B_FREE) + A[H_BNFREE]] = rec
    A[H_BNFREE] += 1
    A[off(A, X_V_BUSY) + v] = -1
    return OK


# --- entry points (called from Python with the arena only) -------------------------------


@njit(none(I1, F1, f8, b1), cache=True)
def _begin_decide(A, F, now, fresh):
    if fresh:
        A[H_OUT_ND] = 0
        A[H_OUT_NR] = 0
        A[H_OUT_NQ] = 0
        A[H_OUT_NX] = 0
        A[H_CALL_PROBES] = 0
        A[H_CT_DECIDE] += 1
    if now > F[F_LAST_NOW]:
        F[F_LAST_NOW] = now


@njit(types.Tuple((i8, i8, i8, f8))(I1, f8, b1), cache=True)
def decide_ppipe(A, now, fresh):
    """One batching decision at ``now`` over every model queue that changed or whose wake time
    has come. Returns (status, dispatches, drops, wake-up time); the actions are in the arena's
    output sections."""
    A, F = raw(A)
    _begin_decide(A, F, now, fresh)
    o_qd = off(A, X_Q_DIRTY)
    o_qw = off(A, X_Q_WAKE)
    wake = INF
    for q in range(A[H_M]):
        if A[o_qd + q] != 0 or F[o_qw + q] <= now:
            status = _ppipe_queue(A, F, q, now)
            if status != OK:
                return status, A[H_OUT_ND], A[H_OUT_NX], INF
            A[o_qd + q] = 0
        wake = min(wake, F[o_qw + q])
    F[F_WAKE] = wake
    return OK, A[H_OUT_ND], A[H_OUT_NX], wake


@njit(types.Tuple((i8, i8, i8, f8))(I1, f8, b1), cache=True)
def decide_reactive(A, now, fresh):
    """Reactive counterpart of :func:`decide_ppipe`: serves every queue that changed (new
    requests, a vGPU freed). It never waits, so the wake-up time is inf."""
    A, F = raw(A)
    _begin_decide(A, F, now, fresh)
    o_qd = off(A, X_Q_DIRTY)
    for q in range(A[H_Q] - A[H_M]):  # (the high-class queues are the ppipe policy's)
        if A[o_qd + q] != 0:
            status = _reactive_queue(A, F, q, now)
            if status != OK:
                return status, A[H_OUT_ND], A[H_OUT_NX], INF
            A[o_qd + q] = 0
    F[F_WAKE] = INF
    return OK, A[H_OUT_ND], A[H_OUT_NX], INF


@njit(cache=True, inline="always")
def _enqueue(A, F, rid, model, arrival, deadline, prio):
    """Queue one request; FULL_SLOTS / FULL_QUEUE (before touching anything) if the arena must grow.
    The one copy of the enqueue logic, shared by :func:`submit` and :func:`submit_many`.

    Priority classes (reserving policies): a high request (``prio > 0``) goes to the model's
    high queue, batched first. Batching order alone cannot protect it: PPipe books requests into
    the tables as they come, so under overload the tables are full up to the SLO with low
    requests when a high one arrives. So while the high class is active (an arrival within
    ``CLASS_HOLD_SLOS`` SLOs), a low request is scheduled against its deadline less
    ``F_CLASS_ROOM`` of the SLO: the low class books the tables only that far ahead, and the
    room beyond is the high class's."""
    if A[H_NFREE] == 0:
        return FULL_SLOTS
    q = model
    o_hu = off(A, X_M_HI_UNTIL) + model
    hold = 0.0
    if model < A[H_M] and A[H_POLICY] != POLICY_REACTIVE:
        hold = F[off(A, X_M_HOLD) + model]
        if prio > 0:
            q = _hiq(A, model)
        elif F[o_hu] > arrival:
            deadline -= F[F_CLASS_ROOM] * hold
    if A[off(A, X_Q_SIZE) + q] >= A[H_QC]:
        return FULL_QUEUE
    if q != model:
        F[o_hu] = max(F[o_hu], arrival + CLASS_HOLD_SLOS * hold)
    A[H_NFREE] -= 1
    slot = A[off(A, X_S_FREE) + A[H_NFREE]]
    F[off(A, X_S_DEADLINE) + slot] = deadline
    F[off(A, X_S_ARRIVAL) + slot] = arrival
    A[off(A, X_S_RID) + slot] = rid
    A[off(A, X_S_PRIO) + slot] = prio
    A[off(A, X_S_SRC) + slot] = -1
    if model < A[H_M]:
        # mean arrival gap (EWMA over arrivals), for the wait decision: requests of one message
        # arrive together (gap 0), a lone request after a long pause raises it
        o_last = off(A, X_M_LAST) + model
        o_gap = off(A, X_M_GAP) + model
        if F[o_last] > -INF:
            gap = max(arrival - F[o_last], 0.0)
            _learn_gap(A, F, model, gap)
            F[o_gap] = gap if F[o_gap] == INF else 0.75 * F[o_gap] + 0.25 * gap
        F[o_last] = max(F[o_last], arrival)
        F[off(A, X_M_SHARE) + model * SHARE_COLS + SH_NA] += 1.0
    push(F, A, queues_desc(A), q, slot)
    A[off(A, X_Q_DIRTY) + model] = 1
    return OK


@njit(i8(I1, i8, i8, f8, f8, i8), cache=True)
def submit(A, rid, model, arrival, deadline, prio):
    """Queue request ``rid`` of ``model``; FULL_SLOTS / FULL_QUEUE if the arena must grow."""
    A, F = raw(A)
    return _enqueue(A, F, rid, model, arrival, deadline, prio)


@njit(types.UniTuple(i8, 2)(I1, i8, i8, i8, f8, f8, i8, i8), cache=True)
def submit_many(A, rid0, n, model, arrival, deadline, prio, i0):
    """Queue requests ``rid0 + i0 .. rid0 + n - 1`` of ``model``, in that order, all with one
    arrival and deadline (the accepted requests of one client message); the same as that many
    :func:`submit` calls. Returns (status, index of the first one not queued)."""
    A, F = raw(A)
    for i in range(i0, n):
        status = _enqueue(A, F, rid0 + i, model, arrival, deadline, prio)
        if status != OK:
            return status, i
    return OK, n


@njit(i8(I1, i8, i8), cache=True)
def cancel(A, rid, model):
    """Remove pending request ``rid`` from ``model``'s queue; 1 if it was there."""
    A, F = raw(A)
    dq = queues_desc(A)
    o_rid = off(A, X_S_RID)
    for q in (model, _hiq(A, model)):
        hb = dq[0] + q * dq[1]
        for i in range(A[dq[2] + q]):
            slot = A[hb + i]
            if A[o_rid + slot] == rid:
                remove_at(F, A, dq, q, i)
                _free_slot(A, slot)
                A[off(A, X_Q_DIRTY) + model] = 1
                return 1
    return 0


@njit(f8(I1, F1, i8, i8), cache=True)
def _profiled_len(A, F, v, h):
    """Profiled latency of inference ``h`` on vGPU ``v`` (0 if it is older than the last RK).
    Kept apart from the tables, whose entries GC may already have dropped."""
    j = v * RK + (h >> HANDLE_SHIFT) % RK
    if A[off(A, X_V_RH) + j] != h:
        return 0.0
    return F[off(A, X_V_RLEN) + j]


@njit(cache=True, inline="always")
def _quantile_step(F, o, x, q, step, hi):
    """One multiplicative stochastic-approximation step of the estimate at ``F[o]`` towards
    the ``q`` quantile of the samples ``x``, kept within [1, ``hi``]."""
    m = F[o]
    if x > m * (1.0 + 1e-9):
        m *= np.exp(step * q)
    else:
        m *= np.exp(-step * (1.0 - q))
    F[o] = min(max(m, 1.0), hi)


@njit(none(I1, F1, i8, f8, f8), cache=True)
def _learn_margin(A, F, v, prof, took):
    """Move vGPU ``v``'s margins towards the ``F_MARGIN_Q`` and ``F_MARGIN_QHI`` quantiles of
    its measured / profiled latency, from a use that took ``took`` µs of a profiled ``prof``.

    Why margins: executors' latency wanders (clocks, MPS neighbours, PCIe); a reservation of
    exactly the profiled time makes every overrun push the batches queued behind it, and their
    downstream transfers, past their deadlines. Why two: at light load gaps between
    reservations absorb most overruns and a lower quantile keeps the finish estimates, and so
    admission, close to the truth; under pressure every resource is booked back to back, each
    overrun cascades, and a high quantile keeps the served requests on time (work-conserving
    executors and pulls keep the capacity). Why this estimator: a multiplicative
    stochastic-approximation step (up by ``step * q`` when a use overran the margin, down by
    ``step * (1 - q)`` otherwise) settles where a fraction ``q`` of uses fit, costs O(1) per
    report and follows drift; a margin stays within [1, ``F_MARGIN_MAX``].
    """
    if prof <= 0.0:
        return
    x = took / prof
    A[off(A, X_V_NREP) + v] += 1
    step = F[F_MARGIN_STEP]
    hi = F[F_MARGIN_MAX]
    _quantile_step(F, off(A, X_V_MARGIN) + v, x, F[F_MARGIN_Q], step, hi)
    _quantile_step(F, off(A, X_V_MARGIN_HI) + v, x, F[F_MARGIN_QHI], step, hi)


@njit(none(I1, F1, i8, i8, f8), cache=True)
def _learn_room(A, F, v, h, b):
    """If use ``h`` of vGPU ``v`` was the last hop of its path, move the model's room towards the
    ``F_ROOM_Q`` quantile of how much later than booked the path ended (``b``), within
    [0, ``F_PRESSURE_ROOM`` x SLO]. (Paths booked right up to the deadline less the room end late
    at about 1 - ``F_ROOM_Q``: at the margins' 0.99 the late share hovered at the 1 % target.)

    Why learned and not fixed: the margins cover each hop's own noise, but under overload every
    table is booked back to back up to the deadlines, and an overrun pushes the bookings behind
    it; how far depends on the plan and the load. A fixed room costs goodput in short bursts,
    where little cascades; this one grows only as far as paths really end late."""
    j = v * RK + (h >> HANDLE_SHIFT) % RK
    fin = F[off(A, X_V_RFIN) + j]
    if fin == -INF:
        return
    F[off(A, X_V_RFIN) + j] = -INF  # learned once per path
    m = A[off(A, X_PIPE_MODEL) + A[off(A, X_POOL_PIPE) + A[off(A, X_V_POOL) + v]]]
    slo = F[off(A, X_M_HOLD) + m]
    for o, q in ((off(A, X_M_ROOM) + m, F[F_ROOM_Q]), (off(A, X_M_ROOM_B) + m, ROOM_Q_BURST)):
        x = F[o]
        x += ROOM_STEP * slo * (q if b - fin > x else q - 1.0)
        F[o] = min(max(x, 0.0), F[F_PRESSURE_ROOM] * slo)


@njit(i8(I1, F1, i8, f8, f8), cache=True)
def _report_one(A, F, h, a, b):
    r = h & HANDLE_MASK
    if r >= A[H_R]:
        return OK
    A[H_CT_REPORT] += 1
    o_va = off(A, X_V_ALIVE)
    if A[H_POLICY] == POLICY_REACTIVE:
        if r >= A[H_V]:
            return OK
        rec = A[off(A, X_V_BUSY) + r]
        if rec < 0 or A[off(A, X_B_HANDLE) + rec] != h:
            return OK  # stale: the vGPU was removed or the batch already ended
        pool = A[off(A, X_B_POOL) + rec]
        status = _release_batch(A, F, r, rec, b > a)
        if status != OK:
            return status
        if A[o_va + r] != 0:
            A[off(A, X_POOL_IDLE) + pool] += 1
        A[off(A, X_Q_DIRTY) + _feed_queue(A, pool)] = 1
        return OK
    horizon = F[F_LAST_NOW]
    if r < A[H_V] and A[o_va + r] == 0:
        horizon = INF  # a removed vGPU keeps no reservations
    learn = r < A[H_V] and horizon < INF and b > a and F[F_MARGIN_STEP] > 0.0
    prof = _profiled_len(A, F, r, h) if learn else 0.0
    if correct(F, A, tables_desc(A), r, h, a, b, horizon, A[H_PULL] != 0 and r < A[H_V]) != 0:
        return FULL_TABLE  # nothing changed, the margin included: the call is repeated
    if learn:
        o = off(A, X_V_HEARD) + 2 * r
        if prof > 0.0 and F[o + 1] > F[o]:
            # the first use since its margins were relaxed (see _relax) says where they stand:
            # still slow, and the vGPU is off the paths again after one batch; well, and it serves
            x = min(max((b - a) / prof, 1.0), F[F_MARGIN_MAX])
            F[off(A, X_V_MARGIN) + r] = x
            F[off(A, X_V_MARGIN_HI) + r] = x
            A[off(A, X_V_NREP) + r] += 1
        else:
            _learn_margin(A, F, r, prof, b - a)
        if prof > 0.0:
            F[o] = max(F[o], b)
            _learn_room(A, F, r, h, b)
    return OK


@njit(i8(I1, i8, f8, f8), cache=True)
def report(A, h, a, b):
    """Feedback: reservation ``h`` really ran over ``[a, b)`` (``b <= a``: it did not run)."""
    A, F = raw(A)
    return _report_one(A, F, h, a, b)


@njit(types.UniTuple(i8, 2)(I1, I1, F1, F1, i8), cache=True)
def report_many(A, hs, starts, ends, i0):
    """Reports ``i0..`` in order; returns (status, index of the first one not applied)."""
    A, F = raw(A)
    for i in range(i0, hs.shape[0]):
        status = _report_one(A, F, hs[i], starts[i], ends[i])
        if status != OK:
            return status, i
    return OK, hs.shape[0]


@njit(i8(I1, i8, b1), cache=True)
def set_alive(A, v, alive):
    """Take vGPU ``v`` out of service (its reservations are released; a reactive batch on it goes
    back to its queue) or put it back. Every queue is re-decided at the next call."""
    A, F = raw(A)
    o_va = off(A, X_V_ALIVE)
    if (A[o_va + v] != 0) == alive:
        return OK
    pool = A[off(A, X_V_POOL) + v]
    o_pl = off(A, X_POOL_LIVE)
    o_pi = off(A, X_POOL_IDLE)
    reactive = A[H_POLICY] == POLICY_REACTIVE
    if not alive:
        busy = A[off(A, X_V_BUSY) + v]
        if reactive and busy >= 0:
            status = _release_batch(A, F, v, busy, False)
            if status != OK:
                return status
        elif reactive:
            A[o_pi + pool] -= 1
        A[o_va + v] = 0
        A[o_pl + pool] -= 1
    else:
        A[o_va + v] = 1
        A[o_pl + pool] += 1
        if reactive:
            A[o_pi + pool] += 1
    clear_row(F, A, tables_desc(A), v)
    o_qd = off(A, X_Q_DIRTY)
    for q in range(A[H_Q]):
        A[o_qd + q] = 1
    return OK


@njit(i8(I1, f8), cache=True)
def gc(A, now):
    """Drop every interval that ended at or before ``now``; returns how many."""
    A, F = raw(A)
    if now > F[F_LAST_NOW]:
        F[F_LAST_NOW] = now
    tb = tables_desc(A)
    o_lo = off(A, X_T_LO)
    o_hi = off(A, X_T_HI)
    n = 0
    for r in range(A[H_R]):
        if A[o_hi + r] > A[o_lo + r]:
            n += gc_row(F, A, tb, r, now)
    A[H_CT_GC] += n
    return n


@njit(f8(I1, I1, f8, f8), cache=True)
def earliest(A, rs, t, d):
    """``earliest_slot``: first start >= ``t`` at which every resource in ``rs`` is free for ``d``."""
    A, F = raw(A)
    tb = tables_desc(A)
    s = t
    while True:
        moved = False
        for r in rs:
            s2 = earliest1(F, A, tb, r, s, d)
            if s2 != s:
                s = s2
                moved = True
        if not moved:
            return s


@njit(types.UniTuple(f8, 2)(I1, i8, i8, f8), cache=True)
def probe_entry(A, p, b, now):
    """probe() from Python, for tests and tools: returns (finish, waiting); the path is in
    scratch buffer 0."""
    A, F = raw(A)
    return probe(A, F, p, b, now, 0)


@njit(cache=True)
def stage_estimate(A, F, m, n, now):
    """How long from ``now`` until ``n`` new requests of model ``m`` could be done: the best
    pipeline's probe at their batch size (up to its planned one), behind the requests already
    queued for ``m`` and those of the ``n`` past one batch (each taking the planned gap between
    arrivals, the model's planned throughput), and under PARD's pressure the room the model
    then keeps before its deadlines. A query's upstream stage subtracts this for its
    downstream stages from the query's deadline (PARD's estimate of the whole remaining path)."""
    o_mp = off(A, X_MODEL_PIPE0)
    o_bs = off(A, X_PIPE_BS)
    gap = F[off(A, X_M_PGAP) + m]
    if not gap < INF:
        gap = 0.0
    best = INF
    for p in range(A[o_mp + m], A[o_mp + m + 1]):
        b = min(max(n, 1), A[o_bs + p])
        f, _ = probe(A, F, p, b, now, 0)
        # the requests past one batch wait like queued ones
        x = f - now + (max(n, 1) - b) * gap
        if x < best:
            best = x
    o_qs = off(A, X_Q_SIZE)
    q = A[o_qs + m] + A[o_qs + _hiq(A, m)]
    if A[H_PARD] != 0 and A[off(A, X_M_PARD) + m] != 0 and F[off(A, X_Q_HBF) + m] > now:
        # under pressure PARD books m's requests its room ahead of their deadlines
        best += _room(A, F, m, now)
    return best + q * gap


@njit(f8(I1, i8, i8, f8), cache=True)
def stage_estimate_entry(A, m, n, now):
    """:func:`stage_estimate` from Python."""
    A, F = raw(A)
    return stage_estimate(A, F, m, n, now)
