# SPDX-License-Identifier: Apache-2.0
"""From the profiling steps to a plan (docs/architecture.md §4.1, 4.4): pure functions, no processes.

A profiling step's measurements, pooled over the ranks (``agreement.merge_replicas``), are one
entry per data-parallel rank: ``{"samples": [(mbs, seconds, activation bytes or None), ...],
"step_overhead": seconds, "state_bytes": bytes}``. ``history`` is the list of those steps.
"""

from .memory import fit_activation_model, max_micro_batch
from .planner import Plan, TimeModel, fit_time_model, plan_micro_batches, plausible_time_model


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
        fit = fit_time_model(samples)  # raises a clear ValueError without samples
        fit = plausible_time_model(fit, sum(m for m, _ in samples) / len(samples))
        fits.append(fit)
        # The optimizer step runs once per step on every rank, at the rank's own speed: a slow
        # rank's is longer, and the others wait for it at the next collective. Spread over the
        # micro-steps, it is part of the fixed cost a that the planner balances.
        overhead = sum(step[rank]["step_overhead"] for step in steps) / len(steps)
        models.append(TimeModel(fit.a + overhead / gradient_accumulation_steps, fit.b))
    return models, fits


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
        limits.append(None if capacity is None or not measured else max_micro_batch(
            capacity, state, fit_activation_model(measured), utilization,
            f"data-parallel rank {rank} ({device_names[rank]})"))
    return limits


def sizes_seen(history, world_size):
    """Sizes each rank was timed at in the steps the fit uses (the warm-up step is not one)."""
    steps = history[1:]
    return [{sample[0] for step in steps for sample in step[rank]["samples"]} for rank in range(world_size)]


def wanted_spread(size):
    """How far apart the profiled sizes of a rank running ``size`` should be: a quarter of it."""
    return max(1, size // 4)


def _spread(sizes):
    return max(sizes) - min(sizes)


def spread_profiling_sizes(sizes, seen, caps=None):
    """Sizes for the next profiling step that widen each rank's range of timed sizes.

    Fitting a + b * mbs needs sizes far enough apart per rank: sizes one sample apart leave the
    split between fixed and per-sample cost to noise, and a model scaled later (dynamic
    rebalancing) or used far from those sizes then misplaces work. A rank whose timed sizes span
    less than ``wanted_spread`` trades that many samples with its neighbour (any split is exact:
    the sum is kept). Ranks pair as (0, 1), (2, 3), ...; in an odd world the last rank trades with
    rank n-2 in the direction that extends the move rank n-2 already made, so neither undoes the
    other's spread.

    Args:
        sizes: per-rank micro-batch sizes the planner chose.
        seen: per-rank sets of sizes already timed.
        caps: per-rank memory limits (entries may be None), or None.
    """
    chosen = list(sizes)
    sizes = list(sizes)

    def trade(big, small):
        delta = min(wanted_spread(sizes[big]), sizes[big] - 1)
        if caps is not None and caps[small] is not None:
            delta = min(delta, caps[small] - sizes[small])
        if delta > 0:
            sizes[big] -= delta
            sizes[small] += delta

    def spread_enough(rank):
        return _spread(seen[rank] | {sizes[rank]}) >= wanted_spread(sizes[rank])

    world = len(sizes)
    for left in range(0, world - 1, 2):
        pair = (left, left + 1)
        if not all(spread_enough(r) for r in pair):
            trade(*sorted(pair, key=lambda r: (-sizes[r], r)))
    if world % 2 == 1 and world > 1 and not spread_enough(world - 1):
        last, neighbour = world - 1, world - 2
        moved = sizes[neighbour] - chosen[neighbour]
        if moved > 0:
            trade(last, neighbour)
        elif moved < 0:
            trade(neighbour, last)
        else:
            trade(*sorted((neighbour, last), key=lambda r: (-sizes[r], r)))
    return sizes


def plan_after_profiling_step(history, plan, gradient_accumulation_steps, limits, allow_per_rank_gas,
                              last_profiling_step):
    """The plan for the next step after a profiling step, and the time models that chose it.

    Args:
        history: the profiling steps so far (pooled per data-parallel rank).
        plan: the plan in force.
        gradient_accumulation_steps: the configured (base) gas.
        limits: per-rank memory limits (``memory_limits``), or None.
        allow_per_rank_gas: whether ranks may run different gas (ZeRO-0/1 without host optimizer).
        last_profiling_step: no further profiling step follows (the sizes are not spread).
    """
    models, _ = measured_time_models(history, gradient_accumulation_steps)
    best = plan_micro_batches(models, train_batch_size=plan.train_batch_size,
                              gradient_accumulation_steps=gradient_accumulation_steps, strategy="compute_aware",
                              max_micro_batch=limits, allow_per_rank_gas=allow_per_rank_gas)
    if limits is not None:
        shown = ["-" if cap is None else cap for cap in limits]
        best = Plan(**{**best.to_dict(), "notes": list(best.notes) + [f"memory limits (samples per micro-step, "
                                                                      f"per rank): {shown}"]})
    if last_profiling_step or set(best.gradient_accumulation_steps) != {gradient_accumulation_steps}:
        return best, models
    sizes = spread_profiling_sizes(best.micro_batch_sizes, sizes_seen(history, plan.world_size), limits)
    if sizes == list(best.micro_batch_sizes):
        return best, models
    return plan_micro_batches(models, train_batch_size=plan.train_batch_size,
                              gradient_accumulation_steps=gradient_accumulation_steps, strategy="manual",
                              manual=sizes), models
