"""Export a checkpoint as a plain `save_pretrained` folder (or, for LoRA, the adapter alone).

`python -m grpo_trainer export CHECKPOINT OUT [--merge]`. The checkpoint carries its
resolved config, so the base model, LoRA settings and chat template come from it.
Works for checkpoints written by one process, DDP and FSDP-with-full-state; a DeepSpeed
ZeRO checkpoint keeps sharded weights, which this does not gather (use DeepSpeed's
zero_to_fp32 first).
"""

from __future__ import annotations

from pathlib import Path

from .checkpoint import load_checkpoint_model
from .models import is_lora, plain_model


def export_checkpoint(checkpoint: str | Path, out: str | Path, merge: bool = False) -> Path:
    """Write `out` as a save_pretrained folder; LoRA checkpoints give the adapter unless `merge`."""
    lm, tokenizer, _ = load_checkpoint_model(checkpoint)
    out = Path(out)
    (plain_model(lm) if merge or not is_lora(lm) else lm).save_pretrained(out)
    tokenizer.save_pretrained(out)
    return out
