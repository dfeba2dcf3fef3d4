"""Rollouts from a vLLM server, behind the JAX sampler's interface (`rollout.backend: vllm`)."""

from __future__ import annotations

import os
import sys
import time

import jax
import numpy as np

from grpo_jax import hf, images, peft_io
from grpo_jax.config.rollout import SamplingParams
from grpo_jax.models import lora
from grpo_jax.rollout import row_images
from grpo_jax.rollout.base import Rollout, RolloutBatch, WeightMode
from grpo_jax.rollout.padding import bucketed_prompts
from grpo_jax.rollout.vllm.client import Completion, VLLMClient, rollout_arrays
from grpo_jax.rollout.vllm.sync import ServerWeights, resolve_transport, transfer_metrics
from grpo_jax.errors import ServerUnreachableError, VLLMServerError, WeightsLost


def warn_filters(sp) -> None:
    """vLLM's log-probs are of the filtered distribution it samples from, the trainer's of the
    whole one: with a filter on they differ (measured in docs/vllm_weight_sync.md)."""
    on = [f"{name}={value}" for name, value, off in (
        ("top_p", sp.top_p, 1.0), ("top_k", sp.top_k or 0, 0), ("min_p", sp.min_p or 0.0, 0.0),
        ("repetition_penalty", sp.repetition_penalty, 1.0)) if value != off]
    if on:
        print(f"warning: with {', '.join(on)} vLLM's sampler log-probs are renormalised over the "
              "tokens the filters keep and the trainer's are not, so the importance-sampling "
              "correction and sampling/* metrics see a mismatch of -log(kept mass) per token "
              "(huggingface/trl#6789; figures in docs/vllm_weight_sync.md)", file=sys.stderr)


class VLLMRollout(Rollout):
    """Completions from a vLLM server, which holds its own weights: PUSH (LoRA: merged) or
    PUSH_ADAPTERS (the server merges the adapters, or serves them with vLLM's LoRA)."""

    def __init__(self, cfg, model_cfg, sp: SamplingParams, pad: int, processor=None):
        """`sp`: the run's sampling settings (engines.make_rollout makes them, with TRL's stop
        set); `pad`: the tokenizer's pad id. `processor`: a vision-language model's HF
        processor (Gemma 3's, Qwen-VL's): the rows' records give each prompt's images, sent
        with its unexpanded ids (generate_images); each push sends the language model's
        weights, and the tower's when it has adapters (_pushed; nccl: its plan's tower)."""
        self.processor = processor
        self.image_token_id = None if processor is None else model_cfg.vision.image_token_id
        self.takes_records = processor is not None
        r = cfg.rollout
        self.client = VLLMClient(r.base_url, api_key=r.vllm_server_api_key
                                 or os.environ.get("VLLM_API_KEY"),
                                 weight_sync_timeout=r.weight_sync_timeout)
        self.server_timeout = r.vllm_server_timeout
        self.client.wait_healthy(r.vllm_server_timeout)
        max_len = (cfg.data.max_prompt_length or 0) + cfg.generation.max_completion_length
        self.client.check_model(model_cfg, max_len=max_len or None)
        print(f"rollouts from the vLLM server at {r.base_url}", file=sys.stderr)
        self.model_cfg, self.pad, self.sp = model_cfg, pad, sp
        self.extras = r.request_extras()
        warn_filters(self.sp)
        transport = resolve_transport(r.vllm_weight_sync, self.client)
        # With LoRA: whether update_weights takes the adapters alone (with the frozen base) or
        # the full weights with the adapters merged in. Over http the adapters alone always
        # work (our engine merges them into the base it was given once), unless the server runs
        # vLLM's own LoRA (`grpo_jax.serve --lora-rank R`), which then serves them.
        self.weight_mode = WeightMode.PUSH
        # LoRA on the tower too (PEFT's rules on a vision-language model): its weights are
        # pushed with the language model's.
        self.tower_adapted = bool(cfg.peft.use_peft and lora.tower_targets(cfg.peft, model_cfg))
        merge_on_server = (cfg.peft.use_peft and not cfg.peft.quant_bits and transport == "http"
                           and r.vllm_lora_sync == "adapter"
                           and not self.client.model_info().get("max_lora_rank"))
        # A frozen tower stays as the server loaded it (model_cfg None: the server's model).
        frozen_tower = (model_cfg is not None and model_cfg.vision is not None
                        and not self.tower_adapted)
        self.weights = ServerWeights(self.client, transport, model_cfg,
                                     lora_scaling=cfg.peft.scale if merge_on_server else None,
                                     tower=not frozen_tower)
        if self.weights.lora_scaling is not None:
            self.weight_mode = WeightMode.PUSH_ADAPTERS
        elif cfg.peft.use_peft and r.vllm_lora_sync == "adapter":
            # The server's base is the checkpoint as stored, the trainer's a quantized copy:
            # only merged weights (the dequantized base + adapters) make them the same policy.
            problem = ("the trainer's base is quantized (load_in_8bit / load_in_4bit)"
                       if cfg.peft.quant_bits else
                       "the vision tower has adapters (its LoRA is given the language model's only)"
                       if self.tower_adapted else self.client.adapter_problem(cfg.peft.lora_r))
            if problem:
                print(f"vllm_lora_sync: adapter is not possible with the vLLM server at "
                      f"{r.base_url}: {problem}; pushing merged full weights instead",
                      file=sys.stderr)
            else:
                self.weight_mode = WeightMode.PUSH_ADAPTERS
                self.adapter_conf = peft_io.adapter_config(cfg.peft, peft_io.base_name(cfg),
                                                            model_cfg)

    def generate(self, weights, prompt_ids, num_generations, key, records=None) -> RolloutBatch:
        seed = int(jax.random.randint(key, (), 0, 2**30))
        if self.processor is not None:
            return self.generate_images(prompt_ids, num_generations, seed, records)
        groups = self._on_current_weights(lambda: self._request(prompt_ids, num_generations, seed))
        arrays = rollout_arrays([c for g in groups for c in g], self.pad,
                                length=self.sp.max_completion_length)
        ids, mask = bucketed_prompts(prompt_ids, num_generations, self.pad)
        return RolloutBatch(ids, mask, arrays["completion_ids"], arrays["completion_mask"],
                            arrays["truncated"], arrays["sampler_logp"])

    def generate_images(self, prompt_ids, num_generations, seed, records) -> RolloutBatch:
        """generate for prompts with images (records[i]: prompt i's record, its images those of
        its multimodal prompt, then in a tool loop's context those its tools returned,
        images.record_images). vLLM expands each image placeholder itself, so each prompt goes
        in with one placeholder per image (unexpanded_ids), and each image at the size the
        trainer's processor resizes it to; the server's expansion must give back our ids, else
        the server's tokens would not be the ones the trainer scores. A tool loop's context
        holding a placeholder token the model wrote (text to the trainer, an image to vLLM)
        can't be sent: its rows end there, with no tokens. The batch carries each row's images
        (Qwen-VL: and M-RoPE positions) for the trainer's forwards, as the JAX sampler's
        does."""
        if records is None or len(records) != len(prompt_ids):
            raise ValueError("a vision-language model's rollout needs each prompt's record")
        pictures = [images.record_images(rec) for rec in records]
        marks = [images.image_tokens(rec) for rec in records]
        short = [unexpanded_ids(self.processor, self.model_cfg, ids, m)
                 for ids, m in zip(prompt_ids, marks)]
        sent = [i for i, ids in enumerate(short) if ids is not None]
        if len(sent) < len(short):
            print(f"{len(short) - len(sent)} of {len(short)} tool-loop contexts hold an image "
                  "placeholder token that the model wrote, which the vLLM server would read as "
                  "an image: those rows end there (the JAX sampler reads it as text)",
                  file=sys.stderr)
        sp = self.sp

        def request():
            if not sent:
                return [], []
            return self.client.generate_images(
                [short[i] for i in sent],
                [[images.at_processed_size(self.processor, im) for im in pictures[i]]
                 for i in sent], n=num_generations, temperature=sp.temperature,
                top_p=sp.top_p, top_k=sp.top_k, min_p=sp.min_p,
                repetition_penalty=sp.repetition_penalty, max_tokens=sp.max_completion_length,
                stop_token_ids=sp.stop_token_ids, seed=seed, extras=self.extras)
        served, expanded = self._on_current_weights(request)
        groups = [[Completion([], [], "stop")] * num_generations for _ in prompt_ids]
        for i, group, theirs in zip(sent, served, expanded):
            ours = list(map(int, prompt_ids[i]))
            if theirs and ours != theirs:
                raise VLLMServerError(
                    f"{self.client.base_url}: vLLM expanded prompt {i}'s images into other "
                    f"tokens than the trainer's processor ({len(theirs)} vs {len(ours)} ids): "
                    "serve the trainer's model directory, processor files included")
            groups[i] = group
        arrays = rollout_arrays([c for g in groups for c in g], self.pad,
                                length=self.sp.max_completion_length)
        ids, mask = bucketed_prompts(prompt_ids, num_generations, self.pad)
        px = images.row_pixels(self.processor, pictures)
        grids = (None if px.image_grid is None
                 else np.repeat(px.image_grid, num_generations, axis=0))
        return RolloutBatch(ids, mask, arrays["completion_ids"], arrays["completion_mask"],
                            arrays["truncated"], arrays["sampler_logp"],
                            pixel_values=np.repeat(px.pixel_values, num_generations, axis=0),
                            image_grid=grids,
                            positions=row_images.positions(
                                self.model_cfg, self.pad, ids, mask, grids,
                                arrays["completion_ids"].shape[1],
                                [m for m in marks for _ in range(num_generations)]))

    def with_row_images(self, r: RolloutBatch, records) -> RolloutBatch:
        return row_images.with_row_images(self.processor, self.model_cfg, self.pad, r, records)

    def _pushed(self, table: dict) -> dict:
        """The table-layout params a push sends: a vision-language model's tower is frozen
        unless it has adapters, so the server keeps the one it loaded and only the language
        model's weights go (the projector, vision/mm_*, is the tower's, frozen with it); an
        adapted tower goes too (merged, or the base its adapters are merged into)."""
        if self.model_cfg.vision is None or self.tower_adapted:
            return table
        return {k: v for k, v in table.items() if not k.startswith("vision/")}

    def _on_current_weights(self, fn, attempts: int = 3):
        """fn() on a server holding the last pushed weights. A server that died, or came back
        from a restart with its initial weights (a retried request reaches the new one), is
        waited for (vllm_server_timeout), re-synced in full, and asked again."""
        for attempt in range(attempts):
            try:
                # Any version of ours will do: with async rounds a push may be under way (its
                # pause lets these requests finish on the weights they started with); a
                # restarted server says "default".
                pushed = self.weights.count
                if pushed and self.weights.held() is None:
                    raise WeightsLost(f"{self.client.base_url} no longer holds the pushed weights")
                out = fn()
                if not pushed or self.weights.held() is not None:
                    return out
                raise WeightsLost(f"{self.client.base_url} lost the pushed weights meanwhile")
            except (ServerUnreachableError, WeightsLost) as e:
                if attempt + 1 == attempts or self.weights.base is None:
                    raise
                self._recover(e)
        raise AssertionError("unreachable")

    def _recover(self, error) -> None:
        print(f"{error}; waiting up to {self.server_timeout:.0f} s for the server, then pushing "
              "every weight again", file=sys.stderr)
        self.weights.resync(self.server_timeout)

    def _request(self, prompt_ids, num_generations, seed):
        sp = self.sp
        return self.client.generate(
            prompt_ids, n=num_generations, temperature=sp.temperature, top_p=sp.top_p,
            top_k=sp.top_k, min_p=sp.min_p, repetition_penalty=sp.repetition_penalty,
            max_tokens=sp.max_completion_length, stop_token_ids=sp.stop_token_ids, seed=seed,
            extras=self.extras)

    @property
    def sync_metrics(self) -> dict:
        return {**self.weights.metrics, "weight_sync/server_restarts": self.weights.restarts}

    def update_weights(self, weights, params=None) -> float:
        """Push `weights` (PUSH_ADAPTERS: the pair (LoRA adapters, frozen base)) to the
        server; returns the seconds it took."""
        if self.weight_mode is WeightMode.PUSH_ADAPTERS:
            adapters, base = weights
            dtype = self.weights.dtype
            adapters = peft_io.state_adapters(adapters)
            if self.weights.lora_scaling is None:  # vLLM's own LoRA, through files
                tensors = peft_io.layer_adapter_tensors(self.model_cfg, adapters, dtype)
                seconds = self.client.sync_adapter(tensors, self.adapter_conf)
                self.weights.metrics = transfer_metrics(
                    sum(a.nbytes for a in tensors.values()), seconds)
                return seconds
            tensors = peft_io.engine_adapter_tensors(self.model_cfg, adapters, dtype)
            push = lambda: self.weights.push_adapters(  # noqa: E731
                lambda: self._pushed(hf.params_from_state(self.model_cfg, base)), tensors)
        elif self.weights.transport == "nccl":  # from the device, nothing on the host
            return self.weights.push_device(weights)
        else:
            table = self._pushed(hf.params_from_state(self.model_cfg, weights))
            push = lambda: self.weights.push_full(table)  # noqa: E731
        try:
            return push()
        except ServerUnreachableError as e:  # died mid-update: what was pushed is remembered
            start = time.perf_counter()
            self._recover(e)
            return time.perf_counter() - start


def unexpanded_ids(processor, model_cfg, ids, image_tokens=None) -> list[int] | None:
    """A prompt's ids (the processor's, each image's placeholder expanded to its image
    sequence) with each image back to the one placeholder the chat template wrote, which vLLM
    expands itself (its inverse, token for token). `image_tokens`: which of the ids may be
    images (images.placeholders; None: all), a tool loop's context marking its tool results'
    images and not the model's tokens. None: the ids hold a placeholder token that is no image
    (the model wrote it), which vLLM would take for one.
    Gemma 3: each "\\n\\n" boi + soft tokens + eoi "\\n\\n" (processor.full_image_sequence) as
    boi, the newlines taken out of the newline tokens around it, which vLLM merges back.
    Qwen-VL: each run of image_token_id (between vision start and end) as one."""
    ids = [int(t) for t in ids]
    image = model_cfg.vision.image_token_id
    marks = images.placeholders([ids], [[1] * len(ids)], image, 0,
                                None if image_tokens is None else [image_tokens])[0][0]
    if model_cfg.image_blocks:  # Gemma 3
        return _gemma_unexpanded(processor, ids, marks, image)
    if any(t == image and not m for t, m in zip(ids, marks)):
        return None
    return [t for i, t in enumerate(ids) if not (marks[i] and i and marks[i - 1])]


NOT_FULL_SEQUENCE = ("an image's tokens are not the processor's full_image_sequence (two "
                     "newlines, boi, soft tokens, eoi, two newlines)")


def _gemma_unexpanded(processor, ids: list[int], marks, soft: int) -> list[int] | None:
    """One pass: text tokens are kept, each image's boi soft... eoi becomes boi, and its two
    newlines on each side come out of the newline tokens around it (those before from the end
    of what is kept, those after as they come)."""
    tok = processor.tokenizer
    boi = tok.convert_tokens_to_ids(processor.boi_token)
    eoi = tok.convert_tokens_to_ids(tok.eoi_token)
    vocab = tok.get_vocab()
    runs = {vocab["\n" * k]: k for k in range(1, 33) if "\n" * k in vocab}

    def less(token: int, need: int) -> tuple[list[int], int]:
        """Newline token `token` less up to `need` newlines: (what is left of it, need left)."""
        k = runs.get(token)
        if k is None or (k > need and "\n" * (k - need) not in vocab):
            raise ValueError(NOT_FULL_SEQUENCE)
        return ([vocab["\n" * (k - need)]] if k > need else []), max(need - k, 0)

    out, owed, i = [], 0, 0  # owed: the last image's newlines not yet taken out after it
    while i < len(ids):
        if ids[i] == soft and not marks[i]:
            return None  # a soft token the model wrote
        if ids[i] != boi and not marks[i]:
            if owed:
                left, owed = less(ids[i], owed)
                out += left
            else:
                out.append(ids[i])
            i += 1
            continue
        end = i + 1  # boi, then the image's soft tokens, then eoi
        while end < len(ids) and marks[end]:
            end += 1
        if ids[i] != boi or end == i + 1 or end == len(ids) or ids[end] != eoi:
            return None  # a boi the model wrote
        need = 2
        while need:
            if owed or not out:
                raise ValueError(NOT_FULL_SEQUENCE)
            left, need = less(out.pop(), need)
            out += left
        out.append(boi)
        owed, i = 2, end + 1
    if owed:
        raise ValueError(NOT_FULL_SEQUENCE)
    return out
