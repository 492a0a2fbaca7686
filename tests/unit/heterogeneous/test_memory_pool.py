# SPDX-License-Identifier: Apache-2.0
"""``HeterogeneousMemoryPool``: per-device budgets, a per-node host budget, the placement decision
(ZeRO-1/2 shares, per-rank optimizer offload, ZeRO-3 ratios) and its report; the engine keeps the
pool it placed its state with, and the profiler's memory figures match that placement."""

import io
import json

import pytest
import torch

from deepspeed.runtime.heterogeneous import HeterogeneousMemoryPool, MemoryPlacementError, ModelStateSpec
from deepspeed.runtime.heterogeneous.config.settings import load_heterogeneous_settings
from deepspeed.runtime.heterogeneous.measure.devices import BYTES_PER_GB, DeviceDescription
from deepspeed.runtime.heterogeneous.cli.env_report import config_placement_lines, parse_parameter_count

GIB = BYTES_PER_GB
# 1e9 parameters, bf16 with Adam: 2 GB of parameters, 2 GB of gradients, 12 GB of optimizer state
# and fp32 master copy.
BF16_1B = dict(num_parameters=10**9, param_bytes=2, optimizer_bytes=8, master_bytes=4)
BF16_4B = {**BF16_1B, "num_parameters": 4 * 10**9}


def device(rank, memory_gib, host="node-a", name="GPU", score=100.0, shared=False):
    return DeviceDescription(rank=rank, local_rank=rank, host=host, name=name, memory_bytes=int(memory_gib * GIB),
                             bf16=True, fp16=True, accelerator="cuda", spec_score=score, score_source="spec",
                             shared_host_memory=shared)


# -- budgets ----------------------------------------------------------------------------------------


def test_budgets_come_from_sizes_bytes_devices_and_the_threshold():
    pool = HeterogeneousMemoryPool(hbm_devices=["80GB", 24 * GIB, None, device(3, 16)], hbm_utilization_threshold=0.5)
    assert pool.capacities == [80 * 10**9, 24 * GIB, None, 16 * GIB]
    assert pool.budgets == [40 * 10**9, 12 * GIB, None, 8 * GIB]
    # The documented call (sizes as strings): the config's default threshold, the host budget
    # parsed like the config's.
    documented = HeterogeneousMemoryPool(hbm_devices=["80GB", "24GB"], cpu_memory_limit="64GB")
    assert documented.utilization == 0.85 and documented.host_budget == 64 * 10**9
    # A CPU rank's reported memory is the host's RAM, shared: no limit of its own.
    assert HeterogeneousMemoryPool([device(0, 512, shared=True)]).capacities == [None]


def test_devices_give_names_nodes_and_speeds():
    pool = HeterogeneousMemoryPool([device(0, 80, "b", "H100", 900.0), device(1, 24, "a", "A10", 100.0),
                                    device(2, 24, "b", "A10", 100.0)])
    assert pool.hosts == [0, 1, 0] and pool.speeds == [900.0, 100.0, 100.0]
    assert pool.device_names == ["H100", "A10", "A10"]


@pytest.mark.parametrize("kwargs, named", [
    (dict(hbm_devices=[]), "one entry per data-parallel rank"),
    (dict(hbm_devices=["80GB", "24 gigs"]), "hbm_devices[1]"),
    (dict(hbm_devices=["80GB", 0]), "hbm_devices[1]"),
    (dict(hbm_devices=["80GB"], cpu_memory_limit="lots"), "cpu_memory_limit"),
    (dict(hbm_devices=["80GB"], hbm_utilization_threshold=1.5), "hbm_utilization_threshold"),
    (dict(hbm_devices=["80GB", "24GB"], hosts=[0]), "hosts"),
    (dict(hbm_devices=["80GB", "24GB"], speeds=[1.0, 0.0]), "speeds"),
])
def test_bad_budgets_are_refused_by_name(kwargs, named):
    with pytest.raises(ValueError, match=named.replace("[", r"\[").replace("]", r"\]")):
        HeterogeneousMemoryPool(**kwargs)


# -- ZeRO-1/2 shares -------------------------------------------------------------------------------


@pytest.mark.parametrize("stage, small_capacity", [(1, 11 * 10**9), (2, 7.5 * 10**9)])
def test_auto_shares_follow_speed_within_each_ranks_room(stage, small_capacity):
    """Shares follow the speeds (3 : 1 : 2) until a rank's room caps its share; what the capped
    rank cannot take goes to the others in proportion to their speeds.

    1e9 parameters, bf16 Adam, 3 ranks, threshold 0.5. Held whole on every rank: the parameters
    (2 GB) and, in ZeRO-1, the gradients (2 GB); partitioned: optimizer state and master copy
    (12 GB) and, in ZeRO-2, the gradients (2 GB):

        ZeRO-1: held 4 GB, partitioned 12 GB; rank 1: 11 GB * 0.5 = 5.5 GB budget,
                room 5.5 - 4 = 1.5 GB = 0.125 of 12 GB
        ZeRO-2: held 2 GB, partitioned 14 GB; rank 1: 7.5 GB * 0.5 = 3.75 GB budget,
                room 3.75 - 2 = 1.75 GB = 0.125 of 14 GB

    Rank 1's speed share, 1/6 = 0.167, is over its cap 0.125, so it gets 0.125. Ranks 0 and 2
    split the other 0.875 as 3 : 2: 0.875 * 3/5 = 0.525 and 0.875 * 2/5 = 0.35, within their
    rooms (rank 0: 40 GB - held, rank 2: 20 GB - held, both more than the whole state)."""
    spec = ModelStateSpec(zero_stage=stage, **BF16_1B)
    pool = HeterogeneousMemoryPool([80 * 10**9, small_capacity, 40 * 10**9], hbm_utilization_threshold=0.5,
                                   speeds=[3.0, 1.0, 2.0])
    placement = pool.place(spec)
    assert placement.partition_shares == (0.525, 0.125, 0.35)
    assert [r.share for r in placement.ranks] == [0.525, 0.125, 0.35]
    assert placement.offloaded_ranks == [] and all(r.fits for r in placement.ranks)
    # Rank 1 is full: its held state plus its share of the partitioned state is its whole budget.
    held, partitioned = {1: (4e9, 12e9), 2: (2e9, 14e9)}[stage]
    assert placement.ranks[1].device_bytes == pytest.approx(held + 0.125 * partitioned) == small_capacity * 0.5


def test_auto_shares_are_the_speeds_where_every_room_is_large_enough():
    """Capacities [80, 24, 40] GiB at 0.85, ZeRO-2 (held 2 GB, partitioned 14 GB): the smallest
    room, 24 GiB * 0.85 - 2 GB = 19.9 GB, holds more than the whole state, so no room caps a
    share and the shares are the speeds' 3 : 1 : 2, rounded to millionths (the last share takes
    what rounding the others leaves: 1 - 0.5 - 0.166667 = 0.333333)."""
    pool = HeterogeneousMemoryPool([80 * GIB, 24 * GIB, 40 * GIB], hbm_utilization_threshold=0.85,
                                   speeds=[3.0, 1.0, 2.0])
    assert pool.place(ModelStateSpec(zero_stage=2, **BF16_1B)).partition_shares == (0.5, 0.166667, 0.333333)


def test_the_memory_limit_tests_rank_gets_a_small_share():
    """test_memory_limits.py's cluster: 4 GiB and 0.43 GiB at 0.6, a 50M-parameter fp32 model."""
    pool = HeterogeneousMemoryPool([4 * GIB, int(0.43 * GIB)], hbm_utilization_threshold=0.6)
    shares = pool.place(ModelStateSpec(12 * (2048 * 2048 + 2048), 2)).partition_shares
    assert shares[1] < 0.25 and pool.placement.ranks[1].fits


def test_even_and_explicit_shares_are_kept_and_equal_shares_mean_upstreams_slices():
    pool = HeterogeneousMemoryPool(["80GB", "80GB"])
    spec = ModelStateSpec(zero_stage=2, **BF16_1B)
    assert pool.place(spec, zero_partitions="even").partition_shares is None
    assert pool.place(spec, zero_partitions=[0.7, 0.3]).partition_shares == (0.7, 0.3)
    assert pool.place(spec).partition_shares is None  # equal devices: auto is even
    assert [r.share for r in pool.place(ModelStateSpec(zero_stage=3, **BF16_1B)).ranks] == [0.5, 0.5]
    assert pool.placement.partition_shares is None  # ZeRO-3 too: equal devices, upstream's equal slices


def test_activations_take_room_from_the_state():
    pool = HeterogeneousMemoryPool([80 * GIB, 24 * GIB])
    spec = ModelStateSpec(zero_stage=2, **BF16_4B)
    without = pool.place(spec).partition_shares
    with_activations = pool.place(spec, activation_bytes=[0, 6 * GIB]).partition_shares
    assert with_activations[1] < without[1]
    assert pool.placement.ranks[1].fits  # its state and its activations, within the shares' rounding


# -- offload -----------------------------------------------------------------------------------------


def test_a_rank_that_cannot_hold_its_share_offloads_and_the_others_keep_theirs_on_the_device():
    # 4e9 parameters, ZeRO-2 bf16 Adam: 8 GB held whole, 56 GB partitioned (8 GB of it gradients).
    # Three 24 GiB ranks and a 16 GiB one cannot keep it all on their devices; offloading only the
    # smallest rank's optimizer state lets it take a larger share, and the others then fit.
    spec = ModelStateSpec(zero_stage=2, **BF16_4B)
    pool = HeterogeneousMemoryPool([24 * GIB, 24 * GIB, 24 * GIB, 16 * GIB], cpu_memory_limit="256GB")
    placement = pool.place(spec)
    assert placement.offloaded_ranks == [3]
    assert [r.optimizer_location for r in placement.ranks] == ["device", "device", "device", "host"]
    assert all(r.fits for r in placement.ranks), [r.device_bytes - r.budget_bytes for r in placement.ranks]
    assert placement.host_bytes(0) == placement.ranks[3].optimizer_bytes > 0
    # Without the offload it would not fit: the same pool refuses, naming the rank and the switch.
    with pytest.raises(MemoryPlacementError, match=r"data-parallel rank \d .*heterogeneous_offload.cpu_offload"):
        pool.place(spec, cpu_offload=False)


def test_explicit_shares_offload_exactly_the_ranks_over_budget():
    # ZeRO-1, half each: 8 GB of parameters + 8 GB of gradients + 24 GB of optimizer state.
    pool = HeterogeneousMemoryPool(["80GB", "24GB"])
    placement = pool.place(ModelStateSpec(zero_stage=1, **BF16_4B), zero_partitions=[0.5, 0.5])
    assert placement.offloaded_ranks == [1] and placement.partition_shares == (0.5, 0.5)
    assert placement.ranks[1].fits and placement.ranks[0].optimizer_location == "device"


def test_zero3_shares_follow_memory_so_the_small_device_needs_no_offload():
    """4B parameters in bf16 (64 GB of ZeRO-3 state over both ranks) on 80 GB and 20 GiB devices:
    even shares would need 32 GB on the small one; its share follows its room instead."""
    spec = ModelStateSpec(zero_stage=3, **BF16_4B)
    pool = HeterogeneousMemoryPool([80 * GIB, 20 * GIB], hbm_utilization_threshold=1.0)
    placement = pool.place(spec)
    small = placement.ranks[1]
    assert small.fits and small.offload_fraction == 0 and placement.offloaded_ranks == []
    assert small.share < 0.34 and placement.partition_shares == tuple(r.share for r in placement.ranks)
    assert small.parameter_bytes == pytest.approx(BF16_4B["num_parameters"] * 2 * small.share)


def test_zero3_rank_whose_share_still_does_not_fit_offloads_alone():
    """Shares (0.7, 0.3) of 4B bf16 parameters (64 GB of ZeRO-3 state: 2 + 2 + 12 bytes each):
    rank 1's 30%, 19.2 GB, exceeds its 12 GiB; it offloads part of its optimizer state, rank 0
    none, and the shares stay as given."""
    spec = ModelStateSpec(zero_stage=3, **BF16_4B)
    pool = HeterogeneousMemoryPool([80 * GIB, 12 * GIB], hbm_utilization_threshold=1.0)
    placement = pool.place(spec, zero_partitions=[0.7, 0.3])
    first, second = placement.ranks
    assert placement.partition_shares == (0.7, 0.3) and placement.offloaded_ranks == [1]
    assert 0 < second.offload_fraction < 1 and second.fits and first.offload_fraction == 0
    assert second.parameter_bytes == pytest.approx(BF16_4B["num_parameters"] * 2 * 0.3)
    assert second.optimizer_bytes == pytest.approx(BF16_4B["num_parameters"] * 12 * 0.3)


def test_zero3_offloads_the_smallest_ratio_that_fits():
    spec = ModelStateSpec(zero_stage=3, **BF16_4B)
    pool = HeterogeneousMemoryPool([80 * GIB, 20 * GIB], hbm_utilization_threshold=1.0)
    rank = pool.place(spec, zero_partitions="even").ranks[1]
    assert 0 < rank.offload_fraction < 1 and rank.fits
    needed = rank.parameter_bytes + rank.gradient_bytes + rank.optimizer_bytes - rank.budget_bytes
    assert rank.optimizer_bytes * (rank.offload_fraction - 0.01) < needed <= rank.offloaded_bytes
    assert pool.placement.ranks[0].offload_fraction == 0


def test_zero3_sub_groups_are_formed_as_upstream_forms_them():
    from deepspeed.runtime.heterogeneous.memory.model_state import zero3_sub_groups
    # World 2: partitions of 10, 3, 8 and 1 elements (odd sizes round up). A sub-group closes once
    # it holds 10 elements or at its parameter group's last parameter.
    assert zero3_sub_groups([[20, 5, 16, 1]], 2, 10) == (10 / 22, 11 / 22, 1 / 22)
    # Per parameter group; a group within sub_group_size is one sub-group; frozen groups vanish.
    assert zero3_sub_groups([[20, 5], [], [16, 1]], 2, 100) == (13 / 22, 9 / 22)
    assert zero3_sub_groups([[4, 4, 4, 4]], 1, 1) == (0.25, 0.25, 0.25, 0.25)
    assert zero3_sub_groups([[]], 2, 10) is None


@pytest.mark.parametrize("sub_groups", range(1, 65))
def test_zero3_offload_ratio_makes_upstream_offload_exactly_that_many_sub_groups(sub_groups):
    from deepspeed.runtime.heterogeneous.memory.spec import zero3_offload_ratio
    for offloaded in range(1, sub_groups + 1):
        ratio = zero3_offload_ratio(offloaded, sub_groups)
        assert 0 < ratio <= 1
        # stage3.py: sub-group i goes to the CPU when i >= int((1 - ratio) * n); ratio 1.0 offloads all
        on_device = int((1 - ratio) * sub_groups)
        assert sub_groups - on_device == offloaded, (offloaded, ratio)


def test_zero3_offloads_the_fewest_whole_sub_groups_that_fit_the_last_first():
    """4e9 parameters, ZeRO-3, bf16 Adam, 2 ranks: rank 1 holds 4 GB of parameters, 4 GB of
    gradients and 24 GB of optimizer state and master copy, 32 GB for a budget of 20 GiB
    (21.47 GB): 10.53 GB must leave the device, 10.53 / 24 = 0.439 of its optimizer state.
    Upstream offloads the last sub-groups first: the last one (0.2: 4.8 GB) is not enough, the
    last two (0.2 + 0.3 = 0.5: 12 GB) are."""
    quarters = (0.4, 0.1, 0.3, 0.2)
    spec = ModelStateSpec(zero_stage=3, sub_groups=quarters, **BF16_4B)
    pool = HeterogeneousMemoryPool([80 * GIB, 20 * GIB], hbm_utilization_threshold=1.0)
    rank = pool.place(spec, zero_partitions="even").ranks[1]
    assert (rank.offload_sub_groups, rank.offload_fraction) == (2, pytest.approx(0.5)) and rank.fits
    # Without known sub-groups the fraction goes in hundredths: 0.44, the first at or above 0.439.
    assert pool.place(ModelStateSpec(zero_stage=3, **BF16_4B),
                      zero_partitions="even").ranks[1].offload_fraction == pytest.approx(0.44)
    # Without DeepSpeedCPUAdam upstream's ratio must be 1: all of it.
    whole = pool.place(ModelStateSpec(zero_stage=3, sub_groups=quarters, partial_offload=False, **BF16_4B),
                       zero_partitions="even").ranks[1]
    assert (whole.offload_fraction, whole.offload_sub_groups) == (1.0, 4)
    with pytest.raises(ValueError, match="sub_groups"):
        ModelStateSpec(zero_stage=3, sub_groups=(0.5, 0.2), **BF16_4B)


def test_the_offloaded_part_follows_upstreams_sub_group_rule():
    from types import SimpleNamespace
    from deepspeed.runtime.heterogeneous.memory.model_state import offloaded_fraction
    from deepspeed.runtime.zero.offload_config import DeepSpeedZeroOffloadOptimizerConfig

    def zero(stage, ratio=None, device="cpu"):
        offload = None if ratio is None else DeepSpeedZeroOffloadOptimizerConfig(device=device, ratio=ratio)
        return SimpleNamespace(stage=stage, offload_optimizer=offload)

    quarters = (0.4, 0.1, 0.3, 0.2)
    assert offloaded_fraction(zero(3)) == 0.0
    assert offloaded_fraction(zero(3, 1.0), quarters) == 1.0
    assert offloaded_fraction(zero(2, 0.3), quarters) == 1.0  # the ratio is ZeRO-3's alone
    assert offloaded_fraction(zero(3, 0.375), quarters) == pytest.approx(0.5)  # int(0.625 * 4) = 2 kept
    assert offloaded_fraction(zero(3, 0.3)) == 0.3  # sub-groups unknown
    assert offloaded_fraction(zero(3, 0.5, device="none")) == 0.0


def test_each_nodes_offload_must_fit_its_host_budget():
    spec = ModelStateSpec(zero_stage=1, **BF16_1B)
    # Even ZeRO-1 shares: 2 + 2 + 3 GB per rank, over an 8 GB device's 6.8 GB budget. Node 0's two
    # small ranks would offload 3 GB each, 6 GB, over its 5 GB host budget; node 1's ranks fit.
    devices = ["8GB", "8GB", "80GB", "80GB"]
    pool = HeterogeneousMemoryPool(devices, cpu_memory_limit="5GB", hosts=["x", "x", "y", "y"])
    with pytest.raises(MemoryPlacementError, match=r"node 0 \(data-parallel ranks \[0, 1\]\).*cpu_memory_limit"):
        pool.place(spec, zero_partitions="even")
    # Host budget enough for one of them: the other goes to NVMe when allowed.
    placement = pool.place(spec, zero_partitions="even", nvme_offload=True)
    assert sorted(r.optimizer_location for r in placement.ranks[:2]) == ["host", "nvme"]
    assert placement.host_bytes(0) <= 5 * 10**9 and placement.host_bytes(1) == 0
    # Another node's budget is its own: 5 GB per node is enough for one offloading rank on each.
    spread = HeterogeneousMemoryPool(devices, cpu_memory_limit="5GB", hosts=["x", "y", "x", "y"])
    assert spread.place(spec, zero_partitions="even").offloaded_ranks == [0, 1]


def test_upstream_offload_puts_every_ranks_optimizer_state_on_the_host():
    spec = ModelStateSpec(zero_stage=2, optimizer_device="cpu", **BF16_1B)
    placement = HeterogeneousMemoryPool(["80GB", "24GB"], cpu_memory_limit="64GB").place(spec, zero_partitions="even")
    assert [r.optimizer_location for r in placement.ranks] == ["host", "host"]
    assert placement.host_bytes(0) == pytest.approx(12 * 10**9)


@pytest.mark.parametrize("stage, devices, named", [
    (0, ["80GB", "12GB"], "ZeRO stage 0 cannot offload"),
    (2, ["80GB", "1GB"], "even with all its optimizer state offloaded"),
])
def test_what_cannot_be_placed_is_an_error_with_the_numbers(stage, devices, named):
    pool = HeterogeneousMemoryPool(devices)
    with pytest.raises(MemoryPlacementError) as error:
        pool.place(ModelStateSpec(zero_stage=stage, **BF16_1B))
    message = str(error.value)
    assert named in message and "data-parallel rank 1 needs" in message and "GiB" in message, message
    assert "hbm_utilization_threshold" in message
    # Not strict (the engine's way, until per-rank offload is applied): recorded, not raised.
    placement = pool.place(ModelStateSpec(zero_stage=stage, **BF16_1B), strict=False)
    assert placement.problems and not placement.ranks[1].fits


# -- the report -------------------------------------------------------------------------------------


def test_report_says_where_each_kind_of_state_lives_and_the_room_left():
    pool = HeterogeneousMemoryPool(["80GB", "24GB"], cpu_memory_limit="64GB", device_names=["H100", "A10"])
    assert "no model placed yet" in str(pool.report())
    assert pool.report().to_dict()["placed"] is False
    pool.place(ModelStateSpec(zero_stage=1, **BF16_4B), zero_partitions=[0.5, 0.5], activation_bytes=[GIB, None])
    text = str(pool.report())
    header = text.splitlines()[1]
    for column in ("rank", "node", "device", "budget", "share", "parameters", "gradients", "optimizer state",
                   "activations", "room left"):
        assert column in header, header
    a10 = next(line for line in text.splitlines() if " A10 " in line)
    assert "host" in a10 and "unmeasured" in a10
    assert "offloaded to the host of 59.6 GiB" in text
    report = pool.report().to_dict()
    json.dumps(report)  # plain data
    first, second = report["ranks"]
    assert first["optimizer_state"]["location"] == "device" and second["optimizer_state"]["location"] == "host"
    assert {first[k]["location"] for k in ("parameters", "gradients", "activations")} == {"device"}
    assert first["activations"]["bytes"] == GIB and second["activations"]["bytes"] is None
    assert first["room_bytes"] == pytest.approx(first["budget_bytes"] - first["device_bytes"])
    assert report["nodes"][0]["offloaded_bytes"] == second["optimizer_state"]["offloaded_bytes"] > 0


# -- the env report -------------------------------------------------------------------------------------


def _settings(config):
    return load_heterogeneous_settings(config)


def test_env_report_placement_follows_the_config_and_the_emulated_capacities():
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 2, "heterogeneous_offload": {"cpu_offload": True}},
              "bf16": {"enabled": True},
              "heterogeneous_config": {"enabled": True, "emulation": {"memory_gb": [80, 24]}},
              "heterogeneous_memory": {"enabled": True, "cpu_memory_limit": "64GB"}}
    # The CPU accelerator's rows: host RAM, shared, but emulated capacities count.
    rows = [(device(0, 80, shared=True), True, False), (device(1, 24, shared=True), True, False)]
    lines = config_placement_lines(config, _settings(config), rows, 10**9)
    assert lines[0].startswith("Memory Placement (1,000,000,000 parameters, fp16/bf16)")
    assert "ZeRO stage 2" in lines[1] and any(line.lstrip().startswith("1 ") for line in lines)
    assert not any("problem" in line for line in lines)
    unknown = config_placement_lines(config, _settings(config), rows)
    assert unknown == ["Memory Placement: unknown: the config gives no model size; add --model-parameters N"]


def test_env_report_prints_the_placement_with_model_parameters(tmp_path, monkeypatch):
    from deepspeed.runtime.heterogeneous.cli import env_report
    config = {"train_batch_size": 8, "zero_optimization": {"stage": 1},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "uniform",
                                       "emulation": {"memory_gb": [2, 1], "mode": "dilation"}},
              "heterogeneous_memory": {"enabled": True}}
    path = tmp_path / "ds_config.json"
    path.write_text(json.dumps(config))
    output = io.StringIO()
    env_report.heterogeneous_report(str(path), file=output, model_parameters=10**7)
    text = output.getvalue()
    assert "Memory Placement (10,000,000 parameters, fp32):" in text and "room left" in text


@pytest.mark.parametrize("text, count", [("125000000", 125_000_000), ("1.3e9", 1_300_000_000), ("350M", 350_000_000),
                                         ("7B", 7_000_000_000), ("125k", 125_000)])
def test_parameter_counts_read_like_model_names(text, count):
    assert parse_parameter_count(text) == count


def test_a_bad_parameter_count_exits_2_naming_it(capsys):
    from deepspeed.runtime.heterogeneous.cli.env_report import main
    assert main(["--model-parameters", "seven"]) == 2
    assert "--model-parameters 'seven'" in capsys.readouterr().err


# -- the engine's pool (two ranks) ------------------------------------------------------------------------

WIDTH = 1024


def _engine_with_pool(rank, world_size):
    import deepspeed
    from deepspeed.profiling.heterogeneous_profiler import HeterogeneousProfiler

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(WIDTH, WIDTH), torch.nn.Linear(WIDTH, 4))
    # Rank 1's emulated memory (accounting only, empty at the start) holds DeepSpeed's buffers (the
    # flat parameters, the reduce bucket, a gradient in flight: ~14 MiB) and about a third of the
    # partitioned ZeRO-2 state (memory_peak).
    config = {"train_batch_size": 8, "optimizer": {"type": "Adam", "params": {"lr": 1e-3, "torch_adam": True}},
              "zero_optimization": {"stage": 2},
              "heterogeneous_config": {"enabled": True, "load_balancing_strategy": "manual",
                                       "micro_batch_sizes": [4, 4],
                                       "emulation": {"memory_gb": [1.0, 0.022], "mode": "dilation"}},
              "heterogeneous_memory": {"enabled": True, "adaptive_chunking": False}}
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    state = engine._config.heterogeneous
    profiler = HeterogeneousProfiler(engine)
    profiler.start_heterogeneous_profile()
    for _ in range(2):
        engine.backward(engine(torch.randn(4, WIDTH)).pow(2).mean())
        engine.step()
    profiler.stop_profile()
    placed = state.memory_pool.placement.ranks[state.dp_rank]
    return {"shares": state.partition_shares, "pool_shares": state.memory_pool.placement.partition_shares,
            "partition": int(engine.optimizer.single_partition_of_fp32_groups[0].numel()),
            "placed_bytes": state.memory_pool.predicted_peak(state.dp_rank).peak_bytes,
            "runtime_state_bytes": engine._heterogeneous_runtime().memory.model_state_bytes(),
            "memory_balance": profiler.get_metrics()["memory_balance"]}


@pytest.mark.multiprocess
def test_the_engine_places_its_state_through_the_pool_and_the_profiler_reads_that_placement():
    from harness import run_subcases
    (first, second), = run_subcases(_engine_with_pool, [{}], world_size=2, timeout=300)
    shares = first["shares"]
    assert shares is not None and shares == first["pool_shares"] == second["shares"], (first, second)
    assert 0.1 < shares[1] < 0.45, shares
    assert second["partition"] < first["partition"]
    # The profiler's per-rank memory (the predicted peak of the rank's own share, plus activations)
    # counts what the pool placed on each rank, not 1/N of the state.
    for result in (first, second):
        assert result["runtime_state_bytes"] == result["placed_bytes"], result
    assert first["placed_bytes"] > second["placed_bytes"]
    assert first["memory_balance"] is not None


def test_a_client_optimizer_zero_offload_would_refuse_is_refused_on_every_rank():
    """Upstream refuses ZeRO-Offload with a client optimizer other than DeepSpeedCPUAdam, on the
    offloading rank alone, while the others go on to a collective and wait: the fork refuses it on
    every rank, whichever rank offloads."""
    from types import SimpleNamespace
    from deepspeed.runtime.heterogeneous.startup import apply_rank_offload

    config = SimpleNamespace(zero_force_ds_cpu_optimizer=True)
    client = torch.optim.Adam(torch.nn.Linear(2, 2).parameters())
    for rank in (0, 1):
        with pytest.raises(ValueError, match=r"rank\(s\) \[1\].*client's optimizer \(Adam\).*zero_force_ds_cpu_optimizer"):
            apply_rank_offload(config, {1: ("cpu", 0.375)}, rank, client)
        # A callable builds its optimizer only inside upstream, on each rank: refused alike.
        with pytest.raises(ValueError, match=r"client's optimizer \(a callable"):
            apply_rank_offload(config, {1: ("nvme", 1.0)}, rank, lambda params: torch.optim.Adam(params))
    apply_rank_offload(config, {}, 0, client)  # nothing offloads: nothing to refuse
