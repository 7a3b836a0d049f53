# Recipes assume the venv made by deploy/bootstrap.sh (it puts .venv/bin first on PATH).
set shell := ["bash", "-euo", "pipefail", "-c"]

py := ".venv/bin/python"

default:
    @just --list

# Create the venv and install the locked dependencies (every extra) and the project.
setup:
    test -x {{py}} || python3 -m venv .venv
    {{py}} -m pip install --quiet --require-hashes -r requirements.lock
    {{py}} -m pip install --quiet --no-deps -e .
    echo dev > .venv/.ibex-installed

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

# Everything CI checks: lint, the lock and generated-code drift, the whole suite.
test: lint lock-check proto-check pytest

# uv.lock holds every extra; requirements.lock (every extra) and requirements-image.lock
# (all but dev) are pip exports of it. Needs the package index. `just lock --upgrade`
# takes the newest releases within the ranges.
# Re-resolve pyproject.toml's ranges into uv.lock and the requirements*.lock exports.
lock *ARGS:
    {{py}} -m ibex.tools.lock {{ARGS}}

# Fail when pyproject.toml, uv.lock and the requirements*.lock exports disagree (offline).
lock-check:
    {{py}} -m ibex.tools.lock --check

# The test suite alone (installs redis-server and promtool when missing; tests start servers).
pytest *ARGS: redis promtool
    {{py}} -m pytest -q {{ARGS}}

# ruff, mypy and the layer contracts (import-linter, see pyproject.toml)
lint:
    {{py}} -m ruff check ibex tests benchmarks
    {{py}} -m ruff format --check ibex tests benchmarks
    {{py}} -m mypy
    .venv/bin/lint-imports

# Regenerate ibex/_proto from protos/ (committed; `proto-check` fails on drift) and the
# grpcio test client (not committed; also made on first import of ibex.testing.grpcio_stubs).
proto:
    {{py}} -m ibex.tools.protogen

# Fail when the committed ibex/_proto differs from what protos/ produce.
proto-check:
    {{py}} -m ibex.tools.protogen --check

# Benchmarks: print tables and write JSON under benchmarks/results/.
bench *ARGS: redis h2load
    {{py}} -m benchmarks {{ARGS}}

# Install h2load (Debian package nghttp2-client) when missing: the capacity benchmarks use it.
h2load:
    #!/usr/bin/env bash
    set -euo pipefail
    if ! command -v h2load >/dev/null 2>&1; then
        if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
        export DEBIAN_FRONTEND=noninteractive
        $SUDO apt-get update -qq
        $SUDO apt-get install -y -qq --no-install-recommends nghttp2-client >/dev/null
    fi
    h2load --version | head -1

# Capacity and the floor at 1 and 2 workers from h2load and grpcio in one run; prints the ratios.
bench-capacity *ARGS: redis h2load
    {{py}} -m benchmarks.load.capacity {{ARGS}}

# Cost curves: CPU per answer and p99 against candidates, history, tools, CJK (PNG with matplotlib).
bench-curves *ARGS: redis h2load
    {{py}} -m benchmarks.load.curves {{ARGS}}

# Config: [tool.mutmut] in pyproject.toml; README "Mutation testing". Not in CI (tens of
# minutes on two cores). Afterwards: `.venv/bin/mutmut results` / `mutmut show NAME`.
# Mutation testing of ibex/assembly and six service modules against tests/unit (mutmut).
mutate *ARGS:
    if [ -z "{{ARGS}}" ]; then rm -rf mutants; fi  # a full run starts clean; named mutants re-run
    .venv/bin/mutmut run --max-children "${IBEX_MUTATE_CHILDREN:-2}" {{ARGS}}
    {{py}} -m tests.mutation.report --equivalent tests/mutation/equivalent.txt --survivors
    {{py}} -m tests.mutation.constants

# --- OCI image (deploy/container/Containerfile); not part of `just test` -----------------
# Host-specific podman flags, all here (override: just PODMAN='podman' BUILD_FLAGS='' ...).
# These suit a root shell without a registry or cgroup delegation: vfs storage, runc
# with cgroupfs, chroot build isolation, the host's CA bundle for pip inside the build,
# host networking and rlimits no higher than the host's.
PODMAN := "podman --storage-driver=vfs --runtime runc --cgroup-manager=cgroupfs"
BUILD_FLAGS := "--isolation=chroot -v /etc/ssl/certs/ca-certificates.crt:/run/host-ca.crt:ro --build-arg CA_BUNDLE=/run/host-ca.crt"
RUN_FLAGS := "--network=host --ulimit nofile=4096:4096 --ulimit nproc=4096:4096"
BASE := "python:3.11-slim-bookworm"
VERSION := `sed -n 's/^version = "\(.*\)"/\1/p' pyproject.toml`
IMAGE := "registry.example.com/ibex/ibex-context:" + VERSION

# Build the image from the locked runtime dependencies (BASE: a python3 image with venv).
image:
    #!/usr/bin/env bash
    set -euo pipefail
    start=$(date +%s)
    {{PODMAN}} build {{BUILD_FLAGS}} -f deploy/container/Containerfile \
        --build-arg BASE={{BASE}} \
        --build-arg VERSION={{VERSION}} \
        --build-arg REVISION="$(git rev-parse HEAD 2>/dev/null || echo unknown)" \
        --build-arg CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
        -t {{IMAGE}} .
    echo "built {{IMAGE}} in $(( $(date +%s) - start )) s"

# Smoke-test the image: read-only root fs, non-root uid, health SERVING, one AssembleContext.
image-test:
    {{py}} -m ibex.tools.image_test --image {{IMAGE}} --podman "{{PODMAN}}" --run-flags "{{RUN_FLAGS}}"

# For hosts without a registry: `just base-image && just BASE=localhost/ibex-base:bookworm image`.
# A local Debian bookworm base image (python3 3.11 with venv), made with debootstrap.
base-image TAG="localhost/ibex-base:bookworm":
    #!/usr/bin/env bash
    set -euo pipefail
    if ! command -v podman >/dev/null || ! command -v debootstrap >/dev/null || ! command -v runc >/dev/null; then
        if [ "$(id -u)" = 0 ]; then SUDO=""; else SUDO="sudo"; fi
        export DEBIAN_FRONTEND=noninteractive
        $SUDO apt-get update -qq
        $SUDO apt-get install -y -qq --no-install-recommends podman runc debootstrap >/dev/null
    fi
    start=$(date +%s)
    sh deploy/container/base-image.sh {{TAG}} {{PODMAN}}
    {{PODMAN}} run --rm {{RUN_FLAGS}} {{TAG}} python3 --version
    echo "base image {{TAG}} made in $(( $(date +%s) - start )) s"
