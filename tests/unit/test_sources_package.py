"""`ibex.sources` names what the package offers, each the object its defining module holds."""

from __future__ import annotations

import importlib
import subprocess
import sys

import pytest

import ibex.sources

# What the package offers (its docstring): protocols, sources, retrieval, feedback, errors.
OFFERED = {
    "Answer": "base",
    "BatchRead": "base",
    "DirectiveSource": "base",
    "MemorySource": "base",
    "SourceError": "base",
    "RedisDirectiveSource": "redis_directive",
    "RedisOptions": "redis_directive",
    "DirectiveCache": "directive_cache",
    "DirectiveCacheConfig": "directive_cache",
    "MemoryHttpSource": "memory_http",
    "LocalFileSource": "local_file",
    "LocalFileError": "local_file",
    "retrieve": "retrieval",
    "cold_search": "retrieval",
    "RetrievalConfig": "retrieval",
    "Retrieved": "retrieval",
    "BranchListener": "retrieval",
    "WallListener": "retrieval_wall",
    "send_feedback": "feedback_sender",
    "FeedbackRejected": "feedback_sender",
    "FeedbackRetryable": "feedback_sender",
    "TransportError": "http_framing",
    "TransportTimeout": "http_framing",
    "ResponseTooLarge": "http_framing",
}


def test_all_names_exactly_what_the_package_offers() -> None:
    assert sorted(ibex.sources.__all__) == sorted(OFFERED)


@pytest.mark.parametrize("name", sorted(OFFERED))
def test_each_public_name_is_its_defining_modules_object(name: str) -> None:
    module = importlib.import_module(f"ibex.sources.{OFFERED[name]}")
    assert getattr(ibex.sources, name) is getattr(module, name)


def test_an_unknown_name_is_an_attribute_error() -> None:
    with pytest.raises(AttributeError, match="no_such_name"):
        _ = ibex.sources.no_such_name  # type: ignore[attr-defined]


def test_importing_the_package_loads_no_io_library() -> None:
    """The ops CLI imports the directive envelope codec alone: the package's names
    load on first use, so neither Redis nor the HTTP client nor Trio comes with it."""
    probe = (
        "import sys, ibex.sources, ibex.sources.directive_envelope; "
        "print(sorted({'redis', 'httptools', 'trio', 'trio_asyncio'} & set(sys.modules)))"
    )
    out = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.strip() == "[]"
