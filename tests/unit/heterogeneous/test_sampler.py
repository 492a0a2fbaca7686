# SPDX-License-Identifier: Apache-2.0
"""Uneven data-parallel sampling: coverage of the epoch, equal steps, epochs, plan changes (no processes)."""

from collections import Counter

import pytest
import torch
from torch.utils.data import DataLoader

from deepspeed.runtime.heterogeneous.data.sampler import HeterogeneousBatchSampler, HeterogeneousDistributedSampler

ALLOCATIONS = [[5, 3], [7, 1], [1, 1], [3, 2, 1]]


def _samplers(size, sizes, cls=HeterogeneousDistributedSampler, **kwargs):
    return [cls(range(size), sizes, rank=rank, **kwargs) for rank in range(len(sizes))]


def _global_order(per_rank, sizes):
    """Undo the layout: concatenate every rank's slice of each round, in rank order."""
    rounds = len(per_rank[0]) // sizes[0]
    order = []
    for round_index in range(rounds):
        for rank, size in enumerate(sizes):
            order += per_rank[rank][round_index * size:(round_index + 1) * size]
    return order


@pytest.mark.parametrize("sizes", ALLOCATIONS)
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("dataset_size", [48, 50])
def test_every_index_once_and_equal_steps(sizes, shuffle, dataset_size):
    for drop_last in (False, True):
        samplers = _samplers(dataset_size, sizes, shuffle=shuffle, seed=3, drop_last=drop_last)
        per_rank = [list(sampler) for sampler in samplers]
        steps = {len(indices) // size for indices, size in zip(per_rank, sizes)}
        assert len(steps) == 1 and steps == {samplers[0].steps_per_epoch}
        assert [len(sampler) for sampler in samplers] == [len(indices) for indices in per_rank]
        order = _global_order(per_rank, sizes)
        assert len(order) == sum(len(indices) for indices in per_rank)
        if drop_last:
            assert len(order) == dataset_size // sum(sizes) * sum(sizes)
            assert len(set(order)) == len(order)
        else:
            # Every index at least once; the only repeats are the wrap-around to the epoch's start.
            assert sorted(order[:dataset_size]) == list(range(dataset_size))
            assert order[dataset_size:] == order[:len(order) - dataset_size]
            assert len(order) - dataset_size < sum(sizes)


def test_layout_without_shuffle_is_contiguous_per_round():
    first, second = _samplers(16, [5, 3], shuffle=False)
    assert list(first) == [0, 1, 2, 3, 4, 8, 9, 10, 11, 12]
    assert list(second) == [5, 6, 7, 13, 14, 15]


def test_dataloader_gets_one_micro_batch_per_step():
    sampler = HeterogeneousDistributedSampler(torch.arange(40), [5, 3], rank=1, seed=1)
    loader = DataLoader(torch.arange(40), batch_size=3, sampler=sampler)
    batches = list(loader)
    assert len(batches) == sampler.steps_per_epoch == 5 and all(len(batch) == 3 for batch in batches)


def test_set_epoch_reshuffles_deterministically():
    sampler = HeterogeneousDistributedSampler(range(64), [5, 3], rank=0, seed=11)
    epoch0 = list(sampler)
    assert list(sampler) == epoch0  # no set_epoch: same order, as DistributedSampler
    sampler.set_epoch(1)
    epoch1 = list(sampler)
    assert epoch1 != epoch0
    again = HeterogeneousDistributedSampler(range(64), [5, 3], rank=0, seed=11)
    again.set_epoch(1)
    assert list(again) == epoch1
    again.set_epoch(0)
    assert list(again) == epoch0
    other_seed = HeterogeneousDistributedSampler(range(64), [5, 3], rank=0, seed=12)
    assert list(other_seed) != epoch0


@pytest.mark.parametrize("dataset_size, drop_last", [(48, False), (50, True), (50, False)])
def test_plan_change_mid_epoch_keeps_every_index_once(dataset_size, drop_last):
    samplers = _samplers(dataset_size, [5, 3], shuffle=True, seed=5, drop_last=drop_last)
    consumed = []
    for sampler, size in zip(samplers, [5, 3]):
        iterator = iter(sampler)
        consumed += [next(iterator) for _ in range(3 * size)]  # three steps under [5, 3]
    for sampler in samplers:
        assert sampler.set_micro_batch_sizes([2, 6], at_step=3) == 3
    assert [len(sampler) for sampler in samplers] == [2 * samplers[0].steps_per_epoch - 6,
                                                      6 * samplers[0].steps_per_epoch - 18]
    rest = [list(sampler) for sampler in samplers]  # a new DataLoader per rank resumes at step 3
    assert len(rest[0]) // 2 == len(rest[1]) // 6
    seen = Counter(consumed + rest[0] + rest[1])
    if drop_last:
        assert max(seen.values()) == 1 and len(seen) == dataset_size // 8 * 8
    else:
        assert set(seen) == set(range(dataset_size))
        assert sum(seen.values()) - dataset_size < 8  # only the last round's wrap-around repeats
    # The pass after the resumed one covers the whole epoch again, with the new split.
    assert len(list(samplers[1])) == 6 * (-(-dataset_size // 8) if not drop_last else dataset_size // 8)


def test_plan_change_to_a_different_total_per_step():
    samplers = _samplers(48, [5, 3], shuffle=False)
    consumed = [index for sampler, size in zip(samplers, [5, 3]) for index in list(sampler)[:3 * size]]
    for sampler in samplers:
        sampler.set_micro_batch_sizes([2, 2], at_step=3)
    assert samplers[0].steps_per_epoch == 3 + 6
    rest = [index for sampler in samplers for index in sampler]
    assert sorted(consumed + rest) == list(range(48))


def test_batch_sampler_follows_a_change_without_a_new_loader():
    size = 48
    samplers = _samplers(size, [5, 3], cls=HeterogeneousBatchSampler, seed=2)
    loaders = [iter(DataLoader(torch.arange(size), batch_sampler=sampler)) for sampler in samplers]
    seen = []
    for step in range(6):
        if step == 3:
            assert [sampler.rounds_drawn for sampler in samplers] == [3, 3]
            assert {sampler.set_micro_batch_sizes([2, 6]) for sampler in samplers} == {3}
        batches = [next(loader) for loader in loaders]
        assert [len(batch) for batch in batches] == ([5, 3] if step < 3 else [2, 6])
        seen += [int(index) for batch in batches for index in batch]
    assert all(next(loader, None) is None for loader in loaders)
    assert sorted(seen) == list(range(size))
    with pytest.raises(ValueError, match="already handed out"):
        samplers[0].set_micro_batch_sizes([4, 4], at_step=2)


def test_batch_sampler_per_rank_gas_rounds_are_optimizer_steps():
    samplers = _samplers(40, [4, 2], cls=HeterogeneousBatchSampler, shuffle=False, gradient_accumulation_steps=[1, 3])
    first, second = [list(sampler) for sampler in samplers]
    assert first[:2] == [[0, 1, 2, 3], [10, 11, 12, 13]] and second[:3] == [[4, 5], [6, 7], [8, 9]]
    assert len(first) == 4 and len(second) == 12 and samplers[0].steps_per_epoch == 4
    assert [len(sampler) for sampler in samplers] == [4, 12]
    assert sorted(i for batch in first + second for i in batch) == list(range(40))


def test_batch_sampler_new_pass_uses_latest_split_and_unstarted_iterators_do_nothing():
    sampler = HeterogeneousBatchSampler(range(16), [5, 3], rank=0, shuffle=False)
    assert next(iter(sampler)) == [0, 1, 2, 3, 4]
    sampler.set_micro_batch_sizes([2, 2])  # from round 1 of this pass on
    iter(sampler)  # torch's multi-worker DataLoader creates an iterator it never advances
    assert list(sampler) == [[0, 1], [4, 5], [8, 9], [12, 13]]  # a new pass: whole epoch, new split
    assert len(sampler) == 4


def test_index_sampler_rejects_rewriting_history():
    sampler = HeterogeneousDistributedSampler(range(48), [5, 3], rank=0)
    sampler.set_micro_batch_sizes([2, 6], at_step=3)
    with pytest.raises(ValueError, match=r"outside rounds 3\.\.6"):
        sampler.set_micro_batch_sizes([4, 4], at_step=2)
    with pytest.raises(ValueError, match=r"outside rounds 3\.\.6"):
        sampler.set_micro_batch_sizes([4, 4], at_step=7)


@pytest.mark.parametrize("kwargs, message", [
    (dict(micro_batch_sizes=[5, 3], rank=0, num_replicas=3), "has 2 entries but there are 3 data-parallel ranks"),
    (dict(micro_batch_sizes=[5, 0], rank=0), r"micro_batch_sizes\[1\] = 0 must be a positive integer"),
    (dict(micro_batch_sizes=[5, -1], rank=0), r"micro_batch_sizes\[1\] = -1"),
    (dict(micro_batch_sizes=[], rank=0), "micro_batch_sizes is empty"),
    (dict(micro_batch_sizes=[5, 3], rank=2), "rank 2 is out of range for 2 data-parallel ranks"),
    (dict(micro_batch_sizes=[5, 3], rank=-1), "rank -1 is out of range"),
    (dict(micro_batch_sizes=[5, 3]), "rank is required"),
    (dict(micro_batch_sizes=[5, 3], rank=0, gradient_accumulation_steps=[1]), "has 1 entries for 2 ranks"),
])
def test_input_errors(kwargs, message):
    for cls in (HeterogeneousDistributedSampler, HeterogeneousBatchSampler):
        with pytest.raises(ValueError, match=message):
            cls(range(16), **kwargs)


def test_single_rank_needs_no_rank_and_empty_dataset_is_refused():
    assert len(HeterogeneousDistributedSampler(range(10), [4])) == 12
    with pytest.raises(ValueError, match="empty"):
        HeterogeneousDistributedSampler([], [4], rank=0)
