"""``ppiped keys``: CURVE keypairs for the scheduler, executors, clients and admins, and the
``[security]`` lines that use them."""

from __future__ import annotations

import argparse
import json
import os
import re
from pathlib import Path

from ..errors import InputError
from ..security import keygen, vgpu_ids

ROLES = ("server", "executor", "client", "admin")

_NAME = re.compile(r"^[A-Za-z0-9_.-]+$")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="make CURVE keypairs (ZeroMQ certificates) and print the config lines",
                       description="Write NAME.key (public) and NAME.key_secret (mode 0600) per name "
                       "under DIR/<role>s/ and print the [security] lines of the serving config. "
                       "Existing key files are never replaced without --force.")
    p.add_argument("--dir", required=True, help="key directory, e.g. /etc/ppiped/keys")
    p.add_argument("--server", action="store_true", help="make the scheduler's keypair (server)")
    p.add_argument("--executor", action="append", default=[], metavar="NAME=VGPUS",
                   help="an executor host's keypair and the vGPUs it may serve, e.g. node1=0-7 (repeatable)")
    p.add_argument("--client", action="append", default=[], metavar="NAME", help="a client keypair (repeatable)")
    p.add_argument("--admin", action="append", default=[], metavar="NAME",
                   help="an admin keypair: ctl over TCP (repeatable)")
    p.add_argument("--force", action="store_true",
                   help="replace key files that exist already (whoever holds the old keys is locked out "
                        "until given the new ones)")
    p.set_defaults(func=run)


def _check_name(flag: str, name: str) -> None:
    """A name becomes a file name under --dir and a TOML key: plain characters only, so it
    neither escapes the directory nor breaks the printed config."""
    if not _NAME.match(name) or name in (".", ".."):
        raise InputError(f"{flag}: bad name {name!r}: use letters, digits, '_', '.' and '-' "
                         "(not '.' or '..')")


def _check_dir(d: Path) -> None:
    """--dir is a directory, or can be made: the nearest existing ancestor is a writable directory."""
    p = d
    while not p.exists() and p != p.parent:
        p = p.parent
    if not p.is_dir():
        raise InputError(f"--dir {d}: {p} is not a directory")
    if not os.access(p, os.W_OK | os.X_OK):
        what = "is not writable" if p == d else f"cannot be created ({p} is not writable)"
        raise InputError(f"--dir {d}: {what}")


def _toml(s: object) -> str:
    """A TOML basic string (JSON's escapes are TOML's), whatever --dir holds."""
    return json.dumps(str(s))


def run(args: argparse.Namespace) -> int:
    d = Path(args.dir)
    if not args.dir:
        raise InputError("--dir: an empty path")
    if not (args.server or args.executor or args.client or args.admin):
        raise InputError("nothing to make: give --server, --executor NAME=VGPUS, --client or --admin")
    # everything is checked before the first file is written: a refused run writes nothing
    execs = []
    taken: dict[int, str] = {}
    for item in args.executor:
        name, sep, vgpus = item.partition("=")
        if not sep or not name or not vgpus:
            raise InputError(f"--executor: expected NAME=VGPUS like node1=0-7, got {item!r}")
        _check_name("--executor", name)
        if any(name == n for n, _ in execs):
            raise InputError(f"--executor: {name!r} is given twice")
        ids = vgpu_ids([vgpus], f"--executor {name}")
        for v in ids:
            if v in taken:
                raise InputError(f"--executor: vGPU {v} is in both {taken[v]!r} and {name!r} "
                                 "(a vGPU is served by one executor key)")
            taken[v] = name
        execs.append((name, vgpus))
    for flag, names in (("--client", args.client), ("--admin", args.admin)):
        for i, name in enumerate(names):
            _check_name(flag, name)
            if name in names[:i]:
                raise InputError(f"{flag}: {name!r} is given twice")
    _check_dir(d)
    jobs = ([(d, "server")] if args.server else []) + [(d / "executors", n) for n, _ in execs] + \
        [(d / "clients", n) for n in args.client] + [(d / "admins", n) for n in args.admin]
    for sub in {where for where, _ in jobs}:
        if sub.exists() and not sub.is_dir():
            raise InputError(f"--dir {d}: {sub} is not a directory")
    existing = [str(f) for where, n in jobs for f in (where / f"{n}.key", where / f"{n}.key_secret")
                if f.exists() or f.is_symlink()]
    if existing and not args.force:
        more = f" and {len(existing) - 1} more" if len(existing) > 1 else ""
        raise InputError(f"{existing[0]}{more} exist already: not replacing keys that may be deployed "
                         "(give --force to replace them, or other names)")
    try:
        for where, name in jobs:
            keygen(where, name)
    except OSError as e:
        raise InputError(f"--dir {d}: cannot write the keys: {e.strerror or e}") from None
    if args.server:
        print(f"made {d / 'server.key'} and {d / 'server.key_secret'}")
    print("\n# serving config (ppiped.toml), every host:")
    print("[security]\ncurve = true")
    print(f'server_key = {_toml(d / "server.key_secret")}   # scheduler host; elsewhere: '
          f'server_public_key = {_toml(d / "server.key")}')
    print(f'executor_key = {_toml(str(d / "executors") + "/<this host>.key_secret")}   # executor hosts')
    print(f'client_keys = {_toml(d / "clients")}')
    print(f'admin_keys = {_toml(d / "admins")}')
    if execs:
        print("[security.executors]")
        for name, vgpus in execs:
            print(f'{_toml(d / "executors" / (name + ".key"))} = {_toml(vgpus)}')
    print("\n# clients: Client(endpoint, key_file='<client>.key_secret', "
          f"server_key_file='{d / 'server.key'}')")
    return 0
