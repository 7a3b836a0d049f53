"""End-to-end load benchmark: the daemon under a gRPC driver with real Redis and HTTP.

`python -m benchmarks.load` runs it; see `__main__` for the scenarios and targets.
"""
