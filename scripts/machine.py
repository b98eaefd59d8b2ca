"""What a performance number holds for: the machine, described and measured, for every script that prints one.

    python scripts/machine.py          # one line and the JSON: CPU, vector units, threads, load, matmul peak, bandwidth

A speed ratio measured on one CPU is a guess on the next (issue 26: the decode loop's weight-stationary
linear doubled the weight-read rate on an AVX-512 Xeon and gained 8% on an AVX2 EPYC). So the bench, the
decode roofline and the docs' tables say which machine they were measured on: its CPU model and flags (and
which vector instruction set ATen used: `ATEN_CPU_CAPABILITY=avx2` runs the AVX2 kernels on an AVX-512 CPU),
the threads, the load average when measured (a shared machine's numbers are only as good as its quiet), and
two measured roofs:

  matmul peak      best float32 `torch.mm` rate over square 512-2048 matrices
  read bandwidth   best `tensor.sum()` rate over a float32 tensor of `bandwidth_bytes` (default 512 MiB,
                   larger than any cache here, so it streams from DRAM)
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

CLOCK = time.perf_counter  # what best_seconds times with; decode_roofline --cpu-time sets time.process_time
VECTOR_FLAGS = ("avx512f", "avx512bw", "avx512_vnni", "avx512_bf16", "amx_bf16", "amx_tile", "avx2", "fma", "avx_vnni")


def best_seconds(fn, reps: int) -> float:
    """The best of `reps` timed calls after one warm-up: on a shared machine, the least disturbed run."""
    fn()
    times = []
    for _ in range(reps):
        start = CLOCK()
        fn()
        times.append(CLOCK() - start)
    return min(times)


def read_bandwidth(n_bytes: int, reps: int = 10) -> float:
    """Bytes per second one `sum()` streams through a float32 tensor of `n_bytes`."""
    import torch

    x = torch.ones(n_bytes // 4)
    return n_bytes / best_seconds(lambda: x.sum(), reps)


def matmul_peak(reps: int = 3) -> float:
    """FLOP/s of the best float32 `torch.mm` over square 512-2048 matrices: the practical compute ceiling."""
    import torch

    best = 0.0
    for n in (512, 1024, 2048):
        a, b = torch.randn(n, n), torch.randn(n, n)
        best = max(best, 2 * n**3 / best_seconds(lambda: torch.mm(a, b), reps))
    return best


def describe(measure: bool = True, bandwidth_bytes: int = 512 * 2**20, reps: int = 10) -> dict:
    """The machine as a dict (JSON-ready); with `measure`, its matmul peak and read bandwidth measured now."""
    import torch

    from grpo_trainer.cpu.machine import cpu_info

    cpu = cpu_info()
    info = {
        "cpu_model": cpu["model"],
        "logical_cpus": cpu["logical_cpus"],
        "vector_flags": [f for f in VECTOR_FLAGS if f in cpu["flags"]],
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "torch_threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "loadavg": [round(x, 2) for x in os.getloadavg()],
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "cpu_flags": cpu["flags"],
    }
    if measure:
        info["matmul_peak_gflop_s"] = round(matmul_peak() / 1e9, 1)
        info["read_bandwidth_gb_s"] = round(read_bandwidth(bandwidth_bytes, reps) / 1e9, 2)
    return info


def one_line(info: dict) -> str:
    """The machine in one line, as the docs' tables name it."""
    parts = [info["cpu_model"], f"{info['logical_cpus']} CPUs",
             f"ATen {info['aten_cpu_capability']} ({', '.join(info['vector_flags']) or 'no AVX'})",
             f"{info['torch_threads']} threads", f"torch {info['torch']}",
             "load " + "/".join(f"{x:.1f}" for x in info["loadavg"])]
    if "matmul_peak_gflop_s" in info:
        parts.append(f"matmul peak {info['matmul_peak_gflop_s']:.0f} GFLOP/s, read {info['read_bandwidth_gb_s']:.1f} GB/s")
    if info.get("gpu"):
        parts.append(info["gpu"])
    return "; ".join(parts)


if __name__ == "__main__":
    machine = describe()
    print(one_line(machine))
    print(json.dumps({k: v for k, v in machine.items() if k != "cpu_flags"}, indent=2))
