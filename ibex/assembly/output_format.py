"""The output-format seam: one object decides how the context block is written and priced.

A format writes the block as *pieces* (tag lines and escaped bodies) in this
shape, each section only when it has something to hold::

    directive_open(directive, nonce)  body  directive_close
    safety_piece(nonce)                                        (only with memories)
    history_open(nonce)   { message_open(role)  body  message_close } ...  history_close
    memories_open(nonce)  { memory_open_prefix + memory_open_suffix(m)  body  memory_close } ...
                          memories_close
    tools_open(nonce)     { tool_open  body  tool_close } ...  tools_close

That is the `seed` section order (`SectionOrder`). The `cache` order writes
the same sections with what changes least first, so a model provider's prompt
cache can serve the longest prefix turn after turn: directive, tools, safety
piece, history, memories. In it the safety piece is written whenever any other
section is (not only with memories), so whether this turn recalled memories
cannot change the bytes in front of the history (`safety_emitted`).

The pipeline (ibex.assembly.pipeline) and the history fit (ibex.assembly.history)
price exactly those pieces, counting each once (counts are cached by text), and
render with `render_pieces`; nothing else about the layout is known outside the
format. The format's join rule, `counts_add_up`, says whether the block's count
is the sum of its pieces' counts. When it says no, the pipeline re-counts the
whole text (and drops the lowest-value memory while it is over the ceiling), so
`tokens_used` is the text's count and within the ceiling for every format; a
format whose joins always add up only saves that re-count.

What a format must hold for the pricing to be right (a subclass that breaks one
of these gets wrong sizes, never an answer over the ceiling, but may leave out
history or memories that would have fit):

- `escape_body` maps a prefix of a text to a prefix of the text's escaped body
  (history proves a long message too long from a prefix of it), and a body
  piece starts with the escaped body;
- a piece carrying the nonce has a non-digit on both sides of it, so a decimal
  nonce costs what zeros of its width cost (see history.DeferredCache.with_nonce);
- a memory's opening piece is `memory_open_prefix + memory_open_suffix(m)`,
  priced as two parts: when `counts_add_up` can say yes, that join must be a
  split point of the tokeniser too.

`ibex.assembly.xml_format.XmlTagFormat` is the default (`PipelineConfig.format`).
A new format subclasses `Format` and gives the pieces, the body escaper and the
join rule; the body cache, the sections and `render_pieces` come from here.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable, Sequence
from typing import Literal, NotRequired, TypedDict, Unpack, get_args

from ibex.assembly.lru import ByteLRU, LRUInfo
from ibex.assembly.structs import Directive, Message, ScoredMemory

#: The order sections are written in: `seed` is the design's fixed order (directive,
#: safety, history, memories, tools); `cache` puts what changes least first
#: (directive, tools, safety, history, memories).
SectionOrder = Literal["seed", "cache"]
SECTION_ORDERS: tuple[SectionOrder, ...] = get_args(SectionOrder)


class BlockInputs(TypedDict):
    """What one block is written from: the keyword arguments of `Format.render_pieces`
    and `Format.render`."""

    directive: Directive | None
    messages: Sequence[Message]
    memories: Sequence[ScoredMemory]
    tool_schemas: Sequence[str]
    nonce: str
    order: NotRequired[SectionOrder]  # "seed" when left out


BODY_CACHE_MAX_CHARS = 4096
#: What one format's escaped-body cache may keep alive (keys and values, see ibex.assembly.lru).
BODY_CACHE_BYTES = 16 * 1024 * 1024


class Format(ABC):
    """Section pieces, the body escaper and the join rule of one output format."""

    directive_close: str
    history_close: str
    message_close: str
    memories_close: str
    memory_open_prefix: str
    memory_close: str
    tools_close: str
    tool_open: str
    tool_close: str

    def __init__(self, body_cache_bytes: int = BODY_CACHE_BYTES) -> None:
        self._bodies: ByteLRU[str, str] = ByteLRU(body_cache_bytes)

    # --- what a format defines ------------------------------------------------

    @abstractmethod
    def directive_open(self, directive: Directive, nonce: str) -> str: ...

    @abstractmethod
    def safety_piece(self, nonce: str) -> str:
        """What the nonce means; emitted whenever memories are (see `safety_emitted`)."""

    @abstractmethod
    def history_open(self, nonce: str) -> str:
        """An empty nonce is the client's fallback history, which the daemon did not write."""

    @abstractmethod
    def message_open(self, role: str) -> str: ...

    @abstractmethod
    def memories_open(self, nonce: str) -> str: ...

    @abstractmethod
    def memory_open_suffix(self, memory: ScoredMemory) -> str: ...

    @abstractmethod
    def tools_open(self, nonce: str) -> str: ...

    @abstractmethod
    def escape_body(self, text: str) -> str:
        """The body as data: it can neither open nor close a section of this format."""

    @abstractmethod
    def counts_add_up(self, pieces: Sequence[str]) -> bool:
        """True when the joined pieces' count is the sum of their counts (no re-count)."""

    def memory_order(self, memories: Iterable[ScoredMemory]) -> list[ScoredMemory]:
        """The order memories are emitted in; here the packer's (best score first)."""
        return list(memories)

    # --- bodies -----------------------------------------------------------------

    def body_piece_uncached(self, text: str) -> str:
        """The escaped body plus its line end; empty text gives an empty piece."""
        escaped = self.escape_body(text)
        return escaped + "\n" if escaped else ""

    def body_piece(self, text: str) -> str:
        """`body_piece_uncached`, memoised for texts up to BODY_CACHE_MAX_CHARS.

        The same hot memories, directives and history turns come back request
        after request: each is escaped once, not on every answer.
        """
        if len(text) > BODY_CACHE_MAX_CHARS:
            return self.body_piece_uncached(text)
        piece = self._bodies.get(text)
        if piece is None:
            piece = self.body_piece_uncached(text)
            self._bodies.put(text, piece)
        return piece

    def cached_body_piece(self, text: str) -> str | None:
        """The cached piece for `text`, or None; nothing is computed or stored."""
        if len(text) > BODY_CACHE_MAX_CHARS:
            return None
        return self._bodies.get(text)

    def remember_body_pieces(self, pieces: Iterable[tuple[str, str]]) -> None:
        """Cache (text, piece) pairs computed uncached, once they are known to be emitted."""
        self._bodies.put_many((t, p) for t, p in pieces if len(t) <= BODY_CACHE_MAX_CHARS)

    def body_cache_info(self) -> LRUInfo:
        return self._bodies.info()

    # --- sections and the whole block --------------------------------------------

    def memory_open(self, memory: ScoredMemory) -> str:
        return self.memory_open_prefix + self.memory_open_suffix(memory)

    def directive_section(self, directive: Directive | None, nonce: str) -> list[str]:
        if directive is None:
            return []
        body = self.body_piece(directive.content)
        if not body:
            return []
        return [self.directive_open(directive, nonce), body, self.directive_close]

    def history_section(self, messages: Sequence[Message], nonce: str) -> list[str]:
        if not messages:
            return []
        message_open = self.message_open
        items = [(message_open(m.role), m.content) for m in messages]
        return self._section(
            self.history_open(nonce), items, self.message_close, self.history_close
        )

    def memory_block(self, memory: ScoredMemory) -> list[str]:
        return [self.memory_open(memory), self.body_piece(memory.content), self.memory_close]

    def memories_section(self, nonce: str, ordered: Sequence[ScoredMemory]) -> list[str]:
        if not ordered:
            return []
        prefix, suffix = self.memory_open_prefix, self.memory_open_suffix
        items = [(prefix + suffix(m), m.content) for m in ordered]
        return self._section(
            self.memories_open(nonce), items, self.memory_close, self.memories_close
        )

    def tools_section(self, schemas: Sequence[str], nonce: str) -> list[str]:
        if not schemas:
            return []
        items = [(self.tool_open, schema) for schema in schemas]
        return self._section(self.tools_open(nonce), items, self.tool_close, self.tools_close)

    def _section(
        self, opening: str, items: list[tuple[str, str]], close: str, closing: str
    ) -> list[str]:
        """`opening`; each item, (its opening piece, its text), as that piece, the text's
        body piece and `close`; then `closing`.

        The sections hand their items over as a list of pairs built by a comprehension:
        map and zip over the section's own objects call its Python functions from C, which
        costs more than the comprehension's calls do.
        """
        out = [opening]
        body_piece = self.body_piece
        for item_open, text in items:
            out += (item_open, body_piece(text), close)
        out.append(closing)
        return out

    def render_pieces(self, **block: Unpack[BlockInputs]) -> list[str]:
        """The block's pieces in its `order`; `render` joins them."""
        nonce = block["nonce"]
        ordered = self.memory_order(block["memories"])
        order = block.get("order", "seed")
        if order == "seed":
            pieces = self.directive_section(block["directive"], nonce)
            if ordered:
                pieces.append(self.safety_piece(nonce))
            pieces += self.history_section(block["messages"], nonce)
            pieces += self.memories_section(nonce, ordered)
            pieces += self.tools_section(block["tool_schemas"], nonce)
            return pieces
        if order != "cache":
            raise ValueError(f"unknown section order {order!r}")
        pieces = self.directive_section(block["directive"], nonce)
        pieces += self.tools_section(block["tool_schemas"], nonce)
        history = self.history_section(block["messages"], nonce)
        if safety_emitted(order, memories=bool(ordered), others=bool(pieces or history)):
            pieces.append(self.safety_piece(nonce))
        pieces += history
        pieces += self.memories_section(nonce, ordered)
        return pieces

    def render(self, **block: Unpack[BlockInputs]) -> str:
        """The whole context block: `render_pieces` joined.

        Byte-identical for identical inputs, nonce and order. The safety piece
        appears whenever memories do, so the model is always told what the
        nonce means (`safety_emitted`).
        """
        return "".join(self.render_pieces(**block))


def safety_emitted(order: SectionOrder, *, memories: bool, others: bool) -> bool:
    """Whether the block carries the safety piece.

    With memories always. In the `cache` order also whenever any other section
    (directive, tools, history) is written: the piece sits in front of the
    history, and a piece that came and went with the memories would change
    the prefix a provider caches on the turns without them.
    """
    return memories or (order == "cache" and others)
