#!/usr/bin/env bash
# On-policy distillation, measured (docs/distillation.md): the embedded tiny model as the student, the model
# `make demo` trains as its teacher (the same tokenizer). Three runs at the same seed and step count:
# (a) GRPO on the reward, (b) pure distillation (loss.teacher_only), (c) both; each evaluated on the held-out
# split at its last step (mean@4 over 64 prompts). Usage: scripts/distill_compare.sh TEACHER_MODEL_DIR OUT [STEPS]
set -euo pipefail
teacher=${1:?the teacher model folder, e.g. outputs/demo/model after make demo}
out=${2:?an output folder}
steps=${3:-30}
py=${PYTHON:-.venv/bin/python}
common=(configs/demo_cpu.yaml "train.max_steps=$steps" "eval.every=$steps" eval.num_samples=64 eval.num_generations=4
        checkpoint.save_every=0 checkpoint.save_final_model=false checkpoint.resume=never logging.progress_bar=false)
teach=("teacher={name_or_path: '$teacher'}" loss.teacher_kl=1.0)
$py -m grpo_trainer train "${common[@]}" "output_dir=$out/a_grpo"
$py -m grpo_trainer train "${common[@]}" "output_dir=$out/b_distill" "${teach[@]}" loss.teacher_only=true
$py -m grpo_trainer train "${common[@]}" "output_dir=$out/c_both" "${teach[@]}"
$py - "$out" <<'PY'
import json, sys
from pathlib import Path

print("| run | held-out mean@4 | reward, first 10% -> last 10% of steps | teacher/reverse_kl first -> last | timing/logprobs s/step |")
print("|---|---|---|---|---|")
for run in ("a_grpo", "b_distill", "c_both"):
    records = [json.loads(line) for line in (Path(sys.argv[1]) / run / "metrics.jsonl").read_text().splitlines()]
    k = max(1, len(records) // 10)
    mean = lambda rs, key: sum(r[key] for r in rs) / len(rs)
    evals = {key: v for key, v in records[-1].items() if key.startswith("eval/reward/mean@")}
    kl = (f"{records[0]['teacher/reverse_kl']:.3f} -> {records[-1]['teacher/reverse_kl']:.3f}"
          if "teacher/reverse_kl" in records[0] else "-")
    print(f"| {run} | {', '.join(f'{v:.3f}' for v in evals.values())} | {mean(records[:k], 'reward'):.3f} -> "
          f"{mean(records[-k:], 'reward'):.3f} | {kl} | {mean(records, 'timing/logprobs'):.3f} |")
PY
