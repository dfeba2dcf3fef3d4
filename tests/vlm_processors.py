"""Tiny vision-language processors built offline (a character tokenizer with each family's
special tokens), shared by the VLM tests."""

import transformers
from transformers.processing_utils import ProcessorMixin

from hf_oracle import char_tokenizer

# Qwen2-VL's chat template, cut to what these prompts use: an image part is one placeholder
# between vision_start/end that the processor expands to the image's tokens.
QWEN_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% else %}{% for c in m['content'] %}{% if c['type'] == 'image' %}"
    "<|vision_start|><|image_pad|><|vision_end|>{% elif c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GEMMA_TEMPLATE = QWEN_TEMPLATE.replace("<|vision_start|><|image_pad|><|vision_end|>",
                                       "<start_of_image>")


class ImageOnlyQwenProcessor(transformers.Qwen2_5_VLProcessor):
    """Qwen2_5_VLProcessor without its video processor (which needs torchvision, not installed
    here); the image path is the class's own."""

    def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
        self.image_token, self.video_token = "<|image_pad|>", "<|video_pad|>"
        self.image_token_id = tokenizer.convert_tokens_to_ids(self.image_token)
        self.video_token_id = tokenizer.convert_tokens_to_ids(self.video_token)
        ProcessorMixin.__init__(self, image_processor, tokenizer, chat_template=chat_template)


def qwen_processor():
    tok = char_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": [
        "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>",
        "<|video_pad|>"]})
    tok.padding_side = "left"
    image = transformers.Qwen2VLImageProcessorPil(min_pixels=56 * 56, max_pixels=112 * 112)
    return ImageOnlyQwenProcessor(image_processor=image, tokenizer=tok,
                                  chat_template=QWEN_TEMPLATE)


def gemma_processor(newlines: bool = False, image_seq_length: int = 4):
    """`newlines`: with the newline tokens ("\\n" to "\\n\\n\\n\\n") that vLLM's Gemma 3
    processor looks up (tests/test_vllm_images.py). `image_seq_length`: soft tokens per image."""
    base = char_tokenizer(["\n" * k for k in range(1, 5)] if newlines else ())
    tok = transformers.PreTrainedTokenizerFast(
        tokenizer_object=base.backend_tokenizer, pad_token="<pad>", bos_token="<s>",
        eos_token="</s>", unk_token="<unk>", padding_side="left",
        extra_special_tokens={"boi_token": "<start_of_image>", "eoi_token": "<end_of_image>",
                              "image_token": "<image_soft_token>"})
    image = transformers.Gemma3ImageProcessorPil(size={"height": 28, "width": 28})
    return transformers.Gemma3Processor(image_processor=image, tokenizer=tok,
                                        image_seq_length=image_seq_length,
                                        chat_template=GEMMA_TEMPLATE)


# ChatML with image parts and tool calls; its generation prompt begins the assistant's turn
# with a calculator call, so that a random model's every turn is one (the tool loop's suffix
# ends in the generation prompt: each result is followed by another call).
FORCED_CALL = '<tool_call>{"name": "calculator", "arguments": {"expression": "7 * 8"}}</tool_call>'
TOOL_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['content'] is string %}"
    "{{ m['content'] }}{% elif m['content'] %}{% for c in m['content'] %}"
    "{% if c['type'] == 'image' %}<start_of_image>{% elif c['type'] == 'text' %}{{ c['text'] }}"
    "{% endif %}{% endfor %}{% endif %}{% if m['tool_calls'] is defined and m['tool_calls'] %}"
    "{% for call in m['tool_calls'] %}<tool_call>{\"name\": \"{{ call['function']['name'] }}\", "
    "\"arguments\": {{ call['function']['arguments'] | tojson }}}</tool_call>{% endfor %}"
    "{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n"
    + FORCED_CALL + "{% endif %}")

# A calculator tool (a module's source) that returns a picture of the answer and the answer
# (TRL 1.16's multimodal tool result), and a reward of 1.0 for a completion that is a call, its
# result and another turn.
PICTURE_TOOL = (
    "from PIL import Image\n"
    "from grpo_jax.calculator import calculator as answer\n\n"
    "def calculator(expression: str) -> list:\n"
    '    """A picture of the answer, and the answer.\n\n'
    "    Args:\n"
    "        expression: The expression.\n"
    '    """\n'
    "    shade = int(answer(expression)) % 256\n"
    "    return [{'type': 'image', 'image': Image.new('RGB', (28, 28), (shade, 0, 255))},\n"
    "            {'type': 'text', 'text': answer(expression)}]\n")
PICTURE_EPISODE = (
    "def episode(prompts, completions, **kw):\n"
    "    return [float([m['role'] for m in c] == ['assistant', 'tool', 'assistant']\n"
    "                  and c[1]['content'][1]['text'] == '56') for c in completions]\n")


def tool_model(model_dir, to):
    """A copy (at `to`) of a Gemma 3 directory with TOOL_TEMPLATE and its Hermes parser saved
    with the tokenizer, and many stop tokens (so turns are short)."""
    import json
    import shutil

    from grpo_jax import images
    from grpo_jax.rollout import tools
    shutil.copytree(model_dir, to)
    tok = images.load_processor(model_dir).tokenizer
    tok.chat_template = TOOL_TEMPLATE
    tok.response_template = dict(tools.HERMES_RESPONSE_TEMPLATE,
                                 start_anchor="<|im_start|>assistant")
    tok.save_pretrained(to)
    gen = json.loads((to / "generation_config.json").read_text())
    (to / "generation_config.json").write_text(json.dumps(
        {**gen, "eos_token_id": list(range(2, 40))}))
    return to
