"""Side-by-side speed of this trainer and TRL's GRPOTrainer on the same work.

    python scripts/bench.py                      # tiny model, both trainers, 3 alternating reps each (~3-5 min on 2 cores)
    python scripts/bench.py --model large        # ~25M-parameter random-init Llama: compute-bound, not overhead-bound
    python scripts/bench.py --model smollm2      # the real SmolLM2-135M-Instruct on word problems (~15 min with TRL)
    python scripts/bench.py --model large --engine vllm   # both trainers generate with vLLM (colocated; CPU build works)
    python scripts/bench.py --trainers ours      # this trainer only (no TRL needed)
    python scripts/bench.py --json bench.json    # also write the numbers as JSON

Same model (built offline), same data (the bundled arithmetic train split, chat-templated by each
trainer itself), same G, prompts per step, max completion length, loss (`grpo`, beta 0, one
iteration), learning rate, Adam betas, grad clipping, seed, temperature 1 with HF `generate`, the
same reward function (`rewards.math_accuracy`, TRL's signature), float32, no gradient
checkpointing. One TRL generation batch is one optimizer step (per_device_train_batch_size x
gradient_accumulation_steps = prompts_per_step x G; steps_per_generation = gradient_accumulation_steps).

Every run is its own process, and the trainers alternate (ours, TRL, ours, TRL, ...), so drift in
machine load hits both alike. The first `--warmup` steps of each run are dropped; the table shows
the median over the remaining steps of all reps, and under it the ours/TRL ratio of each alternating
pair of reps with its spread (the JSON's `ratio_spread_over_reps`). The machine is measured first and
recorded with every number (scripts/machine.py: CPU model and flags, ATen's vector capability, threads,
load average at the start and the end, matmul peak, read bandwidth).

Columns:
  step time         wall time of one optimizer step (ours: `step_time` in metrics.jsonl; TRL: a
                    TrainerCallback from on_step_begin to on_step_end). Both include generation,
                    rewards, log-prob passes, forward/backward and the optimizer step.
  rollout tok/s     completion tokens generated per second of generation time (ours:
                    `timing/rollout`; TRL: time inside `GRPOTrainer._generate_single_turn`, measured by
                    a subclass that only wraps it).
  train tok/s       (prompt + completion) tokens of the step's completions per second of step time.
  peak RSS          the run's process's own peak resident set, MiB: VmHWM from /proc/self/status, read by
                    that process itself when its run ends (processes it starts are not in it); GPU peak
                    allocated memory too when CUDA is present. Not ru_maxrss (os.wait4, or RUSAGE_SELF in the
                    child): on Linux a child's starts at its parent's high-water mark, which exec carries
                    over, and this driver's own (machine.describe's 512 MiB buffer) would be every run's floor.

TRL is looked for in this interpreter, then in $TRL_PYTHON, then /tmp/trl-venv/bin/python. See
docs/performance.md for how that venv is made.

Internal subcommands (one run each, started by the driver): `_run_ours`, `_run_trl`.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

# Per model size: the defaults that keep `make bench` (tiny) well under 10 minutes on 2 cores.
PRESETS = {
    "tiny": dict(prompts_per_step=16, num_generations=8, max_completion_length=16, micro_batch_size=64,
                 steps=8, warmup=2, reps=3, learning_rate=2e-4),
    # The random-init large model's rewards are all 0: with skip_zero_advantage our update would be skipped
    # outright, which says nothing about speed. It is off for this model, so both trainers do the full passes.
    "large": dict(prompts_per_step=4, num_generations=8, max_completion_length=32, micro_batch_size=16,
                  steps=5, warmup=1, reps=2, learning_rate=1e-5, skip_zero_advantage=False),
    # The real pretrained model (builtin:smollm2-135m-instruct) on its recipe's task with configs/smollm2_cpu.yaml's
    # shapes: fp32, 4 prompts x G 8 (32 completions a step), up to 64 new tokens, 8 completions per micro-batch,
    # dr_grpo, beta 0 (issue 47: the bound, the targets and the bench are one piece of work; until 12-06 this was
    # G 4, 16 per micro-batch). One TRL step is ~30-40 s here: 3 reps x 4 steps.
    "smollm2": dict(prompts_per_step=4, num_generations=8, max_completion_length=64, micro_batch_size=8,
                    steps=4, warmup=1, reps=3, learning_rate=1e-6, loss_type="dr_grpo", task="word_problems"),
}
# What each task's prompts look like to both trainers: the bundled records, with this system prompt (if any).
TASKS = {
    "arithmetic": None,
    "word_problems": "Solve the problem. Give the final answer as a number in \\boxed{}.",
}
LARGE_ARCH = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=8, num_attention_heads=8,
                  num_key_value_heads=8, max_position_embeddings=512)
LARGE_VERSION = 1


# ----------------------------------------------------------------------------- model and data


def large_model_dir(root: Path) -> Path:
    """A ~25M-parameter random-init Llama with the tiny model's tokenizer, built once into `root`."""
    target = root / f"bench-large-v{LARGE_VERSION}"
    if (target / "config.json").is_file():
        return target
    import torch
    from transformers import AutoTokenizer, GenerationConfig, LlamaConfig, LlamaForCausalLM

    from grpo_trainer.builtin import tiny

    tokenizer = AutoTokenizer.from_pretrained(str(tiny.ensure_model()))
    config = LlamaConfig(
        vocab_size=128, tie_word_embeddings=False,
        bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"),
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, **LARGE_ARCH,
    )
    with torch.random.fork_rng():
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
    model.generation_config = GenerationConfig(
        eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, do_sample=True
    )
    staging = Path(tempfile.mkdtemp(prefix=".large-", dir=root))
    model.save_pretrained(staging)
    tokenizer.save_pretrained(staging)
    staging.rename(target)
    return target


def model_path(name: str, root: Path) -> str:
    from grpo_trainer.builtin import smollm2, tiny

    if name == "smollm2":
        return str(smollm2.ensure_model())
    return str(tiny.ensure_model() if name == "tiny" else large_model_dir(root))


def chat_records(task: str) -> list[dict]:
    """The task's train split as conversational records (TRL's format): `prompt` messages and `answer`."""
    from grpo_trainer.builtin import task_records

    system = [{"role": "system", "content": TASKS[task]}] if TASKS[task] else []
    return [{"prompt": system + [{"role": "user", "content": r["prompt"]}], "answer": r["answer"]}
            for r in task_records(f"builtin:{task}", "train")]


def prompt_tokens(path: str, task: str) -> float:
    """Mean chat-templated prompt length of the train split, in tokens (what both trainers feed the model)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    texts = [tok.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in chat_records(task)]
    lens = [len(tok(t, add_special_tokens=False)["input_ids"]) for t in texts]
    return sum(lens) / len(lens)


# ----------------------------------------------------------------------------- one run of each trainer


def spec_of(preset: dict, model_path: str, **changes) -> dict:
    """A run's spec (what `ours_config` and `run_trl` read) from a PRESETS entry, possibly edited, with `changes`
    on top; also used by scripts/profile_step.py and scripts/memory_timeline.py, so they run the bench's config."""
    return {**{k: preset[k] for k in ("prompts_per_step", "num_generations", "max_completion_length",
                                      "micro_batch_size", "steps", "learning_rate")},
            "seed": 0, "model_path": model_path,
            "skip_zero_advantage": preset.get("skip_zero_advantage", True), "loss_type": preset.get("loss_type", "grpo"),
            "task": preset.get("task", "arithmetic"), "packing": preset.get("packing", False), **changes}


def ours_config(spec: dict, output_dir: Path) -> dict:
    """This trainer's config for a bench spec (also used by scripts/profile_step.py and scripts/scaling.py), with
    the spec's `ours_overrides` (KEY=VALUE, `--ours-set`) applied."""
    from grpo_trainer.config import apply_override

    data = {
        "output_dir": str(output_dir),
        "seed": spec["seed"],
        "model": {"name_or_path": spec["model_path"], "dtype": "float32", "gradient_checkpointing": False,
                  "share_prompt": spec.get("share_prompt", True)},
        "data": {"source": f"builtin:{spec.get('task', 'arithmetic')}", "split": "train",
                 "system_prompt": TASKS[spec.get("task", "arithmetic")]},
        "rollout": {"engine": "vllm_colocate" if spec.get("engine") == "vllm" else "hf",
                    "num_generations": spec["num_generations"],
                    "max_completion_length": spec["max_completion_length"], "temperature": 1.0},
        "rewards": [{"name": "math_accuracy"}],
        "loss": {"type": spec.get("loss_type", "grpo"), "beta": 0.0, "scale_rewards": "group"},
        "train": {"max_steps": spec["steps"], "prompts_per_step": spec["prompts_per_step"],
                  "micro_batch_size": spec["micro_batch_size"], "learning_rate": spec["learning_rate"],
                  "warmup_steps": 0, "lr_scheduler": "constant", "adam_beta2": 0.99, "max_grad_norm": 1.0,
                  "skip_zero_advantage": spec.get("skip_zero_advantage", True), "packing": spec.get("packing", False)},
        "checkpoint": {"save_every": 0, "resume": "never", "save_final_model": False},
        "logging": {"progress_bar": False, "report_to": ["jsonl"]},
    }
    for override in spec.get("ours_overrides", []):
        apply_override(data, override)
    return data


def run_ours(spec: dict, out: Path) -> None:
    """`python -m grpo_trainer train <generated yaml>` in this process (runpy, exactly what -m does)."""
    import runpy

    import yaml

    cfg = ours_config(spec, out / "run")
    config_path = out / "config.yaml"
    config_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    sys.argv = ["grpo_trainer", "train", str(config_path)]
    try:
        runpy.run_module("grpo_trainer", run_name="__main__")
    except SystemExit as exc:
        if exc.code not in (0, None):
            raise
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [
        {"step_time": r["step_time"], "gen_time": r["timing/rollout"], "mean_length": r["completions/mean_length"],
         "reward": r["reward"]}
        for r in rows
    ]
    _write_result(out, steps)


def run_trl(spec: dict, out: Path) -> None:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rewards import math_accuracy

    n = spec["prompts_per_step"] * spec["num_generations"]
    dataset = Dataset.from_list(chat_records(spec.get("task", "arithmetic")))
    args = GRPOConfig(
        output_dir=str(out / "run"),
        seed=spec["seed"],
        max_steps=spec["steps"],
        per_device_train_batch_size=spec["micro_batch_size"],
        gradient_accumulation_steps=n // spec["micro_batch_size"],  # one generation batch = one optimizer step
        num_generations=spec["num_generations"],
        max_completion_length=spec["max_completion_length"],
        temperature=1.0,
        top_p=1.0,
        use_vllm=spec.get("engine") == "vllm",
        vllm_mode="colocate",
        vllm_gpu_memory_utilization=0.1,  # on CPU: the share of RAM vLLM reserves
        vllm_max_model_length=512,
        loss_type=spec.get("loss_type", "grpo"),
        beta=0.0,
        num_iterations=1,
        scale_rewards="group",
        learning_rate=spec["learning_rate"],
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta2=0.99,
        max_grad_norm=1.0,
        optim="adamw_torch",
        gradient_checkpointing=False,
        bf16=False,
        fp16=False,
        model_init_kwargs={"dtype": torch.float32},
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        disable_tqdm=True,
        remove_unused_columns=False,
        log_completions=False,
    )
    assert args.steps_per_generation * args.per_device_train_batch_size == n, "one generation batch per step"

    class TimedGRPOTrainer(GRPOTrainer):
        gen_time = 0.0

        def _generate_single_turn(self, *a, **k):
            tick = time.perf_counter()
            try:
                return super()._generate_single_turn(*a, **k)
            finally:
                self.gen_time += time.perf_counter() - tick

    steps: list[dict] = []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start, trainer.gen_time = time.perf_counter(), 0.0

        def on_step_end(self, args, state, control, **kw):
            steps.append({"step_time": time.perf_counter() - self.start, "gen_time": trainer.gen_time})

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs and steps:
                steps[-1]["mean_length"] = logs["completions/mean_length"]
                steps[-1]["reward"] = logs.get("reward")

    trainer = TimedGRPOTrainer(model=spec["model_path"], reward_funcs=[math_accuracy], args=args,
                               train_dataset=dataset, callbacks=[Timer()])
    trainer.train()
    _write_result(out, steps)


def own_peak_rss_mib() -> float | None:
    """This process's own peak resident set in MiB (VmHWM in /proc/self/status), or None where there is no such file.

    Read in the process itself, because nothing else gives a child's own figure: on Linux the high-water mark of
    the memory a process had before exec (its parent's, under vfork) is carried over into its rusage, so a
    child's ru_maxrss, from os.wait4 in the parent or RUSAGE_SELF in the child, is at least its parent's peak at
    spawn (a parent that had held 900 MiB makes `python -c pass` report 913 MiB; its VmHWM says 13). VmHWM
    belongs to the process's own address space, which exec makes new."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except OSError:
        pass
    return None


def _write_result(out: Path, steps: list[dict]) -> None:
    """The run's rows and its own peak memory, written by the run's process as its last act (`run_child` reads it)."""
    result = {"steps": steps, "peak_rss_mib": own_peak_rss_mib()}
    torch = sys.modules.get("torch")  # a run that never imported torch has no GPU figure (and need not load it)
    if torch is not None and torch.cuda.is_available():
        result["gpu_peak_mib"] = torch.cuda.max_memory_allocated() / 2**20
    (out / "result.json").write_text(json.dumps(result))


# ----------------------------------------------------------------------------- driver


def find_trl_python() -> str | None:
    candidates = [sys.executable, os.environ.get("TRL_PYTHON"), "/tmp/trl-venv/bin/python"]
    for python in candidates:
        if python and Path(python).exists():
            ok = subprocess.run([python, "-c", "import trl"], capture_output=True, cwd=REPO).returncode == 0
            if ok:
                return python
    return None


def launch(trainer: str, python: str, spec: dict, out: Path, log, threads: int | None = None) -> dict:
    """One run in a child process; returns its per-step rows and its own peak RSS (`own_peak_rss_mib`, read in the
    child)."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "spec.json").write_text(json.dumps(spec))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
               TOKENIZERS_PARALLELISM="false", HF_HUB_OFFLINE="1", TRANSFORMERS_NO_ADVISORY_WARNINGS="1")
    if threads:
        env.update(OMP_NUM_THREADS=str(threads), MKL_NUM_THREADS=str(threads))
    if spec.get("engine") == "vllm":
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # GiB of KV cache when vLLM runs on CPU (both trainers)
    cmd = [python, str(Path(__file__).resolve()), f"_run_{trainer}", str(out)]
    result = run_child(cmd, out, env, trainer)
    log(f"  {trainer:4s} rep done in {result['wall_s']:5.1f}s  step times "
        + " ".join(f"{s['step_time']:.2f}" for s in result["steps"]))
    return result


def run_child(cmd: list[str], out: Path, env: dict, name: str) -> dict:
    """Run `cmd` (its output in out/log.txt) and return the result.json it wrote (`_write_result`), with its wall
    time. Its peak memory is the one it measured itself: none is taken from the wait here (see own_peak_rss_mib)."""
    with open(out / "log.txt", "w") as logfile:
        start = time.perf_counter()
        returncode = subprocess.run(cmd, cwd=REPO, env=env, stdout=logfile, stderr=subprocess.STDOUT).returncode
        wall = time.perf_counter() - start
    if returncode != 0:
        tail = (out / "log.txt").read_text()[-3000:]
        raise RuntimeError(f"{name} run failed (exit {returncode}); log {out / 'log.txt'}:\n{tail}")
    result = json.loads((out / "result.json").read_text())
    result["wall_s"] = wall
    return result


def summarize(runs: list[dict], spec: dict, prompt_len: float, warmup: int) -> dict:
    n = spec["prompts_per_step"] * spec["num_generations"]
    rows = [s for run in runs for s in run["steps"][warmup:]]
    step = [s["step_time"] for s in rows]
    rollout = [n * s["mean_length"] / s["gen_time"] for s in rows if s.get("gen_time")]
    train = [n * (prompt_len + s["mean_length"]) / s["step_time"] for s in rows]
    summary = {
        "median_step_time_s": statistics.median(step),
        "step_time_min_s": min(step),
        "step_time_max_s": max(step),
        "median_gen_time_s": statistics.median(s["gen_time"] for s in rows),
        "rollout_tokens_per_s": statistics.median(rollout) if rollout else None,
        "train_tokens_per_s": statistics.median(train),
        "mean_completion_length": statistics.mean(s["mean_length"] for s in rows),
        "peak_rss_mib": max((run["peak_rss_mib"] for run in runs if run["peak_rss_mib"] is not None), default=None),
        "steps_measured": len(rows),
        "reps": len(runs),
        "wall_s_per_run": statistics.median(run["wall_s"] for run in runs),
    }
    if any("gpu_peak_mib" in run for run in runs):
        summary["gpu_peak_mib"] = max(run.get("gpu_peak_mib", 0.0) for run in runs)
    return summary


METRICS = [
    ("median step time (s)", "median_step_time_s", "{:.3f}", "lower"),
    ("generation time/step (s)", "median_gen_time_s", "{:.3f}", "lower"),
    ("rollout tok/s (per s of generation)", "rollout_tokens_per_s", "{:.0f}", "higher"),
    ("train tok/s (prompt+completion per s of step)", "train_tokens_per_s", "{:.0f}", "higher"),
    ("mean completion length", "mean_completion_length", "{:.1f}", None),
    ("peak RSS (MiB)", "peak_rss_mib", "{:.0f}", "lower"),
    ("GPU peak allocated (MiB)", "gpu_peak_mib", "{:.0f}", "lower"),
    ("process wall time per run (s)", "wall_s_per_run", "{:.1f}", "lower"),
]


def rep_ratios(runs: dict[str, list[dict]], warmup: int) -> dict[str, dict]:
    """ours/TRL of each alternating rep pair (rep i of ours ran right before rep i of TRL, so both saw the same
    load): median step time, generation time and peak RSS, with their spread over the pairs."""
    def median_of(run, key):
        return statistics.median(s[key] for s in run["steps"][warmup:])

    pairs = list(zip(runs["ours"], runs["trl"]))
    per_rep = {
        "median_step_time_s": [median_of(a, "step_time") / median_of(b, "step_time") for a, b in pairs],
        "median_gen_time_s": [median_of(a, "gen_time") / median_of(b, "gen_time") for a, b in pairs],
        "peak_rss_mib": [a["peak_rss_mib"] / b["peak_rss_mib"] for a, b in pairs if a["peak_rss_mib"] and b["peak_rss_mib"]],
    }
    return {key: {"per_rep": [round(r, 4) for r in values], "median": statistics.median(values), "min": min(values),
                  "max": max(values)} for key, values in per_rep.items() if values}


def table(results: dict) -> str:
    names = list(results)
    head = ["metric"] + names + (["ours/TRL"] if len(names) == 2 else [])
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for label, key, fmt, _ in METRICS:
        values = [results[t].get(key) for t in names]
        if all(v is None for v in values):
            continue
        cells = [fmt.format(v) if v is not None else "-" for v in values]
        if len(names) == 2:
            a, b = values
            cells.append(f"{a / b:.2f}" if a is not None and b else "-")
        lines.append("| " + " | ".join([label] + cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in ("_run_ours", "_run_trl"):
        out = Path(argv[1])
        spec = json.loads((out / "spec.json").read_text())
        (run_ours if argv[0] == "_run_ours" else run_trl)(spec, out)
        return 0

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", choices=sorted(PRESETS), default="tiny")
    p.add_argument("--engine", choices=["hf", "vllm"], default="hf",
                   help="generation on both sides: transformers (default) or vLLM colocated in the training "
                        "process (ours: rollout.engine=vllm_colocate; TRL: use_vllm, vllm_mode=colocate). vLLM's "
                        "CPU attention does not support the tiny model's head size: use --model large")
    p.add_argument("--trainers", default="ours,trl", help="comma list of ours, trl (default: both)")
    for key in ("prompts_per_step", "num_generations", "max_completion_length", "micro_batch_size", "steps", "warmup", "reps"):
        p.add_argument("--" + key.replace("_", "-"), type=int, default=None, help="default: per --model preset")
    p.add_argument("--learning-rate", type=float, default=None)
    p.add_argument("--packing", choices=["true", "false"], default=None,
                   help="ours: train.packing (default: the --model preset's)")
    p.add_argument("--ours-set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for ours (repeatable), e.g. train.trim_host_memory=false")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch/OpenMP threads per run (OMP_NUM_THREADS); default: torch's own (all cores). "
                        "1 is far less sensitive to other load on a shared machine")
    p.add_argument("--json", type=Path, default=None, help="write the numbers here too")
    p.add_argument("--workdir", type=Path, default=None, help="keep run folders here (default: a temp dir, removed)")
    p.add_argument("--require-trl", action="store_true", help="fail instead of skipping when TRL is not found")
    args = p.parse_args(argv)

    if args.engine == "vllm" and args.model == "tiny":
        p.error("--engine vllm: vLLM's CPU attention does not support the tiny model's head_dim 24; add --model large")
    preset = dict(PRESETS[args.model])
    for key in preset:
        if getattr(args, key, None) is not None:
            preset[key] = getattr(args, key)
    if preset["steps"] <= preset["warmup"]:
        p.error("--steps must be larger than --warmup")
    n = preset["prompts_per_step"] * preset["num_generations"]
    if n % preset["micro_batch_size"]:
        p.error(f"--micro-batch-size must divide prompts_per_step x num_generations ({n})")

    trainers = [t.strip() for t in args.trainers.split(",") if t.strip()]
    pythons = {"ours": sys.executable}
    notes = []
    if "trl" in trainers:
        trl_python = find_trl_python()
        if trl_python is None:
            if args.require_trl:
                p.error("TRL not importable here, in $TRL_PYTHON or /tmp/trl-venv (see docs/performance.md)")
            notes.append("TRL not found (here, $TRL_PYTHON, /tmp/trl-venv): ran ours only")
            trainers.remove("trl")
        else:
            pythons["trl"] = trl_python
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731

    workdir = args.workdir or Path(tempfile.mkdtemp(prefix="grpo-bench-"))
    workdir.mkdir(parents=True, exist_ok=True)
    try:
        path = model_path(args.model, workdir)
        spec = spec_of(preset, path, seed=args.seed, engine=args.engine, ours_overrides=args.ours_set,
                       **({} if args.packing is None else {"packing": args.packing == "true"}))
        plen = prompt_tokens(path, spec["task"])
        log(f"bench: model={args.model} ({path}) trainers={trainers} {preset} ours-set={args.ours_set}")
        import machine

        host = machine.describe()  # before the runs: the machine's roofs, and its load when the bench started
        log(f"machine: {machine.one_line(host)}")
        runs: dict[str, list[dict]] = {t: [] for t in trainers}
        for rep in range(preset["reps"]):
            for t in trainers:  # alternate A/B
                runs[t].append(launch(t, pythons[t], spec, workdir / f"{t}-{rep}", log, args.threads))
        summaries = {t: summarize(runs[t], spec, plen, preset["warmup"]) for t in trainers}
    finally:
        if args.workdir is None:
            shutil.rmtree(workdir, ignore_errors=True)

    import platform

    import torch
    import transformers

    versions = {"torch": torch.__version__, "transformers": transformers.__version__, "python": platform.python_version()}
    if "trl" in pythons:
        versions["trl"] = subprocess.run([pythons["trl"], "-c", "import trl; print(trl.__version__)"],
                                         capture_output=True, text=True, cwd=REPO).stdout.strip()
    ratios, spread = {}, {}
    if len(summaries) == 2:
        ours, trl = summaries["ours"], summaries["trl"]
        ratios = {key: ours[key] / trl[key] for _, key, _, _ in METRICS
                  if ours.get(key) is not None and trl.get(key)}
        spread = rep_ratios(runs, preset["warmup"])
    report = {
        "model": args.model,
        "config": {**{k: v for k, v in spec.items() if k != "model_path"}, "warmup": preset["warmup"], "reps": preset["reps"],
                   "threads": args.threads,
                   "completions_per_step": n, "mean_prompt_tokens": plen, "beta": 0.0,
                   "temperature": 1.0, "generation": args.engine},
        "machine": {**host, "cpus": os.cpu_count(), "loadavg_at_end": [round(x, 2) for x in os.getloadavg()],
                    "cuda": torch.cuda.is_available()},
        "versions": versions,
        "results": summaries,
        "ratios_ours_over_trl": ratios,
        "ratio_spread_over_reps": spread,
        "per_run": {t: [{"wall_s": r["wall_s"], "peak_rss_mib": r["peak_rss_mib"], "steps": r["steps"]} for r in runs[t]]
                    for t in trainers},
        "notes": notes + ["rollout tok/s: completion tokens / generation time (ours timing/rollout; TRL time in "
                          "_generate_single_turn); train tok/s: (prompt+completion) tokens / step time",
                          "peak RSS: each run's own VmHWM, read by the run's process at its end (not ru_maxrss, "
                          "which starts at this driver's high-water mark)"],
    }
    print(f"\nmodel={args.model} completions/step={n} (prompts {spec['prompts_per_step']} x G {spec['num_generations']}) "
          f"max_completion_length={spec['max_completion_length']} steps={spec['steps']} (first {preset['warmup']} dropped) "
          f"reps={preset['reps']} threads={args.threads or 'default'} {versions}"
          + (f" ours-set: {' '.join(args.ours_set)}" if args.ours_set else ""))
    print(f"machine: {machine.one_line(host)}; load at the end " + "/".join(f"{x:.1f}" for x in os.getloadavg()))
    print(table(summaries))
    for key, label in (("median_step_time_s", "step time"), ("peak_rss_mib", "peak RSS")):
        if key in spread:
            r = spread[key]
            print(f"{label} ours/TRL per alternating rep: {' '.join(f'{x:.2f}' for x in r['per_rep'])} "
                  f"(median {r['median']:.2f}, min {r['min']:.2f}, max {r['max']:.2f})")
    for note in notes:
        print("note:", note)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
