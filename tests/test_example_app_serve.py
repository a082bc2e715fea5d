"""The example app served end to end through the daemon with real ONNX Runtime inference on this
host's CPUs (#17): the models profiled with the ort backend on ``CPU``, planned as an app on two
CPU vGPUs, ``ppiped serve`` with its glue workers and ort executors; the served answers equal
:class:`ppiped.query.local.LocalApp`'s, and under 2x overload every query still gets its one
answer. Then ``ppiped demo --app`` on the same profiles.

The SLO is :data:`ppiped.commands.demo_app.CPU_SLO_MS` (300 ms), not the example's 3.5 ms (a
V100 estimate): on CPU the models take milliseconds, and the scheduler, glue workers, executors
and client share this host's cores, whose time slices add tens of ms (see demo_app's docstring).
No timing is asserted: low load checks that every query is answered OK, not how fast.
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

import numpy as np
import pytest
import uvloop

from ppiped.cli import main
from ppiped.client import Client
from ppiped.commands import demo_app
from ppiped.daemon.launch import short_tmpdir
from ppiped.profiler.example_app import CLASSIFIER, DETECTOR

pytest.importorskip("onnxruntime")


@pytest.fixture(scope="module")
def work():
    with short_tmpdir("ppiped-eas-") as d:
        yield Path(d)


@pytest.fixture(scope="module")
def prepared(work):
    """Built (or taken from plans/example-app), profiled with ort on CPU, planned on 2 vGPUs."""
    (work / "serve").mkdir()
    return demo_app.prepare(work / "serve", vgpus=2)


@pytest.fixture(scope="module")
def cluster(prepared):
    c = demo_app.make_cluster(prepared, log_level="info")
    with c:
        yield c


def _show(c) -> str:
    return "\n".join(f"--- {n}\n{c.tail(n, 30)}" for n in ("serve.log", "executor-0.log", "executor-1.log"))


def test_the_plan_is_an_app_on_cpu(prepared):
    p = prepared
    assert [s.model for s in p.app.stages] == [DETECTOR, CLASSIFIER]
    assert p.app.split == "dp" and p.app.slo_us == demo_app.CPU_SLO_MS * 1000 and p.app.split_done
    assert {q.gpu for m in p.plan.models for pl in m.pipelines for q in pl.partitions} == {"CPU"}
    assert sum(q.num_vgpus for m in p.plan.models for pl in m.pipelines for q in pl.partitions) <= 2
    # the classifier is weighted at fan-out x the detector's rate in the joint plan
    assert p.plan.model(CLASSIFIER).weight == p.app.stages[1].fanout * p.plan.model(DETECTOR).weight
    assert demo_app.query_rate(p.plan, p.app) > 0
    counts = [len(e) for e in p.expected]
    assert 0 in counts and max(counts) >= 3  # frames with no crop and with several


def test_served_answers_equal_the_by_hand_runner(prepared, cluster):
    p = prepared
    try:
        one = demo_app.served_in_order(cluster.client_endpoint, p.app.name, p.frames, range(len(p.frames)))
        rate = 0.1 * demo_app.query_rate(p.plan, p.app)  # low load
        load = uvloop.run(demo_app.offer_queries(cluster.client_endpoint, p.app.name, p.frames, rate, 2.0))
    except BaseException:
        print(_show(cluster))
        raise
    s = load.summary(2.0)
    assert s["sent"] >= 10 and s["ok"] == s["sent"], s  # every query answered OK at low load
    for answers in (one, load.answers):
        c = demo_app.compare(answers, p.expected)
        assert c["equal"], c
        assert c["outputs"] == sum(len(p.expected[k]) for k, _ in answers)  # same crops, every one compared
    assert sum(len(o) for _, o in one) == sum(len(e) for e in p.expected) >= len(p.frames)


def test_overload_every_query_gets_one_answer(prepared, cluster):
    """Twice the planned query rate for 3 s: each query answered OK or refused naming the stage
    and the reason, none without a reply; the OK ones still equal the by-hand outputs."""
    p = prepared
    rate = 2.0 * demo_app.query_rate(p.plan, p.app)
    load = uvloop.run(demo_app.offer_queries(cluster.client_endpoint, p.app.name, p.frames, rate, 3.0, seed=3))
    s = load.summary(3.0)
    assert s["no_reply"] == 0 and s["unnamed"] == 0, (s, _show(cluster))
    assert s["ok"] + s["dropped"] + s["rejected"] == s["sent"] > 2 * rate, s
    stages = {st.name for st in p.app.stages}
    assert set(s["dropped_by_stage"]) | set(s["rejected_by_stage"]) <= stages, s
    assert s["dropped"] + s["rejected"] > 0  # it was an overload
    assert demo_app.compare(load.answers, p.expected)["equal"]
    # the daemon holds no query, and serves on once its executors are back
    end = time.monotonic() + 20
    while time.monotonic() < end:
        st = cluster.status()
        if st and st["vgpus"]["alive"] == 2 and st["apps"]["queries_in_flight"] == 0:
            break
        time.sleep(0.1)
    assert st["apps"]["queries_in_flight"] == 0 and st["apps"]["apps"][p.app.name]["in_flight"] == 0
    k = int(np.argmax([len(e) for e in p.expected]))
    with Client(cluster.client_endpoint, timeout_s=30) as c:
        r = c.submit_query(p.app.name, p.frames[k].tobytes())
    assert demo_app.compare([(k, r.outputs)], p.expected)["equal"]
    log = (cluster.log_dir / "serve.log").read_text(errors="replace")
    assert "Traceback" not in log and "query_internal_errors" not in st["counters"]


def test_demo_app_json(prepared, work, capsys):
    """``ppiped demo --app --duration 2 --json`` (the profiles reused from --keep)."""
    keep = work / "demo"
    keep.mkdir()
    shutil.copytree(prepared.profiles_dir, keep / "prof")
    before = {f.name: f.read_bytes() for f in (keep / "prof").glob("*.json")}
    assert main(["demo", "--app", "--duration", "2", "--json", "--keep", str(keep)]) == 0
    r = json.loads(capsys.readouterr().out)
    assert {f.name: f.read_bytes() for f in (keep / "prof").glob("*.json")} == before  # reused, not measured again
    q = r["queries"]
    assert q["sent"] > 0 and q["ok"] > 0 and q["no_reply"] == 0
    assert q["ok"] + q["dropped"] + q["rejected"] == q["sent"]
    assert r["check"]["equal"] and r["check"]["one_by_one"]["outputs"] > 0
    assert r["check"]["under_load"]["queries"] == q["ok"]
    assert [s["stage"] for s in r["split"]["stages"]] == ["detect", "classify"]
    assert r["split"]["method"] == "dp" and r["split"]["query_rps"] > 0
    assert r["load_factor"] == 0.3 and r["backend"] == "ort"


def test_demo_app_flags_are_checked(capsys):
    for argv, text in ((["--app", "--plan", "x.json"], "drop --plan"),
                       (["--app", "--arrivals", "bursty"], "Poisson"),
                       (["--vgpus", "2"], "for --app"),
                       (["--app", "--vgpus", "999"], "CPUs")):
        assert main(["demo", *argv]) == 2
        assert text in capsys.readouterr().err
