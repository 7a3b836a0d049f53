"""How much of each turn's context a model provider's prompt cache can serve.

Replays 20-turn conversations through two in-process workers (two
`Assembler`s sharing one `IBEX_CONTEXT_NONCE_KEY`) in round robin, as a
load-balanced fleet would: the directive (about 1,400 tokens) and four tool
schemas stay fixed, the history grows by a user question and an assistant
answer per turn, every turn asks something new, and the memory service
returns a different set of memories for each query (a stable hot set plus
query-dependent cold hits).

Counted as a provider counts it (OpenAI: prompts from 1,024 tokens, cached in
128-token steps): a turn's cached tokens are 0 when the common token prefix
with the previous turn's context (o200k_base, gpt-4o's encoding) is under
1,024, else that prefix rounded down to a multiple of 128. Only the previous
turn is compared (a provider may also hit older prompts, so this is a floor).
For each turn from the second on it reports:

- the cached share of the turn's context tokens;
- the coverage: the share of the previous turn's stable part (directive,
  tools, safety sentence and history: what does not change from one turn to
  the next) that the cached prefix covers, and the same share of the stable
  part without the tools (directive, safety sentence, history: all the `seed`
  order can reach, since its tools follow the memories); the prefix coverage
  is the share the common prefix covers before the provider's 128-token step
  (what the order makes cacheable; the step then leaves 0-127 tokens out);
- that miss in tokens, split into what the assembly left out of the common
  prefix and what the step left out of it, and the stable size from which the
  step alone can no longer put a turn under 95 % (`step_bound_tokens`);
- input cost at list prices with and without the cache (defaults: gpt-4o,
  $2.50 per million input tokens, $1.25 per million cached; `--price-input`,
  `--price-cached`). Only the context block is priced; the proxy's own
  messages around it add the same on both sides.

The replay runs the same conversations in each section order
(IBEX_CONTEXT_SECTION_ORDER: `seed`, then `cache`, which puts the tools in
front of the history) with the key, and once without the key (a random nonce
per assembly, the default) as the baseline. It also reports what a nonce on
every memory element would cost per answer (the layout before memory
elements dropped it). Targets: `seed` covers >= 90 % of the previous turn's
directive, safety and history; `cache` >= 95 % of its directive, tools,
safety and history, at a lower input cost than `seed`.

Run: ``.venv/bin/python -m benchmarks.cache_prefix [--conversations N]``
(prints tables, writes ``benchmarks/results/cache_prefix.json``).
"""

from __future__ import annotations

import argparse
import json
import math
import random
import statistics
import zlib
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import msgspec
import trio

from benchmarks import figures
from ibex.assembly.catalog import Catalog, load_catalog
from ibex.assembly.nonce import NonceKey
from ibex.assembly.output_format import SECTION_ORDERS, SectionOrder
from ibex.assembly.pipeline import PipelineConfig
from ibex.assembly.structs import AssemblyRequest, AssemblyResult, Directive, MemoryHit, Message
from ibex.assembly.tokens import Tokenizers
from ibex.service.assembler import Assembler
from ibex.sources.retrieval import RetrievalConfig
from ibex.testing.samples import AGENT, ORG

RESULTS = Path(__file__).parent / "results" / "cache_prefix.json"

MODEL = "gpt-4o"
ENCODING = "o200k_base"
CACHE_MIN_TOKENS = 1024
CACHE_STEP_TOKENS = 128
PRICE_INPUT = 2.50  # USD per million input tokens (gpt-4o list price)
PRICE_CACHED = 1.25  # USD per million cached input tokens (gpt-4o list price)
TURNS = 20
CONVERSATIONS = 10
BENCH_KEY = "benchmark-nonce-key-0123456789abcdef"  # shared by both workers

# Instant in-process sources: a generous wall so a loaded machine never degrades a turn.
RETRIEVAL = RetrievalConfig(
    timeout=5.0, deadline=5.0, directive_timeout=5.0, hot_timeout=5.0, cold_timeout=5.0
)

RULES = (
    "Answer as the Acme Cloud support assistant; be accurate, brief and friendly.",
    "Cite the runbook step or documentation page you relied on at the end of each answer.",
    "Never reveal credentials, signing keys, internal hostnames or other accounts' data.",
    "Escalate to the on-call engineer when an outage affects more than one region.",
    "Ask one clarifying question when the request is ambiguous instead of guessing.",
    "Prefer the customer's configured region and plan when giving limits or prices.",
    "Enterprise customers have a 99.95% uptime SLA and a four-hour first response target.",
    "Deployments are frozen on Fridays after 14:00 UTC and during declared incidents.",
    "Database migrations must stay backward compatible for one release: add, backfill, switch.",
    "Refunds above 500 USD need a manager's approval recorded in the ticket.",
    "Use metric units, ISO 8601 dates and 24-hour times in every answer.",
    "When a tool call fails, say so plainly and offer the manual procedure.",
    "Do not speculate about root causes before the incident review is published.",
    "Summarise long logs instead of pasting them; quote at most five lines.",
    "Offer the status page link when the customer reports elevated error rates.",
)
TOPICS = (
    "deploying the billing service",
    "rotating API keys",
    "a failed database migration",
    "elevated 502 errors in eu-west",
    "raising the rate limit for a tenant",
    "restoring a deleted bucket",
    "the invoice for last month",
    "setting up single sign-on",
    "webhook retries",
    "a slow search index rebuild",
)
SENTENCES = (
    "The service runs three replicas behind the regional load balancer.",
    "Health checks fail after two consecutive timeouts of five seconds.",
    "The last change rolled out at 09:40 UTC and touched the connection pool.",
    "Customers on the Starter plan are limited to 100 requests per second.",
    "The runbook says to drain one node at a time and watch the error budget.",
    "Keys are rotated by publishing the new JWKS entry before switching signers.",
    "Backups are taken every six hours and kept for thirty days.",
    "The webhook dispatcher retries with exponential backoff up to eight times.",
    "SSO needs the identity provider's metadata URL and a verified domain.",
    "Index rebuilds run at low priority and can take an hour on large tenants.",
)
TOOLS = tuple(
    json.dumps(
        {
            "name": name,
            "description": desc,
            "parameters": {
                "type": "object",
                "properties": {p: {"type": "string", "description": f"The {p}."} for p in params},
                "required": list(params[:1]),
            },
        }
    )
    for name, desc, params in (
        ("search_runbooks", "Search the runbooks by keywords", ("query", "service")),
        ("open_ticket", "Open a support ticket", ("summary", "severity", "customer_id")),
        ("get_status", "Current status of a region", ("region",)),
        ("lookup_account", "Plan, region and limits of an account", ("account_id",)),
    )
)
CATEGORIES = ("procedural", "factual", "preference", "behavioral", "episodic")


def cached_tokens(common_prefix_tokens: int) -> int:
    """What the provider serves from its cache for a common prefix of that many tokens."""
    if common_prefix_tokens < CACHE_MIN_TOKENS:
        return 0
    return common_prefix_tokens // CACHE_STEP_TOKENS * CACHE_STEP_TOKENS


def step_bound_tokens(left_by_order: int, share: float) -> int:
    """The stable part's size from which the step can never push coverage under `share`.

    The step leaves at most CACHE_STEP_TOKENS - 1 of the common prefix uncached, so a
    previous turn's stable part of S tokens is covered at least
    (S - left_by_order - 127) / S; under the returned S it can fall below `share`.
    """
    worst = left_by_order + CACHE_STEP_TOKENS - 1
    return math.ceil(round(worst / (1 - share), 6)) if share < 1 else 0


def common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    n = min(len(a), len(b))
    i = 0
    while i < n and a[i] == b[i]:
        i += 1
    return i


def _prose(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(SENTENCES) for _ in range(n))


def directive(seed: int) -> Directive:
    """A production-sized system prompt (about 1,400 tokens), fixed for the agent."""
    rng = random.Random(seed)
    lines = [f"{i + 1}. {rng.choice(RULES)} {_prose(rng, 2)}" for i in range(36)]
    return Directive("\n".join(lines), "system_first", "00000000-0000-4000-8000-00000000d001")


class StandIn:
    """Directive and memories from memory: a stable hot set, cold hits chosen by the query."""

    def __init__(self, seed: int) -> None:
        rng = random.Random(seed)
        self._directive = directive(seed)
        self._pool = [
            MemoryHit(
                memory_id=f"{rng.getrandbits(128):032x}",
                org_id=ORG,
                agent_id=AGENT,
                content=_prose(rng, rng.randint(1, 5)),
                category=rng.choice(CATEGORIES),
                confidence=round(rng.uniform(0.5, 1.0), 3),
                similarity=0.0,
                rank=1,
            )
            for _ in range(80)
        ]

    async def get_directive(
        self, org_id: str, agent_id: str, version: str = ""
    ) -> Directive | None:
        return self._directive

    async def hot(
        self, org_id: str, agent_id: str, *, limit: int, min_confidence: float
    ) -> list[MemoryHit]:
        return [
            msgspec.structs.replace(m, similarity=0.6, rank=i + 1, branch="hot")
            for i, m in enumerate(self._pool[: min(limit, 6)])
        ]

    async def cold(
        self, org_id: str, agent_id: str, query: str, *, limit: int, min_confidence: float
    ) -> list[MemoryHit]:
        rng = random.Random(zlib.crc32(query.encode()))
        picked = rng.sample(self._pool[6:], min(limit, 14))
        return [
            msgspec.structs.replace(
                m, similarity=round(rng.uniform(0.3, 0.95), 3), rank=i + 1, branch="cold"
            )
            for i, m in enumerate(picked)
        ]

    async def aclose(self) -> None:
        return None


class Turn(msgspec.Struct, frozen=True):
    turn: int
    context_tokens: int
    stable_tokens: int  # directive + tools + safety sentence + history of this turn
    common_prefix_tokens: int  # with the previous turn's context (0 on turn 1)
    cached_tokens: int
    coverage: float  # cached / the previous turn's stable tokens (0 on turn 1)
    prev_stable_tokens: int  # that denominator (0 on turn 1)
    # the common prefix (before the provider's 128-token step) / the same stable tokens
    prefix_coverage: float
    # cached / the previous turn's directive + safety + history (the stable part less
    # the tools: what the seed order, whose tools follow the memories, can reach)
    coverage_without_tools: float
    # The previous turn's stable tokens the cache does not serve, in two parts: those
    # the assembly left out of the common prefix (the order's share; in the cache order
    # only the history's closing line, which the next turn's new messages precede), and
    # those of the common prefix the provider's rule leaves out (1,024-token minimum,
    # 128-token step: 0-127 once past the minimum; the provider's share).
    left_by_order: int
    left_by_step: int
    memories: int
    per_element_nonce_tokens: int  # what a nonce on every memory element would add


def _without_tools(result: AssemblyResult) -> int:
    # directive_tokens includes the safety sentence whenever it was emitted.
    return result.directive_tokens + result.history_tokens


def _stable_tokens(result: AssemblyResult) -> int:
    return _without_tools(result) + result.tool_tokens


def _covered(cached: int, stable: int) -> float:
    return min(cached, stable) / stable if stable else 0.0


def _element_nonce_cost(result: AssemblyResult, nonce: str, count: Callable[[str], int]) -> int:
    """Tokens a nonce attribute on each emitted memory element would add to this answer."""
    extra = 0
    for m in result.memories_used:
        tail = f' id="{m.memory_id}" category="{m.category}">\n'
        extra += count(f'<memory nonce="{nonce}"{tail}') - count(f"<memory{tail}")
    return extra


async def replay_conversation(
    workers: Sequence[Assembler],
    tokenizers: Tokenizers,
    seed: int,
    turns: int = TURNS,
    session_id: str | None = None,
) -> tuple[list[Turn], list[str]]:
    """One conversation through `workers` in round robin: per-turn facts and the contexts."""
    rng = random.Random(seed)
    enc = tokenizers.encoding(ENCODING)
    history: list[Message] = []
    out: list[Turn] = []
    texts: list[str] = []
    prev_tokens: list[int] = []
    prev: AssemblyResult | None = None
    session = session_id if session_id is not None else f"session-{seed}"
    topic = rng.choice(TOPICS)
    for t in range(turns):
        query = f"Turn {t + 1}: about {topic}, {rng.choice(SENTENCES).lower()} What now?"
        request = AssemblyRequest(
            agent_id=AGENT,
            org_id=ORG,
            query=query,
            model=MODEL,
            session_id=session,
            recent_messages=tuple(history),
            tool_schemas=TOOLS,
        )
        worker = workers[t % len(workers)]
        result = await worker.assemble(request)
        text = result.assembled_context
        tokens = enc.encode_ordinary(text)
        assert len(tokens) == result.tokens_used  # the reported count is the provider's
        common = common_prefix(prev_tokens, tokens) if t else 0
        cached = cached_tokens(common)
        stable_prev = _stable_tokens(prev) if prev else 0
        shared = min(common, stable_prev)
        nonce_match = text[len('<directive nonce="') :].split('"', 1)[0]
        out.append(
            Turn(
                turn=t + 1,
                context_tokens=len(tokens),
                stable_tokens=_stable_tokens(result),
                common_prefix_tokens=common,
                cached_tokens=cached,
                coverage=_covered(cached, _stable_tokens(prev)) if prev else 0.0,
                prev_stable_tokens=stable_prev,
                prefix_coverage=_covered(common, _stable_tokens(prev)) if prev else 0.0,
                coverage_without_tools=_covered(cached, _without_tools(prev)) if prev else 0.0,
                left_by_order=stable_prev - shared,
                left_by_step=shared - min(cached, shared),
                memories=result.memories_included,
                per_element_nonce_tokens=_element_nonce_cost(
                    result, nonce_match, lambda s: len(enc.encode_ordinary(s))
                ),
            )
        )
        texts.append(text)
        prev_tokens, prev = tokens, result
        history += [
            Message("user", query),
            Message("assistant", _prose(rng, rng.randint(3, 12))),
        ]
    return out, texts


WALL_CLOCK = 1_800_000_000.0  # a Unix time


def workers(
    catalog: Catalog,
    tokenizers: Tokenizers,
    source: StandIn,
    key: str | None,
    order: SectionOrder = "seed",
) -> list[Assembler]:
    """Two assemblers, as two replicas of the daemon, with the same nonce key (or none)
    and section order."""
    nonce_key = NonceKey(key) if key else None
    pipeline = PipelineConfig(section_order=order)
    return [
        Assembler(
            catalog=catalog,
            tokenizers=tokenizers,
            directive_source=source,
            memory_source=source,
            retrieval=RETRIEVAL,
            pipeline=pipeline,
            nonce_key=nonce_key,
            # One instant for every turn: a conversation inside one nonce lifetime window
            # (a rotation costs one cold prefix per IBEX_CONTEXT_NONCE_MAX_AGE, not measured).
            wall_clock=lambda: WALL_CLOCK,
            backend=f"bench-worker-{i}",
        )
        for i in range(2)
    ]


def summarise(runs: list[list[Turn]], price_input: float, price_cached: float) -> dict[str, object]:
    later = [t for run in runs for t in run if t.turn >= 2]
    every = [t for run in runs for t in run]
    total = sum(t.context_tokens for t in every)
    cached = sum(t.cached_tokens for t in every)
    cost_without = total * price_input / 1e6
    cost_with = ((total - cached) * price_input + cached * price_cached) / 1e6
    by_turn = []
    for n in range(1, max(t.turn for t in every) + 1):
        at = [t for t in every if t.turn == n]
        by_turn.append(
            {
                "turn": n,
                "context_tokens": round(statistics.mean(t.context_tokens for t in at)),
                "cached_tokens": round(statistics.mean(t.cached_tokens for t in at)),
                "cached_share": round(
                    sum(t.cached_tokens for t in at) / sum(t.context_tokens for t in at), 4
                ),
                "coverage_min": round(min(t.coverage for t in at), 4),
                "coverage_without_tools_min": round(min(t.coverage_without_tools for t in at), 4),
                "left_by_order_max": max(t.left_by_order for t in at),
                "left_by_step_max": max(t.left_by_step for t in at),
            }
        )
    return {
        "turns": len(every),
        "context_tokens": total,
        "cached_tokens": cached,
        "cached_share": round(cached / total, 4) if total else 0.0,
        "cached_share_from_turn_2": round(
            sum(t.cached_tokens for t in later) / sum(t.context_tokens for t in later), 4
        )
        if later
        else 0.0,
        "coverage_min_from_turn_2": round(min((t.coverage for t in later), default=0.0), 4),
        "coverage_mean_from_turn_2": round(statistics.mean(t.coverage for t in later), 4)
        if later
        else 0.0,
        # Every previous stable token of turns 2+ together: the share the provider serves.
        "coverage_all_from_turn_2": round(
            sum(min(t.cached_tokens, t.prev_stable_tokens) for t in later)
            / sum(t.prev_stable_tokens for t in later),
            4,
        )
        if later
        else 0.0,
        "prefix_coverage_min_from_turn_2": round(
            min((t.prefix_coverage for t in later), default=0.0), 4
        ),
        "coverage_without_tools_min_from_turn_2": round(
            min((t.coverage_without_tools for t in later), default=0.0), 4
        ),
        "coverage_without_tools_mean_from_turn_2": round(
            statistics.mean(t.coverage_without_tools for t in later), 4
        )
        if later
        else 0.0,
        "left_by_order_max_from_turn_2": max((t.left_by_order for t in later), default=0),
        "left_by_step_max_from_turn_2": max((t.left_by_step for t in later), default=0),
        "left_by_step_mean_from_turn_2": round(statistics.mean(t.left_by_step for t in later), 1)
        if later
        else 0.0,
        # The smallest previous stable part whose coverage the step alone can put under
        # 95 %: (S - left_by_order - 127) / S < 0.95 for every S under this.
        "stable_tokens_needed_for_95_percent": step_bound_tokens(
            max((t.left_by_order for t in later), default=0), 0.95
        ),
        "cost_usd_without_cache": round(cost_without, 6),
        "cost_usd_with_cache": round(cost_with, 6),
        "saving": round(1 - cost_with / cost_without, 4) if cost_without else 0.0,
        "memories_per_answer": round(statistics.mean(t.memories for t in every), 1),
        "per_element_nonce_tokens_per_answer": round(
            statistics.mean(t.per_element_nonce_tokens for t in every), 1
        ),
        "by_turn": by_turn,
    }


async def run(
    conversations: int, turns: int, key: str | None, order: SectionOrder = "seed"
) -> list[list[Turn]]:
    catalog = load_catalog()
    tokenizers = Tokenizers(None, 65536)
    tokenizers.preload([ENCODING])
    runs = []
    for c in range(conversations):
        source = StandIn(seed=1000 + c)
        pool = workers(catalog, tokenizers, source, key, order)
        turns_out, _ = await replay_conversation(pool, tokenizers, seed=c, turns=turns)
        runs.append(turns_out)
    return runs


def _print(name: str, s: dict[str, object]) -> None:
    print(f"\n### {name}")
    print(
        "turn  context  cached  cached%  coverage(min)  without tools(min)"
        "  left by order(max)  left by step(max)"
    )
    for row in s["by_turn"]:  # type: ignore[attr-defined]
        print(
            f"{row['turn']:>4}  {row['context_tokens']:>7}  {row['cached_tokens']:>6}  "
            f"{100 * row['cached_share']:>6.1f}%  {100 * row['coverage_min']:>12.1f}%  "
            f"{100 * row['coverage_without_tools_min']:>17.1f}%  "
            f"{row['left_by_order_max']:>18}  {row['left_by_step_max']:>17}"
        )
    keys = [k for k in s if k != "by_turn"]
    for k in keys:
        print(f"{k}: {s[k]}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--conversations", type=int, default=CONVERSATIONS)
    parser.add_argument("--turns", type=int, default=TURNS)
    parser.add_argument("--price-input", type=float, default=PRICE_INPUT, help="USD per M")
    parser.add_argument("--price-cached", type=float, default=PRICE_CACHED, help="USD per M")
    parser.add_argument("--no-figures", action="store_true", help="do not update figures.json")
    args = parser.parse_args(argv)
    out: dict[str, object] = {
        "model": MODEL,
        "encoding": ENCODING,
        "conversations": args.conversations,
        "turns_per_conversation": args.turns,
        "workers": 2,
        "cache_rule": f"0 below {CACHE_MIN_TOKENS} tokens, else floor to {CACHE_STEP_TOKENS}",
        "price_usd_per_million": {"input": args.price_input, "cached_input": args.price_cached},
    }
    # session_nonce: the seed order (the default), kept under its name; then the cache order.
    cases: list[tuple[str, str | None, SectionOrder]] = [
        ("session_nonce", BENCH_KEY, "seed"),
        ("session_nonce_cache_order", BENCH_KEY, "cache"),
        ("random_nonce", None, "seed"),
    ]
    assert {order for _, _, order in cases} == set(SECTION_ORDERS)
    for name, key, order in cases:
        runs = trio.run(run, args.conversations, args.turns, key, order)
        summary = {"section_order": order, **summarise(runs, args.price_input, args.price_cached)}
        title = f"IBEX_CONTEXT_NONCE_KEY {'set' if key else 'unset'}, SECTION_ORDER={order}"
        _print(f"{name} ({title})", summary)
        out[name] = summary
    seed, cache = out["session_nonce"], out["session_nonce_cache_order"]
    # Of the previous turn's directive, tools, safety and history; target for cache: 0.95.
    out["cache_versus_seed"] = {
        k: {"seed": seed[k], "cache": cache[k]}  # type: ignore[index]
        for k in (
            "coverage_min_from_turn_2",
            "coverage_mean_from_turn_2",
            "coverage_all_from_turn_2",
            "prefix_coverage_min_from_turn_2",
            "left_by_order_max_from_turn_2",
            "left_by_step_max_from_turn_2",
            "cached_share",
            "cost_usd_with_cache",
        )
    }
    print(f"\ncache versus seed: {json.dumps(out['cache_versus_seed'])}")
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(out, indent=1) + "\n")
    print(f"\nwrote {RESULTS}")
    if not args.no_figures:
        command = "python -m benchmarks.cache_prefix" + "".join(f" {a}" for a in argv or [])
        # Token counts: no machine speed to record.
        path = figures.record("cache_prefix", command, {}, figures_of(out))
        print(f"recorded in {path}")
    return 0


def figures_of(out: Mapping[str, Any]) -> list[figures.Figure]:
    """The cache order's coverage and cost, the seed order's beside them."""
    seed, cache = out["session_nonce"], out["session_nonce_cache_order"]
    n = f"{out['conversations']} x {out['turns_per_conversation']} turns"
    # (key, label, field, unit, scale: 100 for a share as %, 1 else, None: no seed figure)
    rows = (
        ("coverage_min", f"cache order: min coverage of the previous turn's stable part, "
         f"turns 2+ ({n}; seed beside)", "coverage_min_from_turn_2", "%", 100),
        ("coverage_mean", "cache order: mean coverage of it, turns 2+ (seed beside)",
         "coverage_mean_from_turn_2", "%", 100),
        ("coverage_all", "cache order: coverage of the previous turns' stable tokens all "
         "together, turns 2+ (seed beside)", "coverage_all_from_turn_2", "%", 100),
        ("left_by_order_max", "cache order: stable tokens the assembly leaves out of the "
         "prefix, max (seed beside)", "left_by_order_max_from_turn_2", "tokens", 1),
        ("stable_needed", "stable tokens from which the 128-token step keeps every turn "
         ">= 95 %", "stable_tokens_needed_for_95_percent", "tokens", None),
        ("cost", f"cache order: input cost of the {n} contexts, USD (seed beside)",
         "cost_usd_with_cache", "USD", 1),
    )  # fmt: skip

    def value(run: Mapping[str, Any], field: str, scale: int | None) -> float:
        return round((scale or 1) * run[field], 1 if scale == 100 else 2)

    return [
        figures.Figure(
            f"cache_prefix.{key}",
            label,
            value(cache, field, scale),
            unit,
            "cache_prefix",
            None if scale is None else value(seed, field, scale),
        )
        for key, label, field, unit, scale in rows
    ]


if __name__ == "__main__":
    raise SystemExit(main())
