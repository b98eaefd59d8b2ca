"""environment.verifiers (grpo_trainer/agents/verifiers_env.py): the real verifiers 0.4 package against the real
token endpoint on loopback, builtin:tiny-guess on the hf engine.

Each test attacks one property: a group of episodes of configs/verifiers_guess.py trains on exactly what the
endpoint sampled (tokens, loss mask, sampler log-probs) and carries verifiers' reward and signals; an environment
that fails is a failed episode, not an error; a harness that would download, or a runtime that is not local, is
refused in one line; the taskset's rows, and when `data:` wins over them.
"""

from __future__ import annotations

import asyncio
import textwrap

import pytest

pytest.importorskip("verifiers.v1", reason="verifiers 0.4 is not installed (the dev extra installs it)")

from grpo_trainer.agents.endpoint import TokenEndpoint  # noqa: E402
from grpo_trainer.agents.sampler import HFTokenSampler  # noqa: E402
from grpo_trainer.agents.verifiers_env import (  # noqa: E402
    VerifiersEnvError,
    VerifiersPlayer,
    build,
    load_environment,
    taskset_gives_rows,
)
from grpo_trainer.config import Config, ModelConfig  # noqa: E402
from grpo_trainer.environments.checks import check_environment  # noqa: E402
from grpo_trainer.errors import ConfigError  # noqa: E402
from grpo_trainer.models import load_causal_lm, load_tokenizer  # noqa: E402
from grpo_trainer.rollout import SamplingSettings  # noqa: E402
from grpo_trainer.rollout.hf import HFEngine  # noqa: E402
from grpo_trainer.task import load_task  # noqa: E402

pytestmark = pytest.mark.slow  # loads a model, starts servers

GUESS = "configs/verifiers_guess.py"
BUDGET = 128


@pytest.fixture(scope="module")
def policy():
    model = ModelConfig(name_or_path="builtin:tiny-guess")
    tokenizer, lm = load_tokenizer(model), load_causal_lm(model)
    settings = SamplingSettings(eos_token_ids=[tokenizer.eos_token_id], max_completion_length=BUDGET, temperature=1.0)
    engine = HFEngine(settings, get_model=lambda: lm, pad_token_id=tokenizer.pad_token_id)
    sampler = HFTokenSampler(engine, max_batch=8)
    with TokenEndpoint(sampler, tokenizer, seed=3) as endpoint:
        yield tokenizer, endpoint, sampler


def play_group(player, endpoint, rows, step=0):
    """Each row played once, concurrently, as the agent engine does: (Played, the endpoint's record) per row."""
    episodes = [endpoint.open_episode(step=step, index=i, budget=BUDGET) for i in range(len(rows))]

    async def plays():
        return await asyncio.gather(
            *(player.play(dict(row), ep, seed=i) for i, (row, ep) in enumerate(zip(rows, episodes)))
        )

    played = asyncio.run(plays())
    return list(zip(played, [endpoint.close_episode(ep.session_id) for ep in episodes]))


def test_a_group_trains_on_what_the_endpoint_sampled_with_verifiers_reward(policy):
    tokenizer, endpoint, _ = policy
    player = VerifiersPlayer(GUESS, tokenizer, max_tokens=8)
    try:
        row = player.taskset_rows(3)[2]
        assert row == {"prompt": "Guess my number, 1-8", "secret": 3}
        results = play_group(player, endpoint, [row] * 6)
    finally:
        player.close()
    rewards = []
    for played, record in results:
        assert played.ok and played.error is None, played.error
        assert played.stop_condition == "user_closed" and "user_closed" in player.stop_conditions
        (branch,) = played.branches  # one conversation, extended turn by turn: one sample
        (recorded,) = record.branches()
        assert branch.prompt_ids == recorded.prompt_ids
        assert branch.completion_ids == recorded.completion_ids
        assert branch.completion_mask == recorded.completion_mask
        assert branch.logprobs == pytest.approx(recorded.logprobs, abs=1e-6)
        turns = len(record.turns)
        assert 1 <= turns <= 4 and played.counters["verifiers/turns"] == turns
        assert played.counters["verifiers/tokens"] == record.tokens_used == sum(branch.completion_mask)
        assert played.counters["verifiers/branches"] == 1 and played.counters["verifiers/errors"] == 0
        # the reward is verifiers' (the task's @reward `won`), and it says whether the last reply was the secret
        last_reply = tokenizer.decode(record.turns[-1].completion_ids, skip_special_tokens=True).strip()
        assert played.reward == played.counters["verifiers/reward/won"] == float(last_reply == "3")
        assert played.counters["verifiers/metric/guesses"] == turns
        assert played.messages[0] == {"role": "user", "content": "Guess my number, 1-8"}
        assert set(played.counters) <= set(player.counter_names)
        rewards.append(played.reward)
    assert set(rewards) <= {0.0, 1.0}


def test_training_then_evaluation_on_another_loop_and_endpoint_plays_every_episode(policy):
    """The run's evaluation plays on a loop and an endpoint of its own, after training's: nothing bound to the
    first loop (verifiers' serving, renderers' lock around its first GET /v1/models) may fail the second."""
    tokenizer, endpoint, sampler = policy
    player = VerifiersPlayer(GUESS, tokenizer, max_tokens=8)
    try:
        rows = player.taskset_rows(4)
        trained = play_group(player, endpoint, rows, step=5)
        with TokenEndpoint(sampler, tokenizer, seed=4) as evaluation:
            evaluated = play_group(player, evaluation, rows, step=0)
    finally:
        player.close()
    for played, record in trained + evaluated:
        assert played.ok, played.error
        assert played.counters["verifiers/tokens"] == record.tokens_used > 0


FAILING = """
import verifiers.v1 as vf
from grpo_trainer.agents.vf_harness import InProcessChatHarness
__all__ = ["Tasks", "Broken", "InProcessChatHarness"]

class Tasks(vf.Taskset):
    def load(self):
        yield vf.Task(vf.TaskData(prompt="Guess my number, 1-8"), self.config.task)

class BrokenConfig(vf.EnvConfig):
    player: vf.AgentConfig = vf.AgentConfig()

class Broken(vf.Env[BrokenConfig]):
    async def run(self, task, agents):
        async with agents.player.interaction(task) as game:
            await game.turn()
            raise RuntimeError("the game engine crashed\\nsecond line")
"""


def test_an_environment_that_fails_is_a_failed_episode_not_an_error(policy, tmp_path):
    tokenizer, endpoint, _ = policy
    path = tmp_path / "broken_env.py"
    path.write_text(FAILING)
    player = VerifiersPlayer(str(path), tokenizer, max_tokens=8)  # its prime runtime is moved to subprocess
    try:
        ((played, record),) = play_group(player, endpoint, player.taskset_rows(), step=1)
    finally:
        player.close()
    assert not played.ok and played.reward is None
    assert "the game engine crashed" in played.error and "\n" not in played.error
    assert played.counters["verifiers/errors"] >= 1
    assert played.stop_condition in player.stop_conditions  # verifiers' `error`: counted under its own name
    assert len(record.turns) == 1  # it sampled before it failed


def write_env(tmp_path, name, body):
    path = tmp_path / f"{name}.py"
    path.write_text(textwrap.dedent(body))
    return str(path)


def test_a_harness_that_downloads_or_a_remote_runtime_is_refused_in_one_line(tmp_path):
    # No harness exported: verifiers' default is `bash`, which uv-syncs a script at run time.
    downloads = write_env(
        tmp_path,
        "plain_env",
        """
        import verifiers.v1 as vf
        __all__ = ["Tasks"]
        class Tasks(vf.Taskset):
            def load(self):
                yield vf.Task(vf.TaskData(prompt="hi"), self.config.task)
        """,
    )
    with pytest.raises(VerifiersEnvError, match="downloads its program") as refused:
        load_environment(downloads)
    assert "\n" not in str(refused.value) and "'bash'" in str(refused.value)
    docker = write_env(
        tmp_path,
        "docker_env",
        """
        import verifiers.v1 as vf
        from grpo_trainer.agents.vf_harness import InProcessChatHarness
        __all__ = ["Tasks", "DockerEnv", "InProcessChatHarness"]
        class Tasks(vf.Taskset):
            def load(self):
                yield vf.Task(vf.TaskData(prompt="hi"), self.config.task)
        class DockerConfig(vf.EnvConfig):
            player: vf.AgentConfig = vf.AgentConfig(runtime={"type": "docker"})
        class DockerEnv(vf.Env[DockerConfig]):
            async def run(self, task, agents):
                await agents.player.run(task)
        """,
    )
    with pytest.raises(VerifiersEnvError, match="only the local 'subprocess' runtime"):
        load_environment(docker)
    empty = write_env(tmp_path, "empty_env", "__all__ = []\n")
    with pytest.raises(VerifiersEnvError, match="exports no Taskset subclass"):
        load_environment(empty)
    with pytest.raises(VerifiersEnvError, match="cannot import it"):
        load_environment("no_such_verifiers_env_module")
    # what `train` and `validate` check before the model loads: the same line, a ConfigError naming the key
    cfg = Config.model_validate({"environment": {"verifiers": downloads}})
    with pytest.raises(ConfigError, match=r"^environment\.verifiers .*downloads its program"):
        check_environment(cfg, contact_server=False)


def test_a_module_that_hangs_or_raises_while_loading_is_refused_in_one_line(tmp_path):
    """Importing the module and building its Env are user code: run under the deadline utility, so a module that
    hangs stops the run within environment.step_timeout, and one that raises or exits is one line."""
    import time

    hangs = write_env(tmp_path, "hangs_env", "import time\ntime.sleep(30)\n")
    tick = time.perf_counter()
    with pytest.raises(VerifiersEnvError, match=r"longer than 1s \(environment.step_timeout\)") as refused:
        load_environment(hangs, limit=1.0)
    assert time.perf_counter() - tick < 25  # a bound on hanging (its sleep is 30 s), not a speed
    assert "\n" not in str(refused.value)
    for name, body in (("raises_env", "raise RuntimeError('broken')\n"), ("exits_env", "import sys\nsys.exit(3)\n")):
        with pytest.raises(VerifiersEnvError, match="loading it raised") as refused:
            load_environment(write_env(tmp_path, name, body), limit=10.0)
        assert "\n" not in str(refused.value)


def test_the_taskset_gives_the_rows_unless_data_is_given_explicitly(policy):
    tokenizer = policy[0]
    cfg = Config.model_validate({"model": {"name_or_path": "builtin:tiny-guess"}, "environment": {"verifiers": GUESS}})
    environment = build(cfg)
    try:
        assert environment.player.prompts_from_taskset
        task = load_task(cfg.data, [], tokenizer, 2048, environment=environment, environment_config=cfg.environment)
        assert len(task.prompts.records) == 96
        assert {r["secret"] for r in task.prompts.records} == set(range(1, 9))
        # evaluation's data is a copy with its own source and count: still the taskset's rows
        evaluation = cfg.data.model_copy(update={"source": "builtin:arithmetic", "num_samples": 5})
        task = load_task(evaluation, [], tokenizer, 2048, environment=environment, environment_config=cfg.environment)
        assert [r["secret"] for r in task.prompts.records] == [1, 2, 3, 4, 5]
    finally:
        environment.player.close()
    given = cfg.model_copy(update={"data": Config.model_validate({"data": {"source": "builtin:arithmetic"}}).data})
    assert taskset_gives_rows(cfg) and not taskset_gives_rows(given)


def test_a_verifiers_environment_trains_from_the_cli(tmp_path):
    """configs/verifiers_guess_cpu.yaml from the CLI, shrunk to one step of 2 prompts x 4 episodes: the episodes are
    played through the run's endpoint, verifiers' reward is the `environment` reward, its signals and stop
    conditions are logged, and what was trained is what the endpoint sampled (the hf engine's gap: float rounding)."""
    from grpo_trainer.metrics import read_metrics
    from helpers import run_cli

    out = tmp_path / "run"
    result = run_cli(["train", "configs/verifiers_guess_cpu.yaml", f"output_dir={out}", "train.max_steps=1",
                      "train.prompts_per_step=2", "rollout.num_generations=4", "train.micro_batch_size=8",
                      "eval.every=0", "checkpoint.save_final_model=false", "logging.progress_bar=false"])
    assert result.returncode == 0, result.stderr[-3000:]
    (r,) = read_metrics(out)
    assert r["environment/agent/episodes"] == 8 and r["environment/errors"] == 0
    assert 8 <= r["environment/agent/requests"] <= 32  # 1-4 guesses a game
    assert r["environment/agent/verifiers/turns"] == r["environment/agent/requests"]
    assert r["environment/agent/verifiers/reward/won"] == 8 * r["rewards/environment/mean"]
    stops = {k.removeprefix("environment/agent/stop/"): v for k, v in r.items() if k.startswith("environment/agent/stop/")}
    assert sum(stops.values()) == 8 and stops["user_closed"] > 0 and stops["none"] == stops["other"] == 0, stops
    assert r["sampling/logp_diff_max"] < 1e-4
