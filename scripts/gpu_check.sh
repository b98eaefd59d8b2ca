#!/usr/bin/env bash
# Every GPU-only path, one command, one line per check, on the day a GPU is lent:
#
#   bash scripts/gpu_check.sh            # writes JSON details to ${OUT:-.}; about 6-12 minutes on one H200
#   DRY_RUN=1 bash scripts/gpu_check.sh  # prints each check's command instead (tests/test_gpu_check.py runs them)
#
# What CPU tests cannot reach, each check with its own time limit:
#   hf_bf16           a random-init Qwen2.5-0.5B-shaped model (gpu_check.py), bf16, the hf engine
#   hf_bf16_packed    the same with train.packing and a token budget (train.micro_batch_tokens=8192): the packed
#                     rows' 4D mask through SDPA on the GPU; compare median_update_s and peak memory with hf_bf16
#   hf_compiled       the same with rollout.hf.compile (static KV cache under torch.compile, CUDA graphs): compare
#                     its median step with hf_bf16's, and its first step (the compiling) with the steps it saves
#   vllm_sleep        the same with rollout.engine=vllm_colocate and rollout.vllm.enable_sleep_mode (sleep/wake
#                     around each update, weight push into a woken engine); needs vllm installed
#   deepspeed_bf16    the shipped zero3.yaml on 1 GPU: bf16 from its JSON, ZeRO-3 gathering for sampling and eval
#   fsdp              the shipped fsdp.yaml on 1 GPU (FSDP v2, bf16)
#   vllm_tp2          vLLM colocate with tensor_parallel_size 2; skipped with fewer than 2 GPUs
#   vllm_nccl_push    a vLLM server (`grpo_trainer serve`, GPU 1) takes the trainer's weights (GPU 0) over vLLM's NCCL
#                     backend; its log-probs follow them, the tied head included (gpu_check_push.py); needs 2 GPUs
#   vllm_gloo_push    the same over our gloo backend (through host memory), server and trainer on GPU 0
#   vllm_pace         our vLLM engines' rollout (colocated, then a server) against vLLM alone (`LLM.generate`, the
#                     server's /v1/completions from a bare client) on the same prompts, SamplingParams and seeds
#                     (vllm_pace.py, issue 47: our overhead <= 10% of vLLM's own time); the tiny head_dim-32 model
#   vllm_lora_push    LoRA rank 16 pushed as the adapter alone against the merged model, colocated, bf16: seconds
#                     and bytes per push, and vLLM's generation time with the adapter against without (docs/lora.md)
set -uo pipefail
cd "$(dirname "$0")/.."
out="${OUT:-.}"
mkdir -p "$out"
dry="${DRY_RUN:-}"
[ -n "$dry" ] || python3 -m pip install -q -e . >/dev/null 2>&1 || python3 -m pip install -q -e .
gpus=$(nvidia-smi -L 2>/dev/null | wc -l)
echo "gpu_check: ${gpus} GPU(s): $(nvidia-smi --query-gpu=name --format=csv,noheader 2>/dev/null | head -1)"
failed=0

check() {  # check NAME SECONDS COMMAND...: one line, PASS/FAIL with the time and the log's last line on failure
  local name=$1 limit=$2; shift 2
  local log="$out/gpu_check_${name}.log" start=$SECONDS
  if [ -n "$dry" ]; then echo "CHECK ${name} $*"; return; fi
  if timeout "$limit" "$@" >"$log" 2>&1; then
    echo "PASS ${name} ($((SECONDS - start)) s) $(grep -h '^RESULT' "$log" | tail -1 | cut -c8-)"
  else
    failed=$((failed + 1))
    echo "FAIL ${name} ($((SECONDS - start)) s, exit $?): $(grep -v '^\s*$' "$log" | tail -1 | cut -c1-200)"
  fi
}
skip() { echo "SKIP $1: $2"; }

demo_steps=(configs/demo_cpu.yaml train.max_steps=3 train.warmup_steps=0 logging.progress_bar=false
            checkpoint.resume=never eval.every=3 eval.num_samples=8)

check hf_bf16 180 python3 scripts/gpu_check.py --engine hf --json "$out/gpu_check_hf.json"
check hf_bf16_packed 180 python3 scripts/gpu_check.py --engine hf --packing --micro-batch-tokens 8192 \
  --json "$out/gpu_check_hf_packed.json"
check hf_compiled 420 python3 scripts/gpu_check.py --engine hf --compile --json "$out/gpu_check_hf_compiled.json"
if python3 -c "import vllm" 2>/dev/null; then
  check vllm_sleep 240 python3 scripts/gpu_check.py --engine vllm_colocate --sleep-mode --json "$out/gpu_check_vllm.json"
else
  skip vllm_sleep "vllm is not installed (pip install 'grpo-trainer[vllm]')"
fi
if python3 -c "import deepspeed" 2>/dev/null; then
  check deepspeed_bf16 180 accelerate launch --config_file configs/accelerate/zero3.yaml --num_processes 1 \
    -m grpo_trainer train "${demo_steps[@]}" output_dir="$out/run_zero3"
else
  skip deepspeed_bf16 "deepspeed is not installed (pip install 'grpo-trainer[deepspeed]')"
fi
check fsdp 180 accelerate launch --config_file configs/accelerate/fsdp.yaml --num_processes 1 \
  -m grpo_trainer train "${demo_steps[@]}" output_dir="$out/run_fsdp"
if [ "$gpus" -ge 2 ] && python3 -c "import vllm" 2>/dev/null; then
  check vllm_tp2 240 python3 scripts/gpu_check.py --engine vllm_colocate --tensor-parallel 2 --json "$out/gpu_check_tp2.json"
else
  skip vllm_tp2 "needs 2 GPUs and vllm (found ${gpus} GPU(s))"
fi
if [ "$gpus" -ge 2 ] && python3 -c "import vllm" 2>/dev/null; then
  check vllm_nccl_push 420 python3 scripts/gpu_check_push.py --backend nccl --json "$out/gpu_check_nccl_push.json"
else
  skip vllm_nccl_push "needs 2 GPUs (NCCL puts no two ranks on one GPU) and vllm (found ${gpus} GPU(s))"
fi
if python3 -c "import vllm" 2>/dev/null; then
  check vllm_gloo_push 420 python3 scripts/gpu_check_push.py --backend gloo --json "$out/gpu_check_gloo_push.json"
else
  skip vllm_gloo_push "vllm is not installed (pip install 'grpo-trainer[vllm]')"
fi
if python3 -c "import vllm" 2>/dev/null; then
  check vllm_pace 300 python3 scripts/vllm_pace.py --gpu-memory-utilization 0.3 --max-tokens 64 --reps 5 \
    --json "$out/gpu_check_vllm_pace.json"
else
  skip vllm_pace "vllm is not installed (pip install 'grpo-trainer[vllm]')"
fi
if python3 -c "import vllm" 2>/dev/null; then
  check vllm_lora_push 420 python3 scripts/bench_lora_push.py --model random-qwen2.5-0.5b --dtype bfloat16 --reps 3 \
    --json "$out/gpu_check_lora_push.json"
else
  skip vllm_lora_push "vllm is not installed (pip install 'grpo-trainer[vllm]')"
fi
# Asynchronous rollouts (docs/async.md): a vLLM server on the same GPU (30% of it) samples the next batch while the
# trainer updates; step time with rollout.max_staleness 1 against 0 (scripts/async_speed.py --gpu).
if python3 -c "import vllm" 2>/dev/null; then
  check async_k1 540 python3 scripts/async_speed.py --gpu --steps 6 --warmup 2 --reps 1 --json "$out/gpu_check_async.json"
else
  skip async_k1 "vllm is not installed (pip install 'grpo-trainer[vllm]')"
fi
echo "gpu_check: ${failed} failed"
exit $((failed > 0))
