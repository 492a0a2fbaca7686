# SPDX-License-Identifier: Apache-2.0
"""The sizes the middle profiling steps probe (``profiling.plan_after_profiling_step``): each rank's
timed micro-batch sizes spread far enough apart for its ``a + b * mbs`` fit. Pure: no processes."""


def sizes_seen(history, world_size):
    """Sizes each rank was timed at in the steps the fit uses (the warm-up step is not one)."""
    steps = history[1:]
    return [{sample[0] for step in steps for sample in step[rank]["samples"]} for rank in range(world_size)]


def wanted_spread(size):
    """How far apart the profiled sizes of a rank running ``size`` should be: a quarter of it."""
    return max(1, size // 4)


def _spread(sizes):
    return max(sizes) - min(sizes)


def spread_profiling_sizes(sizes, seen, caps=None, toward=None):
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
        toward: per-rank sizes of the (unconfirmed) measured best plan, or None: within a pair,
            the rank that plan gives more work takes the samples, so the timed sizes reach
            toward where the final plan may go (without it, the larger rank gives).
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

    def giver_first(pair):
        if toward is not None:
            wants = [toward[r] - sizes[r] for r in pair]
            if wants[0] != wants[1]:
                return pair if wants[0] < wants[1] else pair[::-1]
        return sorted(pair, key=lambda r: (-sizes[r], r))

    world = len(sizes)
    for left in range(0, world - 1, 2):
        pair = (left, left + 1)
        if not all(spread_enough(r) for r in pair):
            trade(*giver_first(pair))
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
