"""How well the environments demo's warm-started model (`builtin:tiny-guess`) plays guess-a-number.

    python scripts/tiny_guess_warm_start.py [FOLDER]    # FOLDER: another build of the recipe (default: the shipped one)

Prints, for the warm start: P(midpoint | the range left) and P(a digit 1-8) at the guesses of simulated
games of the mixed policy it was trained on (its target: 0.3875 and 1); and the success rate of games played
against the demo's environment (configs/guess_number_env.py) over the test records, 8 games each, sampled at
temperature 1 as the rollout samples them, and greedily. A plain decode loop: each turn sampled until EOS,
its text given to `step`, the answer appended as the next user message. The numbers it printed are in the
docstring of grpo_trainer/builtin/tiny_guess.py; tests/test_tiny_guess.py runs it on fewer games.
"""

from __future__ import annotations

import importlib.util
import random
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from grpo_trainer.builtin import tiny_guess  # noqa: E402

ENVIRONMENT = ROOT / "configs" / "guess_number_env.py"


def environment_class():
    """configs/guess_number_env.py's GuessNumber, loaded from its file as the trainer loads a user's."""
    spec = importlib.util.spec_from_file_location("guess_number_env", ENVIRONMENT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.GuessNumber


def midpoint_probability(model, tokenizer, games: int = 200, seed: int = 0) -> tuple[float, float]:
    """Mean P(midpoint of the range left) and mean P(any digit 1-8) at the guesses of `games` simulated games."""
    import torch

    rng = random.Random(seed)
    prompt = tiny_guess.prompt_text(tokenizer)
    contexts, midpoints = [], []
    for _ in range(games):
        text = prompt
        for segment, seen in tiny_guess.simulated_game(rng):
            if seen is not None:
                contexts.append(text)
                midpoints.append(tiny_guess.midpoint(*seen))
                segment += tokenizer.eos_token
            text += segment
    digits = tokenizer.convert_tokens_to_ids([str(n) for n in range(tiny_guess.LOW, tiny_guess.HIGH + 1)])
    enc = tokenizer(contexts, return_tensors="pt", padding=True, padding_side="left")
    with torch.no_grad():
        probs = model(**enc).logits[:, -1].float().softmax(-1)
    at_midpoint = probs[torch.arange(len(contexts)), torch.tensor(tokenizer.convert_tokens_to_ids([str(m) for m in midpoints]))]
    return at_midpoint.mean().item(), probs[:, digits].sum(-1).mean().item()


def play(model, tokenizer, records: list[dict], samples: int = 8, seed: int = 0, greedy: bool = False) -> list[dict]:
    """Play `samples` games per record against the demo's environment; one dict per game: `won`, `guesses`,
    `text` (all after the prompt, the environment's turns included)."""
    import torch

    environment = environment_class()
    games = []
    for record in records:
        for _ in range(samples):
            env = environment()
            env.reset(**record)
            games.append({"env": env, "text": "", "done": False})
    prompt = tiny_guess.prompt_text(tokenizer)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        for _ in range(environment.guesses_allowed):
            going = [game for game in games if not game["done"]]
            if not going:
                break
            for game, turn in zip(going, _turns(model, tokenizer, [prompt + g["text"] for g in going], greedy)):
                said, game["done"] = game["env"].step(turn.removesuffix(tokenizer.eos_token))
                game["text"] += turn
                game["done"] = game["done"] or not turn.endswith(tokenizer.eos_token)  # a cut turn ends it
                if not game["done"]:
                    game["text"] += tiny_guess.next_turn_text("user", said)
    return [{"won": g["env"].get_reward() == 1.0, "guesses": g["env"].guesses, "text": g["text"]} for g in games]


def _turns(model, tokenizer, texts: list[str], greedy: bool, max_new_tokens: int = 4) -> list[str]:
    """One turn per text, up to and including its EOS: sampled at temperature 1 (no top-k/top-p), or greedy."""
    import torch

    enc = tokenizer(texts, return_tensors="pt", padding=True, padding_side="left")
    sampling = dict(do_sample=False) if greedy else dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0)
    with torch.no_grad():
        ids = model.generate(**enc, max_new_tokens=max_new_tokens, **sampling)
    out = tokenizer.batch_decode(ids[:, enc["input_ids"].shape[1] :], skip_special_tokens=False)
    eos = tokenizer.eos_token
    return [text.split(eos)[0] + eos if eos in text else text.replace(tokenizer.pad_token, "") for text in out]


def success(results: list[dict]) -> float:
    return sum(r["won"] for r in results) / len(results)


def main() -> None:
    """Build (or reuse) the model and print the warm start's numbers."""
    import time

    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    folder = Path(sys.argv[1]) if len(sys.argv) > 1 else tiny_guess.ensure_model()
    print(f"{folder} ({time.perf_counter() - start:.0f} s)")
    model, tokenizer = AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)
    at_midpoint, at_digits = midpoint_probability(model, tokenizer)
    print(f"P(midpoint | range), mean over the guesses of 200 simulated games: {at_midpoint:.3f} (target 0.3875)")
    print(f"P(a digit 1-8), same guesses: {at_digits:.3f}")
    records = tiny_guess.guess_number_records("test")
    sampled = play(model, tokenizer, records, samples=8)
    print(f"success sampled at temperature 1, {len(sampled)} games ({len(records)} test records x 8): "
          f"{success(sampled):.3f} (the mixed policy: 0.577)")
    print(f"mean guesses: {sum(r['guesses'] for r in sampled) / len(sampled):.2f}")
    print(f"success greedy, {len(records)} games: {success(play(model, tokenizer, records, samples=1, greedy=True)):.3f}")


if __name__ == "__main__":
    main()
