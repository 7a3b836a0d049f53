"""The context a client falls back to when the daemon cannot answer: the history alone.

It is cut as the daemon cuts history (oldest messages left out, the newest
kept) to the model's context ceiling counted in UTF-8 bytes, which no
byte-level BPE tokenizer's count exceeds, so the fallback is never larger than
the window. Pure: the catalog bundled with the package, no I/O past reading it.
"""

from __future__ import annotations

from collections.abc import Sequence

from ibex.assembly.budget import context_ceiling
from ibex.assembly.catalog import Catalog, load_catalog, resolve_model
from ibex.assembly.history import DeferredCache, Uncached, fit_history
from ibex.assembly.structs import Message
from ibex.assembly.xml_format import XML_TAGS

__all__ = ["Utf8ByteCounter", "fallback_history", "history_only"]


class Utf8ByteCounter(Uncached):
    """Counts UTF-8 bytes: never fewer than the tokens of a byte-level BPE tokenizer."""

    estimate_kind = "utf8_bytes"
    max_token_bytes = 0  # a prefix never has more bytes than the whole

    def count(self, text: str) -> int:
        return len(text.encode("utf-8", "surrogatepass"))

    count_uncached = count

    def additive_cut(self, text: str) -> int:
        return len(text)


def fallback_history(
    messages: Sequence[Message],
    *,
    model: str = "",
    available_tokens: int = 0,
    catalog: Catalog | None = None,
) -> tuple[str, int]:
    """The fallback context and how many of the oldest messages it leaves out.

    The history formatted as the daemon would (without a nonce: the daemon did
    not write it), keeping the newest messages that fit the model's context
    ceiling (window less response reserve and safety buffer, as the daemon
    computes it) with every character's UTF-8 bytes counted as tokens. A model
    the catalog does not know, without `available_tokens`, gets the smallest
    window the catalog lists (the daemon would have refused the request).
    """
    if not messages:
        return "", 0
    catalog = catalog or _bundled_catalog()
    if available_tokens <= 0 and catalog.resolve(model) is None:
        available_tokens = min(m.context_window for m in catalog.models.values())
    cap = resolve_model(catalog, model, available_tokens)
    ceiling = context_ceiling(cap, catalog.family(cap.tokenizer_family), available_tokens)
    counter = Utf8ByteCounter()
    fit = fit_history(counter, messages, "", ceiling, DeferredCache(counter, XML_TAGS))
    return "".join(XML_TAGS.history_section(fit.kept, "")), len(messages) - len(fit.kept)


def history_only(
    messages: Sequence[Message],
    *,
    model: str = "",
    available_tokens: int = 0,
    catalog: Catalog | None = None,
) -> str:
    """The fallback context alone (see `fallback_history`)."""
    return fallback_history(
        messages, model=model, available_tokens=available_tokens, catalog=catalog
    )[0]


_CATALOG: list[Catalog] = []


def _bundled_catalog() -> Catalog:
    if not _CATALOG:
        _CATALOG.append(load_catalog())
    return _CATALOG[0]
