"""GRPO's own sections: groups and rewards (GRPOArgs) and the objective (LossConfig), with the
loss-type table that makes a new loss type one entry."""

from __future__ import annotations

import dataclasses
import typing
from typing import Literal, NamedTuple

from grpo_jax.config.fields import arg
from grpo_jax.errors import check


@dataclasses.dataclass(frozen=True)
class GRPOArgs:
    """Groups, rewards and how often a generation batch is reused."""
    num_generations: int = arg(
        8,
        "Completions per prompt: a group, whose rewards give each other's advantages.")
    scale_rewards: Literal["group", "batch", "none"] = arg(
        "group",
        "Divide advantages by the rewards' std over the group, the batch, or not at all (none: "
        "Dr. GRPO).")
    num_iterations: int = arg(
        1,
        "Updates on each generation batch (GRPO's mu): > 1 needs the old log-probs.")
    reward_funcs: tuple[str, ...] = arg(
        ("reward_len",),
        "Built-in names, 'package.module:function', 'path/to/file.py:function', or reward models: "
        "a directory or hub id of a ...ForSequenceClassification checkpoint "
        "(grpo_jax.reward_model).")
    reward_processing_classes: tuple[str | None, ...] | None = arg(
        None,
        "TRL's GRPOTrainer argument: one tokenizer (directory or hub id) per reward function, "
        "used for a reward model (null: the model's own), ignored for a function. None: all null.")
    reward_weights: tuple[float, ...] | None = arg(
        None,
        "One weight per reward function in the advantage's sum (null: all 1.0).")
    multi_objective_aggregation: Literal["sum_then_normalize", "normalize_then_sum"] = arg(
        "sum_then_normalize",
        "How several reward functions make one advantage (grpo_jax.grpo.advantages).")
    sync_ref_model: bool = arg(
        False,
        "TR-DPO: every ref_model_sync_steps optimizer steps, ref = alpha * policy + (1 - alpha) * "
        "ref (needs beta > 0: with beta 0 there is no reference model).")
    ref_model_mixup_alpha: float = arg(
        0.6,
        "TR-DPO's alpha: ref = alpha * policy + (1 - alpha) * ref at each sync.")
    ref_model_sync_steps: int = arg(
        512,
        "Optimizer steps between reference syncs (sync_ref_model).")
    soft_punish_cache: int | None = arg(
        None,
        "The reward soft_overlong_punishment (DAPO, TRL's get_soft_overlong_punishment): its "
        "penalty starts this many tokens before max_completion_length. Needed when it is named.")
    dynamic_sampling: bool = arg(
        False,
        "DAPO's dynamic sampling (verl: algorithm.filter_groups): groups whose rewards all agree "
        "(std 0) are dropped and more prompts are generated until the generation batch is full of "
        "groups with signal, at most max_num_gen_batches generations per batch (<= 0: no limit; "
        "10 as DAPO's recipe, verl's default is 0), then the run stops with an error. With "
        "async rounds (max_staleness >= 1: vLLM's, or a rollout_func's on the JAX sampler) the "
        "batches are generated one ahead in data order "
        "and a fill takes as many as it needs; with sampler_devices a fill takes the batch "
        "sampled a round ahead, then the sampler's next advances.")
    max_num_gen_batches: int = arg(
        10,
        "dynamic_sampling: generations per batch before the run stops with an error (<= 0: no "
        "limit).")

    def __post_init__(self):
        check(self.num_generations >= 2, "num_generations must be >= 2: GRPO's advantage "
              f"compares completions of the same prompt (got {self.num_generations})")
        check(self.num_iterations >= 1, f"num_iterations must be >= 1, got {self.num_iterations}")
        check(len(self.reward_funcs) >= 1, "reward_funcs is empty: name at least one, e.g. "
              "reward_funcs: [reward_len]")
        check(self.reward_weights is None or len(self.reward_weights) == len(self.reward_funcs),
              f"reward_weights has {len(self.reward_weights or ())} entries but reward_funcs "
              f"has {len(self.reward_funcs)}: give one weight per function")
        check(self.reward_processing_classes is None
              or len(self.reward_processing_classes) == len(self.reward_funcs),
              f"reward_processing_classes has {len(self.reward_processing_classes or ())} "
              f"entries but reward_funcs has {len(self.reward_funcs)}: give one per function "
              "(null for a reward model's own tokenizer; functions ignore theirs)")
        check(self.multi_objective_aggregation in ("sum_then_normalize", "normalize_then_sum"),
              "multi_objective_aggregation must be 'sum_then_normalize' or "
              f"'normalize_then_sum', got {self.multi_objective_aggregation!r}")
        check(0.0 <= self.ref_model_mixup_alpha <= 1.0, "ref_model_mixup_alpha must be in "
              f"[0, 1], got {self.ref_model_mixup_alpha}")
        check(self.ref_model_sync_steps >= 1,
              f"ref_model_sync_steps must be >= 1, got {self.ref_model_sync_steps}")
        check(self.soft_punish_cache is None or self.soft_punish_cache >= 0,
              f"soft_punish_cache must be >= 0 tokens, got {self.soft_punish_cache}")
        check(self.soft_punish_cache is not None
              or "soft_overlong_punishment" not in self.reward_funcs,
              "soft_overlong_punishment needs soft_punish_cache: the penalty ramps from 0 at "
              "max_completion_length - soft_punish_cache tokens to -1 at max_completion_length "
              "(DAPO: 4096 of 20480)")


LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
ISLevel = Literal["token", "sequence"]
ISMode = Literal["token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
# verl's rollout rejection sampling modes (algorithm.rollout_correction.rollout_rs): k1 is the
# log-ratio log(pi_train / pi_sampler); token_k1 judges each token, seq_mean_k1 each sequence
# by the mean of its tokens' k1 (the geometric mean of their ratios).
RSMode = Literal["token_k1", "seq_mean_k1"]


class LossKind(NamedTuple):
    """What a loss_type is, in the three places it differs (the module docstring's table)."""
    # The per-token objective: "clip" PPO's clipped ratio (TRL's default), "cispo" the capped
    # detached ratio on the log-prob's gradient, "sapo" a soft gate, "vespo" a sequence weight.
    objective: Literal["clip", "cispo", "sapo", "vespo"]
    # A micro-batch's numerator: "sum" of its masked per-token losses, "sequence_mean" the sum
    # of each sequence's token mean, "token_mean" its token mean.
    numerator: Literal["sum", "sequence_mean", "token_mean"]
    # Its denominator: "sequences" B, "one" 1, "padded" B * max_completion_length, "num_items"
    # its share of TRL's num_items_in_batch (the step's loss tokens).
    denominator: Literal["sequences", "one", "padded", "num_items"]


# A new loss type is one entry here (and its objective, when new, in micro_loss_terms). The
# metrics follow the objective: clip_ratio/* for "clip", cispo_clip_ratio, vespo/phi_seq_mean.
LOSS_KINDS: dict[str, LossKind] = {
    "grpo": LossKind("clip", "sequence_mean", "sequences"),
    "bnpo": LossKind("clip", "token_mean", "one"),
    "dr_grpo": LossKind("clip", "sum", "padded"),
    "dapo": LossKind("clip", "sum", "num_items"),
    "luspo": LossKind("clip", "sum", "sequences"),
    "sapo": LossKind("sapo", "sequence_mean", "sequences"),
    "cispo": LossKind("cispo", "sum", "num_items"),
    "vespo": LossKind("vespo", "sum", "num_items"),
}
assert set(LOSS_KINDS) == set(typing.get_args(LossType))


@dataclasses.dataclass(frozen=True)
class LossConfig:
    """The objective's settings, with TRL GRPOConfig's (1.16) names and defaults."""

    beta: float = arg(0.0, "KL coefficient; 0 needs no reference model")
    use_bias_correction_kl: bool = arg(
        True,
        "Multiply the KL term by the (differentiable) importance ratio (DeepSeek-V3.2's unbiased "
        "reverse-KL gradient). Changes the KL gradient even on-policy, where the ratio's value is "
        "1.")
    epsilon: float = arg(
        0.2,
        "The clip range below 1 of the importance ratio (and above it when epsilon_high is null).")
    epsilon_high: float | None = arg(
        None,
        "The clip range above 1 (null: epsilon); for cispo, the cap on the ratio itself.")
    delta: float | None = arg(
        None,
        "An upper bound on the unclipped ratio (INTELLECT-2); null: off.")
    loss_type: LossType = arg(
        "dapo",
        "The objective and its normaliser: grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo or vespo "
        "(TRL's).")
    sapo_temperature_neg: float = arg(1.05, "sapo's gate temperature for advantages <= 0.")
    sapo_temperature_pos: float = arg(1.0, "sapo's gate temperature for advantages > 0.")
    vespo_k_pos: float = arg(
        2.0,
        "vespo's Gamma weight exp(lambda) w^k exp(-lambda w): its k for advantages >= 0.")
    vespo_lambda_pos: float = arg(3.0, "vespo's lambda for advantages >= 0.")
    vespo_k_neg: float = arg(3.0, "vespo's k for advantages < 0.")
    vespo_lambda_neg: float = arg(2.0, "vespo's lambda for advantages < 0.")
    importance_sampling_level: ISLevel = arg(
        "token",
        "token: one importance ratio per token (GRPO); sequence: one per sequence (GSPO).")
    mask_truncated_completions: bool = arg(
        False,
        "Leave completions that hit max_completion_length out of the loss (DAPO).")
    top_entropy_quantile: float = arg(
        1.0,
        "Train on this fraction of each micro-batch's tokens, those of highest entropy (1.0: "
        "all).")
    entropy_coef: float = arg(
        0.0,
        "Entropy bonus: loss - entropy_coef * mean token entropy (per micro-batch, as TRL). With "
        "use_adaptive_entropy, entropy_coef is the initial value of a coefficient that each step "
        "moves by entropy_coef_delta within [entropy_coef_min, entropy_coef_max] (up when the "
        "step's entropy is <= entropy_target) and that applies only while entropy <= "
        "entropy_target.")
    use_adaptive_entropy: bool = arg(
        False,
        "Move entropy_coef each step toward entropy_target (TRL's adaptive controller).")
    entropy_coef_min: float = arg(0.0, "The adaptive entropy coefficient's floor.")
    entropy_coef_max: float = arg(1.0, "The adaptive entropy coefficient's ceiling.")
    entropy_coef_delta: float = arg(
        0.005,
        "How far the adaptive entropy coefficient moves per step.")
    entropy_target: float = arg(
        0.2,
        "The entropy the adaptive controller steers toward; the bonus applies while entropy is "
        "below it.")
    vllm_importance_sampling_correction: bool = arg(
        True,
        "Sampler/trainer mismatch: weight tokens by exp(old_logp - sampler_logp) (TRL's). The "
        "trainer applies it to vLLM rollouts; to the JAX sampler's only with "
        "native_importance_sampling_correction (it runs the trainer's own weights).")
    native_importance_sampling_correction: bool = arg(
        False,
        "Not TRL's: apply vllm_importance_sampling_correction's weight (its mode and clip "
        "bounds) to the JAX sampler's rollouts too. Off: the native sampler's log-probs differ "
        "from the trainer's by numerics only (bf16 vs fp32 kernels) and feed the sampling/* "
        "metrics alone. Needs vllm_importance_sampling_correction. Partial rollouts "
        "(max_staleness > 0) apply it always: their tokens come from older weights.")
    vllm_importance_sampling_mode: ISMode = arg(
        "sequence_mask",
        "How the sampler-correction weight is cut: per token or per sequence, truncated or "
        "masked.")
    vllm_importance_sampling_clip_min: float | None = arg(
        None,
        "The correction weight's lower bound (null: none).")
    vllm_importance_sampling_clip_max: float | None = arg(
        3.0,
        "The correction weight's upper bound (null: none).")
    rollout_rs: RSMode | None = arg(
        None,
        "Not TRL's: verl's rollout rejection sampling (algorithm.rollout_correction.rollout_rs), "
        "on every backend: token_k1 drops each token whose ratio exp(old_logp - sampler_logp) "
        "is outside [rollout_rs_threshold_lower, rollout_rs_threshold] (a two-sided token mask, "
        "IcePop's band without its weight); seq_mean_k1 drops every token of a sequence whose "
        "geometric-mean ratio over its loss tokens is outside it (MIS, verl's former "
        "'geometric'). Kept tokens weigh 1 (times vllm_importance_sampling_correction's weight "
        "when that applies); dropped ones still count in the loss's denominator, as TRL's "
        "*_mask modes. None: off.")
    rollout_rs_threshold: float | None = arg(
        None,
        "rollout_rs's upper bound on the ratio (verl's rollout_rs_threshold), e.g. 2.0 for "
        "token_k1, 1.001 for seq_mean_k1.")
    rollout_rs_threshold_lower: float | None = arg(
        None,
        "rollout_rs's lower bound on the ratio (verl's rollout_rs_threshold_lower); null: "
        "1 / rollout_rs_threshold, as verl.")
    off_policy_mask_threshold: float | None = arg(
        None,
        "Drop sequences with a negative advantage whose mean KL(sampler || policy) exceeds this "
        "(DeepSeek-V3.2's off-policy sequence mask); None: off.")
    router_aux_loss_coef: float | None = arg(
        None,
        "Mixtures of experts: the weight of the router's load-balancing loss (transformers' "
        "load_balancing_loss_func) added to the loss; None: the checkpoint's own "
        "router_aux_loss_coef (TRL's default), 0: off. Nonzero on a dense model is an error.")

    def __post_init__(self):
        for name, choices in (("loss_type", LossType), ("importance_sampling_level", ISLevel),
                              ("vllm_importance_sampling_mode", ISMode)):
            value, choices = getattr(self, name), typing.get_args(choices)
            check(value in choices, f"{name} must be one of {choices}, got {value!r}")
        check(self.rollout_rs is None or self.rollout_rs in typing.get_args(RSMode),
              f"rollout_rs must be one of {typing.get_args(RSMode)} or null, got "
              f"{self.rollout_rs!r}")
        check(self.beta >= 0, f"beta must be >= 0, got {self.beta}")
        check(self.epsilon > 0, f"epsilon must be > 0, got {self.epsilon}")
        check(self.epsilon_high is None or self.epsilon_high > 0,
              f"epsilon_high must be > 0 or null, got {self.epsilon_high}")
        check(self.delta is None or self.delta > 1, f"delta caps the ratio from above and must "
              f"be > 1 (TRL recommends > 1 + epsilon) or null, got {self.delta}")
        check(self.sapo_temperature_neg > 0 and self.sapo_temperature_pos > 0,
              f"sapo_temperature_neg and sapo_temperature_pos must be > 0, got "
              f"{self.sapo_temperature_neg} and {self.sapo_temperature_pos}")
        check(self.vespo_k_pos >= 0 and self.vespo_k_neg >= 0,
              f"vespo_k_pos and vespo_k_neg must be >= 0, got {self.vespo_k_pos} and "
              f"{self.vespo_k_neg}")
        check(self.vespo_lambda_pos > 0 and self.vespo_lambda_neg > 0,
              f"vespo_lambda_pos and vespo_lambda_neg must be > 0 (TRL raises smaller values to "
              f"1e-4), got {self.vespo_lambda_pos} and {self.vespo_lambda_neg}")
        check(0.0 <= self.top_entropy_quantile <= 1.0,
              f"top_entropy_quantile must be in [0, 1], got {self.top_entropy_quantile}")
        check(self.entropy_coef_min <= self.entropy_coef_max, f"entropy_coef_min "
              f"({self.entropy_coef_min}) must be <= entropy_coef_max ({self.entropy_coef_max})")
        check(self.entropy_coef_delta >= 0,
              f"entropy_coef_delta must be >= 0, got {self.entropy_coef_delta}")
        lo, hi = self.vllm_importance_sampling_clip_min, self.vllm_importance_sampling_clip_max
        check(lo is None or hi is None or lo < hi, f"vllm_importance_sampling_clip_min ({lo}) "
              f"must be < vllm_importance_sampling_clip_max ({hi})")
        check(not (self.vllm_importance_sampling_correction and lo is None and hi is None
                   and self.vllm_importance_sampling_mode.endswith("_truncate")),
              "a *_truncate vllm_importance_sampling_mode needs vllm_importance_sampling_clip_min"
              " or vllm_importance_sampling_clip_max")
        check(self.vllm_importance_sampling_correction
              or not self.native_importance_sampling_correction,
              "native_importance_sampling_correction applies vllm_importance_sampling_correction "
              "to the JAX sampler: set vllm_importance_sampling_correction true too")
        rs, rs_hi, rs_lo = (self.rollout_rs, self.rollout_rs_threshold,
                            self.rollout_rs_threshold_lower)
        check((rs is None) == (rs_hi is None) and (rs is not None or rs_lo is None),
              "rollout_rs and rollout_rs_threshold go together (rollout_rs_threshold_lower "
              f"only with them): got rollout_rs={rs!r}, rollout_rs_threshold={rs_hi}, "
              f"rollout_rs_threshold_lower={rs_lo}")
        check(rs is None or (rs_hi > 0 and (rs_lo is None or 0 < rs_lo < rs_hi)),
              f"rollout_rs's bounds must be 0 < rollout_rs_threshold_lower < "
              f"rollout_rs_threshold, got {rs_lo} and {rs_hi}")
        check(self.off_policy_mask_threshold is None or self.off_policy_mask_threshold >= 0,
              f"off_policy_mask_threshold must be >= 0 or null (TRL expects a positive value, "
              f"e.g. 0.5), got {self.off_policy_mask_threshold}")

    @property
    def eps_high(self) -> float:
        return self.epsilon if self.epsilon_high is None else self.epsilon_high

    @property
    def rollout_rs_bounds(self) -> tuple[float, float]:
        """rollout_rs's [lower, upper] bounds on the ratio (lower: 1 / upper unless given)."""
        hi = self.rollout_rs_threshold
        lo = self.rollout_rs_threshold_lower
        return (1.0 / hi if lo is None else lo), hi

    @property
    def entropy_bonus(self) -> bool:
        """Whether the loss has the entropy term (TRL: a nonzero coefficient, or adaptive)."""
        return self.entropy_coef != 0.0 or self.use_adaptive_entropy
