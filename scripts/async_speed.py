"""Step time with asynchronous rollouts (rollout.max_staleness 1) against the synchronous loop (0), and where it goes.

    .venv/bin/python scripts/async_speed.py            # SmolLM2 recipe, ~15 min on 2 cores
    .venv/bin/python scripts/async_speed.py --steps 5 --warmup 1 --reps 1 --json async_speed.json

One vLLM server for the model (`python -m grpo_trainer serve`), pinned to one core (`taskset -c 1`, vLLM's OpenMP
threads bound there), and trainer runs pinned to the other (`taskset -c 0`, one torch thread), alternating K = 0
and K = 1 (K0, K1, K0, K1, ...: both see the same machine load). Everything else is configs/smollm2_async_cpu.yaml
(SmolLM2-135M-Instruct, float32, word problems, 4 prompts x 8 completions, up to 64 new tokens, Dr. GRPO): the
server engine in both, weights pushed over gloo (`--weight-sync disk`: through /dev/shm). The first --warmup steps
of each run are dropped. Prints the median step time of each K, the ratio K1/K0, and the median of each `timing/*`
phase:

    rollout       main thread in the rollout phase (K0: sampling; K1: waiting for the queued batch)
    rollout_wait  main thread blocked on sampling in the whole step (K1: also before the push)
    server_idle   the sampler not sampling for this trainer during the step
    reward, logprobs, update, weight_sync (K1: includes the wait for the generation in flight)
    cpu_trainer_per_step_s, cpu_server_per_step_s: CPU seconds each process used per step (start-up included). On a
    busy machine wall time also measures the other processes; CPU time does not, and bounds what overlap can give:
    about max(trainer, server) a step with K = 1 against their sum with K = 0.

`--model PATH --server-url URL` measure another model against a server already running (the tests do, tiny).
`--gpu` (scripts/gpu_check.sh): no pinning; the server takes 30% of the GPU; the model is gpu_check.py's random-init
Qwen2.5-0.5B shape with the embedded character tokenizer (nothing is downloaded on the GPU machines), on the bundled
arithmetic task, 16 prompts x 8 completions of up to 256 tokens.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CONFIG = ROOT / "configs" / "smollm2_async_cpu.yaml"
PHASES = ("rollout", "rollout_wait", "server_idle", "reward", "logprobs", "update", "weight_sync")


GPU_OVERRIDES = ["data.source=builtin:arithmetic", "data.system_prompt=null", "train.prompts_per_step=16",
                 "train.micro_batch_size=32", "rollout.max_completion_length=256", "train.learning_rate=1e-6"]


def start_server(model: str, port: int, log: Path, args) -> subprocess.Popen:
    """`python -m grpo_trainer serve` for the recipe with the trainers' overrides (exactly the flags their engine
    needs, the weight push of --weight-sync), pinned to --server-core on a CPU; on a GPU it takes 30% of the GPU."""
    cmd = [sys.executable, "-m", "grpo_trainer", "serve", str(CONFIG), f"model.name_or_path={model}",
           f"rollout.vllm_server.weight_sync={args.weight_sync}", *(GPU_OVERRIDES if args.gpu else []), *args.overrides,
           "--port", str(port)]
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    if args.gpu:
        cmd += ["--", "--gpu-memory-utilization", "0.3"]
    else:
        env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_CPU_OMP_THREADS_BIND=args.server_core)
        cmd = ["taskset", "-c", args.server_core, *cmd]
    with open(log, "w") as fh:
        return subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, env=env, start_new_session=True)


def wait_healthy(url: str, proc: subprocess.Popen | None, log: Path | None, timeout: float = 900) -> None:
    deadline = time.monotonic() + timeout
    while True:
        if proc is not None and proc.poll() is not None:
            sys.exit(f"the vLLM server exited:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(url + "/health", timeout=2):
                return
        except OSError:
            if time.monotonic() > deadline:
                sys.exit(f"no healthy vLLM server at {url} after {timeout:.0f}s")
            time.sleep(1)


def group_cpu_seconds(pgid: int | None) -> float:
    """CPU seconds (user + system) used so far by the processes of a process group (the server and its engine)."""
    if pgid is None:
        return float("nan")
    total = 0
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[2]) == pgid:  # after the command name: state, ppid, pgrp, ..., utime (12), stime (13)
            total += int(fields[11]) + int(fields[12])
    return total / os.sysconf("SC_CLK_TCK")


def train(k: int, args, url: str, out: Path) -> list[dict]:
    overrides = [f"output_dir={out}", f"train.max_steps={args.steps}", f"rollout.max_staleness={k}",
                 f"rollout.vllm_server.base_url={url}", f"rollout.vllm_server.weight_sync={args.weight_sync}",
                 f"rollout.vllm_server.weights_dir={args.weights_dir}",
                 "checkpoint.resume=never", "checkpoint.save_every=0", "checkpoint.save_final_model=false",
                 "logging.progress_bar=false", "logging.completions_every=0", "train.warmup_steps=0"]
    if args.model:
        overrides.append(f"model.name_or_path={args.model}")
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONPATH=str(ROOT))
    cmd = [sys.executable, "-m", "grpo_trainer", "train", str(CONFIG), *overrides,
           *(GPU_OVERRIDES if args.gpu else []), *args.overrides]
    if not args.gpu:
        env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1")
        cmd = ["taskset", "-c", args.trainer_core, *cmd]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    server_before = group_cpu_seconds(args.server_pgid)
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    if proc.returncode != 0:
        sys.exit(f"the trainer (K={k}) failed:\n{proc.stderr[-4000:]}")
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    trainer_cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    for row in rows:  # the run's CPU seconds, spread evenly over its steps (start-up included)
        row["cpu/trainer_per_step"] = trainer_cpu / len(rows)
        row["cpu/server_per_step"] = (group_cpu_seconds(args.server_pgid) - server_before) / len(rows)
    return rows


def summarize(runs: list[list[dict]], warmup: int) -> dict:
    rows = [r for run in runs for r in run[warmup:]]
    out = {"steps_measured": len(rows), "median_step_time_s": statistics.median(r["step_time"] for r in rows)}
    for phase in PHASES:
        values = [r[f"timing/{phase}"] for r in rows if f"timing/{phase}" in r]
        if values:
            out[phase] = statistics.median(values)
    out["mean_completion_length"] = statistics.mean(r["completions/mean_length"] for r in rows)
    for key in ("trainer", "server"):  # per run, not per step: the mean of the runs' averages
        out[f"cpu_{key}_per_step_s"] = statistics.mean(run[0][f"cpu/{key}_per_step"] for run in runs)
    if any("rollout/staleness_mean" in r for r in rows):
        out["staleness_mean"] = statistics.mean(r.get("rollout/staleness_mean", 0.0) for r in rows)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8, help="steps per trainer run")
    p.add_argument("--warmup", type=int, default=2, help="first steps of each run left out")
    p.add_argument("--reps", type=int, default=2, help="trainer runs per K, alternating")
    p.add_argument("--model", help="model folder (default: the config's, SmolLM2)")
    p.add_argument("--server-url", help="use this running server instead of starting one")
    p.add_argument("--server-core", default="1")
    p.add_argument("--trainer-core", default="0")
    p.add_argument("--port", type=int, default=8017)
    p.add_argument("--weight-sync", default="gloo", choices=["gloo", "disk"],
                   help="how weights reach the server (rollout.vllm_server.weight_sync; gloo: vLLM's weight-transfer API)")
    p.add_argument("--weights-dir", default="/dev/shm/grpo_async_speed_weights",
                   help="where pushed weights go with --weight-sync disk (RAM on Linux)")
    p.add_argument("--gpu", action="store_true", help="on a GPU machine (scripts/gpu_check.sh): see above")
    p.add_argument("--json", help="also write the results here")
    p.add_argument("overrides", nargs="*", help="more config overrides for both Ks")
    args = p.parse_args()

    from grpo_trainer.builtin import resolve_model_path

    load_before = Path("/proc/loadavg").read_text().strip()
    with tempfile.TemporaryDirectory(prefix="async-speed-") as tmp:
        tmp = Path(tmp)
        if args.gpu and not args.model:
            import torch

            sys.path.insert(0, str(ROOT / "scripts"))
            from gpu_check import QWEN25_05B, build_model

            args.model = str(tmp / "model")
            build_model(tmp / "model", QWEN25_05B, torch.float32)
        model = args.model or resolve_model_path("builtin:smollm2-135m-instruct")
        server, log, url, args.server_pgid = None, tmp / "server.log", args.server_url, None
        if url is None:
            url = f"http://127.0.0.1:{args.port}"
            server = start_server(str(model), args.port, log, args)
            args.server_pgid = server.pid  # started in its own session: the group holds the server and its engine
        try:
            wait_healthy(url, server, log)
            runs: dict[int, list[list[dict]]] = {0: [], 1: []}
            for rep in range(args.reps):
                for k in (0, 1):
                    tick = time.perf_counter()
                    runs[k].append(train(k, args, url, tmp / f"k{k}-{rep}"))
                    print(f"rep {rep + 1}/{args.reps} K={k}: {time.perf_counter() - tick:.0f}s", file=sys.stderr)
        finally:
            if server is not None:
                server.terminate()
                try:
                    server.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    server.kill()
    results = {k: summarize(v, args.warmup) for k, v in runs.items()}
    ratio = results[1]["median_step_time_s"] / results[0]["median_step_time_s"]
    report = {"ratio_k1_over_k0": ratio, "results": results, "loadavg_before": load_before,
              "loadavg_after": Path("/proc/loadavg").read_text().strip(),
              "config": {"model": str(model), "steps": args.steps, "warmup": args.warmup, "reps": args.reps,
                         "server_core": args.server_core, "trainer_core": args.trainer_core, "overrides": args.overrides}}
    keys = ["median_step_time_s", *PHASES, "cpu_trainer_per_step_s", "cpu_server_per_step_s", "mean_completion_length",
            "staleness_mean"]
    print(f"{'metric':<24} {'K=0':>9} {'K=1':>9}")
    for key in keys:
        a, b = results[0].get(key), results[1].get(key)
        fmt = lambda v: f"{v:9.3f}" if isinstance(v, (int, float)) else f"{'-':>9}"  # noqa: E731
        print(f"{key:<24} {fmt(a)} {fmt(b)}")
    print(f"step time K=1 / K=0: {ratio:.2f}  (load average before: {load_before}; after: {report['loadavg_after']})")
    print(f"RESULT ratio_k1_over_k0={ratio:.3g}, step_k0_s={results[0]['median_step_time_s']:.3g}, "
          f"step_k1_s={results[1]['median_step_time_s']:.3g}, staleness_k1={results[1].get('staleness_mean', 0):.3g}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
