"""`python -m grpo_jax.aot`: the command line over analyze (one layout) and search (--auto);
its help is analyze.py's docstring."""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from grpo_jax.aot import analyze, hardware, report, search, split
from grpo_jax.errors import GrpoJaxError


def analyze_config(target, cfg, quick: bool = False,
                   phases=("generate", "logprobs", "update"), image_tokens: int = 0,
                   images: int | None = None) -> dict:
    """One layout's report: the config's mesh, or where it names none the default layout;
    `image_tokens`: merged image tokens per prompt (a vision-language model), in `images`
    images of equal size."""
    import jax

    start = time.perf_counter()
    chosen = None
    analyze.check_config(cfg)
    if not cfg.mesh.given:
        cfg, chosen = search.default_layout(target, cfg, image_tokens, images)
    run = analyze.make_lowering(target, cfg, image_tokens, images)
    ev = analyze.evaluate(target, run, full_depth=not quick,
                          phases=analyze.run_phases(run, phases))
    result = analyze.summarize(target, cfg, run, ev, start)
    if chosen:
        result["chosen"] = chosen
    result["jax"] = jax.__version__
    return result


# Training flags a layout sets (and their config keys): left out of the command to run with.
_LAYOUT_KEYS = ("dp", "fsdp", "tp", "ep", "cp", "max_num_seqs", "per_device_train_batch_size",
                "gradient_accumulation_steps", "generation_batch_size", "steps_per_generation",
                "remat", "remat_policy", "gradient_checkpointing")


def _without_layout(args: list[str]) -> list[str]:
    out, skip = [], False
    for i, a in enumerate(args):
        if skip:
            skip = False
            continue
        key = a.lstrip("-").split("=")[0].replace("-", "_").rpartition(".")[2]
        if a.startswith("--") and key in _LAYOUT_KEYS:
            skip = "=" not in a
            continue
        if a == "--set" and i + 1 < len(args) and args[i + 1].split("=")[0].rpartition(
                ".")[2] in _LAYOUT_KEYS:
            skip = True
            continue
        out.append(a)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m grpo_jax.aot", add_help=False)
    p.add_argument("--topology")
    p.add_argument("--num_slices", "--num-slices", type=int, default=1)
    p.add_argument("--json")
    p.add_argument("--quick", action="store_true")
    p.add_argument("--auto", action="store_true")
    p.add_argument("--split", action="store_true")
    p.add_argument("--top", type=int)
    p.add_argument("--margin", type=float, default=search.MARGIN)
    p.add_argument("--phases", default="generate,logprobs,update")
    p.add_argument("--image_tokens", "--image-tokens", type=int, default=0)
    p.add_argument("--images_per_prompt", "--images-per-prompt", type=int)
    p.add_argument("-h", "--help", action="store_true")
    args, rest = p.parse_known_args(argv)
    if args.help:
        print(analyze.__doc__)
        raise SystemExit(0)
    try:
        if not args.topology:
            raise GrpoJaxError("--topology is required, e.g. --topology v5e:4x4 or h100:8")
        import jax
        jax.config.update("jax_platforms", "cpu")  # compile only: never open an accelerator
        from grpo_jax import cli
        target = hardware.parse_target(args.topology, args.num_slices)
        cfg = cli.parse_cli(rest)
        result = (search.auto(target, cfg, quick=args.quick, top=args.top,
                              image_tokens=args.image_tokens, margin=args.margin,
                              images=args.images_per_prompt) if args.auto
                  else analyze_config(target, cfg, quick=args.quick,
                                      phases=tuple(args.phases.split(",")),
                                      image_tokens=args.image_tokens,
                                      images=args.images_per_prompt))
        if args.auto or args.split:  # the same round split: the estimate's, no compile
            result["split"] = split.forecast(cfg, analyze.model_config(cfg.model.name_or_path),
                                             target, hardware.devices(target),
                                             args.image_tokens, args.margin,
                                             args.images_per_prompt)
    except GrpoJaxError as e:
        print(f"error: {e}", file=sys.stderr)
        raise SystemExit(2) from None
    if result.get("chosen") or result.get("search"):
        result["command"] = ["python -m grpo_jax.train", *_without_layout(rest),
                             *result["flags"]]
    print(report.render(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return result
