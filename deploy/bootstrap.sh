#!/bin/sh
# Fresh-machine entry point: makes .venv, installs a locked set of dependencies
# (every file pinned by hash), then the project itself without dependencies.
#
#   sh deploy/bootstrap.sh run [ARGS]   runtime set (requirements-image.lock: the
#                                       dependencies and every extra but dev), then
#                                       `ibex serve ARGS`; no just, no dev tools
#   sh deploy/bootstrap.sh RECIPE ...   full set (requirements.lock: the dev extras
#                                       too, `just` from rust-just), then `just RECIPE ...`
#
# .venv/.ibex-installed names the set installed (`runtime` or `dev`; an empty
# stamp is `dev`). The full set contains the runtime set, so `run` in a venv
# with the full set installs nothing, and a recipe in a venv made by `run`
# installs the dev extras on top. Either set is reinstalled when its lock or
# pyproject.toml is newer than the stamp. Each step prints one `bootstrap:`
# line and pip shows what it fetches.
set -eu
cd "$(dirname "$0")/.."
PY="${PYTHON:-python3}"
stamp=.venv/.ibex-installed

step() {
    printf 'bootstrap: %s\n' "$*" >&2
}

lock_of() {
    if [ "$1" = dev ]; then echo requirements.lock; else echo requirements-image.lock; fi
}

want=dev
if [ "${1:-}" = run ]; then
    want=runtime
fi

if [ ! -x .venv/bin/python ]; then
    step "creating .venv with $PY"
    if ! "$PY" -m venv .venv 2>/dev/null; then
        # Debian's python3 ships without venv/ensurepip until python3-venv is installed.
        rm -rf .venv
        if command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
            step "installing python3-venv (apt-get)"
            DEBIAN_FRONTEND=noninteractive apt-get update -qq
            DEBIAN_FRONTEND=noninteractive apt-get install -y -qq python3-venv >/dev/null
        fi
        "$PY" -m venv .venv
    fi
fi

have=""
if [ -f "$stamp" ]; then
    have=$(cat "$stamp")
    # Stamps written before the runtime set existed are empty: they mark the full set.
    [ -n "$have" ] || have=dev
fi
target=$want
if [ "$have" = dev ]; then
    target=dev
fi
lock=$(lock_of "$target")
if [ "$have" != "$target" ] || [ pyproject.toml -nt "$stamp" ] || [ "$lock" -nt "$stamp" ]; then
    count=$(grep -c '^[A-Za-z0-9]' "$lock")
    step "installing the $target set: $lock ($count pinned requirements, hashes checked)"
    .venv/bin/python -m pip install --require-hashes -r "$lock"
    step "installing the project (pip install --no-deps -e .)"
    .venv/bin/python -m pip install --no-deps -e .
    echo "$target" >"$stamp"
else
    step "the $target set is installed ($lock); nothing to do"
fi

export PATH="$PWD/.venv/bin:$PATH"
if [ "$want" = runtime ]; then
    shift
    step "starting: ibex serve $*"
    exec .venv/bin/python -m ibex serve "$@"
fi
step "running: just $*"
exec just "$@"
