"""Model capability catalog: window, output cap and tokenizer family per model.

Shipped as package data; an operator file (IBEX_CONTEXT_CATALOG_PATH) adds or
overrides families and models and is validated at start-up, so a typo stops
the daemon instead of silently mis-budgeting every request.
"""

from __future__ import annotations

import importlib.resources
from pathlib import Path

import msgspec

from ibex.errors import ConfigFileError, InputError

#: Encodings the project can count exactly, offline.
EXACT_ENCODINGS = frozenset({"cl100k_base", "o200k_base"})
UNKNOWN_FAMILY = "unknown"

#: estimate_v1's worst measured undercount against exact OpenAI counts
#: (`python -m benchmarks.token_estimate`, see ibex.assembly.tokens). A family
#: counted by the estimate with a smaller safety buffer could overflow the window.
ESTIMATE_WORST_UNDERCOUNT = 0.043


class CatalogError(ConfigFileError):
    """The catalog file is malformed; the message names the file and entry."""


class FamilyPolicy(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    """How a tokenizer family is counted and how much margin it needs."""

    safety_buffer_fraction: float
    encoding: str | None = None
    name: str = ""


class ModelCapability(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    provider: str
    context_window: int
    max_output_tokens: int
    tokenizer_family: str
    model_id: str = ""


class _CatalogFile(msgspec.Struct, frozen=True, forbid_unknown_fields=True):
    families: dict[str, FamilyPolicy] = {}
    models: dict[str, ModelCapability] = {}


class Catalog:
    """Resolves model ids (dated snapshots by longest known prefix) to capabilities."""

    def __init__(
        self, families: dict[str, FamilyPolicy], models: dict[str, ModelCapability]
    ) -> None:
        self.families = {k: msgspec.structs.replace(v, name=k) for k, v in families.items()}
        self.models = {k: msgspec.structs.replace(v, model_id=k) for k, v in models.items()}
        self._by_length = sorted(self.models, key=len, reverse=True)
        self._resolved: dict[str, ModelCapability | None] = {}
        self._validate()
        self.known_models = _name_list(sorted(self.models))

    def _validate(self) -> None:
        if UNKNOWN_FAMILY not in self.families:
            raise CatalogError(f"catalog: family {UNKNOWN_FAMILY!r} is required")
        for name, fam in self.families.items():
            if not 0.0 <= fam.safety_buffer_fraction < 0.5:
                raise CatalogError(
                    f"catalog: family {name!r}: safety_buffer_fraction not in [0, 0.5)"
                )
            if fam.encoding is None and fam.safety_buffer_fraction < ESTIMATE_WORST_UNDERCOUNT:
                raise CatalogError(
                    f"catalog: family {name!r} is counted by the estimate (no encoding), so "
                    f"its safety_buffer_fraction {fam.safety_buffer_fraction} must be at least "
                    f"{ESTIMATE_WORST_UNDERCOUNT}, the estimate's worst measured undercount"
                )
            if fam.encoding is not None and fam.encoding not in EXACT_ENCODINGS:
                raise CatalogError(
                    f"catalog: family {name!r}: encoding {fam.encoding!r} is not one of "
                    f"{sorted(EXACT_ENCODINGS)}"
                )
        for model_id, cap in self.models.items():
            where = f"catalog: model {model_id!r}"
            if not model_id or model_id != model_id.strip():
                raise CatalogError(f"{where}: id must be non-empty without surrounding spaces")
            if cap.context_window <= 0 or cap.max_output_tokens <= 0:
                raise CatalogError(f"{where}: context_window and max_output_tokens must be > 0")
            if cap.tokenizer_family not in self.families:
                raise CatalogError(f"{where}: unknown tokenizer_family {cap.tokenizer_family!r}")

    def resolve(self, model: str) -> ModelCapability | None:
        """Exact id, else the longest known id that prefixes it (gpt-4o-2024-08-06 -> gpt-4o)."""
        if model in self._resolved:
            return self._resolved[model]
        found = self.models.get(model)
        if found is None:
            for known in self._by_length:
                if model.startswith(known) and model[len(known) : len(known) + 1] in (
                    "-",
                    "@",
                    ":",
                ):
                    found = self.models[known]
                    break
        if len(self._resolved) < 4096:
            self._resolved[model] = found
        return found

    def family(self, name: str) -> FamilyPolicy:
        return self.families[name]

    def encodings(self) -> set[str]:
        return {f.encoding for f in self.families.values() if f.encoding is not None}


def _decode(data: bytes, where: str) -> _CatalogFile:
    try:
        return msgspec.json.decode(data, type=_CatalogFile)
    except msgspec.ValidationError as exc:
        raise CatalogError(f"{where}: {exc}") from None
    except msgspec.DecodeError as exc:
        raise CatalogError(f"{where}: not valid JSON ({exc})") from None


def load_catalog(path: str | None = None) -> Catalog:
    """The bundled catalog, overlaid with the operator's file when given."""
    bundled = importlib.resources.files("ibex").joinpath("data/catalog.json").read_bytes()
    base = _decode(bundled, "bundled catalog")
    families = dict(base.families)
    models = dict(base.models)
    if path is not None:
        try:
            data = Path(path).read_bytes()
        except OSError as exc:
            raise CatalogError(
                f"IBEX_CONTEXT_CATALOG_PATH: cannot read {path!r}: {exc.strerror}"
            ) from None
        extra = _decode(data, f"IBEX_CONTEXT_CATALOG_PATH {path!r}")
        families.update(extra.families)
        models.update(extra.models)
    return Catalog(families, models)


#: max_output_tokens of a model the catalog does not know (sized by available_tokens).
UNKNOWN_MODEL_MAX_OUTPUT = 4096
#: How many model ids an unknown model's error names (an operator file may add hundreds).
KNOWN_MODELS_LISTED = 20


def _name_list(names: list[str]) -> str:
    """Up to KNOWN_MODELS_LISTED ids, each cut at 64 characters, and how many more."""
    shown = ", ".join(name[:64] for name in names[:KNOWN_MODELS_LISTED])
    more = len(names) - KNOWN_MODELS_LISTED
    return shown + (f" and {more} more" if more > 0 else "")


def resolve_model(catalog: Catalog, model: str, available_tokens: int) -> ModelCapability:
    """Catalog entry, or an `unknown`-family stand-in sized by available_tokens."""
    cap = catalog.resolve(model)
    if cap is not None:
        return cap
    if available_tokens > 0:
        return ModelCapability(
            provider="unknown",
            context_window=available_tokens,
            max_output_tokens=UNKNOWN_MODEL_MAX_OUTPUT,
            tokenizer_family="unknown",
            model_id=model,
        )
    # The error says what would be accepted: a known id (or a dated id that starts with
    # one), an operator catalog entry, or a window given by the caller.
    raise InputError(
        "model",
        f"unknown model {model[:64]!r} and available_tokens not set; known models: "
        f"{catalog.known_models} (a dated id resolves to the known id it starts with); "
        "add models with IBEX_CONTEXT_CATALOG_PATH, or send available_tokens",
    )
