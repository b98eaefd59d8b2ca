"""How our step time grows with G, completion length and model size, and how far the hf engine is from a roofline.

    python scripts/scaling.py                 # the table in docs/performance.md (~5 min on 2 cores)
    python scripts/scaling.py --threads 1     # on a shared machine: far less sensitive to other load
    python scripts/scaling.py --json s.json   # also write the numbers

Each row is one run of this trainer (`scripts/bench.py`'s `_run_ours`, its own process) on the bundled
arithmetic task; the first step is dropped and the rest are summarised by their median. A completion
stops at EOS, so the "max completion length" rows only grow as far as the model's completions do: the
random-init `large` model samples EOS about once in 128 tokens, so its completions mostly reach the
maximum, while the tiny model's answers end after ~12 tokens. The `large` rows are the compute-bound
ones. `train.skip_zero_advantage` is off for every row, so the update column is the full forward +
backward over all completions.

Roofline: the machine's peak is measured, not looked up: the best float32 matmul rate over a few
square sizes (`torch.mm`, all threads unless --threads). A token costs 2 x (matmul weights) FLOPs in a
forward (every Linear, the LM head included), plus 4 x layers x context x (heads x head_dim) for
attention; training costs 3x a forward (forward + backward). "achieved" is those FLOPs over the
measured seconds; "% of peak" is achieved over the matmul peak. Generation here is mostly small,
latency-bound matmuls (one new token per row per step), so it sits far below the peak; that gap,
not arithmetic, is what a faster engine (vLLM) closes.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (same folder: its presets, model builder and one-run launcher)

# skip_zero_advantage off: this table measures what the passes cost, and the random-init large model's
# rewards are all 0, so with the default the trainer would (rightly) skip its update altogether.
BASE = dict(prompts_per_step=8, num_generations=8, max_completion_length=16, micro_batch_size=64, steps=6,
            learning_rate=1e-4, seed=0, skip_zero_advantage=False)
ROWS = [  # (label, model, overrides)
    ("G=4", "tiny", dict(num_generations=4, micro_batch_size=32)),
    ("G=8", "tiny", {}),
    ("G=16", "tiny", dict(num_generations=16, micro_batch_size=128)),
    ("G=32", "tiny", dict(num_generations=32, micro_batch_size=128)),
    ("large, max len 16", "large", dict(prompts_per_step=4, micro_batch_size=32, steps=4)),
    ("large, max len 32", "large", dict(prompts_per_step=4, max_completion_length=32, micro_batch_size=32, steps=4)),
    ("large, max len 64", "large", dict(prompts_per_step=4, max_completion_length=64, micro_batch_size=32, steps=4)),
    ("large, G=16", "large", dict(prompts_per_step=4, num_generations=16, micro_batch_size=32, steps=4)),
]


def matmul_peak_flops(threads: int | None) -> float:
    """Best float32 GEMM FLOP/s over a few square sizes: the machine's practical ceiling."""
    import torch

    if threads:
        torch.set_num_threads(threads)
    best = 0.0
    for n in (512, 1024, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        torch.mm(a, b)  # warm-up
        reps = max(3, int(2e9 / (2 * n**3)))
        tick = time.perf_counter()
        for _ in range(reps):
            torch.mm(a, b)
        best = max(best, 2 * n**3 * reps / (time.perf_counter() - tick))
    return best


def model_costs(path: str) -> dict:
    """Matmul weights per token (every Linear incl. the LM head) and the attention width, from the model itself."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(path)
    model = AutoModelForCausalLM.from_config(config)
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return {"params": sum(p.numel() for p in model.parameters()), "matmul_weights": linear,
            "layers": config.num_hidden_layers, "attention_width": config.num_attention_heads * head_dim}


def forward_flops_per_token(costs: dict, context: float) -> float:
    return 2 * costs["matmul_weights"] + 4 * costs["layers"] * context * costs["attention_width"]


def run_row(label: str, model: str, overrides: dict, root: Path, threads: int | None, log) -> dict:
    spec = {**BASE, **overrides, "model_path": bench.model_path(model, root)}
    out = root / label.replace(" ", "_").replace(",", "").replace("=", "")
    bench.launch("ours", sys.executable, {k: v for k, v in spec.items()}, out, log, threads)
    rows = [json.loads(line) for line in (out / "run" / "metrics.jsonl").read_text().splitlines() if line.strip()][1:]
    n = spec["prompts_per_step"] * spec["num_generations"]
    med = lambda key: statistics.median(r[key] for r in rows)  # noqa: E731
    return {"label": label, "model": model, "completions": n, "G": spec["num_generations"],
            "max_completion_length": spec["max_completion_length"], "mean_completion_length": med("completions/mean_length"),
            "step_s": med("step_time"), "generation_s": med("timing/rollout"), "reward_s": med("timing/reward"),
            "update_s": med("timing/update"),
            "model_path": spec["model_path"]}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--threads", type=int, default=None, help="OMP/MKL threads per run (and for the peak matmul)")
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--only", default=None, help="comma list of row labels to run (default: all)")
    args = p.parse_args(argv)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731
    peak = matmul_peak_flops(args.threads)
    log(f"peak float32 matmul: {peak / 1e9:.1f} GFLOP/s")
    wanted = set(args.only.split(",")) if args.only else None
    results = []
    with tempfile.TemporaryDirectory(prefix="grpo-scaling-") as tmp:
        root = Path(tmp)
        prompt_len = bench.prompt_tokens(bench.model_path("tiny", root))
        for label, model, overrides in ROWS:
            if wanted and label not in wanted:
                continue
            row = run_row(label, model, overrides, root, args.threads, log)
            costs = model_costs(row.pop("model_path"))
            c_len = row["mean_completion_length"]
            gen_tokens = row["completions"] * c_len
            # Generation: one prefill per prompt (prompt tokens), then one token per completion per step.
            gen_flops = (row["completions"] / row["G"]) * prompt_len * forward_flops_per_token(costs, prompt_len / 2) \
                + gen_tokens * forward_flops_per_token(costs, prompt_len + c_len / 2)
            # Update: forward + backward (3x) over the prompts once per micro-batch group and every completion token.
            train_flops = 3 * gen_flops
            row.update(
                params_m=costs["params"] / 1e6,
                rollout_tok_s=gen_tokens / row["generation_s"],
                generation_gflop_s=gen_flops / row["generation_s"] / 1e9,
                update_gflop_s=train_flops / row["update_s"] / 1e9,
            )
            row["generation_pct_peak"] = 100 * row["generation_gflop_s"] * 1e9 / peak
            row["update_pct_peak"] = 100 * row["update_gflop_s"] * 1e9 / peak
            results.append(row)
    print(f"peak float32 matmul {peak / 1e9:.1f} GFLOP/s (threads={args.threads or 'default'}); "
          f"mean prompt {prompt_len:.1f} tokens")
    head = ["run", "params (M)", "completions/step", "mean len", "step (s)", "generation (s)", "reward (s)", "update (s)",
            "rollout tok/s", "gen GFLOP/s (% peak)", "update GFLOP/s (% peak)"]
    print("| " + " | ".join(head) + " |\n|" + "---|" * len(head))
    for r in results:
        print(f"| {r['label']} | {r['params_m']:.1f} | {r['completions']} | {r['mean_completion_length']:.1f} | "
              f"{r['step_s']:.3f} | {r['generation_s']:.3f} | {r['reward_s']:.3f} | {r['update_s']:.3f} | "
              f"{r['rollout_tok_s']:.0f} | "
              f"{r['generation_gflop_s']:.1f} ({r['generation_pct_peak']:.0f}%) | "
              f"{r['update_gflop_s']:.1f} ({r['update_pct_peak']:.0f}%) |")
    if args.json:
        args.json.write_text(json.dumps({"peak_gflop_s": peak / 1e9, "threads": args.threads, "rows": results}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
