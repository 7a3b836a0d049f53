"""grpcio-tools client made by `python -m ibex.tools.protogen`; do not edit.

An independent implementation of the contract (the stock stack the Go proxy uses) for
interop tests. Cross-module imports are rewritten to relative ones so this tree imports
as `ibex.testing._grpcio_client.ibex.context.v1.context_pb2` with no sys.path changes and
no clash with the real `ibex` package; `ibex.testing.grpcio_stubs` wraps the imports.
"""
