"""Local paths made absolute once, at the start of a run."""

from __future__ import annotations

from pathlib import Path

from .load import config_from_dict
from .root import Config


def with_absolute_paths(cfg: Config, base: str | Path | None = None) -> Config:
    """`cfg` with every local path it names made absolute against `base` (default: the current folder), once, at
    the start of a run: user code that calls os.chdir (an environment, a reward) would otherwise split the run,
    its config.yaml and metrics in one folder and its checkpoints and model in another, and a later resume=auto
    would find nothing. Paths: output_dir, checkpoint.resume, rollout.vllm_server.weights_dir; the file of each
    `file.py:name` spec (rewards, environment.tools, environment.factory/openenv/action, loss.type); model, tokenizer,
    teacher and reward-model folders and data files that exist here. Hub ids, `builtin:` and `object:` names,
    and `package.module:name` specs are left as they are."""
    import os

    root = Path(base) if base is not None else Path.cwd()

    def absolute(path: str) -> str:
        return os.path.normpath(root / path) if not os.path.isabs(path) else path

    def spec(value: str) -> str:
        module, sep, name = value.rpartition(":")
        return f"{absolute(module)}:{name}" if sep and module.endswith(".py") else value

    def existing(value: str | None) -> str | None:
        if value is None or ":" in value.split("/", 1)[0]:  # builtin:..., object:..., a URL
            return value
        return absolute(value) if (root / value).exists() else value

    data = cfg.dump_unresolved()  # `auto` stays auto: a resume can still keep its checkpoint's value
    data["output_dir"] = absolute(cfg.output_dir)
    if cfg.checkpoint.resume not in ("auto", "never"):
        data["checkpoint"]["resume"] = absolute(cfg.checkpoint.resume)
    if cfg.rollout.vllm_server.weights_dir:
        data["rollout"]["vllm_server"]["weights_dir"] = absolute(cfg.rollout.vllm_server.weights_dir)
    data["environment"]["tools"] = [spec(t) for t in cfg.environment.tools]
    for key in ("factory", "openenv", "action"):
        if data["environment"][key] is not None:
            data["environment"][key] = spec(data["environment"][key])
    data["loss"]["type"] = spec(cfg.loss.type)
    for entry in data["rewards"]:
        entry["name"] = spec(entry["name"])
        if entry.get("model"):
            entry["model"]["path"] = existing(entry["model"]["path"])
    data["model"]["name_or_path"] = existing(cfg.model.name_or_path)
    data["model"]["tokenizer"] = existing(cfg.model.tokenizer)
    if data.get("teacher"):
        data["teacher"]["name_or_path"] = existing(data["teacher"]["name_or_path"])
    data["data"]["source"] = existing(cfg.data.source)
    data["data"]["eval_source"] = existing(cfg.data.eval_source)
    return config_from_dict(data, source="the config with absolute paths")
