"""The GRPO loss of a multimodal batch against TRL 1.16's own GRPOTrainer._compute_loss (issue
#52): a tiny random Gemma 3 vision-language model (Gemma3ForConditionalGeneration, fp32) in
transformers and the same weights in ours (save_pretrained + hf.load_model).

TRL's trainer is built without its __init__ (trl_oracle.trl_trainer) and runs its own
_get_per_token_logps_and_entropies on the transformers model with its fused LM head
(add_fused_lm_head, as GRPOTrainer.__init__ patches it), so the micro-batch's pixel_values,
num_images and token_type_ids go through TRL's slicing and the model's forward as in training.
The batch: 2 prompts of different lengths (left-padded) with one image each, 2 completions per
prompt (right-padded, one of them full length: truncated), advantages, old and reference
log-probs (beta > 0: the KL term), one optimizer step of k = 2 micro-batches (one prompt each).
Ours: train_step.loss_and_grads on the Batch with each row's pixel_values.

Compared: each micro-batch's per-token log-probs and entropies (TRL's, from the model) with
completion_logps', the step's loss, and the gradients of every language-model parameter
(attention, MLP, norms, the tied embedding / LM head). TRL's tower gets gradients too (it trains
whatever the model leaves trainable); ours is frozen (policy.frozen_parts): its gradients are
zero, the language model's are compared."""

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
from test_vlm_gemma3 import BOI, EOI, IMG, MM, PAD, _tiny_vlm  # noqa: E402
from trl.trainer.utils import add_fused_lm_head  # noqa: E402
from trl_oracle import trl_trainer  # noqa: E402

from grpo_jax import hf  # noqa: E402
from grpo_jax.grpo.batch import Batch  # noqa: E402
from grpo_jax.grpo.loss import LossConfig  # noqa: E402
from grpo_jax.grpo.train_step import StepConfig, completion_logps, loss_and_grads  # noqa: E402

G, C, K, TEMPERATURE = 2, 5, 2, 0.9  # generations per prompt, completion tokens, micro-batches
PROMPTS = [[5, 17, BOI, *[IMG] * MM, EOI, 42, 8],
           [7, 9, 3, 30, BOI, *[IMG] * MM, EOI, 11, 12, 13, 14]]


def _batch(seed=0):
    """4 rows (each prompt twice, its image with it), as TRL's generation batch holds them."""
    rng = np.random.default_rng(seed)
    width = max(map(len, PROMPTS))
    p_ids = np.array([[PAD] * (width - len(p)) + p for p in PROMPTS for _ in range(G)], np.int32)
    p_mask = (p_ids != PAD).astype(np.int32)
    lengths = np.array([C, 3, 4, 2])
    c_mask = (np.arange(C)[None] < lengths[:, None]).astype(np.int32)
    c_ids = rng.integers(3, 90, (len(lengths), C)).astype(np.int32) * c_mask
    images = rng.normal(size=(len(PROMPTS), 3, 28, 28)).astype(np.float32)
    pixels = np.repeat(images, G, axis=0)[:, None]  # [N, 1 image, C, H, W]
    adv = np.array([0.8, -0.8, 1.3, -1.3], np.float32)
    return Batch(p_ids, p_mask, c_ids, c_mask, lengths == C, adv, pixel_values=pixels)


def _runtime_name(key):
    """A checkpoint's tensor name (hf_state_dict's: Gemma 3's files say language_model.model.*,
    vision_tower.*) -> the module's parameter name in transformers 5 (model.language_model.*,
    model.vision_tower.*)."""
    key = re.sub(r"^language_model\.model\.", "model.language_model.", key)
    return re.sub(r"^(vision_tower|multi_modal_projector)\.", r"model.\1.", key)


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    ref = _tiny_vlm()
    path = tmp_path_factory.mktemp("gemma3_loss") / "hf"
    ref.save_pretrained(path)
    model, _ = hf.load_model(str(path), dtype=jnp.float32)
    return ref.train(), model  # TRL trains the model in train mode (no dropout here)


def test_loss_and_gradients_match_trl(gemma3):
    ref, model = gemma3
    b = _batch()
    n, size = b.size, b.size // K
    logp, entropy = (np.asarray(x) for x in completion_logps(model, b, TEMPERATURE, 128))
    rng = np.random.default_rng(1)
    real = b.completion_mask.astype(bool)
    b = b.replace(old_logp=(logp + 0.1 * rng.standard_normal(logp.shape)).astype(np.float32),
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
    t_ = lambda a, dtype=torch.long: torch.as_tensor(np.asarray(a), dtype=dtype)  # noqa: E731
    total = 0.0
    for j in range(K):
        sl = slice(j * size, (j + 1) * size)
        ids = np.concatenate([b.prompt_ids[sl], b.completion_ids[sl]], axis=1)
        # The processor's token_type_ids (1 on the image's soft tokens), zeros over the
        # completion (TRL's _generate_and_score_completions extends them so).
        ttype = np.concatenate([b.prompt_ids[sl] == IMG, np.zeros_like(b.completion_ids[sl])],
                               axis=1)
        assert ttype.shape == ids.shape
        inputs = {"prompt_ids": t_(b.prompt_ids[sl]), "prompt_mask": t_(b.prompt_mask[sl]),
                  "completion_ids": t_(b.completion_ids[sl]),
                  "completion_mask": t_(b.completion_mask[sl]),
                  "advantages": t_(b.advantages[sl], torch.float32),
                  "old_per_token_logps": t_(b.old_logp[sl], torch.float32),
                  "ref_per_token_logps": t_(b.ref_logp[sl], torch.float32),
                  "num_items_in_batch": torch.tensor(float(b.completion_mask.sum())),
                  "pixel_values": t_(b.pixel_values[sl].reshape(-1, 3, 28, 28), torch.float32),
                  "num_images": [1] * size, "token_type_ids": t_(ttype)}
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
    got, grads, _ = jax.jit(lambda p, bt: loss_and_grads(graphdef, step, p, bt))(
        params, jax.tree.map(jnp.asarray, b))
    loss_diff = abs(float(got) - total)

    ours = {_runtime_name(k): v for k, v in
            hf.hf_state_dict(model.cfg, hf.params_from_state(model.cfg, grads)).items()}
    theirs = {k: p.grad.numpy() for k, p in ref.named_parameters() if p.grad is not None}
    lm = sorted(k for k in set(ours) & set(theirs) if "language_model" in k)
    tower = [k for k in ours if "vision_tower" in k or "multi_modal_projector" in k]
    rel = {k: float(np.abs(ours[k] - theirs[k]).max() / np.abs(theirs[k]).max()) for k in lm}
    worst = max(rel, key=rel.get)
    print(f"\nlog-probs max |diff| {lp_diff:.3g}, entropies {ent_diff:.3g}; loss TRL {total:.7g} "
          f"ours {float(got):.7g} |diff| {loss_diff:.3g}; {len(lm)} language-model gradients, "
          f"worst relative max |diff| {rel[worst]:.3g} ({worst})")
    assert lp_diff < 1e-5 and ent_diff < 1e-5
    assert loss_diff < 1e-5 and abs(total) > 1e-3
    assert len(lm) == len([k for k in theirs if "language_model" in k]) > 10
    assert any("embed_tokens" in k for k in lm) and any("norm" in k for k in lm)
    for k in lm:
        assert rel[k] < 1e-4, (k, rel[k])
    # The tower: TRL's gradients reach it (the model leaves it trainable), ours are zero.
    assert tower and all(not np.any(ours[k]) for k in tower)
    assert any(np.abs(theirs[k]).max() > 0 for k in tower if k in theirs)
