# Recipes assume the venv made by deploy/bootstrap.sh (it puts .venv/bin first on PATH).
set shell := ["bash", "-euo", "pipefail", "-c"]

py := ".venv/bin/python"

default:
    @just --list

# Create the venv and install the project with its dev extras.
setup:
    test -x {{py}} || python3 -m venv .venv
    {{py}} -m pip install --quiet --upgrade pip
    {{py}} -m pip install --quiet -e '.[dev]'
    touch .venv/.ibex-installed

# Install redis-server from Debian packages when it is missing (tests start their own).
redis:
    #!/usr/bin/env bash
    set -euo pipefail
    if ! command -v redis-server >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
        export DEBIAN_FRONTEND=noninteractive
        $SUDO apt-get update -qq
        $SUDO apt-get install -y -qq redis-server >/dev/null
    fi
    redis-server --version

# Install promtool (Debian package prometheus) when missing: the alert-rule tests use it.
promtool:
    #!/usr/bin/env bash
    set -euo pipefail
    if ! command -v promtool >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
        export DEBIAN_FRONTEND=noninteractive
        $SUDO apt-get update -qq
        # About 30 s; the package's own service is not started (nor needed).
        $SUDO apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    fi
    promtool --version | head -1

# Run the daemon (embedded sample data unless Redis / memory service are configured).
run *ARGS:
    {{py}} -m ibex serve {{ARGS}}

# Everything CI checks: lint, generated-code drift, the whole suite.
test: lint proto-check pytest

# The test suite alone (installs redis-server and promtool when missing; tests start servers).
pytest *ARGS: redis promtool
    {{py}} -m pytest -q {{ARGS}}

# ruff, mypy and the layer contracts (import-linter, see pyproject.toml)
lint:
    {{py}} -m ruff check ibex tests benchmarks
    {{py}} -m ruff format --check ibex tests benchmarks
    {{py}} -m mypy
    .venv/bin/lint-imports

# Regenerate protobuf code from protos/ (committed; `proto-check` fails on drift).
proto:
    {{py}} -m ibex.tools.protogen

# Fail when the committed generated code differs from what protos/ produce.
proto-check:
    {{py}} -m ibex.tools.protogen --check

# Benchmarks: print tables and write JSON under benchmarks/results/.
bench *ARGS: redis
    {{py}} -m benchmarks {{ARGS}}

# Config: [tool.mutmut] in pyproject.toml; README "Mutation testing". Not in CI (tens of
# minutes on two cores). Afterwards: `.venv/bin/mutmut results` / `mutmut show NAME`.
# Mutation testing of ibex/assembly and six service modules against tests/unit (mutmut).
mutate *ARGS:
    if [ -z "{{ARGS}}" ]; then rm -rf mutants; fi  # a full run starts clean; named mutants re-run
    .venv/bin/mutmut run --max-children "${IBEX_MUTATE_CHILDREN:-2}" {{ARGS}}
    {{py}} -m tests.mutation_report --equivalent tests/mutation_equivalent.txt --survivors
    {{py}} -m tests.mutation_constants
