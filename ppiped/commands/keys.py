"""``ppiped keys``: CURVE keypairs for the scheduler, executors, clients and admins, and the
``[security]`` lines that use them."""

from __future__ import annotations

import argparse
from pathlib import Path

from ..errors import InputError
from ..security import keygen

ROLES = ("server", "executor", "client", "admin")


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("keys", help="make CURVE keypairs (ZeroMQ certificates) and print the config lines",
                       description="Write NAME.key (public) and NAME.key_secret (mode 0600) per name "
                       "under DIR/<role>s/ and print the [security] lines of the serving config.")
    p.add_argument("--dir", required=True, help="key directory, e.g. /etc/ppiped/keys")
    p.add_argument("--server", action="store_true", help="make the scheduler's keypair (server)")
    p.add_argument("--executor", action="append", default=[], metavar="NAME=VGPUS",
                   help="an executor host's keypair and the vGPUs it may serve, e.g. node1=0-7 (repeatable)")
    p.add_argument("--client", action="append", default=[], metavar="NAME", help="a client keypair (repeatable)")
    p.add_argument("--admin", action="append", default=[], metavar="NAME",
                   help="an admin keypair: ctl over TCP (repeatable)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    d = Path(args.dir)
    if not (args.server or args.executor or args.client or args.admin):
        raise InputError("nothing to make: give --server, --executor NAME=VGPUS, --client or --admin")
    execs = []
    for item in args.executor:
        name, sep, vgpus = item.partition("=")
        if not sep or not name or not vgpus:
            raise InputError(f"--executor: expected NAME=VGPUS like node1=0-7, got {item!r}")
        execs.append((name, vgpus))
    if args.server:
        keygen(d, "server")
        print(f"made {d / 'server.key'} and {d / 'server.key_secret'}")
    for name, _ in execs:
        keygen(d / "executors", name)
    for name in args.client:
        keygen(d / "clients", name)
    for name in args.admin:
        keygen(d / "admins", name)
    print("\n# serving config (ppiped.toml), every host:")
    print("[security]\ncurve = true")
    print(f'server_key = "{d / "server.key_secret"}"   # scheduler host; elsewhere: '
          f'server_public_key = "{d / "server.key"}"')
    print(f'executor_key = "{d / "executors"}/<this host>.key_secret"   # executor hosts')
    print(f'client_keys = "{d / "clients"}"')
    print(f'admin_keys = "{d / "admins"}"')
    if execs:
        print("[security.executors]")
        for name, vgpus in execs:
            print(f'"{d / "executors" / (name + ".key")}" = "{vgpus}"')
    print("\n# clients: Client(endpoint, key_file='<client>.key_secret', "
          f"server_key_file='{d / 'server.key'}')")
    return 0
