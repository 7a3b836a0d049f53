"""Counts before objects: a request's repeated fields counted on the wire, before decoding.

Decoding a request materialises every element of every repeated field: a
4 MiB AssembleContext of about two million empty `recent_messages` took upb a
quarter of a second and the conversion to Python objects seconds more, all on
the serving loop, before the count check refused it. This module walks the
protobuf wire format of the request's bytes first (tags, varints,
length-delimited skips; no object per field) and refuses, INVALID_ARGUMENT
naming the field and its limit, a repeated field with more elements than its
bound. It stops at the first field past a bound, so a refused request costs
the scan of at most that many fields.

Nested messages hold fields too (a single `recent_messages` element or a
`principal_context` can carry millions of repeated or unknown fields, each
decoded by upb), so the walk goes into every message-typed field the
descriptor knows, and the whole request may hold at most `Rules.max_fields`
fields: what the largest valid request holds (every repeated field at its
bound, every singular field once) plus `UNKNOWN_SLACK` per message for fields
a newer peer adds. The contents of unknown length-delimited fields are
skipped as bytes, as upb keeps them.

What the walk accepts is what upb accepts (tests/unit/test_wire_counts.py
checks it against the real decoder with hypothesis): a request it calls
malformed is one upb refuses too, and is answered as a decoding failure is.
"""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Final

from google.protobuf.descriptor import Descriptor, FieldDescriptor

from ibex.errors import InputError, OverLimitError

#: Unknown fields a message may carry beyond its own (a newer peer's additions).
UNKNOWN_SLACK: Final = 4
_MALFORMED: Final = "not a valid protobuf message"
_LD: Final = 2  # wire type: length-delimited
_MAX_FIELD_NUMBER: Final = (1 << 29) - 1
#: What a group's fields are looked up in: neither bounds nor nested rules apply there.
_IN_A_GROUP: Final[Mapping[int, Any]] = MappingProxyType({})


class Bound:
    """One repeated field's bound: its path, its limit and the unit the refusal names."""

    __slots__ = ("limit", "path", "unit")

    def __init__(self, path: str, limit: int, unit: str) -> None:
        self.path = path
        self.limit = limit
        self.unit = unit

    def refuse(self) -> OverLimitError:
        return OverLimitError(self.path, f"more than {self.limit} {self.unit}")


class Rules:
    """How one message type is walked: the bound of each repeated field (by number), the
    rules of each message-typed field, and the fields the whole message may hold."""

    __slots__ = ("bounds", "max_fields", "nested")

    def __init__(self, bounds: dict[int, Bound], nested: dict[int, Rules], max_fields: int):
        self.bounds = bounds
        self.nested = nested
        self.max_fields = max_fields


def rules_for(descriptor: Descriptor, limits: Mapping[str, tuple[int, str]]) -> Rules:
    """The walk of `descriptor`'s messages, with `limits` for its repeated fields.

    `limits` maps a repeated field's path (`recent_messages`, `principal_context.x`)
    to (limit, unit). Every repeated field must have one: a request type that gains
    a repeated field fails here, at start-up, rather than go unbounded.
    """
    return _rules(descriptor, limits, "", 0)


def _rules(
    descriptor: Descriptor, limits: Mapping[str, tuple[int, str]], prefix: str, depth: int
) -> Rules:
    if depth > 8:
        raise ValueError(f"{descriptor.full_name}: messages nest too deep to bound")
    bounds: dict[int, Bound] = {}
    nested: dict[int, Rules] = {}
    max_fields = UNKNOWN_SLACK
    for field in descriptor.fields:
        path = prefix + field.name
        count = 1
        if _is_repeated(field):
            if path not in limits:
                raise ValueError(f"{descriptor.full_name}.{field.name}: repeated without a bound")
            count, unit = limits[path]
            bounds[field.number] = Bound(path, count, unit)
        elements = 1
        if field.type == FieldDescriptor.TYPE_MESSAGE:
            sub = _rules(field.message_type, limits, path + ".", depth + 1)
            nested[field.number] = sub
            elements += sub.max_fields
        max_fields += count * elements
    return Rules(bounds, nested, max_fields)


def _is_repeated(field: FieldDescriptor) -> bool:
    repeated = getattr(field, "is_repeated", None)
    if repeated is not None:
        return bool(repeated)
    return bool(field.label == FieldDescriptor.LABEL_REPEATED)


def check_counts(data: bytes, rules: Rules) -> None:
    """Refuse `data` if a repeated field holds more elements than its bound, the message
    more fields than `rules.max_fields`, or it is not protobuf (InputError)."""
    left = _walk(data, 0, len(data), rules, rules.max_fields, None)
    if left < 0:
        raise OverLimitError("request", f"more than {rules.max_fields} protobuf fields")


def count_repeated(data: bytes, rules: Rules) -> dict[str, int]:
    """The top-level repeated fields' element counts, bounds not applied (for tests)."""
    counts: dict[str, int] = {b.path: 0 for b in rules.bounds.values()}
    _walk(data, 0, len(data), rules, 1 << 62, counts)
    return counts


def _varint(data: bytes, pos: int, end: int) -> tuple[int, int]:
    """The varint at `pos` and the position after it; at most ten bytes, as upb reads."""
    value = 0
    shift = 0
    while pos < end:
        b = data[pos]
        pos += 1
        value |= (b & 0x7F) << shift
        if b < 0x80:
            return value, pos
        shift += 7
        if shift >= 70:
            break
    raise InputError("request", _MALFORMED)


def _walk(
    data: bytes, pos: int, end: int, rules: Rules, left: int, counts: dict[str, int] | None
) -> int:
    """Walk the fields in data[pos:end]; the field budget left after them (< 0: over).

    Stops as soon as the budget is spent or a bound is passed, so a hostile
    message costs at most a budget's worth of fields. A group (wire types 3 and
    4; no field of ours is one) holds an unknown field's value, which upb keeps
    as bytes: inside one, values are only skipped, each field still counts
    against the budget, and field number 0 is skipped like any other (upb
    refuses it only where a message's own fields are read).
    """
    bounds: Mapping[int, Bound] = rules.bounds
    nested: Mapping[int, Rules] = rules.nested
    seen: dict[int, int] = {}
    groups: list[int] = []  # the numbers of the open groups, innermost last
    while pos < end:
        tag = data[pos]
        if tag < 0x80:
            pos += 1
        else:
            tag, pos = _varint(data, pos, end)
        number, wire = tag >> 3, tag & 7
        if number > _MAX_FIELD_NUMBER or (number == 0 and not groups):
            raise InputError("request", _MALFORMED)
        left -= 1  # an end-group is given it back below: a field pays for no test of it
        if left < 0 and wire != 4:
            return left
        if wire == _LD:
            size = data[pos] if pos < end else 0x80
            if size < 0x80:
                pos += 1
            else:
                size, pos = _varint(data, pos, end)
            start, pos = pos, pos + size
            if pos > end:
                raise InputError("request", _MALFORMED)
            bound = bounds.get(number)
            if bound is not None:
                n = seen[number] = seen.get(number, 0) + 1
                if counts is not None:
                    counts[bound.path] = n
                elif n > bound.limit:
                    raise bound.refuse()
            sub = nested.get(number)
            if sub is not None:
                left = _walk(data, start, pos, sub, left, None)
                if left < 0:
                    return left
        elif wire == 0:
            _, pos = _varint(data, pos, end)
        elif wire == 1:
            pos += 8
        elif wire == 5:
            pos += 4
        elif wire == 3:
            groups.append(number)
            bounds, nested = _IN_A_GROUP, _IN_A_GROUP  # its fields are no message's
        elif wire == 4:  # an end-group, no field: closes the innermost group, of its number
            left += 1
            if not groups or groups.pop() != number:
                raise InputError("request", _MALFORMED)
            if not groups:
                bounds, nested = rules.bounds, rules.nested
        else:  # wire type 6 or 7
            raise InputError("request", _MALFORMED)
    if pos != end or groups:
        raise InputError("request", _MALFORMED)
    return left


def request_rules(message_class: Any, limits: Mapping[str, tuple[int, str]]) -> Rules:
    """`rules_for` a generated message class (its DESCRIPTOR)."""
    return rules_for(message_class.DESCRIPTOR, limits)
