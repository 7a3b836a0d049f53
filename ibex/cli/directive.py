"""`ibex directive get|put`: an agent's directive in Redis, in the daemon's format.

The commands reach the directive cache the way the daemon does (one endpoint,
Sentinel or Cluster, from the same settings) and check a value with the
daemon's own decoder (`ibex.sources.directive_envelope`), so what `get` says
about a value is what the daemon will answer for it. Exit statuses: 0 success;
1 Redis failed or the daemon would refuse the value; 2 a usage or
configuration error; 3 no directive for `get`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import uuid
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any

import msgspec

from ibex.cli.common import (
    EXIT_ERROR,
    EXIT_NOTHING,
    EXIT_OK,
    EXIT_USAGE,
    DefaultsFormatter,
    add_json_flag,
    add_tenant_flags,
    printable,
    usage,
)
from ibex.errors import ConfigError
from ibex.netaddr import split_host_port

if TYPE_CHECKING:
    from ibex.config import Settings

#: Seconds a Redis connect or command may take before `ibex directive` gives up.
REDIS_TIMEOUT = 2.0


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


def _redis_call(
    args: argparse.Namespace, command: Callable[[Any], Awaitable[Any]]
) -> tuple[Any, int | None]:
    """One Redis command on the directive cache: (its result, None), or (None, the exit
    status) after one line on stderr naming what failed."""
    try:
        from ibex.config import load_settings  # the whole server's structs: only here

        redis = DirectiveRedis(load_settings())
    except ConfigError as exc:
        print(f"ibex directive {args.action}: configuration error: {exc}", file=sys.stderr)
        return None, EXIT_USAGE
    try:
        return redis.run(command), None
    except DirectiveCliError as exc:
        print(f"ibex directive {args.action}: {exc}", file=sys.stderr)
        return None, EXIT_ERROR


def _key(args: argparse.Namespace) -> str | int:
    from ibex.errors import SourceError
    from ibex.sources.directive_envelope import directive_key

    try:
        return directive_key(args.org, args.agent)
    except SourceError:
        return usage(args, "--org and --agent must be UUIDs")


def cmd_directive_get(args: argparse.Namespace) -> int:
    """Read the key the daemon reads, decode it as the daemon does, and say what it does."""
    from ibex.errors import SourceError
    from ibex.sources.directive_envelope import MAX_VALUE_BYTES, decode_directive

    key = _key(args)
    if isinstance(key, int):
        return key
    raw, failed = _redis_call(args, lambda r: r.get(key))
    if failed is not None:
        return failed
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
        return usage(args, f"--version-id {args.version_id[:64]!r} is not a UUID")
    if args.ttl < 0:
        return usage(args, "--ttl must be >= 0 seconds (0 keeps the value until replaced)")
    value = encode_envelope(content, args.injection_mode, version)
    try:
        decode_directive(value, MAX_VALUE_BYTES)
    except SourceError as exc:
        return usage(args, f"{exc} ({MAX_VALUE_BYTES} bytes at most, as JSON)")
    _, failed = _redis_call(args, lambda r: r.set(key, value, ex=args.ttl or None))
    if failed is not None:
        return failed
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
        return usage(args, f"--file {args.file}: {exc.strerror}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        return usage(args, f"--file {args.file}: not UTF-8 (the envelope carries UTF-8 text)")


# -- the parsers -------------------------------------------------------------------------------


def register(sub: Any) -> None:
    """Add `directive get` and `directive put` to the `ibex` subcommands."""
    from ibex.assembly.structs import INJECTION_MODES

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
        add_tenant_flags(parser)
    add_json_flag(g, "the stored envelope")
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
