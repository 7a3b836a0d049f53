#!/bin/sh
# Fresh-machine entry point: makes .venv, installs the project with its dev
# extras and `just` (rust-just from PyPI) into it, then runs `just <recipe>`.
set -eu
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
if [ ! -x .venv/bin/python ]; then
    "$PY" -m venv .venv
fi
stamp=.venv/.ibex-installed
if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    .venv/bin/python -m pip install --quiet --upgrade pip
    .venv/bin/python -m pip install --quiet -e '.[dev]'
    touch "$stamp"
fi
export PATH="$PWD/.venv/bin:$PATH"
exec just "$@"
