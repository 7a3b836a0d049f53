"""`ibex` command line: serve, assemble, feedback, config, check (and, from ibex.cli_ops,
health, search, directive, --version)."""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ibex.cli_ops import (
    SAMPLE_AGENT,
    SAMPLE_ORG,
    DefaultsFormatter,
    VersionAction,
    add_client_flags,
    register,
)
from ibex.cli_ops import call as _call
from ibex.cli_ops import client_options as _client_options
from ibex.errors import ConfigError

if TYPE_CHECKING:
    from ibex.config import Settings

log = logging.getLogger(__name__)


def _settings(env: Mapping[str, str] | None = None) -> Settings:
    # Imported here: the settings table imports every layer's config struct (the whole
    # server), which the client commands and `--help` do without.
    from ibex.config import load_settings

    try:
        return load_settings(env)
    except ConfigError as exc:
        raise SystemExit(_refuse(exc)) from None


def _refuse(exc: ConfigError, what: str | None = None) -> int:
    """Say why start-up stopped in one line on stderr; the error's class's exit status."""
    print(f"ibex: {exc.label}: {what or exc}", file=sys.stderr)
    return exc.exit_status


def cmd_serve(args: argparse.Namespace) -> int:
    """Serve until a signal; a start-up refused by a setting, a file or an address is one
    line on stderr and a distinct exit status (docs/operations.md), never a traceback."""
    import signal

    import trio

    from ibex.ops.logs import configure_logging

    # SIGHUP is the supervisor's reload signal; until its handler (or a worker's) is
    # installed, its default action would end the process. Workers inherit the ignore.
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    file_env: dict[str, str] = {}
    if args.env_file is not None:
        from ibex.ops.envfile import read_env_file

        try:
            file_env = read_env_file(Path(args.env_file))
        except ConfigError as exc:
            return _refuse(exc)
    env = {**os.environ, **file_env}
    settings = _settings(env)
    if args.workers is not None:
        if args.workers < 1:
            print("ibex serve: --workers must be >= 1", file=sys.stderr)
            return 2
        settings = _replace(settings, workers=args.workers)
        try:
            settings.check_worker_ports()
        except ConfigError as exc:
            return _refuse(exc)
    if args.supervisor_fd is not None:
        try:
            os.fstat(args.supervisor_fd)
        except OSError:
            print(
                f"ibex serve: --supervisor-fd {args.supervisor_fd} is not an open file descriptor",
                file=sys.stderr,
            )
            return 2
    configure_logging(settings.log_level)
    if not args.worker:  # the supervisor already said it for its workers
        _warn_unknown_variables(env)
        _warn_config(settings)
    # /metrics exposition is ~1.25 ms of pure Python per scrape: served by a supervisor
    # process (multiprocess mode) whenever it is on, so a scrape never pauses calls.
    # An env file means reloads (SIGHUP), which only the supervisor does.
    supervised = settings.workers > 1 or settings.metrics_addr or args.env_file is not None
    try:
        if supervised and not args.worker:
            from ibex.ops.workers import supervise
            from ibex.service.root import check_bind_policy, drain_grace

            check_bind_policy(settings)
            return supervise(
                settings,
                drain_grace=drain_grace(settings),
                env_file=None if args.env_file is None else Path(args.env_file),
                file_env=file_env,
                loader=functools.partial(_reload_settings, running=settings, fixed=args.workers),
            )
        from ibex.ops.metrics import Metrics
        from ibex.service.root import make_daemon

        metrics = Metrics()
        daemon = make_daemon(
            settings, metrics=metrics, reuse_port=args.worker, worker_index=args.worker_index
        )
        if args.supervisor_fd is None:
            trio.run(daemon.serve)
        else:
            trio.run(_serve_while_supervised, daemon, args.supervisor_fd)
    except Exception as exc:
        error = _startup_error(exc)
        if error is None:
            raise
        return _refuse(error, _naming(settings, error))
    return 0


async def _serve_while_supervised(daemon: Any, supervisor_fd: int) -> None:
    """A worker's life: serve until a signal, or until the supervisor is gone."""
    import trio

    from ibex.ops.workers import leave_with_supervisor

    shutdown = trio.Event()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(leave_with_supervisor, supervisor_fd, shutdown)
        await daemon.serve(shutdown=shutdown)
        nursery.cancel_scope.cancel()


def _reload_settings(
    env: Mapping[str, str], *, running: Settings, fixed: int | None
) -> tuple[Settings, float]:
    """The supervisor's check of a reload's settings, as a start checks them: ConfigError
    names the variable. The worker count stays the running one (a restart changes it)."""
    from ibex.config import load_settings
    from ibex.service.root import check_bind_policy, drain_grace

    settings = load_settings(env)
    kept = _replace(settings, workers=running.workers)
    kept.check_worker_ports()
    check_bind_policy(kept)
    _warn_unknown_variables(env)
    _warn_config(kept)
    return (settings if fixed is None else kept), drain_grace(settings)


def _warn_unknown_variables(env: Mapping[str, str] | None = None) -> None:
    """A typo in a setting's name would otherwise leave that setting at its default unseen."""
    from ibex.config import unknown_variables

    for name, closest in unknown_variables(env):
        log.warning("unknown_setting", extra={"variable": name, "closest": closest})


def _warn_config(settings: Settings) -> None:
    """A configuration that serves less than it could: one warning line each, at every start."""
    from ibex.service.root import config_warnings

    for warning in config_warnings(settings):
        variable = warning.partition(":")[0]
        log.warning("config_warning", extra={"variable": variable, "detail": warning})


def _startup_error(exc: BaseException) -> ConfigError | None:
    """The bad setting, file or address behind a failed start, found inside Trio's
    exception groups (None: not a start-up error, let it propagate)."""
    if isinstance(exc, ConfigError):
        return exc
    if isinstance(exc, BaseExceptionGroup):
        matched = exc.subgroup(lambda e: isinstance(e, ConfigError))
        while isinstance(matched, BaseExceptionGroup):
            matched = matched.exceptions[0]
        if isinstance(matched, ConfigError):
            return matched
    return None


def _naming(settings: Settings, error: ConfigError) -> str:
    """The error's line, with the variable that names the address when it is one."""
    from ibex.errors import ListenError

    if isinstance(error, ListenError):
        from ibex.service.root import listen_variable

        return f"{listen_variable(settings, error.port)} {error}"
    return str(error)


def _replace(settings: Settings, **changes: Any) -> Settings:
    import msgspec

    return msgspec.structs.replace(settings, **changes)


def _message(raw: str) -> tuple[str, str]:
    role, sep, content = raw.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError("expected ROLE:CONTENT")
    return role, content


def cmd_assemble(args: argparse.Namespace) -> int:
    from ibex.client import ContextClient

    host, port, token, ssl_ctx = _client_options(args)
    fields: dict[str, Any] = dict(
        org_id=args.org,
        agent_id=args.agent,
        query=args.query,
        model=args.model,
        available_tokens=args.available_tokens,
        recent_messages=[{"role": r, "content": c} for r, c in args.message],
        tool_schemas=list(args.tool),
        request_id=args.request_id,
    )
    if args.max_memories:
        fields["options"] = {"max_memories": args.max_memories}

    ok, result = _call(
        "assemble",
        lambda: ContextClient(host, port, token=token, ssl_context=ssl_ctx, deadline=args.timeout),
        lambda client: client.assemble(**fields),
    )
    if not ok:
        return 1
    if args.json:
        from google.protobuf.json_format import MessageToDict

        body = MessageToDict(result.response) if result.response is not None else {}
        print(json.dumps({"status": result.status, "degraded": result.degraded, **body}, indent=2))
        return 0
    print(render_report(result))
    return 0 if result.status == "OK" else 3


def cmd_feedback(args: argparse.Namespace) -> int:
    """Report which memories helped; prints each score the memory service moved."""
    from ibex.client import ContextClient

    host, port, token, ssl_ctx = _client_options(args)
    ok, response = _call(
        "feedback",
        lambda: ContextClient(host, port, token=token, ssl_context=ssl_ctx),
        lambda client: client.record_feedback(
            args.memory,
            args.feedback,
            org_id=args.org,
            session_id=args.session,
            trace_id=args.trace,
            timeout=args.timeout,
        ),
        addr=args.addr,
    )
    if not ok:
        return 1
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps(MessageToDict(response), indent=2))
        return 0
    print(f"feedback {args.feedback}: recorded, {len(response.updates)} of {len(args.memory)} ids")
    for u in response.updates:
        print(f"  {u.memory_id:<40} {u.previous_score:.3f} -> {u.new_score:.3f}")
    return 0


def render_report(result: Any) -> str:
    """The context, then the budget table and every excluded candidate."""
    out = [result.context.rstrip("\n"), ""]
    r = result.response
    if r is None:
        out.append(f"daemon unavailable ({result.status}): history-only fallback, degraded")
        if result.messages_dropped:
            out.append(f"{result.messages_dropped} oldest messages left out to fit the window")
        return "\n".join(out)
    b = r.budget
    used_markup = r.tokens_used - r.directive_tokens - r.history_tokens - r.memory_tokens
    rows = [
        ("window", b.context_window),
        ("response reserve", b.response_reserve),
        ("safety buffer", b.safety_buffer),
        ("directive", r.directive_tokens),
        ("history", r.history_tokens),
        ("tools + markup", used_markup),
        ("memories", r.memory_tokens),
        ("free", b.context_window - b.response_reserve - b.safety_buffer - r.tokens_used),
    ]
    out.append(f"budget ({b.tokenizer_family}, {b.estimate_kind})")
    out += [f"  {name:<18}{value:>10,}" for name, value in rows]
    out.append(f"  {'tokens used':<18}{r.tokens_used:>10,}")
    # Not part of the context: the oldest messages left out so the rest fits.
    dropped = f"  ({b.messages_dropped} oldest messages, not in the context)"
    out.append(f"  {'history dropped':<18}{b.messages_dropped_tokens:>10,}{dropped}")
    filtered = r.pack.tenant_filtered
    out.append(
        f"degradation {r.degradation_level}; score {r.score_schema}; pack {r.pack.path}; "
        f"{r.memories_included} memories included"
        + (f"; {filtered} hits of other tenants filtered" if filtered else "")
    )
    # A branch's detail is why it did not succeed (e.g. the directive value's error).
    out.append(
        "branches: "
        + ", ".join(
            f"{x.source}={x.status} ({x.latency_ms:.1f}ms{'; ' + x.detail if x.detail else ''})"
            for x in r.branches
        )
    )
    if r.memories_used:  # usefulness shows what feedback (`ibex feedback`) changed
        out.append("included:")
        out += [
            f"  {m.memory_id:<40} score={m.composite_score:.3f} usefulness={m.usefulness_score:.3f}"
            for m in r.memories_used
        ]
    if r.excluded:
        out.append("excluded:")
        out += [
            f"  {m.memory_id:<40} {m.exclusion:<10} score={m.composite_score:.3f}"
            for m in r.excluded
        ]
    return "\n".join(out)


def cmd_config(args: argparse.Namespace) -> int:
    """Print every variable's effective value: set, its default, or computed at start.

    The plain form is `VARIABLE=value` lines (an environment file: durations with a
    unit, lists comma-separated, an off setting empty); `--json` is one object.
    Secrets are redacted in both.
    """
    from ibex.service.root import effective_settings

    shown = effective_settings(_settings())
    if args.json:
        print(json.dumps(shown, indent=2))
        return 0
    for name, value in shown.items():
        print(f"{name}={_env_value(value)}")
    return 0


def _env_value(value: Any) -> str:
    if value is None:
        return ""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return ",".join(str(v) for v in value)
    return str(value)


def cmd_check(args: argparse.Namespace) -> int:
    """Validate settings, catalog and tokenizer files offline and try every listening
    address; exit 1 on any error. Warnings (a configuration that serves less than it
    could) are printed but do not fail the check."""
    from ibex.assembly.catalog import CatalogError, load_catalog
    from ibex.assembly.tokens import TokenizerError, verify_files
    from ibex.config import unknown_variables
    from ibex.service.root import (
        check_bind_policy,
        config_warnings,
        listen_problems,
        server_ssl_context,
        uses_local_sample,
    )
    from ibex.sources.local_file import LocalFileError, LocalFileSource

    settings = _settings()
    unknown = unknown_variables()
    ok = not unknown
    for name, closest in unknown:
        hint = f" (did you mean {closest}?)" if closest else ""
        print(f"settings: warning: unknown variable {name}{hint}")
    warnings = config_warnings(settings)
    for line in warnings:
        print(f"settings: warning: {line}")
    if not unknown and not warnings:
        print("settings: ok")
    try:
        insecure = check_bind_policy(settings)
        server_ssl_context(settings)
    except ConfigError as exc:
        ok = False
        print(f"bind: ERROR {exc}")
    else:
        problems = listen_problems(settings)
        for addr, problem in problems:
            print(f"bind {addr}: ERROR {problem}")
        if not problems:
            print(
                f"bind {settings.grpc_addr}: ok" + (f" (warning: {insecure})" if insecure else "")
            )
        ok = ok and not problems
    try:
        catalog = load_catalog(settings.catalog_path)
        print(f"catalog: ok ({len(catalog.models)} models, {len(catalog.families)} families)")
    except CatalogError as exc:
        ok = False
        print(f"catalog: ERROR {exc}")
    try:
        for line in verify_files(settings.tiktoken_dir):
            print(f"tokenizer: {line}")
    except TokenizerError as exc:
        ok = False
        print(f"tokenizer: ERROR IBEX_CONTEXT_TIKTOKEN_DIR: {exc}")
    if uses_local_sample(settings):
        try:
            src = LocalFileSource.load(settings.local_source_path)
            print(f"local source: ok ({src.origin})")
        except LocalFileError as exc:
            ok = False
            print(f"local source: ERROR {exc}")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="ibex", description="Ibex context-assembly daemon", formatter_class=DefaultsFormatter
    )
    p.add_argument("--version", action=VersionAction)
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser(
        "serve",
        help="run the daemon (settings from IBEX_CONTEXT_*)",
        formatter_class=DefaultsFormatter,
    )
    s.add_argument(
        "--workers",
        type=int,
        default=None,
        help="worker processes (default: IBEX_CONTEXT_WORKERS, which defaults to 1)",
    )
    s.add_argument(
        "--env-file",
        metavar="PATH",
        default=None,
        help="NAME=value lines over the environment, read at start and again at each "
        "SIGHUP (a reload: workers replaced one at a time); runs under the supervisor",
    )
    s.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    # Set by the supervisor (ibex/ops/workers.py): this worker's slot, for its own
    # port (IBEX_CONTEXT_WORKER_PORT_BASE + index) and the x-ibex-worker trailer.
    s.add_argument("--worker-index", type=int, default=None, help=argparse.SUPPRESS)
    # Set by the supervisor: a pipe that turns readable when it is gone (leave_with_supervisor).
    s.add_argument("--supervisor-fd", type=int, default=None, help=argparse.SUPPRESS)
    s.set_defaults(func=cmd_serve)

    a = sub.add_parser(
        "assemble",
        help="ask a running daemon for a context block",
        description="AssembleContext. Exit 0 when the daemon answered (degraded or not), "
        "3 when it did not (the history-only fallback is printed), 1 on an error status.",
        formatter_class=DefaultsFormatter,
    )
    add_client_flags(a)
    a.add_argument("--org", default=SAMPLE_ORG, help="org UUID")
    a.add_argument("--agent", default=SAMPLE_AGENT, help="agent UUID")
    a.add_argument(
        "--query", default="How should I deploy the service on Friday?", help="the user turn"
    )
    a.add_argument("--model", default="gpt-4o", help="model id, looked up in the catalog")
    a.add_argument(
        "--available-tokens",
        type=int,
        default=0,
        help="caps the window (0: the model's); sizes a model the catalog does not know",
    )
    a.add_argument("--max-memories", type=int, default=0, help="0: no cap (hard cap 100)")
    a.add_argument(
        "--message",
        type=_message,
        action="append",
        default=[],
        metavar="ROLE:CONTENT",
        help="history message (repeatable)",
    )
    a.add_argument("--tool", action="append", default=[], help="tool schema JSON (repeatable)")
    a.add_argument("--request-id", default="cli", help="correlation id, echoed")
    a.add_argument("--json", action="store_true", help="print the whole response as JSON")
    a.set_defaults(func=cmd_assemble)

    f = sub.add_parser(
        "feedback",
        help="tell a running daemon which memories helped",
        formatter_class=DefaultsFormatter,
    )
    add_client_flags(f)
    f.add_argument("--org", default=SAMPLE_ORG, help="org UUID")
    f.add_argument(
        "--memory", action="append", required=True, metavar="ID", help="memory id (repeatable)"
    )
    f.add_argument(
        "--feedback",
        required=True,
        choices=("positive", "negative", "neutral"),
        help="whether the memories helped",
    )
    f.add_argument("--session", default="", help="session id")
    f.add_argument("--trace", default="", help="trace id (part of the idempotency key)")
    f.add_argument("--json", action="store_true", help="print the whole response as JSON")
    f.set_defaults(func=cmd_feedback)

    c = sub.add_parser("config", help="print effective settings (secrets redacted)")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=cmd_config)
    k = sub.add_parser("check", help="validate settings, catalog and tokenizer files offline")
    k.set_defaults(func=cmd_check)
    register(sub)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
