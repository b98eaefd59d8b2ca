"""The loss family (grpo_trainer.losses) pinned to hand-derived numbers.

Three kinds of checks:
1. Values and clip counts of small batches worked out by hand (the arithmetic is
   in the comments; the ratios are chosen to be round numbers).
2. Gradients w.r.t. logp against autograd of `reference_batch_loss` below, an
   independent re-implementation written as loops over sequences and tokens with
   the PPO clip spelt out as its case analysis (Schulman et al. 2017, fig. 1).
3. Invariance: the batch loss and its gradients do not depend on how the batch is
   cut into micro-batches and ranks (except `bnpo`, by definition).

Hand batch: clip range [1 - 0.2, 1 + 0.28] = [0.8, 1.28] (DAPO's clip-higher, eps_low != eps_high),
3 completions of 4, 2 and 3 tokens, max_completion_length 8. Per real token, the ratio r and logp:

    seq 0, A = +1.0:  r = [0.5,  1.0, 1.25, 1.5]   logp = [-1.0, -0.5, -2.0, -1.5]
    seq 1, A = -0.5:  r = [0.75, 1.5]              logp = [-0.7, -1.2]
    seq 2, A = +2.0:  r = [0.9,  1.1, 2.0]         logp = [-0.3, -0.9, -1.1]

Padding holds junk (logp +3, old -5: a ratio of e^8) that must never leak in.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_trainer.losses import LOSS_TYPES, LOSS_VARIANTS, GammaShape, SoftGate, aggregate, kl_k3
from loss_helpers import token_loss

EPS_LOW, EPS_HIGH = 0.2, 0.28
GATE, GAMMA = SoftGate(), GammaShape()  # the defaults: tau 1.0 / 1.05; (k, lambda) = (2, 3) for A >= 0, (3, 2) below
MAX_LEN = 8
PAD_LOGP, PAD_OLD_LOGP = 3.0, -5.0
NON_BNPO = [t for t in LOSS_TYPES if t != "bnpo"]


def make_batch(ratios: list[list[float]], logp: list[list[float]], advantages: list[float], width: int) -> dict:
    """Padded tensors with old_logp = logp - log(r), so that exp(logp - old_logp) = r."""
    n = len(ratios)
    batch = {
        "logp": torch.full((n, width), PAD_LOGP),
        "old_logp": torch.full((n, width), PAD_OLD_LOGP),
        "mask": torch.zeros(n, width),
        "advantages": torch.tensor(advantages),
    }
    for i, (row_r, row_logp) in enumerate(zip(ratios, logp)):
        length = len(row_r)
        batch["logp"][i, :length] = torch.tensor(row_logp)
        batch["old_logp"][i, :length] = torch.tensor(row_logp) - torch.log(torch.tensor(row_r))
        batch["mask"][i, :length] = 1.0
    return batch


def hand_batch() -> dict:
    return make_batch(
        ratios=[[0.5, 1.0, 1.25, 1.5], [0.75, 1.5], [0.9, 1.1, 2.0]],
        logp=[[-1.0, -0.5, -2.0, -1.5], [-0.7, -1.2], [-0.3, -0.9, -1.1]],
        advantages=[1.0, -0.5, 2.0],
        width=4,
    )


def project_loss(batch: dict, loss_type: str, *, delta=None, beta=0.0, ref_logp=None, eps_low=EPS_LOW, eps_high=EPS_HIGH,
                 **options):
    """The whole batch as one micro-batch: (loss, dloss/dlogp, metrics, per-token loss). `options`: token_loss's
    per-variant ones (soft_gate, gamma, sampler_weight)."""
    logp = batch["logp"].clone().requires_grad_(True)
    per_token, metrics = token_loss(
        logp, batch["old_logp"], batch["advantages"], batch["mask"], loss_type,
        epsilon_low=eps_low, epsilon_high=eps_high, delta=delta, ref_logp=ref_logp, beta=beta, **options,
    )  # fmt: skip
    loss = aggregate(
        per_token, batch["mask"], loss_type,
        total_sequences=len(batch["mask"]), total_tokens=float(batch["mask"].sum()),
        max_completion_length=MAX_LEN, total_micro_batches=1,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logp)
    return loss.detach(), grad, metrics, per_token.detach()


# ----------------------------------------------------------------------------- the independent reference


def clipped_objective(r: torch.Tensor, adv: float, eps_low: float, eps_high: float, delta: float | None) -> torch.Tensor:
    """min(r A, clip(r, 1-eps_low, 1+eps_high) A), written as PPO's case analysis (Schulman et al. 2017, fig. 1),
    then dual-clip's floor delta*A for A < 0 (Ye et al. 2020, eq. 5). Clipped cases return a constant: no gradient."""
    if adv >= 0:
        objective = r * adv if r.item() <= 1 + eps_high else torch.tensor((1 + eps_high) * adv, dtype=r.dtype)
    else:
        objective = r * adv if r.item() >= 1 - eps_low else torch.tensor((1 - eps_low) * adv, dtype=r.dtype)
        if delta is not None and objective.item() < delta * adv:
            objective = torch.tensor(delta * adv, dtype=r.dtype)
    return objective


def reference_batch_loss(
    logp, old_logp, advantages, mask, loss_type, *, eps_low=EPS_LOW, eps_high=EPS_HIGH, delta=None,
    ref_logp=None, beta=0.0, micro_batches=None,
) -> torch.Tensor:  # fmt: skip
    """The batch loss from the papers' formulas, one token at a time (slow and plain on purpose)."""
    n = len(mask)
    micro_batches = micro_batches or [list(range(n))]
    per_sequence_sums, per_sequence_lengths = [], []
    for i in range(n):
        length = int(mask[i].sum().item())  # real tokens come first
        adv = float(advantages[i])
        if loss_type in ("gspo", "luspo"):  # GSPO (Zheng et al. 2025, eq. 7): one ratio per sequence; LUSPO keeps it
            mean_log_ratio = sum(logp[i, t] - old_logp[i, t] for t in range(length)) / length
            seq_objective = clipped_objective(torch.exp(mean_log_ratio), adv, eps_low, eps_high, delta)
        if loss_type == "vespo":  # VESPO: W = prod_t r_t, phi(W) = W^k e^(lambda (1 - W)), a number (no gradient);
            # each token's log ratio kept in [-20, 20] and ln W in [ln 1e-8, 20], as the authors' code clamps
            log_w = sum(min(max((logp[i, t] - old_logp[i, t]).item(), -20.0), 20.0) for t in range(length))
            w = math.exp(min(max(log_w, math.log(1e-8)), 20.0))
            k, lam = (GAMMA.k_pos, GAMMA.lambda_pos) if adv >= 0 else (GAMMA.k_neg, GAMMA.lambda_neg)
            phi = w**k * math.exp(lam * (1 - w))
        total = torch.zeros((), dtype=logp.dtype)
        for t in range(length):
            if loss_type in ("gspo", "luspo"):
                term = -seq_objective
            elif loss_type == "cispo":  # MiniMax-M1 (2025), eq. 4
                weight = min(math.exp((logp[i, t] - old_logp[i, t]).item()), 1 + eps_high)  # a number: no gradient
                term = -weight * adv * logp[i, t]
            elif loss_type == "sapo":  # SAPO: -A * 4/tau * sigmoid(tau (r - 1)), sigmoid spelt out
                tau = GATE.temperature_pos if adv > 0 else GATE.temperature_neg
                r = torch.exp(logp[i, t] - old_logp[i, t])
                term = -adv * (4 / tau) / (1 + torch.exp(-tau * (r - 1)))
            elif loss_type == "vespo":
                term = -phi * adv * logp[i, t]
            else:
                term = -clipped_objective(torch.exp(logp[i, t] - old_logp[i, t]), adv, eps_low, eps_high, delta)
            if beta > 0:  # k3 (Schulman 2020): e^(ref - logp) - (ref - logp) - 1
                d = ref_logp[i, t] - logp[i, t]
                term = term + beta * (torch.exp(d) - d - 1)
            total = total + term
        per_sequence_sums.append(total)
        per_sequence_lengths.append(length)

    if loss_type in ("grpo", "gspo", "sapo"):  # mean over sequences of per-sequence token means
        return sum(s / l for s, l in zip(per_sequence_sums, per_sequence_lengths)) / n
    if loss_type in ("dapo", "cispo", "vespo"):  # token sum over the batch / tokens in the batch
        return sum(per_sequence_sums) / sum(per_sequence_lengths)
    if loss_type == "luspo":  # each sequence's (GSPO) mean times its length, mean over sequences: token sum / n
        return sum(per_sequence_sums) / n
    if loss_type == "dr_grpo":  # token sum / (sequences x max length)
        return sum(per_sequence_sums) / (n * MAX_LEN)
    if loss_type == "bnpo":  # token mean within each micro-batch, mean over micro-batches
        means = [sum(per_sequence_sums[i] for i in mb) / sum(per_sequence_lengths[i] for i in mb) for mb in micro_batches]
        return sum(means) / len(means)
    raise AssertionError(loss_type)


def random_batch(seed: int, n: int = 16, width: int = 12) -> dict:
    """Ratios spread over [0.4, 2.5] (every clip case, both signs of A), lengths 1..width, junk padding."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, width + 1, (n,), generator=g)
    mask = (torch.arange(width)[None, :] < lengths[:, None]).float()
    logp = -3 * torch.rand(n, width, generator=g, dtype=torch.float64) - 0.05
    old_logp = logp - (torch.rand(n, width, generator=g, dtype=torch.float64) * 1.82 - 0.92)  # log r in [-0.92, 0.9]
    ref_logp = logp + torch.randn(n, width, generator=g, dtype=torch.float64) * 0.5
    logp = torch.where(mask.bool(), logp, torch.full_like(logp, PAD_LOGP))
    old_logp = torch.where(mask.bool(), old_logp, torch.full_like(old_logp, PAD_OLD_LOGP))
    return {
        "logp": logp,
        "old_logp": old_logp,
        "ref_logp": ref_logp,
        "mask": mask.double(),
        "advantages": torch.randn(n, generator=g, dtype=torch.float64),
    }


# ----------------------------------------------------------------------------- 1. hand-derived values


def test_token_losses_of_the_clipped_surrogate():
    # -min(r A, clip(r, 0.8, 1.28) A):
    # seq 0, A=+1:   r=0.5 -> -min(0.5, 0.8) = -0.5 (A > 0: a low ratio is not clipped)
    #                r=1.0 -> -1.0;  r=1.25 -> -1.25 (inside clip-higher; a symmetric 0.2 would clip it)
    #                r=1.5 -> -min(1.5, 1.28) = -1.28 (clipped high)
    # seq 1, A=-0.5: r=0.75 -> -min(-0.375, -0.4) = 0.4 (clipped low);  r=1.5 -> -min(-0.75, -0.64) = 0.75
    # seq 2, A=+2:   r=0.9 -> -1.8;  r=1.1 -> -2.2;  r=2.0 -> -2 * 1.28 = -2.56 (clipped high)
    batch = hand_batch()
    _, _, metrics, per_token = project_loss(batch, "grpo")
    expected = torch.tensor([[-0.5, -1.0, -1.25, -1.28], [0.4, 0.75, 0, 0], [-1.8, -2.2, -2.56, 0]])
    torch.testing.assert_close(per_token * batch["mask"], expected, atol=1e-5, rtol=0)
    # Clipped tokens: low = (r < 0.8 and A < 0) = seq1 t0; high = (r > 1.28 and A > 0) = seq0 t3, seq2 t2.
    assert metrics["clip_low"].item() == 1
    assert metrics["clip_high"].item() == 2
    assert metrics["clip_region"].item() == 3


# Token sums: seq 0: -0.5 - 1 - 1.25 - 1.28 = -4.03 (mean over 4: -1.0075)
#             seq 1:  0.4 + 0.75 = 1.15              (mean over 2:  0.575)
#             seq 2: -1.8 - 2.2 - 2.56 = -6.56       (mean over 3: -2.186667)
#             all:   -9.44 over 9 tokens
HAND_LOSSES = {
    "grpo": (-1.0075 + 0.575 - 2.186667) / 3,  # = -0.873056: mean of sequence means
    "bnpo": -9.44 / 9,  # = -1.048889: one micro-batch, so its token mean is the batch's
    "dapo": -9.44 / 9,  # = -1.048889: token sum / 9 tokens in the whole batch
    "dr_grpo": -9.44 / (3 * 8),  # = -0.393333: token sum / (3 sequences x max length 8)
}


@pytest.mark.parametrize("loss_type", list(HAND_LOSSES))
def test_aggregation_of_the_hand_batch(loss_type):
    loss, _, _, _ = project_loss(hand_batch(), loss_type)
    assert loss.item() == pytest.approx(HAND_LOSSES[loss_type], abs=1e-5)


def test_dapo_gradient_is_zero_exactly_on_clipped_tokens():
    # d(-r A)/dlogp = -r A (dr/dlogp = r) on unclipped tokens, 0 on clipped ones, then / 9 tokens:
    # seq 0: [-0.5, -1.0, -1.25, 0] / 9;  seq 1: [0 (clipped low), -1.5 x -0.5 = 0.75] / 9;  seq 2: [-1.8, -2.2, 0] / 9
    _, grad, _, _ = project_loss(hand_batch(), "dapo")
    expected = torch.tensor([[-0.5, -1.0, -1.25, 0], [0, 0.75, 0, 0], [-1.8, -2.2, 0, 0]]) / 9
    torch.testing.assert_close(grad, expected, atol=1e-6, rtol=0)


def test_symmetric_clip_range_clips_what_clip_higher_lets_through():
    # With eps_high = eps_low = 0.2 the range is [0.8, 1.2]: seq 0's r = 1.25 (A > 0) is now clipped,
    # its loss is -1.2 instead of -1.25, and its gradient vanishes.
    _, grad, metrics, per_token = project_loss(hand_batch(), "dapo", eps_high=0.2)
    assert per_token[0, 2].item() == pytest.approx(-1.2, abs=1e-6)
    assert metrics["clip_high"].item() == 3
    assert grad[0, 2].item() == 0.0


def test_dual_clip_bounds_the_loss_of_negative_advantages():
    # delta = 1.4: for A < 0 the token loss is at most -delta A = 0.7. Only seq 1's r = 1.5 exceeds it
    # (0.75 -> 0.7, now without gradient); its r = 0.75 (0.4) and every A > 0 token are unchanged
    # (seq 2's r = 2.0 keeps -2.56). Seq 1: 0.4 + 0.7 = 1.1, mean 0.55.
    loss, grad, _, per_token = project_loss(hand_batch(), "grpo", delta=1.4)
    assert per_token[1, 1].item() == pytest.approx(0.7, abs=1e-6)
    assert per_token[1, 0].item() == pytest.approx(0.4, abs=1e-6)
    assert per_token[2, 2].item() == pytest.approx(-2.56, abs=1e-6)
    assert loss.item() == pytest.approx((-1.0075 + 0.55 - 2.186667) / 3, abs=1e-5)  # -0.881389
    assert grad[1, 1].item() == 0.0
    # Without dual clip the same token has gradient -r A / (len 2 x 3 sequences) = 0.75 / 6.
    _, grad_without, _, _ = project_loss(hand_batch(), "grpo")
    assert grad_without[1, 1].item() == pytest.approx(0.75 / 6, abs=1e-6)


def test_gspo_clips_one_ratio_per_sequence():
    # Token ratios whose geometric mean is round: s_i = exp(mean_t log r_t).
    # seq 0, A=+1,   r=[2, 2, 1, 1]:  s = exp(2 ln2 / 4) = sqrt2 = 1.4142 > 1.28 -> loss -1.28, all 4 tokens clipped high
    # seq 1, A=-0.5, r=[0.5, 1]:      s = exp(-ln2 / 2) = 0.7071 < 0.8  -> loss -(0.8 x -0.5) = 0.4, 2 tokens clipped low
    # seq 2, A=+2,   r=[1.5, 1, 2/3]: s = exp(0) = 1                     -> loss -2, nothing clipped
    #   (token-level clipping would have clipped seq 2's r = 1.5; GSPO does not look at single tokens)
    # Batch: (-1.28 + 0.4 - 2) / 3 = -0.96.
    # Gradient: only seq 2; d(-A s)/dlogp_t = -A s / len = -2/3, then / 3 sequences = -2/9 per token.
    batch = make_batch(
        ratios=[[2.0, 2.0, 1.0, 1.0], [0.5, 1.0], [1.5, 1.0, 2 / 3]],
        logp=[[-1.0, -0.5, -2.0, -1.5], [-0.7, -1.2], [-0.3, -0.9, -1.1]],
        advantages=[1.0, -0.5, 2.0],
        width=4,
    )
    loss, grad, metrics, _ = project_loss(batch, "gspo")
    assert loss.item() == pytest.approx(-0.96, abs=1e-5)
    expected_grad = torch.tensor([[0.0] * 4, [0.0] * 4, [-2 / 9] * 3 + [0.0]])
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=0)
    assert metrics["clip_high"].item() == 4 and metrics["clip_low"].item() == 2 and metrics["clip_region"].item() == 6
    # The token-level ratio on the same batch would clip seq 2's first token and give a different loss.
    grpo_loss, _, _, _ = project_loss(batch, "grpo")
    assert abs(grpo_loss.item() - loss.item()) > 0.05


def test_cispo_weights_every_token_with_the_clipped_detached_ratio():
    # -min(r, 1.28) A logp, the weight detached:
    # seq 0, A=+1:   w = [0.5, 1, 1.25, 1.28]; -w logp = [0.5, 0.5, 2.5, 1.92]              sum  5.42
    # seq 1, A=-0.5: w = [0.75, 1.28];         0.5 w logp = [-0.2625, -0.768]              sum -1.0305
    # seq 2, A=+2:   w = [0.9, 1.1, 1.28];     -2 w logp = [0.54, 1.98, 2.816]             sum  5.336
    # Batch (token sum / 9 tokens): 9.7255 / 9 = 1.080611.
    # Gradient -w A / 9, nonzero on every real token, clipped ones included (no token is dropped):
    #   seq 0: [-0.5, -1, -1.25, -1.28] / 9;  seq 1: [0.375, 0.64] / 9;  seq 2: [-1.8, -2.2, -2.56] / 9
    loss, grad, metrics, per_token = project_loss(hand_batch(), "cispo")
    assert loss.item() == pytest.approx(9.7255 / 9, abs=1e-5)
    expected_tokens = torch.tensor([[0.5, 0.5, 2.5, 1.92], [-0.2625, -0.768, 0, 0], [0.54, 1.98, 2.816, 0]])
    torch.testing.assert_close(per_token * hand_batch()["mask"], expected_tokens, atol=1e-5, rtol=0)
    expected_grad = torch.tensor([[-0.5, -1.0, -1.25, -1.28], [0.375, 0.64, 0, 0], [-1.8, -2.2, -2.56, 0]]) / 9
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=0)
    # Counted as clipped: r > 1.28 with A > 0 (seq 0 t3, seq 2 t2); CISPO has no lower clip.
    assert metrics["clip_high"].item() == 2 and metrics["clip_low"].item() == 0


KL_DIVISOR = {"dr_grpo": 8, "luspo": 1}  # every other type: 3 (the tokens of the one sequence)


def test_sapo_replaces_the_clip_with_a_soft_gate():
    # f(r) = 4/tau sigmoid(tau (r - 1)), token loss -f(r) A; tau = 1 for A > 0 and 1.05 otherwise (the defaults).
    # seq 0, A=+1:   tau (r-1) = [-0.5, 0, 0.25, 0.5]; sigmoid = [0.377541, 0.5, 0.562177, 0.622459]
    #                f = 4 sigmoid = [1.510163, 2, 2.248706, 2.489837]; loss -f, sum -8.248706, mean -2.062177
    # seq 1, A=-0.5: tau (r-1) = 1.05 x [-0.25, 0.5] = [-0.2625, 0.525]; sigmoid = [0.434749, 0.628316]
    #                f = 4/1.05 sigmoid = [1.656188, 2.393586]; loss 0.5 f = [0.828094, 1.196793], mean 1.012443
    # seq 2, A=+2:   tau (r-1) = [-0.1, 0.1, 1]; sigmoid = [0.475021, 0.524979, 0.731059]
    #                f = [1.900083, 2.099917, 2.924234]; loss -2 f = [-3.800167, -4.199833, -5.848469], mean -4.616156
    # Batch (sequence means, then their mean, as grpo): (-2.062177 + 1.012443 - 4.616156) / 3 = -1.888630.
    loss, grad, metrics, per_token = project_loss(hand_batch(), "sapo")
    expected = torch.tensor([[-1.510163, -2.0, -2.248706, -2.489837], [0.828094, 1.196793, 0, 0], [-3.800167, -4.199833, -5.848469, 0]])
    torch.testing.assert_close(per_token * hand_batch()["mask"], expected, atol=2e-6, rtol=0)
    assert loss.item() == pytest.approx(-1.888630, abs=2e-6)
    # Gradient -A f'(r) r, f'(r) = 4 s (1 - s) (tau cancels), then / (length x 3 sequences):
    #   seq 0 t1, r = 1: -1 x 1 x 1 / 12 = -0.083333, GRPO's on-policy gradient exactly (4 x 0.5 x 0.5 = 1)
    #   seq 0 t3, r = 1.5, where grpo's clip (1.28) leaves no gradient: -4 x 0.622459 x 0.377541 x 1.5 / 12 = -0.117502
    #   seq 1 t0, r = 0.75, clipped low under grpo: 0.5 x 4 x 0.434749 x 0.565251 x 0.75 / 6 = 0.061436
    assert grad[0, 1].item() == pytest.approx(-1 / 12, abs=1e-6)
    assert grad[0, 3].item() == pytest.approx(-0.117502, abs=1e-6)
    assert grad[1, 0].item() == pytest.approx(0.061436, abs=1e-6)
    _, grpo_grad, _, _ = project_loss(hand_batch(), "grpo")
    assert grpo_grad[0, 3].item() == 0.0 and grpo_grad[1, 0].item() == 0.0
    assert metrics["clip_region"].item() == 0  # nothing is clipped


def test_sapo_temperatures_set_how_fast_the_gate_closes():
    # One token, A = +1, r = 2: gradient weight f'(r) r = 4 s (1 - s) x 2 with s = sigmoid(tau):
    #   tau = 1: s = 0.731059, 4 s (1 - s) = 0.786448 -> gradient -1.572895
    #   tau = 4: s = 0.982014, 4 s (1 - s) = 0.070651 -> gradient -0.141302 (a hotter gate shuts off sooner)
    batch = make_batch(ratios=[[2.0]], logp=[[-1.0]], advantages=[1.0], width=1)
    for tau, expected in ((1.0, -1.572895), (4.0, -0.141302)):
        _, grad, _, _ = project_loss(batch, "sapo", soft_gate=SoftGate(temperature_pos=tau, temperature_neg=9.0))
        assert grad.item() == pytest.approx(expected, abs=1e-6)
    # A < 0 reads the negative temperature: tau_neg = 4 gives the same magnitude, opposite sign.
    negative = make_batch(ratios=[[2.0]], logp=[[-1.0]], advantages=[-1.0], width=1)
    _, grad, _, _ = project_loss(negative, "sapo", soft_gate=SoftGate(temperature_pos=1.0, temperature_neg=4.0))
    assert grad.item() == pytest.approx(0.141302, abs=1e-6)


GSPO_BATCH = dict(  # token ratios whose geometric means are round: s = [sqrt2, 1/sqrt2, 1]
    ratios=[[2.0, 2.0, 1.0, 1.0], [0.5, 1.0], [1.5, 1.0, 2 / 3]],
    logp=[[-1.0, -0.5, -2.0, -1.5], [-0.7, -1.2], [-0.3, -0.9, -1.1]],
    advantages=[1.0, -0.5, 2.0],
    width=4,
)


def test_luspo_weights_each_sequence_by_its_length():
    # GSPO's clipped sequence losses (below): -1.28 for seq 0 (4 tokens), 0.4 for seq 1 (2), -2 for seq 2 (3).
    # LUSPO: each sequence's loss times its length, mean over the 3 sequences: (4 x -1.28 + 2 x 0.4 + 3 x -2) / 3
    #        = (-5.12 + 0.8 - 6) / 3 = -3.44 (GSPO: -0.96).
    # Gradient: only seq 2 is unclipped; d(3 x -A s)/dlogp_t = -3 A s / 3 = -A s = -2 (the length cancels),
    #           / 3 sequences = -2/3 per token (GSPO: -2/9, divided by the length once more).
    loss, grad, metrics, _ = project_loss(make_batch(**GSPO_BATCH), "luspo")
    assert loss.item() == pytest.approx(-3.44, abs=1e-5)
    torch.testing.assert_close(grad, torch.tensor([[0.0] * 4, [0.0] * 4, [-2 / 3] * 3 + [0.0]]), atol=1e-6, rtol=0)
    assert metrics["clip_high"].item() == 4 and metrics["clip_low"].item() == 2  # clipped as GSPO: whole sequences


def test_luspo_gives_every_token_the_same_push_whatever_its_sequence_length():
    # Two completions with A = +1 and r = 1, of 1 and 4 tokens. Per token, d/dlogp_t:
    #   gspo (and grpo): -A s / len / 2 sequences = -1/2 (1 token), -1/8 (4 tokens): short answers pushed harder
    #   luspo:           -A s / 2 = -1/2 for both (Liu et al. 2026: the length bias GSPO inherits is gone)
    batch = make_batch(ratios=[[1.0], [1.0] * 4], logp=[[-1.0], [-1.0] * 4], advantages=[1.0, 1.0], width=4)
    _, gspo, _, _ = project_loss(batch, "gspo")
    _, luspo, _, _ = project_loss(batch, "luspo")
    torch.testing.assert_close(gspo, torch.tensor([[-0.5, 0, 0, 0], [-0.125] * 4]), atol=1e-7, rtol=0)
    torch.testing.assert_close(luspo, torch.tensor([[-0.5, 0, 0, 0], [-0.5] * 4]), atol=1e-7, rtol=0)


VESPO_BATCH = dict(  # token ratios with round products W = [1, 2, 0.5]
    ratios=[[2.0, 0.5, 1.0, 1.0], [2.0, 1.0], [0.5, 1.0, 1.0]],
    logp=[[-1.0, -0.5, -2.0, -1.5], [-0.7, -1.2], [-0.3, -0.9, -1.1]],
    advantages=[1.0, -0.5, 2.0],
    width=4,
)


def test_vespo_weights_the_reinforce_gradient_by_a_gamma_kernel_of_the_sequence_ratio():
    # W = prod_t r_t (no length normalisation); phi(W) = W^k e^(lambda (1 - W)); (k, lambda) = (2, 3) for A >= 0,
    # (3, 2) for A < 0. phi is a weight (detached): token loss -phi A logp, gradient -phi A.
    #   seq 0, A=+1,   W = 2 x 0.5 = 1 -> phi = 1 (for any k, lambda)
    #   seq 1, A=-0.5, W = 2           -> phi = 2^3 e^(2 (1 - 2)) = 8 e^-2 = 1.082682
    #   seq 2, A=+2,   W = 0.5         -> phi = 0.5^2 e^(3 (1 - 0.5)) = 0.25 e^1.5 = 1.120422
    #   (seq 2 gets more than 1: the kernel peaks at W = k / lambda = 2/3 for A >= 0, not at 1)
    # Token losses: seq 0: -logp = [1, 0.5, 2, 1.5] (sum 5)
    #               seq 1: 0.5 x 1.082682 x [-0.7, -1.2] = [-0.378939, -0.649609] (sum -1.028548)
    #               seq 2: -2 x 1.120422 x [-0.3, -0.9, -1.1] = [0.672253, 2.016760, 2.464929] (sum 5.153942)
    # Batch: token sum / 9 tokens (as dapo) = 9.125394 / 9 = 1.013933.
    loss, grad, metrics, per_token = project_loss(make_batch(**VESPO_BATCH), "vespo")
    expected = torch.tensor([[1.0, 0.5, 2.0, 1.5], [-0.378939, -0.649609, 0, 0], [0.672253, 2.016760, 2.464929, 0]])
    torch.testing.assert_close(per_token * make_batch(**VESPO_BATCH)["mask"], expected, atol=1e-6, rtol=0)
    assert loss.item() == pytest.approx(1.013933, abs=1e-6)
    # Gradient -phi A / 9 on every real token, however far W is from 1 (nothing is clipped).
    phi_a = torch.tensor([[1.0] * 4, [-0.541341] * 2 + [0.0] * 2, [2.240845] * 3 + [0.0]])
    torch.testing.assert_close(grad, -phi_a / 9 * make_batch(**VESPO_BATCH)["mask"], atol=1e-6, rtol=0)
    assert metrics["clip_region"].item() == 0


def test_vespo_takes_the_rollout_correction_into_w_instead_of_weighting_the_loss():
    # r = 1 everywhere, A = -1, sampler weights pi_old/pi_sampler = [2, 1]: W = pi_theta/pi_sampler = 2,
    # phi = 2^3 e^(2 (1 - 2)) = 1.082682; loss -phi A logp = 1.082682 x [-1, -1], token mean -1.082682.
    # A clipped loss (dapo) multiplies its token losses by the weight instead: -A r w = [2, 1], mean 1.5.
    batch = make_batch(ratios=[[1.0, 1.0]], logp=[[-1.0, -1.0]], advantages=[-1.0], width=2)
    correction = torch.tensor([[2.0, 1.0]])
    loss, grad, _, _ = project_loss(batch, "vespo", sampler_weight=correction)
    assert loss.item() == pytest.approx(-1.082682, abs=1e-6)
    torch.testing.assert_close(grad, torch.full((1, 2), 1.082682 / 2), atol=1e-6, rtol=0)
    dapo_loss, _, _, _ = project_loss(batch, "dapo", sampler_weight=correction)
    assert dapo_loss.item() == pytest.approx(1.5, abs=1e-6)
    # A token the correction masks (weight 0, tis_mode token_mask) takes W to ~1e-8: phi ~ 0, no update at all.
    _, masked_grad, _, _ = project_loss(batch, "vespo", sampler_weight=torch.tensor([[0.0, 1.0]]))
    assert masked_grad.abs().max().item() < 1e-20


def test_vespo_clamps_each_token_log_ratio_to_20_before_forming_w():
    # The authors' code and TRL's get_gamma_weights clamp every token's log ratio to [-20, 20] before the sum:
    # token log ratios +25 and -24.5 count as +20 and -20, so ln W = 0, W = 1 and phi = 1 (A = +1: k 2, lambda 3).
    # Token losses -phi A logp = [1, 2], token mean 1.5; gradient -phi A / 2 = -0.5 on each token.
    # Summed unclamped they would give ln W = 0.5: phi = e^(2 x 0.5 + 3 (1 - e^0.5)) = e^-0.946164 = 0.388, loss 0.582.
    batch = make_batch(ratios=[[1.0, 1.0]], logp=[[-1.0, -2.0]], advantages=[1.0], width=2)
    batch["old_logp"] = batch["logp"] - torch.tensor([[25.0, -24.5]])
    loss, grad, _, _ = project_loss(batch, "vespo")
    assert loss.item() == pytest.approx(1.5, abs=1e-6)
    torch.testing.assert_close(grad, torch.full((1, 2), -0.5), atol=1e-6, rtol=0)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_kl_k3_penalty(loss_type):
    # A = 0 and r = 1, so only beta * k3 remains. ref - logp = [0, ln2, -ln2]:
    #   k3 = e^d - d - 1 = [0, 2 - ln2 - 1, 1/2 + ln2 - 1] = [0, 0.306853, 0.193147], sum = 0.5
    # beta = 0.1: token sum 0.05; one sequence of 3 tokens -> 0.05/3 for every type but dr_grpo (0.05/8, the
    # max length) and luspo (0.05/1: a token sum over 1 sequence).
    # d(k3)/dlogp = 1 - e^d = [0, -1, 0.5]; x beta / 3 = [0, -0.033333, 0.016667].
    batch = make_batch(ratios=[[1.0, 1.0, 1.0]], logp=[[-1.0, -2.0, -0.5]], advantages=[0.0], width=3)
    ref_logp = batch["logp"] + torch.tensor([[0.0, math.log(2), -math.log(2)]])
    loss, grad, metrics, _ = project_loss(batch, loss_type, beta=0.1, ref_logp=ref_logp)
    scale = KL_DIVISOR.get(loss_type, 3)
    assert loss.item() == pytest.approx(0.05 / scale, abs=1e-6)
    assert metrics["kl"].item() == pytest.approx(0.5, abs=1e-6)
    torch.testing.assert_close(grad, torch.tensor([[0.0, -0.1, 0.05]]) / scale, atol=1e-6, rtol=0)


def test_importance_weight_scales_the_policy_term_and_not_the_kl():
    # One token, r = 1, A = 1, ref - logp = ln 2: policy term -r*A = -1, k3 = 2 - ln2 - 1 = 0.306853, beta = 0.1.
    # Weight w = 0.5 (truncated importance sampling): w * policy + beta * k3 = -0.5 + 0.0306853 = -0.4693147.
    # Weighting after the KL was added (as once done here) would give 0.5 * (-1 + 0.0306853) = -0.4846574.
    batch = make_batch(ratios=[[1.0]], logp=[[-1.0]], advantages=[1.0], width=1)
    ref_logp = batch["logp"] + math.log(2)
    loss, _ = token_loss(batch["logp"], batch["old_logp"], batch["advantages"], batch["mask"], "grpo", 0.2, 0.2,
                         ref_logp=ref_logp, beta=0.1, policy_weight=torch.tensor([[0.5]]))
    assert loss.item() == pytest.approx(-0.5 + 0.1 * (1 - math.log(2)), abs=1e-6)


def test_the_variant_table_names_every_loss_type_and_drives_aggregation():
    from grpo_trainer.losses import LOSS_VARIANTS, ClipOptions, GammaShape, SoftGate, clipped_sequence_ratio

    assert tuple(LOSS_VARIANTS)[: len(LOSS_TYPES)] == LOSS_TYPES
    assert [v.name for v in LOSS_VARIANTS.values() if v.per_micro_batch] == ["bnpo"]
    assert [v.name for v in LOSS_VARIANTS.values() if not v.exact_zero_advantage_skip] == ["bnpo"]
    assert [v.name for v in LOSS_VARIANTS.values() if v.ratio == "sequence"] == ["gspo", "luspo"]
    assert [v.name for v in LOSS_VARIANTS.values() if v.surrogate is clipped_sequence_ratio] == ["gspo", "luspo"]
    assert [v.name for v in LOSS_VARIANTS.values() if v.ratio == "sequence_product"] == ["vespo"]
    assert [v.name for v in LOSS_VARIANTS.values() if v.sampler_weight_in_ratio] == ["vespo"]
    # What each reads: its own options model drives the config's check (tests/test_loss_family_2026.py).
    assert LOSS_VARIANTS["sapo"].options is SoftGate and LOSS_VARIANTS["vespo"].options is GammaShape
    assert LOSS_VARIANTS["luspo"].options is LOSS_VARIANTS["gspo"].options is ClipOptions
    assert list(LOSS_VARIANTS["cispo"].options.model_fields) == ["epsilon_high"]
    assert dict(LOSS_VARIANTS["sapo"].legacy_keys) == {"sapo_temperature_pos": "temperature_pos",
                                                       "sapo_temperature_neg": "temperature_neg"}


def test_kl_k3_is_zero_only_at_equality_and_positive_elsewhere():
    logp = torch.tensor([-1.0, -1.0, -1.0, -1.0])
    ref = torch.tensor([-1.0, -3.0, 0.0, -1.5])
    kl = kl_k3(logp, ref)
    assert kl[0].item() == 0.0
    assert (kl[1:] > 0).all()
    # d = -2: e^-2 + 2 - 1 = 1.135335
    assert kl[1].item() == pytest.approx(math.exp(-2) + 1, abs=1e-6)


def test_beta_without_reference_and_unknown_type_are_errors():
    batch = hand_batch()
    with pytest.raises(ValueError, match="ref_logp"):
        token_loss(batch["logp"], batch["old_logp"], batch["advantages"], batch["mask"], "grpo", 0.2, 0.2, beta=0.1)
    with pytest.raises(ValueError, match="unknown loss_type"):
        token_loss(batch["logp"], batch["old_logp"], batch["advantages"], batch["mask"], "ppo", 0.2, 0.2)
    with pytest.raises(ValueError, match="unknown loss_type"):
        aggregate(batch["logp"], batch["mask"], "ppo", total_sequences=3, total_tokens=9, max_completion_length=8, total_micro_batches=1)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_padding_contents_do_not_matter(loss_type):
    batch = hand_batch()
    loss, grad, metrics, _ = project_loss(batch, loss_type, beta=0.1, ref_logp=batch["logp"] - 0.3)
    padding = batch["mask"] == 0
    for junk in (0.0, -30.0):
        other = {**batch, "logp": batch["logp"].masked_fill(padding, junk), "old_logp": batch["old_logp"].masked_fill(padding, junk)}
        loss_2, grad_2, metrics_2, _ = project_loss(other, loss_type, beta=0.1, ref_logp=batch["logp"] - 0.3)
        assert loss_2.item() == pytest.approx(loss.item(), abs=1e-6)
        torch.testing.assert_close(grad_2, grad)
        assert all(metrics_2[k].item() == pytest.approx(metrics[k].item()) for k in metrics)
    assert (grad[padding] == 0).all()


# ----------------------------------------------------------------------------- 2. gradients vs the reference


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_hand_batch_loss_and_gradient_match_the_reference(loss_type):
    batch = hand_batch()
    ref_logp = batch["logp"] + 0.25
    loss, grad, _, _ = project_loss(batch, loss_type, delta=1.4, beta=0.05, ref_logp=ref_logp)
    logp = batch["logp"].clone().requires_grad_(True)
    expected = reference_batch_loss(
        logp, batch["old_logp"], batch["advantages"], batch["mask"], loss_type, delta=None if loss_type == "cispo" else 1.4,
        beta=0.05, ref_logp=ref_logp,
    )  # fmt: skip
    (expected_grad,) = torch.autograd.grad(expected, logp)
    assert loss.item() == pytest.approx(expected.item(), abs=1e-5)
    torch.testing.assert_close(grad, expected_grad, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
@pytest.mark.parametrize("seed", [0, 1])
def test_random_batch_loss_and_gradient_match_the_reference(loss_type, seed):
    batch = random_batch(seed)
    delta = None if loss_type == "cispo" else 2.0
    logp = batch["logp"].clone().requires_grad_(True)
    per_token, _ = token_loss(
        logp, batch["old_logp"], batch["advantages"], batch["mask"], loss_type, EPS_LOW, EPS_HIGH,
        delta=delta, ref_logp=batch["ref_logp"], beta=0.04,
    )  # fmt: skip
    loss = aggregate(
        per_token, batch["mask"], loss_type, total_sequences=16, total_tokens=float(batch["mask"].sum()),
        max_completion_length=MAX_LEN, total_micro_batches=1,
    )  # fmt: skip
    (grad,) = torch.autograd.grad(loss, logp)

    ref_leaf = batch["logp"].clone().requires_grad_(True)
    expected = reference_batch_loss(
        ref_leaf, batch["old_logp"], batch["advantages"], batch["mask"], loss_type, delta=delta,
        ref_logp=batch["ref_logp"], beta=0.04,
    )  # fmt: skip
    (expected_grad,) = torch.autograd.grad(expected, ref_leaf)
    torch.testing.assert_close(loss, expected.to(loss.dtype), atol=1e-10, rtol=1e-9)
    torch.testing.assert_close(grad, expected_grad, atol=1e-10, rtol=1e-9)
    assert grad.abs().sum() > 0


# ----------------------------------------------------------------------------- 3. micro-batch / rank invariance


def split_loss(batch: dict, loss_type: str, ranks: list[list[list[int]]], delta=None, beta=0.04):
    """Run the batch as the trainer does: each rank's micro-batches, each share scaled by grad_accum * world
    before backward, Accelerate dividing by grad_accum, DDP averaging over ranks. Returns the summed loss,
    the resulting gradient and the summed clip counts. `ranks[r][m]` lists the sequences of micro-batch m on rank r."""
    world, grad_accum = len(ranks), len(ranks[0])
    total_tokens = float(batch["mask"].sum())
    logp = batch["logp"].clone().requires_grad_(True)
    loss = torch.zeros((), dtype=logp.dtype)
    rank_grads, counts = [], {"clip_low": 0.0, "clip_high": 0.0, "clip_region": 0.0}
    for micro_batches in ranks:
        rank_grad = torch.zeros_like(logp)
        for rows in micro_batches:
            rows = torch.tensor(rows)
            per_token, metrics = token_loss(
                logp[rows], batch["old_logp"][rows], batch["advantages"][rows], batch["mask"][rows], loss_type,
                EPS_LOW, EPS_HIGH, delta=delta, ref_logp=batch["ref_logp"][rows], beta=beta,
            )  # fmt: skip
            share = aggregate(
                per_token, batch["mask"][rows], loss_type, total_sequences=len(batch["mask"]), total_tokens=total_tokens,
                max_completion_length=MAX_LEN, total_micro_batches=grad_accum * world,
            )  # fmt: skip
            (g,) = torch.autograd.grad(share * grad_accum * world, logp)
            rank_grad += g / grad_accum  # Accelerate's backward divides by the accumulation steps
            loss = loss + share.detach()
            for key in counts:
                counts[key] += metrics[key].item()
        rank_grads.append(rank_grad)
    return loss, sum(rank_grads) / world, counts  # DDP: all-reduce mean of the ranks' gradients


ONE_MICRO_BATCH = [[list(range(16))]]
FOUR_MICRO_BATCHES = [[list(range(0, 4)), list(range(4, 8)), list(range(8, 12)), list(range(12, 16))]]
TWO_RANKS_TWO_MICRO_BATCHES = [[[0, 5, 10, 15], [1, 6, 11, 12]], [[2, 7, 8, 13], [3, 4, 9, 14]]]  # any partition will do


@pytest.mark.parametrize("loss_type", NON_BNPO)
def test_loss_and_gradient_do_not_depend_on_micro_batches_or_ranks(loss_type):
    batch = random_batch(seed=3)
    delta = None if loss_type == "cispo" else 2.0
    whole_loss, whole_grad, whole_counts = split_loss(batch, loss_type, ONE_MICRO_BATCH, delta=delta)
    for layout in (FOUR_MICRO_BATCHES, TWO_RANKS_TWO_MICRO_BATCHES):
        loss, grad, counts = split_loss(batch, loss_type, layout, delta=delta)
        torch.testing.assert_close(loss, whole_loss, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(grad, whole_grad, atol=1e-12, rtol=1e-10)
        assert counts == whole_counts
    assert whole_grad.abs().sum() > 0


@pytest.mark.parametrize("loss_type", [t for t in LOSS_TYPES if LOSS_VARIANTS[t].exact_zero_advantage_skip])
def test_zero_advantage_rows_can_skip_the_passes_without_changing_the_update(loss_type):
    """What `LossVariant.exact_zero_advantage_skip` promises (beta = 0): leaving the completions whose advantage is
    0 out of the micro-batches, while the normalisers still count them, gives the same loss and gradient."""
    batch = random_batch(seed=5)
    batch["advantages"][::3] = 0.0  # rows 0, 3, 6, ... have nothing to learn
    kept = [i for i in range(16) if batch["advantages"][i] != 0]
    whole_loss, whole_grad, _ = split_loss(batch, loss_type, ONE_MICRO_BATCH, beta=0.0)
    loss, grad, _ = split_loss(batch, loss_type, [[kept[:6], kept[6:]]], beta=0.0)
    torch.testing.assert_close(loss, whole_loss, atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(grad, whole_grad, atol=1e-12, rtol=1e-10)
    assert whole_grad[::3].abs().max() == 0 and whole_grad.abs().sum() > 0


def test_bnpo_depends_on_micro_batch_token_counts():
    # Hand case, r = 1 everywhere so each token's loss is -A.
    # seq 0: A = +1, 3 tokens (token losses -1 each, sum -3);  seq 1: A = -1, 1 token (+1).
    #   one micro-batch:  (-3 + 1) / 4 tokens              = -0.5
    #   two micro-batches: (-3/3 + 1/1) / 2 micro-batches  =  0.0
    # With seq 1 also 3 tokens (sum +3) the micro-batches hold as many tokens as each other and both give 0.
    def bnpo(lengths, layout):
        batch = make_batch([[1.0] * n for n in lengths], [[-1.0] * n for n in lengths], [1.0, -1.0], width=3)
        batch["ref_logp"] = batch["logp"]
        return split_loss(batch, "bnpo", layout, beta=0.0)[0].item()

    assert bnpo([3, 1], [[[0, 1]]]) == pytest.approx(-0.5)
    assert bnpo([3, 1], [[[0], [1]]]) == pytest.approx(0.0)
    assert bnpo([3, 3], [[[0, 1]]]) == pytest.approx(0.0)
    assert bnpo([3, 3], [[[0], [1]]]) == pytest.approx(0.0)


def test_bnpo_matches_its_per_micro_batch_definition_on_a_random_batch():
    batch = random_batch(seed=3)
    whole_loss, _, _ = split_loss(batch, "bnpo", ONE_MICRO_BATCH)
    loss, grad, _ = split_loss(batch, "bnpo", FOUR_MICRO_BATCHES)
    assert abs(loss.item() - whole_loss.item()) > 1e-3  # random lengths: the micro-batches hold different token counts
    logp = batch["logp"].clone().requires_grad_(True)
    expected = reference_batch_loss(
        logp, batch["old_logp"], batch["advantages"], batch["mask"], "bnpo", ref_logp=batch["ref_logp"], beta=0.04,
        micro_batches=FOUR_MICRO_BATCHES[0],
    )  # fmt: skip
    (expected_grad,) = torch.autograd.grad(expected, logp)
    torch.testing.assert_close(loss, expected.detach(), atol=1e-12, rtol=1e-10)
    torch.testing.assert_close(grad, expected_grad, atol=1e-12, rtol=1e-10)
