"""The pure core: retrieval results in, a verified context block out.

No I/O library and no settings are imported here (an import-linter contract
keeps it so): frozen `msgspec` structs and plain functions, testable and
benchmarked without a loop, a server or a network. The stages, each in its own
module, run in this order (`assemble_pure`): the fixed sections and the budget
(`fixed_sections`, `history`, `budget`), selection (`candidates`, `scoring`),
pricing (`pricing`), packing (`packer`), rendering within the ceiling
(`render`, through the `Format` of `output_format` / `xml_format`) and the
result (`result`). `EarlyAssembly` (`prepare`) does a branch's share of them as
it lands. Token counts come from `Tokenizers` (`tokens`), models from the
`Catalog` (`catalog`).

The names below are the core's public API; each is imported from its module
on first use, so importing one module of the core loads no other.
"""

from ibex._lazy import lazy_exports

__all__ = [
    "DEFAULT_CONFIG",
    "XML_TAGS",
    "AssemblyInputs",
    "AssemblyOptions",
    "AssemblyRequest",
    "AssemblyResult",
    "BranchOutcome",
    "Catalog",
    "Directive",
    "EarlyAssembly",
    "Format",
    "MemoryHit",
    "MemoryUsed",
    "Message",
    "NonceKey",
    "PipelineConfig",
    "RequestLimits",
    "SearchFilter",
    "SearchRequest",
    "SectionOrder",
    "Tokenizers",
    "XmlTagFormat",
    "assemble_pure",
    "load_catalog",
    "new_nonce",
    "rank_search",
    "resolve_model",
    "validate_request",
    "validate_search",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "DEFAULT_CONFIG": "pipeline_config",
        "AssemblyInputs": "pipeline",
        "PipelineConfig": "pipeline_config",
        "assemble_pure": "pipeline",
        "EarlyAssembly": "prepare",
        "AssemblyOptions": "structs",
        "AssemblyRequest": "structs",
        "AssemblyResult": "structs",
        "BranchOutcome": "structs",
        "Directive": "structs",
        "MemoryHit": "structs",
        "MemoryUsed": "structs",
        "Message": "structs",
        "SearchRequest": "structs",
        "Catalog": "catalog",
        "load_catalog": "catalog",
        "resolve_model": "catalog",
        "Tokenizers": "tokens",
        "Format": "output_format",
        "SectionOrder": "output_format",
        "XML_TAGS": "xml_format",
        "XmlTagFormat": "xml_format",
        "new_nonce": "xml_format",
        "NonceKey": "nonce",
        "RequestLimits": "validation",
        "validate_request": "validation",
        "validate_search": "validation",
        "SearchFilter": "candidates",
        "rank_search": "candidates",
    },
)
