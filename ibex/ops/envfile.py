"""`ibex serve --env-file PATH`: settings the supervisor reads at start and at every SIGHUP.

A running process cannot see a changed environment, so a reload needs the new
settings from a file. The format is the subset of systemd's `EnvironmentFile=`
the example file (deploy/ibex-context.env.example) uses: one `NAME=value` per
line, blank lines and lines starting with `#` or `;` ignored, an optional
`export ` prefix, and one pair of matching quotes around a value removed. No
variable expansion, no line continuation.

The file is hostile until bounded: at most `MAX_BYTES`, UTF-8, names of the
portable form. An error names the file and line, never the value (the file
holds tokens).
"""

from __future__ import annotations

import re
from pathlib import Path

from ibex.errors import ConfigError

MAX_BYTES = 1 << 20  # the example file with every setting is ~20 KiB
_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")


def read_env_file(path: Path) -> dict[str, str]:
    """The file's variables in order (a repeated name: the last wins); ConfigError if unusable."""
    try:
        with path.open("rb") as f:
            raw = f.read(MAX_BYTES + 1)
    except OSError as exc:
        raise ConfigError(f"--env-file {path}: cannot read ({exc.strerror or exc})") from None
    if len(raw) > MAX_BYTES:
        raise ConfigError(f"--env-file {path}: larger than {MAX_BYTES} bytes")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"--env-file {path}: not UTF-8 (byte {exc.start})") from None
    return parse_env(text, str(path))


def parse_env(text: str, origin: str = "<env>") -> dict[str, str]:
    out: dict[str, str] = {}
    for number, line in enumerate(text.splitlines(), 1):
        stripped = line.strip()
        if not stripped or stripped[0] in "#;":
            continue
        if stripped.startswith("export "):
            stripped = stripped[len("export ") :].lstrip()
        name, sep, value = stripped.partition("=")
        name = name.strip()
        if not sep or not _NAME.fullmatch(name):
            raise ConfigError(f"--env-file {origin} line {number}: expected NAME=value")
        if "\0" in value:
            raise ConfigError(f"--env-file {origin} line {number}: {name} holds a NUL byte")
        value = value.strip()
        if len(value) >= 2 and value[0] == value[-1] and value[0] in "\"'":
            value = value[1:-1]
        out[name] = value
    return out
