"""The trainer core: the engine, how it is built, and the parts it composes (generation, loss, evaluation,
optimization, the policy's forward passes, the prompt samplers, metrics)."""
