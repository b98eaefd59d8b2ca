"""An agent's episode that branched (a re-rendered conversation, a second one) is trained on every branch: the
earlier branches are rows after the step's completions (`TrainingSamples.branch_of`), each with its completion's
advantage, in its completion's group and mini-batch; sequence-level normalisers count them (TrainBatch.mini_batch_rows);
with train.micro_batch_size the number of backward calls stays what the geometry says (docs/agents.md)."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from helpers import training_samples

from grpo_trainer.batches import build_train_batch
from grpo_trainer.collect import training_samples as collected
from grpo_trainer.rollout import Branch, Rollout

PAD, G = 0, 2


def branched(completions: int = 8, branch_of=(1, 1, 4, 7)):
    """`completions` rows of 4 prompts x G (lengths vary), then one branch row per `branch_of` entry."""
    prompts = [[5 + j // G, 6] for j in range(completions)]
    comps = [[10 + j] * (2 + j % 3) for j in range(completions)]
    base = training_samples(prompts, comps)
    extra_prompts = [[40 + k, 41, 42] for k in range(len(branch_of))]  # a branch begins elsewhere
    extra = [[60 + k] * (1 + k) for k in range(len(branch_of))]
    return replace(
        base,
        prompt_indices=list(range(completions // G)),
        prompt_ids=base.prompt_ids + extra_prompts,
        completion_ids=base.completion_ids + extra,
        loss_mask=base.loss_mask + [[1] * len(c) for c in extra],
        truncated=base.truncated + [False] * len(extra),
        branch_of=list(branch_of),
    )


def test_branch_rows_take_their_completions_advantage_group_and_mini_batch():
    samples = branched()
    assert samples.completions == 8 and samples.row_completions == [*range(8), 1, 1, 4, 7]
    advantages = samples.per_row(torch.arange(8, dtype=torch.float32))
    assert advantages.tolist() == [*range(8), 1, 1, 4, 7]
    batch = build_train_batch(samples, advantages, PAD, micro_batch_size=2, mask_truncated=False,
                              skip_zero_advantage=False, group_size=G, mini_batches=2)
    # 2 mini-batches (prompts 0, 2 | 1, 3), each 2 micro-batches as for 4 completions: the geometry's backward calls
    assert batch.window_sizes == [2, 2]
    rows = {k: sorted(j for mb in batch.micro_batches if mb.mini_batch == k for j in mb.rows) for k in (0, 1)}
    assert rows == {0: [0, 1, 4, 5, 8, 9, 10], 1: [2, 3, 6, 7, 11]}  # branches of 1 and 4 with prompts 0, 2
    assert batch.mini_batch_rows == [7, 5] and batch.trained_completions == 12
    for mb in batch.micro_batches:
        assert mb.advantages.tolist() == [float(samples.row_completions[j]) for j in mb.rows]
    assert batch.lengths.tolist() == [float(len(c)) for c in samples.completion_ids]


def test_every_row_is_trained_once_under_a_token_budget_and_each_micro_batch_fits():
    samples = branched()
    advantages = samples.per_row(torch.ones(8))
    for packing in (False, True):
        batch = build_train_batch(samples, advantages, PAD, micro_batch_tokens=24, packing=packing,
                                  mask_truncated=False, skip_zero_advantage=False, group_size=G)
        trained = sorted(j for mb in batch.micro_batches for j in mb.rows)
        assert trained == list(range(12))
        assert batch.mini_batch_rows == [12]


def test_the_sequence_normaliser_counts_branch_rows():
    """grpo's loss is the mean over rows of each row's token mean: a branch row weighs as one more sample."""
    from grpo_trainer.losses import aggregate

    samples = branched(branch_of=(0,))
    batch = build_train_batch(samples, samples.per_row(torch.ones(8)), PAD, micro_batch_size=8, mask_truncated=False,
                              skip_zero_advantage=False, group_size=G)
    assert batch.mini_batch_rows == [9] and len(batch.micro_batches) == 1
    mb = batch.micro_batches[0]
    per_token = torch.ones_like(mb.mask)  # each row's token mean is 1: the loss is rows / total_sequences
    share = aggregate(per_token, mb.mask, "grpo", total_sequences=batch.mini_batch_rows[0],
                      total_tokens=batch.mini_batch_totals[0], max_completion_length=16, total_micro_batches=1)
    assert share.item() == pytest.approx(1.0)


def test_collect_turns_a_rollouts_branches_into_rows_after_the_completions():
    first = Branch(prompt_ids=[7, 8], completion_ids=[3, 4, 5], completion_mask=[1, 0, 1], logprobs=[-0.5, 0.0, -0.25])
    rollout = Rollout(
        completion_ids=[[1, 2], [3]], truncated=[False, True], sampling_logprobs=[[-1.0, -2.0], [-3.0]],
        completion_mask=[[1, 1], [1]], prompt_ids=[[9], [9]], weight_versions=[4, 4], branches=[[], [first]],
    )
    samples = collected(None, [0], rollout, torch.tensor([1.0, 0.0]), torch.zeros(2, 1))
    assert samples.completions == 2 and samples.branch_of == [1]
    assert samples.prompt_ids == [[9], [9], [7, 8]] and samples.completion_ids[2] == [3, 4, 5]
    assert samples.loss_mask[2] == [1, 0, 1] and samples.sampler_logprobs[2] == [-0.5, 0.0, -0.25]
    assert samples.weight_versions == [4, 4, 4] and samples.truncated == [False, True, False]
    assert samples.prompt_rows == [0, 0]  # the completions' prompts only
    # Rollout.select / concat (dynamic sampling) carry the branches with their completions
    assert rollout.select([1]).branches == [[first]]
    assert Rollout.concat([rollout.select([1]), rollout.select([0])]).branches == [[first], []]
    assert math.isclose(float(samples.per_row(torch.tensor([0.5, -0.5]))[2]), -0.5)
