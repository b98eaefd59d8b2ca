"""Errors meant for the person running the trainer.

The CLI prints these as one clear message (no stack trace) and exits non-zero;
anything else is a bug and keeps its traceback.
"""


class UserError(Exception):
    """A problem with the user's config, data, model or reward, phrased so they can fix it."""


class ConfigError(UserError, ValueError):
    """The YAML config or a command-line override is invalid."""


class DataError(UserError):
    """The dataset or a prompt cannot be used as configured."""


class RewardError(UserError):
    """A reward function cannot be loaded, or misbehaved on a batch."""


class TrainingError(UserError):
    """Training cannot continue (e.g. repeated non-finite losses, incompatible resume)."""
