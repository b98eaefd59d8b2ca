"""grpo-trainer: GRPO-family RL fine-tuning for causal LMs with verifiable rewards.

Entry points: `python -m grpo_trainer train CONFIG` and `grpo_trainer.train(cfg)`.
"""

from .config import Config, load_config

__version__ = "0.1.0"


def train(cfg: Config, on_step_end=None):
    """Run training for a loaded config; `on_step_end(step)` is called after each step (see grpo_trainer.trainer.train)."""
    from .trainer import train as _train

    return _train(cfg, on_step_end=on_step_end)


__all__ = ["Config", "load_config", "train", "__version__"]
