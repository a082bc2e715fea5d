"""An app: a tree of stages (models) with one end-to-end SLO, and how its deadlines propagate.

The root stage takes the client's frame. Every other stage runs on what a glue callable
(``module:function``) makes of its parent's outputs and the original frame: zero or more inputs
per parent request, ``fanout`` of them on average. A stage's request rate is the app's rate times
the fan-outs along its path, which is all the planner needs to plan every stage as a model.

Three ways to give a stage request its deadline (:func:`stage_deadline_us`), one per system the
issue compares:

- ``split`` (Nexus): the SLO is split across stages; a stage's deadline is the end of its share,
  counted from the query's arrival;
- ``e2e`` (PARD): every stage works to the query's own deadline, less what the rest of its path
  needs after it: the core's live estimate of the stages below (queues and tables) or, when
  larger, the budgets the planner sized them for (a stage that took the whole slack would leave
  its children a path they can only drop on); so a stage drops a request that its downstream
  cannot finish in time, before spending GPU time on it;
- ``chain`` (a client chaining submissions by hand): each stage request gets its stage's budget
  counted from when it is submitted.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

from ..errors import InputError

MODES = ("split", "e2e", "chain")
_GLUE = re.compile(r"[A-Za-z_][\w.]*:[A-Za-z_]\w*")  # (fullmatch: "$" passes a trailing newline)
_NAME = re.compile(r"[A-Za-z0-9_][\w.\-]*")


# Most inputs one parent request may yield on average (a detector's crops: thousands at most).
MAX_FANOUT = 10_000.0
MAX_APP_SLO_US = 3.6e9  # an hour: a video query's deadline is seconds


@dataclass(frozen=True)
class Stage:
    name: str
    model: str
    parent: int = -1  # index of the parent stage; -1: the root
    fanout: float = 1.0  # mean inputs one parent request yields for this stage (root: 1)
    glue: str = ""  # "module:function" making this stage's inputs (root: none)
    budget_us: float = 0.0  # this stage's share of the SLO; 0 until the planner splits it


@dataclass(frozen=True)
class App:
    name: str
    slo_us: float
    stages: tuple[Stage, ...]
    weight: float = 1.0  # query rate share, beside other apps and plain models
    glue_us: float = 0.0  # time kept for each glue step (planning and deadlines)
    split: str = ""  # how the budgets were chosen (reported by the planner)

    # --- structure ---------------------------------------------------------------------------

    def children(self, i: int) -> list[int]:
        return [j for j, s in enumerate(self.stages) if s.parent == i]

    def path(self, i: int) -> list[int]:
        """Stage indices from the root to ``i``."""
        out = []
        while i >= 0:
            out.append(i)
            i = self.stages[i].parent
        return out[::-1]

    def leaves(self) -> list[int]:
        return [i for i in range(len(self.stages)) if not self.children(i)]

    def paths(self) -> list[list[int]]:
        """Every root-to-leaf path (the SLO binds each)."""
        return [self.path(i) for i in self.leaves()]

    def rate_factor(self, i: int) -> float:
        """Requests of stage ``i`` per query: the product of the fan-outs on its path."""
        return math.prod(self.stages[j].fanout for j in self.path(i))

    def stage_of(self, model: str) -> int:
        for i, s in enumerate(self.stages):
            if s.model == model:
                return i
        raise KeyError(model)

    @property
    def split_done(self) -> bool:
        return all(s.budget_us > 0 for s in self.stages)

    def end_us(self, i: int) -> float:
        """Where stage ``i``'s budget ends, from the query's arrival: the budgets on its path and
        one glue step before each stage after the root."""
        p = self.path(i)
        return sum(self.stages[j].budget_us for j in p) + self.glue_us * (len(p) - 1)

    def with_budgets(self, budgets_us: Sequence[float], split: str) -> App:
        if len(budgets_us) != len(self.stages):
            raise ValueError(f"{len(self.stages)} stages, {len(budgets_us)} budgets")
        stages = tuple(replace(s, budget_us=float(b)) for s, b in zip(self.stages, budgets_us, strict=True))
        app = replace(self, stages=stages, split=split)
        app.validate()
        return app

    # --- checks and files --------------------------------------------------------------------

    def validate(self) -> None:
        """Raise :class:`InputError` naming what is wrong."""
        w = f"app {self.name!r}"
        if not _NAME.fullmatch(self.name):
            raise InputError(f"{w}: a name is letters, digits, '_', '-' and '.'")
        if not (0 < self.slo_us <= MAX_APP_SLO_US):
            # (a 10^12 ms SLO planned, and the simulator then ran its queries for ever)
            raise InputError(f"{w}: slo must be a positive number of ms up to {MAX_APP_SLO_US / 1e3:g}, "
                             f"got {self.slo_us / 1e3:.6g}")
        if not (self.weight > 0 and math.isfinite(self.weight)):
            raise InputError(f"{w}: weight must be positive, got {self.weight}")
        if not (self.glue_us >= 0 and math.isfinite(self.glue_us)):
            raise InputError(f"{w}: glue_ms must be >= 0, got {self.glue_us / 1e3}")
        if not self.stages:
            raise InputError(f"{w}: no stages")
        names, models = set(), set()
        for i, s in enumerate(self.stages):
            ws = f"{w}, stage {s.name!r}"
            if not _NAME.fullmatch(s.name):
                raise InputError(f"{w}: stage {i}: a name is letters, digits, '_', '-' and '.'")
            if s.name in names:
                raise InputError(f"{w}: two stages are named {s.name!r}")
            if s.model in models:
                raise InputError(f"{ws}: model {s.model!r} already serves another stage of this app "
                                 "(a model serves one stage)")
            names.add(s.name)
            models.add(s.model)
            if i == 0:
                if s.parent != -1:
                    raise InputError(f"{ws}: the first stage is the root: it takes the client's frame")
                if s.glue:
                    raise InputError(f"{ws}: the root stage takes the client's frame and has no glue")
                if s.fanout != 1.0:
                    raise InputError(f"{ws}: the root stage has no fan-out")
            else:
                if not 0 <= s.parent < i:
                    raise InputError(f"{ws}: its parent must be a stage listed before it")
                if not 0 < s.fanout <= MAX_FANOUT:
                    raise InputError(f"{ws}: fanout is the mean number of inputs a parent request "
                                     f"yields, in (0, {MAX_FANOUT:g}]; got {s.fanout}")
                if not _GLUE.fullmatch(s.glue):
                    raise InputError(f"{ws}: glue must name a callable as 'module:function', "
                                     f"got {s.glue!r}")
            if not (s.budget_us >= 0 and math.isfinite(s.budget_us)):
                raise InputError(f"{ws}: budget must be >= 0, got {s.budget_us}")
        if any(s.budget_us > 0 for s in self.stages):
            if not self.split_done:
                raise InputError(f"{w}: either every stage has a budget or none")
            for p in self.paths():
                end = self.end_us(p[-1])
                if end > self.slo_us * (1 + 1e-9):
                    raise InputError(f"{w}: stage budgets on the path {' -> '.join(self.stages[j].name for j in p)} "
                                     f"add up to {end / 1e3:.3f} ms, over the SLO of {self.slo_us / 1e3:.3f} ms")
        for p in self.paths():
            if self.glue_us * (len(p) - 1) >= self.slo_us:
                raise InputError(f"{w}: the glue steps alone take the whole SLO")

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name, "slo_us": self.slo_us, "weight": self.weight, "glue_us": self.glue_us,
            "split": self.split,
            "stages": [{"name": s.name, "model": s.model,
                        "after": self.stages[s.parent].name if s.parent >= 0 else None,
                        "fanout": s.fanout, "glue": s.glue or None, "budget_us": s.budget_us}
                       for s in self.stages],
        }


def app_from_json(d: Any, source: str = "<memory>") -> App:
    """An app from a plan's ``apps`` entry (``slo_us``) or a user's apps file (``slo_ms``)."""
    if not isinstance(d, dict):
        raise InputError(f"{source}: an app is a table/object")
    name = d.get("name")
    w = f"{source}: app {name!r}"
    known = {"name", "slo_us", "slo_ms", "weight", "glue_us", "glue_ms", "split", "stages"}
    extra = sorted(set(d) - known)
    if extra:
        raise InputError(f"{w}: unknown key(s) {', '.join(extra)} (known: {', '.join(sorted(known))})")
    if not isinstance(name, str):
        raise InputError(f"{source}: every app needs a name")
    slo = _num(d, "slo_us", w) if "slo_us" in d else 1e3 * _num(d, "slo_ms", w, required=True)
    glue = _num(d, "glue_us", w) if "glue_us" in d else 1e3 * _num(d, "glue_ms", w, default=0.0)
    raw = d.get("stages")
    if not isinstance(raw, list) or not raw:
        raise InputError(f"{w}: 'stages' must be a non-empty list")
    index: dict[str, int] = {}
    stages = []
    for i, s in enumerate(raw):
        ws = f"{w}, stages[{i}]"
        if not isinstance(s, dict):
            raise InputError(f"{ws}: a stage is a table/object")
        sk = {"name", "model", "after", "fanout", "glue", "budget_us", "budget_ms"}
        extra = sorted(set(s) - sk)
        if extra:
            raise InputError(f"{ws}: unknown key(s) {', '.join(extra)} (known: {', '.join(sorted(sk))})")
        model = s.get("model")
        if not isinstance(model, str) or not model:
            raise InputError(f"{ws}: 'model' must name a model")
        sname = s.get("name", model)
        if not isinstance(sname, str):
            raise InputError(f"{ws}: 'name' must be a string")
        after = s.get("after")
        if after is None:
            parent = -1
        elif isinstance(after, str) and after in index:
            parent = index[after]
        else:
            raise InputError(f"{ws}: 'after' must name a stage listed before it "
                             f"(listed: {', '.join(index) or 'none'}), got {after!r}")
        budget = _num(s, "budget_us", ws) if "budget_us" in s else 1e3 * _num(s, "budget_ms", ws, default=0.0)
        glue_fn = s.get("glue") or ""
        if not isinstance(glue_fn, str):
            raise InputError(f"{ws}: 'glue' must be a 'module:function' string")
        stages.append(Stage(sname, model, parent, _num(s, "fanout", ws, default=1.0), glue_fn, budget))
        index.setdefault(sname, i)
    split = d.get("split", "")
    if not isinstance(split, str):
        raise InputError(f"{w}: 'split' must be a string")
    app = App(name, slo, tuple(stages), _num(d, "weight", w, default=1.0), glue, split)
    try:
        app.validate()
    except InputError as e:  # its messages name the app and stage; the file goes in front
        raise InputError(f"{source}: {e}") from None
    return app


def apps_from_json(items: Any, source: str = "<memory>") -> list[App]:
    """A list of apps, checked together: names unique, no model in two apps."""
    if not isinstance(items, list):
        raise InputError(f"{source}: 'apps' must be a list of apps")
    apps = [app_from_json(d, f"{source}: apps[{i}]") for i, d in enumerate(items)]
    seen: dict[str, str] = {}
    names = set()
    for a in apps:
        if a.name in names:
            raise InputError(f"{source}: two apps are named {a.name!r}")
        names.add(a.name)
        for s in a.stages:
            if s.model in seen:
                raise InputError(f"{source}: model {s.model!r} serves a stage of both {seen[s.model]!r} "
                                 f"and {a.name!r} (a model serves one stage)")
            seen[s.model] = a.name
    return apps


def _num(d: dict, key: str, where: str, default: float | None = None, required: bool = False) -> float:
    if key not in d:
        if required or default is None:
            raise InputError(f"{where}: missing {key!r}")
        return default
    v = d[key]
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise InputError(f"{where}: {key!r} must be a number, got {v!r}")
    return float(v)


# --- deadlines --------------------------------------------------------------------------------


# How far above the mean fan-out PARD's downstream estimate plans, in standard deviations of a
# Poisson count (mean + z sqrt(mean)): a frame with twice the usual detections is the query
# whose children come back too late, after the GPU time upstream is spent. Measured with
# bench/dag.py at load 1.3 (10 s x 2 seeds): the 3-stage app's invalid GPU time 0.80 % at z = 0,
# 0.61 % at 1, 0.45 % at 3, 0.49 % at 5, goodput 0.984-0.987 throughout.
YIELD_Z = 3.0


def planned_yield(fanout: float) -> int:
    """Requests one parent request yields, as PARD's downstream estimate counts them."""
    return max(1, math.ceil(fanout + YIELD_Z * math.sqrt(fanout)))


def downstream_us(app: App, stage_us: Sequence[float], span_us: float | None = None) -> list[float]:
    """Per stage, the time its slowest path below it needs after it ends: a glue step and the
    child stage's expected time (``stage_us``: queueing, batching and inference), recursively.

    With ``span_us`` (the query's deadline less its arrival) and an SLO split, a stage counts
    at least its planned share of the span, whatever its live estimate: its own deadline will
    keep that much for the stages after it, so an upstream stage that took the time a live
    estimate left free would leave this stage less than it was sized for. (Summing the live
    estimates and comparing the total with the planned rest lets one congested stage hide
    behind an idle one.)"""
    floor = [0.0] * len(app.stages)
    if span_us is not None and app.split_done:
        floor = [s.budget_us * span_us / app.slo_us for s in app.stages]
    rest = [0.0] * len(app.stages)
    for i in range(len(app.stages) - 1, -1, -1):  # children come after their parents
        kids = app.children(i)
        rest[i] = max((app.glue_us + max(stage_us[c], floor[c]) + rest[c] for c in kids), default=0.0)
    return rest


def stage_deadline_us(app: App, i: int, mode: str, query_arrival_us: float, query_deadline_us: float,
                      submit_us: float, rest_us: Sequence[float] | None = None) -> float:
    """The deadline a request of stage ``i`` is scheduled against (see the module docstring).

    ``split`` scales the planned budgets to the query's own SLO (a client may ask for less than
    the app's); ``e2e`` takes ``rest_us`` from :func:`downstream_us` (live estimates) and the
    planned budgets below stage ``i``, whichever is larger; ``chain`` counts the stage's
    budget from ``submit_us``, the time the request reaches the scheduler.
    """
    if mode == "e2e":
        rest = rest_us[i] if rest_us is not None else 0.0
        if app.split_done:  # never less than the planned stages after it were sized for
            rest = max(rest, (query_deadline_us - query_arrival_us) * (1.0 - app.end_us(i) / app.slo_us))
        return query_deadline_us - rest
    if not app.split_done:
        raise InputError(f"app {app.name!r} has no SLO split: plan it first")
    if mode == "split":
        return query_arrival_us + (query_deadline_us - query_arrival_us) * app.end_us(i) / app.slo_us
    if mode == "chain":
        return submit_us + app.stages[i].budget_us
    raise InputError(f"unknown deadline mode {mode!r} (choose from {', '.join(MODES)})")
