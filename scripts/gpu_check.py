"""One prepared check for a GPU machine: a few GRPO steps on a random-init model of a real size.

Nothing can be downloaded on the lent GPU machines, so the model is Qwen2.5-0.5B's shape
(24 layers, hidden 896, 14 heads / 2 KV heads, MLP 4864, vocabulary 151,936, tied
embeddings, QKV bias) as a Llama config with random weights, and the tokenizer is the
embedded character tokenizer. Rewards are therefore ~0: this measures speed and memory,
not learning. Prints median step time, completion tokens/s, and peak GPU memory.

    bash scripts/gpu_check.sh                 # on the GPU machine: every GPU-only check, this one among them
    python scripts/gpu_check.py --compile     # the hf engine's compiled decode step (rollout.hf.compile)
    python scripts/gpu_check.py --small       # a CPU smoke test of the script itself
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

QWEN25_05B = dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                  num_key_value_heads=2, vocab_size=151936, max_position_embeddings=32768, rope_theta=1_000_000.0,
                  tie_word_embeddings=True, attention_bias=True, rms_norm_eps=1e-6)
SMALL = dict(QWEN25_05B, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=4096)


def build_model(folder: Path, shape: dict, dtype) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_trainer.builtin.charlm import build_tokenizer

    tokenizer = build_tokenizer()
    config = LlamaConfig(**shape, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.convert_tokens_to_ids("<|im_start|>"))
    torch.manual_seed(0)
    LlamaForCausalLM(config).to(dtype).save_pretrained(folder)
    tokenizer.save_pretrained(folder)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--small", action="store_true", help="a tiny shape, for a CPU smoke test")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--engine", default="hf")
    parser.add_argument("--compile", action="store_true",
                        help="hf: rollout.hf.compile (static KV cache under torch.compile; reduce-overhead mode on CUDA)")
    parser.add_argument("--sleep-mode", action="store_true", help="vllm_colocate: rollout.vllm.enable_sleep_mode")
    parser.add_argument("--tensor-parallel", type=int, default=1, help="vllm_colocate: rollout.vllm.tensor_parallel_size")
    parser.add_argument("--packing", action="store_true",
                        help="train.packing (prefix-shared rows through SDPA with a 4D mask; docs/performance.md)")
    parser.add_argument("--micro-batch-tokens", type=int, default=None, help="train.micro_batch_tokens (a token budget)")
    parser.add_argument("--json", help="write the numbers here")
    return parser


def main() -> int:
    args = build_parser().parse_args()

    import torch

    from grpo_trainer.config import load_config
    from grpo_trainer.metrics import read_metrics
    from grpo_trainer import train

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    prompts, generations, micro = (4, 4, 16) if args.small else (16, 8, 32)  # --small: a smoke test of the script
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = Path(tmp) / "model"
        build_model(model_dir, SMALL if args.small else QWEN25_05B, dtype)
        cfg = load_config(None, [
            f"output_dir={tmp}/run", f"model.name_or_path={model_dir}", f"model.dtype={'bfloat16' if cuda else 'float32'}",
            f"rollout.engine={args.engine}", f"rollout.num_generations={generations}",
            f"rollout.max_completion_length={32 if args.small else 256}", f"train.prompts_per_step={prompts}",
            f"train.micro_batch_size={micro}", f"train.max_steps={args.steps}",
            "train.learning_rate=1e-6", "checkpoint.save_final_model=false", "checkpoint.save_every=0",
            "checkpoint.resume=never", "logging.progress_bar=false",
            f"rollout.vllm.enable_sleep_mode={str(args.sleep_mode).lower()}",
            f"rollout.vllm.tensor_parallel_size={args.tensor_parallel}", f"train.packing={str(args.packing).lower()}",
            *([f"train.micro_batch_tokens={args.micro_batch_tokens}"] if args.micro_batch_tokens else []),
            f"rollout.hf.compile={str(args.compile).lower()}",
            f"rollout.hf.compile_mode={'reduce-overhead' if cuda else 'default'}",
        ])
        if cuda:
            torch.cuda.reset_peak_memory_stats()
        train(cfg)
        rows = read_metrics(f"{tmp}/run")
    timed = rows[1:] or rows  # the first step pays for warm-up
    tokens = [r["completions/mean_length"] * prompts * generations for r in timed]
    result = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "model": "random-init Qwen2.5-0.5B shape" if not args.small else "small smoke shape",
        "engine": args.engine + (" compiled" if args.compile else ""),
        "packing": args.packing,
        "micro_batch_tokens": args.micro_batch_tokens,
        "first_step_time_s": rows[0]["step_time"],  # with --compile: the compiling
        "median_update_s": statistics.median(r["timing/update"] for r in timed),
        "median_step_time_s": statistics.median(r["step_time"] for r in timed),
        "median_rollout_s": statistics.median(r["timing/rollout"] for r in timed),
        "completion_tokens_per_s": statistics.median(t / r["timing/rollout"] for t, r in zip(tokens, timed)),
        "peak_gpu_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if cuda else None,
    }
    print(json.dumps(result, indent=2))
    print("RESULT " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
