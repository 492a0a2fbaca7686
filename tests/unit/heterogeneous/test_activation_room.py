# SPDX-License-Identifier: Apache-2.0
"""State shares and micro-batches chosen together (memory/activation_room.py), on the real pool.

A 4B-parameter bf16 model in ZeRO-3 (64 GB of state over both ranks) on an 80 GB and a 24 GiB device,
8 GiB of activations per sample, 8 samples per micro-step. Shares from memory and speed alone fill
the small device, leaving it room for a sample or two; with the activations counted, the shares
leave every rank room for the largest part of its speed's samples there is."""

import pytest

from deepspeed.runtime.heterogeneous import HeterogeneousMemoryPool, ModelStateSpec
from deepspeed.runtime.heterogeneous.config.blocks import HeterogeneousMemoryConfig
from deepspeed.runtime.heterogeneous.memory.activation_room import (ShareOption, activation_room,
                                                                    forecast_step_seconds, limits_after_move,
                                                                    reserved_room_advice, speed_targets,
                                                                    starved_ranks_advice, weigh_shares)
from deepspeed.runtime.heterogeneous.planning.planner import TimeModel, plan_micro_batches
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


# -- weighing the shares on what profiling measured ------------------------------------------------

FITS = [TimeModel(0.1, 1.0), TimeModel(0.1, 1.0)]  # equal speeds: 1 s per sample, 0.1 s per micro-step


def test_the_forecast_scales_the_optimizer_step_by_share_and_the_collectives_by_the_largest():
    # Measured on shares (0.75, 0.25): rank 0's optimizer step 3 s, rank 1's 1 s; collectives 2 s.
    now = [0.75, 0.25]
    same = forecast_step_seconds(FITS, [7, 1], 1, [3.0, 1.0], 2.0, now, now)
    assert same == pytest.approx(max(0.1 + 7 + 3.0, 0.1 + 1 + 1.0) + 2.0)
    # Rank 0 takes the whole state: its step grows by a third, the gathers pad to 1.0 (2 s -> 2.667 s).
    moved = forecast_step_seconds(FITS, [5, 3], 1, [3.0, 1.0], 2.0, now, [1.0, 0.0])
    assert moved == pytest.approx(0.1 + 5 + 4.0 + 2.0 * 1.0 / 0.75)
    # Gas multiplies the micro-steps, not the optimizer step.
    assert forecast_step_seconds(FITS, [1, 1], 3, [0.0, 0.0], 0.0, now, now) == pytest.approx(3 * 1.1)


def test_limits_move_with_the_state_a_rank_sheds_or_takes():
    gib = 2**30
    # Rank 1 sheds 2.5 GiB of state at 1 GiB per sample: 2 more samples; rank 0 takes it: 3 fewer (floor).
    assert limits_after_move([10, 1], gib, [50 * gib, 20 * gib], [52.5 * gib, 17.5 * gib]) == [7, 3]
    # No limit stays no limit; never below zero.
    assert limits_after_move([None, 1], gib, [1, 2 * gib], [1, 9 * gib]) == [None, 0]


def _planner(models, batch):
    return lambda limits: plan_micro_batches(models, train_batch_size=batch, gradient_accumulation_steps=1,
                                             max_micro_batch=limits).micro_batch_sizes


def test_moving_state_pays_where_compute_dominates_and_not_where_the_optimizer_does():
    now = [0.75, 0.25]
    plan_for = _planner(FITS, 8)
    current = ShareOption(tuple(now), (7, 1), forecast_step_seconds(FITS, [7, 1], 1, [0.3, 0.1], 0.2, now, now))
    # Compute dominates (1 s per sample, 0.3 s optimizer step): room for 4 samples on rank 1 cuts the
    # step from 7.6 s to 4.73 s (rank 0: 4.1 s of micro-step, 0.38 s of optimizer step, 0.253 s of gathers).
    (cheap, ) = weigh_shares([([0.95, 0.05], [8, 4])], FITS, 1, [0.3, 0.1], 0.2, now, plan_for)
    assert current.seconds == pytest.approx(7.6)
    assert cheap.sizes == (4, 4) and cheap.seconds == pytest.approx(4.1 + 0.3 * 0.95 / 0.75 + 0.2 * 0.95 / 0.75)
    # The optimizer step dominates (30 s on rank 0 at 0.75): the same move costs more than it saves.
    heavy = ShareOption(tuple(now), (7, 1), forecast_step_seconds(FITS, [7, 1], 1, [30.0, 10.0], 0.2, now, now))
    (costly, ) = weigh_shares([([0.95, 0.05], [8, 4])], FITS, 1, [30.0, 10.0], 0.2, now, plan_for)
    assert costly.seconds > heavy.seconds
    # No plan within the moved limits: no sizes, an infinite forecast.
    (unfit, ) = weigh_shares([([0.5, 0.5], [8, 0])], FITS, 1, [0.3, 0.1], 0.2, now, plan_for)
    assert unfit.sizes is None and unfit.seconds == float("inf")
    # The advice to remove a reservation follows the forecast.
    assert reserved_room_advice(heavy, ShareOption((0.5, 0.5), (7, 1), heavy.seconds * 0.5)) is not None
    assert "Remove activation_bytes_per_sample" in reserved_room_advice(heavy, ShareOption((0.5, 0.5), (7, 1), 1.0))
    assert reserved_room_advice(heavy, ShareOption((0.5, 0.5), (7, 1), heavy.seconds * 0.92)) is None
    assert reserved_room_advice(heavy, unfit) is None


def test_the_advice_to_set_the_estimate_is_given_only_where_the_forecast_is_shorter():
    pool = _pool()
    pool.place(SPEC, cpu_offload=False, strict=False)

    def place(activations):
        import copy
        return copy.copy(pool).place(SPEC, cpu_offload=False, strict=False, activation_bytes=activations)

    def weigher(seconds):
        return lambda placement: (ShareOption((0.7, 0.3), (7, 1), 10.0),
                                  ShareOption(tuple(placement.partition_shares), (4, 4), seconds))

    faster = starved_ranks_advice(pool, [7, 1], [PER_SAMPLE, PER_SAMPLE], [1.0, 1.0], place, weigher(6.0))
    assert starved_ranks_advice(pool, [7, 1], [PER_SAMPLE, PER_SAMPLE], [1.0, 1.0], place, weigher(9.5)) \
        .count("would not make the step faster") == 1  # 5% less: within the forecast's error
    assert "activation_bytes_per_sample to" in faster and "forecast 6 s per step against 10 s now, 40% less" in faster
    slower = starved_ranks_advice(pool, [7, 1], [PER_SAMPLE, PER_SAMPLE], [1.0, 1.0], place, weigher(11.0))
    assert "activation_bytes_per_sample to" not in slower
    assert "would not make the step faster" in slower and "forecast 11 s per step against 10 s now" in slower


def _controller_note(per_sample_setting, optimizer_s):
    """The controller's line after profiling (``PlanDecisions._starved_note``) on the real pool and
    settings: SPEC on an 80 GB and a 24 GiB rank at equal speeds (1 s per sample), 8 samples per
    micro-step, 1 GiB of activations per sample measured, collectives 0.3 s, and the optimizer step
    ``optimizer_s`` per rank. Each rank measured 2 GiB less state than the pool predicted (its
    limits are what the measurements allow). The plan is the one the shares allow."""
    from types import SimpleNamespace

    from deepspeed.runtime.heterogeneous.config.settings import load_heterogeneous_settings
    from deepspeed.runtime.heterogeneous.control.decisions import PlanDecisions, _state_held
    from deepspeed.runtime.heterogeneous.planning.profiling import measured_time_models

    memory = {"enabled": True, "zero_partitions": "auto"}
    if per_sample_setting:
        memory["activation_bytes_per_sample"] = per_sample_setting
    settings = load_heterogeneous_settings(
        {"train_batch_size": 8, "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "compute_aware"},
         "heterogeneous_memory": memory}, world_size=2, environ={})
    capacities = [80 * 10**9, 24 * GIB]
    pool = HeterogeneousMemoryPool(capacities, settings.memory.hbm_utilization_threshold, speeds=[1.0, 1.0])
    reserve = [4 * per_sample_setting] * 2 if per_sample_setting else None
    held = _state_held(pool.place(SPEC, cpu_offload=False, strict=False, activation_bytes=reserve))
    sizes = [4, 4] if per_sample_setting else [7, 1]
    step = [{"samples": [(m, 0.1 + 1.0 * m, PER_SAMPLE * m)], "step_overhead": optimizer, "state_bytes": h - 2 * GIB,
             "wall": None, "collective_s": 0.3} for m, optimizer, h in zip(sizes, optimizer_s, held)]
    plan = plan_micro_batches([TimeModel(0.0, 1.0)] * 2, train_batch_size=8, strategy="manual", manual=sizes)
    state = SimpleNamespace(settings=settings, memory_pool=pool, plan=plan, base_gas=1, reference_plan=None,
                            device_names=["big", "small"])
    decisions = PlanDecisions(state, capacities, exchange=None, dynamic=False)
    decisions.history = [step, step, step]
    decisions.base_models = measured_time_models(decisions.history, 1)[1]
    return decisions._starved_note(plan)


def test_the_controller_weighs_the_shares_on_what_profiling_measured():
    # Without an estimate, rank 1 holds 1 sample of its 4. Where compute dominates, room for more
    # pays: the advice names the value to set, with its forecast.
    cheap = _controller_note(None, (0.5, 0.2))
    assert f"activation_bytes_per_sample to {PER_SAMPLE} (measured)" in cheap, cheap
    assert "forecast 4.94 s per step against 7.9 s now, 38% less" in cheap, cheap
    # Where rank 0's optimizer step dominates, the larger share costs it as much: no advice to set.
    heavy = _controller_note(None, (30.0, 10.0))
    assert "would not make the step faster" in heavy and "activation_bytes_per_sample to" not in heavy, heavy
    # With an estimate (here twice what was then measured), the shares chosen without it are weighed
    # the other way round: kept where compute dominates, advised away where rank 0's optimizer does.
    assert _controller_note(2 * PER_SAMPLE, (0.5, 0.2)) is None
    costly = _controller_note(2 * PER_SAMPLE, (100.0, 10.0))
    assert "Remove activation_bytes_per_sample" in costly and "[4, 4]; without it" in costly, costly
    assert "forecast 90.5 s per step against 104 s now, 13% less" in costly, costly
    # A forecast gain within the forecast's own error (WORTH) gives no advice.
    assert _controller_note(2 * PER_SAMPLE, (30.0, 10.0)) is None


def test_the_config_key_takes_a_size():
    assert HeterogeneousMemoryConfig(activation_bytes_per_sample="12MiB").activation_bytes == 12 * 2**20
    assert HeterogeneousMemoryConfig().activation_bytes is None
    with pytest.raises(ValueError, match="activation_bytes_per_sample"):
        HeterogeneousMemoryConfig(activation_bytes_per_sample=0)
