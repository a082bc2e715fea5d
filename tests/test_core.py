"""The compiled scheduler against the plain-Python reference, on random small clusters.

Both are driven in lockstep by one tiny event loop (arrivals, wake-ups, executor reports with
jitter and failures, vGPU failures, GC); every decision must be the same, handle for handle and
µs for µs, and the end-to-end invariants must hold: each request ends exactly once, tables never
overlap, reservations follow the path in time, ppipe dispatches meet their requests' deadlines.
"""

from __future__ import annotations

import dataclasses
import heapq
import math
import random

import numpy as np
import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st
from ppiped.kernels import state as S

from ppiped.cluster import Cluster, GpuType
from ppiped.core import Layout, Scheduler
from ppiped.core.reference import RefScheduler
from ppiped.plan import ModelPlan, Partition, Pipeline, Plan, PlanParams
from ppiped.profiles import Profile

NB = 4  # blocks per synthetic model
MAXB = 3  # profiled batch sizes


def make_case(seed: int, max_parts: int = 3):
    """A random plan on a random two-type cluster, with matching profiles."""
    rnd = random.Random(seed)
    per_server = {"A": rnd.choice([1, 2, 4]), "B": rnd.choice([1, 2])}
    splits = {"A": (1, 2), "B": (1,)}
    profiles, models, need = {}, [], {"A": 0, "B": 0}
    for mi in range(rnd.choice([1, 2])):
        name = f"m{mi}"
        lat = {g: {s: np.array([[rnd.randint(20, 120) * s * (1 + 0.6 * b) for b in range(MAXB)]
                                for _ in range(NB)]) for s in splits[g]} for g in "AB"}
        prof = Profile(name, NB, lat, np.array([float(rnd.randint(500, 8000)) for _ in range(NB - 1)]),
                       {"A": 100.0})
        profiles[name] = prof
        pipes = []
        total = 0.0
        for _ in range(rnd.choice([1, 2])):
            nparts = rnd.randint(1, max_parts)
            cuts = sorted(rnd.sample(range(1, NB), nparts - 1))
            bounds = [0, *cuts, NB]
            bs = rnd.randint(1, MAXB)
            parts = []
            for a, e in zip(bounds, bounds[1:], strict=False):
                g = rnd.choice("AB")
                sp = rnd.choice(splits[g])
                nv = rnd.randint(1, 3)
                need[g] += nv
                li = prof.partition_latency_us(g, sp, a, e, bs)
                lt = prof.transfer_us(e, bs, 1.0)
                total = max(total, li + lt)
                parts.append(Partition((a, e), g, sp, nv, li, lt, 1.0, bs))
            pipes.append(Pipeline(bs, 1.0, 1.0, parts))
        slo = rnd.uniform(3, 8) * sum(prof.partition_latency_us("A", 1, 0, NB, 1) for _ in range(1)) + 500
        models.append(ModelPlan(name, slo, 1.0, 1.0, pipes, 100.0))
    cluster = Cluster({g: GpuType(g, max(1, need[g]), per_server[g], splits[g]) for g in "AB"}, 1.0)
    plan = Plan(cluster, PlanParams(max_partitions=max_parts), models, 1.0)
    return plan, profiles


def _kernel_actions(acts):
    ds = [(d.model, d.pipeline, d.stage, list(d.path), d.final, list(d.request_ids), d.finish_us,
           [(r.handle, r.resource, KIND[r.kind], r.start_us, r.end_us) for r in d.reservations])
          for d in acts.dispatches()]
    return ds, acts.drops(), acts.wake_at


KIND = {"infer": 0, "uplink": 1, "downlink": 2, "claim": 3}


def _ref_actions(ref_out):
    ds, drops, wake = ref_out
    out = []
    for d in ds:
        res = []
        for r, kind, s, e in d.reservations:
            res.append((None, r, kind, s, e))
        out.append((d.model, d.pipeline, d.stage, d.path, d.final, d.rids, d.finish, res))
    return out, drops, wake


def _same(k, r):
    kd, kx, kw = k
    rd, rx, rw = r
    assert kx == rx
    # the wake-up time: the same sums, which a fresh compile may round differently in the last bit
    assert kw == pytest.approx(rw, rel=1e-12, abs=1e-9)
    assert len(kd) == len(rd)
    for a, b in zip(kd, rd, strict=True):
        assert a[:7] == b[:7], (a, b)
        assert [x[1:] for x in a[7]] == [x[1:] for x in b[7]]


def run_lockstep(seed: int, policy: str = "ppipe", n_req: int = 60, fail_vgpu: bool = True,
                 sched_kw: dict | None = None, check_ref: bool = True, high_share: float = 0.0,
                 gap_scale: float = 1.0, refs: list | None = None, planned_share: float | None = None,
                 slow: float = 0.0, spell: float = 0.0):
    """Drive a Scheduler (and the reference) through a random workload, a ``high_share`` of it
    in the high priority class, its arrival gaps scaled by ``gap_scale`` (and the plan's rates
    set to ``planned_share`` of them), the uses reported in the first ``spell`` of it taking
    ``slow`` x their reservation more; returns the log (and appends the reference to ``refs``)."""
    rnd = random.Random(seed * 7919 + 1)
    plan, profiles = make_case(seed)
    kw = sched_kw or {}

    def build(plan):
        sch = Scheduler(plan, profiles, policy, **kw)
        lay = sch.layout
        ref = RefScheduler(lay, "reactive" if policy == "reactive" else "ppipe",
                           early_drop=policy == "ppipe-early-drop",
                           pard=[policy == "pard" and m not in kw.get("pard_exempt", ()) for m in lay.models],
                           noise_z=kw.get("noise_z", 0.0),
                           share_window=kw.get("share_window", 20.0)) if check_ref else None
        return sch, lay, ref

    sch, lay, ref = build(plan)
    M = len(lay.models)
    ev: list = []
    order = 0

    def add(t, kind, payload=None):
        nonlocal order
        order += 1
        heapq.heappush(ev, (t, order, kind, payload))

    t = 0.0
    mean_gap = float(np.min(lay.lat[:, 0])) / max(1, lay.num_vgpus) * rnd.uniform(0.5, 6) * gap_scale
    if planned_share is not None:
        # the plan expects this share of the arrivals (the synthetic plans say 1 request/s)
        rate = planned_share * 1e6 / (mean_gap * M)
        sch, lay, ref = build(dataclasses.replace(
            plan, models=[dataclasses.replace(m, throughput_rps=rate) for m in plan.models]))
    if refs is not None:
        refs.append(ref)
    deadline = {}
    for rid in range(n_req):
        t += rnd.expovariate(1.0 / mean_gap)
        m = rnd.randrange(M)
        deadline[rid] = t + float(lay.slo_us[m]) * rnd.uniform(0.3, 1.2) + rid * 1e-3
        add(t, "arrive", (rid, m, int(rnd.random() < high_share)))
    if fail_vgpu and lay.num_vgpus > 1:
        v = rnd.randrange(lay.num_vgpus)
        t0 = rnd.uniform(0, t)
        add(t0, "down", v)
        add(t0 + rnd.uniform(0, t), "up", v)
    for k in range(1, 8):
        add(t * k / 6, "gc")
    ended: dict[int, str] = {}
    claims: dict[int, int] = {}  # reactive: vgpu -> handle held
    log = []
    wake = math.inf
    while ev or wake < math.inf:
        if ev and ev[0][0] <= wake:
            now, _, kind, payload = heapq.heappop(ev)
        else:
            now, kind, payload = wake, "wake", None
        if kind == "arrive":
            rid, m, prio = payload
            sch.submit(rid, m, now, deadline[rid], priority=prio)
            if ref:
                ref.submit(rid, m, deadline[rid], now, prio)
        elif kind == "report":
            h, a, b = payload
            sch.report(h, a, b)
            if ref:
                ref.report(h, a, b)
            if policy == "reactive":
                v = h & ((1 << 20) - 1)
                if claims.get(v) == h:
                    del claims[v]
        elif kind in ("down", "up"):
            if kind == "down":
                sch.remove_vgpu(payload)
                claims.pop(payload, None)
            else:
                sch.restore_vgpu(payload)
            if ref:
                ref.set_alive(payload, kind == "up")
        elif kind == "gc":
            n = sch.gc(now)
            if ref:
                assert n >= 0
                ref.gc(now)
        acts = sch.decide(now)
        k = _kernel_actions(acts)
        if ref:
            _same(k, _ref_actions(ref.decide(now)))
        wake = acts.wake_at
        assert wake > now
        log.append((now, k))
        for d in acts.dispatches():
            for rid in d.request_ids:
                if d.final:
                    assert rid not in ended, f"request {rid} ended twice"
                    ended[rid] = "dispatched"
            if policy != "reactive":
                _check_path(lay, d, now, deadline)
            for r in d.reservations:
                if r.kind == "claim":
                    assert r.vgpu not in claims, "a vGPU got two batches at once"
                    claims[r.vgpu] = r.handle
                    jit = (rnd.uniform(-0.2, 0.5) + (slow if now < spell * t else 0.0)) * (r.end_us - r.start_us)
                    failed = rnd.random() < 0.05
                    add(r.end_us + jit, "report", (r.handle, r.start_us, r.start_us if failed else r.end_us + jit))
                elif rnd.random() < 0.3:
                    jit = (rnd.uniform(-0.3, 0.6) + (slow if now < spell * t else 0.0)) * (r.end_us - r.start_us)
                    b = r.start_us if rnd.random() < 0.1 else r.end_us + jit
                    add(max(now, r.end_us + jit), "report", (r.handle, r.start_us, b))
        for rid, _why in acts.drops():
            assert rid not in ended, f"request {rid} ended twice"
            ended[rid] = "dropped"
        _check_tables(sch)
    assert sorted(ended) == list(range(n_req)), "every request ends exactly once"
    assert sch.pending() == 0
    return log, sch


def _check_path(lay, d, now, deadline):
    """Hops in order in time, on the right pools, and the batch finishes by every deadline."""
    p = d.pipeline
    assert len(d.path) == lay.pipe_npools[p]
    for k, v in enumerate(d.path):
        assert lay.v_pool[v] == lay.pipe_pool0[p] + k
    prev_end = now
    for k in range(len(d.path)):
        hop = [r for r in d.reservations if r.hop == k]
        tx = [r for r in hop if r.kind != "infer"]
        inf = [r for r in hop if r.kind == "infer"]
        assert len(inf) == 1 and len(tx) in (0, 2)
        if tx:
            assert tx[0].start_us >= prev_end and tx[0].start_us == tx[1].start_us
            assert inf[0].start_us >= tx[0].end_us
        assert inf[0].start_us >= prev_end
        prev_end = inf[0].end_us
    assert prev_end == d.finish_us
    assert all(d.finish_us <= deadline[r] for r in d.request_ids)


def _check_tables(sch):
    for r in range(sch.layout.num_resources):
        row = sch.table(r)
        for (s0, e0, _), (s1, e1, _) in zip(row, row[1:], strict=False):
            assert s0 < e0 <= s1 < e1, f"overlap on {sch.layout.resource_name(r)}: {row}"


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10**6))
def test_ppipe_matches_reference(seed):
    run_lockstep(seed, "ppipe")


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(["ppipe", "pard"]))
def test_noise_guard_matches_reference(seed, policy):
    run_lockstep(seed, policy, sched_kw={"noise_z": 1.5})


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10**6))
def test_reactive_matches_reference(seed):
    run_lockstep(seed, "reactive")


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10**6))
def test_early_drop_matches_reference(seed):
    run_lockstep(seed, "ppipe-early-drop")


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10**6))
def test_pard_matches_reference(seed):
    run_lockstep(seed, "pard")


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10**6))
def test_pard_nic_share_matches_reference(seed):
    """Overloaded, with count windows of half an SLO so that the NIC share's holds happen."""
    run_lockstep(seed, "pard", n_req=300, sched_kw={"share_window": 0.5}, gap_scale=0.2, planned_share=0.5)


def test_pard_nic_share_holds_a_model_back_beside_a_short_one():
    """Some overloaded random cases (two models on a common server) must hold a model back;
    the lockstep runs check that the kernel holds it back alike and every request still ends."""
    holds = 0
    for seed in range(40):
        refs: list = []
        _, sch = run_lockstep(seed, "pard", n_req=300, sched_kw={"share_window": 0.5}, gap_scale=0.2,
                              refs=refs, planned_share=0.5)
        assert sch.stats()["share_holds"] == refs[0].share_holds
        holds += refs[0].share_holds
    assert holds > 0


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10**6))
def test_pard_exempt_models_match_reference(seed):
    """A model exempt from PARD (an app's later stage) batches as PPipe does beside PARD ones."""
    plan, profiles = make_case(seed)
    run_lockstep(seed, "pard", sched_kw={"pard_exempt": [plan.models[0].model]})


def test_pard_is_off_at_later_stages_of_apps():
    from ppiped.query.app import app_from_json

    plan, profiles = make_case(3)
    if len(plan.models) < 2:
        pytest.skip("the case has one model")
    a, b = plan.models[0].model, plan.models[1].model
    plan.apps = [app_from_json({"name": "q", "slo_ms": 1e3, "stages": [
        {"name": "first", "model": a}, {"name": "second", "model": b, "after": "first", "fanout": 2.0,
         "glue": "ppiped.query.example_glue:crop"}]})]
    sch = Scheduler(plan, profiles, "pard")
    flags = dict(zip(sch.layout.models, sch._arena.view("m_pard"), strict=True))
    assert flags[a] == 1 and flags[b] == 0


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(["ppipe", "reactive", "ppipe-early-drop", "pard"]),
       st.sampled_from([0.2, 0.5, 1.0]))
@example(510510, "ppipe", 0.2)  # a low head given back its room stood for a high request's deadline
def test_priority_classes_match_reference(seed, policy, share):
    """Two classes: the kernel's second queue per model and the reference's one sorted list
    agree on every batch, drop and wake-up, under every policy; no batch ends past a deadline."""
    run_lockstep(seed, policy, high_share=share)


@settings(max_examples=10, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(["ppipe", "ppipe-early-drop", "pard"]), st.sampled_from([0.0, 0.3]))
@example(4, "ppipe", 0.0)  # a full row dropped ended intervals a late report then pushed in the reference
def test_slow_spells_match_reference(seed, policy, share):
    """Reports 4 x their reservation late for the first 30 % of the run (margins climb, then relax
    and are set anew): kernel and reference still agree on everything, whatever the table capacity."""
    run_lockstep(seed, policy, n_req=400, high_share=share, gap_scale=0.5, slow=4.0, spell=0.3)


@pytest.mark.parametrize("policy", ["ppipe", "reactive", "pard"])
def test_growing_the_arena_changes_nothing(policy):
    """Tiny initial capacities force every growth path; decisions stay identical."""
    for seed in range(4):
        big, _ = run_lockstep(seed, policy, n_req=80, check_ref=False)
        small, sch = run_lockstep(seed, policy, n_req=80, check_ref=False,
                                  sched_kw=dict(table_capacity=1, queue_capacity=1, request_slots=1))
        assert small == big
        assert sch.stats()["table_capacity"] >= 1


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10**6), st.sampled_from(["ppipe", "reactive", "ppipe-early-drop", "pard"]), st.booleans())
def test_submit_many_is_repeated_submit(seed, policy, tiny):
    """One ``submit_many`` per client message leaves the same state as a ``submit`` per request
    (ties in deadline included, arena growth in the middle of a message included), so every
    later decision is the same too."""
    rnd = random.Random(seed)
    plan, profiles = make_case(seed)
    kw = dict(table_capacity=1, queue_capacity=1, request_slots=1) if tiny else {}
    one, many = Scheduler(plan, profiles, policy, **kw), Scheduler(plan, profiles, policy, **kw)
    lay = one.layout
    rid, t = 0, 0.0
    for _ in range(25):
        t += rnd.uniform(0, float(np.min(lay.lat[:, 0])))
        m = rnd.randrange(len(lay.models))
        n = rnd.randint(0, 6)
        deadline = t + float(lay.slo_us[m]) * rnd.uniform(0.3, 1.2)
        for i in range(n):
            one.submit(rid + i, m, t, deadline)
        many.submit_many(rid, n, m, t, deadline)
        rid += n
        assert np.array_equal(one._A, many._A)
        if rnd.random() < 0.5:
            a, b = _kernel_actions(one.decide(t)), _kernel_actions(many.decide(t))
            assert a == b
            for d in a[0]:  # report every reservation as run, so reactive batches move on
                for h, _, _, s, e in d[7]:
                    one.report(h, s, e)
                    many.report(h, s, e)
    assert np.array_equal(one._A, many._A)
    assert one.pending() == many.pending()


def test_the_noise_guard_grows_with_the_time_booked_ahead_not_with_each_booking():
    """Deadline checks keep z standard deviations of the path's noise: a vGPU's log-sd is read
    off its learned high margin, and the variance of a batch's end adds its own run and the runs
    booked before it on the same vGPU (square-root growth)."""
    plan, profs = _one_pool_case(nv=1, bs=1)
    plain = Scheduler(plan, profs, noise_z=0.0)
    guarded = Scheduler(plan, profs, noise_z=2.0)
    assert guarded.probe(0, 1, 0.0)[0] == plain.probe(0, 1, 0.0)[0]  # nothing learned: no guard
    for s in (plain, guarded):
        s._arena.view("v_margin_hi")[:] = 1.25
    sd = math.log(1.25) / 2.3263
    for k in range(4):  # k batches of 100 µs already booked back to back on the one vGPU
        f0, _, _ = plain.probe(0, 1, 0.0)
        f2, _, _ = guarded.probe(0, 1, 0.0)
        assert f0 == pytest.approx(100.0 * (k + 1))
        assert f2 - f0 == pytest.approx(2.0 * sd * math.sqrt(100.0 * (100.0 + 100.0 * k)))
        for s in (plain, guarded):  # book one more (a far deadline: dispatched at once)
            s.submit(k, 0, 0.0, 1e9)
            assert s.decide(0.0).n_dispatch == 1
    # the dispatch reports its booked end, not the guarded one
    guarded.submit(99, 0, 0.0, 1e9)
    assert guarded.decide(0.0).dispatches()[0].finish_us == pytest.approx(500.0)


def _one_pool_case(nv=2, bs=2, lat=100.0, slo=1000.0, parts=1, rate=None, lat1=None):
    """One model on ``nv`` vGPUs of one type: each block takes ``lat`` at batch 2 and ``lat1``
    (default ``lat / 2``: batching gains nothing) at batch 1."""
    h = lat / 2 if lat1 is None else lat1
    prof = Profile("m", 2, {"A": {1: np.array([[h, lat], [h, lat]])}}, np.array([1000.0]),
                   {"A": lat})
    blocks = [(0, 2)] if parts == 1 else [(0, 1), (1, 2)]
    parts_ = [Partition(b, "A", 1, nv, 1.0, 0.0, 1.0, bs) for b in blocks]
    plan = Plan(Cluster({"A": GpuType("A", nv * parts, 1, (1,))}, 8.0), PlanParams(),
                [ModelPlan("m", slo, 1.0, rate or 1e6 * bs / lat, [Pipeline(bs, 1.0, 1.0, parts_)], 1.0)], 1.0)
    return plan, {"m": prof}


def test_too_few_requests_wait_until_the_last_moment():
    plan, profs = _one_pool_case(nv=1, bs=2, rate=2000.0)  # a planned gap of 500 µs: company may come
    s = Scheduler(plan, profs, noise_z=0.0)  # the noise guard has a test of its own
    s.submit(1, 0, 0.0, 1000.0)
    a = s.decide(0.0)
    assert a.n_dispatch == 0 and a.n_drop == 0
    # bs 1 takes 100 µs on both blocks: latest dispatch at 1000 - 100, less the room for noise:
    # twice the gap between the high-quantile margin (its prior, 1.25, until the vGPU has
    # reported enough uses) and the low one (1.0)
    assert a.wake_at == pytest.approx(1000.0 - 100.0 - 2 * 0.25 * 100.0)
    s.submit(2, 0, 10.0, 2000.0)
    a = s.decide(10.0)  # batch full: dispatch now at the planned size
    (d,) = a.dispatches()
    assert d.request_ids == (1, 2) and d.finish_us == pytest.approx(10.0 + 200.0)
    assert a.wake_at == math.inf


def test_a_held_batch_stops_waiting_through_a_silence():
    """A burst, then silence: the mean gap learns only from arrivals, so it stays short; the
    held partial batch goes once arrivals have been silent for SILENCE_GAPS planned gaps (20,000
    rps planned: 50 µs each), not at its last moment (a 5 s SLO once held one for 4.98 s)."""
    plan, profs = _one_pool_case(nv=2, bs=2, slo=100_000.0)
    s = Scheduler(plan, profs, noise_z=0.0)
    for rid in range(3):  # one message: gaps of 0
        s.submit(rid, 0, 0.0, 100_000.0)
    a = s.decide(0.0)
    (first,) = a.dispatches()
    assert len(first.request_ids) == 2
    assert a.wake_at == pytest.approx(S.SILENCE_GAPS * 50.0)
    a = s.decide(a.wake_at)
    (rest,) = a.dispatches()
    assert sorted(first.request_ids + rest.request_ids) == [0, 1, 2]


def test_a_tick_tail_waits_for_the_next_tick_but_not_through_an_idle_spell():
    """Requests in ticks (5 in one message each millisecond, batches of 2, 20,000 rps planned:
    50 µs gaps): the silence between ticks is their rhythm, so a tick's odd request waits for
    the next tick and every batch leaves full (with 8 mean gaps of silence, it went alone after
    about 830 µs). The last tick's tail goes after a few ticks of silence; after a 1 s idle
    spell, a burst's tail is not held to its deadline either."""
    plan, profs = _one_pool_case(nv=2, bs=2, slo=100_000.0, lat1=70.0)  # batching pays
    s = Scheduler(plan, profs, noise_z=0.0)
    sent = []  # (time, batch size)
    rid = 0

    def serve(t: float, n: int, until: float) -> None:
        nonlocal rid
        for _ in range(n):
            s.submit(rid, 0, t, t + 100_000.0)
            rid += 1
        a = s.decide(t)
        while True:
            sent.extend((t, len(d.request_ids)) for d in a.dispatches())
            if a.wake_at >= until:
                return
            t = a.wake_at
            a = s.decide(t)

    for k in range(31):  # 155 requests: one left over at the end
        serve(1000.0 * k, 5, 1000.0 * (k + 1))
    assert [n for _, n in sent[-40:]] == [2] * 40
    serve(31_000.0, 0, math.inf)
    assert sent[-1][1] == 1 and sent[-1][0] < 41_000.0
    t = 1e6
    serve(t, 5, math.inf)
    assert [n for _, n in sent[-3:]] == [2, 2, 1]
    assert sent[-1][0] - t <= 20_000.0  # the 1 s gap counts as 4 ticks at most: held ~8 ms, not ~100 ms

def test_no_wait_when_no_more_requests_are_expected():
    """Arrivals 5 ms apart against a 1 ms SLO: waiting for a second request gains nothing, so a
    lone request goes at once instead of at the last moment (where noise would make it late)."""
    plan, profs = _one_pool_case(nv=1, bs=2)
    s = Scheduler(plan, profs)
    t = 0.0
    for rid in range(40):
        s.submit(rid, 0, t, t + 1000.0)
        a = s.decide(t)
        if a.n_dispatch == 0:
            a = s.decide(a.wake_at)
        t += 5000.0
    assert a.n_dispatch == 1
    (d,) = a.dispatches()
    assert d.reservations[0].start_us == pytest.approx(t - 5000.0)  # dispatched on arrival


@pytest.mark.parametrize("gap_us, waits", [(400.0, False), (60.0, True)])
def test_hold_only_while_arrivals_need_full_batches(gap_us, waits):
    """Planned for 20,000 req/s at batch 2 (where batch 1 serves as many per vGPU-second). A
    request that could wait for a partner within its slack is held only while arrivals come at
    more than half that rate: at 2,500 /s a lone one goes at once (nothing needs the batching,
    and a held batch is a risk), at 16,700 /s it waits."""
    plan, profs = _one_pool_case(nv=1, bs=2)
    s = Scheduler(plan, profs)
    t, held = 0.0, []
    for rid in range(40):
        s.submit(rid, 0, t, t + 1000.0)
        a = s.decide(t)
        held.append(a.n_dispatch == 0)
        if a.n_dispatch == 0 and s.pending():
            s.cancel(rid, 0)  # keep each arrival alone, so only the rule decides
        t += gap_us
    assert held[-1] is waits


def test_wake_dispatches_a_partial_batch():
    plan, profs = _one_pool_case(nv=1, bs=2)
    s = Scheduler(plan, profs)
    s.submit(1, 0, 0.0, 1000.0)
    w = s.decide(0.0).wake_at
    (d,) = s.decide(w).dispatches()
    assert d.request_ids == (1,) and d.finish_us == pytest.approx(w + 100.0) and d.finish_us < 1000.0


def test_drop_when_no_batch_size_meets_the_deadline():
    plan, profs = _one_pool_case(nv=1, bs=1)
    s = Scheduler(plan, profs)
    s.submit(1, 0, 0.0, 50.0)  # needs 100 µs
    s.submit(2, 0, 0.0, 500.0)
    a = s.decide(0.0)
    assert a.drops() == [(1, "deadline")]
    assert [d.request_ids for d in a.dispatches()] == [(2,)]


@pytest.mark.parametrize("policy", ["ppipe", "pard", "ppipe-early-drop"])
def test_high_class_is_served_first_and_the_low_class_absorbs_the_drops(policy):
    """One vGPU, batch 1, 100 µs each: 4 requests fit before the deadlines. Of 6 low and 3 high
    requests, all with the same budget, the 3 high ones are served and 5 low ones dropped; the
    high class also goes first when its deadlines are later."""
    plan, profs = _one_pool_case(nv=1, bs=1, slo=10_000)
    s = Scheduler(plan, profs, policy, margin_step=0.0, margin_prior=1.0)
    for i in range(6):
        s.submit(i, 0, 0.0, 420.0 + i)
    for i in range(6, 9):
        s.submit(i, 0, 0.0, 430.0 + i, priority=1)
    a = s.decide(0.0)
    served = [r for d in a.dispatches() for r in d.request_ids]
    assert served[:3] == [6, 7, 8]
    assert sorted(served) == [0, 6, 7, 8]
    assert sorted(r for r, _ in a.drops()) == [1, 2, 3, 4, 5]
    assert s.pending() == 0


@pytest.mark.parametrize("policy", ["ppipe", "pard"])
def test_pard_keeps_a_room_free_of_bookings_under_pressure(policy):
    """After a drop (pressure), PARD books against the deadline less the model's room (0.1 SLO
    to start with): a request that fits only inside the room is dropped at once, where ppipe
    books it to end within 70 µs of its deadline."""
    plan, profs = _one_pool_case(nv=1, bs=1, slo=1000.0)
    s = Scheduler(plan, profs, policy, margin_step=0.0, margin_prior=1.0)
    for i in range(3):
        s.submit(i, 0, 0.0, 150.0 + i)
    a = s.decide(0.0)
    assert [d.request_ids for d in a.dispatches()] == [(0,)] and len(a.drops()) == 2
    s.submit(3, 0, 10.0, 270.0)
    a = s.decide(10.0)
    if policy == "pard":
        assert a.drops() == [(3, "early-drop")] and a.n_dispatch == 0
    else:
        (d,) = a.dispatches()
        assert d.request_ids == (3,) and d.finish_us == pytest.approx(200.0)


@pytest.mark.parametrize("policy", ["ppipe", "pard"])
def test_the_class_room_never_takes_what_the_path_needs(policy):
    """SLO 120 µs, a path of 100 µs: the low class's room (0.25 SLO = 30 µs, while the high class
    is active) would leave 90 µs, so every low request, even on empty tables, was dropped (at
    latency noise σ 0.2 the high margins made this so for a whole model at half load). The room
    gives back what the path needs: the low request is served within its own deadline."""
    plan, profs = _one_pool_case(nv=1, bs=1, slo=120.0)
    s = Scheduler(plan, profs, policy, margin_step=0.0, margin_prior=1.0, noise_z=0.0)
    s.submit(0, 0, 0.0, 120.0, priority=1)
    assert [d.request_ids for d in s.decide(0.0).dispatches()] == [(0,)]
    s.submit(1, 0, 1000.0, 1120.0)  # the high class is still active (20 SLOs)
    a = s.decide(1000.0)
    (d,) = a.dispatches()
    assert d.request_ids == (1,) and d.finish_us == pytest.approx(1100.0) and not a.drops()


def test_pard_room_never_takes_what_the_path_needs():
    """After a drop PARD books against the deadline less its room (0.1 SLO); with a path of
    100 µs in an SLO of 105 µs that left no request servable, each drop renewed the pressure,
    and nothing was served again (goodput 67 of 493 req/s at 1.3 x load, σ 0.2). The room is
    capped at what the path leaves: a request arriving to empty tables is served."""
    plan, profs = _one_pool_case(nv=1, bs=1, slo=105.0)
    s = Scheduler(plan, profs, "pard", margin_step=0.0, margin_prior=1.0, noise_z=0.0)
    s.submit(0, 0, 0.0, 50.0)  # needs 100 µs: dropped, and the model is under pressure
    a = s.decide(0.0)
    assert a.n_dispatch == 0 and [r for r, _ in a.drops()] == [0]
    s.submit(1, 0, 10.0, 115.0)  # within the SLO of the drop: the room applies
    a = s.decide(10.0)
    (d,) = a.dispatches()
    assert d.request_ids == (1,) and d.finish_us == pytest.approx(110.0) and not a.drops()


def test_early_drop_wakes_to_the_requests_at_hand():
    """Nexus-style early drop never shrinks a batch for a deadline, but a lone request held for a
    partner (planned batch 2) is all a batch can take when it wakes: it was dropped, and is
    now served at batch size 1 within its deadline, as ppipe serves it."""
    plan, profs = _one_pool_case(nv=1, bs=2)
    s = Scheduler(plan, profs, "ppipe-early-drop")
    s.submit(1, 0, 0.0, 1000.0)
    a = s.decide(0.0)
    assert a.n_dispatch == 0 and not a.drops()
    a = s.decide(a.wake_at)
    (d,) = a.dispatches()
    assert d.request_ids == (1,) and d.finish_us <= 1000.0 and not a.drops()


@pytest.mark.parametrize("q", [None, 0.99])
def test_the_room_learns_how_late_paths_end(q):
    """The room moves towards the ``room_quantile`` (0.995 by default) quantile of how much later
    than booked paths end: up by 1 % of the SLO x q past it, down by 1 % x (1 - q) within it."""
    plan, profs = _one_pool_case(nv=1, bs=1, slo=1000.0, parts=2)
    s = Scheduler(plan, profs, "pard", **({} if q is None else {"room_quantile": q}))
    q = 0.995 if q is None else q
    qb = S.ROOM_Q_BURST
    assert 0.5 < qb < q
    room = s._arena.view("m_room")
    burst = s._arena.view("m_room_b")
    assert room[0] == pytest.approx(100.0)  # half the most (0.2 SLO) to start with
    assert burst[0] == pytest.approx(100.0)
    for i, late in enumerate([300.0, 300.0, 0.0]):
        t = 1000.0 * i
        s.submit(i, 0, t, t + 900.0)
        (d,) = s.decide(t).dispatches()
        before = room[0]
        first, last = sorted((r for r in d.reservations if r.kind == "infer"), key=lambda r: r.hop)
        s.report(first.handle, first.start_us, first.end_us)  # not a last hop: no change
        assert room[0] == before
        before_b = burst[0]
        s.report(last.handle, last.start_us, last.end_us + late)
        if late:  # ended later than booked by more than the room
            assert room[0] == pytest.approx(before + 10.0 * q)
            assert burst[0] == pytest.approx(before_b + 10.0 * qb)  # the burst room: a lower quantile
        else:
            assert room[0] == pytest.approx(before - 10.0 * (1 - q))
            assert burst[0] == pytest.approx(before_b - 10.0 * (1 - qb))


def _pressed_at_rate(policy: str, factor: float, rooms: tuple[float, float] | None = None):
    """A 1-vGPU model fed ``factor`` x its planned rate for 25 ms (past the first 20-SLO count
    window at the plan's rate; past half of it at twice the rate), then a request that cannot
    be served: dropped, so the model is under pressure. Returns the scheduler and that time."""
    plan, profs = _one_pool_case(nv=1, bs=1, slo=1000.0)
    s = Scheduler(plan, profs, policy, margin_step=0.0, margin_prior=1.0)
    if rooms is not None:
        s._arena.view("m_room")[:] = rooms[0]
        s._arena.view("m_room_b")[:] = rooms[1]
    gap = 100.0 / factor  # the plan's rate is one request per 100 µs
    t = 0.0
    for i in range(int(250 * factor)):
        t = i * gap
        s.submit(i, 0, t, t + 1000.0)
        s.decide(t)
    s.submit(10**6, 0, t, t)
    assert s.decide(t).drops()
    return s, t


@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_pard_books_the_burst_room_within_the_planned_rate_and_the_learned_one_above_it(factor):
    """Under pressure PARD books ahead by a room; while arrivals stay within the planned rate it
    is the burst room (a lower quantile), once they run over 1.15 x that rate the learned one."""
    s, t = _pressed_at_rate("pard", factor, rooms=(200.0, 50.0))
    # the estimate is the path's (behind the queue) plus the room
    room = s.stage_estimate_us(0, t) - _estimate_without_room(s, t)
    assert room == pytest.approx(200.0 if factor > 1.15 else 50.0)


@pytest.mark.parametrize("policy", ["ppipe", "pard"])
@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_high_margins_only_under_pressure_while_overloaded(policy, factor):
    """After a drop, a batch is booked at the vGPU's high-quantile margin only while arrivals run
    over 1.15 x the planned rate; at the planned rate the low margin stays (the high one there
    made each drop lengthen the paths and cause more drops: Figure 6 under noise)."""
    s, t = _pressed_at_rate(policy, factor)
    t2 = t + 10_000.0  # the tables have emptied by then; the pressure is held on past t2
    s._arena.view("q_hbf")[0] = t2 + 500.0
    s._arena.view("v_margin")[:] = 1.1  # (set after the drop, which relaxes silent vGPUs' margins)
    s._arena.view("v_margin_hi")[:] = 1.6
    s.submit(10**6 + 1, 0, t2, t2 + 1000.0)
    (d,) = s.decide(t2).dispatches()
    booked = d.finish_us - t2  # one hop of 100 µs at bs 1, booked at the margin in use
    assert booked == pytest.approx(100.0 * (1.6 if factor > 1.15 else 1.1))


@pytest.mark.parametrize("factor", [1.0, 2.0])
def test_pard_takes_the_most_budget_first_only_while_overloaded(factor):
    """After a drop PARD's batches take the requests with the most budget left only while the
    arrivals run over 1.15 x the planned rate; in a burst within the planned rate they keep the
    earliest deadline first (PARD's LBF), which served more in time (Gamma cv 1.5 and 2)."""
    s, t = _pressed_at_rate("pard", factor)
    t2 = t + 10_000.0
    s._arena.view("q_hbf")[0] = t2 + 500.0
    s._arena.view("m_room")[:] = 0.0
    s._arena.view("m_room_b")[:] = 0.0
    s.submit(10**6 + 1, 0, t2, t2 + 1000.0)
    s.submit(10**6 + 2, 0, t2, t2 + 900.0)
    first = min(s.decide(t2).dispatches(), key=lambda d: d.finish_us)
    assert first.request_ids == ((10**6 + 1,) if factor > 1.15 else (10**6 + 2,))


def _estimate_without_room(s, t):
    saved = s._arena.view("q_hbf").copy()
    s._arena.view("q_hbf")[:] = -np.inf
    try:
        return s.stage_estimate_us(0, t)
    finally:
        s._arena.view("q_hbf")[:] = saved


def test_reactive_ignores_the_priority_class():
    plan, profs = _one_pool_case(nv=1, bs=1, slo=10_000)
    s = Scheduler(plan, profs, "reactive")
    s.submit(0, 0, 0.0, 5000.0)
    s.submit(1, 0, 0.0, 6000.0, priority=1)
    assert [d.request_ids for d in s.decide(0.0).dispatches()] == [(0,)]
    assert s.pending(0) == 1 and s.cancel(1, 0) and s.pending() == 0


def test_cancel_finds_a_high_class_request():
    plan, profs = _one_pool_case(nv=1, bs=2)
    s = Scheduler(plan, profs)
    s.submit(0, 0, 0.0, 5000.0, priority=1)
    assert s.pending(0) == 1
    assert s.cancel(0, 0) and not s.cancel(0, 0)
    assert s.pending() == 0


def test_queueing_uses_reserved_slots_and_probe_counts():
    plan, profs = _one_pool_case(nv=2, bs=1, slo=10_000)
    s = Scheduler(plan, profs)
    for i in range(5):
        s.submit(i, 0, 0.0, 10_000.0 + i)
    a = s.decide(0.0)
    ends = sorted(d.finish_us for d in a.dispatches())
    assert ends == pytest.approx([100, 100, 200, 200, 300])
    assert a.probes == 5  # one pipeline at bs 1: one probe per dispatch
    assert s.stats()["probes"] == 5


def test_remove_vgpu_releases_reservations_and_no_capacity():
    plan, profs = _one_pool_case(nv=2, bs=1, slo=10_000)
    s = Scheduler(plan, profs)
    s.submit(0, 0, 0.0, 5000.0)
    (d,) = s.decide(0.0).dispatches()
    v = d.path[0]
    assert s.table(v)
    s.remove_vgpu(v)
    assert s.table(v) == []
    s.submit(1, 0, 1.0, 5000.0)
    (d2,) = s.decide(1.0).dispatches()
    assert d2.path[0] != v
    s.remove_vgpu(d2.path[0])
    s.submit(2, 0, 2.0, 5000.0)
    assert s.decide(2.0).drops() == [(2, "no-capacity")]
    s.restore_vgpu(v)
    s.submit(3, 0, 3.0, 5000.0)
    assert s.decide(3.0).dispatches()[0].path == (v,)


def test_late_report_delays_the_next_reservation():
    plan, profs = _one_pool_case(nv=1, bs=1, slo=10_000)
    s = Scheduler(plan, profs, margin_step=0.0)  # this test is about the push, not the margin
    for i in range(2):
        s.submit(i, 0, 0.0, 10_000.0 + i)
    d0, d1 = s.decide(0.0).dispatches()
    h0 = d0.reservations[0].handle
    s.report(h0, 0.0, 150.0)  # ran 50 µs late
    rows = s.table(d0.path[0])
    assert rows == [(0.0, 150.0, h0), (150.0, 250.0, d1.reservations[0].handle)]
    s.submit(2, 0, 10.0, 10_000.0)
    (d2,) = s.decide(10.0).dispatches()
    assert d2.finish_us == pytest.approx(350.0)


def test_early_end_pulls_the_queue_forward_only_on_work_conserving_executors():
    plan, profs = _one_pool_case(nv=1, bs=1, slo=10_000)
    for wc in (True, False):
        s = Scheduler(plan, profs, margin_step=0.0, work_conserving=wc)
        for i in range(3):
            s.submit(i, 0, 0.0, 10_000.0 + i)
        d0, d1, d2 = s.decide(0.0).dispatches()
        assert [r.start_us for d in (d0, d1, d2) for r in d.reservations] == [0.0, 100.0, 200.0]
        s.report(d0.reservations[0].handle, 0.0, 60.0)  # 40 µs early
        starts = [a for a, _, _ in s.table(d0.path[0])]
        # a FIFO executor that starts whatever it holds as soon as it is free runs the queue 40 µs
        # sooner; one that waits for reserved starts does not
        assert starts == ([0.0, 60.0, 160.0] if wc else [0.0, 100.0, 200.0])


def _serve(s, n, took, t=0.0, rid0=0):
    """Submit ``n`` requests one at a time; each reservation is reported as ``took(vgpu)`` x
    the profiled 100 µs. Returns the time reached."""
    for i in range(n):
        s.submit(rid0 + i, 0, t, t + 1e8)
        for d in s.decide(t).dispatches():
            (r,) = d.reservations
            dur = 100.0 * took(r.vgpu)
            s.report(r.handle, r.start_us, r.start_us + dur)
            t = max(t, r.start_us + dur)
        s.gc(t)
    return t


def test_margin_settles_at_the_quantile_of_measured_over_profiled_latency():
    """Reports of 1.0-1.2 x the profile (uniform): the 0.9 quantile is 1.18, and reservations
    take the profile times that margin."""
    plan, profs = _one_pool_case(nv=1, bs=1, slo=1e9)
    s = Scheduler(plan, profs, margin_quantile=0.9, margin_step=0.02)
    rnd = random.Random(5)
    t = _serve(s, 3000, lambda v: rnd.uniform(1.0, 1.2))
    m = float(s._arena.view("v_margin")[0])
    assert 1.15 < m < 1.21
    s.submit(10**6, 0, t, t + 1e8)
    (d,) = s.decide(t).dispatches()
    (r,) = d.reservations
    assert r.end_us - r.start_us == pytest.approx(100.0 * m)


def test_a_steady_vgpu_wins_over_one_whose_latency_wanders():
    plan, profs = _one_pool_case(nv=2, bs=1, slo=1e9)
    s = Scheduler(plan, profs, margin_step=0.02)
    rnd = random.Random(6)
    _serve(s, 200, lambda v: rnd.uniform(1.0, 1.5) if v == 0 else 1.0)
    m = s._arena.view("v_margin")
    assert m[0] > 1.0 and m[1] == 1.0
    t = 1e7
    s.submit(10**6, 0, t, t + 1e8)
    (d,) = s.decide(t).dispatches()
    assert d.path == (1,)


def test_transfers_reserve_both_nics_only_across_servers():
    plan, profs = _one_pool_case(nv=2, bs=1, slo=10_000, parts=2)
    s = Scheduler(plan, profs)
    lay = s.layout
    s.submit(0, 0, 0.0, 10_000.0)
    (d,) = s.decide(0.0).dispatches()
    a, b = d.path
    kinds = [r.kind for r in d.reservations]
    if lay.v_server[a] == lay.v_server[b]:
        assert kinds == ["infer", "infer"]
    else:
        assert kinds == ["infer", "uplink", "downlink", "infer"]
        up, down = d.reservations[1:3]
        assert up.resource == lay.uplink(int(lay.v_server[a]))
        assert down.resource == lay.downlink(int(lay.v_server[b]))
        assert up.end_us - up.start_us == pytest.approx(1000 * 8 / 8e3)


def test_probe_avoids_a_vgpu_whose_uplink_is_busy():
    """A first-pool vGPU that finishes first but whose output would queue on its server's busy
    uplink loses to one that finishes later on a server whose uplink frees sooner."""
    prof = Profile("m", 2, {"A": {1: np.array([[100.0], [100.0]])}, "B": {1: np.array([[10.0], [10.0]])}},
                   np.array([300_000.0]), {"A": 200.0})  # 300 µs transfer at 8 Gb/s
    parts = [Partition((0, 1), "A", 1, 4, 1.0, 0.0, 1.0, 1), Partition((1, 2), "B", 1, 2, 1.0, 0.0, 1.0, 1)]
    plan = Plan(Cluster({"A": GpuType("A", 4, 2, (1,)), "B": GpuType("B", 2, 1, (1,))}, 8.0), PlanParams(),
                [ModelPlan("m", 100_000.0, 1.0, 1.0, [Pipeline(1, 1.0, 1.0, parts)], 1.0)], 1.0)
    s = Scheduler(plan, {"m": prof})
    assert list(s.layout.v_server[:4]) == [0, 0, 1, 1]
    s.submit(0, 0, 0.0, 100_000.0)
    (d0,) = s.decide(0.0).dispatches()
    assert d0.path[0] == 0
    up0 = next(r for r in d0.reservations if r.kind == "uplink")
    s.report(up0.handle, 100.0, 2000.0)  # server 0's uplink is busy until 2000
    for i, t in ((1, 10.0), (2, 10.0)):  # both vGPUs of server 1 take one
        s.submit(i, 0, t, 100_000.0)
        (d,) = s.decide(t).dispatches()
        assert s.layout.v_server[d.path[0]] == 1
    s.submit(3, 0, 20.0, 100_000.0)
    (d,) = s.decide(20.0).dispatches()
    # vGPU 1 (server 0) would finish at 120 but send only at 2000; vGPU 2 finishes at 210 and
    # sends at 710, after the two transfers already on server 1's uplink
    assert d.path[0] == 2
    assert d.finish_us == pytest.approx(1020.0)


def test_earliest_slot_api():
    plan, profs = _one_pool_case(nv=2, bs=1)
    s = Scheduler(plan, profs)
    s.submit(0, 0, 0.0, 900.0)
    s.decide(0.0)
    v = next(r for r in range(2) if s.table(r))
    assert s.earliest_slot([v], 0.0, 10.0) == 100.0
    assert s.earliest_slot([1 - v], 0.0, 10.0) == 0.0
    assert s.earliest_slot([0, 1], 0.0, 10.0) == 100.0


def test_unknown_policy_and_unimplemented_take():
    plan, profs = _one_pool_case()
    with pytest.raises(ValueError, match="unknown policy"):
        Scheduler(plan, profs, "fifo")
    from ppiped.core import Policy

    with pytest.raises(ValueError, match="not implemented"):
        Scheduler(plan, profs, Policy("pard", take="max"))


@pytest.mark.parametrize("kw", [{"wait_guard_us": math.nan}, {"min_wait_us": math.inf}, {"min_wait_us": -1.0},
                                {"share_window": math.inf}])
def test_the_core_refuses_waits_that_are_not_finite(kw):
    """A NaN guard passed every `v < 0` test and was served with."""
    plan, profs = _one_pool_case()
    with pytest.raises(ValueError, match=next(iter(kw))):
        Scheduler(plan, profs, "ppipe", **kw)


def test_layout_of_a_synthetic_case():
    plan, profs = make_case(3)
    lay = Layout.from_plan(plan, profs)
    for pi, pool in enumerate(lay.pool_pipe):
        assert lay.pool_v0[pi + 1] - lay.pool_v0[pi] > 0
        assert all(lay.v_pool[v] == pi for v in range(lay.pool_v0[pi], lay.pool_v0[pi + 1]))
        assert pool == lay.v_pipe[lay.pool_v0[pi]]


def test_reactive_moves_batches_pool_by_pool_on_reports():
    plan, profs = _one_pool_case(nv=1, bs=1, slo=10_000, parts=2)
    s = Scheduler(plan, profs, "reactive")
    v0, v1 = 0, 1
    s.submit(1, 0, 0.0, 5000.0)
    (d,) = s.decide(0.0).dispatches()
    assert (d.stage, d.path, d.final, d.sources) == (0, (v0,), False, (-1,))
    (claim,) = d.reservations
    assert claim.kind == "claim" and claim.end_us == pytest.approx(50.0)  # block 0 at bs 1
    s.submit(2, 0, 10.0, 5000.0)
    assert s.decide(10.0).n_dispatch == 0  # the first pool's only vGPU is claimed
    s.report(claim.handle, 0.0, 120.0)
    ds = s.decide(120.0).dispatches()
    by_stage = {x.stage: x for x in ds}
    assert by_stage[0].request_ids == (2,) and by_stage[0].path == (v0,)
    assert by_stage[1].request_ids == (1,) and by_stage[1].path == (v1,) and by_stage[1].final
    assert by_stage[1].sources == (v0,)
    # a failed claim sends its requests back to the queue they came from
    s.report(by_stage[0].reservations[0].handle, 120.0, 120.0)
    (again,) = s.decide(121.0).dispatches()
    assert again.request_ids == (2,) and again.stage == 0
    # stale or repeated reports change nothing
    s.report(claim.handle, 0.0, 120.0)
    assert s.decide(122.0).n_dispatch == 0


def test_cancel_withdraws_a_pending_request():
    plan, profs = _one_pool_case(nv=1, bs=2)
    s = Scheduler(plan, profs)
    s.submit(1, 0, 0.0, 1000.0)
    s.submit(2, 0, 0.0, 1001.0)
    assert s.cancel(1, 0)
    assert not s.cancel(1, 0)
    assert s.pending(0) == 1
    w = s.decide(0.0).wake_at
    (d,) = s.decide(w).dispatches()
    assert d.request_ids == (2,)


def test_margins_stale_after_a_slow_spell_relax_and_the_model_is_served_again():
    """A slow spell drives the margins up until no path fits the SLO; nothing is dispatched
    then, so no report can bring them down. Once the vGPUs have been silent for an SLO, every
    drop relaxes their margins towards 1 until a batch fits, whose report then tells the truth.
    (Before, the model stayed unserved for as long as its traffic lasted.) The reference agrees."""
    plan, profs = _one_pool_case(nv=2, bs=1, lat=100.0, slo=300.0)
    s = Scheduler(plan, profs)
    ref = RefScheduler(s.layout, "ppipe")
    t = 0.0
    served = []
    for rid, factor in enumerate([5.0] * 400 + [1.0] * 400):  # one request per 150 µs, a 300 µs SLO
        s.submit(rid, 0, t, t + 300.0)
        ref.submit(rid, 0, t + 300.0, t)
        acts = s.decide(t)
        _same(_kernel_actions(acts), _ref_actions(ref.decide(t)))
        served.append(sum(len(d.request_ids) for d in acts.dispatches()))
        for d in acts.dispatches():
            for r in d.reservations:
                b = r.start_us + 100.0 * factor
                s.report(r.handle, r.start_us, b)
                ref.report(r.handle, r.start_us, b)
        t += 150.0
        s.gc(t - 1000.0)
        ref.gc(t - 1000.0)
    # the slow spell: one batch per vGPU now and then finds out that it goes on
    assert sum(served[300:400]) <= 15, served[300:400]
    assert sum(served[450:]) > 0.95 * 350, sum(served[450:])  # and soon after it, all are served
