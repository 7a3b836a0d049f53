"""The table of settings, derived from the declarations, and `load_settings`.

`TABLE` walks `Settings`' fields in order: a field declared with
`ibex.envvar.env` is one row (a setting of the process itself); a field
holding a layer config struct contributes a row for each of that struct's
declared fields. A row carries the variable's name, where its value lives,
its parser (`ibex.config.values.parser_for`), its default (the field's own,
written once beside the declaration) and whether it is secret. The parser,
the typo check, redaction, `ibex config` and the composition root all read
this table; nothing else lists the variables.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import msgspec

from ibex.config.checks import check_combinations
from ibex.config.settings import Settings
from ibex.config.values import MS, WITH_UNIT, Parse, parser_for
from ibex.envvar import PREFIX, Declared, declared

__all__ = ["DURATIONS", "LAYERS", "SECRETS", "TABLE", "Row", "load_settings", "replace_settings"]


class Row(msgspec.Struct, frozen=True):
    """One variable: `layer` names the `Settings` field holding the layer struct that
    declares it (None for a setting of the process itself), `field` the field it sets."""

    variable: str
    layer: str | None
    owner: type[msgspec.Struct]
    field: str
    parse: Parse
    default: Any
    secret: bool

    @property
    def suffix(self) -> str:
        """The variable's name after `IBEX_CONTEXT_`."""
        return self.variable.removeprefix(PREFIX)

    @property
    def keyword(self) -> str:
        """The name `replace_settings` takes: the suffix in lower case, a unit's `_ms` dropped."""
        return self.suffix.lower().removesuffix("_ms")

    @property
    def target(self) -> str:
        """`Struct.field`, where the declaration is written."""
        return f"{self.owner.__name__}.{self.field}"

    def value(self, settings: Settings) -> Any:
        """The value `settings` holds for this variable."""
        holder = getattr(settings, self.layer) if self.layer else settings
        return getattr(holder, self.field)


def _row(d: Declared, layer: str | None, owner: type[msgspec.Struct]) -> Row:
    return Row(d.variable, layer, owner, d.field, parser_for(d), d.default, d.secret)


def _layers() -> dict[str, type[msgspec.Struct]]:
    """`Settings` field -> the layer config struct it holds."""
    return {
        f.name: type(f.default)
        for f in msgspec.structs.fields(Settings)
        if isinstance(f.default, msgspec.Struct)
    }


#: `Settings` field -> the layer config struct it holds (each declares its variables).
LAYERS: Mapping[str, type[msgspec.Struct]] = _layers()


def _table() -> dict[str, Row]:
    own = {d.field: d for d in declared(Settings)}
    rows: list[Row] = []
    for field in Settings.__struct_fields__:
        if field in LAYERS:
            struct = LAYERS[field]
            rows += [_row(d, field, struct) for d in declared(struct)]
        elif field in own:
            rows.append(_row(own[field], None, Settings))
        else:
            raise TypeError(f"Settings.{field} declares no variable and holds no layer")
    table = {row.variable: row for row in rows}
    if len(table) != len(rows):
        raise TypeError("a variable is declared twice")
    return table


#: Variable (`IBEX_CONTEXT_...`) -> its row: the one table every reader of the settings uses.
TABLE: Mapping[str, Row] = _table()
SECRETS = frozenset(name for name, row in TABLE.items() if row.secret)
#: The duration settings (values in seconds, shown with a unit by `ibex config`).
DURATIONS = frozenset(name for name, row in TABLE.items() if row.parse in (MS, WITH_UNIT))


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """Build Settings from the environment, raising ConfigError on the first bad value.

    Each variable of the table is parsed by its row's parser (an empty value
    counts as unset, so the field's default applies); combinations are checked
    afterwards.
    """
    env = os.environ if env is None else env
    own: dict[str, Any] = {}
    layers: dict[str, dict[str, Any]] = {name: {} for name in LAYERS}
    for name, row in TABLE.items():
        raw = env.get(name)
        if raw is not None and raw.strip() != "":
            (layers[row.layer] if row.layer else own)[row.field] = row.parse(name, raw)
    check_combinations(own)
    built: dict[str, Any] = {name: LAYERS[name](**values) for name, values in layers.items()}
    settings = Settings(**own, **built)
    settings.check_worker_ports()
    return settings


def replace_settings(settings: Settings, **values: Any) -> Settings:
    """`settings` with some values replaced, for code that builds settings without an
    environment (tests, benchmarks): each is named by its row's `keyword`
    (`hot_timeout=0.01`, `request_read_timeout=0.3`) or is a whole `Settings` field.
    Values are typed, not parsed, and no combination is checked."""
    rows = {row.keyword: row for row in TABLE.values()}
    own: dict[str, Any] = {}
    layers: dict[str, dict[str, Any]] = {}
    for key, value in values.items():
        row = rows.get(key)
        if row is None and key in Settings.__struct_fields__:
            own[key] = value
        elif row is None:
            raise TypeError(f"no setting is named {key!r}")
        elif row.layer is None:
            own[row.field] = value
        else:
            layers.setdefault(row.layer, {})[row.field] = value
    for layer, changes in layers.items():
        own[layer] = msgspec.structs.replace(own.get(layer, getattr(settings, layer)), **changes)
    return msgspec.structs.replace(settings, **own)
