"""Cluster spec: GPU types, how many, how they sit in servers, how they may be split, the NIC.

Read from TOML::

    nic_gbps = 6

    [gpus.L4]
    count = 25
    per_server = 1        # GPUs of this type in one server (they share its NIC)
    splits = [1, 2, 3, 4] # allowed vGPU splits: v means 1/v of a GPU through MPS

    [gpus.P4]
    count = 75
    per_server = 1
    splits = [1]
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .readfile import read_toml

# At most this many vGPUs in one cluster (every GPU at its largest split) and so in one plan.
# Each vGPU is an executor and a row of the data plane's tables, and Layout.from_plan places
# them one by one: PPipe's largest clusters have 100 GPUs of at most 4 vGPUs, so a million is
# far past any real plan yet keeps a typo (1e9) from looping for hours or exhausting memory.
MAX_VGPUS = 1_000_000
# vGPUs one GPU may be split into: MPS serves at most 48 clients per GPU (16 before Volta).
MAX_SPLIT = 48


class ClusterError(ValueError):
    """A cluster spec is malformed; the message names the key and the problem."""


@dataclass(frozen=True)
class GpuType:
    name: str
    count: int
    per_server: int
    splits: tuple[int, ...]


@dataclass(frozen=True)
class Cluster:
    gpus: dict[str, GpuType]
    nic_gbps: float

    @property
    def gpu_names(self) -> list[str]:
        return list(self.gpus)

    def to_json(self) -> dict[str, Any]:
        return {
            "nic_gbps": self.nic_gbps,
            "gpus": {
                g.name: {"count": g.count, "per_server": g.per_server, "splits": list(g.splits)}
                for g in self.gpus.values()
            },
        }


def _pos_int(x: Any, key: str, allow_zero: bool = False) -> int:
    lo = 0 if allow_zero else 1
    if isinstance(x, bool) or not isinstance(x, int) or x < lo:
        raise ClusterError(f"{key}: expected an integer >= {lo}, got {x!r}")
    return x


def cluster_from_json(d: Any, source: str = "cluster") -> Cluster:
    """Validate a decoded spec (TOML or the ``cluster`` object of a plan)."""
    if not isinstance(d, dict):
        raise ClusterError(f"{source}: expected a table")
    unknown = set(d) - {"nic_gbps", "gpus"}
    if unknown:
        raise ClusterError(f"{source}: unknown key(s) {', '.join(sorted(unknown))} (known: nic_gbps, gpus)")
    nic = d.get("nic_gbps")
    if isinstance(nic, bool) or not isinstance(nic, (int, float)) or not 0 < nic < math.inf:
        raise ClusterError(f"{source}: nic_gbps: expected a finite positive number, got {nic!r}")
    gpus_in = d.get("gpus")
    if not isinstance(gpus_in, dict) or not gpus_in:
        raise ClusterError(f"{source}: gpus: expected at least one [gpus.NAME] table")
    gpus: dict[str, GpuType] = {}
    for name, g in gpus_in.items():
        key = f"{source}: gpus.{name}"
        if not isinstance(g, dict):
            raise ClusterError(f"{key}: expected a table")
        unknown = set(g) - {"count", "per_server", "splits"}
        if unknown:
            raise ClusterError(f"{key}: unknown key(s) {', '.join(sorted(unknown))}")
        count = _pos_int(g.get("count"), f"{key}.count", allow_zero=True)
        per_server = _pos_int(g.get("per_server", 1), f"{key}.per_server")
        splits = g.get("splits", [1])
        if not isinstance(splits, list) or not splits:
            raise ClusterError(f"{key}.splits: expected a non-empty list of integers")
        sp = tuple(sorted({_pos_int(s, f"{key}.splits") for s in splits}))
        if sp[-1] > MAX_SPLIT:
            raise ClusterError(f"{key}.splits: {sp[-1]} vGPUs per GPU; MPS serves at most {MAX_SPLIT}")
        # a server holds no more GPUs than there are (its NIC is shared by those it holds)
        gpus[name] = GpuType(name, count, min(per_server, max(count, 1)), sp)
    if sum(g.count for g in gpus.values()) == 0:
        raise ClusterError(f"{source}: the cluster has no GPUs (every count is 0)")
    vgpus = sum(g.count * g.splits[-1] for g in gpus.values())
    if vgpus > MAX_VGPUS:
        raise ClusterError(f"{source}: {vgpus:,} vGPUs with every GPU at its largest split, more than "
                           f"{MAX_VGPUS:,} (the most one plan may hold)")
    return Cluster(gpus, float(nic))


def load_cluster(path: str | Path) -> Cluster:
    path = Path(path)
    return cluster_from_json(read_toml(path, ClusterError), str(path))


def _csv(s: str, key: str) -> list[str]:
    items = [x.strip() for x in s.split(",") if x.strip()]
    if not items:
        raise ClusterError(f"{key}: empty list")
    return items


def cluster_from_flags(gpus: str, per_server: str | None, splits: str | None, nic_gbps: float) -> Cluster:
    """Build a cluster from CLI flags: ``--gpus L4:25,P4:75 --gpus-per-server 1,1 --vgpu-splits 4,1``.

    A split flag gives the largest split per type; every split from 1 up to it is allowed.
    """
    pairs = []
    for item in _csv(gpus, "--gpus"):
        name, sep, n = item.partition(":")
        if not sep or not name:
            raise ClusterError(f"--gpus: expected NAME:COUNT items, got {item!r}")
        try:
            pairs.append((name, int(n)))
        except ValueError:
            raise ClusterError(f"--gpus: count of {name} is not an integer: {n!r}") from None
    k = len(pairs)

    def per_type(flag: str, value: str | None, default: int) -> list[int]:
        if value is None:
            return [default] * k
        vals = _csv(value, flag)
        if len(vals) != k:
            raise ClusterError(f"{flag}: expected {k} values (one per --gpus type), got {len(vals)}")
        try:
            return [int(v) for v in vals]
        except ValueError:
            raise ClusterError(f"{flag}: values must be integers, got {value!r}") from None

    ps = per_type("--gpus-per-server", per_server, 1)
    mx = per_type("--vgpu-splits", splits, 1)
    if any(m > MAX_SPLIT for m in mx):
        raise ClusterError(f"--vgpu-splits: at most {MAX_SPLIT} vGPUs per GPU (MPS serves at most "
                           f"{MAX_SPLIT} clients), got {splits}")
    spec = {
        "nic_gbps": nic_gbps,
        "gpus": {
            name: {"count": n, "per_server": p, "splits": list(range(1, m + 1))}
            for (name, n), p, m in zip(pairs, ps, mx, strict=True)
        },
    }
    return cluster_from_json(spec, "flags")
