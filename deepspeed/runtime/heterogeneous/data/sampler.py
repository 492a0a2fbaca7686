# SPDX-License-Identifier: Apache-2.0
"""Uneven data-parallel sampling: rank r takes mbs_r of every sum(mbs) samples (docs/balancing.md, "Data loaders").

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

Both resume from a checkpoint: ``state_dict()`` describes the epoch's position (epoch, the splits
by round, the rounds handed out) without the rank, the same on every rank, so that each rank,
and a rank of a resized group, derives its own slices from it; after ``load_state_dict`` the next
pass starts at the first round not handed out before (``checkpoint.py`` saves and restores them
with the engine's checkpoints).
"""

import torch
from torch.utils.data import Sampler

from .epoch_split import Segment, make_split, resolve_rank, segments_from_state


class _RoundLayout(Sampler):
    """The epoch's permutation, the splits in force by round, and this rank's slices of it."""

    def __init__(self, dataset, micro_batch_sizes, rank, shuffle, seed, drop_last, num_replicas,
                 gradient_accumulation_steps):
        self.dataset_size = len(dataset)
        if self.dataset_size < 1:
            raise ValueError("the dataset is empty")
        split = make_split(micro_batch_sizes, gradient_accumulation_steps, num_replicas)
        self.num_replicas = len(split.micro_batch_sizes)
        self.rank = resolve_rank(rank, self.num_replicas)
        self.shuffle = bool(shuffle)
        self.seed = int(seed)
        self.drop_last = bool(drop_last)
        self.epoch = 0
        self._segments = [Segment(0, 0, split)]
        self._rounds_drawn = 0  # rounds of this pass started (handed out, at least in part)
        self._round_left = 0  # items of the last started round not handed out yet
        self._resume_round = None  # the next pass starts here (a checkpoint's position), once
        self._pass_first_round = 0  # the round this pass started at

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
        """Start epoch ``epoch``: a new permutation when shuffling, the latest split from round 0.

        After ``load_state_dict``, the checkpoint's own epoch keeps the checkpoint's position, so
        that a training loop that calls ``set_epoch`` at the top of each epoch resumes mid-epoch."""
        if self._resume_round is not None and int(epoch) == self.epoch:
            return
        self.epoch = int(epoch)
        self._restart()

    def _restart(self):
        self._segments = [Segment(0, 0, self._segments[-1].split)]
        self._rounds_drawn = self._round_left = self._pass_first_round = 0
        self._resume_round = None

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
        split = make_split(micro_batch_sizes, gradient_accumulation_steps, self.num_replicas)
        if isinstance(at_step, bool) or not isinstance(at_step, int):
            raise ValueError(f"at_step = {at_step!r} must be an integer round of the current epoch")
        if not earliest <= at_step <= self.steps_per_epoch:
            raise ValueError(f"at_step {at_step} is outside rounds {earliest}..{self.steps_per_epoch} of the current "
                             f"epoch where a new split can still start (earlier rounds were already handed out)")
        last = self._segments[-1]
        position = last.first_position + (at_step - last.first_round) * last.split.round_size
        if at_step == last.first_round:
            self._segments.pop()  # the replaced split never served a round
        self._segments.append(Segment(at_step, position, split))
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

    def _rounds_by_split(self, first_round):
        """(split, rounds) of each segment, counting rounds from ``first_round`` to the epoch's end."""
        segments = self._segments
        for index, segment in enumerate(segments):
            end = segments[index + 1].first_round if index + 1 < len(segments) else self.steps_per_epoch
            start = max(segment.first_round, first_round)
            if end > start:
                yield segment.split, end - start

    def _take_resume_round(self):
        """The round a pass resumed from a checkpoint starts at (once), or None."""
        first_round, self._resume_round = self._resume_round, None
        self._pass_first_round = 0 if first_round is None else first_round
        return first_round

    # -- checkpoints --------------------------------------------------------------------------

    @property
    def rounds_done(self):
        """Rounds of the epoch wholly handed out. A round this rank has begun but not finished
        (``mid_round``) is not counted: a resumed run hands it out again from its start."""
        if self._resume_round is not None:
            return self._resume_round
        return self._rounds_drawn - (1 if self._round_left else 0)

    @property
    def mid_round(self):
        """True between the first and last micro-batch of a round of several (per-rank gas)."""
        return self._resume_round is None and self._round_left > 0

    def state_dict(self):
        """The epoch's position as plain values: the same on every rank of a run that hands out
        rounds in step (every rank derives its own slices from it, see ``load_state_dict``)."""
        return {
            "dataset_size": self.dataset_size,
            "shuffle": self.shuffle,
            "seed": self.seed,
            "drop_last": self.drop_last,
            "epoch": self.epoch,
            "segments": [{
                "first_round": segment.first_round,
                "first_position": segment.first_position,
                "micro_batch_sizes": list(segment.split.micro_batch_sizes),
                "gradient_accumulation_steps": list(segment.split.accumulation_steps),
            } for segment in self._segments],
            "rounds_done": self.rounds_done,
        }

    def load_state_dict(self, state):
        """Continue at the position ``state`` (a ``state_dict()`` of this sampler in the saving run,
        from any rank) describes: the next pass starts at the first round not handed out then.

        When the split in force at that round is this sampler's split (the same data-parallel
        ranks and plan), the rest of the epoch is laid out exactly as the saving run had it. Else
        (another world size, another plan) the samples not yet handed out are split with this
        sampler's split from there on: no sample of the epoch is repeated or dropped.
        """
        for key, current in (("dataset_size", self.dataset_size), ("shuffle", self.shuffle), ("seed", self.seed),
                             ("drop_last", self.drop_last)):
            if key not in state:
                raise ValueError(f"sampler state: missing key {key!r}; expected a HeterogeneousBatchSampler/"
                                 f"HeterogeneousDistributedSampler state_dict()")
            if state[key] != current:
                raise ValueError(f"sampler state: {key} is {state[key]!r} in the checkpoint but {current!r} here; the "
                                 f"resumed epoch would not be the saved one's permutation. Build the sampler with "
                                 f"{key}={state[key]!r} (over the same dataset)")
        segments = segments_from_state(state)
        rounds = state["rounds_done"]
        end = segments[-1].first_round + self._rounds_from(segments[-1].first_position, segments[-1].split)
        if isinstance(rounds, bool) or not isinstance(rounds, int) or not 0 <= rounds <= end:
            raise ValueError(f"sampler state: rounds_done = {rounds!r} must be an integer in 0..{end}")
        current = self._segments[-1].split
        at = next(segment for segment in reversed(segments) if segment.first_round <= rounds)
        self.epoch = int(state["epoch"])
        if at.split == current:
            self._segments = segments
        else:  # re-split the rest of the epoch; the rounds already drawn keep their segments, so
            # that a state saved from here (on another world again) still describes the whole epoch
            position = at.first_position + (rounds - at.first_round) * at.split.round_size
            self._segments = [seg for seg in segments if seg.first_round < rounds] + [Segment(rounds, position, current)]
        self._rounds_drawn, self._round_left = rounds, 0
        self._resume_round = self._pass_first_round = rounds


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
        first_round = self._take_resume_round()
        if first_round is None and self._resumes():
            first_round = self._segments[-1].first_round
        elif first_round is None:
            self._restart()
            first_round = 0
        self._resume = False
        for round_index, _, indices in self._rank_rounds(first_round):
            self._rounds_drawn = round_index + 1
            for left, index in zip(range(len(indices) - 1, -1, -1), indices):
                self._round_left = left
                yield index

    def __len__(self):
        last = self._segments[-1]
        if self._resume_round is not None:
            return sum(rounds * split.share(self.rank)[1]
                       for split, rounds in self._rounds_by_split(self._resume_round))
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
        first_round = self._take_resume_round()
        if first_round is None:
            if self._rounds_drawn:  # a pass has begun: this is a new one
                self._restart()
            first_round = 0
        for round_index, split, indices in self._rank_rounds(first_round):
            self._rounds_drawn = round_index + 1
            size = split.micro_batch_sizes[self.rank]
            starts = range(0, len(indices), size)
            for left, start in zip(range(len(starts) - 1, -1, -1), starts):
                self._round_left = left
                yield indices[start:start + size]

    def __len__(self):
        """Micro-batches of this pass (from the checkpoint's round in a resumed one)."""
        return sum(rounds * split.accumulation_steps[self.rank]
                   for split, rounds in self._rounds_by_split(self._pass_first_round))


def resume_sampler(sampler, saved, index):
    """Resume ``sampler`` (the ``index``-th registered) at a checkpoint's saved position; a position
    it cannot take is an error that names the sampler."""
    try:
        sampler.load_state_dict(saved)
    except ValueError as exc:
        raise ValueError(f"deepspeed-hetero: heterogeneous sampler {index} cannot resume from the checkpoint: "
                         f"{exc}") from exc
