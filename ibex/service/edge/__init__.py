"""The HTTP/2 and gRPC edge: connections, frames, flow control and reading a request's bytes.

Serving (`ibex.service`) builds on it; nothing here knows what an assembly is.
"""
