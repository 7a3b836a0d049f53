"""The operator's `ibex` commands: version, health, search, directive get/put.

They talk to a running daemon through `ibex.client` (gRPC), or to the directive
cache in Redis the way the daemon reads it (`ibex.sources.directive_envelope`),
and never load the server. Also here: the client flags and the one-call runner
that `ibex assemble` and `ibex feedback` share, and the help formatter every
subcommand uses, so `--help` shows each option's default.

Exit statuses: 0 success; 1 the daemon or Redis answered an error (or a value
the daemon would refuse); 2 a usage or configuration error; 3 nothing to show
(no answer from the daemon for `health`, no directive for `directive get`).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import ssl
import sys
import uuid
from collections.abc import Awaitable, Callable, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from ibex.errors import ConfigError
from ibex.netaddr import split_host_port

if TYPE_CHECKING:
    from ibex.config import Settings

SAMPLE_ORG = "00000000-0000-4000-8000-000000000001"
SAMPLE_AGENT = "00000000-0000-4000-8000-0000000000a1"
DEFAULT_ADDR = "127.0.0.1:9092"
DISTRIBUTION = "ibex-context"
#: Seconds a Redis connect or command may take before `ibex directive` gives up.
REDIS_TIMEOUT = 2.0

EXIT_OK, EXIT_ERROR, EXIT_USAGE, EXIT_NOTHING = 0, 1, 2, 3


class DefaultsFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends `(default: X)` to every option that has a default worth showing; an unset
    option (None), an off switch (False) or an empty list shows none."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        default = action.default
        if default is None or default is False or default == [] or default == "":
            return action.help
        return super()._get_help_string(action)


def version_text() -> str:
    """The installed distribution's version and the interface versions it speaks."""
    from importlib.metadata import PackageNotFoundError, version

    from ibex import __version__
    from ibex.sources.directive_envelope import ENVELOPE_VERSION

    try:
        installed = version(DISTRIBUTION)
    except PackageNotFoundError:  # run from a source tree that is not installed
        installed = __version__
    return (
        f"{DISTRIBUTION} {installed} "
        f"(gRPC API ibex.context.v1, directive envelope v{ENVELOPE_VERSION})"
    )


# -- the client plumbing shared with `assemble` and `feedback` --------------------------------


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
        raise SystemExit(_usage(args, f"--addr: {exc} (or [V6]:PORT)")) from None
    token = args.token or os.environ.get("IBEX_CONTEXT_CLIENT_TOKEN")
    try:
        ssl_ctx = ContextClient.tls_context(args.ca, args.cert, args.key) if args.ca else None
    except (OSError, ssl.SSLError) as exc:  # a missing or unreadable file, a bad PEM
        reason = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc)
        raise SystemExit(_usage(args, f"--ca/--cert/--key: {reason} (PEM files)")) from None
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


def call(
    command: str,
    make_client: Callable[[], Any],
    send: Callable[[Any], Awaitable[Any]],
    *,
    addr: str = "",
) -> tuple[bool, Any]:
    """`run_client`, or (False, None) after printing one line on stderr: `ibex COMMAND:
    STATUS: message` when the daemon answered an error, `ibex COMMAND: cannot reach
    ADDR: reason` when it could not be reached."""
    from grpclib.exceptions import GRPCError, StreamTerminatedError

    try:
        return True, run_client(make_client, send)
    except GRPCError as exc:
        print(f"ibex {command}: {exc.status.name}: {exc.message}", file=sys.stderr)
    except TimeoutError:  # grpclib's deadline; an OSError, so caught first
        print(f"ibex {command}: no answer from {addr or 'the daemon'} in time", file=sys.stderr)
    except (OSError, StreamTerminatedError) as exc:
        print(f"ibex {command}: cannot reach {addr or 'the daemon'}: {exc}", file=sys.stderr)
    return False, None


def _client(args: argparse.Namespace) -> Any:
    from ibex.client import ContextClient

    host, port, token, ssl_ctx = client_options(args)
    return ContextClient(host, port, token=token, ssl_context=ssl_ctx, deadline=args.timeout)


def _usage(args: argparse.Namespace, message: str) -> int:
    print(f"ibex {args.command}: {message}", file=sys.stderr)
    return EXIT_USAGE


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


# -- search ------------------------------------------------------------------------------------


def cmd_search(args: argparse.Namespace) -> int:
    """SearchMemories: a table of the memories found (or the response as JSON)."""
    ok, response = call(
        "search",
        lambda: _client(args),
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
        addr=args.addr,
    )
    if not ok:
        return EXIT_ERROR
    if args.json:
        from google.protobuf.json_format import MessageToDict

        print(json.dumps(MessageToDict(response), indent=2))
        return EXIT_OK
    print(render_search(response))
    return EXIT_OK


def printable(text: str, keep: str = "") -> str:
    """`text` safe for a terminal: a control or format character (ESC sequences, bidi
    overrides) becomes U+FFFD, except those in `keep`. Memory and directive text comes
    from other systems and is shown to an operator, never executed by their terminal."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() or ch in keep else "\ufffd" for ch in text)


def render_search(response: Any, width: int = 60) -> str:
    """One line per memory: id, composite score, confidence, category, start of the text."""
    out = [
        f"{len(response.memories)} memories of {response.total_candidates} candidates "
        f"({response.search_time_ms} ms)"
    ]
    if response.memories:
        out.append(f"  {'id':<38} {'score':>6} {'conf':>5} {'category':<14} content")
    for m in response.memories:
        text = printable(" ".join(m.content.split()))
        if len(text) > width:
            text = text[: width - 1] + "…"
        out.append(
            f"  {printable(m.id):<38} {m.composite_score:>6.3f} {m.confidence:>5.2f} "
            f"{printable(m.category[:14]):<14} {text}"
        )
    return "\n".join(out)


# -- directive ---------------------------------------------------------------------------------


class DirectiveRedis:
    """The directive cache's Redis, reached as the daemon's settings describe it (one
    endpoint, Sentinel or Cluster), with redis-py's asyncio client for one command."""

    def __init__(self, settings: Settings) -> None:
        if not settings.redis_configured:
            raise ConfigError(
                "IBEX_CONTEXT_REDIS_URL (or IBEX_CONTEXT_REDIS_SENTINELS) is not set: "
                "set it as the daemon has it"
            )
        self.settings = settings

    def client(self) -> Any:
        """A redis-py asyncio client for the configured topology (inside a running loop)."""
        import redis.asyncio as aredis
        from redis.asyncio.connection import SSLConnection, parse_url
        from redis.asyncio.sentinel import Sentinel, SentinelManagedSSLConnection

        s = self.settings
        timeouts: dict[str, Any] = {
            "socket_connect_timeout": REDIS_TIMEOUT,
            "socket_timeout": REDIS_TIMEOUT,
        }
        if s.redis_sentinels:
            # As RedisDirectiveSource.sentinel: the URL gives credentials, db and TLS of
            # the data nodes, and TLS (same options) to the sentinels as well.
            options: dict[str, Any] = dict(parse_url(s.redis_url)) if s.redis_url else {}
            for endpoint in ("host", "port", "path"):
                options.pop(endpoint, None)
            sentinel_options: dict[str, Any] = {**timeouts}
            if s.redis_sentinel_password:
                sentinel_options["password"] = s.redis_sentinel_password
            if options.pop("connection_class", None) is SSLConnection:
                options["connection_class"] = SentinelManagedSSLConnection
                sentinel_options["ssl"] = True
                sentinel_options.update({k: v for k, v in options.items() if k.startswith("ssl_")})
            manager = Sentinel(
                [split_host_port(a) for a in s.redis_sentinels],
                sentinel_kwargs=sentinel_options,
            )
            assert s.redis_sentinel_master is not None  # load_settings requires it
            return manager.master_for(s.redis_sentinel_master, **{**timeouts, **options})
        assert s.redis_url is not None
        if s.redis_cluster:
            return aredis.RedisCluster.from_url(s.redis_url, **timeouts)
        return aredis.Redis.from_url(s.redis_url, **timeouts)

    def run(self, command: Callable[[Any], Awaitable[Any]]) -> Any:
        """One command on a fresh loop and client, closed after; Redis errors as
        `DirectiveCliError` with a message that names no URL (it may hold a password)."""
        from redis.exceptions import RedisError

        async def go() -> Any:
            client = self.client()
            try:
                return await command(client)
            finally:
                await client.aclose()

        try:
            return asyncio.run(go())
        except RedisError as exc:
            reason = type(exc).__name__
            if "ConnectionError" in reason or "Timeout" in reason:
                reason = f"{reason}: {exc}"
            raise DirectiveCliError(f"redis ({self.where()}): {reason}") from None
        except (OSError, ValueError) as exc:
            raise DirectiveCliError(f"redis ({self.where()}): {type(exc).__name__}") from None

    def where(self) -> str:
        s = self.settings
        if s.redis_sentinels:
            return f"sentinel master {s.redis_sentinel_master} via IBEX_CONTEXT_REDIS_SENTINELS"
        if s.redis_cluster:
            return "cluster seed IBEX_CONTEXT_REDIS_URL"
        return "IBEX_CONTEXT_REDIS_URL"


class DirectiveCliError(Exception):
    """A directive command failed; the message is the one line to print."""


def _directive_settings(args: argparse.Namespace) -> DirectiveRedis | int:
    try:
        from ibex.config import load_settings  # the whole server's structs: only here

        return DirectiveRedis(load_settings())
    except ConfigError as exc:
        print(f"ibex directive {args.action}: configuration error: {exc}", file=sys.stderr)
        return EXIT_USAGE


def _key(args: argparse.Namespace) -> str | int:
    from ibex.errors import SourceError
    from ibex.sources.directive_envelope import directive_key

    try:
        return directive_key(args.org, args.agent)
    except SourceError:
        return _usage(args, "--org and --agent must be UUIDs")


def cmd_directive_get(args: argparse.Namespace) -> int:
    """Read the key the daemon reads, decode it as the daemon does, and say what it does."""
    from ibex.errors import SourceError
    from ibex.sources.directive_envelope import MAX_VALUE_BYTES, decode_directive

    key = _key(args)
    if isinstance(key, int):
        return key
    redis = _directive_settings(args)
    if isinstance(redis, int):
        return redis
    try:
        raw = redis.run(lambda r: r.get(key))
    except DirectiveCliError as exc:
        print(f"ibex directive get: {exc}", file=sys.stderr)
        return EXIT_ERROR
    if raw is None:
        print(
            f"ibex directive get: no value at {key}: the daemon answers directive=success "
            "with no directive",
            file=sys.stderr,
        )
        return EXIT_NOTHING
    if args.raw:
        sys.stdout.buffer.write(raw)
        sys.stdout.flush()
    try:
        directive = decode_directive(raw, MAX_VALUE_BYTES)
    except SourceError as exc:
        print(
            f"ibex directive get: {key}: the daemon answers directive=error ({exc}); "
            f"expected the JSON envelope {ENVELOPE_SHAPE}: write it with `ibex directive put "
            f"--org {args.org} --agent {args.agent} --content TEXT` (docs/directives.md)",
            file=sys.stderr,
        )
        return EXIT_ERROR
    assert directive is not None
    if args.raw:
        return EXIT_OK
    if args.json:
        print(json.dumps(json.loads(raw), indent=2, ensure_ascii=False))
        return EXIT_OK
    print(f"key: {key}")
    print(f"version_id: {directive.version_id or '(none)'}")
    print(f"injection_mode: {directive.injection_mode}")
    print(f"bytes: {len(raw)}")
    print("content:")
    print(printable(directive.content, keep="\n\t"))
    return EXIT_OK


ENVELOPE_SHAPE = (
    '{"v": 1, "content": "<text>", "injection_mode": "system_first" | "system_append" | '
    '"user_prepend", "version_id": "<uuid>" | null}'
)


def encode_envelope(content: str, injection_mode: str, version_id: str | None) -> bytes:
    """The cached value for a directive, in the daemon's format (contract section 3)."""
    from ibex.sources.directive_envelope import ENVELOPE_VERSION

    return msgspec.json.encode(
        {
            "v": ENVELOPE_VERSION,
            "content": content,
            "injection_mode": injection_mode,
            "version_id": version_id,
        }
    )


def cmd_directive_put(args: argparse.Namespace) -> int:
    """Write a directive as the JSON envelope, after checking the daemon would read it."""
    from ibex.errors import SourceError
    from ibex.sources.directive_envelope import MAX_VALUE_BYTES, decode_directive

    key = _key(args)
    if isinstance(key, int):
        return key
    content = _content(args)
    if isinstance(content, int):
        return content
    try:
        version = str(uuid.UUID(args.version_id)) if args.version_id else str(uuid.uuid4())
    except ValueError:
        return _usage(args, f"--version-id {args.version_id[:64]!r} is not a UUID")
    if args.ttl < 0:
        return _usage(args, "--ttl must be >= 0 seconds (0 keeps the value until replaced)")
    value = encode_envelope(content, args.injection_mode, version)
    try:
        decode_directive(value, MAX_VALUE_BYTES)
    except SourceError as exc:
        return _usage(args, f"{exc} ({MAX_VALUE_BYTES} bytes at most, as JSON)")
    redis = _directive_settings(args)
    if isinstance(redis, int):
        return redis
    try:
        redis.run(lambda r: r.set(key, value, ex=args.ttl or None))
    except DirectiveCliError as exc:
        print(f"ibex directive put: {exc}", file=sys.stderr)
        return EXIT_ERROR
    print(
        f"put {key}: version_id {version}, injection_mode {args.injection_mode}, "
        f"{len(value)} bytes" + (f", expires in {args.ttl}s" if args.ttl else "")
    )
    return EXIT_OK


def _content(args: argparse.Namespace) -> str | int:
    """The directive text from --content or --file (`-` for stdin), strict UTF-8."""
    if args.content is not None:
        return str(args.content)
    try:
        if args.file == "-":
            data = sys.stdin.buffer.read()
        else:
            with open(args.file, "rb") as f:
                data = f.read()
    except OSError as exc:
        return _usage(args, f"--file {args.file}: {exc.strerror}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return _usage(args, f"--file {args.file}: not UTF-8 (the envelope carries UTF-8 text)")


# -- the parsers -------------------------------------------------------------------------------


def register(sub: Any) -> None:
    """Add health, search and directive to the `ibex` subcommands."""
    from ibex.assembly.structs import INJECTION_MODES

    h = sub.add_parser(
        "health",
        help="gRPC health of a running daemon (exit 0 only when SERVING)",
        description="The standard gRPC Health Check. Exit 0 when SERVING; 1 when the "
        "daemon answers anything else (e.g. NOT_SERVING while draining, or an "
        "unknown --service); 3 when it cannot be reached.",
        formatter_class=DefaultsFormatter,
    )
    add_client_flags(h)
    h.add_argument(
        "--service",
        default="",
        help=f"service to check: '' for the whole server, or {SERVICE_NAME} (default: '')",
    )
    h.set_defaults(func=cmd_health)

    s = sub.add_parser(
        "search",
        help="SearchMemories on a running daemon",
        description="SearchMemories: the agent's memories that match a query, best first.",
        formatter_class=DefaultsFormatter,
    )
    add_client_flags(s)
    s.add_argument("--org", default=SAMPLE_ORG, help="org UUID")
    s.add_argument("--agent", default=SAMPLE_AGENT, help="agent UUID")
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
    s.add_argument("--json", action="store_true", help="print the whole response as JSON")
    s.set_defaults(func=cmd_search)

    d = sub.add_parser(
        "directive",
        help="read or write an agent's directive in Redis, in the daemon's format",
        description="The directive cache the daemon reads (IBEX_CONTEXT_REDIS_URL, or "
        "IBEX_CONTEXT_REDIS_SENTINELS and _SENTINEL_MASTER, or IBEX_CONTEXT_REDIS_CLUSTER, "
        "as the daemon has them). The value format: docs/directives.md.",
        formatter_class=DefaultsFormatter,
    )
    actions = d.add_subparsers(dest="action", required=True, metavar="{get,put}")
    g = actions.add_parser(
        "get",
        help="print the directive and check it as the daemon reads it",
        description="Exit 0 when the value is a valid envelope; 1 when the daemon would "
        "answer directive=error for it (the reason is printed) or Redis fails; 3 when "
        "there is no value (the daemon answers success with no directive).",
        formatter_class=DefaultsFormatter,
    )
    p = actions.add_parser(
        "put",
        help="write a directive as the JSON envelope the daemon reads",
        description='Writes {"v": 1, "content", "injection_mode", "version_id"} at '
        "<org>:directive:<agent>. The daemon's directive cache may serve the previous value "
        "for up to IBEX_CONTEXT_DIRECTIVE_CACHE_TTL (or _MAX_AGE for callers naming a "
        "version) after the write.",
        formatter_class=DefaultsFormatter,
    )
    for parser in (g, p):
        parser.add_argument("--org", default=SAMPLE_ORG, help="org UUID")
        parser.add_argument("--agent", default=SAMPLE_AGENT, help="agent UUID")
    g.add_argument("--json", action="store_true", help="print the stored envelope as JSON")
    g.add_argument("--raw", action="store_true", help="print the stored bytes as they are")
    g.set_defaults(func=cmd_directive_get)
    text = p.add_mutually_exclusive_group(required=True)
    text.add_argument("--content", help="the directive text")
    text.add_argument("--file", metavar="PATH", help="read the text from a file ('-': stdin)")
    p.add_argument(
        "--injection-mode",
        choices=INJECTION_MODES,
        default="system_first",
        help="where the proxy puts the directive",
    )
    p.add_argument(
        "--version-id",
        metavar="UUID",
        help="the version callers name in directive_version_id (default: a new random UUID)",
    )
    p.add_argument(
        "--ttl", type=int, default=0, help="seconds until Redis drops the value (0: never)"
    )
    p.set_defaults(func=cmd_directive_put)


class VersionAction(argparse.Action):
    """`--version`: prints `version_text()`, computed only when asked for."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.setdefault("help", "print the version and the interface versions, then exit")
        super().__init__(
            option_strings, argparse.SUPPRESS, nargs=0, default=argparse.SUPPRESS, **kwargs
        )

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        print(version_text())
        parser.exit()
