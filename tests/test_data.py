"""Prompt loading: files, built-ins, chat templates, left truncation, batches, resume, errors."""

import json
import logging
import re
import time

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
from transformers import PreTrainedTokenizerFast

from grpo_jax.config import DataArgs
from grpo_jax.data import (ARITHMETIC_TEST, DataError, DataPosition, arithmetic_columns,
                           arithmetic_questions, load_prompts)
from grpo_jax.scoring import reward_inputs

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


@pytest.fixture(scope="module")
def tok():
    """One token per byte (ids = the ByteLevel alphabet order) plus ChatML specials."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    inner = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    t = PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<|im_end|>",
                                additional_special_tokens=["<|im_start|>"])
    t.chat_template = CHATML
    return t


def _ids(tok, text):
    return tok(text, add_special_tokens=False)["input_ids"]


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_jsonl_strings_extra_columns_and_left_truncation(tmp_path, tok, caplog):
    texts = ["short one", "x" * 5 + "the end of a long prompt", "abcdefghijklmnopqrstuvwxyz"]
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": t, "answer": str(i), "completion": "ref"}
                                         for i, t in enumerate(texts)])
    with caplog.at_level(logging.WARNING, logger="grpo_jax.data"):
        ds = load_prompts(DataArgs(dataset_name=path, max_prompt_length=12, shuffle_dataset=False),
                          tok)
    assert ds.num_truncated == 2 and "2 of 3 prompts" in caplog.text
    for i, t in enumerate(texts):
        assert ds.prompt_ids(i) == _ids(tok, t)[-12:]  # the left end goes
        assert tok.decode(ds.prompt_ids(i)) == t[-12:]
    rec = ds.record(1)
    assert rec["prompt"] == texts[1] and rec["answer"] == "1"
    assert "completion" not in rec  # reference columns are not reward inputs (as in TRL)


def test_chat_prompts_use_the_template(tmp_path, tok):
    msgs = [[{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}],
            [{"role": "user", "content": "2+2?"}]]
    ds = load_prompts(DataArgs(dataset_name=_jsonl(tmp_path / "c.jsonl",
                                                   [{"question": m} for m in msgs]),
                               prompt_column="question", max_prompt_length=None), tok)
    want = ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi?<|im_end|>\n"
            "<|im_start|>assistant\n")
    assert ds.prompt_ids(0) == _ids(tok, want) and ds.record(0)["prompt"] == msgs[0]
    assert ds.num_truncated == 0
    tok_plain = PreTrainedTokenizerFast(tokenizer_object=tok.backend_tokenizer)
    with pytest.raises(DataError, match="no chat template"):
        load_prompts(DataArgs(dataset_name=_jsonl(tmp_path / "d.jsonl", [{"prompt": msgs[1]}])),
                     tok_plain)


@pytest.fixture(scope="module")
def bos_tok():
    """A tokenizer that adds a BOS with its special tokens (as Llama's does), whose chat template
    writes the BOS itself."""
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    inner = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    inner.add_special_tokens(["<s>", "<|im_end|>", "<|im_start|>"])
    bos = inner.token_to_id("<s>")
    inner.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[
        ("<s>", bos)])
    t = PreTrainedTokenizerFast(tokenizer_object=inner, bos_token="<s>", eos_token="<|im_end|>",
                                additional_special_tokens=["<|im_start|>"])
    t.chat_template = "{{ bos_token }}" + CHATML
    return t


def test_plain_prompts_get_special_tokens_chat_prompts_only_the_template(tmp_path, bos_tok):
    """TRL 1.16: plain strings go through processing_class(text=prompts) (special tokens added:
    a BOS here); chat prompts through apply_chat_template(tokenize=True), which adds none."""
    tok = bos_tok
    texts = ["hello there", "2+2?"]
    ds = load_prompts(DataArgs(dataset_name=_jsonl(tmp_path / "s.jsonl", [{"prompt": t}
                                                                          for t in texts]),
                               shuffle_dataset=False), tok)
    for i, t in enumerate(texts):
        assert ds.prompt_ids(i) == tok(text=t)["input_ids"]
        assert ds.prompt_ids(i)[0] == tok.bos_token_id and ds.prompt_ids(i)[1:] == _ids(tok, t)
    msgs = [[{"role": "user", "content": t}] for t in texts]
    ds = load_prompts(DataArgs(dataset_name=_jsonl(tmp_path / "c.jsonl", [{"prompt": m}
                                                                          for m in msgs]),
                               shuffle_dataset=False), tok)
    for i, m in enumerate(msgs):
        want = tok.apply_chat_template(m, add_generation_prompt=True, tokenize=True,
                                       return_dict=True)["input_ids"]
        assert ds.prompt_ids(i) == list(want)
        assert ds.prompt_ids(i).count(tok.bos_token_id) == 1  # the template's, not a second


def test_csv_parquet_and_file_errors(tmp_path, tok):
    (tmp_path / "p.csv").write_text("prompt,label\nhello,a\nworld,b\n")
    ds = load_prompts(DataArgs(dataset_name=str(tmp_path / "p.csv"), shuffle_dataset=False), tok)
    assert [ds.record(i)["label"] for i in range(2)] == ["a", "b"]
    import datasets
    datasets.Dataset.from_dict({"prompt": ["p0", "p1", "p2"]}).to_parquet(tmp_path / "p.parquet")
    ds = load_prompts(DataArgs(dataset_name=str(tmp_path / "p.parquet"),
                               dataset_train_split="train[:2]"), tok)
    assert len(ds) == 2
    with pytest.raises(DataError, match=r"no column 'prompt'.*\['label', 'text'\]"):
        load_prompts(DataArgs(dataset_name=_jsonl(tmp_path / "t.jsonl",
                                                  [{"text": "a", "label": 1}])), tok)
    with pytest.raises(DataError, match="one split"):
        load_prompts(DataArgs(dataset_name=str(tmp_path / "p.csv"), dataset_train_split="test"),
                     tok)
    (tmp_path / "p.txt").write_text("x")
    with pytest.raises(DataError, match="supported files"):
        load_prompts(DataArgs(dataset_name=str(tmp_path / "p.txt")), tok)
    with pytest.raises(DataError, match="not found"):
        load_prompts(DataArgs(dataset_name=str(tmp_path / "missing.jsonl")), tok)
    with pytest.raises(DataError, match="tokenizes to nothing"):
        load_prompts(DataArgs(dataset_name=_jsonl(tmp_path / "e.jsonl", [{"prompt": ""}])), tok)
    with pytest.raises(DataError, match="must be a string or a list"):
        load_prompts(DataArgs(dataset_name=_jsonl(tmp_path / "n.jsonl", [{"prompt": 3}])), tok)


def _dataset(tmp_path, tok, n, shuffle=True, seed=0):
    path = _jsonl(tmp_path / f"n{n}.jsonl", [{"prompt": f"p{i}", "idx": i} for i in range(n)])
    return load_prompts(DataArgs(dataset_name=path, shuffle_dataset=shuffle, seed=seed), tok)


def test_batches_cover_each_epoch_and_resume_exactly(tmp_path, tok):
    ds = _dataset(tmp_path, tok, 10)
    pos, seen, epochs = DataPosition(), [], []
    for _ in range(6):  # 3 per batch: 3 batches per epoch, the 10th row of each epoch skipped
        recs, pos = ds.batch_prompts(pos, 3)
        seen.append([r["idx"] for r in recs])
        epochs.append(pos.epoch)
    assert pos == DataPosition(1, 9) and epochs == [0, 0, 0, 1, 1, 1]
    for epoch in (seen[:3], seen[3:]):
        flat = sum(epoch, [])
        assert len(set(flat)) == 9  # no repeats within an epoch
    assert sum(seen[:3], []) != sum(seen[3:], [])  # reshuffled per epoch
    # Resume from a stored position in a fresh dataset object: the same batches follow.
    fresh = _dataset(tmp_path, tok, 10)
    pos2 = DataPosition(*json.loads(json.dumps(DataPosition(0, 6))))
    again = []
    for _ in range(3):
        recs, pos2 = fresh.batch_prompts(pos2, 3)
        again.append([r["idx"] for r in recs])
    assert again == seen[2:5]
    other_seed = _dataset(tmp_path, tok, 10, seed=1).batch_prompts(DataPosition(), 9)[0]
    assert [r["idx"] for r in other_seed] != sum(seen[:3], [])
    plain = _dataset(tmp_path, tok, 10, shuffle=False)
    assert [r["idx"] for r in plain.batch_prompts(DataPosition(0, 2), 4)[0]] == [2, 3, 4, 5]
    with pytest.raises(DataError, match="has 10 prompts"):
        ds.batch_prompts(DataPosition(), 11)


def test_reward_inputs_repeat_groups_consecutively(tmp_path, tok):
    ds = _dataset(tmp_path, tok, 4, shuffle=False)
    recs, _ = ds.batch_prompts(DataPosition(), 2)
    prompts, columns = reward_inputs(recs, 3)
    assert prompts == ["p0"] * 3 + ["p1"] * 3
    assert columns == {"idx": [0, 0, 0, 1, 1, 1]}


def test_smol_prompts_builtin(tok):
    """The shipped posts (TL;DR-formatted, varied subreddits) reach the model as one chat turn:
    the post's body and the TL;DR request."""
    import json
    from importlib import resources
    text = (resources.files("grpo_jax") / "assets" / "smol_prompts.jsonl").read_text()
    raw = [json.loads(line)["prompt"] for line in text.splitlines() if line.strip()]
    assert 200 <= len(raw) <= 300 and len(set(raw)) == len(raw)
    pattern = re.compile(r"SUBREDDIT: r/\w+\n\nTITLE: [^\n]+\n\nPOST: (.+)\n\nTL;DR:", re.DOTALL)
    bodies = []
    for p in raw:
        m = pattern.fullmatch(p)
        assert m, p
        assert 40 <= len(m.group(1).split()) <= 120
        bodies.append(m.group(1).strip())
    assert len({p.split("\n")[0] for p in raw}) >= 10
    ds = load_prompts(DataArgs(dataset_name="smol_prompts"), tok)
    assert len(ds) == len(raw)
    for msgs, body in zip(ds.prompts, bodies):
        assert [m["role"] for m in msgs] == ["user"]
        assert msgs[0]["content"] == body + "\n\nTL;DR in a few words:"


def test_arithmetic_builtin(tok):
    cols = arithmetic_columns(7, size=300)
    assert cols == arithmetic_columns(7, size=300) and cols != arithmetic_columns(8, size=300)
    for msgs, answer in zip(cols["prompt"], cols["answer"]):
        a, op, b = re.match(r"What is (\d+) ([+\-x]) (\d+)\?", msgs[0]["content"]).groups()
        assert int(answer) == {"+": int(a) + int(b), "-": int(a) - int(b),
                               "x": int(a) * int(b)}[op]
    ds = load_prompts(DataArgs(dataset_name="arithmetic"), tok)
    assert len(ds) == 2000 and ds.record(0)["answer"] == arithmetic_columns(42)["answer"][0]
    assert tok.decode(ds.prompt_ids(0)).endswith("<|im_start|>assistant\n")
    # The test split: ARITHMETIC_TEST questions, once each, none of them ever in train.
    test = load_prompts(DataArgs(dataset_name="arithmetic"), tok, test=True)
    held_out = [m[0]["content"] for m in test.prompts]
    assert len(held_out) == len(set(held_out)) == ARITHMETIC_TEST
    train_questions = {m[0]["content"] for m in ds.prompts}
    assert not train_questions & set(held_out)
    assert len(train_questions | set(held_out)) == len(arithmetic_questions()) == 126
    assert held_out != [m[0]["content"] for m in
                        arithmetic_columns(43, "test")["prompt"]]  # the seed picks them
    with pytest.raises(DataError, match=r"splits \['train', 'test'\], not 'validation'"):
        load_prompts(DataArgs(dataset_name="arithmetic", dataset_test_split="validation"), tok,
                     test=True)
    with pytest.raises(DataError, match="eval_dataset_name"):
        load_prompts(DataArgs(dataset_name="smol_prompts"), tok, test=True)


def test_eval_split_sources(tok, tmp_path):
    rows = [{"prompt": f"p{i}"} for i in range(10)]
    path = _jsonl(tmp_path / "all.jsonl", rows)
    cfg = DataArgs(dataset_name=path, dataset_train_split="train[:80%]",
                   dataset_test_split="train[80%:]", shuffle_dataset=False)
    train, test = load_prompts(cfg, tok), load_prompts(cfg, tok, test=True)
    assert train.prompts == [f"p{i}" for i in range(8)] and test.prompts == ["p8", "p9"]
    with pytest.raises(DataError, match="slices split it.*eval_dataset_name"):
        load_prompts(DataArgs(dataset_name=path), tok, test=True)
    # A separate eval file: the whole of it (or a slice named in dataset_test_split).
    other = _jsonl(tmp_path / "eval.jsonl", [{"prompt": "q0"}, {"prompt": "q1"}])
    assert load_prompts(DataArgs(dataset_name=path, eval_dataset_name=other), tok,
                        test=True).prompts == ["q0", "q1"]
    assert load_prompts(DataArgs(dataset_name=path, eval_dataset_name=other,
                                 dataset_test_split="train[:1]"), tok, test=True).prompts == ["q0"]
    # A directory with train and test files: datasets' own splits.
    (tmp_path / "d").mkdir()
    _jsonl(tmp_path / "d" / "train.jsonl", rows[:3])
    _jsonl(tmp_path / "d" / "test.jsonl", rows[3:5])
    assert load_prompts(DataArgs(dataset_name=str(tmp_path / "d"), shuffle_dataset=False), tok,
                        test=True).prompts == ["p3", "p4"]


def test_hub_offline_fails_fast_with_the_fix(tok, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    t0 = time.time()
    with pytest.raises(DataError, match="HF_HUB_OFFLINE is set.*not in it.*dataset_name"):
        load_prompts(DataArgs(dataset_name="grpo-jax-tests/not-cached-anywhere"), tok)
    assert time.time() - t0 < 20


def test_hub_unreachable_fails_fast_without_offline_flag(tok, monkeypatch):
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    for var in ("HF_DATASETS_OFFLINE", "http_proxy", "https_proxy", "HTTP_PROXY", "HTTPS_PROXY",
                "all_proxy", "ALL_PROXY"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # nothing listens on the discard port
    t0 = time.time()
    with pytest.raises(DataError, match="unreachable.*HF_HUB_OFFLINE=1"):
        load_prompts(DataArgs(dataset_name="trl-lib/tldr"), tok)
    assert time.time() - t0 < 10


def test_system_prompt_chat_template_and_kwargs(tmp_path):
    """open-r1's system_prompt turns every prompt into [system, user]; chat_template replaces the
    tokenizer's; chat_template_kwargs reach apply_chat_template (Qwen3's enable_thinking)."""
    import copy

    from grpo_jax.cli import config_from_dict
    path = _jsonl(tmp_path / "p.jsonl", [{"prompt": "2+2?"},
                                        {"prompt": [{"role": "user", "content": "3+3?"}]}])
    own = copy.deepcopy(_tok_plain())
    think = ("{% for m in messages %}[{{ m['role'] }}]{{ m['content'] }}{% endfor %}"
             "{% if add_generation_prompt %}[assistant]{% if enable_thinking is defined and "
             "not enable_thinking %}<no-think>{% endif %}{% endif %}")
    cfg = config_from_dict({"dataset_name": path, "system_prompt": "Be brief.",
                            "chat_template": think,
                            "chat_template_kwargs": {"enable_thinking": False}}).data
    ds = load_prompts(cfg, own)
    assert own.chat_template == think
    assert ds.prompts[0] == [{"role": "system", "content": "Be brief."},
                             {"role": "user", "content": "2+2?"}]
    text = own.decode(ds.prompt_ids(1))
    assert text == "[system]Be brief.[user]3+3?[assistant]<no-think>", text
    with pytest.raises(DataError, match="already starts with a system message"):
        load_prompts(DataArgs(dataset_name=_jsonl(tmp_path / "s.jsonl", [{"prompt": [
            {"role": "system", "content": "x"}, {"role": "user", "content": "y"}]}]),
            system_prompt="Be brief."), own)


def _tok_plain():
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    inner = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    inner.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    inner.decoder = decoders.ByteLevel()
    return PreTrainedTokenizerFast(tokenizer_object=inner, eos_token="<|im_end|>")
