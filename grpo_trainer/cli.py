"""Command line: `python -m grpo_trainer {train,validate} CONFIG [key.sub=value ...]`.

Works the same under `accelerate launch -m grpo_trainer ...`. Problems the user
can fix (config, data, rewards) print one clear message and exit with status 2;
anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import sys

from .errors import UserError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="grpo_trainer", description="GRPO-family RL fine-tuning from a YAML config.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, help_text in [
        ("train", "train a model (use `accelerate launch -m grpo_trainer train ...` for several processes)"),
        ("validate", "load and check a config, print it resolved with every default"),
    ]:
        p = sub.add_parser(name, help=help_text)
        p.add_argument("config", help="YAML config file")
        p.add_argument("overrides", nargs="*", help="dotted overrides, e.g. train.max_steps=50 loss.type=dr_grpo")
    p = sub.add_parser("export", help="write a checkpoint's model as a save_pretrained folder")
    p.add_argument("checkpoint", help="a checkpoint folder, e.g. OUTPUT_DIR/checkpoints/step-000100")
    p.add_argument("out", help="folder to write")
    p.add_argument("--merge", action="store_true", help="LoRA runs: merge the adapter into the base weights")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        if args.command == "export":
            from .export import export_checkpoint

            print(f"exported to {export_checkpoint(args.checkpoint, args.out, merge=args.merge)}")
            return 0
        from .config import load_config

        cfg = load_config(args.config, args.overrides)
        if args.command == "validate":
            print(cfg.to_yaml(), end="")
            return 0
        if args.command == "train":
            from .trainer import train

            result = train(cfg)
            if result.is_main_process:
                print(f"done: {result.steps_done} steps; outputs in {result.output_dir}")
            return 0
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 1
