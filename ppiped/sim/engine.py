"""The compiled discrete-event loop: a virtual clock driving the daemon's own compiled core.

"One core, two clocks": this loop never decides anything itself. It feeds arrivals to
``kernels.sched.submit``, calls ``decide_ppipe`` / ``decide_reactive`` at arrivals, at the core's
wake time and after reports that dirty a queue, carries out the dispatches on simulated
executors, reports every use back through ``kernels.sched.report`` and calls ``gc``
periodically -- the same entry points the daemon calls, on the same arena.

Why the loop is compiled: a Python loop costs a few µs per event, the core costs about as much
per decision; at 200k simulated requests per second the loop itself must cost well under 1 µs
per event. So every piece of loop state lives in arrays (``si``/``sf`` scalars, an event heap,
batch records, per-vGPU ready lists) and :func:`run_loop` is resumable: when the core answers a
``FULL_*`` status, or one of the loop's own arrays is full, it returns the status to Python,
which enlarges that array (:class:`ppiped.sim.run.Simulation`) and calls it again; the loop
carries on from the phase it saved.

Simulated executors (the rules of ``ppiped.executor.main.Worker``): each vGPU holds the batches
whose input has arrived, ordered by reserved start, runs one at a time, and starts the head batch
at ``max(reserved start - start_early, input ready, vGPU free)``. ``start_early = inf`` (the
default, as the daemon's executors) makes them work-conserving; with ``start_early = 0`` a batch
never starts before the slot the core reserved for it.
An inference takes the profiled latency (Layout ``lat``) times a seeded lognormal jitter; a
transfer takes ``bytes · bs · 8 / bandwidth`` (Layout ``tin``) from the end of the upstream
inference. By default transfers also share the NICs: a server's vGPUs send over one uplink and
receive over one downlink, so a transfer takes the first time at which both are free (a reserved
one not before its reserved slot). Without that model the reactive baseline, which reserves no
NIC time, would get contention-free transfers that the ppipe policy is charged for.

One difference from the daemon: its executors send an output the moment it is ready, while here
a reserved transfer waits for its slot. Sending at once (FIFO NICs as here) measured 0.958 /
0.928 on Figure 6 at sigma 0 / 0.05 against 0.960 / 0.921 paced (2026-11-26, session 16): early
sends take NIC time booked for others, and late ones no longer queue behind paced ones.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import numba
import numpy as np
from numba import njit
from numba.core import caching as _nbcache

from ..kernels import sched as K
from ..kernels.state import (
    H_K,
    H_OUT_ND,
    H_OUT_NX,
    H_Q,
    KIND_CLAIM,
    KIND_DOWNLINK,
    KIND_INFER,
    KIND_UPLINK,
    OK,
    X_OD_BS,
    X_OD_FINAL,
    X_OD_MODEL,
    X_OD_NHOPS,
    X_OD_NRES,
    X_OD_PATH,
    X_OD_REQ0,
    X_OD_RES0,
    X_OD_STAGE,
    X_OQ_RID,
    X_OQ_SRC,
    X_OR_HANDLE,
    X_OR_HOP,
    X_OR_KIND,
    X_OR_START,
    X_OX_REASON,
    X_OX_RID,
    X_Q_DIRTY,
    X_V_MARGIN,
    X_V_MARGIN_HI,
    _voidptr,
    off,
)

INF = np.inf


class _EngineCacheLocator(_nbcache.InTreeCacheLocator):
    """Numba's on-disk cache, invalidated when the *core* changes too.

    numba stamps a cached function with its own file's contents only, but this loop has the
    core's kernels compiled into it: after an edit to ``kernels/*.py`` the cached loop would
    keep running the old core (seen in practice: a stale reactive path that dispatched nothing).
    So this file's cache entries are stamped with the hash of this file and every kernel file.
    """

    _KERNELS = Path(K.__file__).resolve().parent

    def get_source_stamp(self):
        h = hashlib.sha256()
        for p in [Path(self._py_file), *sorted(self._KERNELS.glob("*.py"))]:
            h.update(p.name.encode())
            h.update(p.read_bytes())
        return h.hexdigest()

    @classmethod
    def from_function(cls, py_func, py_file):
        if Path(py_file).resolve() != Path(__file__).resolve():
            return None
        return super().from_function(py_func, py_file)


_LOCATORS = getattr(_nbcache, "CacheImpl", getattr(_nbcache, "_CacheImpl", None))._locator_classes
if _EngineCacheLocator not in _LOCATORS:
    _LOCATORS.insert(0, _EngineCacheLocator)

# statuses of run_loop besides the core's OK / FULL_* (1..5)
DONE = 0
SIM_FULL_BATCH = 10
SIM_FULL_HEAP = 11
SIM_FULL_NIC = 13
STOPPED = 20

# si: int64 loop state
I_PHASE = 0
I_FRESH = 1
I_NEED_DECIDE = 2
I_AI = 3  # next arrival to submit
I_OUT_D = 4  # next dispatch of the current decide's output to carry out
I_OUT_X = 5  # next drop of the current output
I_RB_N = 6  # reports buffered
I_RB_I = 7  # next buffered report to send
I_EH_N = 8  # events in the heap
I_EH_SEQ = 9  # event sequence number (ties: first pushed, first popped)
I_BFREE = 10  # head of the free list of batch records (-1: none)
I_USES = 11  # inferences started: the jitter stream's counter
I_TL_N = 12  # timeline entries
I_TWICE = 13  # requests that ended twice (a bug if ever > 0)
I_STOP = 14
I_REACTIVE = 15
I_SEED = 16  # seed, already mixed
I_K = 17  # most hops per dispatch
I_INFL = 18  # batch records in use
I_MAX_INFL = 19
I_EVENTS = 20
I_NIC = 21  # 1: transfers share the server NICs they use
I_NIC_MAXN = 22  # most intervals a NIC row has held (growth check)
I_STOP_LATE = 24  # 1: a query that failed spawns no more stages (0: hand-chained clients go on)
I_NROOT = 23  # arrivals known up front (the rest are app stages, spawned by their parents)
I_ORACLE = 25  # 1: the core books inferences at the latency they will take (SimOptions.oracle_latency)
I_SIZE = 26

# sf: float64 loop state
G_NOW = 0
G_NEXT_GC = 1
G_GC_EVERY = 2
G_GC_LAG = 3
G_SIGMA = 4
G_EARLY = 5
G_DURATION = 6
G_TL_LO = 7
G_TL_HI = 8
G_WAKE = 9  # when the core asked to decide again (its last decide's wake time)
G_SIZE = 12

PH_EVENT = 0
PH_SUBMIT = 1
PH_FLUSH = 2
PH_DECIDE = 3
PH_OUTPUT = 4

EV_SPAWN = 0  # payload: a served request whose app children now arrive
EV_END = 1  # payload: job (batch * K + hop)
EV_READY = 2  # payload: job
EV_TIMER = 3  # payload: vGPU

# batch record fields
BI_MODEL = 0
BI_NHOPS = 1
BI_BS = 2
BI_FINAL = 3
BI_NEXT = 4  # free-list link
BI_SIZE = 5
# per hop, int
HI_V = 0
HI_INFER = 1  # handle of the inference (reactive: the claim)
HI_UP = 2  # handles of the transfer into this hop (-1: none)
HI_DOWN = 3
HI_SIZE = 4
# per hop, float
HF_RS = 0  # reserved start
HF_T = 1  # transfer time into this hop
HF_READY = 2
HF_START = 3
HF_END = 4
HF_TX = 5  # when the transfer into this hop started
HF_FAC = 6  # the hop's latency factor, drawn when it was booked (oracle latency; NaN: drawn at its start)
HF_SIZE = 7

# request states
R_PENDING = 0
R_SERVED = 1  # drops are 1 + reason (state.DROP_*)
R_CANCELLED = 9  # an app stage request withdrawn because its query had already failed

# per-request deadline rules (dq_i[:, DQ_MODE]); dq_f[:, DF_DL] is the deadline a request is
# late against (its query's, for app stages), dq_f[:, DF_DC] the mode's parameter
DM_ABS = 0  # scheduled against DF_DC
DM_REL = 1  # scheduled against arrival + DF_DC (hand-chained stages)
DM_E2E = 2  # against DF_DL less the core's estimate of its downstream stages, at least DF_DC
Q_FAIL_DROP = 1  # q_fail: a request was dropped
Q_FAIL_LATE = 2  # a request ended past the query's deadline
Q_FAIL_SPAWN = 3  # a stage's children could not end in time: dropped before they arrived
DQ_MODE = 0
DQ_C0 = 1  # first child request (children of a request are contiguous)
DQ_NC = 2  # children (drawn up front from the stage's fan-out)
DQ_QUERY = 3  # the query (its root's id) or -1 for a plain request
DQ_SIZE = 4
DF_DL = 0
DF_DC = 1
DF_SIZE = 2

# A completion this close after its deadline is on time: a batch dispatched at the last moment
# is planned to end exactly at the deadline, and the simulator's sum start + latency rounds
# differently from the core's deadline - slack arithmetic by an ulp or two.
LATE_EPS_US = 1e-3

RB_CAP = 16  # reports buffered per event (an event makes at most 2)


# --- jitter: a counter-based stream, so results never depend on a global RNG's history --------


@njit(cache=True, inline="always")
def mix64(z):
    """splitmix64's finaliser on a uint64."""
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@njit(cache=True, inline="always")
def _unit(z):
    """uint64 -> uniform in (0, 1)."""
    return ((z >> np.uint64(11)) + 0.5) * (1.0 / 9007199254740992.0)


@njit(cache=True, inline="always")
def jitter(seed, n, sigma):
    """Factor of use ``n``: lognormal with median 1 and log-sd ``sigma`` (exactly 1 at sigma 0)."""
    if sigma == 0.0:
        return 1.0
    s = np.uint64(seed)
    u1 = _unit(mix64(s ^ mix64(np.uint64(2 * n))))
    u2 = _unit(mix64(s ^ mix64(np.uint64(2 * n + 1))))
    z = np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
    return np.exp(sigma * z)


# --- the event heap: (time, sequence) keys, payload = kind | item << 2 -----------------------


@njit(cache=True, inline="always")
def ev_push(si, et, es, ex, t, kind, item):
    # sift the new event up from the end, moving parents down into the hole
    i = si[I_EH_N]
    s = si[I_EH_SEQ]
    si[I_EH_SEQ] = s + 1
    si[I_EH_N] = i + 1
    while i > 0:
        p = (i - 1) >> 1
        tp = et[p]
        if not (t < tp or (t == tp and s < es[p])):
            break
        et[i] = tp
        es[i] = es[p]
        ex[i] = ex[p]
        i = p
    et[i] = t
    es[i] = s
    ex[i] = kind | (item << 2)


@njit(cache=True, inline="always")
def ev_pop(si, et, es, ex):
    """Remove the earliest event; returns its payload (its time was ``et[0]``)."""
    x = ex[0]
    n = si[I_EH_N] - 1
    si[I_EH_N] = n
    if n > 0:
        # sift the last event down from the root, moving the smaller child up into the hole
        t = et[n]
        s = es[n]
        i = 0
        while True:
            c = 2 * i + 1
            if c >= n:
                break
            tc = et[c]
            sc = es[c]
            if c + 1 < n:
                t2 = et[c + 1]
                s2 = es[c + 1]
                if t2 < tc or (t2 == tc and s2 < sc):
                    c += 1
                    tc = t2
                    sc = s2
            if not (tc < t or (tc == t and sc < s)):
                break
            et[i] = tc
            es[i] = sc
            ex[i] = ex[c]
            i = c
        et[i] = t
        es[i] = s
        ex[i] = ex[n]
    return x


# --- simulated executors ----------------------------------------------------------------------


@njit(cache=True, inline="always")
def _enqueue_job(si, j, v, v_head, j_next, bhf):
    """Put job ``j`` (its input is on ``v`` now) into ``v``'s list, ordered by (reserved start, j)."""
    Kd = si[I_K]
    rs = bhf[j // Kd, j % Kd, HF_RS]
    prev = -1
    cur = v_head[v]
    while cur >= 0:
        rc = bhf[cur // Kd, cur % Kd, HF_RS]
        if rc > rs or (rc == rs and cur > j):
            break
        prev = cur
        cur = j_next[cur]
    j_next[j] = cur
    if prev < 0:
        v_head[v] = j
    else:
        j_next[prev] = j


@njit(cache=True, inline="always")
def _try_start(si, sf, now, v, v_head, v_run, v_timer, v_busy, j_next, bi, bhf, v_pool, lat,
               et, es, ex):
    """Start ``v``'s head job if ``v`` is free and the job's reserved start has come; else arm a
    timer for that start."""
    if v_run[v] >= 0:
        return
    j = v_head[v]
    if j < 0:
        return
    Kd = si[I_K]
    b = j // Kd
    k = j % Kd
    at = bhf[b, k, HF_RS] - sf[G_EARLY]
    if at > now:
        if v_timer[v] != at:
            v_timer[v] = at
            ev_push(si, et, es, ex, at, EV_TIMER, v)
        return
    v_head[v] = j_next[j]
    v_run[v] = j
    v_timer[v] = INF
    if si[I_ORACLE] != 0 and bhf[b, k, HF_FAC] == bhf[b, k, HF_FAC]:  # (NaN: not this hop)
        fac = bhf[b, k, HF_FAC]
    else:
        n = si[I_USES]
        si[I_USES] = n + 1
        fac = jitter(si[I_SEED], n, sf[G_SIGMA])
    dur = lat[v_pool[v], bi[b, BI_BS] - 1] * fac
    end = now + dur
    bhf[b, k, HF_START] = now
    bhf[b, k, HF_END] = end
    lo = max(now, 0.0)
    if end > lo:  # all of it, past the window too: the window's requests' work, as goodput counts them
        v_busy[v] += end - lo
    ev_push(si, et, es, ex, end, EV_END, j)


@njit(cache=True, inline="always")
def _nic_prune(nic_s, nic_e, nic_n, r, now):
    """Forget the transfers of NIC row ``r`` that ended by ``now``."""
    n = nic_n[r]
    k = 0
    while k < n and nic_e[r, k] <= now:
        k += 1
    if k:
        for i in range(n - k):
            nic_s[r, i] = nic_s[r, i + k]
            nic_e[r, i] = nic_e[r, i + k]
        nic_n[r] = n - k


@njit(cache=True, inline="always")
def _nic_insert(si, nic_s, nic_e, nic_n, r, a, b):
    n = nic_n[r]
    i = n
    while i > 0 and nic_s[r, i - 1] > a:
        nic_s[r, i] = nic_s[r, i - 1]
        nic_e[r, i] = nic_e[r, i - 1]
        i -= 1
    nic_s[r, i] = a
    nic_e[r, i] = b
    nic_n[r] = n + 1
    if n + 1 > si[I_NIC_MAXN]:
        si[I_NIC_MAXN] = n + 1


@njit(cache=True, inline="always")
def _transfer(si, sf, now, ask, up, down, dur, nic_s, nic_e, nic_n, nic_busy):
    """A transfer of ``dur`` µs over NIC rows ``up`` and ``down``, not before ``ask``: it takes
    the first time both links are free for ``dur`` (filling gaps between transfers already
    placed), or starts at ``ask`` without the NIC model. Returns its start."""
    s = ask
    if si[I_NIC] != 0:
        _nic_prune(nic_s, nic_e, nic_n, up, now)
        _nic_prune(nic_s, nic_e, nic_n, down, now)
        moved = True
        while moved:
            moved = False
            for r in (up, down):
                for i in range(nic_n[r]):
                    if nic_s[r, i] < s + dur and s < nic_e[r, i]:
                        s = nic_e[r, i]
                        moved = True
        _nic_insert(si, nic_s, nic_e, nic_n, up, s, s + dur)
        _nic_insert(si, nic_s, nic_e, nic_n, down, s, s + dur)
    lo = max(s, 0.0)
    if s + dur > lo:
        nic_busy[up] += s + dur - lo
        nic_busy[down] += s + dur - lo
    return s


@njit(cache=True, inline="always")
def _end_request(si, rid, now, dq_f, arr_m, r_state, r_end, miss, miss_allow, state):
    if r_state[rid] != R_PENDING:
        si[I_TWICE] += 1
        return
    r_state[rid] = state
    m = arr_m[rid]
    if state == R_SERVED:
        r_end[rid] = now
        if now > dq_f[rid, DF_DL] + LATE_EPS_US:
            miss[m] += 1
    else:
        miss[m] += 1
    if miss_allow[m] >= 0 and miss[m] > miss_allow[m]:
        si[I_STOP] = 1


@njit(cache=True)
def _rest(A, F, m, k, now, span, m_c0, m_cm, m_n, m_order, m_glue, m_share, rest_tmp):
    """What ``k`` requests of model ``m`` arriving together need after they end, now: per child
    stage a glue step, the core's estimate for the requests they yield together
    (``kernels.sched.stage_estimate``) but never less than the stage's planned share of the
    query's ``span`` (its own deadline will keep that much for the stages after it), and its own
    downstream, the slowest child counting (:func:`ppiped.query.app.downstream_us`; deeper
    stages at one parent request's yield)."""
    if m_c0[m] == m_c0[m + 1]:
        return 0.0
    for i in range(m_order.shape[0]):  # children before parents
        d = m_order[i]
        r = 0.0
        for j in range(m_c0[d], m_c0[d + 1]):
            c = m_cm[j]
            x = m_glue[c] + max(K.stage_estimate(A, F, c, m_n[c] * (k if d == m else 1), now),
                                m_share[c] * span) + rest_tmp[c]
            if x > r:
                r = x
        rest_tmp[d] = r
    return rest_tmp[m]


@njit(cache=True)
def _children_in_time(A, F, rid, now, span, arr_m, dq_i, dq_f, m_c0, m_cm, m_n, m_order, m_glue, m_share,
                      rest_tmp):
    """Whether request ``rid``'s children, now that their number is known, can still end by
    their query's deadline (PARD's check at the next stage's admission): per child model, the
    core's estimate for that many requests and its own downstream stages."""
    c0 = dq_i[rid, DQ_C0]
    c1 = c0 + dq_i[rid, DQ_NC]
    dl = dq_f[rid, DF_DL]
    c = c0
    while c < c1:
        m = arr_m[c]
        k = 0
        while c < c1 and arr_m[c] == m:
            k += 1
            c += 1
        if now + K.stage_estimate(A, F, m, k, now) + _rest(A, F, m, k, now, span, m_c0, m_cm, m_n, m_order,
                                                          m_glue, m_share, rest_tmp) > dl:
            K._pressure(A, F, m, now)  # a drop of m's requests, as PARD counts them
            return False
    return True


@njit(cache=True)
def _query_failed(A, si, rid, now, arr_t, arr_m, dq_i, qm0, qm, q_fail, r_state, why):
    """A request of a query was dropped (or ended late): the query has failed; withdraw its
    requests still queued, which would only spend GPU time on an answer nobody can use (a
    client chaining stages by hand, ``I_STOP_LATE`` 0, knows nothing of the query and goes on)."""
    q = dq_i[rid, DQ_QUERY]
    if q < 0 or q_fail[q] != 0:
        return
    q_fail[q] = why
    if si[I_STOP_LATE] == 0:
        return
    for i in range(qm0[q], qm0[q + 1]):
        j = qm[i]
        if j != rid and r_state[j] == R_PENDING and arr_t[j] <= now and K.cancel(A, j, arr_m[j]) != 0:
            r_state[j] = R_CANCELLED


@njit(cache=True, inline="always")
def _buffer_report(si, rb_h, rb_f, h, a, b):
    i = si[I_RB_N]
    rb_h[i] = h
    rb_f[i, 0] = a
    rb_f[i, 1] = b
    si[I_RB_N] = i + 1


@njit(cache=True, inline="always")
def _nv(a):
    """``a`` as a view without a memory owner (valid while ``a`` is alive: during the call)."""
    return numba.carray(_voidptr(a.ctypes.data), a.shape, a.dtype)


# --- the loop ---------------------------------------------------------------------------------


@njit(cache=True)
def run_loop(A, si, sf, arr_t, arr_m, arr_p, slo, miss_allow, v_pool, v_server, lat, tin,
             nic_s, nic_e, nic_n, nic_busy,
             et, es, ex, bi, bhi, bhf, breq, j_next,
             v_head, v_run, v_timer, v_busy, r_state, r_end, r_gpu, miss, rb_h, rb_f, tl_i, tl_f,
             dq_i, dq_f, qm0, qm, q_fail, m_c0, m_cm, m_n, m_order, m_glue, m_share, rest_tmp, v_fac):
    """Run until every request has ended (DONE), the miss budget is spent (STOPPED), or an array
    is full (a core ``FULL_*`` status or ``SIM_FULL_*``): then grow it and call again."""
    # owner-less views of every array (see kernels.state.raw): numba reference-counts owned
    # arrays with an atomic instruction at every call that passes them, which cost about half
    # of the loop's own time
    A = _nv(A)
    si = _nv(si)
    sf = _nv(sf)
    arr_t = _nv(arr_t)
    arr_m = _nv(arr_m)
    arr_p = _nv(arr_p)
    slo = _nv(slo)
    miss_allow = _nv(miss_allow)
    v_pool = _nv(v_pool)
    v_server = _nv(v_server)
    lat = _nv(lat)
    tin = _nv(tin)
    nic_s = _nv(nic_s)
    nic_e = _nv(nic_e)
    nic_n = _nv(nic_n)
    nic_busy = _nv(nic_busy)
    et = _nv(et)
    es = _nv(es)
    ex = _nv(ex)
    bi = _nv(bi)
    bhi = _nv(bhi)
    bhf = _nv(bhf)
    breq = _nv(breq)
    j_next = _nv(j_next)
    v_head = _nv(v_head)
    v_run = _nv(v_run)
    v_timer = _nv(v_timer)
    v_busy = _nv(v_busy)
    r_state = _nv(r_state)
    r_end = _nv(r_end)
    r_gpu = _nv(r_gpu)
    miss = _nv(miss)
    rb_h = _nv(rb_h)
    rb_f = _nv(rb_f)
    tl_i = _nv(tl_i)
    tl_f = _nv(tl_f)
    dq_i = _nv(dq_i)
    dq_f = _nv(dq_f)
    qm0 = _nv(qm0)
    qm = _nv(qm)
    q_fail = _nv(q_fail)
    n_arr = si[I_NROOT]
    stop_late = si[I_STOP_LATE] != 0
    Bmax = breq.shape[1]
    Kd = si[I_K]
    reactive = si[I_REACTIVE] != 0
    F = _nv(A.view(np.float64))
    while True:
        ph = si[I_PHASE]
        now = sf[G_NOW]
        if ph == PH_EVENT:
            if si[I_STOP] != 0:
                return STOPPED
            if si[I_EH_N] + 4 + Bmax > et.shape[0]:
                return SIM_FULL_HEAP
            if si[I_NIC_MAXN] + 2 * Kd + 2 > nic_s.shape[1]:
                return SIM_FULL_NIC
            t_ev = et[0] if si[I_EH_N] > 0 else INF
            ai = si[I_AI]
            t_arr = arr_t[ai] if ai < n_arr else INF
            t_wake = sf[G_WAKE]
            t_gc = sf[G_NEXT_GC]
            if t_ev == INF and t_arr == INF and t_wake == INF:
                return DONE
            if t_ev <= t_arr and t_ev <= t_wake and t_ev <= t_gc:
                sf[G_NOW] = t_ev
                now = t_ev
                x = ev_pop(si, et, es, ex)
                si[I_EVENTS] += 1
                kind = x & 3
                item = x >> 2
                if kind == EV_SPAWN:
                    q = dq_i[item, DQ_QUERY]
                    span = dq_f[item, DF_DL] - arr_t[qm[qm0[q]]] if q >= 0 else 0.0
                    if (stop_late and q_fail[q] == 0 and dq_i[dq_i[item, DQ_C0], DQ_MODE] == DM_E2E
                            and not _children_in_time(A, F, item, now, span, arr_m, dq_i, dq_f, m_c0, m_cm,
                                                      m_n, m_order, m_glue, m_share, rest_tmp)):
                        q_fail[q] = Q_FAIL_SPAWN
                    if q_fail[q] == 0 or not stop_late:
                        c0 = dq_i[item, DQ_C0]
                        c1 = c0 + dq_i[item, DQ_NC]
                        for c in range(c0, c1):
                            m = arr_m[c]
                            arr_t[c] = now
                            mode = dq_i[c, DQ_MODE]
                            if mode == DM_REL:
                                dl = now + dq_f[c, DF_DC]
                            elif mode == DM_E2E:
                                k = 0  # its siblings of the same stage arrive with it
                                for c2 in range(c0, c1):
                                    if arr_m[c2] == m:
                                        k += 1
                                dl = dq_f[c, DF_DL] - max(dq_f[c, DF_DC], _rest(
                                    A, F, m, k, now, span, m_c0, m_cm, m_n, m_order, m_glue, m_share, rest_tmp))
                            else:
                                dl = dq_f[c, DF_DC]
                            st = K.submit(A, c, m, now, dl, arr_p[c])
                            if st != OK:  # an array is full: the children from c on arrive again
                                arr_t[c] = INF  # once it has grown
                                dq_i[item, DQ_NC] -= c - dq_i[item, DQ_C0]
                                dq_i[item, DQ_C0] = c
                                ev_push(si, et, es, ex, now, EV_SPAWN, item)
                                si[I_EVENTS] -= 1
                                return st
                        si[I_NEED_DECIDE] = 1
                elif kind == EV_TIMER:
                    if v_timer[item] == now:
                        v_timer[item] = INF
                        _try_start(si, sf, now, item, v_head, v_run, v_timer, v_busy, j_next, bi,
                                   bhf, v_pool, lat, et, es, ex)
                elif kind == EV_READY:
                    b = item // Kd
                    k = item % Kd
                    v = bhi[b, k, HI_V]
                    if k > 0 and bhi[b, k, HI_UP] >= 0:
                        a = bhf[b, k, HF_TX]
                        _buffer_report(si, rb_h, rb_f, bhi[b, k, HI_UP], a, now)
                        _buffer_report(si, rb_h, rb_f, bhi[b, k, HI_DOWN], a, now)
                    _enqueue_job(si, item, v, v_head, j_next, bhf)
                    _try_start(si, sf, now, v, v_head, v_run, v_timer, v_busy, j_next, bi, bhf,
                               v_pool, lat, et, es, ex)
                else:  # EV_END
                    b = item // Kd
                    k = item % Kd
                    v = bhi[b, k, HI_V]
                    v_run[v] = -1
                    start = bhf[b, k, HF_START]
                    _buffer_report(si, rb_h, rb_f, bhi[b, k, HI_INFER], start, now)
                    bs = bi[b, BI_BS]
                    share = (now - start) / bs  # GPU time per request, for the invalid rate
                    for i in range(bs):
                        r_gpu[breq[b, i]] += share
                    if sf[G_TL_LO] <= start < sf[G_TL_HI]:
                        n = si[I_TL_N]
                        if n < tl_i.shape[0]:
                            tl_i[n, 0] = v
                            tl_i[n, 1] = bi[b, BI_MODEL]
                            tl_i[n, 2] = bs
                            tl_f[n, 0] = start
                            tl_f[n, 1] = now
                        si[I_TL_N] = n + 1
                    if k + 1 < bi[b, BI_NHOPS]:
                        T = bhf[b, k + 1, HF_T]
                        j2 = item + 1
                        if T > 0.0:
                            v2 = bhi[b, k + 1, HI_V]
                            ask = now
                            if si[I_NIC] != 0:  # paced like an inference: not before its slot
                                ask = max(now, bhf[b, k + 1, HF_TX])
                            tx = _transfer(si, sf, now, ask, 2 * v_server[v], 2 * v_server[v2] + 1,
                                           T, nic_s, nic_e, nic_n, nic_busy)
                            bhf[b, k + 1, HF_TX] = tx
                            bhf[b, k + 1, HF_READY] = tx + T
                            ev_push(si, et, es, ex, tx + T, EV_READY, j2)
                        else:
                            v2 = bhi[b, k + 1, HI_V]
                            bhf[b, k + 1, HF_READY] = now
                            _enqueue_job(si, j2, v2, v_head, j_next, bhf)
                            _try_start(si, sf, now, v2, v_head, v_run, v_timer, v_busy, j_next,
                                       bi, bhf, v_pool, lat, et, es, ex)
                    else:
                        if bi[b, BI_FINAL] != 0:
                            for i in range(bs):
                                rid = breq[b, i]
                                _end_request(si, rid, now, dq_f, arr_m, r_state,
                                             r_end, miss, miss_allow, R_SERVED)
                                q = dq_i[rid, DQ_QUERY]
                                if q >= 0:
                                    if now > dq_f[rid, DF_DL] + LATE_EPS_US:
                                        _query_failed(A, si, rid, now, arr_t, arr_m, dq_i, qm0, qm,
                                                      q_fail, r_state, Q_FAIL_LATE)
                                    if dq_i[rid, DQ_NC] > 0 and (q_fail[q] == 0 or not stop_late):
                                        ev_push(si, et, es, ex, now + m_glue[arr_m[dq_i[rid, DQ_C0]]],
                                                EV_SPAWN, rid)
                        bi[b, BI_NEXT] = si[I_BFREE]
                        si[I_BFREE] = b
                        si[I_INFL] -= 1
                    _try_start(si, sf, now, v, v_head, v_run, v_timer, v_busy, j_next, bi, bhf,
                               v_pool, lat, et, es, ex)
                si[I_PHASE] = PH_FLUSH
            elif t_arr <= t_wake and t_arr <= t_gc:
                sf[G_NOW] = t_arr
                si[I_PHASE] = PH_SUBMIT
            elif t_wake <= t_gc:
                sf[G_NOW] = t_wake
                si[I_NEED_DECIDE] = 1
                si[I_PHASE] = PH_DECIDE
            else:
                sf[G_NOW] = t_gc
                K.gc(A, t_gc - sf[G_GC_LAG])
                sf[G_NEXT_GC] = t_gc + sf[G_GC_EVERY]
        elif ph == PH_SUBMIT:
            ai = si[I_AI]
            while ai < n_arr and arr_t[ai] == now:
                m = arr_m[ai]
                if dq_i[ai, DQ_MODE] == DM_E2E:
                    dl = dq_f[ai, DF_DL] - max(dq_f[ai, DF_DC], _rest(
                        A, F, m, 1, now, dq_f[ai, DF_DL] - now, m_c0, m_cm, m_n, m_order, m_glue, m_share, rest_tmp))
                else:
                    dl = dq_f[ai, DF_DC]
                st = K.submit(A, ai, m, now, dl, arr_p[ai])
                if st != OK:
                    return st
                ai += 1
                si[I_AI] = ai
            si[I_NEED_DECIDE] = 1
            si[I_PHASE] = PH_DECIDE
        elif ph == PH_FLUSH:
            n = si[I_RB_N]
            if n > 0:
                for i in range(si[I_RB_I], n):
                    st = K.report(A, rb_h[i], rb_f[i, 0], rb_f[i, 1])
                    if st != OK:
                        si[I_RB_I] = i
                        return st
                si[I_RB_N] = 0
                si[I_RB_I] = 0
                # a report "matters" when it dirtied a queue (reactive: a claim ended)
                q_dirty = off(A, X_Q_DIRTY)
                for q in range(A[H_Q]):
                    if A[q_dirty + q] != 0:
                        si[I_NEED_DECIDE] = 1
                        break
            si[I_PHASE] = PH_DECIDE
        elif ph == PH_DECIDE:
            if si[I_NEED_DECIDE] != 0:
                fresh = si[I_FRESH] != 0
                if si[I_ORACLE] != 0:
                    # the core's margins are each vGPU's next latency factor: it books exactly
                    o_mg = off(A, X_V_MARGIN)
                    o_hi = off(A, X_V_MARGIN_HI)
                    for v in range(v_fac.shape[0]):
                        if v_fac[v] == v_fac[v]:  # (NaN: a vGPU the oracle leaves to its margins)
                            F[o_mg + v] = v_fac[v]
                            F[o_hi + v] = v_fac[v]
                if reactive:
                    st, _, _, wake = K.decide_reactive(A, now, fresh)
                else:
                    st, _, _, wake = K.decide_ppipe(A, now, fresh)
                if st != OK:
                    si[I_FRESH] = 0
                    return st
                sf[G_WAKE] = wake
                si[I_FRESH] = 1
                si[I_NEED_DECIDE] = 0
                si[I_OUT_D] = 0
                si[I_OUT_X] = 0
                si[I_PHASE] = PH_OUTPUT
            else:
                si[I_PHASE] = PH_EVENT
        else:  # PH_OUTPUT: carry out the decide's drops and dispatches
            nx = A[H_OUT_NX]
            if si[I_OUT_X] < nx:
                ox_rid = off(A, X_OX_RID)
                ox_reason = off(A, X_OX_REASON)
                for x in range(si[I_OUT_X], nx):
                    rid = A[ox_rid + x]
                    _end_request(si, rid, now, dq_f, arr_m, r_state, r_end, miss,
                                 miss_allow, R_SERVED + A[ox_reason + x])
                    _query_failed(A, si, rid, now, arr_t, arr_m, dq_i, qm0, qm, q_fail, r_state, Q_FAIL_DROP)
                si[I_OUT_X] = nx
            nd = A[H_OUT_ND]
            if si[I_OUT_D] < nd:
                od_model = off(A, X_OD_MODEL)
                od_stage = off(A, X_OD_STAGE)
                od_nhops = off(A, X_OD_NHOPS)
                od_final = off(A, X_OD_FINAL)
                od_bs = off(A, X_OD_BS)
                od_req0 = off(A, X_OD_REQ0)
                od_res0 = off(A, X_OD_RES0)
                od_nres = off(A, X_OD_NRES)
                od_path = off(A, X_OD_PATH)
                pk = A[H_K]
                or_handle = off(A, X_OR_HANDLE)
                or_kind = off(A, X_OR_KIND)
                or_hop = off(A, X_OR_HOP)
                or_start = off(A, X_OR_START)
                oq_rid = off(A, X_OQ_RID)
                oq_src = off(A, X_OQ_SRC)
                for d in range(si[I_OUT_D], nd):
                    b = si[I_BFREE]
                    if b < 0:
                        return SIM_FULL_BATCH
                    if si[I_EH_N] + 4 > et.shape[0]:
                        return SIM_FULL_HEAP
                    if si[I_NIC_MAXN] + 2 * Kd + 10 > nic_s.shape[1]:
                        return SIM_FULL_NIC
                    si[I_BFREE] = bi[b, BI_NEXT]
                    si[I_INFL] += 1
                    if si[I_INFL] > si[I_MAX_INFL]:
                        si[I_MAX_INFL] = si[I_INFL]
                    nh = A[od_nhops + d]
                    bs = A[od_bs + d]
                    bi[b, BI_MODEL] = A[od_model + d]
                    bi[b, BI_NHOPS] = nh
                    bi[b, BI_BS] = bs
                    bi[b, BI_FINAL] = A[od_final + d]
                    for k in range(nh):
                        bhi[b, k, HI_V] = A[od_path + d * pk + k]
                        if si[I_ORACLE] != 0:
                            v = bhi[b, k, HI_V]
                            bhf[b, k, HF_FAC] = v_fac[v]
                            if v_fac[v] == v_fac[v]:
                                n = si[I_USES]
                                si[I_USES] = n + 1
                                v_fac[v] = jitter(si[I_SEED], n, sf[G_SIGMA])
                        bhi[b, k, HI_UP] = -1
                        bhi[b, k, HI_DOWN] = -1
                        bhf[b, k, HF_T] = 0.0
                    ready0 = now
                    s0 = A[od_stage + d]
                    r0 = A[od_res0 + d]
                    for r in range(r0, r0 + A[od_nres + d]):
                        k = A[or_hop + r] - s0
                        kd = A[or_kind + r]
                        h = A[or_handle + r]
                        if kd == KIND_INFER:
                            bhi[b, k, HI_INFER] = h
                            bhf[b, k, HF_RS] = F[or_start + r]
                        elif kd == KIND_CLAIM:
                            bhi[b, k, HI_INFER] = h
                            bhf[b, k, HF_RS] = F[or_start + r]
                            ready0 = F[or_start + r]  # the claim starts when its input is in
                        elif kd == KIND_UPLINK:
                            bhi[b, k, HI_UP] = h
                            bhf[b, k, HF_TX] = F[or_start + r]
                            bhf[b, k, HF_T] = tin[v_pool[bhi[b, k, HI_V]], bs - 1]
                        elif kd == KIND_DOWNLINK:
                            bhi[b, k, HI_DOWN] = h
                    q0 = A[od_req0 + d]
                    for i in range(bs):
                        breq[b, i] = A[oq_rid + q0 + i]
                    if ready0 > now and si[I_NIC] != 0:
                        # a reactive claim whose inputs come from other servers: each source
                        # server sends its requests' feature maps over its uplink and this
                        # server's downlink; the batch runs when the last one is in
                        v = bhi[b, 0, HI_V]
                        dst = v_server[v]
                        per = tin[v_pool[v], 0]
                        ready0 = now
                        for i in range(bs):
                            src = A[oq_src + q0 + i]
                            if src < 0 or v_server[src] == dst:
                                continue
                            first = True
                            n = 0
                            for i2 in range(bs):
                                s2 = A[oq_src + q0 + i2]
                                if s2 >= 0 and v_server[s2] == v_server[src]:
                                    if i2 < i:
                                        first = False
                                        break
                                    n += 1
                            if first:
                                tx = _transfer(si, sf, now, now, 2 * v_server[src], 2 * dst + 1,
                                               n * per, nic_s, nic_e, nic_n, nic_busy)
                                ready0 = max(ready0, tx + n * per)
                        bhf[b, 0, HF_RS] = ready0
                    j = b * Kd
                    bhf[b, 0, HF_READY] = ready0
                    if ready0 > now:
                        ev_push(si, et, es, ex, ready0, EV_READY, j)
                    else:
                        v = bhi[b, 0, HI_V]
                        _enqueue_job(si, j, v, v_head, j_next, bhf)
                        _try_start(si, sf, now, v, v_head, v_run, v_timer, v_busy, j_next, bi,
                                   bhf, v_pool, lat, et, es, ex)
                    si[I_OUT_D] = d + 1
            si[I_PHASE] = PH_EVENT
