"""Generate (or drift-check) the code built from `protos/`.

Two trees are generated:

- `ibex/_proto/` (committed): betterproto2 messages, the grpclib server base and client
  stub, a google.protobuf descriptor pool (betterproto2 registers no descriptors on its
  own) and `descriptors.binpb`, a FileDescriptorSet with imports for gRPC reflection.
  The daemon imports it and its image installs no generator, so it is committed and
  `--check` fails when it differs from a fresh run.
- `ibex/testing/_grpcio_client/` (not committed, git ignores it): classic
  `*_pb2.py`/`*_pb2_grpc.py` from grpcio-tools, the stock stack the Go proxy also uses,
  so interop tests talk to the server through an independent implementation of the
  same contract. Only tests and benchmarks use it; `ensure_grpcio_client` makes it on
  first import (`ibex.testing.grpcio_stubs`) and again whenever `protos/`, grpcio-tools
  or this module change, so it is always made from the protos being tested.

grpcio-tools writes absolute imports (`from ibex.auth.v1 import ...`) that would
collide with the real `ibex` package; they are rewritten to relative imports so the
client tree imports as `ibex.testing._grpcio_client.ibex...` without touching sys.path.

Generation runs protoc in an empty scratch directory holding a pinned `ruff.toml`:
the betterproto2 plugin formats its output with whatever ruff config it finds from
its working directory and decides which `__init__.py` files to emit from it, so
running elsewhere would make the output depend on where it was run.

Usage (from the repo root):
    python -m ibex.tools.protogen               # regenerate ibex/_proto and the client
    python -m ibex.tools.protogen --check       # exit 1 if ibex/_proto differs from a fresh run
    python -m ibex.tools.protogen --grpcio-out DIR   # only the grpcio client, into DIR
"""

from __future__ import annotations

import argparse
import difflib
import fcntl
import hashlib
import importlib.metadata
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[2]
PROTO_ROOT = REPO_ROOT / "protos"
BETTERPROTO_DIR = REPO_ROOT / "ibex" / "_proto"
GRPCIO_DIR = REPO_ROOT / "ibex" / "testing" / "_grpcio_client"
DESCRIPTOR_SET = "descriptors.binpb"
# In the client tree: the digest of what it was made from (`grpcio_source_digest`).
GRPCIO_STAMP = ".made-from"

# Plugin options: async grpclib client + server, and a descriptor pool for reflection.
BETTERPROTO_OPTIONS = "client_generation=async,server_generation=async,google_protobuf_descriptors"

# The betterproto2 plugin pipes its output through `ruff format -`; pin what it sees.
_RUFF_TOML = 'line-length = 100\ntarget-version = "py311"\n'

_IGNORED_NAMES = frozenset({"__pycache__", ".ruff_cache", ".mypy_cache", ".pytest_cache"})

_BETTERPROTO_ROOT_INIT = '''"""Made from protos/ by `python -m ibex.tools.protogen`; do not edit.

Messages, the grpclib server base and client stub live in `ibex._proto.ibex.context.v1`;
`descriptors.binpb` is the FileDescriptorSet (with imports) served by gRPC reflection.
"""
'''

_GRPCIO_ROOT_INIT = '''"""grpcio-tools client made by `ibex.tools.protogen` (not committed).

An independent implementation of the contract (the stock stack the Go proxy uses) for
interop tests. Cross-module imports are rewritten to relative ones so this tree imports
as `ibex.testing._grpcio_client.ibex.context.v1.context_pb2` with no sys.path changes and
no clash with the real `ibex` package; `ibex.testing.grpcio_stubs` wraps the imports.
"""
'''

_ABSOLUTE_PB2_IMPORT = re.compile(
    r"^from (ibex(?:\.\w+)*) import (\w+_pb2)( as \w+)?$", flags=re.MULTILINE
)


class ProtogenError(RuntimeError):
    """protoc or a plugin failed; the message carries their stderr."""


def proto_files(proto_root: Path = PROTO_ROOT) -> list[str]:
    """All .proto files under proto_root, as sorted include-relative paths."""
    files = sorted(p.relative_to(proto_root).as_posix() for p in proto_root.rglob("*.proto"))
    if not files:
        raise ProtogenError(f"no .proto files under {proto_root}")
    return files


def _well_known_include() -> Path:
    """grpcio-tools bundles the google/protobuf/*.proto includes next to protoc."""
    import grpc_tools

    return Path(grpc_tools.__file__).resolve().parent / "_proto"


def _bin_dir() -> Path:
    """The venv's bin dir: the plugin executable and the ruff it calls live there."""
    return Path(sys.executable).parent


def _run_protoc(args: Sequence[str], proto_root: Path, scratch: Path) -> None:
    env = dict(os.environ)
    env["PATH"] = f"{_bin_dir()}{os.pathsep}{env.get('PATH', '')}"
    env.pop("BETTERPROTO_DUMP", None)
    cmd = [
        sys.executable,
        "-m",
        "grpc_tools.protoc",
        f"-I{proto_root.resolve()}",
        f"-I{_well_known_include()}",
        *args,
        *proto_files(proto_root),
    ]
    result = subprocess.run(cmd, cwd=scratch, env=env, capture_output=True, text=True)
    if result.returncode != 0:
        raise ProtogenError(f"protoc failed ({result.returncode}):\n{result.stderr.strip()}")


def generate_betterproto(out_dir: Path, proto_root: Path = PROTO_ROOT) -> None:
    """Write the betterproto2 package and descriptors.binpb into an empty out_dir."""
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    plugin = _bin_dir() / "protoc-gen-python_betterproto2"
    if not plugin.exists():
        raise ProtogenError(f"{plugin} missing: install betterproto2-compiler (dev extras)")
    with tempfile.TemporaryDirectory(prefix="protogen-") as scratch:
        (Path(scratch) / "ruff.toml").write_text(_RUFF_TOML)
        _run_protoc(
            [
                f"--plugin=protoc-gen-python_betterproto2={plugin}",
                f"--python_betterproto2_out={out_dir}",
                f"--python_betterproto2_opt={BETTERPROTO_OPTIONS}",
                f"--descriptor_set_out={out_dir / DESCRIPTOR_SET}",
                "--include_imports",
            ],
            proto_root,
            Path(scratch),
        )
    (out_dir / "__init__.py").write_text(_BETTERPROTO_ROOT_INIT)


def _relativize_imports(module: Path, root: Path) -> None:
    """Turn `from ibex.x.y import z_pb2` into an import relative to the tree root."""
    package_depth = len(module.relative_to(root).parts) - 1
    dots = "." * (package_depth + 1)
    text = module.read_text()
    module.write_text(_ABSOLUTE_PB2_IMPORT.sub(rf"from {dots}\1 import \2\3", text))


def generate_grpcio(out_dir: Path, proto_root: Path = PROTO_ROOT) -> None:
    """Write the grpcio-tools client (pb2, pb2_grpc, pyi) into an empty out_dir."""
    out_dir = out_dir.resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="protogen-") as scratch:
        _run_protoc(
            [f"--python_out={out_dir}", f"--pyi_out={out_dir}", f"--grpc_python_out={out_dir}"],
            proto_root,
            Path(scratch),
        )
    for module in sorted([*out_dir.rglob("*_pb2*.py"), *out_dir.rglob("*_pb2.pyi")]):
        _relativize_imports(module, out_dir)
    packages = {d for p in out_dir.rglob("*.py") for d in p.parents if d.is_relative_to(out_dir)}
    for directory in sorted(packages):
        init = directory / "__init__.py"
        if not init.exists():
            init.write_text("")
    (out_dir / "__init__.py").write_text(_GRPCIO_ROOT_INIT)


def _tree(root: Path) -> dict[str, Path]:
    if not root.is_dir():
        return {}
    return {
        p.relative_to(root).as_posix(): p
        for p in root.rglob("*")
        if p.is_file() and not _IGNORED_NAMES.intersection(p.relative_to(root).parts)
    }


def diff_trees(expected: Path, actual: Path, label: str) -> list[str]:
    """Human-readable differences between a fresh tree and a committed one."""
    want, have = _tree(expected), _tree(actual)
    problems: list[str] = []
    for name in sorted(want.keys() - have.keys()):
        problems.append(f"{label}/{name}: missing")
    for name in sorted(have.keys() - want.keys()):
        problems.append(f"{label}/{name}: not produced by the generator (stale?)")
    for name in sorted(want.keys() & have.keys()):
        fresh, committed = want[name].read_bytes(), have[name].read_bytes()
        if fresh == committed:
            continue
        try:
            lines = difflib.unified_diff(
                committed.decode().splitlines(),
                fresh.decode().splitlines(),
                f"committed/{label}/{name}",
                f"fresh/{label}/{name}",
                lineterm="",
                n=1,
            )
            excerpt = "\n".join(list(lines)[:20])
        except UnicodeDecodeError:
            excerpt = f"(binary, {len(committed)} vs {len(fresh)} bytes)"
        problems.append(f"{label}/{name}: differs\n{excerpt}")
    return problems


def check(betterproto_dir: Path = BETTERPROTO_DIR, proto_root: Path = PROTO_ROOT) -> list[str]:
    """Regenerate the committed tree into a temp dir and list every difference; empty
    means no drift."""
    with tempfile.TemporaryDirectory(prefix="protogen-check-") as tmp:
        fresh = Path(tmp) / "betterproto"
        generate_betterproto(fresh, proto_root)
        return diff_trees(fresh, betterproto_dir, _label(betterproto_dir))


def _label(path: Path) -> str:
    try:
        return path.resolve().relative_to(REPO_ROOT).as_posix()
    except ValueError:
        return str(path)


def regenerate(betterproto_dir: Path = BETTERPROTO_DIR, proto_root: Path = PROTO_ROOT) -> None:
    """Rebuild the committed tree from scratch so files for removed protos disappear too."""
    with tempfile.TemporaryDirectory(prefix="protogen-") as tmp:
        fresh = Path(tmp) / "betterproto"
        generate_betterproto(fresh, proto_root)
        shutil.rmtree(betterproto_dir, ignore_errors=True)
        shutil.copytree(fresh, betterproto_dir)


def grpcio_source_digest(proto_root: Path = PROTO_ROOT) -> str:
    """What the client tree is made from: every .proto (path and bytes), the
    grpcio-tools release and this module (its import rewriting)."""
    digest = hashlib.sha256()
    try:
        tools = importlib.metadata.version("grpcio-tools")
    except importlib.metadata.PackageNotFoundError:
        raise ProtogenError("grpcio-tools is not installed: install the dev extras") from None
    digest.update(f"grpcio-tools {tools}\0".encode())
    digest.update(Path(__file__).read_bytes())
    for name in proto_files(proto_root):
        digest.update(f"\0{name}\0".encode())
        digest.update((proto_root / name).read_bytes())
    return digest.hexdigest()


def _made_from(tree: Path) -> str | None:
    try:
        return (tree / GRPCIO_STAMP).read_text().strip()
    except OSError:
        return None


def ensure_grpcio_client(target: Path = GRPCIO_DIR, proto_root: Path = PROTO_ROOT) -> bool:
    """Make the grpcio client tree at `target` unless it was made from these protos;
    True when it was (re)made.

    Processes that start together (a benchmark's clients, test workers) take turns
    under an exclusive lock beside the tree and re-check the stamp once they hold
    it, so one of them generates. The fresh tree is built next to the target and
    renamed into place, so no importer ever sees half a tree.
    """
    digest = grpcio_source_digest(proto_root)
    if _made_from(target) == digest:
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if _made_from(target) == digest:
            return False
        with tempfile.TemporaryDirectory(prefix=f".{target.name}-", dir=target.parent) as tmp:
            fresh = Path(tmp) / "fresh"
            generate_grpcio(fresh, proto_root)
            (fresh / GRPCIO_STAMP).write_text(digest + "\n")
            if target.exists():
                target.rename(Path(tmp) / "old")
            fresh.rename(target)
    importlib.invalidate_caches()
    return True


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ibex.tools.protogen", description=__doc__)
    mode = parser.add_mutually_exclusive_group()
    mode.add_argument("--check", action="store_true", help="fail if committed code drifted")
    mode.add_argument("--grpcio-out", type=Path, help="only write the grpcio client into DIR")
    args = parser.parse_args(argv)
    try:
        if args.check:
            problems = check()
            if problems:
                print("\n".join(problems), file=sys.stderr)
                print(
                    f"\nprotogen: {_label(BETTERPROTO_DIR)} is out of date "
                    f"({len(problems)} file(s)); "
                    "run `python -m ibex.tools.protogen` (or `just proto`) and commit. "
                    "A version change of betterproto2-compiler, grpcio-tools or ruff "
                    "also shows up here.",
                    file=sys.stderr,
                )
                return 1
            print(f"protogen: {_label(BETTERPROTO_DIR)} is up to date")
        elif args.grpcio_out is not None:
            generate_grpcio(args.grpcio_out)
            print(f"protogen: wrote grpcio client to {args.grpcio_out}")
        else:
            regenerate()
            ensure_grpcio_client()
            print(f"protogen: wrote {_label(BETTERPROTO_DIR)}; {_label(GRPCIO_DIR)} is current")
    except ProtogenError as exc:
        print(f"protogen: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
