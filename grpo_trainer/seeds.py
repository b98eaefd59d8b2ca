"""One seed from several integers: the one rule every seeded stream of the trainer derives its seed by.

A prompt's sampling seed (the run's seed, the step, the draw, the prompt's position), the prompt order of an
epoch (the run's seed, the epoch) and the turns of a tool conversation all come from `mix_seed`, so two
streams that must differ never collide through two ad-hoc formulas, and every machine computes the same.
"""

from __future__ import annotations

MIX = 1_000_003  # a prime above any part's usual range (steps, positions), so small parts never collide
MODULUS = 2**63  # what a 64-bit signed seed holds (torch.manual_seed, numpy, vLLM's per-request seed)


def mix_seed(*parts: int) -> int:
    """`parts` folded into one seed in [0, 2**63): ((p0 * MIX + p1) * MIX + p2) ..., modulo 2**63.

    Order matters (mix_seed(1, 2) != mix_seed(2, 1)); the same parts give the same seed on every machine.
    """
    value = 0
    for part in parts:
        value = (value * MIX + part) % MODULUS
    return value
