#!/usr/bin/env bash
# The one prepared GPU check (see scripts/gpu_check.py): installs the package, then runs a few GRPO
# steps of a random-init Qwen2.5-0.5B-shaped model with the hf engine (and vLLM colocate when vLLM
# is installed), printing step time, tokens/s and peak GPU memory. Writes JSON to ${OUT:-.}.
set -euo pipefail
cd "$(dirname "$0")/.."
python3 -m pip install -q -e . >/dev/null
out="${OUT:-.}"
python3 scripts/gpu_check.py --engine hf --json "$out/gpu_check_hf.json"
if python3 -c "import vllm" 2>/dev/null; then
  python3 scripts/gpu_check.py --engine vllm_colocate --json "$out/gpu_check_vllm.json" || echo "vllm_colocate check failed"
fi
