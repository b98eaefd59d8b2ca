"""Command line: `python -m grpo_trainer {train,validate,eval,kernels} CONFIG [key.sub=value ...]`, `plot OUTPUT_DIR`,
`export CHECKPOINT OUT`, `serve CONFIG [...] [-- VLLM_ARGS]` (a vLLM server for rollout.engine=vllm_server).

Works the same under `accelerate launch -m grpo_trainer ...`. Exit status: 0 done; 2 a problem the
user can fix (config, data, rewards, a failed checkpoint save), printed as one clear message; 75 stopped
by a preemption signal after saving a checkpoint (resume with checkpoint.resume=auto); anything else is a
bug and keeps its traceback (or, with a line saying so, user code that ended the process with `os._exit(0)`: 1).
"""

from __future__ import annotations

import argparse
import contextlib
import sys
from collections.abc import Iterator

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
    p = sub.add_parser("eval", help="mean@k and pass@k of each reward on the held-out split (data.eval_split)")
    p.add_argument("config", help="YAML config file (the run's OUTPUT_DIR/config.yaml works)")
    p.add_argument("overrides", nargs="*", help="dotted overrides")
    p.add_argument(
        "--checkpoint", help="OUTPUT_DIR/model, a checkpoint folder, or an adapter folder (default: model.name_or_path)"
    )
    p.add_argument("--k", type=int, help="samples per prompt (default: eval.num_generations)")
    p = sub.add_parser(
        "serve",
        help="start a vLLM server for rollout.engine=vllm_server with the flags it needs (vLLM arguments after --)",
    )
    p.add_argument("config", help="YAML config file (the trainer's)")
    p.add_argument("overrides", nargs="*", help="dotted overrides")
    p.add_argument("--port", type=port_number, help="default: the port of the (first) server URL in the config")
    p.add_argument("--host", type=host_name, help="default: the URL's host if it is loopback, else 0.0.0.0")
    p.add_argument("--tensor-parallel-size", type=positive_int, help="default: rollout.vllm.tensor_parallel_size")
    p.add_argument("--dry-run", action="store_true", help="print the command instead of running it")
    p = sub.add_parser(
        "kernels",
        help="this machine's decode-kernel choices for a config (hf engine, CPU): cached, "
        "measured where missing, or all timed again with --remeasure",
    )
    p.add_argument("config", help="YAML config file")
    p.add_argument("overrides", nargs="*", help="dotted overrides")
    p.add_argument(
        "--remeasure",
        action="store_true",
        help="time every choice again (new runs on this machine may then sample differently)",
    )
    p = sub.add_parser("plot", help="write PNG plots of a run's metrics to OUTPUT_DIR/plots")
    p.add_argument("output_dir", help="the run's output_dir (holding metrics.jsonl)")
    p.add_argument("--out", help="folder for the PNGs (default: OUTPUT_DIR/plots)")
    p = sub.add_parser("export", help="write a checkpoint's model as a save_pretrained folder")
    p.add_argument("checkpoint", help="a checkpoint folder, e.g. OUTPUT_DIR/checkpoints/step-000100")
    p.add_argument("out", help="folder to write")
    p.add_argument("--merge", action="store_true", help="LoRA runs: merge the adapter into the base weights")
    return parser


def port_number(text: str) -> int:
    """A TCP port a server can listen on (argparse names the option when this refuses)."""
    if not text.strip().isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port number (1-65535)")
    return int(text)


def host_name(text: str) -> str:
    """An address a server can listen on: not empty (vLLM would read '' as every interface, serve as the default)."""
    if not text.strip() or any(c.isspace() for c in text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a host name or address (e.g. 127.0.0.1 or 0.0.0.0)")
    return text


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number of at least 1")
    return int(text)


def next_commands(output_dir) -> str:
    """What to run after training, with this run's paths and this interpreter, ready to paste."""
    import os
    from pathlib import Path

    output_dir = Path(output_dir)
    python = os.path.relpath(sys.executable)
    python = python if not python.startswith("..") and os.path.isfile(python) else "python"
    model = output_dir / "model"
    if not model.is_dir():  # checkpoint.save_final_model=false: the last checkpoint
        latest = output_dir / "checkpoints" / "latest"
        model = output_dir / "checkpoints" / latest.read_text().strip() if latest.is_file() else None
    lines = ["next:", f"  {python} -m grpo_trainer plot {output_dir}        # reward, lengths, KL, clip ratios as PNGs"]
    if model is not None:
        lines.append(
            f"  {python} -m grpo_trainer eval {output_dir / 'config.yaml'} --checkpoint {model}"
            "        # held-out mean@k and pass@k"
        )
    return "\n".join(lines)


def report_kernels(cfg, remeasure: bool) -> int:
    """Print the plan a run of `cfg` would sample with here; with `remeasure`, what timing again changed (the
    timed decisions only: those that change numerics follow a rule, rollout/kernels.py)."""
    from .rollout.kernels import default_table
    from .run import measure_decode_kernels

    before, after = measure_decode_kernels(cfg, remeasure)
    if not after:
        print("nothing to choose: only the hf engine's own decode loop (model.share_prompt) has alternative kernels")
        return 0
    for key, choice in sorted(after.items()):
        print(f"{key:40s} {choice}" + (f"   (was {before[key]})" if before[key] != choice else ""))
    print(f"cache: {default_table().path}")
    if remeasure:
        changed = sum(before[key] != after[key] for key in after)
        print(
            f"{changed} of {len(after)} choices changed"
            + (
                ": only exact alternatives are timed, so new runs sample what earlier ones with the same config "
                "and seed sampled, at another speed"
                if changed
                else ""
            )
        )
    return 0


@contextlib.contextmanager
def user_code(command: str) -> Iterator[None]:
    """Around a command that calls user code (rewards, tools, environments): `os._exit` from that code ends the
    process with a failure and a line saying so (deadline.guard_os_exit); `sys.exit()` from it reaching here (user
    code run in this thread) is an error, never a silent success. (__main__ then ends a process that threads left by
    that code would keep alive: deadline.end_process_if_held.)"""
    from .deadline import guard_os_exit

    with guard_os_exit():
        try:
            yield
        except SystemExit as exc:
            raise UserError(
                f"{command}: user code called sys.exit({exc.code!r}) (SystemExit) while it ran; the {command} did not "
                "finish (a reward, a tool or an environment must raise an exception or return, not exit)"
            ) from None


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    vllm_args: list[str] = []
    if argv[:1] == ["serve"] and "--" in argv:  # serve: what follows -- is vLLM's
        argv, vllm_args = argv[: argv.index("--")], argv[argv.index("--") + 1 :]
    args, extra = parser.parse_known_args(argv)
    # Overrides may also come after --options (argparse stops collecting positionals there).
    stray = [a for a in extra if a.startswith("-") or "=" not in a]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    try:
        if args.command == "plot":
            from .plot import plot_run

            for path in plot_run(args.output_dir, args.out, on_skip=lambda note: print(f"skipped: {note}")):
                print(path)
            return 0
        if args.command == "export":
            from .export import export_checkpoint

            print(f"exported to {export_checkpoint(args.checkpoint, args.out, merge=args.merge)}")
            return 0
        from .config import load_config

        cfg = load_config(args.config, args.overrides)
        if args.command == "validate":
            from .preflight import preflight

            for warning in preflight(cfg):
                print(f"warning: {warning}", file=sys.stderr)
            print(cfg.to_yaml(), end="")
            return 0
        if args.command == "serve":
            from .serve import serve

            return serve(
                cfg,
                host=args.host,
                port=args.port,
                tensor_parallel_size=args.tensor_parallel_size,
                vllm_args=vllm_args,
                dry_run=args.dry_run,
            )
        if args.command == "kernels":
            with user_code("kernels"):
                return report_kernels(cfg, args.remeasure)
        if args.command == "eval":
            from .evaluate import evaluate, format_results

            with user_code("eval"):
                print(format_results(evaluate(cfg, args.checkpoint, args.k)))
            return 0
        if args.command == "train":
            from .distributed import exit_without_teardown, launched_ranks
            from .trainer import train

            with user_code("train"):
                result = train(cfg)
            code = 0
            if result.preempted_by:
                from .preemption import PREEMPTED_EXIT_CODE

                code = PREEMPTED_EXIT_CODE
            elif result.is_main_process:
                print(f"done: {result.steps_done} steps; outputs in {result.output_dir}")
                print(next_commands(result.output_dir))
            if launched_ranks() > 1:
                exit_without_teardown(code)  # see its docstring: a rank can abort in teardown after a finished run
            return code
    except UserError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    return 1
