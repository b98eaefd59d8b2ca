"""``math_accuracy``: 1.0 if the completion's final answer equals the gold answer.

How an answer is found
  The completion's answer is the content of its last ``\\boxed{...}`` (or
  ``\\fbox{...}``); without one, math-verify's own extraction runs on the
  last ``_PREDICTION_TAIL_CHARS`` characters (``final answer is ...``
  anchors, then the last LaTeX or plain expression). The gold answer is the
  dataset column ``answer_column``; a bare gold such as ``\\frac12`` is wrapped
  in ``\\boxed{}`` so math-verify reads it as one expression (``1,2`` is then
  the set {1, 2}, not the decimal 1.2).

How answers are compared
  1. Fast path, in this process: if the gold and the boxed answer (or the whole
     completion) are both plain numbers such as ``8``, ``-3.50`` or ``1,000``,
     equal values match and unequal integers do not. Nothing else is decided
     here, so the fast path cannot disagree with math-verify.
  2. Everything else goes to math-verify (``parse`` + ``verify``) in a small
     pool of worker processes (``_math_worker.py``): LaTeX, fractions,
     percentages, sets, intervals, units, matrices, equations, as math-verify
     allows. math-verify's signal-based timeouts are disabled there; ours is
     enforced from outside by killing the worker, so it works from any thread,
     and the pool respawns the worker.

Outcomes
  match 1.0; no match, timeout, or worker crash 0.0; gold that math-verify
  cannot parse into an expression ``None`` (no opinion). Per call it reports
  ``gold_unparseable``, ``timeouts`` and ``fast_path`` (count of samples
  decided without math-verify) through ``log_metric``.

Not done: the worker runs sympy on model output with the trainer's rights and
is not a sandbox (sympy's ``parse_expr`` evaluates Python); math-verify only
reaches it through its own restrictive regexes. Its address space is capped
(``memory_limit_mb``) and it is killed after ``timeout`` seconds.
"""

from __future__ import annotations

import atexit
import json
import logging
import os
import re
import selectors
import subprocess
import sys
import threading
import time
from decimal import Decimal
from typing import Any

from ._completions import MetricLogger, completion_text, report, shorten

logger = logging.getLogger(__name__)

# Answers sit at the end of a completion; math-verify only sees this much of an
# unboxed one, which bounds its regex work on adversarial megabyte outputs.
_PREDICTION_TAIL_CHARS = 8000
_WORKER_SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_math_worker.py")
_WORKER_STARTUP_TIMEOUT_S = 120.0  # importing sympy on a loaded machine; not charged to samples

_PLAIN_NUMBER = re.compile(r"[-+]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?")
_LATEX_THOUSANDS = re.compile(r"(?<=\d)(?:\{,\}|\\,|\\!|\\ )(?=\d{3}(?!\d))")
_BOX_COMMANDS = ("\\boxed", "\\fbox")
_MATH_DELIMITER = re.compile(r"(?<!\\)\$|\\boxed|\\fbox|\\\(|\\\[")  # an unescaped $, a box, \( or \[


# ---------------------------------------------------------------- extraction


def last_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}`` (braces balanced), or None.

    Also accepts ``\\boxed 5`` (a space and one token), which models write.
    """
    start, command = max((text.rfind(cmd), cmd) for cmd in _BOX_COMMANDS)
    if start < 0:
        return None
    rest = text[start + len(command) :]
    if rest.startswith(" "):
        token = rest.strip().split(maxsplit=1)
        return token[0].rstrip("$.") if token else None
    if not rest.startswith("{"):
        return None
    depth = 0
    for i, ch in enumerate(rest):
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return rest[1:i]
    return None  # unbalanced: the completion was cut off inside the box


def _strip_math_delimiters(answer: str) -> str:
    answer = answer.strip()
    for left, right in (("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if answer.startswith(left) and answer.endswith(right) and len(answer) >= len(left) + len(right):
            answer = answer[len(left) : len(answer) - len(right)].strip()
    return answer


def _normalize_thousands(answer: str) -> str:
    """``1{,}000`` and ``1\\,000`` -> ``1,000``; math-verify reads ``1\\,000`` as 1*0."""
    return _LATEX_THOUSANDS.sub(",", answer)


def plain_number(answer: str) -> Decimal | None:
    """The value of an answer that is just a number (``-3.5``, ``1,000``, ``$8$``), else None."""
    answer = _normalize_thousands(_strip_math_delimiters(answer)).rstrip(".").strip()
    if not _PLAIN_NUMBER.fullmatch(answer):
        return None
    return Decimal(answer.replace(",", ""))


def _fast_verdict(gold: str, prediction: str) -> str | None:
    """Decide a pair without math-verify when that is certainly what it would say.

    ``prediction`` is the boxed content or, without a box, the whole completion.
    """
    gold_value, pred_value = plain_number(gold), plain_number(prediction)
    if gold_value is None or pred_value is None:
        return None
    if gold_value == pred_value:
        return "match"
    both_integers = "." not in gold and "." not in prediction
    # Unequal decimals go to math-verify, which compares them after rounding.
    return "no_match" if both_integers else None


def _gold_for_math_verify(gold: str) -> str:
    gold = gold.strip()
    if _MATH_DELIMITER.search(gold):  # already written as LaTeX math: let math-verify find it
        return gold
    return "\\boxed{" + _normalize_thousands(gold) + "}"


def _prediction_for_math_verify(text: str, boxed: str | None) -> str:
    if boxed is not None:
        return "\\boxed{" + _normalize_thousands(boxed) + "}"
    return text[-_PREDICTION_TAIL_CHARS:]


# ---------------------------------------------------------------- worker pool


class _Worker:
    """One ``_math_worker.py`` process and the partial line read from it."""

    def __init__(self, memory_limit_bytes: int) -> None:
        self.process = subprocess.Popen(
            # Run by path: sys.path[0] becomes rewards/, whose module names shadow nothing.
            [sys.executable, _WORKER_SCRIPT, str(memory_limit_bytes)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            close_fds=True,
        )
        assert self.process.stdin is not None and self.process.stdout is not None  # both PIPE
        self.stdin, self.stdout = self.process.stdin, self.process.stdout
        os.set_blocking(self.stdout.fileno(), False)
        self.started_at = time.monotonic()
        self.ready = False
        self.job: int | None = None  # index of the pair it is judging
        self.deadline = 0.0
        self._buffer = b""

    def send(self, job: int, gold: str, pred: str, timeout: float) -> None:
        self.job, self.deadline = job, time.monotonic() + timeout
        self.stdin.write(json.dumps({"gold": gold, "pred": pred}).encode() + b"\n")
        self.stdin.flush()

    def read_lines(self) -> list[dict] | None:
        """Complete protocol lines available now; None if the worker has exited."""
        try:
            chunk = os.read(self.stdout.fileno(), 1 << 16)
        except BlockingIOError:
            return []
        if not chunk:
            return None
        self._buffer += chunk
        *lines, self._buffer = self._buffer.split(b"\n")
        return [json.loads(line) for line in lines if line]

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
        self.process.wait()
        for stream in (self.stdin, self.stdout):
            try:
                stream.close()
            except OSError:
                pass


class _WorkerPool:
    """Persistent math-verify workers; a worker that overruns a sample is killed and replaced.

    ``judge`` is serialised by a lock, so the pool can be shared by threads;
    a process that forked after the pool started gets a pool of its own
    (see ``_pool_for``).
    """

    def __init__(self, size: int, memory_limit_bytes: int) -> None:
        self.size = size
        self.memory_limit_bytes = memory_limit_bytes
        self.workers: list[_Worker] = []
        self.lock = threading.Lock()

    def judge(self, pairs: list[tuple[str, str]], timeout: float) -> list[str]:
        """Verdicts for (gold, pred) pairs: match / no_match / gold_unparseable / timeout / crashed."""
        with self.lock:
            return self._judge(pairs, timeout)

    def _judge(self, pairs: list[tuple[str, str]], timeout: float) -> list[str]:
        verdicts: list[str | None] = [None] * len(pairs)
        queue = list(range(len(pairs)))[::-1]  # pop() takes from the front of the batch
        wanted = max(1, min(self.size, len(pairs)))
        self.workers = [w for w in self.workers if w.process.poll() is None]
        while len(self.workers) < wanted:
            self.workers.append(_Worker(self.memory_limit_bytes))

        def replace(worker: _Worker) -> None:
            worker.kill()
            self.workers[self.workers.index(worker)] = _Worker(self.memory_limit_bytes)

        while queue or any(w.job is not None for w in self.workers):
            for worker in self.workers:
                if worker.ready and worker.job is None and queue:
                    job = queue.pop()
                    try:
                        worker.send(job, *pairs[job], timeout)
                    except (BrokenPipeError, OSError):
                        verdicts[job] = "crashed"
                        worker.job = None
                        replace(worker)

            now = time.monotonic()
            deadlines = [w.deadline for w in self.workers if w.job is not None]
            deadlines += [w.started_at + _WORKER_STARTUP_TIMEOUT_S for w in self.workers if not w.ready]
            wait_s = max(0.0, min(deadlines, default=now + 1.0) - now)
            with selectors.DefaultSelector() as selector:
                for worker in self.workers:
                    selector.register(worker.stdout, selectors.EVENT_READ, worker)
                events = selector.select(timeout=wait_s)

            for key, _ in events:
                worker = key.data  # a _Worker
                lines = worker.read_lines()
                if lines is None:  # exited: killed by its memory limit, or a bug
                    if worker.job is not None:
                        verdicts[worker.job] = "crashed"
                        worker.job = None
                    if not worker.ready:  # cannot import math-verify, or memory_limit_mb too low
                        raise RuntimeError(f"math-verify worker exited during startup: {_WORKER_SCRIPT}")
                    replace(worker)
                    continue
                for message in lines:
                    if message.get("ready"):
                        worker.ready = True
                    elif worker.job is not None:
                        verdicts[worker.job] = message["verdict"]
                        worker.job = None

            now = time.monotonic()
            for worker in list(self.workers):
                if worker.job is not None and now >= worker.deadline:
                    verdicts[worker.job] = "timeout"
                    worker.job = None
                    replace(worker)
                elif not worker.ready and now - worker.started_at >= _WORKER_STARTUP_TIMEOUT_S:
                    raise RuntimeError(f"math-verify worker did not start within {_WORKER_STARTUP_TIMEOUT_S:.0f}s")
        return [v or "crashed" for v in verdicts]

    def close(self) -> None:
        with self.lock:
            for worker in self.workers:
                worker.kill()
            self.workers = []


_pool: _WorkerPool | None = None
_pool_owner_pid = -1
_pool_lock = threading.Lock()


def _pool_for(size: int, memory_limit_bytes: int) -> _WorkerPool:
    """The process-wide pool, started on first use (never at import)."""
    global _pool, _pool_owner_pid
    with _pool_lock:
        if _pool is None or _pool_owner_pid != os.getpid():
            # After a fork the inherited pipes belong to the parent's pool: start fresh.
            _pool = _WorkerPool(size, memory_limit_bytes)
            _pool_owner_pid = os.getpid()
        _pool.size = size
        _pool.memory_limit_bytes = memory_limit_bytes
        return _pool


@atexit.register
def shutdown_workers() -> None:
    """Kill the worker processes (also runs at interpreter exit)."""
    if _pool is not None and _pool_owner_pid == os.getpid():
        _pool.close()


# ---------------------------------------------------------------- the reward


def math_accuracy(
    prompts: Any,
    completions: list,
    completion_ids: Any = None,
    *,
    answer_column: str = "answer",
    timeout: float = 5.0,
    max_workers: int | None = None,
    memory_limit_mb: int = 4096,
    log_metric: MetricLogger = None,
    **kwargs: Any,
) -> list[float | None]:
    """1.0 if a completion's final answer equals the gold answer, else 0.0; None if the gold is unparseable.

    Args:
        answer_column: dataset column with the gold answers (arrives as a keyword list).
        timeout: seconds math-verify may spend on one sample before it counts as wrong.
        max_workers: math-verify worker processes (default: number of CPUs, at most 8).
        memory_limit_mb: address-space limit of each worker.
        log_metric: ``callable(name, value)`` from the trainer, for ``gold_unparseable``,
            ``timeouts`` and ``fast_path`` counts.
    """
    if answer_column not in kwargs:
        raise KeyError(
            f"math_accuracy needs the dataset column {answer_column!r}; "
            f"got columns {sorted(k for k in kwargs if k != 'log_metric')} "
            "(set the reward kwarg answer_column)"
        )
    golds = kwargs[answer_column]
    rewards: list[float | None] = [None] * len(completions)
    slow: list[int] = []
    slow_pairs: list[tuple[str, str]] = []
    texts: list[str] = []
    unparseable = fast = 0

    for i, (completion, gold) in enumerate(zip(completions, golds)):
        text = completion_text(completion)
        texts.append(text)
        gold = "" if gold is None else str(gold)
        if not gold.strip():
            unparseable += 1
            continue
        boxed = last_boxed(text)
        verdict = _fast_verdict(gold, boxed if boxed is not None else text)
        if verdict is not None:
            fast += 1
            rewards[i] = 1.0 if verdict == "match" else 0.0
            continue
        slow.append(i)
        slow_pairs.append((_gold_for_math_verify(gold), _prediction_for_math_verify(text, boxed)))

    timeouts: list[int] = []
    if slow_pairs:
        workers = max_workers or min(os.cpu_count() or 1, 8)
        pool = _pool_for(workers, memory_limit_mb * 2**20)
        for i, verdict in zip(slow, pool.judge(slow_pairs, timeout)):
            if verdict == "gold_unparseable":
                unparseable += 1
                rewards[i] = None
            else:
                rewards[i] = 1.0 if verdict == "match" else 0.0
                if verdict == "timeout":
                    timeouts.append(i)

    if timeouts:
        logger.warning(
            "math_accuracy: %d of %d samples exceeded %.1fs and scored 0; first: %r",
            len(timeouts),
            len(completions),
            timeout,
            shorten(texts[timeouts[0]]),
        )
    report(log_metric, "gold_unparseable", unparseable)
    report(log_metric, "timeouts", len(timeouts))
    report(log_metric, "fast_path", fast)
    return rewards
