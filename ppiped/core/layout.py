"""Where every vGPU of a plan sits, and the latency tables the data plane reads.

A plan says how many vGPUs each pool has; it does not say which physical GPU or server they are
on, yet the data plane needs servers (vGPUs of a server share its NIC). :meth:`Layout.from_plan`
decides that deterministically, following the plan's GPU budget rule: each rounding group (a
model's partition index on a type; a partition index on a type across models for plans that
share GPUs) is placed on whole GPUs of its own by :func:`ppiped.packing.pack`, the count the
checker uses, so its pipelines may share a physical GPU when their counts are fractional, and the
groups take consecutive GPUs of the type; then whole GPUs swap servers within their type so that
few transfers wait on a NIC past their model's slack (:mod:`.placement`; ``balance=False``: no
swaps). GPU slot ``g`` of a type sits in server ``g // per_server``.

Ids are dense integers: pipelines in plan order (model by model), pools pipeline by pipeline and
stage by stage, vGPUs pool by pool. Resources are the vGPUs ``0..V-1``, then per server ``s`` its
uplink ``V + 2s`` and downlink ``V + 2s + 1``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from ..packing import pack
from ..plan import Plan, PlanError
from ..profiles import Profile
from .placement import balance_servers, link_loads


class LayoutError(PlanError):
    """The plan's vGPUs do not fit the cluster, or a profile it needs is missing. A
    :class:`PlanError`, so that commands report it as the bad input it is, not as a crash."""


@dataclass
class Layout:
    """Placement and latency tables of one plan; arrays are indexed by the dense ids above.

    Latencies are µs: ``lat[pool, b-1]`` is the inference time of the pool's partition at batch
    size b (inf where not profiled), ``tin[pool, b-1]`` the transfer of its input from the
    previous pool over the NIC (0 for a first pool), ``rem[pool, b-1]`` the sum of ``tin + lat``
    from this pool to the end of its pipeline.
    """

    models: list[str]
    slo_us: np.ndarray
    model_pipe0: np.ndarray  # [M+1] pipelines of model m are model_pipe0[m]..model_pipe0[m+1]-1
    pipe_model: np.ndarray  # [N]
    pipe_index: np.ndarray  # [N] index of the pipeline within its model's plan
    pipe_bs: np.ndarray  # [N] planned batch size
    pipe_pool0: np.ndarray  # [N] first pool
    pipe_npools: np.ndarray  # [N]
    pool_pipe: np.ndarray  # [P]
    pool_stage: np.ndarray  # [P] partition index
    pool_gpu: list[str]  # [P] GPU type name
    pool_split: np.ndarray  # [P]
    pool_blocks: np.ndarray  # [P, 2] block range [start, end)
    pool_v0: np.ndarray  # [P+1] vGPUs of pool p are pool_v0[p]..pool_v0[p+1]-1
    v_pool: np.ndarray  # [V]
    v_model: np.ndarray
    v_pipe: np.ndarray
    v_stage: np.ndarray
    v_gpu_type: np.ndarray  # [V] index into gpu_types
    v_split: np.ndarray
    v_gpu: np.ndarray  # [V] physical GPU id
    v_server: np.ndarray  # [V] server id
    gpu_types: list[str]
    gpu_type: np.ndarray  # [G] type index of each physical GPU
    gpu_server: np.ndarray  # [G]
    server_type: np.ndarray  # [S]
    lat: np.ndarray
    tin: np.ndarray
    rem: np.ndarray
    nic_gbps: float
    rate_rps: np.ndarray | None = None  # [M] planned throughput (the arrival rate the plan expects)

    def planned_gap_us(self) -> np.ndarray:
        """Mean gap between a model's arrivals at its planned throughput (inf: none planned):
        the core's starting estimate of the gap, before arrivals say otherwise."""
        r = self.rate_rps if self.rate_rps is not None else np.zeros(len(self.models))
        with np.errstate(divide="ignore"):
            return np.where(r > 0, 1e6 / np.maximum(r, 1e-300), np.inf)

    def fastest_us(self) -> np.ndarray:
        """Per model, the quickest a request can be served: a batch of one on its quickest
        pipeline from empty tables (inf: no pipeline)."""
        out = np.full(len(self.models), np.inf)
        for m in range(len(self.models)):
            for p in self.pipelines_of(m):
                out[m] = min(out[m], float(self.rem[self.pipe_pool0[p], 0]))
        return out

    @property
    def num_vgpus(self) -> int:
        return len(self.v_pool)

    @property
    def num_servers(self) -> int:
        return len(self.server_type)

    @property
    def num_resources(self) -> int:
        return self.num_vgpus + 2 * self.num_servers

    @property
    def num_pools(self) -> int:
        return len(self.pool_pipe)

    @property
    def num_pipelines(self) -> int:
        return len(self.pipe_model)

    @property
    def max_batch(self) -> int:
        return self.lat.shape[1]

    def uplink(self, server: int) -> int:
        return self.num_vgpus + 2 * server

    def downlink(self, server: int) -> int:
        return self.num_vgpus + 2 * server + 1

    def resource_name(self, r: int) -> str:
        V = self.num_vgpus
        if r < V:
            p = self.v_pool[r]
            return (f"vgpu{r}({self.models[self.v_model[r]]} pipe{self.pipe_index[self.v_pipe[r]]} "
                    f"part{self.v_stage[r]} {self.pool_gpu[p]} 1/{self.v_split[r]} gpu{self.v_gpu[r]} "
                    f"server{self.v_server[r]})")
        s, link = divmod(r - V, 2)
        return f"server{s}.{'down' if link else 'up'}link"

    def pipelines_of(self, model: int) -> range:
        return range(int(self.model_pipe0[model]), int(self.model_pipe0[model + 1]))

    @classmethod
    def from_plan(cls, plan: Plan, profiles: dict[str, Profile], balance: bool = True) -> Layout:
        cl = plan.cluster
        gpu_types = list(cl.gpus)
        tindex = {g: i for i, g in enumerate(gpu_types)}
        models = [m.model for m in plan.models]
        for m in models:
            if m not in profiles:
                raise LayoutError(f"no profile for model {m!r}")
        _check_against_profiles(plan, profiles)
        # dense pipelines and pools
        model_pipe0, pipe_model, pipe_index, pipe_bs, pipe_pool0, pipe_npools = [0], [], [], [], [], []
        pools = []  # (pipe, stage, Partition)
        for mi, m in enumerate(plan.models):
            for pi, p in enumerate(m.pipelines):
                pipe_model.append(mi)
                pipe_index.append(pi)
                pipe_bs.append(p.batch_size)
                pipe_pool0.append(len(pools))
                pipe_npools.append(len(p.partitions))
                for d, q in enumerate(p.partitions):
                    if q.gpu not in tindex:
                        raise LayoutError(f"model {m.model} pipeline {pi}: GPU type {q.gpu!r} is not in the cluster")
                    pools.append((len(pipe_model) - 1, d, q))
            model_pipe0.append(len(pipe_model))
        P = len(pools)
        # servers and GPUs, type by type
        gpu_off, srv_off = {}, {}
        gpu_type, gpu_server, server_type = [], [], []
        for g in gpu_types:
            t = cl.gpus[g]
            gpu_off[g] = len(gpu_type)
            srv_off[g] = len(server_type)
            nsrv = math.ceil(t.count / t.per_server)
            for i in range(t.count):
                gpu_type.append(tindex[g])
                gpu_server.append(srv_off[g] + i // t.per_server)
            server_type.extend([tindex[g]] * nsrv)
        # place vGPUs: each rounding group of the plan's budget rule on whole GPUs of its own
        # (ppiped.packing, the checker's count), groups of a type on consecutive GPUs
        unit = math.lcm(*[q.vgpu_split for _, _, q in pools]) if pools else 1
        for g in gpu_types:  # cheap bound first: packing a plan far too big would take long to fail
            need = sum(q.num_vgpus * (unit // q.vgpu_split) for _, _, q in pools if q.gpu == g)
            if need > cl.gpus[g].count * unit:
                raise LayoutError(f"{plan.source}: the plan's {g} vGPUs need at least {-(-need // unit)} whole GPUs, "
                                  f"the cluster has {cl.gpus[g].count}")
        share = plan.params.share_gpus
        groups: dict[tuple, list[int]] = {}
        for i, (pipe, d, q) in enumerate(pools):
            groups.setdefault((q.gpu, d) if share else (q.gpu, d, pipe_model[pipe]), []).append(i)
        v_gpu_of_pool: list[list[int]] = [[] for _ in range(P)]
        next_gpu = {g: 0 for g in gpu_types}
        for key in sorted(groups, key=lambda k: (tindex[k[0]], *k[1:])):  # index-major, as before
            g, members = key[0], groups[key]
            n, placed = pack([(pools[i][2].vgpu_split, pools[i][2].num_vgpus) for i in members])
            for i, where in zip(members, placed, strict=True):
                v_gpu_of_pool[i] = [gpu_off[g] + next_gpu[g] + j for j in where]
            next_gpu[g] += n
        for g in gpu_types:
            if next_gpu[g] > cl.gpus[g].count:
                rule = "per (partition index, type)" if share else "per (model, partition index, type)"
                raise LayoutError(f"{plan.source}: the plan's {g} vGPUs need {next_gpu[g]} whole GPUs, "
                                  f"placed {rule}; the cluster has {cl.gpus[g].count}")
        if balance:
            # then swap whole GPUs between a type's servers, so that few transfers wait on a
            # NIC past their model's slack (ppiped.core.placement)
            up, down, slack = link_loads(plan, profiles, v_gpu_of_pool, len(gpu_type))
            ranges = [(gpu_off[g], gpu_off[g] + cl.gpus[g].count) for g in gpu_types]
            pos = balance_servers(up, down, slack, np.asarray(gpu_server, dtype=np.int64), ranges)
            v_gpu_of_pool = [[int(pos[x]) for x in gs] for gs in v_gpu_of_pool]
        # vGPU arrays, pool by pool
        pool_v0 = [0]
        cols: dict[str, list[int]] = {k: [] for k in ("pool", "model", "pipe", "stage", "type", "split", "gpu")}
        for i, (pipe, d, q) in enumerate(pools):
            for gid in v_gpu_of_pool[i]:
                cols["pool"].append(i)
                cols["model"].append(pipe_model[pipe])
                cols["pipe"].append(pipe)
                cols["stage"].append(d)
                cols["type"].append(tindex[q.gpu])
                cols["split"].append(q.vgpu_split)
                cols["gpu"].append(gid)
            pool_v0.append(len(cols["pool"]))
        i64 = lambda x: np.asarray(x, dtype=np.int64)  # noqa: E731
        v_gpu = i64(cols["gpu"])
        gpu_server_a = i64(gpu_server)
        # latency tables
        B = max(pipe_bs) if pipe_bs else 1
        lat = np.full((P, B), np.inf)
        tin = np.zeros((P, B))
        for i, (pipe, d, q) in enumerate(pools):
            prof = profiles[models[pipe_model[pipe]]]
            a, e = q.blocks
            mb = prof.max_batch(q.gpu, q.vgpu_split)
            for b in range(1, min(B, mb) + 1):
                lat[i, b - 1] = prof.partition_latency_us(q.gpu, q.vgpu_split, a, e, b)
                if d > 0:
                    tin[i, b - 1] = prof.transfer_us(a, b, cl.nic_gbps)
        rem = tin + lat
        for n in range(len(pipe_model)):
            for k in range(pipe_npools[n] - 2, -1, -1):
                rem[pipe_pool0[n] + k] += rem[pipe_pool0[n] + k + 1]
        return cls(
            models=models,
            slo_us=np.array([m.slo_us for m in plan.models], dtype=np.float64),
            model_pipe0=i64(model_pipe0),
            pipe_model=i64(pipe_model),
            pipe_index=i64(pipe_index),
            pipe_bs=i64(pipe_bs),
            pipe_pool0=i64(pipe_pool0),
            pipe_npools=i64(pipe_npools),
            pool_pipe=i64([p for p, _, _ in pools]),
            pool_stage=i64([d for _, d, _ in pools]),
            pool_gpu=[q.gpu for _, _, q in pools],
            pool_split=i64([q.vgpu_split for _, _, q in pools]),
            pool_blocks=i64([list(q.blocks) for _, _, q in pools]).reshape(P, 2),
            pool_v0=i64(pool_v0),
            v_pool=i64(cols["pool"]),
            v_model=i64(cols["model"]),
            v_pipe=i64(cols["pipe"]),
            v_stage=i64(cols["stage"]),
            v_gpu_type=i64(cols["type"]),
            v_split=i64(cols["split"]),
            v_gpu=v_gpu,
            v_server=gpu_server_a[v_gpu] if len(v_gpu) else i64([]),
            gpu_types=gpu_types,
            gpu_type=i64(gpu_type),
            gpu_server=gpu_server_a,
            server_type=i64(server_type),
            lat=lat,
            tin=tin,
            rem=rem,
            nic_gbps=cl.nic_gbps,
            rate_rps=np.array([m.throughput_rps for m in plan.models], dtype=np.float64),
        )


def _check_against_profiles(plan: Plan, profiles: dict[str, Profile]) -> None:
    """What the data plane needs of a plan beyond :func:`ppiped.plan.validate_plan`: GPU types
    the cluster has at splits it allows, and pipelines that cover the model's profiled blocks in order at a batch
    size and split profiled on each partition's GPU. ``check`` reports these as broken rules; a
    plan served or simulated with them would index past the latency tables or compute nothing
    sensible, so they are refused here, naming the model, pipeline and partition."""
    cl = plan.cluster
    if not any(m.pipelines for m in plan.models):
        raise LayoutError(f"{plan.source}: the plan serves no model on any vGPU (no model has a pipeline)")
    for m in plan.models:
        prof = profiles[m.model]
        for pi, p in enumerate(m.pipelines):
            bs = p.batch_size
            if not p.partitions:
                raise LayoutError(f"{plan.source}: model {m.model}, pipeline {pi}: no partitions")
            nxt = 0
            for qi, q in enumerate(p.partitions):
                w = f"{plan.source}: model {m.model}, pipeline {pi}, partition {qi}"
                a, b = q.blocks
                if q.gpu not in cl.gpus:
                    raise LayoutError(f"{w}: GPU type {q.gpu!r} is not in the cluster "
                                      f"(it has {', '.join(cl.gpus)})")
                if not 0 <= a < b <= prof.num_blocks:
                    raise LayoutError(f"{w}: blocks [{a}, {b}) are not within the profile's "
                                      f"{prof.num_blocks} blocks [0, {prof.num_blocks})")
                if a != nxt:
                    raise LayoutError(f"{w}: blocks [{a}, {b}) do not start where the previous "
                                      f"partition ends (block {nxt})")
                nxt = b
                if prof.max_batch(q.gpu, q.vgpu_split) == 0:
                    have = prof.splits(q.gpu)
                    raise LayoutError(f"{w}: split 1/{q.vgpu_split} of {q.gpu} is not profiled for "
                                      f"{m.model} (profiled splits: {have or 'none, not this GPU'})")
                if q.vgpu_split not in cl.gpus[q.gpu].splits:
                    raise LayoutError(f"{w}: split 1/{q.vgpu_split} of {q.gpu} is not allowed by the cluster "
                                      f"(allowed: {list(cl.gpus[q.gpu].splits)})")
                if not 1 <= bs <= prof.max_batch(q.gpu, q.vgpu_split):
                    raise LayoutError(f"{w}: batch size {bs} is not profiled for {q.gpu} at split "
                                      f"1/{q.vgpu_split} (profiled: 1-{prof.max_batch(q.gpu, q.vgpu_split)})")
                if q.num_vgpus < 1:
                    raise LayoutError(f"{w}: num_vgpus must be at least 1, got {q.num_vgpus}")
                if q.batch_size != bs:  # (check's batch-size-mixed; serving ran every hop at the pipeline's)
                    raise LayoutError(f"{w}: batch size {q.batch_size} differs from the pipeline's {bs}")
            if nxt != prof.num_blocks:
                raise LayoutError(f"{plan.source}: model {m.model}, pipeline {pi}: partitions end at block {nxt}, "
                                  f"the model has {prof.num_blocks}")
