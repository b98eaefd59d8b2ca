"""Multi-turn rollouts with tools (environment.tools): parsing, running, the template's tool tokens, the loop's
bookkeeping (masks, budget, turns, seeds), the loss mask, and hostile code through the python tool."""

from __future__ import annotations

import os
import threading
import uuid
from pathlib import Path

import pytest
import torch

from grpo_trainer.config import EnvironmentConfig, ModelConfig
from grpo_trainer.environments.episodes import EnvMessageTokens, EpisodeEngine, tools_settings
from grpo_trainer.environments.tools import (
    Tool,
    ToolBox,
    ToolCall,
    ToolResult,
    build_toolbox,
    parse_tool_calls,
    tool_message,
)
from grpo_trainer.environments.tools_env import ToolsEnvironment
from grpo_trainer.models import load_tokenizer
from grpo_trainer.rollout import Rollout, RunsInLockstep, SamplesTrainingModel

CALL = '<tool_call>{"name": "python", "arguments": {"code": "print(6*7)"}}</tool_call>'


# ---------------------------------------------------------------------------- parsing


def test_tool_calls_are_parsed_in_the_hermes_format():
    assert parse_tool_calls(f"let me compute {CALL} then") == [ToolCall("python", {"code": "print(6*7)"})]
    two = parse_tool_calls('<tool_call>\n{"name":"a","arguments":{}}\n</tool_call><tool_call>{"name":"b","arguments":"{\\"x\\": 1}"}</tool_call>')
    assert two == [ToolCall("a", {}), ToolCall("b", {"x": 1})]  # whitespace around the JSON; arguments as a JSON string
    assert parse_tool_calls("no call here") == []


@pytest.mark.parametrize("text,says", [
    ('<tool_call>{"name": "python", "arguments": {"code": "1"}}', "not closed"),
    ("<tool_call>{name: python}</tool_call>", "not valid JSON"),
    ('<tool_call>{"arguments": {}}</tool_call>', '"name": <string>'),
    ('<tool_call>{"name": "python", "arguments": [1]}</tool_call>', '"arguments": <object>'),
    ("<tool_call>[]</tool_call>", '"name": <string>'),
])
def test_a_malformed_call_becomes_an_error_for_the_model(text, says):
    (result,) = parse_tool_calls(text)
    assert isinstance(result, ToolResult) and result.error and says in result.output


def test_parsing_never_raises_on_garbage():
    import random

    rng = random.Random(0)
    pieces = ["<tool_call>", "</tool_call>", "{", "}", '"name"', ":", '"arguments"', "[", "]", "\\", '"', "x", "\n", "null"]
    for _ in range(2000):
        for item in parse_tool_calls("".join(rng.choice(pieces) for _ in range(rng.randint(0, 12)))):
            assert isinstance(item, (ToolCall, ToolResult))


# ---------------------------------------------------------------------------- running


def add(a: int, b: int) -> int:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return a + b


def test_toolbox_reports_every_failure_as_an_error_message_and_cuts_long_output():
    def fails(x: int) -> str:
        raise RuntimeError("boom")

    box = ToolBox([Tool("add", {}, add), Tool("fails", {}, fails), Tool("long", {}, lambda: "y" * 100)], timeout=5, output_chars=80)
    results = box.run([ToolCall("add", {"a": 2, "b": 3}), ToolCall("nope", {}), ToolCall("add", {"c": 1}),
                       ToolCall("fails", {"x": 1}), ToolResult("?", "error: not JSON", True), ToolCall("long", {}),
                       ToolCall("add", {"a": 2, "b": "3"})])
    assert [r.error for r in results] == [False, True, True, True, True, False, True]
    assert results[0].output == "5"
    assert "no tool 'nope'" in results[1].output and "tools: add, fails, long" in results[1].output
    assert results[2].output == "error: bad arguments for add: missing a required argument: 'a'"
    assert results[3].output == "error: RuntimeError: boom"
    assert results[5].output == "y" * 80 + "\n[... 20 more characters]"
    # Arguments that fit the signature but fail inside the tool (2 + "3") are the tool's failure, not bad arguments.
    assert results[6].output.startswith("error: TypeError: unsupported operand")


def test_tool_calls_of_a_batch_run_concurrently_and_a_hung_one_times_out():
    """Four calls meet at a barrier: they pass only if they run at the same time. A call that hangs is reported
    to the model once the timeout is over, and the others still return."""
    barrier = threading.Barrier(4, timeout=10)
    release = threading.Event()

    def meet() -> str:
        barrier.wait()
        return "met"

    box = ToolBox([Tool("meet", {}, meet), Tool("hang", {}, lambda: release.wait(30) and "late")], timeout=0.5,
                  output_chars=100)
    try:
        results = box.run([ToolCall("meet", {})] * 4 + [ToolCall("hang", {})])
    finally:
        release.set()
    assert [r.output for r in results[:4]] == ["met"] * 4
    assert results[4].error and "did not return within 0.5 s" in results[4].output


def test_a_users_function_is_described_from_its_signature_and_docstring(tmp_path):
    from grpo_trainer.errors import ConfigError

    (tmp_path / "my_tools.py").write_text(
        "def multiply(a: int, b: int) -> int:\n"
        '    """Multiply two integers.\n\n    Args:\n        a: The first factor.\n        b: The second factor.\n    """\n'
        "    return a * b\n\n"
        "def undocumented(a):\n    return a\n"
    )
    box = build_toolbox(EnvironmentConfig(tools=[f"{tmp_path}/my_tools.py:multiply", "python"]))
    (schema, python) = box.schemas
    assert schema["function"]["name"] == "multiply" and schema["function"]["description"] == "Multiply two integers."
    assert schema["function"]["parameters"]["properties"]["a"] == {"type": "integer", "description": "The first factor."}
    assert python["function"]["name"] == "python"
    assert box.run([ToolCall("multiply", {"a": 6, "b": 7})])[0].output == "42"
    with pytest.raises(ConfigError, match="environment.tools.0: cannot describe"):
        build_toolbox(EnvironmentConfig(tools=[f"{tmp_path}/my_tools.py:undocumented"]))
    with pytest.raises(ConfigError, match="environment.tools.0: .*no function 'missing'"):
        build_toolbox(EnvironmentConfig(tools=[f"{tmp_path}/my_tools.py:missing"]))
    with pytest.raises(ConfigError, match="environment.tools.0: tool file not found: nowhere.py"):
        build_toolbox(EnvironmentConfig(tools=["nowhere.py:fn"]))
    with pytest.raises(ConfigError, match=r"environment.tools.0: 'calc' is not a built-in tool \(python\) nor of the form"):
        build_toolbox(EnvironmentConfig(tools=["calc"]))
    with pytest.raises(ConfigError, match="two tools are named 'python'"):
        build_toolbox(EnvironmentConfig(tools=["python", "python"]))
    assert build_toolbox(EnvironmentConfig()) is None


# ---------------------------------------------------------------------------- the python tool, hostile code


@pytest.mark.xdist_group("sandbox")  # runs code as `nobody`, like tests/test_sandbox.py's process census
@pytest.mark.slow
class TestPythonTool:
    box = None

    @classmethod
    def toolbox(cls) -> ToolBox:
        if cls.box is None:  # built once for the class, by whichever of its tests runs first
            cls.box = build_toolbox(EnvironmentConfig(tools=["python"], tool_timeout=2.0, tool_output_chars=200))
        return cls.box

    @classmethod
    def run(cls, code: str) -> ToolResult:
        return cls.toolbox().run([ToolCall("python", {"code": code})])[0]

    def test_it_returns_what_the_program_prints(self):
        result = self.run("print(12 * 34)")
        assert (result.name, result.output, result.error) == ("python", "408\n", False) and result.seconds > 0

    def test_a_failing_program_returns_its_error(self):
        result = self.run("print('before')\n1 / 0")
        assert result.error and result.output == "before\nZeroDivisionError: division by zero"

    def test_an_endless_program_is_stopped_at_the_timeout(self):
        result = self.run("while True: pass")
        assert result.error and "did not finish within 2 s" in result.output

    def test_printing_forever_is_cut_off(self):
        result = self.run("while True: print('x' * 1000)")
        assert result.error and len(result.output) < 300

    def test_no_network_and_no_files_outside(self, tmp_path):
        canary = Path("/tmp") / f"grpo-tool-canary-{uuid.uuid4().hex}"
        code = (
            "import socket\n"
            "try:\n    socket.create_connection(('1.1.1.1', 53), timeout=1); print('net')\n"
            "except OSError: print('no net')\n"
            f"try:\n    open({str(canary)!r}, 'w').write('x'); print('wrote')\n"
            "except OSError: print('no write')\n"
        )
        result = self.run(code)
        assert "no net" in result.output and "net\n" not in result.output.replace("no net\n", "")
        assert not canary.exists()
        assert os.getpid() > 0  # the trainer is alive

    def test_bad_arguments_are_an_error_not_a_crash(self):
        result = self.toolbox().run([ToolCall("python", {"code": 5}), ToolCall("python", {"source": "1"})])
        assert all(r.error for r in result)
        assert result[0].output == "error: bad arguments for python: 'code' must be a string, not int"
        assert result[1].output == "error: bad arguments for python: missing a required argument: 'code'"


# ---------------------------------------------------------------------------- the template's tool tokens


def test_tool_tokens_are_what_the_template_renders_for_the_whole_conversation(tiny_model_path):
    """prompt + model turn (ending in EOS) + tool tokens + model turn == the template's rendering of the
    conversation, token for token: the sequence trained on is the one a chat would have produced."""
    tokenizer = load_tokenizer(ModelConfig())
    conversation = [{"role": "user", "content": "What is 6*7?"}]
    prompt = tokenizer.apply_chat_template(conversation, add_generation_prompt=True, tokenize=False)
    first, second = CALL, "\\boxed{42}"
    tool_tokens = EnvMessageTokens(tokenizer)([tool_message("python", "42\n")])
    ids = (tokenizer(prompt + first + tokenizer.eos_token, add_special_tokens=False)["input_ids"] + tool_tokens
           + tokenizer(second + tokenizer.eos_token, add_special_tokens=False)["input_ids"])
    whole = conversation + [{"role": "assistant", "content": first}, {"role": "tool", "content": "42\n"},
                            {"role": "assistant", "content": second}]
    rendered = tokenizer.apply_chat_template(whole, tokenize=False)
    assert tokenizer.decode(ids) + "\n" == rendered  # the template also ends the last turn with a newline


def test_a_template_without_eos_after_assistant_turns_is_refused():
    class NoEos:
        eos_token = "</s>"

        def apply_chat_template(self, messages, **kwargs):
            return "".join(m["content"] for m in messages)

    with pytest.raises(ValueError, match="does not end an assistant turn with the EOS token"):
        EnvMessageTokens(NoEos())


# ---------------------------------------------------------------------------- the loop


class ScriptedEngine(SamplesTrainingModel, RunsInLockstep):  # EpisodeEngine asks for lockstep (hf under FSDP)
    """Plays scripted conversations: completion j of the first call says scripts[j][0]; a later context gets the
    next turn of the script whose first turn it contains."""

    def __init__(self, tokenizer, scripts: list[list[str]]):
        self.tokenizer, self.scripts = tokenizer, scripts
        self.calls: list[dict] = []

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def generate(self, prompt_ids, num_generations, seeds=None, max_tokens=None, episodes=None):
        self.calls.append({"contexts": prompt_ids, "n": num_generations, "seeds": seeds, "max_tokens": max_tokens})
        if len(self.calls) == 1:
            turns = [s[0] for s in self.scripts]
        else:
            turns = []
            for context in prompt_ids:
                text = self.tokenizer.decode(context)
                script = next(s for s in self.scripts if s[0] in text)
                turns.append(script[text.count("<|im_start|>tool")])
        ids = [self.encode(t) for t in turns]
        limit = max_tokens or 10_000
        return Rollout(completion_ids=[t[:limit] for t in ids], truncated=[len(t) > limit for t in ids],
                       sampling_logprobs=[[-0.5] * len(t[:limit]) for t in ids])


def multi_turn(tokenizer, scripts, max_len=400, max_turns=2, tools=None):
    box = ToolBox(tools or [Tool("add", {}, add)], timeout=5, output_chars=100)
    engine = ScriptedEngine(tokenizer, scripts)
    return tools_loop(engine, box, tokenizer, max_len, max_turns), engine


def tools_loop(engine, box: ToolBox, tokenizer, max_completion_length: int, max_tool_turns: int) -> EpisodeEngine:
    """The episode loop with `environment.tools` alone around `engine`, as the run builds it (with_environment)."""
    return EpisodeEngine(engine, ToolsEnvironment(box), tokenizer, eos_token_ids=[tokenizer.eos_token_id],
                         max_completion_length=max_completion_length, settings=tools_settings(box, max_tool_turns))


def add_call(a, b) -> str:
    return f'<tool_call>{{"name": "add", "arguments": {{"a": {a}, "b": {b}}}}}</tool_call><|im_end|>'


def test_the_loop_runs_tools_masks_their_output_and_continues_from_the_whole_context(tiny_model_path):
    tokenizer = load_tokenizer(ModelConfig())
    prompt = tokenizer("<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n", add_special_tokens=False)["input_ids"]
    scripts = [
        [add_call(1, 2), "A3<|im_end|>"],  # one call, then an answer
        ["B no tools<|im_end|>"],  # answers at once
        ["<tool_call>{oops}</tool_call><|im_end|>", "C sorry<|im_end|>"],  # a malformed call: told, goes on
        [add_call(1, 1) + "", add_call(2, 2), add_call(3, 3), "never"],  # calls past max_tool_turns=2
    ]
    loop, engine = multi_turn(tokenizer, scripts)
    out = loop.generate([prompt, prompt], 2, seeds=[11, 12])
    decode = lambda ids: tokenizer.decode(ids)  # noqa: E731
    assert [len(c) for c in out.conversations] == [3, 1, 3, 5]
    assert out.tool_calls == [1, 0, 1, 2] and out.tool_errors == [0, 0, 1, 0] and out.turns == [2, 1, 2, 3]
    assert out.conversations[0][1] == {"role": "tool", "name": "add", "content": "3"}
    assert out.conversations[0][0]["tool_calls"] == [{"type": "function", "function": {"name": "add", "arguments": {"a": 1, "b": 2}}}]
    assert "not valid JSON" in out.conversations[2][1]["content"]
    assert out.conversations[3][-1]["content"].startswith("<tool_call>")  # the third call is never answered
    assert decode(out.completion_ids[0]) == add_call(1, 2) + "\n<|im_start|>tool\n3<|im_end|>\n<|im_start|>assistant\nA3<|im_end|>"
    for ids, mask, lps, truncated in zip(out.completion_ids, out.completion_mask, out.sampling_logprobs, out.truncated):
        assert len(ids) == len(mask) == len(lps) and not truncated
        model_text = decode([t for t, m in zip(ids, mask) if m])
        tool_text = decode([t for t, m in zip(ids, mask) if not m])
        assert "<|im_start|>tool" in tool_text or not tool_text
        assert "<|im_start|>tool" not in model_text
        assert all(lp == (-0.5 if m else 0.0) for lp, m in zip(lps, mask))
    # Every continuation was drawn from the prompt plus the whole conversation so far: the tokens trained on.
    for call in engine.calls[1:]:
        assert call["n"] == 1
        for context in call["contexts"]:
            assert any(context == prompt + ids[: len(context) - len(prompt)] for ids in out.completion_ids)
    # Seeds: the first turn's are the prompts'; continuations get their own per completion and round.
    assert engine.calls[0]["seeds"] == [11, 12] and len(set(engine.calls[1]["seeds"])) == len(engine.calls[1]["seeds"])


def test_the_budget_bounds_model_and_tool_tokens_together(tiny_model_path):
    tokenizer = load_tokenizer(ModelConfig())
    prompt = [1, 5, 6]
    first = len(tokenizer(add_call(1, 2), add_special_tokens=False)["input_ids"])
    tool = len(EnvMessageTokens(tokenizer)([tool_message("add", "3")]))
    scripts = [[add_call(1, 2), "A long answer<|im_end|>"]]
    # Room for exactly 5 answer tokens: the answer is cut there and flagged truncated.
    loop, engine = multi_turn(tokenizer, scripts, max_len=first + tool + 5)
    out = loop.generate([prompt], 1)
    assert len(out.completion_ids[0]) == first + tool + 5 and out.truncated == [True]
    assert engine.calls[1]["max_tokens"] == 5 and sum(out.completion_mask[0]) == first + 5
    # No room after the tool output: the tool is not appended and the conversation ends, truncated.
    loop, engine = multi_turn(tokenizer, scripts, max_len=first + tool)
    out = loop.generate([prompt], 1)
    assert out.completion_ids[0] == tokenizer(add_call(1, 2), add_special_tokens=False)["input_ids"]
    assert out.truncated == [True] and len(engine.calls) == 1


def test_a_turn_cut_by_the_length_limit_runs_no_tool(tiny_model_path):
    tokenizer = load_tokenizer(ModelConfig())
    scripts = [[add_call(1, 2).removesuffix("<|im_end|>"), "x"]]  # no EOS: the engine hit its limit mid-turn
    loop, engine = multi_turn(tokenizer, scripts)
    out = loop.generate([[1, 5]], 1)
    assert out.tool_calls == [0] and out.turns == [1] and len(engine.calls) == 1


def test_the_loss_mask_leaves_tool_tokens_out_and_the_normaliser_counts_model_tokens():
    from grpo_trainer.batches import build_train_batch
    from helpers import training_samples

    samples = training_samples([[1, 2], [1, 2]], [[5, 6, 7, 8, 9], [5, 6]], loss_mask=[[1, 1, 0, 0, 1], [1, 1]])
    batch = build_train_batch(samples, torch.tensor([1.0, -1.0]), 0, micro_batch_size=2,
                              mask_truncated=False, skip_zero_advantage=False)
    (mb,) = batch.micro_batches
    assert mb.mask.tolist() == [[1, 1, 0, 0, 1], [1, 1, 0, 0, 0]]
    assert mb.sequences["completion_mask"].tolist() == [[1, 1, 1, 1, 1], [1, 1, 0, 0, 0]]  # tool tokens still attended
    assert batch.lengths.tolist() == [3.0, 2.0] and batch.local_tokens == 5.0


def test_rollout_select_and_concat_keep_every_per_completion_field():
    rollout = Rollout(completion_ids=[[1], [2], [3]], truncated=[False, True, False], completion_mask=[[1], [0], [1]],
                      conversations=[["a"], ["b"], ["c"]], tool_calls=[1, 2, 3], tool_errors=[0, 1, 0], turns=[2, 3, 1],
                      tool_seconds=1.5)
    picked = rollout.select([2, 0])
    assert picked.completion_ids == [[3], [1]] and picked.tool_calls == [3, 1] and picked.sampling_logprobs is None
    joined = Rollout.concat([picked, rollout.select([1])])
    assert joined.conversations == [["c"], ["a"], ["b"]] and joined.turns == [1, 2, 3] and joined.truncated == [False, False, True]


# ---------------------------------------------------------------------------- training with tools


def train_tools(out: Path, steps: int, *extra: str, resume: str = "never"):
    from helpers import run_cli

    result = run_cli(["train", "configs/tools_cpu.yaml", f"output_dir={out}", f"train.max_steps={steps}",
                      "train.prompts_per_step=4", "rollout.num_generations=4", "train.micro_batch_size=16",
                      "eval.every=0", "checkpoint.save_every=2", "logging.progress_bar=false",
                      f"checkpoint.resume={resume}", *extra])
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.xdist_group("sandbox")  # the python tool runs code as `nobody` (see TestPythonTool)
@pytest.mark.slow
def test_training_with_the_python_tool_logs_tool_metrics_and_resumes_bit_identically(tmp_path):
    """configs/tools_cpu.yaml (the tiny tool-calling model) for 4 steps straight, and 2 + 2 resumed: the same
    weights and metrics; the tool metrics are there and say tools were called and answered."""
    from grpo_trainer.metrics import read_metrics
    from helpers import assert_same_run

    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train_tools(straight, 4)
    train_tools(resumed, 2)
    assert "resumed from" in train_tools(resumed, 4, resume="auto").stderr
    assert_same_run(straight, resumed)
    records = read_metrics(straight)
    assert sum(r["tools/calls_per_completion"] for r in records) > 0
    assert all(0 <= r["tools/errors_per_completion"] <= r["tools/calls_per_completion"] for r in records)
    assert all(r["tools/turns_per_completion"] >= 1 and r["timing/tools"] >= 0 for r in records)
    assert all(r["completions/mean_length"] <= 160 for r in records)


def tools_demo_engine(*overrides: str):
    """configs/tools_cpu.yaml's tokenizer, model, task and multi-turn hf engine (python tool), with `overrides`."""
    from grpo_trainer.config import load_config
    from grpo_trainer.environments import build_environment
    from grpo_trainer.environments.episodes import with_environment
    from grpo_trainer.models import load_causal_lm
    from grpo_trainer.rollout import sampling_settings
    from grpo_trainer.rollout.registry import build_engine
    from grpo_trainer.task import load_task

    cfg = load_config("configs/tools_cpu.yaml", list(overrides))
    tokenizer, lm = load_tokenizer(cfg.model), load_causal_lm(cfg.model)
    environment = build_environment(cfg)  # environment.tools alone: the built-in tools environment, as a run builds it
    task = load_task(cfg.data, cfg.rewards, tokenizer, 256, tools=environment.tools)
    sampling = sampling_settings(cfg, [tokenizer.eos_token_id])
    sampler = build_engine(cfg, sampling, get_model=lambda: lm, pad_token_id=tokenizer.pad_token_id,
                           tokenizer=tokenizer)
    engine = with_environment(sampler, tokenizer, cfg, sampling, environment)
    return tokenizer, lm, task, engine


def test_logprobs_of_a_multi_turn_completion_equal_one_forward_over_the_conversation():
    """Real tool calls by the tiny tool-calling model (hf engine): the trainer's single padded forward over prompt
    + whole conversation gives each model-written token the log-prob the model gave it turn by turn, when the
    engine sampled it from its own context (the turn's prompt: everything before it)."""
    from grpo_trainer.models import TokenLogprobs, make_sequence_batch

    tokenizer, lm, task, engine = tools_demo_engine("rollout.num_generations=8")
    torch.manual_seed(0)
    prompts = task.prompt_ids([0, 1, 2, 3])
    out = engine.generate(prompts, 8)
    rows = [j for j, calls in enumerate(out.tool_calls) if calls and out.turns[j] == 2]
    assert len(rows) >= 3  # tool calls really happened and were answered
    batch = make_sequence_batch([prompts[j // 8] for j in rows], [out.completion_ids[j] for j in rows], tokenizer.pad_token_id)
    with torch.no_grad():
        single = TokenLogprobs(lm, share_prompt=False)(**batch.tensors())[0]
        for i, j in enumerate(rows):
            ids, mask = out.completion_ids[j], out.completion_mask[j]
            full = prompts[j // 8] + ids
            second_turn = mask.index(1, mask.index(0))  # first model token after the tool output
            context = full[: len(prompts[j // 8]) + second_turn]  # what the engine continued from
            logits = lm(torch.tensor([full])).logits[0].log_softmax(-1)
            per_turn = [float(logits[len(context) - 1 + k, full[len(context) + k]]) for k in range(len(ids) - second_turn)]
            torch.testing.assert_close(single[i, second_turn : len(ids)], torch.tensor(per_turn), atol=1e-4, rtol=1e-4)
            assert all(m == 0 for m in mask[mask.index(0) : second_turn])


def test_seeded_multi_turn_groups_do_not_depend_on_batching():
    """rollout.seed_per_prompt with tools: a prompt's conversations are the same whether it is sampled with
    others or alone (as on another rank), tool turns included."""
    _, _, task, engine = tools_demo_engine("rollout.seed_per_prompt=true")
    prompts, seeds = task.prompt_ids([0, 1, 2]), [101, 202, 303]
    together = engine.generate(prompts, 4, seeds=seeds)
    alone = Rollout.concat([engine.generate([p], 4, seeds=[s]) for p, s in zip(prompts, seeds)])
    assert together.completion_ids == alone.completion_ids and together.conversations == alone.conversations
    assert sum(together.tool_calls) > 0


def _build_a_run_and_evaluate(overrides: list[str]) -> None:
    """In a fork (build_run starts an Accelerator): every build_environment call counted and the environment's
    close() recorded through a run's life, a periodic evaluation included."""
    from grpo_trainer import evaluate
    from grpo_trainer import run as building
    from grpo_trainer.config import load_config
    from grpo_trainer.environments import build_environment

    built, closed = [], []

    def counting(cfg):
        built.append(build_environment(cfg))
        built[-1].close = lambda: closed.append(True)
        return built[-1]

    building.build_environment = evaluate.build_environment = counting
    cfg = load_config("configs/tools_cpu.yaml", overrides)
    run = building.build_run(cfg)
    assert len(built) == 1, built
    assert run.task.environment is run.eval_task.environment is run.engine.environment is built[0]
    results = evaluate.evaluate_model(run.bare_lm(), run.tokenizer, cfg, k=1, task=run.eval_task, progress=False)
    assert results["eval/num_prompts"] == 2 and len(built) == 1 and not closed  # evaluated on the run's, left open
    building.stop_run(run)
    assert closed == [True]  # the run closes what it built, once


def test_the_run_builds_its_environment_once_for_the_task_the_engine_and_the_evaluator(tmp_path):
    from helpers import run_in_fork, small_run_overrides

    overrides = [*small_run_overrides(tmp_path / "out"), "eval.every=1", "eval.num_samples=2"]
    result = run_in_fork(_build_a_run_and_evaluate, (overrides,))
    assert result.returncode == 0, result.stderr[-3000:]
