"""The 2026 additions to the loss family around the math (tests/test_losses.py and tests/test_entropy_term.py pin
the math itself): the config reads each variant's options from losses.LOSS_VARIANTS, the adaptive entropy
coefficient survives a resume exactly, and each new loss type trains the tiny model on the bundled task.
"""

from __future__ import annotations

import pytest

from grpo_trainer.config import load_config
from grpo_trainer.errors import ConfigError
from grpo_trainer.metrics import read_metrics
from helpers import assert_same_run, run_cli, small_run_overrides


@pytest.mark.parametrize(
    "overrides, message",
    [
        # The flat keys of earlier versions: each names the types that read it.
        (["loss.sapo_temperature_neg=2"], "loss: sapo_temperature_neg (2) is not used by type grpo; it is read by: sapo"),
        (["loss.type=sapo", "loss.epsilon_high=0.28"],
         "loss: epsilon_high (0.28) is not used by type sapo; it is read by: grpo, bnpo, dr_grpo, dapo, gspo, cispo, luspo"),
        (["loss.type=vespo", "loss.delta=2"], "loss: delta (2) is not used by type vespo"),
        (["loss.type=luspo", "loss.vespo_k_pos=1"], "loss: vespo_k_pos (1) is not used by type luspo; it is read by: vespo"),
        (["loss.type=cispo", "loss.epsilon_low=0.1"], "loss: epsilon_low (0.1) is not used by type cispo"),
        # loss.options: checked by the type's own model.
        (["loss.options.k_pos=1"],
         "loss: options.k_pos is not used by type grpo (its options: epsilon_low, epsilon_high, delta); it is read by: vespo"),
        (["loss.type=sapo", "loss.options.epsilon_low=0.1"],
         "loss: options.epsilon_low is not used by type sapo (its options: temperature_pos, temperature_neg); it is read "
         "by: grpo, bnpo, dr_grpo, dapo, gspo, luspo"),
        (["loss.options.espilon_low=0.1"], "loss: options.espilon_low is not used by type grpo (its options: epsilon_low"),
        (["loss.type=sapo", "loss.options.temperature_pos=0"], "loss: options.temperature_pos: Input should be greater than 0 (got 0)"),
        (["loss.type=sapo", "loss.sapo_temperature_pos=0"],
         "loss: sapo_temperature_pos (options.temperature_pos of type sapo): Input should be greater than 0 (got 0)"),
        (["loss.delta=1.1"], "loss: options: delta (1.1) must be larger than 1 + epsilon_high (1.2)"),
        (["loss.options.epsilon_low=true"], "loss: options.epsilon_low: expected a number, not true"),
        (["loss.type=sapo", "loss.sapo_temperature_pos=false"], "loss: sapo_temperature_pos: expected a number, not false"),
        (["loss.epsilon_low=0.1", "loss.options.epsilon_low=0.3"],
         "loss: epsilon_low and options.epsilon_low are the same option of type grpo: set only options.epsilon_low"),
        (["loss.type=vespo", "loss.tis_cap=2", "loss.tis_mode=sequence_truncate"],
         "loss.type vespo folds the per-token rollout correction into its own ratio"),
        (["loss.type=ppo"], "loss.type: unknown loss_type 'ppo'; expected one of ('grpo', "),
    ],
)
def test_an_option_the_loss_type_does_not_read_is_an_error(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


def test_each_loss_type_accepts_its_own_options_and_a_resolved_config_reloads():
    cfg = load_config(None, ["loss.type=sapo", "loss.options.temperature_pos=0.5", "loss.sapo_temperature_neg=2"])
    assert (cfg.loss.options.temperature_pos, cfg.loss.options.temperature_neg) == (0.5, 2.0)
    cfg = load_config(None, ["loss.type=vespo", "loss.vespo_k_neg=4", "loss.tis_cap=2", "loss.tis_mode=token_mask"])
    assert cfg.loss.options.k_neg == 4.0
    # A run writes its resolved config (every key, defaults included) and `eval` reads it back: that must load.
    import yaml

    from grpo_trainer.config import config_from_dict

    assert config_from_dict(yaml.safe_load(cfg.to_yaml())).loss == cfg.loss


def train(out, steps, *extra, resume="never"):
    overrides = [o for o in small_run_overrides(out, steps) if not o.startswith("checkpoint.resume")]
    result = run_cli(["train", "configs/demo_cpu.yaml", *overrides, f"checkpoint.resume={resume}", *extra])
    assert result.returncode == 0, result.stderr[-3000:]
    return result


@pytest.mark.slow
def test_stop_and_resume_keeps_the_adaptive_entropy_coefficient(tmp_path, tiny_model_path):
    """The tiny model's token entropy (~0.2 nats) stays below a target of 5, so the coefficient grows by 0.01 after
    every step: 0.01, 0.02, 0.03, 0.04 applied at steps 1-4. A resume at step 2 that started the coefficient
    afresh would apply 0.01 at step 3 and change every number after it; restored from the checkpoint, the run
    is bit-identical to the straight one."""
    extra = ["loss.entropy_coef=0.01", "loss.entropy_target=5", "loss.entropy_coef_delta=0.01"]
    straight, resumed = tmp_path / "straight", tmp_path / "resumed"
    train(straight, 4, *extra)
    train(resumed, 2, *extra)
    log = train(resumed, 4, *extra, resume="auto").stderr
    assert "resumed from" in log and "at step 2" in log
    assert [r["entropy_coef"] for r in read_metrics(resumed)] == pytest.approx([0.01, 0.02, 0.03, 0.04])
    assert_same_run(straight, resumed)


@pytest.mark.slow
@pytest.mark.parametrize("loss_type", ["sapo", "luspo", "vespo"])
def test_each_new_loss_trains_the_tiny_model(loss_type, tmp_path, tiny_model_path):
    """Each recipe (configs/<loss>.yaml: its loss, batch reuse, vespo's mini-batches) at small scale, 7 steps of
    4 prompts x 8, rewarded for the tiny model's one prompt-independent habit, working the sum out
    (tests/works_it_out.py): step 1 samples the warm-started model (2 in 8 work it out), and a loss that optimises
    its objective has the habit nearly always by steps 5-7. Seen on tiny-v4 (Intel Xeon here and on CI alike):
    sapo 0.25 -> 0.72, 0.88, 1.0, 0.97, 1.0; vespo 0.25 -> 0.91, 1.0, 0.78, 1.0, 1.0; luspo, whose clip range
    (2e-3) lets each batch move the policy least, 0.25 -> 0.66, 0.56, 0.69, 1.0, 0.97 (steps 3-7). A loss with
    the wrong sign drives the habit to 0, one with no gradient leaves it near step 1's."""
    out = tmp_path / loss_type
    result = run_cli(["train", f"configs/{loss_type}.yaml", f"output_dir={out}", "train.max_steps=7",
                      "train.prompts_per_step=4", "rollout.num_generations=8", "train.micro_batch_size=16",
                      "train.learning_rate=5e-4", "train.warmup_steps=0", "rewards=[{name: tests/works_it_out.py:works_it_out}]",
                      "logging.progress_bar=false", "checkpoint.save_every=0", "checkpoint.save_final_model=false"])
    assert result.returncode == 0, result.stderr[-3000:]
    rewards = [r["reward"] for r in read_metrics(out)]
    assert len(rewards) == 7 and rewards[0] < 0.6
    late = sum(rewards[4:]) / 3
    assert late >= 0.75 and late > rewards[0] + 0.3, rewards
