"""The data side of vision-language GRPO against TRL 1.16 as the oracle: image columns in each
form a dataset holds them, the multimodal prompts and their processor outputs (token ids with
the image tokens expanded, pixel_values, image_grid_thw) as TRL's own code path makes them, size
buckets, images handed to reward functions as TRL hands them, the shipped 'squares' data and
config, a TRL VLM recipe, and the one-line refusals. Tiny processors are built locally (a
character tokenizer with each family's special tokens): no hub."""

import io
import json
from collections import defaultdict
from types import SimpleNamespace

import numpy as np
import pytest
from PIL import Image

from grpo_jax import images as images_lib
from grpo_jax import squares
from grpo_jax.cli import load_config
from grpo_jax.config import DataArgs
from grpo_jax.data import load_prompts
from grpo_jax.errors import DataError
from grpo_jax.rewards import accuracy, compute_rewards
from grpo_jax.scoring import reward_inputs
from hf_oracle import char_tokenizer
from vlm_processors import QWEN_TEMPLATE, gemma_processor, qwen_processor

trl_data = pytest.importorskip("trl.data_utils")
trl_grpo = pytest.importorskip("trl.trainer.grpo_trainer")

BUCKETS = ("56x56", "56x84", "84x56")  # multiples of Qwen-VL's 28 px, within its pixel limits

PROCESSORS = {"qwen2_5_vl": qwen_processor, "gemma3": gemma_processor}


@pytest.fixture(scope="module", params=sorted(PROCESSORS))
def processor(request):
    return PROCESSORS[request.param]()


def _picture(w=60, h=44, seed=0):
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8))


def _png(image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _vlm_dir(tmp_path):
    """A model directory whose config.json says it takes images (the processor comes from
    the test: load_processor is patched)."""
    d = tmp_path / "vlm"
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({"model_type": "qwen2_5_vl",
                                               "vision_config": {"depth": 1}}))
    return d


# ---------------------------------------------------------------- columns and TRL's prompts

def test_column_forms_give_the_same_pixel_values(tmp_path):
    """An image as a PIL image (any mode), a path, bytes, or datasets' {'bytes', 'path'} dict:
    the same RGB pixels, the same processor output."""
    import datasets
    picture = _picture()
    path = tmp_path / "p.png"
    picture.save(path)
    data = _png(picture)
    stored = datasets.Dataset.from_dict({"image": [str(path)]}).cast_column(
        "image", datasets.Image())
    forms = [picture, picture.convert("RGBA"), str(path), path, data,
             {"bytes": data, "path": None}, {"bytes": None, "path": str(path)},
             stored[0]["image"], stored.with_format(None).to_dict()["image"][0]]
    proc = qwen_processor()
    prompt = [{"role": "user", "content": "How many?"}]
    want = None
    for form in forms:
        (image,) = images_lib.model_images(form, "image", 0)
        assert image.mode == "RGB" and np.array_equal(np.asarray(image), np.asarray(picture))
        batch = images_lib.process(proc, [images_lib.multimodal_messages(prompt, [image], 0)])
        if want is None:
            want = batch
        np.testing.assert_array_equal(batch.pixel_values, want.pixel_values)
        np.testing.assert_array_equal(batch.input_ids, want.input_ids)
    # `images` holds a list per row; None is no image, as TRL reads it.
    assert len(images_lib.model_images([data, str(path)], "images", 0)) == 2
    assert images_lib.model_images(None, "image", 0) == []


def _examples():
    """Rows as TRL's datasets hold them: chat prompts with string content and an `image`, an
    image part already placed with two `images`, a system turn."""
    a, b, c = _picture(60, 44, 1), _picture(30, 70, 2), _picture(56, 56, 3)
    return [
        ("image", [{"role": "user", "content": "How many red squares?"}], a),
        ("images", [{"role": "user", "content": [
            {"type": "text", "text": "Compare "}, {"type": "image"},
            {"type": "text", "text": "and"}, {"type": "image"}]}], [b, c]),
        ("image", [{"role": "system", "content": "Be brief."},
                   {"role": "user", "content": "What is it?"}], c),
    ]


def test_prompt_ids_and_pixels_are_trls(processor):
    """Our multimodal prompts are TRL's prepare_multimodal_messages'; their token ids equal both
    of TRL's paths (generation: processor.apply_chat_template(tokenize=True); the forward pass:
    data_utils.apply_chat_template then processor(images=, text=, padding=True)), and so do
    pixel_values and image_grid_thw."""
    ours, theirs, images = [], [], []
    for column, prompt, value in _examples():
        row = images_lib.model_images(value, column, 0)
        mine = images_lib.multimodal_messages(prompt, row, 0)
        trl_images = [value] if column == "image" else value  # grpo_trainer.py:2400-2403
        want = trl_data.prepare_multimodal_messages(prompt, images=trl_images)
        assert mine == want
        ours.append(mine)
        theirs.append(want)
        images.append(trl_images)
    batch = images_lib.process(processor, ours)
    assert batch.num_images == (1, 2, 1)
    generated = processor.apply_chat_template(conversation=theirs, add_generation_prompt=True,
                                              tokenize=True, return_dict=True)
    texts = [trl_data.apply_chat_template({"prompt": p}, processor)["prompt"] for p in theirs]
    forward = processor(images=images, text=texts, padding=True, return_tensors="np")
    for i in range(len(ours)):
        assert batch.prompt_ids(i) == list(generated["input_ids"][i])
        np.testing.assert_array_equal(batch.input_ids[i], forward["input_ids"][i])
        np.testing.assert_array_equal(batch.attention_mask[i], forward["attention_mask"][i])
    np.testing.assert_array_equal(batch.pixel_values, forward["pixel_values"])
    if "image_grid_thw" in forward:
        np.testing.assert_array_equal(batch.image_grid_thw, forward["image_grid_thw"])
        image_pad = processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
        # Each image's placeholder is expanded to its t * h * w / merge_size**2 tokens.
        assert (batch.input_ids == image_pad).sum() == batch.image_grid_thw.prod(-1).sum() // 4
    else:
        assert batch.image_grid_thw is None
    assert batch.input_ids[0, 0] == processor.tokenizer.pad_token_id  # padded on the left


def test_plain_prompts_and_mismatches_are_refused_as_trl_does():
    """TRL raises on a plain-string prompt with images ("Multimodal training requires
    conversational prompts") and when image parts and images don't pair up."""
    with pytest.raises(DataError, match="plain string"):
        images_lib.multimodal_messages("How many?", [_picture()], 3)
    # TRL's condition for that error (grpo_trainer.py:2414): the prompt is not conversational.
    assert not trl_data.is_conversational({"prompt": "How many?"})
    two_parts = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}]
    with pytest.raises(DataError, match="2 image parts but its row has 1 images"):
        images_lib.multimodal_messages(two_parts, [_picture()], 0)
    with pytest.raises(ValueError, match="does not match"):
        trl_data.prepare_multimodal_messages(two_parts, images=[_picture()])


# ---------------------------------------------------------------- buckets

def test_buckets_bound_the_shapes():
    """Images of many sizes take len(buckets) shapes: pixel_values rows and image tokens per
    image one of three, each bucket kept as it is by the processor (grid = bucket / 14 px)."""
    proc = qwen_processor()
    buckets = images_lib.parse_buckets(BUCKETS)
    sizes = [(60, 44), (30, 70), (56, 56), (100, 40), (41, 37), (90, 130), (64, 64), (20, 50)]
    grids, raw = set(), set()
    for w, h in sizes:
        image = images_lib.bucket_image(_picture(w, h), buckets)
        assert (image.height, image.width) in {(b.height, b.width) for b in buckets}
        b = images_lib.pick_bucket(w, h, buckets)
        assert (image.width, image.height) == (b.width, b.height)
        out = proc.image_processor(images=[image], return_tensors="np")
        grid = tuple(out["image_grid_thw"][0])
        assert grid == (1, b.height // 14, b.width // 14)
        grids.add(grid)
        raw.add(tuple(proc.image_processor(images=[_picture(w, h)],
                                           return_tensors="np")["image_grid_thw"][0]))
    assert len(grids) == 3 and len(raw) > 3
    assert images_lib.bucket_image(_picture(60, 44), ()).size == (60, 44)  # no buckets: as is
    with pytest.raises(DataError, match="HEIGHTxWIDTH"):
        images_lib.parse_buckets(["56"])


# ---------------------------------------------------------------- the dataset and rewards

@pytest.fixture
def vlm(tmp_path, monkeypatch):
    monkeypatch.setattr(images_lib, "load_processor", lambda model_dir: qwen_processor())
    return _vlm_dir(tmp_path)


def test_squares_load_as_trl_reads_them(vlm):
    """The built-in 'squares' through load_prompts: TRL's prompts (image parts filled), ids as
    TRL's processor call makes them, the images as the model sees them; the same seed draws
    the same images, and the answer is what the image shows."""
    cfg = DataArgs(dataset_name="squares", image_buckets=("56x56",))
    ds = load_prompts(cfg, None, model_dir=vlm)
    assert len(ds) == squares.TRAIN_SIZE and len(load_prompts(cfg, None, test=True,
                                                              model_dir=vlm)) == squares.TEST_SIZE
    raw = squares.columns(cfg.seed, "train")
    proc = qwen_processor()
    for i in range(4):
        want = trl_data.prepare_multimodal_messages(raw["prompt"][i], images=[raw["image"][i]])
        assert ds.prompts[i] == want
        ids = proc.apply_chat_template(conversation=[want], add_generation_prompt=True,
                                       tokenize=True, return_dict=True)["input_ids"][0]
        assert ds.prompt_ids(i) == list(ids)
        assert ds.images[i][0].size == (56, 56)
        assert squares.count_red_squares(ds.columns["image"][i]) == int(ds.columns["answer"][i])
    assert np.array_equal(np.asarray(raw["image"][7]),
                          np.asarray(squares.columns(cfg.seed, "train")["image"][7]))
    counts = {int(a) for a in ds.columns["answer"]}
    assert counts == {1, 2, 3, 4}


class _Accelerator:
    device = "cpu"
    is_main_process = True


def _trl_reward_kwargs(inputs, prompts, completions):
    """What TRL 1.16's _calculate_rewards passes a reward function, by running it: a trainer
    with just the fields it reads."""
    seen = {}

    def spy(prompts, completions, completion_ids, **kwargs):
        seen.update(kwargs, prompts=prompts)
        return [0.0] * len(completions)

    t = object.__new__(trl_grpo.GRPOTrainer)
    t.accelerator = _Accelerator()
    t.reward_funcs, t.reward_processing_classes, t.reward_func_names = [spy], [None], ["spy"]
    t.state, t.environments = SimpleNamespace(global_step=0), None
    t.args = SimpleNamespace(report_to=[])  # profiling_context reads it
    t._log_completion_extra = t._log_metric = lambda *a, **k: None
    t._metrics = {"train": defaultdict(list), "eval": defaultdict(list)}
    t._calculate_rewards(inputs, prompts, completions, [[1]] * len(completions))
    return seen


def test_rewards_get_images_as_trl_passes_them(vlm, tmp_path):
    """A reward function gets the image column under its own name (`image`), one value per
    completion (each prompt's repeated num_generations times), as the dataset row holds it
    (datasets decodes an Image feature to a PIL image), and the prompts with their image parts:
    as TRL 1.16's _calculate_rewards passes them. `accuracy` scores the count."""
    import datasets
    squares.save(tmp_path / "sq")
    ds = load_prompts(DataArgs(dataset_name=str(tmp_path / "sq"), shuffle_dataset=False), None,
                      model_dir=vlm)
    g = 3
    records, _ = ds.batch_prompts((0, 0), 2)
    prompts, columns = reward_inputs(records, g)
    texts = [f"There are {r['answer']}." for r in records for _ in range(g)]
    completions = [[{"role": "assistant", "content": t}] for t in texts]
    got = {}

    def spy(prompts, completions, image, answer, **kwargs):
        got.update(prompts=prompts, image=image, answer=answer)
        return accuracy(completions, answer=answer)

    rewards = compute_rewards([spy], prompts, completions, [[1]] * len(texts), columns)
    assert rewards[:, 0].tolist() == [1.0] * len(texts)
    # TRL: the rows, repeated per generation by its RepeatSampler, and the prompts after
    # prepare_multimodal_messages (grpo_trainer.py:2400-2423).
    rows = datasets.load_from_disk(str(tmp_path / "sq"))["train"]
    inputs = [dict(rows[i]) for i in range(2) for _ in range(g)]
    trl_prompts = [trl_data.prepare_multimodal_messages(x["prompt"], images=[x["image"]])
                   for x in inputs]
    want = _trl_reward_kwargs(inputs, trl_prompts, completions)
    assert len(got["image"]) == len(want["image"]) == 2 * g
    for ours, theirs in zip(got["image"], want["image"]):
        assert isinstance(ours, Image.Image) and isinstance(theirs, Image.Image)
        assert np.array_equal(np.asarray(ours), np.asarray(theirs))
    assert got["answer"] == want["answer"]
    for ours, theirs in zip(got["prompts"], want["prompts"]):
        assert [m["role"] for m in ours] == [m["role"] for m in theirs]
        assert [[p["type"] for p in m["content"]] for m in ours] == \
            [[p["type"] for p in m["content"]] for m in theirs]


def test_an_images_list_column_from_a_file(vlm, tmp_path):
    """A parquet file with an `images` column (datasets' List(Image)): each row's images are
    decoded to PIL images as TRL's rows hold them, and the prompt gets one image part each,
    before its text."""
    import datasets
    pictures = [[_picture(60, 44, 1), _picture(30, 70, 2)], [_picture(56, 56, 3)]]
    path = tmp_path / "two.parquet"
    datasets.Dataset.from_dict({
        "prompt": [[{"role": "user", "content": "Same shapes?"}]] * 2,
        "images": pictures}).to_parquet(str(path))
    ds = load_prompts(DataArgs(dataset_name=str(path), image_buckets=BUCKETS), None,
                      model_dir=vlm)
    assert [len(x) for x in ds.columns["images"]] == [2, 1]
    assert all(isinstance(im, Image.Image) for x in ds.columns["images"] for im in x)
    assert [p["type"] for p in ds.prompts[0][0]["content"]] == ["image", "image", "text"]
    assert [im.size for im in ds.images[0]] == [(84, 56), (56, 84)]  # (w, h): the buckets
    image_pad = qwen_processor().tokenizer.convert_tokens_to_ids("<|image_pad|>")
    # 84 x 56 px is 6 x 4 patches of 14, 6 tokens after the 2 x 2 merge; 56 x 56 is 4.
    assert [ds.prompt_ids(i).count(image_pad) for i in range(2)] == [12, 4]


# ---------------------------------------------------------------- configs and refusals

def test_trl_vlm_recipe_and_squares_config_load():
    """TRL's VLM GRPO example as a YAML loads as it is; the shipped squares config too."""
    from pathlib import Path
    cfg = load_config(str(Path(__file__).parent / "recipes" / "trl_grpo_vlm.yaml"))
    assert cfg.model.name_or_path == "Qwen/Qwen2.5-VL-3B-Instruct"
    assert cfg.data.dataset_name == "lmms-lab/multimodal-open-r1-8k-verified"
    assert cfg.data.max_prompt_length is None and cfg.peft.use_peft
    # vllm_mode colocate: generation on the training devices, the native JAX sampler
    assert cfg.numerics.dtype == "bfloat16" and cfg.rollout.backend == "jax"
    sq = load_config("squares")
    assert (sq.data.dataset_name, sq.data.image_buckets) == ("squares", ("56x56",))
    assert sq.grpo.reward_funcs == ("accuracy",)


@pytest.fixture(scope="module")
def text_model(tmp_path_factory):
    """A tiny text-only Llama (no vision_config) with a chat template."""
    from hf_oracle import tiny_hf_model
    out = tmp_path_factory.mktemp("text_model")
    tok = char_tokenizer()
    tok.chat_template = QWEN_TEMPLATE
    tiny_hf_model("llama", tie=True, vocab=len(tok), seed=0).save_pretrained(out)
    tok.save_pretrained(out)
    return out


def _cli(tmp_path, capsys, model, rows) -> str:
    from grpo_jax.train import main
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    code = main(["--model_name_or_path", str(model), "--dataset_name", str(data),
                 "--output_dir", str(tmp_path / "out"), "--max_steps", "1",
                 "--num_generations", "2", "--per_device_train_batch_size", "2"])
    err = capsys.readouterr().err
    lines = [x for x in err.splitlines() if x.startswith("grpo_jax.train: error:")]
    assert code == 2 and len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


@pytest.mark.parametrize("case", ["picture", "not_images", "text_model"])
def test_refusals_are_one_line_exit_2(case, text_model, tmp_path, capsys):
    """Through the CLI: image parts with the images in a column TRL doesn't read; an image
    column that holds no images (which column, what it accepts); images for a text-only
    model."""
    path = tmp_path / "a.png"
    _picture().save(path)
    parts = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "n?"}]}]
    chat = [{"role": "user", "content": "How many?"}]
    rows = {"picture": [{"prompt": parts, "picture": str(path), "answer": "1"}] * 4,
            "not_images": [{"prompt": chat, "image": 7, "answer": "1"}] * 4,
            "text_model": [{"prompt": chat, "image": str(path), "answer": "1"}] * 4}[case]
    line = _cli(tmp_path, capsys, text_model, rows)
    want = {"picture": "has no 'image' or 'images' column (its columns are ['answer', "
                       "'picture'])",
            "not_images": "column 'image' row 0 is int 7, not an image; the column must hold "
                          "a PIL image, an image file's path, its bytes",
            "text_model": f"model {text_model} has no vision tower: its config.json has no "
                          "vision_config, but the dataset's column 'image' holds images"}[case]
    assert want in line, line


def test_console_line_shows_image_parts():
    """The completions' console line: a multimodal turn's text, each image as <image>."""
    from grpo_jax.logger import _short
    prompt = images_lib.multimodal_messages([{"role": "user", "content": "How many?"}],
                                            [_picture()], 0)
    assert _short(prompt) == "<image> How many?"
