"""Example custom rewards, used by configs/custom_reward.yaml.

A reward is a plain Python function with TRL's signature:

    fn(prompts, completions, completion_ids=None, **kwargs) -> list[float | None]

- `prompts`: one entry per completion (a prompt repeated rollout.num_generations times in a row).
- `completions`: the generated texts; for chat-message datasets, message lists
  `[{"role": "assistant", "content": ...}]` instead of strings.
- `completion_ids`: the generated token ids of each completion (EOS included, if it was generated).
- every dataset column as a keyword list aligned with `completions` (here `answer` and `prompt`),
  plus the `kwargs:` given in the YAML.
- return one value per completion: a float, or None for "no opinion on this sample"
  (it is left out of its group's statistics). Returning a wrong number of values, a
  non-number or +-inf, or raising, stops the run with a message naming the reward and the sample.

A function that takes `**kwargs` receives everything; one without it receives only
the arguments it names. `async def` rewards run concurrently with each other (useful
for rewards that wait on a remote judge or a sandbox). Reference one in YAML as
`path/to/this_file.py:function_name`, relative to the directory you launch from.
"""

from __future__ import annotations

import asyncio
import re

BOXED = re.compile(r"\\boxed\{([^{}]*)\}")


def _text(completion) -> str:
    """The generated text, for plain-string and chat-message completions alike."""
    if isinstance(completion, str):
        return completion
    return completion[-1]["content"] if completion else ""  # conversational: the assistant's message


def concise_answer(prompts, completions, completion_ids=None, answer=None, target_tokens: int = 12, **kwargs):
    """A bonus for correct answers that are short: 1.0 up to `target_tokens` tokens, then falling linearly to 0 at twice that.

    Uses the token ids (`completion_ids`), so "short" is measured in the model's tokens, and the
    dataset column `answer` (its name in the data; data.answer_column is also passed as `answer`).
    Wrong or missing answers get 0.0: brevity alone earns nothing. A sample without a reference
    answer gets None: this reward has no opinion on it.
    """
    if answer is None:  # the dataset has no `answer` column: no opinion on any sample
        return [None] * len(completions)
    rewards = []
    for completion, ids, gold in zip(completions, completion_ids, answer):
        if gold is None:
            rewards.append(None)
            continue
        boxed = BOXED.findall(_text(completion))
        if not boxed or boxed[-1].strip() != str(gold).strip():
            rewards.append(0.0)
            continue
        excess = max(0, len(ids) - target_tokens)
        rewards.append(max(0.0, 1.0 - excess / target_tokens))
    return rewards


async def has_boxed_answer(completions, max_concurrency: int = 8, **kwargs):
    """1.0 when the completion ends its answer in \\boxed{...}, else 0.0: a format reward, written async.

    Async rewards suit scoring that waits on something (an HTTP judge, a code sandbox): the
    trainer awaits all async rewards of a batch together. Here the "remote call" is simulated;
    the semaphore shows how to cap concurrent requests to a real service.
    """
    limit = asyncio.Semaphore(max_concurrency)

    async def score(completion) -> float:
        async with limit:
            await asyncio.sleep(0)  # stand-in for `await client.post(...)`
            return 1.0 if BOXED.search(_text(completion)) else 0.0

    return list(await asyncio.gather(*(score(c) for c in completions)))
