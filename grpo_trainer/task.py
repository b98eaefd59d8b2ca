"""A task: prompts and the rewards that score completions of them.

Training and evaluation share it, so a completion is decoded and scored in one
place: `Task.score` turns completion token ids into the TRL reward call
(prompts as the dataset holds them, completions as text or as assistant
messages for conversational data, every dataset column as a keyword list).
"""

from __future__ import annotations

import functools
import inspect
import logging
from dataclasses import dataclass
from typing import Any

from .config import DataConfig, EnvironmentConfig, RewardConfig
from .data import PromptSet, build_prompt_set, format_prompt, is_conversational, load_records
from .environments import Environment, EpisodeSpec, environment_seed
from .environments.scoring import REWARD_NAME, apply_on_error, environment_reward, named_environment_reward
from .errors import ConfigError, DataError
from .rewards import STANDARD_ARGS, Reward, RewardBatch, compute_rewards, load_rewards
from .rollout import Rollout

logger = logging.getLogger("grpo_trainer")


@dataclass
class Task:
    prompts: PromptSet
    rewards: list[Reward]
    tokenizer: Any
    prompt_column: str
    answer_column: str
    conversational: bool  # message-list prompts: completions reach the rewards as message lists too (TRL's rule)
    on_error: str = "zero"  # environment.on_error: how episodes the environment failed are scored
    data: DataConfig | None = None  # for prompts extended by an environment's reset text
    tools: list[dict[str, Any]] | None = None  # the tool schemas the prompts show
    environment: Environment | None = None  # the run's, that plays this task's episodes (rollout.tools' included)
    max_context: int | None = None

    def __len__(self) -> int:
        return len(self.prompts)

    def prompt_ids(self, indices: list[int]) -> list[list[int]]:
        return [self.prompts.token_ids[i] for i in indices]

    def episode_spec(self, index: int, group_seed: int, episode_id: str) -> EpisodeSpec:
        """What the episodes of prompt `index` start from: its row, the environment seed of a group whose sampling
        seed would be `group_seed`, and the prompt extended by a reset text."""
        return EpisodeSpec(
            self.prompts.records[index],
            environment_seed(group_seed),
            episode_id,
            functools.partial(self.extend_prompt, index),
        )

    def extend_prompt(self, index: int, text: str) -> list[int]:
        """Prompt `index` with `text` appended to its (last) user message (TRL's rule for reset texts), formatted and
        tokenized as the prompts are; a DataError if it no longer fits."""
        assert self.data is not None, "a Task made without its data config cannot extend prompts"
        prompt = self.prompts.records[index][self.prompt_column]
        if isinstance(prompt, str):
            prompt = prompt + text
        else:
            prompt = [*prompt[:-1], {**prompt[-1], "content": prompt[-1]["content"] + text}]
        formatted = format_prompt(self.data, self.tokenizer, prompt, index, self.tools)
        ids = self.tokenizer(formatted, add_special_tokens=not self.data.use_chat_template)["input_ids"]
        limit = self.data.max_prompt_length or self.max_context
        if limit and len(ids) > limit:
            raise DataError(
                f"record {index}: with the environment's reset text the prompt has {len(ids)} tokens, more than {limit}"
            )
        return ids

    def score(self, prompt_rows: list[int], rollout: Rollout) -> RewardBatch:
        """Rewards of completion j, which continues prompt `prompt_rows[j]`.

        A multi-turn completion (environment.tools, environments) reaches the rewards as its messages, whatever the
        prompt's form, with its tool-call count as `tool_calls`; an episode also as `environments` (what its
        environment's snapshot() gave: TRL's objects) and `episodes` (its EpisodeRecord). Episodes the environment
        failed are then scored by environment.on_error (environments/scoring.py)."""
        columns: dict[str, Any] = self.prompts.reward_columns(prompt_rows, self.answer_column)
        if rollout.conversations is not None:
            completions: list[Any] = rollout.conversations
            columns = {**columns, "tool_calls": rollout.tool_calls}
        else:
            texts = self.tokenizer.batch_decode(rollout.completion_ids, skip_special_tokens=True)
            completions = [[{"role": "assistant", "content": t}] for t in texts] if self.conversational else texts
        if rollout.episodes is not None:
            environments = rollout.environments or [None] * len(rollout.episodes)
            columns = {**columns, "environments": environments, "episodes": rollout.episodes}
        batch = compute_rewards(
            self.rewards,
            prompts=[self.prompts.records[i][self.prompt_column] for i in prompt_rows],
            completions=completions,
            completion_ids=rollout.completion_ids,
            columns=columns,
        )
        if rollout.episodes is not None:
            apply_on_error(batch, rollout.episodes, self.on_error)
        return batch


def load_task(
    data: DataConfig,
    rewards: list[RewardConfig],
    tokenizer,
    max_context: int | None,
    split: str | None = None,
    policy_dtype: str = "float32",
    tools: list[dict[str, Any]] | None = None,
    environment: Environment | None = None,
    environment_config: EnvironmentConfig | None = None,
) -> Task:
    """Load and tokenize the prompts of `data` (its split, or `split`) and resolve the rewards; fail before training.

    `policy_dtype` (the policy's model.dtype) is the dtype of reward models whose own `dtype` is `auto`;
    `tools` (environment.tools' schemas) are shown to the model through the chat template. With an `environment`
    (built from `environment_config`, the `environment` section), its tools are shown instead and its own reward,
    if it has one, is one more reward (environments/scoring.py).
    """
    player = getattr(environment, "player", None)
    if getattr(player, "prompts_from_taskset", False):  # environment.verifiers without data.source: its taskset
        records = player.taskset_rows(data.num_samples)  # type: ignore[union-attr]
    else:
        records = load_records(data, split=split)
    reward_fns = load_rewards(rewards, policy_dtype=policy_dtype)
    on_error = "zero"
    if environment is not None and environment_config is not None and environment_config.kind is not None:
        tools, on_error = environment.tools or None, environment_config.on_error
        if environment.has_reward:
            if REWARD_NAME in [r.name for r in reward_fns]:
                raise ConfigError(
                    f"rewards: the name {REWARD_NAME!r} is the environment's own reward; give yours an alias"
                )
            reward_fns.append(environment_reward(environment_config.reward_weight))
        for name, weight in (getattr(environment, "reward_names", None) or {}).items():  # an agent's named rewards
            reward_fns.append(named_environment_reward(name, weight))
        if not reward_fns:
            raise ConfigError(
                f"rewards: none configured, and {environment.name} has no get_reward(): nothing scores the episodes"
            )
    records = rows_every_reward_can_score(records, reward_fns, data)
    return Task(
        prompts=build_prompt_set(data, tokenizer, records, max_context, tools),
        rewards=reward_fns,
        tokenizer=tokenizer,
        prompt_column=data.prompt_column,
        answer_column=data.answer_column,
        conversational=is_conversational(records, data.prompt_column),
        on_error=on_error,
        data=data,
        tools=tools,
        environment=environment,
        max_context=max_context,
    )


def rows_every_reward_can_score(
    records: list[dict[str, Any]], rewards: list[Reward], data: DataConfig
) -> list[dict[str, Any]]:
    """The records, after checking that each has a value in every column a reward reads.

    A record without its answer can never be rewarded: training on it silently wastes its samples. So such
    records are an error naming the column, the reward and the first record, unless `data.skip_invalid_rows`,
    which leaves them out and says how many.
    """
    invalid: dict[int, tuple[str, Reward]] = {}
    for reward in rewards:
        for column in columns_read(reward, records[0].keys(), data.answer_column):
            for i, record in enumerate(records):
                if i not in invalid and record.get(column) in (None, ""):
                    invalid[i] = (column, reward)
    if not invalid:
        return records
    first = min(invalid)
    column, reward = invalid[first]
    if not data.skip_invalid_rows:
        raise DataError(
            f"data: {len(invalid)} of {len(records)} records (the first: record {first}) have no value in column "
            f"{column!r}, which reward '{reward.name}' ({reward.where}) reads; fix the data, or set "
            "data.skip_invalid_rows=true to leave them out"
        )
    kept = [record for i, record in enumerate(records) if i not in invalid]
    if not kept:
        raise DataError(f"data: every record lacks a value in column {column!r}, which reward '{reward.name}' reads")
    logger.warning(
        "data: left out %d of %d records with no value in a column a reward reads (the first: record %d, "
        "column %r; data.skip_invalid_rows)",
        len(invalid),
        len(records),
        first,
        column,
    )
    return kept


def columns_read(reward: Reward, columns, answer_column: str) -> list[str]:
    """The dataset columns a reward reads, as far as its signature tells: parameters named after a column (or
    `answer`, which the trainer fills from data.answer_column), and built-ins' `*_column` settings
    (math_accuracy's `answer_column`, code_tests' `tests_column`). A `**kwargs` catch-all tells nothing."""
    params = inspect.signature(reward.fn).parameters
    names = []
    for name, param in params.items():
        if param.kind in (inspect.Parameter.VAR_KEYWORD, inspect.Parameter.VAR_POSITIONAL) or name in STANDARD_ARGS:
            continue
        if name.endswith("_column") and isinstance(reward.kwargs.get(name, param.default), str):
            names.append(reward.kwargs.get(name, param.default))
        elif name not in reward.kwargs and (name in columns or name == "answer"):
            names.append(name)
    return [answer_column if name == "answer" and "answer" not in columns else name for name in dict.fromkeys(names)]
