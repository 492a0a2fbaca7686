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
pay more. Hence opt-in, by the estimate.

It needs the activation bytes of one sample. They are measured by the first profiling step, after
the shares are fixed (the optimizer holds its state from the start); before it, the configured
``activation_bytes_per_sample`` is the estimate. Without one, ``"auto"`` keeps its shares from
memory and speed alone, and ``starved_ranks_advice`` (at the end of profiling) names the ranks that
memory held below their part of the batch and the value to configure, from the activations measured.

Pure: no collective; every rank decides alike from the same pool, spec and config.
"""

from .partitions import describe_shares

BISECTION_ROUNDS = 12
"""Halvings of the fraction of the speed-proportional split searched for: within 1/4096 of the best."""


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


def starved_ranks_advice(pool, plan_sizes, per_sample_bytes, speeds, replace_place):
    """After profiling, under ``"auto"`` shares chosen without an activation estimate: when memory held
    some rank below its speed's part of the micro-step (``plan_sizes``) and shares chosen with the
    activations now measured (``per_sample_bytes``, one per rank: the largest is used) would give it
    room for more, the line that says so and what to set; else None.

    ``replace_place(activation_bytes)`` places again on a copy of the pool (the engine's placement
    stays)."""
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
    return (f"memory holds {ranks} below its speed's part of the {samples} samples of a micro-step: the ZeRO shares "
            f"{now} were chosen before any activation was measured. Set heterogeneous_memory."
            f"activation_bytes_per_sample to {int(per_sample)} (measured) and \"auto\" leaves room for "
            f"{fraction:.0%} of that part on every rank ({room} samples), with the shares "
            f"{describe_shares(placement.partition_shares)}; the larger shares cost the other ranks a longer "
            "optimizer step and every rank larger gathers, so compare the step times")
