"""How far the hf engine's decode step is from this machine's roofline, on the real model.

    python scripts/decode_roofline.py                 # SmolLM2-135M, 16 rows (4 prompts x G 4), ~2 min on 2 cores
    python scripts/decode_roofline.py --rows 32       # G 8
    python scripts/decode_roofline.py --json out.json
    ATEN_CPU_CAPABILITY=avx2 python scripts/decode_roofline.py   # the AVX2 kernels on an AVX-512 machine
    python scripts/decode_roofline.py --compile       # + the compiled static-cache step (minutes to compile here)
    python scripts/decode_roofline.py --threads 1 --cpu-time   # on a shared machine: one core, CPU time
    python scripts/decode_roofline.py --rollouts 5    # + whole rollouts of the SmolLM2 recipe against their bound

A decode step reads every weight once to produce one token per row. With 16 rows a weight is used for
16 multiply-adds per read, far below what keeps a CPU core's FMA units busy, so the step's floor is the
memory traffic: float32 weights / read bandwidth. Both are measured here, not looked up:

  read bandwidth     best `tensor.sum()` rate over a float32 tensor the size of the model's weights (at
                     least 256 MiB: larger than the caches, so it streams from DRAM)
  matmul peak        best `torch.mm` rate over square float32 matrices (scripts/scaling.py)
  roofline step      max(weight bytes / bandwidth, step FLOPs / matmul peak)

Then it times the engine's own decode step (reserved KV room, and the kernels the engine chose on this
machine: rollout/kernels.py, planned for the rows and context before timing, cached) at a context of prompt + half the completion,
and its parts: the whole step, the LM head alone in each linear form, the sampler with each exact draw and
with the engine's choice, and transformers' plain decode step (DynamicCache, repeat_kv, `nn.Linear`) for
comparison; and the model's linears alone, one after another at the step's row count through the engine's forms:
the rate a step's products reach at that row count (a 32-row product cannot keep a core's FMA units as busy as
square matrices do), a second, lower roof the step is also set against. Every number is the best of `--reps` after warm-up, the alternatives timed in turn (one rep of
each, then the next round): on a shared 2-core machine the best is the least disturbed run, and a change in
load hits all alike. The JSON records the machine (scripts/machine.py: CPU model and flags, ATen's vector
capability, threads, load average before and after) and the kernel choices in force.

`--rollouts N` also times N whole rollouts at configs/smollm2_cpu.yaml's shapes (its first 4 word problems in
its chat template, G 8, up to 64 tokens, temperature 1, seeds 0..N-1) through the hf engine with its plan, and
sets each against its compute bound: the FLOPs it cannot avoid (each prompt's prefill once, the LM head for its
last token only; then every sampled token after the first through every linear and the attention over its
context) at the matmul peak measured above, and with the decode linears at the row-count ceiling instead.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def decode_step(model, rows: int, context: int, kernels=None, steady: bool = True):
    """(step, context): `step()` runs one decode step of `rows` rows after a `context`-token cache (built once
    here), to be timed inside `context`. With `kernels` (a DecodeKernels): the engine's step (reserved KV room,
    its measured kernel choices, put in place by the context once, as the engine does per batch), else
    transformers' own. `steady`: the context also runs one untimed step, so what is timed is a step in the
    middle of a batch's loop; without it, the batch's first step (oneDNN's weight reordering, when that form was chosen, is in it)."""
    import contextlib

    import torch

    from grpo_trainer.rollout.decode import reserve_room

    ids = torch.randint(0, model.config.vocab_size, (rows, context), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(rows, context + 1, dtype=torch.long)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values
    length = cache.get_seq_length()
    nxt, position = ids[:, -1:], torch.full((rows, 1), context)

    if kernels is None:

        def step():
            with torch.no_grad():
                model(input_ids=nxt, attention_mask=mask, position_ids=position, past_key_values=cache, use_cache=True)
            rewind(cache, length)  # back to `context` tokens for the next rep

        return step, contextlib.nullcontext

    from grpo_trainer.rollout.decode import EagerDecoder

    reserve_room(cache, 1)
    decoder = EagerDecoder(model, cache, mask[:, :-1], kernels)  # the engine's own step (the lean Llama step where it runs)

    def engine_step():
        with torch.no_grad():
            decoder.forward(nxt[:, 0], position[:, 0])
        rewind(cache, length)
        decoder.mask = mask[:, :-1]

    return engine_step, lambda: warmed(engine_step if steady else None, kernels)


def warmed(function, inside=None):
    """A context (inside `inside`, when given) that runs `function` once on entry, untimed, so that what is timed
    in it is a later call; `function` None: nothing."""
    import contextlib

    @contextlib.contextmanager
    def run_once_first():
        with inside or contextlib.nullcontext():
            if function is not None:
                function()
            yield

    return run_once_first()


def alternating_best(calls: dict, reps: int) -> dict[str, float]:
    """Best seconds of each of `calls` ({name: (function, context manager factory)}), one rep of each in turn, so
    that a change in machine load hits every alternative alike; contexts are entered outside the timing."""
    import machine

    best = {}
    for function, context in calls.values():
        with context():
            function()  # warm-up: allocator, oneDNN primitives, the kernel choices' first measurement
    for _ in range(reps):
        for name, (function, context) in calls.items():
            with context():
                start = machine.CLOCK()
                function()
                best[name] = min(best.get(name, float("inf")), machine.CLOCK() - start)
    return best


def compiled_step(model, rows: int, context: int, reps: int, mode: str = "default") -> tuple[float, float]:
    """The compiled static-cache step (`rollout.hf.compile`): (wall seconds of the first call, which compiles;
    best seconds of a step after it). The compile is timed by the wall clock even under --cpu-time: inductor
    builds its C++ kernels in worker processes, whose CPU time this process's clock would leave out."""
    import torch

    import machine
    from grpo_trainer.rollout.static_decode import CompiledForward, StaticDecoder

    ids = torch.randint(0, model.config.vocab_size, (rows, context), generator=torch.Generator().manual_seed(0))
    mask = torch.ones(rows, context, dtype=torch.long)
    with torch.no_grad():
        cache = model(input_ids=ids, use_cache=True, logits_to_keep=1).past_key_values
        decoder = StaticDecoder(CompiledForward(model, mode), cache, mask, reps + 2)
        nxt, position = ids[:, -1], torch.full((rows,), context)
        start = time.perf_counter()
        decoder.forward(nxt, position)
        compile_s = time.perf_counter() - start
        best = float("inf")
        for _ in range(reps):
            start = machine.CLOCK()
            decoder.forward(nxt, position)
            best = min(best, machine.CLOCK() - start)
    return compile_s, best


def rewind(cache, length: int) -> None:
    from grpo_trainer.rollout.decode import ReservedLayer

    for layer in cache.layers:
        if isinstance(layer, ReservedLayer):
            layer.rewind(layer.length - length)
        else:
            layer.keys, layer.values = layer.keys[..., :length, :], layer.values[..., :length, :]


def linears_alone(model, rows: int, kernels):
    """(call, context) timing every linear of `model` once at `rows` rows through the forms `kernels` (the engine's
    DecodeKernels) chose, in the model's order, with nothing between them: the rate the step's own products reach
    at this row count, the weights streamed from memory as in the step."""
    import torch

    linears = [m for m in model.modules() if type(m) is torch.nn.Linear]
    inputs = {m.in_features: torch.randn(rows, m.in_features) for m in linears}

    def run():
        with torch.no_grad():
            for module in linears:
                module(inputs[module.in_features])

    return run, lambda: warmed(run, kernels)


def rollouts(model, name: str, count: int, peak: float, ceiling: float, linear_params: int, width: int) -> list[dict]:
    """`count` rollouts of the SmolLM2 recipe's shapes (module docstring), each {seconds, bound_s (at the square
    peak), ceiling_bound_s (its linears at the decode rows' measured ceiling), tokens}; `linear_params`: the
    model's linear weights, `width`: its query heads x head size."""
    import torch

    import machine

    from grpo_trainer.config import load_config
    from grpo_trainer.models import eos_token_ids, load_tokenizer
    from grpo_trainer.rollout import SamplingSettings
    from grpo_trainer.rollout.decode import plan_decode_kernels
    from grpo_trainer.rollout.hf import HFEngine
    from grpo_trainer.task import load_task

    cfg = load_config(Path(__file__).resolve().parent.parent / "configs/smollm2_cpu.yaml", [f"model.name_or_path={name}"])
    tokenizer = load_tokenizer(cfg.model)
    prompts = load_task(cfg.data, cfg.rewards, tokenizer, 8192).prompts.token_ids[: cfg.train.prompts_per_step]
    group, limit = cfg.rollout.num_generations, cfg.rollout.max_completion_length
    settings = SamplingSettings(eos_token_ids=eos_token_ids(tokenizer, model), max_completion_length=limit,
                                temperature=cfg.rollout.temperature)  # fmt: skip
    plan = plan_decode_kernels(model, len(prompts) * group, max(map(len, prompts)) + limit)
    engine = HFEngine(settings, get_model=lambda: model, pad_token_id=tokenizer.pad_token_id, kernel_plan=plan)
    head_params = model.get_output_embeddings().weight.numel()
    cfg_model = model.config
    engine.generate(prompts, group)  # warm-up: allocator, oneDNN primitives
    results = []
    for seed in range(count):
        torch.manual_seed(seed)  # one stream for the whole batch, as the recipe samples (no seed_per_prompt)
        start = machine.CLOCK()
        out = engine.generate(prompts, group)
        seconds = machine.CLOCK() - start
        flops, products = 0.0, 0.0  # all FLOPs; those of the decode linears
        for prompt in prompts:  # the prefill: every prompt token through the layers, the LM head for the last one
            n = len(prompt)
            flops += 2 * (linear_params - head_params) * n + 2 * head_params + 2 * cfg_model.num_hidden_layers * width * n * n
        for index, completion in enumerate(out.completion_ids):
            context = len(prompts[index // group])
            for t in range(1, len(completion)):  # the first token comes from the prefill's logits
                flops += 2 * linear_params + 4 * cfg_model.num_hidden_layers * width * (context + t)
                products += 2 * linear_params
        results.append({"seconds": seconds, "bound_s": flops / peak,
                        "ceiling_bound_s": (flops - products) / peak + products / ceiling,
                        "tokens": sum(map(len, out.completion_ids))})  # fmt: skip
    return results


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:smollm2-135m-instruct")
    p.add_argument("--rows", type=int, default=16, help="decode batch: prompts x G (default 4 x 4)")
    p.add_argument("--context", type=int, default=100, help="tokens in the cache: ~prompt + half a 64-token completion")
    p.add_argument("--reps", type=int, default=15)
    p.add_argument("--json", type=Path, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's own, all cores)")
    p.add_argument("--cpu-time", action="store_true",
                   help="time by this process's CPU time instead of the wall clock: with --threads 1 on a machine "
                        "other jobs share, the time the process waits for a core is left out (memory contention is not)")
    p.add_argument("--compile", action="store_true",
                   help="also time the compiled static-cache step (rollout.hf.compile): compile seconds, ms per step")
    p.add_argument("--rollouts", type=int, default=0,
                   help="also time this many whole rollouts of the SmolLM2 recipe's shapes against their compute bound")
    args = p.parse_args(argv)

    import torch
    from transformers import AutoModelForCausalLM

    import machine
    from grpo_trainer.cpu.linear import LINEAR, available_linears
    from grpo_trainer.rollout.decode import DecodeKernels, plan_decode_kernels

    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cpu_time:
        machine.CLOCK = time.process_time
    from grpo_trainer.cpu.draw import DRAWS, available_draws
    from grpo_trainer.rollout.hf import sample_next_token
    from grpo_trainer.builtin import resolve_model_path

    model = AutoModelForCausalLM.from_pretrained(resolve_model_path(args.model), dtype=torch.float32).eval()
    weights = {id(t): t for t in model.parameters()}.values()  # tied embeddings once
    weight_bytes = sum(t.numel() * t.element_size() for t in weights)
    linear_params = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    cfg = model.config
    attention_width = cfg.num_attention_heads * getattr(cfg, "head_dim", cfg.hidden_size // cfg.num_attention_heads)
    step_flops = args.rows * (2 * linear_params + 4 * cfg.num_hidden_layers * args.context * attention_width)

    host = machine.describe(bandwidth_bytes=max(weight_bytes, 256 * 2**20), reps=args.reps)
    host["clock"] = "process CPU time" if args.cpu_time else "wall"
    bandwidth, peak = host["read_bandwidth_gb_s"] * 1e9, host["matmul_peak_gflop_s"] * 1e9
    floor = max(weight_bytes / bandwidth, step_flops / peak)
    logits = torch.randn(args.rows, cfg.vocab_size) * 4
    hidden = torch.randn(args.rows, 1, cfg.hidden_size)
    plan = plan_decode_kernels(model, args.rows, args.context)  # the engine's, from this machine's cache or measured now
    kernels, engine_kernels = DecodeKernels(model, plan), DecodeKernels(model, plan)
    plain = contextlib.nullcontext
    calls = {
        "engine_step_s": decode_step(model, args.rows, args.context, engine_kernels),
        "engine_first_step_s": decode_step(model, args.rows, args.context, engine_kernels, steady=False),
        "transformers_step_s": decode_step(model, args.rows, args.context),
        # Each form run once untimed first: the oneDNN form's reordered weights are dropped whenever the engine's
        # loop above ends, as they are after every batch in the engine; a batch's first step (above) pays it.
        **{f"lm_head_{form}_s": (lambda form=form: LINEAR[form](model.lm_head, hidden),
                                 lambda form=form: warmed(lambda: LINEAR[form](model.lm_head, hidden)))
           for form in available_linears(torch.float32)},
        **{f"sampler_{name}_s": (lambda name=name: sample_next_token(logits, draw=DRAWS[name]), plain)
           for name in available_draws()},
        "sampler_s": (lambda: sample_next_token(logits, draw=kernels.draw), plain),  # the engine's choice
        "linears_s": linears_alone(model, args.rows, engine_kernels),
    }
    timings = alternating_best(calls, args.reps)
    engine_token_s = timings["engine_step_s"] + timings["sampler_s"]
    # The rate the step's own products reach alone at this row count: the ceiling its linears can approach
    ceiling = 2 * linear_params * args.rows / timings["linears_s"]
    ceiling_floor = max(weight_bytes / bandwidth, step_flops / ceiling)
    compile_s = None
    if args.compile:
        model.config.use_cache = True
        compile_s, timings["compiled_step_s"] = compiled_step(model, args.rows, args.context, args.reps)
    rollout_runs = []
    if args.rollouts:
        rollout_runs = rollouts(model, args.model, args.rollouts, peak, ceiling, linear_params, attention_width)
    report = {
        "rollouts": rollout_runs,
        "model": args.model, "rows": args.rows, "context": args.context, "threads": torch.get_num_threads(),
        "weight_mib": weight_bytes / 2**20, "step_gflop": step_flops / 1e9,
        "read_bandwidth_gb_s": bandwidth / 1e9, "matmul_peak_gflop_s": peak / 1e9, "roofline_step_s": floor,
        **timings,
        "engine_tokens_per_s": args.rows / engine_token_s, "roofline_tokens_per_s": args.rows / floor,
        "engine_share_of_roofline": floor / engine_token_s,
        "linear_ceiling_gflop_s": ceiling / 1e9, "ceiling_roofline_step_s": ceiling_floor,
        "engine_share_of_ceiling_roofline": ceiling_floor / engine_token_s,
        "compile_s": compile_s,
        "kernel_choices": {**engine_kernels.chosen, **kernels.chosen},
        "machine": {**host, "loadavg_at_end": [round(x, 2) for x in os.getloadavg()]},
    }
    print(f"{args.model}: {report['weight_mib']:.0f} MiB float32 weights, {args.rows} rows, context {args.context}")
    print(f"machine: {machine.one_line(host)}")
    print(f"roofline: max({report['weight_mib']:.0f} MiB / {bandwidth / 1e9:.1f} GB/s, {step_flops / 1e9:.1f} GFLOP / "
          f"{peak / 1e9:.0f} GFLOP/s) = {floor * 1e3:.1f} ms/step ({report['roofline_tokens_per_s']:.0f} tok/s)")
    for key, value in timings.items():
        print(f"  {key[:-2]:24s} {value * 1e3:7.1f} ms")
    if compile_s is not None:
        print(f"compiled step: first call (compiling) {compile_s:.1f} s wall")
    print("kernel choices: " + ", ".join(f"{k} -> {v}" for k, v in sorted(report["kernel_choices"].items())))
    print(f"engine: step + sampler {engine_token_s * 1e3:.1f} ms, {report['engine_tokens_per_s']:.0f} tok/s = "
          f"{100 * report['engine_share_of_roofline']:.0f}% of the roofline")
    print(f"the step's {args.rows}-row products alone: {ceiling / 1e9:.0f} GFLOP/s ({100 * ceiling / peak:.0f}% of the "
          f"square-matrix peak); at that ceiling the roofline is {ceiling_floor * 1e3:.1f} ms: the engine's step + "
          f"sampler is {100 * report['engine_share_of_ceiling_roofline']:.0f}% of it")
    for run in rollout_runs:
        print(f"rollout: {run['tokens']} tokens in {run['seconds']:.2f} s; compute bound at the square peak "
              f"{run['bound_s']:.2f} s: {run['seconds'] / run['bound_s']:.2f}x; at the {args.rows}-row ceiling "
              f"{run['ceiling_bound_s']:.2f} s: {run['seconds'] / run['ceiling_bound_s']:.2f}x")
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
