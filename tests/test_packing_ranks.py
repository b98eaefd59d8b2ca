"""Packing and token budgets in real multi-process runs: two ranks (DDP over gloo, and DeepSpeed ZeRO-2, which
counts accumulation steps itself) with `train.packing` and `train.micro_batch_tokens`, against one process with
the padded layout and a fixed micro-batch size.

Seeded per prompt, so both runs score the same completions; each step's loss, gradient norm, clip ratio and entropy
must agree to 1e-5 (float32: the layouts and the ranks sum in different orders), and the final weights make the
same update (helpers.assert_same_update). The token budget (120) cuts this demo's batches into a different number
of passes per step and per rank than the fixed size, and the ranks must agree on it every step
(tests/test_packing.py checks the same numbers in-process for every loss type).
"""

from __future__ import annotations

import pytest
from safetensors.torch import load_file

from grpo_trainer.metrics import read_metrics
from helpers import accelerate_launch, assert_same_update, run_cli, small_run_overrides
from test_sharding import SETUPS, float32_launch_file

COMMON = ["rollout.seed_per_prompt=true", "loss.type=dapo", "train.num_iterations=2", "train.mini_batches=2"]


@pytest.fixture(scope="module")
def one_padded_process(tmp_path_factory, tiny_model_path):
    one = tmp_path_factory.mktemp("one") / "run"
    single = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(one, steps=2), *COMMON,
                      "train.micro_batch_size=4"])
    assert single.returncode == 0, single.stderr[-3000:]
    return one


@pytest.mark.slow
@pytest.mark.xdist_group("packing-ranks")  # one worker: the one-process baseline (a module fixture) runs once
@pytest.mark.parametrize("setup", ["ddp", "zero2"])
def test_two_ranks_packed_under_a_token_budget_train_as_one_padded_process(setup, one_padded_process, tmp_path,
                                                                          tiny_model_path):
    pytest.importorskip("deepspeed") if setup.startswith("zero") else None
    one, two = one_padded_process, tmp_path / "two"
    env, expected_type = SETUPS[setup]
    launcher = accelerate_launch(float32_launch_file(setup, tmp_path), "--main_process_port", str(29751 + (setup == "zero2")))
    ranks = run_cli(["train", "configs/demo_cpu.yaml", *small_run_overrides(two, steps=2), *COMMON, "train.packing=true",
                     "train.micro_batch_tokens=120"], launcher=launcher, env=env)
    assert ranks.returncode == 0, ranks.stderr[-3000:]
    assert f"world_size=2 distributed_type={expected_type}" in ranks.stderr
    assert "grad_accum=per step (train.micro_batch_tokens=120)" in ranks.stderr
    ours, theirs = read_metrics(two), read_metrics(one)
    assert [r["reward"] for r in ours] == [r["reward"] for r in theirs]
    for key in ("loss", "grad_norm", "clip_ratio/region_mean", "entropy"):
        assert [r[key] for r in ours] == pytest.approx([r[key] for r in theirs], abs=1e-5, rel=1e-5), key
    base = load_file(tiny_model_path / "model.safetensors")
    assert_same_update(base, load_file(two / "model" / "model.safetensors"), load_file(one / "model" / "model.safetensors"))
