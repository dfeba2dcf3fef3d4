"""`python -m grpo_jax.export --checkpoint OUTPUT_DIR [--step N] --out HF_DIR [--dtype D]`.

Writes a Hugging Face model directory (weights, config, tokenizer, chat template) that
`transformers` loads and `vllm serve` serves.
"""

from __future__ import annotations

import argparse
import sys

from grpo_jax import hf
from grpo_jax.checkpoint import load_checkpoint
from grpo_jax.errors import GrpoJaxError


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="python -m grpo_jax.export", description=__doc__)
    p.add_argument("--checkpoint", required=True, help="a training run's output_dir")
    p.add_argument("--step", type=int, help="checkpoint step (default: the latest)")
    p.add_argument("--out", required=True, help="the HF directory to write")
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"])
    args = p.parse_args(argv)
    try:
        model, source_dir, step = load_checkpoint(args.checkpoint, args.step)
        out = hf.save_hf(model, args.out, source_dir=source_dir, dtype=args.dtype)
    except GrpoJaxError as e:
        print(f"grpo_jax.export: error: {e}", file=sys.stderr)
        return 2
    print(f"exported step {step} of {args.checkpoint} to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
