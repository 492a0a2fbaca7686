# SPDX-License-Identifier: Apache-2.0
"""State shares and micro-batches chosen together (memory/activation_room.py), on the real pool.

A 4B-parameter bf16 model in ZeRO-3 (64 GB of state over both ranks) on an 80 GB and a 24 GiB device,
8 GiB of activations per sample, 8 samples per micro-step. Shares from memory and speed alone fill
the small device, leaving it room for a sample or two; with the activations counted, the shares
leave every rank room for the largest part of its speed's samples there is."""

import pytest

from deepspeed.runtime.heterogeneous import HeterogeneousMemoryPool, ModelStateSpec
from deepspeed.runtime.heterogeneous.config.blocks import HeterogeneousMemoryConfig
from deepspeed.runtime.heterogeneous.memory.activation_room import (activation_room, speed_targets,
                                                                    starved_ranks_advice)
from deepspeed.runtime.heterogeneous.measure.devices import BYTES_PER_GB

GIB = BYTES_PER_GB
SPEC = ModelStateSpec(zero_stage=3, num_parameters=4 * 10**9, param_bytes=2, master_bytes=4)
PER_SAMPLE = 1 * GIB
SAMPLES = 8


def _pool(memory=(80 * 10**9, 24 * GIB), speeds=(1.0, 1.0)):
    return HeterogeneousMemoryPool(list(memory), hbm_utilization_threshold=1.0, speeds=list(speeds))


def _room(placement, rank):
    """Bytes rank ``rank`` has beside its state (activations not counted)."""
    placed = placement.ranks[rank]
    return placed.budget_bytes - (placed.device_bytes - (placed.activation_bytes or 0.0))


def test_speed_targets_split_by_speed():
    assert speed_targets([1.0, 1.0], 8) == [4.0, 4.0]
    assert speed_targets([2.0, 1.0, 1.0], 8) == [4.0, 2.0, 2.0]


def test_shares_leave_the_small_rank_room_for_its_part_of_the_batch():
    pool = _pool()
    alone = pool.place(SPEC, cpu_offload=False, strict=False)
    # Alone, the small rank's share fills it: room for under one sample of its four.
    assert _room(alone, 1) < PER_SAMPLE

    def place(activations):
        return pool.place(SPEC, cpu_offload=False, strict=False, activation_bytes=activations)

    activations, fraction = activation_room(place, pool.speeds, PER_SAMPLE, SAMPLES)
    assert fraction == 1.0 and activations == [4 * PER_SAMPLE, 4 * PER_SAMPLE]
    together = place(activations)
    assert not together.problems and together.offloaded_ranks == []
    assert together.ranks[1].share < alone.ranks[1].share
    # Room for its whole part now: the state moved to the large rank, which still has room for its own.
    assert _room(together, 1) >= 4 * PER_SAMPLE and _room(together, 0) >= 4 * PER_SAMPLE


def test_the_largest_part_that_fits_when_the_whole_part_cannot():
    """At 16 GiB the small rank cannot hold four samples whatever its share (it holds whole
    parameters while they are gathered): the reservation is the largest fraction that fits."""
    pool = _pool(memory=(80 * 10**9, 16 * GIB))

    def place(activations):
        return pool.place(SPEC, cpu_offload=False, strict=False, activation_bytes=activations)

    activations, fraction = activation_room(place, pool.speeds, 4 * PER_SAMPLE, SAMPLES)
    assert 0 < fraction < 1
    placement = place(activations)
    assert not placement.problems
    # A little more would not fit: the bisection stops within 1/4096 of the edge.
    assert place([a * (fraction + 2 / 4096) / fraction for a in activations]).problems
    assert int(fraction * 4) >= 1  # it can hold at least one sample


def test_no_reservation_without_an_estimate_or_where_nothing_fits():
    pool = _pool()

    def place(activations):
        return pool.place(SPEC, cpu_offload=False, strict=False, activation_bytes=activations)

    assert activation_room(place, pool.speeds, None, SAMPLES) == (None, 0.0)
    # Half a GiB cannot hold even the smallest share of the state: no reservation makes that better.
    small = _pool(memory=(80 * 10**9, GIB // 2))

    def place_small(activations):
        return small.place(SPEC, cpu_offload=False, strict=False, activation_bytes=activations)

    assert place_small(None).problems
    assert activation_room(place_small, small.speeds, PER_SAMPLE, SAMPLES) == (None, 0.0)


def test_the_reservation_never_makes_a_rank_offload():
    """A rank that fits without offloading keeps fitting without it: activations cannot be offloaded,
    so a reservation that only an offload could pay for is too large."""
    pool = _pool()

    def place(activations):
        return pool.place(SPEC, cpu_offload=True, strict=False, activation_bytes=activations)

    assert place(None).offloaded_ranks == []
    activations, _ = activation_room(place, pool.speeds, 40 * GIB, SAMPLES)
    assert activations is None or place(activations).offloaded_ranks == []


def test_starved_ranks_get_advice_that_names_the_value_to_set():
    pool = _pool()
    pool.place(SPEC, cpu_offload=False, strict=False)

    def place(activations):
        # A copy, as the engine's controller does: the engine's placement must stay.
        import copy
        return copy.copy(pool).place(SPEC, cpu_offload=False, strict=False, activation_bytes=activations)

    advice = starved_ranks_advice(pool, [7, 1], [PER_SAMPLE, PER_SAMPLE], [1.0, 1.0], place)
    assert advice is not None and f"activation_bytes_per_sample to {PER_SAMPLE}" in advice
    assert "rank 1 (1 of 4)" in advice and "[4, 4] samples" in advice
    assert pool.placement.ranks[1].activation_bytes is None  # the engine's placement is untouched
    # A plan at the speeds' split is not starved: no advice.
    assert starved_ranks_advice(pool, [4, 4], [PER_SAMPLE, PER_SAMPLE], [1.0, 1.0], place) is None


def test_the_config_key_takes_a_size():
    assert HeterogeneousMemoryConfig(activation_bytes_per_sample="12MiB").activation_bytes == 12 * 2**20
    assert HeterogeneousMemoryConfig().activation_bytes is None
    with pytest.raises(ValueError, match="activation_bytes_per_sample"):
        HeterogeneousMemoryConfig(activation_bytes_per_sample=0)
