"""The data plane of ppiped: one implementation, driven by the simulator and the daemon alike.

Nothing here reads a clock or does I/O (DESIGN.md, "One core, two clocks"). The caller passes the
time into every call; the algorithm runs in compiled code (``ppiped.kernels``), one call per
decision.

Units and ids
-------------
- Time: float64 **µs** on the caller's clock, any epoch (the daemon: a monotonic clock; the
  simulator: its virtual clock). Times passed to ``decide``/``gc`` must not go backwards.
- :class:`Layout` numbers everything densely: models in plan order; pipelines model by model
  (``layout.pipe_model[p]``, ``layout.pipe_index[p]`` = index in the plan); pools pipeline by
  pipeline and partition by partition; vGPUs pool by pool; servers type by type. Resources (the
  things with reservation tables): vGPU ``v`` is resource ``v``; server ``s`` has uplink
  ``V + 2s`` and downlink ``V + 2s + 1`` (``layout.uplink(s)`` / ``layout.downlink(s)``).
- A reservation handle is an int64: ``(sequence << 20) | resource``.

Placement
---------
``Layout.from_plan(plan, profiles)`` places every pool's vGPUs on physical GPUs and servers
deterministically: per GPU type and partition index, vGPUs are packed first-fit on whole GPUs
(larger vGPUs first; pools of one partition index may share a GPU when their counts are
fractional), partition indices take consecutive GPUs, GPU slot ``g`` of a type is in server
``g // per_server``; then whole GPUs swap slots within their type while the planned share of
transfers that wait on a NIC past their model's slack falls, never putting two models'
transfers on a NIC they did not share (``placement.py``; ``from_plan(..., balance=False)``
keeps the consecutive slots). It also holds the latency tables ``lat[pool, b-1]`` (inference),
``tin[pool, b-1]`` (NIC transfer of the pool's input, 0 for a first pool) and ``rem`` (sum of
both to the end of the pipeline), µs, from the profiles. Same-server hops need no transfer and
reserve no NIC; clients' inputs and results are not modelled on the NIC.

The scheduler
-------------
``Scheduler(plan, profiles, policy="ppipe", layout=None, *, min_wait_us=1.0, wait_guard_us=0.0,
margin_quantile=0.9, margin_quantile_hi=0.99, margin_step=0.02, margin_max=4.0, margin_prior=1.25,
class_room=0.25, pressure_room=0.2, noise_z=0.0, room_quantile=0.995, work_conserving=True)``

- ``submit(req_id, model, arrival_us, deadline_us=None, priority=0)``: queue a request (deadline
  defaults to arrival + the model's SLO from the plan). ``priority`` > 0 is the high class
  (Accordion): the reserving policies keep it in a second queue per model and batch it first;
  while it is active (an arrival within 20 SLOs) low requests are scheduled against their
  deadline less ``class_room`` x SLO, so that booking on arrival leaves the tables room for the
  high class; reactive ignores it. ``cancel(req_id, model)`` withdraws a pending one.
  ``submit_many(first_id, count, model, arrival_us, deadline_us=None, priority=0)`` queues ids
  ``first_id ..`` that share all else (one client message) in one compiled call.
- ``decide(now_us) -> Actions``: the batching decision for every model queue that changed since
  its last decision or whose wake-up time has come. Returns (valid until the next ``decide``):

  * dispatches: ``Actions.dispatches()`` gives :class:`Dispatch` objects (model, pipeline,
    stage, path of vGPU ids, final, request ids, per-request source vGPU, expected finish µs,
    reservations: :class:`Reservation` (handle, resource, kind infer|uplink|downlink|claim,
    hop, vgpu, start_us, end_us)); the same data is in flat arrays for speed
    (``Actions.model``, ``.path``, ``.req_id``, ``.handle``, ... see :class:`Actions`).
  * drops: ``Actions.drops()`` gives ``(req_id, reason)``; reasons ``deadline`` (no batch size
    meets the request's deadline), ``no-capacity`` (a pool of every pipeline of the model has no
    live vGPU), ``early-drop`` (policy ppipe-early-drop).
  * ``Actions.wake_at``: call ``decide`` again at this time if nothing else happens first
    (inf: no need). Also call it after every ``submit`` and, under ``reactive``, after reports.
  * ``Actions.probes``: probe() calls this decision made (``stats()["probes"]`` in total).

  Every request ends exactly once: in a *final* dispatch (its last partition is dispatched) or
  in a drop.
- ``report(handle, actual_start_us, actual_end_us)`` / ``report_many(...)``: feedback from an
  executor. Under ppipe it corrects the reservation tables (late: later reservations of that
  resource are pushed back as a FIFO executor would run them; early: the interval shrinks and,
  with ``work_conserving``, the reservations queued right behind it on that vGPU move forward by
  as much; ``end <= start``: it did not run and the interval goes) and teaches the vGPU's
  margins: two quantiles (``margin_quantile``, ``margin_quantile_hi``) of measured / profiled
  latency. Inferences are reserved for profile x margin: the low quantile, or the high one
  while the model is under pressure (it dropped within one SLO) and overloaded (arrivals over
  1.15 x its planned rate in its last or current count window): back-to-back bookings then
  cascade every overrun. (In every spell of pressure, as before session 24, the high margins
  cost Figure 6 0.4 points at σ = 0.05 and 1.5 at σ = 0.1: near capacity each drop made the
  paths longer and so caused more drops.) (The median as the low quantile gained half a point of
  Figure 6 at σ = 0.05 and lost overload: ppipe at load 1.3 went from 7 % to 21 % late, pard's
  late share doubled, as bookings made before pressure cascade once it comes.)
  Optionally (``noise_z`` > 0) deadline checks keep that many standard deviations of the path's
  noise on top of the booked finish: each vGPU's log-sd is read off its learned high margin, and
  a hop's variance is its own run plus the runs booked before it on its vGPU, so the guard grows
  with the square root of the time booked ahead; dispatches report the booked end. (Off by
  default: with the high margins under pressure it cost more drops than it saved late ends.) Optional:
  uncorrected reservations simply expire and margins stay at 1. Under reactive it is required: reporting a ``claim`` frees the vGPU and moves
  the batch on to the next pool (failure: back to the queue it came from).
- ``remove_vgpu(v)`` / ``restore_vgpu(v)``: a failed executor. Its reservations are released and
  no new batch goes to it; batches already dispatched through it are the caller's to retry.
- ``gc(now_us)``: forget intervals that ended at or before now (tables also do it themselves
  when a row fills up). The tables' capacity only grows if more reservations are live at once.
- Inspection: ``probe(pipeline, bs, now)``, ``earliest_slot(resources, t, d)``, ``table(r)``,
  ``table_sizes()``, ``pending()``, ``stats()``.

Policies (``POLICIES``; a :class:`Policy` is knobs of the one algorithm, not a copy of it)
-----------------------------------------------------------------------------------------
- ``ppipe`` (PPipe Algorithm 1 with reservations). Per model queue (a min-max heap by deadline):
  probe every pipeline of the model at its planned batch size and pick the least *waiting*
  (finish - now - busy time of the path: time queued for resources; ties: lowest pipeline id);
  then the largest batch size b <= planned whose probed finish meets the earliest deadline. No b
  fits: drop every request whose deadline is before the earliest finish any probed b reaches,
  and decide again. Fewer requests than b: wait until ``deadline - finish(n) - wait_guard_us``
  (probed at the current count n) unless that is less than ``min_wait_us`` away, in which case
  dispatch the n now; it also dispatches now when the model's mean arrival gap (an EWMA that
  starts from the planned rate) is longer than that wait, and the wait leaves the path the room
  its high-quantile margins would take. Pipelines that meet the earliest deadline come first,
  and before dropping, the model's other pipelines are tried at the sizes the queue can fill.
  A held batch leaves twice the gap between its path's high and low margins.
  Otherwise reserve the path and dispatch the b earliest deadlines; repeat.
  ``probe``: per pool, each live vGPU's input transfer (joint uplink + downlink slot, only when
  the previous vGPU is on another server) then its inference slot, both the earliest that fits
  (gaps included); the vGPU whose output can leave first wins: its finish, or, where a transfer
  follows (not the last pool), the first time after it that its server's uplink is free for that
  transfer (as the PPipe artifact's ``ReservationOffer.reserve``); ties: the earlier finish, the
  vGPU whose server uplink frees first, then the lowest id.
- ``reactive`` (the paper's ablation: per-pool adaptive batching, no reservations). Each pool
  batches on its own whenever one of its vGPUs is idle: first pools take from the model's
  queue (pipelines in id order), later pools from their own queue, fed by the reports of the
  previous pool (requests re-batch freely between pools). Batch size: the largest b <= planned
  and <= queued with ``now + rem[pool, b-1] <= earliest deadline`` (profiled remaining latency,
  no queueing); none: drop the earliest request (``deadline``). The vGPU (same server as the
  earliest request's input if one is idle, else the lowest idle id) is *claimed* until its
  claim is reported; nothing is reserved and it never waits for a fuller batch.
- ``ppipe-early-drop`` (Nexus-style hook): as ppipe but the batch size stays at the planned one;
  requests it cannot serve in time are dropped instead of shrinking the batch.
- ``pard`` (PARD): as ppipe, but when a full batch served now ends after the earliest deadline
  and the queue holds more than one batch (or, while the model is under pressure, i.e. dropped
  within its SLO: one batch, or fewer with arrivals faster than planned), the batch stays full
  and every request it cannot serve in time is dropped now (``early-drop``) on the probe's
  whole-path estimate; for one SLO after such a drop, while the model is also *overloaded*
  (below), batches take the latest deadlines first (high-budget-first, the DEPQ's max end),
  then earliest-deadline order returns; in bursts within the planned rate they keep the
  earliest deadlines first. Under pressure
  it books against the deadline less the model's *room*: the ``room_quantile`` quantile of
  how much later than booked its paths' last hops end, learned from reports within
  [0, ``pressure_room`` x SLO] (starting at half of it), and takes the vGPUs' high-quantile
  margins while the model is *overloaded* (as every policy does); in bursts within the planned
  rate it keeps the low margins and a second room learned at a lower quantile (0.93,
  ``state.ROOM_Q_BURST``).

Speed: a decision is one compiled call; its Python wrapper returns preallocated arrays. The
simulator may call the ``ppiped.kernels.sched`` entry points directly from compiled code
(``decide_ppipe(A, now, fresh) -> (status, n_dispatch, n_drop, wake)``, ``submit``, ``report``,
``gc``; the arena ``A`` is ``Scheduler._A``, grown by ``Scheduler._grow(status)`` on a
``FULL_*`` status).
"""

from .layout import Layout, LayoutError
from .scheduler import POLICIES, Actions, Dispatch, Policy, Reservation, Scheduler

__all__ = ["Actions", "Dispatch", "Layout", "LayoutError", "POLICIES", "Policy", "Reservation", "Scheduler"]
