# SPDX-License-Identifier: Apache-2.0
"""How long a rank takes for a micro-step of ``mbs`` samples: ``a + b * mbs`` (docs/balancing.md, "Profiling").

The planner balances ranks on these models. They are fitted from profiling steps, derived from a
prior speed score before anything was measured, and guarded against fits that noise made flat.
Pure logic.
"""

import math
from dataclasses import dataclass


def _positive_finite(value):
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class TimeModel:
    """Predicted time of one micro-step of ``mbs`` samples on one rank: ``a + b * mbs``.

    The unit is the caller's (seconds when fitted from measurements, arbitrary for priors); only
    ratios between ranks matter to the planner.
    """

    a: float
    """Fixed cost of a micro-step (launches, hooks, per-micro-step communication); >= 0."""
    b: float
    """Cost of one sample; > 0."""

    def __post_init__(self):
        if not (isinstance(self.a, (int, float)) and math.isfinite(self.a) and self.a >= 0):
            raise ValueError(f"TimeModel: a = {self.a!r} must be a finite number >= 0")
        if not _positive_finite(self.b):
            raise ValueError(f"TimeModel: b = {self.b!r} must be a positive finite number")

    def micro_step_time(self, micro_batch_size):
        return self.a + self.b * micro_batch_size


def least_squares_line(sizes, times):
    """``(intercept, slope)`` of the unconstrained least-squares line through ``(sizes[i], times[i])``;
    needs two or more distinct sizes."""
    mean_size, mean_time = math.fsum(sizes) / len(sizes), math.fsum(times) / len(times)
    spread = math.fsum((m - mean_size)**2 for m in sizes)
    slope = math.fsum((m - mean_size) * (t - mean_time) for m, t in zip(sizes, times)) / spread
    return mean_time - slope * mean_size, slope


def fit_time_model(samples):
    """Least-squares fit of ``time = a + b * mbs`` to measured micro-steps.

    Args:
        samples: (micro_batch_size, seconds) pairs. With two or more distinct sizes both a and b
            are fitted; with a single size the whole time is charged per sample (a = 0).

    A negative intercept or a non-positive slope (noise, or sizes too close together to see the
    fixed cost) falls back to the fit through the origin, ``b = sum(mbs*t) / sum(mbs^2)``: the
    planner needs time to grow with the batch, and proportional time is the safe assumption.
    """
    pairs = list(samples)
    if not pairs:
        raise ValueError("fit_time_model: no samples; give (micro_batch_size, seconds) pairs from profiling steps")
    for index, pair in enumerate(pairs):
        if not (isinstance(pair, (tuple, list)) and len(pair) == 2):
            raise ValueError(f"fit_time_model: samples[{index}] = {pair!r} is not a (micro_batch_size, seconds) pair")
        if not (_positive_finite(pair[0]) and _positive_finite(pair[1])):
            raise ValueError(f"fit_time_model: samples[{index}] = {pair!r}: the size and the time must both be "
                             f"positive finite numbers")
    sizes = [float(size) for size, _ in pairs]
    times = [float(seconds) for _, seconds in pairs]
    through_origin = TimeModel(0.0, math.fsum(m * t for m, t in zip(sizes, times)) / math.fsum(m * m for m in sizes))
    if len(set(sizes)) < 2:
        return through_origin
    intercept, slope = least_squares_line(sizes, times)
    if slope <= 0 or intercept < 0:
        return through_origin
    return TimeModel(intercept, slope)


FIXED_SHARE_LIMIT = 0.5
"""A fitted fixed cost above this share of the micro-step it was measured at is taken as noise."""


def plausible_time_model(model, size):
    """``model``, or the proportional model through its time at ``size`` when its fixed cost is
    more than ``FIXED_SHARE_LIMIT`` of that time.

    A few steps at sizes close together, on a loaded machine, leave the split between fixed and
    per-sample cost to noise: a fit can come out nearly flat (``a`` large, ``b`` small). Used far
    from the sizes it was measured at, such a model makes a rank look cheap per sample, or makes
    moving work off a slowed rank look useless. Proportional time is the safe side: it keeps the
    measured point and lets work follow speed.
    """
    if not size or model.a <= FIXED_SHARE_LIMIT * model.micro_step_time(size):
        return model
    return TimeModel(0.0, model.micro_step_time(size) / size)


def relative_standard_error(model, samples, parameters):
    """Relative standard error of the level of ``model`` over the micro-steps it was fitted to.

    Each measured time divided by the model's prediction at its size is one estimate of the
    rank's level (1.0 when the model is exact); their root-mean-square deviation from 1, with
    ``parameters`` degrees of freedom spent on the fit, over the square root of their count, is
    how far the level (and so the rank's speed relative to the others) could be off. Returns
    ``math.inf`` when the samples leave no degree of freedom (one micro-step, or two fitted with
    a line): the noise is then unknown, which the caller must not read as none.

    Args:
        model: the fitted TimeModel (with any fixed cost added after the fit).
        samples: (micro_batch_size, seconds) pairs, times on the model's footing.
        parameters: the number of fitted parameters (2 for ``a + b * mbs``, 1 through the origin).
    """
    pairs = [(float(m), float(t)) for m, t in samples]
    freedom = len(pairs) - parameters
    if freedom < 1:
        return math.inf
    squares = math.fsum((t / model.micro_step_time(m) - 1.0)**2 for m, t in pairs)
    return math.sqrt(squares / freedom) / math.sqrt(len(pairs))


def time_models_from_scores(scores):
    """Prior time models from relative speed scores (e.g. TFLOP/s): ``b_i = 1 / score_i``, ``a_i = 0``."""
    scores = list(scores)
    for index, score in enumerate(scores):
        if not _positive_finite(score):
            raise ValueError(f"time_models_from_scores: scores[{index}] = {score!r} must be a positive finite number")
    return [TimeModel(0.0, 1.0 / score) for score in scores]
