"""The whole pure pipeline (`assemble_pure`) on a production-shaped request.

30 candidates of 50-800 characters (English, CJK, code, emoji mixed), 4 history
messages, 2 tool schemas and a directive. The count cache is warm (memories
recur across requests) but every iteration draws a fresh nonce as the daemon
does (`formatter.new_nonce(16)`, fixed-width decimal), so no piece carrying the
nonce can be served from the cache; only the count of its zeros-shaped twin,
which every decimal nonce of that width matches (see history.DeferredCache.with_nonce). The
stage table re-runs the pipeline's stages one by one with the same functions,
and cProfile shows which functions the time goes to.

Run: ``.venv/bin/python -m benchmarks.pipeline`` (prints tables, writes
``benchmarks/results/pipeline.json``).
"""

from __future__ import annotations

import cProfile
import json
import platform
import pstats
import random
import statistics
import sys
import time
from pathlib import Path

import msgspec

from benchmarks.timing import timed
from ibex.assembly.catalog import Catalog, load_catalog
from ibex.assembly.packer import pack
from ibex.assembly.pipeline import (
    AssemblyInputs,
    assemble_pure,
    count_fixed_sections,
    price,
    render_within_ceiling,
    resolve_model,
    select_candidates,
)
from ibex.assembly.structs import AssemblyRequest, BranchOutcome, Directive, MemoryHit, Message
from ibex.assembly.tokens import Tokenizers
from ibex.assembly.xml_format import XML_TAGS, new_nonce
from ibex.testing.samples import AGENT, ORG

RESULTS = Path(__file__).parent / "results" / "pipeline.json"

ITERATIONS = 2_000
TARGET_MEDIAN_US = 1_000.0

ENGLISH = (
    "The billing service deploys from main once the CI pipeline is green. "
    "Customers on the Enterprise plan have a 99.95% uptime SLA and four-hour response. "
    "Never rotate the signing key without publishing the new JWKS entry first. "
    "The user prefers short answers with the runbook step cited at the end. "
)
CJK = (
    "数据库迁移必须向后兼容一个版本：先添加新列，再回填数据，然后切换读取。"
    "デプロイは金曜日の午後に行わないでください。障害対応は三十分ごとに報告します。"
    "배포 전에 CI 파이프라인이 녹색인지 확인하고 변경 사항을 기록하세요. "
)
CODE = (
    "def deploy(env: str, *, dry_run: bool = False) -> int:\n"
    "    if env not in {'prod', 'staging'}:\n"
    "        raise ValueError(f'unknown env {env!r}')\n"
    "    return run(['just', 'deploy', 'billing', '--env', env], check=not dry_run)\n"
)
EMOJI = "🚀 shipped 🎉 rollback ⏪ on-call 📟 👍🏽 status ✅ ❌ 👨‍👩‍👧‍👦 🔥 "
SOURCES = (ENGLISH, CJK, CODE, EMOJI)
CATEGORIES = ("procedural", "factual", "preference", "behavioral", "episodic", "notes")


def _text(rng: random.Random, length: int) -> str:
    parts: list[str] = []
    while sum(map(len, parts)) < length:
        src = rng.choice(SOURCES)
        start = rng.randrange(len(src))
        parts.append(src[start : start + rng.randint(20, 200)])
    return "".join(parts)[:length]


def workload(model: str, available_tokens: int = 0, seed: int = 20261021) -> AssemblyInputs:
    rng = random.Random(seed)
    hits = [
        MemoryHit(
            memory_id=f"{rng.getrandbits(128):032x}",
            org_id=ORG,
            agent_id=AGENT,
            content=_text(rng, rng.randint(50, 800)),
            category=rng.choice(CATEGORIES),
            confidence=rng.random(),
            similarity=rng.random(),
            rank=i + 1,
            branch="hot" if i < 10 else "cold",
        )
        for i in range(30)
    ]
    messages = tuple(
        Message(role, _text(rng, rng.randint(80, 400)))
        for role in ("user", "assistant", "user", "assistant")
    )
    tools = (
        '{"name": "search_runbooks", "description": "Search the runbooks", "parameters": '
        '{"type": "object", "properties": {"query": {"type": "string"}}, "required": ["query"]}}',
        '{"name": "open_ticket", "description": "Open a support ticket", "parameters": '
        '{"type": "object", "properties": {"severity": {"type": "integer", "minimum": 1}}}}',
    )
    request = AssemblyRequest(
        agent_id=AGENT,
        org_id=ORG,
        query="how do I deploy billing safely?",
        model=model,
        available_tokens=available_tokens,
        recent_messages=messages,
        tool_schemas=tools,
    )
    return AssemblyInputs(
        request=request,
        directive=Directive("You are the support assistant for Acme Cloud. " * 3, version_id="v1"),
        hot=tuple(h for h in hits if h.branch == "hot"),
        cold=tuple(h for h in hits if h.branch == "cold"),
        branches=(
            BranchOutcome("directive", "success", 1.0),
            BranchOutcome("hot", "success", 4.0),
            BranchOutcome("cold", "success", 20.0),
        ),
        nonce=new_nonce(16),
        now=time.time(),
    )


def _fresh(inputs: AssemblyInputs) -> AssemblyInputs:
    return msgspec.structs.replace(inputs, nonce=new_nonce(16))


def whole(inputs: AssemblyInputs, catalog: Catalog, tokenizers: Tokenizers) -> dict[str, object]:
    for _ in range(50):  # warm the count cache and the catalog's resolve cache
        assemble_pure(_fresh(inputs), catalog=catalog, tokenizers=tokenizers)
    batch = [_fresh(inputs) for _ in range(ITERATIONS)]
    it = iter(batch)
    stats = timed(
        lambda: assemble_pure(next(it), catalog=catalog, tokenizers=tokenizers), ITERATIONS
    )
    result = assemble_pure(batch[0], catalog=catalog, tokenizers=tokenizers)
    return {
        "model": inputs.request.model,
        "available_tokens": inputs.request.available_tokens,
        "estimate_kind": result.budget.estimate_kind,
        "candidates": len(inputs.hot) + len(inputs.cold),
        "included": result.memories_included,
        "chars": len(result.assembled_context),
        "tokens_used": result.tokens_used,
        **stats,
    }


def stages(inputs: AssemblyInputs, catalog: Catalog, tokenizers: Tokenizers) -> dict[str, float]:
    """Median µs of each stage, re-run with the pipeline's own functions.

    The last row is not part of the pipeline: it is what re-tokenising the
    final text would add, the check the format's join rule (`counts_add_up`)
    replaces.
    """
    request = inputs.request
    cap = resolve_model(catalog, request.model, request.available_tokens)
    family = catalog.family(cap.tokenizer_family)
    counter = tokenizers.counter(family.name, family.encoding)
    samples: dict[str, list[int]] = {}

    def clock(name: str, t0: int) -> int:
        t1 = time.perf_counter_ns()
        samples.setdefault(name, []).append(t1 - t0)
        return t1

    model = cap.model_id or request.model
    for _ in range(ITERATIONS // 2):
        nonce = new_nonce(16)
        t = time.perf_counter_ns()
        fixed = count_fixed_sections(
            request, inputs.directive, nonce, cap, family, counter, XML_TAGS
        )
        t = clock("count fixed sections, budget", t)
        candidates, _ = select_candidates(request, inputs.hot, inputs.cold, inputs.now)
        t = clock("select (filter, score, dedupe)", t)
        candidates = price(candidates, counter, XML_TAGS)
        t = clock("price (escape, cache lookups)", t)
        result = pack(candidates, fixed.budget.usable_budget)
        t = clock("pack", t)
        rendered = render_within_ceiling(
            request, inputs.directive, nonce, fixed, result.packed, counter, model, XML_TAGS
        )
        t = clock("render within the ceiling", t)
        counter.count_uncached(rendered.text)
        clock("(not run) full-text re-count", t)
    return {name: statistics.median(s) / 1000 for name, s in samples.items()}


def profile(inputs: AssemblyInputs, catalog: Catalog, tokenizers: Tokenizers) -> list[str]:
    batch = [_fresh(inputs) for _ in range(500)]
    prof = cProfile.Profile()
    prof.enable()
    for inp in batch:
        assemble_pure(inp, catalog=catalog, tokenizers=tokenizers)
    prof.disable()
    stats = pstats.Stats(prof)
    rows: list[tuple[float, int, str]] = []
    for (file, line, func), (_cc, nc, tt, _ct, _callers) in stats.stats.items():  # type: ignore[attr-defined]
        where = f"{Path(file).name}:{line}({func})" if line else func
        rows.append((tt, nc, where))
    rows.sort(reverse=True)
    total = sum(r[0] for r in rows)
    n = len(batch)
    return [
        f"{100 * tt / total:5.1f}%  {tt / n * 1e6:7.1f} µs/req  {nc // n:>5} calls  {w}"
        for tt, nc, w in rows[:12]
    ]


def main() -> None:
    catalog = load_catalog()
    tokenizers = Tokenizers(None, 65536)
    tokenizers.preload(sorted(catalog.encodings()))
    rows = []
    breakdown: dict[str, dict[str, float]] = {}
    for model in ("gpt-4o", "claude-sonnet-4-5"):
        inputs = workload(model)
        rows.append(whole(inputs, catalog, tokenizers))
        breakdown[model] = stages(inputs, catalog, tokenizers)
    # A small window, so the packer has to choose (a DP over a real table).
    rows.append(whole(workload("gpt-4o", available_tokens=6000), catalog, tokenizers))
    hot_spots = profile(workload("gpt-4o"), catalog, tokenizers)

    print(f"pure pipeline, {ITERATIONS} iterations, warm count cache, fresh nonce per iteration")
    head = f"{'model':<20} {'avail':>5} {'kind':<12} {'cands':>5} {'incl':>4} {'chars':>6}"
    head += f" {'tokens':>6}"
    print(f"{head} {'median µs':>10} {'p99 µs':>8}")
    for r in rows:
        print(
            f"{r['model']:<20} {r['available_tokens'] or '-':>5} {r['estimate_kind']:<12} "
            f"{r['candidates']:>5} {r['included']:>4} {r['chars']:>6} {r['tokens_used']:>6} "
            f"{r['median_us']:>10.1f} {r['p99_us']:>8.1f}"
        )
    for model, parts in breakdown.items():
        total = sum(us for name, us in parts.items() if not name.startswith("("))
        print(f"\nstages, {model} (median µs; pipeline stages sum {total:.1f})")
        for name, us in parts.items():
            print(f"  {name:<42} {us:>8.1f}  {100 * us / total:5.1f}%")
    print("\ncProfile, gpt-4o, top functions by own time")
    for line in hot_spots:
        print("  " + line)
    verdict = all(float(r["median_us"]) <= TARGET_MEDIAN_US for r in rows)  # type: ignore[arg-type]
    print(f"\ntarget median <= {TARGET_MEDIAN_US:.0f} µs: {'met' if verdict else 'NOT met'}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(
        json.dumps(
            {
                "machine": {"python": sys.version.split()[0], "platform": platform.platform()},
                "iterations": ITERATIONS,
                "target_median_us": TARGET_MEDIAN_US,
                "whole": rows,
                "stages_median_us": breakdown,
                "profile_gpt_4o": hot_spots,
            },
            indent=2,
            ensure_ascii=False,
        )
        + "\n"
    )
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
