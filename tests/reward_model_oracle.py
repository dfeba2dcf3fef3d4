"""Reward models against TRL 1.16 with transformers (PyTorch CPU, fp32): a tiny random
`...ForSequenceClassification` with a chat template, TRL's own scoring of it, a batch of chat
prompts and completions, and the trainer's rewards. Shared by test_reward_model and test_moe."""

import torch
import transformers
from hf_oracle import char_tokenizer, tiny_hf_model
from trl.data_utils import apply_chat_template, is_conversational

from grpo_jax.rewards import completions_for_rewards, compute_rewards

# A chat template that reads a chat_template_kwargs key, so the test sees them passed on.
TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</s>{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}{% if loud %}!{% endif %}")
PROMPTS = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}],
           [{"role": "user", "content": "Name a colour."}],
           [{"role": "user", "content": "Count to three, slowly and with feeling, please."}]]
COMPLETIONS = ["Hello.", "", "One... two... three! " * 5, "Blue", "x", "Red, or maybe green."]


def tokenizer(template=TEMPLATE, pad=True):
    tok = char_tokenizer()
    tok.chat_template = template
    if not pad:
        tok.pad_token = None
    return tok


def save_reward_model(out, family="llama", *, num_labels=1, seed=0, vocab=99, tok=None):
    """A tiny random `...ForSequenceClassification` (TRL's reward model): the decoder of
    tiny_hf_model (norms and biases perturbed), a random score head; saved with `tok`
    (default: char_tokenizer with TEMPLATE; False: no tokenizer)."""
    tok = tokenizer() if tok is None else tok
    causal = tiny_hf_model(family, seed=seed, vocab=vocab)
    config = causal.config
    config.num_labels = num_labels
    model = transformers.AutoModelForSequenceClassification.from_config(config).eval()
    model.model.load_state_dict(causal.model.state_dict())
    with torch.no_grad():
        model.score.weight.copy_(torch.randn(num_labels, config.hidden_size))
    model.save_pretrained(out)
    if tok is not False:
        tok.save_pretrained(out)
    return out


def trl_rewards(spec, processing_class=None, prompts=(), completions=(),
                chat_template_kwargs=None):
    """TRL 1.16's GRPOTrainer with a reward model, its lines copied verbatim from __init__
    (loading, the processing class and its pad token) and `_calculate_rewards` (texts,
    tokens, score), but for `self.` attributes made locals and the device (CPU). Returns
    (the name TRL logs it under, the scores)."""
    reward_func = transformers.AutoModelForSequenceClassification.from_pretrained(
        spec, num_labels=1).eval()
    name = getattr(reward_func.config, "_name_or_path", "").split("/")[-1]
    reward_processing_class = processing_class
    if reward_processing_class is None:
        reward_processing_class = transformers.AutoTokenizer.from_pretrained(
            getattr(reward_func.config, "_name_or_path", ""))
    if reward_processing_class.pad_token_id is None:
        reward_processing_class.pad_token = reward_processing_class.eos_token
    reward_func.config.get_text_config().pad_token_id = reward_processing_class.pad_token_id
    chat_template_kwargs = chat_template_kwargs or {}
    if is_conversational({"prompt": prompts[0]}):
        messages = [{"messages": p + c} for p, c in zip(prompts, completions, strict=True)]
        texts = [
            apply_chat_template(x, reward_processing_class, **chat_template_kwargs)["text"]
            for x in messages
        ]
    else:
        texts = [p + c for p, c in zip(prompts, completions, strict=True)]
    reward_inputs = reward_processing_class(
        text=texts, return_tensors="pt", padding=True, padding_side="right",
        add_special_tokens=False
    )
    with torch.inference_mode():
        return name, reward_func(**reward_inputs).logits[:, 0].numpy()


def batch(chat=True):
    """6 rows of 3 prompts x 2 completions of different lengths, in TRL's form."""
    prompts = [p for p in PROMPTS for _ in range(2)]
    if not chat:
        prompts = [p[-1]["content"] + "\n" for p in prompts]
    return prompts, completions_for_rewards(prompts, COMPLETIONS)


def ours(funcs, prompts, completions):
    """The rewards as the trainer computes them: [N, F]."""
    return compute_rewards(funcs, prompts, completions, [[1]] * len(prompts))
