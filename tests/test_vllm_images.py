"""A vision-language model's prompts for a vLLM server (rollout/vllm/rollout.py): each image's
expanded sequence back to its one begin-of-image token, which vLLM expands itself. The server
run (a GRPO run through it) is not yet here: docs/vllm.md's Images section."""

import string

import transformers
from PIL import Image
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

from grpo_jax import images
from grpo_jax.rollout.vllm.rollout import unexpanded_ids
from vlm_processors import GEMMA_TEMPLATE


def newline_gemma_processor():
    """vlm_processors.gemma_processor with the newline tokens vLLM's Gemma 3 processor looks
    up ("\\n" to "\\n\\n\\n\\n")."""
    vocab = {t: i for i, t in enumerate(["<pad>", "<s>", "</s>", "<unk>", *string.printable[:95],
                                         "\n", "\n\n", "\n\n\n", "\n\n\n\n"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), "isolated")
    tok.decoder = decoders.Fuse()
    fast = transformers.PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", bos_token="<s>", eos_token="</s>",
        unk_token="<unk>", padding_side="left",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    image = transformers.Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    return transformers.Gemma3Processor(image_processor=image, tokenizer=fast,
                                        image_seq_length=4, chat_template=GEMMA_TEMPLATE)


def test_unexpanded_ids_are_the_rendered_texts_ids():
    proc = newline_gemma_processor()
    im = Image.new("RGB", (28, 28), (255, 0, 0))
    prompts = [[{"role": "user", "content": [{"type": "image", "image": im},
                                             {"type": "text", "text": "How many?"}]}],
               [{"role": "user", "content": [{"type": "text", "text": "Look:\n"},
                                             {"type": "image", "image": im},
                                             {"type": "image", "image": im},
                                             {"type": "text", "text": "count"}]}]]
    batch = images.process(proc, prompts)
    for i, p in enumerate(prompts):
        want = proc.tokenizer(images.render(proc, p), add_special_tokens=False)["input_ids"]
        got = unexpanded_ids(proc, batch.prompt_ids(i))
        assert got == want
        boi = proc.tokenizer.convert_tokens_to_ids(proc.boi_token)
        assert got.count(boi) == len(images.prompt_images(p))
        assert len(got) < len(batch.prompt_ids(i))
