"""Plain-Python statement of the data plane's semantics, for tests and debugging only.

It says the same thing as ``kernels/`` in the most direct way: reservation tables are lists,
``earliest_slot`` tries every candidate start (``t`` and every interval end after it) and keeps
the smallest that is free, queues are lists sorted by deadline. It is slow on purpose; the
property tests run both on the same inputs and demand the same decisions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from ..kernels import state as S
from .layout import Layout

INF = math.inf


class RefTables:
    """Busy intervals ``(start, end, handle)`` per resource."""

    def __init__(self, n: int):
        self.rows: list[list[tuple[float, float, int]]] = [[] for _ in range(n)]

    def free(self, r: int, s: float, d: float) -> bool:
        return all(not (a < s + d and s < b) for a, b, _ in self.rows[r])

    def earliest(self, rs: list[int], t: float, d: float) -> float:
        """Smallest candidate start (``t`` or an interval end after it) free on every resource."""
        cands = {t} | {b for r in rs for _, b, _ in self.rows[r] if b > t}
        return min(s for s in cands if all(self.free(r, s, d) for r in rs))

    def insert(self, r: int, s: float, e: float, h: int) -> None:
        assert self.free(r, s, e - s), "reference: overlapping insert"
        self.rows[r].append((s, e, h))
        self.rows[r].sort(key=lambda x: x[0])

    def correct(self, r: int, h: int, a: float, b: float, horizon: float, pull: bool = False) -> None:
        old = [x for x in self.rows[r] if x[2] == h]
        row = [x for x in self.rows[r] if x[2] != h]
        if b > a and b > horizon:
            out = []
            for s, e, hh in row:
                if s < a < e:
                    e = a
                out.append((s, e, hh))
            before = [x for x in out if x[0] < a]
            after = sorted((x for x in out if x[0] >= a), key=lambda x: x[0])
            cur = b
            moved = []
            for s, e, hh in after:
                if s < cur:
                    s, e = cur, cur + (e - s)
                moved.append((s, e, hh))
                cur = max(cur, e)
            if pull and old and b < old[0][1]:
                # work-conserving: the intervals queued right behind the old one start sooner
                old_end, new_end = old[0][1], b
                for i, (s, e, hh) in enumerate(moved):
                    if not (new_end < old_end and abs(s - old_end) <= 1e-6):
                        break
                    moved[i] = (new_end, e - (s - new_end), hh)
                    old_end, new_end = e, e - (s - new_end)
            row = before + [(a, b, h)] + moved
            row.sort(key=lambda x: x[0])
        self.rows[r] = row

    def gc(self, now: float) -> int:
        n = 0
        for r, row in enumerate(self.rows):
            keep = [x for x in row if x[1] > now]
            n += len(row) - len(keep)
            self.rows[r] = keep
        return n


@dataclass
class RefRequest:
    rid: int
    deadline: float
    src: int = -1
    seq: int = 0  # arrival order, for deterministic comparisons only
    prio: int = 0  # > 0: the high class, batched first by the reserving policies


@dataclass
class RefDispatch:
    model: int
    pipeline: int
    stage: int
    path: list[int]
    final: bool
    rids: list[int]
    finish: float
    reservations: list[tuple[int, int, float, float]] = field(default_factory=list)  # (res, kind, s, e)


class RefScheduler:
    """The ppipe and reactive policies, written for clarity. Requests are keyed by deadline;
    when deadlines tie the kernel may order them differently, so tests use distinct deadlines."""

    def __init__(self, layout: Layout, policy: str = "ppipe", min_wait_us: float = 1.0,
                 wait_guard_us: float = 0.0, early_drop: bool = False, margin_quantile: float = 0.9,
                 margin_quantile_hi: float = 0.99, margin_step: float = 0.02, margin_max: float = 4.0,
                 work_conserving: bool = True, pard: bool | Sequence[bool] = False, margin_prior: float = 1.25,
                 class_room: float = 0.25, pressure_room: float = 0.2, noise_z: float = 0.0,
                 room_quantile: float = 0.995, share_window: float = 20.0):
        self.L = layout
        self.policy = policy
        self.min_wait = min_wait_us
        self.guard = wait_guard_us
        self.early = early_drop
        self.T = RefTables(layout.num_resources)
        # per vGPU, the margin at the low quantile (light load) and at the high one (pressure)
        self.margin = [[1.0, 1.0] for _ in range(layout.num_vgpus)]
        self.mqs = (margin_quantile, margin_quantile_hi)
        self.nrep = [0] * layout.num_vgpus  # reports learned from; below 32 the prior stands in
        self.heard = [[0.0, 0.0] for _ in range(layout.num_vgpus)]  # last report's end, last relaxation
        self.prior = margin_prior
        self.noise_z = noise_z
        # per vGPU, (handle, profiled length, booked path end if it was the last hop) of its
        # last 16 inference reservations by sequence
        self.recent = [[(-1, 0.0, -INF)] * 16 for _ in range(layout.num_vgpus)]
        self.mstep, self.mmax = margin_step, margin_max
        self.pull = work_conserving
        M = len(layout.models)
        self.pard = [bool(pard)] * M if isinstance(pard, bool) else [bool(x) for x in pard]
        self.last = [-INF] * len(layout.models)  # latest arrival per model
        self.gap = [float(g) for g in layout.planned_gap_us()]  # mean arrival gap per model (EWMA)
        self.pgap = list(self.gap)  # at the planned rate
        self.lgap = [[0.0, 0.0] for _ in layout.models]  # EWMAs of the gap and its square (_long_gap)
        self.hbf_until = [-INF] * len(layout.models)  # under pressure until (HBF too with pard)
        self.hi_until = [-INF] * len(layout.models)  # the high class is active until
        self.room = class_room
        self.proom_max = pressure_room
        self.room_q = room_quantile
        self.share_window = share_window
        # per model, the learned room kept free of bookings under pressure (µs)
        self.proom = [0.5 * pressure_room * float(x) for x in layout.slo_us]
        self.proom_b = list(self.proom)  # and the burst room, at S.ROOM_Q_BURST
        # per model, the NIC share's state: [window start, dispatched in it, last window's
        # dispatch rate, tokens, tokens' time, arrivals in it, last window's arrival rate]
        planned = [1.0 / g for g in self.pgap]
        self.share = [[0.0, 0.0, r, 1.0, 0.0, 0.0, r] for r in planned]
        servers = [set(int(s) for s, vm in zip(layout.v_server, layout.v_model, strict=True) if vm == m) for m in range(M)]
        self.near = [[bool(a & b) for b in servers] for a in servers]
        self.share_holds = 0  # queue passes the NIC share held back
        M, P = len(layout.models), layout.num_pools
        self.queues: list[list[RefRequest]] = [[] for _ in range(M + P)]
        self.alive = [True] * layout.num_vgpus
        self.busy: dict[int, tuple[int, list[RefRequest], bool]] = {}  # vgpu -> (handle, reqs, final)
        # a queue is decided again only when it changed or its wake time came (as in the kernel)
        self.dirty = [False] * (M + P)
        self.wake = [INF] * (M + P)
        self.seq = 0
        self.handles = 0
        self.last_now = -INF

    # -- helpers --
    def _vgpus(self, pool: int) -> list[int]:
        return [v for v in range(self.L.pool_v0[pool], self.L.pool_v0[pool + 1]) if self.alive[v]]

    def _up(self, s: int) -> int:
        return self.L.num_vgpus + 2 * s

    def _down(self, s: int) -> int:
        return self.L.num_vgpus + 2 * s + 1

    def _long_gap(self, m: int) -> float:
        s1, s2 = self.lgap[m]
        return s2 / s1 if s1 > 0.0 else 0.0

    def _learn_gap(self, m: int, gap: float) -> None:
        """The length-weighted gap's EWMAs, as the kernel's ``_learn_gap``."""
        L = self._long_gap(m) or max(self.gap[m], self.pgap[m])
        g = min(gap, S.LGAP_CAP * L)
        a = 1.0 - S.LGAP_STEP
        s1 = a * self.lgap[m][0] + S.LGAP_STEP * g
        self.lgap[m] = [0.0, 0.0] if s1 < 1e-200 else [s1, a * self.lgap[m][1] + S.LGAP_STEP * g * g]

    def submit(self, rid: int, model: int, deadline: float, arrival: float = 0.0, prio: int = 0) -> None:
        self.seq += 1
        if self.last[model] > -INF:
            gap = max(arrival - self.last[model], 0.0)
            self._learn_gap(model, gap)
            self.gap[model] = gap if self.gap[model] == INF else 0.75 * self.gap[model] + 0.25 * gap
        self.last[model] = max(self.last[model], arrival)
        self.share[model][5] += 1.0
        if self.policy != "ppipe":
            prio = 0
        slo = float(self.L.slo_us[model])
        if prio > 0:
            self.hi_until[model] = max(self.hi_until[model], arrival + 20 * slo)
        elif self.hi_until[model] > arrival:
            deadline -= self.room * slo  # the room left to the high class
        self._push(model, RefRequest(rid, deadline, -1, self.seq, prio))

    def _push(self, q: int, r: RefRequest) -> None:
        self.dirty[q] = True
        self.queues[q].append(r)
        self.queues[q].sort(key=lambda x: (x.deadline, x.seq))

    def probe(self, p: int, b: int, now: float):
        """(finish, waiting, hops) with hops = [(vgpu, transfer start or None, T, infer start, reserved L,
        profiled L)]."""
        L = self.L
        t, prev_s, busy, hops = now, -1, 0.0, []
        hi = int(self._hot(int(L.pipe_model[p]), now))
        var = 0.0
        tent: list[tuple[int, float, float]] = []
        for k in range(int(L.pipe_npools[p])):
            pool = int(L.pipe_pool0[p]) + k
            lat, T = float(L.lat[pool, b - 1]), float(L.tin[pool, b - 1])
            vs = self._vgpus(pool)
            if not vs or not lat < INF:
                return INF, INF, []
            best = None
            for v in vs:
                sv = int(L.v_server[v])
                tx = None
                ready = t
                if k > 0 and sv != prev_s and T > 0:
                    rs = [self._up(prev_s), self._down(sv)]
                    s = t
                    while True:
                        s = self.T.earliest(rs, s, T)
                        clash = [e for r, a, e in tent if r in rs and a < s + T and s < e]
                        if not clash:
                            break
                        s = max(clash)
                    tx = s
                    ready = tx + T
                lv = lat * self.margin[v][hi]
                s = self.T.earliest([v], ready, lv)
                f = s + lv
                # score: when the output can leave (the uplink free for the next transfer after
                # the finish; the finish itself in the last pool); ties: the earlier finish, the
                # vGPU whose server uplink frees first, then the lowest id
                Tn = float(L.tin[pool + 1, b - 1]) if k + 1 < int(L.pipe_npools[p]) else 0.0
                c = self.T.earliest([self._up(sv)], f, Tn) if Tn > 0 else f
                up = self.T.rows[self._up(sv)]
                u = max(max((e for _, e, _ in up), default=-INF), t)
                key = (c, f, u, v)
                if best is None or key < best[0]:
                    best = (key, v, tx, s, lv)
            (_, f, _, _), v, tx, s, lv = best
            sv = int(L.v_server[v])
            if tx is not None:
                tent += [(self._up(prev_s), tx, tx + T), (self._down(sv), tx, tx + T)]
                busy += T
            busy += lv
            hops.append((v, tx, T, s, lv, lat))
            t, prev_s = f, sv
            sd = math.log(max(self.margin[v][1], 1.0)) / 2.3263
            var += sd * sd * lv * (lv + max(s - now, 0.0))
        if self.noise_z > 0.0:
            return t + self.noise_z * math.sqrt(var), t - now - busy, hops
        return t, t - now - busy, hops

    def decide(self, now: float):
        """Returns (dispatches, drops [(rid, reason)], wake_at)."""
        self.last_now = max(self.last_now, now)
        out: list[RefDispatch] = []
        drops: list[tuple[int, str]] = []
        if self.policy == "ppipe":
            for m in range(len(self.L.models)):
                # due within a rounding: the compiled core computes the same wake times in another
                # order, and its last bit decides whether a queue is due when ``now`` is one
                if self.dirty[m] or self.wake[m] <= now + 1e-9 * max(1.0, abs(now)):
                    self.wake[m] = self._ppipe(m, now, out, drops)
                    self.dirty[m] = False
            return out, drops, min(self.wake[:len(self.L.models)])
        for q in range(len(self.queues)):
            if self.dirty[q]:
                self._reactive(q, now, out, drops)
                self.dirty[q] = False
        return out, drops, INF

    def _ppipe(self, m: int, now: float, out, drops) -> float:
        L, q = self.L, self.queues[m]
        while q:
            n = len(q)
            self._share_roll(m, now)
            if self._share_capped(m, now):
                self.share_holds += 1
                return max(now + (1.0 - self.share[m][3]) * self.pgap[m] / S.SHARE_OVER, now + 1.0)
            best = None
            shift = self._room(m, now) if self.pard[m] and self.hbf_until[m] > now else 0.0
            if shift > 0 and self.hi_until[m] > now:
                shift = max(shift - self.room * float(self.L.slo_us[m]), 0.0)
            dh = q[0].deadline - shift
            for p in L.pipelines_of(m):
                f, w, hops = self.probe(p, int(L.pipe_bs[p]), now)
                # least waiting among the pipelines that meet the oldest deadline, if any does
                if f < INF and (best is None or (f <= dh, -w) > (best[0] <= dh, -best[1])):
                    best = (f, w, hops, p)
            if best is None:
                # the low class first, then the high one, each by deadline (the kernel's order)
                drops += [(r.rid, "no-capacity") for r in sorted(q, key=lambda r: r.prio > 0)]
                q.clear()
                return INF
            f_b, w_b, hops_b, p = best
            # the rooms never take more of the SLO than the path leaves from empty tables
            slo = float(L.slo_us[m])
            cls = self.room * slo if q[0].prio <= 0 and self.hi_until[m] > now else 0.0
            give = shift + cls - max(slo - (f_b - now - w_b), 0.0)
            s_hi = s_lo = shift  # a negative s_lo gives back the class room in a low deadline
            if give > 0:
                s_hi, s_lo = max(shift - give, 0.0), shift - give
                # the earliest of the classes' heads, each less its own shift (high ones go first)
                heads = (next((r for r in q if r.prio > 0), None), next((r for r in q if r.prio <= 0), None))
                dh = min(r.deadline - (s_hi if r.prio > 0 else s_lo) for r in heads if r is not None)
            B = int(L.pipe_bs[p])
            chosen, hops, fmin = 0, hops_b, f_b
            pressed = self.hbf_until[m] > now
            keep_full = self.pard[m] and (n > B or (pressed and (n == B or self.gap[m] < self.pgap[m])))
            if f_b <= dh:
                chosen = B
            elif self.early and n < B:  # a short queue takes what is at hand
                f, _, h = self.probe(p, n, now)
                fmin = min(fmin, f)
                if f <= dh:
                    chosen, hops = n, h
            elif not self.early and not keep_full:
                for b in range(B - 1, 0, -1):
                    f, _, h = self.probe(p, b, now)
                    fmin = min(fmin, f)
                    if f <= dh:
                        chosen, hops = b, h
                        break
            if chosen == 0 and not self.early and not (keep_full and pressed):
                # another pipeline may still serve the oldest with the requests at hand
                for p2 in L.pipelines_of(m):
                    if p2 == p:
                        continue
                    for b in range(min(int(L.pipe_bs[p2]), n), 0, -1):
                        f, _, h = self.probe(p2, b, now)
                        fmin = min(fmin, f)
                        if f <= dh:
                            chosen, hops = b, h
                            break
                    if chosen:
                        p = p2
                        break
            if chosen == 0 and keep_full:
                # PARD: overloaded; keep the batch full, drop what it cannot serve in time and
                # take from the high-budget end for the model's SLO
                self.hbf_until[m] = now + float(L.slo_us[m])
                self._drop_before(q, f_b, s_lo, s_hi, "early-drop", drops)
                self._relax(m, now)
                continue
            if chosen == 0:
                self.hbf_until[m] = now + float(L.slo_us[m])
                self._drop_before(q, fmin, s_lo, s_hi, "early-drop" if self.early else "deadline", drops)
                self._relax(m, now)
                continue
            take = chosen
            if n < chosen:
                take = n
                fn, _, hn = self.probe(p, n, now)
                if fn <= dh:
                    # wait only while more requests are expected, and leave the room the
                    # high-quantile margins would take
                    extra = 0.0 if self._hot(m, now) else sum(
                        (self._hi(h[0]) - self.margin[h[0]][0]) * h[5] for h in hn)
                    room = dh - fn - 2.0 * extra
                    slack = room - self.guard
                    if (slack < max(self.min_wait, self.gap[m]) and self.guard > 0.0
                            and (chosen - n) * self.gap[m] <= 0.5 * room and self._overloaded(m, now)):
                        slack = 0.5 * room  # see the kernel's 3b: arrivals fill the batch in time
                    if slack >= self.min_wait and slack >= self.gap[m] and self._worth_waiting(m, p, n, chosen):
                        # not through a silence of SILENCE_GAPS mean gaps (see kernels' _quiet_left)
                        g = max(S.SILENCE_GAPS * max(self.gap[m], self.pgap[m]),
                                min(S.SILENCE_TICKS * self._long_gap(m), S.SILENCE_TICKS_SLO * float(self.L.slo_us[m])))
                        quiet = g - (now - self.last[m])
                        if quiet > 0.0:
                            return now + min(slack, max(quiet, self.min_wait))
                    hops = hn
            # the dispatch's expected end is its last booked hop's (the noise guard is only checked)
            d = RefDispatch(m, p, 0, [h[0] for h in hops], True, [], hops[-1][3] + hops[-1][4])
            prev_s = -1
            for v, tx, T, s, lat, prof in hops:
                sv = int(L.v_server[v])
                if tx is not None:
                    for r, kind in ((self._up(prev_s), 1), (self._down(sv), 2)):
                        self.T.insert(r, tx, tx + T, self._handle(r))
                        d.reservations.append((r, kind, tx, tx + T))
                h = self._handle(v)
                self.T.insert(v, s, s + lat, h)
                self.recent[v][(h >> 20) % 16] = (h, prof, s + lat if v == hops[-1][0] else -INF)
                d.reservations.append((v, 0, s, s + lat))
                prev_s = sv
            hbf = self.pard[m] and self._hot(m, now)
            high = [r for r in q if r.prio > 0][:take]
            low = [r for r in q if r.prio <= 0]
            low = low[::-1] if hbf else low
            d.rids = [r.rid for r in high + low[:take - len(high)]]
            taken = set(d.rids)
            q[:] = [r for r in q if r.rid not in taken]
            out.append(d)
            self.share[m][1] += take
            self.share[m][3] = max(self.share[m][3] - take, 1.0 - take)
        return INF

    def _relax(self, m: int, now: float) -> None:
        """Margins above the prior of the model's vGPUs silent for a while relax towards it (stale after a slow spell)."""
        L = self.L
        slo = float(L.slo_us[m])
        for p in L.pipelines_of(m):
            for pool in range(int(L.pipe_pool0[p]), int(L.pipe_pool0[p]) + int(L.pipe_npools[p])):
                for v in range(int(L.pool_v0[pool]), int(L.pool_v0[pool + 1])):
                    heard, last = self.heard[v]
                    if now - heard <= S.MARGIN_STALE_SLOS * slo or self.margin[v][1] <= self.prior:
                        continue
                    dt = now - max(heard + S.MARGIN_STALE_SLOS * slo, last)
                    if dt > 0:
                        f = math.exp(-dt / (S.MARGIN_RELAX_SLOS * slo))
                        self.margin[v] = [self.prior + (x - self.prior) * f if x > self.prior else x
                                          for x in self.margin[v]]
                        self.heard[v][1] = now

    @staticmethod
    def _drop_before(q: list, f: float, s_lo: float, s_hi: float, reason: str, drops: list) -> None:
        """Drop what a batch ending at ``f`` serves late (deadline less its class's shift), earliest first."""
        gone = [r for r in q if r.deadline - (s_hi if r.prio > 0 else s_lo) < f]
        drops += [(r.rid, reason) for r in gone]
        out = {id(r) for r in gone}
        q[:] = [r for r in q if id(r) not in out]

    def _share_roll(self, m: int, now: float) -> None:
        sh, slo = self.share[m], float(self.L.slo_us[m])
        if now - sh[0] >= self.share_window * slo:
            span = max(now - sh[0], 1.0)
            sh[2], sh[6] = sh[1] / span, sh[5] / span
            sh[0], sh[1], sh[5] = now, 0.0, 0.0
        if self.pgap[m] < INF:
            burst = S.SHARE_BURST * slo / self.pgap[m]
            sh[3] = min(sh[3] + (now - sh[4]) * S.SHARE_OVER / self.pgap[m], max(burst, 1.0))
        sh[4] = now

    def _overloaded(self, m: int, now: float) -> bool:
        """Arrivals above S.OVERLOAD_RATE x the planned rate in the last share window, or in the
        current one once S.OVERLOAD_EARLY of it has passed."""
        if not self.pgap[m] < INF:
            return True
        sh = self.share[m]
        rate, el = sh[6], now - sh[0]
        if el >= S.OVERLOAD_EARLY * self.share_window * float(self.L.slo_us[m]):
            rate = max(rate, sh[5] / el)
        return rate * self.pgap[m] > S.OVERLOAD_RATE

    def _hot(self, m: int, now: float) -> bool:
        """High-quantile margins: under pressure while also overloaded (every policy)."""
        return self.hbf_until[m] > now and self._overloaded(m, now)

    def _room(self, m: int, now: float) -> float:
        return self.proom[m] if self._overloaded(m, now) else self.proom_b[m]

    def _share_capped(self, m: int, now: float) -> bool:
        """PARD holds model m to its planned rate while a model sharing a server with it is
        offered more than it serves and serves under SHARE_SHORT of its planned rate (not while
        m has a high class)."""
        if not self.pard[m] or self.hi_until[m] > now or self.share[m][3] >= 1.0:
            return False
        return any(j != m and self.near[m][j] and self.pgap[j] < INF
                   and sh[2] * self.pgap[j] < S.SHARE_SHORT and sh[6] > 1.02 * sh[2]
                   for j, sh in enumerate(self.share))

    def _worth_waiting(self, m: int, p: int, n: int, b: int) -> bool:
        """Hold n requests for a batch of b only while arrivals exceed half of what batches of n
        could serve on the pipeline's slowest pool."""
        L = self.L
        pools = range(int(L.pipe_pool0[p]), int(L.pipe_pool0[p]) + int(L.pipe_npools[p]))
        eff = min([1.0] + [n * float(L.lat[q, b - 1]) / (b * float(L.lat[q, n - 1])) for q in pools])
        return self.pgap[m] >= 0.5 * eff * self.gap[m]

    def _handle(self, r: int) -> int:
        h = (self.handles << 20) | r
        self.handles += 1
        return h

    def _reactive(self, qi: int, now: float, out, drops) -> None:
        L, q, M = self.L, self.queues[qi], len(self.L.models)
        pools = [int(L.pipe_pool0[p]) for p in L.pipelines_of(qi)] if qi < M else [qi - M]
        while q:
            if not any(self._vgpus(pool) for pool in pools):
                drops += [(r.rid, "no-capacity") for r in q]
                q.clear()
                return
            src = q[0].src
            src_server = int(L.v_server[src]) if src >= 0 else -1
            pick = None
            for pool in pools:
                idle = [v for v in self._vgpus(pool) if v not in self.busy]
                if idle:
                    same = [v for v in idle if int(L.v_server[v]) == src_server]
                    pick = (pool, same[0] if same else idle[0])
                    break
            if pick is None:
                return
            pool, v = pick
            p = int(L.pool_pipe[pool])
            b = min(int(L.pipe_bs[p]), len(q))
            while b >= 1 and now + L.rem[pool, b - 1] > q[0].deadline:
                b -= 1
            if b == 0:
                drops.append((q.pop(0).rid, "deadline"))
                continue
            reqs = [q.pop(0) for _ in range(b)]
            stage = int(L.pool_stage[pool])
            final = stage == int(L.pipe_npools[p]) - 1
            remote = any(r.src >= 0 and L.v_server[r.src] != L.v_server[v] for r in reqs)
            T = float(L.tin[pool, b - 1]) if remote else 0.0
            end = now + T + float(L.lat[pool, b - 1])
            h = self._handle(v)
            self.busy[v] = (h, [] if final else reqs, final)
            out.append(RefDispatch(int(L.pipe_model[p]), p, stage, [v], final, [r.rid for r in reqs], end,
                                   [(v, 3, now + T, end)]))

    def report(self, h: int, a: float, b: float) -> None:
        r = h & ((1 << 20) - 1)
        if self.policy == "ppipe":
            V = self.L.num_vgpus
            horizon = INF if r < V and not self.alive[r] else self.last_now
            self.T.correct(r, h, a, b, horizon, self.pull and r < V)
            if r < V and self.alive[r] and b > a and self.mstep > 0:
                self._learn(r, h, b - a, b)
            return
        if r not in self.busy or self.busy[r][0] != h:
            return
        _, reqs, _ = self.busy.pop(r)
        pool = int(self.L.v_pool[r])
        M = len(self.L.models)
        stage0 = int(self.L.pool_stage[pool]) == 0
        self.dirty[int(self.L.v_model[r]) if stage0 else M + pool] = True  # a vGPU is free
        for req in reqs:
            if b > a:
                req.src = r
                self._push(M + pool + 1, req)
            else:
                self._push(int(self.L.v_model[r]) if stage0 else M + pool, req)

    def _hi(self, v: int) -> float:
        return self.margin[v][1] if self.nrep[v] >= 32 else max(self.margin[v][1], self.prior)

    def _learn(self, v: int, h: int, took: float, end: float) -> None:
        """The margin: a step towards the quantile of measured / profiled latency."""
        hh, prof, fin = self.recent[v][(h >> 20) % 16]
        if hh == h and prof > 0:
            x = took / prof
            self.nrep[v] += 1
            if self.heard[v][1] > self.heard[v][0]:  # the first use since a relaxation sets them
                self.margin[v] = [min(max(x, 1.0), self.mmax)] * 2
            else:
                for i, q in enumerate(self.mqs):
                    m = self.margin[v][i]
                    m *= math.exp(self.mstep * q) if x > m * (1 + 1e-9) else math.exp(-self.mstep * (1 - q))
                    self.margin[v][i] = min(max(m, 1.0), self.mmax)
            self.heard[v][0] = max(self.heard[v][0], end)
            if fin > -INF:  # the last hop of its path: the room learns how late paths end
                self.recent[v][(h >> 20) % 16] = (hh, prof, -INF)
                mi = int(self.L.v_model[v])
                slo = float(self.L.slo_us[mi])
                for rooms, q in ((self.proom, self.room_q), (self.proom_b, S.ROOM_Q_BURST)):
                    r = rooms[mi] + 0.01 * slo * (q if end - fin > rooms[mi] else q - 1.0)
                    rooms[mi] = min(max(r, 0.0), self.proom_max * slo)

    def set_alive(self, v: int, alive: bool) -> None:
        if self.alive[v] == alive:
            return
        if not alive and v in self.busy:
            h = self.busy[v][0]
            self.report(h, 0.0, 0.0)
        self.alive[v] = alive
        self.T.rows[v] = []
        self.dirty = [True] * len(self.dirty)

    def gc(self, now: float) -> int:
        self.last_now = max(self.last_now, now)
        return self.T.gc(now)
