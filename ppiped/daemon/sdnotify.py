"""systemd notification (``Type=notify``, ``WatchdogSec=``) without libsystemd.

``READY=1`` once the sockets are bound, ``WATCHDOG=1`` from the event loop at a third of the
watchdog period (a hung loop stops petting and systemd restarts the scheduler), ``STOPPING=1``.
Every call is a no-op outside systemd.
"""

from __future__ import annotations

import os
import socket


def notify(state: str) -> bool:
    addr = os.environ.get("NOTIFY_SOCKET")
    if not addr:
        return False
    if addr.startswith("@"):
        addr = "\0" + addr[1:]
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC) as s:
            s.connect(addr)
            # never block the event loop: a systemd (or test listener) that does not read loses a
            # datagram rather than stalling the scheduler
            s.send(state.encode(), socket.MSG_DONTWAIT)
        return True
    except OSError:
        return False


def watchdog_interval_s() -> float | None:
    """Seconds between WATCHDOG=1 pings (a third of WatchdogSec), or None if no watchdog is asked for."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(0.01, int(usec) / 3e6)
    except ValueError:
        return None
