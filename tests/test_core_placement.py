"""Placement of a plan's GPUs on servers: spread for the NIC (ppiped.core.placement)."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from ppiped.cluster import Cluster, GpuType
from ppiped.core import Layout
from ppiped.core.placement import balance_servers, late_transfers, link_loads
from ppiped.plan import ModelPlan, Partition, Pipeline, Plan, PlanParams
from ppiped.profiles import Profile


def _two_models(split: int = 1) -> tuple[Plan, dict[str, Profile]]:
    """``s``: 3 A vGPUs sending 100 µs transfers with 200 µs of slack; ``l``: 5 A vGPUs sending
    200 µs ones with 17 ms of slack; 12 A and 12 B GPUs, 4 per server. Consecutive placement
    puts one of l's A GPUs on s's server."""
    profs, models = {}, []
    for name, nbytes, n, slo in (("s", 1e5, 3, 2300.0), ("l", 2e5, 5, 20_000.0)):
        lat = np.full((2, 1), 1000.0)
        profs[name] = Profile(name, 2, {"A": {split: lat}, "B": {1: lat}}, np.array([nbytes]), {"A": 2000.0, "B": 2000.0})
        parts = [Partition((0, 1), "A", split, n * split, 1000.0, 0.0, 1000.0 * n, 1),
                 Partition((1, 2), "B", 1, n, 1000.0, nbytes * 8 / 8e3, 1000.0 * n, 1)]
        models.append(ModelPlan(name, slo, 1.0, 1000.0 * n, [Pipeline(1, 1000.0 * n, 2100.0, parts)], 1000.0 * n))
    cl = Cluster({"A": GpuType("A", 12, 4, (1, 2)), "B": GpuType("B", 12, 4, (1,))}, 8.0)
    return Plan(cl, PlanParams(), models, 1.0), profs


def _late(plan, profs, lay: Layout) -> float:
    """The objective: transfers per µs planned to wait past their slack, on every link."""
    pools = [[int(g) for g in lay.v_gpu[lay.pool_v0[i]:lay.pool_v0[i + 1]]] for i in range(lay.num_pools)]
    up, down, slack = link_loads(plan, profs, pools, len(lay.gpu_server))
    return late_transfers(up, down, slack, lay.gpu_server)


def _stage_servers(lay: Layout, model: int, stage: int) -> set[int]:
    return {int(lay.v_server[v]) for v in range(lay.num_vgpus) if lay.v_model[v] == model and lay.v_stage[v] == stage}


def test_a_short_slack_model_gets_its_uplink_to_itself():
    plan, profs = _two_models()
    plain = Layout.from_plan(plan, profs, balance=False)
    assert _stage_servers(plain, 0, 0) & _stage_servers(plain, 1, 0)  # sharing, as placed
    lay = Layout.from_plan(plan, profs)
    assert not _stage_servers(lay, 0, 0) & _stage_servers(lay, 1, 0)
    assert _late(plan, profs, lay) < 0.5 * _late(plan, profs, plain)
    # nothing else changes: each vGPU keeps its pool and type, every pool its vGPU count
    assert np.array_equal(lay.v_pool, plain.v_pool) and np.array_equal(lay.v_gpu_type, plain.v_gpu_type)
    assert all(lay.gpu_type[lay.v_gpu[v]] == lay.v_gpu_type[v] for v in range(lay.num_vgpus))
    assert np.array_equal(lay.v_server, lay.gpu_server[lay.v_gpu])


def test_vgpus_that_share_a_gpu_move_together():
    plan, profs = _two_models(split=2)
    plain = Layout.from_plan(plan, profs, balance=False)
    lay = Layout.from_plan(plan, profs)
    pairs = lambda L: sorted(tuple(np.flatnonzero(L.v_gpu == g)) for g in np.unique(L.v_gpu))  # noqa: E731
    assert pairs(lay) == pairs(plain)  # the same vGPUs per physical GPU
    assert not _stage_servers(lay, 0, 0) & _stage_servers(lay, 1, 0)


def test_single_partition_plans_keep_the_plain_placement():
    plan, profs = _two_models()
    for m in plan.models:
        (p,) = m.pipelines
        p.partitions = [Partition((0, 2), "A", 1, p.partitions[0].num_vgpus, 2000.0, 0.0, 500.0, 1)]
    assert np.array_equal(Layout.from_plan(plan, profs).v_gpu, Layout.from_plan(plan, profs, balance=False).v_gpu)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_balancing_permutes_within_a_type_and_never_adds_late_transfers(data):
    types = data.draw(st.lists(st.tuples(st.integers(1, 9), st.integers(1, 4)), min_size=1, max_size=3))
    servers, ranges, g0 = [], [], 0
    s0 = 0
    for count, per in types:
        servers += [s0 + i // per for i in range(count)]
        ranges.append((g0, g0 + count))
        g0 += count
        s0 += -(-count // per)
    G, M = g0, data.draw(st.integers(1, 3))
    rate = st.floats(0.0, 3e-4)

    def rows():
        r = np.zeros((G, 2 + M))
        for g in range(G):
            if data.draw(st.booleans()):
                m, lam, size = data.draw(st.integers(0, M - 1)), data.draw(rate), data.draw(st.floats(10.0, 2000.0))
                r[g] = 0.0
                r[g, 0], r[g, 1], r[g, 2 + m] = lam * size, lam * size * size, lam
        return r

    up, down = rows(), rows()
    slack = np.array([data.draw(st.floats(50.0, 5000.0)) for _ in range(M)])
    srv = np.array(servers, dtype=np.int64)
    pos = balance_servers(up, down, slack, srv, ranges)
    for lo, hi in ranges:
        assert sorted(pos[lo:hi]) == list(range(lo, hi))

    late = late_transfers(up, down, slack, srv, pos)
    assert late <= late_transfers(up, down, slack, srv) * (1 + 1e-9) + 1e-15
    assert np.array_equal(balance_servers(up, down, slack, srv, ranges), pos)  # deterministic


def test_no_swap_puts_two_models_on_a_nic_they_did_not_share():
    """Two models' receivers on servers of their own, one model's links near saturation: moving
    its GPUs beside the other's would cut the planned late transfers, but under overload the
    busier model would then take the other's NIC time (PARD's overload bench lost repvgg's
    goodput that way), so the placement keeps them apart."""
    G = 12
    up = np.zeros((G, 4))
    down = np.zeros((G, 4))
    for g in range(G):
        m, lam, size = (0, 0.24e-3, 1000.0) if g < 8 else (1, 0.05e-3, 300.0)
        down[g, 0], down[g, 1], down[g, 2 + m] = lam * size, lam * size * size, lam
    slack = np.array([5000.0, 2000.0])
    srv = np.arange(G) // 4
    pos = balance_servers(up, down, slack, srv, [(0, G)])
    assert np.array_equal(pos, np.arange(G))
    mixed = np.arange(G)
    mixed[[0, 8]] = mixed[[8, 0]]
    mixed[[4, 9]] = mixed[[9, 4]]
    assert late_transfers(up, down, slack, srv, mixed) < 0.5 * late_transfers(up, down, slack, srv, pos)
    # (what the rule gives up)
