"""The step core: one optimiser step of the actor or critic on a batch (no run state, no I/O)."""
