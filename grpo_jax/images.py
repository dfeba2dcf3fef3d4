"""Images of a vision-language GRPO dataset, as TRL 1.16's GRPOTrainer takes them: an `images`
column (a list per example) or an `image` column (one per example), looked for in that order;
chat prompts whose user turn gets `{"type": "image"}` parts (inserted before the text of a
string-content turn, or already there), filled with the example's images; the model's processor
(AutoProcessor) rendering the chat template, expanding each image placeholder to the image's
tokens and making pixel_values. Pure functions; load_prompts and the round call them.

Image sizes and compiled programs: a processor sizes each image by its own rule. Gemma 3 resizes
every image to one square (896 x 896: 256 image tokens), so any dataset makes one shape. Qwen-VL
rounds each image to multiples of 28 px between min_pixels and max_pixels, so a dataset of photos
makes many sizes. Its tower takes a batch's images each padded to the batch's largest, P patches
(image_blocks), and reads their grids as arrays: a batch of any sizes runs the program compiled
for its P (and its most images per prompt, K), so a run compiles one program per P it meets.
The data setting image_buckets (e.g. ["448x448", "336x448", "448x336"]) bounds that: each image
is scaled, keeping its aspect, to fit the bucket of the closest aspect ratio and padded
(centred, black) to it, so a batch's P is one of at most len(image_buckets) values (the largest
bucket any of its images took), and fewer padded patches are computed. Without buckets P takes
as many values as the largest image of a batch takes sizes. The text side's prompt length varies
with the prompt text already and is padded as for text-only runs. Bucket sides should be
multiples of the processor's patch_size * merge_size (28 for Qwen-VL) and within its
min/max_pixels, so that the processor keeps them as they are: bucket_image's output is then
what the vision tower sees.
"""

from __future__ import annotations

import base64
import io
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Mapping, Sequence

import numpy as np

from grpo_jax import image_blocks
from grpo_jax.errors import DataError

if TYPE_CHECKING:
    from PIL import Image

# TRL looks for "images" first, then "image" (grpo_trainer.py, _generate_and_score_completions).
IMAGE_COLUMNS = ("images", "image")
ACCEPTED = ("a PIL image, an image file's path, its bytes, or a {'bytes', 'path'} dict "
            "(datasets' Image feature)")


# ---------------------------------------------------------------- columns and values

def has_image_parts(prompt: Any) -> bool:
    """Whether a chat prompt holds an image part (`{"type": "image"}`, filled or not)."""
    return isinstance(prompt, list) and any(
        isinstance(m, dict) and isinstance(m.get("content"), list) and any(
            isinstance(part, dict) and part.get("type") == "image" for part in m["content"])
        for m in prompt)


def image_column(columns: Mapping[str, Any], prompts: Sequence[Any], name: str) -> str | None:
    """The dataset's image column (TRL's names, "images" before "image"), or None for a text
    dataset. Prompts with image parts and no such column are refused: the images can't be
    found (e.g. they are in a column called something else)."""
    for column in IMAGE_COLUMNS:
        if column in columns:
            return column
    if any(has_image_parts(p) and not _filled(p) for p in prompts[:64]):
        raise DataError(f"dataset {name!r}: its prompts have image parts but it has no 'image' "
                        f"or 'images' column (its columns are {sorted(columns)}); rename the "
                        "column holding the images to 'image' (one per row) or 'images' (a list "
                        "per row), as TRL reads them")
    return None


def _filled(prompt: list) -> bool:
    """Every image part already holds its image (TRL keeps those as they are)."""
    return all("image" in part for m in prompt if isinstance(m.get("content"), list)
               for part in m["content"] if isinstance(part, dict) and part.get("type") == "image")


def row_images(value: Any, column: str, row: int) -> list[Any]:
    """A row's images as TRL gathers them: `images` a list (None: none), `image` one value
    (None: none)."""
    if value is None:
        return []
    if column == "images":
        if not isinstance(value, (list, tuple)):
            raise DataError(f"column 'images' row {row} is {type(value).__name__}, not a list; "
                            f"'images' holds a list per row of {ACCEPTED}; one image per row "
                            "goes in a column called 'image'")
        return list(value)
    return [value]


def decode_image(value: Any, column: str, row: int) -> Image.Image:
    """`value` as an RGB PIL image (what a processor converts to as well): a PIL image, a file
    path, encoded bytes, or datasets' {'bytes', 'path'} dict. Anything else is refused, naming
    the column and the row."""
    from PIL import Image  # here: grpo_jax.aot's venv (libtpu, no Pillow) imports this module
    where = f"column {column!r} row {row}"
    if isinstance(value, Image.Image):
        image = value
    elif isinstance(value, dict) and ("bytes" in value or "path" in value):
        data, path = value.get("bytes"), value.get("path")
        return decode_image(data if data is not None else path, column, row)
    elif isinstance(value, (bytes, bytearray)):
        try:
            image = Image.open(io.BytesIO(value))
            image.load()
        except OSError as e:
            raise DataError(f"{where}: its bytes are not an image PIL can read ({e}); the "
                            f"column must hold {ACCEPTED}") from None
    elif isinstance(value, (str, Path)):
        path = Path(value).expanduser()
        if not path.is_file():
            raise DataError(f"{where}: {str(value)[:120]!r} is not an image file (no such "
                            f"file); the column must hold {ACCEPTED}")
        try:
            image = Image.open(path)
            image.load()
        except OSError as e:
            raise DataError(f"{where}: can't read {path} as an image ({e})") from None
    else:
        raise DataError(f"{where} is {type(value).__name__} {repr(value)[:60]}, not an image; "
                        f"the column must hold {ACCEPTED}")
    return image if image.mode == "RGB" else image.convert("RGB")


# ---------------------------------------------------------------- sizes

@dataclass(frozen=True)
class Bucket:
    height: int
    width: int


def parse_buckets(values: Sequence[str]) -> tuple[Bucket, ...]:
    """The image_buckets setting ("HxW" strings, pixels) as buckets."""
    out = []
    for v in values:
        h, sep, w = str(v).lower().partition("x")
        if not (sep and h.strip().isdigit() and w.strip().isdigit()
                and int(h) > 0 and int(w) > 0):
            raise DataError(f"image_buckets: {v!r} is not HEIGHTxWIDTH in pixels, e.g. '448x336'")
        out.append(Bucket(int(h), int(w)))
    return tuple(out)


def pick_bucket(width: int, height: int, buckets: Sequence[Bucket]) -> Bucket:
    """The bucket whose aspect ratio is closest to the image's (in log scale, so 2:1 and 1:2
    are as far from 1:1); the first such."""
    ratio = math.log(width / height)
    return min(buckets, key=lambda b: abs(math.log(b.width / b.height) - ratio))


def bucket_image(image: Image.Image, buckets: Sequence[Bucket]) -> Image.Image:
    """`image` scaled (aspect kept) to fit its bucket and padded, centred, with black to it;
    as it is without buckets."""
    from PIL import Image, ImageOps  # here: see decode_image
    if not buckets:
        return image
    b = pick_bucket(image.width, image.height, buckets)
    if (image.width, image.height) == (b.width, b.height):
        return image
    return ImageOps.pad(image, (b.width, b.height), method=Image.Resampling.BICUBIC,
                        color=(0, 0, 0))


def model_images(value: Any, column: str, row: int,
                 buckets: Sequence[Bucket] = ()) -> list[Image.Image]:
    """A row's column value as the images the model sees: decoded, RGB, bucketed."""
    return [bucket_image(decode_image(v, column, row), buckets)
            for v in row_images(value, column, row)]


# ---------------------------------------------------------------- prompts

def multimodal_messages(prompt: Any, images: Sequence[Any], row: int) -> list[dict]:
    """TRL's prepare_multimodal_messages: every content a list of parts; a string-content user
    turn (the first) gets one `{"type": "image"}` part per image before its text; the image
    parts without an image are filled in order. A plain-string prompt is refused, as TRL does
    ("Multimodal training requires conversational prompts")."""
    if not (isinstance(prompt, list) and prompt and all(isinstance(m, dict) and "role" in m
                                                         for m in prompt)):
        raise DataError(f"prompt {row} is a plain string but the dataset has images: TRL trains "
                        "on images with chat prompts only; write the prompts as "
                        "[{'role': 'user', 'content': '...'}] (the image parts are added)")
    out, placed = [], False
    for m in prompt:
        content = m.get("content")
        if m["role"] not in ("system", "user", "assistant", "tool"):
            raise DataError(f"prompt {row}: role {m['role']!r} is not system, user, assistant "
                            "or tool")
        if m["role"] == "user" and isinstance(content, str) and not placed:
            content = [*({"type": "image"} for _ in images), {"type": "text", "text": content}]
            placed = True
        elif isinstance(content, str):
            content = [{"type": "text", "text": content}]
        out.append({**m, "content": content} if content is not m.get("content") else m)
    empty = sum(1 for m in out if m.get("content") and m["role"] != "tool"
                for part in m["content"] if part["type"] == "image" and "image" not in part)
    if empty != len(images):
        raise DataError(f"prompt {row} has {empty} image parts but its row has {len(images)} "
                        "images; each image part needs one image")
    pending = iter(images)
    return [m if not m.get("content") or m["role"] == "tool" else {
        **m, "content": [{**part, "image": next(pending)}
                         if part["type"] == "image" and "image" not in part else part
                         for part in m["content"]]} for m in out]


def prompt_images(messages: Sequence[dict]) -> list[Any]:
    """The images of a multimodal prompt's parts, in order (TRL's _tokenize_prompts)."""
    return [part["image"] for m in messages if isinstance(m.get("content"), list)
            for part in m["content"] if part["type"] == "image"]


# ---------------------------------------------------------------- the model's side

def is_vision_model(model_dir: str | Path) -> bool:
    """Whether the model takes images: its config.json has a vision_config (Qwen2.5-VL,
    Gemma 3, LLaVA, ... all do; a text-only model does not)."""
    path = Path(model_dir) / "config.json"
    return path.is_file() and "vision_config" in json.loads(path.read_text())


def require_vision(model: str, model_dir: str | Path, column: str) -> None:
    if not is_vision_model(model_dir):
        raise DataError(f"model {model} has no vision tower: its config.json has no "
                        f"vision_config, but the dataset's column {column!r} holds images; use "
                        "a vision-language model (e.g. Qwen2.5-VL, Gemma 3) or drop the column")


def load_processor(model_dir: str | Path):
    """The model's processor, as TRL loads it: AutoProcessor, padding and truncating on the
    left (grpo_trainer.py __init__)."""
    from transformers import AutoProcessor
    try:
        return AutoProcessor.from_pretrained(model_dir, truncation_side="left",
                                             padding_side="left")
    except (ImportError, OSError) as e:
        # Qwen-VL's processor carries a video processor that needs torchvision, even for images.
        reason = " ".join(str(e).split())[:300]
        raise DataError(f"can't load the processor of {model_dir}: {type(e).__name__}: {reason}"
                        + ("; install torchvision (the CPU wheel of your torch's version)"
                           if isinstance(e, ImportError) else "")) from None


@dataclass(frozen=True)
class ImageBatch:
    """The processor's output for a batch of multimodal prompts, as numpy."""
    input_ids: np.ndarray  # [B, L] int32, left-padded; each image's placeholder expanded
    attention_mask: np.ndarray  # [B, L] int32, 0 on the padding
    # The processor's: Qwen-VL [patches, C*T*P*P], Gemma 3 [N, C, H, W]; None: no image
    pixel_values: np.ndarray | None
    image_grid_thw: np.ndarray | None  # [images, 3] (t, h, w) patches per image: Qwen-VL only
    num_images: tuple[int, ...]  # per prompt (TRL's num_images)

    def prompt_ids(self, i: int) -> list[int]:
        """Prompt i's token ids without the padding."""
        return self.input_ids[i][self.attention_mask[i].astype(bool)].tolist()


def render(processor, messages: Sequence[dict], chat_template_kwargs=None,
           tools: Sequence[Any] = ()) -> str:
    """A multimodal prompt's text through the processor's chat template (each image one
    placeholder), as TRL's apply_chat_template renders it for the forward pass."""
    return processor.apply_chat_template(list(messages), tokenize=False,
                                         add_generation_prompt=True, tools=list(tools) or None,
                                         **(chat_template_kwargs or {}))


def process(processor, prompts: Sequence[Sequence[dict]], chat_template_kwargs=None,
            tools: Sequence[Any] = ()) -> ImageBatch:
    """Multimodal prompts (multimodal_messages' output) through `processor` as TRL's
    _generate_and_score_completions calls it: the rendered texts and each prompt's images
    (an empty list for one without: processors refuse TRL's None there), padded."""
    texts = [render(processor, p, chat_template_kwargs, tools) for p in prompts]
    images = [prompt_images(p) for p in prompts]
    out = processor(images=images if any(images) else None, text=texts, padding=True,
                    return_tensors="np")
    pixels, grid = out.get("pixel_values"), out.get("image_grid_thw")
    return ImageBatch(input_ids=np.asarray(out["input_ids"], np.int32),
                      attention_mask=np.asarray(out["attention_mask"], np.int32),
                      pixel_values=None if pixels is None else np.asarray(pixels),
                      image_grid_thw=None if grid is None else np.asarray(grid, np.int32),
                      num_images=tuple(map(len, images)))


@dataclass(frozen=True)
class PromptPixels:
    """The images of a generation's prompts as the vision tower takes them, one block per
    prompt (image_blocks): each prompt's images, then blank ones up to the batch's most, so
    that a batch's rows split into micro-batches with their images: the trainer's step sees
    [rows, ...] arrays only."""
    # [prompts, K, C, H, W] (Gemma 3: K images per prompt) or [prompts, K, P, C*T*P*P]
    # (Qwen-VL: each image's patch rows, padded to the batch's most, P)
    pixel_values: np.ndarray
    # Qwen-VL: [prompts, K, 3] int32 each image's patch grid (t, h, w), (0, 0, 0) for a blank;
    # an array the tower reads in the program. None: Gemma 3 (no grid).
    image_grid: np.ndarray | None


def prompt_pixels(processor, prompts: Sequence[Sequence[dict]]) -> PromptPixels:
    """The images of multimodal prompts (multimodal_messages' output) through the processor's
    image processor, as its __call__ makes pixel_values and image_grid_thw, in blocks of one
    prompt (image_blocks.blocks): prompts holding different numbers of images (none too), of
    different sizes."""
    return row_pixels(processor, [prompt_images(p) for p in prompts])


def record_images(record: Mapping[str, Any]) -> list[Any]:
    """A record's images in the order their placeholders come: its prompt's, then (a row of
    the tool loop, rollout.tools) those its tools returned, under "tool_images"."""
    return prompt_images(record["prompt"]) + list(record.get("tool_images", ()))


def with_tool_images(record: Mapping[str, Any], tool_images: Sequence[Any],
                     placed: Sequence[bool]) -> Mapping[str, Any]:
    """A tool loop's row's record (its context: prompt + completion so far): its prompt's
    `record` with the images its tools returned, whose placeholders are the completion tokens
    `placed` marks (one bool per completion token so far); the record itself without any."""
    if not len(tool_images):
        return record
    return dict(record, tool_images=list(tool_images),
                image_tokens=[True] * len(record["prompt_ids"]) + list(placed))


def image_tokens(record: Mapping[str, Any]) -> int | Sequence[bool]:
    """Which tokens of the ids a record is generated from may be image placeholders
    (Sampler.placeholders): its prompt's; a tool loop's row's context (prompt + completion so
    far) marks them per token under "image_tokens", its tool results' placeholders too."""
    return record.get("image_tokens", len(record["prompt_ids"]))


def placeholders(ids, mask, image_token_id: int, pad_id: int, image_tokens=None):
    """(the image placeholders to fill [B, width] bool, the ids with every other placeholder
    id as padding, for M-RoPE's rope_index) of padded rows whose first image_tokens[b] real
    tokens may hold images (None: all; rows past it: none), or whose real tokens
    image_tokens[b] marks (a bool per real token: a multi-turn context whose tool results hold
    images, rollout.tools). Elsewhere a placeholder id is text the model wrote."""
    ids, real = np.asarray(ids), np.asarray(mask).astype(bool)
    is_image = (ids == image_token_id) & real
    if image_tokens is not None:
        allowed = np.zeros_like(real)
        for b, marks in enumerate(image_tokens):
            at = np.flatnonzero(real[b])
            allowed[b, at] = (np.arange(len(at)) < marks if np.ndim(marks) == 0
                              else np.asarray(marks, bool))
        is_image &= allowed
    return is_image, np.where(is_image | (ids != image_token_id), ids, pad_id)


def at_processed_size(processor, image):
    """`image` resized as the processor's image processor resizes it: to its one fixed size
    (Gemma 3's), or to Qwen-VL's `smart_resize` of its size (a multiple of patch x merge within
    the processor's min and max pixels). Another processor then has nothing to resize, so a vLLM
    server's processor (another resize implementation: torchvision's where the trainer's is
    PIL's) makes the trainer's pixels; the trainer's processor makes the same pixels from it as
    from `image` (PIL returns a same-size resize unchanged)."""
    ip = processor.image_processor
    size = ip.size
    if not ip.do_resize:
        return image
    if size.get("height") and size.get("width"):
        height, width = size["height"], size["width"]
    else:  # Qwen-VL's processors: shortest_edge / longest_edge are its min / max pixels
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize
        height, width = smart_resize(image.height, image.width,
                                     factor=ip.patch_size * ip.merge_size,
                                     min_pixels=size["shortest_edge"],
                                     max_pixels=size["longest_edge"])
    return image.convert("RGB").resize((width, height), resample=ip.resample)


def row_pixels(processor, images: Sequence[Sequence[Any]]) -> PromptPixels:
    """prompt_pixels of rows whose images are `images` (a list per row)."""
    from PIL import Image  # here: see decode_image
    # Without any image, one blank tells the blocks' shape (they hold no image).
    flat = [im for row in images for im in row] or [Image.new("RGB", (56, 56))]
    out = processor.image_processor(images=flat, return_tensors="np")
    counts = tuple(map(len, images))
    grid = out.get("image_grid_thw")
    if grid is not None and not any(counts):
        grid = grid[:0]
    return PromptPixels(*image_blocks.blocks(np.asarray(out["pixel_values"]), grid, counts))


def json_bytes(value: Any) -> np.ndarray:
    """`value` (e.g. the tool loop's messages, whose tool results may hold PIL images) as JSON
    in UTF-8 bytes (uint8, for a checkpoint's npz; a numpy string takes 4 bytes a character),
    each PIL image as its PNG (lossless) in base64, anything else JSON can't hold as its str."""
    from PIL import Image  # here: see decode_image

    def encode(x):
        if isinstance(x, Image.Image):
            out = io.BytesIO()
            x.save(out, format="PNG")
            return {_PNG: base64.b64encode(out.getvalue()).decode()}
        return str(x)
    return np.frombuffer(json.dumps(value, default=encode).encode(), np.uint8)


def from_json_bytes(saved) -> Any:
    """json_bytes' value, its images PIL images again (also a checkpoint's from before
    2026-12-07: JSON text as a numpy string)."""
    from PIL import Image  # here: see decode_image

    def decode(x):
        if _PNG in x:
            image = Image.open(io.BytesIO(base64.b64decode(x[_PNG])))
            image.load()
            return image
        return x
    saved = np.asarray(saved)
    text = saved.tobytes().decode() if saved.dtype == np.uint8 else str(saved)
    return json.loads(text, object_hook=decode)


_PNG = "__png__"  # an image's key in json_bytes' JSON
