"""The native JAX sampler: runs in the trainer's processes, on its devices."""
