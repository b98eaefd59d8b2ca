"""The step's phases called directly: micro-batch construction, the update, cross-rank statistics, the weight
sync decision, and the loop driving an engine's lifecycle. (collect: tests/test_dynamic_sampling.py.)"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from torch import nn

from grpo_trainer.batches import build_train_batch
from grpo_trainer.config import Config, load_config
from grpo_trainer.rollout import EngineWrapper, SamplesTrainingModel, Sleeps
from grpo_trainer.geometry import Geometry, batch_geometry
from grpo_trainer.cpu.heap import HeapTrimmer
from grpo_trainer.rollout_queue import push_weights
from grpo_trainer.train_state import TrainState
from grpo_trainer.terms import LossTerm, TermModels, build_terms
from grpo_trainer.update import (
    Learner,
    LogprobSettings,
    LossSettings,
    StepStats,
    UpdateSettings,
    add_logprobs,
    micro_batch_loss,
    update,
)
from helpers import run_ranks, small_run_overrides, training_samples

PAD = 0
ONE_RANK = SimpleNamespace(sum=lambda t: t)  # the collectives of a single process


def four_completions(advantages, truncated=(False, False, False, True)):
    """Two prompts x G = 2: prompt [1, 2] -> [5, 6, 2], [7]; prompt [3] -> [8, 9], [4, 4, 4, 4] (truncated)."""
    samples = training_samples(
        [[1, 2], [1, 2], [3], [3]],
        [[5, 6, 2], [7], [8, 9], [4, 4, 4, 4]],
        truncated=list(truncated),
        sampler_logprobs=[[-0.1, -0.2, -0.3], [-0.4], [-0.5, -0.6], [-0.7] * 4],
    )
    return samples, torch.tensor(advantages, dtype=torch.float32)


def test_micro_batches_keep_every_row_pad_and_mask_truncated_completions():
    samples, advantages = four_completions([1.0, -1.0, 0.0, 0.0])
    batch = build_train_batch(samples, advantages, PAD, micro_batch_size=2, mask_truncated=True,
                              skip_zero_advantage=False)
    assert len(batch.micro_batches) == 2 and batch.trained_completions == 4
    assert batch.local_tokens == 3 + 1 + 2  # the truncated completion counts in no normaliser
    first, second = batch.micro_batches
    assert first.sequences["prompt_ids"].tolist() == [[1, 2]]  # a group's prompt is held once
    assert first.sequences["prompt_index"].tolist() == [0, 0]
    assert first.sequences["completion_ids"].tolist() == [[5, 6, 2], [7, PAD, PAD]]
    assert first.mask.tolist() == [[1, 1, 1], [1, 0, 0]]
    assert torch.allclose(first.sampling_logp, torch.tensor([[-0.1, -0.2, -0.3], [-0.4, 0, 0]]))
    assert second.mask.tolist() == [[1, 1, 0, 0], [0, 0, 0, 0]]  # truncated: every token masked
    assert second.advantages.tolist() == [0.0, 0.0]


def test_zero_advantage_rows_skip_the_passes_but_not_the_normaliser():
    samples, advantages = four_completions([1.0, -1.0, 0.0, 0.0], truncated=(False,) * 4)
    batch = build_train_batch(samples, advantages, PAD, micro_batch_size=2, mask_truncated=False,
                              skip_zero_advantage=True)
    # The same number of micro-batches (every rank must make the same backward calls), one trainable row each.
    assert [mb.sequences["completion_ids"].tolist() for mb in batch.micro_batches] == [[[5, 6, 2]], [[7]]]
    assert batch.trained_completions == 2 and batch.local_tokens == 3 + 1 + 2 + 4


class ToyPolicy(nn.Module):
    """log pi(token) = log_softmax(w)[token], whatever the prompt: a policy with TokenLogprobs' interface whose
    gradient is easy to write down."""

    def __init__(self, vocab: int = 10):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 1, vocab))

    def forward(self, prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask, with_entropy=False):
        logp_all = self.w.log_softmax(-1)
        entropy = -(logp_all.exp() * logp_all).sum()
        return logp_all[completion_ids], (entropy.expand(completion_ids.shape) if with_entropy else None)


@pytest.fixture
def accelerator_factory():
    """Single-process Accelerators in this test process; Accelerate's singletons are reset afterwards."""
    from accelerate import Accelerator
    from accelerate.state import AcceleratorState, GradientState

    yield lambda accumulation: Accelerator(cpu=True, gradient_accumulation_steps=accumulation)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()


@dataclass(frozen=True)
class ToyUpdate:
    """What the update phase is given in a step (update.Learner, the terms, the collectives, the settings), built
    as trainer.train_step builds them, around a toy policy and SGD (lr 1)."""

    cfg: Config
    geometry: Geometry
    learner: Learner
    terms: tuple[LossTerm, ...] = ()
    comm: Any = field(default_factory=lambda: ONE_RANK)

    @property
    def policy(self):
        return self.learner.policy

    def add_logprobs(self, batch) -> None:
        add_logprobs(self.policy, batch, self.terms, self.comm, LogprobSettings.of(self.cfg))

    def update(self, batch, state: TrainState):
        return update(self.learner, batch, state, self.terms, self.comm, UpdateSettings.of(self.cfg, self.geometry))

    def loss(self, batch, mb, logp, entropy=None, terms=None):
        """micro_batch_loss with this step's terms (`LossTerm.for_step` already applied where given)."""
        settings = LossSettings.of(self.cfg, self.geometry)
        return micro_batch_loss(batch, mb, logp, settings, self.terms if terms is None else terms, entropy)


def toy_run(accelerator_factory, overrides=(), policy=None, optimizer=None, models=TermModels(), comm=ONE_RANK):
    """The update's inputs for `overrides` on one process: `policy` (ToyPolicy) trained by `optimizer(params)`
    (SGD, lr 1), under a constant schedule; the terms the config asks for, scoring with `models`."""
    cfg = load_config(None, ["train.prompts_per_step=2", "rollout.num_generations=2", "train.micro_batch_size=2",
                             "train.max_grad_norm=null", *overrides])
    geometry = batch_geometry(cfg, 1)
    accelerator = accelerator_factory(geometry.accumulation_steps)
    policy = ToyPolicy() if policy is None else policy
    optimizer = (optimizer or (lambda params: torch.optim.SGD(params, lr=1.0)))(policy.parameters())
    policy, optimizer = accelerator.prepare(policy, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    learner = Learner(accelerator, policy, optimizer, scheduler, HeapTrimmer(enabled=False))
    return ToyUpdate(cfg, geometry, learner, build_terms(cfg, models), comm)


def test_update_over_micro_batches_takes_the_batch_gradient_step(accelerator_factory):
    """GRPO at ratio 1: L = -(1/N) sum_i A_i mean_t log pi(o_it). Two micro-batches accumulated must take exactly
    one SGD step along that gradient, and report L's value, -(1/N) sum_i A_i = -0.25 here."""
    toy = toy_run(accelerator_factory)
    samples, advantages = four_completions([1.0, -0.5, 0.5, 0.0], truncated=(False,) * 4)
    batch = build_train_batch(samples, advantages, PAD, micro_batch_size=2, mask_truncated=False,
                              skip_zero_advantage=False)
    w0 = toy.policy.w.detach().clone()
    w = w0.clone().requires_grad_(True)
    logp_all = w.log_softmax(-1)
    expected_loss = -sum(a * logp_all[c].mean() for a, c in zip(advantages.tolist(), samples.completion_ids)) / 4
    expected_loss.backward()

    stats, after = toy.update(batch, TrainState(step=1))
    assert float(stats.sums["loss"]) == pytest.approx(-0.25, abs=1e-6)
    assert torch.allclose(toy.policy.w.detach(), w0 - w.grad, atol=1e-6)
    assert stats.nonfinite_skipped == 0 and float(stats.sums["trained_tokens"]) == 3 + 1 + 2 + 4
    assert after == TrainState(step=1)  # nothing else changed


def test_a_nonfinite_update_is_skipped_and_reported_with_the_whole_steps_loss(accelerator_factory, caplog):
    """The first micro-batch overflows, the last is harmless: the warning gives the loss of the optimizer step
    (-inf), not the last micro-batch's share (it once said 0.0), and the weights do not move."""
    toy = toy_run(accelerator_factory)
    samples, advantages = four_completions([3e38, 3e38, 0.5, -0.5], truncated=(False,) * 4)
    batch = build_train_batch(samples, advantages, PAD, micro_batch_size=2, mask_truncated=False,
                              skip_zero_advantage=False)
    w0 = toy.policy.w.detach().clone()
    with caplog.at_level(logging.WARNING, logger="grpo_trainer"):
        stats, after = toy.update(batch, TrainState(step=7, nonfinite_in_a_row=1))
    assert stats.nonfinite_skipped == 1 and after.nonfinite_in_a_row == 2  # counted on from the state given
    assert "step 7: non-finite loss or gradient (loss -inf" in caplog.text
    assert torch.equal(toy.policy.w.detach(), w0)


def test_step_stats_reduce_over_ranks_sums_and_takes_the_max_gap():
    def rank_stats(rank, comm):
        stats = StepStats.zeros("cpu", trained_completions=4)
        stats.sums["loss"] += 0.5 + rank
        stats.sums["clip_low"] += 2.0 * rank
        stats.sums["trained_tokens"] += 10.0
        stats.sums["entropy"] += 5.0 * (rank + 1)
        stats.sums["logp_gap"] += 1.0
        stats.logp_gap_max += 0.25 if rank == 0 else 0.75
        return stats.reduced(comm)

    for reduced in run_ranks(2, rank_stats):
        metrics = reduced.metrics(total_tokens=40.0, total_rows=8, sampler_logprobs=True)
        assert metrics["loss"] == 2.0
        assert metrics["clip_ratio/low_mean"] == 2.0 / 40
        assert metrics["entropy"] == 15.0 / 20  # over the tokens trained on, on both ranks
        assert metrics["completions/trained_fraction"] == 1.0
        assert metrics["sampling/logp_diff_mean"] == 2.0 / 20 and metrics["sampling/logp_diff_max"] == 0.75
        assert "kl" not in metrics


class RecordingEngine(EngineWrapper, Sleeps):
    """Wraps an engine (its capabilities seen through, as every wrapper's) and records which of the lifecycle calls
    the loop made, in order; it can sleep, so the loop puts it to sleep."""

    def __init__(self, inner, calls: list):
        super().__init__(inner)
        self.calls = calls

    def generate(self, *args, **kwargs):
        self.calls.append("generate")
        return self.inner.generate(*args, **kwargs)

    def sync_weights(self, model, version=None, gather=None):
        self.calls.append("sync_weights")

    def sleep(self):
        self.calls.append("sleep")

    def wake_up(self):
        self.calls.append("wake_up")

    def close(self):
        self.calls.append("close")


@pytest.mark.parametrize("needs_weight_sync", [False, True])
def test_sync_weights_only_for_engines_that_keep_their_own_copy(needs_weight_sync):
    calls, barriers = [], []
    lm = nn.Linear(2, 2)
    engine = RecordingEngine(None if needs_weight_sync else SamplesTrainingModel(), calls)  # the hf engine's kind
    comm = SimpleNamespace(max=lambda t: barriers.append(1) or t)  # the ranks agree the push went through
    push_weights(engine, comm, lambda: lm, version=1)
    assert calls == (["sync_weights"] if needs_weight_sync else [])
    assert len(barriers) == int(needs_weight_sync)


def test_the_loop_puts_the_engine_to_sleep_after_sampling_and_closes_it(tmp_path, tiny_model_path, monkeypatch,
                                                                       accelerator_factory):
    """train() in this process, 2 steps, the real hf engine wrapped: sampled, slept through each update, closed
    once; never asked for a weight push (it samples from the training model)."""
    import grpo_trainer.run as building
    from grpo_trainer import train
    from grpo_trainer.metrics import read_metrics

    calls: list[str] = []
    real_build = building.build_engine
    monkeypatch.setattr(building, "build_engine", lambda *a, **k: RecordingEngine(real_build(*a, **k), calls))
    result = train(load_config("configs/demo_cpu.yaml", small_run_overrides(tmp_path / "run")))
    assert calls == ["generate", "sleep", "generate", "sleep", "close"]
    assert result.steps_done == 2 and len(read_metrics(tmp_path / "run")) == 2
