"""Code that runs *inside* the vLLM server started by `grpo_jax.serve`.

`WeightReloadExtension` is mixed into every vLLM worker (`--worker-extension-cls`) and is reached
through `POST /collective_rpc`; `DevRouteAuth` is an ASGI middleware (`--middleware`) for the API
process. Importing the module also registers our weight-transfer engine `grpo_http`
(`http_engine`) with vLLM. The vLLM venv has no jax, so this module imports only the standard
library (and wire.py's constants) at import time, torch/safetensors/vLLM inside functions.

Every RPC method returns a plain dict: a return value msgspec can't serialise hangs the server
for good (only SIGKILL ends it), and an exception is turned into {"error": ...} for the same
reason.
"""

from __future__ import annotations

import hmac
import os
import time
import traceback

from grpo_jax.rollout.server.wire import (HTTP_BACKEND, RAW_UPDATE_ROUTE, SESSION_TOKEN_ENV,
                                  UPDATE_INFO_HEADER)


class WeightReloadExtension:
    """Methods vLLM adds to its worker class; names are prefixed so they can't clash with it."""

    def grpo_reload_weights(self, path: str) -> dict:
        """Load every tensor of a safetensors file (HF names) into the running model."""
        try:
            from safetensors import safe_open

            start = time.perf_counter()
            with safe_open(path, framework="pt", device="cpu") as f:
                names = list(f.keys())
                # reload_weights, not model.load_weights: on CPU the linear weights are repacked
                # after loading, and only the reload path redoes that processing.
                self.reload_weights(weights_iterator=((n, f.get_tensor(n)) for n in names),
                                    is_checkpoint_format=True)
            return {"tensors": len(names), "seconds": time.perf_counter() - start}
        except Exception as e:  # noqa: BLE001 - must come back as JSON, see module docstring
            return {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}

    def grpo_model_info(self) -> dict:
        """The served architecture, to refuse a trainer whose model is a different one."""
        try:
            mc = self.vllm_config.model_config
            hf = mc.hf_text_config
            keys = ("model_type", "vocab_size", "hidden_size", "intermediate_size",
                    "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
                    "tie_word_embeddings")
            info = {k: getattr(hf, k, None) for k in keys}
            if info["tie_word_embeddings"] is None:  # a VLM's: on the wrapper (Qwen2.5-VL)
                info["tie_word_embeddings"] = getattr(mc.hf_config, "tie_word_embeddings", None)
            info["head_dim"] = mc.get_head_size()
            info["max_model_len"] = int(mc.max_model_len)
            info["dtype"] = str(mc.dtype).removeprefix("torch.")
            info["model"] = str(mc.model)
            wt = self.vllm_config.weight_transfer_config
            info["weight_transfer_backend"] = wt.backend if wt is not None else None
            lc = self.vllm_config.lora_config
            info["max_lora_rank"] = int(lc.max_lora_rank) if lc is not None else None
            # Read where the API server reads it: the workers inherit its environment.
            info["runtime_lora_updating"] = os.environ.get(
                "VLLM_ALLOW_RUNTIME_LORA_UPDATING", "0").strip().lower() in ("1", "true")
            return info
        except Exception as e:  # noqa: BLE001
            return {"error": f"{type(e).__name__}: {e}"}


# Without an API key (loopback), what anyone local may call: inference and status. Everything
# else (the dev and weight routes, LoRA loading) takes the session token (server_auth).
OPEN_ROUTES = frozenset({"/health", "/ping", "/version", "/v1/models", "/v1/completions",
                         "/v1/chat/completions", "/tokenize", "/detokenize", "/metrics"})
# Body limits of the guarded routes: a JSON body (vLLM's own weight routes carry metadata, or
# base64 buckets of at most http_sync.BUCKET_BYTES), and one raw bucket, which holds a tensor
# bigger than a bucket whole (an embedding).
MAX_BODY_BYTES = int(os.environ.get("GRPO_JAX_MAX_BODY_BYTES", 1 << 30))
MAX_BUCKET_BYTES = int(os.environ.get("GRPO_JAX_MAX_BUCKET_BYTES", 16 << 30))


class DevRouteAuth:
    """Guards the routes and serves RAW_UPDATE_ROUTE behind the guard.

    With an API key (VLLM_API_KEY, which vLLM reads as well): every route but /health needs
    it. vLLM's own `--api-key` check guards only /v1, /v2, /inference and /cohere, which leaves
    the dev-mode routes (/collective_rpc, /reset_prefix_cache, /update_weights, ...) open to
    anyone who can reach the port. Without one, the session token (GRPO_JAX_SESSION_TOKEN,
    set by grpo_jax.serve): every route but OPEN_ROUTES needs it. Bodies of the guarded POST
    routes are capped (MAX_BODY_BYTES; a raw bucket: the size its header declares).
    """

    def __init__(self, app):
        self.app = app
        key = os.environ.get("VLLM_API_KEY") or ""
        secret = key or os.environ.get(SESSION_TOKEN_ENV) or ""
        self.expected = secret.encode() if secret else None
        self.open = frozenset({"/health"}) if key else OPEN_ROUTES

    async def __call__(self, scope, receive, send):
        path = scope.get("path", "").removeprefix(scope.get("root_path", ""))
        if (self.expected is None or scope["type"] not in ("http", "websocket")
                or scope.get("method") == "OPTIONS" or path in self.open):
            return await self.route(scope, receive, send, path)
        got = dict(scope.get("headers") or ()).get(b"authorization", b"")
        # "Bearer <secret>"; the scheme is case-insensitive (RFC 7235 section 2.1)
        scheme, _, credentials = got.strip().partition(b" ")
        if scheme.lower() == b"bearer" and hmac.compare_digest(credentials.lstrip(b" "),
                                                                self.expected):
            return await self.route(scope, receive, send, path)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        await _answer(send, 401, {"error": "Unauthorized"})

    async def route(self, scope, receive, send, path):
        if scope["type"] == "http" and scope.get("method") == "POST":
            if path == RAW_UPDATE_ROUTE:
                return await raw_update_weights(scope, receive, send)
            if path not in OPEN_ROUTES:
                length = _content_length(scope)
                if length is not None and length > MAX_BODY_BYTES:
                    return await _answer(send, 413, {"error": f"body of {length} bytes is over "
                                                              f"the limit {MAX_BODY_BYTES}"})
                receive = _capped(receive, MAX_BODY_BYTES)
        return await self.app(scope, receive, send)


def _content_length(scope) -> int | None:
    value = dict(scope.get("headers") or ()).get(b"content-length")
    try:
        return int(value) if value is not None else None
    except ValueError:
        return None


def _capped(receive, limit: int):
    """`receive` that reports a disconnect once the body passes `limit` bytes (a chunked body
    has no length to check first)."""
    seen = 0

    async def capped():
        nonlocal seen
        message = await receive()
        seen += len(message.get("body", b""))
        return {"type": "http.disconnect"} if seen > limit else message
    return capped


async def _answer(send, status: int, body: dict) -> None:
    import json
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json")]})
    await send({"type": "http.response.body", "body": json.dumps(body).encode()})


async def raw_update_weights(scope, receive, send) -> None:
    """POST /grpo/update_weights: one bucket for vLLM's /update_weights (engine grpo_http) with
    its bytes as the raw body and its metadata as JSON in the X-Grpo-Update-Info header. It
    calls the engine client's own update_weights, as vLLM's route does, minus what JSON costs:
    base64 (4/3 of the bytes) and parsing a string of hundreds of MB (measured: the raw body
    makes a 108 MB SmolLM2 bucket several times faster). The header is checked first (known
    dtypes, sizes) and the body must be exactly the bytes it declares: no more is read."""
    import json

    from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

    from grpo_jax.rollout.server.http_engine import update_bytes
    try:
        meta = json.loads(dict(scope["headers"])[UPDATE_INFO_HEADER.encode()])
        if not isinstance(meta, dict):
            raise ValueError("X-Grpo-Update-Info must be a JSON object")
        need = update_bytes(meta)
    except (KeyError, ValueError) as e:
        return await _answer(send, 400, {"error": f"bad X-Grpo-Update-Info: {e}"})
    length = _content_length(scope)
    if need > MAX_BUCKET_BYTES or (length is not None and length != need):
        return await _answer(send, 413, {"error": (
            f"body of {length} bytes for tensors of {need} bytes (limit {MAX_BUCKET_BYTES}: "
            "GRPO_JAX_MAX_BUCKET_BYTES)")})
    chunks, more, got = [], True, 0
    while more:
        message = await receive()
        chunk = message.get("body", b"")
        got += len(chunk)
        if got > need or message["type"] == "http.disconnect":
            return await _answer(send, 413, {"error": f"body longer than the {need} bytes its "
                                                      "tensors need"})
        chunks.append(chunk)
        more = message.get("more_body", False)
    if got != need:
        return await _answer(send, 400, {"error": f"body of {got} bytes for tensors of {need}"})
    try:
        info = {**meta, "data": b"".join(chunks)}
        del chunks
        await scope["app"].state.engine_client.update_weights(
            WeightTransferUpdateRequest(update_info=info))
        status, body = 200, {"message": "Weights updated"}
    except Exception as e:  # noqa: BLE001 - answered as JSON, as vLLM's routes answer
        status, body = 500, {"error": f"{type(e).__name__}: {e}"}
    await _answer(send, status, body)


def register_http_engine() -> None:
    """Make `--weight-transfer-config '{"backend": "grpo_http"}'` known to vLLM's factory. vLLM
    imports this module (worker extension, middleware) before a worker builds its engine."""
    try:
        from vllm.distributed.weight_transfer import WeightTransferEngineFactory
    except ImportError:  # imported outside a vLLM server (the trainer's tests)
        return
    if HTTP_BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(
            HTTP_BACKEND, "grpo_jax.rollout.server.http_engine", "HTTPWeightTransferEngine")


register_http_engine()
