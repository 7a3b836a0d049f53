"""What start-up and `ibex check` say about `Settings` before anything serves.

`config_warnings` names the settings that make the daemon serve less than it
could (said at start and by `ibex check`); `listen_problems` tries the addresses
it will listen on (for `ibex check`); `check_bind_policy` refuses a listener off
loopback without caller authentication; `listen_variable` names the variable
behind a port that could not be bound. Nothing here builds a part of the daemon:
that is the composition root's job (`ibex.service.root`).
"""

from __future__ import annotations

import socket

from ibex.config import PREFIX, TABLE, Settings, format_duration
from ibex.errors import ConfigError
from ibex.netaddr import bind_problem, join_host_port, split_host_port
from ibex.service.auth import is_loopback
from ibex.sources.retrieval import RetrievalConfig

__all__ = [
    "check_bind_policy",
    "check_metrics_bind_policy",
    "config_warnings",
    "listen_problems",
    "listen_variable",
    "try_bind",
]


def config_warnings(settings: Settings) -> list[str]:
    """Settings that make the daemon serve less than it could, each naming its variable.

    Said once at start (`config_warning` log lines) and by `ibex check`; none
    stops start-up, since each can be meant (a directive-only deployment), but
    none should pass unseen: a branch timeout set above the retrieval wall (the
    wall cuts the branch first), Redis without the memory service (every answer
    has no memories) or the other way round (no directive), a password sent
    to Redis or a sentinel off loopback without TLS.
    """
    out: list[str] = []
    retrieval = settings.retrieval
    wall = format_duration(retrieval.time_limit)
    # A branch timeout at its default is bounded by the wall by design (cold's 45 ms).
    branches = ("directive_timeout", "hot_timeout", "cold_timeout")
    for row in TABLE.values():
        if row.owner is not RetrievalConfig or row.field not in branches:
            continue
        value = row.value(settings)
        if value != row.default and value > retrieval.time_limit:
            out.append(
                f"{row.variable}: {format_duration(value)} is above the retrieval "
                f"wall of {wall} (min({PREFIX}TIMEOUT, {PREFIX}DEADLINE_MS)), which cuts "
                "the branch first"
            )
    redis = f"{PREFIX}REDIS_SENTINELS" if settings.redis_sentinels else f"{PREFIX}REDIS_URL"
    if settings.redis_configured and settings.memory_base_url is None:
        out.append(
            f"{PREFIX}MEMORY_BASE_URL: not set while {redis} is: every answer has no "
            "memories (the hot and cold branches are skipped)"
        )
    if settings.memory_base_url is not None and not settings.redis_configured:
        out.append(
            f"{PREFIX}REDIS_URL: not set while {PREFIX}MEMORY_BASE_URL is: every answer "
            "has no directive (the directive branch is skipped)"
        )
    out += _insecure_redis(settings)
    return out


def _insecure_redis(settings: Settings) -> list[str]:
    """A Redis or Sentinel password that would cross the network in clear."""
    url = settings.redis_url
    scheme = url.partition("://")[0].lower() if url else ""
    if scheme in ("rediss", "unix"):  # TLS (to the sentinels too), or no network at all
        return []
    out: list[str] = []
    sentinels = [split_host_port(a)[0] for a in settings.redis_sentinels]
    remote_sentinels = [h for h in sentinels if not is_loopback(h)]
    if settings.redis_sentinel_password and remote_sentinels:
        out.append(
            f"{PREFIX}REDIS_SENTINEL_PASSWORD: sent in clear to {remote_sentinels[0]} (not "
            f"loopback); a rediss:// {PREFIX}REDIS_URL puts the sentinel connections on TLS"
        )
    if url and _url_has_password(url):
        # With Sentinel the data nodes are whatever the sentinels name: off loopback
        # unless every sentinel is local.
        host = _url_host(url)
        remote = bool(remote_sentinels) if sentinels else not is_loopback(host)
        if remote:
            where = "the nodes the sentinels name" if sentinels else host
            out.append(
                f"{PREFIX}REDIS_URL: its password is sent in clear to {where} (not "
                "loopback); use rediss://"
            )
    return out


def _url_has_password(url: str) -> bool:
    """Userinfo, or a password-like query parameter (redis-py reads `password`)."""
    rest = url.partition("://")[2]
    if "@" in rest:
        return True
    query = rest.partition("#")[0].partition("?")[2]
    return any(
        k.strip().lower() == "password" for k, _, _ in (p.partition("=") for p in query.split("&"))
    )


def _url_host(url: str) -> str:
    """The host of `scheme://[userinfo@]host[:port][/path]` (brackets dropped)."""
    authority = url.partition("://")[2].rpartition("@")[2]
    for stop in "/?#":
        authority = authority.partition(stop)[0]
    if authority.startswith("["):
        return authority[1:].partition("]")[0]
    return authority.partition(":")[0]


def listen_problems(settings: Settings) -> list[tuple[str, str]]:
    """(address, problem) for each address `ibex serve` would listen on and cannot bind now.

    Each address is bound and closed at once, as the daemon binds it (every
    address the host resolves to, SO_REUSEADDR): the gRPC address, each
    worker's own port, the metrics address. A daemon already serving there
    makes its address show as in use, which is what a check before a start
    should say.
    """
    host, port = split_host_port(settings.grpc_addr)
    addrs = [(f"{PREFIX}GRPC_ADDR", host, port)]
    addrs += [(f"{PREFIX}WORKER_PORT_BASE", host, p) for p in settings.worker_ports()]
    if settings.metrics_addr:
        addrs.append((f"{PREFIX}METRICS_ADDR", *split_host_port(settings.metrics_addr)))
    out: list[tuple[str, str]] = []
    for variable, h, p in addrs:
        problem = try_bind(h, p)
        if problem is not None:
            out.append((f"{join_host_port(h, p)} ({variable})", problem))
    return out


def listen_variable(settings: Settings, port: int) -> str:
    """The variable that names listening port `port` (for a ListenError's one line).

    A worker's own port is WORKER_PORT_BASE + its slot; a worker process's
    settings say one worker, so its port is not among `worker_ports()`.
    """
    if port == split_host_port(settings.grpc_addr)[1]:
        return f"{PREFIX}GRPC_ADDR"
    if settings.metrics_addr and split_host_port(settings.metrics_addr)[1] == port:
        return f"{PREFIX}METRICS_ADDR"
    if settings.worker_port_base is not None:
        return f"{PREFIX}WORKER_PORT_BASE"
    return f"{PREFIX}GRPC_ADDR"


def try_bind(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on now (None when it can); nothing stays bound."""
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except OSError as exc:
        return f"cannot resolve: {exc.strerror or exc}"
    for family, kind, proto, _, sockaddr in infos:
        try:
            with socket.socket(family, kind, proto) as sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                if family == socket.AF_INET6:
                    sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                sock.bind(sockaddr)
                sock.listen(1)
        except OSError as exc:
            return bind_problem(exc)
    return None


def check_bind_policy(settings: Settings) -> str | None:
    """Refuse a non-loopback bind without authentication unless explicitly allowed.

    Returns a warning to log at every start when the insecure override is in use.
    """
    metrics_warning = check_metrics_bind_policy(settings)
    host, _ = split_host_port(settings.grpc_addr)
    has_auth = bool(settings.auth_tokens_sha256) or settings.tls_client_ca is not None
    if is_loopback(host) or has_auth:
        return metrics_warning
    if not settings.allow_insecure:
        raise ConfigError(
            f"IBEX_CONTEXT_GRPC_ADDR: binding {host} (not loopback) requires caller "
            "authentication (IBEX_CONTEXT_AUTH_TOKENS_SHA256 or IBEX_CONTEXT_TLS_CLIENT_CA); "
            "set IBEX_CONTEXT_ALLOW_INSECURE=1 to accept unauthenticated callers"
        )
    warning = (
        f"insecure: listening on {host} without caller authentication "
        "(IBEX_CONTEXT_ALLOW_INSECURE=1); any caller can read any tenant's memories"
    )
    return f"{warning}; {metrics_warning}" if metrics_warning else warning


def check_metrics_bind_policy(settings: Settings) -> str | None:
    """The same rule for /metrics: off loopback it needs a scrape token
    (IBEX_CONTEXT_METRICS_TOKEN_SHA256) unless the insecure override is given."""
    if not settings.metrics_addr or settings.metrics_token_sha256:
        return None
    host, _ = split_host_port(settings.metrics_addr)
    if is_loopback(host):
        return None
    if not settings.allow_insecure:
        raise ConfigError(
            f"IBEX_CONTEXT_METRICS_ADDR: binding {host} (not loopback) requires a scrape "
            "token (IBEX_CONTEXT_METRICS_TOKEN_SHA256); "
            "set IBEX_CONTEXT_ALLOW_INSECURE=1 to serve metrics to anyone"
        )
    return (
        f"insecure: serving /metrics on {host} without a scrape token "
        "(IBEX_CONTEXT_ALLOW_INSECURE=1)"
    )
