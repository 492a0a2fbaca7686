# SPDX-License-Identifier: Apache-2.0
"""How an epoch is split among the ranks (``sampler.py``): pure values, no processes.

A ``Split`` is one round's micro-batch sizes and accumulation steps per rank; a ``Segment`` says
from which round of the epoch (and position of its permutation) a split applies. A sampler's
epoch is a list of segments, one more at each plan change.
"""

from dataclasses import dataclass
from typing import Tuple


@dataclass(frozen=True)
class Split:
    micro_batch_sizes: Tuple[int, ...]
    accumulation_steps: Tuple[int, ...]

    @property
    def round_size(self):
        return sum(m * g for m, g in zip(self.micro_batch_sizes, self.accumulation_steps))

    def share(self, rank):
        """(offset, length) of ``rank``'s slice within a round."""
        shares = [m * g for m, g in zip(self.micro_batch_sizes, self.accumulation_steps)]
        return sum(shares[:rank]), shares[rank]


@dataclass(frozen=True)
class Segment:
    """From round ``first_round`` of the epoch on, ``split`` applies; that round starts at
    ``first_position`` of the epoch's permutation."""

    first_round: int
    first_position: int
    split: Split


def positive_ints(values, what):
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what}[{index}] = {value!r} must be a positive integer")
    return tuple(values)


def make_split(micro_batch_sizes, gradient_accumulation_steps, num_replicas):
    sizes = list(micro_batch_sizes)
    if not sizes:
        raise ValueError("micro_batch_sizes is empty; give one size per data-parallel rank")
    if num_replicas is not None and len(sizes) != num_replicas:
        raise ValueError(f"micro_batch_sizes has {len(sizes)} entries but there are {num_replicas} data-parallel "
                         f"ranks (num_replicas); give one size per rank")
    steps = gradient_accumulation_steps
    if steps is None:
        steps = [1] * len(sizes)
    elif isinstance(steps, int):
        steps = [steps] * len(sizes)
    steps = list(steps)
    if len(steps) != len(sizes):
        raise ValueError(f"gradient_accumulation_steps has {len(steps)} entries for {len(sizes)} ranks")
    return Split(positive_ints(sizes, "micro_batch_sizes"), positive_ints(steps, "gradient_accumulation_steps"))


def segments_from_state(state):
    try:
        segments = [
            Segment(int(entry["first_round"]), int(entry["first_position"]),
                     make_split(entry["micro_batch_sizes"], entry["gradient_accumulation_steps"], None))
            for entry in state["segments"]
        ]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"sampler state: malformed 'segments' ({exc!r}); expected a list of "
                         f"{{first_round, first_position, micro_batch_sizes, gradient_accumulation_steps}}") from exc
    if not segments or segments[0].first_round != 0:
        raise ValueError("sampler state: 'segments' must start at round 0")
    return segments


def resolve_rank(rank, num_replicas):
    if rank is None:
        if num_replicas == 1:
            return 0
        from deepspeed import comm as dist  # only for this default: the layout itself is pure
        if not dist.is_initialized():
            raise ValueError("rank is required when deepspeed.comm is not initialized (pass the data-parallel rank)")
        rank = dist.get_rank()
    if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < num_replicas:
        raise ValueError(f"rank {rank!r} is out of range for {num_replicas} data-parallel ranks (one "
                         f"micro-batch size per rank)")
    return rank
