"""Mutation testing (`just mutate`): the mutmut pytest plugin, the score report,
the module-constant mutator and the list of equivalent mutants."""
