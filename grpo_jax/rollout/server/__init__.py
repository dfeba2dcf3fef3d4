"""Runs inside the vLLM server (imports torch and vLLM, never jax): grpo_jax.serve copies this
directory onto the server's path. wire.py is what both sides agree on."""
