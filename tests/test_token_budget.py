"""Token-budget micro-batches (`train.micro_batch_tokens`), idle mini-batches and the one batch geometry: CPU only,
no model (ToyPolicy from test_phases where a policy is needed)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo_trainer import distributed
from grpo_trainer.batches import budget_micro_batches, build_train_batch
from grpo_trainer.config import load_config
from grpo_trainer.errors import ConfigError
from grpo_trainer.geometry import batch_geometry, geometry_of
from grpo_trainer.preflight import preflight
from grpo_trainer.train_state import TrainState
from helpers import run_ranks, samples_share, training_samples
from test_phases import PAD, accelerator_factory, four_completions, toy_run  # noqa: F401 (a fixture)

G = 4


def rank_samples(rank: int):
    """Rank 0: two groups of short completions; rank 1: one short group and a long-tailed one (two 40-token
    completions among 2-token ones). Prompts of 5 and 3 tokens."""
    lengths = [[3, 2, 4, 1, 2, 2, 3, 1], [2, 3, 1, 2, 40, 2, 40, 2]][rank]
    completions = [[10 + (j % 7)] * n for j, n in enumerate(lengths)]
    prompts = [[1, 2, 3, 4, 5] if j < G else [6, 7, 8] for j in range(len(lengths))]
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5] * 2)
    return training_samples(prompts, completions), advantages


def computed_tokens(mb) -> int:
    """What the model really computes for a micro-batch: packed rows, or padded prompts + padded completions."""
    seq = mb.sequences
    if "input_ids" in seq:
        return seq["input_ids"].numel()
    return seq["prompt_ids"].numel() + seq["completion_ids"].numel()


@pytest.mark.parametrize("packing", [True, False], ids=["packed", "padded"])
def test_micro_batches_stay_within_the_budget_and_every_rank_makes_as_many(packing):
    budget = 48

    def rank(r, comm):
        samples, advantages = rank_samples(r)
        return build_train_batch(samples, advantages, PAD, micro_batch_tokens=budget, packing=packing,
                                 mask_truncated=False, skip_zero_advantage=False, group_size=G, comm=comm)

    batches = run_ranks(2, rank)
    assert batches[0].window_sizes == batches[1].window_sizes == [len(batches[1].micro_batches)]
    assert len(batches[1].micro_batches) == 3  # the long-tailed rank needs three passes...
    for batch in batches:
        assert all(computed_tokens(mb) <= budget for mb in batch.micro_batches)
        trained = sorted(j for mb in batch.micro_batches for j in mb.rows)
        assert trained == list(range(8))  # every completion exactly once
        fillers = [mb for mb in batch.micro_batches if not mb.rows]
        assert all(float(mb.mask.sum()) == 0 for mb in fillers)
    # ...and the short rank, which needs fewer, makes up the count with fillers
    assert any(not mb.rows for mb in batches[0].micro_batches)


def test_a_group_over_the_budget_is_cut_and_its_prompt_runs_in_each_part():
    samples, advantages = rank_samples(1)
    group = samples_share(samples, list(range(G, 8)))
    batch = build_train_batch(group, advantages[G:], PAD, micro_batch_tokens=44,
                              packing=True, mask_truncated=False, skip_zero_advantage=False, group_size=G)
    # The group: prompt 3 + fed tokens 39 + 1 + 39 + 1 = 83 > 44, so it is cut in two parts that fit, [40, 2] and
    # [40, 2] (3 + 39 + 1 = 43 each), each with the prompt.
    assert len(batch.micro_batches) == 2
    for mb in batch.micro_batches:
        assert mb.sequences["input_ids"][0, :3].tolist() == [6, 7, 8]
    assert sorted(j for mb in batch.micro_batches for j in mb.rows) == [0, 1, 2, 3]


def test_a_completion_too_long_for_the_budget_names_the_key():
    samples, advantages = rank_samples(1)
    with pytest.raises(ConfigError, match=r"train.micro_batch_tokens \(30\) cannot hold one completion with its prompt"):
        build_train_batch(samples, advantages, PAD, micro_batch_tokens=30, packing=True, mask_truncated=False,
                          skip_zero_advantage=False, group_size=G)


def test_pieces_are_spread_over_the_micro_batches_by_tokens():
    """Pieces of 10, 9, 8, 2, 2 and 1 tokens over 3 micro-batches of at most 20: largest first into the lightest
    it fits gives loads 11, 11, 10 (not 20, 11, 0 as filling in order would)."""
    sizes = [10, 9, 8, 2, 2, 1]

    def cost(rows):
        return sum(sizes[j] for j in rows)

    bins = budget_micro_batches([[j] for j in range(6)], 3, cost, 20)
    assert sorted(cost(b) for b in bins) == [10, 11, 11]
    assert budget_micro_batches([[0], [1]], 3, cost, 20)[2] == []  # more micro-batches than pieces: one for a filler


def test_skipped_completions_leave_an_idle_mini_batch_with_one_filler_under_a_budget():
    samples, _ = rank_samples(0)
    advantages = torch.tensor([0.0] * 4 + [1.0, -1.0, 0.0, 0.0])  # mini-batch 0 (prompt 0) has nothing to train
    batch = build_train_batch(samples, advantages, PAD, micro_batch_tokens=48, packing=True, mask_truncated=False,
                              skip_zero_advantage=True, group_size=G, mini_batches=2)
    assert batch.idle == [True, False] and batch.window_sizes == [1, 1]
    filler, trained = batch.micro_batches
    assert filler.rows == [] and float(filler.mask.sum()) == 0
    assert trained.rows == [4, 5] and trained.mini_batch == 1


# ----------------------------------------------------------------------------- idle mini-batches in the update


class CountingPolicy(torch.nn.Module):
    """test_phases.ToyPolicy, counting its forward calls."""

    def __init__(self, inner):
        super().__init__()
        self.inner, self.calls = inner, 0

    def forward(self, **kwargs):
        self.calls += 1
        return self.inner(**kwargs)


def idle_step_run(accelerator_factory, monkeypatch, shortcut: bool):
    """Two updates with AdamW: one that trains (so Adam has momentum), then one where every advantage is 0.
    Returns the weights after each, and per update: the batch's idle flags, the policy's forward calls, the stats."""
    from test_phases import ToyPolicy

    monkeypatch.setattr(distributed, "steps_without_backward", lambda accelerator: shortcut)
    counting = CountingPolicy(ToyPolicy())
    run = toy_run(accelerator_factory, ["train.skip_zero_advantage=true"], policy=counting,
                  optimizer=lambda params: torch.optim.AdamW(params, lr=0.1, weight_decay=0.1))
    weights, records = [], []
    for advantages in ([1.0, -0.5, 0.5, -1.0], [0.0] * 4):
        samples, adv = four_completions(advantages, truncated=(False,) * 4)
        batch = build_train_batch(samples, adv, PAD, micro_batch_size=2, mask_truncated=False,
                                  skip_zero_advantage=True, group_size=2)
        calls = counting.calls
        stats, _ = run.update(batch, TrainState(step=len(records) + 1))
        records.append((batch.idle, counting.calls - calls, stats))
        weights.append(counting.inner.w.detach().clone())
    return weights, records


def test_a_mini_batch_no_rank_trains_in_steps_without_passes_and_moves_the_weights_as_the_fillers_did(
        accelerator_factory, monkeypatch):
    """Every advantage 0: the fillers' passes gave exactly zero gradients, so a step on explicit zeros is the same
    step (Adam's momentum and weight decay still move the weights), with no forward or backward at all."""
    from accelerate.state import AcceleratorState, GradientState

    weights, (first, idle) = idle_step_run(accelerator_factory, monkeypatch, shortcut=True)
    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    filler_weights, (_, with_fillers) = idle_step_run(accelerator_factory, monkeypatch, shortcut=False)
    assert first[0] == [False] and first[1] == 2
    assert idle[0] == [True] and idle[1] == 0 and with_fillers[1] == 2  # no passes instead of two fillers' passes
    assert torch.equal(weights[1], filler_weights[1])  # the same step, bit for bit...
    assert not torch.equal(weights[1], weights[0])  # ...and a real one: momentum and weight decay moved the weights
    for name in ("loss", "entropy", "trained_tokens", "clip_region"):
        assert float(idle[2].sums[name].detach()) == float(with_fillers[2].sums[name].detach()) == 0.0
    assert idle[2].grad_norm == with_fillers[2].grad_norm == 0.0


# ----------------------------------------------------------------------------- one geometry


def test_token_budget_replaces_the_micro_batch_size_checks_and_must_hold_a_completion():
    cfg = load_config(None, ["train.micro_batch_tokens=4096", "train.micro_batch_size=5"])  # 5 no longer has to divide
    geometry = geometry_of(cfg)
    assert geometry.micro_batch_size is None and geometry.accumulation_steps is None
    with pytest.raises(ConfigError, match=r"train.micro_batch_tokens \(200\) must be larger than rollout.max_completion_length"):
        load_config(None, ["train.micro_batch_tokens=200", "rollout.max_completion_length=256"])
    geometry.check_room(3840, 256)
    with pytest.raises(ConfigError, match=r"cannot hold the longest prompt \(3841 tokens\).*at least 4097"):
        geometry.check_room(3841, 256)


def test_the_geometry_counts_for_the_launched_world():
    cfg = load_config(None, ["train.prompts_per_step=8", "rollout.num_generations=4", "train.micro_batch_size=4",
                             "train.mini_batches=2", "train.num_iterations=3", "train.max_steps=10"])
    two = batch_geometry(cfg, 2, rank=1)
    assert (two.prompts_per_rank, two.completions_per_rank, two.completions_per_mini_batch) == (4, 16, 8)
    assert two.accumulation_steps == 2 and two.optimizer_steps == 10 * 3 * 2
    assert two.my_prompts(list(range(8))) == [4, 5, 6, 7]
    with pytest.raises(ConfigError, match=r"train.micro_batch_size \(4\) must divide the completions of one mini-batch"):
        batch_geometry(load_config(None, ["train.prompts_per_step=8", "rollout.num_generations=2",
                                          "train.micro_batch_size=4", "train.mini_batches=4"]), 2)


def test_preflight_counts_warmup_against_the_optimizer_steps_the_schedule_takes():
    """2 steps x 2 mini-batches = 4 optimizer steps: a warmup of 3 ends inside the run (it was once counted
    against 2 steps and warned)."""
    quiet = load_config(None, ["train.max_steps=2", "train.mini_batches=2", "train.warmup_steps=3"])
    assert not [w for w in preflight(quiet) if "warmup" in w]
    loud = load_config(None, ["train.max_steps=2", "train.mini_batches=2", "train.warmup_steps=4"])
    assert any("is not below the run's 4 optimizer steps" in w for w in preflight(loud))


def test_token_budget_micro_batches_are_passes_deepspeed_counts_one_at_a_time():
    cfg = load_config(None, ["train.micro_batch_tokens=4096"])
    plugin = SimpleNamespace(deepspeed_config={})
    accelerator = SimpleNamespace(state=SimpleNamespace(deepspeed_plugin=plugin), gradient_accumulation_steps=1,
                                  num_processes=2)
    distributed.fill_deepspeed_config(accelerator, cfg)
    assert plugin.deepspeed_config["train_micro_batch_size_per_gpu"] == 1
    assert plugin.deepspeed_config["train_batch_size"] == 2
