"""`PipelineConfig`: the pure core's knobs, each setting declared on its field.

Kept apart from the pipeline so the settings table (`ibex.config`) can read the
declarations without loading the stages (numpy through the packer). The
packer's own defaults live here, beside the variables that change them, and
`ibex.assembly.packer.pack` takes them from here.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

from ibex.assembly.output_format import Format, SectionOrder
from ibex.assembly.xml_format import XML_TAGS
from ibex.envvar import env

__all__ = [
    "DEFAULT_CONFIG",
    "DEFAULT_DP_CELL_CEILING",
    "DEFAULT_MAX_CONSECUTIVE_SKIPS",
    "DEFAULT_NONCE_BYTES",
    "PipelineConfig",
]

DEFAULT_DP_CELL_CEILING = 70 * 6251
DEFAULT_MAX_CONSECUTIVE_SKIPS = 5
DEFAULT_NONCE_BYTES = 16


class PipelineConfig(msgspec.Struct, frozen=True):
    """The pure core's knobs; the defaults are the packer's and the formatter's own."""

    dp_cell_ceiling: Annotated[
        int, env("IBEX_CONTEXT_PACKER_DP_CELL_CEILING", bounds=(1, 50_000_000))
    ] = DEFAULT_DP_CELL_CEILING
    max_consecutive_skips: Annotated[
        int, env("IBEX_CONTEXT_PACKER_MAX_CONSECUTIVE_SKIPS", bounds=(0, 1_000_000))
    ] = DEFAULT_MAX_CONSECUTIVE_SKIPS
    nonce_bytes: Annotated[int, env("IBEX_CONTEXT_FORMATTER_NONCE_BYTES", bounds=(8, 64))] = (
        DEFAULT_NONCE_BYTES
    )
    #: How the block is written and priced: both come from this one object.
    format: Format = XML_TAGS
    #: The order sections are written in (ibex.assembly.output_format.SectionOrder): `seed`, the
    #: design's fixed order, or `cache`, what changes least first for a provider's cache.
    section_order: Annotated[SectionOrder, env("IBEX_CONTEXT_SECTION_ORDER")] = "seed"


DEFAULT_CONFIG = PipelineConfig()
