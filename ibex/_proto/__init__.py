"""Made from protos/ by `python -m ibex.tools.protogen`; do not edit.

Messages, the grpclib server base and client stub live in `ibex._proto.ibex.context.v1`;
`descriptors.binpb` is the FileDescriptorSet (with imports) served by gRPC reflection.
"""
