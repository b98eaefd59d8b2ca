"""Group sampling with transformers `generate`: the engine that runs everywhere.

It samples from the training model itself (unwrapped from DDP), so there are no
weights to push: `sync_weights` is a no-op. Prompts are repeated G times and
sampled in one batched call per `batch_size` prompts, with the KV cache on.
It reports no sampling log-probs: the sampler is the trained model itself, so
there is no sampler/trainer mismatch to measure.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch

from . import Rollout


class HFEngine:
    def __init__(
        self,
        get_model: Callable[[], torch.nn.Module],
        pad_token_id: int,
        eos_token_ids: list[int],
        max_completion_length: int,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = 0,
        batch_size: int = 0,
        full_parameters: Callable[[torch.nn.Module], ContextManager] | None = None,
    ):
        self.get_model = get_model  # returns the plain causal LM (unwrapped), called per generate
        # Context in which a sharded model's parameters are whole (ZeRO-3 gathers them); default: nothing to do.
        self.full_parameters = full_parameters or (lambda model: contextlib.nullcontext())
        self.pad_token_id = pad_token_id
        self.eos_token_ids = eos_token_ids
        self.max_completion_length = max_completion_length
        self.sampling = dict(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k or None)
        self.batch_size = batch_size

    def sync_weights(self, model: torch.nn.Module) -> None:
        """Nothing to do: this engine samples from the training model itself."""

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], num_generations: int, seeds: list[int] | None = None) -> Rollout:
        model = self.get_model()
        was_training = model.training
        model.eval()
        use_cache = model.config.use_cache
        model.config.use_cache = True
        # Seeded groups are generated one prompt at a time: generate has one RNG stream per call.
        step = 1 if seeds is not None else self.batch_size or len(prompt_ids)
        completions: list[list[int]] = []
        truncated: list[bool] = []
        try:
            with self.full_parameters(model):
                for start in range(0, len(prompt_ids), step):
                    with torch.random.fork_rng(devices=[]) if seeds is not None else contextlib.nullcontext():
                        if seeds is not None:
                            torch.manual_seed(seeds[start])
                        c, t = self._generate_batch(model, prompt_ids[start : start + step], num_generations)
                    completions += c
                    truncated += t
        finally:
            model.config.use_cache = use_cache
            model.train(was_training)
        return Rollout(completion_ids=completions, truncated=truncated)

    def _generate_batch(self, model, prompts: list[list[int]], g: int):
        width = max(len(p) for p in prompts)
        device = next(model.parameters()).device
        ids = torch.full((len(prompts), width), self.pad_token_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for row, p in enumerate(prompts):
            ids[row, width - len(p) :] = torch.tensor(p)
            mask[row, width - len(p) :] = 1
        out = model.generate(
            input_ids=ids.to(device),
            attention_mask=mask.to(device),
            num_return_sequences=g,  # rows come out grouped: prompt 0 x G, prompt 1 x G, ...
            max_new_tokens=self.max_completion_length,
            eos_token_id=self.eos_token_ids,
            pad_token_id=self.pad_token_id,
            **self.sampling,
        )
        new_tokens = out[:, width:].cpu()  # [B*G, <=L]
        eos = torch.tensor(self.eos_token_ids)
        completions, truncated = [], []
        for row in range(new_tokens.shape[0]):
            tokens = new_tokens[row].tolist()
            hits = torch.isin(new_tokens[row], eos).nonzero()
            length = int(hits[0]) + 1 if len(hits) else len(tokens)  # keep the EOS: it is trained on too
            completions.append(tokens[:length])
            truncated.append(not len(hits))
        return completions, truncated
