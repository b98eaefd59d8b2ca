"""LoRA pushes into the colocated vLLM engine: the adapter alone (`rollout.lora_sync: adapter`) against the merged
weights (`merged`), bytes and seconds per push, and generation time per step.

    python scripts/bench_lora_push.py                            # SmolLM2-135M-Instruct, rank 16, all linear layers
    python scripts/bench_lora_push.py --model PATH --rank 8 --reps 3 --json lora_push.json
    python scripts/bench_lora_push.py --model random-qwen2.5-0.5b --dtype bfloat16   # GPU (scripts/gpu_check.sh)

Two engines, one after the other (vLLM in this process, as `vllm_colocate` runs it): one started with LoRA,
pushed the adapter (written as a new version folder, `add_lora` under a new name, the previous removed), one
without, pushed the merged weights (base + delta, in place). The adapter is random (`init_lora_weights=False`)
and changed between reps, so every push changes what vLLM samples from; the first push of each kind is left
out of the medians. Generation: 4 prompts x 8 completions of up to 32 tokens, the same seeds for both, after
each push. Prints a table, one RESULT line, and (with --json) writes the numbers with the CPU model and the load
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


def run(model_path: str, rank: int, reps: int, adapter: bool, dtype: str) -> dict:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from grpo_trainer.config import VLLMConfig
    from grpo_trainer.rollout import SamplingSettings
    from grpo_trainer.rollout.vllm_colocate import VLLMColocateEngine
    from grpo_trainer.rollout.weight_sync import MergedWeights

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    eos = [tokenizer.eos_token_id]
    prompts = [tokenizer(text)["input_ids"] for text in ("What is 2+3?", "Name a colour.", "Count to five:", "Hello")]
    torch.manual_seed(0)
    lm = AutoModelForCausalLM.from_pretrained(model_path, dtype=getattr(torch, dtype))
    if torch.cuda.is_available():
        lm = lm.cuda()
    model = get_peft_model(lm, LoraConfig(r=rank, lora_alpha=2 * rank, target_modules="all-linear", init_lora_weights=False))
    started = time.perf_counter()
    engine = VLLMColocateEngine(SamplingSettings(eos_token_ids=eos, max_completion_length=32),
                                VLLMConfig(dtype=dtype, max_model_len=256, kv_cache_memory_bytes=1 << 29),
                                model_path=model_path, seed=0, lora_rank=rank if adapter else None)
    start_s = time.perf_counter() - started
    push_s, generate_s, pushed = [], [], 0
    try:
        for rep in range(reps + 1):
            with torch.no_grad():
                for name, p in model.named_parameters():
                    if ".lora_" in name:
                        p.mul_(1.0 + 0.01 * (rep + 1))
            t = time.perf_counter()
            engine.sync_weights(model)
            push_s.append(time.perf_counter() - t)
            if adapter:
                pushed = folder_bytes(engine.adapters.current.path)
            else:
                pushed = sum(m.dtype.itemsize * torch.Size(m.shape).numel() for m in MergedWeights(model).metadata())
            t = time.perf_counter()
            engine.generate(prompts, 8, seeds=[1, 2, 3, 4])
            generate_s.append(time.perf_counter() - t)
    finally:
        engine.close()
    return {"start_s": start_s, "bytes_per_push": pushed, "first_push_s": push_s[0],
            "push_s_median": statistics.median(push_s[1:]), "generate_s_median": statistics.median(generate_s[1:])}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="builtin:smollm2-135m-instruct", help=f"a folder, a builtin: name or {RANDOM}")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
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
    results = {kind: run(model_path, args.rank, args.reps, kind == "adapter", args.dtype) for kind in ("adapter", "merged")}
    print(f"{'push':8} {'MiB/push':>10} {'s/push':>8} {'first s':>8} {'gen s/step':>10} {'start s':>8}")
    for kind, r in results.items():
        print(f"{kind:8} {r['bytes_per_push'] / 2**20:10.2f} {r['push_s_median']:8.3f} {r['first_push_s']:8.3f} "
              f"{r['generate_s_median']:10.2f} {r['start_s']:8.1f}")
    a, m = results["adapter"], results["merged"]
    print(f"RESULT push {m['push_s_median'] / a['push_s_median']:.1f}x faster, {m['bytes_per_push'] / a['bytes_per_push']:.0f}x "
          f"fewer bytes; generation {a['generate_s_median'] / m['generate_s_median']:.2f}x the merged model's time")
    if args.json:
        Path(args.json).write_text(json.dumps({"model": args.model, "rank": args.rank, "reps": args.reps,
                                               "cpu": cpu_model(),
                                               "load_before": load, "load_after": os.getloadavg()[0], **results}, indent=1))


if __name__ == "__main__":
    main()
