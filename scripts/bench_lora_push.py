"""LoRA pushes into the colocated vLLM engine: the adapter alone (`rollout.lora_sync: adapter`) against the merged
weights (`merged`), bytes and seconds per push, and generation time per step.

    python scripts/bench_lora_push.py                            # SmolLM2-135M-Instruct, rank 16, all linear layers
    python scripts/bench_lora_push.py --model PATH --rank 8 --reps 3 --json lora_push.json
    python scripts/bench_lora_push.py --model random-qwen2.5-0.5b --dtype bfloat16   # GPU (scripts/gpu_check.sh)
    python scripts/bench_lora_push.py --server                   # one server (`serve`), both kinds of push

Two engines, one after the other (vLLM in this process, as `vllm_colocate` runs it): one started with LoRA,
pushed the adapter (written as a new version folder, `add_lora` under a new name, the previous removed), one
without, pushed the merged weights (base + delta, in place). The adapter is random (`init_lora_weights=False`)
and changed between reps, so every push changes what vLLM samples from; the first push of each kind is left
out of the medians. Generation: 4 prompts x 8 completions of up to 32 tokens, the same seeds for both, after
each push. `--server`: one server started by `python -m grpo_trainer serve` with LoRA on (it takes full reloads
too), two server engines taking turns on it: adapter pushes (`/v1/load_lora_adapter`, requests for the
adapter) and merged pushes over gloo (requests for the base model); both kinds under the same load. Prints a table, one RESULT line, and (with --json) writes the numbers with the CPU model and the load
average. `random-qwen2.5-0.5b` is Qwen2.5-0.5B's shape with random weights (gpu_check.py's, for machines that
download nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
RANDOM = "random-qwen2.5-0.5b"


def folder_bytes(path: Path) -> int:
    return sum(f.stat().st_size for f in path.iterdir() if f.is_file())


def trainer_side(model_path: str, rank: int, dtype: str):
    """The trainer's model (a random adapter on every linear layer), the prompts and the sampling settings."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_trainer.rollout import SamplingSettings

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2+3?", "Name a colour.", "Count to five:", "Hello")]
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    if torch.cuda.is_available():
        lm = lm.cuda()
    model = get_peft_model(lm, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False))
    return model, prompts, SamplingSettings(eos_token_ids=[tokenizer.eos_token_id], max_completion_length=32)


def run(model_path: str, rank: int, reps: int, adapter: bool, dtype: str) -> dict:
    """The colocated engine, with LoRA (adapter pushes) or without (merged pushes)."""
    from grpo_trainer.config import VLLMConfig
    from grpo_trainer.rollout.vllm_colocate import VLLMColocateEngine

    model, prompts, sampling = trainer_side(model_path, rank, dtype)
    started = time.perf_counter()
    engine = VLLMColocateEngine(sampling,
                                VLLMConfig(dtype=dtype, max_model_len=256, kv_cache_memory_bytes=1 << 29),
                                model_path=model_path, seed=0, lora_rank=rank if adapter else None)
    start_s = time.perf_counter() - started
    try:
        timed = [push_and_sample(engine, model, prompts, rep) for rep in range(reps + 1)]
        pushed = folder_bytes(engine.adapters.current.path) if adapter else merged_bytes(model)
    finally:
        engine.close()
    return {"start_s": start_s, "bytes_per_push": pushed, **medians(timed)}


def merged_bytes(model) -> int:
    import torch

    from grpo_trainer.rollout.weight_sync import MergedWeights

    return sum(m.dtype.itemsize * torch.Size(m.shape).numel() for m in MergedWeights(model).metadata())


def run_server(model_path: str, rank: int, reps: int, dtype: str) -> dict[str, dict]:
    import subprocess
    import tempfile

    from bench_push import wait_healthy

    from grpo_trainer.config import VLLMServerConfig
    from grpo_trainer.rollout.vllm_server import VLLMServerEngine, _free_port

    model, prompts, sampling = trainer_side(model_path, rank, dtype)
    port = _free_port()
    url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory(prefix="bench-lora-push-") as tmp:
        weights = str(Path(tmp) / "weights")
        command = [sys.executable, "-m", "grpo_trainer", "serve", "configs/demo_cpu.yaml", f"model.name_or_path={model_path}",
                   "rollout.engine=vllm_server", f"model.lora.r={rank}", "rollout.lora_sync=adapter",
                   f"rollout.vllm_server.weights_dir={weights}", f"rollout.vllm.dtype={dtype}",
                   "rollout.vllm.max_model_len=256", "--port", str(port)]
        log = Path(tmp) / "server.log"
        server = subprocess.Popen(command, cwd=REPO, stdout=open(log, "w"), stderr=subprocess.STDOUT, start_new_session=True)
        try:
            started = time.perf_counter()
            wait_healthy(url, server, log, 1800)
            start_s = time.perf_counter() - started
            # The pushes alone: the probe after each (docs/vllm.md, 'Push deadlines') is measured on its own.
            settings = VLLMServerConfig(base_url=url, weights_dir=weights, startup_timeout=1800, push_probe=False)
            # Merged first in each round: it finds the version it pushed last round (the adapter's push of that round
            # set the same), so it keeps its transfer group (a changed version means a restarted server to it).
            engines = {"merged": VLLMServerEngine(sampling, settings, seed=0),
                       "adapter": VLLMServerEngine(sampling, settings, seed=0, lora_sync="adapter")}
            timed = {kind: [] for kind in engines}
            for rep in range(reps + 1):  # taking turns, push by push; the server's weight version is the round's
                for kind, engine in engines.items():
                    timed[kind].append(push_and_sample(engine, model, prompts, rep))
            pushed = {"adapter": folder_bytes(engines["adapter"].adapters.current.path), "merged": merged_bytes(model)}
            results = {kind: {"start_s": start_s, "bytes_per_push": pushed[kind], **medians(t)} for kind, t in timed.items()}
            for engine in engines.values():
                engine.close()
        finally:
            os.killpg(server.pid, 15)
            server.wait(60)
    return results


def push_and_sample(engine, model, prompts, rep: int) -> tuple[float, float]:
    """Change the adapter, push it (as version `rep`), sample: (push seconds, generation seconds)."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_" in name:
                p.mul_(1.0 + 0.01 * (rep + 1))
    t = time.perf_counter()
    engine.sync_weights(model, version=rep)
    push_s = time.perf_counter() - t
    t = time.perf_counter()
    engine.generate(prompts, 8, seeds=[1, 2, 3, 4])
    return push_s, time.perf_counter() - t


def medians(timed: list[tuple[float, float]]) -> dict:
    """The first push apart (first calls, set-up), medians of the others."""
    return {"first_push_s": timed[0][0], "push_s_median": statistics.median(t[0] for t in timed[1:]),
            "generate_s_median": statistics.median(t[1] for t in timed[1:])}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct", help=f"a folder, a builtin: name or {RANDOM}")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--server", action="store_true", help="one vLLM server, both kinds of push (else colocated)")
    parser.add_argument("--json")
    return parser


def main() -> None:
    args = build_parser().parse_args()
    from bench_push import cpu_model  # scripts/ is this script's folder, first on sys.path

    from grpo_trainer.builtin import resolve_model_path

    if args.model == RANDOM:
        import tempfile

        import torch
        from gpu_check import QWEN25_05B, build_model

        model_path = tempfile.mkdtemp(prefix="bench_lora_model_")
        build_model(Path(model_path), QWEN25_05B, getattr(torch, args.dtype))
    else:
        model_path = resolve_model_path(args.model)
    load = os.getloadavg()[0]
    if args.server:
        results = run_server(model_path, args.rank, args.reps, args.dtype)
    else:
        results = {kind: run(model_path, args.rank, args.reps, kind == "adapter", args.dtype) for kind in ("adapter", "merged")}
    print(f"{'push':8} {'MiB/push':>10} {'s/push':>8} {'first s':>8} {'gen s/step':>10} {'start s':>8}")
    for kind, r in results.items():
        print(f"{kind:8} {r['bytes_per_push'] / 2**20:10.2f} {r['push_s_median']:8.3f} {r['first_push_s']:8.3f} "
              f"{r['generate_s_median']:10.2f} {r['start_s']:8.1f}")
    a, m = results["adapter"], results["merged"]
    print(f"RESULT push {m['push_s_median'] / a['push_s_median']:.1f}x faster, {m['bytes_per_push'] / a['bytes_per_push']:.0f}x "
          f"fewer bytes; generation {a['generate_s_median'] / m['generate_s_median']:.2f}x the merged model's time")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "rank": args.rank, "reps": args.reps, "server": args.server,
                                               "cpu": cpu_model(),
                                               "load_before": load, "load_after": os.getloadavg()[0], **results}, indent=1))


if __name__ == "__main__":
    main()
