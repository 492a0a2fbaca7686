# SPDX-License-Identifier: Apache-2.0
"""Exact integer min-max splits of a batch over ranks with linear time models.

A rank's sizes 1, 2, 3, ... are "slots" with increasing costs; the best split takes the cheapest
slots. Bisection on the cost finds a bracket around the optimum and a heap gives back (or fills)
single slots until the split lands exactly on the batch, ties going to lower ranks so that every
rank computes the same split. Everything here works on lists indexed by rank; the allocation rules
(``allocation.py``) call ``balance`` and ``per_rank_gas_splits``. Pure logic.
"""

import heapq
import math

import numpy as np



def _bisect(holdings, weights, units, high, spacing):
    """Sizes just below and just above the cheapest way to hold ``units``.

    ``holdings(T)`` gives every rank's largest size whose cost is at most T (at least 1).
    Bisection stops once the bracket is narrower than ``spacing``, the smallest cost of one more
    slot, so at most one slot per rank lies between its ends. Returns (sizes at the low end: less
    than ``units``, or all ones; sizes at the high end: at least ``units``).
    """
    low = 0.0
    if int(holdings(low) @ weights) >= units:
        high = low
    while high - low > spacing:
        middle = (low + high) / 2
        if not low < middle < high:
            break  # adjacent floats: the spacing is below their resolution
        if int(holdings(middle) @ weights) >= units:
            high = middle
        else:
            low = middle
    return holdings(low).tolist(), holdings(high).tolist()


def _adjust(cost, sizes, caps, steps, remaining, direction):
    """Move ``remaining`` samples by growing (+1: cheapest next slot first, ties to the lower rank)
    or shrinking (-1: most expensive slot first, ties to the higher rank) one slot at a time.
    ``cost(rank, size)`` is the cost of holding ``size``. Returns (sizes, samples that no slot could
    move without overshooting)."""
    sizes = list(sizes)

    def key(rank):
        price = cost(rank, sizes[rank] + (direction > 0))
        return (price, rank) if direction > 0 else (-price, -rank)

    movable = lambda rank: 1 <= sizes[rank] + direction <= caps[rank]
    heap = [key(rank) for rank in range(len(sizes)) if movable(rank)]
    heapq.heapify(heap)
    while remaining and heap:
        rank = abs(heapq.heappop(heap)[1])
        if steps[rank] > remaining:
            continue  # a whole slot here would overshoot; finer steps may still fit
        sizes[rank] += direction
        remaining -= steps[rank]
        if movable(rank):
            heapq.heappush(heap, key(rank))
    return sizes, remaining


def _exact(cost, bracket, caps, steps, units):
    """From the high end of the bracket give back the most expensive slots; if coarse steps get
    stuck above ``units``, fill the low end with the cheapest slots instead. None if neither lands."""
    below, above = bracket
    surplus = lambda sizes: sum(m * k for m, k in zip(sizes, steps)) - units
    if surplus(above) >= 0:
        sizes, left = _adjust(cost, above, caps, steps, surplus(above), -1)
        if not left:
            return sizes
    if surplus(below) <= 0:
        sizes, left = _adjust(cost, below, caps, steps, -surplus(below), +1)
        if not left:
            return sizes
    return None


def _linear_bracket(models, units, caps, steps):
    """``_bisect`` for costs ``steps_i * (a_i + b_i * m)``; returns (bracket, cost)."""
    a = np.array([model.a for model in models])
    b = np.array([model.b for model in models])
    k = np.array(steps, dtype=np.float64)
    cap = np.array(caps, dtype=np.float64)

    def holdings(limit):
        m = np.floor((limit / k - a) / b)
        # The float quotient can be off by one either way; settle on the rule t_i(m) <= limit itself,
        # computed as TimeModel computes it so that the bracket and the heap agree on ties.
        m += k * (a + b * (m + 1)) <= limit
        m -= k * (a + b * m) > limit
        return np.clip(m, 1, cap).astype(np.int64)

    bracket = _bisect(holdings, np.array(steps, dtype=np.int64), units, float(np.max(k * (a + b * cap))),
                      float(np.min(k * b)))
    return bracket, lambda rank, size: steps[rank] * models[rank].micro_step_time(size)


def balance(models, units, caps, steps):
    """Integer ``m_i`` in ``[1, caps[i]]`` minimising the slowest ``steps_i * (a_i + b_i * m_i)`` subject
    to ``sum(steps_i * m_i) == units``; None when the steps cannot meet ``units`` exactly.

    Rank i's sizes 2, 3, ... are slots costing ``t_i(m)`` and worth ``steps_i`` samples; the best
    split takes the cheapest slots. With all steps 1 the give-back lands exactly on them: the split
    is optimal, and ties go to the lower rank, so every rank computes the same plan. Needs
    ``sum(steps) <= units <= sum(steps * caps)``.
    """
    bracket, cost = _linear_bracket(models, units, caps, steps)
    return _exact(cost, bracket, caps, steps, units)


def _shares_with_fewest_micro_steps(models, units, caps):
    """Samples per step n_i balancing ``ceil(n_i / caps[i]) * a_i + b_i * n_i``: each rank's time when
    it runs the fewest micro-steps that fit its memory (micro-batch sizes left to round later)."""
    a = np.array([model.a for model in models])
    b = np.array([model.b for model in models])
    cap = np.array(caps, dtype=np.float64)

    def holdings(limit):
        # Full micro-batches that fit in the limit, then as much of one more micro-step as fits.
        full = np.floor(limit / (a + b * cap))
        full += (full + 1) * a + b * ((full + 1) * cap) <= limit
        full -= full * a + b * (full * cap) > limit
        partial = np.floor((limit - (full + 1) * a) / b)
        partial += (full + 1) * a + b * (partial + 1) <= limit
        partial -= (full + 1) * a + b * partial > limit
        return np.clip(np.maximum(full * cap, np.minimum(partial, (full + 1) * cap)), 1, units).astype(np.int64)

    def cost(rank, share):
        return -(-share // caps[rank]) * models[rank].a + models[rank].b * share

    world = len(models)
    bracket = _bisect(holdings, np.ones(world, dtype=np.int64), units, max(cost(r, units) for r in range(world)),
                      float(np.min(b)))
    return _exact(cost, bracket, [units] * world, [1] * world, units)


def _fewest_micro_steps(units, cap):
    """The smallest divisor g of ``units`` with ``units / g <= cap``: fewest micro-steps that fit."""
    need, best = -(-units // cap), units
    for divisor in range(1, math.isqrt(units) + 1):
        if units % divisor == 0:
            for candidate in (divisor, units // divisor):
                if need <= candidate < best:
                    best = candidate
    return best


def per_rank_gas_splits(models, units, caps):
    """Candidate (sizes, multiples) in which rank i runs ``multiples[i]`` micro-steps of
    ``sizes[i]`` samples; empty when every rank's share fits its memory in one micro-step.

    Rule: the samples per step n_i are balanced as if each rank ran the fewest micro-steps its
    memory allows, ``ceil(n_i / caps[i])`` (1 where the share fits, so those ranks keep the
    configured gas). Whole micro-batches are then made in two ways, and the caller keeps the
    faster: factor every n_i into the fewest micro-steps that divide it; or fix
    ``k_i = ceil(n_i / caps[i])`` and balance the sizes again (when whole micro-steps cannot meet
    the batch, the rank whose time ends up lowest takes the difference).
    """
    shares = _shares_with_fewest_micro_steps(models, units, caps)
    if all(share <= cap for share, cap in zip(shares, caps)):
        return []
    factored = [_fewest_micro_steps(share, cap) for share, cap in zip(shares, caps)]
    multiples = [-(-share // cap) for share, cap in zip(shares, caps)]
    sizes = balance(models, units, caps, multiples)
    if sizes is None:
        sizes, multiples = _place_remainder(models, units, caps, multiples)
    return [([n // k for n, k in zip(shares, factored)], factored), (sizes, multiples)]


def _place_remainder(models, units, caps, multiples):
    """Sizes for fixed multiples filled to just under ``units``; one rank then takes the rest with
    the fewest micro-steps that fit its memory: the rank whose time ends up lowest."""
    (below, _), cost = _linear_bracket(models, units, caps, multiples)
    missing = units - sum(m * k for m, k in zip(below, multiples))
    sizes, missing = _adjust(cost, below, caps, multiples, missing, +1)
    options = []
    for rank, model in enumerate(models):
        share = multiples[rank] * sizes[rank] + missing
        steps = _fewest_micro_steps(share, caps[rank])
        options.append((steps * model.micro_step_time(share // steps), rank, steps, share // steps))
    _, rank, steps, size = min(options)
    sizes, multiples = list(sizes), list(multiples)
    sizes[rank], multiples[rank] = size, steps
    return sizes, multiples
