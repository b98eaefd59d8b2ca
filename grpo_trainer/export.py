"""Models out: `save_model` writes the `save_pretrained` folders of a run, `export` those of a checkpoint.

`python -m grpo_trainer export CHECKPOINT OUT [--merge]`. The checkpoint carries its
resolved config, so the base model, LoRA settings and chat template come from it.
Works for checkpoints written by one process, DDP and FSDP-with-full-state; a DeepSpeed
ZeRO checkpoint keeps sharded weights, which this does not gather (use DeepSpeed's
zero_to_fp32 first).

A LoRA model is written as its adapter alone (PEFT's folder) and/or merged into plain weights; the merged
weights are computed beside the live model (`weight_sync.iter_merged_weights`, PEFT's own delta), never by
merging it in place, so the model can still be used (and, under ZeRO-3, re-partitioned) afterwards.
"""

from __future__ import annotations

from pathlib import Path

from .checkpoint import load_checkpoint_model, read_trainer_state
from .deepspeed_guard import deepspeed_left_unimported
from .model_card import Setup, write_model_card
from .models import base_model, is_lora


def save_model(
    lm, tokenizer, folder: Path | None = None, *, adapter_folder: Path | None = None, state_dict: dict | None = None
) -> None:
    """Write `lm` with `tokenizer` as a plain `save_pretrained` folder (`folder`; a LoRA model merged) and, for a
    LoRA model, its adapter alone (`adapter_folder`). Either may be None.

    `state_dict` (a plain model's weights, e.g. gathered by Accelerate) replaces the model's own. Under ZeRO-3
    call this inside a gather of every parameter (`distributed.gathered_if_zero3`): PEFT and the merge read the
    live parameters.
    """
    if adapter_folder is not None and not is_lora(lm):
        raise ValueError("save_model: an adapter folder was asked of a model without LoRA adapters")
    with deepspeed_left_unimported():
        if adapter_folder is not None:
            lm.save_pretrained(adapter_folder)
            tokenizer.save_pretrained(adapter_folder)
        if folder is None:
            return
        if is_lora(lm):
            from .rollout.weight_sync import iter_merged_weights

            state_dict = {name: tensor.to("cpu", copy=True) for name, tensor in iter_merged_weights(lm)}
        base_model(lm).save_pretrained(folder, state_dict=state_dict)
        tokenizer.save_pretrained(folder)


def export_checkpoint(checkpoint: str | Path, out: str | Path, merge: bool = False) -> Path:
    """Write `out` as a save_pretrained folder with a model card; LoRA checkpoints give the adapter unless `merge`.

    The card is made from the checkpoint's config and metrics; the checkpoint records the number of processes,
    not the hardware."""
    lm, tokenizer, cfg = load_checkpoint_model(checkpoint)
    out = Path(out)
    adapter = is_lora(lm) and not merge
    if adapter:
        save_model(lm, tokenizer, adapter_folder=out)
    else:
        save_model(lm, tokenizer, out)
    processes = read_trainer_state(checkpoint).get("world_size") or 1
    write_model_card(out, cfg, checkpoint, Setup(processes=int(processes)), adapter=adapter)
    return out
