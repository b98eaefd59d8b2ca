"""Throughput of the built-in rewards and the sandbox's per-run overhead.

    python scripts/bench_rewards.py [--workers N] [--quick] [--reps N] [--reference] [--only humaneval]

``PYTHONPATH=DIR`` benchmarks the ``rewards`` package in DIR instead of this
checkout's (an older commit's, say: ``git archive COMMIT rewards | tar -x -C DIR``).

Prints samples/s for math_accuracy (plain-integer fast path and the
math-verify worker path, warm workers) and code_tests (HumanEval-style: 164
correct function-plus-check programs, one sandboxed run each, the median of
``--reps`` passes; MBPP-style: three asserts per sample; APPS-style: three
stdin/stdout pairs), and the median wall time of a trivial sandboxed program
next to a plain ``python -c pass``.
"""

import argparse
import os
import statistics
import subprocess
import sys
import time

sys.path.append(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # after PYTHONPATH
sys.path.append(os.path.dirname(os.path.abspath(__file__)))

from rewards import code_tests, math_accuracy  # noqa: E402
from rewards.sandbox import run_python, sandbox_mode, sandbox_python  # noqa: E402
from sandbox_corpus import humaneval_like  # noqa: E402


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


def bench_humaneval(workers, reps):
    """The issue-16 measure: 164 realistic programs, correct solutions, every one must score 1.0."""
    samples = humaneval_like(164)
    completions = [f"```python\n{solution}\n```" for solution, _, _ in samples]
    tests = [[check] for _, check, _ in samples]
    entry_points = [name for _, _, name in samples]

    def score():
        assert code_tests(None, completions, tests=tests, entry_point=entry_points,
                          max_workers=workers) == [1.0] * len(samples)

    score()  # warm-up: the sandbox's servers start on first use
    rates = [_rate(score, len(samples)) for _ in range(reps)]
    print(f"code_tests, HumanEval-style: {statistics.median(rates):9.1f} samples/s median of {reps} "
          f"(min {min(rates):.1f}, max {max(rates):.1f}; 164 programs, {workers} at a time)")


def bench_minimal_isolation(workers, reps):
    """The reference of issue 16: per program, ``unshare`` (network, PID), ``prlimit``, ``setpriv`` to nobody,
    a fresh ``python3 -I``; no verdict nonce, no read-only mounts, no output cap. Needs root."""
    import tempfile
    from concurrent.futures import ThreadPoolExecutor

    isolate = ["unshare", "--net", "--pid", "--fork", "--kill-child", "prlimit", "--cpu=11", f"--as={2**30}",
               f"--fsize={16 * 2**20}", "--nofile=64", "--nproc=32", "--core=0",
               "setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", sandbox_python(), "-I", "-B"]
    with tempfile.TemporaryDirectory() as folder:
        os.chmod(folder, 0o755)
        paths = []
        for i, (solution, check, name) in enumerate(humaneval_like(164)):
            paths.append(os.path.join(folder, f"p{i}.py"))
            with open(paths[-1], "w") as f:
                f.write(f"{solution}\n{check}\ncheck({name})\n")

        def run_all():
            with ThreadPoolExecutor(workers) as pool:
                codes = list(pool.map(lambda p: subprocess.run(isolate + [p], timeout=10).returncode, paths))
            assert codes == [0] * len(paths), codes

        rates = [_rate(run_all, len(paths)) for _ in range(reps)]
    print(f"  reference, minimal isolation: {statistics.median(rates):6.1f} samples/s median of {reps} "
          f"(unshare + prlimit + setpriv + fresh interpreter per program)")


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
          f"(the sandbox forks a warm interpreter in namespaces mode, so it can be faster)")


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workers", type=int, default=os.cpu_count())
    parser.add_argument("--quick", action="store_true", help="fewer samples")
    parser.add_argument("--reps", type=int, default=5, help="passes over the HumanEval-style programs")
    parser.add_argument("--reference", action="store_true",
                        help="also time the HumanEval-style programs under a minimal isolation (root only)")
    parser.add_argument("--only", choices=["humaneval"], help="only the HumanEval-style code_tests benchmark")
    args = parser.parse_args()
    scale = 1 if args.quick else 4
    reps = 1 if args.quick else args.reps
    checkout = os.path.dirname(os.path.dirname(os.path.abspath(sys.modules["rewards"].__file__)))
    print(f"cpus: {os.cpu_count()}  sandbox mode: {sandbox_mode()}  python: {sys.version.split()[0]}  "
          f"rewards from: {checkout}  load average: {os.getloadavg()[0]:.1f}")
    bench_humaneval(args.workers, reps)
    if args.reference:
        bench_minimal_isolation(args.workers, reps)
    if args.only:
        return
    bench_math(64 * scale, args.workers)
    bench_code(8 * scale, args.workers)
    bench_overhead(10 * scale)


if __name__ == "__main__":
    main()
