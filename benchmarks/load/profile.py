"""Top entries of a py-spy `--format raw` profile (collapsed stacks with counts)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path


def _frame(name: str) -> str:
    """`func (path/to/module.py:123)` -> `func (module.py)`: group by function, not line."""
    func, _, where = name.partition(" (")
    path = where.rstrip(")").rsplit(":", 1)[0]
    parts = path.split("/")
    short = "/".join(parts[-2:]) if "site-packages" in path or "lib/python" in path else path
    return f"{func} ({short.split('site-packages/')[-1]})"


# Where a sample's time goes, by the innermost matching frame (first match wins).
GROUPS = (
    ("pipeline (assemble_pure)", "assemble_pure "),
    ("memory HTTP client (http_pool)", "MemoryHttpSource."),
    ("redis directive", "RedisDirectiveSource."),
    ("request decode + validation", "check_request "),
    ("response encode (convert)", "response_to_proto "),
    ("retrieval orchestration", "retrieve "),
    ("grpclib + h2 (server)", "grpclib/"),
    ("grpclib + h2 (server)", " (h2/"),
    ("trio-asyncio loop", "trio_asyncio/"),
    ("trio scheduler / epoll", "_core/"),
    ("asyncio", "asyncio/"),
)


def _group(frames: list[str]) -> str:
    for frame in reversed(frames):
        for name, needle in GROUPS:
            if needle in frame:
                return name
    return "other"


def top_entries(raw: Path, n: int = 30) -> dict[str, list[tuple[str, float]]]:
    """Percent of samples per function: as the leaf (self) and anywhere on the stack (total)."""
    own: Counter[str] = Counter()
    total: Counter[str] = Counter()
    groups: Counter[str] = Counter()
    samples = 0
    if not raw.exists():
        return {"self": [], "total": [], "groups": []}
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        k = int(count)
        frames = [
            _frame(f)
            for f in stack.split(";")
            if f and not f.startswith("process ") and not f.startswith("thread ")
        ]
        if not frames:
            continue
        samples += k
        own[frames[-1]] += k
        for f in set(frames):
            total[f] += k
        groups[_group(frames)] += k
    pct = 100.0 / max(1, samples)
    return {
        "self": [(f, round(c * pct, 2)) for f, c in own.most_common(n)],
        "total": [(f, round(c * pct, 2)) for f, c in total.most_common(n)],
        "groups": [(g, round(c * pct, 2)) for g, c in groups.most_common()],
    }
