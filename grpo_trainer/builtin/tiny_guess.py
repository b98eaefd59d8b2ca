r"""`builtin:tiny-guess` and `builtin:guess_number`: a tiny model that plays guess-a-number, half well.

The demo for environments (configs/guess_cpu.yaml with configs/guess_number_env.py): the
environment thinks of a number from 1 to 8 and answers each plain reply of the model with higher or lower
and the range left, for up to four guesses; it scores 1 if the number was found. A conversation:

    <|im_start|>user\nGuess my number, 1-8<|im_end|>\n<|im_start|>assistant\n      (prompt: 39 tokens)
    4<|im_end|>                                                                     (model: 2 tokens)
    \n<|im_start|>user\nhigher, 5-8<|im_end|>\n<|im_start|>assistant\n                (environment: 30-31)
    6<|im_end|>                                                                     (model)
    ...

Every text the model reads ends in the range left ("1-8", "5-8"), so the two digits it needs stand at the
same distance back from the position that answers, on every turn. Guessing the midpoint of the range
(rounded down) always wins within four guesses; guessing uniformly from 1 to 8 wins 0.41 of the time. The
warm start mixes the two: at every turn the midpoint with probability MIDPOINT_SHARE (0.3), else a
uniform guess (which is the midpoint one time in 8), so P(midpoint | range) = 0.3875 and the success rate
is 0.577 (simulated, 200,000 games). Every turn is a decision GRPO can credit, and the ceiling is 1.0.

The task's records carry the secret (`{"prompt": "Guess my number, 1-8", "secret": 5}`; 400 train and 96
test records, each secret equally often), which the environment's `reset(**row)` reads: a group's G
episodes play the same number. There are only 8 games, so the test split is "held out" in its rows only;
it measures the policy on a fixed, balanced set of games.

The model is charlm.py's family with tiny_tools.py's shape (0.31M parameters: 312,704; hidden 128, 4 heads
of 32 for vLLM's CPU attention, q/k/v/o biases, RoPE theta 100), the plain ChatML template. Layer 0's
first two heads start out looking back at the range's two digits (tiny_tools.init_copying_heads). The warm
start trains on simulated games of the mixed policy, loss on the model's tokens only (the digit and its
EOS); at a digit the target is the mixed policy's whole distribution over 1-8 rather than the one guess
sampled, so the model learns P(midpoint | range) itself, not a noisy estimate of it.

Measured (`python scripts/tiny_guess_warm_start.py`; 2-core Intel Xeon, AVX-512):

    build (300 steps of 48 games)               18.5 min on 2 threads under other sessions' load (load average
                                                5-10; canonical: AVX2 kernels, MKL's SSE2 branch); 4.5 min
                                                non-canonically. Shipped, so done once (build.py)
    P(midpoint | range) at the guesses of       0.380 (target 0.3875)
    200 simulated games of the mixed policy
    P(a digit 1-8), same guesses                0.998
    success, 96 test records x 8, sampled       0.608 (the mixed policy: 0.577), 3.08 guesses per game
    at temperature 1
    success, greedy                             1.000 (the midpoint is always its likeliest guess)
"""

from __future__ import annotations

import random
from pathlib import Path

from .build import assembled_from_shipped_weights, load_weights
from .charlm import build_char_model, build_tokenizer, next_turn_text
from .tiny_tools import ROPE_THETA, SHAPE, init_copying_heads

NAME = "tiny-guess"
# Bump when the recipe below changes, so stale caches are not reused.
VERSION = 1
FOLDER = f"{NAME}-v{VERSION}"  # its folder in the cache, and the name of its shipped weights
PROMPT = "Guess my number, 1-8"
LOW, HIGH, GUESSES = 1, 8, 4  # the game configs/guess_number_env.py plays
MIDPOINT_SHARE = 0.3  # share of warm-start turns that take the midpoint on purpose (see the module docstring)
SFT_STEPS = 300
SPLIT_SIZES = {"train": 400, "test": 96}  # multiples of 8: each secret equally often
SEED = 8642


# ----------------------------------------------------------------------------- the task


def guess_number_records(split: str = "train") -> list[dict]:
    """The game's records: the same prompt, a secret from 1 to 8, each secret equally often (fixed order)."""
    if split not in SPLIT_SIZES:
        raise ValueError(f"data.split: the built-in guess_number task has splits 'train' and 'test', not {split!r}")
    secrets = [LOW + i % (HIGH - LOW + 1) for i in range(SPLIT_SIZES[split])]
    random.Random(f"{SEED}-{split}").shuffle(secrets)
    return [{"prompt": PROMPT, "secret": secret} for secret in secrets]


def midpoint(low: int, high: int) -> int:
    return (low + high) // 2


def mixed_policy(low: int, high: int) -> dict[int, float]:
    """The warm start's target: P(guess | the range left), the midpoint on purpose MIDPOINT_SHARE of the time."""
    uniform = (1 - MIDPOINT_SHARE) / (HIGH - LOW + 1)
    return {n: uniform + (MIDPOINT_SHARE if n == midpoint(low, high) else 0.0) for n in range(LOW, HIGH + 1)}


def feedback(secret: int, low: int, high: int, guess: int) -> tuple[str, int, int]:
    """What the game says to a guess, and the range left: "yes", "higher, 5-8" or "lower, 1-3"."""
    if guess == secret:
        return "yes", guess, guess
    if guess < secret:
        low = max(low, guess + 1)
    else:
        high = min(high, guess - 1)
    return f"{'higher' if guess < secret else 'lower'}, {low}-{high}", low, high


# ----------------------------------------------------------------------------- building


def ensure_model() -> Path:
    """The model's folder, assembled from the shipped weights first if this machine has none (build.py)."""
    return assembled_from_shipped_weights(FOLDER, build_model)


def build_model(folder: Path, sft_steps: int = SFT_STEPS, seed: int = 0, weights: Path | None = None) -> None:
    """Build tokenizer and model into `folder`: copying heads at init, then the supervised warm start, or,
    given `weights` (what this recipe's canonical build saved: build.shipped_weights), those loaded instead."""
    tokenizer = build_tokenizer()

    def warm_start(model) -> None:
        init_copying_heads(model, _range_offsets(tokenizer))
        _supervised_warm_start(model, tokenizer, steps=sft_steps, seed=seed)

    build_char_model(
        folder,
        tokenizer,
        SHAPE,
        seed,
        load_weights(weights) if weights is not None else warm_start,
        rope_theta=ROPE_THETA,
    )


def prompt_text(tokenizer) -> str:
    """The game's prompt, as the trainer renders it."""
    return tokenizer.apply_chat_template(
        [{"role": "user", "content": PROMPT}], add_generation_prompt=True, tokenize=False
    )


def simulated_game(rng: random.Random) -> list[tuple[str, tuple[int, int] | None]]:
    """One game of the mixed policy as text segments after the prompt, each with the range the model saw
    before it when the segment is the model's guess (trained on), or None for the environment's turns."""
    secret, low, high = rng.randint(LOW, HIGH), LOW, HIGH
    segments: list[tuple[str, tuple[int, int] | None]] = []
    for turn in range(GUESSES):
        guess = midpoint(low, high) if rng.random() < MIDPOINT_SHARE else rng.randint(LOW, HIGH)
        segments.append((str(guess), (low, high)))
        said, low, high = feedback(secret, low, high, guess)
        if said == "yes" or turn == GUESSES - 1:
            break
        segments.append((next_turn_text("user", said), None))
    return segments


def _range_offsets(tokenizer) -> list[int]:
    """How far back the range's low and high digits stand from the position that predicts the guess (the
    same after the prompt and after every environment turn: both end in the range)."""
    ids = tokenizer(prompt_text(tokenizer), add_special_tokens=False)["input_ids"]
    tokens = tokenizer.convert_ids_to_tokens(ids)
    digits = [i for i, token in enumerate(tokens) if token.isdigit()]
    answer = len(tokens) - 1
    return [answer - digits[-2], answer - digits[-1]]


def _game_ids(tokenizer, prompt: str, game, eos: int) -> tuple[list[int], list[int], list[tuple[int, int, int]]]:
    """Token ids of a game, hard labels (-100 but on each guess's EOS) and, for each guess, (position of the
    digit, low, high): its target is the mixed policy's distribution, not the digit sampled."""
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    labels = [-100] * len(ids)
    guesses = []
    for text, seen in game:
        piece = tokenizer(text, add_special_tokens=False)["input_ids"]
        if seen is None:
            ids += piece
            labels += [-100] * len(piece)
        else:
            guesses.append((len(ids), *seen))
            ids += piece + [eos]
            labels += [-100] * len(piece) + [eos]
    return ids, labels, guesses


def _supervised_warm_start(model, tokenizer, steps: int, seed: int, batch: int = 48, lr: float = 3e-3) -> None:
    """Next-token training on the model's tokens of simulated games: cross-entropy against the EOS after each
    guess and against the mixed policy's distribution at each guess (the digits 1-8 it spreads over)."""
    import math

    import torch

    rng = random.Random(seed)
    prompt = prompt_text(tokenizer)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    digit_ids = torch.tensor(tokenizer.convert_tokens_to_ids([str(n) for n in range(LOW, HIGH + 1)]))
    targets = {
        (low, high): torch.tensor(list(mixed_policy(low, high).values()))
        for low in range(LOW, HIGH + 1)
        for high in range(low, HIGH + 1)
    }
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.0)
    warmup = max(1, steps // 20)
    schedule = torch.optim.lr_scheduler.LambdaLR(  # linear warm-up, cosine down to a tenth
        optimizer, lambda s: min(1.0, (s + 1) / warmup) * (0.1 + 0.45 * (1 + math.cos(math.pi * s / max(steps, 1))))
    )
    model.train()
    for _ in range(steps):
        rows = [_game_ids(tokenizer, prompt, simulated_game(rng), eos) for _ in range(batch)]
        width = max(len(ids) for ids, _, _ in rows)
        ids = torch.tensor([r + [pad] * (width - len(r)) for r, _, _ in rows])
        labels = torch.tensor([r + [-100] * (width - len(r)) for _, r, _ in rows])
        log_probs = model(input_ids=ids, attention_mask=(ids != pad).long()).logits[:, :-1].float().log_softmax(-1)
        hard = torch.nn.functional.nll_loss(
            log_probs.reshape(-1, log_probs.shape[-1]), labels[:, 1:].reshape(-1), ignore_index=-100, reduction="sum"
        )
        where = [(row, position - 1) for row, (_, _, guesses) in enumerate(rows) for position, _, _ in guesses]
        soft_targets = torch.stack([targets[(low, high)] for _, _, guesses in rows for _, low, high in guesses])
        at_guesses = log_probs[[r for r, _ in where], [p for _, p in where]][:, digit_ids]
        soft = -(soft_targets * at_guesses).sum()
        count = int((labels != -100).sum()) + len(where)
        ((hard + soft) / count).backward()
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
