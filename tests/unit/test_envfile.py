"""`--env-file`: the EnvironmentFile= subset the example uses, bounded, errors without values."""

from __future__ import annotations

from pathlib import Path

import pytest

from ibex.config import ConfigError, load_settings
from ibex.ops.envfile import MAX_BYTES, parse_env, read_env_file

EXAMPLE = Path(__file__).resolve().parents[2] / "deploy" / "ibex-context.env.example"


def test_names_values_comments_quotes_and_export() -> None:
    text = (
        "# comment\n"
        "; also a comment\n"
        "\n"
        "A=1\n"
        "  B = two words  \n"
        'C="quoted # not a comment"\n'
        "D='single'\n"
        "export E=exported\n"
        "F=\n"
        "A=last wins\n"
        'G="unbalanced\n'
    )
    assert parse_env(text) == {
        "A": "last wins",
        "B": "two words",
        "C": "quoted # not a comment",
        "D": "single",
        "E": "exported",
        "F": "",
        "G": '"unbalanced',
    }


@pytest.mark.parametrize("line", ["no equals sign", "1BAD=x", "BAD NAME=x", "=x"])
def test_a_malformed_line_names_the_line_not_the_value(line: str) -> None:
    with pytest.raises(ConfigError, match=r"--env-file f line 2: expected NAME=value"):
        parse_env(f"OK=1\n{line}\n", "f")


def test_the_example_file_reads_as_systemd_reads_it() -> None:
    env = read_env_file(EXAMPLE)
    assert env["IBEX_CONTEXT_METRICS_ADDR"] == "127.0.0.1:9464"
    assert load_settings(env).metrics_addr == "127.0.0.1:9464"


def test_missing_oversized_and_non_utf8_files_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read"):
        read_env_file(tmp_path / "absent.env")
    big = tmp_path / "big.env"
    big.write_bytes(b"#" * (MAX_BYTES + 1))
    with pytest.raises(ConfigError, match="larger than"):
        read_env_file(big)
    latin = tmp_path / "latin.env"
    latin.write_bytes(b"A=caf\xe9\n")
    with pytest.raises(ConfigError, match="not UTF-8"):
        read_env_file(latin)
