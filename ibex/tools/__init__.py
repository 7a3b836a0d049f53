"""Developer tools run through `just`, each a command (`python -m ibex.tools.NAME`).

- `protogen`: generate, or drift-check, the code built from `protos/` (`just proto`);
- `lock`: refresh, or check, `uv.lock` and the pip files made from it (`just lock`);
- `image_test`: smoke-test the OCI image as a cluster would (`just image-test`).

They are scripts, not a library: nothing here is imported by the daemon.
"""

__all__: list[str] = []
