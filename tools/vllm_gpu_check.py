"""One-command check of the vLLM weight-sync transports on a GPU machine that has vLLM.

    GRPO_JAX_VLLM_PYTHON=/path/to/vllm-venv/bin/python python tools/vllm_gpu_check.py \
        [--model DIR] [--repeats 5] [--transports nccl,http,shm]

Needs vLLM (a GPU build) in the trainer's environment too for `nccl` (vLLM's trainer engine);
not run yet: no machine of this project had vLLM and a GPU (the lent GPU image has no vLLM).
Without --model it serves a Qwen2-0.5B-shaped model with random weights (the machines have no
hub access), in bf16, trainer and server on the same GPU. For each transport: a server started
by grpo_jax.serve with the matching engine, `repeats` pushes of new weights, the seconds of each
(what a run logs as timing/weight_sync), and the largest |server - trainer| log-prob over a few
sequences after the last push. Prints one JSON line; the goal is nccl <= 0.2 s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.35")  # vLLM shares the GPU

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from flax import nnx  # noqa: E402

from grpo_jax import hf, serve  # noqa: E402
from grpo_jax.rollout.vllm.client import VLLMClient  # noqa: E402
from grpo_jax.rollout.vllm.sync import ServerWeights  # noqa: E402

BACKEND = {"nccl": '{"backend": "nccl"}', "http": serve.WEIGHT_TRANSFER,
           "shm": serve.WEIGHT_TRANSFER}


def random_qwen(out: Path) -> Path:
    """Qwen2-0.5B's shape, random bf16 weights, and a word-level tokenizer over its ids."""
    import torch
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers
    vocab = {f"w{i}": i for i in range(1024)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="w2",
                                         pad_token="w0").save_pretrained(out)
    cfg = transformers.Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864,
                                   num_hidden_layers=24, num_attention_heads=14,
                                   num_key_value_heads=2, tie_word_embeddings=True,
                                   max_position_embeddings=4096, eos_token_id=2)
    torch.manual_seed(0)
    transformers.Qwen2ForCausalLM(cfg).to(torch.bfloat16).save_pretrained(out)
    return out


def logp(model, seq, start):
    seq = jnp.asarray([seq])
    mask = jnp.ones_like(seq)
    from grpo_jax.models import positions_from_mask
    hidden, _ = model(seq, positions_from_mask(mask), mask)
    lp = jax.nn.log_softmax(model.logits(hidden)[0, :-1].astype(jnp.float32), axis=-1)
    return np.asarray(jnp.take_along_axis(lp, seq[0, 1:, None], axis=-1)[start - 1:, 0])


def check(transport, model_dir, model, repeats, port, tmp) -> dict:
    srv = serve.start_server(model_dir, port, max_model_len=512, log_path=tmp / f"{transport}.log",
                             gpu_memory_utilization=0.4,
                             extra_args=["--dtype", "bfloat16", "--weight-transfer-config",
                                         BACKEND[transport]])
    try:
        client = VLLMClient(srv.base_url)
        client.wait_healthy(900, server=srv)
        weights = ServerWeights(client, transport, model.cfg)
        graphdef, params = nnx.split(model, nnx.Param)
        times = []
        for r in range(repeats):
            new = jax.tree.map(lambda x, k=r: x * (1 + 1e-3 * (k + 1)), params)
            if transport == "nccl":
                times.append(weights.push_device(new))
            else:
                times.append(weights.push_full(hf.params_from_state(model.cfg, new)))
        trained = nnx.merge(graphdef, new)
        rng = np.random.default_rng(0)
        seqs = [rng.integers(4, 1000, 40).tolist() for _ in range(4)]
        served = client.logprobs_for([s[:20] for s in seqs], [s[20:] for s in seqs])
        diff = max(float(np.abs(g - logp(trained, s, 20)).max()) for g, s in zip(served, seqs))
        return {"median_s": statistics.median(times), "all_s": [round(t, 4) for t in times],
                "bytes": weights.metrics["weight_sync/bytes"], "max_logprob_diff": diff}
    finally:
        srv.stop()


def main():
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default=None)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--transports", default="nccl,http,shm")
    p.add_argument("--port", type=int, default=8011)
    args = p.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="vllm_gpu_check-"))
    model_dir = Path(args.model) if args.model else random_qwen(tmp / "qwen2-0.5b-random")
    model, _ = hf.load_model(str(model_dir), dtype=jnp.bfloat16)
    out = {"device": str(jax.devices()[0]), "model": str(model_dir), "time": time.ctime()}
    for t in args.transports.split(","):
        try:
            out[t] = check(t, model_dir, model, args.repeats, args.port, tmp)
        except Exception as e:  # noqa: BLE001 - report every transport, whatever fails
            out[t] = {"error": f"{type(e).__name__}: {e}"}
    if "median_s" in out.get("nccl", {}):
        out["nccl_goal_0.2s_met"] = out["nccl"]["median_s"] <= 0.2
    print(json.dumps(out))


if __name__ == "__main__":
    main()
