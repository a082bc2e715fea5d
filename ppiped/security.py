"""ZeroMQ CURVE on every socket: key files, allow-lists per socket, identity of a peer.

Shared by the scheduler, the executors and the client. Keys are ZeroMQ certificate files as
``zmq.auth.create_certificates`` writes them (``NAME.key`` public, ``NAME.key_secret`` both
halves); ``ppiped keys`` makes them. Each listening socket is a CURVE server with a ZAP domain,
and pyzmq's ZAP authenticator (a thread on the socket's context) admits, per domain, only the
public keys configured for it:

- ``client``: client keys (and admin keys);
- ``executor``: executor keys, each bound to the vGPUs it may serve;
- ``ctl``: admin keys (a TCP ctl endpoint accepts ``stop`` only from them);
- ``data``: executor keys (executor-to-executor feature maps).

An authenticated message carries its sender's public key as the frame's ``User-Id``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq

from .errors import InputError

DOMAINS = ("client", "executor", "ctl", "data")


class KeyFileError(InputError):
    """A key file is missing or is not a ZeroMQ certificate."""


@dataclass(frozen=True)
class KeyPair:
    """z85 public key, and the secret one where this host holds it."""

    public: bytes
    secret: bytes | None = None


def load_keypair(path: str | Path, need_secret: bool = False, what: str = "key") -> KeyPair:
    """A certificate file (``.key`` or ``.key_secret``)."""
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as e:
        raise KeyFileError(f"{what}: cannot read the certificate {path}: {e}") from None
    if need_secret and not secret:
        raise KeyFileError(f"{what}: {path} holds no secret key (give the .key_secret file)")
    return KeyPair(public, secret or None)


def load_public_keys(paths: Iterable[str | Path], what: str) -> frozenset[bytes]:
    """Public keys of every ``*.key`` file in each directory, or of each file given."""
    out: set[bytes] = set()
    for p in map(Path, paths):
        files = sorted(p.glob("*.key")) if p.is_dir() else [p]
        if p.is_dir() and not files:
            raise KeyFileError(f"{what}: no .key files in {p}")
        for f in files:
            out.add(load_keypair(f, what=what).public)
    return frozenset(out)


@dataclass
class Security:
    """What one process needs to speak CURVE; ``curve`` False: plain sockets (loopback only)."""

    curve: bool = False
    server: KeyPair | None = None  # the scheduler's (secret only on its host)
    own: KeyPair | None = None  # this executor's keypair (executor hosts)
    clients: frozenset[bytes] = frozenset()
    admins: frozenset[bytes] = frozenset()
    executors: dict[bytes, frozenset[int]] = field(default_factory=dict)  # key -> vGPUs it may serve

    def allowed(self, domain: str) -> frozenset[bytes]:
        return {"client": self.clients | self.admins, "executor": frozenset(self.executors),
                "ctl": self.admins, "data": frozenset(self.executors)}[domain]

    def vgpu_key(self, vgpu: int) -> bytes | None:
        """The public key of the executor bound to ``vgpu`` (the server key of its data socket)."""
        for k, vs in self.executors.items():
            if vgpu in vs:
                return k
        return None


class _AllowList:
    """pyzmq's credentials-provider protocol: ``callback(domain, key) -> bool``."""

    def __init__(self, keys: frozenset[bytes]) -> None:
        self.keys = keys

    def callback(self, domain: str, key: bytes) -> bool:
        return key in self.keys


def start_authenticator(ctx: zmq.Context, sec: Security) -> Any:
    """The ZAP handler for every CURVE server socket of ``ctx`` (None when CURVE is off)."""
    if not sec.curve:
        return None
    from zmq.auth.thread import ThreadAuthenticator

    auth = ThreadAuthenticator(ctx)
    auth.start()
    for d in DOMAINS:
        auth.configure_curve_callback(d, _AllowList(sec.allowed(d)))
    return auth


def serve(sock: zmq.Socket, sec: Security, domain: str, pair: KeyPair | None = None) -> None:
    """Make ``sock`` (before bind) a CURVE server of ``domain`` with ``pair`` (default: the
    scheduler's keypair)."""
    if not sec.curve:
        return
    pair = pair or sec.server
    if pair is None or pair.secret is None:
        raise KeyFileError(f"CURVE server socket ({domain}) without a secret key")
    sock.curve_secretkey = pair.secret
    sock.curve_publickey = pair.public
    sock.curve_server = True
    sock.zap_domain = domain.encode()


def connect_as(sock: zmq.Socket, sec: Security, server_public: bytes | None = None,
               own: KeyPair | None = None) -> None:
    """Make ``sock`` (before connect) a CURVE client of a server with ``server_public``."""
    if not sec.curve:
        return
    own = own or sec.own
    server_public = server_public or (sec.server.public if sec.server else None)
    if own is None or own.secret is None or server_public is None:
        raise KeyFileError("CURVE client socket without its own secret key or the server's public key")
    sock.curve_publickey = own.public
    sock.curve_secretkey = own.secret
    sock.curve_serverkey = server_public


def peer_key(frame: Any) -> bytes | None:
    """The authenticated sender's z85 public key of a received ``zmq.Frame`` (None: no CURVE)."""
    try:
        uid = frame.get("User-Id")
    except (AttributeError, zmq.ZMQError):
        return None
    return uid.encode() if isinstance(uid, str) and uid else None


def keygen(directory: str | Path, name: str) -> KeyPair:
    """Write ``NAME.key`` and ``NAME.key_secret`` in ``directory`` (secret file mode 0600)."""
    import zmq.auth

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    pub, sec = zmq.auth.create_certificates(str(d), name)
    Path(sec).chmod(0o600)
    return load_keypair(sec, need_secret=True)


def vgpu_ids(items: list[str], flag: str, max_count: int | None = None) -> list[int]:
    """vGPU ids as ``--vgpu`` takes them (the config's own parser), each below the plan limit
    ``MAX_VGPUS`` and at most ``max_count`` of them. The bounds are checked on the text first:
    ``0-10**20`` must be refused, not expanded into a list, and an id msgpack cannot carry must
    not reach the wire."""
    from .daemon.config import ConfigError, parse_vgpus
    from .plan import MAX_VGPUS

    count = 0
    for item in items:
        for part in item.split(","):
            a, sep, b = part.strip().partition("-")
            try:
                lo = int(a)
                hi = int(b) if sep else lo
            except ValueError:
                continue  # the parser below says what is wrong with it
            if max(lo, hi) >= MAX_VGPUS:
                raise InputError(f"{flag}: vGPU id {max(lo, hi)} in {part.strip()!r} is too large "
                                 f"(ids are below {MAX_VGPUS:,}, the plan limit)")
            count += max(0, hi - lo + 1)
            if max_count is not None and count > max_count:
                raise InputError(f"{flag}: more than {max_count:,} vGPUs for one process "
                                 "(run several executors)")
    try:
        return parse_vgpus(items)
    except ConfigError as e:
        raise InputError(f"{flag}: {str(e).removeprefix('--vgpu: ')}") from None
