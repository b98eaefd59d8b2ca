"""grpo-trainer: GRPO-family RL fine-tuning for causal LMs with verifiable rewards.

Entry points: `python -m grpo_trainer train CONFIG` and, from Python, `grpo_trainer.train(config, overrides,
train_dataset=..., rewards=[...], model=..., tokenizer=...)` (api.py, docs/python_api.md).
"""

from .api import train
from .config import Config, load_config

__version__ = "0.1.0"

__all__ = ["Config", "load_config", "train", "__version__"]
