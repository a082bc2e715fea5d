"""One query's life, without a clock or I/O: which stage requests to submit, when, to which
deadline, and when the query is over (OK, or failed at a stage for a reason).

The daemon drives a :class:`QueryTracker` with the wall clock and ZeroMQ (and a simulator could
with a virtual clock): it tells the tracker what happened — a stage request's result, a glue
call's output (k child inputs), a stage request dropped or failed, a glue call failed — and does
what the tracker returns: stage requests to submit (:class:`Submit`, with their deadlines from
:func:`~ppiped.query.app.stage_deadline_us`) and glue calls to run (:class:`Glue`).

Rules: the first failure ends the query (``failed`` = (stage, reason, detail)); every later event
is ignored, and the caller cancels or discards the stage requests still live (:meth:`live`).
A query whose every stage request and glue call has ended without a failure is OK — a query whose
glue yields no children ends when its last request does. ``finished`` turns true exactly once.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .app import App, downstream_us, planned_yield, stage_deadline_us

Estimate = Callable[[int, int], float]  # (stage index, requests) -> µs until they could be done


@dataclass(frozen=True)
class Submit:
    """Submit a request of ``stage`` for node ``node`` with this deadline (µs, the caller's clock)."""

    node: int
    stage: int
    deadline_us: float


@dataclass(frozen=True)
class Glue:
    """Run ``stage``'s glue on node ``parent``'s output; answer with :meth:`QueryTracker.glue_done`."""

    parent: int
    stage: int


class _Node:
    """A stage request: where it sits in the query's tree, and its output once it has one."""

    __slots__ = ("stage", "key", "done", "output")

    def __init__(self, stage: int, key: tuple[int, ...]) -> None:
        self.stage = stage
        self.key = key
        self.done = False
        self.output: Any = None


class QueryTracker:
    """The state of one query of ``app`` (see the module docstring).

    ``mode``: "e2e", "split" or "chain" (:data:`~ppiped.query.app.MODES`); ``arrival_us`` and
    ``deadline_us``: the query's (its own SLO may be below the app's); ``keep_all``: keep every
    stage's outputs for the answer, not only the leaves'.
    """

    __slots__ = ("app", "mode", "arrival_us", "deadline_us", "keep_all", "nodes", "open", "finished",
                 "failed", "_kids", "_leaf")

    def __init__(self, app: App, mode: str, arrival_us: float, deadline_us: float,
                 keep_all: bool = False) -> None:
        self.app = app
        self.mode = mode
        self.arrival_us = arrival_us
        self.deadline_us = deadline_us
        self.keep_all = keep_all
        self.nodes: list[_Node] = []
        self.open = 0  # stage requests and glue calls not yet ended
        self.finished = False
        self.failed: tuple[str, str, str] | None = None  # (stage name, reason, detail)
        self._kids = [app.children(i) for i in range(len(app.stages))]
        self._leaf = [not k for k in self._kids]

    # --- events -------------------------------------------------------------------------------

    def start(self, now_us: float, estimate: Estimate | None = None) -> list[Submit]:
        """The root stage's request (call once, first)."""
        return self._submit(0, [()], now_us, estimate)

    def stage_done(self, node: int, output: Any) -> list[Glue]:
        """Node ``node``'s request has its result (``output``: whatever the caller keeps for it)."""
        if self.finished:
            return []
        n = self.nodes[node]
        if n.done:
            return []
        n.done = True
        self.open -= 1
        kids = self._kids[n.stage]
        if self.keep_all or not kids:
            n.output = output
        self.open += len(kids)
        self._check()
        return [Glue(node, c) for c in kids]

    def glue_done(self, parent: int, stage: int, count: int, now_us: float,
                  estimate: Estimate | None = None) -> list[Submit]:
        """``stage``'s glue made ``count`` inputs of parent ``parent``'s output: their requests."""
        if self.finished:
            return []
        self.open -= 1
        if self.mode == "e2e" and estimate is not None and count > 0:
            # PARD's check at the next stage's admission, now that the number of inputs is
            # known (the simulator's engine._children_in_time applies the same rule)
            rest = self._rest(stage, estimate, count)
            need = float(estimate(stage, count)) + (rest[stage] if rest else 0.0)
            if now_us + need > self.deadline_us:
                self._fail(self.app.stages[stage].name, "early-drop",
                           f"{count} inputs need about {need / 1e3:.1f} ms, "
                           f"{max(0.0, self.deadline_us - now_us) / 1e3:.1f} ms left")
                return []
        key = self.nodes[parent].key
        out = self._submit(stage, [(*key, j) for j in range(count)], now_us, estimate)
        self._check()
        return out

    def stage_failed(self, node: int, reason: str, detail: str = "") -> bool:
        """Node ``node``'s request was dropped or failed; True if that ended the query."""
        if self.finished:
            return False
        self.nodes[node].done = True
        return self._fail(self.app.stages[self.nodes[node].stage].name, reason, detail)

    def glue_failed(self, stage: int, reason: str, detail: str = "") -> bool:
        """A glue call making ``stage``'s inputs failed (or timed out); True if that ended the query."""
        if self.finished:
            return False
        return self._fail(self.app.stages[stage].name, reason, detail)

    def fail(self, stage: str, reason: str, detail: str = "") -> bool:
        """End the query from outside (shutdown, a removed model); True if it was not over yet."""
        if self.finished:
            return False
        return self._fail(stage, reason, detail)

    # --- reading ------------------------------------------------------------------------------

    @property
    def ok(self) -> bool:
        return self.finished and self.failed is None

    def live(self) -> list[int]:
        """Nodes whose stage request has not ended: to cancel or discard once the query failed."""
        return [i for i, n in enumerate(self.nodes) if not n.done]

    def outputs(self) -> list[tuple[str, tuple[int, ...], bool, Any]]:
        """(stage name, key, final, output) of every kept output, by stage order then key."""
        stages = self.app.stages
        kept = [n for n in self.nodes if n.done and (self.keep_all or self._leaf[n.stage])]
        kept.sort(key=lambda n: (n.stage, n.key))
        return [(stages[n.stage].name, n.key, self._leaf[n.stage], n.output) for n in kept]

    def submitted(self) -> list[int]:
        """Stage requests made so far, per stage."""
        out = [0] * len(self.app.stages)
        for n in self.nodes:
            out[n.stage] += 1
        return out

    # --- internals ----------------------------------------------------------------------------

    def _submit(self, stage: int, keys: list[tuple[int, ...]], now_us: float,
                estimate: Estimate | None) -> list[Submit]:
        if not keys:
            return []
        rest = None
        if self.mode == "e2e":
            rest = self._rest(stage, estimate, len(keys))
        d = stage_deadline_us(self.app, stage, self.mode, self.arrival_us, self.deadline_us, now_us, rest)
        out = []
        for k in keys:
            self.nodes.append(_Node(stage, k))
            out.append(Submit(len(self.nodes) - 1, stage, d))
        self.open += len(keys)
        return out

    def _rest(self, stage: int, estimate: Estimate | None, k: int = 1) -> list[float] | None:
        """The downstream path's expected time below ``k`` requests of ``stage`` arriving
        together (PARD): only the stages under it are estimated, its children for what the ``k``
        yield together, deeper ones for one parent request's fan-out (the simulator's
        ``engine._rest``)."""
        if estimate is None or not self._kids[stage]:
            return None
        stages = self.app.stages
        est = [0.0] * len(stages)
        todo = list(self._kids[stage])
        while todo:
            c = todo.pop()
            n = planned_yield(stages[c].fanout)
            est[c] = float(estimate(c, n * k if stages[c].parent == stage else n))
            todo.extend(self._kids[c])
        return downstream_us(self.app, est, self.deadline_us - self.arrival_us)

    def _check(self) -> None:
        if self.open == 0 and not self.finished:
            self.finished = True

    def _fail(self, stage: str, reason: str, detail: str) -> bool:
        self.failed = (stage, reason, detail)
        self.finished = True
        return True
