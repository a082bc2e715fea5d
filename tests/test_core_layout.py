"""Placement of the shared PPipe reference plans, and the scheduler on one of them."""

from __future__ import annotations

import math
from collections import defaultdict

import numpy as np
import pytest
from conftest import reference_plans

from ppiped.core import Layout, Scheduler
from ppiped.plan import load_plan

pytestmark = pytest.mark.shared


@pytest.mark.parametrize("algo", ["v4", "bl", "dart-r"])
def test_every_reference_plan_is_placed_within_the_cluster(algo, shared_profiles):
    paths = reference_plans(algo)
    if not paths:
        pytest.skip("../shared/data/ppipe is not present")
    for path in paths:
        plan = load_plan(path)
        lay = Layout.from_plan(plan, shared_profiles)
        pools = [(p, q) for m in plan.models for p in m.pipelines for q in p.partitions]
        assert lay.num_pools == len(pools)
        load = defaultdict(float)
        for i, (pipe, q) in enumerate(pools):
            vs = range(lay.pool_v0[i], lay.pool_v0[i + 1])
            assert len(vs) == q.num_vgpus
            for v in vs:
                assert lay.gpu_types[lay.gpu_type[lay.v_gpu[v]]] == q.gpu
                assert lay.v_server[v] == lay.gpu_server[lay.v_gpu[v]]
                load[int(lay.v_gpu[v])] += 1.0 / q.vgpu_split
            b = pipe.batch_size
            assert lay.lat[i, b - 1] == pytest.approx(q.lat_infer_us, rel=1e-6)
            if lay.pool_stage[i] > 0:
                assert lay.tin[i, b - 1] == pytest.approx(pools[i - 1][1].lat_trans_us, rel=1e-6)
        assert max(load.values()) <= 1.0 + 1e-9, f"{path.name}: a GPU carries more than one GPU of vGPUs"
        for g, t in plan.cluster.gpus.items():
            used = {gpu for gpu in load if lay.gpu_types[lay.gpu_type[gpu]] == g}
            assert len(used) <= t.count
            servers = {int(lay.gpu_server[gpu]) for gpu in used}
            assert len(servers) <= math.ceil(t.count / t.per_server)


def test_a_reference_plan_serves_poisson_load_end_to_end(reference_plan_path, shared_profiles):
    plan = load_plan(reference_plan_path)
    s = Scheduler(plan, shared_profiles)
    lay = s.layout
    rng = np.random.default_rng(1)
    rate = sum(m.throughput_rps for m in plan.models) / 1e6
    t = np.cumsum(rng.exponential(1 / rate, 3000))
    models = rng.integers(0, len(plan.models), len(t))
    ended = set()
    wake = math.inf
    i = 0
    while i < len(t) or wake < math.inf:
        if i < len(t) and t[i] <= wake:
            now = float(t[i])
            s.submit(i, int(models[i]), now)
            i += 1
        else:
            now = wake
        a = s.decide(now)
        wake = a.wake_at
        for d in a.dispatches():
            assert d.finish_us <= min(t[r] + lay.slo_us[models[r]] for r in d.request_ids)
            assert not ended & set(d.request_ids)
            ended |= set(d.request_ids)
        for rid, _ in a.drops():
            assert rid not in ended
            ended.add(rid)
        if i % 100 == 0:
            s.gc(now)
    assert ended == set(range(len(t)))
    st = s.stats()
    assert st["dispatches"] > 0 and st["probes"] >= st["dispatches"]
    assert st["drops"] < 0.2 * len(t)
