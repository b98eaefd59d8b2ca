"""Every recipe in configs/ loads and validates (configs/accelerate/ holds Accelerate's own files, not ours).

A recipe that drifts from the config schema (a renamed key, a wrong type) fails here
instead of in front of a user. The loss recipes also keep the settings that define them.
"""

from __future__ import annotations

import operator
from pathlib import Path

import pytest

from grpo_trainer.config import load_config

CONFIGS = Path(__file__).resolve().parent.parent / "configs"
RECIPES = sorted(CONFIGS.glob("*.yaml"))  # top level only: configs/accelerate/ is not ours


def test_recipes_are_found():
    names = {p.name for p in RECIPES}
    assert {"demo_cpu.yaml", "dapo.yaml", "dr_grpo.yaml", "gspo.yaml", "cispo.yaml", "sapo.yaml", "luspo.yaml",
            "vespo.yaml"} <= names


@pytest.mark.parametrize("path", RECIPES, ids=lambda p: p.name)
def test_recipe_validates(path):
    cfg = load_config(path)
    assert cfg.rewards or cfg.environment.kind  # a recipe always says what it rewards: functions, or an environment


@pytest.mark.parametrize(
    "name, loss_type, expected",
    [
        ("dapo.yaml", "dapo", {"options.epsilon_low": 0.2, "options.epsilon_high_value": 0.28, "beta": 0.0,
                               "mask_truncated_completions": True}),
        ("dr_grpo.yaml", "dr_grpo", {"scale_rewards": "none"}),
        ("gspo.yaml", "gspo", {"options.epsilon_low": 3.0e-4, "options.epsilon_high_value": 4.0e-4}),
        ("cispo.yaml", "cispo", {"options.epsilon_high": 0.28}),
        ("sapo.yaml", "sapo", {"options.temperature_pos": 1.0, "options.temperature_neg": 1.05}),
        ("luspo.yaml", "luspo", {"options.epsilon_low": 2.0e-3, "options.epsilon_high_value": 2.5e-3}),
        ("vespo.yaml", "vespo", {"options.k_pos": 2.0, "options.lambda_pos": 3.0, "options.k_neg": 3.0,
                                 "options.lambda_neg": 2.0}),
    ],
)
def test_loss_recipes_keep_their_defining_settings(name, loss_type, expected):
    cfg = load_config(CONFIGS / name)
    assert cfg.loss.type == loss_type
    for key, value in expected.items():
        assert operator.attrgetter(key)(cfg.loss) == value, key
    # Runnable on a CPU: the embedded tiny model and task.
    assert cfg.model.name_or_path == "builtin:tiny" and cfg.data.source == "builtin:arithmetic"


def test_dapo_recipe_has_the_soft_overlong_punishment():
    cfg = load_config(CONFIGS / "dapo.yaml")
    overlong = [r for r in cfg.rewards if r.name == "overlong_penalty"]
    assert len(overlong) == 1 and overlong[0].weight == 1.0
    assert overlong[0].kwargs["max_length"] == cfg.rollout.max_completion_length
    assert 0 < overlong[0].kwargs["buffer"] < overlong[0].kwargs["max_length"]
