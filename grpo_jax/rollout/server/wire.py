"""What the trainer and the vLLM server must agree on, defined once for both sides.

The server imports this from a private copy of a few of our files (`grpo_jax.serve`
WORKER_MODULES), in a venv without jax: standard library only, constants only.
"""

from __future__ import annotations

# vLLM's weight-transfer engine factory knows our engine (rollout/server/http_engine.py) by this.
HTTP_BACKEND = "grpo_http"
# The layout of update_info; bumped when it changes, so a mismatched trainer is refused.
PROTOCOL = 1
# One bucket's bytes as a raw body, its metadata as JSON in UPDATE_INFO_HEADER (worker.py).
RAW_UPDATE_ROUTE = "/grpo/update_weights"
UPDATE_INFO_HEADER = "x-grpo-update-info"
# The session token the dev and weight routes require when the server has no API key: the
# trainer's side puts it in the server's environment (server_auth), the server reads it.
SESSION_TOKEN_ENV = "GRPO_JAX_SESSION_TOKEN"
