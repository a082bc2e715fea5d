"""Profile and cluster loaders: valid input loads, every malformed field gets a specific error."""

from __future__ import annotations

import copy
import json

import numpy as np
import pytest

from ppiped.cluster import ClusterError, cluster_from_flags, cluster_from_json, load_cluster
from ppiped.profiles import ProfileError, load_profile, load_profiles, profile_from_json


def tiny_profile_json(nb: int = 3) -> dict:
    return {
        "model": "tiny",
        "num_blocks": nb,
        "block_latency_us": {
            "A": {"1": [[100.0 * (i + 1), 180.0 * (i + 1)] for i in range(nb)],
                  "2": [[190.0 * (i + 1)] for i in range(nb)]},
            "B": {"1": [[300.0, 550.0] for _ in range(nb)]},
        },
        "boundary_bytes": [1000 * (i + 1) for i in range(nb - 1)],
        "whole_model_latency_us": {"A": 600.0, "B": 900.0},
    }


def test_profile_range_sums_and_transfer():
    p = profile_from_json(tiny_profile_json())
    assert p.partition_latency_us("A", 1, 0, 3, 1) == pytest.approx(600.0)
    assert p.partition_latency_us("A", 1, 1, 3, 2) == pytest.approx(180.0 * 5)
    assert p.max_batch("A", 2) == 1 and p.max_batch("B", 3) == 0
    # 2000 bytes leave block 1; batch 2 at 8 Gb/s: 2000*2*8/8e3 us
    assert p.transfer_us(2, 2, 8.0) == pytest.approx(4.0)
    assert p.transfer_us(3, 2, 8.0) == 0.0


@pytest.mark.parametrize(
    "mutate, needle",
    [
        (lambda d: d.pop("boundary_bytes"), "missing field 'boundary_bytes'"),
        (lambda d: d.update(num_blocks=0), "num_blocks"),
        (lambda d: d["block_latency_us"]["A"]["1"].pop(), "block_latency_us.A.1: expected 3 blocks"),
        (lambda d: d["block_latency_us"]["A"]["1"][1].append(5.0), "block_latency_us.A.1"),
        (lambda d: d["block_latency_us"]["B"]["1"][0].__setitem__(0, -3), "block_latency_us.B.1[0][0]"),
        (lambda d: d["block_latency_us"]["A"].update({"x": []}), "split key must be an integer"),
        (lambda d: d.update(boundary_bytes=[1]), "boundary_bytes: expected 2 entries"),
        (lambda d: d["whole_model_latency_us"].update(A="fast"), "whole_model_latency_us.A"),
        (lambda d: d.update(format="other/9"), "field format"),
    ],
)
def test_profile_errors_name_the_field(mutate, needle):
    d = copy.deepcopy(tiny_profile_json())
    mutate(d)
    with pytest.raises(ProfileError, match=None) as e:
        profile_from_json(d, "tiny.json")
    assert needle in str(e.value) and "tiny.json" in str(e.value)


def test_profile_roundtrip_and_file_errors(tmp_path):
    p = profile_from_json(tiny_profile_json())
    path = tmp_path / "tiny.json"
    path.write_text(json.dumps(p.to_json()))
    q = load_profile(path)
    assert np.array_equal(q.latency["A"][2], p.latency["A"][2])
    (tmp_path / "bad.json").write_text("{not json")
    with pytest.raises(ProfileError, match="bad.json: not valid JSON"):
        load_profile(tmp_path / "bad.json")
    with pytest.raises(ProfileError, match="unknown model 'nope'"):
        load_profiles(tmp_path, ["nope"])
    (tmp_path / "bad.json").write_text('{"model": "a", "num_blocks": 2, "num_blocks": 3}')
    with pytest.raises(ProfileError, match="bad.json: not valid JSON: key 'num_blocks' appears twice"):
        load_profile(tmp_path / "bad.json")  # json alone keeps the last value, silently
    (tmp_path / "bad.json").unlink()
    (tmp_path / "plan.json").write_text(json.dumps({"format": "ppiped-plan/1"}))
    assert list(load_profiles(tmp_path)) == ["tiny"], "a plan beside the profiles is skipped"
    with pytest.raises(ProfileError, match=r"profiles here: tiny\)"):
        load_profiles(tmp_path, ["nope"])


def test_shared_profiles_load(shared_profiles):
    assert len(shared_profiles) == 18
    for p in shared_profiles.values():
        assert p.num_blocks in (9, 10)
        assert set(p.gpus) == {"L4", "T4", "V100", "P4"}
        assert p.splits("P4") == [1]


def test_cluster_toml_and_flags(tmp_path):
    f = tmp_path / "c.toml"
    f.write_text('nic_gbps = 6\n[gpus.L4]\ncount = 25\nper_server = 1\nsplits = [1,2,3,4]\n'
                 '[gpus.P4]\ncount = 75\n')
    c = load_cluster(f)
    assert c.gpus["L4"].splits == (1, 2, 3, 4) and c.gpus["P4"].splits == (1,)
    same = cluster_from_flags("L4:25,P4:75", "1,1", "4,1", 6)
    assert same == c


@pytest.mark.parametrize(
    "spec, needle",
    [
        ({"nic_gbps": 0, "gpus": {"A": {"count": 1}}}, "nic_gbps"),
        ({"nic_gbps": 1, "gpus": {}}, "gpus"),
        ({"nic_gbps": 1, "gpus": {"A": {"count": -1}}}, "gpus.A.count"),
        ({"nic_gbps": 1, "gpus": {"A": {"count": 1, "colour": 2}}}, "unknown key(s) colour"),
        ({"nic_gbps": 1, "gpus": {"A": {"count": 2, "splits": [0]}}}, "gpus.A.splits"),
        ({"nic_gbps": 1, "gpus": {"A": {"count": 0}}}, "no GPUs"),
        ({"nic_gbps": 1, "gpu": {}}, "unknown key(s) gpu"),
        ({"nic_gbps": float("inf"), "gpus": {"A": {"count": 1}}}, "nic_gbps: expected a finite positive number"),
        # counts no plan may hold (10^20 once reached numpy's allocator deep in the planner)
        ({"nic_gbps": 1, "gpus": {"A": {"count": 10**20}}}, "more than 1,000,000 (the most one plan may hold)"),
        ({"nic_gbps": 1, "gpus": {"A": {"count": 300_000, "splits": [1, 4]}}}, "1,200,000 vGPUs"),
        ({"nic_gbps": 1, "gpus": {"A": {"count": 1, "splits": [1, 10**9]}}}, "MPS serves at most 48"),
    ],
)
def test_cluster_errors(spec, needle):
    with pytest.raises(ClusterError) as e:
        cluster_from_json(spec)
    assert needle in str(e.value)


def test_a_server_holds_no_more_gpus_than_there_are():
    """per_server 100 with 3 GPUs once split each server's NIC 100 ways (and planned 12 % less)."""
    cl = cluster_from_json({"nic_gbps": 10, "gpus": {"P4": {"count": 3, "per_server": 100},
                                                     "V100": {"count": 8, "per_server": 4}}})
    assert cl.gpus["P4"].per_server == 3 and cl.gpus["V100"].per_server == 4


def test_cluster_flag_errors():
    with pytest.raises(ClusterError, match="at most 48 vGPUs per GPU"):
        cluster_from_flags("L4:25", None, "1000000000", 6)
    with pytest.raises(ClusterError, match="expected 2 values"):
        cluster_from_flags("L4:25,P4:75", "1", None, 6)
    with pytest.raises(ClusterError, match="NAME:COUNT"):
        cluster_from_flags("L4", None, None, 6)
