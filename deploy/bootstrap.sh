#!/bin/sh
# Fresh-machine entry point: makes .venv, installs the locked dependencies
# (requirements.lock: runtime and every extra, dev included, with `just` from
# rust-just, all pinned by hash), then the project itself without
# dependencies, and runs `just <recipe>`.
set -eu
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    if ! "$PY" -m venv .venv 2>/dev/null; then
        # Debian's python3 ships without venv/ensurepip until python3-venv is installed.
        rm -rf .venv
        if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
            DEBIAN_FRONTEND=noninteractive apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
        fi
        "$PY" -m venv .venv
    fi
fi
stamp=.venv/.ibex-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements.lock -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --require-hashes -r requirements.lock
    .venv/bin/python -m pip install --quiet --no-deps -e .
    touch "$stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"
exec just "$@"
