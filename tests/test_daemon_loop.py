"""The event-loop plumbing under the scheduler and executors: socket draining and payload frames."""

from __future__ import annotations

import asyncio

import pytest
import zmq

from ppiped.daemon.loop import ZERO_COPY_BYTES, Reader, recv_parts, send_parts


@pytest.fixture
def pair():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    b.bind("inproc://loop-test")
    a.connect("inproc://loop-test")
    yield a, b
    ctx.destroy(0)


def _wait(sock: zmq.Socket) -> None:
    assert sock.poll(2000), "message did not arrive"


def test_recv_parts_copies_only_from_the_payload_index(pair):
    a, b = pair
    send_parts(a, [b"hdr", b"x" * 10, b"y" * 20])
    _wait(b)
    msg = recv_parts(b, 0, 1)
    assert isinstance(msg[0], zmq.Frame)
    assert [type(f) for f in msg[1:]] == [bytes, bytes]
    assert msg[1:] == [b"x" * 10, b"y" * 20]
    send_parts(a, [b"hdr", b"z" * 5])
    _wait(b)
    msg = recv_parts(b, 0)  # no copy: every part stays a frame
    assert all(isinstance(f, zmq.Frame) for f in msg)
    assert bytes(msg[1]) == b"z" * 5


def test_recv_parts_header_only_message(pair):
    a, b = pair
    send_parts(a, [b"hdr"])
    _wait(b)
    msg = recv_parts(b, 0, 1)
    assert len(msg) == 1 and bytes(msg[0]) == b"hdr"


def test_reader_switches_to_zero_copy_after_a_large_payload(pair):
    """Small payloads arrive as bytes; after a message with a large one, the next payloads are
    zero-copy frames, and small ones switch it back. Content is identical either way."""
    a, b = pair
    big = b"B" * (ZERO_COPY_BYTES + 1)
    sent = [[b"h1", b"s" * 8], [b"h2", big], [b"h3", b"t" * 8], [b"h4", b"u" * 8]]
    got: list[list] = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def handler(msg: list) -> None:
            got.append(msg)
            if len(got) == len(sent) and not done.done():
                done.set_result(None)

        r = Reader(loop, b, handler, payload_from=1)
        for m in sent:
            send_parts(a, m)
        await asyncio.wait_for(done, 5)
        r.close()

    asyncio.run(main())
    assert [bytes(m[1]) for m in got] == [m[1] for m in sent]
    # the first two payloads follow small ones (copied); the third follows the big one
    assert [type(m[1]) for m in got] == [bytes, bytes, zmq.Frame, bytes]
