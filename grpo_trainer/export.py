"""Export a checkpoint as a plain `save_pretrained` folder (or, for LoRA, the adapter alone).

`python -m grpo_trainer export CHECKPOINT OUT [--merge]`. The checkpoint carries its
resolved config, so the base model, LoRA settings and chat template come from it.
Works for checkpoints written by one process, DDP and FSDP-with-full-state; a DeepSpeed
ZeRO checkpoint keeps sharded weights, which this does not gather (use DeepSpeed's
zero_to_fp32 first).
"""

from __future__ import annotations

from pathlib import Path

from .checkpoint import TRAINER_STATE, read_trainer_state
from .config import config_from_dict
from .errors import TrainingError
from .models import is_lora, load_causal_lm, load_policy_weights, load_tokenizer, plain_model

WEIGHTS = "model.safetensors"  # Accelerate's name for the first prepared model's weights


def load_checkpoint_model(checkpoint: str | Path):
    """(causal LM with the checkpoint's weights, tokenizer, config) from a checkpoint folder."""
    checkpoint = Path(checkpoint)
    if not (checkpoint / TRAINER_STATE).is_file():
        raise TrainingError(f"{checkpoint} is not a complete checkpoint (no {TRAINER_STATE})")
    if not (checkpoint / WEIGHTS).is_file():
        raise TrainingError(f"{checkpoint} has no {WEIGHTS} (a DeepSpeed checkpoint? run its zero_to_fp32.py first)")
    cfg = config_from_dict(read_trainer_state(checkpoint)["config"], source=str(checkpoint / TRAINER_STATE))
    lm = load_causal_lm(cfg.model)
    load_policy_weights(lm, checkpoint / WEIGHTS, cfg.model.name_or_path)
    return lm, load_tokenizer(cfg.model, cfg.data.chat_template), cfg


def export_checkpoint(checkpoint: str | Path, out: str | Path, merge: bool = False) -> Path:
    """Write `out` as a save_pretrained folder; LoRA checkpoints give the adapter unless `merge`."""
    lm, tokenizer, _ = load_checkpoint_model(checkpoint)
    out = Path(out)
    (plain_model(lm) if merge or not is_lora(lm) else lm).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
