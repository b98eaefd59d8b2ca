"""Issue 15's training controls against hand-derived numbers: PPO mini-batches (`train.mini_batches`), the
RLOO / REINFORCE++ baselines and GDPO's per-reward normalisation (`loss.advantage`, `loss.reward_aggregation`),
rollout-correction modes (`loss.tis_mode`) and high-entropy token selection (`loss.top_entropy_quantile`).
Each control's default leaves the loop's numbers unchanged: tests/test_golden.py pins that."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from grpo_trainer.advantages import batch_advantages, group_advantages, normalize_then_sum
from grpo_trainer.batches import build_train_batch, mini_batch_rows
from grpo_trainer.config import load_config
from grpo_trainer.errors import ConfigError
from grpo_trainer.losses import entropy_threshold, importance_weight
from grpo_trainer.metrics import read_metrics
from grpo_trainer.train_state import TrainState
from grpo_trainer.update import add_logprobs, select_high_entropy_tokens, update
from loss_helpers import token_loss
from helpers import accelerate_launch, cpu_launch_file, free_port, launch_failure, run_cli, run_ranks, small_run_overrides
from test_phases import PAD, accelerator_factory, four_completions, toy_run  # noqa: F401 (a fixture)

NAN = float("nan")
ONE_RANK = SimpleNamespace(sum=lambda t: t, max=lambda t: t, gather=lambda t: t)  # one process's collectives


# ----------------------------------------------------------------------------- baselines


def test_rloo_subtracts_the_mean_of_the_other_rewards():
    # [1, 0, 0, 0]: A_0 = 1 - 0 = 1, A_j = 0 - 1/3. With a NaN (no opinion) the other *valid* rewards count:
    # [1, 0, NaN, 0.5]: A_0 = 1 - 0.25 = 0.75, A_1 = 0 - 0.75, A_3 = 0.5 - 0.5 = 0, A_2 = 0.
    advantages, stats = group_advantages(torch.tensor([1.0, 0, 0, 0, 1, 0, NAN, 0.5]), 4, "none", "rloo")
    torch.testing.assert_close(advantages, torch.tensor([1, -1 / 3, -1 / 3, -1 / 3, 0.75, -0.75, 0, 0]))
    assert stats["reward"] == pytest.approx(2.5 / 7)  # statistics of the rewards, whatever the baseline
    # With the group std: [1, 0, 0, 0] has std sqrt(1/4 * 3/4) = 0.43301, so A_0 = 1 / 0.43301 = 2.3094.
    scaled, _ = group_advantages(torch.tensor([1.0, 0, 0, 0]), 4, "group", "rloo")
    torch.testing.assert_close(scaled, torch.tensor([2.3094, -0.7698, -0.7698, -0.7698]), rtol=1e-3, atol=0)


def test_reinforce_pp_divides_the_group_centred_rewards_by_their_batch_std():
    # Centred: [.75, -.25, -.25, -.25] and [.5, .5, -.5, -.5]; their batch std is
    # sqrt((.5625 + 3 * .0625 + 4 * .25) / 8) = sqrt(0.21875) = 0.46771 (GRPO's `batch` would use the std of the
    # raw rewards, sqrt(3/8 * 5/8) = 0.48412, instead).
    rewards = torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0])
    advantages, _ = group_advantages(rewards, 4, "batch", "reinforce_pp")
    expected = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]) / 0.46771
    torch.testing.assert_close(advantages, expected, rtol=1e-3, atol=0)
    grpo_batch, _ = group_advantages(rewards, 4, "batch", "grpo")
    assert grpo_batch[0] == pytest.approx(0.75 / 0.48412, rel=1e-3)
    with pytest.raises(ValueError, match="batch"):
        group_advantages(rewards, 4, "group", "reinforce_pp")


def test_normalize_then_sum_keeps_reward_combinations_apart():
    """GDPO's example shape: two rewards, weights 1 and 2, a group of 2. Reward 1 = [2, 0], reward 2 = [0, 1]:
    both totals are 2, so the plain sum gives no signal; normalised first, reward 1 -> [1, -1] and
    reward 2 -> [-1, 1], so the sum is [1 - 2, -1 + 2] = [-1, 1] and the group std 1 leaves it there."""
    per_function = torch.tensor([[2.0, 0.0], [0.0, 1.0]])
    weights = torch.tensor([1.0, 2.0])
    torch.testing.assert_close(normalize_then_sum(per_function, weights, 2), torch.tensor([-1.0, 1.0]), rtol=1e-3, atol=0)
    totals = torch.tensor([2.0, 2.0])
    plain, _ = batch_advantages(totals, 2, estimator="grpo", scale="group")
    decoupled, stats = batch_advantages(totals, 2, estimator="grpo", scale="group", per_function=per_function, weights=weights)
    assert plain.tolist() == [0.0, 0.0]
    torch.testing.assert_close(decoupled, torch.tensor([-1.0, 1.0]), rtol=1e-3, atol=0)
    assert stats["reward"] == 2.0 and stats["frac_reward_zero_std"] == 1.0  # the logs describe the plain sum


def test_normalize_then_sum_leaves_out_what_a_reward_has_no_opinion_on():
    # Reward 2 has no opinion on sample 1: within the group it is constant on the rest ([5, 5]) and adds 0;
    # reward 1 = [1, 0, 1] over 3 samples: mean 2/3, std sqrt(2)/3 = 0.4714 -> [0.7071, -1.4142, 0.7071].
    # A sample no reward has an opinion on stays NaN (its advantage will be 0).
    per_function = torch.tensor([[1.0, 5.0], [0.0, NAN], [1.0, 5.0], [NAN, NAN]])
    total = normalize_then_sum(per_function, torch.tensor([1.0, 1.0]), 4)
    torch.testing.assert_close(total[:3], torch.tensor([0.7071, -1.4142, 0.7071]), rtol=1e-3, atol=0)
    assert math.isnan(total[3])


def test_config_asks_reinforce_pp_for_the_batch_scale_and_mini_batches_for_whole_groups():
    with pytest.raises(ConfigError, match="scale_rewards to batch"):
        load_config(None, ["loss.advantage=reinforce_pp"])
    load_config(None, ["loss.advantage=reinforce_pp", "loss.scale_rewards=batch"])
    with pytest.raises(ConfigError, match="mini_batches"):
        load_config(None, ["train.mini_batches=3"])  # 8 prompts do not split into 3 mini-batches of whole groups
    with pytest.raises(ConfigError, match="top_entropy_quantile"):
        load_config(None, ["loss.top_entropy_quantile=1.5"])


# ----------------------------------------------------------------------------- rollout correction


def correction_batch():
    """Two completions, old - sampler log-ratios giving token ratios [2, 0.5, 4] and [1.5, 1.2]; padding junk
    (ratio e^5 = 148) must never count."""
    old = torch.log(torch.tensor([[2.0, 0.5, 4.0], [1.5, 1.2, 1.0]]))
    old[1, 2] = 5.0
    sampling = torch.zeros(2, 3)
    mask = torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    return old, sampling, mask


@pytest.mark.parametrize(
    "mode, weights, capped",
    [
        # per token: 4 > 3 is capped to 3 or zeroed
        ("token_truncate", [[2, 0.5, 3], [1.5, 1.2]], 1),
        ("token_mask", [[2, 0.5, 0], [1.5, 1.2]], 1),
        # per sequence: 2 * 0.5 * 4 = 4 > 3 (all three tokens), 1.5 * 1.2 = 1.8 <= 3
        ("sequence_truncate", [[3, 3, 3], [1.8, 1.8]], 3),
        ("sequence_mask", [[0, 0, 0], [1.8, 1.8]], 3),
    ],
)
def test_rollout_correction_modes(mode, weights, capped):
    old, sampling, mask = correction_batch()
    weight, over = importance_weight(old, sampling, mask, cap=3.0, mode=mode)
    torch.testing.assert_close(weight[0], torch.tensor(weights[0], dtype=torch.float32))
    torch.testing.assert_close(weight[1, :2], torch.tensor(weights[1], dtype=torch.float32))
    assert int(over.sum()) == capped
    assert not weight.requires_grad


def test_masked_tokens_lose_their_policy_term_and_keep_their_kl():
    """A = 1, logp = old (ratio 1), ref = logp + ln 2: per token the policy term is -1 and k3 = 2 - ln 2 - 1 =
    0.3069; with weights [1, 0] (the second token masked) the losses are [-1 + 0.1 * 0.3069, 0.1 * 0.3069]."""
    logp = torch.tensor([[-1.0, -2.0]])
    loss, _ = token_loss(logp, logp, torch.tensor([1.0]), torch.ones(1, 2), "grpo", 0.2, 0.2,
                         ref_logp=logp + math.log(2), beta=0.1, policy_weight=torch.tensor([[1.0, 0.0]]))
    k3 = 2 - math.log(2) - 1
    torch.testing.assert_close(loss, torch.tensor([[-1 + 0.1 * k3, 0.1 * k3]]))


# ----------------------------------------------------------------------------- entropy selection


@pytest.mark.parametrize("rho, threshold, kept", [(0.2, 0.82, 2), (0.0, 1.0, 1), (1.0, 0.1, 10), (0.5, 0.55, 5)])
def test_entropy_threshold_is_the_one_minus_rho_quantile(rho, threshold, kept):
    # 10 entropies 0.1 .. 1.0; rho = 0.2: position 0.8 * 9 = 7.2 between 0.8 and 0.9 -> 0.82, keeps 0.9 and 1.0.
    entropies = torch.arange(1, 11, dtype=torch.float64) / 10
    assert entropy_threshold(entropies, rho) == pytest.approx(threshold)
    assert int((entropies >= entropy_threshold(entropies, rho)).sum()) == kept


def entropy_micro_batches(rows: list[int]):
    """Rows of a 4-completion batch: entropies per token, masks, advantages (row 2 has advantage 0, row 3 a
    masked tail). Ranked tokens: row 0 [.9, .1, .5], row 1 [.7], row 3 [.3, .8]."""
    entropy = torch.tensor([[0.9, 0.1, 0.5], [0.7, 0.0, 0.0], [0.95, 0.99, 0.0], [0.3, 0.8, 0.6]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0], [1, 1, 0], [1, 1, 0]])
    advantages = torch.tensor([1.0, -1.0, 0.0, 0.5])
    mbs = [SimpleNamespace(mask=mask[[j]], advantages=advantages[[j]], entropy_mask=None) for j in rows]
    return SimpleNamespace(micro_batches=mbs), [entropy[[j]] for j in rows]


def test_top_entropy_tokens_are_chosen_over_the_whole_batch_on_any_number_of_ranks():
    """6 ranked tokens [.1 .3 .5 .7 .8 .9], rho = 0.5: position 0.5 * 5 = 2.5 -> threshold 0.6; kept .7 .8 .9
    (3 of 6 masked). Zero-advantage row 2's high entropies (.95, .99) are not ranked: it has no policy gradient."""
    batch, entropies = entropy_micro_batches([0, 1, 2, 3])
    metrics = select_high_entropy_tokens(ONE_RANK, batch, entropies, 0.5)
    assert metrics == {"entropy/threshold": pytest.approx(0.6), "entropy/masked_fraction": 0.5}
    assert [mb.entropy_mask.tolist() for mb in batch.micro_batches] == [
        [[1, 0, 0]], [[1, 0, 0]], [[1, 1, 0]], [[0, 1, 1]]]  # masks off real tokens do not matter

    def rank(r, comm):
        part, ents = entropy_micro_batches([[0, 1], [2, 3]][r])
        return select_high_entropy_tokens(comm, part, ents, 0.5), [mb.entropy_mask.tolist() for mb in part.micro_batches]

    (m0, masks0), (m1, masks1) = run_ranks(2, rank)
    assert m0 == m1 == metrics and masks0 + masks1 == [mb.entropy_mask.tolist() for mb in batch.micro_batches]


# ----------------------------------------------------------------------------- mini-batches


def test_mini_batches_hold_whole_groups_and_the_same_completions_on_any_number_of_ranks():
    # 4 prompts x G = 2, M = 2: prompt p goes to mini-batch p mod 2.
    assert mini_batch_rows([j // 2 for j in range(8)], 2) == [[0, 1, 4, 5], [2, 3, 6, 7]]
    # Two ranks with 2 prompts each: rank 1's rows are global rows 4..7.
    rank0, rank1 = mini_batch_rows([0, 0, 1, 1], 2), mini_batch_rows([0, 0, 1, 1], 2)
    assert [rank0[k] + [4 + j for j in rank1[k]] for k in range(2)] == [[0, 1, 4, 5], [2, 3, 6, 7]]
    assert mini_batch_rows([j // 2 for j in range(8)], 1) == [list(range(8))]


def mini_batch_run(accelerator_factory, micro: int, overrides=()):
    run = toy_run(accelerator_factory, ["train.mini_batches=2", f"train.micro_batch_size={micro}",
                                        "loss.epsilon_low=0.01", *overrides], comm=ONE_RANK)
    samples, advantages = four_completions([1.0, -0.5, -0.5, 1.0], truncated=(False,) * 4)
    batch = build_train_batch(samples, advantages, PAD, micro_batch_size=micro, mask_truncated=False,
                              skip_zero_advantage=False, group_size=2, mini_batches=2)
    run.add_logprobs(batch)
    return run, batch, samples, advantages


def test_mini_batches_take_one_step_each_against_the_sampling_time_policy(accelerator_factory):
    """Two prompts, M = 2: mini-batch 0 = prompt 0's group, mini-batch 1 = prompt 1's. SGD, lr 1, GRPO, clip
    range [0.99, 1.01]. Step 1 at w0 (ratio 1): the gradient of L_0 = -(1/2) sum_i A_i mean_t log pi(o_it). Step 2 at w1 against
    pi_w0 (the old policy of the whole batch): L_1 = -(1/2) sum_i mean_t min(r A_i, clip(r) A_i), r = pi_w/pi_w0,
    so clipping acts in the second mini-batch only."""
    run, batch, samples, advantages = mini_batch_run(accelerator_factory, micro=2)
    assert [mb.mini_batch for mb in batch.micro_batches] == [0, 1] and batch.mini_batch_totals == [4.0, 6.0]
    w = run.policy.w.detach().clone().requires_grad_(True)
    old = w.detach().log_softmax(-1)
    step0 = -sum(a * w.log_softmax(-1)[c].mean() for a, c in zip(advantages[:2].tolist(), samples.completion_ids[:2])) / 2
    (g0,) = torch.autograd.grad(step0, w)
    w1 = (w.detach() - g0).requires_grad_(True)
    terms = []
    for a, c in zip(advantages[2:].tolist(), samples.completion_ids[2:]):
        r = torch.exp(w1.log_softmax(-1)[c] - old[c])
        terms.append(torch.min(r * a, r.clamp(0.99, 1.01) * a).mean())
    step1 = -sum(terms) / 2
    (g1,) = torch.autograd.grad(step1, w1)

    stats, _ = run.update(batch, TrainState(step=1))
    torch.testing.assert_close(run.policy.w.detach(), w1.detach() - g1, rtol=0, atol=1e-6)
    # The logged loss: the mean of the two steps' losses; step 1's at ratio 1 is -(1/2)(1 - 0.5) = -0.25.
    assert float(stats.sums["loss"]) == pytest.approx((-0.25 + float(step1.detach())) / 2, abs=1e-6)
    assert float(stats.sums["clip_region"]) > 0  # tokens of mini-batch 1 were clipped: its policy had moved


def test_mini_batch_updates_do_not_depend_on_micro_batches(accelerator_factory):
    one, batch, _, _ = mini_batch_run(accelerator_factory, micro=2)
    one.update(batch, TrainState(step=1))
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()
    two, batch2, _, _ = mini_batch_run(accelerator_factory, micro=1)  # 2 micro-batches per mini-batch
    assert len(batch2.micro_batches) == 4 and two.geometry.accumulation_steps == 2
    two.update(batch2, TrainState(step=1))
    torch.testing.assert_close(one.policy.w.detach(), two.policy.w.detach(), rtol=0, atol=1e-6)


@pytest.mark.slow
def test_mini_batches_and_entropy_selection_match_across_ranks(tmp_path, tiny_model_path):
    """One process (2 micro-batches per mini-batch) vs two DDP ranks (1 each), 2 mini-batches, rho = 0.5, RLOO:
    the same completions (seeded per prompt), so the same loss, gradient norm, clipping and entropy selection."""
    common = ["rollout.seed_per_prompt=true", "train.mini_batches=2", "loss.top_entropy_quantile=0.5",
              "loss.advantage=rloo", "train.micro_batch_size=4"]
    one, two = tmp_path / "one", tmp_path / "two"
    single = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(one, steps=1), *common])
    assert single.returncode == 0, single.stderr[-3000:]
    launcher = accelerate_launch(cpu_launch_file("ddp", tmp_path), "--main_process_port", str(free_port()))
    ddp = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(two, steps=1), *common],
                  launcher=launcher, env={"ACCELERATE_USE_CPU": "1"})
    assert ddp.returncode == 0, launch_failure(ddp)
    assert "grad_accum=2" in single.stderr and "world_size=2" in ddp.stderr and "grad_accum=1" in ddp.stderr
    a, b = read_metrics(one)[0], read_metrics(two)[0]
    assert a["reward"] == b["reward"] and 0 < a["entropy/masked_fraction"] < 1
    for key in ("loss", "grad_norm", "clip_ratio/region_mean", "entropy/masked_fraction", "entropy/threshold"):
        assert a[key] == pytest.approx(b[key], abs=1e-6, rel=1e-5), key
