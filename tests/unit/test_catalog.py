"""Operator catalog overrides are validated at start-up."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ibex.assembly.catalog import CatalogError, load_catalog


def write(tmp_path: Path, data: object) -> str:
    p = tmp_path / "catalog.json"
    p.write_text(json.dumps(data) if not isinstance(data, str) else data)
    return str(p)


def test_operator_file_adds_and_overrides(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        {
            "models": {
                "gpt-4o": {
                    "provider": "azure",
                    "context_window": 64000,
                    "max_output_tokens": 4096,
                    "tokenizer_family": "o200k_base",
                },
                "local-llama": {
                    "provider": "self",
                    "context_window": 8192,
                    "max_output_tokens": 2048,
                    "tokenizer_family": "unknown",
                },
            }
        },
    )
    c = load_catalog(path)
    assert c.resolve("gpt-4o").context_window == 64000  # type: ignore[union-attr]
    assert c.resolve("local-llama-3-8b").provider == "self"  # type: ignore[union-attr]
    assert c.resolve("gpt-5").context_window == 400000  # type: ignore[union-attr]


@pytest.mark.parametrize(
    "data,needle",
    [
        ("{not json", "not valid JSON"),
        (
            {
                "models": {
                    "m": {
                        "provider": "x",
                        "context_window": 0,
                        "max_output_tokens": 1,
                        "tokenizer_family": "unknown",
                    }
                }
            },
            "context_window",
        ),
        (
            {
                "models": {
                    "m": {
                        "provider": "x",
                        "context_window": 10,
                        "max_output_tokens": 1,
                        "tokenizer_family": "nope",
                    }
                }
            },
            "tokenizer_family",
        ),
        (
            {
                "models": {
                    "m": {
                        "provider": "x",
                        "context_window": "big",
                        "max_output_tokens": 1,
                        "tokenizer_family": "unknown",
                    }
                }
            },
            "context_window",
        ),
        ({"families": {"f": {"safety_buffer_fraction": 0.9}}}, "safety_buffer_fraction"),
        ({"families": {"f": {"safety_buffer_fraction": 0.1, "encoding": "p50k"}}}, "encoding"),
        # An estimate family must cover estimate_v1's worst measured undercount (4.3 %).
        ({"families": {"f": {"safety_buffer_fraction": 0.04}}}, "at least 0.043"),
        ({"families": {"unknown": {"safety_buffer_fraction": 0.0}}}, "counted by the estimate"),
        ({"unexpected": 1}, "unexpected"),
    ],
)
def test_bad_files_name_the_problem(tmp_path: Path, data: object, needle: str) -> None:
    with pytest.raises(CatalogError) as err:
        load_catalog(write(tmp_path, data))
    assert needle in str(err.value)


def test_estimate_family_at_the_measured_undercount_and_exact_families_below_it(
    tmp_path: Path,
) -> None:
    families = {
        "est": {"safety_buffer_fraction": 0.043},
        "exact-tight": {"safety_buffer_fraction": 0.0, "encoding": "o200k_base"},
    }
    c = load_catalog(write(tmp_path, {"families": families}))
    assert c.family("est").safety_buffer_fraction == 0.043
    assert c.family("exact-tight").safety_buffer_fraction == 0.0


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(CatalogError, match="IBEX_CONTEXT_CATALOG_PATH"):
        load_catalog(str(tmp_path / "absent.json"))
