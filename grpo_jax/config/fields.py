"""A settings field with its help line: what `--help` prints and what TRL's GRPOConfig keeps
in each field's metadata["help"]."""

from __future__ import annotations

import dataclasses
from typing import Any


def arg(default: Any, help: str) -> Any:  # noqa: A002 - TRL's and argparse's name
    """dataclasses.field(default=default, metadata={"help": help})."""
    return dataclasses.field(default=default, metadata={"help": help})


def help_of(f: dataclasses.Field) -> str:
    return f.metadata.get("help", "")
