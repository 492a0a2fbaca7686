# SPDX-License-Identifier: Apache-2.0
"""Robust statistics of measured step times (docs/balancing.md, "Dynamic rebalancing"): pure, no processes.

Rebalancing compares intervals of a handful of steps on machines where one step in a few is an
outlier (a scheduler hiccup, a collection); these estimates use medians and median absolute
deviations so that one such step neither moves work nor hides a real slowdown.
"""

import math

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
    centre = median(step_times)
    if count < 2 or centre <= 0:
        return centre, 0.0
    spread = 1.4826 * median([abs(t - centre) for t in step_times])
    return centre, spread / math.sqrt(count) / centre


def median(values):
    ordered = sorted(values)
    middle = len(ordered) // 2
    return ordered[middle] if len(ordered) % 2 else (ordered[middle - 1] + ordered[middle]) / 2


def interval_noise(measured, baseline):
    """Relative error of a drift-scaled prediction: each rank's time is a ratio of two noisy means
    (this interval over the baseline interval), so their relative errors add in quadrature; the
    largest rank's, times ``NOISE_STANDARD_ERRORS``, bounds the error of a predicted gain."""
    return NOISE_STANDARD_ERRORS * max(
        (math.hypot(error, base_error) for (_, error), (_, base_error) in zip(measured, baseline)), default=0.0)


REVERT_STANDARD_ERRORS = 3.0
"""How many standard errors an observed slowdown must exceed before a switch is reverted: more
than a move needs, since the reference may be a single profiling step and a wrong revert costs
the whole gain of a good plan."""

MIN_SLOWDOWN = 0.02
"""A slowdown below this is never reverted, however small the noise: 1-2% is within what a
machine's load moves between two intervals."""

MIN_STEPS_TO_JUDGE = 3
"""Steps at the new plan needed before a switch is judged (a median of fewer is one step)."""


def slowdown_beyond_noise(before, after, standard_errors=REVERT_STANDARD_ERRORS, minimum=MIN_SLOWDOWN):
    """``(slowdown, bound)``: the observed relative slowdown ``median(after) / median(before) - 1``
    and the bound it must exceed to count (``slowdown > bound``).

    The noise is a pooled two-sample estimate: each group's relative deviations from its own
    median (1.4826 * their median absolute value, the standard deviation of a normal
    distribution), from the groups of two steps or more; its standard error for the two medians
    is ``sigma * sqrt(1/n_before + 1/n_after)``. A group of one step (the profiling reference may
    be a single step) thus borrows the other's spread rather than claiming none.

    Args:
        before, after: per-step wall seconds (the slowest rank's) at the old and the new plan.
    """
    if not before or not after:
        raise ValueError("slowdown_beyond_noise: needs at least one step before and one after the switch")
    centres = [median(group) for group in (before, after)]
    deviations = [abs(t / centre - 1.0) for group, centre in zip((before, after), centres) if len(group) >= 2
                  for t in group]
    sigma = 1.4826 * median(deviations) if deviations else 0.0
    bound = max(minimum, standard_errors * sigma * math.sqrt(1.0 / len(before) + 1.0 / len(after)))
    return centres[1] / centres[0] - 1.0, bound
