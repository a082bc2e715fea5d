"""Candidate pipeline configurations of one model, enumerated before the MILP is built.

A configuration fixes everything about a pipeline except how many vGPUs each of its pools gets:
the cut points, the (GPU type, vGPU split) of every partition, and the batch size. Enumerating
them up front keeps the MILP small and linear (it only picks integer pool sizes), and lets us
drop, before the solver ever sees them, every configuration that misses the SLO or that another
configuration beats on every pool at no loss of granularity.
"""

from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass

import numpy as np
from numba import njit

from ..cluster import Cluster
from ..errors import InputError
from ..plan import PlanParams, batch_delay_us, per_vgpu_throughput_rps, slo_margin_us
from ..profiles import Profile


@dataclass(frozen=True)
class Segment:
    """One partition of a configuration: blocks [start, end) on ``gpu`` at split 1/``split``."""

    start: int
    end: int
    gpu: str
    split: int
    lat_infer_us: float
    lat_trans_us: float
    rps_per_vgpu: float

    @property
    def rps_per_gpu(self) -> float:
        """Throughput per physical GPU, the figure dominance compares."""
        return self.rps_per_vgpu * self.split


@dataclass(frozen=True)
class PipelineConfig:
    """A pipeline shape the MILP may instantiate with any number of vGPUs per partition."""

    model: str
    batch_size: int
    segments: tuple[Segment, ...]
    latency_us: float  # inference + transfers + estimated batching delay
    tied: bool = False  # DART-r: every partition gets the same number of (whole) GPUs

    @property
    def gpus(self) -> tuple[str, ...]:
        return tuple(s.gpu for s in self.segments)


def latency_budget_us(slo_us: float, params: PlanParams) -> float:
    """What inference, transfers and batching may take: the SLO less its margin."""
    return slo_us - slo_margin_us(slo_us, params.slo_margin)


# A configuration is kept when it fits the budget up to this many µs of float noise.
_LAT_EPS_US = 1e-6
# Most configurations one model may enumerate (about 1 KB each before pruning).
MAX_CONFIGS = 5_000_000


def _segment_options(
    profile: Profile, cluster: Cluster, splits: dict[str, tuple[int, ...]]
) -> list[tuple[str, int, int]]:
    """(gpu, split, max batch) for every pool kind the cluster allows and the profile covers."""
    out = []
    for g, gt in cluster.gpus.items():
        if gt.count <= 0 or g not in profile.latency:
            continue
        for v in (v for v in splits.get(g, gt.splits) if v in gt.splits):
            mb = profile.max_batch(g, v)
            if mb > 0:
                out.append((g, v, mb))
    return out


def enumerate_configs(
    profile: Profile,
    cluster: Cluster,
    params: PlanParams,
    slo_us: float,
    rate_rps: float | None,
    max_partitions: int,
    splits: dict[str, tuple[int, ...]] | None = None,
    max_batch: int | None = None,
    deadline: float = math.inf,
) -> list[PipelineConfig]:
    """Every configuration of ``profile`` that meets the SLO, before any dominance pruning.

    ``rate_rps`` is λ of the batching-delay estimate (None: no delay, as when bootstrapping NP).
    ``splits`` restricts the vGPU splits per GPU type (default: what the cluster allows).
    ``deadline`` (``time.perf_counter()``): past it, a clear error instead of an enumeration
    that outlives the plan's time limit (the count grows as blocks^partitions x pool kinds^partitions).
    """
    splits = splits or {}
    opts = _segment_options(profile, cluster, splits)
    budget = latency_budget_us(slo_us, params) + _LAT_EPS_US
    nb = profile.num_blocks
    top_bs = max((mb for _, _, mb in opts), default=0)
    if max_batch is not None:
        top_bs = min(top_bs, max_batch)
    out: list[PipelineConfig] = []
    seg_cache: dict[tuple[int, int, int, int], Segment] = {}
    cuttable = [c for c in range(1, nb) if c not in profile.unsafe_cuts()]  # fp16 hops that keep outputs

    def seg(oi: int, a: int, b: int, bs: int) -> Segment:
        key = (oi, a, b, bs)
        s = seg_cache.get(key)
        if s is None:
            g, v, _ = opts[oi]
            s = Segment(a, b, g, v, profile.partition_latency_us(g, v, a, b, bs),
                        profile.transfer_us(b, bs, cluster.nic_gbps),
                        per_vgpu_throughput_rps(profile, cluster, g, v, a, b, bs))
            seg_cache[key] = s
        return s

    for bs in range(1, top_bs + 1):
        if rate_rps is None:
            delay = 0.0
        elif bs > 1 and rate_rps <= 0:
            continue  # no arrivals: a batch of two never forms
        else:
            delay = batch_delay_us(bs, rate_rps, params.batch_delay_factor)
        room = budget - delay
        if room <= 0:
            continue
        usable = [oi for oi, (_, _, mb) in enumerate(opts) if mb >= bs]
        if not usable:
            continue
        # Each block on its fastest pool kind, summed from block a on: a lower bound on what
        # blocks [a, nb) take however they are cut, used to prune the search.
        per_block = np.min([profile.latency[opts[oi][0]][opts[oi][1]][:, bs - 1] for oi in usable], axis=0)
        fastest_tail = np.r_[np.cumsum(per_block[::-1])[::-1], 0.0]
        for parts in range(1, max_partitions + 1):
            for cuts in itertools.combinations(cuttable, parts - 1):
                bounds = (0, *cuts, nb)
                _chains(seg, usable, bounds, bs, room, fastest_tail, profile.model, delay, out)
                if len(out) > MAX_CONFIGS or time.perf_counter() > deadline:
                    raise InputError(
                        f"{profile.model}: {len(out):,} pipeline configurations enumerated (up to {parts} "
                        f"partitions, batch size {bs}) when the {'time limit passed' if len(out) <= MAX_CONFIGS else f'cap of {MAX_CONFIGS:,} was reached'}"
                        f": lower --max-partitions (now {max_partitions}) or --slo-scale, or raise --time-limit")
    return out


def _chains(seg, usable, bounds, bs, room, fastest_tail, model, delay, out) -> None:
    """Depth-first over pool kinds per partition, cutting branches that cannot meet ``room``."""
    parts = len(bounds) - 1
    stack: list[Segment] = []

    def go(d: int, used: float) -> None:
        if d == parts:
            out.append(PipelineConfig(model, bs, tuple(stack), used + delay))
            return
        a, b = bounds[d], bounds[d + 1]
        for oi in usable:
            s = seg(oi, a, b, bs)
            t = used + s.lat_infer_us + s.lat_trans_us
            if t + fastest_tail[b] > room:
                continue
            stack.append(s)
            go(d + 1, t)
            stack.pop()

    go(0, 0.0)


@njit(cache=True)
def _skyline(g: np.ndarray, v: np.ndarray, order: np.ndarray) -> np.ndarray:
    """The rows of ``order`` (a sweep order, dominators first) no earlier survivor dominates: one
    with at least the throughput and a multiple of the split on every partition. Compiled: the
    same test in numpy cost 10 µs a configuration in call overhead (400,000 took 13 s)."""
    n, k = g.shape
    sky = np.empty(n, dtype=np.int64)
    m = 0
    for a in order:
        dominated = False
        for j in range(m):
            b = sky[j]
            ok = True
            for p in range(k):
                if g[b, p] < g[a, p] or v[b, p] % v[a, p] != 0:
                    ok = False
                    break
            if ok:  # a survivor before it equal in both is earlier: it dominates
                dominated = True
                break
        if not dominated:
            sky[m] = a
            m += 1
    return sky[:m]


def prune_dominated(configs: list[PipelineConfig]) -> list[PipelineConfig]:
    """Drop configurations another one beats on every pool without coarser granularity.

    ``j`` dominates ``i`` when they have the same GPU type at every partition index, each split
    of ``i`` divides the matching split of ``j`` (so any pool of ``i`` can be rebuilt from vGPUs
    of ``j`` on the same physical GPUs), and ``j`` gives at least as much throughput per physical
    GPU on every partition. Any plan using ``i`` then stays feasible, with no less throughput,
    using ``j`` instead; so the optimum survives the pruning.

    Dominance is a strict partial order (ties broken by position), so whatever is dominated is
    dominated by a survivor: each group is swept once in an order that puts every dominator
    before what it dominates (throughput summed over the partitions, then the product of the
    splits, both descending), each configuration tested against the survivors so far only (a
    test against every other one took 50 s for 30,000 configurations).
    """
    groups: dict[tuple[str, ...], list[int]] = {}
    for i, c in enumerate(configs):
        groups.setdefault(c.gpus, []).append(i)
    keep: list[int] = []
    for idx in groups.values():
        g = np.array([[s.rps_per_gpu for s in configs[i].segments] for i in idx])
        v = np.array([[s.split for s in configs[i].segments] for i in idx])
        n = len(idx)
        order = np.lexsort((np.arange(n), -np.prod(v, axis=1), -g.sum(axis=1)))
        keep += [idx[a] for a in _skyline(g, v, order)]
    keep.sort()
    return [configs[i] for i in keep]
