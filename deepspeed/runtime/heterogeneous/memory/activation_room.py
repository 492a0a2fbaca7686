# SPDX-License-Identifier: Apache-2.0
"""State shares and micro-batches chosen together (``heterogeneous_memory.activation_bytes_per_sample``).

Where memory binds, a rank's share of the ZeRO state and its micro-batch compete for the same bytes:
a share that fills a small device to the brim leaves it room for one sample, and the planner then
gives it one, so the step takes about as long as on the other ranks alone. The fastest step gives
each rank its speed's part of every micro-step (``speed_targets``); a share is worth what it leaves
room for. The pool therefore places the state with each rank's room reduced by
the activations of the largest fraction of that split which every rank can hold, found by bisection
over the placement itself (so everything the pool counts, offload and host shards included, is
counted; ``activation_room``). The micro-batches are then the planner's, within the room the shares
left.

Moving state is not free: the ranks that take it step a larger optimizer partition, and ZeRO-3's
gathers pad every slice to the largest share. Measured on two CPU ranks (docs/memory.md), the samples
moved to the small rank paid for that and no more; on devices where compute dominates the step they
pay more. Hence opt-in, by the estimate, and weighed once the profiling steps have measured the costs:
``forecast_step_seconds`` predicts a step from each rank's measured forward+backward, its optimizer
step scaled by its share and the collectives scaled by the largest share, and ``weigh_shares``
compares the shares in force with the other choice (with the room reserved, or without it) on the
micro-batches the planner would give each; the line after profiling says which is faster and by what
forecast.

It needs the activation bytes of one sample. They are measured by the first profiling step, after
the shares are fixed (the optimizer holds its state from the start); before it, the configured
``activation_bytes_per_sample`` is the estimate. Without one, ``"auto"`` keeps its shares from
memory and speed alone, and ``starved_ranks_advice`` (at the end of profiling) names the ranks that
memory held below their part of the batch and the value to configure, from the activations measured.

Pure: no collective; every rank decides alike from the same pool, spec and config.
"""

import math
from dataclasses import dataclass
from typing import Optional, Tuple

from .partitions import describe_shares

BISECTION_ROUNDS = 12
"""Halvings of the fraction of the speed-proportional split searched for: within 1/4096 of the best."""

WORTH = 0.10
"""The forecast gain below which the shares in force are kept without advice: the forecast's own error,
3-5% on two CPU ranks (docs/memory.md), with room to spare."""


def speed_targets(speeds, samples):
    """Per rank, its speed's part of ``samples`` (a float: the bytes reserved need not be whole samples)."""
    total = float(sum(speeds))
    return [samples * s / total for s in speeds]


def _fits(placement, offloaded_before):
    """A placement the reservation has not made worse: nothing unplaced, and no rank offloading that
    did not offload without the reservation (activations cannot be offloaded; state can, at a cost
    the reservation is not worth)."""
    return not placement.problems and set(placement.offloaded_ranks) <= set(offloaded_before)


def activation_room(place, speeds, per_sample_bytes, samples):
    """``(activation_bytes, fraction)``: the per-rank activation bytes to place the state beside, for
    the largest ``fraction`` in [0, 1] of the speed-proportional split of ``samples`` per micro-step
    whose activations, at ``per_sample_bytes`` each, every rank can hold beside its state.
    ``place(activation_bytes)`` is the pool's placement with them counted in each rank's room.
    ``(None, 0.0)``: nothing to reserve, or not even the smallest part fits (the profiling steps'
    memory limits then decide, as without an estimate)."""
    if not per_sample_bytes or per_sample_bytes <= 0 or samples <= 0:
        return None, 0.0
    targets = speed_targets(speeds, samples)
    offloaded = tuple(place(None).offloaded_ranks)

    def reservation(fraction):
        return [per_sample_bytes * t * fraction for t in targets]

    if _fits(place(reservation(1.0)), offloaded):
        return reservation(1.0), 1.0
    low, high = 0.0, 1.0
    for _ in range(BISECTION_ROUNDS):
        middle = (low + high) / 2
        if _fits(place(reservation(middle)), offloaded):
            low = middle
        else:
            high = middle
    return (reservation(low), low) if low > 0 else (None, 0.0)


def starved_ranks_advice(pool, plan_sizes, per_sample_bytes, speeds, replace_place, weigh=None):
    """After profiling, under ``"auto"`` shares chosen without an activation estimate: when memory held
    some rank below its speed's part of the micro-step (``plan_sizes``) and shares chosen with the
    activations now measured (``per_sample_bytes``, one per rank: the largest is used) would give it
    room for more, the line that says so and what to set; else None.

    ``replace_place(activation_bytes)`` places again on a copy of the pool (the engine's placement
    stays). ``weigh(placement)``, where given, is ``(current, other)``: the ``ShareOption`` of the shares
    in force and of ``placement``'s (``weigh_shares``); the advice to set the estimate is then given only
    when the other shares' forecast step is shorter, and otherwise the line says why the rank stays
    starved."""
    per_sample = max(per_sample_bytes or [0.0])
    if per_sample <= 0 or pool.placement is None:
        return None
    samples = sum(plan_sizes)
    targets = speed_targets(speeds, samples)
    starved = [r for r, (size, target) in enumerate(zip(plan_sizes, targets)) if size + 1 <= target]
    if not starved:
        return None
    activations, fraction = activation_room(replace_place, speeds, per_sample, samples)
    placement = replace_place(activations) if activations is not None else None
    if placement is None or placement.partition_shares is None:
        return None
    # What the reservation guarantees each rank: room for this many whole samples beside its state.
    room = [int(fraction * target) for target in targets]
    better = [r for r in starved if room[r] > plan_sizes[r]]
    if not better:
        return None
    now = describe_shares(pool.placement.partition_shares or [1.0 / len(plan_sizes)] * len(plan_sizes))
    ranks = ", ".join(f"rank {r} ({plan_sizes[r]} of {targets[r]:.3g})" for r in better)
    held = f"memory holds {ranks} below its speed's part of the {samples} samples of a micro-step"
    weighed = weigh(placement) if weigh is not None else None
    if weighed is not None and not _faster(*weighed):
        current, other = weighed
        sizes = "no plan" if other.sizes is None else f"micro-batches {list(other.sizes)}"
        return (f"{held}; shares that leave it room would not make the step faster: "
                f"{describe_shares(placement.partition_shares)} with {sizes}, forecast "
                f"{other.seconds:.3g} s per step against {current.seconds:.3g} s now (the larger shares lengthen "
                f"the other ranks' optimizer step and pad every gather to the largest share), so the shares "
                f"{now} stay (activations measured: {int(per_sample)} bytes per sample)")
    forecast = "" if weighed is None else f" (forecast {_forecast_text(*weighed)})"
    return (f"{held}: the ZeRO shares "
            f"{now} were chosen before any activation was measured. Set heterogeneous_memory."
            f"activation_bytes_per_sample to {int(per_sample)} (measured) and \"auto\" leaves room for "
            f"{fraction:.0%} of that part on every rank ({room} samples), with the shares "
            f"{describe_shares(placement.partition_shares)}{forecast}")


def reserved_room_advice(current, other):
    """After profiling, with room reserved for activations (``activation_bytes_per_sample`` set): when
    the shares ``"auto"`` chooses without the reservation (``other``) forecast a shorter step than the
    shares in force (``current``; ``ShareOption`` each), the line that says to remove it; else None."""
    if not _faster(current, other):
        return None
    return (f"the room reserved for activations (heterogeneous_memory.activation_bytes_per_sample) costs more "
            f"than it gives: shares {describe_shares(current.shares)} with micro-batches {list(current.sizes)}; "
            f"without it \"auto\" chooses {describe_shares(other.shares)} with {list(other.sizes)}, forecast "
            f"{_forecast_text(current, other)}. Remove activation_bytes_per_sample")


def _faster(current, other):
    return other.sizes is not None and other.seconds < current.seconds * (1.0 - WORTH)


def _forecast_text(current, other):
    gain = 1.0 - other.seconds / current.seconds
    return (f"{other.seconds:.3g} s per step against {current.seconds:.3g} s now, {gain:.0%} less, from the "
            "measured forward+backward, optimizer step and collectives")


@dataclass(frozen=True)
class ShareOption:
    """One choice of ZeRO shares weighed after profiling: the shares, the planner's micro-batches within
    the room they leave (None: some rank cannot hold one sample) and the forecast step seconds."""

    shares: Tuple[float, ...]
    sizes: Optional[Tuple[int, ...]]
    seconds: float


def limits_after_move(limits, per_sample_bytes, held_now, held_then):
    """Per rank, its micro-batch limit once the bytes a placement keeps on it besides activations (its
    state, buffers) move from ``held_now`` to ``held_then``: the bytes it sheds hold that many more
    samples of ``per_sample_bytes``, the bytes it takes that many fewer. None stays None (no limit)."""
    moved = []
    for limit, now, then in zip(limits, held_now, held_then):
        if limit is None or now is None or then is None:
            moved.append(limit)
        else:
            moved.append(max(0, limit + math.floor((now - then) / per_sample_bytes)))
    return moved


def forecast_step_seconds(fits, sizes, gas, overheads, collective_s, shares_now, shares):
    """Seconds of one optimizer step at micro-batches ``sizes`` (``gas`` each) on the ZeRO ``shares``,
    from what the profiling steps measured on ``shares_now``:

    - each rank's forward+backward, ``gas`` micro-steps of its fitted ``a + b * m`` (``fits``: own time,
      collectives excluded), and its optimizer step (``overheads``: measured seconds) scaled by its share
      of the state, which is what that step updates;
    - the step's collectives (``collective_s``: the seconds of the rank that waited least, i.e. the
      transfers themselves), scaled by the largest share: ZeRO's gathers and reductions move every
      rank's slice padded to the largest.

    The slowest rank sets the step; collectives are not overlapped with compute in this forecast."""
    own = []
    for fit, size, overhead, now, then in zip(fits, sizes, overheads, shares_now, shares):
        optimizer = overhead * (then / now) if now > 0 else overhead
        own.append(gas * fit.micro_step_time(size) + optimizer)
    largest_now = max(shares_now)
    return max(own) + (collective_s * max(shares) / largest_now if largest_now > 0 else collective_s)


def weigh_shares(options, fits, gas, overheads, collective_s, shares_now, plan_for):
    """``[ShareOption, ...]`` for ``options`` (``(shares, micro-batch limits)`` pairs), each with the
    micro-batches ``plan_for(limits)`` gives (None when it raises: no plan fits) and its forecast."""
    weighed = []
    for shares, limits in options:
        try:
            sizes = tuple(plan_for(limits))
        except (ValueError, RuntimeError):
            weighed.append(ShareOption(tuple(shares), None, math.inf))
            continue
        seconds = forecast_step_seconds(fits, sizes, gas, overheads, collective_s, shares_now, shares)
        weighed.append(ShareOption(tuple(shares), sizes, seconds))
    return weighed
