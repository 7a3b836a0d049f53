"""The costs that code comments cite as the reason for a design choice.

- loading a verified tiktoken encoding (why `Tokenizers.preload` runs at start-up);
- counting uncached CJK text with tiktoken, per character and for 1 MB (why a
  call with more than `OFFLOAD_CHARS` of text counts in a worker thread);
- rendering ``/metrics`` in pure Python (why a supervisor serves it whenever it
  is on, so a scrape never pauses a worker's calls).

Run: ``.venv/bin/python -m benchmarks.code_costs [--repeats N]``; prints medians.
"""

from __future__ import annotations

import argparse
import functools
import random
import statistics
import time
from collections.abc import Callable

from ibex.assembly.rank_files import load_encoding


def median_ms(fn: Callable[[], object], repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1000.0)
    return statistics.median(times)


def cjk_text(chars: int, seed: int = 7) -> str:
    rng = random.Random(seed)
    common = [chr(c) for c in range(0x4E00, 0x4E00 + 3000)]
    return "".join(rng.choice(common) for _ in range(chars))


def scrape_ms(repeats: int) -> float:
    from prometheus_client import generate_latest

    from benchmarks.pipeline import workload
    from ibex.assembly.catalog import load_catalog
    from ibex.assembly.pipeline import assemble_pure
    from ibex.assembly.tokens import Tokenizers
    from ibex.ops.metrics import Metrics

    metrics = Metrics()
    result = assemble_pure(
        workload("gpt-4o"), catalog=load_catalog(), tokenizers=Tokenizers(None, 65536)
    )
    for i in range(200):
        metrics.observe_assembly(result)
        metrics.observe_request("AssembleContext", "OK", 0.01 + i / 10_000)
        metrics.observe_answer("AssembleContext", 0.02)
    return median_ms(lambda: generate_latest(metrics.registry), repeats)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=15)
    args = parser.parse_args()
    repeats = max(3, min(args.repeats, 200))
    rows = []
    for name in ("cl100k_base", "o200k_base"):
        rows.append((f"load {name}", median_ms(functools.partial(load_encoding, name), 3), "ms"))
    enc = load_encoding("o200k_base")
    small, big = cjk_text(16 * 1024), cjk_text(1024 * 1024)
    per_small = median_ms(lambda: enc.encode_ordinary(small), repeats)
    rows.append(("o200k CJK, chars per ms (16 K chars)", len(small) / per_small, "chars/ms"))
    rows.append(("o200k CJK, 1 M chars", median_ms(lambda: enc.encode_ordinary(big), 3), "ms"))
    rows.append(("/metrics render, one registry", scrape_ms(repeats), "ms"))
    width = max(len(r[0]) for r in rows)
    for label, value, unit in rows:
        print(f"{label:<{width}}  {value:>10,.2f} {unit}")


if __name__ == "__main__":
    main()
