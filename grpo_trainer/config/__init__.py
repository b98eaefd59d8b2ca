"""The one configuration tree: YAML maps 1:1 onto these pydantic models, one module per section.

Every key has a type, a default and a one-line description (docs/config_reference.md
is generated from them). Unknown keys, wrong types and impossible
combinations fail at load time with the key's dotted path and, for a misspelt
key, the nearest valid one.

A config is read in two steps: keys of earlier versions are moved to their places (migrate.py, one table),
then the tree validates it (root.py and a module per section).

Command-line overrides are dotted paths (`train.max_steps=50`,
`rewards.0.weight=2`); values are parsed as YAML scalars, so `true`, `3e-6` and
`[jsonl, tensorboard]` mean what they look like.
"""

from .base import CHANGES_MEANING, HARMLESS_ON_RESUME
from .checkpoint import CheckpointConfig
from .data import DataConfig
from .environment import ENVIRONMENT_KINDS, EnvironmentConfig
from .eval import EvalConfig
from .load import MOVED_KEYS, apply_override, config_from_dict, load_config, merged, read_config_file, set_dotted
from .logging import LoggingConfig, TrackerName
from .loss import LossConfig, ScaleRewards
from .model import LoraConfig, ModelConfig
from .paths import with_absolute_paths
from .rewards import REWARD_MODEL_NAME, RewardConfig, RewardModelConfig
from .rollout import HFEngineConfig, RolloutConfig, VLLMConfig, VLLMServerConfig, check_server_url
from .root import Config, resume_effect
from .teacher import TeacherConfig
from .train import TrainConfig

__all__ = [
    "CHANGES_MEANING",
    "ENVIRONMENT_KINDS",
    "HARMLESS_ON_RESUME",
    "MOVED_KEYS",
    "REWARD_MODEL_NAME",
    "CheckpointConfig",
    "Config",
    "DataConfig",
    "EnvironmentConfig",
    "EvalConfig",
    "HFEngineConfig",
    "LoggingConfig",
    "LoraConfig",
    "LossConfig",
    "ModelConfig",
    "RewardConfig",
    "RewardModelConfig",
    "RolloutConfig",
    "ScaleRewards",
    "TeacherConfig",
    "TrackerName",
    "TrainConfig",
    "VLLMConfig",
    "VLLMServerConfig",
    "apply_override",
    "check_server_url",
    "config_from_dict",
    "load_config",
    "merged",
    "read_config_file",
    "resume_effect",
    "set_dotted",
    "with_absolute_paths",
]
