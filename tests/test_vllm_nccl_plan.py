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


@pytest.fixture(scope="module")
def vlms(tmp_path_factory):
    """Tiny Gemma 3 and Qwen2.5-VL (vlm_models), loaded from their HF directories."""
    from vlm_models import tiny_gemma3, tiny_qwen25
    out = {}
    for name, make in (("gemma3", tiny_gemma3), ("qwen2_5_vl", tiny_qwen25)):
        path = tmp_path_factory.mktemp(name)
        make().save_pretrained(path)
        out[name] = load_model(str(path), dtype=jnp.float32, remat=False)[0]
    return out


def test_a_vlm_plan_sends_what_http_sends(vlms):
    """A vision-language model over nccl: without tower adapters the language model's
    tensors only, under the names and with the values an http push sends
    (VLLMRollout._pushed, hf_state_dict); with them, the tower's too."""
    from grpo_jax.rollout.vllm.nccl_sync import JaxSource
    for model in vlms.values():
        table = params_numpy(model)
        for tower in (False, True):
            pushed = {k: v for k, v in table.items() if tower or not k.startswith("vision/")}
            ref = hf_state_dict(model.cfg, pushed, include_tied_head=True)
            source = JaxSource(model.cfg, "float32", tower=tower)
            source.set(nnx.split(model, nnx.Param)[1])
            got = dict(source)
            assert sorted(got) == sorted(ref) == sorted(m.name for m in source.metadata())
            assert tower == any(k.startswith(("vision_tower.", "visual.")) for k in got)
            for name, tensor in got.items():
                np.testing.assert_array_equal(tensor.numpy(), ref[name])


def _vllms_order(plans: list[list[str]]) -> list[list[str]]:
    """Each list of names in the order of vLLM's layerwise_groups (one vLLM import for all)."""
    code = ("import json, sys\nfrom vllm.distributed.weight_transfer.base import "
            "layerwise_groups\nplans = json.load(sys.stdin)\n"
            "print(json.dumps([[n for g in layerwise_groups(p) for n in g] for p in plans]))")
    out = subprocess.run([VLLM_PYTHON, "-c", code], input=json.dumps(plans), text=True,
                         capture_output=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


@SKIP_WITHOUT_VLLM
@pytest.mark.slow
def test_order_is_vllms_layerwise_order(model, vlms):
    """Our plan's order is vLLM's own partition's (the worker cuts its receive buffers from
    it): a language model's, and a vision-language model's with and without its tower (a
    second stack of layers, and the projector among the names without an index)."""
    from grpo_jax.rollout.vllm.nccl_sync import hf_parts
    names = list(hf_parts(model.cfg, "float32"))
    assert names[0] == "model.embed_tokens.weight" and names[-1] == "lm_head.weight"
    plans = [names] + [list(hf_parts(vlm.cfg, "float32", tower))
                       for vlm in vlms.values() for tower in (False, True)]
    assert _vllms_order(plans) == plans
