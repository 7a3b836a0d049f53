"""The one results file behind docs/performance.md's table of current figures.

`benchmarks/figures.json` (committed) holds, per benchmark, its latest run:
the commit it measured, the date, the command, the machine's speed reference
(`benchmarks.load.speed`) over the run and each figure. A benchmark that
reports figures calls `record()`; the run it replaces moves to the file's
history, newest first. docs/performance.md's "Current figures" table and its
dated history list are generated from the file between marker comments:

    python -m benchmarks.figures --write    # regenerate the docs' blocks
    python -m benchmarks.figures --check    # exit 1 when the docs disagree

`quoted_figures()` finds the figures README.md and docs/*.md quote outside the
history section (ratios like ``2.41×``, ``598 answers/s``, ``3.1 ms CPU per
answer``); tests/unit/test_bench_figures.py fails when one is not in the
current table, so a figure cannot be quoted as current once a new run
replaces it.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import re
import subprocess
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
FILE = ROOT / "benchmarks" / "figures.json"
DOC = ROOT / "docs" / "performance.md"
CURRENT = ("<!-- figures:current:begin -->", "<!-- figures:current:end -->")
HISTORY = ("<!-- figures:history:begin -->", "<!-- figures:history:end -->")
HISTORY_HEADING = "## History"
HISTORY_KEPT = 20  # older runs beyond this many are dropped from the file
# Figures a document quotes as measured: a decimal ratio (not a limit such as "≤ 2.0×"),
# a throughput, or a CPU cost per answer.
QUOTED = (
    re.compile(r"(?<![≤≥<>=\d.,])(?<![≤≥<>=] )(\d+\.\d+) ?×"),
    re.compile(r"(?<![\d.,])(\d[\d,]*(?:\.\d+)?) ?answers/s"),
    re.compile(r"(?<![\d.,])(\d+\.\d+) ms (?:of )?(?:CPU )?per answer"),
)


@dataclass(frozen=True)
class Figure:
    """One measured figure: a stable key, what it is, its value and unit; `beside` is the
    comparison value printed with it (the floor's, for a ratio's two sides)."""

    key: str
    label: str
    value: float | None
    unit: str
    source: str
    beside: float | None = None


def _git(*args: str) -> str:
    try:
        return subprocess.run(
            ["git", *args], cwd=ROOT, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def commit() -> str:
    """The short commit measured, with `+dirty` when the work tree had changes."""
    head = _git("rev-parse", "--short", "HEAD") or "unknown"
    dirty = _git("status", "--porcelain", "--untracked-files=no", "--", "ibex", "benchmarks")
    return head + ("+dirty" if dirty else "")


def load(path: Path = FILE) -> dict[str, Any]:
    if not path.exists():
        return {"current": {}, "history": []}
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def record(
    source: str,
    command: str,
    machine_speed: Mapping[str, Any],
    found: Sequence[Figure],
    *,
    path: Path = FILE,
    when: dt.datetime | None = None,
    measured: str | None = None,
    load_average: float | None = None,
) -> Path:
    """Make `found` the current figures of `source`; its previous run goes to the history.

    The machine's 1-minute load average at the end of the run is kept beside the
    speed reference: on a shared machine it says whether others were busy."""
    data = load(path)
    previous = data["current"].get(source)
    if previous is not None:
        data["history"].insert(0, {"source": source, **previous})
        del data["history"][HISTORY_KEPT:]
    stamp = (when or dt.datetime.now(dt.UTC)).strftime("%Y-%m-%d %H:%M UTC")
    data["current"][source] = {
        "commit": measured if measured is not None else commit(),
        "date": stamp,
        "command": command,
        "machine_speed": dict(machine_speed),
        "load_average": round(os.getloadavg()[0] if load_average is None else load_average, 2),
        "cores": os.cpu_count(),
        "figures": [asdict(f) for f in found],
    }
    data["current"] = dict(sorted(data["current"].items()))
    path.write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n")
    return path


def fmt(value: float | None, unit: str) -> str:
    """A figure as the table prints it (and as documents must quote it)."""
    if value is None:
        return "-"
    if unit == "answers/s":
        return f"{value:,.0f} answers/s"
    if unit == "×":
        return f"{value:.2f}×"
    if unit == "ms":
        return f"{value:.2f} ms"
    if unit == "µs":
        return f"{value:,.0f} µs"
    return f"{value:g} {unit}".strip()


def _speed(speed: Mapping[str, Any]) -> str:
    if not speed.get("samples"):
        return "-"
    return f"{speed['median_ms']} ms (×{speed.get('max_over_min')})"


def render_current(data: Mapping[str, Any]) -> str:
    """The current table: every figure with its run's commit, date and speed reference."""
    lines = [
        "| figure | measured | beside it | run |",
        "|---|---|---|---|",
    ]
    runs = []
    for n, (source, run) in enumerate(data["current"].items(), start=1):
        runs.append(
            f"{n}. `{source}`: {run['date']}, commit {run['commit']}, speed reference "
            f"{_speed(run['machine_speed'])}, load average {run.get('load_average', '-')} "
            f"on {run.get('cores', '-')} cores: `{run['command']}`"
        )
        for f in run["figures"]:
            beside = "-" if f.get("beside") is None else fmt(f["beside"], f["unit"])
            lines.append(f"| {f['label']} | {fmt(f['value'], f['unit'])} | {beside} | {n} |")
    if not runs:
        return "No figures recorded yet: run a benchmark that records them."
    return "\n".join([*lines, "", "Runs (speed reference: median ms of CPU, max/min):", "", *runs])


def render_history(data: Mapping[str, Any]) -> str:
    """Replaced runs, newest first, each dated with its commit and figures."""
    if not data["history"]:
        return "No replaced runs in the results file yet."
    lines = []
    for run in data["history"]:
        shown = ", ".join(f"{f['label']} {fmt(f['value'], f['unit'])}" for f in run["figures"][:12])
        more = len(run["figures"]) - 12
        lines.append(
            f"- {run['date']}, `{run['source']}`, commit {run['commit']}, speed reference "
            f"{_speed(run['machine_speed'])}: {shown}{f' and {more} more' if more > 0 else ''}"
        )
    return "\n".join(lines)


def splice(text: str, markers: tuple[str, str], body: str) -> str:
    begin, end = markers
    head, sep, rest = text.partition(begin)
    if not sep or end not in rest:
        raise ValueError(f"markers {begin} ... {end} not found")
    _, _, tail = rest.partition(end)
    return f"{head}{begin}\n{body}\n{end}{tail}"


def generated(doc_text: str, data: Mapping[str, Any]) -> str:
    text = splice(doc_text, CURRENT, render_current(data))
    return splice(text, HISTORY, render_history(data))


def current_values(data: Mapping[str, Any]) -> list[float]:
    """Every value in the current table, the values printed beside them included."""
    out = []
    for run in data["current"].values():
        for f in run["figures"]:
            out += [v for v in (f["value"], f.get("beside")) if v is not None]
    return out


def without_history(text: str) -> str:
    """A document's text with its generated blocks and its history section cut out."""
    for begin, end in (CURRENT, HISTORY):
        while begin in text and end in text:
            head, _, rest = text.partition(begin)
            text = head + rest.partition(end)[2]
    start = re.search(rf"^{re.escape(HISTORY_HEADING)}\b.*$", text, flags=re.M)
    if start is None:
        return text
    # The history runs to the next heading of its level, or to the end.
    nxt = re.search(r"^## ", text[start.end() :], flags=re.M)
    return text[: start.start()] + ("" if nxt is None else text[start.end() + nxt.start() :])


def quoted_figures(text: str) -> list[str]:
    """The figures a document quotes as measured, outside its history and generated table."""
    body = without_history(text)
    return [m.group(1) for pattern in QUOTED for m in pattern.finditer(body)]


def unknown_figures(quotes: Iterable[str], values: Sequence[float]) -> list[str]:
    """Quotes that no current value rounds to, at the quote's own precision."""
    bad = []
    for q in quotes:
        number = float(q.replace(",", ""))
        digits = len(q.partition(".")[2])
        if not any(round(v, digits) == number for v in values):
            bad.append(q)
    return bad


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--write", action="store_true", help="regenerate docs/performance.md")
    what.add_argument("--check", action="store_true", help="exit 1 when the docs disagree")
    what.add_argument("--print", action="store_true", help="print the current table")
    args = p.parse_args(argv)
    data = load()
    if args.print:
        print(render_current(data))
        return 0
    text = DOC.read_text()
    new = generated(text, data)
    if args.write:
        DOC.write_text(new)
        print(f"wrote {DOC}")
        return 0
    if new != text:
        print(f"{DOC} differs from {FILE}: run python -m benchmarks.figures --write")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
