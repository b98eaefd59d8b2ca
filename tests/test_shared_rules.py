"""Rules the package needs in several places, each written once and tested here once: how seeds are mixed,
what makes a model a LoRA model, when two names clash, how many processes were launched."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest

from grpo_trainer.data import PromptSampler
from grpo_trainer.seeds import mix_seed


def test_mix_seed_folds_its_parts_in_order_into_a_64_bit_seed():
    assert mix_seed() == 0 and mix_seed(7) == 7
    assert mix_seed(3, 5) == 3 * 1_000_003 + 5
    assert mix_seed(3, 5, 2) == (3 * 1_000_003 + 5) * 1_000_003 + 2
    assert mix_seed(3, 5) != mix_seed(5, 3)
    big = mix_seed(2**62, 2**62, 1)
    assert 0 <= big < 2**63 and big == ((2**62 * 1_000_003 + 2**62) % 2**63 * 1_000_003 + 1) % 2**63
    assert 0 <= mix_seed(-1, 0) < 2**63  # negative seeds (config allows them) still give a valid seed


def test_the_prompt_order_of_an_epoch_is_seeded_by_mix_seed():
    """The sampler's epoch order is `random.Random(mix_seed(seed, epoch))`: the same rule as the sampling seeds."""
    sampler = PromptSampler(size=10, seed=3)
    first, second = sampler.next_indices(10), sampler.next_indices(10)
    for epoch, order in enumerate([first, second]):
        expected = list(range(10))
        random.Random(mix_seed(3, epoch)).shuffle(expected)
        assert order == expected


def test_the_rollout_package_exports_the_same_rule():
    from grpo_trainer import rollout

    assert rollout.mix_seed is mix_seed


def test_first_duplicate_names_the_first_name_seen_twice():
    from grpo_trainer.user_functions import first_duplicate

    assert first_duplicate([]) is None and first_duplicate(["a", "b"]) is None
    assert first_duplicate(["a", "b", "c", "b", "a"]) == "b"


def test_is_lora_tells_a_peft_model_from_a_plain_one():
    pytest.importorskip("peft")
    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_trainer.models import base_model, is_lora

    plain = LlamaForCausalLM(LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1))
    lora = get_peft_model(plain, LoraConfig(r=2, target_modules=["q_proj"], task_type="CAUSAL_LM"))
    assert is_lora(lora) and not is_lora(lora.get_base_model())
    assert base_model(lora) is lora.get_base_model() and base_model(plain) is plain


def test_launched_ranks_reads_world_size_and_a_mismatch_is_refused(monkeypatch):
    from grpo_trainer.distributed import check_distributed_setup, launched_ranks
    from grpo_trainer.errors import ConfigError

    monkeypatch.delenv("WORLD_SIZE", raising=False)
    assert launched_ranks() == 1
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert launched_ranks() == 2
    one_process = SimpleNamespace(num_processes=1, distributed_type=SimpleNamespace(value="NO"))
    with pytest.raises(ConfigError, match="2 processes were launched but Accelerate set up 1"):
        check_distributed_setup(one_process)
    check_distributed_setup(SimpleNamespace(num_processes=2, distributed_type=SimpleNamespace(value="MULTI_CPU")))
