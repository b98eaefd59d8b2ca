"""The model card's metadata, from what is known here (never the network), parsed back with huggingface_hub's
ModelCard loader. The card of a real run, and of `export`, is checked in tests/test_api.py on its runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from huggingface_hub import ModelCard

from grpo_trainer import plot
from grpo_trainer.config import load_config
from grpo_trainer.model_card import Setup, write_model_card

SETUP = Setup(processes=8, distributed_type="DEEPSPEED", hardware="8 x NVIDIA H100 80GB HBM3 per node")


def card_for(tmp_path: Path, overrides: list[str], rows: list[dict] | None = None, adapter: bool = False) -> ModelCard:
    run = tmp_path / "run"
    run.mkdir(exist_ok=True)
    if rows is not None:
        (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    folder = tmp_path / "model"
    folder.mkdir(exist_ok=True)
    cfg = load_config("configs/demo_cpu.yaml", [f"output_dir={run}", *overrides])
    return ModelCard.load(write_model_card(folder, cfg, run, SETUP, adapter=adapter))


def fake_hub_cache(root: Path, repo_id: str, card: str) -> Path:
    """The layout huggingface_hub's cache gives a downloaded model's README.md."""
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text("abc123")
    (repo / "snapshots" / "abc123").mkdir(parents=True)
    (repo / "snapshots" / "abc123" / "README.md").write_text(card)
    return root


def test_a_hub_base_model_its_cached_license_and_hub_datasets(tmp_path, monkeypatch):
    import huggingface_hub.constants

    cache = fake_hub_cache(tmp_path / "hub", "Qwen/Qwen2.5-0.5B-Instruct", "---\nlicense: apache-2.0\n---\n# Qwen\n")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    card = card_for(tmp_path, ["model.name_or_path=Qwen/Qwen2.5-0.5B-Instruct", "data.source=openai/gsm8k",
                               "loss.type=dr_grpo", "model.lora={r: 8}"])
    assert card.data.base_model == "Qwen/Qwen2.5-0.5B-Instruct"
    assert card.data.license == "apache-2.0"  # carried over from the base model's own card
    assert card.data.datasets == ["openai/gsm8k"]
    assert card.data.tags == ["grpo-trainer", "reinforcement-learning", "grpo", "dr_grpo", "lora"]
    assert (card.data.library_name, card.data.pipeline_tag) == ("transformers", "text-generation")
    assert "[Qwen/Qwen2.5-0.5B-Instruct](https://huggingface.co/Qwen/Qwen2.5-0.5B-Instruct)" in card.text
    assert "| model | `float32`, LoRA r=8 alpha=32 |" in card.text
    assert "| hardware | 8 x NVIDIA H100 80GB HBM3 per node |" in card.text and "| processes | 8 (DEEPSPEED) |" in card.text


def test_an_uncached_hub_base_model_has_no_license_claimed(tmp_path, monkeypatch):
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "empty"))
    card = card_for(tmp_path, ["model.name_or_path=org/unseen-model"])
    assert card.data.base_model == "org/unseen-model" and card.data.license is None


def test_a_local_base_model_gives_its_license_but_no_hub_id(tmp_path):
    base = tmp_path / "base"
    base.mkdir()
    (base / "README.md").write_text("---\nlicense: mit\n---\nA local model.\n")
    card = card_for(tmp_path, [f"model.name_or_path={base}", f"data.source={tmp_path / 'train.jsonl'}"])
    assert card.data.base_model is None and card.data.license == "mit" and card.data.datasets is None
    assert f"`{base}`, trained by grpo-trainer" in card.text


def test_a_builtin_model_with_a_hub_origin_names_it(tmp_path):
    card = card_for(tmp_path, ["model.name_or_path=builtin:smollm2-135m-instruct", "loss.type=cispo"])
    assert card.data.base_model == "HuggingFaceTB/SmolLM2-135M-Instruct" and card.data.license == "apache-2.0"
    assert "cispo" in card.data.tags


def test_an_adapter_folder_is_a_peft_card(tmp_path):
    card = card_for(tmp_path, ["model.lora={r: 4}"], adapter=True)
    assert card.data.library_name == "peft" and "lora" in card.data.tags


def test_without_metrics_there_is_no_reward_section_and_the_card_still_loads(tmp_path):
    card = card_for(tmp_path, [], rows=None)
    assert "## Reward" not in card.text and "| steps | 0 (of train.max_steps 80) |" in card.text
    assert "## Configuration" in card.text


def test_without_matplotlib_the_card_says_how_to_draw_the_curve(tmp_path, monkeypatch):
    def no_matplotlib():
        raise plot.PlotDependencyError("plotting needs matplotlib")

    monkeypatch.setattr(plot, "_figure_class", no_matplotlib)
    rows = [{"step": s, "reward": 0.1 * s, "completions/mean_length": 10.0, "step_time": 1.5} for s in range(1, 21)]
    card = card_for(tmp_path, [], rows=rows)
    assert "`python -m grpo_trainer plot OUTPUT_DIR` draws it" in card.text
    assert not (tmp_path / "model" / "reward_curve.png").exists()
    # 20 steps x 16 prompts x 8 completions of 10 tokens; first and last 2 steps' mean rewards
    assert "| completion tokens trained on | 25,600 |" in card.text and "| completions trained on | 2,560 |" in card.text
    assert "first 10% of logged steps: **0.150**; over the last 10%: **1.950**" in card.text


@pytest.mark.parametrize("log_every", [1, 2])
def test_tokens_are_counted_over_the_logged_steps(tmp_path, log_every):
    rows = [{"step": s, "reward": 0.0, "completions/mean_length": 4.0} for s in range(log_every, 9, log_every)]
    card = card_for(tmp_path, [], rows=rows)
    logged = "" if log_every == 1 else " (over the 4 logged steps)"
    assert f"| completion tokens trained on | {len(rows) * 4 * 128:,}{logged} |" in card.text
