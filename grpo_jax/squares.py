"""The built-in image dataset 'squares': "How many red squares are in the image?" over small
drawn images (1 to 4 red squares among blue squares and green discs), answered by a number, so
a vision-language run on a CPU has a verifiable reward (`accuracy`: the completion's last number
equals the `answer` column). Drawn from the seed, never stored: the same seed draws the same
images. `save` writes it as a datasets dataset (an Image column) for TRL or any other reader."""

from __future__ import annotations

from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

SIZE = 56  # px: Qwen-VL's smallest image (min_pixels 56 * 56): 4 image tokens, left as it is
CELL = 14  # the image is a 4 x 4 grid of cells, a shape in each of a few: no two touch
TRAIN_SIZE = 512
TEST_SIZE = 32
QUESTION = "How many red squares are in the image? Answer with just the number."
RED, BLUE, GREEN = (220, 30, 30), (30, 60, 220), (30, 170, 60)


def draw(rng: np.random.Generator) -> tuple[Image.Image, int]:
    """One image and its count of red squares (1 to 4), with 0 to 3 other shapes."""
    count = int(rng.integers(1, 5))
    others = int(rng.integers(0, 4))
    cells = rng.permutation((SIZE // CELL) ** 2)[:count + others]
    image = Image.new("RGB", (SIZE, SIZE), (255, 255, 255))
    pen = ImageDraw.Draw(image)
    for k, cell in enumerate(cells):
        side = int(rng.integers(7, 11))
        x = int(cell % (SIZE // CELL)) * CELL + int(rng.integers(0, CELL - side))
        y = int(cell // (SIZE // CELL)) * CELL + int(rng.integers(0, CELL - side))
        box = (x, y, x + side - 1, y + side - 1)
        if k < count:
            pen.rectangle(box, fill=RED)
        elif rng.integers(0, 2):
            pen.rectangle(box, fill=BLUE)
        else:
            pen.ellipse(box, fill=GREEN)
    return image, count


def columns(seed: int, split: str = "train", size: int | None = None) -> dict[str, list]:
    """The columns as TRL reads them: `prompt` (a user turn whose first part is the image's
    placeholder), `image` (a PIL image) and `answer` (the count, a string). The splits draw
    from separate streams of the seed."""
    n = size if size is not None else (TEST_SIZE if split == "test" else TRAIN_SIZE)
    rng = np.random.default_rng([seed, 1 if split == "test" else 0])
    drawn = [draw(rng) for _ in range(n)]
    prompt = [{"role": "user", "content": [{"type": "image"},
                                           {"type": "text", "text": QUESTION}]}]
    return {"prompt": [prompt for _ in drawn], "image": [im for im, _ in drawn],
            "answer": [str(c) for _, c in drawn]}


def save(path: str | Path, seed: int = 42) -> Path:
    """Both splits as a datasets DatasetDict on disk (`image` an Image feature)."""
    import datasets
    out = datasets.DatasetDict({split: datasets.Dataset.from_dict(columns(seed, split))
                                for split in ("train", "test")})
    out.save_to_disk(str(path))
    return Path(path)


def count_red_squares(image: Image.Image) -> int:
    """The red squares `draw` drew, counted from the pixels (their 4-connected red blobs): the
    answer read off the image itself."""
    red = np.all(np.asarray(image.convert("RGB")) == RED, axis=-1)
    seen = np.zeros_like(red)
    blobs = 0
    for y, x in zip(*np.nonzero(red)):
        if seen[y, x]:
            continue
        blobs += 1
        stack = [(y, x)]
        seen[y, x] = True
        while stack:
            cy, cx = stack.pop()
            for ny, nx in ((cy + 1, cx), (cy - 1, cx), (cy, cx + 1), (cy, cx - 1)):
                if 0 <= ny < red.shape[0] and 0 <= nx < red.shape[1] and red[ny, nx] \
                        and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
    return blobs
