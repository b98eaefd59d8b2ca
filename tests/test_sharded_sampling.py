"""Sharded sampling with the hf engine cannot hang (issue 24, item 4).

Under FSDP every forward all-gathers each layer's parameters: a forward is a collective, and a rank whose
completions ended early must keep calling forward while the others still decode, or they wait forever. The
engine's lockstep mode (as transformers' `synced_gpus`) is tested with ranks that are threads
(tests/helpers.py) and a model whose forward really is a collective: a barrier across the ranks.
"""

from __future__ import annotations

import torch

from grpo_trainer.config import ModelConfig
from grpo_trainer.models import load_causal_lm, load_tokenizer
from grpo_trainer.rollout import SamplingSettings
from grpo_trainer.rollout.hf import HFEngine
from helpers import Exchange, ThreadCollectives, run_ranks

QUESTIONS = ["What is 1+2?", "What is 13+4?", "What is 7+75?", "What is 100+1?", "What is 9+9?"]


def _prompts(tokenizer, questions):
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=False)
             for q in questions]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


class Rank:
    """A rank's own copy of the tiny model (the decode loop swaps a model's kernels) and engine, counting its
    forward calls; with `collective_forward`, every forward first waits for every rank's (FSDP's all-gather)
    and the engine runs in lockstep. Built before the rank threads start: transformers' `from_pretrained`
    patches global state while it loads, so two loads at once in threads can corrupt both models."""

    def __init__(self, collective_forward: bool):
        self.tokenizer, self.lm = load_tokenizer(ModelConfig()), load_causal_lm(ModelConfig())
        lm = self.lm
        self.collective_forward, self.calls, self.comm = collective_forward, 0, None
        lm.register_forward_pre_hook(self._before_forward)
        settings = SamplingSettings(eos_token_ids=[self.tokenizer.eos_token_id], max_completion_length=16, temperature=1.5)
        self.engine = HFEngine(settings, get_model=lambda: lm, pad_token_id=self.tokenizer.pad_token_id)

    def join(self, comm: ThreadCollectives) -> Rank:
        self.comm = comm
        if self.collective_forward:
            self.engine.lockstep = comm
        return self

    def _before_forward(self, module, args):
        self.calls += 1
        if self.collective_forward:
            self.comm.sum(torch.zeros(1))


def _on_ranks(ranks: list[Rank], work):
    """work(rank index, Rank) on one thread per rank; returns (forward calls, result) per rank."""

    def rank_fn(index, comm):
        result = work(index, ranks[index].join(comm))
        return ranks[index].calls, result

    return run_ranks(len(ranks), rank_fn)


def _sample_on_ranks(lockstep: bool):
    """Rank 0 samples 2 prompts, rank 1 three (so also a different number of seeded batches), 3 completions each."""

    def work(index, rank):
        mine = QUESTIONS[:2] if index == 0 else QUESTIONS[2:]
        return rank.engine.generate(_prompts(rank.tokenizer, mine), 3, seeds=[10 * index + j for j in range(len(mine))])

    return _on_ranks([Rank(collective_forward=lockstep) for _ in range(2)], work)


def test_ranks_make_the_same_forward_calls_in_lockstep_and_only_then():
    free = _sample_on_ranks(lockstep=False)
    assert free[0][0] != free[1][0]  # on their own, ranks stop at different points: a collective forward would hang
    synced = _sample_on_ranks(lockstep=True)  # the forward is a barrier here: this returns only if the calls match
    (calls0, rollout0), (calls1, rollout1) = synced
    assert calls0 == calls1
    assert len(rollout0.completion_ids) == 6 and len(rollout1.completion_ids) == 9
    assert len({len(c) for c in rollout0.completion_ids + rollout1.completion_ids}) > 1  # ended at different lengths
    eos = load_tokenizer(ModelConfig()).eos_token_id
    for rollout in (rollout0, rollout1):
        for ids, truncated in zip(rollout.completion_ids, rollout.truncated):
            assert 0 < len(ids) <= 16 and (ids[-1] == eos) != truncated


def test_lockstep_samples_what_the_free_engine_samples():
    """Idle forwards read no random numbers and write no cache: one rank in lockstep gives the same tokens."""
    free, synced = Rank(collective_forward=False), Rank(collective_forward=True).join(ThreadCollectives(Exchange(1), 0))
    tokenizer, free, synced = free.tokenizer, free.engine, synced.engine
    prompts = _prompts(tokenizer, QUESTIONS[:3])
    for seeds in ([1, 2, 3], None):
        torch.manual_seed(0)
        expected = free.generate(prompts, 4, seeds=seeds)
        torch.manual_seed(0)
        got = synced.generate(prompts, 4, seeds=seeds)
        assert got.completion_ids == expected.completion_ids and got.truncated == expected.truncated


def test_a_rank_without_prompts_keeps_the_others_company():
    """A rank with nothing to sample (a multi-turn round where none of its conversations called a tool) still
    makes the busy rank's forward calls, and returns nothing."""

    def work(index, rank):
        prompts = _prompts(rank.tokenizer, QUESTIONS[:2]) if index == 0 else []
        return rank.engine.generate(prompts, 2, seeds=[3, 4] if index == 0 else None, max_tokens=8 if index == 0 else 1)

    (calls0, busy), (calls1, idle) = _on_ranks([Rank(collective_forward=True) for _ in range(2)], work)
    assert calls0 == calls1 > 2 and len(busy.completion_ids) == 4 and idle.completion_ids == []


def test_lockstep_is_used_only_where_a_forward_is_a_collective():
    from types import SimpleNamespace

    from grpo_trainer.distributed import forward_is_collective, sampling_lockstep

    def accelerator(kind, n):
        return SimpleNamespace(num_processes=n, distributed_type=SimpleNamespace(value=kind))

    assert forward_is_collective(accelerator("FSDP", 2))
    assert not forward_is_collective(accelerator("FSDP", 1))
    for kind in ("MULTI_CPU", "MULTI_GPU", "DEEPSPEED", "NO"):  # ZeRO-3 samples with its hooks removed
        assert not forward_is_collective(accelerator(kind, 2))
    comm = object()  # what rollouts (run.build_run) and periodic evaluation (trainer.periodic_eval) hand the engine
    assert sampling_lockstep(accelerator("FSDP", 2), comm) is comm and sampling_lockstep(accelerator("MULTI_GPU", 2), comm) is None


def test_multi_turn_rounds_run_on_every_rank_while_any_rank_has_a_conversation_going(tiny_model_path):
    """Tool rounds around an engine in lockstep: a rank whose conversations all ended still takes part in the
    rounds another rank runs (generate with nothing), so the engine's forward calls keep matching."""
    from test_tools import add_call, multi_turn

    tokenizer = load_tokenizer(ModelConfig())
    prompt = tokenizer("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    scripts = {0: [[add_call(1, 2), add_call(3, 4), "A<|im_end|>"]],  # two rounds of tool calls
               1: [["B, no tools<|im_end|>"]]}
    loops = {rank: multi_turn(tokenizer, scripts[rank]) for rank in (0, 1)}

    def rank_fn(rank, comm):
        loop, engine = loops[rank]
        engine.lockstep = comm
        return loop.generate([prompt], 1), engine.calls

    (busy, busy_calls), (idle, idle_calls) = run_ranks(2, rank_fn)
    assert busy.tool_calls == [2] and idle.tool_calls == [0]
    assert len(busy_calls) == len(idle_calls) == 3
    assert [call["contexts"] for call in idle_calls[1:]] == [[], []]


def test_periodic_evaluation_runs_in_lockstep_too(tiny_model_path):
    """evaluate_model, as the trainer calls it every eval.every steps on every rank, with the engine in lockstep:
    ranks whose completions end at different lengths (in a real run: kernels that round differently; here rank 0
    stops at 4 tokens, rank 1 at 16) still make the same forward calls. Every rank evaluates the same prompts in
    the same batches (one prompt each here), so they make the same generate calls. (That lockstep samples the
    free engine's tokens is checked above with one rank: two rank threads share torch's global generator.)"""
    from grpo_trainer.config import load_config
    from grpo_trainer.evaluate import evaluate_model

    configs = [load_config("configs/demo_cpu.yaml", [f"rollout.max_completion_length={length}", "rollout.batch_size=1"])
               for length in (4, 16)]

    def evaluate(lockstep: bool):
        def work(index, rank):
            return evaluate_model(rank.lm, rank.tokenizer, configs[index], k=2, num_prompts=4, progress=False,
                                  lockstep=rank.comm if lockstep else None)

        return _on_ranks([Rank(collective_forward=lockstep) for _ in range(2)], work)

    free = evaluate(lockstep=False)
    assert free[0][0] != free[1][0]
    (calls0, synced0), (calls1, synced1) = evaluate(lockstep=True)  # the forward is a barrier: returns only if they match
    assert calls0 == calls1
    for results in (synced0, synced1):
        assert sorted(results) == sorted(free[0][1]) and results["eval/num_prompts"] == 4
