"""Stop strings, cut where vLLM cuts them, for the engines that sample token by token themselves.

vLLM (`SamplingParams.stop`) detokenizes each new token, looks for a stop string
that ends in the new text, and keeps the token ids up to and including the token
that completed it (the text loses the stop string; the ids do not). The `hf` engine
must end completions on the same token, so a config trains on the same sequences
whatever the engine: `StopStrings.completes_stop` is that check for the newest
token, `StopStrings.cut` the same over a finished sequence.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

MAX_BYTES_PER_CHARACTER = 4  # UTF-8: a stop string of n characters spans at most 4n byte-level tokens


class StopStrings:
    def __init__(self, stop: Sequence[str], decode: Callable[[list[int]], str]):
        if not stop or any(not s for s in stop):
            raise ValueError("StopStrings needs at least one stop string, none of them empty")
        self.stop = tuple(stop)
        self.decode = decode  # token ids -> text, special tokens kept (as vLLM, skip_special_tokens=False)
        # Only the tail of a sequence can hold a stop string that ends in its newest token: decoding that
        # window keeps the check O(stop length) per token instead of O(sequence length).
        self.window = MAX_BYTES_PER_CHARACTER * max(len(s) for s in self.stop) + 2

    def completes_stop(self, tokens: list[int]) -> bool:
        """Whether the newest of `tokens` completes a stop string: one that ends inside the newest token's text."""
        if not tokens:
            return False
        tail = tokens[-self.window :]
        text = self.decode(tail)
        new_chars = len(text) - len(self.decode(tail[:-1]))
        if new_chars <= 0:  # the newest token adds no character (yet): nothing new can match
            return False
        return any(text.find(s, max(0, len(text) - new_chars - len(s) + 1)) != -1 for s in self.stop)

    def cut(self, tokens: list[int]) -> int | None:
        """How many of `tokens` to keep: up to and including the first that completes a stop string (None: none does)."""
        for length in range(1, len(tokens) + 1):
            if self.completes_stop(tokens[:length]):
                return length
        return None
