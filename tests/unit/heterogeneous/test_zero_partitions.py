# SPDX-License-Identifier: Apache-2.0
"""Memory-proportional ZeRO-1/2 partitions (``heterogeneous_memory.zero_partitions``).

Pure: the layout's invariants (aligned boundaries, tail padding in the last slice, no empty slice,
a slice inside one parameter) and the share decision (speed, memory caps). Processes: ZeRO-1/2
training with uneven shares equals the single-process reference of test_exactness, each rank's
optimizer state is its share, and a checkpoint loads back onto its own layout but not another.
"""

import pytest
import torch

from deepspeed.runtime.heterogeneous.memory.partitions import (PartitionLayoutError, ZeroPartitionLayout,
                                                               check_shares, check_checkpoint_layout,
                                                               choose_partition_shares, even_bounds, layout_digest,
                                                               partition_bounds, partition_span, zero_partition_layout)


def _check_invariants(bounds, total, payload, alignment):
    assert bounds[0][0] == 0
    assert sum(n for _, n in bounds) == total
    for (start, numel), (next_start, _) in zip(bounds, bounds[1:]):
        assert start + numel == next_start
    for start, numel in bounds:
        assert start % alignment == 0 and numel % alignment == 0 and numel >= alignment
    # Only the last slice holds padding: every earlier one ends inside the parameters.
    last_start = bounds[-1][0]
    assert last_start < payload


@pytest.mark.parametrize("shares", [(0.7, 0.3), (0.3, 0.7), (0.9, 0.1), (0.5, 0.3, 0.15, 0.05), (0.25, ) * 4])
@pytest.mark.parametrize("payload", [1072, 4099, 1_000_003])
def test_bounds_are_aligned_contiguous_and_keep_padding_at_the_tail(shares, payload):
    alignment, world = 2, len(shares)
    total = -(-payload // (alignment * world)) * alignment * world
    bounds = partition_bounds(total, payload, shares, alignment)
    _check_invariants(bounds, total, payload, alignment)
    for share, (_, numel) in zip(shares[:-1], bounds[:-1]):
        assert abs(numel - share * payload) <= alignment  # the share, to one alignment unit


def test_even_shares_leave_upstreams_equal_slices_in_place():
    assert zero_partition_layout((0.25, ) * 4, 2, 4) is None  # the optimizer then runs upstream's code
    assert even_bounds(1200, 4) == ((0, 300), (300, 300), (600, 300), (900, 300))


def test_a_tiny_share_still_gets_an_aligned_slice_and_a_slice_can_sit_inside_one_parameter():
    bounds = partition_bounds(1000, 999, (0.998, 0.001, 0.001), 4)
    _check_invariants(bounds, 1000, 999, 4)
    assert [n for _, n in bounds][1] == 4
    # One parameter of 1000 elements: rank 1's slice lies wholly inside it.
    layout = ZeroPartitionLayout((0.4, 0.2, 0.4), 2)
    start, numel = layout.add_group(1002, 1000)[1]
    assert 0 < start and start + numel < 1000


def test_a_ranks_span_is_its_slice_of_the_optimizers_layout():
    """What the ZeRO optimizer's ownership tables read (``partition_span``). 1024 elements at
    alignment 2 are 512 units; shares 0.75 / 0.25 cut at 0.75 * 512 = 384 units, element 768."""
    from types import SimpleNamespace
    layout = ZeroPartitionLayout((0.75, 0.25), 2)
    layout.add_group(1024, 1024)
    optimizer = SimpleNamespace(partition_layout=layout)
    assert partition_span(optimizer, 0, 0) == (0, 768)
    assert partition_span(optimizer, 0, 1) == (768, 256)


def test_small_groups_keep_equal_slices():
    layout = ZeroPartitionLayout((0.9, 0.1), 2)
    assert layout.add_group(16, 12) == even_bounds(16, 2)


def test_shares_follow_speed_then_memory_caps():
    assert choose_partition_shares([1.0, 1.0]) == (0.5, 0.5)
    assert choose_partition_shares([3.0, 1.0]) == (0.75, 0.25)
    # Rank 1 can hold only 20% of the state: the rest goes to rank 0, whatever the speeds say.
    assert choose_partition_shares([1.0, 1.0], rooms=[10e9, 2e9], state_bytes=10e9) == (0.8, 0.2)
    # Three ranks, one capped: the others share the rest by speed.
    shares = choose_partition_shares([1.0, 1.0, 2.0], rooms=[None, 1e9, None], state_bytes=10e9)
    assert shares[1] == pytest.approx(0.1) and shares[2] == pytest.approx(2 * shares[0], abs=1e-6)
    # Nothing fits: shares follow the rooms (the memory check then names the rank).
    assert choose_partition_shares([1.0, 1.0], rooms=[3e9, 1e9], state_bytes=10e9) == (0.75, 0.25)
    # No share below the floor.
    assert min(choose_partition_shares([1000.0, 1.0])) >= 0.01


def test_bad_shares_and_unsupported_combinations_are_refused_by_name():
    with pytest.raises(PartitionLayoutError, match="3 shares .* 2 ranks"):
        check_shares([0.5, 0.3, 0.2], 2)
    with pytest.raises(PartitionLayoutError, match="sums to 0.9"):
        check_shares([0.5, 0.4], 2)
    with pytest.raises(PartitionLayoutError, match="offload_optimizer"):
        zero_partition_layout((0.7, 0.3), 2, 2, cpu_offload=True)
    with pytest.raises(PartitionLayoutError, match="MoE"):
        zero_partition_layout((0.7, 0.3), 2, 2, has_moe_layers=True)
    assert zero_partition_layout((0.5, 0.5), 2, 2) is None and zero_partition_layout(None, 2, 2) is None


def test_a_checkpoint_of_another_layout_is_refused():
    layout = ZeroPartitionLayout((0.7, 0.3), 2)
    layout.add_group(1072, 1072)
    saved = {ZeroPartitionLayout.CHECKPOINT_KEY: layout.checkpoint_value()}
    check_checkpoint_layout(saved, layout, [1072], 2)  # same layout: fine
    check_checkpoint_layout({}, None, [1072], 2)  # upstream's on both sides: fine
    with pytest.raises(PartitionLayoutError, match=r"saved with partition shares \[0.700, 0.300\].*\[0.500, 0.500\]"):
        check_checkpoint_layout(saved, None, [1072], 2)
    with pytest.raises(PartitionLayoutError, match="universal"):
        check_checkpoint_layout({}, layout, [1072], 2)
    assert layout_digest(layout.groups) != layout_digest([even_bounds(1072, 2)])


def _train_with_shares(rank, world_size, stage, gas, sizes, clipping, shares, zero=None, bf16=False):
    """test_exactness's training with ``zero_partitions: shares``; returns the parameters and this
    rank's optimizer-state partition (numel of each fp32 group)."""
    import deepspeed
    from test_exactness import BF16_LR, ds_config, make_model, train_slices

    model = make_model()
    config = ds_config(stage, gas, sizes, clipping)
    config["heterogeneous_memory"] = {"zero_partitions": shares}
    config["zero_optimization"].update(zero or {})
    if bf16:
        config.update(bf16={"enabled": True}, optimizer={"type": "SGD", "params": {"lr": BF16_LR}},
                      zero_allow_untested_optimizer=True)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    train_slices(engine, rank, sizes, gas, config["train_batch_size"], torch.bfloat16 if bf16 else None)
    partition = [int(g.numel()) for g in engine.optimizer.single_partition_of_fp32_groups]
    return [p.detach().float().clone() for p in engine.module.parameters()], partition


def _expect_shares(case, per_rank):
    """Each rank's fp32 partition is its share of the model's 1072 parameters (to alignment)."""
    total = sum(partition[0] for _, partition in per_rank)
    for share, (_, partition) in zip(case["shares"], per_rank):
        assert abs(partition[0] - share * 1072) <= 2, (case, [p for _, p in per_rank])
    assert total >= 1072


SHARE_CASES = [
    dict(stage=1, gas=1, sizes=[5, 3], clipping=0.0, shares=[0.7, 0.3]),
    dict(stage=1, gas=2, sizes=[7, 1], clipping=0.05, shares=[0.3, 0.7]),
    dict(stage=2, gas=1, sizes=[5, 3], clipping=0.05, shares=[0.9, 0.1]),
    dict(stage=2, gas=2, sizes=[5, 3], clipping=0.0, shares=[0.7, 0.3],
         zero={"overlap_comm": True, "contiguous_gradients": False}),
    dict(stage=2, gas=1, sizes=[7, 1], clipping=1.0, shares=[0.3, 0.7],
         zero={"use_multi_rank_bucket_allreduce": False, "reduce_bucket_size": 200}),
    dict(stage=1, gas=1, sizes=[5, 3], clipping=0.0, shares=[0.9, 0.1],
         zero={"contiguous_gradients": True, "overlap_comm": True, "use_multi_rank_bucket_allreduce": False}),
]


@pytest.mark.multiprocess
def test_uneven_shares_train_exactly_and_each_rank_holds_its_share():
    from harness import run_subcases
    from test_exactness import reference_parameters

    results = run_subcases(_train_with_shares, SHARE_CASES, world_size=2, timeout=600)
    for case, per_rank in zip(SHARE_CASES, results):
        _expect_shares(case, per_rank)
        expected = reference_parameters(sum(case["sizes"]) * case["gas"], case["clipping"])
        for params, _ in per_rank:
            for got, want in zip(params, expected):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{case}: {m}")


@pytest.mark.multiprocess
def test_bf16_uneven_shares_track_the_reference():
    """As test_exactness's bf16 test (SGD, 2.5e-3): ZeRO-1 with bf16 would run upstream's
    BF16_Optimizer, which keeps equal slices; with uneven shares the ZeRO optimizer runs it."""
    from harness import run_subcases
    from test_exactness import BF16_LR, sgd_reference

    cases = [dict(stage=1, gas=1, sizes=[5, 3], clipping=0.0, shares=[0.7, 0.3], bf16=True),
             dict(stage=2, gas=1, sizes=[7, 1], clipping=0.0, shares=[0.3, 0.7], bf16=True)]
    results = run_subcases(_train_with_shares, cases, world_size=2, timeout=600)
    for case, per_rank in zip(cases, results):
        _expect_shares(case, per_rank)
        expected = sgd_reference(sum(case["sizes"]), BF16_LR)
        for params, _ in per_rank:
            for got, want in zip(params, expected):
                torch.testing.assert_close(got, want, rtol=0, atol=2.5e-3, msg=lambda m: f"{case}: {m}")


# -- checkpoints of an uneven layout ---------------------------------------------------------------

SAVE_AT = 3


def _checkpoint_run(rank, world_size, shares, folder, save=False, load=None, universal=False, sizes=(5, 3), stage=2,
                    repartition=False):
    """ZeRO-2 (or ``stage``), [5, 3], Adam: steps 1..STEPS, saving after step SAVE_AT (``save``) or
    starting from the checkpoint (``load``: its tag); ``universal``: load its universal form by hand;
    ``repartition``: let the fork convert and re-partition a checkpoint of other shares by itself."""
    import deepspeed
    from test_exactness import ds_config, make_model, train_slices

    sizes = list(sizes)
    model = make_model()
    config = ds_config(stage, 1, sizes, 0.0)
    config["heterogeneous_memory"] = {"zero_partitions": shares}
    config["heterogeneous_config"]["elastic"] = {"repartition": repartition}
    if universal:
        config["checkpoint"] = {"load_universal": True}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    first = 0
    if load is not None:
        try:
            engine.load_checkpoint(folder, tag=f"{load}_universal" if universal else load)
        except Exception as error:  # the parent checks the message
            return {"error": f"{type(error).__name__}: {error}"}
        first = SAVE_AT

    def save_at(steps):
        if save and steps == SAVE_AT:
            engine.save_checkpoint(folder, tag="saved")

    train_slices(engine, rank, sizes, 1, sum(sizes), first=first, after_step=save_at)
    from deepspeed.utils import safe_get_full_fp32_param
    full_fp32 = [safe_get_full_fp32_param(p).clone() for p in engine.module.parameters()]
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters()), enabled=stage == 3):
        return {"params": [p.detach().clone() for p in engine.module.parameters()], "full_fp32": full_fp32}


def _reference_after(steps):
    from test_exactness import LR, global_batches, make_model
    model = make_model()
    optimizer = torch.optim.Adam(model.parameters(), lr=LR)
    for inputs, targets in global_batches(8)[:steps]:
        optimizer.zero_grad()
        torch.nn.functional.mse_loss(model(inputs), targets).backward()
        optimizer.step()
    return [p.detach() for p in model.parameters()]


@pytest.mark.multiprocess
def test_uneven_checkpoints_resume_exactly_and_a_mismatched_layout_is_refused(tmp_path):
    """Saved with shares (0.7, 0.3): resumed with the same shares = the uninterrupted run; a
    per-rank load with even or reversed shares is refused by name (re-partitioning switched off),
    or converted and re-partitioned by the fork (on); the universal checkpoint converted by hand
    re-partitions onto the even and the reversed layout, and onto one rank, and resumes exactly."""
    from harness import run_subcases
    from test_exactness import reference_parameters

    import subprocess
    import sys

    folder = str(tmp_path)
    cases = [dict(shares=[0.7, 0.3], folder=folder, save=True),
             dict(shares=[0.7, 0.3], folder=folder, load="saved"),
             dict(shares="even", folder=folder, load="saved"),
             dict(shares=[0.3, 0.7], folder=folder, load="saved"),
             dict(shares=[0.3, 0.7], folder=folder, load="saved", repartition=True)]
    results = run_subcases(_checkpoint_run, cases, world_size=2, timeout=600)
    # The checkpoint holds no client universal_checkpoint_info (a Megatron-style client's): inject it.
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder", f"{folder}/saved",
                    "--output_folder", f"{folder}/saved_universal", "--num_extract_workers", "1",
                    "--num_merge_workers", "1", "--inject_missing_state"], check=True, capture_output=True, cwd=folder)
    universal = [dict(shares="even", folder=folder, load="saved", universal=True),
                 dict(shares=[0.3, 0.7], folder=folder, load="saved", universal=True)]
    cases += universal
    results += run_subcases(_checkpoint_run, universal, world_size=2, timeout=600)
    uninterrupted = results[0][0]["params"]
    for got, want in zip(uninterrupted, reference_parameters(8, 0.0)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for rank_result in results[0]:  # each rank's fp32 master copy of every parameter, gathered
        for got, want in zip(rank_result["full_fp32"], uninterrupted):
            torch.testing.assert_close(got, want, rtol=0, atol=0)
    # zero_to_fp32 merges the uneven slices of the checkpoint into the full state of step SAVE_AT.
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint
    merged = get_fp32_state_dict_from_zero_checkpoint(folder, tag="saved")
    for got, want in zip(merged.values(), _reference_after(SAVE_AT)):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-5)
    for index in (1, 4, 5, 6):
        for rank_result in results[index]:
            assert "params" in rank_result, (cases[index], rank_result)
            for got, want in zip(rank_result["params"], uninterrupted):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=lambda m: f"{cases[index]}: {m}")
    for index in (2, 3):
        for rank_result in results[index]:
            assert "saved with partition shares [0.700, 0.300]" in rank_result.get("error", ""), rank_result
    # Another world size: the universal checkpoint of the 2-rank (0.7, 0.3) run resumes on one rank.
    one_rank = dict(shares="even", folder=folder, load="saved", universal=True, sizes=[8])
    (alone, ), = run_subcases(_checkpoint_run, [one_rank], world_size=1, timeout=600)
    assert "params" in alone, alone
    for got, want in zip(alone["params"], uninterrupted):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)


@pytest.mark.multiprocess
def test_four_ranks_with_shares_half_to_a_twentieth_train_exactly():
    from harness import run_subcases
    from test_exactness import reference_parameters

    shares = [0.5, 0.3, 0.15, 0.05]
    cases = [dict(stage=1, gas=2, sizes=[4, 2, 1, 1], clipping=0.0, shares=shares),
             dict(stage=2, gas=1, sizes=[3, 3, 1, 1], clipping=0.05, shares=shares)]
    results = run_subcases(_train_with_shares, cases, world_size=4, timeout=600)
    for case, per_rank in zip(cases, results):
        _expect_shares(case, per_rank)
        expected = reference_parameters(sum(case["sizes"]) * case["gas"], case["clipping"])
        for params, _ in per_rank:
            for got, want in zip(params, expected):
                torch.testing.assert_close(got, want, rtol=0, atol=1e-5, msg=lambda m: f"{case}: {m}")


def test_the_config_checks_shares_early_and_says_when_they_are_ignored():
    from deepspeed.runtime.heterogeneous.config.settings import load_heterogeneous_settings
    base = {"train_batch_size": 8, "heterogeneous_config": {"enabled": True}}
    with pytest.raises(ValueError, match=r"zero_partitions: \[0.7, 0.2\] sums to 0.9"):
        load_heterogeneous_settings({**base, "heterogeneous_memory": {"zero_partitions": [0.7, 0.2]}}, world_size=2)
    with pytest.raises(ValueError, match="has 3 shares .* 2 data-parallel ranks"):
        load_heterogeneous_settings({**base, "heterogeneous_memory": {"zero_partitions": [0.5, 0.3, 0.2]}},
                                    world_size=2)
    with pytest.raises(ValueError, match="zero_partitions"):
        load_heterogeneous_settings({**base, "heterogeneous_memory": {"zero_partitions": "uneven"}}, world_size=2)
    off = load_heterogeneous_settings({"train_batch_size": 8, "heterogeneous_memory": {"zero_partitions": [0.7, 0.3]}},
                                      world_size=2)
    assert any("zero_partitions ignored" in note for note in off.notes), off.notes
