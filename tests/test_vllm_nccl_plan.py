"""`vllm_weight_sync: nccl`, the parts that run without a GPU: what the trainer hands vLLM's NCCL
trainer engine (rollout/vllm/nccl_sync.py: JaxSource) must announce exactly what it then yields,
hold the same values as the checkpoint-format tensors the other transports send, come out as
torch tensors through DLPack, and keep the order vLLM's own `layerwise_groups` gives (the worker
cuts its packed receive buffers from that announcement). The broadcast itself needs CUDA:
tools/vllm_gpu_check.py.
"""

from __future__ import annotations

import json
import subprocess

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from grpo_jax.hf import hf_state_dict, load_model, params_numpy
from vllm_server import SKIP_WITHOUT_VLLM, VLLM_PYTHON, tiny_llama

torch = pytest.importorskip("torch")


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return load_model(str(tiny_llama(tmp_path_factory.mktemp("tiny"))), dtype=jnp.float32,
                      remat=False)[0]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_jax_source_announces_what_it_yields(model, dtype):
    from grpo_jax.rollout.vllm.nccl_sync import JaxSource
    source = JaxSource(model.cfg, dtype)
    source.set(nnx.split(model, nnx.Param)[1])  # the params as the trainer holds them
    meta, got = source.metadata(), list(source)
    ref = hf_state_dict(model.cfg, params_numpy(model), dtype=dtype, include_tied_head=True)
    assert [m.name for m in meta] == [name for name, _ in got]
    assert sorted(ref) == sorted(m.name for m in meta)  # the tied head included
    for m, (name, tensor) in zip(meta, got):
        assert isinstance(tensor, torch.Tensor) and tensor.dtype == m.dtype == getattr(torch,
                                                                                     dtype)
        assert tuple(tensor.shape) == m.shape == ref[name].shape
        np.testing.assert_array_equal(tensor.float().numpy(), ref[name].astype(np.float32))


@SKIP_WITHOUT_VLLM
@pytest.mark.slow
def test_order_is_vllms_layerwise_order(model):
    from grpo_jax.rollout.vllm.nccl_sync import hf_parts
    names = list(hf_parts(model.cfg, "float32"))
    code = ("import json, sys\nfrom vllm.distributed.weight_transfer.base import "
            "layerwise_groups\nnames = json.load(sys.stdin)\n"
            "print(json.dumps([n for g in layerwise_groups(names) for n in g]))")
    out = subprocess.run([VLLM_PYTHON, "-c", code], input=json.dumps(names), text=True,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert json.loads(out.stdout.strip().splitlines()[-1]) == names
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
