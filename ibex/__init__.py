"""Ibex context-assembly daemon."""

__version__ = "0.1.0"
