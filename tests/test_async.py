"""Asynchronous rollouts (rollout.max_staleness, rollout_queue.py) and the off-policy guards, without vLLM.

The loss pieces against hand-derived numbers; the schedule with a stand-in server engine driven the way the loop
drives it (take -> update -> after_update), on one rank and on two (threads). The real vLLM server, killed and
restarted, is tests/test_async_vllm.py.
"""

from __future__ import annotations

import logging
import threading
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from grpo_trainer.collect import CollectSettings, Sources, collect
from grpo_trainer.config import load_config
from grpo_trainer.data import PromptSampler
from grpo_trainer.errors import ConfigError, TrainingError
from grpo_trainer.losses import importance_weight, off_policy_sequence_mask
from grpo_trainer.metrics import PhaseTimer
from grpo_trainer.rewards import Reward, RewardBatch
from grpo_trainer.rollout import Reconnects, Rollout, ServerGone, ServerUnreachable, WeightsLost
from grpo_trainer.rollout_queue import ServerLostError
from grpo_trainer.geometry import batch_geometry
from helpers import Exchange, ThreadCollectives, rollout_queue, run_ranks
from test_phases import PAD, accelerator_factory, four_completions, toy_run  # noqa: F401 (a fixture)

P, G = 2, 2  # prompts per step, completions per prompt
WAIT = 30  # seconds an event may take before a test fails (never reached when the code is right)


# ----------------------------------------------------------------------------- the off-policy guards


def test_off_policy_sequence_mask_drops_negative_advantages_that_drifted_past_the_threshold():
    """delta = 0.5; the drift is mean_t(log pi_sampler - log pi_theta) over real tokens.
    row 0: A < 0, drift ((-1+2) + (-1+2)) / 2 = 1 > 0.5             -> masked
    row 1: A > 0, the same drift 1                                    -> kept (only negative advantages)
    row 2: A < 0, drift (0.2 + 0.4) / 2 = 0.3 <= 0.5                  -> kept
    row 3: A < 0, one real token: drift 1 (the padding's -9 would make it (1 - 9) / 2 = -4, kept) -> masked
    row 4: A < 0, drift exactly 0.5: not above the threshold          -> kept"""
    sampling = torch.tensor([[-1.0, -1.0], [-1.0, -1.0], [-1.0, -1.0], [-1.0, -9.0], [-1.0, -1.0]])
    logp = torch.tensor([[-2.0, -2.0], [-2.0, -2.0], [-1.2, -1.4], [-2.0, 0.0], [-1.5, -1.5]], requires_grad=True)
    mask = torch.tensor([[1.0, 1], [1, 1], [1, 1], [1, 0], [1, 1]])
    advantages = torch.tensor([-1.0, 1.0, -1.0, -0.5, -2.0])
    keep = off_policy_sequence_mask(logp, sampling, advantages, mask, threshold=0.5)
    assert keep.shape == (5, 1) and keep[:, 0].tolist() == [0.0, 1.0, 1.0, 0.0, 1.0]
    assert not keep.requires_grad


def test_icepop_masks_tokens_whose_ratio_leaves_the_band_and_truncation_clamps_into_it():
    """Token ratios pi_old / pi_sampler = [2, 0.5, 4] and [1.5, 0.3]; the band [1/2, 2] (k = 2):
    token_mask (IcePop) keeps the ratio inside, zeroes outside: [2, 0.5, 0], [1.5, 0] (2 tokens outside);
    token_truncate clamps into the band: [2, 0.5, 2], [1.5, 0.5]. Boundaries (2 and 0.5 exactly) are inside."""
    old = torch.log(torch.tensor([[2.0, 0.5, 4.0], [1.5, 0.3, 1.0]]))
    sampling, mask = torch.zeros(2, 3), torch.tensor([[1.0, 1, 1], [1, 1, 0]])
    weight, outside = importance_weight(old, sampling, mask, cap=2.0, mode="token_mask", floor=0.5)
    torch.testing.assert_close(weight[0], torch.tensor([2.0, 0.5, 0.0]))
    torch.testing.assert_close(weight[1, :2], torch.tensor([1.5, 0.0]))
    assert outside.tolist() == [[False, False, True], [False, True, False]]
    weight, outside = importance_weight(old, sampling, mask, cap=2.0, mode="token_truncate", floor=0.5)
    torch.testing.assert_close(weight[0], torch.tensor([2.0, 0.5, 2.0]))
    torch.testing.assert_close(weight[1, :2], torch.tensor([1.5, 0.5]))
    # Without a floor nothing is bounded below (the existing modes, unchanged).
    weight, outside = importance_weight(old, sampling, mask, cap=2.0, mode="token_mask")
    torch.testing.assert_close(weight[1, :2], torch.tensor([1.5, 0.3]))
    assert int(outside.sum()) == 1


def test_the_off_policy_mask_takes_the_policy_gradient_of_a_masked_completion_away(accelerator_factory):
    """Two prompts x G = 2, GRPO at ratio 1, the toy policy log pi = log_softmax(w), w = linspace(-1, 1, 10).
    Advantages [1, -1, -1, 1]. Completion 1 ([7]) has sampler log-prob -0.4, far above the policy's
    log_softmax(w)[7] = -1.943: drift 1.54 > 0.5, masked. Completion 2 ([8, 9]) has A < 0 too, but its sampler
    log-probs are the policy's own: drift 0, kept. At ratio 1 a token's loss is -A, so the loss (the mean over
    N = 4 sequences of their token means) goes from (1/4)(-1 + 1 + 1 - 1) = 0 to (1/4)(-1 + 1 - 1) = -0.25, and
    the gradient loses completion 1's term, -(1/4) A_1 grad log pi(7) = (1/4)(onehot(7) - softmax(w))."""
    from grpo_trainer.batches import build_train_batch

    samples, advantages = four_completions([1.0, -1.0, -1.0, 1.0], truncated=(False,) * 4)
    results = {}
    for threshold in (None, 0.5):
        run = toy_run(accelerator_factory, [] if threshold is None else [f"loss.off_policy_mask_threshold={threshold}"])
        logp_all = run.policy.w.detach().log_softmax(-1)
        samples.sampler_logprobs[2] = [float(logp_all[8]), float(logp_all[9])]
        batch = build_train_batch(samples, advantages, PAD, micro_batch_size=4, mask_truncated=False,
                                  skip_zero_advantage=False)
        mb = batch.micro_batches[0]
        logp, _ = run.policy(**mb.sequences)
        share, parts = run.loss(batch, mb, logp)
        share.backward()
        results[threshold] = (float(share.detach()), parts, run.policy.w.grad.clone())
    w = torch.linspace(-1, 1, 10)
    assert float(w.log_softmax(-1)[7]) == pytest.approx(-1.943, abs=1e-3)
    assert results[None][0] == pytest.approx(0.0, abs=1e-7) and results[0.5][0] == pytest.approx(-0.25)
    expected = (torch.nn.functional.one_hot(torch.tensor(7), 10).float() - w.softmax(-1)) / 4
    torch.testing.assert_close(results[None][2] - results[0.5][2], expected, atol=1e-6, rtol=0)
    assert float(results[0.5][1]["off_policy_masked"]) == 1.0 and "off_policy_masked" not in results[None][1]


def test_async_settings_are_checked_when_the_config_loads():
    load_config(None, ["rollout.engine=vllm_server", "rollout.max_staleness=2", "loss.tis_cap=2"])
    for engine in ("hf", "vllm_colocate"):
        with pytest.raises(ConfigError, match=f"rollout.max_staleness 1 needs rollout.engine vllm_server: the {engine}"):
            load_config(None, [f"rollout.engine={engine}", "rollout.max_staleness=1"])
    # every kind of environment plays in the queue's thread (a checkpoint saves its batches with what the rewards get)
    for env in ("environment.tools=[python]", "environment.factory=configs/guess_number_env.py:GuessNumber",
                "environment.url=openenv+ws://h:1", "environment.openenv=tests/openenv_envs.py:GuessEnv"):
        assert load_config(None, ["rollout.engine=vllm_server", "rollout.max_staleness=1", env])
    with pytest.raises(ConfigError, match="loss.tis_min"):
        load_config(None, ["loss.tis_min=0.5"])  # a lower bound needs the upper one
    with pytest.raises(ConfigError, match="loss.tis_min"):
        load_config(None, ["loss.tis_min=3", "loss.tis_cap=2"])
    with pytest.raises(ConfigError, match="off_policy_mask_threshold"):
        load_config(None, ["loss.off_policy_mask_threshold=-1"])
    # Legal but rarely meant: the lag left uncorrected is a warning (validate prints it, train logs it).
    from grpo_trainer.preflight import preflight

    uncorrected = load_config(None, ["rollout.engine=vllm_server", "rollout.max_staleness=1", "loss.tis_cap=null"])
    assert any("rollout.max_staleness 1 without loss.tis_cap" in w for w in preflight(uncorrected))
    for corrected in (["loss.tis_cap=2"], []):  # set, or the default (`auto` is on for vllm_server)
        assert not any("tis_cap" in w for w in preflight(load_config(None, ["rollout.engine=vllm_server",
                                                                             "rollout.max_staleness=1", *corrected])))


# ----------------------------------------------------------------------------- the schedule


URL = "http://127.0.0.1:1"


class FakeServer(Reconnects):
    """A server engine stand-in: completion k of prompt p is [p, k]; it records, per generate call, the prompts,
    the version it held and the thread; a push sets its version and fails the test if a generation is running.
    `gate(call)` (optional) runs inside generate, e.g. to block until the test lets it go. Its server never comes
    back once gone (`reconnect`)."""

    def __init__(self, gate=None, fail=None, fail_push=None):
        self.version, self.running, self.calls, self.pushes, self.gathers = 0, 0, [], [], []
        self.fail_push = dict(fail_push or {})  # {version: exception raised by (only) the first push of it}
        self.gate, self.fail = gate, fail or {}  # fail: {call index: exception raised by that generate}
        self.lock = threading.Lock()

    def generate(self, prompt_ids, num_generations, seeds=None, episodes=None):
        with self.lock:
            self.running += 1
            call = len(self.calls)
            self.calls.append(([ids[0] for ids in prompt_ids], self.version, threading.current_thread().name))
        try:
            if self.gate is not None:
                self.gate(call)
            if call in self.fail:
                raise self.fail[call]
            ids = [[p, k] for p, *_ in prompt_ids for k in range(num_generations)]
            return Rollout(ids, [False] * len(ids), sampling_logprobs=[[-1.0, -1.0]] * len(ids))
        finally:
            with self.lock:
                self.running -= 1

    def sync_weights(self, model, version=None, gather=None):
        assert self.running == 0, "a push overlapped a generation"
        self.gathers.append(gather)
        if version in self.fail_push:
            raise self.fail_push.pop(version)
        self.version = version
        self.pushes.append(version)

    def reconnect(self, timeout):
        self.reconnects = [*getattr(self, "reconnects", []), timeout]
        return False

    def close(self):
        pass


def server_run(k: int, steps: int, engine=None, comm=None, overrides=(), task=None):
    comm = comm or ThreadCollectives(Exchange(1), 0)
    cfg = load_config(None, [f"train.prompts_per_step={P * comm.world}", f"rollout.num_generations={G}",
                             "train.micro_batch_size=2", "rollout.engine=vllm_server", f"rollout.max_staleness={k}",
                             f"train.max_steps={steps}", "rollout.vllm_server.reconnect_timeout=1", *overrides])
    run = SimpleNamespace(
        cfg=cfg, geometry=batch_geometry(cfg, comm.world, comm.rank), comm=comm, engine=engine or FakeServer(),
        task=task or SimpleNamespace(prompt_ids=lambda indices: [[i] for i in indices]),
        sampler=PromptSampler(size=1000, seed=0, shuffle=False), bare_lm=lambda: nn.Linear(1, 1),
        accelerator=SimpleNamespace(state=SimpleNamespace()),
    )
    run.rollouts = rollout_queue(run)
    return run


def drive(run, first: int = 1, train=lambda step: None, stop_after: int | None = None) -> list[tuple[list[int], Rollout, dict]]:
    """The loop's calls, as trainer.train makes them: start, then take -> (update) -> after_update per step."""
    queue, out = run.rollouts, []
    queue.start(first - 1)
    for step in range(first, (stop_after or run.cfg.train.max_steps) + 1):
        mine, rollout = queue.take(step)
        train(step)
        queue.after_update(step)
        out.append((mine, rollout, queue.step_metrics()))
    queue.close()
    return out


def stopped_and_resumed(run, folder) -> list[tuple[list[int], Rollout, dict]]:
    """What a K = 1 run (`run()` makes one) trains when stopped after step 2, its checkpoint (in `folder`) holding
    batch 3's completions, and resumed from it: steps 1-2, then the resumed steps, to compare with a straight run."""
    stopped = run()
    first = drive(stopped, stop_after=2)
    held = stopped.rollouts.settle_for_checkpoint()
    assert held == [3]
    stopped.rollouts.save_rollouts(folder)
    resumed = run()
    resumed.sampler.load_state_dict(stopped.sampler.state_dict())
    resumed.rollouts.load_state_dict({**stopped.rollouts.state_dict(), "sampled": held}, step=2, folder=folder)
    return first + drive(resumed, first=3)


def batch_prompts(step: int) -> list[int]:
    return list(range((step - 1) * P, step * P))


@pytest.mark.parametrize("k", [1, 2])
def test_batch_t_is_sampled_with_the_weights_of_step_t_minus_k_minus_1(k):
    steps = 6
    run = server_run(k, steps)
    out = drive(run)
    engine = run.engine
    # The server sampled batch t holding version max(0, t-K-1), in a background thread, in step order.
    assert [(prompts, version) for prompts, version, _ in engine.calls] == [
        (batch_prompts(t), max(0, t - k - 1)) for t in range(1, steps + 1)]
    assert {thread for *_, thread in engine.calls} == {"grpo-rollouts"}
    assert engine.pushes == list(range(0, steps + 1))  # the initial weights, then one push per step
    for step, (mine, rollout, metrics) in enumerate(out, start=1):
        assert mine == batch_prompts(step)
        assert rollout.weight_versions == [max(0, step - k - 1)] * (P * G)  # stamped with what the server held
        assert metrics["rollout/staleness_max"] == metrics["rollout/staleness_mean"] == min(step - 1, k)
        assert metrics["rollout/stale_resampled"] == 0
        assert metrics["timing/rollout_wait"] >= 0 and metrics["timing/server_idle"] >= 0


def test_k0_samples_on_the_main_thread_when_the_step_asks_as_the_synchronous_loop_did():
    run = server_run(0, 3)
    out = drive(run)
    assert [(prompts, version, thread) for prompts, version, thread in run.engine.calls] == [
        (batch_prompts(t), t - 1, "MainThread") for t in (1, 2, 3)]
    assert run.engine.pushes == [0, 1, 2, 3]
    assert all("rollout/staleness_mean" not in metrics for *_, metrics in out)  # no staleness to speak of


def test_the_server_samples_the_next_batch_while_the_trainer_updates():
    """K = 1: during step t's update the server is generating batch t+1. The generation of batch t+1 blocks until
    the test's update of step t releases it; if the queue sampled only when asked, it would wait forever."""
    started = {t: threading.Event() for t in range(1, 6)}
    release = {t: threading.Event() for t in range(1, 6)}

    def gate(call):  # call c generates batch c + 1
        started[call + 1].set()
        if call + 1 >= 2:
            assert release[call + 1].wait(WAIT), f"batch {call + 1} was not released by step {call}'s update"

    def train(step):
        if step + 1 <= 4:
            assert started[step + 1].wait(WAIT), f"batch {step + 1} was not being sampled during step {step}'s update"
            release[step + 1].set()

    run = server_run(1, 4, engine=FakeServer(gate=gate))
    drive(run, train=train)
    assert len(run.engine.calls) == 4


def test_completions_older_than_k_are_left_out_counted_and_sampled_again(caplog):
    """K = 1, 4 steps. Batch 4 is queued after step 2's push; the queue is made to stamp it as sampled by version
    0 (as after a push that never reached the sampler). At step 4 (trainer version 3) it is 3 versions old: left out, counted,
    and its prompts sampled again with the current weights (version 3)."""
    run = server_run(1, 4)
    queue = run.rollouts
    real_refill = queue._refill

    def refill(current):
        if current == 2:
            queue.version = 0
        real_refill(current)
        queue.version = current

    queue._refill = refill
    with caplog.at_level(logging.WARNING, logger="grpo_trainer"):
        out = drive(run)
    mine, rollout, metrics = out[3]
    assert mine == batch_prompts(4) and rollout.weight_versions == [3] * (P * G)
    assert [c for c, *_ in rollout.completion_ids] == [p for p in batch_prompts(4) for _ in range(G)]
    assert metrics["rollout/stale_resampled"] == P and metrics["rollout/staleness_max"] == 0
    assert "sampled by weights 3 versions old (rollout.max_staleness=1): left out and sampled again" in caplog.text
    assert [m["rollout/staleness_max"] for *_, m in out[:3]] == [0, 1, 1]
    assert run.engine.calls[-1][2] == "MainThread"  # sampled again at once, on the main thread


def test_a_server_that_lost_its_weights_gets_them_again_and_every_untrained_batch_is_resampled(caplog):
    """K = 1, 5 steps. The server restarts while sampling batch 3 (generate call 2 raises WeightsLost): at the
    meeting before step 2's push the queue pushes version 2 again and samples batch 3 again with it; batches
    are never trained twice or skipped."""
    step2 = threading.Event()  # the failure surfaces during step 2's update (a fixed meeting point for the test)
    engine = FakeServer(gate=lambda call: call != 2 or step2.wait(WAIT), fail={2: WeightsLost([URL], 1)})
    run = server_run(1, 5, engine=engine)
    with caplog.at_level(logging.WARNING, logger="grpo_trainer"):
        out = drive(run, train=lambda step: step == 2 and step2.set())
    assert [mine for mine, *_ in out] == [batch_prompts(t) for t in range(1, 6)]
    assert "the rollout server lost its weights (restarted?): pushing version 2 again" in caplog.text
    calls = [(prompts, version) for prompts, version, _ in run.engine.calls]
    assert calls == [(batch_prompts(1), 0), (batch_prompts(2), 0), (batch_prompts(3), 1),  # this one failed
                     (batch_prompts(3), 2), (batch_prompts(4), 2), (batch_prompts(5), 3)]
    assert run.engine.pushes == [0, 1, 2, 3, 4, 5]  # the recovery's push is step 2's push
    assert [m["rollout/staleness_max"] for *_, m in out] == [0, 1, 0, 1, 1]


def test_with_k2_the_batches_queued_behind_a_lost_one_are_sampled_again_not_failed():
    """K = 2, 5 steps: batches 1-3 are queued with the initial weights; batch 2's generation raises WeightsLost, so
    batch 3, queued behind it, is not sent (the server is in an unknown state) but marked lost too. At the meeting
    before step 1's push, version 1 is pushed again and batches 2-4 are sampled with it. (The skipped batch once
    raised a TypeError, which stopped the run as if the server were gone for good.)"""
    step1 = threading.Event()  # the failure surfaces during step 1's update (a fixed meeting point for the test)
    engine = FakeServer(gate=lambda call: call != 1 or step1.wait(WAIT), fail={1: WeightsLost([URL], 0)})
    run = server_run(2, 5, engine=engine)
    out = drive(run, train=lambda step: step == 1 and step1.set())
    assert [mine for mine, *_ in out] == [batch_prompts(t) for t in range(1, 6)]
    assert [(prompts, version) for prompts, version, _ in run.engine.calls] == [
        (batch_prompts(1), 0), (batch_prompts(2), 0),  # this one failed; batch 3 was never sent
        (batch_prompts(2), 1), (batch_prompts(3), 1), (batch_prompts(4), 1), (batch_prompts(5), 2)]
    assert run.engine.pushes == [0, 1, 2, 3, 4, 5]
    assert [m["rollout/staleness_max"] for *_, m in out] == [0, 0, 1, 2, 2]


@pytest.mark.parametrize("gone", ["while sampling", "between calls"])
def test_a_server_that_never_comes_back_stops_every_rank_with_one_line_naming_it(gone):
    """Two ranks; rank 1's generation of batch 2 finds the server gone and it does not come back within
    rollout.vllm_server.reconnect_timeout: both ranks stop with ServerLostError, rank 1's naming the URL. The
    engine waits itself for a server that went away mid-request (and raises ServerUnreachable); one found gone
    before a request (ServerGone, e.g. at its weight-version check) is waited for by the queue."""
    error = (ServerUnreachable(f"vLLM server at {URL} went away and did not come back within 1s") if gone == "while sampling"
             else ServerGone(URL, f"vLLM server at {URL} went away during GET /weight_info: connection refused"))

    def rank(r, comm):
        engine = FakeServer(fail={1: error} if r else {})
        run = server_run(1, 4, engine=engine, comm=comm)
        with pytest.raises(ServerLostError) as info:
            drive(run)
        return str(info.value)

    messages = run_ranks(2, rank)
    assert URL in messages[1] and "did not come back within 1s" in messages[1] and "\n" not in messages[1]
    assert "the last checkpoint in" in messages[1] and "is intact" in messages[1]
    assert "another rank's rollouts failed" in messages[0]


def test_one_ranks_lost_weights_resample_every_ranks_batches():
    """Two ranks share a server; only rank 0 sees the restart (its generate of batch 2 raises WeightsLost). Rank
    1's batch 2 finished without error, yet may have been sampled after the restart: both ranks sample again."""
    def rank(r, comm):
        step1 = threading.Event()  # rank 0's failure surfaces during step 1's update
        engine = FakeServer(gate=lambda call: call != 1 or step1.wait(WAIT), fail={1: WeightsLost([URL], 0)} if r == 0 else {})
        run = server_run(1, 3, engine=engine, comm=comm)
        out = drive(run, train=lambda step: step == 1 and step1.set())
        return [mine for mine, *_ in out], [(prompts, version) for prompts, version, _ in engine.calls]

    (mine0, calls0), (mine1, calls1) = run_ranks(2, rank)
    assert mine0 == [[0, 1], [4, 5], [8, 9]] and mine1 == [[2, 3], [6, 7], [10, 11]]
    assert [version for _, version in calls0] == [0, 0, 1, 1] == [version for _, version in calls1]
    assert calls1[2][0] == [6, 7]  # rank 1's batch 2, sampled again after the push


def test_every_rank_pushes_with_the_piecewise_zero3_gather_and_a_push_that_failed_is_made_again_by_all(monkeypatch, caplog):
    """Under ZeRO-3 every rank calls engine.sync_weights(model, version=step, gather=weight_sync.zero3_gather(...)):
    the engine gathers one decoder layer at a time, every rank in the same gathers (test_vllm_weights.py checks
    that with DeepSpeed), and nothing gathers the whole model first. A push the engine could not finish
    (WeightsLost: a server restarted under a ZeRO-3 push) is made again by every rank; any other error stops
    every rank, the failing one with its own error."""
    import grpo_trainer.rollout_queue as rollout_queue

    gather = object()  # stands for DeepSpeed's GatheredParameters factory
    monkeypatch.setattr(rollout_queue, "zero3_gather", lambda accelerator: gather)
    monkeypatch.setattr(rollout_queue, "distributed", None, raising=False)  # nothing may gather the whole model

    def rank(r, comm, fail_push):
        engine = FakeServer(fail_push=fail_push if r == 0 else {})
        drive(server_run(1, 3, engine=engine, comm=comm))
        return engine.pushes, engine.gathers

    with caplog.at_level(logging.WARNING, logger="grpo_trainer"):
        (pushes0, gathers0), (pushes1, gathers1) = run_ranks(2, lambda r, comm: rank(r, comm, {2: WeightsLost([URL], 1)}))
    assert pushes0 == [0, 1, 2, 3] and pushes1 == [0, 1, 2, 2, 3]  # rank 0's first push of 2 failed: both again
    assert gathers0 == gathers1 == [gather] * 5
    assert "pushing weights version 2: " in caplog.text and "pushing again" in caplog.text

    def failing(r, comm):
        with pytest.raises((RuntimeError, ServerLostError)) as info:
            rank(r, comm, {1: RuntimeError("HTTP 500 from /update_weights")})
        return info.value

    errors = run_ranks(2, failing)
    assert type(errors[0]) is RuntimeError and "HTTP 500" in str(errors[0])
    assert isinstance(errors[1], ServerLostError) and "failed on the main process" in str(errors[1])


@pytest.mark.parametrize("k", [1, 2])
def test_a_checkpoint_records_the_batches_in_flight_and_a_resumed_queue_trains_them_once(k):
    """Stopped after step 3 of 6 (a preemption): batches 4 .. 4+K are drawn and not trained (sampled, or being
    sampled); the state names their prompts. A new queue loaded from it, after the sampler's state, samples them
    first with the resumed weights (version 3) and trains exactly the prompts of an uninterrupted run."""
    straight = [mine for mine, *_ in drive(server_run(k, 6))]
    run = server_run(k, 6)
    first = [mine for mine, *_ in drive(run, stop_after=3)]
    state = run.rollouts.state_dict()
    assert state == {"pending": [batch_prompts(t) for t in range(4, min(4 + k, 6) + 1)]}
    resumed = server_run(k, 6)
    resumed.sampler.load_state_dict(run.sampler.state_dict())
    resumed.rollouts.load_state_dict(state, step=3)
    second = [mine for mine, *_ in drive(resumed, first=4)]
    assert first + second == straight
    assert [version for _, version, _ in resumed.engine.calls[: len(state["pending"])]] == [3] * len(state["pending"])


@pytest.mark.parametrize("k", [1, 2])
def test_a_checkpoint_holding_the_sampled_batches_resumes_into_the_uninterrupted_run(k, tmp_path):
    """Stopped after step 3 of 6: batches 4 .. 4+K are drawn and not trained. Those sampled with weights older than
    the checkpoint's (4 .. 3+K, sampled before the last push) are saved, each rank its share, without waiting for
    anything; the one being sampled with the checkpoint's own weights (4+K) is not. A queue loaded from it trains the
    saved ones as they are (the versions that sampled them included: an uninterrupted run's), samples only 4+K again
    (with version 3, as the uninterrupted run did), and goes on as the uninterrupted run: the same prompts,
    completions and versions at every step."""
    straight = drive(server_run(k, 6))
    run = server_run(k, 6)
    first = drive(run, stop_after=3)
    held = run.rollouts.settle_for_checkpoint()
    assert held == list(range(4, 4 + k))
    run.rollouts.save_rollouts(tmp_path)
    state = {**run.rollouts.state_dict(), "sampled": held}
    resumed = server_run(k, 6)
    resumed.sampler.load_state_dict(run.sampler.state_dict())
    resumed.rollouts.load_state_dict(state, step=3, folder=tmp_path)
    second = drive(resumed, first=4)

    def seen(steps):
        return [(mine, rollout.completion_ids, rollout.weight_versions) for mine, rollout, _ in steps]

    assert seen(first + second) == seen(straight)
    prompts, version, _ = resumed.engine.calls[0]
    assert prompts == batch_prompts(4 + k) and version == 3  # the only pending batch sampled again, as before
    assert not {p for call, *_ in resumed.engine.calls for p in call} & {p for t in held for p in batch_prompts(t)}
    # a checkpoint that says it holds them, without the file, is refused in one line
    with pytest.raises(TrainingError, match="has no rollouts_rank0.pkl"):
        server_run(k, 6).rollouts.load_state_dict(state, step=3, folder=tmp_path / "elsewhere")
    # another number of processes (force_resume): no folder, every pending batch sampled again
    other = server_run(k, 6)
    other.rollouts.load_state_dict(state, step=3, folder=None)
    assert all(batch.future is None for batch in other.rollouts.pending)


class ToolCallingServer(FakeServer):
    """A FakeServer whose completions call the `add` tool, then answer once they see its result: the tools loop."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tokenizer = tokenizer

    def generate(self, prompt_ids, num_generations, seeds=None, max_tokens=None, episodes=None):
        from test_tools import add_call

        with self.lock:
            self.running += 1
            self.calls.append(([ids[0] for ids in prompt_ids], self.version, threading.current_thread().name))
        try:
            texts = ["A3<|im_end|>" if "<|im_start|>tool" in self.tokenizer.decode(c) else add_call(1, 2)
                     for c in prompt_ids for _ in range(num_generations)]
            ids = [self.tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
            return Rollout(ids, [False] * len(ids), sampling_logprobs=[[-1.0] * len(t) for t in ids])
        finally:
            with self.lock:
                self.running -= 1


def test_tools_play_in_the_queues_thread_and_a_checkpoint_holds_their_conversations(tiny_model_path, tmp_path):
    """environment.tools under K = 1: each batch's tool-calling episodes (a call to `add`, its result, an answer) are
    played by the queue's background thread while the trainer updates; a checkpoint after step 2 holds batch 3's
    conversations (plain data), and the resumed queue trains them as the uninterrupted one does."""
    from grpo_trainer.config import ModelConfig
    from grpo_trainer.environments.tools import Tool, ToolBox
    from grpo_trainer.models import load_tokenizer
    from test_tools import tools_loop

    tokenizer = load_tokenizer(ModelConfig())

    def run(steps: int):
        box = ToolBox([Tool("add", {}, lambda a, b: str(a + b))], timeout=5, output_chars=100)
        server = ToolCallingServer(tokenizer)
        r = server_run(1, 4, engine=tools_loop(server, box, tokenizer, 200, 2))
        r.task = SimpleNamespace(prompt_ids=lambda indices: [tokenizer("<|im_start|>user\nq<|im_end|>\n")["input_ids"]
                                                             for _ in indices])
        r.rollouts = rollout_queue(r)
        return r, server

    def seen(steps):
        return [(mine, rollout.completion_ids, rollout.tool_calls, rollout.conversations) for mine, rollout, _ in steps]

    straight_run, server = run(4)
    straight = drive(straight_run)
    assert all(rollout.tool_calls == [1] * (P * G) for _, rollout, _ in straight)
    assert straight[0][1].conversations[0][1] == {"role": "tool", "name": "add", "content": "3"}
    assert {thread for *_, thread in server.calls[2:]} == {"grpo-rollouts"}  # after the first batch: the queue's thread
    assert seen(stopped_and_resumed(lambda: run(4)[0], tmp_path)) == seen(straight)


def test_class_environment_episodes_play_in_the_queues_thread_and_resume_with_their_objects(tiny_model_path, tmp_path,
                                                                                            caplog):
    """environment.factory under K = 1 (test_environments' Guess, played by its scripted model): each batch's
    episodes (a tool call, a plain reply, the environment's answer) play in the queue's background thread; a
    checkpoint after step 2 holds batch 3 with its environment objects (what the reward functions get), and the
    resumed queue trains the uninterrupted run's episodes, objects and all. An object that does not pickle leaves
    its batch to be played again (logged), and so does one whose pickling, or unpickling on resume, hangs past
    environment.step_timeout."""
    from test_environments import END, Guess, _engine, _prompt, _spec

    tokenizer = _tokenizer_for_envs()
    call = '<tool_call>{"name": "above", "arguments": {"n": 2}}</tool_call>'
    scripts = {"a": [call + END, "1" + END, "3" + END, "never"]}

    def run(factory=Guess):
        engine, _ = _engine(tokenizer, scripts, factory=factory)
        r = server_run(1, 4, engine=engine, overrides=["environment.step_timeout=0.5"])
        r.task = SimpleNamespace(prompt_ids=lambda indices: [_prompt(tokenizer, "a") for _ in indices],
                                 episode_spec=lambda index, seed, episode_id: _spec(tokenizer, "a", seed=seed))
        r.rollouts = rollout_queue(r)
        return r

    def seen(steps):
        return [(mine, r.completion_ids, [e.ended_by for e in r.episodes], [vars(o) for o in r.environments])
                for mine, r, _ in steps]

    straight = drive(run())
    assert all(isinstance(o, Guess) for _, r, _ in straight for o in r.environments)
    assert seen(stopped_and_resumed(run, tmp_path)) == seen(straight)

    class Unpicklable(Guess):
        def reset(self, seed, **row):
            self.lock = threading.Lock()  # an object holding what pickle cannot take
            return super().reset(seed, **row)

    stopped = run(Unpicklable)
    drive(stopped, stop_after=2)
    assert stopped.rollouts.settle_for_checkpoint() == []  # nothing held: batch 3 is played again on resume

    released = threading.Event()

    class HangsWhenSaved(Guess):
        def __getstate__(self):  # user code the checkpoint runs: within environment.step_timeout
            released.wait(60)
            return vars(self)

    stopped = run(HangsWhenSaved)
    drive(stopped, stop_after=2)
    with caplog.at_level(logging.WARNING, logger="grpo_trainer"):
        assert stopped.rollouts.settle_for_checkpoint() == []
    released.set()
    assert "batch 3's completions cannot be saved (not done within environment.step_timeout (0.5 s))" in caplog.text

    from test_environments import GuessSlowToLoad  # module-level: it pickles; its __setstate__ waits

    stopped = run(GuessSlowToLoad)
    drive(stopped, stop_after=2)
    assert stopped.rollouts.settle_for_checkpoint() == [3]
    stopped.rollouts.save_rollouts(tmp_path)
    resumed = run(GuessSlowToLoad)
    resumed.sampler.load_state_dict(stopped.sampler.state_dict())
    with caplog.at_level(logging.WARNING, logger="grpo_trainer"):
        resumed.rollouts.load_state_dict({**stopped.rollouts.state_dict(), "sampled": [3]}, step=2, folder=tmp_path)
    GuessSlowToLoad.loading.set()
    assert "batch 3's saved completions cannot be loaded (not done within environment.step_timeout (0.5 s)): " \
        "sampled again" in caplog.text
    assert [(b.step, b.future) for b in resumed.rollouts.pending] == [(3, None), (4, None)]  # both played now
    [(mine, again, _), _] = drive(resumed, first=3)
    assert [e.ended_by for e in again.episodes] == [e.ended_by for e in straight[2][1].episodes]


def _tokenizer_for_envs():
    from grpo_trainer.config import ModelConfig
    from grpo_trainer.models import load_tokenizer

    return load_tokenizer(ModelConfig())


# ----------------------------------------------------------------------------- collect, with the queue


class ParityTask:
    """Prompt p's completion k scores k % 2 when p % 3 == 0, else 1 (a degenerate group)."""

    rewards = [Reward(name="x", fn=lambda **_: None)]

    def prompt_ids(self, indices):
        return [[i] for i in indices]

    def score(self, prompt_rows, rollout):
        total = torch.tensor([float(k % 2) if p % 3 == 0 else 1.0 for p, k in rollout.completion_ids])
        return RewardBatch(per_function=total[:, None], total=total, metrics={})


def test_dynamic_sampling_with_k1_samples_its_extra_rounds_now_with_the_current_weights():
    """P = 2 per step, G = 2; only prompts divisible by 3 are informative. Step 1's queued batch [0, 1] keeps
    prompt 0; the extra round [4, 5] (drawn after batch 2 = [2, 3] was queued) keeps none, [6, 7] keeps 6.
    Extra rounds run on the main thread with the trainer's weights (version 0 at step 1: staleness 0)."""
    run = server_run(1, 2, overrides=["loss.dynamic_sampling=true", "loss.max_sampling_rounds=3"], task=ParityTask())
    run.rollouts.start(0)
    sources = Sources(run.rollouts, run.task, run.comm, run.geometry, CollectSettings.of(run.cfg))
    scored = collect(sources, 1, PhaseTimer())
    assert scored.samples.prompt_indices == [0, 6]
    assert scored.sampling_stats["dynamic_sampling/extra_rounds"] == 2
    assert [(prompts, thread) for prompts, _, thread in run.engine.calls] == [
        ([0, 1], "grpo-rollouts"), ([2, 3], "grpo-rollouts"), ([4, 5], "MainThread"), ([6, 7], "MainThread")]
    assert scored.samples.weight_versions == [0] * 4
    run.rollouts.close()


def test_rollout_versions_travel_through_select_and_concat():
    rollout = Rollout([[1], [2], [3]], [False] * 3, weight_versions=[4, 5, 6])
    assert Rollout.concat([rollout.select([2]), rollout.select([0])]).weight_versions == [6, 4]


def test_gpu_check_has_the_k1_row_and_the_speed_script_explains_itself(monkeypatch, capsys):
    import sys

    from helpers import ROOT, load_script

    script = (ROOT / "scripts" / "gpu_check.sh").read_text()
    assert "check async_k1 " in script and "scripts/async_speed.py --gpu" in script
    speed = load_script("async_speed")  # in this process: the script's --help, without starting one
    monkeypatch.setattr(sys, "argv", ["async_speed.py", "--help"])
    with pytest.raises(SystemExit):
        speed.main()
    help_text = capsys.readouterr().out
    assert "--gpu" in help_text and "--server-url" in help_text and "--weight-sync" in help_text
