"""Mismatch-safe by default (issue 46, item 4): `loss.tis_cap: auto` turns the rollout correction on for engines
whose log-probs differ from the trainer's (vLLM) and leaves hf runs as they were; the mismatch KL and the share of
tokens and completions the correction touched are logged; a resumed run keeps the value its checkpoint recorded.

Config-level and update-level, with hand-derived numbers; no vLLM process (tests/test_vllm.py runs the real one).
"""

from __future__ import annotations

import json
import logging
import math

import pytest
import torch

from grpo_trainer.batches import build_train_batch
from grpo_trainer.checkpoint import TRAINER_STATE, check_resume_compatible, keep_recorded_correction, resolved_today
from grpo_trainer.config import config_from_dict, load_config, with_absolute_paths
from grpo_trainer.errors import ConfigError
from grpo_trainer.losses import DEFAULT_TIS_CAP, mismatch_kl
from grpo_trainer.terms import StepTotals, TermInputs
from grpo_trainer.terms.correction import RolloutCorrection
from grpo_trainer.train_state import TrainState
from test_phases import PAD, accelerator_factory, four_completions, toy_run  # noqa: F401 (a fixture)

VLLM_ENGINES = ("vllm_colocate", "vllm_server")


# ----------------------------------------------------------------------------- the default, per engine


@pytest.mark.parametrize("engine", VLLM_ENGINES)
def test_the_default_turns_the_correction_on_for_vllm_engines(engine):
    cfg = load_config(None, [f"rollout.engine={engine}"])
    assert cfg.loss.tis_cap == DEFAULT_TIS_CAP == 2.0 and cfg.loss.tis_mode == "token_truncate"
    assert cfg.loss.correction_on and cfg.loss.tis_cap_by_default
    assert cfg.model_dump(mode="json")["loss"]["tis_cap"] == 2.0  # a run's saved config records the number
    assert load_config(None, [f"rollout.engine={engine}", "loss.tis_cap=auto"]).loss.tis_cap == 2.0


def test_the_default_leaves_the_hf_engine_as_it_was():
    """hf samples with the trainer's own weights: no correction, and its saved config is what it was before
    `auto` existed (tis_cap null), so its checkpoints, config.yaml and resumes do not change."""
    cfg = load_config("configs/demo_cpu.yaml")
    assert cfg.rollout.engine == "hf" and cfg.loss.tis_cap is None and not cfg.loss.correction_on
    assert cfg.model_dump(mode="json")["loss"]["tis_cap"] is None
    assert cfg.loss.tis_cap_by_default


@pytest.mark.parametrize("off", ["null", "off", "false"])
def test_an_explicit_off_turns_it_off_on_every_engine(off):
    for engine in ("hf", *VLLM_ENGINES):
        cfg = load_config(None, [f"rollout.engine={engine}", f"loss.tis_cap={off}"])
        assert cfg.loss.tis_cap is None and not cfg.loss.correction_on and not cfg.loss.tis_cap_by_default


def test_an_explicit_number_is_the_cap_on_every_engine_and_bad_values_are_one_line():
    assert load_config(None, ["loss.tis_cap=3"]).loss.tis_cap == 3.0  # hf too (e.g. for agent endpoint samples)
    assert load_config(None, ["rollout.engine=vllm_server", "loss.tis_cap=5"]).loss.tis_cap == 5.0
    for bad in ("0", "-1", "often"):
        with pytest.raises(ConfigError, match="loss.tis_cap: expected a positive number, `auto`, or null / off"):
            load_config(None, [f"loss.tis_cap={bad}"])
    with pytest.raises(ConfigError, match="loss.tis_cap: expected a number, not true"):
        load_config(None, ["loss.tis_cap=true"])


def test_the_default_goes_with_every_loss_type_and_a_lower_bound():
    """Per-token truncation is valid for the types that fold the correction into their ratio (a sequence mode
    would be refused for them), and tis_min finds the cap it needs on vLLM engines."""
    for loss_type in ("vespo", "cispo", "gspo"):
        assert load_config(None, ["rollout.engine=vllm_server", f"loss.type={loss_type}"]).loss.correction_on
    cfg = load_config(None, ["rollout.engine=vllm_server", "loss.tis_min=0.5", "loss.tis_mode=token_mask"])
    assert (cfg.loss.tis_min, cfg.loss.tis_cap) == (0.5, 2.0)
    with pytest.raises(ConfigError, match="loss.tis_min"):
        load_config(None, ["loss.tis_min=0.5"])  # hf: auto is off, so the lower bound has no cap


def test_a_config_rebuilt_within_a_run_keeps_auto():
    """with_absolute_paths (every run) and a Config given to the Python API rebuild the config from a dict: the
    default must stay a default there, or a resume could no longer keep its checkpoint's value."""
    cfg = load_config(None, ["rollout.engine=vllm_server"])
    assert cfg.dump_unresolved()["loss"]["tis_cap"] == "auto"
    rebuilt = with_absolute_paths(cfg)
    assert rebuilt.loss.tis_cap == 2.0 and rebuilt.loss.tis_cap_by_default and rebuilt.loss == cfg.loss
    from grpo_trainer.api import config_data

    assert config_from_dict(config_data(cfg)).loss.tis_cap_by_default  # a Config given to grpo_trainer.train()
    explicit = load_config(None, ["rollout.engine=vllm_server", "loss.tis_cap=2"])
    assert explicit.dump_unresolved()["loss"]["tis_cap"] == 2.0 and not with_absolute_paths(explicit).loss.tis_cap_by_default


def test_a_loss_section_given_as_an_object_resolves_per_config_and_is_not_changed():
    """An hf config's resolved section (null, by default) passed to a vLLM config becomes 2 there, and stays null
    in the hf config (the section is copied, never changed in place)."""
    from grpo_trainer.config import Config

    hf = load_config(None)
    vllm = Config.model_validate({**hf.model_dump(), "loss": hf.loss, "rollout": {"engine": "vllm_server"}})
    assert (vllm.loss.tis_cap, hf.loss.tis_cap) == (2.0, None) and vllm.loss.tis_cap_by_default


# ----------------------------------------------------------------------------- the numbers it logs


def test_mismatch_kl_is_k3_of_the_sampler_against_the_trainer():
    """d = log pi_trainer - log pi_sampler; k3 = e^d - 1 - d:
    d = ln 3: 3 - 1 - 1.0986123 = 0.9013877;  d = -ln 2: 0.5 - 1 + 0.6931472 = 0.1931472;  d = 0: 0;
    d = ln 1.5: 0.5 - 0.4054651 = 0.0945349. Never negative, 0 only where they agree."""
    trainer = torch.tensor([[math.log(3.0), -math.log(2.0), 0.0, math.log(1.5)]]) - 1.0
    sampler = torch.full((1, 4), -1.0)
    k3 = mismatch_kl(trainer, sampler)
    torch.testing.assert_close(k3, torch.tensor([[0.9013877, 0.1931472, 0.0, 0.0945349]], dtype=torch.float64), atol=1e-6, rtol=0)
    d = torch.linspace(-5, 5, 101)
    assert bool((mismatch_kl(d, torch.zeros_like(d)) >= 0).all())
    # Engines that agree (float32 vLLM: d ~ 3e-7): k3 = d^2 / 2 + d^3 / 6 = 4.5e-14 to 1e-6, where float32's exp
    # gives 0 and its expm1 5.7e-14.
    tiny = torch.tensor([3e-7])
    d = float(tiny)
    assert float(mismatch_kl(tiny, torch.zeros(1))) == pytest.approx(d**2 / 2 + d**3 / 6, rel=1e-6, abs=0)


def _term_on(cap: float, mode: str, old: torch.Tensor, sampler: torch.Tensor, mask: torch.Tensor):
    """The rollout correction's weight and sums for one micro-batch (only what its hook reads is real)."""
    from types import SimpleNamespace

    term = RolloutCorrection(cap, mode, None)
    inputs = TermInputs(SimpleNamespace(sampling_logp=sampler, mask=mask), old, old, sampler, None,  # type: ignore[arg-type]
                        advantages=torch.ones_like(old), sequence_advantages=torch.ones(old.shape[0]))
    weight = term.weight(inputs)
    totals = StepTotals(torch.zeros(()), tokens=float(mask.sum()), trained_tokens=float(mask.sum()),
                        trained_completions=float(old.shape[0]), sampler_logprobs=True)
    return weight, term.metrics(inputs.sums, totals)


def test_the_correction_reports_the_tokens_and_completions_it_touched():
    """Ratios pi_old / pi_sampler, cap 2, three completions (real tokens only):
    [3, 1, 1] -> one token capped; [0.5] -> none; [1.5, 2.5, (pad: ratio 9)] -> one (the pad does not count).
    token_truncate: 2 of 6 tokens, 2 of 3 completions. sequence_mask: the products are 3 (> 2, masked whole),
    0.5 and 3.75 (> 2, masked whole): 2 of 3 completions, their 3 + 2 = 5 of 6 tokens."""
    ratios = torch.tensor([[3.0, 1.0, 1.0], [0.5, 1.0, 1.0], [1.5, 2.5, 9.0]])
    mask = torch.tensor([[1.0, 1, 1], [1, 0, 0], [1, 1, 0]])
    old, sampler = torch.log(ratios) - 1.0, torch.full((3, 3), -1.0)
    weight, metrics = _term_on(2.0, "token_truncate", old, sampler, mask)
    torch.testing.assert_close(weight * mask, torch.tensor([[2.0, 1, 1], [0.5, 0, 0], [1.5, 2.0, 0]]))
    assert metrics == pytest.approx({"sampling/is_truncated_fraction": 2 / 6,
                                     "sampling/is_truncated_sequence_fraction": 2 / 3})
    weight, metrics = _term_on(2.0, "sequence_mask", old, sampler, mask)
    torch.testing.assert_close(weight * mask, torch.tensor([[0.0, 0, 0], [0.5, 0, 0], [0, 0, 0]]))
    assert metrics == pytest.approx({"sampling/is_masked_fraction": 5 / 6, "sampling/is_masked_sequence_fraction": 2 / 3})


def _sampler_off_by(toy, samples, d: list[list[float]]) -> None:
    """The sampler's log-probs set so that log pi_trainer - log pi_sampler = d, token by token (the toy policy's
    log-probs do not depend on the prompt)."""
    logp_all = toy.policy.w.detach().log_softmax(-1)
    samples.sampler_logprobs[:] = [[float(logp_all[t]) - dt for t, dt in zip(ids, row)]
                                   for ids, row in zip(samples.completion_ids, d)]


def _step_metrics(toy, d: list[list[float]]) -> dict:
    samples, advantages = four_completions([1.0, -1.0, 1.0, -1.0], truncated=(False,) * 4)
    _sampler_off_by(toy, samples, d)
    batch = build_train_batch(samples, advantages, PAD, micro_batch_size=2, mask_truncated=False,
                              skip_zero_advantage=False)
    stats, _ = toy.update(batch, TrainState(step=1))
    return stats.metrics(batch.total_tokens, 4, sampler_logprobs=True)  # one rank: the sums are the totals


# Completions [5, 6, 2], [7], [8, 9], [4, 4, 4, 4]: d per token, and the ratio e^d against the cap 2.
D = [[math.log(3.0), 0.0, 0.0], [-math.log(2.0)], [math.log(1.5), math.log(2.5)], [0.0] * 4]
# k3: 0.9013877 + 0.1931472 + 0.0945349 + (2.5 - 1 - 0.9162907 = 0.5837093) = 1.7727791, over 10 tokens.
K3_MEAN = 1.7727791 / 10


def test_a_vllm_step_logs_the_mismatch_kl_and_what_the_default_correction_touched(accelerator_factory):
    """Ratios 3 and 2.5 are above the cap 2: 2 of 10 tokens truncated, in 2 of 4 completions."""
    metrics = _step_metrics(toy_run(accelerator_factory, ["rollout.engine=vllm_server"]), D)
    assert metrics["sampling/mismatch_kl"] == pytest.approx(K3_MEAN, abs=1e-6)
    assert metrics["sampling/is_truncated_fraction"] == pytest.approx(2 / 10)
    assert metrics["sampling/is_truncated_sequence_fraction"] == pytest.approx(2 / 4)
    assert metrics["sampling/logp_diff_max"] == pytest.approx(math.log(3.0), abs=1e-6)


def test_with_the_correction_off_a_vllm_step_still_logs_the_mismatch(accelerator_factory):
    metrics = _step_metrics(toy_run(accelerator_factory, ["rollout.engine=vllm_colocate", "loss.tis_cap=off"]), D)
    assert metrics["sampling/mismatch_kl"] == pytest.approx(K3_MEAN, abs=1e-6)
    assert not any(key.startswith("sampling/is_") for key in metrics)


def test_an_hf_step_logs_no_new_keys_even_with_sampler_logprobs(accelerator_factory):
    """hf with sampler log-probs (the agent endpoint's) logs what it logged before: logp_diff only."""
    metrics = _step_metrics(toy_run(accelerator_factory), D)
    assert {key for key in metrics if key.startswith("sampling/")} == {"sampling/logp_diff_mean", "sampling/logp_diff_max"}


# ----------------------------------------------------------------------------- resume


def _checkpoint(tmp_path, loss_section_edit) -> tuple[str, dict]:
    """A run folder with one checkpoint whose saved config is a vllm_server run's, as an earlier version wrote it:
    the resolved config, every key at its value, edited by `loss_section_edit`."""
    out = tmp_path / "run"
    written = load_config(None, ["rollout.engine=vllm_server", f"output_dir={out}"]).model_dump(mode="json")
    loss_section_edit(written["loss"])
    folder = out / "checkpoints" / "step-2"
    folder.mkdir(parents=True)
    (folder / TRAINER_STATE).write_text(json.dumps({"step": 2, "config": written}))
    return str(out), written


def test_a_checkpoint_from_before_auto_resumes_with_the_correction_off(tmp_path, caplog):
    """The version before `auto` saved `tis_cap: null` (its default: off on every engine). Resumed under a config
    that leaves tis_cap at its default, the run keeps null; then nothing is reported as changed."""
    out, saved = _checkpoint(tmp_path, lambda loss: loss.update(tis_cap=None))
    cfg = load_config(None, ["rollout.engine=vllm_server", f"output_dir={out}"])
    assert cfg.loss.tis_cap == 2.0
    with caplog.at_level(logging.WARNING, logger="grpo_trainer"):
        kept = keep_recorded_correction(cfg)
    assert kept.loss.tis_cap is None and not kept.loss.correction_on
    assert "resuming with loss.tis_cap null (no rollout correction) as checkpoint step-2 recorded" in caplog.text
    current = kept.model_dump(mode="json")
    assert check_resume_compatible(resolved_today(saved), current, 1, 1, force=False) == []
    # Without it the resume would have turned the correction on, reported only as a warning.
    changed = check_resume_compatible(resolved_today(saved), cfg.model_dump(mode="json"), 1, 1, force=False)
    assert [note for note, _ in changed] == ["loss.tis_cap: None -> 2.0"]


def test_a_checkpoint_keeps_its_recorded_cap_and_an_explicit_setting_wins(tmp_path):
    out, _ = _checkpoint(tmp_path, lambda loss: loss.update(tis_cap=3.0))
    assert keep_recorded_correction(load_config(None, ["rollout.engine=vllm_server", f"output_dir={out}"])).loss.tis_cap == 3.0
    for explicit, expected in (("loss.tis_cap=2", 2.0), ("loss.tis_cap=null", None)):
        cfg = load_config(None, ["rollout.engine=vllm_server", f"output_dir={out}", explicit])
        assert keep_recorded_correction(cfg).loss.tis_cap == expected  # the user's change (warned on resume)
    fresh = load_config(None, ["rollout.engine=vllm_server", f"output_dir={out}", "checkpoint.resume=never"])
    assert keep_recorded_correction(fresh).loss.tis_cap == 2.0  # starting over: the default
    named = load_config(None, ["rollout.engine=vllm_server", f"output_dir={tmp_path / 'other'}",
                               f"checkpoint.resume={out}/checkpoints/step-2"])
    assert keep_recorded_correction(named).loss.tis_cap == 3.0


def test_a_checkpoint_without_the_key_trained_without_a_correction(tmp_path):
    out, _ = _checkpoint(tmp_path, lambda loss: loss.pop("tis_cap"))
    cfg = load_config(None, ["rollout.engine=vllm_colocate", f"output_dir={out}"])
    assert keep_recorded_correction(cfg).loss.tis_cap is None


def test_a_checkpoint_of_this_version_resumes_unchanged(tmp_path):
    """A run started now records 2.0 (vLLM) or null (hf): the same config resumes with it, and a config rebuilt
    from the run's own dump (config_from_dict) is the same run."""
    out, saved = _checkpoint(tmp_path, lambda loss: None)
    cfg = load_config(None, ["rollout.engine=vllm_server", f"output_dir={out}"])
    assert keep_recorded_correction(cfg) is cfg
    assert config_from_dict(saved).loss.tis_cap == 2.0


def test_train_resumes_with_the_value_its_checkpoint_recorded(tmp_path, tiny_model_path):
    """Through `train` (the wiring, before the run's loss terms are built): an hf run started with tis_cap 3,
    resumed under a config that leaves tis_cap at `auto` (off on hf), keeps 3 and records it again."""
    from helpers import run_cli, small_run_overrides

    out = tmp_path / "run"

    def train(steps, *extra, resume):
        overrides = [o for o in small_run_overrides(out, steps) if not o.startswith("checkpoint.resume")]
        result = run_cli(["train", "configs/demo_cpu.yaml", *overrides, f"checkpoint.resume={resume}", *extra])
        assert result.returncode == 0, result.stderr[-3000:]
        return result.stderr

    train(1, "loss.tis_cap=3", resume="never")
    log = train(2, resume="auto")
    assert "resuming with loss.tis_cap 3 as checkpoint step-000001 recorded" in log and "changed on resume: loss." not in log
    saved = json.loads((out / "checkpoints" / "step-000002" / TRAINER_STATE).read_text())
    assert saved["config"]["loss"]["tis_cap"] == 3.0
