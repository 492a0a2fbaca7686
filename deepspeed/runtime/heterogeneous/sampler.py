# SPDX-License-Identifier: Apache-2.0
"""Uneven data-parallel sampling: rank r takes mbs_r of every sum(mbs) samples (docs/architecture.md §4.3).

An epoch is a permutation of the dataset (seeded with seed + epoch, as torch's
DistributedSampler does) consumed in *rounds*. In each round every rank takes a contiguous slice
of ``mbs_r * gas_r`` samples, after the slices of the lower ranks, as ``gas_r`` micro-batches of
``mbs_r``. Without per-rank gradient accumulation (the default, gas_r = 1) a round is one global
micro-batch. Every rank runs the same number of rounds per epoch, so the ranks reach each
collective together.

A plan change takes effect at a round boundary: the prefix of the permutation consumed so far
stays consumed and the rest is split with the new sizes, so no sample of the epoch is repeated
or dropped.

Two front ends share the layout:

- ``HeterogeneousDistributedSampler`` yields indices, for ``DataLoader(batch_size=mbs_r,
  sampler=...)``, e.g. in users' own loaders. A plan change changes the batch size, so it needs a
  new DataLoader; that loader's first pass resumes at the change.
- ``HeterogeneousBatchSampler`` yields one list of indices per micro-batch, for
  ``DataLoader(batch_sampler=...)``. It looks up the split in force when it starts each round, so
  a change applies without a new loader, from the first round the loader has not fetched yet
  (a loader with workers fetches a few batches ahead).
"""

from dataclasses import dataclass
from typing import Tuple

import torch
from torch.utils.data import Sampler


@dataclass(frozen=True)
class _Split:
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
class _Segment:
    """From round ``first_round`` of the epoch on, ``split`` applies; that round starts at
    ``first_position`` of the epoch's permutation."""

    first_round: int
    first_position: int
    split: _Split


def _positive_ints(values, what):
    for index, value in enumerate(values):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{what}[{index}] = {value!r} must be a positive integer")
    return tuple(values)


def _make_split(micro_batch_sizes, gradient_accumulation_steps, num_replicas):
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
    return _Split(_positive_ints(sizes, "micro_batch_sizes"), _positive_ints(steps, "gradient_accumulation_steps"))


def _resolve_rank(rank, num_replicas):
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


class _RoundLayout(Sampler):
    """The epoch's permutation, the splits in force by round, and this rank's slices of it."""

    def __init__(self, dataset, micro_batch_sizes, rank, shuffle, seed, drop_last, num_replicas,
                 gradient_accumulation_steps):
        self.dataset_size = len(dataset)
        if self.dataset_size < 1:
            raise ValueError("the dataset is empty")
        split = _make_split(micro_batch_sizes, gradient_accumulation_steps, num_replicas)
        self.num_replicas = len(split.micro_batch_sizes)
        self.rank = _resolve_rank(rank, self.num_replicas)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._segments = [_Segment(0, 0, split)]

    @property
    def micro_batch_sizes(self):
        """The latest split's micro-batch sizes, one per rank."""
        return self._segments[-1].split.micro_batch_sizes

    @property
    def gradient_accumulation_steps(self):
        """The latest split's micro-batches per round, one per rank (1 without per-rank gas)."""
        return self._segments[-1].split.accumulation_steps

    @property
    def steps_per_epoch(self):
        """Rounds in this epoch (global micro-steps without per-rank gas), the same on every rank."""
        last = self._segments[-1]
        return last.first_round + self._rounds_from(last.first_position, last.split)

    def set_epoch(self, epoch):
        """Start epoch ``epoch``: a new permutation when shuffling, the latest split from round 0."""
        self.epoch = int(epoch)
        self._restart()

    def _restart(self):
        self._segments = [_Segment(0, 0, self._segments[-1].split)]

    def _rounds_from(self, position, split):
        remaining = self.dataset_size - position
        if remaining <= 0:
            return 0
        if self.drop_last:
            return remaining // split.round_size
        return -(-remaining // split.round_size)  # the last round wraps around to the start

    def _segment_at(self, round_index):
        return next(segment for segment in reversed(self._segments) if segment.first_round <= round_index)

    def _change(self, micro_batch_sizes, at_step, gradient_accumulation_steps, earliest):
        split = _make_split(micro_batch_sizes, gradient_accumulation_steps, self.num_replicas)
        if isinstance(at_step, bool) or not isinstance(at_step, int):
            raise ValueError(f"at_step = {at_step!r} must be an integer round of the current epoch")
        if not earliest <= at_step <= self.steps_per_epoch:
            raise ValueError(f"at_step {at_step} is outside rounds {earliest}..{self.steps_per_epoch} of the current "
                             f"epoch where a new split can still start (earlier rounds were already handed out)")
        last = self._segments[-1]
        position = last.first_position + (at_step - last.first_round) * last.split.round_size
        if at_step == last.first_round:
            self._segments.pop()  # the replaced split never served a round
        self._segments.append(_Segment(at_step, position, split))
        return at_step

    def _permutation(self):
        if not self.shuffle:
            return torch.arange(self.dataset_size)
        generator = torch.Generator()
        generator.manual_seed(self.seed + self.epoch)
        return torch.randperm(self.dataset_size, generator=generator)

    def _rank_rounds(self, first_round):
        """(round, split, this rank's indices) for each round from ``first_round`` to the epoch's end.

        The split of a round is looked up only when the round is reached, so a change registered
        in the meantime applies.
        """
        permutation = self._permutation()
        round_index = first_round
        while round_index < self.steps_per_epoch:
            segment = self._segment_at(round_index)
            offset, length = segment.split.share(self.rank)
            start = segment.first_position + (round_index - segment.first_round) * segment.split.round_size + offset
            if start + length <= self.dataset_size:
                indices = permutation[start:start + length]
            else:  # padding of the last round, as in DistributedSampler: wrap to the permutation's start
                indices = permutation[torch.arange(start, start + length) % self.dataset_size]
            yield round_index, segment.split, indices.tolist()
            round_index += 1


class HeterogeneousDistributedSampler(_RoundLayout):
    """Indices of this rank's share of each round, for ``DataLoader(batch_size=mbs_r, sampler=...)``.

    Args:
        dataset: any sized dataset; only its length is used.
        micro_batch_sizes: one micro-batch size per data-parallel rank (the plan's).
        rank: this process's data-parallel rank. Default None: its rank in deepspeed.comm's world,
            which is the data-parallel rank only without model parallelism.
        shuffle: permute the dataset each epoch (default True), seeded with ``seed + epoch``.
        seed: base seed, the same on every rank (default 0).
        drop_last: drop the incomplete last round (True) or complete it by wrapping around to the
            start of the permutation (default False), as DistributedSampler does.
        num_replicas: the data-parallel world size, to check ``micro_batch_sizes`` against.
            Default None: ``len(micro_batch_sizes)``.
        gradient_accumulation_steps: micro-batches each rank takes per round, one per rank or one
            for all. Default None: 1, a round is a global micro-batch. Pass the plan's per-rank gas
            so that a round is one optimizer step and ranks with more micro-steps get more samples.

    ``len()`` is the number of indices this rank yields in its next pass. Call ``set_epoch`` at
    the start of every epoch, as with DistributedSampler; without it, each pass repeats the
    epoch's order.
    """

    def __init__(self,
                 dataset,
                 micro_batch_sizes,
                 rank=None,
                 shuffle=True,
                 seed=0,
                 drop_last=False,
                 num_replicas=None,
                 gradient_accumulation_steps=None):
        super().__init__(dataset, micro_batch_sizes, rank, shuffle, seed, drop_last, num_replicas,
                         gradient_accumulation_steps)
        self._resume = False

    def set_epoch(self, epoch):
        super().set_epoch(epoch)
        self._resume = False

    def set_micro_batch_sizes(self, micro_batch_sizes, at_step, gradient_accumulation_steps=None):
        """Split the epoch with new sizes from round ``at_step`` on (a global micro-step without
        per-rank gas); rounds before it keep the sizes they had.

        Build a new DataLoader with ``batch_size`` = the new size of this rank: its first pass
        resumes at ``at_step``, and the passes after it cover whole epochs with the new split.
        Every rank must give the same sizes and ``at_step``. Returns ``at_step``.
        """
        at_step = self._change(micro_batch_sizes, at_step, gradient_accumulation_steps,
                               earliest=self._segments[-1].first_round)
        self._resume = True
        return at_step

    def _resumes(self):
        # A resumed pass with nothing left would end at once; the epoch starts over instead.
        return self._resume and self._segments[-1].first_round < self.steps_per_epoch

    def __iter__(self):
        # A generator, so nothing happens before the first index is asked for: torch's DataLoader
        # creates sampler iterators that it never advances.
        if self._resumes():
            first_round = self._segments[-1].first_round
        else:
            self._restart()
            first_round = 0
        self._resume = False
        for _, _, indices in self._rank_rounds(first_round):
            yield from indices

    def __len__(self):
        last = self._segments[-1]
        if self._resumes():
            rounds = self.steps_per_epoch - last.first_round
        else:
            rounds = self._rounds_from(0, last.split)
        return rounds * last.split.share(self.rank)[1]


class HeterogeneousBatchSampler(_RoundLayout):
    """One list of indices per micro-batch of this rank, for ``DataLoader(batch_sampler=...)``.

    Takes the same arguments as ``HeterogeneousDistributedSampler``. Each round yields
    ``gas_r`` lists of ``mbs_r`` indices, with the split in force when the round starts: a plan
    change applies from the next round the loader fetches, without rebuilding the loader. Do not
    pass ``batch_size``/``drop_last`` to the DataLoader itself. Each ``iter()`` after a pass has
    begun starts a new pass over the epoch with the latest split (call ``set_epoch`` to reshuffle).
    ``len()`` is the number of micro-batches this rank yields in the current pass.
    """

    def __init__(self,
                 dataset,
                 micro_batch_sizes,
                 rank=None,
                 shuffle=True,
                 seed=0,
                 drop_last=False,
                 num_replicas=None,
                 gradient_accumulation_steps=None):
        super().__init__(dataset, micro_batch_sizes, rank, shuffle, seed, drop_last, num_replicas,
                         gradient_accumulation_steps)
        self._rounds_drawn = 0

    @property
    def rounds_drawn(self):
        """Rounds of this pass already started by the loader; the earliest ``at_step`` for a change."""
        return self._rounds_drawn

    def _restart(self):
        super()._restart()
        self._rounds_drawn = 0

    def set_micro_batch_sizes(self, micro_batch_sizes, at_step=None, gradient_accumulation_steps=None):
        """Use new sizes from round ``at_step`` of the current epoch on (a global micro-step without
        per-rank gas, an optimizer step with it).

        Args:
            at_step: a round not yet started (>= ``rounds_drawn``). Default None: the next one,
                which is the next training step when the loader does not prefetch
                (``num_workers=0``). With prefetching workers, ranks must agree on an explicit
                step beyond what any rank's loader has fetched.

        Returns the round at which the new sizes take effect.
        """
        if at_step is None:
            at_step = self._rounds_drawn
        return self._change(micro_batch_sizes, at_step, gradient_accumulation_steps,
                            earliest=max(self._rounds_drawn, self._segments[-1].first_round))

    def __iter__(self):
        # A generator, so nothing happens before the first batch is asked for: torch's DataLoader
        # creates sampler iterators that it never advances.
        if self._rounds_drawn:  # a pass has begun: this is a new one
            self._restart()
        for round_index, split, indices in self._rank_rounds(0):
            self._rounds_drawn = round_index + 1
            size = split.micro_batch_sizes[self.rank]
            for start in range(0, len(indices), size):
                yield indices[start:start + size]

    def __len__(self):
        micro_batches, segments = 0, self._segments
        for index, segment in enumerate(segments):
            end = segments[index + 1].first_round if index + 1 < len(segments) else self.steps_per_epoch
            micro_batches += (end - segment.first_round) * segment.split.accumulation_steps[self.rank]
        return micro_batches
