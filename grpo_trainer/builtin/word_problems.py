"""`builtin:word_problems`: short arithmetic word problems with a whole-number answer, written by this project.

One operation each (addition, subtraction, or a small multiplication), in a dozen everyday phrasings, so
that a 135M-parameter instruct model gets some right from the start and can get better with RL in minutes
on a CPU. Generated deterministically from a fixed seed: 400 `train` and 100 `test` problems, no problem
text in both. Graded by `math_accuracy` against the `answer` column.
"""

from __future__ import annotations

import random

SPLIT_SIZES = {"train": 400, "test": 100}
SEED = 2026

NAMES = ["Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Gus", "Hana", "Ivan", "Jo", "Kofi", "Lena", "Mo", "Nia"]
ITEMS = ["apples", "marbles", "stickers", "books", "coins", "pencils", "cookies", "shells", "stamps", "cards"]

# (template, operation); {n} a name, {i} an item, {a} and {b} the numbers.
TEMPLATES = [
    ("{n} has {a} {i}. {n} gets {b} more. How many {i} does {n} have now?", "+"),
    ("{n} read {a} pages on Monday and {b} pages on Tuesday. How many pages did {n} read in total?", "+"),
    ("A shop sold {a} {i} in the morning and {b} {i} in the afternoon. How many {i} did it sell that day?", "+"),
    ("There are {a} {i} in a box and {n} puts in {b} more. How many {i} are in the box?", "+"),
    ("{n} had {a} {i} and gave {b} of them to a friend. How many {i} does {n} have left?", "-"),
    ("A jar holds {a} {i}. {n} takes out {b}. How many {i} are still in the jar?", "-"),
    ("{n} needs {a} {i} and already has {b}. How many more {i} does {n} need?", "-"),
    ("A bus has {a} people on it. At the stop, {b} people get off. How many people are on the bus now?", "-"),
    ("There are {a} bags with {b} {i} in each bag. How many {i} are there altogether?", "*"),
    ("{n} buys {a} packs of {i}, and each pack has {b} {i}. How many {i} does {n} buy?", "*"),
    ("A class has {a} rows of desks with {b} desks in each row. How many desks are there?", "*"),
    ("{n} saves {b} coins every day for {a} days. How many coins does {n} save?", "*"),
]


def word_problem_records(split: str = "train") -> list[dict[str, str]]:
    """The split's problems as records with `prompt` and `answer` (a whole number, as text)."""
    if split not in SPLIT_SIZES:
        raise ValueError(f"data.split: the built-in word_problems task has splits 'train' and 'test', not {split!r}")
    rng = random.Random(SEED)
    seen: set[str] = set()
    problems: list[dict[str, str]] = []
    while len(problems) < sum(SPLIT_SIZES.values()):
        template, op = rng.choice(TEMPLATES)
        if op == "+":
            a, b = rng.randint(2, 40), rng.randint(2, 40)
        elif op == "-":
            a = rng.randint(10, 50)
            b = rng.randint(1, a - 1)
        else:
            a, b = rng.randint(2, 9), rng.randint(2, 9)
        prompt = template.format(n=rng.choice(NAMES), i=rng.choice(ITEMS), a=a, b=b)
        if prompt in seen:
            continue
        seen.add(prompt)
        answer = a + b if op == "+" else a - b if op == "-" else a * b
        problems.append({"prompt": prompt, "answer": str(answer)})
    start = 0 if split == "train" else SPLIT_SIZES["train"]
    return problems[start : start + SPLIT_SIZES[split]]
