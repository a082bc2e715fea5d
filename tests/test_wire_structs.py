"""Typed wire messages (#16): the structs read and write the very bytes the msgpack-python
implementation did, and accept exactly the headers it accepted (hypothesis).

The reference below is that implementation's schema and checks, frozen here, decoding with
msgpack-python: a plain msgpack peer, as any client may be. One difference is deliberate: maps
with keys other than strings (inside ``meta``, ``token``...) were refused by msgpack-python's
``strict_map_key`` and are taken now, so the reference reads them too."""

from __future__ import annotations

from typing import Any

import msgpack
import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ppiped import wire
from ppiped.wire import ProtocolError, T

# name:kind per field, as the wire had them before the structs. u: unsigned int, i: int,
# s: string, b: bytes, U: list of unsigned ints, I: list of ints, l: list, d: map, a: anything
# (WELCOME.data_key and DISPATCH/FORWARD.tags came later, as optional trailing fields, B: a list of
# byte strings of at most 64 bytes (hop tags); c: an executor's
# clock, 0 <= x < 2^62 µs, came later too: a clock near 2^64 overflowed the DISPATCHes built on it;
# HEARTBEAT.unreachable came later, optional and trailing: next hops an executor could not reach,
# and HEARTBEAT.loading (o: a bool) after it: alive but still loading its assignment;
# SUBMIT.epoch and QUERY.epoch too: the scheduler epoch the client knew when it sent)
OLD_SCHEMA = {
    T.SUBMIT: "model:s slo_us:u ids:U priority:u sent_us:u epoch:u",
    T.REPLY: "ids:U status:u reason:s meta:a",
    T.ERROR: "code:s message:s",
    T.PING: "token:a",
    T.PONG: "token:a info:d",
    T.QUERY: "app:s slo_us:u qid:u stages:u priority:u sent_us:u epoch:u",
    T.ANSWER: "qid:u status:u reason:s stage:s detail:s outputs:l",
    T.REGISTER: "vgpus:U data_endpoint:s backend:s pid:u clock_us:c incarnation:u",
    T.WELCOME: "assignments:l heartbeat_ms:u data_key:b",
    T.PEERS: "directory:l",
    T.HEARTBEAT: "clock_us:c queued:u unreachable:U loading:o",
    T.DISPATCH: "batch:u path:U starts:I ids:U tags:B",
    T.FORWARD: "batch:u path:U starts:I hop:u ids:U meta:a tags:B",
    T.RESULT: "batch:u ids:U meta:a failed:l feedback:I",
    T.FEEDBACK: "entries:I",
    T.CANCEL: "batches:U",
    T.BYE: "vgpus:U",
    T.ALIVE: "",
    T.PREPARE: "prep:u assignments:l",
    T.PRELOADED: "prep:u load_us:u error:s",
}
# trailing fields that may be left out, with the values they then take
OLD_OPTIONAL = {T.SUBMIT: (0, 0, 0), T.QUERY: (0, 0, 0, 0), T.WELCOME: (b"",), T.DISPATCH: ([],), T.FORWARD: ([],),
                T.HEARTBEAT: ([], False)}
FIELDS = {t: [f.split(":") for f in spec.split()] for t, spec in OLD_SCHEMA.items()}

_OK = {
    "u": lambda x: type(x) is int and x >= 0,
    "i": lambda x: type(x) is int,
    "c": lambda x: type(x) is int and 0 <= x < 2**62,
    "s": lambda x: type(x) is str,
    "b": lambda x: type(x) is bytes,
    "B": lambda x: type(x) is list and all(type(i) is bytes and len(i) <= 64 for i in x),
    "U": lambda x: type(x) is list and all(type(i) is int and i >= 0 for i in x),
    "I": lambda x: type(x) is list and all(type(i) is int for i in x),
    "l": lambda x: type(x) is list,
    "d": lambda x: type(x) is dict,
    "a": lambda x: True,
    "o": lambda x: type(x) is bool,
}


def old_decode(raw: bytes) -> list | str:
    """The header as the old decode returned it (defaults filled in), or its error code."""
    try:
        h = msgpack.unpackb(raw, strict_map_key=False)
    except Exception:  # noqa: BLE001 - msgpack raises several types
        return wire.MALFORMED
    if type(h) is not list or len(h) < 2:
        return wire.MALFORMED
    if h[0] != wire.VERSION:
        return wire.VERSION_MISMATCH
    if type(h[1]) is not int or h[1] not in FIELDS:
        return wire.MALFORMED
    fields = FIELDS[h[1]]
    missing = 2 + len(fields) - len(h)
    opt = OLD_OPTIONAL.get(h[1], ())
    if not 0 <= missing <= len(opt):
        return wire.MALFORMED
    h += list(opt[len(opt) - missing:])
    if not all(_OK[kind](x) for (_, kind), x in zip(fields, h[2:], strict=True)):
        return wire.MALFORMED
    return h


def as_list(m: wire.Message) -> list:
    return list(msgspec.structs.astuple(m))


scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**63, 2**64 - 1),
                    st.floats(allow_nan=False), st.text(max_size=10), st.binary(max_size=10))
values = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.text(max_size=4), inner, max_size=3)), max_leaves=10)
uints = st.integers(0, 2**64 - 1)
ints = st.integers(-2**63, 2**63 - 1)
KINDS = {"u": uints, "i": ints, "c": st.integers(0, 2**62 - 1), "s": st.text(max_size=12), "b": st.binary(max_size=20),
         "B": st.lists(st.binary(max_size=64), max_size=4),
         "U": st.lists(uints, max_size=40),
         "I": st.lists(ints, max_size=40), "l": st.lists(values, max_size=4),
         "d": st.dictionaries(st.text(max_size=6), values, max_size=4), "a": values,
         "o": st.booleans()}


@st.composite
def valid(draw: Any) -> tuple[T, list]:
    t = draw(st.sampled_from(list(T)))
    return t, [draw(KINDS[kind]) for _, kind in FIELDS[t]]


def test_structs_keep_the_old_fields_in_order():
    for t, fields in FIELDS.items():
        assert [f.name for f in msgspec.structs.fields(wire.STRUCTS[t])[2:]] == [n for n, _ in fields]
        assert wire.OPTIONAL.get(t, ()) == OLD_OPTIONAL.get(t, ())


@settings(max_examples=400, deadline=None)
@given(valid())
def test_constructors_and_structs_write_the_old_bytes_and_read_them_back(msg):
    t, fields = msg
    old = msgpack.packb([wire.VERSION, t, *fields])  # what the constructors sent before
    assert wire.encode(wire.STRUCTS[t](wire.VERSION, t, *fields)) == old
    if t == T.ALIVE:
        assert old == wire.ALIVE_HEADER
    elif t == T.PEERS:
        d = {3 * i: repr(x) for i, x in enumerate(fields[0])}  # vGPU -> endpoint
        flat = [x for kv in d.items() for x in kv]
        assert wire.peers(d) == msgpack.packb([wire.VERSION, t, flat])
    elif t == T.SUBMIT:
        model, slo_us, ids, prio, sent, epoch = fields
        short = fields if epoch else fields[:5] if sent else fields[:4] if prio else fields[:3]  # trailing zeros left out
        assert wire.submit(*fields) == msgpack.packb([wire.VERSION, t, *short])
    elif t == T.HEARTBEAT:
        # not loading is left out, and then nothing unreachable too
        short = fields if fields[3] else fields[:3] if fields[2] else fields[:2]
        assert wire.heartbeat(*fields) == msgpack.packb([wire.VERSION, t, *short])
    elif t == T.QUERY:
        short = fields if fields[6] else fields[:6]  # a zero epoch is left out
        assert wire.query(*fields) == msgpack.packb([wire.VERSION, t, *short])
    else:
        assert getattr(wire, t.name.lower())(*fields) == old
    h = wire.decode(old)
    assert type(h) is wire.STRUCTS[t] and as_list(h) == old_decode(old) == [wire.VERSION, t, *fields]
    assert wire._decode_checked(old) == h  # the Python path reads it the same
    for i in range(len(OLD_OPTIONAL.get(t, ())) + 1):  # older senders leave trailing fields out
        short = msgpack.packb([wire.VERSION, t, *fields[:len(fields) - i]])
        assert as_list(wire.decode(short)) == old_decode(short)


def _one_changed(t: T, fields: list, i: int, x: Any) -> bytes:
    """A valid header with field ``i`` replaced by ``x`` (or ``x`` appended)."""
    return msgpack.packb([wire.VERSION, t, *fields[:i], x, *fields[i + 1:]])


def _same_verdict(raw: bytes) -> None:
    want = old_decode(raw)
    try:
        got = wire.decode(raw)
    except ProtocolError as e:
        assert e.code == want, (raw, str(e))
        with pytest.raises(ProtocolError) as slow:
            wire._decode_checked(raw)
        assert str(slow.value) == str(e)
        return
    assert as_list(got)[1:] == want[1:], raw


@settings(max_examples=600, deadline=None)
@given(st.one_of(
    st.builds(lambda t, fields: msgpack.packb([wire.VERSION, t, *fields]),
              st.sampled_from([int(x) for x in T] + [0, 99]), st.lists(values, max_size=8)),
    st.builds(lambda fields: msgpack.packb(fields), st.lists(values, max_size=9)),
    st.builds(lambda m, i, x: _one_changed(*m, i, x), valid(), st.integers(0, 7), values),
))
def test_any_header_is_read_as_before_or_refused_with_a_protocol_error(raw):
    _same_verdict(raw)


@settings(max_examples=400, deadline=None)
@given(st.binary(max_size=48), valid())
def test_random_bytes_raise_only_protocol_errors(junk, msg):
    t, fields = msg
    good = msgpack.packb([wire.VERSION, t, *fields])
    for raw in (junk, good[:len(junk) % (len(good) + 1)], good + junk[:1], junk[:3] + good[3:]):
        try:
            h = wire.decode(raw)
        except ProtocolError:
            continue
        want = old_decode(raw)
        assert type(want) is not list or as_list(h)[1:] == want[1:], raw


@pytest.mark.parametrize("raw", [
    b"\xdc\x00\x05" + msgpack.packb([1, T.SUBMIT, "m", 0, [1]])[1:],  # array16 header
    b"\x95\xcc\x01\x01\xa1m\x00\x91\x01",  # version as uint8
    msgpack.packb([True, T.SUBMIT, "m", 0, [1]]),  # True == 1, as before
    msgpack.packb([1, T.SUBMIT, "m", 0, [1], 1, 2, 3]),  # one field too many: refused
    msgpack.packb([1, T.HEARTBEAT, 5]),
    b"\x93\x01" + bytes([T.REPLY]) + b"\x91" * 3000,  # nested deeper than either decoder goes
])
def test_other_spellings_take_the_checked_path(raw):
    _same_verdict(raw)
