"""Helpers for tests: a small, fast training config and a way to run the CLI as a user would."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_script(name: str):
    """`scripts/NAME.py` imported as a module (the scripts are not a package), for tests of its functions;
    registered under NAME as an import would (user_functions.exec_registered), so its dataclasses work."""
    import importlib.util

    from grpo_trainer.user_functions import exec_registered

    return exec_registered(importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py"))


def small_run_overrides(output_dir: Path, steps: int = 2) -> list[str]:
    """A run of the embedded default shrunk to seconds: 4 prompts x 4 completions per step."""
    return [
        f"output_dir={output_dir}",
        f"train.max_steps={steps}",
        "train.prompts_per_step=4",
        "rollout.num_generations=4",
        "train.micro_batch_size=8",
        "train.warmup_steps=0",
        "train.learning_rate=1e-3",
        "rollout.max_completion_length=16",
        "logging.progress_bar=false",
        "checkpoint.resume=never",
    ]


def run_cli(args: list[str], timeout: float = 600, env: dict | None = None, launcher: list[str] | None = None):
    """Run `python -m grpo_trainer ARGS` (or under `launcher`) from the repo root; returns CompletedProcess.

    Without a launcher the command runs in a fresh process forked from a warm server that has already
    imported torch, transformers and the trainer (multiprocessing's forkserver): the same as a new
    `python -m grpo_trainer` process (its own memory, signals, exit status, stdout and stderr), without paying
    ~8 s of imports each time. Nothing has run in the server but imports, so no thread pool or random state
    is inherited (the golden-metrics test would see it).
    """
    full_env = {"PYTHONPATH": str(ROOT), "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    if launcher is None:
        return _run_forked(args, timeout, full_env)
    command = launcher + ["grpo_trainer", *args]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout, env={**os.environ, **full_env})


# Imported once by the fork server; what every trainer process imports anyway.
WARM_MODULES = ["grpo_trainer.cli", "grpo_trainer.trainer", "grpo_trainer.export", "transformers.models.llama.modeling_llama",
                "transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto", "accelerate", "peft"]
_forkserver = None


def _run_forked(args: list[str], timeout: float, env: dict) -> subprocess.CompletedProcess:
    return run_in_fork(_cli_main, (list(args),), timeout=timeout, env=env, label=["grpo_trainer", *args])


def run_in_fork(target, args: tuple = (), timeout: float = 600, env: dict | None = None,
                label: list[str] | None = None) -> subprocess.CompletedProcess:
    """`target(*args)` in a fresh process forked from the warm server (see run_cli), from the repo root, with
    `env` added to its environment; its stdout and stderr captured. The exit status is what target returns
    (None: 0), 1 with the traceback for an exception. `target` must be importable (a module-level function)."""
    import multiprocessing
    import tempfile

    global _forkserver
    if _forkserver is None:
        _forkserver = multiprocessing.get_context("forkserver")
        _forkserver.set_forkserver_preload(WARM_MODULES)
    label = label or [getattr(target, "__name__", "target")]
    with tempfile.TemporaryDirectory(prefix="grpo-fork-") as tmp:
        out, err = Path(tmp) / "stdout", Path(tmp) / "stderr"
        process = _forkserver.Process(target=_child, args=(target, tuple(args), dict(env or {}), str(out), str(err)))
        process.start()
        process.join(timeout)
        if process.is_alive():
            process.kill()
            process.join()
            raise subprocess.TimeoutExpired(label, timeout, err.read_text() if err.exists() else "")
        return subprocess.CompletedProcess(label, process.exitcode,
                                           out.read_text() if out.exists() else "", err.read_text() if err.exists() else "")


def _cli_main(args: list[str]) -> int:
    """The CLI's main, as `python -m grpo_trainer ARGS` would run it."""
    sys.argv = ["grpo_trainer", *args]
    try:
        from grpo_trainer.cli import main

        return main(args)
    except SystemExit as exc:  # argparse errors
        return exc.code if isinstance(exc.code, int) else 1


def cli_with_kernel_timings(args: list[str], timings: dict[str, float], cache_file: str, kill_after_save: int = 0) -> int:
    """The CLI's main on a machine whose decode-kernel timings are `timings` (alternative -> ms; each alternative
    still runs once, as a real timing does, so it consumes random numbers) and whose kernel cache is `cache_file`,
    with every decision worth measuring (even the tiny model's). `kill_after_save`: SIGKILL this process once the
    checkpoint of that step is published (a kill -9 at a known point)."""
    import signal

    from grpo_trainer import checkpoint
    from grpo_trainer.rollout import kernels

    def fake_timing(candidates, **_):
        for run in candidates.values():
            run()
        return {name: timings.get(name, 1.0) for name in candidates}

    kernels.MIN_WORK_BYTES = kernels.MIN_DRAW_ELEMENTS = 0
    kernels.time_alternatives = fake_timing
    table = kernels.KernelTable(Path(cache_file))
    kernels.default_table = lambda: table
    if kill_after_save:
        save = checkpoint.save_checkpoint

        def save_then_die(accelerator, output_dir, step, *rest, **kw):
            save(accelerator, output_dir, step, *rest, **kw)
            if step == kill_after_save:
                os.kill(os.getpid(), signal.SIGKILL)

        checkpoint.save_checkpoint = save_then_die
    return _cli_main(args)


def _child(target, args: tuple, env: dict, stdout_path: str, stderr_path: str) -> None:
    """In the forked process: `target(*args)` from the repo root, its output in the given files."""
    import traceback

    os.chdir(ROOT)
    os.environ.update(env)
    for fd, path in ((1, stdout_path), (2, stderr_path)):
        target_fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(target_fd, fd)  # subprocesses (reward workers, sandboxes) write here too
        os.close(target_fd)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    try:
        code = target(*args) or 0
    except BaseException:  # a bug: keep its traceback, as the interpreter would
        traceback.print_exc()
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def worst_difference(a: dict, b: dict) -> float:
    """The largest |a - b| over the tensors named in `b`, each relative to its scale max(1, max|b|)."""
    return max(float((a[n].double() - b[n].double()).abs().max()) / max(1.0, float(b[n].abs().max())) for n in b)


def assert_as_exact_as(got: dict, baseline: dict, exact: dict, what: str, factor: float = 2.0) -> None:
    """`got` (gradients of a rewritten computation, float32) is as close to `exact` (the same gradients from the
    float64 model) as `baseline` (the plain float32 computation) is, within `factor`.

    Why not `got` against `baseline` directly: two float32 computations that batch the same rows in different
    shapes round differently, by as much as each is off from the exact result, and how much that is depends
    on the CPU's BLAS kernels (MKL takes other paths on AMD than on Intel: a fixed tolerance that held on one
    failed on the other). A bug (a row seeing another's tokens, a wrong position) is off by orders of magnitude
    more than rounding, on every CPU.
    """
    ours, theirs = worst_difference(got, exact), worst_difference(baseline, exact)
    assert ours <= factor * theirs, f"{what}: {ours:.3g} from the float64 gradients, the float32 baseline {theirs:.3g}"


def assert_same_update(base: dict, a: dict, b: dict, rel: float = 3e-3) -> None:
    """Two runs from the same weights `base` took the same optimizer steps: per tensor, the difference of
    their final weights is within `rel` of the size of the update itself.

    Not elementwise: Adam divides each gradient by its own running scale, so where a gradient is ~0, float
    noise (which depends on how rows are grouped into micro-batches and ranks) becomes a visible step.
    Measured: at most 1.1e-3 of the update after 3 steps, DDP vs one process (an AMD EPYC host; below 1e-3 on
    the machine before it); a real error (a gradient scaled or a row lost) is of the order of the update.
    """
    for name in b:
        update = (b[name] - base[name]).norm()
        assert update > 0, f"{name} did not change"
        assert (a[name] - b[name]).norm() <= rel * update, f"{name}: {(a[name] - b[name]).norm()} vs update {update}"



class ThreadCollectives:
    """`distributed.Collectives` for ranks that are threads of one process: phases that combine ranks run
    for real, several ranks at once, without launching processes. Make one per rank with a shared `Exchange`."""

    def __init__(self, exchange: "Exchange", rank: int):
        self.exchange, self.rank, self.world = exchange, rank, exchange.world

    def gather(self, tensor):
        import torch

        return torch.cat(self.exchange.all(self.rank, tensor), 0)

    def gather_objects(self, items: list) -> list:
        return [item for part in self.exchange.all(self.rank, list(items)) for item in part]

    def sum(self, tensor):
        import torch

        return torch.stack(self.exchange.all(self.rank, tensor)).sum(0)

    def max(self, tensor):
        import torch

        return torch.stack(self.exchange.all(self.rank, tensor)).amax(0)


class Exchange:
    """Every rank puts its value in, all wait, every rank gets all values in rank order."""

    def __init__(self, world: int):
        import threading

        self.world = world
        self.barrier = threading.Barrier(world, timeout=30)
        self.slots: list = [None] * world

    def all(self, rank: int, value):
        self.slots[rank] = value
        self.barrier.wait()
        values = list(self.slots)
        self.barrier.wait()  # nobody overwrites a slot before everyone has read it
        return values


def run_ranks(world: int, fn) -> list:
    """fn(rank, ThreadCollectives) on `world` threads at once; their results in rank order (errors re-raised)."""
    from concurrent.futures import ThreadPoolExecutor

    exchange = Exchange(world)
    with ThreadPoolExecutor(world) as pool:
        futures = [pool.submit(fn, rank, ThreadCollectives(exchange, rank)) for rank in range(world)]
        return [f.result() for f in futures]


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cpu_launch_file(name: str, folder: Path, **changes) -> Path:
    """The shipped `configs/accelerate/NAME.yaml` as it runs on this CPU machine: only `num_processes` (2) and
    `use_cpu` (true) changed, plus `changes` where a test says so. Relative paths in it stay relative to ROOT,
    where the tests launch from."""
    import yaml

    config = yaml.safe_load((ROOT / "configs" / "accelerate" / f"{name}.yaml").read_text())
    config.update(num_processes=2, use_cpu=True, **changes)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"cpu_{name}.yaml"
    path.write_text(yaml.safe_dump(config, sort_keys=False))
    return path


# A native abort says so in lines like these, not in a traceback (a rank that dies of SIGABRT or SIGSEGV).
NATIVE_FAILURE = ("terminate called", "what():", "Fatal Python error", "Segmentation fault", "free(): ",
                  "corrupted", "Aborted", "core dumped")


def launch_failure(result: subprocess.CompletedProcess, tail: int = 3000) -> str:
    """What a failed multi-rank launch said, for an assertion message: its exit status, every rank's `error:` line,
    the lines in which a rank died natively (NATIVE_FAILURE) and the end of every traceback, each rank's apart (the
    ranks' stderr is interleaved, lines prefixed `[rankN]: ` under torch's launcher, so the tail alone shows only
    the rank that failed last, usually one that lost its peer), then the last `tail` characters."""
    import re

    prefix = re.compile(r"^(\[rank\d+\]:) ?")
    errors, native, tracebacks = [], [], []
    current: dict[str, list[str]] = {}  # each rank's traceback being read ("" without a prefix)
    for raw in result.stderr.splitlines():
        match = prefix.match(raw)
        rank, line = (match.group(1), raw[match.end():]) if match else ("", raw)
        if line.startswith("error: "):
            errors.append(raw)
        if any(marker in line for marker in NATIVE_FAILURE):
            native.append(raw)
        if line.startswith("Traceback"):
            current[rank] = [raw]
            tracebacks.append(current[rank])
        elif rank in current:
            current[rank].append(raw)
            if line and not line[0].isspace():  # the exception line ends the block
                del current[rank]
    parts = [f"exit status {result.returncode}", *errors, *native, *("\n".join(block[-12:]) for block in tracebacks),
             "--- end of stderr ---", result.stderr[-tail:]]
    return "\n".join(parts)


def accelerate_launch(config_file: Path, *flags: str) -> list[str]:
    """`accelerate launch --config_file FILE FLAGS... -m` (run_cli appends `grpo_trainer ARGS`)."""
    return [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file", str(config_file), *flags, "-m"]


def without_timing(record: dict) -> dict:
    """A metrics record without its wall-clock keys (`timing/*`, `step_time`, each reward's `seconds`,
    `host_memory/trim_seconds`)."""
    return {k: v for k, v in record.items()
            if not (k.startswith("timing/") or k == "step_time" or k.endswith(("/seconds", "_seconds")))}


def assert_same_run(a: Path, b: Path) -> None:
    """Two runs' final weights are bit-identical and their metrics.jsonl equal apart from timings."""
    import torch
    from safetensors.torch import load_file

    from grpo_trainer.metrics import read_metrics

    wa, wb = load_file(a / "model" / "model.safetensors"), load_file(b / "model" / "model.safetensors")
    assert wa.keys() == wb.keys()
    different = [k for k in wa if not torch.equal(wa[k], wb[k])]
    assert not different, f"weights differ: {different[:3]}"
    assert [without_timing(r) for r in read_metrics(a)] == [without_timing(r) for r in read_metrics(b)]


def decode_logits(model, prompts: list[list[int]], continuations: list[list[int]], pad_token_id: int,
                  in_place: bool, drop_row_after: int | None = None) -> list:
    """Logits [rows, V] at each step of feeding `continuations` (equal lengths) after left-padded `prompts`,
    through transformers' own decode (`in_place=False`: DynamicCache + its SDPA) or the hf engine's
    (reserved cache room + grouped-query attention). With `drop_row_after`, row 0 leaves the batch after
    that step, as a finished completion does in the engine's loop."""
    import torch

    from grpo_trainer.models import left_padded, positions
    from grpo_trainer.rollout.decode import decode_kernels, reserve_room

    ids, mask = left_padded(prompts, pad_token_id)
    steps = torch.tensor(continuations)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions(mask), use_cache=True, logits_to_keep=1)
    cache, rows, position = out.past_key_values, torch.arange(len(prompts)), mask.sum(-1)
    if in_place:
        assert reserve_room(cache, steps.shape[1])
    seen = []
    with decode_kernels(model) if in_place else contextlib.nullcontext():
        for step in range(steps.shape[1]):
            if drop_row_after is not None and step == drop_row_after + 1:
                keep = torch.arange(1, len(rows))
                cache.reorder_cache(keep)
                rows, mask, position = rows[keep], mask[keep], position[keep]
            mask = torch.cat([mask, mask.new_ones(len(rows), 1)], 1)
            logits = model(input_ids=steps[rows, step][:, None], attention_mask=mask, position_ids=position[:, None],
                           past_key_values=cache, use_cache=True).logits[:, -1]
            seen.append(logits)
            position = position + 1
    return seen


def assert_stopped_where_vllm_stops(decode, completion: list[int], truncated: bool, stop: list[str], eos: int,
                                    max_length: int) -> bool:
    """Check one completion against the stop-string rule by brute force (whole prefixes decoded, no window):
    it ends on the first token whose prefix text holds a stop string, else on EOS or at `max_length`.
    Returns whether it stopped on a stop string."""
    for length in range(1, len(completion) + 1):
        if completion[length - 1] == eos:
            break
        if any(s in decode(completion[:length]) for s in stop):
            assert length == len(completion), f"ran past the stop string: {decode(completion)!r}"
            assert not truncated, "a completion that stopped on a stop string is not truncated"
            return True
    assert (completion[-1] == eos) != truncated and (truncated == (len(completion) == max_length) or not truncated)
    return False


def rollout_queue(run):
    """A stand-in run's rollout queue, built as run.build_run builds the real one, from the run's parts (`cfg`,
    `engine`, `geometry`, `comm`, `task`, `sampler`; `bare_lm` and `accelerator` where it pushes weights). The push
    reads `run.bare_lm` when it pushes, so a test may set it afterwards."""
    from types import SimpleNamespace

    from grpo_trainer.rollout_queue import QueueSettings, RolloutQueue, weight_pusher

    settings = QueueSettings.of(run.cfg)
    accelerator = getattr(run, "accelerator", None) or SimpleNamespace(state=SimpleNamespace())
    push = weight_pusher(run.engine, run.comm, lambda: run.bare_lm(), accelerator, settings.checkpoints)
    return RolloutQueue(run.engine, settings, geometry=run.geometry, comm=run.comm, task=run.task, sampler=run.sampler,
                        push=push)



def training_samples(prompt_ids: list[list[int]], completion_ids: list[list[int]], truncated=None, loss_mask=None,
                     sampler_logprobs=None):
    """A step's `TrainingSamples` for the training phases (batches, the passes) from per-completion lists, as collect
    builds them: the loss over every token unless `loss_mask` says otherwise; no rewards (the phases read the
    advantages)."""
    import torch

    from grpo_trainer.samples import TrainingSamples

    n = len(completion_ids)
    return TrainingSamples(
        prompt_indices=list(range(n)), prompt_ids=prompt_ids, completion_ids=completion_ids,
        loss_mask=loss_mask or [[1] * len(c) for c in completion_ids], truncated=truncated or [False] * n,
        sampler_logprobs=sampler_logprobs, weight_versions=None, rewards=torch.zeros(n),
        per_function=torch.zeros(n, 0),
    )


def samples_share(samples, rows: list[int]):
    """Completions `rows` of `samples` (a rank's share of the batch), every per-completion field alike."""
    from dataclasses import replace

    def pick(values):
        return None if values is None else [values[j] for j in rows]

    return replace(samples, prompt_indices=list(range(len(rows))), prompt_ids=pick(samples.prompt_ids),
                   completion_ids=pick(samples.completion_ids), loss_mask=pick(samples.loss_mask),
                   truncated=pick(samples.truncated), sampler_logprobs=pick(samples.sampler_logprobs),
                   rewards=samples.rewards[rows], per_function=samples.per_function[rows])
