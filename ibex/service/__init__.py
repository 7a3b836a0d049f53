"""Serving: the gRPC service, admission by deadline, and the in-process assembly.

- `root`: the composition root, which builds every part from `Settings` (with the
  derived values of `ibex.config.effective`) (`make_daemon`, `open_assembler`);
- `daemon`: one serving process (`Daemon`): listen, health, reflection, drain;
- `handlers`: the three RPCs (`ContextService`);
- `admission`, `policies`, `queues`, `budgets`: who is served when
  (`Admission`, `AdmissionPolicy`);
- `assembler`: validation, retrieval and the pure core for one call (`Assembler`);
- `auth`: the caller's bearer token or certificate (`Authenticator`);
- `convert`, `pb`: wire messages to and from the core's structs;
- `dependencies`, `warmup`: Redis and the memory service probed and the
  pipeline run once before the daemon says SERVING;
- `edge`: the HTTP/2 and gRPC plumbing under all of them.

Each name is imported from its module on first use, so `ibex.service.pb` (the
wire classes) loads no serving code.
"""

from ibex._lazy import lazy_exports

__all__ = [
    "Admission",
    "AdmissionPolicy",
    "Assembler",
    "Authenticator",
    "ContextService",
    "Daemon",
    "make_daemon",
    "open_assembler",
]

__getattr__ = lazy_exports(
    __name__,
    {
        "Admission": "admission",
        "AdmissionPolicy": "policies",
        "Assembler": "assembler",
        "Authenticator": "auth",
        "ContextService": "handlers",
        "Daemon": "daemon",
        "make_daemon": "root",
        "open_assembler": "root",
    },
)
