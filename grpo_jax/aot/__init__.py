"""Compile a run for hardware this machine does not have: `python -m grpo_jax.aot`.

hardware: chips, TPU slices and GPUs as the compiler sees them; programs: the run's update,
log-prob and sampler programs, lowered with abstract sharded arguments; report: memory per chip
and roofline time from the compiled programs; analyze: the command line.
"""
