"""A task: prompts and the rewards that score completions of them.

Training and evaluation share it, so a completion is decoded and scored in one
place: `Task.score` turns completion token ids into the TRL reward call
(prompts as the dataset holds them, completions as text or as assistant
messages for conversational data, every dataset column as a keyword list).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .config import DataConfig, RewardConfig
from .data import PromptSet, build_prompt_set, is_conversational, load_records
from .rewards import Reward, RewardBatch, compute_rewards, load_rewards


@dataclass
class Task:
    prompts: PromptSet
    rewards: list[Reward]
    tokenizer: Any
    prompt_column: str
    answer_column: str
    conversational: bool  # message-list prompts: completions reach the rewards as message lists too (TRL's rule)

    def __len__(self) -> int:
        return len(self.prompts)

    def prompt_ids(self, indices: list[int]) -> list[list[int]]:
        return [self.prompts.token_ids[i] for i in indices]

    def score(self, prompt_rows: list[int], completion_ids: list[list[int]]) -> RewardBatch:
        """Rewards of completion j, which continues prompt `prompt_rows[j]`."""
        texts = self.tokenizer.batch_decode(completion_ids, skip_special_tokens=True)
        return compute_rewards(
            self.rewards,
            prompts=[self.prompts.records[i][self.prompt_column] for i in prompt_rows],
            completions=[[{"role": "assistant", "content": t}] for t in texts] if self.conversational else texts,
            completion_ids=completion_ids,
            columns=self.prompts.reward_columns(prompt_rows, self.answer_column),
        )


def load_task(
    data: DataConfig, rewards: list[RewardConfig], tokenizer, max_context: int | None, split: str | None = None
) -> Task:
    """Load and tokenize the prompts of `data` (its split, or `split`) and resolve the rewards; fail before training."""
    records = load_records(data, split=split)
    return Task(
        prompts=build_prompt_set(data, tokenizer, records, max_context),
        rewards=load_rewards(rewards),
        tokenizer=tokenizer,
        prompt_column=data.prompt_column,
        answer_column=data.answer_column,
        conversational=is_conversational(records, data.prompt_column),
    )
