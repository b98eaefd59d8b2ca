"""The environments demo: the guess-a-number environment (configs/guess_number_env.py), the built-in task and
warm-started model that play it (grpo_trainer/builtin/tiny_guess.py), and the script that measures the warm start
(scripts/tiny_guess_warm_start.py). The recipe's weights are checked with the other tiny models' (test_tiny.py)."""

from __future__ import annotations

import itertools
import random

import pytest

from grpo_trainer.builtin import tiny_guess
from grpo_trainer.builtin.tiny_guess import PROMPT, guess_number_records
from helpers import ROOT, load_script

PROMPT_TEXT = "<|im_start|>user\nGuess my number, 1-8<|im_end|>\n<|im_start|>assistant\n"


@pytest.fixture(scope="module")
def measure():
    return load_script("tiny_guess_warm_start")


@pytest.fixture(scope="module")
def game(measure):
    return measure.environment_class()


@pytest.fixture(scope="module")
def warm_start():
    from transformers import AutoModelForCausalLM, AutoTokenizer

    folder = tiny_guess.ensure_model()  # assembled from the shipped weights once per machine (cached)
    return AutoModelForCausalLM.from_pretrained(folder), AutoTokenizer.from_pretrained(folder)


def play(game, secret, *replies):
    env = game()
    assert env.reset(prompt=PROMPT, secret=secret) is None
    return env, [env.step(reply) for reply in replies]


def test_the_environment_answers_higher_or_lower_with_the_range_left(game):
    env, said = play(game, 7, "4", " 6\n", "8", "7")
    assert said == [("higher, 5-8", False), ("higher, 7-8", False), ("lower, 7-7", False), ("yes", True)]
    assert env.get_reward() == 1.0
    env, said = play(game, 2, "5", "1", "hello", "9")
    assert said == [("lower, 1-4", False), ("higher, 2-4", False), ("say a number, 2-4", False), ("say a number, 2-4", True)]
    assert env.get_reward() == 0.0
    env, said = play(game, 3, "3")
    assert said == [("yes", True)] and env.get_reward() == 1.0
    with pytest.raises(ValueError, match="secret 9 is not from 1 to 8"):
        game().reset(prompt=PROMPT, secret=9)


def test_the_midpoint_always_wins_within_four_guesses(game):
    for secret in range(1, 9):
        env = game()
        env.reset(secret=secret)
        low, high, done = 1, 8, False
        while not done:
            said, done = env.step(str(tiny_guess.midpoint(low, high)))
            if said != "yes":
                low, high = map(int, said.split(", ")[1].split("-"))
        assert env.get_reward() == 1.0, secret


def test_the_recipes_game_is_the_environments(game):
    """Every sequence of up to four guesses, for every secret: the warm start's feedback is what the environment says."""
    for secret in range(1, 9):
        for guesses in itertools.product(range(1, 9), repeat=4):
            env = game()
            env.reset(secret=secret)
            low, high = 1, 8
            for turn, guess in enumerate(guesses):
                said, low, high = tiny_guess.feedback(secret, low, high, guess)
                assert env.step(str(guess)) == (said, said == "yes" or turn == 3)
                if said == "yes":
                    break


def test_records_carry_each_secret_equally_often_in_a_fixed_order():
    train, test = guess_number_records("train"), guess_number_records("test")
    assert (len(train), len(test)) == (400, 96)
    assert train == guess_number_records() and train != test
    for records in (train, test):
        assert {r["prompt"] for r in records} == {PROMPT}
        assert [sum(r["secret"] == s for r in records) for s in range(1, 9)] == [len(records) // 8] * 8
    with pytest.raises(ValueError, match="splits 'train' and 'test', not 'validation'"):
        guess_number_records("validation")


def test_registered_as_built_ins():
    from grpo_trainer import builtin
    from grpo_trainer.model_card import BUILTIN_MODELS

    assert builtin.TASKS["guess_number"] is guess_number_records
    assert builtin.MODELS["tiny-guess"] is tiny_guess.ensure_model
    assert builtin.task_records("builtin:guess_number", "test") == guess_number_records("test")
    assert "builtin:tiny-guess" in BUILTIN_MODELS


def test_the_warm_starts_text_is_the_templates_and_ends_in_the_range():
    """The recipe's conversations are the chat template's rendering, token for token; the range's digits stand at
    the offsets the copying heads look back to, after the prompt and after every environment turn alike."""
    tokenizer = tiny_guess.build_tokenizer()
    messages = [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "4"},
                {"role": "user", "content": "higher, 5-8"}]
    rendered = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert tiny_guess.prompt_text(tokenizer) == PROMPT_TEXT
    assert rendered == PROMPT_TEXT + "4" + tokenizer.eos_token + tiny_guess.next_turn_text("user", "higher, 5-8")
    offsets = tiny_guess._range_offsets(tokenizer)
    for text, low, high in ((PROMPT_TEXT, "1", "8"), (rendered, "5", "8")):
        tokens = tokenizer.convert_ids_to_tokens(tokenizer(text, add_special_tokens=False)["input_ids"])
        assert [tokens[len(tokens) - 1 - offset] for offset in offsets] == [low, high]
    count = lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])  # noqa: E731
    longest_feedback = max(count(tiny_guess.next_turn_text("user", s)) for s in ("higher, 1-8", "say a number, 1-8"))
    assert (count(PROMPT_TEXT), count("4" + tokenizer.eos_token), longest_feedback) == (39, 2, 37)
    assert 4 * 2 + 3 * longest_feedback <= 128  # the demo's rollout.max_completion_length holds the longest game


def test_simulated_games_follow_the_mixed_policy():
    rng = random.Random(0)
    guesses = [(int(text), seen) for _ in range(2000) for text, seen in tiny_guess.simulated_game(rng) if seen]
    at_midpoint = sum(guess == tiny_guess.midpoint(*seen) for guess, seen in guesses) / len(guesses)
    assert abs(at_midpoint - tiny_guess.mixed_policy(1, 8)[4]) < 0.03  # 0.3875; ~5000 guesses: sd 0.007
    assert sum(tiny_guess.mixed_policy(5, 8).values()) == pytest.approx(1.0)


def test_warm_start_plays_the_mixed_policy(warm_start, measure):
    model, tokenizer = warm_start
    assert model.config.head_dim == 32 and model.config.max_position_embeddings == 256
    at_midpoint, at_digits = measure.midpoint_probability(model, tokenizer, games=30)
    assert 0.33 < at_midpoint < 0.45 and at_digits > 0.97  # the target: 0.3875 and 1
    records = guess_number_records("test")
    sampled = measure.play(model, tokenizer, records, samples=2, seed=0)  # 192 games, seeded
    assert 0.45 < measure.success(sampled) < 0.75  # the mixed policy: 0.577; sd 0.036 at 192 games
    greedy = measure.play(model, tokenizer, records[:16], samples=1, greedy=True)
    assert measure.success(greedy) == 1.0  # the midpoint is always its likeliest guess
    assert all(g["text"].endswith(tokenizer.eos_token) and g["guesses"] <= 4 for g in sampled + greedy)


def test_the_demo_config_plays_every_guess_through_the_environment_loop(game, monkeypatch):
    """configs/guess_cpu.yaml, evaluated on 16 test games x 2 through the trainer's environment loop: the warm start
    wins some, every win is scored, and a game can last its four guesses (a turn past environment.max_turns would
    never reach step(), so the fourth guess could not win)."""
    from grpo_trainer.config import load_config
    from grpo_trainer.evaluate import evaluate

    monkeypatch.chdir(ROOT)  # the config names the environment's file from the repository root, as the docs run it
    cfg = load_config(ROOT / "configs" / "guess_cpu.yaml")
    assert cfg.environment.factory == "configs/guess_number_env.py:GuessNumber"
    assert cfg.environment.max_turns > game.guesses_allowed and not cfg.rewards
    results = evaluate(cfg, k=2, num_prompts=16, progress=False)
    assert results["eval/num_prompts"] == 16
    assert 0 < results["eval/environment/mean@2"] == results["eval/reward/mean@2"] < 1  # seeded: 32 games
