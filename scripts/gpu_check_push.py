"""GPU check of the weight push into a vLLM server, on a tied model: vLLM's NCCL backend, or our gloo one.

    python scripts/gpu_check_push.py --backend nccl      # 2+ GPUs: the server on GPU 1, the trainer on GPU 0
    python scripts/gpu_check_push.py --backend gloo      # 1 GPU is enough: server and trainer share GPU 0
    python scripts/gpu_check_push.py --backend gloo --url URL --model PATH   # against a running server (CPU smoke test)

The model is Qwen2.5-0.5B's shape with random weights (gpu_check.py: 24 layers, tied embeddings), in bf16
on a GPU. The server is started with `python -m grpo_trainer serve`. Checked, each against a baseline from
the same run (bf16 kernels differ between vLLM and transformers, so "equal" means: as close as before any
push, and far closer than to the weights replaced):
  1. after pushing the checkpoint's own weights, the server's log-probs match the trainer's (the baseline gap);
  2. after pushing a perturbed model, they match the new weights, not the old;
  3. after changing only the embedding (tied: the head is the same tensor), they match again: the head
     followed (vLLM's own NCCL path has no re-tying step; on CPU the head would stay stale without one).
Prints push times (the first, group set-up included; then the median of --reps) and one RESULT line.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--backend", choices=["nccl", "gloo"], default="nccl")
    parser.add_argument("--url", help="a running server (else one is started)")
    parser.add_argument("--model", help="the model that server serves (else the Qwen2.5-0.5B-shaped one is built)")
    parser.add_argument("--small", action="store_true", help="a tiny shape, for a CPU smoke test")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()

    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from bench_push import model_size_mib, sampler_gap, wait_healthy
    from gpu_check import QWEN25_05B, SMALL, build_model
    from grpo_trainer.config import VLLMServerConfig
    from grpo_trainer.rollout import SamplingSettings
    from grpo_trainer.rollout.vllm_server import VLLMServerEngine

    cuda = torch.cuda.is_available()
    dtype = torch.bfloat16 if cuda else torch.float32
    server = None
    with tempfile.TemporaryDirectory(prefix="gpu-check-push-") as tmp:
        model = args.model
        if model is None:
            model = str(Path(tmp) / "model")
            build_model(Path(model), SMALL if args.small else QWEN25_05B, dtype)
        url = args.url
        log = Path(tmp) / "server.log"
        if url is None:
            port = 8100 + os.getpid() % 800
            url = f"http://127.0.0.1:{port}"
            env = dict(os.environ)
            if cuda:  # NCCL cannot join two ranks on one GPU
                env["CUDA_VISIBLE_DEVICES"] = "1" if args.backend == "nccl" else "0"
            command = [sys.executable, "-m", "grpo_trainer", "serve", "configs/demo_cpu.yaml", f"model.name_or_path={model}",
                       f"model.dtype={'bfloat16' if cuda else 'float32'}", "rollout.engine=vllm_server",
                       f"rollout.vllm_server.weight_sync={args.backend}", "rollout.vllm.max_model_len=1024", "--port", str(port)]
            if cuda:
                command += ["--", "--gpu-memory-utilization", "0.4"]
            server = subprocess.Popen(command, cwd=REPO, env=env, stdout=open(log, "w"), stderr=subprocess.STDOUT,
                                      start_new_session=True)
        try:
            wait_healthy(url, server, log, 900)
            device = "cuda:0" if cuda else "cpu"
            tokenizer = AutoTokenizer.from_pretrained(model)
            lm = AutoModelForCausalLM.from_pretrained(model, dtype=dtype).to(device)
            engine = VLLMServerEngine(SamplingSettings(eos_token_ids=[tokenizer.eos_token_id], max_completion_length=32),
                                      VLLMServerConfig(base_url=url, weight_sync=args.backend, startup_timeout=60), seed=0)
            prompts = [list(range(3 + i, 40 + 7 * i)) for i in range(4)]  # any token ids: the model is random
            pad = tokenizer.pad_token_id or 0

            def gap(reference):
                return sampler_gap(engine.generate(prompts, 4), prompts, reference, pad)[1]  # mean over tokens

            t0 = time.perf_counter()
            engine.sync_weights(lm, version=0)  # the checkpoint's own weights (a --url server may hold others)
            result = {"backend": args.backend, "device": torch.cuda.get_device_name() if cuda else "cpu",
                      "mib": model_size_mib(lm), "first_push_s": time.perf_counter() - t0, "baseline_gap": gap(lm)}
            stale = copy.deepcopy(lm)
            generator = torch.Generator(device=device).manual_seed(0)
            with torch.no_grad():
                for p in lm.parameters():
                    p.add_(torch.randn(p.shape, generator=generator, device=device, dtype=p.dtype) * 0.05 * p.float().std())
            engine.sync_weights(lm, version=1)
            result["gap_new"], result["gap_stale"] = gap(lm), gap(stale)
            stale = copy.deepcopy(lm)
            tied = lm.get_input_embeddings().weight is lm.get_output_embeddings().weight
            with torch.no_grad():
                lm.get_input_embeddings().weight.mul_(1.5)
            engine.sync_weights(lm, version=2)
            result["tied"] = tied
            result["gap_embedding_new"], result["gap_embedding_stale"] = gap(lm), gap(stale)
            times = []
            for rep in range(args.reps):
                t0 = time.perf_counter()
                engine.sync_weights(lm, version=3 + rep)
                times.append(time.perf_counter() - t0)
            result["median_push_s"] = statistics.median(times)
            result["mib_per_s"] = result["mib"] / result["median_push_s"]
            engine.close()
        finally:
            if server is not None:
                os.killpg(server.pid, 15)
                server.wait(60)
    base = max(result["baseline_gap"], 1e-6)
    result["ok"] = bool(result["tied"] and result["gap_new"] <= 2 * base + 1e-3 and result["gap_new"] < 0.25 * result["gap_stale"]
                        and result["gap_embedding_new"] <= 2 * base + 1e-3
                        and result["gap_embedding_new"] < 0.25 * result["gap_embedding_stale"])
    print(json.dumps(result, indent=2))
    print("RESULT " + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in result.items()))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0 if result["ok"] else 1


if __name__ == "__main__":
    sys.exit(main())
