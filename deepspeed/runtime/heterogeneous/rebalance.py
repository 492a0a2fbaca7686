# SPDX-License-Identifier: Apache-2.0
"""When to rebalance during training (docs/architecture.md §4.7): pure decision logic, no processes.

Every ``check_interval`` steps the runtime fits each rank's time model to the steps since the
last check and asks ``RebalancePolicy.check`` whether the best plan for those models beats the
plan in force. A new plan is adopted only when

- its predicted gain, ``1 - T(best) / T(current)`` under the same models, exceeds
  ``imbalance_threshold``,
- on ``CONSECUTIVE`` checks in a row (one noisy interval never moves work), and
- at least ``cooldown_checks`` checks have passed since the last rebalance (the new plan is
  measured for a whole interval before it can be judged).

Noise alone gives gains of a few per cent around zero: below a 10% threshold, twice in a row,
it does not rebalance, and the cool-down rules out moving work back and forth. On a loaded
machine the noise can exceed any fixed threshold, so each check also estimates it from the
interval's own measurements (``interval_noise``): a predicted gain within the noise is no gain.

``Rebalancer`` holds rank 0's state across checks (the models that chose the plan in force and
the baseline interval they are scaled against) and turns an interval's measurements into a
``Decision``; the runtime only pools the measurements and broadcasts the decision.
"""

import math
from dataclasses import dataclass
from typing import Optional

from .planner import Plan, TimeModel, fit_time_model

CONSECUTIVE = 2
"""Checks in a row whose predicted gain must exceed the threshold."""


@dataclass(frozen=True)
class Decision:
    rebalance: bool
    predicted_gain: float
    """1 - T(best) / T(current) under the latest models (negative: the current plan is better)."""
    reason: str
    plan: Optional[Plan] = None
    """The plan to adopt when ``rebalance`` (``Rebalancer.check`` only)."""


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

    def check(self, current_time, best_time, noise=0.0):
        """Decide from the predicted step times of the plan in force and of the best plan.

        ``noise``: the relative error of those predictions (``interval_noise``); a predicted gain
        not above it is taken as 0, since noise alone could have produced it."""
        gain = predicted_gain(current_time, best_time)
        if 0.0 < gain <= noise:
            self.streak = 0
            if self.cooldown > 0:
                self.cooldown -= 1
            return Decision(False, 0.0, f"predicted gain {gain:.1%} is within the measured noise {noise:.1%}")
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


NOISE_STANDARD_ERRORS = 2.0
"""How many standard errors of the measured times a predicted gain must exceed (about 95%)."""


def interval_statistics(step_times):
    """(centre, relative standard error of the centre) of one rank's per-step times per micro-step.

    Robust: the median, and the spread from the median absolute deviation (scaled by 1.4826 to a
    normal distribution's standard deviation). A check interval holds a handful of steps, and on a
    shared machine one of them is often an outlier (a scheduler hiccup, a collection): with the
    mean and the sample deviation that one step decided both the drift and the noise bound, and a
    noisy baseline interval then hid a real slowdown for the whole life of the plan."""
    count = len(step_times)
    if count == 0:
        raise ValueError("a rebalancing check needs at least one measured step per rank")
    centre = _median(step_times)
    if count < 2 or centre <= 0:
        return centre, 0.0
    spread = 1.4826 * _median([abs(t - centre) for t in step_times])
    return centre, spread / math.sqrt(count) / centre


def _median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def interval_noise(measured, baseline):
    """Relative error of a drift-scaled prediction: each rank's time is a ratio of two noisy means
    (this interval over the baseline interval), so their relative errors add in quadrature; the
    largest rank's, times ``NOISE_STANDARD_ERRORS``, bounds the error of a predicted gain."""
    return NOISE_STANDARD_ERRORS * max(
        (math.hypot(error, base_error) for (_, error), (_, base_error) in zip(measured, baseline)), default=0.0)


def plan_step_time(models, plan):
    """The slowest rank's predicted step time for ``plan`` under ``models``."""
    return max(g * model.micro_step_time(m)
               for model, m, g in zip(models, plan.micro_batch_sizes, plan.gradient_accumulation_steps))


def scaled_models(reference_models, factors):
    return [TimeModel(ref.a * f, ref.b * f) for ref, f in zip(reference_models, factors)]


class Rebalancer:
    """Rank 0's rebalancing decisions over a training run (pure: no processes).

    Drift is measured against the first whole interval of a plan (the baseline), not against the
    models' predictions: an interval runs one size per rank, which cannot separate a rank's fixed
    cost from its per-sample cost, and a prediction error of the profiled fit at that size would
    read as drift. A device that slows down (throttling, a neighbour) slows all of its compute,
    so the models that chose the plan are scaled by time / baseline: 1 for every rank when
    nothing changed, whatever the split, so noise alone predicts no gain.
    """

    def __init__(self, policy):
        self.policy = policy
        self.reference_models = None  # the time models that chose the plan in force
        self.baseline = None  # per rank (mean, relative error) in the plan's first interval

    def plan_chosen(self, models):
        """A plan chosen by ``models`` is in force from now on; its first interval is the baseline."""
        self.reference_models, self.baseline = models, None

    def check(self, plan, step_times, best_plan_for):
        """One periodic check.

        Args:
            plan: the plan in force.
            step_times: per data-parallel rank, the interval's per-step own times per micro-step
                (the optimizer step's share included, see ``timing.StepTiming``).
            best_plan_for: ``models -> Plan``, the planner with the run's constraints.
        """
        measured = [interval_statistics(times) for times in step_times]
        if self.baseline is None:
            self.baseline = measured
            if self.reference_models is None:  # no profiling steps: per-sample cost only
                self.reference_models = [TimeModel(0.0, mean / m)
                                         for (mean, _), m in zip(measured, plan.micro_batch_sizes)]
            return Decision(False, 0.0, "baseline of the plan in force measured")
        models = scaled_models(self.reference_models,
                               [mean / base for (mean, _), (base, _) in zip(measured, self.baseline)])
        return self._decide(plan, models, best_plan_for, interval_noise(measured, self.baseline))

    def check_on_demand(self, plan, models, best_plan_for):
        """``reschedule_workload``: adopt the best plan for ``models`` whenever it is predicted faster."""
        best = best_plan_for(models)
        current = plan_step_time(models, plan)
        gain = predicted_gain(current, best.predicted_step_time)
        decision = Decision(gain > 0, gain, f"on demand, predicted gain {gain:.1%}")
        return self._adopt_if_new(plan, best, models, decision)

    def _decide(self, plan, models, best_plan_for, noise):
        best = best_plan_for(models)
        decision = self.policy.check(plan_step_time(models, plan), best.predicted_step_time, noise)
        return self._adopt_if_new(plan, best, models, decision)

    def _adopt_if_new(self, plan, best, models, decision):
        same = (best.micro_batch_sizes, best.gradient_accumulation_steps) == (plan.micro_batch_sizes,
                                                                             plan.gradient_accumulation_steps)
        if not decision.rebalance or same:
            return Decision(False, decision.predicted_gain, decision.reason)
        self.plan_chosen(models)
        return Decision(True, decision.predicted_gain, decision.reason, best)


def window_models(step_samples, fits, step_overheads, gradient_accumulation_steps):
    """Per-rank models for an on-demand re-plan from the steps since the last check: the profiled
    fits (or a fit of the window's samples without profiling) scaled by measured / predicted time
    over the window (see ``Rebalancer`` for why a and b are not refitted from one size).

    Args:
        step_samples: per rank, the window's micro-steps ``(mbs, seconds, ...)``.
        fits: per-rank fits from profiling, or None.
        step_overheads: per rank, the mean optimizer-step time of the window.
    """
    models = []
    for rank, samples in enumerate(step_samples):
        samples = [s[:2] for s in samples]
        base = fits[rank] if fits else fit_time_model(samples)
        drift = sum(t for _, t in samples) / sum(base.micro_step_time(m) for m, _ in samples)
        models.append(TimeModel(drift * base.a + step_overheads[rank] / gradient_accumulation_steps,
                                drift * base.b))
    return models
