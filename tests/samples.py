"""The sample tenant every test and benchmark shares (the bundled data's org and agent)."""

from __future__ import annotations

from ibex.cli import SAMPLE_AGENT, SAMPLE_ORG

ORG = SAMPLE_ORG
AGENT = SAMPLE_AGENT

__all__ = ["AGENT", "ORG"]
