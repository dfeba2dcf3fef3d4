"""Reward models in reward_funcs against TRL 1.16 with transformers (PyTorch CPU, fp32): scores,
names, tokenizers, bad checkpoints, and a short GRPO run with one."""

import json
from pathlib import Path

import jax
import numpy as np
import pytest
from hf_oracle import char_tokenizer, tiny_hf_model
from reward_model_oracle import batch, ours, save_reward_model, tokenizer, trl_rewards

from grpo_jax import reward_model
from grpo_jax.cli import config_from_dict
from grpo_jax.errors import ConfigError
from grpo_jax.mesh import MeshConfig, make_mesh
from grpo_jax.rewards import RewardError, load_reward_func, load_reward_funcs, reward_names

REWARD = f"{Path(__file__).parent / 'reward_fixtures.py'}:even_tokens"
OTHER_TEMPLATE = "{% for m in messages %}[{{ m['role'][0] }}] {{ m['content'] }}\n{% endfor %}"


@pytest.mark.parametrize("family,mesh_shape", [("llama", None), ("qwen2", (2, 2, 2)),
                                               ("gemma2", None), ("gemma3_text", None),
                                               ("mistral", None)])
def test_scores_match_trl_with_transformers(tmp_path, family, mesh_shape):
    """Chat and plain prompts through TRL's path (texts, tokens, last non-pad token), on one
    device and sharded over dp x fsdp x tp; the name TRL logs is the directory's."""
    spec = str(save_reward_model(tmp_path / f"my-{family}-rm", family, seed=1))
    mesh = None if mesh_shape is None else make_mesh(MeshConfig(*mesh_shape))
    kwargs = {"loud": True}
    func = load_reward_func(spec, mesh=mesh, dtype="float32", chat_template_kwargs=kwargs)
    for chat in (True, False):
        prompts, completions = batch(chat)
        name, want = trl_rewards(spec, None, prompts, completions, kwargs)
        got = ours([func], prompts, completions)[:, 0]
        assert reward_names([func]) == [name] == [f"my-{family}-rm"]
        assert np.abs(got - want).max() < 1e-4, (got, want)
        assert np.ptp(want) > 1e-3  # the rows do differ
    if mesh is not None:
        assert func.fn.params["embed"][...].sharding.mesh == mesh


def test_long_texts_split_into_few_programs(tmp_path, monkeypatch):
    """Texts longer than the smallest bucket and batches cut by the token budget still score
    as transformers does; a batch shape compiles once."""
    spec = str(save_reward_model(tmp_path / "rm", seed=2))
    func = load_reward_func(spec)
    prompts = ["Q: " + "word " * (3 + 7 * i) for i in range(7)]
    completions = ["A." * i for i in range(7)]
    _, want = trl_rewards(spec, None, prompts, completions)
    monkeypatch.setattr(reward_model, "TOKENS_PER_BATCH", 128)  # 1 or 2 rows a batch
    compiles = []

    def on_event(event, duration, **kw):
        if event == "/jax/core/compile/backend_compile_duration":
            compiles.append(event)
    jax.monitoring.register_event_duration_secs_listener(on_event)
    try:
        got = ours([func], prompts, completions)[:, 0]
        first = len(compiles)
        again = ours([func], prompts[::-1], completions[::-1])[:, 0]
    finally:
        jax.monitoring.unregister_event_duration_listener(on_event)
    assert np.abs(got - want).max() < 1e-4 and np.array_equal(again, got[::-1])
    # 7 texts of 18 to 240 tokens, longest first: batches of (rows, length) (1, 256) twice,
    # (1, 192), (1, 160), (1, 96) and (2, 64); in another order they compile nothing more.
    assert 1 <= first <= 5 and len(compiles) == first, compiles


def test_separate_tokenizer_from_reward_processing_classes(tmp_path):
    """reward_processing_classes: one entry per function (null for functions and for a
    model's own tokenizer); a tokenizer without a pad token pads with EOS, as in TRL, and
    transformers then scores the last token that is not EOS."""
    own = save_reward_model(tmp_path / "rm", seed=3)  # its own tokenizer: TEMPLATE
    other = tmp_path / "other_tok"
    tokenizer(OTHER_TEMPLATE, pad=False).save_pretrained(other)
    bare = save_reward_model(tmp_path / "bare", seed=4, tok=False)  # no tokenizer files
    prompts, completions = batch()
    funcs = load_reward_funcs(["reward_len", str(own), str(own), str(bare)],
                              [str(other), None, str(other), str(other)])
    got = ours(funcs, prompts, completions)
    _, with_own = trl_rewards(str(own), None, prompts, completions)
    _, with_other = trl_rewards(str(own), tokenizer(OTHER_TEMPLATE, pad=False), prompts,
                                completions)
    _, bare_other = trl_rewards(str(bare), tokenizer(OTHER_TEMPLATE, pad=False), prompts,
                                completions)
    assert np.abs(got[:, 1] - with_own).max() < 1e-4
    assert np.abs(got[:, 2] - with_other).max() < 1e-4
    assert np.abs(got[:, 3] - bare_other).max() < 1e-4
    assert np.abs(with_own - with_other).max() > 1e-3
    assert funcs[2].fn.tokenizer.pad_token == "</s>"
    assert reward_names(funcs) == ["reward_len", "rm", "rm_2", "bare"]
    with pytest.raises(RewardError, match="has no tokenizer files .* name the model's "
                                          "tokenizer in reward_processing_classes"):
        load_reward_func(str(bare))
    with pytest.raises(RewardError, match="reward_processing_classes has 1 entries but "
                                          "reward_funcs has 2"):
        load_reward_funcs(["reward_len", str(own)], [None])


def test_reward_processing_classes_setting():
    cfg = config_from_dict({"reward_funcs": ["reward_len", "org/rm"],
                            "reward_processing_classes": [None, "org/tok"]})
    assert cfg.grpo.reward_processing_classes == (None, "org/tok")
    assert config_from_dict({}, ["reward_processing_classes=[null]"]
                            ).grpo.reward_processing_classes == (None,)
    with pytest.raises(ConfigError, match="reward_processing_classes has 1 entries but "
                                          "reward_funcs has 2: give one per function"):
        config_from_dict({"reward_funcs": ["reward_len", "org/rm"],
                          "reward_processing_classes": ["org/tok"]})


def _bad_dirs(tmp_path):
    causal = tmp_path / "causal"
    tiny_hf_model("llama", vocab=99).save_pretrained(causal)
    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2ForSequenceClassification"], "model_type": "gpt2"}))
    return {"causal": causal, "gpt2": gpt2,
            "three": save_reward_model(tmp_path / "three", num_labels=3)}


@pytest.mark.parametrize("spec,needle", [
    ("{causal}", r"is a LlamaForCausalLM, not a \.\.\.ForSequenceClassification model"),
    ("{three}", r"gives 3 scores per text \(score.weight has 3 rows; config.json num_labels "
                r"3\); a reward model gives one score"),
    ("{gpt2}", "unsupported model_type 'gpt2'.*grpo_jax supports llama, mistral, phi3, qwen2, qwen3, gemma2"),
    ("{tmp}/no/such/dir", "no such directory, and not a hub id"),
    ("no-such-org/no-such-rm", "could not be fetched from the Hugging Face hub.*hf download"),
])
def test_bad_reward_models_one_clear_error(tmp_path, spec, needle):
    dirs = _bad_dirs(tmp_path)
    with pytest.raises(RewardError, match=needle):
        load_reward_func(spec.format(tmp=tmp_path, **dirs))


def test_tokenizer_that_does_not_fit_the_model(tmp_path):
    func = load_reward_func(str(save_reward_model(tmp_path / "rm", vocab=40)))
    assert func.fn(["ab"], ["c"])  # ids below 40 score
    with pytest.raises(RewardError, match=r"token ids outside its vocabulary \[0, 40\): the "
                                          "tokenizer is not the model's"):
        func.fn(["XYZ"], ["Z"])


def test_bad_reward_model_stops_the_program_with_one_line(tmp_path, capsys):
    from grpo_jax.train import main
    policy = tmp_path / "policy"
    tok = char_tokenizer()
    tiny_hf_model("llama", tie=True, vocab=len(tok)).save_pretrained(policy)
    tok.save_pretrained(policy)
    (tmp_path / "p.jsonl").write_text(json.dumps({"prompt": "hi"}) + "\n")
    causal = tmp_path / "causal"
    tiny_hf_model("llama", vocab=len(tok)).save_pretrained(causal)
    code = main(["--model_name_or_path", str(policy), "--dataset_name",
                 str(tmp_path / "p.jsonl"), "--reward_funcs", f"[reward_len, {causal}]",
                 "--output_dir", str(tmp_path / "out"), "--report_to", "[]"])
    err = capsys.readouterr().err
    errors = [line for line in err.splitlines() if line.startswith("grpo_jax.train: error:")]
    assert code == 2 and len(errors) == 1 and "Traceback" not in err, err
    assert "reward model" in errors[0] and "not a ...ForSequenceClassification" in errors[0]


@pytest.mark.slow
def test_grpo_run_with_a_reward_model(tmp_path):
    """A reward model beside a function: its column is logged under its name, and the rewards
    (weight 0 on the function) are transformers' scores of TRL's texts of the completions."""
    from grpo_jax.cli import load_config
    from grpo_jax.train import train
    tok = char_tokenizer()
    policy = tmp_path / "policy"
    tiny_hf_model("llama", tie=True, vocab=len(tok)).save_pretrained(policy)
    tok.save_pretrained(policy)
    rm = save_reward_model(tmp_path / "tiny-rm", "qwen2", seed=5, tok=tok)
    with open(tmp_path / "p.jsonl", "w") as f:
        for i in range(8):
            f.write(json.dumps({"prompt": f"Post {i}: say something.\n"}) + "\n")
    sets = {"name_or_path": policy, "dtype": "float32", "dataset_name": tmp_path / "p.jsonl",
            "reward_funcs": f"[{REWARD}, {rm}]", "reward_weights": "[0.0, 1.0]",
            "num_generations": 4, "max_completion_length": 8,
            "per_device_train_batch_size": 8, "learning_rate": 0.01, "beta": 0.0,
            "output_dir": tmp_path / "out", "report_to": "[]", "max_steps": 2, "dp": 1,
            "log_completions": True, "num_completions_to_print": 0, "logging_steps": 1}
    cfg = load_config(None, [f"{k}={v}" for k, v in sets.items()])
    last = train(cfg, devices=jax.devices()[:1])
    records = [json.loads(line) for line in (tmp_path / "out" / "metrics.jsonl").open()]
    assert [r["step"] for r in records] == [1, 2]
    assert np.isfinite(last["rewards/tiny-rm/mean"]) and "rewards/even_tokens/mean" in last
    rows = [json.loads(line) for line in (tmp_path / "out" / "completions.jsonl").open()]
    assert len(rows) == 16
    prompts, completions = [r["prompt"] for r in rows], [r["completion"] for r in rows]
    name, want = trl_rewards(str(rm), None, prompts, completions)
    assert name == "tiny-rm"
    assert np.abs(np.array([r["reward"] for r in rows]) - want).max() < 1e-4
