"""Held-out evaluation: mean@k and pass@k of every reward on an eval split.

For each eval prompt, k completions are sampled (at `eval.temperature`, or the
rollout temperature) and scored by the configured rewards. Per reward, and for
the weighted total the trainer optimises:

- `mean@k`: the mean reward over the k samples of a prompt, averaged over
  prompts. Samples a reward has no opinion on (`None`) are left out of the
  mean; prompts on which it had no opinion at all are left out of the average.
- `pass@k`: the chance that at least one of k samples is *correct*, where
  correct means **reward > 0** (a `None` counts as not correct), estimated
  with the unbiased estimator of Chen et al. 2021 (HumanEval), averaged over
  prompts. With exactly n = k samples per prompt it is 1 if any sample is
  correct, else 0; `pass_at_k` also serves n > k.

Keys: `eval/<reward>/mean@k`, `eval/<reward>/pass@k`, `eval/reward/mean@k`,
`eval/reward/pass@k` (the weighted total), `eval/num_prompts`; with an environment, also
`eval/environment/failed` and `eval/environment/frac_failed` (episodes the environment failed: no score of the
model's, counted apart and warned about; mean@k and pass@k take them as `environment.on_error` scores them).

Where the prompts come from: `data.eval_source` (None: `data.source`), split
`data.eval_split` (None: `test`; a local file is one split, so the split is
ignored there), the first `eval.num_samples` records. Other data settings
(columns, chat template, system prompt) are those of training.

Deliberately simple: evaluation uses the `hf` engine (transformers), whatever
engine training samples with. During training every rank runs the same
evaluation (see `trainer.periodic_eval`), so a ZeRO-3 model is gathered by all
ranks together. It draws its randomness from a forked RNG seeded with `seed`,
so results are reproducible and the training RNG stream is untouched (exact
resume is not disturbed by periodic evaluation).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from contextlib import AbstractContextManager
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from .config import Config
from .data import LOCAL_FORMATS
from .environments import Environment, EpisodeRecord, build_environment
from .environments.episodes import with_environment
from .environments.scoring import failure_kinds
from .errors import ConfigError, DataError
from .models import context_length, eos_token_ids, load_causal_lm, load_tokenizer
from .rollout import RolloutEngine, needs_episodes, sampling_settings
from .rollout.hf import HFEngine
from .seeds import mix_seed
from .task import Task, load_task

logger = logging.getLogger("grpo_trainer")

DEFAULT_EVAL_SPLIT = "test"
DEFAULT_BATCH_PROMPTS = 32
COUNTS = (
    "eval/num_prompts",
    "eval/environment/failed",
)  # shown as whole numbers  # prompts per generate call when rollout.batch_size is 0


# ----------------------------------------------------------------------------- the estimators


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples of which c are correct (Chen et al. 2021, eq. 1).

    pass@k = 1 - C(n - c, k) / C(n, k): one minus the chance that k samples drawn
    without replacement from the n are all incorrect. Exact integer arithmetic.
    """
    if not (0 <= c <= n and 1 <= k <= n):
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k contains a correct sample
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def summarize(values: torch.Tensor, names: list[str], k: int) -> dict[str, float]:
    """mean@k and pass@k per column from sampled rewards.

    values: [P, n, R] rewards of n samples for each of P prompts, NaN = no opinion.
    names:  R metric names (`reward` for the weighted total, else the reward's name).
    Returns `eval/<name>/mean@k` and `eval/<name>/pass@k` for each name.
    """
    if values.dim() != 3 or values.shape[2] != len(names):
        raise ValueError(f"values must be [prompts, samples, {len(names)}], got {tuple(values.shape)}")
    n = values.shape[1]
    values = values.double()  # float32 rewards would print 0.325 as 0.32499998807907104
    out: dict[str, float] = {}
    for j, name in enumerate(names):
        v = values[:, :, j]  # [P, n]
        opinion = ~torch.isnan(v)
        scored = opinion.any(1)  # prompts with at least one opinion
        per_prompt_mean = torch.where(opinion, v, torch.zeros_like(v)).sum(1) / opinion.sum(1).clamp(min=1)  # [P]
        correct = (v > 0).sum(1)  # NaN > 0 is False: no opinion is not correct
        passes = [pass_at_k(n, int(c), k) for c in correct[scored]]
        out[f"eval/{name}/mean@{k}"] = float(per_prompt_mean[scored].mean()) if scored.any() else math.nan
        out[f"eval/{name}/pass@{k}"] = sum(passes) / len(passes) if passes else math.nan
    return out


# ----------------------------------------------------------------------------- settings


@dataclass
class EvalSettings:
    source: str
    split: str
    num_samples: int | None
    k: int
    temperature: float


def eval_settings(cfg: Config, k: int | None = None, num_prompts: int | None = None) -> EvalSettings:
    """Resolve the eval settings, reading `data.eval_*` and `eval.*` if the config has them.

    `k` overrides eval.num_generations and `num_prompts` overrides eval.num_samples.
    """
    section = cfg.eval
    source = cfg.data.eval_source or cfg.data.source
    split = cfg.data.eval_split or DEFAULT_EVAL_SPLIT
    k = k if k is not None else section.num_generations
    if k < 1:
        raise ConfigError(f"eval: k (the samples per prompt) must be at least 1, got {k}")
    num_samples = num_prompts if num_prompts is not None else section.num_samples
    if num_samples is not None and num_samples < 1:
        raise ConfigError(f"eval: the number of prompts must be at least 1, got {num_samples}")
    temperature = section.temperature or cfg.rollout.temperature
    return EvalSettings(
        source=source,
        split=split,
        num_samples=num_samples,
        k=k,
        temperature=temperature,
    )


def load_eval_task(
    cfg: Config,
    tokenizer,
    max_context: int | None = None,
    num_prompts: int | None = None,
    *,
    environment: Environment | None,
) -> Task:
    """The eval prompts, formatted and tokenized, and the rewards; build once, reuse for every evaluation.
    `environment`: the run's (build_environment(cfg)), which plays the evaluation's episodes as it plays training's.

    Raises DataError on a bad source, split or record.
    """
    s = eval_settings(cfg, num_prompts=num_prompts)
    data_cfg = cfg.data.model_copy(update={"source": s.source, "num_samples": s.num_samples})
    one_split = Path(s.source).suffix.lower() in LOCAL_FORMATS  # a local file has no splits: the split is ignored
    if s.source == cfg.data.source and (s.split == cfg.data.split or one_split):
        logger.warning(
            "eval: prompts come from the training data (%s, split %r); set data.eval_source or data.eval_split",
            s.source,
            s.split,
        )
    try:
        return load_task(
            data_cfg,
            cfg.rewards,
            tokenizer,
            max_context,
            split=s.split,
            policy_dtype=cfg.model.dtype,
            tools=environment.tools or None if environment else None,
            environment=environment,
            environment_config=cfg.environment,
        )
    except DataError as exc:
        raise DataError(
            f"eval data: {exc} (set data.eval_split / data.eval_source to choose held-out prompts)"
        ) from None


# ----------------------------------------------------------------------------- evaluation


def evaluate_model(
    lm: torch.nn.Module,
    tokenizer,
    cfg: Config,
    k: int | None = None,
    *,
    task: Task | None = None,
    num_prompts: int | None = None,
    progress: bool = True,
    full_parameters: Callable[[torch.nn.Module], AbstractContextManager] | None = None,
    lockstep=None,
    kernel_plan: Mapping[str, str] | None = None,
) -> dict[str, float]:
    """Evaluate an already-loaded causal LM (plain, unwrapped) on the eval prompts; see the module docstring.

    `full_parameters(lm)` is the context in which a sharded model is whole (the trainer passes its ZeRO-3
    gathering, entered by all ranks together); by default there is nothing to gather. `lockstep`: the ranks'
    collectives where every forward is one (FSDP, see HFEngine), so that all ranks make the same forward calls.
    `kernel_plan`: the decode loop's kernel choices (the training run's; default: planned for this evaluation's
    shapes before it samples, rollout/kernels.py).

    Pass `task=load_eval_task(...)` to reuse the tokenized prompts (and the run's environment, which the task
    carries) across periodic evaluations (then `num_prompts`, which overrides eval.num_samples, is decided there).
    Without, the environment is built here, and closed at the end.
    The model's train/eval mode and KV-cache setting are restored afterwards.
    """
    s = eval_settings(cfg, k)
    built = None  # the environment built here, closed here
    if task is None:
        built = build_environment(cfg)
        try:
            task = load_eval_task(cfg, tokenizer, context_length(lm), num_prompts, environment=built)
        except BaseException:
            if built is not None:
                built.close()
            raise
    sampling = replace(sampling_settings(cfg, eos_token_ids(tokenizer, lm)), temperature=s.temperature, batch_size=0)
    engine: RolloutEngine = HFEngine(
        sampling,
        get_model=lambda: lm,
        pad_token_id=tokenizer.pad_token_id,
        tokenizer=tokenizer,
        share_prompt=cfg.model.share_prompt,
        full_parameters=full_parameters,
        lockstep=lockstep,
        kernel_plan=kernel_plan,
    )
    engine = with_environment(engine, tokenizer, cfg, sampling, task.environment)  # evaluated as trained
    try:
        scores, episodes = _sample_and_score(engine, task, cfg, s.k, next(lm.parameters()).device, progress)
    finally:
        engine.close()  # the episode loop's threads (the HFEngine itself holds nothing)
        if built is not None:
            built.close()
    results = summarize(scores, [r.name for r in task.rewards] + ["reward"], s.k)
    results["eval/num_prompts"] = float(len(task))
    if episodes:
        results.update(environment_failures(episodes, cfg))
    return results


def _sample_and_score(
    engine: RolloutEngine, task: Task, cfg: Config, k: int, device: torch.device, progress: bool
) -> tuple[torch.Tensor, list[EpisodeRecord]]:
    """k completions of every eval prompt, in batches of prompts, scored: [prompts, k, R + 1] (every reward
    function, then the weighted total), and how every episode went (with an environment). Sampled under the
    run's seed in a forked random state, so an evaluation leaves training's random stream as it was."""
    from tqdm.auto import tqdm

    prompts_total = len(task)
    per_batch = cfg.rollout.batch_size or DEFAULT_BATCH_PROMPTS
    chunks: list[torch.Tensor] = []  # [p, k, R + 1] per batch of prompts
    episodes: list[EpisodeRecord] = []
    bar = tqdm(total=prompts_total, desc=f"eval (k={k})", unit="prompt", disable=not progress, dynamic_ncols=True)
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(cfg.seed)
        for start in range(0, prompts_total, per_batch):
            indices = list(range(start, min(start + per_batch, prompts_total)))
            specs = None
            if needs_episodes(engine):  # eval's own seeds: step 0 is never a training step
                specs = [task.episode_spec(i, mix_seed(cfg.seed, 0, -1, i), f"eval-{i}") for i in indices]
            rollout = engine.generate(task.prompt_ids(indices), k, episodes=specs)
            episodes += rollout.episodes or []
            scored = task.score([i for i in indices for _ in range(k)], rollout)  # grouped: prompt i x k
            both = torch.cat([scored.per_function, scored.total[:, None]], 1)  # [p * k, R + 1]
            chunks.append(both.view(len(indices), k, -1))
            bar.update(len(indices))
    bar.close()
    return torch.cat(chunks, 0), episodes


def environment_failures(episodes: list[EpisodeRecord], cfg: Config) -> dict[str, float]:
    """`eval/environment/failed` and `frac_failed`: episodes the environment failed are no score of the model's,
    so they are counted beside mean@k and pass@k (which take them as environment.on_error scores them: 0 under
    `zero`, left out under `none` and `skip_group`), and warned about with their first error."""
    failed = sum(e.failed for e in episodes)
    if failed:
        policy = cfg.environment.on_error
        scored_as = "as 0" if policy == "zero" else "as no opinion: left out, nan where nothing is left"
        logger.warning(
            "eval: %d of %d episodes failed (first: %s); mean@k and pass@k count them %s (environment.on_error=%s)",
            failed,
            len(episodes),
            failure_kinds(episodes)[0][0],
            scored_as,
            policy,
        )
    return {"eval/environment/failed": float(failed), "eval/environment/frac_failed": failed / len(episodes)}


def evaluate(
    cfg: Config,
    checkpoint: str | Path | None = None,
    k: int | None = None,
    *,
    num_prompts: int | None = None,
    progress: bool = True,
) -> dict[str, float]:
    """Load the model (`checkpoint`, or `cfg.model` when None) and evaluate it on one process.

    `checkpoint` is a `save_pretrained` folder (e.g. OUTPUT_DIR/model) or a training
    checkpoint (OUTPUT_DIR/checkpoints/step-N). Uses a GPU if one is visible.
    """
    lm, tokenizer = load_for_eval(cfg, checkpoint)
    lm.to("cuda" if torch.cuda.is_available() else "cpu")
    return evaluate_model(lm, tokenizer, cfg, k, num_prompts=num_prompts, progress=progress)


def format_results(results: dict[str, float]) -> str:
    """One `key: value` line per metric, for the console."""
    return "\n".join(
        f"{key}: {int(value)}" if key in COUNTS else f"{key}: {value:.4f}" for key, value in results.items()
    )


# ----------------------------------------------------------------------------- loading


def load_for_eval(cfg: Config, checkpoint: str | Path | None):
    """(model, tokenizer) for a save_pretrained folder (full model or PEFT adapter), a training checkpoint, or cfg.model.

    A training checkpoint is loaded with the config it carries (`checkpoint.load_checkpoint_model`, as
    `export` does), whatever `cfg` says about the model.
    """
    if checkpoint is None:
        return load_causal_lm(cfg.model), load_tokenizer(cfg.model, cfg.data.chat_template)
    path = Path(checkpoint)
    if not path.is_dir():
        raise ConfigError(
            f"checkpoint: {path} is not a folder (expected OUTPUT_DIR/model or OUTPUT_DIR/checkpoints/step-N)"
        )
    if (path / "config.json").is_file():  # a save_pretrained folder
        model_cfg = cfg.model.model_copy(update={"name_or_path": str(path)})
        has_tokenizer = (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file()
        tokenizer = load_tokenizer(model_cfg if has_tokenizer else cfg.model, cfg.data.chat_template)
        return load_causal_lm(model_cfg), tokenizer
    if (
        path / "adapter_config.json"
    ).is_file():  # a PEFT adapter folder: the base model from cfg.model, then the adapter
        from peft import PeftModel

        base_cfg = cfg.model.model_copy(update={"lora": None})
        lm = PeftModel.from_pretrained(load_causal_lm(base_cfg), str(path))
        has_tokenizer = (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file()
        model_cfg = cfg.model.model_copy(update={"name_or_path": str(path)}) if has_tokenizer else cfg.model
        return lm, load_tokenizer(model_cfg, cfg.data.chat_template)
    from .checkpoint import load_checkpoint_model

    lm, tokenizer, _ = load_checkpoint_model(path)  # a training checkpoint: with the config it was trained with
    return lm, tokenizer
