# SPDX-License-Identifier: Apache-2.0
"""Memory-proportional ZeRO-1/2 partitions (``heterogeneous_memory.zero_partitions``).

Upstream ZeRO-1/2 cuts each flattened parameter group into ``world_size`` equal slices; rank r owns
slice r of the optimizer state (and, in ZeRO-2, of the gradients), so the device with the least
memory decides what fits. Here rank r owns a share ``f_r`` instead. Two decisions, both pure:

- ``choose_partition_shares``: the shares, from each rank's speed (the optimizer step runs on every
  rank at once after the gradient reduction, so a rank's step time is its share over its speed:
  shares proportional to speed equalise it) and its memory (a share may not exceed what the rank's
  room holds; the excess goes to ranks with room, in proportion to their speed).
  ``HeterogeneousMemoryPool.place`` (``pool.py``) calls it for an engine, together with
  the offload decision for ranks whose share still does not fit.
- ``partition_bounds``: where each rank's slice of one flat group starts and how long it is. Every
  boundary sits on a multiple of the alignment upstream keeps for its collectives, every slice is
  non-empty, and the padding upstream adds at the end of the flat group falls into the last slice.

The layout is fixed when the ZeRO optimizer is built and never changes with rebalancing (moving
optimizer state between ranks would cost more than the plan change gains). Gradient reduction
already sends each slice to its owner through ownership tables, so only those tables and the
all-gather of updated parameters follow the layout (``zero-uneven-partitions.patch``); every rank
runs the same collectives, with the same sizes, whatever its share.
"""

import hashlib
import math
from typing import Optional, Sequence, Tuple


class PartitionLayoutError(ValueError):
    """Shares or a group that cannot be partitioned as asked."""


def check_shares(shares, world_size, key="heterogeneous_memory.zero_partitions"):
    """Validate explicit shares: one positive number per data-parallel rank, summing to 1."""
    shares = tuple(float(s) for s in shares)
    if len(shares) != world_size:
        raise PartitionLayoutError(f"{key} has {len(shares)} shares {list(shares)} but the data-parallel "
                                   f"world has {world_size} ranks; give one share per rank")
    if any(not math.isfinite(s) or s <= 0 for s in shares):
        raise PartitionLayoutError(f"{key} = {list(shares)}: every share must be a positive number")
    if abs(sum(shares) - 1.0) > 1e-6:
        raise PartitionLayoutError(f"{key} = {list(shares)} sums to {sum(shares):.6g}; shares must sum to 1")
    return shares


def choose_partition_shares(speeds, rooms=None, state_bytes=None, minimum=0.02):
    """Each rank's share of the partitioned ZeRO state.

    Args:
        speeds: per rank, a relative speed (> 0) of its optimizer step.
        rooms: per rank, bytes left for the partitioned state once everything a rank holds whole
            (parameters, ZeRO-1 gradients, activations) is counted, or None where no limit is
            known; None: no memory limit at all.
        state_bytes: bytes of the whole partitioned state (all ranks together); needed with rooms.
        minimum: no rank's share below this fraction of an even share (a slice must stay non-empty
            and its collectives worth their latency).

    Returns a tuple of shares summing to 1. When the ranks' rooms together cannot hold the state,
    shares follow the rooms (the fullest layout there is) and the memory check that follows names
    the rank that does not fit.
    """
    world = len(speeds)
    if world == 0 or any(not (s > 0) for s in speeds):
        raise PartitionLayoutError(f"speeds must be positive, got {list(speeds)}")
    floor = minimum / world
    caps = [1.0] * world
    if rooms is not None and state_bytes:
        caps = [1.0 if room is None else max(0.0, room) / state_bytes for room in rooms]
        if sum(caps) < 1.0:
            known = [c for c in caps if c < 1.0]
            if len(known) == world:
                total = sum(known) or 1.0
                return _normalised(_with_floor([c / total for c in known], floor))
    shares = [None] * world
    free = list(range(world))
    mass = 1.0
    # Water-filling: a rank whose speed share exceeds its cap keeps its cap; the rest is shared
    # again among the others in proportion to their speeds, until no cap is exceeded.
    while free:
        speed_sum = sum(speeds[r] for r in free)
        over = [r for r in free if mass * speeds[r] / speed_sum > caps[r]]
        if not over:
            for r in free:
                shares[r] = mass * speeds[r] / speed_sum
            break
        for r in over:
            shares[r] = caps[r]
            mass -= caps[r]
        capped = set(over)
        free = [r for r in free if r not in capped]
    return _normalised(_with_floor([s or 0.0 for s in shares], floor))


def _with_floor(shares, floor):
    """Raise shares below ``floor`` to it, taking the difference from the others in proportion to
    what they hold above the floor (so the sum stays 1)."""
    raised = [max(floor, s) for s in shares]
    excess = sum(raised) - 1.0
    above = [r - floor for r in raised]
    room = sum(above)
    if excess <= 0 or room <= 0:
        return raised
    return [r - excess * a / room for r, a in zip(raised, above)]


def _normalised(shares):
    total = sum(shares)
    # Rounded so that every rank, and a checkpoint, sees the same decimal numbers.
    shares = [round(s / total, 6) for s in shares]
    shares[-1] = round(1.0 - sum(shares[:-1]), 6)
    return tuple(shares)


def is_even(shares: Optional[Sequence[float]]):
    return shares is None or max(shares) - min(shares) < 1e-9


def partition_bounds(total_numel, payload_numel, shares, alignment) -> Tuple[Tuple[int, int], ...]:
    """``(start, numel)`` of each rank's slice of a flat group of ``total_numel`` elements whose
    first ``payload_numel`` are parameters (the rest is upstream's tail padding).

    Boundaries are multiples of ``alignment`` placed at the shares' cumulative fractions of the
    payload; each slice holds at least one alignment unit; the last slice ends at ``total_numel``
    and so carries the tail padding. ``total_numel`` is a multiple of ``alignment * world_size``
    (upstream pads the flat group so), which leaves room for every slice.
    """
    world = len(shares)
    if total_numel % alignment:
        raise PartitionLayoutError(f"a flat group of {total_numel} elements is not a multiple of the "
                                   f"alignment {alignment}")
    units = total_numel // alignment
    if units < world:
        raise PartitionLayoutError(f"a flat group of {total_numel} elements cannot give {world} ranks "
                                   f"an aligned slice of {alignment} elements each")
    payload_units = min(units, -(-max(0, payload_numel) // alignment))
    cuts = [0]
    running = 0.0
    for share in shares[:-1]:
        running += share
        cuts.append(int(round(running * payload_units)))
    cuts.append(units)
    # Every slice non-empty: push cuts forward where two meet, then back from the end.
    for k in range(1, world):
        cuts[k] = max(cuts[k], cuts[k - 1] + 1)
    for k in range(world - 1, 0, -1):
        cuts[k] = min(cuts[k], cuts[k + 1] - 1)
    return tuple((cuts[k] * alignment, (cuts[k + 1] - cuts[k]) * alignment) for k in range(world))


def even_bounds(total_numel, world_size):
    """Upstream's layout: ``world_size`` equal slices (``total_numel`` is a multiple of it)."""
    size = total_numel // world_size
    return tuple((rank * size, size) for rank in range(world_size))


def layout_digest(bounds_per_group):
    """A short digest of every group's bounds: ranks compare it before the first collective that
    depends on the layout, so a disagreement is an error rather than a hang or wrong gradients."""
    text = ";".join(",".join(f"{s}+{n}" for s, n in bounds) for bounds in bounds_per_group)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def describe_shares(shares):
    return "[" + ", ".join(f"{s:.3f}" for s in shares) + "]"


RECUT_TOLERANCE = 0.1
"""A model cut before the engine started is cut again only when some rank's share would change by more
than this fraction of it: a re-cut moves every parameter once, a small change is not worth it."""


def shares_differ(current, wanted, world_size, tolerance=RECUT_TOLERANCE):
    """Whether ``wanted`` moves some rank's share by more than ``tolerance`` of its ``current`` one
    (either may be None or "even": equal shares)."""
    def shares_of(value):
        return [1.0 / world_size] * world_size if value is None or value == "even" else [float(v) for v in value]

    return any(abs(w - c) > tolerance * c for c, w in zip(shares_of(current), shares_of(wanted)))


class ZeroPartitionLayout:
    """The uneven layout of one ZeRO-1/2 optimizer: per parameter group, every rank's slice.

    Built by ``zero_partition_layout`` when the shares are uneven (the optimizer keeps None and
    upstream's equal slices otherwise); the optimizer adds each flat group as it creates it."""

    CHECKPOINT_KEY = "heterogeneous_partition_bounds"

    def __init__(self, shares, alignment):
        self.shares = tuple(shares)
        self.alignment = int(alignment)
        self.groups = []

    @property
    def world_size(self):
        return len(self.shares)

    def add_group(self, total_numel, payload_numel):
        # A group too small to give every rank a few aligned units of parameters (a group of
        # biases, say) keeps upstream's equal slices: nothing to gain, and its padding then sits
        # where upstream expects it.
        if payload_numel < 4 * self.alignment * self.world_size:
            bounds = even_bounds(total_numel, self.world_size)
        else:
            bounds = partition_bounds(total_numel, payload_numel, self.shares, self.alignment)
        self.groups.append(bounds)
        return bounds

    def narrow(self, flat, group):
        """Views of ``flat`` (a flat group, or a tensor of its size) for every rank's slice."""
        return [flat.narrow(0, start, numel) for start, numel in self.groups[group]]

    def digest(self):
        return layout_digest(self.groups)

    def checkpoint_value(self):
        return [list(map(list, bounds)) for bounds in self.groups]


def partition_span(optimizer, group_id, partition_id):
    """``(start, numel)`` of data-parallel rank ``partition_id``'s slice of flat group ``group_id`` of
    a ZeRO-1/2 optimizer: the slice of its ``partition_layout`` when the slices are uneven, else
    upstream's equal slice of ``bit16_groups_flat[group_id]``. The optimizer's ownership tables
    (``initialize_gradient_partition``, ``_link_all_hp_params``) take their slices from here."""
    if optimizer.partition_layout is not None:
        return optimizer.partition_layout.groups[group_id][partition_id]
    from deepspeed import comm as dist
    size = optimizer.bit16_groups_flat[group_id].numel() // dist.get_world_size(
        group=optimizer.real_dp_process_group[group_id])
    return partition_id * size, size


def saved_bounds(state_dict):
    """The layout a ZeRO-1/2 checkpoint was saved with (None: upstream's equal slices)."""
    saved = state_dict.get(ZeroPartitionLayout.CHECKPOINT_KEY)
    return None if saved is None else [tuple(tuple(b) for b in bounds) for bounds in saved]


def check_checkpoint_layout(state_dict, layout, flat_numels, world_size):
    """Refuse a per-rank ZeRO-1/2 load whose saved slices differ from this run's: upstream would copy
    each rank's saved slice into a slice of another length (zero-padding a shorter one), which
    silently corrupts the optimizer state."""
    saved = saved_bounds(state_dict)
    if saved is None:
        saved = [even_bounds(n, world_size) for n in flat_numels]
    current = layout.groups if layout is not None else [even_bounds(n, world_size) for n in flat_numels]
    if [tuple(b) for b in saved] == [tuple(b) for b in current]:
        return

    def shares_of(bounds_per_group):
        bounds = max(bounds_per_group, key=lambda b: sum(n for _, n in b))
        total = sum(n for _, n in bounds)
        return describe_shares([n / total for _, n in bounds])

    raise PartitionLayoutError(
        f"this ZeRO checkpoint was saved with partition shares {shares_of(saved)} of the optimizer state, "
        f"but this run partitions it as {shares_of(current)} (heterogeneous_memory.zero_partitions); a "
        f"per-rank load would put each saved slice into a slice of another size. Load it with the layout "
        f"it was saved with (set heterogeneous_memory.zero_partitions to the saved shares), or let the load "
        f"re-partition it (heterogeneous_config.elastic.repartition: true, the default, converts it to a "
        f"universal checkpoint, which re-partitions any layout)")


def zero_partition_layout(shares, alignment, world_size, cpu_offload=False, has_moe_layers=False,
                          optimizer=None):
    """The layout a ZeRO-1/2 optimizer uses for ``shares`` (None: upstream's equal slices), with the
    combinations the uneven layout does not drive refused by name."""
    if shares is None or is_even(shares):
        return None
    shares = check_shares(shares, world_size)
    key = "heterogeneous_memory.zero_partitions"
    if cpu_offload:
        raise PartitionLayoutError(
            f"{key} gives the ranks uneven shares {describe_shares(shares)}, but "
            "zero_optimization.offload_optimizer is set: the offloaded ZeRO-1/2 path keeps its own "
            "equal-slice tables. Use even shares (\"even\") with offload, or drop offload_optimizer")
    if has_moe_layers:
        raise PartitionLayoutError(
            f"{key} gives the ranks uneven shares {describe_shares(shares)}, but the model has MoE "
            "layers, whose expert groups partition their own state; use \"even\" for MoE models")
    if optimizer is not None and type(optimizer).__name__ == "MuonWithAuxAdam":
        raise PartitionLayoutError(
            f"{key} gives the ranks uneven shares {describe_shares(shares)}, but the Muon optimizer "
            "gathers whole matrices across slices; use \"even\" with Muon")
    return ZeroPartitionLayout(shares, alignment)


def ranks_differing_from_rank_0(value, group=None):
    """All-gather one int64 per rank (a digest) over ``group``; the ranks whose value differs from
    rank 0's (empty when all agree, or alone)."""
    import torch
    from deepspeed import comm as dist
    from deepspeed.accelerator import get_accelerator
    world = dist.get_world_size(group=group)
    if world == 1:
        return []
    mine = torch.tensor([value], dtype=torch.int64, device=get_accelerator().current_device_name())
    everyone = [torch.zeros_like(mine) for _ in range(world)]
    dist.all_gather(everyone, mine, group=group)
    values = [int(t.item()) for t in everyone]
    return [rank for rank, value in enumerate(values) if value != values[0]]


def agree_on_layout(layout, group=None):
    """Every rank compares the layout's digest before the first collective that depends on it; a
    rank whose layout differs stops every rank with an error naming it (no hang, no wrong
    gradient)."""
    differing = ranks_differing_from_rank_0(int(layout.digest(), 16) & (2**62 - 1), group)
    if differing:
        raise PartitionLayoutError(
            f"the ranks disagree on the ZeRO partition layout (shares {describe_shares(layout.shares)} on this "
            f"rank; data-parallel ranks {differing} differ from rank 0): every rank must be given the same "
            "heterogeneous_memory.zero_partitions and the same model")


def gather_uneven_partitions(groups_flat, partitioned_param_groups, dp_process_group):
    """All-gather of updated parameters for uneven slices (``all_gather_dp_groups``); returns False,
    having done nothing, when every group's slices are equal (upstream's path then runs).

    ``all_gather_into_tensor`` needs equal sizes and gloo's ``all_gather`` does too, so each
    rank's slice is broadcast from its owner in rank order: every rank runs the same broadcasts
    with the same sizes, and no rank holds more than the flat group it already has."""
    from deepspeed import comm as dist
    if all(len({p.numel() for p in parts}) == 1 for parts in partitioned_param_groups):
        return False
    for group_id, parts in enumerate(partitioned_param_groups):
        group = dp_process_group[group_id]
        if dist.get_world_size(group=group) == 1:
            continue
        for owner, part in enumerate(parts):
            dist.broadcast(part, dist.get_global_rank(group, owner), group=group)
    return True
