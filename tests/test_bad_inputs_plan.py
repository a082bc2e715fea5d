"""Broken plans, profiles and files are refused with an error that names the place and the value,
never a traceback, a hang or a crash further down (the simulator, the daemon). Every case is
the embedded example (``plans/example``) with one thing changed: no ../shared data needed."""

from __future__ import annotations

import copy
import json
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from ppiped.cli import main as cli
from ppiped.cluster import ClusterError, load_cluster
from ppiped.core.layout import Layout, LayoutError
from ppiped.plan import MAX_VGPUS, PlanError, check, import_reference, load_plan, plan_from_json
from ppiped.profiles import ProfileError, load_profiles, profile_from_json

EXAMPLE = Path(__file__).resolve().parents[1] / "plans" / "example"
BASE: dict[str, Any] = json.loads((EXAMPLE / "plan.json").read_text())
PROFILE: dict[str, Any] = json.loads((EXAMPLE / "example.json").read_text())
PROFILES = {"example": profile_from_json(PROFILE, "example.json")}


def _set(*path: Any, value: Any = None, delete: bool = False) -> Callable[[dict], None]:
    """A mutation setting (or deleting) one field of the plan, addressed by keys and indices."""

    def f(d: dict) -> None:
        x = d
        for k in path[:-1]:
            x = x[k]
        if delete:
            del x[path[-1]]
        else:
            x[path[-1]] = value

    return f


M = ("models", 0)
P = (*M, "pipelines", 0)
Q = (*P, "partitions", 0)


def _dup_model(d: dict) -> None:
    d["models"].append(copy.deepcopy(d["models"][0]))


# (mutation, fragment of the PlanError's message)
LOAD_ERRORS: dict[str, tuple[Callable[[dict], None], str]] = {
    "models-empty-list": (_set("models", value=[]), "field models: expected a non-empty list"),
    "models-empty-object": (_set("models", value={}), "field models: expected a non-empty list"),
    "models-null": (_set("models", value=None), "field models: expected a non-empty list"),
    "model-duplicate": (_dup_model, "model 'example' appears twice"),
    "model-name-int": (_set(*M, "model", value=5), "field model: expected a model name, got 5"),
    "slo-nan": (_set(*M, "slo_us", value=math.nan), "model 'example': field slo_us: expected a positive finite"),
    "slo-inf": (_set(*M, "slo_us", value=math.inf), "field slo_us: expected a positive finite number of µs, got inf"),
    "slo-zero": (_set(*M, "slo_us", value=0), "field slo_us: expected a positive finite number of µs, got 0"),
    "slo-negative": (_set(*M, "slo_us", value=-5), "field slo_us: expected a positive finite number of µs, got -5"),
    "slo-string": (_set(*M, "slo_us", value="1500"), "field slo_us: expected a number, got '1500'"),
    "weight-nan": (_set(*M, "weight", value=math.nan), "field weight: expected a positive finite number, got nan"),
    "weight-zero": (_set(*M, "weight", value=0), "field weight: expected a positive finite number, got 0"),
    "model-throughput-nan": (_set(*M, "throughput_rps", value=math.nan), "field throughput_rps"),
    "delay-rate-negative": (_set(*M, "batch_delay_rate_rps", value=-1), "field batch_delay_rate_rps"),
    "delay-rate-zero-batching": (_set(*M, "batch_delay_rate_rps", value=0),
                                 "pipeline 0: batch size 5 with batch_delay_rate_rps 0"),
    "batch-size-zero": (_set(*P, "batch_size", value=0),
                        "model 'example', pipeline 0: field batch_size: expected an integer >= 1, got 0"),
    "batch-size-negative": (_set(*P, "batch_size", value=-3), "field batch_size: expected an integer >= 1, got -3"),
    "batch-size-fraction": (_set(*P, "batch_size", value=2.5), "field batch_size: expected an integer, got 2.5"),
    "batch-size-bool": (_set(*P, "batch_size", value=True), "field batch_size: expected an integer, got True"),
    "partitions-empty": (_set(*P, "partitions", value=[]), "pipeline 0: field partitions: a pipeline has at least"),
    "blocks-reversed": (_set(*Q, "blocks", value=[5, 0]), "partition 0: field blocks: expected [start, end) with"),
    "blocks-negative": (_set(*Q, "blocks", value=[-2, 5]), "got [-2, 5]"),
    "blocks-three": (_set(*Q, "blocks", value=[0, 5, 6]), "field blocks: expected [start, end), got [0, 5, 6]"),
    "split-zero": (_set(*Q, "vgpu_split", value=0),
                   "pipeline 0, partition 0: field vgpu_split: expected an integer >= 1, got 0"),
    "vgpus-zero": (_set(*Q, "num_vgpus", value=0), "field num_vgpus: expected an integer >= 1, got 0"),
    "vgpus-negative": (_set(*Q, "num_vgpus", value=-4), "field num_vgpus: expected an integer >= 1, got -4"),
    "vgpus-billion": (_set(*Q, "num_vgpus", value=10**9), f"vGPUs in all, more than {MAX_VGPUS:,}"),
    "vgpus-billion-float": (_set(*Q, "num_vgpus", value=1e9), "vGPUs in all"),
    "lat-infer-negative": (_set(*Q, "lat_infer_us", value=-1), "field lat_infer_us: expected a finite number >= 0"),
    "lat-trans-nan": (_set(*Q, "lat_trans_us", value=math.nan), "field lat_trans_us"),
    "partition-throughput-nan": (_set(*Q, "throughput_rps", value=math.nan), "partition 0: field throughput_rps"),
    "pipeline-throughput-inf": (_set(*P, "throughput_rps", value=math.inf), "pipeline 0: field throughput_rps"),
    "objective-nan": (_set("objective", "normalized_throughput", value=math.nan),
                      "objective: field normalized_throughput"),
    "params-missing": (_set("params", delete=True), "missing field 'params'"),
    "slo-margin-negative": (_set("params", "slo_margin", value=-1), "params: field slo_margin"),
    "slo-margin-one": (_set("params", "slo_margin", value=1.0), "params: field slo_margin"),
    "delay-factor-zero": (_set("params", "batch_delay_factor", value=0), "params: field batch_delay_factor"),
    "delay-factor-nan": (_set("params", "batch_delay_factor", value=math.nan), "params: field batch_delay_factor"),
    "max-partitions-zero": (_set("params", "max_partitions", value=0), "params: field max_partitions"),
    "params-unknown-key": (_set("params", "slo_margn", value=0.4), "unknown field(s) 'slo_margn'"),
    "top-level-unknown-key": (_set("bogus", value=1), "unknown field(s) 'bogus'"),
    "partition-unknown-key": (_set(*Q, "num_vgpu", value=3), "partition 0: unknown field(s) 'num_vgpu'"),
    # an int too large for a float raised OverflowError in the finiteness check
    "delay-factor-400-digits": (_set("params", "batch_delay_factor", value=10**400),
                                "params: field batch_delay_factor: expected a positive number, got 1000"),
    "slo-scale-400-digits": (_set("params", "slo_scale", value=10**400), "params: field slo_scale"),
}


def _mutated(mutate: Callable[[dict], None]) -> dict:
    d = copy.deepcopy(BASE)
    mutate(d)
    return d


def test_the_example_itself_loads_checks_and_is_placed():
    plan = plan_from_json(copy.deepcopy(BASE), "plan.json")
    assert check(plan, PROFILES) == []
    assert Layout.from_plan(plan, PROFILES).num_vgpus == 16


@pytest.mark.parametrize("case", list(LOAD_ERRORS))
def test_broken_plan_is_refused_when_read(case):
    mutate, fragment = LOAD_ERRORS[case]
    with pytest.raises(PlanError) as e:
        plan_from_json(_mutated(mutate), "broken.json")
    assert fragment in str(e.value) and str(e.value).startswith("broken.json")


@pytest.mark.parametrize("case", ["models-empty-list", "models-empty-object", "slo-nan", "slo-inf",
                                  "delay-rate-zero-batching", "params-missing", "top-level-unknown-key"])
def test_check_command_reports_a_broken_plan_without_a_traceback(case, tmp_path, capsys):
    mutate, fragment = LOAD_ERRORS[case]
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(_mutated(mutate)))  # NaN and Infinity as Python's json writes them
    assert cli(["check", str(f), "--profiles", str(EXAMPLE)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and str(f) in err and fragment in err


# Broken only against the profile or the cluster: `check` lists them as broken rules, and
# Layout.from_plan (the daemon's and the simulator's placement) refuses them.
LAYOUT_ERRORS: dict[str, tuple[Callable[[dict], None], str, str]] = {
    "batch-size-unprofiled": (_set(*P, "batch_size", value=1_000_000),
                              "partition 0: batch size 1000000 is not profiled for P4", "batch-size-unprofiled"),
    "blocks-past-the-profile": (_set(*Q, "blocks", value=[0, 50]),
                                "blocks [0, 50) are not within the profile's 10 blocks", "blocks-contiguous"),
    "blocks-gap": (_set(*P, "partitions", 1, "blocks", value=[6, 10]),
                   "partition 1: blocks [6, 10) do not start where the previous partition ends (block 5)",
                   "blocks-contiguous"),
    "split-unprofiled": (_set(*Q, "vgpu_split", value=7), "split 1/7 of P4 is not profiled", "split-not-allowed"),
    "gpu-unknown": (_set(*Q, "gpu", value="H100"), "GPU type 'H100' is not in the cluster", "unknown-gpu"),
    # check called it batch-size-mixed; serving ran every hop at the pipeline's size
    "partition-batch-size-mixed": (_set(*P, "partitions", 1, "batch_size", value=3),
                                   "partition 1: batch size 3 differs from the pipeline's 5", "batch-size-mixed"),
    "gpu-count-zero": (_set("cluster", "gpus", "P4", "count", value=0),
                       "P4 vGPUs need at least 12 whole GPUs, the cluster has 0", "gpu-budget"),
    "vgpus-far-past-the-cluster": (_set(*Q, "num_vgpus", value=100_000),
                                   "P4 vGPUs need at least 100000 whole GPUs", "gpu-budget"),
    "no-pipelines": (_set(*M, "pipelines", value=[]), "serves no model on any vGPU", "throughput-inflated"),
}


@pytest.mark.parametrize("case", list(LAYOUT_ERRORS))
def test_plan_unfit_for_its_profile_is_refused_by_the_layout(case):
    mutate, fragment, rule = LAYOUT_ERRORS[case]
    plan = plan_from_json(_mutated(mutate), "unfit.json")
    assert rule in {v.rule for v in check(plan, PROFILES)}
    with pytest.raises(LayoutError) as e:
        Layout.from_plan(plan, PROFILES)
    assert fragment in str(e.value) and "unfit.json" in str(e.value)
    assert isinstance(e.value, PlanError)  # so every command prints it as an input error


@pytest.mark.parametrize("case", ["models-empty-list", "batch-size-zero", "gpu-unknown", "batch-size-unprofiled"])
def test_sim_command_refuses_instead_of_crashing_or_hanging(case, tmp_path, capsys):
    mutate, fragment = (LOAD_ERRORS.get(case) or LAYOUT_ERRORS[case])[:2]
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(_mutated(mutate)))
    rc = cli(["sim", "--plan", str(f), "--profiles", str(EXAMPLE), "--load-factor", "0.5", "--duration", "0.01"])
    err = capsys.readouterr().err
    assert rc == 2 and "Traceback" not in err and fragment in err


# --- files that are not UTF-8 ---------------------------------------------------------------

NOT_UTF8 = b'{"format": "\xff\xfe ppiped"}\n'


def _bad_plan(tmp: Path) -> tuple[Path, Callable[[], Any], type[Exception]]:
    f = tmp / "plan.json"
    f.write_bytes(NOT_UTF8)
    return f, lambda: load_plan(f), PlanError


def _bad_profile_dir(tmp: Path) -> tuple[Path, Callable[[], Any], type[Exception]]:
    (tmp / "example.json").write_text(json.dumps(PROFILE))
    f = tmp / "zz-latin1.json"
    f.write_bytes(NOT_UTF8)
    return f, lambda: load_profiles(tmp), ProfileError


def _bad_cluster(tmp: Path) -> tuple[Path, Callable[[], Any], type[Exception]]:
    f = tmp / "cluster.toml"
    f.write_bytes(b"nic_gbps = 10 # \xe9t\xe9\n")
    return f, lambda: load_cluster(f), ClusterError


@pytest.mark.parametrize("make", [_bad_plan, _bad_profile_dir, _bad_cluster], ids=["plan", "profiles", "cluster"])
def test_a_file_that_is_not_utf8_is_named(make, tmp_path):
    f, load, error = make(tmp_path)
    with pytest.raises(error) as e:
        load()
    assert f"{f}: not UTF-8 text" in str(e.value)


def test_check_command_names_a_non_utf8_plan(tmp_path, capsys):
    f, _, _ = _bad_plan(tmp_path)
    assert cli(["check", str(f), "--profiles", str(EXAMPLE)]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{f}: not UTF-8 text" in err


# --- profiles ---------------------------------------------------------------------------------


def test_profile_of_another_format_version_is_not_skipped(tmp_path):
    (tmp_path / "example.json").write_text(json.dumps({**PROFILE, "format": "ppiped-profile/9"}))
    (tmp_path / "plan.json").write_text(json.dumps(BASE))  # a plan beside the profiles: still skipped
    for load in (lambda: load_profiles(tmp_path), lambda: load_profiles(tmp_path, ["example"])):
        with pytest.raises(ProfileError, match="unsupported profile format version") as e:
            load()
        assert "example.json" in str(e.value) and "'ppiped-profile/9'" in str(e.value)


def test_profile_split_keys_that_are_one_number_collide():
    d = copy.deepcopy(PROFILE)
    d["block_latency_us"]["V100"]["01"] = d["block_latency_us"]["V100"]["1"]
    with pytest.raises(ProfileError, match=r"split 1 is given twice \(keys '1', '01'\)"):
        profile_from_json(d, "example.json")


@pytest.mark.parametrize("key", [" 2 ", "+2", "1_0", "9" * 5000])
def test_profile_split_key_must_be_plain_digits(key):
    d = copy.deepcopy(PROFILE)
    d["block_latency_us"]["V100"][key] = d["block_latency_us"]["V100"].pop("2")
    with pytest.raises(ProfileError, match="split key must be an integer"):
        profile_from_json(d, "example.json")


# --- PPipe reference plan files ----------------------------------------------------------------

REF_NAME = "example_V100-P4_1-12_bw-gbps-40_sla-multiplier-7_v4.json"


def _reference() -> list[dict]:
    """The example plan in the layout of PPipe's reference plan files."""
    m = BASE["models"][0]
    cfg = {"dnn_name": m["model"], "gpu_name_arr": ["V100", "P4"], "num_gpu_per_server_arr": [1, 2],
           "num_mps_levels": [4, 1], "bw_gbps": 40, "sla": m["slo_us"],
           "hist_adjustment": math.floor(0.4 * m["slo_us"]), "batch_build_factor": 1.3, "max_num_parts": 2,
           "est_xput": m["batch_delay_rate_rps"]}
    pipes = [{"xput": p["throughput_rps"], "partitions": [
        {"layers": q["blocks"], "gpu": q["gpu"], "mps": q["vgpu_split"] - 1,
         "num_gpu": q["num_vgpus"] / q["vgpu_split"], "lat_infer": q["lat_infer_us"],
         "lat_trans": q["lat_trans_us"], "xput": q["throughput_rps"], "bs": q["batch_size"]}
        for q in p["partitions"]]} for p in m["pipelines"]]
    return [{"config": cfg, "pipelines": pipes, "xput": m["throughput_rps"]}]


def test_reference_form_of_the_example_imports_and_checks(tmp_path):
    f = tmp_path / REF_NAME
    f.write_text(json.dumps(_reference()))
    assert check(import_reference(f), PROFILES) == []


REF_ERRORS: dict[str, tuple[Callable[[list], None], str]] = {
    "config-only-a-name": (lambda d: d.__setitem__(0, {"config": {"dnn_name": "example"}}),
                           "[0].config: missing field 'gpu_name_arr'"),
    "no-sla": (_set(0, "config", "sla", delete=True), "[0].config: missing field 'sla'"),
    "no-rate": (_set(0, "config", "est_xput", delete=True), "[0].config: missing field 'est_xput'"),
    "no-layers": (_set(0, "pipelines", 0, "partitions", 0, "layers", delete=True),
                  "[0].pipelines[0].partitions[0]: missing field 'layers'"),
    "no-mps": (_set(0, "pipelines", 0, "partitions", 0, "mps", delete=True), "missing field 'mps'"),
    "no-xput": (_set(0, "xput", delete=True), "[0]: missing field 'xput'"),
    "sla-nan": (_set(0, "config", "sla", value=math.nan), "field sla: expected a positive number"),
    "num-gpu-nan": (_set(0, "pipelines", 0, "partitions", 0, "num_gpu", value=math.nan), "field num_gpu"),
    # a fractional vGPU count was rounded and served (16.6 GPUs at split 1 became 17)
    "num-gpu-fractional": (_set(0, "pipelines", 0, "partitions", 0, "num_gpu", value=16.6),
                           "field num_gpu: expected GPUs making a whole number (>= 1) of vGPUs"),
    "num-gpu-negative": (_set(0, "pipelines", 0, "partitions", 0, "num_gpu", value=-2), "field num_gpu"),
    "bs-zero": (_set(0, "pipelines", 0, "partitions", 0, "bs", value=0), "field bs: expected a batch size"),
    "gpu-not-in-name": (_set(0, "config", "gpu_name_arr", value=["V100", "T4"]),
                        "GPU type(s) 'T4' are not in the file name's cluster"),
    "not-an-object": (lambda d: d.__setitem__(0, 1), "[0]: a reference plan entry is a JSON object"),
    # 10^9 levels built a list of a billion splits (17 GB) before the cluster refused it
    "mps-levels-billion": (_set(0, "config", "num_mps_levels", value=[10**9, 1]),
                           "num_mps_levels 1000000000: expected 1 to 48"),
}


def test_a_number_of_5000_digits_is_named_not_a_traceback(tmp_path, capsys):
    """Python refuses to convert integers of more than 4,300 digits with a plain ValueError,
    which escaped the JSON reader as a traceback."""
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(BASE).replace('"max_partitions": 2', '"max_partitions": ' + "7" * 5000))
    assert "7" * 5000 in f.read_text()
    with pytest.raises(PlanError, match="not valid JSON: Exceeds the limit"):
        load_plan(f)
    assert cli(["check", str(f), "--profiles", str(EXAMPLE)]) == 2
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("case", list(REF_ERRORS))
def test_broken_reference_plan_names_the_key(case, tmp_path, capsys):
    mutate, fragment = REF_ERRORS[case]
    d = _reference()
    mutate(d)
    f = tmp_path / REF_NAME
    f.write_text(json.dumps(d))
    with pytest.raises(PlanError) as e:
        load_plan(f)
    assert fragment in str(e.value) and str(f) in str(e.value)
    assert cli(["check", str(f), "--profiles", str(EXAMPLE)]) == 2
    assert "Traceback" not in capsys.readouterr().err


def test_every_tool_finds_a_profile_by_one_rule(tmp_path, capsys):
    """Model m's profile is m.json and says m: check and sim took a file named after another
    model, and a model named '../x' read a profile from outside the directory."""
    prof = tmp_path / "profiles"
    prof.mkdir()
    (prof / "example.json").write_text(json.dumps({**PROFILE, "model": "other"}))
    with pytest.raises(ProfileError, match=r"example.json: holds the profile of 'other'"):
        load_profiles(prof, ["example"])
    with pytest.raises(ProfileError, match=r"holds the profile of 'other'"):
        load_profiles(prof)
    for bad in ("../example/example", ".hidden", "a\\b"):
        with pytest.raises(ProfileError, match="a model name is a file name"):
            load_profiles(EXAMPLE, [bad])
    for cmd in (["check", str(EXAMPLE / "plan.json"), "--profiles", str(prof)],
                ["sim", "--plan", str(EXAMPLE / "plan.json"), "--profiles", str(prof), "--duration", "0.1",
                 "--load-factor", "0.5"]):
        assert cli(cmd) == 2
        assert "holds the profile of 'other'" in capsys.readouterr().err


def test_check_names_the_models_whose_slo_it_cannot_judge(tmp_path, capsys):
    """An SLO reference GPU the profiles lack: the SLO rule cannot be applied, and check says so
    beside its verdict (it printed a bare "ok")."""
    f = tmp_path / "plan.json"
    f.write_text(json.dumps(_mutated(_set("params", "slo_reference_gpu", value="XYZ"))))
    assert cli(["check", str(f), "--profiles", str(EXAMPLE)]) == 0
    out = capsys.readouterr().out
    assert out.startswith("ok ") and "note: SLOs not judged for example" in out and "GPU XYZ" in out
    assert cli(["check", str(f), "--profiles", str(EXAMPLE), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["slo_not_judged"] == ["example"]
    assert cli(["check", str(EXAMPLE / "plan.json"), "--profiles", str(EXAMPLE), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["slo_not_judged"] == []
