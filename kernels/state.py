"""The scheduler's whole state in one int64 arena, and its typed views.

Why one flat array: numba charges a few hundred ns per array argument at every call from Python,
and a decision must cost a few µs in all. So the state (layout, reservation tables, queues,
scratch, outputs) is one int64 buffer; float sections are read through ``A.view(np.float64)``
at the same offsets. ``A[:HEADER]`` holds dimensions, counters and float parameters at the fixed
indices below, then a table of (offset, length) per section. Compiled code reads section ``k``
as ``A[off(A, k) + i]`` (or ``F[...]`` for float sections, ``F = A.view(np.float64)``) and
indexes 2-D sections by hand (``row * cols + col``); entry points first turn the arena into
owner-less views with :func:`raw`. Measured why: building a numba array view by slicing costs
~30 ns and ``reshape`` ~40 ns, more than a whole slot search; reference counting of owned
arrays took half of a probe; a namedtuple of all views made numba flatten hundreds of arguments
per call and compile for a minute.

Python builds and grows arenas with :class:`Arena`; growth copies every section into the
top-left corner of its larger shape, so compiled code never reallocates.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import njit
from numba.core import cgutils, types
from numba.extending import intrinsic

# Explicit signatures for the compiled functions. Why: without them numba compiles a function
# once more for every literal argument it meets (``_emit_res(..., KIND_UPLINK, ...)``, a
# ``prev = -1`` before a loop), which tripled the compile time of the decision.
I1 = types.int64[::1]
F1 = types.float64[::1]
TB = types.UniTuple(types.int64, 8)  # tables descriptor, see tables.py
DQ = types.UniTuple(types.int64, 5)  # queues descriptor, see depq.py
i8 = types.int64
f8 = types.float64
b1 = types.boolean
none = types.none

VERSION = 1

# --- header: dimensions ------------------------------------------------------------------
H_VERSION = 0
H_V = 1  # vGPUs
H_S = 2  # servers
H_R = 3  # resources = V + 2 S
H_P = 4  # pools
H_N = 5  # pipelines
H_M = 6  # models
H_Q = 7  # queues = M + P
H_B = 8  # largest batch size
H_K = 9  # most pools in a pipeline
H_C = 10  # intervals per reservation table (grows)
H_QC = 11  # slots per queue (grows)
H_SC = 12  # request slots (grows)
H_BR = 13  # batch records (reactive; grows)
H_OD = 14  # output: dispatches per call (grows)
H_OR = 15  # output: reservations per call (grows)
H_OQ = 16  # output: request ids in dispatches per call (grows)
H_OX = 17  # output: drops per call (grows)
# --- header: state and counters ----------------------------------------------------------
H_SEQ = 20  # next reservation sequence number
H_NFREE = 21  # free request slots on the s_free stack
H_BNFREE = 22  # free batch records on the b_free stack
H_POLICY = 23
H_EARLY = 24  # 1: Nexus-style early drop
H_TAKE = 25  # 0: take batch members from the min (earliest-deadline) end
H_PARD = 27  # 1: PARD: proactive drop under overload, high-budget-first for a while after
H_PULL = 26  # 1: executors are work-conserving; an early end pulls the vGPU's queue forward
H_CT_PROBES = 30
H_CT_DECIDE = 31
H_CT_DISPATCH = 32
H_CT_DROP = 33
H_CT_REPORT = 34
H_CT_GC = 35
H_CALL_PROBES = 36
H_CT_RESERVE = 37
H_CT_SHARE_HOLD = 38  # queue passes PARD's NIC share held back
H_OUT_ND = 40
H_OUT_NR = 41
H_OUT_NQ = 42
H_OUT_NX = 43
H_REPORT_DIRTY = 44  # 1: a report changed what a waiting queue could do
# --- header: float parameters (read through the float64 view) -----------------------------
F_MIN_WAIT = 50
F_GUARD = 51
F_LAST_NOW = 52
F_WAKE = 53
F_MARGIN_Q = 54  # quantile of (measured / profiled) latency a vGPU's reservations cover
F_MARGIN_QHI = 57  # the same while the vGPU's model is under pressure (it dropped lately)
F_MARGIN_STEP = 55  # learning rate of that quantile (0: margins stay as set)
F_MARGIN_MAX = 56  # cap on a vGPU's margin
F_MARGIN_PRIOR = 58  # high-quantile margin assumed for a vGPU that has reported fewer than MARGIN_WARM uses
F_CLASS_ROOM = 59  # share of a model's SLO its low class leaves to the high class while both are active
F_PRESSURE_ROOM = 60  # PARD: most of the SLO kept free of bookings while the model is under pressure
F_NOISE_Z = 61  # deadline checks keep this many standard deviations of the path's latency noise (0: none)
F_ROOM_Q = 62  # PARD: quantile of how much later than booked paths end that the learned room covers
F_SHARE_WINDOW = 63  # PARD's NIC share: holds (SLOs) per window of a model's dispatch and arrival counts
SEC_TABLE = 64

POLICY_PPIPE = 0
POLICY_REACTIVE = 1

# statuses returned by the entry points
OK = 0
FULL_TABLE = 1
FULL_OUT = 2
FULL_QUEUE = 3
FULL_SLOTS = 4
FULL_BATCH = 5

# drop reasons
DROP_DEADLINE = 1
DROP_NO_CAPACITY = 2
DROP_EARLY = 3

# kinds of reservations in the output
KIND_INFER = 0
KIND_UPLINK = 1
KIND_DOWNLINK = 2
KIND_CLAIM = 3  # reactive: the vGPU is claimed until reported; not in the tables

# handle = (sequence << HANDLE_SHIFT) | resource
HANDLE_SHIFT = 20
HANDLE_MASK = (1 << HANDLE_SHIFT) - 1

# (name, 'i' int64 | 'f' float64, shape in dimension names); derived: P1 = P + 1, M1 = M + 1,
# K2 = 2 K, TWO = 2.
SECTIONS: tuple[tuple[str, str, tuple[str, ...]], ...] = (
    ("v_server", "i", ("V",)),
    ("v_pool", "i", ("V",)),
    ("v_alive", "i", ("V",)),
    ("pool_v0", "i", ("P1",)),
    ("pool_pipe", "i", ("P",)),
    ("pool_stage", "i", ("P",)),
    ("pool_live", "i", ("P",)),
    ("lat", "f", ("P", "B")),
    ("tin", "f", ("P", "B")),
    ("rem", "f", ("P", "B")),
    ("pipe_model", "i", ("N",)),
    ("pipe_pool0", "i", ("N",)),
    ("pipe_npools", "i", ("N",)),
    ("pipe_bs", "i", ("N",)),
    ("model_pipe0", "i", ("M1",)),
    ("t_start", "f", ("R", "C")),
    ("t_end", "f", ("R", "C")),
    ("t_handle", "i", ("R", "C")),
    ("t_lo", "i", ("R",)),
    ("t_hi", "i", ("R",)),
    ("t_tail", "f", ("R",)),
    ("t_gfrom", "f", ("R",)),
    ("q_heap", "i", ("Q", "QC")),
    ("q_size", "i", ("Q",)),
    ("q_dirty", "i", ("Q",)),
    ("q_wake", "f", ("Q",)),
    ("s_deadline", "f", ("SC",)),
    ("s_arrival", "f", ("SC",)),
    ("s_rid", "i", ("SC",)),
    ("s_prio", "i", ("SC",)),
    ("s_src", "i", ("SC",)),
    ("s_pos", "i", ("SC",)),
    ("s_free", "i", ("SC",)),
    ("v_busy", "i", ("V",)),
    ("pool_idle", "i", ("P",)),
    ("b_handle", "i", ("BR",)),
    ("b_n", "i", ("BR",)),
    ("b_slots", "i", ("BR", "B")),
    ("b_pool", "i", ("BR",)),
    ("b_final", "i", ("BR",)),
    ("b_free", "i", ("BR",)),
    ("pr_vg", "i", ("TWO", "K")),
    ("pr_tx", "f", ("TWO", "K")),
    ("pr_inf", "f", ("TWO", "K")),
    ("pr_tdur", "f", ("TWO", "K")),
    ("pr_ldur", "f", ("TWO", "K")),
    ("tent_r", "i", ("K2",)),
    ("tent_s", "f", ("K2",)),
    ("tent_e", "f", ("K2",)),
    ("scan_v", "i", ("V",)),
    ("scan_ready", "f", ("V",)),
    ("scan_tx", "f", ("V",)),
    ("od_model", "i", ("OD",)),
    ("od_pipe", "i", ("OD",)),
    ("od_stage", "i", ("OD",)),
    ("od_nhops", "i", ("OD",)),
    ("od_final", "i", ("OD",)),
    ("od_bs", "i", ("OD",)),
    ("od_finish", "f", ("OD",)),
    ("od_req0", "i", ("OD",)),
    ("od_res0", "i", ("OD",)),
    ("od_nres", "i", ("OD",)),
    ("od_path", "i", ("OD", "K")),
    ("or_handle", "i", ("OR",)),
    ("or_res", "i", ("OR",)),
    ("or_kind", "i", ("OR",)),
    ("or_hop", "i", ("OR",)),
    ("or_vgpu", "i", ("OR",)),
    ("or_start", "f", ("OR",)),
    ("or_end", "f", ("OR",)),
    ("oq_rid", "i", ("OQ",)),
    ("oq_src", "i", ("OQ",)),
    ("ox_rid", "i", ("OX",)),
    ("ox_reason", "i", ("OX",)),
    ("v_margin", "f", ("V",)),
    ("q_hbf", "f", ("Q",)),  # per model: under pressure (it dropped) until then
    ("m_hold", "f", ("M",)),
    ("v_rh", "i", ("V", "RK")),
    ("v_rlen", "f", ("V", "RK")),
    ("v_margin_hi", "f", ("V",)),
    ("pr_lprof", "f", ("TWO", "K")),
    ("m_last", "f", ("M",)),
    ("m_gap", "f", ("M",)),
    ("v_nrep", "i", ("V",)),
    ("m_hi_until", "f", ("M",)),
    ("v_rfin", "f", ("V", "RK")),
    ("m_room", "f", ("M",)),
    ("m_pgap", "f", ("M",)),
    ("m_pard", "i", ("M",)),
    ("m_share", "f", ("M", "SHARE")),  # the SH_* columns: window, counts, rates, tokens
    ("m_near", "i", ("M", "M")),  # 1 where two models have vGPUs on a common server (share its NIC)
    ("m_room_b", "f", ("M",)),
    ("v_heard", "f", ("V", "TWO")),  # per vGPU: its last report's end, the margins' last relaxation
    ("m_lgap", "f", ("M", "TWO")),  # per model: EWMAs of the arrival gap and its square (sched._long_gap)
)
# section indices, in SECTIONS order (tests check they agree)
X_V_SERVER = 0
X_V_POOL = 1
X_V_ALIVE = 2
X_POOL_V0 = 3
X_POOL_PIPE = 4
X_POOL_STAGE = 5
X_POOL_LIVE = 6
X_LAT = 7
X_TIN = 8
X_REM = 9
X_PIPE_MODEL = 10
X_PIPE_POOL0 = 11
X_PIPE_NPOOLS = 12
X_PIPE_BS = 13
X_MODEL_PIPE0 = 14
X_T_START = 15
X_T_END = 16
X_T_HANDLE = 17
X_T_LO = 18
X_T_HI = 19
X_T_TAIL = 20
X_T_GFROM = 21
X_Q_HEAP = 22
X_Q_SIZE = 23
X_Q_DIRTY = 24
X_Q_WAKE = 25
X_S_DEADLINE = 26
X_S_ARRIVAL = 27
X_S_RID = 28
X_S_PRIO = 29
X_S_SRC = 30
X_S_POS = 31
X_S_FREE = 32
X_V_BUSY = 33
X_POOL_IDLE = 34
X_B_HANDLE = 35
X_B_N = 36
X_B_SLOTS = 37
X_B_POOL = 38
X_B_FINAL = 39
X_B_FREE = 40
X_PR_VG = 41
X_PR_TX = 42
X_PR_INF = 43
X_PR_TDUR = 44
X_PR_LDUR = 45
X_TENT_R = 46
X_TENT_S = 47
X_TENT_E = 48
X_SCAN_V = 49
X_SCAN_READY = 50
X_SCAN_TX = 51
X_OD_MODEL = 52
X_OD_PIPE = 53
X_OD_STAGE = 54
X_OD_NHOPS = 55
X_OD_FINAL = 56
X_OD_BS = 57
X_OD_FINISH = 58
X_OD_REQ0 = 59
X_OD_RES0 = 60
X_OD_NRES = 61
X_OD_PATH = 62
X_OR_HANDLE = 63
X_OR_RES = 64
X_OR_KIND = 65
X_OR_HOP = 66
X_OR_VGPU = 67
X_OR_START = 68
X_OR_END = 69
X_OQ_RID = 70
X_OQ_SRC = 71
X_OX_RID = 72
X_OX_REASON = 73
X_V_MARGIN = 74
X_Q_HBF = 75
X_M_HOLD = 76
X_V_RH = 77  # per vGPU, the handles of its last RK inference reservations (a ring by sequence)
X_V_RLEN = 78  # and their profiled lengths: what a report's margin update compares against
X_V_MARGIN_HI = 79
X_PR_LPROF = 80  # profiled latency of each hop in the probe scratch (PR_LDUR: reserved)
X_M_LAST = 81  # per model: latest arrival seen
X_M_GAP = 82  # per model: mean gap between arrivals (EWMA from the planned rate's gap)
X_V_NREP = 83  # per vGPU: inference reports learned from (its margins are a prior until WARM)
X_M_HI_UNTIL = 84  # per model: the high class counts as active until then
CLASS_HOLD_SLOS = 20.0  # the high class stays active this many SLOs after its last arrival
X_V_RFIN = 85  # per vGPU ring (as V_RH): the booked end of the path if that use was its last hop, else -inf
X_M_ROOM = 86  # per model: the learned room, a high quantile of how much later than booked paths end
X_M_PGAP = 87  # per model: the arrival gap at its planned rate
X_M_PARD = 88  # per model: 1 where PARD's proactive drops and high-budget-first apply (H_PARD set)
X_M_SHARE = 89
X_M_NEAR = 90
X_M_ROOM_B = 91  # per model: the room for bursts within the planned rate, a lower quantile (ROOM_Q_BURST)
X_V_HEARD = 92
X_M_LGAP = 93
MARGIN_STALE_SLOS = 5.0  # a vGPU silent this many SLOs has margins that may be stale ...
MARGIN_RELAX_SLOS = 2.0  # ... and they relax towards the prior with this time constant (see _relax)
SH_W0, SH_N, SH_RATE, SH_TOK, SH_T, SH_NA, SH_ARATE = 0, 1, 2, 3, 4, 5, 6
SHARE_COLS = 7
SHARE_OVER = 1.02  # a capped model may dispatch this much more than its planned rate
SHARE_SHORT = 0.97  # a model under pressure is short below this share of its planned rate
SHARE_BURST = 0.5  # holds of planned arrivals a capped model's bucket holds
ROOM_STEP = 0.01  # learning step of the room, as a share of the SLO
SILENCE_GAPS = 8.0  # a held batch stops waiting after this many mean arrival gaps of silence (sched._quiet_left)
LGAP_STEP = 1.0 / 16.0  # learning step, per arrival, of the length-weighted gap (sched._long_gap)
LGAP_CAP = 4.0  # a gap counts into it as at most this many times its current value (an idle spell is not a tick)
SILENCE_TICKS = 2.0  # a held batch waits through this many length-weighted gaps of silence ...
SILENCE_TICKS_SLO = 0.125  # ... but through no more of them than this share of the SLO
ROOM_Q_BURST = 0.93  # the quantile of the burst room (X_M_ROOM_B); 0.95 until session 25
OVERLOAD_RATE = 1.15  # PARD: a model is overloaded while arrivals run above this x its planned rate
OVERLOAD_EARLY = 0.5  # share of a window after which its running count may show an overload
RK = 16
MARGIN_WARM = 32

SECTION_INDEX = {name: k for k, (name, _, _) in enumerate(SECTIONS)}
HEADER = SEC_TABLE + 2 * len(SECTIONS)
DIM_SLOTS = {"V": H_V, "S": H_S, "R": H_R, "P": H_P, "N": H_N, "M": H_M, "Q": H_Q, "B": H_B,
             "K": H_K, "C": H_C, "QC": H_QC, "SC": H_SC, "BR": H_BR, "OD": H_OD, "OR": H_OR,
             "OQ": H_OQ, "OX": H_OX}

def _dim(dims: dict[str, int], name: str) -> int:
    derived = {"P1": ("P", 1), "M1": ("M", 1)}
    if name in derived:
        base, add = derived[name]
        return dims[base] + add
    if name == "K2":
        return 2 * dims["K"]
    if name == "TWO":
        return 2
    if name == "RK":
        return RK
    if name == "SHARE":
        return SHARE_COLS
    return dims[name]


class Arena:
    """Builds the int64 arena for given dimensions and gives named numpy views of it."""

    def __init__(self, dims: dict[str, int]):
        missing = set(DIM_SLOTS) - set(dims)
        if missing:
            raise ValueError(f"arena dimensions missing: {', '.join(sorted(missing))}")
        self.dims = dict(dims)
        self.shapes = {name: tuple(_dim(self.dims, d) for d in shape) for name, _, shape in SECTIONS}
        size = HEADER
        self.offsets: dict[str, int] = {}
        for name, _, _ in SECTIONS:
            self.offsets[name] = size
            size += int(np.prod(self.shapes[name]))
        self.A = np.zeros(size, dtype=np.int64)
        self.F = self.A.view(np.float64)
        self.A[H_VERSION] = VERSION
        for d, slot in DIM_SLOTS.items():
            self.A[slot] = self.dims[d]
        for k, (name, _, _) in enumerate(SECTIONS):
            self.A[SEC_TABLE + 2 * k] = self.offsets[name]
            self.A[SEC_TABLE + 2 * k + 1] = int(np.prod(self.shapes[name]))

    def view(self, name: str) -> np.ndarray:
        kind = SECTIONS[SECTION_INDEX[name]][1]
        off = self.offsets[name]
        shape = self.shapes[name]
        buf = self.F if kind == "f" else self.A
        return buf[off:off + int(np.prod(shape))].reshape(shape)

    @property
    def nbytes(self) -> int:
        return self.A.nbytes

    def grown(self, **new_dims: int) -> Arena:
        """A copy with some dimensions enlarged; every section keeps its contents."""
        dims = dict(self.dims)
        for k, v in new_dims.items():
            if v < dims[k]:
                raise ValueError(f"arena dimension {k} cannot shrink ({dims[k]} -> {v})")
            dims[k] = v
        new = Arena(dims)
        keep = np.ones(SEC_TABLE, dtype=bool)
        keep[list(DIM_SLOTS.values())] = False
        new.A[:SEC_TABLE][keep] = self.A[:SEC_TABLE][keep]
        for name, _, _ in SECTIONS:
            old = self.view(name)
            new.view(name)[tuple(slice(0, s) for s in old.shape)] = old
        return new


@intrinsic
def _voidptr(typingctx, addr):
    """int64 address -> void*, so that :func:`numba.carray` can wrap it."""
    def codegen(context, builder, signature, args):
        return builder.inttoptr(args[0], cgutils.voidptr_t)
    return types.voidptr(types.int64), codegen


@njit(cache=True, inline="always")
def raw(A):
    """The arena as int64 and float64 arrays without a memory owner.

    Why: numba reference-counts every array it passes around, with an atomic instruction each
    time; inside the probe loop that was half of the run time. Views made by ``carray`` have no
    owner, so the counting disappears. Only valid while ``A`` itself is alive, i.e. during the
    compiled call that made them.
    """
    ptr = _voidptr(A.ctypes.data)
    return numba.carray(ptr, A.shape[0], np.int64), numba.carray(ptr, A.shape[0], np.float64)


@njit(cache=True, inline="always")
def off(A, k):
    """Offset of section ``k`` in the arena (for the int view ``A`` and the float view alike)."""
    return A[SEC_TABLE + 2 * k]


@njit(cache=True, inline="always")
def tables_desc(A):
    """Descriptor of the reservation tables for :mod:`tables`: (start, end, handle, lo, hi, cap,
    tail, gfrom)."""
    return (A[SEC_TABLE + 2 * X_T_START], A[SEC_TABLE + 2 * X_T_END], A[SEC_TABLE + 2 * X_T_HANDLE],
            A[SEC_TABLE + 2 * X_T_LO], A[SEC_TABLE + 2 * X_T_HI], A[H_C], A[SEC_TABLE + 2 * X_T_TAIL],
            A[SEC_TABLE + 2 * X_T_GFROM])


@njit(cache=True, inline="always")
def queues_desc(A):
    """Descriptor of the request queues for :mod:`depq`: (heap, row length, size, key, pos)."""
    return (A[SEC_TABLE + 2 * X_Q_HEAP], A[H_QC], A[SEC_TABLE + 2 * X_Q_SIZE],
            A[SEC_TABLE + 2 * X_S_DEADLINE], A[SEC_TABLE + 2 * X_S_POS])
