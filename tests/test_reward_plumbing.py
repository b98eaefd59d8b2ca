"""The trainer's side of rewards: resolving names, calling with TRL's signature, and clear failures."""

from __future__ import annotations

import math

import pytest

from grpo_trainer.config import RewardConfig
from grpo_trainer.errors import RewardError
from grpo_trainer.rewards import compute_rewards, load_rewards

PROMPTS = ["What is 1+1?", "What is 2+2?", "What is 3+3?"]
COMPLETIONS = ["\\boxed{2}", "\\boxed{5}", "no idea"]
COLUMNS = {"answer": ["2", "4", "6"], "prompt": PROMPTS}


def rewards_from(tmp_path, source: str, fn: str = "reward", **kwargs):
    path = tmp_path / "my_reward.py"
    path.write_text(source)
    return load_rewards([RewardConfig(name=f"{path}:{fn}", kwargs=kwargs)])


def call(rewards):
    return compute_rewards(rewards, PROMPTS, COMPLETIONS, [[1, 2], [3], [4, 5, 6]], COLUMNS)


def test_custom_reward_from_a_file_gets_trl_arguments_and_kwargs(tmp_path):
    source = (
        "def reward(prompts, completions, completion_ids=None, scale=1.0, **kwargs):\n"
        "    return [scale * len(ids) + (c.endswith('{' + a + '}')) for c, ids, a in zip(completions, completion_ids, kwargs['answer'])]\n"
    )
    batch = call(rewards_from(tmp_path, source, scale=10.0))
    assert batch.total.tolist() == [21.0, 10.0, 30.0]
    assert batch.metrics["rewards/reward/mean"] == pytest.approx(61 / 3)
    assert "rewards/reward/seconds" in batch.metrics


def test_function_without_kwargs_gets_only_what_it_names(tmp_path):
    batch = call(rewards_from(tmp_path, "def reward(completions, answer):\n    return [float(a in c) for c, a in zip(completions, answer)]\n"))
    assert batch.total.tolist() == [1.0, 0.0, 0.0]


def test_package_module_reference_and_builtin_name():
    rewards = load_rewards([RewardConfig(name="rewards.format:think_format"), RewardConfig(name="math_accuracy", weight=2.0)])
    assert [r.name for r in rewards] == ["think_format", "math_accuracy"]
    batch = call(rewards)
    assert batch.per_function[:, 1].tolist() == [1.0, 0.0, 0.0]  # math_accuracy
    assert batch.total[0] == pytest.approx(2.0 + batch.per_function[0, 0])


def test_none_means_no_opinion_and_weights_sum_the_rest(tmp_path):
    source = "def a(completions, **kw):\n    return [1.0, None, None]\n\ndef b(completions, **kw):\n    return [0.5, 0.25, None]\n"
    path = tmp_path / "two.py"
    path.write_text(source)
    rewards = load_rewards([RewardConfig(name=f"{path}:a", weight=2), RewardConfig(name=f"{path}:b", weight=4)])
    total = call(rewards).total.tolist()
    assert total[0] == 2 * 1.0 + 4 * 0.5 and total[1] == 4 * 0.25 and math.isnan(total[2])


def test_async_rewards_run_concurrently(tmp_path):
    # Each waits for the other to have started: run one after the other, they would time out.
    source = (
        "import asyncio\n"
        "started = {}\n"
        "async def _wait(me, other):\n"
        "    started[me] = True\n"
        "    for _ in range(200):\n"
        "        if started.get(other):\n"
        "            return [1.0, 1.0, 1.0]\n"
        "        await asyncio.sleep(0.01)\n"
        "    raise TimeoutError(me + ' never saw ' + other)\n"
        "async def a(completions, **kw):\n    return await _wait('a', 'b')\n"
        "async def b(completions, **kw):\n    return await _wait('b', 'a')\n"
    )
    path = tmp_path / "async_rewards.py"
    path.write_text(source)
    rewards = load_rewards([RewardConfig(name=f"{path}:a"), RewardConfig(name=f"{path}:b")])
    assert call(rewards).total.tolist() == [2.0, 2.0, 2.0]


@pytest.mark.parametrize(
    "source, expected",
    [
        ("def reward(completions, **kw):\n    return [1.0]\n", "reward 'reward' returned 1 values for 3 completions"),
        ("def reward(completions, **kw):\n    return 1.0\n", "must return a list of 3 floats"),
        ("def reward(completions, **kw):\n    return [1.0, 'yes', 0.0]\n", "returned 'yes' for sample 1 (prompt: 'What is 2+2?')"),
        ("def reward(completions, **kw):\n    return [1.0, float('inf'), 0.0]\n", "returned inf for sample 1"),
        (
            "def reward(completions, answer, **kw):\n    return [1 / (int(a) - 4) for a in answer]\n",
            "reward 'reward' raised ZeroDivisionError: division by zero on sample 1 (prompt: 'What is 2+2?')",
        ),
        ("def reward(completions, gold):\n    return [0.0] * len(completions)\n", "its parameter 'gold' is neither a dataset column nor a kwarg"),
    ],
)
def test_misbehaving_rewards_are_named_with_the_sample(tmp_path, source, expected):
    with pytest.raises(RewardError) as err:
        call(rewards_from(tmp_path, source))
    assert expected in str(err.value)


def test_load_errors(tmp_path):
    with pytest.raises(RewardError, match="reward file not found"):
        load_rewards([RewardConfig(name=f"{tmp_path}/missing.py:fn")])
    bad = tmp_path / "broken.py"
    bad.write_text("import not_a_real_module_xyz\n")
    with pytest.raises(RewardError, match=r"rewards.0.name: importing .* failed: ModuleNotFoundError"):
        load_rewards([RewardConfig(name=f"{bad}:fn")])
    with pytest.raises(RewardError, match="has no function 'nope'"):
        load_rewards([RewardConfig(name="rewards.format:nope")])
    with pytest.raises(RewardError, match="is not a built-in reward"):
        load_rewards([RewardConfig(name="accuracy")])
    with pytest.raises(RewardError, match=r"rewards.0.kwargs.bogus: reward 'reward' has no parameter 'bogus'"):
        rewards_from(tmp_path, "def reward(completions):\n    return [0.0] * len(completions)\n", bogus=1)
    with pytest.raises(RewardError, match="two rewards are named 'math_accuracy'"):
        load_rewards([RewardConfig(name="math_accuracy"), RewardConfig(name="math_accuracy")])


def test_a_reward_file_that_hangs_or_exits_while_importing_is_one_line(tmp_path, monkeypatch):
    """Importing a user's file runs its code under the deadline utility (user_functions.py): one that blocks at
    import time stops the resolve within GRPO_TRAINER_IMPORT_TIMEOUT, one that calls sys.exit is an error naming
    the key, not an exit of the run; the same file resolves once it behaves."""
    monkeypatch.setenv("GRPO_TRAINER_IMPORT_TIMEOUT", "1")
    hangs = tmp_path / "hangs.py"
    hangs.write_text("import time\ntime.sleep(600)\n\ndef fn(completions, **kw):\n    return [0.0] * len(completions)\n")
    with pytest.raises(RewardError, match=r"rewards.0.name: importing .*hangs.py.* took longer than 1s"):
        load_rewards([RewardConfig(name=f"{hangs}:fn")])
    exits = tmp_path / "exits.py"
    exits.write_text("import sys\nsys.exit(3)\n")
    with pytest.raises(RewardError, match=r"rewards.0.name: importing .*exits.py.* failed: SystemExit: 3"):
        load_rewards([RewardConfig(name=f"{exits}:fn")])
    fine = tmp_path / "fine.py"
    fine.write_text("def fn(completions, **kw):\n    return [1.0] * len(completions)\n")
    (reward,) = load_rewards([RewardConfig(name=f"{fine}:fn")])
    assert reward.name == "fn"


def test_a_users_file_is_a_module_its_objects_pickle_and_dataclasses_work(tmp_path):
    """A user's file is imported as a registered module (user_functions._module_name): its dataclasses work, its
    objects pickle (a checkpoint saves environment objects under async rollouts), and two files of one name in
    two folders stay two modules."""
    import pickle

    from grpo_trainer.user_functions import resolve_function

    source = ("from dataclasses import dataclass\n\n@dataclass\nclass Board:\n    cells: list\n\n"
              "def make(n):\n    return Board([{tag}] * n)\n")
    made = []
    for tag, folder in (("1", tmp_path / "a"), ("2", tmp_path / "b")):
        folder.mkdir()
        (folder / "board_env.py").write_text(source.format(tag=tag))
        made.append(resolve_function(f"{folder}/board_env.py:make", "environment.factory", "environment", RewardError)(2))
    assert [pickle.loads(pickle.dumps(board)) for board in made] == made
    assert [board.cells for board in made] == [[1, 1], [2, 2]]
    assert type(made[0]).__module__ != type(made[1]).__module__


@pytest.mark.slow
def test_a_users_own_rewards_py_does_not_shadow_the_built_ins(tmp_path, tiny_model_path):
    """The most natural file name for a user's reward is rewards.py. Run from its folder (first on sys.path),
    the built-ins must still resolve: they are never imported as the top-level name `rewards`."""
    import subprocess
    import sys

    from helpers import ROOT, small_run_overrides

    (tmp_path / "rewards.py").write_text("def my_reward(completions, **kwargs):\n    return [float(len(c) % 2) for c in completions]\n")
    (tmp_path / "run.yaml").write_text(
        (ROOT / "configs" / "demo_cpu.yaml").read_text().replace(
            "  - name: math_accuracy\n", "  - name: math_accuracy\n  - name: rewards.py:my_reward\n    weight: 0.5\n"
        )
    )
    result = subprocess.run(
        [sys.executable, "-m", "grpo_trainer", "train", "run.yaml", *small_run_overrides(tmp_path / "out")],
        cwd=tmp_path, capture_output=True, text=True, timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    from grpo_trainer.metrics import read_metrics

    rows = read_metrics(tmp_path / "out")
    assert len(rows) == 2 and all("rewards/math_accuracy/mean" in r and "rewards/my_reward/mean" in r for r in rows)


def test_built_ins_import_by_a_path_no_local_file_shadows():
    from grpo_trainer.rewards import math_accuracy

    assert math_accuracy(["q"], ["\\boxed{4}"], answer=["4"]) == [1.0]
    assert math_accuracy.__module__ == "grpo_trainer._builtin_rewards.math_answer"
