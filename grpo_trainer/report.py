"""Phase 8, report: one step's record (reduced over ranks), and what the loop (trainer.report) writes it with:
completions.jsonl samples, the progress bar.

It comes after the checkpoint (phase 7): the checkpoint's metrics history already holds this step's record.

Metric names follow TRL's where TRL has one (`reward`, `reward_std`,
`frac_reward_zero_std`, `completions/mean_length`, `kl`, `entropy`,
`clip_ratio/...`). Only the main process writes; every rank takes part in the
gathers that build the record.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch

from .checkpoint import flatten
from .config import Config
from .samples import EpisodeStats, ScoredBatch, TrainingSamples

logger = logging.getLogger("grpo_trainer")


def step_record(
    comm,
    step: int,
    scored: ScoredBatch,
    reward_stats: dict,
    batch,
    stats,
    learning_rate: float,
    extra: dict,
) -> dict:
    """Every metric of the step (a collective: every rank gathers); `stats` already reduced over ranks, `extra`
    (eval, timing) appended last. The completions/ lengths are the completions' (what the rewards judged), not
    their episodes' further branches; the trained fraction counts every row."""
    samples = scored.samples
    mine = samples.completions
    all_lengths = comm.gather(batch.lengths[:mine])
    all_truncated = comm.gather(torch.tensor(samples.truncated[:mine], dtype=torch.float32))
    step_metrics = stats.metrics(
        batch.total_tokens, sum(batch.mini_batch_rows), sampler_logprobs=samples.sampler_logprobs is not None
    )
    return {
        "step": step,
        **reward_stats,
        "loss": step_metrics.pop("loss"),
        "learning_rate": learning_rate,
        "completions/mean_length": float(all_lengths.mean()),
        "completions/max_length": float(all_lengths.max()),
        "completions/clipped_ratio": float(all_truncated.mean()),
        **length_by_outcome(all_lengths, samples.rewards),
        **step_metrics,
        **batch.metrics,
        **scored.reward_metrics,
        **scored.episodes.metrics,
        **extra,
    }


def length_by_outcome(lengths: torch.Tensor, rewards: torch.Tensor) -> dict[str, float]:
    """Mean completion length of rewarded (total reward > 0) vs unrewarded completions: the length-bias monitor."""
    valid = ~torch.isnan(rewards)
    correct, incorrect = valid & (rewards > 0), valid & (rewards <= 0)
    return {
        "completions/mean_length_correct": float(lengths[correct].mean()) if correct.any() else math.nan,
        "completions/mean_length_incorrect": float(lengths[incorrect].mean()) if incorrect.any() else math.nan,
    }


def completion_samples(
    texts: list[str],
    tokenizer,
    step: int,
    samples: TrainingSamples,
    episodes: EpisodeStats,
    rewards: torch.Tensor,
    advantages: torch.Tensor,
    n: int,
) -> list[dict]:
    """The first `n` completions of this rank as completions.jsonl records. The prompt is the one the model was
    conditioned on: the dataset's text, or, where the environment extended it by its reset text
    (`prompts_extended`), the prompt tokens decoded; an episode's record also says how it ended and, for a
    failure, why."""
    rows, endings = samples.prompt_rows, episodes.endings
    written = []
    for j in range(n):
        sample = {
            "step": step,
            "prompt": tokenizer.decode(samples.prompt_ids[j]) if samples.prompts_extended else texts[rows[j]],
            "completion": tokenizer.decode(samples.completion_ids[j], skip_special_tokens=True),
            "reward": float(rewards[j]),
            "advantage": float(advantages[j]),
        }
        if endings is not None:
            sample.update(ended_by=endings[j].ended_by, error=endings[j].error)
        written.append(sample)
    return written


def write_completions(path: Path, samples: list[dict], echo: bool) -> None:
    """Append samples to completions.jsonl; with `echo`, print them as a table too."""
    with path.open("a") as f:
        for sample in samples:
            f.write(json.dumps(sample) + "\n")
    if echo:
        width = 48
        cut = lambda text: (text.replace("\n", " ")[-width:]).ljust(width)  # noqa: E731 (prompt ends matter most)
        lines = [f"{'prompt (end)':<{width}} | {'completion':<{width}} | reward | advantage"]
        lines += [
            f"{cut(s['prompt'])} | {s['completion'].replace(chr(10), ' ')[:width]:<{width}} | {s['reward']:6.3f} | {s['advantage']:+.3f}"
            for s in samples
        ]
        logger.info("completions at step %d:\n%s", samples[0]["step"], "\n".join(lines))


def flat_hparams(cfg: Config) -> dict:
    """The config as flat scalars, which is what tensorboard's hparams accept."""
    flat = flatten(cfg.model_dump(mode="json"))
    return {k: v if isinstance(v, (int, float, str, bool)) else str(v) for k, v in flat.items()}


class ProgressBar:
    """tqdm bar with step, ETA and what moves on the main process; plain log lines when the bar is off.

    What moves: the reward and the completion length, then the KL to the reference (loss.beta > 0), the clip
    ratio (when the policy trains away from the sampling one: num_iterations or mini_batches > 1; otherwise
    the ratio is 1 and nothing is clipped) or, where neither applies, the entropy. Not the loss: GRPO's is a
    sum of advantage-weighted terms that are ~0 on average by construction, so it says nothing at a glance.
    """

    def __init__(self, cfg: Config, is_main: bool):
        self.enabled = is_main
        self.bar = None
        self.shown = is_main and cfg.logging.progress_bar
        self.max_steps = cfg.train.max_steps
        self.with_kl = cfg.loss.kl_on
        self.with_clip = cfg.train.policy_moves_within_step

    def start(self, step: int) -> None:
        """Show the bar from `step`, the last one done (a resumed run's bar continues where the run stopped)."""
        if self.shown:
            from tqdm.auto import tqdm

            self.bar = tqdm(total=self.max_steps, initial=step, desc="train", unit="step", dynamic_ncols=True)

    def summary(self, record: dict) -> dict[str, str]:
        summary = {"reward": f"{record['reward']:.3f}", "len": f"{record['completions/mean_length']:.1f}"}
        if self.with_kl:
            summary["kl"] = f"{record['kl']:.4f}"
        if self.with_clip:
            summary["clip"] = f"{record['clip_ratio/region_mean']:.3f}"
        if not (self.with_kl or self.with_clip):
            summary["entropy"] = f"{record['entropy']:.3f}"
        return summary

    def update(self, record: dict) -> None:
        if not self.enabled:
            return
        summary = self.summary(record)
        if self.bar is not None:
            self.bar.set_postfix(summary, refresh=False)
            self.bar.update(1)
        else:
            logger.info(
                "step %d %s step_time=%.2fs",
                record["step"],
                " ".join(f"{k}={v}" for k, v in summary.items()),
                record["step_time"],
            )

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
