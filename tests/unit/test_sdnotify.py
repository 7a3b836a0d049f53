"""The notify protocol against a real AF_UNIX datagram socket standing in for systemd."""

from __future__ import annotations

import os
import socket
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import trio
import trio.testing

from ibex.ops.sdnotify import Notifier, run_watchdog, watchdog_interval


@pytest.fixture
def systemd(tmp_path: Path) -> Iterator[tuple[socket.socket, str]]:
    """A bound datagram socket and its path, as systemd would pass in NOTIFY_SOCKET."""
    path = str(tmp_path / "notify")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.setblocking(False)
    yield sock, path
    sock.close()


def received(sock: socket.socket) -> list[str]:
    out = []
    while True:
        try:
            out.append(sock.recv(4096).decode())
        except BlockingIOError:
            return out


def test_messages_arrive_as_datagrams(systemd: tuple[socket.socket, str]) -> None:
    sock, path = systemd
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path})
    assert notifier.enabled
    assert notifier.ready("listening on 127.0.0.1:9092")
    assert notifier.status("serving\nsecond line")
    assert notifier.watchdog()
    assert notifier.reloading()
    assert notifier.stopping("draining")
    assert notifier.stopping()
    notifier.close()
    assert received(sock) == [
        "READY=1\nSTATUS=listening on 127.0.0.1:9092",
        "STATUS=serving second line",
        "WATCHDOG=1",
        "RELOADING=1",
        "STOPPING=1\nSTATUS=draining",
        "STOPPING=1",
    ]


def test_ready_without_status(systemd: tuple[socket.socket, str]) -> None:
    sock, path = systemd
    Notifier.from_env({"NOTIFY_SOCKET": path}).ready()
    assert received(sock) == ["READY=1"]


def test_abstract_socket() -> None:
    name = f"ibex-test-{uuid.uuid4().hex}"
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(b"\0" + name.encode())
    sock.setblocking(False)
    try:
        notifier = Notifier.from_env({"NOTIFY_SOCKET": "@" + name})
        assert notifier.ready()
        assert received(sock) == ["READY=1"]
    finally:
        sock.close()


def test_unset_socket_is_a_no_op() -> None:
    notifier = Notifier.from_env({})
    assert not notifier.enabled
    assert not notifier.ready("x")
    assert not notifier.watchdog()
    assert notifier.watchdog_interval is None


def test_failure_neither_raises_nor_warns_twice(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    notifier = Notifier.from_env({"NOTIFY_SOCKET": str(tmp_path / "nobody-listens")})
    with caplog.at_level("WARNING", logger="ibex.ops.sdnotify"):
        assert not notifier.ready()
        assert not notifier.watchdog()
    assert [r.getMessage() for r in caplog.records] == ["sd_notify_failed"]


def test_unsupported_address_is_disabled_with_a_warning(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="ibex.ops.sdnotify"):
        notifier = Notifier.from_env({"NOTIFY_SOCKET": "vsock:2:1234"})
    assert not notifier.enabled
    assert [r.getMessage() for r in caplog.records] == ["sd_notify_unsupported_address"]


def test_unset_environment_hides_notify_from_children(systemd: tuple[socket.socket, str]) -> None:
    _, path = systemd
    env = {"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "10000000", "OTHER": "kept"}
    notifier = Notifier.from_env(env, unset_environment=True)
    assert notifier.enabled
    assert notifier.watchdog_interval == 5.0
    assert env == {"OTHER": "kept"}


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, None),
        ({"WATCHDOG_USEC": "10000000"}, 5.0),
        ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid())}, 1.5),
        ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": str(os.getpid() + 1)}, None),
        ({"WATCHDOG_USEC": "3000000", "WATCHDOG_PID": "junk"}, None),
        ({"WATCHDOG_USEC": "0"}, None),
        ({"WATCHDOG_USEC": "soon"}, None),
    ],
)
def test_watchdog_interval(env: dict[str, str], expected: float | None) -> None:
    assert watchdog_interval(env) == expected


async def test_run_watchdog_pings_at_half_the_timeout(
    systemd: tuple[socket.socket, str], autojump_clock: trio.testing.MockClock
) -> None:
    sock, path = systemd
    notifier = Notifier.from_env({"NOTIFY_SOCKET": path, "WATCHDOG_USEC": "2000000"})
    assert notifier.watchdog_interval == 1.0
    with trio.move_on_after(10.5):
        await run_watchdog(notifier)
    # One ping at start, then one per second: t = 0, 1, ..., 10.
    assert received(sock) == ["WATCHDOG=1"] * 11


async def test_run_watchdog_returns_when_there_is_no_watchdog(
    systemd: tuple[socket.socket, str], autojump_clock: trio.testing.MockClock
) -> None:
    sock, path = systemd
    with trio.fail_after(1):
        await run_watchdog(Notifier.from_env({"NOTIFY_SOCKET": path}))
        await run_watchdog(Notifier.from_env({"WATCHDOG_USEC": "2000000"}))
    assert received(sock) == []
