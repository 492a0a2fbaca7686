# SPDX-License-Identifier: Apache-2.0
"""Planning at scale: the memory pool places N ranks in O(N) work, and the
"auto" ZeRO-1/2 offload, which offloads alike ranks by bisection, offloads exactly the ranks the
one-at-a-time loop offloaded; a described cluster of 1,024 ranks of 4 kinds on 128 hosts is planned,
and a plan of 4x the ranks places barely more settings (pure; no wall-clock bound: the time is
``tests/perf/bench_planner.py``'s)."""

import importlib.util
import math
import random
from collections import Counter
from pathlib import Path

import pytest

from deepspeed.runtime.heterogeneous import HeterogeneousMemoryPool, ModelStateSpec
from deepspeed.runtime.heterogeneous.forecast.cluster_plan import plan_cluster
from deepspeed.runtime.heterogeneous.memory.rank_placement import DEVICE, HOST, RankPlacement
from deepspeed.runtime.heterogeneous.memory.spec import offloaded_sub_groups

GIB = 2**30
BF16 = dict(param_bytes=2, optimizer_bytes=8, master_bytes=4)


class OneAtATime(HeterogeneousMemoryPool):
    """The pool as it was: under "auto" ZeRO-1/2 shares, one rank offloads per round."""

    def _next_offloads(self, model_state, over, offloaded, activations):
        budgets = self.budgets
        return [min(over, key=lambda r: (budgets[r], -r))]


def reference_ranks(pool, model_state, shares, offloaded, activations):
    """Each rank placed on its own, as ``_ranks`` did before it placed alike ranks once."""
    world, host_shards = pool.world_size, pool.host_shard_fractions(model_state, shares)
    slack = world * 1e-6 * model_state.device_bytes(world, 1.0) if model_state.zero_stage >= 1 else 0.0
    ranks = []
    for rank, share in enumerate(shares):
        parts = model_state.parts(world, share if model_state.zero_stage >= 1 else None)
        fraction = 1.0 if model_state.optimizer_device else offloaded.get(rank, 0.0)
        peak = None if model_state.allocations is None else model_state.peak(
            share, fraction, activations[rank], pool._baselines[rank], largest_share=max(shares),
            host_shard=host_shards[rank], hosts=len(set(pool.hosts)))
        ranks.append(RankPlacement(
            rank=rank, host=pool.hosts[rank], name=pool.device_names[rank], capacity_bytes=pool.capacities[rank],
            budget_bytes=pool.budgets[rank], share=share,
            parameter_bytes=parts.parameters + model_state.host_shard_bytes(host_shards[rank]),
            gradient_bytes=parts.gradients, optimizer_bytes=parts.optimizer, activation_bytes=activations[rank],
            optimizer_location=HOST if fraction > 0 else DEVICE, offload_fraction=fraction,
            offload_sub_groups=offloaded_sub_groups(model_state.sub_groups, fraction)
            if model_state.zero_stage == 3 else None, slack_bytes=slack, baseline_bytes=pool._baselines[rank],
            predicted_peak_bytes=None if peak is None else peak.peak_bytes,
            peak_phase=None if peak is None else peak.peak_phase))
    return ranks


def spec(stage, parameters, with_buffers):
    if not with_buffers:
        return ModelStateSpec(num_parameters=parameters, zero_stage=stage, **BF16)
    ds = {"train_batch_size": 64, "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {}},
          "zero_optimization": {"stage": stage}}
    return ModelStateSpec.for_config_dict(ds, parameters, True, world=64)


def random_cluster(seed):
    """Runs of alike ranks (kinds of 16-80 GiB, speeds, activations), interleaved, on a few hosts."""
    rng = random.Random(seed)
    kinds = [(rng.choice([16, 24, 24, 32, 40, 80]), rng.choice([1.0, 2.0, 3.0])) for _ in range(rng.randint(2, 4))]
    capacities, speeds, hosts, activations = [], [], [], []
    for host in range(rng.randint(2, 6)):
        memory, speed = rng.choice(kinds)
        for _ in range(rng.randint(1, 8)):
            capacities.append(memory * GIB)
            speeds.append(speed)
            hosts.append(host)
            activations.append(rng.choice([0.0, 0.0, 0.5, 1.0]) * GIB)
    return capacities, speeds, hosts, activations


@pytest.mark.parametrize("seed", range(24))
def test_auto_offload_by_bisection_offloads_the_ranks_one_at_a_time_did(seed):
    capacities, speeds, hosts, activations = random_cluster(seed)
    rng = random.Random(1000 + seed)
    model = spec(rng.choice([1, 2]), rng.choice([4, 7, 13, 20]) * 10**9, with_buffers=seed % 2 == 0)
    placements = []
    for kind in (HeterogeneousMemoryPool, OneAtATime):
        pool = kind(capacities, cpu_memory_limit=None, speeds=speeds, hosts=hosts)
        placements.append(pool.place(model, activation_bytes=activations, strict=False))
    fast, slow = placements
    assert fast == slow
    assert fast.ranks == slow.ranks and fast.partition_shares == slow.partition_shares


@pytest.mark.parametrize("parameters, offloading", [(3.6e9, 5), (4e9, 60)])
def test_many_alike_ranks_that_offload_are_placed_the_same_in_fewer_rounds(parameters, offloading):
    # 60 ranks of 16 GiB and 4 faster ones of 80 GiB, ZeRO-1: a few or all of the small ranks offload.
    capacities = [16 * GIB] * 60 + [80 * GIB] * 4
    speeds = [1.0] * 60 + [4.0] * 4
    model = spec(1, int(parameters), with_buffers=True)
    rounds, placements = [], []
    for kind in (HeterogeneousMemoryPool, OneAtATime):
        pool = kind(capacities, speeds=speeds, hosts=[r // 8 for r in range(64)])
        calls = Counter()
        shares = pool._auto_shares

        def counted(*args, **kwargs):
            calls["shares"] += 1
            return shares(*args, **kwargs)

        pool._auto_shares = counted
        placements.append(pool.place(model, strict=False))
        rounds.append(calls["shares"])
    assert placements[0] == placements[1]
    assert len(placements[0].offloaded_ranks) == offloading and not placements[0].problems
    assert rounds[1] == offloading + 1  # one round per offloading rank, and the last
    # The whole run tried first, then galloping and bisection: logarithmic in the ranks that offload.
    assert rounds[0] <= 2 * math.log2(offloading) + 4
    if offloading == 60:  # the whole run at once
        assert rounds[0] <= 4


@pytest.mark.parametrize("stage, hosts", [(2, 1), (3, 1), (3, 4), (1, 2)])
def test_ranks_placed_alike_once_are_the_ranks_placed_one_by_one(stage, hosts):
    capacities = [24 * GIB] * 6 + [80 * GIB] * 2
    model = spec(stage, 7 * 10**9, with_buffers=True)
    if stage == 3:
        from dataclasses import replace
        model = replace(model, host_shards=True)
    pool = HeterogeneousMemoryPool(capacities, speeds=[1.0] * 6 + [3.0] * 2, hosts=[r % hosts for r in range(8)])
    activations = [GIB] * 4 + [2 * GIB] * 4
    pool.place(model, activation_bytes=activations, strict=False)
    shares = pool._auto_shares(model, {}, activations)
    offloaded = {1: 1.0, 6: 0.5} if stage == 3 else {1: 1.0}
    assert pool._ranks(model, shares, offloaded, activations) == reference_ranks(pool, model, shares, offloaded,
                                                                                 activations)
    over = pool._ranks(model, shares, offloaded, activations, over_only=True)
    assert over == [r.rank for r in reference_ranks(pool, model, shares, offloaded, activations)
                    if not r.fits and r.rank not in offloaded]


def test_predicted_peaks_follow_each_placement():
    model = spec(2, 2 * 10**9, with_buffers=True)
    pool = HeterogeneousMemoryPool([24 * GIB, 80 * GIB], speeds=[1.0, 3.0])
    peaks = []
    for shares in ("even", [0.2, 0.8]):
        placement = pool.place(model, zero_partitions=shares, strict=False)
        largest = max(r.share for r in placement.ranks)
        for placed in placement.ranks:
            expected = model.peak(placed.share, placed.offload_fraction, GIB, largest_share=largest)
            assert pool.predicted_peak(placed.rank, GIB).peak_bytes == expected.peak_bytes
        peaks.append(pool.predicted_peak(1).peak_bytes)
    assert peaks[0] != peaks[1]


def described(hosts_per_kind):
    """bench_planner.py's described cluster (4 kinds, 8 per host, a 7B decoder by numbers) with
    ``hosts_per_kind`` hosts of each kind: the test plans the cluster the benchmark times."""
    path = Path(__file__).resolve().parents[2] / "perf" / "bench_planner.py"
    spec = importlib.util.spec_from_file_location("bench_planner", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    return bench.described_cluster(4 * 8 * hosts_per_kind)


def count_shares(monkeypatch):
    calls = Counter()
    shares = HeterogeneousMemoryPool._auto_shares

    def counted(self, *args, **kwargs):
        calls["shares"] += 1
        return shares(self, *args, **kwargs)

    monkeypatch.setattr(HeterogeneousMemoryPool, "_auto_shares", counted)
    return calls


def test_1024_ranks_of_4_kinds_on_128_hosts_are_planned(monkeypatch):
    calls = count_shares(monkeypatch)
    small = plan_cluster(described(8), largest=False)
    at_256 = calls["shares"]
    calls.clear()
    plan = plan_cluster(described(32))
    fork = plan["fork"]
    assert plan["cluster"]["world_size"] == 1024 and plan["cluster"]["hosts"] == 128
    assert fork["fits"] and len(fork["ranks"]) == 1024
    assert sum(r["micro_batch"] for r in fork["ranks"]) * fork["gradient_accumulation_steps"] == 8 * 1024
    # The 4090s of 24 GB offload under ZeRO-1; the planner picks what is fastest, and the fork is
    # faster than upstream's even split on the same cluster, as on 256 ranks.
    assert plan["speedup"] > 1 and small["speedup"] > 1
    assert fork["zero_stage"] == small["fork"]["zero_stage"]
    # 4x the ranks (4x the ranks that offload): a few more share choices (bisection), not 4x
    # (the largest-model search adds its own placements here).
    assert calls["shares"] < 2 * at_256


def test_plans_of_small_clusters_repeat_and_the_per_plan_pool_is_not_shared_between_clusters():
    first = plan_cluster(described(1), largest=False)
    other = plan_cluster(described(2), largest=False)
    again = plan_cluster(described(1), largest=False)
    assert first == again
    assert other["cluster"]["world_size"] == 64 and len(other["fork"]["ranks"]) == 64
