"""LoRA: the adapted forward, the trainable/frozen split, PEFT's files in both directions."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from hf_oracle import hf_logits, tiny_hf_model

from grpo_jax import hf, mesh as mesh_lib, peft_io
from grpo_jax.errors import ConfigError
from grpo_jax.grpo.optimizer import OptimizerConfig
from grpo_jax.grpo.train_step import StepConfig
from grpo_jax.models import Decoder, lora
from grpo_jax.models.lora import PeftArgs
from grpo_jax.policy import ADAPTERS_OFF, Policy
from model_oracle import MASK, TOKENS, jax_logits
from peft_oracle import ours_and_peft, peft_model, peft_train_config
from step_batches import CFG, loss_config, make_batch
from tiny_run import config, stopped_at

ALL = ("all-linear",)


def _adapted(peft=PeftArgs(use_peft=True, lora_target_modules=ALL), seed=0, b_scale=0.0):
    """The tiny decoder with adapters; B random (scaled by `b_scale`) so they change outputs."""
    model = Decoder(CFG, rngs=nnx.Rngs(0))
    lora.add_adapters(model, peft, jax.random.key(seed))
    if b_scale:
        for i, (name, var) in enumerate(sorted(vars(model.layers).items())):
            if name.endswith("_lora_b"):
                var.set_value(b_scale * jax.random.normal(jax.random.key(i), var.shape))
    return model


@pytest.mark.slow
def test_zero_b_starts_at_the_base_and_adapters_change_the_output():
    base = Decoder(CFG, rngs=nnx.Rngs(0))
    np.testing.assert_array_equal(jax_logits(_adapted()), jax_logits(base))
    assert np.abs(jax_logits(_adapted(b_scale=0.1)) - jax_logits(base)).max() > 1e-3


def test_adapter_forward_equals_the_merged_weights():
    model = _adapted(b_scale=0.1)
    merged = peft_io.merged_model(model)
    assert not any(isinstance(v, lora.LoraParam) for v in vars(merged.layers).values())
    np.testing.assert_allclose(jax_logits(model), jax_logits(merged), atol=1e-4)


def test_scale_and_init_follow_peft():
    assert PeftArgs(lora_r=16, lora_alpha=32).scale == 2.0
    assert PeftArgs(lora_r=16, lora_alpha=32, use_rslora=True).scale == 8.0
    model = _adapted(PeftArgs(lora_r=4, lora_target_modules=("o_proj", "down_proj")))
    a = model.layers.wo_lora_a[...]
    assert a.shape == (CFG.num_layers, CFG.num_heads, CFG.head_dim, 4)
    fan_in = CFG.num_heads * CFG.head_dim
    assert 0.8 / fan_in ** 0.5 < float(jnp.abs(a).max()) <= 1 / fan_in ** 0.5  # kaiming-uniform
    assert not np.any(np.asarray(model.layers.w_down_lora_b[...]))
    assert not hasattr(model.layers, "wq_lora_a")


@pytest.mark.parametrize("kw,msg", [
    (dict(lora_r=0), "lora_r must be >= 1"),
    (dict(lora_target_modules=("q_proj", "qkv_proj")), "match no module"),
    (dict(lora_target_modules=("qkv", "fc1")), "select no module of the language model"),
    (dict(lora_dropout=1.0), "lora_dropout=1.0: a dropout probability"),
])
def test_bad_settings_are_one_clear_error(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        PeftArgs(use_peft=True, **kw)


def test_lora_settings_from_the_command_line():
    from grpo_jax.cli import load_config
    cfg = load_config("smol", ["use_peft=true", "lora_target_modules=all-linear", "lora_r=8",
                               "load_in_4bit=true"])
    assert cfg.peft.target_modules() == tuple(lora.TARGETS) and cfg.peft.quant_bits == 4
    cfg = load_config(None, ["use_peft=true", "lora_target_modules=[q_proj, up_proj]"])
    assert cfg.peft.targets() == ("wq", "w_up")
    with pytest.raises(ConfigError, match="no DoRA"):
        load_config(None, ["use_peft=true", "use_dora=true"])
    with pytest.raises(ConfigError, match="sync_ref_model with use_peft"):
        load_config(None, ["use_peft=true", "sync_ref_model=true", "beta=0.1"])


def _trainer(model, mesh, lr=1e-2):
    step_cfg = StepConfig(loss=loss_config(beta=0.04), temperature=0.9,
                          gradient_accumulation_steps=2, logprob_chunk=4)
    return Policy(model, step_cfg, OptimizerConfig(learning_rate=lr, lr_scheduler_type="constant"),
                   10, mesh)


@pytest.mark.slow
def test_trainer_trains_only_the_adapters_and_the_reference_is_the_base():
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=2, fsdp=2, tp=2))
    model = _adapted(b_scale=0.01)
    base = Decoder(CFG, rngs=nnx.Rngs(0))
    trainer = _trainer(model, mesh)
    state = trainer.init_state
    names = {k for k in state.params["layers"]}
    assert names and all("_lora_" in k for k in names)
    batch = make_batch(with_old=False)
    ref = np.asarray(trainer.logps(ADAPTERS_OFF, batch))
    plain = _trainer(base, mesh)
    np.testing.assert_allclose(ref, np.asarray(plain.logps(plain.init_state.params, batch)),
                               atol=1e-6)
    frozen = jax.tree.map(np.asarray, trainer.frozen[0])
    state, metrics = trainer.step(state, batch.replace(ref_logp=ref))
    state, metrics = trainer.step(state, batch.replace(ref_logp=ref))
    # Per-micro-batch metrics (TRL logs each micro-batch's loss and KL).
    assert np.isfinite(np.asarray(metrics["loss"])).all() and (np.asarray(metrics["kl"]) > 0).all()
    jax.tree.map(np.testing.assert_array_equal, frozen, jax.tree.map(np.asarray,
                                                                     trainer.frozen[0]))
    # The sampler's merged weights give the trained model's log-probs.
    merged = trainer.rollout_params(state.params)
    np.testing.assert_allclose(np.asarray(plain.logps(merged, batch)),
                               np.asarray(trainer.logps(state.params, batch)), atol=1e-4)


@pytest.mark.slow
def test_smollm2_r16_all_linear_trains_a_few_percent(smol_model):
    """r=16 on every linear layer of SmolLM2-135M: the trainable count, gradients and AdamW
    state are the adapters' size (well under 5% of full fine-tuning)."""
    model = nnx.clone(smol_model)  # the adapters go on a copy of the session's
    full = model.cfg.num_params()
    lora.add_adapters(model, PeftArgs(use_peft=True, lora_r=16, lora_target_modules=ALL),
                      jax.random.key(0))
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(1, 1, 1), jax.devices()[:1])
    trainer = _trainer(model, mesh)
    state = trainer.init_state
    c = model.cfg
    per_layer = 16 * (c.hidden_size + c.q_size  # q: D -> H*Dh
                      + 2 * (c.hidden_size + c.kv_size)  # k, v
                      + (c.q_size + c.hidden_size)  # o
                      + 3 * (c.hidden_size + c.intermediate_size))  # gate, up, down
    trainable = lora.count(state.params)
    assert trainable == c.num_layers * per_layer == 4_884_480
    assert trainable / full < 0.05 and full == 134_515_008
    opt_bytes = sum(x.nbytes for x in jax.tree.leaves(state.opt_state))
    # AdamW's mu and nu (fp32) plus a few counters: 2 x the adapters, never the base.
    assert 2 * 4 * trainable <= opt_bytes < 2 * 4 * trainable + 1024
    grads = jax.eval_shape(lambda p: p, state.params)
    assert sum(x.size for x in jax.tree.leaves(grads)) == trainable
    print(f"trainable {trainable} of {full} ({trainable / full:.2%}); "
          f"optimizer state {opt_bytes / 2**20:.1f} MiB "
          f"(full fine-tuning: {8 * full / 2**20:.0f} MiB)")


@pytest.mark.parametrize("family,targets,rslora", [("llama", ALL, False),
                                                   ("qwen2", ("q_proj", "o_proj", "up_proj"),
                                                    True)])
@pytest.mark.slow
def test_our_adapter_loads_in_peft_with_the_same_logits(tmp_path, family, targets, rslora):
    model, ref = ours_and_peft(tmp_path, family, lora_target_modules=targets,
                               use_rslora=rslora)
    theirs, ours = hf_logits(ref, TOKENS, MASK), jax_logits(model)
    base_logits = hf_logits(tiny_hf_model(family), TOKENS, MASK)
    real = MASK.astype(bool)
    assert np.abs(theirs - base_logits)[real].max() > 1e-2  # the adapter matters
    print(f"our adapter in PEFT: max |logit diff| {np.abs(theirs - ours)[real].max():.2e}")
    assert np.abs(theirs - ours)[real].max() < 1e-4


@pytest.mark.slow
def test_peft_adapter_is_our_starting_point_and_merge_export(tmp_path):
    import transformers
    tiny_hf_model("qwen2", tie=True).save_pretrained(tmp_path / "base")
    ref = peft_model(tmp_path / "base", r=8, lora_alpha=16, use_rslora=True,
                     target_modules="all-linear")
    ref.save_pretrained(tmp_path / "adapter")
    conf = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    assert conf["base_model_name_or_path"] == str(tmp_path / "base")
    # The adapter's settings win over the config's (a note says so).
    cfg = peft_io.adapter_settings(peft_train_config(tmp_path / "adapter"))
    assert (cfg.peft.lora_r, cfg.peft.lora_alpha, cfg.peft.use_rslora) == (8, 16, True)
    assert cfg.peft.target_modules() == tuple(lora.TARGETS)
    model, model_dir = peft_io.load_model(cfg, None)
    assert model_dir == tmp_path / "base"
    real = MASK.astype(bool)
    err = np.abs(jax_logits(model) - hf_logits(ref, TOKENS, MASK))[real].max()
    print(f"PEFT adapter in ours: max |logit diff| {err:.2e}")
    assert err < 1e-4
    # --merge's model: a plain HF directory with the same logits.
    hf.save_hf(peft_io.merged_model(model), tmp_path / "merged", source_dir=model_dir)
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    assert np.abs(hf_logits(merged, TOKENS, MASK) - hf_logits(ref, TOKENS, MASK))[real].max() \
        < 1e-4


def test_adapter_errors(tmp_path):
    tiny_hf_model("llama").save_pretrained(tmp_path / "base")
    tiny_hf_model("llama", intermediate_size=64).save_pretrained(tmp_path / "other")
    peft_model(tmp_path / "base", r=4, target_modules=["down_proj"]).save_pretrained(
        tmp_path / "adapter")
    with pytest.raises(ConfigError, match="is a PEFT adapter: set use_peft"):
        peft_io.adapter_settings(peft_train_config(tmp_path / "adapter").__class__(
            model=peft_train_config(tmp_path / "adapter").model))
    # The adapter moved onto another base: its shapes don't fit.
    conf_path = tmp_path / "adapter" / "adapter_config.json"
    conf = json.loads(conf_path.read_text())
    conf_path.write_text(json.dumps({**conf, "base_model_name_or_path": str(tmp_path / "other")}))
    with pytest.raises(peft_io.AdapterError, match="does not fit base model .*other"):
        peft_io.load_model(peft_io.adapter_settings(peft_train_config(tmp_path / "adapter")), None)
    conf_path.write_text(json.dumps({**conf, "use_dora": True}))
    with pytest.raises(peft_io.AdapterError, match="use_dora"):
        peft_io.adapter_settings(peft_train_config(tmp_path / "adapter"))


@pytest.mark.slow
def test_lora_run_checkpoints_adapters_only_resumes_exactly_and_exports(tmp_path, tiny_dir):
    """beta > 0 (the reference: the base, adapters off), the run to 3 resumed from its step-1
    checkpoint ends as it did (2 steps per generation batch: the checkpoint falls inside one,
    the resumed run finishes it and generates the next); checkpoints hold the adapters and
    their optimizer state only; both exports."""
    import transformers

    from grpo_jax.checkpoint import load_checkpoint
    from grpo_jax.export import main as export_main
    from grpo_jax.train import train
    four = dict(per_device_train_batch_size=4, generation_batch_size=8, beta=0.04,
                use_peft="true", lora_r=4, lora_alpha=16, lora_target_modules="all-linear",
                learning_rate=0.05)
    cpu = jax.devices()[:1]
    train(config(tiny_dir, tmp_path / "full", max_steps=3, save_steps=1, **four), devices=cpu)
    stopped_at(tmp_path / "full", tmp_path / "cut", 1)
    train(config(tiny_dir, tmp_path / "cut", max_steps=3, save_steps=1, resume=True, **four),
          devices=cpu)
    a, _, _ = load_checkpoint(tmp_path / "full")
    b, base_dir, step = load_checkpoint(tmp_path / "cut")
    assert step == 3 and base_dir == tiny_dir
    adapters = lambda m: nnx.state(m, lora.LoraParam)  # noqa: E731
    diffs = jax.tree.map(lambda x, y: float(np.abs(np.asarray(x) - np.asarray(y)).max()),
                         adapters(a), adapters(b))
    assert max(jax.tree.leaves(diffs)) < 1e-6
    assert float(np.abs(np.asarray(b.layers.wq_lora_b[...])).max()) > 0  # it trained
    kl = [json.loads(line)["kl"] for line in (tmp_path / "full" / "metrics.jsonl").open()]
    assert max(kl) > 0  # the reference (the base) stays behind the trained adapters
    saved = json.loads((tmp_path / "full" / "checkpoints" / "3" / "state" / "_METADATA")
                       .read_text())["tree_metadata"]
    params = [k for k in saved if k.startswith("('params'")]
    assert len(params) == 14 and all("_lora_" in k for k in params), params
    assert not any("embed" in k or "'wq'," in k for k in saved)

    assert export_main(["--checkpoint", str(tmp_path / "full"), "--out",
                        str(tmp_path / "adapter"), "--dtype", "float32"]) == 0
    assert export_main(["--checkpoint", str(tmp_path / "full"), "--out",
                        str(tmp_path / "merged"), "--dtype", "float32", "--merge"]) == 0
    peft_ref = peft_model(tiny_dir, tmp_path / "adapter")
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    tokens = TOKENS % a.cfg.vocab_size
    ours = jax_logits(a, tokens)
    real = MASK.astype(bool)
    assert np.abs(hf_logits(peft_ref, tokens, MASK) - ours)[real].max() < 1e-4
    assert np.abs(hf_logits(merged, tokens, MASK) - ours)[real].max() < 1e-4


@pytest.mark.parametrize("bits,rel", [(8, 0.01), (4, 0.1)])
@pytest.mark.slow
def test_quantized_weights_and_the_dequantized_matmul(bits, rel):
    from grpo_jax.models import quant
    w = jax.random.normal(jax.random.key(0), (2, 128, 4, 16))
    codes, scale = quant.quantize(w, 1, bits)
    assert codes.shape == w.shape and codes.dtype == (jnp.int8 if bits == 8 else jnp.uint4)
    assert scale.shape == (2, 1 if bits == 8 else 2, 64)  # per output, or per 64 inputs too
    back = quant.dequantize(codes, scale, jnp.float32, stacked=True)
    assert float(jnp.linalg.norm(back - w) / jnp.linalg.norm(w)) < rel
    # The decoder's quantized matmul equals a plain matmul with the dequantized weights.
    model = _adapted(b_scale=0.1)
    quant.quantize_model(model, bits)
    assert model.layers.wq[...].dtype == codes.dtype
    plain = peft_io.merged_model(model)
    assert plain.layers.wq[...].dtype == jnp.float32
    np.testing.assert_allclose(jax_logits(model), jax_logits(plain), atol=2e-5)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.slow
def test_trainer_on_a_quantized_base(bits):
    from grpo_jax.models import quant
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=2, fsdp=2, tp=2))
    model, twin = _adapted(b_scale=0.01), _adapted()
    quant.quantize_model(model, bits)
    quant.quantize_model(twin, bits)
    trainer = _trainer(model, mesh)
    plain = _trainer(peft_io.merged_model(twin), mesh)  # the quantized base, dequantized
    batch = make_batch(with_old=False)
    ref = np.asarray(trainer.logps(ADAPTERS_OFF, batch))
    np.testing.assert_allclose(ref, np.asarray(plain.logps(plain.init_state.params, batch)),
                               atol=1e-5)
    codes = np.asarray(trainer.frozen[0]["layers"]["w_up"].get_value())
    state, metrics = trainer.step(trainer.init_state, batch.replace(ref_logp=ref))
    assert np.isfinite(np.asarray(metrics["loss"])).all()
    np.testing.assert_array_equal(codes, trainer.frozen[0]["layers"]["w_up"].get_value())
    merged = trainer.rollout_params(state.params)
    assert "w_up_qscale" not in merged["layers"]
    np.testing.assert_allclose(np.asarray(plain.logps(merged, batch)),
                               np.asarray(trainer.logps(state.params, batch)), atol=1e-4)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.slow
def test_load_quantizes_each_weight_as_it_is_placed(tiny_dir, bits):
    """hf.load_model(quant_bits=) (a projection quantized right after it is placed, a layer at
    a time) stores what quantizing the loaded model stores, sharded as the weights are."""
    from grpo_jax.models import quant
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=1, fsdp=4, tp=2))
    model, _ = hf.load_model(str(tiny_dir), mesh, quant_bits=bits)
    want, _ = hf.load_model(str(tiny_dir), mesh)
    for leaf in quant.PROJECTIONS:
        w = getattr(want.layers, leaf)[...]
        codes, scale = quant.quantize(w, quant.num_inputs(leaf), bits)  # all layers at once
        got = getattr(model.layers, leaf)[...]
        assert got.dtype == codes.dtype and got.sharding == w.sharding
        np.testing.assert_array_equal(np.asarray(got.astype(jnp.int32)),
                                      np.asarray(codes.astype(jnp.int32)))
        np.testing.assert_allclose(np.asarray(getattr(model.layers, f"{leaf}_qscale")[...]),
                                   np.asarray(scale), rtol=1e-6)


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.slow
def test_sampler_runs_the_adapters_on_a_quantized_base(bits):
    """QLoRA's JAX sampler takes (adapters, quantized base), never a dequantized merged copy:
    its log-probs are the LoRA model's own (as the trainer computes them) on a mesh and off,
    and its tokens those of the merged weights. A round hands it that pair."""
    from grpo_jax.grpo.batch import Batch
    from grpo_jax.grpo.train_step import completion_logps
    from grpo_jax.models import quant
    from grpo_jax.rollout.base import WeightMode
    from grpo_jax.rollout.native.rollout import JaxRollout
    from grpo_jax.rollout.native.sampler import Sampler
    from grpo_jax.rollout.native.sampling import SamplingParams
    from grpo_jax.config import GRPOArgs
    from grpo_jax.round import GRPORound
    peft = PeftArgs(use_peft=True, lora_target_modules=ALL, load_in_8bit=bits == 8,
                    load_in_4bit=bits == 4)
    model = _adapted(peft, b_scale=0.05)
    quant.quantize_model(model, bits)
    _, adapters, base = nnx.split(model, lora.LoraParam, nnx.Param)
    sp = SamplingParams(max_completion_length=8, temperature=1.0)
    prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [3]]
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=2, fsdp=2, tp=2))
    rollout = JaxRollout(CFG, sp, pad_id=0, mesh=mesh, peft=peft)
    assert rollout.weight_mode is WeightMode.READ_ADAPTERS
    out = rollout.generate((adapters, base), prompts, 2, 4)
    one = Sampler(CFG, sp, pad_id=0, peft=peft).generate((adapters, base), prompts, 2, rng=4)
    np.testing.assert_array_equal(out.completion_ids, one.completion_ids)
    batch = Batch(out.prompt_ids, out.prompt_mask, out.completion_ids, out.completion_mask,
                  out.truncated, np.zeros(len(out.truncated), np.float32))
    logp, _ = completion_logps(model, batch, 1.0, 8)
    m = out.completion_mask.astype(bool)
    np.testing.assert_allclose(out.sampler_logp[m], np.asarray(logp)[m], atol=1e-5)
    merged = peft_io.merged_model(model)
    plain = Sampler(CFG, sp, pad_id=0).generate(merged, prompts, 2, rng=4)
    np.testing.assert_array_equal(plain.completion_ids, one.completion_ids)
    with pytest.raises(ValueError, match="adapters, base"):
        Sampler(CFG, sp, pad_id=0, peft=peft).generate(nnx.state(merged, nnx.Param), prompts)
    trainer = _trainer(model, mesh)
    weights = GRPORound(trainer, rollout, None, None, (), GRPOArgs()).rollout_weights(
        trainer.init_state.params)
    assert weights[1] is trainer.frozen[0]
    assert JaxRollout(CFG, sp, pad_id=0, mesh=mesh, peft=PeftArgs(use_peft=True)
                      ).weight_mode is WeightMode.READ  # unquantized: merged, faster to decode


@pytest.mark.parametrize("kw,msg", [
    (dict(load_in_4bit=True, bnb_4bit_quant_type="fp4"), "fp4.* not supported"),
    (dict(load_in_4bit=True, load_in_8bit=True), "choose one"),
    (dict(use_peft=False, load_in_8bit=True), "set use_peft"),
])
def test_bad_quantization_settings(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        PeftArgs(**{"use_peft": True, **kw})


# Measured on SmolLM2-135M-Instruct (one English paragraph, 45 tokens), against the fp32
# model: KL(fp32 || x) per token and top-1 agreement. bf16 weights: 0.0014, 100%; int8:
# 0.0068, 95.5%; nf4: 0.45, 79.5% (a 135M model loses much at 4 bits; the GGUF it comes from
# was already 4-bit). The bounds: about twice the measured divergence.
QUANT_TOLERANCE = {"bf16": (0.003, 0.95), 8: (0.015, 0.9), 4: (1.0, 0.7)}


@pytest.mark.slow
def test_smollm2_quantized_base_logits_within_tolerance(smol_dir, smol_model):
    from grpo_jax.models import positions_from_mask, quant
    text = ("The quick brown fox jumps over the lazy dog. In 1905, Albert Einstein published "
            "four papers that changed physics: on the photoelectric effect, Brownian motion, "
            "special relativity and mass-energy equivalence.")
    import transformers
    ids = jnp.asarray([transformers.AutoTokenizer.from_pretrained(smol_dir)(text)["input_ids"]])
    mask = jnp.ones_like(ids)

    def logp(model):
        hidden, _ = model(ids, positions_from_mask(mask), mask)
        return np.asarray(jax.nn.log_softmax(model.logits(hidden), -1))[0]
    ref = logp(smol_model)
    bf16, _ = hf.load_model(str(smol_dir), dtype=jnp.bfloat16, param_dtype=jnp.bfloat16)
    for kind, (max_kl, min_top1) in QUANT_TOLERANCE.items():
        model = bf16
        if kind != "bf16":  # quantize_model replaces the weights in place: on a copy
            model = nnx.clone(bf16)
            quant.quantize_model(model, kind)
        got = logp(model)
        kl = float((np.exp(ref) * (ref - got)).sum(-1).mean())
        top1 = float((got.argmax(-1) == ref.argmax(-1)).mean())
        print(f"{kind}: KL {kl:.4f}, top-1 agreement {top1:.3f}")
        assert kl < max_kl and top1 >= min_top1, (kind, kl, top1)


@pytest.mark.parametrize("quant_key", ["load_in_8bit", "load_in_4bit"])
@pytest.mark.slow
def test_qlora_run_and_merged_export(tmp_path, tiny_dir, quant_key):
    import transformers

    from grpo_jax.checkpoint import load_checkpoint
    from grpo_jax.export import main as export_main
    from grpo_jax.train import train
    cfg = config(tiny_dir, tmp_path / "run", max_steps=2, beta=0.04, use_peft="true",
                 lora_target_modules="[q_proj, down_proj]", **{quant_key: "true"})
    train(cfg, devices=jax.devices()[:1])
    model, _, _ = load_checkpoint(tmp_path / "run")
    assert model.layers.w_up[...].dtype == (jnp.int8 if quant_key == "load_in_8bit"
                                            else jnp.uint4)
    assert export_main(["--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "hf"),
                        "--dtype", "float32", "--merge"]) == 0
    merged = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = TOKENS % model.cfg.vocab_size
    real = MASK.astype(bool)
    assert np.abs(hf_logits(merged, tokens, MASK) - jax_logits(model, tokens))[real].max() < 1e-4


# ------------------------------------------------------------------ lora_dropout

def _grads(model, batch, key=None):
    from grpo_jax.grpo.train_step import loss_and_grads
    graphdef, adapters, frozen = nnx.split(model, lora.LoraParam, nnx.Param)
    cfg = StepConfig(loss=loss_config(), temperature=0.9, gradient_accumulation_steps=2,
                     logprob_chunk=4)
    loss, grads, _ = jax.jit(lambda a, k: loss_and_grads(graphdef, cfg, a, batch, frozen=(
        frozen,), dropout_key=k))(adapters, key)
    return float(loss), jax.tree.map(np.asarray, grads)


def _max_diff(a, b):
    return max(jax.tree.leaves(jax.tree.map(lambda x, y: float(np.abs(x - y).max()), a, b)))


@pytest.mark.slow
def test_lora_dropout_in_the_train_forward_only():
    batch = make_batch(with_old=False, with_ref=False)
    key = jax.random.key(7)
    plain = _adapted(b_scale=0.1)
    dropped = _adapted(PeftArgs(use_peft=True, lora_target_modules=ALL, lora_dropout=0.3),
                       b_scale=0.1)
    loss0, g0 = _grads(plain, batch)
    # Dropout 0: a key changes nothing, bit for bit.
    loss0k, g0k = _grads(plain, batch, key)
    assert loss0k == loss0 and _max_diff(g0, g0k) == 0
    # Dropout > 0 without a key (evaluation, old/reference log-probs): the same forward.
    loss_eval, g_eval = _grads(dropped, batch)
    assert loss_eval == loss0 and _max_diff(g0, g_eval) == 0
    np.testing.assert_array_equal(jax_logits(dropped), jax_logits(plain))
    # In the train step: other gradients (the loss, on-policy, is the same value: ratio 1),
    # reproducible from the key, new with another key.
    g1 = _grads(dropped, batch, key)[1]
    assert _max_diff(g0, g1) > 1e-4
    assert _max_diff(g1, _grads(dropped, batch, key)[1]) == 0
    assert _max_diff(g1, _grads(dropped, batch, jax.random.key(8))[1]) > 1e-4


@pytest.mark.slow
def test_trainer_with_lora_dropout_on_a_mesh():
    """Sharded over (dp, fsdp, tp): the step drops (other adapters after it than without
    dropout), while the log-prob passes (old, reference) do not."""
    mesh = mesh_lib.make_mesh(mesh_lib.MeshConfig(dp=2, fsdp=2, tp=2))
    peft = PeftArgs(use_peft=True, lora_target_modules=ALL, lora_dropout=0.3)
    dropped, plain = _trainer(_adapted(peft, b_scale=0.01), mesh), _trainer(
        _adapted(b_scale=0.01), mesh)
    batch = make_batch(with_old=False)
    logp = np.asarray(dropped.logps(dropped.init_state.params, batch))
    np.testing.assert_array_equal(logp, np.asarray(plain.logps(plain.init_state.params, batch)))
    states = [t.step(t.init_state, batch)[0] for t in (dropped, plain)]
    assert _max_diff(*[jax.tree.map(np.asarray, s.params) for s in states]) > 1e-6


def test_lora_dropout_masks_follow_torch_dropout():
    x = jnp.ones((4, 64, 32))
    y = lora.dropout(x, jnp.float32(0.25), jax.random.key(0))
    kept = np.asarray(y) != 0
    assert abs(kept.mean() - 0.75) < 0.02
    np.testing.assert_allclose(np.asarray(y)[kept], 1 / 0.75, rtol=1e-6)
    # Each adapted module and layer draws its own mask: q, k and v see other inputs.
    model = lora.with_dropout(_adapted(PeftArgs(use_peft=True, lora_target_modules=ALL,
                                                lora_dropout=0.5)), jax.random.key(1))
    keys = model.layer_params()[lora.DROPOUT_KEY]
    assert keys.shape == (CFG.num_layers,)
    assert len({tuple(np.asarray(jax.random.key_data(k)).ravel()) for k in keys}) == CFG.num_layers


def test_lora_dropout_eval_forward_equals_peft_eval(tmp_path):
    import torch
    model, ref = ours_and_peft(tmp_path, "llama", lora_target_modules=ALL, lora_dropout=0.2)
    drops = [m for n, m in ref.named_modules() if n.endswith("lora_dropout.default")]
    assert drops and all(isinstance(m, torch.nn.Dropout) and m.p == 0.2 for m in drops)
    real = MASK.astype(bool)
    theirs = hf_logits(ref, TOKENS, MASK)  # eval mode: PEFT skips its dropout
    assert np.abs(theirs - jax_logits(model))[real].max() < 1e-4
    # The train step's forward (a key) drops, as PEFT's in train mode does.
    trained = lora.with_dropout(model, jax.random.key(0))
    assert np.abs(theirs - jax_logits(trained))[real].max() > 1e-3


@pytest.mark.slow
def test_lora_dropout_run_trains_and_resumes_exactly(tmp_path, tiny_dir):
    from grpo_jax.checkpoint import load_checkpoint
    from grpo_jax.train import train
    kw = dict(per_device_train_batch_size=4, generation_batch_size=16, use_peft="true",
              lora_r=4, lora_alpha=16, lora_target_modules="all-linear", lora_dropout=0.1,
              learning_rate=0.05)
    cpu = jax.devices()[:1]
    train(config(tiny_dir, tmp_path / "full", max_steps=4, save_steps=2, **kw), devices=cpu)
    stopped_at(tmp_path / "full", tmp_path / "cut", 2)
    train(config(tiny_dir, tmp_path / "cut", max_steps=4, save_steps=2, resume=True, **kw),
          devices=cpu)
    train(config(tiny_dir, tmp_path / "nodrop", max_steps=4, **{**kw, "lora_dropout": 0.0}),
          devices=cpu)
    adapters = lambda out: nnx.state(load_checkpoint(out)[0], lora.LoraParam)  # noqa: E731
    full = adapters(tmp_path / "full")
    assert _max_diff(full, adapters(tmp_path / "cut")) < 1e-6  # the same masks after resume
    assert _max_diff(full, adapters(tmp_path / "nodrop")) > 1e-4  # the masks did something
    assert float(np.abs(np.asarray(full["layers"]["wq_lora_b"][...])).max()) > 0  # it trained
    hist = [json.loads(line) for line in (tmp_path / "full" / "metrics.jsonl").open()]
    assert [h["step"] for h in hist] == [1, 2, 3, 4]  # one round of 4 updates, a record each
    assert all(np.isfinite(h["loss"]) and h["grad_norm"] > 0 for h in hist)
