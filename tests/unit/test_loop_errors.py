"""The asyncio loop's exception handler (ibex/service/edge/loop_errors.py): accept errors
for lack of resources logged once per interval, anything else logged as an error, and
nothing raised into the loop."""

from __future__ import annotations

import errno
import logging

import pytest

from ibex.service.edge import loop_errors
from ibex.service.edge.loop_errors import LoopErrorHandler


def _events(caplog: pytest.LogCaptureFixture, name: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage() == name]


def test_accept_failures_for_lack_of_resources_are_logged_once_per_interval(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    now = [0.0]
    monkeypatch.setattr(loop_errors.time, "monotonic", lambda: now[0])
    handler = LoopErrorHandler(interval=10.0)
    emfile = OSError(errno.EMFILE, "Too many open files")
    with caplog.at_level(logging.INFO, logger="ibex.service.edge.loop_errors"):
        for _ in range(3):
            handler(
                None, {"exception": emfile, "message": "socket.accept() out of system resource"}
            )  # type: ignore[arg-type]
        now[0] = 10.0
        handler(None, {"exception": OSError(errno.ENFILE, "x"), "message": "accept"})  # type: ignore[arg-type]
    lines = _events(caplog, "accept_failed")
    assert [(r.error, r.count, r.levelno) for r in lines] == [  # type: ignore[attr-defined]
        ("EMFILE", 1, logging.WARNING),
        ("ENFILE", 3, logging.WARNING),  # the two held back, and this one
    ]
    assert lines[0].detail == "socket.accept() out of system resource"  # type: ignore[attr-defined]
    assert handler.accept_errors == 4
    now[0] = 20.0
    with caplog.at_level(logging.INFO, logger="ibex.service.edge.loop_errors"):
        handler(None, {"exception": emfile})  # type: ignore[arg-type]  # no message in the context
    assert _events(caplog, "accept_failed")[-1].detail == ""  # type: ignore[attr-defined]
    assert _events(caplog, "loop_error") == []


def test_any_other_loop_error_is_logged_as_an_error_and_never_raised(
    caplog: pytest.LogCaptureFixture,
) -> None:
    handler = LoopErrorHandler()
    with caplog.at_level(logging.INFO, logger="ibex.service.edge.loop_errors"):
        handler(None, {"exception": ValueError("boom"), "message": "Exception in callback"})  # type: ignore[arg-type]
        handler(None, {"message": "no exception here"})  # type: ignore[arg-type]
        handler(None, {"exception": OSError(errno.ECONNRESET, "reset")})  # type: ignore[arg-type]
    lines = _events(caplog, "loop_error")
    assert [(r.levelno, r.detail, r.error) for r in lines] == [  # type: ignore[attr-defined]
        (logging.ERROR, "Exception in callback", "ValueError('boom')"),
        (logging.ERROR, "no exception here", None),
        (logging.ERROR, "", "ConnectionResetError(104, 'reset')"),
    ]
    assert handler.accept_errors == 0
