"""The run lifecycle: assembly, the trainer loop, weight publishing, evaluation, checkpoints, metrics."""
