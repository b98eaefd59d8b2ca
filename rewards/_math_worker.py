"""Worker process for ``rewards.math_answer``: math-verify on one pair per request.

Started by ``rewards.math_answer._WorkerPool`` as ``python <this file>
<memory_limit_bytes>``; never imported by the trainer. The parent enforces the
per-sample timeout by killing this process, which is why math-verify's own
signal-based timeouts are disabled here (``parsing_timeout=None``,
``timeout_seconds=None``; see ``math_verify/utils.py``: ``signal.alarm`` only
works in the main thread of the main interpreter).

Protocol (one JSON object per line):
  out, once after imports:  {"ready": true}
  in:                        {"gold": str, "pred": str}
  out:                       {"verdict": "match" | "no_match" | "gold_unparseable"}

The protocol goes to a private copy of stdout; fd 1 itself is pointed at
/dev/null so that a stray print in sympy cannot corrupt it. The worker exits
when stdin closes or its parent dies.
"""

import functools
import json
import logging
import os
import resource
import sys
import threading
import time


def _limit_memory(limit_bytes: int) -> None:
    # A huge exact power (10^{10^{10}}) makes sympy allocate without bound;
    # MemoryError is then caught by math-verify and reported as no match.
    if limit_bytes > 0:
        resource.setrlimit(resource.RLIMIT_AS, (limit_bytes, limit_bytes))


def _exit_when_orphaned() -> None:
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def main() -> None:
    protocol = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    _limit_memory(int(sys.argv[1]) if len(sys.argv) > 1 else 0)
    _exit_when_orphaned()

    # math-verify logs whole inputs at WARNING on some paths; the parent owns logging.
    logging.disable(logging.CRITICAL)
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify
    from sympy import Basic, MatrixBase

    # Gold answers: math-verify's defaults. Predictions: the same, but a \boxed{}
    # answer wins over "final answer is ..." anchors (priority 0 = first).
    gold_config = [LatexExtractionConfig(), ExprExtractionConfig()]
    pred_config = [LatexExtractionConfig(boxed_match_priority=0), ExprExtractionConfig()]

    @functools.lru_cache(maxsize=4096)  # the same gold arrives once per generation in a group
    def parse_gold(gold: str):
        return parse(gold, extraction_config=gold_config, parsing_timeout=None)

    def judge(gold: str, pred: str) -> str:
        gold_parsed = parse_gold(gold)
        # A bare-string fallback is not a parsed answer: comparing it would be string equality.
        if not any(isinstance(g, (Basic, MatrixBase)) for g in gold_parsed):
            return "gold_unparseable"
        pred_parsed = parse(pred, extraction_config=pred_config, parsing_timeout=None)
        return "match" if verify(gold_parsed, pred_parsed, timeout_seconds=None) else "no_match"

    protocol.write('{"ready": true}\n')
    for line in sys.stdin:
        request = json.loads(line)
        try:
            verdict = judge(request["gold"], request["pred"])
        except Exception:  # noqa: BLE001 - any failure of the matcher is "no match"
            verdict = "no_match"
        protocol.write(json.dumps({"verdict": verdict}) + "\n")


if __name__ == "__main__":
    main()
