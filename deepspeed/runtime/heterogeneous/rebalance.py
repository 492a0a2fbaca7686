# SPDX-License-Identifier: Apache-2.0
"""When to rebalance during training (DESIGN.md 4.7): pure decision logic, no processes.

Every ``check_interval`` steps the runtime fits each rank's time model to the steps since the
last check and asks ``RebalancePolicy.check`` whether the best plan for those models beats the
plan in force. A new plan is adopted only when

- its predicted gain, ``1 - T(best) / T(current)`` under the same models, exceeds
  ``imbalance_threshold``,
- on ``CONSECUTIVE`` checks in a row (one noisy interval never moves work), and
- at least ``cooldown_checks`` checks have passed since the last rebalance (the new plan is
  measured for a whole interval before it can be judged).

Noise alone gives gains of a few per cent around zero: below a 10% threshold, twice in a row,
it does not rebalance, and the cool-down rules out moving work back and forth.
"""

from dataclasses import dataclass
from typing import Optional

CONSECUTIVE = 2
"""Checks in a row whose predicted gain must exceed the threshold."""


@dataclass(frozen=True)
class Decision:
    rebalance: bool
    predicted_gain: float
    """1 - T(best) / T(current) under the latest models (negative: the current plan is better)."""
    reason: str


def predicted_gain(current_time, best_time):
    if current_time <= 0:
        return 0.0
    return 1.0 - best_time / current_time


class RebalancePolicy:
    """Hysteresis around the predicted gain of re-planning; one instance per training run."""

    def __init__(self, imbalance_threshold, cooldown_checks=1, consecutive=CONSECUTIVE):
        if not 0.0 < imbalance_threshold < 1.0:
            raise ValueError(f"imbalance_threshold {imbalance_threshold} must be in (0, 1)")
        self.threshold = imbalance_threshold
        self.cooldown_checks = int(cooldown_checks)
        self.consecutive = int(consecutive)
        self.streak = 0
        self.cooldown = 0
        self.events = 0

    def check(self, current_time, best_time):
        """Decide from the predicted step times of the plan in force and of the best plan."""
        gain = predicted_gain(current_time, best_time)
        if self.cooldown > 0:
            self.cooldown -= 1
            self.streak = 0
            return Decision(False, gain, f"cool-down after a rebalance ({self.cooldown} more check(s))")
        if gain <= self.threshold:
            self.streak = 0
            return Decision(False, gain, f"predicted gain {gain:.1%} <= threshold {self.threshold:.0%}")
        self.streak += 1
        if self.streak < self.consecutive:
            return Decision(False, gain, f"predicted gain {gain:.1%} > threshold on {self.streak} of "
                            f"{self.consecutive} consecutive checks")
        self.streak = 0
        self.cooldown = self.cooldown_checks
        self.events += 1
        return Decision(True, gain, f"predicted gain {gain:.1%} > threshold {self.threshold:.0%} on "
                        f"{self.consecutive} consecutive checks")


@dataclass
class RebalanceEvent:
    """One rebalance, for the log and the profiler's timeline."""

    step: int
    old_sizes: tuple
    new_sizes: tuple
    predicted_gain: float
    step_time_before: float
    step_time_after: Optional[float] = None

    @property
    def observed_gain(self):
        if self.step_time_after is None or self.step_time_before <= 0:
            return None
        return 1.0 - self.step_time_after / self.step_time_before
