"""The ``ppiped`` command. Each subcommand lives beside the code it drives and registers here."""

from __future__ import annotations

import argparse
import importlib
import os
import sys
from collections.abc import Sequence

from .errors import UserError

# module path -> each module defines ``register(subparsers)``; add a line when a command exists.
COMMANDS = [
    "ppiped.commands.check",
    "ppiped.commands.plan",
    "ppiped.commands.profile",
    "ppiped.commands.example_model",
    "ppiped.commands.example_app",
    "ppiped.commands.serve",
    "ppiped.commands.loadgen",
    "ppiped.commands.demo",
    "ppiped.commands.sim",
    "ppiped.commands.sweep",
    "ppiped.commands.keys",
]


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(
        prog="ppiped",
        description="Pipelined CNN inference serving for heterogeneous GPU clusters (PPipe).",
    )
    sub = ap.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for mod in COMMANDS:
        importlib.import_module(mod).register(sub)
    return ap


def _user_errors() -> tuple[type[BaseException], ...]:
    """What a user can fix, printed as one line: :data:`UserError`, and the data plane's
    ``LayoutError`` (a plan that does not fit its cluster) once a command has imported it; the
    check is by module so that commands that never load the compiled core do not pay for it."""
    layout = sys.modules.get("ppiped.core.layout")
    return (*UserError, layout.LayoutError) if layout is not None else UserError


def main(argv: Sequence[str] | None = None) -> int:
    from .commands.argtypes import CommandFailed

    try:
        args = build_parser().parse_args(argv)  # (imports every command: a Ctrl-C may land here)
    except KeyboardInterrupt:
        return 130
    try:
        return int(args.func(args) or 0)
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # the reader went away (``| head``): nothing left to say
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except CommandFailed as e:
        print(f"ppiped {args.command}: error: {e}", file=sys.stderr)
        return 1
    except Exception as e:
        if not isinstance(e, _user_errors()):
            raise
        print(f"ppiped {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
