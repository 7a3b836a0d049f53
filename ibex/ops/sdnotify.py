"""The systemd notify protocol, natively: one datagram per state change to ``$NOTIFY_SOCKET``.

Used by the process systemd started (``NotifyAccess=main``):

- ``ready(status)`` once the port is bound and the catalog and tokenizer are
  loaded (``Type=notify`` holds dependants and ``systemctl start`` until then);
- ``status(text)`` for one-line human status in ``systemctl status``;
- ``stopping()`` when a drain begins;
- `run_watchdog` pings ``WATCHDOG=1`` from the Trio loop itself, so a loop that
  stops scheduling stops the pings and systemd restarts the service.

Without ``NOTIFY_SOCKET`` (a shell, a container) every call is a no-op, so the
server calls these unconditionally. Sending never blocks and never raises: a
datagram to a local socket either queues at once or is dropped, and the first
failure is logged once as a warning.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Mapping, MutableMapping
from typing import Final

import trio

log = logging.getLogger(__name__)

NOTIFY_ENV: Final = "NOTIFY_SOCKET"
_WATCHDOG_ENVS: Final = ("WATCHDOG_USEC", "WATCHDOG_PID")


def _socket_address(raw: str | None) -> str | bytes | None:
    """A bindable address for the socket path; ``@name`` is Linux's abstract namespace."""
    if not raw:
        return None
    if raw.startswith("@"):
        return b"\0" + raw[1:].encode()
    if raw.startswith("/"):
        return raw
    return None  # vsock: and relative paths are not used for services like this one


def watchdog_interval(env: Mapping[str, str] | None = None) -> float | None:
    """Seconds between watchdog pings: half of ``WATCHDOG_USEC``, or None when not asked for.

    ``WATCHDOG_PID``, when set, names the process the watchdog is meant for;
    any other process (e.g. a worker that inherited the environment) gets None.
    """
    env = os.environ if env is None else env
    raw_usec = env.get("WATCHDOG_USEC", "").strip()
    if not raw_usec:
        return None
    raw_pid = env.get("WATCHDOG_PID", "").strip()
    if raw_pid:
        try:
            if int(raw_pid) != os.getpid():
                return None
        except ValueError:
            return None
    try:
        usec = int(raw_usec)
    except ValueError:
        return None
    return usec / 2_000_000 if usec > 0 else None


class Notifier:
    """Sends notify messages to one socket; a Notifier without an address does nothing."""

    def __init__(
        self, address: str | bytes | None, *, watchdog_interval: float | None = None
    ) -> None:
        self.address = address
        self.watchdog_interval = watchdog_interval
        self._sock: socket.socket | None = None
        self._warned = False

    @classmethod
    def from_env(
        cls, env: MutableMapping[str, str] | None = None, *, unset_environment: bool = False
    ) -> Notifier:
        """Read ``NOTIFY_SOCKET`` and the watchdog settings.

        With `unset_environment`, the variables are removed afterwards so child
        processes (workers) neither notify nor expect to feed the watchdog; the
        supervisor should pass it.
        """
        env = os.environ if env is None else env
        notifier = cls(
            _socket_address(env.get(NOTIFY_ENV)), watchdog_interval=watchdog_interval(env)
        )
        if env.get(NOTIFY_ENV) and notifier.address is None:
            log.warning("sd_notify_unsupported_address", extra={"notify_socket": env[NOTIFY_ENV]})
        if unset_environment:
            for name in (NOTIFY_ENV, *_WATCHDOG_ENVS):
                env.pop(name, None)
        return notifier

    @property
    def enabled(self) -> bool:
        return self.address is not None

    def notify(self, *assignments: str) -> bool:
        """Send ``KEY=value`` lines as one datagram; True if it was queued."""
        if self.address is None or not assignments:
            return False
        payload = "\n".join(assignments).encode("utf-8", "replace")
        try:
            if self._sock is None:
                self._sock = socket.socket(
                    socket.AF_UNIX, socket.SOCK_DGRAM | socket.SOCK_CLOEXEC | socket.SOCK_NONBLOCK
                )
            self._sock.sendto(payload, self.address)
        except OSError as exc:  # BlockingIOError (queue full) included
            if not self._warned:
                self._warned = True
                log.warning(
                    "sd_notify_failed",
                    extra={"error_type": type(exc).__name__, "errno": exc.errno},
                )
            return False
        return True

    def ready(self, status: str | None = None) -> bool:
        """The service is up: port bound, catalog and tokenizer loaded."""
        if status is None:
            return self.notify("READY=1")
        return self.notify("READY=1", _status_line(status))

    def status(self, text: str) -> bool:
        """One line shown by ``systemctl status``."""
        return self.notify(_status_line(text))

    def stopping(self, status: str | None = None) -> bool:
        """A drain has begun; keep `run_watchdog` running until the process exits."""
        if status is None:
            return self.notify("STOPPING=1")
        return self.notify("STOPPING=1", _status_line(status))

    def reloading(self) -> bool:
        """Configuration reload started (send `ready` when it is done)."""
        return self.notify("RELOADING=1")

    def watchdog(self) -> bool:
        """One keep-alive ping."""
        return self.notify("WATCHDOG=1")

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


def _status_line(text: str) -> str:
    # The protocol is newline-separated assignments; a newline would start a new one.
    return "STATUS=" + " ".join(text.splitlines())


async def run_watchdog(notifier: Notifier, interval: float | None = None) -> None:
    """Ping ``WATCHDOG=1`` every `interval` seconds (default: the notifier's) until cancelled.

    Returns at once when there is no watchdog to feed, so it can always be
    started in the server's nursery. The ping is sent from this Trio task, so
    it stops when the loop stops running tasks (a blocking call, a busy loop).
    """
    period = notifier.watchdog_interval if interval is None else interval
    if not notifier.enabled or period is None or period <= 0:
        return
    while True:
        notifier.watchdog()
        await trio.sleep(period)
