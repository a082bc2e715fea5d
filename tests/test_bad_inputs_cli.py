"""Bad flag values to ``sim``, ``sweep``, ``plan`` and ``loadgen`` end in one line
``ppiped CMD: error: ...`` and a non-zero exit, never a traceback, a hang or a lost solve.

Each case runs the CLI in a subprocess with a timeout, because several of these inputs used to
hang (``--jitter nan``, ``--step 0``), and only the example plan in ``plans/example`` is used.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from conftest import assert_refused as refused
from conftest import run_cli

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "plans" / "example"
PLAN = str(EXAMPLE / "plan.json")

SIM = ["sim", "--plan", PLAN, "--profiles", str(EXAMPLE), "--duration", "0.2"]
SWEEP = ["sweep", "--plan", PLAN, "--profiles", str(EXAMPLE), "--duration", "0.2"]
PLAN_CMD = ["plan", "--profiles", str(EXAMPLE), "--models", "example", "--slo-reference-gpu", "V100",
            "--slo-scale", "7", "--time-limit", "20"]
CLUSTER = ["--cluster", str(EXAMPLE / "cluster.toml")]


def ppiped(argv: list[str], timeout: float = 60.0) -> subprocess.CompletedProcess[str]:
    return run_cli(["ppiped.cli", *argv], timeout)


def assert_refused(p: subprocess.CompletedProcess[str], rc: int, fragment: str) -> None:
    refused(p, fragment, rc, prefix=f"ppiped {p.args[3]}: error: ")


def _fill(argv: list[str], tmp: Path) -> list[str]:
    return [a.replace("{tmp}", str(tmp)) for a in argv]


SIM_CASES = {
    "jitter-nan": (["--load-factor", "0.5", "--jitter", "nan"], "argument --jitter"),
    "jitter-huge": (["--load-factor", "0.5", "--jitter", "100"], "argument --jitter"),
    "cv-nan": (["--load-factor", "0.5", "--trace", "bursty", "--cv", "nan"], "argument --cv"),
    "cv-tiny": (["--load-factor", "0.5", "--trace", "bursty", "--cv", "1e-300"], "argument --cv"),
    # matplotlib refused the format only after the whole run
    "plot-format": (["--load-factor", "0.5", "--plot", "{tmp}/t.xyz"], "a plot is written as .png"),
    "load-factor-nan": (["--load-factor", "nan"], "argument --load-factor"),
    "load-factor-inf": (["--load-factor", "inf"], "argument --load-factor"),
    "load-factor-1e9": (["--load-factor", "1e9"], "argument --load-factor"),
    "rate-nan": (["--rate", "nan"], "argument --rate"),
    "duration-nan": (["--load-factor", "0.5", "--duration", "nan"], "argument --duration"),
    "duration-inf": (["--load-factor", "0.5", "--duration", "inf"], "argument --duration"),
    "seed-negative": (["--load-factor", "0.5", "--seed", "-1"], "argument --seed"),
    "start-early-negative": (["--load-factor", "0.5", "--start-early-us", "-5"], "argument --start-early-us"),
    "start-early-nan": (["--load-factor", "0.5", "--start-early-us", "nan"], "argument --start-early-us"),
    "plot-window-reversed": (["--load-factor", "0.5", "--plot", "{tmp}/t.png", "--plot-window", "10", "5"],
                             "FROM_MS"),
    "plot-dir-missing": (["--load-factor", "0.5", "--plot", "{tmp}/missing/t.png"], "does not exist"),
    "trace-missing": (["--load-factor", "0.5", "--trace", "{tmp}/nope.csv"], "no such file"),
    "base-plan-missing": (["--load-factor", "0.5", "--base-plan", "{tmp}/nope.json"], "no such file"),
    # more requests than a run may generate (the old code asked numpy for terabytes)
    "requests-by-rate": (["--rate", "1e12", "--duration", "1"], "at most 50,000,000"),
    "requests-by-load-factor": (["--load-factor", "1000", "--duration", "86400"], "at most 50,000,000"),
}


@pytest.mark.parametrize("argv,fragment", list(SIM_CASES.values()), ids=list(SIM_CASES))
def test_sim_refuses(argv: list[str], fragment: str, tmp_path: Path) -> None:
    """Each of these used to hang, trace back, or run with a meaningless value."""
    assert_refused(ppiped([*SIM, *_fill(argv, tmp_path)]), 2, fragment)


SWEEP_CASES = {
    "step-zero": (["--step", "0"], "argument --step"),
    "step-nan": (["--step", "nan"], "argument --step"),
    "step-negative": (["--step", "-0.1"], "argument --step"),
    "step-tiny": (["--step", "1e-6"], "load factors to simulate"),
    "resolution-zero": (["--resolution", "0"], "argument --resolution"),
    "resolution-negative": (["--resolution", "-1"], "argument --resolution"),
    "max-factor-zero": (["--max-factor", "0"], "argument --max-factor"),
    "max-factor-negative": (["--max-factor", "-1"], "argument --max-factor"),
    "start-above-max": (["--start", "5"], "above --max-factor"),
    "max-factor-below-resolution": (["--max-factor", "1e-9"], "below --resolution 0.01: no load factor to try"),
    "plot-dir-missing": (["--plot", "{tmp}/missing/a.png"], "does not exist"),
    "jobs-absurd": (["--jobs", "100000"], "argument --jobs"),
}


@pytest.mark.parametrize("argv,fragment", list(SWEEP_CASES.values()), ids=list(SWEEP_CASES))
def test_sweep_refuses(argv: list[str], fragment: str, tmp_path: Path) -> None:
    """A step or resolution <= 0 never ends the sweep; a max factor <= 0 reported 0.00."""
    assert_refused(ppiped([*SWEEP, *_fill(argv, tmp_path)]), 2, fragment)


PLAN_CASES = {
    "time-limit-inf": ([*CLUSTER, "--time-limit", "inf"], "argument --time-limit"),
    "weights-extreme": ([*CLUSTER, "--weights=1e300"], "argument --weights"),
    "output-is-dir": ([*CLUSTER, "-o", "{tmp}"], "is a directory"),
    "output-dir-missing": ([*CLUSTER, "-o", "{tmp}/missing/plan.json"], "does not exist"),
    "model-is-path": ([*CLUSTER, "--models", "../example/example"], "is a path"),
    "model-trailing-comma": ([*CLUSTER, "--models", "example,"], "an empty model name"),
    "batch-delay-nan": ([*CLUSTER, "--batch-delay-factor", "nan"], "argument --batch-delay-factor"),
    "batch-delay-zero": ([*CLUSTER, "--batch-delay-factor", "0"], "argument --batch-delay-factor"),
    "batch-delay-negative": ([*CLUSTER, "--batch-delay-factor", "-1"], "argument --batch-delay-factor"),
    "threads-zero": ([*CLUSTER, "--threads", "0"], "argument --threads"),
    "threads-negative": ([*CLUSTER, "--threads", "-1"], "argument --threads"),
    "gpus-twice": (["--gpus", "V100:1,V100:2"], "given twice"),
    "cluster-and-gpus": ([*CLUSTER, "--gpus", "P4:3"], "not allowed with argument --cluster"),
    "cluster-and-nic": ([*CLUSTER, "--nic-gbps", "5"], "only with --gpus"),
}


@pytest.mark.parametrize("argv,fragment", list(PLAN_CASES.values()), ids=list(PLAN_CASES))
def test_plan_refuses_before_solving(argv: list[str], fragment: str, tmp_path: Path) -> None:
    """Refused up front: the old code crashed in the solver or lost the plan after solving."""
    assert_refused(ppiped([*PLAN_CMD, *_fill(argv, tmp_path)]), 2, fragment)


LOADGEN_CASES = {
    "endpoint-bad": (["--endpoint", "foo"], "argument --endpoint"),
    "rate-nan": (["--rate", "example=nan"], "finite number > 0"),
    "rate-zero": (["--rate", "example=0"], "finite number > 0"),
    "rate-twice": (["--rate", "example=1", "--rate", "example=2"], "given twice"),
    "duration-nan": (["--duration", "nan"], "argument --duration"),
    "duration-zero": (["--duration", "0"], "argument --duration"),
    "duration-negative": (["--duration", "-1"], "argument --duration"),
    "frame-bytes-negative": (["--frame-bytes", "-1"], "argument --frame-bytes"),
    "slo-zero": (["--slo-ms", "0"], "argument --slo-ms"),
    "too-many-requests": (["--rate", "example=1e9", "--duration", "1"], "at most 10,000,000"),
}


@pytest.mark.parametrize("argv,fragment", list(LOADGEN_CASES.values()), ids=list(LOADGEN_CASES))
def test_loadgen_checks_before_connecting(argv: list[str], fragment: str, tmp_path: Path) -> None:
    """Nothing listens on the endpoint: a refusal that came after connecting would say so."""
    base = ["loadgen", "--endpoint", f"ipc://{tmp_path}/none", "--duration", "1"]
    rate = [] if "--rate" in argv else ["--rate", "example=10"]
    assert_refused(ppiped([*base, *rate, *argv]), 2, fragment)


def test_loadgen_without_daemon_is_one_line(tmp_path: Path) -> None:
    """No daemon: the client's timeout as one line and exit 1, not a traceback."""
    p = ppiped(["loadgen", "--endpoint", f"ipc://{tmp_path}/none", "--rate", "example=10", "--duration", "1"])
    assert_refused(p, 1, "no answer from")


def test_layout_error_is_one_line(tmp_path: Path) -> None:
    """A plan whose vGPUs do not fit its cluster (the data plane's LayoutError, or the plan
    check's PlanError) is a user error, not a traceback."""
    d = json.loads(Path(PLAN).read_text())
    d["cluster"]["gpus"]["P4"]["count"] = 6  # the plan keeps 12 P4 vGPUs
    small = tmp_path / "small.json"
    small.write_text(json.dumps(d))
    p = ppiped(["sim", "--plan", str(small), "--profiles", str(EXAMPLE), "--load-factor", "0.5",
                "--duration", "0.2"], timeout=300)
    assert_refused(p, 2, "P4")


def test_documented_usage_still_runs(tmp_path: Path) -> None:
    """The checks refuse only bad values: the README's sim, sweep and plan lines still work."""
    p = ppiped([*SIM, "--load-factor", "0.5", "--json"], timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["policy"] == "ppipe"
    p = ppiped([*SWEEP, "--step", "0.25", "--resolution", "0.05", "--start", "0.75", "--json"], timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert 0 < json.loads(p.stdout)["max_load_factor"] <= 3
    out = tmp_path / "plan.json"
    p = ppiped([*PLAN_CMD, *CLUSTER, "--threads", "1", "--batch-delay-factor", "1.3", "-o", str(out), "--json"],
               timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(out.read_text())["models"][0]["model"] == "example"


@pytest.mark.parametrize("body, fragment", [
    (b"app,func,end_timestamp,duration\na,f,1.0,0.5\na,f,nan,0.1\n", ":3: end_timestamp/duration must be finite"),
    (b"\xff\xfeapp,func\n", "not UTF-8 text: byte 0xff at offset 0"),
    (b"app,func,start\na,f,1\n", "missing duration, end_timestamp"),
    # an infinite period replayed nothing (a traceback) or, folded, 1 request for thousands
    (b"app,func,end_timestamp,duration\na,f,5e-324,0\na,f,0,0\n", "the invocations span 4.94066e-324 s"),
    (b"app,func,end_timestamp,duration\na,f,1e308,0\na,f,-1e308,0\n", "the invocations span inf s"),
])
def test_bad_trace_files_are_named(tmp_path, body, fragment):
    """A trace file that is not UTF-8, lacks columns or holds a NaN time: one line naming it."""
    trace = tmp_path / "trace.csv"
    trace.write_bytes(body)
    p = ppiped([*SIM, "--load-factor", "0.5", "--trace", str(trace)])
    assert_refused(p, 2, fragment)
    assert str(trace) in p.stderr


@pytest.mark.parametrize("cmd", [SIM, SWEEP])
def test_trace_field_past_the_csv_limit_is_one_line(tmp_path, cmd):
    """A field over 131,072 characters was a _csv.Error traceback."""
    trace = tmp_path / "trace.csv"
    trace.write_text("app,func,end_timestamp,duration\n" + "a" * 140_000 + ",f,1.0,0.5\n")
    extra = ["--load-factor", "0.5"] if cmd is SIM else []
    p = ppiped([*cmd, *extra, "--trace", str(trace)])
    assert_refused(p, 2, "not a readable CSV trace")
    assert str(trace) in p.stderr


@pytest.mark.parametrize("cmd", [SIM, SWEEP])
def test_base_plan_without_the_plans_model_is_one_line(tmp_path, cmd):
    """A --base-plan lacking one of the plan's models was a KeyError traceback."""
    d = json.loads(Path(PLAN).read_text())
    d["models"][0]["model"] = "other"
    base = tmp_path / "base.json"
    base.write_text(json.dumps(d))
    extra = ["--load-factor", "0.5"] if cmd is SIM else []
    p = ppiped([*cmd, *extra, "--base-plan", str(base)])
    assert_refused(p, 2, "--base-plan")
    assert "'example'" in p.stderr.strip().splitlines()[-1]


def test_sweep_reads_only_the_plans_profiles(tmp_path: Path) -> None:
    """sweep loaded every file in --profiles and failed on a broken one that sim ignores."""
    (tmp_path / "example.json").write_text((EXAMPLE / "example.json").read_text())
    (tmp_path / "broken.json").write_text("{not json")
    p = ppiped(["sweep", "--plan", PLAN, "--profiles", str(tmp_path), "--duration", "0.2", "--step", "0.5",
                "--resolution", "0.25", "--max-factor", "1", "--json"], timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert 0 <= json.loads(p.stdout)["max_load_factor"] <= 1


@pytest.mark.parametrize("cmd", [SIM, SWEEP])
def test_a_model_without_pipelines_is_refused(tmp_path, cmd):
    """sim ran a plan that check rejects: a model with no pipelines served nothing."""
    d = json.loads(Path(PLAN).read_text())
    d["models"][0]["pipelines"] = []
    bad = tmp_path / "plan.json"
    bad.write_text(json.dumps(d))
    extra = ["--load-factor", "0.5"] if cmd is SIM else []
    p = ppiped([cmd[0], "--plan", str(bad), *cmd[3:], *extra], timeout=300)
    assert_refused(p, 2, "'example' has no pipelines")


@pytest.mark.parametrize("argv,fragment", [
    (["--max-rate", "0"], "argument --max-rate"),  # a division by zero after setting up
    (["--min-slo-ms", "nan"], "argument --min-slo-ms"),
    (["--duration", "nan"], "argument --duration"),
    (["--duration", "1e9"], "argument --duration"),  # terabytes of arrivals
    (["--seed", "-1"], "argument --seed"),
    (["--processes", "0"], "argument --processes"),
    (["--arrivals", "nosuch"], "argument --arrivals"),  # found only after seconds of work
    (["--app", "--vgpus", "0"], "argument --vgpus"),
    (["--app", "--slo-ms", "nan"], "argument --slo-ms"),
    (["--time-scale", "inf"], "argument --time-scale: expected 'auto' or a finite number"),
])
def test_demo_refuses_bad_flags_before_it_starts(argv, fragment):
    assert_refused(ppiped(["demo", *argv], timeout=60), 2, fragment)
