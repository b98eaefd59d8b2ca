"""The loss registry (grpo_trainer/losses.py: LOSS_VARIANTS): a loss type added from one module trains, a user's
own type by import path with its own options model, the flat option keys of earlier versions still load, the
surrogates take per-token advantages, and every list of the loss types (pyproject, README, docs) is the registry's.
The math of the built-in types is pinned in tests/test_losses.py.
"""

from __future__ import annotations

import math
import re
import tomllib
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from pydantic import Field

from grpo_trainer import losses
from grpo_trainer.batches import MicroBatch
from grpo_trainer.config import config_from_dict, load_config
from grpo_trainer.config_reference import REGENERATE_LOSS_FAMILY, with_loss_family_table
from grpo_trainer.errors import ConfigError
from grpo_trainer.losses import LOSS_TYPES, LOSS_VARIANTS, LossOptions, LossVariant, register_loss
from grpo_trainer.metrics import read_metrics
from helpers import run_in_fork, small_run_overrides

ROOT = Path(__file__).resolve().parent.parent


# ----------------------------------------------------------------------------- a loss type from this module alone


class CappedOptions(LossOptions):
    cap: float = Field(1.0, gt=0, description="|A| is capped at this before it weighs the token's log-prob.")


def capped_reinforce(inputs: losses.TokenInputs, options: CappedOptions):
    """-clamp(A_t, -cap, cap) log pi_theta: REINFORCE with a capped advantage (a type no built-in computes)."""
    loss = -inputs.advantages.clamp(-options.cap, options.cap) * inputs.logp
    nothing = torch.zeros_like(loss, dtype=torch.bool)
    return loss, nothing, nothing


CAPPED = LossVariant("capped_reinforce", capped_reinforce, "sequence_sum", CappedOptions, "a test's own",
                     exact_zero_advantage_skip=True)


@pytest.fixture
def registered():
    """CAPPED registered for one test, as a user's code would (register_loss); the registry restored afterwards."""
    yield register_loss(CAPPED)
    del LOSS_VARIANTS[CAPPED.name]


def test_a_loss_type_registered_from_one_module_computes_the_trainers_loss(registered):
    cfg = load_config(None, ["loss.type=capped_reinforce", "loss.options.cap=0.5", "train.prompts_per_step=1",
                             "rollout.num_generations=2", "train.micro_batch_size=2"])
    assert cfg.loss.variant is CAPPED and cfg.loss.options == CappedOptions(cap=0.5)
    # update.micro_batch_loss, as a step calls it: completions A = +2 (capped to 0.5) and -0.25, one token of
    # padding. Per-token loss -clamp(A) logp: [0.5, 1.0] and [-0.25 x 0.5 = -0.125]; sequence_sum over the
    # 2 completions of the batch: (0.5 + 1.0 - 0.125) / 2 = 0.6875.
    from grpo_trainer.batches import TrainBatch
    from grpo_trainer.geometry import batch_geometry
    from grpo_trainer.update import LossSettings, micro_batch_loss

    logp = torch.tensor([[-1.0, -2.0], [-0.5, -7.0]])
    mb = MicroBatch(sequences={}, mask=torch.tensor([[1.0, 1.0], [1.0, 0.0]]), advantages=torch.tensor([2.0, -0.25]))
    batch = TrainBatch([mb], torch.tensor([2.0, 1.0]), 2, 3.0, mini_batch_totals=[3.0], mini_batch_rows=[2], window_sizes=[1])
    share, parts = micro_batch_loss(batch, mb, logp, LossSettings.of(cfg, batch_geometry(cfg, 1)))
    assert share.item() == pytest.approx(0.6875, abs=1e-7)
    assert parts["clip_region"].item() == 0
    with pytest.raises(ConfigError, match="options.cap: Input should be greater than 0"):
        load_config(None, ["loss.type=capped_reinforce", "loss.options.cap=0"])
    with pytest.raises(ValueError, match="already registered"):
        register_loss(LossVariant("capped_reinforce", capped_reinforce, "batch_token_mean", CappedOptions))
    with pytest.raises(ValueError, match="':' marks an import path"):
        register_loss(LossVariant("a:b", capped_reinforce, "batch_token_mean"))
    with pytest.raises(ValueError, match="unknown aggregation 'token_mean'"):
        LossVariant("x", capped_reinforce, "token_mean")


def train_with_the_registered_type(out: str) -> None:
    """In a forked child: register CAPPED from this module, then train a step with it."""
    import grpo_trainer

    register_loss(CAPPED)
    grpo_trainer.train("configs/demo_cpu.yaml", [*small_run_overrides(Path(out), 1), "loss.type=capped_reinforce",
                                                 "loss.options.cap=0.5"])


@pytest.mark.slow
def test_a_loss_type_registered_from_one_module_trains(tmp_path, tiny_model_path):
    result = run_in_fork(train_with_the_registered_type, (str(tmp_path),))
    assert result.returncode == 0, result.stderr[-3000:]
    rows = read_metrics(tmp_path)
    assert [r["step"] for r in rows] == [1]
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    saved = yaml.safe_load((tmp_path / "config.yaml").read_text())["loss"]
    assert (saved["type"], saved["options"]) == ("capped_reinforce", {"cap": 0.5})


# ----------------------------------------------------------------------------- a user's type by import path


def docs_example() -> str:
    """The `my_losses.py` of docs/loss_family.md ("Your own loss type"): the test runs what the docs show."""
    text = (ROOT / "docs" / "loss_family.md").read_text()
    return re.search(r"```python\n(# my_losses\.py\n.*?)```", text, re.S).group(1)


def test_a_users_loss_type_by_file_path_is_validated_by_its_own_options_model(tmp_path):
    (tmp_path / "my_losses.py").write_text(docs_example())
    spec = f"{tmp_path / 'my_losses.py'}:SCALED"
    cfg = load_config(None, [f"loss.type={spec}", "loss.options.scale=0.5"])
    assert cfg.loss.variant.name == "scaled_reinforce" and cfg.loss.options.scale == 0.5
    assert config_from_dict(cfg.model_dump(mode="json")).loss == cfg.loss  # a saved config reloads
    # Its surrogate on per-token advantages: -0.5 A_t logp_t = -0.5 x [1 x -1, 0.5 x -2] = [0.5, 0.5].
    loss, _ = losses.per_token_loss(cfg.loss.variant, cfg.loss.options, torch.tensor([[-1.0, -2.0]]),
                                    torch.tensor([[-1.0, -2.0]]), torch.tensor([[1.0, 0.5]]), torch.ones(1, 2))
    assert loss.tolist() == [[0.5, 0.5]]
    for overrides, message in [
        (["loss.options.scale=0"], "loss: options.scale: Input should be greater than 0 (got 0)"),
        (["loss.options.epsilon_low=0.1"],
         f"loss: options.epsilon_low is not used by type {spec} (its options: scale); it is read by: grpo, bnpo"),
        (["loss.epsilon_high=0.3"], f"loss: epsilon_high (0.3) is not used by type {spec}; it is read by: grpo"),
    ]:
        with pytest.raises(ConfigError) as err:
            load_config(None, [f"loss.type={spec}", *overrides])
        assert message in str(err.value)
    for name, message in [
        ("NOPE", "has no function 'NOPE'"),
        ("scaled_reinforce", "is a function, not a grpo_trainer.losses.LossVariant"),
    ]:
        with pytest.raises(ConfigError, match=re.escape(message)):
            load_config(None, [f"loss.type={tmp_path / 'my_losses.py'}:{name}"])
    with pytest.raises(ConfigError, match="loss.type: loss type file not found: nowhere.py"):
        load_config(None, ["loss.type=nowhere.py:SCALED"])


def test_a_users_loss_type_by_module_path(tmp_path, monkeypatch):
    package = tmp_path / "user_loss_package"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "losses.py").write_text(docs_example())
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(None, ["loss.type=user_loss_package.losses:SCALED", "loss.options.scale=2"])
    assert cfg.loss.variant.name == "scaled_reinforce" and cfg.loss.options.scale == 2.0


# ----------------------------------------------------------------------------- configs of earlier versions

# The `loss` section of a config resolved by the version before the registry (every type's flat option, as a
# checkpoint saves it), with vespo_k_neg set.
RESOLVED_BEFORE_THE_REGISTRY = {
    "type": "vespo", "beta": 0.0, "epsilon_low": 0.2, "epsilon_high": None, "delta": None, "tis_cap": None,
    "tis_min": None, "off_policy_mask_threshold": None, "tis_mode": "token_truncate", "advantage": "grpo",
    "scale_rewards": "group", "reward_aggregation": "sum", "top_entropy_quantile": 1.0, "sapo_temperature_pos": 1.0,
    "sapo_temperature_neg": 1.05, "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 4.0,
    "vespo_lambda_neg": 2.0, "entropy_coef": 0.0, "entropy_target": None, "entropy_coef_delta": 0.005,
    "entropy_coef_min": 0.0, "entropy_coef_max": 1.0, "dynamic_sampling": False, "max_sampling_rounds": 3,
    "mask_truncated_completions": False,
}


@pytest.mark.parametrize(
    "loss, options",
    [
        (RESOLVED_BEFORE_THE_REGISTRY, losses.GammaShape(k_neg=4.0)),
        ({**RESOLVED_BEFORE_THE_REGISTRY, "type": "cispo", "vespo_k_neg": 3.0, "epsilon_high": 0.28},
         losses.CispoOptions(epsilon_high=0.28)),
        ({**RESOLVED_BEFORE_THE_REGISTRY, "type": "dapo", "vespo_k_neg": 3.0, "epsilon_high": 0.28, "delta": 2.0},
         losses.ClipOptions(epsilon_high=0.28, delta=2.0)),
        # configs/sapo.yaml and configs/vespo.yaml as they were shipped
        ({"type": "sapo", "beta": 0.0, "sapo_temperature_pos": 1.0, "sapo_temperature_neg": 1.05}, losses.SoftGate()),
        ({"type": "vespo", "vespo_k_pos": 2.0, "vespo_lambda_pos": 3.0, "vespo_k_neg": 3.0, "vespo_lambda_neg": 2.0},
         losses.GammaShape()),
    ],
)
def test_the_flat_option_keys_of_earlier_versions_load_into_the_options(loss, options):
    cfg = config_from_dict({"loss": loss})
    assert cfg.loss.options == options and type(cfg.loss.options) is type(options)
    assert config_from_dict(cfg.model_dump(mode="json")) == cfg


# ----------------------------------------------------------------------------- per-token advantages


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_surrogates_take_per_token_advantages(loss_type):
    """A per-token term added to the advantages (a teacher's, say) needs no per-loss code: a term on one token
    changes that token's loss alone. (The [B] form, token_loss, is
    this function with A repeated along each completion: tests/test_losses.py pins it to hand-derived numbers.)"""
    torch.manual_seed(0)
    logp = -torch.rand(3, 5) * 2
    old = logp + torch.randn(3, 5) * 0.2
    mask = torch.ones(3, 5)
    advantages = torch.tensor([1.0, -0.5, 0.7])
    variant = LOSS_VARIANTS[loss_type]
    options = variant.options()
    per_token, _ = losses.per_token_loss(variant, options, logp, old, advantages[:, None].expand(3, 5), mask)
    teacher = torch.zeros(3, 5)
    teacher[1, 2] = 0.3
    moved, _ = losses.per_token_loss(variant, options, logp, old, advantages[:, None] + teacher, mask)
    changed = (moved != per_token).nonzero().tolist()
    assert changed == [[1, 2]]


# ----------------------------------------------------------------------------- every list of the types


def test_every_list_of_the_loss_types_is_the_registrys():
    titles = [v.title for v in LOSS_VARIANTS.values()]
    description = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["description"]
    assert [t for t in titles if t not in description] == [], description
    readme = (ROOT / "README.md").read_text()
    intro = readme.split("\n\n")[1]
    assert [t for t in titles if t not in intro] == [], intro
    sentence = re.search(r"`loss\.type` is one of (.*?);", readme, re.S).group(1)
    assert re.findall(r"`(\w+)`", sentence) == list(LOSS_TYPES)
    doc = (ROOT / "docs" / "loss_family.md").read_text()
    assert with_loss_family_table(doc) == doc, f"docs/loss_family.md's table is stale: run {REGENERATE_LOSS_FAMILY}"


@pytest.mark.parametrize("loss_type", LOSS_TYPES)
def test_the_model_card_describes_every_type_from_the_registry(loss_type):
    from grpo_trainer.model_card import _describe_loss

    cfg = load_config(None, [f"loss.type={loss_type}"])
    text = _describe_loss(cfg)
    assert text.startswith(f"`{loss_type}` ({LOSS_VARIANTS[loss_type].paper}); aggregation: "), text
    for name, value in cfg.loss.options.model_dump().items():
        assert (f"{name} {value:g}" in text) if value is not None else (name not in text), (name, text)


def test_the_loss_rules_are_derived_once_on_the_config():
    """kl_on, correction_on, needs_reference and policy_moves_within_step are the config's; no module re-derives
    them from the raw keys (update.py and report.py once did, each its own way)."""
    cfg = load_config(None)
    assert not (cfg.loss.kl_on or cfg.loss.correction_on or cfg.needs_reference or cfg.train.policy_moves_within_step)
    cfg = load_config(None, ["loss.beta=0.04", "loss.tis_cap=2", "train.num_iterations=2"])
    assert cfg.loss.kl_on and cfg.loss.correction_on and cfg.needs_reference and cfg.train.policy_moves_within_step
    assert not load_config(None, ["loss.beta=0.04", "model.lora={r: 4}"]).needs_reference  # the adapters-off policy
    assert load_config(None, ["train.mini_batches=2"]).train.policy_moves_within_step
    raw = re.compile(r"cfg\.loss\.beta [<>=]|cfg\.loss\.tis_cap is|num_iterations > 1 or|cfg\.model\.lora is None and")
    found = [f"{p.relative_to(ROOT)}:{i}" for p in sorted((ROOT / "grpo_trainer").rglob("*.py")) if p.parent.name != "config"
             for i, line in enumerate(p.read_text().splitlines(), 1) if raw.search(line)]
    assert found == []


def test_a_recipes_loss_type_can_be_overridden_on_the_command_line():
    """`configs/dapo.yaml loss.type=cispo` (an A/B of two types) loads as before the registry: another type's options
    at their defaults are no-ops; one set to something else is refused, saying how to start from the new defaults."""
    from grpo_trainer.config import load_config

    assert load_config("configs/dapo.yaml", ["loss.type=cispo"]).loss.options.epsilon_high == 0.28
    assert load_config("configs/sapo.yaml", ["loss.type=grpo"]).loss.type == "grpo"
    with pytest.raises(ConfigError, match=r"options.temperature_neg is not used by type grpo .*loss.options=null"):
        load_config("configs/sapo.yaml", ["loss.type=grpo", "loss.options.temperature_neg=2.0"])
    assert load_config("configs/sapo.yaml", ["loss.type=grpo", "loss.options=null"]).loss.type == "grpo"
