"""The `ibex` commands that call a running daemon: assemble, feedback, health, search.

They go through `ibex.client` (gRPC) and never load the server. Here too: the
client flags they share (address, deadline, credentials, TLS) and the one-call
runner that turns a failed call into one line on stderr.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import sys
from collections.abc import Awaitable, Callable
from typing import Any

from ibex.cli.common import (
    EXIT_ERROR,
    EXIT_NOTHING,
    EXIT_OK,
    DefaultsFormatter,
    add_json_flag,
    add_tenant_flags,
    usage,
)
from ibex.cli.render import render_report, render_search
from ibex.netaddr import split_host_port

DEFAULT_ADDR = "127.0.0.1:9092"


def add_client_flags(p: argparse.ArgumentParser, *, timeout: float = 2.0) -> None:
    """Address, deadline, credentials and TLS of a command that calls the daemon."""
    p.add_argument(
        "--addr",
        default=os.environ.get("IBEX_CONTEXT_GRPC_ADDR", DEFAULT_ADDR),
        metavar="HOST:PORT",
        help="daemon address (IBEX_CONTEXT_GRPC_ADDR when set)",
    )
    p.add_argument("--timeout", type=float, default=timeout, help="deadline in seconds")
    p.add_argument("--token", help="bearer token (default: IBEX_CONTEXT_CLIENT_TOKEN)")
    p.add_argument("--ca", metavar="FILE", help="CA file: use TLS (default: plain HTTP/2)")
    p.add_argument("--cert", metavar="FILE", help="client certificate for mutual TLS")
    p.add_argument("--key", metavar="FILE", help="client key for mutual TLS")


def client_options(args: argparse.Namespace) -> tuple[str, int, str | None, Any]:
    """Host, port, bearer token and TLS context from the client flags."""
    from ibex.client import ContextClient

    try:
        host, port = split_host_port(args.addr)
    except ValueError as exc:
        raise SystemExit(usage(args, f"--addr: {exc} (or [V6]:PORT)")) from None
    token = args.token or os.environ.get("IBEX_CONTEXT_CLIENT_TOKEN")
    try:
        ssl_ctx = ContextClient.tls_context(args.ca, args.cert, args.key) if args.ca else None
    except (OSError, ssl.SSLError) as exc:  # a missing or unreadable file, a bad PEM
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SystemExit(usage(args, f"--ca/--cert/--key: {reason} (PEM files)")) from None
    return host or "127.0.0.1", port, token, ssl_ctx


def run_client(make_client: Callable[[], Any], send: Callable[[Any], Awaitable[Any]]) -> Any:
    """One client call on a fresh event loop (the client is made and closed inside it)."""

    async def run() -> Any:
        client = make_client()
        try:
            return await send(client)
        finally:
            client.close()

    return asyncio.run(run())


def call(args: argparse.Namespace, send: Callable[[Any], Awaitable[Any]]) -> Any | None:
    """`send` on a client made from the client flags (`run_client`): its answer, or None
    after one line on stderr: `ibex COMMAND: STATUS: message` when the daemon answered an
    error, `ibex COMMAND: cannot reach ADDR: reason` when it could not be reached."""
    from grpclib.exceptions import GRPCError, StreamTerminatedError

    client_options(args)  # a bad --addr is a usage error before any connection
    try:
        return run_client(lambda: _client(args), send)
    except GRPCError as exc:
        print(f"ibex {args.command}: {exc.status.name}: {exc.message}", file=sys.stderr)
    except TimeoutError:  # grpclib's deadline; an OSError, so caught first
        print(f"ibex {args.command}: no answer from {args.addr} in time", file=sys.stderr)
    except (OSError, StreamTerminatedError) as exc:
        print(f"ibex {args.command}: cannot reach {args.addr}: {exc}", file=sys.stderr)
    return None


def _client(args: argparse.Namespace) -> Any:
    from ibex.client import ContextClient

    host, port, token, ssl_ctx = client_options(args)
    return ContextClient(host, port, token=token, ssl_context=ssl_ctx, deadline=args.timeout)


def _answer(
    args: argparse.Namespace, send: Callable[[Any], Awaitable[Any]], text: Callable[[Any], str]
) -> int:
    """`call`, then print the answer as `text` has it, or as JSON with `--json`."""
    response = call(args, send)
    if response is None:
        return EXIT_ERROR
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps(MessageToDict(response), indent=2))
    else:
        print(text(response))
    return EXIT_OK


def _message(raw: str) -> tuple[str, str]:
    role, sep, content = raw.partition(":")
    if not sep:
        raise argparse.ArgumentTypeError("expected ROLE:CONTENT")
    return role, content


def cmd_assemble(args: argparse.Namespace) -> int:
    """AssembleContext: the context and its budget report (or the response as JSON)."""
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

    result = call(args, lambda c: c.assemble(**fields))
    if result is None:
        return EXIT_ERROR
    if args.json:
        from google.protobuf.json_format import MessageToDict

        body = MessageToDict(result.response) if result.response is not None else {}
        print(json.dumps({"status": result.status, "degraded": result.degraded, **body}, indent=2))
        return EXIT_OK
    print(render_report(result))
    return EXIT_OK if result.status == "OK" else EXIT_NOTHING


def _assemble_flags(a: argparse.ArgumentParser) -> None:
    add_tenant_flags(a)
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


def cmd_feedback(args: argparse.Namespace) -> int:
    """Report which memories helped; prints each score the memory service moved."""
    return _answer(
        args,
        lambda c: c.record_feedback(
            args.memory,
            args.feedback,
            org_id=args.org,
            session_id=args.session,
            trace_id=args.trace,
            timeout=args.timeout,
        ),
        lambda response: _feedback_text(args, response),
    )


def _feedback_text(args: argparse.Namespace, response: Any) -> str:
    updates = response.updates
    out = [f"feedback {args.feedback}: recorded, {len(updates)} of {len(args.memory)} ids"]
    out += (f"  {u.memory_id:<40} {u.previous_score:.3f} -> {u.new_score:.3f}" for u in updates)
    return "\n".join(out)


def _feedback_flags(f: argparse.ArgumentParser) -> None:
    add_tenant_flags(f, agent=False)
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


# -- health ------------------------------------------------------------------------------------

SERVICE_NAME = "ibex.context.v1.ContextAssemblyService"


def cmd_health(args: argparse.Namespace) -> int:
    """The gRPC Health Check: exit 0 only when the daemon answers SERVING."""
    from grpclib.const import Status
    from grpclib.exceptions import GRPCError, StreamTerminatedError

    client_options(args)  # a bad --addr is a usage error before any connection
    try:
        status = run_client(
            lambda: _client(args), lambda c: c.health(args.service, timeout=args.timeout)
        )
    except GRPCError as exc:
        if exc.status is Status.NOT_FOUND:
            print(
                f"ibex health: {args.addr}: unknown service {args.service!r}; known: '' "
                f"(the whole server) and {SERVICE_NAME}",
                file=sys.stderr,
            )
        else:
            print(f"ibex health: {args.addr}: {exc.status.name}: {exc.message}", file=sys.stderr)
        return EXIT_ERROR
    except TimeoutError:
        print(f"ibex health: {args.addr}: no answer within {args.timeout}s", file=sys.stderr)
        return EXIT_NOTHING
    except (OSError, StreamTerminatedError) as exc:
        print(f"ibex health: cannot reach {args.addr}: {exc}", file=sys.stderr)
        return EXIT_NOTHING
    if status != "SERVING":
        print(f"ibex health: {args.addr}: {status}", file=sys.stderr)
        return EXIT_ERROR
    print(status)
    return EXIT_OK


def _health_flags(h: argparse.ArgumentParser) -> None:
    h.add_argument(
        "--service",
        default="",
        help=f"service to check: '' for the whole server, or {SERVICE_NAME} (default: '')",
    )


# -- search ------------------------------------------------------------------------------------


def cmd_search(args: argparse.Namespace) -> int:
    """SearchMemories: a table of the memories found (or the response as JSON)."""
    return _answer(
        args,
        lambda c: c.search(
            org_id=args.org,
            agent_id=args.agent,
            query=args.query,
            limit=args.limit,
            min_similarity=args.min_similarity,
            categories=list(args.category),
            tags=list(args.tag),
            session_id=args.session,
            timeout=args.timeout,
        ),
        render_search,
    )


def _search_flags(s: argparse.ArgumentParser) -> None:
    add_tenant_flags(s)
    s.add_argument("--query", required=True, help="search text (required)")
    s.add_argument(
        "--limit", type=int, default=0, help="most memories to return (0: the daemon's 10)"
    )
    s.add_argument("--min-similarity", type=float, default=0.0, help="in [0, 1]")
    s.add_argument(
        "--category", action="append", default=[], help="keep this category (repeatable)"
    )
    s.add_argument("--tag", action="append", default=[], help="keep this tag (repeatable)")
    s.add_argument("--session", default="", help="session id")


# -- the parsers -------------------------------------------------------------------------------


def _daemon_command(
    sub: Any,
    name: str,
    func: Callable[[argparse.Namespace], int],
    flags: Callable[[argparse.ArgumentParser], None],
    *,
    prints_response: bool = True,
    **parser: Any,
) -> None:
    """A subcommand that calls the daemon: the client flags, the command's own, and
    `--json` when it prints the daemon's response."""
    p: argparse.ArgumentParser = sub.add_parser(name, formatter_class=DefaultsFormatter, **parser)
    add_client_flags(p)
    flags(p)
    if prints_response:
        add_json_flag(p)
    p.set_defaults(func=func)


def register(sub: Any) -> None:
    """Add assemble, feedback, health and search to the `ibex` subcommands."""
    _daemon_command(
        sub,
        "assemble",
        cmd_assemble,
        _assemble_flags,
        help="ask a running daemon for a context block",
        description="AssembleContext. Exit 0 when the daemon answered (degraded or not), "
        "3 when it did not (the history-only fallback is printed), 1 on an error status.",
    )
    _daemon_command(
        sub,
        "feedback",
        cmd_feedback,
        _feedback_flags,
        help="tell a running daemon which memories helped",
    )
    _daemon_command(
        sub,
        "health",
        cmd_health,
        _health_flags,
        prints_response=False,
        help="gRPC health of a running daemon (exit 0 only when SERVING)",
        description="The standard gRPC Health Check. Exit 0 when SERVING; 1 when the "
        "daemon answers anything else (e.g. NOT_SERVING while draining, or an "
        "unknown --service); 3 when it cannot be reached.",
    )
    _daemon_command(
        sub,
        "search",
        cmd_search,
        _search_flags,
        help="SearchMemories on a running daemon",
        description="SearchMemories: the agent's memories that match a query, best first.",
    )
