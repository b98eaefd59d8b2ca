"""float32 against bfloat16 for one forward + backward of a model on this CPU, with the operators that differ.

    python scripts/bf16_cpu.py                         # SmolLM2-135M, 8 x 128 tokens, ~1 min on 2 cores
    python scripts/bf16_cpu.py --model builtin:tiny

Why it exists: on a CPU without bfloat16 instructions (no avx512_bf16, no AMX) PyTorch converts around
every bf16 kernel, and a bf16 run is slower than a float32 one (docs/performance.md). The trainer warns
at start in that case (grpo_trainer/preflight.py); this shows by how much, and where.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:smollm2-135m-instruct")
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--tokens", type=int, default=128)
    p.add_argument("--reps", type=int, default=3, help="timed passes per dtype; the best is reported")
    p.add_argument("--top", type=int, default=8, help="operators listed per dtype")
    args = p.parse_args(argv)

    import torch
    from torch.profiler import profile
    from transformers import AutoConfig, AutoModelForCausalLM

    from grpo_trainer.preflight import cpu_has_bf16_instructions
    from grpo_trainer.builtin import resolve_model_path

    path = resolve_model_path(args.model)
    vocab = AutoConfig.from_pretrained(path).vocab_size
    ids = torch.randint(0, vocab, (args.rows, args.tokens), generator=torch.Generator().manual_seed(0))
    print(f"{args.model}: {args.rows} x {args.tokens} tokens; bf16 instructions on this CPU: {cpu_has_bf16_instructions()}")
    seconds = {}
    for dtype in (torch.float32, torch.bfloat16):
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)

        def step():
            logits = model(input_ids=ids).logits[:, :-1].float()
            logits.log_softmax(-1).gather(-1, ids[:, 1:, None]).mean().backward()

        step()  # warm-up
        times = []
        for _ in range(args.reps):
            start = time.perf_counter()
            step()
            times.append(time.perf_counter() - start)
        seconds[dtype] = min(times)  # the least disturbed pass
        with profile() as prof:
            step()
        print(f"\n{dtype}: forward + backward {seconds[dtype]:.2f} s (best of {args.reps})")
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=args.top))
    print(f"bfloat16 / float32: {seconds[torch.bfloat16] / seconds[torch.float32]:.1f}x")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
