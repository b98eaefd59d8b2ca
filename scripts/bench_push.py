"""Weight-push time into vLLM: a server over gloo, a server through files (disk), and the colocated engine.

    python scripts/bench_push.py                       # SmolLM2-135M-Instruct (513 MiB float32), 5 reps each
    python scripts/bench_push.py --model PATH --reps 3 --json push.json
    python scripts/bench_push.py --pin                 # server on core 1, trainer on core 0 (taskset)

One server is started with `python -m grpo_trainer serve` taking both the gloo backend and the worker
extension, so the two server pushes run against the same server and alternate (gloo, disk, gloo, ...):
load drifts hit both alike. The colocated engine (vLLM in this process, an in-memory copy) is timed
after the server is stopped. Every push is the whole model, perturbed between reps so each push really
changes the weights; the first push of each kind (group set-up, first-call costs) is reported apart
and left out of the medians. After the last push of each kind, the engine's sampling log-probs are
compared with the trainer's (a push that did not land would show).

Prints a table and (with --json) writes the numbers, with the CPU model and the load average before and
after. Where several people share a machine, serialise measurements with a lock of your own (e.g.
`flock /tmp/measure.lock python scripts/bench_push.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def cpu_model() -> str:
    try:
        for line in subprocess.run(["lscpu"], capture_output=True, text=True).stdout.splitlines():
            if line.startswith("Model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def wait_healthy(url: str, proc: subprocess.Popen | None, log: Path, limit: float) -> None:
    """Poll the server's health check; stop at once, with its log's end, if its process exited."""
    deadline = time.monotonic() + limit
    while True:
        try:
            with urllib.request.urlopen(url + "/health", timeout=5):
                return
        except OSError:
            pass
        if proc is not None and proc.poll() is not None:
            raise SystemExit(f"the vLLM server exited:\n{log.read_text()[-3000:]}")
        if time.monotonic() > deadline:
            raise SystemExit(f"no healthy vLLM server at {url} after {limit:g}s")
        time.sleep(1)


def model_size_mib(lm) -> float:
    from grpo_trainer.rollout.weight_sync import MergedWeights

    return sum(m.dtype.itemsize * _numel(m.shape) for m in MergedWeights(lm).metadata()) / 2**20


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


def nudge(lm, rep: int) -> None:
    """A small change to every weight, so that each push carries new values."""
    import torch

    with torch.no_grad():
        for p in lm.parameters():
            p.add_(1e-4 * (rep + 1))


def chat_prompts(tokenizer, questions=("What is 12+7?", "Say hello.")) -> list[list[int]]:
    return [tokenizer.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True, tokenize=True,
                                          return_dict=True)["input_ids"] for q in questions]


def sampler_gap(rollout, prompts: list[list[int]], lm, pad_id: int, temperature: float = 1.0) -> tuple[float, float]:
    """(max, mean) |the engine's sampling log-prob - `lm`'s| over every sampled token of `rollout` (G per
    prompt): ~1e-4 in float32 when the engine holds `lm`'s weights, far more when it does not."""
    import torch

    from grpo_trainer.models import TokenLogprobs, make_sequence_batch

    g = len(rollout.completion_ids) // len(prompts)
    grouped = [p for p in prompts for _ in range(g)]
    batch = make_sequence_batch(grouped, rollout.completion_ids, pad_id=pad_id)
    device = next(lm.parameters()).device
    with torch.no_grad():
        lp, _ = TokenLogprobs(lm, temperature=temperature)(**batch.tensors(device))
    gaps = [abs(a - b) for i, c in enumerate(rollout.completion_ids)
            for a, b in zip(rollout.sampling_logprobs[i], lp[i, : len(c)].float().tolist())]
    return max(gaps), sum(gaps) / len(gaps)


def logprob_gap(engine, lm, tokenizer) -> float:
    prompts = chat_prompts(tokenizer)
    return sampler_gap(engine.generate(prompts, 2), prompts, lm, tokenizer.pad_token_id or 0)[0]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--bucket-mb", type=float, default=256)
    parser.add_argument("--max-model-len", type=int, default=512)
    parser.add_argument("--pin", action="store_true", help="taskset: server on core 1, this process on core 0")
    parser.add_argument("--skip-colocate", action="store_true")
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_trainer.config import VLLMConfig, VLLMServerConfig
    from grpo_trainer.rollout import SamplingSettings
    from grpo_trainer.rollout.vllm_server import VLLMServerEngine
    from grpo_trainer.builtin import resolve_model_path

    if args.pin:
        os.sched_setaffinity(0, {0})
    loadavg_before = os.getloadavg()
    path = resolve_model_path(args.model)
    tokenizer = AutoTokenizer.from_pretrained(path)
    lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    sampling = SamplingSettings(eos_token_ids=[tokenizer.eos_token_id], max_completion_length=16)
    size = model_size_mib(lm)
    print(f"model {args.model}: {size:.0f} MiB pushed per push (float32, tied weights once)", flush=True)

    port = 8000 + os.getpid() % 1000
    with tempfile.TemporaryDirectory(prefix="bench-push-") as tmp:
        command = [sys.executable, "-m", "grpo_trainer", "serve", "configs/demo_cpu.yaml", f"model.name_or_path={path}",
                   "rollout.engine=vllm_server", "rollout.vllm_server.weight_sync=gloo", f"rollout.vllm.max_model_len={args.max_model_len}",
                   "--port", str(port), "--", "--worker-extension-cls", "grpo_trainer.rollout.weight_sync.WorkerWeightSync"]
        if args.pin:
            command = ["taskset", "-c", "1", *command]
        server = subprocess.Popen(command, cwd=REPO, stdout=open(Path(tmp) / "server.log", "w"), stderr=subprocess.STDOUT,
                                  start_new_session=True)
        times: dict[str, list[float]] = {"gloo": [], "disk": []}
        first: dict[str, float] = {}
        gaps: dict[str, float] = {}
        try:
            url = f"http://127.0.0.1:{port}"
            wait_healthy(url, server, Path(tmp) / "server.log", 1800)
            engines = {
                kind: VLLMServerEngine(sampling, VLLMServerConfig(base_url=url, weight_sync=kind, startup_timeout=1800,
                                                                  transfer_bucket_mb=args.bucket_mb,
                                                                  weights_dir=str(Path(tmp) / "weights"),
                                                                  push_probe=False), seed=0)  # the push alone
                for kind in ("gloo", "disk")
            }
            for rep in range(args.reps + 1):
                for kind, engine in engines.items():
                    nudge(lm, rep)
                    t0 = time.perf_counter()
                    engine.sync_weights(lm)
                    took = time.perf_counter() - t0
                    (times[kind].append(took) if rep else first.__setitem__(kind, took))
                    print(f"  {kind} push {rep}: {took:.2f}s", flush=True)
                    if rep == args.reps:
                        gaps[kind] = logprob_gap(engine, lm, tokenizer)
            for engine in engines.values():
                engine.close()
        finally:
            os.killpg(server.pid, 15)
            server.wait(60)

    if not args.skip_colocate:
        from grpo_trainer.rollout.vllm_colocate import VLLMColocateEngine

        engine = VLLMColocateEngine(sampling, VLLMConfig(dtype="float32", max_model_len=args.max_model_len), model_path=path,
                                    seed=0)
        times["colocate"] = []
        for rep in range(args.reps + 1):
            nudge(lm, rep)
            t0 = time.perf_counter()
            engine.sync_weights(lm)
            took = time.perf_counter() - t0
            (times["colocate"].append(took) if rep else first.__setitem__("colocate", took))
            print(f"  colocate push {rep}: {took:.2f}s", flush=True)
        gaps["colocate"] = logprob_gap(engine, lm, tokenizer)
        engine.close()

    loadavg_after = os.getloadavg()
    rows = {kind: {"median_s": statistics.median(t), "min_s": min(t), "max_s": max(t), "first_s": first[kind],
                   "mib_per_s": size / statistics.median(t), "reps": t, "logprob_gap_after": gaps[kind]}
            for kind, t in times.items()}
    print(f"\n{'push':10} {'median s':>9} {'min s':>7} {'max s':>7} {'MiB/s':>7} {'first s':>8} {'gap after':>10}")
    for kind, r in rows.items():
        print(f"{kind:10} {r['median_s']:9.2f} {r['min_s']:7.2f} {r['max_s']:7.2f} {r['mib_per_s']:7.0f} "
              f"{r['first_s']:8.2f} {r['logprob_gap_after']:10.1e}")
    if "gloo" in rows and "disk" in rows:
        print(f"gloo / disk median time: {rows['gloo']['median_s'] / rows['disk']['median_s']:.2f}")
    print(f"cpu: {cpu_model()}, {os.cpu_count()} cores; load average before {loadavg_before}, after {loadavg_after}")
    if args.json:
        Path(args.json).write_text(json.dumps({
            "model": args.model, "mib": size, "reps": args.reps, "bucket_mb": args.bucket_mb, "pinned": args.pin,
            "results": rows, "machine": {"cpu": cpu_model(), "cores": os.cpu_count(), "loadavg_before": loadavg_before,
                                         "loadavg_after": loadavg_after},
        }, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
