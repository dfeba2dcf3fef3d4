"""Mixtures of experts (Qwen3-MoE, Mixtral, gpt-oss) against transformers (PyTorch CPU, fp32):
logits on a left-padded batch, the KV-cache path, greedy generation, export, gpt-oss's MXFP4
checkpoints, expert parallelism (8 CPU devices) against one device, the router's
load-balancing loss against transformers' and TRL's, and a GRPO run on a tiny MoE policy.

One tiny random model per family for the module (tests/hf_oracle.py: 4 experts, 2 per token;
Qwen3-MoE with a dense layer between sparse ones, gpt-oss with sliding and full layers)."""

import json
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from flax import nnx
from hf_oracle import hf_greedy, hf_logits, tiny_hf_model
from model_oracle import LONG_MASK, LONG_TOKENS, decode_step, long_diff, long_logits

from grpo_jax import hf
from grpo_jax import mesh as mesh_lib
from grpo_jax.errors import GrpoJaxError
from grpo_jax.models import KVCache, ModelConfig, ModelConfigError, moe, positions_from_mask
from grpo_jax.rollout.native.sampler import Sampler
from grpo_jax.rollout.native.sampling import SamplingParams

# name -> (family, config overrides): Qwen3-MoE both ways of norm_topk_prob.
MODELS = {"qwen3_moe": ("qwen3_moe", {}),
          "qwen3_moe_unnormed": ("qwen3_moe", dict(norm_topk_prob=False)),
          "mixtral": ("mixtral", {}), "gpt_oss": ("gpt_oss", {})}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """name -> (transformers model, its directory, our fp32 decoder), built on first use."""
    made = {}

    def get(name):
        if name not in made:
            family, kw = MODELS[name]
            ref = tiny_hf_model(family, **kw)
            path = tmp_path_factory.mktemp(name)
            ref.save_pretrained(path)
            made[name] = (ref, path, hf.load_model(str(path), dtype=jnp.float32)[0])
        return made[name]
    return get


@pytest.mark.parametrize("name", MODELS)
@pytest.mark.slow
def test_logits_match_transformers(tiny, name):
    ref, _, model = tiny(name)
    cfg = model.cfg
    assert cfg.num_experts == 4 and cfg.num_experts_per_tok == 2
    if name.startswith("qwen3_moe"):  # layer 1 is dense (mlp_only_layers)
        assert cfg.moe_layers == (True, False, True)
        assert model.layers.w_gate.shape[0] == 1 and model.layers.we_gate.shape[0] == 2
    assert long_diff(long_logits(model), hf_logits(ref, LONG_TOKENS, LONG_MASK)) < 1e-4


@pytest.mark.slow
def test_the_switches_matter(tiny):
    """Each MoE switch changes the logits, so the parity above tests it."""
    for name, changes in (
            ("gpt_oss", (dict(swiglu_limit=None), dict(attention_sinks=False, o_bias=False),
                         dict(norm_topk_prob=False), dict(rope_yarn=None))),
            ("qwen3_moe", (dict(norm_topk_prob=False),))):
        _, _, model = tiny(name)
        cfg, base = model.cfg, long_logits(model)
        for change in changes:
            model.cfg = cfg.replace(**change)
            try:
                assert long_diff(long_logits(model), base) > 1e-3, (name, change)
            finally:
                model.cfg = cfg


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss"])
@pytest.mark.slow
def test_kv_cache_path_matches_full_forward(tiny, name):
    """Prefill 5 tokens, then decode the rest one at a time (the sliding layers' rings wrap):
    every step's logits equal the full forward's."""
    _, _, model = tiny(name)
    cfg, S, P = model.cfg, LONG_TOKENS.shape[1], 5
    mask = jnp.asarray(LONG_MASK)
    pos = positions_from_mask(mask)
    hidden, cache = model(jnp.asarray(LONG_TOKENS[:, :P]), pos[:, :P], mask[:, :P],
                          cache=KVCache.zeros(cfg, len(LONG_TOKENS), P), cache_index=0)
    steps = [model.logits(hidden)]
    cache = cache.grown(cfg, S)
    for t in range(P, S):  # one compiled step for all of them (the index traced)
        hidden, cache = decode_step(model, jnp.asarray(LONG_TOKENS[:, t:t + 1]), pos[:, t:t + 1],
                                    mask, cache, jnp.int32(t))
        steps.append(model.logits(hidden))
    assert long_diff(np.asarray(jnp.concatenate(steps, axis=1)), long_logits(model)) < 1e-4


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_greedy_generation_matches_transformers(tiny, name):
    ref, _, model = tiny(name)
    prompts = [[5, 17, 99, 3, 42, 8, 77], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16], [120, 6]]
    sp = SamplingParams(max_completion_length=12, temperature=0, stop_token_ids=(2,))
    out = Sampler(model.cfg, sp, pad_id=0, buckets=(16,)).generate(model, prompts)
    np.testing.assert_array_equal(out.completion_ids, hf_greedy(ref, prompts, 12))


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_export_round_trip(tiny, tmp_path, name):
    """Export writes transformers' own class under its checkpoint names (per-expert tensors
    for Qwen3-MoE and Mixtral, gpt-oss's interleaved gate_up), and reads back the same."""
    ref, path, model = tiny(name)
    ours = hf.hf_state_dict(model.cfg, hf.params_numpy(model))
    sd = ref.state_dict()
    with open(path / "model.safetensors", "rb") as f:
        header = json.loads(f.read(int.from_bytes(f.read(8), "little")))
    assert set(ours) == set(header) - {"__metadata__"}
    hf.save_hf(model, tmp_path / "out", source_dir=path)
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out").eval()
    assert type(back) is type(ref)
    for k, v in back.state_dict().items():
        np.testing.assert_array_equal(v.numpy(), sd[k].numpy(), err_msg=k)
    again, _ = hf.load_model(str(tmp_path / "out"), dtype=jnp.float32)
    assert again.cfg == model.cfg


def test_mxfp4_experts_are_dequantized_on_load(tiny, tmp_path):
    """gpt-oss's released checkpoints store the experts as MXFP4 blocks and scales: loading
    dequantizes them as transformers' convert_moe_packed_tensors does."""
    from safetensors.numpy import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    _, path, _ = tiny("gpt_oss")
    tensors = load_file(path / "model.safetensors")
    rng = np.random.default_rng(0)
    want = {}
    for key in [k for k in tensors if k.endswith(("gate_up_proj", "down_proj"))
                and ".experts." in k]:
        E, n_in, n_out = tensors.pop(key).shape
        blocks = rng.integers(0, 256, (E, n_out, n_in // 32, 16), dtype=np.uint8)
        scales = rng.integers(120, 130, (E, n_out, n_in // 32), dtype=np.uint8)
        tensors[key + "_blocks"], tensors[key + "_scales"] = blocks, scales
        want[key] = convert_moe_packed_tensors(torch.from_numpy(blocks),
                                               torch.from_numpy(scales),
                                               dtype=torch.float32).numpy()
    (tmp_path / "q").mkdir()
    save_file(tensors, tmp_path / "q" / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (tmp_path / "q" / "config.json").write_text(json.dumps(config))
    model, _ = hf.load_model(str(tmp_path / "q"), dtype=jnp.float32)
    got = hf.hf_state_dict(model.cfg, hf.params_numpy(model))
    for key, value in want.items():
        np.testing.assert_array_equal(got[key], value, err_msg=key)


def test_capacity_factor_drops_only_what_overflows(tiny):
    """moe_capacity_factor: room enough for every assignment gives the dropless logits; a
    small one drops assignments and changes them, except under routing replay, which drops
    nothing (its replayed dropless experts give the dropless logits)."""
    _, _, model = tiny("mixtral")
    cfg, dropless = model.cfg, long_logits(model)
    mask = jnp.asarray(LONG_MASK)
    args = (jnp.asarray(LONG_TOKENS), positions_from_mask(mask), mask)
    try:
        _, _, own = nnx.jit(lambda m: m(*args, record_routing=True))(model)
        model.cfg = cfg.replace(moe_capacity_factor=2.0)  # E / k: room for every token
        assert long_diff(long_logits(model), dropless) < 1e-5
        model.cfg = cfg.replace(moe_capacity_factor=0.25)
        assert long_diff(long_logits(model), dropless) > 1e-3
        hidden, _ = nnx.jit(lambda m: m(*args, routing=own.astype(jnp.int8)))(model)
        assert long_diff(np.asarray(model.logits(hidden)), dropless) < 1e-5
    finally:
        model.cfg = cfg


def test_configs_that_cannot_load_say_so():
    base = dict(vocab_size=32, hidden_size=16, intermediate_size=24, num_hidden_layers=2,
                num_attention_heads=2)
    with pytest.raises(ModelConfigError, match="quant_method 'fp8'.*save_pretrained"):
        ModelConfig.from_hf({**base, "model_type": "qwen3_moe", "num_experts": 4,
                             "num_experts_per_tok": 2,
                             "quantization_config": {"quant_method": "fp8"}})
    with pytest.raises(ModelConfigError, match="router_jitter_noise"):
        ModelConfig.from_hf({**base, "model_type": "mixtral", "num_local_experts": 4,
                             "num_experts_per_tok": 2, "router_jitter_noise": 0.1})
    with pytest.raises(GrpoJaxError, match="not a mixture of experts"):
        moe.router_aux_loss_coef(0.01, ModelConfig.from_hf({**base, "model_type": "llama"}))


def _rows(vocab: int, rows: int = 8, width: int = 12, seed: int = 0):
    """A left-padded batch of `rows` rows (lengths 3 to width)."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(3, width + 1, rows)
    lengths[0] = width
    mask = (np.arange(width)[None] >= (width - lengths)[:, None]).astype(np.int32)
    return rng.integers(3, vocab, (rows, width)).astype(np.int32) * mask, mask


def _grpo_batch(vocab: int, groups: int = 2, g: int = 4, seed: int = 0):
    """groups prompts with g completions each (rows of a group consecutive), TRL's inputs."""
    from grpo_jax.grpo.batch import Batch
    p_ids, p_mask = _rows(vocab, groups, 10, seed)
    c_ids, c_mask = _rows(vocab, groups * g, 6, seed + 1)
    c_mask = c_mask[:, ::-1].copy()  # right-padded completions
    c_ids = c_ids[:, ::-1] * c_mask
    adv = np.random.default_rng(seed).standard_normal(groups * g).astype(np.float32)
    return Batch(np.repeat(p_ids, g, 0), np.repeat(p_mask, g, 0), c_ids, c_mask,
                 c_mask.sum(1) == 6, adv)


def test_aux_loss_matches_transformers(tiny):
    """The router statistics give transformers' load_balancing_loss_func (its aux_loss with
    output_router_logits and the attention mask), the dense layer left out."""
    ref, _, model = tiny("qwen3_moe")
    ids, mask = _rows(model.cfg.vocab_size)
    _, _, stats = model(jnp.asarray(ids), positions_from_mask(jnp.asarray(mask)),
                        jnp.asarray(mask), with_router=True)
    pos = torch.as_tensor((mask.cumsum(-1) - 1).clip(0), dtype=torch.long)
    with torch.no_grad():
        want = ref(input_ids=torch.as_tensor(ids, dtype=torch.long),
                   attention_mask=torch.as_tensor(mask), position_ids=pos,
                   output_router_logits=True).aux_loss
    assert float(stats.tokens) == 2 * mask.sum()  # two sparse layers
    np.testing.assert_allclose(float(moe.aux_loss(stats)), float(want), rtol=1e-5)


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
@pytest.mark.slow
def test_loss_with_aux_term_matches_trl(tiny, name):
    """TRL 1.16's own GRPOTrainer._compute_loss on the transformers model (its fused LM head,
    the aux loss from output_router_logits) over k = 2 micro-batches against the train step's
    accumulation on ours: the loss (policy + router_aux_loss_coef * aux / k per micro-batch)
    and the gradients of every parameter both name alike (attention, norms, routers; gpt-oss's
    stacked experts too)."""
    from contextlib import nullcontext

    from trl_oracle import trl_trainer
    from trl.trainer.utils import add_fused_lm_head

    from grpo_jax.grpo.loss import LossConfig
    from grpo_jax.grpo.train_step import StepConfig, loss_and_grads
    _, _, model = tiny(name)
    family, kw = MODELS[name]
    ref = tiny_hf_model(family, **kw).train()  # the fixture's weights (same seed)
    coef, k, temperature = 0.3, 2, 0.9  # a coefficient large enough to show in the gradients
    loss_cfg = LossConfig(loss_type="dapo", vllm_importance_sampling_correction=False,
                          router_aux_loss_coef=coef)
    b = _grpo_batch(model.cfg.vocab_size)
    n = len(b.advantages)

    add_fused_lm_head(ref, temperature=temperature, outputs=("log_probs", "entropy"))
    t = trl_trainer(loss_cfg, k, k, use_vllm=False)
    t.accelerator.autocast = nullcontext
    t.aux_loss_enabled, t.router_aux_loss_coef = True, coef
    # TRL's own method on the real model, without its profiling wrapper (it needs a Trainer).
    t._get_per_token_logps_and_entropies = types.MethodType(
        type(t)._get_per_token_logps_and_entropies.__wrapped__, t)
    total, size = 0.0, n // k
    t_ = lambda a, dtype=torch.long: torch.as_tensor(np.asarray(a), dtype=dtype)  # noqa: E731
    for j in range(k):
        sl = slice(j * size, (j + 1) * size)
        inputs = {"prompt_ids": t_(b.prompt_ids[sl]), "prompt_mask": t_(b.prompt_mask[sl]),
                  "completion_ids": t_(b.completion_ids[sl]),
                  "completion_mask": t_(b.completion_mask[sl]),
                  "advantages": t_(b.advantages[sl], torch.float32),
                  "num_items_in_batch": torch.tensor(float(b.completion_mask.sum()))}
        t.accelerator.sync_gradients = j == k - 1
        loss = t._compute_loss(ref, inputs)
        loss.backward()
        total += float(loss.detach())

    graphdef, params = nnx.split(model, nnx.Param)
    step = StepConfig(loss=loss_cfg, temperature=temperature, gradient_accumulation_steps=k,
                      logprob_chunk=4, aux_loss_coef=coef)
    batch = jax.tree.map(jnp.asarray, b)
    got = {}
    for group in (1, 4):  # shared prompts count their tokens once per row, as TRL's rows do
        loss, grads, sums = jax.jit(lambda p, bt, g=group: loss_and_grads(
            graphdef, step, p, bt, group=g))(params, batch)
        got[group] = float(loss)
    np.testing.assert_allclose(got[1], total, rtol=1e-5)
    np.testing.assert_allclose(got[4], total, rtol=1e-5)
    ours = hf.hf_state_dict(model.cfg, hf.params_from_state(model.cfg, grads))
    theirs = {k: p.grad.numpy() for k, p in ref.named_parameters() if p.grad is not None}
    common = set(ours) & set(theirs)
    assert any(".gate.weight" in k or ".router.weight" in k for k in common)
    scale = max(np.abs(v).max() for v in theirs.values())
    for key in common:
        np.testing.assert_allclose(ours[key], theirs[key], atol=1e-5 * scale, err_msg=key)
    # [k]-stacked per micro-batch (value, count) pairs: the step's over all of them
    metrics = {k: float(v[..., 0].sum() / v[..., 1].sum()) for k, v in sums["mean"].items()}
    assert metrics["aux_loss"] > 0 and "router/load/3" in metrics


@pytest.mark.skipif(jax.device_count() < 8, reason="needs 8 devices (tests/conftest.py)")
@pytest.mark.parametrize("name,shape", [("qwen3_moe", (1, 2, 1, 4)), ("gpt_oss", (1, 2, 2, 2))],
                         ids=["fsdp2-ep4", "fsdp2-ep2-tp2"])
@pytest.mark.slow
def test_expert_parallel_equals_one_device(tiny, name, shape):
    """Experts split over an `expert` mesh axis (tokens gathered over it, outputs
    reduce-scattered; with a tensor axis, each expert's hidden width split too) give one
    device's logits, router statistics, loss and gradients (shared prompts, k = 2, aux on)."""
    from grpo_jax.grpo.loss import LossConfig
    from grpo_jax.grpo.train_step import StepConfig, loss_and_grads
    _, path, one = tiny(name)
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(*shape))
    assert mesh.axis_names == ("data", "fsdp", "expert", "tensor")
    sharded, _ = hf.load_model(str(path), mesh, dtype=jnp.float32)
    assert sharded.layers.we_gate[...].sharding.spec[1] == "expert"
    sharded.shard_activations(mesh)
    ids, mask = _rows(one.cfg.vocab_size)  # 8 rows: split over fsdp x expert
    step = StepConfig(loss=LossConfig(vllm_importance_sampling_correction=False),
                      temperature=1.0, gradient_accumulation_steps=2, logprob_chunk=4,
                      aux_loss_coef=0.1)
    batch = jax.tree.map(jnp.asarray, _grpo_batch(one.cfg.vocab_size))

    def run(model):
        graphdef, params = nnx.split(model, nnx.Param)

        def f(p, ids, mask, b):
            m = nnx.merge(graphdef, p)
            hidden, _, stats = m(ids, positions_from_mask(mask), mask, with_router=True)
            return (m.logits(hidden), stats, *loss_and_grads(graphdef, step, p, b, group=4)[:2])
        return jax.tree.map(np.asarray, jax.jit(f)(params, jnp.asarray(ids), jnp.asarray(mask),
                                                   batch))

    want, got = run(one), run(sharded)
    for a, b in zip(jax.tree.leaves(want), jax.tree.leaves(got)):
        np.testing.assert_allclose(b, a, rtol=0, atol=1e-5 * max(1.0, np.abs(a).max()))


@pytest.mark.parametrize("family,rollout", [
    ("gpt_oss", {}), ("gpt_oss", dict(max_num_seqs=2, max_staleness=1))],
    ids=["gpt_oss", "partial"])
@pytest.mark.slow
def test_grpo_run_on_a_moe_policy(tmp_path, family, rollout):
    """Two GRPO steps with a tiny MoE policy (gpt-oss: sinks, biases, ring caches; Qwen3-MoE's
    mixed layers in the sampler are covered by the generation tests above), fsdp 2 x expert 2
    over 4 devices (the sampler's experts on the expert axis too), the checkpoint's aux-loss
    coefficient, routing replay on (the sampler's record sharded with the rows, replayed in the
    reference and update forwards): the sampler's log-probs equal the train step's, and the
    router metrics are logged, router/mismatch 0. The same as partial rollouts through 2 decode
    slots for a round's 4 rows (max_staleness 1; this run's rows all end in the round that drew
    them: rows carried with their records are test_partial.py's, refill.py's record against a
    static batch's is test_refill.py's)."""
    from hf_oracle import char_tokenizer, tiny_grpo_run
    last = tiny_grpo_run(tmp_path, tiny_hf_model(family, vocab=len(char_tokenizer())),
                         dp=1, fsdp=2, ep=2, router_replay="R3", **rollout)
    assert np.isfinite(last["loss"])
    assert last["sampling/sampling_logp_difference/max"] < 1e-4
    assert ("staleness/max" in last) == ("max_staleness" in rollout)  # partial rollouts ran
    assert last["aux_loss"] > 0 and "router/load/0" in last and last["router/load_max"] >= 1
    assert last["router/mismatch"] == 0


def test_moe_reward_model_scores_match_trl(tmp_path):
    """A Qwen3-MoE reward model (Qwen3MoeForSequenceClassification) scores as TRL's does."""
    from reward_model_oracle import batch, ours, save_reward_model, trl_rewards

    from grpo_jax.rewards import load_reward_func
    spec = str(save_reward_model(tmp_path / "moe-rm", "qwen3_moe", seed=1))
    func = load_reward_func(spec, dtype="float32")
    prompts, completions = batch(True)
    _, want = trl_rewards(spec, None, prompts, completions)
    got = ours([func], prompts, completions)[:, 0]
    assert np.abs(got - want).max() < 1e-4 and np.ptp(want) > 1e-3


@pytest.mark.parametrize("name", ["qwen3_moe", "gpt_oss"])
def test_weight_sync_sends_the_checkpoint_names(tiny, name):
    """What a vLLM server is sent (the NCCL source, one tensor at a time on the device; the
    HTTP paths use hf_state_dict) is the checkpoint's tensors under their own names."""
    from grpo_jax.rollout.vllm.nccl_sync import JaxSource
    _, path, model = tiny(name)
    source = JaxSource(model.cfg, "float32")
    source.set(nnx.split(model, nnx.Param)[1])
    sent = {k: v.numpy() for k, v in source}
    want = hf.hf_state_dict(model.cfg, hf.params_numpy(model), include_tied_head=True)
    assert sent.keys() == want.keys()
    for k in want:
        np.testing.assert_array_equal(sent[k], want[k], err_msg=k)


@pytest.mark.slow
def test_lora_adapter_on_a_moe_loads_in_peft_with_the_same_logits(tmp_path):
    """LoRA on Qwen3-MoE's attention: PEFT loads the adapter we save and gives our logits. An
    MLP module that no layer of a model has is refused, and so is PEFT's target_parameters.
    PEFT 0.21 on transformers 5 reads gate_proj/up_proj/down_proj on a MoE as the experts'
    fused parameters (rank 2r) and adapts no dense MLP, so on a MoE those names are refused
    and all-linear is attention only, also where a layer is dense."""
    from peft_oracle import ours_and_peft

    from grpo_jax.cli import load_config
    from grpo_jax.errors import ConfigError
    from grpo_jax.models import lora
    model, ref = ours_and_peft(tmp_path, "qwen3_moe", lora_target_modules=("q_proj", "v_proj"))
    real = LONG_MASK.astype(bool)
    base = hf_logits(tiny_hf_model("qwen3_moe"), LONG_TOKENS, LONG_MASK)
    theirs = hf_logits(ref, LONG_TOKENS, LONG_MASK)
    assert np.abs(theirs - base)[real].max() > 1e-2
    assert np.abs(theirs - long_logits(model))[real].max() < 1e-4
    # Mixtral has no dense MLP; Qwen3-MoE has one (a dense layer) that PEFT would not adapt.
    for name, refusal in (("mixtral", "mixtral has no dense gate_proj"),
                          ("qwen3_moe", "PEFT reads them as the experts' parameters")):
        cfg = ModelConfig.from_hf(tiny_hf_model(name).config.to_dict())
        with pytest.raises(GrpoJaxError, match=refusal):
            lora.model_targets(lora.PeftArgs(use_peft=True,
                                             lora_target_modules=("q_proj", "gate_proj")), cfg)
        every = lora.PeftArgs(use_peft=True, lora_target_modules=("all-linear",))
        assert lora.model_targets(every, cfg) == ("wq", "wk", "wv", "wo")
    with pytest.raises(ConfigError, match="target_parameters"):
        load_config(None, ["lora_target_parameters=[mlp.experts.gate_up_proj]"])


# ---------------------------------------------------------------- routing replay (R3)

class _ForcedRouter(torch.nn.Module):
    """A transformers router whose top-k experts are given (`experts` [tokens, k], batch-major
    as the MoE block flattens its tokens), their gate weights from the router's own logits:
    gpt-oss's softmax over the k forced logits, else the softmax over all experts at them,
    renormalised (Mixtral, Qwen3-MoE with norm_topk_prob). The oracle of routing replay."""

    def __init__(self, router, experts, bias, over_k: bool):
        super().__init__()
        self.router, self.experts, self.bias, self.over_k = router, experts, bias, over_k

    def forward(self, hidden):
        logits = torch.nn.functional.linear(hidden.reshape(len(self.experts), -1),
                                            self.router.weight, self.bias)
        if self.over_k:
            return logits, torch.softmax(logits.gather(1, self.experts), dim=-1), self.experts
        weights = torch.softmax(logits.float(), dim=-1).gather(1, self.experts)
        return logits, weights / weights.sum(-1, keepdim=True), self.experts


def _random_routing(cfg, rows: int, width: int, seed: int = 0) -> np.ndarray:
    """[rows, width, S, k] int8: k distinct random experts per token and sparse layer."""
    rng = np.random.default_rng(seed)
    S, E, k = sum(cfg.moe_layers), cfg.num_experts, cfg.num_experts_per_tok
    return np.argsort(rng.random((rows, width, S, E)), axis=-1)[..., :k].astype(np.int8)


def _replaying(model):
    """`model` with routing replay on (numerics.router_replay R3)."""
    model.cfg = model.cfg.replace(router_replay="R3")
    return model


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "gpt_oss"])
def test_replayed_routing_equals_a_forced_router(tiny, name):
    """The decoder's forward with replayed experts equals transformers' with every router forced
    to them (gate weights from its own logits, as R3 recomputes them): fp32 logits < 1e-5. The
    forced experts are random, so they change the logits."""
    import copy
    ref, _, model = tiny(name)
    cfg = model.cfg
    routing = _random_routing(cfg, *LONG_TOKENS.shape)
    forced = copy.deepcopy(ref)
    sparse = [i for i, s in enumerate(cfg.moe_layers) if s]
    for s, i in enumerate(sparse):
        mlp = forced.model.layers[i].mlp
        experts = torch.as_tensor(routing[:, :, s].reshape(-1, 2), dtype=torch.long)
        if name == "gpt_oss":
            mlp.router = _ForcedRouter(mlp.router, experts, mlp.router.bias, over_k=True)
        else:
            mlp.gate = _ForcedRouter(mlp.gate, experts, None, over_k=False)
    mask = jnp.asarray(LONG_MASK)
    hidden, _ = model(jnp.asarray(LONG_TOKENS), positions_from_mask(mask), mask,
                      routing=jnp.asarray(routing))
    got = np.asarray(model.logits(hidden))
    assert long_diff(got, hf_logits(forced, LONG_TOKENS, LONG_MASK)) < 1e-5
    assert long_diff(got, long_logits(model)) > 1e-3  # the forced experts matter


def test_replay_off_and_own_routing_are_bit_identical(tiny):
    """Recording the routing changes nothing, and replaying a forward's own experts gives its
    logits bit for bit (the gate weights gathered at the top-k are the top-k's values); -1
    (not recorded) routes a token itself."""
    _, _, model = tiny("qwen3_moe")
    mask = jnp.asarray(LONG_MASK)
    args = (jnp.asarray(LONG_TOKENS), positions_from_mask(mask), mask)

    @nnx.jit
    def forwards(model, *args):
        base, _ = model(*args)
        hidden, _, own = model(*args, record_routing=True)
        replayed, _ = model(*args, routing=own.astype(jnp.int8))
        unrecorded, _ = model(*args, routing=jnp.full(own.shape, -1, jnp.int8))
        return own, base, (hidden, replayed, unrecorded)
    own, base, others = forwards(model, *args)
    assert own.shape == (*LONG_TOKENS.shape, 2, 2)
    for x in others:
        np.testing.assert_array_equal(np.asarray(x), np.asarray(base))


def test_replay_under_a_perturbed_router(tiny):
    """Sample with params A (recording the routing), train-forward with the router perturbed:
    without replay router/mismatch > 0 and the log-probs move with the experts that changed;
    with replay router/mismatch is 0 and the log-probs are as close to the sampler's as the
    gate weights' own change allows. The record is aligned: under A itself the mismatch is 0
    and the log-probs the sampler's."""
    from grpo_jax.grpo.batch import Batch
    from grpo_jax.grpo.train_step import completion_logps_and_router
    _, _, model = tiny("qwen3_moe")
    prompts = [[5, 17, 99, 3, 42, 8, 77], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16]]
    sp = SamplingParams(max_completion_length=8, temperature=1.0)
    out = Sampler(model.cfg, sp, pad_id=0, buckets=(16,), record_routing=True).generate(
        model, prompts, num_generations=4, rng=0)
    assert out.completion_routing.dtype == np.int8
    assert out.completion_routing.shape == (8, 8, 2, 2) and out.prompt_routing.shape == (8, 16, 2, 2)
    assert (out.prompt_routing[out.prompt_mask == 0] == -1).all()
    batch = Batch(*(jnp.asarray(getattr(out, k)) for k in (
        "prompt_ids", "prompt_mask", "completion_ids", "completion_mask", "truncated")),
        advantages=jnp.zeros(8), prompt_routing=jnp.asarray(out.prompt_routing),
        completion_routing=jnp.asarray(out.completion_routing))
    real = out.completion_mask > 0

    @nnx.jit(static_argnums=2)
    def forward(m, b, group):
        logp, _, _, sums = completion_logps_and_router(m, b, 1.0, 4, group)
        return logp, sums

    def run(m, group=1):
        logp, sums = forward(m, batch, group)
        return np.abs(np.asarray(logp) - out.sampler_logp)[real], float(sums[0] / sums[1])

    same, zero = run(model)
    assert zero == 0.0 and same.max() < 1e-5
    graphdef, params = nnx.split(model, nnx.Param)

    def perturbed():  # a copy of A, its routers moved
        m = nnx.merge(graphdef, jax.tree.map(jnp.copy, params))
        router = m.layers.router[...]
        m.layers.router[...] = router + 1e-3 * jax.random.normal(jax.random.key(1), router.shape)
        return m
    off, mismatch = run(perturbed())
    assert mismatch > 0
    # Replayed through shared prompts (each prompt's record once per group); one row per
    # prompt replays in the bench's test (test_bench.py).
    on, replayed = run(_replaying(perturbed()), 4)
    # What is left is the gate weights' own change (linear in the perturbation: 1.3e-4 here),
    # not the experts': 8e-3 without replay.
    assert replayed == 0.0 and on.max() < off.max() / 30
