# SPDX-License-Identifier: Apache-2.0
"""From the profiling steps to a plan
(docs/balancing.md, "Profiling" and "Plans you can trust"): pure functions, no processes.

A profiling step's measurements, pooled over the ranks (``cluster/agreement.merge_replicas``), are
one entry per data-parallel rank: ``{"samples": [(mbs, seconds, activation bytes or None), ...],
"step_overhead": seconds, "state_bytes": bytes, "wall": seconds, "collective_s": seconds}``.
``history`` is the list of those steps.

A plan must be one a user can trust: never a split of noise, never absurd, and checked
after the switch (``rebalance.Rebalancer.judge_switch``). ``trusted_plan`` keeps the start-up
plan unless two ranks' speeds differ beyond the noise of their own measurements, and caps what a
fitted fixed cost may move; the last profiling step runs the start-up plan again, the reference
the switch is judged against. The sizes the middle steps probe are ``probe_sizes.py``'s.
"""

import math
from dataclasses import dataclass
from typing import Optional

from ..memory.model_state import RankCannotFitError, fit_activation_model, max_micro_batch
from .planner import Plan, TimeModel, fit_time_model, plan_micro_batches, plausible_time_model
from .probe_sizes import sizes_seen, spread_profiling_sizes
from .strategies import COMPUTE_AWARE, MANUAL
from .time_model import least_squares_line, relative_standard_error

NOISE_STANDARD_ERRORS = 2.0
"""How many standard errors two ranks' measured speeds must differ by before work moves (about 95%)."""

SHARE_LIMIT = 1.5
"""A measured plan may give a rank at most this many times, and at least this fraction of, the
samples that the measured speed ratio alone (time per sample, no fixed cost) gives it, with one
sample per micro-step of slack."""


def fit_steps(history):
    """The steps a time model is fitted to: the first carries warm-up and is left out once later
    ones exist."""
    return history[1:] if len(history) > 1 else history


def measured_time_models(history, gradient_accumulation_steps):
    """Per-rank models for the planner, and the fits alone.

    Returns ``(models, fits)``: ``fits[r]`` is rank r's ``a + b * mbs`` for its micro-steps (a
    nearly flat fit falls back to proportional time, see ``plausible_time_model``); ``models[r]``
    adds the optimizer step spread over the ``gradient_accumulation_steps`` micro-steps. Raises
    ValueError when a rank has no samples.
    """
    steps = fit_steps(history)
    models, fits = [], []
    for rank in range(len(steps[0])):
        samples = [sample[:2] for step in steps for sample in step[rank]["samples"]]
        if not samples:
            raise ValueError(f"fit_time_model: no samples for data-parallel rank {rank}: it recorded no "
                             f"micro-steps in the profiling steps; {_NO_MICRO_STEPS_HINT}")
        fit = fit_time_model(samples)
        fit = plausible_time_model(fit, sum(m for m, _ in samples) / len(samples))
        fits.append(fit)
        # The optimizer step runs once per step on every rank, at the rank's own speed: a slow
        # rank's is longer, and the others wait for it at the next collective. Spread over the
        # micro-steps, it is part of the fixed cost a that the planner balances.
        overhead = sum(step[rank]["step_overhead"] for step in steps) / len(steps)
        models.append(TimeModel(fit.a + overhead / gradient_accumulation_steps, fit.b))
    return models, fits


def _rank_points(steps, rank, optimizer_share=True):
    """Rank ``rank``'s micro-steps as (mbs, seconds), by default with the step's optimizer share: the
    footing of the planner's models, whose fixed cost includes the optimizer step spread over the
    micro-steps."""
    points = []
    for step in steps:
        samples = step[rank]["samples"]
        share = step[rank]["step_overhead"] / len(samples) if samples and optimizer_share else 0.0
        points += [(sample[0], sample[1] + share) for sample in samples]
    return points


def rank_errors(history, models, fits):
    """Per rank, the relative standard error of its measured level (``relative_standard_error``).

    The residuals are taken against the least-squares line through the rank's micro-steps (with
    the optimizer share) where it leaves a degree of freedom (``_scatter_about_line``), else
    against the planner's model (the fit plus the optimizer share). When a
    line through two sizes leaves no degree of freedom (3 profiling steps with gas 1),
    the residuals are those of the optimizer share plus a time proportional to the samples: that
    counts any fixed cost of the forward+backward as noise, so it errs on the side of keeping the
    plan. ``math.inf`` where a rank has a single micro-step: its noise is unknown.
    """
    steps = fit_steps(history)
    errors = []
    for rank, (model, fit) in enumerate(zip(models, fits)):
        points = _rank_points(steps, rank)
        error = _scatter_about_line(points)
        if error is not None:
            errors.append(error)
            continue
        error = relative_standard_error(model, points, 2 if fit.a > 0 else 1)
        if math.isinf(error) and len(points) >= 2:
            compute = _rank_points(steps, rank, optimizer_share=False)
            share = math.fsum(t for _, t in points) / len(points) - math.fsum(t for _, t in compute) / len(compute)
            per_sample = math.fsum(t for _, t in compute) / math.fsum(m for m, _ in compute)
            error = relative_standard_error(TimeModel(max(share, 0.0), per_sample), points, 1)
        errors.append(error)
    return errors


def _scatter_about_line(points):
    """The relative standard error of the level of the least-squares line ``a + b * mbs`` through
    ``points``, unconstrained (a < 0 or b <= 0 allowed); None when the line leaves no degree of
    freedom (fewer than 3 points, or one size) or predicts no positive time at a measured size.

    The noise is the measurements' scatter about the line that describes them best, not about the
    planner's model: where a rank's time hardly grows with its samples (a fixed cost dominates, as
    on a throttled rank whose per-micro-step overhead is slowed too), the fit falls back to
    proportional time for planning (``fit_time_model``, ``plausible_time_model``), and read against
    that model 2 samples taking as long as 8 would count as 300% noise: the gate would keep [8, 8]
    for a rank at a quarter of the other's speed (``tests/perf/bench_profiling_gate.py``).
    """
    if len(points) < 3 or len({m for m, _ in points}) < 2:
        return None
    sizes, times = [float(m) for m, _ in points], [float(t) for _, t in points]
    intercept, slope = least_squares_line(sizes, times)
    predicted = [intercept + slope * m for m in sizes]
    if min(predicted) <= 0:
        return None
    squares = math.fsum((t / p - 1.0)**2 for t, p in zip(times, predicted))
    return math.sqrt(squares / (len(points) - 2)) / math.sqrt(len(points))


def measured_rates(history):
    """Per rank, the measured forward+backward seconds per sample over the fitted steps: the speed
    ratio the measurements support without any split into fixed and per-sample cost.

    The optimizer step is left out: it does not grow with the samples, and it is where a rank can
    measure time that is not its own compute (waiting for a slower peer in a step that is not timed
    as a collective), which would otherwise pass for a fixed cost and push work onto that peer."""
    steps = fit_steps(history)
    rates = []
    for rank in range(len(steps[0])):
        points = _rank_points(steps, rank, optimizer_share=False)
        if not points:
            raise ValueError(f"data-parallel rank {rank} recorded no micro-steps in the profiling steps; "
                             f"{_NO_MICRO_STEPS_HINT}")
        rates.append(math.fsum(t for _, t in points) / math.fsum(m for m, _ in points))
    return rates


_NO_MICRO_STEPS_HINT = ("its forward must go through the engine (engine(inputs), not engine.module(inputs)) so "
                        "that its micro-steps are timed")


def significant_difference(models, errors, plan, standard_errors=NOISE_STANDARD_ERRORS, times=None):
    """The clearest difference between two ranks' predicted times under ``plan`` beyond the noise.

    Under the plan in force the ranks' times are equal if that plan is right (uniform: equal
    speeds; a datasheet plan: the datasheet's ratio). Ranks i and j differ when
    ``log(T_i / T_j) > standard_errors * hypot(e_i, e_j)``. Returns ``(slower, faster, ratio)``
    for the pair furthest beyond its bound, or None when every difference is within the noise
    (then moving work would follow noise, not speed). ``times``: per-rank step times measured
    under ``plan`` to use instead of the models' predictions.
    """
    if times is None:
        times = [g * model.micro_step_time(m)
                 for model, m, g in zip(models, plan.micro_batch_sizes, plan.gradient_accumulation_steps)]
    found, margin = None, 0.0
    for i, (time_i, error_i) in enumerate(zip(times, errors)):
        for j, (time_j, error_j) in enumerate(zip(times, errors)):
            if time_i <= time_j or math.isinf(error_i) or math.isinf(error_j):
                continue
            excess = math.log(time_i / time_j) - standard_errors * math.hypot(error_i, error_j)
            if excess > margin:
                found, margin = (i, j, time_i / time_j), excess
    return found


def beyond_measured_ratio(plan, reference, limit=SHARE_LIMIT):
    """Ranks that ``plan`` gives more than ``limit`` times, or less than 1/``limit`` of, their
    samples in ``reference`` (the plan of the measured speed ratio, within the same memory limits),
    with one sample per micro-step of slack: the split between any two ranks stays within
    ``limit`` of what their measured speeds give them, whichever way the fit errs."""
    return [rank for rank, (n, r, g) in enumerate(zip(plan.samples_per_rank, reference.samples_per_rank,
                                                       plan.gradient_accumulation_steps))
            if n > limit * r + g or n < r / limit - g]


@dataclass(frozen=True)
class ProfilingDecision:
    """The plan after a profiling step, the models that chose it, and what the log should say."""

    plan: Plan
    models: Optional[list]
    """The time models behind ``plan`` (what rebalancing scales); None when the plan in force at
    start-up was kept because the measurements cannot tell the ranks apart, or there is one rank."""
    note: str = ""
    """Why the measured best plan was not taken (noise, an absurd split, the reference step)."""
    best: Optional[Plan] = None
    """The measured best plan before the gate and the guard (profiling spreads sizes toward it)."""


def trusted_plan(history, startup_plan, gradient_accumulation_steps, limits, allow_per_rank_gas,
                 strategy=COMPUTE_AWARE):
    """The measured best plan when the measurements support it, else a safer one.

    - Noise gate: when no two ranks' predicted times under the start-up plan differ beyond the
      noise (``significant_difference``), the start-up plan (uniform, or the datasheet's) stays:
      a rank that mostly waits in collectives measures little compute, and a split of noise is
      no better than the split already in force, only riskier.
    - Absurd-split guard: a plan that gives a rank more than ``SHARE_LIMIT`` times what the
      measured speed ratio gives it (``beyond_measured_ratio``) is replaced by the plan of that
      ratio: the fitted fixed costs, extrapolated, may not overrule the measured speeds by that
      much.
    - One data-parallel rank: the start-up plan, and no note (no speeds to compare).

    ``strategy`` names the registered strategy whose plan for the measured time models is the
    measured best. Returns a ``ProfilingDecision``.
    """
    models, fits = measured_time_models(history, gradient_accumulation_steps)
    rates = measured_rates(history)
    errors = rank_errors(history, models, fits)

    def best_for(time_models):
        return plan_micro_batches(time_models, train_batch_size=startup_plan.train_batch_size,
                                  gradient_accumulation_steps=gradient_accumulation_steps, strategy=strategy,
                                  max_micro_batch=limits, allow_per_rank_gas=allow_per_rank_gas)

    best = best_for(models)
    # The ranks' own times in the steps that ran the start-up plan (after the warm-up), where there
    # are some: measured where the question is asked, at sizes every rank has run before. A fit
    # through the profiled sizes also carries the first step at each new size, which pays one-off
    # allocations and can make a rank look slower per sample than it is.
    at_startup = startup_plan_times(history, startup_plan)
    over = exceeds_limits(startup_plan, limits)
    if over:  # memory decides, whatever the speeds
        return ProfilingDecision(best, models, f"the start-up plan exceeds the measured memory limits of rank(s) "
                                 f"{over}", best)
    if startup_plan.world_size == 1:  # one rank: no speeds to compare, nothing to move, nothing to advise
        return ProfilingDecision(startup_plan, None, "", best)
    difference = significant_difference(models, errors, startup_plan, times=at_startup)
    if difference is None:
        steps = len(history)
        why = _within_noise_text(history, models, errors, startup_plan, at_startup)
        return ProfilingDecision(startup_plan, None, f"kept the start-up plan: {why}. To measure longer, raise "
                                 f"heterogeneous_config.profile_steps (now {steps}, e.g. {2 * steps}), or turn on "
                                 f"scheduler.dynamic_rebalancing, whose checks keep measuring", best)
    ratio_models = [TimeModel(0.0, rate) for rate in rates]
    by_ratio = best_for(ratio_models)
    absurd = beyond_measured_ratio(best, by_ratio)
    slower, faster, ratio = difference
    note = f"rank {slower} measured {ratio:.2f}x rank {faster}'s time under the start-up plan, beyond the noise"
    if absurd:
        return ProfilingDecision(by_ratio, ratio_models, f"{note}; the fitted plan {list(best.micro_batch_sizes)} "
                                 f"gives rank(s) {absurd} more than {SHARE_LIMIT:g}x the samples of the measured "
                                 f"speed ratio, or less than 1/{SHARE_LIMIT:g} of them, so the plan of that ratio is "
                                 f"used", best)
    return ProfilingDecision(best, models, f"{note}: the plan follows the measured speeds (a fixed split instead: "
                             f"load_balancing_strategy \"manual\" with micro_batch_sizes)", best)


def exceeds_limits(plan, limits):
    """The ranks whose micro-batch in ``plan`` is beyond their memory limit (entries None: none)."""
    return [rank for rank, (m, cap) in enumerate(zip(plan.micro_batch_sizes, limits or [])) if cap is not None and m > cap]


def startup_plan_times(history, startup_plan):
    """Per rank, the mean step time (micro-steps plus optimizer step) over the profiling steps after
    the warm-up that ran ``startup_plan``; None when none did."""
    measured = [step for step in history[1:] if ran_plan(step, startup_plan)]
    if not measured:
        return None
    return [math.fsum(math.fsum(s[1] for s in step[rank]["samples"]) + step[rank]["step_overhead"]
                      for step in measured) / len(measured) for rank in range(startup_plan.world_size)]


def _within_noise_text(history, models, errors, plan, times=None):
    """Why ``significant_difference`` found nothing, with the figures: the spread between the
    slowest and the fastest rank under ``plan``, and the bound it stayed within. "The measured
    noise" only where every rank's error is the scatter of its micro-steps about their own line
    (``rank_errors``' first reading); otherwise the error counts a fixed cost as noise, and the
    bound says the steps were too few, not that the machine is that noisy."""
    times = times or [g * model.micro_step_time(m)
                      for model, m, g in zip(models, plan.micro_batch_sizes, plan.gradient_accumulation_steps)]
    slow = times.index(max(times))
    fast = min((rank for rank in range(len(times)) if rank != slow), key=times.__getitem__)
    spread = f"by up to {times[slow] / times[fast] - 1:.1%}"
    if any(math.isinf(e) for e in errors):
        shown = ", ".join("?" if math.isinf(e) else f"{e:.0%}" for e in errors)
        return (f"the ranks' measured speeds differ {spread}, and a rank has too few micro-steps to measure its "
                f"noise (relative standard errors per rank: {shown})")
    bound = math.exp(NOISE_STANDARD_ERRORS * math.hypot(errors[slow], errors[fast])) - 1
    shown = ", ".join(f"{e:.1%}" for e in errors)
    figures = (f"bound {bound:.1%} for rank {slow} against rank {fast}: {NOISE_STANDARD_ERRORS:g} standard errors; "
               f"relative standard errors per rank: {shown}")
    steps = fit_steps(history)
    if all(_scatter_about_line(_rank_points(steps, rank)) is not None for rank in range(len(errors))):
        return (f"the ranks' measured speeds differ {spread}, within the measured noise ({figures}): the "
                f"{len(history)} profiling steps cannot tell that difference from this machine's timing noise")
    return (f"the ranks' measured speeds differ {spread}, within what so few micro-steps can tell apart "
            f"({figures}): where a rank's micro-steps after the warm-up do not fit a line of their own (fewer than 3, "
            f"or one size), its error counts any fixed cost as noise: the bound measures how few the "
            f"{len(history)} profiling steps were, not this machine's timing noise")


def memory_limits(history, capacities, device_names, utilization):
    """Per-rank micro-batch limits from the measured activations, or None without capacities.

    Every profiling step counts (the bytes a forward saves do not warm up). Raises
    RankCannotFitError naming a rank that cannot hold one sample.
    """
    if capacities is None:
        return None
    limits = []
    for rank, capacity in enumerate(capacities):
        measured = [(m, b) for step in history for m, _, b in step[rank]["samples"] if b is not None]
        state = history[-1][rank]["state_bytes"] if history else 0
        if capacity is None or not measured:
            limits.append(None)
            continue
        label = f"data-parallel rank {rank} ({device_names[rank]})"
        activations = fit_activation_model(measured)
        limit = max_micro_batch(capacity, state, activations, utilization, label)
        limits.append(min(limit, measured_peak_limit(history, rank, capacity, activations, utilization, label)))
    return limits


def measured_peak_limit(history, rank, capacity, activations, utilization, label):
    """The largest micro-batch a rank's *measured* peak allows: a rank whose peak
    (``capacity_peak_bytes`` of its last profiling step: measured against its capacity, at the largest micro-batch it ran) passed its budget gets as many
    samples fewer as its activations per sample take to come back under, whatever the prediction
    said. No limit without a reading or under the budget. When samples are not what fills the rank
    (fewer than one sample would be needed), it keeps at most what it ran while the peak is within
    its capacity, and RankCannotFitError names the rank and the bytes once it is beyond."""
    peak = history[-1][rank].get("capacity_peak_bytes") if history else None
    ran = max((m for m, _, _ in history[-1][rank]["samples"]), default=0) if history else 0
    budget = capacity * utilization
    if peak is None or ran < 1 or peak <= budget:
        return float("inf")
    fewer = -(-(peak - budget) // activations.per_sample)
    limit = int(ran - fewer)
    if limit >= 1:
        return limit
    if peak <= capacity:
        return ran
    raise RankCannotFitError(
        f"{label} measured a memory peak of {peak / 2**30:.4g} GiB at {ran} sample(s) per micro-step, beyond its "
        f"capacity {capacity / 2**30:.4g} GiB (budget {budget / 2**30:.4g} GiB: {utilization:.0%}, "
        f"heterogeneous_memory.hbm_utilization_threshold), and one sample would still need "
        f"{(peak - (ran - 1) * activations.per_sample) / 2**30:.4g} GiB ({activations.per_sample / 2**20:.3g} MiB of "
        f"activations per sample); offload optimizer states, use a higher ZeRO stage, or give the rank more memory")


def plan_after_profiling_step(history, plan, gradient_accumulation_steps, limits, allow_per_rank_gas,
                              steps_left, startup_plan=None, strategy=COMPUTE_AWARE):
    """The plan for the next step after a profiling step (a ``ProfilingDecision``).

    Args:
        history: the profiling steps so far (pooled per data-parallel rank).
        plan: the plan in force.
        gradient_accumulation_steps: the configured (base) gas.
        limits: per-rank memory limits (``memory_limits``), or None.
        allow_per_rank_gas: whether ranks may run different gas (ZeRO-0/1 without host optimizer).
        steps_left: profiling steps still to run after this one (0: this decision is final).
        startup_plan: the plan in force at start-up (default ``plan``).
        strategy: the registered strategy that adapts the plan to the measured time models.

    The schedule: the first step (warm-up, left out of the fits) runs the start-up plan; the
    middle ones run the trusted plan so far (``trusted_plan``) with each rank's sizes spread
    toward the measured best plan; the last one runs the start-up plan again, the reference
    against which the switch to the final plan is judged after profiling (its first step paid
    warm-up costs, so it cannot be that reference); then the final plan, not spread. A start-up
    plan beyond the measured memory limits never runs again: memory decides (``trusted_plan``).
    """
    startup_plan = startup_plan or plan
    if steps_left == 1 and not exceeds_limits(startup_plan, limits):
        return ProfilingDecision(startup_plan, None, "the last profiling step runs the start-up plan: the reference "
                                 "the plan chosen after profiling is checked against")
    decision = trusted_plan(history, startup_plan, gradient_accumulation_steps, limits, allow_per_rank_gas, strategy)
    chosen = decision.plan
    if limits is not None:
        shown = ["-" if cap is None else cap for cap in limits]
        chosen = Plan(**{**chosen.to_dict(), "notes": list(chosen.notes) + [f"memory limits (samples per "
                                                                            f"micro-step, per rank): {shown}"]})
    decision = ProfilingDecision(chosen, decision.models, decision.note, decision.best)
    if steps_left <= 0 or set(chosen.gradient_accumulation_steps) != {gradient_accumulation_steps}:
        return decision
    sizes = spread_profiling_sizes(chosen.micro_batch_sizes, sizes_seen(history, plan.world_size), limits,
                                   toward=None if decision.best is None else decision.best.micro_batch_sizes)
    if sizes == list(chosen.micro_batch_sizes):
        return decision
    models = decision.models or [TimeModel(0.0, rate) for rate in measured_rates(history)]
    spread = plan_micro_batches(models, train_batch_size=plan.train_batch_size,
                                gradient_accumulation_steps=gradient_accumulation_steps, strategy=MANUAL,
                                manual=sizes)
    # Shown under the run's own strategy: the sizes are a probe of it, not a user's manual plan.
    spread = Plan(**{**spread.to_dict(), "strategy": chosen.strategy, "notes": list(spread.notes) + [
        "profiling probe: each rank's size spread around the best plan so far, so that every rank is timed at "
        "more than one size"]})
    return ProfilingDecision(spread, decision.models, decision.note, decision.best)


def ran_plan(step, plan):
    """Whether every rank of a pooled profiling step ran ``plan``'s micro-batch size and gas."""
    return all(len(entry["samples"]) == gas and all(sample[0] == size for sample in entry["samples"])
               for entry, size, gas in zip(step, plan.micro_batch_sizes, plan.gradient_accumulation_steps))


def reference_walls(history, startup_plan):
    """Wall seconds (the slowest rank's) of the profiling steps after the first that ran the
    start-up plan: what the plan chosen after profiling is judged against (the first step paid
    warm-up costs). Empty when none did, or the steps carry no wall times."""
    return [max(entry["wall"] for entry in step) for step in history[1:]
            if all(entry.get("wall") is not None for entry in step) and ran_plan(step, startup_plan)]
