"""GSM8K's gold answers end in `#### 42` after a worked solution: score against that final number.

A thin wrapper around the built-in `math_accuracy`, and an example of adapting a dataset's
answer format in a reward rather than in a preprocessing step.
"""

from grpo_trainer.rewards import math_accuracy  # the built-in, by a path no local rewards.py can shadow


def gsm8k_accuracy(prompts, completions, completion_ids=None, answer=None, **kwargs):
    finals = [a.split("####")[-1].strip().replace(",", "") for a in answer]
    return math_accuracy(prompts, completions, completion_ids, final_answer=finals, answer_column="final_answer", **kwargs)
