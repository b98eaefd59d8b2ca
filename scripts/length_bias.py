"""Reproduce GRPO's length bias on a toy policy, with this project's own loss code.

Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective"
(Dr. GRPO), sec. 3.1: GRPO divides each completion's token losses by that
completion's length. A right answer (A > 0) then pushes harder per token when it
is short, and a wrong answer (A < 0) is punished less per token when it is long,
so training makes right answers shorter and wrong answers longer although no
reward mentions length. Dr. GRPO divides by a constant (max length) instead and
drops the std scaling; the bias goes away.

The toy task, small enough to run in seconds on a CPU:
  * 8 questions, 4 candidate answers each; answer `q % 4` is right for question q
    (reward 1, else 0). Groups of 8 completions per question, all 8 questions per
    step (64 completions), 400 steps, 5 seeds.
  * A completion is: one answer token, then filler tokens, then a stop token;
    at most 40 tokens (a completion without a stop by then is truncated).

The toy policy is tabular (two [8, 4] tables of logits, nothing shared):
  * answer_logits[q, a]: softmax over the 4 answers of question q; token 0.
  * stop_logits[q, a]: after answer a to question q, every later token is the stop
    token with probability sigmoid(stop_logits[q, a]), else a filler. The length
    thus depends on which answer was picked, so it *can* correlate with being right;
    whether it does is left to the loss. Initial stop probability 1/8 gives a mean
    length of 1 + 8 = 9 tokens (geometric, truncation at 40 is negligible).
Per-token log-probs are exact: log p(answer), log(1 - p_stop) per filler, log p_stop
for the stop token. Training is on-policy (one update per batch, old = current), so
the ratio is 1 and no clipping happens: what differs between the two runs is only the
advantage scaling and the aggregation, exactly `grpo_trainer.advantages.group_advantages`
and `grpo_trainer.losses.per_token_loss` + `aggregate`.

Step sizes. Plain SGD (no Adam, whose per-parameter normalisation would hide the
loss's scale). `dr_grpo` divides each completion's token sum by max_length = 40,
not by its own length (~9 at the start: a factor ~4.4), and leaves advantages
unscaled (`grpo` divides them by the group std, ~0.43 at 25% accuracy and smaller
as groups become lopsided: another factor 2.3 to 5). Its gradients are thus
~10-20x smaller, so it gets a 20x larger step size (3 vs 60, chosen so that both
accuracy curves match). The step size changes the speed, not the direction: the
length drift comes from the 1/length weighting, which no step size produces or
removes.

Reported statistics are exact expectations under the policy after each step's
update (no sampling noise): accuracy, mean length of right answers and of wrong
answers, averaged over questions weighted as sampled, then over seeds.

Deliberately simple: no model, no tokenizer, no KL, one update per batch.

    python scripts/length_bias.py                   # full run, ~10 s on 2 CPU cores
    python scripts/length_bias.py --steps 100 --seeds 2 --plot '' --json out.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from grpo_trainer.advantages import group_advantages  # noqa: E402
from grpo_trainer.losses import aggregate, loss_variant, per_token_loss  # noqa: E402

NUM_QUESTIONS = 8
NUM_ANSWERS = 4
GROUP_SIZE = 8
MAX_LENGTH = 40
INITIAL_STOP_PROBABILITY = 1 / 8  # mean length 1 answer + 8 (7 fillers + stop) = 9 tokens
CHECKPOINTS = (1, 50, 100, 200, 400)

# loss_type -> (advantage scaling, SGD step size); see "Step sizes" in the module docstring.
RECIPES = {
    "grpo": ("group", 3.0),
    "dr_grpo": ("none", 60.0),
}


class ToyPolicy(torch.nn.Module):
    """Tabular policy: answer logits and per-(question, answer) stop logits, both [Q, 4]."""

    def __init__(self) -> None:
        super().__init__()
        self.answer_logits = torch.nn.Parameter(torch.zeros(NUM_QUESTIONS, NUM_ANSWERS))
        initial_stop_logit = math.log(INITIAL_STOP_PROBABILITY / (1 - INITIAL_STOP_PROBABILITY))
        self.stop_logits = torch.nn.Parameter(torch.full((NUM_QUESTIONS, NUM_ANSWERS), initial_stop_logit))

    @torch.no_grad()
    def sample(self, questions: torch.Tensor, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Answers [N], lengths [N] (tokens, answer and stop included; at most MAX_LENGTH) and stopped [N]
        (False: truncated at MAX_LENGTH without a stop token)."""
        answer_probs = torch.softmax(self.answer_logits[questions], dim=-1)  # [N, 4]
        answers = torch.multinomial(answer_probs, 1, generator=generator).squeeze(1)  # [N]
        stop_prob = torch.sigmoid(self.stop_logits[questions, answers])  # [N]
        # Each of the MAX_LENGTH - 1 positions after the answer stops with stop_prob: the first stop ends it.
        stops = torch.rand(len(questions), MAX_LENGTH - 1, generator=generator) < stop_prob[:, None]  # [N, L-1]
        stopped = stops.any(1)
        first_stop = stops.float().argmax(1)  # index among those positions; meaningless when not stopped
        lengths = torch.where(stopped, first_stop + 2, torch.full_like(answers, MAX_LENGTH))  # answer + fillers + stop
        return answers, lengths, stopped

    def token_logprobs(self, questions, answers, lengths, stopped) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token log-probs [N, MAX_LENGTH] (differentiable) and the completion mask [N, MAX_LENGTH]."""
        position = torch.arange(MAX_LENGTH)[None, :]  # [1, L]
        mask = (position < lengths[:, None]).float()  # [N, L]
        is_stop = (position == (lengths[:, None] - 1)) & stopped[:, None]  # [N, L]: the last token, if it is a stop
        answer_logp = torch.log_softmax(self.answer_logits[questions], dim=-1).gather(1, answers[:, None])  # [N, 1]
        stop_logit = self.stop_logits[questions, answers][:, None]  # [N, 1]
        after_answer = torch.where(is_stop, torch.nn.functional.logsigmoid(stop_logit), torch.nn.functional.logsigmoid(-stop_logit))
        logp = torch.where(position == 0, answer_logp, after_answer)  # [N, L]
        return logp, mask

    @torch.no_grad()
    def expected_statistics(self) -> dict[str, float]:
        """Exact accuracy and mean lengths of right / wrong answers under the policy (questions uniform)."""
        answer_probs = torch.softmax(self.answer_logits, dim=-1).double()  # [Q, 4]
        stop_prob = torch.sigmoid(self.stop_logits).double()  # [Q, 4]
        # Length is 1 + min(K, MAX_LENGTH - 1) with K ~ Geometric(stop_prob) on {1, 2, ...}:
        # E[min(K, m)] = sum_{j=0}^{m-1} P(K > j) = (1 - (1-p)^m) / p.
        m = MAX_LENGTH - 1
        expected_length = 1 + (1 - (1 - stop_prob) ** m) / stop_prob  # [Q, 4]
        right = torch.zeros_like(answer_probs, dtype=torch.bool)
        right[torch.arange(NUM_QUESTIONS), right_answers()] = True
        right_mass, wrong_mass = answer_probs[right], answer_probs[~right]
        return {
            "accuracy": float(right_mass.mean()),
            "right_length": float((right_mass * expected_length[right]).sum() / right_mass.sum()),
            "wrong_length": float((wrong_mass * expected_length[~right]).sum() / wrong_mass.sum()),
        }


def right_answers() -> torch.Tensor:
    return torch.arange(NUM_QUESTIONS) % NUM_ANSWERS


def train(loss_type: str, steps: int, seed: int) -> dict[int, dict[str, float]]:
    """Train one toy policy with `loss_type`; returns the policy's statistics after each step's update."""
    scale_rewards, step_size = RECIPES[loss_type]
    torch.manual_seed(seed)
    generator = torch.Generator().manual_seed(seed)
    policy = ToyPolicy()
    optimizer = torch.optim.SGD(policy.parameters(), lr=step_size)
    questions = torch.arange(NUM_QUESTIONS).repeat_interleave(GROUP_SIZE)  # [64], groups contiguous
    history = {}
    for step in range(1, steps + 1):
        answers, lengths, stopped = policy.sample(questions, generator)
        rewards = (answers == right_answers()[questions]).float()  # [64]
        advantages, _ = group_advantages(rewards, GROUP_SIZE, scale_rewards)
        logp, mask = policy.token_logprobs(questions, answers, lengths, stopped)
        variant = loss_variant(loss_type)
        options = variant.options.model_construct(epsilon_low=0.2, epsilon_high=0.2, delta=None)
        per_token, _ = per_token_loss(
            variant, options, logp, logp.detach(), advantages[:, None].expand_as(logp), mask
        )
        loss = aggregate(
            per_token,
            mask,
            loss_type,
            total_sequences=len(questions),
            total_tokens=float(mask.sum()),
            max_completion_length=MAX_LENGTH,
            total_micro_batches=1,
        )
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        history[step] = policy.expected_statistics()
    return history


def run(steps: int, seeds: int) -> dict[str, dict[int, dict[str, float]]]:
    """Per loss type, the statistics after every step, averaged over seeds: {loss_type: {step: stats}}."""
    curves = {}
    for loss_type in RECIPES:
        runs = [train(loss_type, steps, seed) for seed in range(seeds)]
        curves[loss_type] = {
            step: {key: sum(r[step][key] for r in runs) / seeds for key in runs[0][step]} for step in runs[0]
        }
    return curves


def checkpoint_table(curves: dict, steps: int) -> dict[str, dict[str, dict[str, float]]]:
    """The documented table (and JSON): CHECKPOINTS up to `steps`, plus the final step; step keys are strings."""
    report_at = sorted({s for s in CHECKPOINTS if s <= steps} | {steps})
    return {loss_type: {str(s): curve[s] for s in report_at} for loss_type, curve in curves.items()}


def format_table(results: dict) -> str:
    header = "| step | " + " | ".join(f"{t} accuracy | {t} right len | {t} wrong len" for t in results) + " |"
    lines = [header, "|" + "---|" * (1 + 3 * len(results))]
    for step in next(iter(results.values())):
        cells = []
        for stats in results.values():
            s = stats[step]
            cells += [f"{s['accuracy']:.2f}", f"{s['right_length']:.1f}", f"{s['wrong_length']:.1f}"]
        lines.append(f"| {step} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def plot(curves: dict, path: Path) -> None:
    import matplotlib  # optional dependency (extra `plot`): imported only when a plot is asked for

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_len, ax_acc) = plt.subplots(1, 2, figsize=(10, 4))
    for loss_type, color in zip(curves, ("tab:red", "tab:blue")):
        steps = list(curves[loss_type])
        rows = list(curves[loss_type].values())
        ax_len.plot(steps, [r["right_length"] for r in rows], color=color, label=f"{loss_type}: right answers")
        ax_len.plot(steps, [r["wrong_length"] for r in rows], color=color, ls="--", label=f"{loss_type}: wrong answers")
        ax_acc.plot(steps, [r["accuracy"] for r in rows], color=color, label=loss_type)
    ax_len.set(xlabel="step", ylabel="mean length (tokens)", title="Length of right and wrong answers", ylim=(0, 20))
    ax_acc.set(xlabel="step", ylabel="accuracy", title="Accuracy", ylim=(0, 1.02))
    ax_len.legend(fontsize=8, loc="upper center", ncol=2)  # the empty band above the curves
    ax_acc.legend(fontsize=8)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=400, help="training steps per run (default 400)")
    parser.add_argument("--seeds", type=int, default=5, help="seeds averaged per loss type (default 5)")
    parser.add_argument("--plot", default="outputs/length_bias.png", help="PNG to write ('' for none)")
    parser.add_argument("--json", default="", help="write the table as JSON here")
    args = parser.parse_args(argv)
    if args.steps < 1 or args.seeds < 1:
        parser.error("--steps and --seeds must be at least 1")

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tensors of a few hundred numbers: threads only add overhead and contention
    started = time.perf_counter()
    try:
        curves = run(args.steps, args.seeds)
    finally:
        torch.set_num_threads(threads)  # main() is also called from tests: leave the process as found
    print(f"length bias, {args.seeds} seeds x {args.steps} steps, {time.perf_counter() - started:.1f} s")
    results = checkpoint_table(curves, args.steps)
    print(format_table(results))
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(results, indent=2))
    if args.plot:
        plot(curves, Path(args.plot))
        print(f"plot: {args.plot}")
    return results


if __name__ == "__main__":
    main()
