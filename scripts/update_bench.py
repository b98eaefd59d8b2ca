"""The update phase (log-prob passes + forward/backward + optimizer steps) in each batch layout: time and peak memory.

    MALLOC_MMAP_THRESHOLD_=65536 python scripts/update_bench.py                        # SmolLM2, the recipe's spreads
    MALLOC_MMAP_THRESHOLD_=65536 python scripts/update_bench.py --spread longtail --budget 2048
    python scripts/update_bench.py --zero-advantage      # a step where every advantage is 0, fillers vs none
    python scripts/update_bench.py --model builtin:tiny --reps 1    # seconds, for a smoke test
    python scripts/update_bench.py --spread longtail --budget 2048 --count-only   # tokens per layout, no passes
    MALLOC_MMAP_THRESHOLD_=65536 python scripts/update_bench.py --spread longtail --budget 2048 --peaks

One process, the model loaded once; the configuration is `configs/smollm2_cpu.yaml`'s (4 prompts x G 8, Dr. GRPO,
beta 0, one iteration) with the recipe's real prompts, and completions of random tokens with the chosen length
spread, every completion with a nonzero advantage (all of them trained):

  end       the recipe at the end of its run: mean ~21 tokens against the 64 cap, ~2% cut off (README, "A real
            model on a CPU": 0-3% over the last steps; docs/performance.md, "Learning runs")
  start     the recipe's first steps: 88% cut off at 64, the rest 20-63 tokens (mean ~60)
  longtail  most completions short (mean ~20), four of the 32 at 512 tokens (max_completion_length 512)

`--dense-mask` adds each packed layout again with one dense mask over each packed row (the attention before
packed_attention.py's segment path), to compare the two in one run. The table's `token bound` is a layout's tokens
computed over padded's: the time ratio if time followed the tokens (the matmuls do); `/ bound` is the measured
ratio over it (1.0: attention and everything else scale as the matmuls).

Layouts: `padded` (today's: each prompt once, completions padded to the longest of the micro-batch, 8 completions
per micro-batch as the recipe), `packed` (train.packing, 8 per micro-batch), and both under `--budget`
(train.micro_batch_tokens). Reps alternate the layouts (padded, packed, ..., padded, packed, ...), so machine load
falls on all alike; the table gives medians and each layout's ratio to `padded`.

Peak memory is the process's peak resident set during the update less what it held before (Linux: VmHWM, reset
through /proc/self/clear_refs), i.e. activations, logits chunks and gradients; run with MALLOC_MMAP_THRESHOLD_=65536
so freed tensors go back to the system. In one process the layouts still share one high-water mark (the first,
padded, sets it: what the allocator keeps is not given back between layouts), so `--peaks` measures each layout
in a process of its own (this script with `--layout NAME`, one update, no warm-up) and prints those peaks; the
time table comes from the alternating run, where load falls on all layouts alike.

`--zero-advantage`: the update of a step whose advantages are all 0 (what `timing/update` showed 2.2 s for), with
the fillers every rank used to run (`fillers`) and without them (`skipped`, where the backend allows: update.py),
and a torch profile of the filler path.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from types import SimpleNamespace

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

SPREADS = ("end", "start", "longtail")


def completion_lengths(spread: str, n: int, seed: int = 0) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    if spread == "start":
        cut = torch.rand(n, generator=g) < 0.88
        return [64 if c else int(x) for c, x in zip(cut, torch.randint(20, 64, (n,), generator=g))]
    # A gamma(2) shape (many short, a tail), mean ~20; `end` caps it at 64 with ~2% cut off. Gamma samples from
    # torch's global generator (it takes none), so seed that too: the same spread every run.
    torch.manual_seed(seed)
    short = (torch.distributions.Gamma(2.0, 0.1).sample((n,)) + 1).round().int().tolist()
    if spread == "end":
        return [min(max(x, 2), 64) for x in short]
    return [512 if j % 8 == 0 and j // 8 < 4 else min(max(x, 2), 200) for j, x in enumerate(short)]


def status_mib(key: str) -> float:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1]) / 1024
    return float("nan")


def setup(model: str, spread: str, lr: float = 1e-5):
    """The policy (prepared by Accelerate, single process), its optimizer, and a step's samples."""
    import torch
    from accelerate import Accelerator

    from grpo_trainer.config import load_config
    from grpo_trainer.models import TokenLogprobs, load_causal_lm, load_tokenizer
    from grpo_trainer.cpu.adamw import adamw_for
    from grpo_trainer.samples import TrainingSamples
    from grpo_trainer.task import load_task

    max_len = 512 if spread == "longtail" else 64
    cfg = load_config("configs/smollm2_cpu.yaml", [f"model.name_or_path={model}", f"rollout.max_completion_length={max_len}"])
    tokenizer = load_tokenizer(cfg.model, cfg.data.chat_template)
    lm = load_causal_lm(cfg.model)
    task = load_task(cfg.data, cfg.rewards, tokenizer, None)
    g = cfg.rollout.num_generations
    n = cfg.train.prompts_per_step * g
    prompts = [p for p in task.prompt_ids(list(range(cfg.train.prompts_per_step))) for _ in range(g)]
    lengths = completion_lengths(spread, n)
    gen = torch.Generator().manual_seed(1)
    vocab = lm.config.vocab_size
    completions = [torch.randint(100, vocab, (k,), generator=gen).tolist() for k in lengths]
    samples = TrainingSamples(
        prompt_indices=list(range(cfg.train.prompts_per_step)), prompt_ids=prompts, completion_ids=completions,
        loss_mask=[[1] * k for k in lengths], truncated=[k == max_len for k in lengths], sampler_logprobs=None,
        weight_versions=None, rewards=torch.zeros(n), per_function=torch.zeros(n, 0),
    )
    advantages = torch.randn(n, generator=gen)
    advantages[advantages == 0] = 0.1
    accelerator = Accelerator(cpu=True)
    policy = TokenLogprobs(lm, cfg.rollout.temperature, cfg.model.logprob_chunk_size)
    optimizer = adamw_for(accelerator)([p for p in policy.parameters() if p.requires_grad], lr=lr)  # the trainer's
    policy, optimizer = accelerator.prepare(policy, optimizer)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda _: 1.0)
    step = SimpleNamespace(samples=samples, advantages=advantages, lengths=lengths,
                           prompt_lengths=[len(p) for p in prompts])
    return cfg, accelerator, policy, optimizer, scheduler, step


def run_for(cfg, accelerator, policy, optimizer, scheduler, packing: bool, budget: int | None, dense: bool = False):
    """What the update phases are given in a step (update.Learner, the terms, the collectives), for one layout;
    `dense`: packed rows take the dense mask over each row (the attention before packed_attention.py)."""
    from grpo_trainer.geometry import geometry_of
    from grpo_trainer.cpu.heap import HeapTrimmer
    from grpo_trainer.terms import TermModels, build_terms
    from grpo_trainer.update import Learner

    layout = cfg.model_copy(update={"train": cfg.train.model_copy(update={"packing": packing, "micro_batch_tokens": budget})})
    # HeapTrimmer off: the layouts' own peaks, as measured before it
    learner = Learner(accelerator, policy, optimizer, scheduler, HeapTrimmer(enabled=False))
    return SimpleNamespace(cfg=layout, geometry=geometry_of(layout), learner=learner, terms=build_terms(layout, TermModels()),
                           comm=SimpleNamespace(sum=lambda t: t, max=lambda t: t, gather=lambda t: t), dense=dense)


def layout_tokens(mb) -> tuple[int, int]:
    """Tokens a micro-batch puts through the model, and how many of them are padding."""
    seq = mb.sequences
    if "input_ids" in seq:
        return seq["input_ids"].numel(), int((seq["piece_ids"] < 0).sum())
    computed = seq["prompt_ids"].numel() + seq["completion_ids"].numel()
    return computed, int((seq["prompt_mask"] == 0).sum() + (seq["completion_mask"] == 0).sum())


def layout_batch(run, step, advantages=None):
    """The step's `TrainBatch` in this run's layout (phase 3), as trainer.train_step builds it."""
    from grpo_trainer.batches import build_train_batch
    from grpo_trainer.trainer import skips_zero_advantage

    cfg, geometry = run.cfg, run.geometry
    return build_train_batch(
        step.samples, step.advantages if advantages is None else advantages, 0,
        micro_batch_size=geometry.micro_batch_size, micro_batch_tokens=geometry.micro_batch_tokens,
        packing=cfg.train.packing, mask_truncated=cfg.loss.mask_truncated_completions,
        skip_zero_advantage=skips_zero_advantage(cfg), group_size=geometry.group_size, mini_batches=geometry.mini_batches,
    )


def layout_counts(batch) -> dict:
    computed, padding = (sum(x) for x in zip(*(layout_tokens(mb) for mb in batch.micro_batches)))
    return {"micro_batches": len(batch.micro_batches), "computed_tokens": computed, "padding": padding}


def update_phase(run, step, advantages=None) -> tuple[float, float, dict]:
    """One step's phases 3-5 as trainer.train_step runs them: seconds, peak MiB over the start, and layout counts."""
    from grpo_trainer.train_state import TrainState
    from grpo_trainer.update import LogprobSettings, UpdateSettings, add_logprobs, update

    from grpo_trainer import packed_attention

    open("/proc/self/clear_refs", "w").write("5")
    before = status_mib("VmRSS")
    rule = packed_attention.SEGMENTS_PAY
    if run.dense:  # the segment path never pays: every packed row takes the dense mask
        packed_attention.SEGMENTS_PAY = float("inf")
    try:
        started = time.perf_counter()
        batch = layout_batch(run, step, advantages)
        add_logprobs(run.learner.policy, batch, run.terms, run.comm, LogprobSettings.of(run.cfg))
        update(run.learner, batch, TrainState(step=1), run.terms, run.comm, UpdateSettings.of(run.cfg, run.geometry))
        seconds = time.perf_counter() - started
    finally:
        packed_attention.SEGMENTS_PAY = rule
    peak = status_mib("VmHWM") - before
    return seconds, peak, layout_counts(batch)


def layouts_of(budget: int | None, dense: bool = False) -> dict[str, tuple[bool, int | None, bool]]:
    """name -> (train.packing, train.micro_batch_tokens, the dense mask); `dense`: each packed layout twice."""
    layouts = {"padded": (False, None, False), "packed": (True, None, False)}
    if budget:
        layouts.update({f"padded, {budget} tokens": (False, budget, False), f"packed, {budget} tokens": (True, budget, False)})
    if dense:
        layouts.update({f"{name}, dense mask": (True, tokens, True) for name, (packing, tokens, _) in list(layouts.items())
                        if packing})
    return layouts


def bench_layouts(args) -> dict:
    cfg, accelerator, policy, optimizer, scheduler, step = setup(args.model, args.spread)
    layouts = layouts_of(args.budget, args.dense_mask)
    if args.layout:  # this layout alone, one update: its peak is its own (see the module docstring)
        layouts = {args.layout: layouts[args.layout]}
    runs = {name: run_for(cfg, accelerator, policy, optimizer, scheduler, *spec) for name, spec in layouts.items()}
    if args.count_only:  # the layouts' token counts: no forward or backward, seconds
        rows = {name: {"seconds": float("nan"), "ratio": float("nan"), "peak_mib": float("nan"),
                       **layout_counts(layout_batch(run, step))} for name, run in runs.items()}
        return {"spread": args.spread, "lengths": step.lengths, "prompt_lengths": sorted(set(step.prompt_lengths)),
                "mean_length": statistics.mean(step.lengths), "layouts": rows}
    for name, run in runs.items():  # warm-up: allocator, kernels
        if args.layout:
            break
        print(f"warm-up {name}: {update_phase(run, step)[0]:.2f} s", file=sys.stderr, flush=True)
    times = {name: [] for name in runs}
    peaks = {name: [] for name in runs}
    counts = {}
    for _ in range(args.reps):
        for name, run in runs.items():
            seconds, peak, counts[name] = update_phase(run, step)
            print(f"{name}: {seconds:.2f} s, peak {peak:.0f} MiB", file=sys.stderr, flush=True)
            times[name].append(seconds)
            peaks[name].append(peak)
    first = next(iter(runs))  # padded, unless --layout picked another alone
    base, base_tokens = statistics.median(times[first]), counts[first]["computed_tokens"]
    rows = {}
    for name in runs:
        t = statistics.median(times[name])
        # The token bound: what the time ratio would be if time followed the tokens computed (the matmuls do)
        bound = counts[name]["computed_tokens"] / base_tokens
        rows[name] = {"seconds": t, "ratio": t / base, "token_bound": bound, "of_bound": t / base / bound,
                      "peak_mib": max(peaks[name]), **counts[name], "all_seconds": times[name]}
    return {"spread": args.spread, "lengths": step.lengths, "prompt_lengths": sorted(set(step.prompt_lengths)),
            "mean_length": statistics.mean(step.lengths), "layouts": rows}


def bench_zero_advantage(args) -> dict:
    """Every advantage 0: the update with fillers (as before) and without; a profile of the filler path."""
    import torch

    from grpo_trainer import distributed

    cfg, accelerator, policy, optimizer, scheduler, step = setup(args.model, args.spread)
    zeros = torch.zeros(len(step.lengths))
    run = run_for(cfg, accelerator, policy, optimizer, scheduler, False, None)
    real = distributed.steps_without_backward
    times = {"fillers": [], "skipped": []}
    update_phase(run, step, zeros)
    for _ in range(args.reps):
        for name in times:
            distributed.steps_without_backward = (lambda a: False) if name == "fillers" else real
            times[name].append(update_phase(run, step, zeros)[0])
    distributed.steps_without_backward = lambda a: False
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        with torch.profiler.record_function("update (fillers)"):
            update_phase(run, step, zeros)
    distributed.steps_without_backward = real
    table = prof.key_averages().table(sort_by="cpu_time_total", row_limit=args.top)
    return {"fillers_s": statistics.median(times["fillers"]), "skipped_s": statistics.median(times["skipped"]),
            "all": times, "profile": table}


def bench_peaks(args) -> dict:
    """Each layout's update in a fresh process of its own (`--layout NAME --reps 1`): its own peak memory."""
    import subprocess
    import tempfile

    rows = {}
    forwarded = ["--model", args.model, "--spread", args.spread]
    forwarded += ["--budget", str(args.budget)] if args.budget else []
    forwarded += ["--threads", str(args.threads)] if args.threads else []
    forwarded += ["--dense-mask"] if args.dense_mask else []
    with tempfile.TemporaryDirectory(prefix="update-bench-peaks-") as tmp:
        for i, name in enumerate(layouts_of(args.budget, args.dense_mask)):
            out = Path(tmp) / f"{i}.json"
            command = [sys.executable, __file__, *forwarded, "--layout", name, "--reps", "1", "--json", str(out)]
            result = subprocess.run(command, capture_output=True, text=True)
            if result.returncode != 0:
                raise RuntimeError(f"{name}: {result.stderr[-2000:]}")
            rows[name] = json.loads(out.read_text())["layouts"][name]
            print(f"{name}: peak {rows[name]['peak_mib']:.0f} MiB in its own process", file=sys.stderr, flush=True)
    return {"spread": args.spread, "layouts": rows}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="builtin:smollm2-135m-instruct")
    p.add_argument("--spread", choices=SPREADS, default="end")
    p.add_argument("--budget", type=int, default=None, help="also the layouts under train.micro_batch_tokens=N")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--zero-advantage", action="store_true")
    p.add_argument("--top", type=int, default=12, help="profile rows (--zero-advantage)")
    p.add_argument("--count-only", action="store_true", help="only the tokens each layout computes (no passes)")
    p.add_argument("--layout", default=None, help="only this layout (e.g. 'packed, 2048 tokens'), one update, no warm-up")
    p.add_argument("--peaks", action="store_true", help="each layout's peak memory, each in a process of its own")
    p.add_argument("--dense-mask", action="store_true",
                   help="also each packed layout with one dense mask over each row (attention before the segment path)")
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's own); 1 is far less sensitive to other load on a shared machine")
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    if args.layout is not None and args.layout not in layouts_of(args.budget, args.dense_mask):
        names = ", ".join(repr(n) for n in layouts_of(args.budget, args.dense_mask))
        p.error(f"--layout: one of {names} (with this --budget and --dense-mask)")
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    load = open("/proc/loadavg").read().split()[:3]
    if args.peaks:
        out = bench_peaks(args)
        print(f"{args.model}, spread {args.spread}: each layout's update in a process of its own; load before {' '.join(load)}")
        print("| layout | peak MiB over the start of the update | micro-batches | tokens computed | of which padding |")
        print("|---|---|---|---|---|")
        for name, row in out["layouts"].items():
            print(f"| {name} | {row['peak_mib']:.0f} | {row['micro_batches']} | {row['computed_tokens']} "
                  f"| {row['padding'] / row['computed_tokens']:.0%} |")
    elif args.zero_advantage:
        out = bench_zero_advantage(args)
        print(out["profile"])
        print(f"every advantage 0, {args.model}: update with fillers {out['fillers_s']:.3f} s, without "
              f"{out['skipped_s']:.3f} s (median of {args.reps}; load {' '.join(load)})")
    else:
        out = bench_layouts(args)
        print(f"{args.model}, spread {args.spread}, threads {args.threads or 'default'}: completions mean {out['mean_length']:.1f} tokens, max "
              f"{max(out['lengths'])}; prompts {out['prompt_lengths']} tokens; load before {' '.join(load)}")
        print("| layout | update (s) | / padded | token bound | / bound | peak MiB | micro-batches | tokens computed | of which padding |")
        print("|---|---|---|---|---|---|---|---|---|")
        for name, row in out["layouts"].items():
            bound = f"{row['token_bound']:.2f} | {row['of_bound']:.2f}" if "token_bound" in row else "- | -"
            print(f"| {name} | {row['seconds']:.3f} | {row['ratio']:.2f} | {bound} | {row['peak_mib']:.0f} | {row['micro_batches']} "
                  f"| {row['computed_tokens']} | {row['padding'] / row['computed_tokens']:.0%} |")
    out["load_before"] = load
    out["load_after"] = open("/proc/loadavg").read().split()[:3]
    print(f"load after {' '.join(out['load_after'])}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
