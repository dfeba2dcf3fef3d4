"""The GRPO loss of a multimodal batch against TRL 1.16's own GRPOTrainer._compute_loss (issue
#52): tiny random vision-language models in transformers (Gemma3ForConditionalGeneration and
Qwen2_5_VLForConditionalGeneration, fp32) and the same weights in ours (save_pretrained +
hf.load_model).

TRL's trainer is built without its __init__ (trl_oracle.trl_trainer) and runs its own
_get_per_token_logps_and_entropies on the transformers model with its fused LM head
(add_fused_lm_head, as GRPOTrainer.__init__ patches it), so a micro-batch's multimodal inputs
(Gemma 3: pixel_values, num_images, token_type_ids; Qwen2.5-VL: pixel_values, image_grid_thw,
num_images, mm_token_type_ids) go through TRL's per-micro-batch slicing and the model's forward
as in training. The batch: 2 prompts of different lengths (left-padded) with one image each, 2
completions per prompt (right-padded, one full length: truncated), advantages, old log-probs
(ours + noise: the ratio is clipped on some tokens) and reference log-probs (beta > 0: the KL
term), one optimizer step of k = 2 micro-batches (one prompt each), temperature 0.9. Ours:
train_step.loss_and_grads on the Batch with each row's pixel_values (Qwen-VL: its grid and the
M-RoPE positions of prompt + completion from qwen_vl.rope_index).

Compared: the per-token log-probs and entropies (TRL's, from the model) with completion_logps',
the step's loss, and the gradients of every language-model parameter (attention, MLP, norms,
biases, the embedding and LM head). TRL's tower gets gradients too (it trains whatever the model
leaves trainable); ours is frozen (policy.frozen_parts): its gradients are zero. Measured:
log-probs and entropies <= 4.8e-7, loss <= 1.2e-7, gradients <= 3e-6 relative to each tensor's
max |gradient| (contract: 1e-5, 1e-5, 1e-4). The same again with each prompt and its image run
once per group of rows (numerics.shared_prefix, the trainer's default)."""

import re
import types
from contextlib import nullcontext

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

torch = pytest.importorskip("torch")
pytest.importorskip("trl.trainer.grpo_trainer")
from vlm_models import BOI, EOI, IMG, MM, PAD, tiny_gemma3  # noqa: E402
import vlm_models as q  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402
from trl_oracle import trl_trainer  # noqa: E402

from grpo_jax import hf  # noqa: E402
from grpo_jax.grpo.batch import Batch  # noqa: E402
from grpo_jax.grpo.loss import LossConfig, step_metrics  # noqa: E402
from grpo_jax.grpo.train_step import StepConfig, completion_logps, loss_and_grads  # noqa: E402

G, C, K, TEMPERATURE = 2, 5, 2, 0.9  # generations per prompt, completion tokens, micro-batches
TOWER = ("vision_tower", "multi_modal_projector", "visual")  # the frozen image tower's names


def _rows(prompts, pixels, seed=0, **extra):
    """4 rows (each prompt twice, its image with it: TRL's generation batch repeats a prompt
    per generation), completions right-padded, the first one full length (truncated)."""
    rng = np.random.default_rng(seed)
    width = max(map(len, prompts))
    p_ids = np.array([[PAD] * (width - len(p)) + p for p in prompts for _ in range(G)], np.int32)
    p_mask = (p_ids != PAD).astype(np.int32)
    lengths = np.array([C, 3, 4, 2])
    c_mask = (np.arange(C)[None] < lengths[:, None]).astype(np.int32)
    c_ids = rng.integers(3, 90, (len(lengths), C)).astype(np.int32) * c_mask
    adv = np.array([0.8, -0.8, 1.3, -1.3], np.float32)
    return Batch(p_ids, p_mask, c_ids, c_mask, lengths == C, adv,
                 pixel_values=np.repeat(pixels, G, axis=0), **extra)


def _gemma3(tmp):
    """Gemma 3 (vlm_models.tiny_gemma3: a sliding window shorter than an image): rows of
    [1 image, C, H, W]; TRL's inputs: pixel_values [images, C, H, W], num_images and the
    processor's token_type_ids (1 on the image's soft tokens) extended with zeros over the
    completion, as _generate_and_score_completions extends them."""
    ref = tiny_gemma3()
    prompts = [[5, 17, BOI, *[IMG] * MM, EOI, 42, 8],
               [7, 9, 3, 30, BOI, *[IMG] * MM, EOI, 11, 12, 13, 14]]
    images = np.random.default_rng(2).normal(size=(2, 1, 3, 28, 28)).astype(np.float32)
    b = _rows(prompts, images)

    def trl_inputs(mb):
        ttype = np.concatenate([mb.prompt_ids == IMG, np.zeros_like(mb.completion_ids)], axis=1)
        return {"pixel_values": _t(mb.pixel_values.reshape(-1, 3, 28, 28), torch.float32),
                "num_images": [1] * mb.size, "token_type_ids": _t(ttype)}
    return ref, b, trl_inputs


def _qwen25(tmp):
    """Qwen2.5-VL (vlm_models.tiny_qwen25) with a 4 x 6 patch image per prompt: rows of
    [1 image, patches, C*T*P*P] and their grids, and M-RoPE positions over prompt +
    completion (qwen_vl.rope_index, the completion's padding masked); TRL's inputs: pixel_values [patches of all images, ...],
    image_grid_thw, num_images and mm_token_type_ids (zeros over the completion), from which
    transformers computes its own M-RoPE positions (get_rope_index)."""
    from grpo_jax.models import qwen_vl
    ref = q.tiny_qwen25()
    grid = q.GRIDS[1]
    merged = int(grid.prod()) // 4
    prompts = [[5, 17, q.START, *[q.IMAGE] * merged, q.END, 99, 3, 42],
               [7, q.START, *[q.IMAGE] * merged, q.END, 8, 9, 10, 11, 12]]
    images = np.random.default_rng(2).standard_normal(
        (2, int(grid.prod()), 3 * 2 * 4 * 4)).astype(np.float32)
    b = _rows(prompts, images[:, None],
              image_grid=np.tile(grid.astype(np.int32), (len(prompts) * G, 1, 1)))
    ids = np.concatenate([b.prompt_ids, b.completion_ids], axis=1)
    mask = np.concatenate([b.prompt_mask, b.completion_mask], axis=1)

    def with_positions(model):
        pos, _ = qwen_vl.rope_index(model.cfg.vision, ids, mask, np.tile(grid, (b.size, 1)))
        return b.replace(positions=np.asarray(pos).transpose(1, 0, 2))

    def trl_inputs(mb):
        mm = np.concatenate([mb.prompt_ids == q.IMAGE, np.zeros_like(mb.completion_ids)], axis=1)
        return {"pixel_values": _t(mb.pixel_values.reshape(-1, mb.pixel_values.shape[-1]),
                                   torch.float32),
                "image_grid_thw": _t(np.tile(grid, (mb.size, 1))),
                "num_images": [1] * mb.size, "mm_token_type_ids": _t(mm.astype(np.int64))}
    return ref, with_positions, trl_inputs


def _t(a, dtype=torch.long):
    return torch.as_tensor(np.asarray(a), dtype=dtype)


def _runtime_name(key):
    """A checkpoint's tensor name (hf_state_dict's) -> the module's parameter name in
    transformers 5: Gemma 3's files say language_model.model.*, vision_tower.*,
    multi_modal_projector.*; Qwen2.5-VL's model.*, visual.*; the modules are
    model.language_model.*, model.vision_tower.* (model.visual.*), ..."""
    key = re.sub(r"^language_model\.model\.", "model.language_model.", key)
    key = re.sub(r"^model\.(?!language_model\.|vision_tower\.|visual\.|multi_modal_projector\.)",
                 "model.language_model.", key)
    return re.sub(r"^(vision_tower|multi_modal_projector|visual)\.", r"model.\1.", key)


FAMILIES = {"gemma3": _gemma3, "qwen2_5_vl": _qwen25}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, tmp_path_factory):
    """(transformers model in train mode, our model from its directory, the Batch, TRL's
    multimodal inputs of a micro-batch)."""
    tmp = tmp_path_factory.mktemp(request.param)
    ref, b, trl_inputs = FAMILIES[request.param](tmp)
    ref.save_pretrained(tmp / "hf")
    model, _ = hf.load_model(str(tmp / "hf"), dtype=jnp.float32)
    b = b(model) if callable(b) else b
    return ref.train(), model, b, trl_inputs  # TRL trains in train mode (no dropout here)


def test_loss_and_gradients_match_trl(family):
    ref, model, b, trl_inputs = family
    size = b.size // K
    logp, entropy = (np.asarray(x) for x in completion_logps(model, b, TEMPERATURE, 128))
    rng = np.random.default_rng(1)
    real = b.completion_mask.astype(bool)
    b = b.replace(old_logp=(logp + 0.3 * rng.standard_normal(logp.shape)).astype(np.float32),
                  ref_logp=(logp + 0.2 * rng.standard_normal(logp.shape)).astype(np.float32))
    cfg = LossConfig(beta=0.04, vllm_importance_sampling_correction=False)  # TRL's loss_type

    # TRL: its own _get_per_token_logps_and_entropies on the model (without the profiling
    # wrapper, which needs a Trainer), the fused head patched on as GRPOTrainer.__init__ does.
    add_fused_lm_head(ref, temperature=TEMPERATURE, outputs=("log_probs", "entropy"))
    t = trl_trainer(cfg, K, K, use_vllm=False)
    t.accelerator.autocast = nullcontext
    seen = []
    own = types.MethodType(type(t)._get_per_token_logps_and_entropies.__wrapped__, t)

    def spy(*a, **kw):
        out = own(*a, **kw)
        seen.append((out[0].detach().numpy(), out[1].detach().numpy()))
        return out
    t._get_per_token_logps_and_entropies = spy
    ref.zero_grad()
    total = 0.0
    for j in range(K):
        sl = slice(j * size, (j + 1) * size)
        mb = b.rows(sl)
        inputs = {"prompt_ids": _t(mb.prompt_ids), "prompt_mask": _t(mb.prompt_mask),
                  "completion_ids": _t(mb.completion_ids),
                  "completion_mask": _t(mb.completion_mask),
                  "advantages": _t(mb.advantages, torch.float32),
                  "old_per_token_logps": _t(mb.old_logp, torch.float32),
                  "ref_per_token_logps": _t(mb.ref_logp, torch.float32),
                  "num_items_in_batch": torch.tensor(float(b.completion_mask.sum())),
                  **trl_inputs(mb)}
        t.accelerator.sync_gradients = j == K - 1
        loss = t._compute_loss(ref, inputs)
        loss.backward()
        total += float(loss.detach())

    # Log-probs and entropies: TRL's (from the model) vs ours, every real completion token.
    want_lp = np.concatenate([s[0] for s in seen])
    want_ent = np.concatenate([s[1] for s in seen])
    lp_diff = float(np.abs(logp - want_lp)[real].max())
    ent_diff = float(np.abs(entropy - want_ent)[real].max())

    # Ours: the train step's accumulation over the same k micro-batches.
    graphdef, params = nnx.split(model, nnx.Param)
    step = StepConfig(loss=cfg, temperature=TEMPERATURE, gradient_accumulation_steps=K)
    got, grads, sums = jax.jit(lambda p, bt: loss_and_grads(graphdef, step, p, bt))(
        params, jax.tree.map(jnp.asarray, b))
    loss_diff = abs(float(got) - total)

    ours = {_runtime_name(k): v for k, v in
            hf.hf_state_dict(model.cfg, hf.params_from_state(model.cfg, grads)).items()}
    theirs = {k: p.grad.numpy() for k, p in ref.named_parameters() if p.grad is not None}
    lm = sorted(k for k in set(ours) & set(theirs) if not any(x in k for x in TOWER))
    tower = [k for k in ours if any(x in k for x in TOWER)]
    rel = {k: float(np.abs(ours[k] - theirs[k]).max() / np.abs(theirs[k]).max()) for k in lm}
    worst = max(rel, key=rel.get)
    print(f"\nlog-probs max |diff| {lp_diff:.3g}, entropies {ent_diff:.3g}; loss TRL {total:.7g} "
          f"ours {float(got):.7g} |diff| {loss_diff:.3g}; {len(lm)} language-model gradients, "
          f"worst relative max |diff| {rel[worst]:.3g} ({worst})")
    assert lp_diff < 1e-5 and ent_diff < 1e-5
    assert loss_diff < 1e-5 and abs(total) > 1e-3
    assert len(lm) == len([k for k in theirs if not any(x in k for x in TOWER)]) > 10, \
        sorted(set(theirs) - set(ours))[:4]
    assert any("embed_tokens" in k for k in lm) and any("norm" in k for k in lm)
    for k in lm:
        assert rel[k] < 1e-4, (k, rel[k])
    # The metrics TRL logs per micro-batch (entropy, KL, clip ratios): step_metrics' lists.
    metrics, logged = step_metrics(sums), t._metrics["train"]
    assert logged and set(logged) <= set(metrics), set(logged) - set(metrics)
    for name, v in logged.items():
        np.testing.assert_allclose(np.asarray(metrics[name]), v, atol=1e-5, err_msg=name)

    # numerics.shared_prefix (the trainer's default): each prompt, its image with it, runs once
    # per group of G rows (the tower too); the same log-probs, entropies, loss and gradients.
    lp_g, ent_g = (np.asarray(x) for x in completion_logps(model, b, TEMPERATURE, 128, G))
    got_g, grads_g, _ = jax.jit(lambda p, bt: loss_and_grads(graphdef, step, p, bt, group=G))(
        params, jax.tree.map(jnp.asarray, b))
    ours_g = {_runtime_name(k): v for k, v in
              hf.hf_state_dict(model.cfg, hf.params_from_state(model.cfg, grads_g)).items()}
    rel_g = {k: float(np.abs(ours_g[k] - theirs[k]).max() / np.abs(theirs[k]).max()) for k in lm}
    print(f"shared prefix: log-probs {np.abs(lp_g - want_lp)[real].max():.3g}, loss |diff| "
          f"{abs(float(got_g) - total):.3g}, worst gradient {max(rel_g.values()):.3g}")
    assert np.abs(lp_g - want_lp)[real].max() < 1e-5
    assert np.abs(ent_g - want_ent)[real].max() < 1e-5
    assert abs(float(got_g) - total) < 1e-5
    for k in lm:
        assert rel_g[k] < 1e-4, (k, rel_g[k])
    assert max(logged["clip_ratio/region_mean"]) > 0  # the clipped branch is exercised
    # The tower: TRL's gradients reach it (the model leaves it trainable), ours are zero.
    assert tower and all(not np.any(ours[k]) for k in tower)
    assert any(np.abs(theirs[k]).max() > 0 for k in tower if k in theirs)
