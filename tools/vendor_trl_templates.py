"""Copy the chat-template data of the installed TRL into grpo_jax/assets/trl/, for runs without
TRL (grpo_jax.rollout.tool_templates reads it there; with TRL importable it reads TRL itself).

    python tools/vendor_trl_templates.py      # in the test venv (trl==1.16.0)

Writes index.json (each of TRL's original chat templates by the sha256 of its text: its name,
the name of its tool-call parser as TRL's `add_response_schema` sets it, and its training
template file as `get_training_chat_template` swaps it in; and TRL's legacy `response_schema`s
by the name of the parser TRL pairs each with), the training templates of those
originals that can render a tool exchange (TRL's `supports_tool_calling`; the others are
refused before a swap), TRL's LICENSE and a README naming the source. tests/test_tool_templates.py
checks that the copy prepares every template as TRL itself does.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

ROOT = Path(__file__).resolve().parents[1]
OUT = ROOT / "grpo_jax" / "assets" / "trl"


def main() -> None:
    import transformers
    from trl import chat_template_utils as ctu

    sys.path.insert(0, str(ROOT))
    from grpo_jax import hf
    version = importlib.metadata.version("trl")
    tok = transformers.AutoTokenizer.from_pretrained(hf.resolve_model_dir(hf.SMOL_ALIAS))
    # The parsers by their names in chat_template_utils (`qwen3_template` -> "qwen3").
    parsers = {k.removesuffix("_template"): v for k, v in vars(ctu).items()
               if k.endswith("_template") and isinstance(v, dict)}
    shutil.rmtree(OUT, ignore_errors=True)
    OUT.mkdir(parents=True)
    index, used = {}, set()
    for path in sorted(ctu._CHAT_TEMPLATES_DIR.glob("*.jinja")):
        if path.stem.endswith("_training"):
            continue
        text = path.read_text(encoding="utf-8")
        holder = SimpleNamespace(chat_template=text)
        try:
            ctu.add_response_schema(holder)
            parser = next(n for n, p in parsers.items() if p is holder.response_template)
        except ValueError:
            parser = None
        # TRL's get_training_chat_template swaps `<name>_chat_template` for
        # `<name>_training_chat_template`.
        training = getattr(ctu, f"{path.stem}_training_chat_template", None)
        tok.chat_template = text
        if training is not None and ctu.supports_tool_calling(tok):
            name = f"{path.stem}_training.jinja"
            (OUT / name).write_text(training, encoding="utf-8")
        else:
            name = None
        index[hashlib.sha256(text.encode()).hexdigest()] = {
            "name": path.stem, "response_template": parser, "training": name}
        used.add(parser)
    # TRL's legacy response_schemas (transformers < 5.13), by the name of the parser TRL pairs
    # each with (`<name>_schema` -> `<name>_template`).
    legacy = {k.removesuffix("_schema"): v for k, v in vars(ctu).items()
              if k.endswith("_schema") and isinstance(v, dict)}
    used |= set(legacy)
    data = {"trl_version": version, "transformers_version": transformers.__version__,
            "response_templates": {n: parsers[n] for n in sorted(used - {None})},
            "chat_templates": index,
            "legacy_schemas": {n: legacy[n] for n in sorted(legacy)}}
    (OUT / "index.json").write_text(json.dumps(data, indent=1, ensure_ascii=False) + "\n",
                                    encoding="utf-8")
    dist = importlib.metadata.distribution("trl")
    license_file = next(f for f in dist.files if f.name == "LICENSE")
    shutil.copy(dist.locate_file(license_file), OUT / "LICENSE")
    (OUT / "README.md").write_text(f"""# TRL's chat-template data (vendored)

From TRL {version} (https://github.com/huggingface/trl, Apache License 2.0, see LICENSE here):
`trl/chat_templates/*_training.jinja` copied unchanged, and in `index.json` the response
templates (tool-call parsers) of `trl/chat_template_utils.py` as transformers
{transformers.__version__} gets them, with which of TRL's original chat templates (by the sha256
of their text) gets which parser and which training template. grpo_jax.rollout.tool_templates
reads this when `trl` is not installed. Regenerate with `python tools/vendor_trl_templates.py`.
""", encoding="utf-8")
    print(f"{len(index)} chat templates, {len(used - {None})} parsers, "
          f"{sum(1 for e in index.values() if e['training'])} training templates -> {OUT}")


if __name__ == "__main__":
    main()
