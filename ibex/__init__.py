"""Ibex context-assembly daemon.

What a user of the package imports:

- `ibex.client`: the Python client for proxies (`ContextClient`, fail-open), with
  `ibex.wire`, the wire messages it shares with the server; neither loads any
  server module;
- `ibex.cli`: the `ibex` command (`main`);
- `ibex.assembly`: the pure core (`assemble_pure` and its structs), for tests,
  benchmarks and new output formats;
- `ibex.testing`: the real stand-ins tests and benchmarks run against.

The daemon's own layers (`ibex.sources`, `ibex.service`, `ibex.ops`) and the
patches of other libraries they share (`ibex.patches`) are documented in their
packages. Nothing is imported here, so importing any one module loads only what
it needs.
"""

__all__ = ["__version__"]

__version__ = "0.1.0"
