"""Which server each of a type's GPUs sits on: spread the planned NIC load so that few
transfers wait past their model's slack.

A server's GPUs share its uplink and downlink, and the data plane books every transfer on both.
Placing a plan's rounding groups on consecutive GPUs (:meth:`Layout.from_plan`) can put the
GPUs of two transfer-heavy groups behind one NIC: on fcn + gfl + wide, V100-T4, fcn's three
V100s shared a server with a gfl V100 whose 3.4 ms transfers held fcn's 0.8 ms ones back, and
fcn kept 99 % attainment only up to load factor 0.87 (0.95 once apart).

:func:`balance_servers` swaps whole GPUs of a type between servers (a vGPU packing stays on its
GPU) while the planned share of transfers that wait past their slack falls. Each link is an
M/G/1 queue at the plan's rates: load rho, mean wait E[W] = sum(rate x size^2) / 2 (1 - rho),
tail P(W > t) ~ rho exp(-rho t / E[W]); a model's slack is its SLO less its slowest pipeline's
path. Why not balance the load alone (tried in session 24: mixed, 0.959 / 0.925 on Figure 6 at
sigma 0 / 0.05): short transfers wait behind long ones in proportion to the long ones' square,
and a model with seconds of slack does not care what a 2 ms one does.

A swap must also not raise the number of pairs of different models whose transfers share the
two servers' NICs. Why: a model alone on its links is held to their capacity under overload.
Without the rule the search spread colorization's saturated L4 downlinks over repvgg's servers
(colorization + googlenet + repvgg 0.39, L4-T4), and at 1.3-2.0 x the planned load colorization
took repvgg's NIC time: repvgg 0.91-0.92 x capacity under PARD, which holds every model at
0.95 otherwise (Figure 6 with the rule: 0.962 / 0.932 at sigma 0 / 0.05, without: 0.964 / 0.934).
"""

from __future__ import annotations

import numba
import numpy as np

# passes over every pair of a type's GPUs at most (the search stops when a pass swaps nothing)
MAX_PASSES = 20
# swaps tried at most, over all types
MAX_EVALS = 2_000_000
# a model uses a link whose summed rate of its transfers is above this (per µs; what sums and
# differences of its GPUs' rates leave behind after it moved away is far below)
PRESENT = 1e-12


def link_loads(plan, profiles, pools_gpus: list[list[int]], num_gpus: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per GPU, its outgoing (uplink) and incoming (downlink) transfers at the plan's rates, as
    rows ``[load, sum rate x size^2, rate of model 0, rate of model 1, ...]`` (rates per µs), and
    each model's slack (µs). ``pools_gpus[i]``: the GPU of each vGPU of pool ``i`` (plan order:
    model, pipeline, partition)."""
    M = len(plan.models)
    up = np.zeros((num_gpus, 2 + M))
    down = np.zeros((num_gpus, 2 + M))
    slack = np.zeros(M)
    i = 0
    for mi, m in enumerate(plan.models):
        prof = profiles[m.model]
        paths = [sum(q.lat_infer_us + q.lat_trans_us for q in p.partitions) for p in m.pipelines]
        slack[mi] = max(m.slo_us - max(paths, default=0.0), 0.02 * m.slo_us)
        for p in m.pipelines:
            batches = p.throughput_rps / p.batch_size * 1e-6
            for d in range(len(p.partitions)):
                gpus = pools_gpus[i]
                i += 1
                if not gpus:
                    continue
                r = batches / len(gpus)
                for rows, k in ((up, d + 1), (down, d)):
                    if 0 < k < len(p.partitions):
                        size = prof.transfer_us(p.partitions[k].blocks[0], p.batch_size, plan.cluster.nic_gbps)
                        for g in gpus:
                            rows[g, 0] += r * size
                            rows[g, 1] += r * size * size
                            rows[g, 2 + mi] += r
    return up, down, slack


@numba.njit(cache=True)
def _late_rate(row: np.ndarray, slack: np.ndarray) -> float:
    """Transfers per µs on one link that wait longer than their model's slack (M/G/1 tail)."""
    rho, m2 = row[0], row[1]
    if rho <= 1e-12 or m2 <= 1e-9:
        return 0.0
    out = 0.0
    if rho >= 1.0:
        for k in range(slack.shape[0]):
            out += row[2 + k]
        return out
    ew = m2 / (2.0 * (1.0 - rho))
    for k in range(slack.shape[0]):
        if row[2 + k] > 0.0:
            out += row[2 + k] * min(1.0, rho * np.exp(-rho * slack[k] / ew))
    return out


@numba.njit(cache=True)
def _server_cost(agg_up, agg_down, s, slack):
    return _late_rate(agg_up[s], slack) + _late_rate(agg_down[s], slack)


@numba.njit(cache=True)
def _pairs(agg_up, agg_down, s, M):
    """Pairs of different models whose transfers share server ``s``'s NIC."""
    n = 0
    for m in range(M):
        if agg_up[s, 2 + m] > PRESENT or agg_down[s, 2 + m] > PRESENT:
            n += 1
    return n * (n - 1) // 2


@numba.njit(cache=True)
def _move(agg_up, agg_down, up, down, i, j, si, sj, sign):
    """Server ``si`` trades GPU ``i``'s rows for GPU ``j``'s and ``sj`` the other way
    (``sign`` -1: undo it)."""
    for w in range(up.shape[1]):
        du = sign * (up[j, w] - up[i, w])
        dd = sign * (down[j, w] - down[i, w])
        agg_up[si, w] += du
        agg_down[si, w] += dd
        agg_up[sj, w] -= du
        agg_down[sj, w] -= dd


@numba.njit(cache=True)
def _swaps(up, down, kind, slack, srv, ranges, max_evals):
    """The search of :func:`balance_servers`; each server's link rows are kept as sums."""
    G = srv.shape[0]
    pos = np.arange(G)
    S = srv.max() + 1
    W = up.shape[1]
    agg_up = np.zeros((S, W))
    agg_down = np.zeros((S, W))
    for g in range(G):
        agg_up[srv[g]] += up[g]
        agg_down[srv[g]] += down[g]
    evals = 0
    M = up.shape[1] - 2
    for t in range(ranges.shape[0]):
        lo, hi = ranges[t, 0], ranges[t, 1]
        for _ in range(MAX_PASSES):
            swapped = False
            for i in range(lo, hi):
                for j in range(i + 1, hi):
                    si, sj = srv[pos[i]], srv[pos[j]]
                    if si == sj or kind[i] == kind[j]:
                        continue
                    if evals >= max_evals:
                        return pos
                    evals += 1
                    before = _server_cost(agg_up, agg_down, si, slack) + _server_cost(agg_up, agg_down, sj, slack)
                    pairs = _pairs(agg_up, agg_down, si, M) + _pairs(agg_up, agg_down, sj, M)
                    _move(agg_up, agg_down, up, down, i, j, si, sj, 1.0)
                    after = _server_cost(agg_up, agg_down, si, slack) + _server_cost(agg_up, agg_down, sj, slack)
                    if after < before * (1.0 - 1e-9) and (
                            _pairs(agg_up, agg_down, si, M) + _pairs(agg_up, agg_down, sj, M) <= pairs):
                        pos[i], pos[j] = pos[j], pos[i]
                        swapped = True
                    else:
                        _move(agg_up, agg_down, up, down, i, j, si, sj, -1.0)
            if not swapped:
                break
    return pos


def balance_servers(up: np.ndarray, down: np.ndarray, slack: np.ndarray, gpu_server: np.ndarray,
                    type_ranges: list[tuple[int, int]], max_evals: int = MAX_EVALS) -> np.ndarray:
    """A permutation ``pos`` of the GPUs within each ``[lo, hi)`` type range: GPU ``g`` takes
    slot ``pos[g]`` (and so server ``gpu_server[pos[g]]``). First-improvement pairwise swaps in a
    fixed order, at most ``max_evals`` tried: deterministic, so the daemon and the simulator
    place a plan alike, and bounded on clusters of thousands of GPUs (about 0.1 µs a try)."""
    G = len(gpu_server)
    if G == 0 or (not up.any() and not down.any()):
        return np.arange(G)
    _, kind = np.unique(np.hstack([up, down]), axis=0, return_inverse=True)
    ranges = np.array(type_ranges, dtype=np.int64).reshape(-1, 2)
    return _swaps(np.ascontiguousarray(up, dtype=np.float64), np.ascontiguousarray(down, dtype=np.float64),
                  kind.reshape(-1).astype(np.int64), np.asarray(slack, dtype=np.float64),
                  np.asarray(gpu_server, dtype=np.int64), ranges, max_evals)


def late_transfers(up: np.ndarray, down: np.ndarray, slack: np.ndarray, gpu_server: np.ndarray,
                   pos: np.ndarray | None = None) -> float:
    """The objective :func:`balance_servers` lowers, transfers per µs planned to wait past their
    model's slack on every link, with GPU ``g`` in slot ``pos[g]`` (default: its own)."""
    srv = np.asarray(gpu_server, dtype=np.int64)
    where = srv if pos is None else srv[np.asarray(pos)]
    total = 0.0
    for rows in (up, down):
        agg = np.zeros((int(srv.max()) + 1, rows.shape[1]))
        np.add.at(agg, where, rows)
        total += sum(_late_rate(a, slack) for a in agg)
    return total
