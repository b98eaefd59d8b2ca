"""The model card: README.md in the Hub's format, written beside the final model (OUTPUT_DIR/model) and by `export`.

YAML metadata first (what the Hub indexes: base model, library, license, tags with the loss type, datasets),
then how the model was trained, from the resolved config and the run's metrics.jsonl: loss, rewards, group
size, steps, completions and completion tokens trained on, hardware and processes, the reward curve (a PNG
beside the card, drawn by plot.py), the held-out evaluation when `eval.every` ran, the versions, and the
resolved config itself.

Only what is known is said: the base model is named when it is a Hub id (or a built-in with a Hub origin),
its license is carried over when the base's own card says it (a local folder's README.md, the local Hugging
Face cache; never the network), datasets when they are Hub ids. Without matplotlib the card says how to
draw the curve instead of showing it.
"""

from __future__ import annotations

import importlib.metadata
import json
import logging
import math
import os
import platform
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import in_memory
from .config import Config
from .errors import UserError
from .losses import AGGREGATION_DOCS

logger = logging.getLogger("grpo_trainer")

CARD = "README.md"
REWARD_CURVE = "reward_curve.png"
LIBRARY_TAG = "grpo-trainer"
# Built-in models: (Hub id of what it is, license). The tiny models are built by this package (Apache-2.0).
BUILTIN_MODELS = {
    "builtin:smollm2-135m-instruct": ("HuggingFaceTB/SmolLM2-135M-Instruct", "apache-2.0"),
    "builtin:tiny": (None, "apache-2.0"),
    "builtin:tiny-tools": (None, "apache-2.0"),
    "builtin:tiny-guess": (None, "apache-2.0"),
}
VERSIONS = ("grpo-trainer", "torch", "transformers", "accelerate", "peft", "datasets", "vllm", "deepspeed")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


@dataclass(frozen=True)
class Setup:
    """Where the run trained: what the card says under hardware and processes (None: not recorded)."""

    processes: int
    distributed_type: str | None = None
    hardware: str | None = None


def setup_of(accelerator) -> Setup:
    """The setup of this run, as Accelerate set it up."""
    return Setup(accelerator.num_processes, accelerator.distributed_type.value, describe_hardware(accelerator.device))


def describe_hardware(device) -> str:
    """`N x <GPU name>` on GPUs; the CPU's model name and core count on a CPU."""
    import torch

    if getattr(device, "type", str(device)) == "cuda" and torch.cuda.is_available():
        return f"{torch.cuda.device_count()} x {torch.cuda.get_device_name(0)} per node"
    cpu = platform.processor() or "CPU"
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    return f"CPU: {cpu} ({os.cpu_count()} cores)"


def write_model_card(
    folder: str | Path, cfg: Config, metrics_dir: str | Path, setup: Setup, adapter: bool = False
) -> Path:
    """Write `folder`/README.md (and the reward curve beside it) for the model trained as `cfg` says, from
    `metrics_dir`/metrics.jsonl (the run's folder, or a checkpoint's). `adapter`: the folder holds a PEFT adapter."""
    folder = Path(folder)
    rows = _read_metrics(Path(metrics_dir))
    curve = _draw_reward_curve(Path(metrics_dir), folder) if rows else None
    text = model_card_text(cfg, rows, setup, curve, adapter)
    path = folder / CARD
    path.write_text(text)
    return path


def model_card_text(
    cfg: Config, rows: list[dict[str, Any]], setup: Setup, curve: str | None, adapter: bool = False
) -> str:
    """The card: metadata, then the body (see the module docstring)."""
    from huggingface_hub import ModelCardData

    base, license_ = base_model(cfg)
    data = ModelCardData(
        base_model=base,
        library_name="peft" if adapter else "transformers",
        license=license_,
        tags=_tags(cfg, adapter),
        datasets=[d for d in (_hub_dataset(cfg.data.source), _hub_dataset(cfg.data.eval_source)) if d] or None,
        pipeline_tag="text-generation",
    )
    sections = [
        f"---\n{data.to_yaml()}\n---",
        _title(cfg, base),
        _training_section(cfg, rows, setup),
        _reward_section(rows, curve),
        _eval_section(rows),
        _versions_section(),
        _config_section(cfg),
    ]
    return "\n\n".join(s for s in sections if s) + "\n"


# ----------------------------------------------------------------------------- metadata


def base_model(cfg: Config) -> tuple[str | None, str | None]:
    """(the base model's Hub id, its license), each None when not known here."""
    name = cfg.model.name_or_path
    if name in BUILTIN_MODELS:
        return BUILTIN_MODELS[name]
    # a model object: where it was loaded from, if it says
    source = in_memory.model_source(name) if in_memory.is_reference(name) else name
    if not source:
        return None, None
    local = Path(source)
    if local.is_dir():
        return None, _license_in(local / CARD)
    if HUB_ID.match(source):
        return source, _license_in(_cached_card(source))
    return None, None


def _cached_card(repo_id: str) -> Path | None:
    """The base model's README.md from the local Hugging Face cache, if it was downloaded (no network)."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(repo_id, CARD)
    except Exception:  # noqa: BLE001 (a malformed id, an unreadable cache: the license is just not known)
        return None
    return Path(found) if isinstance(found, str) else None


def _license_in(card: Path | None) -> str | None:
    if card is None or not card.is_file():
        return None
    try:
        from huggingface_hub import ModelCard

        return ModelCard.load(card, ignore_metadata_errors=True).data.license
    except Exception:  # noqa: BLE001 (a card without metadata)
        return None


def _tags(cfg: Config, adapter: bool) -> list[str]:
    tags = [LIBRARY_TAG, "reinforcement-learning", "grpo", cfg.loss.variant.name]
    if cfg.model.lora is not None or adapter:
        tags.append("lora")
    if cfg.environment.tools:
        tags.append("tool-use")
    return list(dict.fromkeys(tags))


def _hub_dataset(source: str | None) -> str | None:
    if not source or in_memory.is_reference(source) or source.startswith("builtin:") or Path(source).exists():
        return None
    return source if HUB_ID.match(source) else None


# ----------------------------------------------------------------------------- body


def _title(cfg: Config, base: str | None) -> str:
    name = Path(cfg.output_dir).name
    origin = f"[{base}](https://huggingface.co/{base})" if base else f"`{_describe_model(cfg)}`"
    return (
        f"# {name}\n\n{origin}, trained by grpo-trainer with reinforcement learning from verifiable rewards, "
        f"loss `{cfg.loss.type}`."
    )


def _describe_loss(cfg: Config) -> str:
    """The loss as the registry describes it (losses.LOSS_VARIANTS, or the user's type): paper, aggregation and
    the options it was trained with."""
    variant = cfg.loss.variant
    options = ", ".join(f"{k} {_option(v)}" for k, v in cfg.loss.options.model_dump().items() if v is not None)
    return (
        f"`{cfg.loss.type}`"
        + (f" ({variant.paper})" if variant.paper else "")
        + f"; aggregation: {AGGREGATION_DOCS[variant.aggregation]}"
        + (f"; options {options}" if options else "")
        + f"; advantages `{cfg.loss.advantage}`, scaled by `{cfg.loss.scale_rewards}`; KL beta {cfg.loss.beta:g}"
    )


def _option(value: Any) -> str:
    return f"{value:g}" if isinstance(value, float) else str(value)


def _describe_model(cfg: Config) -> str:
    if in_memory.is_reference(cfg.model.name_or_path):
        return in_memory.model_source(cfg.model.name_or_path) or "a model object given in Python"
    return cfg.model.name_or_path


def _describe_data(source: str, split: str | None) -> str:
    if in_memory.is_reference(source):
        name, fingerprint = in_memory.parse(source)
        return f"a dataset given in Python ({name}, fingerprint `{fingerprint}`)"
    return f"`{source}`" + (f" (split `{split}`)" if split else "")


def _training_section(cfg: Config, rows: list[dict[str, Any]], setup: Setup) -> str:
    completions_per_step = cfg.train.prompts_per_step * cfg.rollout.num_generations
    steps = int(rows[-1]["step"]) if rows else 0
    tokens = sum(r.get("completions/mean_length", 0.0) or 0.0 for r in rows) * completions_per_step
    seconds = sum(r.get("step_time", 0.0) or 0.0 for r in rows)
    logged = f" (over the {len(rows)} logged steps)" if rows and len(rows) != steps else ""
    rewards = ", ".join(f"`{_reward_name(r)}` (weight {r.weight:g})" for r in cfg.rewards)
    lr = f"{cfg.train.learning_rate:g} ({cfg.train.lr_scheduler}, {cfg.train.warmup_steps} warmup steps)"
    table = [
        ("loss", _describe_loss(cfg)),
        ("rewards", rewards),
        ("group size G", f"{cfg.rollout.num_generations} completions per prompt"),
        ("prompts per step", str(cfg.train.prompts_per_step)),
        ("steps", f"{steps} (of train.max_steps {cfg.train.max_steps})"),
        ("completions trained on", f"{steps * completions_per_step:,}"),
        ("completion tokens trained on", f"{tokens:,.0f}{logged}"),
        ("max completion length", f"{cfg.rollout.max_completion_length} tokens"),
        ("learning rate", lr),
        ("training data", _describe_data(cfg.data.source, cfg.data.split)),
        (
            "model",
            f"`{cfg.model.dtype}`"
            + (f", LoRA r={cfg.model.lora.r} alpha={cfg.model.lora.alpha}" if cfg.model.lora else ", all weights"),
        ),
        ("sampling", f"`{cfg.rollout.engine}` engine, temperature {cfg.rollout.temperature:g}"),
        ("hardware", setup.hardware or "not recorded"),
        ("processes", f"{setup.processes}" + (f" ({setup.distributed_type})" if setup.distributed_type else "")),
    ]
    if seconds:
        table.append(("training time", f"{seconds / 60:.1f} min in steps{logged}"))
    lines = ["## Training", "", "| | |", "|---|---|"] + [f"| {k} | {v} |" for k, v in table]
    return "\n".join(lines)


def _reward_name(reward) -> str:
    if reward.alias:
        return reward.alias
    if in_memory.is_reference(reward.name):
        return in_memory.parse(reward.name)[0].removeprefix(in_memory.REWARD_PREFIX)
    return reward.name.rpartition(":")[2] if ":" in reward.name else reward.name


def _reward_section(rows: list[dict[str, Any]], curve: str | None) -> str:
    rewards = [r["reward"] for r in rows if isinstance(r.get("reward"), (int, float)) and math.isfinite(r["reward"])]
    if not rewards:
        return ""
    k = max(1, len(rewards) // 10)
    lines = ["## Reward", ""]
    if curve:
        lines += [f"![Training reward]({curve})", ""]
    else:
        lines += [
            "(No curve: drawing it needs matplotlib, `pip install 'grpo-trainer[plot]'`; "
            "`python -m grpo_trainer plot OUTPUT_DIR` draws it from the run's metrics.)",
            "",
        ]
    lines.append(
        f"Mean training reward over the first 10% of logged steps: **{sum(rewards[:k]) / k:.3f}**; "
        f"over the last 10%: **{sum(rewards[-k:]) / k:.3f}**."
    )
    return "\n".join(lines)


def _eval_section(rows: list[dict[str, Any]]) -> str:
    evaluated = [r for r in rows if any(key.startswith("eval/") for key in r)]
    if not evaluated:
        return ""
    keys = [
        key
        for key in dict.fromkeys(k for r in evaluated for k in r)
        if key.startswith("eval/") and key != "eval/num_prompts"
    ]
    header = [key.removeprefix("eval/") for key in keys]
    prompts = evaluated[-1].get("eval/num_prompts")
    lines = [
        "## Held-out evaluation",
        "",
        f"On {int(prompts) if prompts else 'the'} held-out prompts during training (mean@k: the mean reward of k "
        "samples; pass@k: the chance one of k is correct, reward > 0):",
        "",
        "| step | " + " | ".join(header) + " |",
        "|---" * (len(keys) + 1) + "|",
    ]
    for row in evaluated:
        cells = [f"{row[key]:.3f}" if isinstance(row.get(key), (int, float)) else "" for key in keys]
        lines.append(f"| {int(row['step'])} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def _config_section(cfg: Config) -> str:
    data = cfg.model_dump(mode="json")
    given = sorted({in_memory.parse(v)[0] for v in _leaves(data) if in_memory.is_reference(v)})
    how = (
        "`python -m grpo_trainer train config.yaml` reruns it"
        if not given
        else "`object:...` names what was given in Python ("
        + ", ".join(given)
        + "): `grpo_trainer.train(config, ...)` "
        "with the same objects reruns it"
    )
    return f"## Configuration\n\nThe resolved configuration ({how}):\n\n```yaml\n{cfg.to_yaml()}```"


def _leaves(tree: Any) -> list[Any]:
    if isinstance(tree, dict):
        return [leaf for value in tree.values() for leaf in _leaves(value)]
    if isinstance(tree, list):
        return [leaf for value in tree for leaf in _leaves(value)]
    return [tree]


def _versions_section() -> str:
    found = []
    for package in VERSIONS:
        try:
            found.append(f"{package} {importlib.metadata.version(package)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return "## Versions\n\n" + ", ".join([*found, f"Python {platform.python_version()}"]) + "."


# ----------------------------------------------------------------------------- inputs


def _read_metrics(folder: Path) -> list[dict[str, Any]]:
    """The metric lines of folder/metrics.jsonl, by step (a half-written last line is skipped)."""
    path = folder / "metrics.jsonl"
    rows = []
    for line in path.read_text().splitlines() if path.is_file() else []:
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), (int, float)):
            rows.append(row)
    return sorted({int(r["step"]): r for r in rows}.values(), key=lambda r: r["step"])


def _draw_reward_curve(metrics_dir: Path, folder: Path) -> str | None:
    """The reward panel of plot.py as REWARD_CURVE in `folder`; its file name, or None without matplotlib."""
    from .plot import plot_panel, read_run

    try:
        why = plot_panel(read_run(metrics_dir), "reward", folder / REWARD_CURVE)
    except UserError as exc:  # matplotlib missing, no metrics
        logger.info("model card: no reward curve (%s)", exc)
        return None
    return None if why else REWARD_CURVE
