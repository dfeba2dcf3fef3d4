import sys, string, json
sys.path.insert(0, "/work/wt-vllmimg/tests")
import torch, transformers, safetensors.torch
from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from vlm_processors import GEMMA_TEMPLATE
from pathlib import Path

def processor():
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
    return transformers.Gemma3Processor(image_processor=image, tokenizer=fast, image_seq_length=4,
                                        chat_template=GEMMA_TEMPLATE)

def model(proc, seed=0):
    tok = proc.tokenizer
    ids = {n: tok.convert_tokens_to_ids(t) for n, t in (("image", "<image_soft_token>"), ("boi", "<start_of_image>"), ("eoi", "<end_of_image>"))}
    text = dict(vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                max_position_embeddings=512, rms_norm_eps=1e-6, query_pre_attn_scalar=32,
                sliding_window=8, layer_types=["sliding_attention", "full_attention"],
                bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=2,
                  image_size=28, patch_size=7, num_channels=3, vision_use_head=False)
    cfg = transformers.Gemma3Config(text_config=text, vision_config=vision, mm_tokens_per_image=4,
                                    image_token_index=ids["image"], boi_token_index=ids["boi"], eoi_token_index=ids["eoi"])
    torch.manual_seed(seed)
    m = transformers.Gemma3ForConditionalGeneration(cfg).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            if "norm" in name or "mm_input" in name:
                p.add_(0.1 * torch.randn_like(p))
            elif "language_model" in name:
                p.normal_(0, 0.1)
    return m

def save(path):
    path = Path(path); proc = processor()
    model(proc).save_pretrained(path); proc.save_pretrained(path)
    f = path / "model.safetensors"
    t = safetensors.torch.load_file(f)
    t = {("vision_tower.vision_model." + k[len("vision_tower."):] if k.startswith("vision_tower.") else k): v for k, v in t.items()}
    safetensors.torch.save_file(t, f, metadata={"format": "pt"})
    return path

if __name__ == "__main__":
    p = save(sys.argv[1]); print(sorted(json.load(open(p/"config.json")).keys()))
    print([k for k in safetensors.torch.load_file(p/"model.safetensors")][:50])
    pr = processor()
    print(pr.tokenizer("a\n\nb\n")["input_ids"], pr.full_image_sequence.encode())
