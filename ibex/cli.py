"""`ibex` command line: serve, assemble, feedback, config, check."""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import logging
import os
import sys
from collections.abc import Awaitable, Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ibex.config import ConfigError, Settings, load_settings, unknown_variables
from ibex.netaddr import split_host_port

SAMPLE_ORG = "00000000-0000-4000-8000-000000000001"
SAMPLE_AGENT = "00000000-0000-4000-8000-0000000000a1"

log = logging.getLogger(__name__)


def _settings(env: Mapping[str, str] | None = None) -> Settings:
    try:
        return load_settings(env)
    except ConfigError as exc:
        print(f"ibex: configuration error: {exc}", file=sys.stderr)
        raise SystemExit(2) from None


def cmd_serve(args: argparse.Namespace) -> int:
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
            print(f"ibex: configuration error: {exc}", file=sys.stderr)
            return 2
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
            print(f"ibex: configuration error: {exc}", file=sys.stderr)
            return 2
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
    # /metrics exposition is ~1.25 ms of pure Python per scrape: served by a supervisor
    # process (multiprocess mode) whenever it is on, so a scrape never pauses calls.
    # An env file means reloads (SIGHUP), which only the supervisor does.
    supervised = settings.workers > 1 or settings.metrics_addr or args.env_file is not None
    if supervised and not args.worker:
        from ibex.ops.workers import supervise
        from ibex.service.root import check_bind_policy, drain_grace

        try:
            check_bind_policy(settings)
        except ConfigError as exc:
            print(f"ibex: configuration error: {exc}", file=sys.stderr)
            return 2
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

    try:
        if args.supervisor_fd is None:
            trio.run(daemon.serve)
        else:
            trio.run(_serve_while_supervised, daemon, args.supervisor_fd)
    except Exception as exc:
        error = _startup_error(exc)
        if error is None:
            raise
        print(f"ibex: configuration error: {error}", file=sys.stderr)
        return 2
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
    from ibex.service.root import check_bind_policy, drain_grace

    settings = load_settings(env)
    kept = _replace(settings, workers=running.workers)
    kept.check_worker_ports()
    check_bind_policy(kept)
    _warn_unknown_variables(env)
    return (settings if fixed is None else kept), drain_grace(settings)


def _warn_unknown_variables(env: Mapping[str, str] | None = None) -> None:
    """A typo in a setting's name would otherwise leave that setting at its default unseen."""
    for name, closest in unknown_variables(env):
        log.warning("unknown_setting", extra={"variable": name, "closest": closest})


def _startup_error(exc: BaseException) -> BaseException | None:
    """The bad setting or file behind a failed start, unwrapped from Trio's exception groups."""
    from ibex.assembly.catalog import CatalogError
    from ibex.assembly.tokens import TokenizerError
    from ibex.sources.local_file import LocalFileError

    if isinstance(exc, ConfigError | CatalogError | LocalFileError | TokenizerError):
        return exc
    if isinstance(exc, BaseExceptionGroup) and len(exc.exceptions) == 1:
        return _startup_error(exc.exceptions[0])
    return None


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


def _call(
    command: str, make_client: Callable[[], Any], call: Callable[[Any], Awaitable[Any]]
) -> tuple[bool, Any]:
    """One client call on a fresh event loop (the client is made and closed inside it);
    (False, None) after printing `ibex COMMAND: STATUS: message` on stderr when the daemon
    answered an error."""
    from grpclib.exceptions import GRPCError

    async def run() -> Any:
        client = make_client()
        try:
            return await call(client)
        finally:
            client.close()

    try:
        return True, asyncio.run(run())
    except GRPCError as exc:
        print(f"ibex {command}: {exc.status.name}: {exc.message}", file=sys.stderr)
        return False, None


def _client_options(args: argparse.Namespace) -> tuple[str, int, str | None, Any]:
    """Host, port, bearer token and TLS context from the client flags shared by commands."""
    from ibex.client import ContextClient

    host, port = split_host_port(args.addr)
    token = args.token or os.environ.get("IBEX_CONTEXT_CLIENT_TOKEN")
    ssl_ctx = ContextClient.tls_context(args.ca, args.cert, args.key) if args.ca else None
    return host or "127.0.0.1", port, token, ssl_ctx


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
    out.append(
        "branches: "
        + ", ".join(f"{x.source}={x.status} ({x.latency_ms:.1f}ms)" for x in r.branches)
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
    """Print every setting's effective value, an unset one at its layer's default."""
    from ibex.service.root import effective_settings

    settings = _settings()
    print(json.dumps(effective_settings(settings), indent=2, sort_keys=True))
    return 0


def cmd_check(args: argparse.Namespace) -> int:
    """Validate settings, catalog and tokenizer files offline; exit non-zero on any error."""
    from ibex.assembly.catalog import CatalogError, load_catalog
    from ibex.assembly.tokens import TokenizerError, verify_files
    from ibex.service.root import check_bind_policy, server_ssl_context, uses_local_sample
    from ibex.sources.local_file import LocalFileError, LocalFileSource

    settings = _settings()
    unknown = unknown_variables()
    ok = not unknown
    for name, closest in unknown:
        hint = f" (did you mean {closest}?)" if closest else ""
        print(f"settings: warning: unknown variable {name}{hint}")
    if not unknown:
        print("settings: ok")
    try:
        warning = check_bind_policy(settings)
        server_ssl_context(settings)
        print(f"bind {settings.grpc_addr}: ok" + (f" (warning: {warning})" if warning else ""))
    except ConfigError as exc:
        ok = False
        print(f"bind: ERROR {exc}")
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
        print(f"tokenizer: ERROR {exc}")
    if uses_local_sample(settings):
        try:
            src = LocalFileSource.load(settings.local_source_path)
            print(f"local source: ok ({src.origin})")
        except LocalFileError as exc:
            ok = False
            print(f"local source: ERROR {exc}")
    return 0 if ok else 1


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ibex", description="Ibex context-assembly daemon")
    sub = p.add_subparsers(dest="command", required=True)
    s = sub.add_parser("serve", help="run the daemon (settings from IBEX_CONTEXT_*)")
    s.add_argument("--workers", type=int, default=None, help="worker processes (default 1)")
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

    a = sub.add_parser("assemble", help="ask a running daemon for a context block")
    a.add_argument("--addr", default=os.environ.get("IBEX_CONTEXT_GRPC_ADDR", "127.0.0.1:9092"))
    a.add_argument("--org", default=SAMPLE_ORG)
    a.add_argument("--agent", default=SAMPLE_AGENT)
    a.add_argument("--query", default="How should I deploy the service on Friday?")
    a.add_argument("--model", default="gpt-4o")
    a.add_argument("--available-tokens", type=int, default=0)
    a.add_argument("--max-memories", type=int, default=0)
    a.add_argument(
        "--message",
        type=_message,
        action="append",
        default=[],
        metavar="ROLE:CONTENT",
        help="history message (repeatable)",
    )
    a.add_argument("--tool", action="append", default=[], help="tool schema JSON (repeatable)")
    a.add_argument("--request-id", default="cli")
    a.add_argument("--timeout", type=float, default=2.0, help="deadline in seconds")
    a.add_argument("--token", help="bearer token (or IBEX_CONTEXT_CLIENT_TOKEN)")
    a.add_argument("--ca", help="CA file: use TLS")
    a.add_argument("--cert", help="client certificate for mutual TLS")
    a.add_argument("--key", help="client key for mutual TLS")
    a.add_argument("--json", action="store_true", help="print the whole response as JSON")
    a.set_defaults(func=cmd_assemble)

    f = sub.add_parser("feedback", help="tell a running daemon which memories helped")
    f.add_argument("--addr", default=os.environ.get("IBEX_CONTEXT_GRPC_ADDR", "127.0.0.1:9092"))
    f.add_argument("--org", default=SAMPLE_ORG)
    f.add_argument(
        "--memory", action="append", required=True, metavar="ID", help="memory id (repeatable)"
    )
    f.add_argument("--feedback", required=True, choices=("positive", "negative", "neutral"))
    f.add_argument("--session", default="", help="session id")
    f.add_argument("--trace", default="", help="trace id (part of the idempotency key)")
    f.add_argument("--timeout", type=float, default=2.0, help="deadline in seconds")
    f.add_argument("--token", help="bearer token (or IBEX_CONTEXT_CLIENT_TOKEN)")
    f.add_argument("--ca", help="CA file: use TLS")
    f.add_argument("--cert", help="client certificate for mutual TLS")
    f.add_argument("--key", help="client key for mutual TLS")
    f.add_argument("--json", action="store_true", help="print the whole response as JSON")
    f.set_defaults(func=cmd_feedback)

    c = sub.add_parser("config", help="print effective settings (secrets redacted)")
    c.set_defaults(func=cmd_config)
    k = sub.add_parser("check", help="validate settings, catalog and tokenizer files offline")
    k.set_defaults(func=cmd_check)
    return p


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.func(args))
