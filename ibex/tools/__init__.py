"""Developer tools (code generation) run through `just`."""
