"""Throughput of the built-in rewards and the sandbox's per-run overhead.

    python scripts/bench_rewards.py [--workers N] [--quick]

Prints samples/s for math_accuracy (plain-integer fast path and the
math-verify worker path, warm workers) and code_tests (MBPP-style: three
asserts per sample; APPS-style: three stdin/stdout pairs), and the median
wall time of a trivial sandboxed program next to a plain ``python -c pass``.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from rewards import code_tests, math_accuracy  # noqa: E402
from rewards.sandbox import run_python, sandbox_mode, sandbox_python  # noqa: E402


def _rate(fn, n):
    start = time.perf_counter()
    fn()
    return n / (time.perf_counter() - start)


def bench_math(n, workers):
    fast = (["The answer is \\boxed{42}."] * (n // 2) + ["\\boxed{41}"] * (n // 2), ["42"] * n)
    latex = (["So we get \\boxed{\\frac{\\sqrt{2}}{2}}."] * (n // 2) + ["\\boxed{0.5\\%}"] * (n // 2),
             ["\\frac{1}{\\sqrt{2}}"] * n)
    math_accuracy(None, latex[0][:workers * 2], answer=latex[1][:workers * 2], max_workers=workers)  # warm-up
    print(f"math_accuracy fast path:     {_rate(lambda: math_accuracy(None, fast[0], answer=fast[1]), n):9.0f} samples/s")
    rate = _rate(lambda: math_accuracy(None, latex[0], answer=latex[1], max_workers=workers), n)
    print(f"math_accuracy math-verify:   {rate:9.0f} samples/s  ({workers} workers)")


def bench_code(n, workers):
    solution = "```python\ndef add(a, b):\n    return a + b\n```"
    asserts = ["assert add(1, 2) == 3", "assert add(0, 0) == 0", "assert add(2, 2) == 4"]
    rate = _rate(lambda: code_tests(None, [solution] * n, tests=[asserts] * n, max_workers=workers), n)
    print(f"code_tests, 3 asserts each:  {rate:9.1f} samples/s  ({3 * rate:.1f} sandboxed runs/s, {workers} at a time)")
    program = "```python\nprint(int(input()) * 2)\n```"
    io = {"inputs": ["1\n", "2\n", "3\n"], "outputs": ["2\n", "4\n", "6\n"]}
    rate = _rate(lambda: code_tests(None, [program] * n, tests=[io] * n, max_workers=workers), n)
    print(f"code_tests, 3 stdin/stdout:  {rate:9.1f} samples/s")


def bench_overhead(runs):
    sandboxed, plain = [], []
    python = sandbox_python()
    for _ in range(runs):
        start = time.perf_counter()
        assert run_python("pass").completed
        sandboxed.append(time.perf_counter() - start)
        start = time.perf_counter()
        subprocess.run([python, "-c", "pass"], check=True)
        plain.append(time.perf_counter() - start)
    s, p = statistics.median(sandboxed) * 1000, statistics.median(plain) * 1000
    print(f"sandbox run of 'pass':       {s:9.1f} ms median  vs  plain `{python} -c pass`: {p:.1f} ms "
          f"(overhead {s - p:.1f} ms)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    args = parser.parse_args()
    scale = 1 if args.quick else 4
    print(f"cpus: {os.cpu_count()}  sandbox mode: {sandbox_mode()}  python: {sys.version.split()[0]}")
    bench_math(64 * scale, args.workers)
    bench_code(8 * scale, args.workers)
    bench_overhead(10 * scale)


if __name__ == "__main__":
    main()
