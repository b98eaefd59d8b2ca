"""Export a checkpoint as a plain `save_pretrained` folder (or, for LoRA, the adapter alone).

`python -m grpo_trainer export CHECKPOINT OUT [--merge]`. The checkpoint carries its
resolved config, so the base model, LoRA settings and chat template come from it.
Works for checkpoints written by one process, DDP and FSDP-with-full-state; a DeepSpeed
ZeRO checkpoint keeps sharded weights, which this does not gather (use DeepSpeed's
zero_to_fp32 first).
"""

from __future__ import annotations

from pathlib import Path

from .checkpoint import load_checkpoint_model, read_trainer_state
from .model_card import Setup, write_model_card
from .models import is_lora, plain_model


def export_checkpoint(checkpoint: str | Path, out: str | Path, merge: bool = False) -> Path:
    """Write `out` as a save_pretrained folder with a model card; LoRA checkpoints give the adapter unless `merge`.

    The card is made from the checkpoint's config and metrics; the checkpoint records the number of processes,
    not the hardware."""
    lm, tokenizer, cfg = load_checkpoint_model(checkpoint)
    out = Path(out)
    adapter = is_lora(lm) and not merge
    (lm if adapter else plain_model(lm)).save_pretrained(out)
    tokenizer.save_pretrained(out)
    processes = read_trainer_state(checkpoint).get("world_size") or 1
    write_model_card(out, cfg, checkpoint, Setup(processes=int(processes)), adapter=adapter)
    return out
