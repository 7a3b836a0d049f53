"""The `ibex` commands of this host's daemon: serve, config, check.

They read the settings (IBEX_CONTEXT_*, and `serve --env-file`); a start-up
refused by a setting, a file or an address is one line on stderr and the
error's own exit status (docs/operations.md), never a traceback.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ibex.cli.common import EXIT_USAGE, DefaultsFormatter
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
            return EXIT_USAGE
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
            return EXIT_USAGE
    configure_logging(settings.log_level)
    if not args.worker:  # the supervisor already said it for its workers
        _warn_unknown_variables(env)
        _warn_config(settings)
    # /metrics exposition is milliseconds of pure Python per scrape (benchmarks.code_costs):
    # served by a supervisor process (multiprocess mode) whenever it is on, so a scrape
    # never pauses calls.
    # An env file means reloads (SIGHUP), which only the supervisor does.
    supervised = settings.workers > 1 or settings.metrics_addr or args.env_file is not None
    try:
        if supervised and not args.worker:
            from ibex.config import drain_grace
            from ibex.ops.workers import supervise
            from ibex.service.startup_checks import check_bind_policy

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
    from ibex.config import drain_grace, load_settings
    from ibex.service.startup_checks import check_bind_policy

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
    from ibex.service.startup_checks import config_warnings

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
        from ibex.service.startup_checks import listen_variable

        return f"{listen_variable(settings, error.port)} {error}"
    return str(error)


def _replace(settings: Settings, **changes: Any) -> Settings:
    import msgspec

    return msgspec.structs.replace(settings, **changes)


def cmd_config(args: argparse.Namespace) -> int:
    """Print every variable's effective value: set, its default, or computed at start.

    The plain form is `VARIABLE=value` lines (an environment file: durations with a
    unit, lists comma-separated, an off setting empty); `--json` is one object.
    Secrets are redacted in both.
    """
    from ibex.config import effective_settings

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
    from ibex.service.root import server_ssl_context, uses_local_sample
    from ibex.service.startup_checks import check_bind_policy, config_warnings, listen_problems
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


def register(sub: Any) -> None:
    """Add serve, config and check to the `ibex` subcommands."""
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

    c = sub.add_parser("config", help="print effective settings (secrets redacted)")
    c.add_argument("--json", action="store_true", help="print one JSON object")
    c.set_defaults(func=cmd_config)
    k = sub.add_parser("check", help="validate settings, catalog and tokenizer files offline")
    k.set_defaults(func=cmd_check)
