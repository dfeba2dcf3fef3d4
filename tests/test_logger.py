"""The completion log: completions.jsonl rows, the console sample and the W&B table's rows."""

import json
import sys
import types

from grpo_jax.cli import config_from_dict
from grpo_jax.logger import MetricsLogger

PROMPTS = [[{"role": "user", "content": "2+2?"}]] * 2 + ["3+3?"] * 2
COMPLETIONS = ["4", "five", "6", "six"]


def _log(tmp_path, monkeypatch, **run):
    tables = []

    class Table:  # records what the logger would send to W&B
        def __init__(self, columns, data):
            tables.append([dict(zip(columns, row)) for row in data])

    fake = types.SimpleNamespace(Table=Table, init=lambda **kw: types.SimpleNamespace(
        log=lambda *a, **k: None, finish=lambda: None))
    monkeypatch.setitem(sys.modules, "wandb", fake)
    cfg = config_from_dict({"log_completions": True, "report_to": ["wandb"], **run}).run
    logger = MetricsLogger(tmp_path, cfg, total_steps=3)
    logger.log_completions(1, PROMPTS, COMPLETIONS, [1, 0, 1, 0], [0.5, -0.5, 0.5, -0.5],
                           extra={"judge": ["ok", "no", "ok", None]})
    logger.close()
    rows = [json.loads(line) for line in (tmp_path / "completions.jsonl").open()]
    return rows, tables


def test_completions_jsonl_console_sample_and_table(tmp_path, monkeypatch, capsys):
    rows, tables = _log(tmp_path, monkeypatch, num_completions_to_print=2)
    assert [r["completion"] for r in rows] == COMPLETIONS and rows[1]["judge"] == "no"
    out = capsys.readouterr().out  # tqdm.write: the console lines
    assert "2+2? -> 4" in out and "2+2? -> five" in out and "3+3?" not in out  # 2 printed
    assert [r["completion"] for r in tables[0]] == COMPLETIONS


def test_log_unique_prompts_keeps_one_row_per_prompt_in_the_table(tmp_path, monkeypatch):
    rows, tables = _log(tmp_path, monkeypatch, log_unique_prompts=True)
    assert len(rows) == 4  # the file keeps every completion, as TRL's parquet does
    assert [r["completion"] for r in tables[0]] == ["4", "6"]


def test_an_image_in_a_prompt_is_logged_as_its_size_and_mode(tmp_path):
    """A vision-language prompt's image part (a PIL image, as TRL's prepare_multimodal_messages
    leaves it) is written as what it is, not as str()'s memory address."""
    from PIL import Image
    prompt = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (28, 20))},
                                           {"type": "text", "text": "How many red squares?"}]}]
    logger = MetricsLogger(tmp_path, config_from_dict({"log_completions": True}).run,
                           total_steps=1)
    logger.log_completions(1, [prompt], ["3"], [1.0], [0.0])
    logger.close()
    row = json.loads((tmp_path / "completions.jsonl").read_text())
    assert row["prompt"][0]["content"][0] == {"type": "image", "image": "<image 28x20 RGB>"}
