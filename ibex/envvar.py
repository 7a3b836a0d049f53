"""An `IBEX_CONTEXT_*` variable declared on the config field it sets, beside its default.

A layer's config struct (`RetrievalConfig`, `AdmissionConfig`, ...) annotates
each field an operator may set with `env(...)`:

    cold_timeout: Annotated[float, env("IBEX_CONTEXT_COLD_TIMEOUT_MS", unit="ms")] = 0.045

The declaration is plain data in `msgspec.Meta.extra` (the variable's name, the
duration unit, the bounds, whether the value is secret), so the pure core can
carry it without importing `ibex.config`; `ibex.config` walks the structs'
fields to build the settings table, the parser, the typo check and
`ibex config` from these declarations and the fields' own defaults.

The bounds live in `extra`, not in `msgspec.Meta(ge=..., le=...)`: msgspec
refuses numeric constraints on an optional type (`float | None`), and a few
settings are optional numbers.
"""

from __future__ import annotations

import typing
from collections.abc import Callable
from typing import Any, Literal

import msgspec

__all__ = ["PREFIX", "Declared", "Unit", "declared", "env"]

PREFIX = "IBEX_CONTEXT_"

#: A duration's unit: `ms`, a bare number is milliseconds; `s`, the setting is documented
#: in seconds and a bare number is refused (`45` would otherwise mean 45 ms to one reader
#: and 45 s to another).
Unit = Literal["ms", "s"]


def env(
    name: str,
    *,
    unit: Unit | None = None,
    bounds: tuple[float, float] | None = None,
    secret: bool = False,
    parse: Callable[[str, str], Any] | None = None,
) -> msgspec.Meta:
    """The declaration of variable `name` on the annotated field.

    `unit` makes the field a duration (seconds in the struct); `bounds` is the
    closed range a number must fall in; `parse` (for the settings module's own
    fields) replaces the parser derived from the field's type.
    """
    if not name.startswith(PREFIX):
        raise ValueError(f"{name}: a setting's name starts with {PREFIX}")
    return msgspec.Meta(
        extra={"env": name, "unit": unit, "bounds": bounds, "secret": secret, "parse": parse}
    )


class Declared(msgspec.Struct, frozen=True):
    """One declared field: the variable, the field's type (without the annotation) and
    default, and the declaration's data."""

    variable: str
    field: str
    type: Any
    default: Any
    unit: Unit | None
    bounds: tuple[float, float] | None
    secret: bool
    parse: Callable[[str, str], Any] | None


def declared(struct: type[msgspec.Struct]) -> list[Declared]:
    """The fields of `struct` that declare a variable, in field order.

    TypeError when a declared field has no default: a setting left unset must
    have a value, written once, beside its name.
    """
    hints = typing.get_type_hints(struct, include_extras=True)
    out: list[Declared] = []
    for field in msgspec.structs.fields(struct):
        hint = hints[field.name]
        metas = [
            m
            for m in getattr(hint, "__metadata__", ())
            if isinstance(m, msgspec.Meta) and m.extra and "env" in m.extra
        ]
        if not metas:
            continue
        if len(metas) > 1:
            raise TypeError(f"{struct.__name__}.{field.name} declares two variables")
        if field.default is msgspec.NODEFAULT:
            raise TypeError(f"{struct.__name__}.{field.name} declares a variable but no default")
        extra: dict[str, Any] = metas[0].extra or {}
        out.append(
            Declared(
                variable=extra["env"],
                field=field.name,
                type=hint.__origin__,
                default=field.default,
                unit=extra["unit"],
                bounds=extra["bounds"],
                secret=extra["secret"],
                parse=extra["parse"],
            )
        )
    return out
