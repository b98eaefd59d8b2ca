"""The environment of the guess-a-number demo (configs/guess_cpu.yaml), written as a user would write one.

TRL's convention (docs/environments.md): the trainer makes one object per episode and calls `reset(**row)` with
the prompt's dataset row; the model's plain replies go to `step(reply)`, whose text comes back to the model as
the next user message until it says the episode is done; `get_reward()` scores the episode at its end. This game
has no tools, so it has no other public methods (each would be a tool the model could call).

The rows of `builtin:guess_number` carry the secret: `{"prompt": "Guess my number, 1-8", "secret": 5}`.
"""

from __future__ import annotations


class GuessNumber:
    """Guess my number from 1 to 8 in four guesses; told higher or lower and the range left."""

    low, high, guesses_allowed = 1, 8, 4

    def reset(self, secret: int, **row) -> None:
        """Start a game for the row's secret; the prompt already says everything, so nothing is appended to it."""
        if not self.low <= int(secret) <= self.high:
            raise ValueError(f"secret {secret!r} is not from {self.low} to {self.high}")
        self.secret, self.range_left = int(secret), (self.low, self.high)
        self.guesses, self.won = 0, False

    def step(self, reply: str) -> tuple[str, bool]:
        """Answer one reply: "yes", "higher, 5-8", "lower, 1-3", or, to anything but a number, the range again.
        Every answer but "yes" ends with the range left; the game ends when it is found or the guesses run out."""
        self.guesses += 1
        out_of_guesses = self.guesses >= self.guesses_allowed
        low, high = self.range_left
        text = reply.strip()
        if not (text.isdigit() and self.low <= int(text) <= self.high):
            return f"say a number, {low}-{high}", out_of_guesses
        guess = int(text)
        if guess == self.secret:
            self.won = True
            return "yes", True
        if guess < self.secret:
            self.range_left = (max(low, guess + 1), high)
        else:
            self.range_left = (low, min(high, guess - 1))
        word = "higher" if guess < self.secret else "lower"
        return f"{word}, {self.range_left[0]}-{self.range_left[1]}", out_of_guesses

    def get_reward(self) -> float:
        """1 if the number was found within the guesses allowed, else 0."""
        return 1.0 if self.won else 0.0
