"""The loss's entropy term, L - c * H: its value and gradient, its normaliser over micro-batches and ranks, its
token set under top_entropy_quantile, the adaptive coefficient (Skywork-OR1), and the config around it.

Numbers are worked out by hand in the comments, or by plain `math` on the toy policy's closed form
(for softmax probabilities p over logits w: H = -sum_j p_j log p_j and dH/dw_j = -p_j (log p_j + H)).
"""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch
from torch import nn

from grpo_trainer.batches import MicroBatch, TrainBatch, build_train_batch
from grpo_trainer.config import load_config
from grpo_trainer.errors import ConfigError
from grpo_trainer.losses import EntropyControl, entropy_share
from grpo_trainer.geometry import batch_geometry
from grpo_trainer.train_state import TrainState
from grpo_trainer.trainer import skips_zero_advantage
from grpo_trainer.terms import TermModels, build_terms
from grpo_trainer.update import LossSettings, micro_batch_loss
from helpers import run_ranks
from test_phases import ONE_RANK, PAD, accelerator_factory, four_completions  # noqa: F401 (a fixture)
from test_phases import toy_run as phases_toy_run

VOCAB = 10


# ----------------------------------------------------------------------------- the pure pieces


def test_entropy_share_is_the_token_mean_over_the_whole_mini_batch():
    # Entropies of 5 real tokens, split over two micro-batches (and, below, two ranks): H = (0.2 + 0.4 + 1.0 + 0.6
    # + 0.3) / 5 = 0.5. Each micro-batch's share divides by the 5 tokens of the whole mini-batch, not its own.
    first = (torch.tensor([[0.2, 0.4, 9.0]]), torch.tensor([[1.0, 1.0, 0.0]]))  # padding holds junk
    second = (torch.tensor([[1.0, 0.6], [0.3, 7.0]]), torch.tensor([[1.0, 1.0], [1.0, 0.0]]))
    shares = [entropy_share(e, m, total_tokens=5) for e, m in (first, second)]
    assert [s.item() for s in shares] == pytest.approx([0.6 / 5, 1.9 / 5])
    assert sum(shares).item() == pytest.approx(0.5)


def test_the_adaptive_coefficient_follows_skywork_or1s_rule():
    # target 1.0, delta 0.005, bounds [0, 0.02], starting at 0.01 and active (the paper's code starts enabled):
    #   e = 0.8 < 1: 0.01 + 0.005 = 0.015, active     e = 0.9 < 1: 0.02, active
    #   e = 0.5 < 1: 0.025 capped at 0.02, active      e = 1.2 >= 1: 0.015, inactive (applies 0)
    #   e = 1.0 (not below): 0.01, inactive            e = NaN (nothing measured): unchanged
    #   e = 0.1: 0.015, active again
    control, seen = EntropyControl(0.01), []
    for e in (0.8, 0.9, 0.5, 1.2, 1.0, math.nan, 0.1):
        control = control.after_step(e, target=1.0, delta=0.005, low=0.0, high=0.02)
        seen.append((round(control.coef, 10), control.active, round(control.applied, 10)))
    assert seen == [(0.015, True, 0.015), (0.02, True, 0.02), (0.02, True, 0.02), (0.015, False, 0.0),
                    (0.01, False, 0.0), (0.01, False, 0.0), (0.015, True, 0.015)]
    # The lower bound holds too: 0.003 - 0.005 -> 0.
    assert EntropyControl(0.003).after_step(2.0, target=1.0, delta=0.005, low=0.0, high=1.0).coef == 0.0


# ----------------------------------------------------------------------------- through the update


class ToyPolicy(nn.Module):
    """log pi(token) = log_softmax(w)[token] whatever the prompt, and the entropy of that distribution at every
    position: a policy with TokenLogprobs' interface (entropy_grad included) whose gradients are easy to write."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.linspace(-1, 1, VOCAB))

    def forward(self, prompt_ids, prompt_mask, prompt_index, completion_ids, completion_mask, with_entropy=False,
                entropy_grad=False):
        logp_all = self.w.log_softmax(-1)
        if not with_entropy:
            return logp_all[completion_ids], None
        with torch.set_grad_enabled(entropy_grad and torch.is_grad_enabled()):
            entropy = -(logp_all.exp() * logp_all).sum()
        return logp_all[completion_ids], entropy.expand(completion_ids.shape)


def toy_entropy_and_gradient(w: list[float]) -> tuple[float, list[float]]:
    """H and dH/dw of softmax(w), by the closed form, in plain floats."""
    z = sum(math.exp(x) for x in w)
    p = [math.exp(x) / z for x in w]
    h = -sum(q * math.log(q) for q in p)
    return h, [-q * (math.log(q) + h) for q in p]


def toy_run(accelerator_factory, overrides=()):
    """test_phases' toy update (SGD, lr 1, no gradient clipping) with the policy above, which can differentiate H."""
    return phases_toy_run(accelerator_factory, overrides, policy=ToyPolicy())


def state_at(run, step: int) -> TrainState:
    """A fresh run's state in step `step` (the coefficient where loss.entropy_coef starts it)."""
    return replace(TrainState.fresh(run.cfg.loss.entropy_coef), step=step)


def toy_batch(advantages):
    """test_phases' two prompts x G = 2, with 3, 1, 2 and 4 completion tokens (10 in all), in two micro-batches."""
    samples, advantages = four_completions(advantages, truncated=(False,) * 4)
    batch = build_train_batch(samples, advantages, PAD, micro_batch_size=2, mask_truncated=False,
                              skip_zero_advantage=False)  # one rank: build_train_batch counts the tokens itself
    return batch


def test_the_entropy_term_takes_a_step_up_the_entropy_gradient(accelerator_factory):
    """Advantages all 0, so only -c H moves the weights: one SGD step (lr 1) is w + c dH/dw, whatever the
    micro-batching (H is a token mean over all 10 tokens, and every token sees the same distribution here).
    The logged loss is -c H and the policy loss 0."""
    run = toy_run(accelerator_factory, ["loss.entropy_coef=0.5"])
    w0 = run.policy.w.detach().tolist()
    h, dh = toy_entropy_and_gradient(w0)
    stats, _ = run.update(toy_batch([0.0, 0.0, 0.0, 0.0]), state_at(run, 1))
    expected = [w + 0.5 * g for w, g in zip(w0, dh)]
    assert run.policy.w.detach().tolist() == pytest.approx(expected, abs=1e-6)
    logged = stats.metrics(10, 4, sampler_logprobs=False)
    assert logged["loss"] == pytest.approx(-0.5 * h, abs=1e-6)
    assert logged["policy_loss"] == pytest.approx(0.0, abs=1e-6)
    assert logged["entropy_coef"] == 0.5 and logged["entropy/term_mean"] == pytest.approx(h, abs=1e-6)


def test_without_an_entropy_term_nothing_is_logged_or_changed(accelerator_factory):
    run = toy_run(accelerator_factory)
    w0 = run.policy.w.detach().clone()
    stats, _ = run.update(toy_batch([0.0, 0.0, 0.0, 0.0]), state_at(run, 1))
    assert torch.equal(run.policy.w.detach(), w0)  # A = 0 and no term: no gradient at all
    logged = stats.metrics(10, 4, sampler_logprobs=False)
    assert not {"entropy_coef", "policy_loss", "entropy/term_mean"} & set(logged)


def test_the_term_acts_on_the_top_entropy_tokens_when_top_entropy_quantile_selects_them():
    # Entropies [0.2, 0.9, 0.5, 1.0] of 4 real tokens, the quantile keeps the 2nd and 4th: H over those = 0.95,
    # and the term is -c H = -0.1 x 0.95 = -0.095 (A = 0: no policy term). TRL averages over the same tokens.
    cfg = load_config(None, ["loss.entropy_coef=0.1", "train.prompts_per_step=1", "rollout.num_generations=2",
                             "train.micro_batch_size=2"])
    settings = LossSettings.of(cfg, batch_geometry(cfg, 1))
    mb = MicroBatch(sequences={}, mask=torch.tensor([[1.0, 1.0], [1.0, 1.0]]), advantages=torch.zeros(2),
                    entropy_mask=torch.tensor([[0.0, 1.0], [0.0, 1.0]]))
    batch = TrainBatch([mb], torch.tensor([2.0, 2.0]), 2, 4.0, mini_batch_totals=[4.0], mini_batch_rows=[2], window_sizes=[1])
    (term,) = build_terms(cfg, TermModels())
    term = term.for_step(batch, ONE_RANK, TrainState.fresh(0.1))
    assert term.tokens == (2.0,) and term.coef == 0.1
    entropy = torch.tensor([[0.2, 0.9], [0.5, 1.0]], requires_grad=True)
    share, parts = micro_batch_loss(batch, mb, torch.full((2, 2), -1.0, requires_grad=True), settings, (term,), entropy)
    assert share.item() == pytest.approx(-0.095) and parts["entropy_term"].item() == pytest.approx(0.095)
    (grad,) = torch.autograd.grad(share, entropy)  # -c / 2 on the two selected tokens, 0 elsewhere
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.05], [0.0, -0.05]]))


def test_the_entropy_term_does_not_depend_on_micro_batches_or_ranks():
    """Different entropies per token (a tensor, not the toy policy): micro_batch_loss shares on one rank with one
    micro-batch, with two, and on two ranks with one each, add up to the same -c H (H over all 10 tokens)."""
    cfg = load_config(None, ["loss.entropy_coef=0.3", "train.prompts_per_step=2", "rollout.num_generations=2",
                             "train.micro_batch_size=2"])
    entropies = torch.tensor([[0.1, 0.2, 0.3, 0], [0.4, 0, 0, 0], [0.5, 0.6, 0, 0], [0.7, 0.8, 0.9, 1.0]])
    lengths = [3, 1, 2, 4]
    mask = (torch.arange(4)[None, :] < torch.tensor(lengths)[:, None]).float()
    expected = -0.3 * float((entropies * mask).sum()) / 10  # H = 5.5 / 10

    def shares(comm, rows_per_micro_batch):
        settings = LossSettings.of(cfg, batch_geometry(cfg, 1))
        mbs = [MicroBatch(sequences={}, mask=mask[rows], advantages=torch.zeros(len(rows))) for rows in rows_per_micro_batch]
        batch = TrainBatch(mbs, torch.zeros(4), 4, 10.0, mini_batch_totals=[10.0], mini_batch_rows=[4], window_sizes=[len(mbs)])
        (term,) = build_terms(cfg, TermModels())
        term = term.for_step(batch, comm, TrainState.fresh(0.3))
        return sum(micro_batch_loss(batch, mb, torch.zeros(len(rows), 4), settings, (term,), entropies[rows])[0].item()
                   for mb, rows in zip(mbs, rows_per_micro_batch))

    assert shares(ONE_RANK, [[0, 1, 2, 3]]) == pytest.approx(expected)
    assert shares(ONE_RANK, [[0, 1], [2, 3]]) == pytest.approx(expected)
    two_ranks = run_ranks(2, lambda rank, comm: shares(comm, [[0, 1]] if rank == 0 else [[2, 3]]))
    assert sum(two_ranks) == pytest.approx(expected)


def test_the_adaptive_coefficient_moves_once_per_step_from_the_measured_entropy(accelerator_factory):
    """The toy's H (2.12 nats at the start) is below a target of 3: the coefficient starts at 0.1 and grows by
    delta = 0.05 after each step; each step applies the value from before it. A target of 1 (below H) instead
    shrinks it and switches the term off from step 2: with A = 0 the weights then stop moving."""
    run = toy_run(accelerator_factory, ["loss.entropy_coef=0.1", "loss.entropy_target=3.0", "loss.entropy_coef_delta=0.05"])
    h0, _ = toy_entropy_and_gradient(run.policy.w.detach().tolist())
    assert h0 == pytest.approx(2.1213, abs=1e-4)
    applied, state = [], state_at(run, 0)
    for step in (1, 2, 3):
        stats, state = run.update(toy_batch([0.0, 0.0, 0.0, 0.0]), replace(state, step=step))
        applied.append(stats.metrics(10, 4, sampler_logprobs=False)["entropy_coef"])
    assert applied == pytest.approx([0.1, 0.15, 0.2])
    assert state.entropy_control.coef == pytest.approx(0.25) and state.entropy_control.active

    run = toy_run(accelerator_factory, ["loss.entropy_coef=0.1", "loss.entropy_target=1.0", "loss.entropy_coef_delta=0.05"])
    _, state = run.update(toy_batch([0.0, 0.0, 0.0, 0.0]), state_at(run, 1))
    assert state.entropy_control == EntropyControl(0.05, active=False)
    w1 = run.policy.w.detach().clone()
    stats, _ = run.update(toy_batch([0.0, 0.0, 0.0, 0.0]), replace(state, step=2))
    assert stats.metrics(10, 4, sampler_logprobs=False)["entropy_coef"] == 0.0 and torch.equal(run.policy.w.detach(), w1)


def test_token_logprobs_gives_the_entropy_its_gradient_only_when_asked(tiny_model_path):
    """models.TokenLogprobs(entropy_grad=True) on the tiny model: the same entropies as the statistic (no-grad)
    path, in chunks and with the shared prompt, and their gradient equals autograd of the entropy computed
    directly from the full logits of each lone sequence."""
    from transformers import AutoModelForCausalLM

    from grpo_trainer.models import TokenLogprobs, make_sequence_batch

    lm = AutoModelForCausalLM.from_pretrained(tiny_model_path).float()
    prompts, completions = [[1, 40, 41], [1, 42]], [[50, 51, 52, 2], [53, 2]]
    batch = make_sequence_batch(prompts, completions, 0)
    scorer = TokenLogprobs(lm, chunk_size=3, share_prompt=True)
    _, statistic = scorer(**batch.tensors(), with_entropy=True)
    assert not statistic.requires_grad
    _, entropy = scorer(**batch.tensors(), with_entropy=True, entropy_grad=True)
    torch.testing.assert_close(entropy.detach(), statistic)
    mask = batch.completion_mask
    ours = torch.autograd.grad((entropy * mask).sum(), list(lm.parameters()), allow_unused=True)
    direct_total = 0
    for prompt, completion in zip(prompts, completions):
        ids = torch.tensor([prompt + completion])
        logp_all = lm(ids).logits[0, len(prompt) - 1 : -1].float().log_softmax(-1)  # the states predicting completion
        direct_total = direct_total - (logp_all.exp() * logp_all).sum()
    direct = torch.autograd.grad(direct_total, list(lm.parameters()), allow_unused=True)
    for a, b in zip(ours, direct):
        if b is not None:
            torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


# ----------------------------------------------------------------------------- config


def test_an_entropy_term_turns_zero_advantage_skipping_off():
    # Skipping is exact only when a completion with A = 0 has no gradient; the entropy term gives it one.
    assert skips_zero_advantage(load_config(None, []))
    assert not skips_zero_advantage(load_config(None, ["loss.entropy_coef=0.01"]))
    assert not skips_zero_advantage(load_config(None, ["loss.entropy_target=0.5"]))


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["loss.entropy_coef=-0.1"], "loss.entropy_coef: Input should be greater than or equal to 0"),
        (["loss.entropy_target=0.2", "loss.entropy_coef_min=0.5", "loss.entropy_coef_max=0.1"],
         "loss: entropy_coef_min (0.5) must not exceed entropy_coef_max (0.1)"),
    ],
)
def test_entropy_settings_are_checked_at_load_time(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)
