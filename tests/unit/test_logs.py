"""Structured logging: shape of a line, request binding across Trio tasks, redaction, levels."""

from __future__ import annotations

import io
import json
import logging
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import trio
import trio.lowlevel

from ibex.config import Settings
from ibex.ops.logs import (
    ERROR_MESSAGE_MAX,
    REDACTED,
    bind_request,
    bound_fields,
    configure_logging,
    redact_urls,
)

Capture = Callable[[str], Callable[[], list[dict[str, Any]]]]


@pytest.fixture
def capture() -> Iterator[Capture]:
    """configure_logging into a StringIO; returns a reader of the parsed lines."""
    root = logging.getLogger()
    ibex_logger = logging.getLogger("ibex")
    saved = (list(root.handlers), root.level, ibex_logger.level)

    def setup(level: str) -> Callable[[], list[dict[str, Any]]]:
        stream = io.StringIO()
        configure_logging(level, stream=stream)

        def lines() -> list[dict[str, Any]]:
            return [json.loads(line) for line in stream.getvalue().splitlines()]

        return lines

    yield setup
    for handler in list(root.handlers):
        if handler not in saved[0]:
            root.removeHandler(handler)
    root.setLevel(saved[1])
    ibex_logger.setLevel(saved[2])
    logging.captureWarnings(False)


def test_one_json_object_per_line_with_fixed_keys(capture: Capture) -> None:
    lines = capture("info")
    log = logging.getLogger("ibex.service.handlers")
    log.info("assembled", extra={"tokens_used": 812, "branches": ["hot", "cold"], "ok": True})
    log.warning("second")
    first, second = lines()
    assert re.fullmatch(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\.\d{3}Z", first["ts"])
    assert first["level"] == "info"
    assert first["event"] == "assembled"
    assert first["logger"] == "ibex.service.handlers"
    assert first["tokens_used"] == 812
    assert first["branches"] == ["hot", "cold"]
    assert first["ok"] is True
    assert second["level"] == "warning"
    assert "request_id" not in first


def test_reserved_keys_are_not_overwritten_by_fields(capture: Capture) -> None:
    lines = capture("info")
    logging.getLogger("ibex.x").info("real", extra={"event": "fake", "level": "fake"})
    (line,) = lines()
    assert line["event"] == "real"
    assert line["level"] == "info"
    assert line["event_"] == "fake"
    assert line["level_"] == "fake"


async def test_request_binding_reaches_every_trio_task(capture: Capture) -> None:
    lines = capture("info")
    log = logging.getLogger("ibex.sources.retrieval")

    async def branch(name: str) -> None:
        await trio.lowlevel.checkpoint()
        log.info("branch_done", extra={"branch": name})

    async def other_request() -> None:
        with bind_request("req-2", "trace-2"):
            await trio.lowlevel.checkpoint()
            log.info("other")

    async with trio.open_nursery() as outer:
        outer.start_soon(other_request)
        with bind_request("req-1", "trace-1", org_id="org-a"):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(branch, "hot")
                nursery.start_soon(branch, "cold")
            log.info("assembled")
    log.info("after")

    by_event: dict[str, list[dict[str, Any]]] = {}
    for line in lines():
        by_event.setdefault(line["event"], []).append(line)
    assert {line["branch"] for line in by_event["branch_done"]} == {"hot", "cold"}
    for line in [*by_event["branch_done"], *by_event["assembled"]]:
        assert (line["request_id"], line["trace_id"], line["org_id"]) == (
            "req-1",
            "trace-1",
            "org-a",
        )
    (other,) = by_event["other"]
    assert (other["request_id"], other["trace_id"]) == ("req-2", "trace-2")
    assert "org_id" not in other
    (after,) = by_event["after"]
    assert "request_id" not in after
    assert bound_fields() == {}


def test_nested_binding_adds_and_restores(capture: Capture) -> None:
    lines = capture("info")
    log = logging.getLogger("ibex.x")
    with bind_request("r", "t"):
        with bind_request(trace_id="t2", span_id="s"):
            log.info("inner")
        log.info("outer")
    inner, outer = lines()
    assert (inner["request_id"], inner["trace_id"], inner["span_id"]) == ("r", "t2", "s")
    assert (outer["request_id"], outer["trace_id"]) == ("r", "t")
    assert "span_id" not in outer


def test_denylisted_fields_are_redacted_at_any_depth(capture: Capture) -> None:
    lines = capture("debug")
    secret = "s3cr3t-value"
    settings = Settings(memory_api_token=secret, memory_base_url="http://memory.internal")
    logging.getLogger("ibex.x").info(
        "start",
        extra={
            "token": secret,
            "Authorization": f"Bearer {secret}",
            "content": f"memory text {secret}",
            "query": secret,
            "assembled_context": secret,
            "upstream_api_key": secret,
            "settings": settings,
            "request": {"headers": {"authorization": secret}, "items": [{"password": secret}]},
            "tokens_used": 5,
        },
    )
    raw = json.dumps(lines())
    assert secret not in raw
    (line,) = lines()
    for key in ("token", "Authorization", "content", "query", "assembled_context"):
        assert line[key] == REDACTED
    assert line["upstream_api_key"] == REDACTED
    assert line["settings"]["memory_api_token"] == REDACTED
    assert line["settings"]["memory_base_url"] == "http://memory.internal"
    assert line["request"]["headers"]["authorization"] == REDACTED
    assert line["request"]["items"][0]["password"] == REDACTED
    assert line["tokens_used"] == 5


def test_bound_fields_are_redacted_too(capture: Capture) -> None:
    lines = capture("info")
    with bind_request("r", "t", token="leak"):
        logging.getLogger("ibex.x").info("e")
    (line,) = lines()
    assert line["token"] == REDACTED


def test_unknown_objects_are_logged_by_type_name_only(capture: Capture) -> None:
    class Client:
        def __repr__(self) -> str:
            return "Client(password='hunter2')"

    lines = capture("info")
    logging.getLogger("ibex.x").info("e", extra={"client": Client()})
    (line,) = lines()
    assert line["client"] == "<Client>"


def test_exception_is_type_and_short_message_without_traceback_at_info(capture: Capture) -> None:
    lines = capture("info")
    try:
        raise ValueError("x" * 1000)
    except ValueError:
        logging.getLogger("ibex.x").exception("failed")
    (line,) = lines()
    assert line["level"] == "error"
    assert line["error_type"] == "ValueError"
    assert line["error"] == "x" * ERROR_MESSAGE_MAX
    assert "traceback" not in line


def test_traceback_only_at_debug(capture: Capture) -> None:
    lines = capture("debug")
    try:
        raise KeyError("k")
    except KeyError:
        logging.getLogger("ibex.x").warning("failed", exc_info=True)
    (line,) = lines()
    assert line["error_type"] == "KeyError"
    assert "Traceback" in line["traceback"]


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("http://user:secret@otel.internal:4318", "http://<redacted>@otel.internal:4318"),
        ("https://:secret@h/v1/traces", "https://<redacted>@h/v1/traces"),
        # An unencoded password holding `/`, `?`, `#` or `@`: up to the last `@`.
        ("redis://u:p/a?s#s@w@h:6379/0", "redis://<redacted>@h:6379/0"),
        (
            "to http://u:secret@a/ and https://v:secret@b/.",
            "to http://<redacted>@a/ and https://<redacted>@b/.",
        ),
        ("rediss://h:6380/0?password=secret&db=1", "rediss://h:6380/0?password=<redacted>&db=1"),
        ("https://h/x?api_key=secret;sig=secret", "https://h/x?api_key=<redacted>;sig=<redacted>"),
        ("http://127.0.0.1:4318/v1/traces", "http://127.0.0.1:4318/v1/traces"),
        ("user@example.com wrote", "user@example.com wrote"),
        ("no url here", "no url here"),
        # What a setting's URL loses, a logged one loses too.
        (
            "memory at https://svc:hunter2@m:8443/?Password=x&db=1 down",
            "memory at https://<redacted>@m:8443/?Password=<redacted>&db=1 down",
        ),
    ],
)
def test_redact_urls(text: str, expected: str) -> None:
    assert redact_urls(text) == expected


def test_url_credentials_are_redacted_wherever_a_line_carries_them(capture: Capture) -> None:
    """Fields at any depth, bound fields, a third-party event's arguments, errors, tracebacks."""
    lines = capture("debug")
    url = "http://user:secret@otel.internal:4318/v1/traces"
    with bind_request("r", "t", upstream=url):
        logging.getLogger("ibex.x").info("e", extra={"endpoint": url, "nested": {"urls": [url]}})
        logging.getLogger("urllib3.connectionpool").warning("Retrying %s", url)
        try:
            raise ConnectionError(f"cannot reach {url}")
        except ConnectionError:
            logging.getLogger("ibex.x").warning("export_failed", exc_info=True)
    raw = "\n".join(json.dumps(line) for line in lines())
    assert "secret" not in raw
    first, third_party, failed = lines()
    redacted = "http://<redacted>@otel.internal:4318/v1/traces"
    assert first["endpoint"] == first["upstream"] == redacted
    assert first["nested"] == {"urls": [redacted]}
    assert third_party["event"] == f"Retrying {redacted}"
    assert failed["error"] == f"cannot reach {redacted}"
    assert redacted in failed["traceback"]


def test_level_filtering(capture: Capture) -> None:
    lines = capture("warning")
    log = logging.getLogger("ibex.x")
    log.debug("d")
    log.info("i")
    log.warning("w")
    log.error("e")
    assert [line["event"] for line in lines()] == ["w", "e"]
    assert not log.isEnabledFor(logging.INFO)


def test_debug_level_for_ibex_but_not_third_party(capture: Capture) -> None:
    lines = capture("debug")
    logging.getLogger("ibex.x").debug("ours")
    logging.getLogger("httpcore.connection").debug("theirs")
    logging.getLogger("httpcore.connection").info("theirs")
    logging.getLogger("grpclib.server").warning("their warning")
    assert [line["event"] for line in lines()] == ["ours", "their warning"]


def test_reconfiguring_replaces_the_handler(capture: Capture) -> None:
    capture("info")
    lines = capture("info")
    logging.getLogger("ibex.x").info("once")
    assert [line["event"] for line in lines()] == ["once"]
    ours = [h for h in logging.getLogger().handlers if type(h).__name__ == "_IbexHandler"]
    assert len(ours) == 1


def test_bad_level_is_rejected() -> None:
    with pytest.raises(ValueError, match="log level"):
        configure_logging("verbose")
