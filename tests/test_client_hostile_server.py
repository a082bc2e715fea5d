"""The client library against a broken or hostile server (a bare ROUTER scripted by the test):
nothing it sends raises out of the client's reader, the client's memory stays bounded, and a
good answer that follows is delivered to its own request."""

from __future__ import annotations

import asyncio

import msgpack
import pytest
import zmq

from ppiped import client as C
from ppiped import wire
from ppiped.wire import Status, T


async def _serve_once(server: zmq.Socket, junk: list[list[bytes]]) -> None:
    """Answer the client's first SUBMIT with ``junk`` first, then the right reply."""
    loop = asyncio.get_running_loop()
    while True:
        if server.poll(0):
            ident, head, *frames = server.recv_multipart()
            h = wire.decode(head)
            if h.type == T.SUBMIT:
                for parts in junk:
                    server.send_multipart([ident, *parts])
                server.send_multipart([ident, wire.reply(h.ids, Status.OK, "", None), *frames])
                return
        await loop.run_in_executor(None, server.poll, 20)


def test_junk_from_the_server_raises_nothing_and_is_kept_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(C, "ERRORS_KEPT", 50)
    ep = f"ipc://{tmp_path}/s.sock"
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.bind(ep)
    raised: list = []
    junk = [[msgpack.packb([wire.VERSION, int(T.PONG), [1, 2], {}])],  # unhashable tokens
            [msgpack.packb([wire.VERSION, int(T.PONG), {"a": 1}, {}])],
            *[[wire.error("x", f"error {i}")] for i in range(500)]]

    async def main() -> bytes:
        asyncio.get_running_loop().set_exception_handler(lambda _l, ctx_: raised.append(ctx_))
        async with C.AsyncClient(ep, timeout_s=10, watch_s=None) as cl:
            serving = asyncio.ensure_future(_serve_once(server, junk))
            r = await cl.submit("m", b"payload")
            await serving
            await asyncio.sleep(0.05)
            assert len(cl.errors) == 50 and cl.errors[-1] == ("x", "error 499")
            return r.data

    try:
        assert asyncio.run(main()) == b"payload"
    finally:
        ctx.destroy(0)
    assert not raised, raised


def test_a_frame_past_the_cap_is_never_taken(tmp_path, monkeypatch):
    """libzmq refuses a frame above ``MAX_FRAME_BYTES`` before allocating it (a hostile server's
    256 MB REPLY was taken whole); the request then ends by its timeout, not with the frame."""
    monkeypatch.setattr(C, "MAX_FRAME_BYTES", 1 << 16)
    ep = f"ipc://{tmp_path}/s.sock"
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.bind(ep)

    async def main() -> None:
        async with C.AsyncClient(ep, timeout_s=1.0, watch_s=None) as cl:
            loop = asyncio.get_running_loop()
            fut = asyncio.ensure_future(cl.submit("m", b"p"))
            while True:
                ident, head, *_ = await loop.run_in_executor(None, server.recv_multipart)
                if (h := wire.decode(head)).type == T.SUBMIT:
                    break
            server.send_multipart([ident, wire.reply(h.ids, Status.OK, "", None), b"\0" * (1 << 17)])
            with pytest.raises(TimeoutError):
                await fut

    try:
        asyncio.run(main())
    finally:
        ctx.destroy(0)


def test_replies_flowing_keep_pending_requests_alive_without_pongs(tmp_path):
    """A scheduler busy answering: its PONGs may queue behind replies. Replies show it is there,
    so a request answered after more than UNREACHABLE_S of no PONG is still delivered (only
    PONGs counted, and it was ended ``daemon-unreachable``)."""
    ep = f"ipc://{tmp_path}/s.sock"
    ctx = zmq.Context()
    server = ctx.socket(zmq.ROUTER)
    server.setsockopt(zmq.LINGER, 0)
    server.bind(ep)

    async def serve(loop) -> None:
        got: list[tuple[bytes, int, bytes]] = []  # (identity, request id, frame)
        while len(got) < 2:
            ident, head, *frames = await loop.run_in_executor(None, server.recv_multipart)
            h = wire.decode(head)
            if h.type == T.SUBMIT:  # PINGs are never answered
                got += [(ident, i, f) for i, f in zip(h.ids, frames, strict=True)]
        for ident, i, f in got:  # one reply, then the other 1.2 x UNREACHABLE_S after the first ping
            await asyncio.sleep(0.6 * C.UNREACHABLE_S)
            server.send_multipart([ident, wire.reply([i], Status.OK, "", None), f])

    async def main() -> list[bytes]:
        loop = asyncio.get_running_loop()
        async with C.AsyncClient(ep, timeout_s=10, watch_s=0.05) as cl:
            serving = asyncio.ensure_future(serve(loop))
            rs = await asyncio.gather(cl.submit("m", b"one"), cl.submit("m", b"two"))
            await serving
            return [r.data for r in rs]

    try:
        assert asyncio.run(main()) == [b"one", b"two"]
    finally:
        ctx.destroy(0)
