"""What a user's next request is expected to cost, learned from its own finished ones.

A request's real size is known only when it ends. While it runs, the scheduler orders its
user by an *expected* cost (prompt and output), and uses the same expectation for a
class's share at dispatch (``min_share``). The expectation is the request's own figures
scaled by how the user's recent requests turned out:

* expected prompt = estimated prompt x (real / estimated prompt tokens of the user's
  recent requests); a request the engine refused counts as 0 real tokens;
* expected output = reserved output x (real output / reserved output of the same).

Recent = exponentially weighted, each finished request weighing :data:`ALPHA` against
the past; a ratio is taken at most as :data:`MAX_RATIO`. A gamer whose requests are
refused or abandoned is learned within a few requests (its expectations go to 0); an
honest user's errors are symmetric.

A user with no finished request yet has no history: its requests are expected to use
their estimate and their whole reservation (so a new user's first requests throttle it
as much as they might cost), but that expectation is *speculative*: the scheduler does
not let it move the virtual time that other users are lifted to (see
:mod:`qos.fair_queue`), so nothing a brand-new identity claims can be refunded from
under anyone.
"""

from __future__ import annotations

ALPHA = 0.1  # weight of each finished request in a user's ratios
MAX_RATIO = 4.0  # a real/estimated ratio above this is taken as this


class UsageModel:
    """Per-user ratios of real to estimated prompt and output tokens (bounded by the
    users the scheduler tracks: :meth:`forget` drops one)."""

    __slots__ = ("_ratios",)

    def __init__(self) -> None:
        # user -> [real prompt, estimated prompt, real output, reserved output], decayed sums
        self._ratios: dict[str, list[float]] = {}

    def __len__(self) -> int:
        return len(self._ratios)

    def knows(self, user_id: str) -> bool:
        """Whether ``user_id`` has a finished request to learn from."""
        return user_id in self._ratios

    def expected(self, user_id: str, prompt_tokens: int, reserved_output: int) -> tuple[float, float]:
        """(prompt, output) tokens a request of ``user_id`` with this estimated prompt
        and this reserved output (all choices) is expected to use; the request's own
        figures for a user with no history."""
        r = self._ratios.get(user_id)
        if r is None:
            return float(prompt_tokens), float(reserved_output)
        prompt = prompt_tokens * min(MAX_RATIO, r[0] / r[1]) if r[1] > 0 else float(prompt_tokens)
        output = reserved_output * min(MAX_RATIO, r[2] / r[3]) if r[3] > 0 else 0.0
        return prompt, output

    def learn(self, user_id: str, prompt_estimate: int, prompt_real: int, reserved_output: int, output_real: int) -> None:
        """Record how one finished request of ``user_id`` turned out (tokens)."""
        r = self._ratios.get(user_id)
        if r is None:
            self._ratios[user_id] = [float(prompt_real), float(prompt_estimate), float(output_real), float(reserved_output)]
            return
        keep = 1.0 - ALPHA
        r[0] = r[0] * keep + prompt_real
        r[1] = r[1] * keep + prompt_estimate
        r[2] = r[2] * keep + output_real
        r[3] = r[3] * keep + reserved_output

    def forget(self, user_id: str) -> None:
        """Drop ``user_id``'s ratios (its state is being forgotten)."""
        self._ratios.pop(user_id, None)
