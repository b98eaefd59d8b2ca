"""How often the tool demo's warm-started model (`builtin:tiny-tools`) calls the tool, and how well.

    python scripts/tiny_tools_warm_start.py

Samples 8 conversations for each of the 100 test prompts at temperature 1, as the multi-turn rollout
would (the first turn until EOS; a tool call in it is run and answered, then the final turn), and prints
the probability that the first token starts a tool call, the tool-call rate, how many calls printed the
right product, and the accuracy with, without and overall. The numbers it printed are in the docstring of
grpo_trainer/builtin/tiny_tools.py; tests/test_tiny_tools.py runs it on 16 prompts.

The tool here is a stand-in for the real one (environments/tools.py, which sandboxes): it runs only
`print(<digits and * + - ( )>)`, in this process.
"""

from __future__ import annotations

import contextlib
import io
import json
import re

from grpo_trainer.builtin import tiny_tools

TOOL_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)
BOXED = re.compile(r"\\boxed\{([^{}]*)\}")
SAFE_CODE = re.compile(r"print\([0-9*+\- ()]*\)")  # all the measurement will run: a copy of a product


def run_python_tool(call: str) -> tuple[str, bool]:
    """The tool message for one `<tool_call>` body, and whether it was a well-formed python call.

    For measuring only: it runs nothing but `print(<digits and * + - ( )>)` in-process (no `**`);
    anything else gets an error message back, as a real tool would return one.
    """
    try:
        parsed = json.loads(call)
        code = parsed["arguments"]["code"] if parsed.get("name") == "python" else None
    except (ValueError, TypeError, KeyError, AttributeError):
        return "error: the tool call is not JSON with a name and arguments\n", False
    if not isinstance(code, str) or not SAFE_CODE.fullmatch(code) or "**" in code:
        return "error: not run\n", False
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            exec(code, {"__builtins__": {"print": print}})
    except Exception as exc:  # noqa: BLE001 - the error is the tool's answer
        return f"{type(exc).__name__}: {exc}\n", False
    return out.getvalue(), True


def sample_conversations(model, tokenizer, records: list[dict[str, str]], samples: int = 8, seed: int = 0) -> list[dict]:
    """Sample `samples` conversations per record at temperature 1, as a multi-turn rollout would: the first
    turn until EOS; if it holds `<tool_call>` and ended with EOS, run the call (an unclosed or malformed
    one gets an error message), append the tool's turn and sample the final turn.

    Returns one dict per conversation: `tool` (started a tool call), `tool_ok` (a well-formed call that
    printed the right product), `correct` (the last boxed answer is right), `text` (all after the prompt).
    """
    import torch

    prompts = [tiny_tools.prompt_text(tokenizer, r["prompt"]) for r in records for _ in range(samples)]
    answers = [r["answer"] for r in records for _ in range(samples)]
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        results = [{"text": text, "tool": "<tool_call>" in text} for text in _generate(model, tokenizer, prompts, 96)]
        called = [i for i, r in enumerate(results) if r["tool"] and r["text"].endswith(tokenizer.eos_token)]
        for i in called:
            match = TOOL_CALL.search(results[i]["text"])
            output, ok = run_python_tool(match.group(1)) if match else ("error: the tool call is not closed\n", False)
            results[i]["tool_ok"] = ok and output.strip() == answers[i]
            results[i]["text"] += tiny_tools.tool_turn_text(output)
        finals = _generate(model, tokenizer, [prompts[i] + results[i]["text"] for i in called], 24)
        for i, final in zip(called, finals):
            results[i]["text"] += final
    for result, answer in zip(results, answers):
        boxed = BOXED.findall(result["text"])
        result["correct"] = bool(boxed) and boxed[-1].strip() == answer
        result.setdefault("tool_ok", False)
    return results


def _generate(model, tokenizer, texts: list[str], max_new_tokens: int, batch_size: int = 256) -> list[str]:
    """One sampled turn per text (temperature 1, no top-k/top-p), up to and including its EOS."""
    import torch

    out = []
    for start in range(0, len(texts), batch_size):
        enc = tokenizer(texts[start : start + batch_size], return_tensors="pt", padding=True, padding_side="left")
        with torch.no_grad():
            ids = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
        out += tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=False)
    return [text.split(tokenizer.eos_token)[0] + tokenizer.eos_token if tokenizer.eos_token in text else text for text in out]


def tool_call_probability(model, tokenizer, records: list[dict[str, str]]) -> list[float]:
    """For each record, the model's probability that its first turn starts a tool call (`<`)."""
    import torch

    enc = tokenizer([tiny_tools.prompt_text(tokenizer, r["prompt"]) for r in records], return_tensors="pt", padding=True,
                    padding_side="left")
    with torch.no_grad():
        logits = model(**enc).logits[:, -1].float()
    return logits.softmax(-1)[:, tokenizer.convert_tokens_to_ids("<")].tolist()


def summarize(results: list[dict]) -> dict[str, float]:
    """Tool-call rate, share of calls that printed the right product, and accuracies with, without, overall."""
    def share(items, key):
        return sum(r[key] for r in items) / len(items) if items else float("nan")

    tool = [r for r in results if r["tool"]]
    guess = [r for r in results if not r["tool"]]
    return {
        "tool_call_rate": len(tool) / len(results),
        "tool_call_ok": share(tool, "tool_ok"),
        "accuracy_with_tool": share(tool, "correct"),
        "accuracy_without_tool": share(guess, "correct"),
        "accuracy": share(results, "correct"),
    }


def main() -> None:
    """Build (or reuse) the model and print the warm start's numbers."""
    import time

    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    folder = tiny_tools.ensure_model()
    print(f"{folder} ({time.perf_counter() - start:.0f} s)")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    probability = tool_call_probability(model, tokenizer, tiny_tools.multiplication_records("test"))
    print(f"P(first token starts a tool call), mean over the test prompts: {sum(probability) / len(probability):.3f}")
    for name, value in summarize(sample_conversations(model, tokenizer, tiny_tools.multiplication_records("test"))).items():
        print(f"{name}: {value:.3f}")


if __name__ == "__main__":
    main()
