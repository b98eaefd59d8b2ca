"""User code never hangs the trainer (issue 43, part 3; probe defects 1, 2 and 11): the one deadline utility
(grpo_trainer/deadline.py) and every caller moved onto it (tools, rewards, environment calls, the environment
class's first object), and the CLI's end (non-daemon threads, os._exit, sys.exit from user code).

Nothing here measures wall time: the assertions are what the code did (the deadline path taken, the time
reported, the count, the one-line stop, the process exited and with which status)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from grpo_trainer.deadline import EXIT_GRACE_ENV, Call, CallsHang, UserCalls, held_by, run_inline
from grpo_trainer.errors import ConfigError, RewardError

FOREVER = 10**6  # seconds: a call that never returns within any test


def _forever():
    threading.Event().wait(FOREVER)


# ---------------------------------------------------------------------------- the utility itself


def test_a_call_past_its_limit_is_abandoned_in_a_daemon_thread_reported_at_its_limit_and_counted():
    seen = {}
    calls = UserCalls("my.py:slow", workers=2, max_abandoned=5, limit_key="x.timeout")
    release = threading.Event()

    def slow():
        seen["daemon"] = threading.current_thread().daemon
        release.wait(FOREVER)
        return "late"

    outcome = calls.call(slow, 0.05)
    assert outcome.timed_out == "timeout" and not outcome.ok and outcome.value is None
    assert outcome.seconds == 0.05  # the limit, never the limit plus a margin
    assert seen["daemon"] is True
    assert calls.abandoned == 1 and calls.abandoned_total == 1
    assert calls.call(lambda: 7, 5.0).value == 7  # a new worker took the abandoned one's place
    release.set()  # the abandoned call returns: no longer counted as running, its value dropped
    for _ in range(200):
        if calls.abandoned == 0:
            break
        time.sleep(0.01)
    assert calls.abandoned == 0 and calls.abandoned_total == 1


def test_more_abandoned_calls_than_the_bound_stops_in_one_line_naming_the_function():
    calls = UserCalls("rollout.tools", workers=4, max_abandoned=1, limit_key="rollout.tool_timeout")
    first = calls.run([Call(_forever, 0.02, name="rollout.tools wait"), Call(lambda: 1 / 0, 5.0, name="rollout.tools div")])
    assert first[0].timed_out == "timeout" and first[1].error == "ZeroDivisionError: division by zero"
    with pytest.raises(CallsHang, match=r"^rollout.tools wait: 2 calls are still running after their timeout "
                                        r"\(rollout.tool_timeout\): the function hangs; stopping$") as stop:
        calls.run([Call(_forever, 0.02, name="rollout.tools wait")])
    assert "\n" not in str(stop.value)
    other = UserCalls("rewards", workers=4, max_abandoned=1, limit_key="rewards.N.timeout")
    other.run([Call(_forever, 0.02, name="a"), Call(_forever, 0.02, name="b")])  # one each: under the bound per function
    assert other.abandoned == 2


def test_system_exit_from_user_code_is_its_error_in_a_thread_and_inline():
    def leave():
        sys.exit(3)

    assert UserCalls("f", 1, 1, "t").call(leave, 5.0).error == "SystemExit: 3"
    assert UserCalls("f", 1, 1, "t").call(leave, None).error == "SystemExit: 3"  # no limit: still in a worker
    inline = run_inline(leave)
    assert inline.error == "SystemExit: 3" and isinstance(inline.exception, SystemExit)

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):  # Ctrl-C in the main thread still stops the program
        run_inline(interrupted)


def test_system_exit_reaching_the_cli_or_the_api_callback_is_an_error():
    from grpo_trainer.cli import user_code
    from grpo_trainer.errors import UserError
    from grpo_trainer.trainer import call_on_step_end

    with pytest.raises(UserError, match=r"^train: user code called sys.exit\(0\) \(SystemExit\) while it ran"):
        with user_code("train"):
            sys.exit(0)
    with pytest.raises(UserError, match=r"^on_step_end raised SystemExit: 4 after step 2; the run did not finish$"):
        call_on_step_end(lambda step: sys.exit(4), 2)
    with pytest.raises(ValueError, match="its own"):  # anything else reaches the API's caller as it is
        call_on_step_end(lambda step: (_ for _ in ()).throw(ValueError("its own")), 2)


@pytest.mark.slow
def test_an_abandoned_call_never_holds_the_process_at_exit():
    code = ("from grpo_trainer.deadline import UserCalls; import threading\n"
            "print(UserCalls('f', 1, 5, 't').call(lambda: threading.Event().wait(10**6), 0.1).timed_out)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.strip() == "timeout", result.stderr[-2000:]


def test_held_by_names_live_non_daemon_threads_only():
    stop = threading.Event()
    keeper = threading.Thread(target=stop.wait, name="user-keeper", daemon=False)
    ghost = threading.Thread(target=stop.wait, name="user-ghost", daemon=True)
    keeper.start(), ghost.start()
    try:
        assert "user-keeper" in held_by() and "user-ghost" not in held_by()
    finally:
        stop.set()
        keeper.join(), ghost.join()
    assert "user-keeper" not in held_by()


@pytest.mark.slow
@pytest.mark.parametrize("held", [False, True])
def test_a_non_daemon_thread_left_behind_does_not_keep_the_process_alive(held):
    """end_process_if_held: a process held by a non-daemon thread is ended with the status given, naming the thread;
    one that is not (an idle concurrent.futures worker ends with the interpreter's own exit) exits as usual."""
    code = ("import concurrent.futures, sys, threading\nfrom grpo_trainer.deadline import end_process_if_held\n"
            "concurrent.futures.ThreadPoolExecutor(1).submit(print, 'idle worker left').result()\n"
            + ("threading.Thread(target=threading.Event().wait, name='user-keeper').start()\n" if held else "")
            + "end_process_if_held(3, grace=1.0)\nprint('returned', flush=True)\nsys.exit(3)")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 3, result.stderr[-2000:]
    assert result.stdout.split() == ["idle", "worker", "left", "returned"]
    assert ("user-keeper" in result.stderr and "ending it now (status 3)" in result.stderr) is held
    assert ("held by" in result.stderr) is held


@pytest.mark.slow
def test_os_exit_zero_in_a_thread_during_the_run_is_not_a_success():
    code = ("import os, threading\nfrom grpo_trainer.deadline import guard_os_exit\n"
            "with guard_os_exit():\n"
            "    t = threading.Thread(target=os._exit, args=(0,), name='environment-step'); t.start(); t.join()\n"
            "print('unreachable')")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 1 and "unreachable" not in result.stdout
    assert "os._exit(0) was called in thread 'environment-step' before the run finished" in result.stderr


# ---------------------------------------------------------------------------- tools


def test_a_tool_that_never_returns_is_an_error_to_the_model_reported_at_its_limit():
    from grpo_trainer.environments.tools import Tool, ToolBox, ToolCall

    schema = {"type": "function", "function": {"name": "wait", "parameters": {"type": "object", "properties": {}}}}
    box = ToolBox([Tool("wait", schema, lambda: _forever() or "never")], timeout=0.1, output_chars=100)
    result = box.run([ToolCall("wait", {})])[0]
    assert result.error and result.output == "error: wait did not return within 0.1 s" and result.seconds == 0.1
    assert box._calls.abandoned_total == 1

    def leave():
        raise SystemExit(0)

    box = ToolBox([Tool("leave", {**schema, "function": {**schema["function"], "name": "leave"}}, leave)], 5.0, 100)
    assert box.run([ToolCall("leave", {})])[0].output == "error: SystemExit: 0"


# ---------------------------------------------------------------------------- rewards


def _score(rewards, n=4):
    from grpo_trainer.rewards import compute_rewards

    return compute_rewards(rewards, [f"p{i}" for i in range(n)], [f"c{i}" for i in range(n)], [[1]] * n, {})


def test_a_reward_that_never_returns_scores_none_with_on_timeout_none_and_stops_past_the_bound(monkeypatch):
    from grpo_trainer import rewards as rewards_module
    from grpo_trainer.rewards import Reward

    def hang(prompts, completions, **kw):
        _forever()

    async def blocks(prompts, completions, **kw):  # blocks instead of awaiting: still times out
        _forever()

    monkeypatch.setattr(rewards_module, "MAX_ABANDONED", 2)
    pool = rewards_module.reward_calls()
    sync = Reward("hang", hang, timeout=0.05, on_timeout="none", where="rewards.0", calls=pool)
    batch = _score([sync])
    assert batch.metrics["rewards/hang/timed_out_batches"] == 1.0 and batch.metrics["rewards/hang/seconds"] == 0.05
    assert all(v != v for v in batch.total.tolist())  # no opinion: NaN
    _score([sync])
    with pytest.raises(RewardError, match=r"^reward 'hang' \(rewards.0\): 3 calls are still running after their "
                                          r"timeout \(rewards.N.timeout\): the function hangs; stopping$"):
        _score([sync])
    async_reward = Reward("blocks", blocks, timeout=0.05, on_timeout="none", where="rewards.1")
    assert _score([async_reward]).metrics["rewards/blocks/timed_out_batches"] == 1.0


def test_a_hanging_reward_with_on_timeout_error_stops_naming_the_sample():
    from grpo_trainer.rewards import Reward

    def hang_on_two(prompts, completions, **kw):
        if "p2" in prompts:
            _forever()
        return [1.0] * len(prompts)

    with pytest.raises(RewardError, match=r"did not return within 0.1 s \(rewards.0.timeout\) on sample 2 "):
        _score([Reward("slow", hang_on_two, timeout=0.1, where="rewards.0")])


def test_system_exit_in_a_reward_is_its_error_not_the_end_of_the_run():
    from grpo_trainer.rewards import Reward

    def leave(prompts, completions, **kw):
        sys.exit(0)

    for timeout in (None, 5.0):
        with pytest.raises(RewardError, match=r"^reward 'leave' raised SystemExit: 0 on sample 0"):
            _score([Reward("leave", leave, timeout=timeout)])


# ---------------------------------------------------------------------------- environments


class InitHangs:
    def __init__(self):
        _forever()

    def reset(self, **row):
        return None


class CloseHangs:
    def reset(self, **row):
        return None

    def close(self):
        _forever()


class InitExits:
    def __init__(self):
        sys.exit(0)

    def reset(self, **row):
        return None


def test_an_environment_whose_first_object_hangs_or_exits_stops_in_one_line():
    """The object the class is read off is made and closed under environment.step_timeout (defects 1 and 2): the
    run (and `kernels`, which builds the environment too) stops in one line instead of hanging or exiting 0."""
    from grpo_trainer.environments.class_env import ClassEnvironment

    def build(cls):
        return ClassEnvironment(cls, f"environment.factory env.py:{cls.__name__}", {}, extra_tools=[], tool_timeout=1,
                                step_timeout=0.1)

    with pytest.raises(ConfigError, match=r"^environment.factory env.py:InitHangs: .*InitHangs\(\*\*environment.kwargs\) "
                                          r"did not return within environment.step_timeout \(0.1 s\); stopping$"):
        build(InitHangs)
    with pytest.raises(ConfigError, match=r"CloseHangs.close\(\) did not return within environment.step_timeout"):
        build(CloseHangs)
    with pytest.raises(ConfigError, match=r"^environment.factory env.py:InitExits: .*InitExits\(\*\*environment.kwargs\) "
                                          r"raised SystemExit: 0 \(the first object"):
        build(InitExits)


def test_an_object_whose_snapshot_was_abandoned_is_not_closed():
    """Never touched again: neither scored, nor closed, once one of its calls was abandoned."""
    from grpo_trainer.environments.episodes import Conversation, EpisodeEngine, EpisodeSettings
    from grpo_trainer.environments.calls import EnvCalls, EpisodeBudget

    closed = []

    class Episode:
        def __init__(self, hangs):
            self.hangs = hangs

        def snapshot(self):
            if self.hangs:
                _forever()
            return "shot"

        def close(self):
            closed.append(self.hangs)

    class Environment:
        has_reward = False

    engine = EpisodeEngine.__new__(EpisodeEngine)  # only _finish is exercised: no engine, no tokenizer
    engine.environment = Environment()
    engine.settings = EpisodeSettings(max_turns=1, step_timeout=0.1, episode_timeout=5.0, concurrency=2,
                                      observation_chars=None, record=True)
    engine.calls = EnvCalls(2, "environment.factory test:Snap", 8)
    conversations = [Conversation([1], None, episode=Episode(hangs), budget=EpisodeBudget(0.1, 5.0))
                     for hangs in (False, True)]
    assert engine._finish(conversations) == ["shot", None]
    assert closed == [False] and conversations[1].untouchable


# ---------------------------------------------------------------------------- the CLI, as a user runs it
# In a real `python -m grpo_trainer` process (PYTHON_M), not run_cli's fork of a warm server: that child ends with
# os._exit once main returns, so the interpreter's exit (the join of non-daemon and concurrent.futures threads,
# where a hung tool used to hold the process forever) would never be reached.
PYTHON_M = [sys.executable, "-m"]

ENV_FILE = '''
import os, sys, threading, time


class Base:
    def reset(self, **row):
        return None

    def step(self, reply):
        return "go on", False

    def get_reward(self):
        return 1.0


class InitHangs(Base):
    def __init__(self):
        threading.Event().wait(10**6)


class CloseHangs(Base):
    def close(self):
        threading.Event().wait(10**6)


class InitExits(Base):
    def __init__(self):
        sys.exit(0)


class StepHangs(Base):
    def step(self, reply):
        threading.Event().wait(10**6)


class LeavesAThread(Base):
    def __init__(self):  # made in the deadline's daemon threads: a thread started here is a daemon too
        threading.Thread(target=threading.Event().wait, args=(10**6,), name="user-helper").start()

    def reset(self, **row):  # but a library may insist on a non-daemon thread
        threading.Thread(target=threading.Event().wait, args=(10**6,), name="user-poller", daemon=False).start()
        return None


class StepExits(Base):
    def step(self, reply):
        os._exit(0)
'''


def _env_run(tmp_path: Path, cls: str, *extra: str, command: str = "train", timeout: float = 300, env=None):
    from helpers import run_cli, small_run_overrides

    env_file = tmp_path / "env.py"
    env_file.write_text(ENV_FILE)
    return run_cli([command, "configs/demo_cpu.yaml", *small_run_overrides(tmp_path / "out", 2),
                    f"environment.factory={env_file}:{cls}", "environment.step_timeout=1", "environment.max_turns=2",
                    "rewards=[]", "eval.every=0", "checkpoint.save_every=0"], timeout=timeout, launcher=PYTHON_M,
                   env=env)


@pytest.mark.slow
@pytest.mark.parametrize("cls, said", [
    ("InitHangs", "InitHangs(**environment.kwargs) did not return within environment.step_timeout (1 s); stopping"),
    ("CloseHangs", "CloseHangs.close() did not return within environment.step_timeout (1 s); stopping"),
    ("InitExits", "InitExits(**environment.kwargs) raised SystemExit: 0"),
])
def test_an_environment_whose_init_or_close_hangs_or_exits_stops_the_run_in_one_line(tmp_path, cls, said):
    result = _env_run(tmp_path, cls)
    assert result.returncode == 2, result.stderr[-3000:]
    assert said in result.stderr and "Traceback" not in result.stderr and "done:" not in result.stdout


@pytest.mark.slow
def test_kernels_does_not_hang_on_an_environment_whose_init_hangs(tmp_path):
    """`kernels` builds the environment too (its prompts may carry reset text): one line, exit 2."""
    result = _env_run(tmp_path, "InitHangs", command="kernels")
    assert result.returncode == 2, result.stderr[-3000:]
    assert "InitHangs(**environment.kwargs) did not return within environment.step_timeout" in result.stderr


@pytest.mark.slow
def test_an_environment_step_that_never_returns_lets_the_run_finish_and_the_process_exit(tmp_path):
    from grpo_trainer.metrics import read_metrics

    result = _env_run(tmp_path, "StepHangs")
    assert result.returncode == 0 and "done: 2 steps" in result.stdout, result.stderr[-3000:]
    records = read_metrics(tmp_path / "out")
    assert len(records) == 2 and all(r["environment/timeouts"] > 0 for r in records)


@pytest.mark.slow
def test_a_non_daemon_thread_left_by_an_environment_does_not_keep_the_process_alive_after_done(tmp_path):
    result = _env_run(tmp_path, "LeavesAThread", env={EXIT_GRACE_ENV: "2"})  # the watchdog's wait, shortened
    assert result.returncode == 0 and "done: 2 steps" in result.stdout, result.stderr[-3000:]
    assert "user-poller" in result.stderr and "ending it now (status 0)" in result.stderr
    assert "user-helper" not in result.stderr
    assert (tmp_path / "out" / "model").is_dir() and (tmp_path / "out" / "metrics.jsonl").is_file()


@pytest.mark.slow
def test_os_exit_zero_in_an_environment_step_is_not_a_success(tmp_path):
    result = _env_run(tmp_path, "StepExits")
    assert result.returncode == 1 and "done:" not in result.stdout
    assert "os._exit(0) was called in thread" in result.stderr and "the run did not finish" in result.stderr


TOOL_FILE = '''
import threading


def python(code: str) -> str:
    """Never returns.

    Args:
        code: ignored
    """
    threading.Event().wait(10**6)
    return "never"
'''


@pytest.mark.slow
def test_a_tool_that_never_returns_lets_a_cli_run_finish_and_the_process_exit(tmp_path):
    """The tiny tool-calling model calls `python`; here that name is a user function that sleeps forever. Before
    the deadline utility, its ThreadPoolExecutor thread was joined at exit: the process never ended."""
    from grpo_trainer.metrics import read_metrics
    from helpers import run_cli

    tool = tmp_path / "tool.py"
    tool.write_text(TOOL_FILE)
    out = tmp_path / "out"
    result = run_cli(["train", "configs/tools_cpu.yaml", f"output_dir={out}", "train.max_steps=2",
                      "train.prompts_per_step=4", "rollout.num_generations=4", "train.micro_batch_size=16",
                      "eval.every=0", "checkpoint.save_every=0", "logging.progress_bar=false",
                      f"environment.tools=[{tool}:python]", "environment.tool_timeout=0.5"], timeout=300, launcher=PYTHON_M)
    assert result.returncode == 0 and "done: 2 steps" in result.stdout, result.stderr[-3000:]
    records = read_metrics(out)
    assert sum(r["tools/calls_per_completion"] for r in records) > 0
    assert all(r["tools/errors_per_completion"] == r["tools/calls_per_completion"] for r in records)


REWARD_FILE = '''
import threading


async def blocks(prompts, completions, **kwargs):
    threading.Event().wait(10**6)  # blocks the event loop instead of awaiting


def hangs(prompts, completions, **kwargs):
    threading.Event().wait(10**6)
'''


@pytest.mark.slow
def test_a_reward_that_never_returns_lets_a_cli_run_finish_with_on_timeout_none_and_stops_with_error(tmp_path):
    """on_timeout none: both steps scored by math_accuracy alone, the hanging rewards counted, the process exits
    (before: an async reward that blocks held the event loop, and the run, forever). on_timeout error: one line,
    exit status 2."""
    from grpo_trainer.metrics import read_metrics
    from helpers import run_cli, small_run_overrides

    reward = tmp_path / "reward.py"
    reward.write_text(REWARD_FILE)
    hanging = (f"{{name: {reward}:blocks, timeout: 0.5, on_timeout: none}}, "
               f"{{name: {reward}:hangs, timeout: 0.5, on_timeout: none}}")
    result = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(tmp_path / "a", 2),
                      f"rewards=[{{name: math_accuracy}}, {hanging}]"], timeout=300, launcher=PYTHON_M)
    assert result.returncode == 0 and "done: 2 steps" in result.stdout, result.stderr[-3000:]
    records = read_metrics(tmp_path / "a")
    assert [r["rewards/blocks/timed_out_batches"] for r in records] == [1.0, 1.0]
    assert [r["rewards/hangs/timed_out_batches"] for r in records] == [1.0, 1.0]
    result = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(tmp_path / "b", 2),
                      f"rewards=[{{name: {reward}:hangs, timeout: 0.5}}]"], timeout=300, launcher=PYTHON_M)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "error: reward 'hangs' did not return within 0.5 s (rewards.0.timeout)" in result.stderr
    assert "Traceback" not in result.stderr
