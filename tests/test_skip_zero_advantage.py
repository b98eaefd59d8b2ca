"""Completions with zero advantage are left out of the passes when beta = 0, and nothing else changes."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from grpo_trainer.metrics import read_metrics
from grpo_trainer.batches import micro_batch_rows
from helpers import assert_same_update, run_cli, small_run_overrides

pytestmark = pytest.mark.slow  # training runs through the CLI


def test_micro_batch_rows_keep_the_count_and_spread_the_trainable_rows():
    lengths = torch.tensor([5.0, 3.0, 9.0, 1.0, 4.0, 7.0, 2.0, 8.0])
    assert micro_batch_rows(8, 3, None, lengths) == [[0, 1, 2], [3, 4, 5], [6, 7]]
    # 5 trainable rows over the same 3 micro-batches, in order, as evenly as possible.
    assert micro_batch_rows(8, 3, [0, 2, 4, 5, 7], lengths) == [[0, 2], [4, 5], [7]]
    # Fewer trainable rows than micro-batches: the empty ones get the shortest untrainable row (3: length 1).
    assert micro_batch_rows(8, 3, [5], lengths) == [[5], [3], [3]]
    assert micro_batch_rows(8, 3, [], lengths) == [[3], [3], [3]]
    assert micro_batch_rows(8, 4, list(range(8)), lengths) == [[0, 1, 2, 3], [4, 5, 6, 7]]


@pytest.mark.parametrize("loss_type", ["grpo", "dapo"])
def test_skipping_changes_neither_the_loss_nor_the_weights(loss_type, tmp_path, tiny_model_path):
    """Same seeds, skip on vs off: identical rewards, loss and gradient norm per step, and the same weight
    update (helpers.assert_same_update), while some steps really did skip completions (trained_fraction < 1)."""
    common = [*small_run_overrides(tmp_path / "x", steps=3), "rollout.seed_per_prompt=true", f"loss.type={loss_type}",
              "train.prompts_per_step=8", "train.micro_batch_size=8", "train.num_iterations=2"]
    runs = {}
    for skip in (True, False):
        out = tmp_path / f"skip-{skip}"
        result = run_cli(["train", "configs/demo_cpu.yaml", *common, f"output_dir={out}", f"train.skip_zero_advantage={str(skip).lower()}"])
        assert result.returncode == 0, result.stderr[-3000:]
        runs[skip] = out
    on, off = read_metrics(runs[True]), read_metrics(runs[False])
    assert [r["reward"] for r in on] == [r["reward"] for r in off]
    assert [r["completions/trained_fraction"] for r in off] == [1.0, 1.0, 1.0]
    assert min(r["completions/trained_fraction"] for r in on) < 1.0  # some groups had one reward for all
    # Float rounding only: the two runs pad and sum different micro-batches, and the difference compounds over
    # 6 optimizer steps (2e-5 relative in grad_norm at step 3 on an Intel Xeon). A completion wrongly left out
    # changes the update by its share of the batch, orders of magnitude more.
    for key in ("loss", "grad_norm", "clip_ratio/region_mean"):
        assert [r[key] for r in on] == pytest.approx([r[key] for r in off], abs=1e-6, rel=1e-4), key
    base = load_file(tiny_model_path / "model.safetensors")
    assert_same_update(base, load_file(runs[True] / "model" / "model.safetensors"),
                       load_file(runs[False] / "model" / "model.safetensors"))
