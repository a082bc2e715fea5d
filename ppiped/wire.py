"""The ppiped wire protocol: every message type, its header fields and their validation.

A message is a ZeroMQ multipart: ``[header, payload, ...]``. The header is a msgpack array
``[VERSION, TYPE, field, ...]`` (positional, so it stays a few dozen bytes); payload frames are
raw bytes (client frames, fp16 feature maps, results) that the scheduler passes on zero-copy and
never decodes. Each type has a :class:`Message` struct with named fields (:class:`Submit`,
:class:`Result`, ...), in wire order after ``version`` and ``type``. :func:`decode` checks the
version, the type, the arity and the type of every field, returns that struct and raises
:class:`ProtocolError` naming the message and field; each caller then checks the payload frame
count with :func:`expect_frames`. Any plain msgpack client speaks it: the structs are msgspec's
array-like structs, which read and write exactly those arrays.

Sockets: clients (DEALER) ↔ scheduler ROUTER; executor processes (DEALER, one per process, which
may host many vGPUs) ↔ scheduler executor ROUTER; executor → executor over PUSH → PULL.

Times on the wire are integer microseconds of the *receiver's* monotonic clock for what the
scheduler sends (reserved starts) and of the *sender's* clock for what executors send (clock,
feedback); the scheduler keeps a per-executor clock offset, so hosts need no synchronised clocks.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Callable, Sequence
from enum import IntEnum
from types import SimpleNamespace
from typing import Annotated, Any

import msgspec

VERSION = 1
MAX_HEADER_BYTES = 1 << 20
# Largest PING header a scheduler answers: its token comes back in the PONG, so a large one
# made every unread PING cost the scheduler its size again in memory.
MAX_PING_BYTES = 512
# Largest latency (µs) an assignment may carry: a profile's own upper bound, 3 hours (see
# profiles.MAX_LATENCY_US); and the heartbeat interval a WELCOME may ask for (ms).
MAX_ASSIGNED_US = 1e10
MAX_HEARTBEAT_MS = 60_000
FRAME_SLACK = 4096  # above a payload cap, so a frame at the cap still passes ZMQ_MAXMSGSIZE


class T(IntEnum):
    """Message types. 1–15: client ↔ scheduler; 16–: executor ↔ scheduler and executor ↔ executor."""

    SUBMIT = 1  # C→S  model, slo_us (0: the model's SLO), ids[, priority[, sent_us]] + one frame per id
    REPLY = 2  # S→C   ids, status, reason, meta                           + one frame per id if OK
    ERROR = 3  # any   code, message (the message could not be tied to request ids)
    PING = 4  # C→S    token
    PONG = 5  # S→C    token, info (dict: models, SLOs, limits)
    QUERY = 6  # C→S   app, slo_us (0: the app's), qid[, stages[, priority[, sent_us]]] + one frame
    ANSWER = 7  # S→C  qid, status, reason, stage, detail, outputs        + one frame per output
    REGISTER = 16  # E→S  vgpus, data_endpoint, backend, pid, clock_us, incarnation
    WELCOME = 17  # S→E   assignments (one list per vGPU, see Assignment), heartbeat_ms, data_key (its hop-tag key)
    PEERS = 18  # S→E     directory: flat [vgpu, endpoint, ...] of every registered vGPU
    HEARTBEAT = 19  # E→S clock_us, queued batches
    DISPATCH = 20  # S→E  batch, path (vGPU per hop), starts (µs, per hop, each in its executor's clock), ids,
    #                     tags (hop_tag of each later hop) + one input frame per id
    FORWARD = 21  # E→E   batch, path, starts, hop, ids, meta (tensor spec or None), tags (DISPATCH's) + frames
    RESULT = 22  # E→S    batch, ids, meta, failed (flat [id, reason, ...]), feedback (as FEEDBACK's
    #                     entries: piggybacked, saves a message per batch)     + one frame per id
    FEEDBACK = 23  # E→S  entries: flat [vgpu, batch, hop, ready_us, start_us, end_us, ...] (sender clock)
    CANCEL = 24  # S→E    batches whose reservations are void (a vGPU on the path was lost)
    BYE = 25  # E→S       vgpus leaving on purpose
    ALIVE = 26  # S→E     (no fields) liveness probe: with mandatory routing, sending it fails at
    #                     once if the executor's connection is gone; executors ignore it
    PREPARE = 27  # S→E   prep, assignments (as WELCOME's): load these now, keep serving the current
    #                     ones; the assignment comes into force at the next WELCOME that carries it
    PRELOADED = 28  # E→S prep, load_us, error ("": ready to switch): exactly one per PREPARE


class Status(IntEnum):
    OK = 0
    DROPPED = 1  # accepted, then not served in time (deadline, lost executor, shutdown)
    REJECTED = 2  # never admitted: unknown model, oversize payload, malformed, overloaded


# Reasons (the ``reason`` field of REPLY and ``code`` of ERROR): stable strings for counters.
DEADLINE = "deadline"  # no batch could finish before the request's deadline
EXECUTOR_LOST = "executor-lost"  # its batch was on a vGPU that died and the deadline did not allow a retry
NO_CAPACITY = "no-capacity"  # the model has no live pipeline (every pool lost a vGPU)
SHUTDOWN = "shutdown"
UNKNOWN_MODEL = "unknown-model"
PAYLOAD_TOO_LARGE = "payload-too-large"
BAD_INPUT = "bad-input"  # the executor could not use the frame (wrong size for the model input)
OVERLOADED = "overloaded"  # too many requests pending in the scheduler
MALFORMED = "malformed"
VERSION_MISMATCH = "version"
MODEL_REMOVED = "model-removed"  # a replan removed the model while the request was queued
UNREGISTERED = "unregistered"  # an executor spoke before registering (scheduler restarted): re-register
# the scheduler restarted and lost the request (client side), or a request stamped with an
# earlier scheduler's epoch reached a restarted one, which refuses it unserved
DAEMON_RESTARTED = "daemon-restarted"
DAEMON_UNREACHABLE = "daemon-unreachable"  # client side: the scheduler stopped answering pings
UNAUTHORIZED = "unauthorized"  # a peer message without the credentials its kind needs
VGPU_TAKEN = "vgpu-taken"  # another live executor serves that vGPU: retry (it may be about to die)
QUARANTINED = "quarantined"  # its batches kept going overdue: the scheduler takes it back later; retry
# Reasons only a query (QUERY/ANSWER) ends with; the others above apply to its stages too.
UNKNOWN_APP = "unknown-app"
GLUE_ERROR = "glue-error"  # a glue callable raised, returned something unusable, or its worker died
GLUE_TIMEOUT = "glue-timeout"  # a glue call ran past glue.timeout_ms (its worker is replaced)
FAILED = "failed"  # an executor could not run a stage request
EARLY_DROP = "early-drop"  # the policy dropped a stage request early (its path cannot finish in time)


class ProtocolError(ValueError):
    """A header that is not a valid message; ``code`` is a reason string from this module."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


# --- messages -------------------------------------------------------------------------------

UInt = Annotated[int, msgspec.Meta(ge=0)]
UInts = list[UInt]
Ints = list[int]
CLOCK_LIMIT = 1 << 62  # µs (146,000 years): a clock past it is no clock, and offsets added to it stay int64
Clock = Annotated[int, msgspec.Meta(ge=0, lt=CLOCK_LIMIT)]


class Message(msgspec.Struct, array_like=True):
    """A decoded header: ``[version, type, *fields]`` on the wire, positional, so it stays a few
    dozen bytes. (msgspec's own tag would take index 0, where the version is: :func:`decode`
    picks the type by its byte instead.)"""

    version: int
    type: int


class Submit(Message):
    """C→S, + one frame per id. ``priority`` (0 low, 1 high), ``sent_us`` (the sender's
    monotonic clock at send, µs; 0: unknown) and ``epoch`` (the scheduler epoch the sender last
    heard in a PONG; 0: none) are optional trailing fields."""

    model: str
    slo_us: UInt  # 0: the model's SLO
    ids: UInts
    priority: UInt = 0
    sent_us: UInt = 0
    epoch: UInt = 0


class Reply(Message):
    """S→C, + one frame per id if OK."""

    ids: UInts
    status: UInt
    reason: str
    meta: Any


class Error(Message):
    """Any direction: a message that could not be tied to request ids."""

    code: str
    message: str


class Ping(Message):
    token: Any


class Pong(Message):
    token: Any
    info: dict  # models, SLOs, limits


class Query(Message):
    """C→S, + one frame. ``stages``, ``priority``, ``sent_us`` and ``epoch`` (as SUBMIT's) are
    optional trailing fields."""

    app: str
    slo_us: UInt  # 0: the app's
    qid: UInt
    stages: UInt = 0
    priority: UInt = 0
    sent_us: UInt = 0
    epoch: UInt = 0


class Answer(Message):
    """S→C, + one frame per output."""

    qid: UInt
    status: UInt
    reason: str
    stage: str
    detail: str
    outputs: list


class Register(Message):
    vgpus: UInts
    data_endpoint: str
    backend: str
    pid: UInt
    clock_us: Clock
    incarnation: UInt


class Welcome(Message):
    """S→E. ``data_key``: this executor's own key (random, per registration), under which the
    scheduler signs each hop of a batch that this executor is to run (:func:`hop_tag`); only an
    executor with an assignment is told it, and no other executor learns it."""

    assignments: list  # one list per vGPU, see Assignment
    heartbeat_ms: UInt
    data_key: bytes = b""


class Peers(Message):
    directory: list  # flat [vgpu, endpoint, ...]


class Heartbeat(Message):
    """E→S. ``unreachable`` (optional, trailing): next-hop vGPUs the executor gave up forwarding
    to since its last heartbeat (no endpoint in its directory, or no connection). ``loading``
    (optional, trailing): it is alive but still loading its assignment, so it is neither silent
    nor ready (an engine load may take minutes)."""

    clock_us: Clock
    queued: UInt
    unreachable: UInts = []
    loading: bool = False


Tag = Annotated[bytes, msgspec.Meta(max_length=64)]
Tags = list[Tag]


class Dispatch(Message):
    """S→E, + one input frame per id. ``tags[j - 1]``: hop j's :func:`hop_tag`, which the
    FORWARD into hop j carries (the whole list rides along the path)."""

    batch: UInt
    path: UInts
    starts: Ints
    ids: UInts
    tags: Tags = []


class Forward(Message):
    batch: UInt
    path: UInts
    starts: Ints
    hop: UInt
    ids: UInts
    meta: Any  # tensor spec or None
    tags: Tags = []  # DISPATCH.tags: the receiver checks tags[hop - 1]


class Result(Message):
    """E→S, + one frame per id; ``feedback`` as FEEDBACK's entries (piggybacked)."""

    batch: UInt
    ids: UInts
    meta: Any
    failed: list  # flat [id, reason, ...]
    feedback: Ints


class Feedback(Message):
    entries: Ints  # flat [vgpu, batch, hop, ready_us, start_us, end_us, ...]


class Cancel(Message):
    batches: UInts


class Bye(Message):
    vgpus: UInts


class Alive(Message):
    pass


class Prepare(Message):
    prep: UInt
    assignments: list


class Preloaded(Message):
    prep: UInt
    load_us: UInt
    error: str


STRUCTS: dict[int, type[Message]] = {
    T.SUBMIT: Submit, T.REPLY: Reply, T.ERROR: Error, T.PING: Ping, T.PONG: Pong, T.QUERY: Query,
    T.ANSWER: Answer, T.REGISTER: Register, T.WELCOME: Welcome, T.PEERS: Peers,
    T.HEARTBEAT: Heartbeat, T.DISPATCH: Dispatch, T.FORWARD: Forward, T.RESULT: Result,
    T.FEEDBACK: Feedback, T.CANCEL: Cancel, T.BYE: Bye, T.ALIVE: Alive, T.PREPARE: Prepare,
    T.PRELOADED: Preloaded,
}
PRIORITIES = 2  # SUBMIT.priority: 0 low, 1 high
FEEDBACK_STRIDE = 6


# --- field checks (the error path: say which field is wrong, as msgspec's errors do not) ------


def _uint(x: Any) -> bool:
    return type(x) is int and x >= 0


def _int(x: Any) -> bool:
    return type(x) is int


def _clock(x: Any) -> bool:
    return type(x) is int and 0 <= x < CLOCK_LIMIT


def _str(x: Any) -> bool:
    return type(x) is str


def _uints(x: Any) -> bool:
    return type(x) is list and all(type(i) is int and i >= 0 for i in x)


def _ints(x: Any) -> bool:
    return type(x) is list and all(type(i) is int for i in x)


def _bytes(x: Any) -> bool:
    return type(x) is bytes


def _bool(x: Any) -> bool:
    return type(x) is bool


def _list(x: Any) -> bool:
    return type(x) is list


def _dict(x: Any) -> bool:
    return type(x) is dict


def _any(x: Any) -> bool:
    return True


def _tags(x: Any) -> bool:
    return type(x) is list and all(type(t) is bytes and len(t) <= 64 for t in x)


_CHECKS: dict[Any, tuple[Callable[[Any], bool], str]] = {
    UInt: (_uint, "unsigned int"), int: (_int, "int"), Clock: (_clock, "a clock in µs below 2^62"),
    str: (_str, "string"), bool: (_bool, "bool"),
    bytes: (_bytes, "bytes"), UInts: (_uints, "list of unsigned ints"), Ints: (_ints, "list of ints"), list: (_list, "list"),
    dict: (_dict, "map"), Any: (_any, "any"), Tags: (_tags, "list of byte strings of at most 64 bytes")}

Field = tuple[str, Callable[[Any], bool], str]
# per type: (name, check, kind) of each field after version and type, from the structs
SCHEMAS: dict[int, tuple[Field, ...]] = {
    t: tuple((f.name, *_CHECKS[f.type]) for f in msgspec.structs.fields(c)[2:]) for t, c in STRUCTS.items()}
# trailing fields a sender may leave out, with the value they then take (older clients send
# SUBMIT without a priority: the low class; without sent_us, the client's monotonic clock in µs
# when it sent the message: 0, unknown, and the SLO clock starts when the scheduler reads it)
OPTIONAL: dict[int, tuple[Any, ...]] = {
    t: d for t, c in STRUCTS.items()
    if (d := tuple(f.default if f.default is not msgspec.NODEFAULT else f.default_factory()
                   for f in msgspec.structs.fields(c)
                   if f.default is not msgspec.NODEFAULT or f.default_factory is not msgspec.NODEFAULT))}

# per type: its decoder and the largest fixarray byte it takes (msgspec ignores extra trailing
# elements of an array-like struct; the wire refuses them)
_FAST = {int(t): (msgspec.msgpack.Decoder(c), 0x90 + len(c.__struct_fields__)) for t, c in STRUCTS.items()}
_fast_for = _FAST.get
_any_decoder = msgspec.msgpack.Decoder()


def decode(frame: Any) -> Message:
    """Validate a header frame (bytes, memoryview or ``zmq.Frame``); return its typed struct.

    A header as this module writes it (a fixarray starting ``1, type``) is decoded and checked
    by the type's msgspec decoder, in C; anything else, and anything that fails there, takes
    :func:`_decode_checked`, which accepts the same headers and names the wrong field."""
    buf = getattr(frame, "buffer", frame)
    n = len(buf)
    if n > MAX_HEADER_BYTES:
        raise ProtocolError(MALFORMED, f"header of {n} bytes exceeds {MAX_HEADER_BYTES}")
    if n > 2 and buf[1] == VERSION:
        fast = _fast_for(buf[2])
        if fast is not None and 0x92 <= buf[0] <= fast[1]:
            try:
                return fast[0].decode(buf)
            except (msgspec.MsgspecError, RecursionError, UnicodeDecodeError):
                pass
    return _decode_checked(buf)


def _decode_checked(buf: Any) -> Message:
    """:func:`decode` in Python: slower, for any msgpack spelling of a header, and says what
    is wrong with one."""
    try:
        h = _any_decoder.decode(buf)
    except UnicodeDecodeError as e:
        raise ProtocolError(MALFORMED, f"header holds a string that is not UTF-8 (byte {e.start})") from None
    except Exception as e:  # msgspec raises several types for bad input (RecursionError, ...)
        raise ProtocolError(MALFORMED, f"header is not msgpack: {type(e).__name__}") from None
    if type(h) is not list or len(h) < 2:
        raise ProtocolError(MALFORMED, "header must be a msgpack array [version, type, ...]")
    if h[0] != VERSION:
        raise ProtocolError(VERSION_MISMATCH, f"protocol version {brief(h[0])}; this side speaks {VERSION}")
    schema = SCHEMAS.get(h[1]) if type(h[1]) is int else None
    if schema is None:
        raise ProtocolError(MALFORMED, f"unknown message type {brief(h[1])}")
    if len(h) != 2 + len(schema):
        opt = OPTIONAL.get(h[1], ())
        missing = 2 + len(schema) - len(h)
        if not 0 < missing <= len(opt):
            least = len(schema) - len(opt)
            n = f"{least} to {len(schema)}" if opt else f"{len(schema)}"
            raise ProtocolError(MALFORMED, f"{T(h[1]).name}: expected {n} fields "
                                f"({', '.join(f[0] for f in schema)}), got {len(h) - 2}")
    for i, (name, ok, kind) in enumerate(schema):
        if i + 2 < len(h) and not ok(h[i + 2]):
            raise ProtocolError(MALFORMED, f"{T(h[1]).name}.{name}: expected {kind}, "
                                f"got {brief(h[i + 2])}")
    return STRUCTS[h[1]](VERSION, *h[1:])


def query_id(frame: Any) -> int | None:
    """The ``qid`` of a QUERY header that failed :func:`decode`, if it can be read (so the error
    is answered to that query); None otherwise."""
    buf = getattr(frame, "buffer", frame)
    if len(buf) > MAX_HEADER_BYTES:
        return None
    try:
        h = _any_decoder.decode(buf)
    except Exception:  # noqa: BLE001 - not msgpack at all
        return None
    if type(h) is list and len(h) >= 5 and h[0] == VERSION and h[1] == T.QUERY and _uint(h[4]):
        return h[4]
    return None


def expect_frames(h: Message, n_frames: int, wanted: int) -> None:
    """Raise unless a message carries exactly ``wanted`` payload frames."""
    if n_frames != wanted:
        raise ProtocolError(MALFORMED, f"{T(h.type).name}: header announces {wanted} payload frame(s), "
                            f"message has {n_frames}")


def brief(x: Any, limit: int = 40) -> str:
    """``repr(x)`` cut to ``limit`` characters: what error texts quote of a peer's or a file's
    value (a quoted 1 MB field made every answer to it 4 MB; a 5,000-digit number, a line)."""
    r = repr(x)
    return r if len(r) <= limit else r[:limit - 3] + "..."


# --- constructors (one per type, in its struct's field order) --------------------------------

# msgspec writes a list exactly as msgpack-python does (smallest int and str forms, float64),
# 3-4x faster, and without building a struct first
_pack = msgspec.msgpack.Encoder().encode
encode = _pack  # a Message struct (or a list in wire order) as header bytes
_t = SimpleNamespace(**{t.name: int(t) for t in T})  # msgspec writes an int faster than an IntEnum


def submit(model: str, slo_us: int, ids: Sequence[int], priority: int = 0, sent_us: int = 0,
           epoch: int = 0) -> bytes:
    """``sent_us``: the sender's monotonic clock at send (µs; 0: unknown). With it the scheduler
    sees how long the message queued before it read it, and starts the SLO clock at the send.
    ``epoch``: the scheduler's epoch (PONG ``info.epoch``) the sender knows; a scheduler with
    another one (a restart the sender has not heard of yet, and has given these requests up
    for) refuses them unserved with ``daemon-restarted``; 0: any scheduler serves them."""
    if epoch:
        return _pack([VERSION, _t.SUBMIT, model, slo_us, ids, priority, sent_us, epoch])
    if sent_us:
        return _pack([VERSION, _t.SUBMIT, model, slo_us, ids, priority, sent_us])
    if priority:
        return _pack([VERSION, _t.SUBMIT, model, slo_us, ids, priority])
    return _pack([VERSION, _t.SUBMIT, model, slo_us, ids])


def reply(ids: Sequence[int], status: int, reason: str = "", meta: Any = None) -> bytes:
    return _pack([VERSION, _t.REPLY, ids, status, reason, meta])


def query(app: str, slo_us: int, qid: int, stages: bool = False, priority: int = 0, sent_us: int = 0,
          epoch: int = 0) -> bytes:
    """One query of an app (a tree of models): ``stages`` asks for every stage's outputs, not only
    the leaves'; ``priority``, ``sent_us`` and ``epoch`` as SUBMIT's. Exactly one ANSWER with
    ``qid`` follows."""
    if epoch:
        return _pack([VERSION, _t.QUERY, app, slo_us, qid, int(stages), priority, sent_us, epoch])
    return _pack([VERSION, _t.QUERY, app, slo_us, qid, int(stages), priority, sent_us])


def answer(qid: int, status: int, reason: str = "", stage: str = "", detail: str = "",
           outputs: Sequence[list] = ()) -> bytes:
    """A query's one reply. OK: ``outputs`` describes the payload frames that follow, one entry
    ``[stage, key, final, meta]`` per frame (see :func:`output_entry`); otherwise ``reason`` (a
    stable code) and ``stage`` (the stage it failed at; "" when the query never started) say why."""
    return _pack([VERSION, _t.ANSWER, qid, status, reason, stage, detail, list(outputs)])


def output_entry(stage: str, key: Sequence[int], final: bool, meta: Any) -> list:
    """One output of a query's ANSWER. ``key`` places the stage request in the query's tree: the
    root's is ``[]``, and the j-th input that a glue call made of request ``k`` is ``k + [j]``.
    Entries come ordered by stage (as the app lists them), then by key; ``final``: a leaf stage's
    output (what the query returns); the others are sent only when QUERY asked for ``stages``."""
    return [stage, list(key), final, meta]


def error(code: str, message: str) -> bytes:
    return _pack([VERSION, _t.ERROR, code, message])


def ping(token: Any) -> bytes:
    return _pack([VERSION, _t.PING, token])


def pong(token: Any, info: dict) -> bytes:
    return _pack([VERSION, _t.PONG, token, info])


def register(vgpus: Sequence[int], data_endpoint: str, backend: str, pid: int, clock_us: int,
             incarnation: int) -> bytes:
    return _pack([VERSION, _t.REGISTER, vgpus, data_endpoint, backend, pid, clock_us, incarnation])


def welcome(assignments: Sequence[list], heartbeat_ms: int, data_key: bytes = b"") -> bytes:
    return _pack([VERSION, _t.WELCOME, assignments, heartbeat_ms, data_key])


def peers(directory: dict[int, str]) -> bytes:
    flat: list = []
    for v, ep in directory.items():
        flat += (v, ep)
    return _pack([VERSION, _t.PEERS, flat])


def heartbeat(clock_us: int, queued: int, unreachable: Sequence[int] = (), loading: bool = False) -> bytes:
    """The trailing fields only when set: the bytes of a plain heartbeat stay as before."""
    if loading:
        return _pack([VERSION, _t.HEARTBEAT, clock_us, queued, list(unreachable), True])
    if unreachable:
        return _pack([VERSION, _t.HEARTBEAT, clock_us, queued, list(unreachable)])
    return _pack([VERSION, _t.HEARTBEAT, clock_us, queued])


def dispatch(batch: int, path: Sequence[int], starts: Sequence[int], ids: Sequence[int],
             tags: Sequence[bytes] = ()) -> bytes:
    return _pack([VERSION, _t.DISPATCH, batch, path, starts, ids, list(tags)])


def forward(batch: int, path: Sequence[int], starts: Sequence[int], hop: int, ids: Sequence[int],
            meta: Any, tags: Sequence[bytes] = ()) -> bytes:
    return _pack([VERSION, _t.FORWARD, batch, path, starts, hop, ids, meta, list(tags)])


_TAG_INPUT = struct.Struct("<QQQq")
TAG_BYTES = 16


def hop_tag(key: bytes, batch: int, hop: int, vgpu: int, start: int) -> bytes:
    """The capability for hop ``hop`` (on vGPU ``vgpu``, reserved to start at ``start`` on its
    executor's clock) of ``batch``: a keyed BLAKE2b under the key the scheduler gave that hop's
    executor (WELCOME.data_key). The scheduler, which holds every executor's key, puts one per
    hop in the DISPATCH; each hop passes them on, and an executor runs a FORWARD only when it
    carries its own tag for that batch, hop and start, and only once. So only the batch's
    earlier hops can feed a hop, once, at its reserved time: another executor of the plan,
    which holds a key but never saw the batch, cannot forge work or results for it."""
    return hashlib.blake2b(_TAG_INPUT.pack(batch, hop, vgpu, start), key=key,
                           digest_size=TAG_BYTES).digest()


def path_tags(keys: Sequence[bytes], batch: int, path: Sequence[int], starts: Sequence[int]) -> list[bytes]:
    """DISPATCH.tags for ``path`` and its ``starts``, where ``keys[j]`` is the key of hop j's executor."""
    return [hop_tag(keys[j], batch, j, path[j], starts[j]) for j in range(1, len(path))]


def result(batch: int, ids: Sequence[int], meta: Any, failed: Sequence = (), feedback: Sequence[int] = ()
           ) -> bytes:
    return _pack([VERSION, _t.RESULT, batch, ids, meta, list(failed), list(feedback)])


def feedback(entries: Sequence[int]) -> bytes:
    return _pack([VERSION, _t.FEEDBACK, entries])


def cancel(batches: Sequence[int]) -> bytes:
    return _pack([VERSION, _t.CANCEL, batches])


def bye(vgpus: Sequence[int]) -> bytes:
    return _pack([VERSION, _t.BYE, vgpus])


ALIVE_HEADER = _pack([VERSION, _t.ALIVE])


def prepare(prep: int, assignments: Sequence[list]) -> bytes:
    return _pack([VERSION, _t.PREPARE, prep, assignments])


def preloaded(prep: int, load_us: int, error: str = "") -> bytes:
    return _pack([VERSION, _t.PRELOADED, prep, load_us, error])


# --- the vGPU assignment carried by WELCOME -------------------------------------------------


class Assignment:
    """What one vGPU runs: a partition of one pipeline, with its profiled latency per batch size.

    On the wire a positional list: ``[vgpu, model, pipeline, partition, start, end, gpu, split,
    server, last, lat_us, trans_us]`` where ``lat_us[bs-1]`` is the profiled inference latency and
    ``trans_us[bs-1]`` the profiled transfer time of the outgoing boundary (zeros on the last hop).
    """

    __slots__ = ("vgpu", "model", "pipeline", "partition", "start", "end", "gpu", "split", "server",
                 "last", "lat_us", "trans_us")

    def __init__(self, vgpu: int, model: str, pipeline: int, partition: int, start: int, end: int,
                 gpu: str, split: int, server: int, last: bool, lat_us: list[float],
                 trans_us: list[float]) -> None:
        self.vgpu, self.model, self.pipeline, self.partition = vgpu, model, pipeline, partition
        self.start, self.end, self.gpu, self.split, self.server = start, end, gpu, split, server
        self.last, self.lat_us, self.trans_us = last, lat_us, trans_us

    def to_wire(self) -> list:
        return [self.vgpu, self.model, self.pipeline, self.partition, self.start, self.end, self.gpu,
                self.split, self.server, self.last, self.lat_us, self.trans_us]

    @classmethod
    def from_wire(cls, x: Any) -> Assignment:
        if type(x) is not list or len(x) != 12:
            raise ProtocolError(MALFORMED, "WELCOME.assignments: each entry is a 12-field list")
        v, model, pipe, part, start, end, gpu, split, server, last, lat, trans = x
        if not (_uint(v) and _str(model) and _uint(pipe) and _uint(part) and _uint(start) and _uint(end)
                and start < end and _str(gpu) and _uint(split) and _uint(server) and type(last) is bool
                and _list(lat) and _list(trans) and lat):
            raise ProtocolError(MALFORMED, f"WELCOME.assignments: bad entry {brief(x)}")
        bad = [t for t in lat + trans if not (type(t) in (int, float) and 0 <= t <= MAX_ASSIGNED_US)]
        if bad:  # (an infinite or NaN latency wedged the vGPU's worker; 1e300 made it sleep for ever)
            raise ProtocolError(MALFORMED, f"WELCOME.assignments: vGPU {v}: latency {brief(bad[0])} is not a "
                                f"number of µs in [0, {MAX_ASSIGNED_US:g}]")
        return cls(v, model, pipe, part, start, end, gpu, split, server, last,
                   [float(t) for t in lat], [float(t) for t in trans])

    def __repr__(self) -> str:
        return (f"Assignment(vgpu={self.vgpu}, model={self.model!r}, pipeline={self.pipeline}, "
                f"partition={self.partition}, blocks=[{self.start},{self.end}), gpu={self.gpu}/{self.split})")


def tensor_meta(dtype: str, shape: Sequence[int], name: str = "") -> list:
    """Describes a raw tensor frame: ``[dtype, shape, name]`` (numpy dtype string, C order)."""
    return [dtype, list(shape), name]
