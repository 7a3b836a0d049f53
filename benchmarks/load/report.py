"""Summaries of one run's call records, and the tables printed per scenario."""

from __future__ import annotations

from collections import Counter
from typing import Any

from benchmarks.load.driver import Calls

FULL_QUALITY = "L0"


def percentile(sorted_values: list[float], q: float) -> float:
    if not sorted_values:
        return 0.0
    k = min(len(sorted_values) - 1, max(0, round(q / 100.0 * (len(sorted_values) - 1))))
    return sorted_values[k]


def summarize(rec: Calls, *, daemon_cpu_s: float, aux_cpu_s: dict[str, float]) -> dict[str, Any]:
    """The per-run measures: rate, latency percentiles, statuses, CPU per answer, quality."""
    n = len(rec.latency)
    lat = sorted(x * 1000.0 for x in rec.latency)
    lag = sorted(x * 1000.0 for x in rec.lag)
    ok = [i for i in range(n) if rec.status[i] == "OK"]
    answers = len(ok)
    statuses = Counter(rec.status)
    levels = Counter(rec.level[i] for i in ok)
    return {
        "calls": n,
        "answers": answers,
        "achieved_rps": round(answers / rec.wall_s, 1) if rec.wall_s else 0.0,
        "p50_ms": round(percentile(lat, 50), 2),
        "p90_ms": round(percentile(lat, 90), 2),
        "p99_ms": round(percentile(lat, 99), 2),
        "max_ms": round(lat[-1], 2) if lat else 0.0,
        "send_lag_p99_ms": round(percentile(lag, 99), 2),
        "errors": {k: v for k, v in sorted(statuses.items()) if k != "OK"},
        "error_count": n - answers,
        "zero_memory_answers": sum(1 for i in ok if rec.memories[i] == 0),
        "degradation": dict(sorted(levels.items())),
        "daemon_cpu_ms_per_answer": round(daemon_cpu_s * 1000.0 / answers, 3) if answers else None,
        "daemon_cpu_cores": round(daemon_cpu_s / rec.wall_s, 2) if rec.wall_s else 0.0,
        "driver_cpu_ms_per_call": round(rec.driver_cpu_s * 1000.0 / n, 3) if n else None,
        "driver_cpu_cores": round(rec.driver_cpu_s / rec.wall_s, 2) if rec.wall_s else 0.0,
        "aux_cpu_cores": {k: round(v / rec.wall_s, 2) for k, v in aux_cpu_s.items()}
        if rec.wall_s
        else {},
    }


def recovery(rec: Calls, overload_end_s: float, bucket_s: float = 0.1) -> dict[str, Any]:
    """Time after the overload ends until answers are full quality (OK, L0, memories) for good.

    Calls are bucketed by scheduled time; recovery is the start of the first
    bucket after which every bucket has >= 99% full-quality answers.
    """
    buckets: dict[int, list[bool]] = {}
    first_full: float | None = None
    for i, t in enumerate(rec.scheduled):
        if t < overload_end_s:
            continue
        full = rec.status[i] == "OK" and rec.level[i] == FULL_QUALITY and rec.memories[i] > 0
        if full and first_full is None:
            first_full = t - overload_end_s
        buckets.setdefault(int((t - overload_end_s) / bucket_s), []).append(full)
    keys = sorted(buckets)
    recovered_at: float | None = None
    for k in reversed(keys):
        flags = buckets[k]
        if sum(flags) < 0.99 * len(flags):
            break
        recovered_at = k * bucket_s
    return {
        "first_full_quality_s": None if first_full is None else round(first_full, 3),
        "recovered_s": None if recovered_at is None else round(recovered_at, 3),
        "full_quality_after": round(
            sum(sum(buckets[k]) for k in keys) / max(1, sum(len(buckets[k]) for k in keys)), 4
        ),
    }


COLUMNS = (
    ("run", 22, "{}"),
    ("achieved_rps", 8, "{:.0f}"),
    ("p50_ms", 7, "{:.1f}"),
    ("p90_ms", 7, "{:.1f}"),
    ("p99_ms", 7, "{:.1f}"),
    ("max_ms", 7, "{:.1f}"),
    ("error_count", 6, "{}"),
    ("zero_memory_answers", 5, "{}"),
    ("daemon_cpu_ms_per_answer", 7, "{}"),
    ("daemon_cpu_cores", 6, "{}"),
    ("driver_cpu_cores", 6, "{}"),
    ("send_lag_p99_ms", 7, "{:.1f}"),
    ("other_cpu_cores", 6, "{}"),
    ("ref_cpu_ms", 5, "{:.0f}"),
)
HEADS = (
    "run",
    "rps",
    "p50",
    "p90",
    "p99",
    "max",
    "errs",
    "zero",
    "cpu/ans",
    "d.core",
    "drv.c",
    "lag99",
    "other",
    "ref",
)


def table(title: str, rows: list[dict[str, Any]]) -> str:
    lines = [f"== {title}"]
    lines.append(
        " ".join(
            h.rjust(w) if i else h.ljust(w)
            for i, (h, (_, w, _f)) in enumerate(zip(HEADS, COLUMNS, strict=True))
        )
    )
    for r in rows:
        cells = []
        for i, (key, width, f) in enumerate(COLUMNS):
            v = r.get(key)
            text = "-" if v is None else f.format(v)
            cells.append(text.ljust(width) if i == 0 else text.rjust(width))
        extra = []
        if r.get("errors"):
            extra.append("errors=" + ",".join(f"{k}:{v}" for k, v in r["errors"].items()))
        if r.get("degradation"):
            extra.append("levels=" + ",".join(f"{k}:{v}" for k, v in r["degradation"].items()))
        if r.get("health") and not r["health"]["ok"]:
            extra.append(f"HEALTH FAILED {r['health']}")
        lines.append(" ".join(cells) + ("  " + " ".join(extra) if extra else ""))
    return "\n".join(lines)
