"""TowerShape: what a vision tower makes of a prompt's images (VisionConfig.encoded), in a
module of its own so that the configs of both towers and models/config.py share it without an
import cycle."""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass(frozen=True)
class TowerShape:
    """A prompt's images as its vision tower encodes them: what aot lays out and sizes."""
    images: int  # images per prompt
    patches: int  # patches per image: the tower's sequence
    width: int  # the tower's hidden size
    mlp: int  # its MLP's
    heads: int
    layers: int
    full_layers: int  # layers attending over a whole image; the rest over windows of `window`
    window: int  # patches per window
    pixels: tuple[int, ...]  # one image's pixel_values as the processor gives them
