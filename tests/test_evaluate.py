"""`grpo_trainer.evaluate`: the pass@k estimator, mean@k/pass@k aggregation, and evaluating real models."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file

from grpo_trainer.config import load_config
from grpo_trainer.errors import ConfigError
from grpo_trainer.evaluate import eval_settings, evaluate, evaluate_model, load_for_eval, pass_at_k, summarize
from helpers import run_cli, small_run_overrides

nan = math.nan


# ----------------------------------------------------------------------------- pure math


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 0, 4, 0.0),
        (4, 1, 4, 1.0),  # n = k: any correct sample passes
        (4, 1, 1, 0.25),  # pass@1 = c / n
        (10, 3, 1, 0.3),
        (5, 2, 2, 1 - 3 / 10),  # 1 - C(3,2)/C(5,2)
        (10, 3, 4, 1 - 35 / 210),  # 1 - C(7,4)/C(10,4)
        (10, 7, 4, 1.0),  # n - c < k: every draw of 4 contains a correct one
        (200, 10, 100, 1 - math.comb(190, 100) / math.comb(200, 100)),
    ],
)
def test_pass_at_k_matches_hand_computed_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_rejects_impossible_counts():
    for n, c, k in [(4, 5, 1), (4, 1, 5), (4, -1, 1), (4, 1, 0)]:
        with pytest.raises(ValueError):
            pass_at_k(n, c, k)


def test_summarize_means_and_passes_with_no_opinion_samples():
    # 3 prompts x 4 samples x 2 columns (a reward, then the total).
    values = torch.tensor(
        [
            [[1.0, 0.5], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]],  # one correct of 4
            [[0.0, -1.0], [0.0, -1.0], [0.0, -1.0], [0.0, -1.0]],  # none correct
            [[nan, 2.0], [1.0, 2.0], [nan, 2.0], [nan, 2.0]],  # reward: one opinion, correct
        ]
    )
    out = summarize(values, ["acc", "reward"], k=4)
    # mean@4 of acc: prompt means 0.25, 0.0, 1.0 (NaN samples left out) -> 1.25/3
    assert out["eval/acc/mean@4"] == pytest.approx(1.25 / 3)
    # pass@4 with n = k = 4: 1, 0, 1 -> 2/3 (NaN counts as not correct, but one real 1.0 passes)
    assert out["eval/acc/pass@4"] == pytest.approx(2 / 3)
    assert out["eval/reward/mean@4"] == pytest.approx((0.125 - 1.0 + 2.0) / 3)
    assert out["eval/reward/pass@4"] == pytest.approx(2 / 3)  # reward > 0 is "correct"; -1 is not
    # With k = 2 from n = 4 samples the unbiased estimator is used: 1 - C(3,2)/C(4,2) = 0.5 for prompt 0;
    # prompt 2 has 1 correct of 4 (the NaNs are samples that are not correct): also 0.5.
    assert summarize(values, ["acc", "reward"], k=2)["eval/acc/pass@2"] == pytest.approx((0.5 + 0 + 0.5) / 3)


def test_a_prompt_with_no_opinion_at_all_is_left_out():
    values = torch.tensor([[[1.0], [1.0]], [[nan], [nan]]])
    out = summarize(values, ["acc"], k=2)
    assert out == {"eval/acc/mean@2": 1.0, "eval/acc/pass@2": 1.0}


def test_settings_defaults_and_overrides():
    cfg = load_config("configs/demo_cpu.yaml")
    s = eval_settings(cfg)
    assert (s.source, s.split, s.k, s.num_samples, s.temperature) == ("builtin:arithmetic", "test", 4, None, 1.0)
    assert eval_settings(cfg, k=8).k == 8
    assert eval_settings(cfg, num_prompts=5).num_samples == 5
    with pytest.raises(ConfigError, match="at least 1"):
        eval_settings(cfg, k=0)


# ----------------------------------------------------------------------------- the tiny model


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory, tiny_model_path):
    """A 2-step run: its weights differ from the base model's (checked below)."""
    out = tmp_path_factory.mktemp("eval") / "run"
    result = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(out)])
    assert result.returncode == 0, result.stderr[-3000:]
    return out


def test_evaluate_the_base_model_on_the_test_split(tiny_model_path):
    cfg = load_config("configs/demo_cpu.yaml")
    out = evaluate(cfg, k=4, progress=False)
    assert set(out) == {
        "eval/math_accuracy/mean@4", "eval/math_accuracy/pass@4", "eval/reward/mean@4", "eval/reward/pass@4", "eval/num_prompts",
    }
    assert out["eval/num_prompts"] == 20  # the builtin test split
    for key, value in out.items():
        if key != "eval/num_prompts":
            assert 0.0 <= value <= 1.0, (key, value)
    assert out["eval/reward/pass@4"] >= out["eval/reward/mean@4"]
    # The warm start answers right about a quarter of the time: neither broken nor perfect.
    assert 0.05 < out["eval/reward/mean@4"] < 0.6


def test_evaluation_is_seeded_and_leaves_the_global_rng_alone(tiny_model_path):
    cfg = load_config("configs/demo_cpu.yaml")
    lm, tokenizer = load_for_eval(cfg, None)
    torch.manual_seed(123)
    expected_next = torch.rand(3)
    torch.manual_seed(123)
    first = evaluate_model(lm, tokenizer, cfg, k=4, num_prompts=10, progress=False)
    assert torch.equal(torch.rand(3), expected_next)  # the caller's RNG stream is where it would be without evaluation
    assert first["eval/num_prompts"] == 10
    assert evaluate_model(lm, tokenizer, cfg, k=4, num_prompts=10, progress=False) == first
    others = [evaluate_model(lm, tokenizer, cfg.model_copy(update={"seed": s}), k=4, num_prompts=10, progress=False) for s in (1, 2)]
    assert any(other != first for other in others)  # the seed does change the samples (two seeds: ties happen)


@pytest.mark.slow
def test_checkpoint_and_saved_model_folders_load_the_trained_weights(trained_run, tiny_model_path):
    cfg = load_config("configs/demo_cpu.yaml")
    trained = load_file(trained_run / "model" / "model.safetensors")
    base = load_file(tiny_model_path / "model.safetensors")
    key = "model.layers.0.mlp.up_proj.weight"
    assert not torch.equal(trained[key], base[key])
    for folder in (trained_run / "model", trained_run / "checkpoints" / "step-000002"):
        lm, _ = load_for_eval(cfg, folder)
        state = lm.state_dict()
        assert torch.equal(state[key], trained[key]), folder
        assert torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])  # tied weights stay tied

    # A training checkpoint loads with the config it carries, as `export` does: a config at hand that says
    # LoRA (or another model) does not change what the checkpoint is.
    lora_cfg = load_config("configs/demo_cpu.yaml", ["model.lora.r=4"])
    lm, _ = load_for_eval(lora_cfg, trained_run / "checkpoints" / "step-000002")
    assert torch.equal(lm.state_dict()[key], trained[key])

    out_ckpt = evaluate(cfg, trained_run / "checkpoints" / "step-000002", k=2, num_prompts=8, progress=False)
    out_model = evaluate(cfg, trained_run / "model", k=2, num_prompts=8, progress=False)
    assert out_ckpt == out_model  # the same weights and seed: the same samples
    assert set(out_ckpt) >= {"eval/reward/mean@2", "eval/reward/pass@2"}


@pytest.mark.slow
def test_bad_checkpoint_paths_are_clear_errors(trained_run, tmp_path):
    cfg = load_config("configs/demo_cpu.yaml")
    with pytest.raises(ConfigError, match="is not a folder"):
        load_for_eval(cfg, tmp_path / "missing")
    with pytest.raises(ConfigError, match=r"use that"):
        load_for_eval(cfg, trained_run)  # the output_dir itself: point at its model/ folder
    with pytest.raises(ConfigError, match="not a training checkpoint"):
        load_for_eval(cfg, trained_run / "checkpoints")
    wrong = tmp_path / "wrong"
    wrong.mkdir()
    from safetensors.torch import save_file

    (wrong / "trainer_state.json").write_text((trained_run / "checkpoints" / "step-000002" / "trainer_state.json").read_text())
    save_file({"lm.something.else": torch.zeros(2)}, str(wrong / "model.safetensors"))
    with pytest.raises(ConfigError, match="does not match model.name_or_path"):
        load_for_eval(cfg, wrong)


def test_a_peft_adapter_folder_is_loaded_onto_the_base_model(tmp_path, tiny_model_path):
    peft = pytest.importorskip("peft")
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(tiny_model_path)
    adapted = peft.get_peft_model(base, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    adapted.save_pretrained(tmp_path / "adapter")
    lm, tokenizer = load_for_eval(load_config("configs/demo_cpu.yaml"), tmp_path / "adapter")
    assert isinstance(lm, peft.PeftModel)
    key = next(k for k in adapted.state_dict() if "lora_B" in k)
    assert torch.equal(lm.state_dict()[key], adapted.state_dict()[key])
    assert tokenizer.chat_template  # from cfg.model: the adapter folder has no tokenizer
