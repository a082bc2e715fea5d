"""The event-loop plumbing under the scheduler and executors: multipart receive and socket draining."""

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


def test_recv_parts_keeps_message_boundaries(pair):
    a, b = pair
    big = b"B" * (ZERO_COPY_BYTES + 1)
    send_parts(a, [b"h1", b"x" * 10, big])
    send_parts(a, [b"h2"])
    assert b.poll(2000)
    m1 = recv_parts(b, 0)
    m2 = recv_parts(b, 0)
    assert all(isinstance(f, zmq.Frame) for f in m1 + m2)
    assert [bytes(f) for f in m1] == [b"h1", b"x" * 10, big]
    assert [bytes(f) for f in m2] == [b"h2"]
    with pytest.raises(zmq.Again):
        recv_parts(b)


def test_reader_drains_messages_queued_before_and_after_it_exists(pair):
    """ZeroMQ's FD is edge-triggered: messages already queued when the reader starts, and a burst
    larger than one wake-up's quota, must all reach the handler."""
    a, b = pair
    for i in range(5):
        send_parts(a, [b"early", str(i).encode()])
    got: list[bytes] = []
    after_calls = []

    async def main() -> None:
        loop = asyncio.get_running_loop()
        done = loop.create_future()

        def handler(msg: list) -> None:
            got.append(bytes(msg[1]))
            if len(got) == 5 + 50 and not done.done():
                done.set_result(None)

        r = Reader(loop, b, handler, after=lambda: after_calls.append(1), max_per_wakeup=7)
        await asyncio.sleep(0.01)
        for i in range(50):
            send_parts(a, [b"late", str(i).encode()])
        await asyncio.wait_for(done, 5)
        r.close()

    asyncio.run(main())
    assert got == [str(i).encode() for i in range(5)] + [str(i).encode() for i in range(50)]
    assert after_calls  # the after-hook ran once per non-empty wake-up


@pytest.mark.handler_failures
def test_a_handler_that_raises_loses_its_message_not_the_socket(pair, caplog):
    """A bug on one message (the executor's replay check once raised KeyError) must not stop the
    drain: the FD is edge-triggered, so the rest of the backlog would wait for a new message."""
    a, b = pair
    for i in range(6):
        send_parts(a, [str(i).encode()])
    got: list[bytes] = []

    async def main() -> Reader:
        loop = asyncio.get_running_loop()

        def handler(msg: list) -> None:
            if bytes(msg[0]) in (b"1", b"4"):
                raise KeyError("a bug")
            got.append(bytes(msg[0]))

        r = Reader(loop, b, handler)
        for _ in range(100):
            await asyncio.sleep(0.005)
            if len(got) == 4:
                break
        r.close()
        return r

    r = asyncio.run(main())
    assert got == [b"0", b"2", b"3", b"5"]
    assert r.handler_errors == 2
    logged = [r.fields for r in caplog.records if r.getMessage() == "handler-failed"]
    assert [f["count"] for f in logged] == [1, 2]
    assert all(f["error"].startswith("KeyError") and f["at"].startswith("test_daemon_loop.py:") for f in logged)


def test_a_timer_callback_that_raises_stops_no_other_timer():
    """One callback raising used to leave the timerfd unarmed: every later timer (an
    executor's heartbeats) waited for some other event to arm it again."""
    from ppiped.daemon.loop import Timers, now_us

    loop = asyncio.new_event_loop()
    timers = Timers(loop)
    fired: list[str] = []

    def boom() -> None:
        raise ZeroDivisionError("from a callback")

    try:
        t = now_us()
        timers.call_at(t + 1_000, boom)
        timers.call_at(t + 2_000, fired.append, "same wake-up or the next")
        timers.call_at(t + 30_000, fired.append, "later")
        loop.run_until_complete(asyncio.sleep(0.2))
        assert fired == ["same wake-up or the next", "later"]
    finally:
        timers.close()
        loop.close()
