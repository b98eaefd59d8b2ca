"""On-policy distillation (`teacher:`, `loss.teacher_kl`, `loss.teacher_only`): the per-token advantage
A_it = A_i + coef * (log pi_teacher(y_t) - log mu(y_t)), checked against hand-derived numbers, through the
update on a toy policy and teacher, split invariance, the refusals, and one CLI run of the tiny model."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from grpo_trainer.batches import build_train_batch
from grpo_trainer.config import load_config
from grpo_trainer.errors import ConfigError
from grpo_trainer.losses import teacher_advantage
from grpo_trainer.metrics import read_metrics
from grpo_trainer.models import check_same_vocabulary
from grpo_trainer.train_state import TrainState
from grpo_trainer.terms import TermModels
from grpo_trainer.trainer import skips_zero_advantage
from helpers import run_cli, small_run_overrides
from test_phases import PAD, ToyPolicy, accelerator_factory, four_completions, toy_run  # noqa: F401 (a fixture)

TEACHER = ["teacher={name_or_path: builtin:tiny}"]


def test_the_teacher_term_by_hand():
    """coef (log pi_teacher - log mu): 0.5 x (-1.0 - -1.5) = 0.25, 0.5 x (-2.0 - -1.0) = -0.5; 0 off the mask."""
    term = teacher_advantage(torch.tensor([[-1.0, -2.0, -9.0]]), torch.tensor([[-1.5, -1.0, -0.1]]),
                             torch.tensor([[1.0, 1.0, 0.0]]), coef=0.5)
    assert term.tolist() == [[0.25, -0.5, 0.0]]


def reversed_teacher() -> ToyPolicy:
    """A toy teacher whose distribution is the policy's reversed (and sharper)."""
    teacher = ToyPolicy()
    with torch.no_grad():
        teacher.w.copy_(teacher.w.flip(0) * 2)
    return teacher


def teacher_run(accelerator_factory, overrides=()):
    """test_phases' toy update (SGD, lr 1) with the reversed toy teacher scoring for the teacher term."""
    return toy_run(accelerator_factory, [*TEACHER, "loss.teacher_kl=0.5", *overrides],
                   models=TermModels(teacher=reversed_teacher()))


def test_the_update_follows_the_per_token_advantage(accelerator_factory):
    """GRPO at ratio 1 with per-token advantages: L = -(1/N) sum_i (1/|o_i|) sum_t A_it log pi(o_it), with
    A_it = A_i + 0.5 (log pi_teacher(o_it) - mu_it), mu the sampler's log-probs that four_completions reports.
    One SGD step (lr 1) over two micro-batches is exactly w - dL/dw; the logged reverse KL is the mean of
    mu - log pi_teacher over the 10 tokens."""
    run = teacher_run(accelerator_factory)
    samples, advantages = four_completions([1.0, -0.5, 0.5, 0.0], truncated=(False,) * 4)
    batch = build_train_batch(samples, advantages, PAD, micro_batch_size=2, mask_truncated=False,
                              skip_zero_advantage=skips_zero_advantage(run.cfg))
    assert len(batch.micro_batches) == 2  # the zero-advantage completion is trained: the teacher term moves it
    (teacher,) = run.terms
    teacher_logp = teacher.teacher.w.detach().log_softmax(-1)
    w = run.policy.w.detach().clone().requires_grad_(True)
    expected_loss, kl = 0.0, 0.0
    for a, ids, mu in zip(advantages.tolist(), samples.completion_ids, samples.sampler_logprobs):
        a_t = torch.tensor([a + 0.5 * (float(teacher_logp[y]) - m) for y, m in zip(ids, mu)])
        expected_loss = expected_loss - (a_t * w.log_softmax(-1)[ids]).mean() / 4
        kl += sum(m - float(teacher_logp[y]) for y, m in zip(ids, mu))
    (grad,) = torch.autograd.grad(expected_loss, w)

    run.add_logprobs(batch)
    stats, _ = run.update(batch, TrainState(step=1))
    torch.testing.assert_close(run.policy.w.detach(), w.detach() - grad, rtol=0, atol=1e-6)
    logged = stats.metrics(10, 4, sampler_logprobs=True)
    assert logged["teacher/reverse_kl"] == pytest.approx(kl / 10, abs=1e-6)
    teacher_sizes = sum(abs(0.5 * (float(teacher_logp[y]) - m))
                        for ids, mus in zip(samples.completion_ids, samples.sampler_logprobs) for y, m in zip(ids, mus))
    group_sizes = sum(abs(a) * len(ids) for a, ids in zip(advantages.tolist(), samples.completion_ids))
    assert logged["teacher/advantage_share"] == pytest.approx(teacher_sizes / (teacher_sizes + group_sizes), abs=1e-6)


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_the_update_does_not_depend_on_micro_batches(accelerator_factory, loss_type):
    """The same batch in micro-batches of 2 and of 1 (2 and 4 accumulation steps) moves the weights alike."""
    weights = []
    for micro in (2, 1):
        run = teacher_run(accelerator_factory, [f"train.micro_batch_size={micro}", f"loss.type={loss_type}"])
        samples, advantages = four_completions([1.0, -0.5, 0.5, 0.0], truncated=(False,) * 4)
        batch = build_train_batch(samples, advantages, PAD, micro_batch_size=micro, mask_truncated=False,
                                  skip_zero_advantage=False)
        run.add_logprobs(batch)
        run.update(batch, TrainState(step=1))
        weights.append(run.policy.w.detach().clone())
        from accelerate.state import AcceleratorState, GradientState

        AcceleratorState._reset_state(True)
        GradientState._reset_state()
    torch.testing.assert_close(weights[0], weights[1], rtol=0, atol=1e-6)


def test_teacher_only_leaves_the_group_advantage_out_of_the_loss(accelerator_factory):
    """Under loss.teacher_only the group advantages reach the loss not at all: a batch with advantages +-1 has the
    loss and gradient of the same batch with advantages 0 (the teacher's term alone), and the logged size of the
    group term is 0. (The rewards are still scored and logged: they are the step's, not the loss's.)"""
    results = []
    for group in ([1.0, -1.0, 1.0, -1.0], [0.0] * 4):
        run = teacher_run(accelerator_factory, ["loss.teacher_only=true"])
        samples, advantages = four_completions(group, truncated=(False,) * 4)
        batch = build_train_batch(samples, advantages, PAD, micro_batch_size=4, mask_truncated=False,
                                  skip_zero_advantage=skips_zero_advantage(run.cfg))
        run.add_logprobs(batch)
        mb = batch.micro_batches[0]
        logp, _ = run.policy(**mb.sequences)
        share, parts = run.loss(batch, mb, logp)
        (grad,) = torch.autograd.grad(share, run.policy.w)
        results.append((float(share.detach()), grad, float(parts["group_term"]), float(parts["teacher_term"])))
    (loss, grad, group_size, teacher_size), (loss0, grad0, _, _) = results
    assert loss == loss0 and torch.equal(grad, grad0)
    assert group_size == 0.0 and teacher_size > 0
    assert not skips_zero_advantage(run.cfg)  # every completion carries the teacher's gradient


@pytest.mark.parametrize("overrides, message", [
    (["loss.teacher_kl=1.0"], "loss.teacher_kl (1.0) needs a teacher: set teacher.name_or_path"),
    (TEACHER, "teacher is set but loss.teacher_kl is 0"),
    (["loss.teacher_only=true"], "loss.teacher_only needs loss.teacher_kl > 0"),
    ([*TEACHER, "loss.teacher_kl=1.0", "loss.type=gspo"],
     "loss.teacher_kl: loss.type gspo has one ratio per sequence (sequence)"),
    ([*TEACHER, "loss.teacher_kl=1.0", "loss.type=vespo"],
     "loss.teacher_kl: loss.type vespo has one ratio per sequence (sequence_product)"),
    ([*TEACHER, "loss.teacher_kl=1.0", "loss.teacher_only=true", "loss.dynamic_sampling=true"],
     "loss.teacher_only with loss.dynamic_sampling"),
])
def test_what_cannot_work_is_refused_in_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        load_config(None, overrides)


def test_a_teacher_with_another_vocabulary_is_refused():
    def tokenizer(vocab):
        return SimpleNamespace(get_vocab=lambda: dict(vocab))

    policy = tokenizer({"a": 0, "b": 1, "c": 2})
    check_same_vocabulary(policy, tokenizer({"c": 2, "b": 1, "a": 0}), "teacher.name_or_path t")  # same mapping
    with pytest.raises(ConfigError) as error:
        check_same_vocabulary(policy, tokenizer({"a": 0, "b": 2, "c": 1, "d": 3}), "teacher.name_or_path t")
    assert str(error.value) == ("teacher.name_or_path t: its tokenizer's vocabulary differs from the policy's (3 vs 4 "
                                "tokens; 3 differ, e.g. 'b': 1 vs 2, 'c': 2 vs 1, 'd': None vs 3): a teacher must "
                                "share the policy's tokenizer")


@pytest.mark.slow
def test_pure_distillation_trains_where_the_rewards_say_nothing_and_resumes_exactly(tmp_path):
    """The tiny model (a LoRA student) taught by tiny-tools (another model with the same tokenizer), teacher_only:
    the arithmetic reward scores 0 everywhere (logged, left out of the advantage), yet the teacher's term alone
    moves the policy; it is the whole advantage, and at ratio 1 the GRPO loss of full-length completions is the
    sampled KL. 2 steps straight and 1 + 1 resumed are the same run (the teacher holds no state)."""
    from helpers import assert_same_run

    def train(out, steps, resume="never"):
        overrides = [o for o in small_run_overrides(out, steps=steps) if not o.startswith("checkpoint.resume")]
        result = run_cli(["train", "configs/demo_cpu.yaml", *overrides, "teacher={name_or_path: builtin:tiny-tools}",
                          "loss.teacher_kl=1.0", "loss.teacher_only=true", "rollout.max_completion_length=8",
                          "model.lora={r: 4, alpha: 8}", "train.learning_rate=1e-2", "checkpoint.save_every=1",
                          f"checkpoint.resume={resume}"])
        assert result.returncode == 0, result.stderr[-3000:]
        return result

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, 2)
    train(resumed, 1)
    assert "resumed from" in train(resumed, 2, resume="auto").stderr
    assert_same_run(straight, resumed)
    records = read_metrics(straight)
    for record in records:
        assert record["teacher/advantage_share"] == 1.0 and record["teacher/reverse_kl"] > 0
        assert "rewards/math_accuracy/mean" in record and record["grad_norm"] > 0
    if records[0]["completions/mean_length"] == 8:  # every completion full length: sequence mean = token mean
        assert records[0]["loss"] == pytest.approx(records[0]["teacher/reverse_kl"], rel=1e-5)
