"""`python -m grpo_jax.export --checkpoint OUTPUT_DIR [--step N] --out HF_DIR [--dtype D]`.

Writes a Hugging Face model directory (weights, config, tokenizer, chat template) that
`transformers` loads and `vllm serve` serves. A LoRA run (use_peft) writes a PEFT adapter
directory (`adapter_config.json`, `adapter_model.safetensors`) that
`peft.PeftModel.from_pretrained` loads onto the base; `--merge` writes the full model instead.
"""

from __future__ import annotations

import argparse
import sys

from pathlib import Path

from grpo_jax import hf, peft_io
from grpo_jax.checkpoint import load_checkpoint
from grpo_jax.cli import load_config
from grpo_jax.errors import GrpoJaxError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m grpo_jax.export", description=__doc__)
    p.add_argument("--checkpoint", required=True, help="a training run's output_dir")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--out", required=True, help="the HF directory to write")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--merge", action="store_true",
                   help="LoRA runs: merge the adapters into the base and write the full model")
    args = p.parse_args(argv)
    try:
        model, source_dir, step = load_checkpoint(args.checkpoint, args.step)
        if getattr(model, "lora_scale", None) is None:
            out = hf.save_hf(model, args.out, source_dir=source_dir, dtype=args.dtype)
        elif args.merge:
            out = hf.save_hf(peft_io.merged_model(model), args.out, source_dir=source_dir,
                             dtype=args.dtype)
        else:
            cfg = load_config(str(Path(args.checkpoint) / "config.yaml"))
            base = peft_io.base_name(cfg)  # PEFT can't resolve our alias: name the directory
            out = peft_io.save_adapter(model, cfg.peft, args.out,
                                       str(source_dir) if base == hf.SMOL_ALIAS else base,
                                       dtype=args.dtype)
    except GrpoJaxError as e:
        print(f"grpo_jax.export: error: {e}", file=sys.stderr)
        return 2
    print(f"exported step {step} of {args.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
